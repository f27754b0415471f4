//! Vocabulary bookkeeping shared by every backend: token attributes as llama.cpp derives them,
//! the end-of-generation set, and token-to-bytes rendering.

use std::collections::{BTreeSet, HashMap};

use crate::bpe::char_to_byte;
use crate::spec::TokenType;

/// Token attribute bits (llama.cpp `llama_token_attr`, the subset that matters here).
pub(crate) mod attr {
    pub const UNKNOWN: u8 = 1 << 0;
    pub const UNUSED: u8 = 1 << 1;
    pub const NORMAL: u8 = 1 << 2;
    pub const CONTROL: u8 = 1 << 3;
    pub const USER_DEFINED: u8 = 1 << 4;
    pub const BYTE: u8 = 1 << 5;

    pub fn from_type(t: i32) -> u8 {
        match t {
            1 => NORMAL,
            2 => UNKNOWN,
            3 => CONTROL,
            4 => USER_DEFINED,
            5 => UNUSED,
            6 => BYTE,
            _ => 0, // undefined
        }
    }
}

/// How a NORMAL token's text maps back to bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TextStyle {
    /// GPT-2 byte-level: every code point stands for one byte.
    ByteLevel,
    /// SentencePiece: `▁` stands for a space, the rest is UTF-8 as is.
    Spm,
    /// The text is the bytes.
    Raw,
}

/// Texts llama.cpp recognises as end-of-turn tokens (`special_eot_id` detection).
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP: &[&str] = &["<|file_sep|>"];
/// Texts that always end generation (llama.cpp's EOG text list).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// The vocabulary with derived attributes.
pub(crate) struct Vocab {
    pub tokens: Vec<String>,
    pub attrs: Vec<u8>,
    pub token_to_id: HashMap<String, u32>,
    pub style: TextStyle,
    pub eog: BTreeSet<u32>,
}

impl Vocab {
    /// Builds attributes and the end-of-generation set the way llama.cpp's vocab loader does:
    /// tokens whose text marks a turn end, a fill-in-the-middle role or end-of-generation get
    /// the CONTROL attribute added; CONTROL tokens whose text contains "unused" get UNUSED;
    /// the EOG set is the text matches plus FIM pad/repo/sep, `eos` and `eot`.
    /// (llama.cpp walks an unordered map where we walk ids in order: when several tokens match
    /// one FIM/EOT list, we pick the lowest id.)
    pub fn new(
        tokens: Vec<String>,
        mut attrs: Vec<u8>,
        token_to_id: HashMap<String, u32>,
        style: TextStyle,
        eos: Option<u32>,
    ) -> Self {
        let find_first = |list: &[&str]| -> Option<u32> {
            tokens
                .iter()
                .position(|t| list.contains(&t.as_str()))
                .map(|i| i as u32)
        };
        let eot = find_first(EOT_TEXTS);
        let eom = find_first(EOM_TEXTS);
        let fim: Vec<Option<u32>> = [FIM_PRE, FIM_SUF, FIM_MID, FIM_PAD, FIM_REP, FIM_SEP]
            .iter()
            .map(|l| find_first(l))
            .collect();
        for id in [eot, eom].into_iter().chain(fim.iter().copied()).flatten() {
            attrs[id as usize] |= attr::CONTROL;
        }
        for (t, a) in tokens.iter().zip(attrs.iter_mut()) {
            if *a & attr::CONTROL != 0 && t.contains("unused") {
                *a |= attr::UNUSED;
            }
        }
        let mut eog: BTreeSet<u32> = fim[3..].iter().flatten().copied().collect();
        for (i, t) in tokens.iter().enumerate() {
            if EOG_TEXTS.contains(&t.as_str()) {
                eog.insert(i as u32);
                attrs[i] |= attr::CONTROL;
            }
        }
        // gpt-oss: these structural tokens are always rendered
        for (i, t) in tokens.iter().enumerate() {
            if matches!(
                t.as_str(),
                "<|channel|>" | "<|message|>" | "<|start|>" | "<|constrain|>"
            ) {
                attrs[i] = attr::USER_DEFINED;
            }
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        let text_of = |id: u32| tokens[id as usize].as_str();
        let has = |eog: &BTreeSet<u32>, s: &str| eog.iter().find(|&&i| text_of(i) == s).copied();
        // o200k_harmony / solar-open: "<|end|>" is not end-of-generation there
        if let Some(end) = has(&eog, "<|end|>") {
            let call = has(&eog, "<|call|>").or(has(&eog, "<|calls|>")).is_some();
            if call && (has(&eog, "<|return|>").is_some() || has(&eog, "<|flush|>").is_some()) {
                eog.remove(&end);
                attrs[end as usize] = attr::USER_DEFINED;
            }
        }
        // gemma4 / paddleocr: "</s>" is not end-of-generation when "<|tool_response>" is
        if let (Some(s), Some(_)) = (has(&eog, "</s>"), has(&eog, "<|tool_response>")) {
            eog.remove(&s);
            attrs[s as usize] = attr::NORMAL;
        }
        Vocab {
            tokens,
            attrs,
            token_to_id,
            style,
            eog,
        }
    }

    /// The special-token partition candidates: `(id, text, only_with_parse_special)`.
    pub fn special_candidates(&self) -> Vec<(u32, String, bool)> {
        let mask = attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN;
        self.attrs
            .iter()
            .enumerate()
            .filter(|(_, &a)| a & mask != 0)
            .map(|(i, &a)| {
                let needs = a & (attr::CONTROL | attr::UNKNOWN) != 0;
                (i as u32, self.tokens[i].clone(), needs)
            })
            .collect()
    }

    /// The token's type as stored (attributes reduced to one [`TokenType`]; promoted tokens
    /// report `Control`).
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        let a = *self.attrs.get(id as usize)?;
        Some(if a & attr::CONTROL != 0 {
            TokenType::Control
        } else if a & attr::UNKNOWN != 0 {
            TokenType::Unknown
        } else if a & attr::USER_DEFINED != 0 {
            TokenType::UserDefined
        } else if a & attr::BYTE != 0 {
            TokenType::Byte
        } else if a & attr::NORMAL != 0 {
            TokenType::Normal
        } else {
            TokenType::Unused
        })
    }

    /// The bytes one token renders to (llama.cpp `token_to_piece` without lstrip).
    pub fn token_bytes(&self, id: u32, special: bool) -> Vec<u8> {
        let Some(&a) = self.attrs.get(id as usize) else {
            return Vec::new();
        };
        let text = &self.tokens[id as usize];
        if a & (attr::CONTROL | attr::UNKNOWN) != 0 {
            return if special {
                text.as_bytes().to_vec()
            } else {
                Vec::new()
            };
        }
        if a & attr::USER_DEFINED != 0 {
            return text.as_bytes().to_vec();
        }
        if a & attr::NORMAL != 0 {
            return match self.style {
                TextStyle::ByteLevel => {
                    let mut out = Vec::with_capacity(text.len());
                    let mut tmp = [0u8; 4];
                    for c in text.chars() {
                        match char_to_byte(c) {
                            Some(b) => out.push(b),
                            None => out.extend_from_slice(c.encode_utf8(&mut tmp).as_bytes()),
                        }
                    }
                    out
                }
                TextStyle::Spm => text.replace('\u{2581}', " ").into_bytes(),
                TextStyle::Raw => text.as_bytes().to_vec(),
            };
        }
        if a & attr::BYTE != 0 {
            return parse_byte_token(text).map(|b| vec![b]).unwrap_or_default();
        }
        Vec::new()
    }
}

/// `<0xNN>` -> the byte.
pub(crate) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab(texts: &[&str], types: &[i32], eos: Option<u32>) -> Vocab {
        let tokens: Vec<String> = texts.iter().map(|s| s.to_string()).collect();
        let map = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let attrs = types.iter().map(|&t| attr::from_type(t)).collect();
        Vocab::new(tokens, attrs, map, TextStyle::Spm, eos)
    }

    #[test]
    fn eog_and_promotion() {
        let v = vocab(
            &[
                "<pad>",
                "<eos>",
                "</s>",
                "<unused0>",
                "a▁b",
                "<0x0A>",
                "<reponame>",
            ],
            &[3, 3, 4, 3, 1, 6, 1],
            Some(1),
        );
        assert_eq!(v.eog.iter().copied().collect::<Vec<_>>(), [1, 2, 6]);
        assert_eq!(v.token_type(2), Some(TokenType::Control)); // promoted
        assert!(v.attrs[3] & attr::UNUSED != 0);
        assert_eq!(v.token_bytes(4, false), b"a b");
        assert_eq!(v.token_bytes(5, false), b"\n");
        assert_eq!(v.token_bytes(1, false), b"");
        assert_eq!(v.token_bytes(1, true), b"<eos>");
        assert_eq!(v.token_bytes(99, true), b"");
    }
}
