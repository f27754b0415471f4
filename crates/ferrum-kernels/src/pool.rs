//! The kernels' thread pool, tuned for per-token latency.
//!
//! One process-wide pool of `n - 1` workers plus the calling thread ([`set_threads`]). A
//! [`parallel_for`] publishes one job (a task count and a closure), every thread claims task
//! indices from a shared counter until none are left, and the caller returns once all workers have
//! finished: that wait is the only barrier. Workers spin on the job counter between jobs (a decode
//! step issues a few hundred jobs tens of microseconds apart, so sleeping between them would cost
//! more than the jobs), and park after [`SPIN_ROUNDS`] idle rounds so an idle process uses no CPU.
//!
//! With one thread, or when the pool is busy (another thread's job, or a task that itself calls
//! [`parallel_for`]), the tasks run inline on the caller. Kernels must therefore give the same
//! result whichever thread runs a task, which they do: every task writes its own outputs.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};
use std::thread::JoinHandle;

/// Idle spin rounds before a worker parks (about a millisecond).
const SPIN_ROUNDS: u32 = 1 << 16;

/// The job being run: a lifetime-erased pointer to the caller's closure and its task count.
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    n_tasks: usize,
}

// SAFETY: the closure behind `f` is `Sync`, and `Pool::run` keeps it alive until every worker has
// reported that it finished with the job, so sharing the pointer across threads is sound.
unsafe impl Send for Job {}
// SAFETY: as above; the pointer is only dereferenced to call a `Sync` closure.
unsafe impl Sync for Job {}

struct Shared {
    /// Incremented once per published job; workers compare it with the last one they ran.
    epoch: AtomicUsize,
    job: RwLock<Option<Job>>,
    /// Next unclaimed task index of the current job.
    next: AtomicUsize,
    /// Workers that have finished the current job.
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
            epoch: AtomicUsize::new(0),
            job: RwLock::new(None),
            next: AtomicUsize::new(0),
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
            Ok(g) if self.n_threads > 1 && n_tasks > 1 => g,
            _ => return (0..n_tasks).for_each(f),
        };
        let s = &*self.shared;
        // SAFETY (lifetime erasure): `f` outlives this call, and this call returns only after
        // every worker has incremented `done` for this job, after its last use of the pointer.
        let f: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
        *s.job.write().unwrap() = Some(Job { f, n_tasks });
        s.next.store(0, Ordering::SeqCst);
        s.done.store(0, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            let _l = s.lock.lock().unwrap();
            s.wake.notify_all();
        }
        claim_tasks(s, f, n_tasks);
        let n_workers = self.n_threads - 1;
        while s.done.load(Ordering::Acquire) < n_workers {
            std::hint::spin_loop();
        }
        *s.job.write().unwrap() = None;
        drop(guard);
    }
}

fn claim_tasks(s: &Shared, f: *const (dyn Fn(usize) + Sync), n_tasks: usize) {
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= n_tasks {
            return;
        }
        // SAFETY: `f` points to the closure of the job being run, alive until `Pool::run` has
        // seen every worker finish (see `Pool::run`).
        unsafe { (*f)(i) };
    }
}

fn worker(s: &Shared) {
    let mut seen = 0usize;
    loop {
        // Wait for a new job: spin, then park.
        let mut spins = 0u32;
        loop {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            if s.epoch.load(Ordering::Acquire) != seen {
                break;
            }
            if spins < SPIN_ROUNDS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            s.sleeping.fetch_add(1, Ordering::SeqCst);
            let mut l = s.lock.lock().unwrap();
            while s.epoch.load(Ordering::SeqCst) == seen && !s.stop.load(Ordering::SeqCst) {
                l = s.wake.wait(l).unwrap();
            }
            drop(l);
            s.sleeping.fetch_sub(1, Ordering::SeqCst);
            spins = 0;
        }
        seen = s.epoch.load(Ordering::Acquire);
        let job = *s.job.read().unwrap();
        if let Some(job) = job {
            claim_tasks(s, job.f, job.n_tasks);
        }
        s.done.fetch_add(1, Ordering::Release);
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
