//! ferrum's fused ops (domain `com.ferrum`), made by the graph passes ([`crate::passes`]):
//! `FusedConv`, `NhwcConv` (in [`crate::ops::nhwc`]), `FusedGemm`, `FusedMatMul`, `Gelu`, `MatMulIntegerToFloat` (in
//! [`crate::ops::quant`]) and `FusedAttention` (in [`crate::ops::attention`]).
//!
//! Each is its unfused chain computed at once: the product, then (Conv) a residual `Z` or
//! (MatMul) a bias along the last axis, then an activation. Activations give the bits their
//! reference op gives on a float32 value (the transcendental ones computed in f64 and rounded
//! once, as the reference kernels do), except GELU, which is computed in f32 as PyTorch's
//! exported chain `x * 0.5 * (1 + erf(x / sqrt 2))` is, with the float32 Erf kernel.

use ferrum_kernels::pool;

use crate::ops::elementwise::{broadcast_offsets, broadcast_shape};
use crate::ops::vecmath::{self, Unary};
use crate::ops::{
    one, per_input, per_output, same_shape, unsupported, Ctx, Inferred, Kernel, Rules,
};
use crate::tensor::{DType, Tensor};
use crate::{kbail, Result};

/// The activation applied to a fused product's output.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum Act {
    #[default]
    Identity,
    Relu,
    /// `min(max(x, lo), hi)`, NaN kept.
    Clip(f32, f32),
    LeakyRelu(f32),
    Sigmoid,
    /// `x * sigmoid(x)` (SiLU, swish).
    Silu,
    /// `clamp(alpha * x + beta, 0, 1)`.
    HardSigmoid(f32, f32),
    HardSwish,
    Tanh,
    /// GELU, erf form.
    Gelu,
    /// GELU, tanh approximation.
    GeluTanh,
}

impl Act {
    /// The activation named by a fused node's `activation` / `activation_params` attributes.
    pub fn from_node(cx: &Ctx) -> Result<Act> {
        match cx.parsed.and_then(|p| p.act) {
            Some(a) => Ok(a),
            None => Act::of(cx.node, "activation"),
        }
    }

    /// The activation named by a node's attributes `name` and `{name}_params` (as parsed when
    /// the node was resolved, else read now).
    pub fn from_attrs(cx: &Ctx, name: &str) -> Result<Act> {
        let parsed = cx.parsed.and_then(|p| match name {
            "activation" => p.act,
            "expand_activation" => p.expand_act,
            _ => None,
        });
        match parsed {
            Some(a) => Ok(a),
            None => Act::of(cx.node, name),
        }
    }

    /// The activation named by `node`'s attributes `name` and `{name}_params`.
    pub fn of(node: &crate::ir::Node, name: &str) -> Result<Act> {
        let p: Vec<f32> = match node.attrs.get(&format!("{name}_params")) {
            Some(crate::ir::Attr::Floats(v)) => v.clone(),
            _ => Vec::new(),
        };
        let p = |i: usize| -> Result<f32> {
            match p.get(i) {
                Some(v) => Ok(*v),
                None => kbail!("{name}_params has no value #{i}"),
            }
        };
        Ok(
            match crate::ops::attr_str(node, name, "Identity").as_str() {
                "Identity" => Act::Identity,
                "Relu" => Act::Relu,
                "Clip" => Act::Clip(p(0)?, p(1)?),
                "LeakyRelu" => Act::LeakyRelu(p(0)?),
                "Sigmoid" => Act::Sigmoid,
                "Silu" => Act::Silu,
                "HardSigmoid" => Act::HardSigmoid(p(0)?, p(1)?),
                "HardSwish" => Act::HardSwish,
                "Tanh" => Act::Tanh,
                "Gelu" => Act::Gelu,
                "GeluTanh" => Act::GeluTanh,
                other => return Err(unsupported(format!("activation '{other}'"))),
            },
        )
    }

    /// The activation of one value.
    #[inline]
    pub fn apply1(self, x: f32) -> f32 {
        match self {
            Act::Identity => x,
            Act::Relu => {
                if x > 0.0 {
                    x
                } else {
                    0.0
                }
            }
            Act::Clip(lo, hi) => {
                let y = if x < lo { lo } else { x };
                if y > hi {
                    hi
                } else {
                    y
                }
            }
            Act::LeakyRelu(a) => {
                if x >= 0.0 {
                    x
                } else {
                    a * x
                }
            }
            Act::Sigmoid => vecmath::unary_lane(Unary::Sigmoid, x),
            Act::Silu => vecmath::unary_lane(Unary::Silu, x),
            Act::HardSigmoid(a, b) => vecmath::unary_lane(Unary::HardSigmoid(a, b), x),
            Act::HardSwish => vecmath::unary_lane(Unary::HardSwish, x),
            Act::Tanh => (x as f64).tanh() as f32,
            Act::Gelu => {
                let mut v = [x];
                vecmath::unary_inplace(Unary::Gelu, &mut v);
                v[0]
            }
            Act::GeluTanh => {
                let v = x as f64;
                let c = (2.0 / std::f64::consts::PI).sqrt();
                (0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh())) as f32
            }
        }
    }

    /// The vector kernels' form of this activation, for those they apply as they store.
    pub fn lane_op(self) -> Option<Unary> {
        match self {
            Act::Relu => Some(Unary::Relu),
            Act::Clip(lo, hi) => Some(Unary::Clip(lo, hi)),
            Act::LeakyRelu(a) => Some(Unary::LeakyRelu(a)),
            Act::Gelu => Some(Unary::Gelu),
            Act::Sigmoid => Some(Unary::Sigmoid),
            Act::Silu => Some(Unary::Silu),
            Act::HardSigmoid(a, b) => Some(Unary::HardSigmoid(a, b)),
            Act::HardSwish => Some(Unary::HardSwish),
            _ => None,
        }
    }

    /// Applies the activation to every value, in place, over the pool's threads when large.
    /// Each activation gets its own loop (the compiler vectorises the simple ones).
    pub fn apply(self, v: &mut [f32]) {
        if self == Act::Identity {
            return;
        }
        let simd = self.lane_op();
        let per = (v.len().div_ceil(pool::threads() * 4)).max(16 * 1024);
        let go = move |c: &mut [f32]| match simd {
            Some(op) => vecmath::unary_inplace(op, c),
            None => c.iter_mut().for_each(|x| *x = self.apply1(*x)),
        };
        if v.len() <= per {
            go(v);
        } else {
            pool::parallel_chunks_mut(v, per, |_, c| go(c));
        }
    }
}

/// What follows a product: a residual added (broadcast), then the activation.
#[derive(Clone, Copy, Debug, Default)]
pub struct Epi<'a> {
    pub z: Option<&'a Tensor>,
    pub act: Act,
}

impl Epi<'_> {
    /// True when nothing follows.
    pub fn is_identity(&self) -> bool {
        self.z.is_none() && self.act == Act::Identity
    }

    /// The residual as a slice, when it has exactly `shape` (so it can be added in place).
    pub fn z_exact(&self, shape: &[usize]) -> Option<&[f32]> {
        let z = self.z?;
        (z.dtype() == DType::F32 && z.shape() == shape)
            .then(|| z.as_slice::<f32>().ok())
            .flatten()
    }

    /// `act(y + z)` for a computed float32 product `y` (numpy broadcasting for `z`).
    pub fn finish(&self, y: Tensor) -> Result<Tensor> {
        if self.is_identity() {
            return Ok(y);
        }
        if y.dtype() != DType::F32 {
            return Err(unsupported(format!(
                "fused epilogue on {} (float32 only)",
                y.dtype()
            )));
        }
        let shape = y.shape().to_vec();
        let mut y = match (self.z, self.z_exact(&shape)) {
            (None, _) => y,
            (Some(_), Some(z)) => {
                let mut v = into_f32(y)?;
                v.iter_mut().zip(z).for_each(|(a, b)| *a += b);
                Tensor::from_vec(shape, v)?
            }
            (Some(z), None) => add_broadcast(&y, z)?,
        };
        let shape = y.shape().to_vec();
        let mut v = into_f32(std::mem::replace(&mut y, Tensor::scalar(0f32)))?;
        self.act.apply(&mut v);
        Tensor::from_vec(shape, v)
    }
}

pub(crate) fn into_f32(t: Tensor) -> Result<Vec<f32>> {
    match t.into_data() {
        crate::tensor::Data::F32(s) => Ok(s.into_vec()),
        other => kbail!("expected float32, got {}", other.dtype()),
    }
}

/// `a + b` with numpy broadcasting (float32).
fn add_broadcast(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if b.dtype() != DType::F32 {
        kbail!("the residual must be float32, got {}", b.dtype());
    }
    let out = broadcast_shape(a.shape(), b.shape())?;
    let offs = broadcast_offsets(&[a.shape(), b.shape()], &out);
    let (av, bv) = (a.as_slice::<f32>()?, b.as_slice::<f32>()?);
    let v = offs[0]
        .iter()
        .zip(&offs[1])
        .map(|(&i, &j)| av[i] + bv[j])
        .collect();
    Tensor::from_vec(out, v)
}

/// For the `com.ferrum` ops that can write their output into an input's memory: that input and
/// the kernel that takes it.
pub fn reuse(op: &str) -> Option<crate::ops::Reuse> {
    match op {
        // The residual, Z.
        "FusedConv" => Some(crate::ops::Reuse {
            at: &[3],
            kernel: |cx, _, z| {
                let act = Act::from_node(cx)?;
                one(crate::ops::conv::conv_fused_into(cx, z, act)?)
            },
        }),
        // The residual, input 3, when a GEMM form computes the output.
        "NhwcConv" => Some(crate::ops::Reuse {
            at: &[3],
            kernel: |cx, _, z| one(crate::ops::nhwc::conv_into(cx, Act::from_node(cx)?, z)?),
        }),
        // The input, on the float32 path.
        "Silu" => Some(crate::ops::Reuse {
            at: &[0],
            kernel: |cx, at, slot| {
                if let Some(t) = slot.take() {
                    match crate::ops::fast::unary_into(t, Unary::Silu)? {
                        Ok(out) => return one(out),
                        Err(t) => *slot = Some(t),
                    }
                }
                crate::ops::with_slot(cx, at, slot, kernel("Silu").expect("the Silu kernel"))
            },
        }),
        _ => None,
    }
}

/// The static rules of the `com.ferrum` ops: a fused op's are those of the op it extends.
pub fn rules(op: &str) -> Option<Rules> {
    use crate::ops::{conv, nhwc, nn};
    Some(match op {
        "FusedConv" => conv::CONV_RULES,
        "FusedGemm" => nn::GEMM_RULES,
        "FusedMatMul" => nn::MATMUL_RULES,
        "FusedAttention" => crate::ops::attention::FUSED_RULES,
        "NhwcConv" | "NhwcExpandDepthwise" | "NhwcQLinearConv" => {
            Rules::with(nhwc::window_rule, nhwc::conv_flops)
        }
        "NhwcMaxPool" => Rules::shape(nhwc::window_rule),
        "ConvMaxPool" => Rules::with(
            crate::ops::conv_pool::shape_rule,
            crate::ops::conv_pool::flops,
        ),
        "NhwcGlobalAveragePool" => Rules::with(
            |k| {
                let &[b, _, _, c] = k.dims(0)? else {
                    return None;
                };
                Some(Inferred::dims(vec![b, c, 1, 1]))
            },
            per_input,
        ),
        // Y = X + Z rescaled: A (input 0) and B (input 3) broadcast.
        "QLinearAdd" => Rules::shape(|k| {
            Some(Inferred::dims(
                broadcast_shape(k.dims(0)?, k.dims(3)?).ok()?,
            ))
        }),
        "Gelu" | "Silu" => Rules::with(same_shape, per_output),
        _ => return None,
    })
}

/// The kernel of a `com.ferrum` op.
pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "FusedConv" => |cx| {
            let act = Act::from_node(cx)?;
            one(crate::ops::conv::conv_fused(cx, Epi { z: cx.opt(3), act })?)
        },
        "NhwcConv" => |cx| one(crate::ops::nhwc::conv(cx, Act::from_node(cx)?)?),
        "ConvMaxPool" => |cx| {
            one(crate::ops::conv_pool::conv_max_pool(
                cx,
                Act::from_node(cx)?,
            )?)
        },
        "NhwcExpandDepthwise" => {
            |cx| one(crate::ops::nhwc::expand_depthwise(cx, Act::from_node(cx)?)?)
        }
        "FusedGemm" => |cx| one(crate::ops::nn::gemm_act(cx, Act::from_node(cx)?)?),
        "FusedMatMul" => |cx| {
            let act = Act::from_node(cx)?;
            let (a, b) = (cx.t(0)?, cx.t(1)?);
            if a.dtype() != DType::F32 || b.dtype() != DType::F32 {
                return Err(unsupported("FusedMatMul on non-float32 inputs"));
            }
            let pb = cx.packed_b(1, crate::passes::Role::B);
            one(crate::ops::linear::matmul_bias_act(
                a,
                b,
                cx.opt(2),
                Epi { z: cx.opt(3), act },
                pb,
            )?)
        },
        "MatMulIntegerToFloat" => |cx| {
            let act = Act::from_node(cx)?;
            one(Epi { z: None, act }.finish(crate::ops::quant::matmul_integer_to_float(cx)?)?)
        },
        "QLinearAdd" => |cx| one(crate::ops::quant::qlinear_add(cx)?),
        "NhwcQLinearConv" => |cx| one(crate::ops::conv::nhwc_qlinear_conv(cx)?),
        "NhwcMaxPool" => |cx| one(crate::ops::conv::nhwc_max_pool(cx)?),
        "NhwcGlobalAveragePool" => |cx| {
            // Channels-last `[N, H, W, C]` in, GlobalAveragePool's `[N, C, 1, 1]` out (the
            // same bytes as `[N, 1, 1, C]`).
            let x = cx.t(0)?;
            let &[n, h, w, c] = x.shape() else {
                kbail!(
                    "NhwcGlobalAveragePool expects [N, H, W, C], got {:?}",
                    x.shape()
                );
            };
            if x.dtype() != DType::F32 {
                return Err(unsupported("NhwcGlobalAveragePool on non-float32 input"));
            }
            if h * w == 0 || c == 0 {
                kbail!("NhwcGlobalAveragePool of an empty image {:?}", x.shape());
            }
            let v = crate::ops::fast::global_avg_pool_nhwc_f32(x.as_slice::<f32>()?, h * w, c);
            one(Tensor::from_vec(vec![n, c, 1, 1], v)?)
        },
        "FusedAttention" => |cx| one(crate::ops::attention::fused_attention(cx)?),
        "Gelu" => |cx| {
            let x = cx.t(0)?;
            if x.dtype() != DType::F32 {
                return Err(unsupported("com.ferrum Gelu on non-float32 input"));
            }
            let mut v = x.as_slice::<f32>()?.to_vec();
            Act::Gelu.apply(&mut v);
            one(Tensor::from_vec(x.shape().to_vec(), v)?)
        },
        "Silu" => |cx| match crate::ops::fast::unary(cx, Unary::Silu)? {
            Some(t) => one(t),
            None => Err(unsupported(format!(
                "com.ferrum Silu on {} (float32 only)",
                cx.t(0)?.dtype()
            ))),
        },
        _ => return None,
    };
    Some(k)
}
