//! Metadata values: the 13 GGUF value types and typed accessors.

use std::fmt;

/// The type tag of a GGUF metadata value; the discriminant order is GGUF's type id (0..=12).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    /// All types, indexed by their GGUF id.
    pub const ALL: [ValueType; 13] = [
        ValueType::U8,
        ValueType::I8,
        ValueType::U16,
        ValueType::I16,
        ValueType::U32,
        ValueType::I32,
        ValueType::F32,
        ValueType::Bool,
        ValueType::String,
        ValueType::Array,
        ValueType::U64,
        ValueType::I64,
        ValueType::F64,
    ];

    /// The type with GGUF id `id`, or `None` for an unknown id.
    pub fn from_id(id: u32) -> Option<ValueType> {
        usize::try_from(id)
            .ok()
            .and_then(|i| Self::ALL.get(i).copied())
    }

    /// GGUF's id of this type.
    pub const fn id(self) -> u32 {
        self as u32
    }

    /// Short lower-case name used in messages and [`Value`]'s `Display` (`u8`, `str`, `array`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            ValueType::U8 => "u8",
            ValueType::I8 => "i8",
            ValueType::U16 => "u16",
            ValueType::I16 => "i16",
            ValueType::U32 => "u32",
            ValueType::I32 => "i32",
            ValueType::F32 => "f32",
            ValueType::Bool => "bool",
            ValueType::String => "str",
            ValueType::Array => "array",
            ValueType::U64 => "u64",
            ValueType::I64 => "i64",
            ValueType::F64 => "f64",
        }
    }

    /// The fewest bytes one value of this type takes in a file (a string's 8-byte length, an
    /// array's 4-byte element type and 8-byte count). Used to bound counts before allocating.
    pub const fn min_encoded_size(self) -> usize {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => 1,
            ValueType::U16 | ValueType::I16 => 2,
            ValueType::U32 | ValueType::I32 | ValueType::F32 => 4,
            ValueType::U64 | ValueType::I64 | ValueType::F64 | ValueType::String => 8,
            ValueType::Array => 12,
        }
    }

    /// True for the eight integer types.
    pub const fn is_integer(self) -> bool {
        matches!(
            self,
            ValueType::U8
                | ValueType::I8
                | ValueType::U16
                | ValueType::I16
                | ValueType::U32
                | ValueType::I32
                | ValueType::U64
                | ValueType::I64
        )
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value. `Array` carries its element type (needed for empty arrays) and the
/// elements, which all have that type; arrays may nest (the reader caps the depth).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// This value's type tag.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// The value of any integer variant as `i128` (every GGUF integer fits), else `None`.
    fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Any non-negative integer variant, widened to `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }

    /// Any integer variant whose value fits in `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }

    /// Any numeric variant (integers and floats) as `f64`; 64-bit integers may round.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => self.as_i128().map(|v| v as f64),
        }
    }

    /// Any numeric variant as `f32` (an `F32` exactly; others rounded).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            _ => self.as_f64().map(|v| v as f32),
        }
    }

    /// A `Bool`.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// A `String`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements of an `Array`.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, v) => Some(v),
            _ => None,
        }
    }

    /// An array whose elements are all strings (an empty array of any type gives `Some(vec![])`
    /// only when its element type is `String`).
    pub fn as_str_array(&self) -> Option<Vec<&str>> {
        match self {
            Value::Array(ValueType::String, v) => v.iter().map(Value::as_str).collect(),
            _ => None,
        }
    }

    /// An array of numeric elements, each converted as by [`Value::as_f32`].
    pub fn as_f32_array(&self) -> Option<Vec<f32>> {
        self.as_array()?.iter().map(Value::as_f32).collect()
    }

    /// An array of integer elements that all fit in `i32`.
    pub fn as_i32_array(&self) -> Option<Vec<i32>> {
        self.as_array()?
            .iter()
            .map(|v| v.as_i64().and_then(|x| i32::try_from(x).ok()))
            .collect()
    }
}

/// Strings longer than this many chars are shortened by `Display`.
const DISPLAY_STR_CHARS: usize = 60;
/// Arrays longer than this print as `[type; len: first items, ...]`.
const DISPLAY_ARRAY_ITEMS: usize = 8;
/// How many leading items a long array shows.
const DISPLAY_ARRAY_HEAD: usize = 4;

fn fmt_str(s: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let n = s.chars().count();
    if n <= DISPLAY_STR_CHARS {
        write!(f, "{s:?}")
    } else {
        let head: String = s.chars().take(DISPLAY_STR_CHARS).collect();
        write!(f, "{head:?}... ({} bytes)", s.len())
    }
}

/// A short human-readable form: numbers plainly, strings quoted (long ones shortened), arrays
/// of more than 8 elements as `[str; 49152: "<unk>", "<s>", "</s>", "a", ...]`.
impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v:?}"),
            Value::F64(v) => write!(f, "{v:?}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::String(s) => fmt_str(s, f),
            Value::Array(t, items) => {
                let shown = if items.len() > DISPLAY_ARRAY_ITEMS {
                    write!(f, "[{t}; {}: ", items.len())?;
                    DISPLAY_ARRAY_HEAD
                } else {
                    f.write_str("[")?;
                    items.len()
                };
                for (i, item) in items.iter().take(shown).enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{item}")?;
                }
                if shown < items.len() {
                    f.write_str(", ...")?;
                }
                f.write_str("]")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        for (i, t) in ValueType::ALL.iter().enumerate() {
            assert_eq!(t.id() as usize, i);
            assert_eq!(ValueType::from_id(i as u32), Some(*t));
        }
        assert_eq!(ValueType::from_id(13), None);
        assert_eq!(ValueType::from_id(u32::MAX), None);
    }

    #[test]
    fn numeric_accessors() {
        assert_eq!(Value::I8(-1).as_u64(), None);
        assert_eq!(Value::I8(-1).as_i64(), Some(-1));
        assert_eq!(Value::U64(u64::MAX).as_i64(), None);
        assert_eq!(Value::U64(u64::MAX).as_u64(), Some(u64::MAX));
        assert_eq!(Value::U16(7).as_f64(), Some(7.0));
        assert_eq!(Value::F32(0.5).as_f32(), Some(0.5));
        assert_eq!(Value::F64(0.25).as_f32(), Some(0.25));
        assert_eq!(Value::F32(1.0).as_u64(), None);
        assert_eq!(Value::Bool(true).as_u64(), None);
        assert_eq!(Value::Bool(true).as_bool(), Some(true));
        assert_eq!(Value::String("a".into()).as_str(), Some("a"));
        assert_eq!(Value::U8(1).as_str(), None);
    }

    #[test]
    fn array_accessors() {
        let s = Value::Array(
            ValueType::String,
            vec![Value::String("a".into()), Value::String("b".into())],
        );
        assert_eq!(s.as_str_array(), Some(vec!["a", "b"]));
        assert_eq!(s.as_f32_array(), None);
        let n = Value::Array(ValueType::I32, vec![Value::I32(-3), Value::I32(4)]);
        assert_eq!(n.as_i32_array(), Some(vec![-3, 4]));
        assert_eq!(n.as_f32_array(), Some(vec![-3.0, 4.0]));
        assert_eq!(n.as_str_array(), None);
        let big = Value::Array(ValueType::U64, vec![Value::U64(1 << 40)]);
        assert_eq!(big.as_i32_array(), None);
        assert_eq!(
            Value::Array(ValueType::String, vec![]).as_str_array(),
            Some(vec![])
        );
    }

    #[test]
    fn display_is_short() {
        assert_eq!(Value::U32(5).to_string(), "5");
        assert_eq!(Value::F32(1.0).to_string(), "1.0");
        assert_eq!(Value::String("hi\n".into()).to_string(), "\"hi\\n\"");
        let small = Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(2)]);
        assert_eq!(small.to_string(), "[1, 2]");
        let toks: Vec<Value> = (0..49152).map(|i| Value::String(format!("t{i}"))).collect();
        let big = Value::Array(ValueType::String, toks);
        assert_eq!(
            big.to_string(),
            "[str; 49152: \"t0\", \"t1\", \"t2\", \"t3\", ...]"
        );
        let long = Value::String("x".repeat(1000));
        assert!(long.to_string().len() < 100);
        assert!(long.to_string().ends_with("(1000 bytes)"));
    }
}
