//! The bundle: the directory `moeforge compile` writes.
//!
//! ```text
//! DIR/manifest.json   format version, tool, spec hash, targets, SHA-256 of every other file
//! DIR/spec.json       the deployment's checked spec (canonical JSON; its hash is the spec hash)
//! DIR/plan.json       the validated plan
//! DIR/kernels/*.cu    emitted CUDA (and *.cubin when nvcc ran)
//! DIR/kernels/xfer_*.{ptx,ll}  transfer programs (the weight reshard, the EP
//!                     dispatch's rows): PTX and host-flavored LLVM IR
//! DIR/report.md       the human report
//! ```
//!
//! Writing is atomic: files go to a temporary sibling directory which is
//! renamed over DIR only when complete; on any error DIR is untouched.

use crate::plan::{ClusterFacts, ModelFacts, Plan, FORMAT_VERSION};
use crate::validate::{ValidPlan, Violation};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const MANIFEST: &str = "manifest.json";

/// The first bytes of [`Bundle::to_archive`]'s format.
pub const ARCHIVE_MAGIC: &[u8] = b"moeforge-bundle-archive-1\n";

/// Most files an archive may hold.
pub const MAX_ARCHIVE_FILES: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub tool: String,
    pub deploy: String,
    pub spec_hash: String,
    /// GPU architectures the kernels target.
    pub targets: Vec<String>,
    /// Whether `kernels/*.cubin` are present.
    pub cubins: bool,
    /// SHA-256 of every file but the manifest, by bundle-relative path.
    pub files: BTreeMap<String, String>,
}

/// The files of a bundle, by bundle-relative path, in memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bundle {
    pub files: BTreeMap<String, Vec<u8>>,
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

impl Bundle {
    pub fn add(&mut self, path: &str, bytes: impl Into<Vec<u8>>) {
        self.files.insert(path.to_string(), bytes.into());
    }

    /// Adds the manifest covering every file added so far.
    pub fn seal(&mut self, mut manifest: Manifest) {
        manifest.files = self.files.iter().map(|(p, b)| (p.clone(), sha256_hex(b))).collect();
        let mut json = serde_json::to_vec_pretty(&manifest).unwrap_or_default();
        json.push(b'\n');
        self.files.insert(MANIFEST.to_string(), json);
    }

    /// The bundle as one byte string (for embedding in an executable):
    /// [`ARCHIVE_MAGIC`], the file count (u32), then per file its path's
    /// length (u32), the path, its length (u64) and its bytes, little-endian.
    pub fn to_archive(&self) -> Vec<u8> {
        let size: usize = self.files.iter().map(|(p, b)| 12 + p.len() + b.len()).sum();
        let mut out = Vec::with_capacity(ARCHIVE_MAGIC.len() + 4 + size);
        out.extend_from_slice(ARCHIVE_MAGIC);
        out.extend_from_slice(&(self.files.len() as u32).to_le_bytes());
        for (path, bytes) in &self.files {
            out.extend_from_slice(&(path.len() as u32).to_le_bytes());
            out.extend_from_slice(path.as_bytes());
            out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            out.extend_from_slice(bytes);
        }
        out
    }

    /// Reads [`Bundle::to_archive`]'s format; every length is checked against
    /// what is left, so a truncated or foreign byte string is an error.
    pub fn from_archive(bytes: &[u8]) -> Result<Bundle, BundleError> {
        let bad = |why: &str| BundleError::Parse { path: "bundle archive".into(), what: "archive", err: why.into() };
        let mut rest = bytes.strip_prefix(ARCHIVE_MAGIC).ok_or_else(|| bad("no archive header"))?;
        let mut take = |n: usize| -> Result<&[u8], BundleError> {
            if rest.len() < n {
                return Err(bad("truncated"));
            }
            let (head, tail) = rest.split_at(n);
            rest = tail;
            Ok(head)
        };
        let u32_of = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
        let count = u32_of(take(4)?);
        if count > MAX_ARCHIVE_FILES {
            return Err(bad("too many files"));
        }
        let mut files = BTreeMap::new();
        for _ in 0..count {
            let n = u32_of(take(4)?);
            let path = std::str::from_utf8(take(n)?).map_err(|_| bad("a path is not UTF-8"))?.to_string();
            let len = take(8)?;
            let len = u64::from_le_bytes([len[0], len[1], len[2], len[3], len[4], len[5], len[6], len[7]]);
            if len > MAX_FILE_BYTES {
                return Err(bad("a file is larger than a bundle file may be"));
            }
            let data = take(len as usize)?.to_vec();
            if files.insert(path, data).is_some() {
                return Err(bad("a path appears twice"));
            }
        }
        if !rest.is_empty() {
            return Err(bad("trailing bytes"));
        }
        Ok(Bundle { files })
    }

    /// Writes the bundle to `dir` atomically, replacing a previous bundle there.
    /// (An existing directory is replaced only when it holds a bundle's
    /// entries and nothing else.)
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        let also = [MANIFEST, "spec.json", "plan.json", "report.md", "kernels"];
        write_dir_exec(dir, self.files.iter().map(|(p, b)| (p.as_str(), b.as_slice())), &[], &also)
    }
}

/// Writes `files` (relative path, bytes) into `dir` atomically: into a
/// sibling temp directory first, then moved into place; on any error the
/// previous `dir` survives and nothing half-written is left. An existing
/// `dir` is replaced only when it is empty or holds nothing but what such
/// an output holds ([`write_dir_exec`]).
pub fn write_dir<'a>(dir: &Path, files: impl Iterator<Item = (&'a str, &'a [u8])>) -> std::io::Result<()> {
    write_dir_exec(dir, files, &[], &[])
}

/// [`write_dir`], with the files in `executables` made executable (on Unix)
/// before the directory is moved into place. An existing `dir` is replaced
/// (a previous run's output) only when each entry at its top is one this
/// output writes or one of `also` (what other runs of the same command
/// write); anything else there (a user's files, another tool's output, a
/// mistyped `-o`) is refused, naming it, and `dir` stays as it was.
pub fn write_dir_exec<'a>(
    dir: &Path,
    files: impl Iterator<Item = (&'a str, &'a [u8])>,
    executables: &[&str],
    also: &[&str],
) -> std::io::Result<()> {
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent)?;
    if dir.exists() && !dir.is_dir() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a directory", dir.display()),
        ));
    }
    let files: Vec<(&str, &[u8])> = files.collect();
    if dir.is_dir() {
        let ours = |name: &str| also.contains(&name) || files.iter().any(|(p, _)| p.split('/').next() == Some(name));
        for entry in std::fs::read_dir(dir)? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if !ours(&name) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!(
                        "{} holds `{name}`, which this output does not write: refusing to replace the directory \
                         (choose another output directory, or remove it first)",
                        dir.display()
                    ),
                ));
            }
        }
    }
    let stem = dir.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "bundle".into());
    let tmp = tempfile::Builder::new().prefix(&format!(".{stem}.tmp")).tempdir_in(&parent)?;
    for (path, bytes) in files {
        let target = tmp.path().join(path);
        if let Some(p) = target.parent() {
            std::fs::create_dir_all(p)?;
        }
        std::fs::write(&target, bytes)?;
        #[cfg(unix)]
        if executables.contains(&path) {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755))?;
        }
    }
    let tmp_path = tmp.keep();
    let result = replace_dir(&tmp_path, dir, &parent, &stem);
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp_path);
    }
    result
}

/// Moves `new` to `dir`. An existing `dir` is first moved aside and removed
/// only after the rename succeeded, so a failure leaves it as it was.
fn replace_dir(new: &Path, dir: &Path, parent: &Path, stem: &str) -> std::io::Result<()> {
    if !dir.exists() {
        return std::fs::rename(new, dir);
    }
    let old = tempfile::Builder::new().prefix(&format!(".{stem}.old")).tempdir_in(parent)?.keep();
    std::fs::remove_dir(&old)?;
    std::fs::rename(dir, &old)?;
    if let Err(e) = std::fs::rename(new, dir) {
        let _ = std::fs::rename(&old, dir);
        return Err(e);
    }
    std::fs::remove_dir_all(&old)
}

/// A verified bundle: hashes checked, the plan validated and consistent
/// with its spec.
#[derive(Clone, Debug)]
pub struct LoadedBundle {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub plan: ValidPlan,
    /// The deployment's checked spec (`spec.json`).
    pub spec: moeforge_dsl::Spec,
    /// Kernel sources by name.
    pub kernels: BTreeMap<String, String>,
    /// The compile's nvcc builds of them for the plan's architecture
    /// (`kernels/{name}.cubin`, present when nvcc ran), by name.
    pub cubins: BTreeMap<String, Vec<u8>>,
    /// The plan's transfer programs, compiled (`kernels/xfer_{name}.*`) and
    /// checked against the programs the validated plan makes, by name
    /// (`crate::transfers::NAMES`).
    pub transfers: BTreeMap<String, moeforge_xfer::Code>,
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
    #[error("spec.json {why}; recompile the spec with `moeforge compile`")]
    Spec { why: String },
    #[error("plan.json is not a valid plan: {}{}", violations.iter().take(3).map(|v| v.to_string()).collect::<Vec<_>>().join("; "), if violations.len() > 3 { format!(" (and {} more)", violations.len() - 3) } else { String::new() })]
    Plan { violations: Vec<Violation> },
}

/// Largest file a bundle may hold (cubins and plans are far smaller).
pub const MAX_FILE_BYTES: u64 = 1 << 30;

/// Reads a bundle file: a regular file (no link to follow elsewhere) of at
/// most [`MAX_FILE_BYTES`].
fn read(dir: &Path, rel: &str) -> Result<Vec<u8>, BundleError> {
    let path = dir.join(rel);
    let err = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::NotFound => BundleError::Missing { path: rel.to_string() },
        _ => BundleError::Read { path: rel.to_string(), err: e.to_string() },
    };
    let meta = std::fs::symlink_metadata(&path).map_err(err)?;
    if !meta.is_file() || meta.len() > MAX_FILE_BYTES {
        let why = if meta.is_file() { "larger than a bundle file may be" } else { "not a regular file" };
        return Err(BundleError::Read { path: rel.to_string(), err: why.into() });
    }
    std::fs::read(&path).map_err(err)
}

/// Reads and verifies a bundle directory.
pub fn load_bundle(dir: &Path) -> Result<LoadedBundle, BundleError> {
    if !dir.join(MANIFEST).is_file() {
        return Err(BundleError::Read {
            path: dir.join(MANIFEST).display().to_string(),
            err: "not found (is this a bundle directory?)".into(),
        });
    }
    load_with(dir, &|rel| read(dir, rel))
}

/// Verifies a bundle held in memory (an archive embedded in an executable,
/// named `origin` in [`LoadedBundle::dir`]), exactly as [`load_bundle`] does a
/// directory.
pub fn load_bundle_files(bundle: &Bundle, origin: &Path) -> Result<LoadedBundle, BundleError> {
    load_with(origin, &|rel| bundle.files.get(rel).cloned().ok_or_else(|| BundleError::Missing { path: rel.into() }))
}

fn load_with(dir: &Path, read: &dyn Fn(&str) -> Result<Vec<u8>, BundleError>) -> Result<LoadedBundle, BundleError> {
    let raw = read(MANIFEST)?;
    let manifest: Manifest = serde_json::from_slice(&raw).map_err(|e| BundleError::Parse {
        path: MANIFEST.into(),
        what: "manifest",
        err: e.to_string(),
    })?;
    if manifest.format_version != FORMAT_VERSION {
        return Err(BundleError::Format { found: manifest.format_version, expected: FORMAT_VERSION });
    }
    let mut kernels = BTreeMap::new();
    let mut cubins = BTreeMap::new();
    for (rel, hash) in &manifest.files {
        if rel.contains("..") || Path::new(rel).is_absolute() {
            return Err(BundleError::Parse {
                path: rel.clone(),
                what: "bundle path",
                err: "escapes the bundle".into(),
            });
        }
        let bytes = read(rel)?;
        if &sha256_hex(&bytes) != hash {
            return Err(BundleError::Hash { path: rel.clone() });
        }
        if let Some(name) = rel.strip_prefix("kernels/").and_then(|r| r.strip_suffix(".cu")) {
            kernels.insert(name.to_string(), String::from_utf8_lossy(&bytes).into_owned());
        } else if let Some(name) = rel.strip_prefix("kernels/").and_then(|r| r.strip_suffix(".cubin")) {
            cubins.insert(name.to_string(), bytes);
        }
    }
    for required in ["spec.json", "plan.json"] {
        if !manifest.files.contains_key(required) {
            return Err(BundleError::Missing { path: required.into() });
        }
    }
    let spec_bytes = read("spec.json")?;
    let spec_hash = sha256_hex(&spec_bytes);
    if spec_hash != manifest.spec_hash {
        return Err(BundleError::SpecHash {
            manifest: manifest.spec_hash.clone(),
            what: "spec.json",
            found: spec_hash,
        });
    }
    let plan: Plan = serde_json::from_slice(&read("plan.json")?).map_err(|e| BundleError::Parse {
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
    // spec.json must be a checked spec: printed back to `.moe` it checks to
    // itself (so every range and cross-block rule holds for what backends read).
    match moeforge_dsl::check_str("spec.json", &spec.to_string()) {
        Ok(c) if c.spec == spec => {}
        Ok(_) => return Err(BundleError::Spec { why: "does not print and check back to itself".into() }),
        Err(f) => {
            let first = f.diagnostics.iter().next().map_or(String::new(), |d| format!("{}: {}", d.code, d.message));
            return Err(BundleError::Spec { why: format!("is not a valid spec: {first}") });
        }
    }
    // The plan's facts are its spec's before anything else is read from it.
    let violations = spec_consistency(&plan, &spec);
    if !violations.is_empty() {
        return Err(BundleError::Plan { violations });
    }
    let plan = crate::validate::validate(plan).map_err(|violations| BundleError::Plan { violations })?;
    // The validated plan makes the programs its compiled code must be.
    let programs = crate::transfers::programs(plan.plan()).map_err(|e| BundleError::Parse {
        path: "plan.json".into(),
        what: "plan",
        err: format!("its transfer programs: {e}"),
    })?;
    let mut transfers = BTreeMap::new();
    for (name, program) in programs {
        let (ptx_path, ir_path) = crate::transfers::files(name);
        let text = |path: &str| -> Result<String, BundleError> {
            if !manifest.files.contains_key(path) {
                // Not listed: compiled by a moeforge whose plans needed
                // fewer transfer programs (the combine and the all-reduce
                // were host code before), or edited out.
                return Err(BundleError::Parse {
                    path: path.into(),
                    what: "transfer program",
                    err: format!(
                        "this plan runs its `{name}` transfer program, which the manifest does not list: \
                         recompile the bundle with this moeforge"
                    ),
                });
            }
            String::from_utf8(read(path)?).map_err(|e| BundleError::Parse {
                path: path.into(),
                what: "transfer program",
                err: e.to_string(),
            })
        };
        let (ptx, ir) = (text(&ptx_path)?, text(&ir_path)?);
        let code = moeforge_xfer::Code::new(program, ptx, ir).map_err(|err| BundleError::Parse {
            path: if err.contains("its IR") { ir_path.clone() } else { ptx_path.clone() },
            what: "transfer program",
            err: format!("{err}: recompile the bundle"),
        })?;
        transfers.insert(name.to_string(), code);
    }
    if let Some(name) = cubins.keys().find(|n| !kernels.contains_key(*n)) {
        return Err(BundleError::Parse {
            path: format!("kernels/{name}.cubin"),
            what: "bundle",
            err: "a cubin without its kernel source".into(),
        });
    }
    Ok(LoadedBundle { dir: dir.to_path_buf(), manifest, plan, spec, kernels, cubins, transfers })
}

/// The plan's model and cluster facts are those of its spec: a plan edited
/// apart from its spec is refused before a backend sizes anything from
/// either.
fn spec_consistency(plan: &Plan, spec: &moeforge_dsl::Spec) -> Vec<Violation> {
    let mut out = Vec::new();
    let (Some(m), Some(c)) = (spec.models.first(), spec.clusters.first()) else {
        out.push(Violation { field: "spec.json".into(), message: "holds no model or cluster".into() });
        return out;
    };
    if spec.deploys.len() != 1 || spec.tiles.len() != 1 {
        out.push(Violation { field: "spec.json".into(), message: "is not one deployment's spec".into() });
    }
    if plan.model != ModelFacts::of(m) {
        out.push(Violation {
            field: "model".into(),
            message: format!("does not match spec.json's model `{}`", m.name),
        });
    }
    if plan.cluster != ClusterFacts::of(c) {
        out.push(Violation {
            field: "cluster".into(),
            message: format!("does not match spec.json's cluster `{}`", c.name),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn sample() -> Bundle {
        let mut b = Bundle::default();
        b.add("plan.json", b"{}".to_vec());
        b.add("kernels/apk.cubin", (0..=255u8).cycle().take(5000).collect::<Vec<_>>());
        b.add("empty", Vec::new());
        b
    }

    #[test]
    fn archives_round_trip() {
        let b = sample();
        assert_eq!(Bundle::from_archive(&b.to_archive()).unwrap(), b);
        assert_eq!(Bundle::from_archive(&Bundle::default().to_archive()).unwrap(), Bundle::default());
    }

    #[test]
    fn every_truncation_and_extension_is_an_error() {
        let a = sample().to_archive();
        for n in 0..a.len() {
            assert!(Bundle::from_archive(&a[..n]).is_err(), "truncated at {n}");
        }
        let mut longer = a.clone();
        longer.push(0);
        assert!(Bundle::from_archive(&longer).is_err());
        // A length field pointing past the end.
        let mut lying = a;
        let at = ARCHIVE_MAGIC.len() + 4;
        lying[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Bundle::from_archive(&lying).is_err());
    }
}
