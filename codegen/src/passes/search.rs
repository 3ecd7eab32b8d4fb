//! Layout search: ExpertPlex Algorithm 1 (§6.3) over the cost model.
//!
//! A layout ℓ splits the world into MoE servers (all routed experts, shared by
//! both phases), prefill attention servers and decode attention servers (one
//! data-parallel attention rank per GPU, holding the non-routed weights and
//! its KV cache), placed per node with prefill and decode servers spread
//! across nodes so the hierarchical prefill path is common. For every layout
//! that fits memory and every decode SM budget q, the largest prefill batch
//! (tokens) and decode batch (requests) whose modeled iteration latencies
//! meet TTFT and TPOT are found by binary search, and the goodput
//! `G(ℓ, q) = min(B_p/T_p, B_d/(T_d·Ō))` (Eq. 1, requests/s) is maximized.
//!
//! Iteration latencies come from the cost model's one iteration-time
//! function ([`Env::iteration`], shared with the simulator) on mean request
//! lengths: decode uses SBO (attention, then the longer of the shared/dense
//! FFN and dispatch + routed MoE + combine); prefill uses TBO (the longer of
//! attention and communication + MoE, per layer). Every GPU keeps the memory
//! plan's workspace ([`Workspace`]). A request can wait one prefill
//! iteration for the batch in flight before its own, so prefill must finish
//! within TTFT / 2; decode is isolated by APK preemption and must fit TPOT.
//! With `strategy = expertplex` the layout pass realizes the best candidate
//! as the GPUs' roles; with `auto` the ranking is advisory and the plan is
//! colocated.

use super::{Ctx, PassError};
use moeforge_dsl::spec::{Deploy, PlacementPolicy, Spec, Strategy};
use moeforge_plan::cost::step::{Env, Load, MoeSide, Sms};
use moeforge_plan::cost::CostModel;
use moeforge_plan::memory::Workspace;
use moeforge_plan::search::{moe_side, Candidate, SearchResult};
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

impl Lengths<'_> {
    /// Decode iteration with `b` requests over the decode servers, decode holding `q` SMs.
    fn t_decode(&self, c: &Shape, b: f64, q: u32) -> f64 {
        let per = b / f64::from(c.decode);
        let s = self.input + self.output / 2.0;
        let groups = [Load::decode(per, per * s).times(c.decode)];
        self.env.iteration(&groups, 1, 1.0, c.side, Sms::fixed(q), 0.0).seconds
    }

    /// Prefill iteration with `tokens` input tokens (prefill gets the SMs decode does not use).
    fn t_prefill(&self, c: &Shape, tokens: f64, q: u32) -> f64 {
        let per = tokens / f64::from(c.prefill);
        let groups = [Load::prompts(per / self.input, self.input).times(c.prefill)];
        let sms = self.env.cm.sms.saturating_sub(q).max(1);
        self.env.iteration(&groups, 1, 1.0, c.side, Sms::fixed(sms), 0.0).seconds
    }
}

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
/// layout pass reads it), and never fails: a deployment no layout serves
/// gets an empty ranking.
pub fn run(cx: &Ctx<'_>, plan: &mut Plan) -> Result<(), Vec<PassError>> {
    if matches!(cx.deploy.strategy, Strategy::Expertplex | Strategy::Auto) {
        plan.search = Some(search(cx.spec, cx.deploy, &plan.cost));
    }
    Ok(())
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
    let sizes = counts(world);
    let mut all: Vec<Candidate> = Vec::new();
    let (mut considered, mut fitting) = (0, 0);
    for &moe in sizes.iter().filter(|&&m| m + 2 <= world) {
        for &prefill in sizes.iter().filter(|&&p| moe + p < world) {
            let decode = world - moe - prefill;
            considered += 1;
            // FitsMemory: the most expert slots any MoE server holds (the
            // stripes' ⌈E/moe⌉, or ⌈(E+R)/moe⌉ with R redundant replicas),
            // non-routed weights and at least one request's KV on every
            // attention server (the batch searches below stop at the KV
            // capacity, so the chosen batches' KV fits).
            let redundant = if d.placement.policy == PlacementPolicy::None { 0 } else { d.placement.redundant_experts };
            let slots_per_gpu = (m.moe.experts + redundant).div_ceil(moe);
            let moe_need = routed / f64::from(m.moe.experts) * f64::from(slots_per_gpu) + env.workspace;
            let attn_room = env.usable - env.nonrouted - env.workspace;
            let one_request = env.kv_token * (cx.input + cx.output);
            if moe_need > env.usable || attn_room < one_request {
                continue;
            }
            let Some(sh) = shape(prefill, decode, c.nodes, c.gpus_per_node) else { continue };
            // A realized layout's replicated placement fills every MoE
            // server's slots evenly, over a uniform topology.
            let slots = m.moe.experts + d.placement.redundant_experts;
            let realized = d.strategy == Strategy::Expertplex && d.placement.policy != PlacementPolicy::None;
            // (no GPU holding an expert twice).
            if realized && (!uniform_moe(&sh.per_node) || !slots.is_multiple_of(moe) || slots / moe > m.moe.experts) {
                continue;
            }
            fitting += 1;
            let kv_decode =
                (attn_room / one_request * f64::from(decode)).floor().min(f64::from(MAX_DECODE_BATCH)) as u32;
            let kv_prefill =
                (attn_room / env.kv_token * f64::from(prefill)).floor().min(f64::from(MAX_PREFILL_TOKENS)) as u32;
            for &q in &qs {
                let bd = max_feasible(kv_decode, |b| cx.t_decode(&sh, f64::from(b), q) <= d.slo.tpot);
                let bp = max_feasible(kv_prefill, |t| cx.t_prefill(&sh, f64::from(t), q) <= d.slo.ttft / 2.0);
                if bd == 0 || (f64::from(bp) < cx.input) {
                    continue;
                }
                let (t_d, t_p) = (cx.t_decode(&sh, f64::from(bd), q), cx.t_prefill(&sh, f64::from(bp), q));
                let prefill_rate = f64::from(bp) / cx.input / t_p;
                let decode_rate = f64::from(bd) / (t_d * cx.output);
                all.push(Candidate {
                    moe_gpus: moe,
                    prefill_gpus: prefill,
                    decode_gpus: decode,
                    // Filled in for the ranked few (a layout's nodes can be many).
                    per_node: Vec::new(),
                    q,
                    prefill_tokens: bp,
                    t_prefill: t_p,
                    decode_batch: bd,
                    t_decode: t_d,
                    prefill_rate,
                    decode_rate,
                    goodput: prefill_rate.min(decode_rate),
                });
            }
        }
    }
    let feasible = all.len() as u32;
    // Best per layout (over q), then layouts by goodput; ties to fewer MoE GPUs, then smaller q.
    all.sort_by(|a, b| {
        b.goodput
            .total_cmp(&a.goodput)
            .then(a.moe_gpus.cmp(&b.moe_gpus))
            .then(a.prefill_gpus.cmp(&b.prefill_gpus))
            .then(a.q.cmp(&b.q))
    });
    let mut ranked: Vec<Candidate> = Vec::new();
    for cand in all {
        if ranked.len() == 5 {
            break;
        }
        if !ranked.iter().any(|r| (r.moe_gpus, r.prefill_gpus) == (cand.moe_gpus, cand.prefill_gpus)) {
            let per_node = shape(cand.prefill_gpus, cand.decode_gpus, c.nodes, c.gpus_per_node).map(|s| s.per_node);
            ranked.push(Candidate { per_node: per_node.unwrap_or_default(), ..cand });
        }
    }
    SearchResult {
        mean_input: cx.input,
        mean_output: cx.output,
        layouts_considered: considered,
        layouts_fitting: fitting,
        feasible,
        ranked,
    }
}
