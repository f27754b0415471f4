//! A session's runs reuse their tensor memory: once warm, a run of the same shapes allocates
//! no tensor memory but the outputs it hands back (every thread of the kernel pool counted),
//! and gives the same outputs as the first, cold run (a recycled buffer holds an earlier value's
//! elements: a kernel that left part of its output unwritten would show here).
//!
//! "No tensor memory": no allocation of 1 KiB or more other than one per output, on models
//! whose every value is at least that large. What remains is bookkeeping below that size
//! (kernel output lists, shapes, attributes read per run), counted and printed.
//!
//! Two models of the ops the benchmark networks run after the passes: a convolution stack
//! (3x3, 1x1 with a residual add, depthwise, pooling, a classifier) and a transformer encoder
//! layer (projections, attention with a mask, LayerNormalization, a GELU feed-forward). The
//! ignored test does the same on exported networks (`FERRUM_ONNX_MODELS`: a folder of model
//! folders, each with `model.onnx` and `test_data_set_0`, as `scripts/onnx_models.py` writes).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use ferrum_graph::proto::build::{attr_int, attr_ints, f32_tensor, i64_vector, model, node, value};
use ferrum_graph::proto::{encode, AttributeProto, ModelProto, TensorProto};
use ferrum_graph::{Session, Tensor, Value};

/// Counts allocations (and reallocations), their bytes, and those of 1 KiB or more, on every
/// thread.
struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);
static BYTES: AtomicUsize = AtomicUsize::new(0);
static LARGE: AtomicUsize = AtomicUsize::new(0);

/// The size from which an allocation counts as tensor memory.
const LARGE_BYTES: usize = 1024;

fn count(size: usize) {
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    BYTES.fetch_add(size, Ordering::Relaxed);
    if size >= LARGE_BYTES {
        LARGE.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: delegates to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Deterministic values in [-1, 1) (a fixed LCG: the test is about memory, not numerics).
fn vals(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn weight(name: &str, dims: &[i64], scale: f32) -> TensorProto {
    let n = dims.iter().product::<i64>() as usize;
    let v: Vec<f32> = vals(name.len() as u64 * 7919 + n as u64, n)
        .into_iter()
        .map(|x| x * scale)
        .collect();
    f32_tensor(name, dims, &v)
}

fn attr_f(name: &str, f: f32) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        f,
        r#type: 1,
        ..Default::default()
    }
}

fn f32_value(name: &str, dims: &[i64]) -> ferrum_graph::proto::ValueInfoProto {
    value(name, 1, &dims.iter().map(|&d| Some(d)).collect::<Vec<_>>())
}

/// 3x3 conv and Relu, 1x1 conv with a residual and Relu, max pool, depthwise 3x3 and Clip, 1x1
/// expansion and Relu, global average pool, Flatten, Gemm, Softmax. Input `x` [1, 16, 48, 48];
/// every value is 1 KiB or more.
fn convnet() -> (ModelProto, Vec<(&'static str, Vec<usize>)>) {
    let conv = |x: &str, w: &str, b: &str, y: &str, k: i64, group: i64| {
        node(
            "Conv",
            &[x, w, b],
            &[y],
            vec![
                attr_ints("kernel_shape", &[k, k]),
                attr_ints("pads", &[k / 2; 4]),
                attr_int("group", group),
            ],
        )
    };
    let mp = model(
        vec![
            conv("x", "w1", "b1", "c1", 3, 1),
            node("Relu", &["c1"], &["r1"], vec![]),
            conv("r1", "w2", "b2", "c2", 1, 1),
            node("Add", &["c2", "r1"], &["s2"], vec![]),
            node("Relu", &["s2"], &["r2"], vec![]),
            node(
                "MaxPool",
                &["r2"],
                &["p2"],
                vec![
                    attr_ints("kernel_shape", &[2, 2]),
                    attr_ints("strides", &[2, 2]),
                ],
            ),
            conv("p2", "w3", "b3", "c3", 3, 32),
            node("Clip", &["c3", "lo", "hi"], &["r3"], vec![]),
            conv("r3", "w4", "b4", "c4", 1, 1),
            node("Relu", &["c4"], &["r4"], vec![]),
            node("GlobalAveragePool", &["r4"], &["g"], vec![]),
            node("Flatten", &["g"], &["f"], vec![]),
            node(
                "Gemm",
                &["f", "w5", "b5"],
                &["logits"],
                vec![attr_int("transB", 1)],
            ),
            node("Softmax", &["logits"], &["y"], vec![]),
        ],
        vec![f32_value("x", &[1, 16, 48, 48])],
        vec![f32_value("y", &[1, 256])],
        vec![
            weight("w1", &[32, 16, 3, 3], 0.1),
            weight("b1", &[32], 0.1),
            weight("w2", &[32, 32, 1, 1], 0.2),
            weight("b2", &[32], 0.1),
            weight("w3", &[32, 1, 3, 3], 0.3),
            weight("b3", &[32], 0.1),
            f32_tensor("lo", &[], &[0.0]),
            f32_tensor("hi", &[], &[6.0]),
            weight("w4", &[256, 32, 1, 1], 0.2),
            weight("b4", &[256], 0.1),
            weight("w5", &[256, 256], 0.1),
            weight("b5", &[256], 0.1),
        ],
        17,
    );
    (mp, vec![("x", vec![1, 16, 48, 48])])
}

/// One post-norm encoder layer (BERT's): Q, K, V projections split into 4 heads of 24,
/// scores scaled and masked, Softmax, the heads merged and projected, residual +
/// LayerNormalization, a GELU (erf form) feed-forward of 384, residual + LayerNormalization.
/// Inputs `x` [1, 64, 96] and an additive `mask` [1, 1, 1, 64].
fn encoder() -> (ModelProto, Vec<(&'static str, Vec<usize>)>) {
    let (s, d, h) = (64i64, 96i64, 4i64);
    let hd = d / h;
    let mut nodes = vec![];
    for p in ["q", "k", "v"] {
        let (w, b, m, a, r, t) = (
            format!("w{p}"),
            format!("b{p}"),
            format!("{p}m"),
            format!("{p}a"),
            format!("{p}r"),
            format!("{p}t"),
        );
        nodes.push(node("MatMul", &["x", &w], &[&m], vec![]));
        nodes.push(node("Add", &[&m, &b], &[&a], vec![]));
        nodes.push(node("Reshape", &[&a, "heads"], &[&r], vec![]));
        let perm: &[i64] = if p == "k" {
            &[0, 2, 3, 1]
        } else {
            &[0, 2, 1, 3]
        };
        nodes.push(node(
            "Transpose",
            &[&r],
            &[&t],
            vec![attr_ints("perm", perm)],
        ));
    }
    nodes.extend([
        node("MatMul", &["qt", "kt"], &["scores"], vec![]),
        node("Div", &["scores", "root"], &["scaled"], vec![]),
        node("Add", &["scaled", "mask"], &["masked"], vec![]),
        node(
            "Softmax",
            &["masked"],
            &["probs"],
            vec![attr_int("axis", -1)],
        ),
        node("MatMul", &["probs", "vt"], &["ctx"], vec![]),
        node(
            "Transpose",
            &["ctx"],
            &["ctx_t"],
            vec![attr_ints("perm", &[0, 2, 1, 3])],
        ),
        node("Reshape", &["ctx_t", "merged"], &["ctx_m"], vec![]),
        node("MatMul", &["ctx_m", "wo"], &["o"], vec![]),
        node("Add", &["o", "bo"], &["ob"], vec![]),
        node("Add", &["ob", "x"], &["res1"], vec![]),
        node(
            "LayerNormalization",
            &["res1", "g1", "be1"],
            &["n1"],
            vec![attr_int("axis", -1), attr_f("epsilon", 1e-5)],
        ),
        node("MatMul", &["n1", "w1"], &["f1"], vec![]),
        node("Add", &["f1", "b1"], &["f1b"], vec![]),
        node("Div", &["f1b", "sqrt2"], &["gd"], vec![]),
        node("Erf", &["gd"], &["ge"], vec![]),
        node("Add", &["ge", "one"], &["gp"], vec![]),
        node("Mul", &["f1b", "gp"], &["gm"], vec![]),
        node("Mul", &["gm", "half"], &["gelu"], vec![]),
        node("MatMul", &["gelu", "w2"], &["f2"], vec![]),
        node("Add", &["f2", "b2"], &["f2b"], vec![]),
        node("Add", &["f2b", "n1"], &["res2"], vec![]),
        node(
            "LayerNormalization",
            &["res2", "g2", "be2"],
            &["y"],
            vec![attr_int("axis", -1), attr_f("epsilon", 1e-5)],
        ),
    ]);
    let mut inits = vec![
        i64_vector("heads", &[1, s, h, hd]),
        i64_vector("merged", &[1, s, d]),
        f32_tensor("root", &[], &[(hd as f32).sqrt()]),
        weight("wo", &[d, d], 0.1),
        weight("bo", &[d], 0.1),
        weight("g1", &[d], 1.0),
        weight("be1", &[d], 0.1),
        weight("w1", &[d, 4 * d], 0.1),
        weight("b1", &[4 * d], 0.1),
        f32_tensor("sqrt2", &[], &[std::f32::consts::SQRT_2]),
        f32_tensor("one", &[], &[1.0]),
        f32_tensor("half", &[], &[0.5]),
        weight("w2", &[4 * d, d], 0.05),
        weight("b2", &[d], 0.1),
        weight("g2", &[d], 1.0),
        weight("be2", &[d], 0.1),
    ];
    for p in ["q", "k", "v"] {
        inits.push(weight(&format!("w{p}"), &[d, d], 0.1));
        inits.push(weight(&format!("b{p}"), &[d], 0.1));
    }
    let mp = model(
        nodes,
        vec![f32_value("x", &[1, s, d]), f32_value("mask", &[1, 1, 1, s])],
        vec![f32_value("y", &[1, s, d])],
        inits,
        17,
    );
    let (s, d) = (s as usize, d as usize);
    (mp, vec![("x", vec![1, s, d]), ("mask", vec![1, 1, 1, s])])
}

fn feeds(shapes: &[(&'static str, Vec<usize>)]) -> Vec<(String, Value)> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let n = shape.iter().product();
            let mut v = vals(i as u64 + 1, n);
            if *name == "mask" {
                // The last quarter of the positions masked out, as padding is.
                v.iter_mut()
                    .enumerate()
                    .for_each(|(j, m)| *m = if j >= n * 3 / 4 { -1e4 } else { 0.0 });
            }
            let t = Tensor::from_vec(shape.clone(), v).unwrap();
            (name.to_string(), Value::Tensor(t))
        })
        .collect()
}

fn output_bits(outs: &[(String, Value)]) -> Vec<Vec<u32>> {
    outs.iter()
        .map(|(_, v)| {
            let t = v.tensor().unwrap();
            let x = t.as_slice::<f32>().unwrap();
            assert!(x.iter().all(|v| v.is_finite()), "outputs are finite");
            x.iter().map(|v| v.to_bits()).collect()
        })
        .collect()
}

/// Runs after which a session must have reached its steady state.
const MAX_WARM_RUNS: usize = 30;

/// Runs `session` cold, then three more times, then until a run allocates nothing of
/// [`LARGE_BYTES`] or more but its outputs (at most [`MAX_WARM_RUNS`] runs), at 1 and 2 threads;
/// checks that such a run comes, and that it gives the cold run's bits.
///
/// Why not a fixed number of runs: the kernel pool's threads keep scratch space of their own
/// (GEMM packing blocks, Winograd transforms, padded depthwise planes), grown the first time a
/// thread takes part in a kernel of that size, and which thread claims which task varies from
/// run to run (a worker that arrives late finds the tasks taken), so with two threads a worker
/// may first take part in some kernel in any early run: a fourth run allocated 2-5 such buffers
/// in about one process out of six. That growth happens once per thread; a kernel that
/// allocates on every run never gives a clean run and fails here.
fn check_warm_runs(name: &str, session: &Session, feeds: &dyn Fn() -> Vec<(String, Value)>) {
    for threads in [1, 2] {
        ferrum_kernels::pool::set_threads(Some(threads));
        let cold = output_bits(&session.run(feeds()).unwrap());
        for _ in 0..3 {
            session.run(feeds()).unwrap();
        }
        let mut last = (0, 0, 0);
        let mut clean = None;
        for run in 0..MAX_WARM_RUNS {
            let input = feeds();
            let before = [&ALLOCS, &BYTES, &LARGE].map(|c| c.load(Ordering::SeqCst));
            let outs = session.run(input).unwrap();
            let after = [&ALLOCS, &BYTES, &LARGE].map(|c| c.load(Ordering::SeqCst));
            last = (
                after[0] - before[0],
                after[1] - before[1],
                after[2] - before[2],
            );
            if last.2 <= outs.len() {
                clean = Some((run, outs));
                break;
            }
        }
        let (allocs, bytes, large) = last;
        let Some((run, outs)) = clean else {
            panic!(
                "{name}, {threads} thread(s): none of {MAX_WARM_RUNS} warm runs allocated only its \
                 outputs (the last: {large} allocations of {LARGE_BYTES} bytes or more)"
            );
        };
        let out_bytes: usize = outs
            .iter()
            .map(|(_, v)| v.tensor().unwrap().len() * 4)
            .sum();
        let mem = session.memory();
        eprintln!(
            "{name}, {threads} thread(s): warm run {} made {allocs} allocations of {bytes} bytes, \
             {large} of them of {LARGE_BYTES} bytes or more ({} outputs, {out_bytes} bytes); \
             tensor memory: {mem:?}",
            run + 5,
            outs.len()
        );
        assert!(mem.allocated <= outs.len(), "{name}: {mem:?}");
        assert!(mem.reused > 0, "{name}: {mem:?}");
        assert_eq!(
            output_bits(&outs),
            cold,
            "{name}: a warm run gives the cold run's bits"
        );
    }
}

#[test]
fn warm_runs_allocate_no_tensor_memory_but_their_outputs() {
    for (name, (mp, shapes)) in [("convnet", convnet()), ("encoder", encoder())] {
        let session = Session::from_bytes(&encode(&mp)).unwrap();
        let ops: Vec<&str> = session
            .model()
            .graph
            .nodes
            .iter()
            .map(|n| n.op.as_str())
            .collect();
        eprintln!("{name} after the passes: {ops:?}");
        check_warm_runs(name, &session, &|| feeds(&shapes));
    }
}

/// The same on exported networks: `FERRUM_ONNX_MODELS=.onnx-models cargo test --release -p
/// ferrum-graph --test memory -- --ignored` (float32 outputs).
#[test]
#[ignore = "needs exported models: FERRUM_ONNX_MODELS"]
fn warm_runs_of_exported_models_allocate_no_tensor_memory_but_their_outputs() {
    let dir = std::env::var("FERRUM_ONNX_MODELS")
        .expect("FERRUM_ONNX_MODELS: a folder of model folders (model.onnx, test_data_set_0)");
    let mut models: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("model.onnx").exists())
        .collect();
    models.sort();
    assert!(!models.is_empty(), "no model folders in {dir}");
    for m in models {
        let session = Session::from_file(m.join("model.onnx")).unwrap();
        let inputs: Vec<(String, Vec<u8>)> = session
            .input_names()
            .into_iter()
            .enumerate()
            .map(|(j, n)| {
                let p = m.join("test_data_set_0").join(format!("input_{j}.pb"));
                (n, std::fs::read(p).unwrap())
            })
            .collect();
        let types: Vec<_> = session
            .model()
            .graph
            .runtime_inputs()
            .into_iter()
            .map(|id| session.model().value(id).ty.clone())
            .collect();
        let feeds = || {
            inputs
                .iter()
                .zip(&types)
                .map(|((n, b), ty)| {
                    (
                        n.clone(),
                        ferrum_graph::onnx::value_from_bytes(b, ty).unwrap(),
                    )
                })
                .collect()
        };
        check_warm_runs(&m.display().to_string(), &session, &feeds);
    }
}
