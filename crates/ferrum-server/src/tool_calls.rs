//! Tool calls in a model's output: the formats chat templates teach, parsed into OpenAI's
//! `tool_calls`, whole or as the text streams in.
//!
//! - [`Format::Hermes`] (Qwen2/2.5/3, Hermes, many others): `<tool_call>\n{"name": ..., "arguments":
//!   {...}}\n</tool_call>`, any number of them, text allowed around them. Small models often drop
//!   the tags and answer with the bare JSON object: a reply that is only a call object is a call.
//! - [`Format::Mistral`]: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` to the end.
//!   `[TOOL_CALLS]` is a control token that detokenizes to nothing in most Mistral vocabularies,
//!   so a reply that is only a list of call objects is a call too.
//! - [`Format::Json`] (Llama 3.x, and the generic form for templates that name none): the whole
//!   reply is a JSON object `{"name": ..., "parameters" | "arguments": {...}}` or a list of them,
//!   optionally after Llama's `<|python_tag|>`.
//!
//! In each format a reply that is only calls may come in a Markdown code fence (` ```json `), as
//! small models write them.
//!
//! A call's `arguments` are the JSON text the model wrote (its key order and spacing), or the
//! string it wrote when it gave them as a JSON string. Text that turns out not to be a call
//! (malformed JSON, no name) is given back as content: no output is ever lost, and no tool markup
//! reaches the content of a well-formed call.
//!
//! [`Stream`] is what the chat endpoint uses: the parser plus the request's [`Keep`] rules
//! (named `tool_choice`, `parallel_tool_calls`), giving out exactly what [`parse_reply`] gives
//! for the whole text, piece by piece.

use std::collections::BTreeMap;

use serde_json::value::RawValue;
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

    /// The opening of a call to put at the end of the prompt (after the generation prompt)
    /// when the request requires one: `name` None for any function (`tool_choice: required`),
    /// else that function. This is a prompt prefix, not a grammar: the model continues a call
    /// it did not choose to start, which it nearly always completes, but nothing constrains
    /// the arguments it then writes. Empty where the template teaches no call syntax to open
    /// (a generic template that never mentions `tools`).
    pub fn forced_prefix(self, name: Option<&str>, template_source: &str) -> String {
        let Some((open, key)) = self.call_syntax(template_source) else {
            return String::new();
        };
        match name {
            None => format!("{open}\""),
            Some(n) => format!("{open}{}, \"{key}\": ", json!(n)),
        }
    }

    /// How a call opens (up to its name) and the key of its arguments, where the template
    /// teaches one; None for a generic template that never mentions `tools`.
    fn call_syntax(self, template_source: &str) -> Option<(String, &'static str)> {
        Some(match self {
            Format::Hermes => (format!("{HERMES_OPEN}\n{{\"name\": "), "arguments"),
            Format::Mistral => {
                // Mistral v0.3's template writes `[TOOL_CALLS] [`; later ones no space.
                let gap = if template_source.contains("[TOOL_CALLS] [") {
                    " "
                } else {
                    ""
                };
                (format!("{MISTRAL_OPEN}{gap}[{{\"name\": "), "arguments")
            }
            Format::Json if template_source.contains("tools") => {
                // Llama 3.x's templates ask for "parameters".
                let key = if template_source.contains("\"parameters\"") {
                    "parameters"
                } else {
                    "arguments"
                };
                ("{\"name\": ".to_string(), key)
            }
            Format::Json => return None,
        })
    }

    /// The grammar (Lark) of what a model writes after [`Format::forced_prefix`] when a call is
    /// required: the rest of the call, its arguments valid under the function's `parameters`
    /// schema, then, with `parallel`, any number of further calls of the offered functions
    /// (Hermes and Mistral; the JSON form has one), and nothing else. `tools` are the offered
    /// functions' names and parameter schemas (None: any object); `name` the required function
    /// (None: any of them).
    pub fn forced_grammar(
        self,
        template_source: &str,
        tools: &[(String, Option<Value>)],
        name: Option<&str>,
        parallel: bool,
    ) -> Result<String, String> {
        use ferrum_llm::grammar::{lark_json, lark_literal};
        let opened = self.call_syntax(template_source);
        let prefixed = opened.is_some();
        let (open, key) = opened.unwrap_or_else(|| ("{\"name\": ".to_string(), "arguments"));
        // What closes one call, and what opens the next / ends the list.
        let (close, next, end) = match self {
            Format::Hermes => ("}\n</tool_call>", Some(format!("\n{open}\"")), ""),
            Format::Mistral => ("}", Some(", {\"name\": \"".to_string()), "]"),
            Format::Json => ("}", None, ""),
        };
        let mut rules = String::new();
        // body_i: the rest of a call of function i after `"name": "`.
        let mut bodies = Vec::with_capacity(tools.len());
        for (i, (n, params)) in tools.iter().enumerate() {
            let schema = params.clone().unwrap_or_else(|| json!({"type": "object"}));
            let args = lark_json(&schema).map_err(|e| format!("tools[{i}]: {e}"))?;
            rules.push_str(&format!("args_{i}: {args}\n"));
            rules.push_str(&format!(
                "body_{i}: {} args_{i} {}\n",
                lark_literal(&format!("{n}\", \"{key}\": ")),
                lark_literal(close)
            ));
            bodies.push(format!("body_{i}"));
        }
        rules.push_str(&format!("call: {}\n", bodies.join(" | ")));
        // A generic template opened nothing: the grammar writes the call's opening too.
        let lead = if prefixed {
            String::new()
        } else {
            format!("{} ", lark_literal(&format!("{open}\"")))
        };
        let first = match name {
            Some(n) => {
                let i = tools
                    .iter()
                    .position(|t| t.0 == n)
                    .ok_or_else(|| format!("no tool named '{n}'"))?;
                if prefixed {
                    // The prefix ends after `"key": `: the arguments, then the call's close.
                    format!("args_{i} {}", lark_literal(close))
                } else {
                    format!("{lead}body_{i}")
                }
            }
            None => format!("{lead}call"),
        };
        let more = match (&next, parallel && name.is_none()) {
            (Some(nx), true) => format!(" ({} call)*", lark_literal(nx)),
            _ => String::new(),
        };
        let end = if end.is_empty() {
            String::new()
        } else {
            format!(" {}", lark_literal(end))
        };
        Ok(format!("start: {first}{more}{end}\n{rules}"))
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

/// A call from its JSON: `{"name": s, "arguments" | "parameters": object or string}`; the
/// arguments as the model wrote them.
fn call_of(raw: &RawValue) -> Option<ToolCall> {
    let o: BTreeMap<String, &RawValue> = serde_json::from_str(raw.get()).ok()?;
    let name: String = serde_json::from_str(o.get("name")?.get()).ok()?;
    let name = name.trim();
    if name.is_empty() {
        return None;
    }
    let args = match o.get("arguments").or_else(|| o.get("parameters")) {
        None => "{}".to_string(),
        Some(a) => match a.get().as_bytes().first() {
            Some(b'n') => "{}".to_string(),
            Some(b'"') => serde_json::from_str::<String>(a.get()).ok()?,
            Some(b'{') => a.get().to_string(),
            _ => return None,
        },
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
    for v in serde_json::Deserializer::from_str(text).into_iter::<&RawValue>() {
        let v = v.ok()?;
        match v.get().as_bytes().first() {
            Some(b'[') => {
                let items: Vec<&RawValue> = serde_json::from_str(v.get()).ok()?;
                if items.is_empty() {
                    return None;
                }
                for item in items {
                    calls.push(call_of(item)?);
                }
            }
            Some(b'{') => calls.push(call_of(v)?),
            _ => return None,
        }
    }
    (!calls.is_empty()).then_some(calls)
}

/// For a reply that opens with a backtick: whether it is a Markdown code fence (` ``` ` or
/// ` ```json `) whose first line is followed by a JSON object or list (a call, perhaps: small
/// models fence their calls, and llama.cpp's Hermes parser takes them too), None while that is
/// not known yet.
fn fence_opens_json(t: &str) -> Option<bool> {
    const FENCE: &str = "```";
    if t.len() < FENCE.len() {
        return (!FENCE.starts_with(t)).then_some(false);
    }
    let Some(info) = t.strip_prefix(FENCE) else {
        return Some(false);
    };
    let Some(nl) = info.find('\n') else {
        // A long first line is no `json` tag.
        return (info.len() > 8).then_some(false);
    };
    if !matches!(info[..nl].trim(), "" | "json") {
        return Some(false);
    }
    let rest = info[nl + 1..].trim_start();
    if rest.is_empty() {
        return None;
    }
    Some(rest.starts_with('{') || rest.starts_with('['))
}

/// The inside of a Markdown code fence around the whole text (the closing fence may be missing:
/// the model stopped there), or the text itself.
fn unfenced(t: &str) -> &str {
    let Some(inner) = t.strip_prefix("```") else {
        return t;
    };
    let Some(nl) = inner.find('\n') else {
        return t;
    };
    let inner = inner[nl + 1..].trim_end();
    inner.strip_suffix("```").unwrap_or(inner)
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
    /// Plain text (Hermes, Mistral: outside any call).
    Text,
    /// Inside a call (Hermes: after `<tool_call>`; Mistral: after `[TOOL_CALLS]`).
    Call,
    /// Nothing but whitespace seen yet, so the reply may still be a bare call.
    Undecided,
    /// The reply opened like a bare call (or Mistral's list); held until the end.
    Held,
}

/// Parses output as it streams: [`Parser::push`] each piece of text, then [`Parser::finish`].
/// The pieces given back, joined, are the same as [`parse`] of the whole text.
#[derive(Clone, Debug)]
pub struct Parser {
    format: Format,
    state: State,
    buf: String,
    /// The part of a forced opening still held (Hermes: after `<tool_call>`; a held reply: all
    /// of it): text the model did not write, so a call that fails to parse gives back only
    /// what follows it.
    forced: String,
}

impl Parser {
    pub fn new(format: Format) -> Self {
        Parser {
            format,
            state: State::Undecided,
            buf: String::new(),
            forced: String::new(),
        }
    }

    /// A parser for output that continues `prefix`, text the prompt already put in the model's
    /// mouth (the opening of a forced call, [`Format::forced_prefix`]).
    pub fn continuing(format: Format, prefix: &str) -> Self {
        let mut p = Parser::new(format);
        let out = p.push(prefix);
        debug_assert!(out.is_empty(), "a forced prefix opens a call");
        p.forced = p.buf.clone();
        p
    }

    /// The tag that opens a call in running text.
    fn open_tag(&self) -> &'static str {
        match self.format {
            Format::Hermes => HERMES_OPEN,
            Format::Mistral => MISTRAL_OPEN,
            Format::Json => "",
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match (self.format, self.state) {
                (Format::Hermes | Format::Mistral, State::Text) => {
                    let tag = self.open_tag();
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
                (_, State::Undecided) => {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        break;
                    }
                    if t.starts_with('`') {
                        match fence_opens_json(t) {
                            None => break, // the fence's first line is not complete yet
                            Some(held) => {
                                self.state = if held { State::Held } else { State::Text };
                                continue;
                            }
                        }
                    }
                    let held = match self.format {
                        Format::Hermes => t.starts_with('{'),
                        Format::Mistral => t.starts_with('{') || t.starts_with('['),
                        Format::Json => {
                            if t.len() < PYTHON_TAG.len() && PYTHON_TAG.starts_with(t) {
                                break; // may still become `<|python_tag|>`
                            }
                            t.starts_with('{') || t.starts_with('[') || t.starts_with(PYTHON_TAG)
                        }
                    };
                    self.state = if held { State::Held } else { State::Text };
                }
                (Format::Json, State::Text) => {
                    push_text(&mut out, &self.buf);
                    self.buf.clear();
                    break;
                }
                // Mistral calls and held replies run to the end of the output.
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
        let calls = match self.state {
            State::Call => calls_of(&buf),
            State::Held => {
                let body = unfenced(buf.trim_start());
                let body = match self.format {
                    Format::Mistral => body.strip_prefix(MISTRAL_OPEN).unwrap_or(body),
                    Format::Json => body.strip_prefix(PYTHON_TAG).unwrap_or(body),
                    Format::Hermes => body,
                };
                calls_of(body)
            }
            State::Text | State::Undecided => None,
        };
        match (calls, self.state) {
            (Some(calls), _) => out.extend(calls.into_iter().map(Piece::Call)),
            (None, State::Call) => push_text(&mut out, &self.unforced(&buf)),
            (None, State::Held) if !self.forced.is_empty() => {
                push_text(&mut out, &self.unforced(&buf))
            }
            (None, State::Held) if self.format != Format::Json => {
                // Not a bare call: read it again as text that may hold tagged calls.
                let mut again = Parser::new(self.format);
                again.state = State::Text;
                out.extend(again.push(&buf));
                out.extend(again.finish());
            }
            (None, _) => push_text(&mut out, &buf),
        }
        self.state = State::Text;
        out
    }

    /// Call text that did not parse, as content: a forced opening was not the model's words
    /// and is left out (with its tag); otherwise the text as the model wrote it, tag included.
    fn unforced(&self, body: &str) -> String {
        match body.strip_prefix(self.forced.as_str()) {
            Some(rest) if !self.forced.is_empty() => rest.to_string(),
            _ if self.state == State::Call => format!("{}{body}", self.open_tag()),
            _ => body.to_string(),
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

/// Which of the parsed calls a request keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keep {
    /// A named `tool_choice`: only calls of this function.
    pub only: Option<String>,
    /// `parallel_tool_calls`: false keeps only the first call.
    pub parallel: bool,
}

impl Default for Keep {
    fn default() -> Self {
        Keep {
            only: None,
            parallel: true,
        }
    }
}

impl Keep {
    /// Whether a call of `name` is kept when `kept` calls already are.
    fn admits(&self, name: &str, kept: usize) -> bool {
        self.only.as_deref().is_none_or(|n| n == name) && (self.parallel || kept == 0)
    }
}

/// What a chat reply gives out: content text, and the kept calls numbered from 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Out {
    Text(String),
    Call(usize, ToolCall),
}

/// A chat reply parsed as it streams, with the request's [`Keep`] rules: what it gives out,
/// joined, is what [`parse_reply`] gives for the whole text. Text is given out as soon as it
/// cannot be the start of a call, except whitespace before any other text, which is held until
/// it is known whether the reply is only calls (then it is dropped, as the whole reply's content
/// is null).
#[derive(Clone, Debug)]
pub struct Stream {
    parser: Parser,
    keep: Keep,
    kept: usize,
    /// Whether text other than whitespace has been given out.
    said: bool,
    held: String,
}

impl Stream {
    pub fn new(format: Format, prefix: &str, keep: Keep) -> Self {
        Stream {
            parser: Parser::continuing(format, prefix),
            keep,
            kept: 0,
            said: false,
            held: String::new(),
        }
    }

    /// Calls given out so far.
    pub fn calls(&self) -> usize {
        self.kept
    }

    pub fn push(&mut self, text: &str) -> Vec<Out> {
        let pieces = self.parser.push(text);
        self.take(pieces)
    }

    pub fn finish(&mut self) -> Vec<Out> {
        let pieces = self.parser.finish();
        let mut out = self.take(pieces);
        let held = std::mem::take(&mut self.held);
        if self.kept == 0 && !held.is_empty() {
            out.push(Out::Text(held));
        }
        out
    }

    fn take(&mut self, pieces: Vec<Piece>) -> Vec<Out> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Text(t) if self.said => out.push(Out::Text(t)),
                Piece::Text(t) => {
                    self.held.push_str(&t);
                    if !self.held.trim().is_empty() {
                        self.said = true;
                        out.push(Out::Text(std::mem::take(&mut self.held)));
                    }
                }
                Piece::Call(c) if self.keep.admits(&c.name, self.kept) => {
                    out.push(Out::Call(self.kept, c));
                    self.kept += 1;
                }
                // A call the request did not ask for (another function than the named one,
                // or past the first without parallel calls) is left out.
                Piece::Call(_) => {}
            }
        }
        out
    }
}

/// A whole chat reply: its content and the calls the request keeps. Content is the text around
/// the calls; None where calls were kept and that text is only whitespace (OpenAI's `content:
/// null`); the text as written (perhaps empty) where no call is kept.
pub fn parse_reply(
    format: Format,
    prefix: &str,
    keep: &Keep,
    text: &str,
) -> (Option<String>, Vec<ToolCall>) {
    let mut p = Parser::continuing(format, prefix);
    let mut pieces = p.push(text);
    pieces.extend(p.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(c) if keep.admits(&c.name, calls.len()) => calls.push(c),
            Piece::Call(_) => {}
        }
    }
    let content = (calls.is_empty() || !content.trim().is_empty()).then_some(content);
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
        String,
        &'static str,
        Option<&'static str>,
        Vec<ToolCall>,
    );

    const WEATHER_ARGS: &str = r#"{"city": "Paris", "unit": "celsius"}"#;

    /// A template source that teaches each format (what `forced_prefix` reads).
    fn template_of(f: Format) -> &'static str {
        match f {
            Format::Hermes => "<tool_call>",
            Format::Mistral => "{{- \"[TOOL_CALLS] [\" }} {% if tools %}",
            Format::Json => "{% if tools %} {\"name\": function name, \"parameters\": ...}",
        }
    }

    fn forced(f: Format, name: Option<&str>) -> String {
        f.forced_prefix(name, template_of(f))
    }

    /// Outputs as models write them (the Hermes ones as Qwen2.5-Coder-0.5B-Instruct wrote them
    /// through `ferrum serve`), with what they must parse to.
    fn cases() -> Vec<Case> {
        let weather = call("get_weather", WEATHER_ARGS);
        let named = |f| forced(f, Some("get_weather"));
        vec![
            (
                Format::Hermes,
                String::new(),
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>",
                None,
                vec![weather.clone()],
            ),
            (
                Format::Hermes,
                String::new(),
                "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
                Some("Let me check.\n\n"),
                vec![weather.clone(), call("get_time", "{}")],
            ),
            // Stopped at the end-of-turn token before the closing tag.
            (
                Format::Hermes,
                String::new(),
                "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}",
                None,
                vec![call("get_time", r#"{"tz": "UTC"}"#)],
            ),
            // A forced opening: the prompt ended with `<tool_call>\n{"name": "get_weather", "arguments": `
            // (the model's own reply to the integration test's named tool_choice).
            (
                Format::Hermes,
                named(Format::Hermes),
                "{\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>",
                None,
                vec![weather.clone()],
            ),
            // `required`: the prompt opened `<tool_call>\n{"name": "`.
            (
                Format::Hermes,
                forced(Format::Hermes, None),
                "get_time\", \"arguments\": {\"timezone\": \"Asia/Tokyo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"timezone\": \"Europe/Paris\"}}\n</tool_call>",
                None,
                vec![
                    call("get_time", r#"{"timezone": "Asia/Tokyo"}"#),
                    call("get_time", r#"{"timezone": "Europe/Paris"}"#),
                ],
            ),
            // Malformed JSON stays content, tags and all; a lone '<' is just text.
            (
                Format::Hermes,
                String::new(),
                "a < b <tool_call>{not json}</tool_call> c",
                Some("a < b <tool_call>{not json}</tool_call> c"),
                vec![],
            ),
            (
                Format::Hermes,
                String::new(),
                "Plain answer, no tools.",
                Some("Plain answer, no tools."),
                vec![],
            ),
            // Two calls in one block, one per line, the closing tag forgotten.
            (
                Format::Hermes,
                named(Format::Hermes),
                " {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n{\"name\": \"get_time\", \"arguments\": {}}",
                None,
                vec![weather.clone(), call("get_time", "{}")],
            ),
            // A bare call object, no tags (small Qwen models do this), arguments as a string.
            (
                Format::Hermes,
                String::new(),
                " {\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": \\\"UTC\\\"}\"}",
                None,
                vec![call("get_time", r#"{"tz": "UTC"}"#)],
            ),
            // JSON that is not a call, then a tagged call.
            (
                Format::Hermes,
                String::new(),
                "{\"x\": 1} then <tool_call>{\"name\": \"get_time\"}</tool_call>",
                Some("{\"x\": 1} then "),
                vec![call("get_time", "{}")],
            ),
            // A call, then the tool's answer imagined by the model: not all calls, so all text.
            (
                Format::Hermes,
                String::new(),
                "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n{\"temperature\": 18}",
                Some("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n{\"temperature\": 18}"),
                vec![],
            ),
            // A forced opening the model then abandons: only its own words are content.
            (
                Format::Hermes,
                forced(Format::Hermes, None),
                "I cannot call tools.",
                Some("I cannot call tools."),
                vec![],
            ),
            // Arguments cut off (max_tokens): the model's words, none of the forced opening.
            (
                Format::Hermes,
                named(Format::Hermes),
                "{\"city\": \"Pa",
                Some("{\"city\": \"Pa"),
                vec![],
            ),
            // Non-ASCII text and arguments, cut inside multi-byte characters while streaming.
            (
                Format::Hermes,
                String::new(),
                "Je vérifie… <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>",
                Some("Je vérifie… "),
                vec![call("get_weather", r#"{"city": "Zürich"}"#)],
            ),
            (
                Format::Mistral,
                String::new(),
                "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}]",
                None,
                vec![weather.clone()],
            ),
            // `[TOOL_CALLS]` is a control token: detokenized, the reply is the bare list.
            (
                Format::Mistral,
                String::new(),
                " [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}, \"id\": \"abcDEF123\"}, {\"name\": \"get_time\", \"arguments\": {}}]",
                None,
                vec![weather.clone(), call("get_time", "{}")],
            ),
            (
                Format::Mistral,
                String::new(),
                "Sure. [TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {}}]",
                Some("Sure. "),
                vec![call("get_time", "{}")],
            ),
            (
                Format::Mistral,
                String::new(),
                "[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {]",
                Some("[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {]"),
                vec![],
            ),
            (
                Format::Mistral,
                String::new(),
                "[1] is a footnote.",
                Some("[1] is a footnote."),
                vec![],
            ),
            (
                Format::Mistral,
                named(Format::Mistral),
                "{\"city\": \"Paris\", \"unit\": \"celsius\"}}]",
                None,
                vec![weather.clone()],
            ),
            (
                Format::Mistral,
                named(Format::Mistral),
                "no.",
                Some("no."),
                vec![],
            ),
            (
                Format::Json,
                String::new(),
                "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}",
                None,
                vec![weather.clone()],
            ),
            (
                Format::Json,
                String::new(),
                "  [{\"name\": \"get_time\", \"arguments\": \"{}\"}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}]",
                None,
                vec![call("get_time", "{}"), weather.clone()],
            ),
            (
                Format::Json,
                named(Format::Json),
                "{\"city\": \"Paris\", \"unit\": \"celsius\"}}",
                None,
                vec![weather.clone()],
            ),
            (
                Format::Json,
                forced(Format::Json, None),
                "get_time\", \"parameters\": {}}",
                None,
                vec![call("get_time", "{}")],
            ),
            (
                Format::Json,
                named(Format::Json),
                "Paris}",
                Some("Paris}"),
                vec![],
            ),
            (Format::Json, String::new(), "{\"answer\": 42}", Some("{\"answer\": 42}"), vec![]),
            (Format::Json, String::new(), "The answer is 42.", Some("The answer is 42."), vec![]),
            (Format::Json, String::new(), "<|python", Some("<|python"), vec![]),
            (Format::Json, String::new(), "{\"name\": \"\"}", Some("{\"name\": \"\"}"), vec![]),
            // A fenced bare call (Qwen2.5-Coder-0.5B's reply with two tools offered).
            (
                Format::Hermes,
                String::new(),
                "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\n    \"city\": \"Paris\"\n  }\n}\n```",
                None,
                vec![call("get_weather", "{\n    \"city\": \"Paris\"\n  }")],
            ),
            // Fenced, the closing fence never written.
            (
                Format::Json,
                String::new(),
                "```\n[{\"name\": \"get_time\", \"parameters\": {}}]\n",
                None,
                vec![call("get_time", "{}")],
            ),
            // Fenced code and fenced JSON that are not calls stay text.
            (
                Format::Hermes,
                String::new(),
                "```python\nprint(1)\n```",
                Some("```python\nprint(1)\n```"),
                vec![],
            ),
            (
                Format::Hermes,
                String::new(),
                "```json\n{\"a\": 1}\n```\nDone.",
                Some("```json\n{\"a\": 1}\n```\nDone."),
                vec![],
            ),
            (
                Format::Json,
                String::new(),
                "```\nplain\n```",
                Some("```\nplain\n```"),
                vec![],
            ),
            (Format::Hermes, String::new(), "`x` is a variable.", Some("`x` is a variable."), vec![]),
            (Format::Mistral, String::new(), "``", Some("``"), vec![]),
            (Format::Hermes, String::new(), "", None, vec![]),
            (Format::Hermes, String::new(), " \n", None, vec![]),
        ]
    }

    #[test]
    fn forced_prefixes() {
        assert_eq!(
            forced(Format::Hermes, Some("get_weather")),
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
        );
        assert_eq!(forced(Format::Hermes, None), "<tool_call>\n{\"name\": \"");
        assert_eq!(
            forced(Format::Mistral, Some("f")),
            "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": "
        );
        assert_eq!(
            Format::Mistral.forced_prefix(None, "[TOOL_CALLS][{"),
            "[TOOL_CALLS][{\"name\": \""
        );
        assert_eq!(
            forced(Format::Json, Some("f")),
            "{\"name\": \"f\", \"parameters\": "
        );
        assert_eq!(
            Format::Json.forced_prefix(Some("f"), "{{ tools | tojson }}"),
            "{\"name\": \"f\", \"arguments\": "
        );
        // A template that never shows the tools: nothing to open.
        assert_eq!(Format::Json.forced_prefix(Some("f"), "{{ messages }}"), "");
        // Names are JSON-escaped.
        assert!(forced(Format::Hermes, Some("a\"b")).contains(r#""a\"b""#));
    }

    #[test]
    fn formats_of_templates() {
        assert_eq!(Format::of_template("x <tool_call> y"), Format::Hermes);
        assert_eq!(Format::of_template("[TOOL_CALLS] ["), Format::Mistral);
        assert_eq!(Format::of_template("<|python_tag|>"), Format::Json);
        assert_eq!(Format::of_template("{{ messages }}"), Format::Json);
    }

    #[test]
    fn whole_outputs() {
        for (format, prefix, text, content, calls) in cases() {
            let (c, k) = parse(format, &prefix, text);
            assert_eq!(c.as_deref(), content, "{format:?} {text:?}");
            assert_eq!(k, calls, "{format:?} {text:?}");
        }
    }

    /// The ways a text is cut into streamed pieces: in two at every byte boundary (of
    /// characters), and one character at a time.
    fn cuts(text: &str) -> Vec<Vec<&str>> {
        let mut cuts: Vec<Vec<&str>> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .map(|i| vec![&text[..i], &text[i..]])
            .collect();
        cuts.push(
            text.char_indices()
                .map(|(i, ch)| &text[i..i + ch.len_utf8()])
                .collect(),
        );
        cuts
    }

    /// Every output cut in two at every byte boundary (and in one-char pieces) parses the same,
    /// and no text piece given out before the end contains tool markup of a well-formed call.
    #[test]
    fn streamed_at_every_boundary() {
        for (format, prefix, text, _, _) in cases() {
            let whole = parse(format, &prefix, text);
            for pieces in cuts(text) {
                let mut p = Parser::continuing(format, &prefix);
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

    /// The request's rules over the same outputs.
    fn keeps() -> Vec<Keep> {
        vec![
            Keep::default(),
            Keep {
                only: None,
                parallel: false,
            },
            Keep {
                only: Some("get_time".into()),
                parallel: true,
            },
        ]
    }

    /// The chat endpoint's stream, cut at every boundary, under every keep rule: the text it
    /// gives out joined is the whole reply's content ("" for null), its calls the whole reply's
    /// calls, numbered from 0; with calls and null content, no text at all is given out.
    #[test]
    fn chat_stream_equals_whole_reply() {
        for (format, prefix, text, _, _) in cases() {
            for keep in keeps() {
                let (content, calls) = parse_reply(format, &prefix, &keep, text);
                for pieces in cuts(text) {
                    let mut s = Stream::new(format, &prefix, keep.clone());
                    let mut out = Vec::new();
                    for piece in &pieces {
                        out.extend(s.push(piece));
                    }
                    out.extend(s.finish());
                    let mut got_text = String::new();
                    let mut got_calls = Vec::new();
                    for o in out {
                        match o {
                            Out::Text(t) => {
                                assert!(!t.is_empty());
                                got_text.push_str(&t)
                            }
                            Out::Call(i, c) => {
                                assert_eq!(i, got_calls.len());
                                got_calls.push(c)
                            }
                        }
                    }
                    let what = format!("{format:?} {keep:?} {pieces:?}");
                    assert_eq!(got_text, content.clone().unwrap_or_default(), "{what}");
                    assert_eq!(got_calls, calls, "{what}");
                    assert_eq!(s.calls(), calls.len(), "{what}");
                }
            }
        }
    }

    #[test]
    fn reply_content_and_keep_rules() {
        let two = "Checking.<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>\n";
        let all = parse_reply(Format::Hermes, "", &Keep::default(), two);
        assert_eq!(all.0.as_deref(), Some("Checking.\n\n"));
        assert_eq!(all.1.len(), 2);
        let first = Keep {
            only: None,
            parallel: false,
        };
        assert_eq!(
            parse_reply(Format::Hermes, "", &first, two).1,
            vec![call("get_weather", r#"{"city": "Paris"}"#)]
        );
        let only = Keep {
            only: Some("get_time".into()),
            parallel: true,
        };
        assert_eq!(
            parse_reply(Format::Hermes, "", &only, two).1,
            vec![call("get_time", "{}")]
        );
        // Only calls: content null. No call kept: the text as written, even if blank.
        let bare = "\n<tool_call>{\"name\": \"get_time\"}</tool_call>\n";
        assert_eq!(
            parse_reply(Format::Hermes, "", &Keep::default(), bare).0,
            None
        );
        assert_eq!(
            parse_reply(Format::Hermes, "", &Keep::default(), " \n").0,
            Some(" \n".into())
        );
        // Arguments keep the model's key order and spacing.
        let args = parse(
            Format::Json,
            "",
            "{\"name\": \"f\", \"parameters\": {\"z\": 1,  \"a\": [1, 2]}}",
        )
        .1;
        assert_eq!(args[0].arguments, "{\"z\": 1,  \"a\": [1, 2]}");
        // Arguments that are neither an object nor a string: not a call.
        assert_eq!(
            parse(Format::Json, "", "{\"name\": \"f\", \"arguments\": 3}").1,
            vec![]
        );
    }

    /// Forced-call grammars on Qwen2.5's real vocabulary, for each format: the replies a model
    /// writes after the forced prefix pass token by token and complete the grammar, and parse
    /// into the call; arguments outside the schema (an unknown enum value, a missing required
    /// key), a second call where one is allowed, or text after the call are refused.
    #[test]
    fn forced_grammars_hold_calls_to_their_schemas() {
        use ferrum_llm::grammar::{Grammar, Grammars};
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
        let llm = ferrum_llm::Llm::load(&path, &Default::default(), &mut |_, _| {})
            .expect("run scripts/fetch_models.py for the Qwen2.5 test model");
        let grammars = Grammars::new(std::sync::Arc::clone(&llm.tokenizer)).unwrap();
        let weather: Value = serde_json::from_str(
            r#"{"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": false}"#,
        )
        .unwrap();
        let tools = vec![
            ("get_weather".to_string(), Some(weather)),
            ("get_time".to_string(), None),
        ];
        // Whether `text` (what follows the prefix) is a whole output of the grammar.
        let passes = |lark: &str, text: &str| -> bool {
            let mut c = grammars.compile(&Grammar::Lark(lark.to_string())).unwrap();
            for id in llm.tokenizer.encode(text, false, false) {
                if c.is_complete() || !c.allows(id).unwrap() {
                    return false;
                }
                c.accept(id).unwrap();
            }
            c.is_complete() || c.can_end()
        };
        let good = r#"{"city": "Paris", "unit": "celsius"}"#;
        let bad_enum = r#"{"city": "Paris", "unit": "kelvin"}"#;
        let missing = r#"{"city": "Paris"}"#;
        let generic = "{% if messages %}{% endif %}";
        for (format, template, named_tail, any_tail, second) in [
            (
                Format::Hermes,
                "<tool_call>",
                "}\n</tool_call>",
                "}\n</tool_call>",
                "\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
            ),
            (
                Format::Mistral,
                "[TOOL_CALLS] [",
                "}]",
                "}]",
                ", {\"name\": \"get_time\", \"arguments\": {}}]",
            ),
            (Format::Json, "tools \"parameters\"", "}", "}", ""),
            (Format::Json, generic, "}", "}", ""),
        ] {
            let key = if template.contains("parameters") {
                "parameters"
            } else {
                "arguments"
            };
            let keep = Keep::default();
            // Named: the prefix opened the call up to its arguments.
            let prefix = format.forced_prefix(Some("get_weather"), template);
            let lark = format
                .forced_grammar(template, &tools, Some("get_weather"), false)
                .unwrap();
            let opening = if prefix.is_empty() {
                format!("{{\"name\": \"get_weather\", \"{key}\": ")
            } else {
                String::new()
            };
            let reply = format!("{opening}{good}{named_tail}");
            assert!(passes(&lark, &reply), "{format:?} named: {reply:?}\n{lark}");
            let (_, calls) = parse_reply(format, &prefix, &keep, &reply);
            assert_eq!(
                calls,
                vec![call("get_weather", good)],
                "{format:?} {reply:?}"
            );
            for wrong in [bad_enum, missing] {
                let reply = format!("{opening}{wrong}{named_tail}");
                assert!(!passes(&lark, &reply), "{format:?} named took {reply:?}");
            }
            assert!(!passes(
                &lark,
                &format!("{opening}{good}{named_tail} and more")
            ));
            // Any function: the prefix opened the call up to the name.
            let prefix = format.forced_prefix(None, template);
            let opening = if prefix.is_empty() {
                "{\"name\": \"".to_string()
            } else {
                String::new()
            };
            for parallel in [false, true] {
                let lark = format
                    .forced_grammar(template, &tools, None, parallel)
                    .unwrap();
                let first = format!("{opening}get_weather\", \"{key}\": {good}{any_tail}");
                let one = first.clone();
                assert!(passes(&lark, &one), "{format:?} any: {one:?}\n{lark}");
                let (_, calls) = parse_reply(format, &prefix, &keep, &one);
                assert_eq!(calls, vec![call("get_weather", good)], "{format:?} {one:?}");
                let bad = format!("{opening}get_weather\", \"{key}\": {bad_enum}{any_tail}");
                assert!(!passes(&lark, &bad), "{format:?} any took {bad:?}");
                let unknown = format!("{opening}get_news\", \"{key}\": {{}}{any_tail}");
                assert!(!passes(&lark, &unknown), "{format:?} any took {unknown:?}");
                if !second.is_empty() {
                    // A second call: after the first's close (Mistral: before its `]`).
                    let two = match format {
                        Format::Mistral => format!("{}{second}", first.trim_end_matches(']')),
                        _ => format!("{first}{second}"),
                    };
                    assert_eq!(
                        passes(&lark, &two),
                        parallel,
                        "{format:?} {parallel}: {two:?}"
                    );
                    if parallel {
                        let (_, calls) = parse_reply(format, &prefix, &keep, &two);
                        assert_eq!(calls.len(), 2, "{format:?} {two:?}");
                    }
                }
            }
        }
    }
}
