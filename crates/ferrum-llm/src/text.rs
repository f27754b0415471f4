//! Turning a token stream into text as it is produced: UTF-8 reassembly and stop strings.

/// Buffers token bytes and releases only complete UTF-8 (a character may span several tokens).
#[derive(Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Adds bytes, returns the text that is now complete. Invalid sequences become U+FFFD.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    out.push_str(
                        std::str::from_utf8(&self.pending[..good]).expect("validated prefix"),
                    );
                    match e.error_len() {
                        // Incomplete sequence at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..good + bad);
                        }
                    }
                }
            }
        }
    }

    /// Whatever is left at the end of generation.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

/// Finds stop strings in generated text, holding back any tail that could still become one.
pub struct StopMatcher {
    stops: Vec<String>,
    text: String,
    /// Bytes of `text` already released to the caller.
    released: usize,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            text: String::new(),
            released: 0,
        }
    }

    /// Appends text; returns (text safe to show now, whether a stop string was hit). On a hit the
    /// text before the stop string is released and the stop string itself is dropped.
    pub fn push(&mut self, s: &str) -> (String, bool) {
        let search_from = self
            .released
            .saturating_sub(self.stops.iter().map(|s| s.len()).max().unwrap_or(0));
        let search_from = floor_char_boundary(&self.text, search_from);
        self.text.push_str(s);
        let hit = self
            .stops
            .iter()
            .filter_map(|stop| {
                self.text[search_from..]
                    .find(stop.as_str())
                    .map(|i| i + search_from)
            })
            .min();
        if let Some(at) = hit {
            let out = self.text[self.released.min(at)..at].to_string();
            self.text.truncate(at);
            self.released = at;
            return (out, true);
        }
        // Hold back the longest suffix that is a prefix of some stop string.
        let mut hold = 0;
        for stop in &self.stops {
            for n in (1..stop.len()).rev() {
                if n <= self.text.len()
                    && stop.is_char_boundary(n)
                    && self.text.ends_with(&stop[..n])
                {
                    hold = hold.max(n);
                    break;
                }
            }
        }
        let safe = floor_char_boundary(&self.text, self.text.len() - hold).max(self.released);
        let out = self.text[self.released..safe].to_string();
        self.released = safe;
        (out, false)
    }

    /// Releases the held-back tail at the end of generation.
    pub fn finish(&mut self) -> String {
        let out = self.text[self.released..].to_string();
        self.released = self.text.len();
        out
    }

    /// All text accepted so far (without any stop string).
    pub fn text(&self) -> &str {
        &self.text
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_stream_reassembles_split_characters() {
        let mut u = Utf8Stream::default();
        let bytes = "é東".as_bytes();
        assert_eq!(u.push(&bytes[..1]), "");
        assert_eq!(u.push(&bytes[1..3]), "é");
        assert_eq!(u.push(&bytes[3..]), "東");
        assert_eq!(u.push(&[0xff, b'a']), "\u{FFFD}a");
        assert_eq!(u.push(&[0xe6]), "");
        assert_eq!(u.finish(), "\u{FFFD}");
    }

    #[test]
    fn stop_strings_are_found_across_pushes_and_held_back() {
        let mut m = StopMatcher::new(&["END".to_string(), "\n\n".to_string()]);
        let mut shown = String::new();
        for piece in ["Hello", " E", "N", "x more", " EN", "D tail"] {
            let (s, stop) = m.push(piece);
            shown.push_str(&s);
            if stop {
                break;
            }
        }
        assert_eq!(shown, "Hello ENx more ");
        assert_eq!(m.text(), "Hello ENx more ");
        let mut m = StopMatcher::new(&[]);
        assert_eq!(m.push("abc"), ("abc".to_string(), false));
    }
}
