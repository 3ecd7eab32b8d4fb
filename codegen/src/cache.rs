//! The kernel cache: nvcc's results by content, so recompiling an unchanged
//! spec does not run nvcc again and yields the same bytes.
//!
//! The key is the SHA-256 of everything the result depends on: the kernel's
//! source bytes and name, the target arch, nvcc's flags, the full
//! `nvcc --version` text and whether the SASS tools are beside it. An entry
//! is a directory `<key>/` holding `kernel.cubin` and `result.json` (ptxas's
//! figures, the SASS counts, the cubin's SHA-256). It lives in the user's
//! cache directory: `$MOEFORGE_CACHE_DIR`, else `$XDG_CACHE_HOME/moeforge/kernels`,
//! else `~/.cache/moeforge/kernels`.
//!
//! Writes are atomic and safe under concurrent compiles: an entry is built in
//! a temporary directory beside the entries and renamed into place; when two
//! compiles race, the first rename wins and the other's identical entry is
//! dropped. A reader never sees a partial entry; one whose cubin does not
//! match its recorded hash (a damaged disk, a hand edit) is a miss and is
//! replaced. Only successful compiles are cached.

use crate::nvcc::{Compiled, PtxasStats, SassCounts};
use moeforge_plan::bundle::sha256_hex;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Bumped when the entry format or what goes into the key changes.
const FORMAT: &str = "moeforge-kernel-cache-1";

/// A kernel cache rooted at a directory.
#[derive(Clone, Debug)]
pub struct KernelCache {
    root: PathBuf,
}

/// What the key is made of (all of it; see the module docs).
pub struct KeyParts<'a> {
    pub name: &'a str,
    pub arch: &'a str,
    pub flags: &'a [String],
    /// The whole `nvcc --version` output.
    pub nvcc_version: &'a str,
    /// Whether cuobjdump and nvdisasm are beside nvcc (the result then has
    /// SASS counts).
    pub sass_tools: bool,
    pub source: &'a str,
}

impl KeyParts<'_> {
    pub fn key(&self) -> String {
        let mut bytes = Vec::with_capacity(self.source.len() + 512);
        for part in [FORMAT, self.name, self.arch, &self.flags.join("\u{1f}"), self.nvcc_version] {
            bytes.extend_from_slice(part.as_bytes());
            bytes.push(0);
        }
        bytes.push(u8::from(self.sass_tools));
        bytes.push(0);
        bytes.extend_from_slice(self.source.as_bytes());
        sha256_hex(&bytes)
    }
}

#[derive(Serialize, Deserialize)]
struct Entry {
    format: String,
    cubin_sha256: String,
    stats: Vec<PtxasStats>,
    nvcc_version: String,
    sass: Option<SassCounts>,
}

#[derive(Debug, thiserror::Error)]
#[error("kernel cache {path}: {err}")]
pub struct CacheError {
    pub path: String,
    pub err: String,
}

impl KernelCache {
    pub fn at(root: impl Into<PathBuf>) -> KernelCache {
        KernelCache { root: root.into() }
    }

    /// The user's cache (see the module docs), or `None` when no home or
    /// cache directory is known.
    pub fn user() -> Option<KernelCache> {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        if let Some(d) = var("MOEFORGE_CACHE_DIR") {
            return Some(KernelCache::at(d));
        }
        let base = var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|h| h.join(".cache")))?;
        Some(KernelCache::at(base.join("moeforge").join("kernels")))
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The cached result for `key`, if a whole, intact entry holds it.
    pub fn get(&self, key: &str) -> Option<Compiled> {
        let dir = self.root.join(key);
        let entry: Entry = serde_json::from_slice(&std::fs::read(dir.join("result.json")).ok()?).ok()?;
        let cubin = std::fs::read(dir.join("kernel.cubin")).ok()?;
        if entry.format != FORMAT || sha256_hex(&cubin) != entry.cubin_sha256 {
            return None;
        }
        Some(Compiled { cubin, stats: entry.stats, nvcc_version: entry.nvcc_version, sass: entry.sass })
    }

    /// Stores `c` under `key`, atomically.
    pub fn put(&self, key: &str, c: &Compiled) -> Result<(), CacheError> {
        let fail = |p: &Path, e: std::io::Error| CacheError { path: p.display().to_string(), err: e.to_string() };
        std::fs::create_dir_all(&self.root).map_err(|e| fail(&self.root, e))?;
        let tmp = tempfile::Builder::new().prefix(".tmp-").tempdir_in(&self.root).map_err(|e| fail(&self.root, e))?;
        let entry = Entry {
            format: FORMAT.to_string(),
            cubin_sha256: sha256_hex(&c.cubin),
            stats: c.stats.clone(),
            nvcc_version: c.nvcc_version.clone(),
            sass: c.sass.clone(),
        };
        let json = serde_json::to_vec_pretty(&entry).unwrap_or_default();
        std::fs::write(tmp.path().join("kernel.cubin"), &c.cubin).map_err(|e| fail(tmp.path(), e))?;
        std::fs::write(tmp.path().join("result.json"), json).map_err(|e| fail(tmp.path(), e))?;
        let dest = self.root.join(key);
        if dest.exists() && self.get(key).is_none() {
            // A damaged entry: replace it.
            let _ = std::fs::remove_dir_all(&dest);
        }
        match std::fs::rename(tmp.path(), &dest) {
            Ok(()) => {
                // The directory now lives at `dest`; nothing is left to clean up.
                let _ = tmp.keep();
                Ok(())
            }
            // Another compile stored the same entry first.
            Err(_) if self.get(key).is_some() => Ok(()),
            Err(e) => Err(fail(&dest, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn compiled(cubin: &[u8]) -> Compiled {
        Compiled {
            cubin: cubin.to_vec(),
            stats: vec![PtxasStats { function: "k".into(), registers: 10, ..Default::default() }],
            nvcc_version: "release 13.0".into(),
            sass: None,
        }
    }

    fn key(source: &str, version: &str) -> String {
        let flags = vec!["-O3".to_string()];
        KeyParts { name: "apk", arch: "sm_90a", flags: &flags, nvcc_version: version, sass_tools: true, source }.key()
    }

    #[test]
    fn the_key_changes_with_every_input() {
        let base = key("src", "v1");
        assert_eq!(base, key("src", "v1"));
        assert_ne!(base, key("src2", "v1"));
        assert_ne!(base, key("src", "v2"));
        let flags = vec!["-O2".to_string()];
        let other = KeyParts {
            name: "apk",
            arch: "sm_90a",
            flags: &flags,
            nvcc_version: "v1",
            sass_tools: true,
            source: "src",
        };
        assert_ne!(base, other.key());
        let arch = KeyParts { arch: "sm_80", flags: &["-O3".to_string()], ..other };
        assert_ne!(base, arch.key());
    }

    #[test]
    fn round_trips_and_refuses_a_damaged_entry() {
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache::at(dir.path().join("c"));
        let k = key("src", "v1");
        assert!(cache.get(&k).is_none());
        cache.put(&k, &compiled(b"cubin bytes")).unwrap();
        let got = cache.get(&k).unwrap();
        assert_eq!((got.cubin.as_slice(), got.stats[0].registers), (&b"cubin bytes"[..], 10));
        // A second store of the same entry (a racing compile) is fine.
        cache.put(&k, &compiled(b"cubin bytes")).unwrap();
        // A damaged cubin is a miss, and the next store replaces it.
        std::fs::write(cache.root().join(&k).join("kernel.cubin"), b"garbage").unwrap();
        assert!(cache.get(&k).is_none());
        cache.put(&k, &compiled(b"cubin bytes")).unwrap();
        assert_eq!(cache.get(&k).unwrap().cubin, b"cubin bytes");
        // No temporary directories are left behind.
        let names: Vec<String> = std::fs::read_dir(cache.root())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec![k]);
    }

    #[test]
    fn concurrent_stores_leave_one_whole_entry() {
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache::at(dir.path());
        let k = key("racy", "v1");
        let c = compiled(&vec![7u8; 1 << 20]);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    cache.put(&k, &c).unwrap();
                    // Whatever a reader sees is whole.
                    if let Some(got) = cache.get(&k) {
                        assert_eq!(got.cubin.len(), 1 << 20);
                    }
                });
            }
        });
        assert_eq!(cache.get(&k).unwrap().cubin, c.cubin);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
