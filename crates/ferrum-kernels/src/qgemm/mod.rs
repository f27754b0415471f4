//! 8-bit integer GEMM for the graph runtime's quantized products (`MatMulInteger`, and the
//! dynamically quantized `MatMul` that ONNX Runtime's `quantize_dynamic` writes:
//! `DynamicQuantizeLinear` -> `MatMulInteger` -> `Cast` -> `Mul` by the two scales -> `Add` bias).
//!
//! `C = (A - za) (B - zb)` with A `m x k` unsigned 8-bit (an activation), B `k x n` signed or
//! unsigned 8-bit (a weight, or a second activation), zero points per tensor, per row of A or
//! per column of B; C exact in i32 (wrapping, as the reference's i32 output), or converted to
//! f32 in the epilogue: `c as f32 * scale[j] (+ bias[j])`, the two roundings of the unfused
//! `Cast`, `Mul`, `Add` chain, so fusing changes no bit.
//!
//! B is packed once ([`PackedI8`]) for the kernel the CPU runs, as signed values (an unsigned B
//! stored as `b - 128`, the 128 given back in the correction below), the inner dimension padded
//! with zeros to a multiple of 4, in one of two layouts:
//! - [`Layout::Quads`] (AVX-512 VNNI): bytes in panels of 16 columns, k in groups of 4: panel
//!   `p`, group `g`, column `c`, byte `r` at `p * kp * 16 + g * 64 + c * 4 + r`, the operand
//!   order of `vpdpbusd` (u8 x s8, four products summed into each i32 lane, no saturation): one
//!   64-byte load is one group of a panel, a row's 4 bytes of A broadcast to every lane;
//! - [`Layout::Tiles`] (AMX): the bytes of `Quads` with the inner dimension padded to a multiple
//!   of 64, so 16 consecutive groups of a panel (1 KiB) are one `tdpbusd` B tile (16 rows of
//!   64 bytes), and 64 bytes of 16 rows of A one A tile;
//! - [`Layout::Pairs`] (AVX2): 16-bit values in panels of 8 columns, k in pairs: panel `p`, pair
//!   `g`, column `c`, element `r` at `p * kp * 8 + g * 16 + c * 2 + r`, for `vpmaddwd` (i16 x
//!   i16, two products summed into each i32 lane: exact, where `vpmaddubsw` would saturate on
//!   u8 x s8), A widened to 16 bits once per product (into a buffer the thread keeps).
//!
//! With `B = Bs + off` (`off` 0 or 128) the zero points come out as
//!
//! `sum_k (a - za)(b - zb) = sum_k a Bs - za colsum(Bs) + (off - zb) (rowsum(a) - k za)`,
//!
//! so the inner loop is the raw product only; the rest is added per tile.
//!
//! Kernels: AMX (`32 x 32` blocks: two A tiles, two B tiles and four i32 C tiles of 16 x 16 in
//! the tile registers, the 8 KiB tile file; rows left over below 32 go to the VNNI tile), AVX-512
//! VNNI (`6 x 64` tiles: 24 accumulators, 4 panel loads and 6 broadcasts per
//! group of 4), AVX2 (`6 x 16` tiles: 12 accumulators, 2 panel loads and 6 broadcasts per pair:
//! with the product's temporary that is all 16 registers; `4 x 24` spilled and ran at 0.6x)
//! and a portable one that reads either layout; [`qgemm_ref`] is the plain reference the
//! randomized tests compare each with (integers: equal, not close). A may also be gathered
//! ([`qgemm_gathered`]: a convolution's patches read where they lie in the image, through a table
//! of offsets, by the VNNI kernel; written out as rows for the others). The threads split C into
//! column blocks (and row ranges when there are too few blocks); each element's sum is the same
//! whatever the split.

#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::cell::RefCell;

use crate::aligned::Aligned;
use crate::{cpu, pool};

/// How a [`PackedI8`] lies in memory (see the module notes), and so which kernels read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Bytes, panels of 16 columns, k in groups of 4 (AVX-512 VNNI, portable).
    Quads,
    /// `Quads` with k padded to a multiple of 64 (AMX; VNNI and portable read it too).
    Tiles,
    /// 16-bit values, panels of 8 columns, k in pairs (AVX2, portable).
    Pairs,
}

impl Layout {
    /// Columns per panel.
    pub fn panel(self) -> usize {
        match self {
            Layout::Quads | Layout::Tiles => 16,
            Layout::Pairs => 8,
        }
    }
    /// Rows of the SIMD kernel's tile, and panels per tile.
    fn tile(self) -> (usize, usize) {
        match self {
            Layout::Quads => (6, 4),
            Layout::Tiles => (32, 2),
            Layout::Pairs => (6, 2),
        }
    }
    /// k values per packed step of a column (4 bytes, or 2 pairs of 16 bits).
    fn step(self) -> usize {
        match self {
            Layout::Quads | Layout::Tiles => 4,
            Layout::Pairs => 2,
        }
    }
    /// What the inner dimension is padded to.
    fn k_align(self) -> usize {
        match self {
            Layout::Tiles => 64,
            Layout::Quads | Layout::Pairs => 4,
        }
    }
    /// Stored as bytes (else as 16-bit values).
    fn bytes(self) -> bool {
        self != Layout::Pairs
    }

    /// The layout of this process's best kernel.
    pub fn for_cpu() -> Layout {
        if use_amx() {
            Layout::Tiles
        } else if use_vnni() || !cpu::features().x86_simd() {
            Layout::Quads
        } else {
            Layout::Pairs
        }
    }
}
/// Multiply-adds below which a product stays on one thread.
const MIN_PARALLEL_MACS: usize = 1 << 18;

/// An 8-bit matrix's elements, signed or unsigned, read through strides: `(i, j)` at
/// `i * rs + j * cs`.
#[derive(Clone, Copy, Debug)]
pub enum Bytes<'a> {
    I8(&'a [i8]),
    U8(&'a [u8]),
}

/// The right operand (`k x n`) packed for the kernels; see the module notes for the layout.
#[derive(Clone, Debug)]
pub struct PackedI8 {
    k: usize,
    n: usize,
    /// `k` rounded up to the layout's multiple (4, or 64 for `Tiles`).
    kp: usize,
    layout: Layout,
    /// `Quads`, `Tiles`: the bytes (64-byte aligned: a tile row within one cache line);
    /// `Pairs`: empty.
    data: Aligned,
    /// `Pairs`: the 16-bit values; else empty.
    wide: Vec<i16>,
    /// Per column: the sum of its stored (signed) bytes.
    col_sums: Vec<i32>,
    /// 128 when B was unsigned (stored as `b - 128`), else 0.
    offset: i32,
}

impl PackedI8 {
    /// Packs B (`k x n`, element `(i, j)` at `i * rs + j * cs` of `b`) for this CPU's kernel.
    pub fn new(k: usize, n: usize, b: Bytes, rs: usize, cs: usize) -> PackedI8 {
        PackedI8::with_layout(k, n, b, rs, cs, Layout::for_cpu())
    }

    /// Packs B in `layout`.
    pub fn with_layout(
        k: usize,
        n: usize,
        b: Bytes,
        rs: usize,
        cs: usize,
        layout: Layout,
    ) -> PackedI8 {
        let kp = k.div_ceil(layout.k_align()) * layout.k_align();
        let (w, step) = (layout.panel(), layout.step());
        let len = n.div_ceil(w) * kp * w;
        let mut data = Aligned::zeroed(if layout.bytes() { len } else { 0 });
        let mut wide = vec![0i16; if layout.bytes() { 0 } else { len }];
        let mut col_sums = vec![0i32; n];
        let offset = if matches!(b, Bytes::U8(_)) { 128 } else { 0 };
        // One column at a time: gathered (unsigned bytes stored as b - 128, i.e. the top bit
        // flipped), summed, then laid out in its panel, k in steps.
        let mut col = vec![0i8; k];
        for (j, sum) in col_sums.iter_mut().enumerate() {
            match b {
                Bytes::I8(v) => {
                    for (i, d) in col.iter_mut().enumerate() {
                        *d = v[i * rs + j * cs];
                    }
                }
                Bytes::U8(v) => {
                    for (i, d) in col.iter_mut().enumerate() {
                        *d = (v[i * rs + j * cs] ^ 0x80) as i8;
                    }
                }
            }
            *sum = col.iter().map(|&v| v as i32).sum();
            let base = (j / w) * kp * w + (j % w) * step;
            for (g, part) in col.chunks(step).enumerate() {
                let at = base + g * step * w;
                if layout.bytes() {
                    data.i8s_mut()[at..at + part.len()].copy_from_slice(part);
                } else {
                    for (d, &v) in wide[at..at + part.len()].iter_mut().zip(part) {
                        *d = v as i16;
                    }
                }
            }
        }
        PackedI8 {
            k,
            n,
            kp,
            layout,
            data,
            wide,
            col_sums,
            offset,
        }
    }

    /// The layout these values were packed in.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Stored element `(i, j)` (`i < kp`: the padding reads 0), whatever the layout.
    #[inline(always)]
    fn at(&self, i: usize, j: usize) -> i32 {
        let (w, step) = (self.layout.panel(), self.layout.step());
        let at = (j / w) * self.kp * w + (i / step) * step * w + (j % w) * step + i % step;
        if self.layout.bytes() {
            self.data.i8s()[at] as i32
        } else {
            self.wide[at] as i32
        }
    }

    /// Rows (`k`).
    /// K padded as the kernels read A's rows (whole groups of 4, or of 64 for the tile unit).
    pub fn kp(&self) -> usize {
        self.kp
    }

    pub fn k(&self) -> usize {
        self.k
    }

    /// Columns (`n`).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.data.len() + 2 * self.wide.len() + 4 * self.col_sums.len()
    }
}

/// The left operand: `m x k` unsigned bytes, row `i` at `data[i * ld..]`, with its zero point
/// per tensor (one value) or per row (`m` values).
#[derive(Clone, Copy, Debug)]
pub struct QuantA<'a> {
    pub data: &'a [u8],
    pub m: usize,
    pub ld: usize,
    pub zero: &'a [i32],
    /// Bytes `k..ld` of every row are zero: with `ld` equal to [`PackedI8::kp`], the kernels
    /// read the rows in place (else they are copied, padded with zeros).
    pub zero_padded: bool,
}

/// A's rows gathered from an image instead of stored (a convolution's patches, never written
/// out: the indirect convolution of Dukhan 2019): row `p`'s `k = taps * run` bytes are `taps`
/// runs of `run` bytes, run `t` at `image[offsets[p * taps + t]..]`, or `fill` (`run` bytes of
/// the padding's value, made once by the caller) where that offset is [`Gathered::PAD`].
#[derive(Clone, Copy, Debug)]
pub struct Gathered<'a> {
    pub image: &'a [u8],
    pub offsets: &'a [u32],
    pub taps: usize,
    pub run: usize,
    pub fill: &'a [u8],
}

impl Gathered<'_> {
    /// The offset of a run that lies in the padding.
    pub const PAD: u32 = u32::MAX;

    /// Run `t` of row `p` (the fill run for a padding run).
    fn run_of(&self, p: usize, t: usize) -> &[u8] {
        match self.offsets[p * self.taps + t] {
            Gathered::PAD => self.fill,
            o => &self.image[o as usize..o as usize + self.run],
        }
    }

    /// Rows `first..` written out into `out`, `ld` bytes apart with zeros past `k`.
    fn write_rows(&self, first: usize, ld: usize, out: &mut [u8]) {
        for (r, row) in out.chunks_exact_mut(ld).enumerate() {
            let (runs, tail) = row.split_at_mut(self.taps * self.run);
            for (t, dst) in runs.chunks_exact_mut(self.run).enumerate() {
                dst.copy_from_slice(self.run_of(first + r, t));
            }
            tail.fill(0);
        }
    }
}

/// What the product writes, row-major with leading dimension `ld`.
pub enum QOut<'a> {
    /// The exact integer product.
    I32 { out: &'a mut [i32], ld: usize },
    /// `c as f32 * scale[j] + bias[j]` (`scale`: one value or `n`; `bias`: `n`, optional).
    F32 {
        out: &'a mut [f32],
        ld: usize,
        scale: &'a [f32],
        bias: Option<&'a [f32]>,
    },
    /// Requantized to 8 bits: `clamp(round_half_even(y) + zero)` of the [`QOut::F32`] value
    /// `y`, for unsigned (`0..=255`) or signed (`-128..=127`, stored as its byte) outputs;
    /// `y` is first held within `+-65536` (a NaN `y` counts as +65536), beyond any 8-bit
    /// result. Element `(i, j)` at `i * rs + j * cs`, so the output may be stored transposed.
    Q8 {
        out: &'a mut [u8],
        rs: usize,
        cs: usize,
        scale: &'a [f32],
        bias: Option<&'a [f32]>,
        zero: i32,
        signed: bool,
    },
}

/// [`QOut::Q8`]'s bound on the float value before rounding.
const Q8_HOLD: f32 = 65536.0;

/// [`QOut::Q8`]'s requantization of one float value.
#[inline(always)]
fn requantize(y: f32, zero: i32, signed: bool) -> u8 {
    // NaN as +Q8_HOLD: what `vminps(y, hold)` gives in the SIMD form.
    let held = if y.is_nan() {
        Q8_HOLD
    } else {
        y.clamp(-Q8_HOLD, Q8_HOLD)
    };
    let r = held.round_ties_even() as i32 + zero;
    if signed {
        r.clamp(-128, 127) as i8 as u8
    } else {
        r.clamp(0, 255) as u8
    }
}

/// How a tile's integer sums are finished and stored: shared by every kernel, so they store
/// alike.
struct Finish<'a> {
    b: &'a PackedI8,
    /// Per row of A: `rowsum(a) - k za` and `za`.
    row_terms: &'a [(i32, i32)],
    /// Per column: `off - zb` (one value, or `n`).
    b_terms: &'a [i32],
    /// Every `b_terms` value is 0 (so are the row sums in `row_terms`, never computed).
    b_terms_zero: bool,
    /// A's zero point when it is one for all rows.
    za: Option<i32>,
    out: OutPtr,
    scale: &'a [f32],
    bias: Option<&'a [f32]>,
}

#[derive(Clone, Copy)]
enum OutPtr {
    I32(*mut i32, usize),
    F32(*mut f32, usize),
    /// Bytes at `i * rs + j * cs`, the zero point, signed.
    Q8 {
        p: *mut u8,
        rs: usize,
        cs: usize,
        zero: i32,
        signed: bool,
    },
}

// SAFETY: the pointer is written only at the (row, column) elements of the task's own tile; tasks
// get disjoint tiles and the output stays borrowed mutably for the whole product.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl Finish<'_> {
    /// Finishes and stores one element (row `i`, column `j`) from its raw sum `sum_k a Bs`.
    #[inline(always)]
    fn value_i32(&self, i: usize, j: usize, raw: i32) -> i32 {
        let (rs, za) = self.row_terms[i];
        let bt = self.b_terms[if self.b_terms.len() == 1 { 0 } else { j }];
        raw.wrapping_sub(za.wrapping_mul(self.b.col_sums[j]))
            .wrapping_add(bt.wrapping_mul(rs))
    }

    /// Stores row `i`'s columns `j0..j0 + raw.len()`.
    fn store(&self, i: usize, j0: usize, raw: &[i32]) {
        match self.out {
            OutPtr::I32(p, ld) => {
                for (c, &r) in raw.iter().enumerate() {
                    let v = self.value_i32(i, j0 + c, r);
                    // SAFETY: (i, j0 + c) is in this task's tile (see OutPtr).
                    unsafe { *p.add(i * ld + j0 + c) = v };
                }
            }
            OutPtr::F32(p, ld) => {
                for (c, &r) in raw.iter().enumerate() {
                    let j = j0 + c;
                    let v = self.value_f32(i, j, r);
                    // SAFETY: (i, j) is in this task's tile (see OutPtr).
                    unsafe { *p.add(i * ld + j) = v };
                }
            }
            OutPtr::Q8 {
                p,
                rs,
                cs,
                zero,
                signed,
            } => {
                for (c, &r) in raw.iter().enumerate() {
                    let j = j0 + c;
                    let v = requantize(self.value_f32(i, j, r), zero, signed);
                    // SAFETY: (i, j) is in this task's tile (see OutPtr).
                    unsafe { *p.add(i * rs + j * cs) = v };
                }
            }
        }
    }

    /// The float value of element `(i, j)`: `c as f32 * scale[j] + bias[j]`, multiply then add.
    #[inline(always)]
    fn value_f32(&self, i: usize, j: usize, raw: i32) -> f32 {
        let s = self.scale[if self.scale.len() == 1 { 0 } else { j }];
        let mut v = self.value_i32(i, j, raw) as f32 * s;
        if let Some(b) = self.bias {
            v += b[j];
        }
        v
    }
}

/// Which kernel runs a product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Portable,
    /// AVX2 over [`Layout::Pairs`].
    Avx2,
    /// AVX-512 VNNI over [`Layout::Quads`] or [`Layout::Tiles`].
    Vnni,
    /// AMX over [`Layout::Tiles`] (rows below a whole block on the VNNI tile).
    Amx,
}

/// The kernel for `b` on this CPU: its layout's SIMD kernel when the CPU runs it, else the
/// portable one (which reads both layouts).
fn kernel_for(b: &PackedI8) -> Kernel {
    match b.layout {
        Layout::Tiles if use_amx() => Kernel::Amx,
        Layout::Quads | Layout::Tiles if use_vnni() => Kernel::Vnni,
        Layout::Pairs if cfg!(target_arch = "x86_64") && cpu::features().x86_simd() => Kernel::Avx2,
        _ => Kernel::Portable,
    }
}

/// `(A - za)(B - zb)` into `out`; `b_zero` is one value or `n` (per column).
///
/// Panics when the shapes disagree (`a` too short for `m x k` with its `ld`, `out` too short,
/// `scale`/`bias`/zero-point lengths wrong): callers check shapes and report errors first.
pub fn qgemm(a: QuantA, b: &PackedI8, b_zero: &[i32], out: QOut) {
    qgemm_on(a, b, b_zero, out, kernel_for(b))
}

/// [`qgemm`] with A's `m` rows gathered (see [`Gathered`]; `zero` as [`QuantA::zero`]): the
/// VNNI kernel reads the runs where they lie when `run` is a multiple of 4; other kernels get
/// the rows written out first. The same integers either way.
pub fn qgemm_gathered(
    a: Gathered,
    m: usize,
    zero: &[i32],
    b: &PackedI8,
    b_zero: &[i32],
    out: QOut,
) {
    qgemm_gathered_on(a, m, zero, b, b_zero, out, kernel_for(b))
}

fn qgemm_gathered_on(
    a: Gathered,
    m: usize,
    zero: &[i32],
    b: &PackedI8,
    b_zero: &[i32],
    out: QOut,
    kernel: Kernel,
) {
    assert_eq!(a.taps * a.run, b.k, "gathered A: taps * run is not B's k");
    assert_eq!(
        a.fill.len(),
        a.run,
        "gathered A: the fill run is not `run` bytes"
    );
    assert!(a.offsets.len() >= m * a.taps, "gathered A: too few offsets");
    // Every run inside the image: one branch-free pass (it vectorizes).
    let last = a
        .image
        .len()
        .checked_sub(a.run)
        .map(|l| l.min(u32::MAX as usize - 1));
    assert!(
        a.offsets[..m * a.taps].iter().fold(true, |ok, &o| ok
            & (o == Gathered::PAD || last.is_some_and(|l| o as usize <= l))),
        "gathered A: a run outside the image"
    );
    if kernel == Kernel::Vnni && a.run.is_multiple_of(4) {
        assert!(zero.len() == 1 || zero.len() == m, "A zero points");
        assert!(b_zero.len() == 1 || b_zero.len() == b.n, "B zero points");
        if m == 0 || b.n == 0 {
            return;
        }
        return qgemm_core(ASrc::Gathered(a), m, zero, b, b_zero, out, kernel);
    }
    let ld = b.kp;
    let mut rows = vec![0u8; m * ld];
    a.write_rows(0, ld, &mut rows);
    qgemm_on(
        QuantA {
            data: &rows,
            m,
            ld,
            zero,
            zero_padded: true,
        },
        b,
        b_zero,
        out,
        kernel,
    )
}

/// Where the kernels read A: stored rows (`lda` apart, `kp` readable bytes each), or gathered
/// (the VNNI kernel only).
#[derive(Clone, Copy)]
enum ASrc<'a> {
    Rows(&'a [u8], usize),
    Gathered(Gathered<'a>),
}

fn qgemm_on(a: QuantA, b: &PackedI8, b_zero: &[i32], out: QOut, kernel: Kernel) {
    let (m, k, n) = (a.m, b.k, b.n);
    assert!(a.zero.len() == 1 || a.zero.len() == m, "A zero points");
    assert!(b_zero.len() == 1 || b_zero.len() == n, "B zero points");
    assert!(
        m == 0 || a.data.len() >= (m - 1) * a.ld + k,
        "A is too short"
    );
    if m == 0 || n == 0 {
        return;
    }
    // A's rows as the kernels read them: padded with zeros to B's `kp` (whole groups of 4, or of
    // 64 for the tile unit); for the tile unit also copied when its rows do not start on cache
    // lines (a tile row straddling two lines costs two).
    let padded;
    let misaligned = kernel == Kernel::Amx
        && (!(a.data.as_ptr() as usize).is_multiple_of(64) || !a.ld.is_multiple_of(64));
    let in_place = k == b.kp || (a.zero_padded && a.ld == b.kp);
    let (adata, lda) = if in_place && !misaligned {
        (a.data, a.ld)
    } else {
        padded = pad_rows(a.data, m, k, a.ld, b.kp);
        (padded.bytes(), b.kp)
    };
    qgemm_core(ASrc::Rows(adata, lda), m, a.zero, b, b_zero, out, kernel)
}

/// The product once A's source is settled (rows holding `kp` readable bytes each, or gathered
/// for the VNNI kernel), for `m, n > 0`.
fn qgemm_core(
    asrc: ASrc,
    m: usize,
    zero: &[i32],
    b: &PackedI8,
    b_zero: &[i32],
    out: QOut,
    kernel: Kernel,
) {
    let (k, n) = (b.k, b.n);
    let (adata, lda) = match asrc {
        ASrc::Rows(d, l) => (d, l),
        ASrc::Gathered(_) => (&[][..], 0),
    };
    // The per-row and per-column terms in this thread's buffers, kept between products (a
    // product's `m` rows are kilobytes of them): taken out for the call, so a product run
    // inside another on this thread finds them empty rather than borrowed.
    let (mut row_terms, mut b_terms) = TERMS.take();
    b_terms.clear();
    b_terms.extend(b_zero.iter().map(|&z| b.offset - z));
    // A's row sums enter only through `off - zb`: none are needed when that is 0 for every
    // column (a signed weight with zero point 0, as symmetric quantization writes).
    let b_terms_zero = b_terms.iter().all(|&t| t == 0);
    fill_row_terms(asrc, m, k, zero, !b_terms_zero, &mut row_terms);
    let (row_terms_ref, b_terms_ref) = (&row_terms, &b_terms);
    // Everything else, given A widened to 16 bits (`kp` per row) when the AVX2 kernel runs.
    let rest = move |awide: &[u16]| {
        let (out_ptr, scale, bias) = match out {
            QOut::I32 { out, ld } => {
                assert!(out.len() >= (m - 1) * ld + n, "C is too short");
                (OutPtr::I32(out.as_mut_ptr(), ld), &[][..], None)
            }
            QOut::F32 {
                out,
                ld,
                scale,
                bias,
            } => {
                assert!(out.len() >= (m - 1) * ld + n, "C is too short");
                assert!(scale.len() == 1 || scale.len() == n, "scale length");
                assert!(bias.is_none_or(|b| b.len() == n), "bias length");
                (OutPtr::F32(out.as_mut_ptr(), ld), scale, bias)
            }
            QOut::Q8 {
                out,
                rs,
                cs,
                scale,
                bias,
                zero,
                signed,
            } => {
                assert!(out.len() > (m - 1) * rs + (n - 1) * cs, "C is too short");
                assert!(scale.len() == 1 || scale.len() == n, "scale length");
                assert!(bias.is_none_or(|b| b.len() == n), "bias length");
                let p = out.as_mut_ptr();
                (
                    OutPtr::Q8 {
                        p,
                        rs,
                        cs,
                        zero,
                        signed,
                    },
                    scale,
                    bias,
                )
            }
        };
        let fin = Finish {
            b,
            row_terms: row_terms_ref,
            b_terms: b_terms_ref,
            b_terms_zero,
            za: (zero.len() == 1).then(|| zero[0]),
            out: out_ptr,
            scale,
            bias,
        };
        let (mr, np_max) = b.layout.tile();
        let panels = n.div_ceil(b.layout.panel());
        let blocks = panels.div_ceil(np_max);
        let tiles = m.div_ceil(mr);
        let threads = if m * n * k < MIN_PARALLEL_MACS {
            1
        } else {
            pool::threads()
        };
        // Row chunks (whole tiles) per column block: enough tasks for two per thread.
        let chunks = (2 * threads).div_ceil(blocks).clamp(1, tiles);
        let per = tiles.div_ceil(chunks);
        let chunks = tiles.div_ceil(per);
        let task = |t: usize| {
            let (blk, ch) = (t / chunks, t % chunks);
            let rows = ch * per * mr..((ch + 1) * per * mr).min(m);
            let p0 = blk * np_max;
            let np = np_max.min(panels - p0);
            match kernel {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `kernel_for` chose VNNI only where the CPU has AVX-512 F/BW/VL + VNNI, on
                // a `Quads` B; rows and panels are in range; A's rows hold `kp` readable bytes
                // each (k % 4 == 0, or padded above).
                // A gathered only for this kernel (`qgemm_gathered_on`), which then checked
                // every run inside the image and `taps * run == k`, run a multiple of 4.
                Kernel::Vnni => unsafe {
                    match asrc {
                        ASrc::Rows(..) => x86::block_vnni(adata, lda, rows, p0, np, &fin),
                        ASrc::Gathered(g) => x86::block_vnni_gathered(&g, rows, p0, np, &fin),
                    }
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `kernel_for` chose AMX only where the CPU has it (with AVX-512 VNNI, and
                // the OS granted the tile state), on a `Tiles` B (kp a multiple of 64); rows and
                // panels (at most 2) in range; A's rows hold `kp` readable bytes each.
                Kernel::Amx => unsafe { x86::block_amx(adata, lda, rows, p0, np, &fin) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2 chosen only where the CPU has it, on a `Pairs` B; `awide` holds `kp`
                // values for each of the m rows (widened below).
                Kernel::Avx2 => unsafe { x86::block_avx2(awide, b.kp, rows, p0, np, &fin) },
                _ => block_portable(adata, lda, rows, p0, np, &fin),
            }
        };
        if threads == 1 || blocks * chunks == 1 {
            (0..blocks * chunks).for_each(task);
        } else {
            pool::parallel_for(blocks * chunks, task);
        }
    };
    if kernel == Kernel::Avx2 {
        // The 16-bit copy of A lives in this thread's buffer, kept between products.
        WIDE.with(|cell| {
            let mut wide = cell.borrow_mut();
            widen_rows(adata, m, lda, b.kp, &mut wide);
            rest(&wide[..m * b.kp]);
        });
    } else {
        rest(&[]);
    }
    TERMS.set((row_terms, b_terms));
}

/// True when [`qgemm_gathered`] reads runs of `run` bytes where they lie (no rows written out)
/// in a product with `b`.
pub fn reads_gathered(run: usize, b: &PackedI8) -> bool {
    kernel_for(b) == Kernel::Vnni && run.is_multiple_of(4)
}

/// True when the AVX-512 VNNI kernel runs (this process's tier).
pub fn use_vnni() -> bool {
    cfg!(target_arch = "x86_64") && cpu::features().tier() == cpu::Tier::Avx512Vnni
}

/// True when the AMX kernel runs: the VNNI tier, and AMX-INT8 granted by the OS.
pub fn use_amx() -> bool {
    use_vnni() && cpu::features().amx_int8
}

/// A's rows copied `kp` apart (zeros past `k`) into 64-byte aligned memory.
fn pad_rows(a: &[u8], m: usize, k: usize, ld: usize, kp: usize) -> Aligned {
    let mut v = Aligned::zeroed(m * kp);
    for (i, row) in v
        .bytes_mut()
        .chunks_exact_mut(kp.max(1))
        .enumerate()
        .take(m)
    {
        row[..k].copy_from_slice(&a[i * ld..i * ld + k]);
    }
    v
}

thread_local! {
    /// A widened to 16 bits for the AVX2 kernel: kept by each thread that runs products, so a
    /// product writes it without allocating (and zeroing) it again.
    static WIDE: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
    /// A product's per-row terms (row sum times the B offset less the zero point's, A's zero
    /// point) and per-column terms (`offset - zb`), kept by each thread that runs products.
    #[allow(clippy::type_complexity)]
    static TERMS: std::cell::Cell<(Vec<(i32, i32)>, Vec<i32>)> =
        const { std::cell::Cell::new((Vec::new(), Vec::new())) };
}

/// A's rows widened to 16 bits into `v` (`kp` per row: the AVX2 kernel broadcasts a pair as
/// one i32); split across the pool for large A.
fn widen_rows(a: &[u8], m: usize, ld: usize, kp: usize, v: &mut Vec<u16>) {
    if v.len() < m * kp {
        v.resize(m * kp, 0);
    }
    let rows = (1usize << 16).div_ceil(kp).max(1);
    let widen = |c: usize, out: &mut [u16]| {
        for (r, row) in out.chunks_exact_mut(kp).enumerate() {
            let i = c * rows + r;
            for (d, &s) in row.iter_mut().zip(&a[i * ld..i * ld + kp]) {
                *d = s as u16;
            }
        }
    };
    if m > rows && pool::threads() > 1 {
        pool::parallel_chunks_mut(&mut v[..m * kp], rows * kp, widen);
    } else {
        widen(0, &mut v[..m * kp]);
    }
}

/// Per row of A into `t` (its `m` values): `(rowsum(a) - k za, za)`, or `(0, za)` without
/// `sums`; split across the pool for large A.
fn fill_row_terms(a: ASrc, m: usize, k: usize, zero: &[i32], sums: bool, t: &mut Vec<(i32, i32)>) {
    let za = |i: usize| zero[if zero.len() == 1 { 0 } else { i }];
    t.clear();
    if !sums {
        t.extend((0..m).map(|i| (0, za(i))));
        return;
    }
    let sum = |i: usize| match a {
        ASrc::Rows(d, ld) => byte_sum(&d[i * ld..i * ld + k]),
        ASrc::Gathered(g) => {
            (0..g.taps).fold(0u32, |s, t| s.wrapping_add(byte_sum(g.run_of(i, t))))
        }
    };
    t.resize(m, (0, 0));
    let rows = (1usize << 16).div_ceil(k.max(1)).max(1);
    let fill = |c: usize, out: &mut [(i32, i32)]| {
        for (r, o) in out.iter_mut().enumerate() {
            let i = c * rows + r;
            let s = sum(i) as i32;
            *o = (s.wrapping_sub((k as i32).wrapping_mul(za(i))), za(i));
        }
    };
    if m > rows && pool::threads() > 1 {
        pool::parallel_chunks_mut(t, rows, fill);
    } else {
        fill(0, t);
    }
}

/// The sum of `v`'s bytes (wrapping past `u32`; exact for rows under 16 M bytes).
pub fn byte_sum(v: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if cpu::features().avx512bw {
        // SAFETY: AVX-512BW checked.
        return unsafe { x86::byte_sum_avx512(v) };
    }
    byte_sum_portable(v)
}

/// [`byte_sum`] in plain code (the reference the SIMD form is tested against).
pub fn byte_sum_portable(v: &[u8]) -> u32 {
    v.iter().fold(0u32, |s, &x| s.wrapping_add(x as u32))
}

/// The portable kernel (either layout): rows `rows` of the column block starting at panel `p0`
/// (`np` panels).
fn block_portable(
    a: &[u8],
    lda: usize,
    rows: std::ops::Range<usize>,
    p0: usize,
    np: usize,
    fin: &Finish,
) {
    let b = fin.b;
    let w = b.layout.panel();
    let mut raw = vec![0i32; w];
    for i in rows {
        let row = &a[i * lda..i * lda + b.kp];
        for p in p0..p0 + np {
            let j0 = p * w;
            let cols = w.min(b.n - j0);
            for (c, r) in raw[..cols].iter_mut().enumerate() {
                *r = row.iter().enumerate().fold(0i32, |s, (kk, &x)| {
                    s.wrapping_add(x as i32 * b.at(kk, j0 + c))
                });
            }
            fin.store(i, j0, &raw[..cols]);
        }
    }
}

/// The plain reference: `(A - za)(B - zb)` in i64 for every element, wrapped to i32 (the
/// reference's i32 output); with `scale`, then `as f32 * scale[j] + bias[j]` (two roundings).
/// `a` is `m x k` row-major; `b` is `k x n` row-major.
#[allow(clippy::too_many_arguments)]
pub fn qgemm_ref(
    m: usize,
    k: usize,
    n: usize,
    a: &[u8],
    a_zero: &[i32],
    b: Bytes,
    b_zero: &[i32],
    scale: Option<(&[f32], Option<&[f32]>)>,
) -> (Vec<i32>, Vec<f32>) {
    let bv = |i: usize| -> i64 {
        match b {
            Bytes::I8(v) => v[i] as i64,
            Bytes::U8(v) => v[i] as i64,
        }
    };
    let mut c = vec![0i32; m * n];
    let mut f = Vec::new();
    for i in 0..m {
        let za = a_zero[if a_zero.len() == 1 { 0 } else { i }] as i64;
        for j in 0..n {
            let zb = b_zero[if b_zero.len() == 1 { 0 } else { j }] as i64;
            let s: i64 = (0..k)
                .map(|p| (a[i * k + p] as i64 - za) * (bv(p * n + j) - zb))
                .sum();
            c[i * n + j] = s as i32;
        }
    }
    if let Some((scale, bias)) = scale {
        f = c
            .iter()
            .enumerate()
            .map(|(e, &v)| {
                let j = e % n;
                let mut y = v as f32 * scale[if scale.len() == 1 { 0 } else { j }];
                if let Some(b) = bias {
                    y += b[j];
                }
                y
            })
            .collect();
    }
    (c, f)
}

/// `DynamicQuantizeLinear`: the scale and zero point that map `[min(x, 0), max(x, 0)]` onto
/// `0..=255` (scale 1 when that range is empty), and `x` quantized with them into `out`:
/// `clamp(round_half_even(x / scale) + zp, 0, 255)`, the division in f32, as ONNX's reference
/// computes it. Split across the pool for large inputs. Returns `(scale, zero_point)`.
pub fn quantize_dynamic_u8(x: &[f32], out: &mut [u8]) -> (f32, u8) {
    assert_eq!(x.len(), out.len());
    const CHUNK: usize = 1 << 15;
    let (mut lo, mut hi) = (0f32, 0f32);
    let ranges: Vec<(f32, f32)> = if x.len() >= 2 * CHUNK && pool::threads() > 1 {
        let parts = std::sync::Mutex::new(Vec::new());
        pool::parallel_for(x.len().div_ceil(CHUNK), |c| {
            let r = min_max(&x[c * CHUNK..((c + 1) * CHUNK).min(x.len())]);
            parts.lock().unwrap().push(r);
        });
        parts.into_inner().unwrap()
    } else {
        vec![min_max(x)]
    };
    for (a, b) in ranges {
        lo = lo.min(a);
        hi = hi.max(b);
    }
    let scale = if hi == lo { 1.0 } else { hi - lo } / 255.0;
    let zp = (0.0 - lo / scale).clamp(0.0, 255.0).round_ties_even();
    if x.len() >= 2 * CHUNK && pool::threads() > 1 {
        pool::parallel_chunks_mut(out, CHUNK, |c, o| {
            quantize_u8(&x[c * CHUNK..c * CHUNK + o.len()], scale, zp, o)
        });
    } else {
        quantize_u8(x, scale, zp, out);
    }
    (scale, zp as u8)
}

/// Min and max of `x` with 0 included (NaN ignored, as `f32::min` does), in 8 lanes the
/// compiler vectorizes.
fn min_max(x: &[f32]) -> (f32, f32) {
    let mut lo = [0f32; 8];
    let mut hi = [0f32; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for l in 0..8 {
            lo[l] = if c[l] < lo[l] { c[l] } else { lo[l] };
            hi[l] = if c[l] > hi[l] { c[l] } else { hi[l] };
        }
    }
    let (mut a, mut b) = (0f32, 0f32);
    for l in 0..8 {
        a = a.min(lo[l]);
        b = b.max(hi[l]);
    }
    for &v in it.remainder() {
        a = a.min(v);
        b = b.max(v);
    }
    (a, b)
}

/// `clamp(round_half_even(x / scale) + zp, 0, 255)` for each element.
pub fn quantize_u8(x: &[f32], scale: f32, zp: f32, out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        let f = cpu::features();
        if f.avx512() {
            // SAFETY: AVX-512 F/BW/VL checked just above; lengths checked inside.
            unsafe { x86::quantize_u8_avx512(x, scale, zp, out) };
            return;
        }
        if f.x86_simd() {
            // SAFETY: AVX2 checked just above; lengths checked inside.
            unsafe { x86::quantize_u8_avx2(x, scale, zp, out) };
            return;
        }
    }
    quantize_u8_portable(x, scale, zp, out);
}

/// The quantized sum of two unsigned 8-bit tensors of one shape (ONNX Runtime's QLinearAdd):
/// per element `QuantizeLinear(DequantizeLinear(a) + DequantizeLinear(b))`, in the chain's own
/// float32 operations: `da = (a - za) * sa`, `db = (b - zb) * sb`, `da + db`, then
/// [`quantize_u8`]'s rule with `sc`, `zc`. The same bits as [`qadd_u8_portable`] on every
/// instruction set.
#[allow(clippy::too_many_arguments)]
pub fn qadd_u8(
    a: &[u8],
    (za, sa): (f32, f32),
    b: &[u8],
    (zb, sb): (f32, f32),
    (zc, sc): (f32, f32),
    out: &mut [u8],
) {
    assert!(
        a.len() == out.len() && b.len() == out.len(),
        "qadd_u8: lengths"
    );
    #[cfg(target_arch = "x86_64")]
    {
        let f = cpu::features();
        if f.avx512() {
            // SAFETY: AVX-512 F/BW/VL checked just above; lengths checked above.
            unsafe { x86::qadd_u8_avx512(a, (za, sa), b, (zb, sb), (zc, sc), out) };
            return;
        }
        if f.x86_simd() {
            // SAFETY: AVX2 checked just above; lengths checked above.
            unsafe { x86::qadd_u8_avx2(a, (za, sa), b, (zb, sb), (zc, sc), out) };
            return;
        }
    }
    qadd_u8_portable(a, (za, sa), b, (zb, sb), (zc, sc), out);
}

/// The portable form of [`qadd_u8`] (and its reference).
pub fn qadd_u8_portable(
    a: &[u8],
    (za, sa): (f32, f32),
    b: &[u8],
    (zb, sb): (f32, f32),
    (zc, sc): (f32, f32),
    out: &mut [u8],
) {
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = quantize_one_u8((x as f32 - za) * sa + (y as f32 - zb) * sb, sc, zc);
    }
}

/// The portable form of [`quantize_u8`] (and its reference).
pub fn quantize_u8_portable(x: &[f32], scale: f32, zp: f32, out: &mut [u8]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = quantize_one_u8(v, scale, zp);
    }
}

/// One value by [`quantize_u8`]'s rule.
#[inline]
fn quantize_one_u8(v: f32, scale: f32, zp: f32) -> u8 {
    ((v / scale).round_ties_even() + zp).clamp(0.0, 255.0) as u8
}
