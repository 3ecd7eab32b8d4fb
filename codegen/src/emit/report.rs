//! `report.md`: what was planned and emitted, for a human.

use crate::nvcc::PtxasStats;
use crate::plan::{KernelParams, Plan};
use std::collections::BTreeMap;
use std::fmt::Write;

fn gb(b: u64) -> String {
    format!("{:.2} GB", b as f64 / 1e9)
}

/// How the kernels were (or were not) compiled.
pub enum Toolchain<'a> {
    Compiled { nvcc_version: &'a str, stats: &'a BTreeMap<String, Vec<PtxasStats>> },
    Skipped(&'a str),
}

pub fn render(plan: &Plan, toolchain: &Toolchain<'_>) -> String {
    let mut s = String::new();
    let m = &plan.model;
    let c = &plan.cluster;
    let l = &plan.layout;
    let mem = &plan.memory;
    let _ = writeln!(s, "# moeforge report: `{}`\n", plan.deploy);
    let _ = writeln!(s, "Bundle format {} · spec hash `{}`\n", plan.format_version, plan.spec_hash);
    let _ = writeln!(s, "## Model `{}`\n", m.name);
    let _ = writeln!(s, "| | |\n|---|---|");
    let _ = writeln!(s, "| layers (MoE) | {} ({}) |", m.layers, m.moe_layers);
    let _ = writeln!(s, "| hidden | {} |", m.hidden);
    let _ = writeln!(s, "| routed experts × top-k | {} × {} (expert FFN {}) |", m.experts, m.top_k, m.expert_ffn);
    let _ = writeln!(
        s,
        "| parameters | {:.2} B total, {:.2} B active |",
        m.params_total as f64 / 1e9,
        m.params_active as f64 / 1e9
    );
    let _ = writeln!(
        s,
        "| weights | {} (experts {}, {} per expert) |",
        gb(m.weight_bytes),
        m.expert_dtype.name(),
        gb(m.expert_bytes)
    );
    let _ = writeln!(s, "| KV cache per token | {} KB |", m.kv_bytes_per_token as f64 / 1e3);
    let _ = writeln!(s, "\n## Cluster `{}`\n", c.name);
    let _ = writeln!(
        s,
        "{} node(s) × {} {} ({}, {} SMs, {} HBM) = {} GPUs\n",
        c.nodes,
        c.gpus_per_node,
        c.gpu,
        c.arch.name(),
        c.sms,
        gb(c.hbm_bytes),
        c.world
    );
    let _ = writeln!(s, "## Layout\n");
    let _ = writeln!(
        s,
        "attention `{}`, experts `{}`: {} routed experts per GPU per layer.\n",
        l.attention, l.moe, l.max_experts_per_rank
    );
    if let Some(n) = &l.note {
        let _ = writeln!(s, "> {n}\n");
    }
    let _ = writeln!(s, "## Memory per GPU\n");
    let _ = writeln!(s, "| region | bytes |\n|---|---|");
    let _ = writeln!(s, "| HBM | {} |", gb(mem.hbm));
    let _ = writeln!(s, "| usable ({:.0}%) | {} |", mem.memory_fraction * 100.0, gb(mem.usable));
    let _ = writeln!(s, "| replicated weights | {} |", gb(mem.replicated_weights));
    let _ = writeln!(s, "| routed experts | {} |", gb(mem.expert_weights));
    let _ = writeln!(s, "| workspace | {} |", gb(mem.workspace));
    let _ = writeln!(s, "| KV cache | {} ({} tokens) |", gb(mem.kv_cache), mem.kv_tokens);
    let _ = writeln!(s, "\n## Kernels\n");
    match toolchain {
        Toolchain::Compiled { nvcc_version, .. } => {
            let _ = writeln!(
                s,
                "Compiled with nvcc ({nvcc_version}), flags `{}`.\n",
                crate::nvcc::flags(c.arch.name()).join(" ")
            );
        }
        Toolchain::Skipped(why) => {
            let _ = writeln!(s, "Not compiled: {why}.\n");
        }
    }
    for k in &plan.kernels {
        let _ = writeln!(s, "### `kernels/{}.cu`: {}\n", k.name, k.purpose);
        let consts = match &k.params {
            KernelParams::Router(p) => serde_json::to_value(p),
            KernelParams::Permute(p) => serde_json::to_value(p),
        };
        if let Ok(serde_json::Value::Object(map)) = consts {
            let row: Vec<String> = map.iter().map(|(k, v)| format!("{k} = {v}")).collect();
            let _ = writeln!(s, "Constants: {}\n", row.join(", "));
        }
        let stats = match toolchain {
            Toolchain::Compiled { stats, .. } => stats.get(&k.name),
            Toolchain::Skipped(_) => None,
        };
        let _ = writeln!(
            s,
            "| entry | grid × block | registers | spills (st/ld) | stack | static smem |\n|---|---|---|---|---|---|"
        );
        for e in &k.entries {
            let st = stats.and_then(|v| v.iter().find(|p| p.function == e.symbol));
            let (regs, spills, stack, smem) = match st {
                Some(p) => (
                    p.registers.to_string(),
                    format!("{}/{}", p.spill_stores, p.spill_loads),
                    p.stack_frame.to_string(),
                    p.static_smem.to_string(),
                ),
                None => ("–".into(), "–".into(), "–".into(), "–".into()),
            };
            let _ = writeln!(s, "| `{}` | {} × {} | {regs} | {spills} | {stack} | {smem} |", e.symbol, e.grid, e.block);
        }
        let _ = writeln!(s);
    }
    s
}
