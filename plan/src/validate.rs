//! The plan validator: the gate between planning and emission, and between
//! a bundle on disk and the backends that execute it.
//!
//! [`validate`] checks the invariants every emitter and backend relies on and
//! wraps the plan in a [`ValidPlan`], the only thing `emit` accepts and the
//! only plan [`crate::load_bundle`] returns. It runs after every pass in
//! debug builds (a partial plan passes [`check`] as long as what it holds is
//! consistent), after the pipeline in release builds, and on every load.
//!
//! Because a loaded plan may have been edited, every check uses checked
//! arithmetic and nothing is indexed before it was bounds-checked: after
//! `validate`, every view, expert slot, KV page and reshard run lies inside
//! its region of the unified buffer, every rank and layer index is in range,
//! and the derived sizes (page bytes, capacities, slot extents) agree with
//! the values they are derived from. Each [`Violation`] names the field of
//! `plan.json` it is about.

use crate::memory::{expected_shard, BufferName, Mode, RegionKind, TensorPart, TensorRole, ALIGN};
use crate::plan::{ApkForm, Grid, KernelParams, MmaPath, Plan, WeightFormat};
use crate::roles::Role;
use moeforge_dsl::spec::PlacementPolicy;
use std::fmt;

/// A plan that passed [`validate`]. Only this module constructs it.
#[derive(Clone, Debug)]
pub struct ValidPlan(Plan);

impl std::ops::Deref for ValidPlan {
    type Target = Plan;
    fn deref(&self) -> &Plan {
        &self.0
    }
}

impl ValidPlan {
    pub fn plan(&self) -> &Plan {
        &self.0
    }
    pub fn into_plan(self) -> Plan {
        self.0
    }
}

/// A broken plan invariant: in a freshly planned deployment a bug in a pass,
/// in a loaded bundle an edited or corrupt `plan.json`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The `plan.json` field, e.g. `memory.views[3].offset`.
    pub field: String,
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}`: {}", self.field, self.message)
    }
}

#[derive(Default)]
struct Check {
    out: Vec<Violation>,
}

impl Check {
    fn bad(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.out.push(Violation { field: field.into(), message: message.into() });
    }
    /// Records a violation unless `ok`; returns `ok`.
    fn ensure(&mut self, ok: bool, field: impl Into<String>, message: impl FnOnce() -> String) -> bool {
        if !ok {
            self.bad(field, message());
        }
        ok
    }
}

/// Checks the invariants that hold after every pass: a partial plan passes
/// as long as what it has is consistent.
pub fn check(plan: &Plan) -> Vec<Violation> {
    let mut c = Check::default();
    facts(&mut c, plan);
    ranks(&mut c, plan);
    if !plan.memory.regions.is_empty() {
        memory(&mut c, plan);
    }
    kernels(&mut c, plan);
    cost(&mut c, plan);
    search(&mut c, plan);
    placement(&mut c, plan);
    programs(&mut c, plan);
    roles(&mut c, plan);
    if !plan.memory.regions.is_empty() {
        // Last: an edit of the modes or roles is named before its
        // consequences for the buffers.
        buffers(&mut c, plan);
    }
    c.out
}

/// The gate: a complete plan whose invariants hold.
pub fn validate(plan: Plan) -> Result<ValidPlan, Vec<Violation>> {
    let mut v = check(&plan);
    if plan.format_version != crate::FORMAT_VERSION {
        v.push(Violation {
            field: "format_version".into(),
            message: format!("{} (this moeforge writes {})", plan.format_version, crate::FORMAT_VERSION),
        });
    }
    for (empty, field, what) in [
        (plan.ranks.is_empty(), "ranks", "no ranks"),
        (plan.kernels.is_empty(), "kernels", "no kernels"),
        (plan.memory.regions.is_empty(), "memory.regions", "no memory plan"),
        (
            plan.memory.modes.len() == 2 && plan.memory.reshard.is_none(),
            "memory.reshard",
            "a dual-mode plan needs its reshard descriptors",
        ),
        (plan.programs.is_empty(), "programs", "no per-rank programs"),
    ] {
        if empty {
            v.push(Violation { field: field.into(), message: what.into() });
        }
    }
    if v.is_empty() {
        Ok(ValidPlan(plan))
    } else {
        Err(v)
    }
}

fn facts(c: &mut Check, p: &Plan) {
    let (m, cl) = (&p.model, &p.cluster);
    c.ensure(m.layers > 0 && m.moe_layers <= m.layers, "model.moe_layers", || {
        format!("{} MoE layers of {} layers", m.moe_layers, m.layers)
    });
    c.ensure(m.hidden > 0 && m.experts > 0 && m.top_k > 0 && m.top_k <= m.experts, "model.top_k", || {
        format!("top-{} of {} experts (hidden {})", m.top_k, m.experts, m.hidden)
    });
    c.ensure(cl.nodes.checked_mul(cl.gpus_per_node) == Some(cl.world) && cl.world > 0, "cluster.world", || {
        format!("{} ≠ {} nodes × {} GPUs", cl.world, cl.nodes, cl.gpus_per_node)
    });
    c.ensure(cl.sms > 0, "cluster.sms", || "a GPU without SMs".into());
}

fn ranks(c: &mut Check, p: &Plan) {
    if p.ranks.is_empty() {
        return;
    }
    let (world, experts) = (p.cluster.world, p.model.experts);
    if !c.ensure(p.ranks.len() == world as usize, "ranks", || format!("{} ranks for a world of {world}", p.ranks.len()))
    {
        return;
    }
    let ep = p.roles.as_ref().map_or(world, |r| r.ep_groups.first().map_or(0, Vec::len) as u32);
    c.ensure(p.layout.ep_size == ep, "layout.ep_size", || format!("{} for EP groups of {ep} GPUs", p.layout.ep_size));
    let mut held: Vec<[u32; 2]> = Vec::with_capacity(p.ranks.len());
    for (i, r) in p.ranks.iter().enumerate() {
        let gpn = p.cluster.gpus_per_node;
        let numbered = r.rank as usize == i
            && r.local_rank < gpn
            && r.node.checked_mul(gpn).and_then(|n| n.checked_add(r.local_rank)) == Some(r.rank);
        c.ensure(numbered, format!("ranks[{i}]"), || format!("misnumbered: {r:?}"));
        let [b, e] = r.experts;
        // **Invariant**: in a role plan only the GPUs of an EP group hold
        // experts (ExpertPlex: not the attention servers).
        if p.roles.as_ref().is_some_and(|r| !r.holds_experts(i as u32)) {
            c.ensure(b == e, format!("ranks[{i}].experts"), || {
                format!("GPU {i}, in no EP group, holds experts [{b}, {e})")
            });
        }
        if c.ensure(
            b <= e && e <= experts && e - b <= p.layout.max_experts_per_rank,
            format!("ranks[{i}].experts"),
            || format!("[{b}, {e}) of {experts} experts, at most {} per rank", p.layout.max_experts_per_rank),
        ) && b < e
        {
            held.push([b, e]);
        }
    }
    // **Invariant**: without replication every expert lives on exactly one
    // rank of each EP group: the group's ranges, sorted, tile [0, experts).
    if let Some(r) = &p.roles {
        for (gi, g) in r.ep_groups.iter().enumerate() {
            let mut held: Vec<[u32; 2]> =
                g.iter().filter_map(|&x| p.ranks.get(x as usize)).map(|x| x.experts).filter(|[b, e]| b < e).collect();
            held.sort_unstable();
            let tiles = held.first().is_some_and(|x| x[0] == 0)
                && held.windows(2).all(|w| w[0][1] == w[1][0])
                && held.last().is_some_and(|x| x[1] == experts);
            c.ensure(tiles, format!("roles.ep_groups[{gi}]"), || {
                format!("the ranks' experts {held:?} do not tile [0, {experts})")
            });
        }
        return;
    }
    held.sort_unstable();
    let mut next = 0;
    for [b, e] in held {
        if b != next {
            c.bad(
                "ranks",
                format!(
                    "experts [{}, {}) are held by {} ranks",
                    b.min(next),
                    b.max(next),
                    if b < next { "two" } else { "no" }
                ),
            );
            return;
        }
        next = e;
    }
    c.ensure(next == experts, "ranks", || format!("experts [{next}, {experts}) are held by no rank"));
}

/// Bytes of a shape's elements, `None` on overflow.
fn shape_bytes(shape: &[u64], elt: u64) -> Option<u64> {
    shape.iter().try_fold(elt, |acc, &d| acc.checked_mul(d))
}

/// **Invariants** of the memory plan: regions tile the buffer in order,
/// aligned, without gaps or overlap, each kind once (a role plan: each
/// role's regions, the shared workspace and its own, tile a prefix in
/// order; regions of different roles overlay); every view lies inside
/// its region at every layer it covers, in a region its mode uses, under its
/// role's canonical name; the views of one mode never overlap each other at
/// any layer (aliasing happens only across modes); expert slots, KV pages
/// and reshard runs stay inside their regions.
fn memory(c: &mut Check, p: &Plan) {
    let m = &p.memory;
    let layers = p.model.layers;
    c.ensure(m.hbm == p.cluster.hbm_bytes, "memory.hbm", || {
        format!("{} is not the GPU's {}", m.hbm, p.cluster.hbm_bytes)
    });
    c.ensure(m.buffer_bytes <= m.hbm, "memory.buffer_bytes", || format!("{} exceeds HBM {}", m.buffer_bytes, m.hbm));
    let modes_ok = !m.modes.is_empty() && m.modes.windows(2).all(|w| w[0] < w[1]);
    c.ensure(modes_ok, "memory.modes", || format!("{:?}: one or both modes, in order", m.modes));
    let dual = m.modes == [Mode::Tp, Mode::Ep];
    let group_ok = m.group >= 1
        && m.group <= p.cluster.world
        && (!dual || m.group == p.cluster.gpus_per_node)
        && (dual || p.ranks.is_empty() || m.group == p.cluster.world);
    c.ensure(group_ok, "memory.group", || format!("{} ranks (world {}, dual {dual})", m.group, p.cluster.world));
    // Regions: without roles they tile the buffer in kind order; with roles
    // each role's regions (the shared workspace and its own) tile a prefix
    // of the buffer, the attention servers' the whole of it.
    let holders: Vec<Option<Role>> = match &p.roles {
        None => vec![None],
        Some(_) => Role::ALL.iter().copied().map(Some).collect(),
    };
    for (i, r) in m.regions.iter().enumerate() {
        let f = format!("memory.regions[{i}]");
        c.ensure(r.offset % ALIGN == 0, format!("{f}.offset"), || {
            format!("`{}` at {} is not aligned to {ALIGN}", r.kind.name(), r.offset)
        });
        if p.roles.is_none() && i > 0 {
            c.ensure(m.regions[i - 1].kind < r.kind, format!("{f}.kind"), || {
                format!("`{}` out of order or repeated", r.kind.name())
            });
        }
        c.ensure(!r.modes.is_empty() && r.modes.iter().all(|x| m.modes.contains(x)), format!("{f}.modes"), || {
            format!("{:?} outside the plan's modes {:?}", r.modes, m.modes)
        });
        c.ensure(p.roles.is_some() || r.roles.is_empty(), format!("{f}.roles"), || {
            format!("roles {:?} in a plan without roles", r.roles)
        });
        if r.offset.checked_add(r.bytes).is_none() {
            c.bad(format!("{f}.bytes"), "overflows");
            return;
        }
    }
    for holder in holders {
        let mut held: Vec<(usize, &crate::memory::Region)> =
            m.regions.iter().enumerate().filter(|(_, r)| r.held_by(holder)).collect();
        held.sort_by_key(|(_, r)| r.offset);
        let whose = holder.map_or(String::new(), |h| format!(" of the {} servers", h.name()));
        let mut at = 0u64;
        let mut kinds = std::collections::BTreeSet::new();
        for (i, r) in &held {
            let f = format!("memory.regions[{i}]");
            c.ensure(r.offset == at, format!("{f}.offset"), || {
                format!("`{}`{whose} at {} (expected {at})", r.kind.name(), r.offset)
            });
            c.ensure(kinds.insert(r.kind), format!("{f}.kind"), || format!("`{}`{whose} repeated", r.kind.name()));
            at = r.offset.saturating_add(r.bytes);
        }
        let whole = holder.is_none_or(Role::attends);
        if !c.ensure(if whole { at == m.buffer_bytes } else { at <= m.buffer_bytes }, "memory.buffer_bytes", || {
            format!("the regions{whose} end at {at}, the buffer is {}", m.buffer_bytes)
        }) {
            return;
        }
    }
    views(c, p);
    // Expert slots.
    let s = &m.slots;
    match m.regions.get(s.region.index()) {
        Some(r) if r.kind == RegionKind::Experts => {
            let slots = u64::from(s.moe_layers) + u64::from(s.tp_shift.max(s.ep_shift));
            let extent = s.slot_bytes.checked_mul(slots);
            c.ensure(s.base == r.offset && extent.is_some_and(|x| x <= r.bytes), "memory.slots", || {
                format!(
                    "{slots} slots of {} bytes at {} do not fit region `experts` ({} at {})",
                    s.slot_bytes, s.base, r.bytes, r.offset
                )
            });
            c.ensure(
                s.w13_bytes.checked_add(s.w2_bytes).is_some_and(|x| x <= s.slot_bytes),
                "memory.slots.slot_bytes",
                || format!("{} < w13 {} + w2 {}", s.slot_bytes, s.w13_bytes, s.w2_bytes),
            );
        }
        _ => c.bad("memory.slots.region", format!("{:?} is not the experts region", s.region)),
    }
    c.ensure(
        s.moe_layers == p.model.moe_layers && s.first_moe_layer == layers - p.model.moe_layers.min(layers),
        "memory.slots.moe_layers",
        || {
            format!(
                "{} MoE layers from layer {}; the model has {} of {layers}",
                s.moe_layers, s.first_moe_layer, p.model.moe_layers
            )
        },
    );
    let shifts_ok = if dual { s.tp_shift == 0 && s.ep_shift == 1 } else { s.tp_shift == 0 && s.ep_shift == 0 };
    c.ensure(shifts_ok, "memory.slots.ep_shift", || {
        format!("TP shift {}, EP shift {} (N+1 slots: TP layer i → slot i, EP → slot i+1)", s.tp_shift, s.ep_shift)
    });
    kv(c, p, dual);
    reshard(c, p, dual);
}

/// The workspace's buffers: each inside its region (comm, scratch or
/// requests), aligned, of the region's modes, named once per mode, and no
/// two a rank uses in the same mode overlapping (the two modes' comm slots
/// alias by design: a rank runs one mode at a time). The devices bound
/// every kernel and transfer by these addresses, so an edited plan must not
/// move one buffer onto another or past its region.
fn buffers(c: &mut Check, p: &Plan) {
    let m = &p.memory;
    let mut spans: Vec<(Mode, u64, u64, usize)> = vec![];
    for (i, b) in m.buffers.iter().enumerate() {
        let f = format!("memory.buffers[{i}]");
        let Some(r) = m.regions.get(b.region.index()) else {
            c.bad(format!("{f}.region"), format!("{:?} is not a region of the plan", b.region));
            continue;
        };
        let kinds = [RegionKind::Comm, RegionKind::Scratch, RegionKind::Requests];
        c.ensure(kinds.contains(&r.kind), format!("{f}.region"), || {
            format!("`{:?}` in region `{}`: buffers live in comm, scratch and requests", b.name, r.kind.name())
        });
        let end = b.rows.checked_mul(b.row_bytes).and_then(|n| b.offset.checked_add(n));
        let inside = end.is_some_and(|e| b.offset >= r.offset && e <= r.offset.saturating_add(r.bytes));
        if !c.ensure(inside, format!("{f}.offset"), || {
            format!(
                "`{:?}`: {} rows of {} bytes at {} do not fit region `{}` ({} bytes at {})",
                b.name,
                b.rows,
                b.row_bytes,
                b.offset,
                r.kind.name(),
                r.bytes,
                r.offset
            )
        }) {
            continue;
        }
        c.ensure(b.offset % ALIGN == 0, format!("{f}.offset"), || {
            format!("`{:?}` at {} is not aligned to {ALIGN}", b.name, b.offset)
        });
        for &mode in &m.modes {
            if !b.modes.contains(mode) {
                continue;
            }
            c.ensure(r.modes.contains(&mode), format!("{f}.modes"), || {
                format!("`{:?}` is used in {} but its region is not", b.name, mode.name())
            });
            let again = m.buffers[..i].iter().any(|x| x.name == b.name && x.modes.contains(mode));
            c.ensure(!again, format!("{f}.name"), || format!("`{:?}` twice in {}", b.name, mode.name()));
            if b.rows > 0 && b.row_bytes > 0 {
                spans.push((mode, b.offset, end.unwrap_or(b.offset), i));
            }
        }
    }
    spans.sort();
    for w in spans.windows(2) {
        let (x, y) = (w[0], w[1]);
        if x.0 == y.0 && y.1 < x.2 {
            let name = |k: usize| m.buffers.get(k).map_or(String::new(), |b| format!("{:?}", b.name));
            c.bad(
                format!("memory.buffers[{}].offset", x.3.max(y.3)),
                format!("{} buffers overlap: `{}` and `{}`", x.0.name(), name(x.3), name(y.3)),
            );
            return;
        }
    }
}

/// Most (view, layer) extents a plan may hold: far above any model a
/// checked spec describes, so an edited plan cannot make the overlap check
/// allocate without bound.
const MAX_SPANS: usize = 1 << 20;

fn views(c: &mut Check, p: &Plan) {
    let m = &p.memory;
    let layers = p.model.layers;
    let mut spans: Vec<(Mode, u64, u64, usize, u32)> = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for (i, v) in m.views.iter().enumerate() {
        let f = format!("memory.views[{i}]");
        if !seen.insert((v.mode, v.role, v.part)) {
            c.bad(&f, format!("a second {} view of `{}`", v.mode.name(), v.tensor));
            continue;
        }
        c.ensure(v.shard == expected_shard(v.role, v.part, v.mode), format!("{f}.shard"), || {
            format!(
                "{:?} is not how `{}` is laid out in {} ({:?})",
                v.shard,
                v.tensor,
                v.mode.name(),
                expected_shard(v.role, v.part, v.mode)
            )
        });
        c.ensure(v.tensor == v.role.name(v.part), format!("{f}.tensor"), || {
            format!("`{}` is not the name of {:?} {:?} (`{}`)", v.tensor, v.role, v.part, v.role.name(v.part))
        });
        let Some(r) = m.regions.get(v.region.index()) else {
            c.bad(format!("{f}.region"), format!("{} names no region (there are {})", v.region.0, m.regions.len()));
            continue;
        };
        let kind_ok = match v.role {
            TensorRole::ExpertsW13 | TensorRole::ExpertsW2 => r.kind == RegionKind::Experts,
            TensorRole::QProj
            | TensorRole::KProj
            | TensorRole::VProj
            | TensorRole::OProj
            | TensorRole::QNorm
            | TensorRole::KNorm
            | TensorRole::Sinks
            | TensorRole::QAProj
            | TensorRole::QANorm
            | TensorRole::QBProj
            | TensorRole::KvAProj
            | TensorRole::KvANorm
            | TensorRole::KvBProj
            | TensorRole::IndexerQ
            | TensorRole::IndexerK
            | TensorRole::IndexerKNorm
            | TensorRole::IndexerWeights => matches!(r.kind, RegionKind::AttentionEp | RegionKind::AttentionTp),
            _ => r.kind == RegionKind::Replicated,
        };
        c.ensure(kind_ok && r.modes.contains(&v.mode), format!("{f}.region"), || {
            format!("`{}` ({}) cannot live in region `{}` ({:?})", v.tensor, v.mode.name(), r.kind.name(), r.modes)
        });
        let [a, b] = v.layers;
        let layers_ok = if v.role.per_layer() { a < b && b <= layers } else { v.layers == [0, 1] };
        if !c.ensure(layers_ok, format!("{f}.layers"), || {
            format!("[{a}, {b}) for `{}` in a {layers}-layer model", v.tensor)
        }) {
            continue;
        }
        let strides_ok = v.strides.len() == v.shape.len()
            && !v.shape.is_empty()
            && v.shape.iter().all(|&d| d > 0)
            && (0..v.shape.len()).all(|k| {
                let inner: Option<u64> = v.shape[k + 1..].iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
                inner == Some(v.strides[k])
            });
        c.ensure(strides_ok, format!("{f}.strides"), || {
            format!("shape {:?} with strides {:?} is not row-major", v.shape, v.strides)
        });
        // Packed tensors (q‖k‖v, gate‖up) follow each other unpadded: 16
        // bytes is what TMA and cp.async need. Packed fp8 parts' block
        // scales (f32, read one at a time) need their element's 4.
        let align = if v.part == crate::memory::TensorPart::ScaleInv { 4 } else { 16 };
        c.ensure(v.offset % align == 0, format!("{f}.offset"), || format!("{} is not {align}-byte aligned", v.offset));
        let Some(bytes) = shape_bytes(&v.shape, crate::memory::elt_bytes(v.dtype)) else {
            c.bad(format!("{f}.shape"), format!("{:?} overflows", v.shape));
            continue;
        };
        if !c.ensure(b - a == 1 || v.layer_stride >= bytes, format!("{f}.layer_stride"), || {
            format!("{} is less than the {bytes} bytes of one layer", v.layer_stride)
        }) {
            continue;
        }
        if v.role.is_routed_expert() {
            // Expert views sit in their mode's slots: layer i of MoE layer
            // numbering in slot i + shift, W13 first, then W2, then the scales.
            let sl = &m.slots;
            let shift = u64::from(if v.mode == Mode::Tp { sl.tp_shift } else { sl.ep_shift });
            let slot = sl.slot_bytes.checked_mul(shift).and_then(|x| x.checked_add(sl.base));
            let inner = v.offset.checked_sub(slot.unwrap_or(u64::MAX));
            let inner_ok = match (v.role, v.part) {
                (TensorRole::ExpertsW13, TensorPart::Weight) => inner == Some(0) && bytes <= sl.w13_bytes,
                (TensorRole::ExpertsW2, TensorPart::Weight) => inner == Some(sl.w13_bytes) && bytes <= sl.w2_bytes,
                _ => inner.is_some_and(|x| sl.w13_bytes.checked_add(sl.w2_bytes).is_some_and(|end| x >= end)),
            };
            let ok = inner_ok && v.layer_stride == sl.slot_bytes && v.layers == [sl.first_moe_layer, layers];
            if !c.ensure(ok, format!("{f}.offset"), || {
                format!(
                    "`{}` ({}) is not where its slots are (base {}, {} bytes per slot)",
                    v.tensor,
                    v.mode.name(),
                    sl.base,
                    sl.slot_bytes
                )
            }) {
                continue;
            }
        }
        let region_end = r.offset + r.bytes;
        if spans.len() + (b - a) as usize > MAX_SPANS {
            c.bad(format!("{f}.layers"), format!("more than {MAX_SPANS} tensor layers in one plan"));
            return;
        }
        for l in a..b {
            let start = u64::from(l - a).checked_mul(v.layer_stride).and_then(|d| d.checked_add(v.offset));
            let end = start.and_then(|s| s.checked_add(bytes));
            match (start, end) {
                (Some(s), Some(e)) if s >= r.offset && e <= region_end => spans.push((v.mode, s, e, i, l)),
                _ => {
                    c.bad(
                        format!("{f}.offset"),
                        format!(
                            "`{}` layer {l} leaves region `{}` [{}, {region_end})",
                            v.tensor,
                            r.kind.name(),
                            r.offset
                        ),
                    );
                    break;
                }
            }
        }
    }
    spans.sort();
    // Views of different roles' regions overlay each other by design; within
    // the regions one GPU holds, views of one mode never overlap.
    let holders: Vec<Option<Role>> = match &p.roles {
        None => vec![None],
        Some(_) => Role::ALL.iter().copied().map(Some).collect(),
    };
    for holder in holders {
        let held =
            |i: usize| m.views.get(i).and_then(|v| m.regions.get(v.region.index())).is_some_and(|r| r.held_by(holder));
        let spans: Vec<_> = spans.iter().filter(|s| held(s.3)).collect();
        if !overlap(c, m, &spans) {
            break;
        }
    }
}

/// Reports the first overlap of two same-mode spans (sorted); false if any.
fn overlap(c: &mut Check, m: &crate::memory::MemoryPlan, spans: &[&(Mode, u64, u64, usize, u32)]) -> bool {
    for w in spans.windows(2) {
        let (x, y) = (w[0], w[1]);
        if x.0 == y.0 && y.1 < x.2 {
            let name = |k: usize| m.views.get(k).map_or("", |v| v.tensor.as_str());
            c.bad(
                format!("memory.views[{}]", y.3),
                format!(
                    "{} views overlap: `{}` layer {} and `{}` layer {}",
                    x.0.name(),
                    name(x.3),
                    x.4,
                    name(y.3),
                    y.4
                ),
            );
            return false;
        }
    }
    true
}

fn kv(c: &mut Check, p: &Plan, dual: bool) {
    let m = &p.memory;
    let kv = &m.kv;
    let Some(r) = m.regions.get(kv.region.index()).filter(|r| r.kind == RegionKind::KvPool) else {
        c.bad("memory.kv.region", format!("{:?} is not the KV pool", kv.region));
        return;
    };
    c.ensure(kv.page_tokens > 0 && kv.head_token_bytes > 0, "memory.kv.page_tokens", || {
        format!("pages of {} tokens, {} bytes per head and token", kv.page_tokens, kv.head_token_bytes)
    });
    let layers = u64::from(p.model.layers);
    let mode = |c: &mut Check, name: &str, km: &crate::memory::KvMode, holders: u64| {
        let f = format!("memory.kv.{name}");
        let page = layers
            .checked_mul(u64::from(km.heads_per_rank))
            .and_then(|x| x.checked_mul(u64::from(kv.page_tokens)))
            .and_then(|x| x.checked_mul(kv.head_token_bytes));
        c.ensure(km.heads_per_rank > 0 && page == Some(km.page_bytes), format!("{f}.page_bytes"), || {
            format!(
                "{} ≠ {layers} layers × {} heads × {} tokens × {} bytes",
                km.page_bytes, km.heads_per_rank, kv.page_tokens, kv.head_token_bytes
            )
        });
        c.ensure(km.pages.checked_mul(km.page_bytes).is_some_and(|x| x <= r.bytes), format!("{f}.pages"), || {
            format!("{} pages of {} bytes do not fit the {}-byte pool", km.pages, km.page_bytes, r.bytes)
        });
        let cap = holders.checked_mul(km.pages).and_then(|x| x.checked_mul(u64::from(kv.page_tokens)));
        c.ensure(cap == Some(km.capacity_tokens), format!("{f}.capacity_tokens"), || {
            format!("{} ≠ {holders} × {} pages × {} tokens", km.capacity_tokens, km.pages, kv.page_tokens)
        });
    };
    let holders = p.roles.as_ref().map_or(u64::from(m.group), |r| r.attention_ranks().len() as u64);
    mode(c, "ep", &kv.ep, holders);
    match (&kv.tp, dual) {
        (Some(tp), true) => {
            mode(c, "tp", tp, 1);
            let all = kv.ep.heads_per_rank;
            // One entry per rank, or nothing more to compare: the
            // ownership below is one entry per rank of `group`, which a
            // file could set to any u32 (the entries it holds bound it).
            if !c.ensure(kv.tp_heads.len() == m.group as usize, "memory.kv.tp_heads", || {
                format!("{} entries for {} ranks", kv.tp_heads.len(), m.group)
            }) {
                return;
            }
            // Each rank's KV heads are those its query heads read (head_block).
            let (local, rep, heads) = crate::memory::tp_kv_heads(all, m.group);
            c.ensure(kv.tp_heads == heads && tp.heads_per_rank == local && kv.replication == rep, "memory.kv.tp_heads", || {
                format!(
                    "{:?} ({} per rank, ×{}) is not the ownership of {all} KV heads on {} ranks: {heads:?} ({local} per rank, ×{rep})",
                    kv.tp_heads, tp.heads_per_rank, kv.replication, m.group
                )
            });
        }
        (None, false) => {}
        _ => c.bad("memory.kv.tp", "a TP page format exactly when the plan holds both modes"),
    }
}

fn reshard(c: &mut Check, p: &Plan, dual: bool) {
    let m = &p.memory;
    let Some(rs) = &m.reshard else { return };
    if !c.ensure(dual, "memory.reshard", || "reshard descriptors in a single-mode plan".into()) {
        return;
    }
    let s = &m.slots;
    // The descriptors are those of the slot geometry: recomputed and compared.
    let (e, i, h, g) =
        (u64::from(p.model.experts), u64::from(p.model.expert_ffn), u64::from(p.model.hidden), u64::from(m.group));
    if g == 0 || e < g || e % g != 0 || i % g != 0 {
        c.bad("memory.group", format!("{e} experts of FFN size {i} do not shard over {g} ranks"));
        return;
    }
    let want = crate::reshard::weights(s, e, i, h, crate::memory::elt_bytes(p.model.expert_dtype), m.group);
    c.ensure(*rs == want, "memory.reshard", || {
        "the descriptors are not those of the expert slots' geometry (each layer's copies must move exactly the experts' bytes between the two layouts)".into()
    });
    let s = &m.slots;
    for (name, w, from, to) in
        [("ep_to_tp", &rs.ep_to_tp, Mode::Ep, Mode::Tp), ("tp_to_ep", &rs.tp_to_ep, Mode::Tp, Mode::Ep)]
    {
        let f = format!("memory.reshard.{name}");
        let shift = |mode: Mode| if mode == Mode::Tp { s.tp_shift } else { s.ep_shift };
        c.ensure(w.from == from && w.to == to && w.src_shift == shift(from) && w.dst_shift == shift(to), &f, || {
            format!("{:?}→{:?} with shifts {}→{}", w.from, w.to, w.src_shift, w.dst_shift)
        });
        let mut remote = 0u64;
        for (k, cp) in w.per_layer.iter().enumerate() {
            let cf = format!("{f}.per_layer[{k}]");
            c.ensure(cp.src_rank < m.group && cp.dst_rank < m.group, format!("{cf}.src_rank"), || {
                format!("ranks {} → {} of a group of {}", cp.src_rank, cp.dst_rank, m.group)
            });
            // Every run, first to last, inside one slot on both sides.
            let within = |off: u64, strides: [u64; 2]| -> bool {
                let last = cp.counts[0]
                    .checked_sub(1)
                    .and_then(|a| a.checked_mul(strides[0]))
                    .zip(cp.counts[1].checked_sub(1).and_then(|b| b.checked_mul(strides[1])))
                    .and_then(|(x, y)| x.checked_add(y))
                    .and_then(|x| x.checked_add(off))
                    .and_then(|x| x.checked_add(cp.run_bytes));
                last.is_some_and(|e| e <= s.slot_bytes)
            };
            let total = cp.run_bytes.checked_mul(cp.counts[0]).and_then(|x| x.checked_mul(cp.counts[1]));
            let ok = cp.run_bytes > 0
                && total.is_some_and(|t| t <= s.slot_bytes)
                && within(cp.src_offset, cp.src_strides)
                && within(cp.dst_offset, cp.dst_strides);
            if !c.ensure(ok, format!("{cf}.run_bytes"), || {
                format!(
                    "{} × {:?} runs from {} / to {} leave the {}-byte slot",
                    cp.run_bytes, cp.counts, cp.src_offset, cp.dst_offset, s.slot_bytes
                )
            }) {
                continue;
            }
            if cp.src_rank != cp.dst_rank {
                remote = remote.saturating_add(total.unwrap_or(0));
            }
        }
        c.ensure(remote == w.interconnect_bytes_per_layer, format!("{f}.interconnect_bytes_per_layer"), || {
            format!("{} ≠ the {remote} bytes its copies move between ranks", w.interconnect_bytes_per_layer)
        });
    }
}

fn kernels(c: &mut Check, p: &Plan) {
    // A replicated placement routes on the devices (once the kernels pass ran).
    let replicated = p.placement.as_ref().is_some_and(|pl| pl.policy != PlacementPolicy::None);
    let routes = p.kernels.iter().any(|k| matches!(k.params, KernelParams::Zepp(_)));
    c.ensure(p.kernels.is_empty() || replicated == routes, "kernels".to_string(), || {
        format!("a replicated placement needs the routing kernel, and only one does (placement: {replicated}, kernel: {routes})")
    });
    for (i, k) in p.kernels.iter().enumerate() {
        let f = format!("kernels[{i}]");
        match &k.params {
            KernelParams::Router(r) => {
                let ok = r.top_k <= r.experts
                    && r.experts <= crate::caps::ROUTER_MAX_EXPERTS
                    && r.groups <= crate::caps::ROUTER_MAX_GROUPS
                    && r.experts == p.model.experts
                    && r.top_k == p.model.top_k
                    && r.per_lane.checked_mul(32).is_some_and(|x| x >= r.experts)
                    && r.groups.checked_mul(r.group_size) == Some(r.experts)
                    && r.top_groups <= r.groups;
                c.ensure(ok, format!("{f}.params"), || format!("router constants inconsistent: {r:?}"));
            }
            KernelParams::Permute(q) => {
                // TP permutes over every expert.
                let bound =
                    if p.memory.modes.contains(&Mode::Tp) { p.model.experts } else { p.layout.max_experts_per_rank };
                let ok = q.max_local_experts == bound
                    && q.row_vectors.checked_mul(8) == Some(q.hidden)
                    && q.hidden == p.model.hidden
                    && q.block_m > 0;
                c.ensure(ok, format!("{f}.params"), || format!("permute constants inconsistent: {q:?}"));
            }
            KernelParams::Zepp(z) => {
                // The routing kernel serves the plan's placement, at its
                // policy and slack, from buffers the memory plan holds, each
                // as large as the kernel reads and writes: every layer's
                // replica table at its width, and the routing's arrays for
                // every rank and a full batch's entries.
                let buffer = |n| p.memory.buffers.iter().find(|b| b.name == n);
                let sized = p.placement.as_ref().is_some_and(|pl| {
                    let (e, r) = (u64::from(p.model.experts), pl.max_replicas() as u64);
                    let k = u64::from(p.model.top_k);
                    let route = crate::memory::ZeppRouteParts::of(
                        p.ranks.len() as u64,
                        e,
                        r,
                        crate::memory::MAX_BATCH_TOKENS * k,
                    );
                    let table = buffer(BufferName::ReplicaTable)
                        .is_some_and(|b| b.row_bytes == 4 * r && b.rows >= u64::from(p.model.moe_layers) * e);
                    let loads = buffer(BufferName::ExpertLoads)
                        .is_some_and(|b| b.row_bytes == 4 * e && b.rows >= u64::from(p.model.moe_layers));
                    table && loads && buffer(BufferName::ZeppRoute).is_some_and(|b| b.bytes() >= route.bytes)
                });
                let ok = p.placement.as_ref().is_some_and(|pl| {
                    pl.policy == z.policy && pl.slack == z.slack && pl.policy != PlacementPolicy::None
                }) && sized
                    && z.threads % 32 == 0
                    && (32..=1024).contains(&z.threads);
                c.ensure(ok, format!("{f}.params"), || {
                    format!("routing-kernel constants inconsistent with the placement and memory plan: {z:?}")
                });
            }
            KernelParams::Layer(l) => {
                let meta = p.memory.buffers.iter().find(|b| b.name == crate::memory::BufferName::RequestMeta);
                let mut ok = meta.is_none_or(|b| b.row_bytes == u64::from(l.request_meta_words) * 4)
                    && l.request_meta_words > 8
                    && l.hidden == p.model.hidden
                    && l.vocab > 0
                    && l.threads % 32 == 0
                    && (32..=1024).contains(&l.threads);
                if let Some(g) = &l.gqa {
                    let qkv = p.memory.buffers.iter().find(|b| b.name == crate::memory::BufferName::Qkv);
                    ok &= g.head_dim > 0
                        && g.rope_dim % 2 == 0
                        && g.rope_dim <= g.head_dim
                        && g.inv_freq.len() as u32 * 2 == g.rope_dim
                        && g.head_dim <= 256
                        && g.kv_heads > 0
                        && g.heads % g.kv_heads == 0
                        && u64::from(g.qkv_stride)
                            >= (u64::from(g.heads) + 2 * u64::from(g.kv_heads)) * u64::from(g.head_dim)
                        && qkv.is_none_or(|b| b.row_bytes == u64::from(g.qkv_stride) * 2)
                        && (p.memory.regions.is_empty()
                            || (g.page_tokens == p.memory.kv.page_tokens
                                && g.head_token_bytes == p.memory.kv.head_token_bytes));
                }
                c.ensure(ok, format!("{f}.params"), || format!("layer-kernel constants inconsistent: {l:?}"));
            }
            KernelParams::Apk(a) => {
                let tiles_ok = a.m_t_prefill > 0 && a.m_t_decode > 0 && a.n_t_gate_up % 2 == 0 && a.n_t_down > 0;
                let shape_ok = match a.form {
                    ApkForm::Experts => {
                        a.local_experts > 0
                            && a.local_experts <= p.layout.max_experts_per_rank
                            && a.hidden == p.model.hidden
                            && a.inter == p.model.expert_ffn
                    }
                    ApkForm::ExpertsTp => {
                        let world = p.ranks.len() as u32;
                        p.memory.modes.contains(&Mode::Tp)
                            && a.local_experts == p.model.experts
                            && a.hidden == p.model.hidden
                            && a.inter.checked_mul(world) == Some(p.model.expert_ffn)
                    }
                    // One group, shapes per operation: `dense` for bf16
                    // weights, `dense_fp8` for fp8 ones.
                    ApkForm::Dense => {
                        a.local_experts == 1
                            && a.hidden == 0
                            && a.inter == 0
                            && k.name == if a.weights == WeightFormat::Bf16 { "dense" } else { "dense_fp8" }
                    }
                };
                let sms = p.cluster.sms;
                let q_ok = a.cluster_size >= 1
                    && a.q >= a.cluster_size
                    && a.q <= sms
                    && a.q_max >= a.cluster_size
                    && a.q_max <= sms
                    && a.max_clusters.checked_mul(a.cluster_size).is_some_and(|x| x <= sms);
                let path_ok = (a.path == MmaPath::Wgmma) == (k.arch == moeforge_dsl::spec::Arch::Sm90a);
                let fp8_ok = (a.weights == WeightFormat::Fp8E4m3) == (a.scale_block > 0);
                let rows_ok = a.max_prefill_rows % a.m_t_prefill.max(1) == 0 && a.x_star > 0.0;
                // The dense form's SwiGLU epilogue is SiLU's (dense and shared FFNs).
                let act_ok = a.form == ApkForm::Experts || a.activation == moeforge_dsl::spec::Activation::Silu;
                let ok = tiles_ok && shape_ok && q_ok && path_ok && fp8_ok && rows_ok && act_ok;
                c.ensure(ok, format!("{f}.params"), || format!("APK constants inconsistent: {a:?}"));
                for &r in a.ranks.iter().filter(|_| a.form == ApkForm::Experts) {
                    let held = (r < p.cluster.world).then(|| p.local_experts(r as usize));
                    if !p.ranks.is_empty() && held != Some(a.local_experts) {
                        c.bad(
                            format!("{f}.params.ranks"),
                            format!("APK for {} experts on rank {r}, which holds {held:?}", a.local_experts),
                        );
                    }
                }
            }
        }
        if k.entries.is_empty() {
            c.bad(format!("{f}.entries"), format!("kernel `{}` has no entry point", k.name));
        }
        for (j, e) in k.entries.iter().enumerate() {
            let grid_ok = match e.grid {
                Grid::Fixed { blocks } => blocks > 0,
                Grid::Per { per, .. } => per > 0,
                Grid::Tiles { per, times, .. } => per > 0 && times > 0,
                Grid::Persistent { cluster } | Grid::PerOperation { cluster } => cluster > 0,
            };
            c.ensure(grid_ok && e.block > 0 && e.block <= 1024, format!("{f}.entries[{j}]"), || {
                format!("`{}`: grid {:?}, {} threads", e.symbol, e.grid, e.block)
            });
        }
    }
}

fn cost(c: &mut Check, p: &Plan) {
    let cm = &p.cost;
    if cm.sms == 0 && cm.source.is_empty() {
        return; // not planned yet
    }
    c.ensure(cm.sms == p.cluster.sms && cm.cluster >= 1, "cost.cluster", || {
        format!("{} SMs in clusters of {} (the GPU has {})", cm.sms, cm.cluster, p.cluster.sms)
    });
    c.ensure(cm.m_t_prefill > 0 && cm.m_t_decode > 0, "cost.m_t_prefill", || "tile heights must be positive".into());
    let fits = [&cm.attn_prefill, &cm.attn_decode, &cm.moe, &cm.ffn, &cm.head];
    let finite = fits.iter().all(|f| [f.alpha, f.beta, f.gamma, f.delta].iter().all(|x| x.is_finite()));
    c.ensure(finite, "cost", || "non-finite coefficients".into());
}

fn search(c: &mut Check, p: &Plan) {
    let Some(s) = &p.search else { return };
    for (i, cand) in s.ranked.iter().enumerate() {
        let total = cand.moe_gpus.checked_add(cand.prefill_gpus).and_then(|x| x.checked_add(cand.decode_gpus));
        let per_node: Option<u32> = cand.per_node.iter().flatten().try_fold(0u32, |a, &x| a.checked_add(x));
        let ok = total == Some(p.cluster.world)
            && per_node == Some(p.cluster.world)
            && cand.per_node.len() == p.cluster.nodes as usize
            && cand.q >= 1
            && cand.q <= p.cluster.sms;
        c.ensure(ok, format!("search.ranked[{i}]"), || format!("layout does not match the cluster: {cand:?}"));
        // The per-node counts are the candidate's servers.
        let role_sum = |i: usize| cand.per_node.iter().try_fold(0u32, |a, n| a.checked_add(n[i]));
        c.ensure(
            role_sum(0) == Some(cand.moe_gpus)
                && role_sum(1) == Some(cand.prefill_gpus)
                && role_sum(2) == Some(cand.decode_gpus),
            format!("search.ranked[{i}].per_node"),
            || format!("{:?} does not hold the candidate's MoE / prefill / decode servers", cand.per_node),
        );
        // Attention groups of a power-of-two width inside one node, dividing
        // each node's servers of the role.
        for (role, w) in [(1, cand.prefill_width), (2, cand.decode_width)] {
            let ok = w.is_power_of_two()
                && w <= p.cluster.gpus_per_node
                && cand.per_node.iter().all(|n| n[role].is_multiple_of(w));
            let field = if role == 1 { "prefill_width" } else { "decode_width" };
            c.ensure(ok, format!("search.ranked[{i}].{field}"), || {
                format!("attention groups of {w} GPUs do not tile every node's servers {:?}", cand.per_node)
            });
        }
    }
    // A role plan realizes a data-parallel candidate, with its overlap.
    if let Some(r) = p.roles.as_ref().filter(|r| r.moe_servers()) {
        match s.realizable() {
            Some(best) => {
                c.ensure(r.overlap == best.overlap, "roles.overlap", || {
                    format!("{:?} is not the realized search candidate's {:?}", r.overlap, best.overlap)
                });
            }
            None => c.bad("search.ranked", "the plan realizes ExpertPlex roles but ranks no data-parallel candidate"),
        }
    }
}

/// A realized placement: every MoE layer gives each GPU exactly the slots
/// its EP expert views hold, distinct experts per GPU, and every expert at
/// least one replica (a row routed to an expert must find it somewhere).
fn placement(c: &mut Check, p: &Plan) {
    let Some(pl) = &p.placement else { return };
    // Striped experts are no placement: their ids are logical, a placement's physical.
    c.ensure(pl.policy != PlacementPolicy::None, "placement.policy", || {
        "a placement with policy `none` (striped experts have no placement)".to_string()
    });
    c.ensure(pl.slack.is_finite() && (0.0..=10.0).contains(&pl.slack), "placement.slack", || {
        format!("{} is not a load-bound relaxation in [0, 10]", pl.slack)
    });
    c.ensure(pl.replicas.len() == p.model.moe_layers as usize, "placement.replicas", || {
        format!("{} layers for {} MoE layers", pl.replicas.len(), p.model.moe_layers)
    });
    let slots = pl.slots_per_gpu();
    c.ensure(slots as u32 == p.layout.max_experts_per_rank, "layout.max_experts_per_rank", || {
        format!("{} for a placement of {slots} slots per GPU", p.layout.max_experts_per_rank)
    });
    for (l, gpus) in pl.replicas.iter().enumerate() {
        let mut covered = vec![false; p.model.experts as usize];
        let mut ok = gpus.len() == p.cluster.world as usize;
        for (g, es) in gpus.iter().enumerate() {
            // A role plan's attention servers hold no slots.
            let holds = p.roles.as_ref().is_none_or(|r| r.holds_experts(g as u32));
            ok &= es.len() == if holds { slots } else { 0 };
            for (j, &e) in es.iter().enumerate() {
                ok &= e < p.model.experts && !es[..j].contains(&e);
                if let Some(x) = covered.get_mut(e as usize) {
                    *x = true;
                }
            }
        }
        let missing = covered.iter().position(|x| !x);
        if !c.ensure(ok && missing.is_none(), format!("placement.replicas[{l}]"), || match missing {
            Some(e) => format!("expert {e} has no replica"),
            None => {
                format!("not {} GPUs of {slots} distinct experts < {} each: {gpus:?}", p.cluster.world, p.model.experts)
            }
        }) {
            break;
        }
    }
    // The EP expert views hold one slot per replica.
    for (i, v) in p.memory.views.iter().enumerate() {
        if v.mode == Mode::Ep && matches!(v.role, TensorRole::ExpertsW13 | TensorRole::ExpertsW2) {
            c.ensure(v.shape.first() == Some(&(slots as u64)), format!("memory.views[{i}].shape"), || {
                format!("{:?} for {slots} expert slots per GPU", v.shape)
            });
        }
    }
}

/// The memory-plan invariants alone, as messages (for property tests that
/// build memory plans without a whole plan around them).
pub fn memory_violations(plan: &Plan) -> Vec<String> {
    let mut c = Check::default();
    memory(&mut c, plan);
    c.out.into_iter().map(|v| v.to_string()).collect()
}

/// Every program verifies (`program::check`), and each rank has exactly one
/// program per mode and phase.
fn programs(c: &mut Check, p: &Plan) {
    use crate::program::{Phase, Role as ProgramRole};
    if p.programs.is_empty() {
        return;
    }
    for (i, prog) in p.programs.iter().enumerate() {
        for (field, message) in crate::program::check(i, prog, &p.memory, &p.kernels, p.cluster.world, p.model.layers) {
            c.bad(field, message);
        }
        for (b, block) in prog.blocks.iter().enumerate() {
            for (o, op) in block.ops.iter().enumerate() {
                if let Some(r) = op.comm.as_ref().and_then(|x| x.relay) {
                    let f = format!("programs[{i}].blocks[{b}].ops[{o}].comm.relay");
                    c.ensure(r.gpus_per_node == p.cluster.gpus_per_node, f.clone(), || {
                        format!(
                            "relays over nodes of {} GPUs; the cluster's have {}",
                            r.gpus_per_node, p.cluster.gpus_per_node
                        )
                    });
                    // A relay writes one row per (token, source of its local
                    // rank on another node): nodes − 1 rows per token
                    // position, which its dispatch slots (top-k rows per
                    // token) hold while nodes − 1 ≤ top-k.
                    c.ensure(p.cluster.nodes.saturating_sub(1) <= p.model.top_k, f, || {
                        format!(
                            "{} nodes relay more rows than a relay's dispatch slots hold (top-k {})",
                            p.cluster.nodes, p.model.top_k
                        )
                    });
                }
            }
        }
    }
    // Who runs a phase, and as what: every rank colocated; a PD plan's GPUs
    // of the phase's role colocated (whole-model instances); an ExpertPlex
    // plan's attention servers of the phase's role and its MoE servers.
    let runs = |phase: Phase, rank: u32| -> Option<ProgramRole> {
        let Some(r) = &p.roles else { return Some(ProgramRole::Colocated) };
        let serves = match phase {
            Phase::Prefill => Role::Prefill,
            Phase::Decode => Role::Decode,
        };
        match r.gpus.get(rank as usize) {
            Some(&g) if g == serves && r.moe_servers() => Some(ProgramRole::Attention),
            Some(&g) if g == serves => Some(ProgramRole::Colocated),
            Some(Role::Moe) => Some(ProgramRole::Moe),
            _ => None,
        }
    };
    for (i, prog) in p.programs.iter().enumerate() {
        for &r in &prog.ranks {
            let want = runs(prog.phase, r);
            c.ensure(want == Some(prog.role), format!("programs[{i}].role"), || match want {
                Some(w) => format!("rank {r} runs the {} step as {w:?}, not {:?}", prog.phase.name(), prog.role),
                None => format!("rank {r} does not run the {} step", prog.phase.name()),
            });
        }
    }
    // (A role plan's modes are EP's alone: `memory.modes` refuses others.)
    for &mode in p.memory.modes.iter().filter(|&&m| p.roles.is_none() || m == Mode::Ep) {
        for phase in [Phase::Prefill, Phase::Decode] {
            let mut held: Vec<u32> = p
                .programs
                .iter()
                .filter(|q| q.mode == mode && q.phase == phase)
                .flat_map(|q| q.ranks.iter().copied())
                .collect();
            held.sort_unstable();
            let all: Vec<u32> = (0..p.cluster.world).filter(|&r| runs(phase, r).is_some()).collect();
            c.ensure(held == all, "programs", || {
                format!("{} {} programs cover ranks {held:?}, not each of {all:?} once", mode.name(), phase.name())
            });
        }
    }
}

/// **Invariants** of a role plan: one role per GPU laid out as its
/// `per_node` says, every role present; only MoE servers hold the experts'
/// region and only attention servers the weights and KV pool they run,
/// the workspace every GPU; every (attention rank, MoE rank) pair has one
/// post, inside the MoE rank's `dispatch` buffer, the posts into one MoE
/// rank disjoint; the KV handoff moves the attention servers' pages.
fn roles(c: &mut Check, p: &Plan) {
    let Some(r) = &p.roles else { return };
    let world = p.cluster.world as usize;
    c.ensure(r.gpus.len() == world, "roles.gpus", || format!("{} roles for a world of {world}", r.gpus.len()));
    // Counts are checked against the node size before laying them out (an
    // edited plan's counts must not allocate without bound).
    let gpn = u64::from(p.cluster.gpus_per_node);
    let sized = r.per_node.iter().all(|n| n.iter().map(|&x| u64::from(x)).sum::<u64>() == gpn);
    c.ensure(
        r.per_node.len() == p.cluster.nodes as usize && sized && crate::roles::Roles::lay_out(&r.per_node) == r.gpus,
        "roles.per_node",
        || format!("{:?} does not lay out as the GPUs' roles", r.per_node),
    );
    for role in [Role::Prefill, Role::Decode] {
        c.ensure(r.gpus.contains(&role), "roles.gpus", || format!("no {} server", role.name()));
    }
    c.ensure((1..=2).contains(&r.lanes), "roles.lanes", || {
        format!("{} virtual lanes; the schedule uses 1 or 2", r.lanes)
    });
    // Replicas over MoE servers form a topology of equal nodes (placement
    // and the twin's intra-node swaps rely on it).
    c.ensure(p.placement.is_none() || crate::roles::uniform_moe(&r.per_node), "roles.per_node", || {
        format!("{:?}: replicas need the same number of MoE servers on every node holding any", r.per_node)
    });
    // EP groups: disjoint, non-empty, of one size; ExpertPlex's one group is
    // its MoE servers, PD's groups are instances of one role covering the world.
    let mut seen = std::collections::BTreeSet::new();
    let size = r.ep_groups.first().map_or(0, Vec::len);
    let groups_ok = !r.ep_groups.is_empty()
        && r.ep_groups.iter().flatten().all(|&g| (g as usize) < world && seen.insert(g))
        && r.ep_groups.iter().all(|g| g.len() == size && size > 0);
    let shape_ok = if r.moe_servers() {
        r.ep_groups.len() == 1 && r.ep_groups[0] == r.ranks(Role::Moe)
    } else {
        seen.len() == world
            && r.ep_groups.iter().all(|g| g.iter().all(|&x| r.gpus.get(x as usize) == r.gpus.get(g[0] as usize)))
    };
    if !c.ensure(groups_ok && shape_ok, "roles.ep_groups", || {
        format!("{:?} are not disjoint equal groups of the MoE servers or of single-role instances", r.ep_groups)
    }) {
        return;
    }
    // Roles are single-mode EP: Moebius's switch is a colocated mechanism
    // (every GPU holds attention and experts in both views), so a role
    // plan holds no TP views, TP page format or reshard.
    let ep_only = p.memory.modes == [Mode::Ep] && p.memory.kv.tp.is_none() && p.memory.reshard.is_none();
    c.ensure(p.memory.modes.is_empty() || ep_only, "memory.modes", || {
        format!(
            "{:?} with roles; a role plan holds the EP view only, with no TP page format or reshard",
            p.memory.modes
        )
    });
    if !p.memory.regions.is_empty() {
        let moe = r.moe_servers();
        for (i, g) in p.memory.regions.iter().enumerate() {
            let want: &[Role] = if !moe {
                &[]
            } else {
                match g.kind {
                    RegionKind::Experts => &[Role::Moe],
                    RegionKind::Replicated | RegionKind::AttentionEp | RegionKind::KvPool => {
                        &[Role::Prefill, Role::Decode]
                    }
                    RegionKind::AttentionTp => &[],
                    RegionKind::Comm | RegionKind::Scratch | RegionKind::Requests => &[],
                }
            };
            c.ensure(g.roles == want, format!("memory.regions[{i}].roles"), || {
                format!("`{}` is held by {:?}, not {want:?}", g.kind.name(), g.roles)
            });
        }
        let kv = &p.memory.kv;
        c.ensure(
            r.kv_handoff.page_tokens == kv.page_tokens && r.kv_handoff.page_bytes == kv.ep.page_bytes,
            "roles.kv_handoff",
            || format!("{:?} is not the KV pool's page format", r.kv_handoff),
        );
        let Some(d) = p.memory.buffer(Mode::Ep, BufferName::Dispatch) else {
            c.bad("roles.posts", "the plan has no dispatch buffer");
            return;
        };
        let attn = r.attention_ranks();
        let moe = r.ranks(Role::Moe);
        c.ensure(r.posts.len() == attn.len() * moe.len(), "roles.posts", || {
            format!("{} posts for {} attention and {} MoE ranks", r.posts.len(), attn.len(), moe.len())
        });
        let mut seen = std::collections::BTreeSet::new();
        let mut by_dst: std::collections::BTreeMap<u32, Vec<[u64; 2]>> = Default::default();
        for (i, x) in r.posts.iter().enumerate() {
            let f = format!("roles.posts[{i}]");
            let inside = x.rows > 0
                && x.first_row.checked_add(x.rows).is_some_and(|e| e <= d.rows)
                && x.first_row.checked_mul(d.row_bytes).and_then(|b| b.checked_add(d.offset)) == Some(x.offset);
            c.ensure(inside, &f, || {
                format!(
                    "rows [{}, +{}) at {} are not inside `dispatch` ({} rows at {})",
                    x.first_row, x.rows, x.offset, d.rows, d.offset
                )
            });
            c.ensure(attn.contains(&x.src) && moe.contains(&x.dst) && seen.insert((x.src, x.dst)), &f, || {
                format!("{} → {} is not a new (attention, MoE) pair", x.src, x.dst)
            });
            // The path §5 gives the pair: NVLink within a node, decode on the
            // high-priority lane, prefill relayed by the destination node's
            // prefill server where it has one.
            if attn.contains(&x.src) && moe.contains(&x.dst) {
                let want = crate::roles::Roles::path(&r.gpus, p.cluster.gpus_per_node, r.lanes, x.src, x.dst);
                c.ensure(x.path == want, format!("{f}.path"), || {
                    format!("{:?} for {} → {}; the schedule's path is {want:?}", x.path, x.src, x.dst)
                });
            }
            by_dst.entry(x.dst).or_default().push([x.first_row, x.first_row.saturating_add(x.rows)]);
        }
        for (dst, mut rows) in by_dst {
            rows.sort_unstable();
            c.ensure(rows.windows(2).all(|w| w[0][1] <= w[1][0]), "roles.posts", || {
                format!("two attention ranks' rows overlap in MoE rank {dst}'s dispatch buffer")
            });
        }
    }
}
