//! `moeforge-macros`: `spec!("path.moe")` checks a spec while Rust compiles.
//!
//! Takes a path relative to the calling crate's `CARGO_MANIFEST_DIR`; gives
//! an expression of type `&'static str` holding the checked spec's canonical
//! JSON (deserialize it into `moeforge::dsl::Spec`). A spec with errors is a
//! compile error that carries the rendered diagnostics (file:line:col, code,
//! help). Every file the spec reads is registered with `include_bytes!`, so
//! editing a `.moe` file rebuilds the crate that embeds it.
//!
//! Split as the proc-macro habit goes: `parse` reads the macro input,
//! [`expand`] is a plain function (tested without a compiler), and the macro
//! only glues them.

use proc_macro::TokenStream;
use std::path::{Path, PathBuf};

/// What a successful expansion embeds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Expansion {
    pub json: String,
    /// Absolute paths of every file the check read.
    pub sources: Vec<PathBuf>,
}

/// Checks `rel` (relative to `base`) and returns the canonical JSON of the
/// whole checked spec, or the rendered diagnostics.
pub(crate) fn expand(base: &Path, rel: &str) -> Result<Expansion, String> {
    let path = base.join(rel);
    match moeforge_dsl::check_paths(&[path], &moeforge_dsl::FsLoader) {
        Ok(c) => {
            let json = serde_json::to_string(&c.spec).map_err(|e| e.to_string())?;
            let sources = c.sources.files().map(|(_, f)| PathBuf::from(&f.name)).collect();
            Ok(Expansion { json, sources })
        }
        Err(f) => Err(f.render(false)),
    }
}

/// `moeforge::spec!("examples/qwen3-30b-a3b-h200.moe")` → `&'static str` (canonical JSON).
#[proc_macro]
pub fn spec(input: TokenStream) -> TokenStream {
    let lit = match syn::parse::<syn::LitStr>(input) {
        Ok(l) => l,
        Err(e) => return e.to_compile_error().into(),
    };
    let base = std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from).unwrap_or_default();
    match expand(&base, &lit.value()) {
        Ok(x) => {
            let json = x.json;
            let deps = x.sources.iter().map(|p| p.display().to_string());
            quote::quote! {{
                #( const _: &[u8] = include_bytes!(#deps); )*
                #json
            }}
            .into()
        }
        Err(rendered) => {
            let msg = format!("moeforge::spec!: `{}` has errors:\n{rendered}", lit.value());
            syn::Error::new(lit.span(), msg).to_compile_error().into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    #[test]
    fn expands_a_valid_spec_with_its_dependencies() {
        let x = expand(&root(), "examples/qwen3-30b-a3b-h200.moe").unwrap_or_else(|e| panic!("{e}"));
        let spec: moeforge_dsl::Spec = serde_json::from_str(&x.json).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(spec.deploys[0].name, "qwen3-30b-h200");
        assert_eq!(x.sources.len(), 4, "{:?}", x.sources);
    }

    #[test]
    fn errors_carry_rendered_diagnostics() {
        let dir = std::env::temp_dir().join(format!("moeforge-macro-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok();
        std::fs::write(dir.join("bad.moe"), "model m { layers = 0 }\n").ok();
        let e = expand(&dir, "bad.moe").err().unwrap_or_default();
        std::fs::remove_dir_all(&dir).ok();
        assert!(e.contains("E0107") && e.contains("bad.moe:1:20"), "{e}");
    }
}
