//! A chat request as the model's chat template reads it: OpenAI's message shapes turned into the
//! messages Hugging Face's `apply_chat_template` passes, the request's tools checked and passed
//! as given, and what `tool_choice` asks of the reply. Pure functions over the request; the
//! routes (`/v1/chat/completions`, `/tokenize`) call [`render`].
//!
//! Messages reach the template as mappings with `role`, `content` (text; `text` parts joined;
//! `""` for an assistant turn that only calls tools), and where present `tool_calls` (`{id, type,
//! function: {name, arguments}}` with `arguments` parsed from its JSON text into an object, as HF
//! templates expect: Qwen2.5's writes `tool_call.arguments | tojson`), `tool_call_id` and `name`.
//! Tools and arguments keep the client's key order (the template's `tojson` writes them as
//! Python would write the dicts HF is given).

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::api::ApiError;
use crate::tool_calls::{Format, Keep};
use ferrum_llm::grammar::Grammar;
use ferrum_tokenizer::ChatTemplate;

/// A message's `content`: text, or a list of parts (only `text` parts are supported).
#[derive(Deserialize)]
#[serde(untagged)]
pub(crate) enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
pub(crate) struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

/// A call in an assistant message of the history.
#[derive(Deserialize)]
pub(crate) struct InCall {
    #[serde(default)]
    id: Option<String>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    function: Option<InFunction>,
}

#[derive(Deserialize)]
pub(crate) struct InFunction {
    #[serde(default)]
    name: Option<String>,
    /// OpenAI's JSON text (a string); an object is taken as well.
    #[serde(default)]
    arguments: Option<Box<RawValue>>,
}

/// One message of a chat request, as OpenAI's API takes it.
#[derive(Deserialize)]
pub(crate) struct Message {
    role: String,
    /// Null or absent for an assistant turn that only calls tools.
    #[serde(default)]
    content: Option<Content>,
    #[serde(default)]
    tool_calls: Option<Vec<InCall>>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

/// A message as the template sees it (keys in this order).
#[derive(Serialize)]
pub(crate) struct TemplateMessage {
    role: String,
    content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<TemplateCall>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
}

#[derive(Serialize)]
struct TemplateCall {
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    #[serde(rename = "type")]
    kind: &'static str,
    function: TemplateFunction,
}

#[derive(Serialize)]
struct TemplateFunction {
    name: String,
    /// The parsed arguments (an object where the text parses), in the client's key order.
    arguments: Box<RawValue>,
}

fn bad_msg(m: String) -> ApiError {
    ApiError::bad(m, Some("messages"))
}

/// A call's arguments for the template: the JSON its text holds (HF templates expect a mapping),
/// or the text itself as a string where it is not JSON.
fn template_arguments(raw: Option<&RawValue>) -> Box<RawValue> {
    let text = match raw {
        None => return RawValue::from_string("{}".into()).expect("valid JSON"),
        Some(r) if r.get() == "null" => {
            return RawValue::from_string("{}".into()).expect("valid JSON")
        }
        Some(r) => match serde_json::from_str::<String>(r.get()) {
            Ok(s) => s,
            Err(_) => return r.to_owned(),
        },
    };
    let trimmed = text.trim();
    match serde_json::from_str::<&RawValue>(trimmed) {
        Ok(v) => v.to_owned(),
        Err(_) => serde_json::value::to_raw_value(&text).expect("a string is JSON"),
    }
}

/// A call id as Mistral's templates require it (9 letters or digits; they refuse others): the
/// last 9 of the id's letters and digits (vLLM's rule), padded with zeros.
fn mistral_id(id: &str) -> String {
    let alnum: Vec<char> = id.chars().filter(char::is_ascii_alphanumeric).collect();
    let tail: String = alnum[alnum.len().saturating_sub(9)..].iter().collect();
    format!("{tail:0>9}")
}

/// OpenAI messages as the template reads them. Refused (400): an unknown role (`developer` is
/// taken as `system`), content missing where it is required or holding non-text parts,
/// `tool_calls` outside an assistant turn or without a function name, a tool result without the
/// `tool_call_id` it answers. With `short_ids` (Mistral templates), call ids are cut to 9
/// letters and digits.
pub(crate) fn template_messages(
    messages: Vec<Message>,
    short_ids: bool,
) -> Result<Vec<TemplateMessage>, ApiError> {
    if messages.is_empty() {
        return Err(bad_msg("messages is empty".into()));
    }
    let id = |s: String| if short_ids { mistral_id(&s) } else { s };
    let mut out = Vec::with_capacity(messages.len());
    for (at, m) in messages.into_iter().enumerate() {
        // OpenAI's roles; `developer` is its newer name for `system`, which is what templates know.
        let role = match m.role.as_str() {
            "system" | "user" | "assistant" | "tool" => m.role,
            "developer" => "system".to_string(),
            other => {
                return Err(bad_msg(format!(
                    "unknown message role '{other}' (expected system, developer, user, \
                     assistant or tool)"
                )))
            }
        };
        // An empty list of calls is no calls (some clients send one).
        let calls = m.tool_calls.filter(|c| !c.is_empty());
        let content = match m.content {
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => s.push_str(&t),
                        (k, _) => {
                            return Err(bad_msg(format!(
                                "messages[{at}]: content parts of type '{k}' are not supported \
                                 (only text)"
                            )))
                        }
                    }
                }
                s
            }
            // An assistant turn may carry only tool calls; templates get "" (they test it).
            None if role == "assistant" => String::new(),
            None => return Err(bad_msg(format!("messages[{at}] ({role}) has no content"))),
        };
        let tool_calls = match calls {
            None => None,
            Some(_) if role != "assistant" => {
                return Err(bad_msg(format!(
                    "messages[{at}]: only assistant messages carry tool_calls"
                )))
            }
            Some(calls) => {
                let mut v = Vec::with_capacity(calls.len());
                for (j, c) in calls.into_iter().enumerate() {
                    if c.kind.as_deref().is_some_and(|k| k != "function") {
                        return Err(bad_msg(format!(
                            "messages[{at}].tool_calls[{j}].type must be \"function\""
                        )));
                    }
                    let f = c.function.ok_or_else(|| {
                        bad_msg(format!("messages[{at}].tool_calls[{j}] has no function"))
                    })?;
                    let name = f.name.filter(|n| !n.is_empty()).ok_or_else(|| {
                        bad_msg(format!(
                            "messages[{at}].tool_calls[{j}].function has no name"
                        ))
                    })?;
                    v.push(TemplateCall {
                        id: c.id.map(id),
                        kind: "function",
                        function: TemplateFunction {
                            name,
                            arguments: template_arguments(f.arguments.as_deref()),
                        },
                    });
                }
                Some(v)
            }
        };
        if role == "tool" && m.tool_call_id.is_none() {
            return Err(bad_msg(format!(
                "messages[{at}] (tool) needs the tool_call_id it answers"
            )));
        }
        out.push(TemplateMessage {
            role,
            content,
            tool_calls,
            tool_call_id: m.tool_call_id.map(id),
            name: m.name,
        });
    }
    Ok(out)
}

/// How a chat request's output is read for tool calls.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ToolCtx {
    pub(crate) format: Format,
    /// Text the prompt put at the start of the model's reply (the opening of a forced call).
    pub(crate) prefix: String,
    /// `parallel_tool_calls`: false keeps only the first call.
    pub(crate) parallel: bool,
    /// A named `tool_choice`: only a call of this function is kept (one, as OpenAI's).
    pub(crate) only: Option<String>,
    /// When a call is required (`required` or a named function): the grammar of the reply
    /// after `prefix`, so the call is well formed and its arguments valid under the schema.
    pub(crate) grammar: Option<Grammar>,
}

impl ToolCtx {
    pub(crate) fn keep(&self) -> Keep {
        Keep {
            only: self.only.clone(),
            parallel: self.parallel,
        }
    }
}

/// A function name as OpenAI accepts it: 1-64 of a-z, A-Z, 0-9, '_', '-' (and '.', which
/// some clients use).
fn valid_function_name(n: &str) -> bool {
    (1..=64).contains(&n.len())
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// Checks `tools` (each `{type: "function", function: {name, description?, parameters?}}` with
/// an object schema) and returns the function names.
pub(crate) fn check_tools(tools: &[Value]) -> Result<Vec<String>, ApiError> {
    let bad = |m: String| ApiError::bad(m, Some("tools"));
    let mut names = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(format!("tools[{i}].type must be \"function\"")));
        }
        let f = t
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| bad(format!("tools[{i}].function must be an object")))?;
        let name = f.get("name").and_then(Value::as_str).unwrap_or("");
        if !valid_function_name(name) {
            return Err(bad(format!(
                "tools[{i}].function.name must be 1-64 letters, digits, '_', '-' or '.', found {name:?}"
            )));
        }
        match f.get("parameters") {
            None | Some(Value::Object(_)) => {}
            Some(other) => {
                return Err(bad(format!(
                    "tools[{i}].function.parameters must be a JSON Schema object, found {other}"
                )))
            }
        }
        if names.iter().any(|n| n == name) {
            return Err(bad(format!("two tools are named '{name}'")));
        }
        names.push(name.to_string());
    }
    Ok(names)
}

/// How a request's tools are offered and its output read, for a template with source
/// `template`: from `tools` (chat format, checked), `tool_choice` (chat format: none, auto,
/// required, `{"type": "function", "function": {"name"}}`) and `parallel_tool_calls`. None: no
/// tools offered (none given, or `tool_choice: none`).
///
/// A required or named call is opened in the prompt ([`Format::forced_prefix`]) and the rest of
/// the reply is held to [`Format::forced_grammar`] (the engine masks every token), so the call
/// parses and its arguments are valid under the function's schema. `required` with a single
/// tool is that tool.
pub(crate) fn tool_context(
    template: &str,
    tools: &[Value],
    choice: Option<&Value>,
    parallel: Option<bool>,
) -> Result<Option<ToolCtx>, ApiError> {
    let names = check_tools(tools)?;
    let choice_err = |m: String| ApiError::bad(m, Some("tool_choice"));
    // None: no tools offered; Some(None): the model may call one; Some(Some(x)): it must call
    // (x: "" for any, else the named function).
    let choice: Option<Option<String>> = match choice {
        None | Some(Value::Null) => (!tools.is_empty()).then_some(None),
        Some(Value::String(s)) => match s.as_str() {
            "none" => None,
            "auto" => (!tools.is_empty()).then_some(None),
            "required" => Some(Some(String::new())),
            other => {
                return Err(choice_err(format!(
                    "tool_choice '{other}' (expected none, auto, required or a function)"
                )))
            }
        },
        Some(v) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    choice_err(
                        "tool_choice must be none, auto, required or \
                         {\"type\": \"function\", \"function\": {\"name\": ...}}"
                            .into(),
                    )
                })?;
            if !names.iter().any(|n| n == name) {
                return Err(choice_err(format!(
                    "tool_choice names '{name}', which is not among the tools"
                )));
            }
            Some(Some(name.to_string()))
        }
    };
    if matches!(choice, Some(Some(_))) && tools.is_empty() {
        return Err(choice_err(
            "tool_choice requires a call but no tools are given".into(),
        ));
    }
    let Some(forced) = choice else {
        return Ok(None);
    };
    let format = Format::of_template(template);
    let forced = match forced {
        Some(n) if n.is_empty() && names.len() == 1 => Some(names[0].clone()),
        other => other,
    };
    let prefix = match forced.as_deref() {
        None => String::new(),
        Some("") => format.forced_prefix(None, template),
        Some(n) => format.forced_prefix(Some(n), template),
    };
    let only = forced.clone().filter(|n| !n.is_empty());
    let parallel = parallel.unwrap_or(true) && only.is_none();
    let grammar = match forced.as_deref() {
        None => None,
        Some(n) => {
            let schemas: Vec<(String, Option<Value>)> = tools
                .iter()
                .zip(&names)
                .map(|(t, n)| (n.clone(), t["function"].get("parameters").cloned()))
                .collect();
            let name = (!n.is_empty()).then_some(n);
            let lark = format
                .forced_grammar(template, &schemas, name, parallel)
                .map_err(|e| ApiError::bad(e, Some("tools")))?;
            Some(Grammar::Lark(lark))
        }
    };
    Ok(Some(ToolCtx {
        format,
        prefix,
        parallel,
        only,
        grammar,
    }))
}

/// The tools part of a chat request: `tools` as the client wrote them, `tool_choice`,
/// `parallel_tool_calls` and `chat_template_kwargs`.
#[derive(Default)]
pub(crate) struct ToolsIn<'a> {
    pub(crate) tools: Option<&'a RawValue>,
    pub(crate) choice: Option<&'a Value>,
    pub(crate) parallel: Option<bool>,
    pub(crate) kwargs: Option<&'a serde_json::Map<String, Value>>,
}

/// A chat request rendered: the prompt text (ending in a forced call's opening where the
/// request requires a call) and how the reply is read for tool calls.
pub(crate) fn render(
    template: &ChatTemplate,
    messages: Vec<Message>,
    t: ToolsIn<'_>,
    add_generation_prompt: bool,
) -> Result<(String, Option<ToolCtx>), ApiError> {
    let source = template.source();
    let msgs = template_messages(messages, Format::of_template(source) == Format::Mistral)?;
    let tools: Vec<Value> = match t.tools {
        None => Vec::new(),
        Some(raw) => serde_json::from_str(raw.get()).map_err(|_| {
            ApiError::bad(
                "tools must be a list of {\"type\": \"function\", \"function\": {...}} objects",
                Some("tools"),
            )
        })?,
    };
    let ctx = tool_context(source, &tools, t.choice, t.parallel)?;
    // The list as the client wrote it (its key order), when tools are offered.
    let offered = ctx.as_ref().and(t.tools);
    let empty = serde_json::Map::new();
    let mut rendered = template
        .render_json(
            &msgs,
            offered,
            t.kwargs.unwrap_or(&empty),
            add_generation_prompt,
        )
        .map_err(|e| ApiError::bad(format!("chat template: {e}"), Some("messages")))?;
    if let Some(c) = &ctx {
        if add_generation_prompt {
            rendered.push_str(&c.prefix);
        }
    }
    Ok((rendered, ctx))
}

/// A tool call's entry for an OpenAI stream: the first chunk of call `index` (id, type, name,
/// empty arguments, as OpenAI sends it), then its arguments.
pub(crate) fn call_deltas(index: usize, id: &str, name: &str, arguments: &str) -> [Value; 2] {
    [
        json!({"tool_calls": [{"index": index, "id": id, "type": "function",
            "function": {"name": name, "arguments": ""}}]}),
        json!({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    /// Qwen2.5-Coder-Instruct's template, as its GGUF carries it (`tokenizer.chat_template`).
    const QWEN25: &str = include_str!("../testdata/qwen2.5-chat-template.jinja");

    fn qwen() -> ChatTemplate {
        ChatTemplate::new(QWEN25, "", "<|im_end|>").unwrap()
    }

    fn msgs(v: Value) -> Vec<Message> {
        serde_json::from_value(v).unwrap()
    }

    fn raw(v: &str) -> Box<RawValue> {
        serde_json::from_str(v).unwrap()
    }

    const WEATHER: &str = r#"[{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]"#;

    /// The 400 a rendering of these parts gets, and its message.
    fn refused(messages: Value, tools: Option<&str>, choice: Option<Value>) -> String {
        let tools = tools.map(raw);
        let t = ToolsIn {
            tools: tools.as_deref(),
            choice: choice.as_ref(),
            ..Default::default()
        };
        match render(&qwen(), msgs(messages), t, true) {
            Ok((r, _)) => panic!("accepted: {r}"),
            Err(e) => {
                assert_eq!(e.status, StatusCode::BAD_REQUEST);
                e.message
            }
        }
    }

    fn user() -> Value {
        json!([{"role": "user", "content": "Weather in Paris?"}])
    }

    /// A whole round trip as Qwen2.5's template renders it for Hugging Face: Python's jinja2
    /// 3.1 in transformers' environment (trim_blocks, lstrip_blocks, its `tojson`) gives these
    /// exact bytes for the same messages with the arguments as a dict and the system content
    /// as a string (testdata/hf_chat_render.py made the fixture). Keys stay in the client's order.
    #[test]
    fn round_trip_renders_as_transformers() {
        let history = json!([
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"unit\": \"celsius\", \"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C, cloudy"},
        ]);
        let tools = raw(WEATHER);
        let t = ToolsIn {
            tools: Some(&tools),
            ..Default::default()
        };
        let (text, ctx) = render(&qwen(), msgs(history), t, true).unwrap();
        let want = include_str!("../testdata/qwen2.5-round-trip.txt");
        assert_eq!(text, want);
        let ctx = ctx.unwrap();
        assert_eq!((ctx.format, ctx.prefix.as_str()), (Format::Hermes, ""));
        assert!(ctx.parallel && ctx.only.is_none());
    }

    #[test]
    fn tool_choice_shapes_the_prompt() {
        let tools = raw(WEATHER);
        let render_with = |choice: Value, parallel: Option<bool>| {
            let t = ToolsIn {
                tools: Some(&tools),
                choice: Some(&choice),
                parallel,
                kwargs: None,
            };
            render(&qwen(), msgs(user()), t, true).unwrap()
        };
        // none: no tools shown, no parsing.
        let (text, ctx) = render_with(json!("none"), None);
        assert!(ctx.is_none() && !text.contains("# Tools"));
        assert!(text.ends_with("<|im_start|>assistant\n"));
        // auto: tools shown, nothing forced.
        let (text, ctx) = render_with(json!("auto"), Some(false));
        assert!(text.contains("# Tools") && text.ends_with("<|im_start|>assistant\n"));
        assert!(!ctx.unwrap().parallel);
        // named: the call is opened in the prompt, and only that function is kept.
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let (text, ctx) = render_with(named, None);
        assert!(text.ends_with(
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
        ));
        let ctx = ctx.unwrap();
        assert_eq!(ctx.only.as_deref(), Some("get_weather"));
        assert_eq!(
            ctx.keep(),
            Keep {
                only: Some("get_weather".into()),
                parallel: false
            }
        );
        // required with one tool: that tool.
        let (text, _) = render_with(json!("required"), None);
        assert!(text.ends_with("{\"name\": \"get_weather\", \"arguments\": "));
        // required with several: the call is opened up to the name.
        let two = r#"[{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}]"#;
        let two = raw(two);
        let choice = json!("required");
        let t = ToolsIn {
            tools: Some(&two),
            choice: Some(&choice),
            ..Default::default()
        };
        let (text, ctx) = render(&qwen(), msgs(user()), t, true).unwrap();
        assert!(text.ends_with("<|im_start|>assistant\n<tool_call>\n{\"name\": \""));
        assert_eq!(ctx.unwrap().only, None);
    }

    #[test]
    fn chat_template_kwargs_reach_the_template() {
        let t = ChatTemplate::new(
            "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}\
             {{ messages[0].content }}",
            "",
            "",
        )
        .unwrap();
        let mut kw = serde_json::Map::new();
        kw.insert("enable_thinking".into(), json!(false));
        let parts = ToolsIn {
            kwargs: Some(&kw),
            ..Default::default()
        };
        let (text, _) = render(&t, msgs(user()), parts, true).unwrap();
        assert_eq!(text, "/no_think Weather in Paris?");
        let (text, _) = render(&t, msgs(user()), ToolsIn::default(), true).unwrap();
        assert_eq!(text, "Weather in Paris?");
    }

    #[test]
    fn bad_tools_and_choices_are_refused() {
        let named = |n: &str| Some(json!({"type": "function", "function": {"name": n}}));
        for (tools, choice, want) in [
            (Some(WEATHER), named("nope"), "not among the tools"),
            (
                Some(r#"[{"type": "function", "function": {"name": "f", "parameters": "x"}}]"#),
                None,
                "parameters must be a JSON Schema object",
            ),
            (
                Some(r#"[{"type": "function", "function": {"name": "f", "parameters": []}}]"#),
                None,
                "parameters must be a JSON Schema object",
            ),
            (
                Some(r#"[{"type": "function", "function": {}}]"#),
                None,
                "function.name must be",
            ),
            (
                Some(r#"[{"type": "function", "function": {"name": ""}}]"#),
                None,
                "function.name must be",
            ),
            (
                Some(r#"[{"type": "function", "function": {"name": "has space"}}]"#),
                None,
                "function.name must be",
            ),
            (
                Some(r#"[{"type": "web_search"}]"#),
                None,
                "type must be \"function\"",
            ),
            (
                Some(r#"[{"type": "function", "function": "f"}]"#),
                None,
                "function must be an object",
            ),
            (
                Some(
                    r#"[{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]"#,
                ),
                None,
                "two tools are named 'f'",
            ),
            (
                Some(r#"{"type": "function"}"#),
                None,
                "tools must be a list",
            ),
            (None, Some(json!("required")), "no tools are given"),
            (None, named("f"), "not among the tools"),
            (
                Some(WEATHER),
                Some(json!("sometimes")),
                "expected none, auto",
            ),
            (
                Some(WEATHER),
                Some(json!({"type": "function"})),
                "tool_choice must be",
            ),
            (Some(WEATHER), Some(json!(3)), "tool_choice must be"),
        ] {
            let msg = refused(user(), tools, choice.clone());
            assert!(msg.contains(want), "{tools:?} {choice:?}: {msg}");
        }
    }

    #[test]
    fn bad_messages_are_refused() {
        let call = json!({"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "{}"}});
        for (messages, want) in [
            (json!([]), "messages is empty"),
            (
                json!([{"role": "robot", "content": "x"}]),
                "unknown message role 'robot'",
            ),
            (json!([{"role": "user"}]), "(user) has no content"),
            (
                json!([{"role": "user", "content": null}]),
                "(user) has no content",
            ),
            (
                json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                "type 'image_url' are not supported",
            ),
            (
                json!([{"role": "user", "content": "x", "tool_calls": [call]}]),
                "only assistant messages carry tool_calls",
            ),
            (
                json!([{"role": "tool", "content": "18C"}]),
                "needs the tool_call_id",
            ),
            (
                json!([{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function"}]}]),
                "has no function",
            ),
            (
                json!([{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]}]),
                "function has no name",
            ),
            (
                json!([{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "custom", "function": {"name": "f"}}]}]),
                "type must be \"function\"",
            ),
        ] {
            let msg = refused(messages.clone(), None, None);
            assert!(msg.contains(want), "{messages}: {msg}");
        }
    }

    #[test]
    fn history_shapes_are_accepted() {
        let history = json!([
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
            // No type, arguments as an object, an empty string, not JSON; an empty call list.
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "a", "function": {"name": "f", "arguments": {"x": 1}}},
                {"id": "b", "function": {"name": "g", "arguments": ""}},
                {"id": "c", "function": {"name": "h", "arguments": "not json"}},
                {"function": {"name": "k"}}]},
            {"role": "tool", "tool_call_id": "a", "name": "f", "content": [{"type": "text", "text": "1"}]},
            {"role": "assistant", "content": "Done.", "tool_calls": []},
        ]);
        let m = template_messages(msgs(history), false).unwrap();
        let v = serde_json::to_value(&m).unwrap();
        assert_eq!(v[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(v[1]["content"], "Weather in Paris?");
        let calls = &v[2]["tool_calls"];
        assert_eq!(calls[0]["function"]["arguments"], json!({"x": 1}));
        assert_eq!(calls[0]["type"], "function");
        assert_eq!(calls[1]["function"]["arguments"], json!(""));
        assert_eq!(calls[2]["function"]["arguments"], json!("not json"));
        assert_eq!(calls[3]["function"]["arguments"], json!({}));
        assert!(calls[3].get("id").is_none());
        assert_eq!(
            v[3],
            json!({"role": "tool", "content": "1", "tool_call_id": "a", "name": "f"})
        );
        assert_eq!(v[4], json!({"role": "assistant", "content": "Done."}));
    }

    #[test]
    fn mistral_ids_are_nine_alphanumerics() {
        assert_eq!(mistral_id("call_0123456789abcdef01234567"), "f01234567");
        assert_eq!(mistral_id("abcDEF123"), "abcDEF123");
        assert_eq!(mistral_id("a-1"), "0000000a1");
        let history = json!([
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_12345678901234567890abcd", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_12345678901234567890abcd", "content": "ok"},
        ]);
        let v = serde_json::to_value(template_messages(msgs(history), true).unwrap()).unwrap();
        assert_eq!(v[0]["tool_calls"][0]["id"], "67890abcd");
        assert_eq!(v[1]["tool_call_id"], v[0]["tool_calls"][0]["id"]);
    }
}
