//! Constant weights packed for the GEMM once, when the session is created, instead of at every
//! run: a MatMul's or Gemm's constant B in the kernel's column panels, a Conv's constant filter
//! (one group) as its A in row panels, a MatMulInteger's (or MatMulIntegerToFloat's) constant
//! 8-bit B in the integer kernel's panels ([`PackedI8`]), a QLinearConv's 8-bit filter (one
//! group) likewise. The graph is unchanged; the packed copies sit in
//! [`Graph::packed`] under the initializer they were made from (the float ones in f32, or rounded
//! to bf16 when the session asks for bf16: products with them then run on the tile unit), and the products take them from
//! there ([`crate::ops::Ctx::packed_b`], [`crate::ops::Ctx::packed_a`]).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use ferrum_kernels::gemm::{Mat, PackedA, PackedB, Precision};
use ferrum_kernels::qgemm::{Bytes, PackedI8};
use ferrum_kernels::winograd::WinogradFilter;

use super::{constant, DOMAIN};
use crate::infer::Shapes;
use crate::ir::{Attr, Graph, ValueId};
use crate::tensor::DType;

/// How a product reads a constant it has packed.
///
/// A channels-last 1x1 filter (`NhwcConv`, stored `[1, 1, C, M]`) is packed as [`Role::B`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// B of `A B` (`k x n`, row-major): MatMul's second input, Gemm's without `transB`.
    B,
    /// Gemm's B with `transB` (stored `n x k`).
    BTransposed,
    /// A Conv's filter (`M x C x kh x kw`, one group) as the A of `W col(x)`.
    ConvFilter,
    /// An 8-bit B (`k x n`) of MatMulInteger / MatMulIntegerToFloat.
    IntB,
    /// QLinearConv's 8-bit filter (`M x C x kh x kw`, one group) as the B of `col(X)^T W^T`.
    IntFilter,
    /// A 3x3 Conv filter (stride 1, dilation 1, one group) transformed for the Winograd
    /// convolution ([`ferrum_kernels::winograd`]): in place of its [`Role::ConvFilter`] panels
    /// where the output's size is known and Winograd pays, beside them where it is not known
    /// (each run then picks by the size it sees).
    Winograd,
}

enum Packed {
    A(PackedA),
    B(PackedB),
    I8(PackedI8),
    Winograd(WinogradFilter),
}

/// The packed constants of one graph, by initializer and role.
#[derive(Clone, Default)]
pub struct PackedWeights(HashMap<(ValueId, Role), Arc<Packed>>);

impl fmt::Debug for PackedWeights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PackedWeights({} operands)", self.0.len())
    }
}

impl PackedWeights {
    /// The packed B made from `v` read as `role` ([`Role::B`] or [`Role::BTransposed`]).
    pub fn b(&self, v: ValueId, role: Role) -> Option<&PackedB> {
        match self.0.get(&(v, role))?.as_ref() {
            Packed::B(p) => Some(p),
            _ => None,
        }
    }

    /// The packed 8-bit B made from `v`.
    pub fn int_b(&self, v: ValueId) -> Option<&PackedI8> {
        match self.0.get(&(v, Role::IntB))?.as_ref() {
            Packed::I8(p) => Some(p),
            _ => None,
        }
    }

    /// The packed 8-bit filter made from `v`.
    pub fn int_filter(&self, v: ValueId) -> Option<&PackedI8> {
        match self.0.get(&(v, Role::IntFilter))?.as_ref() {
            Packed::I8(p) => Some(p),
            _ => None,
        }
    }

    /// The packed A made from the filter `v`.
    pub fn a(&self, v: ValueId) -> Option<&PackedA> {
        match self.0.get(&(v, Role::ConvFilter))?.as_ref() {
            Packed::A(p) => Some(p),
            _ => None,
        }
    }

    /// The Winograd-transformed filter made from `v`.
    pub fn winograd(&self, v: ValueId) -> Option<&WinogradFilter> {
        match self.0.get(&(v, Role::Winograd))?.as_ref() {
            Packed::Winograd(p) => Some(p),
            _ => None,
        }
    }

    /// How many operands are packed.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Packs every constant operand of the graph's float32 products that the kernels can take
/// packed, in `precision` (bf16: rounded for the tile unit, so those products run in bf16);
/// returns how many. Inputs whose initializer the caller may override are left alone.
pub fn prepack(g: &mut Graph, precision: Precision, shapes: &Shapes) -> usize {
    let mut packed = HashMap::new();
    for n in &g.nodes {
        let std = n.domain.is_empty() || n.domain == "ai.onnx";
        let fused = n.domain == DOMAIN;
        let int_attr = |name: &str, default: i64| match n.attrs.get(name) {
            Some(Attr::Int(i)) => *i,
            _ => default,
        };
        let qconv = (std && n.op == "QLinearConv") || (fused && n.op == "NhwcQLinearConv");
        if qconv && int_attr("group", 1) == 1 {
            let filter = n.inputs.get(3).copied().flatten();
            if let Some(w) = filter.filter(|&w| constant(g, w).is_some()) {
                if let Ok(p) = crate::ops::conv::pack_int_filter(constant(g, w).unwrap()) {
                    packed
                        .entry((w, Role::IntFilter))
                        .or_insert_with(|| Arc::new(Packed::I8(p)));
                }
            }
            continue;
        }
        let Some(Some(w)) = n.inputs.get(1).copied() else {
            continue;
        };
        if (std && n.op == "MatMulInteger") || (fused && n.op == "MatMulIntegerToFloat") {
            if let Some(p) = constant(g, w).and_then(pack_int_b) {
                packed.entry((w, Role::IntB)).or_insert_with(|| Arc::new(p));
            }
            continue;
        }
        let Some(t) = constant(g, w).filter(|t| t.dtype() == DType::F32) else {
            continue;
        };
        let Ok(data) = t.as_slice::<f32>() else {
            continue;
        };
        let s = t.shape();
        let ones = |name: &str| match n.attrs.get(name) {
            Some(Attr::Ints(v)) => v.iter().all(|&x| x == 1),
            _ => true,
        };
        let conv3x3 = matches!(
            (n.op.as_str(), std, fused),
            ("Conv", true, _) | ("FusedConv", _, true)
        ) && precision == Precision::F32
            && s.len() == 4
            && s[2] == 3
            && s[3] == 3
            && s[0] >= 16
            && s[1] >= 16
            && int_attr("group", 1) == 1
            && ones("strides")
            && ones("dilations");
        // Where the output's size is known, only the kernel that will run gets its filter;
        // else both are packed and each run picks.
        let out = shapes
            .get(n.outputs.first().copied().flatten())
            .filter(|o| o.len() == 4);
        let winograd = conv3x3
            && out.is_none_or(|o| ferrum_kernels::winograd::worthwhile(s[1], s[0], o[2], o[3]));
        let direct = !(winograd && out.is_some());
        let made = match (n.op.as_str(), std, fused) {
            ("MatMul", true, _) | ("FusedMatMul", _, true) if s.len() == 2 => {
                let (k, nn) = (s[0], s[1]);
                (k > 0 && nn > 0).then(|| {
                    let p = PackedB::with_precision(k, nn, Mat::row_major(data, nn), precision);
                    (Role::B, Packed::B(p))
                })
            }
            ("Gemm", true, _) | ("FusedGemm", _, true) if s.len() == 2 => {
                let tb = int_attr("transB", 0) != 0;
                let (k, nn) = if tb { (s[1], s[0]) } else { (s[0], s[1]) };
                let (role, b) = if tb {
                    (Role::BTransposed, Mat::transposed(data, k))
                } else {
                    (Role::B, Mat::row_major(data, nn))
                };
                (k > 0 && nn > 0).then(|| {
                    (
                        role,
                        Packed::B(PackedB::with_precision(k, nn, b, precision)),
                    )
                })
            }
            // A channels-last 1x1 filter (`[1, 1, C, M]`): the B of `X[N*H*W, C] W`; also an
            // expansion in front of a depthwise convolution (input 1 of NhwcExpandDepthwise).
            ("NhwcConv" | "NhwcExpandDepthwise", _, true)
                if s.len() == 4
                    && s[0] == 1
                    && s[1] == 1
                    && (n.op == "NhwcExpandDepthwise" || int_attr("group", 1) == 1) =>
            {
                let (k, nn) = (s[2], s[3]);
                (k > 0 && nn > 0).then(|| {
                    let p = PackedB::with_precision(k, nn, Mat::row_major(data, nn), precision);
                    (Role::B, Packed::B(p))
                })
            }
            ("Conv", true, _) | ("FusedConv", _, true) if s.len() == 4 && direct => {
                let (m, kk) = (s[0], s[1] * s[2] * s[3]);
                // One group only (the filter is then the whole A). Where the output's size is
                // known, in the layout its product reads (B's panels for a short product).
                (int_attr("group", 1) == 1 && m > 0 && kk > 0).then(|| {
                    let a = Mat::row_major(data, kk);
                    let p = match out {
                        Some(o) => PackedA::for_columns(m, kk, a, precision, o[2] * o[3]),
                        None => PackedA::with_precision(m, kk, a, precision),
                    };
                    (Role::ConvFilter, Packed::A(p))
                })
            }
            _ => None,
        };
        if let Some((role, p)) = made {
            packed.entry((w, role)).or_insert_with(|| Arc::new(p));
        }
        if winograd {
            packed.entry((w, Role::Winograd)).or_insert_with(|| {
                Arc::new(Packed::Winograd(WinogradFilter::new(data, s[0], s[1])))
            });
        }
    }
    let n = packed.len();
    g.packed = PackedWeights(packed);
    n
}

/// A 2-D 8-bit constant packed as an integer product's B.
fn pack_int_b(t: &crate::tensor::Tensor) -> Option<Packed> {
    let s = t.shape();
    if s.len() != 2 || s[0] == 0 || s[1] == 0 {
        return None;
    }
    let (k, n) = (s[0], s[1]);
    let b = match t.dtype() {
        DType::I8 => Bytes::I8(t.as_slice::<i8>().ok()?),
        DType::U8 => Bytes::U8(t.as_slice::<u8>().ok()?),
        _ => return None,
    };
    Some(Packed::I8(PackedI8::new(k, n, b, n, 1)))
}
