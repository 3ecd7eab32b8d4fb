//! `moeforge explain [FILE]`: the checked spec as canonical `.moe` and the
//! plan's textual form, without writing anything.

use super::{fail, load, out, pick, warn, Format};
use moeforge::codegen;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A `.moe` file holding a `deploy` block; omitted: the embedded default.
    file: Option<PathBuf>,
    #[arg(long)]
    deploy: Option<String>,
    #[arg(long, value_enum, default_value_t)]
    format: Format,
}

pub fn run(a: Args) -> Result<(), ExitCode> {
    let checked = load(&a.file).0.map_err(|f| fail(&f.sources, &f.diagnostics, a.format))?;
    let id = pick(&checked, a.deploy.as_deref()).map_err(|d| fail(&checked.sources, &d, a.format))?;
    warn(&checked.sources, &checked.warnings_for(id), a.format);
    let opts = codegen::PlanOptions::default();
    let (plan, w) =
        codegen::plan_with_warnings(&checked, id, &opts).map_err(|d| fail(&checked.sources, &d, a.format))?;
    warn(&checked.sources, &w, a.format);
    let mut warnings = checked.warnings_for(id);
    warnings.extend(w);
    match a.format {
        Format::Human => {
            out(&format!("// checked spec of deployment `{}`\n", plan.plan().deploy));
            out(&checked.spec.deployment(id).to_string());
            out(&format!("// plan\n{}", plan.plan()));
        }
        Format::Json => out(&serde_json::to_string_pretty(&serde_json::json!({
            "spec": checked.spec.deployment(id),
            "plan": plan.plan(),
            "warnings": warnings.to_json(&checked.sources),
        }))
        .unwrap_or_default()),
    }
    Ok(())
}
