//! Special-token partition (llama.cpp `tokenizer_st_partition`).
//!
//! Candidates are all tokens with the CONTROL, USER_DEFINED or UNKNOWN attribute, sorted by
//! text length, longest first. For each candidate in that order, every remaining raw-text
//! fragment is split at each (leftmost-first, non-overlapping) occurrence into text / token /
//! text. CONTROL and UNKNOWN candidates only take part when `parse_special` is set;
//! USER_DEFINED ones always do. A candidate carrying CONTROL on top of USER_DEFINED (a token
//! promoted by the end-of-generation detection) counts as CONTROL.
//!
//! Candidates that do not occur anywhere in the input are skipped up front with one
//! Aho-Corasick pass, which keeps this cheap for vocabularies with thousands of control
//! tokens (Gemma has 6249); the result is the same as trying every candidate.

use aho_corasick::AhoCorasick;

use crate::{Error, Result};

/// One piece of partitioned input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

pub(crate) struct SpecialMatcher {
    /// `(id, text, only_with_parse_special)`, longest text first (ties: smaller id first).
    cands: Vec<(u32, String, bool)>,
    ac: Option<AhoCorasick>,
}

impl SpecialMatcher {
    /// `cands`: `(id, text, needs_parse_special)` for every special candidate; empty texts
    /// are ignored.
    pub fn new(mut cands: Vec<(u32, String, bool)>) -> Result<Self> {
        cands.retain(|c| !c.1.is_empty());
        cands.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
        let ac = if cands.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::new(cands.iter().map(|c| c.1.as_str()))
                    .map_err(|e| Error::msg(format!("building the special-token matcher: {e}")))?,
            )
        };
        Ok(SpecialMatcher { cands, ac })
    }

    /// Splits `text` into raw-text and special-token fragments.
    pub fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Fragment::Text(text));
        let Some(ac) = &self.ac else { return frags };
        // which candidates occur at all (overlapping search finds every occurrence)
        let mut present = vec![false; self.cands.len()];
        let mut any = false;
        for m in ac.find_overlapping_iter(text) {
            let k = m.pattern().as_usize();
            if parse_special || !self.cands[k].2 {
                present[k] = true;
                any = true;
            }
        }
        if !any {
            return frags;
        }
        for (k, (id, tok, _)) in self.cands.iter().enumerate() {
            if !present[k] {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                match f {
                    Fragment::Text(mut s) => {
                        while let Some(p) = s.find(tok.as_str()) {
                            if p > 0 {
                                next.push(Fragment::Text(&s[..p]));
                            }
                            next.push(Fragment::Token(*id));
                            s = &s[p + tok.len()..];
                        }
                        if !s.is_empty() {
                            next.push(Fragment::Text(s));
                        }
                    }
                    tok_frag => next.push(tok_frag),
                }
            }
            frags = next;
        }
        frags
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Fragment::*;

    #[test]
    fn longest_first_and_user_defined_always() {
        let m = SpecialMatcher::new(vec![
            (1, "<s>".into(), true),
            (2, "<s><s>".into(), true),
            (3, "\n\n".into(), false),
            (4, "\n".into(), false),
        ])
        .unwrap();
        assert_eq!(
            m.partition("a<s><s><s>b\n\n\nc", true),
            [
                Text("a"),
                Token(2),
                Token(1),
                Text("b"),
                Token(3),
                Token(4),
                Text("c")
            ]
        );
        assert_eq!(m.partition("a<s>b\n", false), [Text("a<s>b"), Token(4)]);
        assert!(m.partition("", true).is_empty());
    }
}
