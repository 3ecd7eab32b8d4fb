//! Kernel instance pass: which kernels this deployment needs and their
//! specialization constants.
//!
//! The routing path every MoE layer runs before and after the grouped GEMMs:
//! the router (the model's scoring and top-k rule) and the token permutation
//! into the prefill phase's expert-contiguous layout, with its inverse for
//! combine. Then [`apk`]: the Adaptive Persistent Kernel per distinct MoE
//! rank shape, which runs the grouped GEMMs of both phases.

use super::{At, Ctx, PassError};
use crate::target::{self, ApkInput, TileError, FP8_SCALE_BLOCK};
use moeforge_dsl::spec::PlacementPolicy;
use moeforge_dsl::spec::{Deploy, Routing, Spec};
use moeforge_dsl::Code;
use moeforge_plan::cost::expected_x_moe;
use moeforge_plan::cost::CostModel;
use moeforge_plan::memory::MAX_BATCH_TOKENS;
use moeforge_plan::placement::PlacementPlan;
use moeforge_plan::search::Candidate;
use moeforge_plan::{
    ApkForm, ApkParams, EntryPoint, GqaLayerParams, Grid, GridVar, KernelInstance, KernelParams, LayerParams,
    MlaLayerParams, PermuteParams, Plan, QkNormKind, RankPlan, RouterParams, Scoring, WeightFormat, ZeppParams,
};

const ROUTER_WARPS: u32 = 4;
/// 8 blocks of 128 threads per SM leaves 64 registers per thread, enough for
/// 12 scores per lane (384 experts) without spilling.
const ROUTER_MIN_BLOCKS: u32 = 8;
const PERMUTE_THREADS: u32 = 256;
/// One block of 256 threads per token or row for the layer kernels.
const LAYER_THREADS: u32 = 256;
/// The routing kernel: one thread per expert (strided), one block.
const ZEPP_THREADS: u32 = 256;

/// Writes `plan.kernels`: the router, the permutation and the APKs. It
/// emits no source (that is `emit`).
pub fn run(cx: &Ctx<'_>, plan: &mut Plan) -> Result<(), Vec<PassError>> {
    // TP permutes every token over every expert; the kernels take the
    // rank's expert count at run time, up to this bound.
    let tp = plan.memory.modes.contains(&moeforge_plan::memory::Mode::Tp);
    let max_local = if tp { cx.model.moe.experts } else { plan.layout.max_experts_per_rank };
    let mut kernels = routing(cx.spec, cx.deploy, max_local);
    let tp_world = tp.then_some(plan.ranks.len() as u32);
    // A role plan's APK runs the layout it realizes; otherwise the search's best.
    // (PD instances share no GPU between phases: no searched q applies.)
    let searched = plan.search.as_ref().and_then(|s| match &plan.roles {
        Some(r) if r.moe_servers() => s.realizable(),
        Some(_) => None,
        None => s.best(),
    });
    let apks = apk(cx.spec, cx.deploy, &local_experts(plan), &plan.cost, searched, tp_world).map_err(|e| match e {
        ApkError::Target(t) => t.into_pass_error(cx),
        ApkError::TooFewSms { sms, cluster } => PassError::new(
            Code::Unsupported,
            At::Cluster("gpu.sms".into()),
            format!(
                "the APK runs CTA clusters of {cluster} CTAs, one per SM, but `{}` has {sms} SM{}: {} too few",
                cx.cluster.gpu.name,
                if sms == 1 { "" } else { "s" },
                cluster - sms
            ),
        )
        .label("fewer SMs than one CTA cluster")
        .help("use a tile set whose prefill gate_up `cluster` is [1, 1], or the GPU's real SM count"),
    })?;
    kernels.extend(apks.iter().cloned());
    kernels.extend(dense(cx, &plan.ranks, apks.first(), WeightFormat::Bf16).map_err(|e| vec![e])?);
    if [cx.model.dtype.weights, cx.model.dtype.experts].contains(&moeforge_dsl::spec::DType::Fp8E4m3) {
        kernels.extend(dense(cx, &plan.ranks, apks.first(), WeightFormat::Fp8E4m3).map_err(|e| vec![e])?);
    }
    kernels.push(layer(cx, &plan.memory));
    if let Some(p) = plan.placement.as_ref().filter(|p| p.policy != PlacementPolicy::None) {
        kernels.push(zepp_route(cx, p));
    }
    plan.kernels = kernels;
    unused_tiles(cx);
    Ok(())
}

/// The APK runs both phases on one grid: one CTA-cluster shape and stage
/// ring (the prefill gate_up tile's) and one tile width per GEMM (prefill's);
/// decode contributes its tile height M_t. Any other tile value differing
/// from the one used has no effect, and says so.
fn unused_tiles(cx: &Ctx<'_>) {
    let (pf, dc) = (&cx.tiles.prefill, &cx.tiles.decode);
    let lead = pf.gate_up;
    let warn = |field: String, value: String, used: String, why: &str| {
        // Only values the spec writes (defaults say nothing).
        if cx.spans.tiles.field(&field).is_none() {
            return;
        }
        cx.warn(
            PassError::new(
                Code::NoEffect,
                At::Tiles(field.clone()),
                format!("`{field}` = {value} has no effect on the kernel: the APK uses {used} ({why})"),
            )
            .label("no effect")
            .help(format!("write {used} here, or remove the field where it is optional")),
        );
    };
    let shape = |c: [u32; 2]| format!("[{}, {}]", c[0], c[1]);
    for (name, t) in [("prefill.down", &pf.down), ("decode.gate_up", &dc.gate_up), ("decode.down", &dc.down)] {
        if t.stages != lead.stages {
            let why = "one stage ring serves both phases' GEMMs";
            warn(format!("{name}.stages"), t.stages.to_string(), format!("prefill.gate_up's {}", lead.stages), why);
        }
        if cx.target.arch().has_clusters() && t.cluster != lead.cluster {
            let why = "one grid of CTA clusters serves both phases";
            warn(
                format!("{name}.cluster"),
                shape(t.cluster),
                format!("prefill.gate_up's {}", shape(lead.cluster)),
                why,
            );
        }
    }
    for (name, t, used) in [("decode.gate_up", &dc.gate_up, &pf.gate_up), ("decode.down", &dc.down, &pf.down)] {
        if t.block_n != used.block_n {
            let prefill = if name.ends_with("gate_up") { "prefill.gate_up" } else { "prefill.down" };
            let why = "decode tiles differ from prefill's in height only";
            warn(format!("{name}.block_n"), t.block_n.to_string(), format!("{prefill}'s {}", used.block_n), why);
        }
    }
}

/// The router and permutation kernels.
fn routing(spec: &Spec, d: &Deploy, max_local: u32) -> Vec<KernelInstance> {
    let m = spec.model(d.model);
    let (arch, sms) = (spec.cluster(d.cluster).gpu.arch, spec.cluster(d.cluster).gpu.sms.max(1));
    let tiles = spec.tile_set(d.tiles);
    let (scoring, norm_topk, scaling, selection_bias, groups, top_groups) = match m.moe.routing {
        Routing::SoftmaxTopk { norm_topk } => (Scoring::Softmax, norm_topk, 1.0, false, 1, 1),
        Routing::SigmoidGrouped { groups, top_groups, scaling, norm_topk, bias } => {
            (Scoring::Sigmoid, norm_topk, scaling, bias, groups, top_groups)
        }
    };
    let router = RouterParams {
        experts: m.moe.experts,
        top_k: m.moe.top_k,
        scoring,
        norm_topk,
        scaling,
        selection_bias,
        groups,
        top_groups,
        group_size: m.moe.experts / groups,
        per_lane: m.moe.experts.div_ceil(32),
        warps_per_block: ROUTER_WARPS,
        min_blocks_per_sm: ROUTER_MIN_BLOCKS,
    };
    let permute = PermuteParams {
        hidden: m.hidden,
        top_k: m.moe.top_k,
        max_local_experts: max_local,
        block_m: tiles.prefill.gate_up.block_m,
        row_vectors: m.hidden / 8,
        threads: PERMUTE_THREADS,
    };
    let p = |s: &str| s.to_string();
    // The weighted combine of each token's expert rows, into `out`.
    let combine = |symbol: &str, out: &str| EntryPoint {
        symbol: symbol.into(),
        grid: Grid::Per { over: GridVar::Tokens, per: 1 },
        block: PERMUTE_THREADS.min(m.hidden / 8),
        dynamic_smem: 0,
        params: vec![
            p("const uint4* y_perm"),
            p("const int32_t* entry_row"),
            p("const float* topk_weights"),
            p("int tokens"),
            p(out),
        ],
    };
    vec![
        KernelInstance {
            name: "router".into(),
            purpose: format!(
                "{} top-{} routing over {} experts{}",
                scoring.name(),
                m.moe.top_k,
                m.moe.experts,
                if groups > 1 { format!(" in {groups} groups (keep {top_groups})") } else { String::new() }
            ),
            arch,
            params: KernelParams::Router(router),
            entries: vec![EntryPoint {
                symbol: "moe_router".into(),
                grid: Grid::Per { over: GridVar::Tokens, per: ROUTER_WARPS },
                block: ROUTER_WARPS * 32,
                dynamic_smem: 0,
                params: vec![
                    p("const float* logits"),
                    p("const float* bias"),
                    p("int32_t* topk_ids"),
                    p("float* topk_weights"),
                    p("int tokens"),
                ],
            }],
        },
        KernelInstance {
            name: "permute".into(),
            purpose: format!(
                "expert-contiguous permutation of up to {} local experts padded to M_t = {}, and weighted combine",
                max_local, permute.block_m
            ),
            arch,
            params: KernelParams::Permute(permute),
            entries: vec![
                EntryPoint {
                    symbol: "moe_count".into(),
                    grid: Grid::Per { over: GridVar::LocalExperts, per: 1 },
                    block: PERMUTE_THREADS,
                    dynamic_smem: 0,
                    params: vec![
                        p("const int32_t* topk_ids"),
                        p("int entries"),
                        p("int expert_begin"),
                        p("int num_local"),
                        p("int32_t* counts"),
                        p("int32_t* entry_row"),
                    ],
                },
                EntryPoint {
                    symbol: "moe_offsets".into(),
                    grid: Grid::Fixed { blocks: 1 },
                    block: 32,
                    dynamic_smem: 0,
                    params: vec![
                        p("int32_t* counts"),
                        p("int num_local"),
                        p("int room"),
                        p("int32_t* offsets"),
                        p("int32_t* overflow"),
                    ],
                },
                EntryPoint {
                    symbol: "moe_scatter".into(),
                    grid: Grid::Per { over: GridVar::LocalExperts, per: 1 },
                    block: PERMUTE_THREADS,
                    dynamic_smem: 0,
                    params: vec![
                        p("const int32_t* topk_ids"),
                        p("int entries"),
                        p("int expert_begin"),
                        p("const int32_t* counts"),
                        p("const int32_t* offsets"),
                        p("int32_t* row_entry"),
                        p("int32_t* row_expert"),
                        p("int32_t* entry_row"),
                    ],
                },
                EntryPoint {
                    symbol: "moe_gather".into(),
                    // One block per SM striding over the rows, which the
                    // kernel reads on the device: no count sizes the grid.
                    grid: Grid::Fixed { blocks: sms },
                    block: PERMUTE_THREADS.min(m.hidden / 8),
                    dynamic_smem: 0,
                    params: vec![
                        p("const uint4* x"),
                        p("const int32_t* row_entry"),
                        p("const int32_t* offsets"),
                        p("int num_local"),
                        p("uint4* x_perm"),
                    ],
                },
                combine("moe_combine", "uint4* out"),
                // TP: the same sum in f32, the rank's partial sums for the all-reduce.
                combine("moe_combine_f32", "float4* out"),
            ],
        },
    ]
}

/// The replica routing every dispatch of a replicated placement runs
/// (`kernels/zepp_route.cu`): sizes are run-time arguments, the policy and
/// the load bound's slack are the placement's.
fn zepp_route(cx: &Ctx<'_>, p: &PlacementPlan) -> KernelInstance {
    let arch = cx.cluster.gpu.arch;
    let p_ = |s: &str| s.to_string();
    let experts = cx.model.moe.experts;
    KernelInstance {
        name: "zepp_route".into(),
        purpose: format!(
            "{} routing of every source's routed entries over each layer's replica table",
            match p.policy {
                PlacementPolicy::Zepp => "Zepp's locality-preferred water-filling and consolidation",
                _ => "EPLB's even-split",
            }
        ),
        arch,
        params: KernelParams::Zepp(ZeppParams { policy: p.policy, slack: p.slack, threads: ZEPP_THREADS }),
        entries: vec![
            EntryPoint {
                symbol: "zepp_count".into(),
                grid: Grid::Fixed { blocks: experts.div_ceil(ZEPP_THREADS) },
                block: ZEPP_THREADS,
                dynamic_smem: 0,
                params: vec![
                    p_("const int32_t* topk_ids"),
                    p_("int entries"),
                    p_("int experts"),
                    p_("int32_t* counts"),
                    p_("int32_t* totals"),
                    p_("const int32_t* kv_slots"),
                    p_("int top_k"),
                ],
            },
            EntryPoint {
                symbol: "zepp_route".into(),
                grid: Grid::Fixed { blocks: 1 },
                block: ZEPP_THREADS,
                dynamic_smem: 0,
                params: vec![
                    p_("const int32_t* topk_ids"),
                    p_("int entries"),
                    p_("const int32_t* demand"),
                    p_("const int32_t* table"),
                    p_("const int32_t* member"),
                    p_("int experts"),
                    p_("int reps"),
                    p_("int world"),
                    p_("int gpus_per_node"),
                    p_("int slots_per_gpu"),
                    p_("int src"),
                    p_("int32_t* work"),
                    p_("int32_t* dest"),
                ],
            },
        ],
    }
}

/// Decode tokens one rank dispatches per step (DeepEP low-latency's default
/// `num_max_dispatch_tokens_per_rank`): the masked layout holds this many
/// rows per expert from every rank.
pub const DECODE_TOKENS_PER_RANK: u32 = 128;
/// Decode requests per rank the x*_moe footprint assumes without a layout search.
const NOMINAL_DECODE_PER_RANK: f64 = 64.0;
/// Why no APK can be generated.
pub enum ApkError {
    Target(TileError),
    /// The GPU has fewer SMs than one CTA cluster.
    TooFewSms {
        sms: u32,
        cluster: u32,
    },
}

impl From<TileError> for ApkError {
    fn from(e: TileError) -> ApkError {
        ApkError::Target(e)
    }
}

/// Expert slots per MoE layer on each rank: its stripe, or the placement's slots.
fn local_experts(plan: &Plan) -> Vec<u32> {
    (0..plan.ranks.len()).map(|r| plan.local_experts(r)).collect()
}

/// One APK per distinct local expert count (ranks with the same count share
/// a kernel; a rank's first expert is a run-time offset of its weights).
/// Decode's SM budget q and x*_moe come from the layout search's
/// candidate `best` when there is one: q as searched, x*_moe the expected decode
/// footprint of its decode batch on these ranks; otherwise q is half the
/// SMs and x*_moe that of 64 requests per rank.
pub fn apk(
    spec: &Spec,
    d: &Deploy,
    held: &[u32],
    cm: &CostModel,
    best: Option<&Candidate>,
    tp_world: Option<u32>,
) -> Result<Vec<KernelInstance>, ApkError> {
    let m = spec.model(d.model);
    let c = spec.cluster(d.cluster);
    let target = target::of(c.gpu.arch);
    if c.gpu.sms < cm.cluster {
        return Err(ApkError::TooFewSms { sms: c.gpu.sms, cluster: cm.cluster });
    }
    let weights = target.weight_format(m.dtype.experts, m.dtype.block_scale)?;
    let fp8 = weights == WeightFormat::Fp8E4m3;
    let tiles = spec.tile_set(d.tiles);
    let arch = c.gpu.arch;
    let world = c.world_size();
    let cluster_size = cm.cluster;
    let pipe = target.apk_shape(&ApkInput {
        tiles,
        cluster: cluster_size,
        hidden: m.hidden,
        inter: m.moe.expert_ffn,
        weights,
        smem_per_block: c.gpu.smem_per_block,
    })?;
    let m_t_p = tiles.prefill.gate_up.block_m;
    let m_t_d = tiles.decode.gate_up.block_m;
    let round = |v: u32| v.div_ceil(cluster_size) * cluster_size;
    // Whole clusters: decode may hold all but one of them (prefill keeps one
    // whenever the GPU has two).
    let clusters = c.gpu.sms / cluster_size;
    let q_max = moeforge_plan::cost::q_max(c.gpu.sms, cluster_size);
    let q = best.map_or(round(c.gpu.sms / 2), |b| round(b.q)).clamp(cluster_size, q_max);
    let decode_batch = best.map_or(NOMINAL_DECODE_PER_RANK * f64::from(world), |b| f64::from(b.decode_batch));
    let mut counts: Vec<u32> = held.iter().copied().filter(|&n| n > 0).collect();
    counts.sort_unstable();
    counts.dedup();
    let many = counts.len() > 1;
    // (local experts, intermediate, TP) per instance: EP's per distinct
    // count, and in a dual plan TP's over every expert's 1/P slice.
    let mut shapes: Vec<(u32, u32, bool)> = counts.into_iter().map(|n| (n, m.moe.expert_ffn, false)).collect();
    if let Some(p) = tp_world.filter(|&p| p > 0) {
        let inter = m.moe.expert_ffn / p;
        let ok = target
            .apk_shape(&ApkInput {
                tiles,
                cluster: cluster_size,
                hidden: m.hidden,
                inter,
                weights,
                smem_per_block: c.gpu.smem_per_block,
            })
            .is_ok();
        if ok {
            shapes.push((m.moe.experts, inter, true));
        }
    }
    Ok(shapes
        .into_iter()
        .map(|(local, inter, tp)| {
            let routed_rows = MAX_BATCH_TOKENS as u32 * m.moe.top_k + local * (m_t_p - 1);
            let x_star = expected_x_moe(
                decode_batch * f64::from(m.moe.top_k),
                f64::from(m.moe.experts),
                f64::from(local),
                f64::from(m_t_d),
            );
            let params = ApkParams {
                form: if tp { ApkForm::ExpertsTp } else { ApkForm::Experts },
                hidden: m.hidden,
                inter,
                local_experts: local,
                top_k: m.moe.top_k,
                m_t_prefill: m_t_p,
                m_t_decode: m_t_d,
                n_t_gate_up: tiles.prefill.gate_up.block_n,
                n_t_down: tiles.prefill.down.block_n,
                cluster_size,
                max_clusters: clusters,
                max_prefill_rows: routed_rows.div_ceil(m_t_p) * m_t_p,
                // TP posts every op to the contiguous phase: the masked
                // decode layout holds nothing (one tile per expert).
                max_decode_rows: if tp { m_t_d } else { DECODE_TOKENS_PER_RANK * world },
                q,
                q_max,
                x_star: (x_star * 1000.0).round() / 1000.0,
                weights,
                scale_block: if fp8 { FP8_SCALE_BLOCK } else { 0 },
                activation: m.moe.activation,
                path: target.mma_path(),
                pipeline: pipe,
                ranks: if tp {
                    (0..held.len() as u32).collect()
                } else {
                    (0..held.len() as u32).filter(|&r| held[r as usize] == local).collect()
                },
            };
            let p = |s: &str| s.to_string();
            let fp8_note = if fp8 {
                " (fp8 e4m3 weights with 128×128 block scales, dequantized to bf16 in shared memory)"
            } else {
                ""
            };
            let act = match m.moe.activation {
                moeforge_dsl::spec::Activation::Silu => "SiLU·mul",
                moeforge_dsl::spec::Activation::SwigluOai => "clamped SwiGLU",
            };
            let act = if m.moe.bias { format!("{act}, with biases") } else { act.to_string() };
            // TP's MoE op runs alone on the rank's one stream: launched per
            // operation, it holds the GPU only while it runs.
            let (name, purpose, grid) = if tp {
                (
                    "apk_tp".to_string(),
                    format!(
                        "TP's grouped GEMMs (GateUp → {act} → Down) of every expert's 1/{} of the intermediate ({inter} columns){fp8_note}, launched per MoE operation and posted to its contiguous phase in both steps (TP's permutation writes the contiguous layout)",
                        m.moe.expert_ffn / inter.max(1)
                    ),
                    Grid::PerOperation { cluster: cluster_size },
                )
            } else {
                (
                    if many { format!("apk_e{local}") } else { "apk".into() },
                    format!(
                        "persistent grouped GEMMs (GateUp → {act} → Down) of {local} local experts{fp8_note} for prefill and decode, tile-level preemption, decode q = {q} SMs"
                    ),
                    Grid::Persistent { cluster: cluster_size },
                )
            };
            KernelInstance {
                name,
                purpose,
                arch,
                params: KernelParams::Apk(params),
                entries: vec![EntryPoint {
                    symbol: "moe_apk".into(),
                    grid,
                    block: pipe.threads,
                    dynamic_smem: pipe.smem_bytes,
                    params: vec![p("const __grid_constant__ apk::Templates templates"), p("apk::State* state")],
                }],
            }
        })
        .collect())
}

/// The dense APK: the experts' tiles, pipeline and scheduler as a one-group
/// GEMM that every dense projection of the program launches per operation
/// (shapes and epilogue posted with it). One instance per weight format the
/// projections use: `dense` for bf16 weights (every model's LM head and
/// router), `dense_fp8` for fp8 e4m3 weights with 128×128 block scales
/// (W8A16, as the fp8 experts: the transform warps dequantize each stage).
/// Its tiles are the tile set's `dense` sub-block when it has one (a tile
/// the target cannot use is a located error), else the routed experts'
/// instance's tile heights, widths, stages and cluster shape.
fn dense(
    cx: &Ctx<'_>,
    ranks: &[RankPlan],
    experts: Option<&KernelInstance>,
    weights: WeightFormat,
) -> Result<Option<KernelInstance>, PassError> {
    let m = cx.model;
    let Some(experts) = experts else { return Ok(None) };
    let KernelParams::Apk(e) = &experts.params else {
        return Ok(None);
    };
    let fp8 = weights == WeightFormat::Fp8E4m3;
    let own = cx.tiles.dense_tiles();
    let tiles = own.as_ref().unwrap_or(cx.tiles);
    let cluster = own.as_ref().map_or(e.cluster_size, |t| moeforge_plan::cost::cta_cluster(cx.cluster, t));
    let sms = cx.cluster.gpu.sms;
    let dense_error = |field: &str, message: String| {
        PassError::new(
            Code::Unsupported,
            At::Tiles(moeforge_dsl::spec::Tiles::dense_field(field)),
            format!(
                "the dense tiles of tile set `{}` do not fit {}'s dense APK: {message}",
                cx.tiles.name,
                cx.target.arch().name()
            ),
        )
        .label("not generated for this target")
        .help("the dense sub-block follows the experts' tile rules (see `prefill.gate_up` in models/tiles.moe)")
    };
    if own.is_some() && cluster > sms {
        return Err(dense_error("prefill.gate_up.cluster", format!("{cluster} CTAs per cluster on {sms} SMs")));
    }
    // The format's pipeline (bf16's has no transform warps); with the
    // experts' tiles its rules passed for the experts already.
    let shape = target::of(experts.arch).apk_shape(&ApkInput {
        tiles,
        cluster,
        hidden: m.hidden,
        inter: m.moe.expert_ffn,
        weights,
        smem_per_block: cx.cluster.gpu.smem_per_block,
    });
    let pipeline = match shape {
        Ok(p) => p,
        Err(err) if own.is_some() && !err.model => return Err(dense_error(&err.field, err.message)),
        Err(_) => return Ok(None),
    };
    let (m_t_prefill, m_t_decode) = (tiles.prefill.gate_up.block_m, tiles.decode.gate_up.block_m);
    let rows = |m_t: u32| (MAX_BATCH_TOKENS as u32).div_ceil(m_t) * m_t;
    // Launched per operation: no decode budget under contention applies.
    let q = moeforge_plan::cost::q_max(sms, cluster);
    let params = ApkParams {
        form: ApkForm::Dense,
        hidden: 0,
        inter: 0,
        local_experts: 1,
        top_k: 1,
        m_t_prefill,
        m_t_decode,
        n_t_gate_up: tiles.prefill.gate_up.block_n,
        n_t_down: tiles.prefill.down.block_n,
        cluster_size: cluster,
        max_clusters: sms / cluster,
        max_prefill_rows: rows(m_t_prefill),
        max_decode_rows: rows(m_t_decode),
        q: if own.is_some() { q } else { e.q },
        q_max: if own.is_some() { q } else { e.q_max },
        weights,
        scale_block: if fp8 { FP8_SCALE_BLOCK } else { 0 },
        // Dense and shared-expert FFNs are SwiGLU's (no model here clamps them).
        activation: moeforge_dsl::spec::Activation::Silu,
        pipeline,
        ranks: ranks.iter().map(|r| r.rank).collect(),
        ..e.clone()
    };
    let (name, symbol, what) = if fp8 {
        (
            "dense_fp8",
            "apk_dense_fp8",
            "fp8 e4m3 weights with 128×128 block scales, W8A16 (projections, dense and shared-expert FFNs)",
        )
    } else {
        ("dense", "apk_dense", "bf16 weights (projections, router, LM head, dense and shared-expert FFNs)")
    };
    let Some(first) = experts.entries.first() else { return Ok(None) };
    let entry = EntryPoint {
        symbol: symbol.into(),
        grid: Grid::PerOperation { cluster: params.cluster_size },
        block: pipeline.threads,
        dynamic_smem: pipeline.smem_bytes,
        params: first.params.clone(),
    };
    let whose = if own.is_some() { "the tile set's dense tiles" } else { "the routed experts' tiles" };
    Ok(Some(KernelInstance {
        name: name.into(),
        purpose: format!("one-group GEMMs of the dense layers' {what} on {whose}, launched per operation"),
        arch: experts.arch,
        params: KernelParams::Apk(params),
        entries: vec![entry],
    }))
}

/// The layer kernels (embedding, norms, QK-norm, RoPE, KV write, residual
/// add, sampling) with the model's constants.
fn layer(cx: &Ctx<'_>, mem: &moeforge_plan::memory::MemoryPlan) -> KernelInstance {
    use moeforge_dsl::spec::{Attention, QkNormScope};
    use moeforge_plan::memory::BufferName;
    let m = cx.model;
    let gqa = match m.attention {
        Attention::Gqa { heads, kv_heads, head_dim, qk_norm, qk_norm_scope, rope_dim, .. } => {
            let inv_freq = rope_inv_freq(m, rope_dim);
            let qkv_stride =
                mem.buffers.iter().find(|b| b.name == BufferName::Qkv).map_or(0, |b| (b.row_bytes / 2) as u32);
            Some(GqaLayerParams {
                head_dim,
                rope_dim,
                heads,
                kv_heads,
                qkv_stride,
                qk_norm: match (qk_norm, qk_norm_scope) {
                    (false, _) => QkNormKind::None,
                    (true, QkNormScope::PerHead) => QkNormKind::PerHead,
                    (true, QkNormScope::PerLayer) => QkNormKind::AllHeads,
                },
                inv_freq,
                rope_scale: m.rope_scaling.as_ref().map_or(1.0, |y| y.attention_factor()),
                page_tokens: mem.kv.page_tokens,
                head_token_bytes: mem.kv.head_token_bytes,
                layer_window: m.sliding_window.as_ref().map_or(vec![], |w| {
                    let n = w.pattern.len().max(1);
                    let slides = |l: usize| w.pattern.get(l % n) == Some(&moeforge_dsl::spec::LayerAttn::Sliding);
                    (0..m.layers as usize).map(|l| if slides(l) { w.size } else { 0 }).collect()
                }),
                // The spec's tiles (checked against the heads), else the target's.
                flash: Some(cx.tiles.attention.unwrap_or_else(|| target::of(cx.cluster.gpu.arch).attention_tiles()))
                    .filter(|a| {
                        head_dim % 16 == 0
                            && head_dim <= 128
                            && a.smem_bytes(head_dim) <= moeforge_dsl::check::ATTENTION_STATIC_SMEM
                    }),
            })
        }
        Attention::Mla { .. } => None,
    };
    let meta_words =
        mem.buffers.iter().find(|b| b.name == BufferName::RequestMeta).map_or(0, |b| (b.row_bytes / 4) as u32);
    let mla = match (m.attention, moeforge_plan::memory::MlaRow::of(m)) {
        (Attention::Mla { heads, q_lora, kv_lora, qk_nope, qk_rope, v_head, indexer }, Some(row)) => {
            let inv_freq = rope_inv_freq(m, qk_rope);
            let factor = m.rope_scaling.as_ref().map_or(1.0, |y| y.mla_softmax_factor());
            Some(MlaLayerParams {
                heads,
                q_lora: q_lora.unwrap_or(0),
                kv_lora,
                nope: qk_nope,
                rope: qk_rope,
                v_head,
                qkv_stride: mem
                    .buffers
                    .iter()
                    .find(|b| b.name == BufferName::Qkv)
                    .map_or(0, |b| (b.row_bytes / 2) as u32),
                q_offset: row.q,
                kv_offset: row.kv,
                inv_freq,
                rope_scale: m.rope_scaling.as_ref().map_or(1.0, |y| y.attention_factor()),
                softmax_scale: factor / f64::from(qk_nope + qk_rope).sqrt(),
                page_tokens: mem.kv.page_tokens,
                entry_bytes: mem.kv.head_token_bytes,
                kv_b_fp8: m.dtype.weights == moeforge_dsl::spec::DType::Fp8E4m3,
                indexer: indexer.map(|ix| moeforge_plan::IndexerLayerParams {
                    heads: ix.heads,
                    head_dim: ix.head_dim,
                    top_k: ix.top_k,
                    k_offset: row.ix_k,
                    q_offset: row.ix_q,
                    w_offset: row.ix_w,
                }),
            })
        }
        _ => None,
    };
    let p = |s: &str| s.to_string();
    let t = LAYER_THREADS;
    let entry = |symbol: &str, over: GridVar, params: Vec<String>| EntryPoint {
        symbol: symbol.into(),
        grid: Grid::Per { over, per: 1 },
        block: t,
        dynamic_smem: 0,
        params,
    };
    let mut entries = vec![
        entry(
            "embed_rows",
            GridVar::Tokens,
            vec![p("const int32_t* ids"), p("const __nv_bfloat16* table"), p("int tokens"), p("float* residual")],
        ),
        entry(
            "rms_norm",
            GridVar::Tokens,
            vec![
                p("const float* x"),
                p("const int32_t* rows"),
                p("const __nv_bfloat16* weight"),
                p("int n"),
                p("__nv_bfloat16* out"),
            ],
        ),
        entry(
            "add_rms_norm",
            GridVar::Tokens,
            vec![
                p("float* residual"),
                p("const float* delta"),
                p("const __nv_bfloat16* weight"),
                p("int n"),
                p("__nv_bfloat16* out"),
            ],
        ),
        entry(
            "residual_add",
            GridVar::Tokens,
            vec![p("float* residual"), p("const float* moe"), p("const __nv_bfloat16* shared"), p("int n")],
        ),
        entry(
            "sample_tokens",
            GridVar::SampledRows,
            vec![
                p("const float* logits"),
                p("int rows"),
                p("const int32_t* sample_rows"),
                p("const int32_t* row_request"),
                p("int32_t* request_meta"),
                p("int32_t* out"),
            ],
        ),
        entry(
            "kv_migrate",
            GridVar::KvMoves,
            vec![
                p("const int32_t* moves"),
                p("int rows"),
                p("const uint8_t* src_pool"),
                p("long long src_page_bytes"),
                p("int src_heads"),
                p("int src_head0"),
                p("uint8_t* dst_pool"),
                p("long long dst_page_bytes"),
                p("int dst_heads"),
                p("int dst_head0"),
                p("int heads"),
                p("int layers"),
            ],
        ),
    ];
    if let Some(g) = &gqa {
        if g.qk_norm != QkNormKind::None {
            entries.push(entry(
                "qk_sumsq",
                GridVar::Tokens,
                vec![
                    p("const __nv_bfloat16* qkv"),
                    p("int tokens"),
                    p("int q_heads"),
                    p("int kv_heads"),
                    p("float k_share"),
                    p("float* sumsq"),
                ],
            ));
            entries.push(entry(
                "qk_norm",
                GridVar::Tokens,
                vec![
                    p("__nv_bfloat16* qkv"),
                    p("const __nv_bfloat16* q_weight"),
                    p("const __nv_bfloat16* k_weight"),
                    p("int tokens"),
                    p("int q_heads"),
                    p("int kv_heads"),
                    p("int q_head0"),
                    p("int kv_head0"),
                    p("const float* sumsq"),
                ],
            ));
        }
        entries.push(entry(
            "rope",
            GridVar::Tokens,
            vec![
                p("__nv_bfloat16* qkv"),
                p("const int32_t* positions"),
                p("int tokens"),
                p("int q_heads"),
                p("int kv_heads"),
            ],
        ));
        let attention_params = vec![
            p("const __nv_bfloat16* qkv"),
            p("const int32_t* positions"),
            p("const int32_t* row_request"),
            p("const int32_t* request_meta"),
            p("int tokens"),
            p("int q_heads"),
            p("int kv_heads"),
            p("int q_head0"),
            p("int kv_head0"),
            p("const uint8_t* pool"),
            p("long long page_bytes"),
            p("int layer"),
            p("const __nv_bfloat16* sinks"),
            p("__nv_bfloat16* attn"),
        ];
        entries.push(entry("paged_attention", GridVar::Tokens, attention_params.clone()));
        if let Some(a) = g.flash {
            // One block per tile of block_q rows and local q head (the op's
            // grid names the heads); 16 rows per warp.
            entries.push(EntryPoint {
                symbol: "flash_prefill".into(),
                grid: Grid::Tiles { over: GridVar::Tokens, per: a.block_q, times: g.heads },
                block: 32 * a.block_q / 16,
                dynamic_smem: 0,
                params: attention_params,
            });
        }
        entries.push(entry(
            "kv_write",
            GridVar::Tokens,
            vec![
                p("const __nv_bfloat16* qkv"),
                p("const int32_t* slot_map"),
                p("int tokens"),
                p("int q_heads"),
                p("int kv_heads"),
                p("uint8_t* pool"),
                p("long long page_bytes"),
                p("int layer"),
            ],
        ));
    }
    // The absorbed attention's kv_b: bf16, or fp8 codes with their block scales.
    let kv_b = if mla.as_ref().is_some_and(|a| a.kv_b_fp8) {
        vec![p("const uint8_t* kv_b"), p("const float* kv_b_scale")]
    } else {
        vec![p("const __nv_bfloat16* kv_b")]
    };
    if mla.is_some() {
        entries.push(entry(
            "latent_norm",
            GridVar::Tokens,
            vec![
                p("__nv_bfloat16* qkv"),
                p("int tokens"),
                p("int offset"),
                p("int width"),
                p("const __nv_bfloat16* weight"),
            ],
        ));
        entries.push(entry(
            "mla_rope",
            GridVar::Tokens,
            vec![p("__nv_bfloat16* qkv"), p("const int32_t* positions"), p("int tokens"), p("int q_heads")],
        ));
        entries.push(entry(
            "mla_kv_write",
            GridVar::Tokens,
            vec![
                p("const __nv_bfloat16* qkv"),
                p("const int32_t* slot_map"),
                p("int tokens"),
                p("uint8_t* pool"),
                p("long long page_bytes"),
                p("int layer"),
            ],
        ));
        entries.push(entry(
            "mla_attention",
            GridVar::Tokens,
            [
                vec![
                    p("const __nv_bfloat16* qkv"),
                    p("const int32_t* positions"),
                    p("const int32_t* row_request"),
                    p("const int32_t* request_meta"),
                    p("int tokens"),
                    p("int q_heads"),
                ],
                kv_b.clone(),
                vec![p("const uint8_t* pool"), p("long long page_bytes"), p("int layer"), p("__nv_bfloat16* attn")],
            ]
            .concat(),
        ));
    }
    if mla.as_ref().is_some_and(|a| a.indexer.is_some()) {
        entries.push(entry(
            "indexer_key_norm",
            GridVar::Tokens,
            vec![p("__nv_bfloat16* qkv"), p("int tokens"), p("const __nv_bfloat16* weight_bias")],
        ));
        entries.push(entry(
            "dsa_indexer",
            GridVar::Tokens,
            vec![
                p("const __nv_bfloat16* qkv"),
                p("const int32_t* positions"),
                p("const int32_t* row_request"),
                p("const int32_t* request_meta"),
                p("int tokens"),
                p("const uint8_t* pool"),
                p("long long page_bytes"),
                p("int layer"),
                p("int32_t* topk"),
            ],
        ));
        entries.push(entry(
            "mla_sparse_attention",
            GridVar::Tokens,
            [
                vec![
                    p("const __nv_bfloat16* qkv"),
                    p("const int32_t* row_request"),
                    p("const int32_t* request_meta"),
                    p("int tokens"),
                    p("int q_heads"),
                ],
                kv_b.clone(),
                vec![
                    p("const uint8_t* pool"),
                    p("long long page_bytes"),
                    p("int layer"),
                    p("const int32_t* topk"),
                    p("__nv_bfloat16* attn"),
                ],
            ]
            .concat(),
        ));
    }
    let purpose = match &gqa {
        Some(g) => format!(
            "embedding, RMSNorm, residual adds, sampling, {}RoPE over {} of {} dims, the paged KV write, paged causal attention{}",
            match g.qk_norm {
                QkNormKind::None => "",
                QkNormKind::PerHead => "per-head QK-norm, ",
                QkNormKind::AllHeads => "all-head QK-norm, ",
            },
            g.rope_dim,
            g.head_dim,
            match g.flash {
                Some(a) => format!(
                    " and flash-attention prefill on mma.sync ({} rows × {} keys per step)",
                    a.block_q, a.block_kv
                ),
                None => String::new(),
            }
        ),
        None => format!(
            "embedding, RMSNorm, residual adds, sampling, and MLA's latent norms, interleaved RoPE, latent KV write and weight-absorbed attention{}",
            if mla.as_ref().is_some_and(|a| a.indexer.is_some()) {
                "; DSA's indexer key norm, lightning indexer (top-k in shared memory) and sparse attention"
            } else {
                ""
            }
        ),
    };
    KernelInstance {
        name: "layer".into(),
        purpose,
        arch: cx.cluster.gpu.arch,
        params: KernelParams::Layer(LayerParams {
            hidden: m.hidden,
            vocab: m.vocab,
            rms_eps: m.rms_eps,
            threads: t,
            request_meta_words: meta_words,
            gqa,
            mla,
        }),
        entries,
    }
}

/// RoPE's inverse frequency per rotary pair over `dim` dims: `θ^(-2i/dim)`,
/// YaRN-blended when the model scales (the dsl's `RopeScaling::inv_freq`).
fn rope_inv_freq(m: &moeforge_dsl::spec::Model, dim: u32) -> Vec<f64> {
    match &m.rope_scaling {
        Some(y) => y.inv_freq(dim, m.rope_theta),
        None => (0..dim / 2).map(|i| 1.0 / m.rope_theta.powf(2.0 * f64::from(i) / f64::from(dim))).collect(),
    }
}
