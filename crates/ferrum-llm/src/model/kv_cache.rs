//! Per-sequence KV cache: for each layer, K and V rows of every position, stored in f16 as
//! llama.cpp's default cache is.

use half::f16;

use super::config::Config;

pub struct KvCache {
    /// Positions the cache can hold.
    capacity: usize,
    kv_dim: usize,
    /// Per layer: K then V, each [capacity, kv_dim].
    layers: Vec<(Vec<f16>, Vec<f16>)>,
}

impl KvCache {
    pub fn new(cfg: &Config, capacity: usize) -> Self {
        let kv_dim = cfg.kv_dim();
        Self {
            capacity,
            kv_dim,
            layers: (0..cfg.n_layer)
                .map(|_| {
                    (
                        vec![f16::ZERO; capacity * kv_dim],
                        vec![f16::ZERO; capacity * kv_dim],
                    )
                })
                .collect(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Writes K and V rows ([T, kv_dim] each) for positions `start..start+T` of layer `il`.
    pub fn store(&mut self, il: usize, start: usize, k: &[f32], v: &[f32]) {
        let (kc, vc) = &mut self.layers[il];
        let at = start * self.kv_dim;
        for (dst, &x) in kc[at..at + k.len()].iter_mut().zip(k) {
            *dst = f16::from_f32(x);
        }
        for (dst, &x) in vc[at..at + v.len()].iter_mut().zip(v) {
            *dst = f16::from_f32(x);
        }
    }

    pub fn layer(&self, il: usize) -> (&[f16], &[f16]) {
        let (k, v) = &self.layers[il];
        (k, v)
    }

    /// Bytes held.
    pub fn n_bytes(&self) -> usize {
        self.layers.len() * 2 * self.capacity * self.kv_dim * 2
    }
}
