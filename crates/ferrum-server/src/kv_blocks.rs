//! Which KV blocks each sequence holds, and the prefix cache.
//!
//! The pool's blocks are reference-counted. A sequence's block table grows as its tokens are
//! computed and is freed when it finishes, is aborted or is preempted. With prefix caching, a
//! block that is full of computed tokens is registered under the hash of its whole token prefix
//! (the parent block's hash and its own tokens), so a later sequence whose tokens start the same
//! way takes those blocks as they are, without copying or recomputing them.
//!
//! Free blocks (reference count 0) wait in a queue in the order they were freed, and new blocks
//! are taken from its front (least recently used first). A free block keeps its cached contents
//! until it is taken: until then a lookup may bring it back. Sequences free their blocks last block
//! first, so a prefix shared by many outlives the tails that were used once.
//!
//! Only full blocks are shared, so a sequence never writes into a block another one reads.
//!
//! A sequence's fresh blocks are kept adjacent where the pool allows (attention then reads its
//! keys and values as one stream; interleaved blocks measured ~5% slower decode at a batch of 8):
//! a sequence starting fresh reserves an extent of up to [`EXTENT`] consecutive free blocks that
//! cache nothing (already committed ones first) and grows into it; past it, it takes the next
//! block if that is free and caches nothing; else the free queue's front as before. Reserved
//! blocks leave the free queue (no other sequence takes them) but count as free: an allocation
//! that finds the queue short releases every reservation first. A sequence's unused reservation
//! is released when it frees its blocks.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

/// Content hash of a full block: its tokens and, through the parent's hash, every token before it.
/// 128 bits (two independent SipHash states) so collisions are not a concern.
pub type BlockHash = u128;

/// The hash of the block holding `tokens` (a full block), after the block hashed `parent`.
pub fn block_hash(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let half = |domain: u8| {
        let mut h = DefaultHasher::new();
        domain.hash(&mut h);
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    };
    (u128::from(half(1)) << 64) | u128::from(half(2))
}

const NIL: u32 = u32::MAX;

/// Most blocks a sequence reserves ahead when it starts (512 positions at 16 per block).
pub const EXTENT: usize = 32;

/// Free blocks in least-recently-freed order: a doubly linked list threaded through two arrays,
/// so a block can leave from anywhere (a cache hit on a free block) in O(1).
struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
    queued: Vec<bool>,
}

impl FreeQueue {
    fn new(n: usize) -> Self {
        let mut q = FreeQueue {
            prev: vec![NIL; n],
            next: vec![NIL; n],
            head: NIL,
            tail: NIL,
            len: 0,
            queued: vec![false; n],
        };
        for b in 0..n as u32 {
            q.push_back(b);
        }
        q
    }

    fn push_back(&mut self, b: u32) {
        debug_assert!(!self.queued[b as usize]);
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.queued[b as usize] = true;
        self.len += 1;
    }

    fn push_front(&mut self, b: u32) {
        debug_assert!(!self.queued[b as usize]);
        self.next[b as usize] = self.head;
        self.prev[b as usize] = NIL;
        if self.head == NIL {
            self.tail = b;
        } else {
            self.prev[self.head as usize] = b;
        }
        self.head = b;
        self.queued[b as usize] = true;
        self.len += 1;
    }

    fn remove(&mut self, b: u32) {
        debug_assert!(self.queued[b as usize]);
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.queued[b as usize] = false;
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.remove(b);
        Some(b)
    }
}

pub struct BlockManager {
    block_size: usize,
    ref_cnt: Vec<u32>,
    /// The hash a block is registered under while its contents are cached.
    hash: Vec<Option<BlockHash>>,
    cached: HashMap<BlockHash, u32>,
    free: FreeQueue,
    prefix_caching: bool,
    /// Whether each block was ever handed out (its memory is then committed), and how many.
    touched: Vec<bool>,
    n_touched: usize,
    /// The extent (its first block) each block was reserved in, `NIL` for none.
    owner: Vec<u32>,
    /// Whether each block is reserved and not yet taken (it is then out of the free queue).
    reserved: Vec<bool>,
    n_reserved: usize,
}

impl BlockManager {
    pub fn new(n_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        BlockManager {
            block_size,
            ref_cnt: vec![0; n_blocks],
            hash: vec![None; n_blocks],
            cached: HashMap::new(),
            free: FreeQueue::new(n_blocks),
            prefix_caching,
            touched: vec![false; n_blocks],
            n_touched: 0,
            owner: vec![NIL; n_blocks],
            reserved: vec![false; n_blocks],
            n_reserved: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn n_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    /// Blocks no sequence holds (cached and reserved ones included: they can be taken).
    pub fn n_free(&self) -> usize {
        self.free.len + self.n_reserved
    }

    pub fn n_used(&self) -> usize {
        self.n_blocks() - self.n_free()
    }

    /// Blocks ever handed out: the pool's memory the OS has committed.
    pub fn n_committed(&self) -> usize {
        self.n_touched
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// The cached blocks of the longest run of leading `hashes` (one per full block of a
    /// sequence's tokens) found in the cache. Changes nothing: [`BlockManager::allocate`] takes them.
    pub fn lookup(&self, hashes: &[BlockHash]) -> Vec<u32> {
        if !self.prefix_caching {
            return Vec::new();
        }
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }

    /// Grows `blocks` (a sequence's table) to hold `n_tokens` positions: first the cached `hits`
    /// (from [`BlockManager::lookup`], for a sequence that holds no block yet), then fresh blocks
    /// from the front of the free queue, evicting whatever they cached. Returns false, changing
    /// nothing, when there are not enough free blocks.
    pub fn allocate(&mut self, blocks: &mut Vec<u32>, hits: &[u32], n_tokens: usize) -> bool {
        debug_assert!(hits.is_empty() || blocks.is_empty());
        let need = n_tokens
            .div_ceil(self.block_size)
            .saturating_sub(blocks.len() + hits.len());
        let hits_free = hits
            .iter()
            .filter(|&&b| self.ref_cnt[b as usize] == 0)
            .count();
        if need + hits_free > self.free.len + self.own_reserved(blocks) {
            if need + hits_free > self.n_free() {
                return false;
            }
            self.release_all();
        }
        for &b in hits {
            if self.ref_cnt[b as usize] == 0 {
                self.free.remove(b);
            }
            self.ref_cnt[b as usize] += 1;
            blocks.push(b);
        }
        for i in 0..need {
            let b = self.next_block(blocks.last().copied(), need - i);
            if let Some(h) = self.hash[b as usize].take() {
                if self.cached.get(&h) == Some(&b) {
                    self.cached.remove(&h);
                }
            }
            self.ref_cnt[b as usize] = 1;
            if !std::mem::replace(&mut self.touched[b as usize], true) {
                self.n_touched += 1;
            }
            blocks.push(b);
        }
        true
    }

    /// Reserved blocks right after `blocks`' last one in its extent (what it may still take).
    fn own_reserved(&self, blocks: &[u32]) -> usize {
        let Some(&l) = blocks.last() else { return 0 };
        let o = self.owner[l as usize];
        if o == NIL {
            return 0;
        }
        (l as usize + 1..self.n_blocks())
            .take_while(|&c| self.reserved[c] && self.owner[c] == o)
            .count()
    }

    /// The block a sequence whose last block is `last` takes next, out of the free queue or its
    /// reservation (`want`: how many it is taking now, this one included).
    fn next_block(&mut self, last: Option<u32>, want: usize) -> u32 {
        if let Some(l) = last {
            let (l, c) = (l as usize, l as usize + 1);
            if c < self.n_blocks() {
                if self.reserved[c] && self.owner[c] == self.owner[l] && self.owner[l] != NIL {
                    self.reserved[c] = false;
                    self.n_reserved -= 1;
                    return c as u32;
                }
                if self.free.queued[c] && self.hash[c].is_none() {
                    self.free.remove(c as u32);
                    self.owner[c] = self.owner[l];
                    return c as u32;
                }
            }
        }
        if let Some(start) = self.reserve_extent(want) {
            return start;
        }
        let b = self
            .free
            .pop_front()
            .expect("the free queue holds enough blocks (checked by allocate)");
        self.owner[b as usize] = NIL;
        b
    }

    /// Reserves the first run of at least `want` consecutive free blocks that cache nothing
    /// (among committed blocks first, then any), up to [`EXTENT`] blocks, and takes its first
    /// block. None if there is no such run.
    fn reserve_extent(&mut self, want: usize) -> Option<u32> {
        let n = self.n_blocks();
        let usable = |m: &Self, b: usize, committed: bool| {
            m.free.queued[b] && m.hash[b].is_none() && (!committed || m.touched[b])
        };
        for committed in [true, false] {
            let mut b = 0;
            while b < n {
                if !usable(self, b, committed) {
                    b += 1;
                    continue;
                }
                let start = b;
                while b < n && b - start < EXTENT.max(want) && usable(self, b, committed) {
                    b += 1;
                }
                if b - start >= want {
                    for c in start..b {
                        self.free.remove(c as u32);
                        self.owner[c] = start as u32;
                        self.reserved[c] = c != start;
                    }
                    self.n_reserved += b - start - 1;
                    return Some(start as u32);
                }
            }
        }
        None
    }

    /// Puts reserved block `c` back at the front of the free queue.
    fn unreserve(&mut self, c: usize) {
        debug_assert!(self.reserved[c]);
        self.reserved[c] = false;
        self.owner[c] = NIL;
        self.n_reserved -= 1;
        self.free.push_front(c as u32);
    }

    /// Releases every reservation (the free queue alone was short).
    fn release_all(&mut self) {
        for c in (0..self.n_blocks()).rev() {
            if self.reserved[c] {
                self.unreserve(c);
            }
        }
    }

    /// Gives back every block of `blocks`, last first, and empties it, with the rest of its
    /// reservation. Blocks no other sequence holds join the free queue: at the back with their
    /// cached contents (evicted least recently freed first), or at the front when they cache
    /// nothing, so they are taken again before blocks never used (whose memory the OS has not
    /// committed yet: the pool's footprint then grows only as the prefix cache fills).
    pub fn free(&mut self, blocks: &mut Vec<u32>) {
        if let Some(&l) = blocks.last() {
            if self.ref_cnt[l as usize] == 1 {
                let k = self.own_reserved(blocks);
                for c in (l as usize + 1..l as usize + 1 + k).rev() {
                    self.unreserve(c);
                }
            }
        }
        for b in blocks.drain(..).rev() {
            let r = &mut self.ref_cnt[b as usize];
            debug_assert!(*r > 0, "block {b} freed twice");
            *r = r.saturating_sub(1);
            if *r == 0 {
                self.owner[b as usize] = NIL;
                if self.hash[b as usize].is_some() {
                    self.free.push_back(b);
                } else {
                    self.free.push_front(b);
                }
            }
        }
    }

    /// Records that block `b` is full of computed tokens whose prefix hashes to `hash`, so later
    /// sequences starting with the same tokens may share it.
    pub fn cache_full(&mut self, b: u32, hash: BlockHash) {
        if !self.prefix_caching || self.hash[b as usize].is_some() {
            return;
        }
        self.hash[b as usize] = Some(hash);
        // Another block may hold the same contents (two sequences computed it at once): the
        // first stays the one lookups find; this one is dropped from the cache when evicted.
        self.cached.entry(hash).or_insert(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(tokens: &[u32], bs: usize) -> Vec<BlockHash> {
        let mut out: Vec<BlockHash> = Vec::new();
        for c in tokens.chunks_exact(bs) {
            out.push(block_hash(out.last().copied(), c));
        }
        out
    }

    #[test]
    fn hashes_chain_through_the_prefix() {
        let a = hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        let b = hashes(&[9, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(a.len(), 2);
        assert_ne!(a[0], b[0]);
        // Same second block, different prefix: different hash.
        assert_ne!(a[1], b[1]);
        assert_eq!(a, hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4));
    }

    #[test]
    fn shared_prefix_blocks_are_reused_and_evicted_last() {
        let mut m = BlockManager::new(6, 4, true);
        let toks: Vec<u32> = (0..10).collect();
        let h = hashes(&toks, 4);
        let mut a = Vec::new();
        assert!(m.allocate(&mut a, &[], 10));
        assert_eq!(a.len(), 3);
        m.cache_full(a[0], h[0]);
        m.cache_full(a[1], h[1]);
        // A second sequence with the same first 8 tokens shares two blocks.
        let hits = m.lookup(&h);
        assert_eq!(hits, vec![a[0], a[1]]);
        let mut b = Vec::new();
        assert!(m.allocate(&mut b, &hits, 10));
        assert_eq!(&b[..2], &a[..2]);
        assert_ne!(b[2], a[2]);
        assert_eq!(m.n_used(), 4);
        m.free(&mut a);
        m.free(&mut b);
        assert_eq!(m.n_used(), 0);
        // Still cached after both finished.
        assert_eq!(m.lookup(&h).len(), 2);
        // Taking 4 fresh blocks uses the never-cached ones and the tails first.
        let mut c = Vec::new();
        assert!(m.allocate(&mut c, &[], 16));
        assert_eq!(
            m.lookup(&h).len(),
            2,
            "the shared prefix outlives the tails"
        );
        let mut d = Vec::new();
        assert!(m.allocate(&mut d, &[], 8));
        assert_eq!(m.lookup(&h).len(), 0, "evicted once its blocks were taken");
        assert!(!m.allocate(&mut d, &[], 12), "only 6 blocks");
        assert_eq!(d.len(), 2, "a failed allocation changes nothing");
    }

    #[test]
    fn uncached_blocks_are_reused_before_never_used_ones() {
        // Never-used blocks cost memory the OS has not committed yet: a block that caches
        // nothing is taken again first, a cached one only after the never-used ones.
        let mut m = BlockManager::new(8, 4, true);
        let mut a = Vec::new();
        assert!(m.allocate(&mut a, &[], 12));
        assert_eq!(a, [0, 1, 2]);
        m.cache_full(a[0], hashes(&[7, 7, 7, 7], 4)[0]);
        m.free(&mut a);
        let mut b = Vec::new();
        assert!(m.allocate(&mut b, &[], 12));
        assert_eq!(&b[..2], &[1, 2], "the uncached blocks first");
        assert_eq!(b[2], 3, "then never-used ones, keeping the cached block 0");
        assert_eq!(m.n_committed(), 4);
        assert_eq!(m.lookup(&hashes(&[7, 7, 7, 7], 4)), [0]);
    }

    /// Sequences started together, then growing a block at a time in turn (a batch decoding),
    /// each keep their blocks adjacent; a long one runs past its extent into the next free
    /// blocks; a sequence that needs more than the queue holds gets the others' reservations.
    #[test]
    fn sequences_started_together_keep_adjacent_blocks() {
        let mut m = BlockManager::new(512, 4, true);
        let mut seqs: Vec<Vec<u32>> = (0..8).map(|_| Vec::new()).collect();
        for s in seqs.iter_mut() {
            assert!(m.allocate(s, &[], 8));
        }
        for step in 1..=20 {
            for s in seqs.iter_mut() {
                assert!(m.allocate(s, &[], 8 + 4 * step));
            }
        }
        for s in &seqs {
            assert_eq!(s.len(), 22);
            assert!(
                s.windows(2).all(|w| w[1] == w[0] + 1),
                "not adjacent: {s:?}"
            );
        }
        assert_eq!(m.n_used(), 8 * 22);
        // Past the extent (32 blocks): still adjacent while the next blocks are free.
        let mut long = Vec::new();
        assert!(m.allocate(&mut long, &[], 4));
        assert!(m.allocate(&mut long, &[], 4 * 40));
        assert!(long.windows(2).all(|w| w[1] == w[0] + 1), "{long:?}");
        for s in seqs.iter_mut() {
            m.free(s);
        }
        m.free(&mut long);
        assert_eq!((m.n_used(), m.n_free()), (0, 512));

        // A small pool: one sequence's reservation does not starve another.
        let mut m = BlockManager::new(16, 4, false);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        assert!(m.allocate(&mut a, &[], 4));
        assert_eq!(m.n_used(), 1);
        assert!(
            m.allocate(&mut b, &[], 4 * 15),
            "the reservation is given up"
        );
        assert_eq!(m.n_used(), 16);
        assert!(!m.allocate(&mut a, &[], 8), "nothing left");
        assert_eq!(a.len(), 1, "a failed allocation changes nothing");
        m.free(&mut a);
        m.free(&mut b);
        assert_eq!((m.n_used(), m.n_free()), (0, 16));
    }

    #[test]
    fn without_prefix_caching_nothing_is_shared() {
        let mut m = BlockManager::new(4, 4, false);
        let h = hashes(&[1, 2, 3, 4], 4);
        let mut a = Vec::new();
        assert!(m.allocate(&mut a, &[], 4));
        m.cache_full(a[0], h[0]);
        assert!(m.lookup(&h).is_empty());
    }

    #[test]
    fn random_operations_keep_the_counts_consistent() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut m = BlockManager::new(32, 4, true);
        let mut seqs: Vec<(Vec<u32>, Vec<BlockHash>)> = Vec::new();
        for _ in 0..2000 {
            if !seqs.is_empty() && rng.gen_bool(0.3) {
                // A sequence grows (its hashes stay those of its first blocks).
                let i = rng.gen_range(0..seqs.len());
                let n = seqs[i].0.len() * 4 + rng.gen_range(1..9);
                let before = seqs[i].0.clone();
                if !m.allocate(&mut seqs[i].0, &[], n) {
                    assert_eq!(
                        seqs[i].0, before,
                        "seed {seed}: a failed allocation changed"
                    );
                }
            } else if rng.gen_bool(0.5) || seqs.is_empty() {
                // A new sequence with one of a few prefixes.
                let p = rng.gen_range(0..3u32);
                let toks: Vec<u32> = (0..rng.gen_range(1..20)).map(|i| p * 100 + i).collect();
                let h = hashes(&toks, 4);
                let hits = m.lookup(&h);
                let mut blocks = Vec::new();
                if m.allocate(&mut blocks, &hits, toks.len()) {
                    for (i, &b) in blocks.iter().enumerate().take(h.len()) {
                        m.cache_full(b, h[i]);
                    }
                    seqs.push((blocks, h));
                }
            } else {
                let i = rng.gen_range(0..seqs.len());
                let (mut blocks, _) = seqs.swap_remove(i);
                m.free(&mut blocks);
            }
            let held: usize = {
                let mut all: Vec<u32> = seqs.iter().flat_map(|s| s.0.iter().copied()).collect();
                all.sort_unstable();
                all.dedup();
                all.len()
            };
            assert_eq!(m.n_used(), held, "seed {seed}");
            let reserved = m.reserved.iter().filter(|&&r| r).count();
            assert_eq!(m.n_reserved, reserved, "seed {seed}");
            assert_eq!(m.free.len + reserved + held, 32, "seed {seed}");
            // Every cached hash still names a block with those contents.
            for (blocks, h) in &seqs {
                for (b, hh) in blocks.iter().zip(h) {
                    if let Some(&c) = m.cached.get(hh) {
                        assert_eq!(m.hash[c as usize], Some(*hh), "seed {seed}");
                    }
                    assert!(m.ref_cnt[*b as usize] > 0, "seed {seed}");
                }
            }
        }
        for (mut b, _) in seqs {
            m.free(&mut b);
        }
        assert_eq!(m.n_used(), 0);
    }
}
