//! The emulated device's speed (`--backend emu`) on the transformers
//! fixtures (tests/fixtures/models): one iteration serves the fixture's
//! three prompts to completion (8 tokens each, 8 steps: one prefill, seven
//! decodes) on 4 ranks in EP and 2 in TP (at 4, the tiny DeepSeek-V3's and
//! GLM-5's o_proj rows are 12 wide, below the dense APK's 8-column
//! alignment), every step the bundle's own program
//! and emitted kernels built for the host. Setup (compile, the kernels' host
//! build, which is cached by content, and the weight upload) is outside the
//! timing. Throughput is in generated tokens per second; steps per second
//! are that divided by 3. A second group times the decode dispatch on fixed
//! slots against the routed one on the same bundle.
//!
//!     cargo bench --bench emu

#![allow(clippy::expect_used)]

#[path = "../tests/common/cpu_spec.rs"]
mod cpu_spec;
use cpu_spec::{compile_text, cpu_deployment, imported_block};
#[path = "common/fixtures.rs"]
mod fixtures;
use fixtures::{served, submitted, FAMILIES, NEW, PROMPTS};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use moeforge::plan::memory::Mode;
use moeforge::runtime::device::emu::EmuDevice;
use moeforge::runtime::twin::weights::Checkpoint;
use moeforge::runtime::twin::Twin;
use std::path::Path;
use std::time::Duration;

fn bench(c: &mut Criterion) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
    let cache = tempfile::tempdir().expect("tempdir");
    let mut group = c.benchmark_group("emu: 3 requests × 8 tokens");
    group.throughput(Throughput::Elements((PROMPTS.len() * NEW) as u64));
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(20));
    for family in FAMILIES {
        let dir = root.join(family);
        let ck = Checkpoint::load(&dir).expect("weights");
        for (mode, ranks) in [(Mode::Ep, 4), (Mode::Tp, 2)] {
            let tmp = tempfile::tempdir().expect("tempdir");
            let block = imported_block(&dir);
            let fraction = if block.contains("fp8_e4m3") { 0.6 } else { 0.25 };
            let bundle = compile_text(&cpu_deployment(&block, ranks, fraction), tmp.path());
            if !bundle.plan.memory.modes.contains(&mode) {
                continue;
            }
            group.bench_function(format!("{family} {} P={ranks}", mode.name()), |bch| {
                bch.iter_batched(
                    || {
                        let dev = EmuDevice::start(cache.path()).expect("emulated device");
                        submitted(Twin::on_device(&bundle, &ck, mode, Box::new(dev)).expect("twin on emu"))
                    },
                    served,
                    BatchSize::PerIteration,
                )
            });
        }
    }
    group.finish();
    // A decode step's dispatch on fixed slots (nothing read back: every row
    // to both expert ranks) against the routed one (each source's top-k ids
    // read back per layer), side by side on the same bundle: EP over 2 ranks,
    // top-k 2, where fixed slots apply.
    let mut group = c.benchmark_group("emu: decode dispatch, 3 requests × 8 tokens");
    group.throughput(Throughput::Elements((PROMPTS.len() * NEW) as u64));
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(20));
    let dir = root.join("qwen3-moe");
    let ck = Checkpoint::load(&dir).expect("weights");
    let tmp = tempfile::tempdir().expect("tempdir");
    let bundle = compile_text(&cpu_deployment(&imported_block(&dir), 2, 0.25), tmp.path());
    for route in [false, true] {
        let name = if route { "routed (ids read back)" } else { "fixed slots" };
        group.bench_function(format!("qwen3-moe ep P=2 {name}"), |bch| {
            bch.iter_batched(
                || {
                    let dev = EmuDevice::start(cache.path()).expect("emulated device");
                    let mut t = Twin::on_device(&bundle, &ck, Mode::Ep, Box::new(dev)).expect("twin on emu");
                    t.route_decode_on_device(route);
                    submitted(t)
                },
                served,
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
