//! The KV cache, paged (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
//! Serving with PagedAttention"): one pool of fixed-size blocks per model, K and V rows stored in
//! f16 as llama.cpp's default cache is. A sequence owns a block table: logical position `j` lives
//! in row `j % block_size` of block `table[j / block_size]`. Which blocks a sequence holds, and
//! which sequences share a prefix's blocks, is the server's business; the model only reads and
//! writes rows through the tables it is given.
//!
//! [`KvCache`] is the single-sequence case: a pool of its own with the identity table.

use ferrum_core::{Error, Result};
use ferrum_kernels::attention::PagedKv;
use half::f16;
use half::slice::HalfFloatSliceExt;
use half::vec::HalfBitsVecExt;

use super::config::Config;

/// Rows per block of a [`KvCache`] (any power of two gives the same results).
const OWN_BLOCK: usize = 16;

pub struct KvPool {
    block_size: usize,
    n_blocks: usize,
    kv_dim: usize,
    /// Per layer: K then V, each [n_blocks * block_size, kv_dim].
    layers: Vec<(Vec<f16>, Vec<f16>)>,
}

impl KvPool {
    /// A pool of `n_blocks` blocks of `block_size` positions (a power of two) for `cfg`'s layers.
    /// Its memory is reserved, not touched: pages are committed as blocks are first written.
    pub fn new(cfg: &Config, n_blocks: usize, block_size: usize) -> Result<Self> {
        if !block_size.is_power_of_two() {
            return Err(Error::msg(format!(
                "KV block size {block_size} is not a power of two"
            )));
        }
        if n_blocks > u32::MAX as usize {
            return Err(Error::msg(format!("{n_blocks} KV blocks is too many")));
        }
        let kv_dim = cfg.kv_dim();
        let rows = n_blocks
            .checked_mul(block_size)
            .and_then(|r| r.checked_mul(kv_dim))
            .ok_or_else(|| Error::msg("KV pool size overflows"))?;
        Ok(Self {
            block_size,
            n_blocks,
            kv_dim,
            // Zeroed allocations of u16 come from `calloc`: large ones are fresh pages the OS
            // commits on first write, so the pool holds memory only for the blocks in use.
            // (`vec![f16::ZERO; n]` would write every element.)
            layers: (0..cfg.n_layer)
                .map(|_| {
                    let zeros = || -> Vec<f16> { vec![0u16; rows].reinterpret_into() };
                    (zeros(), zeros())
                })
                .collect(),
        })
    }

    /// Bytes one block takes over all layers (K and V).
    pub fn block_bytes(cfg: &Config, block_size: usize) -> usize {
        cfg.n_layer * 2 * block_size * cfg.kv_dim() * std::mem::size_of::<f16>()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    /// Bytes held.
    pub fn n_bytes(&self) -> usize {
        self.n_blocks * self.block_size * self.kv_dim * 2 * self.layers.len() * 2
    }

    /// Positions a block table of `n` blocks covers.
    pub fn capacity_of(&self, table: &[u32]) -> usize {
        table.len() * self.block_size
    }

    /// Checks that `table` names blocks of this pool.
    pub fn check_table(&self, table: &[u32]) -> Result<()> {
        match table.iter().find(|&&b| b as usize >= self.n_blocks) {
            Some(b) => Err(Error::msg(format!(
                "block table names block {b} of a pool of {}",
                self.n_blocks
            ))),
            None => Ok(()),
        }
    }

    /// Writes K and V rows ([T, kv_dim] each) for logical positions `start..start+T` of layer
    /// `il` of the sequence whose blocks `table` lists.
    pub fn store(&mut self, il: usize, table: &[u32], start: usize, k: &[f32], v: &[f32]) {
        let (kc, vc) = &mut self.layers[il];
        let (d, bs) = (self.kv_dim, self.block_size);
        for (t, (kr, vr)) in k.chunks_exact(d).zip(v.chunks_exact(d)).enumerate() {
            let j = start + t;
            let at = (table[j / bs] as usize * bs + j % bs) * d;
            // Round to nearest even, as `f16::from_f32` (F16C where the CPU has it).
            kc[at..at + d].convert_from_f32_slice(kr);
            vc[at..at + d].convert_from_f32_slice(vr);
        }
    }

    /// Layer `il` as the attention kernel reads it for the sequence whose blocks `table` lists.
    pub fn layer<'a>(&'a self, il: usize, table: &'a [u32]) -> PagedKv<'a> {
        let (k, v) = &self.layers[il];
        PagedKv {
            k,
            v,
            table,
            block_size: self.block_size,
        }
    }
}

/// The cache of one sequence that has the model to itself (`generate`, `perplexity`, benches):
/// a pool of its own, its blocks in order.
pub struct KvCache {
    pub(crate) pool: KvPool,
    pub(crate) table: Vec<u32>,
}

impl KvCache {
    pub fn new(cfg: &Config, capacity: usize) -> Self {
        let n_blocks = capacity.max(1).div_ceil(OWN_BLOCK);
        let pool = KvPool::new(cfg, n_blocks, OWN_BLOCK).expect("a KV cache of a sane size");
        Self {
            pool,
            table: (0..n_blocks as u32).collect(),
        }
    }

    /// Positions the cache can hold.
    pub fn capacity(&self) -> usize {
        self.pool.capacity_of(&self.table)
    }

    /// Bytes held.
    pub fn n_bytes(&self) -> usize {
        self.pool.n_bytes()
    }
}
