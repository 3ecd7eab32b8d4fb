//! Kernel instance pass: which kernels this deployment needs and their
//! specialization constants.
//!
//! v1 emits the routing path every MoE layer runs before and after the
//! grouped GEMMs: the router (the model's scoring and top-k rule) and the
//! token permutation into the prefill phase's expert-contiguous layout, with
//! its inverse for combine. The grouped GEMMs themselves (the Adaptive
//! Persistent Kernel) are not emitted by this version.

use crate::plan::{EntryPoint, KernelInstance, KernelParams, PermuteParams, RouterParams};
use moeforge_dsl::spec::{Deploy, Routing, Spec};

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
        Routing::SoftmaxTopk { norm_topk } => ("softmax", norm_topk, 1.0, false, 1, 1),
        Routing::SigmoidGrouped { groups, top_groups, scaling, norm_topk, bias } => {
            ("sigmoid", norm_topk, scaling, bias, groups, top_groups)
        }
    };
    let router = RouterParams {
        experts: m.moe.experts,
        top_k: m.moe.top_k,
        scoring: scoring.to_string(),
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
                scoring,
                m.moe.top_k,
                m.moe.experts,
                if groups > 1 { format!(" in {groups} groups (keep {top_groups})") } else { String::new() }
            ),
            arch,
            params: KernelParams::Router(router),
            entries: vec![EntryPoint {
                symbol: "moe_router".into(),
                grid: format!("ceil(tokens / {ROUTER_WARPS})"),
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
                    grid: "num_local".into(),
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
                    grid: "1".into(),
                    block: 32,
                    dynamic_smem: 0,
                    params: vec![p("const int32_t* counts"), p("int num_local"), p("int32_t* offsets")],
                },
                EntryPoint {
                    symbol: "moe_scatter".into(),
                    grid: "num_local".into(),
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
                    grid: "rows".into(),
                    block: PERMUTE_THREADS.min(m.hidden / 8),
                    dynamic_smem: 0,
                    params: vec![p("const uint4* x"), p("const int32_t* row_entry"), p("int rows"), p("uint4* x_perm")],
                },
                EntryPoint {
                    symbol: "moe_combine".into(),
                    grid: "tokens".into(),
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
