//! vLLM's `POST /tokenize` and `POST /detokenize`: the model's tokenizer over HTTP, so clients
//! can count and inspect tokens as the server sees them.
//!
//! - `/tokenize` `{"prompt": text, "add_special_tokens": true}` or `{"messages": [...],
//!   "add_generation_prompt": true}` (with the chat endpoint's `tools`, `tool_choice`,
//!   `parallel_tool_calls` and `chat_template_kwargs`; rendered by the chat template exactly as
//!   the chat endpoint does, a forced call's opening included, and refused as it refuses)
//!   -> `{"tokens": [...], "count": n, "max_model_len": ctx}`.
//! - `/detokenize` `{"tokens": [...]}` -> `{"prompt": text}`; an id outside the vocabulary is 400.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::api::{ApiError, AppState};
use crate::chat_request::{self, Message, ToolsIn};
use crate::request::parse;

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
struct TokenizeBody {
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    tools: Option<Box<RawValue>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[serde(default = "yes")]
    add_special_tokens: bool,
    #[serde(default = "yes")]
    add_generation_prompt: bool,
}

#[derive(Deserialize)]
struct DetokenizeBody {
    tokens: Vec<u64>,
}

pub async fn tokenize(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let b: TokenizeBody = parse(&body?)?;
    let tokens = match (b.prompt, b.messages) {
        (Some(p), None) => st.llm.tokenizer.encode(&p, b.add_special_tokens, false),
        (None, Some(msgs)) => {
            let parts = ToolsIn {
                tools: b.tools.as_deref(),
                choice: b.tool_choice.as_ref(),
                parallel: b.parallel_tool_calls,
                kwargs: b.chat_template_kwargs.as_ref(),
            };
            let (rendered, _) =
                chat_request::render(&st.template, msgs, parts, b.add_generation_prompt)?;
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
