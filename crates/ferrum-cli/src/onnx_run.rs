//! `ferrum run` and `ferrum inspect` for ONNX models.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use ferrum_graph::fmt_dims;
use ferrum_graph::ir::{Attr, ValueType};
use ferrum_graph::onnx::{value_from_bytes, value_to_bytes};
use ferrum_graph::{DType, Data, OptLevel, Precision, Session, SessionOptions, Tensor, Value};

/// Exit status for unsupported ops and types (the conformance runner reports these apart).
pub const EXIT_UNSUPPORTED: i32 = 3;

#[derive(ClapArgs, Debug)]
pub struct RunArgs {
    /// The ONNX model (.onnx) to run.
    #[arg(long, short = 'm')]
    pub model: PathBuf,
    /// A folder of ONNX test data: input_0.pb, input_1.pb, ... (TensorProto, or SequenceProto /
    /// OptionalProto for those input kinds), one per graph input that has no initializer, in
    /// graph-input order.
    #[arg(long)]
    pub inputs: Option<PathBuf>,
    /// One named input from a NumPy .npy file, as NAME=FILE.npy (repeatable; combines with
    /// --inputs, and overrides it for that name).
    #[arg(long = "input", value_name = "NAME=FILE.npy")]
    pub input: Vec<String>,
    /// A folder to write the outputs to: output_0.pb, output_1.pb, ... in graph-output order
    /// (created if missing); when --input was given, also NAME.npy for each tensor output.
    #[arg(long)]
    pub outputs: Option<PathBuf>,
    /// Print nothing but errors (and the timing line of --repeat).
    #[arg(long, short = 'q')]
    pub quiet: bool,
    /// Threads the kernels use (default: every core).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// After the first run (a warm-up, whose outputs are written), run the model N more times on
    /// the same inputs and print the median, minimum and mean time of those runs (model loading
    /// and file I/O excluded), after a line with the session creation time (load, import, graph
    /// passes).
    #[arg(long, default_value_t = 0)]
    pub repeat: usize,
    /// With --repeat: also print the time spent per op type over the timed runs (fused nodes
    /// under their fused name, e.g. com.ferrum.FusedConv), then the slowest nodes (see
    /// --profile-nodes): time per run, share, achieved GFLOP/s (for ops with an operation
    /// count: products, convolutions, pools, normalisations, elementwise) and the shapes each
    /// ran with.
    #[arg(long)]
    pub profile: bool,
    /// With --profile: how many of the slowest nodes to list (0 lists every node).
    #[arg(long, default_value_t = 20)]
    pub profile_nodes: usize,
    /// Graph optimisation level, as ONNX Runtime's: 0 runs the graph as imported; 1 folds
    /// constants, removes Identity/Dropout and dead nodes, and folds BatchNormalization (and
    /// constant Add/Mul) into the preceding Conv, and a constant Mul/Div after a MatMul by a
    /// constant matrix (and its bias Add) into that matrix; 2 also fuses GELU, biases, residual adds and
    /// activations into the Conv/Gemm/MatMul that produces them; 3 (the default) also runs
    /// chains of depthwise and dense convolutions (MobileNet's and EfficientNet's blocks, their
    /// squeeze-and-excitation pools and gates included) channels-last (f32; a
    /// large 1x1 expansion made row by row inside the depthwise convolution that reads it), and
    /// chains of 8-bit QLinearConvs and QLinearAdds (a statically quantized ResNet's blocks),
    /// and pools a channels-last tensor without turning it back to NCHW first.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=3))]
    pub opt_level: u32,
    /// Arithmetic of the float MatMul/Gemm/Conv products with constant weights: f32 (the
    /// default), or bf16 (opt-in: weights and activations rounded to bf16, sums in f32, on the
    /// AMX tile unit, about 3x the f32 GEMM's speed, or else on AVX512-BF16's dot product, about
    /// 2x; relative errors around 1e-2). Where the CPU has neither, bf16 warns and runs f32.
    /// Needs --opt-level 1 or more.
    #[arg(long, value_enum, default_value_t = PrecisionArg::F32)]
    pub precision: PrecisionArg,
    /// Keep the heap (weights, their packed copies, activation buffers) on transparent huge
    /// pages where the system gives them only on request (Linux with glibc, huge pages set to
    /// `madvise`): the process then runs itself again with glibc's `glibc.malloc.hugetlb=1`
    /// tunable added to GLIBC_TUNABLES (unless that already names it), so that every stretch
    /// of heap glibc maps is advised before use. Products that stream their weights from
    /// memory then take fewer TLB misses: on an AMD Zen 4 0-7% faster depending on the host's
    /// load (MobileNetV2 0.93-1.0x the time, ResNet-50 0.84-1.06x, BERT-base 0.98x). The cost
    /// is at session creation, where each huge page is zeroed as it is first touched: on that
    /// (virtual) host up to 1-1.5 s more for the 350-440 MB transformers, while the small CNNs
    /// often loaded faster. `auto` (the default): on for model files up to 256 MiB; `on`,
    /// `off`: always, never (`off` keeps the system's default).
    #[arg(long, value_enum, default_value_t = HugePages::Auto)]
    pub huge_pages: HugePages,
}

/// `--huge-pages`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum HugePages {
    Auto,
    On,
    Off,
}

/// The largest model file `--huge-pages auto` puts on huge pages: past it, zeroing fresh huge
/// pages at session creation cost more (up to 1.5 s for BERT-base's 440 MB) than its runs gain.
const HUGE_PAGES_AUTO_MAX_BYTES: u64 = 256 << 20;

/// `--precision`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrecisionArg {
    F32,
    Bf16,
}

impl From<PrecisionArg> for Precision {
    fn from(p: PrecisionArg) -> Precision {
        match p {
            PrecisionArg::F32 => Precision::F32,
            PrecisionArg::Bf16 => Precision::Bf16,
        }
    }
}

#[derive(ClapArgs, Debug)]
pub struct InspectArgs {
    /// The ONNX model (.onnx) to describe.
    pub model: PathBuf,
    /// Describe the graph as it runs, after the optimisation passes (see --opt-level), with
    /// the node count before and after and what was fused where; without it, the graph as
    /// imported.
    #[arg(long)]
    pub optimized: bool,
    /// With --optimized: the optimisation level (0-3, as `ferrum run --opt-level`).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=3))]
    pub opt_level: u32,
    /// With --optimized: the precision of the prepacked products (as `ferrum run --precision`).
    #[arg(long, value_enum, default_value_t = PrecisionArg::F32)]
    pub precision: PrecisionArg,
}

/// How the session's prepacked products compute.
fn precision_name(p: Precision) -> String {
    match (p, ferrum_kernels::gemm::bf16_unit()) {
        (Precision::Bf16, Some(unit)) => format!("bf16 ({unit})"),
        (Precision::Bf16, None) => "bf16".into(),
        (Precision::F32, _) => "f32".into(),
    }
}

/// Runs `f`, and exits with status 3 when it failed on an unsupported op or type.
fn exit_unsupported<T>(r: Result<T>) -> Result<T> {
    if let Err(e) = &r {
        if let Some(g) = e.downcast_ref::<ferrum_graph::Error>() {
            if g.is_unsupported() {
                eprintln!("error: {e:#}");
                std::process::exit(EXIT_UNSUPPORTED);
            }
        }
    }
    r
}

pub fn run(a: RunArgs) -> Result<()> {
    let huge = match a.huge_pages {
        HugePages::On => true,
        HugePages::Off => false,
        HugePages::Auto => {
            std::fs::metadata(&a.model).is_ok_and(|m| m.len() <= HUGE_PAGES_AUTO_MAX_BYTES)
        }
    };
    if huge {
        run_on_huge_pages();
    }
    exit_unsupported(run_inner(a))
}

/// glibc's tunable that advises its heap onto transparent huge pages as it maps it.
const HUGE_PAGE_TUNABLE: &str = "glibc.malloc.hugetlb";

/// For `--huge-pages`: runs this process again (same arguments, `exec`: same process id and
/// streams) with [`HUGE_PAGE_TUNABLE`]`=1` added to GLIBC_TUNABLES, which glibc reads only as a
/// process starts, where the system gives huge pages on request only. Returns (and the run
/// goes on as it is) where that is already set, not needed or not possible.
fn run_on_huge_pages() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::process::CommandExt;
        let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
        if tunables.contains(HUGE_PAGE_TUNABLE) {
            tracing::info!("huge pages as GLIBC_TUNABLES sets them: {tunables}");
            return;
        }
        let on_request = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| s.contains("[madvise]"));
        if !on_request {
            return;
        }
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        let value = if tunables.is_empty() {
            format!("{HUGE_PAGE_TUNABLE}=1")
        } else {
            format!("{tunables}:{HUGE_PAGE_TUNABLE}=1")
        };
        let mut args = std::env::args_os();
        let mut cmd = std::process::Command::new(exe);
        if let Some(arg0) = args.next() {
            cmd.arg0(arg0);
        }
        // `exec` returns only on failure; the run then goes on with the pages it has.
        let err = cmd.args(args).env("GLIBC_TUNABLES", value).exec();
        tracing::debug!("running again on huge pages failed: {err}");
    }
}

fn run_inner(a: RunArgs) -> Result<()> {
    crate::common::set_threads(a.threads)?;
    let opts = SessionOptions {
        opt_level: OptLevel::from_number(a.opt_level),
        precision: a.precision.into(),
    };
    let created = std::time::Instant::now();
    let session = Session::from_file_with(&a.model, &opts)?;
    let created = created.elapsed().as_secs_f64() * 1e3;
    let model = session.model();
    let g = &model.graph;
    let runtime = g.runtime_inputs();
    let mut inputs: Vec<(String, Value)> = Vec::new();
    if let Some(dir) = &a.inputs {
        for (j, id) in runtime.iter().enumerate() {
            let info = model.value(*id);
            let p = dir.join(format!("input_{j}.pb"));
            if !p.exists() {
                if a.input
                    .iter()
                    .any(|s| s.split_once('=').map(|x| x.0) == Some(&info.name))
                {
                    continue;
                }
                bail!("{} is missing (input '{}')", p.display(), info.name);
            }
            let bytes = std::fs::read(&p).with_context(|| p.display().to_string())?;
            let v = value_from_bytes(&bytes, &info.ty)
                .with_context(|| format!("reading {}", p.display()))?;
            inputs.push((info.name.clone(), v));
        }
    }
    for spec in &a.input {
        let (name, file) = spec
            .split_once('=')
            .with_context(|| format!("--input '{spec}' is not NAME=FILE.npy"))?;
        let t = read_npy(Path::new(file))?;
        inputs.retain(|(n, _)| n != name);
        inputs.push((name.to_string(), Value::Tensor(t)));
    }
    if a.inputs.is_none() && a.input.is_empty() && !runtime.is_empty() {
        bail!(
            "the model has {} inputs: give --inputs DIR or --input NAME=FILE.npy",
            runtime.len()
        );
    }
    let outs = if a.repeat > 0 {
        let outs = session.run(inputs.clone())?;
        ferrum_graph::exec::set_op_profiling(a.profile);
        let mut ms = Vec::with_capacity(a.repeat);
        for _ in 0..a.repeat {
            let feed = inputs.clone();
            let t = std::time::Instant::now();
            let o = session.run(feed)?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            drop(o);
        }
        let r = session.optimization_report();
        println!(
            "session: {created:.1} ms (load, import and graph passes, {} -> {} nodes, {} \
             products)",
            r.nodes_before,
            r.nodes_after,
            precision_name(r.precision)
        );
        println!("{}", timing_line(&ms));
        let mem = session.memory();
        println!(
            "tensor memory: the last run reused {} freed buffers, wrote {} outputs into an input's \
             memory and allocated {}; {:.1} MiB kept for the next run",
            mem.reused,
            session.outputs_in_place(),
            mem.allocated,
            mem.held_bytes as f64 / (1u64 << 20) as f64
        );
        if a.profile {
            let prof = ferrum_graph::exec::op_profile();
            let total: f64 = prof.iter().map(|p| p.2).sum();
            println!(
                "{:<24} {:>6} {:>10} {:>6}",
                "op", "nodes", "ms/run", "share"
            );
            for (op, nodes, s) in prof {
                println!(
                    "{op:<24} {:>6} {:>10.3} {:>5.1}%",
                    nodes / a.repeat,
                    s * 1e3 / a.repeat as f64,
                    100.0 * s / total.max(1e-12)
                );
            }
            print_nodes(
                &ferrum_graph::exec::node_profile(),
                a.repeat,
                total,
                a.profile_nodes,
            );
            ferrum_graph::exec::set_op_profiling(false);
        }
        outs
    } else {
        session.run(inputs)?
    };
    if let Some(dir) = &a.outputs {
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
        for (j, (name, v)) in outs.iter().enumerate() {
            let p = dir.join(format!("output_{j}.pb"));
            std::fs::write(&p, value_to_bytes(v, name)).with_context(|| p.display().to_string())?;
            if !a.input.is_empty() {
                if let Value::Tensor(t) = v {
                    let safe: String = name
                        .chars()
                        .map(|c| {
                            if c.is_alphanumeric() || c == '_' || c == '-' || c == '.' {
                                c
                            } else {
                                '_'
                            }
                        })
                        .collect();
                    let p = dir.join(format!("{safe}.npy"));
                    write_npy(&p, t)?;
                }
            }
        }
    }
    if !a.quiet {
        for (name, v) in &outs {
            println!("{name}: {}", describe(v));
        }
    }
    Ok(())
}

/// `time: median M ms, min M ms, mean M ms over N runs, T threads` for `--repeat`.
fn timing_line(ms: &[f64]) -> String {
    let mut v = ms.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    format!(
        "time: median {median:.3} ms, min {:.3} ms, mean {:.3} ms over {n} runs, {} threads",
        v[0],
        v.iter().sum::<f64>() / n as f64,
        ferrum_kernels::pool::threads()
    )
}

/// One line: type, shape and a summary of the values.
fn describe(v: &Value) -> String {
    match v {
        Value::Tensor(t) => {
            let mut s = format!("{} {:?}", t.dtype(), t.shape());
            match t.data() {
                Data::Str(v) => s += &format!(" first: {:?}", &v[..v.len().min(4)]),
                Data::Bool(v) => {
                    s += &format!(" true: {}/{}", v.iter().filter(|b| **b).count(), v.len())
                }
                _ => {
                    if let Ok(f) = t.to_f64_vec() {
                        if !f.is_empty() {
                            let min = f.iter().copied().fold(f64::INFINITY, f64::min);
                            let max = f.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                            let mean = f.iter().sum::<f64>() / f.len() as f64;
                            let first: Vec<String> =
                                f.iter().take(4).map(|x| format!("{x:.6}")).collect();
                            s += &format!(
                                " min {min:.6} max {max:.6} mean {mean:.6} first [{}]",
                                first.join(", ")
                            );
                        }
                    }
                }
            }
            s
        }
        Value::Sequence(ts) => format!("sequence of {} tensors", ts.len()),
        Value::Optional(None) => "empty optional".into(),
        Value::Optional(Some(v)) => format!("optional {}", describe(v)),
    }
}

fn npy_descr(dt: DType) -> Option<&'static str> {
    Some(match dt {
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::F16 => "<f2",
        DType::I8 => "|i1",
        DType::I16 => "<i2",
        DType::I32 => "<i4",
        DType::I64 => "<i8",
        DType::U8 => "|u1",
        DType::U16 => "<u2",
        DType::U32 => "<u4",
        DType::U64 => "<u8",
        DType::Bool => "|b1",
        _ => return None,
    })
}

/// Reads a NumPy .npy file (C order, little-endian numeric or bool dtypes).
pub fn read_npy(path: &Path) -> Result<Tensor> {
    let bytes = std::fs::read(path).with_context(|| path.display().to_string())?;
    let bad = |m: &str| anyhow::anyhow!("{}: not a supported .npy file: {m}", path.display());
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("bad magic"));
    }
    let (hlen, start) = if bytes[6] == 1 {
        (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10)
    } else {
        if bytes.len() < 12 {
            return Err(bad("truncated header"));
        }
        (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        )
    };
    let header = bytes
        .get(start..start + hlen)
        .ok_or_else(|| bad("truncated header"))?;
    let header = String::from_utf8_lossy(header);
    let field = |key: &str| -> Option<String> {
        let i = header.find(&format!("'{key}'"))?;
        let rest = &header[i + key.len() + 2..];
        let rest = rest.trim_start().strip_prefix(':')?.trim_start();
        Some(rest.to_string())
    };
    let descr = field("descr").ok_or_else(|| bad("no descr"))?;
    let descr = descr
        .trim_start_matches('\'')
        .split('\'')
        .next()
        .unwrap_or("")
        .to_string();
    if field("fortran_order").is_some_and(|f| f.starts_with("True")) {
        return Err(bad("Fortran order"));
    }
    let shape_s = field("shape").ok_or_else(|| bad("no shape"))?;
    let inner = shape_s
        .trim_start_matches('(')
        .split(')')
        .next()
        .unwrap_or("");
    let shape: Vec<usize> = inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| bad("bad shape")))
        .collect::<Result<_>>()?;
    let dt = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::Bool,
    ]
    .into_iter()
    .find(|d| {
        npy_descr(*d).is_some_and(|n| n == descr || n[1..] == descr[1..] && descr.starts_with('='))
            || (descr == "<b1" && *d == DType::Bool)
            || (descr == "<u1" && *d == DType::U8)
            || (descr == "<i1" && *d == DType::I8)
    })
    .ok_or_else(|| bad(&format!("dtype '{descr}'")))?;
    let data = &bytes[start + hlen..];
    let proto = ferrum_graph::proto::TensorProto {
        dims: shape.iter().map(|&d| d as i64).collect(),
        data_type: dt.onnx(),
        raw_data: data.to_vec().into(),
        ..Default::default()
    };
    Ok(ferrum_graph::onnx::tensor_from_proto(&proto, None)?)
}

/// Writes a tensor as a NumPy .npy file (version 1.0).
pub fn write_npy(path: &Path, t: &Tensor) -> Result<()> {
    let Some(descr) = npy_descr(t.dtype()) else {
        bail!("{} tensors cannot be written as .npy", t.dtype());
    };
    let shape = match t.shape() {
        [] => "()".to_string(),
        [d] => format!("({d},)"),
        s => format!(
            "({})",
            s.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&ferrum_graph::onnx::tensor_to_proto(t, "").raw_data);
    std::fs::write(path, out).with_context(|| path.display().to_string())
}

fn fmt_type(ty: &ValueType) -> String {
    match ty {
        ValueType::Tensor { dtype, shape } => format!(
            "{} {}",
            dtype.map_or("?".to_string(), |d| d.to_string()),
            shape.as_ref().map_or("[?]".to_string(), |s| fmt_dims(s))
        ),
        ValueType::Sequence(t) => format!("sequence<{}>", fmt_type(t)),
        ValueType::Optional(t) => format!("optional<{}>", fmt_type(t)),
        ValueType::Other(s) => s.clone(),
        ValueType::Unknown => "?".into(),
    }
}

fn human(n: f64) -> String {
    if n <= 0.0 {
        return "0".into();
    }
    for (s, u) in [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")] {
        if n >= s {
            return format!("{:.2}{u}", n / s);
        }
    }
    format!("{n:.0}")
}

pub fn inspect(a: InspectArgs) -> Result<()> {
    exit_unsupported(inspect_inner(a))
}

fn inspect_inner(a: InspectArgs) -> Result<()> {
    let level = if a.optimized {
        OptLevel::from_number(a.opt_level)
    } else {
        OptLevel::Disabled
    };
    let (model, report, unsupported) = Session::inspect_file_with(
        &a.model,
        &SessionOptions {
            opt_level: level,
            precision: a.precision.into(),
        },
    )?;
    let m = &model;
    let g = &m.graph;
    println!("model: {}", a.model.display());
    println!("IR version {}, producer '{}'", m.ir_version, m.producer);
    let opsets: Vec<String> = m
        .opsets
        .iter()
        .map(|(d, v)| format!("{}={v}", if d.is_empty() { "ai.onnx" } else { d }))
        .collect();
    println!("opsets: {}", opsets.join(", "));
    println!("\ninputs:");
    for id in g.runtime_inputs() {
        let v = m.value(id);
        println!("  {}: {}", v.name, fmt_type(&v.ty));
    }
    println!("outputs:");
    for id in &g.outputs {
        let v = m.value(*id);
        println!("  {}: {}", v.name, fmt_type(&v.ty));
    }
    let mut params = 0usize;
    let mut bytes = 0usize;
    let mut count = |t: &Tensor| {
        params += t.len();
        bytes += t.len() * t.dtype().size().max(1);
    };
    for (_, v) in &g.initializers {
        if let Value::Tensor(t) = v {
            count(t);
        }
    }
    let mut hist: BTreeMap<String, usize> = BTreeMap::new();
    let mut flops: BTreeMap<String, f64> = BTreeMap::new();
    let shapes = ferrum_graph::infer::static_shapes(m);
    for n in &g.nodes {
        let key = if n.domain.is_empty() {
            n.op.clone()
        } else {
            format!("{}.{}", n.domain, n.op)
        };
        *hist.entry(key.clone()).or_default() += 1;
        if n.op == "Constant" {
            if let Some(Attr::Tensor(t)) = n.attrs.get("value") {
                count(t);
            }
        }
        if let Some(f) = ferrum_graph::infer::node_flops(n, &shapes) {
            *flops.entry(key).or_default() += f;
        }
    }
    println!(
        "\nparameters: {} ({} bytes)",
        human(params as f64),
        human(bytes as f64)
    );
    println!("nodes: {}", g.nodes.len());
    let mut ops: Vec<(&String, &usize)> = hist.iter().collect();
    ops.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    println!("\n{:<28} {:>6} {:>12}", "op", "count", "FLOPs");
    for (op, c) in ops {
        let f = flops.get(op).map_or("-".to_string(), |f| human(*f));
        println!("{op:<28} {c:>6} {f:>12}");
    }
    let total: f64 = flops.values().sum();
    println!("{:<28} {:>6} {:>12}", "total", g.nodes.len(), human(total));
    if let Some(e) = &unsupported {
        println!("\nferrum cannot run this model: {e}");
    }
    if a.optimized {
        let r = &report;
        println!(
            "\noptimised at level {} ({:?}): {} nodes before, {} after; {} products",
            r.level as u32,
            r.level,
            r.nodes_before,
            r.nodes_after,
            precision_name(r.precision)
        );
        for (pass, n) in &r.passes {
            println!("  {pass:<28} {n:>5} rewrites");
        }
        if !r.fused.is_empty() {
            println!("\nrewrites:");
            for f in &r.fused {
                println!("  {f}");
            }
        }
    }
    Ok(())
}

/// The `--profile` table of the slowest nodes: time per run, share of all node time, achieved
/// GFLOP/s where the op has an operation count, and the shapes the node ran with.
fn print_nodes(nodes: &[ferrum_graph::exec::NodeTime], repeat: usize, total: f64, shown: usize) {
    let shown = if shown == 0 { nodes.len() } else { shown };
    let dims = |d: &[usize]| {
        d.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join("x")
    };
    println!(
        "\nslowest nodes ({} of {}):\n{:>10} {:>6} {:>8}  {:<24} {:<32} shapes (input -> output)",
        shown.min(nodes.len()),
        nodes.len(),
        "ms/run",
        "share",
        "GFLOP/s",
        "op",
        "node"
    );
    for n in nodes.iter().take(shown) {
        let gflops = if n.flops > 0.0 && n.seconds > 0.0 {
            let g = n.flops / n.seconds * 1e-9;
            if g >= 1.0 {
                format!("{g:.1}")
            } else {
                format!("{g:.4}")
            }
        } else {
            "-".into()
        };
        // Long names keep their start and end (where exported names differ).
        let mut name = n.name.clone();
        let chars: Vec<char> = name.chars().collect();
        if chars.len() > 32 {
            name = chars[..12].iter().collect::<String>()
                + "~"
                + &chars[chars.len() - 19..].iter().collect::<String>();
        }
        println!(
            "{:>10.3} {:>5.1}% {:>8}  {:<24} {:<32} {} -> {}",
            n.seconds * 1e3 / repeat.max(1) as f64,
            100.0 * n.seconds / total.max(1e-12),
            gflops,
            n.op,
            name,
            dims(&n.input),
            dims(&n.output)
        );
    }
}
