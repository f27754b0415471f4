//! The doubly linked list of symbols that both merge algorithms (BPE and SentencePiece) work on:
//! one entry per character to start with, merged in place by relinking.

/// One symbol: a byte range of the text being merged plus its list links.
#[derive(Clone, Copy)]
pub(crate) struct Sym {
    pub start: usize,
    pub len: usize,
    pub prev: Option<usize>,
    pub next: Option<usize>,
}

/// One symbol per character of `text`, linked in order.
pub(crate) fn char_symbols(text: &str) -> Vec<Sym> {
    let n = text.chars().count();
    text.char_indices()
        .enumerate()
        .map(|(i, (start, c))| Sym {
            start,
            len: c.len_utf8(),
            prev: i.checked_sub(1),
            next: (i + 1 < n).then_some(i + 1),
        })
        .collect()
}
