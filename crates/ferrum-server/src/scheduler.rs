//! The scheduler: every request the engine holds, as a plain state machine with no model in
//! it. [`Scheduler::schedule`] plans a step (which requests compute how many tokens, under the
//! token budget, the sequence slots and the KV blocks), [`Scheduler::inputs`] gives the model its
//! inputs for the plan, and [`Scheduler::update`] takes the step's logits back: prefix-cache
//! updates, sampling (through each request's grammar), events, finished requests leaving. The
//! engine ([`crate::engine`]) runs the model between the two; the tests here drive it with
//! made-up logits.
//!
//! Policy (the shape of vLLM's scheduler):
//! 1. running requests, oldest first, get their tokens' blocks; when the pool is out of blocks the
//!    lowest-priority (then newest) running request is preempted: its blocks are freed and it goes
//!    back to the queue with its tokens, to be recomputed (mostly found in the prefix cache) and
//!    resumed exactly where it stopped;
//! 2. if nothing was preempted, waiting requests are admitted, lowest priority value first (ties:
//!    arrival order), while there are slots (`max_num_seqs`), budget and blocks: a request first
//!    takes the longest run of its leading full blocks found in the prefix cache; a waiting
//!    request of strictly better priority takes a running one's place.
//!
//! A request whose event receiver is gone (its client disconnected) is dropped by
//! [`Scheduler::drop_abandoned`] and its blocks freed.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use ferrum_llm::generate::PREFILL_CHUNK;
use ferrum_llm::model::{Logits, SeqInput};
use ferrum_llm::output::{SeqOutput, TokenLogprobs};
use ferrum_llm::sampling::Sampler;
use ferrum_llm::FinishReason;
use ferrum_tokenizer::Tokenizer;

use crate::engine::{EngineConfig, Event, Request};
use crate::kv_blocks::{block_hash, BlockHash, BlockManager};
use crate::metrics::Metrics;

/// One step's plan: (index among the running requests, tokens to compute) per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan(pub Vec<(usize, usize)>);

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

pub(crate) struct Seq {
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
    /// Its text, stop strings and finish rules.
    out: SeqOutput,
    /// The latest output bytes, while waiting for `constraint_after` to appear.
    recent: Vec<u8>,
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
            out: SeqOutput::new(&req.stop, req.max_tokens, req.ignore_eos, req.min_tokens),
            arrival,
            tokens: req.prompt.clone(),
            hashes: Vec::new(),
            computed: 0,
            blocks: Vec::new(),
            blocks_cached: 0,
            cached_tokens: 0,
            sampler,
            recent: Vec::new(),
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

/// Every request the engine holds, and the KV blocks they hold.
pub struct Scheduler {
    cfg: EngineConfig,
    blocks: BlockManager,
    waiting: Vec<Seq>,
    /// In admission order.
    running: Vec<Seq>,
    metrics: Arc<Metrics>,
    arrivals: u64,
}

impl Scheduler {
    /// A scheduler over a KV pool of `n_blocks` blocks of `block_size` positions.
    pub fn new(
        cfg: EngineConfig,
        n_blocks: usize,
        block_size: usize,
        metrics: Arc<Metrics>,
    ) -> Self {
        let blocks = BlockManager::new(n_blocks, block_size, cfg.prefix_caching);
        metrics
            .kv_blocks_total
            .store(blocks.n_blocks(), Ordering::Relaxed);
        Scheduler {
            cfg,
            blocks,
            waiting: Vec::new(),
            running: Vec::new(),
            metrics,
            arrivals: 0,
        }
    }

    /// Whether no request is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Requests (waiting, running).
    pub fn counts(&self) -> (usize, usize) {
        (self.waiting.len(), self.running.len())
    }

    /// Takes a new request; it waits for the next [`Scheduler::schedule`].
    pub fn add(&mut self, req: Request) {
        let s = Seq::new(req, self.arrivals, Instant::now(), self.blocks.block_size());
        self.arrivals += 1;
        self.waiting.push(s);
    }

    /// Ends every request with an error, freeing its blocks.
    pub fn abort_all(&mut self, why: &str) {
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
    pub fn drop_abandoned(&mut self) {
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
    pub fn publish(&self) {
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

    /// Plans one step: (index in `running`, tokens to compute) per scheduled request. The plan
    /// is valid until the next call of [`Scheduler::update`] or [`Scheduler::fail`], which take
    /// it back with the step's outputs.
    pub fn schedule(&mut self) -> Plan {
        Plan(self.plan())
    }

    fn plan(&mut self) -> Vec<(usize, usize)> {
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
            let outranks = |e: &Scheduler| {
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

    /// The model's inputs for `plan`: each scheduled request's tokens to compute, where they
    /// start, its block table, and whether its last position's logits are wanted (it catches
    /// up: the next token is drawn from them).
    pub fn inputs(&self, plan: &Plan) -> Vec<SeqInput<'_>> {
        plan.0
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
            .collect()
    }

    /// The step of `plan` failed: each request in it ends with `why` as an error.
    pub fn fail(&mut self, plan: Plan, why: &str) {
        let mut failed: Vec<usize> = plan.0.iter().map(|p| p.0).collect();
        failed.sort_unstable();
        for &i in failed.iter().rev() {
            let mut s = self.running.remove(i);
            let _ = s
                .req
                .events
                .send((s.req.choice, Event::Error(why.to_string())));
            self.blocks.free(&mut s.blocks);
        }
    }

    /// Takes the outputs of `plan`'s step (per request, in plan order, its last position's
    /// logits, or nothing for a prompt chunk that does not reach the end): newly full blocks
    /// enter the prefix cache, requests that caught up draw their next token (from the tokens
    /// their grammar allows), events go out, finished requests leave and free their blocks.
    pub fn update<L>(&mut self, plan: Plan, logits: &[L], tokenizer: &Tokenizer)
    where
        L: AsRef<[f32]>,
    {
        let bs = self.blocks.block_size();
        let mut finished = vec![false; self.running.len()];
        for (&(i, n), logits) in plan.0.iter().zip(logits) {
            let logits: &[f32] = logits.as_ref();
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
            if s.out.generated() == 0 {
                self.metrics
                    .prompt_tokens
                    .fetch_add(s.req.prompt.len() as u64, Ordering::Relaxed);
            }
            let before = s.last_token_at;
            finished[i] = sample_and_emit(tokenizer, s, logits, bs);
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
fn sample_and_emit(tokenizer: &Tokenizer, s: &mut Seq, logits: &[f32], block_size: usize) -> bool {
    // A constrained request draws from the tokens its grammar allows (once the grammar holds:
    // after the reasoning, for a thinking template).
    let holds = s.req.constraint_after.is_none();
    let masked;
    let mut view = logits;
    if let Some(c) = s.req.constraint.as_mut().filter(|_| holds) {
        let mut l = logits.to_vec();
        if let Err(e) = c.mask(&mut l) {
            return fail(s, e.to_string());
        }
        masked = l;
        view = &masked;
    }
    let id = if s.out.holds_eog() {
        // No end of generation yet: those tokens cannot be drawn.
        let mut l = view.to_vec();
        for e in tokenizer.eog_ids() {
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
    if let Some(c) = s.req.constraint.as_mut().filter(|_| holds) {
        if let Err(e) = c.accept(id) {
            return fail(s, e.to_string());
        }
        complete = c.is_complete();
    } else if let Some(marker) = s.req.constraint_after.clone() {
        // Still reasoning: watch for the marker; the grammar holds from the text after it.
        s.recent
            .extend_from_slice(&tokenizer.token_bytes(id, false));
        if let Some(at) = find(&s.recent, marker.as_bytes()) {
            let rest = String::from_utf8_lossy(&s.recent[at + marker.len()..]).into_owned();
            s.req.constraint_after = None;
            s.recent = Vec::new();
            if let Some(c) = s.req.constraint.as_mut() {
                // Text after the marker in the same token is the grammar's first output.
                for t in tokenizer.encode(rest.trim_start(), false, false) {
                    if !c.allows(t).unwrap_or(false) || c.accept(t).is_err() {
                        return fail(s, format!("the answer after {marker} does not start as the grammar allows: {rest:?}"));
                    }
                }
                complete = c.is_complete();
            }
        } else if s.recent.len() > 256 {
            let keep = s.recent.len() - marker.len();
            s.recent.drain(..keep);
        }
    }
    if s.ttft.is_none() {
        s.ttft = Some(s.submitted.elapsed().as_secs_f64());
    }
    let choice = s.req.choice;
    let step = s.out.push(tokenizer, id, complete);
    // An end-of-generation token ends the request without an event of its own.
    if s.req.ignore_eos || !tokenizer.is_eog(id) {
        let logprobs = s
            .req
            .logprobs
            .map(|k| TokenLogprobs::new(tokenizer, logits, id, k));
        let ev = Event::Token {
            text: step.text,
            logprobs,
            token: Some(id),
        };
        if s.req.events.send((choice, ev)).is_err() {
            return true; // the client is gone
        }
    }
    match step.finish {
        None => {
            s.tokens.push(id);
            s.hash_full_blocks(block_size);
            false
        }
        Some(f) => {
            s.finish = Some(f);
            if !step.tail.is_empty() {
                let ev = Event::Token {
                    text: step.tail,
                    logprobs: None,
                    token: None,
                };
                let _ = s.req.events.send((choice, ev));
            }
            let done = Event::Done {
                finish: f,
                prompt_tokens: s.req.prompt.len(),
                completion_tokens: s.out.generated(),
                cached_tokens: s.cached_tokens,
                ttft: s.ttft.unwrap_or(0.0),
            };
            let _ = s.req.events.send((choice, done));
            true
        }
    }
}

/// Where `needle` first occurs in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Ends `s` with an error event (its grammar failed: a step over the parser's bounds); true, as
/// `sample_and_emit` returns for a finished sequence.
fn fail(s: &mut Seq, why: String) -> bool {
    tracing::warn!("request failed while sampling: {why}");
    let _ = s.req.events.send((s.req.choice, Event::Error(why)));
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrum_llm::grammar::{Grammar, Grammars};
    use ferrum_llm::SamplingParams;
    use ferrum_tokenizer::TokenizerSpec;
    use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

    const EOS: u32 = 256;

    /// 256 byte tokens and `<|end|>` (end of text): enough to run the scheduler without a model.
    fn tokenizer() -> Arc<Tokenizer> {
        let mut tokens: Vec<String> = (0..=255u8)
            .map(|b| ferrum_tokenizer::byte_to_char(b).to_string())
            .collect();
        tokens.push("<|end|>".into());
        let spec = TokenizerSpec {
            model: "gpt2".into(),
            pre: Some("gpt2".into()),
            token_types: Some(
                (0..tokens.len())
                    .map(|i| if i == 256 { 3 } else { 1 })
                    .collect(),
            ),
            tokens,
            merges: Some(vec![]),
            eos: Some(EOS),
            ..Default::default()
        };
        Arc::new(Tokenizer::from_spec(spec).unwrap())
    }

    fn config(max_num_seqs: usize, max_batch_tokens: usize, prefix_caching: bool) -> EngineConfig {
        EngineConfig {
            max_num_seqs,
            max_batch_tokens,
            ctx_size: 4096,
            prefix_caching,
        }
    }

    type Events = UnboundedReceiver<(usize, Event)>;

    fn request(prompt: &[u8], max_tokens: usize, priority: i64) -> (Request, Events) {
        let (tx, rx) = unbounded_channel();
        let req = Request {
            prompt: prompt.iter().map(|&b| b as u32).collect(),
            max_tokens,
            sampling: SamplingParams::greedy(),
            stop: vec![],
            ignore_eos: false,
            min_tokens: 0,
            priority,
            logprobs: None,
            choice: 0,
            events: tx,
            constraint: None,
            constraint_after: None,
            completion: None,
        };
        (req, rx)
    }

    /// Made-up logits for a sequence whose next position is `pos`: the letter `'a' + pos % 26`
    /// wins, so a sequence's tokens depend on nothing but its own length.
    fn letter_logits(pos: usize) -> Vec<f32> {
        let mut l = vec![0.0; 257];
        l[b'a' as usize + pos % 26] = 5.0;
        l
    }

    /// One step with `logits(pos)` for each request that catches up; the plan.
    fn step(s: &mut Scheduler, tok: &Tokenizer, logits: &dyn Fn(usize) -> Vec<f32>) -> Plan {
        let plan = s.schedule();
        let outs: Vec<Vec<f32>> = s
            .inputs(&plan)
            .iter()
            .map(|i| match i.want {
                Logits::Last => logits(i.start + i.tokens.len()),
                _ => Vec::new(),
            })
            .collect();
        s.update(plan.clone(), &outs, tok);
        s.publish();
        plan
    }

    /// Everything a request's events say: its text, and how it finished.
    fn drain(rx: &mut Events) -> (String, Option<(FinishReason, usize, usize)>) {
        let mut text = String::new();
        let mut done = None;
        while let Ok((_, e)) = rx.try_recv() {
            match e {
                Event::Token { text: t, .. } => text.push_str(&t),
                Event::Done {
                    finish,
                    completion_tokens,
                    cached_tokens,
                    ..
                } => done = Some((finish, completion_tokens, cached_tokens)),
                Event::Error(e) => panic!("error event: {e}"),
            }
        }
        (text, done)
    }

    /// What `letter_logits` makes a request with a prompt of `n` tokens write in `k` tokens.
    fn letters(n: usize, k: usize) -> String {
        (n..n + k)
            .map(|p| (b'a' + (p % 26) as u8) as char)
            .collect()
    }

    #[test]
    fn continuous_batching_under_the_token_budget() {
        let tok = tokenizer();
        let m = Arc::new(Metrics::default());
        let mut s = Scheduler::new(config(2, 8, false), 64, 4, Arc::clone(&m));
        let mut rxs = Vec::new();
        for _ in 0..3 {
            let (r, rx) = request(b"0123456789", 3, 0);
            s.add(r);
            rxs.push(rx);
        }
        // Prompts go in chunks under the budget of 8; two slots.
        assert_eq!(step(&mut s, &tok, &letter_logits).0, vec![(0, 8)]);
        assert_eq!(step(&mut s, &tok, &letter_logits).0, vec![(0, 2), (1, 6)]);
        assert_eq!(s.counts(), (1, 2));
        // Request 0 decodes one token a step beside request 1's prompt.
        assert_eq!(step(&mut s, &tok, &letter_logits).0, vec![(0, 1), (1, 4)]);
        let mut steps = 3;
        while !s.is_idle() {
            let plan = step(&mut s, &tok, &letter_logits);
            assert!(plan.0.iter().map(|p| p.1).sum::<usize>() <= 8);
            assert!(plan.0.len() <= 2);
            steps += 1;
            assert!(steps < 50, "does not finish");
        }
        for mut rx in rxs {
            let (text, done) = drain(&mut rx);
            assert_eq!(text, letters(10, 3));
            assert_eq!(done, Some((FinishReason::Length, 3, 0)));
        }
        assert_eq!(m.kv_blocks_used.load(Ordering::Relaxed), 0);
        assert_eq!(m.finished_length.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn end_tokens_and_stop_strings_finish() {
        let tok = tokenizer();
        let m = Arc::new(Metrics::default());
        let mut s = Scheduler::new(config(4, 64, false), 64, 4, m);
        // The end token at once: done by stop, no text.
        let (a, mut ra) = request(b"hello", 10, 0);
        s.add(a);
        let eos = |_: usize| {
            let mut l = vec![0.0; 257];
            l[EOS as usize] = 1.0;
            l
        };
        while !s.is_idle() {
            step(&mut s, &tok, &eos);
        }
        assert_eq!(
            drain(&mut ra),
            (String::new(), Some((FinishReason::Stop, 1, 0)))
        );
        // A stop string: the text before it, nothing after.
        let (mut b, mut rb) = request(b"0123", 20, 0); // writes "efghij..."
        b.stop = vec!["gh".into()];
        s.add(b);
        while !s.is_idle() {
            step(&mut s, &tok, &letter_logits);
        }
        assert_eq!(
            drain(&mut rb),
            ("ef".into(), Some((FinishReason::Stop, 4, 0)))
        );
        // min_tokens keeps the end token out of the draw.
        let (mut c, mut rc) = request(b"x", 10, 0);
        c.min_tokens = 2;
        s.add(c);
        let eos_then_b = |_: usize| {
            let mut l = vec![0.0; 257];
            l[EOS as usize] = 2.0;
            l[b'b' as usize] = 1.0;
            l
        };
        while !s.is_idle() {
            step(&mut s, &tok, &eos_then_b);
        }
        assert_eq!(
            drain(&mut rc),
            ("bb".into(), Some((FinishReason::Stop, 3, 0)))
        );
    }

    #[test]
    fn preempted_requests_resume_where_they_stopped() {
        let tok = tokenizer();
        let m = Arc::new(Metrics::default());
        // 6 blocks of 4 positions: two requests growing to 5 + 12 tokens cannot both fit.
        let mut s = Scheduler::new(config(4, 64, false), 6, 4, Arc::clone(&m));
        let (a, mut ra) = request(b"AAAAA", 12, 0);
        let (b, mut rb) = request(b"BBBBB", 12, 1);
        s.add(a);
        s.add(b);
        let mut steps = 0;
        while !s.is_idle() {
            step(&mut s, &tok, &letter_logits);
            steps += 1;
            assert!(steps < 200, "does not finish");
        }
        assert!(m.preemptions.load(Ordering::Relaxed) > 0, "no preemption");
        // Each wrote exactly what it writes alone.
        for rx in [&mut ra, &mut rb] {
            assert_eq!(
                drain(rx),
                (letters(5, 12), Some((FinishReason::Length, 12, 0)))
            );
        }
        assert_eq!(m.kv_blocks_used.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn better_priority_takes_a_running_slot() {
        let tok = tokenizer();
        let m = Arc::new(Metrics::default());
        let mut s = Scheduler::new(config(1, 64, false), 64, 4, Arc::clone(&m));
        let (low, mut rlow) = request(b"low", 6, 5);
        s.add(low);
        step(&mut s, &tok, &letter_logits);
        let (high, mut rhigh) = request(b"high", 2, -5);
        s.add(high);
        // The next step runs the better-priority request alone, in the only slot.
        let plan = step(&mut s, &tok, &letter_logits);
        assert_eq!(plan.0, vec![(0, 4)]);
        assert_eq!(s.counts(), (1, 1));
        while !s.is_idle() {
            step(&mut s, &tok, &letter_logits);
        }
        let (t, d) = drain(&mut rhigh);
        assert_eq!((t.as_str(), d), ("ef", Some((FinishReason::Length, 2, 0))));
        let (t, d) = drain(&mut rlow);
        assert_eq!(t, letters(3, 6));
        assert_eq!(d.map(|d| d.0), Some(FinishReason::Length));
        assert_eq!(m.preemptions.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_repeated_prompt_comes_from_the_prefix_cache() {
        let tok = tokenizer();
        let m = Arc::new(Metrics::default());
        let mut s = Scheduler::new(config(4, 64, true), 64, 4, Arc::clone(&m));
        let prompt = b"The same long system prompt, twice.";
        for expect_cached in [0, 32] {
            let (r, mut rx) = request(prompt, 2, 0);
            s.add(r);
            while !s.is_idle() {
                step(&mut s, &tok, &letter_logits);
            }
            let (_, done) = drain(&mut rx);
            assert_eq!(done, Some((FinishReason::Length, 2, expect_cached)));
        }
        assert_eq!(m.prefix_hits.load(Ordering::Relaxed), 32);
    }

    #[test]
    fn abandoned_requests_free_their_blocks() {
        let tok = tokenizer();
        let m = Arc::new(Metrics::default());
        let mut s = Scheduler::new(config(4, 64, false), 64, 4, Arc::clone(&m));
        let (r, rx) = request(b"a prompt of some length", 100, 0);
        s.add(r);
        step(&mut s, &tok, &letter_logits);
        assert!(m.kv_blocks_used.load(Ordering::Relaxed) > 0);
        drop(rx);
        s.drop_abandoned();
        s.publish();
        assert!(s.is_idle());
        assert_eq!(m.kv_blocks_used.load(Ordering::Relaxed), 0);
        assert_eq!(m.finished_abort.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn the_completion_wait_ends_when_the_last_request_is_dropped() {
        use crate::engine::Completion;
        use std::time::Duration;
        let tok = tokenizer();
        let mut s = Scheduler::new(config(4, 64, false), 64, 4, Arc::new(Metrics::default()));
        let (guard, wait) = Completion::group();
        // One request runs to its length, one is abandoned by its client part way.
        let (mut a, mut ra) = request(b"first", 3, 0);
        let (mut b, rb) = request(b"second prompt", 50, 0);
        a.completion = Some(guard.clone());
        b.completion = Some(guard.clone());
        drop(guard);
        s.add(a);
        s.add(b);
        step(&mut s, &tok, &letter_logits);
        assert!(!wait.wait(Duration::from_millis(1)), "both still run");
        while drain_nonblocking(&mut ra) {
            step(&mut s, &tok, &letter_logits);
        }
        assert!(
            !wait.wait(Duration::from_millis(1)),
            "the second still runs"
        );
        drop(rb);
        s.drop_abandoned();
        assert!(wait.wait(Duration::from_secs(5)), "every guard is dropped");
    }

    /// Whether `rx`'s request is still going (no `Done` among the events waiting in it).
    fn drain_nonblocking(rx: &mut Events) -> bool {
        while let Ok((_, ev)) = rx.try_recv() {
            if matches!(ev, Event::Done { .. }) {
                return false;
            }
        }
        true
    }

    #[test]
    fn a_grammar_holds_the_draw_and_ends_the_request() {
        let tok = tokenizer();
        let g = Grammars::new(Arc::clone(&tok)).unwrap();
        let m = Arc::new(Metrics::default());
        let mut s = Scheduler::new(config(4, 64, false), 64, 4, m);
        // Logits that want "zzzz..." and never the end: the grammar decides.
        let z = |_: usize| {
            let mut l: Vec<f32> = (0..257).map(|i| i as f32 / 1000.0).collect();
            l[b'z' as usize] = 9.0;
            l
        };
        let (mut a, mut ra) = request(b"pick", 50, 0);
        a.constraint = Some(
            g.compile(&Grammar::Choice(vec!["yes".into(), "no".into()]))
                .unwrap(),
        );
        let (b, mut rb) = request(b"free", 3, 0);
        s.add(a);
        s.add(b);
        while !s.is_idle() {
            step(&mut s, &tok, &z);
        }
        // Among "yes" and "no" the logits prefer 'y' (121) to 'n' (110).
        assert_eq!(
            drain(&mut ra),
            ("yes".into(), Some((FinishReason::Stop, 3, 0)))
        );
        assert_eq!(
            drain(&mut rb),
            ("zzz".into(), Some((FinishReason::Length, 3, 0)))
        );
    }
    /// A thinking template's request: the model reasons freely, and the grammar holds from the
    /// text after `</think>` (here within the same token as the marker, then on).
    #[test]
    fn a_grammar_holds_after_the_reasoning() {
        let tok = tokenizer();
        let g = Grammars::new(Arc::clone(&tok)).unwrap();
        let m = Arc::new(Metrics::default());
        let mut s = Scheduler::new(config(4, 64, false), 64, 4, m);
        let (mut a, mut ra) = request(b"q", 50, 0);
        a.constraint = Some(
            g.compile(&Grammar::Choice(vec!["yes".into(), "no".into()]))
                .unwrap(),
        );
        a.constraint_after = Some("</think>".into());
        s.add(a);
        // Spells "hm</think>" from the first generated position (1), then wants 'z' forever.
        let script = b"hm</think>";
        let spell = |pos: usize| {
            let mut l: Vec<f32> = (0..257).map(|i| i as f32 / 1000.0).collect();
            let want = script.get(pos - 1).copied().unwrap_or(b'z');
            l[want as usize] = 9.0;
            l
        };
        while !s.is_idle() {
            step(&mut s, &tok, &spell);
        }
        // Free text through the marker ('<' and 'h' would be refused by the grammar), then
        // the grammar's choice.
        let (text, done) = drain(&mut ra);
        assert_eq!(text, "hm</think>yes");
        assert_eq!(done.map(|d| d.0), Some(FinishReason::Stop));
    }
}
