//! `moeforge-runtime`: loads bundles and runs them.
//!
//! [`load_bundle`] reads a bundle directory and refuses it unless its format
//! version matches, every file's SHA-256 matches the manifest, and the spec
//! hash matches both `spec.json` and `plan.json`. [`twin`] is the `cpu`
//! backend: a real MoE decoder on simulated ranks over the bundle's memory
//! plan, switching TP↔EP live. [`sim`] is the `sim` backend: a
//! discrete-event serving simulator on the plan's cost model, comparing
//! ExpertPlex-style sharing, Moebius-style switching and the baselines.
//! [`batching`] is the admission rule both share. [`reference`] holds scalar
//! references of the emitted kernels.

pub mod batching;
pub mod reference;
pub mod sim;
pub mod twin;

use moeforge_codegen::emit::bundle::{sha256_hex, Manifest, MANIFEST};
use moeforge_codegen::plan::{Plan, FORMAT_VERSION};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A verified bundle.
#[derive(Clone, Debug)]
pub struct LoadedBundle {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub plan: Plan,
    /// The deployment's checked spec (`spec.json`).
    pub spec: moeforge_dsl::Spec,
    /// Kernel sources by name.
    pub kernels: BTreeMap<String, String>,
}

#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("{path}: cannot read: {err}")]
    Read { path: String, err: String },
    #[error("{path}: not a valid {what}: {err}")]
    Parse { path: String, what: &'static str, err: String },
    #[error("bundle format {found} is not supported by this runtime (expects {expected}); recompile the spec with this moeforge")]
    Format { found: u32, expected: u32 },
    #[error("{path}: contents do not match the manifest's hash; the bundle was modified or is incomplete")]
    Hash { path: String },
    #[error("{path}: listed in the manifest but missing")]
    Missing { path: String },
    #[error("spec hash mismatch: manifest says {manifest}, {what} gives {found}")]
    SpecHash { manifest: String, what: &'static str, found: String },
}

fn read(dir: &Path, rel: &str) -> Result<Vec<u8>, BundleError> {
    std::fs::read(dir.join(rel)).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => BundleError::Missing { path: rel.to_string() },
        _ => BundleError::Read { path: rel.to_string(), err: e.to_string() },
    })
}

/// Reads and verifies a bundle directory.
pub fn load_bundle(dir: &Path) -> Result<LoadedBundle, BundleError> {
    let raw = std::fs::read(dir.join(MANIFEST))
        .map_err(|e| BundleError::Read { path: dir.join(MANIFEST).display().to_string(), err: e.to_string() })?;
    let manifest: Manifest = serde_json::from_slice(&raw).map_err(|e| BundleError::Parse {
        path: MANIFEST.into(),
        what: "manifest",
        err: e.to_string(),
    })?;
    if manifest.format_version != FORMAT_VERSION {
        return Err(BundleError::Format { found: manifest.format_version, expected: FORMAT_VERSION });
    }
    let mut kernels = BTreeMap::new();
    for (rel, hash) in &manifest.files {
        if rel.contains("..") || Path::new(rel).is_absolute() {
            return Err(BundleError::Parse {
                path: rel.clone(),
                what: "bundle path",
                err: "escapes the bundle".into(),
            });
        }
        let bytes = read(dir, rel)?;
        if &sha256_hex(&bytes) != hash {
            return Err(BundleError::Hash { path: rel.clone() });
        }
        if let Some(name) = rel.strip_prefix("kernels/").and_then(|r| r.strip_suffix(".cu")) {
            kernels.insert(name.to_string(), String::from_utf8_lossy(&bytes).into_owned());
        }
    }
    for required in ["spec.json", "plan.json"] {
        if !manifest.files.contains_key(required) {
            return Err(BundleError::Missing { path: required.into() });
        }
    }
    let spec_bytes = read(dir, "spec.json")?;
    let spec_hash = sha256_hex(&spec_bytes);
    if spec_hash != manifest.spec_hash {
        return Err(BundleError::SpecHash {
            manifest: manifest.spec_hash.clone(),
            what: "spec.json",
            found: spec_hash,
        });
    }
    let plan: Plan = serde_json::from_slice(&read(dir, "plan.json")?).map_err(|e| BundleError::Parse {
        path: "plan.json".into(),
        what: "plan",
        err: e.to_string(),
    })?;
    if plan.spec_hash != manifest.spec_hash {
        return Err(BundleError::SpecHash {
            manifest: manifest.spec_hash.clone(),
            what: "plan.json",
            found: plan.spec_hash,
        });
    }
    let spec: moeforge_dsl::Spec = serde_json::from_slice(&spec_bytes).map_err(|e| BundleError::Parse {
        path: "spec.json".into(),
        what: "spec",
        err: e.to_string(),
    })?;
    Ok(LoadedBundle { dir: dir.to_path_buf(), manifest, plan, spec, kernels })
}
