//! A dynamic tensor: an element type, a shape and contiguous row-major storage.

use std::fmt;

use half::{bf16, f16};

use crate::{kbail, Error, Result};

/// Element types, numbered as ONNX's `TensorProto.DataType`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    U8,
    I8,
    U16,
    I16,
    I32,
    I64,
    Str,
    Bool,
    F16,
    F64,
    U32,
    U64,
    BF16,
    F8E4M3FN,
    F8E4M3FNUZ,
    F8E5M2,
    F8E5M2FNUZ,
    U4,
    I4,
    F4E2M1,
    F8E8M0,
    U2,
    I2,
    F6E2M3,
    F6E3M2,
}

impl DType {
    /// From ONNX's enum value; `None` for types ferrum cannot hold.
    pub fn from_onnx(code: i32) -> Option<DType> {
        Some(match code {
            1 => DType::F32,
            2 => DType::U8,
            3 => DType::I8,
            4 => DType::U16,
            5 => DType::I16,
            6 => DType::I32,
            7 => DType::I64,
            8 => DType::Str,
            9 => DType::Bool,
            10 => DType::F16,
            11 => DType::F64,
            12 => DType::U32,
            13 => DType::U64,
            16 => DType::BF16,
            17 => DType::F8E4M3FN,
            18 => DType::F8E4M3FNUZ,
            19 => DType::F8E5M2,
            20 => DType::F8E5M2FNUZ,
            21 => DType::U4,
            22 => DType::I4,
            23 => DType::F4E2M1,
            24 => DType::F8E8M0,
            25 => DType::U2,
            26 => DType::I2,
            27 => DType::F6E2M3,
            28 => DType::F6E3M2,
            _ => return None,
        })
    }

    pub fn onnx(self) -> i32 {
        match self {
            DType::F32 => 1,
            DType::U8 => 2,
            DType::I8 => 3,
            DType::U16 => 4,
            DType::I16 => 5,
            DType::I32 => 6,
            DType::I64 => 7,
            DType::Str => 8,
            DType::Bool => 9,
            DType::F16 => 10,
            DType::F64 => 11,
            DType::U32 => 12,
            DType::U64 => 13,
            DType::BF16 => 16,
            DType::F8E4M3FN => 17,
            DType::F8E4M3FNUZ => 18,
            DType::F8E5M2 => 19,
            DType::F8E5M2FNUZ => 20,
            DType::U4 => 21,
            DType::I4 => 22,
            DType::F4E2M1 => 23,
            DType::F8E8M0 => 24,
            DType::U2 => 25,
            DType::I2 => 26,
            DType::F6E2M3 => 27,
            DType::F6E3M2 => 28,
        }
    }

    /// ONNX's name for any data type code, supported or not (for error messages).
    pub fn onnx_name(code: i32) -> String {
        const NAMES: [&str; 29] = [
            "UNDEFINED",
            "FLOAT",
            "UINT8",
            "INT8",
            "UINT16",
            "INT16",
            "INT32",
            "INT64",
            "STRING",
            "BOOL",
            "FLOAT16",
            "DOUBLE",
            "UINT32",
            "UINT64",
            "COMPLEX64",
            "COMPLEX128",
            "BFLOAT16",
            "FLOAT8E4M3FN",
            "FLOAT8E4M3FNUZ",
            "FLOAT8E5M2",
            "FLOAT8E5M2FNUZ",
            "UINT4",
            "INT4",
            "FLOAT4E2M1",
            "FLOAT8E8M0",
            "UINT2",
            "INT2",
            "FLOAT6E2M3",
            "FLOAT6E3M2",
        ];
        NAMES
            .get(code as usize)
            .map(|s| s.to_string())
            .unwrap_or_else(|| format!("data type {code}"))
    }

    /// Bytes per element in memory (strings: 0, they have no fixed width; sub-byte formats
    /// hold one code per byte in memory and are packed in files, see [`crate::small`]).
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 | DType::Bool => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::Str => 0,
            _ => 1,
        }
    }

    /// The storage-only formats of [`crate::small`] (float8, float4, float6, int4, int2).
    pub fn is_small(self) -> bool {
        self.onnx() >= 17
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    pub fn is_int(self) -> bool {
        matches!(
            self,
            DType::U8
                | DType::I8
                | DType::U16
                | DType::I16
                | DType::I32
                | DType::I64
                | DType::U32
                | DType::U64
        )
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&DType::onnx_name(self.onnx()))
    }
}

/// A tensor's elements: owned, or shared with memory another owner keeps (a NumPy array handed
/// to a session is read in place). Reading derefs to a slice either way; writing (`DerefMut`,
/// [`Store::into_vec`]) first copies shared elements into an owned vector (copy on write), so
/// the owner's memory is never written.
pub struct Store<T: 'static>(Repr<T>);

/// Memory a [`Store`] reads without owning it: whatever keeps the elements alive.
pub type SharedElems<T> = std::sync::Arc<dyn AsRef<[T]> + Send + Sync + std::panic::RefUnwindSafe>;

enum Repr<T: 'static> {
    Owned(Vec<T>),
    Shared(SharedElems<T>),
}

impl<T: Clone> Store<T> {
    /// Elements read from `owner` without a copy. `owner.as_ref()` must return the same
    /// elements for as long as the store (or a clone of it) lives.
    pub fn shared(owner: SharedElems<T>) -> Self {
        Store(Repr::Shared(owner))
    }

    /// Whether the elements are another owner's memory (not yet copied).
    pub fn is_shared(&self) -> bool {
        matches!(self.0, Repr::Shared(_))
    }

    /// The elements as an owned vector (shared elements are copied).
    pub fn into_vec(self) -> Vec<T> {
        match self.0 {
            Repr::Owned(v) => v,
            Repr::Shared(o) => (*o).as_ref().to_vec(),
        }
    }

    /// The owned vector, `None` for shared elements (another owner's memory).
    pub fn into_owned(self) -> Option<Vec<T>> {
        match self.0 {
            Repr::Owned(v) => Some(v),
            Repr::Shared(_) => None,
        }
    }

    /// The owned vector, copying shared elements into one first.
    pub fn make_mut(&mut self) -> &mut Vec<T> {
        if let Repr::Shared(o) = &self.0 {
            self.0 = Repr::Owned((**o).as_ref().to_vec());
        }
        match &mut self.0 {
            Repr::Owned(v) => v,
            Repr::Shared(_) => unreachable!("made owned above"),
        }
    }
}

impl<T> std::ops::Deref for Store<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.0 {
            Repr::Owned(v) => v,
            Repr::Shared(o) => (**o).as_ref(),
        }
    }
}

impl<T: Clone> std::ops::DerefMut for Store<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.make_mut()
    }
}

impl<T: Clone> Clone for Store<T> {
    /// Owned elements are copied; shared ones stay shared (no copy).
    fn clone(&self) -> Self {
        match &self.0 {
            Repr::Owned(v) => Store(Repr::Owned(v.clone())),
            Repr::Shared(o) => Store(Repr::Shared(std::sync::Arc::clone(o))),
        }
    }
}

impl<T: PartialEq> PartialEq for Store<T> {
    fn eq(&self, o: &Self) -> bool {
        **self == **o
    }
}

impl<T: fmt::Debug> fmt::Debug for Store<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        (**self).fmt(f)
    }
}

impl<T> Default for Store<T> {
    fn default() -> Self {
        Store(Repr::Owned(Vec::new()))
    }
}

impl<T> From<Vec<T>> for Store<T> {
    fn from(v: Vec<T>) -> Self {
        Store(Repr::Owned(v))
    }
}

impl<T: Clone> FromIterator<T> for Store<T> {
    fn from_iter<I: IntoIterator<Item = T>>(it: I) -> Self {
        Store(Repr::Owned(it.into_iter().collect()))
    }
}

impl<T: Clone> IntoIterator for Store<T> {
    type Item = T;
    type IntoIter = std::vec::IntoIter<T>;
    fn into_iter(self) -> Self::IntoIter {
        self.into_vec().into_iter()
    }
}

impl<'a, T> IntoIterator for &'a Store<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// The storage of a tensor, one variant per element type.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F32(Store<f32>),
    F64(Store<f64>),
    F16(Store<f16>),
    BF16(Store<bf16>),
    I8(Store<i8>),
    I16(Store<i16>),
    I32(Store<i32>),
    I64(Store<i64>),
    U8(Store<u8>),
    U16(Store<u16>),
    U32(Store<u32>),
    U64(Store<u64>),
    Bool(Store<bool>),
    Str(Vec<String>),
    /// A storage-only format: one code per element (see [`crate::small`]).
    Code(DType, Vec<u8>),
}

/// An element type a [`Data`] can hold. Kernels are written once over `T: Elem` and dispatched
/// by [`crate::dispatch!`].
pub trait Elem: Clone + Default + fmt::Debug + PartialEq + Send + Sync + 'static {
    const DT: DType;
    fn slice(d: &Data) -> Option<&[Self]>;
    fn into_data(v: Vec<Self>) -> Data;
    /// An empty vector with room for `n`, for a kernel's output: from the running session's
    /// pools ([`crate::arena`]; strings are allocated).
    fn room(n: usize) -> Vec<Self> {
        Vec::with_capacity(n)
    }
}

/// Numeric element types (everything but strings): conversions and the arithmetic of ONNX.
pub trait Num: Elem + Copy + PartialOrd {
    const IS_FLOAT: bool;
    fn to_f64(self) -> f64;
    /// Float to this type: floats round to nearest, integers truncate toward zero (saturating).
    fn from_f64(v: f64) -> Self;
    /// Integer value (floats truncate); wide enough for every integer type.
    fn to_i128(self) -> i128;
    /// Integer to this type: integers keep the low bits (two's complement), floats round.
    fn from_i128(v: i128) -> Self;
    fn zero() -> Self;
    fn one() -> Self;
    /// The lowest and highest values (floats: -inf, +inf).
    fn lowest() -> Self;
    fn highest() -> Self;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    /// Integer division truncates toward zero; division by zero is an error for integers.
    fn div(self, o: Self) -> Result<Self>;
    fn is_nan(self) -> bool {
        false
    }
}

macro_rules! elem_impl {
    ($t:ty, $dt:ident $(, $room:path)?) => {
        impl Elem for $t {
            const DT: DType = DType::$dt;
            fn slice(d: &Data) -> Option<&[Self]> {
                match d {
                    Data::$dt(v) => Some(v),
                    _ => None,
                }
            }
            fn into_data(v: Vec<Self>) -> Data {
                Data::$dt(v.into())
            }
            $(
                fn room(n: usize) -> Vec<Self> {
                    $room(n)
                }
            )?
        }
    };
}

elem_impl!(f32, F32, crate::arena::take);
elem_impl!(f64, F64, crate::arena::take);
elem_impl!(f16, F16, crate::arena::take);
elem_impl!(bf16, BF16, crate::arena::take);
elem_impl!(i8, I8, crate::arena::take);
elem_impl!(i16, I16, crate::arena::take);
elem_impl!(i32, I32, crate::arena::take);
elem_impl!(i64, I64, crate::arena::take);
elem_impl!(u8, U8, crate::arena::take);
elem_impl!(u16, U16, crate::arena::take);
elem_impl!(u32, U32, crate::arena::take);
elem_impl!(u64, U64, crate::arena::take);
elem_impl!(bool, Bool, crate::arena::take);
elem_impl!(String, Str);

macro_rules! int_impl {
    ($t:ty) => {
        impl Num for $t {
            const IS_FLOAT: bool = false;
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn to_i128(self) -> i128 {
                self as i128
            }
            fn from_i128(v: i128) -> Self {
                v as $t
            }
            fn zero() -> Self {
                0
            }
            fn one() -> Self {
                1
            }
            fn lowest() -> Self {
                <$t>::MIN
            }
            fn highest() -> Self {
                <$t>::MAX
            }
            fn add(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            fn sub(self, o: Self) -> Self {
                self.wrapping_sub(o)
            }
            fn mul(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            fn div(self, o: Self) -> Result<Self> {
                if o == 0 {
                    kbail!("integer division by zero");
                }
                Ok(self.wrapping_div(o))
            }
        }
    };
}

int_impl!(i8);
int_impl!(i16);
int_impl!(i32);
int_impl!(i64);
int_impl!(u8);
int_impl!(u16);
int_impl!(u32);
int_impl!(u64);

impl Num for bool {
    const IS_FLOAT: bool = false;
    fn to_f64(self) -> f64 {
        self as u8 as f64
    }
    fn from_f64(v: f64) -> Self {
        v != 0.0
    }
    fn to_i128(self) -> i128 {
        self as i128
    }
    fn from_i128(v: i128) -> Self {
        v != 0
    }
    fn zero() -> Self {
        false
    }
    fn one() -> Self {
        true
    }
    fn lowest() -> Self {
        false
    }
    fn highest() -> Self {
        true
    }
    fn add(self, o: Self) -> Self {
        self | o
    }
    fn sub(self, o: Self) -> Self {
        self ^ o
    }
    fn mul(self, o: Self) -> Self {
        self & o
    }
    fn div(self, o: Self) -> Result<Self> {
        Ok(self & o)
    }
}

macro_rules! float_impl {
    ($t:ty, $from:expr, $to:expr) => {
        impl Num for $t {
            const IS_FLOAT: bool = true;
            fn to_f64(self) -> f64 {
                #[allow(clippy::redundant_closure_call)]
                ($to)(self)
            }
            fn from_f64(v: f64) -> Self {
                #[allow(clippy::redundant_closure_call)]
                ($from)(v)
            }
            fn to_i128(self) -> i128 {
                self.to_f64() as i128
            }
            fn from_i128(v: i128) -> Self {
                Self::from_f64(v as f64)
            }
            fn zero() -> Self {
                Self::from_f64(0.0)
            }
            fn one() -> Self {
                Self::from_f64(1.0)
            }
            fn lowest() -> Self {
                Self::from_f64(f64::NEG_INFINITY)
            }
            fn highest() -> Self {
                Self::from_f64(f64::INFINITY)
            }
            fn add(self, o: Self) -> Self {
                Self::from_f64(self.to_f64() + o.to_f64())
            }
            fn sub(self, o: Self) -> Self {
                Self::from_f64(self.to_f64() - o.to_f64())
            }
            fn mul(self, o: Self) -> Self {
                Self::from_f64(self.to_f64() * o.to_f64())
            }
            fn div(self, o: Self) -> Result<Self> {
                Ok(Self::from_f64(self.to_f64() / o.to_f64()))
            }
            fn is_nan(self) -> bool {
                self.to_f64().is_nan()
            }
        }
    };
}

float_impl!(f32, |v: f64| v as f32, |x: f32| x as f64);
float_impl!(f64, |v: f64| v, |x: f64| x);
float_impl!(f16, f16::from_f64, |x: f16| x.to_f64());
float_impl!(bf16, bf16::from_f64, |x: bf16| x.to_f64());

/// Calls a generic function with the Rust type of a [`DType`]:
/// `dispatch!(dt, all, f, args..)` for every type, `num` for all but strings,
/// `float` for float types, `int` for integer types.
#[macro_export]
macro_rules! dispatch {
    ($dt:expr, all, $f:ident, $($a:expr),*) => {
        match $dt {
            $crate::DType::Str => $f::<String>($($a),*),
            $crate::DType::Bool => $f::<bool>($($a),*),
            _ => $crate::dispatch!($dt, num_nobool, $f, $($a),*),
        }
    };
    ($dt:expr, num, $f:ident, $($a:expr),*) => {
        match $dt {
            $crate::DType::Bool => $f::<bool>($($a),*),
            _ => $crate::dispatch!($dt, num_nobool, $f, $($a),*),
        }
    };
    ($dt:expr, num_nobool, $f:ident, $($a:expr),*) => {
        match $dt {
            $crate::DType::F32 => $f::<f32>($($a),*),
            $crate::DType::F64 => $f::<f64>($($a),*),
            $crate::DType::F16 => $f::<half::f16>($($a),*),
            $crate::DType::BF16 => $f::<half::bf16>($($a),*),
            $crate::DType::I8 => $f::<i8>($($a),*),
            $crate::DType::I16 => $f::<i16>($($a),*),
            $crate::DType::I32 => $f::<i32>($($a),*),
            $crate::DType::I64 => $f::<i64>($($a),*),
            $crate::DType::U8 => $f::<u8>($($a),*),
            $crate::DType::U16 => $f::<u16>($($a),*),
            $crate::DType::U32 => $f::<u32>($($a),*),
            $crate::DType::U64 => $f::<u64>($($a),*),
            dt => return Err($crate::Error::UnsupportedType(dt.to_string())),
        }
    };
    ($dt:expr, float, $f:ident, $($a:expr),*) => {
        match $dt {
            $crate::DType::F32 => $f::<f32>($($a),*),
            $crate::DType::F64 => $f::<f64>($($a),*),
            $crate::DType::F16 => $f::<half::f16>($($a),*),
            $crate::DType::BF16 => $f::<half::bf16>($($a),*),
            dt => return Err($crate::Error::UnsupportedType(dt.to_string())),
        }
    };
    ($dt:expr, int, $f:ident, $($a:expr),*) => {
        match $dt {
            $crate::DType::I8 => $f::<i8>($($a),*),
            $crate::DType::I16 => $f::<i16>($($a),*),
            $crate::DType::I32 => $f::<i32>($($a),*),
            $crate::DType::I64 => $f::<i64>($($a),*),
            $crate::DType::U8 => $f::<u8>($($a),*),
            $crate::DType::U16 => $f::<u16>($($a),*),
            $crate::DType::U32 => $f::<u32>($($a),*),
            $crate::DType::U64 => $f::<u64>($($a),*),
            dt => return Err($crate::Error::UnsupportedType(dt.to_string())),
        }
    };
}

impl Data {
    pub fn dtype(&self) -> DType {
        match self {
            Data::F32(_) => DType::F32,
            Data::F64(_) => DType::F64,
            Data::F16(_) => DType::F16,
            Data::BF16(_) => DType::BF16,
            Data::I8(_) => DType::I8,
            Data::I16(_) => DType::I16,
            Data::I32(_) => DType::I32,
            Data::I64(_) => DType::I64,
            Data::U8(_) => DType::U8,
            Data::U16(_) => DType::U16,
            Data::U32(_) => DType::U32,
            Data::U64(_) => DType::U64,
            Data::Bool(_) => DType::Bool,
            Data::Str(_) => DType::Str,
            Data::Code(dt, _) => *dt,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::F64(v) => v.len(),
            Data::F16(v) => v.len(),
            Data::BF16(v) => v.len(),
            Data::I8(v) => v.len(),
            Data::I16(v) => v.len(),
            Data::I32(v) => v.len(),
            Data::I64(v) => v.len(),
            Data::U8(v) => v.len(),
            Data::U16(v) => v.len(),
            Data::U32(v) => v.len(),
            Data::U64(v) => v.len(),
            Data::Bool(v) => v.len(),
            Data::Str(v) => v.len(),
            Data::Code(_, v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when the elements are read from memory the value does not own (a model file's
    /// bytes, shared with the session): taking them means copying them.
    pub fn is_shared(&self) -> bool {
        match self {
            Data::F32(v) => v.is_shared(),
            Data::F64(v) => v.is_shared(),
            Data::F16(v) => v.is_shared(),
            Data::BF16(v) => v.is_shared(),
            Data::I8(v) => v.is_shared(),
            Data::I16(v) => v.is_shared(),
            Data::I32(v) => v.is_shared(),
            Data::I64(v) => v.is_shared(),
            Data::U8(v) => v.is_shared(),
            Data::U16(v) => v.is_shared(),
            Data::U32(v) => v.is_shared(),
            Data::U64(v) => v.is_shared(),
            Data::Bool(v) => v.is_shared(),
            Data::Str(_) | Data::Code(..) => false,
        }
    }
}

/// A tensor: element type, shape (row-major) and its elements.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    data: Data,
}

/// Elements of a shape, `None` on overflow.
pub fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

impl Tensor {
    /// A tensor from its shape and elements; fails when the element count does not match.
    pub fn new(shape: Vec<usize>, data: Data) -> Result<Tensor> {
        let n = numel(&shape).ok_or_else(|| Error::Kernel(format!("shape {shape:?} overflows")))?;
        if n != data.len() {
            kbail!(
                "shape {shape:?} holds {n} elements but {} were given",
                data.len()
            );
        }
        Ok(Tensor { shape, data })
    }

    pub fn from_vec<T: Elem>(shape: Vec<usize>, v: Vec<T>) -> Result<Tensor> {
        Tensor::new(shape, T::into_data(v))
    }

    pub fn scalar<T: Elem>(v: T) -> Tensor {
        Tensor {
            shape: vec![],
            data: T::into_data(vec![v]),
        }
    }

    /// A tensor of `shape` filled with the default (zero) value of `dtype`.
    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Result<Tensor> {
        fn z<T: Elem>(n: usize) -> Result<Data> {
            Ok(T::into_data(vec![T::default(); n]))
        }
        let n = numel(&shape).ok_or_else(|| Error::Kernel(format!("shape {shape:?} overflows")))?;
        let data = dispatch!(dtype, all, z, n)?;
        Ok(Tensor { shape, data })
    }

    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    pub fn len(&self) -> usize {
        self.data.len()
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    pub fn data(&self) -> &Data {
        &self.data
    }
    pub fn into_data(self) -> Data {
        self.data
    }

    /// The same elements under another shape of equal element count.
    pub fn reshape(self, shape: Vec<usize>) -> Result<Tensor> {
        Tensor::new(shape, self.data)
    }

    /// The elements as `&[T]`; an error when the tensor holds another type.
    pub fn as_slice<T: Elem>(&self) -> Result<&[T]> {
        T::slice(&self.data).ok_or_else(|| {
            Error::Kernel(format!("expected a {} tensor, got {}", T::DT, self.dtype()))
        })
    }

    /// Integer tensor contents as i64 (for shapes, axes, indices).
    pub fn to_i64_vec(&self) -> Result<Vec<i64>> {
        fn conv<T: Num>(t: &Tensor) -> Result<Vec<i64>> {
            Ok(t.as_slice::<T>()?
                .iter()
                .map(|x| x.to_i128() as i64)
                .collect())
        }
        if let Data::Code(dt, v) = &self.data {
            return Ok(v
                .iter()
                .map(|&c| crate::small::decode(*dt, c) as i64)
                .collect());
        }
        match self.dtype() {
            DType::Str | DType::Bool => kbail!("expected an integer tensor, got {}", self.dtype()),
            dt => dispatch!(dt, num_nobool, conv, self),
        }
    }

    /// Numeric contents as f64.
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        fn conv<T: Num>(t: &Tensor) -> Result<Vec<f64>> {
            Ok(t.as_slice::<T>()?.iter().map(|x| x.to_f64()).collect())
        }
        if let Data::Code(dt, v) = &self.data {
            return Ok(v.iter().map(|&c| crate::small::decode(*dt, c)).collect());
        }
        dispatch!(self.dtype(), num, conv, self)
    }

    /// The single element of a one-element tensor, as f64.
    pub fn scalar_f64(&self) -> Result<f64> {
        let v = self.to_f64_vec()?;
        if v.len() != 1 {
            kbail!("expected one element, got shape {:?}", self.shape);
        }
        Ok(v[0])
    }

    pub fn scalar_i64(&self) -> Result<i64> {
        let v = self.to_i64_vec()?;
        if v.len() != 1 {
            kbail!("expected one element, got shape {:?}", self.shape);
        }
        Ok(v[0])
    }
}

/// A graph value: a tensor, a sequence of tensors, or an optional value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Tensor(Tensor),
    Sequence(Vec<Tensor>),
    /// An optional: `None` when empty.
    Optional(Option<Box<Value>>),
}

impl Value {
    pub fn tensor(&self) -> Result<&Tensor> {
        match self {
            Value::Tensor(t) => Ok(t),
            Value::Optional(Some(v)) => v.tensor(),
            _ => kbail!("expected a tensor, got a sequence or an empty optional"),
        }
    }
    pub fn into_tensor(self) -> Result<Tensor> {
        match self {
            Value::Tensor(t) => Ok(t),
            Value::Optional(Some(v)) => v.into_tensor(),
            _ => kbail!("expected a tensor, got a sequence or an empty optional"),
        }
    }
}

impl From<Tensor> for Value {
    fn from(t: Tensor) -> Value {
        Value::Tensor(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Memory a store borrows.
    struct Outside(Vec<f32>);
    impl AsRef<[f32]> for Outside {
        fn as_ref(&self) -> &[f32] {
            &self.0
        }
    }

    #[test]
    fn shared_store_reads_in_place_and_copies_on_write() {
        let owner = Arc::new(Outside(vec![1.0, -2.0, 3.0]));
        let mut s = Store::<f32>::shared(owner.clone());
        assert!(s.is_shared());
        assert_eq!(s.as_ptr(), owner.0.as_ptr(), "read in place");
        // A clone shares the memory too.
        let c = s.clone();
        assert!(c.is_shared() && c.as_ptr() == owner.0.as_ptr());
        // Writing copies first: the owner's memory is never written.
        s[1] = 5.0;
        assert!(!s.is_shared());
        assert_eq!(&*s, &[1.0, 5.0, 3.0]);
        assert_eq!(owner.0, vec![1.0, -2.0, 3.0]);
        assert_eq!(&*c, &[1.0, -2.0, 3.0]);
        // into_vec copies shared elements; owned ones are handed over.
        assert_eq!(c.into_vec(), vec![1.0, -2.0, 3.0]);
        let v = vec![7.0f32; 4];
        let p = v.as_ptr();
        let back = Store::from(v).into_vec();
        assert_eq!(back.as_ptr(), p);
        // A tensor over shared storage behaves as any other.
        let t = Tensor::new(vec![3], Data::F32(Store::shared(owner.clone()))).unwrap();
        assert_eq!(t.as_slice::<f32>().unwrap(), &[1.0, -2.0, 3.0]);
        assert_eq!(
            t,
            Tensor::new(vec![3], Data::F32(vec![1.0, -2.0, 3.0].into())).unwrap()
        );
    }
}
