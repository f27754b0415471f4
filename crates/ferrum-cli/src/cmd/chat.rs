use std::io::{BufRead, IsTerminal, Write};

use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use ferrum_llm::{generate, GenerateRequest};
use ferrum_tokenizer::{ChatMessage, ChatTemplate};

use crate::common::{ModelArgs, SamplingArgs};

/// Gemma's turn format, used when a Gemma file carries no template of its own.
const GEMMA_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}{% if role == 'system' %}{{ '<start_of_turn>user\n' + m['content'] + '\n\n' }}{% else %}{% if not (loop.index0 == 1 and messages[0]['role'] == 'system') %}{{ '<start_of_turn>' + role + '\n' }}{% endif %}{{ m['content'] + '<end_of_turn>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}";

/// ChatML, the fallback for models without a template.
const CHATML_TEMPLATE: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A system message to start the conversation with.
    #[arg(long)]
    pub system: Option<String>,
    /// At most N tokens per reply.
    #[arg(short = 'n', long, default_value_t = 512)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Context size in tokens (the whole conversation must fit).
    #[arg(short, long, default_value_t = 4096)]
    pub ctx_size: usize,
}

pub fn run(a: Args) -> Result<()> {
    let llm = a.model.load()?;
    let tok = &llm.tokenizer;
    let piece = |id: Option<u32>| {
        id.map(|i| String::from_utf8_lossy(&tok.token_bytes(i, true)).into_owned())
            .unwrap_or_default()
    };
    let (bos, eos) = (piece(tok.bos()), piece(tok.eos()));
    let source = match &llm.chat_template {
        Some(t) => t.clone(),
        None if llm.model.config.arch == ferrum_llm::model::Arch::Gemma3 => {
            GEMMA_TEMPLATE.to_string()
        }
        None => CHATML_TEMPLATE.to_string(),
    };
    let template = ChatTemplate::new(&source, &bos, &eos)?;
    let sampling = a.sampling.params()?;
    let interactive = std::io::stdin().is_terminal();
    let mut messages: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &a.system {
        messages.push(ChatMessage {
            role: "system".into(),
            content: s.clone(),
        });
    }
    if interactive {
        eprintln!("ferrum chat with {} (Ctrl-D to quit)", llm.name);
    }
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            eprint!("> ");
            std::io::stderr().flush().ok();
        }
        let Some(line) = lines.next() else { break };
        let line = line.context("reading stdin")?;
        if line.trim().is_empty() {
            continue;
        }
        messages.push(ChatMessage {
            role: "user".into(),
            content: line,
        });
        let rendered = template.render(&messages, true)?;
        // A template that writes the BOS text itself must not get a second BOS.
        let add_special = bos.is_empty() || !rendered.starts_with(&bos);
        let prompt = tok.encode(&rendered, add_special, true);
        let req = GenerateRequest {
            prompt,
            max_tokens: a.max_tokens,
            sampling: sampling.clone(),
            stop: Vec::new(),
            ignore_eos: false,
            force_tokens: None,
            top_logprobs: 0,
            ctx_size: a.ctx_size,
        };
        let mut out = std::io::stdout().lock();
        let g = generate(&llm, &req, &mut |s| {
            let _ = out.write_all(s.as_bytes());
            let _ = out.flush();
        })?;
        writeln!(out)?;
        messages.push(ChatMessage {
            role: "assistant".into(),
            content: g.text.trim().to_string(),
        });
    }
    Ok(())
}
