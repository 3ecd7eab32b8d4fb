//! The `moeforge` command line: check, compile and explain `.moe` specs.

use clap::{Parser, Subcommand, ValueEnum};
use moeforge::codegen::{self, NvccMode};
use moeforge::dsl::{self, Checked, Code, Diagnostic, Diagnostics, Failed, FsLoader, Loader, SourceMap};
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
enum Format {
    /// Rendered diagnostics and text.
    #[default]
    Human,
    /// JSON on stdout (diagnostics as an array of objects).
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Check spec files; print every diagnostic; exit non-zero on any error.
    Check {
        /// `.moe` files (with the files they `use`).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Compile one deployment into a bundle directory (written atomically).
    Compile {
        /// A `.moe` file holding a `deploy` block; omitted: the embedded
        /// default (Qwen3-30B-A3B on 1×8 H200).
        file: Option<PathBuf>,
        /// Output directory; replaced atomically if it exists.
        #[arg(short, long, default_value = "bundle")]
        output: PathBuf,
        /// Which deployment, when the file has several.
        #[arg(long)]
        deploy: Option<String>,
        /// `auto` ($MOEFORGE_NVCC, then PATH), `off`, or a path to nvcc.
        #[arg(long, default_value = "auto")]
        nvcc: String,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Print the checked spec (as canonical .moe) and the plan, without writing anything.
    Explain {
        /// A `.moe` file holding a `deploy` block; omitted: the embedded default.
        file: Option<PathBuf>,
        #[arg(long)]
        deploy: Option<String>,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}

/// Prints diagnostics in the chosen format and returns the failure code.
fn fail(sources: &SourceMap, diags: &Diagnostics, format: Format) -> ExitCode {
    match format {
        Format::Human => {
            let color = std::io::stderr().is_terminal();
            eprint!("{}", diags.render(sources, color));
        }
        Format::Json => out(&serde_json::to_string_pretty(&diags.to_json(sources)).unwrap_or_default()),
    }
    ExitCode::from(1)
}

fn out(s: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{s}");
}

fn load(file: &Option<PathBuf>) -> (Result<Checked, Failed>, bool) {
    match file {
        Some(f) => (dsl::check_paths(std::slice::from_ref(f), &FsLoader), false),
        None => {
            let loader = embedded::loader();
            (dsl::check_paths(&[PathBuf::from(embedded::DEFAULT_SPEC)], &loader as &dyn Loader), true)
        }
    }
}

/// Picks the deployment: the named one, or the only one.
fn pick(checked: &Checked, name: Option<&str>) -> Result<dsl::spec::DeployId, Diagnostics> {
    let names: Vec<&str> = checked.spec.deploys.iter().map(|d| d.name.as_str()).collect();
    let d = match name {
        Some(n) => checked.spec.find_deploy(n).ok_or_else(|| {
            Diagnostic::new(Code::NoDeployment, format!("no deployment named `{n}`")).help(format!(
                "deployments in this spec: {}",
                if names.is_empty() { "none".into() } else { names.join(", ") }
            ))
        }),
        None if names.len() == 1 => Ok(dsl::spec::DeployId(0)),
        None if names.is_empty() => Err(Diagnostic::new(Code::NoDeployment, "the spec has no `deploy` block")
            .help("add `deploy NAME { model = … cluster = … tiles = … }` or `use` a file with one")),
        None => Err(Diagnostic::new(Code::NoDeployment, format!("the spec has {} deployments", names.len()))
            .help(format!("choose one with --deploy: {}", names.join(", ")))),
    };
    d.map_err(|x| Diagnostics(vec![x]))
}

fn run(cmd: Command) -> Result<(), ExitCode> {
    match cmd {
        Command::Check { files, format } => match dsl::check_paths(&files, &FsLoader) {
            Ok(c) => {
                let s = &c.spec;
                match format {
                    Format::Human => eprintln!(
                        "ok: {} model(s), {} cluster(s), {} tile set(s), {} deployment(s)",
                        s.models.len(),
                        s.clusters.len(),
                        s.tiles.len(),
                        s.deploys.len()
                    ),
                    Format::Json => out("[]"),
                }
                Ok(())
            }
            Err(f) => Err(fail(&f.sources, &f.diagnostics, format)),
        },
        Command::Explain { file, deploy, format } => {
            let checked = load(&file).0.map_err(|f| fail(&f.sources, &f.diagnostics, format))?;
            let id = pick(&checked, deploy.as_deref()).map_err(|d| fail(&checked.sources, &d, format))?;
            let plan = codegen::plan_deployment(&checked, id).map_err(|d| fail(&checked.sources, &d, format))?;
            match format {
                Format::Human => {
                    out(&format!("// checked spec of deployment `{}`\n", plan.plan().deploy));
                    out(&checked.spec.deployment(id).to_string());
                    out(&format!("// plan\n{}", plan.plan()));
                }
                Format::Json => out(&serde_json::to_string_pretty(&serde_json::json!({
                    "spec": checked.spec.deployment(id),
                    "plan": plan.plan(),
                }))
                .unwrap_or_default()),
            }
            Ok(())
        }
        Command::Compile { file, output, deploy, nvcc, format } => {
            let (checked, embedded) = load(&file);
            let checked = checked.map_err(|f| fail(&f.sources, &f.diagnostics, format))?;
            let id = pick(&checked, deploy.as_deref()).map_err(|d| fail(&checked.sources, &d, format))?;
            let plan = codegen::plan_deployment(&checked, id).map_err(|d| fail(&checked.sources, &d, format))?;
            let mode = match nvcc.as_str() {
                "auto" => NvccMode::Auto,
                "off" => NvccMode::Off,
                p => NvccMode::Path(PathBuf::from(p)),
            };
            let (bundle, summary) = codegen::emit(&checked, id, &plan, &mode).map_err(|e| {
                eprintln!("error: {e}");
                ExitCode::from(1)
            })?;
            bundle.write(&output).map_err(|e| {
                eprintln!("error: cannot write bundle to {}: {e}", output.display());
                ExitCode::from(1)
            })?;
            let p = plan.plan();
            match format {
                Format::Human => {
                    if embedded {
                        eprintln!("note: no spec given; compiling the embedded default {}", embedded::DEFAULT_SPEC);
                    }
                    out(&summary_text(p, &output, &bundle, &summary));
                }
                Format::Json => out(&serde_json::to_string_pretty(&serde_json::json!({
                    "bundle": output,
                    "deploy": p.deploy,
                    "spec_hash": p.spec_hash,
                    "files": bundle.files.keys().collect::<Vec<_>>(),
                    "compiled_with": summary.compiled_with,
                }))
                .unwrap_or_default()),
            }
            Ok(())
        }
    }
}

fn summary_text(
    p: &codegen::Plan,
    dir: &std::path::Path,
    bundle: &codegen::Bundle,
    s: &codegen::EmitSummary,
) -> String {
    let m = &p.model;
    let c = &p.cluster;
    let mem = &p.memory;
    let mut t = String::new();
    t.push_str(&format!("compiled `{}` → {}\n", p.deploy, dir.display()));
    t.push_str(&format!(
        "  model    {}: {:.1}B params ({:.1}B active), {} layers, {} experts top-{}\n",
        m.name,
        m.params_total as f64 / 1e9,
        m.params_active as f64 / 1e9,
        m.layers,
        m.experts,
        m.top_k
    ));
    t.push_str(&format!("  cluster  {}: {}×{} {} ({})\n", c.name, c.nodes, c.gpus_per_node, c.gpu, c.arch.name()));
    t.push_str(&format!(
        "  layout   attention {}, experts {} ({} per GPU)\n",
        p.layout.attention, p.layout.moe, p.layout.max_experts_per_rank
    ));
    let weights: u64 = mem
        .regions
        .iter()
        .filter(|r| !matches!(r.name.as_str(), "comm" | "scratch" | "requests" | "kv_pool"))
        .map(|r| r.bytes)
        .sum();
    let modes: Vec<&str> = mem.modes.iter().map(|m| m.name()).collect();
    t.push_str(&format!(
        "  memory   per GPU: {:.1} GB buffer, {:.1} GB weights, KV for {} tokens (EP); modes [{}]",
        mem.buffer_bytes as f64 / 1e9,
        weights as f64 / 1e9,
        mem.kv.ep.capacity_tokens,
        modes.join(", ")
    ));
    if let Some(tp) = &mem.kv.tp {
        t.push_str(&format!(
            ", TP KV {} tokens, dual-mode overhead {:.2}%",
            tp.capacity_tokens,
            mem.overhead.overhead_fraction * 100.0
        ));
    }
    t.push('\n');
    let kernels: Vec<&str> = p.kernels.iter().map(|k| k.name.as_str()).collect();
    t.push_str(&format!("  kernels  {} for {}", kernels.join(", "), c.arch.name()));
    match (&s.compiled_with, &s.skipped_reason) {
        (Some(v), _) => t.push_str(&format!(", compiled to cubin ({v})\n")),
        (None, Some(why)) => t.push_str(&format!(", not compiled: {why}\n")),
        _ => t.push('\n'),
    }
    t.push_str(&format!("  files    {}\n", bundle.files.keys().cloned().collect::<Vec<_>>().join(" ")));
    t.push_str(&format!("  spec     sha256 {}", p.spec_hash));
    t
}
