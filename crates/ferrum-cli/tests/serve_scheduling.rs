//! The engine's scheduling over real sockets, on the real default model:
//!
//! * prefix caching: 16 requests sharing a ~1,000-token system prompt (arriving together, after one
//!   earlier request with it) get the same tokens with the prefix cache on and off, at least 90% of
//!   each prompt is served from the cache, and the hit rate shows in `/metrics`;
//! * preemption: in a KV pool too small for all requests at once, requests are preempted, recomputed
//!   and resumed, and every one still equals `ferrum generate` alone (prefix cache on and off);
//! * priorities: under saturation, priority-0 requests' median time to first token is lower than
//!   that of priority-10 requests submitted at the same time;
//!
//! The speed-ups themselves (time to first token at least 5x lower with the prefix cache, 3x lower
//! at priority 0) vary with the machine's load, so they are measurements, not CI checks: the
//! ignored tests `*_speedup` run the same scenarios and assert them
//! (`cargo test --release -p ferrum-cli --test serve_scheduling -- --ignored`).
//! * robustness: 200 requests mixing valid, malformed, oversized and client-aborted ones; every
//!   valid one completes correctly, the server still answers, KV blocks in use return to zero and
//!   resident memory stays within 10% of its level after warm-up.

mod server;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use serde_json::{json, Value};
use server::*;

/// Sends every body at once (threads released together) as streamed completions; returns
/// (time to first token, text, usage) per body, in order.
fn all_at_once(addr: &str, bodies: Vec<Value>) -> Vec<(f64, String, Value)> {
    let go = Arc::new(Barrier::new(bodies.len()));
    let handles: Vec<_> = bodies
        .into_iter()
        .map(|b| {
            let (addr, go) = (addr.to_string(), Arc::clone(&go));
            std::thread::spawn(move || {
                go.wait();
                stream_timed(&addr, b)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// 16 requests sharing a ~1,000-token system prompt, sent at once to a server with the prefix
/// cache and to one without (each having answered one earlier request with that prompt); checks
/// that both give the same tokens and that the cache served the shared prompt. Returns the median
/// time to first token with and without the cache, and the prompt's length.
fn prefix_cache_scenario() -> (f64, f64, u64) {
    let text = std::fs::read_to_string(shared_dir().join("reference/ppl-text.txt")).unwrap();
    let system: String = text.chars().take(5400).collect();
    let bodies: Vec<Value> = (0..16)
        .map(|i| {
            json!({"prompt": format!("{system}\n\nQuestion {i}: in one sentence, what is item {i}?\nAnswer:"),
                "max_tokens": 8, "temperature": 0, "ignore_eos": true})
        })
        .collect();
    // Both servers first answer one request with the same system prompt (as a server in use has
    // seen it before), then the 16 arrive at once.
    let warm_up = json!({"prompt": format!("{system}\n\nQuestion: what is this text about?\nAnswer:"),
        "max_tokens": 2, "temperature": 0, "ignore_eos": true});
    let run = |extra: &[&str]| {
        let server = Server::start(extra);
        stream_timed(&server.addr, warm_up.clone());
        let out = all_at_once(&server.addr, bodies.clone());
        let m = metrics_when_idle(&server.addr);
        assert_eq!(metric(&m, "ferrum:kv_cache_blocks_used{"), 0.0);
        (out, m)
    };
    let (cached, m_on) = run(&[]);
    let (plain, m_off) = run(&["--no-prefix-cache"]);
    let prompt_tokens = cached[0].2["prompt_tokens"].as_u64().unwrap();
    assert!(
        prompt_tokens >= 1000,
        "the shared prompt is only {prompt_tokens} tokens"
    );
    for (i, (a, b)) in cached.iter().zip(&plain).enumerate() {
        assert_eq!(a.1, b.1, "request {i}: prefix cache on vs off");
        assert_eq!(b.2["prompt_tokens_details"]["cached_tokens"], 0);
    }
    let mut cached_tokens = 0;
    for (i, c) in cached.iter().enumerate() {
        let n = c.2["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        let of = c.2["prompt_tokens"].as_u64().unwrap();
        assert!(
            10 * n >= 9 * of,
            "request {i}: {n} of {of} prompt tokens cached"
        );
        cached_tokens += n;
    }
    let hits = metric(&m_on, "vllm:prefix_cache_hits{");
    let queries = metric(&m_on, "vllm:prefix_cache_queries{");
    assert_eq!(hits, cached_tokens as f64);
    assert!(hits / queries > 0.8, "hit rate {hits}/{queries}");
    assert_eq!(metric(&m_off, "vllm:prefix_cache_hits{"), 0.0);
    let on = median(&mut cached.iter().map(|c| c.0).collect::<Vec<_>>());
    let off = median(&mut plain.iter().map(|c| c.0).collect::<Vec<_>>());
    eprintln!(
        "median time to first token, 16 requests sharing {prompt_tokens} prompt tokens: \
         {on:.3} s with the prefix cache, {off:.3} s without ({:.1}x)",
        off / on
    );
    (on, off, prompt_tokens)
}

#[test]
fn prefix_cache_keeps_the_tokens_and_serves_the_shared_prompt() {
    prefix_cache_scenario();
}

/// A measurement (the ratio varies with the machine's load): run with `--ignored`.
#[test]
#[ignore]
fn prefix_cache_time_to_first_token_speedup() {
    let (on, off, _) = prefix_cache_scenario();
    assert!(
        off >= 5.0 * on,
        "prefix cache: {on:.3} s vs {off:.3} s without"
    );
}

#[test]
fn preempted_requests_resume_with_identical_output() {
    let prompts = reference_prompts();
    let n = 64;
    let want: Vec<String> = prompts.iter().map(|p| generate_text(p, n)).collect();
    // 24 blocks of 16 positions: room for three of these requests (~10 + 64 tokens, 5 blocks)
    // at a time, less once they grow; eight run at once.
    let block = 30 * 2 * 16 * 192 * 2; // SmolLM2: 30 layers, K and V, 16 positions, 192 dims, f16
    let pool = (24 * block).to_string();
    for extra in [&[][..], &["--no-prefix-cache"][..]] {
        let mut args = vec![
            "-c",
            "256",
            "--max-num-seqs",
            "8",
            "--kv-cache-memory",
            &pool,
        ];
        args.extend_from_slice(extra);
        let server = Server::start(&args);
        let bodies = prompts
            .iter()
            .map(|p| json!({"prompt": p, "max_tokens": n, "temperature": 0}))
            .collect();
        let out = all_at_once(&server.addr, bodies);
        for ((p, w), got) in prompts.iter().zip(&want).zip(&out) {
            assert_eq!(&got.1, w, "{extra:?}: prompt {p:?} after preemption");
        }
        let m = metrics_when_idle(&server.addr);
        let preempted = metric(&m, "vllm:num_preemptions{");
        assert!(preempted > 0.0, "{extra:?}: no request was preempted");
        assert_eq!(metric(&m, "ferrum:kv_cache_blocks_used{"), 0.0);
        assert_eq!(metric(&m, "vllm:kv_cache_usage_perc{"), 0.0);
        eprintln!("{extra:?}: {preempted} preemptions");
    }
}

/// 16 requests at once for 4 slots, every fourth at priority 0, the rest at priority 10; checks
/// that each completes. Returns the median time to first token at priority 0 and at priority 10.
fn priority_scenario() -> (f64, f64) {
    let server = Server::start(&["--max-num-seqs", "4"]);
    let bodies: Vec<Value> = (0..16)
        .map(|i| {
            json!({"prompt": format!("Request {i}. Write a short story about a lighthouse keeper."),
                "max_tokens": 32, "temperature": 0, "ignore_eos": true,
                "priority": if i % 4 == 3 { 0 } else { 10 }})
        })
        .collect();
    let out = all_at_once(&server.addr, bodies);
    let (mut high, mut low): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
    for (i, o) in out.iter().enumerate() {
        assert_eq!(o.2["completion_tokens"], 32);
        if i % 4 == 3 {
            high.push(o.0);
        } else {
            low.push(o.0);
        }
    }
    let (h, l) = (median(&mut high), median(&mut low));
    eprintln!(
        "median time to first token: priority 0 {h:.3} s, priority 10 {l:.3} s ({:.1}x)",
        l / h
    );
    (h, l)
}

#[test]
fn priority_zero_starts_sooner_under_saturation() {
    let (h, l) = priority_scenario();
    assert!(l > h, "priority 0: {h:.3} s, priority 10: {l:.3} s");
}

/// A measurement (the ratio varies with the machine's load): run with `--ignored`.
#[test]
#[ignore]
fn priority_zero_time_to_first_token_speedup() {
    let (h, l) = priority_scenario();
    assert!(l >= 3.0 * h, "priority 0: {h:.3} s, priority 10: {l:.3} s");
}

/// Sends a streamed completion, reads until its first token, then hangs up.
fn abandon_after_first_token(addr: &str) {
    let body = json!({"prompt": "Tell me a very long story.", "max_tokens": 200,
        "stream": true, "ignore_eos": true})
    .to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    for line in BufReader::new(&s).lines() {
        if line.unwrap().starts_with("data: {") {
            break;
        }
    }
    let _ = s.shutdown(std::net::Shutdown::Both);
}

#[test]
fn two_hundred_mixed_requests_lose_nothing_and_leak_nothing() {
    let server = Server::start(&["-c", "512", "--max-num-seqs", "8"]);
    let addr = server.addr.clone();
    let prompts = [
        "The capital of France is",
        "def add(a, b):",
        "Once upon a time, there was a",
        "The three primary colors are",
    ];
    let complete_text = |p: &str| -> String {
        let body = json!({"prompt": p, "max_tokens": 12, "temperature": 0}).to_string();
        let (s, b) = http(&addr, "POST", "/v1/completions", &body);
        assert_eq!(s, 200, "{b}");
        json_body(s, &b)["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_string()
    };
    // Warm-up: each kind of request once, alone; the valid answers become the expected ones.
    let want: Vec<String> = prompts.iter().map(|p| complete_text(p)).collect();
    abandon_after_first_token(&addr);
    let long = "word ".repeat(2000);
    let bad_bodies: Vec<String> = vec![
        "{not json".into(),
        r#"{"prompt": 7}"#.into(),
        r#"{"prompt": "hi", "max_tokens": -3}"#.into(),
        r#"{"prompt": "hi", "temperature": "hot"}"#.into(),
        r#"{"prompt": "hi", "stop": [1, 2]}"#.into(),
        "\u{0}\u{1}garbage".into(),
    ];
    let oversized: Vec<String> = vec![
        json!({"prompt": long, "max_tokens": 4}).to_string(),
        json!({"prompt": "hi", "max_tokens": 100000}).to_string(),
    ];
    for b in bad_bodies.iter().chain(&oversized) {
        assert_eq!(http(&addr, "POST", "/v1/completions", b).0, 400, "{b}");
    }
    let m_warm = metrics_when_idle(&addr);
    let rss_warm = rss_kib(server.child.id());

    let next = Arc::new(AtomicUsize::new(0));
    let valid_done = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..12)
        .map(|_| {
            let (addr, next, valid_done) = (addr.clone(), next.clone(), valid_done.clone());
            let (want, bad, big) = (want.clone(), bad_bodies.clone(), oversized.clone());
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= 200 {
                    return;
                }
                match i % 5 {
                    0 | 1 => {
                        let k = (i / 5) % prompts.len();
                        let body = json!({"prompt": prompts[k], "max_tokens": 12,
                            "temperature": 0})
                        .to_string();
                        let (s, b) = http(&addr, "POST", "/v1/completions", &body);
                        assert_eq!(s, 200, "request {i}: {b}");
                        let got = json_body(s, &b)["choices"][0]["text"]
                            .as_str()
                            .unwrap()
                            .to_string();
                        assert_eq!(got, want[k], "request {i}: prompt {:?}", prompts[k]);
                        valid_done.fetch_add(1, Ordering::SeqCst);
                    }
                    2 => {
                        let b = &bad[(i / 5) % bad.len()];
                        assert_eq!(http(&addr, "POST", "/v1/completions", b).0, 400, "{b}");
                    }
                    3 => {
                        let b = &big[(i / 5) % big.len()];
                        assert_eq!(http(&addr, "POST", "/v1/completions", b).0, 400);
                    }
                    _ => abandon_after_first_token(&addr),
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a client thread");
    }
    assert_eq!(valid_done.load(Ordering::SeqCst), 80);
    let (s, _) = http(&addr, "GET", "/health", "");
    assert_eq!(s, 200, "the server still answers");
    // Every valid request was answered and every abandoned one dropped: nothing runs, nothing
    // waits, no block is held.
    let m = metrics_when_idle(&addr);
    assert_eq!(metric(&m, "vllm:num_requests_running{"), 0.0);
    assert_eq!(metric(&m, "vllm:num_requests_waiting{"), 0.0);
    assert_eq!(metric(&m, "ferrum:kv_cache_blocks_used{"), 0.0);
    // And the server still gives the same answers.
    for (p, w) in prompts.iter().zip(&want) {
        assert_eq!(&complete_text(p), w);
    }
    let rss_after = rss_kib(server.child.id());
    // The KV pool's pages are committed as blocks are first used: growth by the blocks the load
    // touched for the first time is the pool filling, not a leak. Anything beyond is.
    let m_after = metrics_when_idle(&addr);
    let block_kib = metric(&m, "ferrum:kv_cache_reserved_bytes{")
        / (metric(&m, "ferrum:kv_cache_blocks_used{") + metric(&m, "ferrum:kv_cache_blocks_free{"))
        / 1024.0;
    let new_blocks = metric(&m_after, "ferrum:kv_cache_blocks_committed{")
        - metric(&m_warm, "ferrum:kv_cache_blocks_committed{");
    let kv_kib = new_blocks * block_kib;
    eprintln!(
        "resident memory: {rss_warm} KiB after warm-up, {rss_after} KiB after 200 requests, \
         of which {kv_kib:.0} KiB for {new_blocks} KV blocks used for the first time"
    );
    assert!(
        (rss_after as f64) <= 1.1 * rss_warm as f64 + kv_kib,
        "memory grew from {rss_warm} KiB to {rss_after} KiB ({kv_kib:.0} KiB of it new KV blocks)"
    );
}
