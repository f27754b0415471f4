//! NumPy arrays to ferrum values and back.
//!
//! Inputs: a C-contiguous, aligned array of a native numeric dtype is read in place, without a
//! copy: the tensor's storage borrows the array's buffer (and holds a reference to the array, so
//! it outlives the run); an op that would write to it copies first (`ferrum_graph::Store`), so the
//! caller's array is never modified. Booleans are copied (a byte other than 0 or 1 is not a Rust
//! `bool`), and so is any other layout, element by element in logical (row-major) order. As with
//! onnxruntime, an array another Python thread writes to while a run reads it gives undefined
//! results for that run. Python lists are sequences, `None` an empty optional.
//! Outputs: numeric tensors hand their storage to NumPy without a copy (an output that is an
//! input's borrowed buffer, e.g. through Identity, is copied into a new array).
//!
//! The storage-only formats (bfloat16, float8, float4, float6, int4, int2) are the `ml_dtypes`
//! NumPy types, as `onnx.numpy_helper` gives them: one element per byte (two for bfloat16), the
//! byte holding the element's bit pattern.

use ferrum_graph::ir::ValueType;
use ferrum_graph::{DType, Data, Store, Tensor, Value};
use half::{bf16, f16};
use numpy::ndarray::{ArrayD, IxDyn};
use numpy::{
    Element, IntoPyArray, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::errors::InvalidArgument;

/// ml_dtypes' type names for ferrum's storage-only types.
const ML_DTYPES: [(&str, DType); 13] = [
    ("bfloat16", DType::BF16),
    ("float8_e4m3fn", DType::F8E4M3FN),
    ("float8_e4m3fnuz", DType::F8E4M3FNUZ),
    ("float8_e5m2", DType::F8E5M2),
    ("float8_e5m2fnuz", DType::F8E5M2FNUZ),
    ("float8_e8m0fnu", DType::F8E8M0),
    ("float4_e2m1fn", DType::F4E2M1),
    ("float6_e2m3fn", DType::F6E2M3),
    ("float6_e3m2fn", DType::F6E3M2),
    ("int4", DType::I4),
    ("uint4", DType::U4),
    ("int2", DType::I2),
    ("uint2", DType::U2),
];

/// onnxruntime's type string for an element type (`tensor(float)` has `float`).
pub fn ort_elem_name(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "float",
        DType::U8 => "uint8",
        DType::I8 => "int8",
        DType::U16 => "uint16",
        DType::I16 => "int16",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::Str => "string",
        DType::Bool => "bool",
        DType::F16 => "float16",
        DType::F64 => "double",
        DType::U32 => "uint32",
        DType::U64 => "uint64",
        DType::BF16 => "bfloat16",
        DType::F8E4M3FN => "float8e4m3fn",
        DType::F8E4M3FNUZ => "float8e4m3fnuz",
        DType::F8E5M2 => "float8e5m2",
        DType::F8E5M2FNUZ => "float8e5m2fnuz",
        DType::U4 => "uint4",
        DType::I4 => "int4",
        DType::F4E2M1 => "float4e2m1",
        DType::F8E8M0 => "float8e8m0",
        DType::U2 => "uint2",
        DType::I2 => "int2",
        DType::F6E2M3 => "float6e2m3",
        DType::F6E3M2 => "float6e3m2",
    }
}

/// onnxruntime's type string of a value type: `tensor(float)`, `seq(tensor(int64))`,
/// `optional(tensor(float))`.
pub fn ort_type_name(ty: &ValueType) -> String {
    match ty {
        ValueType::Tensor { dtype, .. } => {
            format!("tensor({})", dtype.map_or("undefined", ort_elem_name))
        }
        ValueType::Sequence(t) => format!("seq({})", ort_type_name(t)),
        ValueType::Optional(t) => format!("optional({})", ort_type_name(t)),
        ValueType::Other(s) => s.clone(),
        ValueType::Unknown => "unknown".into(),
    }
}

/// A Python object fed for an input of type `ty`.
pub fn to_value(
    py: Python<'_>,
    name: &str,
    obj: &Bound<'_, PyAny>,
    ty: &ValueType,
) -> PyResult<Value> {
    match ty {
        ValueType::Optional(inner) => {
            if obj.is_none() {
                Ok(Value::Optional(None))
            } else {
                Ok(Value::Optional(Some(Box::new(to_value(
                    py, name, obj, inner,
                )?))))
            }
        }
        ValueType::Sequence(_) => {
            if !(obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>()) {
                return Err(InvalidArgument::new_err(format!(
                    "input '{name}' is a sequence: give a list of arrays, not {}",
                    obj.get_type().name()?
                )));
            }
            let mut ts = Vec::new();
            for (i, item) in obj.try_iter()?.enumerate() {
                ts.push(to_tensor(py, &format!("{name}[{i}]"), &item?)?);
            }
            Ok(Value::Sequence(ts))
        }
        _ => {
            if obj.is_none() {
                return Err(InvalidArgument::new_err(format!(
                    "input '{name}' is None; it needs an array"
                )));
            }
            Ok(Value::Tensor(to_tensor(py, name, obj)?))
        }
    }
}

fn read_typed<T: Element + Copy>(arr: &Bound<'_, PyUntypedArray>) -> PyResult<Vec<T>> {
    let typed = arr.cast::<PyArrayDyn<T>>()?;
    // `to_vec` copies the buffer in memory order: right for C order only.
    if typed.is_c_contiguous() {
        if let Ok(v) = typed.to_vec() {
            return Ok(v);
        }
    }
    let ro = typed.try_readonly()?;
    Ok(ro.as_array().iter().copied().collect())
}

/// The elements of a C-contiguous, aligned NumPy array, read in place; the array is kept alive
/// by the reference held here.
struct NumpyElems<T> {
    _array: Py<PyAny>,
    ptr: *const T,
    len: usize,
}

// SAFETY: the elements are plain numbers (`T` is Send + Sync) read through a shared slice, and
// the array object is only reference-counted here (pyo3 defers a decref made without the GIL).
unsafe impl<T: Send + Sync> Send for NumpyElems<T> {}
// SAFETY: as above; nothing is written through the pointer.
unsafe impl<T: Send + Sync> Sync for NumpyElems<T> {}
impl<T> std::panic::RefUnwindSafe for NumpyElems<T> {}

impl<T> AsRef<[T]> for NumpyElems<T> {
    fn as_ref(&self) -> &[T] {
        // SAFETY: `ptr` is the data pointer of a C-contiguous array of `len` elements of `T`
        // (checked aligned and non-empty in `read_in_place`), and `_array` keeps the array, and
        // so its buffer, alive for as long as `self`. NumPy cannot resize an array that has other
        // references; every bit pattern is a valid `T` (numbers only: booleans are copied).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// A numeric array's elements: read in place when it is C-contiguous and aligned, else copied.
fn read_in_place<T: Element + Copy + Send + Sync>(
    arr: &Bound<'_, PyUntypedArray>,
) -> PyResult<Store<T>> {
    let typed = arr.cast::<PyArrayDyn<T>>()?;
    let ptr = typed.data() as *const T;
    let len = typed.len();
    if typed.is_c_contiguous() && len > 0 && (ptr as usize).is_multiple_of(align_of::<T>()) {
        let elems = NumpyElems {
            _array: typed.clone().into_any().unbind(),
            ptr,
            len,
        };
        return Ok(Store::shared(std::sync::Arc::new(elems)));
    }
    Ok(read_typed(arr)?.into())
}

/// An array (or anything `numpy.asarray` takes) as a tensor.
pub fn to_tensor(py: Python<'_>, name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let np = py.import("numpy")?;
    let owned;
    let arr: &Bound<'_, PyUntypedArray> = match obj.cast::<PyUntypedArray>() {
        Ok(a) => a,
        Err(_) => {
            owned = np.call_method1("asarray", (obj,)).map_err(|e| {
                InvalidArgument::new_err(format!("input '{name}' is not an array: {e}"))
            })?;
            owned.cast::<PyUntypedArray>()?
        }
    };
    let dtype = arr.dtype();
    let shape = arr.shape().to_vec();
    let kind = dtype.kind();
    let size = dtype.itemsize();
    // Non-native byte order: convert to native first.
    if dtype.is_native_byteorder() == Some(false) {
        let native = dtype.call_method1("newbyteorder", ("=",))?;
        let conv = np.call_method1("ascontiguousarray", (arr, native))?;
        return to_tensor(py, name, &conv);
    }
    // An unaligned buffer (a view at an odd byte offset) cannot be read as a slice of its
    // element type: NumPy copies it into an aligned array first.
    let aligned: bool = arr.getattr("flags")?.getattr("aligned")?.extract()?;
    if !aligned {
        let conv = arr.call_method0("copy")?;
        return to_tensor(py, name, &conv);
    }
    let bad = || {
        InvalidArgument::new_err(format!(
            "input '{name}': arrays of dtype {} are not supported",
            dtype.str().map(|s| s.to_string()).unwrap_or_default()
        ))
    };
    let ml = if kind == b'V' || (kind == b'f' && size == 1) {
        let n: String = dtype.getattr("name")?.extract()?;
        Some(
            ML_DTYPES
                .iter()
                .find(|(m, _)| *m == n)
                .map(|x| x.1)
                .ok_or_else(bad)?,
        )
    } else {
        None
    };
    let data = match (ml, kind, size) {
        (Some(DType::BF16), _, _) => {
            let bits = arr.call_method1("view", ("uint16",))?;
            let v: Vec<u16> = read_typed(bits.cast::<PyUntypedArray>()?)?;
            Data::BF16(v.into_iter().map(bf16::from_bits).collect())
        }
        (Some(dt), _, _) => {
            let bytes = arr.call_method1("view", ("uint8",))?;
            let v: Vec<u8> = read_typed(bytes.cast::<PyUntypedArray>()?)?;
            let mask = ((1u16 << ferrum_graph::small::bits(dt)) - 1) as u8;
            Data::Code(dt, v.into_iter().map(|c| c & mask).collect())
        }
        // A NumPy bool is a byte that may hold any value (through views): copied and checked.
        (None, b'b', 1) => {
            let v: Vec<u8> = read_typed(arr.call_method1("view", ("uint8",))?.cast()?)?;
            Data::Bool(v.into_iter().map(|b| b != 0).collect())
        }
        (None, b'i', 1) => Data::I8(read_in_place(arr)?),
        (None, b'i', 2) => Data::I16(read_in_place(arr)?),
        (None, b'i', 4) => Data::I32(read_in_place(arr)?),
        (None, b'i', 8) => Data::I64(read_in_place(arr)?),
        (None, b'u', 1) => Data::U8(read_in_place(arr)?),
        (None, b'u', 2) => Data::U16(read_in_place(arr)?),
        (None, b'u', 4) => Data::U32(read_in_place(arr)?),
        (None, b'u', 8) => Data::U64(read_in_place(arr)?),
        (None, b'f', 2) => Data::F16(read_in_place::<f16>(arr)?),
        (None, b'f', 4) => Data::F32(read_in_place(arr)?),
        (None, b'f', 8) => Data::F64(read_in_place(arr)?),
        (None, b'O' | b'U' | b'S', _) => {
            let flat = arr.call_method0("ravel")?.call_method0("tolist")?;
            let mut v = Vec::with_capacity(arr.len());
            for item in flat.try_iter()? {
                let item = item?;
                let s = if let Ok(s) = item.extract::<String>() {
                    s
                } else if let Ok(b) = item.cast::<pyo3::types::PyBytes>() {
                    String::from_utf8(b.as_bytes().to_vec()).map_err(|_| {
                        InvalidArgument::new_err(format!(
                            "input '{name}': bytes that are not UTF-8"
                        ))
                    })?
                } else {
                    return Err(InvalidArgument::new_err(format!(
                        "input '{name}' is not an array of numbers or strings (holds {})",
                        item.get_type().name()?
                    )));
                };
                v.push(s);
            }
            Data::Str(v)
        }
        _ => return Err(bad()),
    };
    Tensor::new(shape, data).map_err(|e| InvalidArgument::new_err(format!("input '{name}': {e}")))
}

fn array<'py, T: Element + Clone>(
    py: Python<'py>,
    shape: &[usize],
    v: Store<T>,
) -> PyResult<Bound<'py, PyAny>> {
    // Owned storage is handed over; an input's borrowed buffer is copied into a new array.
    let a = ArrayD::from_shape_vec(IxDyn(shape), v.into_vec())
        .map_err(|e| crate::errors::FerrumError::new_err(format!("output shape: {e}")))?;
    Ok(a.into_pyarray(py).into_any())
}

/// A ferrum value as Python: a tensor as a NumPy array (numeric storage is handed over, not
/// copied), a sequence as a list, an empty optional as `None`.
pub fn from_value(py: Python<'_>, v: Value) -> PyResult<Py<PyAny>> {
    Ok(match v {
        Value::Tensor(t) => from_tensor(py, t)?.unbind(),
        Value::Sequence(ts) => {
            let items = ts
                .into_iter()
                .map(|t| from_tensor(py, t))
                .collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any().unbind()
        }
        Value::Optional(None) => py.None(),
        Value::Optional(Some(inner)) => from_value(py, *inner)?,
    })
}

fn from_tensor(py: Python<'_>, t: Tensor) -> PyResult<Bound<'_, PyAny>> {
    let shape = t.shape().to_vec();
    match t.into_data() {
        Data::F32(v) => array(py, &shape, v),
        Data::F64(v) => array(py, &shape, v),
        Data::F16(v) => array(py, &shape, v),
        Data::I8(v) => array(py, &shape, v),
        Data::I16(v) => array(py, &shape, v),
        Data::I32(v) => array(py, &shape, v),
        Data::I64(v) => array(py, &shape, v),
        Data::U8(v) => array(py, &shape, v),
        Data::U16(v) => array(py, &shape, v),
        Data::U32(v) => array(py, &shape, v),
        Data::U64(v) => array(py, &shape, v),
        Data::Bool(v) => array(py, &shape, v),
        Data::BF16(v) => {
            let bits: Vec<u16> = v.iter().map(|x| x.to_bits()).collect();
            ml_view(py, array(py, &shape, bits.into())?, DType::BF16)
        }
        Data::Code(dt, v) => ml_view(py, array(py, &shape, v.into())?, dt),
        Data::Str(v) => {
            let np = py.import("numpy")?;
            let list = PyList::new(py, v)?;
            let flat = np.call_method1("array", (list, "object"))?;
            flat.call_method1("reshape", (PyTuple::new(py, shape)?,))
        }
    }
}

/// The raw array viewed as the ml_dtypes type of `dt`.
fn ml_view<'py>(py: Python<'py>, raw: Bound<'py, PyAny>, dt: DType) -> PyResult<Bound<'py, PyAny>> {
    let name = ML_DTYPES
        .iter()
        .find(|(_, d)| *d == dt)
        .map(|x| x.0)
        .ok_or_else(|| crate::errors::FerrumError::new_err(format!("no NumPy type for {dt}")))?;
    let ml = py.import("ml_dtypes").map_err(|e| {
        crate::errors::FerrumError::new_err(format!(
            "an output of type {dt} needs the ml_dtypes package (pip install ml_dtypes): {e}"
        ))
    })?;
    raw.call_method1("view", (ml.getattr(name)?,))
}
