use std::io::Write;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use ferrum_llm::grammar::{Constraint, Grammar, Grammars};
use ferrum_llm::{generate, FinishReason, GenerateRequest};
use serde_json::json;

use crate::common::{ModelArgs, SamplingArgs};

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt (raw text; the chat template is not applied).
    #[arg(short, long)]
    pub prompt: String,
    /// Generate at most N tokens.
    #[arg(short = 'n', long, default_value_t = 128)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Stop when this text is generated (repeatable); the stop text is not printed.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Context size in tokens (prompt + generated).
    #[arg(short, long, default_value_t = 4096)]
    pub ctx_size: usize,
    /// Parse special-token text such as <|im_start|> in the prompt as those tokens.
    #[arg(long)]
    pub parse_special: bool,
    /// Print one JSON object (prompt_tokens, tokens, text, finish_reason, timings) instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// With --json: also report the K most likely tokens and their log-probabilities at each position.
    #[arg(long, default_value_t = 0)]
    pub top_logprobs: usize,
    /// Feed these token ids (comma-separated) instead of sampling, still reporting --top-logprobs at
    /// every position: scores a given continuation (teacher forcing).
    #[arg(long, value_delimiter = ',')]
    pub force_tokens: Option<Vec<u32>>,
    /// Print prompt and generation speed to stderr at the end.
    #[arg(long)]
    pub timings: bool,
    /// Constrain the output to JSON valid under this JSON Schema (the schema's text, or @FILE).
    #[arg(short = 'j', long, value_name = "SCHEMA")]
    pub json_schema: Option<String>,
    /// Constrain the output to this GBNF grammar (llama.cpp's syntax; the text, or @FILE).
    #[arg(long, value_name = "GBNF", conflicts_with = "json_schema")]
    pub grammar: Option<String>,
    /// Constrain the output to text matching this regular expression as a whole.
    #[arg(long, value_name = "REGEX", conflicts_with_all = ["json_schema", "grammar"])]
    pub regex: Option<String>,
}

/// A flag's text, or the contents of the file it names as `@FILE`.
fn text_or_file(v: &str) -> Result<String> {
    match v.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("reading {path}")),
        None => Ok(v.to_string()),
    }
}

/// The grammar the flags ask for, compiled for `llm`'s vocabulary.
fn constraint(a: &Args, llm: &ferrum_llm::Llm) -> Result<Option<Constraint>> {
    let grammar = if let Some(s) = &a.json_schema {
        let text = text_or_file(s)?;
        let schema = serde_json::from_str(&text).context("--json-schema is not valid JSON")?;
        Grammar::JsonSchema(schema)
    } else if let Some(g) = &a.grammar {
        Grammar::Gbnf(text_or_file(g)?)
    } else if let Some(r) = &a.regex {
        Grammar::Regex(r.clone())
    } else {
        return Ok(None);
    };
    let grammars = Grammars::new(std::sync::Arc::clone(&llm.tokenizer))?;
    Ok(Some(grammars.compile(&grammar)?))
}

pub fn run(a: Args) -> Result<()> {
    let llm = a.model.load()?;
    let prompt = llm.tokenizer.encode(&a.prompt, true, a.parse_special);
    let constraint = constraint(&a, &llm)?;
    let req = GenerateRequest {
        prompt: prompt.clone(),
        max_tokens: a.max_tokens,
        sampling: a.sampling.params()?,
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
        force_tokens: a.force_tokens.clone(),
        top_logprobs: a.top_logprobs,
        ctx_size: a.ctx_size,
        constraint,
    };
    let stdout = std::io::stdout();
    let g = if a.json {
        generate(&llm, &req, &mut |_| {})?
    } else {
        let mut lock = stdout.lock();
        let g = generate(&llm, &req, &mut |s| {
            let _ = lock.write_all(s.as_bytes());
            let _ = lock.flush();
        })?;
        writeln!(lock).context("writing to stdout")?;
        g
    };
    if a.json {
        let tok = &llm.tokenizer;
        let mut obj = json!({
            "model": llm.name,
            "prompt_tokens": prompt,
            "tokens": g.tokens,
            "text": g.text,
            "finish_reason": match g.finish { FinishReason::Length => "length", FinishReason::Stop => "stop" },
            "timings": {
                "prompt_tokens_per_second": g.prompt_tokens_per_second(),
                "tokens_per_second": g.tokens_per_second(),
            },
        });
        if a.top_logprobs > 0 {
            obj["top_logprobs"] = g
                .top_logprobs
                .iter()
                .map(|pos| {
                    pos.iter()
                        .map(|&(id, lp)| {
                            json!({"id": id, "token": String::from_utf8_lossy(&tok.token_bytes(id, true)), "logprob": lp})
                        })
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
                .into();
        }
        println!("{obj}");
    }
    if a.timings {
        eprintln!(
            "prompt: {} tokens, {:.1} tokens/s | generation: {} tokens, {:.1} tokens/s",
            g.prompt_tokens,
            g.prompt_tokens_per_second(),
            g.tokens.len(),
            g.tokens_per_second()
        );
    }
    Ok(())
}
