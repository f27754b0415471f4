//! The sub-byte and 8-bit formats ONNX stores but does not compute in: float8 (E4M3FN,
//! E4M3FNUZ, E5M2, E5M2FNUZ, E8M0), float4 E2M1, float6 (E2M3, E3M2), int4/uint4, int2/uint2.
//!
//! Tensors of these types hold one code per element (`Data::Code`); kernels see them through
//! [`decode`] (to f64) and produce them through [`encode`]. In files they are bit-packed
//! LSB-first ([`unpack`], [`pack`]).

use crate::tensor::DType;

/// Bits per element in a file.
pub fn bits(dt: DType) -> usize {
    match dt {
        DType::U4 | DType::I4 | DType::F4E2M1 => 4,
        DType::U2 | DType::I2 => 2,
        DType::F6E2M3 | DType::F6E3M2 => 6,
        _ => 8,
    }
}

/// Element codes from an LSB-first bit stream.
pub fn unpack(dt: DType, raw: &[u8], n: usize) -> Vec<u8> {
    let b = bits(dt);
    if b == 8 {
        return raw[..n].to_vec();
    }
    let mask = (1u16 << b) - 1;
    (0..n)
        .map(|i| {
            let bit = i * b;
            let (byte, shift) = (bit / 8, bit % 8);
            let lo = raw[byte] as u16;
            let hi = raw.get(byte + 1).copied().unwrap_or(0) as u16;
            (((lo | hi << 8) >> shift) & mask) as u8
        })
        .collect()
}

/// Element codes to an LSB-first bit stream.
pub fn pack(dt: DType, codes: &[u8]) -> Vec<u8> {
    let b = bits(dt);
    if b == 8 {
        return codes.to_vec();
    }
    let mut out = vec![0u8; (codes.len() * b).div_ceil(8)];
    for (i, &c) in codes.iter().enumerate() {
        let bit = i * b;
        let (byte, shift) = (bit / 8, bit % 8);
        let v = (c as u16) << shift;
        out[byte] |= v as u8;
        if let Some(h) = out.get_mut(byte + 1) {
            *h |= (v >> 8) as u8;
        }
    }
    out
}

/// Bytes a file uses for `n` elements.
pub fn packed_len(dt: DType, n: usize) -> usize {
    (n * bits(dt)).div_ceil(8)
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// IEEE-like: all-ones exponent is Inf (mantissa 0) or NaN.
    Ieee,
    /// No Inf; NaN is all ones (E4M3FN).
    Fn,
    /// No Inf, no -0; NaN is the sign bit alone (FNUZ).
    Fnuz,
    /// Neither Inf nor NaN (float4, float6).
    Finite,
}

struct Fmt {
    e: u32,
    m: u32,
    bias: i32,
    kind: Kind,
    max: f64,
}

fn fmt(dt: DType) -> Option<Fmt> {
    let f = |e, m, bias, kind, max| {
        Some(Fmt {
            e,
            m,
            bias,
            kind,
            max,
        })
    };
    match dt {
        DType::F8E4M3FN => f(4, 3, 7, Kind::Fn, 448.0),
        DType::F8E4M3FNUZ => f(4, 3, 8, Kind::Fnuz, 240.0),
        DType::F8E5M2 => f(5, 2, 15, Kind::Ieee, 57344.0),
        DType::F8E5M2FNUZ => f(5, 2, 16, Kind::Fnuz, 57344.0),
        DType::F4E2M1 => f(2, 1, 1, Kind::Finite, 6.0),
        DType::F6E2M3 => f(2, 3, 1, Kind::Finite, 7.5),
        DType::F6E3M2 => f(3, 2, 3, Kind::Finite, 28.0),
        _ => None,
    }
}

/// The value of one code.
pub fn decode(dt: DType, c: u8) -> f64 {
    match dt {
        DType::U4 | DType::U2 => return c as f64,
        DType::I4 => return ((c << 4) as i8 >> 4) as f64,
        DType::I2 => return ((c << 6) as i8 >> 6) as f64,
        DType::F8E8M0 => {
            return if c == 0xFF {
                f64::NAN
            } else {
                (2f64).powi(c as i32 - 127)
            }
        }
        _ => {}
    }
    let Some(f) = fmt(dt) else { return f64::NAN };
    let sign_bit = 1u8 << (f.e + f.m);
    if f.kind == Kind::Fnuz && c == sign_bit {
        return f64::NAN;
    }
    let neg = c & sign_bit != 0;
    let ex = ((c >> f.m) & ((1 << f.e) - 1)) as i32;
    let man = (c & ((1 << f.m) - 1)) as i32;
    let all = (1 << f.e) - 1;
    if f.kind == Kind::Ieee && ex == all {
        return if man == 0 {
            if neg {
                f64::NEG_INFINITY
            } else {
                f64::INFINITY
            }
        } else {
            f64::NAN
        };
    }
    if f.kind == Kind::Fn && ex == all && man == (1 << f.m) - 1 {
        return f64::NAN;
    }
    let v = if ex == 0 {
        man as f64 * 2f64.powi(1 - f.bias - f.m as i32)
    } else {
        (1.0 + man as f64 / (1 << f.m) as f64) * 2f64.powi(ex - f.bias)
    };
    if neg {
        -v
    } else {
        v
    }
}

/// The code of an integer value (low bits kept, two's complement).
pub fn encode_int(dt: DType, v: i128) -> u8 {
    let mask = (1i128 << bits(dt)) - 1;
    (v & mask) as u8
}

/// The code nearest `v` (round half to even). `saturate`: out-of-range values and ±Inf become
/// ±max instead of Inf/NaN. `round_mode` is for E8M0 ("up", "down", "nearest").
pub fn encode(dt: DType, v: f64, saturate: bool, round_mode: &str) -> u8 {
    match dt {
        DType::U4 | DType::I4 | DType::U2 | DType::I2 => {
            if !v.is_finite() {
                return 0;
            }
            return encode_int(dt, v.round_ties_even() as i128);
        }
        DType::F8E8M0 => return encode_e8m0(v as f32, saturate, round_mode),
        _ => {}
    }
    let Some(f) = fmt(dt) else { return 0 };
    let sign_bit = 1u8 << (f.e + f.m);
    let all_e = (1u8 << f.e) - 1;
    let nan = match f.kind {
        Kind::Fn => (all_e << f.m) | ((1 << f.m) - 1),
        Kind::Fnuz => sign_bit,
        Kind::Ieee => (all_e << f.m) | (1 << (f.m - 1)),
        Kind::Finite => sign_bit,
    };
    if v.is_nan() {
        return nan;
    }
    let neg = v.is_sign_negative();
    let sign = if neg { sign_bit } else { 0 };
    let max_code = |neg: bool| -> u8 {
        let s = if neg { sign_bit } else { 0 };
        let top = match f.kind {
            Kind::Ieee => ((all_e - 1) << f.m) | ((1 << f.m) - 1),
            Kind::Fn => (all_e << f.m) | ((1 << f.m) - 2),
            _ => (all_e << f.m) | ((1 << f.m) - 1),
        };
        s | top
    };
    let overflow = |neg: bool| -> u8 {
        if saturate || f.kind == Kind::Finite {
            max_code(neg)
        } else if f.kind == Kind::Ieee {
            (if neg { sign_bit } else { 0 }) | (all_e << f.m)
        } else {
            nan
        }
    };
    let a = v.abs();
    if a.is_infinite() {
        return overflow(neg);
    }
    let emin = 1 - f.bias;
    let e = (a.log2().floor() as i32).max(emin);
    let q = 2f64.powi(e - f.m as i32);
    let r = (a / q).round_ties_even() * q;
    if r > f.max {
        return overflow(neg);
    }
    if r == 0.0 {
        // FNUZ formats have no negative zero (its code is NaN).
        return if f.kind == Kind::Fnuz { 0 } else { sign };
    }
    let e2 = r.log2().floor() as i32;
    let code = if e2 < emin {
        (r / 2f64.powi(emin - f.m as i32)) as u8
    } else {
        let ex = (e2 + f.bias) as u8;
        let man = (r / 2f64.powi(e2 - f.m as i32)) as u32 - (1 << f.m);
        (ex << f.m) | man as u8
    };
    sign | code
}

/// E8M0 from the f32 exponent field, as the ONNX reference does (sign ignored).
fn encode_e8m0(x: f32, saturate: bool, mode: &str) -> u8 {
    let b = x.to_bits();
    let exp = (b >> 23) & 0xFF;
    if exp == 0xFF {
        return 0xFF;
    }
    let frac = b & 0x7F_FFFF;
    let up = match mode {
        "nearest" => {
            let g = frac & 0x40_0000 != 0;
            let r = frac & 0x20_0000 != 0;
            let s = frac & 0x1F_FFFF != 0;
            g && (r || s || exp > 0)
        }
        "down" => false,
        _ => frac != 0,
    };
    if up && saturate && exp == 0xFE {
        return 0xFE;
    }
    (exp + up as u32).min(0xFF) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float8_known_codes() {
        assert_eq!(encode(DType::F8E4M3FN, 448.0, true, "up"), 0x7E);
        assert_eq!(encode(DType::F8E4M3FN, 1e6, true, "up"), 0x7E);
        assert_eq!(encode(DType::F8E4M3FN, 1e6, false, "up"), 0x7F); // NaN
        assert_eq!(encode(DType::F8E4M3FN, -1.0, true, "up"), 0xB8);
        assert_eq!(encode(DType::F8E5M2, f64::INFINITY, false, "up"), 0x7C);
        assert_eq!(encode(DType::F8E5M2, f64::INFINITY, true, "up"), 0x7B);
        assert_eq!(encode(DType::F8E4M3FNUZ, -0.0, true, "up"), 0x00);
        assert!(decode(DType::F8E4M3FNUZ, 0x80).is_nan());
        assert_eq!(decode(DType::F8E5M2FNUZ, 0x7F), 57344.0);
        // round half to even: 1.0625 lies halfway between 1.0 and 1.125 in E4M3
        assert_eq!(
            decode(DType::F8E4M3FN, encode(DType::F8E4M3FN, 1.0625, true, "up")),
            1.0
        );
        // smallest subnormal of E4M3FN is 2^-9
        assert_eq!(decode(DType::F8E4M3FN, 0x01), 2f64.powi(-9));
    }

    #[test]
    fn every_float8_code_round_trips() {
        for dt in [
            DType::F8E4M3FN,
            DType::F8E4M3FNUZ,
            DType::F8E5M2,
            DType::F8E5M2FNUZ,
            DType::F4E2M1,
        ] {
            let n = 1u16 << bits(dt);
            for c in 0..n {
                let v = decode(dt, c as u8);
                if v.is_nan() || (v == 0.0 && v.is_sign_negative() && dt == DType::F8E4M3FNUZ) {
                    continue;
                }
                let back = encode(dt, v, false, "up");
                assert_eq!(decode(dt, back), v, "{dt} code {c:#x}");
            }
        }
    }

    #[test]
    fn e8m0_and_small_ints() {
        assert_eq!(encode(DType::F8E8M0, 1.0, true, "up"), 0x7F);
        assert_eq!(encode(DType::F8E8M0, 1.1, true, "up"), 0x80); // rounds up to 2
        assert_eq!(encode(DType::F8E8M0, 1.1, true, "down"), 0x7F);
        assert_eq!(decode(DType::F8E8M0, 0x80), 2.0);
        assert_eq!(encode(DType::I4, -9.0, true, "up"), 7); // wraps modulo 16
        assert_eq!(decode(DType::I4, 0x8), -8.0);
        assert_eq!(decode(DType::I2, 0x3), -1.0);
        assert_eq!(encode(DType::F4E2M1, 5.0, true, "up"), 0x6); // 5 is halfway 4..6 -> even (4)
        assert_eq!(encode(DType::F4E2M1, 100.0, false, "up"), 0x7); // always saturates
    }

    #[test]
    fn packing_is_lsb_first() {
        // INT4 [1, -2, 3] -> bytes [0xE1, 0x03]
        let codes: Vec<u8> = [1i128, -2, 3]
            .iter()
            .map(|&v| encode_int(DType::I4, v))
            .collect();
        assert_eq!(pack(DType::I4, &codes), vec![0xE1, 0x03]);
        assert_eq!(unpack(DType::I4, &[0xE1, 0x03], 3), codes);
        // INT2 [1, -2, 0, -1, 1] -> [201, 1]
        let codes: Vec<u8> = [1i128, -2, 0, -1, 1]
            .iter()
            .map(|&v| encode_int(DType::I2, v))
            .collect();
        assert_eq!(pack(DType::I2, &codes), vec![201, 1]);
        // 6-bit: four codes in three bytes
        let six = [0x3F, 0x01, 0x20, 0x15];
        assert_eq!(
            unpack(DType::F6E2M3, &pack(DType::F6E2M3, &six), 4),
            six.to_vec()
        );
        assert_eq!(packed_len(DType::F6E2M3, 4), 3);
    }
}
