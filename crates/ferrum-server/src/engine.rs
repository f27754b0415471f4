//! The engine: a synchronous state machine (schedule -> run one step -> update) on its own thread,
//! fed requests through a channel and answering each request through its own event channel.
//!
//! Every step it admits waiting requests up to `max_num_seqs`, then builds one batch under a token
//! budget (`max_batch_tokens`): one token for each sequence that is decoding, then prompt chunks for
//! sequences still prefilling (continuous batching: requests join at the next step and leave the
//! moment they finish). The batch runs as one `Model::forward_batch`, whose kernels are
//! batch-invariant, so a sequence's tokens do not depend on what shares its batch.
//!
//! A request whose event receiver is gone (its client disconnected) is dropped at the next step
//! and its KV cache freed.
//!
//! Not yet here (issue notes): a paged KV cache with prefix sharing (each sequence owns a
//! contiguous cache sized for its prompt plus `max_tokens`), priorities and preemption.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrum_llm::generate::PREFILL_CHUNK;
use ferrum_llm::model::{KvCache, Logits, SeqInput};
use ferrum_llm::sampling::Sampler;
use ferrum_llm::text::{StopMatcher, Utf8Stream};
use ferrum_llm::{FinishReason, Llm, SamplingParams};
use tokio::sync::mpsc::UnboundedSender;

/// Limits of the engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Sequences decoding at once.
    pub max_num_seqs: usize,
    /// Tokens per step (decode tokens plus prompt chunks).
    pub max_batch_tokens: usize,
    /// Largest prompt + completion of one request, in tokens.
    pub ctx_size: usize,
}

/// Counters and histograms the engine keeps for `/metrics`.
#[derive(Default)]
pub struct Metrics {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    /// Bytes of KV cache held by running sequences.
    pub kv_bytes: AtomicUsize,
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
    /// Where the engine sends this request's events.
    pub events: UnboundedSender<Event>,
}

/// What the engine tells a request's handler.
#[derive(Debug)]
pub enum Event {
    /// Newly final text (may be empty when a token completes no character yet) and its token.
    Token { text: String },
    /// The request finished.
    Done {
        finish: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Seconds from submission to the first token.
        ttft: f64,
    },
    /// The request failed (the model could not run it).
    Error(String),
}

struct Seq {
    req: Request,
    cache: KvCache,
    sampler: Sampler,
    utf8: Utf8Stream,
    stops: StopMatcher,
    /// Prompt tokens already in the cache.
    prefilled: usize,
    /// The token to feed at the next step (decoding); it goes at position prompt + generated - 1.
    next: Option<u32>,
    generated: usize,
    submitted: Instant,
    ttft: Option<f64>,
    last_token_at: Option<Instant>,
    /// Why it finished (None while running, or when its client went away).
    finish: Option<FinishReason>,
}

impl Seq {
    fn new(req: Request, submitted: Instant, cfg: &ferrum_llm::Config) -> Seq {
        let capacity = (req.prompt.len() + req.max_tokens).max(1);
        let mut sampler = Sampler::new(req.sampling.clone());
        for &t in &req.prompt {
            sampler.accept(t);
        }
        Seq {
            stops: StopMatcher::new(&req.stop),
            cache: KvCache::new(cfg, capacity),
            sampler,
            utf8: Utf8Stream::default(),
            prefilled: 0,
            next: None,
            generated: 0,
            submitted,
            ttft: None,
            last_token_at: None,
            finish: None,
            req,
        }
    }
}

/// Runs the engine until `rx` closes and every accepted request has finished.
pub fn run(llm: Arc<Llm>, cfg: EngineConfig, rx: Receiver<Request>, metrics: Arc<Metrics>) {
    let mut waiting: VecDeque<(Request, Instant)> = VecDeque::new();
    let mut running: Vec<Seq> = Vec::new();
    let mut open = true;
    loop {
        // Take new requests: block while idle, poll while busy.
        if running.is_empty() && waiting.is_empty() {
            if !open {
                return;
            }
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(r) => waiting.push_back((r, Instant::now())),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => open = false,
            }
        }
        while let Ok(r) = rx.try_recv() {
            waiting.push_back((r, Instant::now()));
        }
        // Admit, lowest priority value first (ties: arrival order).
        while running.len() < cfg.max_num_seqs {
            let best = waiting
                .iter()
                .enumerate()
                .min_by_key(|(i, (r, _))| (r.priority, *i))
                .map(|(i, _)| i);
            let Some((req, t)) = best.and_then(|i| waiting.remove(i)) else {
                break;
            };
            metrics.waiting.store(waiting.len(), Ordering::Relaxed);
            running.push(Seq::new(req, t, &llm.model.config));
        }
        publish(&metrics, waiting.len(), &running);
        // Drop requests whose client went away.
        let before = running.len();
        running.retain(|s| !s.req.events.is_closed());
        metrics
            .finished_abort
            .fetch_add((before - running.len()) as u64, Ordering::Relaxed);
        if running.is_empty() {
            publish(&metrics, waiting.len(), &running);
            continue;
        }
        step(&llm, &cfg, &mut running, &metrics);
        publish(&metrics, waiting.len(), &running);
    }
}

/// Updates the gauges of `/metrics`.
/// The running count goes last (Release), so a reader that sees it (Acquire) sees the rest.
fn publish(metrics: &Metrics, waiting: usize, running: &[Seq]) {
    metrics.kv_bytes.store(
        running.iter().map(|s| s.cache.n_bytes()).sum(),
        Ordering::Relaxed,
    );
    metrics.waiting.store(waiting, Ordering::Relaxed);
    metrics.running.store(running.len(), Ordering::Release);
}

/// One forward pass over the running sequences, then sampling and events.
fn step(llm: &Llm, cfg: &EngineConfig, running: &mut Vec<Seq>, metrics: &Metrics) {
    // Plan: decode tokens first, then prompt chunks within the token budget.
    let mut budget = cfg.max_batch_tokens.max(1);
    let mut plan: Vec<(usize, std::ops::Range<usize>)> = Vec::new(); // (seq index, prompt range)
    let mut decoders: Vec<usize> = Vec::new();
    for (i, s) in running.iter().enumerate() {
        if s.next.is_some() && budget > 0 {
            decoders.push(i);
            budget -= 1;
        }
    }
    for (i, s) in running.iter().enumerate() {
        if s.next.is_none() && s.prefilled < s.req.prompt.len() && budget > 0 {
            let n = (s.req.prompt.len() - s.prefilled)
                .min(budget)
                .min(PREFILL_CHUNK);
            plan.push((i, s.prefilled..s.prefilled + n));
            budget -= n;
        }
    }
    if decoders.is_empty() && plan.is_empty() {
        return;
    }
    // Inputs in running order; remember which entry each result belongs to.
    let mut order: Vec<usize> = decoders.clone();
    order.extend(plan.iter().map(|(i, _)| *i));
    order.sort_unstable();
    let next_tokens: Vec<[u32; 1]> = running.iter().map(|s| [s.next.unwrap_or(0)]).collect();
    let mut inputs: Vec<SeqInput> = Vec::with_capacity(order.len());
    for (i, s) in running.iter_mut().enumerate() {
        if order.binary_search(&i).is_err() {
            continue;
        }
        match plan.iter().find(|(j, _)| *j == i) {
            Some((_, range)) => {
                let last = range.end == s.req.prompt.len();
                inputs.push(SeqInput {
                    tokens: &s.req.prompt[range.clone()],
                    start: range.start,
                    cache: &mut s.cache,
                    want: if last { Logits::Last } else { Logits::None },
                });
            }
            None => {
                let start = s.req.prompt.len() + s.generated - 1;
                inputs.push(SeqInput {
                    tokens: &next_tokens[i],
                    start,
                    cache: &mut s.cache,
                    want: Logits::Last,
                });
            }
        }
    }
    let result = llm.model.forward_batch(inputs);
    let logits = match result {
        Ok(l) => l,
        Err(e) => {
            for &i in &order {
                let _ = running[i].req.events.send(Event::Error(e.to_string()));
            }
            let failed: std::collections::HashSet<usize> = order.iter().copied().collect();
            let mut idx = 0;
            running.retain(|_| {
                let keep = !failed.contains(&idx);
                idx += 1;
                keep
            });
            return;
        }
    };
    let mut finished = vec![false; running.len()];
    for (k, &i) in order.iter().enumerate() {
        let s = &mut running[i];
        if let Some(range) = plan.iter().find(|(j, _)| *j == i).map(|(_, r)| r.clone()) {
            metrics
                .prompt_tokens
                .fetch_add(range.len() as u64, Ordering::Relaxed);
            s.prefilled = range.end;
            if s.prefilled < s.req.prompt.len() {
                continue;
            }
        }
        if logits[k].is_empty() {
            continue;
        }
        let before = s.last_token_at;
        finished[i] = sample_and_emit(llm, s, &logits[k]);
        metrics.generation_tokens.fetch_add(1, Ordering::Relaxed);
        match before {
            None => metrics.ttft.observe(s.ttft.unwrap_or(0.0)),
            Some(t) => metrics.itl.observe(t.elapsed().as_secs_f64()),
        }
        s.last_token_at = Some(Instant::now());
        if finished[i] {
            let c = match s.finish {
                Some(FinishReason::Stop) => &metrics.finished_stop,
                Some(FinishReason::Length) => &metrics.finished_length,
                None => &metrics.finished_abort,
            };
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
    let mut idx = 0;
    running.retain(|_| {
        let keep = !finished[idx];
        idx += 1;
        keep
    });
}

/// Samples the next token of `s` from `logits`, sends its text, and returns whether `s` is done.
fn sample_and_emit(llm: &Llm, s: &mut Seq, logits: &[f32]) -> bool {
    let id = if s.generated < s.req.min_tokens && !s.req.ignore_eos {
        // No end of generation yet: those tokens cannot be drawn.
        let mut l = logits.to_vec();
        for e in llm.tokenizer.eog_ids() {
            if let Some(v) = l.get_mut(e as usize) {
                *v = f32::NEG_INFINITY;
            }
        }
        s.sampler.sample(&l)
    } else {
        s.sampler.sample(logits)
    };
    s.sampler.accept(id);
    s.generated += 1;
    if s.ttft.is_none() {
        s.ttft = Some(s.submitted.elapsed().as_secs_f64());
    }
    let mut finish = None;
    if !s.req.ignore_eos && llm.tokenizer.is_eog(id) {
        finish = Some(FinishReason::Stop);
    } else {
        let piece = s.utf8.push(&llm.tokenizer.token_bytes(id, false));
        let (shown, hit) = s.stops.push(&piece);
        if s.req.events.send(Event::Token { text: shown }).is_err() {
            return true; // the client is gone
        }
        if hit {
            finish = Some(FinishReason::Stop);
        } else if s.generated >= s.req.max_tokens {
            finish = Some(FinishReason::Length);
        }
    }
    match finish {
        None => {
            s.next = Some(id);
            false
        }
        Some(f) => {
            s.finish = Some(f);
            if f == FinishReason::Length {
                let tail = s.utf8.finish();
                let (shown, _) = s.stops.push(&tail);
                let rest = shown + &s.stops.finish();
                if !rest.is_empty() {
                    let _ = s.req.events.send(Event::Token { text: rest });
                }
            }
            let _ = s.req.events.send(Event::Done {
                finish: f,
                prompt_tokens: s.req.prompt.len(),
                completion_tokens: s.generated,
                ttft: s.ttft.unwrap_or(0.0),
            });
            true
        }
    }
}
