//! The KV cache, paged (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
//! Serving with PagedAttention"): one pool of fixed-size blocks per model, K and V rows stored as
//! `Config::kv_type` (f16 by default, as llama.cpp's cache; f32, Q8_0 or Q4_0 as its `-ctk/-ctv`).
//! A sequence owns a block table: logical position `j` lives in row `j % block_size` of block
//! `table[j / block_size]`. Which blocks a sequence holds, and which sequences share a prefix's
//! blocks, is the server's business; the model only reads and writes rows through the tables it
//! is given.
//!
//! [`KvCache`] is the single-sequence case: a pool of its own with the identity table.

use ferrum_core::{DType, Error, Result};
use ferrum_kernels::attention::{KvRows, PagedKv};
use ferrum_kernels::quant;
use half::f16;
use half::slice::HalfFloatSliceExt;
use half::vec::HalfBitsVecExt;

use super::config::Config;

/// Rows per block of a [`KvCache`] (any power of two gives the same results).
const OWN_BLOCK: usize = 16;

/// One layer's K or V rows, in the cache's storage type.
enum Rows {
    F16(Vec<f16>),
    F32(Vec<f32>),
    /// Q8_0 or Q4_0 rows, `row_bytes` each.
    Blocks(DType, Vec<u8>),
}

impl Rows {
    /// `n` rows of `row_len` values, zeroed. Zeroed allocations come from `calloc`: large ones
    /// are fresh pages the OS commits on first write, so the pool holds memory only for the
    /// blocks in use. (`vec![f16::ZERO; n]` would write every element.)
    fn zeroed(dtype: DType, n: usize, row_len: usize) -> Rows {
        match dtype {
            DType::F16 => Rows::F16(vec![0u16; n * row_len].reinterpret_into()),
            DType::F32 => Rows::F32(vec![0f32; n * row_len]),
            t => Rows::Blocks(
                t,
                vec![0u8; n * t.row_bytes(row_len).expect("whole blocks")],
            ),
        }
    }

    /// Writes `x` (one row) as row `r`: f16 rounded to nearest even (F16C where the CPU has it),
    /// f32 as is, block types quantized as llama.cpp writes its cache (`quantize_row`).
    fn put(&mut self, r: usize, x: &[f32]) {
        let d = x.len();
        match self {
            Rows::F16(c) => c[r * d..(r + 1) * d].convert_from_f32_slice(x),
            Rows::F32(c) => c[r * d..(r + 1) * d].copy_from_slice(x),
            Rows::Blocks(t, c) => {
                let rb = t.row_bytes(d).expect("whole blocks");
                quant::quantize_row(*t, x, &mut c[r * rb..(r + 1) * rb]);
            }
        }
    }

    fn view(&self) -> KvRows<'_> {
        match self {
            Rows::F16(c) => KvRows::F16(c),
            Rows::F32(c) => KvRows::F32(c),
            Rows::Blocks(t, c) => KvRows::Blocks(*t, c),
        }
    }
}

/// The storage types a KV cache may have (llama.cpp's `-ctk/-ctv` choices ferrum implements).
pub const KV_TYPES: [DType; 4] = [DType::F32, DType::F16, DType::Q8_0, DType::Q4_0];

/// Checks that `cfg`'s KV rows can be stored as `cfg.kv_type`.
pub fn check_kv_type(cfg: &Config) -> Result<()> {
    let t = cfg.kv_type;
    if !KV_TYPES.contains(&t) {
        return Err(Error::msg(format!(
            "KV cache type {t} is not supported (f32, f16, q8_0, q4_0)"
        )));
    }
    if !cfg.head_dim.is_multiple_of(t.block_size()) {
        return Err(Error::msg(format!(
            "KV cache type {t} needs a head dimension that is a multiple of {}; this model's is {}",
            t.block_size(),
            cfg.head_dim
        )));
    }
    Ok(())
}

pub struct KvPool {
    block_size: usize,
    n_blocks: usize,
    kv_dim: usize,
    dtype: DType,
    /// Per layer: K then V, each [n_blocks * block_size, kv_dim].
    layers: Vec<(Rows, Rows)>,
    /// The most positions one sequence may reach (RoPE scalings that depend on the context,
    /// LongRoPE, choose by it): the whole pool unless set.
    seq_context: usize,
}

impl KvPool {
    /// A pool of `n_blocks` blocks of `block_size` positions (a power of two) for `cfg`'s layers,
    /// its rows stored as `cfg.kv_type`. Its memory is reserved, not touched: pages are committed
    /// as blocks are first written.
    pub fn new(cfg: &Config, n_blocks: usize, block_size: usize) -> Result<Self> {
        if !block_size.is_power_of_two() {
            return Err(Error::msg(format!(
                "KV block size {block_size} is not a power of two"
            )));
        }
        if n_blocks > u32::MAX as usize {
            return Err(Error::msg(format!("{n_blocks} KV blocks is too many")));
        }
        check_kv_type(cfg)?;
        let kv_dim = cfg.kv_dim();
        let rows = n_blocks
            .checked_mul(block_size)
            .filter(|r| r.checked_mul(Self::row_bytes(cfg)).is_some())
            .ok_or_else(|| Error::msg("KV pool size overflows"))?;
        let t = cfg.kv_type;
        Ok(Self {
            block_size,
            n_blocks,
            kv_dim,
            dtype: t,
            layers: (0..cfg.n_layer)
                .map(|_| (Rows::zeroed(t, rows, kv_dim), Rows::zeroed(t, rows, kv_dim)))
                .collect(),
            seq_context: rows,
        })
    }

    /// Sets the most positions one sequence may reach (a server's context size, below the
    /// pool's capacity when the pool holds several sequences).
    pub fn set_seq_context(&mut self, n_ctx: usize) {
        self.seq_context = n_ctx;
    }

    /// The most positions one sequence may reach ([`KvPool::set_seq_context`]).
    pub fn seq_context(&self) -> usize {
        self.seq_context
    }

    /// Bytes of one K (or V) row of one layer in `cfg.kv_type`.
    fn row_bytes(cfg: &Config) -> usize {
        cfg.kv_type
            .row_bytes(cfg.kv_dim())
            .unwrap_or(cfg.kv_dim() * 4)
    }

    /// Bytes one position takes over all layers (K and V), in `cfg.kv_type`.
    pub fn bytes_per_token(cfg: &Config) -> usize {
        cfg.n_layer * 2 * Self::row_bytes(cfg)
    }

    /// Bytes one block takes over all layers (K and V).
    pub fn block_bytes(cfg: &Config, block_size: usize) -> usize {
        block_size * Self::bytes_per_token(cfg)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    /// The storage type of its rows.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes held.
    pub fn n_bytes(&self) -> usize {
        let row = self.dtype.row_bytes(self.kv_dim).unwrap_or(0);
        self.n_blocks * self.block_size * row * 2 * self.layers.len()
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
            let r = table[j / bs] as usize * bs + j % bs;
            kc.put(r, kr);
            vc.put(r, vr);
        }
    }

    /// Layer `il` as the attention kernel reads it for the sequence whose blocks `table` lists.
    pub fn layer<'a>(&'a self, il: usize, table: &'a [u32]) -> PagedKv<'a> {
        let (k, v) = &self.layers[il];
        PagedKv {
            k: k.view(),
            v: v.view(),
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
