//! Entry points for the fuzz targets (`fuzz/`): what the routes do with a request body before it
//! reaches the engine, callable without a server. Not part of the API.

use axum::body::Bytes;
use ferrum_llm::grammar::Grammar;
use ferrum_tokenizer::ChatTemplate;

use crate::chat_request::{self, ToolsIn};
use crate::request::{self, ChatBody};

/// A chat request body as `/v1/chat/completions` reads it: parsed, its messages and tools checked
/// and rendered by `template`, and the grammar its reply must follow (structured output or a
/// required call). `Err` is the 400 message the route would answer with.
pub fn chat_request(
    template: &ChatTemplate,
    body: &[u8],
) -> Result<(String, Option<Grammar>), String> {
    let b: ChatBody = request::parse(&Bytes::copy_from_slice(body)).map_err(|e| e.message)?;
    let parts = ToolsIn {
        tools: b.tools.as_deref(),
        choice: b.tool_choice.as_ref(),
        parallel: b.parallel_tool_calls,
        kwargs: b.chat_template_kwargs.as_ref(),
    };
    let (rendered, ctx) =
        chat_request::render(template, b.messages, parts, true).map_err(|e| e.message)?;
    let grammar = request::request_grammar(&b.common, ctx.as_ref()).map_err(|e| e.message)?;
    Ok((rendered, grammar.map(|g| g.1)))
}
