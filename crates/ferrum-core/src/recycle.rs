//! Recycled `f32` buffers. A [`Buf`] is a `Vec<f32>` that, when dropped, goes back to its thread's
//! free list instead of the allocator, and [`Buf::zeros`] takes the smallest free buffer that
//! fits. A loop needing the same sizes every iteration (a decode step: the same activations,
//! layer after layer, token after token) so allocates only in its first iterations: the buffers
//! are planned by use, once per model and batch size. A [`Pool`] is such a free list owned by
//! its user instead of a thread (a graph session's tensors), of any element type.

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
            best_fit(f.iter().map(|v| v.capacity()), n, usize::MAX).map(|i| f.swap_remove(i))
        })
        .ok()
        .flatten();
    found.unwrap_or_else(|| Vec::with_capacity(n))
}

/// The position of the smallest capacity in `caps` that holds `n` and is at most `most`; of
/// equal ones the last (the most recently freed, when buffers are kept in the order they were
/// freed: its memory is the likeliest to be in cache still).
fn best_fit(
    caps: impl DoubleEndedIterator<Item = usize> + ExactSizeIterator,
    n: usize,
    most: usize,
) -> Option<usize> {
    caps.enumerate()
        .rev()
        .filter(|&(_, c)| c >= n && c <= most)
        .min_by_key(|&(_, c)| c)
        .map(|(i, _)| i)
}

/// A free list of vectors its owner keeps (a graph session's tensor memory) rather than a
/// thread: the buffers a run frees serve the next requests of that run and of the next runs,
/// so a run of the same shapes allocates nothing once warm. A request takes the best-fitting
/// free buffer of at most twice its length, or 1024 elements more (a small request does not
/// take the large buffer a later large one needs), and each [`Pool::end_run`] releases the
/// buffers no request took during that run, so memory follows the shapes in use.
#[derive(Debug)]
pub struct Pool<T = f32> {
    free: Vec<Vec<T>>,
    /// Per free buffer: whether it was given back during the current run.
    fresh: Vec<bool>,
    taken: usize,
    allocated: usize,
}

impl<T> Default for Pool<T> {
    fn default() -> Self {
        Pool {
            free: Vec::new(),
            fresh: Vec::new(),
            taken: 0,
            allocated: 0,
        }
    }
}

impl<T> Pool<T> {
    /// An empty vector with room for `n`: the best-fitting free buffer, or a new one.
    pub fn take(&mut self, n: usize) -> Vec<T> {
        let mut v = self.take_keeping(n);
        v.clear();
        v
    }

    /// [`Pool::take`], the buffer still holding what it held when given back (for a caller
    /// that overwrites every element: only the part past that length needs a first write).
    pub fn take_keeping(&mut self, n: usize) -> Vec<T> {
        let most = n.saturating_mul(2).max(n.saturating_add(1024));
        match best_fit(self.free.iter().map(|v| v.capacity()), n, most) {
            Some(i) => {
                // `remove`, not `swap_remove`: the others stay in the order they were freed.
                self.fresh.remove(i);
                let v = self.free.remove(i);
                self.taken += 1;
                v
            }
            None => {
                self.allocated += 1;
                Vec::with_capacity(n)
            }
        }
    }

    /// Keeps `v`'s memory for later requests.
    pub fn give(&mut self, v: Vec<T>) {
        if v.capacity() > 0 {
            self.free.push(v);
            self.fresh.push(true);
        }
    }

    /// Ends a run: releases the free buffers not given back since the previous call (no
    /// request of this run needed them), and returns this run's counts.
    pub fn end_run(&mut self) -> PoolRun {
        let mut keep = self.fresh.iter();
        self.free.retain(|_| *keep.next().unwrap_or(&false));
        self.fresh.clear();
        self.fresh.resize(self.free.len(), false);
        let run = PoolRun {
            reused: self.taken,
            allocated: self.allocated,
            held_bytes: self.held_bytes(),
        };
        self.taken = 0;
        self.allocated = 0;
        run
    }

    /// The bytes of the free buffers.
    pub fn held_bytes(&self) -> usize {
        self.free
            .iter()
            .map(|v| v.capacity() * std::mem::size_of::<T>())
            .sum()
    }
}

/// What one run asked of a [`Pool`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolRun {
    /// Requests served by a free buffer.
    pub reused: usize,
    /// Requests that allocated.
    pub allocated: usize,
    /// The free buffers' bytes at the run's end (after the release).
    pub held_bytes: usize,
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
    fn a_pool_fits_requests_tightly_and_releases_what_a_run_left_untouched() {
        let mut p: Pool<f32> = Pool::default();
        let a = p.take(100_000);
        let b = p.take(10);
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        p.give(a);
        p.give(b);
        assert_eq!(p.end_run().allocated, 2);
        // A small request does not take the large buffer; one of 60% of it does.
        let c = p.take(10);
        assert_eq!((c.as_ptr(), c.len()), (pb, 0));
        let d = p.take(20);
        assert_ne!(d.as_ptr(), pa);
        let e = p.take(60_000);
        assert_eq!(e.as_ptr(), pa);
        p.give(c);
        p.give(e);
        drop(d);
        let run = p.end_run();
        assert_eq!((run.reused, run.allocated), (2, 1));
        assert_eq!(run.held_bytes, (100_000 + 10) * 4);
        // A run that takes only the small buffer releases the large one at its end.
        let c = p.take(10);
        p.give(c);
        assert_eq!(p.end_run().held_bytes, 10 * 4);
        // `take_keeping` hands the buffer back as it was given (its values), `take` empty.
        let mut f = p.take(10);
        f.extend([7.0; 10]);
        let pf = f.as_ptr();
        p.give(f);
        let g = p.take_keeping(8);
        assert_eq!((g.as_ptr(), g.len()), (pf, 10));
        assert!(g.iter().all(|&v| v == 7.0));
        p.give(g);
        assert_eq!(p.take(8).len(), 0);
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
