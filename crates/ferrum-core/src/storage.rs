//! Immutable byte storage shared between tensors: a window into a memory map, or an owned buffer.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use crate::{Error, Result};

#[derive(Clone)]
pub struct Bytes {
    inner: Arc<Inner>,
    range: Range<usize>,
}

enum Inner {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    /// Memory-maps a whole file read-only.
    pub fn map_file(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; ferrum never writes model files while they are open. A file
        // truncated by another process while mapped is outside what any mmap-based loader can defend.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let len = map.len();
        Ok(Self {
            inner: Arc::new(Inner::Mapped(map)),
            range: 0..len,
        })
    }

    pub fn from_vec(v: Vec<u8>) -> Self {
        let len = v.len();
        Self {
            inner: Arc::new(Inner::Owned(v)),
            range: 0..len,
        }
    }

    /// A sub-window `[start, start+len)` of this buffer, sharing the allocation.
    pub fn slice(&self, start: usize, len: usize) -> Result<Self> {
        let end = start
            .checked_add(len)
            .filter(|&e| e <= self.len())
            .ok_or_else(|| {
                Error::msg(format!(
                    "byte range {start}+{len} is outside a buffer of {} bytes",
                    self.len()
                ))
            })?;
        Ok(Self {
            inner: self.inner.clone(),
            range: self.range.start + start..self.range.start + end,
        })
    }

    pub fn as_slice(&self) -> &[u8] {
        let all: &[u8] = match &*self.inner {
            Inner::Mapped(m) => m,
            Inner::Owned(v) => v,
        };
        &all[self.range.clone()]
    }

    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bytes({} bytes)", self.len())
    }
}
