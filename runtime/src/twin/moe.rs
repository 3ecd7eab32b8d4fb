//! The MoE block of one layer on every rank: routing (the router weights
//! are replicated; each rank routes the tokens it holds), then TP (every
//! rank's `I/P` slice of every expert, all-reduced) or EP (dispatch each
//! (token, k) to a replica of its expert, combine back in k order), plus the
//! replicated shared experts.
//!
//! EP's dispatch is the plan's placement at work: every step, the routed
//! counts per (source rank, expert) go through the placement policy's
//! routing (`moeforge_plan::placement::route`: Zepp's locality-preferred
//! water-filling within the per-replica bounds and its consolidation of
//! remote requests, or an even split over the replicas), and each source's
//! rows of an expert take the replicas it was given in token order. Without
//! a placement every expert has one replica, its stripe's owner. A replica
//! holds the same bytes as any other, so where a row is computed never
//! changes what it computes.

use super::forward::{all_reduce, par_ranks, Ctx};
use super::{Rank, Twin};
use crate::reference::{route, RoutingRule};
use moeforge_dsl::spec::PlacementPolicy;
use moeforge_plan::memory::{Mode, TensorRole};
use moeforge_plan::placement::{self, Topology};
use moeforge_plan::Plan;

/// Which experts each rank's EP slots hold in every MoE layer, and how
/// routed rows find a replica: the plan's placement, or the stripes.
#[derive(Debug)]
pub(super) struct Slots {
    /// `table[moe layer][rank]` = experts in slot order.
    table: Vec<Vec<Vec<u32>>>,
    first_moe_layer: usize,
    policy: PlacementPolicy,
    topo: Topology,
    /// The ranks that hold slots, in rank order, and their topology (the
    /// MoE servers of a role plan; every rank otherwise): drift is measured
    /// and swaps are planned over these, never over slotless attention
    /// servers, whose zero load would read as imbalance nothing can fix.
    holders: Vec<usize>,
    holder_topo: Topology,
    slack: f64,
    /// Routed rows per MoE layer and expert in the current window, and
    /// since the engine started.
    window: std::sync::Mutex<Vec<Vec<f64>>>,
    total: std::sync::Mutex<Vec<Vec<f64>>>,
    steps: usize,
    pub(super) policy_swap: SwapPolicy,
    /// Slot exchanges executed so far.
    pub(super) swaps: u64,
}

impl Slots {
    pub(super) fn of(plan: &Plan) -> Slots {
        let world = plan.ranks.len();
        let layers = plan.model.moe_layers as usize;
        let topo = Topology { nodes: plan.cluster.nodes as usize, gpus_per_node: plan.cluster.gpus_per_node as usize };
        let (holders, holder_topo) = match plan.roles.as_ref().filter(|r| r.moe_servers()) {
            None => ((0..world).collect(), topo),
            Some(r) => {
                // The placement pass's topology of the MoE servers: the same
                // count on every node that holds any (uniform, or no placement).
                let per: Vec<usize> = r.per_node.iter().map(|n| n[0] as usize).filter(|&m| m > 0).collect();
                let holders = r.ranks(moeforge_plan::roles::Role::Moe).into_iter().map(|x| x as usize).collect();
                (holders, Topology { nodes: per.len(), gpus_per_node: per.first().copied().unwrap_or(1) })
            }
        };
        Slots {
            table: (0..layers).map(|l| (0..world).map(|r| plan.slot_experts(l, r)).collect()).collect(),
            first_moe_layer: plan.memory.slots.first_moe_layer as usize,
            policy: plan.placement.as_ref().map_or(PlacementPolicy::None, |p| p.policy),
            topo,
            holders,
            holder_topo,
            slack: plan.placement.as_ref().map_or(0.0, |p| p.slack),
            window: std::sync::Mutex::new(vec![vec![0.0; plan.model.experts as usize]; layers]),
            total: std::sync::Mutex::new(vec![vec![0.0; plan.model.experts as usize]; layers]),
            steps: 0,
            policy_swap: SwapPolicy::default_for(plan.placement.as_ref().map_or(0.0, |p| p.slack)),
            swaps: 0,
        }
    }

    /// Ends a step: at a window's end, the intra-node swaps each drifted
    /// layer needs (Zepp placements only), with the table updated; the
    /// caller moves the bytes.
    pub(super) fn end_step(&mut self) -> Vec<(usize, placement::Swap)> {
        if self.policy != PlacementPolicy::Zepp {
            return vec![];
        }
        self.steps += 1;
        if self.steps < self.policy_swap.window.max(1) {
            return vec![];
        }
        self.steps = 0;
        let loads = match self.window.get_mut() {
            Ok(w) => std::mem::replace(w, vec![vec![0.0; w.first().map_or(0, Vec::len)]; w.len()]),
            Err(_) => return vec![],
        };
        let mut out = Vec::new();
        for (l, (table, loads)) in self.table.iter_mut().zip(&loads).enumerate() {
            let held: Vec<Vec<u32>> = self.holders.iter().map(|&r| table.get(r).cloned().unwrap_or_default()).collect();
            if placement::imbalance(&held, loads) <= self.policy_swap.threshold {
                continue;
            }
            let swaps = swap_holders(table, &self.holders, self.holder_topo, loads);
            self.swaps += swaps.len() as u64;
            out.extend(swaps.into_iter().map(|s| (l + self.first_moe_layer, s)));
        }
        out
    }

    /// Adds a step's routed rows per MoE layer and expert (counted where
    /// the rows were routed, e.g. by the device's dispatch) to the window.
    pub(super) fn record(&self, loads: Vec<Vec<f64>>) {
        for (l, rows) in loads.iter().enumerate() {
            self.add(l, rows);
        }
    }

    /// Adds routed rows per expert of MoE layer `l` to the window and the total.
    fn add(&self, l: usize, rows: &[f64]) {
        for m in [&self.window, &self.total] {
            if let Some(w) = m.lock().ok().as_mut().and_then(|w| w.get_mut(l)) {
                w.iter_mut().zip(rows).for_each(|(a, b)| *a += b);
            }
        }
    }

    /// Routed rows per MoE layer and expert since the engine started.
    pub(super) fn total(&self) -> Vec<Vec<f64>> {
        self.total.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Model layer of MoE layer 0.
    pub(super) fn first_moe_layer(&self) -> usize {
        self.first_moe_layer
    }

    /// The slot table of (absolute) layer `l`.
    fn layer(&self, l: usize) -> &[Vec<u32>] {
        self.table.get(l.wrapping_sub(self.first_moe_layer)).map_or(&[], Vec::as_slice)
    }

    /// The experts of rank `r`'s slots in (absolute) layer `l`.
    pub(super) fn experts(&self, l: usize, r: usize) -> &[u32] {
        self.layer(l).get(r).map_or(&[], Vec::as_slice)
    }
}

/// Zepp's intra-node swaps over the slot-holding ranks `holders` only (in
/// rank order, forming `topo`: a role plan's MoE servers, whose count per
/// node the validator keeps uniform), applied to `table` (indexed by world
/// rank) and returned in world ranks.
fn swap_holders(table: &mut [Vec<u32>], holders: &[usize], topo: Topology, loads: &[f64]) -> Vec<placement::Swap> {
    let held: Vec<Vec<u32>> = holders.iter().map(|&r| table.get(r).cloned().unwrap_or_default()).collect();
    let (next, swaps) = placement::intra_node_swaps(&held, loads, topo);
    for (&r, slots) in holders.iter().zip(next) {
        if let Some(t) = table.get_mut(r) {
            *t = slots;
        }
    }
    let world = |i: usize| holders.get(i).copied().unwrap_or(i);
    swaps
        .into_iter()
        .map(|s| placement::Swap { a: world(s.a), slot_a: s.slot_a, b: world(s.b), slot_b: s.slot_b })
        .collect()
}

/// When the twin re-plans a Zepp placement on drifted expert loads.
///
/// The runtime sums each MoE layer's routed rows per expert over `window`
/// steps. At a window's end, a layer whose busiest GPU would carry more than
/// `threshold` × the mean (each expert's rows split evenly over its
/// replicas) gets Zepp's greedy intra-node swaps, executed as slot-content
/// exchanges between the two GPUs' buffers (addresses unchanged).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SwapPolicy {
    pub window: usize,
    pub threshold: f64,
}

impl SwapPolicy {
    /// 64 steps, and 1 + 2·slack: the routing may load a replica up to
    /// `1 + slack` of its even share, so imbalance up to there is the
    /// routing's to absorb; twice that margin is placement drift, not one
    /// window's noise, and the swap (a few slots' bytes over NVLink) then
    /// pays for itself over the next windows.
    pub fn default_for(slack: f64) -> SwapPolicy {
        SwapPolicy { window: 64, threshold: 1.0 + 2.0 * slack }
    }
}

/// Where EP's routed (token, k) rows were computed over a run: on the
/// rank that holds the token, elsewhere on its node, or on another node;
/// and the (source rank, destination node) messages the remote rows took,
/// one per layer and step with rows to send.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Routed {
    pub own_rank: u64,
    pub own_node: u64,
    pub remote: u64,
    pub remote_messages: u64,
    /// A role plan's communication schedule at work (`roles.posts`): the
    /// remote rows relayed through a prefill server on the MoE rank's node,
    /// and the scale-out sends they took (one per token and relay, however
    /// many of that node's experts the token activates: §5's deduplication).
    pub relayed: u64,
    pub relay_sends: u64,
    /// Remote prefill rows sent straight over RDMA on the low-priority lane.
    pub low_lane: u64,
    /// Dispatch rounds: a source's rows for one MoE rank go in rounds of at
    /// most its post's reserved rows (one round when they fit).
    pub rounds: u64,
}

impl Routed {
    pub fn rows(&self) -> u64 {
        self.own_rank + self.own_node + self.remote
    }
}

impl Twin {
    pub(super) fn moe(&self, cx: &Ctx, l: usize, normed: &[Vec<Vec<f32>>]) -> Vec<Vec<Vec<f32>>> {
        let m = &self.model;
        let p = self.ranks.len();
        let rule = RoutingRule { experts: m.experts, top_k: m.top_k, routing: m.routing };
        // Routing (replicated router weights; each rank routes the tokens it holds).
        let routes: Vec<Vec<(Vec<i32>, Vec<f32>)>> = par_ranks(&self.ranks, |rank| {
            normed[rank.id]
                .iter()
                .map(|h| {
                    let mut logits = cx.mat(&rank.buf, TensorRole::Router, l).map(|w| w.matvec(h)).unwrap_or_default();
                    // GPT-OSS's router bias shifts the logits (ranking and softmax both).
                    let b = cx.bias(&rank.buf, TensorRole::Router, l, 0, m.experts);
                    logits.iter_mut().zip(&b).for_each(|(x, b)| *x += b);
                    let bias = m.selection_bias().then(|| cx.f32s(&rank.buf, TensorRole::RouterBias, l));
                    route(&rule, &logits, bias.as_deref())
                })
                .collect()
        });
        let shared_roles = [TensorRole::SharedGate, TensorRole::SharedUp, TensorRole::SharedDown];
        let shared = |rank: &Rank, h: &[f32]| (m.shared_ffn > 0).then(|| cx.ffn(&rank.buf, shared_roles, l, h));
        match cx.mode {
            Mode::Tp => {
                // Each rank: Σ_k w_k · expert_k restricted to its I/P slice; then all-reduce.
                let partial = par_ranks(&self.ranks, |rank| {
                    normed[rank.id]
                        .iter()
                        .zip(&routes[rank.id])
                        .map(|(h, (ids, w))| {
                            let mut y = vec![0f32; m.hidden];
                            for (e, wk) in ids.iter().zip(w) {
                                let ye = cx.expert(&rank.buf, l, *e as usize, h);
                                y.iter_mut().zip(&ye).for_each(|(a, b)| *a += wk * b);
                            }
                            y
                        })
                        .collect()
                });
                let mut reduced = all_reduce(partial);
                // Shared experts are replicated: every rank adds the same full output.
                for (rank, ys) in self.ranks.iter().zip(reduced.iter_mut()) {
                    for (y, h) in ys.iter_mut().zip(&normed[rank.id]) {
                        if let Some(s) = shared(rank, h) {
                            y.iter_mut().zip(&s).for_each(|(a, b)| *a += b);
                        }
                    }
                }
                reduced
            }
            Mode::Ep => {
                // Route: this step's counts per (source rank, expert) through
                // the placement's routing, then each source's rows of an
                // expert to the replicas it was given, in token order.
                let table = self.slots.layer(l);
                let mut demand = vec![vec![0f64; m.experts]; p];
                for (src, rs) in routes.iter().enumerate() {
                    for (ids, _) in rs {
                        for &e in ids {
                            demand[src][e as usize] += 1.0;
                        }
                    }
                }
                let route = |t: &[Vec<u32>], d: &[Vec<f64>]| {
                    placement::route(self.slots.policy, t, d, self.slots.topo, self.slots.slack)
                };
                let plan = match self.roles.as_ref().filter(|r| r.ep_groups.len() > 1) {
                    None => route(table, &demand),
                    // PD: each whole-model instance routes its own rows over its own GPUs.
                    Some(r) => {
                        let mut out = vec![vec![placement::Reps::new(); m.experts]; p];
                        for g in &r.ep_groups {
                            let inside = |x: usize| g.contains(&(x as u32));
                            let t: Vec<Vec<u32>> = table
                                .iter()
                                .enumerate()
                                .map(|(x, s)| if inside(x) { s.clone() } else { vec![] })
                                .collect();
                            let d: Vec<Vec<f64>> = demand
                                .iter()
                                .enumerate()
                                .map(|(x, d)| if inside(x) { d.clone() } else { vec![0.0; d.len()] })
                                .collect();
                            let part = route(&t, &d);
                            for &x in g {
                                if let (Some(o), Some(pt)) = (out.get_mut(x as usize), part.get(x as usize)) {
                                    *o = pt.clone();
                                }
                            }
                        }
                        out
                    }
                };
                for d in &demand {
                    self.slots.add(l.wrapping_sub(self.slots.first_moe_layer), d);
                }
                let topo = self.slots.topo;
                let mut counted = Routed::default();
                // inbox[gpu] = (source rank, token, k, slot on gpu).
                let mut inbox: Vec<Vec<(usize, usize, usize, usize)>> = vec![vec![]; p];
                for (src, rs) in routes.iter().enumerate() {
                    // The replica each of this source's rows of expert e takes, in order.
                    let mut take = placement::row_queues(&plan[src]);
                    let mut to_node = vec![false; topo.nodes.max(1)];
                    for (t, (ids, _)) in rs.iter().enumerate() {
                        for (k, &e) in ids.iter().enumerate() {
                            let e = e as usize;
                            // Routing conserves rows (tested), so the fallback, a
                            // rank holding the expert, is never taken.
                            let Some(g) = take[e].next().or_else(|| table.iter().position(|s| s.contains(&(e as u32))))
                            else {
                                continue;
                            };
                            let Some(slot) = table.get(g).and_then(|s| s.iter().position(|&x| x as usize == e)) else {
                                continue;
                            };
                            inbox[g].push((src, t, k, slot));
                            if g == src {
                                counted.own_rank += 1;
                            } else if topo.node(g) == topo.node(src) {
                                counted.own_node += 1;
                            } else {
                                counted.remote += 1;
                                if let Some(x) = to_node.get_mut(topo.node(g)) {
                                    *x = true;
                                }
                            }
                        }
                    }
                    counted.remote_messages += to_node.iter().filter(|&&x| x).count() as u64;
                }
                if let Some(roles) = self.roles.as_ref().filter(|r| r.moe_servers()) {
                    posted(roles, &inbox, &mut counted);
                }
                if let Ok(mut r) = self.routed.lock() {
                    r.own_rank += counted.own_rank;
                    r.own_node += counted.own_node;
                    r.remote += counted.remote;
                    r.remote_messages += counted.remote_messages;
                    r.relayed += counted.relayed;
                    r.relay_sends += counted.relay_sends;
                    r.low_lane += counted.low_lane;
                    r.rounds += counted.rounds;
                }
                let results: Vec<Vec<Vec<f32>>> = par_ranks(&self.ranks, |rank| {
                    inbox[rank.id]
                        .iter()
                        .map(|&(src, t, _, slot)| cx.expert(&rank.buf, l, slot, &normed[src][t]))
                        .collect()
                });
                // Combine: back to the source, summed in k order.
                let mut ys: Vec<Vec<Vec<Vec<f32>>>> =
                    normed.iter().map(|xs| xs.iter().map(|_| vec![vec![]; m.top_k]).collect()).collect();
                for (owner, res) in results.into_iter().enumerate() {
                    for (&(src, t, k, _), y) in inbox[owner].iter().zip(res) {
                        ys[src][t][k] = y;
                    }
                }
                ys.into_iter()
                    .enumerate()
                    .map(|(r, tokens)| {
                        tokens
                            .into_iter()
                            .enumerate()
                            .map(|(t, parts)| {
                                let mut y = vec![0f32; m.hidden];
                                for (k, part) in parts.iter().enumerate() {
                                    let wk = routes[r][t].1[k];
                                    y.iter_mut().zip(part).for_each(|(a, b)| *a += wk * b);
                                }
                                if let Some(s) = shared(&self.ranks[r], &normed[r][t]) {
                                    y.iter_mut().zip(&s).for_each(|(a, b)| *a += b);
                                }
                                y
                            })
                            .collect()
                    })
                    .collect()
            }
        }
    }
}

/// One layer's dispatch under a role plan's schedule: each (attention rank,
/// MoE rank) pair's rows take their post's path, in rounds of at most the
/// post's reserved rows. `inbox[gpu]` holds (source rank, token, k, slot).
fn posted(roles: &moeforge_plan::roles::Roles, inbox: &[Vec<(usize, usize, usize, usize)>], out: &mut Routed) {
    use moeforge_plan::roles::Path;
    let posts: std::collections::BTreeMap<(usize, usize), &moeforge_plan::roles::Post> =
        roles.posts.iter().map(|p| ((p.src as usize, p.dst as usize), p)).collect();
    let mut rows: std::collections::BTreeMap<(usize, usize), u64> = Default::default();
    let mut sends = std::collections::BTreeSet::new();
    for (dst, rs) in inbox.iter().enumerate() {
        for &(src, t, _, _) in rs {
            *rows.entry((src, dst)).or_default() += 1;
            match posts.get(&(src, dst)).map(|p| p.path) {
                Some(Path::Relay { via }) => {
                    out.relayed += 1;
                    sends.insert((src, t, via));
                }
                Some(Path::Rdma { lane: 1 }) => out.low_lane += 1,
                _ => {}
            }
        }
    }
    out.relay_sends += sends.len() as u64;
    // The validator guarantees a post of at least one row for every pair.
    out.rounds += rows.iter().map(|(k, &n)| n.div_ceil(posts.get(k).map_or(n, |p| p.rows).max(1))).sum::<u64>();
}

#[cfg(test)]
mod tests {
    use super::swap_holders;
    use moeforge_plan::placement::Topology;

    /// Two nodes of four GPUs whose MoE servers are local ranks 0 and 1
    /// (world 0, 1, 4, 5). Node 1's servers drift apart (experts 0 and 1 hot,
    /// both on GPU 4): the swaps exchange slots between world GPUs 4 and 5
    /// only, and the attention GPUs keep no slot.
    #[test]
    fn swaps_between_moe_servers_land_on_their_world_ranks() {
        let mut table: Vec<Vec<u32>> =
            vec![vec![4, 5], vec![6, 7], vec![], vec![], vec![0, 1], vec![2, 3], vec![], vec![]];
        let loads = [100.0, 100.0, 1.0, 1.0, 10.0, 10.0, 10.0, 10.0];
        let gpu = |t: &Vec<Vec<u32>>, g: usize| t[g].iter().map(|&e| loads[e as usize]).sum::<f64>();
        let before = gpu(&table, 4).max(gpu(&table, 5));
        let swaps = swap_holders(&mut table, &[0, 1, 4, 5], Topology { nodes: 2, gpus_per_node: 2 }, &loads);
        assert!(!swaps.is_empty());
        for s in &swaps {
            assert!([s.a, s.b].iter().all(|g| [4, 5].contains(g)), "{s:?}");
        }
        assert!(gpu(&table, 4).max(gpu(&table, 5)) < before, "{table:?}");
        assert_eq!((table[0].clone(), table[1].clone()), (vec![4, 5], vec![6, 7]), "node 0 was balanced");
        assert!([2, 3, 6, 7].iter().all(|&g| table[g].is_empty()));
        let mut experts: Vec<u32> = table[4].iter().chain(&table[5]).copied().collect();
        experts.sort_unstable();
        assert_eq!(experts, [0, 1, 2, 3], "no expert left node 1");
    }
}
