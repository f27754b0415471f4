#!/usr/bin/env python3
"""Structured output through `ferrum serve` with the official `openai` client over 127.0.0.1, on
the default model (SmolLM2-135M-Instruct) and on Qwen2.5-Coder-0.5B-Instruct. Every JSON reply is
checked by the `jsonschema` package, an independent validator.

Checks, per model: `response_format` json_schema replies validate, streaming and not (the streamed
text equals the plain one), for schemas with enums, numeric bounds, nested objects, arrays with
length bounds, string patterns; `json_object` gives a JSON object; vLLM's `guided_choice`,
`guided_regex`, `guided_json`, `guided_grammar` (Lark) and llama.cpp's `grammar` (GBNF) hold;
`/v1/completions` takes them too; the Responses API's `text.format` json_schema; a required and a
named tool call give arguments valid under the tool's schema (Qwen's `<tool_call>` format, and the
plain JSON form for SmolLM2, whose template has no tools), streamed too; a whole round (the
call, its result, the answer) through the chat endpoint, the Responses API and Anthropic's
Messages API (`anthropic` client), streamed and not; eight concurrent
requests, half constrained, all answer correctly; bad grammars (invalid schema, unsatisfiable
bounds, broken regex, undefined GBNF rule, two constraints at once, a non-object tool schema) get
400 naming the field, and the server keeps serving.

Usage: scripts/structured_output_test.py [path/to/ferrum]   (default: target/debug/ferrum)
FERRUM_ONLY_MODEL=SUBSTRING runs only the model whose label or file contains it (for
FERRUM_SERVER_URL, see openai_client_test.py).
"""
import json
import os
import re
import sys
import threading

import jsonschema
from openai import OpenAI, BadRequestError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import openai_client_test as base  # noqa: E402  (its server start-up and check helpers)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODELS = os.environ.get("FERRUM_MODELS_DIR", os.path.join(ROOT, "models"))
check = base.check
group = base.group

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "role": {"type": "string", "enum": ["engineer", "manager", "designer"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 8},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"], "additionalProperties": False}},
            "shipping": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 16},
                "express": {"type": "boolean"}},
                "required": ["city", "express"], "additionalProperties": False},
        },
        "required": ["id", "items", "shipping"],
        "additionalProperties": False,
    },
    "scores": {
        "type": "array", "minItems": 2, "maxItems": 4,
        "items": {"type": "number", "minimum": 0, "maximum": 10},
    },
}

PROMPTS = {
    "person": "Describe a fictional employee as JSON with name, age and role.",
    "order": "Write an example shop order as JSON: an id, items with sku and qty, shipping.",
    "scores": "Give three review scores out of ten as a JSON list.",
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current local time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"], "additionalProperties": False}}}


def valid(schema, text):
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        print("   invalid:", e.__class__.__name__, str(e).splitlines()[0], repr(text))
        return False


def chat(client, content, max_tokens=160, **kw):
    return client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": content}],
        temperature=0, max_tokens=max_tokens, **kw)


def stream_text(client, content, max_tokens=160, **kw):
    text, finish = "", None
    for ch in client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": content}],
            temperature=0, max_tokens=max_tokens, stream=True, **kw):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
    return text, finish


def streamed_calls(client, content, **kw):
    calls = {}
    for ch in client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": content}],
            temperature=0, max_tokens=160, stream=True, **kw):
        for t in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            c = calls.setdefault(t.index, {"name": "", "arguments": ""})
            c["name"] += (t.function.name or "") if t.function else ""
            c["arguments"] += (t.function.arguments or "") if t.function else ""
    return [calls[i] for i in sorted(calls)]


def run_model(model_file, label):
    only = os.environ.get("FERRUM_ONLY_MODEL", "").lower()
    if only and only not in label.lower() and only not in model_file.lower():
        return
    base.MODEL = os.path.join(MODELS, model_file)
    proc, addr = base.start_server()
    try:
        client = OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0)

        for name, schema in SCHEMAS.items():
            rf = {"type": "json_schema",
                  "json_schema": {"name": name, "schema": schema, "strict": True}}
            with group(f"{label}: json_schema '{name}'"):
                r = chat(client, PROMPTS[name], response_format=rf)
                text = r.choices[0].message.content
                check(r.choices[0].finish_reason == "stop" and valid(schema, text),
                      f"{label}: json_schema '{name}' reply validates: {text!r}")
                s, finish = stream_text(client, PROMPTS[name], response_format=rf)
                check(s == text and finish == "stop",
                      f"{label}: json_schema '{name}' streamed equals the plain reply")

        with group(f"{label}: json_object"):
            r = chat(client, "Reply with a JSON object giving the planet name and number of "
                     "moons of Mars.", max_tokens=200, response_format={"type": "json_object"})
            text = r.choices[0].message.content
            check(r.choices[0].finish_reason == "stop" and isinstance(json.loads(text), dict),
                  f"{label}: json_object reply is a JSON object: {text!r}")

        with group(f"{label}: guided_choice"):
            r = chat(client, "Is 'I loved this film' positive or negative?",
                     extra_body={"guided_choice": ["positive", "negative", "neutral"]})
            check(r.choices[0].message.content in ("positive", "negative", "neutral"),
                  f"{label}: guided_choice: {r.choices[0].message.content!r}")

        with group(f"{label}: guided_regex"):
            rx = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
            r = chat(client, "Write a US phone number.", extra_body={"guided_regex": rx})
            check(re.fullmatch(rx, r.choices[0].message.content),
                  f"{label}: guided_regex: {r.choices[0].message.content!r}")

        with group(f"{label}: grammar (GBNF)"):
            gbnf = 'root ::= "The answer is " digit+ "."\ndigit ::= [0-9]\n'
            r = chat(client, "What is six times seven?", extra_body={"grammar": gbnf})
            check(re.fullmatch(r"The answer is [0-9]+\.", r.choices[0].message.content),
                  f"{label}: grammar (GBNF): {r.choices[0].message.content!r}")

        with group(f"{label}: guided_grammar (Lark)"):
            lark = 'start: "Colour: " COLOUR\nCOLOUR: "red" | "green" | "blue"\n'
            r = chat(client, "Name a colour.", extra_body={"guided_grammar": lark})
            check(r.choices[0].message.content in ("Colour: red", "Colour: green",
                                                   "Colour: blue"),
                  f"{label}: guided_grammar (Lark): {r.choices[0].message.content!r}")

        with group(f"{label}: /v1/completions guided_json"):
            r = client.completions.create(model="default", prompt="A user record in JSON:",
                                          max_tokens=120, temperature=0,
                                          extra_body={"guided_json": SCHEMAS["person"]})
            check(valid(SCHEMAS["person"], r.choices[0].text),
                  f"{label}: /v1/completions guided_json validates: {r.choices[0].text!r}")

        with group(f"{label}: responses text.format json_schema"):
            r = client.responses.create(model="default", input=PROMPTS["person"],
                                        max_output_tokens=120, temperature=0, text={"format": {
                                            "type": "json_schema", "name": "person",
                                            "schema": SCHEMAS["person"], "strict": True}})
            check(valid(SCHEMAS["person"], r.output_text),
                  f"{label}: responses text.format json_schema validates: {r.output_text!r}")

        # Tool calls held to their schema.
        ask = "What will the weather be in Lisbon this week?"
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            kind = choice if isinstance(choice, str) else 'named'
            with group(f"{label}: tool_choice {kind}"):
                r = chat(client, ask, tools=[WEATHER, TIME], tool_choice=choice)
                calls = r.choices[0].message.tool_calls or []
                check(len(calls) >= 1 and calls[0].function.name in ("get_weather", "get_time")
                      and all(valid((WEATHER if c.function.name == "get_weather" else TIME)
                                    ["function"]["parameters"], c.function.arguments)
                              for c in calls)
                      and r.choices[0].finish_reason == "tool_calls",
                      f"{label}: tool_choice {choice if isinstance(choice, str) else 'named'}: "
                      f"arguments validate: "
                      f"{[(c.function.name, c.function.arguments) for c in calls]}")
                if not isinstance(choice, str):
                    check(len(calls) == 1 and calls[0].function.name == "get_weather",
                          f"{label}: named tool_choice gives that function once")
                    s = streamed_calls(client, ask, tools=[WEATHER, TIME], tool_choice=choice)
                    check(len(s) == 1 and s[0]["arguments"] == calls[0].function.arguments,
                          f"{label}: streamed named call equals the plain one")

        # A whole round on this model: the forced call, its result, the answer; then the same
        # through the Responses API and Anthropic's Messages API (streamed and not).
        with group(f"{label}: chat round trip"):
            r = chat(client, ask, tools=[WEATHER], tool_choice="required")
            tc = r.choices[0].message.tool_calls[0]
            history = [{"role": "user", "content": ask},
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"id": tc.id, "type": "function",
                            "function": {"name": tc.function.name,
                                         "arguments": tc.function.arguments}}]},
                       {"role": "tool", "tool_call_id": tc.id,
                        "content": json.dumps({"forecast": "sunny", "high_c": 24})}]
            r = client.chat.completions.create(model="default", messages=history,
                                               tools=[WEATHER], tool_choice="none",
                                               temperature=0, max_tokens=60)
            m = r.choices[0].message
            check(valid(WEATHER["function"]["parameters"], tc.function.arguments)
                  and m.content and not m.tool_calls,
                  f"{label}: round trip (call, result, answer): {m.content!r}")

        rtool = {"type": "function", "name": "get_weather",
                 "parameters": WEATHER["function"]["parameters"]}
        with group(f"{label}: responses"):
            r = client.responses.create(model="default", input=ask, tools=[rtool],
                                        tool_choice="required", max_output_tokens=80,
                                        temperature=0)
            fc = [o for o in r.output if o.type == "function_call"]
            check(len(fc) >= 1 and valid(rtool["parameters"], fc[0].arguments),
                  f"{label}: responses function_call validates: "
                  f"{[(f.name, f.arguments) for f in fc]}")
            events = list(client.responses.create(model="default", input=ask, tools=[rtool],
                                                  tool_choice="required", max_output_tokens=80,
                                                  temperature=0, stream=True))
            done = [e for e in events if e.type == "response.completed"]
            sfc = [o for o in done[0].response.output if o.type == "function_call"] if done else []
            check(len(sfc) >= 1 and sfc[0].arguments == fc[0].arguments,
                  f"{label}: responses streamed function_call equals the plain one")
            r2 = client.responses.create(
                model="default", max_output_tokens=60, temperature=0, tools=[rtool],
                input=[{"role": "user", "content": ask},
                       {"type": "function_call", "call_id": fc[0].call_id,
                        "name": fc[0].name, "arguments": fc[0].arguments},
                       {"type": "function_call_output", "call_id": fc[0].call_id,
                        "output": json.dumps({"forecast": "sunny"})}])
            check(bool(r2.output_text), f"{label}: responses round trip answered: "
                  f"{r2.output_text!r}")

        with group(f"{label}: anthropic"):
            import anthropic
            ac = anthropic.Anthropic(base_url=f"http://{addr}", api_key="unused", max_retries=0)
            # This client version takes no `temperature` argument: sent in the body.
            greedy = {"extra_body": {"temperature": 0}}
            atool = {"name": "get_weather", "description": "Current weather in a city",
                     "input_schema": WEATHER["function"]["parameters"]}
            msg = ac.messages.create(model="default", max_tokens=80,
                                     tools=[atool], tool_choice={"type": "tool",
                                                                 "name": "get_weather"},
                                     messages=[{"role": "user", "content": ask}], **greedy)
            uses = [b for b in msg.content if b.type == "tool_use"]
            check(msg.stop_reason == "tool_use" and len(uses) == 1
                  and valid(atool["input_schema"], json.dumps(uses[0].input)),
                  f"{label}: anthropic tool_use input validates: "
                  f"{[(u.name, u.input) for u in uses]}")
            with ac.messages.stream(model="default", max_tokens=80,
                                    tools=[atool], tool_choice={"type": "tool",
                                                                "name": "get_weather"},
                                    messages=[{"role": "user", "content": ask}], **greedy) as st:
                final = st.get_final_message()
            suses = [b for b in final.content if b.type == "tool_use"]
            check(len(suses) == 1 and suses[0].input == uses[0].input,
                  f"{label}: anthropic streamed tool_use equals the plain one")
            reply = ac.messages.create(
                model="default", max_tokens=60, tools=[atool], tool_choice={"type": "none"},
                messages=[{"role": "user", "content": ask},
                          {"role": "assistant", "content": [
                              {"type": "tool_use", "id": uses[0].id, "name": uses[0].name,
                               "input": uses[0].input}]},
                          {"role": "user", "content": [
                              {"type": "tool_result", "tool_use_id": uses[0].id,
                               "content": "sunny, 24 C"}]}], **greedy)
            text = "".join(b.text for b in reply.content if b.type == "text")
            check(bool(text), f"{label}: anthropic tool_result round trip answered: {text!r}")

        # A batch: eight at once, every other one constrained.
        results = [None] * 8

        def one(i):
            if i % 2 == 0:
                r = chat(client, PROMPTS["person"], response_format={
                    "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["person"]}})
                results[i] = valid(SCHEMAS["person"], r.choices[0].message.content)
            else:
                r = chat(client, "Tell me a short story about a robot.", max_tokens=48)
                results[i] = bool(r.choices[0].message.content)

        with group(f"{label}: 8 concurrent requests"):
            threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            check(all(results),
                  f"{label}: 8 concurrent requests, 4 constrained, all right: {results}")

        bad = [
            ("an invalid schema", "response_format",
             dict(response_format={"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})),
            ("unsatisfiable bounds", "guided_json",
             dict(extra_body={"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}})),
            ("a broken regex", "guided_regex", dict(extra_body={"guided_regex": "(unclosed"})),
            ("an undefined GBNF rule", "grammar", dict(extra_body={"grammar": "root ::= missing"})),
            ("two constraints at once", None,
             dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})),
            ("an unknown response_format type", "response_format",
             dict(response_format={"type": "xml"})),
            ("a tool schema that is not an object", "tools",
             dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}])),
            ("a schema that is not JSON", "guided_json", dict(extra_body={"guided_json": "{nope"})),
        ]
        for what, param, kw in bad:
            with group(f"{label}: {what}"):
                try:
                    chat(client, "hi", **kw)
                    check(False, f"{label}: {what}: accepted")
                except BadRequestError as e:
                    body = e.body or {}
                    check(e.status_code == 400 and (param is None or body.get("param") == param),
                          f"{label}: {what}: 400 ({body.get('message')})")
        with group(f"{label}: still serving"):
            r = chat(client, "Say hi.", max_tokens=8)
            check(r.choices[0].message.content is not None, f"{label}: still serving")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main():
    run_model("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2")
    run_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen2.5")
    print("all structured-output checks passed")


if __name__ == "__main__":
    main()
