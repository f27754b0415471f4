#!/usr/bin/env python3
"""Tool calling through `ferrum serve` with the official `openai` Python client, over a real socket
on 127.0.0.1, on Qwen2.5-Coder-0.5B-Instruct (its chat template teaches `<tool_call>` calls).
Run by scripts/test.sh after `cargo test` (which builds the binary); exits non-zero on the first
failed check.

Checks: a named tool_choice and `required` give a call whose arguments parse as JSON with the
schema's required keys (streaming and not: the streamed arguments equal the plain reply's, each
streamed call opens with its id, type and name, no markup in the streamed content); with `auto`
the streamed and plain replies agree; a full round trip (call, then an assistant message with
`content: null` and `tool_calls`, then the `role: tool` result) reaches the template as Hugging
Face renders it (seen through /tokenize) and is answered with text; `tool_choice: "none"` gives
content and no calls; `parallel_tool_calls: false` gives at most one call; text content parts
and `chat_template_kwargs` are taken; bad tools, tool_choice and messages get 400s; and
the Responses API (`client.responses.create`): text, streamed events, function calls streamed
and not, a function_call_output round trip, bad inputs; and Anthropic's Messages API with the
`anthropic` client: text, streaming, tool_use forced and streamed, a tool_result round trip,
count_tokens, errors in Anthropic's shape; `/tokenize` and `/detokenize`.

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
group = base.group

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
    """A streamed chat reply: its content, calls and finish reason. Each call must arrive as
    OpenAI sends one: a first delta with its id, type, name and empty arguments, then deltas with
    argument text only."""
    content, calls, finish = "", {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            first = t.index not in calls
            c = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
            if first:
                check(t.id and t.type == "function" and t.function.name
                      and t.function.arguments == "", "streamed call opens with id, type, name")
            else:
                check(t.id is None and t.function.name is None,
                      "streamed call continues with arguments only")
            c["id"] = t.id or c["id"]
            c["name"] += (t.function.name or "") if t.function else ""
            c["arguments"] += (t.function.arguments or "") if t.function else ""
        finish = ch.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def responses_api(client):
    """The Responses API (stateless) with the same client: text, streaming events, tools."""
    kw = dict(model="default", max_output_tokens=32, temperature=0)
    with group("responses: text reply"):
        r = client.responses.create(input="Name three colours.", instructions="Answer briefly.",
                                    **kw)
        check(r.status in ("completed", "incomplete") and r.output_text and r.id.startswith("resp_")
              and r.usage.input_tokens > 0 and r.usage.output_tokens > 0,
              f"responses: text reply {r.output_text!r}")
    with group("responses: streamed events"):
        kinds, text, final = [], "", None
        for ev in client.responses.create(input=[{"role": "user", "content": [
                {"type": "input_text", "text": "Say hello."}]}], stream=True, **kw):
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        check(kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                               "response.incomplete")
              and "response.output_text.delta" in kinds and final is not None
              and final.output_text == text and text,
              f"responses: streamed events end in the full response ({len(kinds)} events)")
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
              "parameters": WEATHER["function"]["parameters"]}]
    with group("responses: function_call item"):
        r = client.responses.create(input="What is the weather in Paris?", tools=tools,
                                    tool_choice="required", **kw)
        calls = [o for o in r.output if o.type == "function_call"]
        check(len(calls) == 1 and calls[0].name == "get_weather"
              and "city" in json.loads(calls[0].arguments) and calls[0].call_id,
              f"responses: function_call item {[(c.name, c.arguments) for c in calls]}")
    with group("responses: round trip with function_call_output"):
        r = client.responses.create(input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id,
             "output": "18C and cloudy"}], tools=tools, tool_choice="none", **kw)
        check(r.output_text, "responses: round trip with function_call_output answered")
    with group("responses: streamed function_call"):
        got = []
        for ev in client.responses.create(input="What is the weather in Paris?", tools=tools,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          stream=True, **kw):
            if ev.type == "response.output_item.done" and ev.item.type == "function_call":
                got.append(ev.item.name)
        check(got == ["get_weather"], f"responses: streamed function_call {got}")
    for what, bad in [("empty input", dict(input=[])),
                      ("previous_response_id", dict(input="x", previous_response_id="resp_1")),
                      ("a non-function tool", dict(input="x", tools=[{"type": "web_search"}]))]:
        with group(f"responses: {what}"):
            try:
                client.responses.create(model="default", max_output_tokens=4, **bad)
                check(False, f"responses: {what} is refused")
            except BadRequestError as e:
                check(e.status_code == 400, f"responses: {what}: 400")


def anthropic_api(addr):
    """Anthropic's Messages API with the official `anthropic` client: text, streaming, tool_use
    (forced and streamed), a tool_result round trip, count_tokens, Anthropic-style 400s."""
    import anthropic
    c = anthropic.Anthropic(base_url=f"http://{addr}", api_key="unused", max_retries=0)
    greedy = {"extra_body": {"temperature": 0}}
    with group("anthropic: text reply"):
        r = c.messages.create(model="default", max_tokens=32, system="Answer briefly.",
                              messages=[{"role": "user", "content": "Name three colours."}],
                              **greedy)
        check(r.type == "message" and r.content[0].type == "text" and r.content[0].text
              and r.stop_reason in ("end_turn", "max_tokens") and r.usage.input_tokens > 0,
              f"anthropic: text reply {r.content[0].text!r}")
    with group("anthropic: streamed text"):
        with c.messages.stream(model="default", max_tokens=24,
                               messages=[{"role": "user", "content": "Say hello."}], **greedy) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        check(text and final.content[0].text == text, "anthropic: streamed text equals the message")
    tools = [{"name": "get_weather", "description": "Weather in a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    with group("anthropic: tool_choice any"):
        r = c.messages.create(model="default", max_tokens=48, tools=tools,
                              tool_choice={"type": "any"}, messages=ask, **greedy)
        uses = [b for b in r.content if b.type == "tool_use"]
        check(r.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
              and "city" in uses[0].input and uses[0].id,
              f"anthropic: tool_choice any gives tool_use {[(u.name, u.input) for u in uses]}")
    with group("anthropic: tool_result round trip"):
        r = c.messages.create(model="default", max_tokens=32, tools=tools, messages=ask + [
            {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id,
                                               "name": "get_weather", "input": uses[0].input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                          "content": "18C, cloudy"},
                                         {"type": "text", "text": "Summarise it."}]}], **greedy)
        check(r.content and r.content[0].type == "text" and r.content[0].text,
              f"anthropic: tool_result round trip answered: {r.content[0].text!r}")
    with group("anthropic: streamed tool_use"):
        with c.messages.stream(model="default", max_tokens=48, tools=tools,
                               tool_choice={"type": "tool", "name": "get_weather"},
                               messages=[{"role": "user", "content": "Weather in Rome?"}],
                               **greedy) as s:
            final = s.get_final_message()
        uses = [b for b in final.content if b.type == "tool_use"]
        check(final.stop_reason == "tool_use" and len(uses) == 1 and "city" in uses[0].input,
              "anthropic: streamed tool_use")
    with group("anthropic: count_tokens"):
        n = c.messages.count_tokens(model="default", messages=ask)
        check(n.input_tokens > 5, f"anthropic: count_tokens {n.input_tokens}")
    for what, kw in [("empty messages", dict(messages=[])),
                     ("tool_choice naming an unknown tool",
                      dict(messages=ask, tools=tools, tool_choice={"type": "tool", "name": "x"}))]:
        with group(f"anthropic: {what}"):
            try:
                c.messages.create(model="default", max_tokens=4, **kw)
                check(False, f"anthropic: {what} is refused")
            except anthropic.BadRequestError as e:
                check(e.status_code == 400 and e.body.get("type") == "error"
                      and e.body["error"]["type"] == "invalid_request_error",
                      f"anthropic: {what}: 400 in Anthropic's error shape")


def post_json(addr, path, body):
    import urllib.error
    import urllib.request
    req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def tokenize_text(addr, body):
    """The prompt the chat endpoint would give the model for `body` (through /tokenize, then
    /detokenize, which leaves out control tokens such as <|im_start|>)."""
    code, t = post_json(addr, "/tokenize", body)
    check(code == 200, f"/tokenize {code}")
    code, d = post_json(addr, "/detokenize", {"tokens": t["tokens"]})
    return d["prompt"]


def tokenize_api(addr):
    """vLLM's /tokenize and /detokenize, with plain HTTP."""
    def post(path, body):
        return post_json(addr, path, body)

    with group("/tokenize prompt"):
        code, t = post("/tokenize", {"prompt": "Hello world"})
        check(code == 200 and t["count"] == len(t["tokens"]) > 0, f"/tokenize prompt: {t}")
    with group("/detokenize round trip"):
        code, d = post("/detokenize", {"tokens": t["tokens"]})
        check(code == 200 and d["prompt"] == "Hello world", "/detokenize round trip")
    with group("/tokenize messages"):
        code, c = post("/tokenize", {"messages": ASK})
        check(code == 200 and c["count"] > t["count"], "/tokenize messages through the template")
    with group("/detokenize of an id outside the vocabulary"):
        code, e = post("/detokenize", {"tokens": [10 ** 9]})
        check(code == 400 and "error" in e, "/detokenize of an id outside the vocabulary: 400")


def main():
    proc, addr = base.start_server()
    try:
        client = OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0, timeout=600)
        common = dict(model="default", max_tokens=48, temperature=0)

        with group("named tool_choice"):
            named = {"type": "function", "function": {"name": "get_weather"}}
            r = client.chat.completions.create(messages=ASK, tools=[WEATHER, TIME],
                                               tool_choice=named, **common)
            m = r.choices[0].message
            check(r.choices[0].finish_reason == "tool_calls" and len(m.tool_calls or []) == 1
                  and args_ok(m.tool_calls[0], "get_weather", ["city"]),
                  f"named tool_choice gives a get_weather call with valid arguments: "
                  f"{m.tool_calls}")
            check(m.tool_calls[0].id.startswith("call_") and m.tool_calls[0].type == "function",
                  "tool call id and type")
            named_args = m.tool_calls[0].function.arguments

        with group("tool_choice required"):
            r = client.chat.completions.create(messages=ASK, tools=[WEATHER],
                                               tool_choice="required", **common)
            m = r.choices[0].message
            check(m.tool_calls and args_ok(m.tool_calls[0], "get_weather", ["city"]),
                  "tool_choice required gives a call with valid arguments")

        with group("streamed named call"):
            content, calls, finish = streamed(client, messages=ASK, tools=[WEATHER, TIME],
                                              tool_choice=named, **common)
            check(finish == "tool_calls" and len(calls) == 1 and calls[0]["name"] == "get_weather"
                  and "city" in json.loads(calls[0]["arguments"]) and calls[0]["id"],
                  f"streamed named call: {calls}")
            check("<tool_call>" not in content and "get_weather" not in content,
                  f"no tool markup in streamed content: {content!r}")
            check(calls[0]["arguments"] == named_args, "streamed arguments equal the plain reply's")

        # auto: the model chooses; streamed and plain replies agree (greedy), markup never in
        # the streamed content.
        with group("auto, streamed and not"):
            r = client.chat.completions.create(messages=ASK, tools=[WEATHER, TIME], **common)
            m = r.choices[0].message
            content, calls, finish = streamed(client, messages=ASK, tools=[WEATHER, TIME],
                                              **common)
            plain = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
            check(finish == r.choices[0].finish_reason and content == (m.content or "")
                  and [(c["name"], c["arguments"]) for c in calls] == plain
                  and "<tool_call>" not in content,
                  f"auto, streamed and not, agree: {finish} {plain} {content!r}")

        with group("tool_choice none"):
            r = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="none",
                                               **common)
            m = r.choices[0].message
            check(not m.tool_calls and m.content, "tool_choice none: content, no calls")

        with group("parallel_tool_calls false"):
            r = client.chat.completions.create(
                messages=[{"role": "user", "content": "What time is it in Tokyo and in Paris?"}],
                tools=[TIME], tool_choice="required", parallel_tool_calls=False, **common)
            check(len(r.choices[0].message.tool_calls or []) == 1,
                  "parallel_tool_calls false: one call")

        # Round trip: the call, its result, the answer. The assistant turn goes back as every
        # client sends it (content null, tool_calls with arguments as a JSON string), the result
        # as a tool message; the template must show the call with its arguments (as an object,
        # in the client's key order) and the result.
        with group("round trip: the history through /tokenize"):
            r = client.chat.completions.create(messages=ASK, tools=[WEATHER],
                                               tool_choice="required", **common)
            tc = r.choices[0].message.tool_calls[0]
            args = json.loads(tc.function.arguments)
            history = ASK + [
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": tc.id, "type": "function",
                     "function": {"name": tc.function.name, "arguments": tc.function.arguments}}]},
                {"role": "tool", "tool_call_id": tc.id,
                 "content": json.dumps({"temperature": 18, "unit": "celsius", "sky": "cloudy"})},
            ]
            prompt = tokenize_text(addr, {"messages": history, "tools": [WEATHER]})
            shown = '<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>' % (
                json.dumps(args))
            check(shown in prompt and "<tool_response>\n{\"temperature\": 18" in prompt
                  and '{"type": "function", "function": {"name": "get_weather"' in prompt,
                  "the history's call, its result and the tools reach the template as HF "
                  "renders them")
        for choice in ("auto", "none"):
            with group(f"round trip ({choice})"):
                r = client.chat.completions.create(messages=history, tools=[WEATHER],
                                                   tool_choice=choice, **common)
                m = r.choices[0].message
                check(m.content and not m.tool_calls
                      and r.choices[0].finish_reason in ("stop", "length"),
                      f"round trip ({choice}) answered with text: {m.content!r}")

        # Content as a list of text parts, and chat_template_kwargs, are taken.
        with group("content parts and chat_template_kwargs"):
            r = client.chat.completions.create(
                messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}],
                extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **common)
            check(r.choices[0].message.content, "content parts and chat_template_kwargs")

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
            ("a tool of another type", dict(tools=[{"type": "web_search"}])),
            ("an unknown message role", dict(messages=[{"role": "robot", "content": "hi"}])),
            ("an image part", dict(messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])),
        ]
        for what, kw in bad:
            with group(what):
                kw = {"messages": ASK, **kw}
                try:
                    client.chat.completions.create(**kw, **common)
                    check(False, f"{what} is refused")
                except BadRequestError as e:
                    check(e.status_code == 400 and e.body and "message" in e.body,
                          f"{what}: 400 ({e.body.get('message', '')[:80]})")
        responses_api(client)
        anthropic_api(addr)
        tokenize_api(addr)
        with group("server still serving"):
            r = client.chat.completions.create(messages=ASK, max_tokens=4, model="default")
            check(r.choices[0].message.content is not None, "server still serving")
    finally:
        proc.kill()
    print("all tool-calling checks passed")


if __name__ == "__main__":
    main()
