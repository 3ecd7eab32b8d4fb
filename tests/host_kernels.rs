//! Host-emulation tier: the emitted router and permutation kernels run on the
//! CPU through a small CUDA shim (tests/shim: CUDA threads as std::threads,
//! warp shuffles and ballots through per-warp barriers) and must agree with
//! the scalar references in `moeforge_runtime::reference`. This executes the
//! very source that nvcc compiles, specialized per example deployment.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use moeforge::codegen::{self, NvccMode};
use moeforge::dsl::{check_paths, FsLoader};
use moeforge::plan::KernelParams;
use moeforge::runtime::reference::{self, RoutingRule};
use std::path::{Path, PathBuf};
use std::process::Command;

struct Emitted {
    name: String,
    plan: codegen::Plan,
    files: std::collections::BTreeMap<String, Vec<u8>>,
    routing: moeforge::dsl::spec::Routing,
}

fn emit(example: &Path) -> Emitted {
    let checked = check_paths(&[example.to_path_buf()], &FsLoader).unwrap_or_else(|f| panic!("{}", f.render(false)));
    let id = moeforge::dsl::spec::DeployId(0);
    let plan =
        codegen::plan_deployment(&checked, id).unwrap_or_else(|d| panic!("{}", d.render(&checked.sources, false)));
    let (bundle, _) = codegen::emit(&checked, id, &plan, &NvccMode::Off).unwrap();
    let routing = checked.spec.model(checked.spec.deploys[0].model).moe.routing;
    Emitted { name: stem(example), plan: plan.plan().clone(), files: bundle.files, routing }
}

/// Builds `driver` with the kernel source included; returns the binary.
fn build(dir: &Path, driver: &str, kernel_src: &[u8], tag: &str) -> PathBuf {
    build_host_driver(dir, driver, kernel_src, tag, &[])
}

fn run(bin: &Path, input: &[u8], dir: &Path) -> Vec<u8> {
    let (i, o) = (dir.join("in.bin"), dir.join("out.bin"));
    std::fs::write(&i, input).unwrap();
    let status = Command::new(bin).arg(&i).arg(&o).status().unwrap();
    assert!(status.success(), "{}: exit {status}", bin.display());
    std::fs::read(&o).unwrap()
}

fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
}

#[test]
fn emitted_router_matches_reference_on_every_example() {
    let tmp = tempfile::tempdir().unwrap();
    for ex in examples() {
        let e = emit(&ex);
        let KernelParams::Router(p) = &e.plan.kernels.iter().find(|k| k.name == "router").unwrap().params else {
            panic!("no router")
        };
        let (experts, k) = (p.experts as usize, p.top_k as usize);
        let bin = build(tmp.path(), "router_main.cpp", &e.files["kernels/router.cu"], &format!("{}-router", e.name));
        let mut rng = Rng(0x5eed ^ experts as u64);
        // 37 tokens: not a multiple of the warps per block, so a block exits early.
        let tokens = 37;
        let mut logits = Vec::with_capacity(tokens * experts);
        for t in 0..tokens {
            if t == 5 {
                logits.extend(std::iter::repeat_n(0.25f32, experts)); // all tied: lower ids win
            } else {
                // distinct values, so only deliberate ties exist
                logits.extend(rng.permutation(experts).into_iter().map(|v| (v as f32 - experts as f32 / 2.0) * 0.05));
            }
        }
        let bias: Vec<f32> = (0..experts).map(|_| (rng.unit() * 64.0).round() / 1024.0).collect();
        let mut input = Vec::new();
        input.extend((tokens as i32).to_le_bytes());
        input.extend((experts as i32).to_le_bytes());
        logits.iter().chain(&bias).for_each(|v| input.extend(v.to_le_bytes()));
        let out = run(&bin, &input, tmp.path());
        let (ids, weights) = out.split_at(tokens * k * 4);
        let (ids, weights) = (i32s(ids), f32s(weights));
        let rule = RoutingRule { experts, top_k: k, routing: e.routing };
        let (want_ids, want_w) = reference::route(&rule, &logits, Some(&bias));
        assert_eq!(ids, want_ids, "{}: router ids differ", e.name);
        for (i, (a, b)) in weights.iter().zip(&want_w).enumerate() {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1e-3), "{}: weight {i}: kernel {a} vs reference {b}", e.name);
        }
    }
}

#[test]
fn emitted_permutation_and_combine_match_reference() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["qwen3-30b-a3b-h200", "mixtral-8x7b-a100", "glm-5-h800x24"] {
        let e = emit(&root().join(format!("examples/{name}.moe")));
        let KernelParams::Permute(p) = &e.plan.kernels.iter().find(|k| k.name == "permute").unwrap().params else {
            panic!("no permute")
        };
        let (hidden, k, m_t) = (p.hidden as usize, p.top_k as usize, p.block_m as usize);
        let bin = build(tmp.path(), "permute_main.cpp", &e.files["kernels/permute.cu"], &format!("{}-permute", e.name));
        // The last rank: with uneven splits (GLM-5: 256 experts on 24 GPUs) it holds fewer experts.
        let last = e.plan.ranks.last().unwrap();
        let (begin, num_local) = (last.experts[0] as i32, (last.experts[1] - last.experts[0]) as usize);
        let mut rng = Rng(0xc0ffee ^ hidden as u64);
        let tokens = 19;
        let experts = e.plan.model.experts as usize;
        let mut ids = Vec::new();
        for _ in 0..tokens {
            // Bias towards the local range so several local experts get more than one row.
            let mut picks: Vec<i32> = Vec::new();
            while picks.len() < k {
                let id =
                    if rng.below(2) == 0 { begin + rng.below(num_local) as i32 } else { rng.below(experts) as i32 };
                if !picks.contains(&id) {
                    picks.push(id);
                }
            }
            ids.extend(picks);
        }
        let weights: Vec<f32> = (0..tokens * k).map(|_| rng.unit().abs() + 0.01).collect();
        let x: Vec<u16> = (0..tokens * hidden).map(|_| reference::f32_to_bf16(rng.unit() * 4.0)).collect();
        let mut input = Vec::new();
        for v in [tokens as i32, begin, num_local as i32] {
            input.extend(v.to_le_bytes());
        }
        ids.iter().for_each(|v| input.extend(v.to_le_bytes()));
        weights.iter().for_each(|v| input.extend(v.to_le_bytes()));
        x.iter().for_each(|v| input.extend(v.to_le_bytes()));
        let out = run(&bin, &input, tmp.path());

        let want = reference::permute(&ids, begin, num_local, m_t);
        let rows = *want.offsets.last().unwrap() as usize;
        let mut at = 0;
        let mut take = |n: usize| {
            let s = &out[at..at + n];
            at += n;
            s
        };
        assert_eq!(i32s(take(num_local * 4)), want.counts, "{name}: counts");
        assert_eq!(i32s(take((num_local + 1) * 4)), want.offsets, "{name}: offsets");
        assert_eq!(i32s(take(4)), vec![rows as i32], "{name}: rows");
        assert!(want.counts.iter().any(|&c| c > 1), "{name}: the test should give some expert several rows");
        assert_eq!(i32s(take(rows * 4)), want.row_entry, "{name}: row_entry");
        assert_eq!(i32s(take(rows * 4)), want.row_expert, "{name}: row_expert");
        assert_eq!(i32s(take(tokens * k * 4)), want.entry_row, "{name}: entry_row");
        let x_perm = u16s(take(rows * hidden * 2));
        for (r, &entry) in want.row_entry.iter().enumerate() {
            let got = &x_perm[r * hidden..(r + 1) * hidden];
            if entry < 0 {
                assert!(got.iter().all(|&v| v == 0), "{name}: padding row {r} not zeroed");
            } else {
                let t = entry as usize / k;
                assert_eq!(got, &x[t * hidden..(t + 1) * hidden], "{name}: row {r} is not token {t}");
            }
        }
        // The driver's stand-in expert: y = bf16(x_perm · (local expert + 1) · 0.5).
        let y: Vec<u16> = x_perm
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let scale = (want.row_expert[i / hidden] + 1) as f32 * 0.5;
                reference::f32_to_bf16(reference::bf16_to_f32(v) * scale)
            })
            .collect();
        let combined = u16s(take(tokens * hidden * 2));
        assert_eq!(combined, reference::combine(&y, hidden, &want.entry_row, &weights, k), "{name}: combine");
    }
}
