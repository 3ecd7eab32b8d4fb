//! A user crate built on moeforge: the deployment is embedded with
//! `moeforge::spec!` (checked while this crate compiles: a bad spec is a
//! compile error pointing into the `.moe` file), compiled into a bundle with
//! `moeforge::compile` at start, and served with the OpenAI-compatible server
//! on the CPU twin.
//!
//! ```sh
//! cargo run --release -- init-weights examples/tiny-qwen3-cpu4.moe --seed 7 -o weights
//! cp tests/fixtures/tokenizer/tokenizer*.json weights/
//! cargo run --release -p moeforge-example-serve-embedded -- weights 8000
//! curl -s localhost:8000/v1/completions -d '{"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}'
//! ```

use moeforge::codegen::NvccMode;
use moeforge::plan::memory::Mode;
use moeforge::runtime::twin::{weights::Checkpoint, Twin};
use moeforge::server::{serve_blocking, text::Text, Config};
use moeforge::EmbeddedSpec;
use std::error::Error;
use std::io::Write;
use std::path::PathBuf;

/// The deployment, relative to this file.
static SPEC: &EmbeddedSpec = moeforge::spec!("../../tiny-qwen3-cpu4.moe");

fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let weights = PathBuf::from(args.next().ok_or("usage: moeforge-example-serve-embedded WEIGHTS_DIR [PORT]")?);
    let port: u16 = args.next().map_or(Ok(8000), |p| p.parse()).map_err(|e| format!("PORT: {e}"))?;
    let deploy = &SPEC.deploys[0];
    let model = SPEC.model(deploy.model);

    // Compile: the library form of `moeforge compile` (no nvcc: the twin runs the plan).
    let opts = moeforge::compile::Options { nvcc: NvccMode::Off, cache: None, ..Default::default() };
    let compiled = moeforge::compile(SPEC, &opts)?;
    let dir = std::env::temp_dir().join(format!("moeforge-embedded-{}", std::process::id()));
    compiled.bundle.write(&dir)?;
    let bundle = moeforge::runtime::load_bundle(&dir)?;

    // Serve: the twin under the deployment's switch policy (`t_high = auto`
    // at the cost model's crossover: the CPU twin has no decode graphs to time).
    let ck = Checkpoint::load(&weights)?;
    let twin = Twin::new(&bundle, &ck, Mode::Ep)?;
    let modeled = |context| moeforge::runtime::sim::Bench::new(&bundle.spec, &bundle.plan)?.decode_costs(context);
    let context = moeforge::runtime::policy::calibration_context(&deploy.workload);
    let (driver, _) = moeforge::runtime::policy::driver(
        Some(&deploy.switch),
        &bundle.plan.memory.modes,
        true,
        twin,
        context,
        modeled,
    )?;
    let cfg = Config { model: model.name.clone(), aliases: vec![], max_queue: 256, text: Text::load(&weights)? };
    let name = deploy.name.clone();
    serve_blocking(&format!("127.0.0.1:{port}"), driver, cfg, |addr| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{name}: listening on http://{addr}");
    })?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
