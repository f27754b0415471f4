//! Model weights, named as in GGUF (`blk.N.attn_q.weight`, ...), whatever file they came from.
//!
//! Quantization sits behind [`Linear`]: a model file calls `linear.forward(x)` and never sees the
//! storage type. A [`TensorSource`] hands out tensors by GGUF name; the GGUF loader reads them from
//! the memory map, the safetensors loader translates Hugging Face names and layouts.

use ferrum_core::{Buf, Bytes, DType, Error, Result};
use ferrum_kernels::matmul::{self, WeightRef};
use ferrum_kernels::profile;
use ferrum_kernels::quant;

use super::config::{Arch, Config};

/// A tensor as stored: type, dims in GGUF order (`dims[0]` contiguous), bytes.
#[derive(Clone, Debug)]
pub struct RawTensor {
    pub dtype: DType,
    pub dims: Vec<usize>,
    pub data: Bytes,
}

impl RawTensor {
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// All elements as f32 (exact dequantization).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.n_elements()];
        quant::dequantize_row(self.dtype, &self.data, &mut out);
        out
    }

    /// The same values re-stored as F32 (for reference runs without quantized kernels).
    pub fn dequantized(&self) -> RawTensor {
        let v = self.to_f32();
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        RawTensor {
            dtype: DType::F32,
            dims: self.dims.clone(),
            data: Bytes::from_vec(bytes),
        }
    }
}

/// Where weights come from. Names are GGUF's.
pub trait TensorSource {
    fn tensor(&self, name: &str) -> Result<Option<RawTensor>>;
}

/// `y = x W^T (+ b)` with W stored row-major [out, in] in any supported type.
#[derive(Clone, Debug)]
pub struct Linear {
    /// What the projection is in the model (`attn_q`, `ffn_down`, `output`, ...), for profiles.
    pub kind: &'static str,
    pub weight: RawTensor,
    pub bias: Option<Vec<f32>>,
    pub n_in: usize,
    pub n_out: usize,
    /// The weight repacked for one-token products, where a kernel for that layout exists (Q8_0,
    /// Q5_0, Q4_1, Q4_K, Q6_K in groups of 16 rows on AVX-512 VNNI; see
    /// [`Linear::pack_for_decode`]).
    pub gemv: Option<Bytes>,
}

impl Linear {
    pub fn weight_ref(&self) -> WeightRef<'_> {
        WeightRef {
            dtype: self.weight.dtype,
            rows: self.n_out,
            cols: self.n_in,
            data: &self.weight.data,
        }
    }

    /// Builds [`Linear::gemv`] where it pays: the one-token kernel over 16-row groups reads a
    /// Q8_0, Q5_0, Q4_1, Q4_K or Q6_K matrix front to back, 16 rows per vector, well above the
    /// row kernels' speed (`cargo bench -p ferrum-kernels --bench matmul`). Same bits as the
    /// row kernel (Q4_K: as llama.cpp's repacked GEMV, the order one token gets from
    /// [`matmul::Order::of`] for row counts divisible by 16). Costs a second copy of the matrix
    /// (the row-major one serves prompts and embedding lookups).
    pub fn pack_for_decode(&mut self) {
        #[cfg(target_arch = "x86_64")]
        if matmul::avx512::available() {
            let w = &self.weight;
            self.gemv = matmul::avx512::pack_x16(w.dtype, &w.data, self.n_out, self.n_in)
                .and_then(|v| Bytes::pack(&[&v]).ok())
                .and_then(|mut b| b.pop());
        }
    }

    /// `x`: [T, n_in] -> [T, n_out]. `segs`: the rows of each sequence stacked in `x` (each
    /// sequence's rows are computed as if alone in the call; see [`matmul::matmul_segments`]).
    pub fn forward(&self, x: &[f32], segs: &[usize]) -> Buf {
        let t = x.len() / self.n_in;
        let mut y = Buf::zeros(t * self.n_out);
        let flops = 2.0 * (self.n_in * self.n_out * t) as f64;
        let bytes = (self.weight.data.len() + 4 * t * (self.n_in + self.n_out)) as f64;
        profile::record("matmul", self.kind, flops, bytes, || {
            #[cfg(target_arch = "x86_64")]
            if let (1, Some(p)) = (t, &self.gemv) {
                let dtype = self.weight.dtype;
                matmul::avx512::gemv_x16(dtype, p, self.n_out, self.n_in, x, &mut y);
                return;
            }
            matmul::matmul_segments(&self.weight_ref(), x, &mut y, segs)
        });
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(self.n_out) {
                for (v, bv) in row.iter_mut().zip(b) {
                    *v += bv;
                }
            }
        }
        y
    }
}

/// Per-layer weights; the optional ones belong to some architectures only.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub attn_q: Linear,
    pub attn_k: Linear,
    pub attn_v: Linear,
    pub attn_output: Linear,
    /// Gemma 3: per-head RMSNorm weights of Q and K.
    pub attn_q_norm: Option<Vec<f32>>,
    pub attn_k_norm: Option<Vec<f32>>,
    /// Gemma 3: norm of the attention output before the residual add.
    pub post_attention_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub ffn_gate: Linear,
    pub ffn_up: Linear,
    pub ffn_down: Linear,
    /// Gemma 3: norm of the FFN output before the residual add.
    pub post_ffw_norm: Option<Vec<f32>>,
}

#[derive(Clone, Debug)]
pub struct Weights {
    pub token_embd: RawTensor,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>,
    /// The LM head; the embedding matrix itself when the file ties them.
    pub output: Linear,
}

impl LayerWeights {
    /// The layer's seven projections.
    pub fn linears(&self) -> [&Linear; 7] {
        [
            &self.attn_q,
            &self.attn_k,
            &self.attn_v,
            &self.attn_output,
            &self.ffn_gate,
            &self.ffn_up,
            &self.ffn_down,
        ]
    }

    /// [`LayerWeights::linears`], mutably.
    pub fn linears_mut(&mut self) -> [&mut Linear; 7] {
        [
            &mut self.attn_q,
            &mut self.attn_k,
            &mut self.attn_v,
            &mut self.attn_output,
            &mut self.ffn_gate,
            &mut self.ffn_up,
            &mut self.ffn_down,
        ]
    }
}

impl Weights {
    /// Every distinct tensor of the model (the tied LM head counted once).
    pub fn tensors(&self) -> Vec<&RawTensor> {
        let mut v = vec![&self.token_embd];
        for l in &self.layers {
            v.extend(l.linears().map(|lin| &lin.weight));
        }
        if self.output.weight.data.as_ptr() != self.token_embd.data.as_ptr() {
            v.push(&self.output.weight);
        }
        v
    }

    /// Bytes of the matrices (norm vectors and biases are not counted, as llama-bench does not).
    pub fn n_bytes(&self) -> usize {
        self.tensors().iter().map(|t| t.data.len()).sum()
    }

    /// Parameters in the matrices and norms.
    pub fn n_params(&self) -> usize {
        let norms: usize = self
            .layers
            .iter()
            .map(|l| {
                l.attn_norm.len()
                    + l.ffn_norm.len()
                    + [
                        &l.attn_q_norm,
                        &l.attn_k_norm,
                        &l.post_attention_norm,
                        &l.post_ffw_norm,
                    ]
                    .iter()
                    .map(|n| n.as_ref().map_or(0, |n| n.len()))
                    .sum::<usize>()
            })
            .sum();
        self.tensors().iter().map(|t| t.n_elements()).sum::<usize>()
            + norms
            + self.output_norm.len()
    }

    /// Weight bytes one decode step reads: every matrix, except that the embedding table
    /// contributes one row (unless it is also the LM head, which reads all of it).
    pub fn bytes_per_token(&self) -> usize {
        let embd = &self.token_embd;
        let tied = self.output.weight.data.as_ptr() == embd.data.as_ptr();
        let embd_rows = embd.dims.get(1).copied().unwrap_or(1).max(1);
        let embd_read = if tied {
            embd.data.len()
        } else {
            embd.data.len() / embd_rows
        };
        self.n_bytes() - embd.data.len() + embd_read
    }

    /// Loads every tensor the architecture needs, checking each shape against `cfg`.
    /// `progress(i, total)` is called after each layer.
    pub fn load(
        src: &dyn TensorSource,
        cfg: &Config,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Weights> {
        let get = |name: &str| -> Result<RawTensor> {
            src.tensor(name)?.ok_or_else(|| {
                Error::msg(format!(
                    "model file has no tensor '{name}' ({} needs it)",
                    cfg.arch.name()
                ))
            })
        };
        let check = |name: &str, t: &RawTensor, want: &[usize]| -> Result<()> {
            if t.dims != want {
                return Err(Error::Shape(format!(
                    "tensor '{name}' has dims {:?}, expected {want:?}",
                    t.dims
                )));
            }
            Ok(())
        };
        let vector = |name: &str, n: usize| -> Result<Vec<f32>> {
            let t = get(name)?;
            check(name, &t, &[n])?;
            Ok(t.to_f32())
        };
        let opt_vector = |name: &str, n: usize| -> Result<Option<Vec<f32>>> {
            match src.tensor(name)? {
                None => Ok(None),
                Some(t) => {
                    check(name, &t, &[n])?;
                    Ok(Some(t.to_f32()))
                }
            }
        };
        let linear = |name: &str, n_in: usize, n_out: usize, bias: bool| -> Result<Linear> {
            let w = get(&format!("{name}.weight"))?;
            check(name, &w, &[n_in, n_out])?;
            if w.dtype.row_bytes(n_in).is_none() {
                return Err(Error::Shape(format!(
                    "tensor '{name}': row of {n_in} is not whole {} blocks",
                    w.dtype
                )));
            }
            let bias = if bias {
                Some(vector(&format!("{name}.bias"), n_out)?)
            } else {
                None
            };
            Ok(Linear {
                kind: linear_kind(name),
                weight: w,
                bias,
                n_in,
                n_out,
                gemv: None,
            })
        };
        let (e, q, kv, ff) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
        let token_embd = get("token_embd.weight")?;
        check("token_embd.weight", &token_embd, &[e, cfg.n_vocab])?;
        let qkv_bias = cfg.arch == Arch::Qwen2;
        let gemma = cfg.arch == Arch::Gemma3;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for il in 0..cfg.n_layer {
            let p = format!("blk.{il}");
            let norm_opt = |n: &str, len: usize| -> Result<Option<Vec<f32>>> {
                if gemma {
                    vector(&format!("{p}.{n}.weight"), len).map(Some)
                } else {
                    opt_vector(&format!("{p}.{n}.weight"), len)
                }
            };
            layers.push(LayerWeights {
                attn_norm: vector(&format!("{p}.attn_norm.weight"), e)?,
                attn_q: linear(&format!("{p}.attn_q"), e, q, qkv_bias)?,
                attn_k: linear(&format!("{p}.attn_k"), e, kv, qkv_bias)?,
                attn_v: linear(&format!("{p}.attn_v"), e, kv, qkv_bias)?,
                attn_output: linear(&format!("{p}.attn_output"), q, e, false)?,
                attn_q_norm: norm_opt("attn_q_norm", cfg.head_dim)?,
                attn_k_norm: norm_opt("attn_k_norm", cfg.head_dim)?,
                post_attention_norm: norm_opt("post_attention_norm", e)?,
                ffn_norm: vector(&format!("{p}.ffn_norm.weight"), e)?,
                ffn_gate: linear(&format!("{p}.ffn_gate"), e, ff, false)?,
                ffn_up: linear(&format!("{p}.ffn_up"), e, ff, false)?,
                ffn_down: linear(&format!("{p}.ffn_down"), ff, e, false)?,
                post_ffw_norm: norm_opt("post_ffw_norm", e)?,
            });
            progress(il + 1, cfg.n_layer);
        }
        let output = match src.tensor("output.weight")? {
            Some(_) => linear("output", e, cfg.n_vocab, false)?,
            None => Linear {
                kind: "output",
                weight: token_embd.clone(),
                bias: None,
                n_in: e,
                n_out: cfg.n_vocab,
                gemv: None,
            },
        };
        let mut w = Weights {
            output_norm: vector("output_norm.weight", e)?,
            token_embd,
            layers,
            output,
        };
        w.pack()?;
        Ok(w)
    }

    /// Moves every matrix into one anonymous buffer backed by huge pages where the OS allows
    /// ([`Bytes::pack`]): decoding reads all weights per token, and from a 4 KiB-page file map
    /// that costs a TLB miss every few rows.
    pub fn pack(&mut self) -> Result<()> {
        let tied = self.output.weight.data.as_ptr() == self.token_embd.data.as_ptr();
        let mut mats: Vec<&mut RawTensor> = vec![&mut self.token_embd];
        for l in self.layers.iter_mut() {
            mats.extend(l.linears_mut().map(|lin| &mut lin.weight));
        }
        if !tied {
            mats.push(&mut self.output.weight);
        }
        let packed = {
            let parts: Vec<&[u8]> = mats.iter().map(|t| &t.data[..]).collect();
            Bytes::pack(&parts)?
        };
        for (t, b) in mats.into_iter().zip(packed) {
            t.data = b;
        }
        if tied {
            self.output.weight.data = self.token_embd.data.clone();
        }
        for l in self.layers.iter_mut() {
            l.linears_mut()
                .into_iter()
                .for_each(Linear::pack_for_decode);
        }
        self.output.pack_for_decode();
        Ok(())
    }

    /// Every matrix re-stored as F32 (the unquantized reference path).
    pub fn dequantized(&self) -> Weights {
        let lin = |l: &Linear| Linear {
            weight: l.weight.dequantized(),
            gemv: None,
            ..l.clone()
        };
        let token_embd = self.token_embd.dequantized();
        let tied = std::ptr::eq(
            self.output.weight.data.as_ptr(),
            self.token_embd.data.as_ptr(),
        );
        Weights {
            output: if tied {
                Linear {
                    weight: token_embd.clone(),
                    gemv: None,
                    ..self.output.clone()
                }
            } else {
                lin(&self.output)
            },
            token_embd,
            output_norm: self.output_norm.clone(),
            layers: self
                .layers
                .iter()
                .map(|l| LayerWeights {
                    attn_q: lin(&l.attn_q),
                    attn_k: lin(&l.attn_k),
                    attn_v: lin(&l.attn_v),
                    attn_output: lin(&l.attn_output),
                    ffn_gate: lin(&l.ffn_gate),
                    ffn_up: lin(&l.ffn_up),
                    ffn_down: lin(&l.ffn_down),
                    ..l.clone()
                })
                .collect(),
        }
    }
}

/// The role of a projection from its GGUF name (`blk.N.attn_q` -> `attn_q`).
fn linear_kind(name: &str) -> &'static str {
    const KINDS: [&str; 8] = [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
        "output",
    ];
    let last = name.rsplit('.').next().unwrap_or(name);
    KINDS
        .iter()
        .find(|&&k| k == last)
        .copied()
        .unwrap_or("linear")
}

/// GGUF tensors straight from the memory map.
pub struct GgufSource<'a>(pub &'a ferrum_gguf::GgufFile);

impl TensorSource for GgufSource<'_> {
    fn tensor(&self, name: &str) -> Result<Option<RawTensor>> {
        let Some(info) = self.0.tensor(name) else {
            return Ok(None);
        };
        Ok(Some(RawTensor {
            dtype: info.dtype,
            dims: info.dims.iter().map(|&d| d as usize).collect(),
            data: self.0.tensor_data(info),
        }))
    }
}
