//! Constrained decoding: a grammar per request, turned into a mask over the vocabulary before
//! each token is sampled, so the output always belongs to the grammar's language.
//!
//! The grammar engine is `llguidance` (an Earley parser over a lexer, walking the tokenizer's
//! byte trie once per step: JSON Schema, Lark, regular expressions). This module adapts it to
//! ferrum's tokenizer and to the request shapes servers accept:
//!
//! - [`Grammar`]: what a request asks for (a JSON Schema, any JSON object, a regex, one of a list
//!   of strings, a Lark grammar, a GBNF grammar as llama.cpp takes it; see [`gbnf`]).
//! - [`Grammars`]: compiles them for one model's vocabulary (built once; the byte trie of every
//!   token, control tokens kept out of text).
//! - [`Constraint`]: one sequence's parser state: [`Constraint::mask`] sets forbidden logits to
//!   -inf, [`Constraint::accept`] advances by the sampled token, [`Constraint::is_complete`] says
//!   when nothing but the end may follow.
//!
//! Bounds: compiling and each step run on `llguidance`'s fuel limits (lexer states, Earley
//! items, grammar size), so a pathological grammar fails with an error instead of stalling.
//! JSON whitespace between tokens is bounded as llama.cpp's schema grammars bound it (a space, or
//! one or two newlines and up to 20 spaces or tabs of indent), so a model cannot spin in
//! whitespace forever.

pub mod gbnf;

use std::sync::Arc;

use ferrum_core::{Error, Result};
use ferrum_tokenizer::{TokenType, Tokenizer};
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{self, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// A JSON value valid under this JSON Schema (draft 2020-12 as `llguidance` supports it).
    JsonSchema(Value),
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// Text matching this regular expression as a whole (Rust `regex` syntax).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in `llguidance`'s Lark syntax (`start: ...`; `%json {...}` embeds a schema).
    Lark(String),
    /// A grammar in llama.cpp's GBNF (`root ::= ...`).
    Gbnf(String),
}

/// JSON whitespace between tokens: a space, or one or two newlines and at most 20 spaces or tabs
/// (llama.cpp's `space` rule), so pretty-printed and compact JSON both pass but whitespace cannot
/// run on.
const JSON_WHITESPACE: &str = r"(?: |\n{1,2}[ \t]{0,20})";

/// A JSON Schema with ferrum's compile options: bounded whitespace, and the usual separators.
fn schema_with_options(mut schema: Value) -> Result<Value> {
    let Value::Object(map) = &mut schema else {
        // `true` is "anything"; `false` admits nothing; other values are not schemas.
        return match schema {
            Value::Bool(true) => schema_with_options(json!({})),
            Value::Bool(false) => Err(Error::Msg("the JSON Schema `false` admits no value".into())),
            other => Err(Error::Msg(format!(
                "a JSON Schema must be an object or a boolean, found {}",
                kind_of(&other)
            ))),
        };
    };
    let mut opts = match map.remove("x-guidance") {
        Some(Value::Object(o)) => o,
        Some(_) => return Err(Error::Msg("x-guidance must be an object".into())),
        None => serde_json::Map::new(),
    };
    opts.entry("whitespace_pattern")
        .or_insert_with(|| json!(JSON_WHITESPACE));
    opts.entry("item_separator").or_insert_with(|| json!(","));
    opts.entry("key_separator").or_insert_with(|| json!(":"));
    map.insert("x-guidance".into(), Value::Object(opts));
    Ok(schema)
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A string as a Lark literal (a JSON string: the syntax `llguidance` reads).
pub fn lark_literal(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// `%json {...}` for a schema, with ferrum's options, for use inside a Lark grammar.
pub fn lark_json(schema: &Value) -> Result<String> {
    let s = schema_with_options(schema.clone())?;
    Ok(format!("%json {s}"))
}

impl Grammar {
    /// The grammar in `llguidance`'s terms.
    fn top_level(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            Grammar::JsonSchema(s) => {
                TopLevelGrammar::from_json_schema(schema_with_options(s.clone())?)
            }
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(schema_with_options(json!({"type": "object"}))?)
            }
            Grammar::Regex(r) => {
                // The regex must parse as Rust's syntax; llguidance reads the same syntax.
                if r.is_empty() {
                    return Err(Error::Msg("the regex is empty".into()));
                }
                TopLevelGrammar::from_regex(r)
            }
            Grammar::Choice(c) => {
                if c.is_empty() {
                    return Err(Error::Msg("the list of choices is empty".into()));
                }
                let alts: Vec<String> = c.iter().map(|s| lark_literal(s)).collect();
                TopLevelGrammar::from_lark(format!("start: {}\n", alts.join(" | ")))
            }
            Grammar::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            Grammar::Gbnf(g) => TopLevelGrammar::from_lark(gbnf::to_lark(g)?),
        })
    }
}

/// The tokenizer as `llguidance` sees it: each token's bytes in a trie (control tokens as
/// `\xff` + their text, which no text grammar matches), and ferrum's encoder for the strings a
/// grammar forces.
struct Env {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(text) => self.tokenizer.encode(text, false, false),
            // Not text (a cut character): the trie's greedy split is a valid tokenization.
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Grammar compiler for one model's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
}

impl Grammars {
    /// Builds the byte trie of `tokenizer`'s vocabulary (tens of milliseconds for 150k tokens).
    /// End-of-generation tokens end a grammar's output.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Grammars> {
        let vocab = tokenizer.vocab_size();
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tokenizer.token_type(id) {
                Some(TokenType::Control) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tokenizer.token_text(id).as_bytes());
                    w
                }
                Some(TokenType::Unknown | TokenType::Unused) | None => Vec::new(),
                _ => tokenizer.token_bytes(id, false),
            })
            .collect();
        let eog = tokenizer.eog_ids();
        let eos = tokenizer
            .eos()
            .or_else(|| eog.first().copied())
            .ok_or_else(|| Error::Msg("constrained decoding needs an end-of-text token".into()))?;
        let mut info = TokRxInfo::new(vocab as u32, eos);
        info.tok_bos = tokenizer.bos();
        let mut ends = vec![eos];
        ends.extend(eog.iter().copied().filter(|&e| e != eos));
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&ends);
        let env: TokEnv = Arc::new(Env { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::Msg(format!("grammar engine: {e}")))?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Grammars { factory, vocab })
    }

    /// Compiles `g` into a fresh constraint. Errors name what is wrong with the grammar (a bad
    /// schema, a syntax error, a grammar that admits no output at all, one over the size and
    /// time bounds).
    pub fn compile(&self, g: &Grammar) -> Result<Constraint> {
        let top = g.top_level()?;
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| Error::Msg(short_error(&e.to_string())))?;
        let mut c = Constraint {
            matcher: Matcher::new(Ok(parser)),
            vocab: self.vocab,
        };
        // The first mask: an unsatisfiable grammar admits no token at all.
        let first = c.allowed()?;
        if first.is_zero() {
            return Err(Error::Msg("the grammar admits no output".into()));
        }
        Ok(c)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab
    }
}

/// An `llguidance` error on one line, at most 400 characters (its first lines name the problem;
/// parser dumps may follow).
fn short_error(e: &str) -> String {
    let joined = e
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .take(6)
        .collect::<Vec<_>>()
        .join(" ");
    let mut s: String = joined.chars().take(400).collect();
    if s.len() < joined.len() {
        s.push('…');
    }
    s
}

/// One sequence's constraint: the parser state after the tokens accepted so far. A clone
/// continues independently (each choice of a request gets one).
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("complete", &self.is_complete())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// The tokens allowed next: the end-of-generation tokens alone once the output is complete.
    fn allowed(&mut self) -> Result<toktrie::SimpleVob> {
        self.matcher
            .compute_mask_or_eos()
            .map_err(|e| Error::Msg(format!("grammar: {}", short_error(&e.to_string()))))
    }

    /// Sets the logits of every token the grammar forbids next to -inf (end-of-generation tokens
    /// are allowed exactly when the output may end here). `logits` may be longer than the
    /// vocabulary (padded output rows): the padding is forbidden too. An error (the parser out of
    /// its bounds, or no token allowed) leaves `logits` unchanged.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let allowed = self.allowed()?;
        if allowed.is_zero() {
            return Err(Error::Msg("grammar: no token is allowed here".into()));
        }
        let words = allowed.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (j, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << j) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        Ok(())
    }

    /// Whether the grammar allows `id` next (computes the mask).
    pub fn allows(&mut self, id: u32) -> Result<bool> {
        Ok((id as usize) < self.vocab && self.allowed()?.is_allowed(id))
    }

    /// Advances by the sampled token. A token the grammar forbids is an error.
    pub fn accept(&mut self, id: u32) -> Result<()> {
        self.matcher
            .consume_token(id)
            .map_err(|e| Error::Msg(format!("grammar: {}", short_error(&e.to_string()))))
    }

    /// Whether the output is complete: nothing but the end may follow.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }

    /// Whether the output could end here (the end-of-text token is allowed).
    pub fn can_end(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_options_are_added_and_kept() {
        let s = schema_with_options(json!({"type": "object"})).unwrap();
        assert_eq!(s["x-guidance"]["whitespace_pattern"], JSON_WHITESPACE);
        let s = schema_with_options(
            json!({"type": "object", "x-guidance": {"whitespace_pattern": " ?"}}),
        )
        .unwrap();
        assert_eq!(s["x-guidance"]["whitespace_pattern"], " ?");
        assert!(schema_with_options(json!(false)).is_err());
        assert!(schema_with_options(json!(3)).is_err());
        assert!(schema_with_options(json!(true)).is_ok());
    }

    #[test]
    fn literals_escape() {
        assert_eq!(lark_literal("a\"b\n"), "\"a\\\"b\\n\"");
    }
}
