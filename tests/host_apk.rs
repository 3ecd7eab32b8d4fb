//! Host emulation of the Adaptive Persistent Kernel, in two tiers, both
//! building the emitted `apk.cu` (the same source nvcc compiles) with g++
//! against runtime/shim/:
//!   - instructions: every CUDA thread a fiber, the grid resident in its CTA
//!     clusters, the PTX layer emulated instruction by instruction
//!     (ptx_host.h: TMA boxes with 128-byte swizzling, wgmma through its
//!     shared-memory descriptors and fragment layout, mbarrier transaction
//!     counts, DSMEM; cp.async, ldmatrix and mma.sync on sm_80), so the
//!     tensor-core path computes and its outputs are held to a reference the
//!     driver writes itself;
//!   - protocol: each CTA role an OS thread, tiles that only signal, at the
//!     examples' full grids and under ThreadSanitizer.
//!
//! The driver (runtime/shim/apk_main.cpp) posts a seeded random mix of
//! prefill and decode operations while the persistent grid runs and checks
//! from the trace that every tile runs exactly once, GateUp→Down
//! dependencies hold, decode-assigned clusters start at most one prefill tile
//! after the signal, idle clusters take the other phase's tiles, and nothing
//! deadlocks.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use moeforge::codegen::{self, NvccMode};
use moeforge::dsl::{check_paths, FsLoader};
use moeforge::plan::KernelParams;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Every routed-experts APK source of an example (EP's, and TP's in a dual
/// plan) with its parameters.
fn apks(example: &Path) -> Vec<(String, moeforge::plan::ApkParams, Vec<u8>)> {
    use moeforge::plan::ApkForm;
    apks_of(example, &[ApkForm::Experts, ApkForm::ExpertsTp])
}

fn apks_of(example: &Path, forms: &[moeforge::plan::ApkForm]) -> Vec<(String, moeforge::plan::ApkParams, Vec<u8>)> {
    let checked = check_paths(&[example.to_path_buf()], &FsLoader).unwrap_or_else(|f| panic!("{}", f.render(false)));
    let id = moeforge::dsl::spec::DeployId(0);
    let plan =
        codegen::plan_deployment(&checked, id).unwrap_or_else(|d| panic!("{}", d.render(&checked.sources, false)));
    let (bundle, _) = codegen::emit(&checked, id, &plan, &NvccMode::Off).unwrap();
    plan.plan()
        .kernels
        .iter()
        .filter_map(|k| match &k.params {
            KernelParams::Apk(p) if forms.contains(&p.form) => {
                Some((k.name.clone(), p.clone(), bundle.files[&format!("kernels/{}.cu", k.name)].clone()))
            }
            _ => None,
        })
        .collect()
}

#[derive(Clone, Copy, PartialEq)]
enum Tier {
    /// Every CUDA thread a fiber, the PTX layer emulated: tiles compute.
    Instructions,
    /// Each CTA role an OS thread, tiles only signal.
    Protocol,
    /// The protocol tier under ThreadSanitizer.
    ProtocolTsan,
}

fn build(dir: &Path, src: &[u8], tag: &str, tier: Tier) -> PathBuf {
    let extra: &[&str] = match tier {
        Tier::Instructions => &[],
        Tier::Protocol => &["-DAPK_PROTOCOL_TIER"],
        Tier::ProtocolTsan => &["-DAPK_PROTOCOL_TIER", "-fsanitize=thread"],
    };
    build_host_driver(dir, "apk_main.cpp", src, tag, extra)
}

/// Runs the driver; returns its metrics line as key → value.
fn drive(bin: &Path, seed: u64, clusters: u32, ops: u32, max_rows: u32) -> Vec<(String, u64)> {
    drive_widened(bin, seed, clusters, ops, max_rows, 0)
}

fn drive_widened(bin: &Path, seed: u64, clusters: u32, ops: u32, max_rows: u32, widen_us: u32) -> Vec<(String, u64)> {
    let o = Command::new(bin)
        .args([seed.to_string(), clusters.to_string(), ops.to_string(), max_rows.to_string(), widen_us.to_string()])
        .env("TSAN_OPTIONS", "halt_on_error=1 exitcode=66")
        .output()
        .unwrap();
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(o.status.success(), "{} seed {seed}: exit {}\n{out}\n{err}", bin.display(), o.status);
    assert!(!err.contains("ThreadSanitizer"), "{err}");
    out.split_whitespace()
        .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.parse().unwrap_or(0))))
        .collect()
}

fn metric(m: &[(String, u64)], k: &str) -> u64 {
    m.iter().find(|(n, _)| n == k).map(|(_, v)| *v).unwrap_or_else(|| panic!("no {k} in {m:?}"))
}

/// The tensor-core path computes: EP's and TP's APK of the tiny model, the
/// persistent grid fed concurrently by the attention side, every output row
/// against the driver's reference.
#[test]
fn apk_computes_the_reference_on_small_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    let ex = root().join("examples/tiny-qwen3-cpu4.moe");
    for (name, p, src) in apks(&ex) {
        let bin = build(tmp.path(), &src, &name, Tier::Instructions);
        for seed in [1, 2] {
            let m = drive(&bin, seed, p.max_clusters, 120, 80);
            assert_eq!(metric(&m, "compute"), 1);
            assert!(metric(&m, "checked") > 1_000_000, "{m:?}");
            assert!(metric(&m, "contended_signals") > 0, "decode never contended with prefill: {m:?}");
        }
    }
}

#[test]
fn apk_schedules_every_example_at_full_size() {
    let tmp = tempfile::tempdir().unwrap();
    for ex in examples() {
        let list = apks(&ex);
        // Every example deployment's MoE ranks get an APK (bf16 and fp8 experts).
        assert!(!list.is_empty(), "{}: no APK", stem(&ex));
        for (name, p, src) in list {
            let bin = build(tmp.path(), &src, &format!("{}-{name}", stem(&ex)), Tier::Protocol);
            let m = drive(&bin, 11, p.max_clusters, 40, 64);
            assert!(metric(&m, "tiles") > 0, "{}: {m:?}", stem(&ex));
            // One APK CTA per SM: the whole grid emulated, decode's q' binds.
            assert!(metric(&m, "contended_signals") > 0, "{}: never contended {m:?}", stem(&ex));
        }
    }
}

/// A small fp8 model (gate and up in separate 128-row scale blocks, two
/// blocks along K for GateUp and two row blocks for Down) on the tiny model's
/// four ranks: the APK's W8A16 path, whose transform warps run as one more
/// host thread per CTA.
fn tiny_fp8(dir: &Path) -> PathBuf {
    write_spec(
        dir,
        "tiny-fp8.moe",
        &["models/clusters.moe", "models/tiles.moe"],
        "model tiny-fp8 { layers = 2 hidden = 256 vocab = 512 rope_theta = 1000000 rms_eps = 1e-6
           attention gqa { heads = 8 kv_heads = 2 head_dim = 32 qk_norm = true }
           moe { experts = 16 top_k = 4 expert_ffn = 128 routing softmax_topk { norm_topk = true } }
           dtype { weights = fp8_e4m3 block_scale = [128, 128] activations = bf16 } }
         deploy tiny-fp8-cpu4 { model = tiny-fp8 cluster = cpu4 tiles = hopper-fp8 slo { ttft = 1s tpot = 50ms }
           workload { input = sharegpt output = sharegpt arrival poisson { rate = 4req/s } }
           strategy = colocated memory_fraction = 0.6 }\n",
    )
}

#[test]
fn apk_dequantizes_fp8_weights_like_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, p, src) in apks(&tiny_fp8(tmp.path())) {
        assert!(String::from_utf8_lossy(&src).contains("kFp8Weights = true"));
        let bin = build(tmp.path(), &src, &format!("fp8-{name}"), Tier::Instructions);
        for seed in [1, 2] {
            let m = drive(&bin, seed, p.max_clusters, 60, 48);
            assert_eq!(metric(&m, "compute"), 1);
            assert!(metric(&m, "checked") > 100_000, "{m:?}");
        }
    }
}

#[test]
fn apk_scheduler_is_race_free_under_thread_sanitizer() {
    let tmp = tempfile::tempdir().unwrap();
    let fp8 = tiny_fp8(tmp.path());
    for (ex, clusters) in [
        (root().join("examples/tiny-qwen3-cpu4.moe"), None),
        (fp8, None), // the transform thread's signalling
        (root().join("examples/qwen3-30b-a3b-h200.moe"), Some(24)),
    ] {
        let ex_name = stem(&ex);
        for (name, p, src) in apks(&ex) {
            let bin = build(tmp.path(), &src, &format!("tsan-{ex_name}-{name}"), Tier::ProtocolTsan);
            let m = drive(&bin, 5, clusters.unwrap_or(p.max_clusters), 60, 40);
            assert!(metric(&m, "tiles") > 0);
        }
    }
}

/// CTA 0 stalls between publishing an operation and its claim word: with the
/// fields published in the wrong order, a finishing cluster would publish a
/// stale `done` and the attention side would wait forever (a review found
/// exactly that; the watchdog turns it into a failure).
#[test]
fn apk_publishes_an_operation_before_its_tiles_can_be_claimed() {
    let tmp = tempfile::tempdir().unwrap();
    let ex = root().join("examples/tiny-qwen3-cpu4.moe");
    for (name, p, src) in apks(&ex) {
        let bin = build(tmp.path(), &src, &format!("widen-{name}"), Tier::Protocol);
        let m = drive_widened(&bin, 9, p.max_clusters, 40, 40, 50_000);
        assert_eq!(metric(&m, "ops"), 40);
    }
}

/// The dense form, launched per operation as colocated ranks do, on an
/// sm_90a tile set with 2-CTA clusters, an sm_80 one and (fp8 weights with
/// 128×128 block scales, W8A16) the tiny fp8 model's `dense_fp8`: random
/// shapes (partial tiles in rows, columns and K; x and y inside wider rows)
/// and every epilogue, against the driver's own triple loop, with sentinels
/// around the outputs. A grid smaller than the tile count makes clusters
/// loop; the full grid leaves most clusters without a tile.
#[test]
fn dense_apk_runs_every_gemm_shape_and_epilogue_per_operation() {
    let tmp = tempfile::tempdir().unwrap();
    let fp8 = tiny_fp8(tmp.path());
    let mut cases = Vec::new();
    for ex in [root().join("examples/tiny-qwen3-cpu4.moe"), root().join("examples/mixtral-8x7b-a100.moe")] {
        let list = apks_of(&ex, &[moeforge::plan::ApkForm::Dense]);
        assert_eq!(list.len(), 1, "{}: one dense APK", stem(&ex));
        cases.extend(list);
    }
    let list = apks_of(&fp8, &[moeforge::plan::ApkForm::Dense]);
    assert_eq!(
        list.iter().map(|(n, _, _)| n.as_str()).collect::<Vec<_>>(),
        ["dense", "dense_fp8"],
        "an fp8 model gets both dense instances (its LM head and router are bf16)"
    );
    cases.extend(list.into_iter().filter(|(n, _, _)| n == "dense_fp8"));
    for (i, (name, p, src)) in cases.iter().enumerate() {
        let bin = build_host_driver(tmp.path(), "dense_main.cpp", src, &format!("dense{i}-{name}"), &[]);
        for (seed, clusters) in [(1, 3.min(p.max_clusters)), (2, 1), (3, p.max_clusters)] {
            let o = Command::new(&bin).args([seed.to_string(), clusters.to_string(), "24".into()]).output().unwrap();
            let (out, err) = (text(&o.stdout), text(&o.stderr));
            assert!(o.status.success(), "{name} seed {seed}: exit {}\n{out}\n{err}", o.status);
            let m: Vec<(String, u64)> = out
                .split_whitespace()
                .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.parse().unwrap_or(0))))
                .collect();
            assert_eq!(metric(&m, "ops"), 24);
            assert!(metric(&m, "checked") > 10_000, "{m:?}");
            for e in 0..4 {
                assert!(
                    metric(&m, &format!("epilogue_{e}")) > 0,
                    "{name} seed {seed}: epilogue {e} never drawn: {m:?}"
                );
            }
        }
    }
}

/// CUTLASS's headers from the toolchain venv (scripts/setup.sh), beside
/// nvcc's CUDA headers: (CuTe's include dir, CUDA's include dir).
fn cute_headers() -> Option<(PathBuf, PathBuf)> {
    let nvcc = nvcc()?;
    let cuda = nvcc.parent()?.parent()?.join("include");
    let site = nvcc.ancestors().nth(4)?;
    let cute = site.join("cutlass_library/source/include");
    if cute.join("cute/tensor.hpp").is_file() && cuda.join("cccl").is_dir() {
        return Some((cute, cuda));
    }
    if std::env::var("MOEFORGE_REQUIRE_NVCC").is_ok_and(|v| v == "1") {
        panic!("MOEFORGE_REQUIRE_NVCC=1 but CUTLASS's headers are not in the toolchain venv: run scripts/setup.sh");
    }
    None
}

/// The PTX layer's emulation against a definition nobody here wrote: CuTe's
/// GMMA shared-memory atoms (TMA boxes under 128B, 64B and 32B swizzling,
/// the wgmma descriptor decoder in all four modes, the emitted kernel's own
/// descriptor fields), wgmma's accumulator layout for every N, mma.sync's
/// A/B/C and ldmatrix's fragments, and both MMA paths end to end on
/// CuTe-laid tiles (tests/cute/).
#[test]
fn ptx_emulation_layouts_match_cute() {
    let Some((cute, cuda)) = cute_headers() else {
        eprintln!("skipped: no CUTLASS headers (run scripts/setup.sh)");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let obj = tmp.path().join("cute_tables.o");
    let o = Command::new("g++")
        .args(["-std=c++17", "-O1", "-w", "-c"])
        .arg(format!("-I{}", cute.display()))
        .arg(format!("-I{}", cuda.display()))
        .arg(format!("-I{}", cuda.join("cccl").display()))
        .arg(root().join("tests/cute/cute_tables.cpp"))
        .arg("-o")
        .arg(&obj)
        .output()
        .unwrap();
    assert!(o.status.success(), "CuTe's tables do not build:\n{}", text(&o.stderr));
    let dense = apks_of(&root().join("examples/tiny-qwen3-cpu4.moe"), &[moeforge::plan::ApkForm::Dense]);
    let check = root().join("tests/cute/layout_check.cpp");
    let obj_arg = obj.display().to_string();
    let bin = build_host_driver(tmp.path(), &check.display().to_string(), &dense[0].2, "layout_check", &[&obj_arg]);
    let o = Command::new(&bin).output().unwrap();
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(o.status.success(), "{out}\n{err}");
    let n: u64 = out.trim().rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!(n > 100_000, "too few layout points compared: {out}");
}

/// The emulation sees layout: the same kernels with the wgmma descriptor's
/// swizzle mode flipped from 128B to 64B, two accumulator fragment indices
/// swapped in the epilogue, or (sm_80) ldmatrix's A-row address taken from
/// the wrong lanes, each fail the driver's reference that the emitted
/// sources pass (`dense_apk_runs_every_gemm_shape_and_epilogue_per_operation`).
#[test]
fn a_wrong_swizzle_fragment_or_ldmatrix_address_fails_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        ("tiny-qwen3-cpu4", "| (64ull << 32) | (1ull << 62);", "| (64ull << 32) | (2ull << 62);"),
        (
            "tiny-qwen3-cpu4",
            "store_out(op, sh, epilogue, row, col, acc[4 * j + 2 * h] + b.x, acc[4 * j + 2 * h + 1] + b.y);",
            "store_out(op, sh, epilogue, row, col, acc[4 * j + 2 * h + 1] + b.x, acc[4 * j + 2 * h] + b.y);",
        ),
        ("mixtral-8x7b-a100", "static_cast<int>(lane / 16) * 8]);", "static_cast<int>((lane / 8) % 2) * 8]);"),
    ];
    for (i, (ex, from, to)) in cases.iter().enumerate() {
        let list = apks_of(&root().join(format!("examples/{ex}.moe")), &[moeforge::plan::ApkForm::Dense]);
        let src = text(&list[0].2);
        assert_eq!(src.matches(from).count(), 1, "{ex}: the mutated line is not in the emitted kernel: {from}");
        let bin =
            build_host_driver(tmp.path(), "dense_main.cpp", src.replace(from, to).as_bytes(), &format!("mut{i}"), &[]);
        let o = Command::new(&bin).args(["1", "2", "4"]).output().unwrap();
        let err = text(&o.stderr);
        assert!(!o.status.success() && err.contains("FAILED"), "{ex}: `{to}` passed the reference:\n{err}");
    }
}
