//! The program interpreter: runs one forward step of a bundle's per-rank
//! programs (`plan.json`'s `programs`) on any [`Device`], every rank's
//! unified buffer one device allocation, op by op in program order.
//!
//! - Launches bind their plan arguments ([`super::bind`]); a GEMM op runs
//!   the dense APK and an experts op the MoE APK, each launched per
//!   operation with the operation posted before the grid starts (what a
//!   colocated rank does; EP's post to the persistent APK runs the same way
//!   here, since the emulated device runs launches to completion).
//! - Communication ops move bytes between the ranks' buffers at the plan's
//!   addresses: the TP all-reduce sums in rank order; EP's dispatch sends
//!   each token row once to every rank owning one of its experts (sources
//!   in rank order, tokens in order) with its top-k ids and weights, as one
//!   batch of the bundle's compiled dispatch program (`kernels/xfer_dispatch.*`:
//!   the host reads only the top-k ids, which fix where every row lands);
//!   a decode step's dispatch (direct, whose rows fit) instead
//!   takes fixed slots, a row on every rank holding experts for every
//!   token, its hidden bytes gated on the device by its top-k ids (they
//!   move only to a rank holding one of its experts; with replicas, by the
//!   physical slots the device's routing chose, which the row carries as
//!   its ids), so the token counts
//!   fix every copy and the host reads nothing (a role plan's rows between the posts' used parts
//!   get -1 ids by a fill on the device, so such a step uploads nothing
//!   after its inputs either);
//!   the combine is pulled by each token's source rank, its row the f32 sum
//!   of the rows the receiving ranks computed, in rank order (the bundle's
//!   compiled `combine` program: the host reads nothing; after a fixed-slot
//!   dispatch over more ranks than top-k, a gated sum that reads a rank's
//!   row only where the token's ids gate it in); the TP all-reduce
//!   is the compiled `all_reduce` program, a reduce-scatter then an
//!   all-gather, rows summed in rank order. Every byte a communication op
//!   moves is moved by a transfer program (on a GPU the same code reads
//!   peers' buffers through their pointers); the host reads only a
//!   routed dispatch's top-k ids (and a replicated placement's routing of
//!   them), and writes the ids each destination
//!   sees where the plan needs them (a replicated placement's rewritten
//!   ids, a role plan's per-destination ids, -1 in rows no source used).
//! - Counts the device computes stay there: the permutation's padded rows
//!   (`offsets[num_local]`) are read by the scatter, the gather (a fixed
//!   grid striding over them) and the experts on the device; a layout past
//!   the room of its buffers sets its slice's overflow word, which the
//!   step clears before it and reads once after it; a replicated
//!   placement's expert loads, which `zepp_count` adds up per layer, are
//!   read (and zeroed) once after the step.
//!
//! - Decode steps run as graphs where the device records them
//!   ([`Executor::use_graphs`]; CUDA graphs, Moebius §4.4's per-mode graph
//!   sets): a decode step whose dispatches take fixed slots is padded to its
//!   batch bucket ([`bucket`]: every rank that takes requests to the bucket of
//!   the most any has; a padding request is one token whose KV slot is -1,
//!   which the KV writes skip, and whose sample is dropped), so its
//!   launches, transfers and fills are the bucket's whatever the batch. A
//!   (mode, bucket)'s first step runs call by call (the warm-up a GPU needs:
//!   the APK's templates are encoded on a launch's first run), its second is
//!   recorded between the step's input uploads and its readbacks and then
//!   replayed, every later one replays it. Both modes' graphs stay kept, so
//!   a step after a live switch replays the graph recorded before it (the
//!   reshard moves weights, never addresses). A recording the device refuses
//!   leaves that (mode, bucket) call by call.
//! - A live switch runs here too: the weight reshard's descriptors as one
//!   transfer program between the ranks' buffers ([`Executor::reshard`]), and
//!   the KV cache's pages by the layer kernels' `kv_migrate`, which reads the
//!   source rank's pool through its pointer ([`Executor::migrate_kv`]).
//!
//! The ranks that run a (mode, phase) meet at communication ops: each runs
//! its ops up to the next one, then every group issuing it moves its rows.
//! Every rank that communicates in a block issues the same communication
//! ops in the same order, each group's members the same `Comm` (checked):
//! a colocated plan's ranks issue the same ops throughout; a role plan's
//! attention servers and MoE servers run different programs that meet
//! there (the MoE servers' blocks outside the MoE layers are empty); a PD
//! plan's instances each meet in their own group. A role plan's dispatch
//! lands each source's rows in the rows its post reserves
//! (`moeforge_plan::roles::Post`), and its prefill→decode KV handoff is
//! the compiled `kv_handoff` program ([`Executor::hand_off_pages`]).

use super::bind::{self, Counts, Site};
use super::{
    BufferId, Code, Device, DeviceError, Elem, Gate, GatedCopy, GraphId, KernelArg, ModuleId, SideEvent, StridedCopy,
    Sum, SumGate, Transfer,
};
use moeforge_plan::memory::{
    BufferName, MemoryPlan, Mode, RouteIndexParts, TensorPart, TensorRole, WeightReshard, ZeppRouteParts,
    KV_MOVE_CHUNK, STEP_SAMPLED, STEP_TOKENS,
};
use moeforge_plan::placement::Swap;
use moeforge_plan::program::{CommKind, KernelRef, Op, OpKind, Operand, Phase, Program};
use moeforge_plan::reshard::ReshardTransfers;
use moeforge_plan::{ApkForm, GridVar, KernelParams, Plan};
use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error("the bundle has no source for kernel `{0}` (kernels/{0}.cu)")]
    NoSource(String),
    #[error("op `{op}` needs {family}, which this bundle does not emit")]
    Missing { op: String, family: String },
    #[error("{0}")]
    Plan(String),
    #[error("the step does not fit the plan: {0}")]
    Capacity(String),
}

/// One request's work on one rank this step.
#[derive(Clone, Debug)]
pub struct Work {
    /// Tokens whose KV is cached before the step.
    pub cached: u32,
    /// The tokens processed this step (positions `cached..`).
    pub tokens: Vec<u32>,
    /// Its KV pages on this rank, in position order.
    pub pages: Vec<u32>,
    /// Whether its last position is sampled.
    pub sample: bool,
    pub temperature: f32,
    pub top_p: f32,
    /// The sampler's generator state.
    pub rng: u64,
}

impl Work {
    /// A padding request of a bucketed decode step: one token at position
    /// 0 and no KV page (its KV slot is −1, so it writes no KV), sampled
    /// into a row nobody reads.
    pub fn padding() -> Work {
        Work { cached: 0, tokens: vec![0], pages: vec![], sample: true, temperature: 0.0, top_p: 1.0, rng: 0 }
    }
}

/// The sampled token of one request, its generator's state after the draw,
/// and the logits it was drawn from.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub rng: u64,
    pub logits: Vec<f32>,
}

/// One side of a KV migration: its page format's page size and heads per
/// page, and the first of the moved heads among them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSide {
    pub page_bytes: u64,
    pub heads: u32,
    pub head0: u32,
}

/// A KV migration between two page formats: `heads` consecutive heads per
/// moved page, through the `kv_moves` table of `table_mode`'s buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvMigration {
    pub src: KvSide,
    pub dst: KvSide,
    pub heads: u32,
    pub table_mode: Mode,
}

/// Per destination rank, its received rows of a micro-batch: (row, source
/// rank, token row).
type Routes = Vec<Vec<(u64, usize, usize)>>;

/// A decode step padded to its bucket: the bucket and each rank's work.
type Bucketed = (u32, Vec<Vec<Work>>);

/// Where each (source rank, entry) of a dispatch goes: (destination rank,
/// the id its permutation matches).
type Assigned = BTreeMap<(usize, usize), (usize, i32)>;

/// One source's part of a replicated placement's routing of one dispatch
/// ([`Executor::route`]): its top-k ids' address, its entries (tokens ×
/// top-k) and where the routing writes each entry's physical slot, one
/// i32 per entry like the ids' rows: micro-batch m's at the entries of the
/// step's earlier micro-batches, so each micro-batch's stay until its
/// combine.
#[derive(Clone, Copy, Debug)]
struct Source {
    ids: u64,
    entries: usize,
    dest: u64,
    /// Its rows' KV slots (`SlotMap`): a padding row's −1 is no load.
    kv_slots: u64,
}

pub struct Executor {
    dev: Box<dyn Device + Send>,
    plan: std::sync::Arc<Plan>,
    buffers: Vec<BufferId>,
    modules: BTreeMap<String, ModuleId>,
    /// The compiled weight reshard and its batches, for a dual-mode plan.
    reshard: Option<(Code, ReshardTransfers)>,
    /// The compiled EP dispatch (its batches are each step's rows).
    dispatch: Option<Code>,
    /// The compiled EP combine (each step's gathers) and TP all-reduce.
    combine: Option<Code>,
    all_reduce: Option<Code>,
    /// The compiled prefill→decode KV page copy of a role plan.
    kv_handoff: Option<Code>,
    /// The compiled slot exchange of a Zepp placement's swaps.
    expert_swap: Option<Code>,
    /// `slots[moe layer][rank]`: the experts rank's slots hold now, in slot
    /// order (the plan's placement, then every swap since).
    slots: Vec<Vec<Vec<u32>>>,
    /// Routed entries per MoE layer and expert since the last
    /// [`Executor::take_expert_loads`]: a replicated placement's routing
    /// counts them on the device (`zepp_count`, into each source's
    /// `expert_loads`), read and zeroed after each step (Zepp's drift
    /// statistics; without replicas nothing uses them).
    expert_loads: Vec<Vec<f64>>,
    /// The group membership each rank's routing last wrote (`ZeppRoute`'s
    /// `member`), so a step writes it only when it changes (never, after a
    /// rank's first routing: a rank dispatches within one group, its EP
    /// group, in every program, so a graph's routing reads the right one).
    members: BTreeMap<usize, Vec<i32>>,
    traffic: CombineTraffic,
    dispatch_traffic: DispatchTraffic,
    /// Slot swaps queued on the device's side stream and not yet waited
    /// on by the host: (model layer, event, whether a step's work has
    /// joined it on the device since).
    side: Vec<(u32, SideEvent, bool)>,
    /// `main_ops` when the side queue last went from empty to busy.
    side_since: Option<u64>,
    /// Whether a step's graph is being recorded (its calls do not run).
    capturing: bool,
    /// Kernel and communication ops issued on the main stream so far.
    main_ops: u64,
    swap_overlap: SwapOverlap,
    /// A replicated placement's routing kernel and where its tables lie.
    zepp: Option<ZeppRouting>,
    /// Whether each device routing is checked against the host's
    /// (`placement::route` on the same counts and table), and the entries
    /// checked so far.
    verify_routing: bool,
    routing_checked: u64,
    /// Whether decode steps route their dispatch as prefill does instead
    /// of taking fixed slots ([`Executor::route_decode`]).
    route_decode: bool,
    /// Whether decode steps run as graphs ([`Executor::use_graphs`]), the
    /// graphs by (mode, bucket), and what they did.
    graphs_on: bool,
    graphs: BTreeMap<(Mode, u32), Graph>,
    graph_stats: GraphStats,
    /// Weight reshards (live switches) so far.
    reshards: u64,
}

/// A (mode, bucket)'s decode graph: warmed up (one step ran call by call),
/// or recorded, with the traffic its step counts (a replay moves what the
/// recorded step moved, and counts it again).
#[derive(Clone, Debug)]
enum Graph {
    Warm,
    /// Recorded after `reshards` weight reshards and `swaps` slot swaps.
    Kept {
        graph: GraphId,
        counted: Counted,
        reshards: u64,
        swaps: u64,
    },
    /// The device refused to record it (why): its steps run call by call.
    Refused(String),
}

/// What one step adds to the executor's counters.
#[derive(Clone, Copy, Debug, Default)]
struct Counted {
    dispatch: DispatchTraffic,
    combine: CombineTraffic,
    main_ops: u64,
}

/// How a step's launches, transfers and fills are issued.
#[derive(Clone, Copy, Debug)]
enum Body {
    /// Call by call.
    Eager,
    /// Recorded as (mode, bucket)'s graph, which then runs.
    Capture(Mode, u32),
    /// As (mode, bucket)'s kept graph.
    Replay(GraphId, Counted),
}

/// Decode steps as graphs (issue 12; Moebius §4.4 keeps both modes' graph
/// sets): `captured` graphs recorded, one per (mode, batch bucket);
/// `replayed` decode steps that ran as one (their capturing step
/// included); `warmups` steps run call by call, padded to their bucket,
/// before their key's capture (the warm-up a GPU needs before it records:
/// the APK's tensor-map templates are encoded on a launch's first run);
/// `eager` decode steps run call by call at their own size: no graph holds
/// them (their dispatch is routed, their padded rows would need dispatch
/// rounds or pass a step input's slice), or their key's recording was
/// refused (that step included); `padded_rows` the
/// padding rows the bucketed steps carried; `refused` recordings the
/// device refused (that step, and its key's later ones, ran call by call);
/// `replayed_after_switch` replays of a graph recorded before a later live
/// switch (its weights resharded in between, at the same addresses: the
/// graph is still the step's, Moebius §4.4's two resident graph sets);
/// `replayed_after_swap` replays of a graph recorded before a later Zepp
/// slot swap (slot contents and the replica table rewritten in between,
/// never an address); `replayed_beside_swap` those of them issued while
/// such a swap was still queued on the side stream, which the graph (its
/// recording older than the swap) waits for on the device just before the
/// swapped layer's expert computation; `recorded_before_serving` those of
/// the `captured` recorded before serving, by [`Executor::capture_decode_graphs`]
/// or [`Executor::probe_decode`], whose steps no other count includes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub refused: u64,
    pub replayed_after_switch: u64,
    pub replayed_after_swap: u64,
    pub replayed_beside_swap: u64,
    pub captured: u64,
    pub recorded_before_serving: u64,
    pub replayed: u64,
    pub warmups: u64,
    pub eager: u64,
    pub padded_rows: u64,
}

/// Whether rank `r` takes decode requests in `mode`: it runs a decode
/// program of the mode and, in a role plan, is a decode server.
fn takes_decode(plan: &Plan, mode: Mode, r: usize) -> bool {
    use moeforge_plan::roles::Role;
    plan.programs.iter().any(|g| g.mode == mode && g.phase == Phase::Decode && g.ranks.contains(&(r as u32)))
        && plan.roles.as_ref().is_none_or(|x| x.gpus.get(r) == Some(&Role::Decode))
}

/// The batch bucket a decode step of `n` requests per rank is padded to:
/// powers of two to 8, multiples of 8 to 256, then multiples of 64 (the
/// captured batch sizes serving engines use: few graphs at small batches,
/// where padding would cost most).
pub fn bucket(n: u32) -> u32 {
    match n {
        0..=8 => n.max(1).next_power_of_two(),
        9..=256 => n.div_ceil(8) * 8,
        _ => n.div_ceil(64).saturating_mul(64),
    }
}

/// The routing kernel of a replicated placement (`kernels/zepp_route.cu`)
/// and its buffers: every dispatch routes on the device.
#[derive(Clone, Copy, Debug)]
struct ZeppRouting {
    module: ModuleId,
    /// `ReplicaTable`'s offset, and its width (replicas per expert).
    table: u64,
    width: usize,
    /// `ZeppRoute`'s offset, and its parts.
    route: u64,
    parts: ZeppRouteParts,
    /// `ExpertLoads`'s offset: `[moe layer][expert]` i32 entries routed.
    loads: u64,
    slots_per_gpu: usize,
    count_blocks: u32,
    threads: u32,
}

impl ZeppRouting {
    /// Where a source's routing writes the physical slots of its `token`-th
    /// token of the step (`top_k` i32 each; the step's earlier
    /// micro-batches' tokens first, [`tokens_before`]).
    fn slots_at(&self, top_k: usize, token: u64) -> u64 {
        self.route + self.parts.dest + 4 * top_k as u64 * token
    }
}

/// A rank's tokens in the step's micro-batches before `m`.
fn tokens_before(counts: &[Counts], m: usize) -> u64 {
    counts[..m].iter().map(|c| u64::from(c.tokens)).sum()
}

/// How Zepp's swaps overlapped serving: `swaps` exchanges queued on the
/// side stream; `ops_beside`, the main-stream kernel and communication ops
/// the executor issued call by call while at least one swap was queued and
/// not yet joined (each op once: the next step's ops up to the swapped
/// layer's expert computation, what the schedule lets the swaps run beside,
/// whatever the timing; a graph's replay adds none);
/// `device_overlapped`, the main-stream launches and transfers the device
/// reports finished while side work was queued (as timed on it, graphs'
/// included; 0 on a device that runs side transfers at once).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SwapOverlap {
    pub swaps: u64,
    pub ops_beside: u64,
    pub device_overlapped: u64,
}

/// Where the dispatches' rows went so far, counted per (token, receiving
/// rank) row: to a GPU on the source's node (`node_rows`) or on another
/// (`remote_rows`), and how rows crossed the scale-out link
/// (`scale_out_rows`: every remote row of a direct dispatch; relayed, one
/// per (token, other node), to the relay) and were then forwarded over
/// NVLink by a relay (`forwarded_rows`). Zepp's NIC split: sends handed to
/// another GPU's NIC of the node (`split_rows`), and, summed over relayed
/// dispatches, the busiest NIC's sends after the split and as they would
/// have been without it. `rounds`: the dispatch rounds steps took beyond
/// their first, where a source's tokens in a micro-batch exceeded what its
/// posts reserve ([`post_rounds`]; the CPU twin's `Routed::rounds` counts
/// rounds per (source, MoE rank) pair of its rows instead, so the two are
/// not the same count). `fixed`: dispatches (one per op and micro-batch)
/// that ran on fixed slots, a row for every token on every rank holding
/// experts, with nothing read back (a decode step's); the others read their
/// sources' top-k ids. `gated_rows`: the (token, rank) hidden rows of those
/// fixed-slot dispatches, each a gated copy that the device runs only when
/// the rank holds one of the token's experts (replicated: one of the
/// physical slots the routing chose for it) (the rows above count them
/// as placed; the host does not learn which moved).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DispatchTraffic {
    pub node_rows: u64,
    pub remote_rows: u64,
    pub scale_out_rows: u64,
    pub forwarded_rows: u64,
    pub split_rows: u64,
    pub busiest_nic_rows: u64,
    pub busiest_nic_rows_unsplit: u64,
    pub rounds: u64,
    pub fixed: u64,
    pub gated_rows: u64,
}

/// Where the combines' rows went so far, counted per (token, computing
/// rank) row: summed inside the source's node (`node_rows`), summed on a
/// relay of another node (`relayed_rows`), and rows crossing the scale-out
/// link (`scale_out_rows`: every remote row of a direct combine, and the
/// `relay_rows`, one per (token, node) of a relayed one). `gated_rows`: the
/// (token, rank) rows of gated sums (a fixed-slot combine over more ranks
/// than top-k), each read on the device only when the rank holds one of the
/// token's experts; they are in no other count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CombineTraffic {
    pub node_rows: u64,
    pub relayed_rows: u64,
    pub relay_rows: u64,
    pub scale_out_rows: u64,
    pub gated_rows: u64,
}

impl DispatchTraffic {
    fn plus(self, o: DispatchTraffic) -> DispatchTraffic {
        DispatchTraffic {
            node_rows: self.node_rows + o.node_rows,
            remote_rows: self.remote_rows + o.remote_rows,
            scale_out_rows: self.scale_out_rows + o.scale_out_rows,
            forwarded_rows: self.forwarded_rows + o.forwarded_rows,
            split_rows: self.split_rows + o.split_rows,
            busiest_nic_rows: self.busiest_nic_rows + o.busiest_nic_rows,
            busiest_nic_rows_unsplit: self.busiest_nic_rows_unsplit + o.busiest_nic_rows_unsplit,
            rounds: self.rounds + o.rounds,
            fixed: self.fixed + o.fixed,
            gated_rows: self.gated_rows + o.gated_rows,
        }
    }
}

impl CombineTraffic {
    fn plus(self, o: CombineTraffic) -> CombineTraffic {
        CombineTraffic {
            node_rows: self.node_rows + o.node_rows,
            relayed_rows: self.relayed_rows + o.relayed_rows,
            relay_rows: self.relay_rows + o.relay_rows,
            scale_out_rows: self.scale_out_rows + o.scale_out_rows,
            gated_rows: self.gated_rows + o.gated_rows,
        }
    }
}

impl Counted {
    fn plus(self, o: Counted) -> Counted {
        Counted {
            dispatch: self.dispatch.plus(o.dispatch),
            combine: self.combine.plus(o.combine),
            main_ops: self.main_ops + o.main_ops,
        }
    }
}

fn le32(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

impl Executor {
    /// Loads every kernel instance the programs launch or post to and
    /// allocates each rank's unified buffer. `transfers` are the bundle's
    /// compiled transfer programs (`LoadedBundle::transfers`): the executor
    /// rebuilds each from the plan and refuses code that is not its plan's.
    /// `cubins` are the bundle's builds of `sources` (`LoadedBundle::cubins`),
    /// handed to the device with each source.
    pub fn new(
        mut dev: Box<dyn Device + Send>,
        plan: &Plan,
        sources: &BTreeMap<String, String>,
        cubins: &BTreeMap<String, Vec<u8>>,
        transfers: &BTreeMap<String, Code>,
    ) -> Result<Executor, ExecError> {
        // The room each layout is given is the room its buffers and its
        // experts have, and its overflow word the one the step reads: the
        // device writes up to the room without a host check.
        for g in &plan.programs {
            use moeforge_plan::program::Arg;
            let room = layout_room(plan, g);
            let word = plan
                .memory
                .buffer(g.mode, BufferName::RouteIndex)
                .map(|b| RouteIndexParts::of(b.slice_bytes(g.micro_batches), u64::from(plan.model.experts)).overflow);
            for op in g.blocks.iter().flat_map(|b| &b.ops).filter(|op| lays_out(op)) {
                let room_ok = matches!(op.args.get(2), Some(Arg::Int { value }) if u64::try_from(*value).is_ok_and(|v| v <= room));
                let word_ok = matches!(
                    op.args.get(4),
                    Some(Arg::Ptr { operand: Operand::Buffer { name: BufferName::RouteIndex }, at }) if Some(*at) == word
                );
                if !room_ok || !word_ok {
                    return Err(ExecError::Plan(format!(
                        "op `{}` gives the permutation {:?} rows of room and its overflow word {:?}; its buffers and \
                         experts hold {room} rows, and the word is RouteIndex byte {word:?}",
                        op.name,
                        op.args.get(2),
                        op.args.get(4)
                    )));
                }
            }
        }
        let programs = moeforge_plan::transfers::programs(plan)
            .map_err(|e| ExecError::Plan(format!("the plan's transfer programs: {e}")))?;
        let mut codes = BTreeMap::new();
        for (name, program) in programs {
            let code = transfers.get(name).ok_or_else(|| {
                ExecError::Plan(format!(
                    "the bundle holds no compiled `{name}` transfer program (kernels/xfer_{name}.*)"
                ))
            })?;
            if code.program != program {
                return Err(ExecError::Plan(format!(
                    "the compiled `{name}` transfer program is not this plan's (recompile the bundle)"
                )));
            }
            codes.insert(name, code.clone());
        }
        let reshard = match (&plan.memory.reshard, codes.remove("reshard")) {
            (Some(rs), Some(code)) => Some((
                code,
                moeforge_plan::reshard::transfers(&plan.memory, rs)
                    .map_err(|e| ExecError::Plan(format!("the weight reshard: {e}")))?,
            )),
            _ => None,
        };
        let dispatch = codes.remove("dispatch");
        let combine = codes.remove("combine");
        let all_reduce = codes.remove("all_reduce");
        let kv_handoff = codes.remove("kv_handoff");
        let expert_swap = codes.remove("expert_swap");
        let layers = plan.model.moe_layers as usize;
        let slots = (0..layers).map(|l| (0..plan.ranks.len()).map(|r| plan.slot_experts(l, r)).collect()).collect();
        let mut modules = BTreeMap::new();
        for p in &plan.programs {
            for (_, op) in p.ops() {
                let (KernelRef::Launch { instance, .. } | KernelRef::Post { instance }) = &op.kernel else { continue };
                if modules.contains_key(instance) {
                    continue;
                }
                let src = sources.get(instance).ok_or_else(|| ExecError::NoSource(instance.clone()))?;
                modules.insert(instance.clone(), dev.load(instance, src, cubins.get(instance).map(Vec::as_slice))?);
            }
        }
        let zepp = match (&plan.placement, plan.kernels.iter().find(|k| matches!(k.params, KernelParams::Zepp(_)))) {
            (Some(p), Some(k)) => {
                let src = sources.get(&k.name).ok_or_else(|| ExecError::NoSource(k.name.clone()))?;
                let module = dev.load(&k.name, src, cubins.get(&k.name).map(Vec::as_slice))?;
                let at = |name| {
                    plan.memory
                        .buffers
                        .iter()
                        .find(|b| b.name == name)
                        .map(|b| b.offset)
                        .ok_or_else(|| ExecError::Plan(format!("the replicated placement has no {name:?} buffer")))
                };
                let width = p.max_replicas();
                let (experts, k_top) = (u64::from(plan.model.experts), u64::from(plan.model.top_k));
                let threads = k.entries.first().map_or(256, |e| e.block);
                Some(ZeppRouting {
                    module,
                    table: at(BufferName::ReplicaTable)?,
                    width,
                    route: at(BufferName::ZeppRoute)?,
                    loads: at(BufferName::ExpertLoads)?,
                    parts: ZeppRouteParts::of(
                        plan.ranks.len() as u64,
                        experts,
                        width as u64,
                        moeforge_plan::memory::MAX_BATCH_TOKENS * k_top,
                    ),
                    slots_per_gpu: p.slots_per_gpu(),
                    count_blocks: plan.model.experts.div_ceil(threads.max(1)),
                    threads,
                })
            }
            (Some(p), None) if p.policy != moeforge_dsl::spec::PlacementPolicy::None => {
                return Err(ExecError::Missing { op: "dispatch".into(), family: "the replica routing kernel".into() })
            }
            _ => None,
        };
        let buffers =
            (0..plan.memory.group).map(|_| dev.alloc(plan.memory.buffer_bytes)).collect::<Result<Vec<_>, _>>()?;
        let mut ex = Executor {
            dev,
            plan: std::sync::Arc::new(plan.clone()),
            buffers,
            modules,
            reshard,
            dispatch,
            combine,
            all_reduce,
            kv_handoff,
            expert_swap,
            slots,
            expert_loads: vec![vec![0.0; plan.model.experts as usize]; layers],
            members: BTreeMap::new(),
            traffic: CombineTraffic::default(),
            dispatch_traffic: DispatchTraffic::default(),
            side: Vec::new(),
            side_since: None,
            capturing: false,
            main_ops: 0,
            swap_overlap: SwapOverlap::default(),
            zepp,
            verify_routing: false,
            routing_checked: 0,
            route_decode: false,
            graphs_on: false,
            graphs: BTreeMap::new(),
            graph_stats: GraphStats::default(),
            reshards: 0,
        };
        ex.graphs_on = ex.dev.captures();
        for l in 0..layers {
            ex.store_replica_table(l)?;
        }
        Ok(ex)
    }

    /// Writes MoE layer `moe_layer`'s replica table, as the slots hold
    /// experts now, at its fixed address on every rank (every source routes).
    fn store_replica_table(&mut self, moe_layer: usize) -> Result<(), ExecError> {
        let (Some(z), Some(slots)) = (self.zepp, self.slots.get(moe_layer)) else { return Ok(()) };
        let experts = self.plan.model.experts as usize;
        let table = moeforge_plan::placement::PlacementPlan::replica_table(slots, experts, z.slots_per_gpu, z.width);
        let at = z.table + (moe_layer * experts * z.width * 4) as u64;
        let bytes = le32(&table);
        for r in 0..self.buffers.len() {
            self.store(r, at, &bytes)?;
        }
        Ok(())
    }

    /// A compiled transfer program the plan needs, or why the bundle lacks it.
    fn code(&self, code: &Option<Code>, name: &str) -> Result<Code, ExecError> {
        code.clone()
            .ok_or_else(|| ExecError::Plan(format!("the bundle holds no compiled {name} (kernels/xfer_{name}.*)")))
    }

    /// The combines' traffic so far.
    pub fn combine_traffic(&self) -> CombineTraffic {
        self.traffic
    }

    /// The dispatches' traffic so far.
    pub fn dispatch_traffic(&self) -> DispatchTraffic {
        self.dispatch_traffic
    }

    /// The device's own description ([`Device::describe`]).
    pub fn describe(&self) -> Option<String> {
        self.dev.describe()
    }

    /// Most tokens one rank's step may carry on this device: each
    /// micro-batch's slice of the step inputs must hold them all, since a
    /// step splits a rank's requests over micro-batches by count, not by
    /// tokens. The smallest over the plan's programs.
    pub fn step_tokens(&self) -> usize {
        let mem = &self.plan.memory;
        self.plan
            .programs
            .iter()
            .filter_map(|g| {
                let b = mem.buffer(g.mode, BufferName::TokenIds)?;
                Some(b.slice_bytes(g.micro_batches) / b.row_bytes.max(1))
            })
            .min()
            .map_or(0, |t| usize::try_from(t).unwrap_or(usize::MAX))
    }
    pub fn ranks(&self) -> usize {
        self.buffers.len()
    }

    /// Writes `data` at `offset` of rank `rank`'s buffer (weights).
    pub fn upload(&mut self, rank: usize, offset: u64, data: &[u8]) -> Result<(), ExecError> {
        self.settle()?;
        self.store(rank, offset, data)
    }

    /// A write inside a step (of nothing a swap moves).
    fn store(&mut self, rank: usize, offset: u64, data: &[u8]) -> Result<(), ExecError> {
        let b = *self.buffers.get(rank).ok_or_else(|| ExecError::Plan(format!("no rank {rank}")))?;
        Ok(self.dev.upload(b, offset, data)?)
    }

    /// Reads `len` bytes at `offset` of rank `rank`'s buffer, after every
    /// queued slot swap finished (a swap's slots may be among them).
    pub fn download(&mut self, rank: usize, offset: u64, len: u64) -> Result<Vec<u8>, ExecError> {
        self.settle()?;
        self.fetch(rank, offset, len)
    }

    /// A read inside a step: the step itself waits for a swap before its
    /// layer's expert computation, and reads nothing a swap moves.
    fn fetch(&mut self, rank: usize, offset: u64, len: u64) -> Result<Vec<u8>, ExecError> {
        let b = *self.buffers.get(rank).ok_or_else(|| ExecError::Plan(format!("no rank {rank}")))?;
        Ok(self.dev.download(b, offset, len)?)
    }

    /// Blocks the host until every queued slot swap finished (before it
    /// reads or writes device memory a swap may move).
    fn settle(&mut self) -> Result<(), ExecError> {
        let Some(last) = self.side.iter().map(|x| x.1).max() else {
            return Ok(());
        };
        let overlapped = self.dev.side_wait(last)?;
        if last.0 > 0 {
            self.swap_overlap.device_overlapped = overlapped;
        }
        self.side.clear();
        self.end_beside();
        Ok(())
    }

    /// The step's wait for model layer `layer`'s queued slot swaps, on the
    /// device and not on the host, just before the layer's expert
    /// computation reads its slots (Zepp's overlapped swap: nothing else of
    /// the step waits for it). With a slot exchange in the bundle every
    /// expert computation joins, swap queued or not, so a graph holds the
    /// wait and each replay waits for the swaps queued before it.
    fn join_side(&mut self, layer: u32) -> Result<(), ExecError> {
        if self.expert_swap.is_none() {
            return Ok(());
        }
        self.dev.side_join(layer)?;
        // A recording's join waits when its graph runs (`replay_graph`).
        if !self.capturing {
            self.joined(Some(layer));
        }
        Ok(())
    }

    /// Notes that a step's work joined the queued swaps of model layer
    /// `layer` (every layer's with `None`), and so every swap queued before
    /// them, which the side stream finished first.
    fn joined(&mut self, layer: Option<u32>) {
        let Some(last) = self.side.iter().filter(|x| layer.is_none_or(|l| x.0 == l)).map(|x| x.1).max() else {
            return;
        };
        for x in self.side.iter_mut().filter(|x| x.1 <= last) {
            x.2 = true;
        }
        if self.side.iter().all(|x| x.2) {
            self.end_beside();
        }
    }

    /// The main-stream ops issued beside the queued swaps end here (every
    /// one joined or waited for).
    fn end_beside(&mut self) {
        if let Some(since) = self.side_since.take() {
            self.swap_overlap.ops_beside += self.main_ops - since;
        }
    }

    /// How the swaps so far overlapped serving.
    pub fn swap_overlap(&self) -> SwapOverlap {
        self.swap_overlap
    }

    fn buffer(&self, rank: u32) -> Result<BufferId, ExecError> {
        self.buffers.get(rank as usize).copied().ok_or_else(|| ExecError::Plan(format!("no rank {rank}")))
    }

    /// One weight reshard (Moebius §3.1) on the device: the bundle's
    /// compiled transfer program over the plan's descriptors, a batch per
    /// MoE layer in the schedule's order (`moeforge_plan::reshard::transfers`;
    /// a peer copy between GPUs). Returns the bytes that crossed between ranks.
    pub fn reshard(&mut self, w: &WeightReshard) -> Result<u64, ExecError> {
        // The reshard moves expert slots: queued swaps finish first.
        self.settle()?;
        let plan = self.plan.clone();
        let (code, t) = self
            .reshard
            .as_ref()
            .ok_or_else(|| ExecError::Plan("the bundle holds no compiled reshard (kernels/xfer_reshard.*)".into()))?;
        self.dev.transfer(code, t.batches(w.from), &self.buffers)?;
        self.reshards += 1;
        Ok(w.schedule(&plan.memory.slots).filter(|(c, ..)| c.src_rank != c.dst_rank).map(|(c, ..)| c.bytes()).sum())
    }

    /// A role plan's prefill→decode KV handoff (ExpertPlex §3): whole pages
    /// of rank `src`'s pool into pages of rank `dst`'s, `(source page,
    /// destination page)` each, one batch of the bundle's compiled
    /// `kv_handoff` program. Returns the bytes moved.
    pub fn hand_off_pages(&mut self, src: usize, dst: usize, pages: &[(u32, u32)]) -> Result<u64, ExecError> {
        self.settle()?;
        let code = self.code(&self.kv_handoff, "kv_handoff")?;
        let plan = std::sync::Arc::clone(&self.plan);
        let (base, page) = moeforge_plan::transfers::kv_pages(&plan)
            .ok_or_else(|| ExecError::Plan("the plan has no KV handoff".into()))?;
        let pool = plan.memory.kv.ep.pages;
        let mut copies = Vec::with_capacity(pages.len());
        for &(a, b) in pages {
            if u64::from(a.max(b)) >= pool {
                return Err(ExecError::Capacity(format!("KV page {} is outside the pool of {pool}", a.max(b))));
            }
            let at = |p: u32| u64::from(p).checked_mul(page).and_then(|o| o.checked_add(base));
            let (Some(from), Some(to)) = (at(a), at(b)) else {
                return Err(ExecError::Plan("a KV page address overflows".into()));
            };
            copies.push(Transfer { src: src as u32, dst: dst as u32, copy: StridedCopy::one_run(from, to, page) });
        }
        let batch = code.program.batch(&copies).map_err(|e| ExecError::Plan(format!("the KV handoff: {e}")))?;
        self.dev.transfer(&code, &[batch], &self.buffers)?;
        Ok(pages.len() as u64 * page)
    }

    /// Zepp's intra-node swap `s` in model layer `layer` (§4.3): the two
    /// slots' contents trade places in place, every routed-expert view's
    /// slot, as the compiled `expert_swap` program (one launch; on a GPU
    /// node a peer exchange over NVLink), queued on the device's side
    /// stream: it runs beside the next step, which waits for it just
    /// before that layer's expert computation (the swap is Zepp's
    /// "overlapped swap": no step drains for it). The slots keep their
    /// addresses; the dispatch's table of which slot holds which expert
    /// follows the swap at once (rows routed to a moved replica reach its
    /// slot before the wait, and are computed after it). Returns the bytes
    /// each side moved.
    pub fn exchange_slots(&mut self, layer: u32, s: &Swap) -> Result<u64, ExecError> {
        let code = self.code(&self.expert_swap, "expert_swap")?;
        let moe = layer.checked_sub(self.plan.memory.slots.first_moe_layer).map(|l| l as usize);
        let held = |t: &Vec<Vec<Vec<u32>>>, r: usize, slot: usize| {
            moe.and_then(|l| t.get(l)).and_then(|l| l.get(r)).and_then(|x| x.get(slot)).copied()
        };
        let (Some(x), Some(y)) = (held(&self.slots, s.a, s.slot_a), held(&self.slots, s.b, s.slot_b)) else {
            return Err(ExecError::Plan(format!(
                "swap {s:?} of layer {layer}: no such slot in the placement (a MoE layer's slots on two GPUs)"
            )));
        };
        let exchanges = moeforge_plan::transfers::slot_exchanges(&self.plan.memory, layer, s);
        let batch = code.program.exchange_batch(&exchanges).map_err(|e| ExecError::Plan(format!("swap {s:?}: {e}")))?;
        let event = self.dev.side_transfer(&code, &[batch], &self.buffers)?;
        self.dev.side_mark(layer)?;
        self.side_since.get_or_insert(self.main_ops);
        self.side.push((layer, event, false));
        self.swap_overlap.swaps += 1;
        if let Some(l) = moe.and_then(|l| self.slots.get_mut(l)) {
            l[s.a][s.slot_a] = y;
            l[s.b][s.slot_b] = x;
        }
        if let Some(l) = moe {
            self.store_replica_table(l)?;
        }
        Ok(exchanges.iter().map(|x| x.bytes).sum())
    }

    /// Checks every device routing of a replicated placement against the
    /// host's routing of the same counts over the same table (a step whose
    /// routings differ fails with both); a verification mode, which costs the
    /// host routing each dispatch.
    pub fn verify_routing(&mut self, on: bool) {
        self.verify_routing = on;
    }

    /// Routes every decode dispatch as prefill's are routed (the host reads
    /// the top-k ids and each row goes only where its entries go) instead of
    /// taking fixed slots: a diagnostic, to compare the two (their tokens
    /// are the same) or to count routed traffic alone.
    pub fn route_decode(&mut self, on: bool) {
        self.route_decode = on;
    }

    /// Records `mode`'s decode graphs now, for the batch buckets that hold
    /// up to `most` requests a rank, before any request arrives: Moebius
    /// §4.4 captures both modes' graph sets at startup, so no live step pays
    /// a warm-up or a recording. Each bucket takes its warm-up step and its recorded one, every
    /// request a padding one ([`Work::padding`]: no KV written, the sample
    /// dropped), so no request's state changes; nor do the statistics, but
    /// for `captured` and `recorded_before_serving` (the steps are not
    /// serving's). Stops at the first bucket the step inputs or the posts
    /// cannot hold. Returns the buckets whose graph is kept (one the device
    /// refused is not).
    pub fn capture_decode_graphs(&mut self, mode: Mode, most: u32) -> Result<Vec<u32>, ExecError> {
        let mut kept = Vec::new();
        if !self.graphs_on || most == 0 {
            return Ok(kept);
        }
        self.before_serving(|x, plan| x.capture_buckets(plan, mode, bucket(most), &mut kept))?;
        Ok(kept)
    }

    /// Times decode steps of `batch` requests in `mode` as serving runs
    /// them, for `t_high = auto`: Moebius §4.5 probes both modes' decode
    /// cost over a few batch sizes once both graph sets are recorded, and
    /// puts T_h at the crossover. `batch` counts the requests in flight, as
    /// the switch policy does: every rank that takes requests holds all of
    /// them in TP and `⌈batch / ranks⌉` in EP (data-parallel attention).
    /// Its rows are padding ones ([`probe_rows`]): each has `context` tokens
    /// cached on pages of its own, which its attention reads as a served
    /// request's would, writes no KV and drops its sample, and carries its
    /// own token so that the rows' routing spreads over the experts as a
    /// batch's does; no request's state changes, and nothing is written to
    /// the pool (no request may be in flight: the pages are any).
    /// Each step runs as [`Executor::step`] would run it: a replay of its
    /// bucket's graph where it has one (recorded first if it is not kept
    /// yet, counted as recorded before serving), else call by call (after
    /// one untimed warm-up). Each of the `steps` timed ones (at least one)
    /// runs from its issue until every rank's stream has finished it (a
    /// readback from each). No statistic changes but `captured`, `refused`
    /// and `recorded_before_serving` (and the routing checks
    /// `--verify-routing` counts, where it is on). `None` where the step
    /// does not fit the engine: its rows' KV the rank's pool, or a capacity
    /// error (its inputs, a request's page table or its posts cannot hold
    /// the batch).
    pub fn probe_decode(
        &mut self,
        mode: Mode,
        batch: u32,
        steps: usize,
        context: u32,
    ) -> Result<Option<Vec<f64>>, ExecError> {
        let plan = std::sync::Arc::clone(&self.plan);
        let (ranks, rows) = self.probe_shape(mode, batch);
        let vocab = plan.memory.buffer(mode, BufferName::Logits).map_or(1, |b| (b.row_bytes / 4).max(1)) as usize;
        let kv = self.probe_kv(mode);
        let mut work = vec![Vec::new(); self.buffers.len()];
        for (i, &r) in ranks.iter().enumerate() {
            // TP's ranks all hold the same requests; EP's each its own.
            let first = if mode == Mode::Ep { i * rows } else { 0 };
            match probe_rows(first, rows, context, kv, vocab) {
                Some(w) => work[r] = w,
                None => return Ok(None),
            }
        }
        self.before_serving(|x, plan| x.time_steps(plan, mode, &work, steps))
    }

    /// Whether a rank of `mode` holds its share of `batch` requests with
    /// `context` tokens cached each: their KV on pages of their own in its
    /// pool, each one's pages in its page table ([`probe_rows`]), and their
    /// request headers and decode rows in its step inputs. (Not whether
    /// its posts hold the step: that only running it tells.)
    pub fn probe_holds(&self, mode: Mode, batch: u32, context: u32) -> bool {
        let (_, rows) = self.probe_shape(mode, batch);
        let inputs = [BufferName::RequestMeta, BufferName::TokenIds]
            .iter()
            .all(|&name| self.plan.memory.buffer(mode, name).is_some_and(|b| rows as u64 <= b.rows));
        inputs && probe_rows(0, rows, context, self.probe_kv(mode), 1).is_some()
    }

    /// The ranks a decode step of `batch` requests in flight runs on in
    /// `mode`, and the requests each holds: all of them in TP, `⌈batch /
    /// ranks⌉` in EP (data-parallel attention).
    fn probe_shape(&self, mode: Mode, batch: u32) -> (Vec<usize>, usize) {
        let ranks: Vec<usize> = (0..self.buffers.len()).filter(|&r| takes_decode(&self.plan, mode, r)).collect();
        let rows = match mode {
            Mode::Tp => batch,
            Mode::Ep => batch.div_ceil(ranks.len().max(1) as u32),
        };
        (ranks, rows as usize)
    }

    /// `mode`'s KV as a calibration step's rows take it.
    fn probe_kv(&self, mode: Mode) -> ProbeKv {
        let mem = &self.plan.memory;
        let pool = match (mode, &mem.kv.tp) {
            (Mode::Tp, Some(tp)) => tp.pages,
            _ => mem.kv.ep.pages,
        };
        // A request's header is 8 words before its page table (`write_inputs`).
        let words = mem.buffer(mode, BufferName::RequestMeta).map_or(0, |b| b.row_bytes / 4);
        ProbeKv { page_tokens: mem.kv.page_tokens, pool, table: words.saturating_sub(8) }
    }

    /// [`Executor::probe_decode`]'s steps, each run as [`Executor::step`]
    /// runs a decode step of that shape, its rows all padding.
    fn time_steps(
        &mut self,
        plan: &Plan,
        mode: Mode,
        work: &[Vec<Work>],
        steps: usize,
    ) -> Result<Option<Vec<f64>>, ExecError> {
        let real = vec![0; work.len()];
        let graph = match self.graphs_on {
            true => self.bucketed(plan, mode, work, 0)?.map(|(size, _)| (mode, size)),
            false => None,
        };
        let mut times = Vec::with_capacity(steps);
        // A graph's bucket is kept or refused after its second step; a
        // call-by-call step is timed after one warm-up.
        let mut untimed = 0;
        while times.len() < steps.max(1) {
            let (timed, bucketed) = match graph.map(|k| self.graphs.get(&k)) {
                Some(Some(Graph::Kept { .. })) => (true, true),
                Some(None | Some(Graph::Warm)) if untimed < 2 => (false, true),
                Some(None | Some(Graph::Warm)) => return Ok(None),
                // A refused bucket runs padded to it, call by call.
                Some(Some(Graph::Refused(_))) => (untimed > 0, true),
                // Not a graph's shape: call by call at its own size.
                None => (untimed > 0, false),
            };
            let start = std::time::Instant::now();
            let ran = match bucketed {
                true => self.graphed_step_of(plan, mode, work, &real, 0).map(|_| ()),
                false => self.step_in_rounds(plan, mode, Phase::Decode, work, false).map(|_| ()),
            };
            match ran {
                Ok(()) => {}
                // The step does not fit the engine (its inputs, its posts).
                Err(ExecError::Capacity(_)) => return Ok(None),
                Err(e) => return Err(e),
            }
            if timed {
                for r in 0..self.buffers.len() {
                    self.fetch(r, 0, 4)?;
                }
                times.push(start.elapsed().as_secs_f64());
            } else {
                untimed += 1;
            }
        }
        Ok(Some(times))
    }

    /// Runs steps before serving (recording graphs, probing step costs) of
    /// padding or probe requests: no statistic they change is serving's,
    /// so every one is put back but `captured` and `refused`, and each
    /// graph they recorded counts as recorded before serving.
    fn before_serving<T>(
        &mut self,
        steps: impl FnOnce(&mut Self, &Plan) -> Result<T, ExecError>,
    ) -> Result<T, ExecError> {
        let plan = std::sync::Arc::clone(&self.plan);
        let (stats, counted, loads) = (self.graph_stats, self.counted(), self.expert_loads.clone());
        let ran = steps(self, &plan);
        self.expert_loads = loads;
        self.graph_stats = GraphStats {
            captured: self.graph_stats.captured,
            refused: self.graph_stats.refused,
            recorded_before_serving: stats.recorded_before_serving + (self.graph_stats.captured - stats.captured),
            ..stats
        };
        self.set_counted(counted);
        ran
    }

    /// [`Executor::capture_decode_graphs`]'s steps, bucket by bucket up to
    /// `last`, the kept ones into `kept`.
    fn capture_buckets(&mut self, plan: &Plan, mode: Mode, last: u32, kept: &mut Vec<u32>) -> Result<(), ExecError> {
        let mut size = 1;
        while size <= last {
            // No request: the bucket's rows are all padding.
            let work = vec![Vec::new(); self.buffers.len()];
            // A warm-up, then the recording (twice at most: a key is kept or
            // refused after its second step).
            for _ in 0..2 {
                if matches!(self.graphs.get(&(mode, size)), Some(Graph::Kept { .. } | Graph::Refused(_))) {
                    break;
                }
                if self.graphed_step(plan, mode, &work, size)?.is_none() {
                    return Ok(());
                }
            }
            if matches!(self.graphs.get(&(mode, size)), Some(Graph::Kept { .. })) {
                kept.push(size);
            }
            size = bucket(size + 1);
        }
        Ok(())
    }

    /// Whether decode steps run as graphs ([`Executor::use_graphs`]).
    pub fn records_graphs(&self) -> bool {
        self.graphs_on
    }

    /// Weight reshards so far: live switches and warm-up ones.
    pub fn reshards(&self) -> u64 {
        self.reshards
    }

    /// Whether a graph would hold `mode`'s decode step of one request a
    /// rank, the smallest bucket (what [`Executor::capture_decode_graphs`]
    /// records first): graphs on, the dispatch on fixed slots, the bucket
    /// within the step's inputs and one post round. `false` says recording
    /// that mode's graphs would keep none, before any step runs (a larger
    /// bucket asks more of each check); an error, that the step itself
    /// cannot be laid out (as recording it would fail).
    pub fn graphs_hold(&self, mode: Mode) -> Result<bool, ExecError> {
        let work = vec![Vec::new(); self.buffers.len()];
        Ok(self.graphs_on && self.bucketed(&self.plan, mode, &work, 1)?.is_some())
    }

    /// Counts the kept graphs as recorded now: a live switch or swap after
    /// this is one after their recording (what `replayed_after_switch` and
    /// `replayed_after_swap` count), the warm-up switches that recorded or
    /// probed them before serving are not.
    pub fn rebase_graphs(&mut self) {
        let (now, swaps) = (self.reshards, self.swap_overlap.swaps);
        for g in self.graphs.values_mut() {
            if let Graph::Kept { reshards, swaps: s, .. } = g {
                (*reshards, *s) = (now, swaps);
            }
        }
    }

    /// Runs decode steps as graphs where the device records them (the
    /// default there): each step padded to its batch bucket, the second
    /// step of a (mode, bucket) recorded, every later one replayed. Off,
    /// every step runs call by call at its own size.
    pub fn use_graphs(&mut self, on: bool) {
        self.graphs_on = on && self.dev.captures();
    }

    /// What the decode graphs did so far.
    pub fn graph_stats(&self) -> GraphStats {
        self.graph_stats
    }

    /// The (mode, bucket)s whose decode graph is kept, in order.
    pub fn graph_keys(&self) -> Vec<(Mode, u32)> {
        self.graphs.iter().filter(|(_, g)| matches!(g, Graph::Kept { .. })).map(|(k, _)| *k).collect()
    }

    /// Each (mode, bucket) whose recording the device refused, and why.
    pub fn graph_refusals(&self) -> Vec<String> {
        self.graphs
            .iter()
            .filter_map(|((mode, size), g)| match g {
                Graph::Refused(why) => Some(format!("{} decode, bucket {size}: {why}", mode.name())),
                _ => None,
            })
            .collect()
    }

    /// Routed entries whose device routing [`Executor::verify_routing`] checked.
    pub fn routing_checked(&self) -> u64 {
        self.routing_checked
    }

    /// The experts rank `rank`'s slots of MoE layer `moe_layer` hold now, as
    /// the dispatch routes to them.
    pub fn slot_experts(&self, moe_layer: usize, rank: usize) -> Option<&[u32]> {
        self.slots.get(moe_layer)?.get(rank).map(Vec::as_slice)
    }

    /// The routed entries per MoE layer and expert the dispatches counted
    /// since the last call (what a drift window sums), and a fresh count.
    pub fn take_expert_loads(&mut self) -> Vec<Vec<f64>> {
        let fresh = self.expert_loads.iter().map(|l| vec![0.0; l.len()]).collect();
        std::mem::replace(&mut self.expert_loads, fresh)
    }

    /// KV pages into rank `dst` from rank `src`'s pool (Moebius §4.3): the
    /// layer kernels' `kv_migrate` reads the source pool through its pointer
    /// and writes this rank's pages in the target format, by rows of
    /// (source page, destination page, tokens) written into `dst`'s
    /// `kv_moves` table, [`KV_MOVE_CHUNK`] rows a launch. Returns the bytes moved.
    pub fn migrate_kv(
        &mut self,
        m: &KvMigration,
        src: usize,
        dst: usize,
        moves: &[[i32; 3]],
    ) -> Result<u64, ExecError> {
        self.settle()?;
        let plan = self.plan.clone();
        let mem = &plan.memory;
        let bad = |what: &str| ExecError::Plan(format!("KV migration: {what}"));
        let table =
            mem.buffer(m.table_mode, BufferName::KvMoves).ok_or_else(|| bad("the plan has no kv_moves buffer"))?;
        let pool = mem.regions.get(mem.kv.region.index()).ok_or_else(|| bad("no KV region"))?.offset;
        let (layer, entry) = plan
            .kernels
            .iter()
            .find_map(|k| match &k.params {
                KernelParams::Layer(_) => {
                    Some((k.name.clone(), k.entries.iter().find(|e| e.symbol == "kv_migrate")?.clone()))
                }
                _ => None,
            })
            .ok_or_else(|| bad("no layer kernel with kv_migrate"))?;
        let module = *self.modules.get(&layer).ok_or_else(|| bad("the layer kernels are not loaded"))?;
        let (sb, db) = (self.buffer(src as u32)?, self.buffer(dst as u32)?);
        let i = |v: u32| KernelArg::I32(v as i32);
        let mut bytes = 0u64;
        for chunk in moves.chunks(KV_MOVE_CHUNK.min(table.rows) as usize) {
            self.dev.upload(db, table.offset, &le32(&chunk.iter().flatten().copied().collect::<Vec<_>>()))?;
            let args = [
                KernelArg::Ptr { buffer: db, offset: table.offset },
                i(chunk.len() as u32),
                KernelArg::Ptr { buffer: sb, offset: pool },
                KernelArg::I64(m.src.page_bytes as i64),
                i(m.src.heads),
                i(m.src.head0),
                KernelArg::Ptr { buffer: db, offset: pool },
                KernelArg::I64(m.dst.page_bytes as i64),
                i(m.dst.heads),
                i(m.dst.head0),
                i(m.heads),
                i(plan.model.layers),
            ];
            self.dev.launch(module, &entry.symbol, chunk.len() as u32, entry.block, &args)?;
            let tokens: u64 = chunk.iter().map(|r| r[2].max(0) as u64).sum();
            bytes += tokens * u64::from(m.heads) * u64::from(plan.model.layers) * mem.kv.head_token_bytes;
        }
        Ok(bytes)
    }

    /// Runs one step of `mode`'s `phase` program: `work[r]` is rank `r`'s
    /// requests. Returns, per rank and request, what was sampled.
    ///
    /// In a role plan each attention rank writes into a post of fixed rows
    /// in every MoE rank's dispatch buffer (`roles.posts`), so a source with
    /// more rows than its post dispatches in rounds, each after the MoE rank
    /// consumed the last (the schedule's rule). The rounds here are whole
    /// requests ([`post_rounds`]): each round is the program over a subset
    /// of every rank's requests that fits the posts, one after another. A
    /// request's rows never depend on another's, so the tokens are the
    /// one-round step's; only a request whose own tokens exceed its post is
    /// refused.
    pub fn step(
        &mut self,
        mode: Mode,
        phase: Phase,
        work: &[Vec<Work>],
    ) -> Result<Vec<Vec<Option<Sampled>>>, ExecError> {
        let plan = std::sync::Arc::clone(&self.plan);
        if self.graphs_on && phase == Phase::Decode {
            match self.graphed_step(&plan, mode, work, 0)? {
                Some(out) => return Ok(out),
                None => self.graph_stats.eager += 1,
            }
        }
        self.step_in_rounds(&plan, mode, phase, work, true)
    }

    /// A step run call by call, in as many steps as its posts need (each
    /// round's requests fit the rows every post reserves). `real`: the
    /// requests are requests; otherwise all padding (no KV, nothing
    /// returned).
    fn step_in_rounds(
        &mut self,
        plan: &Plan,
        mode: Mode,
        phase: Phase,
        work: &[Vec<Work>],
        real: bool,
    ) -> Result<Vec<Vec<Option<Sampled>>>, ExecError> {
        let count = |w: &[Vec<Work>]| -> Vec<usize> { w.iter().map(|x| if real { x.len() } else { 0 }).collect() };
        let rounds = post_rounds(plan, mode, phase, work)?;
        if rounds.len() <= 1 {
            return self.step_with(plan, mode, phase, work, &count(work), Body::Eager);
        }
        let mut out: Vec<Vec<Option<Sampled>>> = work.iter().map(|w| vec![None; w.len()]).collect();
        for round in &rounds {
            let part: Vec<Vec<Work>> =
                round.iter().zip(work).map(|(ix, w)| ix.iter().map(|&i| w[i].clone()).collect()).collect();
            let got = self.step_with(plan, mode, phase, &part, &count(&part), Body::Eager)?;
            for ((ix, o), g) in round.iter().zip(out.iter_mut()).zip(got) {
                for (&i, s) in ix.iter().zip(g) {
                    o[i] = s;
                }
            }
        }
        self.dispatch_traffic.rounds += rounds.len() as u64 - 1;
        Ok(out)
    }

    /// One step over `work`, of which each rank's first `real` requests
    /// are requests and the rest padding (no KV written, nothing returned),
    /// its device work issued as `body` says.
    fn step_with(
        &mut self,
        plan: &Plan,
        mode: Mode,
        phase: Phase,
        work: &[Vec<Work>],
        real: &[usize],
        body: Body,
    ) -> Result<Vec<Vec<Option<Sampled>>>, ExecError> {
        let mem = &plan.memory;
        let p = self.buffers.len();
        if work.len() != p {
            return Err(ExecError::Plan(format!("work for {} ranks; the plan has {p}", work.len())));
        }
        // The ranks that take part in this step: those with a program for
        // (mode, phase). A role plan's GPUs of the other phase have none.
        let programs: Vec<Option<&Program>> = (0..p as u32)
            .map(|r| plan.programs.iter().find(|g| g.mode == mode && g.phase == phase && g.ranks.contains(&r)))
            .collect();
        for (r, (g, w)) in programs.iter().zip(work).enumerate() {
            if g.is_none() && !w.is_empty() {
                return Err(ExecError::Plan(format!(
                    "rank {r} has requests but runs no {} {} program",
                    mode.name(),
                    phase.name()
                )));
            }
        }
        let running: Vec<(usize, &Program)> =
            programs.iter().enumerate().filter_map(|(r, g)| Some((r, (*g)?))).collect();
        let Some(&(_, first)) = running.first() else {
            return Err(ExecError::Plan(format!("no {} {} program", mode.name(), phase.name())));
        };
        // One step shape: the same micro-batches and blocks over the same
        // layers on every rank (a MoE server's blocks outside the MoE layers
        // are empty).
        for &(_, g) in &running {
            let same = g.micro_batches == first.micro_batches
                && g.blocks.len() == first.blocks.len()
                && g.blocks.iter().zip(&first.blocks).all(|(a, b)| a.kind == b.kind && a.layers == b.layers);
            if !same {
                return Err(ExecError::Plan(format!(
                    "the {} {} programs of ranks {:?} and {:?} do not step through the same blocks",
                    mode.name(),
                    phase.name(),
                    first.ranks,
                    g.ranks
                )));
            }
        }
        let mbs = first.micro_batches.max(1) as usize;
        let top_k = plan.model.top_k;
        let experts = plan.model.experts;
        let split: Vec<Vec<std::ops::Range<usize>>> = work.iter().map(|w| micro_batches(w.len(), mbs)).collect();
        let mut counts = vec![vec![Counts::default(); mbs]; p];
        for &(r, _) in &running {
            let local = match mode {
                Mode::Tp => experts,
                Mode::Ep => plan.local_experts(r),
            };
            for (m, range) in split[r].iter().enumerate() {
                let reqs = real[r].saturating_sub(range.start).min(range.len());
                let c = self.write_inputs(mem, mode, mbs as u32, r, m as u32, &work[r][range.clone()], reqs)?;
                counts[r][m] = Counts {
                    tokens: c.0,
                    entries: c.0 * top_k,
                    sampled_rows: c.1,
                    local_experts: local,
                    ..Counts::default()
                };
            }
        }
        // Each micro-batch slice's permutation overflow word, on every rank
        // that lays out routed rows: cleared before the step, read after it.
        // With it, the room the rank's layouts are given (checked against
        // its buffers and experts by `Executor::new`), for the error.
        let overflow: Vec<(usize, u32, u64, i64)> = running
            .iter()
            .filter_map(|&(r, g)| {
                let op = g.blocks.iter().flat_map(|b| &b.ops).find(|op| lays_out(op))?;
                let room = match op.args.get(2) {
                    Some(moeforge_plan::program::Arg::Int { value }) => *value,
                    _ => 0,
                };
                Some((r, room))
            })
            .flat_map(|(r, room)| (0..mbs as u32).map(move |m| (r, m, room)))
            .filter_map(|(r, m, room)| {
                let site =
                    Site { mem, mode, micro_batches: mbs as u32, rank: r as u32, layer: 0, buffer: self.buffers[r] };
                let at = bind::buffer_address(&site, Some(m).filter(|_| mbs > 1), BufferName::RouteIndex)?;
                Some((r, m, at + route_parts(&site, plan).overflow, room))
            })
            .collect();
        for &(r, _, at, _) in &overflow {
            self.dev.upload(self.buffers[r], at, &0i32.to_le_bytes())?;
        }
        // A refused layout is seen only after the step: what the step
        // counted (expert loads for Zepp's drift window, traffic) is put
        // back then, as if it had not run.
        let counted = (self.expert_loads.clone(), self.traffic, self.dispatch_traffic);
        match body {
            Body::Eager => self.run_blocks(plan, mode, phase, &running, &mut counts)?,
            Body::Capture(mode, size) => {
                // The step counts from zero, so what it counted is its own.
                let before = self.counted();
                self.set_counted(Counted::default());
                let kept = counts.clone();
                let recorded = self.dev.begin_capture().map_err(ExecError::from).and_then(|()| {
                    self.capturing = true;
                    let ran = self.run_blocks(plan, mode, phase, &running, &mut counts);
                    self.capturing = false;
                    // The recording ends whatever happened, so the device
                    // is never left recording.
                    let graph = self.dev.end_capture();
                    ran?;
                    Ok(graph?)
                });
                match recorded {
                    Ok(graph) => {
                        let counted = self.counted();
                        self.set_counted(before);
                        self.graphs.insert(
                            (mode, size),
                            Graph::Kept { graph, counted, reshards: self.reshards, swaps: self.swap_overlap.swaps },
                        );
                        self.graph_stats.captured += 1;
                        self.replay_graph(graph, counted, false)?;
                    }
                    Err(e) => {
                        // Nothing recorded ran: the step runs call by call
                        // (a real fault shows there again), and the key is
                        // not recorded again.
                        self.graphs.insert((mode, size), Graph::Refused(e.to_string()));
                        self.graph_stats.refused += 1;
                        self.set_counted(before);
                        counts = kept;
                        self.run_blocks(plan, mode, phase, &running, &mut counts)?;
                    }
                }
            }
            Body::Replay(graph, counted) => self.replay_graph(graph, counted, true)?,
        }
        // Every queued swap the step's work joined finished before the
        // step's last work did: the host's wait returns at once and hands
        // their resources back (a swap no step joined yet goes on).
        if !self.side.is_empty() && self.side.iter().all(|x| x.2) {
            self.settle()?;
        }
        // The ranks whose dispatches routed this step (a replicated
        // placement's counted their loads on the device).
        let sources: Vec<usize> =
            running.iter().map(|&(r, _)| r).filter(|&r| counts[r].iter().any(|c| c.tokens > 0)).collect();
        for &(r, m, at, room) in &overflow {
            if i32s(&self.fetch(r, at, 4)?).first().is_some_and(|&x| x != 0) {
                (self.expert_loads, self.traffic, self.dispatch_traffic) = counted;
                self.collect_loads(&sources, false)?;
                return Err(ExecError::Capacity(format!(
                    "rank {r}, micro-batch {m}: a layer's routed rows, each expert's padded to its tile, passed the \
                     {room} rows its permutation is given (the step's outputs are not used)"
                )));
            }
        }
        self.collect_loads(&sources, true)?;
        // Read back what was sampled.
        let vocab = mem.buffer(mode, BufferName::Logits).map_or(0, |b| b.row_bytes / 4);
        let mut out = Vec::with_capacity(p);
        for r in 0..p {
            let mut per = vec![None; work[r].len()];
            if work[r].is_empty() {
                out.push(per);
                continue;
            }
            for (m, range) in split[r].iter().enumerate() {
                let site =
                    Site { mem, mode, micro_batches: mbs as u32, rank: r as u32, layer: 0, buffer: self.buffers[r] };
                let mb = Some(m as u32).filter(|_| mbs > 1);
                let at = |name| bind::buffer_address(&site, mb, name);
                let (Some(sampled), Some(logits), Some(meta)) =
                    (at(BufferName::Sampled), at(BufferName::Logits), at(BufferName::RequestMeta))
                else {
                    return Err(ExecError::Plan("the plan has no sampled-token, logits or request buffers".into()));
                };
                let words = mem.buffer(mode, BufferName::RequestMeta).map_or(0, |b| b.row_bytes / 4);
                let rows = counts[r][m].sampled_rows as u64;
                let tokens = i32s(&self.fetch(r, sampled, rows * 4)?);
                let all = f32s(&self.fetch(r, logits, rows * vocab * 4)?);
                let mut j = 0usize;
                for (i, w) in work[r][range.clone()].iter().enumerate() {
                    if !w.sample || range.start + i >= real[r] {
                        continue;
                    }
                    let hdr = i32s(&self.fetch(r, meta + i as u64 * words * 4, 32)?);
                    let rng = u64::from(hdr[6] as u32) | (u64::from(hdr[7] as u32) << 32);
                    let row = all[j * vocab as usize..(j + 1) * vocab as usize].to_vec();
                    per[range.start + i] = Some(Sampled { token: tokens[j] as u32, rng, logits: row });
                    j += 1;
                }
            }
            out.push(per);
        }
        Ok(out)
    }

    /// Issues the step's ops over every block and layer: the ranks meet at
    /// communication ops (each runs its ops up to the next one, then every
    /// group moves its rows).
    fn run_blocks(
        &mut self,
        plan: &Plan,
        mode: Mode,
        phase: Phase,
        running: &[(usize, &Program)],
        counts: &mut [Vec<Counts>],
    ) -> Result<(), ExecError> {
        let Some(&(_, first)) = running.first() else { return Ok(()) };
        let mbs = first.micro_batches.max(1);
        let mut routes: Vec<Routes> = vec![vec![]; mbs as usize];
        for (bi, block) in first.blocks.iter().enumerate() {
            for layer in block.layers.map_or(0..1, |[a, e]| a..e) {
                let meets = rendezvous(running, bi, mode, phase)?;
                for (j, meet) in meets.iter().enumerate() {
                    for &(r, g) in running {
                        for op in chunk(&g.blocks[bi].ops, j) {
                            let m = op.micro_batch.unwrap_or(0) as usize;
                            let site = Site {
                                mem: &plan.memory,
                                mode,
                                micro_batches: mbs,
                                rank: r as u32,
                                layer,
                                buffer: self.buffers[r],
                            };
                            self.run_op(plan, &site, op, phase, &mut counts[r][m])?;
                        }
                    }
                    for op in meet {
                        let m = op.micro_batch.unwrap_or(0) as usize;
                        self.comm(plan, mode, phase, mbs, op, layer, counts, m, &mut routes[m])?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Runs a kept graph as the step, adding what its recording counted.
    /// Its expert computations join their layers' queued swaps on the
    /// device (the recorded [`Executor::join_side`]s), so the swaps queued
    /// now run beside the replay up to each layer's experts. Its ops are
    /// not counted in `SwapOverlap::ops_beside` (only those up to a join
    /// ran beside a swap; the device's own count times them).
    /// `kept`: a graph recorded at an earlier step (not this step's own
    /// recording), so a swap queued now was queued after it was recorded.
    fn replay_graph(&mut self, graph: GraphId, counted: Counted, kept: bool) -> Result<(), ExecError> {
        let beside = kept && self.side.iter().any(|x| !x.2);
        self.dev.replay(graph)?;
        self.graph_stats.replayed_beside_swap += u64::from(beside);
        self.joined(None);
        self.set_counted(self.counted().plus(counted));
        self.graph_stats.replayed += 1;
        Ok(())
    }

    /// The counters a step adds to.
    fn counted(&self) -> Counted {
        Counted { dispatch: self.dispatch_traffic, combine: self.traffic, main_ops: self.main_ops }
    }

    /// Sets the counters a step adds to.
    fn set_counted(&mut self, c: Counted) {
        (self.dispatch_traffic, self.traffic, self.main_ops) = (c.dispatch, c.combine, c.main_ops);
    }

    /// A decode step as its batch bucket's graph (a warm-up, the recording
    /// or a replay), the bucket at least `least` requests (the most any
    /// rank takes otherwise); `None` where no graph holds the step (it then
    /// runs call by call).
    fn graphed_step(
        &mut self,
        plan: &Plan,
        mode: Mode,
        work: &[Vec<Work>],
        least: u32,
    ) -> Result<Option<Vec<Vec<Option<Sampled>>>>, ExecError> {
        let real: Vec<usize> = work.iter().map(Vec::len).collect();
        self.graphed_step_of(plan, mode, work, &real, least)
    }

    /// [`Executor::graphed_step`] whose first `real[r]` requests of rank r
    /// are requests and the rest padding (a probe's rows are all padding).
    fn graphed_step_of(
        &mut self,
        plan: &Plan,
        mode: Mode,
        work: &[Vec<Work>],
        real: &[usize],
        least: u32,
    ) -> Result<Option<Vec<Vec<Option<Sampled>>>>, ExecError> {
        let phase = Phase::Decode;
        let Some((size, padded)) = self.bucketed(plan, mode, work, least)? else { return Ok(None) };
        let (body, after_switch, after_swap) = match self.graphs.get(&(mode, size)) {
            None | Some(Graph::Refused(_)) => (Body::Eager, false, false),
            Some(Graph::Warm) => (Body::Capture(mode, size), false, false),
            Some(&Graph::Kept { graph, counted, reshards, swaps }) => {
                (Body::Replay(graph, counted), reshards < self.reshards, swaps < self.swap_overlap.swaps)
            }
        };
        let ran = self.step_with(plan, mode, phase, &padded, real, body);
        let mut out = ran?;
        self.graph_stats.padded_rows += padded.iter().zip(real).map(|(p, &n)| (p.len() - n) as u64).sum::<u64>();
        self.graph_stats.replayed_after_switch += u64::from(after_switch);
        self.graph_stats.replayed_after_swap += u64::from(after_swap);
        match self.graphs.entry((mode, size)) {
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert(Graph::Warm);
                self.graph_stats.warmups += 1;
            }
            // A refused key's steps (the refused one included) run call by call.
            std::collections::btree_map::Entry::Occupied(e) if matches!(e.get(), Graph::Refused(_)) => {
                self.graph_stats.eager += 1;
            }
            std::collections::btree_map::Entry::Occupied(_) => {}
        }
        for (o, &n) in out.iter_mut().zip(real) {
            o.truncate(n);
        }
        Ok(Some(out))
    }

    /// `work` padded to its batch bucket, where the step is one a graph
    /// holds: a decode step (one token per request) of a plan whose
    /// dispatches take fixed slots (not routed on request, a replicated
    /// placement's routed on the device), every rank that takes requests (all of a colocated plan's;
    /// a role plan's decode servers) padded to the bucket of the most
    /// requests any of them has (at least `least`), so the step's launches, transfers and
    /// fills are the bucket's whatever the batch; padding requests are one
    /// token each, write no KV and are not returned. `None` (run it call by
    /// call) where the padded step would not fit one step's inputs, would
    /// need dispatch rounds, or a dispatch of it would be routed.
    fn bucketed(&self, plan: &Plan, mode: Mode, work: &[Vec<Work>], least: u32) -> Result<Option<Bucketed>, ExecError> {
        if self.route_decode {
            return Ok(None);
        }
        if work.iter().flatten().any(|w| w.tokens.len() != 1) {
            return Ok(None);
        }
        let most = work.iter().map(Vec::len).max().unwrap_or(0).max(least as usize);
        if most == 0 {
            return Ok(None);
        }
        let size = bucket(u32::try_from(most).unwrap_or(u32::MAX));
        let programs: Vec<&Program> =
            plan.programs.iter().filter(|g| g.mode == mode && g.phase == Phase::Decode).collect();
        let Some(mbs) = programs.first().map(|g| g.micro_batches.max(1)) else { return Ok(None) };
        // Every step input's slice holds a micro-batch's padded requests
        // (one token, one sampled row each).
        let per = u64::from(size.div_ceil(mbs));
        let inputs = [
            BufferName::TokenIds,
            BufferName::Positions,
            BufferName::SlotMap,
            BufferName::RowRequest,
            BufferName::SampleRows,
            BufferName::RequestMeta,
            BufferName::Sampled,
            BufferName::Logits,
        ];
        let fits = inputs.iter().all(|&name| {
            plan.memory.buffer(mode, name).is_some_and(|b| per <= b.slice_bytes(mbs) / b.row_bytes.max(1))
        });
        if !fits {
            return Ok(None);
        }
        let padded: Vec<Vec<Work>> = work
            .iter()
            .enumerate()
            .map(|(r, w)| {
                let mut w = w.clone();
                if takes_decode(plan, mode, r) {
                    w.resize(size as usize, Work::padding());
                }
                w
            })
            .collect();
        if post_rounds(plan, mode, Phase::Decode, &padded)?.len() > 1 {
            return Ok(None);
        }
        // Each rank's tokens in micro-batch m, as the step splits them.
        let tokens = |s: usize, m: u32| -> u64 {
            let n = padded.get(s).map_or(0, Vec::len);
            micro_batches(n, mbs as usize).get(m as usize).map_or(0, |r| r.len() as u64)
        };
        for op in programs.iter().flat_map(|g| g.ops()).map(|(_, op)| op) {
            let Some(c) = op.comm.as_ref().filter(|c| c.kind == CommKind::AllToAll && !c.with.is_empty()) else {
                continue;
            };
            let m = op.micro_batch.unwrap_or(0);
            if !self.fixed_slots(plan, mode, Phase::Decode, mbs, c, &|s| tokens(s, m)) {
                return Ok(None);
            }
        }
        Ok(Some((size, padded)))
    }

    /// Whether a dispatch takes fixed slots ([`Executor::comm`]'s dispatch
    /// says when), given each source's tokens in the micro-batch.
    fn fixed_slots(
        &self,
        plan: &Plan,
        mode: Mode,
        phase: Phase,
        mbs: u32,
        c: &moeforge_plan::program::Comm,
        tokens: &dyn Fn(usize) -> u64,
    ) -> bool {
        let k = plan.model.top_k as usize;
        let mem = &plan.memory;
        let holders: Vec<usize> = c.group.iter().map(|&r| r as usize).filter(|&d| plan.local_experts(d) > 0).collect();
        let row = mem.buffer(mode, c.to).map_or(0, |b| b.row_bytes);
        // More ranks than top-k: only with the rows gated on the device (a
        // row to every rank would move more than the routed pairs); its
        // combine's sums are gated by the same ids, so it reads no more
        // rows than the routed pairs either.
        // A replicated placement's dispatch takes fixed slots where its
        // routing runs on the device and the rows can carry its slots (one
        // i32 per entry, as the ids' rows), unless each routing is checked
        // against the host's (which reads the slots back).
        let replicated = plan.placement.is_some() || self.zepp.is_some();
        let slots_as_ids = self.zepp.is_some()
            && !self.verify_routing
            && c.with.first().and_then(|w| mem.buffer(mode, w[0])).is_some_and(|b| b.row_bytes == 4 * k as u64);
        if phase != Phase::Decode
            || self.route_decode
            || (replicated && !slots_as_ids)
            || c.relay.is_some()
            || (holders.len() > k && !self.gates_rows(row, k))
        {
            return false;
        }
        let cap = mem.buffer(mode, c.to).map_or(0, |b| b.slice_bytes(mbs)) / row.max(1);
        let posts = posts_of(plan, mbs);
        if posts.is_empty() {
            c.group.iter().map(|&s| tokens(s as usize)).sum::<u64>() <= cap
        } else {
            c.group.iter().map(|&s| s as usize).all(|s| {
                holders.iter().all(|&d| {
                    tokens(s) == 0
                        || posts.get(&(s, d)).is_some_and(|&(first, rows)| tokens(s) <= rows && first + rows <= cap)
                })
            })
        }
    }

    /// Whether the bundle's dispatch program gates rows of `row` bytes on
    /// `k` ids ([`moeforge_plan::transfers::gated_rows`]).
    fn gates_rows(&self, row: u64, k: usize) -> bool {
        self.dispatch
            .as_ref()
            .is_some_and(|code| code.program.gated_shapes().iter().any(|g| g.run_bytes == row && g.ids as usize == k))
    }

    /// A replicated placement's routing of one dispatch, on the device
    /// (Zepp §5): each source counts its entries per expert (`zepp_count`,
    /// its row of the demand matrix, also added to its `expert_loads` row
    /// of the layer), the rows are exchanged among the group (one batch of
    /// the compiled dispatch program), and every source with entries runs
    /// `zepp_route` over MoE layer `moe_layer`'s replica table, writing the
    /// physical slot of each of its entries at its [`Source::dest`]. With
    /// `ids` (the host read the sources' top-k ids: a routed dispatch) it
    /// reads those back: `(source, entry) → (destination rank, physical
    /// slot id)`; without (a fixed-slot dispatch, which moves the slots
    /// themselves as the rows' ids) it reads nothing, so a graph can hold
    /// it, and returns no assignment.
    fn route(
        &mut self,
        plan: &Plan,
        z: ZeppRouting,
        moe_layer: usize,
        sources: &BTreeMap<usize, Source>,
        ids: Option<&BTreeMap<usize, Vec<i32>>>,
        group: &[usize],
    ) -> Result<Assigned, ExecError> {
        let (world, experts) = (self.buffers.len(), plan.model.experts as usize);
        let gpn = (plan.cluster.gpus_per_node as usize).max(1);
        if world != plan.ranks.len() {
            return Err(ExecError::Plan(format!(
                "the replica routing routes over every rank: {world} buffers for {} ranks",
                plan.ranks.len()
            )));
        }
        if world % gpn != 0 || z.slots_per_gpu == 0 {
            return Err(ExecError::Plan(format!(
                "the replica routing needs whole nodes of {gpn} GPUs and expert slots on them ({world} ranks, {} \
                 slots per GPU)",
                z.slots_per_gpu
            )));
        }
        let end = z.route + z.parts.bytes;
        let row = |s: usize| z.route + z.parts.demand + (s * experts * 4) as u64;
        let buffers = self.buffers.clone();
        let ptr = |s: usize, offset: u64| KernelArg::Ptr { buffer: buffers[s], offset };
        let int = |x: usize| i32::try_from(x).map(KernelArg::I32);
        let too_big = |what: &str| ExecError::Capacity(format!("the replica routing: {what} past an i32"));
        let totals = z.loads + (moe_layer * experts * 4) as u64;
        let k = plan.model.top_k as usize;
        for (&s, src) in sources {
            if src.dest + 4 * src.entries as u64 > end {
                return Err(ExecError::Capacity(format!(
                    "rank {s}: {} routed entries past the routing's {} (a step's entries)",
                    src.entries,
                    (z.parts.bytes - z.parts.dest) / 4
                )));
            }
            let args = [
                ptr(s, src.ids),
                int(src.entries).map_err(|_| too_big("entries"))?,
                int(experts).map_err(|_| too_big("experts"))?,
                ptr(s, row(s)),
                ptr(s, totals),
                ptr(s, src.kv_slots),
                int(k).map_err(|_| too_big("top-k"))?,
            ];
            self.dev.launch(z.module, "zepp_count", z.count_blocks, z.threads, &args)?;
        }
        // Every source's row to every source that routes (the counts
        // exchange: ExpertPlex's metadata before the rows, Zepp's "metadata
        // exchange"), rows of ranks outside the group masked by `member`.
        let routing: Vec<usize> = sources.iter().filter(|(_, x)| x.entries > 0).map(|(&s, _)| s).collect();
        let mut copies = Vec::new();
        for &s in sources.keys() {
            for &d in routing.iter().filter(|&&d| d != s) {
                copies.push(Transfer {
                    src: s as u32,
                    dst: d as u32,
                    copy: StridedCopy::one_run(row(s), row(s), (experts * 4) as u64),
                });
            }
        }
        if !copies.is_empty() {
            let code = self.code(&self.dispatch, "dispatch")?;
            let batch =
                code.program.batch(&copies).map_err(|e| ExecError::Plan(format!("the counts exchange: {e}")))?;
            self.dev.transfer(&code, &[batch], &self.buffers)?;
        }
        let member: Vec<i32> = (0..world).map(|r| i32::from(group.contains(&r))).collect();
        let table = z.table + (moe_layer * experts * z.width * 4) as u64;
        let mut out = BTreeMap::new();
        for s in routing {
            let src = sources[&s];
            // The group's membership is the same at every dispatch of this
            // source, so it is written once, by the first step (a graph's
            // warm-up runs call by call), and never inside a recording.
            if self.members.get(&s) != Some(&member) {
                self.store(s, z.route + z.parts.member, &le32(&member))?;
                self.members.insert(s, member.clone());
            }
            let args = [
                ptr(s, src.ids),
                int(src.entries).map_err(|_| too_big("entries"))?,
                ptr(s, z.route + z.parts.demand),
                ptr(s, table),
                ptr(s, z.route + z.parts.member),
                int(experts).map_err(|_| too_big("experts"))?,
                int(z.width).map_err(|_| too_big("replicas"))?,
                int(world).map_err(|_| too_big("ranks"))?,
                int(gpn).map_err(|_| too_big("GPUs per node"))?,
                int(z.slots_per_gpu).map_err(|_| too_big("slots"))?,
                int(s).map_err(|_| too_big("ranks"))?,
                ptr(s, z.route + z.parts.work),
                ptr(s, src.dest),
            ];
            self.dev.launch(z.module, "zepp_route", 1, z.threads, &args)?;
            if ids.is_none() {
                continue;
            }
            let dest = i32s(&self.fetch(s, src.dest, (src.entries * 4) as u64)?);
            for (i, &p) in dest.iter().enumerate() {
                let Ok(p) = usize::try_from(p) else { continue };
                let g = p / z.slots_per_gpu;
                if g >= world || !group.contains(&g) {
                    return Err(ExecError::Plan(format!("the replica routing sent an entry to slot {p}")));
                }
                out.insert((s, i), (g, p as i32));
            }
        }
        let Some(ids_of) = ids else { return Ok(out) };
        if self.verify_routing {
            let slots = self.slots.get(moe_layer).map_or(&[][..], Vec::as_slice);
            let want = host_routing(plan, slots, ids_of, group);
            let differs = want.keys().chain(out.keys()).find(|k| want.get(k) != out.get(k));
            if let Some(&(s, i)) = differs {
                let say = |x: Option<&(usize, i32)>| {
                    x.map_or("nowhere".to_string(), |&(g, slot)| format!("rank {g} (physical slot {slot})"))
                };
                return Err(ExecError::Plan(format!(
                    "MoE layer {moe_layer}: the device routed source {s}'s entry {i} to {}, the host routing to {}",
                    say(out.get(&(s, i))),
                    say(want.get(&(s, i)))
                )));
            }
            self.routing_checked += out.len() as u64;
        }
        Ok(out)
    }

    /// Adds the expert loads a step's routings counted on the device
    /// (`zepp_count`, into each source's `expert_loads`) to
    /// [`Executor::take_expert_loads`]'s (`keep`), or drops them (a step
    /// whose outputs are not used), and zeroes them there: one readback
    /// per source after the step, none inside it.
    fn collect_loads(&mut self, sources: &[usize], keep: bool) -> Result<(), ExecError> {
        let Some(z) = self.zepp else { return Ok(()) };
        let experts = self.expert_loads.first().map_or(0, Vec::len);
        let bytes = (self.expert_loads.len() * experts * 4) as u64;
        if bytes == 0 {
            return Ok(());
        }
        for &r in sources {
            if keep {
                let counted = i32s(&self.fetch(r, z.loads, bytes)?);
                for (loads, row) in self.expert_loads.iter_mut().zip(counted.chunks(experts)) {
                    loads.iter_mut().zip(row).for_each(|(x, &c)| *x += f64::from(c));
                }
            }
            let b = self.buffer(r as u32)?;
            self.dev.fill(b, z.loads, bytes, 0)?;
        }
        Ok(())
    }

    /// Writes one micro-batch's step inputs on rank `r`: token ids,
    /// positions, KV slots, request headers with page tables, each row's
    /// request and the sampled rows; `reqs` past the first `real` are
    /// padding. Returns (tokens, sampled rows).
    #[allow(clippy::too_many_arguments)]
    fn write_inputs(
        &mut self,
        mem: &MemoryPlan,
        mode: Mode,
        mbs: u32,
        r: usize,
        m: u32,
        reqs: &[Work],
        real: usize,
    ) -> Result<(u32, u32), ExecError> {
        let pages = match (mode, &mem.kv.tp) {
            (Mode::Tp, Some(tp)) => tp.pages,
            _ => mem.kv.ep.pages,
        };
        let words = mem.buffer(mode, BufferName::RequestMeta).map_or(0, |b| b.row_bytes / 4) as usize;
        let StepInputs { ids, pos, slots, row_req, sample, meta } =
            step_inputs(reqs, real, mem.kv.page_tokens, pages, words, r)?;
        let mb = Some(m).filter(|_| mbs > 1);
        for (name, data) in [
            (BufferName::TokenIds, le32(&ids)),
            (BufferName::Positions, le32(&pos)),
            (BufferName::SlotMap, le32(&slots)),
            (BufferName::RowRequest, le32(&row_req)),
            (BufferName::SampleRows, le32(&sample)),
            (BufferName::StepCounts, le32(&[ids.len() as i32, sample.len() as i32, 0, 0])),
            (BufferName::RequestMeta, le32(&meta)),
        ] {
            let b = mem
                .buffer(mode, name)
                .ok_or_else(|| ExecError::Plan(format!("the {} plan has no {name:?} buffer", mode.name())))?;
            if data.len() as u64 > b.slice_bytes(mbs) {
                return Err(ExecError::Capacity(format!(
                    "{} bytes of {name:?} for a slice of {}",
                    data.len(),
                    b.slice_bytes(mbs)
                )));
            }
            let site = Site { mem, mode, micro_batches: mbs, rank: r as u32, layer: 0, buffer: self.buffers[r] };
            let at = bind::buffer_address(&site, mb, name).unwrap_or(b.offset);
            self.dev.upload(self.buffers[r], at, &data)?;
        }
        Ok((ids.len() as u32, sample.len() as u32))
    }

    /// One launch, APK operation or skip on one rank.
    fn run_op(
        &mut self,
        plan: &Plan,
        site: &Site<'_>,
        op: &Op,
        phase: Phase,
        counts: &mut Counts,
    ) -> Result<(), ExecError> {
        // The routed experts' computation reads the layer's slots: a swap
        // queued for them finishes first (nothing else of the layer waits).
        if op.kind == OpKind::Experts {
            self.join_side(site.layer)?;
        }
        if matches!(op.kernel, KernelRef::Post { .. } | KernelRef::Launch { .. }) {
            self.main_ops += 1;
        }
        match &op.kernel {
            KernelRef::Missing { family } => Err(ExecError::Missing { op: op.name.clone(), family: family.clone() }),
            KernelRef::Skip { .. } => Ok(()),
            KernelRef::Transfer => Ok(()),
            KernelRef::Post { instance } => self.apk(plan, site, op, instance, phase, counts),
            KernelRef::Launch { instance, .. } if op.gemm.is_some() || op.kind == OpKind::Experts => {
                self.apk(plan, site, op, instance, phase, counts)
            }
            KernelRef::Launch { entry, .. } => {
                // The permutation's maps hold `capacity` entries and padded
                // rows: a step past them is refused before a kernel runs.
                let parts = route_parts(site, plan);
                let entries = u64::from(counts.entries.max(counts.received_entries));
                if entry == "moe_count" && entries > parts.capacity {
                    return Err(ExecError::Capacity(format!(
                        "rank {}: {entries} routed entries for a permutation of {}",
                        site.rank, parts.capacity
                    )));
                }
                // The padded rows stay on the device (`offsets[num_local]`,
                // read there by the scatter, the gather and the experts);
                // a layout past its room sets the slice's overflow word,
                // which the step reads once at its end.
                bind::launch(self.dev.as_mut(), &plan.kernels, &self.modules, site, op, counts)?;
                Ok(())
            }
        }
    }

    /// A GEMM on the dense APK or an experts op on the MoE APK, launched
    /// for this one operation (the emulated APK launch's flat arguments:
    /// the template pointers, the posted counts, phase, layer and shape).
    fn apk(
        &mut self,
        plan: &Plan,
        site: &Site<'_>,
        op: &Op,
        instance: &str,
        phase: Phase,
        counts: &Counts,
    ) -> Result<(), ExecError> {
        let bad = |m: String| ExecError::Plan(format!("op `{}`: {m}", op.name));
        let k =
            plan.kernels.iter().find(|k| k.name == instance).ok_or_else(|| bad(format!("no kernel `{instance}`")))?;
        let (KernelParams::Apk(a), Some(entry)) = (&k.params, k.entries.first()) else {
            return Err(bad(format!("`{instance}` is not an APK")));
        };
        let module = *self.modules.get(instance).ok_or_else(|| bad(format!("`{instance}` is not loaded")))?;
        let addr = |o: &Operand| bind::address(site, op, o).ok_or_else(|| bad(format!("no {o:?} in the memory plan")));
        let ptr = |offset: u64| KernelArg::Ptr { buffer: site.buffer, offset };
        let bufname = |list: &[Operand]| {
            list.iter().find_map(|o| match *o {
                Operand::Buffer { name } => Some(name),
                _ => None,
            })
        };
        let weights: Vec<(TensorRole, TensorPart)> = op
            .reads
            .iter()
            .filter_map(|o| match *o {
                Operand::Weight { role, part } => Some((role, part)),
                _ => None,
            })
            .collect();
        let wptr = |part: TensorPart, nth: usize| -> Result<KernelArg, ExecError> {
            match weights.iter().filter(|w| w.1 == part).nth(nth) {
                Some(&(role, part)) => Ok(ptr(addr(&Operand::Weight { role, part })?)),
                None => Ok(KernelArg::Null),
            }
        };
        let clusters = a.max_clusters.clamp(1, 2);
        let grid = clusters * a.cluster_size.max(1);
        let i = |v: u32| KernelArg::I32(v as i32);
        // A row bound, clamped to the int the APK takes (a bound only needs
        // to cover the rows, which never come near it).
        let bound = |rows: u64| KernelArg::I32(i32::try_from(rows).unwrap_or(i32::MAX));
        let args = if let Some(g) = op.gemm {
            if a.form != ApkForm::Dense {
                return Err(bad(format!("a GEMM on the {:?} APK", a.form)));
            }
            let (Some(xn), Some(yn)) = (bufname(&op.reads), bufname(&op.writes)) else {
                return Err(bad("a GEMM without input and output buffers".into()));
            };
            let (Some(xb), Some(yb)) = (site.mem.buffer(site.mode, xn), site.mem.buffer(site.mode, yn)) else {
                return Err(bad(format!("no {xn:?} or {yn:?} buffer")));
            };
            let eb = g.epilogue.out_bytes();
            let x = addr(&Operand::Buffer { name: xn })? + u64::from(g.x_col) * 2;
            let y = addr(&Operand::Buffer { name: yn })? + u64::from(g.y_col) * eb;
            // The first part's weights, block scales (fp8) and bias: the parts lie back to back.
            let (w, sc, bias) =
                (wptr(TensorPart::Weight, 0)?, wptr(TensorPart::ScaleInv, 0)?, wptr(TensorPart::Bias, 0)?);
            let swiglu = g.epilogue == moeforge_plan::program::Epilogue::SwiGlu;
            let rows = counts.of(g.rows);
            if rows == 0 {
                return Ok(());
            }
            // Decode tiles where the rows fit them; the one group's layout is the same.
            let ph = u32::from(phase == Phase::Decode && rows <= a.max_decode_rows);
            // The step's token or sampled rows are on the device
            // (`StepCounts`, written with the step's inputs): the launch
            // passes them by address and bounds its input's tensor map by
            // the input slice's rows, so its arguments do not change with
            // the batch (the cuda device encodes its templates once).
            // Other row counts go by value.
            let word = match g.rows {
                GridVar::Tokens => Some(STEP_TOKENS),
                GridVar::SampledRows => Some(STEP_SAMPLED),
                _ => None,
            };
            let (counts_arg, rows_arg) = match word {
                Some(w) => (
                    ptr(addr(&Operand::Buffer { name: BufferName::StepCounts })? + w),
                    bound(xb.slice_bytes(site.micro_batches) / xb.row_bytes.max(1)),
                ),
                None => (KernelArg::Null, i(rows)),
            };
            vec![
                ptr(x),
                KernelArg::Null,
                ptr(y),
                if swiglu { w } else { KernelArg::Null },
                if swiglu { KernelArg::Null } else { w },
                if swiglu { sc } else { KernelArg::Null },
                if swiglu { KernelArg::Null } else { sc },
                counts_arg,
                rows_arg,
                i(ph),
                i(0),
                i(g.n),
                i(g.k),
                i((xb.row_bytes / 2) as u32),
                i((yb.row_bytes / eb) as u32),
                i(g.epilogue.code()),
                if swiglu { bias } else { KernelArg::Null },
                if swiglu { KernelArg::Null } else { bias },
            ]
        } else {
            if a.form == ApkForm::Dense {
                return Err(bad("an experts op on the dense APK".into()));
            }
            // No routed entry to scan, no work (the counts, and so the
            // rows, stay on the device: with entries none of them this
            // rank's, the experts find zero rows and do nothing).
            let scanned = match site.mode {
                Mode::Ep => counts.received_entries,
                Mode::Tp => counts.entries,
            };
            if scanned == 0 {
                return Ok(());
            }
            // The permutation's layout is contiguous, each expert padded to
            // its block: the APK's prefill layout, which it must match.
            let block_m = plan.kernels.iter().find_map(|k| match &k.params {
                KernelParams::Permute(p) => Some(p.block_m),
                _ => None,
            });
            if block_m != Some(a.m_t_prefill) {
                return Err(bad(format!(
                    "the permutation pads experts to {block_m:?} rows, the APK's contiguous layout to {}",
                    a.m_t_prefill
                )));
            }
            let parts = route_parts(site, plan);
            let room =
                site.mem.permute_room(site.mode, site.micro_batches, plan.model.experts, u64::from(a.max_prefill_rows));
            let ri = addr(&Operand::Buffer { name: BufferName::RouteIndex })?;
            let b = |name| addr(&Operand::Buffer { name });
            let w13 = Operand::Weight { role: TensorRole::ExpertsW13, part: TensorPart::Weight };
            let w2 = Operand::Weight { role: TensorRole::ExpertsW2, part: TensorPart::Weight };
            vec![
                ptr(b(BufferName::Permuted)?),
                ptr(b(BufferName::GateUp)?),
                ptr(b(BufferName::ExpertOut)?),
                ptr(addr(&w13)?),
                ptr(addr(&w2)?),
                wptr(TensorPart::ScaleInv, 0)?,
                wptr(TensorPart::ScaleInv, 1)?,
                ptr(ri + parts.counts),
                // The rows stay on the device (the counts); `rows` bounds
                // the experts' tensor maps: the rows the permutation may
                // fill, so the launch's templates follow from its
                // arguments alone (the cuda device encodes them once).
                bound(room),
                i(0),
                i(0),
                i(0),
                i(0),
                i(0),
                i(0),
                i(0),
                // The experts' biases: w13's, then w2's.
                wptr(TensorPart::Bias, 0)?,
                wptr(TensorPart::Bias, 1)?,
            ]
        };
        Ok(self.dev.launch(module, &entry.symbol, grid, entry.block, &args)?)
    }

    /// A communication op across its group.
    #[allow(clippy::too_many_arguments)]
    fn comm(
        &mut self,
        plan: &Plan,
        mode: Mode,
        phase: Phase,
        mbs: u32,
        op: &Op,
        layer: u32,
        counts: &mut [Vec<Counts>],
        m: usize,
        routes: &mut Routes,
    ) -> Result<(), ExecError> {
        let mem = &plan.memory;
        let c = op.comm.as_ref().ok_or_else(|| ExecError::Plan(format!("op `{}` moves nothing", op.name)))?;
        self.main_ops += 1;
        let group: Vec<usize> = c.group.iter().map(|&r| r as usize).collect();
        let buffers = self.buffers.clone();
        let site = |r: usize| Site { mem, mode, micro_batches: mbs, rank: r as u32, layer, buffer: buffers[r] };
        let at = |r: usize, name| {
            bind::address(&site(r), op, &Operand::Buffer { name })
                .ok_or_else(|| ExecError::Plan(format!("op `{}`: no {name:?} buffer", op.name)))
        };
        let row = |name| mem.buffer(mode, name).map_or(0, |b| b.row_bytes);
        // Row `i` of `bytes` each from `base`, checked: an edited plan's
        // sizes must not wrap an address.
        let row_at = |base: u64, i: u64, bytes: u64| {
            i.checked_mul(bytes)
                .and_then(|o| o.checked_add(base))
                .ok_or_else(|| ExecError::Plan(format!("op `{}`: a row address overflows", op.name)))
        };
        match c.kind {
            CommKind::AllReduce => {
                // The two-shot all-reduce, as the bundle's compiled
                // `all_reduce` program: each row summed in rank order on the
                // rank that owns it (rows dealt round-robin over the group),
                // in place, then copied from there to the others.
                let code = self.code(&self.all_reduce, "all_reduce")?;
                let tokens = counts[group[0]][m].tokens as u64;
                let (rf, rt) = (row(c.from), row(c.to));
                if rf != rt {
                    return Err(ExecError::Plan(format!(
                        "op `{}`: {:?} rows are {rt} bytes and {:?}'s {rf}: the all-reduce sums rows in place",
                        op.name, c.to, c.from
                    )));
                }
                let (mut sums, mut copies) = (vec![], vec![]);
                for t in 0..tokens {
                    let owner = group[(t % group.len() as u64) as usize];
                    let dst_offset = row_at(at(owner, c.to)?, t, rt)?;
                    let sources = group
                        .iter()
                        .map(|&r| Ok((r as u32, row_at(at(r, c.from)?, t, rf)?)))
                        .collect::<Result<_, ExecError>>()?;
                    sums.push(Sum {
                        dst: owner as u32,
                        dst_offset,
                        sources,
                        elems: rt / 4,
                        elem: Elem::F32,
                        out: Elem::F32,
                        gate: None,
                    });
                    for &r in group.iter().filter(|&&r| r != owner) {
                        copies.push(Transfer {
                            src: owner as u32,
                            dst: r as u32,
                            copy: StridedCopy::one_run(dst_offset, row_at(at(r, c.to)?, t, rt)?, rt),
                        });
                    }
                }
                let bad = |e: moeforge_xfer::XferError| ExecError::Plan(format!("op `{}`: {e}", op.name));
                let batches =
                    [code.program.batch_with_sums(&[], &sums).map_err(bad)?, code.program.batch(&copies).map_err(bad)?];
                self.dev.transfer(&code, &batches, &self.buffers)?;
            }
            CommKind::AllToAll if !c.with.is_empty() => {
                // Dispatch: each token row to every rank holding one of its
                // (token, k) entries. Striped: the expert's owner. Replicated:
                // the replica the placement's routing chose for the entry, on
                // the device (`kernels/zepp_route.cu`, [`Executor::route`]:
                // the same routing as the cpu twin's
                // `moeforge_plan::placement::route` on the same counts; over
                // this micro-batch's rows, where the twin routes the whole
                // step, so the replicas chosen can differ, never the
                // tokens), each entry's physical slot id (`Plan::ep_ids`)
                // written on the source.
                let k = plan.model.top_k as usize;
                let ids_name = c.with[0][0];
                let moe_layer = layer.saturating_sub(plan.memory.slots.first_moe_layer) as usize;
                let posts = posts_of(plan, mbs);
                // A decode step's dispatch on fixed slots (DeepEP's
                // low-latency layout, ExpertPlex's per-source regions taken
                // whole): every token row goes to every rank of the group
                // that holds experts, to the row its source and its index
                // fix, with its top-k ids as they are, or a replicated
                // placement's physical slot ids (a rank's permutation takes
                // the entries of its own experts or slots and leaves the
                // others; its combine row for a token it serves none of is
                // +0.0, which the source's in-order f32 sum adds exactly).
                // The replicas' routing runs on the device and its slots stay
                // there. Where every row lands and what the combine pulls
                // then follow from the token counts alone: the host reads
                // nothing, so the step's launches and copies are the same
                // for every step of its batch shape (what a CUDA graph
                // captures). Each hidden row is gated on the device by the
                // token's ids or slots (`GatedCopy`: it moves only to a rank
                // holding one of them), so a group wider than top-k moves no
                // more hidden rows than the routed pairs; the ids and
                // weights move to every rank. Prefill keeps the routed
                // dispatch (each row only where its entries go, in fewer
                // bytes), as does a relayed path; so does a decode step
                // whose group's rows do not all fit a receiver.
                let holders: Vec<usize> = group.iter().copied().filter(|&d| plan.local_experts(d) > 0).collect();
                let fixed = self.fixed_slots(plan, mode, phase, mbs, c, &|s| u64::from(counts[s][m].tokens));
                let mut ids_of: BTreeMap<usize, Vec<i32>> = BTreeMap::new();
                for &s in group.iter().filter(|_| !fixed) {
                    let t = counts[s][m].tokens as usize;
                    ids_of.insert(s, i32s(&self.fetch(s, at(s, ids_name)?, (t * k * 4) as u64)?));
                }
                // Where a replicated placement's routing writes each
                // source's slots for this micro-batch.
                let sources: BTreeMap<usize, Source> = match self.zepp {
                    Some(z) => group
                        .iter()
                        .map(|&s| {
                            let dest = z.slots_at(k, tokens_before(&counts[s], m));
                            let entries = counts[s][m].tokens as usize * k;
                            let kv_slots = at(s, BufferName::SlotMap)?;
                            Ok((s, Source { ids: at(s, ids_name)?, entries, dest, kv_slots }))
                        })
                        .collect::<Result<_, ExecError>>()?,
                    None => BTreeMap::new(),
                };
                let assigned = match self.zepp {
                    Some(z) => self.route(plan, z, moe_layer, &sources, Some(&ids_of).filter(|_| !fixed), &group)?,
                    None => stripe_entries(plan, &ids_of, &group),
                };
                // On fixed slots a replicated placement's rows carry their
                // entries' physical slots (the routing's `dest`) as their ids.
                let slot_ids = |s: usize, tok: usize| -> Option<u64> {
                    sources.get(&s).filter(|_| fixed).map(|x| x.dest + 4 * (k * tok) as u64)
                };
                if fixed {
                    self.dispatch_traffic.fixed += 1;
                }
                // Where each source's rows land on a destination. A role
                // plan's MoE server reserves each attention server rows of
                // its `dispatch` (`roles.posts`: micro-batch m's slice holds
                // each region's m-th share), so no source needs another's
                // counts to place its rows (a replicated placement's routing
                // above exchanges counts, to choose replicas); rows between
                // the regions' used parts carry no entry (ids −1). Otherwise
                // the counts are exchanged first: rows packed in source-rank,
                // then token order. On fixed slots every row goes everywhere,
                // so both orders put token `tok` of source `s` at a row that
                // the token counts fix: the region's first row + `tok`, or
                // the earlier sources' tokens + `tok`.
                // A relayed dispatch (§5's hierarchical prefill path):
                // a token's row crosses to each other node once, into the
                // receive rows of that node's relay (`Relays`), which
                // forwards it to the node's GPUs that need it. A relay that
                // serves none of the token's entries still holds the row
                // (`held`, not a route: ids it does not match, and no output
                // for the combine to pull).
                let gpn = plan.cluster.gpus_per_node.max(1) as usize;
                let relays = Relays::of(plan, c);
                let relay_of = |s: usize, d: usize| relays.of_pair(s, d);
                let mut to: Routes = vec![vec![]; self.buffers.len()];
                let mut held: Routes = vec![vec![]; self.buffers.len()];
                // Where each (source, token) landed on each destination.
                let mut landed: BTreeMap<(usize, usize, usize), u64> = BTreeMap::new();
                // Rows each (source, destination) pair has placed so far.
                let mut placed: BTreeMap<(usize, usize), u64> = BTreeMap::new();
                for &s in &group {
                    let t = counts[s][m].tokens as usize;
                    for tok in 0..t {
                        let mut dests: Vec<usize> = match fixed {
                            true => holders.clone(),
                            false => (0..k).filter_map(|j| assigned.get(&(s, tok * k + j)).map(|x| x.0)).collect(),
                        };
                        let relays: Vec<usize> = dests.iter().filter_map(|&d| relay_of(s, d)).collect();
                        dests.sort_unstable();
                        dests.dedup();
                        let mut hold: Vec<usize> = relays.into_iter().filter(|r| !dests.contains(r)).collect();
                        hold.sort_unstable();
                        hold.dedup();
                        for r in hold {
                            if !group.contains(&r) {
                                return Err(ExecError::Plan(format!(
                                    "op `{}`: the relay {r} of rank {s}'s rows is not in the group",
                                    op.name
                                )));
                            }
                            let row = (to[r].len() + held[r].len()) as u64;
                            landed.insert((s, tok, r), row);
                            held[r].push((row, s, tok));
                        }
                        for d in dests {
                            let row = match posts.get(&(s, d)) {
                                None if posts.is_empty() => (to[d].len() + held[d].len()) as u64,
                                None => {
                                    return Err(ExecError::Plan(format!(
                                        "op `{}`: rank {s} has no post into rank {d}'s {:?}",
                                        op.name, c.to
                                    )))
                                }
                                Some(&(first, rows)) => {
                                    let used = placed.entry((s, d)).or_insert(0);
                                    if *used >= rows {
                                        return Err(ExecError::Capacity(format!(
                                            "attention rank {s} sends MoE rank {d} more than the {rows} rows its post \
                                             reserves per micro-batch: one request's tokens exceed it (a step's \
                                             dispatch rounds are whole requests)"
                                        )));
                                    }
                                    *used += 1;
                                    first + *used - 1
                                }
                            };
                            landed.insert((s, tok, d), row);
                            to[d].push((row, s, tok));
                        }
                    }
                }
                // Zepp's NIC split (§4.2) of a relayed dispatch: each
                // node's scale-out sends (one per (token, other node))
                // spread over its GPUs' NICs. A GPU sending more than its
                // share, ⌈the node's sends / its GPUs⌉, hands only the
                // excess (its last sends) to the least-loaded GPUs of its
                // node below the share, over NVLink; every other send keeps
                // its own NIC. A handed-over row is held in the sending
                // GPU's receive rows (unless it receives it anyway).
                let mut sent_by: BTreeMap<(usize, usize, usize), usize> = BTreeMap::new();
                if c.relay.is_some() {
                    let mut sends: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
                    for &(s, tok, r) in landed.keys() {
                        if r / gpn != s / gpn && relay_of(s, r) == Some(r) {
                            sends.entry(s).or_default().push((tok, r));
                        }
                    }
                    let (split, busiest, busiest_before) = nic_split(&sends, &group, gpn);
                    sent_by = split;
                    let t = &mut self.dispatch_traffic;
                    t.split_rows += sent_by.len() as u64;
                    t.busiest_nic_rows += busiest;
                    t.busiest_nic_rows_unsplit += busiest_before;
                    for (&(s, tok, _), &p) in &sent_by {
                        if let std::collections::btree_map::Entry::Vacant(e) = landed.entry((s, tok, p)) {
                            let row = (to[p].len() + held[p].len()) as u64;
                            e.insert(row);
                            held[p].push((row, s, tok));
                        }
                    }
                }
                // The GPUs that send a handed-over row: each receives it first.
                let staged: std::collections::BTreeSet<(usize, usize, usize)> =
                    sent_by.iter().map(|(&(s, tok, _), &p)| (s, tok, p)).collect();
                // Each destination's received rows: up to the last one filled.
                let extents: Vec<u64> =
                    to.iter().zip(&held).map(|(a, b)| a.iter().chain(b).map(|x| x.0 + 1).max().unwrap_or(0)).collect();
                // The rows move as the bundle's compiled dispatch program,
                // one batch: every (row, destination) of every buffer pair
                // an instance. Where each source's rows land is fixed (above)
                // before anything moves.
                let code = self.dispatch.clone().ok_or_else(|| {
                    ExecError::Plan("the bundle holds no compiled dispatch (kernels/xfer_dispatch.*)".into())
                })?;
                let pairs: Vec<[BufferName; 2]> =
                    std::iter::once([c.from, c.to]).chain(c.with.iter().copied()).collect();
                // Three batches: the rows handed to another GPU's NIC, then
                // every row's hop (straight from its source, or from the GPU
                // it was handed to), then the relays' forwards over NVLink.
                let (mut handed, mut hops, mut forwards) = (vec![], vec![], vec![]);
                // On fixed slots, a token's row moves only to a rank holding
                // one of its experts, which the device decides from the
                // token's top-k ids (its ids and weights always move, so the
                // rank's permutation sees them and takes none of a skipped
                // row's entries).
                let gate = fixed && self.gates_rows(row(c.to), k);
                let ids_from = c.with[0][0];
                let ids_row = row(ids_from);
                let mut gated = vec![];
                let t = &mut self.dispatch_traffic;
                for &d in &group {
                    for (pair, [src, dst]) in pairs.iter().enumerate() {
                        let (rs, rd) = (row(*src), row(*dst));
                        if rd != rs {
                            return Err(ExecError::Plan(format!(
                                "op `{}`: {dst:?} rows are {rd} bytes and {src:?}'s {rs}: the dispatch moves rows whole",
                                op.name
                            )));
                        }
                        let cap = mem.buffer(mode, *dst).map_or(0, |b| b.slice_bytes(mbs)) / rd.max(1);
                        if extents[d] > cap {
                            return Err(ExecError::Capacity(format!(
                                "rank {d} receives rows up to row {} of {dst:?}; its slots hold {cap}",
                                extents[d]
                            )));
                        }
                        let base = at(d, *dst)?;
                        for &(row, s, tok) in to[d].iter().chain(&held[d]) {
                            let into = row_at(base, row, rd)?;
                            let from = match relay_of(s, d).filter(|&r| r != d) {
                                Some(r) => {
                                    let at_relay = landed.get(&(s, tok, r)).copied().ok_or_else(|| {
                                        ExecError::Plan(format!("op `{}`: relay {r} holds no row of {s}", op.name))
                                    })?;
                                    forwards.push(Transfer {
                                        src: r as u32,
                                        dst: d as u32,
                                        copy: StridedCopy::one_run(row_at(at(r, *dst)?, at_relay, rd)?, into, rs),
                                    });
                                    continue;
                                }
                                None => match slot_ids(s, tok).filter(|_| pair == 1) {
                                    Some(at_slots) => at_slots,
                                    None => row_at(at(s, *src)?, tok as u64, rs)?,
                                },
                            };
                            if let Some(&p) = sent_by.get(&(s, tok, d)) {
                                let at_p = landed.get(&(s, tok, p)).copied().ok_or_else(|| {
                                    ExecError::Plan(format!("op `{}`: rank {p} holds no row of {s}", op.name))
                                })?;
                                let from = row_at(at(p, *dst)?, at_p, rd)?;
                                let copy = StridedCopy::one_run(from, into, rs);
                                hops.push(Transfer { src: p as u32, dst: d as u32, copy });
                                continue;
                            }
                            let copy =
                                Transfer { src: s as u32, dst: d as u32, copy: StridedCopy::one_run(from, into, rs) };
                            if gate && pair == 0 {
                                let [lo, hi] = plan.ep_ids(d).map(|x| i32::try_from(x).unwrap_or(i32::MAX));
                                let offset = match slot_ids(s, tok) {
                                    Some(at_slots) => at_slots,
                                    None => row_at(at(s, ids_from)?, tok as u64, ids_row)?,
                                };
                                gated.push(GatedCopy { transfer: copy, gate: Gate { buf: s as u32, offset, lo, hi } });
                                t.gated_rows += 1;
                                continue;
                            }
                            match staged.contains(&(s, tok, d)) {
                                true => handed.push(copy),
                                false => hops.push(copy),
                            }
                        }
                    }
                    // Rows (not bytes), once per (row, destination).
                    for &(_, s, _) in &to[d] {
                        match (d / gpn == s / gpn, relay_of(s, d)) {
                            (true, _) => t.node_rows += 1,
                            (false, r) => {
                                t.remote_rows += 1;
                                if r.is_some_and(|r| r != d) {
                                    t.forwarded_rows += 1;
                                } else {
                                    t.scale_out_rows += 1;
                                }
                            }
                        }
                    }
                    // A relay's held rows crossed; a row held to be sent on
                    // (a split) stayed on its node.
                    t.scale_out_rows += held[d].iter().filter(|&&(_, s, _)| d / gpn != s / gpn).count() as u64;
                    counts[d][m].received = extents[d] as u32;
                    counts[d][m].received_entries = (extents[d] * k as u64) as u32;
                }
                let bad = |e: moeforge_xfer::XferError| ExecError::Plan(format!("op `{}`: {e}", op.name));
                if fixed && !posts.is_empty() {
                    // The rows between the posts' used parts carry no entry:
                    // -1 over every received row, one fill on the device per
                    // destination, before the rows (their ids with them) land.
                    let ids_to = c.with[0][1];
                    let rd = row(ids_to);
                    for &d in group.iter().filter(|&&d| extents[d] > 0) {
                        let b = self.buffer(d as u32)?;
                        self.dev.fill(b, at(d, ids_to)?, extents[d] * rd, 0xff)?;
                    }
                }
                let batches = [
                    code.program.batch(&handed).map_err(bad)?,
                    code.program.batch_gated(&hops, &gated, k as u32).map_err(bad)?,
                    code.program.batch(&forwards).map_err(bad)?,
                ];
                self.dev.transfer(&code, &batches, &self.buffers)?;
                if !fixed && (plan.placement.is_some() || !posts.is_empty()) {
                    // Each destination's view of a row's entries: the ids
                    // the rows carried (a replicated placement's rewritten
                    // to the physical slot the destination serves, -1 for
                    // the others); rows no source used, -1.
                    let ids_to = c.with[0][1];
                    let rd = row(ids_to) as usize;
                    for &d in &group {
                        let mut data = vec![0xffu8; extents[d] as usize * rd];
                        for &(row, s, tok) in &to[d] {
                            let i = row as usize;
                            for j in 0..k.min(rd / 4) {
                                let id = match assigned.get(&(s, tok * k + j)) {
                                    Some(&(g, id)) if g == d => id,
                                    _ => -1,
                                };
                                data[i * rd + 4 * j..i * rd + 4 * j + 4].copy_from_slice(&id.to_le_bytes());
                            }
                        }
                        let a = at(d, ids_to)?;
                        self.store(d, a, &data)?;
                    }
                }
                // Only this group's destinations: another group's dispatch
                // of the same op (a PD instance's) keeps its own routes.
                routes.resize(self.buffers.len(), vec![]);
                for &d in &group {
                    routes[d] = std::mem::take(&mut to[d]);
                }
            }
            CommKind::AllToAll => {
                // Combine, pulled by each token's source rank: its row becomes
                // the f32 sum of the rows the ranks that received it computed,
                // as the bundle's compiled `combine` program. Direct: every
                // row in rank order. Relayed (§5's hierarchical path, Zepp's
                // merge): first, on each other node holding some of a token's
                // rows, its relay (`Relays`) sums them into one bf16 row of
                // its `via` rows (one batch, NVLink reads); then the source
                // sums the rows that came straight, in rank order, then the
                // relays' partial rows, in rank order (one row per relay over
                // the scale-out link).
                let code = self.code(&self.combine, "combine")?;
                let h = u64::from(plan.model.hidden);
                let (rs, rt) = (row(c.from), row(c.to));
                if rs < 2 * h || rt < 4 * h {
                    return Err(ExecError::Plan(format!(
                        "op `{}`: rows of {rs} and {rt} bytes cannot hold {h} bf16 and f32 elements",
                        op.name
                    )));
                }
                let mut from: BTreeMap<(usize, usize), Vec<(u32, u64)>> = BTreeMap::new();
                for &d in &group {
                    let base = at(d, c.from)?;
                    for &(row, s, tok) in routes.get(d).map(Vec::as_slice).unwrap_or_default() {
                        from.entry((s, tok)).or_default().push((d as u32, row_at(base, row, rs)?));
                    }
                }
                let (mut partials, mut sums) = (vec![], vec![]);
                let relays = Relays::of(plan, c);
                let mut relay_rows: BTreeMap<usize, u64> = BTreeMap::new();
                let k = plan.model.top_k as usize;
                let ids_row = row(BufferName::TopkIds);
                for &s in &group {
                    let base = at(s, c.to)?;
                    for tok in 0..counts[s][m].tokens as usize {
                        let rows = from.remove(&(s, tok)).unwrap_or_default();
                        let gpn = plan.cluster.gpus_per_node.max(1) as usize;
                        // More rows than top-k: a fixed-slot dispatch's over
                        // a group wider than top-k (no relay: those route).
                        // The sum reads a rank's row only where the rank
                        // holds one of the token's experts, which the device
                        // decides from the token's ids on this rank (the
                        // others computed +0.0 for it, which skipping adds
                        // exactly); the host knows only the rows it may read.
                        if rows.len() > k && rows.iter().all(|x| relays.of_pair(s, x.0 as usize).is_none()) {
                            self.traffic.gated_rows += rows.len() as u64;
                            let ranges = rows
                                .iter()
                                .map(|&(d, _)| plan.ep_ids(d as usize).map(|x| i32::try_from(x).unwrap_or(i32::MAX)))
                                .map(|[lo, hi]| (lo, hi))
                                .collect();
                            // A replicated placement's rows carried their
                            // physical slots, which the routing left on the
                            // source ([`Source::dest`]).
                            let offset = match self.zepp {
                                Some(z) => z.slots_at(k, tokens_before(&counts[s], m) + tok as u64),
                                None => row_at(at(s, BufferName::TopkIds)?, tok as u64, ids_row)?,
                            };
                            let gate = SumGate { buf: s as u32, offset, ids: k as u32, ranges };
                            sums.push(Sum {
                                dst: s as u32,
                                dst_offset: row_at(base, tok as u64, rt)?,
                                sources: rows,
                                elems: h,
                                elem: Elem::Bf16,
                                out: Elem::F32,
                                gate: Some(gate),
                            });
                            continue;
                        }
                        for &(d, _) in &rows {
                            let t = &mut self.traffic;
                            match (d as usize / gpn == s / gpn, relays.of_pair(s, d as usize).is_some()) {
                                (true, _) => t.node_rows += 1,
                                (false, true) => t.relayed_rows += 1,
                                (false, false) => t.scale_out_rows += 1,
                            }
                        }
                        let sources = {
                            // Rows that go straight, then each relay's.
                            let mut by_relay: BTreeMap<Option<usize>, Vec<(u32, u64)>> = BTreeMap::new();
                            for x in rows {
                                by_relay.entry(relays.of_pair(s, x.0 as usize)).or_default().push(x);
                            }
                            let mut out = vec![];
                            for (relay, rows) in by_relay {
                                let Some(relay) = relay else {
                                    out.extend(rows);
                                    continue;
                                };
                                if !group.contains(&relay) {
                                    return Err(ExecError::Plan(format!(
                                        "op `{}`: rank {s}'s relay, rank {relay}, is not in the group",
                                        op.name
                                    )));
                                }
                                let via = relays.via;
                                let used = relay_rows.entry(relay).or_insert(0);
                                let cap = mem.buffer(mode, via).map_or(0, |b| b.slice_bytes(mbs)) / rs;
                                if *used >= cap {
                                    return Err(ExecError::Capacity(format!(
                                        "rank {relay} relays more than the {cap} rows of its {via:?} slots"
                                    )));
                                }
                                let dst_offset = row_at(at(relay, via)?, *used, rs)?;
                                *used += 1;
                                self.traffic.scale_out_rows += 1;
                                self.traffic.relay_rows += 1;
                                partials.push(Sum {
                                    dst: relay as u32,
                                    dst_offset,
                                    sources: rows,
                                    elems: h,
                                    elem: Elem::Bf16,
                                    out: Elem::Bf16,
                                    gate: None,
                                });
                                out.push((relay as u32, dst_offset));
                            }
                            out
                        };
                        sums.push(Sum {
                            dst: s as u32,
                            dst_offset: row_at(base, tok as u64, rt)?,
                            sources,
                            elems: h,
                            elem: Elem::Bf16,
                            out: Elem::F32,
                            gate: None,
                        });
                    }
                }
                if !from.is_empty() {
                    return Err(ExecError::Plan(format!(
                        "op `{}`: {} received rows have no token of this step's group to return to",
                        op.name,
                        from.len()
                    )));
                }
                let bad = |e: moeforge_xfer::XferError| ExecError::Plan(format!("op `{}`: {e}", op.name));
                let batches = [
                    code.program.batch_with_sums(&[], &partials).map_err(bad)?,
                    code.program.batch_with_sums(&[], &sums).map_err(bad)?,
                ];
                self.dev.transfer(&code, &batches, &self.buffers)?;
            }
        }
        Ok(())
    }
}

/// The ops of chunk `j` of a block: those after its `j`-th communication op
/// and before the next (a block without communication is one chunk).
fn chunk(ops: &[Op], j: usize) -> impl Iterator<Item = &Op> {
    let mut seen = 0;
    ops.iter().filter(move |o| {
        let comm = o.kernel == KernelRef::Transfer;
        seen += usize::from(comm);
        !comm && seen == j
    })
}

/// Where the ranks of a step meet in block `bi`: for each of its
/// communication ops in order, one op per group that issues it. Every rank
/// that communicates in the block issues the same communication ops (name
/// and micro-batch) in the same order, each group's members the same
/// `Comm`, and a group holds only ranks that run the step: otherwise a rank
/// would wait for a partner that never comes. The last entry is empty (the
/// ops after the last communication).
fn rendezvous<'p>(
    running: &[(usize, &'p Program)],
    bi: usize,
    mode: Mode,
    phase: Phase,
) -> Result<Vec<Vec<&'p Op>>, ExecError> {
    let comms = |g: &'p Program| -> Vec<&'p Op> {
        g.blocks[bi].ops.iter().filter(|o| o.kernel == KernelRef::Transfer).collect()
    };
    let key = |o: &Op| (o.name.clone(), o.micro_batch);
    let mut order: Option<Vec<(String, Option<u32>)>> = None;
    for &(r, g) in running {
        let mine: Vec<_> = comms(g).into_iter().map(key).collect();
        if mine.is_empty() {
            continue;
        }
        match &order {
            None => order = Some(mine),
            Some(o) if *o == mine => {}
            Some(o) => {
                return Err(ExecError::Plan(format!(
                    "the {} {} programs do not meet: rank {r} communicates {mine:?} where another rank does {o:?}",
                    mode.name(),
                    phase.name()
                )))
            }
        }
    }
    let n = order.as_ref().map_or(0, Vec::len);
    let mut out: Vec<Vec<&'p Op>> = vec![vec![]; n + 1];
    let runs = |r: u32| running.iter().any(|&(x, _)| x as u32 == r);
    for (j, meet) in out.iter_mut().enumerate().take(n) {
        let mut groups: BTreeMap<Vec<u32>, (&'p Op, usize)> = BTreeMap::new();
        for &(r, g) in running {
            let Some(op) = comms(g).get(j).copied() else { continue };
            let c = op.comm.as_ref().ok_or_else(|| ExecError::Plan(format!("op `{}` moves nothing", op.name)))?;
            if !c.group.contains(&(r as u32)) {
                return Err(ExecError::Plan(format!("rank {r} issues `{}` outside its group {:?}", op.name, c.group)));
            }
            if let Some(&x) = c.group.iter().find(|&&x| !runs(x)) {
                return Err(ExecError::Plan(format!(
                    "`{}`'s group {:?} holds rank {x}, which runs no {} {} program",
                    op.name,
                    c.group,
                    mode.name(),
                    phase.name()
                )));
            }
            let entry = groups.entry(c.group.clone()).or_insert((op, 0));
            if entry.0.comm != op.comm {
                return Err(ExecError::Plan(format!("rank {r}'s `{}` moves other rows than its group's", op.name)));
            }
            entry.1 += 1;
        }
        let mut members: Vec<u32> = vec![];
        for (group, (op, met)) in groups {
            if met != group.len() || group.iter().any(|r| members.contains(r)) {
                return Err(ExecError::Plan(format!(
                    "`{}`: {met} of group {group:?} issue it, or a rank is in two of its groups",
                    op.name
                )));
            }
            members.extend(&group);
            meet.push(op);
        }
    }
    Ok(out)
}

/// Zepp's NIC split (§4.2) of one relayed dispatch's scale-out sends
/// (`sends[gpu]`: its (token, landing GPU) sends, in order): on each node
/// of `group`, a GPU above the node's share, ⌈the node's sends / its
/// GPUs⌉, hands its excess (its last sends) to the least-loaded GPUs of
/// its node below the share (the lower rank on a tie); every other send
/// keeps its own NIC. Returns who sends each handed-over (source, token,
/// landing GPU), and the busiest NIC's sends after and before the split.
fn nic_split(
    sends: &BTreeMap<usize, Vec<(usize, usize)>>,
    group: &[usize],
    gpn: usize,
) -> (BTreeMap<(usize, usize, usize), usize>, u64, u64) {
    let mut sent_by = BTreeMap::new();
    let nodes: std::collections::BTreeSet<usize> = group.iter().map(|g| g / gpn).collect();
    let (mut busiest, mut busiest_before) = (0u64, 0u64);
    for n in nodes {
        let gpus: Vec<usize> = group.iter().copied().filter(|g| g / gpn == n).collect();
        let mut load: BTreeMap<usize, usize> = gpus.iter().map(|&g| (g, sends.get(&g).map_or(0, Vec::len))).collect();
        let total: usize = load.values().sum();
        let share = total.div_ceil(gpus.len().max(1));
        busiest_before = busiest_before.max(load.values().copied().max().unwrap_or(0) as u64);
        for &g in &gpus {
            let excess = load[&g].saturating_sub(share);
            let own = sends.get(&g).map_or(&[][..], Vec::as_slice);
            for &(tok, r) in &own[own.len().saturating_sub(excess)..] {
                let Some(p) = gpus.iter().copied().filter(|p| load[p] < share).min_by_key(|p| (load[p], *p)) else {
                    break;
                };
                *load.entry(p).or_insert(0) += 1;
                *load.entry(g).or_insert(0) -= 1;
                sent_by.insert((g, tok, r), p);
            }
        }
        busiest = busiest.max(load.values().copied().max().unwrap_or(0) as u64);
    }
    (sent_by, busiest, busiest_before)
}

/// Where a dispatch's or combine's rows between two nodes meet (ExpertPlex
/// §5's hierarchical path): a colocated relayed op (`Comm::relay`) meets on
/// the destination node's GPU with the source's local rank; a role plan's
/// prefill posts through `Path::Relay { via }` meet on the prefill server
/// `via`. Rows on one node, and every other op's, go straight. A relay
/// holds the rows it forwards, and the partial sums it returns, in its
/// `dispatch` rows (the receive rows; an attention server's are otherwise unused).
struct Relays {
    gpus_per_node: usize,
    colocated: bool,
    posts: BTreeMap<(usize, usize), usize>,
    via: BufferName,
}

impl Relays {
    fn of(plan: &Plan, c: &moeforge_plan::program::Comm) -> Relays {
        let posts = plan
            .roles
            .iter()
            .flat_map(|r| &r.posts)
            .filter_map(|p| match p.path {
                moeforge_plan::roles::Path::Relay { via } => Some(((p.src as usize, p.dst as usize), via as usize)),
                _ => None,
            })
            .collect();
        Relays {
            // The cluster's node size: the validator refuses a `Comm::relay`
            // over any other.
            gpus_per_node: plan.cluster.gpus_per_node.max(1) as usize,
            colocated: c.relay.is_some(),
            posts,
            via: c.relay.map_or(BufferName::Dispatch, |r| r.via),
        }
    }

    /// The relay of rows from `s` to `d` (`d` itself when `d` is its own
    /// node's relay), or `None` when they go straight.
    fn of_pair(&self, s: usize, d: usize) -> Option<usize> {
        let g = self.gpus_per_node;
        if d / g == s / g {
            return None;
        }
        match self.colocated {
            true => Some((d / g) * g + s % g),
            false => self.posts.get(&(s, d)).copied(),
        }
    }
}

/// The most padded rows program `g`'s permutation may lay out: its
/// buffers' slices and the rows its experts APK takes.
fn layout_room(plan: &Plan, g: &Program) -> u64 {
    let apk_rows = g
        .blocks
        .iter()
        .flat_map(|b| &b.ops)
        .filter(|op| op.kind == OpKind::Experts)
        .filter_map(|op| match &op.kernel {
            KernelRef::Post { instance } | KernelRef::Launch { instance, .. } => {
                plan.kernels.iter().find(|k| &k.name == instance)
            }
            _ => None,
        })
        .filter_map(|k| match &k.params {
            KernelParams::Apk(a) => Some(u64::from(a.max_prefill_rows)),
            _ => None,
        })
        .min()
        .unwrap_or(u64::MAX);
    plan.memory.permute_room(g.mode, g.micro_batches, plan.model.experts, apk_rows)
}

/// Whether `op` lays out routed rows (the permutation's `moe_offsets`).
fn lays_out(op: &Op) -> bool {
    matches!(&op.kernel, KernelRef::Launch { entry, .. } if entry == "moe_offsets")
}

fn route_parts(site: &Site<'_>, plan: &Plan) -> RouteIndexParts {
    let bytes = site.mem.buffer(site.mode, BufferName::RouteIndex).map_or(0, |b| b.slice_bytes(site.micro_batches));
    RouteIndexParts::of(bytes, u64::from(plan.model.experts))
}

/// A step's dispatch rounds in a role plan: for each round, the indices of
/// every rank's requests it runs. A source's requests go in order into
/// the current round while each of its micro-batches (the step's split:
/// whole requests, `⌈n / micro-batches⌉` per micro-batch, in order) holds at
/// most the fewest rows any of its posts reserves per micro-batch; a token
/// sends a MoE rank at most one row, so tokens bound rows (rows per MoE
/// rank are not known before routing: rounds start on tokens, the safe
/// side). Round k runs every rank's k-th group (an empty one for a rank
/// with fewer). One round of everything where every source fits, or a plan
/// has no posts. A request whose own tokens exceed its post is refused
/// before any round runs.
pub fn post_rounds(
    plan: &Plan,
    mode: Mode,
    phase: Phase,
    work: &[Vec<Work>],
) -> Result<Vec<Vec<Vec<usize>>>, ExecError> {
    let whole = || vec![work.iter().map(|w| (0..w.len()).collect()).collect()];
    let Some(roles) = plan.roles.as_ref().filter(|r| !r.posts.is_empty()) else { return Ok(whole()) };
    let mut groups: Vec<Vec<Vec<usize>>> = Vec::with_capacity(work.len());
    for (r, w) in work.iter().enumerate() {
        let program =
            plan.programs.iter().find(|g| g.mode == mode && g.phase == phase && g.ranks.contains(&(r as u32)));
        let mbs = program.map_or(1, |g| u64::from(g.micro_batches.max(1)));
        let cap = roles.posts.iter().filter(|p| p.src as usize == r).map(|p| p.rows / mbs).min();
        let Some(cap) = cap else {
            groups.push(vec![(0..w.len()).collect()]);
            continue;
        };
        // The largest micro-batch's tokens when `n` requests from `start` run together.
        let widest = |start: usize, n: usize| {
            let per = n.div_ceil(mbs as usize).max(1);
            w[start..start + n].chunks(per).map(|c| c.iter().map(|x| x.tokens.len() as u64).sum::<u64>()).max()
        };
        if widest(0, w.len()).is_none_or(|t| t <= cap) {
            groups.push(vec![(0..w.len()).collect()]);
            continue;
        }
        // Refused before any round runs (no round's KV, loads or traffic
        // are left behind by a step that fails).
        if let Some(x) = w.iter().find(|x| x.tokens.len() as u64 > cap) {
            return Err(ExecError::Capacity(format!(
                "attention rank {r}: a request of {} tokens exceeds the {cap} rows a micro-batch's post reserves on \
                 a MoE rank (a step's dispatch rounds are whole requests)",
                x.tokens.len()
            )));
        }
        let (mut mine, mut start) = (Vec::new(), 0usize);
        for i in 0..w.len() {
            if i > start && widest(start, i + 1 - start).is_some_and(|t| t > cap) {
                mine.push((start..i).collect());
                start = i;
            }
        }
        if start < w.len() || mine.is_empty() {
            mine.push((start..w.len()).collect());
        }
        groups.push(mine);
    }
    let rounds = groups.iter().map(Vec::len).max().unwrap_or(1).max(1);
    Ok((0..rounds).map(|k| groups.iter().map(|g| g.get(k).cloned().unwrap_or_default()).collect()).collect())
}

/// One micro-batch's step inputs on a rank, as `write_inputs` uploads them.
#[derive(Debug, Default, PartialEq)]
struct StepInputs {
    ids: Vec<i32>,
    pos: Vec<i32>,
    slots: Vec<i32>,
    row_req: Vec<i32>,
    sample: Vec<i32>,
    /// `words` per request: cached tokens, first row, rows, 0, temperature,
    /// top-p, the generator's state (two words), then its page table.
    meta: Vec<i32>,
}

/// The step inputs of `reqs` on rank `r` (its pool of `pages` pages of
/// `page_tokens` tokens, `words` a request's header): every token a row at
/// its position with its KV slot, -1 for the padding requests past the
/// first `real` (which the KV writes skip), and each request's header.
fn step_inputs(
    reqs: &[Work],
    real: usize,
    page_tokens: u32,
    pages: u64,
    words: usize,
    r: usize,
) -> Result<StepInputs, ExecError> {
    let page_tokens = page_tokens.max(1);
    let mut x = StepInputs { meta: vec![0i32; words * reqs.len()], ..StepInputs::default() };
    for (i, w) in reqs.iter().enumerate() {
        let first = x.ids.len() as i32;
        for (j, &t) in w.tokens.iter().enumerate() {
            let at = w.cached + j as u32;
            let slot = if i >= real {
                // Padding: its KV slot is -1, which the KV writes skip.
                -1
            } else {
                let page = *w.pages.get((at / page_tokens) as usize).ok_or_else(|| {
                    ExecError::Capacity(format!("request {i} on rank {r} has no KV page for position {at}"))
                })?;
                if page as u64 >= pages {
                    return Err(ExecError::Capacity(format!("KV page {page} is outside the pool of {pages}")));
                }
                (page * page_tokens + at % page_tokens) as i32
            };
            x.ids.push(t as i32);
            x.pos.push(at as i32);
            x.slots.push(slot);
            x.row_req.push(i as i32);
        }
        if w.sample && !w.tokens.is_empty() {
            x.sample.push(x.ids.len() as i32 - 1);
        }
        if w.pages.len() + 8 > words {
            return Err(ExecError::Capacity(format!("{} KV pages exceed the page table", w.pages.len())));
        }
        let h = &mut x.meta[i * words..(i + 1) * words];
        h[0] = w.cached as i32;
        h[1] = first;
        h[2] = w.tokens.len() as i32;
        h[4] = w.temperature.to_bits() as i32;
        h[5] = w.top_p.to_bits() as i32;
        h[6] = w.rng as u32 as i32;
        h[7] = (w.rng >> 32) as u32 as i32;
        for (k, &pg) in w.pages.iter().enumerate() {
            h[8 + k] = pg as i32;
        }
    }
    Ok(x)
}

/// A rank's KV as a calibration step's rows take it: tokens a page, pages
/// in its pool, pages a request's page table holds.
#[derive(Clone, Copy, Debug)]
struct ProbeKv {
    page_tokens: u32,
    pool: u64,
    table: u64,
}

/// The padding rows of a calibration step on one rank
/// ([`Executor::probe_decode`]): requests `first..first + rows`, each with
/// `context` tokens cached on pages of its own (rows share none, so their
/// attention reads as much of the pool as served requests' would: the
/// pages its positions `0..=context` fall on, `page_tokens` each), and its
/// own token below `vocab`. `None` where their pages outnumber the rank's
/// pool, or one request's its page table: a batch of that context does not
/// fit the rank.
fn probe_rows(first: usize, rows: usize, context: u32, kv: ProbeKv, vocab: usize) -> Option<Vec<Work>> {
    let per = context / kv.page_tokens.max(1) + 1;
    let total = u32::try_from(rows).ok()?.checked_mul(per)?;
    if u64::from(total) > kv.pool || u64::from(per) > kv.table {
        return None;
    }
    let row = |i: u32| Work {
        cached: context,
        tokens: vec![(((first + i as usize) * 7919 + 1) % vocab.max(1)) as u32],
        pages: (i * per..(i + 1) * per).collect(),
        ..Work::padding()
    };
    Some((0..rows as u32).map(row).collect())
}

/// A rank's `n` requests split into `mbs` micro-batches: whole requests, in
/// order, ⌈n / mbs⌉ to each but the last.
fn micro_batches(n: usize, mbs: usize) -> Vec<std::ops::Range<usize>> {
    let per = n.div_ceil(mbs.max(1));
    (0..mbs.max(1)).map(|m| (m * per).min(n)..((m + 1) * per).min(n)).collect()
}

/// A role plan's posts as (source, destination) → (first row, rows) of a
/// micro-batch's share (empty without roles).
fn posts_of(plan: &Plan, mbs: u32) -> BTreeMap<(usize, usize), (u64, u64)> {
    plan.roles
        .iter()
        .flat_map(|r| &r.posts)
        .map(|x| ((x.src as usize, x.dst as usize), (x.first_row / u64::from(mbs), x.rows / u64::from(mbs))))
        .collect()
}

/// The host's routing of a replicated placement's dispatch, what
/// [`Executor::verify_routing`] checks the device's against: the
/// placement's routing (`placement::route`) of the counts per (source,
/// expert) over the group's slots, each source's entries of an expert taking
/// the replicas it was given in entry order, and the physical slot id
/// `rank·S + slot`.
fn host_routing(plan: &Plan, slots: &[Vec<u32>], ids_of: &BTreeMap<usize, Vec<i32>>, group: &[usize]) -> Assigned {
    let mut out = BTreeMap::new();
    let Some(p) = &plan.placement else { return out };
    let (world, experts) = (plan.ranks.len(), plan.model.experts as usize);
    let table: Vec<Vec<u32>> = (0..world)
        .map(|r| if group.contains(&r) { slots.get(r).cloned().unwrap_or_default() } else { vec![] })
        .collect();
    let mut demand = vec![vec![0f64; experts]; world];
    for (&s, ids) in ids_of {
        for &e in ids {
            if let Some(x) = demand.get_mut(s).and_then(|d| d.get_mut(e as usize)) {
                *x += 1.0;
            }
        }
    }
    let topo = moeforge_plan::placement::Topology {
        nodes: plan.cluster.nodes as usize,
        gpus_per_node: plan.cluster.gpus_per_node as usize,
    };
    let routing = moeforge_plan::placement::route(p.policy, &table, &demand, topo, p.slack);
    let per = p.slots_per_gpu();
    for (&s, ids) in ids_of {
        let Some(row) = routing.get(s) else { continue };
        let mut take = moeforge_plan::placement::row_queues(row);
        for (i, &e) in ids.iter().enumerate() {
            let Some(g) = take.get_mut(e as usize).and_then(Iterator::next) else { continue };
            if let Some(slot) = table[g].iter().position(|&x| x as i32 == e) {
                out.insert((s, i), (g, (g * per + slot) as i32));
            }
        }
    }
    out
}

/// Where each (source rank, entry) of a striped plan's dispatch goes:
/// `(the owner of the expert's stripe, the logical id)`.
fn stripe_entries(plan: &Plan, ids_of: &BTreeMap<usize, Vec<i32>>, group: &[usize]) -> Assigned {
    let owner = |e: i32| {
        group
            .iter()
            .copied()
            .find(|&g| plan.ranks.get(g).is_some_and(|x| (x.experts[0] as i32..x.experts[1] as i32).contains(&e)))
    };
    let mut out = BTreeMap::new();
    for (&s, ids) in ids_of {
        for (i, &e) in ids.iter().enumerate() {
            if let Some(d) = owner(e) {
                out.insert((s, i), (d, e));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{nic_split, probe_rows, step_inputs, ProbeKv};
    use std::collections::BTreeMap;

    /// A calibration step's rows: positions 0..=context need
    /// ⌊context / page_tokens⌋ + 1 pages (16 tokens a page: 1 for contexts
    /// 0 and 15, 2 for 16 and 31, 3 for 32), no two rows share a page, all
    /// lie in the pool, and a batch one page short of it does not fit, nor
    /// a request one page past its page table.
    #[test]
    fn probe_rows_hold_their_context_on_pages_of_their_own() {
        let kv = |pool: u64, table: u64| ProbeKv { page_tokens: 16, pool, table };
        for (context, pages) in [(0, 1), (15, 1), (16, 2), (31, 2), (32, 3)] {
            let rows = probe_rows(10, 4, context, kv(4 * pages, pages), 1000).expect("fits exactly");
            assert_eq!(rows.len(), 4);
            let mut seen = std::collections::BTreeSet::new();
            for w in &rows {
                assert_eq!((w.cached, w.pages.len() as u64, w.tokens.len()), (context, pages, 1), "{w:?}");
                assert!(w.pages.iter().all(|&p| u64::from(p) < 4 * pages && seen.insert(p)), "{rows:?}");
            }
            let tokens: std::collections::BTreeSet<u32> = rows.iter().map(|w| w.tokens[0]).collect();
            assert_eq!(tokens.len(), 4, "each row its own token");
            assert!(probe_rows(10, 4, context, kv(4 * pages - 1, pages), 1000).is_none());
            assert!(probe_rows(10, 4, context, kv(4 * pages, pages - 1), 1000).is_none());
        }
        assert!(probe_rows(0, 0, 1 << 20, kv(0, 1 << 17), 1).is_some_and(|r| r.is_empty()));
    }

    /// What the kernels read of a calibration row is a served request's:
    /// two rows at 40 cached tokens (pages 0..3 and 3..6 of 16 tokens) sit
    /// at position 40 (the attention's keys 0..=40) and their headers hold
    /// 40 and their pages; only their KV slots differ, -1 (written by no
    /// one) where the same requests served would write slots 2·16 + 8 = 40
    /// and 5·16 + 8 = 88.
    #[test]
    fn a_calibration_row_reads_its_context_as_a_served_request_and_writes_no_kv() {
        let rows = probe_rows(0, 2, 40, ProbeKv { page_tokens: 16, pool: 6, table: 8 }, 100).unwrap();
        let probe = step_inputs(&rows, 0, 16, 6, 16, 0).unwrap();
        let served = step_inputs(&rows, rows.len(), 16, 6, 16, 0).unwrap();
        assert_eq!((probe.pos.as_slice(), probe.slots.as_slice()), (&[40, 40][..], &[-1, -1][..]));
        assert_eq!(served.slots, [40, 88]);
        assert_eq!(
            (&probe.ids, &probe.pos, &probe.row_req, &probe.meta),
            (&served.ids, &served.pos, &served.row_req, &served.meta)
        );
        assert_eq!((probe.meta[0], &probe.meta[8..11]), (40, &[0, 1, 2][..]));
        assert_eq!((probe.meta[16], &probe.meta[16 + 8..16 + 11]), (40, &[3, 4, 5][..]));
    }

    /// The split on random sends over 2 nodes of 4 GPUs, against its
    /// definition counted per GPU: afterwards no GPU sends more than its
    /// node's share (when the node's spare room allows), a GPU hands over
    /// exactly its excess and only its last sends, a receiver stays on the
    /// sender's node, and the busiest NIC's sends never rise.
    #[test]
    fn the_nic_split_moves_only_the_excess_within_a_node() {
        let mut x = 0x5eed_u64;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n) as usize
        };
        let (group, gpn): (Vec<usize>, usize) = ((0..8).collect(), 4);
        let mut moved_any = false;
        for _ in 0..500 {
            let sends: BTreeMap<usize, Vec<(usize, usize)>> = group
                .iter()
                .map(|&g| (g, (0..next(9)).map(|t| (t, (1 - g / gpn) * gpn + g % gpn)).collect()))
                .collect();
            let (by, after, before) = nic_split(&sends, &group, gpn);
            assert!(after <= before);
            for n in 0..2 {
                let gpus: Vec<usize> = (n * gpn..(n + 1) * gpn).collect();
                let share = gpus.iter().map(|g| sends[g].len()).sum::<usize>().div_ceil(gpn);
                for &g in &gpus {
                    let out: Vec<usize> = by.keys().filter(|k| k.0 == g).map(|k| k.1).collect();
                    let excess = sends[&g].len().saturating_sub(share);
                    assert_eq!(out.len(), excess, "GPU {g} hands over exactly its excess");
                    let last: Vec<usize> = sends[&g][sends[&g].len() - excess..].iter().map(|s| s.0).collect();
                    assert_eq!(out, last, "GPU {g} hands over its last sends");
                    let load = sends[&g].len() - excess + by.values().filter(|&&p| p == g).count();
                    assert!(load <= share, "GPU {g} sends {load} of a share of {share}");
                }
            }
            assert!(by.iter().all(|(k, &p)| p / gpn == k.0 / gpn && p != k.0));
            moved_any |= !by.is_empty();
        }
        assert!(moved_any);
    }
}
