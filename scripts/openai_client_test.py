#!/usr/bin/env python3
"""Drives `ferrum serve` with the official `openai` Python client (streaming and not, completions and
chat), over a real socket on 127.0.0.1. Run by scripts/test.sh after `cargo test` (which builds the
binary); exits non-zero on the first failed check.

Usage: scripts/openai_client_test.py [path/to/ferrum]   (default: target/debug/ferrum)

For comparisons with other servers (here and in the scripts that import this one):
FERRUM_SERVER_URL=HOST:PORT tests a server that is already running instead of starting
`ferrum serve`; FERRUM_KEEP_GOING=1 prints a failed check as `FAIL: ...` and goes on (an exception
inside a `group` is recorded as that group's failure), then exits 1 if anything failed.
"""
import atexit
import contextlib
import json
import os
import subprocess
import sys
import threading

from openai import OpenAI, BadRequestError

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BIN = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "debug", "ferrum")
MODEL = os.path.join(os.environ.get("FERRUM_MODELS_DIR", os.path.join(ROOT, "models")),
                     "SmolLM2-135M-Instruct.Q4_1.gguf")
SERVER_URL = os.environ.get("FERRUM_SERVER_URL")
KEEP_GOING = os.environ.get("FERRUM_KEEP_GOING") == "1"
PASSED, FAILED = [], []


class _Running:
    """Stands in for the server process when FERRUM_SERVER_URL names one already running."""
    def terminate(self):
        pass

    def kill(self):
        pass

    def wait(self, timeout=None):
        return 0


def start_server():
    if SERVER_URL:
        return _Running(), SERVER_URL.split("://", 1)[-1].rstrip("/")
    p = subprocess.Popen([BIN, "serve", "-m", MODEL, "--port", "0", "-t", "2"],
                         stdout=subprocess.PIPE, text=True)
    addr = []
    ready = threading.Event()

    def read():
        for line in p.stdout:
            if "http://" in line and not addr:
                addr.append(line.split("http://", 1)[1].strip())
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(120):
        p.kill()
        sys.exit("ferrum serve did not print its address")
    return p, addr[0]


def check(cond, what):
    if not cond:
        if not KEEP_GOING:
            raise AssertionError(what)
        FAILED.append(what)
        print("FAIL:", what)
        return
    PASSED.append(what)
    print("ok:", what)


@contextlib.contextmanager
def group(name):
    """A group of checks: with FERRUM_KEEP_GOING=1, an exception inside it (an unexpected 500,
    say) is recorded as `FAIL: name: ...` and the run goes on after it; otherwise it propagates."""
    if not KEEP_GOING:
        yield
        return
    try:
        yield
    except Exception as e:
        FAILED.append(f"{name}: {e}")
        print(f"FAIL: {name}: {type(e).__name__}: {e}")


@atexit.register
def _keep_going_verdict():
    if KEEP_GOING:
        print(f"keep-going: {len(PASSED)} checks ok, {len(FAILED)} failed")
        if FAILED:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


def main():
    proc, addr = start_server()
    try:
        client = OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0, timeout=600)
        models = client.models.list()
        check(len(models.data) == 1 and models.data[0].id, "models.list")

        out = subprocess.run([BIN, "generate", "-m", MODEL, "--temperature", "0", "-n", "24",
                              "--json", "-p", "The capital of France is"],
                             capture_output=True, text=True, check=True).stdout
        want = json.loads(out)["text"]
        r = client.completions.create(model=models.data[0].id, prompt="The capital of France is",
                                      max_tokens=24, temperature=0)
        check(r.choices[0].text == want, "completion equals `ferrum generate`")
        check(r.usage.completion_tokens == 24 and r.usage.prompt_tokens == 5, "completion usage")

        chunks = list(client.completions.create(model="x", prompt="The capital of France is",
                                                max_tokens=24, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        check(text == want, "streamed completion equals the plain one")
        check(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24,
              "streamed usage")

        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model="x", messages=msgs, max_tokens=20, temperature=0)
        reply = r.choices[0].message.content
        check(r.choices[0].message.role == "assistant" and reply, "chat completion")
        stream = client.chat.completions.create(model="x", messages=msgs, max_tokens=20,
                                                temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        check(streamed == reply, "streamed chat equals the plain one")

        # Log-probabilities, through the client's own types.
        r = client.completions.create(model="x", prompt="The capital of France is", max_tokens=6,
                                      temperature=0, logprobs=3)
        lp = r.choices[0].logprobs
        check(len(lp.tokens) == 6 and "".join(lp.tokens) == r.choices[0].text
              and all(x <= 0 for x in lp.token_logprobs)
              and all(len(t) == 3 for t in lp.top_logprobs), "completion logprobs")
        r = client.chat.completions.create(model="x", messages=msgs, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        check(len(content) == 6 and all(len(c.top_logprobs) == 2 and c.logprob <= 0
                                        for c in content), "chat logprobs")
        stream = client.chat.completions.create(model="x", messages=msgs, max_tokens=6,
                                                temperature=0, logprobs=True, stream=True)
        entries = [e for c in stream if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]
        check([e.token for e in entries] == [e.token for e in content], "streamed chat logprobs")

        # n choices, seeded: choice i samples with seed + i.
        r = client.completions.create(model="x", prompt="Once upon a time", max_tokens=12,
                                      temperature=1.0, seed=11, n=3)
        check(sorted(c.index for c in r.choices) == [0, 1, 2]
              and r.usage.completion_tokens == 36, "n=3 choices")
        one = client.completions.create(model="x", prompt="Once upon a time", max_tokens=12,
                                        temperature=1.0, seed=12)
        check(one.choices[0].text == r.choices[1].text, "choice 1 is the seed + 1 answer")

        # Bad requests: the client raises BadRequestError with the server's message.
        for what, kwargs, word in [
            ("max_tokens=0", dict(prompt="hi", max_tokens=0), "max_tokens"),
            ("temperature=5", dict(prompt="hi", temperature=5), "temperature"),
            ("n=0", dict(prompt="hi", n=0), "n must"),
            ("logprobs=99", dict(prompt="hi", logprobs=99), "logprobs"),
            ("a prompt over the context", dict(prompt="word " * 9000, max_tokens=4), "context"),
        ]:
            try:
                client.completions.create(model="x", **kwargs)
                check(False, f"{what} is refused")
            except BadRequestError as e:
                check(e.status_code == 400 and word in str(e), f"{what} -> 400")
        try:
            client.chat.completions.create(model="x", messages=[], max_tokens=4)
            check(False, "empty messages are refused")
        except BadRequestError as e:
            check(e.status_code == 400 and "messages" in str(e), "empty messages -> 400")
    finally:
        proc.terminate()
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
    check(code == 0, "SIGTERM -> exit 0")
    print("openai client: all checks passed")


if __name__ == "__main__":
    main()
