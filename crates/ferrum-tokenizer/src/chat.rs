//! Chat templates: Jinja sources from model files, rendered the way Hugging Face
//! `transformers` does (`apply_chat_template`).
//!
//! Environment as in transformers: `trim_blocks` and `lstrip_blocks` on, trailing newline
//! dropped, loop controls (`break`/`continue`) available, Python string/dict/list methods
//! (`.strip()`, `.startswith()`, `.items()`, ...) through minijinja-contrib's pycompat layer.
//! Variables: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`. Functions:
//! `raise_exception(msg)` (fails the render with `msg`), `strftime_now(fmt)` (UTC). Filter:
//! `tojson` with Python `json.dumps` formatting (`ensure_ascii=False`, `", "` / `": "`
//! separators, `indent`, `sort_keys`, `separators` keyword arguments).

use std::fmt::Write;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{context, Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `"system"`, `"user"`, `"assistant"`, ...
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

const NAME: &str = "chat_template";

fn template_error(e: minijinja::Error) -> Error {
    let mut msg = format!("chat template: {e}");
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        let _ = write!(msg, ": {s}");
        src = s.source();
    }
    Error::Msg(msg)
}

impl ChatTemplate {
    /// Compiles `source`. `bos_token`/`eos_token` are the texts the template sees (e.g.
    /// `tokenizer.token_text(bos)`). Syntax errors are reported here.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_owned())
            .map_err(template_error)?;
        Ok(ChatTemplate {
            env,
            source: source.to_owned(),
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders messages given as JSON objects, as Hugging Face's `apply_chat_template` takes
    /// them (`role`, `content`, and where present `tool_calls`, `tool_call_id`, `name`), with
    /// `tools` (the request's list of tool definitions, None: the template sees no `tools`) and
    /// `extra` variables (`chat_template_kwargs`, e.g. `enable_thinking`; they cannot replace
    /// the variables above).
    ///
    /// `messages` and `tools` are anything that serializes to JSON; the template sees their
    /// objects' keys in the order they serialize in (as Python dicts keep them), so a
    /// `serde_json::value::RawValue` holding a client's JSON reaches `tojson` with the client's
    /// key order, not sorted.
    pub fn render_json<M, T>(
        &self,
        messages: &M,
        tools: Option<&T>,
        extra: &serde_json::Map<String, serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String>
    where
        M: Serialize + ?Sized,
        T: Serialize + ?Sized,
    {
        let tmpl = self.env.get_template(NAME).map_err(template_error)?;
        let mut ctx: Vec<(String, Value)> = Vec::with_capacity(extra.len() + 5);
        let reserved = [
            "messages",
            "tools",
            "add_generation_prompt",
            "bos_token",
            "eos_token",
        ];
        for (k, v) in extra {
            if !reserved.contains(&k.as_str()) {
                ctx.push((k.clone(), ordered_value(v)?));
            }
        }
        ctx.push(("messages".into(), ordered_value(messages)?));
        if let Some(t) = tools {
            ctx.push(("tools".into(), ordered_value(t)?));
        }
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        ctx.push(("bos_token".into(), Value::from(self.bos_token.as_str())));
        ctx.push(("eos_token".into(), Value::from(self.eos_token.as_str())));
        tmpl.render(Value::from_iter(ctx)).map_err(template_error)
    }

    /// Renders `messages`; with `add_generation_prompt` the template appends the opening of
    /// the assistant's turn. A `raise_exception(msg)` in the template gives an `Err` whose
    /// text contains `msg`.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self.env.get_template(NAME).map_err(template_error)?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(template_error)
    }
}

/// A template value from anything serializable to JSON, its objects' keys in serialization order
/// (through JSON text: minijinja's maps keep insertion order, `serde_json::Value`'s do not).
fn ordered_value<S: Serialize + ?Sized>(v: &S) -> Result<Value> {
    let text =
        serde_json::to_string(v).map_err(|e| Error::Msg(format!("chat template input: {e}")))?;
    serde_json::from_str(&text).map_err(|e| Error::Msg(format!("chat template input: {e}")))
}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// Python `json.dumps` formatting options.
struct JsonFmt {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.kind() == ValueKind::Number => {
            Some(" ".repeat(i64::try_from(v)?.max(0) as usize))
        }
        Some(v) => Some(v.as_str().unwrap_or_default().to_owned()),
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let fmt = JsonFmt {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&value, &fmt, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write_json_str(s: &str, ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn newline(fmt: &JsonFmt, depth: usize, out: &mut String) {
    if let Some(ind) = &fmt.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

fn write_json(
    v: &Value,
    fmt: &JsonFmt,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Ok(i) = i64::try_from(v.clone()) {
                if v.as_i64().is_some() {
                    let _ = write!(out, "{i}");
                    return Ok(());
                }
            }
            let f = f64::try_from(v.clone())?;
            if f.is_nan() {
                out.push_str("NaN");
            } else if f.is_infinite() {
                out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
            } else if f.fract() == 0.0 && f.abs() < 1e16 {
                let _ = write!(out, "{f:.1}");
            } else {
                let _ = write!(out, "{f}");
            }
        }
        ValueKind::String | ValueKind::Bytes => {
            write_json_str(v.as_str().unwrap_or_default(), fmt.ensure_ascii, out)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, it) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&fmt.item_sep);
                }
                newline(fmt, depth + 1, out);
                write_json(it, fmt, depth + 1, out)?;
            }
            newline(fmt, depth, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if fmt.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&fmt.item_sep);
                }
                newline(fmt, depth + 1, out);
                match k.as_str() {
                    Some(s) => write_json_str(s, fmt.ensure_ascii, out),
                    None => write_json_str(&k.to_string(), fmt.ensure_ascii, out),
                }
                out.push_str(&fmt.key_sep);
                write_json(&v.get_item(k)?, fmt, depth + 1, out)?;
            }
            newline(fmt, depth, out);
            out.push('}');
        }
        _ => write_json_str(&v.to_string(), fmt.ensure_ascii, out),
    }
    Ok(())
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Civil date from days since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Formats a Unix time (seconds, UTC) with the common `strftime` codes.
pub(crate) fn strftime_utc(secs: i64, fmt: &str) -> String {
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (sod / 3600, sod / 60 % 60, sod % 60);
    let wd = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let is_leap = |y: i64| (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[m as usize - 1] + d + u32::from(m > 2 && is_leap(y));
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match it.next() {
            Some('Y') => write!(out, "{y}"),
            Some('y') => write!(out, "{:02}", y.rem_euclid(100)),
            Some('m') => write!(out, "{m:02}"),
            Some('d') => write!(out, "{d:02}"),
            Some('e') => write!(out, "{d:2}"),
            Some('-') => match it.next() {
                Some('d') => write!(out, "{d}"),
                Some('m') => write!(out, "{m}"),
                Some('H') => write!(out, "{hh}"),
                Some(o) => write!(out, "%-{o}"),
                None => write!(out, "%-"),
            },
            Some('H') => write!(out, "{hh:02}"),
            Some('I') => write!(out, "{:02}", (hh + 11) % 12 + 1),
            Some('p') => write!(out, "{}", if hh < 12 { "AM" } else { "PM" }),
            Some('M') => write!(out, "{mm:02}"),
            Some('S') => write!(out, "{ss:02}"),
            Some('j') => write!(out, "{yday:03}"),
            Some('B') => write!(out, "{}", MONTHS[m as usize - 1]),
            Some('b') | Some('h') => write!(out, "{}", &MONTHS[m as usize - 1][..3]),
            Some('A') => write!(out, "{}", DAYS[wd]),
            Some('a') => write!(out, "{}", &DAYS[wd][..3]),
            Some('%') => write!(out, "%"),
            Some(o) => write!(out, "%{o}"),
            None => write!(out, "%"),
        };
    }
    out
}

fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime_utc(secs, &fmt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime() {
        // 2024-02-29 13:05:09 UTC, a Thursday
        let t = 1_709_211_909;
        assert_eq!(
            strftime_utc(t, "%Y-%m-%d %H:%M:%S %A %a %B %b %j %y %-d %%"),
            "2024-02-29 13:05:09 Thursday Thu February Feb 060 24 29 %"
        );
        assert_eq!(strftime_utc(0, "%d %B %Y"), "01 January 1970");
    }

    #[test]
    fn tojson_python_style() {
        let t = ChatTemplate::new(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ 'é\"\n' | tojson }}|{{ [] | tojson }}|\
             {{ x | tojson(sort_keys=true) }}",
            "",
            "",
        )
        .unwrap();
        let env = &t.env;
        let out = env
            .get_template(NAME)
            .unwrap()
            .render(context! { x => serde_json::json!({"b": [1, 2.5, null, true], "a": "s"}) })
            .unwrap();
        assert_eq!(
            out,
            // Keys in the mapping's own order (Python's json.dumps), sorted on request.
            "{\"b\": [1, 2.5, null, true], \"a\": \"s\"}|{\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"a\": \"s\"\n}|\"é\\\"\\n\"|[]|\
             {\"a\": \"s\", \"b\": [1, 2.5, null, true]}"
        );
    }

    /// Tools and tool-call arguments reach the template in their serialized key order (HF renders
    /// the dicts it is given), `chat_template_kwargs` become variables, and the reserved
    /// variables cannot be replaced by them.
    #[test]
    fn render_json_keeps_key_order() {
        let t = ChatTemplate::new(
            "{% for t in tools %}{{ t | tojson }}\n{% endfor %}\
             {% for m in messages %}{{ m.role }}:{{ m.content }}\
             {% for c in m.tool_calls %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}\
             {% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}\n{% endfor %}\
             {{ enable_thinking }} {{ add_generation_prompt }}",
            "<s>",
            "</s>",
        )
        .unwrap();
        let tools: Value = serde_json::from_str(
            r#"[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"z": {}, "a": {}}}}}]"#,
        )
        .unwrap();
        let msgs: Value = serde_json::from_str(
            r#"[{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"z": 1, "a": [2.5, null]}}}]},
                {"role": "tool", "content": "ok", "tool_call_id": "call_1"}]"#,
        )
        .unwrap();
        let mut extra = serde_json::Map::new();
        extra.insert("enable_thinking".into(), false.into());
        extra.insert("add_generation_prompt".into(), "no".into());
        let out = t.render_json(&msgs, Some(&tools), &extra, true).unwrap();
        assert_eq!(
            out,
            "{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": \
             {\"type\": \"object\", \"properties\": {\"z\": {}, \"a\": {}}}}}\n\
             user:hiassistant:[f {\"z\": 1, \"a\": [2.5, null]}]tool:ok(call_1)False True"
        );
        // No tools: the template sees none (`tools` undefined, so `for` runs zero times).
        let none: Option<&serde_json::Value> = None;
        let out = t.render_json(&msgs, none, &extra, false).unwrap();
        assert!(
            out.starts_with("user:hi") && out.ends_with("False False"),
            "{out}"
        );
    }
}
