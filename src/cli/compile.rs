//! `moeforge compile [FILE] -o DIR`: one deployment into a bundle, written
//! atomically; prints what was planned and emitted.

use super::{error, fail, load, out, pick, read_profile, warn, Format};
use indicatif::{ProgressBar, ProgressStyle};
use moeforge::codegen::{self, NvccMode};
use moeforge::compile::{CompileError, Compiled, Options};
use moeforge::dsl::{Checked, Diagnostics};
use moeforge::embedded;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A `.moe` file holding a `deploy` block; omitted: the embedded
    /// default (Qwen3-30B-A3B on 1×8 H200).
    file: Option<PathBuf>,
    /// Output directory, written atomically; an existing one is replaced only when it holds
    /// nothing but this command's outputs (anything else there is refused).
    #[arg(short, long, default_value = "bundle")]
    output: PathBuf,
    /// Which deployment, when the file has several.
    #[arg(long)]
    deploy: Option<String>,
    /// `auto` ($MOEFORGE_NVCC, then PATH), `off`, or a path to nvcc.
    #[arg(long, default_value = "auto", value_parser = parse_nvcc)]
    nvcc: NvccMode,
    /// Run nvcc for every kernel, bypassing the kernel cache
    /// ($MOEFORGE_CACHE_DIR, else $XDG_CACHE_HOME/moeforge/kernels, else ~/.cache/moeforge/kernels).
    #[arg(long)]
    no_cache: bool,
    /// A measured latency profile (JSON samples) that overrides the roofline cost model.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Measured expert loads (SGLang expert statistics JSON) for the placement pass.
    #[arg(long)]
    loads: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t)]
    format: Format,
}

pub fn parse_nvcc(s: &str) -> Result<NvccMode, String> {
    Ok(match s {
        "auto" => NvccMode::Auto,
        "off" => NvccMode::Off,
        "" => return Err("give `auto`, `off` or a path to nvcc".into()),
        p => NvccMode::Path(PathBuf::from(p)),
    })
}

pub fn run(a: Args) -> Result<(), ExitCode> {
    let (checked, embedded) = load(&a.file);
    let checked = checked.map_err(|f| fail(&f.sources, &f.diagnostics, a.format))?;
    let id = pick(&checked, a.deploy.as_deref()).map_err(|d| fail(&checked.sources, &d, a.format))?;
    // The spec's warnings first (planning may still fail), the planner's after.
    let spec_warnings = checked.warnings_for(id).0.len();
    warn(&checked.sources, &checked.warnings_for(id), a.format);
    let mut plan = codegen::PlanOptions { profile: read_profile(&a.profile)?, ..Default::default() };
    if let Some(p) = &a.loads {
        let text = std::fs::read_to_string(p).map_err(|e| error(format!("{}: {e}", p.display()), ""))?;
        let parsed = codegen::placement::load_sglang(&text).map_err(|e| {
            error(format!("{}: {e}", p.display()), "expected {\"logical_count\": [[count per expert] per MoE layer]}")
        })?;
        plan.loads = Some((parsed, moeforge::plan::bundle::sha256_hex(text.as_bytes())));
    }
    let Compiled { bundle, plan, summary, warnings } =
        build(&checked, plan, a.deploy.clone(), &a.nvcc, a.no_cache, a.format)?;
    warn(&checked.sources, &Diagnostics(warnings.0[spec_warnings.min(warnings.0.len())..].to_vec()), a.format);
    if let Some(w) = &summary.cache_warning {
        eprintln!("warning: {w} (the bundle is complete; later compiles run nvcc again)");
    }
    bundle.write(&a.output).map_err(|e| error(format!("cannot write bundle to {}: {e}", a.output.display()), ""))?;
    let p = plan.plan();
    match a.format {
        Format::Human => {
            if embedded {
                eprintln!("note: no spec given; compiling the embedded default {}", embedded::DEFAULT_SPEC);
            }
            out(&summary_text(p, &a.output, &bundle, &summary));
        }
        Format::Json => out(&serde_json::to_string_pretty(&serde_json::json!({
            "bundle": a.output,
            "deploy": p.deploy,
            "spec_hash": p.spec_hash,
            "files": bundle.files.keys().collect::<Vec<_>>(),
            "compiled_with": summary.compiled_with,
            "warnings": warnings.to_json(&checked.sources),
        }))
        .unwrap_or_default()),
    }
    Ok(())
}

/// Compiles through the library API: kernels through the cache unless
/// `--no-cache`, with a progress bar on nvcc builds when stderr is a terminal.
pub fn build(
    checked: &Checked,
    plan: codegen::PlanOptions,
    deploy: Option<String>,
    nvcc: &NvccMode,
    no_cache: bool,
    format: Format,
) -> Result<Compiled, ExitCode> {
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = ProgressBar::new(0);
        b.set_style(
            ProgressStyle::with_template("{spinner} nvcc [{bar:20}] {pos}/{len} {msg} ({elapsed})")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        b
    });
    let progress = |p: codegen::Progress<'_>| {
        let Some(b) = &bar else { return };
        match p {
            codegen::Progress::Start { kernel, total, .. } => {
                b.set_length(total as u64);
                b.set_message(kernel.to_string());
                b.enable_steady_tick(std::time::Duration::from_millis(100));
            }
            codegen::Progress::Done { cached, kernel } => {
                if cached {
                    b.set_message(format!("{kernel} (cached)"));
                }
                b.inc(1);
            }
        }
    };
    let opts = Options {
        deploy,
        plan,
        nvcc: nvcc.clone(),
        cache: if no_cache { None } else { codegen::KernelCache::user() },
        progress: Some(&progress),
    };
    let r = moeforge::compile(checked, &opts);
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    r.map_err(|e| match e {
        CompileError::Spec { diagnostics, .. } => fail(&checked.sources, &diagnostics, format),
        CompileError::Emit(e) => error(e, ""),
    })
}

fn summary_text(
    p: &codegen::Plan,
    dir: &std::path::Path,
    bundle: &codegen::Bundle,
    s: &codegen::EmitSummary,
) -> String {
    let mut t = format!("compiled `{}` → {}\n{}", p.deploy, dir.display(), p.summary());
    let kernels: Vec<&str> = p.kernels.iter().map(|k| k.name.as_str()).collect();
    t.push_str(&format!("  kernels  {} for {}", kernels.join(", "), p.cluster.arch.name()));
    match (&s.compiled_with, &s.skipped_reason) {
        (Some(v), _) if s.cache_hits > 0 => t.push_str(&format!(
            ", compiled to cubin ({v}; {} from the kernel cache, {} by nvcc)\n",
            s.cache_hits, s.nvcc_runs
        )),
        (Some(v), _) => t.push_str(&format!(", compiled to cubin ({v})\n")),
        (None, Some(why)) => t.push_str(&format!(", not compiled: {why}\n")),
        _ => t.push('\n'),
    }
    t.push_str(&format!("  files    {}\n", bundle.files.keys().cloned().collect::<Vec<_>>().join(" ")));
    t.push_str(&format!("  spec     sha256 {}", p.spec_hash));
    t
}
