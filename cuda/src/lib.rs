//! The cuda backend's device (`moeforge run --backend cuda`): the runtime's
//! [`Device`] on an NVIDIA GPU through the CUDA driver API (cudarc, the
//! driver library loaded at run time, so this crate builds and links on
//! machines without CUDA). The program interpreter
//! (`moeforge_runtime::device::exec`) runs the same programs on it as on the
//! emulated device: each rank's unified buffer one `cuMemAlloc` at the plan's
//! size, weights uploaded into their views, every op's launch bound by the
//! same `bind`, the reshard's strided copies as `cuMemcpy2D`.
//!
//! - [`probe`] answers first: no driver library, a driver without a GPU, or
//!   the GPUs it sees. A missing driver is an error, never a panic (cudarc
//!   panics at the first call into a library it cannot load).
//! - Kernel instances are built from the bundle's emitted source with nvcc
//!   for this GPU (`sm_90a` on compute capability 9.0), cached by content
//!   under `MOEFORGE_CUDA_CACHE` (`~/.cache/moeforge/cuda`), and loaded as
//!   cubins.
//! - The APK's per-operation launch: the entry's `_prepare` kernel binds the
//!   flat arguments into its `Templates` and `State` on the GPU
//!   (`apk::bind_operation`, the emulated device's binding), recording the
//!   tensor maps' encode calls; the host encodes them with
//!   `cuTensorMapEncodeTiled` into the templates, then launches the
//!   persistent grid (its compile-time cluster dims, its dynamic shared
//!   memory, at most the clusters that can be co-resident) with the
//!   operation and `stop` posted, and checks the operation's `done`.
//! - A launch returns once the GPU finished it (the [`Device`] contract):
//!   the stream is polled, and a launch still running after
//!   `MOEFORGE_CUDA_WATCHDOG_S` seconds (60) is an error naming it.
//! - Every rank's buffer lives on one GPU (ordinal 0 unless
//!   `MOEFORGE_CUDA_DEVICE` says otherwise): the interpreter's communication
//!   ops are copies between buffers of one process. Peer access across a
//!   node's GPUs, CUDA graphs and one-sided communication are not here yet.

use cudarc::driver::result;
use cudarc::driver::sys;
use moeforge_runtime::device::{Batch, BufferId, Code, Device, DeviceError, KernelArg, ModuleId};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::ffi::{c_void, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// What the driver sees.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub capability: (u32, u32),
    pub sms: u32,
    pub memory_bytes: u64,
}

fn other(what: impl std::fmt::Display) -> DeviceError {
    DeviceError::Other(what.to_string())
}

fn driver(call: &str, e: result::DriverError) -> DeviceError {
    let name = e.error_name().map(|c| c.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{e:?}"));
    DeviceError::Other(format!("{call}: {name}"))
}

/// The GPUs the driver sees. Errors (never panics) when the driver library
/// cannot be loaded, the driver finds no device, or it sees none.
pub fn probe() -> Result<Vec<Gpu>, DeviceError> {
    // SAFETY: only tries to open the driver library; no driver call yet.
    if !unsafe { sys::is_culib_present() } {
        return Err(other(
            "no CUDA driver found (libcuda.so could not be loaded): the cuda backend needs an NVIDIA GPU and its \
             driver; `--backend emu` runs the same program on the emulated device",
        ));
    }
    result::init().map_err(|e| match e.0 {
        sys::cudaError_enum::CUDA_ERROR_NO_DEVICE => {
            other("the CUDA driver is installed but sees no GPU (cuInit: CUDA_ERROR_NO_DEVICE)")
        }
        _ => driver("cuInit", e),
    })?;
    let n = result::device::get_count().map_err(|e| driver("cuDeviceGetCount", e))?;
    if n < 1 {
        return Err(other("the CUDA driver sees no GPU"));
    }
    (0..n)
        .map(|i| {
            let dev = result::device::get(i).map_err(|e| driver("cuDeviceGet", e))?;
            let attr = |a| {
                // SAFETY: `dev` is a device handle the driver just returned.
                unsafe { result::device::get_attribute(dev, a) }.map_err(|e| driver("cuDeviceGetAttribute", e))
            };
            use sys::CUdevice_attribute::*;
            Ok(Gpu {
                ordinal: i as usize,
                name: result::device::get_name(dev).map_err(|e| driver("cuDeviceGetName", e))?,
                capability: (
                    attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32,
                    attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32,
                ),
                sms: attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
                // SAFETY: as above.
                memory_bytes: unsafe { result::device::total_mem(dev) }.map_err(|e| driver("cuDeviceTotalMem", e))?
                    as u64,
            })
        })
        .collect()
}

/// The default build cache.
pub fn default_cache() -> PathBuf {
    if let Some(d) = std::env::var_os("MOEFORGE_CUDA_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("moeforge").join("cuda")
}

/// nvcc: `MOEFORGE_NVCC`, else `nvcc` on the PATH, else CUDA's default prefix.
fn nvcc() -> PathBuf {
    if let Some(p) = std::env::var_os("MOEFORGE_NVCC") {
        return PathBuf::from(p);
    }
    let on_path =
        std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).map(|d| d.join("nvcc")).find(|c| c.is_file()));
    on_path.unwrap_or_else(|| PathBuf::from("/usr/local/cuda/bin/nvcc"))
}

/// The APK entry's launch geometry and layout, from its `_layout` kernel.
struct Apk {
    prepare: sys::CUfunction,
    templates_bytes: usize,
    smem: u32,
    threads: u32,
    cluster: u32,
    /// Clusters a launch may use: the kernel's bound and co-residency.
    clusters: u32,
    done_offset: [u64; 2],
    call_words: usize,
    /// Device scratch: the templates `_prepare` writes, the state, the recorded maps.
    templates: sys::CUdeviceptr,
    state: sys::CUdeviceptr,
    calls: sys::CUdeviceptr,
}

struct Module {
    name: String,
    module: sys::CUmodule,
    functions: BTreeMap<String, sys::CUfunction>,
    /// The entries with a `_prepare` kernel in the source (APK launches).
    apk_entries: Vec<String>,
    /// Per APK entry: its launch, set up on first use.
    apk: BTreeMap<String, Apk>,
}

/// The entries whose source defines `{entry}_prepare` (the APK's cuda launch).
fn apk_entries(source: &str) -> Vec<String> {
    source
        .lines()
        .filter(|l| l.contains("__global__ void "))
        .filter_map(|l| {
            let name = l.split("__global__ void ").nth(1)?.split('(').next()?.trim();
            name.strip_suffix("_prepare").map(str::to_string)
        })
        .collect()
}

/// Recorded encode calls per `_prepare`: a count word, then at most four maps.
const MAX_MAPS: usize = 4;
/// The APK's per-operation launch arguments (apk::FlatOp).
const APK_ARGS: usize = 18;

pub struct CudaDevice {
    gpu: Gpu,
    ctx: sys::CUcontext,
    device: sys::CUdevice,
    stream: sys::CUstream,
    buffers: Vec<(sys::CUdeviceptr, u64)>,
    modules: Vec<Module>,
    cache: PathBuf,
    arch: String,
    watchdog: Duration,
    /// Loaded transfer programs (their PTX through the driver's JIT) by content key.
    transfers: BTreeMap<String, (sys::CUmodule, sys::CUfunction)>,
    /// A batch's buffer addresses and table, uploaded before its launch.
    scratch: Option<(sys::CUdeviceptr, usize)>,
    /// The launch a watchdog gave up on: the GPU may still run it.
    poisoned: std::cell::OnceCell<String>,
}

// SAFETY: the handles are the driver's; every method first makes the
// device's context current on the calling thread, and `&mut self` keeps
// calls from two threads apart.
unsafe impl Send for CudaDevice {}

impl CudaDevice {
    /// Opens GPU `ordinal` (after [`probe`]), with its primary context and one stream.
    pub fn open(ordinal: usize, cache: &Path) -> Result<CudaDevice, DeviceError> {
        let gpus = probe()?;
        let gpu = gpus
            .get(ordinal)
            .cloned()
            .ok_or_else(|| other(format!("GPU {ordinal} does not exist: the driver sees {} GPU(s)", gpus.len())))?;
        std::fs::create_dir_all(cache).map_err(|e| other(format!("cannot create {}: {e}", cache.display())))?;
        let device = result::device::get(ordinal as i32).map_err(|e| driver("cuDeviceGet", e))?;
        // SAFETY: `device` is valid; the primary context is released in Drop.
        let ctx = unsafe { result::primary_ctx::retain(device) }.map_err(|e| driver("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: `ctx` was just retained.
        unsafe { result::ctx::set_current(ctx) }.map_err(|e| driver("cuCtxSetCurrent", e))?;
        let stream =
            result::stream::create(result::stream::StreamKind::NonBlocking).map_err(|e| driver("cuStreamCreate", e))?;
        let arch = match gpu.capability {
            (9, 0) => "sm_90a".to_string(),
            (10, 0) => "sm_100a".to_string(),
            (major, minor) => format!("sm_{major}{minor}"),
        };
        let watchdog = std::env::var("MOEFORGE_CUDA_WATCHDOG_S")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .unwrap_or(Duration::from_secs(60));
        Ok(CudaDevice {
            gpu,
            ctx,
            device,
            stream,
            buffers: Vec::new(),
            modules: Vec::new(),
            cache: cache.to_path_buf(),
            arch,
            watchdog,
            transfers: BTreeMap::new(),
            scratch: None,
            poisoned: std::cell::OnceCell::new(),
        })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    fn current(&self) -> Result<(), DeviceError> {
        // SAFETY: `ctx` is retained for the device's lifetime.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(|e| driver("cuCtxSetCurrent", e))
    }

    /// Host to device on the work stream (after everything issued before it), waited for.
    fn h2d<T>(&self, at: sys::CUdeviceptr, data: &[T], what: &str) -> Result<(), DeviceError> {
        // SAFETY: the caller checked that `at` holds `size_of_val(data)` bytes;
        // `data` outlives the copy, which `finish` waits for.
        unsafe { result::memcpy_htod_async(at, data, self.stream) }
            .map_err(|e| driver(&format!("{what}: cuMemcpyHtoDAsync"), e))?;
        self.finish(what)
    }

    /// Device to host on the work stream (after everything issued before it), waited for.
    fn d2h<T>(&self, out: &mut [T], at: sys::CUdeviceptr, what: &str) -> Result<(), DeviceError> {
        // SAFETY: the caller checked that `at` holds `size_of_val(out)` bytes;
        // `out` outlives the copy, which `finish` waits for.
        unsafe { result::memcpy_dtoh_async(out, at, self.stream) }
            .map_err(|e| driver(&format!("{what}: cuMemcpyDtoHAsync"), e))?;
        self.finish(what)
    }

    /// Waits for the stream, polling so that a hung kernel is an error. After
    /// a hang the device is poisoned: every later call fails at once.
    fn finish(&self, what: &str) -> Result<(), DeviceError> {
        if let Some(hung) = self.poisoned.get() {
            return Err(other(format!("the GPU is still running `{hung}`, which hung: restart the process")));
        }
        let t0 = Instant::now();
        let mut spins = 0u32;
        loop {
            // SAFETY: `stream` lives as long as the device.
            match unsafe { sys::cuStreamQuery(self.stream) } {
                sys::cudaError_enum::CUDA_SUCCESS => return Ok(()),
                sys::cudaError_enum::CUDA_ERROR_NOT_READY => {}
                e => return Err(driver(what, result::DriverError(e))),
            }
            if t0.elapsed() > self.watchdog {
                let _ = self.poisoned.set(what.to_string());
                return Err(DeviceError::Launch {
                    entry: what.to_string(),
                    message: format!(
                        "still running after {:.0} s (MOEFORGE_CUDA_WATCHDOG_S): a hang; the GPU is left running it",
                        self.watchdog.as_secs_f64()
                    ),
                });
            }
            spins += 1;
            if spins > 1000 {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    fn address(&self, buffer: BufferId, offset: u64, len: u64) -> Result<sys::CUdeviceptr, DeviceError> {
        let &(base, size) =
            self.buffers.get(buffer.0 as usize).ok_or_else(|| other(format!("no buffer {}", buffer.0)))?;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(other(format!("bytes {offset}..+{len} lie outside buffer {} ({size} bytes)", buffer.0)));
        }
        Ok(base + offset)
    }

    /// Builds kernel instance `name` into a cubin for this GPU, or finds it in the cache.
    fn build(&self, name: &str, source: &str) -> Result<Vec<u8>, DeviceError> {
        let nvcc = nvcc();
        let version = Command::new(&nvcc).arg("--version").output().map_err(|e| DeviceError::Build {
            kernel: name.into(),
            device: "cuda device",
            message: format!(
                "cannot run {} ({e}): the cuda backend builds the bundle's kernels with nvcc; set MOEFORGE_NVCC",
                nvcc.display()
            ),
        })?;
        // The -gencode form: nvcc 13.0's `-arch=sm_90a` shorthand also runs a
        // plain sm_90 pass, which rejects wgmma and setmaxnreg.
        let digits = self.arch.trim_start_matches("sm_");
        let gencode = format!("-gencode=arch=compute_{digits},code={}", self.arch);
        let flags = ["-cubin", "-O3", "-std=c++17", "-lineinfo", gencode.as_str()];
        let mut h = Sha256::new();
        h.update(source.as_bytes());
        h.update(flags.join(" ").as_bytes());
        h.update(&version.stdout);
        let key: String = h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect();
        let cubin = self.cache.join(format!("{name}-{key}.cubin"));
        if let Ok(bytes) = std::fs::read(&cubin) {
            return Ok(bytes);
        }
        // Per-process names until the cubin is renamed into place: concurrent builds are safe.
        let src = self.cache.join(format!("{name}-{key}.{}.cu", std::process::id()));
        std::fs::write(&src, source).map_err(|e| other(format!("cannot write {}: {e}", src.display())))?;
        let tmp = self.cache.join(format!("{name}-{key}.cubin.tmp{}", std::process::id()));
        let o = Command::new(&nvcc)
            .args(flags)
            .arg(&src)
            .arg("-o")
            .arg(&tmp)
            .output()
            .map_err(|e| other(format!("cannot run nvcc: {e}")))?;
        let _ = std::fs::remove_file(&src);
        if !o.status.success() {
            let err = String::from_utf8_lossy(&o.stderr);
            return Err(DeviceError::Build {
                kernel: name.into(),
                device: "cuda device",
                message: err.lines().take(20).collect::<Vec<_>>().join("\n"),
            });
        }
        std::fs::rename(&tmp, &cubin).map_err(|e| other(format!("cannot write {}: {e}", cubin.display())))?;
        std::fs::read(&cubin).map_err(|e| other(format!("cannot read {}: {e}", cubin.display())))
    }

    fn function(&mut self, module: ModuleId, entry: &str) -> Result<sys::CUfunction, DeviceError> {
        let m = self.modules.get_mut(module.0 as usize).ok_or_else(|| other(format!("no module {}", module.0)))?;
        if let Some(&f) = m.functions.get(entry) {
            return Ok(f);
        }
        let name = CString::new(entry).map_err(|_| other(format!("entry `{entry}` holds a NUL")))?;
        // SAFETY: `m.module` is loaded; the name is NUL-terminated.
        let f = unsafe { result::module::get_function(m.module, name) }.map_err(|e| DeviceError::Launch {
            entry: format!("{}::{entry}", m.name),
            message: format!("no such entry in the module ({e:?})"),
        })?;
        m.functions.insert(entry.to_string(), f);
        Ok(f)
    }

    /// Launches `f` on the stream with parameters `params` (each a pointer to its value).
    fn raw_launch(
        &self,
        f: sys::CUfunction,
        grid: u32,
        block: u32,
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), result::DriverError> {
        // SAFETY: `f` is a function of a loaded module; `params` point to live
        // values of the entry's parameter sizes (the caller's storage outlives
        // the launch, which `finish` waits for before it is dropped).
        unsafe { result::launch_kernel(f, (grid.max(1), 1, 1), (block, 1, 1), smem, self.stream, params) }
    }

    /// The APK launch of `entry` (see the module docs), set up on first use;
    /// none for a plain kernel.
    fn apk(&mut self, module: ModuleId, entry: &str) -> Result<Option<&Apk>, DeviceError> {
        let idx = module.0 as usize;
        let Some(m) = self.modules.get(idx) else { return Err(other(format!("no module {}", module.0))) };
        if !m.apk_entries.iter().any(|e| e == entry) {
            return Ok(None);
        }
        if !m.apk.contains_key(entry) {
            let apk = self.setup_apk(module, entry)?;
            if let Some(m) = self.modules.get_mut(idx) {
                m.apk.insert(entry.to_string(), apk);
            }
        }
        Ok(self.modules.get(idx).and_then(|m| m.apk.get(entry)))
    }

    fn setup_apk(&mut self, module: ModuleId, entry: &str) -> Result<Apk, DeviceError> {
        let prepare = self.function(module, &format!("{entry}_prepare"))?;
        let layout = self.function(module, &format!("{entry}_layout"))?;
        let alloc = |bytes: usize| {
            // SAFETY: a plain allocation in the current context, freed in Drop.
            unsafe { result::malloc_sync(bytes.max(256)) }.map_err(|e| driver("cuMemAlloc", e))
        };
        let out = alloc(16 * 8)?;
        let mut out_ptr = out;
        let mut words = [0u64; 9];
        let read = self
            .raw_launch(layout, 1, 32, 0, &mut [(&raw mut out_ptr).cast()])
            .map_err(|e| driver(&format!("{entry}_layout"), e))
            .and_then(|()| self.d2h(&mut words, out, &format!("{entry}_layout")));
        // SAFETY: `out` is not used again (the stream finished, or failed).
        let _ = unsafe { result::free_sync(out) };
        read?;
        let [templates_bytes, state_bytes, smem, threads, cluster, max_clusters, done0, done1, call_words] = words;
        let f = self.function(module, entry)?;
        // SAFETY: `f` is valid; the attribute raises the dynamic shared memory limit.
        unsafe {
            result::function::set_function_attribute(
                f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
        }
        .map_err(|e| driver(&format!("{entry}: dynamic shared memory of {smem} bytes"), e))?;
        // Co-resident clusters: the driver's answer for this launch shape.
        let cluster = cluster.max(1) as u32;
        let mut clusters = (self.gpu.sms / cluster).min(max_clusters as u32);
        let cfg = sys::CUlaunchConfig {
            gridDimX: clusters * cluster,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: threads as u32,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem as u32,
            hStream: self.stream,
            attrs: std::ptr::null_mut(),
            numAttrs: 0,
        };
        let mut active = 0i32;
        // SAFETY: `cfg` describes a launch of `f`; `active` receives the answer.
        let r = unsafe { sys::cuOccupancyMaxActiveClusters(&raw mut active, f, &raw const cfg) };
        if r == sys::cudaError_enum::CUDA_SUCCESS && active > 0 {
            clusters = clusters.min(active as u32);
        }
        if clusters == 0 {
            return Err(DeviceError::Launch {
                entry: entry.into(),
                message: format!("no cluster of {cluster} CTAs with {smem} bytes of shared memory fits this GPU"),
            });
        }
        Ok(Apk {
            prepare,
            templates_bytes: templates_bytes as usize,
            smem: smem as u32,
            threads: threads as u32,
            cluster,
            clusters,
            done_offset: [done0, done1],
            call_words: call_words as usize,
            templates: alloc(templates_bytes as usize)?,
            state: alloc(state_bytes as usize)?,
            calls: alloc((1 + MAX_MAPS) * call_words as usize * 8)?,
        })
    }

    /// A transfer program's kernel: the bundle's PTX of it (compiled for the
    /// plan's architecture, which `run` checks against the GPU's) loaded
    /// through the driver's JIT, once per program.
    fn transfer_function(&mut self, code: &Code) -> Result<sys::CUfunction, DeviceError> {
        let key = code.program.key();
        if let Some(&(_, f)) = self.transfers.get(&key) {
            return Ok(f);
        }
        let build = |message: String| DeviceError::Build {
            kernel: "a transfer program".into(),
            device: "cuda device",
            message,
        };
        let ptx = CString::new(code.ptx.as_str()).map_err(|_| build("PTX with a NUL byte".into()))?;
        // SAFETY: `ptx` is NUL-terminated PTX text; the driver JIT-compiles it for this GPU.
        let module = unsafe { result::module::load_data(ptx.as_ptr().cast()) }
            .map_err(|e| build(format!("cuModuleLoadData (PTX): {e:?}")))?;
        let name = CString::new(moeforge_xfer::ENTRY).map_err(|_| other("NUL"))?;
        // SAFETY: `module` is loaded; the name is NUL-terminated.
        let f = unsafe { result::module::get_function(module, name) }.map_err(|e| driver(moeforge_xfer::ENTRY, e))?;
        self.transfers.insert(key, (module, f));
        Ok(f)
    }

    /// At least `bytes` of scratch device memory (grown, never shrunk).
    fn scratch(&mut self, bytes: usize) -> Result<sys::CUdeviceptr, DeviceError> {
        if let Some((p, n)) = self.scratch {
            if n >= bytes {
                return Ok(p);
            }
            // SAFETY: the stream is idle (every transfer finishes before it returns).
            let _ = unsafe { result::free_sync(p) };
            self.scratch = None;
        }
        let n = bytes.next_power_of_two().max(4096);
        // SAFETY: a plain allocation, freed here or in Drop.
        let p = unsafe { result::malloc_sync(n) }.map_err(|e| driver("cuMemAlloc (transfer table)", e))?;
        self.scratch = Some((p, n));
        Ok(p)
    }

    fn launch_apk(
        &mut self,
        module: ModuleId,
        entry: &str,
        grid: u32,
        values: &mut [[u8; 8]],
    ) -> Result<bool, DeviceError> {
        let Some(apk) = self.apk(module, entry)? else { return Ok(false) };
        if values.len() != APK_ARGS {
            return Err(DeviceError::Launch {
                entry: entry.into(),
                message: format!("an APK launch takes {APK_ARGS} arguments (apk::FlatOp), not {}", values.len()),
            });
        }
        let (prepare, tb, words, calls_ptr, tm_ptr, st_ptr) =
            (apk.prepare, apk.templates_bytes, apk.call_words, apk.calls, apk.templates, apk.state);
        let (smem, threads, cluster, clusters, done_offset) =
            (apk.smem, apk.threads, apk.cluster, apk.clusters, apk.done_offset);
        let name = format!("{entry}_prepare");
        // 1. Bind on the GPU: the flat arguments, then the scratch pointers.
        let mut scratch = [tm_ptr, st_ptr, calls_ptr];
        let mut params: Vec<*mut c_void> = values.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
        params.extend(scratch.iter_mut().map(|p| (p as *mut u64).cast::<c_void>()));
        self.raw_launch(prepare, 1, 256, 0, &mut params).map_err(|e| driver(&name, e))?;
        let mut calls = vec![0u64; (1 + MAX_MAPS) * words];
        self.d2h(&mut calls, calls_ptr, &name)?;
        // Whole words of the templates: the allocation was rounded up to 256 bytes.
        let mut templates = vec![0u64; tb.div_ceil(8)];
        self.d2h(&mut templates, tm_ptr, &name)?;
        let count = calls[0];
        if count > MAX_MAPS as u64 {
            return Err(DeviceError::Launch {
                entry: entry.into(),
                message: "the operation's arguments do not bind (a phase past 1, or a tensor map of rank > 5)".into(),
            });
        }
        // 2. Encode the recorded tensor maps into the templates.
        for i in 0..count as usize {
            let c = &calls[(1 + i) * words..(2 + i) * words];
            let map = encode(c).map_err(|m| DeviceError::Launch { entry: entry.into(), message: m })?;
            let off = c[0] as usize;
            if !off.is_multiple_of(8) || off / 8 + 16 > templates.len() {
                return Err(other(format!("{entry}: a tensor map at byte {off} of {tb}-byte templates")));
            }
            templates[off / 8..off / 8 + 16].copy_from_slice(&map.opaque);
        }
        // 3. The persistent grid, with the operation and `stop` posted.
        let f = self.function(module, entry)?;
        let use_clusters = (grid / cluster).clamp(1, clusters);
        let mut state = st_ptr;
        let mut params: [*mut c_void; 2] = [templates.as_mut_ptr().cast(), (&raw mut state).cast()];
        self.raw_launch(f, use_clusters * cluster, threads, smem, &mut params).map_err(|e| driver(entry, e))?;
        self.finish(entry)?;
        let phase = u32::from_le_bytes(values.get(9).map_or([0; 4], |v| [v[0], v[1], v[2], v[3]]));
        let mut done = [0u32; 1];
        let at = st_ptr + done_offset[(phase as usize).min(1)];
        self.d2h(&mut done, at, entry)?;
        if done[0] != 1 {
            return Err(DeviceError::Launch {
                entry: entry.into(),
                message: format!("the grid returned without finishing the operation (done = {})", done[0]),
            });
        }
        Ok(true)
    }
}

/// `cuTensorMapEncodeTiled` of one recorded call (27 words: offset, data
/// type, rank, base, dims[5], strides[4], box[5], element strides[5],
/// interleave, swizzle, L2 promotion, OOB fill).
fn encode(c: &[u64]) -> Result<sys::CUtensorMap, String> {
    use sys::CUtensorMapDataType_enum as D;
    use sys::CUtensorMapFloatOOBfill_enum as O;
    use sys::CUtensorMapInterleave_enum as I;
    use sys::CUtensorMapL2promotion_enum as L;
    use sys::CUtensorMapSwizzle_enum as S;
    if c.len() < 27 {
        return Err(format!("a recorded tensor map has {} words, not 27", c.len()));
    }
    fn pick<T: Copy>(v: u64, all: &[T], as_u64: fn(T) -> u64, what: &str) -> Result<T, String> {
        all.iter()
            .copied()
            .find(|x| as_u64(*x) == v)
            .ok_or_else(|| format!("tensor map {what} {v} is not one this backend encodes"))
    }
    let dtype = pick(
        c[1],
        &[D::CU_TENSOR_MAP_DATA_TYPE_UINT8, D::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16],
        |x| x as u64,
        "data type",
    )?;
    let interleave = pick(c[23], &[I::CU_TENSOR_MAP_INTERLEAVE_NONE], |x| x as u64, "interleave")?;
    let swizzle = pick(
        c[24],
        &[
            S::CU_TENSOR_MAP_SWIZZLE_NONE,
            S::CU_TENSOR_MAP_SWIZZLE_32B,
            S::CU_TENSOR_MAP_SWIZZLE_64B,
            S::CU_TENSOR_MAP_SWIZZLE_128B,
        ],
        |x| x as u64,
        "swizzle",
    )?;
    let l2 = pick(
        c[25],
        &[
            L::CU_TENSOR_MAP_L2_PROMOTION_NONE,
            L::CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
            L::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            L::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        ],
        |x| x as u64,
        "L2 promotion",
    )?;
    let oob = pick(c[26], &[O::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE], |x| x as u64, "OOB fill")?;
    let rank = c[2] as usize;
    if !(1..=5).contains(&rank) {
        return Err(format!("tensor map rank {rank}"));
    }
    let dims: Vec<u64> = c[4..4 + rank].to_vec();
    let strides: Vec<u64> = c[9..9 + rank.saturating_sub(1)].to_vec();
    let boxes: Vec<u32> = c[13..13 + rank].iter().map(|&x| x as u32).collect();
    let es: Vec<u32> = c[18..18 + rank].iter().map(|&x| x as u32).collect();
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every array holds `rank` (strides `rank - 1`) entries; the
    // driver validates the values and writes only `map`.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &raw mut map,
            dtype,
            rank as u32,
            c[3] as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            es.as_ptr(),
            interleave,
            swizzle,
            l2,
            oob,
        )
    };
    if r != sys::cudaError_enum::CUDA_SUCCESS {
        return Err(format!(
            "cuTensorMapEncodeTiled refused a map ({r:?}): rank {rank}, dims {dims:?}, strides {strides:?}, box {boxes:?}"
        ));
    }
    Ok(map)
}

impl Device for CudaDevice {
    fn alloc(&mut self, bytes: u64) -> Result<BufferId, DeviceError> {
        self.current()?;
        // SAFETY: a plain allocation in the current context, freed in Drop.
        let ptr = unsafe { result::malloc_sync(bytes.max(1) as usize) }.map_err(|e| {
            driver(&format!("cuMemAlloc of {bytes} bytes (a rank's unified buffer on {})", self.gpu.name), e)
        })?;
        self.buffers.push((ptr, bytes));
        // SAFETY: `ptr` holds `bytes` bytes; the memset is ordered on the work stream.
        unsafe { result::memset_d8_async(ptr, 0, bytes as usize, self.stream) }
            .map_err(|e| driver("cuMemsetD8Async", e))?;
        self.finish("zeroing a rank buffer")?;
        Ok(BufferId(self.buffers.len() as u32 - 1))
    }

    fn upload(&mut self, buffer: BufferId, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.current()?;
        let at = self.address(buffer, offset, data.len() as u64).map_err(|e| other(format!("upload: {e}")))?;
        self.h2d(at, data, "upload")
    }

    fn download(&mut self, buffer: BufferId, offset: u64, len: u64) -> Result<Vec<u8>, DeviceError> {
        self.current()?;
        let at = self.address(buffer, offset, len).map_err(|e| other(format!("download: {e}")))?;
        let mut v = vec![0u8; len as usize];
        self.d2h(&mut v, at, "download")?;
        Ok(v)
    }

    fn transfer(&mut self, code: &Code, batches: &[Batch], buffers: &[BufferId]) -> Result<(), DeviceError> {
        // A poisoned device fails before the scratch is freed or regrown
        // under a kernel that may still run.
        self.finish("transfer")?;
        self.current()?;
        let program = &code.program;
        let mut words: Vec<u64> = vec![];
        let mut sizes = vec![];
        for b in buffers {
            let &(p, size) =
                self.buffers.get(b.0 as usize).ok_or_else(|| other(format!("transfer: no buffer {}", b.0)))?;
            words.push(p);
            sizes.push(size);
        }
        for b in batches {
            b.check(program, &sizes).map_err(other)?;
        }
        let f = self.transfer_function(code)?;
        let n = words.len();
        for b in batches.iter().filter(|b| !b.is_empty()) {
            words.truncate(n);
            words.extend(b.words());
            let at = self.scratch(words.len() * 8)?;
            // The scratch holds the buffer addresses, then the batch's table.
            self.h2d(at, &words, "transfer table")?;
            let grid = b.pieces(program).div_ceil(256).clamp(1, 16 * u64::from(self.gpu.sms)) as u32;
            let (mut bases, mut table) = (at, at + 8 * n as u64);
            let mut params: [*mut c_void; 2] = [(&raw mut bases).cast(), (&raw mut table).cast()];
            self.raw_launch(f, grid, 256, 0, &mut params).map_err(|e| driver(moeforge_xfer::ENTRY, e))?;
            self.finish("transfer")?;
        }
        Ok(())
    }

    fn load(&mut self, name: &str, source: &str) -> Result<ModuleId, DeviceError> {
        self.current()?;
        let image = self.build(name, source)?;
        // SAFETY: `image` is a cubin nvcc wrote for this GPU's architecture.
        let module = unsafe { result::module::load_data(image.as_ptr().cast()) }.map_err(|e| DeviceError::Build {
            kernel: name.into(),
            device: "cuda device",
            message: format!("cuModuleLoadData: {e:?}"),
        })?;
        self.modules.push(Module {
            name: name.into(),
            module,
            functions: BTreeMap::new(),
            apk_entries: apk_entries(source),
            apk: BTreeMap::new(),
        });
        Ok(ModuleId(self.modules.len() as u32 - 1))
    }

    fn launch(
        &mut self,
        module: ModuleId,
        entry: &str,
        grid: u32,
        block: u32,
        args: &[KernelArg],
    ) -> Result<(), DeviceError> {
        self.current()?;
        let module_name = self.modules.get(module.0 as usize).map(|m| m.name.clone()).unwrap_or_default();
        let what = format!("{module_name}::{entry}");
        // One 8-byte slot per parameter, holding its value as the kernel reads it.
        let mut values: Vec<[u8; 8]> = Vec::with_capacity(args.len());
        for a in args {
            let mut v = [0u8; 8];
            match *a {
                KernelArg::Ptr { buffer, offset } => v = self.address(buffer, offset, 0)?.to_le_bytes(),
                KernelArg::Null => {}
                KernelArg::I32(x) => v[..4].copy_from_slice(&x.to_le_bytes()),
                KernelArg::I64(x) => v = x.to_le_bytes(),
                KernelArg::F32(x) => v[..4].copy_from_slice(&x.to_le_bytes()),
            }
            values.push(v);
        }
        if self.launch_apk(module, entry, grid, &mut values)? {
            return Ok(());
        }
        let f = self.function(module, entry)?;
        let mut params: Vec<*mut c_void> = values.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
        self.raw_launch(f, grid, block, 0, &mut params)
            .map_err(|e| DeviceError::Launch { entry: what.clone(), message: format!("{e:?}") })?;
        self.finish(&what)
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // A hung kernel may still use everything: leave it to the process's exit.
        if self.poisoned.get().is_some() || self.current().is_err() || self.finish("teardown").is_err() {
            return;
        }
        for m in &self.modules {
            for apk in m.apk.values() {
                for p in [apk.templates, apk.state, apk.calls] {
                    // SAFETY: allocated in setup_apk, not used after this.
                    let _ = unsafe { result::free_sync(p) };
                }
            }
            // SAFETY: no launch of this module is pending (the stream finished).
            let _ = unsafe { result::module::unload(m.module) };
        }
        for &(module, _) in self.transfers.values() {
            // SAFETY: the stream is idle; the module is not used after this.
            let _ = unsafe { result::module::unload(module) };
        }
        if let Some((p, _)) = self.scratch {
            // SAFETY: as above.
            let _ = unsafe { result::free_sync(p) };
        }
        for &(p, _) in &self.buffers {
            // SAFETY: allocated in alloc, not used after this.
            let _ = unsafe { result::free_sync(p) };
        }
        // SAFETY: the stream is idle and not used after this.
        let _ = unsafe { result::stream::destroy(self.stream) };
        // SAFETY: retained in open.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    #[test]
    fn the_apk_entries_are_the_ones_with_a_prepare_kernel() {
        let src = "extern \"C\" __global__ void moe_apk(const Templates t, State* s) {}\n\
                   extern \"C\" __global__ void moe_apk_layout(unsigned long long* out) {\n\
                   extern \"C\" __global__ void moe_apk_prepare(const void* x,\n\
                   __global__ void rms_norm(float* x) {}\n\
                   // moe_apk_prepare( in a comment is not a definition\n";
        assert_eq!(apk_entries(src), vec!["moe_apk".to_string()]);
    }

    /// Without a driver (every CI machine), opening the device is an error
    /// that says what is missing; with one, probing lists its GPUs.
    #[test]
    fn probing_without_a_driver_is_an_error_not_a_panic() {
        match probe() {
            Err(e) => {
                let m = e.to_string();
                assert!(m.contains("no CUDA driver found") || m.contains("sees no GPU") || m.contains("cuInit"), "{m}");
                let Err(open) = CudaDevice::open(0, &std::env::temp_dir()) else { panic!("opened without a GPU") };
                assert_eq!(open.to_string(), m);
            }
            Ok(gpus) => assert!(!gpus.is_empty() && gpus.iter().all(|g| g.sms > 0 && g.capability.0 >= 7)),
        }
    }

    /// A recorded map the backend cannot encode is refused before the
    /// driver sees it.
    #[test]
    fn recorded_maps_outside_what_the_kernels_use_are_refused() {
        let mut call = vec![0u64; 27];
        call[1] = 9; // bf16
        call[2] = 2;
        call[24] = 3; // 128-byte swizzle
        call[25] = 3;
        let mut bad = call.clone();
        bad[1] = 77;
        assert!(encode(&bad).unwrap_err().contains("data type 77"));
        let mut bad = call.clone();
        bad[2] = 6;
        assert!(encode(&bad).unwrap_err().contains("rank 6"));
        assert!(encode(&call[..20]).unwrap_err().contains("20 words"));
    }
}
