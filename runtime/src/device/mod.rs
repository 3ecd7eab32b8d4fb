//! The `Device` interface: what a backend needs from a GPU (or an emulation
//! of one) to run a bundle's programs: device memory, uploads and readbacks
//! at offsets, kernel modules, and launches with `cuLaunchKernel`'s
//! argument convention. [`bind`] turns a program op's plan arguments into a
//! launch on any `Device`; [`emu`] is the emulated device.
//!
//! Data movement between buffers (the weight reshard, the dispatch's token
//! rows, the combine's and the all-reduce's sums) is a transfer program ([`moeforge_xfer`]): one LLVM IR that each
//! device compiles for itself.
//!
//! Every call behaves as if the work before it finished: a device may
//! return from a launch, an upload or a transfer once it is queued (the
//! cuda device does, but for an APK launch of arguments it has not seen
//! before; the emulated device runs each to completion), but every later
//! call sees its effects (and a fault in queued work is reported by a later
//! call, at the latest the next download), so issuing a program's ops in program order is a
//! legal execution of its streams and events. One stream of its own
//! exists beside them: the side stream ([`Device::side_transfer`]), on
//! which Zepp's slot swaps run while the next step's launches go on. The
//! host waits for its [`SideEvent`]s ([`Device::side_wait`]) before it
//! reads or writes what they move; a step's own work waits on the device
//! ([`Device::side_join`] on a layer's [`Device::side_mark`]), just before
//! the work that reads it, which a graph records too.
//! The program's own streams and events do not reach this interface yet.
//!
//! A device may record graphs ([`Device::captures`]): between
//! [`Device::begin_capture`] and [`Device::end_capture`] its launches,
//! transfers and fills are recorded, not run, and [`Device::replay`] runs
//! them again with the arguments they were recorded with over what the
//! buffers hold then (a CUDA graph). The executor records decode steps this
//! way, per (mode, batch bucket) ([`exec::Executor::use_graphs`]).

pub mod bind;
pub mod emu;
pub mod exec;

pub use moeforge_xfer::{Batch, Code, Elem, Gate, GatedCopy, Program, StridedCopy, Sum, SumGate, Transfer};

/// Device memory: one allocation (a rank's unified buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferId(pub u32);

/// A loaded kernel instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModuleId(pub u32);

/// A recorded graph of device work ([`Device::begin_capture`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct GraphId(pub u32);

/// A side-stream transfer's completion: its place in the side stream's
/// queue (transfers there finish in the order they were queued).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SideEvent(pub u64);

/// One argument value of a launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelArg {
    /// `offset` bytes into a buffer.
    Ptr {
        buffer: BufferId,
        offset: u64,
    },
    Null,
    I32(i32),
    I64(i64),
    F32(f32),
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A kernel instance's source does not build for this device.
    #[error("kernel `{kernel}` does not build for the {device}: {message}")]
    Build { kernel: String, device: &'static str, message: String },
    /// A launch failed or the device stopped while running it.
    #[error("launch of `{entry}` failed: {message}")]
    Launch { entry: String, message: String },
    #[error("{0}")]
    Other(String),
}

pub trait Device {
    /// Allocates `bytes` of zeroed device memory.
    fn alloc(&mut self, bytes: u64) -> Result<BufferId, DeviceError>;
    /// Copies `data` into `buffer` at `offset`. It may return before the
    /// bytes landed (`data` is free to go at once); every later download,
    /// launch, transfer or side transfer sees them.
    fn upload(&mut self, buffer: BufferId, offset: u64, data: &[u8]) -> Result<(), DeviceError>;
    /// Sets `len` bytes of `buffer` at `offset` to `byte`, on the device: no
    /// host data travels, so a step that fills mid-way still takes its
    /// inputs before its first launch (the cuda device queues a memset; a
    /// device without one uploads the bytes, this default).
    fn fill(&mut self, buffer: BufferId, offset: u64, len: u64, byte: u8) -> Result<(), DeviceError> {
        let len = usize::try_from(len).map_err(|_| DeviceError::Other(format!("a fill of {len} bytes")))?;
        self.upload(buffer, offset, &vec![byte; len])
    }
    fn download(&mut self, buffer: BufferId, offset: u64, len: u64) -> Result<Vec<u8>, DeviceError>;
    /// Runs a compiled transfer program's batches in order (each batch's
    /// pieces in parallel where the device can): buffer i of a batch is
    /// `buffers[i]`. The device loads its form of the program's one IR (the
    /// PTX on a GPU, host code built from the IR on the emulated device),
    /// once per program, and checks every batch against the buffers' sizes
    /// before anything runs.
    fn transfer(&mut self, code: &Code, batches: &[Batch], buffers: &[BufferId]) -> Result<(), DeviceError>;
    /// Queues a transfer on the side stream, behind the side stream's
    /// earlier transfers and beside the launches and transfers that follow,
    /// and returns its event. Nothing may touch the bytes it reads or
    /// writes before [`Device::side_wait`] on that event returned, or be
    /// issued before a [`Device::side_join`] on a mark made after it. A device
    /// without a side stream runs it at once (this default), which is a
    /// legal schedule of the same program.
    fn side_transfer(
        &mut self,
        code: &Code,
        batches: &[Batch],
        buffers: &[BufferId],
    ) -> Result<SideEvent, DeviceError> {
        self.transfer(code, batches, buffers)?;
        Ok(SideEvent(0))
    }
    /// Blocks until side transfer `event`, and every one queued before it,
    /// finished. Returns how many main-stream launches and transfers this
    /// device has run so far while side work was queued and not finished
    /// (the cuda device counts a queued launch when it is issued): its
    /// measure of the overlap, 0 for a device that runs side transfers at once.
    fn side_wait(&mut self, event: SideEvent) -> Result<u64, DeviceError> {
        let _ = event;
        Ok(0)
    }
    /// Marks the side work queued so far as `key`'s (the executor's keys
    /// are model layers, whose slot swaps the mark covers), in place of the
    /// key's earlier mark: what [`Device::side_join`] on `key` waits for. A
    /// device that runs side transfers at once has nothing to mark (this
    /// default); a device that wraps another and passes its side transfers
    /// on must pass its marks and joins on too, or the step's waits are lost.
    fn side_mark(&mut self, key: u32) -> Result<(), DeviceError> {
        let _ = key;
        Ok(())
    }
    /// Makes the work issued after it wait, on the device, for the side work
    /// marked as `key`'s, without blocking the host (a stream's wait on an
    /// event); nothing marked, nothing to wait for. Inside a recording it is
    /// recorded, and each replay waits for the key's mark as it stands when
    /// the replay is issued (a CUDA graph's external event-wait node): a
    /// graph recorded before a swap waits for it when replayed after.
    fn side_join(&mut self, key: u32) -> Result<(), DeviceError> {
        let _ = key;
        Ok(())
    }
    /// Loads kernel instance `name`: `cubin` is the bundle's build of its
    /// `source` for the plan's architecture (when the compile ran nvcc),
    /// which a device that runs that architecture loads as it is; otherwise
    /// the device builds the source itself (or finds it in its cache).
    fn load(&mut self, name: &str, source: &str, cubin: Option<&[u8]>) -> Result<ModuleId, DeviceError>;
    /// What the device is, for a run's report: its GPUs and where each
    /// rank's buffer lives, where its kernels came from (`None`: nothing to
    /// add to the backend's name).
    fn describe(&self) -> Option<String> {
        None
    }
    /// Whether this device records graphs ([`Device::begin_capture`]). A
    /// device without them runs every step's calls as they come (this
    /// default).
    fn captures(&self) -> bool {
        false
    }
    /// Starts recording a graph (a CUDA graph's stream capture): the
    /// launches, transfers, fills and side joins issued until
    /// [`Device::end_capture`] are recorded in order and not run. A recording
    /// holds a step's device work, not the host's calls around it: any other
    /// call before the end (an upload, a download, a load, a side-stream
    /// transfer, wait or mark) is
    /// an error that ends the recording, and so is a recorded call that
    /// fails (the graph would lack it).
    fn begin_capture(&mut self) -> Result<(), DeviceError> {
        Err(DeviceError::Other("this device records no graphs".into()))
    }
    /// Ends the recording and keeps it: [`Device::replay`] runs it.
    fn end_capture(&mut self) -> Result<GraphId, DeviceError> {
        Err(DeviceError::Other("this device records no graphs".into()))
    }
    /// Runs a recorded graph's calls in their order, with the arguments
    /// they were recorded with, over what the buffers hold now.
    fn replay(&mut self, graph: GraphId) -> Result<(), DeviceError> {
        Err(DeviceError::Other(format!("this device records no graphs (graph {})", graph.0)))
    }
    /// Runs `entry` of `module` over `grid` blocks of `block` threads.
    fn launch(
        &mut self,
        module: ModuleId,
        entry: &str,
        grid: u32,
        block: u32,
        args: &[KernelArg],
    ) -> Result<(), DeviceError>;
}
