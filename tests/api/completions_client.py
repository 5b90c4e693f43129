"""The legacy Completions endpoint through the official OpenAI client.

Usage: completions_client.py BASE_URL MODEL PROMPT
Prints one JSON object for the Rust test to check.
"""
import json
import sys

import openai

base_url, model, prompt = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
out = {}

done = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
choice = done.choices[0]
out["text"] = choice.text
out["finish_reason"] = choice.finish_reason
out["object"] = done.object
out["logprob_tokens"] = len(choice.logprobs.tokens)
out["top_per_token"] = [len(t) for t in choice.logprobs.top_logprobs]
out["usage"] = done.usage.model_dump()

pieces = []
for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True):
    pieces.extend(c.text for c in chunk.choices)
out["stream_text"] = "".join(pieces)

many = client.completions.create(model=model, prompt=[prompt, "Once upon a time"], max_tokens=4, temperature=0)
out["many"] = [(c.index, c.text) for c in many.choices]
echo = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True)
out["echo"] = echo.choices[0].text
ids = client.completions.create(model=model, prompt=[504, 2444, 3465], max_tokens=4, temperature=0)
out["ids_usage"] = ids.usage.prompt_tokens

errors = {}
for name, extra in {"n": {"n": 17}, "suffix": {"suffix": "x"}, "best_of": {"best_of": 2}}.items():
    try:
        client.completions.create(model=model, prompt=prompt, max_tokens=2, **extra)
        errors[name] = None
    except openai.BadRequestError as error:
        errors[name] = error.status_code
out["errors"] = errors
print(json.dumps(out))
