//! The GPU check script (`scripts/gpu-check.sh`) is tested here without a
//! GPU, so it is not dead code waiting for one: `--emu` builds the tiny
//! bundle's APK drivers with nvcc (spills fail the step) and runs the tiny
//! Qwen3-MoE fixture end to end on the emulated device across a live switch,
//! and again with Zepp's replicas, to transformers' tokens; a run without
//! bundles fails and says why,
//! instead of skipping.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn check(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, Value, String) {
    let out = tempfile::tempdir().unwrap();
    let mut c = Command::new("bash");
    c.arg(root().join("scripts/gpu-check.sh")).args(args).arg(out.path()).current_dir(root());
    c.env("MOEFORGE", env!("CARGO_BIN_EXE_moeforge"));
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    let report = std::fs::read_to_string(out.path().join("gpu-check.json"))
        .unwrap_or_else(|e| panic!("no report ({e}): {stdout}\n{}", String::from_utf8_lossy(&o.stderr)));
    (o.status.code(), serde_json::from_str(&report).unwrap(), stdout)
}

fn steps<'a>(report: &'a Value, step: &str) -> Vec<&'a Value> {
    report["steps"].as_array().unwrap().iter().filter(|s| s["step"] == step).collect()
}

#[test]
fn the_gpu_check_runs_on_the_emulated_device_and_reports() {
    let (code, report, stdout) = check(&["--emu"], &[]);
    assert_eq!(code, Some(0), "{stdout}");
    assert_eq!(report["ok"], true, "{stdout}");
    // Built with the real toolchain (scripts/setup.sh installs nvcc): both
    // APK forms of the tiny bundle, no spills.
    let builds = steps(&report, "build");
    let names: Vec<&str> = builds.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"tiny-qwen3-cpu4/apk") && names.contains(&"tiny-qwen3-cpu4/apk_tp"), "{names:?}");
    for b in builds.iter().filter(|b| b["name"] != "copy_check") {
        assert_eq!(b["result"]["spills"], serde_json::json!({}), "{b}");
        assert!(b["result"]["functions"]["moe_apk"].is_object(), "{b}");
    }
    // The model end to end on the emulated device, switching mode live,
    // then with Zepp's replicas.
    let e2e = steps(&report, "e2e");
    assert_eq!(e2e.len(), 2, "{stdout}");
    let r = &e2e[0]["result"];
    assert_eq!(r["match"], true, "{r}");
    assert_eq!(r["switches"], 1, "{r}");
    assert_eq!(r["tokens"], r["expected"]);
    // Its decode steps ran as graphs (the emulated device records them), as
    // the report reads them from the run's output.
    assert!(r["graphs"]["recorded"].as_u64().unwrap() > 0 && r["graphs"]["replayed"].as_u64().unwrap() > 0, "{r}");
    assert!(r.get("graph_refusals").is_none(), "{r}");
    // The replicated plan's decode steps route on the device and replay
    // graphs too, with transformers' tokens.
    let z = &e2e[1]["result"];
    assert_eq!((&z["placement"], &z["match"]), (&serde_json::json!("zepp"), &serde_json::json!(true)), "{z}");
    assert_eq!(z["tokens"], z["expected"]);
    assert!(z["graphs"]["recorded"].as_u64().unwrap() > 0 && z["graphs"]["replayed"].as_u64().unwrap() > 0, "{z}");
    assert!(z.get("graph_refusals").is_none(), "{z}");
    // The steps it cannot run here are listed, not skipped silently.
    assert!(report["missing"]["gpu_steps"].as_str().unwrap().contains("need a GPU"));
    assert!(stdout.contains("end-to-end tokens = transformers': 2/2 runs"), "{stdout}");
}

#[test]
fn a_gpu_check_without_bundles_fails_and_says_why() {
    let empty = tempfile::tempdir().unwrap();
    let (code, report, stdout) = check(&[], &[("GPU_BUNDLES", empty.path().to_str().unwrap())]);
    assert_eq!(code, Some(1), "{stdout}");
    assert_eq!(report["ok"], false);
    let missing: Vec<&Value> = steps(&report, "prepare").into_iter().filter(|s| s["ok"] == false).collect();
    assert_eq!(missing.len(), 6, "{stdout}");
    assert!(missing[0]["error"].as_str().unwrap().contains("run scripts/gpu-check.sh --prepare"), "{stdout}");
}
