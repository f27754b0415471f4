//! Rotary position embedding (Su et al. 2021, "RoFormer").
//!
//! Dimension pair i of a head rotates by theta = pos * base^(-2i/n_rot). Two pairings exist:
//! [`RopeStyle::Norm`] rotates consecutive values (2i, 2i+1) (GGUF Llama, whose Q/K rows the
//! converter permuted), [`RopeStyle::Neox`] rotates (i, i + n_rot/2) (Hugging Face's rotate-half,
//! Gemma, Qwen2).
//!
//! Context extension ([`RopeScaling`]) changes the angles as ggml's `rope_yarn` does: per-pair
//! frequency factors divide theta (Llama 3's `rope_freqs`, LongRoPE), linear scaling multiplies it
//! by `freq_scale = 1/factor`, and YaRN (Peng et al. 2023) blends the interpolated and the original
//! angle per pair by a ramp over the correction dims and scales cos/sin by `attn_factor (1 + 0.1 ln
//! factor)`. With no scaling every step is an exact identity, so unscaled models keep their bits.

/// Which dimensions form a rotated pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    Norm,
    Neox,
}

/// How a model stretches its RoPE past the context it was trained on (ggml's `rope_ext` settings).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeScaling {
    /// Multiplies every angle: 1/factor for linear and YaRN scaling, else 1.
    pub freq_scale: f32,
    /// Per-pair divisors of theta (`n_rot/2` of them), e.g. Llama 3's `rope_freqs.weight`.
    pub freq_factors: Option<Vec<f32>>,
    /// YaRN's blend, when the model asks for it.
    pub yarn: Option<Yarn>,
}

impl Default for RopeScaling {
    fn default() -> Self {
        Self {
            freq_scale: 1.0,
            freq_factors: None,
            yarn: None,
        }
    }
}

impl RopeScaling {
    /// Whether angles differ from plain RoPE.
    pub fn is_identity(&self) -> bool {
        self.freq_scale == 1.0 && self.freq_factors.is_none() && self.yarn.is_none()
    }
}

/// YaRN ("Efficient Context Window Extension of Large Language Models", Peng et al. 2023).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// Weight of the extrapolated angle in the ramp (ggml's `ext_factor`, 1 for YaRN).
    pub ext_factor: f32,
    /// Extra scale of cos/sin (ggml's `attn_factor`, usually 1).
    pub attn_factor: f32,
    /// The training context the correction dims are computed for.
    pub n_ctx_orig: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

impl Yarn {
    /// The pair range [low, high] over which the ramp runs (ggml's `ggml_rope_yarn_corr_dims`).
    pub fn corr_dims(&self, n_rot: usize, base: f32) -> [f32; 2] {
        let dim = |n_rotations: f32| -> f32 {
            n_rot as f32
                * (self.n_ctx_orig as f32 / (n_rotations * 2.0 * std::f32::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        let start = dim(self.beta_fast).floor();
        let end = dim(self.beta_slow).ceil();
        [start.max(0.0), end.min(n_rot as f32 - 1.0)]
    }
}

/// cos/sin of every (position, pair) used by one forward pass.
pub struct RopeCache {
    n_rot: usize,
    style: RopeStyle,
    /// [positions, n_rot/2] pairs of (cos, sin), interleaved (a recycled buffer: building one
    /// per step allocates nothing once warm).
    cos_sin: ferrum_core::Buf,
}

impl RopeCache {
    /// As ggml: theta_scale = powf(base, -2/n_rot), theta_0 = pos, theta_{i+1} = theta_i * theta_scale
    /// (iterated f32 products), then cosf/sinf.
    pub fn new(positions: &[usize], n_rot: usize, base: f32, style: RopeStyle) -> Self {
        Self::scaled(positions, n_rot, base, style, &RopeScaling::default())
    }

    /// [`RopeCache::new`] with context-extension `scaling`, in ggml's order: for pair i,
    /// theta_extrap = theta_i / freq_factor[i], theta_interp = freq_scale * theta_extrap; with
    /// YaRN theta = theta_interp (1 - ramp_i) + theta_extrap ramp_i and cos/sin scaled by mscale.
    pub fn scaled(
        positions: &[usize],
        n_rot: usize,
        base: f32,
        style: RopeStyle,
        scaling: &RopeScaling,
    ) -> Self {
        assert!(n_rot.is_multiple_of(2), "rope: n_rot must be even");
        if let Some(ff) = &scaling.freq_factors {
            assert_eq!(ff.len(), n_rot / 2, "rope: one frequency factor per pair");
        }
        let theta_scale = base.powf(-2.0 / n_rot as f32);
        let corr = scaling.yarn.map(|y| y.corr_dims(n_rot, base));
        let mut cos_sin = ferrum_core::Buf::with_capacity(positions.len() * n_rot);
        for &p in positions {
            let mut theta_base = p as f32;
            for i in 0..n_rot / 2 {
                let ff = scaling.freq_factors.as_ref().map_or(1.0, |f| f[i]);
                let theta_extrap = theta_base / ff;
                let theta_interp = scaling.freq_scale * theta_extrap;
                let (theta, mscale) = match (scaling.yarn, corr) {
                    (Some(y), Some([low, high])) if y.ext_factor != 0.0 => {
                        let r = (i as f32 - low) / (high - low).max(0.001);
                        let ramp_mix = (1.0 - r.clamp(0.0, 1.0)) * y.ext_factor;
                        let theta = theta_interp * (1.0 - ramp_mix) + theta_extrap * ramp_mix;
                        let m = y.attn_factor * (1.0 + 0.1 * (1.0 / scaling.freq_scale).ln());
                        (theta, m)
                    }
                    (Some(y), _) => (theta_interp, y.attn_factor),
                    _ => (theta_interp, 1.0),
                };
                cos_sin.extend_from_slice(&[theta.cos() * mscale, theta.sin() * mscale]);
                theta_base *= theta_scale;
            }
        }
        Self {
            n_rot,
            style,
            cos_sin,
        }
    }

    /// Rotates `x`, laid out [positions, heads, head_dim], in place; dims past n_rot pass through.
    pub fn apply(&self, x: &mut [f32], n_heads: usize, head_dim: usize) {
        let half = self.n_rot / 2;
        let n_pos = self.cos_sin.len() / (2 * half).max(1);
        assert_eq!(x.len(), n_pos * n_heads * head_dim, "rope: shape differs");
        assert!(self.n_rot <= head_dim, "rope: n_rot exceeds head_dim");
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::features().fma {
            // SAFETY: the CPU reports FMA.
            unsafe { self.apply_fma(x, n_heads, head_dim) };
            return;
        }
        self.apply_generic(x, n_heads, head_dim);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "fma")]
    unsafe fn apply_fma(&self, x: &mut [f32], n_heads: usize, head_dim: usize) {
        self.apply_generic(x, n_heads, head_dim)
    }

    /// The rotation as ggml's compiled code evaluates it: GCC contracts `x0*c - x1*s` into
    /// `fma(x0, c, -(x1*s))` and `x0*s + x1*c` into `fma(x0, s, x1*c)`, and we do the same so the
    /// rotated values agree bit for bit.
    #[inline(always)]
    fn apply_generic(&self, x: &mut [f32], n_heads: usize, head_dim: usize) {
        let half = self.n_rot / 2;
        for (t, row) in x.chunks_exact_mut(n_heads * head_dim).enumerate() {
            let cs = &self.cos_sin[2 * t * half..2 * (t + 1) * half];
            for head in row.chunks_exact_mut(head_dim) {
                for (i, cs) in cs.chunks_exact(2).enumerate() {
                    let (c, s) = (cs[0], cs[1]);
                    let (a, b) = match self.style {
                        RopeStyle::Norm => (2 * i, 2 * i + 1),
                        RopeStyle::Neox => (i, i + half),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0.mul_add(c, -(x1 * s));
                    head[b] = x0.mul_add(s, x1 * c);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_f64_reference_for_both_styles() {
        let (heads, hd, base) = (3, 16, 10000.0f32);
        let positions = [0usize, 1, 7, 300];
        for style in [RopeStyle::Norm, RopeStyle::Neox] {
            let x: Vec<f32> = (0..positions.len() * heads * hd)
                .map(|i| ((i * 7919 % 103) as f32 / 51.5) - 1.0)
                .collect();
            let mut y = x.clone();
            RopeCache::new(&positions, hd, base, style).apply(&mut y, heads, hd);
            for (t, &p) in positions.iter().enumerate() {
                for h in 0..heads {
                    let o = (t * heads + h) * hd;
                    for i in 0..hd / 2 {
                        let theta = p as f64 * (base as f64).powf(-2.0 * i as f64 / hd as f64);
                        let (a, b) = match style {
                            RopeStyle::Norm => (2 * i, 2 * i + 1),
                            RopeStyle::Neox => (i, i + hd / 2),
                        };
                        let (x0, x1) = (x[o + a] as f64, x[o + b] as f64);
                        let ra = x0 * theta.cos() - x1 * theta.sin();
                        let rb = x0 * theta.sin() + x1 * theta.cos();
                        // Iterated f32 theta drifts ~1e-7 relative per step; at pos 300 that is ~1e-4 rad.
                        let tol = 1e-5 + 5e-7 * p as f64;
                        assert!((y[o + a] as f64 - ra).abs() < tol, "{style:?} p{p} i{i}");
                        assert!((y[o + b] as f64 - rb).abs() < tol, "{style:?} p{p} i{i}");
                    }
                }
            }
        }
    }

    /// Linear, per-pair factor, YaRN and LongRoPE scaling against the formulas as Hugging Face
    /// writes them (`_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`,
    /// `_compute_yarn_parameters`, `_compute_longrope_parameters`), in f64: inverse frequencies per pair, angle = pos * inv_freq,
    /// cos/sin times the attention factor.
    #[test]
    fn scaled_matches_f64_formulas() {
        let (n_rot, base) = (32usize, 500000.0f32);
        let positions = [0usize, 1, 5, 63, 200, 1000];
        let inv_freq = |i: usize| (base as f64).powf(-2.0 * i as f64 / n_rot as f64);
        // Llama 3: factor 8, low 1, high 4, original context 64.
        let (factor, low_ff, high_ff, orig) = (8.0f64, 1.0f64, 4.0f64, 64.0f64);
        let llama3: Vec<f64> = (0..n_rot / 2)
            .map(|i| {
                let f = inv_freq(i);
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < orig / high_ff {
                    1.0
                } else if wavelen > orig / low_ff {
                    factor
                } else {
                    let smooth = (orig / wavelen - low_ff) / (high_ff - low_ff);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                }
            })
            .collect();
        assert!(llama3.contains(&1.0) && llama3.contains(&factor));
        assert!(
            llama3.iter().any(|&f| f > 1.0 && f < factor),
            "smoothed band exercised"
        );
        // YaRN: factor 4, original context 64, beta_fast 32, beta_slow 1.
        let yarn = Yarn {
            ext_factor: 1.0,
            attn_factor: 1.0,
            n_ctx_orig: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
        };
        let yarn_inv = |i: usize| -> f64 {
            let d = |rot: f64| {
                n_rot as f64 * (64.0 / (rot * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * (base as f64).ln())
            };
            let (low, high) = (
                d(32.0).floor().max(0.0),
                d(1.0).ceil().min(n_rot as f64 - 1.0),
            );
            let ramp = ((i as f64 - low) / (high - low).max(0.001)).clamp(0.0, 1.0);
            let extrap_w = 1.0 - ramp;
            inv_freq(i) / 4.0 * (1.0 - extrap_w) + inv_freq(i) * extrap_w
        };
        // LongRoPE (`_compute_longrope_parameters`): per-pair divisors, cos/sin times
        // sqrt(1 + ln(s) / ln(orig)) for s = 8, orig 64, no ramp (ggml's ext_factor 0).
        let long: Vec<f64> = (0..n_rot / 2).map(|i| 1.0 + 0.7 * i as f64).collect();
        let long_m = (1.0 + 8f64.ln() / 64f64.ln()).sqrt();
        let longrope = Yarn {
            ext_factor: 0.0,
            attn_factor: long_m as f32,
            ..yarn
        };
        type Case<'a> = (RopeScaling, Box<dyn Fn(usize) -> f64 + 'a>, f64);
        let cases: Vec<Case> = vec![
            (
                RopeScaling {
                    freq_scale: 0.25,
                    ..Default::default()
                },
                Box::new(|i| inv_freq(i) / 4.0),
                1.0,
            ),
            (
                RopeScaling {
                    freq_factors: Some(llama3.iter().map(|&f| f as f32).collect()),
                    ..Default::default()
                },
                Box::new(|i| inv_freq(i) / llama3[i]),
                1.0,
            ),
            (
                RopeScaling {
                    freq_scale: 0.25,
                    freq_factors: None,
                    yarn: Some(yarn),
                },
                Box::new(yarn_inv),
                1.0 + 0.1 * 4f64.ln(),
            ),
            (
                RopeScaling {
                    freq_scale: 1.0,
                    freq_factors: Some(long.iter().map(|&f| f as f32).collect()),
                    yarn: Some(longrope),
                },
                Box::new(|i| inv_freq(i) / long[i]),
                long_m,
            ),
        ];
        for (scaling, inv, mscale) in &cases {
            let c = RopeCache::scaled(&positions, n_rot, base, RopeStyle::Neox, scaling);
            for (t, &p) in positions.iter().enumerate() {
                for i in 0..n_rot / 2 {
                    let theta = p as f64 * inv(i);
                    let (cos, sin) = (
                        c.cos_sin[t * n_rot + 2 * i],
                        c.cos_sin[t * n_rot + 2 * i + 1],
                    );
                    let tol = 1e-5 + 5e-7 * p as f64;
                    assert!(
                        (cos as f64 - theta.cos() * mscale).abs() < tol,
                        "{scaling:?} p{p} i{i}"
                    );
                    assert!(
                        (sin as f64 - theta.sin() * mscale).abs() < tol,
                        "{scaling:?} p{p} i{i}"
                    );
                }
            }
        }
        // No scaling is the same bits as plain RoPE.
        let plain = RopeCache::new(&positions, n_rot, base, RopeStyle::Norm);
        let ident = RopeCache::scaled(
            &positions,
            n_rot,
            base,
            RopeStyle::Norm,
            &RopeScaling::default(),
        );
        assert_eq!(plain.cos_sin.to_vec(), ident.cos_sin.to_vec());
    }
}
