//! The plan: everything moeforge decided about one deployment.
//!
//! A [`Plan`] is built by the passes in `passes/` from a checked
//! [`moeforge_dsl::Spec`], checked by `validate.rs`, and only then emitted.
//! It is serialized as `plan.json` in the bundle and is the runtime's input:
//! nothing in it is implicit, every size is in bytes, every time in seconds.
//!
//! It holds the layout (data-parallel attention, expert parallelism over the
//! GPUs with experts striped contiguously), the memory plan (one unified
//! buffer per rank with TP and EP views and the reshard descriptors between
//! them), and the kernel instances with their specialization constants.

use moeforge_dsl::spec::{Arch, DType, Strategy};
use serde::{Deserialize, Serialize};

/// Bumped whenever `plan.json` or the bundle layout changes incompatibly.
pub const FORMAT_VERSION: u32 = 2;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub format_version: u32,
    pub deploy: String,
    /// SHA-256 of the deployment's canonical spec JSON (`spec.json` in the bundle).
    pub spec_hash: String,
    pub model: ModelFacts,
    pub cluster: ClusterFacts,
    pub layout: DeployLayout,
    pub ranks: Vec<RankPlan>,
    /// The unified buffer of every rank: regions, TP/EP views, reshard descriptors.
    pub memory: crate::memory::MemoryPlan,
    pub kernels: Vec<KernelInstance>,
    /// The latency model the search used (roofline defaults or a fitted profile).
    pub cost: crate::cost::CostModel,
    /// ExpertPlex Algorithm 1 over the cost model, for `expertplex` and `auto`
    /// strategies (advisory: the layout above is what the bundle implements).
    pub search: Option<crate::search::SearchResult>,
    /// Replicas per layer and GPU for `placement { policy = zepp | eplb }`
    /// (advisory: the memory plan holds one replica per expert).
    pub placement: Option<crate::placement::PlacementPlan>,
}

/// Derived model sizes the rest of the plan uses.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelFacts {
    pub name: String,
    pub layers: u32,
    pub moe_layers: u32,
    pub hidden: u32,
    pub experts: u32,
    pub top_k: u32,
    pub expert_ffn: u32,
    pub params_total: u64,
    pub params_active: u64,
    pub weight_bytes: u64,
    /// Bytes of one routed expert (gate, up, down) in its storage dtype.
    pub expert_bytes: u64,
    pub expert_dtype: DType,
    /// Block-scale shape of quantized weights, as the model declares it.
    #[serde(default)]
    pub block_scale: Option<[u32; 2]>,
    pub activation_dtype: DType,
    /// KV-cache bytes per token over all layers.
    pub kv_bytes_per_token: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterFacts {
    pub name: String,
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub world: u32,
    pub gpu: String,
    pub arch: Arch,
    pub sms: u32,
    pub hbm_bytes: u64,
    /// Scale-up (NVLink) bandwidth per GPU per direction, bytes/s.
    pub scale_up_bandwidth: f64,
}

/// How the deployment maps onto GPUs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeployLayout {
    /// The strategy the spec asked for.
    pub requested: Strategy,
    /// What this plan implements: in v1 always data-parallel attention with
    /// expert parallelism over every GPU (the colocated baseline).
    pub attention: String,
    pub moe: String,
    pub ep_size: u32,
    /// Most routed experts on any rank (ranks differ by at most one).
    pub max_experts_per_rank: u32,
    /// Why the plan differs from the request, when it does.
    pub note: Option<String>,
}

/// One GPU's share.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankPlan {
    pub rank: u32,
    pub node: u32,
    pub local_rank: u32,
    /// Global ids of the routed experts this rank holds, `[begin, end)`.
    pub experts: [u32; 2],
}

/// One emitted kernel source and how to launch its entry points.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelInstance {
    /// Stable name; the source is `kernels/<name>.cu`.
    pub name: String,
    pub purpose: String,
    pub arch: Arch,
    /// Specialization constants baked into the source.
    pub params: KernelParams,
    pub entries: Vec<EntryPoint>,
}

/// The compile-time constants of each kernel family. Templates print these
/// and nothing else; every decision is made in the kernels pass.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kernel", rename_all = "snake_case")]
pub enum KernelParams {
    Router(RouterParams),
    Permute(PermuteParams),
    Apk(ApkParams),
}

/// The Adaptive Persistent Kernel of the MoE ranks holding `local_experts`
/// experts (ExpertPlex §4): GateUp → SiLU·mul → Down for both phases.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ApkParams {
    pub hidden: u32,
    /// Expert intermediate size I.
    pub inter: u32,
    pub local_experts: u32,
    pub top_k: u32,
    /// Tile heights M_t of the prefill (contiguous) and decode (masked) layouts.
    pub m_t_prefill: u32,
    pub m_t_decode: u32,
    /// Output columns of one CTA tile: GateUp (half gate, half up) and Down.
    pub n_t_gate_up: u32,
    pub n_t_down: u32,
    /// CTAs per cluster (1 where the GPU has no clusters).
    pub cluster_size: u32,
    /// Clusters the grid may have: SMs / cluster size.
    pub max_clusters: u32,
    /// Contiguous prefill rows the buffers hold (padding included) and
    /// masked decode rows per expert.
    pub max_prefill_rows: u32,
    pub max_decode_rows: u32,
    /// Decode's SM budget under contention, its cap, and the footprint it was sized for.
    pub q: u32,
    pub q_max: u32,
    pub x_star: f64,
    /// Expert weight type: `bf16`, or `fp8_e4m3` with `scale_block`² block
    /// scales (dequantized to bf16 in shared memory by the producer
    /// warpgroup's other warps; activations and math stay bf16).
    pub weights: String,
    pub scale_block: u32,
    /// Tensor-core path: `wgmma` (sm_90a: TMA, warp specialization,
    /// multicast) or `mma_sync` (portable, sm_80: cp.async, ldmatrix).
    pub path: String,
    /// Reduction depth of one pipeline stage and the stage count (one
    /// shared-memory ring serves both phases' GEMMs).
    pub block_k: u32,
    pub stages: u32,
    /// Math units per CTA (warpgroups for wgmma, warps for mma.sync), their
    /// threads, and the CTA's threads: one producer (warp)group plus the units.
    pub units: u32,
    pub unit_threads: u32,
    pub threads: u32,
    /// `setmaxnreg` budgets of the producer and the math warpgroups (wgmma with two math warpgroups; 0: none).
    pub producer_regs: u32,
    pub consumer_regs: u32,
    /// Dynamic shared memory per CTA: the stage ring, barriers and decision
    /// slots, plus 1 KiB to align the ring for 128-byte swizzling.
    pub smem_bytes: u32,
    /// The MoE ranks that run this kernel.
    pub ranks: Vec<u32>,
}

/// Router: scores → top-k expert ids and weights, one warp per token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterParams {
    pub experts: u32,
    pub top_k: u32,
    /// `softmax` or `sigmoid`.
    pub scoring: String,
    pub norm_topk: bool,
    pub scaling: f64,
    /// Sigmoid routing adds a per-expert bias for selection only.
    pub selection_bias: bool,
    /// Expert groups (1 = no grouping) and how many groups survive.
    pub groups: u32,
    pub top_groups: u32,
    /// Experts per group (`experts / groups`).
    pub group_size: u32,
    /// Scores each lane holds: `ceil(experts / 32)`.
    pub per_lane: u32,
    pub warps_per_block: u32,
    /// `__launch_bounds__` occupancy hint: caps registers at 64K / (threads × this).
    pub min_blocks_per_sm: u32,
}

/// Token permutation into the expert-contiguous layout and its inverse.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PermuteParams {
    pub hidden: u32,
    pub top_k: u32,
    /// Most routed experts on one rank; a rank passes its own count and first
    /// expert at run time, and ids outside its range are skipped.
    pub max_local_experts: u32,
    /// Tile height M_t: each expert's rows are padded to a multiple of it.
    pub block_m: u32,
    /// 16-byte vectors per bf16 row (`hidden / 8`).
    pub row_vectors: u32,
    pub threads: u32,
}

/// An `extern "C"` kernel and its launch shape. Grid sizes that depend on the
/// batch are formulas over the runtime variables named in `grid`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EntryPoint {
    pub symbol: String,
    /// Grid size: a number or an expression over `tokens`, `entries`, `rows`.
    pub grid: String,
    pub block: u32,
    pub dynamic_smem: u32,
    /// The arguments in order, as `type name`.
    pub params: Vec<String>,
}
