//! Expert replica placement and token routing (Zepp), with the baselines it
//! is measured against: one replica per expert ("none") and DeepSeek's EPLB.
//!
//! Inputs are per-layer expert load histograms (routed rows per expert):
//! seeded synthetic Zipf or drifting ones, or SGLang's expert statistics
//! (`{"logical_count": [[…per expert…] per layer]}`). Every GPU holds the same
//! number of replica slots, `(E + redundant) / W`.
//!
//! - **none**: experts striped contiguously, one replica each.
//! - **EPLB**: hierarchical when expert groups divide the nodes (pack groups to
//!   nodes by load, replicate inside each node the expert with the highest
//!   load per replica, pack replicas to GPUs heaviest first), global
//!   otherwise (replicate over all slots, then pack).
//! - **Zepp**: replica counts from an explicit per-GPU load bound (each
//!   replica's share must fit one GPU's budget) and then the inter-node rows
//!   each replica saves (`zepp_counts`), every replica of an expert on a
//!   different node (so tokens find a local one), packed to
//!   the least-loaded node then GPU; locality-preferred routing by greedy
//!   water-filling within per-replica load bounds (own GPU, then own node,
//!   then remote; `moeforge_plan::placement::route_local`, which the runtime
//!   runs every iteration); merged inter-node transfers (one copy per token per
//!   destination node, node-local pre-reduction on combine) split evenly
//!   over the node's NICs.
//!
//! The modeled MoE-layer latency of a placement is the slowest GPU's
//! dispatch + expert computation + combine under the cost model.

use moeforge_plan::cost::{x_moe, CostModel};
pub use moeforge_plan::placement::{
    intra_node_swaps, route, route_local, route_uniform, routing_stats, Routing, Swap, Topology,
};
use serde::{Deserialize, Serialize};

/// A placement: for each GPU, the experts of its replica slots.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub gpus: Vec<Vec<u32>>,
}

impl Placement {
    /// Replicas of each expert: `(gpu)` list.
    pub fn replicas(&self, experts: usize) -> Vec<Vec<usize>> {
        moeforge_plan::placement::replicas_of(&self.gpus, experts)
    }
}

/// Seeded Zipf loads: `rows` routed rows over `experts`, popularity rank
/// permuted per layer, exponent `s`.
pub fn zipf_loads(layers: usize, experts: usize, rows: f64, s: f64, seed: u64) -> Vec<Vec<f64>> {
    let mut rng = moeforge_plan::rng::SplitMix64(seed ^ 0x5a17_7e9d);
    let mut next = move || rng.next_u64();
    let weights: Vec<f64> = (1..=experts).map(|r| 1.0 / (r as f64).powf(s)).collect();
    let total: f64 = weights.iter().sum();
    (0..layers)
        .map(|_| {
            let mut perm: Vec<usize> = (0..experts).collect();
            for i in (1..experts).rev() {
                perm.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            let mut l = vec![0.0; experts];
            for (rank, &e) in perm.iter().enumerate() {
                l[e] = rows * weights[rank] / total;
            }
            l
        })
        .collect()
}

/// A drifted histogram: each expert takes the load of the expert `shift` places on.
pub fn drift(loads: &[f64], shift: usize) -> Vec<f64> {
    let n = loads.len();
    (0..n).map(|e| loads[(e + shift) % n]).collect()
}

/// SGLang's expert statistics: `{"logical_count": [[count per expert] per layer]}`.
#[derive(Clone, Debug, Deserialize)]
pub struct SglangStats {
    pub logical_count: Vec<Vec<f64>>,
}

pub fn load_sglang(json: &str) -> Result<Vec<Vec<f64>>, String> {
    let s: SglangStats = serde_json::from_str(json).map_err(|e| format!("not SGLang expert statistics: {e}"))?;
    let n = s.logical_count.first().map_or(0, Vec::len);
    if n == 0 || s.logical_count.iter().any(|l| l.len() != n) {
        return Err("`logical_count` must hold one equally long list of counts per layer".into());
    }
    if s.logical_count.iter().flatten().any(|c| !c.is_finite() || *c < 0.0) {
        return Err("counts must be finite and non-negative".into());
    }
    Ok(s.logical_count)
}

fn slots_per_gpu(experts: usize, redundant: usize, t: Topology) -> Result<usize, String> {
    let total = experts + redundant;
    if !total.is_multiple_of(t.world()) {
        return Err(format!(
            "{experts} experts + {redundant} redundant replicas do not fill {} GPUs evenly",
            t.world()
        ));
    }
    let per = total / t.world();
    if per > experts {
        return Err(format!("{per} slots per GPU exceed the {experts} experts: a GPU would hold one expert twice"));
    }
    Ok(per)
}

/// One replica per expert, striped contiguously (needs E divisible by W).
pub fn none(experts: usize, t: Topology) -> Result<Placement, String> {
    let per = slots_per_gpu(experts, 0, t)?;
    Ok(Placement { gpus: (0..t.world()).map(|g| ((g * per) as u32..((g + 1) * per) as u32).collect()).collect() })
}

/// Replica counts: start at one, then repeatedly give one more replica to the
/// expert with the highest load per replica (EPLB's rule), at most `cap`
/// replicas an expert (one per GPU they can go to).
fn replica_counts(loads: &[f64], slots: usize, cap: usize) -> Vec<usize> {
    let mut count = vec![1usize; loads.len()];
    for _ in loads.len()..slots {
        let e = (0..loads.len())
            .filter(|&e| count[e] < cap.max(1))
            .max_by(|&a, &b| (loads[a] / count[a] as f64).total_cmp(&(loads[b] / count[b] as f64)).then(b.cmp(&a)));
        // Every expert at the cap: the slots cannot hold distinct replicas
        // (`distinct` then refuses the placement).
        let Some(e) = e else { break };
        count[e] += 1;
    }
    count
}

/// A placement whose every GPU holds `per_gpu` distinct experts, or why not
/// (two replicas of an expert on one GPU would be one replica's work in two
/// slots, and the slot table could not say which serves a row).
fn distinct(p: Placement, per_gpu: usize) -> Result<Placement, String> {
    for (g, es) in p.gpus.iter().enumerate() {
        let mut sorted = es.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if es.len() != per_gpu || sorted.len() != es.len() {
            return Err(format!(
                "GPU {g} cannot hold {per_gpu} distinct experts under this policy (it got {es:?}); use fewer redundant_experts"
            ));
        }
    }
    Ok(p)
}

/// Packs weighted items into `bins` of `cap` items each, heaviest first to
/// the lightest bin with room, never two items of one `kind` in a bin while
/// another bin with room lacks that kind (two replicas of an expert on one
/// GPU would be one replica's work in two slots). Returns the bin of each item.
fn pack(weights: &[f64], kinds: &[usize], bins: usize, cap: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
    let mut load = vec![0.0f64; bins];
    let mut used = vec![0usize; bins];
    let mut held: Vec<Vec<usize>> = vec![Vec::new(); bins];
    let mut out = vec![0; weights.len()];
    for i in order {
        let b = (0..bins)
            .filter(|&b| used[b] < cap)
            .min_by(|&a, &b| {
                let dup = |x: usize| held[x].contains(&kinds[i]);
                dup(a).cmp(&dup(b)).then(load[a].total_cmp(&load[b])).then(a.cmp(&b))
            })
            .unwrap_or(0);
        held[b].push(kinds[i]);
        out[i] = b;
        load[b] += weights[i];
        used[b] += 1;
    }
    out
}

/// DeepSeek's EPLB for one layer.
pub fn eplb(loads: &[f64], redundant: usize, groups: usize, t: Topology) -> Result<Placement, String> {
    let e = loads.len();
    let per_gpu = slots_per_gpu(e, redundant, t)?;
    let mut gpus: Vec<Vec<u32>> = vec![Vec::new(); t.world()];
    let hierarchical = groups > 1 && groups.is_multiple_of(t.nodes) && e.is_multiple_of(groups) && redundant.is_multiple_of(t.nodes)
            // A node's GPUs each need per_gpu distinct experts of the node's E / nodes.
            && per_gpu <= e / t.nodes;
    if hierarchical {
        // 1. groups to nodes, balancing group load.
        let gsize = e / groups;
        let gload: Vec<f64> = (0..groups).map(|g| loads[g * gsize..(g + 1) * gsize].iter().sum()).collect();
        let node_of_group = pack(&gload, &(0..groups).collect::<Vec<_>>(), t.nodes, groups / t.nodes);
        for n in 0..t.nodes {
            let experts: Vec<usize> = (0..e).filter(|x| node_of_group[x / gsize] == n).collect();
            let local: Vec<f64> = experts.iter().map(|&x| loads[x]).collect();
            // 2. replicate inside the node, 3. pack replicas to its GPUs.
            let counts = replica_counts(&local, per_gpu * t.gpus_per_node, t.gpus_per_node);
            let (items, weights) = expand(&experts, &local, &counts);
            for (i, b) in pack(&weights, &items, t.gpus_per_node, per_gpu).into_iter().enumerate() {
                gpus[n * t.gpus_per_node + b].push(items[i] as u32);
            }
        }
    } else {
        let all: Vec<usize> = (0..e).collect();
        let counts = replica_counts(loads, e + redundant, t.world());
        let (items, weights) = expand(&all, loads, &counts);
        for (i, b) in pack(&weights, &items, t.world(), per_gpu).into_iter().enumerate() {
            gpus[b].push(items[i] as u32);
        }
    }
    gpus.iter_mut().for_each(|g| g.sort_unstable());
    distinct(Placement { gpus }, per_gpu)
}

/// (expert of each replica, load of each replica).
fn expand(experts: &[usize], loads: &[f64], counts: &[usize]) -> (Vec<usize>, Vec<f64>) {
    let mut items = Vec::new();
    let mut weights = Vec::new();
    for (i, &x) in experts.iter().enumerate() {
        for _ in 0..counts[i] {
            items.push(x);
            weights.push(loads[i] / counts[i] as f64);
        }
    }
    (items, weights)
}

/// Zepp's replica counts (§4.1: reduce token traffic under GPU balance
/// constraints). The constraint first: a GPU may carry at most
/// `B = (1 + SLACK) · total / W` rows, so expert `e` needs at least
/// `⌈load_e / B⌉` replicas (one replica's even share must fit a GPU). Then
/// the objective: with an expert's replicas on distinct nodes and
/// locality-preferred routing, the rows of `e` that cross the network are
/// `load_e · (nodes − c_e) / nodes`, so each further replica, up to one per
/// node, saves `load_e / nodes`; the remaining slots go to the largest
/// saving. Slots left once every expert is on every node go by EPLB's rule
/// (highest load per replica), which only balances. When the constraint
/// alone needs more slots than exist, EPLB's counts (the best balance the
/// slots allow) are used.
fn zepp_counts(loads: &[f64], slots: usize, t: Topology) -> Vec<usize> {
    let total: f64 = loads.iter().sum();
    let budget = (1.0 + moeforge_plan::placement::SLACK) * total / t.world().max(1) as f64;
    let cap = t.world().max(1);
    let mut count: Vec<usize> =
        loads.iter().map(|&l| if budget > 0.0 { ((l / budget).ceil() as usize).clamp(1, cap) } else { 1 }).collect();
    if count.iter().sum::<usize>() > slots {
        return replica_counts(loads, slots, cap);
    }
    for _ in count.iter().sum::<usize>()..slots {
        let saving = (0..loads.len())
            .filter(|&e| count[e] < t.nodes)
            .max_by(|&a, &b| loads[a].total_cmp(&loads[b]).then(b.cmp(&a)))
            .filter(|&e| loads[e] > 0.0);
        let e = saving.or_else(|| {
            (0..loads.len())
                .filter(|&e| count[e] < cap)
                .max_by(|&a, &b| (loads[a] / count[a] as f64).total_cmp(&(loads[b] / count[b] as f64)).then(b.cmp(&a)))
        });
        match e {
            Some(e) => count[e] += 1,
            None => break,
        }
    }
    count
}

/// Zepp's placement for one layer: the traffic-reducing counts
/// ([`zepp_counts`], under the per-replica GPU budget) and EPLB's balancing
/// ones, each spread and packed by [`spread`]; `cost` (the caller's modeled
/// MoE-layer latency of a placement, so whichever of communication and
/// balance is the bottleneck decides) picks one. Tie: the traffic-reducing one.
pub fn zepp(
    loads: &[f64],
    redundant: usize,
    t: Topology,
    cost: &dyn Fn(&Placement) -> f64,
) -> Result<Placement, String> {
    let e = loads.len();
    let per_gpu = slots_per_gpu(e, redundant, t)?;
    // A candidate that cannot hold distinct experts per GPU drops out.
    let traffic = spread(loads, &zepp_counts(loads, e + redundant, t), per_gpu, t);
    let balance = spread(loads, &replica_counts(loads, e + redundant, t.world()), per_gpu, t);
    match (traffic, balance) {
        (Ok(a), Ok(b)) => Ok(if cost(&a) <= cost(&b) { a } else { b }),
        (Ok(a), Err(_)) => Ok(a),
        (Err(_), Ok(b)) => Ok(b),
        (Err(why), Err(_)) => Err(why),
    }
}

/// The modeled MoE-layer latency of a placement under Zepp's routing and
/// flows on `loads` (even demand per source): the cost [`zepp`] minimizes.
pub fn zepp_latency<'a>(
    loads: &'a [f64],
    t: Topology,
    shape: LayerShape,
    cm: &'a CostModel,
) -> impl Fn(&Placement) -> f64 + 'a {
    move |p: &Placement| {
        let r = route_local(&p.gpus, &even_demand(loads, t), t, moeforge_plan::placement::SLACK);
        layer_cost(&r, t, shape, cm, Flows::ZEPP).latency
    }
}

/// Rows that cross the network under locality-preferred routing with loose
/// bounds and even demand: expert `e` is local to the nodes holding it.
pub fn remote_rows(p: &Placement, loads: &[f64], t: Topology) -> f64 {
    p.replicas(loads.len())
        .iter()
        .zip(loads)
        .map(|(reps, l)| {
            let mut nodes: Vec<usize> = reps.iter().map(|&g| t.node(g)).collect();
            nodes.sort_unstable();
            nodes.dedup();
            l * (t.nodes - nodes.len().min(t.nodes)) as f64 / t.nodes.max(1) as f64
        })
        .sum()
}

/// Places `counts[e]` replicas of each expert: distinct nodes where
/// possible, heaviest replica first to the least-loaded node, then to that
/// node's least-loaded GPU with a free slot (never one already holding it).
fn spread(loads: &[f64], counts: &[usize], per_gpu: usize, t: Topology) -> Result<Placement, String> {
    let e = loads.len();
    let (items, weights) = expand(&(0..e).collect::<Vec<_>>(), loads, counts);
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(items[a].cmp(&items[b])));
    let mut gpu_load = vec![0.0; t.world()];
    let mut gpus: Vec<Vec<u32>> = vec![Vec::new(); t.world()];
    for i in order {
        let x = items[i] as u32;
        let node_load = |n: usize| (0..t.gpus_per_node).map(|g| gpu_load[n * t.gpus_per_node + g]).sum::<f64>();
        let free = |n: usize| (0..t.gpus_per_node).any(|g| gpus[n * t.gpus_per_node + g].len() < per_gpu);
        // A node with a free slot on a GPU that lacks x (else any free slot).
        let takes = |n: usize| {
            (0..t.gpus_per_node)
                .any(|g| gpus[n * t.gpus_per_node + g].len() < per_gpu && !gpus[n * t.gpus_per_node + g].contains(&x))
        };
        let holds = |n: usize| (0..t.gpus_per_node).any(|g| gpus[n * t.gpus_per_node + g].contains(&x));
        let node = (0..t.nodes)
            .filter(|&n| free(n))
            .min_by(|&a, &b| {
                (!takes(a), holds(a))
                    .cmp(&(!takes(b), holds(b)))
                    .then(node_load(a).total_cmp(&node_load(b)))
                    .then(a.cmp(&b))
            })
            .ok_or("no free replica slot")?;
        let g = (0..t.gpus_per_node)
            .map(|g| node * t.gpus_per_node + g)
            .filter(|&g| gpus[g].len() < per_gpu && !gpus[g].contains(&x))
            .min_by(|&a, &b| gpu_load[a].total_cmp(&gpu_load[b]).then(a.cmp(&b)))
            .or_else(|| (0..t.gpus_per_node).map(|g| node * t.gpus_per_node + g).find(|&g| gpus[g].len() < per_gpu))
            .ok_or("no free replica slot")?;
        gpus[g].push(x);
        gpu_load[g] += weights[i];
    }
    gpus.iter_mut().for_each(|g| g.sort_unstable());
    distinct(Placement { gpus }, per_gpu)
}

/// Every source GPU holding `1/W` of each expert's rows: the demand the
/// modeled comparison routes (the run-time routing gets the live counts).
pub fn even_demand(loads: &[f64], t: Topology) -> Vec<Vec<f64>> {
    let w = t.world();
    vec![loads.iter().map(|x| x / w as f64).collect(); w]
}

/// Modeled latency of one MoE layer and its parts (seconds).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerCost {
    pub latency: f64,
    pub compute: f64,
    pub nvlink: f64,
    pub network: f64,
    /// Inter-node bytes over all NICs (one direction).
    pub inter_node_bytes: f64,
    /// Largest routed rows on one GPU over the mean.
    pub gpu_imbalance: f64,
}

/// What a layer moves: routed experts, top-k, hidden size.
#[derive(Clone, Copy, Debug)]
pub struct LayerShape {
    pub experts: usize,
    pub top_k: f64,
    pub hidden: f64,
}

/// How inter-node flows are shaped and executed.
#[derive(Clone, Copy, Debug)]
pub struct Flows {
    /// One copy of a token per destination node (pre-reduced on combine),
    /// fanned out over that node's NVLink: Zepp's merge, and the per-node
    /// dedup DeepEP's normal kernels already do.
    pub merge: bool,
    /// A node's inter-node bytes spread over all its NICs (else each GPU uses its own).
    pub split: bool,
    /// Expert computation scheduled around the flows (Zepp §4.2): each
    /// source node's dispatch group is computed as it arrives and combine
    /// groups leave as they finish, so the layer is a three-stage pipeline
    /// over the source nodes instead of dispatch, then compute, then combine.
    pub overlap: bool,
}

impl Flows {
    /// NCCL all-to-allv then grouped GEMM (Zepp's A2AV+GEMM baseline): every
    /// (token, remote GPU) pair is its own message, nothing overlaps.
    pub const A2AV: Flows = Flows { merge: false, split: false, overlap: false };
    /// DeepEP's normal kernels: per-node dedup, each GPU on its own NIC, serial.
    pub const DEEPEP: Flows = Flows { merge: true, split: false, overlap: false };
    /// Zepp's execution: merge, NIC split and overlapped scheduling.
    pub const ZEPP: Flows = Flows { merge: true, split: true, overlap: true };
}

/// The slowest GPU's dispatch + expert computation + combine.
pub fn layer_cost(r: &Routing, t: Topology, shape: LayerShape, cm: &CostModel, flows: Flows) -> LayerCost {
    let w = t.world();
    let row_bytes = shape.hidden * 2.0;
    // Rows computed per GPU per expert.
    let mut rows = vec![vec![0.0; shape.experts]; w];
    // Bytes each GPU sends over NVLink and over the network.
    let mut nv = vec![0.0; w];
    let mut net = vec![0.0; w];
    // Inter-node messages each GPU's NIC issues: one per remote GPU it sends
    // to, or one per remote node when flows merge.
    let mut messages = vec![0usize; w];
    for (src, per_e) in r.iter().enumerate() {
        let mut to_gpu = vec![false; w];
        let routed: f64 = per_e.iter().flatten().map(|(_, x)| x).sum();
        let tokens = routed / shape.top_k.max(1.0);
        let mut to_node = vec![0.0; t.nodes];
        for (e, reps) in per_e.iter().enumerate() {
            for &(g, x) in reps {
                rows[g][e] += x;
                if g == src {
                    continue;
                }
                if t.node(g) == t.node(src) {
                    nv[src] += x * row_bytes;
                } else {
                    to_node[t.node(g)] += x;
                    to_gpu[g] |= x > 0.0;
                }
            }
        }
        messages[src] = if flows.merge {
            to_node.iter().filter(|&&x| x > 0.0).count()
        } else {
            to_gpu.iter().filter(|&&b| b).count()
        };
        for (n, &x) in to_node.iter().enumerate() {
            if x <= 0.0 {
                continue;
            }
            if flows.merge {
                // A token needs node n with probability 1-(1-f)^k, f = its rows' share there;
                // the received copy fans out over node n's NVLink.
                let f = (x / routed.max(1e-9)).min(1.0);
                net[src] += tokens * (1.0 - (1.0 - f).powf(shape.top_k)) * row_bytes;
                for i in 0..t.gpus_per_node {
                    nv[n * t.gpus_per_node + i] += x * row_bytes / t.gpus_per_node as f64;
                }
            } else {
                net[src] += x * row_bytes;
            }
        }
    }
    let m_t = u64::from(cm.m_t_prefill);
    let compute: Vec<f64> = rows
        .iter()
        .map(|per| {
            let ints: Vec<u64> = per.iter().map(|x| x.ceil() as u64).collect();
            let active = ints.iter().filter(|&&r| r > 0).count() as f64;
            let routed: f64 = per.iter().sum();
            cm.moe_seconds(x_moe(&ints, m_t) as f64, active, routed, m_t as f64, 1.0, f64::from(cm.sms))
        })
        .collect();
    let nic_time: Vec<f64> = if flows.split {
        (0..w)
            .map(|g| {
                let n = t.node(g);
                let node_total: f64 = (0..t.gpus_per_node).map(|i| net[n * t.gpus_per_node + i]).sum();
                cm.rdma(node_total / t.gpus_per_node as f64)
            })
            .collect()
    } else {
        net.iter().map(|&b| cm.rdma(b)).collect()
    };
    // Each further message costs its NIC one more link latency (the cost
    // model's floor and first latency are in `rdma`): small per-destination
    // transfers are what makes all-to-allv latency-bound at scale (Zepp §3.2).
    let nic_time: Vec<f64> = nic_time
        .iter()
        .zip(&messages)
        .map(|(&t0, &m)| if t0 > 0.0 { t0 + m.saturating_sub(1) as f64 * cm.links.scale_out_latency } else { t0 })
        .collect();
    let nv_time: Vec<f64> = nv.iter().map(|&b| cm.nvlink(b)).collect();
    // Dispatch and combine each cost the link time, compute in between; with
    // overlap, a pipeline over the source nodes' groups.
    let groups = t.nodes.max(1) as f64;
    let per_gpu: Vec<f64> = (0..w)
        .map(|g| {
            let link = nv_time[g].max(nic_time[g]);
            if flows.overlap {
                (2.0 * link + compute[g]) / groups + (groups - 1.0) / groups * link.max(compute[g])
            } else {
                2.0 * link + compute[g]
            }
        })
        .collect();
    let slowest = (0..w).max_by(|&a, &b| per_gpu[a].total_cmp(&per_gpu[b])).unwrap_or(0);
    let total_rows: Vec<f64> = rows.iter().map(|r| r.iter().sum()).collect();
    let mean = total_rows.iter().sum::<f64>() / w as f64;
    LayerCost {
        latency: per_gpu[slowest],
        compute: compute[slowest],
        nvlink: nv_time[slowest],
        network: nic_time[slowest],
        inter_node_bytes: net.iter().sum(),
        gpu_imbalance: total_rows.iter().copied().fold(0.0, f64::max) / mean.max(1e-9),
    }
}
