//! The CLI as a user runs it: check, compile (atomic, deterministic bundles),
//! explain, JSON diagnostics, and bad input of every kind.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use moeforge::runtime::{load_bundle, BundleError};

#[test]
fn compile_embedded_default_writes_a_verified_bundle() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let out = tmp.path().join("b");
    let o = moeforge(&["compile", "-o", out.to_str().unwrap_or_default(), "--nvcc", "off"], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let stdout = text(&o.stdout);
    assert!(stdout.contains("qwen3-30b-a3b") && stdout.contains("ep8"), "{stdout}");
    let b = load_bundle(&out).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(b.plan.model.name, "qwen3-30b-a3b");
    assert_eq!(b.plan.cluster.world, 8);
    assert!(b.kernels.contains_key("router") && b.kernels.contains_key("permute"));
    for f in ["manifest.json", "spec.json", "plan.json", "report.md", "kernels/router.cu", "kernels/permute.cu"] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
}

#[test]
fn same_spec_compiles_to_identical_bytes() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    for ex in examples() {
        let a = tmp.path().join(format!("{}-a", stem(&ex)));
        let b = tmp.path().join(format!("{}-b", stem(&ex)));
        for d in [&a, &b] {
            let o = moeforge(
                &["compile", ex.to_str().unwrap_or_default(), "-o", d.to_str().unwrap_or_default(), "--nvcc", "off"],
                None,
            );
            assert!(o.status.success(), "{}: {}", ex.display(), text(&o.stderr));
        }
        let (ta, tb) = (read_tree(&a), read_tree(&b));
        assert!(ta.len() >= 6);
        assert_eq!(ta, tb, "{} compiled twice differs", ex.display());
    }
}

#[test]
fn a_failed_compile_leaves_nothing_and_keeps_the_old_bundle() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let bad = tmp.path().join("bad.moe");
    let good = std::fs::read_to_string(root().join("examples/qwen3-30b-a3b-h200.moe")).unwrap_or_default();
    let abs = good.replace("\"../models/", &format!("\"{}/models/", root().display()));
    std::fs::write(&bad, abs.replace("memory_fraction = 0.85", "memory_fraction = 0.01")).ok();
    // A fresh output directory is not created on error.
    let fresh = tmp.path().join("fresh");
    let o = moeforge(&["compile", bad.to_str().unwrap_or_default(), "-o", fresh.to_str().unwrap_or_default()], None);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("E0107"), "{}", text(&o.stderr));
    assert!(!fresh.exists());
    // An existing bundle survives a failing compile byte for byte.
    let kept = tmp.path().join("kept");
    let o = moeforge(&["compile", "-o", kept.to_str().unwrap_or_default(), "--nvcc", "off"], None);
    assert!(o.status.success());
    let before = read_tree(&kept);
    let o = moeforge(&["compile", bad.to_str().unwrap_or_default(), "-o", kept.to_str().unwrap_or_default()], None);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(read_tree(&kept), before);
    // No temporary directories are left behind.
    let leftovers: Vec<String> = std::fs::read_dir(tmp.path())
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with('.'))
                .collect()
        })
        .unwrap_or_default();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn recompiling_replaces_the_bundle() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let out = tmp.path().join("b");
    let o = moeforge(&["compile", "-o", out.to_str().unwrap_or_default(), "--nvcc", "off"], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    // A previous bundle, with a kernel this compile does not write: replaced whole.
    std::fs::write(out.join("kernels/stale.cu"), "old").ok();
    let o = moeforge(&["compile", "-o", out.to_str().unwrap_or_default(), "--nvcc", "off"], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(!out.join("kernels/stale.cu").exists());
    assert!(load_bundle(&out).is_ok());
}

/// An output directory holding anything a bundle does not (a user's files,
/// a mistyped `-o`) is refused, naming it, and left as it was; so is
/// `simulate -o` (its own outputs, whatever flags wrote them, are replaced).
#[test]
fn an_output_directory_holding_other_files_is_not_replaced() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let out = tmp.path().join("precious");
    std::fs::create_dir_all(&out).ok();
    std::fs::write(out.join("thesis.txt"), "years of work").ok();
    let o = moeforge(&["compile", "-o", out.to_str().unwrap_or_default(), "--nvcc", "off"], None);
    assert_eq!(o.status.code(), Some(1));
    let e = text(&o.stderr);
    assert!(e.contains("holds `thesis.txt`") && e.contains("refusing to replace"), "{e}");
    assert_eq!(std::fs::read_to_string(out.join("thesis.txt")).ok().as_deref(), Some("years of work"));
    assert_eq!(std::fs::read_dir(&out).map(Iterator::count).unwrap_or(0), 1);
    let sim = tmp.path().join("sim");
    let run = |extra: &[&str]| {
        let mut args = vec!["simulate", "-o", sim.to_str().unwrap_or_default(), "--seconds", "2", "--rates", "2"];
        args.extend_from_slice(extra);
        moeforge(&args, None)
    };
    let o = run(&["--systems", "colocated,pd-disagg", "--rollout", "8"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(sim.join("rollout.csv").exists(), "the rollout's output, which the next run does not write");
    let o = run(&["--systems", "colocated"]);
    assert!(o.status.success(), "a previous simulate output is replaced: {}", text(&o.stderr));
    std::fs::write(sim.join("notes.md"), "mine").ok();
    let o = run(&["--systems", "colocated"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stdout));
    assert!(sim.join("notes.md").exists());
}

/// `init-weights` writes test-sized checkpoints: a full-size model is
/// refused before anything is allocated or created.
#[test]
fn init_weights_refuses_a_full_size_model_and_creates_nothing() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let out = tmp.path().join("w");
    let spec = root().join("examples/qwen3-235b-a22b-h200.moe");
    let o =
        moeforge(&["init-weights", spec.to_str().unwrap_or_default(), "-o", out.to_str().unwrap_or_default()], None);
    assert_eq!(o.status.code(), Some(1));
    let e = text(&o.stderr);
    assert!(e.contains("random checkpoints are for test-sized models") && e.contains("import-hf"), "{e}");
    assert!(!out.exists());
    // A write that fails midway (the file-size limit stands in for a full
    // disk) leaves no partial checkpoint, nor the directories it created.
    let nested = tmp.path().join("a/b/c");
    let tiny = root().join("examples/tiny-qwen3-cpu4.moe");
    let o = std::process::Command::new("sh")
        .arg("-c")
        .arg("trap '' XFSZ; ulimit -f 64; exec \"$0\" init-weights \"$1\" -o \"$2\"")
        .args([env!("CARGO_BIN_EXE_moeforge"), tiny.to_str().unwrap_or_default(), nested.to_str().unwrap_or_default()])
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(!tmp.path().join("a").exists(), "a failed write left {}", tmp.path().join("a").display());
}

#[test]
fn check_reports_located_errors_and_fails() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let f = tmp.path().join("x.moe");
    std::fs::write(&f, "model m {\n  layers = 4\n}\n").ok();
    let o = moeforge(&["check", f.to_str().unwrap_or_default()], None);
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(err.contains("E0104") && err.contains("x.moe:1:1") && err.contains("help:"), "{err}");
    let o = moeforge(&["check", "--format", "json", f.to_str().unwrap_or_default()], None);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o.stdout)));
    assert!(v.as_array().is_some_and(|a| a.len() >= 4), "{v}");
    assert_eq!(v[0]["code"], "E0104");
    assert_eq!(v[0]["primary"]["line"], 1);
}

#[test]
fn check_accepts_the_whole_zoo() {
    let mut args = vec!["check".to_string()];
    for dir in ["models", "examples"] {
        for e in std::fs::read_dir(root().join(dir)).into_iter().flatten().flatten() {
            if e.path().extension().is_some_and(|x| x == "moe") {
                args.push(e.path().display().to_string());
            }
        }
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = moeforge(&args, None);
    assert!(o.status.success(), "{}", text(&o.stderr));
}

#[test]
fn unreadable_input_is_an_error_not_a_panic() {
    let o = moeforge(&["check", "/nonexistent/spec.moe"], None);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("E0002"), "{}", text(&o.stderr));
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let bin = tmp.path().join("bin.moe");
    std::fs::write(&bin, [0xffu8, 0xfe, 0x00, 0x7b]).ok();
    let o = moeforge(&["check", bin.to_str().unwrap_or_default()], None);
    assert_eq!(o.status.code(), Some(1));
}

#[test]
fn compile_picks_a_deployment_or_says_which() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let two = tmp.path().join("two.moe");
    let r = root();
    std::fs::write(
        &two,
        format!(
            "use \"{0}/examples/qwen3-30b-a3b-h200.moe\"\nuse \"{0}/examples/glm-4.5-air-h200.moe\"\n",
            r.display()
        ),
    )
    .ok();
    let out = tmp.path().join("o");
    let o = moeforge(&["compile", two.to_str().unwrap_or_default(), "-o", out.to_str().unwrap_or_default()], None);
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(err.contains("E0201") && err.contains("--deploy") && err.contains("glm-4.5-air-h200"), "{err}");
    let o = moeforge(
        &[
            "compile",
            two.to_str().unwrap_or_default(),
            "-o",
            out.to_str().unwrap_or_default(),
            "--deploy",
            "glm-4.5-air-h200",
            "--nvcc",
            "off",
        ],
        None,
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let model = load_bundle(&out).map(|b| b.plan.model.name.clone()).unwrap_or_default();
    assert_eq!(model, "glm-4.5-air");
}

#[test]
fn mxfp4_is_declared_but_rejected_by_compile() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let f = write_spec(
        tmp.path(),
        "oss.moe",
        &["models/gpt-oss-120b.moe", "models/clusters.moe", "models/tiles.moe"],
        "deploy oss { model = gpt-oss-120b cluster = h200x8 tiles = hopper-bf16 slo { ttft = 1s tpot = 50ms }
         workload { input = sharegpt output = sharegpt arrival poisson { rate = 1req/s } } }\n",
    );
    assert!(moeforge(&["check", f.to_str().unwrap_or_default()], None).status.success());
    let out = tmp.path().join("o");
    let o = moeforge(&["compile", f.to_str().unwrap_or_default(), "-o", out.to_str().unwrap_or_default()], None);
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(err.contains("E0200") && err.contains("mxfp4") && err.contains("gpt-oss-120b.moe:"), "{err}");
    assert!(!out.exists());
}

/// fp8 activations at dispatch (a DeepEP option): the checker accepts them,
/// the capability table says dispatch moves bf16 rows, so compile refuses
/// them at the `activations` field instead of emitting wrong math.
#[test]
fn a_feature_the_kernels_lack_is_refused_where_the_spec_asks_for_it() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let oss = std::fs::read_to_string(root().join("models/gpt-oss-120b.moe")).unwrap_or_default();
    let fp8 = oss.replace("experts = mxfp4  activations = bf16", "experts = bf16  activations = fp8_e4m3");
    assert_ne!(fp8, oss, "models/gpt-oss-120b.moe's dtype line changed");
    std::fs::write(tmp.path().join("oss-fp8a.moe"), fp8).ok();
    let f = write_spec(
        tmp.path(),
        "d.moe",
        &["models/clusters.moe", "models/tiles.moe"],
        "use \"oss-fp8a.moe\"
         deploy oss { model = gpt-oss-120b cluster = h200x8 tiles = hopper-bf16 slo { ttft = 1s tpot = 50ms }
         workload { input = sharegpt output = sharegpt arrival poisson { rate = 1req/s } } }\n",
    );
    let out = tmp.path().join("o");
    let o = moeforge(&["compile", f.to_str().unwrap_or_default(), "-o", out.to_str().unwrap_or_default()], None);
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(err.contains("E0200") && err.contains("dispatch moves bf16 rows"), "{err}");
    assert!(err.contains("oss-fp8a.moe:") && err.contains("activations = fp8_e4m3"), "not located: {err}");
    assert!(!out.exists());
}

/// A tile set the dsl accepts (block_k a multiple of the MMA's k) but the
/// APK's wgmma path cannot use (it stages 128-byte swizzled rows, so block_k
/// must be a multiple of 64 bf16): a located error with a hint, nothing written.
#[test]
fn tiles_the_apk_cannot_use_are_a_located_error() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let f = write_spec(
        tmp.path(),
        "k32.moe",
        &["models/qwen3-30b-a3b.moe", "models/clusters.moe"],
        "tiles k32 {
           prefill { layout = contiguous
             gate_up { block_m = 128 block_n = 128 block_k = 32 cluster = [2, 1] stages = 4 }
             down { block_m = 128 block_n = 128 block_k = 32 cluster = [2, 1] stages = 4 } }
           decode { layout = masked
             gate_up { block_m = 64 block_n = 128 block_k = 32 cluster = [1, 1] stages = 6 }
             down { block_m = 64 block_n = 128 block_k = 32 cluster = [1, 1] stages = 6 } }
         }
         deploy q { model = qwen3-30b-a3b cluster = h200x8 tiles = k32 slo { ttft = 1s tpot = 50ms }
         workload { input = sharegpt output = sharegpt arrival poisson { rate = 1req/s } } }\n",
    );
    assert!(moeforge(&["check", f.to_str().unwrap_or_default()], None).status.success());
    let out = tmp.path().join("o");
    let o = moeforge(&["compile", f.to_str().unwrap_or_default(), "-o", out.to_str().unwrap_or_default()], None);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(err.contains("block_k = 32") && err.contains("128-byte") && err.contains("k32.moe:"), "{err}");
    assert!(err.contains("hopper-bf16"), "no hint: {err}");
    assert!(!out.exists());
}

/// A `dense` sub-block the checker accepts but the dense APK cannot use
/// (wgmma widths stop at 256): a located error at the dense field, with the
/// rule, nothing written.
#[test]
fn dense_tiles_the_dense_apk_cannot_use_are_a_located_error() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let tiles = std::fs::read_to_string(root().join("models/tiles.moe")).unwrap_or_default();
    let anchor = "tiles hopper-bf16 {\n";
    assert!(tiles.contains(anchor));
    let wide = tiles.replacen(
        anchor,
        &format!("{anchor}  dense {{ block_m = 128  block_n = 272  block_k = 64  cluster = [2, 1]  stages = 3  decode_block_m = 64 }}\n"),
        1,
    );
    std::fs::write(tmp.path().join("tiles.moe"), wide).ok();
    let f = write_spec(
        tmp.path(),
        "d.moe",
        &["models/qwen3-30b-a3b.moe", "models/clusters.moe"],
        "use \"tiles.moe\"
         deploy q { model = qwen3-30b-a3b cluster = h200x8 tiles = hopper-bf16 slo { ttft = 1s tpot = 50ms }
         workload { input = sharegpt output = sharegpt arrival poisson { rate = 1req/s } } }\n",
    );
    assert!(moeforge(&["check", f.to_str().unwrap_or_default()], None).status.success());
    let out = tmp.path().join("o");
    let o = moeforge(&["compile", f.to_str().unwrap_or_default(), "-o", out.to_str().unwrap_or_default()], None);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(err.contains("dense tiles") && err.contains("at most 256") && err.contains("block_n = 272"), "{err}");
    let line = tiles.lines().position(|l| l == "tiles hopper-bf16 {").map_or(0, |i| i + 2);
    assert!(err.contains(&format!("tiles.moe:{line}:26")), "not located at dense.block_n: {err}");
    assert!(!out.exists());
}

#[test]
fn explain_prints_spec_and_plan() {
    let o = moeforge(&["explain", "examples/glm-5-h800x24.moe"], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let s = text(&o.stdout);
    assert!(s.contains("model glm-5 {") && s.contains("attention mla") && s.contains("plan glm-5-h800x24 {"), "{s}");
    assert!(s.contains("rank 23 (node 2, gpu 7)"), "{s}");
    let o = moeforge(&["explain", "--format", "json"], None);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
    assert_eq!(v["plan"]["model"]["name"], "qwen3-30b-a3b");
}

#[test]
fn every_command_has_help() {
    for args in [
        vec!["--help"],
        vec!["check", "--help"],
        vec!["compile", "--help"],
        vec!["explain", "--help"],
        vec!["init-weights", "--help"],
        vec!["run", "--help"],
        vec!["simulate", "--help"],
    ] {
        let o = moeforge(&args, None);
        assert!(o.status.success());
        assert!(text(&o.stdout).contains("Usage"), "{args:?}");
    }
}

#[test]
fn tampered_bundles_are_refused() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let out = tmp.path().join("b");
    assert!(moeforge(&["compile", "-o", out.to_str().unwrap_or_default(), "--nvcc", "off"], None).status.success());
    let cu = out.join("kernels/router.cu");
    let src = std::fs::read_to_string(&cu).unwrap_or_default();
    std::fs::write(&cu, src.replace("kTopK = 8", "kTopK = 7")).ok();
    assert!(matches!(load_bundle(&out), Err(BundleError::Hash { .. })));
    std::fs::write(&cu, src).ok();
    assert!(load_bundle(&out).is_ok());
    let manifest = out.join("manifest.json");
    let m = std::fs::read_to_string(&manifest).unwrap_or_default();
    // A cubin (listed, hash right) for a kernel the bundle has no source of.
    let ghost = b"\x7fELF not a kernel of this plan";
    std::fs::write(out.join("kernels/ghost.cubin"), ghost).ok();
    let mut j: serde_json::Value = serde_json::from_str(&m).unwrap();
    let hash = moeforge::plan::bundle::sha256_hex(ghost);
    j["files"]["kernels/ghost.cubin"] = serde_json::Value::String(hash);
    std::fs::write(&manifest, serde_json::to_string(&j).unwrap()).ok();
    let e = load_bundle(&out).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("kernels/ghost.cubin") && e.contains("without its kernel source"), "{e}");
    std::fs::write(&manifest, &m).ok();
    assert!(load_bundle(&out).is_ok());
    let current = format!("\"format_version\": {}", moeforge::plan::FORMAT_VERSION);
    assert!(m.contains(&current));
    std::fs::write(&manifest, m.replace(&current, "\"format_version\": 99")).ok();
    let e = load_bundle(&out).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("format 99") && e.contains("recompile"), "{e}");
    std::fs::write(&manifest, "{ not json").ok();
    assert!(matches!(load_bundle(&out), Err(BundleError::Parse { .. })));
}

#[test]
fn init_weights_compile_and_run_on_the_cpu_twin() {
    let tmp = tempfile::tempdir().unwrap();
    let (w, b) = (tmp.path().join("w"), tmp.path().join("b"));
    let spec = "examples/tiny-qwen3-cpu4.moe";
    let o = moeforge(&["init-weights", spec, "--seed", "7", "-o", w.to_str().unwrap()], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(w.join("model.safetensors").is_file());
    let o = moeforge(&["compile", spec, "-o", b.to_str().unwrap(), "--nvcc", "off"], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let args = |extra: &[&str]| {
        let mut v = vec![
            "run",
            b.to_str().unwrap(),
            "--backend",
            "cpu",
            "--weights",
            w.to_str().unwrap(),
            "--prompt",
            "1 2 3",
            "--prompt",
            "5,6",
            "--max-new",
            "5",
        ];
        v.extend_from_slice(extra);
        v.into_iter().map(String::from).collect::<Vec<_>>()
    };
    // Arrivals past the run's steps (or past usize) are refused up front.
    for every in ["100000", "18446744073709551615"] {
        let late = args(&["--arrive-every", every]);
        let o = moeforge(&late.iter().map(String::as_str).collect::<Vec<_>>(), None);
        let e = text(&o.stderr);
        assert!(!o.status.success() && e.contains("--arrive-every") && e.contains("give at most 99999"), "{e}");
    }
    let forced = args(&["--switch-at", "1,3", "--arrive-every", "1"]);
    let o = moeforge(&forced.iter().map(String::as_str).collect::<Vec<_>>(), None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let s = text(&o.stdout);
    assert!(s.contains("switch before step 1: ep → tp") && s.contains("switch before step 3: tp → ep"), "{s}");
    let tokens = |s: &str| s.lines().filter(|l| l.starts_with("request ")).map(String::from).collect::<Vec<_>>();
    // The same prompts without switching give the same tokens.
    let plain = args(&["--arrive-every", "1", "--start", "tp", "--switch-at", "100"]);
    let o2 = moeforge(&plain.iter().map(String::as_str).collect::<Vec<_>>(), None);
    assert!(o2.status.success(), "{}", text(&o2.stderr));
    assert_eq!(tokens(&s), tokens(&text(&o2.stdout)));
    assert_eq!(tokens(&s).len(), 2);
    // The emulated device runs the bundle's own kernels to the same tokens,
    // under the spec's policy (calibrated on the emulated device) and across
    // forced live switches (weights and KV moved on the device).
    let emu: Vec<String> = args(&["--arrive-every", "1", "--start", "tp"])
        .into_iter()
        .map(|a| if a == "cpu" { "emu".to_string() } else { a })
        .collect();
    let o3 = moeforge(&emu.iter().map(String::as_str).collect::<Vec<_>>(), None);
    assert!(o3.status.success(), "{}", text(&o3.stderr));
    let s3 = text(&o3.stdout);
    assert!(s3.starts_with("emulated device: "), "{s3}");
    assert_eq!(tokens(&s), tokens(&s3));
    // `t_high = auto` was measured on the emulated device's decode graphs of
    // both modes; the CPU twin, which has no device steps, takes the
    // modeled crossover. Both at ShareGPT's mean prompt (215 tokens) plus
    // half its mean output (197): 314 cached tokens a request.
    assert!(
        s3.contains(
            "calibration, measured on this engine's decode steps of requests with 314 cached tokens each (graph \
             replays where a graph holds the step, the median of 5 each, until EP is no slower): B=1: tp "
        ),
        "{s3}"
    );
    assert!(s3.contains("policy: T_h = "), "{s3}");
    let cpu_policy = args(&["--arrive-every", "1"]);
    let o = moeforge(&cpu_policy.iter().map(String::as_str).collect::<Vec<_>>(), None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let s5 = text(&o.stdout);
    assert!(
        s5.contains(
            "calibration, modeled (this engine measured no decode step; the cost model's decode iterations of \
             requests with 314 cached tokens each): B=1: tp "
        ) && s5.contains("B=2048: "),
        "{s5}"
    );
    assert_eq!(tokens(&s), tokens(&s5));
    let mut switching = emu.clone();
    switching.extend(["--switch-at".to_string(), "1,3".to_string()]);
    let o = moeforge(&switching.iter().map(String::as_str).collect::<Vec<_>>(), None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let s4 = text(&o.stdout);
    assert!(s4.contains("switch before step 1: tp → ep") && s4.contains("switch before step 3: ep → tp"), "{s4}");
    assert_eq!(tokens(&s), tokens(&s4));
    // Bad requests are errors with a hint, not panics.
    let bad = args(&["--prompt", "1 x"]);
    let o = moeforge(&bad.iter().map(String::as_str).collect::<Vec<_>>(), None);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("`x` is not a token id"), "{}", text(&o.stderr));
    let oob = args(&["--prompt", "99999"]);
    let o = moeforge(&oob.iter().map(String::as_str).collect::<Vec<_>>(), None);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("outside the vocabulary"), "{}", text(&o.stderr));
    let o = moeforge(&["run", b.to_str().unwrap(), "--weights", tmp.path().to_str().unwrap(), "--prompt", "1"], None);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("no *.safetensors"), "{}", text(&o.stderr));
    // The cuda backend: on a machine without a driver or a GPU a clear error
    // and exit 1 (never a panic); on a GPU machine, the same tokens.
    let cuda: Vec<String> = args(&["--arrive-every", "1", "--start", "tp"])
        .into_iter()
        .map(|a| if a == "cpu" { "cuda".to_string() } else { a })
        .collect();
    let o = moeforge(&cuda.iter().map(String::as_str).collect::<Vec<_>>(), None);
    match moeforge::cuda::probe() {
        Err(why) => {
            assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
            let e = text(&o.stderr);
            assert!(e.contains("--backend cuda: ") && e.contains(&why.to_string()), "{e}");
            assert!(!e.contains("panicked"), "{e}");
        }
        Ok(_) => {
            assert!(o.status.success(), "{}", text(&o.stderr));
            assert_eq!(tokens(&s), tokens(&text(&o.stdout)));
        }
    }
    // The GPUs it drives are named by index; anything else is refused first.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_moeforge"))
        .args(&cuda)
        .current_dir(common::root())
        .env_remove("MOEFORGE_CUDA_DEVICE")
        .env("MOEFORGE_CUDA_DEVICES", "0,x")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let e = text(&o.stderr);
    assert!(e.contains("MOEFORGE_CUDA_DEVICES = `0,x` is not a list of GPU indices") && e.contains("help: "), "{e}");
    // The old single-GPU variable is refused by name, not silently ignored.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_moeforge"))
        .args(&cuda)
        .current_dir(common::root())
        .env("MOEFORGE_CUDA_DEVICE", "1")
        .env_remove("MOEFORGE_CUDA_DEVICES")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let e = text(&o.stderr);
    assert!(e.contains("MOEFORGE_CUDA_DEVICE = `1` is no longer read") && e.contains("MOEFORGE_CUDA_DEVICES"), "{e}");
}

#[test]
fn the_twin_refuses_bundles_too_large_for_the_host() {
    let tmp = tempfile::tempdir().unwrap();
    let (w, b) = (tmp.path().join("w"), tmp.path().join("b"));
    assert!(moeforge(&["init-weights", "examples/tiny-qwen3-cpu4.moe", "-o", w.to_str().unwrap()], None)
        .status
        .success());
    assert!(moeforge(&["compile", "-o", b.to_str().unwrap(), "--nvcc", "off"], None).status.success());
    let o = moeforge(&["run", b.to_str().unwrap(), "--weights", w.to_str().unwrap(), "--prompt", "1"], None);
    assert_eq!(o.status.code(), Some(1));
    let e = text(&o.stderr);
    // Refused by the machine check (host memory), or by the twin's own
    // allocation limit on a host with more memory than any test machine.
    let machine = e.contains("does not fit the bundle") && e.contains("8 rank buffers");
    assert!(machine || (e.contains("would allocate") && e.contains("small `hbm`")), "{e}");
}

#[test]
fn compile_takes_measured_expert_loads() {
    let tmp = tempfile::tempdir().unwrap();
    // MiniMax-M2: 62 MoE layers of 256 experts.
    let layers: Vec<Vec<u32>> = (0..62).map(|l| (0..256).map(|e| (e * 7 + l) % 97 + 1).collect()).collect();
    let good = tmp.path().join("loads.json");
    std::fs::write(&good, serde_json::json!({ "logical_count": layers }).to_string()).unwrap();
    let compile = |loads: &std::path::Path, out: &std::path::Path| {
        let args = [
            "compile",
            "examples/minimax-m2-h800.moe",
            "--nvcc",
            "off",
            "--loads",
            loads.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ];
        moeforge(&args, None)
    };
    let out = tmp.path().join("b");
    let o = compile(&good, &out);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let plan = load_bundle(&out).unwrap().plan;
    let p = plan.placement.clone().unwrap();
    assert!(p.loads.starts_with("sglang sha256:"), "{}", p.loads);
    assert_eq!(p.replicas.len(), 62);
    // ExpertPlex roles: 256 experts + 32 replicas fill the 4 MoE servers'
    // slots (72 each); the 4 attention servers hold none.
    assert!(p.replicas[0].iter().all(|g| g.len() == 72 || g.is_empty()));
    assert_eq!(p.replicas[0].iter().filter(|g| !g.is_empty()).count(), 4);
    // Wrong shape: a located error, nothing written.
    let bad = tmp.path().join("bad.json");
    std::fs::write(&bad, r#"{"logical_count": [[1, 2, 3]]}"#).unwrap();
    let out2 = tmp.path().join("b2");
    let o = compile(&bad, &out2);
    assert_eq!(o.status.code(), Some(1));
    let e = text(&o.stderr);
    assert!(e.contains("1 layers of 3 experts") && e.contains("minimax-m2-h800.moe:"), "{e}");
    assert!(!out2.exists());
}

#[test]
fn simulate_writes_curves_and_a_goodput_table_deterministically() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let run = |dir: &std::path::Path| {
        let o = moeforge(
            &[
                "simulate",
                "examples/minimax-m2-h800.moe",
                "-o",
                dir.to_str().unwrap_or_default(),
                "--seconds",
                "10",
                "--rates",
                "4",
                "--systems",
                "expertplex,colocated,moebius",
            ],
            None,
        );
        assert!(o.status.success(), "{}", text(&o.stderr));
        text(&o.stdout)
    };
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let stdout = run(&a);
    assert!(stdout.contains("expertplex") && stdout.contains("1P3D4E"), "{stdout}");
    assert!(stdout.contains("moebius          not run: the plan is EP-only"), "{stdout}");
    let csv = std::fs::read_to_string(a.join("attainment.csv")).unwrap_or_default();
    // Header + 4 rates × 2 systems that ran.
    assert_eq!(csv.lines().count(), 9, "{csv}");
    let svg = std::fs::read_to_string(a.join("attainment.svg")).unwrap_or_default();
    assert!(svg.starts_with("<svg") && svg.matches("<polyline").count() == 2, "{svg}");
    run(&b);
    assert_eq!(read_tree(&a), read_tree(&b));
}

#[test]
fn simulate_rejects_bad_arguments_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let out = tmp.path().join("s");
    let dir = out.to_str().unwrap_or_default();
    for (args, needle) in [
        (vec!["--systems", "expertplex,vllm"], "unknown system `vllm`"),
        (vec!["--seconds", "0"], "--seconds must be in (0, 86400]"),
        (vec!["--rates", "0"], "--rates in 1..=1000"),
        (vec!["--rates", "100000000"], "--rates in 1..=1000"),
        (vec!["--rollout", "0"], "--rollout in 1..=1000000"),
        (vec!["--seconds", "nan"], "--seconds must be in (0, 86400]"),
    ] {
        let mut all = vec!["simulate", "examples/minimax-m2-h800.moe", "-o", dir];
        all.extend(args);
        let o = moeforge(&all, None);
        assert!(!o.status.success(), "{all:?}");
        assert!(text(&o.stderr).contains(needle), "{all:?}: {}", text(&o.stderr));
        assert!(!out.exists(), "{all:?} wrote output");
    }
}

/// Tile values the APK does not use (it runs both phases on one grid of the
/// prefill gate_up tile's shape) compile with a located warning saying which
/// value it uses instead; the bundle is written, and the JSON output lists it.
#[test]
fn tile_values_without_effect_compile_with_a_warning() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let f = write_spec(
        tmp.path(),
        "t.moe",
        &["models/qwen3-30b-a3b.moe", "models/clusters.moe"],
        "tiles t {
           prefill { gate_up { block_m = 128 block_n = 128 block_k = 64 cluster = [2, 1] stages = 4 }
                     down { block_m = 128 block_n = 128 block_k = 64 cluster = [2, 1] stages = 4 } }
           decode { gate_up { block_m = 64 block_n = 128 block_k = 64 cluster = [2, 1] stages = 6 }
                    down { block_m = 64 block_n = 128 block_k = 64 cluster = [2, 1] stages = 4 } }
         }
         deploy q { model = qwen3-30b-a3b cluster = h200x8 tiles = t slo { ttft = 1s tpot = 50ms }
         workload { input = sharegpt output = sharegpt arrival poisson { rate = 1req/s } } }\n",
    );
    let out = tmp.path().join("o");
    let o = moeforge(&["compile", f.to_str().unwrap(), "-o", out.to_str().unwrap(), "--nvcc", "off"], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(err.contains("W0100") && err.contains("`decode.gate_up.stages` = 6 has no effect on the kernel"), "{err}");
    assert!(err.contains("t.moe:") && err.contains("prefill.gate_up's 4"), "{err}");
    assert_eq!(err.matches("W0100").count(), 1, "{err}");
    assert!(out.join("plan.json").is_file());
    let o = moeforge(
        &["compile", f.to_str().unwrap(), "-o", out.to_str().unwrap(), "--nvcc", "off", "--format", "json"],
        None,
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["warnings"][0]["severity"], "warning");
    assert_eq!(v["warnings"][0]["code"], "W0100");
}

/// The tiny example with `strategy = expertplex`: a role plan that `run`
/// serves on the CPU twin with the colocated plan's tokens, and on the
/// emulated device (each GPU its role's program) with the same tokens.
#[test]
fn an_expertplex_role_bundle_runs_on_the_cpu_twin_and_the_emulated_device() {
    let tmp = tempfile::tempdir().unwrap();
    let text0 = std::fs::read_to_string(root().join("examples/tiny-qwen3-cpu4.moe")).unwrap();
    let models = format!("use \"{}/models/", root().display());
    let roles = text0.replace("strategy = colocated", "strategy = expertplex").replace("use \"../models/", &models);
    assert!(roles.contains("strategy = expertplex"));
    let spec = tmp.path().join("roles.moe");
    std::fs::write(&spec, roles).unwrap();
    let (w, colo, role) = (tmp.path().join("w"), tmp.path().join("colo"), tmp.path().join("roles"));
    let ex = "examples/tiny-qwen3-cpu4.moe";
    assert!(moeforge(&["init-weights", ex, "--seed", "7", "-o", w.to_str().unwrap()], None).status.success());
    for (s, out) in [(ex, &colo), (spec.to_str().unwrap(), &role)] {
        let o = moeforge(&["compile", s, "-o", out.to_str().unwrap(), "--nvcc", "off"], None);
        assert!(o.status.success(), "{}", text(&o.stderr));
    }
    let report = std::fs::read_to_string(role.join("report.md")).unwrap();
    assert!(report.contains("ExpertPlex roles, realized") && report.contains("### Communication schedule"), "{report}");
    let run = |b: &std::path::Path, backend: &str| {
        moeforge(
            &[
                "run",
                b.to_str().unwrap(),
                "--backend",
                backend,
                "--weights",
                w.to_str().unwrap(),
                "--prompt",
                "1 2 3",
                "--prompt",
                "5 6 7 8 9",
                "--max-new",
                "5",
            ],
            None,
        )
    };
    let tokens = |s: &str| s.lines().filter(|l| l.starts_with("request ")).map(String::from).collect::<Vec<_>>();
    let (a, b) = (run(&colo, "cpu"), run(&role, "cpu"));
    assert!(a.status.success() && b.status.success(), "{}", text(&b.stderr));
    assert!(text(&b.stdout).contains("roles: prefill servers"), "{}", text(&b.stdout));
    assert_eq!(tokens(&text(&a.stdout)), tokens(&text(&b.stdout)));
    assert_eq!(tokens(&text(&b.stdout)).len(), 2);
    let e = run(&role, "emu");
    assert!(e.status.success(), "{}", text(&e.stderr));
    assert_eq!(tokens(&text(&e.stdout)), tokens(&text(&b.stdout)));
}

/// examples/tiny-qwen3-cpu4.moe with `deploy` in place of its strategy and
/// switch policy, in `dir`: its random weights (`init-weights`) and its
/// bundle, compiled without nvcc.
fn tiny_qwen3_with(dir: &std::path::Path, deploy: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let (w, b, spec) = (dir.join("w"), dir.join("b"), dir.join("tiny.moe"));
    let text_of = std::fs::read_to_string(root().join("examples/tiny-qwen3-cpu4.moe")).unwrap();
    let edited = text_of
        .replace("\"../models/", &format!("\"{}/", root().join("models").display()))
        .replace("  strategy = colocated\n", "")
        .replace("  switch { t_high = auto  window = 4  cooldown = 0s }", &format!("  {deploy}"));
    assert!(edited.contains(deploy) && !edited.contains("switch"), "{edited}");
    std::fs::write(&spec, edited).unwrap();
    let o = moeforge(&["init-weights", spec.to_str().unwrap(), "-o", w.to_str().unwrap()], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = moeforge(&["compile", spec.to_str().unwrap(), "-o", b.to_str().unwrap(), "--nvcc", "off"], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    (w, b)
}

/// A role plan's decode servers write into posts of fixed rows on the MoE
/// server (`roles.posts`: one search-sized decode step each). More decode
/// requests than a post holds run in dispatch rounds of whole requests on
/// the emulated device, with the CPU twin's tokens (which count the rounds
/// but compute in one pass); before, the device refused the step.
#[test]
fn decode_servers_past_their_posts_dispatch_in_rounds_on_the_emulated_device() {
    let tmp = tempfile::tempdir().unwrap();
    let (w, b) = tiny_qwen3_with(tmp.path(), "strategy = expertplex");
    let plan = load_bundle(&b).unwrap().plan;
    let roles = plan.roles.as_ref().expect("expertplex realizes roles");
    let decode = roles.ranks(moeforge::plan::roles::Role::Decode);
    let post = roles.posts.iter().filter(|p| decode.contains(&p.src)).map(|p| p.rows).max().unwrap();
    // Enough one-token prompts that each decode server holds more requests than its post's rows.
    let n = post as usize * decode.len() + 40;
    let run = |backend: &str| {
        let mut args: Vec<String> =
            ["run", b.to_str().unwrap(), "--backend", backend, "--weights", w.to_str().unwrap(), "--max-new", "2"]
                .map(String::from)
                .to_vec();
        for i in 0..n {
            args.extend(["--prompt".to_string(), (i % 50 + 1).to_string()]);
        }
        let o = moeforge(&args.iter().map(String::as_str).collect::<Vec<_>>(), None);
        assert!(o.status.success(), "{backend}: {}", text(&o.stderr));
        text(&o.stdout)
    };
    let (cpu, emu) = (run("cpu"), run("emu"));
    let tokens = |s: &str| s.lines().filter(|l| l.starts_with("request ")).map(String::from).collect::<Vec<_>>();
    assert_eq!(tokens(&emu).len(), n);
    assert_eq!(tokens(&cpu), tokens(&emu));
    // The prefill step fits its posts; the decode step takes one round more.
    assert!(emu.contains("dispatch rounds: 1 beyond one per step"), "{emu}");
    assert!(!cpu.contains("dispatch rounds"), "the CPU twin computes in one pass");
}

/// `run --verify-routing` on the emulated device: the tiny Qwen3 model on
/// its 4 ranks with a Zepp placement; every dispatch routes on the device
/// (`kernels/zepp_route.cu`) and is checked against the host routing of the
/// same counts, the run prints how many entries were checked, and its
/// tokens are the CPU twin's. The flag is
/// refused on the CPU twin (which routes on the host) and on a plan without
/// a placement, with a hint.
#[test]
fn run_verifies_the_device_replica_routing_against_the_host_routing() {
    let tmp = tempfile::tempdir().unwrap();
    let (w, b) = tiny_qwen3_with(tmp.path(), "placement { policy = zepp redundant_experts = 4 }");
    let run = |backend: &str, bundle: &std::path::Path, verify: bool| {
        let mut args = vec!["run", bundle.to_str().unwrap(), "--backend", backend, "--weights", w.to_str().unwrap()];
        args.extend(["--max-new", "4", "--prompt", "3 17 42 99 5 64 7", "--prompt", "120 1", "--prompt", "9 8 7 6"]);
        if verify {
            args.push("--verify-routing");
        }
        moeforge(&args, None)
    };
    let (emu, cpu) = (run("emu", &b, true), run("cpu", &b, false));
    assert!(emu.status.success() && cpu.status.success(), "{}{}", text(&emu.stderr), text(&cpu.stderr));
    let (emu, cpu) = (text(&emu.stdout), text(&cpu.stdout));
    let tokens = |s: &str| s.lines().filter(|l| l.starts_with("request ")).map(String::from).collect::<Vec<_>>();
    assert_eq!(tokens(&emu).len(), 3, "{emu}");
    assert_eq!(tokens(&emu), tokens(&cpu));
    let checked = emu
        .lines()
        .find_map(|l| l.strip_prefix("replica routing: "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no routing line: {emu}"));
    assert!(checked > 0, "{emu}");
    // Unchecked, the decode steps take fixed slots (each row carries the
    // physical slots the device's routing chose, nothing read back) and
    // run as graphs, with the same tokens.
    let o = run("emu", &b, false);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let graphed = text(&o.stdout);
    assert_eq!(tokens(&graphed), tokens(&cpu));
    let graphs = graphed.lines().find(|l| l.starts_with("decode graphs: ")).unwrap_or_else(|| panic!("{graphed}"));
    let replayed = graphs
        .split(", ")
        .find_map(|part| part.strip_suffix(" decode steps replayed one"))
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("{graphs}"));
    assert!(replayed > 0 && graphs.contains(", 0 ran call by call"), "{graphs}");
    // Refused where it has nothing to check, with a hint.
    let o = run("cpu", &b, true);
    assert!(!o.status.success() && text(&o.stderr).contains("--backend emu"), "{}", text(&o.stderr));
    let plain = tmp.path().join("plain");
    let o =
        moeforge(&["compile", "examples/tiny-qwen3-cpu4.moe", "-o", plain.to_str().unwrap(), "--nvcc", "off"], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = run("emu", &plain, true);
    assert!(!o.status.success() && text(&o.stderr).contains("no replicated placement"), "{}", text(&o.stderr));
}

/// `run --swap-window 1 --swap-threshold 1` on the emulated device: the
/// tiny Qwen3 model's ExpertPlex roles with a Zepp placement, re-planned
/// after every step, so slot swaps run on the device's side stream while
/// the decode steps replay their graphs (a graph waits for a queued swap
/// just before that layer's experts). Decode runs two micro-batches (the
/// search's TBO), so the fixed-slot dispatch's routed slots of micro-batch
/// 1 lie after micro-batch 0's. The device's side stream is lazy
/// (`MOEFORGE_EMU_LAZY_SIDE=1`). The tokens are the CPU twin's run with the same window (which
/// swaps its host slots), the run reports its swaps and graphs replayed
/// after them; the options are refused without replicas or with a window
/// or threshold the policy cannot take, with a hint.
#[test]
fn run_swaps_slots_on_its_drift_window_beside_decode_graphs() {
    let tmp = tempfile::tempdir().unwrap();
    let (w, b) = tiny_qwen3_with(tmp.path(), "strategy = expertplex placement { policy = zepp redundant_experts = 4 }");
    let plan = load_bundle(&b).unwrap().plan;
    let decode: Vec<_> = plan.programs.iter().filter(|g| g.phase == moeforge::plan::program::Phase::Decode).collect();
    assert!(plan.roles.is_some() && !decode.is_empty() && decode.iter().all(|g| g.micro_batches == 2), "{decode:?}");
    // The emulated device's side stream runs a swap only when a wait asks
    // for it, so a step or graph that did not wait would compute with the
    // bytes the swap has not moved.
    let run = |backend: &str, bundle: &std::path::Path, swap: &[&str]| {
        let mut args = vec!["run", bundle.to_str().unwrap(), "--backend", backend, "--weights", w.to_str().unwrap()];
        args.extend(["--max-new", "8", "--prompt", "3 17 42 99 5 64 7", "--prompt", "120 1", "--prompt", "9 8 7 6"]);
        args.extend(swap);
        moeforge_with_env(&args, &[("MOEFORGE_EMU_LAZY_SIDE", "1")])
    };
    let swap = ["--swap-window", "1", "--swap-threshold", "1"];
    // Graphs recorded on first use: their warm-up steps run call by call
    // beside queued swaps too (recorded before serving, every decode step
    // would be a replay).
    let emu_swap = [&swap[..], &["--capture-graphs", "0"]].concat();
    let (emu, cpu) = (run("emu", &b, &emu_swap), run("cpu", &b, &swap));
    assert!(emu.status.success() && cpu.status.success(), "{}{}", text(&emu.stderr), text(&cpu.stderr));
    let (emu, cpu) = (text(&emu.stdout), text(&cpu.stdout));
    let tokens = |s: &str| s.lines().filter(|l| l.starts_with("request ")).map(String::from).collect::<Vec<_>>();
    assert_eq!(tokens(&emu).len(), 3, "{emu}");
    assert_eq!(tokens(&emu), tokens(&cpu));
    let number_after = |s: &str, prefix: &str| {
        s.split(prefix)
            .nth(1)
            .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse::<u64>().ok())
    };
    let swaps = number_after(&emu, "slot swaps: ").unwrap_or_else(|| panic!("no swaps line: {emu}"));
    assert!(swaps > 0, "{emu}");
    // The ops issued call by call beside a queued swap: a count of this
    // run's ops (some, every swap's step joins it), not a wrapped difference.
    let beside = number_after(&emu, "on the device's side stream: ").unwrap_or_else(|| panic!("{emu}"));
    assert!(beside > 0 && beside < 1_000_000, "{emu}");
    let graphs = emu.lines().find(|l| l.starts_with("decode graphs: ")).unwrap_or_else(|| panic!("{emu}"));
    let after = number_after(graphs, "before a later slot swap: ").unwrap_or_else(|| panic!("{graphs}"));
    assert!(after > 0 && graphs.contains(", 0 ran call by call"), "{graphs}");
    let beside =
        number_after(graphs, &format!("before a later slot swap: {after} (")).unwrap_or_else(|| panic!("{graphs}"));
    assert!(beside > 0 && beside <= after, "{graphs}");
    // Refused where there is nothing to swap, or a value the policy cannot take.
    for (bad, why) in [
        (["--swap-window", "0"], "at least one step"),
        (["--swap-threshold", "0.5"], "at least 1"),
        (["--swap-threshold", "NaN"], "at least 1"),
    ] {
        let o = run("emu", &b, &bad);
        assert!(!o.status.success() && text(&o.stderr).contains(why), "{bad:?}: {}", text(&o.stderr));
        assert!(text(&o.stderr).contains("help:"), "{}", text(&o.stderr));
    }
    let plain = tmp.path().join("plain");
    let o =
        moeforge(&["compile", "examples/tiny-qwen3-cpu4.moe", "-o", plain.to_str().unwrap(), "--nvcc", "off"], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = run("emu", &plain, &["--swap-window", "4"]);
    assert!(!o.status.success() && text(&o.stderr).contains("no replicated placement"), "{}", text(&o.stderr));
    // `serve` takes the same options, checked before it loads weights or binds.
    let o =
        moeforge(&["serve", b.to_str().unwrap(), "--weights", w.to_str().unwrap(), "--swap-threshold", "0.9"], None);
    assert!(!o.status.success() && text(&o.stderr).contains("at least 1"), "{}", text(&o.stderr));
    let o = moeforge(&["serve", plain.to_str().unwrap(), "--weights", w.to_str().unwrap(), "--swap-window", "4"], None);
    assert!(!o.status.success() && text(&o.stderr).contains("no replicated placement"), "{}", text(&o.stderr));
}

/// `run --capture-graphs 4` on the emulated device: the tiny Qwen3 model's
/// dual-mode plan records EP's and TP's decode graphs for buckets 1, 2 and
/// 4 before the first request (a weight-only warm-up switch enters TP and
/// comes back), so the serving run with two live switches warms up and
/// records nothing more: its recordings are the six made before serving,
/// and it ran no warm-up. Its tokens are the CPU twin's. Without the option
/// `run` records the buckets its three requests can fill (bucket 4: the
/// same six); with `--capture-graphs 0`, none before serving, so serving
/// warms up and records each bucket on its first use in each mode. Refused on
/// the CPU twin and beside --eager (for `serve` too), with a hint.
#[test]
fn run_records_both_modes_graphs_before_serving() {
    let tmp = tempfile::tempdir().unwrap();
    let (w, b) = (tmp.path().join("w"), tmp.path().join("b"));
    let spec = "examples/tiny-qwen3-cpu4.moe";
    let o = moeforge(&["init-weights", spec, "-o", w.to_str().unwrap()], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = moeforge(&["compile", spec, "-o", b.to_str().unwrap(), "--nvcc", "off"], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let run = |backend: &str, extra: &[&str]| {
        let mut args = vec!["run", b.to_str().unwrap(), "--backend", backend, "--weights", w.to_str().unwrap()];
        args.extend(["--max-new", "8", "--prompt", "1 2 3", "--prompt", "4 5 6 7", "--prompt", "9 9 1"]);
        args.extend(["--switch-at", "3,6"]);
        args.extend(extra);
        moeforge(&args, None)
    };
    let (emu, cpu) = (run("emu", &["--capture-graphs", "4"]), run("cpu", &[]));
    assert!(emu.status.success() && cpu.status.success(), "{}{}", text(&emu.stderr), text(&cpu.stderr));
    let (emu, cpu) = (text(&emu.stdout), text(&cpu.stdout));
    let tokens = |s: &str| s.lines().filter(|l| l.starts_with("request ")).map(String::from).collect::<Vec<_>>();
    assert_eq!(tokens(&emu).len(), 3, "{emu}");
    assert_eq!(tokens(&emu), tokens(&cpu));
    assert_eq!(emu.matches("\nswitch before step").count(), 2, "{emu}");
    assert!(emu.contains("decode graphs recorded before serving: ep buckets 1, 2, 4; tp buckets 1, 2, 4"), "{emu}");
    let graphs = emu.lines().find(|l| l.starts_with("decode graphs: ")).unwrap_or_else(|| panic!("{emu}"));
    assert!(
        graphs.starts_with("decode graphs: 6 recorded (one per mode and batch bucket, 6 before serving)")
            && graphs.contains(", 0 ran as a bucket's warm-up, 0 ran call by call"),
        "{graphs}"
    );
    let default = run("emu", &[]);
    assert!(default.status.success(), "{}", text(&default.stderr));
    let default = text(&default.stdout);
    assert_eq!(tokens(&default), tokens(&cpu));
    let line = |s: &str, prefix: &str| s.lines().find(|l| l.starts_with(prefix)).map(String::from);
    assert_eq!(
        line(&default, "decode graphs recorded before serving: "),
        line(&emu, "decode graphs recorded before serving: ")
    );
    assert_eq!(line(&default, "decode graphs: "), Some(graphs.to_string()));
    let lazy = run("emu", &["--capture-graphs", "0"]);
    assert!(lazy.status.success(), "{}", text(&lazy.stderr));
    let lazy = text(&lazy.stdout);
    assert_eq!(tokens(&lazy), tokens(&cpu));
    assert_eq!(line(&lazy, "decode graphs recorded before serving: "), None, "{lazy}");
    let graphs = line(&lazy, "decode graphs: ").unwrap_or_else(|| panic!("{lazy}"));
    assert!(
        graphs.contains(" recorded (one per mode and batch bucket), ")
            && !graphs.contains(", 0 ran as a bucket's warm-up"),
        "{graphs}"
    );
    for (backend, extra, why) in [
        ("cpu", &["--capture-graphs", "4"][..], "records no graphs"),
        ("emu", &["--capture-graphs", "4", "--eager"][..], "--eager"),
    ] {
        let o = run(backend, extra);
        assert!(!o.status.success() && text(&o.stderr).contains(why), "{}", text(&o.stderr));
        assert!(text(&o.stderr).contains("help:"), "{}", text(&o.stderr));
    }
    let o = moeforge(&["serve", b.to_str().unwrap(), "--weights", w.to_str().unwrap(), "--capture-graphs", "2"], None);
    assert!(!o.status.success() && text(&o.stderr).contains("records no graphs"), "{}", text(&o.stderr));
}
