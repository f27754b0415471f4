//! The hand-written o200k_base (`gpt-4o`) pre-tokenizer against real regex engines: the
//! Python `regex` module (split for split on `tests/data/gpt4o_pretokenizer_splits.json`,
//! written by `scripts/gen_pretokenizer_fixture.py`), and the `tokenizers` crate's `Split`
//! (fancy-regex, the Rust regex semantics tiktoken also has) on random strings.

use ferrum_tokenizer::{hf_tokenizer_json_from_spec, PreTokenizer, TokenizerSpec};
use proptest::prelude::*;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer as _, SplitDelimiterBehavior,
};

fn fixture() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/gpt4o_pretokenizer_splits.json"
    );
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn pattern() -> String {
    fixture()["pattern"].as_str().unwrap().to_owned()
}

/// ferrum's pieces.
fn ours(text: &str) -> Vec<&str> {
    PreTokenizer::Gpt4o
        .split(text)
        .into_iter()
        .map(|r| &text[r])
        .collect()
}

/// Pieces from code-point lengths.
fn by_lens<'a>(text: &'a str, lens: &[usize]) -> Vec<&'a str> {
    let mut out = Vec::with_capacity(lens.len());
    let mut rest = text;
    for &n in lens {
        let b = rest.char_indices().nth(n).map_or(rest.len(), |(b, _)| b);
        out.push(&rest[..b]);
        rest = &rest[b..];
    }
    assert!(rest.is_empty(), "lengths do not cover {text:?}");
    out
}

#[test]
fn matches_python_regex_on_fixture() {
    let fx = fixture();
    let items = fx["items"].as_array().unwrap();
    assert!(items.len() > 2000);
    let mut bad = Vec::new();
    for it in items {
        let text = it["text"].as_str().unwrap();
        let lens: Vec<usize> = it["lens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap() as usize)
            .collect();
        let want = by_lens(text, &lens);
        let got = ours(text);
        if got != want {
            bad.push(format!("{text:?}\n  regex:  {want:?}\n  ferrum: {got:?}"));
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} strings split differently:\n{}",
        bad.len(),
        items.len(),
        bad[..bad.len().min(20)].join("\n")
    );
}

/// The `tokenizers` crate's split of `text` by `split`.
fn theirs<'a>(split: &Split, text: &'a str) -> Vec<&'a str> {
    let mut pts = PreTokenizedString::from(text);
    split.pre_tokenize(&mut pts).unwrap();
    pts.get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(_, (a, b), _)| &text[a..b])
        .collect()
}

fn hf_split() -> Split {
    Split::new(
        SplitPattern::Regex(pattern()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .unwrap()
}

#[test]
fn tokenizers_split_agrees_on_tricky_strings() {
    let split = hf_split();
    for text in [
        "HelloWorld DON'T it'ſ we'RE",
        "XMLHttpRequest ǅungla ΣΊΣΥΦΟΣ's",
        "cafe\u{301} \u{301}ABC \u{301}abc e\u{301}E\u{301}",
        "a.b/\nc !?\n/x x\n/y",
        "12345 ٣٤٥٦٧ ①②③④",
        "x  \n\n  y\r\n\r\n\t\tz  ",
        "東京Tower 😀 😀 👨‍👩‍👧",
        "\u{a0}\u{3000}\u{85}\u{2028}x\u{1c}y",
    ] {
        assert_eq!(ours(text), theirs(&split, text), "{text:?}");
    }
}

/// Code points whose categories are the same in every recent Unicode version.
#[rustfmt::skip]
const POOL: &[char] = &[
    'a', 'b', 'z', 'A', 'B', 'Z', 's', 'S', 't', 'T', 'r', 'R', 'e', 'E', 'v', 'V', 'm', 'M',
    'l', 'L', 'd', 'D', 'ſ', '\'', '\'', '0', '1', '9', ' ', ' ', ' ', '\t', '\n', '\r', '\x0b',
    '\x0c', '\x1c', '\x00', '\x7f', '\u{85}', '\u{a0}', '\u{2003}', '\u{3000}', '\u{2028}',
    '\u{200b}', '\u{200d}', '\u{feff}', '.', ',', '!', '?', '/', '/', '-', '_', '(', ')', '"',
    '#', '$', '+', '<', '=', '|', '~', '`', 'é', 'É', 'ß', 'ø', 'Ø', 'ª', 'µ', '¹', '½', '¿', '«',
    '©', '×', 'α', 'Σ', 'ς', 'ǅ', 'ᾈ', 'ж', 'Ж', 'ʰ', '々', 'ー', '東', '京', 'ひ', 'カ', '한',
    'م', 'ر', '\u{64e}', '٣', '،', 'न', '\u{94d}', '\u{93e}', '०', '\u{300}', '\u{301}',
    '\u{308}', '\u{20dd}', '０', 'Ⅻ', 'ⅰ', '①', '😀', '👍', '\u{1f3fd}', '\u{fe0f}', '🇫',
    '\u{e000}',
];

/// Snippets that exercise the pattern's corners (contractions after words, punctuation runs
/// followed by newlines and slashes, case changes, marks, digit runs, whitespace runs).
#[rustfmt::skip]
const SNIPPETS: &[&str] = &[
    "Hello", "WORLD", "wORLD", "don't", "DON'T", "'s", "'S", "'re", "'VE", "'ll", "'Ll", "'d",
    "'ſ", "'x", "!\n/", "?\r\n", "./", "//", "/\n", " \n", "\n\n", "\r\n", "  ", " \t ",
    "\u{3000}\n", "e\u{301}", "\u{301}A", "A\u{301}b", "ǅa", "ΣΊΣ", "12345", "٣٤٥٦", "東京",
];

fn text_strategy() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        3 => prop::sample::select(POOL).prop_map(String::from),
        1 => prop::sample::select(SNIPPETS).prop_map(String::from),
    ];
    prop::collection::vec(piece, 0..16).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn tokenizers_split_agrees_on_random_strings(text in text_strategy()) {
        thread_local!(static SPLIT: Split = hf_split());
        SPLIT.with(|split| {
            prop_assert_eq!(ours(&text), theirs(split, &text));
            Ok(())
        })?;
    }
}

#[test]
fn tokenizer_json_export_uses_the_pattern() {
    let tokens: Vec<String> = (0..=255u8)
        .map(|b| ferrum_tokenizer::byte_to_char(b).to_string())
        .collect();
    let spec = TokenizerSpec {
        model: "gpt2".into(),
        pre: Some("gpt-4o".into()),
        tokens,
        merges: Some(Vec::new()),
        ..Default::default()
    };
    let json: serde_json::Value =
        serde_json::from_str(&hf_tokenizer_json_from_spec(&spec).unwrap()).unwrap();
    let pre = &json["pre_tokenizer"]["pretokenizers"];
    assert_eq!(
        pre[0]["pattern"]["Regex"].as_str(),
        Some(pattern().as_str())
    );
    assert_eq!(pre[1]["type"], "ByteLevel");
    assert_eq!(json["model"]["ignore_merges"], false);
    assert!(json["post_processor"].is_null(), "gpt-4o adds no BOS");
}
