//! Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.
//!
//! A request's `system` (text or text blocks) and `messages` (text, `tool_use` and `tool_result`
//! blocks) become the chat the model's template renders: a user turn's `tool_result` blocks
//! become `tool` messages placed before the turn's text (they answer the calls of the turn
//! before), an assistant turn's `tool_use` blocks its `tool_calls`. `tools` (`name`,
//! `description`, `input_schema`) and `tool_choice` (`auto`, `any`, `tool`, `none`,
//! `disable_parallel_tool_use`) map to the chat endpoint's. The reply is a `message` with `text`
//! and `tool_use` content blocks and a `stop_reason` (`end_turn`, `max_tokens`, `tool_use`);
//! with `stream: true`, Anthropic's events (`message_start`, `content_block_start`,
//! `content_block_delta` with `text_delta` / `input_json_delta`, `content_block_stop`,
//! `message_delta`, `message_stop`). Errors use Anthropic's error shape.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferrum_llm::FinishReason;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::api::{call_id, response_id, submit_one, ApiError, AppState, Submitted};
use crate::chat_request::{tool_context, ToolCtx};
use crate::engine::Event;
use crate::request::{parse, Common};
use crate::tool_calls::{self, Piece, ToolCall};

#[derive(Deserialize)]
struct Body {
    messages: Vec<Value>,
    #[serde(default)]
    system: Option<Value>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
}

fn bad(m: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad(m, Some(param))
}

/// Text of a `system` or `tool_result` content: a string or text blocks.
fn text_of(v: &Value, what: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(blocks) => {
            let mut s = String::new();
            for b in blocks {
                match (b.get("type").and_then(Value::as_str), b.get("text")) {
                    (Some("text"), Some(Value::String(t))) => s.push_str(t),
                    (k, _) => {
                        return Err(bad(
                            format!(
                                "{what}: blocks of type {} are not supported",
                                k.unwrap_or("?")
                            ),
                            "messages",
                        ))
                    }
                }
            }
            Ok(s)
        }
        other => Err(bad(
            format!("{what} must be text or blocks, found {other}"),
            "messages",
        )),
    }
}

/// The request as chat messages (see the module text).
fn chat_messages(b: &Body) -> Result<Vec<Value>, ApiError> {
    let mut msgs = Vec::new();
    if let Some(s) = &b.system {
        msgs.push(json!({"role": "system", "content": text_of(s, "system")?}));
    }
    if b.messages.is_empty() {
        return Err(bad("messages is empty", "messages"));
    }
    for (at, m) in b.messages.iter().enumerate() {
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            other => {
                return Err(bad(
                    format!("messages[{at}].role must be user or assistant, found {other:?}"),
                    "messages",
                ))
            }
        };
        let blocks = match m.get("content") {
            Some(Value::String(s)) => {
                msgs.push(json!({"role": role, "content": s}));
                continue;
            }
            Some(Value::Array(b)) => b,
            _ => {
                return Err(bad(
                    format!("messages[{at}].content must be text or a list of blocks"),
                    "messages",
                ))
            }
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        for blk in blocks {
            match blk.get("type").and_then(Value::as_str) {
                Some("text") => {
                    text.push_str(blk.get("text").and_then(Value::as_str).unwrap_or(""))
                }
                Some("tool_use") if role == "assistant" => {
                    let (Some(id), Some(name)) = (
                        blk.get("id").and_then(Value::as_str),
                        blk.get("name").and_then(Value::as_str),
                    ) else {
                        return Err(bad(
                            format!("messages[{at}]: a tool_use block needs id and name"),
                            "messages",
                        ));
                    };
                    let input = blk.get("input").cloned().unwrap_or(json!({}));
                    calls.push(json!({"id": id, "type": "function",
                        "function": {"name": name, "arguments": input}}));
                }
                Some("tool_result") if role == "user" => {
                    let Some(id) = blk.get("tool_use_id").and_then(Value::as_str) else {
                        return Err(bad(
                            format!("messages[{at}]: a tool_result block needs tool_use_id"),
                            "messages",
                        ));
                    };
                    let mut out =
                        text_of(blk.get("content").unwrap_or(&Value::Null), "tool_result")?;
                    if blk.get("is_error").and_then(Value::as_bool) == Some(true) {
                        out = format!("Error: {out}");
                    }
                    // Tool results answer the previous turn's calls: they come first.
                    msgs.push(json!({"role": "tool", "tool_call_id": id, "content": out}));
                }
                // Earlier thinking is not shown to the template.
                Some("thinking" | "redacted_thinking") => {}
                other => {
                    return Err(bad(
                        format!(
                            "messages[{at}]: content blocks of type {} are not supported in a \
                             {role} turn",
                            other.unwrap_or("(none)")
                        ),
                        "messages",
                    ))
                }
            }
        }
        if role == "assistant" {
            let mut msg = json!({"role": "assistant", "content": text});
            if !calls.is_empty() {
                msg["tool_calls"] = Value::Array(calls);
            }
            msgs.push(msg);
        } else if !text.is_empty() {
            msgs.push(json!({"role": "user", "content": text}));
        }
    }
    Ok(msgs)
}

/// Tools, tool_choice and parallel_tool_calls in the chat endpoint's form.
type ChatTools = (Vec<Value>, Option<Value>, Option<bool>);

/// The request's tools in the chat endpoint's form.
fn chat_tools(b: &Body) -> Result<ChatTools, ApiError> {
    let mut tools = Vec::new();
    for (i, t) in b.tools.iter().flatten().enumerate() {
        if let Some(kind) = t.get("type").and_then(Value::as_str) {
            if kind != "custom" {
                return Err(bad(
                    format!("tools[{i}]: server tools ({kind}) are not supported"),
                    "tools",
                ));
            }
        }
        let mut f = serde_json::Map::new();
        if let Some(n) = t.get("name") {
            f.insert("name".into(), n.clone());
        }
        if let Some(d) = t.get("description") {
            f.insert("description".into(), d.clone());
        }
        match t.get("input_schema") {
            Some(s) => {
                f.insert("parameters".into(), s.clone());
            }
            None => return Err(bad(format!("tools[{i}] needs an input_schema"), "tools")),
        }
        tools.push(json!({"type": "function", "function": f}));
    }
    let (choice, parallel) = match &b.tool_choice {
        None => (None, None),
        Some(c) => {
            let parallel = c
                .get("disable_parallel_tool_use")
                .and_then(Value::as_bool)
                .map(|d| !d);
            let choice = match c.get("type").and_then(Value::as_str) {
                Some("auto") => json!("auto"),
                Some("any") => json!("required"),
                Some("none") => json!("none"),
                Some("tool") => json!({"type": "function", "function": {"name": c.get("name")}}),
                other => {
                    return Err(bad(
                        format!("tool_choice.type {other:?} (expected auto, any, tool or none)"),
                        "tool_choice",
                    ))
                }
            };
            (Some(choice), parallel)
        }
    };
    Ok((tools, choice, parallel))
}

/// The prompt tokens and the tool context of a request.
fn prepare(st: &AppState, b: &Body) -> Result<(Vec<u32>, Option<ToolCtx>), ApiError> {
    let msgs = chat_messages(b)?;
    let (tools, choice, parallel) = chat_tools(b)?;
    let ctx = tool_context(st.template.source(), &tools, choice.as_ref(), parallel)?;
    let offered = ctx.is_some().then_some(Value::Array(tools));
    let mut rendered = st
        .template
        .render_json(
            &Value::Array(msgs),
            offered.as_ref(),
            &Default::default(),
            true,
        )
        .map_err(|e| bad(format!("chat template: {e}"), "messages"))?;
    if let Some(t) = &ctx {
        rendered.push_str(&t.prefix);
    }
    Ok((st.llm.encode_rendered_chat(&rendered), ctx))
}

pub async fn count_tokens(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = || -> Result<Response, ApiError> {
        let raw = body.map_err(ApiError::from)?;
        // count_tokens takes no max_tokens.
        let b: Body = parse(&raw)?;
        let (prompt, _) = prepare(&st, &b)?;
        Ok(Json(json!({"input_tokens": prompt.len()})).into_response())
    };
    run().unwrap_or_else(ApiError::into_anthropic)
}

pub async fn messages(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match messages_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_anthropic(),
    }
}

async fn messages_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let b: Body = parse(&body?)?;
    let Some(max_tokens) = b.max_tokens else {
        return Err(bad("max_tokens is required", "max_tokens"));
    };
    let (prompt, ctx) = prepare(&st, &b)?;
    let common: Common = serde_json::from_value(json!({
        "max_tokens": max_tokens, "temperature": b.temperature, "top_p": b.top_p,
        "top_k": b.top_k, "stop": b.stop_sequences, "stream": b.stream,
    }))
    .map_err(|e| bad(format!("invalid request: {e}"), "messages"))?;
    let Submitted {
        mut rx,
        guard,
        prompt_tokens,
    } = match submit_one(&st, &common, prompt, ctx.as_ref()).await? {
        Ok(s) => s,
        Err(busy) => return Ok(busy),
    };
    let id = format!(
        "msg_{}",
        response_id(st.next_id.fetch_add(1, Ordering::Relaxed))
    );
    let model = st.model_id.clone();

    if !b.stream {
        let _guard = guard;
        let mut text = String::new();
        loop {
            match rx.recv().await {
                Some((_, Event::Token { text: t, .. })) => text.push_str(&t),
                Some((
                    _,
                    Event::Done {
                        finish,
                        completion_tokens,
                        ..
                    },
                )) => {
                    let mut blocks = Blocks::new(ctx);
                    let pieces = blocks.parse_whole(&text);
                    for p in pieces {
                        blocks.push(p, &mut |_, _| {});
                    }
                    let body = json!({"id": id, "type": "message", "role": "assistant",
                        "model": model, "content": blocks.content(),
                        "stop_reason": blocks.stop_reason(finish), "stop_sequence": null,
                        "usage": {"input_tokens": prompt_tokens,
                            "output_tokens": completion_tokens}});
                    return Ok(Json(body).into_response());
                }
                Some((_, Event::Error(e))) => return Err(ApiError::internal(e)),
                None => return Err(ApiError::internal("the engine dropped the request".into())),
            }
        }
    }

    let (sse_tx, sse_rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let _guard = guard;
        let mut out: Vec<(String, Value)> = vec![(
            "message_start".into(),
            json!({"type": "message_start", "message": {"id": id, "type": "message",
                "role": "assistant", "model": model, "content": [], "stop_reason": null,
                "stop_sequence": null,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}),
        )];
        let mut parser = ctx
            .as_ref()
            .map(|t| tool_calls::Parser::continuing(t.format, &t.prefix));
        let mut blocks = Blocks::new(ctx);
        loop {
            let Some((_, ev)) = rx.recv().await else {
                return;
            };
            let mut done = None;
            let pieces = match ev {
                Event::Token { text, .. } if text.is_empty() => Vec::new(),
                Event::Token { text, .. } => match parser.as_mut() {
                    Some(p) => p.push(&text),
                    None => vec![Piece::Text(text)],
                },
                Event::Done {
                    finish,
                    completion_tokens,
                    ..
                } => {
                    done = Some((finish, completion_tokens));
                    parser.as_mut().map(|p| p.finish()).unwrap_or_default()
                }
                Event::Error(e) => {
                    let err = json!({"type": "error",
                        "error": {"type": "api_error", "message": e}});
                    let _ = sse_tx
                        .send(Ok(SseEvent::default().event("error").data(err.to_string())))
                        .await;
                    return;
                }
            };
            let mut emit = |kind: &str, data: Value| out.push((kind.to_string(), data));
            for p in pieces {
                blocks.push(p, &mut emit);
            }
            if let Some((finish, ct)) = done {
                blocks.close_text(&mut emit);
                emit(
                    "message_delta",
                    json!({"type": "message_delta",
                        "delta": {"stop_reason": blocks.stop_reason(finish),
                            "stop_sequence": null},
                        "usage": {"output_tokens": ct}}),
                );
                emit("message_stop", json!({"type": "message_stop"}));
            }
            for (kind, data) in out.drain(..) {
                let e = SseEvent::default().event(kind).data(data.to_string());
                if sse_tx.send(Ok(e)).await.is_err() {
                    return;
                }
            }
            if done.is_some() {
                return;
            }
        }
    });
    Ok(Sse::new(ReceiverStream::new(sse_rx)).into_response())
}

/// The reply's content blocks as they form: text (one block per run of text) and tool_use.
struct Blocks {
    ctx: Option<ToolCtx>,
    content: Vec<Value>,
    /// Index of the open text block while streaming.
    open_text: Option<usize>,
    n_calls: usize,
}

impl Blocks {
    fn new(ctx: Option<ToolCtx>) -> Self {
        Blocks {
            ctx,
            content: Vec::new(),
            open_text: None,
            n_calls: 0,
        }
    }

    /// A whole reply as pieces: parsed for calls when tools are offered.
    fn parse_whole(&self, text: &str) -> Vec<Piece> {
        match &self.ctx {
            None => vec![Piece::Text(text.to_string())],
            Some(t) => {
                let mut p = tool_calls::Parser::continuing(t.format, &t.prefix);
                let mut pieces = p.push(text);
                pieces.extend(p.finish());
                // With calls, text that is only whitespace around them is dropped.
                if pieces.iter().any(|p| matches!(p, Piece::Call(_))) {
                    pieces.retain(|p| !matches!(p, Piece::Text(t) if t.trim().is_empty()));
                }
                pieces
            }
        }
    }

    fn keep(&self, c: &ToolCall) -> bool {
        let Some(t) = &self.ctx else { return false };
        (t.parallel || self.n_calls == 0) && t.only.as_ref().is_none_or(|n| *n == c.name)
    }

    fn push(&mut self, p: Piece, emit: &mut dyn FnMut(&str, Value)) {
        match p {
            Piece::Text(t) => {
                let i = match self.open_text {
                    Some(i) => i,
                    None => {
                        if self.n_calls > 0 && t.trim().is_empty() {
                            return; // whitespace between calls
                        }
                        let i = self.content.len();
                        self.content.push(json!({"type": "text", "text": ""}));
                        self.open_text = Some(i);
                        emit(
                            "content_block_start",
                            json!({"type": "content_block_start", "index": i,
                                "content_block": {"type": "text", "text": ""}}),
                        );
                        i
                    }
                };
                let cur = self.content[i]["text"].as_str().unwrap_or("").to_string();
                self.content[i]["text"] = json!(cur + &t);
                emit(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": i,
                        "delta": {"type": "text_delta", "text": t}}),
                );
            }
            Piece::Call(c) => {
                if !self.keep(&c) {
                    return;
                }
                self.close_text(emit);
                let input: Value = serde_json::from_str(&c.arguments).unwrap_or(json!({}));
                let id = format!("toolu_{}", &call_id()[5..]);
                let i = self.content.len();
                emit(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": i,
                        "content_block": {"type": "tool_use", "id": id, "name": c.name,
                            "input": {}}}),
                );
                emit(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": i,
                        "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
                );
                emit(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": i}),
                );
                self.content
                    .push(json!({"type": "tool_use", "id": id, "name": c.name, "input": input}));
                self.n_calls += 1;
            }
        }
    }

    fn close_text(&mut self, emit: &mut dyn FnMut(&str, Value)) {
        if let Some(i) = self.open_text.take() {
            emit(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": i}),
            );
        }
    }

    fn content(&self) -> Value {
        Value::Array(self.content.clone())
    }

    fn stop_reason(&self, finish: FinishReason) -> &'static str {
        if self.n_calls > 0 {
            "tool_use"
        } else if finish == FinishReason::Length {
            "max_tokens"
        } else {
            "end_turn"
        }
    }
}
