//! The serving simulator (runtime `sim` backend): the mechanisms each
//! comparison rests on, checked directly.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::sim_fixture::fixture;
use moeforge::dsl::spec::DeployId;
use moeforge::dsl::{check_paths, FsLoader};
use moeforge::plan::cost::step::{Load, MoeSide, Overlap, Overlaps, Sms};
use moeforge::runtime::sim::report::{attainment, Probe};
use moeforge::runtime::sim::workload::Req;
use moeforge::runtime::sim::{Bench, Deployment, Phases, Sharing, System};

fn one(b: &Bench, s: System) -> Deployment {
    b.deployment(s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
}

fn req(arrival: f64, input: u32, output: u32) -> Req {
    Req { arrival, input, output }
}

#[test]
fn pd_duplicates_experts_and_holds_less_kv_than_sharing() {
    let f = fixture("minimax-m2-h800");
    let b = f.bench();
    let pd = one(&b, System::PdDisagg);
    let xp = one(&b, System::ExpertPlex);
    let co = one(&b, System::Colocated);
    // 230 GB of fp8 weights need 4 of the 80 GB GPUs: 1P1D × DP4EP4, as the paper deploys it.
    assert_eq!(pd.label, "1P1D × DP4EP4");
    assert_eq!((pd.expert_copies, xp.expert_copies, co.expert_copies), (2, 1, 1));
    // The decode instance's 4 GPUs each hold a quarter of the model; ExpertPlex's
    // decode servers hold only the non-routed weights.
    let per_gpu = |d: &Deployment| match &d.phases {
        Phases::Split { decode, .. } => decode.kv_per_group,
        Phases::Unified { ep, .. } => ep.unwrap().kv_per_group,
    };
    assert!(per_gpu(&pd) < 0.5 * per_gpu(&xp), "{} vs {}", per_gpu(&pd), per_gpu(&xp));
    assert!(per_gpu(&pd) < per_gpu(&co));
    assert!(pd.decode_kv_tokens < co.decode_kv_tokens);
    // GLM-5 (746 GB) needs a 32-GPU unit: on 16 H800s each GPU would hold its
    // 1/16 of the routed experts (45.3 GB) beside all 21.2 GB of the weights
    // data-parallel attention replicates and the 8.7 GB workspace, past 72 GB. 24 GPUs cannot hold
    // two instances either way (ExpertPlex §7.1): PD is refused with the reason.
    let g = fixture("glm-5-h800x24");
    let env = &g.bench().env;
    assert!(env.usable - env.weights_per_gpu(1, 16) - env.workspace < 0.0);
    assert!(env.usable - env.weights_per_gpu(1, 32) - env.workspace > 0.0);
    let err = g.bench().deployment(System::PdDisagg).unwrap_err();
    assert!(err.contains("needs 32 GPUs"), "{err}");
}

#[test]
fn tp_replicates_kv_heads_and_the_dual_plan_gives_both_capacities() {
    let f = fixture("qwen3-235b-a22b-h200");
    let b = f.bench();
    let (tp, ep) = (one(&b, System::StaticTp), one(&b, System::StaticEp));
    let mem = &f.planned.plan().memory;
    // Capacities come from the memory plan: 4 KV heads on 8 ranks replicate ×2.
    assert_eq!(tp.decode_kv_tokens, mem.kv.tp.as_ref().unwrap().capacity_tokens as f64);
    assert_eq!(ep.decode_kv_tokens, mem.kv.ep.capacity_tokens as f64);
    assert!((ep.decode_kv_tokens / tp.decode_kv_tokens - 2.0).abs() < 0.01);
    // A plan without `switch` has no TP mode: the systems needing one say why.
    let m = fixture("minimax-m2-h800");
    let err = m.bench().deployment(System::Moebius).unwrap_err();
    assert!(err.contains("EP-only"), "{err}");
}

#[test]
fn a_lone_request_sees_exactly_the_modeled_iterations() {
    let f = fixture("minimax-m2-h800");
    let b = f.bench();
    let e = &b.env;
    let co = one(&b, System::Colocated);
    let out = b.simulate(&co, &[req(1.0, 500, 11)]);
    let Phases::Unified { ep: Some(ep), .. } = co.phases else { panic!() };
    let mut loads = vec![Load::default(); ep.groups as usize];
    loads[0].add_chunk(500.0, 0.0);
    let prefill = e.iteration(&loads, 1, 1.0, ep.moe, Sms::all(e.cm.sms), 0.0, Overlaps::STANDARD).seconds;
    assert!((out[0].ttft.unwrap() - prefill).abs() < 1e-12);
    // Ten decode iterations with 501..=510 cached tokens.
    let decode: f64 = (0..10)
        .map(|i| {
            let mut l = vec![Load::default(); ep.groups as usize];
            l[0] = Load::decode(1.0, 500.0 + f64::from(i));
            e.iteration(&l, 1, 1.0, ep.moe, Sms::all(e.cm.sms), 0.0, Overlaps::STANDARD).seconds
        })
        .sum();
    assert!((out[0].tpot.unwrap() - decode / 10.0).abs() < 1e-12);
    assert!((out[0].finish.unwrap() - (1.0 + prefill + decode)).abs() < 1e-9);
}

#[test]
fn colocated_prefill_stalls_decode_but_expertplex_decode_keeps_going() {
    let f = fixture("minimax-m2-h800");
    let b = f.bench();
    // A request decoding 200 tokens; long prompts keep arriving while it runs.
    let mut reqs = vec![req(0.0, 200, 200)];
    reqs.extend((0..400).map(|i| req(0.1 + 0.02 * f64::from(i), 8000, 2)));
    let alone = |s| b.simulate(&one(&b, s), &reqs[..1])[0].tpot.unwrap();
    let shared = |s| b.simulate(&one(&b, s), &reqs)[0].tpot.unwrap();
    let (co_alone, co_shared) = (alone(System::Colocated), shared(System::Colocated));
    let (xp_alone, xp_shared) = (alone(System::ExpertPlex), shared(System::ExpertPlex));
    // Colocated runs the prompts' prefill iterations between the decode steps.
    assert!(co_shared > 1.5 * co_alone, "colocated {co_alone} → {co_shared}");
    // ExpertPlex's decode servers keep iterating; under contention APK holds
    // q' = ⌈q·x/x*⌉ SMs for decode, sized so that decode's MoE takes what the
    // search budgeted: the TPOT stays inside the SLO.
    let tpot = f.spec.deploys[0].slo.tpot;
    eprintln!("colocated {co_alone} → {co_shared}; expertplex {xp_alone} → {xp_shared}");
    assert!(xp_shared > xp_alone && xp_shared <= tpot, "expertplex {xp_alone} → {xp_shared}");
    assert!(co_shared > tpot, "colocated {co_shared}");
}

#[test]
fn apk_preemption_waits_at_most_one_tile_and_q_scales_with_the_footprint() {
    let f = fixture("minimax-m2-h800");
    let b = f.bench();
    let e = &b.env;
    let side = MoeSide::Ep { gpus: 4, nodes: 1, replicas: 1, local: 1.0, disaggregated: true };
    let sms = f64::from(e.cm.sms);
    let alone = e.moe(512.0, side, false, Sms { alone: 99.0, shared: 99.0, contention: 0.0, preempt: 0.0 });
    let contended =
        e.moe(512.0, side, false, Sms { alone: sms, shared: 99.0, contention: 1.0, preempt: e.tile_seconds });
    // Under contention decode holds q SMs and starts within one prefill tile.
    assert!((contended - alone - e.tile_seconds).abs() < 1e-12);
    assert!(e.tile_seconds > 0.0 && e.tile_seconds < 1e-4, "{}", e.tile_seconds);
    // More decode rows → larger footprint → larger q' (Eq. 4).
    let xp = one(&b, System::ExpertPlex);
    let Phases::Split { sharing: Sharing::Apk { x_star, .. }, .. } = xp.phases else { panic!() };
    assert!(x_star > 0.0);
    assert!(e.decode_footprint(64.0, side) < e.decode_footprint(4096.0, side));
}

#[test]
fn chunked_prefill_pays_for_every_chunk() {
    let f = fixture("minimax-m2-h800");
    let b = f.bench();
    let long = [req(0.0, 16000, 2)];
    let ttft = |d: &Deployment| b.simulate(d, &long)[0].ttft.unwrap();
    let whole = ttft(&one(&b, System::Colocated));
    // The ExpertPlex evaluation's configuration: `--chunked-prefill-size 2048`
    // over DP8, which SGLang divides into 256 tokens a rank.
    let paper = one(&b, System::ChunkedPrefill);
    assert_eq!(paper.label, "DP8EP8 chunk 2048 (256 a rank)");
    let Phases::Unified { chunked_prefill: Some(total), .. } = paper.phases else { panic!("{:?}", paper.phases) };
    assert_eq!(total, 2048.0);
    let at = |total: f64| {
        let mut d = paper.clone();
        if let Phases::Unified { chunked_prefill, .. } = &mut d.phases {
            *chunked_prefill = Some(total);
        }
        ttft(&d)
    };
    let chunked: Vec<(f64, f64)> = [2048.0, 8192.0, 32768.0].iter().map(|&c| (c, at(c))).collect();
    // Each chunk re-reads the weights and its prefix KV, and each prefill
    // iteration runs eagerly: smaller chunks, longer prefill.
    for w in chunked.windows(2) {
        assert!(w[0].1 > w[1].1, "{chunked:?}");
    }
    assert!(chunked[0].1 > whole, "{chunked:?} vs whole {whole}");
    // A prompt of 16000 tokens at 256 a step takes 63 eager prefill iterations.
    let e = &b.env;
    let host = (e.moe_layers + e.dense_layers) * e.cm.calib.eager_layer;
    assert!(chunked[0].1 >= 63.0 * host, "{chunked:?}, host floor {host}");
}

/// SGLang-PDMux's Green Contexts: a decode with nothing prefilling runs on
/// every SM; beside a long prompt's prefill it runs on the split PD-Multiplexing
/// chose for a decode batch of one, 20 of 132 SMs, and once that prefill is
/// done it has every SM again.
#[test]
fn pdmux_decode_runs_on_its_split_only_while_a_prefill_is_in_flight() {
    let f = fixture("minimax-m2-h800");
    let b = f.bench();
    let g = &one(&b, System::GreenContext);
    let Phases::Split { sharing: Sharing::PdMux(mux), decode, .. } = g.phases else { panic!("{:?}", g.phases) };
    assert_eq!(mux.split(1), (112.0, 20.0));
    // One step on the split's 20 SMs at the request's first context.
    let split_step = b
        .env
        .iteration(
            &[Load::decode(1.0, 301.0)],
            decode.width,
            20.0 / 132.0,
            decode.moe,
            Sms::fixed(20),
            0.0,
            decode.overlap,
        )
        .seconds;
    let alone = b.simulate(g, &[req(0.0, 300, 200)])[0].tpot.unwrap();
    assert!(alone < split_step, "lone TPOT {alone} vs a step on the split's 20 SMs {split_step}");
    // The same request, and a 16k-token prompt arriving once it decodes:
    // its steps slow while that prefill is in flight, and only then (a
    // split held for good would put the mean TPOT near the split's step).
    let beside = b.simulate(g, &[req(0.0, 300, 200), req(0.5, 16000, 2)])[0].tpot.unwrap();
    assert!(beside > alone * 1.02, "TPOT beside a prefill {beside} vs alone {alone}");
    assert!(beside < (alone + split_step) / 2.0, "TPOT beside a prefill {beside}: the split outlived the prefill");
}

#[test]
fn moebius_beats_both_static_layouts_on_a_rollout_step() {
    let f = fixture("qwen3-235b-a22b-h200");
    let b = f.bench();
    let r = b.rollout(512, 7);
    let t = |s: System| r.iter().find(|x| x.system == s).unwrap().seconds;
    let (tp, ep, mo) = (t(System::StaticTp), t(System::StaticEp), t(System::Moebius));
    assert!(tp.is_finite() && ep.is_finite(), "{tp} {ep}");
    // EP clears the burst, TP the tail; switching once takes both.
    assert!(mo < tp.min(ep), "moebius {mo} vs tp {tp}, ep {ep}");
}

#[test]
fn every_request_is_served_once_and_in_order_of_its_own_timeline() {
    for name in ["minimax-m2-h800", "qwen3-235b-a22b-bursty"] {
        let f = fixture(name);
        let b = f.bench();
        let reqs = moeforge::runtime::sim::workload::requests(&f.spec.deploys[0].workload, 300, 20.0, 3);
        for s in System::ALL {
            let Ok(dep) = b.deployment(s) else { continue };
            let out = b.simulate(&dep, &reqs);
            for (r, o) in reqs.iter().zip(&out) {
                let (Some(ttft), Some(tpot), Some(fin)) = (o.ttft, o.tpot, o.finish) else {
                    panic!("{name} {s:?}: request {r:?} unserved: {o:?}")
                };
                assert!(ttft > 0.0 && tpot > 0.0, "{name} {s:?}: {o:?}");
                let first = r.arrival + ttft;
                assert!((fin - first - tpot * f64::from(r.output - 1)).abs() < 1e-6, "{name} {s:?}: {o:?}");
            }
        }
    }
}

#[test]
fn goodput_is_a_rate_that_meets_the_slos_and_results_are_deterministic() {
    let f = fixture("minimax-m2-h800");
    let b = f.bench();
    let probe = Probe { seconds: 20.0, seed: 5 };
    let dep = one(&b, System::ExpertPlex);
    let g = b.goodput(&dep, 5.0, probe);
    assert!(g > 0.0);
    assert!(b.point(&dep, g, probe).attainment >= 0.9);
    assert_eq!(g, b.goodput(&dep, 5.0, probe));
    // Far above it the SLOs fail for most requests.
    let over = b.point(&dep, 4.0 * g, probe);
    assert!(over.attainment < 0.9, "{over:?}");
    let slo = &f.spec.deploys[0].slo;
    assert_eq!(attainment(slo, &[]), 0.0);
}

#[test]
fn a_profile_with_negative_latencies_is_refused() {
    use moeforge::codegen::{plan_deployment_with, PlanOptions};
    use moeforge::plan::cost::{Profile, ProfileSample, Sample};
    let checked = check_paths(&[common::root().join("examples/minimax-m2-h800.moe")], &FsLoader)
        .unwrap_or_else(|f| panic!("{}", f.render(false)));
    // A fit that falls below zero at large footprints: t = 1e-4 − 1e-8·x.
    let samples = (1..10)
        .map(|x| ProfileSample {
            component: "moe".into(),
            sample: Sample { x: f64::from(x), s: 0.0, t: 1e-4 - 1e-8 * f64::from(x) },
        })
        .collect();
    let opts = PlanOptions { profile: Some((Profile { samples }, "neg".into())), ..PlanOptions::default() };
    // The compile refuses it (as it refuses a negative or non-finite sample).
    let err = format!(
        "{:?}",
        plan_deployment_with(&checked, DeployId(0), &opts).map(|_| ()).expect_err("the profile is refused")
    );
    assert!(err.contains("`moe`") && err.contains("non-negative"), "{err}");
    let bad = Sample { x: 1e200, s: 0.0, t: f64::INFINITY };
    let opts = PlanOptions {
        profile: Some((
            Profile { samples: vec![ProfileSample { component: "ffn".into(), sample: bad }] },
            "inf".into(),
        )),
        ..PlanOptions::default()
    };
    let err = format!(
        "{:?}",
        plan_deployment_with(&checked, DeployId(0), &opts).map(|_| ()).expect_err("the sample is refused")
    );
    assert!(err.contains("sample 0 (`ffn`") && err.contains("finite and non-negative"), "{err}");
    // So does the simulator, for a plan whose cost model was not compiled here.
    let planned =
        plan_deployment_with(&checked, DeployId(0), &PlanOptions::default()).unwrap_or_else(|d| panic!("{d:?}"));
    let mut plan = planned.plan().clone();
    plan.cost.moe = moeforge::plan::cost::Fit { alpha: 1e-4, beta: -1e-8, gamma: 0.0, delta: 0.0 };
    let spec = checked.spec.deployment(DeployId(0));
    let err = Bench::new(&spec, &plan).err().unwrap_or_default();
    assert!(err.contains("`moe`") && err.contains("non-negative"), "{err}");
}

#[test]
fn sensitivity_moves_one_constant_at_a_time_and_memory_bound_decode_follows_bandwidth() {
    let f = fixture("minimax-m2-h800");
    let b = f.bench();
    let probe = Probe { seconds: 10.0, seed: 1 };
    let rows = b
        .sensitivity(&[System::ExpertPlex, System::Colocated, System::StaticTp], probe, &[0.8, 1.2], Default::default())
        .unwrap();
    let n = moeforge::plan::cost::Calibration::published().entries().len();
    assert_eq!(rows.len(), 1 + 2 * n);
    // Systems that cannot run here (no TP mode) are left out, not reported as zero.
    assert!(rows
        .iter()
        .all(|r| r.goodput.iter().map(|g| g.0).collect::<Vec<_>>() == [System::ExpertPlex, System::Colocated]));
    let xp = |name: &str, factor: f64| {
        rows.iter().find(|r| r.constant == Some(name) && r.factor == factor).unwrap().goodput[0].1
    };
    // ExpertPlex's decode streams expert weights: more bandwidth, more goodput.
    assert!(xp("gemm_memory_efficiency", 1.2) > rows[0].goodput[0].1);
    assert!(xp("gemm_memory_efficiency", 0.8) < rows[0].goodput[0].1);
    let table = moeforge::runtime::sim::report::sensitivity_table(&rows, 1);
    assert_eq!(table.lines().count(), rows.len() + 2, "{table}");
}

/// The sweep carries Moebius's bursty-trace figures in every row, each on
/// that row's constants, so Moebius's published conclusions can be checked
/// under every move (`simulate --bursty --sensitivity`).
#[test]
fn the_sensitivity_sweep_replays_the_bursty_trace_on_every_rows_constants() {
    use moeforge::runtime::sim::report::{claims, BurstyMeasures, Claim, MoebiusRuns, MOEBIUS_CLAIMS};
    let f = fixture("qwen3-235b-a22b-bursty");
    let b = f.bench();
    let runs = MoebiusRuns { rollout: None, bursty: true, seed: 1 };
    let rows = b.sensitivity(&[], Probe { seconds: 10.0, seed: 1 }, &[0.8, 1.2], runs).unwrap();
    let n = moeforge::plan::cost::Calibration::published().entries().len();
    assert_eq!(rows.len(), 1 + 2 * n);
    assert!(rows.iter().all(|r| r.goodput.is_empty() && r.moebius.rollout_gain.is_none()));
    // The published row is the bench's own bursty trace.
    assert_eq!(rows[0].moebius.bursty, BurstyMeasures::of(&b.bursty(1)));
    let quiet = |name: &str, factor: f64| {
        let r = rows.iter().find(|r| r.constant == Some(name) && r.factor == factor).unwrap();
        r.moebius.bursty.unwrap().quiet_tpot
    };
    // Quiet-period decode streams expert weights: more HBM bandwidth, lower
    // TPOT for static TP and static EP (memory-bound decode GEMMs).
    let (slow, fast) = (quiet("gemm_memory_efficiency", 0.8), quiet("gemm_memory_efficiency", 1.2));
    assert!(fast[0] < slow[0] && fast[1] < slow[1], "{slow:?} {fast:?}");
    // Every bursty claim gets a verdict on every row; the rollout one needs --rollout.
    for claim in MOEBIUS_CLAIMS {
        let want_verdict = !matches!(claim, Claim::RolloutGain { .. });
        assert!(rows.iter().all(|r| claim.holds(r, 1).is_some() == want_verdict), "{claim:?}");
    }
    assert_eq!(claims(&rows, &MOEBIUS_CLAIMS, 1).len(), MOEBIUS_CLAIMS.len());
}

#[test]
fn a_step_with_prompt_tokens_runs_eagerly() {
    let f = fixture("minimax-m2-h800");
    let b = f.bench();
    let e = &b.env;
    let side = MoeSide::Ep { gpus: 8, nodes: 1, replicas: 1, local: 1.0, disaggregated: false };
    let sms = Sms::all(e.cm.sms);
    let decode = Load::decode(4.0, 4000.0);
    let prompt = Load::prompts(1.0, 512.0);
    let graph = e.iteration(&[decode], 1, 1.0, side, sms, 0.0, Overlaps::STANDARD).seconds;
    let eager = e.iteration(&[prompt], 1, 1.0, side, sms, 0.0, Overlaps::STANDARD).seconds;
    let host = (e.moe_layers + e.dense_layers) * e.cm.calib.eager_layer;
    assert!(eager >= host && graph < host, "graph {graph}, eager {eager}, host floor {host}");
}

#[test]
fn placement_is_evaluated_under_skewed_loads() {
    use moeforge::dsl::spec::PlacementPolicy;
    let probe = Probe { seconds: 20.0, seed: 1 };
    let f = fixture("minimax-m2-h800");
    let rs = f.bench().placements(probe).unwrap();
    let get =
        |rs: &[moeforge::runtime::sim::report::PlacementResult], p| rs.iter().find(|r| r.policy == p).unwrap().clone();
    // The replicas sit on the role plan's MoE servers: ExpertPlex is what runs under them.
    assert!(rs.iter().all(|r| r.system == System::ExpertPlex), "{rs:?}");
    // Zipf popularity without replicas leaves one MoE server far above the
    // mean, which costs goodput; EPLB's replicas even it out.
    let (uniform, none, eplb) =
        (get(&rs, None), get(&rs, Some(PlacementPolicy::None)), get(&rs, Some(PlacementPolicy::Eplb)));
    assert_eq!(uniform.busiest, 1.0);
    assert!(none.busiest > 1.5 && eplb.busiest < none.busiest, "{none:?} {eplb:?}");
    assert!(none.goodput < uniform.goodput && eplb.goodput > none.goodput, "{uniform:?} {none:?} {eplb:?}");
    // Across nodes Zepp serves more rows on the sender's node than EPLB, and that shows in goodput.
    let f = fixture("glm-5-h800x24");
    let rs = f.bench().placements(probe).unwrap();
    let (uniform, eplb, zepp) =
        (get(&rs, None), get(&rs, Some(PlacementPolicy::Eplb)), get(&rs, Some(PlacementPolicy::Zepp)));
    // EPLB routes uniformly over replicas spread like the stripes: the
    // uniform layout's locality, seen from the attention servers.
    assert!((eplb.local - uniform.local).abs() < 1e-9, "{uniform:?} {eplb:?}");
    assert!(zepp.local > eplb.local + 0.1, "{zepp:?} {eplb:?}");
    // Zepp's busiest MoE server is no lighter than EPLB's, so its higher
    // goodput comes from the rows it keeps on the sender's node.
    assert!(zepp.busiest >= eplb.busiest, "{zepp:?} {eplb:?}");
    assert!(zepp.goodput > eplb.goodput, "{zepp:?} {eplb:?}");
    // A plan without roles places for colocated serving, and is evaluated there.
    let f = fixture("deepseek-v3-h100x32");
    let rs = f.bench().placements(probe).unwrap();
    assert!(rs.iter().all(|r| r.system == System::Colocated), "{rs:?}");
    let (none, eplb) = (get(&rs, Some(PlacementPolicy::None)), get(&rs, Some(PlacementPolicy::Eplb)));
    assert!(eplb.busiest < none.busiest && eplb.goodput > none.goodput, "{none:?} {eplb:?}");
}

/// Virtual-lane priority (ExpertPlex §5): where prefill's rows take a direct
/// scale-out path decode also uses, prefill on a lower-priority lane leaves
/// decode's transfers unstretched; on a FIFO link (one lane) decode's
/// transfers stretch by prefill's link duty. GLM-5 on 3×8 H800 with half of
/// prefill's MoE traffic on shared links, a decoding request among a stream
/// of long prompts.
#[test]
fn virtual_lanes_keep_prefill_traffic_from_slowing_decode() {
    let f = fixture("glm-5-h800x24");
    let b = f.bench();
    let xp = one(&b, System::ExpertPlex);
    let with = |lanes: bool, shared: f64| {
        let mut d = xp.clone();
        let Phases::Split { sharing: Sharing::Apk { lanes: l, shared: s, .. }, .. } = &mut d.phases else { panic!() };
        (*l, *s) = (lanes, shared);
        d
    };
    let mut reqs = vec![req(0.0, 200, 200)];
    reqs.extend((0..200).map(|i| req(0.1 + 0.05 * f64::from(i), 8000, 2)));
    let run = |d: &Deployment| {
        let out = b.simulate(d, &reqs);
        let ttft: f64 = out[1..].iter().filter_map(|o| o.ttft).sum::<f64>() / (out.len() - 1) as f64;
        (out[0].tpot.unwrap(), ttft)
    };
    let (isolated, lanes, fifo) = (run(&with(true, 0.0)), run(&with(true, 0.5)), run(&with(false, 0.5)));
    eprintln!("decode TPOT / mean prompt TTFT: isolated {isolated:?}, two lanes {lanes:?}, one lane {fifo:?}");
    // Decode: not slowed with lanes (prefill's stretched transfers shift when
    // its MoE work contends, which moves decode's TPOT by a hair either way),
    // slower on a FIFO link.
    assert!(lanes.0 <= 1.01 * isolated.0, "lanes {} vs isolated {}", lanes.0, isolated.0);
    assert!(fifo.0 > lanes.0, "FIFO {} vs lanes {}", fifo.0, lanes.0);
    // Prefill pays for sharing the link either way.
    assert!(lanes.1 >= isolated.1 && fifo.1 >= isolated.1);
}

/// The simulator's ExpertPlex system is the compiled role plan: its
/// prefill/decode/MoE counts, q and overlap are the plan's roles, and its
/// decode servers hold the compiled memory plan's KV pool.
#[test]
fn the_simulated_expertplex_system_is_the_compiled_role_plan() {
    use moeforge::plan::roles::Role;
    let f = fixture("glm-5-h800x24");
    let plan = f.planned.plan();
    let roles = plan.roles.as_ref().expect("glm-5-h800x24 realizes ExpertPlex roles");
    let d = one(&f.bench(), System::ExpertPlex);
    let n = |r: Role| roles.ranks(r).len();
    let o = roles.overlap;
    assert_eq!(
        d.label,
        format!(
            "{}P{}D{}E q={} dp/{} dp/{}",
            n(Role::Prefill),
            n(Role::Decode),
            n(Role::Moe),
            roles.q,
            o.prefill.name(),
            o.decode.name()
        )
    );
    let kv = &plan.memory.kv;
    assert_eq!(d.decode_kv_tokens, (n(Role::Decode) as u64 * kv.ep.pages * u64::from(kv.page_tokens)) as f64);
    // A plan whose roles are another layout (the search's runner-up) is not
    // what the simulator models, and it says so rather than modeling the
    // search's best on that plan's memory.
    let other = plan.search.as_ref().unwrap().ranked.iter().find(|c| c.per_node != roles.per_node).unwrap();
    let mut edited = plan.clone();
    edited.roles.as_mut().unwrap().per_node = other.per_node.clone();
    let err = Bench::new(&f.spec, &edited).unwrap().deployment(System::ExpertPlex).unwrap_err();
    assert!(err.contains("not the layout search's best"), "{err}");
    // So is a plan whose schedule overlaps otherwise than the search chose.
    let mut edited = plan.clone();
    let r = edited.roles.as_mut().unwrap();
    r.overlap.decode = if r.overlap.decode == Overlap::Tbo { Overlap::Sbo } else { Overlap::Tbo };
    let err = Bench::new(&f.spec, &edited).unwrap().deployment(System::ExpertPlex).unwrap_err();
    assert!(err.contains("not the layout search's best"), "{err}");
}

/// The simulator's PD system is the compiled `pd-disagg` plan: the same
/// whole-model instances, its decode GPUs holding the compiled KV pool.
#[test]
fn the_simulated_pd_system_is_the_compiled_pd_plan() {
    use moeforge::plan::roles::Role;
    let f = fixture("glm-4.5-air-h200");
    let plan = f.planned.plan();
    let roles = plan.roles.as_ref().expect("glm-4.5-air-h200 realizes PD instances");
    let d = one(&f.bench(), System::PdDisagg);
    let unit = roles.ep_groups[0].len();
    let of = |r: Role| roles.ep_groups.iter().filter(|g| roles.gpus[g[0] as usize] == r).count();
    assert_eq!(d.label, format!("{}P{}D × DP{unit}EP{unit}", of(Role::Prefill), of(Role::Decode)));
    let kv = &plan.memory.kv;
    let decode_gpus = roles.ranks(Role::Decode).len() as u64;
    assert_eq!(d.decode_kv_tokens, (decode_gpus * kv.ep.pages * u64::from(kv.page_tokens)) as f64);
}

/// `strategy = auto` weighs the strategies with Eq. 1-style estimates on
/// the cost model; its colocated estimate (prefill-first cycles) and its PD
/// estimate (Eq. 1 over the instances, the KV handoff in decode's budget)
/// are checked against a different method, the simulator's discrete-event
/// P90 goodput on Poisson arrivals and sampled ShareGPT lengths: within 2×,
/// and ExpertPlex ahead of both in each. MiniMax-M2 without its replicated
/// placement, which PD plans refuse.
#[test]
fn autos_estimates_track_the_simulator() {
    let root = common::root();
    let text = std::fs::read_to_string(root.join("examples/minimax-m2-h800.moe"))
        .unwrap()
        .replace("strategy = expertplex", "strategy = auto")
        .replace("placement { policy = zepp  redundant_experts = 32 }", "")
        .replace("\"../models/", &format!("\"{}/models/", root.display()));
    assert!(text.contains("strategy = auto") && !text.contains("placement"));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("auto.moe");
    std::fs::write(&path, text).unwrap();
    let f = common::sim_fixture::load(path.to_str().unwrap());
    let plan = f.planned.plan();
    let alt = &plan.search.as_ref().unwrap().alternatives;
    let estimate = |s: moeforge::dsl::spec::Strategy| alt.iter().find(|a| a.strategy == s).unwrap().goodput;
    use moeforge::dsl::spec::Strategy;
    assert_eq!(alt[0].strategy, Strategy::Expertplex, "{alt:?}");
    assert!(plan.roles.as_ref().is_some_and(|r| r.moe_servers()), "auto realizes the ExpertPlex roles it chose");
    let b = f.bench();
    let probe = Probe { seconds: 20.0, seed: 5 };
    let sim = |s: System| {
        let dep = one(&b, s);
        b.goodput(&dep, 2.0, probe)
    };
    let (colocated, expertplex, pd) = (sim(System::Colocated), sim(System::ExpertPlex), sim(System::PdDisagg));
    let ratio = estimate(Strategy::Colocated) / colocated;
    let pd_ratio = estimate(Strategy::PdDisagg) / pd;
    eprintln!(
        "colocated: estimate {:.2} req/s, simulated {colocated:.2} (×{ratio:.2}); PD: estimate {:.2}, simulated \
         {pd:.2} (×{pd_ratio:.2}); ExpertPlex simulated {expertplex:.2}",
        estimate(Strategy::Colocated),
        estimate(Strategy::PdDisagg)
    );
    assert!((0.5..=2.0).contains(&ratio), "estimate ×{ratio} of the simulated colocated goodput");
    assert!((0.5..=2.0).contains(&pd_ratio), "estimate ×{pd_ratio} of the simulated PD goodput");
    assert!(expertplex > colocated && expertplex > pd);
}
