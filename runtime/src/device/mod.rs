//! The `Device` interface: what a backend needs from a GPU (or an emulation
//! of one) to run a bundle's programs: device memory, uploads and readbacks
//! at offsets, kernel modules, and launches with `cuLaunchKernel`'s
//! argument convention. [`bind`] turns a program op's plan arguments into a
//! launch on any `Device`; [`emu`] is the emulated device.
//!
//! A launch here runs to completion before the call returns (the emulated
//! device's semantics), so issuing a program's ops in program order is a
//! legal execution of its streams and events. Streams, events and peer
//! addresses join this interface with the CUDA device (the cuda-backend
//! issue), where launches are asynchronous.

pub mod bind;
pub mod emu;
pub mod exec;

/// Device memory: one allocation (a rank's unified buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferId(pub u32);

/// A loaded kernel instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModuleId(pub u32);

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

/// A strided copy of device memory: `counts[0] × counts[1]` runs of
/// `run_bytes`, run (a, b) read at `src_offset + a·src_strides[0] +
/// b·src_strides[1]` and written at the same offsets with the destination's
/// strides, in that order, each run as a memmove. The shape of the plan's
/// reshard descriptors, and of cuMemcpy3DPeer between two GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StridedCopy {
    pub src_offset: u64,
    pub dst_offset: u64,
    pub run_bytes: u64,
    pub counts: [u64; 2],
    pub src_strides: [u64; 2],
    pub dst_strides: [u64; 2],
}

pub trait Device {
    /// Allocates `bytes` of zeroed device memory.
    fn alloc(&mut self, bytes: u64) -> Result<BufferId, DeviceError>;
    fn upload(&mut self, buffer: BufferId, offset: u64, data: &[u8]) -> Result<(), DeviceError>;
    fn download(&mut self, buffer: BufferId, offset: u64, len: u64) -> Result<Vec<u8>, DeviceError>;
    /// Copies between (or within) two buffers on the device; runs in order.
    fn copy(&mut self, src: BufferId, dst: BufferId, c: &StridedCopy) -> Result<(), DeviceError>;
    /// Builds (or finds in its cache) and loads kernel instance `name` from its source.
    fn load(&mut self, name: &str, source: &str) -> Result<ModuleId, DeviceError>;
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
