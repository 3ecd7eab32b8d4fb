//! The direct-transfer reshard descriptors between the EP and TP views of
//! the expert slots (Moebius §3.1, §4.3), as a pure function of the slot
//! geometry and the model's shape: the compiler's `reshard` pass writes
//! them into the plan, and the validator recomputes them to check a loaded
//! plan's descriptors exactly (so an edited descriptor can neither move
//! weights where a view does not read them nor loop over runs it invented).
//!
//! EP→TP ("permute then exchange"): rank r holds complete experts
//! `[r·E/P, (r+1)·E/P)`; for every destination rank q it sends the q-th
//! `I/P` slice of each local expert's gate, up and down projections straight
//! into q's TP slot, so no staging buffer exists. TP→EP ("exchange then
//! permute") is the same set of copies with source and destination swapped.
//! EP→TP runs layers in ascending order (slot i+1 holds EP layer i, read
//! before TP layer i+1 is written there), TP→EP in descending order.

use crate::memory::{Copy, ExpertSlots, LayerOrder, Mode, ReshardPlans, WeightReshard};

/// Expert count, FFN size, hidden size, element bytes and group size.
#[derive(Clone, Copy)]
struct Dims {
    e: u64,
    i: u64,
    h: u64,
    elt: u64,
    p: u64,
}

/// The gate, up and down copies from EP rank `r` to TP rank `q`.
fn slices(slots: &ExpertSlots, d: Dims, r: u64, q: u64) -> Vec<Copy> {
    let Dims { e, i, h, elt, p } = d;
    let (el, ip) = (e / p, i / p);
    let first = r * el;
    let w13 = |ep_row: u64, tp_row: u64| Copy {
        src_rank: r as u32,
        dst_rank: q as u32,
        src_offset: ep_row * h * elt,
        dst_offset: (first * 2 * ip + tp_row) * h * elt,
        run_bytes: ip * h * elt,
        counts: [el, 1],
        src_strides: [2 * i * h * elt, 0],
        dst_strides: [2 * ip * h * elt, 0],
    };
    let gate = w13(q * ip, 0);
    let up = w13(i + q * ip, ip);
    let down = Copy {
        src_rank: r as u32,
        dst_rank: q as u32,
        // Saturating: an edited plan's slot sizes are refused by the
        // checks that compare these descriptors; they must not wrap first.
        src_offset: slots.w13_bytes.saturating_add(q * ip * elt),
        dst_offset: slots.w13_bytes.saturating_add(first * h * ip * elt),
        run_bytes: ip * elt,
        counts: [el, h],
        src_strides: [h * i * elt, i * elt],
        dst_strides: [h * ip * elt, ip * elt],
    };
    vec![gate, up, down]
}

fn swap(c: Copy) -> Copy {
    Copy {
        src_rank: c.dst_rank,
        dst_rank: c.src_rank,
        src_offset: c.dst_offset,
        dst_offset: c.src_offset,
        run_bytes: c.run_bytes,
        counts: c.counts,
        src_strides: c.dst_strides,
        dst_strides: c.src_strides,
    }
}

/// Expert bytes per layer whose owning rank differs between EP and TP: the
/// q-th slice of expert g moves unless g's EP owner is q.
pub fn owner_changed_bytes(e: u64, i: u64, h: u64, elt: u64, p: u64) -> u64 {
    let slice = 3 * (i / p) * h * elt;
    (0..e).map(|g| (0..p).filter(|&q| g / (e / p) != q).count() as u64 * slice).sum()
}

/// The descriptors of both directions for `p` ranks, experts `e` of FFN
/// size `i` and hidden size `h`, `elt` bytes per element.
pub fn weights(slots: &ExpertSlots, e: u64, i: u64, h: u64, elt: u64, p: u32) -> ReshardPlans {
    let pp = u64::from(p);
    let dims = Dims { e, i, h, elt, p: pp };
    let mut ep_to_tp = Vec::new();
    for r in 0..pp {
        for q in 0..pp {
            ep_to_tp.extend(slices(slots, dims, r, q));
        }
    }
    let tp_to_ep: Vec<Copy> = ep_to_tp.iter().cloned().map(swap).collect();
    let owner_changed = owner_changed_bytes(e, i, h, elt, pp);
    let split = |v: &[Copy]| {
        let remote: u64 = v.iter().filter(|c| c.src_rank != c.dst_rank).map(Copy::bytes).sum();
        let local: u64 = v.iter().filter(|c| c.src_rank == c.dst_rank).map(Copy::bytes).sum();
        (remote, local)
    };
    let (remote, local) = split(&ep_to_tp);
    ReshardPlans {
        ep_to_tp: WeightReshard {
            from: Mode::Ep,
            to: Mode::Tp,
            order: LayerOrder::Ascending,
            src_shift: slots.ep_shift,
            dst_shift: slots.tp_shift,
            per_layer: ep_to_tp,
            interconnect_bytes_per_layer: remote,
            local_bytes_per_layer: local,
            owner_changed_bytes_per_layer: owner_changed,
        },
        tp_to_ep: WeightReshard {
            from: Mode::Tp,
            to: Mode::Ep,
            order: LayerOrder::Descending,
            src_shift: slots.tp_shift,
            dst_shift: slots.ep_shift,
            per_layer: tp_to_ep,
            interconnect_bytes_per_layer: remote,
            local_bytes_per_layer: local,
            owner_changed_bytes_per_layer: owner_changed,
        },
    }
}

/// The weight reshard as one transfer program ([`moeforge_xfer`]): the
/// shapes of both directions' descriptors, so a bundle carries one compiled
/// program for it, and each direction's batches, one per MoE layer in its
/// schedule's order (a layer's descriptors move between two distinct slots,
/// so they run in parallel; the next layer reads the slot this one freed, so
/// it waits). Buffer i of a batch is rank i's unified buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReshardTransfers {
    pub program: moeforge_xfer::Program,
    pub ep_to_tp: Vec<moeforge_xfer::Batch>,
    pub tp_to_ep: Vec<moeforge_xfer::Batch>,
}

impl ReshardTransfers {
    /// The batches of the reshard that leaves `from`.
    pub fn batches(&self, from: Mode) -> &[moeforge_xfer::Batch] {
        match from {
            Mode::Ep => &self.ep_to_tp,
            Mode::Tp => &self.tp_to_ep,
        }
    }
}

/// [`ReshardTransfers`] of a plan's reshard descriptors.
pub fn transfers(
    mem: &crate::memory::MemoryPlan,
    rs: &ReshardPlans,
) -> Result<ReshardTransfers, moeforge_xfer::XferError> {
    use moeforge_xfer::{StridedCopy, Transfer};
    let layers = |w: &WeightReshard| -> Vec<Vec<Transfer>> {
        let copies: Vec<Transfer> = w
            .schedule(&mem.slots)
            .map(|(c, src_base, dst_base)| Transfer {
                src: c.src_rank,
                dst: c.dst_rank,
                copy: StridedCopy {
                    src_offset: src_base + c.src_offset,
                    dst_offset: dst_base + c.dst_offset,
                    run_bytes: c.run_bytes,
                    counts: c.counts,
                    src_strides: c.src_strides,
                    dst_strides: c.dst_strides,
                },
            })
            .collect();
        copies.chunks(w.per_layer.len().max(1)).map(<[Transfer]>::to_vec).collect()
    };
    let (a, b) = (layers(&rs.ep_to_tp), layers(&rs.tp_to_ep));
    let n = a.len();
    let (program, mut batches) = moeforge_xfer::Program::build(&[a, b].concat())?;
    let tp_to_ep = batches.split_off(n);
    Ok(ReshardTransfers { program, ep_to_tp: batches, tp_to_ep })
}
