//! Live TP↔EP switching (Moebius §3, §4.3): the capacity check, the
//! weight reshard by the plan's descriptors, request redistribution
//! (metadata all-gather on EP→TP, longest-first to least-loaded on TP→EP,
//! waiting requests carry nothing) and KV migration head by head from live
//! page tables through a staging copy (gather, exchange, scatter: §3.2's
//! three-stage path) into pages allocated in the target format.
//!
//! On the cpu backend the staging is host memory outside the unified
//! buffers. On a device (`--backend emu`) nothing passes through the host
//! (§4.3): the weights move by the plan's descriptors as device copies, and
//! the KV by the layer kernels' page-indexed `kv_migrate`, each destination
//! rank reading the source ranks' pools directly into target pages the
//! switch allocates outside every live source page (the two page formats
//! share the pool), so no page is written while it may still be read. The
//! capacity check uses the requests' full reservations (prompt + max_new),
//! which is conservative against §4.5's live-token check; on a device the
//! pages moved now must also fit outside the live source pages, or the
//! switch is cancelled. A request's sampling state (its generator) lives in
//! its record and is written into its new owner's request header at the
//! next step, so it moves with the request.

use super::paging::{kv_pages, KvGeom, Pages};
use super::reshard::execute_reshard;
use super::{Live, Twin, TwinError};
use crate::engine::{RequestId, SwitchEvent};
use moeforge_plan::memory::Mode;
use std::collections::BTreeMap;
use std::time::Instant;

/// One request's staged KV: `[layer][kv head]` → bytes of every cached position.
type StagedKv = Vec<Vec<Vec<u8>>>;

/// A group of KV page moves: (source rank, destination rank, first source
/// head, first destination head, heads).
type MoveGroup = (usize, usize, usize, usize, usize);

/// Where a device switch puts the KV: per rank, each request's new page
/// table and the pages left free.
struct Placed {
    tables: Vec<BTreeMap<RequestId, Vec<u32>>>,
    free: Vec<std::collections::VecDeque<u32>>,
}

impl Twin {
    /// Switches now, unless the target mode cannot hold the live KV cache
    /// (then the switch is recorded as cancelled). Returns whether it switched.
    pub fn switch_to(&mut self, target: Mode) -> Result<bool, TwinError> {
        if target == self.mode {
            return Ok(false);
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
        // On a device: the target pages of the KV moved now, outside the live source pages.
        let (over, placed) = match (over, self.device.is_some()) {
            (None, true) => match self.place_outside_sources(&running, &owners, target) {
                Ok(p) => (None, Some(p)),
                Err(reason) => (Some(reason), None),
            },
            (over, _) => (over, None),
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
        if let Some(placed) = placed {
            let (weight_bytes, kv_bytes) = self.switch_on_device(&running, &owners, target, placed)?;
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
            return Ok(true);
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

    /// The rank holding KV head `h` of request `id` before a switch to
    /// `target`: EP its owner; TP the new owner if it holds `h`, else the
    /// first holder.
    fn kv_source(&self, id: RequestId, h: usize, owners: &BTreeMap<RequestId, usize>, target: Mode) -> usize {
        match self.mode {
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
        }
    }

    /// The ranks holding request `id` after a switch to `target`.
    fn holders(&self, id: RequestId, owners: &BTreeMap<RequestId, usize>, target: Mode) -> Vec<usize> {
        match target {
            Mode::Tp => (0..self.ranks.len()).collect(),
            Mode::Ep => owners.get(&id).map(|&o| vec![o]).unwrap_or_default(),
        }
    }

    /// Target-format pages for every running request's cached KV on every
    /// rank that will hold it, none overlapping a live page of the current
    /// format on that rank (the formats share the pool). Per rank: each
    /// request's new page table, and the free pages left. An error says
    /// which rank lacks room.
    fn place_outside_sources(
        &self,
        running: &[RequestId],
        owners: &BTreeMap<RequestId, usize>,
        target: Mode,
    ) -> Result<Placed, String> {
        let (src, dst) = (KvGeom::of(&self.plan, self.mode), KvGeom::of(&self.plan, target));
        let total = kv_pages(&self.plan, target) as u32;
        let page = dst.page_tokens;
        let mut placed = Placed { tables: vec![BTreeMap::new(); self.ranks.len()], free: Vec::new() };
        for (r, rank) in self.ranks.iter().enumerate() {
            // Live source bytes on this rank, as page-aligned intervals.
            let mut live: Vec<(usize, usize)> = rank
                .tables
                .values()
                .flatten()
                .map(|&p| (p as usize * src.page_bytes, (p as usize + 1) * src.page_bytes))
                .collect();
            live.sort_unstable();
            let clear = |q: u32| {
                let (a, b) = (q as usize * dst.page_bytes, (q as usize + 1) * dst.page_bytes);
                let i = live.partition_point(|&(_, e)| e <= a);
                live.get(i).is_none_or(|&(s, _)| s >= b)
            };
            let mut free: std::collections::VecDeque<u32> = (0..total).filter(|&q| clear(q)).collect();
            let mut later: Vec<u32> = (0..total).filter(|&q| !clear(q)).collect();
            for &id in running {
                if !self.holders(id, owners, target).contains(&r) {
                    continue;
                }
                let n = self.requests.get(&id).map_or(0, |q| q.cached).div_ceil(page);
                if free.len() < n {
                    return Err(format!(
                        "rank {r} has {} {} KV pages outside the live {} pages; the running requests need more",
                        free.len(),
                        target.name(),
                        self.mode.name()
                    ));
                }
                placed.tables[r].insert(id, free.drain(..n).collect());
            }
            // Pages under the old live ones are free once the switch is done.
            free.extend(later.drain(..));
            placed.free.push(free);
        }
        Ok(placed)
    }

    /// The switch on the device: weights by the plan's descriptors, KV by
    /// `kv_migrate` into the placed pages, then the ranks' tables and
    /// ownership. Returns (weight bytes crossing ranks, KV bytes moved).
    fn switch_on_device(
        &mut self,
        running: &[RequestId],
        owners: &BTreeMap<RequestId, usize>,
        target: Mode,
        placed: Placed,
    ) -> Result<(u64, u64), TwinError> {
        use crate::device::exec::{KvMigration, KvSide};
        let reshard = self.plan.reshard.clone().ok_or(TwinError::NoMode(target))?;
        let w = if target == Mode::Tp { &reshard.ep_to_tp } else { &reshard.tp_to_ep };
        let (src, dst) = (KvGeom::of(&self.plan, self.mode), KvGeom::of(&self.plan, target));
        let page = src.page_tokens;
        // Page moves grouped by (source rank, destination rank, first source
        // head, first destination head, heads): each group one migration.
        let mut moves: BTreeMap<MoveGroup, Vec<[i32; 3]>> = BTreeMap::new();
        for &id in running {
            let cached = self.requests.get(&id).map_or(0, |q| q.cached);
            for d in self.holders(id, owners, target) {
                let Some(to) = placed.tables[d].get(&id) else { continue };
                let (da, db) = self.kv_heads_of(target, d);
                let mut h = da;
                while h < db {
                    // The run of heads [h, e) one source rank gives.
                    let s = self.kv_source(id, h, owners, target);
                    let (sa, sb) = self.kv_heads_of(self.mode, s);
                    let mut e = h + 1;
                    while e < db.min(sb) && self.kv_source(id, e, owners, target) == s {
                        e += 1;
                    }
                    let from = self.ranks[s].tables.get(&id).map_or(&[][..], Vec::as_slice);
                    let rows = moves.entry((s, d, h - sa, h - da, e - h)).or_default();
                    for (i, (&sp, &dp)) in from.iter().zip(to).enumerate() {
                        let tokens = cached.saturating_sub(i * page).min(page);
                        rows.push([sp as i32, dp as i32, tokens as i32]);
                    }
                    h = e;
                }
            }
        }
        let dev = self.device.as_mut().ok_or_else(|| TwinError::Unsupported("no device".into()))?;
        let err = |e: crate::device::exec::ExecError| TwinError::Unsupported(format!("live switch on the device: {e}"));
        // KV first: the weight reshard never touches the pool, and the
        // sources must be read before anything else changes.
        let mut kv_bytes = 0;
        for ((s, d, s0, d0, heads), rows) in &moves {
            let m = KvMigration {
                src: KvSide { page_bytes: src.page_bytes as u64, heads: src.heads as u32, head0: *s0 as u32 },
                dst: KvSide { page_bytes: dst.page_bytes as u64, heads: dst.heads as u32, head0: *d0 as u32 },
                heads: *heads as u32,
                table_mode: target,
            };
            kv_bytes += dev.migrate_kv(&m, *s, *d, rows).map_err(err)?;
        }
        let weight_bytes = dev.reshard(w).map_err(err)?;
        self.mode = target;
        for (r, (tables, free)) in placed.tables.into_iter().zip(placed.free).enumerate() {
            let rank = &mut self.ranks[r];
            rank.pages = Pages { free, total: kv_pages(&self.plan, target) as u32 };
            rank.requests = running.iter().copied().filter(|id| tables.contains_key(id)).collect();
            rank.tables = tables;
        }
        Ok((weight_bytes, kv_bytes))
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
                    let src = self.kv_source(id, h, owners, target);
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
