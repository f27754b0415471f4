//! What this CPU can run, read once per process, and the kernel tier that follows from it.
//!
//! Every kernel asks here instead of detecting features itself, so one set of switches steps the
//! whole process down a tier (for tests, and to compare tiers on one machine):
//!
//! | variable | effect |
//! |---|---|
//! | `FERRUM_FORCE_SCALAR=1` | no SIMD at all: the portable kernels |
//! | `FERRUM_NO_AVX512=1` | AVX-512 is reported absent (AVX2, with AVX-VNNI where present) |
//! | `FERRUM_NO_AVX_VNNI=1` | AVX-VNNI (the 256-bit `vpdpbusd`) is reported absent |
//! | `FERRUM_NO_AMX=1` | AMX (the tile unit) is reported absent |
//!
//! AMX is not a tier: it serves the graph runtime's integer GEMM (exact, so the same results as
//! the VNNI tile) and its opt-in bf16 GEMM, on top of [`Tier::Avx512Vnni`], and goes with it
//! when AVX-512 is switched off. The kernel asks the OS once for the tile state (Linux `arch_prctl`); where
//! that is refused AMX counts as absent.
//!
//! [`Tier`] orders the kernel families from the portable one up; a planner picks a kernel by
//! (weight type, tier, rows in the call), see [`crate::matmul::PackedMatrix`]. ARM's NEON (and
//! dot-product, SVE) are detected for the tier table but have no kernels yet.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// CPU features the kernels use, after the environment's overrides.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Features {
    pub avx2: bool,
    pub fma: bool,
    pub f16c: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512vl: bool,
    pub avx512vnni: bool,
    pub avx512bf16: bool,
    /// AVX-VNNI: `vpdpbusd` on 256-bit registers without AVX-512 (Alder Lake and later, Zen 5).
    pub avxvnni: bool,
    /// AMX tiles with the 8-bit dot products (`tdpbusd`), and the OS lets this process use them.
    pub amx_int8: bool,
    /// AMX tiles with the bf16 dot products (`tdpbf16ps`), and the OS lets this process use them.
    pub amx_bf16: bool,
    pub neon: bool,
    pub dotprod: bool,
    pub sve: bool,
}

/// A family of kernels, from the portable one up. Each tier's kernels need the features of
/// every tier below it on the same architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Plain Rust. The quantized dot products keep the float order of llama.cpp's x86 AVX2 build
    /// (`quant::vec_dot_lanes`), so they give the same bits as the x86 tiers.
    Portable,
    /// x86_64 AVX2 + FMA + F16C (llama.cpp's `haswell` build).
    Avx2,
    /// AVX2 with AVX-VNNI.
    Avx2Vnni,
    /// AVX-512 F/BW/VL with VNNI.
    Avx512Vnni,
}

impl Tier {
    /// Every tier, lowest first.
    pub const ALL: [Tier; 4] = [Tier::Portable, Tier::Avx2, Tier::Avx2Vnni, Tier::Avx512Vnni];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Portable => "portable",
            Tier::Avx2 => "avx2",
            Tier::Avx2Vnni => "avx2+avx-vnni",
            Tier::Avx512Vnni => "avx512-vnni",
        }
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn env_set(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| !v.is_empty() && v != "0")
}

/// The hardware's features, without the overrides. Asks the CPU (and for AMX the OS) each time:
/// slow in a virtual machine, where CPUID traps; [`hardware`] keeps the answer.
pub fn detected() -> Features {
    #[allow(unused_mut)]
    let mut f = Features::default();
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        f.avx2 = has!("avx2");
        f.fma = has!("fma");
        f.f16c = has!("f16c");
        f.avx512f = has!("avx512f");
        f.avx512bw = has!("avx512bw");
        f.avx512vl = has!("avx512vl");
        f.avx512vnni = has!("avx512vnni");
        f.avx512bf16 = has!("avx512bf16");
        f.avxvnni = has!("avxvnni");
        (f.amx_int8, f.amx_bf16) = amx();
    }
    #[cfg(target_arch = "aarch64")]
    {
        use std::arch::is_aarch64_feature_detected as has;
        f.neon = has!("neon");
        f.dotprod = has!("dotprod");
        f.sve = has!("sve");
    }
    f
}

/// AMX-INT8 and AMX-BF16 by CPUID (leaf 7, EDX bits 25 and 22, each with AMX-TILE, bit 24),
/// when the OS grants this process the tile data state (asked here; without it the first tile
/// instruction faults).
#[cfg(target_arch = "x86_64")]
fn amx() -> (bool, bool) {
    // CPUID is present on every x86_64 CPU; leaf 7 is read only when the CPU reports it.
    if std::arch::x86_64::__cpuid(0).eax < 7 {
        return (false, false);
    }
    let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
    let (int8, bf16) = (edx & (1 << 25) != 0, edx & (1 << 22) != 0);
    if edx & (1 << 24) == 0 || !(int8 || bf16) || !tile_state_granted() {
        return (false, false);
    }
    (int8, bf16)
}

/// Asks the OS for the AMX tile data state (Linux `arch_prctl(ARCH_REQ_XCOMP_PERM)`).
#[cfg(target_arch = "x86_64")]
fn tile_state_granted() -> bool {
    #[cfg(target_os = "linux")]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM takes two integers and touches no memory
        // of ours; it fails (non-zero) on kernels without AMX support.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// [`detected`], read once.
pub fn hardware() -> &'static Features {
    static F: OnceLock<Features> = OnceLock::new();
    F.get_or_init(detected)
}

/// `f` with the environment's switches applied (see the module text).
pub fn with_overrides(mut f: Features, scalar: bool, no_avx512: bool, no_vnni: bool) -> Features {
    if scalar {
        return Features::default();
    }
    if no_avx512 {
        f.avx512f = false;
        f.avx512bw = false;
        f.avx512vl = false;
        f.avx512vnni = false;
        f.avx512bf16 = false;
        f.amx_int8 = false;
        f.amx_bf16 = false;
    }
    if no_vnni {
        f.avxvnni = false;
    }
    f
}

/// The environment's features: detected once, the `FERRUM_*` switches applied.
fn base() -> &'static Features {
    static F: OnceLock<Features> = OnceLock::new();
    F.get_or_init(|| {
        let mut f = with_overrides(
            *hardware(),
            env_set("FERRUM_FORCE_SCALAR"),
            env_set("FERRUM_NO_AVX512"),
            env_set("FERRUM_NO_AVX_VNNI"),
        );
        if env_set("FERRUM_NO_AMX") {
            f.amx_int8 = false;
            f.amx_bf16 = false;
        }
        f
    })
}

/// The highest tier kernels may use, set by [`set_tier_cap`] (0: no cap).
static CAP: AtomicU8 = AtomicU8::new(0);

/// This process's features: detected once, the environment's switches applied, and capped at
/// [`set_tier_cap`]'s tier when one is set. Every kernel asks here, at every call.
pub fn features() -> Features {
    let f = *base();
    match CAP.load(Ordering::Relaxed) {
        0 => f,
        c => f.capped(Tier::ALL[usize::from(c) - 1]),
    }
}

/// Caps the kernels of the whole process at `tier` (`None`: no cap), so one process can run every
/// tier the CPU has in turn (the kernel harness, benchmarks). Only lowers what the CPU and the
/// environment allow. Set it while no kernel is running: a product that reads the tier twice
/// must see one value (and weights packed for one tier are read by its kernels only; see
/// `PackedMatrix::plan_layout`).
pub fn set_tier_cap(tier: Option<Tier>) {
    let v = tier.map_or(0, |t| {
        Tier::ALL.iter().position(|&x| x == t).unwrap() as u8 + 1
    });
    CAP.store(v, Ordering::Relaxed);
}

impl Features {
    /// These features with everything above `tier` removed.
    pub fn capped(mut self, tier: Tier) -> Features {
        if tier < Tier::Avx512Vnni {
            self = with_overrides(self, false, true, false);
        }
        if tier < Tier::Avx2Vnni {
            self.avxvnni = false;
        }
        if tier < Tier::Avx2 {
            self = Features::default();
        }
        self
    }

    /// AVX2, FMA and F16C: the base of every x86 SIMD kernel here.
    pub fn x86_simd(&self) -> bool {
        self.avx2 && self.fma && self.f16c
    }

    /// AVX-512 F/BW/VL on top of [`Features::x86_simd`].
    pub fn avx512(&self) -> bool {
        self.x86_simd() && self.avx512f && self.avx512bw && self.avx512vl
    }

    /// The best tier these features run.
    pub fn tier(&self) -> Tier {
        if self.avx512() && self.avx512vnni {
            Tier::Avx512Vnni
        } else if self.x86_simd() && self.avxvnni {
            Tier::Avx2Vnni
        } else if self.x86_simd() {
            Tier::Avx2
        } else {
            Tier::Portable
        }
    }

    /// Every tier these features run, lowest first (for tests that compare them).
    pub fn tiers(&self) -> Vec<Tier> {
        let top = self.tier();
        Tier::ALL
            .into_iter()
            .filter(|&t| {
                t <= top
                    && (t != Tier::Avx2Vnni || self.avxvnni)
                    && (t == Tier::Portable || self.x86_simd())
            })
            .collect()
    }
}

/// This process's kernel tier.
pub fn tier() -> Tier {
    features().tier()
}

/// Who designed the CPU: some choices that do not change results (software prefetch hints) pay
/// on one vendor's cores and cost on the other's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vendor {
    Intel,
    Amd,
    Other,
}

/// The CPU's vendor by the CPUID vendor string (read once; [`Vendor::Other`] off x86).
pub fn vendor() -> Vendor {
    static V: OnceLock<Vendor> = OnceLock::new();
    *V.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // CPUID leaf 0 is present on every x86_64 CPU: the vendor string in EBX, EDX, ECX.
            let r = std::arch::x86_64::__cpuid(0);
            let mut id = [0u8; 12];
            id[..4].copy_from_slice(&r.ebx.to_le_bytes());
            id[4..8].copy_from_slice(&r.edx.to_le_bytes());
            id[8..].copy_from_slice(&r.ecx.to_le_bytes());
            vendor_of(&id)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Vendor::Other
        }
    })
}

/// The CPU's family as CPUID leaf 1 reports it (the base family, plus the extended family when
/// the base is 15: AMD Zen 3 and 4 are 25, Zen 5 is 26); 0 off x86.
pub fn family() -> u32 {
    static F: OnceLock<u32> = OnceLock::new();
    *F.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // CPUID leaf 1 is present on every x86_64 CPU: the signature in EAX.
            family_of(std::arch::x86_64::__cpuid(1).eax)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            0
        }
    })
}

/// The family in a CPUID leaf-1 signature (EAX).
pub fn family_of(eax: u32) -> u32 {
    let base = (eax >> 8) & 0xf;
    if base == 0xf {
        base + ((eax >> 20) & 0xff)
    } else {
        base
    }
}

/// The vendor a CPUID vendor string names.
pub fn vendor_of(id: &[u8; 12]) -> Vendor {
    match id {
        b"GenuineIntel" => Vendor::Intel,
        b"AuthenticAMD" | b"HygonGenuine" => Vendor::Amd,
        _ => Vendor::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> Features {
        Features {
            avx2: true,
            fma: true,
            f16c: true,
            avx512f: true,
            avx512bw: true,
            avx512vl: true,
            avx512vnni: true,
            avx512bf16: true,
            avxvnni: true,
            ..Features::default()
        }
    }

    #[test]
    fn overrides_step_down_tiers() {
        assert_eq!(full().tier(), Tier::Avx512Vnni);
        assert_eq!(
            with_overrides(full(), false, true, false).tier(),
            Tier::Avx2Vnni
        );
        assert_eq!(with_overrides(full(), false, true, true).tier(), Tier::Avx2);
        assert_eq!(
            with_overrides(full(), true, false, false).tier(),
            Tier::Portable
        );
        let no_vnni = Features {
            avxvnni: false,
            ..full()
        };
        assert_eq!(
            no_vnni.tiers(),
            vec![Tier::Portable, Tier::Avx2, Tier::Avx512Vnni]
        );
        assert_eq!(Features::default().tiers(), vec![Tier::Portable]);
        for t in Tier::ALL {
            assert!(full().capped(t).tier() <= t, "{t}");
        }
        assert_eq!(full().capped(Tier::Avx2).tier(), Tier::Avx2);
    }

    #[test]
    fn vendor_strings_name_their_vendor() {
        assert_eq!(vendor_of(b"GenuineIntel"), Vendor::Intel);
        assert_eq!(vendor_of(b"AuthenticAMD"), Vendor::Amd);
        assert_eq!(vendor_of(b"HygonGenuine"), Vendor::Amd);
        assert_eq!(vendor_of(b"VIA VIA VIA "), Vendor::Other);
        // Signatures: Zen 4 (EPYC 9004), Zen 5 (EPYC 9005), a Sapphire Rapids Xeon.
        assert_eq!(family_of(0x00A1_0F11), 25);
        assert_eq!(family_of(0x00B0_0F21), 26);
        assert_eq!(family_of(0x0008_06F8), 6);
        #[cfg(target_arch = "x86_64")]
        {
            let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
            if let Some(line) = cpuinfo.lines().find(|l| l.starts_with("vendor_id")) {
                let name = line.split(':').nth(1).unwrap_or("").trim();
                if let Ok(id) = <[u8; 12]>::try_from(name.as_bytes()) {
                    assert_eq!(vendor(), vendor_of(&id), "{name}");
                }
            }
        }
    }
}
