//! Emitted code as text: every example deployment's kernels and plan are
//! pinned by insta snapshots, so any change to generated code is reviewed.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use moeforge::codegen::{self, NvccMode};
use moeforge::dsl::{check_paths, FsLoader};

#[test]
fn emitted_kernels_and_plans_are_pinned() {
    for ex in examples() {
        let checked =
            check_paths(std::slice::from_ref(&ex), &FsLoader).unwrap_or_else(|f| panic!("{}", f.render(false)));
        for id in checked.spec.deploy_ids() {
            let plan = codegen::plan_deployment(&checked, id)
                .unwrap_or_else(|d| panic!("{}", d.render(&checked.sources, false)));
            let (bundle, _) = codegen::emit(&checked, id, &plan, &NvccMode::Off).unwrap_or_else(|e| panic!("{e}"));
            let name = stem(&ex);
            for (path, bytes) in &bundle.files {
                let Some(kernel) = path.strip_prefix("kernels/").and_then(|p| p.strip_suffix(".cu")) else { continue };
                insta::assert_snapshot!(format!("{name}__{kernel}"), String::from_utf8_lossy(bytes));
            }
            insta::assert_snapshot!(format!("{name}__plan"), plan.plan().to_string());
        }
    }
}

#[test]
fn plan_memory_budget_is_rejected_when_it_cannot_fit() {
    let text = std::fs::read_to_string(root().join("examples/qwen3-235b-a22b-h200.moe")).unwrap_or_default();
    let text = text
        .replace("\"../models/", &format!("\"{}/models/", root().display()))
        .replace("memory_fraction = 0.85", "memory_fraction = 0.4");
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = tmp.path().join("tight.moe");
    std::fs::write(&path, text).ok();
    let checked = check_paths(&[path], &FsLoader).unwrap_or_else(|f| panic!("{}", f.render(false)));
    let diags = codegen::plan_deployment(&checked, moeforge::dsl::spec::DeployId(0))
        .err()
        .unwrap_or_else(|| panic!("should not fit"));
    let rendered = diags.render(&checked.sources, false);
    assert!(
        rendered.contains("E0140") && rendered.contains("tight.moe:") && rendered.contains("does not fit"),
        "{rendered}"
    );
}

/// Templates only print: no template compares strings to choose code (the
/// targets and the kernels pass decide; a partial per target holds its code).
#[test]
fn templates_choose_no_code_by_string() {
    let dir = root().join("codegen/templates");
    let mut files = vec![];
    for e in std::fs::read_dir(&dir).unwrap().chain(std::fs::read_dir(dir.join("apk")).unwrap()) {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "tera") {
            files.push(p);
        }
    }
    assert!(files.len() >= 5, "{files:?}");
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for (n, line) in text.lines().enumerate() {
            let tag = line.contains("{%") && (line.contains("== \"") || line.contains("!= \""));
            assert!(!tag, "{}:{}: a template compares strings: {line}", f.display(), n + 1);
        }
    }
}

/// Replicas and a live TP↔EP switch do not combine in this version: the
/// compiler says so at the deployment's `placement` field, with why.
#[test]
fn replicas_with_a_switching_deployment_are_refused_at_the_placement() {
    let block = std::fs::read_to_string(root().join("models/tiny-qwen3.moe")).unwrap().replace("tiny-qwen3", "tiny");
    let text = common::cpu_spec::cpu_cluster_deployment(
        &block,
        1,
        4,
        0.6,
        "placement { policy = zepp redundant_experts = 4 }",
    );
    let checked = moeforge::dsl::check_str("switching.moe", &text).unwrap_or_else(|f| panic!("{}", f.render(false)));
    let diags = codegen::plan_deployment(&checked, moeforge::dsl::spec::DeployId(0))
        .err()
        .unwrap_or_else(|| panic!("a switching deployment with replicas planned"));
    let rendered = diags.render(&checked.sources, false);
    assert!(
        rendered.contains("switching.moe:")
            && rendered.contains("expert replicas cannot be combined with TP↔EP switching")
            && rendered.contains("per-layer descriptors")
            && rendered.contains("remove the `switch` block"),
        "{rendered}"
    );
    // Without the switch the same placement plans: single-mode EP with 5
    // slots per rank (colocated; `auto` would weigh role plans too).
    let text = text.replace("switch { t_high = 4 t_low = 2 window = 2 cooldown = 0s }", "strategy = colocated");
    let checked = moeforge::dsl::check_str("ep.moe", &text).unwrap_or_else(|f| panic!("{}", f.render(false)));
    let plan = codegen::plan_deployment(&checked, moeforge::dsl::spec::DeployId(0))
        .unwrap_or_else(|d| panic!("{}", d.render(&checked.sources, false)));
    assert_eq!(plan.plan().layout.max_experts_per_rank, 5);
    assert_eq!(plan.plan().memory.modes, vec![moeforge::plan::memory::Mode::Ep]);
}
