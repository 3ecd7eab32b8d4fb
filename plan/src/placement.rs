//! Expert replicas per layer and GPU (`placement { policy = zepp | eplb }`)
//! and the modeled comparison of the policies, as `plan.json` records them.
//! Only data: the algorithms live in moeforge-codegen's `placement` module.

use moeforge_dsl::spec::PlacementPolicy;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacementPlan {
    pub policy: PlacementPolicy,
    /// Where the loads came from.
    pub loads: String,
    pub redundant_experts: u32,
    /// `replicas[moe layer][gpu]` = experts of that GPU's slots.
    pub replicas: Vec<Vec<Vec<u32>>>,
    /// Modeled latency of MoE layer 0 under each policy (seconds); `none`
    /// is absent when experts do not stripe evenly.
    pub latency_none: Option<f64>,
    pub latency_eplb: f64,
    pub latency_zepp: f64,
    /// Every policy's routing on every layer's loads, as the serving
    /// simulator uses them (`none` absent when experts do not stripe evenly).
    #[serde(default)]
    pub stats: Vec<PolicyStats>,
}

/// How one placement policy spreads the loads: the busiest GPU's routed
/// rows over the mean, and the fraction of routed rows served on the
/// sender's node, each averaged over the MoE layers.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyStats {
    pub policy: PlacementPolicy,
    pub busiest: f64,
    pub local: f64,
}
