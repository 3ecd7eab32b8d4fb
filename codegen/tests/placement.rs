//! Zepp placement and routing against no replication and EPLB, on the same
//! seeded histograms, with the modeled MoE-layer latency of each.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use moeforge_codegen::placement::*;
use moeforge_dsl::{check_paths, FsLoader};
use moeforge_plan::cost::CostModel;

fn cost_model() -> CostModel {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/kimi-k2-h100x32.moe");
    let c = check_paths(&[path], &FsLoader).unwrap();
    let d = &c.spec.deploys[0];
    CostModel::roofline(c.spec.model(d.model), c.spec.cluster(d.cluster), c.spec.tile_set(d.tiles))
}

fn check_placement(p: &Placement, experts: usize, per_gpu: usize) {
    assert!(p.gpus.iter().all(|g| g.len() == per_gpu), "uneven slots");
    for g in &p.gpus {
        let set: std::collections::BTreeSet<_> = g.iter().collect();
        assert_eq!(set.len(), g.len(), "a GPU holds an expert twice: {g:?}");
    }
    let reps = p.replicas(experts);
    assert!(reps.iter().all(|r| !r.is_empty()), "an expert has no replica");
}

#[test]
fn placements_fill_every_slot_and_cover_every_expert() {
    let t = Topology { nodes: 4, gpus_per_node: 8 };
    for (experts, redundant, groups) in [(256, 32, 8), (384, 32, 1), (128, 0, 1)] {
        let loads = zipf_loads(1, experts, 1e5, 1.1, 7).remove(0);
        let per = (experts + redundant) / t.world();
        check_placement(&eplb(&loads, redundant, groups, t).unwrap(), experts, per);
        let z = zepp(&loads, redundant, t, &|p| remote_rows(p, &loads, t)).unwrap();
        check_placement(&z, experts, per);
        // Zepp spreads an expert's replicas over distinct nodes.
        for r in z.replicas(experts) {
            let mut nodes: Vec<usize> = r.iter().map(|&g| t.node(g)).collect();
            nodes.sort_unstable();
            let n = nodes.len();
            nodes.dedup();
            assert_eq!(nodes.len(), n.min(t.nodes), "replicas share a node: {r:?}");
        }
    }
    assert!(eplb(&[1.0; 10], 1, 1, t).is_err(), "11 replicas cannot fill 32 GPUs");
}

#[test]
fn eplb_hierarchical_keeps_groups_on_one_node() {
    let t = Topology { nodes: 4, gpus_per_node: 8 };
    let loads = zipf_loads(1, 256, 1e5, 1.0, 3).remove(0);
    let p = eplb(&loads, 32, 8, t).unwrap();
    for (e, reps) in p.replicas(256).iter().enumerate() {
        let nodes: std::collections::BTreeSet<usize> = reps.iter().map(|&g| t.node(g)).collect();
        assert_eq!(nodes.len(), 1, "expert {e} of a group spans nodes");
    }
    // Each node holds exactly two of the eight groups.
    let mut per_node = vec![std::collections::BTreeSet::new(); 4];
    for (g, es) in p.gpus.iter().enumerate() {
        for &e in es {
            per_node[t.node(g)].insert(e / 32);
        }
    }
    assert!(per_node.iter().all(|s| s.len() == 2), "{per_node:?}");
}

#[test]
fn locality_routing_conserves_rows_and_respects_bounds() {
    let t = Topology { nodes: 4, gpus_per_node: 4 };
    let loads = zipf_loads(1, 64, 64_000.0, 1.2, 11).remove(0);
    let p = zepp(&loads, 16, t, &|p| remote_rows(p, &loads, t)).unwrap();
    let r = route_local(&p.gpus, &even_demand(&loads, t), t, 0.1);
    let reps = p.replicas(64);
    for e in 0..64 {
        let total: f64 = r.iter().map(|src| src[e].iter().map(|x| x.1).sum::<f64>()).sum();
        assert!((total - loads[e]).abs() < 1e-6 * loads[e].max(1.0), "expert {e}: {total} vs {}", loads[e]);
        for &g in &reps[e] {
            let on: f64 = r.iter().map(|src| src[e].iter().filter(|x| x.0 == g).map(|x| x.1).sum::<f64>()).sum();
            assert!(on <= (1.1 * loads[e] / reps[e].len() as f64).ceil() + 1e-6, "replica bound exceeded");
        }
        for src in &r {
            assert!(src[e].iter().all(|x| reps[e].contains(&x.0)), "routed to a GPU without the expert");
        }
    }
}

#[test]
fn intra_node_swaps_keep_coverage_and_lower_load() {
    let t = Topology { nodes: 2, gpus_per_node: 8 };
    let loads = zipf_loads(1, 128, 1e5, 1.2, 5).remove(0);
    let p = zepp(&loads, 16, t, &|p| remote_rows(p, &loads, t)).unwrap();
    let drifted = drift(&loads, 17);
    let (gpus, swaps) = intra_node_swaps(&p.gpus, &drifted, t);
    let q = Placement { gpus };
    assert!(!swaps.is_empty());
    // Each exchange is within a node and the table is the old one with the
    // exchanges applied, slot by slot.
    let mut replay = p.gpus.clone();
    for s in &swaps {
        assert_eq!(t.node(s.a), t.node(s.b), "{s:?} crosses nodes");
        let (x, y) = (replay[s.a][s.slot_a], replay[s.b][s.slot_b]);
        replay[s.a][s.slot_a] = y;
        replay[s.b][s.slot_b] = x;
    }
    assert_eq!(replay, q.gpus);
    let max_load = |p: &Placement| {
        let reps = p.replicas(128);
        p.gpus
            .iter()
            .map(|g| g.iter().map(|&e| drifted[e as usize] / reps[e as usize].len() as f64).sum::<f64>())
            .fold(0.0, f64::max)
    };
    assert!(max_load(&q) <= max_load(&p));
    for n in 0..2 {
        let cover = |p: &Placement| {
            let mut s: Vec<u32> = (0..8).flat_map(|i| p.gpus[n * 8 + i].clone()).collect();
            s.sort_unstable();
            s
        };
        assert_eq!(cover(&p), cover(&q), "node {n} coverage changed");
    }
}

#[test]
fn sglang_statistics_load_and_bad_files_are_refused() {
    let l = load_sglang(r#"{"logical_count": [[1, 2, 3], [4, 5, 6]]}"#).unwrap();
    assert_eq!(l, vec![vec![1.0, 2.0, 3.0], vec![4.0, 5.0, 6.0]]);
    assert!(load_sglang(r#"{"logical_count": [[1, 2], [3]]}"#).is_err());
    assert!(load_sglang(r#"{"logical_count": [[1, -2]]}"#).is_err());
    assert!(load_sglang("[]").is_err());
}

/// The figure: modeled MoE-layer latency of Zepp vs the faster of EPLB and
/// no replication, 4 and 16 nodes, two models' expert counts, two token
/// volumes, skewed (Zipf 1.1) loads. Zepp must win on geometric mean.
#[test]
fn zepp_beats_the_best_baseline_on_modeled_layer_latency() {
    let cm = cost_model();
    let mut ratios = Vec::new();
    for nodes in [4, 16] {
        let t = Topology { nodes, gpus_per_node: 8 };
        for (name, experts, top_k, hidden) in [("kimi-k2", 384usize, 8.0, 7168.0), ("qwen3-235b", 128, 8.0, 4096.0)] {
            if experts % t.world() != 0 && !t.world().is_multiple_of(experts) {
                continue;
            }
            for tokens_per_gpu in [128.0, 1024.0] {
                let rows = tokens_per_gpu * top_k * t.world() as f64;
                let loads = zipf_loads(1, experts, rows, 1.1, nodes as u64).remove(0);
                let redundant = t.world(); // one extra replica per GPU
                let shape = LayerShape { experts, top_k, hidden };
                let plain = Flows::DEEPEP;
                let base_none = if experts % t.world() == 0 {
                    let p = none(experts, t).unwrap();
                    Some(layer_cost(&route_uniform(&p.gpus, &even_demand(&loads, t)), t, shape, &cm, plain).latency)
                } else {
                    None
                };
                let pe = eplb(&loads, redundant, 1, t).unwrap();
                let base_eplb =
                    layer_cost(&route_uniform(&pe.gpus, &even_demand(&loads, t)), t, shape, &cm, plain).latency;
                let pz = zepp(&loads, redundant, t, &zepp_latency(&loads, t, shape, &cm)).unwrap();
                let z = layer_cost(&route_local(&pz.gpus, &even_demand(&loads, t), t, 0.1), t, shape, &cm, Flows::ZEPP);
                let best = base_none.map_or(base_eplb, |n| n.min(base_eplb));
                eprintln!(
                    "{nodes:>2} nodes {name:<10} {tokens_per_gpu:>5} tok/GPU: none {:>8} us, EPLB {:>8.1} us, Zepp {:>8.1} us → {:.2}x over the best baseline",
                    base_none.map_or("-".to_string(), |n| format!("{:.1}", n * 1e6)),
                    base_eplb * 1e6,
                    z.latency * 1e6,
                    best / z.latency
                );
                ratios.push(best / z.latency);
            }
        }
    }
    let geo = (ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64).exp();
    eprintln!("geometric mean speedup over the best baseline: {geo:.2}x (Zepp paper: 1.86x)");
    assert!(geo > 1.0, "{ratios:?}");
}

/// Which Zepp mechanism buys what (16 nodes, Kimi-K2's 384 experts, 1024
/// tokens per GPU): each step adds one mechanism; none may make it slower,
/// and locality routing must cut inter-node bytes.
#[test]
fn zepp_mechanisms_each_help() {
    let cm = cost_model();
    let t = Topology { nodes: 16, gpus_per_node: 8 };
    let (experts, top_k) = (384usize, 8.0);
    let loads = zipf_loads(1, experts, 1024.0 * top_k * 128.0, 1.1, 16).remove(0);
    let shape = LayerShape { experts, top_k, hidden: 7168.0 };
    let pz = zepp(&loads, 128, t, &zepp_latency(&loads, t, shape, &cm)).unwrap();
    let plain = Flows::A2AV;
    let spread_only = layer_cost(&route_uniform(&pz.gpus, &even_demand(&loads, t)), t, shape, &cm, plain);
    let local = layer_cost(&route_local(&pz.gpus, &even_demand(&loads, t), t, 0.1), t, shape, &cm, plain);
    let merged = layer_cost(&route_local(&pz.gpus, &even_demand(&loads, t), t, 0.1), t, shape, &cm, Flows::DEEPEP);
    let split = layer_cost(
        &route_local(&pz.gpus, &even_demand(&loads, t), t, 0.1),
        t,
        shape,
        &cm,
        Flows { overlap: false, ..Flows::ZEPP },
    );
    let overlapped = layer_cost(&route_local(&pz.gpus, &even_demand(&loads, t), t, 0.1), t, shape, &cm, Flows::ZEPP);
    for (name, c) in [
        ("placement only", spread_only),
        ("+ locality routing", local),
        ("+ merge", merged),
        ("+ NIC split", split),
        ("+ overlap", overlapped),
    ] {
        eprintln!("{name:<20} {:>8.1} us, inter-node {:>7.1} MB", c.latency * 1e6, c.inter_node_bytes / 1e6);
    }
    assert!(local.inter_node_bytes < spread_only.inter_node_bytes);
    assert!(merged.inter_node_bytes <= local.inter_node_bytes);
    assert!(local.latency <= spread_only.latency && merged.latency <= local.latency && split.latency <= merged.latency);
    assert!(overlapped.latency < split.latency, "overlap {} vs {}", overlapped.latency, split.latency);
}

/// Zepp §6.2: on 16 nodes of four A100s (BF16), Zepp's MoE layer is 6.68×
/// (Qwen) and 5.77× (K2) faster than NCCL all-to-allv + grouped GEMM at
/// 1 MB of input tokens per GPU, and 4.66× / 3.28× at 16 MB. The testbed's
/// NIC is not in the summary we hold; one 200 Gb/s NIC per GPU is assumed.
/// Pinned: Zepp wins at both volumes, by more than its merge alone gives
/// (overlap and locality count). *Not* met: the published lead shrinks
/// from 1 MB to 16 MB; here it grows and is about twice the published one,
/// because the synthetic Zipf(1.1) loads put a quarter of Qwen's rows on one
/// expert, and with no replicas the baseline's hottest GPU dominates at 16 MB.
#[test]
fn zepp_against_all_to_allv_plus_gemm() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mixtral-8x7b-a100.moe");
    let c = check_paths(&[path], &FsLoader).unwrap();
    let d = &c.spec.deploys[0];
    let mut cm = CostModel::roofline(c.spec.model(d.model), c.spec.cluster(d.cluster), c.spec.tile_set(d.tiles));
    let t = Topology { nodes: 16, gpus_per_node: 4 };
    cm.links.scale_out_bw = 25e9;
    cm.links.scale_out_latency = 5e-6;
    cm.links.nodes = 16;
    cm.links.gpus_per_node = 4;
    for (name, experts, hidden, paper_1mb, paper_16mb) in
        [("qwen3-30b", 128usize, 2048.0, 6.68, 4.66), ("kimi-k2", 384, 7168.0, 5.77, 3.28)]
    {
        let speedup = |mb: f64| {
            let tokens = mb * 1e6 / (hidden * 2.0);
            let rows = tokens * 8.0 * t.world() as f64;
            let loads = zipf_loads(1, experts, rows, 1.1, 16).remove(0);
            let shape = LayerShape { experts, top_k: 8.0, hidden };
            let base = layer_cost(
                &route_uniform(&none(experts, t).unwrap().gpus, &even_demand(&loads, t)),
                t,
                shape,
                &cm,
                Flows::A2AV,
            );
            let dedup = layer_cost(
                &route_uniform(&none(experts, t).unwrap().gpus, &even_demand(&loads, t)),
                t,
                shape,
                &cm,
                Flows::DEEPEP,
            );
            let pz = zepp(&loads, t.world(), t, &zepp_latency(&loads, t, shape, &cm)).unwrap();
            let z = layer_cost(&route_local(&pz.gpus, &even_demand(&loads, t), t, 0.1), t, shape, &cm, Flows::ZEPP);
            (base.latency / z.latency, base.latency / dedup.latency)
        };
        let ((small, merge_small), (large, merge_large)) = (speedup(1.0), speedup(16.0));
        eprintln!("{name}: Zepp over A2AV+GEMM {small:.2}× at 1 MB (paper {paper_1mb}×), {large:.2}× at 16 MB (paper {paper_16mb}×)");
        assert!(
            small > merge_small && large > merge_large && merge_small > 1.0,
            "{name}: {small} {merge_small} {large} {merge_large}"
        );
    }
}

/// Zepp §4.1: replicas placed to reduce token traffic under a GPU budget.
/// Scored by expected inter-node rows, Zepp's placement sends fewer rows
/// across the network than EPLB's on the same slots (a different algorithm
/// over the same loads), and each expert's replicas respect the budget: an
/// even share of its rows fits `(1 + SLACK)` times the mean GPU load.
#[test]
fn zepp_placement_cuts_inter_node_rows_within_the_gpu_budget() {
    for nodes in [4, 16] {
        let t = Topology { nodes, gpus_per_node: 8 };
        let (experts, redundant) = (384usize, t.world());
        let loads = zipf_loads(1, experts, 1e6, 1.1, 21).remove(0);
        let z = zepp(&loads, redundant, t, &|p| remote_rows(p, &loads, t)).unwrap();
        let e = eplb(&loads, redundant, 1, t).unwrap();
        let (rz, re) = (remote_rows(&z, &loads, t), remote_rows(&e, &loads, t));
        eprintln!("{nodes} nodes: expected inter-node rows Zepp {rz:.0}, EPLB {re:.0} of 1000000");
        assert!(rz < 0.9 * re, "{nodes} nodes: Zepp {rz} vs EPLB {re}");
        let budget = (1.0 + moeforge_plan::placement::SLACK) * 1e6 / t.world() as f64;
        for (x, reps) in z.replicas(experts).iter().enumerate() {
            assert!(loads[x] / reps.len() as f64 <= budget * (1.0 + 1e-9), "expert {x}: {} replicas", reps.len());
        }
    }
}

/// Slot counts where a greedy spread or EPLB's hierarchical packing would put
/// one expert twice on a GPU (found in review): every placement either holds
/// distinct experts per GPU or is refused with a reason, never duplicated.
#[test]
fn placements_never_put_an_expert_twice_on_a_gpu() {
    let cases: &[(Vec<f64>, usize, Topology)] = &[
        (vec![0.25, 0.143, 3.333, 1.0, 0.5, 0.2, 0.167, 0.111, 0.125], 7, Topology { nodes: 2, gpus_per_node: 2 }),
        (zipf_loads(1, 16, 1e4, 1.1, 3).remove(0), 20, Topology { nodes: 3, gpus_per_node: 4 }),
        (zipf_loads(1, 16, 1e4, 1.1, 5).remove(0), 32, Topology { nodes: 8, gpus_per_node: 2 }),
        (zipf_loads(1, 16, 1e4, 1.1, 7).remove(0), 20, Topology { nodes: 2, gpus_per_node: 2 }),
    ];
    for (loads, redundant, t) in cases {
        let per = (loads.len() + redundant) / t.world();
        let results = [
            zepp(loads, *redundant, *t, &|p| remote_rows(p, loads, *t)),
            eplb(loads, *redundant, 4, *t),
            eplb(loads, *redundant, 1, *t),
        ];
        for r in results {
            match r {
                Ok(p) => check_placement(&p, loads.len(), per),
                Err(why) => assert!(why.contains("distinct") || why.contains("evenly"), "{why}"),
            }
        }
    }
}
