//! Constrained decoding on the real vocabularies (SmolLM2's 49k tokens, Qwen2.5's 151k):
//! outputs in a grammar's language tokenize into tokens the masks allow, outputs outside it are
//! refused, and random walks through the masks (fresh random logits each run) always end inside
//! the language.

mod common;

use std::sync::Arc;

use ferrum_llm::grammar::{Constraint, Grammar, Grammars};
use ferrum_llm::Llm;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

fn grammars(llm: &Llm) -> Grammars {
    Grammars::new(Arc::clone(&llm.tokenizer)).expect("grammar compiler builds")
}

/// Feeds `text`'s tokens; returns how many the constraint took before refusing one, and
/// whether it could end after all of them.
fn feed(c: &mut Constraint, llm: &Llm, text: &str) -> (usize, usize, bool) {
    let ids = llm.tokenizer.encode(text, false, false);
    for (i, &id) in ids.iter().enumerate() {
        if c.is_complete() || !c.allows(id).unwrap() {
            return (i, ids.len(), false);
        }
        c.accept(id).unwrap();
    }
    let end = c.is_complete() || c.can_end();
    (ids.len(), ids.len(), end)
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": false
            }
        },
        "required": ["name", "age", "role", "address"],
        "additionalProperties": false
    })
}

/// A JSON integer in `lo..=hi` (as JSON Schema counts them: `-0` and `2.0` are integers).
fn int_in(v: &Value, lo: i64, hi: i64) -> bool {
    v.as_f64()
        .is_some_and(|f| f.fract() == 0.0 && (lo as f64..=hi as f64).contains(&f))
}

/// Whether `v` is valid under [`person_schema`] (written out by hand).
fn person_valid(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    let allowed = ["name", "age", "role", "tags", "address"];
    if o.keys().any(|k| !allowed.contains(&k.as_str())) {
        return false;
    }
    let name_ok = o["name"].as_str().is_some_and(|s| s.chars().count() <= 12);
    let age_ok = int_in(&o["age"], 0, 150);
    let role_ok = o["role"]
        .as_str()
        .is_some_and(|r| ["admin", "user", "guest"].contains(&r));
    let tags_ok = match o.get("tags") {
        None => true,
        Some(t) => t.as_array().is_some_and(|a| {
            a.len() <= 3
                && a.iter()
                    .all(|s| s.as_str().is_some_and(|s| s.chars().count() <= 6))
        }),
    };
    let addr_ok = o["address"].as_object().is_some_and(|a| {
        a.len() == 2
            && a["city"].as_str().is_some_and(|c| c.chars().count() <= 10)
            && a["zip"]
                .as_str()
                .is_some_and(|z| z.len() == 5 && z.bytes().all(|b| b.is_ascii_digit()))
    });
    o.contains_key("name")
        && o.contains_key("age")
        && o.contains_key("role")
        && o.contains_key("address")
        && name_ok
        && age_ok
        && role_ok
        && tags_ok
        && addr_ok
}

#[test]
fn outputs_in_the_language_pass_and_others_are_refused() {
    for llm in [common::smollm2(), common::qwen2()] {
        let g = grammars(llm);
        let cases: Vec<(Grammar, &str, &str)> = vec![
            (
                Grammar::JsonSchema(person_schema()),
                r#"{"name": "Ada", "age": 36, "role": "admin", "address": {"city": "London", "zip": "12345"}}"#,
                r#"{"name": "Ada", "age": 151, "role": "admin", "address": {"city": "London", "zip": "12345"}}"#,
            ),
            (
                Grammar::JsonSchema(person_schema()),
                "{\n  \"name\": \"Bo\",\n  \"age\": 0,\n  \"role\": \"guest\",\n  \"tags\": [\"a\", \"b\"],\n  \"address\": {\"city\": \"Oslo\", \"zip\": \"00000\"}\n}",
                r#"{"name": "Bo", "age": 1, "role": "root", "address": {"city": "Oslo", "zip": "00000"}}"#,
            ),
            (
                Grammar::JsonObject,
                r#"{"anything": [1, 2.5, null, {"x": true}]}"#,
                r#"[1, 2]"#,
            ),
            (
                Grammar::Regex(r"\d{3}-[A-Z]{2}".into()),
                "123-AB",
                "12-ABC",
            ),
            (
                Grammar::Choice(vec!["positive".into(), "negative".into(), "neutral".into()]),
                "negative",
                "mixed",
            ),
            (
                Grammar::Lark(r#"start: "The answer is " NUM "."
NUM: /[0-9]+/
"#.into()),
                "The answer is 42.",
                "The answer is forty-two.",
            ),
            (
                Grammar::Gbnf(r#"root ::= "yes" | "no" | ("maybe" [ ]? digit{1,2})
digit ::= [0-9]
"#.into()),
                "maybe 42",
                "maybe 123",
            ),
        ];
        for (grammar, good, bad) in cases {
            let mut c = g.compile(&grammar).unwrap();
            let (took, n, end) = feed(&mut c, llm, good);
            assert!(
                took == n && end,
                "{}: {grammar:?} refused token {took} of {good:?}",
                llm.name
            );
            let mut c = g.compile(&grammar).unwrap();
            let (took, n, end) = feed(&mut c, llm, bad);
            assert!(
                took < n || !end,
                "{}: {grammar:?} took all of {bad:?}",
                llm.name
            );
        }
    }
}

/// Samples from the mask with random logits until the constraint is complete or an end token is
/// drawn; the text, and whether it ended.
fn random_walk(c: &mut Constraint, llm: &Llm, rng: &mut impl Rng, limit: usize) -> (String, bool) {
    let vocab = llm.tokenizer.vocab_size();
    let mut ids = Vec::new();
    for _ in 0..limit {
        let mut logits: Vec<f32> = (0..vocab).map(|_| rng.gen::<f32>()).collect();
        // Favour short tokens a little so strings close and walks end.
        for (i, l) in logits.iter_mut().enumerate() {
            if llm.tokenizer.token_bytes(i as u32, false).len() > 2 {
                *l -= 0.5;
            }
        }
        c.mask(&mut logits).unwrap();
        assert!(logits.iter().all(|l| !l.is_nan()));
        let id = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap();
        assert!(logits[id as usize].is_finite(), "nothing allowed");
        if llm.tokenizer.is_eog(id) {
            return (llm.tokenizer.decode(&ids, false), true);
        }
        c.accept(id).unwrap();
        ids.push(id);
        if c.is_complete() {
            return (llm.tokenizer.decode(&ids, false), true);
        }
    }
    (llm.tokenizer.decode(&ids, false), false)
}

/// Whether a text is in a grammar's language (written out by hand for each test grammar).
type Validator = Box<dyn Fn(&str) -> bool>;

#[test]
fn random_walks_end_inside_the_language() {
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let llm = common::smollm2();
    let g = grammars(llm);
    let kinds: Vec<(Grammar, Validator)> = vec![
        (
            Grammar::JsonSchema(person_schema()),
            Box::new(|t: &str| serde_json::from_str::<Value>(t).is_ok_and(|v| person_valid(&v))),
        ),
        (
            Grammar::JsonSchema(
                json!({"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4}),
            ),
            Box::new(|t: &str| {
                serde_json::from_str::<Value>(t).is_ok_and(|v| {
                    v.as_array().is_some_and(|a| {
                        (1..=4).contains(&a.len()) && a.iter().all(|x| int_in(x, -5, 5))
                    })
                })
            }),
        ),
        (
            Grammar::Regex(r"[a-c]{2,4}(-[0-9])?".into()),
            Box::new(|t: &str| {
                let (head, tail) = t.split_once('-').unwrap_or((t, ""));
                (2..=4).contains(&head.len())
                    && head.bytes().all(|b| (b'a'..=b'c').contains(&b))
                    && (tail.is_empty() && !t.contains('-')
                        || tail.len() == 1 && tail.as_bytes()[0].is_ascii_digit())
            }),
        ),
        (
            Grammar::Choice(vec!["red".into(), "green".into(), "blue and gold".into()]),
            Box::new(|t: &str| ["red", "green", "blue and gold"].contains(&t)),
        ),
    ];
    for (grammar, valid) in &kinds {
        for walk in 0..8 {
            let mut c = g.compile(grammar).unwrap();
            let (text, ended) = random_walk(&mut c, llm, &mut rng, 400);
            assert!(
                ended,
                "seed {seed}: {grammar:?} walk {walk} did not end: {text:?}"
            );
            assert!(
                valid(&text),
                "seed {seed}: {grammar:?} walk {walk} left the language: {text:?}"
            );
        }
    }
}

#[test]
fn bad_grammars_are_errors() {
    let llm = common::smollm2();
    let g = grammars(llm);
    for (grammar, want) in [
        (Grammar::JsonSchema(json!(false)), "admits no value"),
        (Grammar::JsonSchema(json!("object")), "must be an object"),
        (
            Grammar::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 1})),
            "",
        ),
        (Grammar::JsonSchema(json!({"type": "nonsense"})), ""),
        (Grammar::Regex("(unclosed".into()), ""),
        (Grammar::Regex(String::new()), "empty"),
        (Grammar::Choice(vec![]), "empty"),
        (Grammar::Lark("start: undefined_rule".into()), ""),
        (Grammar::Lark("this is not lark".into()), ""),
        (Grammar::Gbnf("root ::= missing".into()), "not defined"),
    ] {
        match g.compile(&grammar) {
            Ok(_) => panic!("{grammar:?} compiled"),
            Err(e) => assert!(e.to_string().contains(want), "{grammar:?}: {e}"),
        }
    }
}
