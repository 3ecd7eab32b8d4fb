//! The plan's transfer programs ([`moeforge_xfer`]): what a bundle carries
//! compiled as `kernels/xfer_{name}.ptx` and `.ll`, and what the runtime
//! rebuilds from the plan to check that code and to lay out its batches.
//!
//! - `reshard`: a dual-mode plan's weight reshard, both directions
//!   ([`crate::reshard::transfers`]).
//! - `dispatch`: an EP dispatch's row copies: each token row, with its top-k
//!   ids and weights, from its source rank's buffer into the next free row of
//!   every destination rank's receive buffer (one shape per buffer pair: a
//!   run of the row's bytes). A decode dispatch on fixed slots gates each
//!   token row on its top-k ids ([`gated_rows`]): the row moves only to a
//!   rank holding one of its experts, decided on the device. The rows are known only at run time, so the
//!   program's code is fixed here and each step's copies are its batch
//!   ([`Program::batch`]); its pieces are the widest every row address of
//!   the pair's buffers allows (a buffer's offset plus whole rows, in every
//!   micro-batch's slice). A replicated placement's dispatch first exchanges
//!   each source's counts per expert (a row of the routing kernel's demand
//!   matrix) with the same program.
//! - `combine`: an EP combine, pulled by each token's source rank: its row
//!   becomes the f32 sum of the bf16 rows the ranks its entries went to
//!   computed, in rank order (a sum shape per number of such ranks, none to
//!   the most a token reaches: its top-k, at most the group). A relayed
//!   combine (`Comm::relay`, or a role plan's prefill posts through
//!   `Path::Relay`) first sums, on each other node's relay, the rows
//!   computed there into one bf16 row (a shape per count, one to the top-k
//!   or the GPUs computing there), then pulls those and the rows that come
//!   straight.
//! - `all_reduce`: a TP all-reduce as a reduce-scatter then an all-gather
//!   (the two-shot all-reduce): each row is summed in rank order on the rank
//!   that owns it (rows dealt round-robin), in place, then copied from there
//!   to every other rank. One sum shape per (row width, group size), one
//!   copy shape per row width.
//! - `kv_handoff`: a role plan's prefill→decode KV handoff
//!   (`crate::roles::KvHandoff`): whole KV pages (every layer and head of
//!   one page's tokens, contiguous) from the prefill server's pool into
//!   pages of the decode server's, one copy per page; each handoff's pages
//!   are its batch.
//! - `expert_swap`: a Zepp placement's intra-node swaps (Zepp §4.3,
//!   [`crate::placement::Swap`]): the contents of two expert slots of one
//!   MoE layer trade places, every routed-expert view's slot (weights,
//!   block scales, biases), in place, between two GPUs of a node or within
//!   one ([`slot_exchanges`]); each swap is its batch. Slots keep their
//!   addresses, so the programs' bindings and descriptors stay valid.

use crate::memory::{BufferName, MemoryPlan, Mode, View, ZeppRouteParts};
use crate::placement::Swap;
use crate::program::CommKind;
use crate::roles::Path;
use crate::Plan;
use moeforge_dsl::spec::PlacementPolicy;
use moeforge_xfer::{Elem, Exchange, Program, StridedCopy, SumShape, Transfer, XferError};

/// The program names, in the order a bundle lists them.
pub const NAMES: [&str; 6] = ["reshard", "dispatch", "combine", "all_reduce", "kv_handoff", "expert_swap"];

/// `kernels/xfer_{name}.ptx` and `.ll`.
pub fn files(name: &str) -> (String, String) {
    (format!("kernels/xfer_{name}.ptx"), format!("kernels/xfer_{name}.ll"))
}

/// Every transfer program `plan` needs, by name.
pub fn programs(plan: &Plan) -> Result<Vec<(&'static str, Program)>, XferError> {
    let mut out = vec![];
    if let Some(rs) = &plan.memory.reshard {
        out.push((NAMES[0], crate::reshard::transfers(&plan.memory, rs)?.program));
    }
    let pairs = dispatch_pairs(plan);
    if !pairs.is_empty() {
        out.push((NAMES[1], row_copies(&pairs)?.with_gated(gated_rows(plan))));
    }
    let combines = combine_sums(plan);
    if !combines.is_empty() {
        out.push((NAMES[2], Program::build(&[])?.0.with_sums(combines)));
    }
    let (sums, pairs) = all_reduce_shapes(plan);
    if !sums.is_empty() {
        // The all-gather copies whole rows of a buffer on one rank to the
        // same rows on another.
        let pairs: Vec<(u64, u64, u64)> = pairs.iter().map(|&(at, row)| (at, at, row)).collect();
        out.push((NAMES[3], row_copies(&pairs)?.with_sums(sums)));
    }
    if let Some((base, page)) = kv_pages(plan) {
        out.push((NAMES[4], row_copies(&[(base, base, page)])?));
    }
    if plan.placement.as_ref().is_some_and(|p| p.policy == PlacementPolicy::Zepp) {
        // One exchange shape per view's slot size; its piece divides every
        // slot address (the view's offset plus whole slots and layers).
        let runs: Vec<(u64, u64)> =
            expert_views(&plan.memory).map(|(v, per)| (per, v.offset | per | v.layer_stride)).collect();
        if !runs.is_empty() {
            out.push((NAMES[5], Program::build(&[])?.0.with_exchanges(runs)));
        }
    }
    Ok(out)
}

/// Every EP view of a routed-expert tensor (weights, block scales, biases)
/// with the bytes of one of its slots (its first dimension).
fn expert_views(mem: &MemoryPlan) -> impl Iterator<Item = (&View, u64)> {
    mem.views.iter().filter(|v| v.mode == Mode::Ep && v.role.is_routed_expert()).map(|v| {
        let slots = v.shape.first().copied().unwrap_or(1).max(1);
        (v, v.bytes() / slots)
    })
}

/// The exchanges that carry out `swap` in model layer `layer`: for every
/// routed-expert view, slot `slot_a` of GPU `a` and slot `slot_b` of GPU
/// `b` trade their bytes (buffer i of the batch is rank i's unified
/// buffer). Empty when the swap exchanges a slot with itself.
pub fn slot_exchanges(mem: &MemoryPlan, layer: u32, swap: &Swap) -> Vec<Exchange> {
    if (swap.a, swap.slot_a) == (swap.b, swap.slot_b) {
        return vec![];
    }
    expert_views(mem)
        .filter(|(v, _)| v.covers(layer))
        .map(|(v, per)| {
            let base = v.offset_of(layer);
            Exchange {
                a: swap.a as u32,
                a_offset: base + swap.slot_a as u64 * per,
                b: swap.b as u32,
                b_offset: base + swap.slot_b as u64 * per,
                bytes: per,
            }
        })
        .collect()
}

/// The code of whole-row copies between buffers at each (source offset,
/// destination offset, row bytes): two instances per pair, the buffers'
/// offsets and one row further on, so a shape's piece divides every row
/// address (the first plus whole rows).
fn row_copies(pairs: &[(u64, u64, u64)]) -> Result<Program, XferError> {
    let copies: Vec<Transfer> = pairs
        .iter()
        .flat_map(|&(src, dst, row)| {
            [0, 1].map(|k| Transfer {
                src: 0,
                dst: 0,
                copy: StridedCopy::one_run(src.saturating_add(k * row), dst.saturating_add(k * row), row),
            })
        })
        .collect();
    Ok(Program::build(&[copies])?.0)
}

/// The sums of every EP combine: `hidden` bf16 elements from each of 0 to
/// min(top-k, group) ranks (and a gated decode dispatch's over more ranks
/// holding experts than top-k: from every one of them, each read only where
/// the token's top-k ids gate it in) (or, relayed, ranks of the own node and relays)
/// into f32; relayed, also the relays' partial sums, from 1 to
/// min(top-k, node) ranks into bf16 rows.
fn combine_sums(plan: &Plan) -> Vec<SumShape> {
    let k = plan.model.top_k;
    let h = u64::from(plan.model.hidden);
    // A role plan's relayed prefill posts: a relay sums the rows of its
    // node's MoE servers.
    let relayed_posts = plan.roles.as_ref().filter(|r| r.posts.iter().any(|p| matches!(p.path, Path::Relay { .. })));
    let moe_per_node = relayed_posts.map(|r| r.per_node.iter().map(|n| n[0]).max().unwrap_or(0));
    let mut out = vec![];
    let mut add = |s: SumShape| {
        if !out.contains(&s) {
            out.push(s);
        }
    };
    // A decode dispatch on fixed slots with gated rows reaches every rank
    // holding experts, more than top-k in a wider group: its combine's sum
    // lists each of them and reads, on the device, only those holding one of
    // the token's top-k experts (the others computed +0.0 for it).
    let gated = !gated_rows(plan).is_empty();
    for p in plan.programs.iter().filter(|p| p.mode == Mode::Ep) {
        for (_, op) in p.ops() {
            let Some(c) = op.comm.as_ref().filter(|c| c.kind == CommKind::AllToAll && c.with.is_empty()) else {
                continue;
            };
            for sources in 0..=k.min(c.group.len() as u32) {
                add(SumShape { elems: h, sources, elem: Elem::Bf16, out: Elem::F32, gate: 0 });
            }
            let holders = c.group.iter().filter(|&&r| plan.local_experts(r as usize) > 0).count() as u32;
            if gated && p.phase == crate::program::Phase::Decode && c.relay.is_none() && holders > k {
                add(SumShape { elems: h, sources: holders, elem: Elem::Bf16, out: Elem::F32, gate: k });
            }
            let computing = c.relay.map(|r| r.gpus_per_node).or(moe_per_node);
            if let Some(n) = computing {
                for sources in 1..=k.min(n) {
                    add(SumShape { elems: h, sources, elem: Elem::Bf16, out: Elem::Bf16, gate: 0 });
                }
            }
        }
    }
    out
}

/// A role plan's KV pool, `(offset, page bytes)`: the pages its handoffs
/// copy (the attention servers' one page format).
pub fn kv_pages(plan: &Plan) -> Option<(u64, u64)> {
    let handoff = plan.roles.as_ref()?.kv_handoff;
    let kv = &plan.memory.kv;
    let base = plan.memory.regions.get(kv.region.index())?.offset;
    (handoff.page_bytes > 0 && handoff.page_bytes == kv.ep.page_bytes).then_some((base, handoff.page_bytes))
}

/// The sums (a row of f32 from each rank of the group) and the all-gather's
/// (buffer offset, row bytes) of every all-reduce, in program order.
fn all_reduce_shapes(plan: &Plan) -> (Vec<SumShape>, Vec<(u64, u64)>) {
    let (mut sums, mut pairs) = (vec![], vec![]);
    for p in &plan.programs {
        for (_, op) in p.ops() {
            let Some(c) = op.comm.as_ref().filter(|c| c.kind == CommKind::AllReduce) else { continue };
            let Some(to) = plan.memory.buffer(p.mode, c.to) else { continue };
            let s = SumShape {
                elems: to.row_bytes / 4,
                sources: c.group.len() as u32,
                elem: Elem::F32,
                out: Elem::F32,
                gate: 0,
            };
            if s.elems > 0 && !sums.contains(&s) {
                sums.push(s);
            }
            let pair = (to.offset, to.row_bytes);
            if to.row_bytes > 0 && !pairs.contains(&pair) {
                pairs.push(pair);
            }
        }
    }
    (sums, pairs)
}

/// The gated row copies of every decode dispatch that may take fixed slots
/// (no relay): its token rows, each gated on the token's top-k ids (a
/// replicated placement's: the physical slots its routing chose), so a row
/// moves only to a rank holding one of its experts while where it lands
/// stays fixed by the token counts. `(row bytes, every row address's bits,
/// top-k)`.
pub fn gated_rows(plan: &Plan) -> Vec<(u64, u64, u32)> {
    let mem = &plan.memory;
    let mut out = vec![];
    for p in plan.programs.iter().filter(|p| p.mode == Mode::Ep && p.phase == crate::program::Phase::Decode) {
        for (_, op) in p.ops() {
            let Some(c) =
                op.comm.as_ref().filter(|c| c.kind == CommKind::AllToAll && !c.with.is_empty() && c.relay.is_none())
            else {
                continue;
            };
            let (Some(s), Some(d)) = (mem.buffer(p.mode, c.from), mem.buffer(p.mode, c.to)) else { continue };
            if s.row_bytes == d.row_bytes && s.row_bytes > 0 {
                let run = (s.row_bytes, s.offset | d.offset | s.row_bytes, plan.model.top_k);
                if !out.contains(&run) {
                    out.push(run);
                }
            }
        }
    }
    out
}

/// Each distinct (source buffer offset, destination buffer offset, row
/// bytes) an EP dispatch copies rows between, in program order. Rows travel
/// at the source's width; a pair whose destination rows are another width
/// is left out (the interpreter refuses it).
pub fn dispatch_pairs(plan: &Plan) -> Vec<(u64, u64, u64)> {
    let mem = &plan.memory;
    let mut out = vec![];
    for p in plan.programs.iter().filter(|p| p.mode == Mode::Ep) {
        for (_, op) in p.ops() {
            let Some(c) = op.comm.as_ref().filter(|c| c.kind == CommKind::AllToAll && !c.with.is_empty()) else {
                continue;
            };
            for [from, to] in std::iter::once([c.from, c.to]).chain(c.with.iter().copied()) {
                let (Some(s), Some(d)) = (mem.buffer(p.mode, from), mem.buffer(p.mode, to)) else { continue };
                let pair = (s.offset, d.offset, s.row_bytes);
                if s.row_bytes == d.row_bytes && s.row_bytes > 0 && !out.contains(&pair) {
                    out.push(pair);
                }
            }
        }
    }
    // A replicated placement's counts exchange before the rows: each
    // source's row of the routing kernel's demand matrix, at the same
    // address on every rank (`ZeppRouteParts::demand`).
    let replicated = plan.placement.as_ref().is_some_and(|p| p.policy != PlacementPolicy::None);
    if let (true, Some(z)) = (replicated, mem.buffers.iter().find(|b| b.name == BufferName::ZeppRoute)) {
        let at = z.offset + ZeppRouteParts::of(1, 1, 1, 0).demand;
        out.push((at, at, 4 * u64::from(plan.model.experts)));
    }
    out
}
