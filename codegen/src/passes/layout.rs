//! Layout pass: which GPU holds what.
//!
//! Two layouts. **Colocated** (every strategy but `expertplex`):
//! data-parallel attention on every GPU and expert parallelism over all of
//! them, experts striped contiguously in balanced blocks (the first
//! `E mod P` ranks hold one more). **ExpertPlex roles** (`strategy =
//! expertplex`): the layout search's best layout, realized: each GPU is a
//! prefill attention server, a decode attention server or a MoE server
//! ([`moeforge_plan::roles`]), laid out node by node as the search placed
//! them, with the experts striped over the MoE servers only. When the spec
//! asks for something this pass does not realize (PD disaggregation,
//! `auto`, or an ExpertPlex deployment no layout serves), the plan is
//! colocated and `DeployLayout::note` says so rather than pretending.

use super::{Ctx, PassError};
use moeforge_dsl::spec::Strategy;
use moeforge_plan::roles::{KvHandoff, Role, Roles};
use moeforge_plan::{DeployLayout, Plan, RankPlan};

/// Stripes `experts` over `holders` (rank ids in order): `[begin, end)` per
/// rank of the world, empty for ranks that hold none.
fn stripes(experts: u32, world: u32, holders: &[u32]) -> Vec<[u32; 2]> {
    let n = holders.len() as u32;
    let (base, extra) = (experts / n.max(1), experts % n.max(1));
    let mut out = vec![[0, 0]; world as usize];
    let mut at = 0;
    for (i, &r) in holders.iter().enumerate() {
        let count = base + u32::from((i as u32) < extra);
        out[r as usize] = [at, at + count];
        at += count;
    }
    // Ranks without experts sit at the end of the stripes (empty ranges).
    for (r, x) in out.iter_mut().enumerate() {
        if !holders.contains(&(r as u32)) {
            *x = [experts, experts];
        }
    }
    out
}

/// Writes `plan.layout`, `plan.ranks` and, for an ExpertPlex deployment,
/// `plan.roles` (its dispatch posts are the memory pass's). It does not size
/// memory, place replicas or choose kernels, and never fails.
pub fn run(cx: &Ctx<'_>, plan: &mut Plan) -> Result<(), Vec<PassError>> {
    let (m, c, d) = (cx.model, cx.cluster, cx.deploy);
    let world = c.world_size();
    let best = plan.search.as_ref().and_then(|s| s.ranked.first()).filter(|b| b.per_node.len() == c.nodes as usize);
    let roles = match (d.strategy, best) {
        (Strategy::Expertplex, Some(b)) => Some(Roles {
            gpus: Roles::lay_out(&b.per_node),
            per_node: b.per_node.clone(),
            q: b.q,
            goodput: b.goodput,
            posts: Vec::new(),
            kv_handoff: KvHandoff { page_tokens: 0, page_bytes: 0 },
        }),
        _ => None,
    };
    let holders: Vec<u32> = match &roles {
        Some(r) => r.ranks(Role::Moe),
        None => (0..world).collect(),
    };
    let held = stripes(m.moe.experts, world, &holders);
    plan.ranks = (0..world)
        .map(|r| RankPlan {
            rank: r,
            node: r / c.gpus_per_node,
            local_rank: r % c.gpus_per_node,
            experts: held[r as usize],
        })
        .collect();
    let ep = holders.len() as u32;
    let most = m.moe.experts.div_ceil(ep.max(1));
    let name =
        |s: Strategy| serde_json::to_value(s).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
    let note = match (d.strategy, &roles) {
        (Strategy::Colocated, _) | (_, Some(_)) => None,
        (Strategy::Expertplex, None) => Some(format!(
            "strategy `expertplex` requested but the layout search found no layout that meets the SLOs and fits memory{}; the plan is the colocated DP-attention + EP layout",
            if d.placement.policy == moeforge_dsl::spec::PlacementPolicy::None {
                ""
            } else {
                " with the replicated placement (the same number of MoE servers on every node holding them, dividing experts + redundant_experts)"
            }
        )),
        (other, None) => Some(format!(
            "strategy `{}` requested; the memory plan and kernels are for the colocated DP-attention + EP layout, the layout search's choice (see `search`) is advisory, and `moeforge simulate` evaluates it",
            name(other)
        )),
    };
    plan.layout = match &roles {
        Some(r) => DeployLayout {
            requested: d.strategy,
            attention: format!("prefill dp{} + decode dp{}", r.ranks(Role::Prefill).len(), r.ranks(Role::Decode).len()),
            moe: format!("ep{ep}"),
            ep_size: ep,
            max_experts_per_rank: most,
            note,
        },
        None => DeployLayout {
            requested: d.strategy,
            attention: format!("dp{world}"),
            moe: format!("ep{world}"),
            ep_size: world,
            max_experts_per_rank: most,
            note,
        },
    };
    plan.roles = roles;
    Ok(())
}
