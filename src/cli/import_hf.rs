//! `moeforge import-hf PATH -o FILE.moe`: a Hugging Face `config.json` (or
//! a checkpoint directory holding one) as a `model` block. What the spec
//! cannot express becomes `// note:` comments; the output is checked before
//! it is written, atomically.

use super::{error, out};
use moeforge::dsl::hf;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A config.json, or a checkpoint directory holding one.
    path: PathBuf,
    /// The `.moe` file to write.
    #[arg(short, long)]
    output: PathBuf,
    /// The model block's name (default: the checkpoint directory's name).
    #[arg(long)]
    name: Option<String>,
}

/// A name the `.moe` grammar accepts: letters, digits, `_`, `-`, `.`,
/// starting with a letter or `_`.
fn block_name(raw: &str) -> String {
    let mut s: String = raw
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.') { c.to_ascii_lowercase() } else { '-' })
        .collect();
    if !s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') {
        s.insert(0, 'm');
        s.insert(1, '-');
    }
    s
}

pub fn run(a: Args) -> Result<(), ExitCode> {
    let (file, dir): (PathBuf, Option<&Path>) =
        if a.path.is_dir() { (a.path.join("config.json"), Some(&a.path)) } else { (a.path.clone(), a.path.parent()) };
    let text = std::fs::read_to_string(&file).map_err(|e| {
        error(format!("{}: {e}", file.display()), "give a config.json or a checkpoint directory that holds one")
    })?;
    let default_name = dir
        .and_then(|d| std::fs::canonicalize(d).ok())
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "imported".into());
    let name = block_name(a.name.as_deref().unwrap_or(&default_name));
    let imported = hf::import(&text, &name).map_err(|e| error(format!("{}: {e}", file.display()), ""))?;
    let moe = hf::to_moe(&imported, &file.display().to_string());
    // What is written must check: the model block on its own is a spec.
    if let Err(f) = moeforge::dsl::check_str(&a.output.display().to_string(), &moe) {
        return Err(error(
            format!("the imported model does not check:\n{}", f.render(false)),
            "the config holds values the spec refuses; please report it with the config",
        ));
    }
    let name_out = a.output.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let parent = match a.output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let write = || -> std::io::Result<()> {
        let mut tmp = tempfile::Builder::new().prefix(&format!(".{name_out}.tmp")).tempfile_in(&parent)?;
        std::io::Write::write_all(&mut tmp, moe.as_bytes())?;
        tmp.persist(&a.output).map_err(|e| e.error)?;
        Ok(())
    };
    write().map_err(|e| error(format!("cannot write {}: {e}", a.output.display()), ""))?;
    let p = imported.model.params();
    out(&format!(
        "imported {} ({}) → {}: {} params ({} active)",
        name,
        imported.architecture,
        a.output.display(),
        count(p.total()),
        count(imported.model.active_params())
    ));
    for n in &imported.notes {
        eprintln!("note: {n}");
    }
    Ok(())
}

/// A parameter count in the unit that keeps three significant digits (`671.0B`, `2.43M`).
fn count(n: u64) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.1}B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.2}M", n / 1e6)
    } else {
        format!("{:.1}K", n / 1e3)
    }
}
