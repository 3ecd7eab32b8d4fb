//! An edited bundle never panics the runtime: `load_bundle` validates the
//! plan it reads (every offset, size, page format, rank and layer index
//! against its buffer) and names the bad field; what it accepts, the CPU
//! twin either runs or refuses with an error. Every numeric field of a
//! small bundle's plan.json is edited (to 0, one more, and a huge value),
//! the manifest re-hashed, and the bundle loaded and run.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use moeforge::codegen::{self, NvccMode};
use moeforge::plan::bundle::{sha256_hex, Manifest};
use moeforge::plan::memory::Mode;
use moeforge::plan::{load_bundle, BundleError};
use moeforge::runtime::engine::{Engine, Request};
use moeforge::runtime::twin::weights::{write_random, Checkpoint, Family};
use moeforge::runtime::twin::{Twin, TwinModel};
use serde_json::Value;
use std::path::Path;

const SPEC: &str = r#"model tiny { layers = 2 hidden = 64 vocab = 64 rope_theta = 10000 rms_eps = 1e-6
  attention gqa { heads = 4 kv_heads = 2 head_dim = 16 qk_norm = true }
  moe { experts = 4 top_k = 2 expert_ffn = 32 routing softmax_topk { norm_topk = true } } }
cluster cpu { nodes = 1 gpus_per_node = 2
  gpu cpu { arch = sm_90a sms = 4 hbm = 128MB hbm_bandwidth = 1TB/s bf16 = 100TFLOP/s smem_per_sm = 228KiB smem_per_block = 227KiB }
  scale_up shm { bandwidth = 10GB/s latency = 1us } }
tiles t { prefill { gate_up { block_m = 64 block_n = 64 block_k = 64 stages = 2 } down { block_m = 64 block_n = 64 block_k = 64 stages = 2 } }
  decode { gate_up { block_m = 64 block_n = 64 block_k = 64 stages = 2 } down { block_m = 64 block_n = 64 block_k = 64 stages = 2 } } }
deploy tiny { model = tiny cluster = cpu tiles = t slo { ttft = 1s tpot = 50ms }
  workload { input = sharegpt output = sharegpt arrival poisson { rate = 1req/s } }
  strategy = colocated switch { t_high = 4 window = 2 cooldown = 0s } memory_fraction = 0.3 }
"#;

/// Every numeric leaf of `v` as a JSON pointer, arrays sampled at their
/// first, second and last element.
fn numeric_leaves(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Number(_) => out.push(at),
        Value::Array(xs) => {
            let n = xs.len();
            let mut picks: Vec<usize> = [0, 1, n.saturating_sub(1)].into_iter().filter(|&i| i < n).collect();
            picks.dedup();
            for i in picks {
                numeric_leaves(&xs[i], format!("{at}/{i}"), out);
            }
        }
        Value::Object(m) => {
            for (k, x) in m {
                numeric_leaves(x, format!("{at}/{k}"), out);
            }
        }
        _ => {}
    }
}

/// Checks, plans and emits `spec`'s deployment into `dir` (no nvcc).
fn write_bundle(spec: &str, dir: &Path) {
    let checked = moeforge::dsl::check_str("tiny.moe", spec).unwrap_or_else(|f| panic!("{}", f.render(false)));
    let id = moeforge::dsl::spec::DeployId(0);
    let plan =
        codegen::plan_deployment(&checked, id).unwrap_or_else(|d| panic!("{}", d.render(&checked.sources, false)));
    codegen::emit(&checked, id, &plan, &NvccMode::Off).unwrap().0.write(dir).unwrap();
}

/// Writes `plan` as the bundle's plan.json and re-hashes the manifest.
fn rewrite(dir: &Path, plan: &Value) {
    let bytes = serde_json::to_vec_pretty(plan).unwrap();
    std::fs::write(dir.join("plan.json"), &bytes).unwrap();
    let mpath = dir.join("manifest.json");
    let mut m: Manifest = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    m.files.insert("plan.json".into(), sha256_hex(&bytes));
    std::fs::write(mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
}

#[test]
fn edited_plans_are_refused_by_field_or_run_without_panicking() {
    edit_every_field(SPEC);
}

/// The same for role plans: ExpertPlex's prefill, decode and MoE servers
/// (roles, dispatch posts, overlaid regions) and PD's instances.
#[test]
fn edited_role_plans_are_refused_by_field_or_run_without_panicking() {
    let four = SPEC.replace("gpus_per_node = 2", "gpus_per_node = 4");
    for strategy in ["expertplex", "pd-disagg"] {
        let spec = four.replace("strategy = colocated", &format!("strategy = {strategy}"));
        assert!(spec.contains(strategy));
        edit_every_field(&spec);
    }
}

fn edit_every_field(spec: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("b");
    let checked = moeforge::dsl::check_str("tiny.moe", spec).unwrap_or_else(|f| panic!("{}", f.render(false)));
    let id = moeforge::dsl::spec::DeployId(0);
    let plan =
        codegen::plan_deployment(&checked, id).unwrap_or_else(|d| panic!("{}", d.render(&checked.sources, false)));
    let (bundle, _) = codegen::emit(&checked, id, &plan, &NvccMode::Off).unwrap();
    bundle.write(&dir).unwrap();
    let loaded = load_bundle(&dir).unwrap();
    assert_eq!(loaded.plan.roles.is_some(), !spec.contains("strategy = colocated"), "{spec}");
    let model = TwinModel::from_spec(&loaded.spec.models[0]).unwrap();
    write_random(&model, 3, Family::Qwen3Moe, &tmp.path().join("w")).unwrap();
    let ck = Checkpoint::load(&tmp.path().join("w")).unwrap();
    let original: Value = serde_json::from_slice(&std::fs::read(dir.join("plan.json")).unwrap()).unwrap();
    let mut leaves = Vec::new();
    numeric_leaves(&original, String::new(), &mut leaves);
    assert!(leaves.len() > 200, "{} numeric fields", leaves.len());
    let (mut refused, mut ran) = (0, 0);
    for leaf in &leaves {
        let Some(n) = original.pointer(leaf).and_then(Value::as_f64) else { continue };
        for edited in [0.0, n + 1.0, f64::from(u32::MAX), 1e15] {
            if edited == n {
                continue;
            }
            let mut plan = original.clone();
            *plan.pointer_mut(leaf).unwrap() = if n.fract() == 0.0 && edited.fract() == 0.0 {
                Value::from(edited as u64)
            } else {
                Value::from(edited)
            };
            rewrite(&dir, &plan);
            match load_bundle(&dir) {
                Err(BundleError::Plan { violations }) => {
                    assert!(!violations.is_empty());
                    refused += 1;
                }
                Err(BundleError::Parse { .. }) => refused += 1,
                Err(e) => panic!("{leaf} = {edited}: unexpected {e}"),
                Ok(b) => match Twin::new(&b, &ck, Mode::Ep) {
                    Err(_) => refused += 1,
                    Ok(mut t) => {
                        t.submit(Request::new(1, vec![1, 2, 3], 2)).unwrap();
                        let _ = t.run_to_completion(8);
                        if let Ok(false) | Err(_) = t.switch_to(Mode::Tp) {}
                        let _ = t.run_to_completion(8);
                        ran += 1;
                    }
                },
            }
        }
    }
    rewrite(&dir, &original);
    assert!(load_bundle(&dir).is_ok());
    eprintln!("{} fields edited: {refused} refused, {ran} ran", leaves.len());
    assert!(refused > 100 && ran > 10, "{refused} refused, {ran} ran");
}

/// A refusal names the field: the plan.json path and what is wrong with it.
#[test]
fn a_refused_plan_names_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("b");
    let checked = moeforge::dsl::check_str("tiny.moe", SPEC).unwrap();
    let id = moeforge::dsl::spec::DeployId(0);
    let plan = codegen::plan_deployment(&checked, id).unwrap();
    codegen::emit(&checked, id, &plan, &NvccMode::Off).unwrap().0.write(&dir).unwrap();
    let mut v: Value = serde_json::from_slice(&std::fs::read(dir.join("plan.json")).unwrap()).unwrap();
    let v0 = v.clone();
    v["memory"]["views"][3]["offset"] = Value::from(v["memory"]["buffer_bytes"].as_u64().unwrap());
    rewrite(&dir, &v);
    let e = load_bundle(&dir).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("plan.json") && e.contains("memory.views[3].offset") && e.contains("leaves region"), "{e}");
    // A workspace buffer moved onto another, or past its region: the
    // devices bound every kernel and transfer by these addresses.
    let buffers = v0["memory"]["buffers"].as_array().unwrap();
    let (first, second) = (&buffers[0], &buffers[1]);
    assert_eq!(first["region"], second["region"], "two buffers of one region");
    let mut v = v0.clone();
    v["memory"]["buffers"][1]["offset"] = first["offset"].clone();
    rewrite(&dir, &v);
    let e = load_bundle(&dir).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("memory.buffers[1].offset") && e.contains("buffers overlap"), "{e}");
    let mut v = v0.clone();
    v["memory"]["buffers"][0]["rows"] = Value::from(v0["memory"]["buffer_bytes"].as_u64().unwrap());
    rewrite(&dir, &v);
    let e = load_bundle(&dir).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("memory.buffers[0].offset") && e.contains("do not fit region"), "{e}");
    rewrite(&dir, &v0);
    // A plan that disagrees with its spec is refused too.
    let mut v: Value = serde_json::from_slice(&std::fs::read(dir.join("plan.json")).unwrap()).unwrap();
    v = {
        let mut p = v.clone();
        p["model"]["hidden"] = Value::from(128);
        p
    };
    rewrite(&dir, &v);
    let e = load_bundle(&dir).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("model") && e.contains("spec.json"), "{e}");
}

/// Writes `spec` as the bundle's spec.json and re-hashes everything that
/// names it (the manifest's spec hash and files, the plan's spec hash).
fn rewrite_spec(dir: &Path, spec: &Value) {
    let bytes = serde_json::to_vec_pretty(spec).unwrap();
    std::fs::write(dir.join("spec.json"), &bytes).unwrap();
    let hash = sha256_hex(&bytes);
    let mut plan: Value = serde_json::from_slice(&std::fs::read(dir.join("plan.json")).unwrap()).unwrap();
    plan["spec_hash"] = Value::from(hash.clone());
    rewrite(dir, &plan);
    let mpath = dir.join("manifest.json");
    let mut m: Manifest = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    m.spec_hash = hash.clone();
    m.files.insert("spec.json".into(), hash);
    std::fs::write(mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
}

/// Edits no single-number sweep makes: swapped TP KV-head ownership, a view
/// holding the wrong shard, an invented reshard copy, an out-of-range spec,
/// a manifest entry that is a link. Each is refused, naming what is wrong.
#[test]
fn structural_edits_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("b");
    let checked = moeforge::dsl::check_str("tiny.moe", SPEC).unwrap();
    let id = moeforge::dsl::spec::DeployId(0);
    let plan = codegen::plan_deployment(&checked, id).unwrap();
    codegen::emit(&checked, id, &plan, &NvccMode::Off).unwrap().0.write(&dir).unwrap();
    let plan0: Value = serde_json::from_slice(&std::fs::read(dir.join("plan.json")).unwrap()).unwrap();
    let spec0: Value = serde_json::from_slice(&std::fs::read(dir.join("spec.json")).unwrap()).unwrap();
    let refused = |dir: &Path| load_bundle(dir).err().map(|e| e.to_string()).unwrap_or_default();
    // TP KV heads swapped between the two ranks: query heads would miss theirs.
    let mut p = plan0.clone();
    assert_eq!(p["memory"]["kv"]["tp_heads"], serde_json::json!([[0, 1], [1, 2]]));
    p["memory"]["kv"]["tp_heads"] = serde_json::json!([[1, 2], [0, 1]]);
    rewrite(&dir, &p);
    assert!(refused(&dir).contains("memory.kv.tp_heads"), "{}", refused(&dir));
    // The TP k_proj view claims query-head blocks instead of KV-head blocks.
    let mut p = plan0.clone();
    let views = p["memory"]["views"].as_array_mut().unwrap();
    let k = views.iter_mut().find(|v| v["role"] == "k_proj" && v["mode"] == "tp").unwrap();
    k["shard"]["heads"] = Value::from("query");
    rewrite(&dir, &p);
    assert!(refused(&dir).contains(".shard"), "{}", refused(&dir));
    // One more copy in the EP→TP descriptors.
    let mut p = plan0.clone();
    let copies = p["memory"]["reshard"]["ep_to_tp"]["per_layer"].as_array_mut().unwrap();
    let extra = copies[0].clone();
    copies.push(extra);
    rewrite(&dir, &p);
    assert!(refused(&dir).contains("memory.reshard"), "{}", refused(&dir));
    // A program naming 100,000 streams (nothing uses them): refused by
    // count before the happens-before check sizes a clock per stream pair.
    let mut p = plan0.clone();
    let streams = p["programs"][0]["streams"].as_array_mut().unwrap();
    let one = streams[0].clone();
    streams.extend(std::iter::repeat_n(one, 100_000));
    rewrite(&dir, &p);
    assert!(refused(&dir).contains("programs[0].streams"), "{}", refused(&dir));
    rewrite(&dir, &plan0);
    assert!(load_bundle(&dir).is_ok());
    // spec.json with a rotary width beyond the head (out of the checker's range).
    let mut s = spec0.clone();
    s["models"][0]["attention"]["rope_dim"] = Value::from(999);
    rewrite_spec(&dir, &s);
    let e = refused(&dir);
    assert!(e.contains("spec.json") && e.contains("rope_dim"), "{e}");
    rewrite_spec(&dir, &spec0);
    assert!(load_bundle(&dir).is_ok());
    // The compiled reshard: another program's code (its key line edited), or none.
    let rehash = |rel: &str, bytes: Option<&[u8]>| {
        let mpath = dir.join("manifest.json");
        let mut m: Manifest = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
        match bytes {
            Some(b) => {
                std::fs::write(dir.join(rel), b).unwrap();
                m.files.insert(rel.into(), sha256_hex(b));
            }
            None => {
                m.files.remove(rel);
            }
        }
        std::fs::write(mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    };
    let ptx0 = std::fs::read_to_string(dir.join("kernels/xfer_reshard.ptx")).unwrap();
    assert!(ptx0.starts_with("// moeforge transfer program "), "{}", &ptx0[..80]);
    let other = ptx0.replacen("// moeforge transfer program ", "// moeforge transfer program 0", 1);
    rehash("kernels/xfer_reshard.ptx", Some(other.as_bytes()));
    let e = refused(&dir);
    assert!(e.contains("kernels/xfer_reshard.ptx") && e.contains("another transfer program"), "{e}");
    rehash("kernels/xfer_reshard.ptx", Some(ptx0.as_bytes()));
    assert!(load_bundle(&dir).is_ok());
    rehash("kernels/xfer_reshard.ll", None);
    let e = refused(&dir);
    assert!(e.contains("kernels/xfer_reshard.ll"), "{e}");
    let ir0 = std::fs::read(dir.join("kernels/xfer_reshard.ll")).unwrap();
    rehash("kernels/xfer_reshard.ll", Some(&ir0));
    assert!(load_bundle(&dir).is_ok());
    // A kernel source replaced by a link to a file outside the bundle.
    #[cfg(unix)]
    {
        let cu = dir.join("kernels/router.cu");
        let outside = tmp.path().join("outside.cu");
        std::fs::rename(&cu, &outside).unwrap();
        std::os::unix::fs::symlink(&outside, &cu).unwrap();
        let e = refused(&dir);
        assert!(e.contains("kernels/router.cu") && e.contains("not a regular file"), "{e}");
    }
}

/// A relayed combine (the prefill combine of an EP plan over 2 nodes) is
/// refused where it cannot relay: into another buffer than the dispatch's
/// rows (a combine reading its own destination), over nodes its group does
/// not fill, or over another node size than the cluster's; a relayed
/// dispatch, where its relays would land rows elsewhere than its own
/// receive rows.
#[test]
fn an_edited_relay_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("b");
    let spec = SPEC
        .replace("nodes = 1", "nodes = 2")
        .replace(
            "latency = 1us }",
            "latency = 1us } scale_out net { nics_per_node = 2 bandwidth = 10Gb/s latency = 5us }",
        )
        .replace("switch { t_high = 4 window = 2 cooldown = 0s }", "");
    write_bundle(&spec, &dir);
    let v0: Value = serde_json::from_slice(&std::fs::read(dir.join("plan.json")).unwrap()).unwrap();
    // The first relayed op named `name`: (program, block, op).
    let first = |name: &str| {
        for (pi, p) in v0["programs"].as_array().unwrap().iter().enumerate() {
            for (bi, b) in p["blocks"].as_array().unwrap().iter().enumerate() {
                for (oi, o) in b["ops"].as_array().unwrap().iter().enumerate() {
                    if !o["comm"]["relay"].is_null() && o["name"].as_str().unwrap().starts_with(name) {
                        return (pi, bi, oi);
                    }
                }
            }
        }
        panic!("a 2-node EP plan relays its prefill {name}")
    };
    let refused_at = |(pi, bi, oi): (usize, usize, usize), edit: &dyn Fn(&mut Value)| {
        let mut v = v0.clone();
        edit(&mut v["programs"][pi]["blocks"][bi]["ops"][oi]);
        rewrite(&dir, &v);
        load_bundle(&dir).err().map(|e| e.to_string()).unwrap_or_default()
    };
    let (pi, bi, oi) = first("dispatch");
    let e = refused_at((pi, bi, oi), &|o| o["comm"]["relay"]["via"] = Value::from("combine"));
    assert!(
        e.contains(&format!("programs[{pi}].blocks[{bi}].ops[{oi}].comm.relay")) && e.contains("lands its rows"),
        "{e}"
    );
    let (pi, bi, oi) = first("combine");
    assert_eq!(v0["programs"][pi]["phase"], "prefill");
    let field = format!("programs[{pi}].blocks[{bi}].ops[{oi}].comm.relay");
    let refused = |edit: &dyn Fn(&mut Value)| refused_at((pi, bi, oi), edit);
    let e = refused(&|o| {
        o["comm"]["relay"]["via"] = Value::from("combine");
        o["writes"].as_array_mut().unwrap().push(serde_json::json!({"kind": "buffer", "name": "combine"}));
    });
    assert!(e.contains(&field) && e.contains("dispatch's receive rows"), "{e}");
    let e = refused(&|o| o["comm"]["relay"]["gpus_per_node"] = Value::from(4));
    assert!(e.contains(&field) && e.contains("whole nodes"), "{e}");
    let e = refused(&|o| o["comm"]["relay"]["gpus_per_node"] = Value::from(1));
    assert!(e.contains(&field) && e.contains("the cluster's have 2"), "{e}");
    rewrite(&dir, &v0);
    assert!(load_bundle(&dir).is_ok());
}

/// A role plan is single-mode EP (Moebius's switch is colocated): an edit
/// that gives it the TP view back is refused by field.
#[test]
fn a_role_plan_holding_the_tp_view_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("b");
    let spec =
        SPEC.replace("gpus_per_node = 2", "gpus_per_node = 4").replace("strategy = colocated", "strategy = expertplex");
    let checked = moeforge::dsl::check_str("tiny.moe", &spec).unwrap();
    let id = moeforge::dsl::spec::DeployId(0);
    let plan = codegen::plan_deployment(&checked, id).unwrap();
    assert!(plan.roles.is_some());
    codegen::emit(&checked, id, &plan, &NvccMode::Off).unwrap().0.write(&dir).unwrap();
    let mut v: Value = serde_json::from_slice(&std::fs::read(dir.join("plan.json")).unwrap()).unwrap();
    assert_eq!(v["memory"]["modes"], serde_json::json!(["ep"]));
    let original = v.clone();
    v["memory"]["modes"] = serde_json::json!(["tp", "ep"]);
    rewrite(&dir, &v);
    let e = load_bundle(&dir).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("memory.modes") && e.contains("EP view only"), "{e}");
    // A post to the last u32 rank (past any node) is refused, not an overflow.
    let mut v = original;
    let prefill = v["roles"]["gpus"].as_array().unwrap().iter().position(|g| g == "prefill").unwrap();
    v["roles"]["posts"][0]["src"] = Value::from(prefill);
    v["roles"]["posts"][0]["dst"] = Value::from(u32::MAX);
    rewrite(&dir, &v);
    let e = load_bundle(&dir).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("roles.posts[0]"), "{e}");
}

/// What the plan realizes decides its modes and what report.md says, not
/// the requested strategy: an `expertplex` deployment on two GPUs (no room
/// for three roles) falls back to the colocated layout, which switches
/// TP↔EP like any colocated plan.
#[test]
fn a_strategy_that_falls_back_to_colocated_keeps_the_switch() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("b");
    let spec = SPEC.replace("strategy = colocated", "strategy = expertplex");
    let checked = moeforge::dsl::check_str("tiny.moe", &spec).unwrap();
    let id = moeforge::dsl::spec::DeployId(0);
    let plan = codegen::plan_deployment(&checked, id).unwrap();
    assert!(plan.roles.is_none());
    assert!(plan.layout.note.as_deref().is_some_and(|n| n.contains("colocated")), "{:?}", plan.layout.note);
    assert_eq!(plan.memory.modes, [Mode::Tp, Mode::Ep], "{:?}", plan.memory.single_mode_reason);
    assert!(plan.memory.reshard.is_some());
    codegen::emit(&checked, id, &plan, &NvccMode::Off).unwrap().0.write(&dir).unwrap();
    let report = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(report.contains("the plan is the colocated DP-attention + EP layout"), "{report}");
    assert!(!report.contains("Realized:") && !report.contains("ExpertPlex roles put attention"), "{report}");
}

/// A replicated placement's routing buffers are checked against what the
/// routing kernel reads and writes: a `zepp_route` buffer a word short, or a
/// replica table of another width, is refused at the routing kernel (the
/// kernel would write past the buffer), and a placement that says `none` is
/// refused at its policy (striped experts have logical ids, a placement's
/// are physical).
#[test]
fn undersized_routing_buffers_and_a_striped_placement_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("b");
    let spec = SPEC
        .replace("switch { t_high = 4 window = 2 cooldown = 0s }", "placement { policy = zepp redundant_experts = 2 }");
    write_bundle(&spec, &dir);
    assert!(load_bundle(&dir).is_ok());
    let v0: Value = serde_json::from_slice(&std::fs::read(dir.join("plan.json")).unwrap()).unwrap();
    let buffer = |name: &str| {
        v0["memory"]["buffers"]
            .as_array()
            .unwrap()
            .iter()
            .position(|b| b["name"] == name)
            .unwrap_or_else(|| panic!("a replicated plan holds `{name}`"))
    };
    let refused = |edit: &dyn Fn(&mut Value)| {
        let mut v = v0.clone();
        edit(&mut v);
        rewrite(&dir, &v);
        load_bundle(&dir).err().map(|e| e.to_string()).unwrap_or_default()
    };
    let (route, table) = (buffer("zepp_route"), buffer("replica_table"));
    let e = refused(&|v| {
        let b = &mut v["memory"]["buffers"][route]["row_bytes"];
        *b = Value::from(b.as_u64().unwrap() - 4);
    });
    assert!(e.contains("kernels[") && e.contains("routing-kernel"), "{e}");
    let e = refused(&|v| {
        let b = &mut v["memory"]["buffers"][table]["row_bytes"];
        *b = Value::from(b.as_u64().unwrap() + 4);
    });
    assert!(e.contains("kernels[") && e.contains("routing-kernel"), "{e}");
    let e = refused(&|v| v["placement"]["policy"] = Value::from("none"));
    assert!(e.contains("placement.policy"), "{e}");
    // An expert id at u32's limit: refused by its range, and sizing the
    // routing kernel's table for it costs nothing (it once asked for ~100 GB).
    let e = refused(&|v| v["placement"]["replicas"][0][0][0] = Value::from(u32::MAX));
    assert!(e.contains("placement"), "{e}");
    rewrite(&dir, &v0);
    assert!(load_bundle(&dir).is_ok());
}
