//! Storage types. Quantized types store `block_size` elements in `block_bytes` bytes, blocks running
//! along the innermost (contiguous) axis; the ids are GGML's `ggml_type` values, which GGUF files use.

/// Every storage type ferrum reads or computes with. Adding one is a variant here plus its row
/// in [`TABLE`] (and, in `ferrum-kernels`, the block format that reads it).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    /// Activation-only: Q8_0 plus the block sum, partner of Q4_1/Q5_1 weights.
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    /// Activation-only: f32 scale, 256 int8 and 16 partial sums, partner of the K-quants.
    Q8_K,
    /// 32 weights: f16 scale and 4-bit indices into a fixed non-linear table (`kvalues_iq4nl`).
    IQ4_NL,
    /// 256 weights: IQ4_NL's table with a 6-bit scale per 32 (an f16 super-scale).
    IQ4_XS,
    /// 256 weights, 2.06 bits each: groups of 8 from a 256-entry lattice, 7-bit sign patterns,
    /// a 4-bit scale per 32.
    IQ2_XXS,
    /// 256 weights, 2.31 bits: a 512-entry lattice, a 4-bit scale per 16.
    IQ2_XS,
    /// 256 weights, 2.56 bits: a 1024-entry lattice, explicit sign bytes.
    IQ2_S,
    /// 256 weights, 3.06 bits: groups of 4 from a 256-entry lattice.
    IQ3_XXS,
    /// 256 weights, 3.44 bits: a 512-entry lattice, explicit sign bytes.
    IQ3_S,
    /// 256 weights, 1.56 bits: groups of 8 in {-1, 0, 1} (2048-entry lattice) plus a shift.
    IQ1_S,
    /// 256 weights, 1.75 bits: IQ1_S's lattice, a scale per 16 and the f16 scale spread over them.
    IQ1_M,
    /// 256 ternary weights, 1.69 bits: five trits per byte (base 3).
    TQ1_0,
    /// 256 ternary weights, 2.06 bits: 2 bits each.
    TQ2_0,
    /// 32 weights, 4.25 bits: FP4 (E2M1) values with a shared power-of-two scale (E8M0).
    MXFP4,
}

/// What a storage type is: GGML's id and name, elements and bytes per block.
#[derive(Clone, Copy, Debug)]
pub struct TypeInfo {
    pub dtype: DType,
    /// GGML's `ggml_type` id (what GGUF files store).
    pub ggml_id: u32,
    pub name: &'static str,
    /// Elements per block (1 for plain float types).
    pub block_size: usize,
    pub block_bytes: usize,
}

const fn info(
    dtype: DType,
    ggml_id: u32,
    name: &'static str,
    block_size: usize,
    block_bytes: usize,
) -> TypeInfo {
    TypeInfo {
        dtype,
        ggml_id,
        name,
        block_size,
        block_bytes,
    }
}

/// One row per [`DType`], in declaration order. Q8_1 blocks are 40 bytes here: ggml's 36 plus 4
/// bytes of padding (Q8_1 never appears in files).
pub const TABLE: [TypeInfo; 27] = [
    info(DType::F32, 0, "F32", 1, 4),
    info(DType::F16, 1, "F16", 1, 2),
    info(DType::BF16, 30, "BF16", 1, 2),
    info(DType::Q4_0, 2, "Q4_0", 32, 18),
    info(DType::Q4_1, 3, "Q4_1", 32, 20),
    info(DType::Q5_0, 6, "Q5_0", 32, 22),
    info(DType::Q5_1, 7, "Q5_1", 32, 24),
    info(DType::Q8_0, 8, "Q8_0", 32, 34),
    info(DType::Q8_1, 9, "Q8_1", 32, 40),
    info(DType::Q2_K, 10, "Q2_K", 256, 84),
    info(DType::Q3_K, 11, "Q3_K", 256, 110),
    info(DType::Q4_K, 12, "Q4_K", 256, 144),
    info(DType::Q5_K, 13, "Q5_K", 256, 176),
    info(DType::Q6_K, 14, "Q6_K", 256, 210),
    info(DType::Q8_K, 15, "Q8_K", 256, 292),
    info(DType::IQ4_NL, 20, "IQ4_NL", 32, 18),
    info(DType::IQ4_XS, 23, "IQ4_XS", 256, 136),
    info(DType::IQ2_XXS, 16, "IQ2_XXS", 256, 66),
    info(DType::IQ2_XS, 17, "IQ2_XS", 256, 74),
    info(DType::IQ2_S, 22, "IQ2_S", 256, 82),
    info(DType::IQ3_XXS, 18, "IQ3_XXS", 256, 98),
    info(DType::IQ3_S, 21, "IQ3_S", 256, 110),
    info(DType::IQ1_S, 19, "IQ1_S", 256, 50),
    info(DType::IQ1_M, 29, "IQ1_M", 256, 56),
    info(DType::TQ1_0, 34, "TQ1_0", 256, 54),
    info(DType::TQ2_0, 35, "TQ2_0", 256, 66),
    info(DType::MXFP4, 39, "MXFP4", 32, 17),
];

impl DType {
    /// Every type, in declaration order.
    pub const ALL: [DType; TABLE.len()] = {
        let mut all = [DType::F32; TABLE.len()];
        let mut i = 0;
        while i < TABLE.len() {
            all[i] = TABLE[i].dtype;
            i += 1;
        }
        all
    };

    /// This type's row of [`TABLE`].
    pub const fn info(self) -> &'static TypeInfo {
        &TABLE[self as usize]
    }

    /// GGML's `ggml_type` id.
    pub const fn ggml_id(self) -> u32 {
        self.info().ggml_id
    }

    pub fn from_ggml_id(id: u32) -> Option<DType> {
        TABLE.iter().find(|t| t.ggml_id == id).map(|t| t.dtype)
    }

    /// The name GGML gives a type id ferrum does not support, for error messages.
    pub fn ggml_name_of_id(id: u32) -> &'static str {
        if let Some(d) = DType::from_ggml_id(id) {
            return d.name();
        }
        match id {
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            40 => "NVFP4",
            _ => "unknown",
        }
    }

    pub const fn name(self) -> &'static str {
        self.info().name
    }

    /// Elements per block (1 for plain float types).
    pub const fn block_size(self) -> usize {
        self.info().block_size
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        self.info().block_bytes
    }

    pub const fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes taken by a row of `n` elements, or `None` when `n` is not a whole number of blocks
    /// or the size overflows.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.block_bytes())
    }

    /// Bits per weight, for reports.
    pub fn bits_per_weight(self) -> f64 {
        self.block_bytes() as f64 * 8.0 / self.block_size() as f64
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_sizes_match_ggml() {
        for d in DType::ALL {
            assert_eq!(DType::from_ggml_id(d.ggml_id()), Some(d));
        }
        for (i, t) in TABLE.iter().enumerate() {
            assert_eq!(t.dtype as usize, i, "{} is out of place in TABLE", t.name);
            assert_eq!(format!("{:?}", t.dtype), t.name);
        }
        assert_eq!(DType::from_ggml_id(24), None);
        assert_eq!(DType::from_ggml_id(16), Some(DType::IQ2_XXS));
        assert!((DType::IQ2_XXS.bits_per_weight() - 2.0625).abs() < 1e-12);
        assert!((DType::IQ1_S.bits_per_weight() - 1.5625).abs() < 1e-12);
        assert!((DType::TQ1_0.bits_per_weight() - 1.6875).abs() < 1e-12);
        assert!((DType::MXFP4.bits_per_weight() - 4.25).abs() < 1e-12);
        assert_eq!(DType::from_ggml_id(23), Some(DType::IQ4_XS));
        assert!((DType::IQ4_XS.bits_per_weight() - 4.25).abs() < 1e-12);
        assert!((DType::IQ4_NL.bits_per_weight() - 4.5).abs() < 1e-12);
        assert_eq!(DType::Q4_K.row_bytes(512), Some(288));
        assert_eq!(DType::Q4_K.row_bytes(100), None);
        assert!((DType::Q4_K.bits_per_weight() - 4.5).abs() < 1e-12);
        assert!((DType::Q6_K.bits_per_weight() - 6.5625).abs() < 1e-12);
    }
}
