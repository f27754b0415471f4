//! ferrum-tokenizer: text <-> token ids, and chat templates.
//!
//! - [`Tokenizer`]: built from GGUF metadata ([`Tokenizer::from_gguf`], via [`TokenizerSpec`])
//!   or from a Hugging Face `tokenizer.json` ([`Tokenizer::from_hf_file`]). GGUF tokenizers are
//!   re-implementations of llama.cpp's (`src/llama-vocab.cpp`, `src/unicode.cpp`) and give the
//!   same ids: byte-level BPE (`gpt2`) with llama.cpp's pre-tokenizers, and SentencePiece-style
//!   BPE (`llama`), both behind llama.cpp's special-token partition.
//! - [`ChatTemplate`]: renders a model's Jinja chat template the way Hugging Face does.
//! - [`hf_tokenizer_json_from_spec`]: writes a `tokenizer.json` for a GGUF BPE vocabulary.
//!
//! ```no_run
//! # fn main() -> ferrum_tokenizer::Result<()> {
//! let file = ferrum_gguf::GgufFile::open(std::path::Path::new("model.gguf"))?;
//! let tok = ferrum_tokenizer::Tokenizer::from_gguf(&file)?;
//! let ids = tok.encode("Hello world", true, false);
//! assert_eq!(tok.decode(&ids, false), "Hello world");
//! # Ok(()) }
//! ```

mod bpe;
mod chat;
mod hf;
mod pretokenize;
mod spec;
mod special;
mod spm;
mod symbols;
mod unicode;
mod vocab;

use std::collections::HashMap;
use std::path::Path;

pub use bpe::{byte_encode, byte_to_char, char_to_byte};
pub use chat::{ChatMessage, ChatTemplate};
pub use ferrum_core::{Error, Result};
pub use hf::hf_tokenizer_json_from_spec;
pub use pretokenize::PreTokenizer;
pub use spec::{TokenType, TokenizerSpec};

use special::{Fragment, SpecialMatcher};
use vocab::{attr, TextStyle, Vocab};

/// The tokenization algorithm.
enum Engine {
    /// Byte-level BPE (`gpt2`).
    Bpe {
        merges: bpe::Merges,
        pre: PreTokenizer,
        ignore_merges: bool,
    },
    /// SentencePiece-style BPE (`llama`).
    Spm {
        scores: Vec<f32>,
        byte_tokens: Box<[Option<u32>; 256]>,
    },
    /// The `tokenizers` crate (Hugging Face `tokenizer.json`).
    Hf(Box<hf::HfEngine>),
}

/// A tokenizer: encodes text to ids and renders ids back to bytes.
///
/// Thread-safe and immutable after construction.
pub struct Tokenizer {
    vocab: Vocab,
    engine: Engine,
    special: SpecialMatcher,
    model: String,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model", &self.model)
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .finish_non_exhaustive()
    }
}

fn check_id(what: &str, id: Option<u32>, n: usize) -> Result<()> {
    match id {
        Some(i) if i as usize >= n => Err(Error::msg(format!(
            "tokenizer {what} token id {i} is out of range (vocabulary has {n} tokens)"
        ))),
        _ => Ok(()),
    }
}

impl Tokenizer {
    /// Validates and compiles a spec. Errors (never panics) on: an unknown model or BPE
    /// pre-tokenizer, an empty vocabulary, duplicate token texts, score/type arrays shorter
    /// than the vocabulary, special ids out of range, missing or malformed BPE merges, and
    /// `add_bos`/`add_eos` without the id.
    pub fn from_spec(spec: TokenizerSpec) -> Result<Self> {
        let n = spec.tokens.len();
        if n == 0 {
            return Err(Error::msg("tokenizer vocabulary is empty"));
        }
        if u32::try_from(n).is_err() {
            return Err(Error::msg(format!("tokenizer vocabulary too large ({n})")));
        }
        for (what, id) in [
            ("BOS", spec.bos),
            ("EOS", spec.eos),
            ("UNK", spec.unk),
            ("PAD", spec.pad),
        ] {
            check_id(what, id, n)?;
        }
        if let Some(s) = &spec.scores {
            if s.len() < n {
                return Err(Error::msg(format!(
                    "tokenizer has {} scores for {n} tokens",
                    s.len()
                )));
            }
        }
        let attrs: Vec<u8> = match &spec.token_types {
            Some(t) if t.len() < n => {
                return Err(Error::msg(format!(
                    "tokenizer has {} token types for {n} tokens",
                    t.len()
                )))
            }
            Some(t) => t[..n].iter().map(|&x| attr::from_type(x)).collect(),
            None => vec![attr::NORMAL; n],
        };
        // llama.cpp renames empty tokens so that every text is a unique key
        let tokens: Vec<String> = spec
            .tokens
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                if t.is_empty() {
                    format!("[EMPTY_{i}]")
                } else {
                    t
                }
            })
            .collect();
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            if let Some(prev) = token_to_id.insert(t.clone(), i as u32) {
                return Err(Error::msg(format!(
                    "duplicate token in vocabulary: {t:?} has ids {prev} and {i}"
                )));
            }
        }
        let pre_name = spec.pre.as_deref();
        let (engine, style, add_bos_default, add_space_prefix_default) = match spec.model.as_str() {
            "gpt2" => {
                let pre = PreTokenizer::from_name(pre_name)?;
                let lines = spec.merges.as_deref().ok_or_else(|| {
                    Error::msg("gpt2 (BPE) tokenizer has no merges (tokenizer.ggml.merges)")
                })?;
                let merges = bpe::Merges::parse(lines)?;
                let engine = Engine::Bpe {
                    merges,
                    pre,
                    ignore_merges: pre.ignore_merges(pre_name),
                };
                (
                    engine,
                    TextStyle::ByteLevel,
                    pre.default_add_bos(pre_name),
                    false,
                )
            }
            "llama" => {
                let scores = match spec.scores {
                    Some(mut s) => {
                        s.truncate(n);
                        s
                    }
                    None => vec![0.0; n],
                };
                let mut byte_tokens = Box::new([None; 256]);
                for (b, slot) in byte_tokens.iter_mut().enumerate() {
                    let hex = format!("<0x{b:02X}>");
                    *slot = token_to_id.get(&hex).copied().or_else(|| {
                        let c = char::from(b as u8);
                        (b < 0x80)
                            .then(|| token_to_id.get(c.to_string().as_str()).copied())
                            .flatten()
                    });
                }
                let engine = Engine::Spm {
                    scores,
                    byte_tokens,
                };
                (engine, TextStyle::Spm, true, true)
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "tokenizer model '{other}' (tokenizer.ggml.model); supported: gpt2, llama"
                )))
            }
        };
        let add_bos = spec.add_bos.unwrap_or(add_bos_default);
        let add_eos = spec.add_eos.unwrap_or(false);
        if add_bos && spec.bos.is_none() {
            return Err(Error::msg(
                "tokenizer add_bos_token is true, but bos_token_id is not set",
            ));
        }
        if add_eos && spec.eos.is_none() {
            return Err(Error::msg(
                "tokenizer add_eos_token is true, but eos_token_id is not set",
            ));
        }
        let vocab = Vocab::new(tokens, attrs, token_to_id, style, spec.eos);
        let special = SpecialMatcher::new(vocab.special_candidates())?;
        Ok(Tokenizer {
            vocab,
            engine,
            special,
            model: spec.model,
            bos: spec.bos,
            eos: spec.eos,
            unk: spec.unk,
            pad: spec.pad,
            add_bos,
            add_eos,
            add_space_prefix: spec.add_space_prefix.unwrap_or(add_space_prefix_default),
            chat_template: spec.chat_template,
        })
    }

    /// Reads the tokenizer of a GGUF file.
    pub fn from_gguf(file: &ferrum_gguf::GgufFile) -> Result<Self> {
        Self::from_spec(TokenizerSpec::from_gguf(file)?)
    }

    /// Loads a Hugging Face `tokenizer.json` (encoding runs in the `tokenizers` crate). BOS/EOS
    /// ids, `add_bos_token`/`add_eos_token` and the chat template come from a
    /// `tokenizer_config.json` next to it, when there is one.
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        hf::load(path)
    }

    /// Encodes `text`. `add_special` adds BOS/EOS as the model asks (`add_bos`/`add_eos`);
    /// `parse_special` lets control tokens written in the text (e.g. `<|im_start|>`) become
    /// their ids — user-defined tokens are always recognised.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        if let Engine::Hf(h) = &self.engine {
            return h.encode(text, add_special, parse_special);
        }
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        let frags = self.special.partition(text, parse_special);
        let lookup = |s: &str| self.vocab.token_to_id.get(s).copied();
        match &self.engine {
            Engine::Bpe {
                merges,
                pre,
                ignore_merges,
            } => {
                for f in frags {
                    match f {
                        Fragment::Token(id) => out.push(id),
                        Fragment::Text(s) => {
                            for r in pre.split(s) {
                                let word = byte_encode(&s[r]);
                                bpe::encode_word(&word, merges, *ignore_merges, &lookup, &mut out);
                            }
                        }
                    }
                }
            }
            Engine::Spm {
                scores,
                byte_tokens,
            } => {
                let lookup_scored = |s: &str| {
                    self.vocab
                        .token_to_id
                        .get(s)
                        .map(|&id| (id, scores[id as usize]))
                };
                let byte_token = |b: u8| byte_tokens[b as usize].or(self.unk);
                let mut prev_special = true;
                for f in frags {
                    match f {
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                        Fragment::Text(s) => {
                            let mut t = String::with_capacity(s.len() + 4);
                            if self.add_space_prefix && prev_special {
                                t.push(' ');
                            }
                            t.push_str(s);
                            let t = t.replace(' ', "\u{2581}");
                            spm::encode(&t, &lookup_scored, &byte_token, &mut out);
                            prev_special = false;
                        }
                    }
                }
            }
            Engine::Hf(_) => unreachable!("handled above"),
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        out
    }

    /// Renders ids to text: the concatenation of [`Tokenizer::token_bytes`] (control tokens
    /// only with `special`), decoded as UTF-8 at the end with invalid sequences replaced by
    /// U+FFFD. For SentencePiece models with `add_space_prefix`, one leading space of the first
    /// token is dropped, as llama.cpp does (so not when the first id is BOS). No other clean-up
    /// (llama.cpp's `clean_spaces`) is applied.
    pub fn decode(&self, ids: &[u32], special: bool) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for (i, &id) in ids.iter().enumerate() {
            let piece = self.token_bytes(id, special);
            if i == 0 && self.add_space_prefix {
                bytes.extend_from_slice(piece.strip_prefix(b" ").unwrap_or(&piece));
            } else {
                bytes.extend_from_slice(&piece);
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The raw bytes of one token: empty for ids out of range, for unused tokens, and for
    /// control/unknown tokens unless `special`. A token may hold part of a UTF-8 character;
    /// streaming callers buffer incomplete sequences.
    pub fn token_bytes(&self, id: u32, special: bool) -> Vec<u8> {
        self.vocab.token_bytes(id, special)
    }

    /// The vocabulary string of `id` as stored (byte-encoded for BPE, `▁` for SPM); `""` for
    /// ids out of range.
    pub fn token_text(&self, id: u32) -> &str {
        self.vocab
            .tokens
            .get(id as usize)
            .map(String::as_str)
            .unwrap_or("")
    }

    /// The id of a vocabulary string, if present.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.token_to_id.get(text).copied()
    }

    /// The type of `id` (tokens promoted to control by the end-of-generation detection report
    /// [`TokenType::Control`]); `None` out of range.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.vocab.token_type(id)
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab.tokens.len()
    }

    /// `"gpt2"`, `"llama"`, or `"hf"` for a `tokenizer.json`.
    pub fn model(&self) -> &str {
        &self.model
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }
    pub fn unk(&self) -> Option<u32> {
        self.unk
    }
    pub fn pad(&self) -> Option<u32> {
        self.pad
    }
    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    /// Whether `encode(.., add_special = true, ..)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether `id` ends generation: EOS, end-of-turn tokens and llama.cpp's text matches
    /// (`<|im_end|>`, `<|endoftext|>`, `<end_of_turn>`, `<eos>`, `</s>`, ...), plus FIM
    /// pad/repo/separator tokens.
    pub fn is_eog(&self, id: u32) -> bool {
        self.vocab.eog.contains(&id)
    }

    /// The end-of-generation ids, ascending.
    pub fn eog_ids(&self) -> Vec<u32> {
        self.vocab.eog.iter().copied().collect()
    }

    /// The model's chat template source, if it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn shareable_across_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<super::Tokenizer>();
        send_sync::<super::ChatTemplate>();
        send_sync::<super::TokenizerSpec>();
    }
}
