//! The memory plan IR: one unified buffer per rank, its regions, and the
//! tensor views of each parallelism mode (Moebius §4.2).
//!
//! Every rank allocates one buffer of `buffer_bytes` once and never frees or
//! moves it. Every long-lived tensor is a [`View`] into it: an offset, a
//! shape, element strides and a dtype. A view belongs to one [`Mode`]; where
//! both modes use the same bytes (replicated weights, the KV pool, the
//! expert slots) their views alias one region. Expert weights use N+1 layer
//! slots: TP maps MoE layer i to slot i, EP maps it to slot i+1, so a reshard
//! can run in place layer by layer (EP→TP ascending, TP→EP descending).
//!
//! Offsets are identical on every rank; what differs per rank is *which*
//! slice of the model a view holds, given by the ownership tables
//! ([`KvPlan::tp_heads`], the plan's `ranks[].experts`, [`head_block`]).

use moeforge_dsl::spec::{DType, Model};
use serde::{Deserialize, Serialize};

/// Byte alignment of every region and view.
pub const ALIGN: u64 = 256;

/// Tokens per KV-cache page.
pub const PAGE_TOKENS: u32 = 16;

/// Communication and scratch regions are sized for this many tokens per rank per step.
pub const MAX_BATCH_TOKENS: u64 = 8192;
/// Requests tracked at once (the request-metadata region).
pub const MAX_REQUESTS: u64 = 2048;
/// Longest sequence the page tables cover.
pub const MAX_SEQ: u64 = 32768;
/// KV pages a live switch moves per launch of its migration kernel (the
/// `KvMoves` table's rows; a switch moving more issues several launches).
pub const KV_MOVE_CHUNK: u64 = 16384;

/// The working memory every GPU keeps besides weights and KV cache: the
/// `comm`, `scratch` and `requests` regions of the memory plan, each the
/// sum of its fixed [`BufferSpec`]s (the program's activations, routing
/// metadata, communication slots and step inputs). The memory plan lays the
/// buffers out, and the layout search and the simulator charge the same
/// bytes to every GPU they place, so all three agree on what is left for KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workspace {
    /// EP dispatch + combine rows (top-k copies of every token), or TP's
    /// f32 all-reduce slots when that is larger (dual mode): the modes alias.
    pub comm: u64,
    /// Activations of one step: residual, normed, projections, attention,
    /// routing, GateUp rows, FFN intermediates, logits.
    pub scratch: u64,
    /// Step inputs and request metadata: token ids, positions, KV slots,
    /// page tables, sampled rows and tokens.
    pub requests: u64,
}

/// A fixed buffer of the workspace, in rows of `row_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferName {
    /// Step inputs, written by the host before the step (`requests` region).
    TokenIds,
    Positions,
    /// The KV-pool slot (page × page_tokens + offset) of every token.
    SlotMap,
    /// Per request: a header of eight i32 (tokens cached before the step,
    /// its first row, its rows this step, flags, temperature and top-p as
    /// f32, the sampler's 64-bit SplitMix64 state), then its page table.
    RequestMeta,
    /// The request (index into `request_meta`) of every token row.
    RowRequest,
    /// The rows whose logits are sampled (the last position of each request).
    SampleRows,
    /// The step's row counts on the device, i32 per micro-batch slice:
    /// [`STEP_TOKENS`] (the slice's token rows) and [`STEP_SAMPLED`] (its
    /// sampled rows). The dense APK reads its GEMM's rows here, so its
    /// launch arguments (and templates) do not change with the batch.
    StepCounts,
    /// The sampled token of each sampled row, read back by the host.
    Sampled,
    /// f32 residual stream.
    Residual,
    /// bf16 normed hidden state (the input of every projection).
    Normed,
    /// Every attention projection output of a token (q, k, v; MLA's
    /// q_a / q / kv_a / kv_b; DSA's indexer q, k and head weights).
    Qkv,
    /// Attention output before `o_proj`.
    Attn,
    /// DSA: the `index_topk` keys each query attends to.
    IndexerTopk,
    RouterLogits,
    TopkIds,
    TopkWeights,
    /// The permutation: per-expert counts and offsets, row ↔ entry maps.
    RouteIndex,
    /// The expert-contiguous rows the APK reads (gathered tokens).
    Permuted,
    /// GateUp output rows (gate ‖ up) of the routed experts.
    GateUp,
    /// The routed experts' output rows before the weighted combine.
    ExpertOut,
    /// The combined MoE output per token (f32).
    MoeOut,
    /// SiLU(gate)·up of the dense FFN and the shared experts (bf16; the
    /// dense APK's SwiGLU epilogue writes it, its down projection reads it).
    FfnMid,
    /// The shared experts' output per token (bf16), written on their own stream.
    SharedOut,
    /// f32 logits of the sampled rows.
    Logits,
    /// EP: token rows received from every rank for this rank's experts
    /// (`comm`), with their tokens' top-k ids and weights beside them in
    /// `DispatchIds` and `DispatchWeights` (row for row, so the permutation,
    /// gather and combine read them as they read a local batch's); the
    /// combine's bf16 partial sums go back from `Combine` and are summed in
    /// f32 into `MoeOut` on arrival.
    Dispatch,
    DispatchIds,
    DispatchWeights,
    Combine,
    /// TP: the f32 partial sums every rank all-reduces (`comm`).
    AllReduce,
    /// TP with an all-head QK-norm (MiniMax-M2): per token, the partial sum
    /// of squares of q and of k that the ranks all-reduce.
    QkSumSq,
    /// A replicated placement: the replica table of every MoE layer, i32
    /// `[moe layer][expert][replica]` physical slots (GPUs ascending, −1
    /// padded), at a fixed address (a swap rewrites its layer's rows).
    ReplicaTable,
    /// A replicated placement: the routing kernel's demand matrix, group,
    /// work and per-entry destinations ([`ZeppRouteParts`]).
    ZeppRoute,
    /// A replicated placement: i32 `[moe layer][expert]` entries this rank
    /// routed since the host last read them (`zepp_count` adds its counts;
    /// the runtime reads and zeroes them between steps for Zepp's per-window
    /// drift statistics, so no step reads its ids back).
    ExpertLoads,
    /// Dual plans: a live switch's KV page moves into this rank, i32
    /// (source page, destination page, tokens) per row, read by the
    /// migration kernel (Moebius §4.3), [`KV_MOVE_CHUNK`] rows at a time.
    KvMoves,
}

/// Byte offsets of a [`BufferName::StepCounts`] slice's words.
pub const STEP_TOKENS: u64 = 0;
pub const STEP_SAMPLED: u64 = 4;

/// Which modes' programs use a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferModes {
    Both,
    Ep,
    Tp,
}

impl BufferModes {
    pub fn contains(self, m: Mode) -> bool {
        matches!((self, m), (BufferModes::Both, _) | (BufferModes::Ep, Mode::Ep) | (BufferModes::Tp, Mode::Tp))
    }
}

/// A buffer of the workspace before layout: its region, modes and size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferSpec {
    pub name: BufferName,
    pub region: RegionKind,
    pub modes: BufferModes,
    pub rows: u64,
    pub row_bytes: u64,
}

/// A laid-out buffer: `rows × row_bytes` at `offset` of the unified buffer.
/// Buffers of one mode never overlap; EP's and TP's communication slots
/// alias (a rank runs one mode at a time).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Buffer {
    pub name: BufferName,
    pub region: RegionId,
    pub modes: BufferModes,
    pub offset: u64,
    pub rows: u64,
    pub row_bytes: u64,
}

impl Buffer {
    pub fn bytes(&self) -> u64 {
        self.rows * self.row_bytes
    }
    /// Bytes of one micro-batch's slice when the step splits into `m`.
    pub fn slice_bytes(&self, m: u32) -> u64 {
        self.rows / u64::from(m.max(1)) * self.row_bytes
    }
}

/// Where the permutation's arrays lie inside a `RouteIndex` slice of
/// `bytes` bytes for `experts` experts (byte offsets, 16-byte aligned): the
/// per-expert counts and offsets (`experts + 1` words) first, the overflow
/// word in the alignment gap after them (8·experts + 4 bytes is never a
/// multiple of 16, so the gap holds at least one word), then three equal
/// arrays of `capacity` words: row → entry, row → expert and entry → row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteIndexParts {
    pub counts: u64,
    pub offsets: u64,
    /// Set on the device when a layer's padded rows would pass the room
    /// of its buffers (`moe_offsets`); the host clears it before a step
    /// and reads it after.
    pub overflow: u64,
    pub row_entry: u64,
    pub row_expert: u64,
    pub entry_row: u64,
    /// Words in each of the three maps.
    pub capacity: u64,
}

impl RouteIndexParts {
    pub fn of(bytes: u64, experts: u64) -> RouteIndexParts {
        let a16 = |x: u64| x.div_ceil(16) * 16;
        let offsets = 4 * experts;
        let head = a16(offsets + 4 * (experts + 1));
        let capacity = bytes.saturating_sub(head) / 12 / 4 * 4;
        let row_entry = head;
        let row_expert = row_entry + 4 * capacity;
        RouteIndexParts {
            counts: 0,
            offsets,
            overflow: offsets + 4 * (experts + 1),
            row_entry,
            row_expert,
            entry_row: row_expert + 4 * capacity,
            capacity,
        }
    }
}

/// Where the routing kernel's arrays lie in a `ZeppRoute` buffer (byte
/// offsets): every source's counts per expert (`[world][experts]`), the
/// dispatch group's membership (`[world]`), the kernel's work area and the
/// physical slot of each of this source's entries (16-byte aligned).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZeppRouteParts {
    pub demand: u64,
    pub member: u64,
    pub work: u64,
    /// Inside the work area: the per-expert load bounds of the latest
    /// routing (after `nrep` and `rep`).
    pub bounds: u64,
    pub dest: u64,
    /// Bytes in all, for `entries` entries.
    pub bytes: u64,
}

impl ZeppRouteParts {
    pub fn of(world: u64, experts: u64, reps: u64, entries: u64) -> ZeppRouteParts {
        let (w, e, r) = (world, experts, reps);
        // `zepp_route`'s views: nrep, rep, bounds, used, need, lens, lists,
        // scratch, moves, nmoves, flow, order, ctl (kernels/zepp_route.cu).
        let work_words = e + e * r + e + 3 * e * w + 2 * e * w * r + 2 * e * r + 3 * e * r + e + 2 * w + 2;
        let demand = 0;
        let member = demand + 4 * w * e;
        let work = member + 4 * w;
        // 16-byte aligned, so a token's slots (`4 × top-k` bytes from
        // here, a fixed-slot decode dispatch's ids row) are as aligned as
        // the ids rows the dispatch program's copies were compiled for.
        let dest = (work + 4 * work_words).next_multiple_of(16);
        ZeppRouteParts { demand, member, work, bounds: work + 4 * (e + e * r), dest, bytes: dest + 4 * entries }
    }
}

/// Where each MLA projection sits in a `qkv` row (bf16 elements): the
/// normed q latent (q LoRA only) at 0, this rank's q heads (nope ‖ rope per
/// head) at `q`, the latent and the shared rope key at `kv`, then the DSA
/// indexer's key at `ix_k` (right after the rope key, so a cache entry is one
/// contiguous run), its query heads at `ix_q` and its per-head weights at
/// `ix_w`; `width` elements in all. The absorbed attention (both phases)
/// never decompresses k and v, so they have no place here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaRow {
    pub q: u32,
    pub kv: u32,
    pub ix_k: u32,
    pub ix_q: u32,
    pub ix_w: u32,
    pub width: u32,
}

impl MlaRow {
    /// `None` for a GQA model.
    pub fn of(m: &Model) -> Option<MlaRow> {
        use moeforge_dsl::spec::Attention;
        let Attention::Mla { heads, q_lora, kv_lora, qk_nope, qk_rope, indexer, .. } = m.attention else {
            return None;
        };
        Some(MlaRow::new(heads, q_lora, kv_lora, qk_nope, qk_rope, indexer))
    }

    /// The row of an MLA attention block with these fields.
    pub fn new(
        heads: u32,
        q_lora: Option<u32>,
        kv_lora: u32,
        qk_nope: u32,
        qk_rope: u32,
        indexer: Option<moeforge_dsl::spec::Indexer>,
    ) -> MlaRow {
        let q = q_lora.unwrap_or(0);
        let kv = q + heads * (qk_nope + qk_rope);
        let ix_k = kv + kv_lora + qk_rope;
        let (ih, id) = indexer.map_or((0, 0), |ix| (ix.heads, ix.head_dim));
        let ix_q = ix_k + id;
        let ix_w = ix_q + ih * id;
        MlaRow { q, kv, ix_k, ix_q, ix_w, width: ix_w + ih }
    }
}

/// Per-token bytes of every attention projection output (bf16), and of
/// the attention output.
fn attention_rows(m: &Model) -> (u64, u64) {
    use moeforge_dsl::spec::Attention;
    match m.attention {
        Attention::Gqa { heads, kv_heads, head_dim, .. } => {
            let (q, kv, d) = (u64::from(heads), u64::from(kv_heads), u64::from(head_dim));
            ((q + 2 * kv) * d * 2, q * d * 2)
        }
        Attention::Mla { heads, v_head, .. } => {
            let row = MlaRow::of(m).map_or(0, |r| u64::from(r.width));
            (row * 2, u64::from(heads) * u64::from(v_head) * 2)
        }
    }
}

impl Workspace {
    /// Every buffer of model `m` for [`MAX_BATCH_TOKENS`] tokens per rank
    /// per step and [`MAX_REQUESTS`] requests, with TP's all-reduce slots
    /// when the plan holds both modes (`dual`).
    pub fn buffers(m: &Model, dual: bool) -> Vec<BufferSpec> {
        use BufferModes::{Both, Ep, Tp};
        use BufferName::*;
        let (h, i, k, e) =
            (u64::from(m.hidden), u64::from(m.moe.expert_ffn), u64::from(m.moe.top_k), u64::from(m.moe.experts));
        let (t, r) = (MAX_BATCH_TOKENS, MAX_REQUESTS);
        let entries = t * k;
        let pages_per_request = MAX_SEQ.div_ceil(u64::from(PAGE_TOKENS));
        let (qkv, attn) = attention_rows(m);
        let shared = u64::from(m.moe.shared_experts) * u64::from(m.moe.shared_ffn);
        let dense = m.dense.map_or(0, |d| u64::from(d.ffn));
        let b = |name, region, modes, rows, row_bytes| BufferSpec { name, region, modes, rows, row_bytes };
        let (rq, sc, cm) = (RegionKind::Requests, RegionKind::Scratch, RegionKind::Comm);
        let mut v = vec![
            b(TokenIds, rq, Both, t, 4),
            b(Positions, rq, Both, t, 4),
            b(SlotMap, rq, Both, t, 4),
            b(RequestMeta, rq, Both, r, 32 + 4 * pages_per_request),
            b(RowRequest, rq, Both, t, 4),
            b(SampleRows, rq, Both, r, 4),
            // One 16-byte row per micro-batch slice (at most 16 slices).
            b(StepCounts, rq, Both, 16, 16),
            b(Sampled, rq, Both, r, 4),
            b(Residual, sc, Both, t, h * 4),
            b(Normed, sc, Both, t, h * 2),
            b(Qkv, sc, Both, t, qkv),
            b(Attn, sc, Both, t, attn),
        ];
        if let moeforge_dsl::spec::Attention::Mla { indexer: Some(ix), .. } = m.attention {
            v.push(b(IndexerTopk, sc, Both, t, u64::from(ix.top_k) * 4));
        }
        v.extend([
            b(RouterLogits, sc, Both, t, e * 4),
            b(TopkIds, sc, Both, t, k * 4),
            b(TopkWeights, sc, Both, t, k * 4),
            // counts and offsets per expert, then row→entry, row→expert and
            // entry→row maps (`RouteIndexParts` places them): the entry map
            // covers k entries of every row the receive buffer holds (EP's
            // `dispatch` has `entries` rows, a role plan's MoE server
            // scanning up to the last row its posts filled), the padded rows
            // ≤ entries + 256 per expert.
            b(RouteIndex, sc, Both, entries * k + 256 * e, 12),
            // Expert-contiguous rows: each local expert's padded to M_t (≤ 256).
            b(Permuted, sc, Both, entries + 256 * e, h * 2),
            b(GateUp, sc, Both, entries + 256 * e, 2 * i * 2),
            b(ExpertOut, sc, Both, entries + 256 * e, h * 2),
            b(MoeOut, sc, Both, t, h * 4),
        ]);
        if shared.max(dense) > 0 {
            v.push(b(FfnMid, sc, Both, t, shared.max(dense) * 2));
        }
        if shared > 0 {
            v.push(b(SharedOut, sc, Both, t, h * 2));
        }
        v.push(b(Logits, sc, Both, r, u64::from(m.vocab) * 4));
        // Received rows, their top-k ids and weights, row for row.
        v.extend([
            b(Dispatch, cm, Ep, entries, h * 2),
            b(DispatchIds, cm, Ep, entries, k * 4),
            b(DispatchWeights, cm, Ep, entries, k * 4),
            b(Combine, cm, Ep, entries, h * 2),
        ]);
        if dual {
            v.push(b(KvMoves, rq, Both, KV_MOVE_CHUNK, 12));
            v.push(b(AllReduce, cm, Tp, 2 * t, h * 4));
            if let moeforge_dsl::spec::Attention::Gqa {
                qk_norm: true,
                qk_norm_scope: moeforge_dsl::spec::QkNormScope::PerLayer,
                ..
            } = m.attention
            {
                v.push(b(QkSumSq, cm, Tp, t, 2 * 4));
            }
        }
        v
    }

    /// A replicated placement's routing buffers, for `world` GPUs, `reps`
    /// replicas at most per expert and `moe_layers` layers: in the
    /// requests region, in both modes (they persist across a switch).
    pub fn zepp_buffers(m: &Model, world: u64, reps: u64) -> Vec<BufferSpec> {
        let (e, k) = (u64::from(m.moe.experts), u64::from(m.moe.top_k));
        let parts = ZeppRouteParts::of(world, e, reps, MAX_BATCH_TOKENS * k);
        let b = |name, rows, row_bytes| BufferSpec {
            name,
            region: RegionKind::Requests,
            modes: BufferModes::Both,
            rows,
            row_bytes,
        };
        vec![
            b(BufferName::ReplicaTable, u64::from(m.moe_layers()) * e, 4 * reps),
            b(BufferName::ZeppRoute, 1, parts.bytes),
            b(BufferName::ExpertLoads, u64::from(m.moe_layers()), 4 * e),
        ]
    }

    /// The workspace of model `m`: the three regions' sizes from [`Workspace::buffers`].
    pub fn of(m: &Model, dual: bool) -> Workspace {
        Workspace::of_specs(&Workspace::buffers(m, dual))
    }

    /// The three regions' sizes holding `specs`.
    pub fn of_specs(specs: &[BufferSpec]) -> Workspace {
        let sum = |region: RegionKind, mode: Mode| {
            specs
                .iter()
                .filter(|s| s.region == region && s.modes.contains(mode))
                .map(|s| align(s.rows * s.row_bytes))
                .sum::<u64>()
        };
        let both = |region| sum(region, Mode::Ep).max(sum(region, Mode::Tp));
        Workspace {
            comm: both(RegionKind::Comm),
            scratch: both(RegionKind::Scratch),
            requests: both(RegionKind::Requests),
        }
    }
    /// Bytes of the three regions, each aligned.
    pub fn bytes(&self) -> u64 {
        align(self.comm) + align(self.scratch) + align(self.requests)
    }
}

/// A parallelism mode (Moebius §2.1): TP = tensor-parallel attention and
/// experts; EP = data-parallel attention and expert-parallel experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Tp,
    Ep,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Tp => "tp",
            Mode::Ep => "ep",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
pub struct MemoryPlan {
    pub hbm: u64,
    pub memory_fraction: f64,
    /// Size of each rank's unified buffer: `hbm × memory_fraction`, aligned down.
    pub buffer_bytes: u64,
    /// The modes this plan holds views for: `[ep]`, or `[tp, ep]` when the
    /// deployment switches.
    pub modes: Vec<Mode>,
    /// Ranks in the switching group (TP size = EP size).
    pub group: u32,
    /// Why the plan holds a single mode, when it does.
    pub single_mode_reason: Option<String>,
    /// Largest batch (tokens per rank per step) the communication and scratch
    /// regions are sized for, and the most requests tracked at once.
    pub max_batch_tokens: u64,
    pub max_requests: u64,
    pub regions: Vec<Region>,
    pub views: Vec<View>,
    pub slots: ExpertSlots,
    pub kv: KvPlan,
    pub reshard: Option<ReshardPlans>,
    pub overhead: DualModeOverhead,
    /// The workspace's fixed buffers (activations, routing metadata, comm
    /// slots, step inputs) inside the comm, scratch and requests regions.
    #[serde(default)]
    pub buffers: Vec<Buffer>,
}

/// Index of a [`Region`] in [`MemoryPlan::regions`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RegionId(pub u32);

impl RegionId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// What a region holds. Each kind appears at most once per buffer, in this
/// order (the ones a plan does not need are absent).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RegionKind {
    /// Weights identical on every rank and in both modes: embeddings, norms,
    /// the router, shared experts, dense FFN layers, the LM head.
    Replicated,
    /// The full attention weights (EP: data-parallel attention).
    AttentionEp,
    /// This rank's attention head shard (TP).
    AttentionTp,
    /// The routed experts' layer slots (N+1 in dual mode).
    Experts,
    /// Dispatch/combine rows (EP) and all-reduce buffers (TP).
    Comm,
    /// GateUp outputs and activations.
    Scratch,
    /// Per-request metadata and page tables.
    Requests,
    /// The paged KV cache.
    KvPool,
}

impl RegionKind {
    pub fn name(self) -> &'static str {
        match self {
            RegionKind::Replicated => "replicated",
            RegionKind::AttentionEp => "attention_ep",
            RegionKind::AttentionTp => "attention_tp",
            RegionKind::Experts => "experts",
            RegionKind::Comm => "comm",
            RegionKind::Scratch => "scratch",
            RegionKind::Requests => "requests",
            RegionKind::KvPool => "kv_pool",
        }
    }
}

/// A contiguous byte range of the unified buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    pub kind: RegionKind,
    pub offset: u64,
    pub bytes: u64,
    /// Modes whose views point into this region.
    pub modes: Vec<Mode>,
    /// The roles whose GPUs hold this region (a role plan's regions overlay
    /// one another behind the shared workspace); empty: every GPU.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub roles: Vec<crate::roles::Role>,
}

impl Region {
    /// Whether a GPU of `role` (`None`: a plan without roles) holds the region.
    pub fn held_by(&self, role: Option<crate::roles::Role>) -> bool {
        self.roles.is_empty() || role.is_some_and(|r| self.roles.contains(&r))
    }
}

/// A tensor as one mode sees it. For per-layer tensors, layer `l` of
/// `layers` is at `offset + (l - layers[0]) × layer_stride`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct View {
    /// Hugging Face-style name with `{l}` for the layer; always
    /// [`TensorRole::name`] of `role` and `part` (the validator checks it).
    pub tensor: String,
    /// What the tensor is; consumers select views by role, never by name.
    pub role: TensorRole,
    pub part: TensorPart,
    pub mode: Mode,
    pub region: RegionId,
    pub offset: u64,
    /// `[first, end)` of the layers this view covers; `[0, 1)` for global tensors.
    pub layers: [u32; 2],
    pub layer_stride: u64,
    pub shape: Vec<u64>,
    /// Element strides, row-major unless a view says otherwise.
    pub strides: Vec<u64>,
    pub dtype: DType,
    /// What slice of the global tensor this rank's view holds.
    pub shard: Shard,
}

impl MemoryPlan {
    /// The region of `kind`, if the plan has one.
    pub fn region(&self, kind: RegionKind) -> Option<&Region> {
        self.regions.iter().find(|r| r.kind == kind)
    }
    /// The view of `role` (`part`) in `mode`.
    pub fn view(&self, mode: Mode, role: TensorRole, part: TensorPart) -> Option<&View> {
        self.views.iter().find(|v| v.mode == mode && v.role == role && v.part == part)
    }
    /// The buffer `name` that `mode`'s program uses.
    pub fn buffer(&self, mode: Mode, name: BufferName) -> Option<&Buffer> {
        self.buffers.iter().find(|b| b.name == name && b.modes.contains(mode))
    }
    /// Padded rows one micro-batch's permutation may lay out (of a step
    /// split into `micro_batches`) for a model of `experts` experts whose
    /// grouped GEMMs take at most `apk_rows`: the `RouteIndex` maps'
    /// capacity, the rows of the `Permuted`, `GateUp` and `ExpertOut`
    /// slices and `apk_rows`, whichever is least. `moe_offsets` refuses a
    /// layout past it on the device.
    pub fn permute_room(&self, mode: Mode, micro_batches: u32, experts: u32, apk_rows: u64) -> u64 {
        let rows = |n| self.buffer(mode, n).map_or(0, |b| b.slice_bytes(micro_batches) / b.row_bytes.max(1));
        let maps = self.buffer(mode, BufferName::RouteIndex).map_or(0, |b| b.slice_bytes(micro_batches));
        [BufferName::Permuted, BufferName::GateUp, BufferName::ExpertOut]
            .into_iter()
            .map(rows)
            .fold(RouteIndexParts::of(maps, u64::from(experts)).capacity.min(apk_rows), u64::min)
    }
}

impl View {
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * elt_bytes(self.dtype)
    }
    /// Byte offset of layer `l` (a model layer index inside `layers`).
    pub fn offset_of(&self, l: u32) -> u64 {
        self.offset + u64::from(l.saturating_sub(self.layers[0])) * self.layer_stride
    }
    /// Whether the view covers model layer `l`.
    pub fn covers(&self, l: u32) -> bool {
        (self.layers[0]..self.layers[1]).contains(&l)
    }
}

/// The slice of a global tensor a view holds on rank r of the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Shard {
    /// The whole tensor, identical on every rank.
    Full,
    /// Rows `[r·n, (r+1)·n)` of dimension `dim` in blocks of `block` rows
    /// (`block` = head size for projections), where the block index comes from
    /// the rank's head ownership (`heads`: query heads; `kv`: KV heads).
    Heads { dim: u32, heads: HeadSet },
    /// The experts this rank owns in EP, stacked on dimension 0.
    LocalExperts,
    /// Every expert, each cut to this rank's `1/P` of the intermediate
    /// dimension `dim` (for W13 both the gate and the up half are cut).
    ExpertShard { dim: u32 },
}

/// The tensors of a model as the memory plan stores them. Per-layer roles
/// are named with `{l}` for the layer; routed experts are stacked per layer
/// (`w13`: gate rows then up rows of every local expert, `w2`: down).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorRole {
    Embedding,
    LmHead,
    FinalNorm,
    InputNorm,
    PostAttentionNorm,
    /// GQA projections and per-head norms; MLA's `o_proj` too.
    QProj,
    KProj,
    VProj,
    OProj,
    QNorm,
    KNorm,
    Sinks,
    /// MLA's low-rank projections and their norms.
    QAProj,
    QANorm,
    QBProj,
    KvAProj,
    KvANorm,
    KvBProj,
    /// DSA's lightning indexer: query projection, key projection, the key's
    /// LayerNorm (weight and bias rows) and the per-head weights.
    IndexerQ,
    IndexerK,
    IndexerKNorm,
    IndexerWeights,
    /// The router's weight and its selection bias (sigmoid routing).
    Router,
    RouterBias,
    SharedGate,
    SharedUp,
    SharedDown,
    DenseGate,
    DenseUp,
    DenseDown,
    ExpertsW13,
    ExpertsW2,
}

/// The weight itself, its fp8 block scales, or its bias (one value per
/// output row: attention projections, the router and the experts of GPT-OSS).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorPart {
    Weight,
    ScaleInv,
    Bias,
}

impl TensorRole {
    /// Whether the tensor exists once per layer (`{l}` in its name).
    pub fn per_layer(self) -> bool {
        !matches!(self, TensorRole::Embedding | TensorRole::LmHead | TensorRole::FinalNorm)
    }

    /// The Hugging Face-style name of `part` of this tensor, `{l}` for the layer.
    pub fn name(self, part: TensorPart) -> String {
        use TensorRole::*;
        let stem = match self {
            Embedding => "model.embed_tokens",
            LmHead => "lm_head",
            FinalNorm => "model.norm",
            InputNorm => "model.layers.{l}.input_layernorm",
            PostAttentionNorm => "model.layers.{l}.post_attention_layernorm",
            QProj => "model.layers.{l}.self_attn.q_proj",
            KProj => "model.layers.{l}.self_attn.k_proj",
            VProj => "model.layers.{l}.self_attn.v_proj",
            OProj => "model.layers.{l}.self_attn.o_proj",
            QNorm => "model.layers.{l}.self_attn.q_norm",
            KNorm => "model.layers.{l}.self_attn.k_norm",
            Sinks => return "model.layers.{l}.self_attn.sinks".into(),
            QAProj => "model.layers.{l}.self_attn.q_a_proj",
            QANorm => "model.layers.{l}.self_attn.q_a_layernorm",
            QBProj => "model.layers.{l}.self_attn.q_b_proj",
            KvAProj => "model.layers.{l}.self_attn.kv_a_proj_with_mqa",
            KvANorm => "model.layers.{l}.self_attn.kv_a_layernorm",
            KvBProj => "model.layers.{l}.self_attn.kv_b_proj",
            IndexerQ => "model.layers.{l}.self_attn.indexer.wq_b",
            IndexerK => "model.layers.{l}.self_attn.indexer.wk",
            IndexerKNorm => "model.layers.{l}.self_attn.indexer.k_norm",
            IndexerWeights => "model.layers.{l}.self_attn.indexer.weights_proj",
            Router => "model.layers.{l}.mlp.gate",
            RouterBias => return "model.layers.{l}.mlp.gate.e_score_correction_bias".into(),
            SharedGate => "model.layers.{l}.mlp.shared_experts.gate_proj",
            SharedUp => "model.layers.{l}.mlp.shared_experts.up_proj",
            SharedDown => "model.layers.{l}.mlp.shared_experts.down_proj",
            DenseGate => "model.layers.{l}.mlp.gate_proj",
            DenseUp => "model.layers.{l}.mlp.up_proj",
            DenseDown => "model.layers.{l}.mlp.down_proj",
            ExpertsW13 | ExpertsW2 => {
                let w = if self == ExpertsW13 { "w13" } else { "w2" };
                return match part {
                    TensorPart::Weight => format!("model.layers.{{l}}.mlp.experts.{w}"),
                    TensorPart::ScaleInv => format!("model.layers.{{l}}.mlp.experts.{w}_weight_scale_inv"),
                    TensorPart::Bias => format!("model.layers.{{l}}.mlp.experts.{w}_bias"),
                };
            }
        };
        match part {
            TensorPart::Weight => format!("{stem}.weight"),
            TensorPart::ScaleInv => format!("{stem}.weight_scale_inv"),
            TensorPart::Bias => format!("{stem}.bias"),
        }
    }

    /// Routed expert weights, which live in the expert slots.
    pub fn is_routed_expert(self) -> bool {
        matches!(self, TensorRole::ExpertsW13 | TensorRole::ExpertsW2)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeadSet {
    Query,
    Kv,
}

/// The N+1 expert slots (Moebius Figure 7).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ExpertSlots {
    pub region: RegionId,
    pub base: u64,
    /// MoE layers N; the region holds N+1 slots (N when single-mode).
    pub moe_layers: u32,
    /// Model layer of MoE layer 0 (the leading dense layers come first).
    pub first_moe_layer: u32,
    pub slot_bytes: u64,
    /// Within a slot: the gate-up block `W13` then the down block `W2`.
    pub w13_bytes: u64,
    pub w2_bytes: u64,
    /// Slot of MoE layer i = i + shift: TP 0, EP 1.
    pub tp_shift: u32,
    pub ep_shift: u32,
}

/// The paged KV cache: one pool, two page formats.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct KvPlan {
    pub region: RegionId,
    pub page_tokens: u32,
    /// Bytes of one token of one KV head in one layer (K and V together).
    pub head_token_bytes: u64,
    /// KV heads stored per rank per mode, and the resulting page size and count.
    pub ep: KvMode,
    pub tp: Option<KvMode>,
    /// TP: the KV heads `[begin, end)` held by each rank. With fewer KV heads
    /// than ranks each head is replicated on `replication` consecutive ranks.
    pub tp_heads: Vec<[u32; 2]>,
    pub replication: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct KvMode {
    pub heads_per_rank: u32,
    /// A page holds `page_tokens` tokens of every layer for `heads_per_rank` heads.
    pub page_bytes: u64,
    pub pages: u64,
    /// Tokens the whole group can hold: EP `P × pages × page_tokens` (each
    /// rank its own requests), TP `pages × page_tokens` (every rank every request).
    pub capacity_tokens: u64,
}

/// Both directions of the weight reshard, as direct-transfer descriptors.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReshardPlans {
    pub ep_to_tp: WeightReshard,
    pub tp_to_ep: WeightReshard,
}

/// A weight reshard. For each MoE layer i in `order`, every descriptor runs
/// with source offsets relative to slot `i + src_shift` on `src_rank` and
/// destination offsets relative to slot `i + dst_shift` on `dst_rank`;
/// all ranks finish layer i before any starts the next.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightReshard {
    pub from: Mode,
    pub to: Mode,
    pub order: LayerOrder,
    pub src_shift: u32,
    pub dst_shift: u32,
    pub per_layer: Vec<Copy>,
    /// Bytes crossing between ranks per layer and in total, and the lower
    /// bound: expert bytes whose owning rank changes.
    pub interconnect_bytes_per_layer: u64,
    pub local_bytes_per_layer: u64,
    pub owner_changed_bytes_per_layer: u64,
}

impl WeightReshard {
    /// Every copy of the reshard in execution order (MoE layer by layer in
    /// the plan's order, each layer's descriptors in order), with the byte
    /// offsets of its source and destination slots in the ranks' buffers.
    pub fn schedule<'a>(&'a self, slots: &'a ExpertSlots) -> impl Iterator<Item = (&'a Copy, u64, u64)> + 'a {
        let layers: Vec<u32> = match self.order {
            LayerOrder::Ascending => (0..slots.moe_layers).collect(),
            LayerOrder::Descending => (0..slots.moe_layers).rev().collect(),
        };
        layers.into_iter().flat_map(move |l| {
            let src = slots.base + u64::from(l + self.src_shift) * slots.slot_bytes;
            let dst = slots.base + u64::from(l + self.dst_shift) * slots.slot_bytes;
            self.per_layer.iter().map(move |c| (c, src, dst))
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerOrder {
    Ascending,
    Descending,
}

/// A strided copy: `counts[0] × counts[1]` runs of `run_bytes`; run (a, b)
/// starts at `src_offset + a·src_strides[0] + b·src_strides[1]` and goes to
/// `dst_offset + a·dst_strides[0] + b·dst_strides[1]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Copy {
    pub src_rank: u32,
    pub dst_rank: u32,
    pub src_offset: u64,
    pub dst_offset: u64,
    pub run_bytes: u64,
    pub counts: [u64; 2],
    pub src_strides: [u64; 2],
    pub dst_strides: [u64; 2],
}

impl Copy {
    pub fn bytes(&self) -> u64 {
        self.run_bytes * self.counts[0] * self.counts[1]
    }
    /// `(src, dst)` byte offsets of every run, in order.
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.counts[0]).flat_map(move |a| {
            (0..self.counts[1]).map(move |b| {
                (
                    self.src_offset + a * self.src_strides[0] + b * self.src_strides[1],
                    self.dst_offset + a * self.dst_strides[0] + b * self.dst_strides[1],
                )
            })
        })
    }
}

/// What holding both modes costs. The reference is the single-layout EP
/// plan (DP attention, N slots): the dual plan is that plan plus the TP head
/// shards and one extra expert slot, paid for out of the KV pool (Moebius
/// §6.6 reports 2.4%, 2.8 GB per GPU, for Qwen3-235B on 8×H200 at 0.85).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
pub struct DualModeOverhead {
    /// Bytes of everything but the KV pool in this plan.
    pub fixed_bytes: u64,
    /// The same for a single-layout EP plan (N slots, full attention only).
    pub single_ep_fixed_bytes: u64,
    /// The same for a single-layout TP plan (N slots, head shards only; its
    /// KV capacity is lower when KV heads are replicated).
    pub single_tp_fixed_bytes: u64,
    /// `fixed_bytes - single_ep_fixed_bytes`: the KV cache given up.
    pub overhead_bytes: u64,
    /// `overhead_bytes / buffer_bytes`.
    pub overhead_fraction: f64,
}

/// Bytes per element of a storage dtype (fp8 scales are separate tensors;
/// mxfp4 never reaches the memory plan: the support gate rejects it).
pub fn elt_bytes(dt: DType) -> u64 {
    match dt {
        DType::Bf16 => 2,
        DType::Fp8E4m3 | DType::Mxfp4 => 1,
        DType::F32 => 4,
    }
}

/// TP's KV-head ownership with `kv_heads` KV heads on `p` ranks: the heads
/// per rank, how many ranks hold each head, and each rank's `[begin, end)`.
/// With at least as many heads as ranks each rank holds `kv/p` of them;
/// with fewer, each head is replicated on `p/kv` consecutive ranks, so rank
/// r's query heads (`head_block`) always find their KV head locally.
pub fn tp_kv_heads(kv_heads: u32, p: u32) -> (u32, u32, Vec<[u32; 2]>) {
    let (kv, p) = (kv_heads.max(1), p.max(1));
    if kv >= p {
        let local = kv / p;
        (local, 1, (0..p).map(|r| [r * local, (r + 1) * local]).collect())
    } else {
        let rep = p / kv;
        (1, rep, (0..p).map(|r| [r / rep, r / rep + 1]).collect())
    }
}

/// The shard a view of `role` holds in `mode`, as the memory plan lays
/// it out: EP holds whole tensors and its own experts; TP holds head blocks
/// of the head-sharded projections (rows; `o_proj`'s columns), every
/// expert's `1/P` of the intermediate dimension, and the rest whole.
/// How `part` of `role` is laid out in `mode`: a bias follows its weight's
/// rows (o_proj's, one per output column of the whole projection, stays
/// whole: TP adds it once).
pub fn expected_shard(role: TensorRole, part: TensorPart, mode: Mode) -> Shard {
    use TensorRole::*;
    let heads = |dim, heads| Shard::Heads { dim, heads };
    match (mode, role) {
        (Mode::Tp, OProj) if part == TensorPart::Bias => Shard::Full,
        (Mode::Ep, ExpertsW13 | ExpertsW2) => Shard::LocalExperts,
        (Mode::Tp, ExpertsW13) => Shard::ExpertShard { dim: 1 },
        (Mode::Tp, ExpertsW2) => Shard::ExpertShard { dim: 2 },
        (Mode::Ep, _) => Shard::Full,
        (Mode::Tp, QProj | QBProj | KvBProj | Sinks) => heads(0, HeadSet::Query),
        (Mode::Tp, KProj | VProj) => heads(0, HeadSet::Kv),
        (Mode::Tp, OProj) => heads(1, HeadSet::Query),
        (Mode::Tp, _) => Shard::Full,
    }
}

/// Query heads `[begin, end)` of rank `r` under TP with `p` ranks.
pub fn head_block(heads: u32, p: u32, r: u32) -> [u32; 2] {
    let n = heads / p.max(1);
    [r * n, (r + 1) * n]
}

pub fn align(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

#[cfg(test)]
mod tests {
    use super::{RouteIndexParts, ZeppRouteParts};

    /// The routing's per-entry slots start 16-byte aligned past the work
    /// area (a fixed-slot dispatch copies a token's `4 × top-k` bytes of them
    /// with the ids rows' 16-byte pieces), whatever the sizes that come
    /// before them: `4·W·E` demand, `4·W` member and the work words.
    #[test]
    fn the_routings_slots_are_16_byte_aligned_after_its_work_area() {
        for world in [1u64, 2, 3, 5, 8, 24, 32] {
            for experts in [2u64, 7, 16, 61, 256, 384] {
                for reps in [1u64, 2, 3, 4] {
                    let p = ZeppRouteParts::of(world, experts, reps, 8192 * 8);
                    assert!(p.dest.is_multiple_of(16), "{world} × {experts} × {reps}: {p:?}");
                    assert!(p.dest > p.bounds && p.bounds > p.work);
                    assert!(p.work >= p.member + 4 * world && p.member >= 4 * world * experts);
                    assert_eq!(p.bytes, p.dest + 4 * 8192 * 8);
                }
            }
        }
    }

    /// The overflow word lies after the last offset and before the first
    /// map, for every expert count and slice size (against the layout's
    /// byte arithmetic spelled out: 4·E counts, 4·(E + 1) offsets).
    #[test]
    fn the_overflow_word_fits_the_alignment_gap() {
        for experts in 1..=1024u64 {
            for bytes in [0, 4096, 1 << 20, 12 * 4 * 1000 + 7] {
                let p = RouteIndexParts::of(bytes, experts);
                assert_eq!(p.overflow, 4 * experts + 4 * (experts + 1));
                assert!(p.overflow + 4 <= p.row_entry && p.row_entry.is_multiple_of(16), "{experts} experts: {p:?}");
            }
        }
    }
}
