//! `ferrum`: run LLMs from GGUF files on the CPU.

mod cmd;
mod common;
mod onnx_run;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "ferrum", version, about = "ferrum: an inference engine for LLMs on the CPU", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Continue a prompt, streaming the text to stdout (or one JSON object with --json).
    Generate(cmd::generate::Args),
    /// Interactive chat using the model's chat template; reads user turns from stdin (a TTY or a pipe).
    Chat(cmd::chat::Args),
    /// Perplexity of a text file, computed the way llama.cpp's perplexity tool does.
    Perplexity(cmd::perplexity::Args),
    /// Print a GGUF file's architecture, hyperparameters, tokenizer, chat template and tensors.
    Info(cmd::info::Args),
    /// Prompt-processing and generation speed (llama-bench's table), or this machine's ceilings (--machine).
    Bench(cmd::bench::Args),
    /// Per-operator time, FLOPs, bytes and roofline position of a prompt and a generation.
    Profile(cmd::profile::Args),
    /// Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions).
    Serve(cmd::serve::Args),
    /// Run an ONNX model on inputs from ONNX test data (.pb) or NumPy (.npy) files.
    Run(onnx_run::RunArgs),
    /// Describe an ONNX model: opsets, inputs and outputs, op histogram, parameters, FLOPs.
    Inspect(onnx_run::InspectArgs),
}

/// Keeps freed memory in the process: the forward pass allocates activation buffers of a few MB
/// per operator, and glibc would otherwise map fresh (zero-filled) pages for each of them.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc malloc parameters; called before any other thread runs.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 512 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

fn main() {
    tune_allocator();
    common::init_logging();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(a) => cmd::generate::run(a),
        Command::Chat(a) => cmd::chat::run(a),
        Command::Perplexity(a) => cmd::perplexity::run(a),
        Command::Info(a) => cmd::info::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Profile(a) => cmd::profile::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Run(a) => onnx_run::run(a),
        Command::Inspect(a) => onnx_run::inspect(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
