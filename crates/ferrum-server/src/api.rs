//! The OpenAI-compatible HTTP API: `POST /v1/completions`, `POST /v1/chat/completions` (both with
//! `stream: true` as server-sent events ending in `data: [DONE]`), `GET /v1/models`, `GET /health`.
//! Request bodies are parsed here (not by an extractor) so every malformed one gets a 400 with an
//! OpenAI-style error body.
//!
//! `n` > 1 submits one engine request per choice (choice i samples with `seed + i`); they share
//! the prompt's KV blocks through the prefix cache. `logprobs` (completions: a count; chat:
//! `logprobs: true` with `top_logprobs`) reports each token's log-probability under the model
//! before temperature and penalties, as vLLM does by default.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::chat_request::{self, call_deltas, ToolCtx, ToolsIn};
use crate::request::{
    build, parse, parse_logprobs, request_grammar, ChatBody, Common, CompletionBody, Kind, Prompt,
    MAX_N,
};
use crate::{reasoning, structured, tool_calls};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ferrum_llm::grammar::{Constraint, Grammars};
use ferrum_llm::{FinishReason, Llm};
use ferrum_tokenizer::ChatTemplate;
use serde_json::{json, Value};
use std::sync::OnceLock;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::engine::{Event, Metrics, Request, TokenLogprobs};

/// Shared by the handlers.
pub struct AppState {
    pub llm: Arc<Llm>,
    pub template: ChatTemplate,
    pub engine: Sender<Request>,
    pub model_id: String,
    pub ctx_size: usize,
    pub next_id: AtomicU64,
    pub metrics: Arc<Metrics>,
    /// Requests accepted and not yet answered; over `max_in_flight` new ones get 429.
    pub in_flight: AtomicUsize,
    pub max_in_flight: usize,
    /// Positions per KV block, and whether prefix caching is on (for `/metrics`).
    pub block_size: usize,
    pub prefix_caching: bool,
    /// Weights and KV pool sizes (for `/metrics`).
    pub memory: crate::MemoryReport,
    /// The grammar compiler for structured output, built on first use.
    pub grammars: OnceLock<Result<Arc<Grammars>, String>>,
}

/// Counts a request in flight for as long as it lives.
pub(crate) struct InFlight(Arc<AppState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(crate::responses::responses))
        .route("/v1/messages", post(crate::anthropic::messages))
        .route(
            "/v1/messages/count_tokens",
            post(crate::anthropic::count_tokens),
        )
        .route("/tokenize", post(crate::tokenize::tokenize))
        .route("/detokenize", post(crate::tokenize::detokenize))
        .with_state(state)
}

/// 24 hex digits naming a response: unique across requests, restarts and replicas (a hash of
/// the request's sequence number, the process id, the start time and a per-process random
/// state), not a counter from 0.
pub(crate) fn response_id(seq: u64) -> String {
    use std::hash::{BuildHasher, Hasher};
    static SEED: std::sync::OnceLock<(std::collections::hash_map::RandomState, u128)> =
        std::sync::OnceLock::new();
    let (state, started) = SEED.get_or_init(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        (std::collections::hash_map::RandomState::new(), t)
    });
    let word = |salt: u64| {
        let mut h = state.build_hasher();
        h.write_u64(salt);
        h.write_u64(seq);
        h.write_u32(std::process::id());
        h.write_u128(*started);
        h.finish()
    };
    format!("{:016x}{:08x}", word(1), word(2) as u32)
}

/// A tool call's id: `call_` and 24 hex digits, unique as response ids are (a process-wide
/// counter through the same keyed hash, on a range of its own).
pub(crate) fn call_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1 << 63);
    format!("call_{}", response_id(NEXT.fetch_add(1, Ordering::Relaxed)))
}

/// An OpenAI-style error response.
#[derive(Debug)]
pub struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    pub(crate) param: Option<&'static str>,
}

impl ApiError {
    pub(crate) fn internal(message: String) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message,
            param: None,
        }
    }

    pub(crate) fn bad(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param,
        }
    }
}

/// A body the server could not take (over the size limit: 413; unreadable: 400) as the API's
/// JSON error rather than axum's plain text.
impl From<BytesRejection> for ApiError {
    fn from(r: BytesRejection) -> ApiError {
        let status = r.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            format!("request body too large: {}", r.body_text())
        } else {
            format!("could not read the request body: {}", r.body_text())
        };
        ApiError {
            status,
            message,
            param: None,
        }
    }
}

impl ApiError {
    /// The error as Anthropic's API writes it: `{"type": "error", "error": {"type", "message"}}`.
    pub(crate) fn into_anthropic(self) -> Response {
        let kind = match self.status {
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            s if s.is_client_error() => "invalid_request_error",
            _ => "api_error",
        };
        let body = json!({"type": "error", "error": {"type": kind, "message": self.message}});
        (self.status, Json(body)).into_response()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = if self.status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        let body = json!({"error": {"message": self.message, "type": kind, "param": self.param, "code": null}});
        (self.status, Json(body)).into_response()
    }
}

async fn health() -> impl IntoResponse {
    Json(json!({"status": "ok"}))
}

async fn models(State(st): State<Arc<AppState>>) -> impl IntoResponse {
    Json(json!({
        "object": "list",
        "data": [{"id": st.model_id, "object": "model", "created": now(), "owned_by": "ferrum"}],
    }))
}

/// `/metrics`: Prometheus text format ([`crate::metrics::render`]).
async fn metrics(State(st): State<Arc<AppState>>) -> impl IntoResponse {
    let o = crate::metrics::render(
        &st.metrics,
        &crate::metrics::Info {
            model_id: &st.model_id,
            block_size: st.block_size,
            prefix_caching: st.prefix_caching,
            memory: &st.memory,
        },
    );
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        o,
    )
}

pub(crate) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        FinishReason::Stop => "stop",
    }
}

async fn completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let b: CompletionBody = parse(&body?)?;
    let prompt = match b.prompt {
        Prompt::Text(t) => st.llm.tokenizer.encode(&t, true, false),
        Prompt::Texts(v) if v.len() == 1 => st.llm.tokenizer.encode(&v[0], true, false),
        Prompt::Texts(_) => {
            return Err(ApiError::bad(
                "only one prompt per request is supported",
                Some("prompt"),
            ))
        }
        Prompt::Ids(ids) => ids,
    };
    run(st, &b.common, prompt, 16, Kind::Completion, None, None).await
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let b: ChatBody = parse(&body?)?;
    let parts = ToolsIn {
        tools: b.tools.as_deref(),
        choice: b.tool_choice.as_ref(),
        parallel: b.parallel_tool_calls,
        kwargs: b.chat_template_kwargs.as_ref(),
    };
    let (rendered, tool_ctx) = chat_request::render(&st.template, b.messages, parts, true)?;
    // Thinking templates: the reasoning goes to reasoning_content (Some(true): the prompt
    // already opened it).
    let think = reasoning::template_thinks(st.template.source())
        .then(|| reasoning::prompt_opens(&rendered));
    let prompt = st.llm.encode_rendered_chat(&rendered);
    let default_max = st.ctx_size;
    run(
        st,
        &b.common,
        prompt,
        default_max,
        Kind::Chat,
        tool_ctx,
        think,
    )
    .await
}

/// One choice of a streamed chat reply, read as it comes: the reasoning split off (thinking
/// templates), then the answer parsed for tool calls (when tools are offered).
struct ChatReader {
    think: Option<reasoning::Splitter>,
    tools: Option<tool_calls::Stream>,
}

/// What a [`ChatReader`] gives out.
enum ReadOut {
    Reasoning(String),
    Answer(tool_calls::Out),
}

impl ChatReader {
    fn route(&mut self, parts: Vec<reasoning::Part>) -> Vec<ReadOut> {
        let mut out = Vec::new();
        for (is_reasoning, t) in parts {
            if is_reasoning {
                out.push(ReadOut::Reasoning(t));
            } else if let Some(p) = self.tools.as_mut() {
                out.extend(p.push(&t).into_iter().map(ReadOut::Answer));
            } else {
                out.push(ReadOut::Answer(tool_calls::Out::Text(t)));
            }
        }
        out
    }

    fn push(&mut self, text: &str) -> Vec<ReadOut> {
        let parts = match self.think.as_mut() {
            Some(s) => s.push(text),
            None => vec![(false, text.to_string())],
        };
        self.route(parts)
    }

    fn finish(&mut self) -> Vec<ReadOut> {
        let parts = self.think.as_mut().map(|s| s.finish()).unwrap_or_default();
        let mut out = self.route(parts);
        if let Some(p) = self.tools.as_mut() {
            out.extend(p.finish().into_iter().map(ReadOut::Answer));
        }
        out
    }

    /// Calls given out so far.
    fn calls(&self) -> usize {
        self.tools.as_ref().map_or(0, tool_calls::Stream::calls)
    }
}

fn logprobs_json(kind: Kind, lps: &[TokenLogprobs], mut offset: usize) -> Value {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    match kind {
        Kind::Completion => {
            let mut offsets = Vec::with_capacity(lps.len());
            for l in lps {
                offsets.push(offset);
                offset += text(&l.token).len();
            }
            json!({
                "tokens": lps.iter().map(|l| text(&l.token)).collect::<Vec<_>>(),
                "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                "top_logprobs": lps.iter().map(|l| {
                    let mut m = serde_json::Map::new();
                    for (t, lp) in &l.top {
                        m.entry(text(t)).or_insert(json!(lp));
                    }
                    Value::Object(m)
                }).collect::<Vec<_>>(),
                "text_offset": offsets,
            })
        }
        Kind::Chat => json!({
            "content": lps.iter().map(|l| json!({
                "token": text(&l.token),
                "logprob": l.logprob,
                "bytes": l.token,
                "top_logprobs": l.top.iter().map(|(t, lp)| json!({
                    "token": text(t), "logprob": lp, "bytes": t,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        }),
    }
}

/// An accepted request: its engine events (choice index, event), the admission slot it holds
/// until dropped, and its prompt's length.
pub(crate) struct Submitted {
    pub rx: mpsc::UnboundedReceiver<(usize, Event)>,
    pub guard: InFlight,
    pub prompt_tokens: usize,
}

/// Checks a request's shared fields, takes an admission slot and sends its `n` choices to the
/// engine, each with its own copy of the compiled grammar (and the text after which it holds).
/// `Ok(Err(response))`: the server is at capacity (429, to be returned as is).
pub(crate) fn submit(
    st: &Arc<AppState>,
    c: &Common,
    prompt: Vec<u32>,
    default_max: usize,
    n: usize,
    logprobs: Option<usize>,
    (constraint, constraint_after): (Option<Constraint>, Option<String>),
) -> Result<Result<Submitted, Response>, ApiError> {
    let (prompt, max_tokens, sampling, stop) = build(st, c, prompt, default_max)?;
    let min_tokens = c.min_tokens.unwrap_or(0) as usize;
    if min_tokens > max_tokens {
        return Err(ApiError::bad(
            "min_tokens is larger than max_tokens",
            Some("min_tokens"),
        ));
    }
    // Admission: at most max_in_flight requests accepted at once.
    if st.in_flight.fetch_add(1, Ordering::SeqCst) >= st.max_in_flight {
        st.in_flight.fetch_sub(1, Ordering::SeqCst);
        let body = json!({"error": {"message": "the server is at capacity; retry shortly",
            "type": "rate_limit_error", "param": null, "code": null}});
        return Ok(Err((
            StatusCode::TOO_MANY_REQUESTS,
            [(axum::http::header::RETRY_AFTER, "1")],
            Json(body),
        )
            .into_response()));
    }
    let guard = InFlight(Arc::clone(st));
    // One engine request per choice, all answering on one channel; choice i samples with seed + i.
    let (tx, rx) = mpsc::unbounded_channel();
    for choice in 0..n {
        let mut sampling = sampling.clone();
        sampling.seed = sampling.seed.wrapping_add(choice as u64);
        let req = Request {
            prompt: prompt.clone(),
            max_tokens,
            sampling,
            stop: stop.clone(),
            ignore_eos: c.ignore_eos,
            min_tokens,
            priority: c.priority.unwrap_or(0),
            logprobs,
            choice,
            events: tx.clone(),
            constraint: constraint.clone(),
            constraint_after: constraint_after.clone(),
            completion: None,
        };
        st.engine.send(req).map_err(|_| ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the engine has stopped".into(),
            param: None,
        })?;
    }
    Ok(Ok(Submitted {
        rx,
        guard,
        prompt_tokens: prompt.len(),
    }))
}

/// [`request_grammar`], compiled for the engine.
pub(crate) async fn request_constraint(
    st: &Arc<AppState>,
    c: &Common,
    tools: Option<&ToolCtx>,
) -> Result<Option<Constraint>, ApiError> {
    match request_grammar(c, tools)? {
        Some((param, g)) => structured::compile(st, g, param).await.map(Some),
        None => Ok(None),
    }
}

/// One choice of a request from another API's endpoint (Responses, Anthropic): its grammar
/// (structured output or a required call) compiled, then submitted as [`submit`] does, with the
/// whole context as the default budget.
pub(crate) async fn submit_one(
    st: &Arc<AppState>,
    c: &Common,
    prompt: Vec<u32>,
    tools: Option<&ToolCtx>,
) -> Result<Result<Submitted, Response>, ApiError> {
    let constraint = request_constraint(st, c, tools).await?;
    submit(st, c, prompt, st.ctx_size, 1, None, (constraint, None))
}

async fn run(
    st: Arc<AppState>,
    c: &Common,
    prompt: Vec<u32>,
    default_max: usize,
    kind: Kind,
    tools: Option<ToolCtx>,
    think: Option<bool>,
) -> Result<Response, ApiError> {
    let logprobs = parse_logprobs(c, kind)?;
    let constraint = request_constraint(&st, c, tools.as_ref()).await?;
    // A thinking template whose prompt opened the reasoning: the grammar holds for the answer,
    // after `</think>`, as vLLM's reasoning parsers have it.
    let after = (constraint.is_some() && think == Some(true)).then(|| reasoning::CLOSE.to_string());
    let n = match c.n {
        None => 1,
        Some(n) if (1..=MAX_N).contains(&n) => n as usize,
        Some(_) => {
            return Err(ApiError::bad(
                format!("n must be from 1 to {MAX_N}"),
                Some("n"),
            ))
        }
    };
    let Submitted {
        mut rx,
        guard,
        prompt_tokens,
    } = match submit(
        &st,
        c,
        prompt,
        default_max,
        n,
        logprobs,
        (constraint, after),
    )? {
        Ok(s) => s,
        Err(busy) => return Ok(busy),
    };
    let id = format!(
        "{}-{}",
        if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        response_id(st.next_id.fetch_add(1, Ordering::Relaxed))
    );
    let created = now();
    let model = st.model_id.clone();

    if !c.stream {
        let _guard = guard;
        let mut texts = vec![String::new(); n];
        let mut lps: Vec<Vec<TokenLogprobs>> = vec![Vec::new(); n];
        let mut finishes: Vec<Option<FinishReason>> = vec![None; n];
        let (mut completion_tokens, mut cached_tokens) = (0, 0);
        while finishes.iter().any(Option::is_none) {
            let Some((i, ev)) = rx.recv().await else {
                return Err(ApiError {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: "the engine dropped the request".into(),
                    param: None,
                });
            };
            match ev {
                Event::Token { text, logprobs, .. } => {
                    texts[i].push_str(&text);
                    lps[i].extend(logprobs);
                }
                Event::Done {
                    finish,
                    completion_tokens: ct,
                    cached_tokens: cached,
                    ..
                } => {
                    finishes[i] = Some(finish);
                    completion_tokens += ct;
                    cached_tokens = cached_tokens.max(cached);
                }
                Event::Error(e) => {
                    return Err(ApiError {
                        status: StatusCode::INTERNAL_SERVER_ERROR,
                        message: e,
                        param: None,
                    })
                }
            }
        }
        let choices: Vec<Value> = (0..n)
            .map(|i| {
                let lp = match logprobs {
                    Some(_) => logprobs_json(kind, &lps[i], 0),
                    None => Value::Null,
                };
                let mut finish = finishes[i].map(finish_str);
                match (kind, &tools) {
                    (Kind::Completion, _) => json!({"index": i, "text": texts[i], "logprobs": lp,
                        "finish_reason": finish}),
                    (Kind::Chat, _) => {
                        // Reasoning split off first (thinking templates), then tool calls.
                        let (reasoning, answer) = match think {
                            Some(inside) => reasoning::split(inside, &texts[i]),
                            None => (None, texts[i].clone()),
                        };
                        let mut message = json!({"role": "assistant", "content": answer});
                        if let Some(r) = reasoning {
                            message["reasoning_content"] = json!(r);
                        }
                        let Some(t) = &tools else {
                            return json!({"index": i, "message": message, "logprobs": lp,
                                "finish_reason": finish});
                        };
                        let (content, calls) =
                            tool_calls::parse_reply(t.format, &t.prefix, &t.keep(), &answer);
                        message["content"] = json!(content);
                        if !calls.is_empty() {
                            message["tool_calls"] =
                                calls.iter().map(|c| c.to_json(&call_id())).collect();
                            finish = Some("tool_calls");
                        }
                        json!({"index": i, "message": message, "logprobs": lp,
                            "finish_reason": finish})
                    }
                }
            })
            .collect();
        let usage = usage_json(prompt_tokens, completion_tokens, cached_tokens);
        let object = match kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion",
        };
        let body = json!({"id": id, "object": object, "created": created, "model": model,
            "choices": choices, "usage": usage});
        return Ok(Json(body).into_response());
    }

    // Streaming: a task turns engine events into SSE chunks; when the client goes away the SSE
    // stream is dropped, the task's sends fail, it drops the engine's receiver, and the engine
    // frees the request's sequences at its next step.
    let include_usage = c.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let (sse_tx, sse_rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let _guard = guard;
        let object = match kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        let chunk = |i: usize, delta: Value, lp: Value, finish: Option<&str>| -> Value {
            let choice = match kind {
                Kind::Completion => {
                    json!({"index": i, "text": delta, "logprobs": lp, "finish_reason": finish})
                }
                Kind::Chat => {
                    json!({"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish})
                }
            };
            json!({"id": id, "object": object, "created": created, "model": model,
                "choices": [choice]})
        };
        let send = |v: Value| SseEvent::default().data(v.to_string());
        if kind == Kind::Chat {
            for i in 0..n {
                let first = chunk(
                    i,
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                    None,
                );
                if sse_tx.send(Ok(send(first))).await.is_err() {
                    return;
                }
            }
        }
        let mut offsets = vec![0usize; n];
        // Per choice: the reasoning splitter and the tool-call parser.
        let mut parsers: Vec<Option<ChatReader>> = (0..n)
            .map(|_| {
                (kind == Kind::Chat && (tools.is_some() || think.is_some())).then(|| ChatReader {
                    think: think.map(reasoning::Splitter::new),
                    tools: tools
                        .as_ref()
                        .map(|t| tool_calls::Stream::new(t.format, &t.prefix, t.keep())),
                })
            })
            .collect();
        // Reasoning, content and tool-call deltas for what a reader gave out. A call goes out
        // once it is complete (as OpenAI sends one: id, type and name first, then arguments).
        let deltas_of = |pieces: Vec<ReadOut>| -> Vec<Value> {
            let mut deltas = Vec::new();
            for p in pieces {
                match p {
                    ReadOut::Reasoning(t) => deltas.push(json!({"reasoning_content": t})),
                    ReadOut::Answer(tool_calls::Out::Text(t)) => deltas.push(json!({"content": t})),
                    ReadOut::Answer(tool_calls::Out::Call(index, c)) => {
                        deltas.extend(call_deltas(index, &call_id(), &c.name, &c.arguments))
                    }
                }
            }
            deltas
        };
        let (mut left, mut completion_tokens, mut cached_tokens) = (n, 0, 0);
        while let Some((i, ev)) = rx.recv().await {
            let out = match ev {
                Event::Token {
                    text,
                    logprobs: None,
                    ..
                } if text.is_empty() => continue,
                Event::Token { text, logprobs, .. } => {
                    let lp = match logprobs {
                        Some(l) => {
                            let v = logprobs_json(kind, std::slice::from_ref(&l), offsets[i]);
                            offsets[i] += String::from_utf8_lossy(&l.token).len();
                            v
                        }
                        None => Value::Null,
                    };
                    match (kind, parsers[i].as_mut()) {
                        (Kind::Completion, _) => vec![send(chunk(i, json!(text), lp, None))],
                        (Kind::Chat, None) => {
                            vec![send(chunk(i, json!({"content": text}), lp, None))]
                        }
                        (Kind::Chat, Some(p)) => {
                            let mut deltas = deltas_of(p.push(&text));
                            if deltas.is_empty() && !lp.is_null() {
                                deltas.push(json!({"content": ""}));
                            }
                            let mut lp = Some(lp);
                            deltas
                                .into_iter()
                                .map(|d| send(chunk(i, d, lp.take().unwrap_or(Value::Null), None)))
                                .collect()
                        }
                    }
                }
                Event::Done {
                    finish,
                    completion_tokens: ct,
                    cached_tokens: cached,
                    ..
                } => {
                    completion_tokens += ct;
                    cached_tokens = cached_tokens.max(cached);
                    left -= 1;
                    let mut v = Vec::new();
                    let mut finish = finish_str(finish);
                    if let Some(p) = parsers[i].as_mut() {
                        for d in deltas_of(p.finish()) {
                            v.push(send(chunk(i, d, Value::Null, None)));
                        }
                        if p.calls() > 0 {
                            finish = "tool_calls";
                        }
                    }
                    let delta = match kind {
                        Kind::Completion => json!(""),
                        Kind::Chat => json!({}),
                    };
                    v.push(send(chunk(i, delta, Value::Null, Some(finish))));
                    if left == 0 {
                        if include_usage {
                            v.push(send(json!({"id": id, "object": object, "created": created,
                                    "model": model, "choices": [],
                                    "usage": usage_json(prompt_tokens, completion_tokens,
                                        cached_tokens)})));
                        }
                        v.push(SseEvent::default().data("[DONE]"));
                    }
                    v
                }
                Event::Error(e) => {
                    let err = json!({"error": {"message": e, "type": "server_error",
                        "param": null, "code": null}});
                    let _ = sse_tx.send(Ok(send(err))).await;
                    let _ = sse_tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
                    return;
                }
            };
            let last = left == 0;
            for e in out {
                if sse_tx.send(Ok(e)).await.is_err() {
                    return;
                }
            }
            if last {
                return;
            }
        }
    });
    Ok(Sse::new(ReceiverStream::new(sse_rx)).into_response())
}

/// The `usage` object: token counts, with the prompt tokens the prefix cache supplied.
fn usage_json(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}
