//! Structured output: the request fields that constrain a reply to a grammar, read into one
//! [`Grammar`], and compiled for the engine.
//!
//! Accepted (at most one per request):
//! - OpenAI's `response_format`: `{"type": "text"}`, `{"type": "json_object"}`, `{"type":
//!   "json_schema", "json_schema": {"name", "schema", "strict"}}` (llama.cpp's `{"type":
//!   "json_object" | "json_schema", "schema": {...}}` too);
//! - vLLM's `guided_json` (a schema, or its JSON text), `guided_regex`, `guided_choice`,
//!   `guided_grammar` (GBNF when it has `::=` rules, else Lark), and its newer
//!   `structured_outputs: {json | regex | choice | grammar}`;
//! - llama.cpp's `json_schema` and `grammar` (GBNF).
//!
//! A grammar that does not compile, or admits no output, is a 400 naming the field. Compiling
//! runs off the async runtime, bounded by the grammar engine's limits and by [`COMPILE_TIMEOUT`].

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use ferrum_llm::grammar::{Constraint, Grammar, Grammars};
use serde::Deserialize;
use serde_json::Value;

use crate::api::{ApiError, AppState};

/// The longest a grammar may take to compile before the request is refused.
pub const COMPILE_TIMEOUT: Duration = Duration::from_secs(10);

/// The structured-output fields of a completion or chat request.
#[derive(Deserialize, Default, Debug)]
pub(crate) struct Fields {
    #[serde(default)]
    pub(crate) response_format: Option<Value>,
    #[serde(default)]
    guided_json: Option<Value>,
    #[serde(default)]
    guided_regex: Option<Value>,
    #[serde(default)]
    guided_choice: Option<Value>,
    #[serde(default)]
    guided_grammar: Option<Value>,
    #[serde(default)]
    structured_outputs: Option<Value>,
    #[serde(default)]
    json_schema: Option<Value>,
    #[serde(default)]
    grammar: Option<Value>,
}

fn bad(m: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad(m, Some(param))
}

/// A schema given as an object (or boolean), or as its JSON text.
fn schema(v: &Value, param: &'static str) -> Result<Grammar, ApiError> {
    let v = match v {
        Value::String(s) => serde_json::from_str(s)
            .map_err(|e| bad(format!("{param}: the schema is not valid JSON: {e}"), param))?,
        other => other.clone(),
    };
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(Grammar::JsonSchema(v)),
        _ => Err(bad(format!("{param} must be a JSON Schema object"), param)),
    }
}

fn text<'a>(v: &'a Value, param: &'static str) -> Result<&'a str, ApiError> {
    v.as_str()
        .filter(|s| !s.trim().is_empty())
        .ok_or_else(|| bad(format!("{param} must be a non-empty string"), param))
}

fn choices(v: &Value, param: &'static str) -> Result<Grammar, ApiError> {
    let list = v.as_array().filter(|a| !a.is_empty()).ok_or_else(|| {
        bad(
            format!("{param} must be a non-empty list of strings"),
            param,
        )
    })?;
    let mut out = Vec::with_capacity(list.len());
    for c in list {
        match c.as_str() {
            Some(s) if !s.is_empty() => out.push(s.to_string()),
            _ => {
                return Err(bad(
                    format!("{param} must be a non-empty list of non-empty strings"),
                    param,
                ))
            }
        }
    }
    Ok(Grammar::Choice(out))
}

/// A grammar in GBNF (it defines rules with `::=`) or in Lark.
fn ebnf(s: &str) -> Grammar {
    if s.contains("::=") {
        Grammar::Gbnf(s.to_string())
    } else {
        Grammar::Lark(s.to_string())
    }
}

fn response_format(f: &Value) -> Result<Option<Grammar>, ApiError> {
    const P: &str = "response_format";
    let kind = f.get("type").and_then(Value::as_str);
    match kind {
        Some("text") => Ok(None),
        Some("json_object") => match f.get("schema") {
            Some(s) => schema(s, P).map(Some),
            None => Ok(Some(Grammar::JsonObject)),
        },
        Some("json_schema") => {
            let s = f
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .or_else(|| f.get("schema"))
                .ok_or_else(|| bad("response_format json_schema needs json_schema.schema", P))?;
            schema(s, P).map(Some)
        }
        _ => Err(bad(
            "response_format.type must be \"text\", \"json_object\" or \"json_schema\"",
            P,
        )),
    }
}

impl Fields {
    /// The grammar these fields ask for, if any, and the field that asked. Two at once are
    /// refused.
    pub(crate) fn grammar(&self) -> Result<Option<(&'static str, Grammar)>, ApiError> {
        let mut found: Vec<(&'static str, Grammar)> = Vec::new();
        if let Some(f) = &self.response_format {
            if let Some(g) = response_format(f)? {
                found.push(("response_format", g));
            }
        }
        if let Some(v) = &self.guided_json {
            found.push(("guided_json", schema(v, "guided_json")?));
        }
        if let Some(v) = &self.guided_regex {
            found.push((
                "guided_regex",
                Grammar::Regex(text(v, "guided_regex")?.to_string()),
            ));
        }
        if let Some(v) = &self.guided_choice {
            found.push(("guided_choice", choices(v, "guided_choice")?));
        }
        if let Some(v) = &self.guided_grammar {
            found.push(("guided_grammar", ebnf(text(v, "guided_grammar")?)));
        }
        if let Some(v) = &self.json_schema {
            found.push(("json_schema", schema(v, "json_schema")?));
        }
        if let Some(v) = &self.grammar {
            found.push(("grammar", ebnf(text(v, "grammar")?)));
        }
        if let Some(so) = &self.structured_outputs {
            const P: &str = "structured_outputs";
            let o = so
                .as_object()
                .ok_or_else(|| bad("structured_outputs must be an object", P))?;
            for (k, v) in o {
                let g = match k.as_str() {
                    "json" => schema(v, P)?,
                    "regex" => Grammar::Regex(text(v, P)?.to_string()),
                    "choice" => choices(v, P)?,
                    "grammar" => ebnf(text(v, P)?),
                    "json_object" if v.as_bool() == Some(true) => Grammar::JsonObject,
                    // Backend hints and the like do not constrain.
                    "disable_fallback"
                    | "disable_any_whitespace"
                    | "disable_additional_properties"
                    | "whitespace_pattern"
                    | "backend"
                    | "json_object" => continue,
                    other => {
                        return Err(bad(
                            format!("structured_outputs.{other} is not supported"),
                            P,
                        ))
                    }
                };
                found.push((P, g));
            }
        }
        match found.len() {
            0 => Ok(None),
            1 => Ok(found.pop()),
            _ => Err(bad(
                format!(
                    "only one structured output may be asked for; found {}",
                    found.iter().map(|f| f.0).collect::<Vec<_>>().join(" and ")
                ),
                found[1].0,
            )),
        }
    }
}

impl AppState {
    /// The grammar compiler for this model's vocabulary, built on first use.
    fn grammars(&self) -> Result<Arc<Grammars>, ApiError> {
        self.grammars
            .get_or_init(|| {
                let t = std::time::Instant::now();
                let g = Grammars::new(Arc::clone(&self.llm.tokenizer)).map_err(|e| e.to_string());
                tracing::info!(
                    seconds = t.elapsed().as_secs_f64(),
                    "grammar compiler built for the vocabulary"
                );
                g.map(Arc::new)
            })
            .clone()
            .map_err(|e| ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: format!("constrained decoding is unavailable: {e}"),
                param: None,
            })
    }
}

/// Compiles `grammar` for the engine (off the async runtime, at most [`COMPILE_TIMEOUT`]).
/// `param` names the request field a compile error is reported against.
pub(crate) async fn compile(
    st: &Arc<AppState>,
    grammar: Grammar,
    param: &'static str,
) -> Result<Constraint, ApiError> {
    let st2 = Arc::clone(st);
    let job = tokio::task::spawn_blocking(move || {
        let grammars = st2.grammars()?;
        grammars
            .compile(&grammar)
            .map_err(|e| bad(format!("{param}: {e}"), param))
    });
    match tokio::time::timeout(COMPILE_TIMEOUT, job).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Err(ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: format!("grammar compilation failed: {e}"),
            param: None,
        }),
        Err(_) => Err(bad(
            format!(
                "{param}: the grammar took longer than {} s to compile",
                COMPILE_TIMEOUT.as_secs()
            ),
            param,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(v: Value) -> Fields {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn each_field_gives_its_grammar() {
        let s = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        for (body, want) in [
            (json!({}), None),
            (json!({"response_format": {"type": "text"}}), None),
            (
                json!({"response_format": {"type": "json_object"}}),
                Some(Grammar::JsonObject),
            ),
            (
                json!({"response_format": {"type": "json_object", "schema": s}}),
                Some(Grammar::JsonSchema(s.clone())),
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s, "strict": true}}}),
                Some(Grammar::JsonSchema(s.clone())),
            ),
            (
                json!({"guided_json": s.to_string()}),
                Some(Grammar::JsonSchema(s.clone())),
            ),
            (
                json!({"guided_regex": "[0-9]+"}),
                Some(Grammar::Regex("[0-9]+".into())),
            ),
            (
                json!({"guided_choice": ["a", "b"]}),
                Some(Grammar::Choice(vec!["a".into(), "b".into()])),
            ),
            (
                json!({"guided_grammar": "root ::= \"x\""}),
                Some(Grammar::Gbnf("root ::= \"x\"".into())),
            ),
            (
                json!({"guided_grammar": "start: \"x\""}),
                Some(Grammar::Lark("start: \"x\"".into())),
            ),
            (
                json!({"grammar": "root ::= \"x\""}),
                Some(Grammar::Gbnf("root ::= \"x\"".into())),
            ),
            (
                json!({"json_schema": s}),
                Some(Grammar::JsonSchema(s.clone())),
            ),
            (
                json!({"structured_outputs": {"choice": ["y"], "backend": "x"}}),
                Some(Grammar::Choice(vec!["y".into()])),
            ),
        ] {
            let got = fields(body.clone()).grammar().unwrap().map(|g| g.1);
            assert_eq!(got, want, "{body}");
        }
    }

    #[test]
    fn bad_fields_are_refused() {
        for (body, want) in [
            (
                json!({"response_format": {"type": "xml"}}),
                "response_format.type",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "needs json_schema.schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}),
                "must be a JSON Schema object",
            ),
            (json!({"guided_json": "{not json"}), "not valid JSON"),
            (json!({"guided_regex": ""}), "non-empty string"),
            (json!({"guided_choice": []}), "non-empty list"),
            (json!({"guided_choice": ["a", 3]}), "non-empty strings"),
            (
                json!({"guided_regex": "a", "guided_choice": ["a"]}),
                "only one structured output",
            ),
            (
                json!({"structured_outputs": {"xml": "<a/>"}}),
                "structured_outputs.xml is not supported",
            ),
        ] {
            let e = fields(body.clone()).grammar().unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert!(e.message.contains(want), "{body}: {}", e.message);
        }
    }
}
