//! The layout search's result (ExpertPlex Algorithm 1, §6.3): the ranked
//! candidates the `search` pass of moeforge-codegen found, as `plan.json`
//! records them. Only data: the search itself is a planning pass.

use crate::cost::step::Overlaps;
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
    /// GPUs per attention group of each role: 1 is data-parallel
    /// attention, w > 1 tensor-parallel attention over w GPUs of one node.
    pub prefill_width: u32,
    pub decode_width: u32,
    /// How each phase overlaps communication with computation.
    pub overlap: Overlaps,
    /// Whether a phase's batch is capped by the KV its attention servers
    /// hold rather than by its SLO (the memory check asks for the KV of the
    /// largest batch the SLO allows; a layout that cannot hold it serves
    /// the smaller batch it can).
    pub prefill_kv_bound: bool,
    pub decode_kv_bound: bool,
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
    /// The best candidate first, then up to four runners-up with other
    /// layouts (a layout's tensor-parallel and data-parallel attention
    /// count apart), then the best data-parallel candidate when none of
    /// those is.
    pub ranked: Vec<Candidate>,
    /// `strategy = auto`: each strategy the planner realizes with its Eq. 1
    /// goodput, the best first (the layout pass realizes it); empty otherwise.
    pub alternatives: Vec<Alternative>,
}

/// One strategy `auto` weighed: its layout (or why it cannot serve) and
/// its modeled goodput, requests/s.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Alternative {
    pub strategy: moeforge_dsl::spec::Strategy,
    pub label: String,
    pub goodput: f64,
}

impl SearchResult {
    /// The best candidate.
    pub fn best(&self) -> Option<&Candidate> {
        self.ranked.first()
    }
    /// The best candidate a role plan executes: data-parallel attention on
    /// every attention server (the twin and the per-role memory plan hold
    /// whole attention weights and whole KV per server; tensor-parallel
    /// attention groups are evaluated by the simulator but not realized).
    pub fn realizable(&self) -> Option<&Candidate> {
        self.ranked.iter().find(|c| c.data_parallel())
    }
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

/// The fraction of prefill's attention→MoE traffic that takes a direct
/// scale-out path (ExpertPlex §5): a prefill server's rows for MoE servers on
/// its own node stay on NVLink, and for a remote node with a prefill server
/// go once to that server and fan out over its NVLink (the hierarchical
/// path, prefill-only links); only rows for MoE servers on a remote node
/// without a prefill server share the scale-out link decode uses. Rows
/// spread over MoE servers evenly.
pub fn prefill_shared_scale_out(per_node: &[[u32; 3]]) -> f64 {
    let moe: u32 = per_node.iter().map(|n| n[0]).sum();
    let prefill: u32 = per_node.iter().map(|n| n[1]).sum();
    if moe == 0 || prefill == 0 {
        return 0.0;
    }
    let mut direct = 0.0;
    for (a, src) in per_node.iter().enumerate() {
        for (b, dst) in per_node.iter().enumerate() {
            if a != b && dst[1] == 0 {
                direct += f64::from(src[1]) * f64::from(dst[0]);
            }
        }
    }
    direct / (f64::from(prefill) * f64::from(moe))
}

impl Candidate {
    /// The shared MoE servers this layout's attention servers route to.
    pub fn moe_side(&self) -> crate::cost::step::MoeSide {
        moe_side(&self.per_node)
    }
    /// Whether both roles run data-parallel attention (one GPU per group).
    pub fn data_parallel(&self) -> bool {
        self.prefill_width == 1 && self.decode_width == 1
    }
    /// `"{P}P{D}D{M}E q={q} {prefill attention}/{overlap} {decode attention}/{overlap}"`,
    /// e.g. `1P3D4E q=100 dp/none tp2/sbo`.
    pub fn label(&self) -> String {
        format!(
            "{}P{}D{}E q={} {}/{} {}/{}",
            self.prefill_gpus,
            self.decode_gpus,
            self.moe_gpus,
            self.q,
            Self::attention_name(self.prefill_width),
            self.overlap.prefill.name(),
            Self::attention_name(self.decode_width),
            self.overlap.decode.name()
        )
    }
    /// `"dp"` or `"tp{w}"` for a role's attention groups of `w` GPUs.
    pub fn attention_name(w: u32) -> String {
        if w == 1 {
            "dp".into()
        } else {
            format!("tp{w}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::prefill_shared_scale_out;

    /// Counted by hand: which (prefill server, MoE server) pairs cross to a
    /// node without a prefill server.
    #[test]
    fn only_rows_for_nodes_without_a_prefill_server_share_the_scale_out_link() {
        // One node: nothing leaves it.
        assert_eq!(prefill_shared_scale_out(&[[5, 1, 2]]), 0.0);
        // Every node has a prefill server: the hierarchical path carries it all.
        assert_eq!(prefill_shared_scale_out(&[[4, 1, 3], [4, 1, 3]]), 0.0);
        // Node 1 has 4 of the 6 MoE servers and no prefill server: the one
        // prefill server (node 0) sends 4/6 of its rows there directly.
        assert!((prefill_shared_scale_out(&[[2, 1, 5], [4, 0, 4]]) - 4.0 / 6.0).abs() < 1e-12);
        // Two prefill servers on node 0, one on node 1; node 2 (2 MoE of 6) has none:
        // every prefill server sends 2/6 there.
        assert!((prefill_shared_scale_out(&[[2, 2, 4], [2, 1, 5], [2, 0, 6]]) - 2.0 / 6.0).abs() < 1e-12);
        // No prefill or no MoE server: nothing to share.
        assert_eq!(prefill_shared_scale_out(&[[0, 1, 7]]), 0.0);
    }
}
