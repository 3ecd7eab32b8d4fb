//! The paged KV cache of one rank: a free-page allocator per page format,
//! and where (page, layer, head, token) lives in the pool (the plan's
//! `KvPlan`: a page holds `page_tokens` tokens of every layer for the
//! rank's heads; K then V per head and token).

use super::Twin;
use moeforge_plan::memory::{MemoryPlan, Mode};
use std::collections::VecDeque;

/// A page allocator over one rank's KV pool in one page format.
#[derive(Clone, Debug)]
pub(super) struct Pages {
    pub free: VecDeque<u32>,
    pub total: u32,
}

impl Pages {
    pub fn new(total: u64) -> Pages {
        let total = total.min(u64::from(u32::MAX)) as u32;
        Pages { free: (0..total).collect(), total }
    }
}

/// Pages per rank of `mode`'s KV format.
pub(super) fn kv_pages(plan: &MemoryPlan, mode: Mode) -> u64 {
    match (mode, &plan.kv.tp) {
        (Mode::Tp, Some(tp)) => tp.pages,
        _ => plan.kv.ep.pages,
    }
}

/// The KV geometry of one mode: pool base, page size, heads per page.
#[derive(Clone, Copy, Debug)]
pub(super) struct KvGeom {
    pub base: usize,
    pub page_bytes: usize,
    pub heads: usize,
    pub page_tokens: usize,
    pub token_bytes: usize,
}

impl KvGeom {
    pub fn of(plan: &MemoryPlan, mode: Mode) -> KvGeom {
        let kv = &plan.kv;
        let (heads, page_bytes) = match (mode, &kv.tp) {
            (Mode::Tp, Some(tp)) => (tp.heads_per_rank as usize, tp.page_bytes as usize),
            _ => (kv.ep.heads_per_rank as usize, kv.ep.page_bytes as usize),
        };
        KvGeom {
            base: plan.regions.get(kv.region.index()).map_or(0, |r| r.offset) as usize,
            page_bytes,
            heads,
            page_tokens: kv.page_tokens.max(1) as usize,
            token_bytes: kv.head_token_bytes as usize,
        }
    }

    /// Byte offset of (page, layer, local head, token in page).
    pub fn slot(&self, page: u32, layer: usize, head: usize, tip: usize) -> usize {
        self.base
            + page as usize * self.page_bytes
            + ((layer * self.heads + head) * self.page_tokens + tip) * self.token_bytes
    }
}

impl Twin {
    /// The KV heads `[a, b)` a rank stores in `mode`.
    pub(super) fn kv_heads_of(&self, mode: Mode, r: usize) -> (usize, usize) {
        match mode {
            Mode::Ep => (0, self.model.kv_heads),
            Mode::Tp => {
                let [a, b] = self.plan.kv.tp_heads.get(r).copied().unwrap_or([0, 0]);
                (a as usize, b as usize)
            }
        }
    }
}
