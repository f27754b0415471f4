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

    /// Copies `parts` into one anonymous, read-only mapping (each part starting on a 64-byte
    /// boundary) and returns a view of each. On Linux the mapping asks for transparent huge
    /// pages, so kernels that stream every weight per token take few TLB misses (a file map is
    /// made of 4 KiB pages).
    pub fn pack(parts: &[&[u8]]) -> Result<Vec<Self>> {
        let mut offsets = Vec::with_capacity(parts.len());
        let mut total = 0usize;
        for p in parts {
            offsets.push(total);
            total = (total + p.len()).next_multiple_of(64);
        }
        let mut map = memmap2::MmapMut::map_anon(total.max(1))
            .map_err(|e| Error::msg(format!("allocating {total} bytes for weights: {e}")))?;
        #[cfg(target_os = "linux")]
        {
            // A hint only: without huge pages the mapping still works.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        for (p, &o) in parts.iter().zip(&offsets) {
            map[o..o + p.len()].copy_from_slice(p);
        }
        let map = map
            .make_read_only()
            .map_err(|e| Error::msg(format!("protecting the weight buffer: {e}")))?;
        let inner = Arc::new(Inner::Mapped(map));
        Ok(parts
            .iter()
            .zip(offsets)
            .map(|(p, o)| Self {
                inner: inner.clone(),
                range: o..o + p.len(),
            })
            .collect())
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

/// A writable, zero-filled anonymous buffer that asks the OS for transparent huge pages (on
/// Linux), for large scratch or benchmark buffers that should not pay a TLB miss per 4 KiB.
pub struct HugeBuf(memmap2::MmapMut);

impl HugeBuf {
    pub fn zeroed(len: usize) -> Result<Self> {
        let map = memmap2::MmapMut::map_anon(len.max(1))
            .map_err(|e| Error::msg(format!("allocating {len} bytes: {e}")))?;
        #[cfg(target_os = "linux")]
        {
            // A hint only.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        Ok(Self(map))
    }
}

impl std::ops::Deref for HugeBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl std::ops::DerefMut for HugeBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}
