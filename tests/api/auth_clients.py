"""The official OpenAI and Anthropic clients against a node that needs an
API key: a wrong or missing key raises each client's own authentication
error (a 401 in its dialect's shape); the right key answers.

Usage: auth_clients.py BASE_URL MODEL KEY
Prints one JSON object for the Rust test to check.
"""
import json
import sys

import anthropic
import openai

base_url, model, key = sys.argv[1], sys.argv[2], sys.argv[3]
messages = [{"role": "user", "content": "Say hi."}]
out = {}


# A missing key: the clients refuse to start without one, so they get one
# and the request leaves its header out (each SDK's `omit`).
def openai_call(api_key):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key or "unsent", max_retries=0, timeout=120)
    headers = {} if api_key else {"Authorization": openai.omit}
    done = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, extra_headers=headers
    )
    return done.choices[0].message.content


def anthropic_call(api_key):
    client = anthropic.Anthropic(base_url=base_url, api_key=api_key or "unsent", max_retries=0, timeout=120)
    headers = {} if api_key else {"X-Api-Key": anthropic.omit}
    done = client.messages.create(model=model, max_tokens=4, messages=messages, extra_headers=headers)
    return "".join(b.text for b in done.content if b.type == "text")


for dialect, call, refusal in [
    ("openai", openai_call, openai.AuthenticationError),
    ("anthropic", anthropic_call, anthropic.AuthenticationError),
]:
    for case, api_key in [("wrong", key + "x"), ("missing", "")]:
        try:
            call(api_key)
            out[f"{dialect}_{case}"] = "answered"
        except refusal as error:
            out[f"{dialect}_{case}"] = {"status": error.status_code, "message": str(error)}
        except Exception as error:  # any other error type is a failure too
            out[f"{dialect}_{case}"] = {"other": type(error).__name__, "message": str(error)}
    out[f"{dialect}_right"] = call(key)

print(json.dumps(out))
