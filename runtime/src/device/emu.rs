//! The emulated device (`--backend emu`'s device): the bundle's own emitted
//! kernel sources built for the host with g++ against the project's CUDA
//! shim (`runtime/shim/`: CUDA threads as fibers, blocks one after
//! another or, for the APK, every block of the grid resident in its CTA
//! clusters; `__syncthreads` a barrier; the APK's PTX layer emulated
//! instruction by instruction by `ptx_host.h`), each kernel instance a shared
//! library exporting the emitted launch table (`moeforge_emu_launch`),
//! loaded by a device process (`shim/emu_device.cpp`) that owns the device
//! memory. The runtime talks to it over a pipe: the kernels run in their
//! own process, so a kernel that traps or faults stops that process, and
//! the launch it was running is reported, instead of taking the runtime
//! down (the workspace also forbids `unsafe`, which loading a library
//! in-process would need).
//!
//! It records graphs ([`Device::begin_capture`]) as the list of launches,
//! transfers (checked as they are recorded), fills and side joins (each
//! looking up its key's mark as it runs), replayed in order;
//! an upload, readback, load or side-stream call inside a recording is an
//! error that drops it, as it would break a CUDA stream capture.
//!
//! Builds are cached by content (the source, the shim, the flags and the
//! compiler's version) under `MOEFORGE_EMU_CACHE`, `$XDG_CACHE_HOME/moeforge/emu`
//! or `~/.cache/moeforge/emu`; entries are renamed into place, so
//! concurrent builds are safe.

use super::{Batch, BufferId, Code, Device, DeviceError, GraphId, KernelArg, ModuleId, SideEvent};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

const CUDA_HOST: &str = include_str!("../../shim/cuda_host.h");
const CUDA_BF16: &str = include_str!("../../shim/cuda_bf16.h");
const DEVICE_MAIN: &str = include_str!("../../shim/emu_device.cpp");
const APK_HOST: &str = include_str!("../../shim/apk_host.h");
const PTX_HOST: &str = include_str!("../../shim/ptx_host.h");

/// g++ flags of the kernel libraries: the host-emulation tier's (no
/// floating-point contraction, so f32 arithmetic rounds as written).
const KERNEL_FLAGS: &[&str] = &[
    "-std=c++20",
    "-O2",
    "-pthread",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    "-fvisibility-inlines-hidden",
    "-fno-strict-aliasing",
    "-ffp-contract=off",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unknown-pragmas",
    "-Wno-unused-parameter",
    "-Wno-psabi",
    "-DMOEFORGE_HOST",
    "-DMOEFORGE_EMU",
];

pub struct EmuDevice {
    child: Child,
    tx: BufWriter<ChildStdin>,
    rx: BufReader<ChildStdout>,
    cache: PathBuf,
    shim: PathBuf,
    /// Identifies the compiler and the shim in every cache key.
    salt: String,
    /// Module names, for errors.
    modules: Vec<String>,
    /// Each buffer's bytes, for checking transfer batches.
    sizes: Vec<u64>,
    /// Loaded transfer programs by content key.
    transfers: BTreeMap<String, u32>,
    /// The graph being recorded ([`Device::begin_capture`]), and the kept
    /// ones by [`GraphId`].
    capture: Option<Vec<Call>>,
    graphs: Vec<Vec<Call>>,
    /// The side stream's last event, and each key's mark
    /// ([`Device::side_mark`]).
    side_last: SideEvent,
    marks: BTreeMap<u32, SideEvent>,
}

/// One recorded call of a graph, with the arguments it was issued with (a
/// `Join`'s key's mark is looked up when it runs, [`Device::side_join`]).
#[derive(Clone, Debug)]
enum Call {
    Launch { module: ModuleId, entry: String, grid: u32, block: u32, args: Vec<KernelArg> },
    Transfer { code: Code, batches: Vec<Batch>, buffers: Vec<BufferId> },
    Fill { buffer: BufferId, offset: u64, len: u64, byte: u8 },
    Join { key: u32 },
}

/// The default build cache.
pub fn default_cache() -> PathBuf {
    if let Some(d) = std::env::var_os("MOEFORGE_EMU_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("moeforge").join("emu")
}

fn other(what: impl std::fmt::Display) -> DeviceError {
    DeviceError::Other(what.to_string())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().take(12).map(|b| format!("{b:02x}")).collect()
}

/// LLVM 19's `llc`: `$MOEFORGE_LLC`, else the one under
/// `$LLVM_SYS_191_PREFIX` or `/usr/lib/llvm-19` (Debian's llvm-19, which
/// `scripts/setup.sh` installs), else `llc-19` on the PATH.
pub fn llc() -> PathBuf {
    if let Some(p) = std::env::var_os("MOEFORGE_LLC") {
        return PathBuf::from(p);
    }
    let prefix =
        std::env::var_os("LLVM_SYS_191_PREFIX").map_or_else(|| PathBuf::from("/usr/lib/llvm-19"), PathBuf::from);
    let p = prefix.join("bin/llc");
    if p.is_file() {
        p
    } else {
        PathBuf::from("llc-19")
    }
}

/// Writes `data` to `path` unless it is there, through a temporary file
/// renamed into place.
fn put(path: &Path, data: &[u8]) -> Result<(), DeviceError> {
    if path.exists() {
        return Ok(());
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, data).map_err(|e| other(format!("cannot write {}: {e}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(|e| other(format!("cannot write {}: {e}", path.display())))
}

impl EmuDevice {
    /// Builds (or finds) the device process and starts it.
    pub fn start(cache: &Path) -> Result<EmuDevice, DeviceError> {
        std::fs::create_dir_all(cache).map_err(|e| other(format!("cannot create {}: {e}", cache.display())))?;
        let version = Command::new("g++")
            .arg("--version")
            .output()
            .map_err(|e| other(format!("the emulated device needs g++ (C++20): {e}")))?;
        let mut h = Sha256::new();
        for part in [CUDA_HOST, CUDA_BF16, DEVICE_MAIN, APK_HOST, PTX_HOST] {
            h.update(part.as_bytes());
        }
        h.update(&version.stdout);
        let salt = hex(&h.finalize());
        let shim = cache.join(format!("shim-{salt}"));
        if !shim.exists() {
            let tmp = cache.join(format!("shim-{salt}.tmp{}", std::process::id()));
            std::fs::create_dir_all(&tmp).map_err(|e| other(format!("cannot create {}: {e}", tmp.display())))?;
            for (name, text) in [
                ("cuda_host.h", CUDA_HOST),
                ("cuda_bf16.h", CUDA_BF16),
                ("emu_device.cpp", DEVICE_MAIN),
                ("apk_host.h", APK_HOST),
                ("ptx_host.h", PTX_HOST),
            ] {
                std::fs::write(tmp.join(name), text).map_err(|e| other(format!("cannot write {name}: {e}")))?;
            }
            if std::fs::rename(&tmp, &shim).is_err() && !shim.exists() {
                return Err(other(format!("cannot create {}", shim.display())));
            }
            let _ = std::fs::remove_dir_all(&tmp);
        }
        let bin = cache.join(format!("emu_device-{salt}"));
        if !bin.exists() {
            let tmp = cache.join(format!("emu_device-{salt}.tmp{}", std::process::id()));
            let o = Command::new("g++")
                .args(["-std=c++20", "-O2", "-pthread", "-Wall", "-Wextra", "-Werror"])
                .arg(shim.join("emu_device.cpp"))
                .arg("-o")
                .arg(&tmp)
                .arg("-ldl")
                .output()
                .map_err(|e| other(format!("cannot run g++: {e}")))?;
            if !o.status.success() {
                return Err(DeviceError::Build {
                    kernel: "emu_device".into(),
                    device: "emulated device",
                    message: String::from_utf8_lossy(&o.stderr).into_owned(),
                });
            }
            std::fs::rename(&tmp, &bin).map_err(|e| other(format!("cannot write {}: {e}", bin.display())))?;
        }
        let mut child = Command::new(&bin)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| other(format!("cannot start {}: {e}", bin.display())))?;
        let (Some(tx), Some(rx)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(other("the emulated device has no pipes"));
        };
        Ok(EmuDevice {
            child,
            tx: BufWriter::new(tx),
            rx: BufReader::new(rx),
            cache: cache.to_path_buf(),
            shim,
            salt,
            modules: Vec::new(),
            sizes: Vec::new(),
            transfers: BTreeMap::new(),
            capture: None,
            graphs: Vec::new(),
            side_last: SideEvent(0),
            marks: BTreeMap::new(),
        })
    }

    /// From now on the side stream starts a transfer only when a wait
    /// ([`Device::side_wait`], or a [`Device::side_join`] as it runs) asks
    /// for it: as late as the runtime's waits allow, a legal schedule of
    /// the same program in which every main-stream call before the wait
    /// runs beside the queued side work. Tests use it to see that a step
    /// waits where it must (a wait placed too late computes with the bytes
    /// a swap has not moved yet) and to count the overlap without timing.
    pub fn lazy_side(&mut self) -> Result<(), DeviceError> {
        self.outside_capture("a side-stream setting")?;
        self.send(&[10u8])?;
        self.reply("a side-stream setting")?.map_err(other)
    }

    /// Blocks the main stream (the device process's request loop) until
    /// side transfer `event` finished; returns the overlap count.
    fn wait_event(&mut self, event: SideEvent) -> Result<u64, DeviceError> {
        if event.0 == 0 {
            return Ok(0);
        }
        let mut m = vec![9u8];
        m.extend(event.0.to_le_bytes());
        self.send(&m)?;
        self.reply("a side-stream wait")?.map_err(other)?;
        Ok(u64::from_le_bytes(self.read_n(8, "a side-stream wait")?.try_into().unwrap_or_default()))
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), DeviceError> {
        self.tx.write_all(bytes).map_err(|e| other(format!("the emulated device stopped: {e}")))
    }

    /// The reply's status; an error reply's message as `Err`. `what` names
    /// the request for the error when the device process has stopped.
    fn reply(&mut self, what: &str) -> Result<Result<(), String>, DeviceError> {
        self.tx.flush().map_err(|e| other(format!("the emulated device stopped: {e}")))?;
        let mut status = [0u8; 1];
        if self.rx.read_exact(&mut status).is_err() {
            let code = self.child.wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
            return Err(other(format!(
                "the emulated device stopped during {what} ({code}): a kernel trapped or faulted"
            )));
        }
        if status[0] == 0 {
            return Ok(Ok(()));
        }
        let n = u32::from_le_bytes(self.read_n(4, what)?.try_into().unwrap_or_default());
        let msg = self.read_n(n as usize, what)?;
        Ok(Err(String::from_utf8_lossy(&msg).into_owned()))
    }

    fn read_n(&mut self, n: usize, what: &str) -> Result<Vec<u8>, DeviceError> {
        let mut v = vec![0u8; n];
        self.rx.read_exact(&mut v).map_err(|e| other(format!("the emulated device stopped during {what}: {e}")))?;
        Ok(v)
    }

    fn read_u32(&mut self, what: &str) -> Result<u32, DeviceError> {
        Ok(u32::from_le_bytes(self.read_n(4, what)?.try_into().unwrap_or_default()))
    }

    /// Builds kernel instance `name` for the host, or finds it in the cache.
    fn build(&self, name: &str, source: &str) -> Result<PathBuf, DeviceError> {
        let mut h = Sha256::new();
        h.update(source.as_bytes());
        h.update(KERNEL_FLAGS.join(" ").as_bytes());
        h.update(self.salt.as_bytes());
        let key = hex(&h.finalize());
        let lib = self.cache.join(format!("{name}-{key}.so"));
        if lib.exists() {
            return Ok(lib);
        }
        let src = self.cache.join(format!("{name}-{key}.cu"));
        put(&src, source.as_bytes())?;
        let tmp = self.cache.join(format!("{name}-{key}.so.tmp{}", std::process::id()));
        let o = Command::new("g++")
            .args(KERNEL_FLAGS)
            .arg(format!("-I{}", self.shim.display()))
            .args(["-include", "cuda_host.h", "-x", "c++"])
            .arg(&src)
            .arg("-o")
            .arg(&tmp)
            .output()
            .map_err(|e| other(format!("cannot run g++: {e}")))?;
        if !o.status.success() {
            let err = String::from_utf8_lossy(&o.stderr);
            let lines: Vec<&str> = err.lines().take(20).collect();
            return Err(DeviceError::Build {
                kernel: name.into(),
                device: "emulated device",
                message: lines.join("\n"),
            });
        }
        std::fs::rename(&tmp, &lib).map_err(|e| other(format!("cannot write {}: {e}", lib.display())))?;
        Ok(lib)
    }
}

impl EmuDevice {
    /// Refuses a call a graph cannot hold while one is being recorded, and
    /// ends that recording (a CUDA stream capture is invalidated the same way).
    fn outside_capture(&mut self, what: &str) -> Result<(), DeviceError> {
        match self.capture.take() {
            Some(_) => Err(other(format!(
                "{what} while a graph is being recorded (a graph holds launches, transfers, fills and side joins only); the \
                 recording is dropped"
            ))),
            None => Ok(()),
        }
    }

    /// Checks a transfer's batches against the buffers' sizes.
    fn check_transfer(&self, code: &Code, batches: &[Batch], buffers: &[BufferId]) -> Result<(), DeviceError> {
        let sizes = buffers
            .iter()
            .map(|b| self.sizes.get(b.0 as usize).copied().ok_or_else(|| other(format!("transfer: no buffer {}", b.0))))
            .collect::<Result<Vec<u64>, _>>()?;
        for b in batches {
            b.check(&code.program, &sizes).map_err(other)?;
        }
        Ok(())
    }

    /// Runs one recorded call.
    fn run(&mut self, call: &Call) -> Result<(), DeviceError> {
        match call {
            Call::Launch { module, entry, grid, block, args } => self.run_launch(*module, entry, *grid, *block, args),
            Call::Transfer { code, batches, buffers } => self.queue_transfer(code, batches, buffers, false).map(|_| ()),
            Call::Fill { buffer, offset, len, byte } => {
                let len = usize::try_from(*len).map_err(|_| other(format!("a fill of {len} bytes")))?;
                self.run_upload(*buffer, *offset, &vec![*byte; len])
            }
            Call::Join { key } => {
                let event = self.marks.get(key).copied().unwrap_or(SideEvent(0));
                self.wait_event(event).map(|_| ())
            }
        }
    }

    fn run_upload(&mut self, buffer: BufferId, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        let mut m = vec![2u8];
        m.extend(buffer.0.to_le_bytes());
        m.extend(offset.to_le_bytes());
        m.extend((data.len() as u64).to_le_bytes());
        self.send(&m)?;
        self.send(data)?;
        self.reply("upload")?.map_err(other)
    }

    fn run_launch(
        &mut self,
        module: ModuleId,
        entry: &str,
        grid: u32,
        block: u32,
        args: &[KernelArg],
    ) -> Result<(), DeviceError> {
        let mut m = vec![5u8];
        m.extend(module.0.to_le_bytes());
        m.extend((entry.len() as u32).to_le_bytes());
        m.extend(entry.as_bytes());
        m.extend(grid.to_le_bytes());
        m.extend(block.to_le_bytes());
        m.extend((args.len() as u32).to_le_bytes());
        for a in args {
            match *a {
                KernelArg::Ptr { buffer, offset } => {
                    m.push(0);
                    m.extend(buffer.0.to_le_bytes());
                    m.extend(offset.to_le_bytes());
                }
                KernelArg::Null => m.push(1),
                KernelArg::I32(v) => {
                    m.push(2);
                    m.extend(v.to_le_bytes());
                }
                KernelArg::I64(v) => {
                    m.push(3);
                    m.extend(v.to_le_bytes());
                }
                KernelArg::F32(v) => {
                    m.push(4);
                    m.extend(v.to_le_bytes());
                }
            }
        }
        self.send(&m)?;
        let module_name = self.modules.get(module.0 as usize).cloned().unwrap_or_default();
        let what = format!("`{module_name}::{entry}`");
        match self.reply(&what) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(message)) => Err(DeviceError::Launch { entry: format!("{module_name}::{entry}"), message }),
            Err(e) => Err(DeviceError::Launch { entry: format!("{module_name}::{entry}"), message: e.to_string() }),
        }
    }

    /// Checks a transfer program's batches against the buffers, then runs
    /// them on the main stream, or (`side`) queues them on the side stream
    /// and returns the last one's event (`SideEvent(0)`: nothing queued).
    fn queue_transfer(
        &mut self,
        code: &Code,
        batches: &[Batch],
        buffers: &[BufferId],
        side: bool,
    ) -> Result<SideEvent, DeviceError> {
        self.check_transfer(code, batches, buffers)?;
        let id = self.transfer_program(code)?;
        let mut event = SideEvent(0);
        for b in batches.iter().filter(|b| !b.is_empty()) {
            let words = b.words();
            let mut m = vec![if side { 8u8 } else { 6u8 }];
            m.extend(id.to_le_bytes());
            m.extend((buffers.len() as u32).to_le_bytes());
            for x in buffers {
                m.extend(x.0.to_le_bytes());
            }
            m.extend((words.len() as u64).to_le_bytes());
            for w in words {
                m.extend(w.to_le_bytes());
            }
            self.send(&m)?;
            self.reply("transfer")?.map_err(other)?;
            if side {
                event = SideEvent(u64::from_le_bytes(self.read_n(8, "transfer")?.try_into().unwrap_or_default()));
            }
        }
        Ok(event)
    }

    /// Loads a transfer program into the device process: its host IR
    /// compiled by LLVM's `llc` ([`llc`]) and linked into a shared library,
    /// cached by the IR's content.
    fn transfer_program(&mut self, code: &Code) -> Result<u32, DeviceError> {
        let key = code.program.key();
        if let Some(&id) = self.transfers.get(&key) {
            return Ok(id);
        }
        let mut h = Sha256::new();
        h.update(code.host_ir.as_bytes());
        h.update(self.salt.as_bytes());
        let name = format!("xfer-{}", hex(&h.finalize()));
        let lib = self.cache.join(format!("{name}.so"));
        let build = |message: String| DeviceError::Build {
            kernel: "a transfer program".into(),
            device: "emulated device",
            message,
        };
        if !lib.exists() {
            let ir = self.cache.join(format!("{name}.ll"));
            put(&ir, code.host_ir.as_bytes())?;
            // Unique per process and thread: tests build in parallel threads.
            let pid = format!("{}-{:?}", std::process::id(), std::thread::current().id()).replace(['(', ')'], "");
            let obj = self.cache.join(format!("{name}.o.tmp{pid}"));
            let llc = llc();
            let o = Command::new(&llc)
                .args(["-O3", "-relocation-model=pic", "-filetype=obj", "-o"])
                .arg(&obj)
                .arg(&ir)
                .output()
                .map_err(|e| build(format!("cannot run {} ({e}): the emulated device compiles transfer programs with LLVM 19's llc (scripts/setup.sh installs it; or set MOEFORGE_LLC)", llc.display())))?;
            if !o.status.success() {
                return Err(build(String::from_utf8_lossy(&o.stderr).lines().take(20).collect::<Vec<_>>().join("\n")));
            }
            let tmp = self.cache.join(format!("{name}.so.tmp{pid}"));
            let o = Command::new("g++")
                .args(["-shared", "-o"])
                .arg(&tmp)
                .arg(&obj)
                .output()
                .map_err(|e| other(format!("cannot run g++: {e}")))?;
            let _ = std::fs::remove_file(&obj);
            if !o.status.success() {
                return Err(build(String::from_utf8_lossy(&o.stderr).lines().take(20).collect::<Vec<_>>().join("\n")));
            }
            std::fs::rename(&tmp, &lib).map_err(|e| other(format!("cannot write {}: {e}", lib.display())))?;
        }
        let path = lib.to_string_lossy().into_owned();
        let mut m = vec![7u8];
        m.extend((path.len() as u32).to_le_bytes());
        m.extend(path.as_bytes());
        self.send(&m)?;
        self.reply("load transfer")?.map_err(build)?;
        let id = self.read_u32("load transfer")?;
        self.transfers.insert(key, id);
        Ok(id)
    }
}

impl Device for EmuDevice {
    fn alloc(&mut self, bytes: u64) -> Result<BufferId, DeviceError> {
        self.outside_capture("an allocation")?;
        let mut m = vec![1u8];
        m.extend(bytes.to_le_bytes());
        self.send(&m)?;
        self.reply("alloc")?.map_err(other)?;
        let id = self.read_u32("alloc")?;
        if id as usize != self.sizes.len() {
            return Err(other(format!("the device numbered buffer {} as {id}", self.sizes.len())));
        }
        self.sizes.push(bytes);
        Ok(BufferId(id))
    }

    fn upload(&mut self, buffer: BufferId, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.outside_capture("an upload")?;
        self.run_upload(buffer, offset, data)
    }

    fn fill(&mut self, buffer: BufferId, offset: u64, len: u64, byte: u8) -> Result<(), DeviceError> {
        match self.capture.as_mut() {
            Some(calls) => {
                calls.push(Call::Fill { buffer, offset, len, byte });
                Ok(())
            }
            None => self.run(&Call::Fill { buffer, offset, len, byte }),
        }
    }

    fn download(&mut self, buffer: BufferId, offset: u64, len: u64) -> Result<Vec<u8>, DeviceError> {
        self.outside_capture("a download")?;
        let mut m = vec![3u8];
        m.extend(buffer.0.to_le_bytes());
        m.extend(offset.to_le_bytes());
        m.extend(len.to_le_bytes());
        self.send(&m)?;
        self.reply("download")?.map_err(other)?;
        self.read_n(len as usize, "download")
    }

    fn transfer(&mut self, code: &Code, batches: &[Batch], buffers: &[BufferId]) -> Result<(), DeviceError> {
        if self.capture.is_some() {
            // Checked as it is recorded, as a GPU checks a captured node's
            // arguments when the graph is built.
            if let Err(e) = self.check_transfer(code, batches, buffers) {
                self.capture = None;
                return Err(e);
            }
            let call = Call::Transfer { code: code.clone(), batches: batches.to_vec(), buffers: buffers.to_vec() };
            self.capture.get_or_insert_with(Vec::new).push(call);
            return Ok(());
        }
        self.queue_transfer(code, batches, buffers, false).map(|_| ())
    }

    fn side_transfer(
        &mut self,
        code: &Code,
        batches: &[Batch],
        buffers: &[BufferId],
    ) -> Result<SideEvent, DeviceError> {
        self.outside_capture("a side-stream transfer")?;
        let event = self.queue_transfer(code, batches, buffers, true)?;
        self.side_last = self.side_last.max(event);
        Ok(event)
    }

    fn side_wait(&mut self, event: SideEvent) -> Result<u64, DeviceError> {
        self.outside_capture("a side-stream wait")?;
        self.wait_event(event)
    }

    fn side_mark(&mut self, key: u32) -> Result<(), DeviceError> {
        self.outside_capture("a side-stream mark")?;
        if self.side_last.0 > 0 {
            self.marks.insert(key, self.side_last);
        }
        Ok(())
    }

    /// The device process runs the main stream's calls one at a time, so
    /// the main stream's wait is the process's: it blocks there until the
    /// mark's transfer finished (the host waits for the reply, as it does
    /// for every call).
    fn side_join(&mut self, key: u32) -> Result<(), DeviceError> {
        match self.capture.as_mut() {
            Some(calls) => {
                calls.push(Call::Join { key });
                Ok(())
            }
            None => self.run(&Call::Join { key }),
        }
    }

    /// Always from the source, built for the host (a cubin is GPU code).
    fn load(&mut self, name: &str, source: &str, _cubin: Option<&[u8]>) -> Result<ModuleId, DeviceError> {
        self.outside_capture("a module load")?;
        let lib = self.build(name, source)?;
        let path = lib.to_string_lossy().into_owned();
        let mut m = vec![4u8];
        m.extend((path.len() as u32).to_le_bytes());
        m.extend(path.as_bytes());
        self.send(&m)?;
        self.reply("load")?.map_err(|message| DeviceError::Build {
            kernel: name.into(),
            device: "emulated device",
            message,
        })?;
        let id = self.read_u32("load")?;
        self.modules.push(name.into());
        Ok(ModuleId(id))
    }

    fn captures(&self) -> bool {
        true
    }

    fn begin_capture(&mut self) -> Result<(), DeviceError> {
        if self.capture.is_some() {
            self.capture = None;
            return Err(other("a graph recording began inside another (both dropped)"));
        }
        self.capture = Some(Vec::new());
        Ok(())
    }

    fn end_capture(&mut self) -> Result<GraphId, DeviceError> {
        let calls = self.capture.take().ok_or_else(|| other("no graph is being recorded"))?;
        let id = u32::try_from(self.graphs.len()).map_err(|_| other("too many graphs"))?;
        self.graphs.push(calls);
        Ok(GraphId(id))
    }

    fn replay(&mut self, graph: GraphId) -> Result<(), DeviceError> {
        self.outside_capture("a graph replay")?;
        let calls = std::mem::take(
            self.graphs.get_mut(graph.0 as usize).ok_or_else(|| other(format!("no graph {}", graph.0)))?,
        );
        let ran = calls.iter().try_for_each(|c| self.run(c));
        self.graphs[graph.0 as usize] = calls;
        ran
    }

    fn launch(
        &mut self,
        module: ModuleId,
        entry: &str,
        grid: u32,
        block: u32,
        args: &[KernelArg],
    ) -> Result<(), DeviceError> {
        match self.capture.as_mut() {
            Some(calls) => {
                calls.push(Call::Launch { module, entry: entry.to_string(), grid, block, args: args.to_vec() });
                Ok(())
            }
            None => self.run_launch(module, entry, grid, block, args),
        }
    }
}

impl Drop for EmuDevice {
    fn drop(&mut self) {
        let _ = self.tx.write_all(&[0]);
        let _ = self.tx.flush();
        let _ = self.child.wait();
    }
}
