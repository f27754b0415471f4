//! [`TokenizerSpec`]: everything a tokenizer is built from, as read from GGUF metadata.

use ferrum_gguf::{GgufFile, Value};

use crate::{Error, Result};

/// Token types as GGUF stores them in `tokenizer.ggml.token_type` (ids 1..=6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// 1: ordinary text token.
    Normal,
    /// 2: the unknown token.
    Unknown,
    /// 3: control token (BOS, EOS, chat markers): only parsed from text with
    /// `parse_special`, rendered empty unless `special`.
    Control,
    /// 4: user-defined token: always split out of text, always rendered.
    UserDefined,
    /// 5: unused slot.
    Unused,
    /// 6: byte-fallback token `<0xNN>`.
    Byte,
}

impl TokenType {
    /// The type for a GGUF id; `None` for 0 (undefined) and unknown ids.
    pub fn from_gguf(id: i32) -> Option<TokenType> {
        Some(match id {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }

    /// The GGUF id of this type.
    pub fn to_gguf(self) -> i32 {
        match self {
            TokenType::Normal => 1,
            TokenType::Unknown => 2,
            TokenType::Control => 3,
            TokenType::UserDefined => 4,
            TokenType::Unused => 5,
            TokenType::Byte => 6,
        }
    }
}

/// The raw tokenizer description: the `tokenizer.ggml.*` keys of a GGUF file (or the same
/// data from elsewhere). [`crate::Tokenizer::from_spec`] validates and compiles it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE) or `"llama"` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: the BPE pre-tokenizer name (ignored for `llama`).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: token text, index = id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores`: SentencePiece merge priorities.
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type`: GGUF token type ids (see [`TokenType`]).
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`: BPE merges `"left right"`, rank = index.
    pub merges: Option<Vec<String>>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
    /// `tokenizer.chat_template` (Jinja source).
    pub chat_template: Option<String>,
}

fn str_array(file: &GgufFile, key: &str) -> Result<Option<Vec<String>>> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_str_array()
            .map(|a| Some(a.into_iter().map(str::to_owned).collect()))
            .ok_or_else(|| bad_type(key, v, "an array of strings")),
    }
}

fn bad_type(key: &str, v: &Value, want: &str) -> Error {
    Error::msg(format!(
        "GGUF key {key} has type {} but should be {want}",
        v.value_type()
    ))
}

fn opt_u32(file: &GgufFile, key: &str) -> Result<Option<u32>> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| bad_type(key, v, "a token id (unsigned integer < 2^32)")),
    }
}

fn opt_bool(file: &GgufFile, key: &str) -> Result<Option<bool>> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| bad_type(key, v, "a bool")),
    }
}

fn opt_string(file: &GgufFile, key: &str) -> Result<Option<String>> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_str()
            .map(|s| Some(s.to_owned()))
            .ok_or_else(|| bad_type(key, v, "a string")),
    }
}

impl TokenizerSpec {
    /// Reads the `tokenizer.ggml.*` keys and `tokenizer.chat_template` of a GGUF file.
    /// Missing required keys (`model`, `tokens`) and keys of the wrong type are errors;
    /// everything else is validated by [`crate::Tokenizer::from_spec`].
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let model = opt_string(file, "tokenizer.ggml.model")?.ok_or_else(|| {
            Error::msg("GGUF file has no tokenizer (tokenizer.ggml.model missing)")
        })?;
        let tokens = str_array(file, "tokenizer.ggml.tokens")?.ok_or_else(|| {
            Error::msg("GGUF file has no vocabulary (tokenizer.ggml.tokens missing)")
        })?;
        let scores = match file.get("tokenizer.ggml.scores") {
            None => None,
            Some(v) => Some(
                v.as_f32_array()
                    .ok_or_else(|| bad_type("tokenizer.ggml.scores", v, "an array of numbers"))?,
            ),
        };
        let token_types = match file.get("tokenizer.ggml.token_type") {
            None => None,
            Some(v) => Some(
                v.as_i32_array()
                    .ok_or_else(|| bad_type("tokenizer.ggml.token_type", v, "an array of i32"))?,
            ),
        };
        Ok(TokenizerSpec {
            model,
            pre: opt_string(file, "tokenizer.ggml.pre")?,
            tokens,
            scores,
            token_types,
            merges: str_array(file, "tokenizer.ggml.merges")?,
            bos: opt_u32(file, "tokenizer.ggml.bos_token_id")?,
            eos: opt_u32(file, "tokenizer.ggml.eos_token_id")?,
            unk: opt_u32(file, "tokenizer.ggml.unknown_token_id")?,
            pad: opt_u32(file, "tokenizer.ggml.padding_token_id")?,
            add_bos: opt_bool(file, "tokenizer.ggml.add_bos_token")?,
            add_eos: opt_bool(file, "tokenizer.ggml.add_eos_token")?,
            add_space_prefix: opt_bool(file, "tokenizer.ggml.add_space_prefix")?,
            chat_template: opt_string(file, "tokenizer.chat_template")?,
        })
    }
}
