//! Channels-last convolution kernels on MobileNetV2's and ResNet's shapes (no criterion):
//! `cargo bench -p ferrum-kernels --bench conv [-- --reps N]`. The depthwise layers (3x3, pad 1,
//! stride 1 or 2, ReLU6 as the network fuses it), the large ones also behind their 1x1
//! expansion (the product over every pixel then the depthwise convolution, beside
//! `expand_depthwise_nhwc`, which never holds the expanded tensor), and the first layers over an
//! image's 3 channels (`direct`, AVX-512 and AVX2), and ResNet's 3x3 layers by Winograd's
//! F(2x2, 3x3) (channels-first), at 1 and 2 threads; GFLOP/s count 2 FLOPs per multiply-add. Each
//! figure: the median and the fastest of `--reps` runs (default 15) after one warm-up (the
//! fastest is the steadier estimate on a machine shared with other work).

use std::mem::MaybeUninit;

use ferrum_kernels::depthwise::{
    depthwise_nhwc_with, expand_depthwise_nhwc_with, Expand, Finish, Geometry,
};
use ferrum_kernels::gemm::{self, Act};
use ferrum_kernels::{direct, winograd};

mod common;
use common::timings as time;

fn vals(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| ((i as f32 + seed) * 0.731).sin()).collect()
}

/// A square `k x k` convolution of a `size x size` input with padding `k / 2`.
fn geometry(size: usize, channels: usize, k: usize, stride: usize) -> Geometry {
    let out = (size + 2 * (k / 2) - k) / stride + 1;
    Geometry {
        input: [size, size],
        channels,
        kernel: [k, k],
        stride: [stride, stride],
        dilation: [1, 1],
        pad: [k / 2, k / 2],
        output: [out, out],
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let reps = args
        .iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(15);
    let relu6 = Act::Clip { lo: 0.0, hi: 6.0 };
    println!("| kernel | shape | threads | median ms | fastest ms | GFLOP/s (fastest) |");
    println!("|---|---|---:|---:|---:|---:|");
    for threads in [1, 2] {
        // MobileNetV2's depthwise layers: (input size, channels, stride).
        for (size, c, s) in [
            (112, 32, 1),
            (112, 96, 2),
            (56, 144, 1),
            (56, 144, 2),
            (28, 192, 1),
            (14, 576, 1),
            (7, 960, 1),
        ] {
            let g = geometry(size, c, 3, s);
            let (x, w, b) = (vals(size * size * c, 1.0), vals(9 * c, 2.0), vals(c, 3.0));
            let fin = Finish {
                bias: Some(&b),
                residual: None,
                act: relu6,
            };
            let mut out = vec![MaybeUninit::new(0f32); g.output[0] * g.output[1] * c];
            let (med, best) = time(reps, || {
                depthwise_nhwc_with(gemm::isa(), threads, &x, &w, 1, &g, &fin, &mut out)
            });
            let flops = 2.0 * (g.output[0] * g.output[1] * c * 9) as f64;
            println!(
                "| depthwise | {size}x{size}x{c} 3x3/{s} | {threads} | {:.3} | {:.3} | {:.1} |",
                med * 1e3,
                best * 1e3,
                flops / best / 1e9
            );
        }
        // MobileNetV2's expansions in front of its largest depthwise layers: (input size,
        // channels in, expanded channels, stride).
        for (size, cin, c, s) in [(112, 16, 96, 2), (56, 24, 144, 1), (56, 24, 144, 2)] {
            let g = geometry(size, c, 3, s);
            let (x, we, be) = (
                vals(size * size * cin, 4.0),
                vals(cin * c, 5.0),
                vals(c, 6.0),
            );
            let (w, b) = (vals(9 * c, 2.0), vals(c, 3.0));
            let packed = gemm::PackedB::new(cin, c, gemm::Mat::row_major(&we, c));
            let e = Expand {
                cin,
                w: gemm::Rhs::Packed(&packed),
                bias: Some(&be),
                act: relu6,
            };
            let fin = Finish {
                bias: Some(&b),
                residual: None,
                act: relu6,
            };
            let epi = gemm::Epilogue {
                bias: gemm::Bias::Col(&be),
                act: relu6,
                residual: None,
            };
            let mut mid = vec![0f32; size * size * c];
            let mut out = vec![MaybeUninit::new(0f32); g.output[0] * g.output[1] * c];
            let flops = 2.0 * (size * size * cin * c + g.output[0] * g.output[1] * c * 9) as f64;
            let apart = time(reps, || {
                let lhs = gemm::Lhs::Mat(gemm::Mat::row_major(&x, cin));
                let (m, isa) = (size * size, gemm::isa());
                gemm::gemm_ex_with(
                    isa, threads, m, c, cin, 1.0, lhs, e.w, 0.0, &mut mid, c, &epi,
                );
                depthwise_nhwc_with(isa, threads, &mid, &w, 1, &g, &fin, &mut out)
            });
            let fused = time(reps, || {
                expand_depthwise_nhwc_with(gemm::isa(), threads, &x, &e, &w, 1, &g, &fin, &mut out)
            });
            for (what, (med, best)) in [("1x1 then depthwise", apart), ("expand_depthwise", fused)]
            {
                println!(
                    "| {what} | {size}x{size}x{cin} -> {c} 3x3/{s} | {threads} | {:.3} | {:.3} | {:.1} |",
                    med * 1e3,
                    best * 1e3,
                    flops / best / 1e9
                );
            }
        }
        // ResNet-50's 3x3 stride-1 layers (channels, size), by Winograd F(2x2, 3x3) with the
        // bias, residual and ReLU as the network fuses them; GFLOP/s of the direct convolution's
        // multiply-adds (so above the machine's peak when the transform saves enough).
        for (c, size) in [(64, 56), (128, 28), (256, 14), (512, 7)] {
            let (x, w, b) = (
                vals(c * size * size, 1.0),
                vals(c * c * 9, 2.0),
                vals(c, 3.0),
            );
            let z = vals(c * size * size, 4.0);
            let f = winograd::WinogradFilter::new(&w, c, c);
            let g = winograd::Geometry {
                input: [size, size],
                output: [size, size],
                pad: [1, 1],
            };
            let fin = winograd::Finish {
                bias: Some(&b),
                residual: Some(&z),
                act: Act::Relu,
            };
            let mut out = vec![MaybeUninit::new(0f32); c * size * size];
            let (med, best) = time(reps, || {
                winograd::conv3x3_with(gemm::isa(), threads, &f, &x, 1, g, &fin, &mut out)
            });
            let flops = 2.0 * (c * c * 9 * size * size) as f64;
            println!(
                "| winograd | {c}x{size}x{size} 3x3/1 -> {c} | {threads} | {:.3} | {:.3} | {:.1} |",
                med * 1e3,
                best * 1e3,
                flops / best / 1e9
            );
        }
        if !direct::worthwhile(3) {
            continue;
        }
        // First layers: MobileNetV2's 3x3/2 to 32 channels, ResNet's 7x7/2 to 64.
        for (k, cout) in [(3, 32), (7, 64)] {
            let g = geometry(224, 3, k, 2);
            let (x, w, b) = (
                vals(224 * 224 * 3, 1.0),
                vals(k * k * 3 * cout, 2.0),
                vals(cout, 3.0),
            );
            let fin = Finish {
                bias: Some(&b),
                residual: None,
                act: relu6,
            };
            let mut out = vec![MaybeUninit::new(0f32); g.output[0] * g.output[1] * cout];
            let flops = 2.0 * (g.output[0] * g.output[1] * cout * k * k * 3) as f64;
            // The image channels-last, then as the three planes it enters the network as.
            for (input, what) in [
                (direct::Input::Nhwc, ""),
                (direct::Input::Nchw, " (planes)"),
            ] {
                let (med, best) = time(reps, || {
                    direct::dense_with(threads, input, &x, &w, cout, 1, &g, &fin, &mut out)
                });
                println!(
                    "| direct | 224x224x3{what} {k}x{k}/2 -> {cout} | {threads} | {:.3} | {:.3} | {:.1} |",
                    med * 1e3,
                    best * 1e3,
                    flops / best / 1e9
                );
            }
            // ResNet's stem: the 7x7 layer then its 3x3 stride-2 max pool (padding 1), the
            // convolution's rows pooled as they are made, the output as planes.
            if k == 7 {
                let [oh, ow] = g.output;
                let p = direct::MaxPool {
                    kernel: [3, 3],
                    stride: [2, 2],
                    pad: [1, 1],
                    output: [(oh - 1) / 2 + 1, (ow - 1) / 2 + 1],
                };
                let fin = Finish {
                    act: Act::Relu,
                    ..fin
                };
                let mut pooled = vec![MaybeUninit::new(0f32); cout * p.output[0] * p.output[1]];
                let (med, best) = time(reps, || {
                    direct::dense_max_pool_with_isa(
                        gemm::isa(),
                        threads,
                        direct::Input::Nchw,
                        &x,
                        &w,
                        cout,
                        1,
                        &g,
                        &fin,
                        &p,
                        &mut pooled,
                    )
                });
                println!(
                    "| direct + max pool | 224x224x3 (planes) {k}x{k}/2 -> {cout}, 3x3/2 | {threads} | {:.3} | {:.3} | {:.1} |",
                    med * 1e3,
                    best * 1e3,
                    flops / best / 1e9
                );
            }
        }
    }
}
