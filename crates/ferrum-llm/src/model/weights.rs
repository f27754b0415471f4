//! Model weights, named as in GGUF (`blk.N.attn_q.weight`, ...), whatever file they came from.
//!
//! Quantization sits behind [`Linear`]: a model file calls `linear.forward(x)` and never sees the
//! storage type. A [`TensorSource`] hands out tensors by GGUF name; the GGUF loader reads them from
//! the memory map, the safetensors loader translates Hugging Face names and layouts.

use ferrum_core::{Buf, Bytes, DType, Error, Result};
use ferrum_kernels::matmul::{Layout, PackedMatrix};
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

/// `y = x W^T (+ b)` with W ([out, in], any supported type) stored once, in the layout its
/// kernels want ([`PackedMatrix`]).
#[derive(Clone, Debug)]
pub struct Linear {
    /// What the projection is in the model (`attn_q`, `ffn_down`, `output`, ...), for profiles.
    pub kind: &'static str,
    pub weight: PackedMatrix,
    pub bias: Option<Vec<f32>>,
    pub n_in: usize,
    pub n_out: usize,
}

impl Linear {
    /// `x`: [T, n_in] -> [T, n_out]. `segs`: the rows of each sequence stacked in `x` (each
    /// sequence's rows are computed as if alone in the call; see
    /// [`ferrum_kernels::matmul::matmul_segments`]).
    pub fn forward(&self, x: &[f32], segs: &[usize]) -> Buf {
        let t = x.len() / self.n_in;
        let mut y = Buf::zeros(t * self.n_out);
        let flops = 2.0 * (self.n_in * self.n_out * t) as f64;
        let bytes = (self.weight.n_bytes() + 4 * t * (self.n_in + self.n_out)) as f64;
        profile::record("matmul", self.kind, flops, bytes, || {
            self.weight.matmul(x, &mut y, segs)
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

/// A gated feed-forward block's three projections (SwiGLU or GeGLU): `down(act(gate x) * up x)`.
#[derive(Clone, Debug)]
pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

/// A mixture of experts ([`super::config::MoeConfig`]): the router, `[n_embd] -> [n_expert]`, and
/// each expert's projections, stored one matrix per expert.
#[derive(Clone, Debug)]
pub struct Moe {
    pub router: Linear,
    pub experts: Vec<Mlp>,
}

/// A layer's feed-forward block.
#[derive(Clone, Debug)]
pub enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

/// Per-layer weights; the optional ones belong to some architectures only.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub attn_q: Linear,
    pub attn_k: Linear,
    pub attn_v: Linear,
    pub attn_output: Linear,
    /// Gemma 3, Qwen3: per-head RMSNorm weights of Q and K.
    pub attn_q_norm: Option<Vec<f32>>,
    pub attn_k_norm: Option<Vec<f32>>,
    /// Gemma 3: norm of the attention output before the residual add.
    pub post_attention_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn,
    /// Gemma 3: norm of the FFN output before the residual add.
    pub post_ffw_norm: Option<Vec<f32>>,
}

impl LayerWeights {
    /// The dense feed-forward block (the architectures without experts always have one).
    pub fn mlp(&self) -> &Mlp {
        match &self.ffn {
            Ffn::Dense(m) => m,
            Ffn::Moe(_) => unreachable!("Weights::load gives this architecture dense blocks"),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Weights {
    /// The embedding table, [n_vocab, n_embd]; the LM head's matrix itself when the file ties
    /// them (then stored in the head's layout, and lookups unpack a row).
    pub token_embd: PackedMatrix,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>,
    /// The LM head.
    pub output: Linear,
}

/// What loading stored, and where ([`Weights::load`]).
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    /// Bytes of matrices repacked for this CPU's kernels (anonymous memory).
    pub packed_bytes: usize,
    /// Bytes of matrices copied as they are into anonymous memory.
    pub copied_bytes: usize,
    /// Bytes of matrices read in place from the file map (pages resident as they are read).
    pub mapped_bytes: usize,
    /// Seconds spent reading tensors and checking shapes, then packing or copying.
    pub read_seconds: f64,
    pub pack_seconds: f64,
}
impl LayerWeights {
    /// Every projection of the layer: attention, then the feed-forward block's (a mixture's
    /// router, then each expert's gate, up and down).
    pub fn linears(&self) -> Vec<&Linear> {
        let mut v = vec![&self.attn_q, &self.attn_k, &self.attn_v, &self.attn_output];
        match &self.ffn {
            Ffn::Dense(m) => v.extend([&m.gate, &m.up, &m.down]),
            Ffn::Moe(moe) => {
                v.push(&moe.router);
                for m in &moe.experts {
                    v.extend([&m.gate, &m.up, &m.down]);
                }
            }
        }
        v
    }

    /// [`LayerWeights::linears`], mutably and in the same order.
    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v = vec![
            &mut self.attn_q,
            &mut self.attn_k,
            &mut self.attn_v,
            &mut self.attn_output,
        ];
        match &mut self.ffn {
            Ffn::Dense(m) => v.extend([&mut m.gate, &mut m.up, &mut m.down]),
            Ffn::Moe(moe) => {
                v.push(&mut moe.router);
                for m in &mut moe.experts {
                    v.extend([&mut m.gate, &mut m.up, &mut m.down]);
                }
            }
        }
        v
    }
}

impl Weights {
    /// Whether the LM head is the embedding table.
    pub fn tied(&self) -> bool {
        self.output.weight.data().as_ptr() == self.token_embd.data().as_ptr()
    }

    /// Every distinct matrix of the model (the tied LM head counted once).
    pub fn matrices(&self) -> Vec<&PackedMatrix> {
        let mut v = vec![&self.token_embd];
        for l in &self.layers {
            v.extend(l.linears().into_iter().map(|lin| &lin.weight));
        }
        if !self.tied() {
            v.push(&self.output.weight);
        }
        v
    }

    /// Bytes of the matrices as stored (norm vectors and biases are not counted, as llama-bench
    /// does not).
    pub fn n_bytes(&self) -> usize {
        self.matrices().iter().map(|t| t.n_bytes()).sum()
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
        self.matrices()
            .iter()
            .map(|t| t.rows() * t.cols())
            .sum::<usize>()
            + norms
            + self.output_norm.len()
    }

    /// Weight bytes one decode step reads: every matrix, except that the embedding table
    /// contributes one row (unless it is also the LM head, which reads all of it).
    /// A mixture of experts contributes its router and `n_used` of its experts (on average over
    /// the experts: the ones a token picks vary).
    pub fn bytes_per_token(&self, n_expert_used: usize) -> usize {
        let embd = &self.token_embd;
        let embd_read = if self.tied() {
            embd.n_bytes()
        } else {
            embd.n_bytes() / embd.rows().max(1)
        };
        let unread_experts: usize = self
            .layers
            .iter()
            .map(|l| match &l.ffn {
                Ffn::Dense(_) => 0,
                Ffn::Moe(moe) => {
                    let all: usize = moe
                        .experts
                        .iter()
                        .flat_map(|m| [&m.gate, &m.up, &m.down])
                        .map(|lin| lin.weight.n_bytes())
                        .sum();
                    let n = moe.experts.len().max(1);
                    all - all * n_expert_used.min(n) / n
                }
            })
            .sum();
        self.n_bytes() - embd.n_bytes() + embd_read - unread_experts
    }

    /// Loads every tensor the architecture needs, checking each shape against `cfg`, and stores
    /// each matrix once ([`Weights::store`]). `progress(i, total)` is called after each layer.
    pub fn load(
        src: &dyn TensorSource,
        cfg: &Config,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Weights> {
        Ok(Self::load_report(src, cfg, progress)?.0)
    }

    /// [`Weights::load`], also saying what was stored where and how long each part took.
    pub fn load_report(
        src: &dyn TensorSource,
        cfg: &Config,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(Weights, LoadReport)> {
        let started = std::time::Instant::now();
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
        let matrix = |name: &str, n_in: usize, n_out: usize| -> Result<RawTensor> {
            let w = get(name)?;
            check(name, &w, &[n_in, n_out])?;
            if w.dtype.row_bytes(n_in).is_none() {
                return Err(Error::Shape(format!(
                    "tensor '{name}': row of {n_in} is not whole {} blocks",
                    w.dtype
                )));
            }
            Ok(w)
        };
        // Each matrix as read, with its Linear's fields; stored once at the end.
        struct Pending {
            kind: &'static str,
            raw: RawTensor,
            bias: Option<Vec<f32>>,
            n_in: usize,
            n_out: usize,
        }
        let linear = |name: &str, n_in: usize, n_out: usize, bias: bool| -> Result<Pending> {
            let raw = matrix(&format!("{name}.weight"), n_in, n_out)?;
            let bias = if bias {
                Some(vector(&format!("{name}.bias"), n_out)?)
            } else {
                None
            };
            Ok(Pending {
                kind: linear_kind(name),
                raw,
                bias,
                n_in,
                n_out,
            })
        };
        // A 3-d tensor of experts, [n_in, n_out, n_expert], as one matrix per expert (zero-copy
        // windows of its bytes).
        let experts = |name: &str, n_in: usize, n_out: usize, n: usize| -> Result<Vec<Pending>> {
            let w = get(&format!("{name}.weight"))?;
            check(name, &w, &[n_in, n_out, n])?;
            let rb = w.dtype.row_bytes(n_in).ok_or_else(|| {
                Error::Shape(format!(
                    "tensor '{name}': row of {n_in} is not whole {} blocks",
                    w.dtype
                ))
            })?;
            let kind = linear_kind(name);
            (0..n)
                .map(|i| {
                    Ok(Pending {
                        kind,
                        raw: RawTensor {
                            dtype: w.dtype,
                            dims: vec![n_in, n_out],
                            data: w.data.slice(i * rb * n_out, rb * n_out)?,
                        },
                        bias: None,
                        n_in,
                        n_out,
                    })
                })
                .collect()
        };
        enum FfnPlan {
            Dense([Pending; 3]),
            Moe(Pending, Vec<[Pending; 3]>),
        }
        let (e, q, kv, ff) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
        let token_embd = matrix("token_embd.weight", e, cfg.n_vocab)?;
        let qkv_bias = cfg.arch == Arch::Qwen2;
        let gemma = cfg.arch.is_gemma();
        let qk_norm = cfg.arch.has_qk_norm();
        let fused = cfg.arch == Arch::Phi3;
        // A matrix whose rows stack several projections, as one Pending per part.
        fn split_rows<const N: usize>(
            p: Pending,
            parts: [(&'static str, usize); N],
        ) -> Result<[Pending; N]> {
            let rb = p.raw.dtype.row_bytes(p.n_in).expect("checked by matrix()");
            let mut r0 = 0;
            let mut out = Vec::with_capacity(N);
            for (kind, rows) in parts {
                out.push(Pending {
                    kind,
                    raw: RawTensor {
                        dtype: p.raw.dtype,
                        dims: vec![p.n_in, rows],
                        data: p.raw.data.slice(r0 * rb, rows * rb)?,
                    },
                    bias: None,
                    n_in: p.n_in,
                    n_out: rows,
                });
                r0 += rows;
            }
            Ok(out.try_into().unwrap_or_else(|_| unreachable!("N parts")))
        }
        // Per layer: the attention projections, the feed-forward block's and the norms.
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for il in 0..cfg.n_layer {
            let p = format!("blk.{il}");
            let norm = |n: &str, len: usize, required: bool| -> Result<Option<Vec<f32>>> {
                if required {
                    vector(&format!("{p}.{n}.weight"), len).map(Some)
                } else {
                    opt_vector(&format!("{p}.{n}.weight"), len)
                }
            };
            let attn = if fused {
                // Phi-3: Q, K and V stacked in one matrix, split by rows (zero-copy).
                let [aq, ak, av] = split_rows(
                    linear(&format!("{p}.attn_qkv"), e, q + 2 * kv, false)?,
                    [("attn_q", q), ("attn_k", kv), ("attn_v", kv)],
                )?;
                [
                    aq,
                    ak,
                    av,
                    linear(&format!("{p}.attn_output"), q, e, false)?,
                ]
            } else {
                [
                    linear(&format!("{p}.attn_q"), e, q, qkv_bias)?,
                    linear(&format!("{p}.attn_k"), e, kv, qkv_bias)?,
                    linear(&format!("{p}.attn_v"), e, kv, qkv_bias)?,
                    linear(&format!("{p}.attn_output"), q, e, false)?,
                ]
            };
            let router = format!("{p}.ffn_gate_inp.weight");
            let ffn = match cfg.moe {
                Some(m) if src.tensor(&router)?.is_some() => {
                    let (n, f) = (m.n_expert, m.n_ff_exp);
                    let gate = experts(&format!("{p}.ffn_gate_exps"), e, f, n)?;
                    let up = experts(&format!("{p}.ffn_up_exps"), e, f, n)?;
                    let down = experts(&format!("{p}.ffn_down_exps"), f, e, n)?;
                    let per_expert = gate
                        .into_iter()
                        .zip(up)
                        .zip(down)
                        .map(|((g, u), d)| [g, u, d])
                        .collect();
                    FfnPlan::Moe(
                        linear(&format!("{p}.ffn_gate_inp"), e, n, false)?,
                        per_expert,
                    )
                }
                _ if fused => {
                    // Phi-3: gate and up stacked in `ffn_up`, gate first.
                    let [g, u] = split_rows(
                        linear(&format!("{p}.ffn_up"), e, 2 * ff, false)?,
                        [("ffn_gate", ff), ("ffn_up", ff)],
                    )?;
                    FfnPlan::Dense([g, u, linear(&format!("{p}.ffn_down"), ff, e, false)?])
                }
                _ => FfnPlan::Dense([
                    linear(&format!("{p}.ffn_gate"), e, ff, false)?,
                    linear(&format!("{p}.ffn_up"), e, ff, false)?,
                    linear(&format!("{p}.ffn_down"), ff, e, false)?,
                ]),
            };
            let norms = [
                norm("attn_norm", e, true)?,
                norm("attn_q_norm", cfg.head_dim, qk_norm)?,
                norm("attn_k_norm", cfg.head_dim, qk_norm)?,
                norm("post_attention_norm", e, gemma)?,
                norm("ffn_norm", e, true)?,
                norm("post_ffw_norm", e, gemma)?,
            ];
            layers.push((attn, ffn, norms));
        }
        let output = match src.tensor("output.weight")? {
            Some(_) => Some(linear("output", e, cfg.n_vocab, false)?),
            None => None,
        };
        let output_norm = vector("output_norm.weight", e)?;
        let read_seconds = started.elapsed().as_secs_f64();

        // Store: the embedding table (the LM head too when tied), every projection, the head.
        let started = std::time::Instant::now();
        let mut raws: Vec<&RawTensor> = vec![&token_embd];
        // Index of each layer's last matrix in `raws`, for the progress callback.
        let mut layer_last = Vec::with_capacity(cfg.n_layer);
        for (attn, ffn, _) in &layers {
            raws.extend(attn.iter().map(|p| &p.raw));
            match ffn {
                FfnPlan::Dense(m) => raws.extend(m.iter().map(|p| &p.raw)),
                FfnPlan::Moe(router, experts) => {
                    raws.push(&router.raw);
                    raws.extend(experts.iter().flatten().map(|p| &p.raw));
                }
            }
            layer_last.push(raws.len() - 1);
        }
        if let Some(o) = &output {
            raws.push(&o.raw);
        }
        let tied = output.is_none();
        let n_layer = cfg.n_layer;
        let mut report = LoadReport {
            read_seconds,
            ..LoadReport::default()
        };
        let mut stored = store_matrices(&raws, tied, &mut report, &mut |i| {
            if let Ok(il) = layer_last.binary_search(&i) {
                progress(il + 1, n_layer);
            }
        })?
        .into_iter();
        report.pack_seconds = started.elapsed().as_secs_f64();
        drop(raws);
        tracing::info!(
            packed_mib = report.packed_bytes >> 20,
            copied_mib = report.copied_bytes >> 20,
            mapped_mib = report.mapped_bytes >> 20,
            read_s = report.read_seconds,
            pack_s = report.pack_seconds,
            threads = ferrum_kernels::pool::threads(),
            tier = %ferrum_kernels::cpu::tier(),
            "weights stored once"
        );

        let token_embd_m = stored.next().expect("one per matrix");
        let mut finish = |p: Pending| Linear {
            kind: p.kind,
            weight: stored.next().expect("one per matrix"),
            bias: p.bias,
            n_in: p.n_in,
            n_out: p.n_out,
        };
        let mut out_layers = Vec::with_capacity(n_layer);
        for (attn, ffn, norms) in layers {
            let [attn_q, attn_k, attn_v, attn_output] = attn.map(&mut finish);
            let mut mlp = |[g, u, d]: [Pending; 3]| Mlp {
                gate: finish(g),
                up: finish(u),
                down: finish(d),
            };
            let ffn = match ffn {
                FfnPlan::Dense(m) => Ffn::Dense(mlp(m)),
                FfnPlan::Moe(router, experts) => {
                    let router = finish(router);
                    // Re-borrow: `mlp` holds `finish` mutably.
                    let mut mlp = |[g, u, d]: [Pending; 3]| Mlp {
                        gate: finish(g),
                        up: finish(u),
                        down: finish(d),
                    };
                    Ffn::Moe(Moe {
                        router,
                        experts: experts.into_iter().map(&mut mlp).collect(),
                    })
                }
            };
            let [attn_norm, attn_q_norm, attn_k_norm, post_attention_norm, ffn_norm, post_ffw_norm] =
                norms;
            out_layers.push(LayerWeights {
                attn_norm: attn_norm.expect("required"),
                attn_q,
                attn_k,
                attn_v,
                attn_output,
                attn_q_norm,
                attn_k_norm,
                post_attention_norm,
                ffn_norm: ffn_norm.expect("required"),
                ffn,
                post_ffw_norm,
            });
        }
        let output = match output {
            Some(p) => finish(p),
            None => Linear {
                kind: "output",
                weight: token_embd_m.clone(),
                bias: None,
                n_in: e,
                n_out: cfg.n_vocab,
            },
        };
        Ok((
            Weights {
                token_embd: token_embd_m,
                layers: out_layers,
                output_norm,
                output,
            },
            report,
        ))
    }

    /// Every matrix re-stored as F32 row-major (the unquantized reference path).
    pub fn dequantized(&self) -> Result<Weights> {
        let f32_of = |m: &PackedMatrix| -> Result<PackedMatrix> {
            let rb = m.dtype().row_bytes(m.cols()).expect("whole blocks");
            let raw = m.to_row_major();
            let mut bytes = Vec::with_capacity(m.rows() * m.cols() * 4);
            let mut row = vec![0f32; m.cols()];
            for r in raw.chunks_exact(rb) {
                quant::dequantize_row(m.dtype(), r, &mut row);
                bytes.extend(row.iter().flat_map(|x| x.to_le_bytes()));
            }
            PackedMatrix::row_major(DType::F32, m.rows(), m.cols(), Bytes::from_vec(bytes))
        };
        let lin = |l: &Linear| -> Result<Linear> {
            Ok(Linear {
                weight: f32_of(&l.weight)?,
                ..l.clone()
            })
        };
        let token_embd = f32_of(&self.token_embd)?;
        let output = if self.tied() {
            Linear {
                weight: token_embd.clone(),
                ..self.output.clone()
            }
        } else {
            lin(&self.output)?
        };
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let mut l = l.clone();
                for m in l.linears_mut() {
                    *m = lin(m)?;
                }
                Ok(l)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Weights {
            output,
            token_embd,
            output_norm: self.output_norm.clone(),
            layers,
        })
    }
}

/// Rows of a matrix packed at a time (a multiple of every packed layout's group): the file pages
/// of one chunk are mapped in, packed, then released, so loading holds at most one chunk of a
/// large matrix twice.
const STORE_CHUNK_BYTES: usize = 8 << 20;

/// Writes `t` ([rows, cols], row-major) into `dst` in `layout`, a chunk of whole 16-row groups
/// at a time (each chunk is a matrix of its own in every layout: groups are stored one after
/// another), mapping each chunk's file pages in before and releasing them after.
fn store_chunked(
    t: &RawTensor,
    rows: usize,
    cols: usize,
    layout: Layout,
    dst: &mut [u8],
) -> Result<()> {
    let rb = t.dtype.row_bytes(cols).expect("whole blocks");
    let chunk_rows = (STORE_CHUNK_BYTES / rb.max(1)).max(16) / 16 * 16;
    let mut at = 0;
    for r0 in (0..rows).step_by(chunk_rows) {
        let n = chunk_rows.min(rows - r0);
        let src = t.data.slice(r0 * rb, n * rb)?;
        let len = PackedMatrix::stored_len(t.dtype, n, cols, layout).ok_or_else(|| {
            Error::Shape(format!(
                "a {n}x{cols} {} chunk does not fit {}",
                t.dtype,
                layout.name()
            ))
        })?;
        let out = dst.get_mut(at..at + len).ok_or_else(|| {
            Error::Shape(format!(
                "packing a {rows}x{cols} {} matrix overflows",
                t.dtype
            ))
        })?;
        src.populate();
        PackedMatrix::pack_into(t.dtype, n, cols, layout, &src, out)?;
        src.release();
        at += len;
    }
    if at != dst.len() {
        return Err(Error::Shape(format!(
            "packing a {rows}x{cols} {} matrix wrote {at} of {} bytes",
            t.dtype,
            dst.len()
        )));
    }
    Ok(())
}

/// Stores each matrix once: those this CPU's kernels want repacked, and the projections (which
/// decode streams every token), go into one anonymous buffer backed by huge pages where the OS
/// allows ([`Bytes::build`]: a file map is made of 4 KiB pages, and streaming all weights per
/// token through them costs a TLB miss every few rows); after each is written, its pages of the
/// file map are released, so the process holds each weight once. An untied embedding table,
/// read one row per token, stays in the file map. `raws[0]` is the embedding table; with `tied`
/// it is also the LM head. `done(i)` is called after matrix i.
fn store_matrices(
    raws: &[&RawTensor],
    tied: bool,
    report: &mut LoadReport,
    done: &mut dyn FnMut(usize),
) -> Result<Vec<PackedMatrix>> {
    // (rows, cols, layout) of each; `None` layout: kept where it is.
    let plan: Vec<(usize, usize, Option<Layout>)> = raws
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let (cols, rows) = (t.dims[0], t.dims[1]);
            let layout = PackedMatrix::plan_layout(t.dtype, rows, cols);
            let keep = i == 0 && !tied;
            (rows, cols, (!keep).then_some(layout))
        })
        .collect();
    let to_store: Vec<usize> = (0..raws.len()).filter(|&i| plan[i].2.is_some()).collect();
    let sizes: Vec<usize> = to_store
        .iter()
        .map(|&i| {
            let (rows, cols, layout) = plan[i];
            PackedMatrix::stored_len(raws[i].dtype, rows, cols, layout.expect("stored"))
                .expect("planned layout fits")
        })
        .collect();
    let bufs = Bytes::build(&sizes, |parts| {
        let mut parts = parts.into_iter();
        for i in 0..raws.len() {
            if plan[i].2.is_some() {
                let (rows, cols, layout) = plan[i];
                let t = raws[i];
                let dst = parts.next().expect("one part per stored matrix");
                store_chunked(t, rows, cols, layout.expect("stored"), dst)?;
            }
            done(i);
        }
        Ok(())
    })?;
    let mut bufs = bufs.into_iter();
    raws.iter()
        .zip(&plan)
        .map(|(t, &(rows, cols, layout))| match layout {
            None => {
                report.mapped_bytes += t.data.len();
                PackedMatrix::row_major(t.dtype, rows, cols, t.data.clone())
            }
            Some(layout) => {
                let b = bufs.next().expect("one buffer per stored matrix");
                if layout == Layout::RowMajor {
                    report.copied_bytes += b.len();
                } else {
                    report.packed_bytes += b.len();
                }
                PackedMatrix::from_parts(t.dtype, rows, cols, layout, b)
            }
        })
        .collect()
}

/// The role of a projection from its GGUF name (`blk.N.attn_q` -> `attn_q`).
fn linear_kind(name: &str) -> &'static str {
    const KINDS: [&str; 12] = [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
        "ffn_gate_inp",
        "ffn_gate_exps",
        "ffn_up_exps",
        "ffn_down_exps",
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
