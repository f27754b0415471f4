//! Model weights, named as in GGUF (`blk.N.attn_q.weight`, ...), whatever file they came from.
//!
//! Quantization sits behind [`Linear`]: a model file calls `linear.forward(x)` and never sees the
//! storage type. A [`TensorSource`] hands out tensors by GGUF name; the GGUF loader reads them from
//! the memory map, the safetensors loader translates Hugging Face names and layouts.

use ferrum_core::{Buf, Bytes, DType, Error, Result};
use ferrum_kernels::matmul::{Layout, PackedMatrix};
use ferrum_kernels::profile;
use ferrum_kernels::quant;

use super::arch::{Layer, LayerTensors, Loaded, Shape};
use super::config::Config;

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

    /// Whether the source has the tensor (for optional ones; reads nothing where it can).
    fn contains(&self, name: &str) -> bool {
        matches!(self.tensor(name), Ok(Some(_)))
    }
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
        // Every output is written by the product: no need to clear the buffer first.
        let mut y = Buf::overwritten(t * self.n_out);
        let flops = 2.0 * (self.n_in * self.n_out * t) as f64;
        let bytes = (self.weight.n_bytes() + 4 * t * (self.n_in + self.n_out)) as f64;
        profile::record("matmul", self.kind, flops, bytes, || {
            self.weight.matmul(x, &mut y, segs)
        });
        self.add_bias(&mut y);
        y
    }

    /// Adds the bias, if any, to every row of `y` ([T, n_out]).
    fn add_bias(&self, y: &mut [f32]) {
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(self.n_out) {
                for (v, bv) in row.iter_mut().zip(b) {
                    *v += bv;
                }
            }
        }
    }

    /// Several projections of the same input `x` ([T, n_in] each), one product call for all
    /// ([`PackedMatrix::matmul_many`]: a layer's Q, K and V, or its gate and up, split over the
    /// threads as one matrix): each output the bits its own [`Linear::forward`] gives. Profiles
    /// record the call once, as `kind`.
    pub fn forward_many<const N: usize>(
        kind: &'static str,
        ls: [&Linear; N],
        x: &[f32],
        segs: &[usize],
    ) -> [Buf; N] {
        let n_in = ls[0].n_in;
        assert!(
            ls.iter().all(|l| l.n_in == n_in),
            "forward_many: projections of one input"
        );
        let t = x.len() / n_in;
        let mut ys: [Buf; N] = core::array::from_fn(|i| Buf::overwritten(t * ls[i].n_out));
        let n_out: usize = ls.iter().map(|l| l.n_out).sum();
        let flops = 2.0 * (n_in * n_out * t) as f64;
        let w_bytes: usize = ls.iter().map(|l| l.weight.n_bytes()).sum();
        let bytes = (w_bytes + 4 * t * (n_in + n_out)) as f64;
        profile::record("matmul", kind, flops, bytes, || {
            let mats: [&PackedMatrix; N] = core::array::from_fn(|i| &ls[i].weight);
            let mut outs = ys.each_mut().map(|y| &mut y[..]);
            PackedMatrix::matmul_many(&mats, x, &mut outs, segs)
        });
        for (l, y) in ls.iter().zip(ys.iter_mut()) {
            l.add_bias(y);
        }
        ys
    }
}

#[derive(Clone, Debug)]
pub struct Weights {
    /// The embedding table, [n_vocab, n_embd]; the LM head's matrix itself when the file ties
    /// them (then stored in the head's layout, and lookups unpack a row).
    pub token_embd: PackedMatrix,
    /// The decoder layers, each of its architecture's type ([`super::arch`]).
    pub layers: Vec<Box<dyn Layer>>,
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
            .flat_map(|l| l.norms())
            .map(|(_, v)| v.len())
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
            .map(|l| match l.moe() {
                None => 0,
                Some(moe) => {
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
        let linear = |kind: &'static str,
                      name: &str,
                      n_in: usize,
                      n_out: usize,
                      bias: bool|
         -> Result<Pending> {
            let raw = matrix(&format!("{name}.weight"), n_in, n_out)?;
            let bias = if bias {
                Some(vector(&format!("{name}.bias"), n_out)?)
            } else {
                None
            };
            Ok(Pending {
                kind,
                raw,
                bias,
                n_in,
                n_out,
            })
        };
        // A 3-d tensor of experts, [n_in, n_out, n_expert], as one matrix per expert (zero-copy
        // windows of its bytes).
        let experts = |kind: &'static str,
                       name: &str,
                       n_in: usize,
                       n_out: usize,
                       n: usize,
                       bias: bool|
         -> Result<Vec<Pending>> {
            let w = get(&format!("{name}.weight"))?;
            check(name, &w, &[n_in, n_out, n])?;
            // Each expert's bias, [n_out, n_expert].
            let biases = if bias {
                let bn = format!("{name}.bias");
                let b = get(&bn)?;
                check(&bn, &b, &[n_out, n])?;
                Some(b.to_f32())
            } else {
                None
            };
            let rb = w.dtype.row_bytes(n_in).ok_or_else(|| {
                Error::Shape(format!(
                    "tensor '{name}': row of {n_in} is not whole {} blocks",
                    w.dtype
                ))
            })?;
            (0..n)
                .map(|i| {
                    Ok(Pending {
                        kind,
                        raw: RawTensor {
                            dtype: w.dtype,
                            dims: vec![n_in, n_out],
                            data: w.data.slice(i * rb * n_out, rb * n_out)?,
                        },
                        bias: biases
                            .as_ref()
                            .map(|b| b[i * n_out..(i + 1) * n_out].to_vec()),
                        n_in,
                        n_out,
                    })
                })
                .collect()
        };
        // A matrix whose rows stack several projections, as one Pending per part.
        fn split_rows(p: Pending, parts: &[(&'static str, usize)]) -> Result<Vec<Pending>> {
            let rb = p.raw.dtype.row_bytes(p.n_in).expect("checked by matrix()");
            let mut r0 = 0;
            let mut out = Vec::with_capacity(parts.len());
            for &(kind, rows) in parts {
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
            Ok(out)
        }
        // A layer tensor as read: a norm, or the matrices it stores (stored once at the end).
        enum Read {
            Vector(Vec<f32>),
            Linear(Pending),
            Experts(Vec<Pending>),
        }
        let e = cfg.n_embd;
        let token_embd = matrix("token_embd.weight", e, cfg.n_vocab)?;
        // Per layer, every tensor the architecture declares, in its order.
        let specs = (cfg.arch.tensors)(cfg);
        let mut layers: Vec<Vec<(&'static str, Read)>> = Vec::with_capacity(cfg.n_layer);
        for il in 0..cfg.n_layer {
            let mut items = Vec::with_capacity(specs.len());
            for spec in &specs {
                let name = format!("blk.{il}.{}", spec.gguf);
                if !spec.required && !src.contains(&format!("{name}.weight")) {
                    continue;
                }
                match spec.shape {
                    Shape::Vector(n) => {
                        let v = vector(&format!("{name}.weight"), n(cfg))?;
                        items.push((spec.gguf, Read::Vector(v)));
                    }
                    Shape::Matrix { n_in, n_out, bias } => {
                        let p = linear(spec.gguf, &name, n_in(cfg), n_out(cfg), bias)?;
                        items.push((spec.gguf, Read::Linear(p)));
                    }
                    Shape::Stacked { n_in, parts } => {
                        let sizes: Vec<(&'static str, usize)> =
                            parts.iter().map(|&(k, d)| (k, d(cfg))).collect();
                        let rows = sizes.iter().map(|p| p.1).sum();
                        let whole = linear(spec.gguf, &name, n_in(cfg), rows, false)?;
                        for p in split_rows(whole, &sizes)? {
                            items.push((p.kind, Read::Linear(p)));
                        }
                    }
                    Shape::Experts { n_in, n_out, bias } => {
                        let n = super::arch::dim::EXPERTS(cfg);
                        let v = experts(spec.gguf, &name, n_in(cfg), n_out(cfg), n, bias)?;
                        items.push((spec.gguf, Read::Experts(v)));
                    }
                }
            }
            layers.push(items);
        }
        let output = match src.tensor("output.weight")? {
            Some(_) => Some(linear("output", "output", e, cfg.n_vocab, false)?),
            None => None,
        };
        let output_norm = vector("output_norm.weight", e)?;
        let read_seconds = started.elapsed().as_secs_f64();

        // Store: the embedding table (the LM head too when tied), every projection, the head.
        let started = std::time::Instant::now();
        let mut raws: Vec<&RawTensor> = vec![&token_embd];
        // Index of each layer's last matrix in `raws`, for the progress callback.
        let mut layer_last = Vec::with_capacity(cfg.n_layer);
        for items in &layers {
            for (_, r) in items {
                match r {
                    Read::Vector(_) => {}
                    Read::Linear(p) => raws.push(&p.raw),
                    Read::Experts(ps) => raws.extend(ps.iter().map(|p| &p.raw)),
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
        for (il, items) in layers.into_iter().enumerate() {
            let loaded = items
                .into_iter()
                .map(|(name, r)| {
                    let l = match r {
                        Read::Vector(v) => Loaded::Vector(v),
                        Read::Linear(p) => Loaded::Linear(finish(p)),
                        Read::Experts(ps) => {
                            Loaded::Experts(ps.into_iter().map(&mut finish).collect())
                        }
                    };
                    (name, l)
                })
                .collect();
            let mut t = LayerTensors::new(il, cfg.arch.name(), loaded);
            out_layers.push((cfg.arch.build)(cfg, &mut t)?);
            t.finish()?;
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
