//! Expert replicas per layer and GPU (`placement { policy = zepp | eplb }`),
//! the modeled comparison of the policies, and the run-time routing of
//! routed rows to replicas, as `plan.json` records them and the runtime
//! executes them.
//!
//! The placement *algorithms* (which expert goes into which slot) are the
//! compiler's (moeforge-codegen's `placement` module). The *routing* runs
//! every iteration on the live routed counts, so it lives here, where the
//! runtime reaches it; the compiler's modeled comparison calls the same
//! function on expected loads.
//!
//! A realized placement: GPU `g`'s EP expert view holds `slots` experts per
//! MoE layer, and slot `j` of MoE layer `l` holds expert `replicas[l][g][j]`.
//! Replicas are copies of the same checkpoint tensors, so routing changes
//! where a (token, k) row is computed, never what it computes: tokens are
//! unchanged.

use moeforge_dsl::spec::PlacementPolicy;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacementPlan {
    pub policy: PlacementPolicy,
    /// Where the loads came from.
    pub loads: String,
    pub redundant_experts: u32,
    /// `replicas[moe layer][gpu]` = the experts of that GPU's slots, in slot order.
    pub replicas: Vec<Vec<Vec<u32>>>,
    /// The routing's relaxation of the per-replica load bound:
    /// a replica of expert `e` takes at most `⌈(1 + slack) · rows_e / replicas_e⌉`
    /// of an iteration's `rows_e` routed rows (Zepp §4.1's relaxed balance constraint).
    #[serde(default = "default_slack")]
    pub slack: f64,
    /// Modeled latency of MoE layer 0 under each policy (seconds); `none`
    /// is absent when experts do not stripe evenly.
    pub latency_none: Option<f64>,
    pub latency_eplb: f64,
    pub latency_zepp: f64,
    /// Every policy's routing on every layer's loads, as the serving
    /// simulator uses them (`none` absent when experts do not stripe evenly).
    #[serde(default)]
    pub stats: Vec<PolicyStats>,
}

fn default_slack() -> f64 {
    SLACK
}

/// The load bound's relaxation the compiler writes: a replica of an expert
/// may take 10% more than its even share of that expert's rows (Zepp treats
/// balance as a relaxed constraint). A GPU's load then also depends on the
/// placement; `report.md` shows the modeled busiest GPU and node-local share.
pub const SLACK: f64 = 0.1;

impl PlacementPlan {
    /// Expert slots each GPU holding experts has per MoE layer (a role
    /// plan's attention servers hold none).
    pub fn slots_per_gpu(&self) -> usize {
        self.replicas.first().and_then(|l| l.iter().map(Vec::len).max()).unwrap_or(0)
    }

    /// The most GPUs holding one expert in any layer: the replica table's
    /// width (swaps exchange slot contents inside a node and never put an
    /// expert twice on a GPU, so no swap changes it).
    ///
    /// Counted over the ids the table holds (each GPU's distinct ids,
    /// sorted together), so an id out of the model's range, which the
    /// plan's checks refuse later, costs no table as large as the id.
    pub fn max_replicas(&self) -> usize {
        self.replicas
            .iter()
            .filter_map(|layer| {
                let mut held: Vec<u32> = layer
                    .iter()
                    .flat_map(|es| {
                        let mut v = es.clone();
                        v.sort_unstable();
                        v.dedup();
                        v
                    })
                    .collect();
                held.sort_unstable();
                held.chunk_by(|a, b| a == b).map(<[u32]>::len).max()
            })
            .max()
            .unwrap_or(0)
    }

    /// One layer's replica table as the routing kernel reads it: for each
    /// of `experts` experts, `width` physical slots (`gpu · slots_per_gpu +`
    /// the first slot of the GPU holding it), GPUs ascending, −1 past the last.
    pub fn replica_table(layer: &[Vec<u32>], experts: usize, slots_per_gpu: usize, width: usize) -> Vec<i32> {
        let mut out = vec![-1i32; experts * width];
        for (e, gpus) in replicas_of(layer, experts).iter().enumerate() {
            for (i, &g) in gpus.iter().take(width).enumerate() {
                let slot = layer[g].iter().position(|&x| x as usize == e).unwrap_or(0);
                out[e * width + i] = (g * slots_per_gpu + slot) as i32;
            }
        }
        out
    }
}

/// How one placement policy spreads the loads: the busiest GPU's routed
/// rows over the mean, and the fraction of routed rows served on the
/// sender's node, each averaged over the MoE layers.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyStats {
    pub policy: PlacementPolicy,
    pub busiest: f64,
    pub local: f64,
}

/// Nodes × GPUs per node; GPU `g` is on node `g / gpus_per_node`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    pub nodes: usize,
    pub gpus_per_node: usize,
}

impl Topology {
    pub fn world(&self) -> usize {
        self.nodes * self.gpus_per_node
    }
    pub fn node(&self, gpu: usize) -> usize {
        gpu / self.gpus_per_node.max(1)
    }
}

/// Which replica serves each (source GPU, expert) demand:
/// `routing[src][e]` = list of (gpu, rows).
pub type Routing = Vec<Vec<Reps>>;

/// One (source, expert)'s replicas and the rows each takes, in the order
/// its rows go to them. Two inline: most experts have one or two replicas,
/// so routing a layer allocates per source, not per (source, expert).
pub type Reps = smallvec::SmallVec<[(usize, f64); 2]>;

/// Replicas of each expert (GPUs holding it, ascending) in one layer's slot table.
pub fn replicas_of(slots: &[Vec<u32>], experts: usize) -> Vec<Vec<usize>> {
    let mut r = vec![Vec::new(); experts];
    for (g, es) in slots.iter().enumerate() {
        for &e in es {
            if let Some(x) = r.get_mut(e as usize) {
                if !x.contains(&g) {
                    x.push(g);
                }
            }
        }
    }
    r
}

/// The routing a policy runs: Zepp's locality-preferred routing, or an
/// even split over the replicas (EPLB, and the single-replica baseline).
pub fn route(policy: PlacementPolicy, slots: &[Vec<u32>], demand: &[Vec<f64>], t: Topology, slack: f64) -> Routing {
    match policy {
        PlacementPolicy::Zepp => route_local(slots, demand, t, slack),
        PlacementPolicy::Eplb | PlacementPolicy::None => route_uniform(slots, demand),
    }
}

/// Splits each source's rows of an expert evenly over its replicas (what
/// EPLB and the single-replica baseline do: no locality preference). Whole
/// rows stay whole: the remainder goes one row each to the replicas after
/// the source's own position, so sources do not all overload the first one.
pub fn route_uniform(slots: &[Vec<u32>], demand: &[Vec<f64>]) -> Routing {
    let experts = demand.first().map_or(0, Vec::len);
    let reps = replicas_of(slots, experts);
    demand
        .iter()
        .enumerate()
        .map(|(src, row)| {
            row.iter()
                .enumerate()
                .map(|(e, &need)| {
                    let r = &reps[e];
                    if r.is_empty() || need <= 0.0 {
                        return Reps::new();
                    }
                    let n = r.len() as f64;
                    let whole = need.fract() == 0.0;
                    let base = if whole { (need / n).floor() } else { need / n };
                    let mut extra = if whole { need - base * n } else { 0.0 };
                    (0..r.len())
                        .map(|i| {
                            let g = r[(i + src) % r.len()];
                            let one = if extra >= 1.0 { 1.0 } else { 0.0 };
                            extra -= one;
                            (g, base + one)
                        })
                        .filter(|x| x.1 > 0.0)
                        .collect()
                })
                .collect()
        })
        .collect()
}

/// One source's routing as whole rows: for each expert, the replica each of
/// its rows takes, in order (the runtime hands a source's rows of an expert
/// to these in token order, so the twin and the devices agree row by row).
pub fn row_queues(row: &[Reps]) -> Vec<std::vec::IntoIter<usize>> {
    row.iter()
        .map(|reps| reps.iter().flat_map(|&(g, n)| std::iter::repeat_n(g, n as usize)).collect::<Vec<_>>().into_iter())
        .collect()
}

/// Zepp's locality-preferred routing (§4.1, §5): `demand[src][e]` rows of
/// expert `e` are held on source GPU `src`. Each replica of `e` takes at most
/// `bound_e = ⌈(1 + slack) · rows_e / replicas_e⌉`. Greedy water-filling in
/// three tiers: every source first fills replicas on its own GPU, then on
/// its node, then remote ones (within a tier the least-filled replica
/// first). Rows no bound admits (none when `slack ≥ 0`: the bounds sum to at
/// least `rows_e`) go to the least-filled replica. A refinement then
/// consolidates remote requests ([`consolidate`]). Integer demands give
/// integer rows.
pub fn route_local(slots: &[Vec<u32>], demand: &[Vec<f64>], t: Topology, slack: f64) -> Routing {
    let w = demand.len();
    let experts = demand.first().map_or(0, Vec::len);
    let reps = replicas_of(slots, experts);
    let tier = |src: usize, g: usize| {
        if g == src {
            0
        } else if t.node(g) == t.node(src) {
            1
        } else {
            2
        }
    };
    // Built, not cloned: cloning a SmallVec goes element by element.
    let mut out: Routing = (0..w).map(|_| (0..experts).map(|_| Reps::new()).collect()).collect();
    let mut bounds = vec![0.0; experts];
    let mut used = vec![vec![0.0f64; t.world().max(w)]; experts];
    // Each expert's rows, summed source by source (row-major: the demand
    // is one row per source).
    let mut rows_of = vec![0.0f64; experts];
    for d in demand {
        for (r, x) in rows_of.iter_mut().zip(d) {
            *r += x;
        }
    }
    // An expert with one replica: its bound (at least every row) admits
    // each source's rows whole, whatever the tier, which is what the tiers
    // below would give. Placed source by source, in row order.
    for (src, d) in demand.iter().enumerate() {
        for (e, &x) in d.iter().enumerate().take(experts) {
            if let (&[g], true) = (reps[e].as_slice(), x > 0.0) {
                out[src][e].push((g, x));
                used[e][g] += x;
            }
        }
    }
    let (mut need, mut cands) = (Vec::with_capacity(w), Vec::new());
    for e in 0..experts {
        if reps[e].is_empty() {
            continue;
        }
        let rows = rows_of[e];
        let bound = ((1.0 + slack.max(0.0)) * rows / reps[e].len() as f64).ceil();
        bounds[e] = bound;
        if reps[e].len() == 1 {
            continue;
        }
        need.clear();
        need.extend(demand.iter().map(|d| d[e]));
        for level in 0..3 {
            for src in 0..w {
                if need[src] <= 0.0 {
                    continue;
                }
                cands.clear();
                cands.extend(reps[e].iter().copied().filter(|&g| tier(src, g) == level));
                match cands.as_slice() {
                    [] => {}
                    // One candidate (most experts have one replica per tier).
                    &[g] => {
                        let take = need[src].min((bound - used[e][g]).max(0.0));
                        if take > 0.0 {
                            add(&mut out[src][e], g, take);
                            used[e][g] += take;
                            need[src] -= take;
                        }
                    }
                    _ => {
                        let mut levels: Vec<f64> = cands.iter().map(|&g| used[e][g]).collect();
                        let takes = water_fill(&mut levels, bound, need[src]);
                        for (&g, take) in cands.iter().zip(takes) {
                            if take > 0.0 {
                                add(&mut out[src][e], g, take);
                                used[e][g] += take;
                                need[src] -= take;
                            }
                        }
                    }
                }
            }
        }
        // Rounding leaves ~1e-13 of fractional (modeled) demand unplaced; that is no row.
        let eps = 1e-9 * rows.max(1.0);
        for (src, left) in need.iter().enumerate() {
            if *left > eps {
                let g = *reps[e].iter().min_by(|&&a, &&b| used[e][a].total_cmp(&used[e][b])).unwrap_or(&reps[e][0]);
                add(&mut out[src][e], g, *left);
                used[e][g] += left;
            }
        }
    }
    consolidate(&mut out, &reps, &bounds, &mut used, t);
    out
}

/// Raises the lowest of `levels` together towards the next level, none
/// past `cap`, until `need` rows are placed or every level is at `cap`;
/// returns what each took. Whole `need` and levels give whole takes (the
/// last rows one each to the lowest, in order).
fn water_fill(levels: &mut [f64], cap: f64, mut need: f64) -> Vec<f64> {
    let whole = need.fract() == 0.0 && levels.iter().all(|l| l.fract() == 0.0) && cap.fract() == 0.0;
    let mut takes = vec![0.0; levels.len()];
    // Each round either places every remaining row or lifts a group onto the
    // next level (or its cap), so 2·len + 1 rounds suffice.
    for _ in 0..2 * levels.len() + 1 {
        if need <= 1e-9 {
            break;
        }
        let open: Vec<usize> = (0..levels.len()).filter(|&i| levels[i] < cap).collect();
        let Some(lo) = open.iter().map(|&i| levels[i]).min_by(f64::total_cmp) else { break };
        let low: Vec<usize> = open.iter().copied().filter(|&i| levels[i] <= lo).collect();
        let next = open.iter().map(|&i| levels[i]).filter(|&l| l > lo).fold(cap, f64::min);
        let mut per = (next - lo).min(need / low.len() as f64);
        if whole {
            per = per.floor();
            if per < 1.0 {
                for &i in low.iter().take(need as usize) {
                    levels[i] += 1.0;
                    takes[i] += 1.0;
                    need -= 1.0;
                }
                continue;
            }
        }
        // Land exactly on the next level, so equal levels stay equal.
        let target = if per == next - lo { next } else { lo + per };
        for &i in &low {
            takes[i] += target - levels[i];
            need -= target - levels[i];
            levels[i] = target;
        }
    }
    takes
}

fn add(list: &mut Reps, g: usize, rows: f64) {
    match list.iter_mut().find(|x| x.0 == g) {
        Some(x) => x.1 += rows,
        None => list.push((g, rows)),
    }
}

/// Zepp's refinement (§5, "then refines assignments to consolidate remote
/// requests"): a source that sends a few rows to some remote node pays that
/// node a message of its own. For each source, its remote destination nodes
/// are visited from the lightest flow up; when every row it sends to that
/// node can move to replicas (of the same experts) on nodes it already
/// sends to, within their bounds, the rows move and the message disappears.
/// Rows served on the source's node never move, remote rows never increase
/// and no bound is exceeded.
pub fn consolidate(out: &mut Routing, reps: &[Vec<usize>], bounds: &[f64], used: &mut [Vec<f64>], t: Topology) {
    for (src, row) in out.iter_mut().enumerate() {
        let home = t.node(src);
        let mut flow = vec![0.0f64; t.nodes];
        for &(g, rows) in row.iter().flatten() {
            if let Some(f) = flow.get_mut(t.node(g)) {
                *f += rows;
            }
        }
        let mut nodes: Vec<usize> = (0..t.nodes).filter(|&n| n != home && flow[n] > 0.0).collect();
        if nodes.len() < 2 {
            continue;
        }
        nodes.sort_by(|&a, &b| flow[a].total_cmp(&flow[b]).then(a.cmp(&b)));
        for n in nodes {
            let targets: Vec<usize> = (0..t.nodes).filter(|&m| m != home && m != n && flow[m] > 0.0).collect();
            if targets.is_empty() {
                break;
            }
            // Plan every move first; apply only if the whole flow to n finds room.
            let mut moves: Vec<(usize, usize, usize, f64)> = Vec::new(); // (e, from, to, rows)
            let ok = row.iter().enumerate().all(|(e, list)| {
                list.iter().filter(|x| t.node(x.0) == n).all(|&(g, rows)| {
                    let pending = |h: usize| moves.iter().filter(|x| x.0 == e && x.2 == h).map(|x| x.3).sum::<f64>();
                    let to = reps[e]
                        .iter()
                        .copied()
                        .filter(|&h| targets.contains(&t.node(h)) && used[e][h] + pending(h) + rows <= bounds[e])
                        .min_by(|&a, &b| {
                            (used[e][a] + pending(a)).total_cmp(&(used[e][b] + pending(b))).then(a.cmp(&b))
                        });
                    match to {
                        Some(h) => {
                            moves.push((e, g, h, rows));
                            true
                        }
                        None => false,
                    }
                })
            });
            if !ok {
                continue;
            }
            for (e, g, h, rows) in moves {
                row[e].retain(|x| x.0 != g);
                add(&mut row[e], h, rows);
                used[e][g] -= rows;
                used[e][h] += rows;
                flow[t.node(g)] -= rows;
                flow[t.node(h)] += rows;
            }
            flow[n] = 0.0;
        }
    }
}

/// The busiest GPU's routed rows over the mean, and the fraction of rows
/// served on their sender's node.
pub fn routing_stats(r: &Routing, t: Topology) -> (f64, f64) {
    let mut per_gpu = vec![0.0f64; t.world()];
    let (mut local, mut total) = (0.0, 0.0);
    for (src, row) in r.iter().enumerate() {
        for demands in row {
            for &(g, rows) in demands {
                if let Some(x) = per_gpu.get_mut(g) {
                    *x += rows;
                }
                total += rows;
                if t.node(g) == t.node(src) {
                    local += rows;
                }
            }
        }
    }
    let mean = total / t.world().max(1) as f64;
    let busiest = per_gpu.iter().copied().fold(0.0, f64::max);
    if total <= 0.0 {
        (1.0, 1.0)
    } else {
        (busiest / mean, local / total)
    }
}

/// Routed rows each GPU's replicas would take if every expert's rows split
/// evenly over its replicas (what the swaps balance).
pub fn gpu_loads(slots: &[Vec<u32>], loads: &[f64]) -> Vec<f64> {
    let reps = replicas_of(slots, loads.len());
    let share = |e: u32| loads.get(e as usize).map_or(0.0, |l| l / reps[e as usize].len().max(1) as f64);
    slots.iter().map(|es| es.iter().map(|&e| share(e)).sum()).collect()
}

/// The busiest GPU's load over the mean under [`gpu_loads`] (1 when idle).
pub fn imbalance(slots: &[Vec<u32>], loads: &[f64]) -> f64 {
    let g = gpu_loads(slots, loads);
    let mean = g.iter().sum::<f64>() / g.len().max(1) as f64;
    if mean <= 0.0 {
        1.0
    } else {
        g.iter().copied().fold(0.0, f64::max) / mean
    }
}

/// One exchange of slot contents between two GPUs of a node: GPU `a`'s slot
/// `slot_a` takes the expert GPU `b`'s slot `slot_b` held, and the other way
/// round. Slots keep their addresses; only their bytes move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Swap {
    pub a: usize,
    pub slot_a: usize,
    pub b: usize,
    pub slot_b: usize,
}

/// Greedy intra-node swaps for a drifted histogram (Zepp §4.3, §5): in each
/// node, exchange one replica of the heaviest GPU with one of the lightest
/// while that lowers the pair's maximum load, at most 64 times a node. No
/// expert leaves its node, so node-level coverage (and every routing tier
/// a source had) is unchanged, and no weight crosses the scale-out network.
/// Returns the new table (same slot positions, exchanged contents) and the
/// exchanges in order.
pub fn intra_node_swaps(slots: &[Vec<u32>], loads: &[f64], t: Topology) -> (Vec<Vec<u32>>, Vec<Swap>) {
    let reps = replicas_of(slots, loads.len());
    let rep_load = |e: u32| loads.get(e as usize).map_or(0.0, |l| l / reps[e as usize].len().max(1) as f64);
    let mut gpus = slots.to_vec();
    let mut swaps = Vec::new();
    for n in 0..t.nodes {
        let ids: Vec<usize> =
            (0..t.gpus_per_node).map(|i| n * t.gpus_per_node + i).filter(|&g| g < gpus.len()).collect();
        let Some(&first) = ids.first() else { continue };
        for _ in 0..64 {
            let load = |g: usize, gpus: &Vec<Vec<u32>>| gpus[g].iter().map(|&e| rep_load(e)).sum::<f64>();
            let hi = *ids.iter().max_by(|&&a, &&b| load(a, &gpus).total_cmp(&load(b, &gpus))).unwrap_or(&first);
            let lo = *ids.iter().min_by(|&&a, &&b| load(a, &gpus).total_cmp(&load(b, &gpus))).unwrap_or(&first);
            let (lh, ll) = (load(hi, &gpus), load(lo, &gpus));
            let mut best: Option<(usize, usize, f64)> = None;
            for (i, &a) in gpus[hi].iter().enumerate() {
                for (j, &b) in gpus[lo].iter().enumerate() {
                    if gpus[lo].contains(&a) || gpus[hi].contains(&b) {
                        continue;
                    }
                    let d = rep_load(a) - rep_load(b);
                    let new_max = (lh - d).max(ll + d);
                    if new_max < lh - 1e-12 && best.is_none_or(|x| new_max < x.2) {
                        best = Some((i, j, new_max));
                    }
                }
            }
            let Some((i, j, _)) = best else { break };
            let (a, b) = (gpus[hi][i], gpus[lo][j]);
            gpus[hi][i] = b;
            gpus[lo][j] = a;
            swaps.push(Swap { a: hi, slot_a: i, b: lo, slot_b: j });
        }
    }
    (gpus, swaps)
}
