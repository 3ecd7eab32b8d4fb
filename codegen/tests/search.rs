//! The cost model and ExpertPlex Algorithm 1 on real deployments.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use moeforge_codegen::{plan_deployment, plan_deployment_with, PlanOptions};
use moeforge_dsl::spec::DeployId;
use moeforge_dsl::{check_paths, FsLoader};
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
        if let (Some(roles), Some(best)) = (p.roles.as_ref(), r.ranked.first()) {
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
