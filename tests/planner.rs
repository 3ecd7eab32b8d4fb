//! No spec the checker accepts may panic the planner or the emitter: it gets
//! a bundle, or located, coded diagnostics (never an internal error). Random
//! small deployments around the edges the checker allows (one SM, one GPU,
//! tiny HBM, odd expert counts, odd tiles, CTA clusters larger than the GPU,
//! fp8 with odd block scales) run check → plan → validate → emit → load.
//! `fuzz/fuzz_targets/plan.rs` runs the same generator from fuzz input.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
#[path = "common/specgen.rs"]
mod specgen;

use moeforge::codegen::{self, NvccMode};
use moeforge::dsl::{check_str, Code};
use specgen::{spec_text, Seeded};

/// What happened to one generated spec.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Refused,
    Unplanned,
    Bundle,
}

fn exercise(text: &str, dir: &std::path::Path) -> Outcome {
    let Ok(checked) = check_str("gen.moe", text) else { return Outcome::Refused };
    let id = moeforge::dsl::spec::DeployId(0);
    match codegen::plan_deployment(&checked, id) {
        Err(d) => {
            assert!(!d.is_empty());
            for x in d.iter() {
                assert_ne!(x.code, Code::Internal, "{}\n{text}", d.render(&checked.sources, false));
                assert!(x.primary.is_some() || x.code == Code::Unsupported, "unlocated: {x:?}\n{text}");
            }
            let _ = d.render(&checked.sources, false);
            Outcome::Unplanned
        }
        Ok(plan) => {
            let (bundle, _) =
                codegen::emit(&checked, id, &plan, &NvccMode::Off).unwrap_or_else(|e| panic!("{e}\n{text}"));
            bundle.write(dir).unwrap();
            let loaded = moeforge::plan::load_bundle(dir).unwrap_or_else(|e| panic!("{e}\n{text}"));
            assert_eq!(loaded.plan.plan(), plan.plan());
            Outcome::Bundle
        }
    }
}

#[test]
fn random_small_deployments_plan_or_fail_with_located_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let mut counts = [0usize; 3];
    for seed in 0..600u64 {
        let text = spec_text(&mut Seeded(seed));
        let o = exercise(&text, &tmp.path().join(format!("b{}", seed % 4)));
        counts[o as usize] += 1;
    }
    // The generator must reach the planner often, and both outcomes must occur.
    eprintln!("refused by the checker / refused by the planner / bundles: {counts:?}");
    assert!(counts[1] >= 30 && counts[2] >= 30, "{counts:?}");
}

/// Every example deployment under valid-but-unusual edits of the zoo
/// files it uses: tiny GPUs, odd node sizes, little HBM, odd tiles, odd
/// expert counts.
#[test]
fn zoo_mutations_plan_or_fail_with_located_errors() {
    let root = common::root();
    let mut zoo: Vec<(String, String)> = Vec::new();
    for dir in ["models", "examples"] {
        for e in std::fs::read_dir(root.join(dir)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_none_or(|x| x != "moe") {
                continue;
            }
            zoo.push((
                format!("{dir}/{}", p.file_name().unwrap().to_string_lossy()),
                std::fs::read_to_string(&p).unwrap(),
            ));
        }
    }
    zoo.sort();
    let mutations: &[(&str, &str, &str)] = &[
        ("models/clusters.moe", "sms = 132", "sms = 1"),
        ("models/clusters.moe", "sms = 132", "sms = 3"),
        ("models/clusters.moe", "sms = 108", "sms = 2"),
        ("models/clusters.moe", "gpus_per_node = 8", "gpus_per_node = 3"),
        ("models/clusters.moe", "gpus_per_node = 8", "gpus_per_node = 1"),
        ("models/clusters.moe", "hbm = 80GB", "hbm = 24GB"),
        ("models/clusters.moe", "nodes = 4", "nodes = 300"),
        ("models/clusters.moe", "hbm = 141GB", "hbm = 30GB"),
        ("models/tiles.moe", "block_n = 128", "block_n = 96"),
        ("models/tiles.moe", "cluster = [2, 1]", "cluster = [4, 1]"),
        ("models/tiles.moe", "stages = 4", "stages = 1"),
        ("models/tiles.moe", "block_k = 64", "block_k = 32"),
        ("models/tiles.moe", "block_m = 64", "block_m = 128"),
        ("models/qwen3-30b-a3b.moe", "experts = 128", "experts = 127"),
        ("models/tiny-qwen3.moe", "experts = 16", "experts = 5"),
        ("models/minimax-m2.moe", "experts = 256", "experts = 255"),
        ("models/mixtral-8x7b.moe", "top_k = 2", "top_k = 8"),
    ];
    let tmp = tempfile::tempdir().unwrap();
    let (mut tried, mut bundles) = (0, 0);
    for (file, from, to) in mutations {
        let Some((_, original)) = zoo.iter().find(|(p, _)| p == file) else { panic!("no {file}") };
        assert!(original.contains(from), "{file} has no `{from}`");
        let edited = original.replace(from, to);
        let files: Vec<(&str, &str)> =
            zoo.iter().map(|(p, t)| (p.as_str(), if p == file { edited.as_str() } else { t.as_str() })).collect();
        for (example, _) in zoo.iter().filter(|(p, _)| p.starts_with("examples/")) {
            let loader = moeforge::dsl::MemLoader::new(files.iter().copied());
            let Ok(checked) = moeforge::dsl::check_paths(&[example.into()], &loader) else { continue };
            tried += 1;
            let id = moeforge::dsl::spec::DeployId(0);
            match codegen::plan_deployment(&checked, id) {
                Err(d) => {
                    for x in d.iter() {
                        assert_ne!(
                            x.code,
                            Code::Internal,
                            "{example} with {from} → {to}:\n{}",
                            d.render(&checked.sources, false)
                        );
                        assert!(x.primary.is_some(), "{example} with {from} → {to}: unlocated {x:?}");
                    }
                }
                Ok(plan) => {
                    codegen::emit(&checked, id, &plan, &NvccMode::Off).unwrap_or_else(|e| panic!("{example}: {e}"));
                    bundles += 1;
                }
            }
        }
    }
    let _ = tmp;
    eprintln!("{tried} mutated compiles, {bundles} bundles");
    assert!(tried >= 100 && bundles >= 30, "{tried} compiles, {bundles} bundles");
}
