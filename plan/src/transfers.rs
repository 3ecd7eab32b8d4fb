//! The plan's transfer programs ([`moeforge_xfer`]): what a bundle carries
//! compiled as `kernels/xfer_{name}.ptx` and `.ll`, and what the runtime
//! rebuilds from the plan to check that code and to lay out its batches.
//!
//! - `reshard`: a dual-mode plan's weight reshard, both directions
//!   ([`crate::reshard::transfers`]).
//! - `dispatch`: an EP dispatch's row copies: each token row, with its top-k
//!   ids and weights, from its source rank's buffer into the next free row of
//!   every destination rank's receive buffer (one shape per buffer pair: a
//!   run of the row's bytes). The rows are known only at run time, so the
//!   program's code is fixed here and each step's copies are its batch
//!   ([`Program::batch`]); its pieces are the widest every row address of
//!   the pair's buffers allows (a buffer's offset plus whole rows, in every
//!   micro-batch's slice).

use crate::memory::Mode;
use crate::program::CommKind;
use crate::Plan;
use moeforge_xfer::{Program, StridedCopy, Transfer, XferError};

/// The program names, in the order a bundle lists them.
pub const NAMES: [&str; 2] = ["reshard", "dispatch"];

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
        // Two instances per pair: the buffers' offsets, and one row further
        // on: every row address is the first plus whole rows.
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
        out.push((NAMES[1], Program::build(&[copies])?.0));
    }
    Ok(out)
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
    out
}
