#!/usr/bin/env python3
"""Renders the chat-template fixtures of crates/ferrum-server/testdata the way Hugging Face's
`apply_chat_template` does (jinja2's sandbox with transformers' settings: trim_blocks,
lstrip_blocks, loop controls, and its `tojson`, Python's json.dumps with ensure_ascii=False), so
the server's unit tests compare ferrum's rendering of OpenAI-shaped requests with it.

Usage: crates/ferrum-server/testdata/hf_chat_render.py   (needs `jinja2`; rewrites the .txt
fixtures beside it)
"""
import json
import os

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

DATA = os.path.dirname(os.path.abspath(__file__))


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def render(template, **ctx):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    return env.from_string(template).render(**ctx)


# The round trip of crates/ferrum-server/src/chat_request.rs's `round_trip_renders_as_transformers`,
# as HF is given it: the arguments as a dict (the server parses OpenAI's JSON string), the
# system content as a string (the server joins text parts), the assistant content None.
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}]
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": {"unit": "celsius", "city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, cloudy"},
]


def main():
    with open(os.path.join(DATA, "qwen2.5-chat-template.jinja")) as f:
        qwen = f.read()
    out = render(qwen, messages=ROUND_TRIP, tools=WEATHER, add_generation_prompt=True,
                 bos_token="", eos_token="<|im_end|>")
    with open(os.path.join(DATA, "qwen2.5-round-trip.txt"), "w") as f:
        f.write(out)
    print(out)


if __name__ == "__main__":
    main()
