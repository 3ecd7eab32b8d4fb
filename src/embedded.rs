//! Specs embedded in a binary: [`EmbeddedSpec`] (what `moeforge::spec!`
//! expands to) and the embedded default, Qwen3-30B-A3B on one 8×H200 node,
//! with the model zoo files it uses, so `moeforge compile` works with no
//! files at hand.

use moeforge_dsl::{Checked, MemLoader, Spec};
use std::path::PathBuf;
use std::sync::OnceLock;

/// A spec whose files are compiled into the binary: `root` and every file it
/// `use`s, by the names diagnostics show. It is checked on first use, once;
/// it derefs to the checked [`Spec`] and [`EmbeddedSpec::checked`] gives the
/// whole result (sources included) for [`crate::compile`].
pub struct EmbeddedSpec {
    root: &'static str,
    files: &'static [(&'static str, &'static str)],
    checked: OnceLock<Checked>,
}

impl EmbeddedSpec {
    pub const fn new(root: &'static str, files: &'static [(&'static str, &'static str)]) -> EmbeddedSpec {
        EmbeddedSpec { root, files, checked: OnceLock::new() }
    }

    /// The name of the root file.
    pub fn root(&self) -> &'static str {
        self.root
    }

    /// The embedded files, by name.
    pub fn files(&self) -> &'static [(&'static str, &'static str)] {
        self.files
    }

    pub fn loader(&self) -> MemLoader {
        MemLoader::new(self.files.iter().copied())
    }

    /// Checks the embedded text (again: `spec!` checked it while Rust
    /// compiled, with this same checker), or the rendered diagnostics.
    pub fn check(&self) -> Result<Checked, String> {
        moeforge_dsl::check_paths(&[PathBuf::from(self.root)], &self.loader()).map_err(|f| f.render(false))
    }

    /// The checked spec, checked on first use.
    pub fn checked(&self) -> &Checked {
        self.checked.get_or_init(|| match self.check() {
            Ok(c) => c,
            // `spec!` refused this text at compile time unless it checks, and
            // the default is checked by the tests: reaching this is a bug in
            // moeforge (a checker that is not deterministic), not bad input.
            #[allow(clippy::panic)]
            Err(rendered) => panic!("moeforge bug: embedded spec `{}` no longer checks:\n{rendered}", self.root),
        })
    }
}

impl std::ops::Deref for EmbeddedSpec {
    type Target = Spec;
    fn deref(&self) -> &Spec {
        &self.checked().spec
    }
}

impl AsRef<Checked> for EmbeddedSpec {
    fn as_ref(&self) -> &Checked {
        self.checked()
    }
}

impl std::fmt::Debug for EmbeddedSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.files.iter().map(|(n, _)| *n).collect();
        f.debug_struct("EmbeddedSpec").field("root", &self.root).field("files", &names).finish()
    }
}

/// Path of the default deployment inside the embedded file table.
pub const DEFAULT_SPEC: &str = "examples/qwen3-30b-a3b-h200.moe";

/// Every embedded file, by repository-relative path.
pub const FILES: &[(&str, &str)] = &[
    (DEFAULT_SPEC, include_str!("../examples/qwen3-30b-a3b-h200.moe")),
    ("models/qwen3-30b-a3b.moe", include_str!("../models/qwen3-30b-a3b.moe")),
    ("models/clusters.moe", include_str!("../models/clusters.moe")),
    ("models/tiles.moe", include_str!("../models/tiles.moe")),
];

/// The embedded default.
pub static DEFAULT: EmbeddedSpec = EmbeddedSpec::new(DEFAULT_SPEC, FILES);

pub fn loader() -> MemLoader {
    DEFAULT.loader()
}
