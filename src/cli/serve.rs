//! `moeforge serve BUNDLE --weights DIR`: the OpenAI-compatible HTTP server
//! (`moeforge-server`) over a backend's engine, under the spec's switch
//! policy. Prints `listening on http://ADDR` once bound; Ctrl-C or SIGTERM
//! stops accepting and drains what is in flight.

use super::run::{driver, load_dir, prepare, startup_lines, swap_policy, Backend, GraphArgs, Start, SwapArgs};
use super::{error, out};
use moeforge::plan::bundle::LoadedBundle;
use moeforge::plan::memory::Mode;
use moeforge_server::text::Text;
use moeforge_server::{serve_blocking, Config};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A bundle directory written by `moeforge compile`.
    bundle: PathBuf,
    #[command(flatten)]
    opts: Options,
}

/// Everything but the bundle (a deployable binary carries its own).
#[derive(clap::Args)]
pub struct Options {
    /// Execution backend.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: Backend,
    /// Checkpoint directory: *.safetensors, and optionally tokenizer.json
    /// and tokenizer_config.json (text prompts and chat).
    #[arg(long)]
    weights: PathBuf,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind (0: any free port; the bound address is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Requests held (running and waiting) beyond which new ones get 429.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Starting mode (when the plan holds it).
    #[arg(long, value_enum, default_value = "ep")]
    start: Start,
    /// The model id clients address (default: the model's name).
    #[arg(long)]
    served_model_name: Option<String>,
    #[command(flatten)]
    graphs: GraphArgs,
    #[command(flatten)]
    swap: SwapArgs,
}

pub fn run(a: Args) -> Result<(), ExitCode> {
    let bundle = load_dir(&a.bundle)?;
    serve_bundle(&a.opts, &bundle)
}

/// `serve` on a loaded bundle.
pub fn serve_bundle(a: &Options, bundle: &LoadedBundle) -> Result<(), ExitCode> {
    let start = match a.start {
        Start::Tp => Mode::Tp,
        Start::Ep => Mode::Ep,
    };
    let swap = swap_policy(&a.swap, bundle)?;
    a.graphs.check(a.backend)?;
    let ck = prepare(bundle, &a.weights, a.backend)?;
    let text = Text::load(&a.weights).map_err(|e| {
        error(e, "tokenizer.json must be a Hugging Face tokenizers file (or absent: token-id prompts only)")
    })?;
    // Serving's concurrency is not known before it: Moebius's cap on a GPU,
    // what the emulated device records in seconds there (GraphArgs).
    let capture = match a.backend {
        Backend::Cuda => 256,
        Backend::Emu => 8,
        Backend::Cpu => 0,
    };
    let (driver, startup) = driver(bundle, &ck, a.backend, start, true, (&a.graphs, capture), |engine| {
        if let Some(policy) = swap {
            engine.set_swap_policy(policy);
        }
    })?;
    // Printed under the serving line, once the server is bound.
    let device = driver.engine.device_description();
    let startup = startup_lines(&startup, &driver);
    let name = bundle.plan.model.name.clone();
    let deploy = bundle.spec.deploys.first().map(|d| d.name.clone());
    let model = a.served_model_name.clone().unwrap_or_else(|| name.clone());
    let aliases = [Some(name), deploy].into_iter().flatten().filter(|n| *n != model).collect();
    let tokenizer = if text.is_some() { "tokenizer.json" } else { "no tokenizer: token-id prompts only" };
    let plan = &bundle.plan.memory;
    let cfg = Config { model: model.clone(), aliases, max_queue: a.max_queue, text };
    let addr = format!("{}:{}", a.host, a.port);
    let modes = plan.modes.iter().map(|m| m.name()).collect::<Vec<_>>().join(", ");
    let group = plan.group;
    let backend = a.backend.describe();
    serve_blocking(&addr, driver, cfg, |bound| {
        out(&format!("serving {model} on the {backend} ({group} ranks, modes [{modes}], {tokenizer})"));
        if let Some(d) = &device {
            out(&format!("device: {d}"));
        }
        for line in &startup {
            out(line);
        }
        out(&format!("listening on http://{bound}"));
    })
    .map_err(|e| error(format!("{addr}: {e}"), "is the port in use? --port 0 picks a free one"))
}
