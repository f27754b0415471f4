//! A session's tensor memory, reused from run to run.
//!
//! Every output a kernel writes through [`Elem::room`] (the float32 fast paths, the generic
//! kernels' outputs) comes from the running session's pools, one per element type: the free
//! buffers of values already past their last reader (the executor gives each one back when it
//! frees it, see `exec`), else a new one. A run thus holds at most its live values (their
//! lifetimes decide the reuse, as a static memory plan's offsets would), and once the pools
//! have seen the model's shapes a run allocates no tensor memory but the outputs it hands back
//! (`tests/memory.rs` counts). The pools belong to the session, so dropping the session returns
//! the memory; buffers no request needed in a run are released at its end (`Pool::end_run`), so
//! the pools follow the shapes in use.
//!
//! The pools reach the kernels through this thread's slot, filled for the span of a
//! `Session::run` ([`Installed`]); elsewhere (constant folding at load, kernels called on their
//! own) buffers are simply allocated.

use std::cell::RefCell;
use std::sync::Mutex;

use ferrum_core::recycle::{Pool, PoolRun};
use half::{bf16, f16};

use crate::tensor::{Data, Elem, Store, Value};

/// One pool per element type a tensor stores in a vector of its own.
#[derive(Debug, Default)]
pub struct Pools {
    f32: Pool<f32>,
    f64: Pool<f64>,
    f16: Pool<f16>,
    bf16: Pool<bf16>,
    i8: Pool<i8>,
    i16: Pool<i16>,
    i32: Pool<i32>,
    i64: Pool<i64>,
    u8: Pool<u8>,
    u16: Pool<u16>,
    u32: Pool<u32>,
    u64: Pool<u64>,
    bool: Pool<bool>,
    /// Outputs written this run into the memory of an input they were the last to read.
    in_place: usize,
}

/// The element types [`Pools`] keeps: each finds its pool.
pub(crate) trait Pooled: Sized {
    fn pool(p: &mut Pools) -> &mut Pool<Self>;
}

macro_rules! pooled {
    ($($t:ty => $f:ident),*) => {$(
        impl Pooled for $t {
            fn pool(p: &mut Pools) -> &mut Pool<$t> {
                &mut p.$f
            }
        }
    )*};
}

pooled!(f32 => f32, f64 => f64, f16 => f16, bf16 => bf16, i8 => i8, i16 => i16, i32 => i32,
    i64 => i64, u8 => u8, u16 => u16, u32 => u32, u64 => u64, bool => bool);

impl Pools {
    /// Ends a run of every pool; the counts summed, and the outputs written in place.
    fn end_run(&mut self) -> (PoolRun, usize) {
        let runs = [
            self.f32.end_run(),
            self.f64.end_run(),
            self.f16.end_run(),
            self.bf16.end_run(),
            self.i8.end_run(),
            self.i16.end_run(),
            self.i32.end_run(),
            self.i64.end_run(),
            self.u8.end_run(),
            self.u16.end_run(),
            self.u32.end_run(),
            self.u64.end_run(),
            self.bool.end_run(),
        ];
        let sum = runs.iter().fold(PoolRun::default(), |a, r| PoolRun {
            reused: a.reused + r.reused,
            allocated: a.allocated + r.allocated,
            held_bytes: a.held_bytes + r.held_bytes,
        });
        (sum, std::mem::take(&mut self.in_place))
    }
}

thread_local! {
    static CURRENT: RefCell<Option<Pools>> = const { RefCell::new(None) };
}

/// A session's pools between runs (`None` while a run holds them).
#[derive(Debug, Default)]
pub struct Arena {
    pools: Mutex<Option<Box<Pools>>>,
    last: Mutex<(PoolRun, usize)>,
}

impl Arena {
    /// Puts the pools in this thread's slot until the guard drops. A second run at the same
    /// time (another thread) gets empty pools of its own.
    pub fn install(&self) -> Installed<'_> {
        let pools = self
            .pools
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .map(|b| *b)
            .unwrap_or_default();
        let outer = CURRENT.with(|c| c.borrow_mut().replace(pools));
        Installed { arena: self, outer }
    }

    /// What the last finished run asked of the pools.
    pub fn last_run(&self) -> PoolRun {
        self.last.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    /// How many outputs the last finished run wrote into the memory of an input they were the
    /// last to read (a fused convolution's residual), instead of taking a buffer.
    pub fn last_in_place(&self) -> usize {
        self.last.lock().unwrap_or_else(|e| e.into_inner()).1
    }
}

/// Holds a session's pools in this thread's slot (see [`Arena::install`]).
pub struct Installed<'a> {
    arena: &'a Arena,
    outer: Option<Pools>,
}

impl Drop for Installed<'_> {
    fn drop(&mut self) {
        let pools = CURRENT.with(|c| std::mem::replace(&mut *c.borrow_mut(), self.outer.take()));
        if let Some(mut pools) = pools {
            *self.arena.last.lock().unwrap_or_else(|e| e.into_inner()) = pools.end_run();
            let mut slot = self.arena.pools.lock().unwrap_or_else(|e| e.into_inner());
            if slot.is_none() {
                *slot = Some(Box::new(pools));
            }
        }
    }
}

/// An empty vector with room for `n`: from the running session's pool, else new.
pub(crate) fn take<T: Pooled>(n: usize) -> Vec<T> {
    let mut v = take_keeping(n);
    v.clear();
    v
}

/// A vector with room for `n` from the running session's pool, holding what it held when
/// given back ([`ferrum_core::recycle::Pool::take_keeping`]), else a new empty one.
fn take_keeping<T: Pooled>(n: usize) -> Vec<T> {
    CURRENT
        .try_with(|c| {
            c.try_borrow_mut()
                .ok()?
                .as_mut()
                .map(|p| T::pool(p).take_keeping(n))
        })
        .ok()
        .flatten()
        .unwrap_or_else(|| Vec::with_capacity(n))
}

/// `n` elements for a kernel that writes every one of them: a buffer from the running
/// session's pool keeping what it held (only elements past its old length are set, to `v`),
/// else `n` copies of `v` in new memory. Integer and float types only: any bits are a value.
pub(crate) fn overwritten<T: Pooled + Copy>(n: usize, v: T) -> Vec<T> {
    let mut out = take_keeping(n);
    out.truncate(n);
    out.resize(n, v);
    out
}

/// `n` copies of `v`, in memory from the running session's pool (else new).
pub(crate) fn full<T: Pooled + Clone>(n: usize, v: T) -> Vec<T> {
    let mut out = take(n);
    out.resize(n, v);
    out
}

/// Gives `v`'s memory to the running session's pool of its type.
fn give<T: Pooled + Elem>(store: Store<T>) {
    let Some(v) = store.into_owned() else { return };
    let _ = CURRENT.try_with(|c| {
        if let Ok(mut c) = c.try_borrow_mut() {
            if let Some(p) = c.as_mut() {
                T::pool(p).give(v);
            }
        }
    });
}

/// Counts an output written into an input's memory in the running session's run.
pub(crate) fn note_in_place() {
    let _ = CURRENT.try_with(|c| {
        if let Ok(mut c) = c.try_borrow_mut() {
            if let Some(p) = c.as_mut() {
                p.in_place += 1;
            }
        }
    });
}

/// Gives a freed value's memory to the running session's pools (strings, storage-only
/// formats, sequences and maps are dropped).
pub(crate) fn recycle(v: Value) {
    let Value::Tensor(t) = v else { return };
    match t.into_data() {
        Data::F32(s) => give(s),
        Data::F64(s) => give(s),
        Data::F16(s) => give(s),
        Data::BF16(s) => give(s),
        Data::I8(s) => give(s),
        Data::I16(s) => give(s),
        Data::I32(s) => give(s),
        Data::I64(s) => give(s),
        Data::U8(s) => give(s),
        Data::U16(s) => give(s),
        Data::U32(s) => give(s),
        Data::U64(s) => give(s),
        Data::Bool(s) => give(s),
        Data::Str(_) | Data::Code(..) => {}
    }
}
