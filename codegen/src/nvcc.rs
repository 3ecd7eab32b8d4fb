//! The real-toolchain tier: compiling emitted CUDA with nvcc.
//!
//! nvcc comes from NVIDIA's PyPI wheels (`scripts/setup.sh`), which run on a
//! machine without a GPU. Each kernel is compiled to a cubin for its target
//! with every warning an error, and ptxas's per-function report (registers,
//! spills, stack, shared memory) is parsed into [`PtxasStats`]. A spill, a
//! local-memory stack frame or serialized wgmma is an error: the kernels are
//! written to avoid all three.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Command;

/// How `compile` finds nvcc.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NvccMode {
    /// `$MOEFORGE_NVCC`, else `nvcc` on `PATH`; skip compilation if neither exists.
    #[default]
    Auto,
    /// Do not compile.
    Off,
    /// This nvcc; failing to run it is an error.
    Path(PathBuf),
}

impl NvccMode {
    /// The nvcc to use, if any. `Path` is returned even if missing, so that
    /// running it reports the problem.
    pub fn resolve(&self) -> Option<PathBuf> {
        match self {
            NvccMode::Off => None,
            NvccMode::Path(p) => Some(p.clone()),
            NvccMode::Auto => {
                if let Some(p) = std::env::var_os("MOEFORGE_NVCC").filter(|p| !p.is_empty()) {
                    return Some(PathBuf::from(p));
                }
                let path = std::env::var_os("PATH")?;
                std::env::split_paths(&path).map(|d| d.join("nvcc")).find(|p| p.is_file())
            }
        }
    }
}

/// ptxas's report for one kernel function.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtxasStats {
    pub function: String,
    pub registers: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub stack_frame: u32,
    pub static_smem: u32,
    pub barriers: u32,
}

#[derive(Clone, Debug)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub stats: Vec<PtxasStats>,
    pub nvcc_version: String,
    /// Counts of the SASS instruction families that show which hardware path
    /// the kernel uses, from `cuobjdump -sass`; `None` without cuobjdump and
    /// nvdisasm next to nvcc.
    pub sass: Option<SassCounts>,
}

/// SASS opcode families → instruction count in the cubin.
pub type SassCounts = std::collections::BTreeMap<String, u32>;

/// The families counted: Hopper warpgroup MMA, TMA loads and mbarrier
/// operations; Ampere-style MMA, `ldmatrix` and `cp.async`.
pub const SASS_FAMILIES: [&str; 6] = ["HGMMA", "UTMALDG", "SYNCS", "HMMA", "LDSM", "LDGSTS"];

#[derive(Debug, thiserror::Error)]
pub enum NvccError {
    #[error("cannot run nvcc at {path}: {err}")]
    Spawn { path: String, err: String },
    #[error("nvcc rejected kernels/{name}.cu for {arch}:\n{stderr}")]
    Failed { name: String, arch: String, stderr: String },
    #[error("kernels/{name}.cu: `{function}` spills ({stores} bytes stored, {loads} loaded) or uses a {stack}-byte stack frame")]
    Spills { name: String, function: String, stores: u32, loads: u32, stack: u32 },
    #[error("kernels/{name}.cu: ptxas serializes wgmma ({remark}); keep wgmma out of divergent code")]
    WgmmaSerialized { name: String, remark: String },
    #[error("cannot use a temporary directory for nvcc: {0}")]
    Io(String),
}

/// `nvcc` as a command whose output depends on its input only: cicc's
/// optimizer orders some work by heap address, so under address-space
/// randomization, or with a source path or environment of another length,
/// the same source gave one of two PTX files (and cubins) from run to run. On Linux nvcc then runs under `setarch -R` (no
/// randomization for it and the cicc and ptxas it starts) where util-linux's
/// `setarch` can do it (a container's seccomp profile may forbid it).
fn deterministic(nvcc: &Path) -> Command {
    static SETARCH: std::sync::OnceLock<Option<&'static Path>> = std::sync::OnceLock::new();
    let setarch = SETARCH.get_or_init(|| {
        let found = ["/usr/bin/setarch", "/bin/setarch"].into_iter().map(Path::new).find(|p| p.is_file())?;
        let works =
            Command::new(found).args([std::env::consts::ARCH, "-R", "true"]).output().is_ok_and(|o| o.status.success());
        (cfg!(target_os = "linux") && works).then_some(found)
    });
    match setarch {
        Some(s) => {
            let mut c = Command::new(s);
            c.arg(std::env::consts::ARCH).arg("-R").arg(nvcc);
            c
        }
        None => Command::new(nvcc),
    }
}

/// Compiles one kernel source. `name` is the kernel's name (the file stem).
pub fn compile(nvcc: &Path, name: &str, source: &str, arch: &str) -> Result<Compiled, NvccError> {
    let dir = tempfile::tempdir().map_err(|e| NvccError::Io(e.to_string()))?;
    let src = dir.path().join(format!("{name}.cu"));
    let out = dir.path().join(format!("{name}.cubin"));
    std::fs::write(&src, source).map_err(|e| NvccError::Io(e.to_string()))?;
    let output = deterministic(nvcc)
        .args(crate::target::nvcc_flags(arch))
        // Relative names: the temporary directory's (random) path must not
        // reach nvcc, whose output depends on its heap layout (see above).
        .arg("-o")
        .arg(format!("{name}.cubin"))
        .arg(format!("{name}.cu"))
        .current_dir(dir.path())
        // A fixed environment (the heap layout depends on its size too):
        // the search path, and nvcc's temporary files next to the source.
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("TMPDIR", dir.path())
        .env("LC_ALL", "C")
        .output()
        .map_err(|e| NvccError::Spawn { path: nvcc.display().to_string(), err: e.to_string() })?;
    let stderr = String::from_utf8_lossy(&output.stderr).replace(&dir.path().display().to_string(), "");
    if !output.status.success() {
        return Err(NvccError::Failed { name: name.to_string(), arch: arch.to_string(), stderr });
    }
    let stats = parse_ptxas(&stderr);
    if let Some(s) = stats.iter().find(|s| s.spill_stores > 0 || s.spill_loads > 0 || s.stack_frame > 0) {
        return Err(NvccError::Spills {
            name: name.to_string(),
            function: s.function.clone(),
            stores: s.spill_stores,
            loads: s.spill_loads,
            stack: s.stack_frame,
        });
    }
    // ptxas falls back to serialized wgmma (a large slowdown, not an error) when
    // accumulators are touched in divergent code; the kernels are written to avoid it.
    if let Some(l) = stderr.lines().find(|l| l.contains("wgmma.mma_async instructions are serialized")) {
        return Err(NvccError::WgmmaSerialized { name: name.to_string(), remark: l.trim().to_string() });
    }
    let cubin = std::fs::read(&out).map_err(|e| NvccError::Io(e.to_string()))?;
    Ok(Compiled { cubin, stats, nvcc_version: version(nvcc), sass: sass_counts(nvcc, &out) })
}

/// Whether cuobjdump and nvdisasm sit next to `nvcc` (then compiles count SASS).
pub fn sass_tools(nvcc: &Path) -> bool {
    nvcc.parent().is_some_and(|b| b.join("cuobjdump").is_file() && b.join("nvdisasm").is_file())
}

/// The whole `nvcc --version` output (the kernel cache's key holds it);
/// `None` when nvcc does not run.
pub fn full_version(nvcc: &Path) -> Option<String> {
    let o = Command::new(nvcc).arg("--version").output().ok().filter(|o| o.status.success())?;
    Some(String::from_utf8_lossy(&o.stdout).into_owned())
}

/// Disassembles a cubin with the cuobjdump next to `nvcc` (it needs nvdisasm
/// there too, as the PyPI wheels install them) and counts [`SASS_FAMILIES`].
pub fn sass_counts(nvcc: &Path, cubin: &Path) -> Option<SassCounts> {
    if !sass_tools(nvcc) {
        return None;
    }
    let bin = nvcc.parent()?;
    let cuobjdump = bin.join("cuobjdump");
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![bin.to_path_buf()];
    dirs.extend(std::env::split_paths(&path));
    let out = Command::new(&cuobjdump)
        .arg("-sass")
        .arg(cubin)
        .env("PATH", std::env::join_paths(dirs).ok()?)
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    Some(count_sass(&String::from_utf8_lossy(&out.stdout)))
}

/// Counts instructions by opcode family in a `cuobjdump -sass` listing, whose
/// instruction lines read `/*0a40*/   @!P0 HGMMA.64x128x16.F32.BF16 … ;`.
pub fn count_sass(listing: &str) -> SassCounts {
    let mut counts: SassCounts = SASS_FAMILIES.iter().map(|f| (f.to_string(), 0)).collect();
    for line in listing.lines() {
        let Some(rest) = line.trim_start().strip_prefix("/*").and_then(|r| r.split_once("*/")).map(|(_, r)| r) else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let Some(mut op) = words.next() else { continue };
        if op.starts_with('@') {
            op = words.next().unwrap_or_default();
        }
        let family = op.split('.').next().unwrap_or_default();
        if let Some(n) = counts.get_mut(family) {
            *n += 1;
        }
    }
    counts
}

/// `release X.Y, VX.Y.Z` from `nvcc --version`.
pub fn version(nvcc: &Path) -> String {
    Command::new(nvcc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout).lines().find(|l| l.contains("release")).map(|l| l.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".to_string())
}

/// Parses `ptxas info` lines. Shape (per function):
/// ```text
/// ptxas info    : Compiling entry function 'moe_router' for 'sm_90a'
/// ptxas info    : Function properties for moe_router
///     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 30 registers, used 0 barriers, 512 bytes smem
/// ```
pub fn parse_ptxas(stderr: &str) -> Vec<PtxasStats> {
    let mut out: Vec<PtxasStats> = Vec::new();
    let mut current: Option<PtxasStats> = None;
    for line in stderr.lines() {
        let line = line.trim();
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            if let Some(s) = current.take() {
                out.push(s);
            }
            let function = rest.split('\'').next().unwrap_or_default().to_string();
            current = Some(PtxasStats { function, ..Default::default() });
        } else if let Some(s) = current.as_mut() {
            if line.contains("bytes stack frame") {
                s.stack_frame = number_before(line, "bytes stack frame");
                s.spill_stores = number_before(line, "bytes spill stores");
                s.spill_loads = number_before(line, "bytes spill loads");
            } else if line.contains("Used") && line.contains("registers") {
                s.registers = number_before(line, "registers");
                s.barriers = number_before(line, "barriers");
                s.static_smem = number_before(line, "bytes smem");
            }
        }
    }
    out.extend(current);
    out
}

fn number_before(line: &str, marker: &str) -> u32 {
    line.split(marker)
        .next()
        .and_then(|head| head.split(|c: char| !c.is_ascii_digit()).rfind(|t| !t.is_empty()))
        .and_then(|n| n.parse().ok())
        .filter(|_| line.contains(marker))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_sass_families() {
        let listing =
            "        /*0a40*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;  /* 0x... */\n\
        /*0a50*/              @!P0 SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR5], RZ ;\n\
        /*0a60*/                   UTMALDG.2D.MULTICAST [UR8], [UR14], UR6 ;\n\
        /*0a70*/                   IMAD R1, R2, R3, R4 ;\n\
        Function : moe_apk\n";
        let c = count_sass(listing);
        assert_eq!((c["HGMMA"], c["SYNCS"], c["UTMALDG"], c["HMMA"]), (1, 1, 1, 0));
    }

    #[test]
    fn parses_ptxas_report() {
        let text = "ptxas info    : 0 bytes gmem\nptxas info    : Compiling entry function 'k' for 'sm_90a'\n\
ptxas info    : Function properties for k\n    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
ptxas info    : Used 10 registers, used 1 barriers, 64 bytes smem\n";
        let s = parse_ptxas(text);
        assert_eq!(
            s,
            vec![PtxasStats {
                function: "k".into(),
                registers: 10,
                spill_stores: 4,
                spill_loads: 4,
                stack_frame: 8,
                static_smem: 64,
                barriers: 1
            }]
        );
    }
}
