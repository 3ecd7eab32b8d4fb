//! The Zepp routing cases of `cargo bench --bench routing`, of the GPU
//! check's routing step (scripts/gpu/route_check.cu) and of
//! tests/host_kernels.rs (which include this file by path): DeepSeek-V3 on
//! 4 × 8 H100 (examples/deepseek-v3-h100x32.moe), Zepp's placement with 32
//! redundant replicas on a Zipf(1.1) histogram, at a decode and a prefill
//! volume per GPU, each with the modeled MoE-layer latency (the placement
//! pass's `layer_cost` under Zepp's flows).
#![allow(dead_code)]

use moeforge::codegen::placement::{layer_cost, zepp, zepp_latency, zipf_loads, Flows, LayerShape, Topology};
use moeforge::dsl::{check_paths, FsLoader};
use moeforge::plan::cost::CostModel;
use moeforge::plan::placement::{replicas_of, route_local, row_queues, PlacementPlan, SLACK};
use moeforge::plan::rng::SplitMix64;

pub struct Case {
    pub name: &'static str,
    pub file: &'static str,
    pub slots: Vec<Vec<u32>>,
    pub demand: Vec<Vec<f64>>,
    pub t: Topology,
    pub modeled: f64,
}

pub fn cases() -> Vec<Case> {
    cases_of(&["decode", "prefill"])
}

/// The cases named (`decode`, `prefill`) that built.
pub fn cases_of(files: &[&str]) -> Vec<Case> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/deepseek-v3-h100x32.moe");
    let Ok(c) = check_paths(&[path], &FsLoader) else { return vec![] };
    let d = &c.spec.deploys[0];
    let (m, cl) = (c.spec.model(d.model), c.spec.cluster(d.cluster));
    let cm = CostModel::roofline(m, cl, c.spec.tile_set(d.tiles));
    let t = Topology { nodes: cl.nodes as usize, gpus_per_node: cl.gpus_per_node as usize };
    let (experts, top_k) = (m.moe.experts as usize, m.moe.top_k as usize);
    let shape = LayerShape { experts, top_k: top_k as f64, hidden: f64::from(m.hidden) };
    let mut out = Vec::new();
    for (name, file, tokens) in
        [("decode, 64 tokens/GPU", "decode", 64usize), ("prefill, 4096 tokens/GPU", "prefill", 4096)]
    {
        if !files.contains(&file) {
            continue;
        }
        let rows = (tokens * top_k * t.world()) as f64;
        let loads = zipf_loads(1, experts, rows, 1.1, 0x6d6f65).remove(0);
        let Ok(p) = zepp(&loads, 32, t, &zepp_latency(&loads, t, shape, &cm)) else { continue };
        // Whole counts per source: each source's share of each expert, jittered.
        let mut rng = SplitMix64(9);
        let demand: Vec<Vec<f64>> = (0..t.world())
            .map(|_| {
                loads
                    .iter()
                    .map(|l| (l / t.world() as f64 * (0.5 + (rng.next_u64() % 1000) as f64 / 1000.0)).round())
                    .collect()
            })
            .collect();
        let routing = route_local(&p.gpus, &demand, t, SLACK);
        let modeled = layer_cost(&routing, t, shape, &cm, Flows::ZEPP).latency;
        out.push(Case { name, file, slots: p.gpus, demand, t, modeled });
    }
    out
}

/// A case as the routing kernel takes it: the replica table
/// (`PlacementPlan::replica_table`, `reps` wide, `per` slots per GPU), each
/// source's routed expert ids (its demand's rows, expert by expert,
/// interleaved: routing depends on counts and entry order only), and the
/// physical slot of each under the host routing (`route_local`,
/// `row_queues`).
pub struct Routed {
    pub reps: usize,
    pub per: usize,
    pub table: Vec<i32>,
    pub ids: Vec<Vec<i32>>,
    pub dest: Vec<Vec<i32>>,
}

pub fn routed(k: &Case) -> Routed {
    let experts = k.demand.first().map_or(0, Vec::len);
    let per = k.slots.iter().map(Vec::len).max().unwrap_or(0);
    let reps = replicas_of(&k.slots, experts).iter().map(Vec::len).max().unwrap_or(0);
    let routing = route_local(&k.slots, &k.demand, k.t, SLACK);
    let table = PlacementPlan::replica_table(&k.slots, experts, per, reps);
    let (mut ids, mut dest) = (vec![], vec![]);
    for (src, row) in k.demand.iter().enumerate() {
        let mut left: Vec<u64> = row.iter().map(|&x| x as u64).collect();
        let mut mine = Vec::new();
        while left.iter().any(|&x| x > 0) {
            for (e, x) in left.iter_mut().enumerate() {
                if *x > 0 {
                    *x -= 1;
                    mine.push(e as i32);
                }
            }
        }
        let mut take = row_queues(&routing[src]);
        let slot = |e: i32, g: usize| k.slots[g].iter().position(|&x| x as i32 == e).unwrap_or(0);
        dest.push(
            mine.iter().map(|&e| take[e as usize].next().map_or(-1, |g| (g * per + slot(e, g)) as i32)).collect(),
        );
        ids.push(mine);
    }
    Routed { reps, per, table, ids, dest }
}

/// `case` as scripts/gpu/route_check.cu reads it (whitespace-separated
/// integers after the name line): `world gpus_per_node experts reps
/// slots_per_gpu modeled_layer_ns`, the replica table, then per source its
/// entry count, its ids and their slots.
pub fn text(k: &Case) -> String {
    use std::fmt::Write as _;
    let r = routed(k);
    let experts = k.demand.first().map_or(0, Vec::len);
    let mut s = format!(
        "{}\n{} {} {experts} {} {} {:.0}\n",
        k.name,
        k.t.world(),
        k.t.gpus_per_node,
        r.reps,
        r.per,
        k.modeled * 1e9
    );
    s += &r.table.iter().map(i32::to_string).collect::<Vec<_>>().join(" ");
    s.push('\n');
    for (ids, dest) in r.ids.iter().zip(&r.dest) {
        let _ = write!(s, "{}", ids.len());
        for x in ids.iter().chain(dest) {
            let _ = write!(s, " {x}");
        }
        s.push('\n');
    }
    s
}
