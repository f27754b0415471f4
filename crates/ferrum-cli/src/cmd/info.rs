use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args as ClapArgs;
use ferrum_gguf::GgufFile;
use ferrum_llm::Config;

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// The GGUF file to describe.
    pub path: PathBuf,
    /// Print every tensor (default: the first 40 and a per-type summary).
    #[arg(long)]
    pub all_tensors: bool,
}

fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", b / (1024.0 * 1024.0 * 1024.0))
    } else if b >= 1024.0 * 1024.0 {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

pub fn run(a: Args) -> Result<()> {
    if a.path.is_dir() {
        bail!("{} is a directory, not a GGUF file", a.path.display());
    }
    let f = GgufFile::open(&a.path)?;
    println!("file: {} ({})", a.path.display(), human(f.file_size()));
    println!(
        "GGUF v{}, {} metadata keys, {} tensors, alignment {}, data at byte {}",
        f.version,
        f.metadata.len(),
        f.tensors.len(),
        f.alignment,
        f.data_offset
    );
    println!("architecture: {}", f.architecture().unwrap_or("(none)"));
    match Config::from_gguf(&f) {
        Ok(c) => {
            println!("\nhyperparameters:");
            println!(
                "  layers {}  embedding {}  feed-forward {}  vocab {}",
                c.n_layer, c.n_embd, c.n_ff, c.n_vocab
            );
            println!(
                "  heads {}  kv heads {}  head dim {}  rope dims {} ({:?}, base {})",
                c.n_head, c.n_head_kv, c.head_dim, c.n_rot, c.rope_style, c.rope_base
            );
            println!(
                "  rms eps {:e}  trained context {}",
                c.rms_eps, c.n_ctx_train
            );
            if let Some(w) = c.sliding_window {
                if c.swa_pattern > 1 {
                    println!(
                        "  sliding window {w} (one layer in {} global, local rope base {})",
                        c.swa_pattern, c.rope_base_swa
                    );
                } else {
                    println!("  sliding window {w} on every layer");
                }
            }
            if c.attn_softcap.is_some() || c.final_softcap.is_some() {
                let show = |v: Option<f32>| v.map_or("none".to_string(), |c| c.to_string());
                println!(
                    "  logit soft-capping: attention {}, final {}",
                    show(c.attn_softcap),
                    show(c.final_softcap)
                );
            }
            let rs = &c.rope_scaling;
            if let Some(lr) = &c.long_rope {
                let range = |ff: &Option<Vec<f32>>| {
                    let ff = ff.as_deref().unwrap_or(&[]);
                    let (lo, hi) = ff
                        .iter()
                        .fold((f32::MAX, f32::MIN), |(a, b), &f| (a.min(f), b.max(f)));
                    format!("[{lo}, {hi}]")
                };
                println!(
                    "  rope scaling: LongRoPE, short factors {} up to {} positions, long factors {} \
                     past it (chosen by the context size), attn factor {}",
                    range(&lr.short.freq_factors),
                    lr.n_ctx_orig,
                    range(&lr.long.freq_factors),
                    lr.short.yarn.map_or(1.0, |y| y.attn_factor)
                );
            } else if !rs.is_identity() {
                let mut parts = Vec::new();
                if rs.freq_scale != 1.0 {
                    parts.push(format!("factor {} (linear)", 1.0 / rs.freq_scale));
                }
                if let Some(y) = &rs.yarn {
                    parts.push(format!(
                        "YaRN over original context {} (beta fast {}, slow {}, attn factor {})",
                        y.n_ctx_orig, y.beta_fast, y.beta_slow, y.attn_factor
                    ));
                }
                if let Some(ff) = &rs.freq_factors {
                    let (lo, hi) = ff
                        .iter()
                        .fold((f32::MAX, f32::MIN), |(a, b), &f| (a.min(f), b.max(f)));
                    parts.push(format!(
                        "{} per-pair frequency factors in [{lo}, {hi}]",
                        ff.len()
                    ));
                }
                println!("  rope scaling: {}", parts.join(", "));
            }
            if let Some(m) = &c.moe {
                use ferrum_llm::model::config::{ExpertAct, Gating};
                println!(
                    "  experts {} ({} per token, expert feed-forward {}, {}, weights {}, {})",
                    m.n_expert,
                    m.n_expert_used,
                    m.n_ff_exp,
                    match m.gating {
                        Gating::Softmax => "softmax over all, then top k",
                        Gating::SoftmaxWeight => "top k, then softmax over them",
                    },
                    if m.norm { "renormalised" } else { "as routed" },
                    match m.act {
                        ExpertAct::Silu => "SwiGLU",
                        ExpertAct::SwigluOai => "clamped SwiGLU (alpha 1.702, limit 7)",
                    }
                );
            }
            if f.tensor("blk.0.attn_sinks.weight").is_some() {
                println!("  attention sinks: one learned logit per head, every layer");
            }
            // What a position of context costs in the KV cache, per storage type.
            let per_token = |t: ferrum_core::DType| {
                let mut c = c.clone();
                c.kv_type = t;
                match ferrum_llm::model::kv_cache::check_kv_type(&c) {
                    Ok(()) => format!(
                        "{t} {:.1} KiB",
                        ferrum_llm::model::KvPool::bytes_per_token(&c) as f64 / 1024.0
                    ),
                    Err(_) => format!("{t} n/a"),
                }
            };
            let kinds: Vec<String> = ferrum_llm::model::kv_cache::KV_TYPES
                .into_iter()
                .map(per_token)
                .collect();
            println!("  KV cache per token: {}", kinds.join(", "));
        }
        Err(e) => println!("\nhyperparameters: not runnable by ferrum: {e}"),
    }
    println!("\nmetadata:");
    let mut template = None;
    for (k, v) in &f.metadata {
        if k == "tokenizer.chat_template" {
            template = v.as_str();
            continue;
        }
        println!("  {k} = {v}");
    }
    match ferrum_tokenizer::Tokenizer::from_gguf(&f) {
        Ok(t) => println!(
            "\ntokenizer: {} tokens, bos {:?}, eos {:?}, adds bos: {}",
            t.vocab_size(),
            t.bos(),
            t.eos(),
            t.add_bos()
        ),
        Err(e) => println!("\ntokenizer: cannot be built: {e}"),
    }
    match template {
        Some(t) => println!("\nchat template:\n{t}"),
        None => println!("\nchat template: (none in the file)"),
    }
    println!("\ntensors:");
    println!(
        "  {:<40} {:<6} {:>20} {:>12}",
        "name", "type", "shape", "bytes"
    );
    let mut by_type: BTreeMap<&str, (usize, u64, u64)> = BTreeMap::new();
    let (mut total_bytes, mut total_elems) = (0u64, 0u64);
    for (i, t) in f.tensors.iter().enumerate() {
        if a.all_tensors || i < 40 {
            let shape = format!("{:?}", t.dims);
            println!(
                "  {:<40} {:<6} {:>20} {:>12}",
                t.name,
                t.dtype.name(),
                shape,
                t.n_bytes
            );
        } else if i == 40 {
            println!(
                "  ... {} more (--all-tensors lists them)",
                f.tensors.len() - 40
            );
        }
        let e = by_type.entry(t.dtype.name()).or_default();
        e.0 += 1;
        e.1 += t.n_elements();
        e.2 += t.n_bytes;
        total_bytes += t.n_bytes;
        total_elems += t.n_elements();
    }
    println!("\nby type:");
    for (ty, (n, elems, bytes)) in &by_type {
        println!(
            "  {ty:<6} {n:>5} tensors {elems:>12} elements {:>12}",
            human(*bytes)
        );
    }
    println!(
        "total: {} tensors, {} parameters, {} ({:.2} bits per weight)",
        f.tensors.len(),
        total_elems,
        human(total_bytes),
        total_bytes as f64 * 8.0 / total_elems.max(1) as f64
    );
    Ok(())
}
