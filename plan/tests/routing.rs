//! The run-time routing of routed rows to expert replicas
//! (`moeforge_plan::placement::route`), on integer per-source counts as the
//! runtime gives it every iteration. Expectations come from counting by
//! hand or from a different computation (per-node capacity sums), never
//! from the routing itself.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use moeforge_dsl::spec::PlacementPolicy;
use moeforge_plan::placement::{consolidate, replicas_of, route, route_local, Reps, Routing, Topology};
use moeforge_plan::rng::SplitMix64;

/// A seeded instance: every GPU holds `per` distinct experts, every expert
/// at least one replica, skewed integer demands per (source, expert).
fn instance(seed: u64, t: Topology, experts: usize, per: usize) -> (Vec<Vec<u32>>, Vec<Vec<f64>>) {
    let mut rng = SplitMix64(seed);
    let w = t.world();
    // Experts 0..E once each, striped, then the rest of the slots hot experts.
    let mut slots: Vec<Vec<u32>> = vec![Vec::new(); w];
    for e in 0..experts {
        slots[e % w].push(e as u32);
    }
    for held in slots.iter_mut() {
        let mut tries = 0u64;
        while held.len() < per {
            // Mostly the hottest quarter; any expert once those run out.
            let range = if tries < 16 { (experts as u64 / 4).max(1) } else { experts as u64 };
            tries += 1;
            let e = (rng.next_u64() % range) as u32;
            if !held.contains(&e) {
                held.push(e);
            }
        }
    }
    let demand =
        (0..w).map(|_| (0..experts).map(|e| (rng.next_u64() % (64 / (e as u64 + 1) + 1)) as f64).collect()).collect();
    (slots, demand)
}

fn served(r: &Routing, e: usize, g: usize) -> f64 {
    r.iter().map(|src| src[e].iter().filter(|x| x.0 == g).map(|x| x.1).sum::<f64>()).sum()
}

#[test]
fn every_row_goes_whole_to_a_replica_of_its_expert_within_the_bound() {
    for seed in 0..40 {
        let t = Topology { nodes: 1 + (seed as usize % 3), gpus_per_node: 2 + (seed as usize % 2) * 2 };
        let experts: usize = 16;
        let per = experts.div_ceil(t.world()) + 2;
        let (slots, demand) = instance(seed, t, experts, per);
        let reps = replicas_of(&slots, experts);
        for policy in [PlacementPolicy::Zepp, PlacementPolicy::Eplb] {
            let r = route(policy, &slots, &demand, t, 0.1);
            for (src, row) in r.iter().enumerate() {
                for e in 0..experts {
                    let sent: f64 = row[e].iter().map(|x| x.1).sum();
                    assert_eq!(
                        sent, demand[src][e],
                        "seed {seed} {policy:?}: source {src} expert {e} rows not conserved"
                    );
                    for &(g, n) in &row[e] {
                        assert!(reps[e].contains(&g), "seed {seed}: expert {e} routed to GPU {g}, which lacks it");
                        assert!(n > 0.0 && n.fract() == 0.0, "seed {seed}: {n} rows is not a whole count");
                    }
                }
            }
            if policy == PlacementPolicy::Zepp {
                for (e, rs) in reps.iter().enumerate() {
                    let rows: f64 = demand.iter().map(|d| d[e]).sum();
                    let bound = (1.1 * rows / rs.len() as f64).ceil();
                    for &g in rs {
                        assert!(served(&r, e, g) <= bound, "seed {seed}: expert {e} on GPU {g} over its bound {bound}");
                    }
                }
            }
        }
    }
}

/// With bounds that never bind, locality is exact: a row is served on its
/// own GPU when that GPU holds the expert, else on its node when the node
/// does, else remotely (counted directly from the slot table).
#[test]
fn loose_bounds_serve_every_row_as_close_as_a_replica_is() {
    for seed in 0..20 {
        let t = Topology { nodes: 3, gpus_per_node: 2 };
        let experts = 12;
        let (slots, demand) = instance(100 + seed, t, experts, 4);
        let r = route_local(&slots, &demand, t, 100.0);
        let (mut own, mut node, mut remote) = (0.0, 0.0, 0.0);
        let (mut want_own, mut want_node, mut want_remote) = (0.0, 0.0, 0.0);
        for (src, row) in r.iter().enumerate() {
            for e in 0..experts {
                let d = demand[src][e];
                if slots[src].contains(&(e as u32)) {
                    want_own += d;
                } else if (0..t.world()).any(|g| t.node(g) == t.node(src) && slots[g].contains(&(e as u32))) {
                    want_node += d;
                } else {
                    want_remote += d;
                }
                for &(g, n) in &row[e] {
                    if g == src {
                        own += n;
                    } else if t.node(g) == t.node(src) {
                        node += n;
                    } else {
                        remote += n;
                    }
                }
            }
        }
        assert_eq!((own, node, remote), (want_own, want_node, want_remote), "seed {seed}");
    }
}

/// Tight bounds (slack 0) cap every replica at ⌈rows_e / replicas_e⌉ and
/// still place every row: the busiest replica of each expert is within one
/// row of an even split.
#[test]
fn zero_slack_splits_each_expert_evenly_over_its_replicas() {
    let t = Topology { nodes: 2, gpus_per_node: 2 };
    let (slots, demand) = instance(7, t, 8, 4);
    let reps = replicas_of(&slots, 8);
    let r = route_local(&slots, &demand, t, 0.0);
    for (e, rs) in reps.iter().enumerate() {
        let rows: f64 = demand.iter().map(|d| d[e]).sum();
        let placed: f64 = rs.iter().map(|&g| served(&r, e, g)).sum();
        assert_eq!(placed, rows, "expert {e}: rows not all placed");
        let even = (rows / rs.len() as f64).ceil();
        for &g in rs {
            assert!(served(&r, e, g) <= even, "expert {e} GPU {g}: {} > {even}", served(&r, e, g));
        }
    }
}

/// The refinement on a hand-built case: three one-GPU nodes; GPU 0 sends
/// 2 rows of expert 0 (replicas on GPUs 1 and 2) and 2 rows of expert 1
/// (only on GPU 1). Water-filling alone splits expert 0's rows 1 + 1, so
/// GPU 0 messages two nodes; expert 0's bound ⌈1.1 · 2 / 2⌉ = 2 leaves room
/// on GPU 1, so consolidation moves the lone row there: one message.
#[test]
fn consolidation_merges_a_lone_remote_flow_into_a_node_already_sent_to() {
    let t = Topology { nodes: 3, gpus_per_node: 1 };
    let slots = vec![vec![2], vec![0, 1], vec![0]];
    let demand = vec![vec![2.0, 2.0, 0.0], vec![0.0; 3], vec![0.0; 3]];
    let reps = replicas_of(&slots, 3);
    // What water-filling alone gives (checked by hand above).
    let lists = |l: Vec<Vec<(usize, f64)>>| l.into_iter().map(Reps::from_vec).collect::<Vec<_>>();
    let mut split: Routing = vec![
        lists(vec![vec![(1, 1.0), (2, 1.0)], vec![(1, 2.0)], vec![]]),
        lists(vec![vec![]; 3]),
        lists(vec![vec![]; 3]),
    ];
    let mut used = vec![vec![0.0, 1.0, 1.0], vec![0.0, 2.0, 0.0], vec![0.0; 3]];
    consolidate(&mut split, &reps, &[2.0, 3.0, 0.0], &mut used, t);
    assert_eq!(split[0][0].as_slice(), [(1, 2.0)]);
    assert_eq!(split[0][1].as_slice(), [(1, 2.0)]);
    assert_eq!(used[0], vec![0.0, 2.0, 0.0]);
    // route_local ends at the same place.
    let r = route_local(&slots, &demand, t, 0.1);
    assert_eq!(r[0][0].as_slice(), [(1, 2.0)]);
    // With no room on GPU 1 (slack 0: expert 0's bound is 1) the flow stays split.
    let r = route_local(&slots, &demand, t, 0.0);
    let mut to: Vec<usize> = r[0][0].iter().map(|x| x.0).collect();
    to.sort_unstable();
    assert_eq!(to, vec![1, 2]);
}

/// Consolidation never adds remote rows, a destination node or bound
/// overruns, and never moves rows served on the source's node.
#[test]
fn consolidation_only_removes_messages() {
    for seed in 0..30 {
        let t = Topology { nodes: 4, gpus_per_node: 1 };
        let experts = 12;
        let (slots, demand) = instance(300 + seed, t, experts, 6);
        let reps = replicas_of(&slots, experts);
        let plain = route(PlacementPolicy::Eplb, &slots, &demand, t, 0.1);
        let mut used = vec![vec![0.0; t.world()]; experts];
        for row in &plain {
            for (e, list) in row.iter().enumerate() {
                for &(g, n) in list {
                    used[e][g] += n;
                }
            }
        }
        // Bounds that admit what the even split already placed.
        let bounds: Vec<f64> = (0..experts).map(|e| used[e].iter().copied().fold(0.0, f64::max) + 2.0).collect();
        let mut merged = plain.clone();
        consolidate(&mut merged, &reps, &bounds, &mut used, t);
        for src in 0..t.world() {
            let nodes = |r: &Routing| {
                let mut n: Vec<usize> =
                    r[src].iter().flatten().filter(|x| t.node(x.0) != t.node(src)).map(|x| t.node(x.0)).collect();
                n.sort_unstable();
                n.dedup();
                n
            };
            let after = nodes(&merged);
            assert!(after.iter().all(|n| nodes(&plain).contains(n)), "seed {seed}: a new destination");
            let local = |r: &Routing| -> f64 {
                r[src].iter().flatten().filter(|x| t.node(x.0) == t.node(src)).map(|x| x.1).sum()
            };
            assert_eq!(local(&merged), local(&plain), "seed {seed}: local rows moved");
            for e in 0..experts {
                let a: f64 = merged[src][e].iter().map(|x| x.1).sum();
                assert_eq!(a, demand[src][e], "seed {seed}: rows lost");
            }
        }
        for (e, per_gpu) in used.iter().enumerate() {
            assert!(per_gpu.iter().all(|&u| u <= bounds[e]), "seed {seed}: bound overrun");
        }
    }
}
