//! Iteration times from the cost model (ExpertPlex §6.2–6.3): the one
//! function that turns the fitted components into the time of a forward
//! step. The layout search (`moeforge-codegen`'s `search` pass, on mean
//! request lengths) and the serving simulator (`moeforge-runtime`'s `sim`,
//! per group and request) both call [`Env::iteration`]; nothing else
//! composes components into step times.
//!
//! Every system is described with the same two pieces: *attention groups*
//! (a group is one DP rank, or a TP group of `width` GPUs sharing heads) and
//! the *MoE side* the groups route to (EP over some GPUs, or TP slices). An
//! iteration's layer time follows §6.3 under each phase's [`Overlap`]: TBO
//! (two microbatches, the longer of one's attention and the other's
//! communication + MoE, each microbatch paying its own kernels and weight
//! reads), SBO (attention + max(shared FFN, communication + MoE)) or none.
//! The layout search chooses per phase; the baselines run TBO for prefill
//! and SBO for decode ([`Overlaps::STANDARD`]). DP groups synchronize at every MoE layer, so the
//! slowest group sets the pace. MoE computation is tile-aware: the expected
//! footprint x_moe = Σ⌈m_e/M_t⌉ of the rows each MoE GPU receives, executed
//! on however many SMs the phase holds.

use super::{expected_active, expected_x_moe, CostModel, ATTN_KERNELS, FFN_KERNELS};
pub use crate::program::{Overlap, Overlaps};
use moeforge_dsl::spec::{Attention, Cluster, Deploy, Model, Tiles};

/// What one attention group runs in an iteration: decode requests with
/// their cached tokens, and prompt chunks, kept as the sums the cost model
/// needs (so a fractional mean batch, as the layout search uses, is a load
/// too), and on how many identical groups it runs (`copies`: the search's
/// uniform layouts cost one evaluation, whatever their server count).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Load {
    /// Decode requests and the tokens they have cached, and Σ ctx_i² (the
    /// `δ·x·s²` term of a fitted decode profile).
    pub decode: f64,
    pub ctx: f64,
    pub ctx_sq: f64,
    /// Prompt chunks, their new tokens Σn, causal token pairs
    /// Σ(n² + 2n·prefix), and the tokens already cached before them Σprefix.
    pub prompts: f64,
    pub prompt_tokens: f64,
    pub pairs: f64,
    pub prefix: f64,
    pub copies: f64,
}

impl Default for Load {
    fn default() -> Load {
        Load {
            decode: 0.0,
            ctx: 0.0,
            ctx_sq: 0.0,
            prompts: 0.0,
            prompt_tokens: 0.0,
            pairs: 0.0,
            prefix: 0.0,
            copies: 1.0,
        }
    }
}

impl Load {
    /// `requests` decode requests holding `ctx` cached tokens together
    /// (each the same share of it).
    pub fn decode(requests: f64, ctx: f64) -> Load {
        let ctx_sq = if requests > 0.0 { ctx * ctx / requests } else { 0.0 };
        Load { decode: requests, ctx, ctx_sq, ..Load::default() }
    }
    /// The same load on `n` identical groups.
    pub fn times(self, n: u32) -> Load {
        Load { copies: f64::from(n), ..self }
    }
    /// `count` whole prompts of `len` tokens, nothing cached before them.
    pub fn prompts(count: f64, len: f64) -> Load {
        Load { prompts: count, prompt_tokens: count * len, pairs: count * len * len, ..Load::default() }
    }
    /// Adds a chunk of `n` new prompt tokens after `prefix` cached ones.
    pub fn add_chunk(&mut self, n: f64, prefix: f64) {
        self.prompts += 1.0;
        self.prompt_tokens += n;
        self.pairs += n * n + 2.0 * n * prefix;
        self.prefix += prefix;
    }
    pub fn tokens(&self) -> f64 {
        self.decode + self.prompt_tokens
    }
    pub fn has_prefill(&self) -> bool {
        self.prompts > 0.0
    }
    pub fn is_empty(&self) -> bool {
        self.decode == 0.0 && !self.has_prefill()
    }
    /// One of two equal microbatches of this load (TBO): half of every sum.
    /// Σctx² halves too, since half the requests carry it.
    pub fn half(self) -> Load {
        Load {
            decode: self.decode / 2.0,
            ctx: self.ctx / 2.0,
            ctx_sq: self.ctx_sq / 2.0,
            prompts: self.prompts / 2.0,
            prompt_tokens: self.prompt_tokens / 2.0,
            pairs: self.pairs / 2.0,
            prefix: self.prefix / 2.0,
            copies: self.copies,
        }
    }
}

/// Σ_{j = prefix+1}^{prefix+n} min(j, k): the keys the `n` new queries of a
/// chunk after `prefix` cached tokens attend to when each reads at most `k`.
pub fn capped_pairs(n: f64, prefix: f64, k: f64) -> f64 {
    let tri = |a: f64, b: f64| if b > a { (b - a) * (a + b + 1.0) / 2.0 } else { 0.0 }; // Σ_{j=a+1}^{b} j
    let end = prefix + n;
    if end <= k {
        tri(prefix, end)
    } else if prefix >= k {
        n * k
    } else {
        tri(prefix, k) + (end - k) * k
    }
}

/// Where routed rows go.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MoeSide {
    /// Experts spread over `gpus` GPUs on `nodes` nodes, in `replicas`
    /// independent EP groups (whole-model instances) that split the attention
    /// groups' rows; `local` is the fraction of an attention GPU's rows whose
    /// expert sits on its own node; `disaggregated` when the experts live on
    /// GPUs of their own (not the attention GPUs), so attention and expert
    /// computation run in parallel.
    Ep { gpus: u32, nodes: u32, replicas: u32, local: f64, disaggregated: bool },
    /// Every GPU of the TP group holds a 1/width slice of every expert.
    Tp { width: u32 },
}

/// SMs a phase's MoE computation gets: `alone` when the other phase has no
/// MoE work, `shared` during the fraction `contention` of the time it has;
/// `preempt` is the delay before the phase's tiles start (seconds per layer).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sms {
    pub alone: f64,
    pub shared: f64,
    pub contention: f64,
    pub preempt: f64,
}

impl Sms {
    /// Every SM, always.
    pub fn all(sms: u32) -> Sms {
        Sms::fixed(sms)
    }
    /// `q` SMs whether or not the other phase runs (the layout search's
    /// assumption: each phase sized for the contended case).
    pub fn fixed(q: u32) -> Sms {
        Sms { alone: f64::from(q), shared: f64::from(q), contention: 0.0, preempt: 0.0 }
    }
}

/// The time of one iteration and how long it kept the MoE GPUs and links busy.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Iter {
    pub seconds: f64,
    pub moe_seconds: f64,
    pub comm_seconds: f64,
}

/// The model, cluster and cost model every system shares.
#[derive(Clone, Debug)]
pub struct Env {
    pub cm: CostModel,
    pub world: u32,
    pub gpus_per_node: u32,
    pub nodes: u32,
    pub moe_layers: f64,
    pub dense_layers: f64,
    pub hidden: f64,
    pub experts: f64,
    pub top_k: f64,
    /// KV bytes of one token over all layers and heads.
    pub kv_token: f64,
    /// KV heads (GQA) or `None` for MLA's shared latent.
    pub kv_heads: Option<u32>,
    /// Weight bytes: all, and those outside the routed experts.
    pub weights: f64,
    pub nonrouted: f64,
    /// Bytes of HBM the stack may use per GPU.
    pub usable: f64,
    /// Bytes per GPU kept for communication buffers, scratch and request
    /// metadata ([`crate::memory::Workspace`]).
    pub workspace: f64,
    /// One M_t × N_t tile of the prefill GateUp GEMM on one SM (seconds):
    /// the most a decode preemption waits (§4.3); on average it waits half
    /// of it (each preempted cluster is at a uniformly random point of its tile).
    pub tile_seconds: f64,
    /// SMs per CTA cluster (q rounds up to a multiple).
    pub cluster: u32,
    /// The busiest EP rank's share of routed rows over the mean that
    /// skewed expert popularity leaves after placement (1: uniform
    /// popularity; the placement pass's routing statistics otherwise).
    pub skew: f64,
}

impl Env {
    /// The shared quantities of deployment `d`; `workspace` is the bytes
    /// [`crate::memory::Workspace`] reserves on every GPU.
    pub fn new(m: &Model, c: &Cluster, t: &Tiles, d: &Deploy, cm: &CostModel, workspace: u64) -> Env {
        let n_tiles = (2.0 * f64::from(m.moe.expert_ffn) / f64::from(t.prefill.gate_up.block_n.max(1))).ceil().max(1.0);
        Env {
            world: c.world_size(),
            gpus_per_node: c.gpus_per_node,
            nodes: c.nodes,
            moe_layers: f64::from(m.moe_layers()),
            dense_layers: f64::from(m.layers - m.moe_layers()),
            hidden: f64::from(m.hidden),
            experts: f64::from(m.moe.experts),
            top_k: f64::from(m.moe.top_k),
            kv_token: f64::from(m.layers) * m.kv_bytes_per_token_layer() as f64,
            kv_heads: match m.attention {
                Attention::Gqa { kv_heads, .. } => Some(kv_heads),
                Attention::Mla { .. } => None,
            },
            weights: m.weight_bytes() as f64,
            nonrouted: m.nonrouted_weight_bytes() as f64,
            usable: c.gpu.hbm as f64 * d.memory_fraction,
            workspace: workspace as f64,
            // β is one M_t-row tile of GateUp and Down (6·M_t·H·I FLOPs) across
            // all N columns on the whole GPU at the GEMM's achieved efficiency;
            // GateUp is 2/3 of it. One tile's main loop runs at the SM's
            // tensor-core rate (the GEMM's efficiency losses are waves, tails
            // and epilogues), so a single tile takes β·efficiency of it.
            tile_seconds: cm.moe.beta * cm.calib.compute_efficiency * 2.0 / 3.0 * f64::from(cm.sms) / n_tiles,
            cluster: cm.cluster,
            skew: 1.0,
            cm: cm.clone(),
        }
    }

    /// Fraction of a token's KV one GPU of a width-`w` attention group holds:
    /// GQA heads shard until there are fewer heads than GPUs (then they
    /// replicate); MLA's latent is replicated on every GPU.
    pub fn kv_fraction(&self, w: u32) -> f64 {
        match self.kv_heads {
            Some(h) => 1.0 / f64::from(h.min(w).max(1)),
            None => 1.0,
        }
    }

    /// PD disaggregation's instance (ExpertPlex §7.1's PD baseline): the
    /// fewest GPUs, a power of two, whose data-parallel attention + EP copy
    /// of the whole model leaves room for KV. `Err(unit)` when the world
    /// cannot hold one prefill and one decode instance of that size.
    pub fn pd_unit(&self) -> Result<u32, u32> {
        let mut unit = 1;
        while unit <= self.world
            && self.kv_tokens(self.usable - self.weights_per_gpu(1, unit) - self.workspace, 1) < 1.0
        {
            unit *= 2;
        }
        if unit <= self.world && self.world / unit >= 2 {
            Ok(unit)
        } else {
            Err(unit)
        }
    }

    /// Weight bytes one GPU holds when attention runs `width`-way tensor
    /// parallel (1: data parallel) and the routed experts spread over `ep`
    /// GPUs: a 1/`width` share of every weight outside the routed experts
    /// (attention, embeddings, LM head, dense layers, shared experts; under
    /// data parallelism all of them on every GPU, as the memory plan's
    /// `replicated` and `attention_ep` regions hold them) and a 1/`ep`
    /// share of the routed experts.
    pub fn weights_per_gpu(&self, width: u32, ep: u32) -> f64 {
        self.nonrouted / f64::from(width.max(1)) + (self.weights - self.nonrouted) / f64::from(ep.max(1))
    }

    /// Tokens of KV a width-`w` group holds with `free` bytes per GPU.
    pub fn kv_tokens(&self, free: f64, w: u32) -> f64 {
        (free.max(0.0) / (self.kv_token * self.kv_fraction(w))).floor()
    }

    /// Ring all-reduce of a `bytes` message over a `w`-GPU NVLink group.
    fn all_reduce(&self, bytes: f64, w: u32) -> f64 {
        if w <= 1 {
            return 0.0;
        }
        let w = f64::from(w);
        self.cm.nvlink(bytes * 2.0 * (w - 1.0) / w)
    }

    /// One attention group's attention (with its all-reduces) and dense
    /// FFN / shared-expert time per layer, on an SM `share`.
    fn attention(&self, l: &Load, width: u32, share: f64) -> (f64, f64) {
        if l.is_empty() {
            return (0.0, 0.0);
        }
        let (a, p) = (&self.cm.attn_decode, &self.cm.attn_prefill);
        let w = f64::from(width);
        let rep = self.kv_fraction(width) * w;
        // Weights shard over the group; the per-kernel cost does not. A step
        // with prompts launches the prefill kernels (their fixed cost).
        let fixed = ATTN_KERNELS * self.cm.calib.op_overhead;
        let alpha = if l.has_prefill() { p.alpha } else { a.alpha };
        // DeepSeek Sparse Attention: the indexer scores every key, the
        // attention reads at most top-k keys per query (per request, on the
        // load's mean context and chunk).
        let (ctx, pairs, ix_gamma, ix_delta) = match &self.cm.dsa {
            Some(d) => (
                l.decode * (l.ctx / l.decode.max(1e-9)).min(d.top_k),
                if l.prompts > 0.0 {
                    2.0 * l.prompts * capped_pairs(l.prompt_tokens / l.prompts, l.prefix / l.prompts, d.top_k)
                } else {
                    0.0
                },
                d.decode_gamma,
                d.prefill_delta,
            ),
            None => (l.ctx, l.pairs, 0.0, 0.0),
        };
        let decode = a.beta * l.decode + ((a.gamma - ix_gamma) * ctx + ix_gamma * l.ctx + a.delta * l.ctx_sq) * rep;
        // Projections and KV writes per token, causal scores over the new
        // tokens and against the cached prefix, and one read of the prefix KV.
        let prefill = p.beta * l.prompts
            + p.gamma * l.prompt_tokens
            + (p.delta - ix_delta) * pairs
            + ix_delta * l.pairs
            + a.gamma * l.prefix * rep;
        let t = fixed + (alpha - fixed) / w + (decode + prefill) / w;
        let f = &self.cm.ffn;
        let ffn_fixed = FFN_KERNELS * self.cm.calib.op_overhead;
        let ffn = (ffn_fixed + (f.eval(l.tokens(), 0.0) - ffn_fixed) / w) / share;
        (t / share + 2.0 * self.all_reduce(l.tokens() * self.hidden * 2.0, width), ffn)
    }

    /// Moves one request's prompt KV from its prefill GPU to its decode GPU.
    pub fn kv_move(&self, tokens: f64) -> f64 {
        let bytes = tokens * self.kv_token;
        if self.nodes > 1 {
            self.cm.rdma(bytes)
        } else {
            self.cm.nvlink(bytes)
        }
    }

    /// Dispatch + combine of one layer for an attention group sending
    /// `tokens` rows (the cost model's dispatch: hierarchical for prefill).
    /// A prefill dispatch through receiver-count (normal-mode) kernels also
    /// waits for the host to learn the counts; ExpertPlex's attention-initiated
    /// one-sided writes into fixed slots (`disaggregated`) need no such exchange.
    fn moe_comm(&self, tokens: f64, width: u32, side: MoeSide, prefill: bool) -> f64 {
        match side {
            MoeSide::Tp { .. } => 0.0,
            MoeSide::Ep { gpus, nodes, local, disaggregated, .. } => {
                // A TP group's GPUs each send 1/width of its (replicated) rows.
                let per_gpu = tokens / f64::from(width);
                let (g, n) = (f64::from(gpus), f64::from(nodes.max(1)));
                let sync = if prefill && !disaggregated && tokens > 0.0 { self.cm.calib.normal_mode_sync } else { 0.0 };
                2.0 * self.cm.dispatch(per_gpu, self.hidden * 2.0, self.top_k, g, n, local, prefill) + sync
            }
        }
    }

    /// Routed rows the busiest of `gpus` EP ranks receives when `rows` rows
    /// spread uniformly: the maximum of `gpus` counts of mean μ = rows/gpus,
    /// μ + √(2·ln(gpus)·μ) (the Gaussian extreme of Poisson counts), never
    /// more than every row. Skewed expert popularity, which placement
    /// (EPLB, Zepp) counters, comes on top and is not modeled here.
    pub fn busiest_rows(rows: f64, gpus: u32) -> f64 {
        if gpus <= 1 || rows <= 0.0 {
            return rows.max(0.0);
        }
        let mu = rows / f64::from(gpus);
        (mu + (2.0 * f64::from(gpus).ln() * mu).sqrt()).min(rows)
    }

    /// Expected decode footprint x_moe of one MoE GPU receiving from `rows` routed rows.
    pub fn decode_footprint(&self, rows: f64, side: MoeSide) -> f64 {
        let (rows, local) = match side {
            MoeSide::Ep { gpus, replicas, .. } => (rows / f64::from(replicas.max(1)), self.experts / f64::from(gpus)),
            MoeSide::Tp { .. } => (rows, self.experts),
        };
        expected_x_moe(rows, self.experts, local, f64::from(self.cm.m_t_decode))
    }

    /// MoE computation of one layer on the busiest MoE GPU: EP ranks hold
    /// `experts / gpus` whole experts and the busiest receives
    /// [`Env::busiest_rows`]; TP ranks hold a 1/width slice of every expert
    /// and each runs all of its group's rows (balanced by construction, but
    /// every rank reads and writes every row's activations).
    pub fn moe(&self, rows: f64, side: MoeSide, prefill: bool, sms: Sms) -> f64 {
        if rows <= 0.0 {
            return 0.0;
        }
        let cm = &self.cm;
        let m_t = f64::from(if prefill { cm.m_t_prefill } else { cm.m_t_decode });
        let (x, active, on_gpu, slice) = match side {
            MoeSide::Ep { gpus, .. } => {
                let local = self.experts / f64::from(gpus.max(1));
                // The busiest rank's rows (popularity skew, then routing
                // noise), as if all ranks received that many.
                let busiest = Self::busiest_rows(rows * self.skew.max(1.0), gpus).min(rows) * f64::from(gpus.max(1));
                let x = expected_x_moe(busiest, self.experts, local, m_t);
                (x, expected_active(busiest, self.experts, local), busiest / f64::from(gpus.max(1)), 1.0)
            }
            MoeSide::Tp { width } => (
                expected_x_moe(rows, self.experts, self.experts, m_t),
                expected_active(rows, self.experts, self.experts),
                rows,
                f64::from(width),
            ),
        };
        let on = |q: f64| cm.moe_seconds(x, active, on_gpu, m_t, slice, q);
        (1.0 - sms.contention) * on(sms.alone) + sms.contention * (on(sms.shared) + sms.preempt)
    }

    /// One layer's parts for `groups`: the slowest group's attention (with
    /// its all-reduces) and dense FFN, the busiest group's dispatch +
    /// combine, and the busiest MoE GPU's expert computation.
    fn layer_parts(
        &self,
        groups: &[Load],
        width: u32,
        share: f64,
        side: MoeSide,
        sms: Sms,
        interference: f64,
    ) -> Parts {
        let prefill = groups.iter().any(|g| g.has_prefill());
        let parts: Vec<(f64, f64)> = groups.iter().map(|g| self.attention(g, width, share)).collect();
        let attn = parts.iter().map(|p| p.0).fold(0.0, f64::max);
        let ffn = parts.iter().map(|p| p.1).fold(0.0, f64::max);
        let busiest = groups.iter().map(|g| g.tokens()).fold(0.0, f64::max);
        let comm = self.moe_comm(busiest, width, side, prefill) * (1.0 + interference);
        // Rows an MoE GPU receives: all groups' tokens (EP spreads them over
        // its GPUs through the expert footprint; TP groups each run their own).
        let rows = match side {
            MoeSide::Ep { replicas, .. } => {
                groups.iter().map(|g| g.tokens() * g.copies).sum::<f64>() * self.top_k / f64::from(replicas.max(1))
            }
            MoeSide::Tp { .. } => busiest * self.top_k,
        };
        let moe = self.moe(rows, side, prefill, sms);
        Parts { attn, ffn, comm, moe }
    }

    /// One iteration of `groups` (each `width` GPUs wide, attention on an SM
    /// `share`) routing to `side`, each phase's layers overlapped as
    /// `overlap` says; `interference` stretches communication when another
    /// phase's traffic shares the links.
    #[allow(clippy::too_many_arguments)]
    pub fn iteration(
        &self,
        groups: &[Load],
        width: u32,
        share: f64,
        side: MoeSide,
        sms: Sms,
        interference: f64,
        overlap: Overlaps,
    ) -> Iter {
        // Groups that run (a load with no copies is nowhere).
        let groups: Vec<Load> = groups.iter().filter(|g| g.copies > 0.0).copied().collect();
        let prefill = groups.iter().any(|g| g.has_prefill());
        let whole = self.layer_parts(&groups, width, share, side, sms, interference);
        if whole.attn == 0.0 {
            return Iter::default();
        }
        let disaggregated = matches!(side, MoeSide::Ep { disaggregated: true, .. });
        let how = match (prefill, overlap.decode) {
            (true, _) => overlap.prefill,
            // Decode micro-batches are whole sequences: a group of one
            // request does not split into two.
            (false, Overlap::Tbo) if groups.iter().all(|g| g.decode < 2.0) => Overlap::None,
            (false, o) => o,
        };
        // TBO runs every layer twice, on two microbatches of half the
        // groups' requests: the per-kernel costs, the dispatch latency and
        // (for memory-bound experts) the weight reads are paid per
        // microbatch; that is what TBO costs against SBO.
        let (layer, moe, comm) = match how {
            Overlap::Tbo => {
                let halves: Vec<Load> = groups.iter().map(|g| g.half()).collect();
                let h = self.layer_parts(&halves, width, share, side, sms, interference);
                (2.0 * h.layer(Overlap::Tbo, disaggregated), 2.0 * h.moe, 2.0 * h.comm)
            }
            how => (whole.layer(how, disaggregated), whole.moe, whole.comm),
        };
        let dense = whole.attn + whole.ffn;
        let heads = groups.iter().map(|g| g.decode + g.prompts).fold(0.0, f64::max);
        let head = self.cm.head.alpha + (self.cm.head.eval(heads, 0.0) - self.cm.head.alpha) / f64::from(width);
        // Scheduling, sampling and the DP batch sync, once per iteration.
        let mut seconds = self.moe_layers * layer + self.dense_layers * dense + head + self.cm.calib.iteration_overhead;
        // A step carrying prompt tokens runs eagerly (no CUDA graph): the host
        // launches every layer's kernels, and the GPU cannot finish before the last launch.
        if prefill {
            let host = (self.moe_layers + self.dense_layers) * self.cm.calib.eager_layer;
            seconds = seconds.max(host + self.cm.calib.iteration_overhead);
        }
        // Work always takes time: a fitted profile with negative terms must not
        // stall or reverse the clock (the simulator rejects such profiles).
        Iter {
            seconds: if seconds.is_finite() { seconds.max(1e-9) } else { f64::MAX },
            moe_seconds: self.moe_layers * moe,
            comm_seconds: self.moe_layers * comm,
        }
    }
}

/// One MoE layer's parts (seconds): attention, dense FFN or shared
/// experts, dispatch + combine, routed experts.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Parts {
    attn: f64,
    ffn: f64,
    comm: f64,
    moe: f64,
}

impl Parts {
    /// The layer's critical path under `how` (§6.3). On separate expert
    /// GPUs (`disaggregated`) the attention side and the MoE side run in
    /// parallel; on shared GPUs attention and expert computation queue on
    /// the same SMs and only communication can hide.
    /// - TBO: one microbatch's attention against the other's
    ///   communication and experts, the longer path (per microbatch).
    /// - SBO: attention, then the longer of the shared experts / dense FFN
    ///   and communication + routed experts.
    /// - None: everything in turn.
    fn layer(&self, how: Overlap, disaggregated: bool) -> f64 {
        let Parts { attn, ffn, comm, moe } = *self;
        match (how, disaggregated) {
            (Overlap::Tbo, true) => (attn + ffn).max(comm + moe),
            (Overlap::Tbo, false) => (attn + ffn + moe).max(comm),
            (Overlap::Sbo, true) => attn + ffn.max(comm + moe),
            (Overlap::Sbo, false) => attn + moe + ffn.max(comm),
            (Overlap::None, _) => attn + ffn + comm + moe,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capped_pairs_counts_keys_query_by_query() {
        for (n, prefix, k) in [(10u32, 0u32, 4u32), (10, 2, 4), (3, 7, 4), (5, 0, 100), (2048, 1000, 2048), (1, 0, 1)] {
            let brute: u64 = (prefix + 1..=prefix + n).map(|j| u64::from(j.min(k))).sum();
            let got = capped_pairs(f64::from(n), f64::from(prefix), f64::from(k));
            assert_eq!(got, brute as f64, "n {n} prefix {prefix} k {k}");
        }
        // Uncapped, a whole prompt's pairs are the causal triangle the dense fit uses.
        assert_eq!(2.0 * capped_pairs(100.0, 0.0, 1e9), 100.0 * 101.0);
    }

    /// §6.3's critical paths, on parts chosen by hand: attention 3, shared
    /// FFN 2, communication 4, routed experts 5.
    #[test]
    fn each_overlap_strategy_takes_the_papers_critical_path() {
        let p = Parts { attn: 3.0, ffn: 2.0, comm: 4.0, moe: 5.0 };
        // TBO on separate expert GPUs: max(attention side 3 + 2, MoE side 4 + 5).
        assert_eq!(p.layer(Overlap::Tbo, true), 9.0);
        // TBO on shared GPUs: compute 3 + 2 + 5 against communication 4.
        assert_eq!(p.layer(Overlap::Tbo, false), 10.0);
        // SBO: attention, then max(shared 2, communication + routed 9).
        assert_eq!(p.layer(Overlap::Sbo, true), 12.0);
        // SBO on shared GPUs: attention and routed experts queue, the shared FFN hides communication.
        assert_eq!(p.layer(Overlap::Sbo, false), 12.0);
        assert_eq!(p.layer(Overlap::None, true), 14.0);
        assert_eq!(p.layer(Overlap::None, false), 14.0);
    }

    #[test]
    fn a_tbo_microbatch_is_half_of_every_sum() {
        let mut l = Load::decode(6.0, 600.0).times(3);
        l.add_chunk(100.0, 20.0);
        let h = l.half();
        assert_eq!((h.decode, h.ctx, h.ctx_sq), (3.0, 300.0, 30_000.0));
        assert_eq!((h.prompts, h.prompt_tokens, h.pairs, h.prefix), (0.5, 50.0, 7_000.0, 10.0));
        // The groups stay: each group splits its own batch.
        assert_eq!(h.copies, 3.0);
        assert!(h.has_prefill());
    }

    /// Qwen3-30B-A3B on one 8×H200 node (no shared experts).
    fn env() -> Env {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/qwen3-30b-a3b-h200.moe");
        let checked = moeforge_dsl::check_paths(&[path], &moeforge_dsl::FsLoader)
            .unwrap_or_else(|f| panic!("{}", f.render(false)));
        let spec = checked.spec;
        let d = &spec.deploys[0];
        let (m, c, t) = (spec.model(d.model), spec.cluster(d.cluster), spec.tile_set(d.tiles));
        let cm = super::super::CostModel::roofline(m, c, t);
        Env::new(m, c, t, d, &cm, 1 << 30)
    }

    /// TBO pays per microbatch: on a memory-bound decode step each
    /// microbatch reads the active experts' weights again, so the routed
    /// experts take longer in total than in one batch, while no overlap
    /// costs the sum of the parts and SBO never more.
    #[test]
    fn tbo_charges_each_microbatch_its_weight_reads_and_kernels() {
        let e = env();
        let side = MoeSide::Ep { gpus: 4, nodes: 1, replicas: 1, local: 1.0, disaggregated: true };
        let sms = Sms::all(e.cm.sms);
        let decode = [Load::decode(32.0, 32.0 * 1000.0).times(4)];
        let with = |prefill, decode| Overlaps { prefill, decode };
        let it = |o: Overlap, loads: &[Load]| e.iteration(loads, 1, 1.0, side, sms, 0.0, with(o, o));
        let (tbo, sbo, none) = (it(Overlap::Tbo, &decode), it(Overlap::Sbo, &decode), it(Overlap::None, &decode));
        assert!(tbo.moe_seconds > sbo.moe_seconds, "{tbo:?} vs {sbo:?}");
        assert!(tbo.comm_seconds > sbo.comm_seconds);
        assert_eq!(sbo.moe_seconds, none.moe_seconds);
        assert!(sbo.seconds <= none.seconds && tbo.seconds <= none.seconds + tbo.moe_seconds);
        // The overlap a step uses is its phase's.
        let prefill = [Load::prompts(4.0, 2048.0).times(4)];
        let a = e.iteration(&prefill, 1, 1.0, side, sms, 0.0, with(Overlap::Tbo, Overlap::None));
        let b = e.iteration(&prefill, 1, 1.0, side, sms, 0.0, with(Overlap::Tbo, Overlap::Sbo));
        assert_eq!(a, b);
        let c = e.iteration(&prefill, 1, 1.0, side, sms, 0.0, with(Overlap::None, Overlap::Sbo));
        assert!(c.seconds > a.seconds, "no overlap {c:?} vs TBO {a:?} on a compute-bound prefill");
    }

    #[test]
    fn the_busiest_rank_gets_more_than_the_mean_and_never_more_than_all() {
        assert_eq!(Env::busiest_rows(800.0, 1), 800.0);
        let b = Env::busiest_rows(800.0, 8);
        assert!(b > 100.0 && b < 200.0, "{b}");
        assert!(Env::busiest_rows(2.0, 8) <= 2.0);
    }
}
