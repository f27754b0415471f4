//! llama.cpp's GBNF grammars, rewritten into `llguidance`'s Lark syntax.
//!
//! GBNF: `name ::= body` rules (the start rule is `root`), a rule ending at the end of its line
//! unless inside parentheses or after `::=` / `|`; `"literals"` and `[character classes]` with
//! `\n \r \t \\ \" \[ \] \- \xHH \uHHHH \UHHHHHHHH` escapes, `[^...]` negated, `.` any character;
//! `( )` groups, `|` alternatives, `* + ?` and `{m}`, `{m,}`, `{m,n}` repetition; `#` comments.
//!
//! The rewrite keeps the structure: each rule becomes a Lark rule (names made lowercase-safe),
//! literals become JSON-quoted strings, character classes and `.` become one-character regexes
//! (every character written as `\x{..}`, so nothing in them is read as regex syntax).

use std::collections::HashSet;

use ferrum_core::{Error, Result};

fn err<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::Msg(format!("GBNF: {}", msg.into())))
}

struct Reader<'a> {
    src: &'a [u8],
    text: &'a str,
    pos: usize,
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Option<u8> {
        self.src.get(self.pos).copied()
    }

    /// The line of the current position (counted on demand: only errors name lines).
    fn line(&self) -> usize {
        line_at(self.src, self.pos)
    }

    /// Skips spaces, tabs and comments; newlines too when `newlines`.
    fn space(&mut self, newlines: bool) {
        while let Some(b) = self.peek() {
            match b {
                b' ' | b'\t' => self.pos += 1,
                b'\r' | b'\n' if newlines => self.pos += 1,
                b'#' => {
                    while self.peek().is_some_and(|b| b != b'\n') {
                        self.pos += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Option<&'a str> {
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            self.pos += 1;
        }
        (self.pos > start).then(|| &self.text[start..self.pos])
    }

    fn number(&mut self) -> Option<u64> {
        let start = self.pos;
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.pos += 1;
        }
        self.text[start..self.pos].parse().ok()
    }

    /// One character of a literal or class, escapes decoded.
    fn char(&mut self) -> Result<char> {
        let rest = &self.text[self.pos..];
        let mut it = rest.chars();
        let Some(c) = it.next() else {
            return err("unexpected end of grammar");
        };
        if c != '\\' {
            self.pos += c.len_utf8();
            return Ok(c);
        }
        let Some(e) = it.next() else {
            return err("unexpected end of grammar after '\\'");
        };
        self.pos += 1 + e.len_utf8();
        let hex = |r: &mut Self, n: usize| -> Result<char> {
            let digits = r.text.get(r.pos..r.pos + n).unwrap_or("");
            let v = u32::from_str_radix(digits, 16)
                .ok()
                .filter(|_| digits.len() == n);
            r.pos += n;
            match v.and_then(char::from_u32) {
                Some(c) => Ok(c),
                None => err(format!("bad escape \\{e}{digits} on line {}", r.line())),
            }
        };
        match e {
            'n' => Ok('\n'),
            'r' => Ok('\r'),
            't' => Ok('\t'),
            '0' => Ok('\0'),
            'x' => hex(self, 2),
            'u' => hex(self, 4),
            'U' => hex(self, 8),
            '\\' | '"' | '[' | ']' | '-' | '^' | '\'' | '/' | '.' | '|' | '(' | ')' | '*' | '+'
            | '?' | '{' | '}' => Ok(e),
            other => err(format!("unknown escape \\{other} on line {}", self.line())),
        }
    }
}

/// A GBNF rule name as a Lark rule name: lowercase letters and digits kept, an uppercase letter
/// `X` written `_x`, `-` written `__`, and a `g_` prefix so no name collides with a keyword or
/// with another rewritten name.
/// The 1-based line of byte offset `pos` in `src`.
fn line_at(src: &[u8], pos: usize) -> usize {
    1 + src[..pos.min(src.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
}

fn rule_name(n: &str) -> String {
    let mut s = String::from("g_");
    for c in n.chars() {
        match c {
            'a'..='z' | '0'..='9' => s.push(c),
            'A'..='Z' => {
                s.push('_');
                s.push(c.to_ascii_lowercase());
            }
            '-' => s.push_str("__"),
            _ => s.push_str("_0"),
        }
    }
    s
}

fn class_char(c: char) -> String {
    format!("\\x{{{:X}}}", c as u32)
}

/// Rewrites a GBNF grammar into Lark. Errors name the line of a syntax error, a rule used but
/// never defined, or a grammar without `root`.
pub fn to_lark(src: &str) -> Result<String> {
    let mut r = Reader {
        src: src.as_bytes(),
        text: src,
        pos: 0,
    };
    let mut out = String::new();
    let mut defined: HashSet<&str> = HashSet::new();
    // Rule references and their byte offsets, checked once every rule is read.
    let mut used: Vec<(String, usize)> = Vec::new();
    loop {
        r.space(true);
        if r.peek().is_none() {
            break;
        }
        let Some(name) = r.name() else {
            return err(format!("expected a rule name on line {}", r.line()));
        };
        r.space(false);
        if !r.text[r.pos..].starts_with("::=") {
            return err(format!(
                "expected '::=' after '{name}' on line {}",
                r.line()
            ));
        }
        r.pos += 3;
        r.space(true);
        let body = alternatives(&mut r, false, &mut used)?;
        if !defined.insert(name) {
            return err(format!("rule '{name}' is defined twice"));
        }
        out.push_str(&format!("{}: {body}\n", rule_name(name)));
        match r.peek() {
            None => break,
            Some(b'\n' | b'\r') => {}
            Some(b) => return err(format!("unexpected '{}' on line {}", b as char, r.line())),
        }
    }
    if !defined.contains("root") {
        return err("no 'root' rule");
    }
    for (u, at) in &used {
        if !defined.contains(u.as_str()) {
            let line = line_at(r.src, *at);
            return err(format!("rule '{u}' (line {line}) is not defined"));
        }
    }
    Ok(format!("start: {}\n{out}", rule_name("root")))
}

fn alternatives(
    r: &mut Reader<'_>,
    nested: bool,
    used: &mut Vec<(String, usize)>,
) -> Result<String> {
    let mut alts = vec![sequence(r, nested, used)?];
    while r.peek() == Some(b'|') {
        r.pos += 1;
        r.space(true);
        alts.push(sequence(r, nested, used)?);
    }
    Ok(alts.join(" | "))
}

fn sequence(r: &mut Reader<'_>, nested: bool, used: &mut Vec<(String, usize)>) -> Result<String> {
    let mut items: Vec<String> = Vec::new();
    loop {
        let item = match r.peek() {
            Some(b'"') => {
                r.pos += 1;
                let mut s = String::new();
                while r.peek() != Some(b'"') {
                    if r.peek().is_none() {
                        return err("unterminated string");
                    }
                    s.push(r.char()?);
                }
                r.pos += 1;
                if s.is_empty() {
                    // An empty literal matches the empty string.
                    "\"\"".to_string()
                } else {
                    super::lark_literal(&s)
                }
            }
            Some(b'[') => {
                r.pos += 1;
                let mut class = String::from("[");
                if r.peek() == Some(b'^') {
                    r.pos += 1;
                    class.push('^');
                }
                let mut empty = true;
                while r.peek() != Some(b']') {
                    if r.peek().is_none() {
                        return err("unterminated character class");
                    }
                    let lo = r.char()?;
                    class.push_str(&class_char(lo));
                    if r.peek() == Some(b'-') && r.src.get(r.pos + 1) != Some(&b']') {
                        r.pos += 1;
                        let hi = r.char()?;
                        if hi < lo {
                            return err(format!(
                                "character range {lo:?}-{hi:?} runs backwards on line {}",
                                r.line()
                            ));
                        }
                        class.push('-');
                        class.push_str(&class_char(hi));
                    }
                    empty = false;
                }
                r.pos += 1;
                if empty {
                    return err(format!("empty character class on line {}", r.line()));
                }
                class.push(']');
                format!("/{class}/")
            }
            Some(b'.') => {
                r.pos += 1;
                "/(?s:.)/".to_string()
            }
            Some(b'(') => {
                r.pos += 1;
                r.space(true);
                let inner = alternatives(r, true, used)?;
                if r.peek() != Some(b')') {
                    return err(format!("expected ')' on line {}", r.line()));
                }
                r.pos += 1;
                format!("({inner})")
            }
            Some(b) if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' => {
                let save = r.pos;
                let name = r.name().expect("a name starts here");
                // The next rule's `name ::=` ends this one (only possible across a newline,
                // which the loop below never crosses outside parentheses).
                let mut look = Reader {
                    src: r.src,
                    text: r.text,
                    pos: r.pos,
                };
                look.space(false);
                if look.text[look.pos..].starts_with("::=") {
                    r.pos = save;
                    break;
                }
                used.push((name.to_string(), save));
                rule_name(name)
            }
            _ => break,
        };
        // Repetition.
        let item = match r.peek() {
            Some(op @ (b'*' | b'+' | b'?')) => {
                r.pos += 1;
                format!("{item}{}", op as char)
            }
            Some(b'{') => {
                r.pos += 1;
                r.space(false);
                let Some(min) = r.number() else {
                    return err(format!("expected a count after '{{' on line {}", r.line()));
                };
                r.space(false);
                let max = if r.peek() == Some(b',') {
                    r.pos += 1;
                    r.space(false);
                    r.number()
                } else {
                    Some(min)
                };
                r.space(false);
                if r.peek() != Some(b'}') {
                    return err(format!("expected '}}' on line {}", r.line()));
                }
                r.pos += 1;
                if min > 10_000 || max.is_some_and(|m| m > 10_000) {
                    return err(format!("repetition count over 10000 on line {}", r.line()));
                }
                match max {
                    Some(max) if max < min => {
                        return err(format!(
                            "repetition {{{min},{max}}} runs backwards on line {}",
                            r.line()
                        ))
                    }
                    Some(max) => format!("({item}){{{min},{max}}}"),
                    None => format!("({item}){{{min},}}"),
                }
            }
            _ => item,
        };
        items.push(item);
        r.space(nested);
    }
    if items.is_empty() {
        // An empty alternative matches the empty string.
        return Ok("\"\"".to_string());
    }
    Ok(items.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_the_constructs() {
        let g = r#"
# a comment
root   ::= greeting (" " name)? punct{1,3} tail
greeting ::= "hi" | "hello\n"   # trailing comment
name ::= [A-Z] [a-z-]* | [^0-9\]]+
punct ::= "!" | [.?]
tail ::= (
    "x" |
    "y"
  )* any{2,}
any ::= .
"#;
        let l = to_lark(g).unwrap();
        let want = "start: g_root\n\
g_root: g_greeting (\" \" g_name)? (g_punct){1,3} g_tail\n\
g_greeting: \"hi\" | \"hello\\n\"\n\
g_name: /[\\x{41}-\\x{5A}]/ /[\\x{61}-\\x{7A}\\x{2D}]/* | /[^\\x{30}-\\x{39}\\x{5D}]/+\n\
g_punct: \"!\" | /[\\x{2E}\\x{3F}]/\n\
g_tail: (\"x\" | \"y\")* (g_any){2,}\n\
g_any: /(?s:.)/\n";
        assert_eq!(l, want);
    }

    #[test]
    fn names_do_not_collide() {
        assert_eq!(rule_name("root"), "g_root");
        assert_ne!(rule_name("a-b"), rule_name("a_b"));
        assert_ne!(rule_name("Ab"), rule_name("ab"));
        assert_eq!(rule_name("Ab-1"), "g__ab__1");
    }

    #[test]
    fn errors_name_the_problem() {
        for (g, want) in [
            ("root ::= foo", "rule 'foo' (line 1) is not defined"),
            ("start ::= \"a\"", "no 'root' rule"),
            ("root ::= \"a", "unterminated string"),
            ("root ::= [a", "unterminated character class"),
            ("root ::= [z-a]", "runs backwards"),
            ("root ::= (\"a\"", "expected ')'"),
            ("root \"a\"", "expected '::='"),
            ("root ::= \"a\"{3,1}", "runs backwards"),
            ("root ::= \"a\"{99999}", "over 10000"),
            ("root ::= \"\\q\"", "unknown escape"),
            ("root ::= \"a\"\nroot ::= \"b\"", "defined twice"),
            ("root ::= \"a\" )", "unexpected ')'"),
            ("::= \"a\"", "expected a rule name"),
        ] {
            let e = to_lark(g).unwrap_err().to_string();
            assert!(e.contains(want), "{g:?}: {e}");
        }
    }

    #[test]
    fn escapes_decode() {
        let l = to_lark(r#"root ::= "\x41\u00e9\t\"" [\x00-\x1F]"#).unwrap();
        assert!(l.contains("\"Aé\\t\\\"\""), "{l}");
        assert!(l.contains("/[\\x{0}-\\x{1F}]/"), "{l}");
    }
}
