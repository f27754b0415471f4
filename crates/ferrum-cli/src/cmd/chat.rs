use std::io::{BufRead, IsTerminal, Write};

use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use ferrum_llm::{generate, GenerateRequest};
use ferrum_tokenizer::ChatMessage;

use crate::common::{ModelArgs, SamplingArgs};

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
    let template = llm.chat_template()?;
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
        let prompt = llm.encode_chat(&template, &messages)?;
        let req = GenerateRequest {
            prompt,
            max_tokens: a.max_tokens,
            sampling: sampling.clone(),
            stop: Vec::new(),
            ignore_eos: false,
            force_tokens: None,
            top_logprobs: 0,
            ctx_size: a.ctx_size,
            constraint: None,
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
