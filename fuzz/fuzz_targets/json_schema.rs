//! Arbitrary JSON Schemas (and the other grammar kinds, picked by the first byte) compiled for
//! SmolLM2's vocabulary and walked through their masks: errors are fine, panics and hangs are
//! not, and every mask allows a token or is an error.
#![no_main]

use ferrum_llm::grammar::Grammar;
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest).into_owned();
    let g = match kind % 5 {
        0 | 1 => match serde_json::from_str(&text) {
            Ok(v) => Grammar::JsonSchema(v),
            Err(_) => return,
        },
        2 => Grammar::Regex(text),
        3 => Grammar::Gbnf(text),
        _ => Grammar::Lark(text),
    };
    common::walk(&g, 6, data);
});
