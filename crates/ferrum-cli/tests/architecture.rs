//! The crate map of docs/architecture.md, enforced: dependencies between ferrum crates point one way.

use std::collections::BTreeMap;
use std::process::Command;

/// Each ferrum crate and the ferrum crates it may depend on (directly).
const ALLOWED: &[(&str, &[&str])] = &[
    ("ferrum-core", &[]),
    ("ferrum-kernels", &["ferrum-core"]),
    ("ferrum-gguf", &["ferrum-core"]),
    ("ferrum-tokenizer", &["ferrum-core", "ferrum-gguf"]),
    (
        "ferrum-llm",
        &[
            "ferrum-core",
            "ferrum-kernels",
            "ferrum-gguf",
            "ferrum-tokenizer",
        ],
    ),
    ("ferrum-graph", &["ferrum-core", "ferrum-kernels"]),
    ("ferrum-server", &["ferrum-llm", "ferrum-tokenizer"]),
    (
        "ferrum-cli",
        &[
            "ferrum-core",
            "ferrum-kernels",
            "ferrum-gguf",
            "ferrum-tokenizer",
            "ferrum-llm",
            "ferrum-server",
            "ferrum-graph",
        ],
    ),
    (
        "ferrum-py",
        &[
            "ferrum-kernels",
            "ferrum-graph",
            "ferrum-llm",
            "ferrum-tokenizer",
            "ferrum-server",
        ],
    ),
];

#[test]
fn dependencies_point_down_the_stack() {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let mut seen = 0;
    for pkg in meta["packages"].as_array().unwrap() {
        let name = pkg["name"].as_str().unwrap();
        let Some(ok) = allowed.get(name) else {
            panic!("crate {name} is not in the crate map: add it to docs/architecture.md and this test");
        };
        seen += 1;
        for dep in pkg["dependencies"].as_array().unwrap() {
            let d = dep["name"].as_str().unwrap();
            if d.starts_with("ferrum-") && dep["kind"].is_null() {
                assert!(
                    ok.contains(&d),
                    "{name} depends on {d}, against the crate map"
                );
            }
        }
    }
    assert_eq!(
        seen,
        ALLOWED.len(),
        "every crate of the map is in the workspace"
    );
}
