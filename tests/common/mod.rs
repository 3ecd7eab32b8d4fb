//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub mod cpu_spec;
pub mod sim_fixture;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every example deployment, sorted.
pub fn examples() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join("examples"))
        .map(|rd| {
            rd.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "moe")).collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Writes the spec `dir/name`: a `use` line per repository file in `uses`
/// (e.g. `models/clusters.moe`), then `body`.
pub fn write_spec(dir: &Path, name: &str, uses: &[&str], body: &str) -> PathBuf {
    let f = dir.join(name);
    let mut text: String = uses.iter().map(|u| format!("use \"{}\"\n", root().join(u).display())).collect();
    text.push_str(body);
    std::fs::write(&f, text).unwrap_or_else(|e| panic!("cannot write {}: {e}", f.display()));
    f
}

pub fn stem(p: &Path) -> String {
    p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
}

/// Runs the CLI with `MOEFORGE_NVCC` cleared unless `nvcc` is given, and a
/// kernel cache of its own (empty, removed afterwards), so that no test
/// reads kernels a previous run left in the user's cache.
pub fn moeforge(args: &[&str], nvcc: Option<&Path>) -> Output {
    let cache = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    moeforge_with_cache(args, nvcc, cache.path())
}

/// [`moeforge`] with environment variables `vars` set.
pub fn moeforge_with_env(args: &[&str], vars: &[(&str, &str)]) -> Output {
    let cache = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut cmd = command(args, None, cache.path());
    cmd.envs(vars.iter().copied());
    cmd.output().unwrap_or_else(|e| panic!("cannot run moeforge: {e}"))
}

/// [`moeforge`] with the kernel cache at `cache`.
pub fn moeforge_with_cache(args: &[&str], nvcc: Option<&Path>, cache: &Path) -> Output {
    command(args, nvcc, cache).output().unwrap_or_else(|e| panic!("cannot run moeforge: {e}"))
}

/// The command [`moeforge_with_cache`] runs.
fn command(args: &[&str], nvcc: Option<&Path>, cache: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_moeforge"));
    cmd.args(args)
        .current_dir(root())
        .env_remove("MOEFORGE_NVCC")
        .env_remove("MOEFORGE_CUDA_DEVICE")
        .env_remove("MOEFORGE_CUDA_DEVICES")
        .env("PATH", "/usr/bin:/bin")
        .env("MOEFORGE_CACHE_DIR", cache);
    if let Some(n) = nvcc {
        cmd.env("MOEFORGE_NVCC", n);
    }
    cmd
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// All files under `dir`, relative path → bytes.
pub fn read_tree(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    fn walk(base: &Path, dir: &Path, out: &mut std::collections::BTreeMap<String, Vec<u8>>) {
        let Ok(rd) = std::fs::read_dir(dir) else { return };
        for e in rd.filter_map(|e| e.ok()) {
            let p = e.path();
            if p.is_dir() {
                walk(base, &p, out);
            } else {
                let rel = p.strip_prefix(base).map(|r| r.display().to_string()).unwrap_or_default();
                out.insert(rel, std::fs::read(&p).unwrap_or_default());
            }
        }
    }
    let mut out = std::collections::BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// The nvcc for the real-toolchain tier: `$MOEFORGE_NVCC`, or the one
/// `scripts/setup.sh` installs. `None` means the tier cannot run here; with
/// `MOEFORGE_REQUIRE_NVCC=1` (set by scripts/test.sh and CI) that is a failure.
pub fn nvcc() -> Option<PathBuf> {
    let from_env = std::env::var_os("MOEFORGE_NVCC").map(PathBuf::from).filter(|p| p.is_file());
    let found = from_env.or_else(|| {
        let venv = root().join(".toolchain/venv/lib");
        std::fs::read_dir(&venv).ok()?.filter_map(|e| e.ok()).find_map(|py| {
            let nvidia = py.path().join("site-packages/nvidia");
            std::fs::read_dir(nvidia)
                .ok()?
                .filter_map(|e| e.ok())
                .map(|cu| cu.path().join("bin/nvcc"))
                .find(|p| p.is_file())
        })
    });
    if found.is_none() && std::env::var("MOEFORGE_REQUIRE_NVCC").is_ok_and(|v| v == "1") {
        panic!("MOEFORGE_REQUIRE_NVCC=1 but no nvcc: run scripts/setup.sh or set MOEFORGE_NVCC");
    }
    found
}

/// Test-input helpers over the project's SplitMix64.
pub struct Rng(pub u64);

impl Rng {
    fn inner(&mut self) -> u64 {
        let mut g = moeforge::plan::rng::SplitMix64(self.0);
        let v = g.next_u64();
        self.0 = g.0;
        v
    }
    /// Uniform in `[0, n)`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.inner() % n as u64) as usize
    }
    /// Uniform in `[-1, 1)`.
    pub fn unit(&mut self) -> f32 {
        (self.inner() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// A random permutation of `0..n`.
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            v.swap(i, self.below(i + 1));
        }
        v
    }
}

/// Builds a host-emulation driver from runtime/shim with an emitted kernel
/// source included (`-DKERNEL_SOURCE`); `extra` adds flags (e.g. a sanitizer).
pub fn build_host_driver(dir: &Path, driver: &str, kernel_src: &[u8], tag: &str, extra: &[&str]) -> PathBuf {
    let src = dir.join(format!("{tag}.cu"));
    std::fs::write(&src, kernel_src).unwrap_or_else(|e| panic!("{e}"));
    let bin = dir.join(tag);
    let shim = root().join("runtime/shim");
    let o = Command::new("g++")
        .args(["-std=c++20", "-O1", "-g", "-pthread", "-fno-strict-aliasing", "-ffp-contract=off"])
        .args(["-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas", "-Wno-unused-parameter"])
        .args(["-Wno-psabi", "-DMOEFORGE_HOST"])
        .args(extra)
        .arg(format!("-I{}", shim.display()))
        .arg(format!("-DKERNEL_SOURCE=\"{}\"", src.display()))
        .arg(shim.join(driver))
        .arg("-o")
        .arg(&bin)
        .output()
        .unwrap_or_else(|e| panic!("g++ is required for the host-emulation tier (scripts/test.sh installs it): {e}"));
    assert!(o.status.success(), "{tag}: g++ failed:\n{}", text(&o.stderr));
    bin
}
