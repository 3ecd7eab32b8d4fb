//! Binds a program op's plan arguments to a launch: every `Arg` of
//! `plan.json` resolved to a value at this rank, layer and step — a
//! buffer's address (its micro-batch's slice), a weight view's layer, the
//! KV pool, a count, a per-rank value — in the entry's parameter order, and
//! the launch grid from the op's (or its entry's) grid over the step's
//! counts. The same binding serves every [`Device`].

use super::{BufferId, Device, DeviceError, KernelArg, ModuleId};
use moeforge_plan::memory::{BufferName, MemoryPlan, Mode};
use moeforge_plan::program::{Arg, KernelRef, Op, Operand};
use moeforge_plan::{EntryPoint, Grid, GridVar, KernelInstance};
use std::collections::BTreeMap;

/// The step's run-time counts on one rank (of one micro-batch).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub tokens: u32,
    pub entries: u32,
    pub local_experts: u32,
    pub sampled_rows: u32,
    pub received: u32,
    pub received_entries: u32,
    pub kv_moves: u32,
}

impl Counts {
    pub fn of(&self, v: GridVar) -> u32 {
        match v {
            GridVar::Tokens => self.tokens,
            GridVar::Entries => self.entries,
            GridVar::LocalExperts => self.local_experts,
            GridVar::SampledRows => self.sampled_rows,
            GridVar::Received => self.received,
            GridVar::ReceivedEntries => self.received_entries,
            GridVar::KvMoves => self.kv_moves,
        }
    }
}

/// Where an op runs: the memory plan of its program's mode, the rank, the
/// layer its body is issued for, and the rank's unified buffer.
#[derive(Clone, Copy, Debug)]
pub struct Site<'a> {
    pub mem: &'a MemoryPlan,
    pub mode: Mode,
    pub micro_batches: u32,
    pub rank: u32,
    pub layer: u32,
    pub buffer: BufferId,
}

#[derive(Debug, thiserror::Error)]
#[error("op `{op}`: {message}")]
pub struct BindError {
    pub op: String,
    pub message: String,
}

/// The byte offset of buffer `name` (micro-batch `mb`'s slice) in the
/// rank's unified buffer.
pub fn buffer_address(site: &Site<'_>, mb: Option<u32>, name: BufferName) -> Option<u64> {
    let b = site.mem.buffer(site.mode, name)?;
    let slice = mb.map_or(0, |m| u64::from(m) * b.slice_bytes(site.micro_batches));
    Some(b.offset + slice)
}

/// The byte offset of `operand` in the rank's unified buffer.
pub fn address(site: &Site<'_>, op: &Op, operand: &Operand) -> Option<u64> {
    match *operand {
        Operand::Buffer { name } => buffer_address(site, op.micro_batch, name),
        Operand::Weight { role, part } => {
            let v = site.mem.view(site.mode, role, part)?;
            Some(if role.per_layer() { v.offset_of(site.layer) } else { v.offset })
        }
        Operand::Kv => site.mem.regions.get(site.mem.kv.region.index()).map(|r| r.offset),
    }
}

/// The launch arguments of `op` (an entry with parameters `params`).
pub fn args(site: &Site<'_>, op: &Op, params: &[String], counts: &Counts) -> Result<Vec<KernelArg>, BindError> {
    let bad = |message: String| BindError { op: op.name.clone(), message };
    if op.args.len() != params.len() {
        return Err(bad(format!("{} arguments for {} parameters", op.args.len(), params.len())));
    }
    let wide = |p: &str| p.starts_with("long long ") || p.starts_with("int64_t ");
    let int = |p: &str, v: i64| -> Result<KernelArg, BindError> {
        if wide(p) {
            Ok(KernelArg::I64(v))
        } else {
            i32::try_from(v).map(KernelArg::I32).map_err(|_| bad(format!("`{p}` = {v} is out of range")))
        }
    };
    op.args
        .iter()
        .zip(params)
        .map(|(a, p)| match a {
            Arg::Ptr { operand, at } => {
                let base =
                    address(site, op, operand).ok_or_else(|| bad(format!("no {operand:?} in the memory plan")))?;
                Ok(KernelArg::Ptr { buffer: site.buffer, offset: base + at })
            }
            Arg::Null => Ok(KernelArg::Null),
            Arg::Count { var } => int(p, i64::from(counts.of(*var))),
            Arg::Int { value } => int(p, *value),
            Arg::Float { value } => Ok(KernelArg::F32(*value)),
            Arg::Layer => int(p, i64::from(site.layer)),
            Arg::PerRank { values } => {
                let v =
                    values.get(site.rank as usize).ok_or_else(|| bad(format!("no value for rank {}", site.rank)))?;
                int(p, *v)
            }
        })
        .collect()
}

/// Blocks of `op`'s launch: its own grid, else its entry's.
pub fn blocks(op: &Op, entry: &EntryPoint, counts: &Counts) -> Result<u32, BindError> {
    match op.grid.unwrap_or(entry.grid) {
        Grid::Fixed { blocks } => Ok(blocks),
        Grid::Per { over, per } => Ok(counts.of(over).div_ceil(per.max(1))),
        Grid::Tiles { over, per, times } => Ok(counts.of(over).div_ceil(per.max(1)) * times),
        g => Err(BindError { op: op.name.clone(), message: format!("a {g} grid is the APK's launch, not a flat one") }),
    }
}

/// Launches `op` on `device`: its entry from `modules` (instance name →
/// loaded module) with its bound arguments. Launches with no blocks (no
/// rows this step) are skipped, as a GPU runtime skips them.
pub fn launch(
    device: &mut dyn Device,
    kernels: &[KernelInstance],
    modules: &BTreeMap<String, ModuleId>,
    site: &Site<'_>,
    op: &Op,
    counts: &Counts,
) -> Result<(), DeviceError> {
    let bind = |e: BindError| DeviceError::Launch { entry: op.name.clone(), message: e.message };
    let KernelRef::Launch { instance, entry } = &op.kernel else {
        return Err(DeviceError::Launch {
            entry: op.name.clone(),
            message: format!("{:?} is not a launch", op.kernel),
        });
    };
    let ep = kernels
        .iter()
        .find(|k| &k.name == instance)
        .and_then(|k| k.entries.iter().find(|e| &e.symbol == entry))
        .ok_or_else(|| DeviceError::Launch {
        entry: entry.clone(),
        message: format!("no entry in `{instance}`"),
    })?;
    let module = *modules
        .get(instance)
        .ok_or_else(|| DeviceError::Launch { entry: entry.clone(), message: format!("`{instance}` is not loaded") })?;
    let a = args(site, op, &ep.params, counts).map_err(bind)?;
    let grid = blocks(op, ep, counts).map_err(bind)?;
    if grid == 0 {
        return Ok(());
    }
    device.launch(module, entry, grid, ep.block, &a)
}
