//! The plan validator: the gate between planning and emission.
//!
//! [`validate`] checks the invariants every emitter relies on and wraps the
//! plan in a [`ValidPlan`], the only thing `emit` accepts. It runs after the
//! pipeline in release builds and after every pass in debug builds.

use crate::plan::{KernelParams, Plan};
use std::fmt;

/// A plan that passed [`validate`]. Only this module constructs it.
#[derive(Clone, Debug)]
pub struct ValidPlan(Plan);

impl ValidPlan {
    pub fn plan(&self) -> &Plan {
        &self.0
    }
}

/// A broken plan invariant: a bug in a pass, never a user error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation(pub String);

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "plan invariant violated: {}", self.0)
    }
}

/// Checks the invariants that hold after every pass (a partial plan passes
/// as long as what it has is consistent).
pub fn check(plan: &Plan) -> Vec<Violation> {
    let mut v = Vec::new();
    let mut bad = |s: String| v.push(Violation(s));
    let world = plan.cluster.world;
    if !plan.ranks.is_empty() {
        // **Invariant**: ranks are 0..world in order, each on its node.
        if plan.ranks.len() != world as usize {
            bad(format!("{} ranks for a world of {world}", plan.ranks.len()));
        }
        let mut owner = vec![0u32; plan.model.experts as usize];
        for (i, r) in plan.ranks.iter().enumerate() {
            if r.rank as usize != i || r.node * plan.cluster.gpus_per_node + r.local_rank != r.rank {
                bad(format!("rank {i} is misnumbered ({r:?})"));
            }
            let [b, e] = r.experts;
            if b > e || e > plan.model.experts || e - b > plan.layout.max_experts_per_rank {
                bad(format!("rank {i} holds experts [{b}, {e}) of {}", plan.model.experts));
                continue;
            }
            for x in b..e {
                owner[x as usize] += 1;
            }
        }
        // **Invariant**: without replication every expert lives on exactly one rank.
        if let Some(x) = owner.iter().position(|&c| c != 1) {
            bad(format!("expert {x} is held by {} ranks", owner[x]));
        }
    }
    for v in memory_violations(&plan.memory) {
        bad(v);
    }
    for k in &plan.kernels {
        match &k.params {
            KernelParams::Router(r) => {
                if r.top_k > r.experts || r.per_lane * 32 < r.experts || r.groups * r.group_size != r.experts {
                    bad(format!("router constants inconsistent: {r:?}"));
                }
            }
            KernelParams::Permute(p) => {
                if p.max_local_experts != plan.layout.max_experts_per_rank
                    || p.row_vectors * 8 != p.hidden
                    || p.block_m == 0
                {
                    bad(format!("permute constants inconsistent: {p:?}"));
                }
            }
            KernelParams::Apk(a) => {
                let tiles_ok = a.m_t_prefill > 0 && a.m_t_decode > 0 && a.n_t_gate_up % 2 == 0 && a.n_t_down > 0;
                let shape_ok = a.local_experts > 0 && a.local_experts <= plan.layout.max_experts_per_rank;
                let q_ok = a.q >= a.cluster_size && a.q <= plan.cluster.sms && a.q_max < plan.cluster.sms;
                if !(tiles_ok && shape_ok && q_ok && a.max_prefill_rows % a.m_t_prefill == 0 && a.x_star > 0.0) {
                    bad(format!("APK constants inconsistent: {a:?}"));
                }
                for &r in &a.ranks {
                    let held = plan.ranks.get(r as usize).map(|x| x.experts[1] - x.experts[0]);
                    if held != Some(a.local_experts) {
                        bad(format!("APK for {} experts assigned to rank {r}, which holds {held:?}", a.local_experts));
                    }
                }
            }
        }
        if k.entries.is_empty() {
            bad(format!("kernel `{}` has no entry point", k.name));
        }
    }
    v
}

/// The gate: a complete plan whose invariants hold.
pub fn validate(plan: Plan) -> Result<ValidPlan, Vec<Violation>> {
    let mut v = check(&plan);
    if plan.ranks.is_empty() {
        v.push(Violation("no ranks".into()));
    }
    if plan.kernels.is_empty() {
        v.push(Violation("no kernels".into()));
    }
    if v.is_empty() {
        Ok(ValidPlan(plan))
    } else {
        Err(v)
    }
}

/// **Invariants** of the memory plan: regions tile the buffer in order,
/// aligned, without gaps or overlap; every view lies inside its region; the
/// views of one mode never overlap each other at any layer (aliasing happens
/// only across modes).
pub fn memory_violations(m: &crate::memory::MemoryPlan) -> Vec<String> {
    use crate::memory::ALIGN;
    let mut out = Vec::new();
    let mut at = 0;
    for r in &m.regions {
        if r.offset != at || r.offset % ALIGN != 0 {
            out.push(format!("region `{}` at {} (expected {at}, aligned to {ALIGN})", r.name, r.offset));
        }
        at = r.offset + r.bytes;
    }
    if at != m.buffer_bytes {
        out.push(format!("regions end at {at}, buffer is {}", m.buffer_bytes));
    }
    let mut spans: Vec<(crate::memory::Mode, u64, u64, String)> = Vec::new();
    let mut names = std::collections::BTreeSet::new();
    for v in &m.views {
        if !names.insert((v.mode, v.tensor.clone())) {
            out.push(format!("two {:?} views of `{}`", v.mode, v.tensor));
        }
        let Some(r) = m.regions.iter().find(|r| r.name == v.region) else {
            out.push(format!("view `{}` names unknown region `{}`", v.tensor, v.region));
            continue;
        };
        if v.offset % ALIGN != 0 {
            out.push(format!("view `{}` ({:?}) is not aligned", v.tensor, v.mode));
        }
        for l in v.layers[0]..v.layers[1] {
            let (a, b) = (v.offset_of(l), v.offset_of(l) + v.bytes());
            if a < r.offset || b > r.offset + r.bytes {
                out.push(format!("view `{}` layer {l} ({:?}) leaves region `{}`", v.tensor, v.mode, r.name));
            }
            spans.push((v.mode, a, b, format!("{}@{l}", v.tensor)));
        }
    }
    spans.sort();
    for w in spans.windows(2) {
        let (x, y) = (&w[0], &w[1]);
        // Identical ranges of the same mode are one tensor seen twice only for
        // the TP aliases of full attention tensors, which live in another mode.
        if x.0 == y.0 && y.1 < x.2 {
            out.push(format!("{:?} views overlap: {} and {}", x.0, x.3, y.3));
            break;
        }
    }
    out
}
