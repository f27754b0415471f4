//! Tool calls in a model's output: the formats chat templates teach, parsed into OpenAI's
//! `tool_calls`, whole or as the text streams in.
//!
//! - [`Format::Hermes`] (Qwen2/2.5/3, Hermes, many others): `<tool_call>\n{"name": ..., "arguments":
//!   {...}}\n</tool_call>`, any number of them, text allowed around them. Small models often drop
//!   the tags and answer with the bare JSON object: a reply that is only a call object is a call.
//! - [`Format::Mistral`]: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` to the end.
//! - [`Format::Json`] (Llama 3.x, and the generic form for templates that name none): the whole
//!   reply is a JSON object `{"name": ..., "parameters" | "arguments": {...}}` or a list of them,
//!   optionally after Llama's `<|python_tag|>`.
//!
//! Text that turns out not to be a call (malformed JSON, no name) is given back as content: no
//! output is ever lost, and no tool markup reaches the content of a well-formed call.

use serde_json::{json, Value};

/// How a model writes its tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Hermes,
    Mistral,
    Json,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";

impl Format {
    /// The format a chat template teaches, from its source.
    pub fn of_template(source: &str) -> Format {
        if source.contains(HERMES_OPEN) {
            Format::Hermes
        } else if source.contains(MISTRAL_OPEN) {
            Format::Mistral
        } else {
            Format::Json
        }
    }
}

/// One call: the function's name and its arguments as JSON text (OpenAI's `arguments` string).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

impl ToolCall {
    /// OpenAI's `tool_calls` entry, with a fresh id.
    pub fn to_json(&self, id: &str) -> Value {
        json!({"id": id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// A piece of parsed output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
}

/// A call from its JSON: `{"name": s, "arguments" | "parameters": object or string}`.
fn call_of(v: &Value) -> Option<ToolCall> {
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?.trim();
    if name.is_empty() {
        return None;
    }
    let args = match o.get("arguments").or_else(|| o.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(_) => return None,
    };
    Some(ToolCall {
        name: name.to_string(),
        arguments: args,
    })
}

/// Calls from a JSON text holding call objects or lists of them, one after another (models
/// write several calls in one block, one per line); None unless all of it is calls.
fn calls_of(text: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    for v in serde_json::Deserializer::from_str(text).into_iter::<Value>() {
        match v.ok()? {
            Value::Array(items) if !items.is_empty() => {
                for item in &items {
                    calls.push(call_of(item)?);
                }
            }
            v @ Value::Object(_) => calls.push(call_of(&v)?),
            _ => return None,
        }
    }
    (!calls.is_empty()).then_some(calls)
}

/// The length of the longest suffix of `s` that is a proper prefix of `tag` (text that may be the
/// start of the tag, to hold back until the next chunk decides).
fn partial_tag_len(s: &str, tag: &str) -> usize {
    let max = s.len().min(tag.len() - 1);
    (1..=max)
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Plain text (Hermes: outside any call).
    Text,
    /// Inside a call (Hermes: after `<tool_call>`; Mistral: after `[TOOL_CALLS]`).
    Call,
    /// JSON format: nothing but whitespace seen yet, so the reply may still be a call.
    Undecided,
    /// JSON format: the reply opened like a call; held until the end.
    Held,
}

/// Parses output as it streams: [`Parser::push`] each piece of text, then [`Parser::finish`].
/// The pieces given back, joined, are the same as [`parse`] of the whole text.
#[derive(Clone, Debug)]
pub struct Parser {
    format: Format,
    state: State,
    buf: String,
    /// The part of a forced opening inside the call (after `<tool_call>`): text the model did not
    /// write, so a call that fails to parse gives back only what follows it.
    forced: String,
}

impl Parser {
    pub fn new(format: Format) -> Self {
        let state = match format {
            Format::Json | Format::Hermes => State::Undecided,
            Format::Mistral => State::Text,
        };
        Parser {
            format,
            state,
            buf: String::new(),
            forced: String::new(),
        }
    }

    /// A parser for output that continues `prefix`, text the prompt already put in the model's
    /// mouth (the opening of a forced call).
    pub fn continuing(format: Format, prefix: &str) -> Self {
        let mut p = Parser::new(format);
        let out = p.push(prefix);
        debug_assert!(out.is_empty(), "a forced prefix opens a call");
        p.forced = p.buf.clone();
        p
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match (self.format, self.state) {
                (Format::Hermes, State::Text) | (Format::Mistral, State::Text) => {
                    let tag = if self.format == Format::Hermes {
                        HERMES_OPEN
                    } else {
                        MISTRAL_OPEN
                    };
                    if let Some(at) = self.buf.find(tag) {
                        push_text(&mut out, &self.buf[..at]);
                        self.buf.drain(..at + tag.len());
                        self.state = State::Call;
                        continue;
                    }
                    let keep = partial_tag_len(&self.buf, tag);
                    let emit = self.buf.len() - keep;
                    push_text(&mut out, &self.buf[..emit]);
                    self.buf.drain(..emit);
                    break;
                }
                (Format::Hermes, State::Call) => {
                    let Some(at) = self.buf.find(HERMES_CLOSE) else {
                        break;
                    };
                    let body: String = self.buf[..at].to_string();
                    self.buf.drain(..at + HERMES_CLOSE.len());
                    match calls_of(&body) {
                        Some(calls) => out.extend(calls.into_iter().map(Piece::Call)),
                        None => {
                            let raw = format!("{body}{HERMES_CLOSE}");
                            push_text(&mut out, &self.unforced(&raw));
                        }
                    }
                    self.forced.clear();
                    self.state = State::Text;
                }
                (Format::Hermes, State::Undecided) => {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        break;
                    }
                    self.state = if t.starts_with('{') {
                        State::Held
                    } else {
                        State::Text
                    };
                }
                (Format::Json, State::Undecided) => {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        break;
                    }
                    if t.len() < PYTHON_TAG.len() && PYTHON_TAG.starts_with(t) {
                        break; // may still become `<|python_tag|>`
                    }
                    let opens_call =
                        t.starts_with('{') || t.starts_with('[') || t.starts_with(PYTHON_TAG);
                    self.state = if opens_call { State::Held } else { State::Text };
                }
                (Format::Json, State::Text) => {
                    push_text(&mut out, &self.buf);
                    self.buf.clear();
                    break;
                }
                // Mistral calls and held JSON replies run to the end of the output.
                _ => break,
            }
        }
        out
    }

    /// The rest, at the end of the output: an unterminated call that parses is a call (the
    /// model stopped at its end-of-turn token instead of the closing tag), anything else text.
    pub fn finish(&mut self) -> Vec<Piece> {
        let buf = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        match (self.format, self.state) {
            (Format::Hermes, State::Call) => match calls_of(&buf) {
                Some(calls) => out.extend(calls.into_iter().map(Piece::Call)),
                None => push_text(&mut out, &self.unforced(&buf)),
            },
            (Format::Hermes, State::Held) => match calls_of(&buf) {
                Some(calls) => out.extend(calls.into_iter().map(Piece::Call)),
                None => {
                    // Not a bare call: read it again as text that may hold tagged calls.
                    let mut again = Parser::new(Format::Hermes);
                    again.state = State::Text;
                    out.extend(again.push(&buf));
                    out.extend(again.finish());
                }
            },
            (Format::Mistral, State::Call) => match calls_of(&buf) {
                Some(calls) => out.extend(calls.into_iter().map(Piece::Call)),
                None => push_text(&mut out, &format!("{MISTRAL_OPEN}{buf}")),
            },
            (Format::Json, State::Held) => {
                let body = buf.trim_start();
                let body = body.strip_prefix(PYTHON_TAG).unwrap_or(body);
                match calls_of(body) {
                    Some(calls) => out.extend(calls.into_iter().map(Piece::Call)),
                    None => push_text(&mut out, &buf),
                }
            }
            _ => push_text(&mut out, &buf),
        }
        self.state = State::Text;
        out
    }
}

impl Parser {
    /// Call text that did not parse, as content: the tag and any forced opening were not the
    /// model's words and are left out; otherwise the text as the model wrote it, tag included.
    fn unforced(&self, body: &str) -> String {
        match body.strip_prefix(self.forced.as_str()) {
            Some(rest) if !self.forced.is_empty() => rest.to_string(),
            _ => format!("{HERMES_OPEN}{body}"),
        }
    }
}

fn push_text(out: &mut Vec<Piece>, s: &str) {
    if s.is_empty() {
        return;
    }
    if let Some(Piece::Text(t)) = out.last_mut() {
        t.push_str(s);
    } else {
        out.push(Piece::Text(s.to_string()));
    }
}

/// The whole output at once: the text outside the calls (None if only whitespace) and the calls.
pub fn parse(format: Format, prefix: &str, text: &str) -> (Option<String>, Vec<ToolCall>) {
    let mut p = Parser::continuing(format, prefix);
    let mut pieces = p.push(text);
    pieces.extend(p.finish());
    split(pieces)
}

/// Pieces as (content, calls); content None where it is only whitespace.
pub fn split(pieces: Vec<Piece>) -> (Option<String>, Vec<ToolCall>) {
    let mut content = String::new();
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    let content = (!content.trim().is_empty()).then_some(content);
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, args: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: args.into(),
        }
    }

    /// (format, forced prefix, output, content, calls).
    type Case = (
        Format,
        &'static str,
        &'static str,
        Option<&'static str>,
        Vec<ToolCall>,
    );

    /// Outputs as models write them, with what they must parse to.
    fn cases() -> Vec<Case> {
        let weather = call("get_weather", r#"{"city":"Paris","unit":"celsius"}"#);
        vec![
            (
                Format::Hermes,
                "",
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>",
                None,
                vec![weather.clone()],
            ),
            (
                Format::Hermes,
                "",
                "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
                Some("Let me check.\n\n"),
                vec![weather.clone(), call("get_time", "{}")],
            ),
            // Stopped at the end-of-turn token before the closing tag.
            (
                Format::Hermes,
                "",
                "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}",
                None,
                vec![call("get_time", r#"{"tz":"UTC"}"#)],
            ),
            // A forced opening: the prompt ended with `<tool_call>\n{"name": "get_time", "arguments": `.
            (
                Format::Hermes,
                "<tool_call>\n{\"name\": \"get_time\", \"arguments\": ",
                "{\"tz\": \"UTC\"}}\n</tool_call>",
                None,
                vec![call("get_time", r#"{"tz":"UTC"}"#)],
            ),
            // Malformed JSON stays content, tags and all; a lone '<' is just text.
            (
                Format::Hermes,
                "",
                "a < b <tool_call>{not json}</tool_call> c",
                Some("a < b <tool_call>{not json}</tool_call> c"),
                vec![],
            ),
            (Format::Hermes, "", "Plain answer, no tools.", Some("Plain answer, no tools."), vec![]),
            // Two calls in one block, one per line, the closing tag forgotten.
            (
                Format::Hermes,
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ",
                " {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n{\"name\": \"get_time\", \"arguments\": {}}",
                None,
                vec![weather.clone(), call("get_time", "{}")],
            ),
            // A bare call object, no tags (small Qwen models do this).
            (
                Format::Hermes,
                "",
                " {\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}",
                None,
                vec![call("get_time", r#"{"tz":"UTC"}"#)],
            ),
            // JSON that is not a call, then a tagged call.
            (
                Format::Hermes,
                "",
                "{\"x\": 1} then <tool_call>{\"name\": \"get_time\"}</tool_call>",
                Some("{\"x\": 1} then "),
                vec![call("get_time", "{}")],
            ),
            // A forced opening the model then abandons: only its own words are content.
            (
                Format::Hermes,
                "<tool_call>\n{\"name\": \"",
                "I cannot call tools.",
                Some("I cannot call tools."),
                vec![],
            ),
            (
                Format::Mistral,
                "",
                "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}]",
                None,
                vec![weather.clone()],
            ),
            (
                Format::Json,
                "",
                "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}",
                None,
                vec![weather.clone()],
            ),
            (
                Format::Json,
                "",
                "  [{\"name\": \"get_time\", \"arguments\": \"{}\"}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}]",
                None,
                vec![call("get_time", "{}"), weather],
            ),
            (Format::Json, "", "{\"answer\": 42}", Some("{\"answer\": 42}"), vec![]),
            (Format::Json, "", "The answer is 42.", Some("The answer is 42."), vec![]),
        ]
    }

    #[test]
    fn whole_outputs() {
        for (format, prefix, text, content, calls) in cases() {
            let (c, k) = parse(format, prefix, text);
            assert_eq!(c.as_deref(), content, "{format:?} {text:?}");
            assert_eq!(k, calls, "{format:?} {text:?}");
        }
    }

    /// Every output cut in two at every byte boundary (and in one-char pieces) parses the same,
    /// and no text piece given out before the end contains tool markup of a well-formed call.
    #[test]
    fn streamed_at_every_boundary() {
        for (format, prefix, text, _, _) in cases() {
            let whole = parse(format, prefix, text);
            let mut cuts: Vec<Vec<&str>> = (0..=text.len())
                .filter(|&i| text.is_char_boundary(i))
                .map(|i| vec![&text[..i], &text[i..]])
                .collect();
            cuts.push(
                text.char_indices()
                    .map(|(i, ch)| &text[i..i + ch.len_utf8()])
                    .collect(),
            );
            for pieces in cuts {
                let mut p = Parser::continuing(format, prefix);
                let mut got = Vec::new();
                for piece in &pieces {
                    got.extend(p.push(piece));
                }
                got.extend(p.finish());
                assert_eq!(split(got.clone()), whole, "{format:?} {pieces:?}");
                if !whole.1.is_empty() && whole.0.is_none() {
                    for g in &got {
                        if let Piece::Text(t) = g {
                            assert!(t.trim().is_empty(), "markup leaked: {t:?} in {pieces:?}");
                        }
                    }
                }
            }
        }
    }
}
