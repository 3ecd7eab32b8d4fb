//! `moeforge-macros`: `spec!("path.moe")` checks a spec while Rust compiles.
//!
//! Takes a path relative to the file that calls it, as `include_str!` does
//! (`CARGO_MANIFEST_DIR` when the compiler cannot say which file); gives
//! an expression of type `&'static moeforge::EmbeddedSpec`, which derefs to
//! the checked `moeforge::dsl::Spec` (`spec.deploys[0]`) and holds the whole
//! `Checked` result for `moeforge::compile`. The expansion embeds the text of
//! every file the spec reads (`include_str!`, so editing a `.moe` file
//! rebuilds the crate that embeds it) and checks it again, once, on first
//! use. A spec with errors is a compile error carrying the rendered
//! diagnostics: the `.moe` file's `path:line:col`, the code, the help.
//!
//! Split as the proc-macro habit goes: `parse` reads the macro input,
//! [`expand`] is a plain function (tested without a compiler), and the macro
//! only glues them.

use proc_macro::TokenStream;
use std::path::{Path, PathBuf};

/// What a successful expansion embeds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Expansion {
    /// The root file's name in the file table.
    pub root: String,
    /// Every file the check read: its name as diagnostics show it (relative
    /// to the crate when given so) and its path on disk.
    pub files: Vec<(String, PathBuf)>,
}

/// Reads paths relative to the calling file's directory, so that diagnostics
/// and the embedded file table name files as the user wrote them.
struct CrateLoader<'a>(&'a Path);

impl moeforge_dsl::Loader for CrateLoader<'_> {
    fn load(&self, path: &Path) -> Result<String, String> {
        std::fs::read_to_string(self.0.join(path)).map_err(|e| e.to_string())
    }
}

/// Checks `rel` (relative to `base`) and returns the files it read, or the
/// rendered diagnostics.
pub(crate) fn expand(base: &Path, rel: &str) -> Result<Expansion, String> {
    let root = moeforge_dsl::normalize(Path::new(rel));
    match moeforge_dsl::check_paths(std::slice::from_ref(&root), &CrateLoader(base)) {
        Ok(c) => {
            let files = c.sources.files().map(|(_, f)| (f.name.clone(), base.join(&f.name))).collect();
            Ok(Expansion { root: root.display().to_string(), files })
        }
        Err(f) => Err(f.render(false)),
    }
}

/// `moeforge::spec!("../examples/qwen3-30b-a3b-h200.moe")` → `&'static moeforge::EmbeddedSpec`.
#[proc_macro]
pub fn spec(input: TokenStream) -> TokenStream {
    let lit = match syn::parse::<syn::LitStr>(input) {
        Ok(l) => l,
        Err(e) => return e.to_compile_error().into(),
    };
    let caller = proc_macro::Span::call_site().local_file();
    // A relative file name is relative to rustc's working directory, which
    // is the macro's too; `include_str!` needs the absolute path.
    let cwd = std::env::current_dir().unwrap_or_default();
    let base = match caller.as_deref().and_then(Path::parent) {
        Some(dir) => cwd.join(dir),
        None => std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from).unwrap_or_default(),
    };
    match expand(&base, &lit.value()) {
        Ok(x) => {
            let root = x.root;
            let names = x.files.iter().map(|(n, _)| n.clone());
            let paths = x.files.iter().map(|(_, p)| p.display().to_string());
            quote::quote! {{
                static SPEC: ::moeforge::EmbeddedSpec =
                    ::moeforge::EmbeddedSpec::new(#root, &[ #( (#names, include_str!(#paths)) ),* ]);
                &SPEC
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
        assert_eq!(x.root, "examples/qwen3-30b-a3b-h200.moe");
        let names: Vec<&str> = x.files.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            ["examples/qwen3-30b-a3b-h200.moe", "models/qwen3-30b-a3b.moe", "models/clusters.moe", "models/tiles.moe"]
        );
        assert!(x.files.iter().all(|(_, p)| p.is_file()));
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
