//! Tool-call parsing of model output: for any text, any format and keep rule, and any way of
//! cutting it into streamed pieces, the stream gives out exactly what the whole reply parses to
//! (text joined; calls in order, numbered from 0), and never panics.
#![no_main]

use ferrum_server::tool_calls::{parse_reply, Format, Keep, Out, Stream};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let format = [Format::Hermes, Format::Mistral, Format::Json][data[0] as usize % 3];
    let keep = match data[0] / 3 % 3 {
        0 => Keep::default(),
        1 => Keep {
            only: None,
            parallel: false,
        },
        _ => Keep {
            only: Some("f".into()),
            parallel: true,
        },
    };
    let prefix = match data[0] / 9 % 3 {
        0 => String::new(),
        1 => format.forced_prefix(None, "<tool_call> [TOOL_CALLS] [ tools"),
        _ => format.forced_prefix(Some("f"), "<tool_call> [TOOL_CALLS] [ tools"),
    };
    let step = 1 + data[1] as usize % 7;
    let text = String::from_utf8_lossy(&data[2..]).into_owned();
    let (content, calls) = parse_reply(format, &prefix, &keep, &text);
    let mut s = Stream::new(format, &prefix, keep);
    let mut out = Vec::new();
    let mut at = 0;
    while at < text.len() {
        let mut end = (at + step).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        out.extend(s.push(&text[at..end]));
        at = end;
    }
    out.extend(s.finish());
    let mut got_text = String::new();
    let mut got_calls = Vec::new();
    for o in out {
        match o {
            Out::Text(t) => got_text.push_str(&t),
            Out::Call(i, c) => {
                assert_eq!(i, got_calls.len(), "calls numbered in order");
                got_calls.push(c);
            }
        }
    }
    assert_eq!(
        got_calls, calls,
        "streamed calls differ from the whole reply's: {text:?}"
    );
    assert_eq!(
        got_text,
        content.unwrap_or_default(),
        "streamed text differs: {text:?}"
    );
});
