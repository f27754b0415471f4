use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use std::path::PathBuf;

use crate::common::ModelArgs;

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text file to score.
    #[arg(short, long)]
    pub file: PathBuf,
    /// Tokens per chunk; the second half of each chunk is scored.
    #[arg(short, long, default_value_t = 512)]
    pub ctx: usize,
}

pub fn run(a: Args) -> Result<()> {
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    let llm = a.model.load()?;
    let start = std::time::Instant::now();
    let r = ferrum_llm::perplexity::perplexity(&llm, &text, a.ctx, &mut |i, n, ppl| {
        eprintln!("[{i}/{n}] running PPL = {ppl:.4}");
    })?;
    eprintln!(
        "{} tokens, {} chunks of {}, {} scored, {:.1} s",
        r.n_tokens,
        r.n_chunks,
        a.ctx,
        r.n_scored,
        start.elapsed().as_secs_f64()
    );
    println!("Final estimate: PPL = {:.4} +/- {:.5}", r.ppl, r.ppl_stderr);
    println!("PPL = {:.4}", r.ppl);
    Ok(())
}
