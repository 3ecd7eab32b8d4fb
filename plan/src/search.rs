//! The layout search's result (ExpertPlex Algorithm 1, §6.3): the ranked
//! candidates the `search` pass of moeforge-codegen found, as `plan.json`
//! records them. Only data: the search itself is a planning pass.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub moe_gpus: u32,
    pub prefill_gpus: u32,
    pub decode_gpus: u32,
    /// Per node: `[moe, prefill, decode]` GPUs.
    pub per_node: Vec<[u32; 3]>,
    /// Decode SM budget q on each MoE GPU under contention.
    pub q: u32,
    /// Largest prefill batch (tokens) meeting TTFT, and its iteration time.
    pub prefill_tokens: u32,
    pub t_prefill: f64,
    /// Largest decode batch (requests) meeting TPOT, and its iteration time.
    pub decode_batch: u32,
    pub t_decode: f64,
    /// Requests per second each phase sustains, and G = their minimum.
    pub prefill_rate: f64,
    pub decode_rate: f64,
    pub goodput: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SearchResult {
    pub mean_input: f64,
    pub mean_output: f64,
    pub layouts_considered: u32,
    pub layouts_fitting: u32,
    pub feasible: u32,
    /// The best candidate first, then up to four runners-up with other layouts.
    pub ranked: Vec<Candidate>,
}

/// Per node `[moe, prefill, decode]` GPUs: the MoE side the attention
/// servers route to. Its nodes are those holding MoE servers; `local` is the
/// fraction of the MoE servers on an attention server's own node, averaged
/// over the attention servers.
pub fn moe_side(per_node: &[[u32; 3]]) -> crate::cost::step::MoeSide {
    let moe: u32 = per_node.iter().map(|n| n[0]).sum();
    let attn: u32 = per_node.iter().map(|n| n[1] + n[2]).sum();
    let nodes = per_node.iter().filter(|n| n[0] > 0).count() as u32;
    let local = per_node.iter().map(|n| f64::from(n[1] + n[2]) * f64::from(n[0])).sum::<f64>()
        / f64::from(attn.max(1))
        / f64::from(moe.max(1));
    crate::cost::step::MoeSide::Ep { gpus: moe, nodes, replicas: 1, local, disaggregated: true }
}

impl Candidate {
    /// The shared MoE servers this layout's attention servers route to.
    pub fn moe_side(&self) -> crate::cost::step::MoeSide {
        moe_side(&self.per_node)
    }
}
