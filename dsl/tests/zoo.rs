//! The model zoo and example deployments: every file checks, and each checked
//! spec is pinned by a snapshot (serde JSON plus parameter counts).

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use moeforge_dsl::{check_paths, FsLoader};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn moe_files(dir: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join(dir))
        .map(|rd| {
            rd.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "moe")).collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn every_model_and_example_checks() {
    let files: Vec<PathBuf> = moe_files("models").into_iter().chain(moe_files("examples")).collect();
    assert!(files.len() >= 14, "zoo incomplete: {files:?}");
    for f in files {
        if let Err(e) = check_paths(std::slice::from_ref(&f), &FsLoader) {
            panic!("{}:\n{}", f.display(), e.render(false));
        }
    }
}

/// Published total parameter counts (billions), ±4% for what the language
/// leaves out (MTP heads, biases, DSA indexers).
#[test]
fn parameter_counts_match_published_sizes() {
    let expect = [
        ("qwen3-30b-a3b", 30.5, 3.3),
        ("qwen3-235b-a22b", 235.1, 22.2),
        ("deepseek-v3", 671.0, 37.0),
        ("kimi-k2", 1026.0, 32.6),
        ("minimax-m2", 229.0, 10.0),
        ("glm-4.5-air", 106.0, 12.0),
        ("glm-5", 744.0, 40.0),
        ("mixtral-8x7b", 46.7, 12.9),
        ("gpt-oss-120b", 116.8, 5.1),
    ];
    for (name, total_b, active_b) in expect {
        let path = root().join("models").join(format!("{name}.moe"));
        let checked = check_paths(&[path], &FsLoader).unwrap_or_else(|e| panic!("{}", e.render(false)));
        let m = &checked.spec.models[0];
        let total = m.params().total() as f64 / 1e9;
        let active = m.active_params() as f64 / 1e9;
        assert!((total / total_b - 1.0).abs() < 0.04, "{name}: total {total:.1}B vs published {total_b}B");
        assert!((active / active_b - 1.0).abs() < 0.12, "{name}: active {active:.2}B vs published {active_b}B");
    }
}

#[test]
fn checked_specs_are_pinned() {
    for f in moe_files("examples") {
        let checked =
            check_paths(std::slice::from_ref(&f), &FsLoader).unwrap_or_else(|e| panic!("{}", e.render(false)));
        for id in checked.spec.deploy_ids() {
            let d = checked.spec.deployment(id);
            let m = &d.models[0];
            let summary = serde_json::json!({
                "spec": d,
                "params_total": m.params().total(),
                "params_active": m.active_params(),
                "weight_bytes": m.weight_bytes(),
            });
            let name = f.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            insta::assert_json_snapshot!(name, summary);
        }
    }
}

/// The textual form of a checked spec is valid `.moe` that checks back to an
/// equal spec (the form `moeforge explain` prints).
#[test]
fn display_form_round_trips() {
    for f in moe_files("examples").into_iter().chain(moe_files("models")) {
        let checked =
            check_paths(std::slice::from_ref(&f), &FsLoader).unwrap_or_else(|e| panic!("{}", e.render(false)));
        let text = checked.spec.to_string();
        let again = moeforge_dsl::check_str("printed.moe", &text)
            .unwrap_or_else(|e| panic!("{} printed as invalid .moe:\n{}\n{text}", f.display(), e.render(false)));
        assert_eq!(again.spec, checked.spec, "{} does not round-trip:\n{text}", f.display());
    }
}
