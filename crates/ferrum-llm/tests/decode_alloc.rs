//! The decode path allocates nothing once warm: after a few steps, one-token forward passes
//! (every thread of the kernel pool included) make no heap allocation, on both real models.
//! Buffers come from the model's recycled scratch ([`ferrum_core::recycle`]) and the kernels'
//! per-thread scratch, planned by the first steps.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use ferrum_llm::model::{KvCache, Logits};
use ferrum_llm::Llm;

/// Counts every allocation and reallocation, on every thread.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: delegates to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations per decode step after `warm` steps, over `steps` steps.
fn allocs_per_step(llm: &Llm, warm: usize, steps: usize) -> f64 {
    let cfg = &llm.model.config;
    let prompt = llm
        .tokenizer
        .encode("The capital of France is", true, false);
    let mut cache = KvCache::new(cfg, prompt.len() + warm + steps + 1);
    llm.model
        .forward(&prompt, 0, &mut cache, Logits::Last)
        .unwrap();
    let mut count = 0;
    for i in 0..warm + steps {
        let pos = prompt.len() + i;
        if i == warm {
            count = ALLOCS.load(Ordering::SeqCst);
        }
        let logits = llm
            .model
            .forward(&[1 + i as u32], pos, &mut cache, Logits::Last)
            .unwrap();
        assert_eq!(logits.len(), cfg.n_vocab);
        assert!(logits.iter().all(|v| v.is_finite()));
    }
    (ALLOCS.load(Ordering::SeqCst) - count) as f64 / steps as f64
}

#[test]
fn decode_steps_allocate_nothing_once_warm() {
    for (name, llm) in [
        ("SmolLM2", common::smollm2()),
        ("Gemma 3", common::gemma3()),
    ] {
        for threads in [1, 2] {
            ferrum_kernels::pool::set_threads(Some(threads));
            let n = allocs_per_step(llm, 4, 8);
            eprintln!("{name}, {threads} thread(s): {n} allocations per decode step");
            assert_eq!(
                n, 0.0,
                "{name}, {threads} thread(s): {n} allocations per decode step"
            );
        }
    }
}
