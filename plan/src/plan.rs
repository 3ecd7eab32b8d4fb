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

use moeforge_dsl::spec::{Activation, Arch, DType, Strategy};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Bumped whenever `plan.json` or the bundle layout changes incompatibly.
pub const FORMAT_VERSION: u32 = 12;

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
    /// strategies: `expertplex` realizes its best layout as `roles`; for
    /// `auto` it is advisory (the plan is colocated).
    pub search: Option<crate::search::SearchResult>,
    /// Replicas per layer and GPU for `placement { policy = zepp | eplb }`:
    /// the contents of each GPU's EP expert slots (realized by the memory plan).
    pub placement: Option<crate::placement::PlacementPlan>,
    /// What each rank launches for one forward step, per mode and phase.
    #[serde(default)]
    pub programs: Vec<crate::program::Program>,
    /// The ExpertPlex roles (`strategy = expertplex`): each GPU a prefill
    /// attention, decode attention or MoE server, from the search's best
    /// layout. `None`: every GPU runs attention and holds experts (colocated).
    #[serde(default)]
    pub roles: Option<crate::roles::Roles>,
}

impl Plan {
    /// The routed experts GPU `rank`'s EP expert slots hold in MoE layer
    /// `moe_layer`, in slot order: the placement's replicas when the plan has
    /// one, the layout's stripe otherwise.
    pub fn slot_experts(&self, moe_layer: usize, rank: usize) -> Vec<u32> {
        match &self.placement {
            Some(p) => p.replicas.get(moe_layer).and_then(|l| l.get(rank)).cloned().unwrap_or_default(),
            None => self.ranks.get(rank).map(|r| (r.experts[0]..r.experts[1]).collect()).unwrap_or_default(),
        }
    }

    /// The expert ids GPU `rank`'s EP permutation matches, `[begin, end)`:
    /// its stripe's (logical) ids without a placement; with one, the
    /// physical slot ids `rank·S .. (rank+1)·S` (S slots per GPU), because
    /// the dispatch rewrites each routed entry's logical id to the physical
    /// slot the routing chose (as SGLang maps logical to physical experts).
    /// Physical ids are numbered by world rank, so a role plan's attention
    /// servers, which hold no slot, leave empty ranges.
    pub fn ep_ids(&self, rank: usize) -> [u32; 2] {
        match &self.placement {
            Some(p) => {
                let s = p.slots_per_gpu() as u32;
                let first = rank as u32 * s;
                [first, first + self.local_experts(rank)]
            }
            None => self.ranks.get(rank).map_or([0, 0], |r| r.experts),
        }
    }

    /// GPU `rank`'s role, for a role plan.
    pub fn role(&self, rank: usize) -> Option<crate::roles::Role> {
        self.roles.as_ref().and_then(|r| r.gpus.get(rank).copied())
    }

    /// Expert slots GPU `rank` holds per MoE layer (the same in every layer;
    /// none on a role plan's attention servers).
    pub fn local_experts(&self, rank: usize) -> u32 {
        if self.roles.as_ref().is_some_and(|r| !r.holds_experts(rank as u32)) {
            return 0;
        }
        match &self.placement {
            Some(p) => p.slots_per_gpu() as u32,
            None => self.ranks.get(rank).map_or(0, |r| r.experts[1].saturating_sub(r.experts[0])),
        }
    }

    /// A plan with its facts and nothing planned yet: the passes fill in
    /// the layout, memory plan, cost model, search, kernels and placement.
    pub fn new(deploy: &str, spec_hash: String, model: ModelFacts, cluster: ClusterFacts, requested: Strategy) -> Plan {
        Plan {
            format_version: FORMAT_VERSION,
            deploy: deploy.to_string(),
            spec_hash,
            model,
            cluster,
            layout: DeployLayout {
                requested,
                attention: String::new(),
                moe: String::new(),
                ep_size: 0,
                max_experts_per_rank: 0,
                note: None,
            },
            ranks: Vec::new(),
            memory: crate::memory::MemoryPlan::default(),
            kernels: Vec::new(),
            cost: crate::cost::CostModel::default(),
            search: None,
            placement: None,
            programs: Vec::new(),
            roles: None,
        }
    }
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

impl ModelFacts {
    /// The facts of model `m`, as the plan records them.
    pub fn of(m: &moeforge_dsl::spec::Model) -> ModelFacts {
        ModelFacts {
            name: m.name.clone(),
            layers: m.layers,
            moe_layers: m.moe_layers(),
            hidden: m.hidden,
            experts: m.moe.experts,
            top_k: m.moe.top_k,
            expert_ffn: m.moe.expert_ffn,
            params_total: m.params().total(),
            params_active: m.active_params(),
            weight_bytes: m.weight_bytes(),
            expert_bytes: m.expert_bytes(),
            expert_dtype: m.dtype.experts,
            block_scale: m.dtype.block_scale,
            activation_dtype: m.dtype.activations,
            kv_bytes_per_token: u64::from(m.layers) * m.kv_bytes_per_token_layer(),
        }
    }
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

impl ClusterFacts {
    /// The facts of cluster `c`, as the plan records them.
    pub fn of(c: &moeforge_dsl::spec::Cluster) -> ClusterFacts {
        ClusterFacts {
            name: c.name.clone(),
            nodes: c.nodes,
            gpus_per_node: c.gpus_per_node,
            world: c.world_size(),
            gpu: c.gpu.name.clone(),
            arch: c.gpu.arch,
            sms: c.gpu.sms,
            hbm_bytes: c.gpu.hbm,
            scale_up_bandwidth: c.scale_up.bandwidth,
        }
    }
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
    /// The stripe of routed experts `[begin, end)` this rank holds when the
    /// plan has no placement; with one, its slots hold the placement's
    /// replicas instead ([`Plan::slot_experts`] answers either way).
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
    Layer(LayerParams),
    Zepp(ZeppParams),
}

/// The replica routing of a placement (`kernels/zepp_route.cu`): each
/// source's routed entries counted per expert, then the placement policy's
/// routing of every source's counts over the layer's replica table, at
/// fixed addresses ([`crate::memory::ZeppRouteParts`]), and each of this
/// source's entries given its physical slot. Sizes are run-time arguments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ZeppParams {
    /// Zepp's locality-preferred water-filling and consolidation, or EPLB's
    /// even split.
    pub policy: moeforge_dsl::spec::PlacementPolicy,
    /// The load bound's relaxation (`PlacementPlan::slack`).
    pub slack: f64,
    pub threads: u32,
}

/// The per-token kernels around the GEMMs and attention: embedding,
/// RMSNorm (with the fused residual add), the residual add of the MoE
/// output, sampling (greedy or seeded temperature/top-p), and for GQA models QK-norm, RoPE and the paged
/// KV write. One block per token (or row); head counts, pages and layers
/// are run-time arguments, so both modes' programs launch one instance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerParams {
    pub hidden: u32,
    pub vocab: u32,
    pub rms_eps: f64,
    pub threads: u32,
    /// i32 words per request in `request_meta`: the header (tokens cached,
    /// first row, rows, flags, temperature, top-p, the generator's 64-bit
    /// state), then the page table from word 8.
    pub request_meta_words: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gqa: Option<GqaLayerParams>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<MlaLayerParams>,
}

/// The MLA constants of [`LayerParams`]: the `qkv` row holds q_a
/// (`q_lora`, when the model has one) at 0, q (`heads × (nope + rope)`) at
/// `q_offset`, kv_a (the latent `kv_lora`, then the shared rope key) at
/// `kv_offset`; a cache entry is the normed latent and the rotated rope key
/// (then the DSA indexer's key).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MlaLayerParams {
    pub heads: u32,
    pub q_lora: u32,
    pub kv_lora: u32,
    pub nope: u32,
    pub rope: u32,
    pub v_head: u32,
    pub qkv_stride: u32,
    pub q_offset: u32,
    pub kv_offset: u32,
    /// RoPE's inverse frequencies over the rope dims (interleaved pairs) and
    /// the factor on cos and sin.
    pub inv_freq: Vec<f64>,
    pub rope_scale: f64,
    /// `(nope + rope)^-1/2`, times YaRN's `mscale²` when scaled.
    pub softmax_scale: f64,
    pub page_tokens: u32,
    /// Bytes of one cache entry (latent, rope key, indexer key).
    pub entry_bytes: u64,
    /// DeepSeek Sparse Attention's lightning indexer, if the model has one.
    pub indexer: Option<IndexerLayerParams>,
    /// `kv_b` is fp8 e4m3 with 128×128 block scales (the absorbed attention
    /// takes its scales beside it), else bf16.
    #[serde(default)]
    pub kv_b_fp8: bool,
}

/// The DSA indexer's constants: `heads` ReLU scoring heads of `head_dim`
/// (interleaved RoPE on the first [`MlaLayerParams::rope`] dims of each, as
/// on the key), and
/// where its key, query and per-head weights sit in the `qkv` row. The key
/// follows the rope key, so a cache entry (latent ‖ rope key ‖ indexer key)
/// is one contiguous run of the row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IndexerLayerParams {
    pub heads: u32,
    pub head_dim: u32,
    pub top_k: u32,
    pub k_offset: u32,
    pub q_offset: u32,
    pub w_offset: u32,
}

/// The GQA constants of [`LayerParams`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GqaLayerParams {
    pub head_dim: u32,
    /// Rotary dims per head (`< head_dim`: partial RoPE over the first ones).
    pub rope_dim: u32,
    /// Global query and KV heads (an all-head QK-norm divides by their size).
    pub heads: u32,
    pub kv_heads: u32,
    /// Elements per row of the `qkv` buffer (its q, then k, then v heads).
    pub qkv_stride: u32,
    /// QK-norm: none, per head, or over all heads.
    pub qk_norm: QkNormKind,
    /// RoPE's inverse frequency per rotary pair (YaRN-blended when the model
    /// scales), and the factor cos and sin are multiplied by.
    pub inv_freq: Vec<f64>,
    pub rope_scale: f64,
    pub page_tokens: u32,
    /// Bytes of one token of one KV head in one layer (K then V).
    pub head_token_bytes: u64,
    /// Per layer, the keys a sliding-window layer attends to (0: every
    /// key); empty when no layer slides.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layer_window: Vec<u32>,
    /// The flash-attention-style prefill kernel's tiles (`flash_prefill`);
    /// absent where the heads do not fit it (head_dim a multiple of 16, at
    /// most 128): prefill then runs `paged_attention`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flash: Option<moeforge_dsl::spec::AttentionTiles>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNormKind {
    None,
    PerHead,
    AllHeads,
}

/// What an APK instance runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApkForm {
    /// EP's routed experts: GateUp → SiLU·mul → Down over the rank's
    /// `local_experts` groups, shapes fixed at compile time.
    Experts,
    /// TP's: every expert (`local_experts` = E) over this rank's `1/P` of
    /// the intermediate (`inter` = I/P), launched per MoE operation.
    ExpertsTp,
    /// The one-group form every dense GEMM runs (projections, router and LM
    /// head, dense and shared-expert FFNs): one GEMM per operation, its shape
    /// and epilogue posted with it ([`crate::program::GemmArgs`]);
    /// `hidden` and `inter` are 0.
    Dense,
}

/// An Adaptive Persistent Kernel (ExpertPlex §4): the routed experts of the
/// MoE ranks holding `local_experts` experts (GateUp → SiLU·mul → Down for
/// both phases), or the dense form, the same tiles as a one-group GEMM.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ApkParams {
    pub form: ApkForm,
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
    pub weights: WeightFormat,
    pub scale_block: u32,
    /// The GateUp epilogue's activation: SiLU(gate)·up, or GPT-OSS's clamped
    /// SwiGLU. Biases, where the model has them, are pointers of the launch.
    pub activation: Activation,
    /// Tensor-core path: `wgmma` (sm_90a: TMA, warp specialization,
    /// multicast) or `mma_sync` (portable, sm_80: cp.async, ldmatrix).
    pub path: MmaPath,
    /// The pipeline its target sized for these tiles.
    #[serde(flatten)]
    pub pipeline: ApkPipeline,
    /// The MoE ranks that run this kernel.
    pub ranks: Vec<u32>,
}

/// The APK's pipeline shape on one target: one shared-memory ring and one
/// CTA shape serve every GEMM of both phases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApkPipeline {
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
}

/// Router: scores → top-k expert ids and weights, one warp per token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterParams {
    pub experts: u32,
    pub top_k: u32,
    pub scoring: Scoring,
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

/// The expert weights' storage format in the MoE kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightFormat {
    Bf16,
    /// fp8 e4m3 with 128×128 block scales (`weight_scale_inv`).
    Fp8E4m3,
}

/// The tensor-core instruction path of a target's MoE kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MmaPath {
    /// sm_90a: wgmma fed by TMA, warp-specialized, multicast over clusters.
    Wgmma,
    /// Portable (sm_80+): mma.sync fed by cp.async and ldmatrix.
    MmaSync,
}

/// The router's score function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scoring {
    Softmax,
    Sigmoid,
}

impl Scoring {
    pub fn name(self) -> &'static str {
        match self {
            Scoring::Softmax => "softmax",
            Scoring::Sigmoid => "sigmoid",
        }
    }
}

/// A quantity a launch grid scales with, known at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GridVar {
    /// Tokens of the step on this rank (of the op's micro-batch when it
    /// names one; every count below is too).
    Tokens,
    /// (token, k) routing entries: tokens × top-k.
    Entries,
    /// Routed experts this rank holds.
    LocalExperts,
    /// Rows sampled this step (one per request finishing a prompt or decoding).
    SampledRows,
    /// EP: token rows this rank received in the step's dispatch, and their
    /// (row, k) entries.
    Received,
    ReceivedEntries,
    /// A live switch's KV page moves into this rank (rows of `kv_moves` in one launch).
    KvMoves,
}

/// How many blocks a kernel launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Grid {
    /// A fixed number of blocks.
    Fixed { blocks: u32 },
    /// `ceil(over / per)` blocks.
    Per { over: GridVar, per: u32 },
    /// `ceil(over / per) × times` blocks: one per tile of `per` rows and
    /// each of `times` heads (the prefill attention's tiles × local heads).
    Tiles { over: GridVar, per: u32, times: u32 },
    /// The persistent kernel: one CTA per SM, rounded down to whole
    /// `cluster`-CTA clusters, launched once per serving session.
    Persistent { cluster: u32 },
    /// The same kernel launched per operation (the dense APK form): one CTA
    /// per SM up to the operation's tiles, whole `cluster`-CTA clusters;
    /// the launch posts the operation and `stop`, and returns when it is done.
    PerOperation { cluster: u32 },
}

impl fmt::Display for Grid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let var = |v: &GridVar| match v {
            GridVar::Tokens => "tokens",
            GridVar::Entries => "entries",
            GridVar::LocalExperts => "num_local",
            GridVar::SampledRows => "sampled_rows",
            GridVar::Received => "received",
            GridVar::ReceivedEntries => "received_entries",
            GridVar::KvMoves => "kv_moves",
        };
        match self {
            Grid::Fixed { blocks } => write!(f, "{blocks}"),
            Grid::Per { over, per: 1 } => write!(f, "{}", var(over)),
            Grid::Per { over, per } => write!(f, "ceil({} / {per})", var(over)),
            Grid::Tiles { over, per, times } => write!(f, "ceil({} / {per})·{times}", var(over)),
            Grid::Persistent { cluster } => write!(f, "SMs rounded down to a multiple of {cluster} (launched once)"),
            Grid::PerOperation { cluster } => {
                write!(f, "SMs rounded down to a multiple of {cluster} (launched per operation)")
            }
        }
    }
}

impl Grid {
    /// Blocks for the run-time value of the grid's variable (`None` for the
    /// persistent grid, which the device's SM count sizes).
    pub fn blocks(&self, value: u32) -> Option<u32> {
        match *self {
            Grid::Fixed { blocks } => Some(blocks),
            Grid::Per { per, .. } => Some(value.div_ceil(per.max(1))),
            Grid::Tiles { per, times, .. } => Some(value.div_ceil(per.max(1)) * times),
            Grid::Persistent { .. } | Grid::PerOperation { .. } => None,
        }
    }
}

/// An `extern "C"` kernel and its launch shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EntryPoint {
    pub symbol: String,
    pub grid: Grid,
    pub block: u32,
    pub dynamic_smem: u32,
    /// The arguments in order, as `type name`.
    pub params: Vec<String>,
}
