//! End-to-end tests of the `ferrum` binary: error handling on bad input, `generate` (streamed,
//! JSON, teacher forcing, sampling flags), `info`, `chat`, `perplexity` and `--help`.
//!
//! The real models are used (the dev profile is optimised); they live in `$FERRUM_MODELS_DIR` or
//! `<workspace>/models` and are fetched by `python3 scripts/fetch_models.py`. A missing model
//! fails the tests that need it. Every child process runs under a deadline and is killed when it
//! passes it, so a hang fails the test instead of wedging the run.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use ferrum_gguf::{str_array, DType, GgufWriter, Value, ValueType};
use serde_json::Value as Json;

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";

/// Deadline for commands that fail before running a model.
const QUICK: Duration = Duration::from_secs(30);
/// Deadline for commands that load and run a model (normally a second or two).
const MODEL_RUN: Duration = Duration::from_secs(120);

/// " Paris" in SmolLM2's vocabulary.
const PARIS: u64 = 7042;
const FRANCE_PROMPT: &str = "The capital of France is";

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

fn models_dir() -> PathBuf {
    std::env::var_os("FERRUM_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models"))
}

/// The path of a model file; panics (fails the test) with the fetch hint if it is missing.
fn model(name: &str) -> PathBuf {
    let p = models_dir().join(name);
    assert!(
        p.is_file(),
        "model {} is missing: run `python3 scripts/fetch_models.py` (or set FERRUM_MODELS_DIR)",
        p.display()
    );
    p
}

fn smollm2() -> String {
    model(SMOLLM2).to_string_lossy().into_owned()
}

fn gemma3() -> String {
    model(GEMMA3).to_string_lossy().into_owned()
}

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "ferrum-cli-test-{}-{tag}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    fn write(&self, name: &str, bytes: &[u8]) -> String {
        let p = self.path(name);
        std::fs::write(&p, bytes).expect("write temp file");
        p.to_string_lossy().into_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Output {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    /// The command line, for failure messages.
    cmd: String,
}

impl Output {
    fn describe(&self) -> String {
        format!(
            "`{}` exited with {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.cmd, self.status, self.stdout, self.stderr
        )
    }

    /// Asserts a zero exit and no panic; returns self for chaining.
    fn ok(self) -> Output {
        assert!(
            self.status.success(),
            "expected success: {}",
            self.describe()
        );
        assert!(!self.stderr.contains("panicked"), "{}", self.describe());
        self
    }

    /// The single JSON object printed by `generate --json`.
    fn json(&self) -> Json {
        let lines: Vec<&str> = self.stdout.lines().filter(|l| !l.is_empty()).collect();
        assert_eq!(
            lines.len(),
            1,
            "expected exactly one JSON line: {}",
            self.describe()
        );
        let v: Json = serde_json::from_str(lines[0])
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", self.describe()));
        assert!(v.is_object(), "expected a JSON object: {}", self.describe());
        v
    }
}

/// Runs the `ferrum` binary with `args`, feeding `stdin` (or nothing: stdin is closed), and kills
/// it if it is still running after `timeout`, failing the test.
fn ferrum_with(
    args: &[&str],
    stdin: Option<&str>,
    timeout: Duration,
    envs: &[(&str, &str)],
) -> Output {
    let cmd_line = format!("ferrum {}", args.join(" "));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrum"));
    cmd.args(args)
        .env_remove("FERRUM_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn the ferrum binary");

    // Feed stdin and drain both pipes on their own threads so a full pipe never blocks the child.
    let mut child_stdin = child.stdin.take().expect("stdin piped");
    let input = stdin.unwrap_or("").to_string();
    let writer = std::thread::spawn(move || {
        let _ = child_stdin.write_all(input.as_bytes());
        // Dropping child_stdin closes the pipe: the child sees end of input.
    });
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    };
    let out_thread = drain(Box::new(child.stdout.take().expect("stdout piped")));
    let err_thread = drain(Box::new(child.stderr.take().expect("stderr piped")));

    let start = Instant::now();
    let status = loop {
        match child.try_wait().expect("wait for ferrum") {
            Some(status) => break status,
            None if start.elapsed() > timeout => {
                let _ = child.kill();
                let _ = child.wait();
                let stderr = err_thread.join().unwrap_or_default();
                panic!(
                    "`{cmd_line}` did not finish within {timeout:?}; killed it. stderr:\n{}",
                    String::from_utf8_lossy(&stderr)
                );
            }
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    let _ = writer.join();
    let stdout = out_thread.join().expect("stdout reader");
    let stderr = err_thread.join().expect("stderr reader");
    Output {
        status,
        stdout: String::from_utf8(stdout).expect("stdout is UTF-8"),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
        cmd: cmd_line,
    }
}

fn ferrum(args: &[&str], timeout: Duration) -> Output {
    ferrum_with(args, None, timeout, &[])
}

/// Asserts that the command failed cleanly: a non-zero exit code (not a signal), no panic, and
/// stderr holding exactly one line that starts with `error:` and contains every string in
/// `mentions` (case-insensitively). Returns that line.
fn assert_clean_error(out: &Output, mentions: &[&str]) -> String {
    assert!(
        !out.status.success(),
        "expected failure: {}",
        out.describe()
    );
    assert!(
        out.status.code().is_some_and(|c| c != 0),
        "expected a non-zero exit code (not a signal): {}",
        out.describe()
    );
    assert!(
        !out.stderr.contains("panicked") && !out.stderr.contains("RUST_BACKTRACE"),
        "the binary panicked: {}",
        out.describe()
    );
    let lines: Vec<&str> = out.stderr.trim_end().lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "expected exactly one line on stderr: {}",
        out.describe()
    );
    let line = lines[0];
    assert!(
        line.starts_with("error: "),
        "stderr does not start with `error: `: {}",
        out.describe()
    );
    let lower = line.to_lowercase();
    for m in mentions {
        assert!(
            lower.contains(&m.to_lowercase()),
            "error line does not mention {m:?}: {}",
            out.describe()
        );
    }
    line.to_string()
}

fn as_ids(v: &Json) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("expected an array of ids, got {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap_or_else(|| panic!("not an id: {x}")))
        .collect()
}

/// Minimal GPT-2-style tokenizer metadata (two tokens, no merges).
fn with_tiny_tokenizer(w: GgufWriter) -> GgufWriter {
    w.kv("tokenizer.ggml.model", Value::String("gpt2".into()))
        .kv("tokenizer.ggml.tokens", str_array(&["a", "b"]))
        .kv(
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(1)]),
        )
        .kv("tokenizer.ggml.merges", str_array::<&str>(&[]))
}

/// Some English prose for perplexity: the start of the shared reference text if it can be found
/// ($FERRUM_SHARED_DIR or `<workspace>/../shared`), else a built-in paragraph.
fn prose(max_bytes: usize) -> String {
    let shared = std::env::var_os("FERRUM_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    let text = std::fs::read_to_string(shared.join("reference/ppl-text.txt"))
        .unwrap_or_else(|_| BUILTIN_PROSE.repeat(4));
    // Cut at the last whitespace at or before max_bytes (never inside a character).
    let mut end = text.len().min(max_bytes);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let cut = text[..end]
        .rfind(char::is_whitespace)
        .filter(|&i| i > 0)
        .unwrap_or(end);
    text[..cut].to_string()
}

const BUILTIN_PROSE: &str = "The river starts high in the hills, where snow melts slowly through \
the spring and feeds a hundred small streams. By the time it reaches the valley it is wide and \
brown, carrying soil from the fields and branches from the forests upstream. Farmers have lived \
along its banks for centuries, planting wheat and barley in the rich ground that the floods leave \
behind each year. In the town at the bend of the river there is a stone bridge with seven arches, \
built by masons whose names nobody remembers. Children fish from it in the summer, and in the \
winter the old men stand on it and argue about the weather. The market is held on the square \
beside the church every Saturday morning, and people come from the villages to sell eggs, cheese, \
honey and vegetables. ";

// ---------------------------------------------------------------------------------------------
// 1. Bad input fails cleanly
// ---------------------------------------------------------------------------------------------

#[test]
fn missing_model_file_is_a_clean_error() {
    let dir = TempDir::new("missing");
    let missing = dir.path("no-such-model.gguf");
    let missing = missing.to_str().unwrap();
    let out = ferrum(&["generate", "-m", missing, "-p", "hi", "-n", "2"], QUICK);
    assert_clean_error(&out, &["no-such-model.gguf"]);
    let out = ferrum(&["info", missing], QUICK);
    assert_clean_error(&out, &["no-such-model.gguf"]);
    let out = ferrum(&["chat", "-m", missing], QUICK);
    assert_clean_error(&out, &["no-such-model.gguf"]);

    // No --model and no default model: the message says how to fetch it.
    let empty = dir.0.to_str().unwrap();
    let out = ferrum_with(
        &["generate", "-p", "hi", "-n", "2"],
        None,
        QUICK,
        &[("FERRUM_MODELS_DIR", empty)],
    );
    assert_clean_error(&out, &["fetch_models.py"]);
}

#[test]
fn directory_that_is_not_a_model_is_a_clean_error() {
    let dir = TempDir::new("notmodel");
    dir.write("readme.txt", b"nothing to see here\n");
    let d = dir.0.to_str().unwrap();
    let out = ferrum(&["generate", "-m", d, "-p", "hi", "-n", "2"], QUICK);
    assert_clean_error(&out, &[]);
    let out = ferrum(&["info", d], QUICK);
    assert_clean_error(&out, &["directory"]);
}

#[test]
fn text_file_named_gguf_is_not_a_gguf_file() {
    let dir = TempDir::new("textgguf");
    let p = dir.write("model.gguf", b"hello, I am just a text file\n");
    let out = ferrum(&["generate", "-m", &p, "-p", "hi", "-n", "2"], QUICK);
    assert_clean_error(&out, &["not a GGUF file"]);
    let out = ferrum(&["info", &p], QUICK);
    assert_clean_error(&out, &["not a GGUF file"]);
    let out = ferrum(&["perplexity", "-m", &p, "-f", &p], QUICK);
    assert_clean_error(&out, &["not a GGUF file"]);
}

#[test]
fn truncated_model_is_a_clean_error() {
    let bytes = std::fs::read(model(SMOLLM2)).expect("read SmolLM2");
    let dir = TempDir::new("truncated");
    for (name, len) in [("first-1mb.gguf", 1 << 20), ("first-10b.gguf", 10)] {
        let p = dir.write(name, &bytes[..len]);
        let out = ferrum(&["generate", "-m", &p, "-p", "hi", "-n", "2"], QUICK);
        assert_clean_error(&out, &[name]);
        let out = ferrum(&["info", &p], QUICK);
        assert_clean_error(&out, &[]);
    }
    // Header and metadata intact, tensor data cut short.
    let data_start = bytes.len() - (bytes.len() / 2);
    let p = dir.write("half.gguf", &bytes[..data_start]);
    let out = ferrum(&["generate", "-m", &p, "-p", "hi", "-n", "2"], QUICK);
    assert_clean_error(&out, &["half.gguf"]);
}

#[test]
fn unknown_architecture_is_a_clean_error() {
    let dir = TempDir::new("mamba");
    let p = dir.path("mamba.gguf");
    with_tiny_tokenizer(
        GgufWriter::new().kv("general.architecture", Value::String("mamba".into())),
    )
    .kv("mamba.block_count", Value::U32(1))
    .kv("mamba.embedding_length", Value::U32(4))
    .tensor("token_embd.weight", &[4, 2], DType::F32, vec![0u8; 32])
    .write(&p)
    .expect("write mamba.gguf");
    let p = p.to_str().unwrap();
    let out = ferrum(&["generate", "-m", p, "-p", "a", "-n", "2"], QUICK);
    assert_clean_error(&out, &["mamba"]);

    // `info` still describes the file and says it cannot be run.
    let out = ferrum(&["info", p], QUICK).ok();
    assert!(
        out.stdout.contains("architecture: mamba"),
        "{}",
        out.describe()
    );
    assert!(out.stdout.contains("not runnable"), "{}", out.describe());
    assert!(
        out.stdout.contains("token_embd.weight"),
        "{}",
        out.describe()
    );
}

#[test]
fn unsupported_tensor_type_is_a_clean_error() {
    let dir = TempDir::new("i8");
    let p = dir.path("i8.gguf");
    with_tiny_tokenizer(
        GgufWriter::new().kv("general.architecture", Value::String("llama".into())),
    )
    .kv("llama.block_count", Value::U32(1))
    .kv("llama.embedding_length", Value::U32(256))
    .kv("llama.feed_forward_length", Value::U32(256))
    .kv("llama.attention.head_count", Value::U32(1))
    .kv("llama.context_length", Value::U32(64))
    // GGML type 24 (I8, an integer tensor type no model matrix uses): 1 byte per element.
    .tensor_with_type_id("token_embd.weight", &[256, 2], 24, vec![0u8; 512])
    .write(&p)
    .expect("write i8.gguf");
    let p = p.to_str().unwrap();
    let out = ferrum(&["generate", "-m", p, "-p", "a", "-n", "2"], QUICK);
    assert_clean_error(&out, &["token_embd.weight", "24", "not supported"]);
    let out = ferrum(&["info", p], QUICK);
    assert_clean_error(&out, &["token_embd.weight", "24"]);
}

/// RoPE scaling ferrum does not implement (a scaling type it does not know), or malformed
/// frequency factors (zero, or the wrong count), are refused at load, not run with wrong angles.
/// (Llama 3.1 factors, linear and YaRN scaling run: tests/tiny_models.rs in ferrum-llm.)
#[test]
fn unsupported_or_malformed_rope_scaling_is_refused() {
    let dir = TempDir::new("rope");
    let base = || {
        with_tiny_tokenizer(
            GgufWriter::new().kv("general.architecture", Value::String("llama".into())),
        )
        .kv("llama.block_count", Value::U32(1))
        .kv("llama.embedding_length", Value::U32(4))
        .kv("llama.feed_forward_length", Value::U32(8))
        .kv("llama.attention.head_count", Value::U32(1))
        .kv("llama.context_length", Value::U32(64))
        .tensor("token_embd.weight", &[4, 2], DType::F32, vec![0u8; 32])
    };
    let run = |name: &str, w: GgufWriter, want: &[&str]| {
        let p = dir.path(name);
        w.write(&p).expect("write gguf");
        let out = ferrum(
            &["generate", "-m", p.to_str().unwrap(), "-p", "a", "-n", "2"],
            QUICK,
        );
        assert_clean_error(&out, want);
    };
    run(
        "zero.gguf",
        base().tensor("rope_freqs.weight", &[2], DType::F32, vec![0u8; 8]),
        &["frequency factors"],
    );
    run(
        "count.gguf",
        base().tensor("rope_freqs.weight", &[3], DType::F32, vec![0u8; 12]),
        &["rope_freqs.weight", "expected F32 [2]"],
    );
    run(
        "longrope.gguf",
        base()
            .kv("llama.rope.scaling.type", Value::String("longrope".into()))
            .kv("llama.rope.scaling.factor", Value::F32(4.0)),
        &["RoPE scaling 'longrope'"],
    );
}

#[test]
fn prompt_longer_than_the_context_is_a_clean_error() {
    let m = smollm2();
    let prompt = "The quick brown fox jumps over the lazy dog, again and again and again.";
    let out = ferrum(
        &[
            "generate",
            "-m",
            &m,
            "--ctx-size",
            "8",
            "-n",
            "4",
            "-p",
            prompt,
        ],
        MODEL_RUN,
    );
    assert_clean_error(&out, &["context", "--ctx-size"]);

    // The same in chat: the templated turn does not fit.
    let out = ferrum_with(
        &["chat", "-m", &m, "--ctx-size", "8", "-n", "4"],
        Some(&format!("{prompt}\n")),
        MODEL_RUN,
        &[],
    );
    assert_clean_error(&out, &["context"]);
}

#[test]
fn invalid_flag_values_are_clean_errors() {
    let m = smollm2();
    let cases: &[(&[&str], &str)] = &[
        (&["--temperature", "-1"], "temperature"),
        (&["--temperature=-0.5"], "temperature"),
        (&["--top-p", "0"], "top-p"),
        (&["--top-p", "1.5"], "top-p"),
        (&["--threads", "0"], "--threads"),
    ];
    for (flags, mention) in cases {
        let mut args = vec!["generate", "-m", &m, "-p", "hi", "-n", "2"];
        args.extend_from_slice(flags);
        let out = ferrum(&args, MODEL_RUN);
        assert_clean_error(&out, &[mention]);
    }
    // chat validates the same flags.
    let out = ferrum_with(
        &["chat", "-m", &m, "--temperature", "-1"],
        Some("hi\n"),
        MODEL_RUN,
        &[],
    );
    assert_clean_error(&out, &["temperature"]);
}

#[test]
fn forced_token_outside_the_vocabulary_is_a_clean_error() {
    let m = smollm2();
    for ids in ["49152", "7042,30,4000000000"] {
        let out = ferrum(
            &[
                "generate",
                "-m",
                &m,
                "-p",
                FRANCE_PROMPT,
                "--json",
                "--force-tokens",
                ids,
            ],
            MODEL_RUN,
        );
        let line = assert_clean_error(&out, &["vocabulary"]);
        let bad = ids.rsplit(',').next().unwrap();
        assert!(line.contains(bad), "{}", out.describe());
        assert!(
            out.stdout.is_empty(),
            "no JSON on failure: {}",
            out.describe()
        );
    }
}

#[test]
fn too_short_perplexity_text_is_a_clean_error() {
    let dir = TempDir::new("pplshort");
    let p = dir.write("short.txt", b"Hello world.\n");
    let m = smollm2();
    let out = ferrum(
        &["perplexity", "-m", &m, "-f", &p, "--ctx", "64"],
        MODEL_RUN,
    );
    assert_clean_error(&out, &["tokens"]);
    let missing = dir.path("nope.txt");
    let out = ferrum(
        &["perplexity", "-m", &m, "-f", missing.to_str().unwrap()],
        QUICK,
    );
    assert_clean_error(&out, &["nope.txt"]);
}

// ---------------------------------------------------------------------------------------------
// 2-4. generate
// ---------------------------------------------------------------------------------------------

#[test]
fn greedy_generate_json_and_stream_agree() {
    let m = smollm2();
    let args = [
        "generate",
        "-m",
        &m,
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--prompt",
        FRANCE_PROMPT,
    ];
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let out = ferrum(&json_args, MODEL_RUN).ok();
    let v = out.json();
    assert_eq!(
        as_ids(&v["prompt_tokens"]),
        vec![504, 3575, 282, 4649, 314],
        "{}",
        out.describe()
    );
    let tokens = as_ids(&v["tokens"]);
    assert_eq!(tokens.len(), 8, "{}", out.describe());
    assert_eq!(tokens[0], PARIS, "{}", out.describe());
    let text = v["text"].as_str().expect("text is a string");
    assert!(text.starts_with(" Paris"), "{}", out.describe());
    // llama.cpp's greedy continuation starts " Paris.\n\nThe United States has".
    assert_eq!(&tokens[..3], &[PARIS, 30, 198], "{}", out.describe());
    assert_eq!(v["finish_reason"], "length", "{}", out.describe());
    assert!(v["timings"].is_object(), "{}", out.describe());
    assert!(v.get("top_logprobs").is_none(), "{}", out.describe());

    // The streamed text is the same text plus a newline.
    let streamed = ferrum(&args, MODEL_RUN).ok();
    assert_eq!(
        streamed.stdout,
        format!("{text}\n"),
        "{}",
        streamed.describe()
    );
}

#[test]
fn teacher_forcing_reports_top_logprobs() {
    let m = smollm2();
    let out = ferrum(
        &[
            "generate",
            "-m",
            &m,
            "--temperature",
            "0",
            "--prompt",
            FRANCE_PROMPT,
            "--force-tokens",
            "7042,30,198",
            "--top-logprobs",
            "5",
            "--json",
        ],
        MODEL_RUN,
    )
    .ok();
    let v = out.json();
    assert_eq!(
        as_ids(&v["tokens"]),
        vec![PARIS, 30, 198],
        "{}",
        out.describe()
    );
    assert_eq!(v["text"], " Paris.\n", "{}", out.describe());
    let positions = v["top_logprobs"].as_array().expect("top_logprobs array");
    assert_eq!(positions.len(), 3, "{}", out.describe());
    for (i, pos) in positions.iter().enumerate() {
        let entries = pos.as_array().expect("a position is an array");
        assert_eq!(entries.len(), 5, "position {i}: {}", out.describe());
        let mut prev = f64::INFINITY;
        let mut mass = 0.0;
        let mut ids = Vec::new();
        for e in entries {
            let id = e["id"].as_u64().expect("id");
            assert!(e["token"].is_string(), "token text: {e}");
            let lp = e["logprob"].as_f64().expect("logprob");
            assert!(lp.is_finite() && lp <= 0.0, "position {i}: bad logprob {e}");
            assert!(lp <= prev, "position {i}: logprobs not descending: {pos}");
            prev = lp;
            mass += lp.exp();
            ids.push(id);
        }
        assert!(
            mass <= 1.0 + 1e-4,
            "position {i}: probabilities sum to {mass}"
        );
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), 5, "position {i}: duplicate ids in {pos}");
    }
    let first = &positions[0][0];
    assert_eq!(first["id"], PARIS, "{}", out.describe());
    assert_eq!(first["token"], " Paris", "{}", out.describe());
    // " Paris" is clearly the favourite (llama.cpp: logprob about -0.24).
    assert!(first["logprob"].as_f64().unwrap() > -1.0, "{first}");
    // The forced "." is the top choice after " Paris" too.
    assert_eq!(positions[1][0]["id"], 30, "{}", out.describe());
}

#[test]
fn sampling_seed_stop_and_max_tokens() {
    let m = smollm2();
    let sampled = |seed: &str| -> Vec<u64> {
        let out = ferrum(
            &[
                "generate",
                "-m",
                &m,
                "--temperature",
                "1",
                "--seed",
                seed,
                "--max-tokens",
                "12",
                "--ignore-eos",
                "--json",
                "--prompt",
                "Once upon a time",
            ],
            MODEL_RUN,
        )
        .ok();
        let tokens = as_ids(&out.json()["tokens"]);
        assert_eq!(tokens.len(), 12, "{}", out.describe());
        tokens
    };
    let a = sampled("7");
    let b = sampled("7");
    assert_eq!(a, b, "the same seed must reproduce the same tokens");
    // Different seeds: at least one of two should differ (each very likely does).
    let c = sampled("8");
    let d = sampled("9");
    assert!(
        a != c || a != d,
        "seeds 7, 8 and 9 all gave the same 12 sampled tokens: {a:?}"
    );

    // --stop "." ends before the first period; the period is not printed.
    let stop_args = [
        "generate",
        "-m",
        &m,
        "--temperature",
        "0",
        "--max-tokens",
        "32",
        "--stop",
        ".",
        "--prompt",
        FRANCE_PROMPT,
    ];
    let mut json_args = stop_args.to_vec();
    json_args.push("--json");
    let out = ferrum(&json_args, MODEL_RUN).ok();
    let v = out.json();
    let text = v["text"].as_str().expect("text");
    assert!(!text.contains('.'), "{}", out.describe());
    assert!(text.starts_with(" Paris"), "{}", out.describe());
    assert_eq!(v["finish_reason"], "stop", "{}", out.describe());
    let streamed = ferrum(&stop_args, MODEL_RUN).ok();
    assert!(!streamed.stdout.contains('.'), "{}", streamed.describe());
    assert_eq!(
        streamed.stdout,
        format!("{text}\n"),
        "{}",
        streamed.describe()
    );

    // --max-tokens 3 gives exactly 3 tokens.
    let out = ferrum(
        &[
            "generate",
            "-m",
            &m,
            "--temperature",
            "0",
            "--max-tokens",
            "3",
            "--json",
            "--prompt",
            FRANCE_PROMPT,
        ],
        MODEL_RUN,
    )
    .ok();
    let v = out.json();
    assert_eq!(as_ids(&v["tokens"]).len(), 3, "{}", out.describe());
    assert_eq!(v["finish_reason"], "length", "{}", out.describe());
}

// ---------------------------------------------------------------------------------------------
// 5. info
// ---------------------------------------------------------------------------------------------

/// The tensor-table row for `name`, split into columns.
fn tensor_row<'a>(stdout: &'a str, name: &str) -> Vec<&'a str> {
    stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|cols| cols.first() == Some(&name))
        .unwrap_or_else(|| panic!("no tensor row for {name} in:\n{stdout}"))
}

#[test]
fn info_describes_both_models() {
    let out = ferrum(&["info", &smollm2()], QUICK).ok();
    let s = &out.stdout;
    assert!(s.contains("architecture: llama"), "{}", out.describe());
    assert!(s.contains("layers 30 "), "{}", out.describe());
    assert!(s.contains("vocab 49152"), "{}", out.describe());
    assert!(s.contains("\nchat template:\n"), "{}", out.describe());
    assert!(s.contains("<|im_start|>"), "{}", out.describe());
    assert!(s.contains("\ntensors:\n"), "{}", out.describe());
    assert_eq!(
        tensor_row(s, "token_embd.weight")[1],
        "Q8_0",
        "{}",
        out.describe()
    );
    assert_eq!(
        tensor_row(s, "blk.0.ffn_up.weight")[1],
        "Q4_1",
        "{}",
        out.describe()
    );
    let total = s.lines().last().expect("a last line");
    assert!(
        total.starts_with("total: 272 tensors"),
        "{}",
        out.describe()
    );

    let out = ferrum(&["info", &gemma3()], QUICK).ok();
    let s = &out.stdout;
    assert!(s.contains("architecture: gemma3"), "{}", out.describe());
    assert!(s.contains("layers 18 "), "{}", out.describe());
    assert!(s.contains("sliding window"), "{}", out.describe());
    assert!(
        s.contains("chat template: (none in the file)"),
        "{}",
        out.describe()
    );
    assert_eq!(
        tensor_row(s, "token_embd.weight")[1],
        "Q8_0",
        "{}",
        out.describe()
    );
    assert!(s.contains("--all-tensors"), "{}", out.describe());
    assert!(
        s.lines().any(|l| l.starts_with("total: 236 tensors")),
        "{}",
        out.describe()
    );

    // --all-tensors lists every tensor.
    let out = ferrum(&["info", "--all-tensors", &gemma3()], QUICK).ok();
    tensor_row(&out.stdout, "blk.17.ffn_down.weight");
}

// ---------------------------------------------------------------------------------------------
// 6. chat
// ---------------------------------------------------------------------------------------------

#[test]
fn chat_with_piped_stdin() {
    let m = smollm2();
    let args = ["chat", "-m", &m, "--temperature", "0", "--max-tokens", "16"];
    // One turn: the reply to "What is 2+2?" alone.
    let one = ferrum_with(&args, Some("What is 2+2?\n"), MODEL_RUN, &[]).ok();
    let first = one.stdout.trim();
    assert!(!first.is_empty(), "{}", one.describe());
    // llama.cpp: "The answer to this classic math problem is 4."
    assert!(first.contains('4'), "{}", one.describe());
    assert!(!first.contains("<|im_"), "{}", one.describe());

    // Two turns (with a blank line, which is skipped): the first reply is the same, and a
    // second, non-empty reply follows it.
    let two = ferrum_with(&args, Some("What is 2+2?\n\nThanks!\n"), MODEL_RUN, &[]).ok();
    assert!(
        two.stdout.starts_with(&one.stdout),
        "first reply differs between runs: {}\nvs\n{}",
        two.describe(),
        one.describe()
    );
    let second = two.stdout[one.stdout.len()..].trim();
    assert!(!second.is_empty(), "{}", two.describe());
    assert!(!second.contains("<|im_"), "{}", two.describe());

    // Gemma has no template in the file: the built-in Gemma template is used.
    let out = ferrum_with(
        &[
            "chat",
            "-m",
            &gemma3(),
            "--temperature",
            "0",
            "--max-tokens",
            "8",
        ],
        Some("What is 2+2?\n"),
        MODEL_RUN,
        &[],
    )
    .ok();
    assert!(!out.stdout.trim().is_empty(), "{}", out.describe());
    assert!(
        !out.stdout.contains("<start_of_turn>"),
        "{}",
        out.describe()
    );

    // Empty stdin: nothing to say, a clean exit.
    let out = ferrum_with(&args, Some(""), MODEL_RUN, &[]).ok();
    assert!(out.stdout.trim().is_empty(), "{}", out.describe());
}

// ---------------------------------------------------------------------------------------------
// 7. perplexity
// ---------------------------------------------------------------------------------------------

#[test]
fn perplexity_of_a_text_file() {
    let dir = TempDir::new("ppl");
    let text = prose(1800);
    assert!(text.split_whitespace().count() > 200, "too little text");
    let p = dir.write("text.txt", text.as_bytes());
    let out = ferrum(
        &["perplexity", "-m", &smollm2(), "--file", &p, "--ctx", "64"],
        MODEL_RUN,
    )
    .ok();
    let last = out.stdout.trim_end().lines().last().expect("a last line");
    let value = last
        .strip_prefix("PPL = ")
        .unwrap_or_else(|| panic!("last line is not `PPL = <number>`: {}", out.describe()));
    let ppl: f64 = value
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("PPL is not a number ({e}): {}", out.describe()));
    assert!(ppl.is_finite() && ppl > 1.0, "{}", out.describe());
    // SmolLM2 on plain English prose: tens, not thousands.
    assert!(ppl < 500.0, "implausible perplexity: {}", out.describe());
    assert!(
        out.stdout.contains("Final estimate: PPL = "),
        "{}",
        out.describe()
    );
}

// ---------------------------------------------------------------------------------------------
// 8. --help
// ---------------------------------------------------------------------------------------------

#[test]
fn help_for_every_subcommand() {
    let out = ferrum(&["--help"], QUICK).ok();
    for sub in ["generate", "chat", "perplexity", "info"] {
        assert!(out.stdout.contains(sub), "{}", out.describe());
    }
    let out = ferrum(&["--version"], QUICK).ok();
    assert!(out.stdout.starts_with("ferrum "), "{}", out.describe());

    let common = ["--model", "--threads", "--dequantize", "--help"];
    let sampling = [
        "--temperature",
        "--top-k",
        "--top-p",
        "--min-p",
        "--repeat-penalty",
        "--repeat-last-n",
        "--presence-penalty",
        "--frequency-penalty",
        "--seed",
        "--max-tokens",
        "--ctx-size",
    ];
    let cases: &[(&str, Vec<&str>)] = &[
        (
            "generate",
            [
                &common[..],
                &sampling[..],
                &[
                    "--prompt",
                    "--stop",
                    "--ignore-eos",
                    "--parse-special",
                    "--json",
                    "--top-logprobs",
                    "--force-tokens",
                    "--timings",
                ],
            ]
            .concat(),
        ),
        ("chat", [&common[..], &sampling[..], &["--system"]].concat()),
        ("perplexity", [&common[..], &["--file", "--ctx"]].concat()),
        ("info", vec!["--all-tensors", "<PATH>", "--help"]),
    ];
    for (sub, flags) in cases {
        let out = ferrum(&[sub, "--help"], QUICK).ok();
        assert!(out.stderr.is_empty(), "{}", out.describe());
        for flag in flags {
            assert!(
                out.stdout.contains(flag),
                "`{sub} --help` does not mention {flag}: {}",
                out.describe()
            );
        }
    }

    // A missing required flag or an unknown flag is a usage error (exit 2), not a panic.
    let out = ferrum(&["generate"], QUICK);
    assert_eq!(out.status.code(), Some(2), "{}", out.describe());
    assert!(out.stderr.starts_with("error:"), "{}", out.describe());
    assert!(out.stderr.contains("--prompt"), "{}", out.describe());
    let out = ferrum(&["generate", "-p", "x", "--no-such-flag"], QUICK);
    assert_eq!(out.status.code(), Some(2), "{}", out.describe());
    assert!(out.stderr.starts_with("error:"), "{}", out.describe());
}

#[test]
fn bench_prints_llama_bench_rows_and_json() {
    let m = smollm2();
    let out = ferrum(
        &[
            "bench", "-m", &m, "-p", "16", "-n", "4", "-r", "2", "-t", "1,2", "--json",
        ],
        MODEL_RUN,
    );
    assert!(out.status.success(), "{}", out.describe());
    let rows: Json = serde_json::from_str(&out.stdout).expect("bench --json prints JSON");
    let rows = rows.as_array().expect("a JSON array");
    let seen: Vec<(String, u64)> = rows
        .iter()
        .map(|r| {
            let tps = r["tokens_per_second"].as_f64().expect("tokens_per_second");
            assert!(tps.is_finite() && tps > 0.0, "{r}");
            assert!(
                r["stddev"]
                    .as_f64()
                    .is_some_and(|s| s.is_finite() && s >= 0.0),
                "{r}"
            );
            assert_eq!(r["repetitions"], 2, "{r}");
            assert_eq!(r["dot_order"], "llama", "{r}");
            assert!(r["model"].as_str().is_some_and(|s| !s.is_empty()), "{r}");
            (
                r["test"].as_str().unwrap().to_string(),
                r["threads"].as_u64().unwrap(),
            )
        })
        .collect();
    let want: Vec<(String, u64)> = [("pp16", 1), ("tg4", 1), ("pp16", 2), ("tg4", 2)]
        .iter()
        .map(|(t, n)| (t.to_string(), *n))
        .collect();
    assert_eq!(seen, want);

    let out = ferrum(
        &[
            "bench", "-m", &m, "-p", "8", "-n", "0", "-r", "1", "-t", "1",
        ],
        MODEL_RUN,
    );
    assert!(out.status.success(), "{}", out.describe());
    assert!(out.stdout.starts_with("| model"), "{}", out.describe());
    let row = out
        .stdout
        .lines()
        .find(|l| l.contains("pp8"))
        .unwrap_or_else(|| panic!("no pp8 row: {}", out.describe()));
    assert_eq!(row.matches('|').count(), 8, "{row}");

    for bad in [["-t", "0"], ["-r", "0"]] {
        let out = ferrum(&["bench", "-m", &m, bad[0], bad[1]], QUICK);
        assert_clean_error(&out, &[]);
    }

    // The block order, asked for by flag, is named in the rows; an unknown order is refused.
    let out = ferrum(
        &[
            "bench",
            "-m",
            &m,
            "-p",
            "8",
            "-n",
            "2",
            "-r",
            "1",
            "-t",
            "1",
            "--json",
            "--dot-order",
            "blocks",
        ],
        MODEL_RUN,
    );
    assert!(out.status.success(), "{}", out.describe());
    let rows: Json = serde_json::from_str(&out.stdout).expect("bench --json prints JSON");
    for r in rows.as_array().expect("a JSON array") {
        assert_eq!(r["dot_order"], "blocks", "{r}");
        assert!(
            r["tokens_per_second"].as_f64().is_some_and(|v| v > 0.0),
            "{r}"
        );
    }
    let out = ferrum(&["bench", "-m", &m, "--dot-order", "fast"], QUICK);
    assert_eq!(out.status.code(), Some(2), "{}", out.describe());
    assert!(out.stderr.contains("--dot-order"), "{}", out.describe());
}

#[test]
fn bench_machine_measures_and_caches_ceilings() {
    let dir = TempDir::new("machine");
    let file = dir.0.join("machine.json");
    let file_s = file.to_string_lossy().into_owned();
    let out = ferrum_with(
        &["bench", "--machine", "--json"],
        None,
        MODEL_RUN,
        &[("FERRUM_MACHINE_FILE", &file_s)],
    );
    assert!(out.status.success(), "{}", out.describe());
    let printed: Json = serde_json::from_str(&out.stdout).expect("JSON ceilings");
    let cached: Json =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("cache file written"))
            .expect("cached JSON");
    assert_eq!(printed, cached);
    for key in [
        "fma_gflops_1",
        "fma_gflops_all",
        "mem_read_gbs_1",
        "mem_read_gbs_all",
        "mem_copy_gbs_1",
        "l2_read_gbs_1",
        "l3_read_gbs_1",
    ] {
        let v = printed[key].as_f64().unwrap_or(f64::NAN);
        assert!(v.is_finite() && v > 0.0, "{key} = {v}");
    }
    // Caches are faster than memory: a check that the measurement measures something.
    assert!(
        printed["l2_read_gbs_1"].as_f64().unwrap() > printed["mem_read_gbs_1"].as_f64().unwrap(),
        "{}",
        out.stdout
    );
}

#[test]
fn profile_prints_operator_tables_trace_and_roofline() {
    let dir = TempDir::new("profile");
    let machine = dir.0.join("machine.json");
    // Cached ceilings keep the test short (the profiler measures them when none are cached).
    std::fs::write(
        &machine,
        r#"{"cpu":"test","threads":2,"fma_gflops_1":100.0,"fma_gflops_all":200.0,
            "mem_read_gbs_1":20.0,"mem_read_gbs_all":30.0,"mem_copy_gbs_1":20.0,
            "mem_copy_gbs_all":30.0,"l2_read_gbs_1":80.0,"l3_read_gbs_1":60.0}"#,
    )
    .unwrap();
    let trace = dir.0.join("trace.json");
    let svg = dir.0.join("roofline.svg");
    let m = smollm2();
    let (trace_s, svg_s, machine_s) = (
        trace.to_string_lossy().into_owned(),
        svg.to_string_lossy().into_owned(),
        machine.to_string_lossy().into_owned(),
    );
    let out = ferrum_with(
        &[
            "profile",
            "-m",
            &m,
            "-t",
            "1",
            "-p",
            "24",
            "-n",
            "6",
            "--trace",
            &trace_s,
            "--roofline",
            &svg_s,
            "--overhead",
            "1",
        ],
        None,
        MODEL_RUN,
        &[("FERRUM_MACHINE_FILE", &machine_s)],
    );
    assert!(out.status.success(), "{}", out.describe());
    // The profiler's off-cost (calls per token x ns per disabled call) and the operators' share
    // of the wall time are timings, which a busy machine moves (`ferrum profile` and the README
    // report them): the test checks that they are printed as numbers in range, not their size.
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("profiler off: "))
        .unwrap_or_else(|| panic!("no `profiler off` line: {}", out.describe()));
    let pct: f64 = line
        .rsplit('(')
        .next()
        .and_then(|s| s.split('%').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no share in {line}"));
    assert!(pct.is_finite() && (0.0..100.0).contains(&pct), "{line}");
    assert!(line.contains(" operator calls/token"), "{line}");
    for phase in ["prompt phase: 24 tokens", "generation phase: 6 tokens"] {
        let line = out
            .stdout
            .lines()
            .find(|l| l.starts_with(phase))
            .unwrap_or_else(|| panic!("no `{phase}` line: {}", out.describe()));
        // "... profiled operators cover NN.N% of it".
        let pct: f64 = line
            .rsplit("cover ")
            .next()
            .and_then(|s| s.split('%').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no coverage in {line}"));
        assert!(pct > 0.0 && pct <= 100.5, "{line}");
    }
    // SmolLM2 has 30 layers: 7 projections each per call, plus the LM head.
    let row = out
        .stdout
        .lines()
        .find(|l| l.starts_with("| matmul | ffn_down |"))
        .unwrap_or_else(|| panic!("no ffn_down row: {}", out.describe()));
    let cells: Vec<&str> = row.split('|').map(str::trim).collect();
    assert_eq!(cells[3], "30", "{row}");
    let trace: Json =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).expect("the trace is JSON");
    let events = trace["traceEvents"].as_array().expect("traceEvents");
    assert!(events.len() > 30 * 7 * 7, "{} events", events.len());
    assert!(events
        .iter()
        .all(|e| e["ph"] == "X" && e["ts"].is_number() && e["dur"].is_number()));
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(
        svg.matches("<circle").count() >= 5,
        "points per operator class"
    );
}

/// `generate --json-schema / --grammar / --regex` hold the output to the grammar (SmolLM2,
/// greedy); a grammar that does not compile is a clean error.
#[test]
fn generate_follows_a_grammar() {
    let m = smollm2();
    let schema = r#"{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "role": {"enum": ["admin", "guest"]}}, "required": ["name", "age", "role"], "additionalProperties": false}"#;
    let out = ferrum(
        &[
            "generate",
            "-m",
            &m,
            "-p",
            "A user record as JSON:",
            "-n",
            "80",
            "--temperature",
            "0",
            "--json",
            "-j",
            schema,
        ],
        MODEL_RUN,
    )
    .ok()
    .json();
    assert_eq!(out["finish_reason"], "stop", "{out}");
    let v: Json = serde_json::from_str(out["text"].as_str().unwrap()).expect("the output is JSON");
    let o = v.as_object().expect("an object");
    assert_eq!(o.len(), 3, "{v}");
    assert!(
        o["name"].as_str().is_some_and(|n| n.chars().count() <= 12),
        "{v}"
    );
    assert!(
        o["age"].as_i64().is_some_and(|a| (0..=120).contains(&a)),
        "{v}"
    );
    assert!(
        ["admin", "guest"].contains(&o["role"].as_str().unwrap_or("")),
        "{v}"
    );

    let out = ferrum(
        &[
            "generate",
            "-m",
            &m,
            "-p",
            "The date:",
            "-n",
            "20",
            "--temperature",
            "0",
            "--json",
            "--regex",
            "[0-9]{4}-[0-9]{2}-[0-9]{2}",
        ],
        MODEL_RUN,
    )
    .ok()
    .json();
    let t = out["text"].as_str().unwrap();
    assert!(
        t.len() == 10
            && t.bytes().enumerate().all(|(i, b)| if i == 4 || i == 7 {
                b == b'-'
            } else {
                b.is_ascii_digit()
            }),
        "{out}"
    );

    let out = ferrum(
        &[
            "generate",
            "-m",
            &m,
            "-p",
            "Answer:",
            "-n",
            "10",
            "--temperature",
            "0",
            "--json",
            "--grammar",
            "root ::= \"yes\" | \"no\"",
        ],
        MODEL_RUN,
    )
    .ok()
    .json();
    assert!(
        ["yes", "no"].contains(&out["text"].as_str().unwrap()),
        "{out}"
    );

    let out = ferrum(
        &[
            "generate",
            "-m",
            &m,
            "-p",
            "x",
            "-n",
            "2",
            "--grammar",
            "root ::= nope",
        ],
        MODEL_RUN,
    );
    assert_clean_error(&out, &["not defined"]);
}

/// A mixture of experts decodes a token by reading only the routed experts' weights: `ferrum
/// profile` on the tiny Mixtral (8 experts, 2 per token) reports the matmuls' bytes per token
/// near the active weights (activations add a few percent on a model this small) and well under
/// every matrix.
#[test]
fn moe_decode_reads_only_the_active_experts() {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/models/tiny/mixtral.f32.gguf");
    let out = ferrum(
        &[
            "profile",
            "-m",
            model.to_str().unwrap(),
            "-p",
            "8",
            "-n",
            "16",
            "-t",
            "1",
        ],
        // A first `profile` on a machine also measures its ceilings (~13 s on 2 cores).
        MODEL_RUN,
    );
    assert!(out.status.success(), "{}", out.describe());
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("weights read per generated token"))
        .unwrap_or_else(|| panic!("no weight-traffic line: {}", out.describe()));
    let mib: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.parse().ok())
        .collect();
    // read, active, percentage, every matrix, experts
    let (read, active, all) = (mib[0], mib[1], mib[3]);
    assert!(
        read <= 1.15 * active && read >= active && read < 0.8 * all,
        "{line}"
    );
}

/// `ferrum info` says what a gpt-oss file holds beyond a Llama: its routing, its clamped SwiGLU
/// experts, its sinks and its alternating sliding window (tests/models/tiny/gptoss.mxfp4.gguf).
#[test]
fn info_describes_gpt_oss() {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/models/tiny/gptoss.mxfp4.gguf");
    let out = ferrum(&["info", model.to_str().unwrap()], QUICK).ok();
    for want in [
        "architecture: gpt-oss",
        "experts 8 (2 per token",
        "top k, then softmax over them",
        "clamped SwiGLU",
        "attention sinks",
        "sliding window 8 (one layer in 2 global",
        "YaRN over original context 64",
    ] {
        assert!(out.stdout.contains(want), "{want}: {}", out.describe());
    }
}
