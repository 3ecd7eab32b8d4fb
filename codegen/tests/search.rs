//! The cost model and ExpertPlex Algorithm 1 on real deployments.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use moeforge_codegen::{plan_deployment, plan_deployment_with, PlanOptions};
use moeforge_dsl::spec::DeployId;
use moeforge_dsl::{check_paths, FsLoader};
use moeforge_plan::cost::step::{Env, Load, Overlap, Overlaps, Sms};
use moeforge_plan::cost::{Fit, Profile, ProfileSample, Sample};

fn example(name: &str) -> moeforge_dsl::Checked {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../examples/{name}.moe"));
    check_paths(&[path], &FsLoader).unwrap_or_else(|f| panic!("{}", f.render(false)))
}

#[test]
fn search_results_meet_slos_fit_memory_and_are_ranked() {
    for name in ["minimax-m2-h800", "glm-5-h800x24", "kimi-k2-h100x32"] {
        let checked = example(name);
        let plan = plan_deployment(&checked, DeployId(0)).unwrap();
        let p = plan.plan();
        let r = p.search.as_ref().unwrap();
        assert!(!r.ranked.is_empty(), "{name}: no feasible layout");
        let d = &checked.spec.deploys[0];
        let m = checked.spec.model(d.model);
        let c = checked.spec.cluster(d.cluster);
        let routed = f64::from(m.moe_layers()) * f64::from(m.moe.experts) * m.expert_bytes() as f64;
        let usable = c.gpu.hbm as f64 * d.memory_fraction;
        for w in r.ranked.windows(2) {
            assert!(w[0].goodput >= w[1].goodput, "{name}: not ranked");
        }
        for cand in &r.ranked {
            assert_eq!(cand.moe_gpus + cand.prefill_gpus + cand.decode_gpus, c.world_size());
            assert!(cand.t_decode <= d.slo.tpot && cand.t_prefill <= d.slo.ttft / 2.0, "{name}: {cand:?}");
            // The busiest MoE server's slots: the stripes' or the replicas' rounding up.
            let redundant = if d.placement.policy == moeforge_dsl::spec::PlacementPolicy::None {
                0
            } else {
                d.placement.redundant_experts
            };
            let slots = (m.moe.experts + redundant).div_ceil(cand.moe_gpus);
            let held = routed / f64::from(m.moe.experts) * f64::from(slots);
            assert!(held <= usable, "{name}: {slots} expert slots do not fit {cand:?}");
            assert!((cand.goodput - cand.prefill_rate.min(cand.decode_rate)).abs() < 1e-9);
            let per_node: u32 = cand.per_node.iter().map(|n| n.iter().sum::<u32>()).sum();
            assert_eq!(per_node, c.world_size());
            // Prefill servers are spread: no node holds two more than another.
            let p: Vec<u32> = cand.per_node.iter().map(|n| n[1]).collect();
            assert!(p.iter().max().unwrap() - p.iter().min().unwrap() <= 1, "{name}: {p:?}");
        }
        // The realized best layout's MoE servers hold what the check charged:
        // the placement pass's slots (replicas), or the widest stripe.
        if let (Some(roles), Some(best)) = (p.roles.as_ref(), r.realizable()) {
            let charged = (m.moe.experts + p.placement.as_ref().map_or(0, |_| d.placement.redundant_experts))
                .div_ceil(best.moe_gpus);
            let held = roles.ranks(moeforge_plan::roles::Role::Moe).iter().map(|&g| p.local_experts(g as usize)).max();
            assert_eq!(held, Some(charged), "{name}");
        }
    }
}

#[test]
fn tighter_slos_never_raise_goodput() {
    let base = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/minimax-m2-h800.moe"),
    )
    .unwrap();
    let abs = base.replace("\"../models/", &format!("\"{}/../models/", env!("CARGO_MANIFEST_DIR")));
    let mut last = f64::INFINITY;
    for tpot in ["100ms", "50ms", "30ms", "20ms"] {
        let text = abs.replace("tpot = 50ms", &format!("tpot = {tpot}"));
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("m.moe");
        std::fs::write(&f, text).unwrap();
        let checked = check_paths(&[f], &FsLoader).unwrap_or_else(|e| panic!("{}", e.render(false)));
        let plan = plan_deployment(&checked, DeployId(0)).unwrap();
        let g = plan.plan().search.as_ref().unwrap().ranked.first().map_or(0.0, |c| c.goodput);
        assert!(g <= last + 1e-9, "TPOT {tpot}: goodput {g} above {last}");
        last = g;
    }
    assert!(last > 0.0);
}

#[test]
fn a_measured_profile_overrides_the_roofline() {
    let checked = example("minimax-m2-h800");
    let truth = Fit { alpha: 30e-6, beta: 4e-6, gamma: 0.0, delta: 0.0 };
    let samples = (1..20)
        .map(|x| ProfileSample {
            component: "moe".into(),
            sample: Sample { x: f64::from(x * 8), s: 0.0, t: truth.eval(f64::from(x * 8), 0.0) },
        })
        .collect();
    let opts = PlanOptions { profile: Some((Profile { samples }, "abc123".into())), ..PlanOptions::default() };
    let plan = plan_deployment_with(&checked, DeployId(0), &opts).unwrap();
    let cm = &plan.plan().cost;
    assert_eq!(cm.source, "profile sha256:abc123");
    assert!((cm.moe.alpha - truth.alpha).abs() < 1e-12 && (cm.moe.beta - truth.beta).abs() < 1e-12, "{:?}", cm.moe);
    let roof = plan_deployment(&checked, DeployId(0)).unwrap();
    assert_eq!(cm.attn_decode, roof.plan().cost.attn_decode, "components without samples keep the roofline");
    // A profile naming an unknown component is refused with a clear message.
    let bad = PlanOptions {
        profile: Some((
            Profile {
                samples: vec![ProfileSample { component: "attn".into(), sample: Sample { x: 1.0, s: 1.0, t: 1.0 } }],
            },
            "x".into(),
        )),
        ..PlanOptions::default()
    };
    let e = plan_deployment_with(&checked, DeployId(0), &bad).err().unwrap();
    assert!(e.0[0].message.contains("unknown component `attn`"), "{:?}", e);
}

#[test]
fn no_feasible_layout_is_reported_not_invented() {
    // A TPOT no layout can meet.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/minimax-m2-h800.moe");
    let text = std::fs::read_to_string(&path).unwrap().replace("tpot = 50ms", "tpot = 1us");
    let abs = text.replace("\"../models/", &format!("\"{}/../models/", env!("CARGO_MANIFEST_DIR")));
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("m.moe");
    std::fs::write(&f, abs).unwrap();
    let checked = check_paths(&[f], &FsLoader).unwrap();
    let plan = plan_deployment(&checked, DeployId(0)).unwrap();
    let r = plan.plan().search.as_ref().unwrap();
    assert!(r.ranked.is_empty() && r.feasible == 0 && r.layouts_fitting > 0);
}

/// The environment the search prices a deployment in.
fn env_of(checked: &moeforge_dsl::Checked, cm: &moeforge_plan::cost::CostModel) -> Env {
    let s = &checked.spec;
    let d = &s.deploys[0];
    let m = s.model(d.model);
    let ws = moeforge_plan::memory::Workspace::of(m, false).bytes();
    Env::new(m, s.cluster(d.cluster), s.tile_set(d.tiles), d, cm, ws)
}

/// The search keeps, per phase, the attention width and overlap whose
/// largest batch meeting the SLO serves the most requests. Checked by a
/// different search: every alternative's largest batch found by a linear
/// scan upwards from one request (or one prompt), never better than the
/// choice; the choice's own batch is largest (one more breaks the SLO or
/// the KV).
#[test]
fn each_phase_keeps_the_attention_and_overlap_that_serve_the_most_requests() {
    for name in ["minimax-m2-h800", "glm-5-h800x24", "qwen3-30b-a3b-h200"] {
        let checked = example(name);
        let plan = plan_deployment(&checked, DeployId(0)).unwrap();
        let p = plan.plan();
        let r = p.search.as_ref().unwrap();
        let best = r.best().unwrap();
        let d = &checked.spec.deploys[0];
        let e = env_of(&checked, &p.cost);
        let side = best.moe_side();
        let (input, output) = (r.mean_input, r.mean_output);
        let gpn = checked.spec.cluster(d.cluster).gpus_per_node;
        let room = |w: u32| e.usable - e.nonrouted / f64::from(w) - e.workspace;
        let kv = |w: u32| e.kv_token * e.kv_fraction(w);
        let t_decode = |w: u32, o: Overlap, b: f64| {
            let groups = best.decode_gpus / w;
            let per = (b / f64::from(groups)).ceil();
            let load = Load::decode(per, per * (input + output / 2.0)).times(groups);
            let ov = Overlaps { decode: o, ..Overlaps::STANDARD };
            e.iteration(&[load], w, 1.0, side, Sms::fixed(best.q), 0.0, ov).seconds
        };
        let t_prefill = |w: u32, o: Overlap, tokens: f64| {
            let groups = best.prefill_gpus / w;
            let load = Load::prompts(tokens / f64::from(groups) / input, input).times(groups);
            let ov = Overlaps { prefill: o, ..Overlaps::STANDARD };
            e.iteration(&[load], w, 1.0, side, Sms::fixed(e.cm.sms - best.q), 0.0, ov).seconds
        };
        for w in [1u32, 2, 4, 8].into_iter().filter(|&w| w <= gpn) {
            // SBO needs shared experts to put beside the routed ones.
            let sbo = checked.spec.model(d.model).moe.shared_experts > 0;
            for o in [Overlap::Tbo, Overlap::Sbo, Overlap::None].into_iter().filter(|&o| sbo || o != Overlap::Sbo) {
                if best.per_node.iter().all(|n| n[2] % w == 0) {
                    let cap = ((room(w) / (kv(w) * (input + output))).floor() * f64::from(best.decode_gpus / w)) as u32;
                    let mut b = 0;
                    while b < cap.min(8192) && t_decode(w, o, f64::from(b + 1)) <= d.slo.tpot {
                        b += 1;
                    }
                    if b > 0 {
                        let rate = f64::from(b) / (t_decode(w, o, f64::from(b)) * output);
                        assert!(rate <= best.decode_rate * (1.0 + 1e-9), "{name}: decode {w} {o:?} {rate} > {best:?}");
                    }
                }
                if best.per_node.iter().all(|n| n[1] % w == 0) {
                    // The largest feasible prompt-token batch: up in steps of 1024, then of 1.
                    let cap = ((room(w) / kv(w)).floor() * f64::from(best.prefill_gpus / w)).min(262_144.0);
                    let ok = |t: f64| t <= cap && t_prefill(w, o, t) <= d.slo.ttft / 2.0;
                    let mut t = 0.0;
                    for step in [1024.0, 1.0] {
                        while ok(t + step) {
                            t += step;
                        }
                    }
                    if t >= input {
                        let rate = t / input / t_prefill(w, o, t);
                        assert!(
                            rate <= best.prefill_rate * (1.0 + 1e-9),
                            "{name}: prefill {w} {o:?} {rate} > {best:?}"
                        );
                    }
                }
            }
        }
        // The chosen batches are the largest: one more breaks the SLO or the KV.
        let (dw, pw) = (best.decode_width, best.prefill_width);
        let cap = ((room(dw) / (kv(dw) * (input + output))).floor() * f64::from(best.decode_gpus / dw)) as u32;
        assert!(
            best.decode_batch == cap.min(8192)
                || t_decode(dw, best.overlap.decode, f64::from(best.decode_batch + 1)) > d.slo.tpot,
            "{name}: {best:?}"
        );
        assert_eq!(
            best.decode_kv_bound,
            best.decode_batch == cap && t_decode(dw, best.overlap.decode, f64::from(cap + 1)) <= d.slo.tpot
        );
        let _ = pw;
    }
}

/// A decode step whose attention alone outruns TPOT for one request per
/// GPU can still meet it with tensor-parallel attention (each GPU of a
/// group reads 1/w of the KV). The search finds such layouts; role plans
/// execute data-parallel attention only, so the plan says why it is
/// colocated instead of realizing a layout it cannot run.
#[test]
fn tensor_parallel_attention_carries_a_decode_that_data_parallel_cannot() {
    let checked = example("minimax-m2-h800");
    let roof = plan_deployment(&checked, DeployId(0)).unwrap();
    let d = &checked.spec.deploys[0];
    let r = roof.plan().search.as_ref().unwrap();
    let m = checked.spec.model(d.model);
    // γ such that one request at the mean decode context takes 0.8 × TPOT
    // in attention alone over the model's layers: with the rest of a step
    // (experts, communication, head) one request per data-parallel server
    // misses TPOT, while a TP2 group reads half of it per GPU.
    let ctx = r.mean_input + r.mean_output / 2.0;
    let gamma = 0.8 * d.slo.tpot / (f64::from(m.layers) * ctx);
    let a = roof.plan().cost.attn_decode;
    let truth = Fit { gamma, ..a };
    let samples = [1.0, 2.0, 4.0, 16.0, 64.0]
        .iter()
        .flat_map(|&x| [256.0, 1024.0, 4096.0].map(|s| (x, s)))
        .map(|(x, s)| ProfileSample { component: "attn_decode".into(), sample: Sample { x, s, t: truth.eval(x, s) } })
        .collect();
    let opts = PlanOptions { profile: Some((Profile { samples }, "tp".into())), ..PlanOptions::default() };
    let plan = plan_deployment_with(&checked, DeployId(0), &opts).unwrap();
    let p = plan.plan();
    let s = p.search.as_ref().unwrap();
    let best = s.best().expect("tensor-parallel decode attention meets TPOT");
    assert!(best.decode_width >= 2, "{best:?}");
    assert!(best.t_decode <= d.slo.tpot);
    // One request per data-parallel decode server misses TPOT on that layout.
    let e = env_of(&checked, &p.cost);
    let one = Load::decode(1.0, ctx).times(best.decode_gpus);
    for decode in [Overlap::Sbo, Overlap::None] {
        let o = Overlaps { decode, ..Overlaps::STANDARD };
        let dp = e.iteration(&[one], 1, 1.0, best.moe_side(), Sms::fixed(best.q), 0.0, o);
        assert!(dp.seconds > d.slo.tpot, "{decode:?}: {dp:?}");
    }
    // No data-parallel candidate meets TPOT: the plan is colocated, and says why.
    assert!(s.realizable().is_none(), "{:?}", s.realizable());
    assert!(p.roles.is_none());
    let note = p.layout.note.as_deref().unwrap_or_default();
    assert!(note.contains("tensor-parallel attention") && note.contains(&format!("tp{}", best.decode_width)), "{note}");
}

/// `strategy = auto` realizes what its comparison puts first, and keeps
/// the colocated layout when the spec asks for TP↔EP switching.
#[test]
fn auto_realizes_the_strategy_its_comparison_puts_first() {
    use moeforge_dsl::spec::Strategy;
    // With `switch` (the example): colocated, dual mode, and the note says why.
    let checked = example("qwen3-30b-a3b-h200");
    let plan = plan_deployment(&checked, DeployId(0)).unwrap();
    let p = plan.plan();
    assert!(p.roles.is_none() && p.memory.modes.len() == 2, "{:?}", p.memory.modes);
    assert!(p.layout.note.as_deref().unwrap_or_default().contains("`switch`"), "{:?}", p.layout.note);
    assert_eq!(p.search.as_ref().unwrap().alternatives.len(), 3);
    // Without it: the comparison decides, and the plan is what it chose.
    let dir = tempfile::tempdir().unwrap();
    for (name, expect) in [("qwen3-30b-a3b-h200", Strategy::Expertplex), ("qwen3-235b-a22b-h200", Strategy::Colocated)]
    {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../examples/{name}.moe"));
        let text: String = std::fs::read_to_string(&path)
            .unwrap()
            .replace("strategy = colocated", "strategy = auto")
            .replace("\"../models/", &format!("\"{}/../models/", env!("CARGO_MANIFEST_DIR")))
            .lines()
            .filter(|l| !l.trim_start().starts_with("switch"))
            .map(|l| format!("{l}\n"))
            .collect();
        let f = dir.path().join(format!("{name}.moe"));
        std::fs::write(&f, text).unwrap();
        let checked = check_paths(&[f], &FsLoader).unwrap_or_else(|e| panic!("{}", e.render(false)));
        let plan = plan_deployment(&checked, DeployId(0)).unwrap();
        let p = plan.plan();
        let alt = &p.search.as_ref().unwrap().alternatives;
        assert!(alt.windows(2).all(|w| w[0].goodput >= w[1].goodput), "{alt:?}");
        assert_eq!(alt[0].strategy, expect, "{name}: {alt:?}");
        assert_eq!(p.layout.requested, Strategy::Auto);
        match expect {
            Strategy::Expertplex => {
                let roles = p.roles.as_ref().expect("auto realizes ExpertPlex roles");
                let best = p.search.as_ref().unwrap().realizable().unwrap();
                assert_eq!((roles.per_node.clone(), roles.q), (best.per_node.clone(), best.q));
                assert_eq!(alt[0].goodput, best.goodput);
            }
            _ => assert!(p.roles.is_none()),
        }
        let note = p.layout.note.as_deref().unwrap_or_default();
        assert!(note.contains(&format!("chose `{}`", expect.name())), "{note}");
        assert!(moeforge_plan::validate::check(p).is_empty(), "{:?}", moeforge_plan::validate::check(p));
    }
}
