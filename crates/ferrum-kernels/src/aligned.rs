//! Byte storage whose first byte is 64-byte aligned, viewed as `u8`, `i8`, `u16` or `f32`: packed
//! GEMM operands, whose 64-byte tile rows and AVX-512 vectors (at multiples of 64 from the start)
//! then never straddle two cache lines. A large `Vec` sits 16 bytes into its pages, which made every AMX tile load
//! touch twice the lines, and whether an operand was aligned changed with the allocation
//! history (bf16 ViT-B/16 at one thread: 95 or 120 ms from one build to the next).

/// One cache line.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// 64-byte aligned bytes (see the module notes).
#[derive(Clone, Default)]
pub struct Aligned {
    lines: Vec<Line>,
    len: usize,
}

impl std::fmt::Debug for Aligned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Aligned({} bytes)", self.len)
    }
}

impl Aligned {
    /// No bytes.
    pub const fn new() -> Aligned {
        Aligned {
            lines: Vec::new(),
            len: 0,
        }
    }

    /// `n` zero bytes.
    pub fn zeroed(n: usize) -> Aligned {
        Aligned {
            lines: vec![Line([0; 64]); n.div_ceil(64)],
            len: n,
        }
    }

    /// Resized to `n` bytes, growing the storage (with zeros) when needed; the bytes kept from
    /// before are unspecified to the caller (buffers that are written before they are read).
    pub fn resize_for(&mut self, n: usize) {
        if self.lines.len() * 64 < n {
            self.lines.resize(n.div_ceil(64), Line([0; 64]));
        }
        self.len = n;
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `Line` is `repr(C)` over 64 bytes with no padding, so the lines are
        // `64 * lines.len() >= len` consecutive initialised bytes.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<u8>(), self.len) }
    }

    pub fn i8s(&self) -> &[i8] {
        // SAFETY: as in `bytes`; i8 has the size and alignment of u8 and every bit pattern.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<i8>(), self.len) }
    }

    pub fn i8s_mut(&mut self) -> &mut [i8] {
        // SAFETY: as in `i8s`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<i8>(), self.len) }
    }

    /// The first `len / 2` u16 (native order).
    pub fn u16s(&self) -> &[u16] {
        // SAFETY: as in `bytes`; the start is 64-byte aligned (so u16-aligned), and every bit
        // pattern is a u16.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<u16>(), self.len / 2) }
    }

    /// The first `len / 4` f32 (native order).
    pub fn f32s(&self) -> &[f32] {
        // SAFETY: as in `bytes`; the start is 64-byte aligned (so f32-aligned), and every bit
        // pattern is an f32.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len / 4) }
    }

    pub fn f32s_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `f32s`.
        unsafe {
            std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), self.len / 4)
        }
    }

    pub fn u16s_mut(&mut self) -> &mut [u16] {
        // SAFETY: as in `u16s`.
        unsafe {
            std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<u16>(), self.len / 2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_is_aligned_and_keeps_its_length() {
        for n in [0usize, 1, 63, 64, 65, 1000, 100_000] {
            let mut a = Aligned::zeroed(n);
            assert_eq!(a.bytes().len(), n);
            assert!(a.bytes().iter().all(|&b| b == 0));
            assert_eq!(a.bytes().as_ptr() as usize % 64, 0);
            a.resize_for(2 * n + 2);
            assert_eq!(
                (a.u16s().len(), a.u16s().as_ptr() as usize % 64),
                (n + 1, 0)
            );
            a.u16s_mut().fill(7);
            assert!(a.u16s().iter().all(|&v| v == 7));
            assert_eq!(a.i8s_mut().len(), 2 * n + 2);
        }
    }
}
