//! The tiny CPU deployment the twin's tests and benchmarks put a model in
//! (P simulated ranks, a dual-mode switch policy), and compiling it into a
//! bundle directory. Shared by tests/twin.rs, tests/hf_twin.rs and
//! benches/twin.rs (which includes this file by path).
#![allow(dead_code, clippy::panic, clippy::unwrap_used)]

use moeforge::codegen::{self, NvccMode};
use moeforge::plan::bundle::LoadedBundle;
use std::path::Path;

/// `model_block` (a model named `tiny`) on `ranks` CPU ranks. fp8 models
/// get 128-deep stages (one scale block of K each).
pub fn cpu_deployment(model_block: &str, ranks: u32, memory_fraction: f64) -> String {
    cpu_cluster_deployment(model_block, 1, ranks, memory_fraction, "")
}

/// [`cpu_deployment`] on `nodes` × `per_node` ranks, with `extra` (say a
/// `placement` block) added to the deployment.
pub fn cpu_cluster_deployment(
    model_block: &str,
    nodes: u32,
    per_node: u32,
    memory_fraction: f64,
    extra: &str,
) -> String {
    let k = if model_block.contains("fp8_e4m3") { 128 } else { 64 };
    let scale_out = if nodes > 1 { "scale_out net { nics_per_node = 2 bandwidth = 10Gb/s latency = 5us }" } else { "" };
    format!(
        r#"{model_block}
cluster cpu {{ nodes = {nodes} gpus_per_node = {per_node}
  gpu cpu {{ arch = sm_90a sms = 4 hbm = 256MB hbm_bandwidth = 1TB/s bf16 = 100TFLOP/s smem_per_sm = 228KiB smem_per_block = 227KiB }}
  scale_up shm {{ bandwidth = 10GB/s latency = 1us }} {scale_out} }}
tiles t {{ prefill {{ gate_up {{ block_m = 64 block_n = 64 block_k = {k} stages = 2 }} down {{ block_m = 64 block_n = 64 block_k = {k} stages = 2 }} }}
  decode {{ gate_up {{ block_m = 64 block_n = 64 block_k = {k} stages = 2 }} down {{ block_m = 64 block_n = 64 block_k = {k} stages = 2 }} }} }}
deploy tiny {{ model = tiny cluster = cpu tiles = t slo {{ ttft = 1s tpot = 50ms }}
  workload {{ input = sharegpt output = sharegpt arrival poisson {{ rate = 1req/s }} }}
  switch {{ t_high = 4 t_low = 2 window = 2 cooldown = 0s }} {extra} memory_fraction = {memory_fraction} }}
"#
    )
}

/// The model block `import-hf` writes for a checkpoint directory's config.json, named `tiny`.
pub fn imported_block(dir: &Path) -> String {
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let imported = moeforge::dsl::hf::import(&config, "tiny").unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    moeforge::dsl::hf::to_moe(&imported, "config.json")
}

/// Checks, plans and emits `text`'s first deployment into `out`; loads it back.
pub fn compile_text(text: &str, out: &Path) -> LoadedBundle {
    let checked = moeforge::dsl::check_str("tiny.moe", text).unwrap_or_else(|f| panic!("{}", f.render(false)));
    let id = moeforge::dsl::spec::DeployId(0);
    let plan =
        codegen::plan_deployment(&checked, id).unwrap_or_else(|d| panic!("{}", d.render(&checked.sources, false)));
    let (b, _) = codegen::emit(&checked, id, &plan, &NvccMode::Off).unwrap();
    b.write(out).unwrap();
    moeforge::runtime::load_bundle(out).unwrap()
}
