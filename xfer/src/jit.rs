//! Running a program in this process: the host flavor of its IR compiled by
//! LLVM's JIT (MCJIT) and called on [`HostBuffer`]s. What the differential
//! tests run against the plan's descriptor interpreter (the CPU twin's
//! `execute_reshard`); the emulated device runs the same code as a shared
//! library in its own process ([`crate::host_object`]).

use crate::lower::{host_machine, module, optimize, Flavor};
use crate::{Batch, Program, XferError, ENTRY};
use inkwell::context::Context;
use inkwell::OptimizationLevel;

/// Host memory aligned like device memory (16 bytes, the widest piece).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostBuffer {
    words: Vec<u128>,
    len: usize,
}

impl HostBuffer {
    pub fn zeroed(len: usize) -> HostBuffer {
        HostBuffer { words: vec![0; len.div_ceil(16)], len }
    }

    pub fn from_bytes(bytes: &[u8]) -> HostBuffer {
        let mut b = HostBuffer::zeroed(bytes.len());
        b.as_bytes_mut().copy_from_slice(bytes);
        b
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialized bytes (u128 has no
        // padding), the slice borrows `self`.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`; every byte pattern is a valid u128, and
        // the slice borrows `self` mutably.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }
}

type Entry = unsafe extern "C" fn(*const *mut u8, *const u64, u64, u64);

/// Compiles `program` (its host IR, LLVM's O3 pipeline, MCJIT) and runs
/// `batches` in order on `buffers` (buffer i of a batch is `buffers[i]`).
/// Every batch is checked against the buffers before anything runs.
pub fn run(program: &Program, batches: &[Batch], buffers: &mut [HostBuffer]) -> Result<(), XferError> {
    let sizes: Vec<u64> = buffers.iter().map(|b| b.len() as u64).collect();
    for b in batches {
        b.check(program, &sizes)?;
    }
    let llvm = |e: String| XferError::Llvm(e);
    let ctx = Context::create();
    let tm = host_machine()?;
    let m = module(&ctx, program, Flavor::Host)?;
    optimize(&m, &tm)?;
    let engine = m.create_jit_execution_engine(OptimizationLevel::None).map_err(|e| llvm(e.to_string()))?;
    // SAFETY: the module defines ENTRY with exactly this signature (lower::module, Flavor::Host).
    let f = unsafe { engine.get_function::<Entry>(ENTRY) }.map_err(|e| llvm(e.to_string()))?;
    let bases: Vec<*mut u8> = buffers.iter_mut().map(|b| b.words.as_mut_ptr().cast::<u8>()).collect();
    for b in batches {
        let words = b.words();
        // SAFETY: `words` is the table this program's code reads (its counts
        // match the program's shapes), every instance's runs lie inside the
        // 16-byte-aligned buffers `bases` points to and its offsets are
        // multiples of its piece (`Batch::check`, above); the buffers are
        // borrowed mutably for the whole call, and one worker runs the
        // pieces in order.
        unsafe { f.call(bases.as_ptr(), words.as_ptr(), 0, 1) };
    }
    Ok(())
}
