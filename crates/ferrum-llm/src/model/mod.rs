//! Decoder-only transformers. One file per architecture ([`llama`], [`qwen2`], [`qwen3`],
//! [`qwen3moe`], [`phi3`], [`gemma2`], [`gemma3`], [`gptoss`]) declares its conventions, its tensors and its
//! layer as the paper writes it, and has one line in the registry ([`arch::REGISTRY`]). Layers are
//! built from the shared [`blocks`] (attention, the gated feed-forward block, the [`moe`]
//! mixture of experts); the operations they share (norms, RoPE, cached attention) live here.

pub mod arch;
pub mod blocks;
pub mod config;
pub mod gemma2;
pub mod gemma3;
pub mod gptoss;
pub mod kv_cache;
pub mod llama;
pub mod moe;
pub mod phi3;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3moe;
pub mod weights;

use ferrum_core::{Buf, Error, Result};
use ferrum_kernels::attention::{attention_paged_batch, AttnParams, SeqAttn};
use ferrum_kernels::ops::{self, RopeCache};
use ferrum_kernels::profile;
use smallvec::SmallVec;

pub use arch::{Arch, Layer};
pub use blocks::{Ffn, Mlp, Moe};
pub use config::{Config, MoeConfig};
pub use kv_cache::{KvCache, KvPool};
pub use weights::{Linear, RawTensor, TensorSource, Weights};

/// Which positions of a forward pass need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    /// Every position from this index (within the batch) on.
    From(usize),
}

pub struct Model {
    pub config: Config,
    pub weights: Weights,
}

/// One sequence of a batched forward pass ([`Model::forward_batch`]).
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    /// Position of the first token: the cache must hold positions `0..start`.
    pub start: usize,
    /// The sequence's blocks in the pool, covering at least `start + tokens.len()` positions.
    /// Blocks the new positions fall in must belong to this sequence alone.
    pub table: &'a [u32],
    /// Which of this sequence's positions need logits.
    pub want: Logits,
}

/// State shared by the layers of one forward pass over one or more sequences, whose rows are
/// stacked in the batch in order.
pub struct Step<'a> {
    pub cfg: &'a Config,
    pool: &'a mut KvPool,
    tables: PerSeq<&'a [u32]>,
    starts: PerSeq<usize>,
    lens: PerSeq<usize>,
    /// Per sequence, the first of its rows whose output is needed (`None`: no row). As llama.cpp
    /// does, the last layer runs its output projection and feed-forward block only on those rows.
    out_first: PerSeq<Option<usize>>,
    /// Position of each row of the batch.
    pub positions: PerRow<usize>,
    pub rope: RopeCache,
    /// RoPE of sliding-window layers, when their base differs (Gemma 3).
    pub rope_swa: Option<RopeCache>,
    /// Rows per sequence in the activations now (all its tokens; after the last layer's pruning,
    /// the rows that need logits). Matmuls take it so each sequence's rows are computed as if
    /// alone in the call: a sequence's results do not depend on its batch.
    pub segs: PerSeq<usize>,
}

/// The rows kept by the last layer: per sequence, from its first needed row to its end.
fn kept_rows<'a>(
    lens: &'a [usize],
    out_first: &'a [Option<usize>],
) -> impl Iterator<Item = usize> + 'a {
    let mut r0 = 0;
    lens.iter().zip(out_first).flat_map(move |(&len, first)| {
        let rows = r0 + first.unwrap_or(len)..r0 + len;
        r0 += len;
        rows
    })
}

/// How one layer's queries attend ([`Step::attend`]).
#[derive(Clone, Copy, Debug)]
pub struct Attend<'a> {
    /// Multiplies q.k.
    pub scale: f32,
    /// A query sees only the last `window` positions.
    pub window: Option<usize>,
    /// Per query head, a logit joining the softmax's denominator with no value (gpt-oss).
    pub sinks: Option<&'a [f32]>,
}

/// Per-sequence values of a step, inline for batches of up to 16 sequences (no allocation).
pub type PerSeq<T> = SmallVec<[T; 16]>;
/// Per-row values of a step, inline up to 16 rows (a decode step of up to 16 sequences).
pub type PerRow<T> = SmallVec<[T; 16]>;

impl Step<'_> {
    pub fn n_tokens(&self) -> usize {
        self.positions.len()
    }

    /// In the last layer, keeps only the rows of `x` (the residual stream, [T, n_embd]) and `o`
    /// (the attention block's output after its projection, [T, n_embd]) that logits need. As in
    /// llama.cpp this happens after the output projection, which runs on every row of the call
    /// (its row count picks the K-quant kernel and so the float order), so only the norms and the
    /// FFN after it run on the kept rows.
    pub fn keep_output_rows(&mut self, il: usize, x: &mut Buf, o: &mut Buf) {
        if il + 1 != self.cfg.n_layer {
            return;
        }
        let e = self.cfg.n_embd;
        let gather = |v: &[f32]| -> Buf {
            let n = kept_rows(&self.lens, &self.out_first).count();
            let mut out = Buf::with_capacity(n * e);
            for r in kept_rows(&self.lens, &self.out_first) {
                out.extend_from_slice(&v[r * e..(r + 1) * e]);
            }
            out
        };
        *x = gather(x);
        *o = gather(o);
        self.segs.clear();
        for (&len, first) in self.lens.iter().zip(&self.out_first) {
            self.segs.push(len - first.unwrap_or(len));
        }
    }

    /// Writes each sequence's K/V rows into its cache for layer `il`, then attends every query to
    /// its sequence's cached keys up to its own position, as `how` says.
    /// `q`: [T, n_head*head_dim].
    pub fn attend(&mut self, il: usize, q: &[f32], k: &[f32], v: &[f32], how: Attend) -> Buf {
        let Attend {
            scale,
            window,
            sinks,
        } = how;
        let cfg = self.cfg;
        let kvd = cfg.kv_dim();
        // A quantized cache holds K and V rotated by a Walsh-Hadamard matrix, as llama.cpp's
        // does (its default; see `ops::hadamard_inplace`): Q and K by the largest power-of-two
        // block (>= 64) dividing head_dim, V by 64; the output is rotated back below.
        let (rot_k, rot_v) = kv_rotation(cfg);
        let (mut qr, mut kr, mut vr);
        let (q, k, v) = match (rot_k, rot_v) {
            (None, None) => (q, k, v),
            _ => {
                (qr, kr, vr) = (q.to_vec(), k.to_vec(), v.to_vec());
                if let Some(n) = rot_k {
                    ops::hadamard_inplace(&mut qr, n);
                    ops::hadamard_inplace(&mut kr, n);
                }
                if let Some(n) = rot_v {
                    ops::hadamard_inplace(&mut vr, n);
                }
                (&qr[..], &kr[..], &vr[..])
            }
        };
        profile::record(
            "kv_store",
            "cache",
            0.0,
            6.0 * (k.len() + v.len()) as f64,
            || {
                let mut r0 = 0;
                for ((table, &start), &len) in self.tables.iter().zip(&self.starts).zip(&self.lens)
                {
                    let rows = r0 * kvd..(r0 + len) * kvd;
                    self.pool
                        .store(il, table, start, &k[rows.clone()], &v[rows]);
                    r0 += len;
                }
            },
        );
        let p = AttnParams {
            n_head: cfg.n_head,
            n_head_kv: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            scale,
            window,
            softcap: cfg.attn_softcap,
            sinks,
        };
        let mut out = Buf::zeros(q.len());
        // Keys each query reads, for the FLOP and byte counts.
        let keys: usize = self
            .positions
            .iter()
            .map(|&pos| window.map_or(pos + 1, |w| (pos + 1).min(w)))
            .sum();
        let hd = cfg.head_dim;
        let flops = 4.0 * (cfg.n_head * hd * keys) as f64;
        let bytes = (4 * cfg.n_head_kv * hd * keys + 8 * q.len()) as f64;
        let class = if window.is_some() { "local" } else { "global" };
        profile::record("attention", class, flops, bytes, || {
            // Every sequence's rows in one parallel pass (split by sequence, query and head).
            let mut seqs: PerSeq<SeqAttn> = SmallVec::new();
            let mut r0 = 0;
            for (table, &len) in self.tables.iter().zip(&self.lens) {
                seqs.push(SeqAttn {
                    kv: self.pool.layer(il, table),
                    positions: &self.positions[r0..r0 + len],
                });
                r0 += len;
            }
            attention_paged_batch(&p, q, &seqs, &mut out);
        });
        if let Some(n) = rot_v {
            ops::hadamard_inplace(&mut out, n);
        }
        out
    }
}

/// The Walsh-Hadamard block sizes llama.cpp rotates Q/K and V by around a quantized KV cache
/// (`llama_kv_cache`'s `attn_rot_k` / `attn_rot_v`, on unless `LLAMA_ATTN_ROT_DISABLE`): for a
/// quantized cache type and a head dimension that is a multiple of 64, K by the largest power of
/// two dividing head_dim, V by 64. `None`: no rotation.
pub fn kv_rotation(cfg: &Config) -> (Option<usize>, Option<usize>) {
    let hd = cfg.head_dim;
    if !cfg.kv_type.is_quantized() || !hd.is_multiple_of(64) {
        return (None, None);
    }
    let mut n = 64;
    while hd.is_multiple_of(2 * n) {
        n *= 2;
    }
    (Some(n), Some(64))
}

/// Named-tensor trace, on with `FERRUM_TRACE=1` (names follow llama.cpp's graph callbacks:
/// `attn_norm-0`, `Qcur-0`, ...): one stderr line per intermediate with its shape, sum and first
/// values of the first and last rows, to find where a run parts from a reference. Off, it costs
/// one cached flag check.
pub fn trace(name: &str, il: Option<usize>, x: &[f32], cols: usize) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*ON.get_or_init(|| std::env::var_os("FERRUM_TRACE").is_some_and(|v| v != "0")) {
        return;
    }
    let rows = x.len() / cols.max(1);
    if rows == 0 {
        eprintln!("ferrum-trace {name} rows=0 cols={cols}");
        return;
    }
    let sum: f64 = x.iter().map(|&v| v as f64).sum();
    let head = |r: usize| -> Vec<String> {
        x[r * cols..][..cols.min(4)]
            .iter()
            .map(|v| format!("{v:.6}"))
            .collect()
    };
    let full = match il {
        Some(il) => format!("{name}-{il}"),
        None => name.to_string(),
    };
    eprintln!(
        "ferrum-trace {full} rows={rows} cols={cols} sum={sum:.6} first=[{}] last_row=[{}]",
        head(0).join(", "),
        head(rows.saturating_sub(1)).join(", ")
    );
}

/// RMSNorm of every row, returning a new buffer.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Buf {
    let mut y = Buf::zeros(x.len());
    let n = x.len() as f64;
    profile::record("rms_norm", "norm", 4.0 * n, 8.0 * n, || {
        ops::rms_norm(x, w, eps, &mut y)
    });
    y
}

/// RMSNorm of each row of `w.len()` values of `x`, in place (Gemma 3's per-head Q/K norms).
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let n = x.len() as f64;
    profile::record("rms_norm", "norm", 4.0 * n, 8.0 * n, || {
        ops::rms_norm_inplace(x, w, eps)
    })
}

/// x += y (the residual connection).
pub fn add(x: &mut [f32], y: &[f32]) {
    let n = x.len() as f64;
    profile::record("add", "residual", n, 12.0 * n, || ops::add_inplace(x, y))
}

/// x *= s.
pub fn scale(x: &mut [f32], s: f32) {
    let n = x.len() as f64;
    profile::record("scale", "elementwise", n, 8.0 * n, || {
        ops::scale_inplace(x, s)
    })
}

/// Rotary position embedding of `n_heads` heads of `head_dim` in each row of `x`.
pub fn rope(r: &RopeCache, x: &mut [f32], n_heads: usize, head_dim: usize) {
    let n = x.len() as f64;
    profile::record("rope", "rope", 3.0 * n, 8.0 * n, || {
        r.apply(x, n_heads, head_dim)
    })
}

/// g = SiLU(g) * u.
pub fn swiglu(g: &mut [f32], u: &[f32]) {
    let n = g.len() as f64;
    profile::record("swiglu", "ffn_act", 6.0 * n, 12.0 * n, || ops::swiglu(g, u))
}

/// g = GELU_tanh(g) * u.
pub fn geglu(g: &mut [f32], u: &[f32]) {
    let n = g.len() as f64;
    profile::record("geglu", "ffn_act", 10.0 * n, 12.0 * n, || ops::geglu(g, u))
}

impl Model {
    pub fn new(config: Config, weights: Weights) -> Self {
        Self { config, weights }
    }

    /// Runs `tokens` at positions `start..start+T` (the cache must hold `0..start`), and returns
    /// logits [n, n_vocab] for the positions `want` selects. The result is a recycled buffer:
    /// a decode loop that drops each step's logits before the next step allocates nothing once
    /// warm.
    pub fn forward(
        &self,
        tokens: &[u32],
        start: usize,
        cache: &mut KvCache,
        want: Logits,
    ) -> Result<Buf> {
        let seq = SeqInput {
            tokens,
            start,
            table: &cache.table,
            want,
        };
        Ok(self.run(&mut cache.pool, std::slice::from_ref(&seq))?.0)
    }

    /// Runs several sequences in one pass (their rows share every matmul, so each weight is read
    /// once for all of them) and returns each sequence's logits, [n_i, n_vocab] for the positions
    /// its `want` selects, for the sequences with tokens (in order). A sequence's logits are the
    /// same bits as when it runs alone. Every sequence's cache lives in `pool`, through its block
    /// table.
    pub fn forward_batch(&self, pool: &mut KvPool, seqs: Vec<SeqInput<'_>>) -> Result<Vec<Buf>> {
        let (logits, segs) = self.run(pool, &seqs)?;
        let v = self.config.n_vocab;
        let mut out = Vec::with_capacity(segs.len());
        let mut r0 = 0;
        for &n in &segs {
            out.push(Buf::from_slice(&logits[r0 * v..(r0 + n) * v]));
            r0 += n;
        }
        Ok(out)
    }

    /// The forward pass of [`Model::forward_batch`]: all logits rows stacked, and how many rows
    /// each sequence with tokens has.
    fn run(&self, pool: &mut KvPool, seqs: &[SeqInput<'_>]) -> Result<(Buf, PerSeq<usize>)> {
        let cfg = &self.config;
        let seqs = || seqs.iter().filter(|s| !s.tokens.is_empty());
        let mut written: PerRow<u32> = SmallVec::new();
        for s in seqs() {
            let t = s.tokens.len();
            let capacity = pool.capacity_of(s.table);
            if s.start + t > capacity {
                return Err(Error::msg(format!(
                    "context of {capacity} tokens exceeded ({} cached + {t} new): raise --ctx-size",
                    s.start
                )));
            }
            pool.check_table(s.table)?;
            let bs = pool.block_size();
            written.extend_from_slice(&s.table[s.start / bs..=(s.start + t - 1) / bs]);
            if let Some(&bad) = s.tokens.iter().find(|&&id| id as usize >= cfg.n_vocab) {
                return Err(Error::msg(format!(
                    "token id {bad} is outside the vocabulary of {}",
                    cfg.n_vocab
                )));
            }
        }
        written.sort_unstable();
        if let Some(w) = written.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::msg(format!(
                "KV block {} would be written by two sequences of one batch",
                w[0]
            )));
        }
        if seqs().next().is_none() {
            return Ok((Buf::default(), PerSeq::new()));
        }
        let t: usize = seqs().map(|s| s.tokens.len()).sum();
        let positions: PerRow<usize> = seqs()
            .flat_map(|s| s.start..s.start + s.tokens.len())
            .collect();
        let rope = RopeCache::scaled(
            &positions,
            cfg.n_rot,
            cfg.rope_base,
            cfg.rope_style,
            cfg.rope_scaling_for(pool.seq_context()),
        );
        // Gemma's sliding-window layers rotate unscaled, with their own base (as llama.cpp's).
        let rope_swa = (cfg.arch.is_gemma()
            && cfg.sliding_window.is_some()
            && (cfg.rope_base_swa != cfg.rope_base || !cfg.rope_scaling.is_identity()))
        .then(|| RopeCache::new(&positions, cfg.n_rot, cfg.rope_base_swa, cfg.rope_style));
        let lens: PerSeq<usize> = seqs().map(|s| s.tokens.len()).collect();
        let out_first: PerSeq<Option<usize>> = seqs()
            .map(|s| {
                let n = s.tokens.len();
                match s.want {
                    Logits::None => None,
                    Logits::Last => Some(n - 1),
                    Logits::From(i) => Some(i.min(n - 1)),
                }
            })
            .collect();
        let mut step = Step {
            cfg,
            pool,
            tables: seqs().map(|s| s.table).collect(),
            starts: seqs().map(|s| s.start).collect(),
            segs: lens.clone(),
            lens,
            out_first,
            positions,
            rope,
            rope_swa,
        };

        // x: [T, n_embd], the embedding rows (dequantized exactly).
        let e = cfg.n_embd;
        let mut x = Buf::zeros(t * e);
        let embd = &self.weights.token_embd;
        profile::record("get_rows", "token_embd", 0.0, (8 * t * e) as f64, || {
            let tokens = seqs().flat_map(|s| s.tokens.iter());
            for (row, &id) in x.chunks_exact_mut(e).zip(tokens) {
                embd.get_row(id as usize, row);
            }
        });

        if cfg.arch.is_gemma() {
            // Gemma scales the embeddings by sqrt(n_embd).
            scale(&mut x, (e as f32).sqrt());
            trace("inp_scaled", None, &x, e);
        }
        for (il, layer) in self.weights.layers.iter().enumerate() {
            layer.forward(il, &mut step, &mut x);
        }

        // The last layer kept only the rows that need logits, `step.segs` of them per sequence.
        let n_out: usize = step.segs.iter().sum();
        let logits = if n_out == 0 {
            Buf::default()
        } else {
            let h = rms_norm(&x, &self.weights.output_norm, cfg.rms_eps);
            trace("result_norm", None, &h, e);
            let mut logits = self.weights.output.forward(&h, &step.segs);
            if let Some(c) = cfg.final_softcap {
                // As llama.cpp: scale by 1/cap, tanh, scale by cap.
                let inv = 1.0 / c;
                for x in logits.iter_mut() {
                    *x = (*x * inv).tanh() * c;
                }
            }
            trace("result_output", None, &logits, cfg.n_vocab);
            logits
        };
        Ok((logits, step.segs))
    }
}
