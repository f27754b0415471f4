//! The AMX tile unit's set-up, shared by the integer ([`crate::qgemm`]) and bf16
//! ([`crate::gemm`]) products: one tile configuration (eight tiles of 16 rows by 64 bytes) loaded
//! before a run of blocks and released after it. Which products may use the unit is
//! [`crate::cpu::Features`]' `amx_int8` / `amx_bf16` (CPUID, and the tile state granted by the OS).

use std::arch::asm;

/// A tile configuration as `ldtilecfg` reads it (64 bytes, aligned).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

/// Palette 1, tiles 0-7 each 16 rows by 64 bytes: a C tile of 16 x 16 32-bit values, an A tile
/// of 16 rows of 64 bytes of k, a B tile of 16 rows of 16 columns x 4 bytes.
static TILES_16X64: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        // colsb[t] (u16, little-endian) at 16 + 2t, rows[t] at 48 + t.
        c[16 + 2 * t] = 64;
        c[48 + t] = 16;
        t += 1;
    }
    TileConfig(c)
};

/// Loads [`TILES_16X64`] (every tile zeroed).
///
/// # Safety
/// The CPU must have AMX and the OS must have granted this process the tile state.
#[inline]
pub(crate) unsafe fn configure() {
    // SAFETY: the configuration is 64 readable bytes; the CPU has AMX (contract).
    unsafe { asm!("ldtilecfg [{}]", in(reg) TILES_16X64.0.as_ptr(), options(nostack, readonly)) };
}

/// Returns the tile state to its initial (unused) form, so context switches do not save it.
///
/// # Safety
/// As [`configure`].
#[inline]
pub(crate) unsafe fn release() {
    // SAFETY: the CPU has AMX (contract).
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Zeroes the C tiles, tmm0-3.
///
/// # Safety
/// As [`configure`], with the configuration loaded.
#[inline]
pub(crate) unsafe fn zero_c() {
    // SAFETY: the configuration is loaded (contract); touches tile registers only.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        )
    };
}

/// Stores C tile `tmm{t}` (`t < 4`) as 16 rows of 64 bytes at `dst`.
///
/// # Safety
/// As [`zero_c`]; `dst` is writable for 1 KiB.
#[inline]
pub(crate) unsafe fn store_c(t: usize, dst: *mut u8) {
    // SAFETY: 16 rows of 64 bytes, 64 apart, inside the caller's 1 KiB (contract).
    unsafe {
        match t {
            0 => {
                asm!("tilestored [{p} + {s}*1], tmm0", p = in(reg) dst, s = in(reg) 64usize, options(nostack))
            }
            1 => {
                asm!("tilestored [{p} + {s}*1], tmm1", p = in(reg) dst, s = in(reg) 64usize, options(nostack))
            }
            2 => {
                asm!("tilestored [{p} + {s}*1], tmm2", p = in(reg) dst, s = in(reg) 64usize, options(nostack))
            }
            3 => {
                asm!("tilestored [{p} + {s}*1], tmm3", p = in(reg) dst, s = in(reg) 64usize, options(nostack))
            }
            _ => unreachable!("C tiles are tmm0-3"),
        }
    };
}
