//! The `moeforge` commands, one module each, and what they share: argument
//! types, loading a spec (a file or the embedded default), picking a
//! deployment, and printing diagnostics and errors in one format.

mod build;
mod check;
mod compile;
mod deployed;
mod explain;
mod import_hf;
mod init_weights;
mod run;
mod serve;
mod simulate;

use clap::{Parser, Subcommand, ValueEnum};
use moeforge::dsl::{self, Checked, Diagnostics, Failed, FsLoader, Loader, SourceMap};
use moeforge::embedded;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "moeforge",
    version,
    about = "Compile a MoE model + cluster + tiles spec into a specialized serving bundle"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Default, ValueEnum)]
pub enum Format {
    /// Rendered diagnostics and text.
    #[default]
    Human,
    /// JSON on stdout (diagnostics as an array of objects).
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Check spec files; print every diagnostic; exit non-zero on any error.
    Check(check::Args),
    /// Compile one deployment into a bundle directory (written atomically).
    Compile(compile::Args),
    /// Build one deployment into a directory: a self-contained executable with the
    /// bundle embedded (bin/DEPLOY) and Slurm and Kubernetes launchers (launch/).
    Build(build::Args),
    /// Print the checked spec (as canonical .moe) and the plan, without writing anything.
    Explain(explain::Args),
    /// Write a `model` block from a Hugging Face config.json (or a checkpoint directory).
    ImportHf(import_hf::Args),
    /// Write random bf16 weights for a spec's model in Hugging Face safetensors names.
    InitWeights(init_weights::Args),
    /// Serve prompts from a bundle: prints tokens, switch events and per-step timings.
    Run(run::Args),
    /// Serve a bundle over HTTP: the OpenAI completions and chat API, /health, /metrics.
    Serve(serve::Args),
    /// Simulate serving a deployment under its workload: every system on the
    /// same cost model; writes goodput.csv, attainment.csv and attainment.svg.
    Simulate(simulate::Args),
}

pub fn main() -> ExitCode {
    // A deployable binary (`moeforge build`) carries its bundle: its CLI is the deployment's.
    match moeforge::deploy::embedded() {
        Ok(Some(bundle)) => {
            let exe = std::env::current_exe().unwrap_or_default();
            return deployed::main(bundle, exe);
        }
        Ok(None) => {}
        Err(e) => return error(e, "rebuild it with `moeforge build`"),
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check(a) => check::run(a),
        Command::Compile(a) => compile::run(a),
        Command::Build(a) => build::run(a),
        Command::Explain(a) => explain::run(a),
        Command::ImportHf(a) => import_hf::run(a),
        Command::InitWeights(a) => init_weights::run(a),
        Command::Run(a) => run::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Simulate(a) => simulate::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}

/// Prints diagnostics in the chosen format and returns the failure code.
pub fn fail(sources: &SourceMap, diags: &Diagnostics, format: Format) -> ExitCode {
    match format {
        Format::Human => {
            let color = std::io::stderr().is_terminal();
            eprint!("{}", diags.render(sources, color));
        }
        Format::Json => out(&serde_json::to_string_pretty(&diags.to_json(sources)).unwrap_or_default()),
    }
    ExitCode::from(1)
}

/// Prints warnings to stderr (human format only: JSON callers get them in
/// their JSON).
pub fn warn(sources: &SourceMap, warnings: &Diagnostics, format: Format) {
    if !warnings.is_empty() && matches!(format, Format::Human) {
        eprint!("{}", warnings.render(sources, std::io::stderr().is_terminal()));
    }
}

pub fn out(s: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{s}");
}

/// Checks a spec file, or the embedded default when none is given (then
/// the second value is true).
pub fn load(file: &Option<PathBuf>) -> (Result<Checked, Failed>, bool) {
    match file {
        Some(f) => (dsl::check_paths(std::slice::from_ref(f), &FsLoader), false),
        None => {
            let loader = embedded::loader();
            (dsl::check_paths(&[PathBuf::from(embedded::DEFAULT_SPEC)], &loader as &dyn Loader), true)
        }
    }
}

/// Picks the deployment: the named one, or the only one.
pub fn pick(checked: &Checked, name: Option<&str>) -> Result<dsl::spec::DeployId, Diagnostics> {
    moeforge::compile::deployment(checked, name)
}

/// An error that is not a spec diagnostic: printed with its hint, exit 1.
pub fn error(msg: impl std::fmt::Display, help: &str) -> ExitCode {
    eprintln!("error: {msg}");
    if !help.is_empty() {
        eprintln!("  help: {help}");
    }
    ExitCode::from(1)
}

/// Reads a measured latency profile (`--profile`) and its digest.
pub fn read_profile(path: &Option<PathBuf>) -> Result<Option<(moeforge::plan::cost::Profile, String)>, ExitCode> {
    let Some(p) = path else { return Ok(None) };
    let bytes = std::fs::read(p).map_err(|e| error(format!("{}: {e}", p.display()), ""))?;
    let parsed: moeforge::plan::cost::Profile = serde_json::from_slice(&bytes).map_err(|e| {
        error(
            format!("{}: not a latency profile: {e}", p.display()),
            "a profile is {\"samples\": [{\"component\": \"moe\", \"x\": 12, \"s\": 1, \"t\": 3.1e-5}, …]}",
        )
    })?;
    Ok(Some((parsed, moeforge::plan::bundle::sha256_hex(&bytes))))
}
