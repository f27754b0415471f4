//! OpenAI's Responses API, `POST /v1/responses`, stateless: the whole conversation comes in
//! `input` (a string, or items: messages with text content, `function_call` and
//! `function_call_output`), with `instructions` as the system message, function `tools` and
//! `tool_choice`, `max_output_tokens`, `temperature`, `top_p`. The reply is a `response` object
//! whose `output` holds a `message` item (`output_text` content) and `function_call` items;
//! with `stream: true` it arrives as the `response.*` server-sent events (`response.created`,
//! `response.output_item.added`, `response.output_text.delta`, ..., `response.completed`).
//! Conversation state (`previous_response_id`, `store`) is not kept: a request that needs it is
//! refused.

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

use crate::api::{call_id, now, response_id, submit_one, ApiError, AppState, Submitted};
use crate::chat_request::{tool_context, ToolCtx};
use crate::engine::Event;
use crate::request::{parse, Common};
use crate::tool_calls::{self, Piece};

#[derive(Deserialize)]
struct Body {
    input: Value,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    text: Option<Value>,
}

fn bad(m: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad(m, Some(param))
}

/// The text of a message's content: a string, or parts of type `input_text`/`output_text`/`text`.
fn content_text(c: &Value, at: usize) -> Result<String, ApiError> {
    match c {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut s = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("input_text" | "output_text" | "text"), Some(Value::String(t))) => {
                        s.push_str(t)
                    }
                    (kind, _) => {
                        return Err(bad(
                            format!(
                                "input[{at}]: content parts of type {} are not supported",
                                kind.unwrap_or("(none)")
                            ),
                            "input",
                        ))
                    }
                }
            }
            Ok(s)
        }
        other => Err(bad(
            format!("input[{at}].content must be a string or a list of parts, found {other}"),
            "input",
        )),
    }
}

/// `instructions` and `input` as chat messages (the JSON the template reads): consecutive
/// `function_call` items become one assistant turn with `tool_calls`, each
/// `function_call_output` a `tool` message.
fn messages(b: &Body) -> Result<Vec<Value>, ApiError> {
    let mut msgs = Vec::new();
    if let Some(i) = &b.instructions {
        msgs.push(json!({"role": "system", "content": i}));
    }
    let items = match &b.input {
        Value::String(s) => return Ok([msgs, vec![json!({"role": "user", "content": s})]].concat()),
        Value::Array(items) if !items.is_empty() => items,
        _ => {
            return Err(bad(
                "input must be a string or a non-empty list of items",
                "input",
            ))
        }
    };
    for (at, it) in items.iter().enumerate() {
        let kind = it.get("type").and_then(Value::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let role = match it.get("role").and_then(Value::as_str) {
                    Some(r @ ("system" | "user" | "assistant")) => r,
                    Some("developer") => "system",
                    other => {
                        return Err(bad(format!("input[{at}]: unknown role {other:?}"), "input"))
                    }
                };
                let text = content_text(it.get("content").unwrap_or(&Value::Null), at)?;
                msgs.push(json!({"role": role, "content": text}));
            }
            "function_call" => {
                let (Some(id), Some(name)) = (
                    it.get("call_id").and_then(Value::as_str),
                    it.get("name").and_then(Value::as_str),
                ) else {
                    return Err(bad(
                        format!("input[{at}]: a function_call needs call_id and name"),
                        "input",
                    ));
                };
                let args = match it.get("arguments") {
                    Some(Value::String(a)) => serde_json::from_str(a).unwrap_or_else(|_| json!(a)),
                    Some(a) => a.clone(),
                    None => json!({}),
                };
                let call = json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": args}});
                // Calls in a row are one assistant turn.
                match msgs.last_mut() {
                    Some(m) if m["role"] == "assistant" && m.get("tool_calls").is_some() => {
                        m["tool_calls"].as_array_mut().expect("array").push(call)
                    }
                    _ => msgs.push(json!({"role": "assistant", "content": "",
                        "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let Some(id) = it.get("call_id").and_then(Value::as_str) else {
                    return Err(bad(
                        format!("input[{at}]: a function_call_output needs its call_id"),
                        "input",
                    ));
                };
                let out = match it.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v) => v.to_string(),
                    None => String::new(),
                };
                msgs.push(json!({"role": "tool", "tool_call_id": id, "content": out}));
            }
            // Reasoning items of an earlier turn carry nothing the template shows.
            "reasoning" => {}
            other => {
                return Err(bad(
                    format!("input[{at}]: items of type '{other}' are not supported"),
                    "input",
                ))
            }
        }
    }
    Ok(msgs)
}

/// Responses-style function tools (`{type, name, description, parameters}`) in chat form, and
/// `tool_choice` likewise (`{type: "function", name}` -> `{type, function: {name}}`).
fn chat_tools(b: &Body) -> Result<(Vec<Value>, Option<Value>), ApiError> {
    let mut out = Vec::new();
    for (i, t) in b.tools.iter().flatten().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(
                format!("tools[{i}]: only function tools are supported"),
                "tools",
            ));
        }
        let mut f = serde_json::Map::new();
        for k in ["name", "description", "parameters"] {
            if let Some(v) = t.get(k).filter(|v| !v.is_null()) {
                f.insert(k.into(), v.clone());
            }
        }
        out.push(json!({"type": "function", "function": f}));
    }
    let choice = match &b.tool_choice {
        Some(c @ Value::Object(o)) if o.get("function").is_none() => match o.get("name") {
            Some(n) => Some(json!({"type": "function", "function": {"name": n}})),
            None => Some(c.clone()),
        },
        other => other.clone(),
    };
    Ok((out, choice))
}

pub async fn responses(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let b: Body = parse(&body?)?;
    if b.previous_response_id.is_some() {
        return Err(bad(
            "previous_response_id is not supported: this server keeps no conversation state; \
             send the whole conversation in input",
            "previous_response_id",
        ));
    }
    // `text.format` is the chat endpoint's response_format with the schema one level up.
    let response_format = match b.text.as_ref().and_then(|t| t.get("format")) {
        None => Value::Null,
        Some(f) => match f.get("type").and_then(Value::as_str) {
            Some("text") => Value::Null,
            Some("json_object") => json!({"type": "json_object"}),
            Some("json_schema") => {
                let schema = f
                    .get("schema")
                    .ok_or_else(|| bad("text.format json_schema needs a schema", "text"))?;
                json!({"type": "json_schema", "json_schema": {"schema": schema}})
            }
            _ => {
                return Err(bad(
                    "text.format.type must be \"text\", \"json_object\" or \"json_schema\"",
                    "text",
                ))
            }
        },
    };
    let msgs = messages(&b)?;
    let (tools, choice) = chat_tools(&b)?;
    let ctx = tool_context(
        st.template.source(),
        &tools,
        choice.as_ref(),
        b.parallel_tool_calls,
    )?;
    let offered = ctx.is_some().then_some(Value::Array(tools));
    let mut rendered = st
        .template
        .render_json(
            &Value::Array(msgs),
            offered.as_ref(),
            &Default::default(),
            true,
        )
        .map_err(|e| bad(format!("chat template: {e}"), "input"))?;
    if let Some(t) = &ctx {
        rendered.push_str(&t.prefix);
    }
    let prompt = st.llm.encode_rendered_chat(&rendered);
    let common: Common = serde_json::from_value(json!({
        "max_tokens": b.max_output_tokens, "temperature": b.temperature, "top_p": b.top_p,
        "seed": b.seed, "stream": b.stream, "response_format": response_format,
    }))
    .map_err(|e| bad(format!("invalid request: {e}"), "input"))?;
    let Submitted {
        mut rx,
        guard,
        prompt_tokens,
    } = match submit_one(&st, &common, prompt, ctx.as_ref()).await? {
        Ok(s) => s,
        Err(busy) => return Ok(busy),
    };
    let id = format!(
        "resp_{}",
        response_id(st.next_id.fetch_add(1, Ordering::Relaxed))
    );
    let msg_id = format!(
        "msg_{}",
        response_id(st.next_id.fetch_add(1, Ordering::Relaxed))
    );
    let shell = Shell {
        id,
        msg_id,
        created: now(),
        model: st.model_id.clone(),
        b_tools: b.tools.clone().unwrap_or_default(),
        tool_choice: b.tool_choice.clone().unwrap_or(json!("auto")),
        parallel: b.parallel_tool_calls.unwrap_or(true),
        temperature: b.temperature,
        top_p: b.top_p,
        max_output_tokens: b.max_output_tokens,
        instructions: b.instructions.clone(),
    };

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
                        cached_tokens,
                        ..
                    },
                )) => {
                    let mut out = Output::new(&shell.msg_id);
                    out.push_pieces(&ctx, tool_pieces(&ctx, &text), &text);
                    let usage = usage(prompt_tokens, completion_tokens, cached_tokens);
                    return Ok(Json(shell.response(&out.items(), finish, usage)).into_response());
                }
                Some((_, Event::Error(e))) => return Err(ApiError::internal(e)),
                None => return Err(ApiError::internal("the engine dropped the request".into())),
            }
        }
    }

    let (sse_tx, sse_rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let _guard = guard;
        let mut seq = 0u64;
        let mut events: Vec<(String, Value)> = Vec::new();
        let mut emit = |kind: &str, mut data: Value, events: &mut Vec<(String, Value)>| {
            data["type"] = json!(kind);
            data["sequence_number"] = json!(seq);
            seq += 1;
            events.push((kind.to_string(), data));
        };
        let in_progress = shell.in_progress();
        emit(
            "response.created",
            json!({"response": in_progress}),
            &mut events,
        );
        emit(
            "response.in_progress",
            json!({"response": in_progress}),
            &mut events,
        );
        let mut parser = ctx
            .as_ref()
            .map(|t| tool_calls::Parser::continuing(t.format, &t.prefix));
        let mut out = Output::new(&shell.msg_id);
        loop {
            let Some((_, ev)) = rx.recv().await else {
                return;
            };
            let (pieces, done) = match ev {
                Event::Token { text, .. } if text.is_empty() => continue,
                Event::Token { text, .. } => match parser.as_mut() {
                    Some(p) => (p.push(&text), None),
                    None => (vec![Piece::Text(text)], None),
                },
                Event::Done {
                    finish,
                    completion_tokens,
                    cached_tokens,
                    ..
                } => {
                    let rest = parser.as_mut().map(|p| p.finish()).unwrap_or_default();
                    (rest, Some((finish, completion_tokens, cached_tokens)))
                }
                Event::Error(e) => {
                    let err = json!({"type": "error", "code": "server_error", "message": e,
                        "sequence_number": seq});
                    let _ = sse_tx
                        .send(Ok(SseEvent::default().event("error").data(err.to_string())))
                        .await;
                    return;
                }
            };
            for p in pieces {
                out.stream_piece(&ctx, p, &mut |k, d| emit(k, d, &mut events));
            }
            let last = done.is_some();
            if let Some((finish, ct, cached)) = done {
                out.close_message(&mut |k, d| emit(k, d, &mut events));
                let full = shell.response(&out.items(), finish, usage(prompt_tokens, ct, cached));
                let kind = if finish == FinishReason::Length {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                emit(kind, json!({"response": full}), &mut events);
            }
            for (kind, data) in events.drain(..) {
                let e = SseEvent::default().event(kind).data(data.to_string());
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

/// Pieces of a whole reply: parsed for calls when tools are offered.
fn tool_pieces(ctx: &Option<ToolCtx>, text: &str) -> Vec<Piece> {
    match ctx {
        None => vec![Piece::Text(text.to_string())],
        Some(t) => {
            let mut p = tool_calls::Parser::continuing(t.format, &t.prefix);
            let mut pieces = p.push(text);
            pieces.extend(p.finish());
            pieces
        }
    }
}

fn usage(input: usize, output: usize, cached: usize) -> Value {
    json!({"input_tokens": input, "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input + output})
}

/// The request's fields the response echoes.
struct Shell {
    id: String,
    msg_id: String,
    created: u64,
    model: String,
    b_tools: Vec<Value>,
    tool_choice: Value,
    parallel: bool,
    temperature: Option<f32>,
    top_p: Option<f32>,
    max_output_tokens: Option<u64>,
    instructions: Option<String>,
}

impl Shell {
    fn base(&self, status: &str, output: &[Value]) -> Value {
        json!({"id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model, "output": output, "error": null,
            "incomplete_details": null, "instructions": self.instructions,
            "tools": self.b_tools, "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel, "temperature": self.temperature,
            "top_p": self.top_p, "max_output_tokens": self.max_output_tokens,
            "text": {"format": {"type": "text"}}, "metadata": {}, "store": false,
            "usage": null})
    }

    fn in_progress(&self) -> Value {
        self.base("in_progress", &[])
    }

    fn response(&self, output: &[Value], finish: FinishReason, usage: Value) -> Value {
        let incomplete = finish == FinishReason::Length;
        let mut r = self.base(
            if incomplete {
                "incomplete"
            } else {
                "completed"
            },
            output,
        );
        if incomplete {
            r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        r["usage"] = usage;
        r
    }
}

/// The output items as they form: at most one message (its text accumulated) and the calls,
/// in the order they appear.
struct Output {
    msg_id: String,
    items: Vec<Value>,
    /// Index in `items` of the open message, if any.
    message: Option<usize>,
    n_calls: usize,
}

impl Output {
    fn new(msg_id: &str) -> Self {
        Output {
            msg_id: msg_id.to_string(),
            items: Vec::new(),
            message: None,
            n_calls: 0,
        }
    }

    fn message_item(&self, text: &str, status: &str) -> Value {
        json!({"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                "logprobs": []}]})
    }

    fn call_item(c: &tool_calls::ToolCall) -> Value {
        let call = call_id();
        json!({"type": "function_call", "id": format!("fc_{}", &call[5..]), "call_id": call,
            "name": c.name, "arguments": c.arguments, "status": "completed"})
    }

    fn keep_call(&self, ctx: &Option<ToolCtx>, c: &tool_calls::ToolCall) -> bool {
        let Some(t) = ctx else { return false };
        (t.parallel || self.n_calls == 0) && t.only.as_ref().is_none_or(|n| *n == c.name)
    }

    /// A whole reply's pieces (non-streaming); `raw` is the reply as generated.
    fn push_pieces(&mut self, ctx: &Option<ToolCtx>, pieces: Vec<Piece>, raw: &str) {
        let (content, calls) = tool_calls::split(pieces);
        // Without calls the message is the reply as it came; with calls, the text around them.
        let text = if calls.is_empty() {
            Some(raw.to_string())
        } else {
            content
        };
        if let Some(t) = text {
            self.items.push(self.message_item(&t, "completed"));
        }
        for c in &calls {
            if self.keep_call(ctx, c) {
                self.items.push(Self::call_item(c));
                self.n_calls += 1;
            }
        }
    }

    /// One streamed piece: text goes to the message (opened on first text), a call becomes a
    /// complete function_call item.
    fn stream_piece(&mut self, ctx: &Option<ToolCtx>, p: Piece, emit: &mut dyn FnMut(&str, Value)) {
        match p {
            Piece::Text(t) => {
                let i = match self.message {
                    Some(i) => i,
                    None => {
                        let i = self.items.len();
                        self.items.push(self.message_item("", "in_progress"));
                        self.message = Some(i);
                        emit(
                            "response.output_item.added",
                            json!({"output_index": i, "item": {"type": "message",
                                "id": self.msg_id, "status": "in_progress",
                                "role": "assistant", "content": []}}),
                        );
                        emit(
                            "response.content_part.added",
                            json!({"item_id": self.msg_id, "output_index": i,
                                "content_index": 0, "part": {"type": "output_text", "text": "",
                                "annotations": []}}),
                        );
                        i
                    }
                };
                let cur = self.items[i]["content"][0]["text"]
                    .as_str()
                    .unwrap_or("")
                    .to_string();
                self.items[i]["content"][0]["text"] = json!(cur + &t);
                emit(
                    "response.output_text.delta",
                    json!({"item_id": self.msg_id, "output_index": i, "content_index": 0,
                        "delta": t, "logprobs": []}),
                );
            }
            Piece::Call(c) => {
                if !self.keep_call(ctx, &c) {
                    return;
                }
                let item = Self::call_item(&c);
                let i = self.items.len();
                let mut added = item.clone();
                added["status"] = json!("in_progress");
                added["arguments"] = json!("");
                emit(
                    "response.output_item.added",
                    json!({"output_index": i, "item": added}),
                );
                emit(
                    "response.function_call_arguments.delta",
                    json!({"item_id": item["id"], "output_index": i, "delta": c.arguments}),
                );
                emit(
                    "response.function_call_arguments.done",
                    json!({"item_id": item["id"], "output_index": i,
                        "arguments": c.arguments}),
                );
                emit(
                    "response.output_item.done",
                    json!({"output_index": i, "item": item}),
                );
                self.items.push(item);
                self.n_calls += 1;
            }
        }
    }

    /// Closes the streamed message, if one was opened.
    fn close_message(&mut self, emit: &mut dyn FnMut(&str, Value)) {
        let Some(i) = self.message.take() else { return };
        let text = self.items[i]["content"][0]["text"]
            .as_str()
            .unwrap_or("")
            .to_string();
        self.items[i] = self.message_item(&text, "completed");
        emit(
            "response.output_text.done",
            json!({"item_id": self.msg_id, "output_index": i, "content_index": 0,
                "text": text, "logprobs": []}),
        );
        emit(
            "response.content_part.done",
            json!({"item_id": self.msg_id, "output_index": i, "content_index": 0,
                "part": {"type": "output_text", "text": text, "annotations": []}}),
        );
        emit(
            "response.output_item.done",
            json!({"output_index": i, "item": self.items[i]}),
        );
    }

    fn items(&self) -> Vec<Value> {
        self.items.clone()
    }
}
