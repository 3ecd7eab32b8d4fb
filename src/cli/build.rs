//! `moeforge build [FILE] -o DIR`: one deployment into a deployable
//! directory: `bin/<deploy>` (this executable with the bundle embedded: it
//! runs and serves with nothing beside it) and `launch/` (a Slurm batch
//! script and a Kubernetes manifest sized from the cluster block, with a
//! README each). Written atomically.

use super::compile::{build, parse_nvcc};
use super::{error, fail, load, out, pick, warn, Format};
use moeforge::codegen::{self, NvccMode};
use moeforge::compile::Compiled;
use moeforge::deploy;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A `.moe` file holding a `deploy` block; omitted: the embedded default.
    file: Option<PathBuf>,
    /// Output directory, written atomically; an existing one is replaced only when it holds
    /// nothing but this command's outputs (anything else there is refused).
    #[arg(short, long)]
    output: PathBuf,
    /// Which deployment, when the file has several.
    #[arg(long)]
    deploy: Option<String>,
    /// `auto` ($MOEFORGE_NVCC, then PATH), `off`, or a path to nvcc.
    #[arg(long, default_value = "auto", value_parser = parse_nvcc)]
    nvcc: NvccMode,
    /// Run nvcc for every kernel, bypassing the kernel cache.
    #[arg(long)]
    no_cache: bool,
}

pub fn run(a: Args) -> Result<(), ExitCode> {
    let (checked, embedded) = load(&a.file);
    let checked = checked.map_err(|f| fail(&f.sources, &f.diagnostics, Format::Human))?;
    let id = pick(&checked, a.deploy.as_deref()).map_err(|d| fail(&checked.sources, &d, Format::Human))?;
    if embedded {
        eprintln!("note: no spec given; building the embedded default {}", moeforge::embedded::DEFAULT_SPEC);
    }
    let name = checked.spec.deploy(id).name.clone();
    let Compiled { bundle, plan, summary, warnings } =
        build(&checked, codegen::PlanOptions::default(), Some(name.clone()), &a.nvcc, a.no_cache, Format::Human)?;
    warn(&checked.sources, &warnings, Format::Human);
    let exe_path = std::env::current_exe().map_err(|e| error(format!("cannot find this executable: {e}"), ""))?;
    let exe = std::fs::read(&exe_path).map_err(|e| error(format!("{}: {e}", exe_path.display()), ""))?;
    let binary = deploy::attach(&exe, &bundle);
    let bin = format!("bin/{name}");
    let p = plan.plan();
    let mut files: Vec<(String, Vec<u8>)> = vec![(bin.clone(), binary)];
    files.extend(deploy::launchers(p, &name).into_iter().map(|(f, t)| (f, t.into_bytes())));
    moeforge::plan::bundle::write_dir_exec(
        &a.output,
        files.iter().map(|(f, b)| (f.as_str(), b.as_slice())),
        &[bin.as_str()],
        &[],
    )
    .map_err(|e| error(format!("cannot write {}: {e}", a.output.display()), ""))?;
    let c = &p.cluster;
    let kernels = match &summary.compiled_with {
        Some(v) => format!("kernels compiled to cubin ({v})"),
        None => format!("kernels as CUDA source only ({})", summary.skipped_reason.clone().unwrap_or_default()),
    };
    out(&format!("built `{name}` → {}", a.output.display()));
    out(&format!(
        "  bin      {bin}: {:.1} MB, the bundle embedded ({} files, {kernels})",
        files[0].1.len() as f64 / 1e6,
        bundle.files.len()
    ));
    out(&format!(
        "  launch   slurm.sbatch and k8s.yaml for {} node(s) × {} {} ({}), README each",
        c.nodes,
        c.gpus_per_node,
        c.gpu,
        c.arch.name()
    ));
    out(&format!("  spec     sha256 {}", p.spec_hash));
    Ok(())
}
