//! The CPU twin's speed on the transformers fixtures (tests/fixtures/models):
//! one iteration serves the fixture's three prompts to completion (8 tokens
//! each) on 4 simulated ranks, in EP and in TP. Setup (compile, load the
//! weights into every rank's buffer) is outside the timing. Throughput is
//! reported in generated tokens per second.
//!
//!     cargo bench --bench twin

#![allow(clippy::expect_used)]

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use moeforge::codegen::{self, NvccMode};
use moeforge::plan::memory::Mode;
use moeforge::runtime::engine::{Engine, Request};
use moeforge::runtime::load_bundle;
use moeforge::runtime::twin::weights::Checkpoint;
use moeforge::runtime::twin::Twin;
use std::path::Path;

const FAMILIES: [&str; 5] = ["qwen3-moe", "mixtral", "minimax-m2", "deepseek-v3", "glm-5"];
const PROMPTS: [&[u32]; 3] = [&[3, 17, 42, 99, 5, 64, 7], &[120, 1], &[9]];
const NEW: usize = 8;

fn spec(model_block: &str) -> String {
    format!(
        r#"{model_block}
cluster cpu {{ nodes = 1 gpus_per_node = 4
  gpu cpu {{ arch = sm_90a sms = 4 hbm = 256MB hbm_bandwidth = 1TB/s bf16 = 100TFLOP/s smem_per_sm = 228KiB smem_per_block = 227KiB }}
  scale_up shm {{ bandwidth = 10GB/s latency = 1us }} }}
tiles t {{ prefill {{ gate_up {{ block_m = 64 block_n = 64 block_k = 64 stages = 2 }} down {{ block_m = 64 block_n = 64 block_k = 64 stages = 2 }} }}
  decode {{ gate_up {{ block_m = 64 block_n = 64 block_k = 64 stages = 2 }} down {{ block_m = 64 block_n = 64 block_k = 64 stages = 2 }} }} }}
deploy tiny {{ model = tiny cluster = cpu tiles = t slo {{ ttft = 1s tpot = 50ms }}
  workload {{ input = sharegpt output = sharegpt arrival poisson {{ rate = 1req/s }} }}
  switch {{ t_high = 4 t_low = 2 window = 2 cooldown = 0s }} memory_fraction = 0.25 }}
"#
    )
}

fn bench(c: &mut Criterion) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
    let mut group = c.benchmark_group("twin: 3 requests × 8 tokens, 4 ranks");
    group.throughput(Throughput::Elements((PROMPTS.len() * NEW) as u64));
    group.sample_size(20);
    for family in FAMILIES {
        let dir = root.join(family);
        let config = std::fs::read_to_string(dir.join("config.json")).expect("fixture config");
        let imported = moeforge::dsl::hf::import(&config, "tiny").expect("import");
        let text = spec(&moeforge::dsl::hf::to_moe(&imported, "config.json"));
        let checked = moeforge::dsl::check_str("tiny.moe", &text).expect("spec");
        let id = moeforge::dsl::spec::DeployId(0);
        let plan = codegen::plan_deployment(&checked, id).expect("plan");
        let (b, _) = codegen::emit(&checked, id, &plan, &NvccMode::Off).expect("emit");
        let tmp = tempfile::tempdir().expect("tempdir");
        b.write(tmp.path()).expect("write");
        let bundle = load_bundle(tmp.path()).expect("load");
        let ck = Checkpoint::load(&dir).expect("weights");
        for mode in [Mode::Ep, Mode::Tp] {
            group.bench_function(format!("{family} {}", mode.name()), |bch| {
                bch.iter_batched(
                    || {
                        let mut t = Twin::new(&bundle, &ck, mode).expect("twin");
                        for (i, p) in PROMPTS.iter().enumerate() {
                            t.submit(Request::new(i as u64, p.to_vec(), NEW)).expect("submit");
                        }
                        t
                    },
                    |mut t| {
                        while !t.idle() {
                            t.step().expect("step");
                        }
                        t
                    },
                    BatchSize::PerIteration,
                )
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
