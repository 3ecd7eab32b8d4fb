//! `moeforge check FILE…`: every diagnostic of the given specs; warnings
//! (fields with no effect yet) do not fail the check.

use super::{fail, out, warn, Format};
use moeforge::dsl::{self, FsLoader};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// `.moe` files (with the files they `use`).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    #[arg(long, value_enum, default_value_t)]
    format: Format,
}

pub fn run(a: Args) -> Result<(), ExitCode> {
    let c = dsl::check_paths(&a.files, &FsLoader).map_err(|f| fail(&f.sources, &f.diagnostics, a.format))?;
    let warnings = c.all_warnings();
    let s = &c.spec;
    match a.format {
        Format::Human => {
            warn(&c.sources, &warnings, a.format);
            eprintln!(
                "ok: {} model(s), {} cluster(s), {} tile set(s), {} deployment(s)",
                s.models.len(),
                s.clusters.len(),
                s.tiles.len(),
                s.deploys.len()
            );
        }
        // On success the array holds the warnings (severity "warning").
        Format::Json => out(&serde_json::to_string_pretty(&warnings.to_json(&c.sources)).unwrap_or_default()),
    }
    Ok(())
}
