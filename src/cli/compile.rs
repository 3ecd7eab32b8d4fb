//! `moeforge compile [FILE] -o DIR`: one deployment into a bundle, written
//! atomically; prints what was planned and emitted.

use super::{error, fail, load, out, pick, read_profile, warn, Format};
use moeforge::codegen::{self, NvccMode};
use moeforge::embedded;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
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
    #[arg(long, default_value = "auto", value_parser = parse_nvcc)]
    nvcc: NvccMode,
    /// A measured latency profile (JSON samples) that overrides the roofline cost model.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Measured expert loads (SGLang expert statistics JSON) for the placement pass.
    #[arg(long)]
    loads: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t)]
    format: Format,
}

fn parse_nvcc(s: &str) -> Result<NvccMode, String> {
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
    let mut warnings = checked.warnings_for(id);
    warn(&checked.sources, &warnings, a.format);
    let mut opts = codegen::PlanOptions { profile: read_profile(&a.profile)?, ..Default::default() };
    if let Some(p) = &a.loads {
        let text = std::fs::read_to_string(p).map_err(|e| error(format!("{}: {e}", p.display()), ""))?;
        let parsed = codegen::placement::load_sglang(&text).map_err(|e| {
            error(format!("{}: {e}", p.display()), "expected {\"logical_count\": [[count per expert] per MoE layer]}")
        })?;
        opts.loads = Some((parsed, moeforge::plan::bundle::sha256_hex(text.as_bytes())));
    }
    let plan = {
        let (plan, w) =
            codegen::plan_with_warnings(&checked, id, &opts).map_err(|d| fail(&checked.sources, &d, a.format))?;
        warn(&checked.sources, &w, a.format);
        warnings.extend(w);
        plan
    };
    let (bundle, summary) = codegen::emit(&checked, id, &plan, &a.nvcc).map_err(|e| error(e, ""))?;
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
        (Some(v), _) => t.push_str(&format!(", compiled to cubin ({v})\n")),
        (None, Some(why)) => t.push_str(&format!(", not compiled: {why}\n")),
        _ => t.push('\n'),
    }
    t.push_str(&format!("  files    {}\n", bundle.files.keys().cloned().collect::<Vec<_>>().join(" ")));
    t.push_str(&format!("  spec     sha256 {}", p.spec_hash));
    t
}
