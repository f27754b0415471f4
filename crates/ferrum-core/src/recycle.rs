//! Recycled `f32` buffers. A [`Buf`] is a `Vec<f32>` that, when dropped, goes back to its thread's
//! free list instead of the allocator, and [`Buf::zeros`] takes the smallest free buffer that
//! fits. A loop needing the same sizes every iteration (a decode step: the same activations,
//! layer after layer, token after token) so allocates only in its first iterations: the buffers
//! are planned by use, once per model and batch size.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

/// Free buffers kept per thread (more are released to the allocator).
const KEEP: usize = 96;

thread_local! {
    static FREE: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// A recycled `Vec<f32>` (see the module text). Dereferences to the `Vec`.
#[derive(Default, PartialEq)]
pub struct Buf(Vec<f32>);

impl Buf {
    /// `n` zeros, in the smallest free buffer of this thread that holds them (else a new one).
    pub fn zeros(n: usize) -> Buf {
        let mut v = take(n);
        v.resize(n, 0.0);
        Buf(v)
    }

    /// `n` values for a caller that overwrites every one (a product's output): a free buffer
    /// of this thread keeps the values it held (they are not cleared; only growth is written),
    /// so taking it costs no pass over memory.
    pub fn overwritten(n: usize) -> Buf {
        let mut v = take_keeping(n);
        v.truncate(n);
        v.resize(n, 0.0);
        Buf(v)
    }

    /// An empty buffer with room for `n` values.
    pub fn with_capacity(n: usize) -> Buf {
        Buf(take(n))
    }

    /// A copy of `x`.
    pub fn from_slice(x: &[f32]) -> Buf {
        let mut v = take(x.len());
        v.extend_from_slice(x);
        Buf(v)
    }

    /// The `Vec`, leaving recycling.
    pub fn into_vec(mut self) -> Vec<f32> {
        std::mem::take(&mut self.0)
    }
}

/// An empty vector with room for `n`: the best-fitting free one, or a new one.
fn take(n: usize) -> Vec<f32> {
    let mut v = take_keeping(n);
    v.clear();
    v
}

/// A vector with room for `n`, holding what it held when freed: the best-fitting free one, or
/// a new (empty) one.
fn take_keeping(n: usize) -> Vec<f32> {
    let found = FREE
        .try_with(|f| {
            let mut f = f.borrow_mut();
            let best = f
                .iter()
                .enumerate()
                .filter(|(_, v)| v.capacity() >= n)
                .min_by_key(|(_, v)| v.capacity())
                .map(|(i, _)| i);
            best.map(|i| f.swap_remove(i))
        })
        .ok()
        .flatten();
    found.unwrap_or_else(|| Vec::with_capacity(n))
}

impl Drop for Buf {
    fn drop(&mut self) {
        if self.0.capacity() == 0 {
            return;
        }
        let v = std::mem::take(&mut self.0);
        // During thread teardown the list may be gone: the buffer is then simply freed.
        let _ = FREE.try_with(|f| {
            if let Ok(mut f) = f.try_borrow_mut() {
                if f.len() < KEEP {
                    f.push(v);
                }
            }
        });
    }
}

impl Deref for Buf {
    type Target = Vec<f32>;
    fn deref(&self) -> &Vec<f32> {
        &self.0
    }
}

impl AsRef<[f32]> for Buf {
    fn as_ref(&self) -> &[f32] {
        &self.0
    }
}

impl DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut Vec<f32> {
        &mut self.0
    }
}

impl Clone for Buf {
    fn clone(&self) -> Buf {
        Buf::from_slice(&self.0)
    }
}

impl IntoIterator for Buf {
    type Item = f32;
    type IntoIter = std::vec::IntoIter<f32>;
    fn into_iter(self) -> Self::IntoIter {
        self.into_vec().into_iter()
    }
}

impl<'a> IntoIterator for &'a Buf {
    type Item = &'a f32;
    type IntoIter = std::slice::Iter<'a, f32>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl From<Buf> for Vec<f32> {
    fn from(b: Buf) -> Vec<f32> {
        b.into_vec()
    }
}

impl std::fmt::Debug for Buf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_buffers_come_back_zeroed_and_best_fitting() {
        let mut a = Buf::zeros(1000);
        a[3] = 7.0;
        let pa = a.as_ptr();
        let b = Buf::zeros(10);
        let pb = b.as_ptr();
        drop(a);
        drop(b);
        // The 10-element request takes the 10-element buffer, not the 1000-element one.
        let c = Buf::zeros(10);
        assert_eq!(c.as_ptr(), pb);
        let d = Buf::zeros(900);
        assert_eq!(d.as_ptr(), pa);
        assert_eq!(d.len(), 900);
        assert!(d.iter().all(|&v| v == 0.0), "recycled buffers are zeroed");
        let e = Buf::from_slice(&[1.0, 2.0]);
        assert_eq!(&e[..], &[1.0, 2.0]);
        assert_eq!(e.into_vec(), vec![1.0, 2.0]);
    }

    #[test]
    fn overwritten_buffers_keep_their_values_and_zeros_still_clears() {
        let mut a = Buf::zeros(64);
        a.iter_mut().for_each(|v| *v = 5.0);
        let pa = a.as_ptr();
        drop(a);
        // The length asked for, in the same buffer, its values left as they were.
        let b = Buf::overwritten(48);
        assert_eq!((b.as_ptr(), b.len()), (pa, 48));
        assert!(b.iter().all(|&v| v == 5.0));
        drop(b);
        // Growing past what the buffer held writes the new part (zeros).
        let c = Buf::overwritten(64);
        assert_eq!(c.as_ptr(), pa);
        assert!(c[..48].iter().all(|&v| v == 5.0) && c[48..].iter().all(|&v| v == 0.0));
        drop(c);
        let d = Buf::zeros(64);
        assert_eq!(d.as_ptr(), pa);
        assert!(d.iter().all(|&v| v == 0.0), "zeros clears a dirty buffer");
    }
}
