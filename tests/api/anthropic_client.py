"""Drives a tessera node with the official Anthropic Python client.

Usage: anthropic_client.py BASE_URL MODEL PROMPT MAX_TOKENS
Prints one JSON object: what each call returned, for the Rust test to check.
"""
import json
import sys

import anthropic

base_url, model, prompt, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
messages = [{"role": "user", "content": prompt}]
out = {}

done = client.messages.create(model=model, max_tokens=max_tokens, messages=messages, extra_body={"temperature": 0})
out["type"] = done.type
out["text"] = "".join(b.text for b in done.content if b.type == "text")
out["stop_reason"] = done.stop_reason
out["output_tokens"] = done.usage.output_tokens

events, pieces = [], []
with client.messages.stream(
    model=model, max_tokens=max_tokens, messages=messages, extra_body={"temperature": 0}
) as stream:
    for event in stream:
        events.append(event.type)
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            pieces.append(event.delta.text)
    final = stream.get_final_message()
out["stream_text"] = "".join(pieces)
out["stream_events"] = sorted(set(events))
out["stream_stop_reason"] = final.stop_reason

errors = {}
for name, kwargs in {
    "unknown_model": dict(model="no-such-model", max_tokens=4, messages=messages),
    "empty_messages": dict(model=model, max_tokens=4, messages=[]),
}.items():
    try:
        client.messages.create(**kwargs)
        errors[name] = None
    except anthropic.APIStatusError as e:
        errors[name] = {"status": e.status_code, "type": e.body["error"]["type"]}
out["errors"] = errors
print(json.dumps(out))
