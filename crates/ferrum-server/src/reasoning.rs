//! A thinking model's reasoning, split from its answer: templates that teach `<think>` ...
//! `</think>` (Qwen3, DeepSeek-R1 distills) get the text inside the tags as `reasoning_content`
//! and the rest as `content`, whole or as it streams. When the prompt already opened the tag
//! (the generation prompt ends in `<think>`), the output starts inside the reasoning.

const OPEN: &str = "<think>";
pub(crate) const CLOSE: &str = "</think>";

/// Whether a template teaches thinking tags.
pub fn template_thinks(source: &str) -> bool {
    source.contains(CLOSE)
}

/// Whether a rendered prompt leaves the model inside an opened `<think>`.
pub fn prompt_opens(rendered: &str) -> bool {
    let t = rendered.trim_end();
    t.ends_with(OPEN)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: the reply may still open with `<think>`.
    Start,
    Reasoning,
    Answer,
}

/// A piece of output: reasoning (true) or answer (false) text.
pub type Part = (bool, String);

/// Splits output as it streams: [`Splitter::push`] each piece, then [`Splitter::finish`].
#[derive(Clone, Debug)]
pub struct Splitter {
    state: State,
    buf: String,
    /// Whitespace right after `</think>` is dropped (templates put a blank line there).
    trim_answer_start: bool,
}

/// The length of the longest suffix of `s` that is a proper prefix of `tag`.
fn partial(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

impl Splitter {
    /// `inside`: the prompt opened the reasoning.
    pub fn new(inside: bool) -> Self {
        Splitter {
            state: if inside {
                State::Reasoning
            } else {
                State::Start
            },
            buf: String::new(),
            trim_answer_start: false,
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Start => {
                    let t = self.buf.trim_start();
                    if t.is_empty() || (t.len() < OPEN.len() && OPEN.starts_with(t)) {
                        break;
                    }
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.buf = rest.to_string();
                        self.state = State::Reasoning;
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Reasoning => {
                    if let Some(at) = self.buf.find(CLOSE) {
                        emit(&mut out, true, &self.buf[..at]);
                        self.buf.drain(..at + CLOSE.len());
                        self.state = State::Answer;
                        self.trim_answer_start = true;
                        continue;
                    }
                    let keep = partial(&self.buf, CLOSE);
                    let n = self.buf.len() - keep;
                    emit(&mut out, true, &self.buf[..n]);
                    self.buf.drain(..n);
                    break;
                }
                State::Answer => {
                    if self.trim_answer_start {
                        let t = self.buf.trim_start();
                        if t.is_empty() {
                            self.buf.clear();
                            break;
                        }
                        self.buf = t.to_string();
                        self.trim_answer_start = false;
                    }
                    emit(&mut out, false, &self.buf);
                    self.buf.clear();
                    break;
                }
            }
        }
        out
    }

    /// The rest at the end of the output.
    pub fn finish(&mut self) -> Vec<Part> {
        let buf = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        match self.state {
            State::Reasoning => emit(&mut out, true, &buf),
            State::Answer if self.trim_answer_start => emit(&mut out, false, buf.trim_start()),
            _ => emit(&mut out, false, &buf),
        }
        out
    }
}

fn emit(out: &mut Vec<Part>, reasoning: bool, s: &str) {
    if s.is_empty() {
        return;
    }
    match out.last_mut() {
        Some((r, t)) if *r == reasoning => t.push_str(s),
        _ => out.push((reasoning, s.to_string())),
    }
}

/// The whole output as (reasoning, answer).
pub fn split(inside: bool, text: &str) -> (Option<String>, String) {
    let mut s = Splitter::new(inside);
    let mut parts = s.push(text);
    parts.extend(s.finish());
    let (mut reasoning, mut answer) = (None::<String>, String::new());
    for (r, t) in parts {
        if r {
            reasoning.get_or_insert_with(String::new).push_str(&t);
        } else {
            answer.push_str(&t);
        }
    }
    (reasoning, answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cases() -> Vec<(bool, &'static str, Option<&'static str>, &'static str)> {
        vec![
            (
                false,
                "<think>\nLet me add.\n</think>\n\n4",
                Some("\nLet me add.\n"),
                "4",
            ),
            (false, "Plain answer.", None, "Plain answer."),
            (false, "  <think>a < b</think>yes", Some("a < b"), "yes"),
            (
                true,
                "The user asks.\n</think>\n\nParis.",
                Some("The user asks.\n"),
                "Paris.",
            ),
            (true, "cut off mid-thought", Some("cut off mid-thought"), ""),
            (false, "<thin", None, "<thin"),
            (false, "", None, ""),
        ]
    }

    #[test]
    fn whole() {
        for (inside, text, reasoning, answer) in cases() {
            let (r, a) = split(inside, text);
            assert_eq!((r.as_deref(), a.as_str()), (reasoning, answer), "{text:?}");
        }
    }

    #[test]
    fn streamed_at_every_boundary() {
        for (inside, text, _, _) in cases() {
            let whole = split(inside, text);
            for i in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
                let mut s = Splitter::new(inside);
                let mut parts = s.push(&text[..i]);
                parts.extend(s.push(&text[i..]));
                parts.extend(s.finish());
                let (mut r, mut a) = (None::<String>, String::new());
                for (is_r, t) in parts {
                    assert!(!t.contains(CLOSE), "tag leaked in {text:?} cut at {i}");
                    if is_r {
                        r.get_or_insert_with(String::new).push_str(&t);
                    } else {
                        a.push_str(&t);
                    }
                }
                assert_eq!((r, a), whole, "{text:?} cut at {i}");
            }
        }
    }
}
