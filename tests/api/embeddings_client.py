"""Embeddings through the official OpenAI client and Ollama's endpoints,
checked against sentence-transformers' own vectors for the same texts.

Usage: embeddings_client.py NODE_ADDRESS MODEL REFERENCE_JSON
Prints one JSON object for the Rust test to check; exits non-zero on the
first vector that is not the reference's.
"""
import base64
import concurrent.futures
import json
import math
import struct
import sys
import urllib.error
import urllib.request

import openai

address, model, reference_path = sys.argv[1], sys.argv[2], sys.argv[3]
reference = json.load(open(reference_path))
client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0, timeout=120)
out = {"cosines": {}}


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def check(name, got, expected):
    c = cosine(got, expected)
    out["cosines"][name] = c
    if c < 0.999 or len(got) != len(expected):
        print(json.dumps({"failed": name, "cosine": c, "len": len(got)}), file=sys.stderr)
        sys.exit(1)


def post(path, body):
    request = urllib.request.Request(
        f"http://{address}{path}", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


texts, ids, expected = reference["texts"], reference["token_ids"], reference["embeddings"]
fits = [i for i, t in enumerate(ids) if len(t) <= 256]
# The model takes 256 tokens: a longer text is refused by OpenAI's rule
# and cut by Ollama's, as sentence-transformers cuts it (WordPiece splits
# at spaces, so the text three times is its tokens three times).
longest = max(range(len(ids)), key=lambda i: len(ids[i]))
long_text = " ".join([texts[longest]] * 3)
body = ids[longest][1:-1] * 3
assert len(body) + 2 > 256, "the long text is long enough"
long_ids = [ids[longest][0]] + body[:254] + [ids[longest][-1]]

# 1. All the texts that fit in one request, through the client's default
#    (base64) and as floats.
batch = client.embeddings.create(model=model, input=[texts[i] for i in fits])
floats = client.embeddings.create(model=model, input=[texts[i] for i in fits], encoding_format="float")
for item, i in zip(batch.data, fits):
    check(f"openai {i}", item.embedding, expected[i])
out["base64_equals_float"] = [a.embedding == b.embedding for a, b in zip(batch.data, floats.data)]
out["usage"] = batch.usage.model_dump()
out["token_total"] = sum(len(ids[i]) for i in fits)

# 2. Token ids give the text's vector.
by_ids = client.embeddings.create(model=model, input=[ids[i] for i in fits[:3]], encoding_format="float")
out["ids_equal_texts"] = [a.embedding == floats.data[k].embedding for k, a in enumerate(by_ids.data)]
one_id_list = client.embeddings.create(model=model, input=ids[fits[1]], encoding_format="float")
out["one_id_list"] = one_id_list.data[0].embedding == floats.data[1].embedding

# 3. Every text through Ollama's /api/embed (long ones cut) and the legacy
#    /api/embeddings.
status, answer = post("/api/embed", {"model": model, "input": texts})
out["ollama_status"] = status
for i, vector in enumerate(answer["embeddings"]):
    check(f"ollama {i}", vector, expected[i])
out["ollama_prompt_eval_count"] = answer["prompt_eval_count"]
status, cut = post("/api/embed", {"model": model, "input": long_text})
whole_ids = client.embeddings.create(model=model, input=long_ids, encoding_format="float")
out["long_cut_equals_its_first_tokens"] = cut["embeddings"][0] == whole_ids.data[0].embedding
status, legacy = post("/api/embeddings", {"model": model, "prompt": texts[1]})
check("legacy", legacy["embedding"], expected[1])

# 4. Eight at once from eight threads: each the same bits as alone.
def alone(i):
    return client.embeddings.create(model=model, input=texts[i], encoding_format="float").data[0].embedding

with concurrent.futures.ThreadPoolExecutor(8) as pool:
    together = list(pool.map(alone, fits[:8]))
out["concurrent_equal"] = [v == floats.data[k].embedding for k, v in enumerate(together)]

# 5. What is refused.
errors = {}
def refused(name, path, body):
    status, answer = post(path, body)
    errors[name] = {"status": status, "body": answer}

refused("openai_long", "/v1/embeddings", {"model": model, "input": long_text})
refused("ollama_no_truncate", "/api/embed", {"model": model, "input": long_text, "truncate": False})
refused("dimensions", "/v1/embeddings", {"model": model, "input": "a", "dimensions": 10})
refused("empty_list", "/v1/embeddings", {"model": model, "input": []})
refused("bad_id", "/v1/embeddings", {"model": model, "input": [101, 999999]})
refused("chat_on_embedder", "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}]})
refused("unknown_field", "/v1/embeddings", {"model": model, "input": "a", "bogus": True})
status, whole = post("/v1/embeddings", {"model": model, "input": "a", "dimensions": 384})
errors["whole_dimensions"] = {"status": status}
out["errors"] = errors
print(json.dumps(out))
