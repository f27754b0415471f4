//! Byte-level BPE (GPT-2 style, `tokenizer.ggml.model = "gpt2"`).
//!
//! Each pre-tokenized word is byte-encoded (every UTF-8 byte becomes one printable code point
//! through the GPT-2 byte-to-unicode map), split into code points, and merged pairwise: the
//! adjacent pair with the lowest merge rank goes first, ties to the leftmost pair, stale queue
//! entries are skipped. Each final symbol is looked up in the vocab; a symbol that is not a
//! token is emitted as one byte token per byte-encoded character (llama.cpp instead looks up
//! each raw UTF-8 byte of the symbol, which loses the non-ASCII ones; with a complete byte
//! alphabet in the vocab, as every real GPT-2 style vocab has, neither path is ever taken).

use std::collections::{BinaryHeap, HashMap};
use std::sync::OnceLock;

use crate::{Error, Result};

use crate::symbols::{char_symbols, Sym};

/// The GPT-2 byte-to-unicode map: printable Latin-1 bytes (0x21-0x7E, 0xA1-0xAC, 0xAE-0xFF)
/// map to themselves; the other 68 bytes map, in increasing order, to U+0100, U+0101, ...
pub fn byte_to_char(b: u8) -> char {
    byte_tables().0[b as usize]
}

/// The inverse of [`byte_to_char`]; `None` for code points outside the 256-entry alphabet.
pub fn char_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    let idx = usize::try_from(cp).ok()?;
    byte_tables().1.get(idx).copied().flatten()
}

fn byte_tables() -> &'static ([char; 256], Vec<Option<u8>>) {
    static T: OnceLock<([char; 256], Vec<Option<u8>>)> = OnceLock::new();
    T.get_or_init(|| {
        let printable =
            |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        let mut fwd = ['\0'; 256];
        let mut n = 0;
        for b in 0..256u32 {
            let cp = if printable(b) {
                b
            } else {
                n += 1;
                255 + n
            };
            fwd[b as usize] = char::from_u32(cp).expect("valid code point");
        }
        let mut inv = vec![None; 0x144];
        for (b, &c) in fwd.iter().enumerate() {
            inv[c as usize] = Some(b as u8);
        }
        (fwd, inv)
    })
}

/// Byte-encodes `s`: each UTF-8 byte becomes its GPT-2 code point.
pub fn byte_encode(s: &str) -> String {
    s.bytes().map(byte_to_char).collect()
}

/// The merge table: `(left, right) -> rank`, keyed by a length-prefixed concatenation so a
/// lookup needs no allocation beyond a reused buffer.
pub(crate) struct Merges {
    ranks: HashMap<String, u32>,
}

fn merge_key(buf: &mut String, left: &str, right: &str) {
    use std::fmt::Write;
    buf.clear();
    let _ = write!(buf, "{}:", left.len());
    buf.push_str(left);
    buf.push_str(right);
}

impl Merges {
    /// Parses `"left right"` lines; rank = index. The split is at the first space after the
    /// first byte (as llama.cpp does, so a merge may start with a space); a line without such
    /// a space, or with an empty side, is an error. The first occurrence of a pair keeps its rank.
    pub fn parse(lines: &[String]) -> Result<Self> {
        let mut ranks = HashMap::with_capacity(lines.len());
        let mut buf = String::new();
        for (i, line) in lines.iter().enumerate() {
            let split = line
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(p, _)| p);
            let Some(p) = split else {
                return Err(Error::msg(format!(
                    "tokenizer merge #{i} {line:?} has no space separating its two parts"
                )));
            };
            let (left, right) = (&line[..p], &line[p + 1..]);
            if right.is_empty() {
                return Err(Error::msg(format!(
                    "tokenizer merge #{i} {line:?} has an empty right part"
                )));
            }
            merge_key(&mut buf, left, right);
            let rank = u32::try_from(i).map_err(|_| Error::msg("too many merges"))?;
            ranks.entry(buf.clone()).or_insert(rank);
        }
        Ok(Merges { ranks })
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.ranks.len()
    }

    fn rank(&self, buf: &mut String, left: &str, right: &str) -> Option<u32> {
        merge_key(buf, left, right);
        self.ranks.get(buf.as_str()).copied()
    }
}

/// A candidate merge in the queue; `Ord` makes the heap pop the lowest rank, then leftmost.
#[derive(PartialEq, Eq)]
struct Cand {
    rank: u32,
    left: usize,
    right: usize,
    /// Total byte length of the pair when queued; a mismatch later means the entry is stale.
    size: usize,
}

impl Ord for Cand {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        o.rank.cmp(&self.rank).then(o.left.cmp(&self.left))
    }
}
impl PartialOrd for Cand {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// Merges one byte-encoded word and appends its token ids.
///
/// `lookup` maps a symbol's text to its id. When `ignore_merges` is set and the whole word is
/// a token, it is emitted directly (llama.cpp's Llama 3 behaviour).
pub(crate) fn encode_word(
    word: &str,
    merges: &Merges,
    ignore_merges: bool,
    lookup: &dyn Fn(&str) -> Option<u32>,
    out: &mut Vec<u32>,
) {
    if word.is_empty() {
        return;
    }
    if ignore_merges {
        if let Some(id) = lookup(word) {
            out.push(id);
            return;
        }
    }
    let n = word.chars().count();
    let mut syms = char_symbols(word);
    let text = |s: &Sym| &word[s.start..s.start + s.len];
    let mut buf = String::new();
    let mut heap = BinaryHeap::new();
    let mut push =
        |heap: &mut BinaryHeap<Cand>, syms: &[Sym], l: Option<usize>, r: Option<usize>| {
            let (Some(l), Some(r)) = (l, r) else { return };
            if let Some(rank) = merges.rank(&mut buf, text(&syms[l]), text(&syms[r])) {
                heap.push(Cand {
                    rank,
                    left: l,
                    right: r,
                    size: syms[l].len + syms[r].len,
                });
            }
        };
    for i in 1..n {
        push(&mut heap, &syms, Some(i - 1), Some(i));
    }
    while let Some(c) = heap.pop() {
        let (l, r) = (syms[c.left], syms[c.right]);
        // Stale: either side was merged away, or has grown since the pair was queued.
        // (Symbols only ever grow to the right, so equal sizes mean identical texts.)
        if l.len == 0 || r.len == 0 || l.next != Some(c.right) || l.len + r.len != c.size {
            continue;
        }
        syms[c.left].len += r.len;
        syms[c.left].next = r.next;
        syms[c.right].len = 0;
        if let Some(nx) = r.next {
            syms[nx].prev = Some(c.left);
        }
        push(&mut heap, &syms, syms[c.left].prev, Some(c.left));
        push(&mut heap, &syms, Some(c.left), syms[c.left].next);
    }
    let mut i = Some(0);
    while let Some(k) = i {
        let s = &syms[k];
        let t = text(s);
        match lookup(t) {
            Some(id) => out.push(id),
            None => {
                // fall back to the single-character (= single-byte) tokens
                let mut tmp = [0u8; 4];
                for ch in t.chars() {
                    if let Some(id) = lookup(ch.encode_utf8(&mut tmp)) {
                        out.push(id);
                    }
                }
            }
        }
        i = s.next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map() {
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(b'\t'), 'ĉ');
        assert_eq!(byte_to_char(b'a'), 'a');
        assert_eq!(byte_to_char(0xAD), 'Ń');
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char(b)), Some(b));
        }
        assert_eq!(char_to_byte('東'), None);
        assert_eq!(byte_encode("é"), "Ã©");
    }

    #[test]
    fn merges_by_rank() {
        let merges = Merges::parse(&["a b".into(), "b c".into(), "ab c".into()]).unwrap();
        let vocab: HashMap<&str, u32> = [
            ("a", 0),
            ("b", 1),
            ("c", 2),
            ("ab", 3),
            ("bc", 4),
            ("abc", 5),
        ]
        .into_iter()
        .collect();
        let lookup = |s: &str| vocab.get(s).copied();
        let mut out = vec![];
        encode_word("abc", &merges, false, &lookup, &mut out);
        assert_eq!(out, [5]);
        out.clear();
        encode_word("bcab", &merges, false, &lookup, &mut out);
        assert_eq!(out, [4, 3]);
        out.clear();
        encode_word("axb", &merges, false, &lookup, &mut out);
        assert_eq!(out, [0, 1]); // 'x' is unknown and has no byte token: dropped
        assert!(Merges::parse(&["nospace".into()]).is_err());
        assert!(Merges::parse(&["a ".into()]).is_err());
        assert_eq!(Merges::parse(&[" a b".into()]).unwrap().len(), 1);
    }
}
