//! Decoder-only transformers. One file per architecture ([`llama`], [`gemma3`]) holds its block as
//! the paper writes it; the pieces they share (projections, RoPE, cached attention) live here.

pub mod config;
pub mod gemma3;
pub mod kv_cache;
pub mod llama;
pub mod weights;

use ferrum_core::{Error, Result};
use ferrum_kernels::attention::{attention, AttnParams};
use ferrum_kernels::matmul;
use ferrum_kernels::ops::{self, RopeCache};

pub use config::{Arch, Config};
pub use kv_cache::KvCache;
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

/// State shared by the layers of one forward pass.
pub struct Step<'a> {
    pub cfg: &'a Config,
    pub cache: &'a mut KvCache,
    /// Position of each token of the batch.
    pub positions: Vec<usize>,
    pub rope: RopeCache,
    /// RoPE of sliding-window layers, when their base differs (Gemma 3).
    pub rope_swa: Option<RopeCache>,
    /// First batch row whose output is needed (`None`: no row). As llama.cpp does, the last layer
    /// runs its feed-forward block only on those rows.
    pub out_first: Option<usize>,
}

impl Step<'_> {
    pub fn n_tokens(&self) -> usize {
        self.positions.len()
    }

    /// In the last layer, drops the rows of `x` (the residual stream, [T, n_embd]) and `a` (the
    /// attention output before its projection, [T, n_head * head_dim]) that no logits need. As in
    /// llama.cpp this happens before the output projection, so that projection (and the FFN) runs
    /// only on the kept rows.
    pub fn keep_output_rows(&self, il: usize, x: &mut Vec<f32>, a: &mut Vec<f32>) {
        if il + 1 != self.cfg.n_layer {
            return;
        }
        let first = self.out_first.unwrap_or(self.n_tokens());
        x.drain(..first * self.cfg.n_embd);
        a.drain(..first * self.cfg.q_dim());
    }

    /// Writes this batch's K/V into layer `il`'s cache, then attends every query to the cached
    /// keys up to its own position (`window` limits how far back). `q`: [T, n_head*head_dim].
    pub fn attend(
        &mut self,
        il: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        scale: f32,
        window: Option<usize>,
    ) -> Vec<f32> {
        let cfg = self.cfg;
        self.cache.store(il, self.positions[0], k, v);
        let (kc, vc) = self.cache.layer(il);
        let p = AttnParams {
            n_head: cfg.n_head,
            n_head_kv: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            scale,
            window,
        };
        let mut out = vec![0f32; q.len()];
        attention(&p, q, kc, vc, &self.positions, &mut out);
        out
    }
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
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    ops::rms_norm(x, w, eps, &mut y);
    y
}

impl Model {
    pub fn new(config: Config, weights: Weights) -> Self {
        Self { config, weights }
    }

    /// Runs `tokens` at positions `start..start+T` (the cache must hold `0..start`), and returns
    /// logits [n, n_vocab] for the positions `want` selects.
    pub fn forward(
        &self,
        tokens: &[u32],
        start: usize,
        cache: &mut KvCache,
        want: Logits,
    ) -> Result<Vec<f32>> {
        let cfg = &self.config;
        let t = tokens.len();
        if t == 0 {
            return Ok(Vec::new());
        }
        if start + t > cache.capacity() {
            return Err(Error::msg(format!(
                "context of {} tokens exceeded ({} cached + {t} new): raise --ctx-size",
                cache.capacity(),
                start
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= cfg.n_vocab) {
            return Err(Error::msg(format!(
                "token id {bad} is outside the vocabulary of {}",
                cfg.n_vocab
            )));
        }
        let positions: Vec<usize> = (start..start + t).collect();
        let rope = RopeCache::new(&positions, cfg.n_rot, cfg.rope_base, cfg.rope_style);
        let rope_swa = (cfg.sliding_window.is_some() && cfg.rope_base_swa != cfg.rope_base)
            .then(|| RopeCache::new(&positions, cfg.n_rot, cfg.rope_base_swa, cfg.rope_style));
        let out_first = match want {
            Logits::None => None,
            Logits::Last => Some(t - 1),
            Logits::From(i) => Some(i.min(t - 1)),
        };
        let mut step = Step {
            cfg,
            cache,
            positions,
            rope,
            rope_swa,
            out_first,
        };

        // x: [T, n_embd], the embedding rows (dequantized exactly).
        let e = cfg.n_embd;
        let mut x = vec![0f32; t * e];
        let embd = weights_ref(&self.weights.token_embd, e, cfg.n_vocab);
        for (row, &id) in x.chunks_exact_mut(e).zip(tokens) {
            matmul::get_row(&embd, id as usize, row);
        }

        match cfg.arch {
            Arch::Llama | Arch::Qwen2 => llama::forward(&self.weights, &mut step, &mut x),
            Arch::Gemma3 => gemma3::forward(&self.weights, &mut step, &mut x),
        }

        // The last layer kept only the rows that need logits.
        if out_first.is_none() {
            return Ok(Vec::new());
        }
        let h = rms_norm(&x, &self.weights.output_norm, cfg.rms_eps);
        trace("result_norm", None, &h, e);
        let logits = self.weights.output.forward(&h);
        trace("result_output", None, &logits, cfg.n_vocab);
        Ok(logits)
    }
}

fn weights_ref(t: &RawTensor, cols: usize, rows: usize) -> matmul::WeightRef<'_> {
    matmul::WeightRef {
        dtype: t.dtype,
        rows,
        cols,
        data: &t.data,
    }
}
