//! Kernel instance pass: which kernels this deployment needs and their
//! specialization constants.
//!
//! The routing path every MoE layer runs before and after the grouped GEMMs:
//! the router (the model's scoring and top-k rule) and the token permutation
//! into the prefill phase's expert-contiguous layout, with its inverse for
//! combine. Then [`apk`]: the Adaptive Persistent Kernel per distinct MoE
//! rank shape, which runs the grouped GEMMs of both phases.

use moeforge_dsl::spec::{Arch, DType, Deploy, Routing, Spec, Tiles};
use moeforge_plan::cost::expected_x_moe;
use moeforge_plan::cost::CostModel;
use moeforge_plan::memory::MAX_BATCH_TOKENS;
use moeforge_plan::search::SearchResult;
use moeforge_plan::{
    ApkParams, EntryPoint, Grid, GridVar, KernelInstance, KernelParams, MmaPath, PermuteParams, RankPlan, RouterParams,
    Scoring, WeightFormat,
};

const ROUTER_WARPS: u32 = 4;
/// 8 blocks of 128 threads per SM leaves 64 registers per thread, enough for
/// 12 scores per lane (384 experts) without spilling.
const ROUTER_MIN_BLOCKS: u32 = 8;
const PERMUTE_THREADS: u32 = 256;

pub fn run(spec: &Spec, d: &Deploy, max_local: u32) -> Vec<KernelInstance> {
    let m = spec.model(d.model);
    let arch = spec.cluster(d.cluster).gpu.arch;
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
                    params: vec![p("const int32_t* counts"), p("int num_local"), p("int32_t* offsets")],
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
                    grid: Grid::Per { over: GridVar::Rows, per: 1 },
                    block: PERMUTE_THREADS.min(m.hidden / 8),
                    dynamic_smem: 0,
                    params: vec![p("const uint4* x"), p("const int32_t* row_entry"), p("int rows"), p("uint4* x_perm")],
                },
                EntryPoint {
                    symbol: "moe_combine".into(),
                    grid: Grid::Per { over: GridVar::Tokens, per: 1 },
                    block: PERMUTE_THREADS.min(m.hidden / 8),
                    dynamic_smem: 0,
                    params: vec![
                        p("const uint4* y_perm"),
                        p("const int32_t* entry_row"),
                        p("const float* topk_weights"),
                        p("int tokens"),
                        p("uint4* out"),
                    ],
                },
            ],
        },
    ]
}

/// Decode tokens one rank dispatches per step (DeepEP low-latency's default
/// `num_max_dispatch_tokens_per_rank`): the masked layout holds this many
/// rows per expert from every rank.
pub const DECODE_TOKENS_PER_RANK: u32 = 128;
/// Decode requests per rank the x*_moe footprint assumes without a layout search.
const NOMINAL_DECODE_PER_RANK: f64 = 64.0;
/// `setmaxnreg` budgets on sm_90a: the producer warpgroup (which also runs
/// the scheduler, hence more than a bare TMA warp) gives registers to the two
/// math warpgroups. The launch holds 384 × 168 registers (`__launch_bounds__`
/// with one CTA per SM), and 128·72 + 256·216 = 384·168 exactly, so the
/// increase never waits for registers.
const PRODUCER_REGS: u32 = 72;
const CONSUMER_REGS: u32 = 216;
/// mma.sync math warps per CTA on the portable path.
const PORTABLE_WARPS: u32 = 4;
/// Reduction depth of one wgmma pipeline stage: one 128-byte swizzled bf16 row.
const WGMMA_STAGE_K: u32 = 64;
/// fp8 experts' block-scale size (DeepSeek-V3's `weight_scale_inv` blocks).
const FP8_SCALE_BLOCK: u32 = 128;

/// The APK's pipeline shape on this GPU, from the prefill tiles (one
/// shared-memory ring and one CTA shape serve every GEMM of both phases), or
/// why the tile set does not fit the generated kernel.
struct Pipeline {
    path: MmaPath,
    block_k: u32,
    stages: u32,
    units: u32,
    unit_threads: u32,
    threads: u32,
    smem_bytes: u32,
}

fn pipeline(
    arch: Arch,
    tiles: &Tiles,
    cluster_size: u32,
    hidden: u32,
    inter: u32,
    fp8: bool,
    smem_per_block: u64,
) -> Result<Pipeline, String> {
    let (pf, dc) = (&tiles.prefill, &tiles.decode);
    let all = [
        ("prefill.gate_up", &pf.gate_up),
        ("prefill.down", &pf.down),
        ("decode.gate_up", &dc.gate_up),
        ("decode.down", &dc.down),
    ];
    let block_k = pf.gate_up.block_k;
    if let Some((name, t)) = all.iter().find(|(_, t)| t.block_k != block_k) {
        return Err(format!("`{name}.block_k` = {} differs from `prefill.gate_up.block_k` = {block_k}: the APK's stage ring has one depth", t.block_k));
    }
    for (name, v) in [("hidden", hidden), ("expert_ffn", inter)] {
        if v % 8 != 0 {
            return Err(format!("the model's {name} = {v} is not a multiple of 8 (16-byte rows for TMA and cp.async)"));
        }
    }
    let (mt_p, mt_d) = (pf.gate_up.block_m, dc.gate_up.block_m);
    if pf.down.block_m != mt_p || dc.down.block_m != mt_d {
        return Err("each phase's gate_up and down tiles must have the same block_m (the Down tile reads the GateUp tile's rows)".into());
    }
    let (n_gu, n_d) = (pf.gate_up.block_n, pf.down.block_n);
    let mt_max = mt_p.max(mt_d);
    let n_max = n_gu.max(n_d);
    let (path, units, unit_threads, producer_threads, row_elems) = match arch {
        Arch::Sm90a => {
            if block_k % WGMMA_STAGE_K != 0 {
                return Err(format!(
                    "block_k = {block_k}: the wgmma path stages 128-byte swizzled rows of {WGMMA_STAGE_K} bf16, block_k must be a multiple of {WGMMA_STAGE_K}"
                ));
            }
            if fp8 && hidden % 16 != 0 {
                return Err(format!("hidden = {hidden}: fp8 weight rows must be a multiple of 16 bytes for TMA"));
            }
            if fp8 && inter % FP8_SCALE_BLOCK != 0 {
                return Err(format!("expert_ffn = {inter}: fp8 gate and up weights are one [2·expert_ffn] matrix whose {FP8_SCALE_BLOCK}-row scale blocks must not straddle them"));
            }
            if fp8 && (FP8_SCALE_BLOCK % (n_gu / 2) != 0 || FP8_SCALE_BLOCK % n_d != 0) {
                return Err(format!("block_n = {n_gu} (gate_up) / {n_d} (down): with fp8 weights a tile's columns (half of gate_up's) must lie in one {FP8_SCALE_BLOCK}-row scale block"));
            }
            for (what, m) in [("prefill", mt_p), ("decode", mt_d)] {
                if m != 64 && m != 128 {
                    return Err(format!(
                        "{what} block_m = {m}: the wgmma path runs one or two 64-row warpgroups, block_m = 64 or 128"
                    ));
                }
                if (m / cluster_size) % 8 != 0 {
                    return Err(format!("{what} block_m = {m} split over a {cluster_size}-CTA cluster is not a multiple of 8 rows per multicast slice"));
                }
            }
            if n_gu % 16 != 0 || n_gu > 256 || n_d % 8 != 0 || n_d > 256 {
                return Err(format!("block_n = {n_gu} (gate_up) / {n_d} (down): wgmma needs gate_up a multiple of 16 and down of 8, both at most 256"));
            }
            (MmaPath::Wgmma, mt_max / 64, 128, 128, WGMMA_STAGE_K)
        }
        Arch::Sm80 => {
            if block_k % 16 != 0 {
                return Err(format!("block_k = {block_k} is not a multiple of 16 (mma.sync k16)"));
            }
            if mt_p % 16 != 0 || mt_d % 16 != 0 {
                return Err(format!("block_m = {mt_p}/{mt_d}: mma.sync needs multiples of 16"));
            }
            if n_gu % (16 * PORTABLE_WARPS) != 0 || n_d % (8 * PORTABLE_WARPS) != 0 {
                return Err(format!("block_n = {n_gu} (gate_up) / {n_d} (down): {PORTABLE_WARPS} math warps need gate_up a multiple of {} and down of {}", 16 * PORTABLE_WARPS, 8 * PORTABLE_WARPS));
            }
            if fp8 {
                return Err("fp8 weights need sm_90a (the portable path computes bf16 experts)".into());
            }
            // Rows padded by 8 elements: conflict-free ldmatrix without swizzling.
            (MmaPath::MmaSync, PORTABLE_WARPS, 32, 32, block_k + 8)
        }
    };
    // The APK's stage depth: 64 on the wgmma path (a deeper tile block is
    // several stages), the tile's block_k on the portable path.
    let stage_k = if arch == Arch::Sm90a { WGMMA_STAGE_K } else { block_k };
    // Per stage: the activation and (bf16) weight tiles, plus the raw fp8
    // weight tile the transform warps dequantize from.
    let stage_bytes = u64::from((mt_max + n_max) * row_elems) * 2 + if fp8 { u64::from(n_max * stage_k) } else { 0 };
    // Barriers: full/empty (and converted) per stage, 2 × (handoff full/empty,
    // broadcast, tile done); 4 decision slots; 1 KiB to align the ring.
    let smem_for = |stages: u64| {
        let barriers = 8 * ((if fp8 { 3 } else { 2 }) * stages + 8) + 16 * 4;
        (stages * stage_bytes + barriers).div_ceil(1024) * 1024 + 1024
    };
    let wanted = u64::from(pf.gate_up.stages * (block_k / stage_k));
    let stages = (1..=wanted).rev().find(|&n| smem_for(n) <= smem_per_block).unwrap_or(0);
    if stages < 2 {
        return Err(format!("the APK's ring of {mt_max}×{stage_k} + {n_max}×{stage_k} tiles needs {} bytes of shared memory for two stages; the GPU allows {smem_per_block}", smem_for(2)));
    }
    let smem = smem_for(stages);
    let stages = stages as u32;
    Ok(Pipeline {
        path,
        block_k: stage_k,
        stages,
        units,
        unit_threads,
        threads: producer_threads + units * unit_threads,
        smem_bytes: smem as u32,
    })
}

/// Why a model's experts get no APK, for the report: the APK computes bf16
/// experts, and fp8 e4m3 experts with 128×128 block scales on sm_90a
/// (dequantized to bf16 in shared memory).
pub fn apk_missing(experts: DType, block_scale: Option<[u32; 2]>, arch: Arch) -> Option<String> {
    let why = match experts {
        DType::Bf16 => return None,
        DType::Fp8E4m3 if arch != Arch::Sm90a => "fp8 experts are generated for sm_90a only".to_string(),
        DType::Fp8E4m3 if block_scale != Some([FP8_SCALE_BLOCK; 2]) => {
            format!("fp8 experts need {FP8_SCALE_BLOCK}×{FP8_SCALE_BLOCK} block scales, this model declares {block_scale:?}")
        }
        DType::Fp8E4m3 => return None,
        other => format!("{} experts are not generated", other.name()),
    };
    Some(format!("No Adaptive Persistent Kernel: {why}."))
}

/// One APK per distinct local expert count (ranks with the same count share
/// a kernel; a rank's first expert is a run-time offset of its weights).
/// Decode's SM budget q and x*_moe come from the layout search's best
/// candidate when there is one: q as searched, x*_moe the expected decode
/// footprint of its decode batch on these ranks; otherwise q is half the
/// SMs and x*_moe that of 64 requests per rank.
pub fn apk(
    spec: &Spec,
    d: &Deploy,
    ranks: &[RankPlan],
    cm: &CostModel,
    search: Option<&SearchResult>,
) -> Result<Vec<KernelInstance>, String> {
    let m = spec.model(d.model);
    let c = spec.cluster(d.cluster);
    if apk_missing(m.dtype.experts, m.dtype.block_scale, c.gpu.arch).is_some() {
        return Ok(Vec::new());
    }
    let fp8 = m.dtype.experts == DType::Fp8E4m3;
    let tiles = spec.tile_set(d.tiles);
    let arch = c.gpu.arch;
    let world = c.world_size();
    let cluster_size = cm.cluster;
    let pipe = pipeline(arch, tiles, cluster_size, m.hidden, m.moe.expert_ffn, fp8, c.gpu.smem_per_block)?;
    // The split is sized for one producer and two math warpgroups (384 threads at 168 registers).
    let (producer_regs, consumer_regs) =
        if arch == Arch::Sm90a && pipe.units == 2 { (PRODUCER_REGS, CONSUMER_REGS) } else { (0, 0) };
    let m_t_p = tiles.prefill.gate_up.block_m;
    let m_t_d = tiles.decode.gate_up.block_m;
    let round = |v: u32| v.div_ceil(cluster_size) * cluster_size;
    let best = search.and_then(|s| s.ranked.first());
    let q = best.map_or(round(c.gpu.sms / 2), |b| round(b.q)).clamp(cluster_size, c.gpu.sms);
    let decode_batch = best.map_or(NOMINAL_DECODE_PER_RANK * f64::from(world), |b| f64::from(b.decode_batch));
    let mut counts: Vec<u32> = ranks.iter().map(|r| r.experts[1] - r.experts[0]).filter(|&n| n > 0).collect();
    counts.sort_unstable();
    counts.dedup();
    let many = counts.len() > 1;
    Ok(counts
        .into_iter()
        .map(|local| {
            let routed_rows = MAX_BATCH_TOKENS as u32 * m.moe.top_k + local * (m_t_p - 1);
            let x_star = expected_x_moe(
                decode_batch * f64::from(m.moe.top_k),
                f64::from(m.moe.experts),
                f64::from(local),
                f64::from(m_t_d),
            );
            let params = ApkParams {
                hidden: m.hidden,
                inter: m.moe.expert_ffn,
                local_experts: local,
                top_k: m.moe.top_k,
                m_t_prefill: m_t_p,
                m_t_decode: m_t_d,
                n_t_gate_up: tiles.prefill.gate_up.block_n,
                n_t_down: tiles.prefill.down.block_n,
                cluster_size,
                max_clusters: c.gpu.sms / cluster_size,
                max_prefill_rows: routed_rows.div_ceil(m_t_p) * m_t_p,
                max_decode_rows: DECODE_TOKENS_PER_RANK * world,
                q,
                q_max: c.gpu.sms - cluster_size,
                x_star: (x_star * 1000.0).round() / 1000.0,
                weights: if fp8 { WeightFormat::Fp8E4m3 } else { WeightFormat::Bf16 },
                scale_block: if fp8 { FP8_SCALE_BLOCK } else { 0 },
                activation: m.moe.activation,
                path: pipe.path,
                block_k: pipe.block_k,
                stages: pipe.stages,
                units: pipe.units,
                unit_threads: pipe.unit_threads,
                threads: pipe.threads,
                producer_regs,
                consumer_regs,
                smem_bytes: pipe.smem_bytes,
                ranks: ranks.iter().filter(|r| r.experts[1] - r.experts[0] == local).map(|r| r.rank).collect(),
            };
            let p = |s: &str| s.to_string();
            KernelInstance {
                name: if many { format!("apk_e{local}") } else { "apk".into() },
                purpose: format!(
                    "persistent grouped GEMMs (GateUp → SiLU·mul → Down) of {local} local experts{} for prefill and decode, tile-level preemption, decode q = {q} SMs",
                    if fp8 { " (fp8 e4m3 weights with 128×128 block scales, dequantized to bf16 in shared memory)" } else { "" }
                ),
                arch,
                params: KernelParams::Apk(params),
                entries: vec![EntryPoint {
                    symbol: "moe_apk".into(),
                    grid: Grid::Persistent { cluster: cluster_size },
                    block: pipe.threads,
                    dynamic_smem: pipe.smem_bytes,
                    params: vec![p("const __grid_constant__ apk::Templates templates"), p("apk::State* state")],
                }],
            }
        })
        .collect())
}
