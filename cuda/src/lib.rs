//! The cuda backend's device (`moeforge run --backend cuda`): the runtime's
//! [`Device`] on an NVIDIA GPU through the CUDA driver API (cudarc, the
//! driver library loaded at run time, so this crate builds and links on
//! machines without CUDA). The program interpreter
//! (`moeforge_runtime::device::exec`) runs the same programs on it as on the
//! emulated device: each rank's unified buffer one `cuMemAlloc` at the plan's
//! size, weights uploaded into their views, every op's launch bound by the
//! same `bind`, every data movement (reshard, dispatch, combine, all-reduce,
//! KV handoff, slot swap) a launch of the bundle's transfer program.
//!
//! - [`probe`] answers first: no driver library, a driver without a GPU, or
//!   the GPUs it sees. A missing driver is an error, never a panic (cudarc
//!   panics at the first call into a library it cannot load).
//! - Kernel instances are the bundle's cubins (`kernels/{name}.cubin`,
//!   built by the compile's nvcc for the plan's architecture), so a serving
//!   machine needs no nvcc; a bundle compiled without nvcc, or a cubin the
//!   driver refuses, is built here from the emitted source with nvcc for
//!   this GPU (`sm_90a` on compute capability 9.0), cached by content under
//!   `MOEFORGE_CUDA_CACHE` (`~/.cache/moeforge/cuda`).
//! - The APK's per-operation launch: the entry's `_prepare` kernel binds the
//!   flat arguments into its `Templates` and `State` on the GPU
//!   (`apk::bind_operation`, the emulated device's binding), recording the
//!   tensor maps' encode calls; the host encodes them with
//!   `cuTensorMapEncodeTiled` into the templates, then launches the
//!   persistent grid (its compile-time cluster dims, its dynamic shared
//!   memory, at most the clusters that can be co-resident) with the
//!   operation and `stop` posted. The templates are a function of the
//!   launch's arguments alone, and those do not change with the batch (the
//!   rows are device counts, the maps bounded by the input slice or the
//!   permutation's room), so they are read back and encoded once per
//!   launch and kept: a launch seen
//!   before queues `_prepare` (which still binds the device counts into the
//!   state) and the grid, and reads nothing back. Each operation's `done`
//!   word is copied on the stream into the GPU's done log, checked at the
//!   next download (or when the log is full): an operation the grid
//!   returned without finishing is reported there, by name. With `MOEFORGE_CUDA_SYNC=1`
//!   every launch is read back, encoded again and compared with the kept
//!   templates, and its `done` read at once.
//! - Zepp's slot swaps ([`Device::side_transfer`]) run on a side stream
//!   of the first GPU: each batch's table from the transfer-table pool, an
//!   event recorded after the swap; [`Device::side_wait`] polls that event
//!   under the watchdog and returns the swaps' tables to the pool. The
//!   launches and transfers issued while a swap still runs are counted
//!   (the overlap `side_wait` reports). A step's expert computation waits
//!   for its layer's swaps on the GPU ([`Device::side_join`] on the event
//!   each swap records as its layer's mark). `MOEFORGE_CUDA_SIDE_DELAY_MS=N`
//!   holds the side stream N ms before each swap (a host function on it), so
//!   a step that did not wait would compute with the bytes the swap has not
//!   moved yet: the GPU check's test of those waits.
//! - Every wait polls the stream: work still running after
//!   `MOEFORGE_CUDA_WATCHDOG_S` seconds (60) is an error naming the last
//!   launch queued there (the [`Device`] contract lets a call return once
//!   its work is queued; see Ordering).
//! - One process drives a node's GPUs ([`CudaDevice::open`] with the
//!   ordinals `MOEFORGE_CUDA_DEVICES` names, else every GPU, at most one per
//!   rank): rank r's unified buffer on GPU r mod n ([`gpu_of`]), each kernel
//!   instance built once and loaded into every GPU's context, a launch on
//!   the GPU of its rank's buffer, and peer access enabled between every
//!   pair, so a transfer program's pieces read and write any rank's buffer
//!   through its address (one address space). Why one process and not one
//!   per GPU with IPC handles: the program interpreter meets every rank at
//!   each communication op in one loop, and a transfer program addresses
//!   all the ranks' buffers through one table of base addresses, the same
//!   program the emulated device runs; with one process per GPU every
//!   meeting would be a cross-process barrier and every buffer an imported
//!   IPC mapping, for the same copies. With one GPU every rank's buffer is
//!   on it (the test configuration). Every transfer runs on the first
//!   GPU's SMs, so a copy between two other GPUs crosses the first one's
//!   links twice. One-sided communication (device-side dispatch) is not
//!   here yet.
//! - CUDA graphs ([`Device::begin_capture`]), when the device drives one GPU
//!   (every rank's buffer on it, so a step is one work stream's; not with
//!   `MOEFORGE_CUDA_SYNC=1`): the work stream is captured in relaxed mode
//!   (`cuStreamBeginCapture`), instantiated (`cuGraphInstantiate`) and
//!   launched per replay (`cuGraphLaunch`). A recorded APK operation must
//!   have its templates encoded already (its first run, outside the graph,
//!   reads them back) and copies its `done` word into the graph's own done
//!   words, checked at the download after each replay; a recorded transfer's
//!   tables are the graph's own pinned memory, which every replay copies
//!   again. A side join is recorded as an external event-wait node on
//!   its key's mark event, re-recorded by every mark, so a replay waits for
//!   the swaps queued before it. An upload, readback, load or other
//!   side-stream call inside a recording drops it. Compile-checked only: no GPU has run it yet
//!   (`scripts/gpu-check.sh` (d) and (d') do).
//! - Ordering: a GPU's work stream orders its own work. A plain launch
//!   returns once queued (every launch waited for with
//!   `MOEFORGE_CUDA_SYNC=1`); uploads go through two pinned staging chunks
//!   per GPU and return once queued (the host fills one chunk while the
//!   other copies); an APK launch returns once queued when its templates
//!   were encoded before (the first launch of a distinct argument list waits
//!   for its `_prepare`); a transfer returns once queued on the first GPU's
//!   work stream (each batch's table copied from pinned memory into a pool
//!   table that returns to the pool once the transfer's event completed).
//!   A download waits. So a step whose APK launches were all seen before
//!   queues every op and waits only for its downloads. Before any work that
//!   can touch another GPU's memory through peer access (every launch,
//!   transfer, upload and download), the host waits for what that GPU
//!   still has queued; a fault or hang in a queued launch is reported at
//!   that wait, naming the launch.

use cudarc::driver::result;
use cudarc::driver::sys;
use moeforge_runtime::device::{Batch, BufferId, Code, Device, DeviceError, GraphId, KernelArg, ModuleId, SideEvent};
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

/// A checkpoint file mapped read-only into memory, for
/// `Checkpoint::load_with`: the tensors kept as stored are ranges of the
/// mapping, so loading reads only the pages a view's slice touches and the
/// host holds no copy of the weights (the page cache may drop them once
/// they reached the GPU). The file must not change while it is mapped.
pub fn map_file(path: &Path) -> std::io::Result<moeforge_runtime::twin::weights::FileBytes> {
    let file = std::fs::File::open(path)?;
    // SAFETY: a read-only shared mapping of a file this process only
    // reads. A checkpoint rewritten under a running server is outside what
    // the loader supports (said above): another process changing it changes
    // the bytes read, and truncating it makes a later read of the lost pages
    // a SIGBUS, which no bounds check here can prevent.
    let map = unsafe { memmap2::Mmap::map(&file) }?;
    Ok(std::sync::Arc::new(map))
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

/// The GPUs a run drives, from the ones the driver sees: `chosen` (the
/// ordinals `MOEFORGE_CUDA_DEVICES` names, in its order) or else every GPU,
/// at most one per rank. Errors name an ordinal the driver does not see,
/// or one named twice.
pub fn select(visible: &[Gpu], chosen: Option<&[usize]>, ranks: usize) -> Result<Vec<Gpu>, String> {
    let picked: Vec<Gpu> = match chosen {
        None => visible.to_vec(),
        Some(ordinals) => {
            let mut out: Vec<Gpu> = Vec::with_capacity(ordinals.len());
            for &o in ordinals {
                let g = visible
                    .iter()
                    .find(|g| g.ordinal == o)
                    .ok_or_else(|| format!("GPU {o} does not exist: the driver sees {} GPU(s)", visible.len()))?;
                if out.iter().any(|x| x.ordinal == o) {
                    return Err(format!("GPU {o} is named twice"));
                }
                out.push(g.clone());
            }
            out
        }
    };
    if picked.is_empty() {
        return Err("no GPU to run on".into());
    }
    Ok(picked.into_iter().take(ranks.max(1)).collect())
}

/// Which of the driven GPUs holds buffer `k` (the executor allocates one
/// buffer per rank, in rank order): rank r on GPU r with a GPU per rank;
/// with fewer GPUs the ranks go round them (r mod n), several unified
/// buffers to a GPU.
pub fn gpu_of(k: usize, gpus: usize) -> usize {
    k % gpus.max(1)
}

/// Checks that `ranks` unified buffers of `buffer_bytes` fit the GPUs they
/// go to ([`gpu_of`]); the error names the first GPU that is too small.
pub fn check_fit(ranks: usize, buffer_bytes: u64, gpus: &[Gpu]) -> Result<(), String> {
    for (i, g) in gpus.iter().enumerate() {
        let held = (0..ranks).filter(|&k| gpu_of(k, gpus.len()) == i).count() as u64;
        let need = held.saturating_mul(buffer_bytes);
        if need > g.memory_bytes {
            return Err(format!(
                "GPU {} ({}) would hold {held} rank buffer(s) of {buffer_bytes} bytes = {need} bytes, more than its {} \
                 bytes ({ranks} ranks over {} GPU(s))",
                g.ordinal,
                g.name,
                g.memory_bytes,
                gpus.len()
            ));
        }
    }
    Ok(())
}

/// Checks that `image` is a whole ELF64 object before it reaches
/// `cuModuleLoadData`, which takes no length (bytes that are not ELF it
/// reads as PTX text up to a NUL; an ELF's header it trusts): the header,
/// the program and section header tables, and every section with file
/// contents lie inside the bytes.
pub fn check_cubin(image: &[u8]) -> Result<(), String> {
    let word = |at: usize, n: usize| -> Result<u64, String> {
        let b = image.get(at..at + n).ok_or_else(|| format!("truncated at byte {at} of {}", image.len()))?;
        Ok(b.iter().rev().fold(0u64, |v, &x| (v << 8) | u64::from(x)))
    };
    if image.len() < 64 || &image[..4] != b"\x7fELF" {
        return Err(format!("not an ELF object ({} bytes)", image.len()));
    }
    if image[4] != 2 || image[5] != 1 {
        return Err("not a little-endian ELF64 object".into());
    }
    let table = |off: u64, count: u64, size: u64, what: &str| -> Result<(), String> {
        let end = count.checked_mul(size).and_then(|n| n.checked_add(off));
        match end {
            Some(e) if e <= image.len() as u64 => Ok(()),
            _ => Err(format!("its {what} table ({count} entries at byte {off}) runs past its {} bytes", image.len())),
        }
    };
    let (phoff, shoff) = (word(32, 8)?, word(40, 8)?);
    let (phentsize, phnum, shentsize, shnum) = (word(54, 2)?, word(56, 2)?, word(58, 2)?, word(60, 2)?);
    table(phoff, phnum, phentsize, "program header")?;
    table(shoff, shnum, shentsize, "section header")?;
    if shnum > 0 && shentsize < 64 {
        return Err(format!("section headers of {shentsize} bytes"));
    }
    for i in 0..shnum {
        let at = (shoff + i * shentsize) as usize;
        const NOBITS: u64 = 8;
        if word(at + 4, 4)? == NOBITS {
            continue;
        }
        let (off, size) = (word(at + 24, 8)?, word(at + 32, 8)?);
        if off.checked_add(size).is_none_or(|e| e > image.len() as u64) {
            return Err(format!("section {i} (byte {off}, {size} bytes) runs past its {} bytes", image.len()));
        }
    }
    Ok(())
}

/// Checks that the GPUs can be driven together: one architecture (the
/// kernels are built once), and a peer path from each to every other (the
/// transfers and cross-rank kernels reach other GPUs' buffers through
/// peer access). Needs only the driver's init ([`probe`]), no context.
pub fn check_together(gpus: &[Gpu]) -> Result<(), String> {
    if let Some(g) = gpus.iter().find(|g| g.capability != gpus[0].capability) {
        return Err(format!(
            "GPU {} is compute capability {}.{} and GPU {} {}.{}: one run drives GPUs of one architecture",
            g.ordinal, g.capability.0, g.capability.1, gpus[0].ordinal, gpus[0].capability.0, gpus[0].capability.1
        ));
    }
    for a in gpus {
        for b in gpus.iter().filter(|b| b.ordinal != a.ordinal) {
            let dev = |g: &Gpu| {
                result::device::get(g.ordinal as i32).map_err(|e| format!("cuDeviceGet({}): {e:?}", g.ordinal))
            };
            let mut can = 0i32;
            // SAFETY: both devices are valid; `can` receives the answer.
            let r = unsafe { sys::cuDeviceCanAccessPeer(&raw mut can, dev(a)?, dev(b)?) };
            if r != sys::cudaError_enum::CUDA_SUCCESS {
                return Err(format!("cuDeviceCanAccessPeer(GPU {}, GPU {}): {r:?}", a.ordinal, b.ordinal));
            }
            if can == 0 {
                return Err(format!(
                    "GPU {} cannot access GPU {}'s memory (no peer path): the cuda backend drives a node's GPUs from \
                     one process through peer access",
                    a.ordinal, b.ordinal
                ));
            }
        }
    }
    Ok(())
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
    /// The encoded templates of each distinct launch (its flat arguments'
    /// bytes), with the tick it was last used at: a pure function of them
    /// (the maps are bounded by the launch's `rows`, not by the device
    /// counts), so a launch seen before reads nothing back. At most
    /// [`ENCODED_LAUNCHES`]; the least recently used goes first.
    encoded: BTreeMap<Vec<u8>, (Vec<u64>, u64)>,
    /// Launches so far (the clock of `encoded`).
    tick: u64,
}

/// Distinct launches an APK entry keeps encoded templates for (per GPU):
/// every op of a step at each batch size the server sees.
const ENCODED_LAUNCHES: usize = 4096;

/// Words of a GPU's done log: APK operations whose `done` is checked at the
/// next download (or when the log is full).
const DONE_LOG_WORDS: usize = 1024;

/// APK operations queued on one GPU without a wait: each one's `done` word
/// is copied (on the stream, after its grid) into slot i of `dev`; the host
/// reads the slots at the next download, or when the log is full
/// ([`CudaDevice::check_done`]).
struct DoneLog {
    dev: sys::CUdeviceptr,
    /// The entry of each queued operation, in slot order.
    entries: Vec<String>,
}

/// The first queued APK operation whose grid returned without finishing
/// it: its entry and its `done` word.
fn unfinished<'a>(done: &[u32], entries: &'a [String]) -> Option<(&'a str, u32)> {
    done.iter().zip(entries).find(|(&d, _)| d != 1).map(|(&d, e)| (e.as_str(), d))
}

/// A module as loaded into one GPU's context.
struct Loaded {
    module: sys::CUmodule,
    functions: BTreeMap<String, sys::CUfunction>,
    /// Per APK entry: its launch on this GPU, set up on first use.
    apk: BTreeMap<String, Apk>,
}

struct Module {
    name: String,
    /// The entries with a `_prepare` kernel in the source (APK launches).
    apk_entries: Vec<String>,
    /// The one cubin, loaded into every GPU's context (index: the GPU's place in [`CudaDevice::gpus`]).
    per_gpu: Vec<Loaded>,
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

/// Bytes of one pinned staging chunk.
const STAGING_CHUNK: usize = 16 << 20;

/// A GPU's upload staging: two chunks of pinned host memory, each with the
/// event recorded after the last copy out of it. The host fills one while
/// the other's copy runs; an upload returns once its last chunk is queued.
struct Staging {
    chunks: [(*mut u8, sys::CUevent, bool); 2],
    next: usize,
}

/// One GPU the device drives: its primary context, its work stream, and
/// what lives in its context (the transfer programs, the upload staging).
struct Ctx {
    gpu: Gpu,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    /// Loaded transfer programs (their PTX through the driver's JIT) by content key.
    transfers: BTreeMap<String, (sys::CUmodule, sys::CUfunction)>,
    staging: Option<Staging>,
    /// Work queued on the work stream that the host has not waited for
    /// (uploads, plain and APK launches and transfers unless
    /// `MOEFORGE_CUDA_SYNC` is set; cleared by
    /// [`CudaDevice::finish`]): work on another GPU, which could touch this
    /// one's memory through peer access, waits for it first.
    pending: std::cell::Cell<bool>,
    /// The last launch queued without a wait, for the error a later wait reports.
    last_launch: std::cell::RefCell<String>,
    /// APK operations queued without a wait (created on the first one).
    done_log: Option<DoneLog>,
}

/// A rank's unified buffer: its address, size and the GPU (index into
/// [`CudaDevice::gpus`]) that holds it.
#[derive(Clone, Copy)]
struct Buffer {
    ptr: sys::CUdeviceptr,
    bytes: u64,
    gpu: usize,
}

/// The side stream (on the first GPU, beside its work stream): Zepp's slot
/// swaps run there while the next launches go on.
struct Side {
    stream: sys::CUstream,
    /// The last event handed out (events count from 1).
    last: u64,
    /// Queued transfers not yet waited for, in queue order.
    pending: Vec<Pending>,
    /// Main-stream launches and transfers that finished while side work was
    /// still running (cumulative; what [`Device::side_wait`] reports).
    beside: u64,
}

/// A transfer's table (the buffers' addresses, then the batch's words):
/// device memory its launch reads, and the pinned host memory it is copied
/// from (a copy from pageable memory may wait for the stream).
struct Table {
    dev: sys::CUdeviceptr,
    host: *mut u8,
    bytes: usize,
}

/// One queued transfer (on the side stream or the first GPU's work
/// stream): its completion event, and the tables its launches read (kept
/// until the event completed).
struct Pending {
    id: u64,
    event: sys::CUevent,
    tables: Vec<Table>,
}

/// A recorded graph of the first GPU's work stream ([`Device::captures`]:
/// one GPU), instantiated.
struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    /// Its APK operations' `done` words, in chunks of [`DONE_LOG_WORDS`]
    /// (each replay copies them here again, checked at the next download),
    /// and their entries.
    done: Vec<sys::CUdeviceptr>,
    entries: Vec<String>,
    /// The transfer tables its copies read: each replay copies them again
    /// from their pinned host memory, so they are the graph's alone.
    tables: Vec<Table>,
}

/// The graph being recorded: its done words and tables so far.
struct Recording {
    done: Vec<sys::CUdeviceptr>,
    entries: Vec<String>,
    tables: Vec<Table>,
}

pub struct CudaDevice {
    /// The GPUs this process drives, every pair with peer access.
    ctxs: Vec<Ctx>,
    /// Created on the first side transfer.
    side: Option<Side>,
    /// Each key's mark on the side stream ([`Device::side_mark`]): an event
    /// in the first GPU's context, created at its first mark or join and
    /// re-recorded by every mark, so a graph's wait node on it waits for
    /// the mark as it stands when the graph is launched.
    marks: BTreeMap<u32, sys::CUevent>,
    /// Transfers queued on the first GPU's work stream, not yet seen
    /// finished (their tables stay out of the pool until then).
    queued: Vec<Pending>,
    /// Transfer tables no queued transfer reads (the first GPU's, for both
    /// streams): grown, never freed before Drop (an allocation or free
    /// between queued commands would wait for the device).
    tables: Vec<Table>,
    buffers: Vec<Buffer>,
    modules: Vec<Module>,
    cache: PathBuf,
    arch: String,
    watchdog: Duration,
    /// The launch a watchdog gave up on: the GPU may still run it.
    poisoned: std::cell::OnceCell<String>,
    /// Kernel instances loaded from the bundle's cubins, and built here with nvcc.
    from_bundle: u32,
    built: u32,
    /// Every launch and transfer waited for, and every APK launch's templates
    /// encoded again and compared with the kept ones (`MOEFORGE_CUDA_SYNC=1`:
    /// for debugging a fault to the launch that made it, and the GPU
    /// check's comparison).
    sync_launches: bool,
    /// `MOEFORGE_CUDA_SIDE_DELAY_MS`: milliseconds the side stream is held
    /// before each side transfer (0: none).
    side_delay_ms: u64,
    /// The graph being recorded, the kept ones by [`GraphId`], and those
    /// replayed since their done words were last checked.
    recording: Option<Recording>,
    graphs: Vec<Graph>,
    replayed: Vec<usize>,
}

// SAFETY: the handles are the driver's; every method first makes the
// context it uses current on the calling thread, and `&mut self` keeps
// calls from two threads apart.
unsafe impl Send for CudaDevice {}

/// `MOEFORGE_CUDA_SIDE_DELAY_MS`'s host function on the side stream: holds
/// it for the milliseconds its argument's address encodes.
extern "C" fn hold_side_stream(ms: *mut c_void) {
    std::thread::sleep(Duration::from_millis(ms.addr() as u64));
}

fn arch_of(capability: (u32, u32)) -> String {
    match capability {
        (9, 0) => "sm_90a".to_string(),
        (10, 0) => "sm_100a".to_string(),
        (major, minor) => format!("sm_{major}{minor}"),
    }
}

impl CudaDevice {
    /// Opens the GPUs `ordinals` (after [`probe`]; the first one alone for
    /// a single-GPU run), each with its primary context and one stream, and
    /// enables peer access between every pair: a kernel or transfer on one
    /// of them reads and writes the others' buffers through their
    /// addresses (one address space, UVA). The GPUs must share one
    /// architecture (the kernels are built once).
    pub fn open(ordinals: &[usize], cache: &Path) -> Result<CudaDevice, DeviceError> {
        let visible = probe()?;
        let gpus = select(&visible, Some(ordinals), usize::MAX).map_err(other)?;
        check_together(&gpus).map_err(other)?;
        std::fs::create_dir_all(cache).map_err(|e| other(format!("cannot create {}: {e}", cache.display())))?;
        let watchdog = std::env::var("MOEFORGE_CUDA_WATCHDOG_S")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .unwrap_or(Duration::from_secs(60));
        let mut dev = CudaDevice {
            ctxs: Vec::with_capacity(gpus.len()),
            side: None,
            marks: BTreeMap::new(),
            queued: Vec::new(),
            tables: Vec::new(),
            buffers: Vec::new(),
            modules: Vec::new(),
            cache: cache.to_path_buf(),
            arch: arch_of(gpus[0].capability),
            watchdog,
            poisoned: std::cell::OnceCell::new(),
            from_bundle: 0,
            built: 0,
            sync_launches: std::env::var("MOEFORGE_CUDA_SYNC").is_ok_and(|v| v == "1"),
            side_delay_ms: std::env::var("MOEFORGE_CUDA_SIDE_DELAY_MS")
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0),
            recording: None,
            graphs: Vec::new(),
            replayed: Vec::new(),
        };
        // Each context is pushed as soon as it exists, so Drop releases it if a later one fails.
        for gpu in gpus {
            let device = result::device::get(gpu.ordinal as i32).map_err(|e| driver("cuDeviceGet", e))?;
            // SAFETY: `device` is valid; the primary context is released in Drop.
            let ctx =
                unsafe { result::primary_ctx::retain(device) }.map_err(|e| driver("cuDevicePrimaryCtxRetain", e))?;
            // SAFETY: `ctx` was just retained.
            let stream = match unsafe { result::ctx::set_current(ctx) }
                .map_err(|e| driver("cuCtxSetCurrent", e))
                .and_then(|()| {
                    result::stream::create(result::stream::StreamKind::NonBlocking)
                        .map_err(|e| driver("cuStreamCreate", e))
                }) {
                Ok(s) => s,
                Err(e) => {
                    // SAFETY: retained above and not recorded anywhere else.
                    let _ = unsafe { result::primary_ctx::release(device) };
                    return Err(e);
                }
            };
            dev.ctxs.push(Ctx {
                gpu,
                device,
                ctx,
                stream,
                transfers: BTreeMap::new(),
                staging: None,
                pending: std::cell::Cell::new(false),
                last_launch: std::cell::RefCell::new(String::new()),
                done_log: None,
            });
        }
        dev.enable_peers()?;
        Ok(dev)
    }

    /// Peer access from every driven GPU to every other ([`check_together`]
    /// found the paths).
    fn enable_peers(&self) -> Result<(), DeviceError> {
        for a in &self.ctxs {
            for b in self.ctxs.iter().filter(|b| b.gpu.ordinal != a.gpu.ordinal) {
                // SAFETY: `a.ctx` is retained; enabling access maps `b`'s allocations into it.
                unsafe { result::ctx::set_current(a.ctx) }.map_err(|e| driver("cuCtxSetCurrent", e))?;
                // SAFETY: `b.ctx` is a retained primary context of another device.
                match unsafe { sys::cuCtxEnablePeerAccess(b.ctx, 0) } {
                    sys::cudaError_enum::CUDA_SUCCESS | sys::cudaError_enum::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                    }
                    e => {
                        return Err(driver(
                            &format!("cuCtxEnablePeerAccess (GPU {} to GPU {})", a.gpu.ordinal, b.gpu.ordinal),
                            result::DriverError(e),
                        ))
                    }
                }
            }
        }
        Ok(())
    }

    /// Fails at once after a hang: a hung kernel may still touch any GPU's
    /// memory, so nothing more is queued anywhere.
    fn live(&self) -> Result<(), DeviceError> {
        match self.poisoned.get() {
            Some(hung) => Err(other(format!("the GPU is still running `{hung}`, which hung: restart the process"))),
            None => Ok(()),
        }
    }

    fn ctx(&self, g: usize) -> Result<&Ctx, DeviceError> {
        self.ctxs.get(g).ok_or_else(|| other(format!("no GPU {g} in this device")))
    }

    /// Makes GPU `g`'s context current on this thread.
    fn current(&self, g: usize) -> Result<(), DeviceError> {
        // SAFETY: the context is retained for the device's lifetime.
        unsafe { result::ctx::set_current(self.ctx(g)?.ctx) }.map_err(|e| driver("cuCtxSetCurrent", e))
    }

    /// Device to host on GPU `g`'s work stream (after everything issued before it), waited for.
    fn d2h<T>(&self, g: usize, out: &mut [T], at: sys::CUdeviceptr, what: &str) -> Result<(), DeviceError> {
        // SAFETY: the caller checked that `at` holds `size_of_val(out)` bytes;
        // `out` outlives the copy, which `finish` waits for.
        unsafe { result::memcpy_dtoh_async(out, at, self.ctx(g)?.stream) }
            .map_err(|e| driver(&format!("{what}: cuMemcpyDtoHAsync"), e))?;
        self.finish(g, what)
    }

    /// Waits for GPU `g`'s stream, polling so that a hung kernel is an
    /// error. After a hang the device is poisoned: every later call fails
    /// at once.
    fn finish(&self, g: usize, what: &str) -> Result<(), DeviceError> {
        let c = self.ctx(g)?;
        let stream = c.stream;
        // A launch queued without a wait fails or hangs here: name it too.
        let last = c.last_launch.borrow().clone();
        let what = if c.pending.get() && !last.is_empty() { format!("{what} (after `{last}`)") } else { what.into() };
        // SAFETY: `stream` lives as long as the device.
        self.poll(&what, || unsafe { sys::cuStreamQuery(stream) })?;
        c.pending.set(false);
        Ok(())
    }

    /// Waits for the work queued without a wait on every GPU but `g` (whose
    /// own stream orders it before what follows there), and makes `g`'s
    /// context current.
    fn settle_others(&self, g: usize, what: &str) -> Result<(), DeviceError> {
        for h in (0..self.ctxs.len()).filter(|&h| h != g) {
            if self.ctxs[h].pending.get() {
                self.current(h)?;
                self.finish(h, what)?;
            }
        }
        self.current(g)
    }

    /// Host bytes to device address `at` of GPU `g` through its pinned
    /// staging chunks (see [`Staging`]); `g`'s context must be current.
    /// Returns with the last chunk's copy queued, not finished: `data` is
    /// free to go, and the stream orders the copy before what follows on it.
    fn staged_upload(&mut self, g: usize, at: sys::CUdeviceptr, data: &[u8]) -> Result<(), DeviceError> {
        let c = self.ctxs.get(g).ok_or_else(|| other(format!("no GPU {g} in this device")))?;
        if c.staging.is_none() {
            let mut chunks = [(std::ptr::null_mut(), std::ptr::null_mut(), false); 2];
            for (i, chunk) in chunks.iter_mut().enumerate() {
                // SAFETY: pinned host memory, freed in Drop (or just below when the other fails).
                let host = unsafe { result::malloc_host(STAGING_CHUNK, sys::CU_MEMHOSTALLOC_PORTABLE) };
                let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
                match (host, event) {
                    (Ok(h), Ok(e)) => *chunk = (h.cast::<u8>(), e, false),
                    (h, e) => {
                        for &(p, ev, _) in chunks.iter().take(i) {
                            // SAFETY: allocated above, never used.
                            let _ = unsafe { result::free_host(p.cast()) };
                            // SAFETY: created above, never recorded.
                            let _ = unsafe { result::event::destroy(ev) };
                        }
                        if let Ok(p) = h {
                            // SAFETY: as above.
                            let _ = unsafe { result::free_host(p) };
                        }
                        if let Ok(ev) = e {
                            // SAFETY: as above.
                            let _ = unsafe { result::event::destroy(ev) };
                        }
                        return Err(other(
                            "cannot allocate the pinned upload staging (cuMemHostAlloc / cuEventCreate)",
                        ));
                    }
                }
            }
            if let Some(c) = self.ctxs.get_mut(g) {
                c.staging = Some(Staging { chunks, next: 0 });
            }
        }
        let stream = self.ctx(g)?.stream;
        let mut off = 0usize;
        while off < data.len() {
            let n = (data.len() - off).min(STAGING_CHUNK);
            let (host, event, used, slot) = {
                let st = self.ctxs[g].staging.as_ref().ok_or_else(|| other("no upload staging"))?;
                let (h, e, u) = st.chunks[st.next];
                (h, e, u, st.next)
            };
            if used {
                // SAFETY: the event lives as long as the staging.
                self.poll("upload", || unsafe { sys::cuEventQuery(event) })?;
            }
            // SAFETY: `host` holds STAGING_CHUNK bytes, no copy reads it any
            // more (its event completed), and `n` <= STAGING_CHUNK.
            let chunk = unsafe {
                std::ptr::copy_nonoverlapping(data[off..].as_ptr(), host, n);
                std::slice::from_raw_parts(host.cast_const(), n)
            };
            // Before the copy is queued: whatever happens next, later work
            // on other GPUs waits for this stream.
            self.ctxs[g].pending.set(true);
            // SAFETY: the caller checked that `at` holds `data.len()` bytes;
            // the pinned chunk is not written again before the event below completed.
            unsafe { result::memcpy_htod_async(at + off as u64, chunk, stream) }
                .map_err(|e| driver("upload: cuMemcpyHtoDAsync", e))?;
            // SAFETY: the event and the stream are the same context's.
            if let Err(e) = unsafe { result::event::record(event, stream) } {
                // The chunk's copy may still run and its event says nothing:
                // wait for the stream before anything reuses the chunk.
                self.finish(g, "upload")?;
                return Err(driver("upload: cuEventRecord", e));
            }
            if let Some(st) = self.ctxs[g].staging.as_mut() {
                st.chunks[slot].2 = true;
                st.next = 1 - slot;
            }
            off += n;
        }
        Ok(())
    }

    /// Polls `query` (a stream's or an event's) until it reports done,
    /// under the watchdog.
    fn poll(&self, what: &str, query: impl Fn() -> sys::CUresult) -> Result<(), DeviceError> {
        self.live()?;
        let t0 = Instant::now();
        let mut spins = 0u32;
        loop {
            match query() {
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

    /// A main-stream launch or transfer was issued (and, but for a queued
    /// plain launch, finished): counted as beside the side stream's work
    /// while some of it still runs.
    fn main_op_done(&mut self) {
        let Some(side) = self.side.as_mut() else { return };
        // SAFETY: the events live until they are waited for and destroyed.
        let running = side
            .pending
            .iter()
            .any(|p| unsafe { sys::cuEventQuery(p.event) } == sys::cudaError_enum::CUDA_ERROR_NOT_READY);
        if running {
            side.beside += 1;
        }
    }

    /// The side stream's queued work up to and including `id` (after it
    /// finished): its tables back to the pool, its events destroyed.
    fn retire(&mut self, id: u64) {
        let Some(side) = self.side.as_mut() else { return };
        let done: Vec<Pending> = {
            let (done, rest): (Vec<Pending>, Vec<Pending>) = side.pending.drain(..).partition(|p| p.id <= id);
            side.pending = rest;
            done
        };
        for p in done {
            // The transfers that read them finished: free for the next ones.
            self.tables.extend(p.tables);
            // SAFETY: recorded and completed; not used after this.
            let _ = unsafe { result::event::destroy(p.event) };
        }
    }

    /// The work stream's queued transfers that finished (their events
    /// complete; the stream runs in order, so the first unfinished one ends
    /// the scan): tables back to the pool, events destroyed. Never waits.
    fn reclaim(&mut self) {
        let done = self
            .queued
            .iter()
            // SAFETY: the events live until destroyed here or in Drop.
            .take_while(|p| unsafe { sys::cuEventQuery(p.event) } == sys::cudaError_enum::CUDA_SUCCESS)
            .count();
        for p in self.queued.drain(..done) {
            self.tables.extend(p.tables);
            // SAFETY: recorded and completed; not used after this.
            let _ = unsafe { result::event::destroy(p.event) };
        }
    }

    /// A transfer table of at least `bytes`: from the pool, or allocated in
    /// the first GPU's context (current) when the pool has none that large.
    fn table(&mut self, bytes: usize) -> Result<Table, DeviceError> {
        if let Some(i) = self.tables.iter().position(|t| t.bytes >= bytes) {
            return Ok(self.tables.swap_remove(i));
        }
        let bytes = bytes.next_power_of_two().max(4096);
        // SAFETY: a plain allocation in the first GPU's context, freed in Drop.
        let dev = unsafe { result::malloc_sync(bytes) }.map_err(|e| driver("cuMemAlloc (transfer table)", e))?;
        // SAFETY: pinned host memory, freed in Drop (or at once below).
        match unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) } {
            Ok(host) => Ok(Table { dev, host: host.cast(), bytes }),
            Err(e) => {
                // SAFETY: allocated above, never used.
                let _ = unsafe { result::free_sync(dev) };
                Err(driver("cuMemHostAlloc (transfer table)", e))
            }
        }
    }

    /// Bytes `offset..+len` of `buffer`: their address and the GPU holding them.
    fn address(&self, buffer: BufferId, offset: u64, len: u64) -> Result<(usize, sys::CUdeviceptr), DeviceError> {
        let b = self.buffers.get(buffer.0 as usize).ok_or_else(|| other(format!("no buffer {}", buffer.0)))?;
        if offset.checked_add(len).is_none_or(|end| end > b.bytes) {
            return Err(other(format!("bytes {offset}..+{len} lie outside buffer {} ({} bytes)", buffer.0, b.bytes)));
        }
        Ok((b.gpu, b.ptr + offset))
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

    fn loaded(&mut self, module: ModuleId, g: usize) -> Result<&mut Loaded, DeviceError> {
        self.modules
            .get_mut(module.0 as usize)
            .and_then(|m| m.per_gpu.get_mut(g))
            .ok_or_else(|| other(format!("no module {} on GPU {g}", module.0)))
    }

    fn function(&mut self, module: ModuleId, g: usize, entry: &str) -> Result<sys::CUfunction, DeviceError> {
        if let Some(&f) = self.loaded(module, g)?.functions.get(entry) {
            return Ok(f);
        }
        let name = self.modules.get(module.0 as usize).map(|m| m.name.clone()).unwrap_or_default();
        let l = self.loaded(module, g)?;
        let c_entry = CString::new(entry).map_err(|_| other(format!("entry `{entry}` holds a NUL")))?;
        // SAFETY: `l.module` is loaded; the name is NUL-terminated.
        let f = unsafe { result::module::get_function(l.module, c_entry) }.map_err(|e| DeviceError::Launch {
            entry: format!("{name}::{entry}"),
            message: format!("no such entry in the module ({e:?})"),
        })?;
        l.functions.insert(entry.to_string(), f);
        Ok(f)
    }

    /// Launches `f` on GPU `g`'s stream with parameters `params` (each a
    /// pointer to its value); `g`'s context must be current.
    fn raw_launch(
        &self,
        g: usize,
        f: sys::CUfunction,
        grid: u32,
        block: u32,
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), DeviceError> {
        let stream = self.ctx(g)?.stream;
        // SAFETY: `f` is a function of a module loaded in `g`'s context;
        // `params` point to live values of the entry's parameter sizes (the
        // caller's storage outlives the launch, which `finish` waits for
        // before it is dropped).
        unsafe { result::launch_kernel(f, (grid.max(1), 1, 1), (block, 1, 1), smem, stream, params) }
            .map_err(|e| driver("cuLaunchKernel", e))
    }

    /// The APK launch of `entry` on GPU `g` (see the module docs), set up
    /// on first use; none for a plain kernel.
    fn apk(&mut self, module: ModuleId, g: usize, entry: &str) -> Result<Option<&Apk>, DeviceError> {
        let idx = module.0 as usize;
        let Some(m) = self.modules.get(idx) else { return Err(other(format!("no module {}", module.0))) };
        if !m.apk_entries.iter().any(|e| e == entry) {
            return Ok(None);
        }
        if !self.loaded(module, g)?.apk.contains_key(entry) {
            let apk = self.setup_apk(module, g, entry)?;
            self.loaded(module, g)?.apk.insert(entry.to_string(), apk);
        }
        Ok(self.modules.get(idx).and_then(|m| m.per_gpu.get(g)).and_then(|l| l.apk.get(entry)))
    }

    fn setup_apk(&mut self, module: ModuleId, g: usize, entry: &str) -> Result<Apk, DeviceError> {
        let prepare = self.function(module, g, &format!("{entry}_prepare"))?;
        let layout = self.function(module, g, &format!("{entry}_layout"))?;
        let alloc = |bytes: usize| {
            // SAFETY: a plain allocation in `g`'s context (current), freed in Drop.
            unsafe { result::malloc_sync(bytes.max(256)) }.map_err(|e| driver("cuMemAlloc", e))
        };
        let out = alloc(16 * 8)?;
        let mut out_ptr = out;
        let mut words = [0u64; 9];
        let read = self
            .raw_launch(g, layout, 1, 32, 0, &mut [(&raw mut out_ptr).cast()])
            .map_err(|e| other(format!("{entry}_layout: {e}")))
            .and_then(|()| self.d2h(g, &mut words, out, &format!("{entry}_layout")));
        // SAFETY: `out` is not used again (the stream finished, or failed).
        let _ = unsafe { result::free_sync(out) };
        read?;
        let [templates_bytes, state_bytes, smem, threads, cluster, max_clusters, done0, done1, call_words] = words;
        let f = self.function(module, g, entry)?;
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
        let c = self.ctx(g)?;
        let mut clusters = (c.gpu.sms / cluster).min(max_clusters as u32);
        let cfg = sys::CUlaunchConfig {
            gridDimX: clusters * cluster,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: threads as u32,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem as u32,
            hStream: c.stream,
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
            encoded: BTreeMap::new(),
            tick: 0,
        })
    }

    /// A transfer program's kernel on GPU `g`: the bundle's PTX of it
    /// (compiled for the plan's architecture, which `run` checks against the
    /// GPU's) loaded through the driver's JIT, once per program and GPU.
    fn transfer_function(&mut self, g: usize, code: &Code) -> Result<sys::CUfunction, DeviceError> {
        let key = code.program.key();
        if let Some(&(_, f)) = self.ctx(g)?.transfers.get(&key) {
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
        if let Some(c) = self.ctxs.get_mut(g) {
            c.transfers.insert(key, (module, f));
        }
        Ok(f)
    }

    /// A transfer's kernel on the first GPU and, per non-empty batch, its
    /// table (the buffers' addresses, then the batch's words) and grid;
    /// every batch checked against the buffers' sizes first.
    #[allow(clippy::type_complexity)]
    fn prepare_transfer(
        &mut self,
        code: &Code,
        batches: &[Batch],
        buffers: &[BufferId],
    ) -> Result<(sys::CUfunction, Vec<(Vec<u64>, u32)>), DeviceError> {
        let program = &code.program;
        let mut bases: Vec<u64> = vec![];
        let mut sizes = vec![];
        for b in buffers {
            let x = self.buffers.get(b.0 as usize).ok_or_else(|| other(format!("transfer: no buffer {}", b.0)))?;
            bases.push(x.ptr);
            sizes.push(x.bytes);
        }
        for b in batches {
            b.check(program, &sizes).map_err(other)?;
        }
        let f = self.transfer_function(0, code)?;
        let sms = u64::from(self.ctx(0)?.gpu.sms);
        let tables = batches
            .iter()
            .filter(|b| !b.is_empty())
            .map(|b| {
                let mut words = bases.clone();
                words.extend(b.words());
                (words, b.pieces(program).div_ceil(256).clamp(1, 16 * sms) as u32)
            })
            .collect();
        Ok((f, tables))
    }

    /// Queues a transfer's launches on `stream` (the first GPU's, current;
    /// the side stream when `side`): each batch's table copied from pinned
    /// memory into a pool table, its launch, then one event after them. The
    /// transfer's record (its tables out of the pool until the event
    /// completed) goes to that stream's list under `id`. When queueing
    /// fails, what was queued before may still run: the stream is waited
    /// for and the tables go back to the pool, or, if that wait fails too,
    /// the record stays in the list (a later wait or reclaim retires it).
    fn queue_transfer(
        &mut self,
        stream: sys::CUstream,
        f: sys::CUfunction,
        tables: &[(Vec<u64>, u32)],
        buffers: usize,
        id: u64,
        side: bool,
    ) -> Result<(), DeviceError> {
        let what = if side { "side stream" } else { "transfer" };
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| driver("cuEventCreate", e))?;
        let mut kept = Vec::with_capacity(tables.len());
        let queued = self.launch_tables(stream, f, tables, buffers, what, &mut kept).and_then(|()| {
            // SAFETY: `event` was just created; `stream` is the first GPU's.
            unsafe { result::event::record(event, stream) }.map_err(|e| driver("cuEventRecord", e))
        });
        let pending = Pending { id, event, tables: kept };
        let keep = |dev: &mut CudaDevice, p: Pending| match (side, dev.side.as_mut()) {
            (true, Some(x)) => {
                x.last = x.last.max(p.id);
                x.pending.push(p);
            }
            _ => dev.queued.push(p),
        };
        let Err(e) = queued else {
            keep(self, pending);
            return Ok(());
        };
        // SAFETY: `stream` lives as long as the device.
        if self.poll("transfer", || unsafe { sys::cuStreamQuery(stream) }).is_ok() {
            self.tables.extend(pending.tables);
            // SAFETY: not used after this.
            let _ = unsafe { result::event::destroy(pending.event) };
        } else {
            keep(self, pending);
        }
        Err(e)
    }

    /// Loads `image` (a cubin) into every GPU's context as kernel instance
    /// `name`; nothing stays loaded when one GPU refuses it.
    fn load_image(&mut self, name: &str, source: &str, image: &[u8]) -> Result<ModuleId, DeviceError> {
        check_cubin(image).map_err(|m| DeviceError::Build {
            kernel: name.into(),
            device: "cuda device",
            message: format!("the cubin is refused before the driver sees it: {m}"),
        })?;
        let mut per_gpu = Vec::with_capacity(self.ctxs.len());
        for g in 0..self.ctxs.len() {
            let loaded = self.current(g).and_then(|()| {
                // SAFETY: `check_cubin` found a whole ELF64 object: its header,
                // header tables and sections lie inside `image`, which outlives the call.
                unsafe { result::module::load_data(image.as_ptr().cast()) }
                    .map_err(|e| other(format!("cuModuleLoadData on GPU {}: {e:?}", self.ctxs[g].gpu.ordinal)))
            });
            match loaded {
                Ok(module) => per_gpu.push(Loaded { module, functions: BTreeMap::new(), apk: BTreeMap::new() }),
                Err(e) => {
                    for (h, l) in per_gpu.iter().enumerate() {
                        if self.current(h).is_ok() {
                            // SAFETY: loaded just above, never launched.
                            let _ = unsafe { result::module::unload(l.module) };
                        }
                    }
                    return Err(DeviceError::Build {
                        kernel: name.into(),
                        device: "cuda device",
                        message: e.to_string(),
                    });
                }
            }
        }
        self.modules.push(Module { name: name.into(), apk_entries: apk_entries(source), per_gpu });
        Ok(ModuleId(self.modules.len() as u32 - 1))
    }

    fn launch_apk(
        &mut self,
        module: ModuleId,
        g: usize,
        entry: &str,
        grid: u32,
        values: &mut [[u8; 8]],
    ) -> Result<bool, DeviceError> {
        // Setting an APK entry up reads its layout back: never inside a recording.
        if self.recording.is_some() {
            let m = self.modules.get(module.0 as usize);
            let is_apk = m.is_some_and(|m| m.apk_entries.iter().any(|e| e == entry));
            let ready = m.and_then(|m| m.per_gpu.get(g)).is_some_and(|l| l.apk.contains_key(entry));
            if is_apk && !ready {
                return Err(DeviceError::Launch {
                    entry: entry.into(),
                    message: "an APK entry's first launch (which reads its layout back) cannot be recorded into a \
                              graph: run the step once before recording it"
                        .into(),
                });
            }
        }
        let Some(apk) = self.apk(module, g, entry)? else { return Ok(false) };
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
        // An experts launch with the device counts and no row bound binds
        // maps sized by the counts: its templates are not kept.
        let keep = !(values[7] != [0; 8] && values[8][..4] == [0; 4]);
        let key: Vec<u8> = values.iter().flatten().copied().collect();
        let cached = if keep { apk.encoded.get(&key).map(|e| e.0.clone()) } else { None };
        let name = format!("{entry}_prepare");
        // A graph cannot wait for `_prepare`: a recorded launch is one whose
        // templates were encoded before (the step ran once, unrecorded).
        if self.recording.is_some() && cached.is_none() {
            return Err(DeviceError::Launch {
                entry: entry.into(),
                message: "an APK launch whose templates were never encoded cannot be recorded into a graph (its \
                          first run reads them back): run the step once before recording it"
                    .into(),
            });
        }
        // The done log (queued launches): created on the first, read when full.
        if !self.sync_launches && self.recording.is_none() {
            if self.ctx(g)?.done_log.as_ref().is_some_and(|l| l.entries.len() >= DONE_LOG_WORDS) {
                self.check_done(g)?;
            }
            if self.ctx(g)?.done_log.is_none() {
                // SAFETY: a plain allocation in `g`'s context (current), freed in Drop.
                let dev = unsafe { result::malloc_sync(DONE_LOG_WORDS * 4) }
                    .map_err(|e| driver("cuMemAlloc (done log)", e))?;
                if let Some(c) = self.ctxs.get_mut(g) {
                    c.done_log = Some(DoneLog { dev, entries: Vec::new() });
                }
            }
        }
        // 1. Bind on the GPU: the flat arguments, then the scratch pointers.
        // Always: it zeroes the state and reads the device counts into it.
        let mut scratch = [tm_ptr, st_ptr, calls_ptr];
        let mut params: Vec<*mut c_void> = values.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
        params.extend(scratch.iter_mut().map(|p| (p as *mut u64).cast::<c_void>()));
        self.raw_launch(g, prepare, 1, 256, 0, &mut params).map_err(|e| other(format!("{name}: {e}")))?;
        self.ctx(g)?.pending.set(true);
        // 2. The templates: encoded once per distinct launch (read back and
        // encoded again, and compared, when every launch is waited for).
        let mut templates = match cached {
            Some(t) if !self.sync_launches => t,
            cached => {
                let t = self.encode_templates(g, entry, &name, calls_ptr, tm_ptr, tb, words)?;
                if cached.as_ref().is_some_and(|c| *c != t) {
                    return Err(DeviceError::Launch {
                        entry: entry.into(),
                        message: "the templates encoded for this launch differ from the ones encoded for the same \
                                  arguments before: they depend on more than the arguments"
                            .into(),
                    });
                }
                if keep {
                    if let Some(a) = self.apk_mut(module, g, entry) {
                        if a.encoded.len() >= ENCODED_LAUNCHES && !a.encoded.contains_key(&key) {
                            let oldest = a.encoded.iter().min_by_key(|e| e.1 .1).map(|e| e.0.clone());
                            if let Some(k) = oldest {
                                a.encoded.remove(&k);
                            }
                        }
                        a.encoded.insert(key.clone(), (t.clone(), 0));
                    }
                }
                t
            }
        };
        if let Some(a) = self.apk_mut(module, g, entry) {
            a.tick += 1;
            let tick = a.tick;
            if let Some(e) = a.encoded.get_mut(&key) {
                e.1 = tick;
            }
        }
        // 3. The persistent grid, with the operation and `stop` posted.
        let f = self.function(module, g, entry)?;
        let use_clusters = (grid / cluster).clamp(1, clusters);
        let mut state = st_ptr;
        let mut params: [*mut c_void; 2] = [templates.as_mut_ptr().cast(), (&raw mut state).cast()];
        self.raw_launch(g, f, use_clusters * cluster, threads, smem, &mut params)
            .map_err(|e| other(format!("{entry}: {e}")))?;
        {
            // Queued: later work on another GPU waits for it, and a fault
            // in it is reported at the next wait here, naming it.
            let c = self.ctx(g)?;
            c.pending.set(true);
            *c.last_launch.borrow_mut() = entry.to_string();
        }
        let phase = u32::from_le_bytes(values.get(9).map_or([0; 4], |v| [v[0], v[1], v[2], v[3]]));
        let at = st_ptr + done_offset[(phase as usize).min(1)];
        if self.sync_launches {
            self.finish(g, entry)?;
            let mut done = [0u32; 1];
            self.d2h(g, &mut done, at, entry)?;
            return match unfinished(&done, &[entry.to_string()]) {
                Some((e, d)) => Err(not_finished(e, d)),
                None => Ok(true),
            };
        }
        // 4. Its `done` word is logged on the stream, checked at the next
        // download: into the graph's own words when recorded.
        if let Some(rec) = self.recording.as_mut() {
            let n = rec.entries.len();
            if n == rec.done.len() * DONE_LOG_WORDS {
                // Another chunk of done words (relaxed capture allows the allocation).
                // SAFETY: a plain allocation in `g`'s context (current), freed with the graph.
                let at = unsafe { result::malloc_sync(DONE_LOG_WORDS * 4) }
                    .map_err(|e| driver("cuMemAlloc (a graph's done words)", e))?;
                rec.done.push(at);
            }
            let slot = rec.done[n / DONE_LOG_WORDS] + 4 * (n % DONE_LOG_WORDS) as u64;
            let stream = self.ctxs.get(g).map(|c| c.stream).ok_or_else(|| other(format!("no GPU {g}")))?;
            // SAFETY: `slot` is inside the graph's words; `at` is the
            // state's `done` word; both on `g`, ordered after the grid.
            unsafe { result::memcpy_dtod_async(slot, at, 4, stream) }
                .map_err(|e| driver(&format!("{entry}: cuMemcpyDtoDAsync (done, recorded)"), e))?;
            rec.entries.push(entry.to_string());
            return Ok(true);
        }
        let c = self.ctxs.get_mut(g).ok_or_else(|| other(format!("no GPU {g} in this device")))?;
        let log = c.done_log.as_mut().ok_or_else(|| other("no done log"))?;
        let slot = log.dev + 4 * log.entries.len() as u64;
        // SAFETY: `slot` is inside the log (fewer than DONE_LOG_WORDS entries:
        // a full log was read above), `at` is the state's `done` word; both
        // on `g`, ordered after the grid.
        unsafe { result::memcpy_dtod_async(slot, at, 4, c.stream) }
            .map_err(|e| driver(&format!("{entry}: cuMemcpyDtoDAsync (done)"), e))?;
        log.entries.push(entry.to_string());
        Ok(true)
    }

    /// The APK launch of `entry` on GPU `g`, once set up.
    fn apk_mut(&mut self, module: ModuleId, g: usize, entry: &str) -> Option<&mut Apk> {
        self.modules.get_mut(module.0 as usize)?.per_gpu.get_mut(g)?.apk.get_mut(entry)
    }

    /// Reads back what `_prepare` recorded on GPU `g` and encodes its
    /// tensor maps with the driver into the templates (after waiting for it).
    #[allow(clippy::too_many_arguments)]
    fn encode_templates(
        &self,
        g: usize,
        entry: &str,
        name: &str,
        calls_ptr: sys::CUdeviceptr,
        tm_ptr: sys::CUdeviceptr,
        tb: usize,
        words: usize,
    ) -> Result<Vec<u64>, DeviceError> {
        let mut calls = vec![0u64; (1 + MAX_MAPS) * words];
        self.d2h(g, &mut calls, calls_ptr, name)?;
        // Whole words of the templates: the allocation was rounded up to 256 bytes.
        let mut templates = vec![0u64; tb.div_ceil(8)];
        self.d2h(g, &mut templates, tm_ptr, name)?;
        let count = calls[0];
        if count > MAX_MAPS as u64 {
            return Err(DeviceError::Launch {
                entry: entry.into(),
                message: "the operation's arguments do not bind (a phase past 1, or a tensor map of rank > 5)".into(),
            });
        }
        for i in 0..count as usize {
            let c = &calls[(1 + i) * words..(2 + i) * words];
            let map = encode(c).map_err(|m| DeviceError::Launch { entry: entry.into(), message: m })?;
            let off = c[0] as usize;
            if !off.is_multiple_of(8) || off / 8 + 16 > templates.len() {
                return Err(other(format!("{entry}: a tensor map at byte {off} of {tb}-byte templates")));
            }
            templates[off / 8..off / 8 + 16].copy_from_slice(&map.opaque);
        }
        Ok(templates)
    }

    /// [`CudaDevice::check_done`] on every GPU, then the replayed graphs'.
    fn check_all_done(&mut self) -> Result<(), DeviceError> {
        for g in 0..self.ctxs.len() {
            self.check_done(g)?;
        }
        self.check_graphs()
    }

    /// Waits for the first GPU and checks the `done` words of every graph
    /// replayed since the last check, as [`CudaDevice::check_done`] does
    /// (an unfinished operation stays reported).
    fn check_graphs(&mut self) -> Result<(), DeviceError> {
        if self.replayed.is_empty() {
            return Ok(());
        }
        self.current(0)?;
        for &i in &self.replayed {
            let Some(g) = self.graphs.get(i).filter(|g| !g.entries.is_empty()) else { continue };
            let mut done = vec![0u32; g.entries.len()];
            for (chunk, &at) in done.chunks_mut(DONE_LOG_WORDS).zip(&g.done) {
                self.d2h(0, chunk, at, "a decode graph's done words")?;
            }
            if let Some((e, d)) = unfinished(&done, &g.entries) {
                return Err(not_finished(&format!("{e} (in decode graph {i})"), d));
            }
        }
        self.replayed.clear();
        Ok(())
    }

    /// Refuses a call a graph cannot hold while one is being recorded: the
    /// recording is ended and dropped.
    fn outside_recording(&mut self, what: &str) -> Result<(), DeviceError> {
        if self.recording.is_none() {
            return Ok(());
        }
        self.drop_recording();
        Err(other(format!(
            "{what} while a graph is being recorded (a graph holds launches, transfers, fills and side joins only); the recording \
             is dropped"
        )))
    }

    /// Key `key`'s mark event (the first GPU's context must be current),
    /// created at first use.
    fn mark(&mut self, key: u32) -> Result<sys::CUevent, DeviceError> {
        if let Some(&e) = self.marks.get(&key) {
            return Ok(e);
        }
        let e = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| driver("cuEventCreate (side-stream mark)", e))?;
        self.marks.insert(key, e);
        Ok(e)
    }

    /// Ends the stream's capture and frees what the recording held.
    fn drop_recording(&mut self) {
        let Some(rec) = self.recording.take() else { return };
        if let Ok(c) = self.ctx(0) {
            let stream = c.stream;
            let mut graph: sys::CUgraph = std::ptr::null_mut();
            // SAFETY: the stream is capturing (or its capture was
            // invalidated, which this ends too); the graph, if any, is
            // destroyed at once.
            unsafe {
                let _ = sys::cuStreamEndCapture(stream, &raw mut graph);
                if !graph.is_null() {
                    let _ = sys::cuGraphDestroy(graph);
                }
            }
        }
        // Nothing of the recording ran: its tables go back to the pool.
        self.tables.extend(rec.tables);
        for at in rec.done {
            // SAFETY: allocated for the recording; no graph refers to it.
            let _ = unsafe { result::free_sync(at) };
        }
    }

    /// A transfer recorded into the graph: each batch's table copied from
    /// pinned memory (a copy node, which every replay runs again) and its
    /// launch. The tables are the graph's from now on.
    fn record_transfer(
        &mut self,
        stream: sys::CUstream,
        f: sys::CUfunction,
        tables: &[(Vec<u64>, u32)],
        buffers: usize,
    ) -> Result<(), DeviceError> {
        let mut kept = Vec::with_capacity(tables.len());
        let recorded = self.launch_tables(stream, f, tables, buffers, "transfer (recorded)", &mut kept);
        match self.recording.as_mut() {
            Some(rec) => rec.tables.extend(kept),
            None => {
                self.tables.extend(kept);
                return Err(other("no graph is being recorded"));
            }
        }
        recorded
    }

    /// Each batch's table copied from pinned memory into a pool table on
    /// `stream`, then the program's launch over it. Every table taken goes
    /// to `kept` (before its copy is queued), whose owner holds it while
    /// anything may read it: a queued transfer's record until its event
    /// completed, or a graph.
    fn launch_tables(
        &mut self,
        stream: sys::CUstream,
        f: sys::CUfunction,
        tables: &[(Vec<u64>, u32)],
        buffers: usize,
        what: &str,
        kept: &mut Vec<Table>,
    ) -> Result<(), DeviceError> {
        for (words, grid) in tables {
            let t = self.table(words.len() * 8)?;
            // SAFETY: `t.host` holds `t.bytes` >= the words' bytes, and no
            // queued copy or graph reads it (it came from the pool or is new).
            let chunk = unsafe {
                std::ptr::copy_nonoverlapping(words.as_ptr().cast::<u8>(), t.host, words.len() * 8);
                std::slice::from_raw_parts(t.host.cast_const(), words.len() * 8)
            };
            let at = t.dev;
            kept.push(t);
            // SAFETY: `at` holds the words; the pinned memory stays with
            // `kept`'s owner while the copy may run.
            unsafe { result::memcpy_htod_async(at, chunk, stream) }
                .map_err(|e| driver(&format!("{what} table: cuMemcpyHtoDAsync"), e))?;
            let (mut bases, mut table) = (at, at + 8 * buffers as u64);
            let mut params: [*mut c_void; 2] = [(&raw mut bases).cast(), (&raw mut table).cast()];
            // SAFETY: `f` is the program's kernel in this context; the
            // parameters are read at launch (or when it is recorded).
            unsafe { result::launch_kernel(f, (*grid, 1, 1), (256, 1, 1), 0, stream, &mut params) }
                .map_err(|e| driver(&format!("{} ({what})", moeforge_xfer::ENTRY), e))?;
        }
        Ok(())
    }

    /// Waits for GPU `g` and checks the `done` word of every APK operation
    /// queued there since the last check: an operation whose grid returned
    /// without finishing it is an error naming it.
    fn check_done(&mut self, g: usize) -> Result<(), DeviceError> {
        let Some((dev, n)) =
            self.ctx(g)?.done_log.as_ref().filter(|l| !l.entries.is_empty()).map(|l| (l.dev, l.entries.len()))
        else {
            return Ok(());
        };
        self.current(g)?;
        let mut done = vec![0u32; n];
        self.d2h(g, &mut done, dev, "the APK operations' done words")?;
        let log = self.ctxs.get_mut(g).and_then(|c| c.done_log.as_mut()).ok_or_else(|| other("no done log"))?;
        // An unfinished operation stays in the log: every later check
        // reports it again (the device's outputs cannot be trusted).
        if let Some((e, d)) = unfinished(&done, &log.entries) {
            return Err(not_finished(e, d));
        }
        log.entries.clear();
        Ok(())
    }
}

/// An APK grid that returned with its operation unfinished.
fn not_finished(entry: &str, done: u32) -> DeviceError {
    DeviceError::Launch {
        entry: entry.into(),
        message: format!("the grid returned without finishing the operation (done = {done})"),
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
    /// Buffer k on GPU [`gpu_of`]`(k, GPUs)`: rank r's unified buffer on
    /// its own GPU when there is one per rank.
    fn alloc(&mut self, bytes: u64) -> Result<BufferId, DeviceError> {
        self.live()?;
        self.outside_recording("an allocation")?;
        let g = gpu_of(self.buffers.len(), self.ctxs.len());
        self.current(g)?;
        let name = self.ctx(g)?.gpu.name.clone();
        // SAFETY: a plain allocation in `g`'s context, freed in Drop.
        let ptr = unsafe { result::malloc_sync(bytes.max(1) as usize) }
            .map_err(|e| driver(&format!("cuMemAlloc of {bytes} bytes (a rank's unified buffer on {name})"), e))?;
        self.buffers.push(Buffer { ptr, bytes, gpu: g });
        // SAFETY: `ptr` holds `bytes` bytes; the memset is ordered on `g`'s work stream.
        unsafe { result::memset_d8_async(ptr, 0, bytes as usize, self.ctx(g)?.stream) }
            .map_err(|e| driver("cuMemsetD8Async", e))?;
        self.finish(g, "zeroing a rank buffer")?;
        Ok(BufferId(self.buffers.len() as u32 - 1))
    }

    /// Through the GPU's pinned staging, returning once the copy is queued.
    fn upload(&mut self, buffer: BufferId, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.live()?;
        self.outside_recording("an upload")?;
        let (g, at) = self.address(buffer, offset, data.len() as u64).map_err(|e| other(format!("upload: {e}")))?;
        // A kernel on another GPU may still read these bytes through peer access.
        self.settle_others(g, "upload")?;
        self.staged_upload(g, at, data)
    }

    /// A memset queued on the buffer's GPU stream.
    fn fill(&mut self, buffer: BufferId, offset: u64, len: u64, byte: u8) -> Result<(), DeviceError> {
        let r = self.fill_now(buffer, offset, len, byte);
        self.end_recording_on(r)
    }

    fn download(&mut self, buffer: BufferId, offset: u64, len: u64) -> Result<Vec<u8>, DeviceError> {
        self.live()?;
        self.outside_recording("a download")?;
        let (g, at) = self.address(buffer, offset, len).map_err(|e| other(format!("download: {e}")))?;
        // A kernel on another GPU may still write these bytes through peer access.
        self.settle_others(g, "download")?;
        let mut v = vec![0u8; len as usize];
        self.d2h(g, &mut v, at, "download")?;
        // What was read may be an unfinished operation's output.
        self.check_all_done()?;
        Ok(v)
    }

    /// On the first GPU, which reaches every other's buffers through peer
    /// access: a batch's pieces may read and write any rank's buffer.
    fn transfer(&mut self, code: &Code, batches: &[Batch], buffers: &[BufferId]) -> Result<(), DeviceError> {
        let r = self.transfer_now(code, batches, buffers);
        self.end_recording_on(r)
    }

    /// On the side stream of the first GPU: every batch's table copied into
    /// a pool table (kept until the wait), the launches queued, one event
    /// recorded after them (the host's wait). The work streams wait for it
    /// only through a later mark's join ([`Device::side_join`]).
    fn side_transfer(
        &mut self,
        code: &Code,
        batches: &[Batch],
        buffers: &[BufferId],
    ) -> Result<SideEvent, DeviceError> {
        self.live()?;
        self.outside_recording("a side-stream transfer")?;
        self.settle_others(0, "side transfer")?;
        self.finish(0, "side transfer")?;
        let (f, tables) = self.prepare_transfer(code, batches, buffers)?;
        if self.side.is_none() {
            let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
                .map_err(|e| driver("cuStreamCreate (side stream)", e))?;
            self.side = Some(Side { stream, last: 0, pending: Vec::new(), beside: 0 });
        }
        let stream = self.side.as_ref().map(|x| x.stream).ok_or_else(|| other("no side stream"))?;
        if self.side_delay_ms > 0 {
            let ms = std::ptr::without_provenance_mut(usize::try_from(self.side_delay_ms).unwrap_or(usize::MAX));
            // SAFETY: the side stream is the first GPU's; the host function
            // makes no CUDA call and its argument is a number, not a pointer.
            let r = unsafe { sys::cuLaunchHostFunc(stream, Some(hold_side_stream), ms) };
            if r != sys::cudaError_enum::CUDA_SUCCESS {
                return Err(driver("cuLaunchHostFunc (MOEFORGE_CUDA_SIDE_DELAY_MS)", result::DriverError(r)));
            }
        }
        let id = self.side.as_ref().map_or(0, |x| x.last) + 1;
        // A failed queue keeps its record under this id (handed to no one):
        // the next wait for a later event, which the side stream reaches
        // after it, retires it.
        self.queue_transfer(stream, f, &tables, buffers.len(), id, true)?;
        Ok(SideEvent(id))
    }

    /// Polls the event (the side stream runs in order, so every earlier
    /// transfer finished too), then returns their tables to the pool.
    fn side_wait(&mut self, event: SideEvent) -> Result<u64, DeviceError> {
        self.live()?;
        self.outside_recording("a side-stream wait")?;
        let Some(side) = self.side.as_ref() else { return Ok(0) };
        let beside = side.beside;
        let Some(p) = side.pending.iter().rev().find(|p| p.id <= event.0) else { return Ok(beside) };
        let e = p.event;
        self.current(0)?;
        // SAFETY: the event lives until `retire` destroys it.
        self.poll("a side-stream transfer (slot swap)", || unsafe { sys::cuEventQuery(e) })?;
        self.retire(event.0);
        Ok(beside)
    }

    /// Records the key's event on the side stream, after what is queued there.
    fn side_mark(&mut self, key: u32) -> Result<(), DeviceError> {
        self.live()?;
        self.outside_recording("a side-stream mark")?;
        let Some(stream) = self.side.as_ref().map(|x| x.stream) else { return Ok(()) };
        self.current(0)?;
        let event = self.mark(key)?;
        // SAFETY: the event and the side stream are the first GPU's and live
        // until Drop.
        unsafe { result::event::record(event, stream) }.map_err(|e| driver("cuEventRecord (side-stream mark)", e))
    }

    /// Every work stream waits for the key's event (`cuStreamWaitEvent`);
    /// inside a recording, as an external event-wait node of the graph
    /// (`CU_EVENT_WAIT_EXTERNAL`), on the event whether or not it has been
    /// recorded yet (a never-recorded event is waited for at once).
    fn side_join(&mut self, key: u32) -> Result<(), DeviceError> {
        self.live()?;
        if self.recording.is_some() {
            let r = self.current(0).and_then(|()| {
                let event = self.mark(key)?;
                let stream = self.ctx(0)?.stream;
                let flags = sys::CUevent_wait_flags_enum::CU_EVENT_WAIT_EXTERNAL as u32;
                // SAFETY: the stream is capturing; the event lives until Drop,
                // after every graph that waits on it.
                let r = unsafe { sys::cuStreamWaitEvent(stream, event, flags) };
                if r == sys::cudaError_enum::CUDA_SUCCESS {
                    Ok(())
                } else {
                    Err(driver("cuStreamWaitEvent (a graph's wait for a side-stream mark)", result::DriverError(r)))
                }
            });
            return self.end_recording_on(r);
        }
        let Some(&event) = self.marks.get(&key) else { return Ok(()) };
        for g in 0..self.ctxs.len() {
            self.current(g)?;
            let stream = self.ctx(g)?.stream;
            // SAFETY: both live until Drop; an event of another context is
            // allowed.
            let r = unsafe { sys::cuStreamWaitEvent(stream, event, 0) };
            if r != sys::cudaError_enum::CUDA_SUCCESS {
                return Err(driver("cuStreamWaitEvent (a side-stream mark)", result::DriverError(r)));
            }
        }
        Ok(())
    }

    /// The bundle's cubin where the driver takes it (no nvcc needed on a
    /// serving machine); otherwise, or without one, built here with nvcc
    /// for this GPU (cached). Loaded into every GPU's context.
    fn load(&mut self, name: &str, source: &str, cubin: Option<&[u8]>) -> Result<ModuleId, DeviceError> {
        self.live()?;
        self.outside_recording("a module load")?;
        if let Some(c) = cubin {
            let bundled = match self.load_image(name, source, c) {
                Ok(id) => {
                    self.from_bundle += 1;
                    return Ok(id);
                }
                Err(e) => e,
            };
            // A cubin this driver or GPU does not take: build it here.
            let image = self.build(name, source).map_err(|e| DeviceError::Build {
                kernel: name.into(),
                device: "cuda device",
                message: format!(
                    "the bundle's cubin does not load ({bundled}) and building the source here failed: {e}"
                ),
            })?;
            let id = self.load_image(name, source, &image)?;
            self.built += 1;
            return Ok(id);
        }
        let image = self.build(name, source)?;
        let id = self.load_image(name, source, &image)?;
        self.built += 1;
        Ok(id)
    }

    /// `GPU 0 (NVIDIA H200): ranks 0, 2; …; peer access between them;
    /// kernels: 6 from the bundle's cubins, 0 built here with nvcc`.
    fn describe(&self) -> Option<String> {
        let gpus: Vec<String> = self
            .ctxs
            .iter()
            .enumerate()
            .map(|(g, c)| {
                let ranks: Vec<String> =
                    self.buffers.iter().enumerate().filter(|(_, b)| b.gpu == g).map(|(k, _)| k.to_string()).collect();
                format!("GPU {} ({}): ranks {}", c.gpu.ordinal, c.gpu.name, ranks.join(", "))
            })
            .collect();
        let peers = if self.ctxs.len() > 1 { "; peer access between them" } else { "" };
        Some(format!(
            "{}{peers}; kernels: {} from the bundle's cubins, {} built here with nvcc",
            gpus.join("; "),
            self.from_bundle,
            self.built
        ))
    }

    /// With one GPU (every rank's buffer on it, so a step's work is its one
    /// work stream's) and launches not each waited for.
    fn captures(&self) -> bool {
        self.ctxs.len() == 1 && !self.sync_launches
    }

    /// Captures the first GPU's work stream (relaxed mode: the host's own
    /// calls beside it, such as a transfer table's allocation, are allowed),
    /// with the graph's done words allocated first.
    fn begin_capture(&mut self) -> Result<(), DeviceError> {
        self.live()?;
        self.outside_recording("a graph recording")?;
        if !self.captures() {
            return Err(other("graphs are recorded on one GPU with queued launches (see Device::captures)"));
        }
        self.current(0)?;
        let stream = self.ctx(0)?.stream;
        // SAFETY: the stream is the first GPU's and not capturing.
        let r =
            unsafe { sys::cuStreamBeginCapture_v2(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) };
        if r != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(driver("cuStreamBeginCapture", result::DriverError(r)));
        }
        // The done words are allocated as the APK operations are recorded.
        self.recording = Some(Recording { done: Vec::new(), entries: Vec::new(), tables: Vec::new() });
        Ok(())
    }

    fn end_capture(&mut self) -> Result<GraphId, DeviceError> {
        let Some(rec) = self.recording.take() else { return Err(other("no graph is being recorded")) };
        let stream = self.ctx(0)?.stream;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream is capturing; the graph is kept or destroyed below.
        let r = unsafe { sys::cuStreamEndCapture(stream, &raw mut graph) };
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        let r = if r == sys::cudaError_enum::CUDA_SUCCESS {
            // SAFETY: `graph` was just captured.
            unsafe { sys::cuGraphInstantiateWithFlags(&raw mut exec, graph, 0) }
        } else {
            r
        };
        if r != sys::cudaError_enum::CUDA_SUCCESS {
            // SAFETY: nothing launched the graph; destroyed once.
            unsafe {
                if !graph.is_null() {
                    let _ = sys::cuGraphDestroy(graph);
                }
                for at in rec.done {
                    let _ = result::free_sync(at);
                }
            }
            self.tables.extend(rec.tables);
            return Err(driver("cuStreamEndCapture / cuGraphInstantiate", result::DriverError(r)));
        }
        let id = u32::try_from(self.graphs.len()).map_err(|_| other("too many graphs"))?;
        self.graphs.push(Graph { graph, exec, done: rec.done, entries: rec.entries, tables: rec.tables });
        Ok(GraphId(id))
    }

    /// Launches the graph on the first GPU's work stream and returns; its
    /// done words are checked at the next download (first, if it already
    /// ran unchecked, since this replay writes them again).
    fn replay(&mut self, graph: GraphId) -> Result<(), DeviceError> {
        self.live()?;
        self.outside_recording("a graph replay")?;
        let i = graph.0 as usize;
        if self.replayed.contains(&i) {
            self.check_graphs()?;
        }
        self.current(0)?;
        let exec = self.graphs.get(i).map(|g| g.exec).ok_or_else(|| other(format!("no graph {i}")))?;
        let stream = self.ctx(0)?.stream;
        // SAFETY: `exec` was instantiated in this context; the buffers,
        // modules and tables it reads live as long as the device.
        let r = unsafe { sys::cuGraphLaunch(exec, stream) };
        if r != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(driver(&format!("cuGraphLaunch (decode graph {i})"), result::DriverError(r)));
        }
        let c = self.ctx(0)?;
        c.pending.set(true);
        *c.last_launch.borrow_mut() = format!("decode graph {i}");
        self.replayed.push(i);
        self.main_op_done();
        Ok(())
    }

    /// On the GPU of its first pointer argument (the rank whose op it is);
    /// a launch without one runs on the first GPU. A failure inside a
    /// recording ends it.
    fn launch(
        &mut self,
        module: ModuleId,
        entry: &str,
        grid: u32,
        block: u32,
        args: &[KernelArg],
    ) -> Result<(), DeviceError> {
        let r = self.launch_now(module, entry, grid, block, args);
        self.end_recording_on(r)
    }
}

impl CudaDevice {
    /// A call's result; its failure inside a recording ends the recording
    /// (the graph would lack the call), so the executor runs the step call
    /// by call instead.
    fn end_recording_on(&mut self, r: Result<(), DeviceError>) -> Result<(), DeviceError> {
        if r.is_err() && self.recording.is_some() {
            self.drop_recording();
        }
        r
    }

    fn transfer_now(&mut self, code: &Code, batches: &[Batch], buffers: &[BufferId]) -> Result<(), DeviceError> {
        self.live()?;
        // Work queued on another GPU may still touch these buffers through
        // peer access; the first GPU's own stream orders its earlier work.
        self.settle_others(0, "transfer")?;
        let (f, tables) = self.prepare_transfer(code, batches, buffers)?;
        self.reclaim();
        let stream = self.ctx(0)?.stream;
        let c = self.ctx(0)?;
        // Later work on another GPU waits for it; a fault in it is reported
        // at the next wait on the first GPU, naming it.
        c.pending.set(true);
        *c.last_launch.borrow_mut() = moeforge_xfer::ENTRY.to_string();
        if self.recording.is_some() {
            return self.record_transfer(stream, f, &tables, buffers.len());
        }
        self.queue_transfer(stream, f, &tables, buffers.len(), 0, false)?;
        if self.sync_launches {
            self.finish(0, "transfer")?;
        }
        self.main_op_done();
        Ok(())
    }

    fn fill_now(&mut self, buffer: BufferId, offset: u64, len: u64, byte: u8) -> Result<(), DeviceError> {
        self.live()?;
        let (g, at) = self.address(buffer, offset, len).map_err(|e| other(format!("fill: {e}")))?;
        // A kernel on another GPU may still read these bytes through peer access.
        self.settle_others(g, "fill")?;
        let c = self.ctx(g)?;
        // SAFETY: `address` checked that `at` holds `len` bytes; the memset
        // is ordered on `g`'s work stream.
        unsafe { result::memset_d8_async(at, byte, len as usize, c.stream) }
            .map_err(|e| driver("fill: cuMemsetD8Async", e))?;
        c.pending.set(true);
        if self.sync_launches {
            self.finish(g, "fill")?;
        }
        Ok(())
    }

    fn launch_now(
        &mut self,
        module: ModuleId,
        entry: &str,
        grid: u32,
        block: u32,
        args: &[KernelArg],
    ) -> Result<(), DeviceError> {
        self.live()?;
        let module_name = self.modules.get(module.0 as usize).map(|m| m.name.clone()).unwrap_or_default();
        let what = format!("{module_name}::{entry}");
        let mut g = None;
        // One 8-byte slot per parameter, holding its value as the kernel reads it.
        let mut values: Vec<[u8; 8]> = Vec::with_capacity(args.len());
        for a in args {
            let mut v = [0u8; 8];
            match *a {
                KernelArg::Ptr { buffer, offset } => {
                    let (on, at) = self.address(buffer, offset, 0)?;
                    g.get_or_insert(on);
                    v = at.to_le_bytes();
                }
                KernelArg::Null => {}
                KernelArg::I32(x) => v[..4].copy_from_slice(&x.to_le_bytes()),
                KernelArg::I64(x) => v = x.to_le_bytes(),
                KernelArg::F32(x) => v[..4].copy_from_slice(&x.to_le_bytes()),
            }
            values.push(v);
        }
        let g = g.unwrap_or(0);
        // Its pointers may reach another GPU's buffer through peer access.
        self.settle_others(g, &what)?;
        if self.launch_apk(module, g, entry, grid, &mut values)? {
            self.main_op_done();
            return Ok(());
        }
        let f = self.function(module, g, entry)?;
        let mut params: Vec<*mut c_void> = values.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
        self.raw_launch(g, f, grid, block, 0, &mut params)
            .map_err(|e| DeviceError::Launch { entry: what.clone(), message: e.to_string() })?;
        if self.sync_launches {
            self.finish(g, &what)?;
        } else {
            // Queued: the stream orders it before the GPU's next work; any
            // work that can touch this GPU's memory from another waits for it.
            let c = self.ctx(g)?;
            c.pending.set(true);
            *c.last_launch.borrow_mut() = what;
        }
        self.main_op_done();
        Ok(())
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // A hung kernel may still use everything: leave it to the process's exit.
        if self.poisoned.get().is_some() {
            return;
        }
        // A stream still capturing cannot be waited for: end the capture first.
        if self.recording.is_some() && self.current(0).is_ok() {
            self.drop_recording();
        }
        for g in 0..self.ctxs.len() {
            if self.current(g).is_err() || self.finish(g, "teardown").is_err() {
                return;
            }
        }
        if let Some(stream) = self.side.as_ref().map(|x| x.stream) {
            // SAFETY: the side stream lives until destroyed below.
            if self.current(0).is_err() || self.poll("teardown", || unsafe { sys::cuStreamQuery(stream) }).is_err() {
                return;
            }
            self.retire(u64::MAX);
            // SAFETY: idle, not used after this.
            let _ = unsafe { result::stream::destroy(stream) };
        }
        // Every work stream finished: the queued transfers' tables are free,
        // and no graph runs.
        if self.current(0).is_ok() {
            self.drop_recording();
            for g in std::mem::take(&mut self.graphs) {
                // SAFETY: the stream is idle; each destroyed once, not used after this.
                unsafe {
                    let _ = sys::cuGraphExecDestroy(g.exec);
                    let _ = sys::cuGraphDestroy(g.graph);
                    for at in g.done {
                        let _ = result::free_sync(at);
                    }
                }
                self.tables.extend(g.tables);
            }
            // After the graphs that wait on them; both streams are idle.
            for (_, e) in std::mem::take(&mut self.marks) {
                // SAFETY: destroyed once, not used after this.
                let _ = unsafe { result::event::destroy(e) };
            }
            self.reclaim();
            for t in std::mem::take(&mut self.tables) {
                // SAFETY: every stream is idle: nothing reads them.
                let _ = unsafe { result::free_sync(t.dev) };
                // SAFETY: as above.
                let _ = unsafe { result::free_host(t.host.cast()) };
            }
        }
        for m in &self.modules {
            for (g, l) in m.per_gpu.iter().enumerate() {
                if self.current(g).is_err() {
                    continue;
                }
                for apk in l.apk.values() {
                    for p in [apk.templates, apk.state, apk.calls] {
                        // SAFETY: allocated in setup_apk, not used after this.
                        let _ = unsafe { result::free_sync(p) };
                    }
                }
                // SAFETY: no launch of this module is pending (every stream finished).
                let _ = unsafe { result::module::unload(l.module) };
            }
        }
        for b in &self.buffers {
            if self.current(b.gpu).is_ok() {
                // SAFETY: allocated in alloc, not used after this.
                let _ = unsafe { result::free_sync(b.ptr) };
            }
        }
        for c in &self.ctxs {
            // SAFETY: retained in open.
            if unsafe { result::ctx::set_current(c.ctx) }.is_err() {
                continue;
            }
            for &(module, _) in c.transfers.values() {
                // SAFETY: the stream is idle; the module is not used after this.
                let _ = unsafe { result::module::unload(module) };
            }
            if let Some(log) = &c.done_log {
                // SAFETY: as above.
                let _ = unsafe { result::free_sync(log.dev) };
            }
            for &(host, event, _) in c.staging.iter().flat_map(|st| st.chunks.iter()) {
                // SAFETY: the stream finished every copy out of it; not used after this.
                let _ = unsafe { result::free_host(host.cast()) };
                // SAFETY: as above.
                let _ = unsafe { result::event::destroy(event) };
            }
            // SAFETY: the stream is idle and not used after this.
            let _ = unsafe { result::stream::destroy(c.stream) };
            // SAFETY: retained in open.
            let _ = unsafe { result::primary_ctx::release(c.device) };
        }
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

    #[test]
    fn the_done_log_names_the_first_operation_left_unfinished() {
        let entries: Vec<String> = ["qkv", "experts", "o_proj"].iter().map(|s| s.to_string()).collect();
        assert_eq!(unfinished(&[1, 1, 1], &entries), None);
        // A grid that returned early leaves its phase's `done` at 0; the
        // first such operation in queue order is the one named.
        assert_eq!(unfinished(&[1, 0, 0], &entries), Some(("experts", 0)));
        assert_eq!(unfinished(&[2, 1, 1], &entries), Some(("qkv", 2)));
        let e = not_finished("experts", 0).to_string();
        assert!(e.contains("experts") && e.contains("done = 0"), "{e}");
    }

    /// Without a driver (every CI machine), opening the device is an error
    /// that says what is missing; with one, probing lists its GPUs.
    #[test]
    fn probing_without_a_driver_is_an_error_not_a_panic() {
        match probe() {
            Err(e) => {
                let m = e.to_string();
                assert!(m.contains("no CUDA driver found") || m.contains("sees no GPU") || m.contains("cuInit"), "{m}");
                let Err(open) = CudaDevice::open(&[0], &std::env::temp_dir()) else { panic!("opened without a GPU") };
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

    /// A mapped checkpoint holds the same tensors as a read one (two ways
    /// of getting the bytes), and the tensors loading keeps as stored are
    /// ranges of the mapping, not copies: their bytes lie in the file's
    /// mapping as the kernel lists it (Linux's /proc/self/maps).
    #[test]
    fn a_mapped_checkpoint_is_the_read_one_without_copies() {
        use moeforge_runtime::twin::weights::Checkpoint;
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/qwen3-moe");
        let read = Checkpoint::load(&dir).unwrap();
        let mapped = Checkpoint::load_with(&dir, &map_file).unwrap();
        assert_eq!(read.tensors.len(), mapped.tensors.len());
        assert!(read.tensors.len() > 10);
        for (name, t) in &read.tensors {
            assert_eq!(Some(t), mapped.tensors.get(name), "{name}");
        }
        assert!(mapped.tensors.values().all(|t| t.data.is_in_file()), "a bf16 checkpoint is kept as stored");
        if let Ok(maps) = std::fs::read_to_string("/proc/self/maps") {
            let file = std::fs::canonicalize(dir.join("model.safetensors")).unwrap();
            let ranges: Vec<(usize, usize)> = maps
                .lines()
                .filter(|l| l.ends_with(file.to_str().unwrap()))
                .filter_map(|l| {
                    let (a, b) = l.split_whitespace().next()?.split_once('-')?;
                    Some((usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?))
                })
                .collect();
            assert!(!ranges.is_empty(), "model.safetensors is not mapped");
            for (name, t) in &mapped.tensors {
                let p = t.data.as_ptr() as usize;
                assert!(ranges.iter().any(|&(a, b)| a <= p && p + t.data.len() <= b), "{name} is not in the mapping");
            }
            for (name, t) in &read.tensors {
                let p = t.data.as_ptr() as usize;
                assert!(!ranges.iter().any(|&(a, b)| a <= p && p < b), "{name}: the read checkpoint is mapped");
            }
        }
        let missing = Checkpoint::load_with(&dir.join("absent"), &map_file);
        assert!(missing.is_err());
    }

    /// An ELF64 with one section, its bytes and header tables as `check_cubin` reads them.
    fn elf(section_off: u64, section_size: u64) -> Vec<u8> {
        let mut b = vec![0u8; 256];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2; // 64-bit
        b[5] = 1; // little-endian
        b[40..48].copy_from_slice(&128u64.to_le_bytes()); // e_shoff
        b[58..60].copy_from_slice(&64u16.to_le_bytes()); // e_shentsize
        b[60..62].copy_from_slice(&1u16.to_le_bytes()); // e_shnum
        b[128 + 4..128 + 8].copy_from_slice(&1u32.to_le_bytes()); // SHT_PROGBITS
        b[128 + 24..128 + 32].copy_from_slice(&section_off.to_le_bytes());
        b[128 + 32..128 + 40].copy_from_slice(&section_size.to_le_bytes());
        b
    }

    /// Bytes the driver would read past (not ELF, truncated, a header table
    /// or a section outside them) are refused before `cuModuleLoadData`
    /// (tests/nvcc.rs checks that nvcc's real cubins pass).
    #[test]
    fn only_whole_elf_objects_reach_the_driver() {
        assert!(check_cubin(&elf(64, 64)).is_ok());
        assert!(check_cubin(&[]).unwrap_err().contains("not an ELF"));
        assert!(check_cubin(b"\x7fELF not a kernel of this plan, but long enough to pass the length check.....")
            .unwrap_err()
            .contains("ELF64"));
        assert!(check_cubin(&elf(200, 100)).unwrap_err().contains("section 0"));
        assert!(check_cubin(&elf(u64::MAX, 2)).unwrap_err().contains("section 0"));
        let mut far = elf(64, 64);
        far[40..48].copy_from_slice(&250u64.to_le_bytes());
        assert!(check_cubin(&far).unwrap_err().contains("section header table"));
        let mut many = elf(64, 64);
        many[56..58].copy_from_slice(&u16::MAX.to_le_bytes()); // e_phnum
        many[54..56].copy_from_slice(&56u16.to_le_bytes());
        assert!(check_cubin(&many).unwrap_err().contains("program header table"));
        assert!(check_cubin(&elf(64, 64)[..150]).unwrap_err().contains("section header table"));
    }

    fn h100(ordinal: usize) -> Gpu {
        Gpu { ordinal, name: "NVIDIA H100 80GB HBM3".into(), capability: (9, 0), sms: 132, memory_bytes: 80 << 30 }
    }

    /// A GPU per rank while there are enough; the chosen ordinals in their
    /// order; an unknown or repeated ordinal is refused by name.
    #[test]
    fn a_run_drives_at_most_one_gpu_per_rank_of_the_ones_chosen() {
        let eight: Vec<Gpu> = (0..8).map(h100).collect();
        let ordinals = |v: Vec<Gpu>| v.iter().map(|g| g.ordinal).collect::<Vec<_>>();
        assert_eq!(ordinals(select(&eight, None, 4).unwrap()), vec![0, 1, 2, 3]);
        assert_eq!(ordinals(select(&eight, None, 16).unwrap()).len(), 8);
        assert_eq!(ordinals(select(&eight, Some(&[5, 2]), 4).unwrap()), vec![5, 2]);
        assert_eq!(ordinals(select(&eight, Some(&[7]), 4).unwrap()), vec![7]);
        assert!(select(&eight, Some(&[8]), 4).unwrap_err().contains("GPU 8 does not exist"));
        assert!(select(&eight, Some(&[1, 1]), 4).unwrap_err().contains("named twice"));
        assert!(select(&[], None, 4).is_err());
    }

    /// Rank r on GPU r mod n: every GPU holds ⌈ranks / n⌉ or ⌊ranks / n⌋
    /// buffers, and the check counts exactly those against each GPU's memory.
    #[test]
    fn rank_buffers_go_round_the_gpus_and_must_fit_each() {
        for (ranks, n) in [(8usize, 8usize), (8, 2), (8, 3), (2, 1), (5, 4)] {
            let mut held = vec![0usize; n];
            for k in 0..ranks {
                held[gpu_of(k, n)] += 1;
            }
            assert!(held.iter().all(|&h| h == ranks / n || h == ranks.div_ceil(n)), "{ranks} over {n}: {held:?}");
            assert_eq!(held.iter().sum::<usize>(), ranks);
        }
        let two = [h100(0), h100(1)];
        // Four 30 GiB buffers over two 80 GiB GPUs fit; over one they do not.
        assert!(check_fit(4, 30 << 30, &two).is_ok());
        let e = check_fit(4, 30 << 30, &two[..1]).unwrap_err();
        assert!(e.contains("GPU 0") && e.contains("4 rank buffer(s)"), "{e}");
        // Three over two: GPU 0 holds two (60 GiB), fits; at 41 GiB it does not.
        assert!(check_fit(3, 30 << 30, &two).is_ok());
        assert!(check_fit(3, 41 << 30, &two).unwrap_err().contains("GPU 0 (NVIDIA H100 80GB HBM3) would hold 2"));
    }
}
