//! A bounds-checked little-endian reader over a byte slice. Every read checks the bytes left
//! first and reports the offset where it started; nothing here can panic or over-allocate.

use ferrum_core::Error;

use crate::Result;

/// Format name used in every [`Error::Parse`] this crate returns.
pub(crate) const FORMAT: &str = "GGUF";

/// A parse error at byte `offset`.
pub(crate) fn parse_err(offset: usize, msg: impl Into<String>) -> Error {
    Error::Parse {
        format: FORMAT,
        offset: offset as u64,
        msg: msg.into(),
    }
}

/// Prefixes a parse error's message with `ctx: ` (other errors pass through).
pub(crate) fn with_context(e: Error, ctx: impl FnOnce() -> String) -> Error {
    match e {
        Error::Parse {
            format,
            offset,
            msg,
        } => Error::Parse {
            format,
            offset,
            msg: format!("{}: {msg}", ctx()),
        },
        other => other,
    }
}

pub(crate) struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0 }
    }

    /// Current offset from the start of the file.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// Bytes left after the current position.
    pub(crate) fn remaining(&self) -> usize {
        self.data.len().saturating_sub(self.pos)
    }

    /// The next `n` bytes, advancing past them.
    pub(crate) fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let left = self.remaining();
        if n > left {
            return Err(parse_err(
                self.pos,
                format!("unexpected end of file reading {what}: need {n} bytes, {left} left"),
            ));
        }
        let start = self.pos;
        self.pos += n;
        Ok(&self.data[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let b = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }
    pub(crate) fn u16(&mut self, what: &str) -> Result<u16> {
        self.array(what).map(u16::from_le_bytes)
    }
    pub(crate) fn u32(&mut self, what: &str) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }
    pub(crate) fn u64(&mut self, what: &str) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A GGUF string: `u64` length then that many bytes of UTF-8. The length is checked against
    /// the bytes left before anything is allocated; invalid UTF-8 is an error.
    pub(crate) fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos;
        let len = self.u64(what)?;
        let left = self.remaining();
        let n = usize::try_from(len)
            .ok()
            .filter(|&n| n <= left)
            .ok_or_else(|| {
                parse_err(
                    at,
                    format!("{what}: string length {len} exceeds the {left} bytes left"),
                )
            })?;
        let bytes = self.take(n, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(parse_err(
                at + 8 + e.valid_up_to(),
                format!(
                    "{what}: invalid UTF-8 at byte {} of a {n}-byte string",
                    e.valid_up_to()
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offset_of(e: Error) -> u64 {
        match e {
            Error::Parse { offset, .. } => offset,
            other => panic!("not a parse error: {other}"),
        }
    }

    #[test]
    fn reads_little_endian_and_stops_at_end() {
        let data = [1u8, 0, 2, 0, 0, 0, 9];
        let mut c = Cursor::new(&data);
        assert_eq!(c.u16("a").unwrap(), 1);
        assert_eq!(c.u32("b").unwrap(), 2);
        assert_eq!(c.remaining(), 1);
        let e = c.u64("c").unwrap_err();
        assert_eq!(offset_of(e), 6);
        assert_eq!(c.u8("d").unwrap(), 9);
        assert_eq!(c.remaining(), 0);
    }

    #[test]
    fn string_checks_length_and_utf8() {
        let mut ok = 3u64.to_le_bytes().to_vec();
        ok.extend_from_slice(b"abc");
        assert_eq!(Cursor::new(&ok).string("s").unwrap(), "abc");

        let mut huge = u64::MAX.to_le_bytes().to_vec();
        huge.extend_from_slice(b"abc");
        let e = Cursor::new(&huge).string("s").unwrap_err();
        assert!(e.to_string().contains("exceeds the 3 bytes left"), "{e}");

        let mut bad = 2u64.to_le_bytes().to_vec();
        bad.extend_from_slice(&[b'a', 0xff]);
        let e = Cursor::new(&bad).string("s").unwrap_err();
        assert!(e.to_string().contains("invalid UTF-8"), "{e}");
        assert_eq!(offset_of(e), 9);
    }
}
