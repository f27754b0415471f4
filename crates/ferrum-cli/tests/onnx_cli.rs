//! `ferrum run` and `ferrum inspect` on small ONNX models written by the test.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ferrum_graph::onnx::{tensor_from_proto, tensor_to_proto};
use ferrum_graph::proto::build::{attr_int, f32_tensor, model, node, value};
use ferrum_graph::proto::{decode, encode, TensorProto};
use ferrum_graph::Tensor;

struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let p = std::env::temp_dir().join(format!("ferrum-onnx-cli-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(p.join("in")).unwrap();
        Dir(p)
    }
    fn path(&self, rel: &str) -> PathBuf {
        self.0.join(rel)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn ferrum(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrum"))
        .args(args)
        .output()
        .expect("run ferrum")
}

/// y = Softmax(x @ w + b) over a [2, 3] input, w [3, 2], b [2]; plus s = Shape(x).
fn write_model(dir: &Dir) -> PathBuf {
    let mp = model(
        vec![
            node("MatMul", &["x", "w"], &["xw"], vec![]),
            node("Add", &["xw", "b"], &["z"], vec![]),
            node("Softmax", &["z"], &["y"], vec![attr_int("axis", -1)]),
            node("Shape", &["x"], &["s"], vec![]),
        ],
        vec![value("x", 1, &[None, Some(3)])],
        vec![value("y", 1, &[None, Some(2)]), value("s", 7, &[Some(2)])],
        vec![
            f32_tensor("w", &[3, 2], &[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]),
            f32_tensor("b", &[2], &[0.5, -0.5]),
        ],
        13,
    );
    let p = dir.path("model.onnx");
    std::fs::write(&p, encode(&mp)).unwrap();
    p
}

/// The [2, 3] input `x` of [`write_model`]'s model, written as `in/input_0.pb`; returned.
fn write_input(dir: &Dir) -> [f32; 6] {
    let x = [1.0f32, 2.0, 3.0, -1.0, 0.0, 4.0];
    let t = Tensor::from_vec(vec![2, 3], x.to_vec()).unwrap();
    std::fs::write(dir.path("in/input_0.pb"), encode(&tensor_to_proto(&t, "x"))).unwrap();
    x
}

fn expected(x: &[f32]) -> Vec<f64> {
    let mut out = Vec::new();
    for r in x.chunks(3) {
        let z = [(r[0] + r[2]) as f64 + 0.5, (r[1] + r[2]) as f64 - 0.5];
        let m = z[0].max(z[1]);
        let s: f64 = z.iter().map(|v| (v - m).exp()).sum();
        out.extend(z.iter().map(|v| (v - m).exp() / s));
    }
    out
}

fn read_pb(p: &Path) -> Tensor {
    let tp: TensorProto = decode(&std::fs::read(p).unwrap(), "tensor").unwrap();
    tensor_from_proto(&tp, None).unwrap()
}

#[test]
fn run_reads_pb_inputs_and_writes_pb_outputs() {
    let d = Dir::new("pb");
    let m = write_model(&d);
    let x = write_input(&d);
    let out = ferrum(&[
        "run",
        "--model",
        m.to_str().unwrap(),
        "--inputs",
        d.path("in").to_str().unwrap(),
        "--outputs",
        d.path("out").to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("y: FLOAT [2, 2]"), "{stdout}");
    let y = read_pb(&d.path("out/output_0.pb"));
    assert_eq!(y.shape(), &[2, 2]);
    for (a, b) in y.to_f64_vec().unwrap().iter().zip(expected(&x)) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
    let s = read_pb(&d.path("out/output_1.pb"));
    assert_eq!(s.to_i64_vec().unwrap(), vec![2, 3]);
}

fn npy_f32(shape: &[usize], v: &[f32]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let mut header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({},), }}",
        dims.join(", ")
    );
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(header.len() as u16).to_le_bytes());
    b.extend_from_slice(header.as_bytes());
    for x in v {
        b.extend_from_slice(&x.to_le_bytes());
    }
    b
}

#[test]
fn run_takes_npy_inputs_and_writes_npy_outputs() {
    let d = Dir::new("npy");
    let m = write_model(&d);
    let x = [0.5f32, -2.0, 1.0];
    std::fs::write(d.path("x.npy"), npy_f32(&[1, 3], &x)).unwrap();
    let arg = format!("x={}", d.path("x.npy").display());
    let out = ferrum(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "--input",
        &arg,
        "--outputs",
        d.path("out").to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let y = std::fs::read(d.path("out/y.npy")).unwrap();
    assert!(y.starts_with(b"\x93NUMPY"));
    let data = &y[y.len() - 8..];
    let got: Vec<f64> = data
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
        .collect();
    for (a, b) in got.iter().zip(expected(&x)) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
    assert!(d.path("out/output_0.pb").exists());
}

#[test]
fn unsupported_op_exits_with_status_3_naming_the_node() {
    let d = Dir::new("unsupported");
    let mut n = node("FancyOp", &["x"], &["y"], vec![]);
    n.name = "fancy_1".into();
    let mp = model(
        vec![n],
        vec![value("x", 1, &[Some(2)])],
        vec![value("y", 1, &[Some(2)])],
        vec![],
        17,
    );
    std::fs::write(d.path("m.onnx"), encode(&mp)).unwrap();
    let t = Tensor::from_vec(vec![2], vec![1f32, 2.0]).unwrap();
    std::fs::write(d.path("in/input_0.pb"), encode(&tensor_to_proto(&t, "x"))).unwrap();
    let out = ferrum(&[
        "run",
        "--model",
        d.path("m.onnx").to_str().unwrap(),
        "--inputs",
        d.path("in").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    for part in ["fancy_1", "FancyOp", "opset 17", "FLOAT"] {
        assert!(err.contains(part), "{err} lacks {part}");
    }
    // `inspect` still shows the graph, and says which op stops it from running.
    let out = ferrum(&["inspect", d.path("m.onnx").to_str().unwrap()]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    for part in [
        "FancyOp",
        "nodes: 1",
        "ferrum cannot run this model",
        "fancy_1",
    ] {
        assert!(s.contains(part), "{s} lacks {part}");
    }
}

#[test]
fn bad_model_files_are_clean_errors() {
    let d = Dir::new("bad");
    std::fs::write(d.path("junk.onnx"), b"\x0a\xff\xff\xff\xff\x0f").unwrap();
    let out = ferrum(&[
        "run",
        "--model",
        d.path("junk.onnx").to_str().unwrap(),
        "--inputs",
        d.path("in").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid model"));
    let out = ferrum(&["inspect", d.path("missing.onnx").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn inspect_lists_io_ops_parameters_and_flops() {
    let d = Dir::new("inspect");
    let m = write_model(&d);
    let out = ferrum(&["inspect", m.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8_lossy(&out.stdout);
    for part in [
        "ai.onnx=13",
        "x: FLOAT [N, 3]",
        "y: FLOAT [N, 2]",
        "MatMul",
        "Softmax",
        "parameters: 8",
    ] {
        assert!(s.contains(part), "{s} lacks {part}");
    }
    assert!(!s.contains("optimised at level"), "{s}");
    let out = ferrum(&["inspect", "--optimized", m.to_str().unwrap()]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("optimised at level 3 (All)"), "{s}");
    assert!(s.contains("constant folding"), "{s}");
    let bad = ferrum(&[
        "inspect",
        "--optimized",
        "--opt-level",
        "4",
        m.to_str().unwrap(),
    ]);
    assert!(!bad.status.success());
}

#[test]
fn huge_pages_change_no_output() {
    // `--huge-pages` (`auto`, the default, for a small model) runs the process again with
    // glibc's huge-page tunable where the system gives huge pages on request: the same outputs
    // as without it, with other tunables kept, and it runs itself again once (the run ends).
    let d = Dir::new("huge");
    let m = write_model(&d);
    let x = write_input(&d);
    let on_request = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|s| s.contains("[madvise]"))
        && cfg!(all(target_os = "linux", target_env = "gnu"));
    let run = |tag: &str, huge: &str, tunables: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrum"));
        cmd.args([
            "run",
            "--model",
            m.to_str().unwrap(),
            "--inputs",
            d.path("in").to_str().unwrap(),
            "--outputs",
            d.path(tag).to_str().unwrap(),
            "--huge-pages",
            huge,
        ])
        .env("FERRUM_LOG", "info");
        match tunables {
            Some(v) => cmd.env("GLIBC_TUNABLES", v),
            None => cmd.env_remove("GLIBC_TUNABLES"),
        };
        let out = cmd.output().expect("run ferrum");
        assert!(
            out.status.success(),
            "{tag}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let logged = String::from_utf8_lossy(&out.stderr).into_owned();
        let files: Vec<Vec<u8>> = ["output_0.pb", "output_1.pb"]
            .iter()
            .map(|f| std::fs::read(d.path(tag).join(f)).unwrap())
            .collect();
        (logged, files)
    };
    let (log_off, off) = run("off", "off", None);
    let (log_on, on) = run("on", "auto", None);
    let (log_kept, kept) = run("kept", "on", Some("glibc.malloc.tcache_count=7"));
    let y = read_pb(&d.path("off/output_0.pb"));
    for (a, b) in y.to_f64_vec().unwrap().iter().zip(expected(&x)) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
    assert_eq!(on, off, "outputs with and without huge pages");
    assert_eq!(kept, off, "outputs with another tunable set");
    assert!(
        !log_off.contains("huge pages as GLIBC_TUNABLES"),
        "{log_off}"
    );
    if on_request {
        assert!(
            log_on.contains("huge pages as GLIBC_TUNABLES sets them: glibc.malloc.hugetlb=1"),
            "{log_on}"
        );
        assert!(
            log_kept.contains(
                "huge pages as GLIBC_TUNABLES sets them: glibc.malloc.tcache_count=7:glibc.malloc.hugetlb=1"
            ),
            "{log_kept}"
        );
    }
}

#[test]
fn run_repeat_prints_timing_and_profile_and_keeps_outputs() {
    let d = Dir::new("repeat");
    let m = write_model(&d);
    let x = write_input(&d);
    let out = ferrum(&[
        "run",
        "--quiet",
        "--model",
        m.to_str().unwrap(),
        "--inputs",
        d.path("in").to_str().unwrap(),
        "--outputs",
        d.path("out").to_str().unwrap(),
        "--threads",
        "2",
        "--repeat",
        "3",
        "--profile",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("time: median ")
            && stdout.contains("over 3 runs, 2 threads")
            && stdout.contains("session: "),
        "{stdout}"
    );
    assert!(
        stdout.contains("MatMul") && stdout.contains("Softmax"),
        "{stdout}"
    );
    // The per-node table: the MatMul with its achieved GFLOP/s and the shapes it ran with.
    let nodes = stdout
        .split_once("slowest nodes (")
        .map(|(_, t)| t)
        .unwrap_or_else(|| panic!("no node table: {stdout}"));
    let matmul = nodes
        .lines()
        .find(|l| {
            l.split_whitespace()
                .nth(3)
                .is_some_and(|o| o.ends_with("MatMul"))
        })
        .unwrap_or_else(|| panic!("no MatMul row: {stdout}"));
    let cols: Vec<&str> = matmul.split_whitespace().collect();
    assert!(
        cols[0].parse::<f64>().is_ok()
            && cols[2].parse::<f64>().is_ok_and(|g| g >= 0.0)
            && matmul.contains("2x3 -> 2x"),
        "{matmul}"
    );
    let y = read_pb(&d.path("out/output_0.pb"));
    for (a, b) in y.to_f64_vec().unwrap().iter().zip(expected(&x)) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
    let bad = ferrum(&["run", "--model", m.to_str().unwrap(), "--threads", "0"]);
    assert!(!bad.status.success());
    // --precision bf16: the session line says which arithmetic ran, on which unit (f32, with a
    // warning, where the CPU has neither AMX-BF16 nor AVX512-BF16).
    let bf = ferrum(&[
        "run",
        "--quiet",
        "--model",
        m.to_str().unwrap(),
        "--inputs",
        d.path("in").to_str().unwrap(),
        "--repeat",
        "1",
        "--precision",
        "bf16",
    ]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&bf.stdout),
        String::from_utf8_lossy(&bf.stderr),
    );
    assert!(bf.status.success(), "{stderr}");
    if let Some(unit) = ferrum_kernels::gemm::bf16_unit() {
        let want = format!("bf16 ({unit}) products");
        assert!(stdout.contains(&want), "{stdout}");
    } else {
        assert!(
            stdout.contains("f32 products") && stderr.contains("running f32"),
            "{stdout}{stderr}"
        );
    }
}
