//! vLLM's `POST /tokenize` and `POST /detokenize`: the model's tokenizer over HTTP, so clients
//! can count and inspect tokens as the server sees them.
//!
//! - `/tokenize` `{"prompt": text, "add_special_tokens": true}` or `{"messages": [...],
//!   "add_generation_prompt": true}` (rendered by the chat template, as the chat endpoint does)
//!   -> `{"tokens": [...], "count": n, "max_model_len": ctx}`.
//! - `/detokenize` `{"tokens": [...]}` -> `{"prompt": text}`; an id outside the vocabulary is 400.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::api::{parse, ApiError, AppState};

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
struct TokenizeBody {
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<Value>>,
    #[serde(default = "yes")]
    add_special_tokens: bool,
    #[serde(default = "yes")]
    add_generation_prompt: bool,
}

#[derive(Deserialize)]
struct DetokenizeBody {
    tokens: Vec<u64>,
}

/// A message's text: a string, or `text` parts.
fn message_text(m: &Value, at: usize) -> Result<String, ApiError> {
    match m.get("content") {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(
                |p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => Ok(t.clone()),
                    _ => Err(ApiError::bad(
                        format!("messages[{at}]: only text content parts are supported"),
                        Some("messages"),
                    )),
                },
            )
            .collect(),
        Some(other) => Err(ApiError::bad(
            format!("messages[{at}].content must be text, found {other}"),
            Some("messages"),
        )),
    }
}

pub async fn tokenize(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let b: TokenizeBody = parse(&body?)?;
    let tokens = match (b.prompt, b.messages) {
        (Some(p), None) => st.llm.tokenizer.encode(&p, b.add_special_tokens, false),
        (None, Some(msgs)) => {
            let mut chat = Vec::with_capacity(msgs.len());
            for (at, m) in msgs.iter().enumerate() {
                let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::bad(format!("messages[{at}] has no role"), Some("messages"))
                })?;
                chat.push(json!({"role": role, "content": message_text(m, at)?}));
            }
            let rendered = st
                .template
                .render_json(
                    &Value::Array(chat),
                    None,
                    &Default::default(),
                    b.add_generation_prompt,
                )
                .map_err(|e| ApiError::bad(format!("chat template: {e}"), Some("messages")))?;
            st.llm.encode_rendered_chat(&rendered)
        }
        _ => {
            return Err(ApiError::bad(
                "give exactly one of prompt and messages",
                Some("prompt"),
            ))
        }
    };
    Ok(Json(json!({"tokens": tokens, "count": tokens.len(),
        "max_model_len": st.ctx_size}))
    .into_response())
}

pub async fn detokenize(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let b: DetokenizeBody = parse(&body?)?;
    let n_vocab = st.llm.tokenizer.vocab_size();
    let mut ids = Vec::with_capacity(b.tokens.len());
    for &t in &b.tokens {
        if t >= n_vocab as u64 {
            return Err(ApiError::bad(
                format!("token id {t} is outside the vocabulary of {n_vocab}"),
                Some("tokens"),
            ));
        }
        ids.push(t as u32);
    }
    Ok(Json(json!({"prompt": st.llm.tokenizer.decode(&ids, false)})).into_response())
}
