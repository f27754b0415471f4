//! The kernels' thread pool, tuned for per-token latency.
//!
//! One process-wide pool of `n - 1` workers plus the calling thread ([`set_threads`]). A
//! [`parallel_for`] publishes one job (a task count and a closure) and every thread claims task
//! indices until none are left; the caller returns once every task has finished, which is the only
//! barrier. A worker that arrives late (parked, or descheduled because the machine is
//! oversubscribed) finds nothing left to claim and is not waited for: the caller runs the tasks
//! itself rather than wait for a thread that is not running.
//!
//! Workers spin between jobs (a decode step issues a few hundred jobs tens of microseconds apart,
//! so sleeping between them would cost more than the jobs) and park after [`SPIN_ROUNDS`] idle
//! rounds so an idle process uses no CPU.
//!
//! Claims are tagged with the job's epoch: the job's number and the next task index share one
//! atomic word, so a worker still holding an old job can never claim a task of a newer one.
//!
//! With one thread, or when the pool is busy (another thread's job, or a task that itself calls
//! [`parallel_for`]), the tasks run inline on the caller. Kernels must therefore give the same
//! result whichever thread runs a task, which they do: every task writes its own outputs.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};
use std::thread::JoinHandle;

/// Idle spin rounds before a worker parks (about a millisecond).
const SPIN_ROUNDS: u32 = 1 << 16;

/// Spin rounds the caller waits for running tasks before it starts yielding its core (so that a
/// preempted worker can finish its task sooner on an oversubscribed machine).
const CALLER_SPINS: u32 = 1 << 12;

/// The job being run: its epoch, a lifetime-erased pointer to the caller's closure and its task
/// count.
#[derive(Clone, Copy)]
struct Job {
    epoch: u32,
    f: *const (dyn Fn(usize) + Sync),
    n_tasks: u32,
}

// SAFETY: the closure behind `f` is `Sync`, and `Pool::run` keeps it alive until every task of
// the job has finished; a task can only be claimed while its job is the current one (the epoch
// tag in `Shared::state`), so no thread calls `f` after `Pool::run` returns.
unsafe impl Send for Job {}
// SAFETY: as above; the pointer is only dereferenced to call a `Sync` closure.
unsafe impl Sync for Job {}

/// `Shared::state`: the current epoch in the high 32 bits, the next unclaimed task in the low 32.
fn epoch_of(state: u64) -> u32 {
    (state >> 32) as u32
}

fn index_of(state: u64) -> u32 {
    state as u32
}

struct Shared {
    /// Epoch of the current job and its next unclaimed task index (see [`epoch_of`]).
    state: AtomicU64,
    job: RwLock<Option<Job>>,
    /// Tasks of the current job that have finished.
    done: AtomicUsize,
    /// Workers currently parked on `wake`.
    sleeping: AtomicUsize,
    stop: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

struct Pool {
    n_threads: usize,
    shared: Arc<Shared>,
    /// Held for the duration of a job; a second caller that finds it taken runs inline.
    busy: Mutex<()>,
    workers: Vec<JoinHandle<()>>,
}

impl Pool {
    fn new(n_threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: RwLock::new(None),
            done: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..n_threads)
            .map(|i| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("ferrum-worker-{i}"))
                    .spawn(move || worker(&s))
                    .expect("spawning a kernel worker thread")
            })
            .collect();
        Pool {
            n_threads,
            shared,
            busy: Mutex::new(()),
            workers,
        }
    }

    fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let guard = match self.busy.try_lock() {
            Ok(g) if self.n_threads > 1 && n_tasks > 1 && n_tasks < u32::MAX as usize => g,
            _ => return (0..n_tasks).for_each(f),
        };
        let s = &*self.shared;
        // SAFETY (lifetime erasure): `f` outlives this call, and this call returns only after
        // every task has finished; later claims fail on the epoch tag, so nothing calls the
        // pointer afterwards.
        let f: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
        let epoch = epoch_of(s.state.load(Ordering::Acquire)).wrapping_add(1);
        let job = Job {
            epoch,
            f,
            n_tasks: n_tasks as u32,
        };
        *s.job.write().unwrap() = Some(job);
        s.done.store(0, Ordering::SeqCst);
        s.state.store(u64::from(epoch) << 32, Ordering::SeqCst);
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            let _l = s.lock.lock().unwrap();
            s.wake.notify_all();
        }
        claim_tasks(s, job);
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) < n_tasks {
            if spins < CALLER_SPINS {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        drop(guard);
    }
}

/// Claims and runs tasks of `job` until none are left or a newer job has replaced it.
fn claim_tasks(s: &Shared, job: Job) {
    let mut cur = s.state.load(Ordering::Acquire);
    loop {
        if epoch_of(cur) != job.epoch || index_of(cur) >= job.n_tasks {
            return;
        }
        match s
            .state
            .compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                // SAFETY: the task was claimed while `job` was current, and `Pool::run` waits for
                // every claimed task to finish before the closure goes away.
                unsafe { (*job.f)(index_of(cur) as usize) };
                s.done.fetch_add(1, Ordering::Release);
                cur = s.state.load(Ordering::Acquire);
            }
            Err(now) => cur = now,
        }
    }
}

fn worker(s: &Shared) {
    let mut seen = 0u32;
    loop {
        // Wait for a new job: spin, then park.
        let mut spins = 0u32;
        loop {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            if epoch_of(s.state.load(Ordering::Acquire)) != seen {
                break;
            }
            if spins < SPIN_ROUNDS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            s.sleeping.fetch_add(1, Ordering::SeqCst);
            let mut l = s.lock.lock().unwrap();
            while epoch_of(s.state.load(Ordering::SeqCst)) == seen && !s.stop.load(Ordering::SeqCst)
            {
                l = s.wake.wait(l).unwrap();
            }
            drop(l);
            s.sleeping.fetch_sub(1, Ordering::SeqCst);
            spins = 0;
        }
        seen = epoch_of(s.state.load(Ordering::Acquire));
        let job = *s.job.read().unwrap();
        if let Some(job) = job.filter(|j| j.epoch == seen) {
            claim_tasks(s, job);
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _l = self.shared.lock.lock().unwrap();
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn pool_slot() -> &'static RwLock<Option<Arc<Pool>>> {
    static POOL: OnceLock<RwLock<Option<Arc<Pool>>>> = OnceLock::new();
    POOL.get_or_init(|| RwLock::new(None))
}

/// The machine's core count (what `set_threads(None)` uses).
pub fn available_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Sets the number of threads kernels use (the caller counts as one), replacing the pool.
/// `None`: every available core. Values below 1 count as 1.
pub fn set_threads(n: Option<usize>) {
    let n = n.unwrap_or_else(available_threads).max(1);
    let mut slot = pool_slot().write().unwrap();
    if slot.as_ref().is_some_and(|p| p.n_threads == n) {
        return;
    }
    *slot = Some(Arc::new(Pool::new(n)));
}

/// Threads the kernels use now.
pub fn threads() -> usize {
    current().n_threads
}

fn current() -> Arc<Pool> {
    if let Some(p) = pool_slot().read().unwrap().as_ref() {
        return Arc::clone(p);
    }
    set_threads(None);
    current()
}

/// Runs `f(0) .. f(n_tasks - 1)`, spread over the pool's threads, and returns when all are done.
/// The order and the thread of each task are unspecified.
pub fn parallel_for(n_tasks: usize, f: impl Fn(usize) + Sync) {
    if n_tasks == 0 {
        return;
    }
    current().run(n_tasks, &f);
}

/// Runs `f(i)` for every `i` in `0..n`, split across the pool as runs of consecutive indices,
/// two runs per thread: each thread then streams one stretch of whatever `i` indexes (a
/// matrix's row groups), which the hardware prefetcher follows, instead of every other item
/// (tasks are claimed in turn), which made 2 threads slower than 1 on decode.
pub fn parallel_runs(n: usize, f: impl Fn(usize) + Sync) {
    let per = n.div_ceil(2 * threads()).max(1);
    parallel_for(n.div_ceil(per), |run| {
        for i in run * per..((run + 1) * per).min(n) {
            f(i)
        }
    });
}

/// Splits `out` into chunks of `chunk` elements and runs `f(chunk_index, chunk)` on each in
/// parallel (the last chunk may be shorter).
pub fn parallel_chunks_mut<T: Send>(
    out: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let chunk = chunk.max(1);
    let n = out.len();
    let n_tasks = n.div_ceil(chunk);
    let base = SendPtr(out.as_mut_ptr());
    parallel_for(n_tasks, |i| {
        let start = i * chunk;
        let len = chunk.min(n - start);
        // SAFETY: tasks get disjoint ranges `start..start + len` of `out`, which stays borrowed
        // mutably for the whole call; each index runs exactly once.
        let c = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), len) };
        f(i, c)
    });
}

struct SendPtr<T>(*mut T);
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
// SAFETY: used only to hand disjoint sub-slices of one `&mut [T]` (T: Send) to pool tasks.
unsafe impl<T: Send> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_task_runs_once() {
        for n in [1, 2, 3] {
            set_threads(Some(n));
            assert_eq!(threads(), n);
            for n_tasks in [0usize, 1, 2, 7, 1000] {
                let hits: Vec<AtomicU64> = (0..n_tasks).map(|_| AtomicU64::new(0)).collect();
                for _ in 0..50 {
                    parallel_for(n_tasks, |i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    });
                }
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 50));
            }
        }
    }

    #[test]
    fn back_to_back_jobs_never_mix() {
        // Jobs of different sizes published tens of thousands of times in a row, with more
        // threads than cores: a task claimed by a late worker must belong to the current job.
        set_threads(Some(3));
        for round in 0..20_000usize {
            let n_tasks = 1 + round % 7;
            let hits: Vec<AtomicU64> = (0..n_tasks).map(|_| AtomicU64::new(0)).collect();
            parallel_for(n_tasks, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "round {round}"
            );
        }
    }

    #[test]
    fn chunks_cover_the_slice() {
        let mut v = vec![0usize; 1003];
        parallel_chunks_mut(&mut v, 10, |ci, c| {
            for (j, x) in c.iter_mut().enumerate() {
                *x += ci * 10 + j;
            }
        });
        assert!(v.iter().enumerate().all(|(i, &x)| x == i));
    }

    #[test]
    fn nested_and_concurrent_calls_run_inline() {
        let total = AtomicU64::new(0);
        std::thread::scope(|sc| {
            for _ in 0..3 {
                sc.spawn(|| {
                    parallel_for(8, |_| {
                        parallel_for(4, |_| {
                            total.fetch_add(1, Ordering::Relaxed);
                        });
                    });
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 3 * 8 * 4);
    }
}
