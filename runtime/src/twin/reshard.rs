//! Executing the plan's weight reshard descriptors (Moebius §3.1) on rank
//! buffers: layer by layer in the plan's order, every strided copy byte for
//! byte, in place in the N+1 expert slots. The validator bounds every run
//! inside its slot, so no edited plan makes this index out of a buffer.

use super::Rank;
use moeforge_plan::memory::{Copy, MemoryPlan, WeightReshard};

impl AsMut<[u8]> for Rank {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

/// Executes a weight reshard on the ranks' buffers: for each MoE layer in
/// the plan's order, every descriptor, byte for byte. Returns the bytes that
/// crossed between ranks.
pub fn execute_reshard(plan: &MemoryPlan, w: &WeightReshard, ranks: &mut [impl AsMut<[u8]>]) -> u64 {
    let mut remote = 0;
    for (c, src_base, dst_base) in w.schedule(&plan.slots) {
        copy_runs(c, src_base, dst_base, ranks);
        if c.src_rank != c.dst_rank {
            remote += c.bytes();
        }
    }
    remote
}

fn copy_runs(c: &Copy, src_base: u64, dst_base: u64, ranks: &mut [impl AsMut<[u8]>]) {
    let run = c.run_bytes as usize;
    for (so, dof) in c.runs() {
        let (s, d) = ((src_base + so) as usize, (dst_base + dof) as usize);
        if c.src_rank == c.dst_rank {
            ranks[c.src_rank as usize].as_mut().copy_within(s..s + run, d);
        } else {
            let (a, b) = (c.src_rank as usize, c.dst_rank as usize);
            let (lo, hi) = ranks.split_at_mut(a.max(b));
            let (src, dst) = if a < b { (lo[a].as_mut(), hi[0].as_mut()) } else { (hi[0].as_mut(), lo[b].as_mut()) };
            dst[d..d + run].copy_from_slice(&src[s..s + run]);
        }
    }
}
