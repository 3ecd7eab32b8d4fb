//! Zepp's run-time routing (`moeforge_plan::placement::route_local`) per
//! MoE layer, on the host as the runtime runs it every iteration, against
//! the paper's budget: routing, swap planning and metadata together take
//! about 5% of an iteration (Zepp §5). Prints, for DeepSeek-V3 on 4 × 8
//! H100 (examples/deepseek-v3-h100x32.moe, Zepp with 32 redundant replicas),
//! the median routing time per layer beside the modeled MoE-layer latency
//! (the placement pass's `layer_cost` under Zepp's flows) and their ratio,
//! at a decode and a prefill volume per GPU.
//!
//! `cargo bench --bench routing`

#![allow(clippy::print_stdout)] // the side-by-side report is the point

use criterion::{criterion_group, criterion_main, Criterion};
use moeforge::codegen::placement::{layer_cost, zepp, zepp_latency, zipf_loads, Flows, LayerShape, Topology};
use moeforge::dsl::{check_paths, FsLoader};
use moeforge::plan::cost::CostModel;
use moeforge::plan::placement::{route_local, SLACK};
use moeforge::plan::rng::SplitMix64;
use std::time::Instant;

struct Case {
    name: &'static str,
    slots: Vec<Vec<u32>>,
    demand: Vec<Vec<f64>>,
    t: Topology,
    modeled: f64,
}

fn cases() -> Vec<Case> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/deepseek-v3-h100x32.moe");
    let Ok(c) = check_paths(&[path], &FsLoader) else { return vec![] };
    let d = &c.spec.deploys[0];
    let (m, cl) = (c.spec.model(d.model), c.spec.cluster(d.cluster));
    let cm = CostModel::roofline(m, cl, c.spec.tile_set(d.tiles));
    let t = Topology { nodes: cl.nodes as usize, gpus_per_node: cl.gpus_per_node as usize };
    let (experts, top_k) = (m.moe.experts as usize, m.moe.top_k as usize);
    let shape = LayerShape { experts, top_k: top_k as f64, hidden: f64::from(m.hidden) };
    let mut out = Vec::new();
    for (name, tokens) in [("decode, 64 tokens/GPU", 64usize), ("prefill, 4096 tokens/GPU", 4096)] {
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
        out.push(Case { name, slots: p.gpus, demand, t, modeled });
    }
    out
}

fn bench(c: &mut Criterion) {
    let cases = cases();
    assert!(!cases.is_empty(), "examples/deepseek-v3-h100x32.moe did not load");
    let mut group = c.benchmark_group("zepp routing per MoE layer");
    for k in &cases {
        group.bench_function(k.name, |b| b.iter(|| route_local(&k.slots, &k.demand, k.t, SLACK)));
    }
    group.finish();
    // Side by side in this run: median of 31 timed calls against the model.
    println!("\nrouting on the host vs the modeled MoE layer (Zepp's budget: ~5% of an iteration)");
    for k in &cases {
        let mut times: Vec<f64> = (0..31)
            .map(|_| {
                let t0 = Instant::now();
                std::hint::black_box(route_local(&k.slots, &k.demand, k.t, SLACK));
                t0.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        println!(
            "  {:<26} routing {:>9.1} us   modeled layer {:>8.1} us   ratio {:.2}",
            k.name,
            median * 1e6,
            k.modeled * 1e6,
            median / k.modeled
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
