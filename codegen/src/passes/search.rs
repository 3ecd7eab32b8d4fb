//! Layout search: ExpertPlex Algorithm 1 (§6.3) over the cost model.
//!
//! A layout ℓ splits the world into MoE servers (all routed experts, shared by
//! both phases), prefill attention servers and decode attention servers,
//! placed per node with prefill and decode servers spread across nodes so
//! the hierarchical prefill path is common. §6.1 chooses parallelism,
//! placement and overlap jointly, and so does this search: for every layout
//! that fits memory and every decode SM budget q, each phase tries
//! - its attention as data-parallel ranks (one GPU each) or tensor-parallel
//!   groups of 2, 4, … GPUs inside a node (weights shard over the group; KV
//!   heads shard, or replicate for MLA and past the KV head count), and
//! - its overlap strategy: TBO, SBO or none ([`Overlap`]),
//!
//! and keeps the choice whose largest batch meeting its SLO (prefill tokens
//! within TTFT / 2, decode requests within TPOT, each found by binary
//! search and capped by the KV its servers hold) serves the most requests
//! per second. The phases' choices are independent (a phase's batch and
//! time depend on its own), so the best per phase maximizes the goodput
//! `G(ℓ, q) = min(B_p/T_p, B_d/(T_d·Ō))` (Eq. 1, requests/s).
//!
//! Iteration latencies come from the cost model's one iteration-time
//! function ([`Env::iteration`], shared with the simulator) on mean request
//! lengths. Every GPU keeps the memory plan's workspace ([`Workspace`]). A
//! request can wait one prefill iteration for the batch in flight before
//! its own, so prefill must finish within TTFT / 2; decode is isolated by
//! APK preemption and must fit TPOT. With `strategy = expertplex` the layout
//! pass realizes the best candidate with data-parallel attention (the one
//! role plans execute; [`SearchResult::realizable`]) as the GPUs' roles and
//! its overlap as their schedule's. With `auto` the pass also weighs
//! ExpertPlex against PD and colocated serving ([`alternatives`]) and the
//! layout pass realizes the best.

use super::{Ctx, PassError};
use moeforge_dsl::spec::{Deploy, PlacementPolicy, Spec, Strategy};
use moeforge_plan::cost::step::{Env, Load, MoeSide, Overlap, Overlaps, Sms};
use moeforge_plan::cost::CostModel;
use moeforge_plan::memory::Workspace;
use moeforge_plan::search::{moe_side, Alternative, Candidate, SearchResult};
use moeforge_plan::workload::{mean, Side};
use moeforge_plan::Plan;

/// Largest batches the search considers.
pub const MAX_DECODE_BATCH: u32 = 8192;
pub const MAX_PREFILL_TOKENS: u32 = 262_144;

/// Mean-length iteration times of a layout, through the cost model's one
/// iteration-time function ([`Env::iteration`]).
struct Lengths<'a> {
    env: &'a Env,
    input: f64,
    output: f64,
}

/// How one role runs its attention: groups of `width` GPUs (1: data
/// parallel) and the phase's overlap strategy.
#[derive(Clone, Copy)]
struct Attn {
    width: u32,
    overlap: Overlap,
}

impl Lengths<'_> {
    /// Decode iteration with `b` requests over the decode servers, decode
    /// holding `q` SMs. A request is never split between attention groups,
    /// and the slowest group (⌈b / groups⌉ requests) sets the pace: every
    /// group is charged as that one (which overstates the routed rows by
    /// fewer than one request per group).
    fn t_decode(&self, c: &Shape, a: Attn, b: f64, q: u32) -> f64 {
        let groups = c.decode / a.width;
        let per = (b / f64::from(groups)).ceil();
        let s = self.input + self.output / 2.0;
        let loads = [Load::decode(per, per * s).times(groups)];
        let overlap = Overlaps { decode: a.overlap, ..Overlaps::STANDARD };
        self.env.iteration(&loads, a.width, 1.0, c.side, Sms::fixed(q), 0.0, overlap).seconds
    }

    /// Prefill iteration with `tokens` input tokens (prefill gets the SMs decode does not use).
    fn t_prefill(&self, c: &Shape, a: Attn, tokens: f64, q: u32) -> f64 {
        let groups = c.prefill / a.width;
        let per = tokens / f64::from(groups);
        let loads = [Load::prompts(per / self.input, self.input).times(groups)];
        let sms = self.env.cm.sms.saturating_sub(q).max(1);
        let overlap = Overlaps { prefill: a.overlap, ..Overlaps::STANDARD };
        self.env.iteration(&loads, a.width, 1.0, c.side, Sms::fixed(sms), 0.0, overlap).seconds
    }
}

/// One phase's best choice on a (layout, q): its attention and overlap,
/// the largest batch meeting its SLO within the KV its servers hold, the
/// iteration time, the requests per second, and whether KV (not the SLO)
/// capped the batch.
#[derive(Clone, Copy)]
struct Phase {
    attn: Attn,
    batch: u32,
    seconds: f64,
    rate: f64,
    kv_bound: bool,
}

/// The attention widths a role of `counts` GPUs per node can use: 1 (data
/// parallel) and every power of two up to the node size that divides each
/// node's count (a TP group never spans nodes).
fn widths(counts: impl Iterator<Item = u32> + Clone, gpn: u32) -> Vec<u32> {
    let total: u32 = counts.clone().sum();
    (0..)
        .map(|k| 1u32 << k)
        .take_while(|&w| w <= gpn && w <= total.max(1))
        .filter(|&w| counts.clone().all(|n| n.is_multiple_of(w)))
        .collect()
}

/// The best of `choices` by `rate` (ties to the earlier: narrower
/// attention, then no overlap before SBO before TBO, the simpler schedule).
fn best_phase(choices: impl Iterator<Item = Phase>) -> Option<Phase> {
    choices.fold(None, |best: Option<Phase>, p| match best {
        Some(b) if b.rate >= p.rate => Some(b),
        _ => Some(p),
    })
}

/// The overlap strategies in tie-breaking order (the simplest first).
const OVERLAPS: [Overlap; 3] = [Overlap::None, Overlap::Sbo, Overlap::Tbo];

/// A layout's counts and where they sit.
struct Shape {
    prefill: u32,
    decode: u32,
    per_node: Vec<[u32; 3]>,
    side: MoeSide,
}

/// Spreads `n` over `nodes` as evenly as possible, earlier nodes first.
fn spread(n: u32, nodes: u32) -> Vec<u32> {
    (0..nodes).map(|i| n / nodes + u32::from(i < n % nodes)).collect()
}

fn shape(prefill: u32, decode: u32, nodes: u32, gpn: u32) -> Option<Shape> {
    let p = spread(prefill, nodes);
    // Decode servers fill nodes from the other end so both roles spread.
    let mut d = spread(decode, nodes);
    d.reverse();
    let mut per_node = Vec::with_capacity(nodes as usize);
    for i in 0..nodes as usize {
        let used = p[i] + d[i];
        if used > gpn {
            return None;
        }
        per_node.push([gpn - used, p[i], d[i]]);
    }
    Some(Shape { prefill, decode, side: moe_side(&per_node), per_node })
}

/// Whether every node holding MoE servers holds the same number: a
/// replicated placement over the MoE servers needs that (its topology is
/// nodes × GPUs per node), so an `expertplex` deployment with one
/// considers no other layout.
pub use moeforge_plan::roles::uniform_moe;

/// The decode SM budgets q the search tries: 1/8 … 6/8 of the SMs, each
/// rounded up to whole CTA clusters and kept in [cluster, Q_max] so that
/// prefill always keeps a cluster. None when the GPU holds fewer than two
/// clusters (the phases cannot share its SMs).
pub fn decode_budgets(sms: u32, cluster: u32) -> Vec<u32> {
    let cluster = cluster.max(1);
    if sms < 2 * cluster {
        return Vec::new();
    }
    let top = moeforge_plan::cost::q_max(sms, cluster);
    let mut qs: Vec<u32> =
        (1..=6u32).map(|f| ((sms * f / 8).div_ceil(cluster) * cluster).clamp(cluster, top)).collect();
    qs.dedup();
    qs
}

/// Server counts the search enumerates for `world` GPUs: every count on
/// clusters of up to [`DENSE_WORLD`] GPUs, then 1–8 and a grid of about 64
/// steps, so the search stays a few thousand layouts on any cluster.
fn counts(world: u32) -> Vec<u32> {
    if world <= DENSE_WORLD {
        return (1..world).collect();
    }
    let step = world.div_ceil(64);
    let mut v: Vec<u32> = (1..=8).chain((1..).map(|k| k * step).take_while(|&n| n < world)).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Largest cluster on which the search tries every server count.
pub const DENSE_WORLD: u32 = 96;

/// Largest integer in `[1, hi]` with `ok`, assuming `ok` is monotone; 0 if none.
fn max_feasible(hi: u32, ok: impl Fn(u32) -> bool) -> u32 {
    if hi == 0 || !ok(1) {
        return 0;
    }
    let (mut lo, mut hi) = (1u32, hi);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if ok(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Writes `plan.search` for the `expertplex` and `auto` strategies (the
/// layout pass reads it), with `auto`'s comparison of the strategies the
/// planner realizes, and never fails: a deployment no layout serves gets an
/// empty ranking.
pub fn run(cx: &Ctx<'_>, plan: &mut Plan) -> Result<(), Vec<PassError>> {
    if matches!(cx.deploy.strategy, Strategy::Expertplex | Strategy::Auto) {
        let mut s = search(cx.spec, cx.deploy, &plan.cost);
        if cx.deploy.strategy == Strategy::Auto {
            s.alternatives = alternatives(cx.spec, cx.deploy, &plan.cost, &s);
        }
        plan.search = Some(s);
    }
    Ok(())
}

/// `auto`'s comparison: Eq. 1's goodput of each strategy the planner
/// realizes, on the same iteration-time function and mean lengths as the
/// search, the best first (ties to the earlier of ExpertPlex, PD,
/// colocated). A strategy that cannot serve the deployment is listed with
/// goodput 0 and why.
/// - **ExpertPlex**: the search's best layout a role plan executes.
/// - **PD** (whole-model instances, [`Env::pd_unit`]): Eq. 1 over its
///   prefill and decode instances, the prompt's KV handoff (`Env::kv_move`,
///   what the simulator charges) delaying the first decode step and so
///   spread over the output's TPOT; not with a replicated placement (PD
///   plans take none).
/// - **Colocated** (data-parallel attention and EP on every GPU, SGLang's
///   prefill-first scheduling): the phases time-share the GPUs in cycles of
///   one decode iteration and, when requests arrived during it, one
///   prefill iteration of them. At rate λ with cycles of TPOT τ, B_d =
///   λ·τ·Ō requests decode (Little's law) and a cycle prefills with
///   probability 1 − e^(−λτ); the goodput is the largest λ whose mean cycle
///   T_d(B_d) + (1 − e^(−λτ))·T_p fits τ, with the prefill within TTFT / 2
///   and the batch's KV within the GPUs'.
pub fn alternatives(spec: &Spec, d: &Deploy, cm: &CostModel, search: &SearchResult) -> Vec<Alternative> {
    let m = spec.model(d.model);
    let c = spec.cluster(d.cluster);
    let env = Env::new(m, c, spec.tile_set(d.tiles), d, cm, Workspace::of(m, false).bytes());
    let (input, output) = (search.mean_input, search.mean_output);
    let world = c.world_size();
    let sms = Sms::all(cm.sms);
    let ttft = d.slo.ttft / 2.0;
    // Tokens of KV per GPU of a data-parallel rank holding `weights` bytes of weights.
    let kv_per_gpu = |weights: f64| (env.usable - weights - env.workspace).max(0.0) / env.kv_token;
    let t_decode = |b: u32, groups: u32, side: MoeSide| {
        let per = (f64::from(b) / f64::from(groups)).ceil();
        let load = Load::decode(per, per * (input + output / 2.0)).times(groups);
        env.iteration(&[load], 1, 1.0, side, sms, 0.0, Overlaps::STANDARD).seconds
    };
    let t_prefill = |tokens: u32, groups: u32, side: MoeSide| {
        let load = Load::prompts(f64::from(tokens) / f64::from(groups) / input, input).times(groups);
        env.iteration(&[load], 1, 1.0, side, sms, 0.0, Overlaps::STANDARD).seconds
    };
    // The largest prefill batch meeting TTFT / 2 within `kv` tokens, and its requests per second.
    let prefill_rate = |groups: u32, side: MoeSide, kv: f64| {
        let cap = kv.min(f64::from(MAX_PREFILL_TOKENS)) as u32;
        let bp = max_feasible(cap, |t| t_prefill(t, groups, side) <= ttft);
        if f64::from(bp) < input {
            0.0
        } else {
            f64::from(bp) / input / t_prefill(bp, groups, side)
        }
    };
    let mut out = Vec::new();
    let xp = search.realizable();
    out.push(Alternative {
        strategy: Strategy::Expertplex,
        label: xp.map_or("no data-parallel layout meets both SLOs".into(), |b| {
            format!("{}P{}D{}E q={}", b.prefill_gpus, b.decode_gpus, b.moe_gpus, b.q)
        }),
        goodput: xp.map_or(0.0, |b| b.goodput),
    });
    // PD.
    let pd = match (env.pd_unit(), d.placement.policy) {
        (_, p) if p != PlacementPolicy::None => Alternative {
            strategy: Strategy::PdDisagg,
            label: "PD plans take no replicated placement".into(),
            goodput: 0.0,
        },
        (Err(unit), _) => Alternative {
            strategy: Strategy::PdDisagg,
            label: format!("a whole-model instance needs {unit} GPUs; {world} cannot hold one of each phase"),
            goodput: 0.0,
        },
        (Ok(unit), _) if !world.is_multiple_of(unit) => Alternative {
            strategy: Strategy::PdDisagg,
            label: format!("{world} GPUs do not split into instances of {unit}"),
            goodput: 0.0,
        },
        (Ok(unit), _) => {
            let instances = world / unit;
            let (np, nd) = (instances / 2, instances - instances / 2);
            let side = |replicas: u32| MoeSide::Ep {
                gpus: unit,
                nodes: unit.div_ceil(c.gpus_per_node),
                replicas,
                local: (f64::from(c.gpus_per_node) / f64::from(unit)).min(1.0),
                disaggregated: false,
            };
            let kv = kv_per_gpu(env.weights_per_gpu(1, unit));
            let rp = prefill_rate(np * unit, side(np), kv * f64::from(np * unit));
            let cap = ((kv / (input + output)).floor() * f64::from(nd * unit)).min(f64::from(MAX_DECODE_BATCH)) as u32;
            // The prompt's KV moves to the decode instance before its first
            // decode step: one step's delay spread over the output's TPOT.
            let handoff = env.kv_move(input) / (output - 1.0).max(1.0);
            let bd = max_feasible(cap, |b| t_decode(b, nd * unit, side(nd)) + handoff <= d.slo.tpot);
            let rd = if bd == 0 { 0.0 } else { f64::from(bd) / (t_decode(bd, nd * unit, side(nd)) * output) };
            Alternative {
                strategy: Strategy::PdDisagg,
                label: format!("{np}P{nd}D × DP{unit}EP{unit}"),
                goodput: rp.min(rd),
            }
        }
    };
    out.push(pd);
    // Colocated, prefill first: a cycle is one decode iteration of the
    // running batch, then, when requests arrived during it, one prefill
    // iteration of them.
    let side = MoeSide::Ep {
        gpus: world,
        nodes: c.nodes,
        replicas: 1,
        local: f64::from(c.gpus_per_node) / f64::from(world),
        disaggregated: false,
    };
    let kv = kv_per_gpu(env.weights_per_gpu(1, world)) * f64::from(world);
    let tau = d.slo.tpot;
    let serves = |lambda: f64| {
        // At arrival rate λ and cycle τ (the TPOT): B_d = λ·τ·Ō requests
        // decode (Little's law), and a cycle prefills with probability
        // 1 − e^(−λτ) the λ·τ·Ī tokens that arrived, as one batch.
        let decode = (lambda * tau * output).ceil();
        let arrived = 1.0 - (-lambda * tau).exp();
        let tokens = (lambda * tau * input / arrived.max(1e-12)).ceil();
        let t_p = t_prefill(tokens as u32, world, side);
        let cycle = t_decode(decode as u32, world, side) + arrived * t_p;
        cycle <= tau && t_p <= ttft && decode * (input + output) <= kv && decode <= f64::from(MAX_DECODE_BATCH)
    };
    // The largest such λ, by bisection (the cycle grows with λ).
    let (mut lo, mut hi) = (0.0, f64::from(MAX_DECODE_BATCH) / (tau * output));
    if serves(1e-6) {
        for _ in 0..60 {
            let mid = 0.5 * (lo + hi);
            if serves(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
    }
    out.push(Alternative { strategy: Strategy::Colocated, label: format!("DP{world}EP{world}"), goodput: lo });
    // Stable: ties keep the order above.
    out.sort_by(|a, b| b.goodput.total_cmp(&a.goodput));
    out
}

/// ExpertPlex Algorithm 1 for deployment `d` on cost model `cm`.
pub fn search(spec: &Spec, d: &Deploy, cm: &CostModel) -> SearchResult {
    let m = spec.model(d.model);
    let c = spec.cluster(d.cluster);
    let tiles = spec.tile_set(d.tiles);
    let world = c.world_size();
    let env = Env::new(m, c, tiles, d, cm, Workspace::of(m, false).bytes());
    let routed = env.weights - env.nonrouted;
    let cx = Lengths {
        env: &env,
        input: mean(&d.workload.input, Side::Input),
        output: mean(&d.workload.output, Side::Output),
    };
    let qs = decode_budgets(cm.sms, cm.cluster);
    // SBO overlaps the shared experts with the routed ones' communication:
    // a model without shared experts has nothing to put beside it (its
    // programs run SBO as no overlap).
    let overlaps: Vec<Overlap> =
        OVERLAPS.into_iter().filter(|&o| o != Overlap::Sbo || m.moe.shared_experts > 0).collect();
    let mut feasible = 0;
    let sizes = counts(world);
    let gpn = c.gpus_per_node;
    // Per GPU of a width-w attention group: the room left for KV once its
    // 1/w of the non-routed weights (attention and dense FFN shard over the
    // group, as the cost model's attention does) and the workspace are in,
    // and the bytes one token's KV takes there (GQA heads shard, MLA's
    // latent replicates: `Env::kv_fraction`).
    let attn_room = |w: u32| env.usable - env.nonrouted / f64::from(w) - env.workspace;
    let kv_token = |w: u32| env.kv_token * env.kv_fraction(w);
    let full_request = cx.input + cx.output;
    let mut all: Vec<Candidate> = Vec::new();
    let (mut considered, mut fitting) = (0, 0);
    for &moe in sizes.iter().filter(|&&m| m + 2 <= world) {
        for &prefill in sizes.iter().filter(|&&p| moe + p < world) {
            let decode = world - moe - prefill;
            considered += 1;
            // FitsMemory: the most expert slots any MoE server holds (the
            // stripes' ⌈E/moe⌉, or ⌈(E+R)/moe⌉ with R redundant replicas)
            // and, on the attention servers, non-routed weights and KV. The
            // KV asked for is that of each phase's largest batch meeting
            // its SLO: the batch searches below stop at what the servers
            // hold, and a layout that holds less serves the smaller batch
            // (`Candidate::{prefill,decode}_kv_bound` say which did).
            let redundant = if d.placement.policy == PlacementPolicy::None { 0 } else { d.placement.redundant_experts };
            let slots_per_gpu = (m.moe.experts + redundant).div_ceil(moe);
            let moe_need = routed / f64::from(m.moe.experts) * f64::from(slots_per_gpu) + env.workspace;
            if moe_need > env.usable {
                continue;
            }
            let Some(sh) = shape(prefill, decode, c.nodes, gpn) else { continue };
            // A realized layout's replicated placement fills every MoE
            // server's slots evenly, over a uniform topology.
            let slots = m.moe.experts + d.placement.redundant_experts;
            let realized = matches!(d.strategy, Strategy::Expertplex | Strategy::Auto)
                && d.placement.policy != PlacementPolicy::None;
            // (no GPU holding an expert twice).
            if realized && (!uniform_moe(&sh.per_node) || !slots.is_multiple_of(moe) || slots / moe > m.moe.experts) {
                continue;
            }
            // Attention choices whose servers hold at least one request.
            let fits = |w: u32| attn_room(w) >= kv_token(w) * full_request;
            let pw: Vec<u32> = widths(sh.per_node.iter().map(|n| n[1]), gpn).into_iter().filter(|&w| fits(w)).collect();
            let dw: Vec<u32> = widths(sh.per_node.iter().map(|n| n[2]), gpn).into_iter().filter(|&w| fits(w)).collect();
            if pw.is_empty() || dw.is_empty() {
                continue;
            }
            fitting += 1;
            for &q in &qs {
                let decode_choices = dw
                    .iter()
                    .flat_map(|&width| overlaps.iter().map(move |&overlap| Attn { width, overlap }))
                    .map(|a| {
                        let kv = (attn_room(a.width) / (kv_token(a.width) * full_request)).floor()
                            * f64::from(decode / a.width);
                        let cap = kv.min(f64::from(MAX_DECODE_BATCH)) as u32;
                        let ok = |b: u32| cx.t_decode(&sh, a, f64::from(b), q) <= d.slo.tpot;
                        let batch = max_feasible(cap, ok);
                        let seconds = cx.t_decode(&sh, a, f64::from(batch.max(1)), q);
                        let rate = if batch == 0 { 0.0 } else { f64::from(batch) / (seconds * cx.output) };
                        let kv_bound = batch == cap && f64::from(cap) == kv && ok(cap + 1);
                        Phase { attn: a, batch, seconds, rate, kv_bound }
                    });
                let prefill_choices = pw
                    .iter()
                    .flat_map(|&width| overlaps.iter().map(move |&overlap| Attn { width, overlap }))
                    .map(|a| {
                        let kv = (attn_room(a.width) / kv_token(a.width)).floor() * f64::from(prefill / a.width);
                        let cap = kv.min(f64::from(MAX_PREFILL_TOKENS)) as u32;
                        let ok = |t: u32| cx.t_prefill(&sh, a, f64::from(t), q) <= d.slo.ttft / 2.0;
                        let batch = max_feasible(cap, ok);
                        let seconds = cx.t_prefill(&sh, a, f64::from(batch.max(1)), q);
                        // A batch must hold at least one mean prompt.
                        let rate =
                            if f64::from(batch) < cx.input { 0.0 } else { f64::from(batch) / cx.input / seconds };
                        let kv_bound = batch == cap && f64::from(cap) == kv && ok(cap + 1);
                        Phase { attn: a, batch, seconds, rate, kv_bound }
                    });
                let decode_choices: Vec<Phase> = decode_choices.collect();
                let prefill_choices: Vec<Phase> = prefill_choices.collect();
                // The best choice, and the best data-parallel one when it
                // differs: role plans execute data-parallel attention only
                // (`SearchResult::realizable`).
                let dp_only = |p: &&Phase| p.attn.width == 1;
                let best = (best_phase(decode_choices.iter().copied()), best_phase(prefill_choices.iter().copied()));
                let dp = (
                    best_phase(decode_choices.iter().filter(dp_only).copied()),
                    best_phase(prefill_choices.iter().filter(dp_only).copied()),
                );
                // Tensor-parallel attention only where it raises the goodput
                // itself (a faster phase that does not bind G is not worth
                // a layout role plans cannot execute).
                let goodput = |p: (Option<Phase>, Option<Phase>)| p.0.zip(p.1).map_or(0.0, |(d, p)| d.rate.min(p.rate));
                let pairs = if goodput(best) > goodput(dp) { vec![best, dp] } else { vec![dp] };
                let before = all.len();
                for pair in pairs {
                    let (Some(de), Some(pr)) = pair else { continue };
                    if de.rate == 0.0 || pr.rate == 0.0 {
                        continue;
                    }
                    all.push(Candidate {
                        moe_gpus: moe,
                        prefill_gpus: prefill,
                        decode_gpus: decode,
                        // Filled in for the ranked few (a layout's nodes can be many).
                        per_node: Vec::new(),
                        q,
                        prefill_width: pr.attn.width,
                        decode_width: de.attn.width,
                        overlap: Overlaps { prefill: pr.attn.overlap, decode: de.attn.overlap },
                        prefill_kv_bound: pr.kv_bound,
                        decode_kv_bound: de.kv_bound,
                        prefill_tokens: pr.batch,
                        t_prefill: pr.seconds,
                        decode_batch: de.batch,
                        t_decode: de.seconds,
                        prefill_rate: pr.rate,
                        decode_rate: de.rate,
                        goodput: pr.rate.min(de.rate),
                    });
                }
                // A (layout, q) counts once, whichever attention it keeps.
                feasible += u32::from(all.len() > before);
            }
        }
    }
    // Best per layout (over q), then layouts by goodput; ties to fewer MoE GPUs, then smaller q.
    all.sort_by(|a, b| {
        b.goodput
            .total_cmp(&a.goodput)
            .then(a.moe_gpus.cmp(&b.moe_gpus))
            .then(a.prefill_gpus.cmp(&b.prefill_gpus))
            .then(a.q.cmp(&b.q))
    });
    // Up to five layouts (a layout with tensor-parallel attention and the
    // same layout with data-parallel attention count apart), and the best
    // data-parallel one whenever none of those is.
    let key = |c: &Candidate| (c.moe_gpus, c.prefill_gpus, c.data_parallel());
    let mut ranked: Vec<Candidate> = Vec::new();
    for cand in &all {
        let full = ranked.len() >= 5;
        if full && ranked.iter().any(Candidate::data_parallel) {
            break;
        }
        if (full && !cand.data_parallel()) || ranked.iter().any(|r| key(r) == key(cand)) {
            continue;
        }
        let per_node = shape(cand.prefill_gpus, cand.decode_gpus, c.nodes, c.gpus_per_node).map(|s| s.per_node);
        ranked.push(Candidate { per_node: per_node.unwrap_or_default(), ..cand.clone() });
    }
    SearchResult {
        mean_input: cx.input,
        mean_output: cx.output,
        layouts_considered: considered,
        layouts_fitting: fitting,
        feasible,
        ranked,
        alternatives: Vec::new(),
    }
}
