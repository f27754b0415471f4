//! Request schemas and their validation, apart from the routes: the bodies of
//! `/v1/completions` and `/v1/chat/completions` (the fields they share in [`Common`]), the checks
//! that turn them into an engine request's settings ([`build`]: prompt, budget, sampling, stop
//! strings), `n` and log-probabilities, and which grammar the reply must follow
//! ([`request_grammar`]). Chat messages and tools are read in [`crate::chat_request`], the
//! structured-output fields in [`crate::structured`].

use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use ferrum_llm::grammar::Grammar;
use ferrum_llm::SamplingParams;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::api::{ApiError, AppState};
use crate::chat_request::{Message, ToolCtx};
use crate::structured;

#[derive(Deserialize)]
#[serde(untagged)]
pub(crate) enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(crate) enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
}

#[derive(Deserialize)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    pub(crate) include_usage: bool,
}

/// The fields both endpoints share (unknown fields are ignored, as OpenAI's API does).
#[derive(Deserialize)]
pub(crate) struct Common {
    #[serde(default)]
    pub(crate) max_tokens: Option<u64>,
    #[serde(default)]
    pub(crate) max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub(crate) temperature: Option<f32>,
    #[serde(default)]
    pub(crate) top_p: Option<f32>,
    #[serde(default)]
    pub(crate) top_k: Option<i64>,
    #[serde(default)]
    pub(crate) min_p: Option<f32>,
    #[serde(default)]
    pub(crate) seed: Option<u64>,
    #[serde(default)]
    pub(crate) stop: Option<OneOrMany>,
    #[serde(default)]
    pub(crate) stream: bool,
    #[serde(default)]
    pub(crate) stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub(crate) n: Option<u64>,
    #[serde(default)]
    pub(crate) presence_penalty: Option<f32>,
    #[serde(default)]
    pub(crate) frequency_penalty: Option<f32>,
    #[serde(default)]
    pub(crate) ignore_eos: bool,
    #[serde(default)]
    pub(crate) min_tokens: Option<u64>,
    #[serde(default)]
    pub(crate) priority: Option<i64>,
    /// `response_format`, `guided_*`, `grammar`, `json_schema`: see [`structured`].
    #[serde(flatten)]
    pub(crate) structured: structured::Fields,
    #[serde(default)]
    pub(crate) logprobs: Option<Value>,
    #[serde(default)]
    pub(crate) top_logprobs: Option<Value>,
}

#[derive(Deserialize)]
pub(crate) struct CompletionBody {
    pub(crate) prompt: Prompt,
    #[serde(flatten)]
    pub(crate) common: Common,
}

#[derive(Deserialize)]
pub(crate) struct ChatBody {
    pub(crate) messages: Vec<Message>,
    /// As the client wrote it: the template sees its keys in the client's order.
    #[serde(default)]
    pub(crate) tools: Option<Box<RawValue>>,
    #[serde(default)]
    pub(crate) tool_choice: Option<Value>,
    #[serde(default)]
    pub(crate) parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub(crate) chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[serde(flatten)]
    pub(crate) common: Common,
}

pub(crate) fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("invalid request body: {e}"), None))
}

/// Checks the shared fields and builds the engine request (without its event channel).
pub(crate) fn build(
    st: &AppState,
    c: &Common,
    prompt: Vec<u32>,
    default_max: usize,
) -> Result<(Vec<u32>, usize, SamplingParams, Vec<String>), ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::bad("the prompt is empty", Some("prompt")));
    }
    if let Some(&bad) = prompt
        .iter()
        .find(|&&t| t as usize >= st.llm.model.config.n_vocab)
    {
        return Err(ApiError::bad(
            format!("token id {bad} is outside the vocabulary"),
            Some("prompt"),
        ));
    }
    let room = st.ctx_size.saturating_sub(prompt.len());
    if room == 0 {
        return Err(ApiError::bad(
            format!(
                "the prompt has {} tokens; this server's context is {} tokens",
                prompt.len(),
                st.ctx_size
            ),
            Some("prompt"),
        ));
    }
    let max = c.max_completion_tokens.or(c.max_tokens);
    let max_tokens = match max {
        Some(0) => {
            return Err(ApiError::bad(
                "max_tokens must be at least 1",
                Some("max_tokens"),
            ))
        }
        Some(m) if m as usize > room => {
            return Err(ApiError::bad(
                format!(
                    "prompt ({} tokens) + max_tokens ({m}) exceeds the context of {} tokens",
                    prompt.len(),
                    st.ctx_size
                ),
                Some("max_tokens"),
            ))
        }
        Some(m) => m as usize,
        None => default_max.min(room),
    };
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad(
            "temperature must be between 0 and 2",
            Some("temperature"),
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad("top_p must be in (0, 1]", Some("top_p")));
    }
    let top_k = match c.top_k.unwrap_or(0) {
        k if k < -1 => {
            return Err(ApiError::bad(
                "top_k must be -1, 0 or positive",
                Some("top_k"),
            ))
        }
        k if k <= 0 => 0,
        k => k as usize,
    };
    let min_p = c.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::bad("min_p must be in [0, 1]", Some("min_p")));
    }
    let presence = c.presence_penalty.unwrap_or(0.0);
    let frequency = c.frequency_penalty.unwrap_or(0.0);
    for (v, name) in [
        (presence, "presence_penalty"),
        (frequency, "frequency_penalty"),
    ] {
        if !(-2.0..=2.0).contains(&v) {
            return Err(ApiError::bad(
                format!("{name} must be between -2 and 2"),
                None,
            ));
        }
    }
    let sampling = SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        repeat_penalty: 1.0,
        presence_penalty: presence,
        frequency_penalty: frequency,
        penalty_last_n: 64,
        seed: c.seed.unwrap_or_else(rand_seed),
    };
    sampling.validate().map_err(|e| ApiError::bad(e, None))?;
    let stop = match &c.stop {
        None => Vec::new(),
        Some(OneOrMany::One(s)) => vec![s.clone()],
        Some(OneOrMany::Many(v)) => v.clone(),
    };
    if stop.len() > 4 || stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::bad(
            "stop takes up to 4 non-empty strings",
            Some("stop"),
        ));
    }
    Ok((prompt, max_tokens, sampling, stop))
}

pub(crate) fn rand_seed() -> u64 {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    t ^ (t >> 29).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    Completion,
    Chat,
}

/// Largest `n` (choices per request) and `logprobs` / `top_logprobs` accepted.
pub(crate) const MAX_N: u64 = 16;
const MAX_TOP_LOGPROBS: u64 = 20;

/// How many alternatives per token the request wants log-probabilities for (`None`: no
/// log-probabilities). Completions take `logprobs: k`; chat takes `logprobs: true` with an optional
/// `top_logprobs: k`.
pub(crate) fn parse_logprobs(c: &Common, kind: Kind) -> Result<Option<usize>, ApiError> {
    let count = |v: &Value, name: &'static str| -> Result<usize, ApiError> {
        match v.as_u64() {
            Some(k) if k <= MAX_TOP_LOGPROBS => Ok(k as usize),
            _ => Err(ApiError::bad(
                format!("{name} must be an integer from 0 to {MAX_TOP_LOGPROBS}"),
                Some(name),
            )),
        }
    };
    match kind {
        Kind::Completion => match &c.logprobs {
            None | Some(Value::Null) => Ok(None),
            Some(v) => count(v, "logprobs").map(Some),
        },
        Kind::Chat => {
            let on = match &c.logprobs {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::bad(
                        "logprobs must be a boolean",
                        Some("logprobs"),
                    ))
                }
            };
            let top = match &c.top_logprobs {
                None | Some(Value::Null) => 0,
                Some(v) => count(v, "top_logprobs")?,
            };
            if top > 0 && !on {
                return Err(ApiError::bad(
                    "top_logprobs needs logprobs: true",
                    Some("top_logprobs"),
                ));
            }
            Ok(on.then_some(top))
        }
    }
}

/// Log-probabilities of a run of tokens in the endpoint's format. `offset` is the text length
/// before the first of them (completions report each token's text offset).
/// The grammar a request's reply must follow, and the field that asks for it: its
/// structured-output fields, or a required tool call's grammar; both at once are refused.
pub(crate) fn request_grammar(
    c: &Common,
    tools: Option<&ToolCtx>,
) -> Result<Option<(&'static str, Grammar)>, ApiError> {
    let asked = c.structured.grammar()?;
    let forced = tools.and_then(|t| t.grammar.clone());
    match (asked, forced) {
        (Some(_), Some(_)) => Err(ApiError::bad(
            "a structured output cannot be combined with a required tool call",
            Some("response_format"),
        )),
        (Some(g), None) => Ok(Some(g)),
        (None, Some(g)) => Ok(Some(("tools", g))),
        (None, None) => Ok(None),
    }
}
