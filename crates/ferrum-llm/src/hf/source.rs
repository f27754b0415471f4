//! A [`TensorSource`] over Hugging Face safetensors: GGUF names in, HF tensors out, laid out the way
//! the GGUF converter (`convert_hf_to_gguf.py`) would have stored them.
//!
//! - Names: `blk.N.attn_q.weight` <- `model.layers.N.self_attn.q_proj.weight`, ... ([`hf_tensor_name`]).
//! - Dims: safetensors shapes are outermost-first (`[out, in]`), GGUF dims innermost-first (`[in, out]`);
//!   the bytes are the same row-major matrix, so most tensors are zero-copy windows of the map.
//! - Llama/Mistral Q and K rows are permuted from HF's rotate-half RoPE order to GGUF's
//!   consecutive-pairs order ([`permute_qk_rows`]).
//! - Gemma 3 norm weights `w` become `1 + w` in F32 (HF computes `x̂ (1 + w)`; GGUF stores `1 + w`).

use std::collections::HashMap;
use std::path::Path;

use ferrum_core::{Bytes, DType, Error, Result};
use ferrum_kernels::quant;
use serde_json::Value;

use super::config::HfConfig;
use super::safetensors::{SafetensorsFile, TensorEntry};
use crate::model::arch::{dim, Shape};
use crate::model::config::Config;
use crate::model::weights::{RawTensor, TensorSource};

/// Where a GGUF tensor lives in a Hugging Face checkpoint (names without any multimodal prefix).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HfName {
    One(String),
    /// The experts a GGUF expert tensor stacks, each stored apart, in expert order.
    Experts(Vec<String>),
}

/// The HF name of a GGUF tensor name, from the architecture's tensor list
/// ([`crate::model::arch::TensorSpec`]), or None when the model has no such tensor.
pub fn hf_tensor_name(cfg: &Config, gguf: &str) -> Option<HfName> {
    let one = |s: &str| Some(HfName::One(s.into()));
    match gguf {
        "token_embd.weight" => return one("model.embed_tokens.weight"),
        "output_norm.weight" => return one("model.norm.weight"),
        "output.weight" => return one("lm_head.weight"),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let (part, suffix) = rest.rsplit_once('.')?;
    let spec = (cfg.arch.tensors)(cfg)
        .into_iter()
        .find(|s| s.gguf == part)?;
    let name = |hf: &str| format!("model.layers.{layer}.{hf}.{suffix}");
    Some(match spec.shape {
        Shape::Experts { .. } => HfName::Experts(
            (0..dim::EXPERTS(cfg))
                .map(|e| name(&spec.hf.replace("{e}", &e.to_string())))
                .collect(),
        ),
        _ => HfName::One(name(spec.hf)),
    })
}

/// Reorders the rows of a Q or K projection (`n_head` heads of `head_dim` rows, `row_bytes` each)
/// from HF's order to GGUF's: within each head, GGUF row `2i` is HF row `i` and row `2i+1` is HF
/// row `i + head_dim/2` (what `convert_hf_to_gguf.py` does for llama).
pub fn permute_qk_rows(data: &[u8], n_head: usize, head_dim: usize, row_bytes: usize) -> Vec<u8> {
    debug_assert_eq!(data.len(), n_head * head_dim * row_bytes);
    let half = head_dim / 2;
    let mut out = Vec::with_capacity(data.len());
    for h in 0..n_head {
        for j in 0..head_dim {
            let src = h * head_dim + if j % 2 == 0 { j / 2 } else { half + j / 2 };
            out.extend_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
        }
    }
    out
}

/// Tensors of one or several safetensors files, served under GGUF names.
pub struct HfSource {
    files: Vec<SafetensorsFile>,
    /// HF name -> index into `files`.
    index: HashMap<String, usize>,
    cfg: Config,
    tied: bool,
    /// Prefix of the language model's `model.*` tensors (`model.`, `language_model.model.`, ...).
    body: String,
    /// Where the LM head lives (`lm_head.weight` or `language_model.lm_head.weight`).
    lm_head: String,
}

impl std::fmt::Debug for HfSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfSource")
            .field("files", &self.files)
            .field("arch", &self.cfg.arch)
            .finish_non_exhaustive()
    }
}

impl HfSource {
    /// Opens the weights of a model folder: the shards listed by `model.safetensors.index.json`
    /// when present, else `model.safetensors`, else every `*.safetensors` in it.
    pub fn open_dir(dir: &Path, cfg: &HfConfig) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let mut names: Vec<String> = Vec::new();
        if index_path.is_file() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| Error::msg(format!("{}: invalid JSON: {e}", index_path.display())))?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    Error::msg(format!("{}: no weight_map object", index_path.display()))
                })?;
            for f in map.values() {
                let f = f.as_str().ok_or_else(|| {
                    Error::msg(format!(
                        "{}: weight_map values must be file names",
                        index_path.display()
                    ))
                })?;
                if f.contains('/') || f.contains('\\') || f.starts_with('.') {
                    return Err(Error::msg(format!(
                        "{}: bad shard name '{f}'",
                        index_path.display()
                    )));
                }
                if !names.iter().any(|n| n == f) {
                    names.push(f.to_string());
                }
            }
            names.sort();
        } else if dir.join("model.safetensors").is_file() {
            names.push("model.safetensors".into());
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
            for entry in rd {
                let name = entry
                    .map_err(|e| Error::io(dir, e))?
                    .file_name()
                    .to_string_lossy()
                    .into_owned();
                if name.ends_with(".safetensors") {
                    names.push(name);
                }
            }
            names.sort();
        }
        if names.is_empty() {
            return Err(Error::msg(format!(
                "{} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)",
                dir.display()
            )));
        }
        let files = names
            .iter()
            .map(|n| SafetensorsFile::open(&dir.join(n)))
            .collect::<Result<Vec<_>>>()?;
        Self::from_files(files, cfg)
    }

    /// Serves the tensors of already opened files (a name in two files is an error).
    pub fn from_files(files: Vec<SafetensorsFile>, cfg: &HfConfig) -> Result<Self> {
        let mut index = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for name in f.names() {
                if let Some(j) = index.insert(name.to_string(), i) {
                    return Err(Error::msg(format!(
                        "tensor '{name}' is in both {} and {}",
                        files[j].path().display(),
                        f.path().display()
                    )));
                }
            }
        }
        // Multimodal Gemma 3 checkpoints nest the language model under another prefix.
        let body = ["model.", "language_model.model.", "model.language_model."]
            .into_iter()
            .find(|p| index.contains_key(&format!("{p}embed_tokens.weight")))
            .unwrap_or("model.")
            .to_string();
        let lm_head = ["lm_head.weight", "language_model.lm_head.weight"]
            .into_iter()
            .find(|n| index.contains_key(*n))
            .unwrap_or("lm_head.weight")
            .to_string();
        Ok(Self {
            files,
            index,
            cfg: cfg.config.clone(),
            tied: cfg.tie_word_embeddings,
            body,
            lm_head,
        })
    }

    /// Number of tensors across all files.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The full HF name (with this checkpoint's prefix) of an HF name.
    fn full_name(&self, n: &str) -> String {
        match n.strip_prefix("model.") {
            Some(rest) => format!("{}{rest}", self.body),
            None => self.lm_head.clone(),
        }
    }

    fn entry(&self, hf: &str) -> Option<(&SafetensorsFile, &TensorEntry)> {
        let f = &self.files[*self.index.get(hf)?];
        Some((f, f.get(hf)?))
    }
}

impl HfSource {
    /// The experts of a GGUF expert tensor, each a 2-d HF tensor, stacked into one
    /// [n_in, n_out, n_expert] tensor (a copy).
    fn stacked_experts(&self, name: &str, names: &[String]) -> Result<Option<RawTensor>> {
        let mut data = Vec::new();
        let mut first: Option<(DType, Vec<usize>)> = None;
        for n in names {
            let full = self.full_name(n);
            let Some(t) = self.plain(&full, name)? else {
                return Err(Error::msg(format!(
                    "safetensors weights have no tensor '{full}' (an expert of GGUF {name}; \
                     checkpoints with fused expert tensors are not supported)"
                )));
            };
            match &first {
                None => first = Some((t.dtype, t.dims.clone())),
                Some((dt, dims)) if *dt == t.dtype && *dims == t.dims => {}
                Some((dt, dims)) => {
                    return Err(Error::Shape(format!(
                        "expert '{full}' is {} {:?}, its first sibling {dt} {dims:?}",
                        t.dtype, t.dims
                    )))
                }
            }
            data.extend_from_slice(&t.data);
        }
        let Some((dtype, mut dims)) = first else {
            return Ok(None);
        };
        dims.push(names.len());
        Ok(Some(RawTensor {
            dtype,
            dims,
            data: Bytes::from_vec(data),
        }))
    }

    /// The HF tensor `hf` (serving GGUF `name`) with no layout change; None if absent.
    fn plain(&self, hf: &str, name: &str) -> Result<Option<RawTensor>> {
        let Some((file, e)) = self.entry(hf) else {
            return Ok(None);
        };
        let dtype = e.ferrum_dtype().ok_or_else(|| {
            Error::Unsupported(format!(
                "tensor '{hf}' (GGUF {name}) in {} has dtype {} (only F32, F16 and BF16 weights load)",
                file.path().display(),
                e.dtype
            ))
        })?;
        Ok(Some(RawTensor {
            dtype,
            dims: e.shape.iter().rev().copied().collect(),
            data: file.data(e)?,
        }))
    }
}

impl TensorSource for HfSource {
    fn contains(&self, name: &str) -> bool {
        match hf_tensor_name(&self.cfg, name) {
            None => false,
            Some(HfName::One(n)) => self.entry(&self.full_name(&n)).is_some(),
            Some(HfName::Experts(names)) => names
                .iter()
                .all(|n| self.entry(&self.full_name(n)).is_some()),
        }
    }

    fn tensor(&self, name: &str) -> Result<Option<RawTensor>> {
        let hf = match hf_tensor_name(&self.cfg, name) {
            None => return Ok(None),
            Some(HfName::Experts(names)) => return self.stacked_experts(name, &names),
            Some(HfName::One(n)) => self.full_name(&n),
        };
        if name == "output.weight" && self.tied {
            return Ok(None); // HF ties the head to the embedding even when lm_head is saved
        }
        let Some((file, e)) = self.entry(&hf) else {
            if name == "output.weight" {
                return Err(Error::msg(format!(
                    "config.json sets tie_word_embeddings = false but the checkpoint has no '{hf}'"
                )));
            }
            return Err(Error::msg(format!(
                "safetensors weights have no tensor '{hf}' (GGUF {name}, needed by {})",
                self.cfg.arch.name()
            )));
        };
        let dtype = e.ferrum_dtype().ok_or_else(|| {
            Error::Unsupported(format!(
                "tensor '{hf}' in {} has dtype {} (only F32, F16 and BF16 weights load)",
                file.path().display(),
                e.dtype
            ))
        })?;
        let mut dims: Vec<usize> = e.shape.iter().rev().copied().collect();
        let mut data = file.data(e)?;
        let is_norm = name.ends_with("norm.weight");
        if self.cfg.arch.is_gemma() && is_norm {
            let mut v = vec![0f32; e.shape.iter().product()];
            quant::dequantize_row(dtype, &data, &mut v);
            let bytes: Vec<u8> = v.iter().flat_map(|w| (1.0 + w).to_le_bytes()).collect();
            return Ok(Some(RawTensor {
                dtype: DType::F32,
                dims,
                data: Bytes::from_vec(bytes),
            }));
        }
        let c = &self.cfg;
        let qk_heads = match name.rsplit_once('.').map(|(p, _)| p) {
            Some(p) if c.arch.hf_permute_qk && p.ends_with(".attn_q") => Some(c.n_head),
            Some(p) if c.arch.hf_permute_qk && p.ends_with(".attn_k") => Some(c.n_head_kv),
            _ => None,
        };
        if let Some(heads) = qk_heads {
            // A tensor of the wrong shape is left alone: Weights::load reports its dims.
            let rows = heads * c.head_dim;
            if e.shape.first() == Some(&rows) && rows > 0 && c.head_dim.is_multiple_of(2) {
                let row_bytes = data.len() / rows;
                data = Bytes::from_vec(permute_qk_rows(&data, heads, c.head_dim, row_bytes));
            }
        }
        if dims.is_empty() {
            dims.push(1);
        }
        Ok(Some(RawTensor { dtype, dims, data }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(model_type: &str, extra: &str) -> Config {
        Config::from_hf(&format!(
            r#"{{"model_type": "{model_type}", "hidden_size": 64, "intermediate_size": 96,
            "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100,
            "head_dim": 16 {extra}}}"#
        ))
        .unwrap()
    }

    #[test]
    fn names() {
        let one = |s: &str| Some(HfName::One(s.into()));
        let (llama, qwen2, gemma3) = (
            config("llama", ""),
            config("qwen2", ""),
            config("gemma3_text", ""),
        );
        let n = hf_tensor_name;
        assert_eq!(
            n(&llama, "blk.3.attn_q.weight"),
            one("model.layers.3.self_attn.q_proj.weight")
        );
        assert_eq!(
            n(&qwen2, "blk.0.attn_k.bias"),
            one("model.layers.0.self_attn.k_proj.bias")
        );
        assert_eq!(
            n(&llama, "blk.1.ffn_norm.weight"),
            one("model.layers.1.post_attention_layernorm.weight")
        );
        assert_eq!(
            n(&gemma3, "blk.1.ffn_norm.weight"),
            one("model.layers.1.pre_feedforward_layernorm.weight")
        );
        assert_eq!(
            n(&gemma3, "blk.1.post_attention_norm.weight"),
            one("model.layers.1.post_attention_layernorm.weight")
        );
        assert_eq!(
            n(&gemma3, "blk.2.attn_k_norm.weight"),
            one("model.layers.2.self_attn.k_norm.weight")
        );
        assert_eq!(n(&llama, "blk.2.attn_k_norm.weight"), None);
        assert_eq!(n(&llama, "blk.x.attn_q.weight"), None);
        assert_eq!(n(&llama, "output.weight"), one("lm_head.weight"));
        let phi3 = config("phi3", "");
        assert_eq!(
            n(&phi3, "blk.0.ffn_up.weight"),
            one("model.layers.0.mlp.gate_up_proj.weight")
        );
        let mixtral = config(
            "mixtral",
            r#", "num_local_experts": 3, "num_experts_per_tok": 2"#,
        );
        assert_eq!(
            n(&mixtral, "blk.1.ffn_down_exps.weight"),
            Some(HfName::Experts(
                (0..3)
                    .map(|e| format!("model.layers.1.block_sparse_moe.experts.{e}.w2.weight"))
                    .collect()
            ))
        );
        assert_eq!(n(&mixtral, "blk.1.ffn_down.weight"), None);
    }

    #[test]
    fn permutation_matches_the_converter() {
        // 2 heads of head_dim 4, one byte per row: HF rows [0..8).
        let hf: Vec<u8> = (0..8).collect();
        // GGUF row 2i = HF row i, row 2i+1 = HF row i + 2, per head.
        assert_eq!(permute_qk_rows(&hf, 2, 4, 1), [0, 2, 1, 3, 4, 6, 5, 7]);
    }
}
