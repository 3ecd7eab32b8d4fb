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
//! Iteration latency sums the layers' critical paths: decode uses SBO
//! (attention, then the longer of the shared/dense FFN and dispatch + routed
//! MoE + combine); prefill uses TBO (the longer of attention and
//! communication + MoE, per layer). A request can wait one prefill
//! iteration for the batch in flight before its own, so prefill must finish
//! within TTFT / 2; decode is isolated by APK preemption and must fit TPOT.
//! The result is advisory in this version: the bundle's memory plan and
//! kernels still follow the colocated layout.

use moeforge_dsl::spec::{Deploy, Spec};
use moeforge_plan::cost::{expected_x_moe, CostModel};
use moeforge_plan::search::{Candidate, SearchResult};
use moeforge_plan::workload::{mean, Side};

/// Largest batches the search considers.
pub const MAX_DECODE_BATCH: u32 = 8192;
pub const MAX_PREFILL_TOKENS: u32 = 262_144;
/// Workspace reserved on every GPU (communication buffers, scratch).
pub const WORKSPACE: f64 = 2.0 * (1u64 << 30) as f64;

struct Ctx<'a> {
    cm: &'a CostModel,
    moe_layers: f64,
    dense_layers: f64,
    hidden: f64,
    experts: f64,
    top_k: f64,
    input: f64,
    output: f64,
    /// KV bytes per token (all layers).
    kv_token: f64,
    gpus_per_node: u32,
    nodes: u32,
}

impl Ctx<'_> {
    /// Decode iteration with `b` requests.
    fn t_decode(&self, c: &Shape, b: f64, q: u32) -> f64 {
        let cm = self.cm;
        let per = b / f64::from(c.decode);
        let s = self.input + self.output / 2.0;
        let attn = cm.attn_decode.eval(per, s);
        let ffn = cm.ffn.eval(per, 0.0);
        let comm = 2.0 * self.dispatch(c, per, false);
        let x = expected_x_moe(b * self.top_k, self.experts, self.experts / f64::from(c.moe), f64::from(cm.m_t_decode));
        let moe = cm.moe_time(x, q);
        let moe_layer = attn + ffn.max(comm + moe);
        let dense_layer = attn + ffn;
        self.moe_layers * moe_layer + self.dense_layers * dense_layer + cm.head.eval(per, 0.0)
    }

    /// Prefill iteration with `tokens` input tokens (prefill gets the SMs decode does not use).
    fn t_prefill(&self, c: &Shape, tokens: f64, q: u32) -> f64 {
        let cm = self.cm;
        let per_tokens = tokens / f64::from(c.prefill);
        let reqs = per_tokens / self.input;
        let attn = cm.attn_prefill.eval(reqs, self.input) + cm.ffn.eval(per_tokens, 0.0);
        let comm = 2.0 * self.dispatch(c, per_tokens, true);
        let x = expected_x_moe(
            tokens * self.top_k,
            self.experts,
            self.experts / f64::from(c.moe),
            f64::from(cm.m_t_prefill),
        );
        let moe = cm.moe_time(x, cm.sms.saturating_sub(q).max(1));
        let moe_layer = attn.max(comm + moe);
        self.moe_layers * moe_layer + self.dense_layers * attn + cm.head.eval(reqs, 0.0)
    }

    /// One-way dispatch of `tokens` rows from one attention GPU to the MoE servers.
    fn dispatch(&self, c: &Shape, tokens: f64, prefill: bool) -> f64 {
        let (gpus, nodes) = (f64::from(c.moe), f64::from(c.moe_nodes.max(1)));
        self.cm.dispatch(tokens, self.hidden * 2.0, self.top_k, gpus, nodes, c.local_moe_fraction, prefill)
    }
}

/// A layout's counts and where they sit.
struct Shape {
    moe: u32,
    prefill: u32,
    decode: u32,
    per_node: Vec<[u32; 3]>,
    moe_nodes: u32,
    /// Fraction of MoE GPUs on an attention server's own node (averaged).
    local_moe_fraction: f64,
}

/// Spreads `n` over `nodes` as evenly as possible, earlier nodes first.
fn spread(n: u32, nodes: u32) -> Vec<u32> {
    (0..nodes).map(|i| n / nodes + u32::from(i < n % nodes)).collect()
}

fn shape(moe: u32, prefill: u32, decode: u32, nodes: u32, gpn: u32) -> Option<Shape> {
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
    let moe_nodes = per_node.iter().filter(|r| r[0] > 0).count() as u32;
    let attn: u32 = prefill + decode;
    let local: f64 = per_node.iter().map(|r| f64::from(r[1] + r[2]) * f64::from(r[0])).sum::<f64>()
        / f64::from(attn.max(1))
        / f64::from(moe.max(1));
    Some(Shape { moe, prefill, decode, per_node, moe_nodes, local_moe_fraction: local })
}

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

pub fn run(spec: &Spec, d: &Deploy, cm: &CostModel) -> SearchResult {
    let m = spec.model(d.model);
    let c = spec.cluster(d.cluster);
    let tiles = spec.tile_set(d.tiles);
    let world = c.world_size();
    let routed = m.moe_layers() as f64 * f64::from(m.moe.experts) * m.expert_bytes() as f64;
    let nonrouted = m.nonrouted_weight_bytes() as f64;
    let usable = c.gpu.hbm as f64 * d.memory_fraction;
    let cx = Ctx {
        cm,
        moe_layers: f64::from(m.moe_layers()),
        dense_layers: f64::from(m.layers - m.moe_layers()),
        hidden: f64::from(m.hidden),
        experts: f64::from(m.moe.experts),
        top_k: f64::from(m.moe.top_k),
        input: mean(&d.workload.input, Side::Input),
        output: mean(&d.workload.output, Side::Output),
        kv_token: f64::from(m.layers) * m.kv_bytes_per_token_layer() as f64,
        gpus_per_node: c.gpus_per_node,
        nodes: c.nodes,
    };
    let cluster = tiles.decode.gate_up.cluster[0] * tiles.decode.gate_up.cluster[1];
    let sms = c.gpu.sms;
    let mut qs: Vec<u32> = [1u32, 2, 3, 4, 5, 6]
        .iter()
        .map(|f| ((sms * f / 8).div_ceil(cluster) * cluster).clamp(cluster, sms - cluster))
        .collect();
    qs.dedup();
    let mut all: Vec<Candidate> = Vec::new();
    let (mut considered, mut fitting) = (0, 0);
    for moe in 1..world.saturating_sub(1) {
        for prefill in 1..world - moe {
            let decode = world - moe - prefill;
            if decode == 0 {
                continue;
            }
            considered += 1;
            // FitsMemory: routed experts on MoE servers, non-routed weights
            // and at least one request's KV on every attention server.
            let moe_need = routed / f64::from(moe) + WORKSPACE;
            let attn_room = usable - nonrouted - WORKSPACE;
            let one_request = cx.kv_token * (cx.input + cx.output);
            if moe_need > usable || attn_room < one_request {
                continue;
            }
            let Some(sh) = shape(moe, prefill, decode, cx.nodes, cx.gpus_per_node) else { continue };
            fitting += 1;
            let kv_decode =
                (attn_room / one_request * f64::from(decode)).floor().min(f64::from(MAX_DECODE_BATCH)) as u32;
            let kv_prefill =
                (attn_room / cx.kv_token * f64::from(prefill)).floor().min(f64::from(MAX_PREFILL_TOKENS)) as u32;
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
                    per_node: sh.per_node.clone(),
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
            ranked.push(cand);
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
