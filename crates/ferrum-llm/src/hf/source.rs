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
use crate::model::config::Arch;
use crate::model::weights::{RawTensor, TensorSource};

/// The HF name (without any multimodal prefix) of a GGUF tensor name, or None when the
/// architecture has no such tensor.
pub fn hf_tensor_name(arch: Arch, gguf: &str) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let (part, suffix) = rest.rsplit_once('.')?;
    let gemma = arch.is_gemma();
    let hf = match part {
        "attn_qkv" => "self_attn.qkv_proj",
        "ffn_up" if arch == Arch::Phi3 => "mlp.gate_up_proj",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_norm" => "input_layernorm",
        "ffn_norm" if gemma => "pre_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "post_attention_norm" if gemma => "post_attention_layernorm",
        "post_ffw_norm" if gemma => "post_feedforward_layernorm",
        "attn_q_norm" if arch.has_qk_norm() => "self_attn.q_norm",
        "attn_k_norm" if arch.has_qk_norm() => "self_attn.k_norm",
        "ffn_gate_inp" if arch == Arch::Qwen3Moe => "mlp.gate",
        "ffn_gate_inp" if arch == Arch::Llama => "block_sparse_moe.gate",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// The HF names (without any multimodal prefix) of the experts a GGUF expert tensor stacks
/// (`blk.N.ffn_gate_exps.weight` -> `model.layers.N.mlp.experts.E.gate_proj.weight`, E in
/// 0..n_expert), in the per-expert layout checkpoints are published in.
pub fn hf_expert_names(arch: Arch, gguf: &str, n_expert: usize) -> Option<Vec<String>> {
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let (part, suffix) = rest.rsplit_once('.')?;
    let (block, proj) = match (arch, part) {
        (Arch::Qwen3Moe, "ffn_gate_exps") => ("mlp", "gate_proj"),
        (Arch::Qwen3Moe, "ffn_up_exps") => ("mlp", "up_proj"),
        (Arch::Qwen3Moe, "ffn_down_exps") => ("mlp", "down_proj"),
        (Arch::Llama, "ffn_gate_exps") => ("block_sparse_moe", "w1"),
        (Arch::Llama, "ffn_up_exps") => ("block_sparse_moe", "w3"),
        (Arch::Llama, "ffn_down_exps") => ("block_sparse_moe", "w2"),
        _ => return None,
    };
    Some(
        (0..n_expert)
            .map(|e| format!("model.layers.{layer}.{block}.experts.{e}.{proj}.{suffix}"))
            .collect(),
    )
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
    arch: Arch,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    tied: bool,
    /// Experts per mixture-of-experts layer (0: none).
    n_expert: usize,
    /// Prefix of the language model's `model.*` tensors (`model.`, `language_model.model.`, ...).
    body: String,
    /// Where the LM head lives (`lm_head.weight` or `language_model.lm_head.weight`).
    lm_head: String,
}

impl std::fmt::Debug for HfSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfSource")
            .field("files", &self.files)
            .field("arch", &self.arch)
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
        let c = &cfg.config;
        Ok(Self {
            files,
            index,
            arch: c.arch,
            n_head: c.n_head,
            n_head_kv: c.n_head_kv,
            head_dim: c.head_dim,
            tied: cfg.tie_word_embeddings,
            n_expert: c.moe.map_or(0, |m| m.n_expert),
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

    /// The full HF name (with this checkpoint's prefix) the GGUF name maps to.
    fn hf_name(&self, gguf: &str) -> Option<String> {
        let n = hf_tensor_name(self.arch, gguf)?;
        Some(match n.strip_prefix("model.") {
            Some(rest) => format!("{}{rest}", self.body),
            None => self.lm_head.clone(),
        })
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
            let full = match n.strip_prefix("model.") {
                Some(rest) => format!("{}{rest}", self.body),
                None => n.clone(),
            };
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
    fn tensor(&self, name: &str) -> Result<Option<RawTensor>> {
        if let Some(names) = hf_expert_names(self.arch, name, self.n_expert) {
            return self.stacked_experts(name, &names);
        }
        let Some(hf) = self.hf_name(name) else {
            return Ok(None);
        };
        if name.ends_with("ffn_gate_inp.weight") && self.entry(&hf).is_none() {
            return Ok(None); // a dense layer
        }
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
                self.arch.name()
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
        if self.arch.is_gemma() && is_norm {
            let mut v = vec![0f32; e.shape.iter().product()];
            quant::dequantize_row(dtype, &data, &mut v);
            let bytes: Vec<u8> = v.iter().flat_map(|w| (1.0 + w).to_le_bytes()).collect();
            return Ok(Some(RawTensor {
                dtype: DType::F32,
                dims,
                data: Bytes::from_vec(bytes),
            }));
        }
        let qk_heads = match (self.arch, name.rsplit_once('.').map(|(p, _)| p)) {
            (Arch::Llama, Some(p)) if p.ends_with(".attn_q") => Some(self.n_head),
            (Arch::Llama, Some(p)) if p.ends_with(".attn_k") => Some(self.n_head_kv),
            _ => None,
        };
        if let Some(heads) = qk_heads {
            // A tensor of the wrong shape is left alone: Weights::load reports its dims.
            let rows = heads * self.head_dim;
            if e.shape.first() == Some(&rows) && rows > 0 && self.head_dim.is_multiple_of(2) {
                let row_bytes = data.len() / rows;
                data = Bytes::from_vec(permute_qk_rows(&data, heads, self.head_dim, row_bytes));
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

    #[test]
    fn names() {
        let n = |a, g| hf_tensor_name(a, g);
        assert_eq!(
            n(Arch::Llama, "blk.3.attn_q.weight").unwrap(),
            "model.layers.3.self_attn.q_proj.weight"
        );
        assert_eq!(
            n(Arch::Qwen2, "blk.0.attn_k.bias").unwrap(),
            "model.layers.0.self_attn.k_proj.bias"
        );
        assert_eq!(
            n(Arch::Llama, "blk.1.ffn_norm.weight").unwrap(),
            "model.layers.1.post_attention_layernorm.weight"
        );
        assert_eq!(
            n(Arch::Gemma3, "blk.1.ffn_norm.weight").unwrap(),
            "model.layers.1.pre_feedforward_layernorm.weight"
        );
        assert_eq!(
            n(Arch::Gemma3, "blk.1.post_attention_norm.weight").unwrap(),
            "model.layers.1.post_attention_layernorm.weight"
        );
        assert_eq!(
            n(Arch::Gemma3, "blk.2.attn_k_norm.weight").unwrap(),
            "model.layers.2.self_attn.k_norm.weight"
        );
        assert_eq!(n(Arch::Llama, "blk.2.attn_k_norm.weight"), None);
        assert_eq!(n(Arch::Llama, "blk.x.attn_q.weight"), None);
        assert_eq!(n(Arch::Llama, "output.weight").unwrap(), "lm_head.weight");
    }

    #[test]
    fn permutation_matches_the_converter() {
        // 2 heads of head_dim 4, one byte per row: HF rows [0..8).
        let hf: Vec<u8> = (0..8).collect();
        // GGUF row 2i = HF row i, row 2i+1 = HF row i + 2, per head.
        assert_eq!(permute_qk_rows(&hf, 2, 4, 1), [0, 2, 1, 3, 4, 6, 5, 7]);
    }
}
