//! BPE pre-tokenizers: split a raw text fragment into words before merging.
//!
//! llama.cpp describes each pre-tokenizer as a list of regexes applied in sequence: every regex
//! splits every piece produced by the previous stage, and the text *between* two matches is kept
//! as a piece of its own (so no text is ever dropped). The big GPT-2 and Llama 3 patterns run as
//! hand-written matchers over code points (`unicode_regex_split_custom_*` in `src/unicode.cpp`);
//! the small helper patterns (`\p{N}`, `\p{N}+`, `[0-9][0-9][0-9]`, punctuation runs) run
//! through `std::regex`. This module implements each stage as a matcher over `char`s with the
//! same results, including llama.cpp's quirks (see [`crate::unicode`] for the flag semantics).
//!
//! The exception is the o200k_base (`gpt-4o`) pattern: llama.cpp has no hand-written matcher for
//! it and runs an approximation through `std::regex` (see [`PreTokenizer::Gpt4o`]); here it is
//! matched exactly as the original regex (tiktoken, Hugging Face `tokenizers`) does.

use std::ops::Range;

use crate::unicode::Flags;
use crate::{Error, Result};

/// The pre-tokenizer selected by `tokenizer.ggml.pre`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// The GPT-2 pattern alone:
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
    Gpt2,
    /// `\p{N}` (every numeric code point isolated), then GPT-2. SmolLM, StarCoder, Refact,
    /// Command-R, CodeShell, EXAONE, Minerva.
    DigitsThenGpt2,
    /// llama.cpp's fallback list for `default` (and a missing `pre`): punctuation runs
    /// `[\p{P}\$\+<=>\^~\|]+`, GPT-2, `\p{N}+`, then `[0-9][0-9][0-9]`.
    Default,
    /// Llama 3: `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
    /// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
    Llama3,
    /// Qwen 2: the Llama 3 pattern with single digits (`\p{N}` instead of `\p{N}{1,3}`).
    Qwen2,
    /// OpenAI's o200k_base (GPT-4o, gpt-oss; also Llama 4 and MiniMax-M2):
    /// `[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|
    /// [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|
    /// \p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
    ///
    /// Words split at case changes (`HelloWorld` → `Hello` `World`), keep their combining marks
    /// and an (any-case) English contraction, and punctuation runs take following newlines and
    /// slashes. This is the exact regex, as tiktoken and Hugging Face `tokenizers` apply it
    /// (`(?i:'s)` also matches `'ſ`, by simple case folding). llama.cpp instead runs a
    /// `std::regex` rewrite over its collapsed category bytes, which splits ASCII text the same
    /// but differs on some non-ASCII text: every non-ASCII letter counts as both upper and
    /// lower case (so `HelloÉcole` and `МоскваСити` stay one word), combining marks are not
    /// part of words (`cafe\u{301}` → `cafe` `\u{301}`; Devanagari and Arabic vowel signs split
    /// words), and its contractions are ASCII-only.
    Gpt4o,
}

impl PreTokenizer {
    /// Maps a `tokenizer.ggml.pre` value to its pre-tokenizer, with llama.cpp's aliases.
    /// `None` (key absent) gives [`PreTokenizer::Default`], as llama.cpp does.
    pub fn from_name(pre: Option<&str>) -> Result<Self> {
        let Some(name) = pre else {
            return Ok(PreTokenizer::Default);
        };
        Ok(match name {
            "default" => PreTokenizer::Default,
            "gpt2" | "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" | "trillion"
            | "granite-docling" | "exaone4" | "jina-es" | "jina-de" | "jina-v2-es"
            | "jina-v2-de" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" | "gigachat"
            | "mellum" | "modern-bert" => PreTokenizer::Gpt2,
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva-7b" | "mellum2" => PreTokenizer::DigitsThenGpt2,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
            | "midm-2.0" | "lfm2" | "dbrx" | "smaug-bpe" | "glm4" | "chatglm-bpe" => {
                PreTokenizer::Llama3
            }
            "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" | "hunyuan" | "solar-open"
            | "grok-2" | "kormo" => PreTokenizer::Qwen2,
            // llama.cpp: LLAMA_VOCAB_PRE_TYPE_GPT4O, and MINIMAX_M2 (the same regex list)
            "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => PreTokenizer::Gpt4o,
            other => {
                return Err(Error::Unsupported(format!(
                    "BPE pre-tokenizer '{other}' (tokenizer.ggml.pre); supported: default, gpt2, \
                     smollm/starcoder/refact/command-r, llama3/llama-bpe, qwen2, gpt-4o/llama4 \
                     and their aliases"
                )))
            }
        })
    }

    /// Whether llama.cpp adds BOS by default for this pre-tokenizer (when the file has no
    /// `tokenizer.ggml.add_bos_token`).
    pub fn default_add_bos(self, name: Option<&str>) -> bool {
        // llama.cpp sets add_bos for the llama3 family, tekken and chameleon; of the
        // supported names only the llama3 family (minus the GLM/DBRX/Smaug aliases) qualifies
        // (not gpt-4o and its aliases: add_bos stays false).
        matches!(
            name,
            Some(
                "llama3"
                    | "llama-v3"
                    | "llama-bpe"
                    | "falcon3"
                    | "falcon-h1"
                    | "pixtral"
                    | "midm-2.0"
                    | "lfm2"
            )
        ) && self == PreTokenizer::Llama3
    }

    /// Whether a word that is itself a vocab entry is emitted without merging (llama.cpp's
    /// `ignore_merges`, set for the Llama 3 family; not for gpt-4o).
    pub fn ignore_merges(self, name: Option<&str>) -> bool {
        self.default_add_bos(name)
    }

    /// Splits `text` into words; returns byte ranges covering `text` exactly, in order.
    pub fn split(self, text: &str) -> Vec<Range<usize>> {
        let chars: Vec<char> = text.chars().collect();
        let flags: Vec<Flags> = chars.iter().map(|&c| Flags::of(c)).collect();
        let cx = Ctx {
            chars: &chars,
            flags: &flags,
        };
        let mut segs: Vec<Range<usize>> = std::iter::once(0..chars.len()).collect();
        let stages: &[Stage] = match self {
            PreTokenizer::Gpt2 => &[Stage::Gpt2],
            PreTokenizer::DigitsThenGpt2 => &[Stage::EachNumber, Stage::Gpt2],
            PreTokenizer::Default => &[
                Stage::PunctRuns,
                Stage::Gpt2,
                Stage::NumberRuns,
                Stage::AsciiDigitTriples,
            ],
            PreTokenizer::Llama3 => &[Stage::Llama3 { max_digits: 3 }],
            PreTokenizer::Qwen2 => &[Stage::Llama3 { max_digits: 1 }],
            PreTokenizer::Gpt4o => &[Stage::O200k],
        };
        for stage in stages {
            let mut out = Vec::with_capacity(segs.len() * 2);
            for seg in &segs {
                let mut e = Emitter {
                    out: &mut out,
                    prev: seg.start,
                };
                stage.run(&cx, seg.start, seg.end, &mut e);
                e.emit(seg.end);
            }
            segs = out;
        }
        // char ranges -> byte ranges
        let mut byte_at = Vec::with_capacity(chars.len() + 1);
        let mut b = 0;
        for &c in &chars {
            byte_at.push(b);
            b += c.len_utf8();
        }
        byte_at.push(b);
        segs.into_iter()
            .map(|r| byte_at[r.start]..byte_at[r.end])
            .collect()
    }
}

#[derive(Clone, Copy)]
enum Stage {
    /// `\p{N}`: each numeric code point alone.
    EachNumber,
    /// `\p{N}+`.
    NumberRuns,
    /// `[\p{P}\$\+<=>\^~\|]+`.
    PunctRuns,
    /// `[0-9][0-9][0-9]`.
    AsciiDigitTriples,
    Gpt2,
    Llama3 {
        max_digits: usize,
    },
    /// The o200k_base pattern (see [`PreTokenizer::Gpt4o`]).
    O200k,
}

struct Ctx<'a> {
    chars: &'a [char],
    flags: &'a [Flags],
}

/// Collects pieces: `emit(end)` closes the piece from the previous end to `end` (if non-empty).
struct Emitter<'a> {
    out: &'a mut Vec<Range<usize>>,
    prev: usize,
}

impl Emitter<'_> {
    #[inline]
    fn emit(&mut self, end: usize) {
        if end > self.prev {
            self.out.push(self.prev..end);
        }
        self.prev = end;
    }
}

impl Stage {
    fn run(self, cx: &Ctx, start: usize, end: usize, e: &mut Emitter) {
        match self {
            Stage::EachNumber => {
                for i in start..end {
                    if cx.flags[i].is_number() {
                        e.emit(i);
                        e.emit(i + 1);
                    }
                }
            }
            Stage::NumberRuns => runs(cx, start, end, e, |_, f| f.is_number()),
            Stage::PunctRuns => runs(cx, start, end, e, |c, f| {
                f.is_punctuation() || matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '~' | '|')
            }),
            Stage::AsciiDigitTriples => {
                let mut i = start;
                while i + 3 <= end {
                    if cx.chars[i..i + 3].iter().all(|c| c.is_ascii_digit()) {
                        e.emit(i);
                        e.emit(i + 3);
                        i += 3;
                    } else {
                        i += 1;
                    }
                }
            }
            Stage::Gpt2 => gpt2(cx, start, end, e),
            Stage::Llama3 { max_digits } => llama3(cx, start, end, max_digits, e),
            Stage::O200k => {
                let mut pos = start;
                while pos < end {
                    pos = o200k_match(cx, pos, end);
                    e.emit(pos);
                }
            }
        }
    }
}

/// `[class]+` where `pred` decides membership: each maximal run is a piece.
fn runs(cx: &Ctx, start: usize, end: usize, e: &mut Emitter, pred: impl Fn(char, Flags) -> bool) {
    let mut i = start;
    while i < end {
        if pred(cx.chars[i], cx.flags[i]) {
            let s = i;
            while i < end && pred(cx.chars[i], cx.flags[i]) {
                i += 1;
            }
            e.emit(s);
            e.emit(i);
        } else {
            i += 1;
        }
    }
}

/// Flags at `i`, or the empty sentinel outside `[.., end)`.
#[inline]
fn flag_at(cx: &Ctx, i: usize, end: usize) -> Flags {
    if i < end {
        cx.flags[i]
    } else {
        Flags::NONE
    }
}

/// "Other symbol" in the `[^\s\p{L}\p{N}]` sense: in range and neither whitespace, letter nor
/// number.
#[inline]
fn is_other(f: Flags) -> bool {
    f.any() && !f.is_whitespace() && !f.is_letter() && !f.is_number()
}

/// How [`contraction`] compares letters.
#[derive(Clone, Copy)]
enum Case {
    /// `'s|'t|...` (GPT-2).
    Sensitive,
    /// `'[sS]|'[tT]|...`: llama.cpp's rewrite of `(?i:...)` (Llama 3, Qwen 2).
    Ascii,
    /// `(?i:'s|'t|...)` with simple case folding, as real regex engines match it: also `'ſ`
    /// (U+017F LATIN SMALL LETTER LONG S folds to `s`; no other non-ASCII letter folds to one
    /// of `s t r e v m l d`).
    Unicode,
}

/// Length of an English contraction starting at `pos` (which holds `'`) and ending by `end`,
/// or 0.
fn contraction(cx: &Ctx, pos: usize, end: usize, case: Case) -> usize {
    if pos >= end || cx.chars[pos] != '\'' || pos + 1 >= end {
        return 0;
    }
    let low = |c: char| match case {
        Case::Sensitive => c,
        Case::Ascii => c.to_ascii_lowercase(),
        Case::Unicode if c == 'ſ' => 's',
        Case::Unicode => c.to_ascii_lowercase(),
    };
    let n1 = low(cx.chars[pos + 1]);
    if matches!(n1, 's' | 't' | 'm' | 'd') {
        return 2;
    }
    if pos + 2 < end {
        let n2 = low(cx.chars[pos + 2]);
        if matches!((n1, n2), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
            return 3;
        }
    }
    0
}

/// Trailing-whitespace handling shared by both big patterns: `\s+(?!\S)` then `\s+`, and a
/// single unmatched code point as the last resort. Returns the new position.
fn whitespace_or_single(cx: &Ctx, pos: usize, end: usize) -> usize {
    let mut n = 0;
    while flag_at(cx, pos + n, end).is_whitespace() {
        n += 1;
    }
    if n > 1 && pos + n < end {
        // leave the last whitespace char to prefix the following word
        pos + n - 1
    } else if n > 0 {
        pos + n
    } else {
        pos + 1
    }
}

/// The GPT-2 pattern over `[start, end)`.
fn gpt2(cx: &Ctx, start: usize, end: usize, e: &mut Emitter) {
    let mut pos = start;
    while pos < end {
        let c = cx.chars[pos];
        let n = contraction(cx, pos, end, Case::Sensitive);
        if n > 0 {
            pos += n;
            e.emit(pos);
            continue;
        }
        let space = usize::from(c == ' ');
        let f2 = flag_at(cx, pos + space, end);
        if f2.is_letter() {
            pos += space;
            while flag_at(cx, pos, end).is_letter() {
                pos += 1;
            }
        } else if f2.is_number() {
            pos += space;
            while flag_at(cx, pos, end).is_number() {
                pos += 1;
            }
        } else if is_other(f2) {
            pos += space;
            while is_other(flag_at(cx, pos, end)) {
                pos += 1;
            }
        } else {
            pos = whitespace_or_single(cx, pos, end);
        }
        e.emit(pos);
    }
}

/// The Llama 3 pattern over `[start, end)`; `max_digits` is 3 for Llama 3 and 1 for Qwen 2.
fn llama3(cx: &Ctx, start: usize, end: usize, max_digits: usize, e: &mut Emitter) {
    let mut pos = start;
    while pos < end {
        let c = cx.chars[pos];
        let f = cx.flags[pos];
        let n = contraction(cx, pos, end, Case::Ascii);
        if n > 0 {
            pos += n;
            e.emit(pos);
            continue;
        }
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !(c == '\r' || c == '\n' || f.is_number())
            && (f.is_letter() || flag_at(cx, pos + 1, end).is_letter())
        {
            pos += 1;
            while flag_at(cx, pos, end).is_letter() {
                pos += 1;
            }
            e.emit(pos);
            continue;
        }
        // \p{N}{1,max}
        if f.is_number() {
            let mut ini = pos;
            while flag_at(cx, pos, end).is_number() {
                pos += 1;
                if pos - ini >= max_digits {
                    e.emit(pos);
                    ini = pos;
                }
            }
            e.emit(pos);
            continue;
        }
        //  ?[^\s\p{L}\p{N}]+[\r\n]*
        let space = usize::from(c == ' ');
        let f2 = flag_at(cx, pos + space, end);
        // (llama.cpp tests the current code point's flags here, not f2's, for being in range)
        if !(f2.is_whitespace() || f2.is_letter() || f2.is_number()) && f.any() {
            pos += space;
            while is_other(flag_at(cx, pos, end)) {
                pos += 1;
            }
            while pos < end && matches!(cx.chars[pos], '\r' | '\n') {
                pos += 1;
            }
            e.emit(pos);
            continue;
        }
        pos = newlines_or_whitespace(cx, pos, end);
        e.emit(pos);
    }
}

/// The tail shared by the Llama 3 and o200k patterns: `\s*[\r\n]+`, then `\s+(?!\S)`, `\s+`
/// and a single unmatched code point (see [`whitespace_or_single`]). Returns the new position.
fn newlines_or_whitespace(cx: &Ctx, pos: usize, end: usize) -> usize {
    // \s* backtracks to the last newline of the whitespace run; [\r\n]+ then ends just after it
    let mut n = 0;
    let mut last_nl = None;
    while flag_at(cx, pos + n, end).is_whitespace() {
        if matches!(cx.chars[pos + n], '\r' | '\n') {
            last_nl = Some(pos + n + 1);
        }
        n += 1;
    }
    match last_nl {
        Some(p) => p,
        None => whitespace_or_single(cx, pos, end),
    }
}

/// The end of the o200k_base match at `pos` (`pos < end`): the alternatives in order, each
/// with the backtracking a regex engine would do.
fn o200k_match(cx: &Ctx, pos: usize, end: usize) -> usize {
    let c = cx.chars[pos];
    let f = cx.flags[pos];
    // [^\r\n\p{L}\p{N}]?<word>(?i:'s|'t|'re|'ve|'m|'ll|'d)?, for the two word shapes in turn.
    // The optional prefix is greedy: first try the word after it, then (when the prefix code
    // point can start a word itself, i.e. is a mark) the word at `pos`.
    let prefix = !(c == '\r' || c == '\n' || f.is_letter() || f.is_number());
    for word in [word_ending_lower, word_upper] {
        let at_prefix = if prefix { word(cx, pos + 1, end) } else { None };
        if let Some(w) = at_prefix.or_else(|| word(cx, pos, end)) {
            return w + contraction(cx, w, end, Case::Unicode);
        }
    }
    // \p{N}{1,3}
    if f.is_number() {
        let mut p = pos + 1;
        while p < pos + 3 && flag_at(cx, p, end).is_number() {
            p += 1;
        }
        return p;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n/]*
    let space = usize::from(c == ' ');
    if is_other(flag_at(cx, pos + space, end)) {
        let mut p = pos + space + 1;
        while is_other(flag_at(cx, p, end)) {
            p += 1;
        }
        while p < end && matches!(cx.chars[p], '\r' | '\n' | '/') {
            p += 1;
        }
        return p;
    }
    newlines_or_whitespace(cx, pos, end)
}

/// `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+` at `i`: the end of the match, if
/// any. Marks and `Lm`/`Lo` letters belong to both classes, so when the greedy first run is
/// not followed by a lowercase letter, the match backtracks to end just after the run's last
/// code point that is in the second class.
fn word_ending_lower(cx: &Ctx, i: usize, end: usize) -> Option<usize> {
    let mut j = i;
    while flag_at(cx, j, end).is_upper_or_uncased() {
        j += 1;
    }
    if flag_at(cx, j, end).is_lower_or_uncased() {
        while flag_at(cx, j, end).is_lower_or_uncased() {
            j += 1;
        }
        return Some(j);
    }
    (i..j)
        .rev()
        .find(|&k| cx.flags[k].is_lower_or_uncased())
        .map(|k| k + 1)
}

/// `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*` at `i`: the end of the match, if
/// any.
fn word_upper(cx: &Ctx, i: usize, end: usize) -> Option<usize> {
    let mut j = i;
    while flag_at(cx, j, end).is_upper_or_uncased() {
        j += 1;
    }
    if j == i {
        return None;
    }
    while flag_at(cx, j, end).is_lower_or_uncased() {
        j += 1;
    }
    Some(j)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(p: PreTokenizer, s: &str) -> Vec<String> {
        p.split(s).into_iter().map(|r| s[r].to_string()).collect()
    }

    #[test]
    fn gpt2_basic() {
        let p = PreTokenizer::Gpt2;
        assert_eq!(pieces(p, "Hello world"), ["Hello", " world"]);
        assert_eq!(pieces(p, " Hello  world!"), [" Hello", " ", " world", "!"]);
        assert_eq!(pieces(p, "a  b   c"), ["a", " ", " b", "  ", " c"]);
        assert_eq!(pieces(p, "I'm don't"), ["I", "'m", " don", "'t"]);
        assert_eq!(pieces(p, "x \n\ny"), ["x", " \n", "\n", "y"]);
        assert_eq!(pieces(p, "end  "), ["end", "  "]);
        assert_eq!(pieces(p, "year 2024!?"), ["year", " 2024", "!?"]);
    }

    #[test]
    fn smollm_isolates_digits() {
        let p = PreTokenizer::DigitsThenGpt2;
        assert_eq!(
            pieces(p, "The year 2024 had"),
            ["The", " year", " ", "2", "0", "2", "4", " had"]
        );
    }

    #[test]
    fn default_list() {
        let p = PreTokenizer::Default;
        assert_eq!(pieces(p, "a,b 12345"), ["a", ",", "b", " ", "123", "45"]);
    }

    #[test]
    fn llama3_and_qwen2() {
        let p = PreTokenizer::Llama3;
        assert_eq!(
            pieces(p, "I'M 12345 ok"),
            ["I", "'M", " ", "123", "45", " ok"]
        );
        assert_eq!(pieces(p, "hi!!\n\nthere"), ["hi", "!!\n\n", "there"]);
        assert_eq!(pieces(p, "a \n b"), ["a", " \n", " b"]);
        let q = PreTokenizer::Qwen2;
        assert_eq!(pieces(q, "x 123"), ["x", " ", "1", "2", "3"]);
    }

    #[test]
    fn gpt4o_words_and_case() {
        let p = PreTokenizer::Gpt4o;
        assert_eq!(pieces(p, "HelloWorld"), ["Hello", "World"]);
        assert_eq!(pieces(p, "XMLHttpRequest"), ["XMLHttp", "Request"]);
        assert_eq!(pieces(p, "HelloÉcole"), ["Hello", "École"]);
        assert_eq!(pieces(p, "МоскваСити"), ["Москва", "Сити"]);
        // titlecase letters are upper case
        assert_eq!(pieces(p, "ǅungla"), ["ǅungla"]);
        // the optional prefix: any code point but CR, LF, letters and numbers (so also tab)
        assert_eq!(pieces(p, "\tword"), ["\tword"]);
        assert_eq!(pieces(p, "path/to/file"), ["path", "/to", "/file"]);
        assert_eq!(pieces(p, "  leading"), [" ", " leading"]);
        // Lo letters are both upper and lower: CJK runs and CJK+Latin stay whole
        assert_eq!(pieces(p, "東京は晴れ"), ["東京は晴れ"]);
        assert_eq!(pieces(p, "東京Tower"), ["東京Tower"]);
        assert_eq!(pieces(p, "😀 😀"), ["😀", " 😀"]);
    }

    #[test]
    fn gpt4o_contractions() {
        let p = PreTokenizer::Gpt4o;
        assert_eq!(pieces(p, "DON'T stop"), ["DON'T", " stop"]);
        assert_eq!(pieces(p, "don'T we'RE"), ["don'T", " we'RE"]);
        assert_eq!(pieces(p, "I'M 12345 ok"), ["I'M", " ", "123", "45", " ok"]);
        assert_eq!(pieces(p, "ΣΊΣΥΦΟΣ's"), ["ΣΊΣΥΦΟΣ's"]);
        // simple case folding: 'ſ is 's
        assert_eq!(pieces(p, "it'ſ"), ["it'ſ"]);
        // a contraction only follows a word; alone, the apostrophe is a word prefix
        assert_eq!(pieces(p, "'s x"), ["'s", " x"]);
        assert_eq!(pieces(p, "a'x"), ["a", "'x"]);
    }

    #[test]
    fn gpt4o_marks() {
        let p = PreTokenizer::Gpt4o;
        // combining marks belong to words (both letter classes)...
        assert_eq!(pieces(p, "cafe\u{301} ok"), ["cafe\u{301}", " ok"]);
        assert_eq!(pieces(p, "e\u{301}E\u{301}"), ["e\u{301}", "E\u{301}"]);
        assert_eq!(pieces(p, "नमस्ते"), ["नमस्ते"]);
        // ...but may also be the prefix; before an all-caps word the prefix+word alternative
        // fails and the mark alone is a lowercase-ending word
        assert_eq!(pieces(p, "\u{301}abc"), ["\u{301}abc"]);
        assert_eq!(pieces(p, "\u{301}ABC"), ["\u{301}", "ABC"]);
    }

    #[test]
    fn gpt4o_numbers_punctuation_whitespace() {
        let p = PreTokenizer::Gpt4o;
        assert_eq!(pieces(p, "12345"), ["123", "45"]);
        assert_eq!(pieces(p, "٣٤٥٦٧"), ["٣٤٥", "٦٧"]);
        assert_eq!(pieces(p, "hi!!\n\nthere"), ["hi", "!!\n\n", "there"]);
        // punctuation runs take following CR, LF and slashes
        assert_eq!(pieces(p, "a.b/\nc"), ["a", ".b", "/\n", "c"]);
        assert_eq!(pieces(p, " !?\n/x"), [" !?\n/", "x"]);
        assert_eq!(pieces(p, "x\n/y"), ["x", "\n", "/y"]);
        assert_eq!(pieces(p, "a\r\n\r\nb"), ["a", "\r\n\r\n", "b"]);
        assert_eq!(pieces(p, "x  \n\n  y"), ["x", "  \n\n", " ", " y"]);
        assert_eq!(pieces(p, "a \u{3000}\n b"), ["a", " \u{3000}\n", " b"]);
        assert_eq!(pieces(p, "x\u{a0}\u{a0}y"), ["x", "\u{a0}", "\u{a0}y"]);
        assert_eq!(pieces(p, "a  b"), ["a", " ", " b"]);
        assert_eq!(pieces(p, "end  "), ["end", "  "]);
        assert_eq!(pieces(p, ""), Vec::<String>::new());
    }

    #[test]
    fn gpt4o_names_and_defaults() {
        for name in ["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"] {
            let p = PreTokenizer::from_name(Some(name)).unwrap();
            assert_eq!(p, PreTokenizer::Gpt4o, "{name}");
            assert!(!p.default_add_bos(Some(name)), "{name}");
            assert!(!p.ignore_merges(Some(name)), "{name}");
        }
    }

    #[test]
    fn unknown_name_is_an_error() {
        let err = PreTokenizer::from_name(Some("bogus-pre")).unwrap_err();
        assert!(err.to_string().contains("bogus-pre"));
    }
}
