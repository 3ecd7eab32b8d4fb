//! The CPU twin's speed on the transformers fixtures (tests/fixtures/models):
//! one iteration serves the fixture's three prompts to completion (8 tokens
//! each) on 4 simulated ranks, in EP and in TP. Setup (compile, load the
//! weights into every rank's buffer) is outside the timing. Throughput is
//! reported in generated tokens per second.
//!
//!     cargo bench --bench twin

#![allow(clippy::expect_used)]

#[path = "../tests/common/cpu_spec.rs"]
mod cpu_spec;
use cpu_spec::{compile_text, cpu_deployment, imported_block};
#[path = "common/fixtures.rs"]
mod fixtures;
use fixtures::{served, submitted, FAMILIES, NEW, PROMPTS};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use moeforge::plan::memory::Mode;
use moeforge::runtime::twin::weights::Checkpoint;
use moeforge::runtime::twin::Twin;
use std::path::Path;

fn bench(c: &mut Criterion) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
    let mut group = c.benchmark_group("twin: 3 requests × 8 tokens, 4 ranks");
    group.throughput(Throughput::Elements((PROMPTS.len() * NEW) as u64));
    group.sample_size(20);
    for family in FAMILIES {
        let dir = root.join(family);
        let tmp = tempfile::tempdir().expect("tempdir");
        let block = imported_block(&dir);
        let fraction = if block.contains("fp8_e4m3") { 0.6 } else { 0.25 };
        let bundle = compile_text(&cpu_deployment(&block, 4, fraction), tmp.path());
        let ck = Checkpoint::load(&dir).expect("weights");
        for mode in [Mode::Ep, Mode::Tp].into_iter().filter(|m| bundle.plan.memory.modes.contains(m)) {
            group.bench_function(format!("{family} {}", mode.name()), |bch| {
                bch.iter_batched(
                    || submitted(Twin::new(&bundle, &ck, mode).expect("twin")),
                    served,
                    BatchSize::PerIteration,
                )
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
