//! The textual form of a [`Plan`] (what `moeforge explain` prints).

use crate::plan::{KernelParams, Plan};
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
        for r in &self.ranks {
            writeln!(
                f,
                "  rank {} (node {}, gpu {}): experts [{}, {})",
                r.rank, r.node, r.local_rank, r.experts[0], r.experts[1]
            )?;
        }
        let mem = &self.memory;
        writeln!(
            f,
            "  memory/gpu: usable {} = replicated {} + experts {} + workspace {} + kv {} ({} tokens)",
            gb(mem.usable),
            gb(mem.replicated_weights),
            gb(mem.expert_weights),
            gb(mem.workspace),
            gb(mem.kv_cache),
            mem.kv_tokens
        )?;
        for k in &self.kernels {
            let consts = match &k.params {
                KernelParams::Router(p) => serde_json::to_string(p),
                KernelParams::Permute(p) => serde_json::to_string(p),
            }
            .unwrap_or_default();
            writeln!(f, "  kernel {} ({}): {}", k.name, k.arch.name(), consts)?;
            for e in &k.entries {
                writeln!(f, "    {}<<<{}, {}>>>({})", e.symbol, e.grid, e.block, e.params.join(", "))?;
            }
        }
        writeln!(f, "}}")
    }
}
