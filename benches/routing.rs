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
//!
//! With `MOEFORGE_ROUTING_CASES=DIR` it instead writes the two cases for the
//! GPU check's routing step (`scripts/gpu/route_check.cu`, which runs the
//! bundle's `kernels/zepp_route.cu` on them): `DIR/{decode,prefill}.txt`,
//! each the topology, the replica table, every source's routed expert ids
//! and the physical slot the host routing gives each of them, and the
//! modeled layer (`common/routing_cases.rs`).

#![allow(clippy::print_stdout)] // the side-by-side report is the point

#[path = "common/routing_cases.rs"]
mod routing_cases;

use criterion::{criterion_group, Criterion};
use moeforge::plan::placement::{route_local, SLACK};
use routing_cases::cases;
use std::time::Instant;

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

fn main() -> std::process::ExitCode {
    if let Some(dir) = std::env::var_os("MOEFORGE_ROUTING_CASES") {
        let dir = std::path::PathBuf::from(dir);
        let cases = cases();
        assert!(cases.len() == 2, "examples/deepseek-v3-h100x32.moe did not give both routing cases");
        let write =
            |k: &routing_cases::Case| std::fs::write(dir.join(format!("{}.txt", k.file)), routing_cases::text(k));
        if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| cases.iter().try_for_each(write)) {
            eprintln!("{}: {e}", dir.display());
            return std::process::ExitCode::FAILURE;
        }
        println!("wrote {} routing cases into {}", cases.len(), dir.display());
        return std::process::ExitCode::SUCCESS;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
    std::process::ExitCode::SUCCESS
}
