"""Drives a tessera node with the official OpenAI Python client.

Usage: openai_client.py BASE_URL MODEL PROMPT MAX_TOKENS
Prints one JSON object: what each call returned, for the Rust test to check.
"""
import json
import sys

import openai

base_url, model, prompt, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
messages = [{"role": "user", "content": prompt}]
out = {}

# Non-streaming, greedy.
done = client.chat.completions.create(
    model=model, messages=messages, max_tokens=max_tokens, temperature=0
)
out["text"] = done.choices[0].message.content
out["finish_reason"] = done.choices[0].finish_reason
out["usage"] = done.usage.model_dump()
out["object"] = done.object

# Streaming, with usage in the final chunk.
pieces, finish, usage, roles = [], None, None, []
stream = client.chat.completions.create(
    model=model,
    messages=messages,
    max_tokens=max_tokens,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage.model_dump()
    for choice in chunk.choices:
        if choice.delta.role:
            roles.append(choice.delta.role)
        if choice.delta.content:
            pieces.append(choice.delta.content)
        if choice.finish_reason:
            finish = choice.finish_reason
out["stream_text"] = "".join(pieces)
out["stream_finish_reason"] = finish
out["stream_usage"] = usage
out["stream_roles"] = roles

# Logprobs.
lp = client.chat.completions.create(
    model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
)
out["logprobs"] = [
    {"logprob": t.logprob, "top": len(t.top_logprobs)} for t in lp.choices[0].logprobs.content
]

# Errors come back as the client's own exceptions.
errors = {}
cases = {
    "unknown_model": dict(model="no-such-model", messages=messages),
    "empty_messages": dict(model=model, messages=[]),
    "max_tokens_beyond_context": dict(model=model, messages=messages, max_tokens=10_000_000),
    "bad_temperature": dict(model=model, messages=messages, temperature=9),
}
for name, kwargs in cases.items():
    try:
        client.chat.completions.create(**kwargs)
        errors[name] = None
    except openai.APIStatusError as e:
        errors[name] = {"status": e.status_code, "message": e.message}
out["errors"] = errors

# The Responses API, whole and streamed.
resp = client.responses.create(
    model=model, input=prompt, max_output_tokens=max_tokens, temperature=0
)
out["responses_text"] = resp.output_text
out["responses_status"] = resp.status
pieces, kinds = [], set()
for event in client.responses.create(
    model=model, input=prompt, max_output_tokens=max_tokens, temperature=0, stream=True
):
    kinds.add(event.type)
    if event.type == "response.output_text.delta":
        pieces.append(event.delta)
out["responses_stream_text"] = "".join(pieces)
out["responses_events"] = sorted(kinds)

# A tool call: the conversation shows the model how, and the client gets
# it back as tool_calls with JSON arguments.
weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
example = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
conversation = [
    {"role": "system", "content": 'You call tools by writing <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>.'},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": example},
    {"role": "user", "content": "Weather in Paris?"},
]
called = client.chat.completions.create(
    model=model, messages=conversation, tools=[weather], temperature=0, max_tokens=40
)
choice = called.choices[0]
out["tool_finish_reason"] = choice.finish_reason
out["tool_calls"] = [
    {"name": c.function.name, "arguments": json.loads(c.function.arguments), "id": c.id}
    for c in (choice.message.tool_calls or [])
]
streamed_calls = []
for chunk in client.chat.completions.create(
    model=model, messages=conversation, tools=[weather], temperature=0, max_tokens=40, stream=True
):
    for c in chunk.choices:
        for call in c.delta.tool_calls or []:
            streamed_calls.append({"name": call.function.name, "arguments": json.loads(call.function.arguments)})
out["stream_tool_calls"] = streamed_calls

# The model list.
out["models"] = [m.id for m in client.models.list()]

print(json.dumps(out))
