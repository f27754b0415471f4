//! SentencePiece-style BPE (`tokenizer.ggml.model = "llama"`), as llama.cpp runs it.
//!
//! The fragment (spaces already replaced by `▁`) is split into UTF-8 characters. Every
//! adjacent pair whose concatenation is a vocab entry goes into a max-heap keyed by that
//! entry's score (ties: smaller left index first). Popping the best pair merges it, unless it
//! is stale, and queues the two new neighbour pairs. Finally each symbol is emitted as its
//! token, or — when it is not in the vocab, which only happens for single characters that never
//! merged — as one byte token `<0xNN>` per UTF-8 byte.
//!
//! (llama.cpp also keeps a "reverse merge" map to re-split symbols that are not tokens; since a
//! pair is only ever merged when its concatenation is a token, every merged symbol is a token
//! and that path reduces to the byte fallback implemented here.)

use std::collections::BinaryHeap;

use crate::symbols::{char_symbols, Sym};

/// A candidate merge; `Ord` pops the highest score first, then the smallest left index.
struct Cand {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Cand {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == std::cmp::Ordering::Equal
    }
}
impl Eq for Cand {}
impl Ord for Cand {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        // partial_cmp so that -0.0 == 0.0, as in C++
        self.score
            .partial_cmp(&o.score)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(o.left.cmp(&self.left))
    }
}
impl PartialOrd for Cand {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// Tokenizes one escaped fragment and appends the ids.
///
/// `lookup` maps text to `(id, score)`; `byte_token` maps a byte to its byte-fallback token.
pub(crate) fn encode(
    text: &str,
    lookup: &dyn Fn(&str) -> Option<(u32, f32)>,
    byte_token: &dyn Fn(u8) -> Option<u32>,
    out: &mut Vec<u32>,
) {
    if text.is_empty() {
        return;
    }
    let n = text.chars().count();
    let mut syms = char_symbols(text);
    let mut heap = BinaryHeap::with_capacity(n);
    let try_add =
        |heap: &mut BinaryHeap<Cand>, syms: &[Sym], l: Option<usize>, r: Option<usize>| {
            let (Some(l), Some(r)) = (l, r) else { return };
            let start = syms[l].start;
            let size = syms[l].len + syms[r].len;
            if let Some((_, score)) = lookup(&text[start..start + size]) {
                heap.push(Cand {
                    score,
                    left: l,
                    right: r,
                    size,
                });
            }
        };
    for i in 1..n {
        try_add(&mut heap, &syms, Some(i - 1), Some(i));
    }
    while let Some(c) = heap.pop() {
        let (l, r) = (syms[c.left], syms[c.right]);
        if l.len == 0 || r.len == 0 || l.len + r.len != c.size {
            continue;
        }
        syms[c.left].len += r.len;
        syms[c.left].next = r.next;
        syms[c.right].len = 0;
        if let Some(nx) = r.next {
            syms[nx].prev = Some(c.left);
        }
        try_add(&mut heap, &syms, syms[c.left].prev, Some(c.left));
        try_add(&mut heap, &syms, Some(c.left), syms[c.left].next);
    }
    let mut i = Some(0);
    while let Some(k) = i {
        let s = syms[k];
        let t = &text[s.start..s.start + s.len];
        match lookup(t) {
            Some((id, _)) => out.push(id),
            None => out.extend(t.bytes().filter_map(byte_token)),
        }
        i = s.next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn highest_score_first() {
        // "abc": "ab" scores higher than "bc", and "abc" exists.
        let v: HashMap<&str, (u32, f32)> = [
            ("a", (0, -1.0)),
            ("b", (1, -1.0)),
            ("c", (2, -1.0)),
            ("ab", (3, -2.0)),
            ("bc", (4, -3.0)),
            ("abc", (5, -4.0)),
        ]
        .into_iter()
        .collect();
        let lookup = |s: &str| v.get(s).copied();
        let bytes = |b: u8| Some(100 + u32::from(b));
        let mut out = vec![];
        encode("abc", &lookup, &bytes, &mut out);
        assert_eq!(out, [5]);
        out.clear();
        encode("bcx", &lookup, &bytes, &mut out);
        assert_eq!(out, [4, 100 + u32::from(b'x')]);
        out.clear();
        encode("é", &lookup, &bytes, &mut out);
        assert_eq!(out, [100 + 0xC3, 100 + 0xA9]);
    }
}
