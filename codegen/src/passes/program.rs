//! Program pass: the per-rank program of one forward step for every mode
//! the memory plan holds and both phases (see `moeforge_plan::program`).
//!
//! Colocated ranks (data-parallel attention + EP, or TP for both in a
//! switching plan) run:
//! - EP prefill with two-batch overlap: micro-batch 1's attention runs on
//!   `compute` while micro-batch 0's dispatch runs on `comm`, and one
//!   micro-batch's experts run while the other's combine moves;
//! - EP decode with single-batch overlap when the model has shared experts:
//!   they run on `shared` beside the routed experts' dispatch, APK and
//!   combine; the residual add waits on both (WaitDone);
//! - TP on one stream: its all-reduces (after `o_proj`, after the experts
//!   and, for an all-head QK-norm, of the sums of squares) sit between the
//!   ops that need their result, so nothing is left to overlap.
//!
//! EP ranks holding different expert counts run different APK instances:
//! their programs are separate.
//!
//! A plan with roles (`moeforge_plan::roles`) gets one program per role and
//! phase, with the search's overlap per phase (`Roles::overlap`):
//! - **ExpertPlex**: a phase's attention servers (prefill servers' prefill,
//!   decode servers' decode) run `Role::Attention`: the colocated EP
//!   program without the routed experts. The MoE servers run `Role::Moe`
//!   for both phases: their side of each MoE layer (what the dispatch
//!   delivers, the permutation, the APK, the weighted combine of rows),
//!   with empty prologue, dense bodies and epilogue. Both sides issue the
//!   same communication ops, each listing only its own operands (the sender
//!   reads, the receiver writes): the interpreter meets them there. Their
//!   group is the phase's attention servers and the MoE servers.
//! - **PD**: each whole-model instance runs the colocated EP program of
//!   its role's phase over its own GPUs (its communication group).

use super::{Ctx, PassError};
use moeforge_dsl::spec::{Attention, DType, Model, QkNormScope, Routing};
use moeforge_plan::memory::{BufferName as Buf, MemoryPlan, Mode, RouteIndexParts, TensorPart, TensorRole as W};
use moeforge_plan::program::*;
use moeforge_plan::{ApkForm, Grid, GridVar, KernelParams, Plan};

pub fn run(cx: &Ctx<'_>, plan: &mut Plan) -> Result<(), Vec<PassError>> {
    let m = cx.model;
    let world: Vec<u32> = plan.ranks.iter().map(|r| r.rank).collect();
    let experts: Vec<[u32; 2]> = (0..plan.ranks.len()).map(|r| plan.ep_ids(r)).collect();
    let mut programs = Vec::new();
    // The dense APK instances by the weight format they read.
    let dense_of = |w: moeforge_plan::WeightFormat| {
        plan.kernels
            .iter()
            .any(|k| matches!(&k.params, KernelParams::Apk(a) if a.form == ApkForm::Dense && a.weights == w))
    };
    let dense = [dense_of(moeforge_plan::WeightFormat::Bf16), dense_of(moeforge_plan::WeightFormat::Fp8E4m3)];
    let flash = plan.kernels.iter().find_map(|k| match &k.params {
        KernelParams::Layer(l) => l.gqa.as_ref().and_then(|g| g.flash),
        _ => None,
    });
    let overlaps = plan.roles.as_ref().map_or(Overlaps::STANDARD, |r| r.overlap);
    // Prefill servers whose posts cross nodes through another prefill
    // server (`Path::Relay`): every prefill server may relay.
    let relayed_posts =
        plan.roles.iter().flat_map(|r| &r.posts).any(|p| matches!(p.path, moeforge_plan::roles::Path::Relay { .. }));
    for &mode in &plan.memory.modes {
        // EP ranks grouped by the APK instance their expert count selects.
        let apk_groups: Vec<(Vec<u32>, Option<String>)> = match mode {
            Mode::Tp => {
                let apk = plan
                    .kernels
                    .iter()
                    .find(|k| matches!(&k.params, KernelParams::Apk(a) if a.form == ApkForm::ExpertsTp));
                vec![(world.clone(), apk.map(|k| k.name.clone()))]
            }
            Mode::Ep => {
                let mut g: Vec<(Vec<u32>, Option<String>)> = plan
                    .kernels
                    .iter()
                    .filter_map(|k| match &k.params {
                        KernelParams::Apk(a) if a.form == ApkForm::Experts => {
                            Some((a.ranks.clone(), Some(k.name.clone())))
                        }
                        _ => None,
                    })
                    .collect();
                // Ranks holding no routed experts (fewer experts than ranks,
                // or a role plan's attention servers).
                let idle: Vec<u32> =
                    plan.ranks.iter().filter(|r| plan.local_experts(r.rank as usize) == 0).map(|r| r.rank).collect();
                if !idle.is_empty() {
                    g.push((idle, None));
                }
                g
            }
        };
        for phase in [Phase::Prefill, Phase::Decode] {
            for (role, group) in sides(plan, phase) {
                for (ranks, apk) in &apk_groups {
                    let ranks: Vec<u32> = ranks.iter().copied().filter(|r| group.runs.contains(r)).collect();
                    if ranks.is_empty() {
                        continue;
                    }
                    let cfg = Config {
                        m,
                        mem: &plan.memory,
                        mode,
                        phase,
                        role,
                        overlaps,
                        world: &world,
                        group: &group.comm,
                        gpus_per_node: plan.cluster.gpus_per_node.max(1),
                        experts: &experts,
                        apk: apk.as_deref(),
                        apk_rows: apk_rows(plan, apk.as_deref()),
                        dense,
                        flash,
                        relayed_posts,
                    };
                    programs.push(cfg.program(ranks));
                }
            }
        }
    }
    plan.programs = programs;
    Ok(())
}

/// The ranks that run a phase's program of one role, and the communication
/// group their ops span.
struct Side {
    runs: Vec<u32>,
    comm: Vec<u32>,
}

/// Who runs `phase`, by program role: every rank (colocated); each PD
/// instance of the phase's role over its own GPUs; the phase's ExpertPlex
/// attention servers and the MoE servers, one group.
fn sides(plan: &Plan, phase: Phase) -> Vec<(Role, Side)> {
    use moeforge_plan::roles::Role as Gpu;
    let world: Vec<u32> = plan.ranks.iter().map(|r| r.rank).collect();
    let Some(roles) = &plan.roles else {
        return vec![(Role::Colocated, Side { runs: world.clone(), comm: world })];
    };
    let serves = match phase {
        Phase::Prefill => Gpu::Prefill,
        Phase::Decode => Gpu::Decode,
    };
    let attention = roles.ranks(serves);
    if !roles.moe_servers() {
        return roles
            .ep_groups
            .iter()
            .filter(|g| g.iter().all(|r| attention.contains(r)))
            .map(|g| (Role::Colocated, Side { runs: g.clone(), comm: g.clone() }))
            .collect();
    }
    let moe = roles.ranks(Gpu::Moe);
    let mut comm: Vec<u32> = attention.iter().chain(&moe).copied().collect();
    comm.sort_unstable();
    vec![(Role::Attention, Side { runs: attention, comm: comm.clone() }), (Role::Moe, Side { runs: moe, comm })]
}

struct Config<'a> {
    m: &'a Model,
    mem: &'a MemoryPlan,
    mode: Mode,
    phase: Phase,
    role: Role,
    overlaps: Overlaps,
    world: &'a [u32],
    /// The ranks this program's communication ops span.
    group: &'a [u32],
    gpus_per_node: u32,
    /// The expert ids each rank's EP permutation matches `[begin, end)`
    /// (`Plan::ep_ids`: its stripe, or its physical slots), indexed by rank.
    experts: &'a [[u32; 2]],
    apk: Option<&'a str>,
    /// The most rows that APK's grouped GEMMs take (`max_prefill_rows`).
    apk_rows: u64,
    /// The bundle has the dense APK for bf16 weights (`dense`) and for fp8
    /// e4m3 ones (`dense_fp8`).
    dense: [bool; 2],
    /// The layer instance's flash-attention prefill tiles, when it has the kernel.
    flash: Option<moeforge_dsl::spec::AttentionTiles>,
    /// A role plan's prefill posts cross nodes through a prefill server
    /// (`Path::Relay`), which holds the rows it forwards and the partial
    /// sums it returns in its `dispatch` rows.
    relayed_posts: bool,
}

const COMPUTE: u32 = 0;
const COMM: u32 = 1;
const APK: u32 = 2;
const SHARED: u32 = 3;

/// Ops of one block under construction, with the program's event names.
struct Ops<'e> {
    events: &'e mut Vec<String>,
    ops: Vec<Op>,
}

impl Ops<'_> {
    fn event(&mut self, name: String) -> u32 {
        match self.events.iter().position(|e| *e == name) {
            Some(i) => i as u32,
            None => {
                self.events.push(name);
                (self.events.len() - 1) as u32
            }
        }
    }
    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        name: &str,
        kind: OpKind,
        stream: u32,
        mb: Option<u32>,
        reads: Vec<Operand>,
        writes: Vec<Operand>,
        kernel: KernelRef,
    ) -> &mut Op {
        let name = match mb {
            Some(i) => format!("{name}.{i}"),
            None => name.to_string(),
        };
        let i = self.ops.len();
        self.ops.push(Op {
            name,
            kind,
            stream,
            micro_batch: mb,
            waits: vec![],
            record: None,
            reads,
            writes,
            kernel,
            comm: None,
            gemm: None,
            args: vec![],
            grid: None,
        });
        &mut self.ops[i]
    }
    /// Sets the last op's launch arguments.
    fn args(&mut self, args: Vec<Arg>) {
        if let Some(op) = self.ops.last_mut() {
            op.args = args;
        }
    }
    /// Makes the last op record `name` and returns its id.
    fn record(&mut self, name: String) -> u32 {
        let e = self.event(name);
        if let Some(op) = self.ops.last_mut() {
            op.record = Some(e);
        }
        e
    }
    /// Makes the last op wait on `e`.
    fn wait(&mut self, e: u32) {
        if let Some(op) = self.ops.last_mut() {
            op.waits.push(e);
        }
    }
}

fn buf(name: Buf) -> Operand {
    Operand::Buffer { name }
}

/// Launch arguments: a buffer's slice, `at` bytes into it, a weight view,
/// a count, a constant.
fn ptr(name: Buf) -> Arg {
    Arg::Ptr { operand: buf(name), at: 0 }
}
fn ptr_at(name: Buf, at: u64) -> Arg {
    Arg::Ptr { operand: buf(name), at }
}
fn wptr(role: W) -> Arg {
    Arg::Ptr { operand: Operand::Weight { role, part: TensorPart::Weight }, at: 0 }
}
fn kv() -> Arg {
    Arg::Ptr { operand: Operand::Kv, at: 0 }
}
/// The most rows the experts APK `name` takes (unbounded without one: the
/// rank computes no routed experts).
fn apk_rows(plan: &Plan, name: Option<&str>) -> u64 {
    name.and_then(|n| plan.kernels.iter().find(|k| k.name == n))
        .and_then(|k| match &k.params {
            KernelParams::Apk(a) => Some(u64::from(a.max_prefill_rows)),
            _ => None,
        })
        .unwrap_or(u64::MAX)
}

fn cnt(var: GridVar) -> Arg {
    Arg::Count { var }
}
fn int(v: impl Into<i64>) -> Arg {
    Arg::Int { value: v.into() }
}

fn missing(family: &str) -> KernelRef {
    KernelRef::Missing { family: family.into() }
}

fn mb_name(base: &str, mb: Option<u32>) -> String {
    match mb {
        Some(i) => format!("{base}.{i}"),
        None => base.to_string(),
    }
}

impl Config<'_> {
    /// Micro-batches of this program's step.
    fn micro_batches(&self) -> u32 {
        if self.tbo() {
            2
        } else {
            1
        }
    }
    /// The query and KV heads one rank's attention computes, and each
    /// rank's first of each (TP shards heads; EP's data-parallel attention
    /// holds them all).
    fn heads(&self) -> (i64, i64, Arg, Arg) {
        let (Attention::Gqa { heads, .. } | Attention::Mla { heads, .. }) = self.m.attention;
        let world = self.world.len();
        let kv = i64::from(self.kv_mode().heads_per_rank);
        if self.mode == Mode::Tp {
            let per = i64::from(heads) / world as i64;
            let q0 = (0..world as i64).map(|r| r * per).collect();
            let kv0 = (0..world).map(|r| self.mem.kv.tp_heads.get(r).map_or(0, |h| i64::from(h[0]))).collect();
            (per, kv, Arg::PerRank { values: q0 }, Arg::PerRank { values: kv0 })
        } else {
            let zero = Arg::PerRank { values: vec![0; world] };
            (i64::from(heads), kv, zero.clone(), zero)
        }
    }
    /// The KV pages of this program's mode.
    fn kv_mode(&self) -> &moeforge_plan::memory::KvMode {
        match (self.mode, &self.mem.kv.tp) {
            (Mode::Tp, Some(tp)) => tp,
            _ => &self.mem.kv.ep,
        }
    }
    fn page_bytes(&self) -> i64 {
        self.kv_mode().page_bytes as i64
    }
    /// Where the permutation's arrays lie in this program's `RouteIndex` slices.
    fn route_parts(&self) -> RouteIndexParts {
        let bytes = self.mem.buffer(self.mode, Buf::RouteIndex).map_or(0, |b| b.slice_bytes(self.micro_batches()));
        RouteIndexParts::of(bytes, u64::from(self.m.moe.experts))
    }
    /// A weight and, when the memory plan stores them, its fp8 block scales
    /// and its bias.
    fn w(&self, role: W) -> Vec<Operand> {
        let mut v = vec![Operand::Weight { role, part: TensorPart::Weight }];
        for part in [TensorPart::ScaleInv, TensorPart::Bias] {
            if self.mem.view(self.mode, role, part).is_some() {
                v.push(Operand::Weight { role, part });
            }
        }
        v
    }
    fn ws(&self, roles: &[W]) -> Vec<Operand> {
        roles.iter().flat_map(|r| self.w(*r)).collect()
    }
    /// A GEMM op on the dense APK: columns `[x_col, x_col + k)` of `x`
    /// times the weights `roles` (back to back) into `y` from `y_col`, with
    /// n and k from the weights' views. Where the kernel cannot run it (fp8
    /// weights, a shape off its alignment) the op names what is missing.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        o: &mut Ops<'_>,
        name: &str,
        stream: u32,
        mb: Option<u32>,
        (x, x_col): (Buf, u32),
        roles: &[W],
        (y, y_col): (Buf, u32),
        epilogue: Epilogue,
        rows: GridVar,
    ) {
        let views: Vec<_> = roles.iter().filter_map(|r| self.mem.view(self.mode, *r, TensorPart::Weight)).collect();
        let rows_of: u32 = views.iter().map(|v| v.shape.first().copied().unwrap_or(0) as u32).sum();
        let k = views.first().and_then(|v| v.shape.get(1)).copied().unwrap_or(0) as u32;
        let n = if epilogue == Epilogue::SwiGlu { rows_of / 2 } else { rows_of };
        let mut reads = vec![buf(x)];
        if epilogue == Epilogue::AddF32 {
            reads.push(buf(y));
        }
        reads.extend(self.ws(roles));
        let args = GemmArgs { n, k, x_col, y_col, rows, epilogue };
        // The instance of the weights' format: bf16, or fp8 with block scales.
        let fp8 = views.first().is_some_and(|v| v.dtype == DType::Fp8E4m3);
        let kernel = if fp8 { launch("dense_fp8", "apk_dense_fp8") } else { launch("dense", "apk_dense") };
        let op = o.push(name, OpKind::Gemm, stream, mb, reads, vec![buf(y)], kernel);
        op.gemm = Some(args);
        // A TP partial sum (o_proj into the all-reduce) would add a bias once per rank.
        let biased = roles.iter().any(|r| self.mem.view(self.mode, *r, TensorPart::Bias).is_some());
        let fits = match (self.dense[usize::from(fp8)], fp8) {
            _ if biased && self.mode == Mode::Tp && y == Buf::AllReduce => {
                Err("a bias on a TP partial sum; every rank would add it".into())
            }
            (true, _) => gemm_fits(op, &args, self.mode, self.mem),
            (false, false) => Err("no dense APK for this target's tiles".into()),
            (false, true) => Err("fp8 weights; this target's dense APK runs bf16".into()),
        };
        if let Err(why) = fits {
            op.gemm = None;
            op.kernel = missing(&format!("dense_gemm ({why})"));
        }
    }
    /// EP phases overlap as the cost model's baselines time them
    /// ([`Overlaps::STANDARD`]), or as the search chose for a role plan; SBO
    /// needs shared experts to run beside the routed ones, and TP has
    /// nothing to overlap.
    fn overlap(&self) -> Overlap {
        let o = match self.phase {
            Phase::Prefill => self.overlaps.prefill,
            Phase::Decode => self.overlaps.decode,
        };
        match o {
            _ if self.mode != Mode::Ep => Overlap::None,
            Overlap::Sbo if self.m.moe.shared_experts == 0 => Overlap::None,
            o => o,
        }
    }
    fn tbo(&self) -> bool {
        self.overlap() == Overlap::Tbo
    }
    fn sbo(&self) -> bool {
        self.overlap() == Overlap::Sbo
    }
    /// Whether this step's dispatch and combine take the hierarchical path
    /// through relays (§5): a colocated prefill step whose group spans
    /// nodes. A combine's relay writes nodes − 1 partial rows per token
    /// position into its dispatch slots (top-k per token): relayed while
    /// nodes − 1 ≤ top-k. (A role plan's MoE servers are reached through
    /// their posts.)
    fn relays(&self) -> bool {
        let nodes = self.group.iter().map(|r| r / self.gpus_per_node).collect::<std::collections::BTreeSet<_>>();
        self.role == Role::Colocated
            && self.phase == Phase::Prefill
            && nodes.len() > 1
            && nodes.len() - 1 <= self.m.moe.top_k as usize
    }
    /// Whether this is a prefill attention server's program in a role plan
    /// whose prefill posts relay (`Path::Relay`): its dispatch and combine
    /// also write its `dispatch` rows (a relay's forwarded rows and
    /// partial sums).
    fn relays_posts(&self) -> bool {
        self.role == Role::Attention && self.phase == Phase::Prefill && self.relayed_posts
    }

    fn program(&self, ranks: Vec<u32>) -> Program {
        let m = self.m;
        let mut events = Vec::new();
        let overlap = self.overlap();
        let micro_batches = if overlap == Overlap::Tbo { 2 } else { 1 };
        // A MoE server issues only its side of the MoE layers: no
        // embedding, attention, dense FFN, shared experts or head.
        let attends = self.role != Role::Moe;
        let mut streams = vec!["compute".to_string()];
        if self.mode == Mode::Ep {
            streams.push("comm".into());
            streams.push("apk".into());
        }
        if self.sbo() && attends {
            streams.push("shared".into());
        }
        let mbs: Vec<Option<u32>> = if micro_batches > 1 { (0..micro_batches).map(Some).collect() } else { vec![None] };
        let mut blocks = Vec::new();

        // Every op of a micro-batched step works on its micro-batch's slices
        // (its tokens, requests, sampled rows), the prologue and epilogue too:
        // a micro-batch is a step of its own requests.
        let mut o = Ops { events: &mut events, ops: vec![] };
        for &mb in mbs.iter().filter(|_| attends) {
            o.push(
                "embed",
                OpKind::Embedding,
                COMPUTE,
                mb,
                [vec![buf(Buf::TokenIds)], self.w(W::Embedding)].concat(),
                vec![buf(Buf::Residual)],
                launch("layer", "embed_rows"),
            );
            o.args(vec![ptr(Buf::TokenIds), wptr(W::Embedding), cnt(GridVar::Tokens), ptr(Buf::Residual)]);
        }
        blocks.push(Block { kind: BlockKind::Prologue, layers: None, ops: o.ops });

        let first_moe = self.mem.slots.first_moe_layer;
        if first_moe > 0 {
            let mut o = Ops { events: &mut events, ops: vec![] };
            for &mb in mbs.iter().filter(|_| attends) {
                self.attention(&mut o, mb);
                let t = GridVar::Tokens;
                let gu = [W::DenseGate, W::DenseUp];
                let (normed, mid) = ((Buf::Normed, 0), (Buf::FfnMid, 0));
                self.gemm(&mut o, "dense_gate_up", COMPUTE, mb, normed, &gu, mid, Epilogue::SwiGlu, t);
                let down = [W::DenseDown];
                self.gemm(&mut o, "dense_down", COMPUTE, mb, mid, &down, (Buf::Residual, 0), Epilogue::AddF32, t);
            }
            blocks.push(Block { kind: BlockKind::Dense, layers: Some([0, first_moe]), ops: o.ops });
        }
        let mut o = Ops { events: &mut events, ops: vec![] };
        match self.mode {
            Mode::Ep => self.ep_moe_layer(&mut o, &mbs),
            Mode::Tp => {
                self.attention(&mut o, None);
                self.tp_moe(&mut o);
            }
        }
        blocks.push(Block { kind: BlockKind::Moe, layers: Some([first_moe, m.layers]), ops: o.ops });

        let mut o = Ops { events: &mut events, ops: vec![] };
        let head = if m.tie_embeddings { W::Embedding } else { W::LmHead };
        for &mb in mbs.iter().filter(|_| attends) {
            o.push(
                "final_norm",
                OpKind::RmsNorm { add: false },
                COMPUTE,
                mb,
                [vec![buf(Buf::Residual), buf(Buf::SampleRows)], self.w(W::FinalNorm)].concat(),
                vec![buf(Buf::Normed)],
                launch("layer", "rms_norm"),
            )
            .grid = Some(Grid::Per { over: GridVar::SampledRows, per: 1 });
            let rows = GridVar::SampledRows;
            o.args(vec![ptr(Buf::Residual), ptr(Buf::SampleRows), wptr(W::FinalNorm), cnt(rows), ptr(Buf::Normed)]);
            let (normed, logits) = ((Buf::Normed, 0), (Buf::Logits, 0));
            self.gemm(
                &mut o,
                "lm_head",
                COMPUTE,
                mb,
                normed,
                &[head],
                logits,
                Epilogue::StoreF32,
                GridVar::SampledRows,
            );
            o.push(
                "sample",
                OpKind::Sample,
                COMPUTE,
                mb,
                vec![buf(Buf::Logits), buf(Buf::SampleRows), buf(Buf::RowRequest), buf(Buf::RequestMeta)],
                // The sampler advances each request's generator state in its header.
                vec![buf(Buf::RequestMeta), buf(Buf::Sampled)],
                launch("layer", "sample_tokens"),
            );
            o.args(vec![
                ptr(Buf::Logits),
                cnt(GridVar::SampledRows),
                ptr(Buf::SampleRows),
                ptr(Buf::RowRequest),
                ptr(Buf::RequestMeta),
                ptr(Buf::Sampled),
            ]);
        }
        blocks.push(Block { kind: BlockKind::Epilogue, layers: None, ops: o.ops });

        Program {
            role: self.role,
            mode: self.mode,
            phase: self.phase,
            ranks,
            overlap,
            micro_batches,
            streams,
            events,
            blocks,
        }
    }

    /// Input norm through the post-attention norm of one micro-batch: the
    /// residual has had attention added and `normed` holds the FFN's input.
    fn attention(&self, o: &mut Ops<'_>, mb: Option<u32>) {
        let m = self.m;
        let (c, tp) = (COMPUTE, self.mode == Mode::Tp);
        let (r, qkv) = (buf(Buf::Residual), buf(Buf::Qkv));
        let (t, bf16) = (GridVar::Tokens, Epilogue::StoreBf16);
        let normed = (Buf::Normed, 0);
        o.push(
            "input_norm",
            OpKind::RmsNorm { add: false },
            c,
            mb,
            [vec![r], self.w(W::InputNorm)].concat(),
            vec![buf(Buf::Normed)],
            launch("layer", "rms_norm"),
        );
        o.args(vec![ptr(Buf::Residual), Arg::Null, wptr(W::InputNorm), cnt(t), ptr(Buf::Normed)]);
        let (qh, kvh, q0, kv0) = self.heads();
        let yarn = m.rope_scaling.is_some();
        let kind = match m.attention {
            Attention::Gqa { qk_norm, qk_norm_scope, sinks, .. } => {
                // q, k and v are one packed matrix: one GEMM.
                self.gemm(o, "qkv_proj", c, mb, normed, &[W::QProj, W::KProj, W::VProj], (Buf::Qkv, 0), bf16, t);
                if qk_norm {
                    let norms = self.ws(&[W::QNorm, W::KNorm]);
                    let all = qk_norm_scope == QkNormScope::PerLayer;
                    if all && tp {
                        // Each rank holds its heads only: the all-head RMS needs
                        // every rank's sum of squares.
                        o.push(
                            "qk_sumsq",
                            OpKind::QkSumSq,
                            c,
                            mb,
                            vec![qkv],
                            vec![buf(Buf::QkSumSq)],
                            launch("layer", "qk_sumsq"),
                        );
                        let k_share = 1.0 / self.mem.kv.replication.max(1) as f32;
                        o.args(vec![
                            ptr(Buf::Qkv),
                            cnt(t),
                            int(qh),
                            int(kvh),
                            Arg::Float { value: k_share },
                            ptr(Buf::QkSumSq),
                        ]);
                        self.comm(
                            o,
                            "qk_sumsq_all_reduce",
                            CommKind::AllReduce,
                            mb,
                            vec![buf(Buf::QkSumSq)],
                            (Buf::QkSumSq, Buf::QkSumSq),
                            &[],
                            8,
                            Role::Colocated,
                        );
                        o.push(
                            "qk_norm",
                            OpKind::QkNorm { all_heads: true, partial: true },
                            c,
                            mb,
                            [vec![qkv, buf(Buf::QkSumSq)], norms].concat(),
                            vec![qkv],
                            launch("layer", "qk_norm"),
                        );
                        let sumsq = ptr(Buf::QkSumSq);
                        o.args(self.qk_norm_args(qh, kvh, &q0, &kv0, sumsq));
                    } else {
                        o.push(
                            "qk_norm",
                            OpKind::QkNorm { all_heads: all, partial: false },
                            c,
                            mb,
                            [vec![qkv], norms].concat(),
                            vec![qkv],
                            launch("layer", "qk_norm"),
                        );
                        o.args(self.qk_norm_args(qh, kvh, &q0, &kv0, Arg::Null));
                    }
                }
                let variant = if yarn { RopeVariant::YarnStandard } else { RopeVariant::Standard };
                o.push(
                    "rope",
                    OpKind::Rope { variant },
                    c,
                    mb,
                    vec![qkv, buf(Buf::Positions)],
                    vec![qkv],
                    launch("layer", "rope"),
                );
                o.args(vec![ptr(Buf::Qkv), ptr(Buf::Positions), cnt(t), int(qh), int(kvh)]);
                if sinks {
                    AttentionKind::GqaSinks
                } else {
                    AttentionKind::Gqa
                }
            }
            Attention::Mla { heads, q_lora, kv_lora, qk_nope, qk_rope, indexer, .. } => {
                // The Qkv row: q_a, q, kv_a (latent ‖ rope key), then the DSA indexer's k, q and weights.
                let row = moeforge_plan::memory::MlaRow::new(heads, q_lora, kv_lora, qk_nope, qk_rope, indexer);
                let (q_at, kv_at) = (row.q, row.kv);
                if q_lora.is_some() {
                    self.gemm(o, "q_a_proj", c, mb, normed, &[W::QAProj], (Buf::Qkv, 0), bf16, t);
                    o.push(
                        "q_a_norm",
                        OpKind::RmsNorm { add: false },
                        c,
                        mb,
                        [vec![qkv], self.w(W::QANorm)].concat(),
                        vec![qkv],
                        launch("layer", "latent_norm"),
                    );
                    o.args(vec![ptr(Buf::Qkv), cnt(t), int(0), int(q_at), wptr(W::QANorm)]);
                    self.gemm(o, "q_b_proj", c, mb, (Buf::Qkv, 0), &[W::QBProj], (Buf::Qkv, q_at), bf16, t);
                } else {
                    self.gemm(o, "q_proj", c, mb, normed, &[W::QProj], (Buf::Qkv, q_at), bf16, t);
                }
                self.gemm(o, "kv_a_proj", c, mb, normed, &[W::KvAProj], (Buf::Qkv, kv_at), bf16, t);
                o.push(
                    "kv_a_norm",
                    OpKind::RmsNorm { add: false },
                    c,
                    mb,
                    [vec![qkv], self.w(W::KvANorm)].concat(),
                    vec![qkv],
                    launch("layer", "latent_norm"),
                );
                o.args(vec![ptr(Buf::Qkv), cnt(t), int(kv_at), int(kv_lora), wptr(W::KvANorm)]);
                if indexer.is_some() {
                    // The indexer's query reads the normed q latent (the
                    // hidden rows without a q LoRA), its key and per-head
                    // weights the hidden rows; the key is LayerNormed in place.
                    let q_in = if q_lora.is_some() { (Buf::Qkv, 0) } else { normed };
                    self.gemm(o, "indexer_q_proj", c, mb, q_in, &[W::IndexerQ], (Buf::Qkv, row.ix_q), bf16, t);
                    self.gemm(o, "indexer_k_proj", c, mb, normed, &[W::IndexerK], (Buf::Qkv, row.ix_k), bf16, t);
                    self.gemm(
                        o,
                        "indexer_weights_proj",
                        c,
                        mb,
                        normed,
                        &[W::IndexerWeights],
                        (Buf::Qkv, row.ix_w),
                        bf16,
                        t,
                    );
                    o.push(
                        "indexer_k_norm",
                        OpKind::LayerNorm,
                        c,
                        mb,
                        [vec![qkv], self.w(W::IndexerKNorm)].concat(),
                        vec![qkv],
                        launch("layer", "indexer_key_norm"),
                    );
                    o.args(vec![ptr(Buf::Qkv), cnt(t), wptr(W::IndexerKNorm)]);
                }
                let variant = if yarn { RopeVariant::YarnInterleaved } else { RopeVariant::Interleaved };
                o.push(
                    "rope",
                    OpKind::Rope { variant },
                    c,
                    mb,
                    vec![qkv, buf(Buf::Positions)],
                    vec![qkv],
                    launch("layer", "mla_rope"),
                );
                o.args(vec![ptr(Buf::Qkv), ptr(Buf::Positions), cnt(t), int(qh)]);
                if indexer.is_some() {
                    AttentionKind::MlaSparse
                } else {
                    AttentionKind::Mla
                }
            }
        };
        o.push(
            "kv_write",
            OpKind::KvWrite,
            c,
            mb,
            vec![qkv, buf(Buf::SlotMap)],
            vec![Operand::Kv],
            match m.attention {
                Attention::Gqa { .. } => launch("layer", "kv_write"),
                // DSA: the indexer key continues the entry.
                Attention::Mla { .. } => launch("layer", "mla_kv_write"),
            },
        );
        let (slots, pages) = (ptr(Buf::SlotMap), int(self.page_bytes()));
        match m.attention {
            Attention::Gqa { .. } => {
                o.args(vec![ptr(Buf::Qkv), slots, cnt(t), int(qh), int(kvh), kv(), pages, Arg::Layer]);
            }
            Attention::Mla { .. } => o.args(vec![ptr(Buf::Qkv), slots, cnt(t), kv(), pages, Arg::Layer]),
        }
        let mut reads = vec![qkv, Operand::Kv, buf(Buf::RequestMeta), buf(Buf::Positions)];
        if let Attention::Mla { indexer: Some(ix), .. } = m.attention {
            o.push(
                "indexer",
                OpKind::Indexer { top_k: ix.top_k },
                c,
                mb,
                vec![qkv, Operand::Kv, buf(Buf::RequestMeta), buf(Buf::Positions), buf(Buf::RowRequest)],
                vec![buf(Buf::IndexerTopk)],
                launch("layer", "dsa_indexer"),
            );
            o.args(vec![
                ptr(Buf::Qkv),
                ptr(Buf::Positions),
                ptr(Buf::RowRequest),
                ptr(Buf::RequestMeta),
                cnt(t),
                kv(),
                int(self.page_bytes()),
                Arg::Layer,
                ptr(Buf::IndexerTopk),
            ]);
            reads.push(buf(Buf::IndexerTopk));
        }
        if kind == AttentionKind::GqaSinks {
            reads.extend(self.w(W::Sinks));
        }
        if matches!(kind, AttentionKind::Mla | AttentionKind::MlaSparse) {
            reads.extend(self.w(W::KvBProj));
        }
        // GQA runs the layer instance's paged causal attention in both phases,
        // MLA its weight-absorbed attention in both phases too: the kv_b GEMM
        // folds into the query and the output, so a prefill row attends over
        // the latent cache like a decode row (causal, and right for extends
        // over a cached prefix). A naive-form prefill kernel, FLOP-cheaper on
        // long prompts, is not built. DSA's sparse attention is the same over
        // the indexer's selection; GPT-OSS's sinks and sliding windows are the
        // GQA kernel's (its sinks pointer, its per-layer window). The absorbed
        // attention reads kv_b as stored: bf16, or fp8 codes and their block
        // scales.
        let kv_b = match self.mem.view(self.mode, W::KvBProj, TensorPart::Weight).map(|v| v.dtype) {
            Some(DType::Fp8E4m3) => vec![
                wptr(W::KvBProj),
                Arg::Ptr { operand: Operand::Weight { role: W::KvBProj, part: TensorPart::ScaleInv }, at: 0 },
            ],
            _ => vec![wptr(W::KvBProj)],
        };
        let (rows, pages) =
            ((ptr(Buf::Positions), ptr(Buf::RowRequest), ptr(Buf::RequestMeta)), int(self.page_bytes()));
        let (kernel, args) = match (kind, self.phase) {
            (AttentionKind::Gqa | AttentionKind::GqaSinks, _) => {
                reads.push(buf(Buf::RowRequest));
                let (pos, rr, meta) = rows;
                let a = vec![ptr(Buf::Qkv), pos, rr, meta, cnt(t), int(qh), int(kvh), q0, kv0, kv(), pages, Arg::Layer];
                let sinks = if kind == AttentionKind::GqaSinks { wptr(W::Sinks) } else { Arg::Null };
                // Prefill tiles its rows on tensor cores where the layer
                // instance has the kernel; decode reads the pages per row.
                let entry = match (self.phase, self.flash) {
                    (Phase::Prefill, Some(_)) => "flash_prefill",
                    _ => "paged_attention",
                };
                (launch("layer", entry), [a, vec![sinks, ptr(Buf::Attn)]].concat())
            }
            (AttentionKind::Mla, _) => {
                reads.push(buf(Buf::RowRequest));
                let (pos, rr, meta) = rows;
                let a = vec![ptr(Buf::Qkv), pos, rr, meta, cnt(t), int(qh)];
                let tail = vec![kv(), pages, Arg::Layer, ptr(Buf::Attn)];
                (launch("layer", "mla_attention"), [a, kv_b, tail].concat())
            }
            (AttentionKind::MlaSparse, _) => {
                // The selection names the keys: no positions.
                reads.retain(|r| *r != buf(Buf::Positions));
                reads.push(buf(Buf::RowRequest));
                let (_, rr, meta) = rows;
                let a = vec![ptr(Buf::Qkv), rr, meta, cnt(t), int(qh)];
                let tail = vec![kv(), pages, Arg::Layer, ptr(Buf::IndexerTopk), ptr(Buf::Attn)];
                (launch("layer", "mla_sparse_attention"), [a, kv_b, tail].concat())
            }
        };
        let flash = matches!(&kernel, KernelRef::Launch { entry, .. } if entry == "flash_prefill");
        let op = o.push(
            "attention",
            OpKind::Attention { kind, phase: self.phase },
            c,
            mb,
            reads,
            vec![buf(Buf::Attn)],
            kernel,
        );
        if let (true, Some(a)) = (flash, self.flash) {
            // One block per tile of rows and local query head.
            op.grid = Some(Grid::Tiles { over: t, per: a.block_q, times: qh as u32 });
        }
        o.args(args);
        if tp {
            let f32 = Epilogue::StoreF32;
            self.gemm(o, "o_proj", c, mb, (Buf::Attn, 0), &[W::OProj], (Buf::AllReduce, 0), f32, t);
            self.comm(
                o,
                "attn_all_reduce",
                CommKind::AllReduce,
                mb,
                vec![buf(Buf::AllReduce)],
                (Buf::AllReduce, Buf::AllReduce),
                &[],
                u64::from(m.hidden) * 4,
                Role::Colocated,
            );
            o.push(
                "post_attention_norm",
                OpKind::RmsNorm { add: true },
                c,
                mb,
                [vec![buf(Buf::AllReduce), r], self.w(W::PostAttentionNorm)].concat(),
                vec![r, buf(Buf::Normed)],
                launch("layer", "add_rms_norm"),
            );
            let w = wptr(W::PostAttentionNorm);
            o.args(vec![ptr(Buf::Residual), ptr(Buf::AllReduce), w, cnt(t), ptr(Buf::Normed)]);
        } else {
            self.gemm(o, "o_proj", c, mb, (Buf::Attn, 0), &[W::OProj], (Buf::Residual, 0), Epilogue::AddF32, t);
            o.push(
                "post_attention_norm",
                OpKind::RmsNorm { add: false },
                c,
                mb,
                [vec![r], self.w(W::PostAttentionNorm)].concat(),
                vec![buf(Buf::Normed)],
                launch("layer", "rms_norm"),
            );
            o.args(vec![ptr(Buf::Residual), Arg::Null, wptr(W::PostAttentionNorm), cnt(t), ptr(Buf::Normed)]);
        }
    }

    /// A communication op over every rank of the plan on `comm` (EP) or
    /// `compute` (TP, where nothing runs beside it).
    #[allow(clippy::too_many_arguments)]
    fn comm(
        &self,
        o: &mut Ops<'_>,
        name: &str,
        kind: CommKind,
        mb: Option<u32>,
        reads: Vec<Operand>,
        (from, to): (Buf, Buf),
        with: &[[Buf; 2]],
        row_bytes: u64,
        sender: Role,
    ) {
        let stream = if self.mode == Mode::Ep { COMM } else { COMPUTE };
        let mut writes: Vec<Operand> = std::iter::once(to).chain(with.iter().map(|w| w[1])).map(buf).collect();
        let mut reads = reads;
        // A role program lists its own side: the sender's reads, the
        // receiver's writes.
        match self.role {
            Role::Colocated => {}
            r if r == sender => writes.clear(),
            _ => reads.clear(),
        }
        let op = o.push(name, OpKind::Comm, stream, mb, reads, writes, KernelRef::Transfer);
        op.comm =
            Some(Comm { kind, group: self.group.to_vec(), from, to, with: with.to_vec(), row_bytes, relay: None });
    }
    fn qk_norm_args(&self, qh: i64, kvh: i64, q0: &Arg, kv0: &Arg, sumsq: Arg) -> Vec<Arg> {
        let t = cnt(GridVar::Tokens);
        vec![ptr(Buf::Qkv), wptr(W::QNorm), wptr(W::KNorm), t, int(qh), int(kvh), q0.clone(), kv0.clone(), sumsq]
    }

    /// The router's GEMM and top-k of one micro-batch.
    fn route(&self, o: &mut Ops<'_>, mb: Option<u32>) {
        let c = COMPUTE;
        let (normed, logits) = ((Buf::Normed, 0), (Buf::RouterLogits, 0));
        self.gemm(o, "router_gemm", c, mb, normed, &[W::Router], logits, Epilogue::StoreF32, GridVar::Tokens);
        let mut reads = vec![buf(Buf::RouterLogits)];
        let reads_bias = matches!(self.m.moe.routing, Routing::SigmoidGrouped { bias: true, .. });
        if reads_bias {
            reads.extend(self.w(W::RouterBias));
        }
        o.push(
            "route",
            OpKind::Route,
            c,
            mb,
            reads,
            vec![buf(Buf::TopkIds), buf(Buf::TopkWeights)],
            launch("router", "moe_router"),
        );
        let bias = if reads_bias { wptr(W::RouterBias) } else { Arg::Null };
        o.args(vec![ptr(Buf::RouterLogits), bias, ptr(Buf::TopkIds), ptr(Buf::TopkWeights), cnt(GridVar::Tokens)]);
    }

    fn shared(&self, o: &mut Ops<'_>, stream: u32, mb: Option<u32>) {
        let (t, mid) = (GridVar::Tokens, (Buf::FfnMid, 0));
        let gu = [W::SharedGate, W::SharedUp];
        self.gemm(o, "shared_gate_up", stream, mb, (Buf::Normed, 0), &gu, mid, Epilogue::SwiGlu, t);
        let out = (Buf::SharedOut, 0);
        self.gemm(o, "shared_down", stream, mb, mid, &[W::SharedDown], out, Epilogue::StoreBf16, t);
    }

    /// Permute, gather, experts and the weighted row combine over the rows
    /// in `input` (received rows in EP, every token in TP), into `out`.
    fn experts(&self, o: &mut Ops<'_>, mb: Option<u32>, input: Buf, out: Buf) {
        let (c, ep) = (COMPUTE, self.mode == Mode::Ep);
        let ri = buf(Buf::RouteIndex);
        // TP permutes every token over every expert (num_local = E); EP its
        // received rows over its own experts.
        let permute = |entry: &str| launch("permute", entry);
        let (ids, weights) =
            if ep { (Buf::DispatchIds, Buf::DispatchWeights) } else { (Buf::TopkIds, Buf::TopkWeights) };
        let (rows, entries) =
            if ep { (GridVar::Received, GridVar::ReceivedEntries) } else { (GridVar::Tokens, GridVar::Entries) };
        let e = self.m.moe.experts;
        let (begin, local): (Vec<i64>, Vec<i64>) = self
            .experts
            .iter()
            .map(|r| if ep { (i64::from(r[0]), i64::from(r[1] - r[0])) } else { (0, i64::from(e)) })
            .unzip();
        let (begin, local) = (Arg::PerRank { values: begin }, Arg::PerRank { values: local });
        let parts = self.route_parts();
        let part = |at: u64| ptr_at(Buf::RouteIndex, at);
        o.push("permute_count", OpKind::Permute, c, mb, vec![buf(ids)], vec![ri], permute("moe_count"));
        o.args(vec![ptr(ids), cnt(entries), begin.clone(), local.clone(), part(parts.counts), part(parts.entry_row)]);
        // The rows the layout may fill (the device refuses more).
        let room = self.mem.permute_room(self.mode, self.micro_batches(), e, self.apk_rows).min(i32::MAX as u64) as i64;
        o.push("permute_offsets", OpKind::Permute, c, mb, vec![ri], vec![ri], permute("moe_offsets"));
        o.args(vec![part(parts.counts), local.clone(), int(room), part(parts.offsets), part(parts.overflow)]);
        o.push("permute_scatter", OpKind::Permute, c, mb, vec![buf(ids), ri], vec![ri], permute("moe_scatter"));
        o.args(vec![
            ptr(ids),
            cnt(entries),
            begin,
            part(parts.counts),
            part(parts.offsets),
            part(parts.row_entry),
            part(parts.row_expert),
            part(parts.entry_row),
        ]);
        o.push(
            "gather",
            OpKind::Gather,
            c,
            mb,
            vec![buf(input), ri],
            vec![buf(Buf::Permuted)],
            launch("permute", "moe_gather"),
        );
        o.args(vec![ptr(input), part(parts.row_entry), part(parts.offsets), local, ptr(Buf::Permuted)]);
        let kernel = match self.apk {
            Some(apk) if ep => KernelRef::Post { instance: apk.to_string() },
            None if ep => KernelRef::Skip { reason: "the rank holds no routed experts".into() },
            // TP's instance runs alone on the one stream, launched per op.
            Some(apk) => launch(apk, "moe_apk"),
            None => missing("apk (tp: every expert's 1/P of the intermediate; its tiles do not fit this shape)"),
        };
        // EP posts the op to the persistent APK, which runs it beside this
        // rank's streams: the `apk` stream stands for its operation queue, the
        // post waits for the gathered rows and WaitDone is the combine's wait
        // on its record.
        let gathered = if ep { Some(o.record(mb_name("gathered", mb))) } else { None };
        let stream = if ep { APK } else { c };
        o.push(
            "experts",
            OpKind::Experts,
            stream,
            mb,
            [vec![buf(Buf::Permuted), ri], self.ws(&[W::ExpertsW13, W::ExpertsW2])].concat(),
            vec![buf(Buf::GateUp), buf(Buf::ExpertOut)],
            kernel,
        );
        let expert_rows = gathered.map(|g| {
            o.wait(g);
            o.record(mb_name("experts_out", mb))
        });
        // EP's combine writes bf16 rows (per-source partial sums sent back);
        // TP's keeps its f32 partial sums for the all-reduce.
        let combine = launch("permute", if ep { "moe_combine" } else { "moe_combine_f32" });
        o.push(
            "combine_rows",
            OpKind::CombineRows,
            c,
            mb,
            vec![buf(Buf::ExpertOut), ri, buf(weights)],
            vec![buf(out)],
            combine,
        );
        o.args(vec![ptr(Buf::ExpertOut), part(parts.entry_row), ptr(weights), cnt(rows), ptr(out)]);
        if ep {
            if let Some(op) = o.ops.last_mut() {
                op.grid = Some(Grid::Per { over: rows, per: 1 });
            }
        }
        if let Some(e) = expert_rows {
            o.wait(e);
        }
    }

    /// One EP MoE layer: attention, routing, dispatch, experts, combine and
    /// the residual add of every micro-batch, overlapped as the module says.
    /// An attention server issues all but the routed experts, a MoE server
    /// only the dispatch, the experts and the combine.
    fn ep_moe_layer(&self, o: &mut Ops<'_>, mbs: &[Option<u32>]) {
        let m = self.m;
        let h = u64::from(m.hidden);
        let k = u64::from(m.moe.top_k);
        let has_shared = m.moe.shared_experts > 0;
        let (attends, computes) = (self.role != Role::Moe, self.role != Role::Attention);
        let mut dispatched = Vec::new();
        for &mb in mbs {
            let routed = attends.then(|| {
                self.attention(o, mb);
                let normed = if self.sbo() { Some(o.record(mb_name("normed", mb))) } else { None };
                if let Some(e) = normed {
                    let first = o.ops.len();
                    self.shared(o, SHARED, mb);
                    o.ops[first].waits.push(e);
                    o.record(mb_name("shared_done", mb));
                }
                self.route(o, mb);
                // The dispatch leaves as soon as the routing is known; in prefill
                // the shared experts then run on `compute` beside it.
                let routed = o.record(mb_name("routed", mb));
                if has_shared && !self.sbo() {
                    self.shared(o, COMPUTE, mb);
                }
                routed
            });
            let reads = vec![buf(Buf::Normed), buf(Buf::TopkIds), buf(Buf::TopkWeights)];
            let with = [[Buf::TopkIds, Buf::DispatchIds], [Buf::TopkWeights, Buf::DispatchWeights]];
            let rows = (Buf::Normed, Buf::Dispatch);
            self.comm(o, "dispatch", CommKind::AllToAll, mb, reads, rows, &with, h * 2 + k * 8, Role::Attention);
            // Prefill's dispatch across nodes takes the hierarchical path
            // too (§5, Zepp's merge): a token's row crosses once per node,
            // to the GPU with its source's local rank, which forwards it
            // over NVLink. Decode's few rows go straight, for latency.
            if let Some(c) = o.ops.last_mut().and_then(|op| op.comm.as_mut()).filter(|_| self.relays()) {
                c.relay = Some(Relay { gpus_per_node: self.gpus_per_node, via: Buf::Dispatch });
            }
            if let Some(op) = o.ops.last_mut().filter(|_| self.relays_posts()) {
                op.writes.push(buf(Buf::Dispatch));
            }
            if let Some(routed) = routed {
                o.wait(routed);
            }
            dispatched.push(o.record(mb_name("dispatched", mb)));
        }
        let mut combined = Vec::new();
        for (&mb, &d) in mbs.iter().zip(&dispatched) {
            let done = computes.then(|| {
                let before = o.ops.len();
                self.experts(o, mb, Buf::Dispatch, Buf::Combine);
                o.ops[before].waits.push(d);
                o.record(mb_name("experts_done", mb))
            });
            let rows = (Buf::Combine, Buf::MoeOut);
            self.comm(o, "combine", CommKind::AllToAll, mb, vec![buf(Buf::Combine)], rows, &[], h * 2, Role::Moe);
            // Prefill's combine across nodes takes the hierarchical path
            // (§5): node-local partial sums on the relays, one row per
            // (token, node) over the scale-out link. Decode's rows are few:
            // it pulls directly, for latency.
            if let Some(op) = o.ops.last_mut().filter(|_| self.relays() || self.relays_posts()) {
                op.writes.push(buf(Buf::Dispatch));
                if let Some(c) = op.comm.as_mut().filter(|_| self.relays()) {
                    c.relay = Some(Relay { gpus_per_node: self.gpus_per_node, via: Buf::Dispatch });
                }
            }
            if let Some(done) = done {
                o.wait(done);
            }
            combined.push(o.record(mb_name("combined", mb)));
        }
        for (&mb, &cb) in mbs.iter().zip(&combined).filter(|_| attends) {
            let mut reads = vec![buf(Buf::MoeOut), buf(Buf::Residual)];
            if has_shared {
                reads.push(buf(Buf::SharedOut));
            }
            o.push(
                "moe_residual",
                OpKind::ResidualAdd,
                COMPUTE,
                mb,
                reads,
                vec![buf(Buf::Residual)],
                launch("layer", "residual_add"),
            );
            let shared = if has_shared { ptr(Buf::SharedOut) } else { Arg::Null };
            o.args(vec![ptr(Buf::Residual), ptr(Buf::MoeOut), shared, cnt(GridVar::Tokens)]);
            o.wait(cb);
            if self.sbo() {
                let e = o.event(mb_name("shared_done", mb));
                o.wait(e);
            }
        }
    }

    /// TP's MoE: every rank routes every token, computes every expert's
    /// `1/P` slice, and all-reduces the partial sums.
    fn tp_moe(&self, o: &mut Ops<'_>) {
        let h = u64::from(self.m.hidden);
        self.route(o, None);
        if self.m.moe.shared_experts > 0 {
            self.shared(o, COMPUTE, None);
        }
        self.experts(o, None, Buf::Normed, Buf::AllReduce);
        self.comm(
            o,
            "moe_all_reduce",
            CommKind::AllReduce,
            None,
            vec![buf(Buf::AllReduce)],
            (Buf::AllReduce, Buf::AllReduce),
            &[],
            h * 4,
            Role::Colocated,
        );
        let mut reads = vec![buf(Buf::AllReduce), buf(Buf::Residual)];
        if self.m.moe.shared_experts > 0 {
            reads.push(buf(Buf::SharedOut));
        }
        o.push(
            "moe_residual",
            OpKind::ResidualAdd,
            COMPUTE,
            None,
            reads,
            vec![buf(Buf::Residual)],
            launch("layer", "residual_add"),
        );
        let shared = if self.m.moe.shared_experts > 0 { ptr(Buf::SharedOut) } else { Arg::Null };
        o.args(vec![ptr(Buf::Residual), ptr(Buf::AllReduce), shared, cnt(GridVar::Tokens)]);
    }
}

fn launch(instance: &str, entry: &str) -> KernelRef {
    KernelRef::Launch { instance: instance.into(), entry: entry.into() }
}
