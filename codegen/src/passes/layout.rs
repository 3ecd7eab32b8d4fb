//! Layout pass: which GPU holds what.
//!
//! v1 implements one layout for every strategy: data-parallel attention on
//! every GPU and expert parallelism over all of them, experts striped
//! contiguously in balanced blocks (the first `E mod P` ranks hold one more). The layout
//! search of ExpertPlex Algorithm 1 and Zepp placement replace this pass in
//! later versions; when the spec asks for something else, the plan says so in
//! `DeployLayout::note` rather than pretending.

use super::{Ctx, PassError};
use moeforge_dsl::spec::Strategy;
use moeforge_plan::{DeployLayout, Plan, RankPlan};

/// Writes `plan.layout` and `plan.ranks`. It does not size memory or choose
/// kernels, and it never fails: any world and expert count stripe.
pub fn run(cx: &Ctx<'_>, plan: &mut Plan) -> Result<(), Vec<PassError>> {
    let (m, c, d) = (cx.model, cx.cluster, cx.deploy);
    let world = c.world_size();
    let (base, extra) = (m.moe.experts / world, m.moe.experts % world);
    plan.ranks = (0..world)
        .map(|r| {
            let begin = r * base + r.min(extra);
            let count = base + u32::from(r < extra);
            RankPlan {
                rank: r,
                node: r / c.gpus_per_node,
                local_rank: r % c.gpus_per_node,
                experts: [begin, begin + count],
            }
        })
        .collect();
    let note = match d.strategy {
        Strategy::Colocated => None,
        other => Some(format!(
            "strategy `{}` requested; the memory plan and kernels are for the colocated DP-attention + EP layout, the layout search's choice (see `search`) is advisory, and `moeforge simulate` evaluates it",
            serde_json::to_value(other).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
        )),
    };
    plan.layout = DeployLayout {
        requested: d.strategy,
        attention: format!("dp{world}"),
        moe: format!("ep{world}"),
        ep_size: world,
        max_experts_per_rank: base + u32::from(extra > 0),
        note,
    };
    Ok(())
}
