//! Memory budget pass: bytes per GPU for the planned layout.
//!
//! Replicated weights (embeddings, LM head, attention, norms, router, dense
//! layers, shared experts) plus this rank's routed experts, a fixed
//! workspace, and the remainder of `hbm × memory_fraction` for the KV cache.
//! It does not lay out addresses (that is the unified-buffer memory plan).

use crate::plan::{DeployLayout, MemoryBudget};
use moeforge_dsl::spec::{Deploy, Model, Spec};

/// Activation and communication workspace per GPU: dispatch/combine buffers
/// and GEMM scratch for `MAX_BATCH_TOKENS` tokens, at least 2 GiB.
pub const MAX_BATCH_TOKENS: u64 = 16384;

pub fn run(spec: &Spec, d: &Deploy, layout: &DeployLayout) -> Result<MemoryBudget, String> {
    let m = spec.model(d.model);
    let c = spec.cluster(d.cluster);
    let hbm = c.gpu.hbm;
    let usable = (hbm as f64 * d.memory_fraction).floor() as u64;
    let expert_weights = u64::from(m.moe_layers()) * u64::from(layout.max_experts_per_rank) * m.expert_bytes();
    let replicated = replicated_bytes(m);
    let workspace = workspace_bytes(m);
    let kv_per_token = u64::from(m.layers) * m.kv_bytes_per_token_layer();
    let fixed = replicated + expert_weights + workspace;
    if fixed > usable {
        return Err(format!(
            "each GPU needs {:.1} GB of weights and workspace but may use {:.1} GB ({:.0}% of {:.1} GB)",
            fixed as f64 / 1e9,
            usable as f64 / 1e9,
            d.memory_fraction * 100.0,
            hbm as f64 / 1e9
        ));
    }
    let kv_cache = usable - fixed;
    Ok(MemoryBudget {
        hbm,
        memory_fraction: d.memory_fraction,
        usable,
        replicated_weights: replicated,
        expert_weights,
        workspace,
        kv_cache,
        kv_tokens: kv_cache / kv_per_token.max(1),
    })
}

/// Weights every GPU holds in full under data-parallel attention.
pub fn replicated_bytes(m: &Model) -> u64 {
    let routed = m.moe_layers() as u64 * m.moe.experts as u64 * m.expert_bytes();
    m.weight_bytes().saturating_sub(routed)
}

fn workspace_bytes(m: &Model) -> u64 {
    // Dispatch + combine rows (top_k per token, bf16) and GateUp output (2·I per row).
    let rows = MAX_BATCH_TOKENS * u64::from(m.moe.top_k);
    let bytes = rows * (2 * u64::from(m.hidden) * 2 + 2 * u64::from(m.moe.expert_ffn) * 2);
    bytes.max(2 << 30)
}
