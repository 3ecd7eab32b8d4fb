//! Live TP↔EP switching (Moebius §3, §4.3): the capacity check, the
//! weight reshard by the plan's descriptors, request redistribution
//! (metadata all-gather on EP→TP, longest-first to least-loaded on TP→EP,
//! waiting requests carry nothing) and KV migration head by head from live
//! page tables through a staging copy (gather, exchange, scatter: §3.2's
//! three-stage path) into pages allocated in the target format.
//!
//! The staging is host memory outside the unified buffers; a device
//! implementation would instead allocate target pages outside the live
//! source pages and write them directly (§4.3). The capacity check uses the
//! requests' full reservations (prompt + max_new), which is conservative
//! against §4.5's live-token check.

use super::paging::{kv_pages, KvGeom, Pages};
use super::reshard::execute_reshard;
use super::{Live, Twin, TwinError};
use crate::engine::{RequestId, SwitchEvent};
use moeforge_plan::memory::Mode;
use std::collections::BTreeMap;
use std::time::Instant;

/// One request's staged KV: `[layer][kv head]` → bytes of every cached position.
type StagedKv = Vec<Vec<Vec<u8>>>;

impl Twin {
    /// Switches now, unless the target mode cannot hold the live KV cache
    /// (then the switch is recorded as cancelled). Returns whether it switched.
    pub fn switch_to(&mut self, target: Mode) -> Result<bool, TwinError> {
        if target == self.mode {
            return Ok(false);
        }
        if self.device.is_some() {
            return Err(TwinError::Unsupported(
                "live switches on a device (the reshard and KV migration as device transfers) are not built yet; \
                 run with `switch { t_high = off }` or on the cpu backend"
                    .into(),
            ));
        }
        if !self.plan.modes.contains(&target) {
            return Err(TwinError::NoMode(target));
        }
        let t0 = Instant::now();
        let from = self.mode;
        let inflight = self.inflight();
        // Running requests in metadata all-gather order: rank by rank, each in its order.
        let mut running: Vec<RequestId> = Vec::new();
        for r in &self.ranks {
            for id in &r.requests {
                if !running.contains(id) {
                    running.push(*id);
                }
            }
        }
        // New ownership and the KV capacity check.
        let target_pages = kv_pages(&self.plan, target) as usize;
        let owners: BTreeMap<RequestId, usize> = match target {
            Mode::Ep => self.partition(&running),
            Mode::Tp => BTreeMap::new(),
        };
        let over = match target {
            Mode::Tp => {
                let need: usize = running.iter().map(|id| self.pages_needed(*id)).sum();
                (need > target_pages).then(|| {
                    format!("TP needs {need} KV pages per rank for {} requests, has {target_pages}", running.len())
                })
            }
            Mode::Ep => (0..self.ranks.len()).find_map(|r| {
                let need: usize = owners.iter().filter(|(_, o)| **o == r).map(|(id, _)| self.pages_needed(*id)).sum();
                (need > target_pages).then(|| format!("EP rank {r} needs {need} KV pages, has {target_pages}"))
            }),
        };
        if let Some(reason) = over {
            self.events.push(SwitchEvent {
                step: self.step,
                from,
                to: target,
                inflight,
                cancelled: Some(reason),
                weight_bytes_moved: 0,
                kv_bytes_moved: 0,
                seconds: t0.elapsed().as_secs_f64(),
            });
            return Ok(false);
        }
        // KV: gather every running request's cached K/V per layer and head.
        let staged = self.gather_kv(&running, &owners, target);
        // Expert weights: the plan's descriptors, in place, in the plan's layer order.
        let reshard = self.plan.reshard.clone().ok_or(TwinError::NoMode(target))?;
        let w = if target == Mode::Tp { &reshard.ep_to_tp } else { &reshard.tp_to_ep };
        let weight_bytes = execute_reshard(&self.plan, w, &mut self.ranks);
        // Ownership and pages in the target format; scatter the KV.
        self.mode = target;
        for r in &mut self.ranks {
            r.pages = Pages::new(target_pages as u64);
            r.tables.clear();
            r.requests.clear();
        }
        for &id in &running {
            match target {
                Mode::Tp => self.ranks.iter_mut().for_each(|r| r.requests.push(id)),
                Mode::Ep => {
                    if let Some(&o) = owners.get(&id) {
                        self.ranks[o].requests.push(id);
                    }
                }
            }
        }
        let kv_bytes = self.scatter_kv(&running, staged)?;
        self.events.push(SwitchEvent {
            step: self.step,
            from,
            to: target,
            inflight,
            cancelled: None,
            weight_bytes_moved: weight_bytes,
            kv_bytes_moved: kv_bytes,
            seconds: t0.elapsed().as_secs_f64(),
        });
        Ok(true)
    }

    /// TP→EP request partition (Moebius §3.2): by decreasing sequence length
    /// (ties by id), each to the rank with the fewest tokens, then requests,
    /// then the lowest id. Deterministic, so every rank computes the same.
    fn partition(&self, running: &[RequestId]) -> BTreeMap<RequestId, usize> {
        let len = |id: &RequestId| self.requests.get(id).map_or(0, Live::len);
        let mut order: Vec<RequestId> = running.to_vec();
        order.sort_by_key(|id| (std::cmp::Reverse(len(id)), *id));
        let mut load = vec![(0usize, 0usize); self.ranks.len()];
        let mut out = BTreeMap::new();
        for id in order {
            let r = (0..load.len()).min_by_key(|&r| (load[r].0, load[r].1, r)).unwrap_or(0);
            load[r].0 += len(&id);
            load[r].1 += 1;
            out.insert(id, r);
        }
        out
    }

    /// Reads the cached K/V of every running request:
    /// `staged[req][layer][head]` = bytes of all its positions.
    fn gather_kv(
        &self,
        running: &[RequestId],
        owners: &BTreeMap<RequestId, usize>,
        target: Mode,
    ) -> BTreeMap<RequestId, StagedKv> {
        let m = &self.model;
        let geo = KvGeom::of(&self.plan, self.mode);
        let (page, tb) = (geo.page_tokens, geo.token_bytes);
        let mut out = BTreeMap::new();
        for &id in running {
            let n = self.requests.get(&id).map_or(0, |r| r.cached);
            let mut layers = vec![vec![Vec::with_capacity(n * tb); m.kv_heads]; m.layers];
            for (layer, heads) in layers.iter_mut().enumerate() {
                for (h, bytes) in heads.iter_mut().enumerate() {
                    // The source rank holding head h: EP the owner; TP the new
                    // owner if it holds h, else the first holder.
                    let src = match self.mode {
                        Mode::Ep => self.ranks.iter().position(|r| r.requests.contains(&id)).unwrap_or(0),
                        Mode::Tp => {
                            let holds = |r: usize| {
                                let (a, b) = self.kv_heads_of(Mode::Tp, r);
                                (a..b).contains(&h)
                            };
                            match (target, owners.get(&id)) {
                                (Mode::Ep, Some(&o)) if holds(o) => o,
                                _ => (0..self.ranks.len()).find(|&r| holds(r)).unwrap_or(0),
                            }
                        }
                    };
                    let rank = &self.ranks[src];
                    let table = rank.tables.get(&id).cloned().unwrap_or_default();
                    let local = h.saturating_sub(self.kv_heads_of(self.mode, src).0);
                    for pos in 0..n {
                        let Some(&pg) = table.get(pos / page) else { break };
                        let at = geo.slot(pg, layer, local, pos % page);
                        bytes.extend_from_slice(&rank.buf[at..at + tb]);
                    }
                }
            }
            out.insert(id, layers);
        }
        out
    }

    /// Writes staged K/V into freshly allocated pages of the current mode.
    fn scatter_kv(&mut self, running: &[RequestId], staged: BTreeMap<RequestId, StagedKv>) -> Result<u64, TwinError> {
        let geo = KvGeom::of(&self.plan, self.mode);
        let (page, tb) = (geo.page_tokens, geo.token_bytes);
        let mut moved = 0u64;
        for &id in running {
            let n = self.requests.get(&id).map_or(0, |r| r.cached);
            let Some(layers) = staged.get(&id) else { continue };
            for r in 0..self.ranks.len() {
                if !self.ranks[r].requests.contains(&id) {
                    continue;
                }
                let mut table = Vec::new();
                for _ in 0..n.div_ceil(page) {
                    let pg = self.ranks[r].pages.free.pop_front().ok_or_else(|| {
                        TwinError::Unsupported(format!(
                            "rank {r} has no KV page left for request {id} after the switch"
                        ))
                    })?;
                    table.push(pg);
                }
                let (a, b) = self.kv_heads_of(self.mode, r);
                for (layer, heads) in layers.iter().enumerate() {
                    for (h, head) in heads.iter().enumerate().take(b).skip(a) {
                        for pos in 0..n.min(head.len() / tb.max(1)) {
                            let at = geo.slot(table[pos / page], layer, h - a, pos % page);
                            self.ranks[r].buf[at..at + tb].copy_from_slice(&head[pos * tb..(pos + 1) * tb]);
                            moved += tb as u64;
                        }
                    }
                }
                self.ranks[r].tables.insert(id, table);
            }
        }
        Ok(moved)
    }
}
