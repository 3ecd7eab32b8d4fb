//! The command line of a deployable binary (`moeforge build`): the bundle
//! is the one embedded in the executable, so `run` and `serve` take no
//! bundle argument; `info` says what the bundle is and whether this machine
//! fits it; `extract` writes the bundle out.

use super::run::{self, run_bundle};
use super::serve::{self, serve_bundle};
use super::{error, out};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use moeforge::plan::bundle::{load_bundle_files, Bundle, LoadedBundle};
use moeforge::runtime::machine;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(about = "A moeforge deployment: its bundle (plan, kernels, cubins) is inside this executable", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the deployment's plan and whether this machine fits it (exit 1 if not).
    Info,
    /// Serve prompts: prints tokens, switch events and per-step timings.
    Run(run::Options),
    /// Serve over HTTP: the OpenAI completions and chat API, /health, /metrics.
    Serve(serve::Options),
    /// Write the embedded bundle out as a bundle directory.
    Extract {
        #[arg(short, long)]
        output: PathBuf,
    },
}

/// Runs the deployment's CLI over the `bundle` embedded in `exe`.
pub fn main(bundle: Bundle, exe: PathBuf) -> ExitCode {
    let result = (|| {
        let loaded = load_bundle_files(&bundle, &exe).map_err(|e| {
            error(
                format!("the bundle embedded in {} is damaged: {e}", exe.display()),
                "rebuild it with `moeforge build`",
            )
        })?;
        let name = loaded.plan.deploy.clone();
        let matches = Cli::command().name(name).get_matches();
        let cli = Cli::from_arg_matches(&matches).map_err(|e| {
            let _ = e.print();
            ExitCode::from(2)
        })?;
        match cli.command {
            Command::Info => info(&loaded),
            Command::Run(a) => {
                rendezvous(&loaded)?;
                run_bundle(&a, &loaded)
            }
            Command::Serve(a) => {
                rendezvous(&loaded)?;
                serve_bundle(&a, &loaded)
            }
            Command::Extract { output } => bundle
                .write(&output)
                .map_err(|e| error(format!("cannot write {}: {e}", output.display()), ""))
                .map(|()| out(&format!("wrote the bundle of `{}` to {}", loaded.plan.deploy, output.display()))),
        }
    })();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}

/// The launcher's rank environment must describe this bundle's cluster.
fn rendezvous(b: &LoadedBundle) -> Result<(), ExitCode> {
    let nodes = b.plan.cluster.nodes;
    if let Ok(n) = std::env::var("MOEFORGE_NODES") {
        if n.trim().parse::<u32>().ok() != Some(nodes) {
            return Err(error(
                format!(
                    "MOEFORGE_NODES is {n}, but the bundle's cluster `{}` has {nodes} node(s)",
                    b.plan.cluster.name
                ),
                "launch with the manifests `moeforge build` wrote beside the binary",
            ));
        }
    }
    Ok(())
}

fn info(b: &LoadedBundle) -> Result<(), ExitCode> {
    let p = &b.plan;
    out(&format!("deployment `{}` (bundle format {}, {})", p.deploy, b.manifest.format_version, b.manifest.tool));
    out(p.summary().trim_end());
    let host = machine::Host::probe();
    out(&format!("  gpus     {}", machine::describe_gpus(p, &host)));
    match machine::check_cpu(p, &host) {
        Ok(()) => {
            out("  machine  fits the cpu backend");
            Ok(())
        }
        Err(e) => Err(error(format!("this machine does not fit the bundle: {e}"), "")),
    }
}
