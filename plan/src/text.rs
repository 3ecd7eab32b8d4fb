//! The textual form of a [`Plan`] (what `moeforge explain` prints).

use crate::memory::RegionKind;
use crate::program::{KernelRef, Program};
use crate::{KernelParams, Plan};
use std::fmt::{self, Display, Formatter};

impl Display for Plan {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let gb = |b: u64| format!("{:.2}GB", b as f64 / 1e9);
        writeln!(f, "plan {} {{", self.deploy)?;
        writeln!(f, "  format = {}  spec_hash = {}", self.format_version, self.spec_hash)?;
        let m = &self.model;
        writeln!(
            f,
            "  model {}: params {} total / {} active, weights {}, expert {} ({}), kv {}B/token",
            m.name,
            m.params_total,
            m.params_active,
            gb(m.weight_bytes),
            gb(m.expert_bytes),
            m.expert_dtype.name(),
            m.kv_bytes_per_token
        )?;
        let c = &self.cluster;
        writeln!(
            f,
            "  cluster {}: {}×{} {} {} ({} SMs)",
            c.name,
            c.nodes,
            c.gpus_per_node,
            c.gpu,
            c.arch.name(),
            c.sms
        )?;
        let l = &self.layout;
        writeln!(
            f,
            "  layout: attention {}, moe {}, {} experts/rank (requested {:?})",
            l.attention, l.moe, l.max_experts_per_rank, l.requested
        )?;
        if let Some(n) = &l.note {
            writeln!(f, "    note: {n}")?;
        }
        if let Some(r) = &self.roles {
            writeln!(
                f,
                "  roles: per node [moe, prefill, decode] {:?}, APK decode q {}, {} dispatch posts, KV handoff pages of {} B",
                r.per_node,
                r.q,
                r.posts.len(),
                r.kv_handoff.page_bytes
            )?;
        }
        for r in &self.ranks {
            let role = self.role(r.rank as usize).map_or(String::new(), |x| format!(" {} server:", x.name()));
            if self.role(r.rank as usize).is_some_and(crate::roles::Role::attends) {
                writeln!(f, "  rank {} (node {}, gpu {}):{role} attention, no experts", r.rank, r.node, r.local_rank)?;
                continue;
            }
            match &self.placement {
                None => writeln!(
                    f,
                    "  rank {} (node {}, gpu {}):{role} experts [{}, {})",
                    r.rank, r.node, r.local_rank, r.experts[0], r.experts[1]
                )?,
                Some(p) => {
                    let slots: Vec<String> = self.slot_experts(0, r.rank as usize).iter().map(u32::to_string).collect();
                    writeln!(
                        f,
                        "  rank {} (node {}, gpu {}):{role} {} slots, MoE layer 0 holds {} ({:?} placement)",
                        r.rank,
                        r.node,
                        r.local_rank,
                        slots.len(),
                        slots.join(" "),
                        p.policy
                    )?
                }
            }
        }
        let mem = &self.memory;
        let modes: Vec<&str> = mem.modes.iter().map(|m| m.name()).collect();
        writeln!(
            f,
            "  memory/rank: buffer {} ({}), modes [{}], group {}",
            gb(mem.buffer_bytes),
            mem.memory_fraction,
            modes.join(", "),
            mem.group
        )?;
        if let Some(r) = &mem.single_mode_reason {
            writeln!(f, "    single mode: {r}")?;
        }
        for r in &mem.regions {
            let modes: Vec<&str> = r.modes.iter().map(|m| m.name()).collect();
            let held = if r.roles.is_empty() {
                String::new()
            } else {
                format!(" held by {}", r.roles.iter().map(|x| x.name()).collect::<Vec<_>>().join(", "))
            };
            writeln!(
                f,
                "    region {:<13} @{:>14} {:>14} B [{}]{held}",
                r.kind.name(),
                r.offset,
                r.bytes,
                modes.join(", ")
            )?;
        }
        let s = &mem.slots;
        writeln!(
            f,
            "    expert slots: {} × {} B (w13 {} + w2 {}), tp layer i → slot i+{}, ep layer i → slot i+{}",
            u64::from(s.moe_layers) + u64::from(s.ep_shift),
            s.slot_bytes,
            s.w13_bytes,
            s.w2_bytes,
            s.tp_shift,
            s.ep_shift
        )?;
        let kv = &mem.kv;
        writeln!(
            f,
            "    kv ep: {} heads/rank, {} pages of {} B, {} tokens",
            kv.ep.heads_per_rank, kv.ep.pages, kv.ep.page_bytes, kv.ep.capacity_tokens
        )?;
        if let Some(tp) = &kv.tp {
            writeln!(
                f,
                "    kv tp: {} heads/rank (×{} replicated), {} pages of {} B, {} tokens",
                tp.heads_per_rank, kv.replication, tp.pages, tp.page_bytes, tp.capacity_tokens
            )?;
        }
        if let Some(rs) = &mem.reshard {
            for w in [&rs.ep_to_tp, &rs.tp_to_ep] {
                writeln!(
                    f,
                    "    reshard {}→{} ({:?}): {} copies/layer, {} B/layer over links (lower bound {}), {} B/layer local",
                    w.from.name(),
                    w.to.name(),
                    w.order,
                    w.per_layer.len(),
                    w.interconnect_bytes_per_layer,
                    w.owner_changed_bytes_per_layer,
                    w.local_bytes_per_layer
                )?;
            }
        }
        writeln!(
            f,
            "    dual-mode overhead: {} B ({:.2}% of the buffer)",
            mem.overhead.overhead_bytes,
            mem.overhead.overhead_fraction * 100.0
        )?;
        for b in &mem.buffers {
            writeln!(
                f,
                "    buffer {:<13} @ {:>13} {:>6} × {:>7} B [{}]",
                snake(&b.name),
                b.offset,
                b.rows,
                b.row_bytes,
                snake(&b.modes)
            )?;
        }
        if let Some(r) = &self.search {
            match r.ranked.first() {
                Some(c) => writeln!(
                    f,
                    "  search: best {}P{}D{}E q={} prefill {}/{} decode {}/{} B_p={} B_d={} G={:.2} req/s ({} layouts, {} feasible candidates)",
                    c.prefill_gpus,
                    c.decode_gpus,
                    c.moe_gpus,
                    c.q,
                    crate::search::Candidate::attention_name(c.prefill_width),
                    c.overlap.prefill.name(),
                    crate::search::Candidate::attention_name(c.decode_width),
                    c.overlap.decode.name(),
                    c.prefill_tokens,
                    c.decode_batch,
                    c.goodput,
                    r.layouts_considered,
                    r.feasible
                )?,
                None => writeln!(f, "  search: no layout meets both SLOs ({} layouts)", r.layouts_considered)?,
            }
        }
        if let Some(p) = &self.placement {
            writeln!(
                f,
                "  placement: {:?}, {} redundant, loads {}; layer 0 modeled: none {}, eplb {:.1}us, zepp {:.1}us",
                p.policy,
                p.redundant_experts,
                p.loads,
                p.latency_none.map_or("n/a".to_string(), |t| format!("{:.1}us", t * 1e6)),
                p.latency_eplb * 1e6,
                p.latency_zepp * 1e6
            )?;
        }
        for k in &self.kernels {
            let consts = match &k.params {
                KernelParams::Router(p) => serde_json::to_string(p),
                KernelParams::Permute(p) => serde_json::to_string(p),
                KernelParams::Apk(p) => serde_json::to_string(p),
                KernelParams::Layer(p) => serde_json::to_string(p),
                KernelParams::Zepp(p) => serde_json::to_string(p),
            }
            .unwrap_or_default();
            writeln!(f, "  kernel {} ({}): {}", k.name, k.arch.name(), consts)?;
            for e in &k.entries {
                let smem = if e.dynamic_smem > 0 { format!(", {}", e.dynamic_smem) } else { String::new() };
                writeln!(f, "    {}<<<{}, {}{smem}>>>({})", e.symbol, e.grid, e.block, e.params.join(", "))?;
            }
        }
        for p in &self.programs {
            write_program(f, p)?;
        }
        writeln!(f, "}}")
    }
}

/// A program as one header line and one line of ops per block: `name`,
/// `@stream` off the first stream, `<events>` waited on, `>event` recorded.
fn write_program(f: &mut Formatter<'_>, p: &Program) -> fmt::Result {
    let mut kinds = [0usize; 4];
    for (_, op) in p.ops() {
        kinds[match op.kernel {
            KernelRef::Launch { .. } => 0,
            KernelRef::Post { .. } => 1,
            KernelRef::Transfer => 2,
            KernelRef::Missing { .. } | KernelRef::Skip { .. } => 3,
        }] += 1;
    }
    let ranks = match (p.ranks.first(), p.ranks.last()) {
        (Some(a), Some(b)) if b - a + 1 == p.ranks.len() as u32 => format!("{a}..={b}"),
        _ => format!("{:?}", p.ranks),
    };
    writeln!(
        f,
        "  program {} {} {} (ranks {ranks}): overlap {}, {} micro-batch(es), streams [{}], {} events; ops: {} launched, {} posted to the APK, {} transfers, {} with no emitted kernel yet",
        snake(&p.role),
        p.mode.name(),
        p.phase.name(),
        snake(&p.overlap),
        p.micro_batches,
        p.streams.join(", "),
        p.events.len(),
        kinds[0],
        kinds[1],
        kinds[2],
        kinds[3]
    )?;
    for b in &p.blocks {
        let ops: Vec<String> = b
            .ops
            .iter()
            .map(|op| {
                let mut t = op.name.clone();
                if op.stream != 0 {
                    t.push_str(&format!("@{}", p.streams.get(op.stream as usize).map_or("?", |s| s.as_str())));
                }
                if !op.waits.is_empty() {
                    let w: Vec<&str> =
                        op.waits.iter().map(|e| p.events.get(*e as usize).map_or("?", |s| s.as_str())).collect();
                    t.push_str(&format!("<{}>", w.join(",")));
                }
                if let Some(e) = op.record {
                    t.push_str(&format!(">{}", p.events.get(e as usize).map_or("?", |s| s.as_str())));
                }
                t
            })
            .collect();
        let layers = b.layers.map_or(String::new(), |[a, e]| format!(" [{a}, {e})"));
        writeln!(f, "    {}{layers}: {}", snake(&b.kind), ops.join(" "))?;
    }
    Ok(())
}

impl Plan {
    /// The few lines `moeforge compile` prints: model, cluster, layout and
    /// the per-GPU memory plan.
    pub fn summary(&self) -> String {
        let (m, c, mem) = (&self.model, &self.cluster, &self.memory);
        let mut t = String::new();
        t.push_str(&format!(
            "  model    {}: {:.1}B params ({:.1}B active), {} layers, {} experts top-{}\n",
            m.name,
            m.params_total as f64 / 1e9,
            m.params_active as f64 / 1e9,
            m.layers,
            m.experts,
            m.top_k
        ));
        t.push_str(&format!("  cluster  {}: {}×{} {} ({})\n", c.name, c.nodes, c.gpus_per_node, c.gpu, c.arch.name()));
        t.push_str(&format!(
            "  layout   attention {}, experts {} ({} per GPU)\n",
            self.layout.attention, self.layout.moe, self.layout.max_experts_per_rank
        ));
        let weights = |holder: Option<crate::roles::Role>| -> u64 {
            mem.regions
                .iter()
                .filter(|r| {
                    r.held_by(holder)
                        && matches!(
                            r.kind,
                            RegionKind::Replicated
                                | RegionKind::AttentionEp
                                | RegionKind::AttentionTp
                                | RegionKind::Experts
                        )
                })
                .map(|r| r.bytes)
                .sum()
        };
        let modes: Vec<&str> = mem.modes.iter().map(|m| m.name()).collect();
        let held = match self.roles.as_ref().filter(|r| r.moe_servers()) {
            None => format!("{:.1} GB weights", weights(None) as f64 / 1e9),
            Some(_) => {
                use crate::roles::Role;
                format!(
                    "{:.1} GB weights on attention servers, {:.1} GB expert slots on MoE servers",
                    weights(Some(Role::Decode)) as f64 / 1e9,
                    weights(Some(Role::Moe)) as f64 / 1e9
                )
            }
        };
        t.push_str(&format!(
            "  memory   per GPU: {:.1} GB buffer, {held}, KV for {} tokens (EP); modes [{}]",
            mem.buffer_bytes as f64 / 1e9,
            mem.kv.ep.capacity_tokens,
            modes.join(", ")
        ));
        if let Some(tp) = &mem.kv.tp {
            t.push_str(&format!(
                ", TP KV {} tokens, dual-mode overhead {:.2}%",
                tp.capacity_tokens,
                mem.overhead.overhead_fraction * 100.0
            ));
        }
        t.push('\n');
        t
    }
}

/// A unit enum variant's `plan.json` name.
fn snake<T: serde::Serialize>(x: &T) -> String {
    serde_json::to_value(x).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
}
