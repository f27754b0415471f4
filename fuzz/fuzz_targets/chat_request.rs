//! Chat request bodies as `/v1/chat/completions` reads them (Qwen2.5's chat template, which
//! renders tools): parsing, message and tool checks, rendering, `tool_choice`, structured-output
//! fields; then any grammar the request asks for is compiled and walked a few tokens. Bad input
//! must be an error, never a panic or a hang.
#![no_main]

use std::sync::OnceLock;

use ferrum_tokenizer::ChatTemplate;
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fn template() -> &'static ChatTemplate {
    static T: OnceLock<ChatTemplate> = OnceLock::new();
    T.get_or_init(|| {
        let src = include_str!("../../crates/ferrum-server/testdata/qwen2.5-chat-template.jinja");
        ChatTemplate::new(src, "", "<|im_end|>").expect("template")
    })
}

fuzz_target!(|data: &[u8]| {
    if let Ok((_rendered, Some(g))) = ferrum_server::fuzzing::chat_request(template(), data) {
        common::walk(&g, 8, data);
    }
});
