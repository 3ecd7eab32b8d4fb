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
    if plan.memory.usable > 0 {
        let m = &plan.memory;
        let sum = m.replicated_weights + m.expert_weights + m.workspace + m.kv_cache;
        if sum != m.usable || m.usable > m.hbm {
            bad(format!("memory budget does not add up: {sum} of {} usable, {} HBM", m.usable, m.hbm));
        }
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
