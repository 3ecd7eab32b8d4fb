//! Cost model pass: the tile-aware latency model of this deployment
//! (ExpertPlex §6.2): a roofline of the spec's GPU and links, refitted
//! component by component from a measured profile when one is given. It
//! plans nothing; later passes and the simulator read `plan.cost`.

use super::{At, Ctx, PassError};
use moeforge_dsl::Code;
use moeforge_plan::cost::CostModel;
use moeforge_plan::Plan;

/// Writes `plan.cost`.
pub fn run(cx: &Ctx<'_>, plan: &mut Plan) -> Result<(), Vec<PassError>> {
    let cm = CostModel::roofline(cx.model, cx.cluster, cx.tiles);
    plan.cost = match &cx.opts.profile {
        None => cm,
        Some((profile, digest)) => cm.with_profile(profile, digest).map_err(|e| {
            PassError::new(Code::Unsupported, At::Input, format!("the latency profile cannot be used: {e}"))
                .help("a profile is {\"samples\": [{\"component\": \"moe\", \"x\": …, \"s\": …, \"t\": seconds}, …]}")
        })?,
    };
    Ok(())
}
