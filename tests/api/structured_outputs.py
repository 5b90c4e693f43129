"""Structured outputs through the official OpenAI client.

Usage: structured_outputs.py BASE_URL MODEL [--only N]
Asks the model for twenty JSON schemas' worth of answers (nested objects,
arrays with minItems, enums, anyOf, string patterns, bounded numbers,
required and optional fields), each through `response_format` with
`strict`, checks every answer with `jsonschema`, sends eight at once (one
batch), and uses `client.beta.chat.completions.parse` with a Pydantic
model; forces tool calls through the OpenAI and Anthropic clients and
checks their arguments. Prints one JSON object for the Rust test to check; exits non-zero on
the first answer that does not validate.
"""
import concurrent.futures
import json
import sys
import time
from pathlib import Path
from typing import List, Literal, Optional

import jsonschema
import openai
import pydantic

base_url, model = sys.argv[1], sys.argv[2]
only = int(sys.argv[sys.argv.index("--only") + 1]) if "--only" in sys.argv else None
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)


# The twenty cases, shared with the engine's test through tensor world 2
# (engine/tests/it/structured.rs): a prompt and its schema each.
with open(Path(__file__).with_name("schemas.json")) as f:
    SCHEMAS = [(case["prompt"], case["schema"]) for case in json.load(f)]
assert len(SCHEMAS) == 20


def ask(index):
    prompt, schema = SCHEMAS[index]
    started = time.monotonic()
    done = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=300,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": f"s{index}", "strict": True, "schema": schema}},
    )
    text = done.choices[0].message.content
    try:
        value = json.loads(text)
        jsonschema.validate(value, schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as error:
        print(f"schema {index} ({prompt}): {type(error).__name__}: {error}\n{text!r}", file=sys.stderr)
        sys.exit(1)
    return {
        "index": index,
        "finish_reason": done.choices[0].finish_reason,
        "tokens": done.usage.completion_tokens,
        "seconds": time.monotonic() - started,
        "text": text,
    }


indices = range(len(SCHEMAS)) if only is None else range(only)
out = {"one_at_a_time": [ask(i) for i in indices]}

# Eight at once: the node's batch runs them side by side, each with its own
# constraint.
with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
    out["eight_at_once"] = list(pool.map(ask, range(12, 20)))


class Step(pydantic.BaseModel):
    explanation: str = pydantic.Field(max_length=60)
    output: str = pydantic.Field(max_length=30)


class MathAnswer(pydantic.BaseModel):
    steps: List[Step] = pydantic.Field(min_length=1, max_length=3)
    final_answer: str = pydantic.Field(max_length=20)
    confidence: Literal["low", "medium", "high"]
    note: Optional[str] = None


parsed = client.beta.chat.completions.parse(
    model=model,
    messages=[{"role": "user", "content": "Solve 8x + 7 = -23 step by step."}],
    response_format=MathAnswer,
    max_tokens=400,
    temperature=0,
)
answer = parsed.choices[0].message.parsed
out["parsed"] = answer.model_dump() if answer is not None else None
out["parsed_type"] = type(answer).__name__

# Forced tool calls: the arguments hold the function's schema.
WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
}
tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city", "parameters": WEATHER}}]
forced = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
    tools=tools,
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
    parallel_tool_calls=False,
    max_tokens=120,
    temperature=0,
)
calls = forced.choices[0].message.tool_calls or []
for call in calls:
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
out["forced_calls"] = [call.function.name for call in calls]
out["forced_finish_reason"] = forced.choices[0].finish_reason

import anthropic

claude = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=300)
message = claude.messages.create(
    model=model,
    max_tokens=120,
    messages=[{"role": "user", "content": "Weather in Rome?"}],
    tools=[{"name": "get_weather", "description": "The weather of a city", "input_schema": WEATHER}],
    tool_choice={"type": "any", "disable_parallel_tool_use": True},
)
uses = [block for block in message.content if block.type == "tool_use"]
for use in uses:
    jsonschema.validate(use.input, WEATHER)
out["anthropic_calls"] = [use.name for use in uses]
out["anthropic_stop_reason"] = message.stop_reason

# What cannot be honoured is a 400 naming the field.
errors = {}
for name, fmt in {
    "unknown_type": {"type": "nonsense"},
    "bad_schema": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}}},
}.items():
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, response_format=fmt
        )
        errors[name] = None
    except openai.BadRequestError as error:
        errors[name] = {"status": error.status_code, "param": error.body.get("param") if isinstance(error.body, dict) else None}
for name, choice in {"bogus_tool_choice": "bogus", "unknown_function": {"type": "function", "function": {"name": "nope"}}}.items():
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, tools=tools, tool_choice=choice
        )
        errors[name] = None
    except openai.BadRequestError as error:
        errors[name] = {"status": error.status_code, "param": error.body.get("param") if isinstance(error.body, dict) else None}
out["errors"] = errors

print(json.dumps(out))
