//! Anchors: published measurements the cost model and the simulator must
//! reproduce from their mechanisms, each with the paper's setup and a stated
//! tolerance (±20% unless argued otherwise at the test). The constants the
//! model uses (`moeforge_plan::cost::Calibration`, each citing its source)
//! come from *other* figures than the ones pinned here: where one table both
//! sets a constant and is pinned, the test says which entry set it and pins
//! only the others.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::sim_fixture::{fixture, load, Fixture};
use moeforge::plan::cost::step::{Env, Load, MoeSide, Overlaps, Sms};
use moeforge::plan::cost::{CostModel, Links};
use moeforge::plan::memory::Workspace;
use moeforge::runtime::sim::report::Probe;
use moeforge::runtime::sim::{Bench, System};

fn cost(f: &Fixture) -> &CostModel {
    &f.planned.plan().cost
}

/// The shared quantities with the papers' DeepGEMM prefill tile: ExpertPlex
/// §4.1, "CTA tiles of at most a 128×192 output block with a 128-wide reduction tile".
fn env_with_paper_tiles(f: &Fixture) -> Env {
    let d = &f.spec.deploys[0];
    let (m, c) = (f.spec.model(d.model), f.spec.cluster(d.cluster));
    let mut t = f.spec.tile_set(d.tiles).clone();
    t.prefill.gate_up.block_n = 192;
    let ws = Workspace::of(m, false).bytes();
    Env::new(m, c, &t, d, &CostModel::roofline(m, c, &t), ws)
}

/// `got` within `tol` (a fraction) of the published `want`.
fn near(what: &str, got: f64, want: f64, tol: f64) {
    let err = got / want - 1.0;
    assert!(
        err.abs() <= tol,
        "{what}: modeled {got:.4e}, published {want:.4e} ({:+.0}%, tolerance ±{:.0}%)",
        err * 100.0,
        tol * 100.0
    );
    eprintln!("{what}: modeled {got:.4e}, published {want:.4e} ({:+.1}%)", err * 100.0);
}

/// DeepEP V1's low-latency kernels on H800 (README): 128 tokens per rank,
/// 7168 wide, top-8, fp8 dispatch (7168 + 56·4 scale bytes per row), bf16
/// combine, one 400 Gb/s CX7 per GPU, each (token, expert) pair sent
/// directly. `comm_floor` was set from the EP256 dispatch entry and
/// `rdma_efficiency` from the normal kernels' EP16 figure; every other entry
/// is pinned here. EP8 runs inside one node, over NVLink.
#[test]
fn deepep_low_latency_table() {
    let f = fixture("glm-5-h800x24");
    let mut cm = cost(&f).clone();
    cm.links = Links {
        scale_up_bw: 200e9,
        scale_up_latency: 2e-6,
        scale_out_bw: 50e9,
        scale_out_latency: 5e-6,
        nodes: 1,
        gpus_per_node: 8,
    };
    let (tokens, k) = (128.0, 8.0);
    let (fp8_row, bf16_row) = (7168.0 + 56.0 * 4.0, 7168.0 * 2.0);
    let one_way = |row: f64, ep: f64| {
        let nodes = (ep / 8.0).max(1.0);
        cm.dispatch(tokens, row, k, ep, nodes, 1.0 / nodes, false)
    };
    for (ep, dispatch, combine) in [
        (8.0, 77e-6, 114e-6),
        (16.0, 118e-6, 195e-6),
        (32.0, 155e-6, 273e-6),
        (64.0, 173e-6, 314e-6),
        (128.0, 192e-6, 369e-6),
    ] {
        near(&format!("DeepEP LL dispatch EP{ep}"), one_way(fp8_row, ep), dispatch, 0.2);
        near(&format!("DeepEP LL combine EP{ep}"), one_way(bf16_row, ep), combine, 0.2);
    }
    near("DeepEP LL combine EP256", one_way(bf16_row, 256.0), 360e-6, 0.2);
}

/// ExpertPlex §4.1: with EP4 on MiniMax-M2, decode grouped GEMMs with eight
/// active experts take 17.7–34.7 µs: Down (a third of an expert's weights)
/// is the short end, GateUp (two thirds) the long one. `gemm_memory_efficiency`
/// was set from the GateUp figure, so only Down is pinned, and what that pins
/// is narrow: the model charges an expert's GEMMs together and this test
/// takes a third of them as Down, so it checks the paper's Down/GateUp ratio
/// (0.51) against the weight-byte ratio (1/2) that a memory-bound decode
/// GEMM implies, plus the model's first-tile rule, the rows' activation
/// traffic and the kernel's fixed cost around the constant. The independent
/// checks of the constant are the Moebius steps below.
#[test]
fn expertplex_decode_gemms_with_eight_active_experts() {
    let f = fixture("minimax-m2-h800");
    let cm = cost(&f);
    let m_t = f64::from(cm.m_t_decode);
    // GateUp + Down of 8 experts, 8 rows each (one tile per expert), on every SM.
    let both = cm.moe_seconds(8.0, 8.0, 64.0, m_t, 1.0, f64::from(cm.sms)) - cm.moe.alpha;
    eprintln!(
        "MiniMax-M2 EP4 decode GateUp, 8 experts (sets the constant): modeled {:.4e}, published 3.47e-5",
        both * 2.0 / 3.0
    );
    near("MiniMax-M2 EP4 decode Down, 8 experts", both / 3.0, 17.7e-6, 0.2);
}

/// ExpertPlex Fig. 15: every MiniMax-M2 MoE GEMM reaches a tile boundary
/// within 10.7 µs: the prefill GateUp tile (the longest) on one SM, with
/// the paper's 128×192 tile.
#[test]
fn expertplex_gemm_preemption_interval() {
    let f = fixture("minimax-m2-h800");
    near("MiniMax-M2 GEMM preemption interval", env_with_paper_tiles(&f).tile_seconds, 10.7e-6, 0.2);
}

/// ExpertPlex Fig. 12: under APK, a GLM-5-shaped decode grouped GEMM (128
/// tokens, eight active experts) launched while a prefill GEMM (8192 tokens)
/// runs is 1.08× slower than alone. Modeled: decode's clusters join after a
/// mean half prefill tile, and its weight stream does not slow on fewer SMs.
/// Tolerance ±0.04 on the ratio (half the published excess, read off a bar chart).
#[test]
fn apk_decode_slowdown_under_sharing() {
    let f = fixture("glm-5-h800x24");
    let e = env_with_paper_tiles(&f);
    let cm = &e.cm;
    let m_t = f64::from(cm.m_t_decode);
    let x = 8.0 * (128.0 / m_t).ceil();
    let alone = cm.moe_seconds(x, 8.0, 1024.0, m_t, 1.0, f64::from(cm.sms));
    let q = f64::from(moeforge::plan::cost::q_max(cm.sms, cm.cluster));
    let shared = cm.moe_seconds(x, 8.0, 1024.0, m_t, 1.0, q) + e.tile_seconds / 2.0;
    let slowdown = shared / alone;
    eprintln!("APK decode slowdown under sharing: modeled {slowdown:.3}, published 1.08");
    assert!((slowdown - 1.08).abs() <= 0.04, "APK decode slowdown {slowdown:.3} (published 1.08)");
}

/// One decode iteration of `b` requests with `ctx` cached tokens each on
/// Qwen3-235B-A22B, 8×H200: TP8 (one group), or DP8 attention + EP8.
fn qwen3_steps(b: &Bench, batch: f64, ctx: f64) -> (f64, f64) {
    let e = &b.env;
    let tp = e.iteration(
        &[Load::decode(batch, batch * ctx)],
        8,
        1.0,
        MoeSide::Tp { width: 8 },
        Sms::all(e.cm.sms),
        0.0,
        Overlaps::STANDARD,
    );
    let side = MoeSide::Ep { gpus: 8, nodes: 1, replicas: 1, local: 1.0, disaggregated: false };
    let loads: Vec<Load> = (0..8).map(|_| Load::decode(batch / 8.0, batch / 8.0 * ctx)).collect();
    let ep = e.iteration(&loads, 1, 1.0, side, Sms::all(e.cm.sms), 0.0, Overlaps::STANDARD);
    (tp.seconds, ep.seconds)
}

/// Moebius §2 (Fig. 1, Fig. 3): Qwen3-235B-A22B on 8×H200 crosses from TP
/// to EP between global batch 128 and 256.
#[test]
fn moebius_tp_ep_crossover() {
    let f = fixture("qwen3-235b-a22b-bursty");
    let b = f.bench();
    let (tp, ep) = qwen3_steps(&b, 128.0, 1000.0);
    assert!(tp < ep, "B = 128: TP {tp} should beat EP {ep}");
    let (tp, ep) = qwen3_steps(&b, 256.0, 1000.0);
    assert!(ep < tp, "B = 256: EP {ep} should beat TP {tp}");
}

/// Moebius §2.1 (Fig. 2): across global batches 8 to 2048, TP/TP wins by
/// 1.5× at small batches and DP/EP by 1.5× at large ones. Pinned at both
/// ends of the sweep (B = 8 and B = 2048; the paper gives no context length,
/// 1000 cached tokens as in the crossover anchor). The model's gap is the
/// narrower at both ends (1.25× and 1.30× at this commit, within ±20%); in
/// between, at the quiet period's ~111 requests, it is 1.02× where Moebius
/// measured 1.41× (the quiet-period anchor below).
#[test]
fn moebius_tp_and_ep_each_lead_by_1_5x_at_the_ends_of_the_batch_sweep() {
    let f = fixture("qwen3-235b-a22b-bursty");
    let b = f.bench();
    let (tp, ep) = qwen3_steps(&b, 8.0, 1000.0);
    near("Qwen3-235B B = 8: EP step over TP step", ep / tp, 1.5, 0.2);
    let (tp, ep) = qwen3_steps(&b, 2048.0, 1000.0);
    near("Qwen3-235B B = 2048: TP step over EP step", tp / ep, 1.5, 0.2);
}

/// Moebius §6.2: in the bursty trace's quiet period (1–5 req/s, prompts of
/// 300–700 tokens, outputs of 800–1200) static TP decodes at 37 ms per
/// token. Setup: 3 req/s × ~1000 outputs × 37 ms ≈ 111 requests in flight
/// (Little's law), each ~1000 tokens cached on average.
///
/// The same period's EP TPOT (52 ms) is *not* met: the model gives ~33 ms,
/// barely above TP's. `moeforge simulate examples/qwen3-235b-a22b-bursty.moe
/// --bursty --sensitivity` checks that conclusion (static EP 1.41× static
/// TP in the quiet period, ±20%) under every one-constant move: only
/// moves far outside the published ranges restore it (README, "Simulate
/// serving").
#[test]
fn moebius_quiet_period_tp_tpot() {
    let f = fixture("qwen3-235b-a22b-bursty");
    let b = f.bench();
    let (tp, ep) = qwen3_steps(&b, 111.0, 1000.0);
    eprintln!("Qwen3-235B DP8EP8 quiet-period step (not pinned): modeled {ep:.4e}, published 5.2e-2");
    near("Qwen3-235B TP8 quiet-period TPOT", tp, 37e-3, 0.2);
}

/// Moebius §6.4: the EP→TP expert-weight reshard of Qwen3-235B-A22B on
/// 8×H200 takes 152 ms.
#[test]
fn moebius_weight_reshard() {
    let f = fixture("qwen3-235b-a22b-h200");
    let plan = f.planned.plan();
    let rs = plan.memory.reshard.as_ref().expect("the dual-mode plan has a reshard");
    near("Qwen3-235B EP→TP weight reshard", plan.cost.reshard_seconds(&rs.ep_to_tp, &plan.memory), 152e-3, 0.2);
}

/// ExpertPlex §7.2 (Fig. 7), MiniMax-M2 on ShareGPT, one 8×H800 node:
/// ExpertPlex is ahead of instance-level PD (2.01×), colocated (2.72×) and
/// chunked prefill (5.65×). The order is pinned; the modeled ratios are
/// printed by `moeforge simulate` beside the published ones.
#[test]
fn expertplex_leads_pd_colocated_and_chunked_on_minimax_sharegpt() {
    let f = fixture("minimax-m2-h800");
    leads(&f.bench(), &[System::PdDisagg, System::Colocated, System::ChunkedPrefill]);
}

/// Moebius §6.2's bursty trace on Qwen3-235B-A22B, 8×H200: Moebius runs EP
/// through each burst and TP through the quiet period, so it switches four
/// times (TP→EP→TP→EP→TP), its quiet-period TPOT tracks TP's (±20%) and its
/// burst TTFT (the higher burst's peak mean over 10 s bins of arrivals, the
/// statistic §6.2 reports) stays below TP's. The published burst TTFTs are
/// not met: TP's peaks are ~49 and ~6 s against the paper's "reaches
/// 9.9 s" (its p99 ~51 and ~48 s against 90 s at burst onset), and EP and Moebius
/// admit a burst at once with SGLang's estimated admission (peaks of
/// 0.1–0.2 s against the paper's 2.0 and 3.1 s; README, "Simulate serving").
#[test]
fn moebius_bursty_trace() {
    let f = fixture("qwen3-235b-a22b-bursty");
    let b = f.bench();
    let rs = b.bursty(1);
    let get = |s: System| rs.iter().find(|r| r.system == s).unwrap();
    let (tp, ep, mo) = (get(System::StaticTp), get(System::StaticEp), get(System::Moebius));
    assert_eq!((tp.switches, ep.switches, mo.switches), (0, 0, 4));
    near("Moebius quiet-period TPOT against static TP's", mo.quiet_tpot, tp.quiet_tpot, 0.2);
    assert!(mo.burst_ttft() < tp.burst_ttft(), "moebius {:?} vs tp {:?}", mo.burst_peak, tp.burst_peak);
    for r in [tp, ep, mo] {
        eprintln!(
            "{}: burst TTFT peak {:.2} / {:.2} s, p99 {:.2} / {:.2} s",
            r.system.name(),
            r.burst_peak[0],
            r.burst_peak[1],
            r.burst_p99[0],
            r.burst_p99[1]
        );
    }
}

/// Moebius §6.3 (Fig. 10): on nine RL rollout steps of 2048 DeepMath prompts
/// on Qwen3-235B-A22B, 8×H200 (rollout policy: start in EP, T_h = T_l = 256,
/// W = 1), Moebius is the fastest at every step and beats the better static
/// layout by 1.16–1.25×, mean 1.22×. Nine seeded steps stand in for the
/// paper's nine; each must be won, and the mean gain is pinned at ±20%
/// (1.12× at this commit, per step 1.08–1.16×: the model's EP wins every step,
/// where the paper's TP won the heaviest-tailed ones).
#[test]
fn moebius_rollout_gain_over_the_better_static_layout() {
    let f = fixture("qwen3-235b-a22b-h200");
    let b = f.bench();
    let gains: Vec<f64> = (1..=9)
        .map(|seed| {
            let rs = b.rollout(2048, seed);
            moeforge::runtime::sim::report::rollout_gain(&rs).unwrap_or_else(|| panic!("step {seed}: {rs:?}"))
        })
        .collect();
    assert!(gains.iter().all(|&g| g > 1.0), "Moebius lost a step: {gains:?}");
    near(
        "Qwen3-235B rollout: Moebius over the better static layout (mean of 9 steps)",
        gains.iter().sum::<f64>() / 9.0,
        1.22,
        0.2,
    );
}

/// ExpertPlex §7.2 (Fig. 7), MiniMax-M2 on ShareGPT, one 8×H800 node:
/// ExpertPlex's P90 goodput is 2.01× instance-level PD's (1P1D × DP4EP4).
/// PD loses by duplicating the experts: each decode GPU holds a quarter of
/// the routed experts beside every non-routed weight, leaving KV for about
/// 20k tokens, so its decode batch is KV-bound. 30 s probes; seeds 1–3 give
/// 2.28×, 2.16× and 1.96×.
#[test]
fn expertplex_over_pd_on_minimax_sharegpt() {
    let f = fixture("minimax-m2-h800");
    let g = f.bench().goodputs(&[System::ExpertPlex, System::PdDisagg], Probe { seconds: 30.0, seed: 1 });
    near("MiniMax-M2 ShareGPT: ExpertPlex goodput over PD's", g[0].1 / g[1].1, 2.01, 0.2);
}

/// ExpertPlex §7.2 (Fig. 8), MiniMax-M2 on LooGLE (TTFT 10 s, TPOT 100 ms):
/// ExpertPlex's goodput is 1.28× SGLang-PDMux's (Green Contexts under
/// SGLang's PD-Multiplexing splits, TP8EP8), lengths capped at PD's KV
/// capacity (§7.1). 30 s probes; seeds 1–3 give 1.14×, 1.17× and 1.18×. (On
/// ShareGPT the model puts PDMux slightly ahead, 0.86× against the paper's
/// 1.41×: README, "Simulate serving".)
#[test]
fn expertplex_over_green_context_on_minimax_loogle() {
    let f = paper_fixture("minimax-m2-h800-loogle");
    let g = f.bench().goodputs(&[System::ExpertPlex, System::GreenContext], Probe { seconds: 30.0, seed: 1 });
    near("MiniMax-M2 LooGLE: ExpertPlex goodput over Green Context's", g[0].1 / g[1].1, 1.28, 0.2);
}

fn paper_fixture(name: &str) -> Fixture {
    load(&format!("examples/papers/{name}.moe"))
}

/// ExpertPlex's goodput is above each of `systems`'; returns them all,
/// ExpertPlex's first.
fn leads(b: &Bench, systems: &[System]) -> Vec<(System, f64)> {
    let all: Vec<System> = std::iter::once(System::ExpertPlex).chain(systems.iter().copied()).collect();
    let g = b.goodputs(&all, Probe { seconds: 30.0, seed: 1 });
    for &(s, gs) in &g[1..] {
        assert!(g[0].1 > gs, "expertplex {:.3} req/s vs {} {gs:.3}", g[0].1, s.name());
    }
    g
}

/// ExpertPlex Fig. 9, GLM-5 on ShareGPT, 3×8 H800: ahead of colocated
/// (1.5×) and chunked prefill (3.3×). PD cannot hold two instances on 24
/// GPUs (as in the paper). The modeled PDMux is ahead (paper: parity).
#[test]
fn expertplex_leads_on_glm5_sharegpt() {
    let f = fixture("glm-5-h800x24");
    leads(&f.bench(), &[System::Colocated, System::ChunkedPrefill]);
}

/// ExpertPlex Fig. 8, MiniMax-M2 on LooGLE: ahead of colocated (4.12×) and
/// chunked prefill, which "cannot sustain the SLO over the evaluated load
/// range" (0–2.5 req/s/node): its modeled P90 goodput is below the first
/// non-zero rate the figure labels, 0.5 req/s. Each LooGLE prompt takes dozens of
/// 256-token prefill iterations a rank, each eager, and decode waits for
/// every one (TPOT past 100 ms).
#[test]
fn expertplex_leads_colocated_and_chunked_on_minimax_loogle() {
    let f = paper_fixture("minimax-m2-h800-loogle");
    let g = leads(&f.bench(), &[System::Colocated, System::ChunkedPrefill]);
    assert!(g[2].1 < 0.5, "chunked prefill sustains {:.3} req/s on LooGLE", g[2].1);
}

/// ExpertPlex §7.2 (Fig. 7), MiniMax-M2 on ShareGPT: ExpertPlex's goodput is
/// 5.65× SGLang-ChunkedPrefill's (Chunk=2048 over DP8EP8: SGLang divides
/// `--chunked-prefill-size` by the DP size, 256 prompt tokens a rank per
/// prefill iteration, not mixed with decode). Each chunk is an eager
/// iteration that re-reads the weights and its prefix KV while decode
/// waits. 30 s probes; seeds 1–3 give 5.68×, 6.36× and 4.88×.
#[test]
fn expertplex_over_chunked_prefill_on_minimax_sharegpt() {
    let f = fixture("minimax-m2-h800");
    let g = f.bench().goodputs(&[System::ExpertPlex, System::ChunkedPrefill], Probe { seconds: 30.0, seed: 1 });
    near("MiniMax-M2 ShareGPT: ExpertPlex goodput over chunked prefill's", g[0].1 / g[1].1, 5.65, 0.2);
}

/// ExpertPlex Fig. 10, GLM-5 on LooGLE: ahead of colocated (2.5×) and
/// chunked prefill (5.0×).
#[test]
fn expertplex_leads_on_glm5_loogle() {
    let f = paper_fixture("glm-5-h800x24-loogle");
    leads(&f.bench(), &[System::Colocated, System::ChunkedPrefill]);
}

/// ExpertPlex §7.1: lengths are capped at PD's KV capacity so every system
/// serves the same requests; on 24 GPUs GLM-5's PD cannot run, and nothing is capped.
#[test]
fn request_lengths_are_capped_at_pd_kv() {
    let f = paper_fixture("minimax-m2-h800-loogle");
    let b = f.bench();
    let cap = b.length_cap.expect("PD runs on one MiniMax node");
    let pd = b.deployment(System::PdDisagg).unwrap();
    let long = moeforge::runtime::sim::workload::Req { arrival: 0.0, input: 10 * cap as u32, output: 100 };
    let out = b.simulate(&pd, &[long]);
    assert!(out[0].ttft.is_some(), "a capped request is served, not refused: {:?}", out[0]);
    assert!(fixture("glm-5-h800x24").bench().length_cap.is_none());
}

/// ExpertPlex Fig. 12, the other partition: MPS leaves the GLM-5 prefill GEMM
/// (compute-bound, 8192 tokens) 1/3.33 of the SMs and slows the decode GEMM
/// (128 tokens, eight experts, memory-bound) 1.34×. `stream_sm_saturation`
/// was set from Green Context's pair (4.07×, 1.24×); this pins MPS's. The
/// pairing of the figure's bars is the one where the partition that starves
/// prefill more leaves decode more SMs and slows it less. Tolerance ±0.04 on
/// the ratio, as for the APK's slowdown.
#[test]
fn a_partitioned_decode_gemm_streams_at_its_share_of_the_sms() {
    let f = fixture("glm-5-h800x24");
    let e = env_with_paper_tiles(&f);
    let cm = &e.cm;
    let (sms, m_t) = (f64::from(cm.sms), f64::from(cm.m_t_decode));
    let x = 8.0 * (128.0 / m_t).ceil();
    let gemm = |q: f64| cm.moe_seconds(x, 8.0, 1024.0, m_t, 1.0, q) - cm.moe.alpha;
    let prefill = |q: f64| {
        let mp = f64::from(cm.m_t_prefill);
        cm.moe_seconds(8.0 * (8192.0 / mp).ceil(), 8.0, 65536.0, mp, 1.0, q) - cm.moe.alpha
    };
    let prefill_sms = sms / 3.33;
    // The prefill GEMM is compute-bound: its slowdown is the SM share it lost.
    near("MPS prefill GEMM slowdown", prefill(prefill_sms) / prefill(sms), 3.33, 0.05);
    let slowdown = gemm(sms - prefill_sms) / gemm(sms);
    eprintln!("MPS decode GEMM slowdown: modeled {slowdown:.3}, published 1.34");
    assert!((slowdown - 1.34).abs() <= 0.04, "MPS decode slowdown {slowdown:.3} (published 1.34)");
    // With every SM but one cluster (APK's Q_max) the stream is not slowed
    // (only the little compute of the experts' later tiles is).
    let q_max = f64::from(moeforge::plan::cost::q_max(cm.sms, cm.cluster));
    assert!(cm.calib.stream_sm_saturation * sms / q_max <= 1.0);
    assert!(gemm(q_max) / gemm(sms) < 1.02, "{}", gemm(q_max) / gemm(sms));
}
