//! Rotary position embedding (Su et al. 2021, "RoFormer").
//!
//! Dimension pair i of a head rotates by theta = pos * base^(-2i/n_rot). Two pairings exist:
//! [`RopeStyle::Norm`] rotates consecutive values (2i, 2i+1) (GGUF Llama, whose Q/K rows the
//! converter permuted), [`RopeStyle::Neox`] rotates (i, i + n_rot/2) (Hugging Face's rotate-half,
//! Gemma, Qwen2).

/// Which dimensions form a rotated pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    Norm,
    Neox,
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
        assert!(n_rot.is_multiple_of(2), "rope: n_rot must be even");
        let theta_scale = base.powf(-2.0 / n_rot as f32);
        let mut cos_sin = ferrum_core::Buf::with_capacity(positions.len() * n_rot);
        for &p in positions {
            let mut theta = p as f32;
            for _ in 0..n_rot / 2 {
                cos_sin.extend_from_slice(&[theta.cos(), theta.sin()]);
                theta *= theta_scale;
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
}
