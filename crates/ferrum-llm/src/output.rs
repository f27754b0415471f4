//! One sequence's output as tokens are drawn: their text (whole UTF-8 characters only, held back
//! while it may still become a stop string), and when and why the sequence finishes. Shared by
//! [`crate::generate`] (the CLI) and the server's engine, so both end sequences by the same rules:
//!
//! - an end-of-generation token ends it (`Stop`, no text) unless `ignore_eos`;
//! - a stop string ends it (`Stop`; the text up to the stop string, which is not shown);
//! - a grammar whose output is complete ends it (`Stop`, after the token's text);
//! - the `max_tokens`-th token ends it (`Length`; text held back for a possible stop string or
//!   an unfinished character is given out then).

use crate::generate::FinishReason;
use crate::text::{StopMatcher, Utf8Stream};
use ferrum_tokenizer::Tokenizer;

/// What one drawn token gives out.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TokenOut {
    /// Newly final text (may be empty).
    pub text: String,
    /// Text held back until now, given out because the sequence finished by length.
    pub tail: String,
    /// Set when this token finishes the sequence.
    pub finish: Option<FinishReason>,
}

/// The output state of one sequence.
pub struct SeqOutput {
    utf8: Utf8Stream,
    stops: StopMatcher,
    max_tokens: usize,
    ignore_eos: bool,
    min_tokens: usize,
    generated: usize,
    finish: Option<FinishReason>,
}

impl SeqOutput {
    /// `stop`: stop strings; the sequence ends after `max_tokens` tokens; end-of-generation
    /// tokens end it unless `ignore_eos`, and may not be drawn before `min_tokens` tokens.
    pub fn new(stop: &[String], max_tokens: usize, ignore_eos: bool, min_tokens: usize) -> Self {
        SeqOutput {
            utf8: Utf8Stream::default(),
            stops: StopMatcher::new(stop),
            max_tokens,
            ignore_eos,
            min_tokens,
            generated: 0,
            finish: None,
        }
    }

    /// Whether end-of-generation tokens must be kept from the draw (fewer than `min_tokens` yet).
    pub fn holds_eog(&self) -> bool {
        self.generated < self.min_tokens && !self.ignore_eos
    }

    /// Takes the drawn token `id`. `complete`: a grammar constraining the sequence admits nothing
    /// after it. Pushing after the sequence finished is a no-op.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32, complete: bool) -> TokenOut {
        if self.finish.is_some() {
            return TokenOut::default();
        }
        self.generated += 1;
        let mut out = TokenOut::default();
        if !self.ignore_eos && tokenizer.is_eog(id) {
            out.finish = Some(FinishReason::Stop);
        } else {
            let piece = self.utf8.push(&tokenizer.token_bytes(id, false));
            let (shown, hit) = self.stops.push(&piece);
            out.text = shown;
            if hit || complete {
                out.finish = Some(FinishReason::Stop);
            } else if self.generated >= self.max_tokens {
                out.finish = Some(FinishReason::Length);
                out.tail = self.flush();
            }
        }
        self.finish = out.finish;
        out
    }

    /// Ends the sequence by length now (the caller stopped it, e.g. its context is full): the
    /// text held back.
    pub fn cut(&mut self) -> String {
        if self.finish.is_some() {
            return String::new();
        }
        self.finish = Some(FinishReason::Length);
        self.flush()
    }

    fn flush(&mut self) -> String {
        let tail = self.utf8.finish();
        let (shown, _) = self.stops.push(&tail);
        shown + &self.stops.finish()
    }

    /// Tokens taken so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Why the sequence finished, once it has.
    pub fn finish(&self) -> Option<FinishReason> {
        self.finish
    }

    /// All text given out so far.
    pub fn text(&self) -> &str {
        self.stops.text()
    }
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
    pub fn new(tokenizer: &Tokenizer, logits: &[f32], id: u32, k: usize) -> TokenLogprobs {
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
            token: tokenizer.token_bytes(id, false),
            logprob: lp(id as usize),
            top: top
                .into_iter()
                .map(|i| (tokenizer.token_bytes(i as u32, false), lp(i)))
                .collect(),
        }
    }
}
