//! The per-rank program of one forward step: a small dataflow graph of ops
//! on named streams, ordered by events, over fixed plan addresses.
//!
//! A [`Program`] is what one role's ranks launch for one step of one
//! [`Mode`] and [`Phase`]. Its [`Block`]s run in order: the prologue
//! (embedding), one body per run of layers (dense or MoE), the epilogue
//! (final norm, LM head, sampling); a body with `layers = [a, b)` is issued
//! once per layer. Ops are issued in program order; each runs on its stream
//! after the ops before it on that stream and after the latest record of
//! every event it waits on (CUDA stream and event semantics). This is what
//! lets a program state the papers' overlaps:
//!
//! - prefill's two-batch overlap (TBO): the step's tokens split into two
//!   micro-batches, and one micro-batch's dispatch and combine run on the
//!   `comm` stream while the other's attention or experts run on `compute`;
//! - decode's single-batch overlap (SBO): the shared experts run on their
//!   own stream while the routed experts' dispatch, experts and combine run;
//! - WaitDone as a wait on the combine's event.
//!
//! Every operand is a plan address: a weight view of the program's mode
//! (of the body's current layer), a workspace [`crate::memory::Buffer`] (the
//! micro-batch's equal share of its rows when the op names one), or the
//! layer's KV pages. Nothing is allocated at run time. Communication ops
//! state what they move, between which ranks, from which buffer into which.
//!
//! [`check`] is the program's verifier, run by the plan validator: every
//! operand resolves in the memory plan, every kernel in the plan's
//! instances, every wait follows a record, no buffer is read before the step
//! writes it, and no two ops on different streams touch the same buffer
//! slice (one of them writing) without a happens-before path between them.
//! It unrolls the step layer by layer and tracks happens-before with one
//! vector clock per stream, independently of how the compiler built the
//! program.

use crate::memory::{BufferName, MemoryPlan, Mode, TensorPart, TensorRole};
use crate::plan::{KernelInstance, KernelParams};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What a program's ranks do in the deployment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Attention and a share of the experts on every rank (colocated plans,
    /// and each whole-model instance of a PD plan).
    Colocated,
    /// An ExpertPlex attention server of the program's phase (a prefill
    /// server's prefill, a decode server's decode): embedding, attention,
    /// the router, shared experts, the head; its routed rows go to the MoE
    /// servers and their outputs come back through the same communication
    /// ops the MoE servers' programs issue.
    Attention,
    /// An ExpertPlex MoE server's side of the phase's MoE layers: what the
    /// attention servers dispatch, permuted through the APK, and published
    /// for their combine. It issues only the MoE layers' ops.
    Moe,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Prefill,
    Decode,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
        }
    }
}

/// How a phase's layers overlap communication with computation (ExpertPlex
/// §2.3, §6.3): what a program expresses, what the cost model times and
/// what the layout search chooses per phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// Two micro-batches: one's communication under the other's compute.
    Tbo,
    /// Shared experts beside the routed experts' dispatch, compute and combine.
    Sbo,
    /// One stream of work (nothing to overlap).
    None,
}

impl Overlap {
    pub fn name(self) -> &'static str {
        match self {
            Overlap::Tbo => "tbo",
            Overlap::Sbo => "sbo",
            Overlap::None => "none",
        }
    }
}

/// Each phase's overlap strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Overlaps {
    pub prefill: Overlap,
    pub decode: Overlap,
}

impl Overlaps {
    /// TBO for prefill, SBO for decode: what the colocated programs and the
    /// baselines run (SGLang's two-batch overlap for prefill, DeepEP
    /// low-latency decode beside the shared experts), and what the layout
    /// search assumed before it chose.
    pub const STANDARD: Overlaps = Overlaps { prefill: Overlap::Tbo, decode: Overlap::Sbo };
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Program {
    pub role: Role,
    pub mode: Mode,
    pub phase: Phase,
    /// The ranks that run this program.
    pub ranks: Vec<u32>,
    pub overlap: Overlap,
    /// Micro-batches the step's tokens split into (op `micro_batch` indices
    /// are below it; micro-batch m of M uses the m-th of M equal row ranges
    /// of every buffer it names).
    pub micro_batches: u32,
    /// Stream names; an op's `stream` indexes this list.
    pub streams: Vec<String>,
    /// Event names; an op's `waits` and `record` index this list.
    pub events: Vec<String>,
    pub blocks: Vec<Block>,
}

/// What a block computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockKind {
    /// Once per step, before the layers.
    Prologue,
    /// A layer with a dense FFN.
    Dense,
    /// A layer with routed experts.
    Moe,
    /// Once per step, after the layers.
    Epilogue,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Block {
    pub kind: BlockKind,
    /// `[first, end)` model layers this body is issued for, in order;
    /// absent for the prologue and the epilogue.
    pub layers: Option<[u32; 2]>,
    pub ops: Vec<Op>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Op {
    pub name: String,
    pub kind: OpKind,
    pub stream: u32,
    /// The micro-batch whose rows this op touches; absent: every row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch: Option<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waits: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<u32>,
    pub reads: Vec<Operand>,
    pub writes: Vec<Operand>,
    pub kernel: KernelRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm: Option<Comm>,
    /// A GEMM op's shape and epilogue: what its launch posts to the dense APK.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm: Option<GemmArgs>,
    /// A launched entry's arguments, in its parameter order (the APK's
    /// entries take its templates and state instead: `gemm` and the posted
    /// counts say what they run).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<Arg>,
    /// The launch's grid where it is not the entry's (the final norm over
    /// the sampled rows, EP's combine over the received rows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grid: Option<crate::plan::Grid>,
}

/// One argument of a launch: what a backend passes for the entry's
/// parameter at the same position (the `void**` of `cuLaunchKernel`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "arg", rename_all = "snake_case")]
pub enum Arg {
    /// The address of one of the op's operands plus `at` bytes: a weight
    /// view of the current layer, a buffer's slice for the op's micro-batch,
    /// or the KV pool (kernels index its pages by `layer`).
    Ptr {
        operand: Operand,
        #[serde(default, skip_serializing_if = "is_zero")]
        at: u64,
    },
    /// A null pointer (an optional input the op does not have).
    Null,
    /// A count known when the step is issued (of the op's micro-batch).
    Count {
        var: crate::plan::GridVar,
    },
    /// An integer constant (`int` or `long long`).
    Int {
        value: i64,
    },
    Float {
        value: f32,
    },
    /// The model layer the body is issued for.
    Layer,
    /// One integer per rank of the world, indexed by rank (a TP rank's
    /// first head, an EP rank's first expert).
    PerRank {
        values: Vec<i64>,
    },
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

/// A parameter's C type as the verifier reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CType {
    Ptr {
        mutable: bool,
        elem: Elem,
    },
    I32,
    I64,
    F32,
    /// Anything else (the APK's `__grid_constant__` templates).
    Other,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Elem {
    Bf16,
    F32,
    I32,
    Bytes,
    Vector,
}

/// Reads `type name` (an `EntryPoint` parameter).
fn ctype(param: &str) -> CType {
    let ty = param.rsplit_once(' ').map_or(param, |(t, _)| t).trim();
    if let Some(base) = ty.strip_suffix('*') {
        let base = base.trim();
        let (mutable, base) = match base.strip_prefix("const ") {
            Some(b) => (false, b.trim()),
            None => (true, base),
        };
        let elem = match base {
            "__nv_bfloat16" => Elem::Bf16,
            "float" => Elem::F32,
            "int32_t" | "int" => Elem::I32,
            "uint8_t" => Elem::Bytes,
            "uint4" | "float4" => Elem::Vector,
            _ => return CType::Other,
        };
        return CType::Ptr { mutable, elem };
    }
    match ty {
        "int" | "int32_t" => CType::I32,
        "long long" | "int64_t" => CType::I64,
        "float" => CType::F32,
        _ => CType::Other,
    }
}

/// Whether `arg` can be passed for `param` by op `op`; the reason if not.
fn arg_fits(arg: &Arg, param: &str, op: &Op, mode: Mode, mem: &MemoryPlan, m: u32, world: u32) -> Result<(), String> {
    use moeforge_dsl::spec::DType;
    let fits_i32 = |v: i64| i32::try_from(v).is_ok();
    match (ctype(param), arg) {
        (CType::Ptr { .. }, Arg::Null) => Ok(()),
        (CType::Ptr { mutable, elem }, Arg::Ptr { operand, at }) => {
            let listed = if mutable { op.writes.contains(operand) } else { op.reads.contains(operand) };
            if !listed {
                let dir = if mutable { "writes" } else { "reads" };
                return Err(format!("`{param}` gets {operand:?}, which the op does not list in its {dir}"));
            }
            match *operand {
                Operand::Weight { role, part } => {
                    let v = mem.view(mode, role, part).ok_or_else(|| format!("no view of {}", role.name(part)))?;
                    let ok = matches!(
                        (elem, v.dtype),
                        (Elem::Bf16, DType::Bf16) | (Elem::F32, DType::F32) | (Elem::Bytes, DType::Fp8E4m3)
                    );
                    if !ok || *at != 0 {
                        return Err(format!("`{param}` gets {} ({}) at byte {at}", v.tensor, v.dtype.name()));
                    }
                }
                Operand::Buffer { name } => {
                    let b = mem.buffer(mode, name).ok_or_else(|| format!("no buffer {name:?}"))?;
                    let align = if elem == Elem::Vector { 16 } else { 4 };
                    if *at % align != 0 || *at >= b.slice_bytes(m) {
                        return Err(format!(
                            "`{param}` at byte {at} of a {}-byte slice of {name:?}, or off its {align}-byte alignment",
                            b.slice_bytes(m)
                        ));
                    }
                }
                Operand::Kv => {
                    if elem != Elem::Bytes || *at != 0 {
                        return Err(format!("`{param}` gets the KV pool, which is addressed as bytes from its base"));
                    }
                }
            }
            Ok(())
        }
        (CType::I32, Arg::Count { .. } | Arg::Layer) => Ok(()),
        (CType::I32, Arg::Int { value }) if fits_i32(*value) => Ok(()),
        (CType::I64, Arg::Int { .. }) => Ok(()),
        (CType::I32 | CType::I64, Arg::PerRank { values }) => {
            if values.len() != world as usize || (ctype(param) == CType::I32 && !values.iter().all(|v| fits_i32(*v))) {
                return Err(format!("`{param}` gets {} per-rank values for a world of {world}", values.len()));
            }
            Ok(())
        }
        (CType::F32, Arg::Float { value }) if value.is_finite() => Ok(()),
        (t, a) => Err(format!("`{param}` ({t:?}) cannot take {a:?}")),
    }
}

/// One GEMM of the dense APK form: `y = x·Wᵀ` over rows of the op's first
/// read buffer (`x`, bf16) into its first written buffer (`y`), W the op's
/// weight reads back to back (`[n][k]`; SwiGLU: gate then up, `[2n][k]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GemmArgs {
    /// Output columns (SwiGLU: intermediate columns) and reduction depth.
    pub n: u32,
    pub k: u32,
    /// First column of x within its buffer's row, and of y within its buffer's (elements).
    pub x_col: u32,
    pub y_col: u32,
    /// Which rows: the step's tokens, or the sampled rows (the LM head).
    pub rows: crate::plan::GridVar,
    pub epilogue: Epilogue,
}

/// How a GEMM writes its outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Epilogue {
    /// bf16 outputs.
    StoreBf16,
    /// f32 outputs (logits, router logits, TP's partial sums).
    StoreF32,
    /// Added into f32 outputs (the residual).
    AddF32,
    /// SiLU(x·W_gateᵀ)·(x·W_upᵀ) as bf16 (dense FFNs and shared experts).
    SwiGlu,
}

impl Epilogue {
    /// Bytes of one output element.
    pub fn out_bytes(self) -> u64 {
        match self {
            Epilogue::StoreF32 | Epilogue::AddF32 => 4,
            Epilogue::StoreBf16 | Epilogue::SwiGlu => 2,
        }
    }
    /// The value the kernel's `DenseShape::epilogue` takes.
    pub fn code(self) -> u32 {
        match self {
            Epilogue::StoreBf16 => 0,
            Epilogue::StoreF32 => 1,
            Epilogue::AddF32 => 2,
            Epilogue::SwiGlu => 3,
        }
    }
}

/// What an op does (its kernel's contract).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum OpKind {
    Embedding,
    /// RMSNorm of the residual into `normed`; `add` first adds the
    /// residual delta the op reads (fused residual add).
    RmsNorm {
        add: bool,
    },
    /// A dense GEMM (one-group APK): a projection, the router or LM head,
    /// or half of a dense FFN; its [`GemmArgs`] say which.
    Gemm,
    /// QK-norm per head, or over all heads (MiniMax-M2); `partial` reads
    /// the all-reduced sums of squares instead of computing them locally.
    QkNorm {
        all_heads: bool,
        partial: bool,
    },
    /// This rank's partial sums of squares for an all-head QK-norm under TP.
    QkSumSq,
    /// LayerNorm with weight and bias, in place (the DSA indexer's key).
    LayerNorm,
    Rope {
        variant: RopeVariant,
    },
    /// Writes k and v (MLA: the latent and the rope key; DSA: the indexer
    /// key too) into the layer's KV pages at the slot map's slots.
    KvWrite,
    /// DSA's lightning indexer: scores every cached key, keeps `top_k`.
    Indexer {
        top_k: u32,
    },
    Attention {
        kind: AttentionKind,
        phase: Phase,
    },
    /// Router logits → top-k ids and weights.
    Route,
    /// Counts, offsets and the row ↔ entry maps of the expert-contiguous layout.
    Permute,
    /// Gathers token rows into the expert-contiguous layout.
    Gather,
    /// GateUp → activation → Down over the routed experts (the APK).
    Experts,
    /// The weighted sum of each token's expert rows.
    CombineRows,
    /// Adds the MoE (and shared-expert) output into the residual.
    ResidualAdd,
    /// Samples one token per sampled row (greedy, or temperature/top-p from
    /// the request's seeded generator).
    Sample,
    Comm,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeVariant {
    /// Rotate-half over the first `rope_dim` dims of each head (partial when
    /// `rope_dim < head_dim`).
    Standard,
    /// DeepSeek's interleaved pairs on MLA's rope dims.
    Interleaved,
    /// Either form with YaRN-scaled frequencies and attention factor.
    YarnStandard,
    YarnInterleaved,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKind {
    Gqa,
    /// GQA with per-head sinks.
    GqaSinks,
    /// MLA: weight-absorbed over the latent cache, in both phases.
    Mla,
    /// MLA over the indexer's top-k keys (DeepSeek Sparse Attention).
    MlaSparse,
}

/// A plan address an op reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Operand {
    /// The program mode's view of a weight (of the body's current layer
    /// when the tensor is per layer).
    Weight { role: TensorRole, part: TensorPart },
    /// A workspace buffer (the op's micro-batch's rows when it has one).
    Buffer { name: BufferName },
    /// The current layer's pages of the KV pool.
    Kv,
}

/// The code an op runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum KernelRef {
    /// An entry of one of the bundle's kernel instances, launched with its
    /// grid and block.
    Launch { instance: String, entry: String },
    /// Work posted to a running persistent kernel (the APK): its state
    /// words, not a launch.
    Post { instance: String },
    /// A collective or one-sided transfer run by the communication engine.
    Transfer,
    /// A kernel family the op needs that this bundle does not emit yet.
    Missing { family: String },
    /// Nothing to run on these ranks (a rank holding no routed experts
    /// computes none; its dispatch and combine still run).
    Skip { reason: String },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CommKind {
    /// Sum over the group; every rank ends with the total.
    AllReduce,
    /// Each rank sends each row to the ranks owning its experts (dispatch),
    /// or returns rows to their sources (combine), where the rows from all
    /// owners of a token are summed in f32 into `to` on arrival.
    AllToAll,
}

/// What a communication op moves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Comm {
    pub kind: CommKind,
    /// The participating ranks.
    pub group: Vec<u32>,
    /// From this buffer on each rank into `to` on the receivers.
    pub from: BufferName,
    pub to: BufferName,
    /// Buffers that travel row for row with `from` (`[from, to]`: the
    /// dispatch's top-k ids and weights).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub with: Vec<[BufferName; 2]>,
    /// Bytes a rank sends per row, every buffer together.
    pub row_bytes: u64,
    /// A dispatch or combine that crosses nodes through relays (ExpertPlex
    /// §5's hierarchical prefill path, Zepp's merge). Each other node's
    /// relay for a source is that node's GPU with the source's local rank.
    /// - Dispatch: a token's row (with its `with` rows) crosses the
    ///   scale-out link once per other node that needs it, into the relay's
    ///   `via` rows (its own receive rows: a row it serves no entry of
    ///   carries ids no expert of its matches), and the relay forwards it
    ///   over NVLink to the node's other GPUs that need it. The source
    ///   node's sends are split over its NICs (Zepp §4.2): a GPU above
    ///   ⌈the node's sends / its GPUs⌉ hands its excess sends over NVLink
    ///   to the least-loaded GPUs of its node below that share.
    /// - Combine: the relay sums the token's rows computed on its node
    ///   (NVLink) into its `via` rows, and the one pre-reduced row crosses
    ///   the scale-out link.
    ///
    /// Rows on the source's own node move directly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay: Option<Relay>,
}

/// Where a relayed combine's node-local partial sums go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Relay {
    /// GPUs per node: rank r is local rank r mod this on node r / this.
    pub gpus_per_node: u32,
    /// The relay's buffer its partial rows go to (rows of `from`'s width,
    /// one per relayed (source, token)): the dispatch's receive rows, dead
    /// once the experts read them.
    pub via: BufferName,
}

impl Comm {
    /// Every `[from, to]` pair the op moves.
    pub fn moves(&self) -> impl Iterator<Item = [BufferName; 2]> + '_ {
        std::iter::once([self.from, self.to]).chain(self.with.iter().copied())
    }
}

/// The kernel entries an op of `kind` may launch: the contract of each
/// entry is the op's (a norm op launching the sampler is refused).
pub fn entries_for(kind: OpKind) -> &'static [&'static str] {
    match kind {
        OpKind::Embedding => &["embed_rows"],
        OpKind::RmsNorm { add: false } => &["rms_norm", "latent_norm"],
        OpKind::RmsNorm { add: true } => &["add_rms_norm"],
        OpKind::QkNorm { .. } => &["qk_norm"],
        OpKind::QkSumSq => &["qk_sumsq"],
        OpKind::LayerNorm => &["indexer_key_norm"],
        OpKind::Rope { .. } => &["rope", "mla_rope"],
        OpKind::KvWrite => &["kv_write", "mla_kv_write"],
        OpKind::Attention { kind: AttentionKind::Gqa | AttentionKind::GqaSinks, .. } => {
            &["paged_attention", "flash_prefill"]
        }
        OpKind::Attention { kind: AttentionKind::Mla, .. } => &["mla_attention"],
        OpKind::Attention { kind: AttentionKind::MlaSparse, .. } => &["mla_sparse_attention"],
        OpKind::Route => &["moe_router"],
        OpKind::Permute => &["moe_count", "moe_offsets", "moe_scatter"],
        OpKind::Gather => &["moe_gather"],
        OpKind::CombineRows => &["moe_combine", "moe_combine_f32"],
        OpKind::ResidualAdd => &["residual_add"],
        OpKind::Sample => &["sample_tokens"],
        OpKind::Gemm => &["apk_dense", "apk_dense_fp8"],
        OpKind::Experts => &["moe_apk"],
        OpKind::Indexer { .. } => &["dsa_indexer"],
        OpKind::Comm => &[],
    }
}

/// A GEMM's shape against its operands: x and y (the first buffer read and
/// written) hold the columns it reads and writes at the kernel's alignment,
/// and its weight reads are one bf16 `[n][k]` matrix (SwiGLU: `[2n][k]`),
/// back to back in every layer.
pub fn gemm_fits(op: &Op, g: &GemmArgs, mode: Mode, mem: &MemoryPlan) -> Result<(), String> {
    use crate::plan::GridVar;
    let first = |list: &[Operand]| {
        list.iter().find_map(|o| match o {
            Operand::Buffer { name } => Some(*name),
            _ => None,
        })
    };
    let (Some(xn), Some(yn)) = (first(&op.reads), first(&op.writes)) else {
        return Err("a GEMM reads an input buffer and writes an output buffer".into());
    };
    let (Some(x), Some(y)) = (mem.buffer(mode, xn), mem.buffer(mode, yn)) else {
        return Err(format!("no {} buffers {xn:?} and {yn:?}", mode.name()));
    };
    let (n, k, xc, yc) = (u64::from(g.n), u64::from(g.k), u64::from(g.x_col), u64::from(g.y_col));
    let eb = g.epilogue.out_bytes();
    let (ld_x, ld_y) = (x.row_bytes / 2, y.row_bytes / eb);
    if n == 0 || k == 0 || k % 8 != 0 || xc % 8 != 0 || x.row_bytes % 16 != 0 || xc + k > ld_x {
        return Err(format!(
            "k = {k} columns from column {xc} of {xn:?} ({ld_x} per row): k and the first column must be multiples of 8 within the row"
        ));
    }
    if n % 2 != 0 || yc % 2 != 0 || y.row_bytes % (2 * eb) != 0 || yc + n > ld_y {
        return Err(format!(
            "n = {n} columns from column {yc} of {yn:?} ({ld_y} per row): the epilogue writes pairs within the row"
        ));
    }
    if g.epilogue == Epilogue::AddF32 && !op.reads.contains(&Operand::Buffer { name: yn }) {
        return Err(format!("it adds into {yn:?} without reading it"));
    }
    // In place (MLA's q_b and kv_b read and write the Qkv row): the columns
    // it reads and those it writes are disjoint.
    if xn == yn && xc * 2 < (yc + n) * eb && yc * eb < (xc + k) * 2 {
        return Err(format!("it writes columns {yc}..{} of {yn:?} while reading {xc}..{}", yc + n, xc + k));
    }
    if !matches!(g.rows, GridVar::Tokens | GridVar::SampledRows) {
        return Err(format!("rows {:?}: a GEMM runs over the tokens or the sampled rows", g.rows));
    }
    let views: Vec<_> = op
        .reads
        .iter()
        .filter_map(|o| match *o {
            Operand::Weight { role, part: TensorPart::Weight } => mem.view(mode, role, TensorPart::Weight),
            _ => None,
        })
        .collect();
    let rows: u64 = views.iter().map(|v| v.shape.first().copied().unwrap_or(0)).sum();
    let want = if g.epilogue == Epilogue::SwiGlu { 2 * n } else { n };
    // SwiGLU: the gate rows, then as many up rows.
    let split_ok = g.epilogue != Epilogue::SwiGlu
        || (views.len() == 2 && views.iter().all(|v| v.shape.first().copied() == Some(n)));
    use moeforge_dsl::spec::DType;
    let dtype = views.first().map_or(DType::Bf16, |v| v.dtype);
    let fp8 = dtype == DType::Fp8E4m3;
    if views.is_empty()
        || !split_ok
        || rows != want
        || !matches!(dtype, DType::Bf16 | DType::Fp8E4m3)
        || views.iter().any(|v| v.shape.len() != 2 || v.shape[1] != k || v.dtype != dtype)
    {
        return Err(format!("its weights are not one bf16 or fp8 [{want}][{k}] matrix"));
    }
    back_to_back(&views)?;
    if fp8 {
        // W8A16: 16-byte rows of fp8 codes, and one f32 scale per 128×128
        // block of the whole matrix: the parts' scales back to back, each
        // part but the last a whole number of block rows.
        let scales: Vec<_> = views.iter().filter_map(|v| mem.view(mode, v.role, TensorPart::ScaleInv)).collect();
        let blocks = |r: u64| r.div_ceil(FP8_BLOCK);
        if k % 16 != 0 {
            return Err(format!("k = {k}: fp8 weight rows must be whole 16-byte vectors"));
        }
        if scales.len() != views.len()
            || views.iter().zip(&scales).any(|(v, s)| s.shape != [blocks(v.shape[0]), blocks(k)])
            || views[..views.len() - 1].iter().any(|v| v.shape[0] % FP8_BLOCK != 0)
        {
            return Err(format!(
                "its fp8 parts' {FP8_BLOCK}×{FP8_BLOCK} block scales do not tile one [{want}][{k}] matrix"
            ));
        }
        back_to_back(&scales)?;
        let read = op.reads.iter().filter(|o| matches!(o, Operand::Weight { part: TensorPart::ScaleInv, .. })).count();
        if read != scales.len() {
            return Err("it does not read every part's block scales".into());
        }
    }
    // Biases: none, or one bf16 value per output row of every part, back to
    // back (the epilogue reads one vector of the whole matrix), all read.
    let biases: Vec<_> = views.iter().filter_map(|v| mem.view(mode, v.role, TensorPart::Bias)).collect();
    if !biases.is_empty() {
        if biases.len() != views.len()
            || views.iter().zip(&biases).any(|(v, b)| b.shape != [v.shape[0]] || b.dtype != DType::Bf16)
        {
            return Err(format!("its biases are not one bf16 vector of {want} values"));
        }
        back_to_back(&biases)?;
        let read = op.reads.iter().filter(|o| matches!(o, Operand::Weight { part: TensorPart::Bias, .. })).count();
        if read != biases.len() {
            return Err("it does not read every part's bias".into());
        }
    }
    Ok(())
}

/// The block of fp8 weights' scales (rows and columns), as the Hub's
/// checkpoints and the APK's dequantization use them.
pub const FP8_BLOCK: u64 = 128;

/// Views that lie back to back (one matrix, as the dense APK reads it).
fn back_to_back(views: &[&crate::memory::View]) -> Result<(), String> {
    for w in views.windows(2) {
        let packed = w[1].region == w[0].region
            && w[1].offset == w[0].offset + w[0].bytes()
            && w[1].layers == w[0].layers
            && w[1].layer_stride == w[0].layer_stride;
        if !packed {
            return Err(format!("{} does not follow {} back to back", w[1].tensor, w[0].tensor));
        }
    }
    Ok(())
}

/// A launch's arguments against its entry's parameters: one per parameter,
/// each of the parameter's type, every pointer to an operand the op lists
/// (read-only pointers among its reads, writable ones among its writes),
/// and every buffer, weight and KV operand the op lists passed to the
/// kernel. An APK entry takes its templates and state: no flat arguments.
fn check_args(op: &Op, ep: &crate::plan::EntryPoint, mode: Mode, mem: &MemoryPlan, m: u32, world: u32) -> Vec<Finding> {
    let mut out = Vec::new();
    if ep.params.iter().any(|p| ctype(p) == CType::Other) {
        if !op.args.is_empty() {
            out.push((
                "args".into(),
                format!("`{}` takes the APK's templates and state, not flat arguments", ep.symbol),
            ));
        }
        return out;
    }
    if op.args.len() != ep.params.len() {
        out.push((
            "args".into(),
            format!("{} arguments for `{}`'s {} parameters {:?}", op.args.len(), ep.symbol, ep.params.len(), ep.params),
        ));
        return out;
    }
    for (k, (a, param)) in op.args.iter().zip(&ep.params).enumerate() {
        if let Err(why) = arg_fits(a, param, op, mode, mem, m, world) {
            out.push((format!("args[{k}]"), why));
        }
    }
    for o in op.reads.iter().chain(&op.writes) {
        if !op.args.iter().any(|a| matches!(a, Arg::Ptr { operand, .. } if operand == o)) {
            out.push(("args".into(), format!("the op lists {o:?} but passes no pointer to it")));
        }
    }
    match op.grid {
        None
        | Some(crate::plan::Grid::Per { .. } | crate::plan::Grid::Fixed { .. } | crate::plan::Grid::Tiles { .. }) => {}
        Some(g) => out.push(("grid".into(), format!("a launch's own grid is fixed or per count, not {g}"))),
    }
    out
}

/// Host inputs: written before the step, so read without a prior op.
pub fn is_step_input(b: BufferName) -> bool {
    use BufferName::*;
    matches!(b, TokenIds | Positions | SlotMap | RequestMeta | RowRequest | SampleRows | StepCounts)
}

/// A finding of [`check`]: the `plan.json` field and what is wrong.
pub type Finding = (String, String);

/// Most findings reported per program (the first ones locate the fault).
const MAX_FINDINGS: usize = 8;

/// One access of a buffer slice in the unrolled step.
#[derive(Clone, Copy)]
struct Access {
    stream: usize,
    /// The stream's clock when the access ran.
    clock: u64,
    slice: Option<u32>,
    write: bool,
    at: (usize, usize, u32),
}

fn overlaps(a: Option<u32>, b: Option<u32>) -> bool {
    match (a, b) {
        (Some(x), Some(y)) => x == y,
        _ => true,
    }
}

/// A relayed dispatch or combine: its group spans whole nodes, more than
/// one, so every (source, node) pair has its relay in the group; the op
/// writes the relay rows, the dispatch's receive rows. A dispatch lands
/// its relayed rows there (its `to`); a combine's partial sums go there
/// (dead once the permutation read them, and sliced like the combine's),
/// as wide as its `from`.
fn relay_fits(c: &Comm, r: &Relay, op: &Op, mem: &MemoryPlan, mode: Mode) -> Result<(), String> {
    let g = r.gpus_per_node;
    if c.kind != CommKind::AllToAll {
        return Err("only a dispatch or a combine is relayed".into());
    }
    let dispatch = !c.with.is_empty();
    if dispatch && c.to != r.via {
        return Err(format!("a relayed dispatch lands its rows in its own {:?}, not {:?}", c.to, r.via));
    }
    if g == 0 {
        return Err("0 GPUs per node".into());
    }
    if r.via != BufferName::Dispatch {
        return Err(format!("relay rows in {:?}: a relay sums into the dispatch's receive rows", r.via));
    }
    let nodes: std::collections::BTreeSet<u32> = c.group.iter().map(|x| x / g).collect();
    let member = |n: u32, l: u32| n.checked_mul(g).and_then(|x| x.checked_add(l)).is_some_and(|x| c.group.contains(&x));
    let whole = nodes.iter().all(|&n| (0..g).all(|l| member(n, l)));
    if nodes.len() < 2 || !whole {
        return Err(format!("group {:?} is not two or more whole nodes of {g} GPUs", c.group));
    }
    if !op.writes.contains(&Operand::Buffer { name: r.via }) {
        return Err(format!("the op does not write its relay rows ({:?})", r.via));
    }
    let row = |b| mem.buffer(mode, b).map(|b| b.row_bytes);
    if row(r.via).is_none() || !dispatch && row(r.via) != row(c.from) {
        return Err(format!("relay rows {:?} are not {:?}'s width", r.via, c.from));
    }
    Ok(())
}

fn covers(w: Option<u32>, a: Option<u32>) -> bool {
    w.is_none() || w == a
}

/// Verifies program `pi` of a plan against its memory plan, kernels and
/// world size (see the module documentation).
/// Most streams and events a program may name (the compiler emits at most
/// four streams and a dozen events per program).
pub const MAX_STREAMS: usize = 16;
pub const MAX_EVENTS: usize = 1024;

pub fn check(
    pi: usize,
    p: &Program,
    mem: &MemoryPlan,
    kernels: &[KernelInstance],
    world: u32,
    layers: u32,
) -> Vec<Finding> {
    let mut out: Vec<Finding> = Vec::new();
    let at = |b: usize, o: usize| format!("programs[{pi}].blocks[{b}].ops[{o}]");
    let ns = p.streams.len();
    if ns == 0 {
        out.push((format!("programs[{pi}].streams"), "a program needs a stream".into()));
        return out;
    }
    // The happens-before check keeps a vector clock per stream and a
    // snapshot per event: bounded here, since a file may list any number.
    if ns > MAX_STREAMS || p.events.len() > MAX_EVENTS {
        out.push((
            format!("programs[{pi}].streams"),
            format!(
                "{ns} streams and {} events; a program has at most {MAX_STREAMS} and {MAX_EVENTS} (the compiler \
                 emits a handful)",
                p.events.len()
            ),
        ));
        return out;
    }
    if p.micro_batches == 0 {
        out.push((format!("programs[{pi}].micro_batches"), "at least one micro-batch".into()));
        return out;
    }
    if !mem.modes.contains(&p.mode) {
        out.push((format!("programs[{pi}].mode"), format!("the memory plan holds no {} views", p.mode.name())));
        return out;
    }
    for r in &p.ranks {
        if *r >= world {
            out.push((format!("programs[{pi}].ranks"), format!("rank {r} of a world of {world}")));
        }
    }
    // The blocks: prologue, bodies tiling [0, layers) in order, epilogue.
    let mut next = 0u32;
    for (bi, b) in p.blocks.iter().enumerate() {
        let field = format!("programs[{pi}].blocks[{bi}]");
        match (b.kind, b.layers) {
            (BlockKind::Prologue, None) if bi == 0 => {}
            (BlockKind::Epilogue, None) if bi + 1 == p.blocks.len() && next == layers => {}
            (BlockKind::Dense | BlockKind::Moe, Some([a, e])) if a == next && a < e && e <= layers => next = e,
            _ => out.push((
                field,
                format!(
                    "{:?} block with layers {:?} out of order (layers {next}.. of {layers} come next)",
                    b.kind, b.layers
                ),
            )),
        }
    }
    if p.blocks.len() < 2 || next != layers {
        out.push((format!("programs[{pi}].blocks"), format!("the bodies cover layers [0, {next}) of {layers}")));
    }
    if !out.is_empty() {
        return out;
    }

    // Static checks of every op.
    for (bi, b) in p.blocks.iter().enumerate() {
        let layer_range = b.layers.map_or(0..1, |[a, e]| a..e);
        for (oi, op) in b.ops.iter().enumerate() {
            let f = at(bi, oi);
            if op.stream as usize >= ns {
                out.push((format!("{f}.stream"), format!("stream {} of {ns}", op.stream)));
            }
            if op.micro_batch.is_some_and(|m| m >= p.micro_batches) {
                out.push((
                    format!("{f}.micro_batch"),
                    format!("micro-batch {:?} of {}", op.micro_batch, p.micro_batches),
                ));
            }
            for e in op.waits.iter().chain(op.record.iter()) {
                if *e as usize >= p.events.len() {
                    out.push((format!("{f}.waits"), format!("event {e} of {}", p.events.len())));
                }
            }
            for (dir, list) in [("reads", &op.reads), ("writes", &op.writes)] {
                for (k, o) in list.iter().enumerate() {
                    let field = format!("{f}.{dir}[{k}]");
                    match *o {
                        Operand::Weight { role, part } => {
                            if dir == "writes" {
                                out.push((field, format!("writes weight {}", role.name(part))));
                            } else if let Some(v) = mem.view(p.mode, role, part) {
                                if b.layers.is_some() != role.per_layer()
                                    || !layer_range.clone().all(|l| v.covers(l) || !role.per_layer())
                                {
                                    out.push((
                                        field,
                                        format!("view {} does not cover layers {:?}", v.tensor, b.layers),
                                    ));
                                }
                            } else {
                                out.push((field, format!("no {} view of {}", p.mode.name(), role.name(part))));
                            }
                        }
                        Operand::Buffer { name } => {
                            if mem.buffer(p.mode, name).is_none() {
                                out.push((field, format!("no {} buffer {name:?} in the memory plan", p.mode.name())));
                            }
                        }
                        Operand::Kv => {
                            let pages = match (p.mode, &mem.kv.tp) {
                                (Mode::Tp, Some(tp)) => tp.pages,
                                (Mode::Tp, None) => 0,
                                (Mode::Ep, _) => mem.kv.ep.pages,
                            };
                            if b.layers.is_none() || pages == 0 {
                                out.push((field, "KV pages outside a layer body, or no KV pool".into()));
                            }
                        }
                    }
                }
            }
            let instance = |name: &str| kernels.iter().find(|k| k.name == name);
            match &op.kernel {
                KernelRef::Launch { instance: i, entry } => {
                    let ep = instance(i).and_then(|k| k.entries.iter().find(|e| &e.symbol == entry));
                    if let Some(ep) = ep {
                        for (field, why) in check_args(op, ep, p.mode, mem, p.micro_batches, world) {
                            out.push((format!("{f}.{field}"), why));
                        }
                    }
                    if ep.is_none() {
                        out.push((format!("{f}.kernel"), format!("no entry `{entry}` in kernel instance `{i}`")));
                    } else if !entries_for(op.kind).contains(&entry.as_str()) {
                        out.push((
                            format!("{f}.kernel"),
                            format!(
                                "a {:?} op cannot launch `{entry}` (it launches one of {:?})",
                                op.kind,
                                entries_for(op.kind)
                            ),
                        ));
                    }
                }
                KernelRef::Post { instance: i } => {
                    let persistent = |k: &KernelInstance| matches!(&k.params, KernelParams::Apk(a) if a.form == crate::plan::ApkForm::Experts);
                    if !instance(i).is_some_and(persistent) {
                        out.push((format!("{f}.kernel"), format!("`{i}` is not a persistent kernel instance")));
                    }
                }
                KernelRef::Transfer | KernelRef::Missing { .. } | KernelRef::Skip { .. } => {}
            }
            if !matches!(op.kernel, KernelRef::Launch { .. }) && (!op.args.is_empty() || op.grid.is_some()) {
                out.push((format!("{f}.args"), "only a launch has arguments and a grid".into()));
            }
            match (&op.comm, op.kind) {
                (Some(c), OpKind::Comm) => {
                    for [from, to] in c.moves() {
                        let reads = op.reads.contains(&Operand::Buffer { name: from });
                        let writes = op.writes.contains(&Operand::Buffer { name: to });
                        // A role program lists its own side of the move: the
                        // sender reads `from`, the receiver writes `to`.
                        let sides = match p.role {
                            Role::Colocated => reads && writes,
                            Role::Attention | Role::Moe => reads || writes,
                        };
                        if !sides || c.row_bytes == 0 || op.kernel != KernelRef::Transfer {
                            out.push((
                                format!("{f}.comm"),
                                format!("moves {from:?} → {to:?} but its operands or kernel say otherwise"),
                            ));
                        }
                    }
                    // Per row: the sum over the moves of the narrower side
                    // (a combine's bf16 rows arrive into f32 sums).
                    let row = |b| mem.buffer(p.mode, b).map(|b| b.row_bytes);
                    let sent: Option<u64> = c.moves().map(|[a, b]| Some(row(a)?.min(row(b)?))).sum();
                    if sent.is_some_and(|s| s != c.row_bytes) {
                        out.push((
                            format!("{f}.comm.row_bytes"),
                            format!("moves {} bytes per row, but its buffers' rows hold {sent:?}", c.row_bytes),
                        ));
                    }
                    let once = c.group.iter().enumerate().all(|(i, r)| !c.group[..i].contains(r));
                    if c.group.is_empty()
                        || c.group.iter().any(|r| *r >= world)
                        || !p.ranks.iter().all(|r| c.group.contains(r))
                        || !once
                    {
                        out.push((
                            format!("{f}.comm.group"),
                            format!(
                                "group {:?} must hold the program's ranks of a world of {world}, each once",
                                c.group
                            ),
                        ));
                    }
                    if let Some(r) = &c.relay {
                        if let Err(why) = relay_fits(c, r, op, mem, p.mode) {
                            out.push((format!("{f}.comm.relay"), why));
                        }
                    }
                }
                (None, OpKind::Comm) | (Some(_), _) => {
                    out.push((format!("{f}.comm"), "a communication op, and only one, states what it moves".into()))
                }
                (None, _) => {}
            }
            let launched = matches!(op.kernel, KernelRef::Launch { .. });
            match (op.kind, &op.gemm) {
                (OpKind::Gemm, Some(g)) => {
                    if let Err(why) = gemm_fits(op, g, p.mode, mem) {
                        out.push((format!("{f}.gemm"), why));
                    }
                }
                (OpKind::Gemm, None) if launched => {
                    out.push((format!("{f}.gemm"), "a launched GEMM states its shape and epilogue".into()))
                }
                (OpKind::Gemm, None) => {}
                (_, Some(_)) => out.push((format!("{f}.gemm"), format!("a {:?} op is no GEMM", op.kind))),
                (_, None) => {}
            }
        }
    }
    if !out.is_empty() {
        out.truncate(MAX_FINDINGS);
        return out;
    }

    // The unrolled step, and per buffer the accesses not yet superseded by
    // an ordered write.
    let (issued, unsatisfied) = unroll(p);
    for (bi, oi, layer, e) in unsatisfied.into_iter().take(MAX_FINDINGS) {
        out.push((
            format!("{} (layer {layer})", at(bi, oi)),
            format!("waits on `{}`, which no earlier op of the step records", p.events[e as usize]),
        ));
    }
    // Resources: the buffers, and each layer's KV pages (read before the
    // step writes them: they hold the requests' cached tokens).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
    enum Res {
        Buf(BufferName),
        Kv(u32),
    }
    let mut history: BTreeMap<Res, Vec<Access>> = BTreeMap::new();
    let mut written: BTreeMap<Res, Vec<Option<u32>>> = BTreeMap::new();
    'step: for is in &issued {
        let (bi, oi, layer) = (is.block, is.op, is.layer);
        let op = &p.blocks[bi].ops[oi];
        let f = || format!("{} (layer {layer})", at(bi, oi));
        let s = is.stream;
        let me = &is.clock;
        let mut touch = |res: Res, write: bool, out: &mut Vec<Finding>| {
            let a = Access { stream: s, clock: me[s], slice: op.micro_batch, write, at: (bi, oi, layer) };
            let name = match res {
                Res::Buf(b) => format!("{b:?}"),
                Res::Kv(l) => format!("the KV pages of layer {l}"),
            };
            if let (false, Res::Buf(b)) = (write, res) {
                if !is_step_input(b) && written.get(&res).map(|v| v.iter().any(|x| covers(*x, a.slice))) != Some(true) {
                    out.push((f(), format!("reads {name} before any op of the step writes it")));
                }
            }
            let h = history.entry(res).or_default();
            for prev in h.iter() {
                let ordered = prev.stream == s || prev.clock <= me[prev.stream];
                if (prev.write || write) && overlaps(prev.slice, a.slice) && !ordered {
                    let (pb, po, pl) = prev.at;
                    out.push((
                        f(),
                        format!(
                            "{} {name} concurrently with {} (layer {pl}, stream `{}`): no event orders them",
                            if write { "writes" } else { "reads" },
                            at(pb, po),
                            p.streams[prev.stream]
                        ),
                    ));
                }
            }
            if write {
                h.retain(|prev| !covers(a.slice, prev.slice));
                written.entry(res).or_default().push(a.slice);
            }
            h.push(a);
        };
        let res = |o: &Operand| match *o {
            Operand::Buffer { name } => Some(Res::Buf(name)),
            Operand::Kv => Some(Res::Kv(layer)),
            Operand::Weight { .. } => None,
        };
        for r in op.reads.iter().filter_map(res) {
            touch(r, false, &mut out);
        }
        for r in op.writes.iter().filter_map(res) {
            touch(r, true, &mut out);
        }
        if out.len() >= MAX_FINDINGS {
            break 'step;
        }
    }
    // The sampled tokens are the step's result: the last op must produce them
    // after everything else (one stream joins every other before it). A MoE
    // server samples nothing: its step is its side of the MoE layers.
    if p.role == Role::Moe {
        for (bi, b) in p.blocks.iter().enumerate() {
            if b.kind != BlockKind::Moe && !b.ops.is_empty() {
                out.push((
                    format!("programs[{pi}].blocks[{bi}]"),
                    format!("a MoE server's program issues ops in MoE layers only, not in a {:?} block", b.kind),
                ));
            }
        }
    } else if out.is_empty() {
        let last = p.blocks.last().and_then(|b| b.ops.last());
        let end = issued.last().map(|i| &i.clock);
        let mut finals = vec![0u64; ns];
        for i in &issued {
            finals[i.stream] = i.clock[i.stream];
        }
        match (last, end) {
            (Some(op), Some(end)) if op.writes.contains(&Operand::Buffer { name: BufferName::Sampled }) => {
                let s = op.stream as usize;
                for t in 0..ns {
                    if t != s && end[t] < finals[t] {
                        out.push((
                            format!("programs[{pi}].blocks"),
                            format!("the step ends before stream `{}`'s last op: nothing joins it", p.streams[t]),
                        ));
                    }
                }
            }
            _ => {
                out.push((format!("programs[{pi}].blocks"), "the step's last op must write the sampled tokens".into()))
            }
        }
    }
    out.truncate(MAX_FINDINGS);
    out
}

/// A wait on an event no earlier op recorded: `(block, op, layer, event)`.
pub type Unsatisfied = (usize, usize, u32, u32);

/// One op as issued in the unrolled step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Issued {
    pub block: usize,
    pub op: usize,
    /// The model layer (0 in the prologue and epilogue).
    pub layer: u32,
    pub stream: usize,
    /// The vector clock when the op ran: entry `t` counts the ops of stream
    /// `t` that happen before it (itself included on its own stream).
    pub clock: Vec<u64>,
}

impl Issued {
    /// Whether `self` (issued earlier) happens before `later`: program
    /// order on one stream, or a chain of event records and waits.
    pub fn happens_before(&self, later: &Issued) -> bool {
        self.clock[self.stream] <= later.clock[self.stream]
    }
}

/// The step in issue order: every op of every block, bodies once per layer,
/// with its vector clock under CUDA stream and event semantics (a wait
/// joins the clock of the event's latest record). Also the waits on events
/// no earlier op recorded, as `(block, op, layer, event)`: on a GPU they
/// would not wait at all. Streams and events out of range are skipped (the
/// static checks report them).
pub fn unroll(p: &Program) -> (Vec<Issued>, Vec<Unsatisfied>) {
    let ns = p.streams.len();
    let mut vc = vec![vec![0u64; ns]; ns];
    let mut ev: Vec<Option<Vec<u64>>> = vec![None; p.events.len()];
    let (mut issued, mut unsatisfied) = (Vec::new(), Vec::new());
    for (bi, b) in p.blocks.iter().enumerate() {
        for layer in b.layers.map_or(0..1, |[a, e]| a..e) {
            for (oi, op) in b.ops.iter().enumerate() {
                let s = op.stream as usize;
                if s >= ns {
                    continue;
                }
                for &e in &op.waits {
                    match ev.get(e as usize) {
                        Some(Some(snap)) => {
                            for (x, y) in vc[s].iter_mut().zip(snap) {
                                *x = (*x).max(*y);
                            }
                        }
                        Some(None) => unsatisfied.push((bi, oi, layer, e)),
                        None => {}
                    }
                }
                vc[s][s] += 1;
                if let Some(slot) = op.record.and_then(|e| ev.get_mut(e as usize)) {
                    *slot = Some(vc[s].clone());
                }
                issued.push(Issued { block: bi, op: oi, layer, stream: s, clock: vc[s].clone() });
            }
        }
    }
    (issued, unsatisfied)
}

impl Program {
    /// Every op of the program with its block, in program order.
    pub fn ops(&self) -> impl Iterator<Item = (&Block, &Op)> {
        self.blocks.iter().flat_map(|b| b.ops.iter().map(move |o| (b, o)))
    }
}
