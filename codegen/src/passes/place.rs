//! Placement pass: expert replicas and routing for `placement { policy = zepp | eplb }`.
//!
//! Loads come from a measured histogram (`compile --loads`, SGLang's expert
//! statistics) or, without one, a seeded Zipf(1.1) histogram per layer. The
//! pass places replicas per layer with the chosen policy, and records the
//! modeled MoE-layer latency of the chosen placement next to the baselines
//! (no replication, EPLB, Zepp) on the same loads.
//!
//! The placement is realized: it runs before the memory pass, which gives
//! each GPU's EP expert view one slot per replica it holds
//! (`layout.max_experts_per_rank` = slots per GPU), and the runtime loads
//! slot `j` of layer `l` on GPU `g` with expert `replicas[l][g][j]` and
//! routes every iteration's rows to replicas (`moeforge_plan::placement::route`).
//! A plan with replicas is single-mode: the TP↔EP reshard descriptors are
//! one per-layer-invariant set over striped experts, so dual mode with a
//! placement is refused here, at the deployment's `placement` field.

use super::{At, Ctx, PassError};
use crate::placement::{
    eplb, even_demand, layer_cost, none, route_local, route_uniform, routing_stats, zepp, zepp_latency, zipf_loads,
    Flows, LayerShape, Topology,
};
use moeforge_dsl::spec::{Deploy, PlacementPolicy, Routing, Spec};
use moeforge_dsl::Code;
use moeforge_plan::cost::CostModel;
use moeforge_plan::placement::{PlacementPlan, PolicyStats, SLACK};
use moeforge_plan::Plan;

/// Tokens per GPU the latency comparison assumes (a mid-sized prefill batch).
pub const TOKENS_PER_GPU: f64 = 256.0;

/// Writes `plan.placement` for `zepp` and `eplb`, and the slots per GPU into
/// `plan.layout.max_experts_per_rank`; refuses a placement in a deployment
/// that switches TP↔EP.
pub fn run(cx: &Ctx<'_>, plan: &mut Plan) -> Result<(), Vec<PassError>> {
    if cx.deploy.placement.policy != PlacementPolicy::None
        && super::memory::single_mode_reason(cx.spec, cx.deploy, plan.roles.as_ref()).is_none()
    {
        let why =
            "a live TP↔EP switch moves each expert once by reshard descriptors that are the same for every layer \
                   over striped experts; replicated slots differ per layer and would need per-layer descriptors that \
                   fan each expert out to its replicas, which this version does not generate";
        return Err(vec![PassError::new(
            Code::Unsupported,
            At::Deploy("placement".into()),
            format!(
                "expert replicas cannot be combined with TP↔EP switching: {why}{}",
                // A strategy that fell back to colocated switches like any colocated plan.
                plan.layout.note.as_ref().map_or(String::new(), |n| format!(" (this plan switches because {n})"))
            ),
        )
        .label("placement with a `switch` block")
        .help(
            "remove the `switch` block to serve with replicas in EP, or set `placement { policy = none }` to switch",
        )]);
    }
    let measured = cx.opts.loads.as_ref().map(|(l, digest)| (l.as_slice(), digest.as_str()));
    if plan.roles.as_ref().is_some_and(|r| !r.moe_servers()) && cx.deploy.placement.policy != PlacementPolicy::None {
        return Err(vec![PassError::new(
            Code::Unsupported,
            At::Deploy("placement".into()),
            "replicas in a PD deployment would be placed per whole-model instance; this version places them over one EP group (colocated, or ExpertPlex's MoE servers)".to_string(),
        )
        .label("placement with `strategy = pd-disagg`")
        .help("remove the `placement` block, or use `strategy = expertplex` or `colocated` for a replicated placement")]);
    }
    // A role plan places replicas over its MoE servers only: the same
    // count on every node holding them (the search guarantees it), as a
    // topology of their own, then maps them back to world ranks.
    let moe_ranks = plan.roles.as_ref().map(|r| r.ranks(moeforge_plan::roles::Role::Moe));
    let t = match &plan.roles {
        None => Topology { nodes: cx.cluster.nodes as usize, gpus_per_node: cx.cluster.gpus_per_node as usize },
        Some(r) => {
            let counts: Vec<u32> = r.per_node.iter().map(|n| n[0]).filter(|&m| m > 0).collect();
            if !super::search::uniform_moe(&r.per_node) {
                return Err(vec![PassError::new(
                    Code::Unsupported,
                    At::Deploy("placement".into()),
                    format!("the ExpertPlex layout puts {counts:?} MoE servers on its nodes; replicas need the same number on each"),
                )
                .label("placement over uneven MoE servers")]);
            }
            Topology { nodes: counts.len(), gpus_per_node: counts.first().copied().unwrap_or(1) as usize }
        }
    };
    plan.placement = place(cx.spec, cx.deploy, &plan.cost, measured, t).map_err(|e| {
        // Statistics that do not match the model point at the placement block that reads them.
        let at = if e.contains("expert statistics") { "placement" } else { "placement.redundant_experts" };
        let at = At::Deploy(at.into());
        PassError::new(Code::Unsupported, at, format!("expert placement failed: {e}")).label("placement policy").help(
            "(experts + redundant_experts) must be a multiple of the GPUs holding experts (every GPU, or a role plan's MoE servers), at most `experts` per GPU; measured loads must match the model",
        )
    })?;
    if let (Some(p), Some(moe)) = (plan.placement.as_mut(), &moe_ranks) {
        let world = cx.cluster.world_size() as usize;
        for layer in &mut p.replicas {
            let mut full = vec![Vec::new(); world];
            for (slots, &r) in layer.drain(..).zip(moe) {
                full[r as usize] = slots;
            }
            *layer = full;
        }
    }
    if let Some(p) = &plan.placement {
        plan.layout.max_experts_per_rank = p.slots_per_gpu() as u32;
    }
    Ok(())
}

fn place(
    spec: &Spec,
    d: &Deploy,
    cm: &CostModel,
    measured: Option<(&[Vec<f64>], &str)>,
    t: Topology,
) -> Result<Option<PlacementPlan>, String> {
    if d.placement.policy == PlacementPolicy::None {
        return Ok(None);
    }
    let m = spec.model(d.model);
    let experts = m.moe.experts as usize;
    let layers = m.moe_layers() as usize;
    let redundant = d.placement.redundant_experts as usize;
    let rows = TOKENS_PER_GPU * f64::from(m.moe.top_k) * t.world() as f64;
    let (loads, source) = match measured {
        Some((l, digest)) => {
            if l.len() != layers || l.iter().any(|x| x.len() != experts) {
                return Err(format!(
                    "the expert statistics have {} layers of {} experts; `{}` has {layers} MoE layers of {experts}",
                    l.len(),
                    l.first().map_or(0, Vec::len),
                    m.name
                ));
            }
            (l.to_vec(), format!("sglang sha256:{digest}"))
        }
        None => (zipf_loads(layers, experts, rows, 1.1, 0x6d6f65), "synthetic zipf(1.1), seed 0x6d6f65".to_string()),
    };
    let groups = match m.moe.routing {
        Routing::SigmoidGrouped { groups, .. } => groups as usize,
        Routing::SoftmaxTopk { .. } => 1,
    };
    let shape = LayerShape { experts, top_k: f64::from(m.moe.top_k), hidden: f64::from(m.hidden) };
    // A layer's loads at the reference volume (what Zepp's modeled choice sees).
    let scaled = |l: &[f64]| -> Vec<f64> {
        let total: f64 = l.iter().sum();
        l.iter().map(|x| x * rows / total.max(1e-9)).collect()
    };
    let eplbs = loads.iter().map(|l| eplb(l, redundant, groups, t)).collect::<Result<Vec<_>, _>>()?;
    let zepps = loads
        .iter()
        .map(|l| {
            let at = scaled(l);
            let cost = zepp_latency(&at, t, shape, cm);
            zepp(l, redundant, t, &cost)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let chosen = if d.placement.policy == PlacementPolicy::Eplb { &eplbs } else { &zepps };
    let replicas: Vec<Vec<Vec<u32>>> = chosen.iter().map(|p| p.gpus.clone()).collect();
    // Compare the policies on layer 0's loads, scaled to the reference volume.
    let l0 = scaled(&loads[0]);
    // The baselines run DeepEP's normal kernels (per-node dedup, serial).
    let latency_none = none(experts, t)
        .ok()
        .map(|p| layer_cost(&route_uniform(&p.gpus, &even_demand(&l0, t)), t, shape, cm, Flows::DEEPEP).latency);
    let pe = eplb(&l0, redundant, groups, t)?;
    let latency_eplb = layer_cost(&route_uniform(&pe.gpus, &even_demand(&l0, t)), t, shape, cm, Flows::DEEPEP).latency;
    let pz = zepp(&l0, redundant, t, &zepp_latency(&l0, t, shape, cm))?;
    let latency_zepp =
        layer_cost(&route_local(&pz.gpus, &even_demand(&l0, t), t, SLACK), t, shape, cm, Flows::ZEPP).latency;
    // Every policy on every layer, for the serving simulator.
    let mean = |xs: &[(f64, f64)]| {
        let n = xs.len().max(1) as f64;
        (xs.iter().map(|x| x.0).sum::<f64>() / n, xs.iter().map(|x| x.1).sum::<f64>() / n)
    };
    let mut stats = Vec::new();
    if let Ok(p) = none(experts, t) {
        let per: Vec<(f64, f64)> =
            loads.iter().map(|l| routing_stats(&route_uniform(&p.gpus, &even_demand(l, t)), t)).collect();
        let (busiest, local) = mean(&per);
        stats.push(PolicyStats { policy: PlacementPolicy::None, busiest, local });
    }
    let mut per = Vec::new();
    for (l, p) in loads.iter().zip(&eplbs) {
        per.push(routing_stats(&route_uniform(&p.gpus, &even_demand(l, t)), t));
    }
    let (busiest, local) = mean(&per);
    stats.push(PolicyStats { policy: PlacementPolicy::Eplb, busiest, local });
    let mut per = Vec::new();
    for (l, p) in loads.iter().zip(&zepps) {
        per.push(routing_stats(&route_local(&p.gpus, &even_demand(l, t), t, SLACK), t));
    }
    let (busiest, local) = mean(&per);
    stats.push(PolicyStats { policy: PlacementPolicy::Zepp, busiest, local });
    Ok(Some(PlacementPlan {
        stats,
        policy: d.placement.policy,
        loads: source,
        redundant_experts: d.placement.redundant_experts,
        replicas,
        slack: SLACK,
        latency_none,
        latency_eplb,
        latency_zepp,
    }))
}
