//! Per-operator profiling: callers wrap each operator in [`record`] with its FLOPs and bytes; while
//! profiling is on ([`start`] .. [`stop`]) every call is timed and kept as an [`Event`]. Off, a
//! call costs one relaxed atomic load.
//!
//! Events are recorded from the thread that issued the operator (the kernels' pool threads work
//! inside it), so the events of one forward pass tile its wall time without overlapping.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

static ON: AtomicBool = AtomicBool::new(false);
static STATE: Mutex<Option<State>> = Mutex::new(None);

struct State {
    origin: Instant,
    events: Vec<Event>,
}

/// One timed operator call.
#[derive(Clone, Debug)]
pub struct Event {
    /// The operator ("matmul", "attention", "rms_norm", ...).
    pub op: &'static str,
    /// What it computes in the model ("attn_q", "ffn_down", "output", "norm", ...).
    pub class: &'static str,
    /// Start, nanoseconds since [`start`].
    pub start_ns: u64,
    pub dur_ns: u64,
    /// Floating-point (or integer multiply-add) operations, counting a multiply-add as 2.
    pub flops: f64,
    /// Bytes read and written from memory (weights, activations, cache).
    pub bytes: f64,
}

/// Whether profiling is on.
#[inline]
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Turns profiling on, dropping earlier events.
pub fn start() {
    *STATE.lock().unwrap() = Some(State {
        origin: Instant::now(),
        events: Vec::with_capacity(1 << 16),
    });
    ON.store(true, Ordering::SeqCst);
}

/// Turns profiling off and returns the events recorded since [`start`], in start order.
pub fn stop() -> Vec<Event> {
    ON.store(false, Ordering::SeqCst);
    let mut ev = STATE
        .lock()
        .unwrap()
        .take()
        .map(|s| s.events)
        .unwrap_or_default();
    ev.sort_by_key(|e| e.start_ns);
    ev
}

/// Runs `f`, timing it as one call of `op` when profiling is on.
#[inline]
pub fn record<T>(
    op: &'static str,
    class: &'static str,
    flops: f64,
    bytes: f64,
    f: impl FnOnce() -> T,
) -> T {
    if !enabled() {
        return f();
    }
    let t0 = Instant::now();
    let out = f();
    let t1 = Instant::now();
    if let Some(s) = STATE.lock().unwrap().as_mut() {
        s.events.push(Event {
            op,
            class,
            start_ns: t0.saturating_duration_since(s.origin).as_nanos() as u64,
            dur_ns: t1.saturating_duration_since(t0).as_nanos() as u64,
            flops,
            bytes,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_while_on() {
        assert_eq!(record("x", "c", 1.0, 1.0, || 7), 7);
        start();
        let v = record("matmul", "attn_q", 10.0, 20.0, || {
            std::thread::sleep(std::time::Duration::from_millis(2));
            3
        });
        assert_eq!(v, 3);
        let ev = stop();
        assert_eq!(record("x", "c", 1.0, 1.0, || 5), 5);
        let mine: Vec<&Event> = ev.iter().filter(|e| e.class == "attn_q").collect();
        assert_eq!(mine.len(), 1);
        assert!(mine[0].dur_ns >= 2_000_000, "{:?}", mine[0]);
        assert_eq!((mine[0].flops, mine[0].bytes), (10.0, 20.0));
    }
}
