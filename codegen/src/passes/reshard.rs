//! Reshard pass: the direct-transfer descriptors that move expert weights
//! between the EP and TP views (Moebius §3.1, §4.3), from
//! [`moeforge_plan::reshard::weights`]. Attention weights need no transfer:
//! both layouts stay resident and a switch swaps views. KV transfers depend
//! on live page tables and are built by the runtime from
//! [`moeforge_plan::memory::KvPlan`]'s head ownership.

use super::{Ctx, PassError};
use moeforge_plan::memory::{elt_bytes, Mode};
use moeforge_plan::reshard::weights;
use moeforge_plan::Plan;

/// Writes `plan.memory.reshard` when the memory plan holds both modes. It
/// moves no KV (the runtime does, from live page tables) and never fails.
pub fn run(cx: &Ctx<'_>, plan: &mut Plan) -> Result<(), Vec<PassError>> {
    let mem = &mut plan.memory;
    if mem.modes != [Mode::Tp, Mode::Ep] {
        return Ok(());
    }
    let m = cx.model;
    let (e, i, h) = (u64::from(m.moe.experts), u64::from(m.moe.expert_ffn), u64::from(m.hidden));
    mem.reshard = Some(weights(&mem.slots, e, i, h, elt_bytes(m.dtype.experts), mem.group));
    Ok(())
}
