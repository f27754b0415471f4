//! 3x3 convolution (stride 1, dilation 1, one group) by Winograd's minimal filtering F(2x2, 3x3)
//! (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2015).
//!
//! Each 2 x 2 block of outputs ("tile") comes from the 4 x 4 block of input around it:
//! `Y = A^T [ (G g G^T) . (B^T d B) ] A`, where `g` is a 3 x 3 filter, `d` the 4 x 4 input block
//! and `.` the element-wise product. Summed over the input channels, the 16 element-wise
//! products become 16 independent matrix products, one per position `xi` of the 4 x 4 block:
//! `M_xi = U_xi V_xi` with `U_xi` (`cout x cin`) the transformed filters and `V_xi`
//! (`cin x tiles`) the transformed input. A tile costs 16 multiply-adds per channel pair instead
//! of 36 (2.25x fewer). The transforms use only `0`, `+-1` and `+-1/2`, so the result stays close
//! to the direct sum (the tests bound it against an f64 direct convolution).
//!
//! The filters are transformed and packed for the GEMM once ([`WinogradFilter`]). A run
//! ([`conv3x3`]) splits each image's tiles into groups of tile rows, small enough that a group's
//! transformed input and products stay in the core's L2. A group transforms its input (`V`,
//! `xi x channel x tile`), runs the 16 products on [`crate::gemm`]'s packed microkernels (`M`,
//! `xi x output channel x tile`) and transforms the products back into the output, adding the
//! bias and residual and applying the activation as it writes. With several threads, groups run
//! in parallel when there are enough of them (each thread its own group, start to end);
//! otherwise each group's three steps are split across the threads in turn (channels, products,
//! output channels). The AVX-512 transforms work on 16 tiles per vector; the portable ones are
//! the same arithmetic in the same order.
//!
//! Worth it where the products dominate: enough channels, and enough tiles that the 16/9 larger
//! transformed filters (read from memory at every run) cost less than the multiply-adds saved
//! ([`worthwhile`]).

use std::cell::RefCell;
use std::mem::MaybeUninit;

use crate::gemm::{self, Act, Epilogue, Isa, Lhs, Mat, PackedA, Rhs};
use crate::pool;

/// Positions of the 4 x 4 transformed block.
const XI: usize = 16;

/// Bytes of a group's transformed input or products (`16 x channels x tiles`) aimed for: the
/// group's 16 products then each find their operands in L2, and the transformed filters are
/// read once per group (fewer, larger groups read them less often). 1 MiB rather than 512 KiB:
/// at two threads, ResNet-50's 64 x 56 x 56 and 128 x 28 x 28 layers then run as 4 and 2 groups
/// instead of 8 and 4 (`cargo bench --bench conv`, Zen 4, fastest of 9, three alternated
/// rounds: 0.77-0.81 -> 0.68-0.69 and 0.73 -> 0.63 ms), one thread unchanged (1.34-1.35 and
/// 1.21-1.22 ms either way); 2 MiB made the 56 x 56 layer slower again.
const GROUP_BYTES: usize = 1 << 20;

/// Fewest tiles a group holds for cache's sake (unless the image has fewer): a 14 x 14 layer's
/// 49 tiles stay one group even with 256 channels (smaller groups leave the products' column
/// panels mostly edge and read the transformed filters once per group).
const MIN_CACHE_TILES: usize = 64;

/// Fewest tiles for a group to run on one thread: fewer make the products' column panels
/// mostly edge.
const MIN_GROUP_TILES: usize = 32;

/// 3x3 filters (`cout x cin x 3 x 3`) transformed (`U = G g G^T`, in f64, rounded once) and
/// packed as the A operand of each of the 16 products.
pub struct WinogradFilter {
    cout: usize,
    cin: usize,
    u: Vec<PackedA>,
}

impl std::fmt::Debug for WinogradFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WinogradFilter({} x {} x 3 x 3)", self.cout, self.cin)
    }
}

/// `G g G^T` of one 3 x 3 filter `g` (row-major), row-major 4 x 4.
fn transform_filter(g: &[f32]) -> [f64; XI] {
    let g: Vec<f64> = g.iter().map(|&v| v as f64).collect();
    // G = [[1, 0, 0], [1/2, 1/2, 1/2], [1/2, -1/2, 1/2], [0, 0, 1]]: rows of G g first.
    let mut t = [[0f64; 3]; 4];
    for c in 0..3 {
        let (a, b, d) = (g[c], g[3 + c], g[6 + c]);
        t[0][c] = a;
        t[1][c] = 0.5 * (a + b + d);
        t[2][c] = 0.5 * (a - b + d);
        t[3][c] = d;
    }
    let mut u = [0f64; XI];
    for (r, row) in t.iter().enumerate() {
        let (a, b, d) = (row[0], row[1], row[2]);
        u[r * 4] = a;
        u[r * 4 + 1] = 0.5 * (a + b + d);
        u[r * 4 + 2] = 0.5 * (a - b + d);
        u[r * 4 + 3] = d;
    }
    u
}

impl WinogradFilter {
    /// Transforms and packs `w` (`cout x cin x 3 x 3`, row-major). Panics when `w` is shorter.
    pub fn new(w: &[f32], cout: usize, cin: usize) -> WinogradFilter {
        assert!(
            w.len() >= cout * cin * 9,
            "winograd: {} weights for {cout} x {cin} x 3 x 3",
            w.len()
        );
        // u[xi][o * cin + c]
        let mut u = vec![vec![0f32; cout * cin]; XI];
        for o in 0..cout {
            for c in 0..cin {
                let t = transform_filter(&w[(o * cin + c) * 9..][..9]);
                for (xi, &v) in t.iter().enumerate() {
                    u[xi][o * cin + c] = v as f32;
                }
            }
        }
        let u = u
            .iter()
            .map(|m| PackedA::new(cout, cin, Mat::row_major(m, cin)))
            .collect();
        WinogradFilter { cout, cin, u }
    }

    pub fn cout(&self) -> usize {
        self.cout
    }

    pub fn cin(&self) -> usize {
        self.cin
    }

    /// Bytes held by the packed transformed filters.
    pub fn size_bytes(&self) -> usize {
        self.u.iter().map(PackedA::size_bytes).sum()
    }
}

/// Whether [`conv3x3`] beats the direct product for `cin -> cout` channels and an `oh x ow`
/// output: enough channels for its products to run at the kernel's rate, and enough tiles per
/// image that the saved multiply-adds (20 per tile and channel pair) outweigh reading the
/// transformed filters (64 bytes per channel pair, 28 more than the direct filter's). ResNet's
/// 56 x 56, 28 x 28, 14 x 14 and 7 x 7 layers qualify: at 7 x 7 (16 tiles, the 2 x 2 tiles
/// cover 8 x 8, so 49 of 64 outputs are kept) 320 multiply-adds are saved per 28 bytes read, and
/// ResNet-50's 512-channel 7 x 7 layers measured 2.9 -> 1.8 ms at one thread and 1.67 -> 0.95 ms
/// at two (AVX-512 host with 26 GB/s per core; the direct product there runs at 77 GFLOP/s, its
/// 49 columns filling 49 of the kernel's 64 lanes). Smaller planes were not measured.
/// `FERRUM_NO_WINOGRAD=1` turns it off (every convolution then runs as a direct product).
pub fn worthwhile(cin: usize, cout: usize, oh: usize, ow: usize) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *OFF.get_or_init(|| std::env::var("FERRUM_NO_WINOGRAD").is_ok_and(|v| v == "1")) {
        return false;
    }
    let tiles = oh.div_ceil(2) * ow.div_ceil(2);
    cin >= 16 && cout >= 16 && oh >= 7 && ow >= 7 && tiles >= 16
}

/// A 3x3 convolution's geometry (stride 1, dilation 1): input and output planes and the
/// padding at the top and left (the bottom and right follow from the sizes: input beyond the
/// plane reads as zero).
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub input: [usize; 2],
    pub output: [usize; 2],
    pub pad: [usize; 2],
}

/// What [`conv3x3`] adds as it writes each output: `act((y + bias[o]) + residual)`.
#[derive(Clone, Copy, Debug)]
pub struct Finish<'a> {
    /// One value per output channel.
    pub bias: Option<&'a [f32]>,
    /// A tensor of the output's shape.
    pub residual: Option<&'a [f32]>,
    pub act: Act,
}

thread_local! {
    /// Each thread's transformed input and products for one group.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// A buffer that pool tasks write disjoint parts of.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: the tasks of one [`conv3x3_with`] call write disjoint parts (their own channels, tile
// rows or output rows) of buffers that the call borrows mutably throughout, and read only what
// an earlier, finished step wrote.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// What every step of one call reads.
struct Job<'a> {
    isa: Isa,
    f: &'a WinogradFilter,
    x: &'a [f32],
    g: Geometry,
    fin: &'a Finish<'a>,
    tiles_x: usize,
    out: Shared,
}

/// A group: image `b`'s tile rows `ty0..ty1`.
#[derive(Clone, Copy)]
struct Group {
    b: usize,
    ty0: usize,
    ty1: usize,
}

impl Group {
    fn tiles(&self, tiles_x: usize) -> usize {
        (self.ty1 - self.ty0) * tiles_x
    }
}

/// The convolution of `n` images `x` (`n x cin x ih x iw`) with `f`, written with `fin` into
/// `out` (`n x cout x oh x ow`, every element written), on the pool's threads with the best
/// microkernel.
pub fn conv3x3(
    f: &WinogradFilter,
    x: &[f32],
    n: usize,
    g: Geometry,
    fin: &Finish,
    out: &mut [MaybeUninit<f32>],
) {
    conv3x3_with(gemm::isa(), pool::threads(), f, x, n, g, fin, out)
}

/// [`conv3x3`] with a chosen microkernel family and at most `threads` tasks at a time.
#[allow(clippy::too_many_arguments)]
pub fn conv3x3_with(
    isa: Isa,
    threads: usize,
    f: &WinogradFilter,
    x: &[f32],
    n: usize,
    g: Geometry,
    fin: &Finish,
    out: &mut [MaybeUninit<f32>],
) {
    run(isa, threads, GROUP_BYTES, f, x, n, g, fin, out)
}

/// [`conv3x3_with`] with groups of about `group_bytes` (tests make many small ones).
#[allow(clippy::too_many_arguments)]
fn run(
    isa: Isa,
    threads: usize,
    group_bytes: usize,
    f: &WinogradFilter,
    x: &[f32],
    n: usize,
    g: Geometry,
    fin: &Finish,
    out: &mut [MaybeUninit<f32>],
) {
    let (cin, cout) = (f.cin, f.cout);
    let [ih, iw] = g.input;
    let [oh, ow] = g.output;
    assert!(
        x.len() >= n * cin * ih * iw && out.len() >= n * cout * oh * ow,
        "winograd: buffers too short for {n} x {cin} x {ih} x {iw} -> {cout} x {oh} x {ow}"
    );
    if let Some(b) = fin.bias {
        assert!(
            b.len() >= cout,
            "winograd: {} biases for {cout} outputs",
            b.len()
        );
    }
    if let Some(z) = fin.residual {
        assert!(
            z.len() >= n * cout * oh * ow,
            "winograd: residual too short"
        );
    }
    assert!(
        isa != Isa::Avx512 || crate::cpu::hardware().avx512f,
        "winograd: AVX-512 kernels asked for on a CPU without AVX-512F"
    );
    if n == 0 || oh == 0 || ow == 0 || cout == 0 {
        return;
    }
    let (tiles_y, tiles_x) = (oh.div_ceil(2), ow.div_ceil(2));
    let threads = threads.max(1);
    let job = Job {
        isa,
        f,
        x,
        g,
        fin,
        tiles_x,
        out: Shared(out.as_mut_ptr().cast()),
    };
    let rows_cache = (group_bytes / (XI * cin.max(cout).max(1) * tiles_x * 4))
        .max(MIN_CACHE_TILES.div_ceil(tiles_x))
        .clamp(1, tiles_y);
    // `per_image` groups of each image's tile rows, their sizes within one of each other.
    let groups = |per_image: usize| -> Vec<Group> {
        (0..n)
            .flat_map(|b| {
                (0..per_image).map(move |i| Group {
                    b,
                    ty0: i * tiles_y / per_image,
                    ty1: (i + 1) * tiles_y / per_image,
                })
            })
            .collect()
    };
    let per_image = tiles_y.div_ceil(rows_cache);
    if threads > 1 {
        // As many groups as the cache wants, rounded up to a multiple of the threads (for one
        // image), each still large enough.
        let parallel = if n == 1 {
            per_image.div_ceil(threads) * threads
        } else {
            per_image
        };
        if n * parallel >= threads && (tiles_y / parallel) * tiles_x >= MIN_GROUP_TILES {
            let list = groups(parallel);
            pool::parallel_for(list.len(), |i| {
                SCRATCH.with(|s| {
                    let (v, m) = &mut *s.borrow_mut();
                    run_group(&job, list[i], v, m)
                })
            });
            return;
        }
        // Too few groups: each one's steps split across the threads.
        SCRATCH.with(|s| {
            let (v, m) = &mut *s.borrow_mut();
            for grp in groups(per_image) {
                run_group_split(&job, grp, threads, v, m);
            }
        });
        return;
    }
    SCRATCH.with(|s| {
        let (v, m) = &mut *s.borrow_mut();
        for grp in groups(per_image) {
            run_group(&job, grp, v, m);
        }
    });
}

/// Floats from one position's matrix (`channels x t`) to the next in `V` and `M`: one cache
/// line more than the matrix, so that the 16 positions a transform reads or writes together do
/// not all fall in the same L1 set (a matrix of a multiple of 4 KiB put them there: ResNet's
/// 56 x 56 layers lost half their input transform's speed to it).
fn stride(channels: usize, t: usize) -> usize {
    channels * t + 16
}

/// Grows `buf` to at least `len` floats and returns its start.
fn room(buf: &mut Vec<f32>, len: usize) -> Shared {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    Shared(buf.as_mut_ptr())
}

/// One group on this thread: its input transformed into `v`, the products into `m`, the
/// output written.
fn run_group(job: &Job, grp: Group, v: &mut Vec<f32>, m: &mut Vec<f32>) {
    let (cin, cout) = (job.f.cin, job.f.cout);
    let t = grp.tiles(job.tiles_x);
    let (vp, mp) = (room(v, XI * stride(cin, t)), room(m, XI * stride(cout, t)));
    // SAFETY: `v` holds 16 positions of cin x t floats and this thread alone uses it.
    unsafe { transform_input(job, grp, (0, cin), vp) };
    for xi in 0..XI {
        // SAFETY: `v` and `m` hold 16 positions of cin x t and cout x t floats, used by this
        // thread alone.
        unsafe { product(job, grp, xi, vp, mp) };
    }
    // SAFETY: `m` holds the products; this group's output rows are written by it alone.
    unsafe { transform_output(job, grp, (0, cout), mp) };
}

/// One group with each step split across `threads` tasks (channels, products, output
/// channels), the buffers this thread's.
fn run_group_split(job: &Job, grp: Group, threads: usize, v: &mut Vec<f32>, m: &mut Vec<f32>) {
    let (cin, cout) = (job.f.cin, job.f.cout);
    let t = grp.tiles(job.tiles_x);
    let (vp, mp) = (room(v, XI * stride(cin, t)), room(m, XI * stride(cout, t)));
    let split = |len: usize| len.div_ceil(threads).max(1);
    let per = split(cin);
    pool::parallel_for(cin.div_ceil(per), |i| {
        // SAFETY: `v` holds 16 positions of cin x t floats; each task writes its own channels.
        unsafe { transform_input(job, grp, (i * per, ((i + 1) * per).min(cin)), vp) }
    });
    pool::parallel_for(XI, |xi| {
        // SAFETY: the input step has finished; each task writes its own product.
        unsafe { product(job, grp, xi, vp, mp) }
    });
    let per = split(cout);
    pool::parallel_for(cout.div_ceil(per), |i| {
        // SAFETY: the products have finished; each task writes its own output channels.
        unsafe { transform_output(job, grp, (i * per, ((i + 1) * per).min(cout)), mp) }
    });
}

/// `M_xi = U_xi V_xi` for one group, on one thread.
///
/// # Safety
/// `v` holds the group's transformed input (16 positions of cin x t floats, written), `m` room for 16 x
/// cout x t floats of which no other thread touches product `xi`'s part during the call.
unsafe fn product(job: &Job, grp: Group, xi: usize, v: Shared, m: Shared) {
    let (cin, cout) = (job.f.cin, job.f.cout);
    let t = grp.tiles(job.tiles_x);
    // SAFETY: per the contract, these ranges lie in the buffers; V's is only read.
    let (vx, mx) = unsafe {
        (
            std::slice::from_raw_parts(v.0.add(xi * stride(cin, t)), cin * t),
            std::slice::from_raw_parts_mut(m.0.add(xi * stride(cout, t)), cout * t),
        )
    };
    gemm::gemm_ex_with(
        job.isa,
        1,
        cout,
        t,
        cin,
        1.0,
        Lhs::Packed(&job.f.u[xi]),
        Rhs::Mat(Mat::row_major(vx, t)),
        0.0,
        mx,
        t,
        &Epilogue::NONE,
    );
}

/// The 4 input rows of tile row `ty` of channel `c`, zero-padded: row `r` is input row
/// `2 ty - top + r`, its element `k` input column `k - left` (`w` of them).
fn padded_rows(x: &[f32], g: Geometry, ty: usize, w: usize, rows: &mut [f32]) {
    let [ih, iw] = g.input;
    let [top, left] = g.pad;
    for (r, row) in rows.chunks_exact_mut(w).take(4).enumerate() {
        let y = (2 * ty + r) as isize - top as isize;
        if y < 0 || y >= ih as isize {
            row.fill(0.0);
            continue;
        }
        let src = &x[y as usize * iw..][..iw];
        let (lo, hi) = (left.min(w), (left + iw).min(w));
        row[..lo].fill(0.0);
        row[lo..hi].copy_from_slice(&src[..hi - lo]);
        row[hi..].fill(0.0);
    }
}

/// Writes `V[xi][c][j]` (`j`: the group's tile `(ty, tx)` as `(ty - ty0) * tiles_x + tx`) =
/// `B^T d B` of the 4 x 4 input block of every tile of the group, for channels `c0..c1`.
///
/// # Safety
/// `v` holds 16 positions of cin x t floats ([`stride`] apart; t: the group's tiles), of which no other thread writes
/// channels `c0..c1` during the call.
unsafe fn transform_input(job: &Job, grp: Group, (c0, c1): (usize, usize), v: Shared) {
    let (cin, tiles_x) = (job.f.cin, job.tiles_x);
    let [ih, iw] = job.g.input;
    let t = grp.tiles(tiles_x);
    // The portable path's zero-padded copy of a tile row's 4 input rows.
    let w = 2 * tiles_x + 2;
    // The portable transform, compiled for AVX2 where the CPU has it.
    let row: unsafe fn(&[f32], usize, usize, *mut f32, usize) = match job.isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 if crate::cpu::features().avx2 => input_tile_row_avx2,
        _ => input_tile_row,
    };
    let mut rows = if job.isa == Isa::Avx512 {
        Vec::new()
    } else {
        vec![0f32; 4 * w]
    };
    for c in c0..c1 {
        let plane = &job.x[(grp.b * cin + c) * ih * iw..][..ih * iw];
        for ty in grp.ty0..grp.ty1 {
            let j0 = (ty - grp.ty0) * tiles_x;
            #[cfg(target_arch = "x86_64")]
            if job.isa == Isa::Avx512 {
                // SAFETY: the Avx512 family runs only where the CPU has AVX-512F (checked at
                // the start of the call); the writes are channel c's, per the caller.
                unsafe {
                    input_tile_row_avx512(
                        plane,
                        job.g,
                        ty,
                        tiles_x,
                        v.0.add(c * t + j0),
                        stride(cin, t),
                    )
                };
                continue;
            }
            padded_rows(plane, job.g, ty, w, &mut rows);
            // SAFETY: channel c's first tile of this row, inside `v` (the contract); the
            // kernel suits this CPU; the writes are channel c's, per the caller.
            unsafe { row(&rows, w, tiles_x, v.0.add(c * t + j0), stride(cin, t)) };
        }
    }
}

/// [`input_tile_row`] on 8 tiles per AVX2 vector (same arithmetic, same order, so the same
/// bits), the tiles past the last whole 8 as [`input_tile_row`] does them. Per input row and 8
/// tiles, the 16 columns from the first tile's and the 16 from two columns on are split into
/// even and odd ones: the tiles' columns 0 and 1, then 2 and 3.
///
/// # Safety
/// As [`input_tile_row`], and the CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn input_tile_row_avx2(rows: &[f32], w: usize, tiles_x: usize, v: *mut f32, step: usize) {
    use std::arch::x86_64::*;
    let whole = tiles_x / 8 * 8;
    assert!(rows.len() >= 4 * w && (whole == 0 || 2 * whole + 2 <= w));
    // Even and odd floats of the 16 at `p`: [p0 p2 .. p14], [p1 p3 .. p15].
    let split = |p: *const f32| -> (__m256, __m256) {
        // SAFETY: 16 floats from `p` lie inside `rows` (the callers below).
        let (a, b) = unsafe { (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) };
        let ev = _mm256_shuffle_ps::<0x88>(a, b); // a0 a2 b0 b2 | a4 a6 b4 b6
        let od = _mm256_shuffle_ps::<0xdd>(a, b); // a1 a3 b1 b3 | a5 a7 b5 b7
        let order =
            |x: __m256| _mm256_castpd_ps(_mm256_permute4x64_pd::<0xd8>(_mm256_castps_pd(x)));
        (order(ev), order(od))
    };
    for tx0 in (0..whole).step_by(8) {
        // Columns 0 - 3 of the 8 tiles of input row r: lanes l at 2 (tx0 + l) + col.
        let cols = |r: usize| -> [__m256; 4] {
            // Reads columns 2 tx0 .. 2 tx0 + 18 <= 2 whole + 2 <= w of row r.
            let p = rows[r * w + 2 * tx0..].as_ptr();
            let (c0, c1) = split(p);
            // SAFETY: as above.
            let (c2, c3) = split(unsafe { p.add(2) });
            [c0, c1, c2, c3]
        };
        let d = [cols(0), cols(1), cols(2), cols(3)];
        let mut q = [[_mm256_setzero_ps(); 4]; 4];
        for col in 0..4 {
            let e = |r: usize| d[r][col];
            q[0][col] = _mm256_sub_ps(e(0), e(2));
            q[1][col] = _mm256_add_ps(e(1), e(2));
            q[2][col] = _mm256_sub_ps(e(2), e(1));
            q[3][col] = _mm256_sub_ps(e(1), e(3));
        }
        for (i, row) in q.iter().enumerate() {
            let vals = [
                _mm256_sub_ps(row[0], row[2]),
                _mm256_add_ps(row[1], row[2]),
                _mm256_sub_ps(row[2], row[1]),
                _mm256_sub_ps(row[1], row[3]),
            ];
            for (j, &val) in vals.iter().enumerate() {
                // SAFETY: xi = 4 i + j < 16 and tiles tx0 .. tx0 + 8 <= tiles_x, per the
                // contract.
                unsafe { _mm256_storeu_ps(v.add((i * 4 + j) * step + tx0), val) };
            }
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { input_tiles(rows, w, whole..tiles_x, v, step) }
}

/// One tile row of one channel (see [`transform_input`]): `v` points at its first tile for
/// `xi = 0`, each further `xi` `step` floats on.
///
/// # Safety
/// `v + xi * step + tx` is writable for every `xi < 16`, `tx < tiles_x`.
#[inline(always)]
unsafe fn input_tile_row(rows: &[f32], w: usize, tiles_x: usize, v: *mut f32, step: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { input_tiles(rows, w, 0..tiles_x, v, step) }
}

/// [`input_tile_row`] for the tiles `txs` of the row.
///
/// # Safety
/// As [`input_tile_row`], for `tx` in `txs`.
#[allow(clippy::needless_range_loop)] // the transforms' indices, as in the matrices
#[inline(always)]
unsafe fn input_tiles(
    rows: &[f32],
    w: usize,
    txs: std::ops::Range<usize>,
    v: *mut f32,
    step: usize,
) {
    let d = |r: usize, col: usize| &rows[r * w + col..];
    for tx in txs {
        // B^T d: rows 0 - 2, 1 + 2, 2 - 1, 1 - 3; then times B: columns likewise.
        let mut q = [[0f32; 4]; 4];
        for col in 0..4 {
            let e = |r: usize| d(r, 2 * tx + col)[0];
            q[0][col] = e(0) - e(2);
            q[1][col] = e(1) + e(2);
            q[2][col] = e(2) - e(1);
            q[3][col] = e(1) - e(3);
        }
        for (i, row) in q.iter().enumerate() {
            let vals = [
                row[0] - row[2],
                row[1] + row[2],
                row[2] - row[1],
                row[1] - row[3],
            ];
            for (j, &val) in vals.iter().enumerate() {
                // SAFETY: xi = 4 i + j < 16 and tx < tiles_x, per the contract.
                unsafe { *v.add((i * 4 + j) * step + tx) = val };
            }
        }
    }
}

/// [`input_tile_row`] on 16 tiles per vector (same arithmetic, same order), reading tile row
/// `ty` of the `ih x iw` plane `x` in place: lanes outside the plane are masked off (zero).
///
/// # Safety
/// As [`input_tile_row`], and the CPU supports AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn input_tile_row_avx512(
    x: &[f32],
    g: Geometry,
    ty: usize,
    tiles_x: usize,
    v: *mut f32,
    step: usize,
) {
    use std::arch::x86_64::*;
    let [ih, iw] = g.input;
    let [top, left] = g.pad;
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    // Lanes l of a load at input column `start` (may be negative) with 0 <= start + l < iw.
    let inside = |start: isize| -> __mmask16 {
        let lo = (-start).clamp(0, 16) as u32;
        let hi = (iw as isize - start).clamp(0, 16) as u32;
        if hi <= lo {
            0
        } else {
            (((1u32 << hi) - 1) & !((1u32 << lo) - 1)) as __mmask16
        }
    };
    assert!(x.len() >= ih * iw);
    for tx0 in (0..tiles_x).step_by(16) {
        let left_tiles = tiles_x - tx0;
        let mask: __mmask16 = if left_tiles >= 16 {
            0xffff
        } else {
            (1u16 << left_tiles) - 1
        };
        // d[r][col] for 16 tiles: input row 2 ty + r - top, columns 2 tx - left + col.
        let col0 = (2 * tx0) as isize - left as isize;
        let mut d = [[_mm512_setzero_ps(); 4]; 4];
        for (r, dr) in d.iter_mut().enumerate() {
            let y = (2 * ty + r) as isize - top as isize;
            if y < 0 || y >= ih as isize {
                continue;
            }
            let row = x[y as usize * iw..].as_ptr();
            let load = |start: isize| {
                // SAFETY: only lanes inside the row (columns 0 .. iw) are read; the others are
                // masked off, so the address of a masked-off lane is never dereferenced.
                unsafe { _mm512_maskz_loadu_ps(inside(start), row.wrapping_offset(start)) }
            };
            let (a, b) = (load(col0), load(col0 + 16));
            let (a2, b2) = (load(col0 + 2), load(col0 + 18));
            dr[0] = _mm512_permutex2var_ps(a, even, b);
            dr[1] = _mm512_permutex2var_ps(a, odd, b);
            dr[2] = _mm512_permutex2var_ps(a2, even, b2);
            dr[3] = _mm512_permutex2var_ps(a2, odd, b2);
        }
        let mut q = [[_mm512_setzero_ps(); 4]; 4];
        for col in 0..4 {
            q[0][col] = _mm512_sub_ps(d[0][col], d[2][col]);
            q[1][col] = _mm512_add_ps(d[1][col], d[2][col]);
            q[2][col] = _mm512_sub_ps(d[2][col], d[1][col]);
            q[3][col] = _mm512_sub_ps(d[1][col], d[3][col]);
        }
        for (i, row) in q.iter().enumerate() {
            let vals = [
                _mm512_sub_ps(row[0], row[2]),
                _mm512_add_ps(row[1], row[2]),
                _mm512_sub_ps(row[2], row[1]),
                _mm512_sub_ps(row[1], row[3]),
            ];
            for (j, &val) in vals.iter().enumerate() {
                // SAFETY: the masked lanes are tiles tx0 .. tiles_x, writable per the contract.
                unsafe { _mm512_mask_storeu_ps(v.add((i * 4 + j) * step + tx0), mask, val) };
            }
        }
    }
}

/// Writes, for output channels `o0..o1` and every tile of the group, `A^T M A` of its 16
/// products into image `b`'s output, with the bias, residual and activation.
///
/// # Safety
/// `m` holds the group's products (16 positions of cout x t floats, written); `job.out` addresses an
/// `n x cout x oh x ow` buffer of which no other thread writes these channels' rows of this
/// group during the call.
unsafe fn transform_output(job: &Job, grp: Group, (o0, o1): (usize, usize), m: Shared) {
    let cout = job.f.cout;
    let [oh, ow] = job.g.output;
    let tiles_x = job.tiles_x;
    let t = grp.tiles(tiles_x);
    let fin = job.fin;
    let row = output_row_kernel(job.isa);
    for o in o0..o1 {
        let bias = fin.bias.map_or(0.0, |bv| bv[o]);
        let plane = (grp.b * cout + o) * oh * ow;
        for ty in grp.ty0..grp.ty1 {
            let rows = (oh - 2 * ty).min(2);
            // SAFETY: product xi's row o for this tile row: tiles_x floats inside `m`.
            let mx = unsafe { m.0.add(o * t + (ty - grp.ty0) * tiles_x) };
            let at = plane + 2 * ty * ow;
            let z = fin.residual.map(|z| &z[at..][..rows * ow]);
            // SAFETY: the output rows 2 ty .. 2 ty + rows of channel o of image b lie inside
            // `out` and are this task's (the contract).
            let dst = unsafe { job.out.0.add(at) };
            let r = OutRow {
                m: mx,
                step: stride(cout, t),
                tiles_x,
                ow,
                rows,
                bias,
                z,
                act: fin.act,
                dst,
            };
            // SAFETY: the kernel suits this CPU ([`output_row_kernel`]); pointers as above.
            unsafe { row(&r) };
        }
    }
}

/// One output tile row of one channel, as [`output_tile_row`] reads and writes it: `m` points at
/// its first tile's product for `xi = 0`, each further `xi` `step` floats on; `dst` at output
/// row `2 ty` (`rows` of them, 1 or 2, each `ow` wide); `z` the residual's same rows.
#[derive(Clone, Copy)]
struct OutRow<'a> {
    m: *const f32,
    step: usize,
    tiles_x: usize,
    ow: usize,
    rows: usize,
    bias: f32,
    z: Option<&'a [f32]>,
    act: Act,
    dst: *mut f32,
}

/// The transform of one output tile row (see [`output_tile_row`]).
type OutputRow = unsafe fn(&OutRow);

/// [`output_tile_row`] in the build the CPU runs best: 16 tiles per AVX-512 vector with the
/// AVX-512 family (the caller has checked the CPU has it), compiled for AVX2 where present.
fn output_row_kernel(isa: Isa) -> OutputRow {
    #[cfg(target_arch = "x86_64")]
    {
        if isa == Isa::Avx512 {
            return output_tile_row_avx512;
        }
        if isa != Isa::Scalar && crate::cpu::features().avx2 {
            return output_tile_row_avx2;
        }
    }
    output_tile_row
}

/// [`output_tile_row`] on 8 tiles per AVX2 vector (same arithmetic, same order, so the same
/// bits), the tiles past the last whole 8 as [`output_tile_row`] does them. A row's two
/// outputs per tile are interleaved into 16 consecutive columns; columns past the output's
/// width are left unwritten.
///
/// # Safety
/// As [`output_tile_row`], and the CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)] // the transforms' indices, as in the matrices
unsafe fn output_tile_row_avx2(r: &OutRow) {
    use std::arch::x86_64::*;
    let OutRow {
        m,
        step,
        tiles_x,
        ow,
        rows,
        bias,
        z,
        act,
        dst,
    } = *r;
    let whole = tiles_x / 8 * 8;
    let bv = _mm256_set1_ps(bias);
    for tx0 in (0..whole).step_by(8) {
        // SAFETY: tiles tx0 .. tx0 + 8 <= tiles_x of product xi, readable per the contract.
        let mv = |xi: usize| unsafe { _mm256_loadu_ps(m.add(xi * step + tx0)) };
        let mut s = [[_mm256_setzero_ps(); 4]; 2];
        for j in 0..4 {
            s[0][j] = _mm256_add_ps(_mm256_add_ps(mv(j), mv(4 + j)), mv(8 + j));
            s[1][j] = _mm256_sub_ps(_mm256_sub_ps(mv(4 + j), mv(8 + j)), mv(12 + j));
        }
        for (i, si) in s.iter().enumerate().take(rows) {
            let y0 = _mm256_add_ps(_mm256_add_ps(si[0], si[1]), si[2]);
            let y1 = _mm256_sub_ps(_mm256_sub_ps(si[1], si[2]), si[3]);
            // Output columns 2 tx0 .. 2 tx0 + 16, interleaved: y0[0] y1[0] y0[1] y1[1] ...
            let (lo, hi) = (_mm256_unpacklo_ps(y0, y1), _mm256_unpackhi_ps(y0, y1));
            let halves = [
                _mm256_permute2f128_ps::<0x20>(lo, hi),
                _mm256_permute2f128_ps::<0x31>(lo, hi),
            ];
            for (h, &yv) in halves.iter().enumerate() {
                let col = 2 * tx0 + 8 * h;
                if col >= ow {
                    break;
                }
                let n = (ow - col).min(8);
                let at = i * ow + col;
                let mut val = _mm256_add_ps(yv, bv);
                let mut buf = [0f32; 8];
                if let Some(z) = z {
                    let zv = if n == 8 {
                        // SAFETY: columns col .. col + 8 <= ow of row i, inside `z`.
                        unsafe { _mm256_loadu_ps(z.as_ptr().add(at)) }
                    } else {
                        buf[..n].copy_from_slice(&z[at..at + n]);
                        // SAFETY: `buf` holds 8 floats.
                        unsafe { _mm256_loadu_ps(buf.as_ptr()) }
                    };
                    val = _mm256_add_ps(val, zv);
                }
                let val = if act.is_vector() {
                    gemm::act_avx2(act, val)
                } else {
                    // SAFETY: `buf` holds 8 floats.
                    unsafe { _mm256_storeu_ps(buf.as_mut_ptr(), val) };
                    buf.iter_mut().for_each(|x| *x = act.apply(*x));
                    // SAFETY: `buf` holds 8 floats.
                    unsafe { _mm256_loadu_ps(buf.as_ptr()) }
                };
                if n == 8 {
                    // SAFETY: columns col .. col + 8 <= ow of row i, inside `dst`.
                    unsafe { _mm256_storeu_ps(dst.add(at), val) };
                } else {
                    // SAFETY: `buf` holds 8 floats; columns col .. ow of row i lie inside
                    // `dst`, apart from `buf`.
                    unsafe {
                        _mm256_storeu_ps(buf.as_mut_ptr(), val);
                        std::ptr::copy_nonoverlapping(buf.as_ptr(), dst.add(at), n);
                    }
                }
            }
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { output_tiles(r, whole..tiles_x) }
}

/// One tile row of one output channel (see [`transform_output`] and [`OutRow`]).
///
/// # Safety
/// `m + xi * step + tx` is readable for `xi < 16`, `tx < tiles_x`; `dst` has `rows * ow`
/// writable floats.
#[inline(always)]
unsafe fn output_tile_row(r: &OutRow) {
    // SAFETY: forwarded from the caller.
    unsafe { output_tiles(r, 0..r.tiles_x) }
}

/// [`output_tile_row`] for the tiles `txs` of the row.
///
/// # Safety
/// As [`output_tile_row`], for `tx` in `txs`.
#[allow(clippy::needless_range_loop)] // the transforms' indices, as in the matrices
#[inline(always)]
unsafe fn output_tiles(r: &OutRow, txs: std::ops::Range<usize>) {
    let OutRow {
        m,
        step,
        tiles_x: _,
        ow,
        rows,
        bias,
        z,
        act,
        dst,
    } = *r;
    for tx in txs {
        // SAFETY: xi < 16 and tx < tiles_x, per the contract.
        let mv = |xi: usize| unsafe { *m.add(xi * step + tx) };
        // A^T M (rows 0 + 1 + 2 and 1 - 2 - 3), then times A (columns likewise).
        let mut s = [[0f32; 4]; 2];
        for j in 0..4 {
            s[0][j] = mv(j) + mv(4 + j) + mv(8 + j);
            s[1][j] = mv(4 + j) - mv(8 + j) - mv(12 + j);
        }
        for (i, si) in s.iter().enumerate().take(rows) {
            let y = [si[0] + si[1] + si[2], si[1] - si[2] - si[3]];
            for (jj, &yv) in y.iter().enumerate() {
                let col = 2 * tx + jj;
                if col >= ow {
                    break;
                }
                let at = i * ow + col;
                let val = match z {
                    Some(z) => (yv + bias) + z[at],
                    None => yv + bias,
                };
                // SAFETY: at < rows * ow, per the contract.
                unsafe { *dst.add(at) = act.apply(val) };
            }
        }
    }
}

/// [`output_tile_row`] on 16 tiles per vector (same arithmetic, same order).
///
/// # Safety
/// As [`output_tile_row`], and the CPU supports AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)] // the transforms' indices, as in the matrices
unsafe fn output_tile_row_avx512(r: &OutRow) {
    use std::arch::x86_64::*;
    let OutRow {
        m,
        step,
        tiles_x,
        ow,
        rows,
        bias,
        z,
        act,
        dst,
    } = *r;
    let lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    let bv = _mm512_set1_ps(bias);
    let lanes = |n: usize| -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            (1u16 << n) - 1
        }
    };
    for tx0 in (0..tiles_x).step_by(16) {
        let mask = lanes(tiles_x - tx0);
        // SAFETY: the masked lanes are tiles tx0 .. tiles_x, readable per the contract.
        let mv = |xi: usize| unsafe { _mm512_maskz_loadu_ps(mask, m.add(xi * step + tx0)) };
        let mut s = [[_mm512_setzero_ps(); 4]; 2];
        for j in 0..4 {
            s[0][j] = _mm512_add_ps(_mm512_add_ps(mv(j), mv(4 + j)), mv(8 + j));
            s[1][j] = _mm512_sub_ps(_mm512_sub_ps(mv(4 + j), mv(8 + j)), mv(12 + j));
        }
        for (i, si) in s.iter().enumerate().take(rows) {
            let y0 = _mm512_add_ps(_mm512_add_ps(si[0], si[1]), si[2]);
            let y1 = _mm512_sub_ps(_mm512_sub_ps(si[1], si[2]), si[3]);
            // Output columns 2 tx0 .. 2 tx0 + 32, interleaved: y0[0] y1[0] y0[1] y1[1] ...
            let halves = [
                _mm512_permutex2var_ps(y0, lo, y1),
                _mm512_permutex2var_ps(y0, hi, y1),
            ];
            for (h, &yv) in halves.iter().enumerate() {
                let col = 2 * tx0 + 16 * h;
                if col >= ow {
                    break;
                }
                let mask = lanes(ow - col);
                let at = i * ow + col;
                let mut val = _mm512_add_ps(yv, bv);
                if let Some(z) = z {
                    // SAFETY: the masked lanes are columns col .. ow of row i, inside `z`
                    // (rows * ow floats).
                    let zv = unsafe { _mm512_maskz_loadu_ps(mask, z.as_ptr().add(at)) };
                    val = _mm512_add_ps(val, zv);
                }
                let val = if act.is_vector() {
                    gemm::act_avx512(act, val)
                } else {
                    let mut buf = [0f32; 16];
                    _mm512_storeu_ps(buf.as_mut_ptr(), val);
                    buf.iter_mut().for_each(|x| *x = act.apply(*x));
                    _mm512_loadu_ps(buf.as_ptr())
                };
                // SAFETY: the masked lanes are columns col .. ow of row i, inside `dst`.
                unsafe { _mm512_mask_storeu_ps(dst.add(at), mask, val) };
            }
        }
    }
}

/// The plain reference: the direct convolution (stride 1, dilation 1, 3 x 3), each output an f64
/// sum over channels and taps in order, then `act((y + bias) + residual)` as [`conv3x3`] applies
/// it, rounded once. Also returns, per output, a magnitude for error bounds: the transforms mix
/// the whole 4 x 4 input block of the output's tile, not only its 3 x 3 window, so each
/// channel's largest tap magnitude times the sum of the input magnitudes over the 5 x 5 block
/// that holds the output's tile whichever way tiles align (plus the bias and residual).
pub fn conv3x3_ref(
    w: &[f32],
    cout: usize,
    cin: usize,
    x: &[f32],
    n: usize,
    g: Geometry,
    fin: &Finish,
) -> (Vec<f32>, Vec<f64>) {
    let [ih, iw] = g.input;
    let [oh, ow] = g.output;
    let [top, left] = g.pad;
    let mut y = vec![0f32; n * cout * oh * ow];
    let mut mag = vec![0f64; n * cout * oh * ow];
    for b in 0..n {
        for o in 0..cout {
            for oy in 0..oh {
                for ox in 0..ow {
                    let (mut s, mut a) = (0f64, 0f64);
                    let at_input = |c: usize, iy: usize, ix: usize| -> Option<f64> {
                        (iy >= top && ix >= left && iy - top < ih && ix - left < iw)
                            .then(|| x[((b * cin + c) * ih + iy - top) * iw + ix - left] as f64)
                    };
                    for c in 0..cin {
                        let mut wmax = 0f64;
                        for ky in 0..3 {
                            for kx in 0..3 {
                                let wv = w[((o * cin + c) * 3 + ky) * 3 + kx] as f64;
                                wmax = wmax.max(wv.abs());
                                if let Some(xv) = at_input(c, oy + ky, ox + kx) {
                                    s += xv * wv;
                                }
                            }
                        }
                        // The 5 x 5 block from one row and column before the window.
                        for iy in oy.saturating_sub(1)..oy + 4 {
                            for ix in ox.saturating_sub(1)..ox + 4 {
                                a += wmax * at_input(c, iy, ix).map_or(0.0, f64::abs);
                            }
                        }
                    }
                    let at = ((b * cout + o) * oh + oy) * ow + ox;
                    let mut v = s + fin.bias.map_or(0.0, |bv| bv[o] as f64);
                    if let Some(z) = fin.residual {
                        v += z[at] as f64;
                        a += (z[at] as f64).abs();
                    }
                    y[at] = fin.act.apply(v as f32);
                    mag[at] = a + fin.bias.map_or(0.0, |bv| (bv[o] as f64).abs());
                }
            }
        }
    }
    (y, mag)
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Fresh random shapes, paddings, epilogues, batch sizes, microkernels and thread counts:
    /// within `4e-6` of the tile's magnitude from [`conv3x3_ref`] (the transforms add a few
    /// roundings of values up to that size, from anywhere in the tile's input block, so an
    /// output whose own window is small still carries its neighbours' rounding), times 1.5
    /// after an activation, plus one unit in the last place of the output. NaN never passes.
    #[test]
    fn matches_the_direct_convolution() {
        let seed = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let acts = [
            Act::Identity,
            Act::Relu,
            Act::Clip { lo: -0.5, hi: 0.5 },
            Act::LeakyRelu(0.1),
            Act::Sigmoid,
        ];
        for case in 0..40 {
            let cin = rng.gen_range(1..40);
            let cout = rng.gen_range(1..50);
            // Up to 35 tiles a row: whole 16-tile vectors and a tail.
            let (ih, iw) = (rng.gen_range(1..14), rng.gen_range(1..70));
            let pad = [rng.gen_range(0..3), rng.gen_range(0..3)];
            // Bottom and right padding of 0..=2 as well: the output size follows.
            let (pb, pr) = (rng.gen_range(0..3), rng.gen_range(0..3));
            let (oh, ow) = (ih + pad[0] + pb, iw + pad[1] + pr);
            if oh < 3 || ow < 3 {
                continue;
            }
            let g = Geometry {
                input: [ih, iw],
                output: [oh - 2, ow - 2],
                pad,
            };
            let n = rng.gen_range(1..3);
            let rnd = |rng: &mut rand::rngs::StdRng, len: usize| -> Vec<f32> {
                (0..len).map(|_| rng.gen_range(-1.0..1.0)).collect()
            };
            let w = rnd(&mut rng, cout * cin * 9);
            let x = rnd(&mut rng, n * cin * ih * iw);
            let bias = rnd(&mut rng, cout);
            let z = rnd(&mut rng, n * cout * g.output[0] * g.output[1]);
            let fin = Finish {
                bias: rng.gen_bool(0.5).then_some(&bias[..]),
                residual: rng.gen_bool(0.5).then_some(&z[..]),
                act: acts[rng.gen_range(0..acts.len())],
            };
            let f = WinogradFilter::new(&w, cout, cin);
            let (want, mag) = conv3x3_ref(&w, cout, cin, &x, n, g, &fin);
            for isa in gemm::available_isas() {
                let threads = rng.gen_range(1..4);
                let mut out = vec![MaybeUninit::new(f32::NAN); want.len()];
                // Groups of the real size, or of a tile row or two (many groups).
                let group_bytes = if rng.gen_bool(0.5) {
                    GROUP_BYTES
                } else {
                    rng.gen_range(1..20_000)
                };
                run(isa, threads, group_bytes, &f, &x, n, g, &fin, &mut out);
                let scale = if fin.act == Act::Identity { 1.0 } else { 1.5 };
                for (i, (o, (&wv, &m))) in out.iter().zip(want.iter().zip(&mag)).enumerate() {
                    // SAFETY: every element was initialised (NaN) before the call.
                    let got = unsafe { o.assume_init() };
                    // Plus one rounding of the output itself: after an activation that maps
                    // small sums near a constant (a sigmoid near 0.5), the f32 result cannot
                    // come closer than its own last place.
                    let tol = scale * 4e-6 * (m + 1e-3) + f32::EPSILON as f64 * wv.abs() as f64;
                    assert!(
                        (got - wv).abs() as f64 <= tol,
                        "seed {seed} case {case} {isa:?} t{threads} group {group_bytes}: {cout}x{cin} {g:?} n {n} {fin:?}: \
                         output {i}: {got} vs {wv} (tol {tol:e})"
                    );
                }
            }
        }
    }

    #[test]
    fn transformed_filters_are_the_definition() {
        // G g G^T of a filter with one tap: the outer product of G's column for that tap.
        let gm = [
            [1.0, 0.0, 0.0],
            [0.5, 0.5, 0.5],
            [0.5, -0.5, 0.5],
            [0.0, 0.0, 1.0],
        ];
        for tap in 0..9 {
            let mut g = [0f32; 9];
            g[tap] = 1.0;
            let u = transform_filter(&g);
            for r in 0..4 {
                for c in 0..4 {
                    assert_eq!(u[r * 4 + c], gm[r][tap / 3] * gm[c][tap % 3], "tap {tap}");
                }
            }
        }
    }
}
