//! Hugging Face `tokenizer.json` support: loading one through the `tokenizers` crate, and
//! writing one for a GGUF byte-level BPE vocabulary.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Value as Json};

use crate::spec::TokenizerSpec;
use crate::special::SpecialMatcher;
use crate::vocab::{attr, parse_byte_token, TextStyle, Vocab};
use crate::{Engine, Error, PreTokenizer, Result, Tokenizer};

/// Two configured copies of one `tokenizers::Tokenizer`: the crate decides whether special
/// added tokens are parsed with a per-tokenizer switch, so each setting gets its own copy.
pub(crate) struct HfEngine {
    parse_special: tokenizers::Tokenizer,
    plain: tokenizers::Tokenizer,
}

impl HfEngine {
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let tk = if parse_special {
            &self.parse_special
        } else {
            &self.plain
        };
        match tk.encode(text, add_special) {
            Ok(enc) => enc.get_ids().to_vec(),
            Err(e) => {
                tracing::warn!("tokenizers failed to encode {} bytes: {e}", text.len());
                Vec::new()
            }
        }
    }
}

fn hf_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::msg(format!("{}: {e}", path.display()))
}

/// A token given in `tokenizer_config.json`: a string or an `AddedToken` object.
fn config_token(cfg: &Json, key: &str) -> Option<String> {
    match cfg.get(key)? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// The chat template of a `tokenizer_config.json`: a string, or a list of named templates of
/// which the one named "default" (else the first) is taken.
fn config_chat_template(cfg: &Json) -> Option<String> {
    match cfg.get("chat_template")? {
        Json::String(s) => Some(s.clone()),
        Json::Array(list) => {
            let named = |name: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some(name))
            };
            named("default")
                .or(list.first())
                .and_then(|t| t.get("template")?.as_str().map(str::to_owned))
        }
        _ => None,
    }
}

/// Whether a decoder / pre-tokenizer JSON node contains a component of type `ty`.
fn has_component(node: &Json, ty: &str) -> bool {
    match node {
        Json::Object(o) => {
            o.get("type").and_then(Json::as_str) == Some(ty)
                || o.values().any(|v| has_component(v, ty))
        }
        Json::Array(a) => a.iter().any(|v| has_component(v, ty)),
        _ => false,
    }
}

/// Whether a pre-tokenizer node holds a Metaspace that prepends "▁" to the first word.
fn metaspace_prepends(node: &Json) -> bool {
    match node {
        Json::Object(o) => {
            let own = o.get("type").and_then(Json::as_str) == Some("Metaspace")
                && (o.get("add_prefix_space").and_then(Json::as_bool) == Some(true)
                    || matches!(
                        o.get("prepend_scheme").and_then(Json::as_str),
                        Some("always" | "first")
                    ));
            own || o.values().any(metaspace_prepends)
        }
        Json::Array(a) => a.iter().any(metaspace_prepends),
        _ => false,
    }
}

pub(crate) fn load(path: &Path) -> Result<Tokenizer> {
    let raw = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let json: Json = serde_json::from_slice(&raw).map_err(|e| hf_err(path, e))?;
    let plain_tk = tokenizers::Tokenizer::from_bytes(&raw).map_err(|e| hf_err(path, e))?;
    let mut plain = plain_tk.clone();
    plain.set_encode_special_tokens(true);
    let parse_special = plain_tk;

    let style = if has_component(&json["decoder"], "ByteLevel")
        || has_component(&json["pre_tokenizer"], "ByteLevel")
    {
        TextStyle::ByteLevel
    } else if has_component(&json["decoder"], "Metaspace")
        || has_component(&json["decoder"], "ByteFallback")
        || has_component(&json["pre_tokenizer"], "Metaspace")
    {
        TextStyle::Spm
    } else {
        TextStyle::Raw
    };

    // SentencePiece-style files that prepend "▁" when encoding: decode drops it again
    let add_space_prefix = style == TextStyle::Spm
        && (has_component(&json["normalizer"], "Prepend")
            || metaspace_prepends(&json["pre_tokenizer"]));

    let vocab_map = parse_special.get_vocab(true);
    let n = vocab_map
        .values()
        .map(|&i| i as usize + 1)
        .max()
        .unwrap_or(0);
    if n == 0 {
        return Err(hf_err(path, "tokenizer has an empty vocabulary"));
    }
    let mut tokens: Vec<Option<String>> = vec![None; n];
    for (t, &i) in &vocab_map {
        tokens[i as usize] = Some(t.clone());
    }
    let mut attrs = vec![attr::NORMAL; n];
    let tokens: Vec<String> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            t.unwrap_or_else(|| {
                attrs[i] = 0; // a hole in the id space: renders as nothing
                format!("[EMPTY_{i}]")
            })
        })
        .collect();
    for (i, t) in tokens.iter().enumerate() {
        if style == TextStyle::Spm && parse_byte_token(t).is_some() {
            attrs[i] = attr::BYTE;
        }
    }
    for (id, at) in parse_special.get_added_tokens_decoder() {
        if let Some(a) = attrs.get_mut(id as usize) {
            *a = if at.special {
                attr::CONTROL
            } else {
                attr::USER_DEFINED
            };
        }
    }
    let token_to_id: HashMap<String, u32> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();

    let cfg_path = path.with_file_name("tokenizer_config.json");
    let cfg: Json = match std::fs::read(&cfg_path) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| hf_err(&cfg_path, e))?,
        Err(_) => Json::Null,
    };
    let id_of = |key: &str| config_token(&cfg, key).and_then(|t| token_to_id.get(&t).copied());
    let (bos, eos, pad, unk) = (
        id_of("bos_token"),
        id_of("eos_token"),
        id_of("pad_token"),
        id_of("unk_token"),
    );
    let probe = parse_special
        .encode("", true)
        .map_err(|e| hf_err(path, e))?;
    let add_bos = bos.is_some() && probe.get_ids().first().copied() == bos;
    let add_eos = eos.is_some() && probe.get_ids().last().copied() == eos;

    let vocab = Vocab::new(tokens, attrs, token_to_id, style, eos);
    Ok(Tokenizer {
        vocab,
        engine: Engine::Hf(Box::new(HfEngine {
            parse_special,
            plain,
        })),
        special: SpecialMatcher::new(Vec::new())?,
        model: "hf".to_owned(),
        bos,
        eos,
        unk,
        pad,
        add_bos,
        add_eos,
        add_space_prefix,
        chat_template: config_chat_template(&cfg),
    })
}

/// GPT-2's split pattern (with the trailing `\s+` alternative Hugging Face keeps).
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// OpenAI's o200k_base (`gpt-4o`) split pattern.
const O200K_PATTERN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
);

fn split(pattern: &str) -> Json {
    json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false})
}

fn byte_level(use_regex: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

/// Writes a Hugging Face `tokenizer.json` equivalent to a GGUF byte-level BPE (`gpt2`) spec:
/// a BPE model with the vocab and merges, the pre-tokenizer matching `spec.pre` (e.g. for
/// `smollm`: `Sequence[Digits(individual_digits), ByteLevel(use_regex)]`), a ByteLevel decoder,
/// every control/user-defined token as an added token (control ones `special`), and a
/// `TemplateProcessing` post-processor when the spec adds BOS/EOS.
///
/// Errors for non-`gpt2` models and for pre-tokenizers it cannot express.
pub fn hf_tokenizer_json_from_spec(spec: &TokenizerSpec) -> Result<String> {
    if spec.model != "gpt2" {
        return Err(Error::Unsupported(format!(
            "tokenizer.json export of tokenizer model '{}' (only gpt2 BPE)",
            spec.model
        )));
    }
    let pre = PreTokenizer::from_name(spec.pre.as_deref())?;
    let pre_tokenizer = match pre {
        PreTokenizer::Gpt2 => byte_level(true),
        PreTokenizer::DigitsThenGpt2 => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        PreTokenizer::Llama3 => json!({"type": "Sequence", "pretokenizers": [
            split(LLAMA3_PATTERN), byte_level(false)]}),
        PreTokenizer::Qwen2 => json!({"type": "Sequence", "pretokenizers": [
            split(QWEN2_PATTERN), byte_level(false)]}),
        PreTokenizer::Gpt4o => json!({"type": "Sequence", "pretokenizers": [
            split(O200K_PATTERN), byte_level(false)]}),
        PreTokenizer::Default => json!({"type": "Sequence", "pretokenizers": [
            split(r"[\p{P}\$\+<=>\^~\|]+"), split(GPT2_PATTERN), split(r"\p{N}+"),
            split("[0-9][0-9][0-9]"), byte_level(false)]}),
    };
    // validate through the same path as encoding, so errors match
    let tok = Tokenizer::from_spec(spec.clone())?;
    let merges = spec
        .merges
        .as_ref()
        .ok_or_else(|| Error::msg("gpt2 (BPE) tokenizer has no merges"))?;
    let mut merge_pairs = Vec::with_capacity(merges.len());
    for m in merges {
        let p = m
            .char_indices()
            .skip(1)
            .find(|&(_, c)| c == ' ')
            .map(|(p, _)| p)
            .ok_or_else(|| Error::msg(format!("malformed merge {m:?}")))?;
        merge_pairs.push(json!([&m[..p], &m[p + 1..]]));
    }
    let mut vocab = serde_json::Map::with_capacity(spec.tokens.len());
    let mut added = Vec::new();
    for id in 0..tok.vocab_size() as u32 {
        let text = tok.token_text(id);
        vocab.insert(text.to_owned(), json!(id));
        let a = tok.vocab.attrs[id as usize];
        if a & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0 {
            let special = a & (attr::CONTROL | attr::UNKNOWN) != 0;
            added.push(
                json!({"id": id, "content": text, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": special}),
            );
        }
    }
    let post_processor = if tok.add_bos || tok.add_eos {
        let mut single = Vec::new();
        let mut specials = serde_json::Map::new();
        let mut add = |id: u32, list: &mut Vec<Json>| {
            let t = tok.token_text(id).to_owned();
            list.push(json!({"SpecialToken": {"id": t, "type_id": 0}}));
            specials.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
        };
        if let (true, Some(b)) = (tok.add_bos, tok.bos) {
            add(b, &mut single);
        }
        single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
        if let (true, Some(e)) = (tok.add_eos, tok.eos) {
            add(e, &mut single);
        }
        json!({"type": "TemplateProcessing", "single": single, "pair": single.clone(),
            "special_tokens": specials})
    } else {
        Json::Null
    };
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": pre.ignore_merges(spec.pre.as_deref()),
            "vocab": vocab,
            "merges": merge_pairs,
        }
    });
    serde_json::to_string(&doc).map_err(|e| Error::msg(format!("serializing tokenizer.json: {e}")))
}
