//! Causal scaled-dot-product attention over an f16 KV cache, one query row at a time with an online
//! softmax (running max and sum; Milakov & Gimelshein 2018, FlashAttention's recurrence), so no
//! score matrix is materialised. Grouped-query attention: query head h reads KV head h / (n_head / n_head_kv).
//!
//! Numerics follow llama.cpp's CPU flash-attention path: Q is rounded to f16 (K is f16 in the cache),
//! dot products and softmax run in f32, and the V.p accumulator is f16.
//!
//! The cache may also hold f32, Q8_0 or Q4_0 rows (llama.cpp's `-ctk/-ctv`, [`KvRows`]); then, as
//! llama.cpp does, Q is converted to K's dot format (f32 as is, Q8_0 for the quantized types),
//! each score is that type's dot product, and V rows are converted to f32 and accumulated in an
//! f32 accumulator (`VKQ32`) by FMA. Those caches run the portable kernel.

use ferrum_core::DType;
use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::ops::{expf, expf_slice};
use crate::{pool, quant};

/// Shape and masking of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnParams<'a> {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Multiplies q.k (1/sqrt(head_dim) for Llama; 1 for Gemma 3, which pre-scales Q).
    pub scale: f32,
    /// Sliding window: a query at position p sees keys p-window+1 ..= p. `None`: all earlier keys.
    pub window: Option<usize>,
    /// Logit soft-capping (Gemma 2): each score s = scale q.k becomes cap * tanh(s / cap), computed
    /// as llama.cpp's flash attention does, cap * tanh(q.k (scale / cap)).
    pub softcap: Option<f32>,
    /// Attention sinks (gpt-oss): per query head a learned logit that joins the softmax's
    /// denominator with no value row, so a head can attend to "nothing". Applied as llama.cpp's
    /// flash attention does, after the keys ([`join_sink`]).
    pub sinks: Option<&'a [f32]>,
}

/// Joins a sink logit to a finished online softmax (running max `m`, sum `s`), as llama.cpp's
/// flash attention does after the last key: with `sink > m` the sum is rescaled by
/// `ms = exp(m - sink)` plus 1 and `ms` is returned (the accumulator must be scaled by it, in
/// f32); otherwise `s + exp(sink - m)`. `S = fma(S, ms, vs)` either way.
#[inline(always)]
fn join_sink(sink: Option<f32>, m: f32, s: &mut f32) -> Option<f32> {
    let sk = sink?;
    if sk > m {
        let ms = expf(m - sk);
        *s = s.mul_add(ms, 1.0);
        Some(ms)
    } else {
        *s = s.mul_add(1.0, expf(sk - m));
        None
    }
}

/// A score after soft-capping: `x` is q.k times the row's scale (already divided by the cap).
#[inline(always)]
fn capped(x: f32, softcap: Option<f32>) -> f32 {
    match softcap {
        Some(c) => c * x.tanh(),
        None => x,
    }
}

/// One layer's K or V rows as a cache stores them: `n_head_kv * head_dim` values a row.
#[derive(Clone, Copy, Debug)]
pub enum KvRows<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
    /// A block-quantized type (Q8_0, Q4_0): each row `dtype.row_bytes(row_len)` bytes, its
    /// blocks lying within one head (head_dim is a multiple of the block size).
    Blocks(DType, &'a [u8]),
}

impl<'a> KvRows<'a> {
    pub fn dtype(&self) -> DType {
        match self {
            KvRows::F16(_) => DType::F16,
            KvRows::F32(_) => DType::F32,
            KvRows::Blocks(t, _) => *t,
        }
    }

    /// Whole rows of `row_len` values held.
    fn n_rows(&self, row_len: usize) -> usize {
        match self {
            KvRows::F16(x) => x.len() / row_len.max(1),
            KvRows::F32(x) => x.len() / row_len.max(1),
            KvRows::Blocks(t, x) => x.len() / t.row_bytes(row_len).unwrap_or(usize::MAX).max(1),
        }
    }

    fn f16(&self) -> Option<&'a [f16]> {
        match *self {
            KvRows::F16(x) => Some(x),
            _ => None,
        }
    }
}

/// One layer's KV cache as the kernels read it, paged: rows of `n_head_kv * head_dim` values
/// stored in blocks of `block_size` rows (a power of two). Logical position `j` of the sequence
/// lives in row `table[j / block_size] * block_size + j % block_size` of `k` and `v`.
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a> {
    pub k: KvRows<'a>,
    pub v: KvRows<'a>,
    /// Block of each run of `block_size` logical positions.
    pub table: &'a [u32],
    pub block_size: usize,
}

/// Block size of the identity table [`attention`] uses for a contiguous cache.
const CONTIGUOUS_BLOCK: usize = 16;

/// `q`: [T, n_head*head_dim]; `k`, `v`: the layer's cache, [ctx, n_head_kv*head_dim] f16, filled at
/// least up to the largest position; `positions[t]`: the position of query t; `out`: [T, n_head*head_dim].
pub fn attention(
    p: &AttnParams,
    q: &[f32],
    k: &[f16],
    v: &[f16],
    positions: &[usize],
    out: &mut [f32],
) {
    let table = identity_table(positions);
    let kv = contiguous(k, v, &table);
    run(p, q, &[SeqAttn { kv, positions }], out, true)
}

/// [`attention`] with the portable kernel only (the same float operations in the same order,
/// without AVX-512): the plain version the SIMD kernels are tested against bit for bit.
pub fn attention_portable(
    p: &AttnParams,
    q: &[f32],
    k: &[f16],
    v: &[f16],
    positions: &[usize],
    out: &mut [f32],
) {
    let table = identity_table(positions);
    let kv = contiguous(k, v, &table);
    run(p, q, &[SeqAttn { kv, positions }], out, false)
}

/// [`attention`] over a paged cache: the same float operations in the same order, so the same
/// bits as the contiguous cache holding the same rows.
pub fn attention_paged(
    p: &AttnParams,
    q: &[f32],
    kv: PagedKv<'_>,
    positions: &[usize],
    out: &mut [f32],
) {
    run(p, q, &[SeqAttn { kv, positions }], out, true)
}

/// [`attention_paged`] with the portable kernel only.
pub fn attention_paged_portable(
    p: &AttnParams,
    q: &[f32],
    kv: PagedKv<'_>,
    positions: &[usize],
    out: &mut [f32],
) {
    run(p, q, &[SeqAttn { kv, positions }], out, false)
}

/// One sequence of [`attention_paged_batch`]: its cache and the positions of its query rows.
#[derive(Clone, Copy, Debug)]
pub struct SeqAttn<'a> {
    pub kv: PagedKv<'a>,
    pub positions: &'a [usize],
}

/// [`attention_paged`] for several sequences whose query rows are stacked in `q` (and `out`) in
/// order: one parallel pass over every (sequence, query, head) row, so a decode step of many
/// sequences splits across threads by sequence and head. Each row is computed exactly as
/// alone (same bits).
pub fn attention_paged_batch(p: &AttnParams, q: &[f32], seqs: &[SeqAttn<'_>], out: &mut [f32]) {
    run(p, q, seqs, out, true)
}

fn identity_table(positions: &[usize]) -> Vec<u32> {
    let max_pos = positions.iter().copied().max().unwrap_or(0);
    (0..(max_pos / CONTIGUOUS_BLOCK + 1) as u32).collect()
}

fn contiguous<'a>(k: &'a [f16], v: &'a [f16], table: &'a [u32]) -> PagedKv<'a> {
    PagedKv {
        k: KvRows::F16(k),
        v: KvRows::F16(v),
        table,
        block_size: CONTIGUOUS_BLOCK,
    }
}

/// Checks that every position `kv` must serve for `positions` lies in its table and cache.
fn check_cache(kv: &PagedKv<'_>, positions: &[usize], kv_row: usize) {
    let bs = kv.block_size;
    assert!(bs.is_power_of_two(), "attention: block size {bs}");
    let Some(max_pos) = positions.iter().copied().max() else {
        return;
    };
    assert!(
        max_pos / bs < kv.table.len(),
        "attention: block table too short"
    );
    // Every row a query can reach lies inside the cache (the last block may be partly filled).
    let rows = kv.k.n_rows(kv_row).min(kv.v.n_rows(kv_row));
    let last_row = |b: u32, used: usize| b as usize * bs + used;
    let n_blocks = max_pos / bs + 1;
    assert!(
        kv.table[..n_blocks].iter().enumerate().all(|(i, &b)| {
            let used = if i + 1 == n_blocks {
                max_pos % bs + 1
            } else {
                bs
            };
            last_row(b, used) <= rows
        }),
        "attention: cache too short"
    );
}

fn run(p: &AttnParams, q: &[f32], seqs: &[SeqAttn<'_>], out: &mut [f32], simd: bool) {
    let (hd, nh, nkv) = (p.head_dim, p.n_head, p.n_head_kv);
    assert!(
        nh % nkv == 0,
        "attention: n_head {nh} is not a multiple of n_head_kv {nkv}"
    );
    let n_rows: usize = seqs.iter().map(|s| s.positions.len()).sum();
    assert_eq!(q.len(), n_rows * nh * hd, "attention: q shape");
    assert_eq!(out.len(), q.len(), "attention: out shape");
    let kv_row = nkv * hd;
    for s in seqs {
        check_cache(&s.kv, s.positions, kv_row);
    }
    // First query row of each sequence (inline for up to 16 sequences).
    let mut first: smallvec::SmallVec<[usize; 17]> = smallvec::SmallVec::new();
    let mut r0 = 0;
    for s in seqs {
        first.push(r0);
        r0 += s.positions.len();
    }
    first.push(r0);
    let group = nh / nkv;
    if !seqs
        .iter()
        .all(|s| s.kv.k.f16().is_some() && s.kv.v.f16().is_some())
    {
        return run_any(p, q, seqs, &first, out);
    }

    let fast = simd && has_avx2_fma_f16c();
    let wide = simd && matches!(hd, 64 | 128 | 256) && has_avx512();
    let job = |idx: usize| {
        let (t, h) = (idx / nh, idx % nh);
        let (s, keys) = query_keys(p, seqs, &first, t);
        Row {
            q: &q[idx * hd..(idx + 1) * hd],
            k: s.kv.k.f16().expect("f16 cache"),
            v: s.kv.v.f16().expect("f16 cache"),
            table: s.kv.table,
            shift: s.kv.block_size.trailing_zeros(),
            at: (h / group) * hd,
            kv_row,
            keys,
            scale: p.softcap.map_or(p.scale, |c| p.scale / c),
            softcap: p.softcap,
            sink: p.sinks.map(|sk| sk[h]),
            fetch: Fetch::OwnV,
        }
    };
    // AVX2 without AVX-512: the same task split and three-pass structure, 256-bit registers.
    let narrow = fast && !wide && matches!(hd, 64 | 128 | 256);
    #[cfg(target_arch = "x86_64")]
    if wide || narrow {
        // A task is one query's heads of one KV head, G at a time: they share their keys and
        // their K and V rows, so the kernel runs G rows together (each K and V row converted
        // once, the per-key dependency chains overlapping). G is 4 at any head_dim (both kernels
        // run V.p in blocks of lanes, so the accumulators stay in registers), but small enough
        // that there are at least two tasks per thread (a one-token step must still split).
        let g_max = 4;
        // Tasks: per query, per KV head, its query heads G at a time (rows of one task share
        // their K and V rows).
        let n_q = n_rows;
        let mut g = g_max;
        let tasks_for = |g: usize| n_q * nkv * group.div_ceil(g);
        while g > 1 && tasks_for(g) < 2 * pool::threads() {
            g /= 2;
        }
        let per_kv = group.div_ceil(g);
        let max_keys = (0..n_q)
            .map(|t| query_keys(p, seqs, &first, t).1.len())
            .max()
            .unwrap_or(0);
        let cache_rows = seqs
            .iter()
            .map(|s| s.kv.k.n_rows(kv_row))
            .max()
            .unwrap_or(0);
        prepare_scores(max_keys, cache_rows);
        let o_ptr = OutRows(out.as_mut_ptr());
        // A decode step of several sequences (one query each, enough for every thread): a task
        // runs all of a query's KV heads, its first asking for whole K and V cache rows (every
        // head's part) into L2, so the later heads find them there. Split by KV head, each task
        // streamed two cache lines in six of every row from memory: 15-25% slower
        // (`cargo bench --bench ops -- batched`, 30 layers).
        let whole = nkv > 1 && n_q == seqs.len() && n_q >= 2 * pool::threads();
        let one = |task: usize, fetch: Fetch| {
            let (t, rest) = (task / (nkv * per_kv), task % (nkv * per_kv));
            let (kvh, gi) = (rest / per_kv, rest % per_kv);
            let h0 = kvh * group + gi * g;
            let n = g.min((kvh + 1) * group - h0);
            let r0 = t * nh + h0;
            // SAFETY: rows r0 .. r0 + n of `out` ([n_rows * nh, hd]) belong to this task alone,
            // and the range lies inside `out` (t < n_q, h0 + n <= nh).
            let o = unsafe { std::slice::from_raw_parts_mut(o_ptr.at(r0 * hd), n * hd) };
            let mut rows: [Row; 4] = core::array::from_fn(|i| job(r0 + i.min(n - 1)));
            rows[0].fetch = fetch;
            if narrow {
                // SAFETY (every call): `narrow` is true only when the CPU reports AVX2, FMA and
                // F16C and head_dim is 64, 128 or 256, which is 8 * NV for the NV each call
                // names.
                unsafe {
                    match hd {
                        64 => attend_rows_avx2_n::<8>(&rows, n, o),
                        128 => attend_rows_avx2_n::<16>(&rows, n, o),
                        _ => attend_rows_avx2_n::<32>(&rows, n, o),
                    }
                }
                return;
            }
            // SAFETY (every call): `wide` is true only when the CPU reports AVX-512F, AVX2,
            // FMA and F16C and head_dim is 64, 128 or 256, which is 16 * NV for the NV each
            // call names.
            unsafe {
                match hd {
                    64 => attend_rows_avx512_n::<4>(&rows, n, o),
                    128 => attend_rows_avx512_n::<8>(&rows, n, o),
                    _ => attend_rows_avx512_n::<16>(&rows, n, o),
                }
            }
        };
        if whole {
            pool::parallel_for(n_q, |t| {
                for i in 0..nkv * per_kv {
                    let fetch = if i == 0 {
                        Fetch::WholeRows
                    } else {
                        Fetch::None
                    };
                    one(t * nkv * per_kv + i, fetch);
                }
            });
        } else {
            pool::parallel_for(tasks_for(g), |task| one(task, Fetch::OwnV));
        }
        return;
    }
    pool::parallel_chunks_mut(out, hd, |idx, o| {
        let job = job(idx);
        #[cfg(target_arch = "x86_64")]
        if fast {
            // SAFETY: `fast` is true only when the CPU reports AVX2, FMA and F16C.
            unsafe { attend_row_avx2(&job, o) };
            return;
        }
        let _ = (fast, wide, narrow);
        attend_row(&job, o);
    });
}

/// The output of an attention call, shared by tasks that write disjoint rows.
#[derive(Clone, Copy)]
struct OutRows(*mut f32);
// SAFETY: tasks write disjoint rows of one `&mut [f32]` that outlives the parallel call.
unsafe impl Send for OutRows {}
// SAFETY: as above.
unsafe impl Sync for OutRows {}
impl OutRows {
    /// Element `i` (the caller keeps it inside the output and writes no row another task writes).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// One query row of one head against its KV head's cached rows `keys`.
struct Row<'a> {
    q: &'a [f32],
    k: &'a [f16],
    v: &'a [f16],
    /// Block table and log2 of the block size (see [`PagedKv`]).
    table: &'a [u32],
    shift: u32,
    /// Offset of the KV head within a cache row.
    at: usize,
    kv_row: usize,
    keys: std::ops::Range<usize>,
    /// Multiplies q.k (the cap's division folded in, see [`AttnParams::softcap`]).
    scale: f32,
    softcap: Option<f32>,
    /// This head's sink logit ([`AttnParams::sinks`]).
    sink: Option<f32>,
    /// What the score pass brings into L2 besides this head's next K rows.
    fetch: Fetch,
}

/// The prefetches of a row's score pass ([`KeyWalk`]) beyond its own K rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fetch {
    /// Each key's V row (this head's part) while the key is scored.
    OwnV,
    /// Every head's part of the K and V rows [`PREFETCH_ROWS`] keys ahead: the first of a task
    /// that runs all of a query's KV heads.
    WholeRows,
    /// Nothing: a later head of such a task, whose rows the first brought in.
    None,
}

impl Row<'_> {
    /// Offset in `k` and `v` of this row's head at logical position `j`.
    #[inline(always)]
    fn offset(&self, j: usize) -> usize {
        let mask = (1usize << self.shift) - 1;
        let row = ((self.table[j >> self.shift] as usize) << self.shift) | (j & mask);
        row * self.kv_row + self.at
    }
}

fn has_avx2_fma_f16c() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::cpu::features().x86_simd()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::cpu::features().avx512f && has_avx2_fma_f16c()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Score buffers of the AVX-512 and AVX2 kernels, one per task running at once: a task takes one
/// and gives it back. [`prepare_scores`] sizes them on the calling thread before a parallel call,
/// so whichever worker runs a task finds a buffer large enough: once a context's size is reached,
/// no call allocates, however the tasks were scheduled before.
static SCORES: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());

/// Score-buffer length a task of `n_keys` keys needs (H <= 4 rows, up to three values per key
/// and row, and one per key: the AVX-512 kernel keeps the scores apart from the weights and
/// rescales, and marks the keys where a row's max rose).
fn scores_len(n_keys: usize) -> usize {
    (3 * 4 + 1) * n_keys
}

/// Makes every score buffer hold at least `scores_len(max_keys)` values, with room for every
/// row of a cache of `cache_rows` rows (up to 8 MiB) so a growing context does not reallocate
/// step after step; one buffer per thread that may run a task.
fn prepare_scores(max_keys: usize, cache_rows: usize) {
    let want = scores_len(max_keys);
    let cap = (scores_len(cache_rows)).clamp(want, (2 << 20).max(want));
    let mut free = SCORES.lock().unwrap_or_else(|e| e.into_inner());
    let n = pool::threads() + 1;
    if free.len() < n {
        free.resize_with(n, Vec::new);
    }
    for b in free.iter_mut() {
        if b.capacity() < want {
            b.reserve_exact(cap - b.len());
        }
    }
}

/// [`attend_rows_avx512`] for the first `n` (1 to 4) of `rows`, which share their KV head; `o`
/// holds the n output rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn attend_rows_avx512_n<const NV: usize>(rows: &[Row; 4], n: usize, o: &mut [f32]) {
    let r = |i: usize| &rows[i];
    // SAFETY (every call): the caller's CPU has AVX-512F, AVX2, FMA and F16C (this function's
    // own requirement); the kernel checks head_dim = 16 * NV and the rows' sharing itself.
    unsafe {
        match n {
            4 => attend_rows_avx512::<4, NV>(core::array::from_fn(r), o),
            3 => attend_rows_avx512::<3, NV>(core::array::from_fn(r), o),
            2 => attend_rows_avx512::<2, NV>(core::array::from_fn(r), o),
            _ => attend_rows_avx512::<1, NV>([&rows[0]], o),
        }
    }
}

/// Asserts that the rows of one multi-row call are one query's heads of one KV head: the same
/// head_dim `hd`, keys, cache, table and KV head.
#[cfg(target_arch = "x86_64")]
fn check_shared<const H: usize>(rows: [&Row; H], hd: usize, what: &str) {
    let r0 = rows[0];
    assert!(
        rows.iter().all(|r| r.q.len() == hd
            && r.keys == r0.keys
            && r.at == r0.at
            && core::ptr::eq(r.k, r0.k)
            && core::ptr::eq(r.v, r0.v)
            && core::ptr::eq(r.table, r0.table)
            && r.shift == r0.shift
            && r.kv_row == r0.kv_row),
        "{what}: rows of one call share their KV head"
    );
}

/// Pass 2 of the multi-row kernels: the online softmax's factors per row, from its scores alone
/// (the same exp calls and sums as the one-pass recurrence of [`attend_row`]): ms = e^(m_old - m)
/// where a key raises the running max m (1 elsewhere), vs = e^(score - m) (1 where it raises it),
/// s = fma(s, ms, vs). The scores come in `vs_all` (key by key, H values a key), which gets the
/// weights, and `ms_all` the rescales, in the same order. Returns per row the sink's factor and
/// 1/s. Three steps: the running maxima and each key's exponent (into `ms_all`, with in
/// `vs_all` whether the key raised the max), every exponential at once
/// ([`expf_slice`], vectorized, the same bits as [`expf`]), then the factors and the sums (the
/// rows' chains interleaved).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // the rows' running values side by side, key by key
#[inline(always)]
fn softmax_factors<const H: usize>(
    rows: [&Row; H],
    vs_all: &mut [f32],
    ms_all: &mut [f32],
) -> [(Option<f32>, f32); H] {
    let n_keys = vs_all.len() / H;
    let mut m = [f32::NEG_INFINITY; H];
    for jj in 0..n_keys {
        for hi in 0..H {
            let i = jj * H + hi;
            let score = vs_all[i];
            if score > m[hi] {
                ms_all[i] = m[hi] - score;
                m[hi] = score;
                vs_all[i] = 1.0;
            } else {
                ms_all[i] = score - m[hi];
                vs_all[i] = 0.0;
            }
        }
    }
    expf_slice(ms_all);
    let mut s = [0f32; H];
    for jj in 0..n_keys {
        for hi in 0..H {
            let i = jj * H + hi;
            let e = ms_all[i];
            let (ms, vs) = if vs_all[i] == 1.0 { (e, 1.0) } else { (1.0, e) };
            ms_all[i] = ms;
            vs_all[i] = vs;
            s[hi] = s[hi].mul_add(ms, vs);
        }
    }
    finish_sums(rows, m, s)
}

/// Per row, the sink's factor (joined into the sum, [`join_sink`]) and 1/s, from the row's
/// final running max `m` and sum `s`: the end of both softmax-factor passes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn finish_sums<const H: usize>(
    rows: [&Row; H],
    m: [f32; H],
    s: [f32; H],
) -> [(Option<f32>, f32); H] {
    core::array::from_fn(|hi| {
        let mut s = s[hi];
        let sink = join_sink(rows[hi].sink, m[hi], &mut s);
        (sink, 1.0 / s)
    })
}

/// [`attend_row`] with AVX-512 for `H` rows of one query that share a KV head (grouped-query
/// attention): the same float operations in the same order per row, bit for bit, in three
/// passes. First every score ([`scores_avx512`]: each K row converted from f16 once for the H
/// rows, Q.K in ggml's AVX-512 `vec_dot_f16` lanes); then per row the online softmax's factors
/// ([`softmax_factors_avx512`], the running max found 16 keys at a time); then V.p with the
/// f16-rounded accumulator ([`v_pass_avx512`]). `head_dim` must be 16 * NV with NV a multiple
/// of 4 (64, 128, 256: no tail in Q.K); `o` holds the H output rows. No heap buffer per call
/// once [`prepare_scores`] sized the score buffers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn attend_rows_avx512<const H: usize, const NV: usize>(rows: [&Row; H], o: &mut [f32]) {
    let hd = rows[0].q.len();
    assert!(
        hd == 16 * NV && NV.is_multiple_of(4),
        "attend_rows_avx512: head_dim"
    );
    assert_eq!(o.len(), H * hd, "attend_rows_avx512: out");
    check_shared(rows, hd, "attend_rows_avx512");
    let n_keys = rows[0].keys.len();
    // A buffer sized by `prepare_scores` (a fresh one only if this task is not part of a
    // prepared call): the scores row by row, then the weights vs and the rescales ms row by
    // row, then per key whether any row's running max rose there.
    let taken = SCORES.lock().unwrap_or_else(|e| e.into_inner()).pop();
    let mut scores = taken.unwrap_or_default();
    // Every value is written by the passes below (`raised` cleared by the second): the
    // buffer keeps what it holds rather than be cleared first.
    scores.truncate((3 * H + 1) * n_keys);
    scores.resize((3 * H + 1) * n_keys, 0.0);
    let (by_row, rest) = scores.split_at_mut(H * n_keys);
    let (vs_all, rest) = rest.split_at_mut(H * n_keys);
    let (ms_all, raised) = rest.split_at_mut(H * n_keys);
    // SAFETY (all three): this function runs only where the CPU has AVX-512F, AVX2, FMA and
    // F16C; head_dim = 16 * NV was checked above, and the buffers hold H values per key.
    unsafe {
        scores_avx512::<H, NV>(rows, by_row);
        let fin = softmax_factors_avx512(rows, by_row, vs_all, ms_all, raised);
        // CB: 16 accumulators a block where H and NV allow (H = 3: 12), so there are enough
        // independent chains per key to hide the FMA-and-rounding latency, without spills.
        let (vs_all, ms_all, raised) = (&*vs_all, &*ms_all, &*raised);
        match (H, NV) {
            (1, 4) | (2, 4) | (3, _) | (4, _) => {
                v_pass_avx512::<H, NV, 4>(rows, vs_all, ms_all, raised, &fin, o)
            }
            (1, 8) | (2, _) => v_pass_avx512::<H, NV, 8>(rows, vs_all, ms_all, raised, &fin, o),
            _ => v_pass_avx512::<H, NV, 16>(rows, vs_all, ms_all, raised, &fin, o),
        }
    }
    SCORES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(scores);
}

/// The offsets of a row's keys in the cache, one after another: a block-table lookup once per
/// block, then one cache row further per key.
#[derive(Clone)]
struct KeyCursor<'r, 'a> {
    row: &'r Row<'a>,
    /// The next key's logical position, its offset, and the keys left in its block after it.
    j: usize,
    off: usize,
    left: usize,
}

impl<'r, 'a> KeyCursor<'r, 'a> {
    /// A cursor whose first key is logical position `j` of `row`'s cache.
    fn new(row: &'r Row<'a>, j: usize) -> Self {
        Self {
            row,
            j,
            off: 0,
            left: 0,
        }
    }

    /// The offset of the next key's row (this head's part of it), [`Row::offset`] of it.
    #[inline(always)]
    fn next_offset(&mut self) -> usize {
        if self.left == 0 {
            let mask = (1usize << self.row.shift) - 1;
            self.off = self.row.offset(self.j);
            self.left = mask + 1 - (self.j & mask);
        }
        let off = self.off;
        self.off += self.row.kv_row;
        self.left -= 1;
        self.j += 1;
        off
    }
}

/// A row's keys one after another for a score pass: each key's offset ([`KeyCursor`]), and
/// while it is scored the K row [`PREFETCH_KEYS`] keys ahead fetched into L1 and the key's V
/// row into L2, or as the row's [`Fetch`] asks: where whole cache rows, the whole K and V rows
/// [`PREFETCH_ROWS`] keys ahead instead (the first `PREFETCH_ROWS` keys' when the walk starts).
#[cfg(target_arch = "x86_64")]
struct KeyWalk<'r, 'a> {
    keys: KeyCursor<'r, 'a>,
    ahead: KeyCursor<'r, 'a>,
    /// Keys left whose K row `PREFETCH_KEYS` ahead still lies inside the row's keys.
    left_ahead: usize,
    far: KeyCursor<'r, 'a>,
    /// Keys left whose rows `PREFETCH_ROWS` ahead still lie inside the row's keys.
    left_far: usize,
}

#[cfg(target_arch = "x86_64")]
impl<'r, 'a> KeyWalk<'r, 'a> {
    fn new(row: &'r Row<'a>) -> Self {
        let n = row.keys.len();
        let mut far = KeyCursor::new(row, row.keys.start);
        let mut left_far = 0;
        if row.fetch == Fetch::WholeRows {
            for _ in 0..PREFETCH_ROWS.min(n) {
                Self::fetch_rows(row, far.next_offset());
            }
            left_far = n.saturating_sub(PREFETCH_ROWS);
        }
        Self {
            keys: KeyCursor::new(row, row.keys.start),
            ahead: KeyCursor::new(row, row.keys.start + PREFETCH_KEYS),
            left_ahead: n.saturating_sub(PREFETCH_KEYS),
            far,
            left_far,
        }
    }

    /// Brings the whole K and V cache rows of the key at offset `at` into L2.
    #[inline(always)]
    fn fetch_rows(r: &Row, at: usize) {
        use core::arch::x86_64::_MM_HINT_T1;
        prefetch_lines::<_MM_HINT_T1>(r.k, at - r.at, r.kv_row / 32);
        prefetch_lines::<_MM_HINT_T1>(r.v, at - r.at, r.kv_row / 32);
    }

    /// The next key's offset ([`KeyCursor::next_offset`]), its prefetches issued.
    #[inline(always)]
    fn next_offset(&mut self) -> usize {
        use core::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1};
        let r = self.keys.row;
        let at = self.keys.next_offset();
        let lines = r.q.len() / 32;
        if self.left_ahead > 0 {
            self.left_ahead -= 1;
            prefetch_lines::<_MM_HINT_T0>(r.k, self.ahead.next_offset(), lines);
        }
        match r.fetch {
            Fetch::WholeRows if self.left_far > 0 => {
                self.left_far -= 1;
                Self::fetch_rows(r, self.far.next_offset());
            }
            Fetch::OwnV => prefetch_lines::<_MM_HINT_T1>(r.v, at, lines),
            _ => {}
        }
        at
    }
}

/// Pass 1 of [`attend_rows_avx512`]: the H rows' scaled (and capped) scores, row by row into
/// `by_row` ([H, n_keys]). Each K row is converted once for the H rows; per row and key the
/// 16-lane sums (a0 + a2) + (a1 + a3) of `dot_f16_order`, 16 keys' sums reduced together by
/// [`scores_block`]. While a key is scored, the K row [`PREFETCH_KEYS`] keys ahead is fetched
/// into L1 and V (or whole cache) rows into L2 as the row's [`Fetch`] asks ([`KeyWalk`]).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // index loops over register arrays mirror the lanes
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn scores_avx512<const H: usize, const NV: usize>(rows: [&Row; H], by_row: &mut [f32]) {
    use core::arch::x86_64::*;
    let r0 = rows[0];
    let hd = 16 * NV;
    let keys = r0.keys.clone();
    let n_keys = keys.len();
    let round = |x: __m512| _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
    // Q rounded to f16, per row.
    let q: [[__m512; NV]; H] = core::array::from_fn(|hi| {
        core::array::from_fn(|i| {
            // SAFETY: i * 16 + 16 <= hd = q.len().
            round(unsafe { _mm512_loadu_ps(rows[hi].q.as_ptr().add(i * 16)) })
        })
    });
    let mut walk = KeyWalk::new(r0);
    let mut rs = [[_mm512_setzero_ps(); 16]; H];
    for jj in 0..n_keys {
        let at = walk.next_offset();
        let krow = &r0.k[at..at + hd];
        // dot_f16_order: chunk i of 16 lanes goes to accumulator i % 4, in order.
        let mut a = [[_mm512_setzero_ps(); 4]; H];
        for i4 in (0..NV).step_by(4) {
            for (ai, i) in (i4..i4 + 4).enumerate() {
                // SAFETY: i * 16 + 16 <= hd = krow.len().
                let k = _mm512_cvtph_ps(unsafe {
                    _mm256_loadu_si256(krow.as_ptr().add(i * 16) as *const __m256i)
                });
                for hi in 0..H {
                    a[hi][ai] = _mm512_fmadd_ps(q[hi][i], k, a[hi][ai]);
                }
            }
        }
        for hi in 0..H {
            let a = &a[hi];
            rs[hi][jj % 16] = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
        }
        let n = jj % 16 + 1;
        if n == 16 || jj + 1 == n_keys {
            // SAFETY: the CPU has AVX-512F; keys jj + 1 - n ..= jj lie inside every row of
            // `by_row`.
            unsafe { scores_block(rows, &rs, jj + 1 - n, n, by_row) };
        }
    }
}

/// The last `n` (up to 16) keys' scores from their 16-lane sums `rs`, from key `base` on: per
/// row the halving tree of each key's sum at once ([`hsum16`]), times the scale (then capped),
/// into the row's scores. Out of line, so the key loop keeps Q and its sums in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline(never)]
unsafe fn scores_block<const H: usize>(
    rows: [&Row; H],
    rs: &[[core::arch::x86_64::__m512; 16]; H],
    base: usize,
    n: usize,
    by_row: &mut [f32],
) {
    use core::arch::x86_64::*;
    let n_keys = by_row.len() / H;
    for hi in 0..H {
        let dots = _mm512_mul_ps(hsum16(&rs[hi]), _mm512_set1_ps(rows[hi].scale));
        let dst = &mut by_row[hi * n_keys + base..hi * n_keys + base + n];
        // SAFETY: the mask writes the first n values, which `dst` holds.
        unsafe { _mm512_mask_storeu_ps(dst.as_mut_ptr(), ((1u32 << n) - 1) as u16, dots) };
        if let Some(c) = rows[hi].softcap {
            for x in dst.iter_mut() {
                *x = capped(*x, Some(c));
            }
        }
    }
}

/// Pass 2 of [`attend_rows_avx512`]: [`softmax_factors`]' values for row-major scores
/// `by_row` ([H, n_keys]), 16 keys at a time. Per row, the running max before each key is an
/// exclusive prefix maximum (a key raises it only if its score is larger, so a NaN score
/// never does and ties keep the earlier value, as the one-key-at-a-time loop), and with it
/// each key's exponent argument; then every exponential at once ([`expf_slice`]); then the
/// factors: where the max rose, ms = e and vs = 1, elsewhere ms = 1 and vs = e, row-major into
/// `ms_all` and `vs_all`, and per key in `raised` 1 where any row's max rose (where the V pass
/// rescales); last the sums `s = fma(s, ms, vs)` key by key (the rows' chains interleaved).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // the rows' running values side by side, key by key
#[target_feature(enable = "avx512f")]
unsafe fn softmax_factors_avx512<const H: usize>(
    rows: [&Row; H],
    by_row: &[f32],
    vs_all: &mut [f32],
    ms_all: &mut [f32],
    raised: &mut [f32],
) -> [(Option<f32>, f32); H] {
    use core::arch::x86_64::*;
    let n_keys = raised.len();
    raised.fill(0.0);
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let one = _mm512_set1_ps(1.0);
    let zero = _mm512_setzero_ps();
    // The later of two running maxima: `later` where it is larger, else `earlier`.
    let join = |earlier: __m512, later: __m512| {
        _mm512_mask_blend_ps(
            _mm512_cmp_ps_mask::<_CMP_GT_OQ>(later, earlier),
            earlier,
            later,
        )
    };
    let mut m = [f32::NEG_INFINITY; H];
    for hi in 0..H {
        let mut run = ninf;
        for c in (0..n_keys).step_by(16) {
            let k = ((1u32 << (n_keys - c).min(16)) - 1) as u16;
            let at = hi * n_keys + c;
            // SAFETY: the mask reads only the keys c.. that the row holds.
            let s = unsafe { _mm512_mask_loadu_ps(ninf, k, by_row.as_ptr().add(at)) };
            // The running max within the 16 keys (NaN scores count as -inf: they raise
            // nothing), lane by lane: shifts by 1, 2, 4 and 8 lanes, -inf shifted in.
            let mut x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(s, s), ninf, s);
            x = join(from_below::<15>(x, ninf), x);
            x = join(from_below::<14>(x, ninf), x);
            x = join(from_below::<12>(x, ninf), x);
            x = join(from_below::<8>(x, ninf), x);
            let incl = join(run, x);
            // Before key i: the max through key i - 1 (lane 0: the max before the block).
            let before = from_below::<15>(incl, run);
            let rose = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(s, before) & k;
            let arg =
                _mm512_mask_blend_ps(rose, _mm512_sub_ps(s, before), _mm512_sub_ps(before, s));
            // SAFETY (both stores and the load): the mask touches only keys c.. of this row
            // (and of `raised`), which the buffers hold.
            unsafe {
                _mm512_mask_storeu_ps(ms_all.as_mut_ptr().add(at), k, arg);
                _mm512_mask_storeu_ps(
                    vs_all.as_mut_ptr().add(at),
                    k,
                    _mm512_mask_blend_ps(rose, zero, one),
                );
                let r = _mm512_mask_loadu_ps(zero, k, raised.as_ptr().add(c));
                _mm512_mask_storeu_ps(
                    raised.as_mut_ptr().add(c),
                    k,
                    _mm512_mask_blend_ps(rose, r, one),
                );
            }
            run = _mm512_permutexvar_ps(_mm512_set1_epi32(15), incl);
        }
        m[hi] = _mm512_cvtss_f32(run);
    }
    expf_slice(ms_all);
    for c in (0..H * n_keys).step_by(16) {
        let k = ((1u32 << (H * n_keys - c).min(16)) - 1) as u16;
        // SAFETY: the mask touches only values c.. of the two buffers, which hold H * n_keys.
        unsafe {
            let e = _mm512_mask_loadu_ps(one, k, ms_all.as_ptr().add(c));
            let rose = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(
                _mm512_mask_loadu_ps(zero, k, vs_all.as_ptr().add(c)),
                one,
            );
            _mm512_mask_storeu_ps(
                ms_all.as_mut_ptr().add(c),
                k,
                _mm512_mask_blend_ps(rose, one, e),
            );
            _mm512_mask_storeu_ps(
                vs_all.as_mut_ptr().add(c),
                k,
                _mm512_mask_blend_ps(rose, e, one),
            );
        }
    }
    let mut s = [0f32; H];
    for jj in 0..n_keys {
        for hi in 0..H {
            let i = hi * n_keys + jj;
            s[hi] = s[hi].mul_add(ms_all[i], vs_all[i]);
        }
    }
    finish_sums(rows, m, s)
}

/// Lanes `IMM..IMM + 16` of `fill` followed by `x`: `x` moved up by 16 - IMM lanes, the lanes
/// below it taken from the top of `fill`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn from_below<const IMM: i32>(
    x: core::arch::x86_64::__m512,
    fill: core::arch::x86_64::__m512,
) -> core::arch::x86_64::__m512 {
    use core::arch::x86_64::*;
    _mm512_castsi512_ps(_mm512_alignr_epi32::<IMM>(
        _mm512_castps_si512(x),
        _mm512_castps_si512(fill),
    ))
}

/// Asks the CPU to bring `lines` cache lines from offset `at` of `rows` (a head's part of a
/// cache row: 32 f16 values a line) into the cache level `HINT` names (a hint: no effect on
/// results).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_lines<const HINT: i32>(rows: &[f16], at: usize, lines: usize) {
    let p = rows.as_ptr().wrapping_add(at) as *const i8;
    for line in 0..lines {
        // SAFETY: a prefetch never faults (the caller's offsets lie inside `rows`).
        unsafe { core::arch::x86_64::_mm_prefetch::<HINT>(p.wrapping_add(64 * line)) };
    }
}

/// How far ahead of the key being scored the K row is fetched (into L1); V rows, read in pass
/// 3, go to L2 only (a task's K rows stream through L1 in pass 1 and would
/// push its V rows out: 5-10% faster on a cold cache, `cargo bench --bench ops -- batched`).
/// The rows of one KV head lie a cache row apart (paged), a pattern the hardware prefetcher
/// follows poorly at this little work per key.
#[cfg(target_arch = "x86_64")]
const PREFETCH_KEYS: usize = 8;

/// How far ahead of the key being scored the first task of a query fetches whole K and V cache
/// rows into L2 ([`Fetch::WholeRows`]): far enough to cover a miss to memory at the few tens of
/// cycles a key takes. At 16 (whole rows of the key being scored before) a batched decode
/// step's attention ran 0.78x the time (`cargo bench --bench ops -- batched`: 0.142 -> 0.111 ms
/// a layer at two threads, medians of five alternated runs; 0.84x at one thread), and SmolLM2's
/// `ferrum profile --batch 8 -p 128 -n 128 -t 2` 0.885x (629 -> 557 ms over 128 steps); 24
/// gained nothing more.
#[cfg(target_arch = "x86_64")]
const PREFETCH_ROWS: usize = 16;

/// The dot products of 16 keys from their 16-lane sums `r` (key k's in `r[k]`): lane k of the
/// result is `dot_f16_order`'s halving tree over r[k]'s lanes (l + l+8, then l + l+4, then
/// l + l+2, then l + l+1), the same additions of the same pairs, for the 16 keys in 4 x 3 + 1
/// steps of two shuffles and an add each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn hsum16(r: &[core::arch::x86_64::__m512; 16]) -> core::arch::x86_64::__m512 {
    use core::arch::x86_64::*;
    // Step 1, keys 2p and 2p+1: 128-bit blocks [a0+a2, a1+a3, b0+b2, b1+b3] (a = key 2p's
    // blocks, b = key 2p+1's): each key's lanes l + l+8.
    let s1: [__m512; 8] = core::array::from_fn(|p| {
        let (a, b) = (r[2 * p], r[2 * p + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        )
    });
    // Step 2, lanes l + l+4: block k holds key 4p + k's four sums.
    let s2: [__m512; 4] = core::array::from_fn(|p| {
        let (x, y) = (s1[2 * p], s1[2 * p + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(x, y),
            _mm512_shuffle_f32x4::<0xDD>(x, y),
        )
    });
    // Step 3, lanes l + l+2: block k holds [key 8p+k's two sums, key 8p+4+k's two sums].
    let s3: [__m512; 2] = core::array::from_fn(|p| {
        let (x, y) = (s2[2 * p], s2[2 * p + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(x, y),
            _mm512_shuffle_ps::<0xEE>(x, y),
        )
    });
    // Step 4, lanes l + l+1: lane 4k + m holds key 4m + k; then keys in order.
    let (x, y) = (s3[0], s3[1]);
    let t = _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(x, y),
        _mm512_shuffle_ps::<0xDD>(x, y),
    );
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(idx, t)
}

/// The V pass of [`attend_rows_avx512`] in blocks of CB sixteen-lane chunks (CB divides NV):
/// per block, per key, the rescale (where any row's max rose; a row whose max did not has
/// ms = 1, and the accumulator holds f16 values, so its factor changes nothing) and the FMA of
/// the V row by vs, each rounded to f16; then the sink's factor and 1/s into `o`. The factors
/// are row-major ([H, n_keys]).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // index loops over register arrays mirror the lanes
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn v_pass_avx512<const H: usize, const NV: usize, const CB: usize>(
    rows: [&Row; H],
    vs_all: &[f32],
    ms_all: &[f32],
    raised: &[f32],
    fin: &[(Option<f32>, f32); H],
    o: &mut [f32],
) {
    use core::arch::x86_64::*;
    let round = |x: __m512| _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
    let r0 = rows[0];
    let hd = 16 * NV;
    let n_keys = raised.len();
    assert!(vs_all.len() == H * n_keys && ms_all.len() == H * n_keys);
    for b in (0..NV).step_by(CB) {
        let mut acc = [[_mm512_setzero_ps(); CB]; H];
        let mut keys_at = KeyCursor::new(r0, r0.keys.start);
        for jj in 0..n_keys {
            let at = keys_at.next_offset();
            let vrow = &r0.v[at + b * 16..at + (b + CB) * 16];
            if raised[jj] != 0.0 {
                for hi in 0..H {
                    let msv = _mm512_set1_ps(ms_all[hi * n_keys + jj]);
                    for av in acc[hi].iter_mut() {
                        *av = round(_mm512_mul_ps(*av, msv));
                    }
                }
            }
            let vs: [__m512; H] =
                core::array::from_fn(|hi| _mm512_set1_ps(vs_all[hi * n_keys + jj]));
            for c in 0..CB {
                // SAFETY: c * 16 + 16 <= CB * 16 = vrow.len().
                let x = _mm512_cvtph_ps(unsafe {
                    _mm256_loadu_si256(vrow.as_ptr().add(c * 16) as *const __m256i)
                });
                for hi in 0..H {
                    acc[hi][c] = round(_mm512_fmadd_ps(x, vs[hi], acc[hi][c]));
                }
            }
        }
        for hi in 0..H {
            let (sink, inv) = fin[hi];
            let inv = _mm512_set1_ps(inv);
            for (c, &a) in acc[hi].iter().enumerate() {
                let a = match sink {
                    Some(f) => _mm512_mul_ps(a, _mm512_set1_ps(f)),
                    None => a,
                };
                let dst = &mut o[hi * hd + (b + c) * 16..hi * hd + (b + c) * 16 + 16];
                // SAFETY: `dst` holds 16 values.
                unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), _mm512_mul_ps(a, inv)) };
            }
        }
    }
}

/// [`attend_rows_avx2`] for the first `n` (1 to 4) of `rows`, which share their KV head; `o`
/// holds the n output rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_rows_avx2_n<const NV: usize>(rows: &[Row; 4], n: usize, o: &mut [f32]) {
    let r = |i: usize| &rows[i];
    // SAFETY (every call): the caller's CPU has AVX2, FMA and F16C (this function's own
    // requirement); the kernel checks head_dim = 8 * NV and the rows' sharing itself.
    unsafe {
        match n {
            4 => attend_rows_avx2::<4, NV>(core::array::from_fn(r), o),
            3 => attend_rows_avx2::<3, NV>(core::array::from_fn(r), o),
            2 => attend_rows_avx2::<2, NV>(core::array::from_fn(r), o),
            _ => attend_rows_avx2::<1, NV>([&rows[0]], o),
        }
    }
}

/// [`attend_row`] with AVX2 for `H` rows of one query that share a KV head (grouped-query
/// attention): the same float operations in the same order per row, bit for bit, in three passes
/// as [`attend_rows_avx512`] does. First every score (each K row converted from f16 once for the
/// H rows; Q.K in `dot_f16_order`'s sixteen lanes held as two eight-lane halves, the same
/// reduction tree); then per row the online softmax's factors (running max, rescale `ms`, weight
/// `vs`, sum) with libm's `expf`; then V.p with the f16-rounded accumulator, eight lanes a
/// register. The lanes of the accumulator are independent of each other, so that last pass runs
/// the keys once per block of lanes, the H rows' accumulators of one block held in registers
/// (enough independent chains of FMA and f16 rounding per key, no spills; any head_dim).
/// `head_dim` must be 8 * NV with NV a multiple of 8 (64, 128, 256: no tail in Q.K); `o` holds
/// the H output rows. No heap buffer per call once [`prepare_scores`] sized the score buffers.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // index loops over register arrays mirror the lanes
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_rows_avx2<const H: usize, const NV: usize>(rows: [&Row; H], o: &mut [f32]) {
    use core::arch::x86_64::*;
    let hd = rows[0].q.len();
    assert!(
        hd == 8 * NV && NV.is_multiple_of(8),
        "attend_rows_avx2: head_dim"
    );
    assert_eq!(o.len(), H * hd, "attend_rows_avx2: out");
    // One query's heads of one KV head: the same keys, cache, table and KV head.
    check_shared(rows, hd, "attend_rows_avx2");
    let r0 = rows[0];
    let keys = r0.keys.clone();
    let n_keys = keys.len();
    let round = |x: __m256| _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
    // A buffer sized by `prepare_scores` (a fresh one only if this task is not part of a
    // prepared call): per key and row the score, then the weight vs; after them the rescales ms.
    let taken = SCORES.lock().unwrap_or_else(|e| e.into_inner()).pop();
    let mut scores = taken.unwrap_or_default();
    scores.clear();
    scores.resize(2 * H * n_keys, 0.0);
    let (vs_all, ms_all) = scores.split_at_mut(H * n_keys);

    // Pass 1: the scores. Q rounded to f16, per row.
    let q: [[__m256; NV]; H] = core::array::from_fn(|hi| {
        core::array::from_fn(|c| {
            // SAFETY: c * 8 + 8 <= hd = q.len().
            round(unsafe { _mm256_loadu_ps(rows[hi].q.as_ptr().add(c * 8)) })
        })
    });
    let mut walk = KeyWalk::new(r0);
    for jj in 0..n_keys {
        let at = walk.next_offset();
        let krow = &r0.k[at..at + hd];
        // dot_f16_order's accumulator a (0..4) lane l (0..16) is slot 2a + l / 8 here, lane
        // l % 8: eight-lane chunk c goes to slot c % 8, and the chunks of one slot are summed in
        // order. Slot by slot, so only H running sums are live at a time.
        let mut slot = [[_mm256_setzero_ps(); 8]; H];
        for sl in 0..8 {
            for g in 0..NV / 8 {
                let c = g * 8 + sl;
                // SAFETY: c * 8 + 8 <= hd = krow.len().
                let k = _mm256_cvtph_ps(unsafe {
                    _mm_loadu_si128(krow.as_ptr().add(c * 8) as *const __m128i)
                });
                for hi in 0..H {
                    slot[hi][sl] = _mm256_fmadd_ps(q[hi][c], k, slot[hi][sl]);
                }
            }
        }
        for hi in 0..H {
            let a = &slot[hi];
            // (a0 + a2) + (a1 + a3) per half, then the halving tree over the 16 lanes.
            let lo = _mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6]));
            let hi8 = _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7]));
            let t8 = _mm256_add_ps(lo, hi8);
            let t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps::<1>(t8));
            let t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4)); // [t0+t2, t1+t3, ..]
            let dot = _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
            vs_all[jj * H + hi] = capped(dot * rows[hi].scale, rows[hi].softcap);
        }
    }

    // Pass 2: the softmax factors.
    let fin = softmax_factors(rows, vs_all, ms_all);

    // Pass 3: V.p, a block of CB eight-lane chunks at a time (H * CB accumulators in registers).
    let (vs_all, ms_all) = (&*vs_all, &*ms_all);
    // SAFETY (every call): this function runs only where the CPU has AVX2, FMA and F16C; CB
    // divides NV; the factors hold H values per key and `o` the H rows.
    unsafe {
        match H {
            1 => v_pass::<H, NV, 8>(rows, vs_all, ms_all, &fin, o),
            2 => v_pass::<H, NV, 4>(rows, vs_all, ms_all, &fin, o),
            3 => v_pass::<H, NV, 4>(rows, vs_all, ms_all, &fin, o),
            _ => v_pass::<H, NV, 2>(rows, vs_all, ms_all, &fin, o),
        }
    }
    SCORES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(scores);
}

/// The V pass of [`attend_rows_avx2`] in blocks of CB chunks (CB divides NV): per block,
/// per key, the rescale (where a row's ms is not 1; the accumulator holds f16 values, so a
/// factor of 1 changes nothing) and the FMA of the V row by vs, each rounded to f16; then
/// the sink's factor and 1/s into `o`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // index loops over register arrays mirror the lanes
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn v_pass<const H: usize, const NV: usize, const CB: usize>(
    rows: [&Row; H],
    vs_all: &[f32],
    ms_all: &[f32],
    fin: &[(Option<f32>, f32); H],
    o: &mut [f32],
) {
    use core::arch::x86_64::*;
    let round = |x: __m256| _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
    let r0 = rows[0];
    let hd = 8 * NV;
    for b in (0..NV).step_by(CB) {
        let mut acc = [[_mm256_setzero_ps(); CB]; H];
        let mut keys_at = KeyCursor::new(r0, r0.keys.start);
        for jj in 0..r0.keys.len() {
            let at = keys_at.next_offset();
            let vrow = &r0.v[at + b * 8..at + (b + CB) * 8];
            let ms = &ms_all[jj * H..jj * H + H];
            let vs = &vs_all[jj * H..jj * H + H];
            if ms.iter().any(|&x| x != 1.0) {
                for (a, &f) in acc.iter_mut().zip(ms) {
                    let msv = _mm256_set1_ps(f);
                    for av in a.iter_mut() {
                        *av = round(_mm256_mul_ps(*av, msv));
                    }
                }
            }
            for c in 0..CB {
                // SAFETY: c * 8 + 8 <= CB * 8 = vrow.len().
                let x = _mm256_cvtph_ps(unsafe {
                    _mm_loadu_si128(vrow.as_ptr().add(c * 8) as *const __m128i)
                });
                for hi in 0..H {
                    let vsv = _mm256_set1_ps(vs[hi]);
                    acc[hi][c] = round(_mm256_fmadd_ps(x, vsv, acc[hi][c]));
                }
            }
        }
        for hi in 0..H {
            let (sink, inv) = fin[hi];
            let inv = _mm256_set1_ps(inv);
            for (c, &a) in acc[hi].iter().enumerate() {
                let a = match sink {
                    Some(f) => _mm256_mul_ps(a, _mm256_set1_ps(f)),
                    None => a,
                };
                let dst = &mut o[hi * hd + (b + c) * 8..hi * hd + (b + c) * 8 + 8];
                // SAFETY: `dst` holds 8 values.
                unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), _mm256_mul_ps(a, inv)) };
            }
        }
    }
}

/// [`attend_row`] compiled with AVX2/FMA/F16C so `mul_add` and the f16 conversions are single
/// instructions.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_row_avx2(r: &Row, o: &mut [f32]) {
    attend_row(r, o)
}

#[inline(always)]
fn attend_row(r: &Row, o: &mut [f32]) {
    let hd = r.q.len();
    // Q rounded to f16 (bulk conversions use F16C where the CPU has it).
    let mut qh = vec![f16::ZERO; hd];
    qh.convert_from_f32_slice(r.q);
    let mut qf = vec![0f32; hd];
    qh.convert_to_f32_slice(&mut qf);
    let mut m = f32::NEG_INFINITY;
    let mut s = 0f32;
    // The V.p accumulator holds f16 values and is rounded after every update, as llama.cpp's
    // CPU flash attention does with an f16 V cache (its `VKQ16`); `acc16` is the rounding step.
    let mut acc = vec![0f32; hd];
    let mut acc16 = vec![f16::ZERO; hd];
    let mut row = vec![0f32; hd];
    for j in r.keys.clone() {
        let at = r.offset(j);
        r.k[at..at + hd].convert_to_f32_slice(&mut row);
        let score = capped(dot_f16_order(&qf, &row) * r.scale, r.softcap);
        let mut ms = 1f32;
        let mut vs = 1f32;
        if score > m {
            ms = expf(m - score);
            m = score;
            for a in acc.iter_mut() {
                *a *= ms;
            }
            round_to_f16(&mut acc, &mut acc16);
        } else {
            vs = expf(score - m);
        }
        r.v[at..at + hd].convert_to_f32_slice(&mut row);
        for (a, &b) in acc.iter_mut().zip(&row) {
            *a = b.mul_add(vs, *a);
        }
        round_to_f16(&mut acc, &mut acc16);
        s = s.mul_add(ms, vs);
    }
    if let Some(ms) = join_sink(r.sink, m, &mut s) {
        for a in acc.iter_mut() {
            *a *= ms;
        }
    }
    let inv = 1.0 / s;
    for (dst, a) in o.iter_mut().zip(&acc) {
        *dst = a * inv;
    }
}

/// The sequence holding query row `t` of a call (the last whose first row, `first`, is <= t) and
/// the logical key positions that row attends to (its own and the earlier ones in the window).
fn query_keys<'a, 's>(
    p: &AttnParams,
    seqs: &'a [SeqAttn<'s>],
    first: &[usize],
    t: usize,
) -> (&'a SeqAttn<'s>, std::ops::Range<usize>) {
    let si = first.partition_point(|&f| f <= t) - 1;
    let s = &seqs[si];
    let pos = s.positions[t - first[si]];
    let start = match p.window {
        Some(w) => (pos + 1).saturating_sub(w),
        None => 0,
    };
    (s, start..pos + 1)
}

/// Attention over a cache whose K or V rows are not f16 ([`KvRows::F32`], [`KvRows::Blocks`]):
/// one task per (query row, head), each by [`attend_row_any`].
fn run_any(p: &AttnParams, q: &[f32], seqs: &[SeqAttn<'_>], first: &[usize], out: &mut [f32]) {
    let (hd, nh) = (p.head_dim, p.n_head);
    for s in seqs {
        for rows in [s.kv.k, s.kv.v] {
            if let KvRows::Blocks(t, _) = rows {
                assert!(
                    hd.is_multiple_of(t.block_size()),
                    "attention: head_dim {hd} is not a multiple of {t}'s block"
                );
            }
        }
    }
    let fast = has_avx2_fma_f16c();
    pool::parallel_chunks_mut(out, hd, |idx, o| {
        let (t, h) = (idx / nh, idx % nh);
        let (s, keys) = query_keys(p, seqs, first, t);
        let q = &q[idx * hd..(idx + 1) * hd];
        #[cfg(target_arch = "x86_64")]
        if fast {
            // SAFETY: `fast` is true only when the CPU reports AVX2, FMA and F16C.
            unsafe { attend_row_any_avx2(p, q, &s.kv, h, keys, o) };
            return;
        }
        let _ = fast;
        attend_row_any(p, q, &s.kv, h, keys, o);
    });
}

/// [`attend_row_any`] compiled with AVX2/FMA/F16C, so its `mul_add`s and f16 conversions are
/// single instructions (the same results).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_row_any_avx2(
    p: &AttnParams,
    q: &[f32],
    kv: &PagedKv<'_>,
    h: usize,
    keys: std::ops::Range<usize>,
    o: &mut [f32],
) {
    attend_row_any(p, q, kv, h, keys, o)
}

/// One query row of one head, llama.cpp's flash-attention recurrence for any cache type
/// (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`): Q converted to K's dot format once;
/// per key the score `dot(K, Q)·scale` (soft-capped), then with `s > M` the accumulator scaled
/// by `exp(M - s)`, else the weight `exp(s - M)`; V (as f32) added by FMA; `S = fma(S, ms, vs)`.
/// An f16 V accumulates in f16 (rounded after every update), any other V in f32. `h`: the
/// query head.
#[inline(always)]
fn attend_row_any(
    p: &AttnParams,
    q: &[f32],
    kv: &PagedKv<'_>,
    h: usize,
    keys: std::ops::Range<usize>,
    o: &mut [f32],
) {
    let hd = q.len();
    let head = (h / (p.n_head / p.n_head_kv)) * hd;
    let kv_row = p.n_head_kv * hd;
    let scale = p.softcap.map_or(p.scale, |c| p.scale / c);
    let shift = kv.block_size.trailing_zeros();
    let mask = kv.block_size - 1;
    let row_of = |j: usize| ((kv.table[j >> shift] as usize) << shift) | (j & mask);
    // Q in the format K's dot product takes: f16-rounded for an f16 K, as is for f32, and
    // quantized as the type's `vec_dot_type` (Q8_0) for a block type.
    let mut qf = q.to_vec();
    let mut qb = Vec::new();
    match kv.k {
        KvRows::F16(_) => {
            let mut h = vec![f16::ZERO; hd];
            round_to_f16(&mut qf, &mut h);
        }
        KvRows::F32(_) => {}
        KvRows::Blocks(t, _) => {
            let at = quant::vec_dot_type(t);
            qb = vec![0u8; at.row_bytes(hd).expect("whole blocks")];
            quant::quantize_row(at, q, &mut qb);
        }
    }
    let v16 = kv.v.f16().is_some();
    // Byte geometry of block-typed rows: a whole row, this head's offset, one head.
    let geometry = |t: DType| match t.row_bytes(kv_row) {
        Some(rb) if t.is_quantized() => (rb, t.row_bytes(head).unwrap(), t.row_bytes(hd).unwrap()),
        _ => (0, 0, 0),
    };
    let (krb, khb, khl) = geometry(kv.k.dtype());
    let (vrb, vhb, vhl) = geometry(kv.v.dtype());
    let mut acc = vec![0f32; hd];
    let mut acc16 = vec![f16::ZERO; hd];
    let mut row = vec![0f32; hd];
    let (mut m, mut s) = (f32::NEG_INFINITY, 0f32);
    for j in keys {
        let r = row_of(j);
        let dot = match kv.k {
            KvRows::F16(k) => {
                k[r * kv_row + head..][..hd].convert_to_f32_slice(&mut row);
                dot_f16_order(&qf, &row)
            }
            // ggml's AVX-512 `ggml_vec_dot_f32` sums in the same lanes as its f16 dot.
            KvRows::F32(k) => dot_f16_order(&qf, &k[r * kv_row + head..][..hd]),
            KvRows::Blocks(t, k) => quant::vec_dot(t, &k[r * krb + khb..][..khl], &qb, hd),
        };
        let score = capped(dot * scale, p.softcap);
        let (mut ms, mut vs) = (1f32, 1f32);
        if score > m {
            ms = expf(m - score);
            m = score;
            for a in acc.iter_mut() {
                *a *= ms;
            }
            if v16 {
                round_to_f16(&mut acc, &mut acc16);
            }
        } else {
            vs = expf(score - m);
        }
        let vrow: &[f32] = match kv.v {
            KvRows::F16(v) => {
                v[r * kv_row + head..][..hd].convert_to_f32_slice(&mut row);
                &row
            }
            KvRows::F32(v) => &v[r * kv_row + head..][..hd],
            KvRows::Blocks(t, v) => {
                quant::dequantize_row(t, &v[r * vrb + vhb..][..vhl], &mut row);
                &row
            }
        };
        for (a, &b) in acc.iter_mut().zip(vrow) {
            *a = b.mul_add(vs, *a);
        }
        if v16 {
            round_to_f16(&mut acc, &mut acc16);
        }
        s = s.mul_add(ms, vs);
    }
    if let Some(ms) = join_sink(p.sinks.map(|sk| sk[h]), m, &mut s) {
        for a in acc.iter_mut() {
            *a *= ms;
        }
    }
    let inv = 1.0 / s;
    for (dst, a) in o.iter_mut().zip(&acc) {
        *dst = a * inv;
    }
}

/// Q.K in the order of ggml's AVX-512 `ggml_vec_dot_f16`, which llama.cpp's flash attention uses:
/// four 16-lane accumulators updated by FMA (element i goes to accumulator (i/16)%4, lane i%16),
/// combined as (a0+a2)+(a1+a3), then a halving tree over the 16 lanes; the tail past a multiple of
/// 64 is added in f64. Same inputs, same bits, whatever the batch.
#[inline(always)]
fn dot_f16_order(a: &[f32], b: &[f32]) -> f32 {
    let full = a.len() / 64 * 64;
    let mut acc = [[0f32; 16]; 4];
    for (ca, cb) in a[..full].chunks_exact(64).zip(b[..full].chunks_exact(64)) {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, v) in lanes.iter_mut().enumerate() {
                *v = ca[j * 16 + l].mul_add(cb[j * 16 + l], *v);
            }
        }
    }
    let mut r = [0f32; 16];
    for (l, v) in r.iter_mut().enumerate() {
        *v = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let mut t8 = [0f32; 8];
    for (l, v) in t8.iter_mut().enumerate() {
        *v = r[l] + r[l + 8];
    }
    let t4 = [t8[0] + t8[4], t8[1] + t8[5], t8[2] + t8[6], t8[3] + t8[7]];
    let mut sum = ((t4[0] + t4[2]) + (t4[1] + t4[3])) as f64;
    for (x, y) in a[full..].iter().zip(&b[full..]) {
        sum += (x * y) as f64;
    }
    sum as f32
}

/// Rounds every value to the nearest f16 (through `scratch`).
#[inline(always)]
fn round_to_f16(x: &mut [f32], scratch: &mut [f16]) {
    scratch.convert_from_f32_slice(x);
    scratch.convert_to_f32_slice(x);
}

/// Plain reference: full scores, f64 softmax (with the sinks in its denominator), no f16
/// rounding of Q.
pub fn attention_ref(
    p: &AttnParams,
    q: &[f32],
    k: &[f16],
    v: &[f16],
    positions: &[usize],
    out: &mut [f32],
) {
    let (hd, nh, nkv) = (p.head_dim, p.n_head, p.n_head_kv);
    let kv_row = nkv * hd;
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..nh {
            let kvh = h / (nh / nkv);
            let qh = &q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
            let start = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let scores: Vec<f64> = (start..=pos)
                .map(|j| {
                    let kr = &k[j * kv_row + kvh * hd..][..hd];
                    let s = qh
                        .iter()
                        .zip(kr)
                        .map(|(&a, b)| a as f64 * b.to_f64())
                        .sum::<f64>()
                        * p.scale as f64;
                    match p.softcap {
                        Some(c) => c as f64 * (s / c as f64).tanh(),
                        None => s,
                    }
                })
                .collect();
            let sink = p.sinks.map(|sk| sk[h] as f64);
            let m = scores
                .iter()
                .copied()
                .chain(sink)
                .fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            // A sink joins the denominator only.
            let sum: f64 = w.iter().sum::<f64>() + sink.map_or(0.0, |sk| (sk - m).exp());
            for d in 0..hd {
                let val: f64 = (start..=pos)
                    .zip(&w)
                    .map(|(j, wj)| wj * v[j * kv_row + kvh * hd + d].to_f64())
                    .sum();
                out[(t * nh + h) * hd + d] = (val / sum) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn online_softmax_matches_reference() {
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for (nh, nkv, hd, window, softcap, sinks) in [
            (4, 2, 16, None, None, false),
            (4, 1, 32, Some(5), None, false),
            (3, 3, 8, None, None, false),
            (4, 2, 64, None, Some(1.5), false),
            (2, 1, 16, Some(3), Some(0.8), false),
            (4, 2, 64, Some(4), None, true),
            (4, 2, 32, None, None, true),
        ] {
            let ctx = 20;
            let positions: Vec<usize> = (12..20).collect();
            let k: Vec<f16> = (0..ctx * nkv * hd)
                .map(|_| f16::from_f32(rng.gen_range(-2.0..2.0)))
                .collect();
            let v: Vec<f16> = (0..ctx * nkv * hd)
                .map(|_| f16::from_f32(rng.gen_range(-2.0..2.0)))
                .collect();
            let q: Vec<f32> = (0..positions.len() * nh * hd)
                .map(|_| rng.gen_range(-2.0..2.0))
                .collect();
            // Sinks both above and below the scores (some heads' sink dominates).
            let sink_logits: Vec<f32> = (0..nh).map(|_| rng.gen_range(-3.0..6.0)).collect();
            let p = AttnParams {
                n_head: nh,
                n_head_kv: nkv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                window,
                softcap,
                sinks: sinks.then_some(&sink_logits[..]),
            };
            let mut a = vec![0.0; q.len()];
            let mut b = vec![0.0; q.len()];
            attention(&p, &q, &k, &v, &positions, &mut a);
            attention_ref(&p, &q, &k, &v, &positions, &mut b);
            for (x, y) in a.iter().zip(&b) {
                // Q is rounded to f16 and V.p accumulates in f16 (rel. 2^-11 per step): 1e-2 absolute.
                assert!(
                    x.is_finite() && (x - y).abs() < 5e-3,
                    "seed {seed}: {x} vs {y}"
                );
            }
        }
    }

    /// The AVX2 kernel against the portable one, bit for bit (see [`rows_match_portable_bits`]).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_rows_match_portable_bits() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            eprintln!("skipped: the CPU lacks AVX2, FMA or F16C");
            return;
        }
        rows_match_portable_bits("avx2", |rows, n, hd, o| {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked above); head_dim is 8 * NV.
            unsafe {
                match hd {
                    64 => attend_rows_avx2_n::<8>(rows, n, o),
                    128 => attend_rows_avx2_n::<16>(rows, n, o),
                    _ => attend_rows_avx2_n::<32>(rows, n, o),
                }
            }
        });
    }

    /// The AVX-512 kernel against the portable one, bit for bit (see
    /// [`rows_match_portable_bits`]).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_rows_match_portable_bits() {
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            eprintln!("skipped: the CPU lacks AVX-512F, AVX2, FMA or F16C");
            return;
        }
        rows_match_portable_bits("avx512", |rows, n, hd, o| {
            // SAFETY: the CPU has AVX-512F, AVX2, FMA and F16C (checked above); head_dim is
            // 16 * NV.
            unsafe {
                match hd {
                    64 => attend_rows_avx512_n::<4>(rows, n, o),
                    128 => attend_rows_avx512_n::<8>(rows, n, o),
                    _ => attend_rows_avx512_n::<16>(rows, n, o),
                }
            }
        });
    }

    /// A multi-row kernel (`kernel(rows, n, head_dim, out)` runs the first n rows) against the
    /// portable one, bit for bit: head dims 64, 128 and 256, 1 to 8 query heads per KV head (run
    /// 1 to 4 at a time, as `run` splits them), 1 to 300 keys, sliding windows, sinks,
    /// soft-capping, and paged caches of 1, 4, 16 or 32 rows a block with shuffled tables. Large Q
    /// scales make the running max move often (many rescales).
    #[cfg(target_arch = "x86_64")]
    fn rows_match_portable_bits(name: &str, kernel: impl Fn(&[Row; 4], usize, usize, &mut [f32])) {
        use rand::seq::SliceRandom;
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for case in 0..300 {
            let hd = [64, 128, 256][case % 3];
            let group = rng.gen_range(1..=8);
            let nkv = rng.gen_range(1..=2);
            let nh = group * nkv;
            let bs = [1usize, 4, 16, 32][rng.gen_range(0..4)];
            let pos = rng.gen_range(0..300);
            let n_blocks = pos / bs + 1;
            let phys = n_blocks + rng.gen_range(0..3);
            let mut table: Vec<u32> = (0..phys as u32).collect();
            table.shuffle(&mut rng);
            table.truncate(n_blocks);
            let kv_row = nkv * hd;
            let k: Vec<f16> = (0..phys * bs * kv_row)
                .map(|_| f16::from_f32(rng.gen_range(-2.0..2.0)))
                .collect();
            let v: Vec<f16> = (0..phys * bs * kv_row)
                .map(|_| f16::from_f32(rng.gen_range(-2.0..2.0)))
                .collect();
            let window = rng.gen_bool(0.3).then(|| rng.gen_range(1..=pos + 8));
            let start = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let softcap = rng.gen_bool(0.3).then(|| rng.gen_range(0.5..30.0f32));
            let qs = [0.5f32, 2.0, 8.0][rng.gen_range(0..3)];
            let q: Vec<f32> = (0..nh * hd).map(|_| rng.gen_range(-qs..qs)).collect();
            let sinks: Option<Vec<f32>> = rng
                .gen_bool(0.4)
                .then(|| (0..nh).map(|_| rng.gen_range(-3.0..12.0)).collect());
            let scale = 1.0 / (hd as f32).sqrt();
            // Prefetching (a hint) must not change a bit.
            let fetch = [Fetch::OwnV, Fetch::WholeRows, Fetch::None][rng.gen_range(0..3)];
            let row = |h: usize| Row {
                q: &q[h * hd..(h + 1) * hd],
                k: &k,
                v: &v,
                table: &table,
                shift: bs.trailing_zeros(),
                at: (h / group) * hd,
                kv_row,
                keys: start..pos + 1,
                scale: softcap.map_or(scale, |c| scale / c),
                softcap,
                sink: sinks.as_ref().map(|s| s[h]),
                fetch,
            };
            for kvh in 0..nkv {
                let mut h0 = kvh * group;
                while h0 < (kvh + 1) * group {
                    let n = rng.gen_range(1..=4).min((kvh + 1) * group - h0);
                    let rows: [Row; 4] = core::array::from_fn(|i| row(h0 + i.min(n - 1)));
                    let mut a = vec![f32::NAN; n * hd];
                    kernel(&rows, n, hd, &mut a);
                    for (i, a) in a.chunks_exact(hd).enumerate() {
                        let mut b = vec![f32::NAN; hd];
                        attend_row(&rows[i], &mut b);
                        let bad = a
                            .iter()
                            .zip(&b)
                            .position(|(x, y)| x.is_nan() || x.to_bits() != y.to_bits());
                        assert!(
                            bad.is_none(),
                            "{name}: seed {seed}: case {case}: head_dim {hd}, group {group}, head {}, \
                             keys {start}..={pos}, block {bs}, softcap {softcap:?}, sink {:?}: \
                             lane {}: {} vs portable {}",
                            h0 + i,
                            rows[i].sink,
                            bad.unwrap(),
                            a[bad.unwrap()],
                            b[bad.unwrap()]
                        );
                    }
                    h0 += n;
                }
            }
        }
    }
}
