//! The engine: a loop on its own thread (schedule -> one forward pass -> update), fed requests
//! through a channel and answering each request through its own event channel. What runs when
//! is the [`Scheduler`]'s decision; this file runs the model between its two halves.
//!
//! Every request's KV cache lives in one preallocated paged pool ([`KvPool`]); the scheduler's
//! block manager hands out its blocks and keeps the prefix cache. A request carries its tokens (prompt and
//! generated) and how many of them are computed (in the cache); each step gives each running
//! request the tokens that catch it up, under a token budget (`max_batch_tokens`): one token when
//! it is decoding, a chunk of its prompt while prefilling (continuous batching: requests join at
//! the next step and leave the moment they finish). The batch runs as one
//! `Model::forward_batch`, whose kernels are batch-invariant, so a request's tokens do not depend
//! on what shares its batch.
//!
//! The scheduling policy is described in [`crate::scheduler`].

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use ferrum_llm::grammar::Constraint;
use ferrum_llm::model::KvPool;
use ferrum_llm::{FinishReason, Llm, SamplingParams};
use tokio::sync::mpsc::UnboundedSender;

pub use crate::metrics::{Histogram, Metrics};
use crate::scheduler::Scheduler;
pub use ferrum_llm::output::TokenLogprobs;

/// Limits of the engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Sequences decoding at once.
    pub max_num_seqs: usize,
    /// Tokens per step (decode tokens plus prompt chunks).
    pub max_batch_tokens: usize,
    /// Largest prompt + completion of one request, in tokens.
    pub ctx_size: usize,
    /// Share the KV blocks of common prompt prefixes between requests.
    pub prefix_caching: bool,
}

/// One generation request.
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// End-of-generation tokens are suppressed until this many tokens were generated.
    pub min_tokens: usize,
    /// Lower runs first; equal priorities run in arrival order.
    pub priority: i64,
    /// Report each generated token's log-probability and this many most likely alternatives.
    pub logprobs: Option<usize>,
    /// Which choice of its HTTP request this is (`n` > 1 submits one engine request per choice).
    pub choice: usize,
    /// Where the engine sends this request's events, tagged with `choice`.
    pub events: UnboundedSender<(usize, Event)>,
    /// The grammar the output must follow (compiled; this choice's own parser state): each
    /// token is drawn from the logits it allows, and the request stops when it is complete.
    pub constraint: Option<Constraint>,
    /// The constraint holds only after this text appears in the output (a thinking template's
    /// `</think>`: the model reasons freely, then its answer follows the grammar).
    pub constraint_after: Option<String>,
    /// Held until the engine is through with the request (finished, failed, aborted, or
    /// dropped with the engine): see [`Completion`]. `None` for callers that follow the events.
    pub completion: Option<Completion>,
}

/// A guard each request of a group holds until the engine drops the request; the group's
/// [`CompletionWait`] returns once every guard is gone. A caller that needs only complete
/// results (a batch `generate`) waits on it and is woken once, instead of by every token's
/// event: on a machine whose cores all run the forward pass, each such wake-up preempts a
/// kernel thread and stalls the others at the next barrier.
#[derive(Clone, Debug)]
pub struct Completion(#[allow(dead_code)] std::sync::mpsc::Sender<()>);

/// Waits for every [`Completion`] of its group to be dropped.
#[derive(Debug)]
pub struct CompletionWait(Receiver<()>);

impl Completion {
    /// A guard (clone it for each request) and the wait that ends when all clones are dropped.
    pub fn group() -> (Completion, CompletionWait) {
        let (tx, rx) = std::sync::mpsc::channel();
        (Completion(tx), CompletionWait(rx))
    }
}

impl CompletionWait {
    /// Whether every guard was dropped, waiting at most `timeout` for it. Nothing is ever sent
    /// on the channel: it only disconnects.
    pub fn wait(&self, timeout: Duration) -> bool {
        matches!(
            self.0.recv_timeout(timeout),
            Err(RecvTimeoutError::Disconnected)
        )
    }
}

/// What the engine tells a request's handler.
#[derive(Debug)]
pub enum Event {
    /// Newly final text (may be empty when a token completes no character yet, or while it may
    /// still become part of a stop string), and the generated token's log-probabilities when the
    /// request asked for them.
    Token {
        text: String,
        logprobs: Option<TokenLogprobs>,
        /// The drawn token's id (`None` for text held back until the end, which has no token of
        /// its own).
        token: Option<u32>,
    },
    /// The request finished.
    Done {
        finish: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Prompt tokens found in the prefix cache.
        cached_tokens: usize,
        /// Seconds from submission to the first token.
        ttft: f64,
    },
    /// The request failed (the model could not run it).
    Error(String),
}

/// Runs the engine until `rx` closes and every accepted request has finished. Every request's
/// KV cache lives in `pool`.
pub fn run(
    llm: Arc<Llm>,
    cfg: EngineConfig,
    mut pool: KvPool,
    rx: Receiver<Request>,
    metrics: Arc<Metrics>,
) {
    let mut sched = Scheduler::new(
        cfg,
        pool.n_blocks(),
        pool.block_size(),
        Arc::clone(&metrics),
    );
    let mut open = true;
    loop {
        // Take new requests: block while idle, poll while busy.
        if sched.is_idle() {
            if !open {
                return;
            }
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(r) => sched.add(r),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => open = false,
            }
        }
        while let Ok(r) = rx.try_recv() {
            sched.add(r);
        }
        if metrics.abort_all.load(Ordering::Acquire) {
            sched.abort_all("the server is shutting down and its drain time is over");
        }
        sched.drop_abandoned();
        step(&llm, &mut pool, &mut sched);
        sched.publish();
    }
}

/// One step: schedule, one forward pass over every scheduled request, then the scheduler's
/// update (prefix cache, sampling, events).
fn step(llm: &Llm, pool: &mut KvPool, sched: &mut Scheduler) {
    let plan = sched.schedule();
    sched.publish();
    if plan.is_empty() {
        return;
    }
    let result = llm.model.forward_batch(pool, sched.inputs(&plan));
    match result {
        Ok(logits) => sched.update(plan, &logits, &llm.tokenizer),
        Err(e) => {
            tracing::error!("forward pass failed: {e}");
            sched.fail(plan, &e.to_string());
        }
    }
}
