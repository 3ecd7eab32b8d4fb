//! Layout pass: which GPU holds what.
//!
//! Three layouts. **Colocated** (`strategy = colocated`, and the fallback):
//! data-parallel attention on every GPU and expert parallelism over all of
//! them, experts striped contiguously in balanced blocks (the first
//! `E mod P` ranks hold one more). **ExpertPlex roles** (`strategy =
//! expertplex`): the layout search's best layout with data-parallel
//! attention (role plans hold whole attention weights and KV per server),
//! realized: each GPU is a prefill attention server, a decode attention
//! server or a MoE server ([`moeforge_plan::roles`]), laid out node by node
//! as the search placed them, with the experts striped over the MoE servers
//! only. **PD** (`strategy = pd-disagg`): whole-model instances (the
//! simulator's PD baseline), the first half prefill, the rest decode, each
//! instance striping every expert over its own GPUs. **`auto`** realizes
//! whichever of the three the search pass's comparison
//! (`SearchResult::alternatives`) puts first, or the colocated layout when
//! the spec enables `switch` (Moebius's dual mode is a colocated plan's).
//! When the spec asks for something this pass does not realize (a
//! deployment no layout serves), the plan is colocated and
//! `DeployLayout::note` says so rather than pretending.

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

/// Writes `plan.layout`, `plan.ranks` and, for an ExpertPlex or PD
/// deployment, `plan.roles` (its dispatch posts are the memory pass's). It does not size
/// memory, place replicas or choose kernels, and never fails.
pub fn run(cx: &Ctx<'_>, plan: &mut Plan) -> Result<(), Vec<PassError>> {
    let (m, c, d) = (cx.model, cx.cluster, cx.deploy);
    let world = c.world_size();
    let search = plan.search.as_ref();
    // Role plans run data-parallel attention: the best candidate that does.
    let best = search.and_then(|s| s.realizable()).filter(|b| b.per_node.len() == c.nodes as usize);
    // `auto` realizes the strategy the search's comparison put first
    // (`SearchResult::alternatives`), unless the spec asks for TP↔EP
    // switching: Moebius's dual mode is a colocated plan's.
    let chosen = search
        .filter(|_| d.strategy == Strategy::Auto && !d.switch.enabled)
        .and_then(|s| s.alternatives.first())
        .filter(|a| a.goodput > 0.0);
    let realize = match (d.strategy, chosen) {
        (Strategy::Auto, Some(a)) => a.strategy,
        (Strategy::Auto, None) => Strategy::Colocated,
        (s, _) => s,
    };
    let roles = match (realize, best) {
        (Strategy::Expertplex, Some(b)) => {
            let gpus = Roles::lay_out(&b.per_node);
            let moe = (0..world).filter(|&r| gpus[r as usize] == Role::Moe).collect();
            Some(Roles {
                gpus,
                per_node: b.per_node.clone(),
                ep_groups: vec![moe],
                q: b.q,
                goodput: b.goodput,
                overlap: b.overlap,
                posts: Vec::new(),
                // Two lanes are all the schedule uses: decode's and prefill's.
                lanes: c.scale_out.as_ref().map_or(1, |o| o.virtual_lanes.clamp(1, 2)),
                kv_handoff: KvHandoff { page_tokens: 0, page_bytes: 0 },
            })
        }
        (Strategy::PdDisagg, _) => pd(cx, plan),
        _ => None,
    };
    // Each EP group stripes every expert over its GPUs.
    let groups: Vec<Vec<u32>> = match &roles {
        Some(r) => r.ep_groups.clone(),
        None => vec![(0..world).collect()],
    };
    let mut held = vec![[m.moe.experts; 2]; world as usize];
    for g in &groups {
        for (r, x) in stripes(m.moe.experts, world, g).into_iter().enumerate() {
            if g.contains(&(r as u32)) {
                held[r] = x;
            }
        }
    }
    plan.ranks = (0..world)
        .map(|r| RankPlan {
            rank: r,
            node: r / c.gpus_per_node,
            local_rank: r % c.gpus_per_node,
            experts: held[r as usize],
        })
        .collect();
    let holders = groups.first().cloned().unwrap_or_default();
    let ep = holders.len() as u32;
    let most = m.moe.experts.div_ceil(ep.max(1));
    let tp_best = search.and_then(|s| s.best()).filter(|b| !b.data_parallel());
    let note = match (d.strategy, &roles) {
        (Strategy::Expertplex, Some(r)) => tp_best.map(|t| {
            format!(
                "the layout search's best layout runs tensor-parallel attention ({}, G = {:.2} req/s); role plans execute data-parallel attention only, so the plan realizes the best data-parallel layout (G = {:.2} req/s)",
                t.label(),
                t.goodput,
                r.goodput
            )
        }),
        (Strategy::Auto, _) => Some(auto_note(d.switch.enabled, search)),
        (Strategy::Colocated, _) | (_, Some(_)) => None,
        (Strategy::Expertplex, None) if tp_best.is_some() => tp_best.map(|t| {
            format!(
                "strategy `expertplex` requested but only layouts with tensor-parallel attention meet the SLOs (best {}, G = {:.2} req/s) and role plans execute data-parallel attention only; the plan is the colocated DP-attention + EP layout, and `moeforge simulate` evaluates the searched layout",
                t.label(),
                t.goodput
            )
        }),
        (Strategy::Expertplex, None) => Some(format!(
            "strategy `expertplex` requested but the layout search found no layout that meets the SLOs and fits memory{}; the plan is the colocated DP-attention + EP layout",
            if d.placement.policy == moeforge_dsl::spec::PlacementPolicy::None {
                ""
            } else {
                " with the replicated placement (the same number of MoE servers on every node holding them, dividing experts + redundant_experts)"
            }
        )),
        (Strategy::PdDisagg, None) => Some(format!(
            "strategy `pd-disagg` requested but {world} GPUs cannot hold one prefill and one decode whole-model instance; the plan is the colocated DP-attention + EP layout"
        )),
    };
    plan.layout = match &roles {
        Some(r) => DeployLayout {
            requested: d.strategy,
            attention: format!("prefill dp{} + decode dp{}", r.ranks(Role::Prefill).len(), r.ranks(Role::Decode).len()),
            moe: if r.moe_servers() { format!("ep{ep}") } else { format!("{} instances × ep{ep}", r.ep_groups.len()) },
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

/// What `auto` chose and why: the comparison's goodputs, or the switch
/// that keeps the plan colocated.
fn auto_note(switch: bool, search: Option<&moeforge_plan::search::SearchResult>) -> String {
    let weighed = search.map_or(String::new(), |s| {
        s.alternatives
            .iter()
            .map(|a| {
                if a.goodput > 0.0 {
                    format!("{} {} {:.2} req/s", a.strategy.name(), a.label, a.goodput)
                } else {
                    format!("{} (none: {})", a.strategy.name(), a.label)
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    });
    match search.and_then(|s| s.alternatives.first()) {
        _ if switch => "strategy `auto` with `switch`: TP↔EP switching (Moebius) is a colocated plan's, so the plan is the colocated layout; the layout search's ranking (see `search`) is advisory and `moeforge simulate` evaluates it".into(),
        Some(a) if a.goodput > 0.0 => format!(
            "strategy `auto` chose `{}`, the highest goodput of Eq. 1 on the cost model over the strategies the planner realizes: {weighed}",
            a.strategy.name()
        ),
        _ => format!("strategy `auto`: no strategy meets both SLOs under the cost model ({weighed}); the plan is the colocated DP-attention + EP layout"),
    }
}

/// PD disaggregation realized: whole-model instances of the fewest GPUs
/// (a power of two) that hold the model with KV room, the simulator's PD
/// baseline ([`moeforge_plan::cost::step::Env::pd_unit`]); the first half
/// of the instances prefill, the rest decode. `None` when the world cannot
/// hold one of each.
fn pd(cx: &Ctx<'_>, plan: &Plan) -> Option<Roles> {
    let (m, c, d) = (cx.model, cx.cluster, cx.deploy);
    let ws = moeforge_plan::memory::Workspace::of(m, false).bytes();
    let env = moeforge_plan::cost::step::Env::new(m, c, cx.tiles, d, &plan.cost, ws);
    let unit = env.pd_unit().ok()?;
    let world = c.world_size();
    let instances = world / unit;
    let prefill = instances / 2;
    // Instances are consecutive ranks covering the world.
    if !world.is_multiple_of(unit) {
        return None;
    }
    let gpus: Vec<Role> = (0..world).map(|r| if r / unit < prefill { Role::Prefill } else { Role::Decode }).collect();
    let gpn = c.gpus_per_node;
    let per_node = (0..c.nodes)
        .map(|n| {
            let on = &gpus[(n * gpn) as usize..((n + 1) * gpn) as usize];
            let count = |x: Role| on.iter().filter(|&&r| r == x).count() as u32;
            [0, count(Role::Prefill), count(Role::Decode)]
        })
        .collect();
    Some(Roles {
        gpus,
        per_node,
        ep_groups: (0..instances).map(|i| (i * unit..(i + 1) * unit).collect()).collect(),
        q: 0,
        goodput: 0.0,
        overlap: moeforge_plan::cost::step::Overlaps::STANDARD,
        posts: Vec::new(),
        lanes: 1,
        kv_handoff: KvHandoff { page_tokens: 0, page_bytes: 0 },
    })
}
