//! Host emulation of the Adaptive Persistent Kernel: the scheduler and
//! signalling of the emitted `apk.cu` (the same source nvcc compiles) build
//! with g++ against runtime/shim/apk_host.h (CTAs and clusters as threads,
//! scoped atomics as std::atomic_ref, distributed shared memory as a
//! per-cluster slot table) and run a seeded random mix of prefill and decode
//! operations. The driver (runtime/shim/apk_main.cpp) checks from the trace that
//! every tile runs exactly once, GateUp→Down dependencies hold, outputs equal
//! the scalar reference bit for bit (small shapes), decode-assigned clusters
//! start at most one prefill tile after the signal, idle clusters take the
//! other phase's tiles, and nothing deadlocks. ThreadSanitizer runs too.

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

fn build(dir: &Path, src: &[u8], tag: &str, tsan: bool) -> PathBuf {
    let extra: &[&str] = if tsan { &["-fsanitize=thread"] } else { &[] };
    build_host_driver(dir, "apk_main.cpp", src, tag, extra)
}

/// Runs the driver; returns its metrics line as key → value.
fn drive(bin: &Path, seed: u64, clusters: u32, ops: u32, compute: bool, max_rows: u32) -> Vec<(String, u64)> {
    drive_widened(bin, seed, clusters, ops, compute, max_rows, 0)
}

fn drive_widened(
    bin: &Path,
    seed: u64,
    clusters: u32,
    ops: u32,
    compute: bool,
    max_rows: u32,
    widen_us: u32,
) -> Vec<(String, u64)> {
    let o = Command::new(bin)
        .args([seed.to_string(), clusters.to_string(), ops.to_string(), u32::from(compute).to_string()])
        .args([max_rows.to_string(), widen_us.to_string()])
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

#[test]
fn apk_computes_the_reference_on_small_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    let ex = root().join("examples/tiny-qwen3-cpu4.moe");
    for (name, p, src) in apks(&ex) {
        let bin = build(tmp.path(), &src, &name, false);
        for seed in [1, 2, 3] {
            let m = drive(&bin, seed, p.max_clusters, 120, true, 80);
            assert_eq!(metric(&m, "compute"), 1);
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
            let bin = build(tmp.path(), &src, &format!("{}-{name}", stem(&ex)), false);
            let m = drive(&bin, 11, p.max_clusters, 40, false, 64);
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
        let bin = build(tmp.path(), &src, &format!("fp8-{name}"), false);
        for seed in [1, 2] {
            let m = drive(&bin, seed, p.max_clusters, 60, true, 48);
            assert_eq!(metric(&m, "compute"), 1);
        }
    }
}

#[test]
fn apk_scheduler_is_race_free_under_thread_sanitizer() {
    let tmp = tempfile::tempdir().unwrap();
    let fp8 = tiny_fp8(tmp.path());
    for (ex, compute, clusters) in [
        (root().join("examples/tiny-qwen3-cpu4.moe"), true, None),
        (fp8, false, None), // the transform thread's signalling; its data path is the reference on the host
        (root().join("examples/qwen3-30b-a3b-h200.moe"), false, Some(24)),
    ] {
        let ex_name = stem(&ex);
        for (name, p, src) in apks(&ex) {
            let bin = build(tmp.path(), &src, &format!("tsan-{ex_name}-{name}"), true);
            let m = drive(&bin, 5, clusters.unwrap_or(p.max_clusters), 60, compute, 40);
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
        let bin = build(tmp.path(), &src, &format!("widen-{name}"), false);
        let m = drive_widened(&bin, 9, p.max_clusters, 40, true, 40, 50_000);
        assert_eq!(metric(&m, "ops"), 40);
    }
}

/// The dense form, launched per operation as colocated ranks do, on an
/// sm_90a tile set with 2-CTA clusters and an sm_80 one: random shapes
/// (partial tiles in rows, columns and K; x and y inside wider rows) and
/// every epilogue, against the driver's own triple loop, with sentinels
/// around the outputs. A grid smaller than the tile count makes clusters
/// loop; the full grid leaves most clusters without a tile.
#[test]
fn dense_apk_runs_every_gemm_shape_and_epilogue_per_operation() {
    let tmp = tempfile::tempdir().unwrap();
    for ex in ["tiny-qwen3-cpu4", "mixtral-8x7b-a100"] {
        let list = apks_of(&root().join(format!("examples/{ex}.moe")), &[moeforge::plan::ApkForm::Dense]);
        assert_eq!(list.len(), 1, "{ex}: one dense APK");
        let (name, p, src) = &list[0];
        let bin = build_host_driver(tmp.path(), "dense_main.cpp", src, &format!("{ex}-{name}"), &[]);
        for (seed, clusters) in [(1, 3.min(p.max_clusters)), (2, 1), (3, p.max_clusters)] {
            let o = Command::new(&bin).args([seed.to_string(), clusters.to_string(), "24".into()]).output().unwrap();
            let (out, err) = (text(&o.stdout), text(&o.stderr));
            assert!(o.status.success(), "{ex} seed {seed}: exit {}\n{out}\n{err}", o.status);
            let m: Vec<(String, u64)> = out
                .split_whitespace()
                .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.parse().unwrap_or(0))))
                .collect();
            assert_eq!(metric(&m, "ops"), 24);
            assert!(metric(&m, "checked") > 10_000, "{m:?}");
            for e in 0..4 {
                assert!(metric(&m, &format!("epilogue_{e}")) > 0, "{ex} seed {seed}: epilogue {e} never drawn: {m:?}");
            }
        }
    }
}
