//! The real-toolchain tier: every emitted `.cu` of every example deployment
//! compiles with a real nvcc for its target (sm_90a, or sm_80 for the
//! portable path) with warnings as errors and no spills, and ptxas figures
//! reach report.md. Skipped (with a message) when no nvcc is installed,
//! unless MOEFORGE_REQUIRE_NVCC=1, as in scripts/test.sh and CI.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use moeforge::plan::KernelParams;
use moeforge::runtime::load_bundle;

#[test]
fn every_example_compiles_with_nvcc_without_spills() {
    let Some(nvcc) = nvcc() else {
        eprintln!("skipping the nvcc tier: no nvcc (run scripts/setup.sh)");
        return;
    };
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    for ex in examples() {
        let out = tmp.path().join(stem(&ex));
        let o = moeforge(
            &["compile", ex.to_str().unwrap_or_default(), "-o", out.to_str().unwrap_or_default()],
            Some(&nvcc),
        );
        assert!(o.status.success(), "{}:\n{}", ex.display(), text(&o.stderr));
        let b = load_bundle(&out).unwrap_or_else(|e| panic!("{e}"));
        assert!(b.manifest.cubins, "{}: no cubins", ex.display());
        for k in &b.plan.kernels {
            let cubin = std::fs::read(out.join(format!("kernels/{}.cubin", k.name))).unwrap_or_default();
            assert!(cubin.starts_with(b"\x7fELF"), "{}: {} is not an ELF cubin", ex.display(), k.name);
            // What a device is handed with the source (a serving machine loads it without nvcc).
            assert_eq!(b.cubins.get(&k.name), Some(&cubin), "{}: {}", ex.display(), k.name);
            // And what the cuda device lets through to the driver.
            moeforge::cuda::check_cubin(&cubin).unwrap_or_else(|e| panic!("{}: {}: {e}", ex.display(), k.name));
        }
        assert_eq!(b.cubins.len(), b.plan.kernels.len(), "{}", ex.display());
        let report = std::fs::read_to_string(out.join("report.md")).unwrap_or_default();
        assert!(report.contains("Compiled with nvcc"), "{report}");
        // The APK's hardware path, from its SASS: warpgroup MMA fed by TMA on
        // sm_90a; mma.sync fed by ldmatrix and cp.async on the portable path.
        for k in b.plan.kernels.iter().filter(|k| matches!(k.params, KernelParams::Apk(_))) {
            let cubin = out.join(format!("kernels/{}.cubin", k.name));
            let sass = moeforge::codegen::nvcc::sass_counts(&nvcc, &cubin).unwrap_or_else(|| {
                panic!("no cuobjdump/nvdisasm next to {} (scripts/setup.sh installs them)", nvcc.display())
            });
            for f in moeforge::codegen::target::of(k.arch).sass_families() {
                assert!(sass[*f] > 0, "{}: {} has no {f} instruction: {sass:?}", ex.display(), k.name);
            }
            assert!(report.contains("SASS (cuobjdump)"), "{}: no SASS line in report.md", ex.display());
        }
        // The prefill attention's tensor-core path: mma.sync in the layer kernels' SASS.
        for k in b.plan.kernels.iter().filter(|k| k.entries.iter().any(|e| e.symbol == "flash_prefill")) {
            let cubin = out.join(format!("kernels/{}.cubin", k.name));
            let sass = moeforge::codegen::nvcc::sass_counts(&nvcc, &cubin).unwrap_or_default();
            let hmma = sass.get("HMMA").copied().unwrap_or(0);
            assert!(hmma > 0, "{}: {} (flash_prefill) has no HMMA: {sass:?}", ex.display(), k.name);
        }
        for k in &b.plan.kernels {
            for e in &k.entries {
                let row = report
                    .lines()
                    .find(|l| l.starts_with(&format!("| `{}`", e.symbol)))
                    .unwrap_or_else(|| panic!("{}: no report row for {}", ex.display(), e.symbol));
                let cells: Vec<&str> = row.split('|').map(str::trim).collect();
                let regs: u32 = cells[3].parse().unwrap_or_else(|_| panic!("no register count in {row}"));
                assert!(regs > 0 && regs <= 255, "{row}");
                assert_eq!(cells[4], "0/0", "{}: spills in {row}", ex.display());
                assert_eq!(cells[5], "0", "{}: stack frame in {row}", ex.display());
            }
        }
        // cubins are deterministic too: nvcc again, filling a cache this time…
        let cache = tmp.path().join(format!("{}-cache", stem(&ex)));
        let again = tmp.path().join(format!("{}-again", stem(&ex)));
        let o = moeforge_with_cache(
            &["compile", ex.to_str().unwrap_or_default(), "-o", again.to_str().unwrap_or_default()],
            Some(&nvcc),
            &cache,
        );
        assert!(o.status.success());
        assert!(!text(&o.stdout).contains("kernel cache"), "{}", text(&o.stdout));
        assert_eq!(read_tree(&out), read_tree(&again), "{}: nvcc output differs between runs", ex.display());
        // …and from the warm cache, every kernel without nvcc, the same bytes.
        let cached = tmp.path().join(format!("{}-cached", stem(&ex)));
        let o = moeforge_with_cache(
            &["compile", ex.to_str().unwrap_or_default(), "-o", cached.to_str().unwrap_or_default()],
            Some(&nvcc),
            &cache,
        );
        assert!(o.status.success());
        let n = b.plan.kernels.len();
        assert!(
            text(&o.stdout).contains(&format!("{n} from the kernel cache, 0 by nvcc")),
            "{}: {}",
            ex.display(),
            text(&o.stdout)
        );
        assert_eq!(read_tree(&out), read_tree(&cached), "{}: the cached bundle differs", ex.display());
        // --no-cache runs nvcc even so (once: it costs a full build).
        if ex != examples()[0] {
            continue;
        }
        let o = moeforge_with_cache(
            &["compile", ex.to_str().unwrap_or_default(), "-o", cached.to_str().unwrap_or_default(), "--no-cache"],
            Some(&nvcc),
            &cache,
        );
        assert!(o.status.success() && !text(&o.stdout).contains("kernel cache"), "{}", text(&o.stdout));
    }
}

#[test]
fn nvcc_errors_are_reported_with_the_kernel_name() {
    let Some(nvcc) = nvcc() else {
        eprintln!("skipping: no nvcc");
        return;
    };
    let e =
        moeforge::codegen::nvcc::compile(&nvcc, "broken", "extern \"C\" __global__ void k() { int x = ; }", "sm_90a")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
    assert!(e.contains("kernels/broken.cu") && e.contains("sm_90a") && e.contains("error"), "{e}");
    // A warning is an error too.
    let e = moeforge::codegen::nvcc::compile(
        &nvcc,
        "warns",
        "extern \"C\" __global__ void k(int* p) { int unused_var; p[0] = 1; }",
        "sm_90a",
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(e.contains("kernels/warns.cu"), "a warning passed: {e}");
    // Serialized wgmma (ptxas only remarks on it) is an error too.
    let serialized = r#"extern "C" __global__ void k(float* out, unsigned long long da, unsigned long long db) {
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %6, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 { %0, %1, %2, %3 }, %4, %5, p, 1, 1, 0, 0;\n\t}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db), "r"(1));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  if (threadIdx.x == 0) d[0] = out[0];  // an accumulator redefined while its wgmma is in flight
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  out[threadIdx.x] = d[0] + d[1] + d[2] + d[3];
}"#;
    let e = moeforge::codegen::nvcc::compile(&nvcc, "serial", serialized, "sm_90a")
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("kernels/serial.cu") && e.contains("serializes wgmma"), "serialized wgmma passed: {e}");
}

/// The GPU check's drivers build, host code and all: scripts/gpu/apk_check.cu
/// around an emitted APK for both targets, and scripts/gpu/route_check.cu
/// around an emitted routing kernel, so `scripts/gpu-check.sh` does not
/// first fail on a device machine.
#[test]
fn the_gpu_check_driver_builds_around_emitted_apks() {
    let Some(nvcc) = nvcc() else {
        eprintln!("skipping: no nvcc");
        return;
    };
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    for (example, gencode, variant) in [
        ("tiny-qwen3-cpu4", "-gencode=arch=compute_90a,code=sm_90a", "-DAPK_DYNAMIC"),
        ("tiny-qwen3-cpu4", "-gencode=arch=compute_90a,code=sm_90a", "-DAPK_STATIC_TILES"),
        ("minimax-m2-h800", "-gencode=arch=compute_90a,code=sm_90a", "-DAPK_DYNAMIC"),
        ("mixtral-8x7b-a100", "-gencode=arch=compute_80,code=compute_80", "-DAPK_DYNAMIC"),
        ("mixtral-8x7b-a100", "-gencode=arch=compute_80,code=compute_80", "-DAPK_STATIC_TILES"),
    ] {
        let out = tmp.path().join(format!("{example}{variant}"));
        let o = moeforge(
            &["compile", &format!("examples/{example}.moe"), "-o", out.to_str().unwrap_or_default(), "--nvcc", "off"],
            None,
        );
        assert!(o.status.success(), "{}", text(&o.stderr));
        let o = std::process::Command::new(&nvcc)
            .args([gencode, variant, "-O3", "-std=c++17", "-Werror", "all-warnings"])
            .arg(format!("-DKERNEL_SOURCE=\"{}\"", out.join("kernels/apk.cu").display()))
            .arg("-o")
            .arg(tmp.path().join(format!("{example}{variant}-check")))
            .arg(root().join("scripts/gpu/apk_check.cu"))
            .output()
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(o.status.success(), "{example}: {}", text(&o.stderr));
    }
    // The routing step's driver, around GLM-5's routing kernel.
    let out = tmp.path().join("glm-5");
    let o = moeforge(
        &["compile", "examples/glm-5-h800x24.moe", "-o", out.to_str().unwrap_or_default(), "--nvcc", "off"],
        None,
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = std::process::Command::new(&nvcc)
        .args(["-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-Werror", "all-warnings"])
        .arg(format!("-DKERNEL_SOURCE=\"{}\"", out.join("kernels/zepp_route.cu").display()))
        .arg("-o")
        .arg(tmp.path().join("route_check"))
        .arg(root().join("scripts/gpu/route_check.cu"))
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(o.status.success(), "route_check: {}", text(&o.stderr));
}

/// Each `load`'s kernel name and the cubin it was handed.
type Loads = std::sync::Arc<std::sync::Mutex<Vec<(String, Option<Vec<u8>>)>>>;

/// A device that records what each `load` was handed and loads nothing.
struct Recorder(Loads, u32);

use moeforge::runtime::device::{Batch, BufferId, Code, Device, DeviceError, KernelArg, ModuleId};

impl Device for Recorder {
    fn alloc(&mut self, _: u64) -> Result<BufferId, DeviceError> {
        self.1 += 1;
        Ok(BufferId(self.1 - 1))
    }
    fn upload(&mut self, _: BufferId, _: u64, _: &[u8]) -> Result<(), DeviceError> {
        Ok(())
    }
    fn download(&mut self, _: BufferId, _: u64, len: u64) -> Result<Vec<u8>, DeviceError> {
        Ok(vec![0; len as usize])
    }
    fn transfer(&mut self, _: &Code, _: &[Batch], _: &[BufferId]) -> Result<(), DeviceError> {
        Ok(())
    }
    fn load(&mut self, name: &str, _: &str, cubin: Option<&[u8]>) -> Result<ModuleId, DeviceError> {
        let mut l = self.0.lock().unwrap();
        l.push((name.to_string(), cubin.map(<[u8]>::to_vec)));
        Ok(ModuleId(l.len() as u32 - 1))
    }
    fn launch(&mut self, _: ModuleId, _: &str, _: u32, _: u32, _: &[KernelArg]) -> Result<(), DeviceError> {
        Ok(())
    }
}

/// A bundle compiled with nvcc hands each kernel's cubin to the device with
/// its source (what lets the cuda device load it without nvcc), the bytes
/// of `kernels/{name}.cubin`; compiled without, none.
#[test]
fn the_executor_hands_the_bundles_cubins_to_the_device() {
    let Some(nvcc) = nvcc() else {
        eprintln!("skipping: no nvcc");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    for (with, dir) in [(true, tmp.path().join("with")), (false, tmp.path().join("without"))] {
        let mut args = vec!["compile", "examples/tiny-qwen3-cpu4.moe", "-o", dir.to_str().unwrap()];
        if !with {
            args.extend(["--nvcc", "off"]);
        }
        let o = moeforge(&args, with.then_some(nvcc.as_path()));
        assert!(o.status.success(), "{}", text(&o.stderr));
        let b = load_bundle(&dir).unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(vec![]));
        let dev = Recorder(std::sync::Arc::clone(&seen), 0);
        moeforge::runtime::device::exec::Executor::new(
            Box::new(dev),
            b.plan.plan(),
            &b.kernels,
            &b.cubins,
            &b.transfers,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let seen = seen.lock().unwrap();
        assert!(seen.len() >= 4, "{seen:?}");
        for (name, cubin) in seen.iter() {
            let file = std::fs::read(dir.join(format!("kernels/{name}.cubin"))).ok();
            assert_eq!(cubin, &file, "{name}: with nvcc {with}");
            assert_eq!(cubin.is_some(), with, "{name}");
        }
    }
}
