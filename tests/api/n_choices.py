"""n answers of one request through the official OpenAI client: Chat
Completions and legacy Completions, whole and streamed.

Usage: n_choices.py BASE_URL MODEL
Prints one JSON object for the Rust test to check.
"""
import json
import sys

import openai

base_url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
messages = [{"role": "user", "content": "Name a colour and say why you like it."}]
sampling = dict(max_tokens=12, temperature=0.9, seed=7)
out = {}

one = client.chat.completions.create(model=model, messages=messages, **sampling)
three = client.chat.completions.create(model=model, messages=messages, n=3, **sampling)
out["chat_one"] = one.choices[0].message.content
out["chat_three"] = [(c.index, c.message.content) for c in three.choices]
out["chat_one_usage"] = one.usage.model_dump()
out["chat_three_usage"] = three.usage.model_dump()

texts = {}
usage = None
stream = client.chat.completions.create(
    model=model, messages=messages, n=3, stream=True, stream_options={"include_usage": True}, **sampling
)
for chunk in stream:
    for choice in chunk.choices:
        texts.setdefault(choice.index, "")
        texts[choice.index] += choice.delta.content or ""
    if chunk.usage is not None:
        usage = chunk.usage.model_dump()
out["chat_stream"] = [[i, texts[i]] for i in sorted(texts)]
out["chat_stream_usage"] = usage

prompts = ["The capital of France is", "Once upon a time"]
legacy = dict(max_tokens=6, temperature=0.9, seed=11)
alone = [client.completions.create(model=model, prompt=p, **legacy).choices[0].text for p in prompts]
both = client.completions.create(model=model, prompt=prompts, n=2, **legacy)
out["completions_alone"] = alone
out["completions_both"] = [(c.index, c.text) for c in both.choices]
pieces = {}
for chunk in client.completions.create(model=model, prompt=prompts[0], n=2, stream=True, **legacy):
    for choice in chunk.choices:
        pieces[choice.index] = pieces.get(choice.index, "") + choice.text
out["completions_stream"] = [[i, pieces[i]] for i in sorted(pieces)]
print(json.dumps(out))
