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
    /// A read-only map of a file.
    File(memmap2::Mmap),
    /// An anonymous mapping the process filled ([`Bytes::build`]).
    Anon(memmap2::Mmap),
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
            inner: Arc::new(Inner::File(map)),
            range: 0..len,
        })
    }

    /// Tells the OS this window of a file map will not be read again, so its pages leave the
    /// process's resident set (they stay in the page cache, and a later read maps them back:
    /// the contents never change). A loader calls it after copying a tensor elsewhere. Pages
    /// shared with a neighbouring window are released too, which only costs that window a
    /// re-read. No effect on other storage.
    pub fn release(&self) {
        #[cfg(unix)]
        if let Inner::File(map) = &*self.inner {
            if !self.range.is_empty() {
                // SAFETY: the map is a read-only, shared map of a file. MADV_DONTNEED on it only
                // drops the page-table entries; a later read faults the same file contents back
                // in, so no reference into the map sees different bytes (the file is not written
                // while mapped, as `map_file` assumes). Failure changes only the resident size.
                let _ = unsafe {
                    map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        self.range.start,
                        self.range.len(),
                    )
                };
            }
        }
    }

    /// Asks the OS to map this window of a file map in now, in one call, rather than page by
    /// page as it is first read (a loader about to read every byte of a tensor). A hint: no
    /// effect on other storage, or where the OS lacks it.
    pub fn populate(&self) {
        #[cfg(target_os = "linux")]
        if let Inner::File(map) = &*self.inner {
            if !self.range.is_empty() {
                let _ = map.advise_range(
                    memmap2::Advice::PopulateRead,
                    self.range.start,
                    self.range.len(),
                );
            }
        }
    }

    /// Whether these bytes are a window of a file map.
    pub fn is_file_mapped(&self) -> bool {
        matches!(&*self.inner, Inner::File(_))
    }

    /// Copies `parts` into one anonymous, read-only mapping (each part starting on a 64-byte
    /// boundary) and returns a view of each; see [`Bytes::build`].
    pub fn pack(parts: &[&[u8]]) -> Result<Vec<Self>> {
        let sizes: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        Self::build(&sizes, |bufs| {
            for (dst, src) in bufs.into_iter().zip(parts) {
                dst.copy_from_slice(src);
            }
            Ok(())
        })
    }

    /// One anonymous mapping holding parts of `sizes` bytes (each starting on a 64-byte
    /// boundary), zero-filled, handed to `fill` as writable slices, then made read-only; returns
    /// a view of each part. On Linux the mapping asks for transparent huge pages, so kernels
    /// that stream every weight per token take few TLB misses (a file map is made of 4 KiB
    /// pages). Pages are committed as `fill` writes them.
    pub fn build(
        sizes: &[usize],
        fill: impl FnOnce(Vec<&mut [u8]>) -> Result<()>,
    ) -> Result<Vec<Self>> {
        let mut offsets = Vec::with_capacity(sizes.len());
        let mut total = 0usize;
        for &n in sizes {
            offsets.push(total);
            total = total
                .checked_add(n)
                .map(|t| t.next_multiple_of(64))
                .ok_or_else(|| Error::msg("weight buffer size overflows"))?;
        }
        let mut map = memmap2::MmapMut::map_anon(total.max(1))
            .map_err(|e| Error::msg(format!("allocating {total} bytes for weights: {e}")))?;
        #[cfg(target_os = "linux")]
        {
            // A hint only: without huge pages the mapping still works.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        {
            let mut parts = Vec::with_capacity(sizes.len());
            let mut rest: &mut [u8] = &mut map[..];
            let mut at = 0;
            for (&n, &o) in sizes.iter().zip(&offsets) {
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(o - at);
                let (part, tail) = tail.split_at_mut(n);
                parts.push(part);
                rest = tail;
                at = o + n;
            }
            fill(parts)?;
        }
        let map = map
            .make_read_only()
            .map_err(|e| Error::msg(format!("protecting the weight buffer: {e}")))?;
        let inner = Arc::new(Inner::Anon(map));
        Ok(sizes
            .iter()
            .zip(offsets)
            .map(|(&n, o)| Self {
                inner: inner.clone(),
                range: o..o + n,
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
            Inner::File(m) | Inner::Anon(m) => m,
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
