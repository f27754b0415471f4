//! The engine: a synchronous state machine (schedule -> run one step -> update) on its own thread,
//! fed requests through a channel and answering each request through its own event channel.
//!
//! Every request's KV cache lives in one preallocated paged pool ([`KvPool`]); [`BlockManager`]
//! hands out its blocks and keeps the prefix cache. A request carries its tokens (prompt and
//! generated) and how many of them are computed (in the cache); each step gives each running
//! request the tokens that catch it up, under a token budget (`max_batch_tokens`): one token when
//! it is decoding, a chunk of its prompt while prefilling (continuous batching: requests join at
//! the next step and leave the moment they finish). The batch runs as one
//! `Model::forward_batch`, whose kernels are batch-invariant, so a request's tokens do not depend
//! on what shares its batch.
//!
//! Step, in order (the shape of vLLM's scheduler):
//! 1. running requests, oldest first, get their tokens' blocks; when the pool is out of blocks the
//!    lowest-priority (then newest) running request is preempted: its blocks are freed and it goes
//!    back to the queue with its tokens, to be recomputed (mostly found in the prefix cache) and
//!    resumed exactly where it stopped;
//! 2. if nothing was preempted, waiting requests are admitted, lowest priority value first (ties:
//!    arrival order), while there are slots (`max_num_seqs`), budget and blocks: a request first
//!    takes the longest run of its leading full blocks found in the prefix cache;
//! 3. one forward pass; newly full blocks enter the prefix cache; requests that caught up sample
//!    their next token.
//!
//! A request whose event receiver is gone (its client disconnected) is dropped at the next step
//! and its blocks freed.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrum_llm::generate::PREFILL_CHUNK;
use ferrum_llm::grammar::Constraint;
use ferrum_llm::model::{KvPool, Logits, SeqInput};
use ferrum_llm::sampling::Sampler;
use ferrum_llm::text::{StopMatcher, Utf8Stream};
use ferrum_llm::{FinishReason, Llm, SamplingParams};
use tokio::sync::mpsc::UnboundedSender;

use crate::kv_blocks::{block_hash, BlockHash, BlockManager};

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

/// Counters and histograms the engine keeps for `/metrics`.
#[derive(Default)]
pub struct Metrics {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    /// KV blocks held by requests, and the pool's size.
    pub kv_blocks_used: AtomicUsize,
    pub kv_blocks_total: AtomicUsize,
    /// Blocks written at least once (their memory is committed).
    pub kv_blocks_committed: AtomicUsize,
    /// Prompt tokens looked up in the prefix cache, and those found there.
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub preemptions: AtomicU64,
    /// Set when the drain time after SIGTERM is over: the engine ends every request it holds.
    pub abort_all: std::sync::atomic::AtomicBool,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Finished requests by reason.
    pub finished_stop: AtomicU64,
    pub finished_length: AtomicU64,
    pub finished_abort: AtomicU64,
    /// Seconds from arrival to the first token.
    pub ttft: Histogram,
    /// Seconds between consecutive tokens of a request.
    pub itl: Histogram,
}

/// A Prometheus histogram with fixed bucket bounds (seconds).
pub struct Histogram {
    pub bounds: Vec<f64>,
    inner: Mutex<(Vec<u64>, f64, u64)>, // per-bucket counts, sum, count
}

impl Default for Histogram {
    fn default() -> Self {
        let bounds = vec![
            0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0,
        ];
        Histogram {
            inner: Mutex::new((vec![0; bounds.len()], 0.0, 0)),
            bounds,
        }
    }
}

impl Histogram {
    pub fn observe(&self, v: f64) {
        let mut g = self.inner.lock().unwrap();
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            g.0[i] += 1;
        }
        g.1 += v;
        g.2 += 1;
    }

    /// Cumulative bucket counts, sum and count.
    pub fn snapshot(&self) -> (Vec<u64>, f64, u64) {
        let g = self.inner.lock().unwrap();
        let mut acc = 0;
        let cum =
            g.0.iter()
                .map(|&c| {
                    acc += c;
                    acc
                })
                .collect();
        (cum, g.1, g.2)
    }
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
}

/// The log-probability of a generated token under the model (before temperature and penalties),
/// with the most likely tokens at that step.
#[derive(Debug, Clone)]
pub struct TokenLogprobs {
    /// The token's bytes (a piece of UTF-8 text, possibly not a whole character).
    pub token: Vec<u8>,
    pub logprob: f32,
    /// The most likely tokens, most likely first.
    pub top: Vec<(Vec<u8>, f32)>,
}

impl TokenLogprobs {
    /// Log-softmax of `logits` at `id`, and the `k` largest entries.
    pub fn new(llm: &Llm, logits: &[f32], id: u32, k: usize) -> TokenLogprobs {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
        let lse = max as f64 + sum.ln();
        let lp = |i: usize| (logits[i] as f64 - lse) as f32;
        // The k largest, by insertion into a short sorted list.
        let mut top: Vec<usize> = Vec::with_capacity(k + 1);
        if k > 0 {
            for (i, &l) in logits.iter().enumerate() {
                if top.len() == k && l <= logits[top[k - 1]] {
                    continue;
                }
                let at = top.partition_point(|&j| logits[j] >= l);
                top.insert(at, i);
                top.truncate(k);
            }
        }
        TokenLogprobs {
            token: llm.tokenizer.token_bytes(id, false),
            logprob: lp(id as usize),
            top: top
                .into_iter()
                .map(|i| (llm.tokenizer.token_bytes(i as u32, false), lp(i)))
                .collect(),
        }
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

struct Seq {
    req: Request,
    /// Order of arrival (ties between equal priorities go to the earlier one).
    arrival: u64,
    /// Prompt, then every generated token.
    tokens: Vec<u32>,
    /// Hash of every full block of `tokens`, each covering the whole prefix up to its end.
    hashes: Vec<BlockHash>,
    /// Leading tokens whose K/V are in the cache.
    computed: usize,
    /// The block table.
    blocks: Vec<u32>,
    /// Leading blocks already offered to the prefix cache.
    blocks_cached: usize,
    /// Prompt tokens the prefix cache supplied at first admission.
    cached_tokens: usize,
    sampler: Sampler,
    utf8: Utf8Stream,
    stops: StopMatcher,
    generated: usize,
    submitted: Instant,
    ttft: Option<f64>,
    last_token_at: Option<Instant>,
    /// Why it finished (None while running, or when its client went away).
    finish: Option<FinishReason>,
    admitted_before: bool,
}

impl Seq {
    fn new(req: Request, arrival: u64, submitted: Instant, block_size: usize) -> Seq {
        let mut sampler = Sampler::new(req.sampling.clone());
        for &t in &req.prompt {
            sampler.accept(t);
        }
        let mut s = Seq {
            stops: StopMatcher::new(&req.stop),
            arrival,
            tokens: req.prompt.clone(),
            hashes: Vec::new(),
            computed: 0,
            blocks: Vec::new(),
            blocks_cached: 0,
            cached_tokens: 0,
            sampler,
            utf8: Utf8Stream::default(),
            generated: 0,
            submitted,
            ttft: None,
            last_token_at: None,
            finish: None,
            admitted_before: false,
            req,
        };
        s.hash_full_blocks(block_size);
        s
    }

    /// Extends `hashes` over the full blocks of `tokens`.
    fn hash_full_blocks(&mut self, block_size: usize) {
        while (self.hashes.len() + 1) * block_size <= self.tokens.len() {
            let i = self.hashes.len();
            let h = block_hash(
                self.hashes.last().copied(),
                &self.tokens[i * block_size..(i + 1) * block_size],
            );
            self.hashes.push(h);
        }
    }

    /// Lower sorts first: runs first, is preempted last.
    fn rank(&self) -> (i64, u64) {
        (self.req.priority, self.arrival)
    }
}

/// The engine's state between steps.
struct Engine {
    llm: Arc<Llm>,
    cfg: EngineConfig,
    pool: KvPool,
    blocks: BlockManager,
    waiting: Vec<Seq>,
    /// In admission order.
    running: Vec<Seq>,
    metrics: Arc<Metrics>,
    arrivals: u64,
}

/// Runs the engine until `rx` closes and every accepted request has finished. Every request's
/// KV cache lives in `pool`.
pub fn run(
    llm: Arc<Llm>,
    cfg: EngineConfig,
    pool: KvPool,
    rx: Receiver<Request>,
    metrics: Arc<Metrics>,
) {
    let blocks = BlockManager::new(pool.n_blocks(), pool.block_size(), cfg.prefix_caching);
    metrics
        .kv_blocks_total
        .store(blocks.n_blocks(), Ordering::Relaxed);
    let mut e = Engine {
        llm,
        cfg,
        pool,
        blocks,
        waiting: Vec::new(),
        running: Vec::new(),
        metrics,
        arrivals: 0,
    };
    let mut open = true;
    loop {
        // Take new requests: block while idle, poll while busy.
        if e.running.is_empty() && e.waiting.is_empty() {
            if !open {
                return;
            }
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(r) => e.arrive(r),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => open = false,
            }
        }
        while let Ok(r) = rx.try_recv() {
            e.arrive(r);
        }
        if e.metrics.abort_all.load(Ordering::Acquire) {
            e.abort_all("the server is shutting down and its drain time is over");
        }
        e.drop_abandoned();
        e.step();
        e.publish();
    }
}

impl Engine {
    fn arrive(&mut self, req: Request) {
        let s = Seq::new(req, self.arrivals, Instant::now(), self.pool.block_size());
        self.arrivals += 1;
        self.waiting.push(s);
    }

    /// Ends every request with an error, freeing its blocks.
    fn abort_all(&mut self, why: &str) {
        let n = self.running.len() + self.waiting.len();
        for mut s in self.running.drain(..).chain(self.waiting.drain(..)) {
            let _ = s
                .req
                .events
                .send((s.req.choice, Event::Error(why.to_string())));
            self.blocks.free(&mut s.blocks);
        }
        self.metrics
            .finished_abort
            .fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Drops requests whose client went away, freeing their blocks.
    fn drop_abandoned(&mut self) {
        let mut dropped = 0;
        for list in [&mut self.running, &mut self.waiting] {
            let mut i = 0;
            while i < list.len() {
                if list[i].req.events.is_closed() {
                    let mut s = list.remove(i);
                    self.blocks.free(&mut s.blocks);
                    dropped += 1;
                } else {
                    i += 1;
                }
            }
        }
        self.metrics
            .finished_abort
            .fetch_add(dropped, Ordering::Relaxed);
    }

    /// Updates the gauges of `/metrics`. The running count goes last (Release), so a reader that
    /// sees it (Acquire) sees the rest.
    fn publish(&self) {
        let m = &self.metrics;
        m.kv_blocks_used
            .store(self.blocks.n_used(), Ordering::Relaxed);
        m.kv_blocks_committed
            .store(self.blocks.n_committed(), Ordering::Relaxed);
        m.waiting.store(self.waiting.len(), Ordering::Relaxed);
        m.running.store(self.running.len(), Ordering::Release);
    }

    /// Frees `running[i]`'s blocks and sends it back to the queue, to be recomputed.
    fn preempt(&mut self, i: usize) -> Seq {
        let mut s = self.running.remove(i);
        self.blocks.free(&mut s.blocks);
        s.computed = 0;
        s.blocks_cached = 0;
        self.metrics.preemptions.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            priority = s.req.priority,
            tokens = s.tokens.len(),
            "preempted: out of KV blocks"
        );
        s
    }

    /// Preempts `running[v]` while a step is being planned: drops its entry from `plan` (giving
    /// its tokens back to `budget`) and shifts the indices after it.
    fn evict(&mut self, plan: &mut Vec<(usize, usize)>, budget: &mut usize, v: usize) -> Seq {
        if let Some(k) = plan.iter().position(|&(j, _)| j == v) {
            *budget += plan.remove(k).1;
        }
        for p in plan.iter_mut() {
            if p.0 > v {
                p.0 -= 1;
            }
        }
        self.preempt(v)
    }

    /// The running request to preempt first: lowest priority (largest value), then newest.
    fn worst_running(&self) -> Option<usize> {
        (0..self.running.len()).max_by_key(|&j| self.running[j].rank())
    }

    /// Plans one step: (index in `running`, tokens to compute) per scheduled request.
    fn schedule(&mut self) -> Vec<(usize, usize)> {
        let mut budget = self.cfg.max_batch_tokens.max(1);
        let mut plan: Vec<(usize, usize)> = Vec::new();
        let mut preempted: Vec<Seq> = Vec::new();
        let mut i = 0;
        'running: while i < self.running.len() {
            let s = &self.running[i];
            let n = (s.tokens.len() - s.computed).min(budget).min(PREFILL_CHUNK);
            if n == 0 {
                i += 1;
                continue;
            }
            loop {
                let s = &mut self.running[i];
                if self.blocks.allocate(&mut s.blocks, &[], s.computed + n) {
                    plan.push((i, n));
                    budget -= n;
                    i += 1;
                    break;
                }
                // Out of blocks: preempt the lowest-priority, newest running request.
                let v = self.worst_running().expect("running holds request i");
                preempted.push(self.evict(&mut plan, &mut budget, v));
                if v == i {
                    // This request was the victim: nothing more for it this step.
                    continue 'running;
                }
                if v < i {
                    i -= 1;
                }
            }
        }
        let any_preempted = !preempted.is_empty();
        self.waiting.append(&mut preempted);
        if any_preempted {
            return plan;
        }
        self.admit(plan, budget)
    }

    /// Admits waiting requests into the step being planned, best rank first, while there are
    /// slots, budget and blocks. A request with a strictly better (lower) priority than a running
    /// one takes that one's slot or blocks: the running request is preempted (its blocks stay in
    /// the prefix cache, so its recomputation is mostly lookups).
    fn admit(&mut self, mut plan: Vec<(usize, usize)>, mut budget: usize) -> Vec<(usize, usize)> {
        if self.waiting.is_empty() {
            return plan;
        }
        let bs = self.blocks.block_size();
        // Full blocks running requests are computing in this step or later: a waiting request
        // whose next uncached block is one of them waits for it instead of computing it again
        // (requests sharing a new system prompt arrive together).
        let in_flight: std::collections::HashSet<BlockHash> = if self.blocks.prefix_caching() {
            self.running
                .iter()
                .flat_map(|s| {
                    s.hashes[(s.computed / bs).min(s.hashes.len())..]
                        .iter()
                        .copied()
                })
                .collect()
        } else {
            Default::default()
        };
        let mut queue = std::mem::take(&mut self.waiting);
        queue.sort_by_key(|s| s.rank());
        let mut queue = queue.into_iter();
        let mut bumped: Vec<Seq> = Vec::new();
        while budget > 0 {
            let Some(mut s) = queue.next() else { break };
            // At least the last token is computed, for its logits.
            let max_hit = (s.tokens.len().saturating_sub(1) / bs).min(s.hashes.len());
            let hits = self.blocks.lookup(&s.hashes[..max_hit]);
            if hits.len() < max_hit && in_flight.contains(&s.hashes[hits.len()]) {
                self.waiting.push(s);
                continue;
            }
            let computed = hits.len() * bs;
            let n = (s.tokens.len() - computed).min(budget).min(PREFILL_CHUNK);
            let outranks = |e: &Engine| {
                e.worst_running()
                    .filter(|&v| s.req.priority < e.running[v].req.priority)
            };
            if self.running.len() >= self.cfg.max_num_seqs {
                match outranks(self) {
                    Some(v) => bumped.push(self.evict(&mut plan, &mut budget, v)),
                    None => {
                        self.waiting.push(s);
                        break;
                    }
                }
            }
            let admitted = loop {
                if self.blocks.allocate(&mut s.blocks, &hits, computed + n) {
                    break true;
                }
                match outranks(self) {
                    Some(v) => bumped.push(self.evict(&mut plan, &mut budget, v)),
                    None => break false,
                }
            };
            if !admitted {
                // Out of blocks: wait for running requests to finish.
                self.waiting.push(s);
                break;
            }
            s.computed = computed;
            s.blocks_cached = hits.len();
            if !s.admitted_before {
                s.admitted_before = true;
                s.cached_tokens = computed.min(s.req.prompt.len());
                let m = &self.metrics;
                m.prefix_queries
                    .fetch_add(s.tokens.len() as u64, Ordering::Relaxed);
                m.prefix_hits.fetch_add(computed as u64, Ordering::Relaxed);
            }
            self.running.push(s);
            plan.push((self.running.len() - 1, n));
            budget -= n;
        }
        self.waiting.extend(queue);
        self.waiting.append(&mut bumped);
        plan
    }

    /// One step: schedule, one forward pass, then prefix-cache updates, sampling and events.
    fn step(&mut self) {
        let plan = self.schedule();
        self.publish();
        if plan.is_empty() {
            return;
        }
        let inputs: Vec<SeqInput> = plan
            .iter()
            .map(|&(i, n)| {
                let s = &self.running[i];
                let end = s.computed + n;
                SeqInput {
                    tokens: &s.tokens[s.computed..end],
                    start: s.computed,
                    table: &s.blocks,
                    want: if end == s.tokens.len() {
                        Logits::Last
                    } else {
                        Logits::None
                    },
                }
            })
            .collect();
        let result = self.llm.model.forward_batch(&mut self.pool, inputs);
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("forward pass failed: {e}");
                let mut failed: Vec<usize> = plan.iter().map(|p| p.0).collect();
                failed.sort_unstable();
                for &i in failed.iter().rev() {
                    let mut s = self.running.remove(i);
                    let _ = s
                        .req
                        .events
                        .send((s.req.choice, Event::Error(e.to_string())));
                    self.blocks.free(&mut s.blocks);
                }
                return;
            }
        };
        let bs = self.blocks.block_size();
        let mut finished = vec![false; self.running.len()];
        for (&(i, n), logits) in plan.iter().zip(&logits) {
            let s = &mut self.running[i];
            s.computed += n;
            while s.blocks_cached < s.computed / bs {
                let b = s.blocks_cached;
                self.blocks.cache_full(s.blocks[b], s.hashes[b]);
                s.blocks_cached += 1;
            }
            if logits.is_empty() {
                continue; // a prompt chunk that does not reach the end
            }
            if s.generated == 0 {
                self.metrics
                    .prompt_tokens
                    .fetch_add(s.req.prompt.len() as u64, Ordering::Relaxed);
            }
            let before = s.last_token_at;
            finished[i] = sample_and_emit(&self.llm, s, logits, bs);
            self.metrics
                .generation_tokens
                .fetch_add(1, Ordering::Relaxed);
            match before {
                None => self.metrics.ttft.observe(s.ttft.unwrap_or(0.0)),
                Some(t) => self.metrics.itl.observe(t.elapsed().as_secs_f64()),
            }
            s.last_token_at = Some(Instant::now());
            if finished[i] {
                let c = match s.finish {
                    Some(FinishReason::Stop) => &self.metrics.finished_stop,
                    Some(FinishReason::Length) => &self.metrics.finished_length,
                    None => &self.metrics.finished_abort,
                };
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        for i in (0..finished.len()).rev() {
            if finished[i] {
                let mut s = self.running.remove(i);
                self.blocks.free(&mut s.blocks);
            }
        }
    }
}

/// Samples the next token of `s` from `logits`, sends its text, and returns whether `s` is done.
fn sample_and_emit(llm: &Llm, s: &mut Seq, logits: &[f32], block_size: usize) -> bool {
    // A constrained request draws from the tokens its grammar allows.
    let masked;
    let mut view = logits;
    if let Some(c) = s.req.constraint.as_mut() {
        let mut l = logits.to_vec();
        if let Err(e) = c.mask(&mut l) {
            return fail(s, e.to_string());
        }
        masked = l;
        view = &masked;
    }
    let id = if s.generated < s.req.min_tokens && !s.req.ignore_eos {
        // No end of generation yet: those tokens cannot be drawn.
        let mut l = view.to_vec();
        for e in llm.tokenizer.eog_ids() {
            if let Some(v) = l.get_mut(e as usize) {
                *v = f32::NEG_INFINITY;
            }
        }
        s.sampler.sample(&l)
    } else {
        s.sampler.sample(view)
    };
    s.sampler.accept(id);
    let mut complete = false;
    if let Some(c) = s.req.constraint.as_mut() {
        if let Err(e) = c.accept(id) {
            return fail(s, e.to_string());
        }
        complete = c.is_complete();
    }
    s.generated += 1;
    if s.ttft.is_none() {
        s.ttft = Some(s.submitted.elapsed().as_secs_f64());
    }
    let mut finish = None;
    let choice = s.req.choice;
    if !s.req.ignore_eos && llm.tokenizer.is_eog(id) {
        finish = Some(FinishReason::Stop);
    } else {
        let piece = s.utf8.push(&llm.tokenizer.token_bytes(id, false));
        let (shown, hit) = s.stops.push(&piece);
        let logprobs = s
            .req
            .logprobs
            .map(|k| TokenLogprobs::new(llm, logits, id, k));
        let ev = Event::Token {
            text: shown,
            logprobs,
        };
        if s.req.events.send((choice, ev)).is_err() {
            return true; // the client is gone
        }
        if hit || complete {
            // A stop string, or the grammar's output is whole (only its end could follow).
            finish = Some(FinishReason::Stop);
        } else if s.generated >= s.req.max_tokens {
            finish = Some(FinishReason::Length);
        }
    }
    match finish {
        None => {
            s.tokens.push(id);
            s.hash_full_blocks(block_size);
            false
        }
        Some(f) => {
            s.finish = Some(f);
            if f == FinishReason::Length {
                let tail = s.utf8.finish();
                let (shown, _) = s.stops.push(&tail);
                let rest = shown + &s.stops.finish();
                if !rest.is_empty() {
                    let ev = Event::Token {
                        text: rest,
                        logprobs: None,
                    };
                    let _ = s.req.events.send((choice, ev));
                }
            }
            let done = Event::Done {
                finish: f,
                prompt_tokens: s.req.prompt.len(),
                completion_tokens: s.generated,
                cached_tokens: s.cached_tokens,
                ttft: s.ttft.unwrap_or(0.0),
            };
            let _ = s.req.events.send((choice, done));
            true
        }
    }
}

/// Ends `s` with an error event (its grammar failed: a step over the parser's bounds); true, as
/// `sample_and_emit` returns for a finished sequence.
fn fail(s: &mut Seq, why: String) -> bool {
    tracing::warn!("request failed while sampling: {why}");
    let _ = s.req.events.send((s.req.choice, Event::Error(why)));
    true
}
