#!/usr/bin/env python3
"""Tool calling through `ferrum serve` with the official `openai` Python client, over a real socket
on 127.0.0.1, on Qwen2.5-Coder-0.5B-Instruct (its chat template teaches `<tool_call>` calls).
Run by scripts/test.sh after `cargo test` (which builds the binary); exits non-zero on the first
failed check.

Checks: a named tool_choice and `required` give a call whose arguments parse as JSON with the
schema's required keys (streaming and not, no markup in the streamed content); a full round
trip (call, then an assistant message with `content: null` and `tool_calls`, then the `role:
tool` result) is accepted and answered; `tool_choice: "none"` gives content and no calls;
`parallel_tool_calls: false` gives at most one call; bad tools and tool_choice get 400s.

Usage: scripts/tool_calls_test.py [path/to/ferrum]   (default: target/debug/ferrum)
"""
import json
import os
import sys

from openai import OpenAI, BadRequestError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import openai_client_test as base  # noqa: E402  (its server start-up and check helpers)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
base.MODEL = os.path.join(os.environ.get("FERRUM_MODELS_DIR", os.path.join(ROOT, "models")),
                          "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
check = base.check

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current local time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                   "required": ["timezone"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def args_ok(call, name, required):
    if call.function.name != name:
        return False
    try:
        a = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return False
    return isinstance(a, dict) and all(k in a for k in required)


def streamed(client, **kw):
    content, calls, finish = "", {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            c = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = t.id or c["id"]
            c["name"] += (t.function.name or "") if t.function else ""
            c["arguments"] += (t.function.arguments or "") if t.function else ""
        finish = ch.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def main():
    proc, addr = base.start_server()
    try:
        client = OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0, timeout=600)
        common = dict(model="default", max_tokens=48, temperature=0)

        named = {"type": "function", "function": {"name": "get_weather"}}
        r = client.chat.completions.create(messages=ASK, tools=[WEATHER, TIME],
                                           tool_choice=named, **common)
        m = r.choices[0].message
        check(r.choices[0].finish_reason == "tool_calls" and len(m.tool_calls or []) == 1
              and args_ok(m.tool_calls[0], "get_weather", ["city"]),
              f"named tool_choice gives a get_weather call with valid arguments: {m.tool_calls}")
        check(m.tool_calls[0].id.startswith("call_") and m.tool_calls[0].type == "function",
              "tool call id and type")

        r = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="required",
                                           **common)
        m = r.choices[0].message
        check(m.tool_calls and args_ok(m.tool_calls[0], "get_weather", ["city"]),
              "tool_choice required gives a call with valid arguments")

        content, calls, finish = streamed(client, messages=ASK, tools=[WEATHER, TIME],
                                          tool_choice=named, **common)
        check(finish == "tool_calls" and len(calls) == 1 and calls[0]["name"] == "get_weather"
              and "city" in json.loads(calls[0]["arguments"]) and calls[0]["id"],
              f"streamed named call: {calls}")
        check("<tool_call>" not in content and "get_weather" not in content,
              f"no tool markup in streamed content: {content!r}")

        r = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="none",
                                           **common)
        m = r.choices[0].message
        check(not m.tool_calls and m.content, "tool_choice none: content, no calls")

        r = client.chat.completions.create(
            messages=[{"role": "user", "content": "What time is it in Tokyo and in Paris?"}],
            tools=[TIME], tool_choice="required", parallel_tool_calls=False, **common)
        check(len(r.choices[0].message.tool_calls or []) == 1,
              "parallel_tool_calls false: one call")

        # Round trip: the call, its result, the answer.
        r = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="required",
                                           **common)
        tc = r.choices[0].message.tool_calls[0]
        history = ASK + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": tc.id, "type": "function",
                 "function": {"name": tc.function.name, "arguments": tc.function.arguments}}]},
            {"role": "tool", "tool_call_id": tc.id,
             "content": json.dumps({"temperature": 18, "unit": "celsius", "sky": "cloudy"})},
        ]
        r = client.chat.completions.create(messages=history, tools=[WEATHER], tool_choice="none",
                                           **common)
        check(r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length"),
              f"round trip answered: {r.choices[0].message.content!r}")

        bad = [
            ("tool_choice naming an unknown function",
             dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})),
            ("a tool whose parameters is not an object",
             dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}])),
            ("a tool without a name", dict(tools=[{"type": "function", "function": {}}])),
            ("tool_choice required without tools", dict(tool_choice="required")),
            ("an unknown tool_choice", dict(tools=[WEATHER], tool_choice="sometimes")),
            ("a tool message without tool_call_id",
             dict(messages=ASK + [{"role": "tool", "content": "18C"}])),
        ]
        for what, kw in bad:
            kw = {"messages": ASK, **kw}
            try:
                client.chat.completions.create(**kw, **common)
                check(False, f"{what} is refused")
            except BadRequestError as e:
                check(e.status_code == 400 and e.body and "message" in e.body,
                      f"{what}: 400 ({e.body.get('message', '')[:80]})")
        r = client.chat.completions.create(messages=ASK, max_tokens=4, model="default")
        check(r.choices[0].message.content is not None, "server still serving")
    finally:
        proc.kill()
    print("all tool-calling checks passed")


if __name__ == "__main__":
    main()
