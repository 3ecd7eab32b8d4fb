//! Transfer programs: the data movement of a bundle (the TP↔EP weight
//! reshard's direct-transfer descriptors, Moebius §3.1/§4.3, and the EP
//! dispatch's token rows, ExpertPlex §5) compiled once to LLVM IR and
//! emitted from that one IR as PTX for the GPU ([`ptx`], loaded by the cuda
//! device through the driver's JIT) and as native code for the host
//! ([`host_object`], loaded by the emulated device; [`jit`] runs it in this
//! process). One implementation of the transfers on every device.
//!
//! A program separates code from data:
//! - its **code** is one loop nest per distinct [`Shape`] (run length,
//!   counts, strides and the widest piece every address allows), all of them
//!   constants in the IR, so the index arithmetic is divisions by constants
//!   that LLVM strength-reduces;
//! - its **data** is a [`Batch`]: which buffers and offsets each instance of
//!   a shape reads and writes, a table of 64-bit words the code walks.
//!
//! A program's loops are of four kinds: a [`Shape`] copies strided runs of
//! bytes, a [`GatedShape`] copies a run only when one of a few i32 ids it
//! reads on the device lies in a range (a dispatch's token row to a rank
//! holding one of its experts: [`GatedCopy`]), a [`SumShape`] sums rows of bf16 or f32 elements from several
//! buffers into one f32 row, in source order from +0.0 (what the combine's
//! gather and the all-reduce compute: the same additions in the same order
//! on every device, so every device gives the same bits; a gated sum reads
//! a source only when one of the token's ids lies in its range, [`SumGate`],
//! and skips the others, which adds what a +0.0 row would), and an exchange
//! shape trades two runs of bytes in place ([`Exchange`]: Zepp's swap of
//! two expert slots' contents), each worker loading a piece of both sides
//! before it stores either, so no staging buffer is needed.
//!
//! The reshard's layers are one program (a layer's descriptors are the same
//! shapes at other slot offsets) and one batch per layer; a dispatch is one
//! program per row width and one batch per step; a combine or an all-reduce
//! is one program and one or two batches per op. Within a batch every piece
//! may run in parallel (the GPU's threads take consecutive pieces, so a warp
//! copies contiguous bytes); batches run in order. So a batch's destination
//! runs must not overlap each other or its source runs: the plan's reshard
//! moves between distinct slots and its descriptors write each byte once
//! (the validator recomputes them from the spec), a dispatch writes each
//! received row once. A sum's destination may alias one of its own sources
//! (an in-place all-reduce: each element is read, then written, by one
//! worker), never another instance's. An exchange's two sides must not
//! overlap each other or another exchange of its batch
//! ([`Program::exchange_batch`] refuses that). [`Batch::check`] enforces
//! what memory safety needs: every run inside its buffer, every offset a
//! multiple of its piece.

#[cfg(feature = "llvm")]
mod lower;

#[cfg(feature = "llvm")]
pub mod jit;

#[cfg(feature = "llvm")]
pub use lower::{host_ir, host_object, ptx};

/// The entry point's symbol on every target.
pub const ENTRY: &str = "moeforge_xfer";

/// A compiled program as a bundle holds it: its PTX for the GPU and its
/// host-flavored IR (what the emulated device compiles with LLVM's `llc`),
/// each headed by [`header`] naming the program's key. Devices run this;
/// the runtime recomputes the program from the plan and refuses code whose
/// key differs ([`Code::new`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Code {
    pub program: Program,
    pub ptx: String,
    pub host_ir: String,
}

/// The first line of a compiled program's PTX (`comment` = `//`) or IR (`;`).
pub fn header(comment: &str, program: &Program) -> String {
    format!("{comment} moeforge transfer program {}\n", program.key())
}

impl Code {
    /// Pairs `program` with its compiled text, checking that both were
    /// compiled from it.
    pub fn new(program: Program, ptx: String, host_ir: String) -> Result<Code, String> {
        for (text, comment, what) in [(&ptx, "//", "PTX"), (&host_ir, ";", "IR")] {
            let first = text.lines().next().unwrap_or("");
            if format!("{first}\n") != header(comment, &program) {
                return Err(format!(
                    "its {what} was compiled for another transfer program (`{first}`; this plan's key is {})",
                    program.key()
                ));
            }
        }
        Ok(Code { program, ptx, host_ir })
    }
}

use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error)]
pub enum XferError {
    /// A copy this program form cannot express.
    #[error("transfer {index}: {message}")]
    Copy { index: usize, message: String },
    /// A sum this program's code cannot run.
    #[error("sum {index}: {message}")]
    Sum { index: usize, message: String },
    /// An exchange this program's code cannot run, or one that overlaps another.
    #[error("exchange {index}: {message}")]
    Exchange { index: usize, message: String },
    /// A batch that does not fit the buffers it was given.
    #[error("transfer batch: {0}")]
    Bounds(String),
    /// LLVM refused the module or a target (a bug, or an LLVM without the NVPTX target).
    #[error("LLVM: {0}")]
    Llvm(String),
}

/// A strided copy: `counts[0] × counts[1]` runs of `run_bytes`, run (a, b)
/// read at `src_offset + a·src_strides[0] + b·src_strides[1]` and written at
/// the same offsets with the destination's strides. The shape of the plan's
/// reshard descriptors, and of cuMemcpy3DPeer between two GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StridedCopy {
    pub src_offset: u64,
    pub dst_offset: u64,
    pub run_bytes: u64,
    pub counts: [u64; 2],
    pub src_strides: [u64; 2],
    pub dst_strides: [u64; 2],
}

impl StridedCopy {
    /// One run of `run_bytes` (a token row of the dispatch).
    pub fn one_run(src_offset: u64, dst_offset: u64, run_bytes: u64) -> StridedCopy {
        StridedCopy { src_offset, dst_offset, run_bytes, counts: [1, 1], src_strides: [0, 0], dst_strides: [0, 0] }
    }
}

/// One copy of a batch: from buffer `src` to buffer `dst` (indices into the
/// buffers the batch runs on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    pub src: u32,
    pub dst: u32,
    pub copy: StridedCopy,
}

/// The constants of one loop nest: a strided copy without its addresses,
/// moved in `piece`-byte loads and stores (16, 8, 4, 2 or 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shape {
    pub run_bytes: u64,
    pub counts: [u64; 2],
    pub src_strides: [u64; 2],
    pub dst_strides: [u64; 2],
    pub piece: u64,
}

impl Shape {
    /// Pieces of one instance (`build` checks that this does not overflow).
    pub fn pieces(&self) -> u64 {
        self.counts[0] * self.counts[1] * (self.run_bytes / self.piece)
    }
    /// The end of an instance's last run on each side, relative to its offsets.
    fn extents(&self) -> Option<(u64, u64)> {
        let end = |s: [u64; 2]| {
            let a = (self.counts[0] - 1).checked_mul(s[0])?;
            let b = (self.counts[1] - 1).checked_mul(s[1])?;
            a.checked_add(b)?.checked_add(self.run_bytes)
        };
        Some((end(self.src_strides)?, end(self.dst_strides)?))
    }
    /// Whether the destination runs are disjoint: laid out along one axis
    /// with strides of at least a run, rows of them at least a row apart.
    /// Sufficient, not necessary.
    fn runs_disjoint(&self) -> bool {
        let disjoint = |inner: usize| {
            let outer = 1 - inner;
            let (n_in, s_in, n_out, s_out) =
                (self.counts[inner], self.dst_strides[inner], self.counts[outer], self.dst_strides[outer]);
            (n_in == 1 || s_in >= self.run_bytes)
                && (n_out == 1 || s_out >= (n_in - 1).saturating_mul(s_in).saturating_add(self.run_bytes))
        };
        disjoint(1) || disjoint(0)
    }
}

/// Where one instance of a shape reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Instance {
    pub src: u32,
    pub dst: u32,
    pub src_offset: u64,
    pub dst_offset: u64,
}

/// The element type a sum reads; its destination is always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Elem {
    /// bfloat16: the upper half of an f32, widened exactly.
    Bf16,
    F32,
}

impl Elem {
    pub fn bytes(self) -> u64 {
        match self {
            Elem::Bf16 => 2,
            Elem::F32 => 4,
        }
    }
}

/// The constants of one reduction loop: `sources` rows of `elems` elements
/// of `elem`, summed element by element in f32, starting from +0.0 and
/// adding the sources in order, into a row of `elems` elements of `out`
/// (f32, or bf16 rounded to nearest, ties to even; no source: the row
/// becomes +0.0). One worker per destination element. With `gate` ids (0:
/// none), each source is read and added only when one of the instance's
/// `gate` i32 ids lies in the source's range ([`SumGate`]); a skipped
/// source adds nothing, which is what adding a +0.0 row does (the sum
/// starts at +0.0 and IEEE addition never makes it -0.0 from there).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SumShape {
    pub elems: u64,
    pub sources: u32,
    pub elem: Elem,
    pub out: Elem,
    pub gate: u32,
}

impl SumShape {
    /// Words of one instance in a batch's table: `[dst, dst_offset]`, then
    /// `[src, src_offset]` per source; gated, `[dst, dst_offset, gate
    /// buffer, gate offset]`, then `[src, src_offset, lo, hi]` per source.
    pub fn words(&self) -> usize {
        match self.gate {
            0 => 2 + 2 * self.sources as usize,
            _ => 4 + 4 * self.sources as usize,
        }
    }
}

/// What decides which sources of a gated sum are read: the `ids` i32 ids
/// at `offset` of buffer `buf` (the token's top-k expert ids, on the rank
/// the sum writes), and per source the experts `[lo, hi)` its rank holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SumGate {
    pub buf: u32,
    pub offset: u64,
    pub ids: u32,
    pub ranges: Vec<(i32, i32)>,
}

/// One reduction made at run time: the row of `out` elements at
/// `dst_offset` of buffer `dst` becomes the in-order sum of the rows of
/// `elem` elements at `sources` (buffer, offset), each read only where
/// `gate` (when set) passes for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sum {
    pub dst: u32,
    pub dst_offset: u64,
    pub sources: Vec<(u32, u64)>,
    pub elems: u64,
    pub elem: Elem,
    pub out: Elem,
    pub gate: Option<SumGate>,
}

/// Where one instance of a [`SumShape`] reads and writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SumInstance {
    pub dst: u32,
    pub dst_offset: u64,
    pub sources: Vec<(u32, u64)>,
    pub gate: Option<SumGate>,
}

/// An exchange made at run time: the `bytes` at `a_offset` of buffer `a`
/// and the `bytes` at `b_offset` of buffer `b` trade places. Its shape is a
/// contiguous [`Shape`] of `bytes` (one run; an instance's `src` is `a`,
/// its `dst` is `b`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exchange {
    pub a: u32,
    pub a_offset: u64,
    pub b: u32,
    pub b_offset: u64,
    pub bytes: u64,
}

/// What decides whether a gated copy runs: the `ids` i32 ids at `offset`
/// of buffer `buf` (a token's top-k expert ids); the copy runs when one of
/// them lies in `[lo, hi)` (the experts its destination holds). Read on the
/// device, so the host need not know the ids to lay out the copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gate {
    pub buf: u32,
    pub offset: u64,
    pub lo: i32,
    pub hi: i32,
}

/// A one-run copy that runs only when its gate passes (a dispatch's token
/// row to a rank that computes one of its entries).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatedCopy {
    pub transfer: Transfer,
    pub gate: Gate,
}

/// The constants of a gated copy's loop: a run of `run_bytes` in `piece`s,
/// gated on `ids` ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GatedShape {
    pub run_bytes: u64,
    pub piece: u64,
    pub ids: u32,
}

/// Words of one gated instance in a batch's table: an instance's four,
/// then `[gate buffer, gate offset, lo, hi]`.
pub const GATED_WORDS: usize = 8;

/// A program's code: its copy shapes, its sum shapes, its exchange shapes,
/// then its gated copy shapes, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Program {
    shapes: Vec<Shape>,
    sums: Vec<SumShape>,
    swaps: Vec<Shape>,
    gated: Vec<GatedShape>,
}

/// A program's data for one run: the instances of each of its shapes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    per_shape: Vec<Vec<Instance>>,
    per_sum: Vec<Vec<SumInstance>>,
    per_swap: Vec<Vec<Instance>>,
    per_gated: Vec<Vec<(Instance, Gate)>>,
}

/// Refuses one-run copies of one batch that race: two destinations that
/// overlap, or a destination that overlaps a source (a copy onto itself,
/// same bytes, excepted).
fn races(transfers: &[Transfer]) -> Result<(), XferError> {
    let span = |buf: u32, off: u64, bytes: u64, i: usize| (buf, off, off.saturating_add(bytes), i);
    let rows = transfers.iter().enumerate().filter(|(_, t)| t.copy.counts == [1, 1] && t.copy.run_bytes > 0);
    let mut writes: Vec<(u32, u64, u64, usize)> =
        rows.clone().map(|(i, t)| span(t.dst, t.copy.dst_offset, t.copy.run_bytes, i)).collect();
    writes.sort_unstable();
    for w in writes.windows(2) {
        if w[0].0 == w[1].0 && w[1].1 < w[0].2 {
            return Err(XferError::Copy {
                index: w[1].3,
                message: format!(
                    "it writes bytes [{}, {}) of buffer {} that transfer {} also writes (a batch's copies run in parallel)",
                    w[1].1, w[1].2, w[1].0, w[0].3
                ),
            });
        }
    }
    for (i, t) in rows {
        let (buf, start, end, _) = span(t.src, t.copy.src_offset, t.copy.run_bytes, i);
        // Writes are disjoint and sorted: their ends rise with their starts,
        // so the last one starting before `end` is the only one to check.
        let at = writes.partition_point(|w| (w.0, w.1) < (buf, end));
        let Some(w) = at.checked_sub(1).map(|j| writes[j]) else { continue };
        let itself = w.3 == i && w.1 == start;
        if w.0 == buf && w.2 > start && !itself {
            return Err(XferError::Copy {
                index: i,
                message: format!(
                    "it reads bytes [{start}, {end}) of buffer {buf} that transfer {} writes in the same batch \
                     (a batch's copies run in parallel)",
                    w.3
                ),
            });
        }
    }
    Ok(())
}

/// The widest of 16, 8, 4, 2 and 1 bytes dividing every bit of `bits`.
fn widest_piece(bits: u64) -> u64 {
    [16u64, 8, 4, 2, 1].into_iter().find(|p| bits.is_multiple_of(*p)).unwrap_or(1)
}

/// Words of one instance in a batch's table.
pub const INSTANCE_WORDS: usize = 4;

impl Program {
    /// Compiles batches of transfers into one program and its batches: the
    /// distinct shapes in order of first appearance, every copy an instance
    /// of its shape. A shape's piece is the widest of 16, 8, 4, 2 and 1 bytes
    /// that divides its run, its strides and every instance's offsets (the
    /// devices' buffers are at least 16-byte aligned). Copies that move
    /// nothing are dropped. Refuses a copy whose extent overflows or whose
    /// destination runs may overlap (its runs run in parallel).
    pub fn build(batches: &[Vec<Transfer>]) -> Result<(Program, Vec<Batch>), XferError> {
        type Key = (u64, [u64; 2], [u64; 2], [u64; 2]);
        let key = |c: &StridedCopy| (c.run_bytes, c.counts, c.src_strides, c.dst_strides);
        let mut order: Vec<Key> = vec![];
        let mut align: BTreeMap<Key, u64> = BTreeMap::new();
        let mut index = 0usize;
        for t in batches.iter().flatten() {
            let c = &t.copy;
            if c.run_bytes == 0 || c.counts[0] == 0 || c.counts[1] == 0 {
                index += 1;
                continue;
            }
            let k = key(c);
            let bits = align.entry(k).or_insert_with(|| {
                order.push(k);
                c.run_bytes | c.src_strides[0] | c.src_strides[1] | c.dst_strides[0] | c.dst_strides[1]
            });
            *bits |= c.src_offset | c.dst_offset;
            let shape = Shape {
                run_bytes: c.run_bytes,
                counts: c.counts,
                src_strides: c.src_strides,
                dst_strides: c.dst_strides,
                piece: 1,
            };
            let bad = |message: &str| XferError::Copy { index, message: message.into() };
            if shape.extents().is_none()
                || c.counts[0].checked_mul(c.counts[1]).and_then(|n| n.checked_mul(c.run_bytes)).is_none()
            {
                return Err(bad("its extent overflows"));
            }
            if !shape.runs_disjoint() {
                return Err(bad("its destination runs may overlap (they are copied in parallel)"));
            }
            index += 1;
        }
        let shapes: Vec<Shape> = order
            .iter()
            .map(|k| Shape {
                run_bytes: k.0,
                counts: k.1,
                src_strides: k.2,
                dst_strides: k.3,
                piece: widest_piece(align[k]),
            })
            .collect();
        let slot: BTreeMap<Key, usize> = order.iter().enumerate().map(|(i, k)| (*k, i)).collect();
        let out = batches
            .iter()
            .map(|b| {
                let mut per_shape = vec![vec![]; shapes.len()];
                for t in b {
                    if let Some(&i) = slot.get(&key(&t.copy)) {
                        per_shape[i].push(Instance {
                            src: t.src,
                            dst: t.dst,
                            src_offset: t.copy.src_offset,
                            dst_offset: t.copy.dst_offset,
                        });
                    }
                }
                Batch { per_shape, per_sum: vec![], per_swap: vec![], per_gated: vec![] }
            })
            .collect();
        Ok((Program { shapes, sums: vec![], swaps: vec![], gated: vec![] }, out))
    }

    /// This program with `sums` as its reduction loops too (each distinct
    /// shape once, in order of first appearance). Batches built before
    /// belong to the program without them (`Batch::check` refuses them).
    pub fn with_sums(mut self, sums: impl IntoIterator<Item = SumShape>) -> Program {
        for s in sums {
            if !self.sums.contains(&s) {
                self.sums.push(s);
            }
        }
        self
    }

    /// This program with exchanges of each `(bytes, offsets)` as its
    /// exchange loops too: one contiguous shape per distinct byte count, in
    /// order of first appearance, its piece the widest that divides the
    /// count and `offsets` (the OR of every offset an instance may take:
    /// a slot's base, its slot and layer strides). Batches built before
    /// belong to the program without them (`Batch::check` refuses them).
    pub fn with_exchanges(mut self, runs: impl IntoIterator<Item = (u64, u64)>) -> Program {
        for (bytes, offsets) in runs.into_iter().filter(|r| r.0 > 0) {
            let bits = bytes | offsets;
            match self.swaps.iter_mut().find(|s| s.run_bytes == bytes) {
                Some(s) => s.piece = s.piece.min(widest_piece(bits)),
                None => self.swaps.push(Shape {
                    run_bytes: bytes,
                    counts: [1, 1],
                    src_strides: [0, 0],
                    dst_strides: [0, 0],
                    piece: widest_piece(bits),
                }),
            }
        }
        self
    }

    /// This program with gated copies of each `(bytes, offsets, ids)` as
    /// its gated loops too: one shape per distinct (byte count, id count),
    /// in order of first appearance, its piece the widest that divides the
    /// count and `offsets` (the OR of every offset an instance may take).
    /// Batches built before belong to the program without them.
    pub fn with_gated(mut self, runs: impl IntoIterator<Item = (u64, u64, u32)>) -> Program {
        for (bytes, offsets, ids) in runs.into_iter().filter(|r| r.0 > 0 && r.2 > 0) {
            let bits = bytes | offsets;
            match self.gated.iter_mut().find(|s| s.run_bytes == bytes && s.ids == ids) {
                Some(s) => s.piece = s.piece.min(widest_piece(bits)),
                None => self.gated.push(GatedShape { run_bytes: bytes, piece: widest_piece(bits), ids }),
            }
        }
        self
    }

    pub fn shapes(&self) -> &[Shape] {
        &self.shapes
    }

    pub fn gated_shapes(&self) -> &[GatedShape] {
        &self.gated
    }

    pub fn sum_shapes(&self) -> &[SumShape] {
        &self.sums
    }

    pub fn exchange_shapes(&self) -> &[Shape] {
        &self.swaps
    }

    /// A batch of exchanges made at run time, run by one launch: each an
    /// instance of the exchange shape of its byte count. Refuses an exchange
    /// no shape has, one whose offsets are not multiples of its shape's
    /// piece, and one whose bytes overlap its own other side or any side of
    /// another exchange (they run in parallel); exchanges of no bytes are
    /// dropped.
    pub fn exchange_batch(&self, exchanges: &[Exchange]) -> Result<Batch, XferError> {
        let mut per_swap = vec![vec![]; self.swaps.len()];
        let mut sides: Vec<(u32, u64, u64, usize)> = vec![];
        for (index, x) in exchanges.iter().enumerate().filter(|(_, x)| x.bytes > 0) {
            let bad = |message: String| XferError::Exchange { index, message };
            let i =
                self.swaps.iter().position(|s| s.run_bytes == x.bytes).ok_or_else(|| {
                    bad(format!("no exchange shape of this program trades runs of {} bytes", x.bytes))
                })?;
            let piece = self.swaps[i].piece;
            if !(x.a_offset | x.b_offset).is_multiple_of(piece) {
                return Err(bad(format!(
                    "offsets {} and {} are not multiples of the shape's {piece}-byte piece",
                    x.a_offset, x.b_offset
                )));
            }
            for (buf, off) in [(x.a, x.a_offset), (x.b, x.b_offset)] {
                let end = off.checked_add(x.bytes).ok_or_else(|| bad("its extent overflows".into()))?;
                sides.push((buf, off, end, index));
            }
            per_swap[i].push(Instance { src: x.a, dst: x.b, src_offset: x.a_offset, dst_offset: x.b_offset });
        }
        sides.sort_unstable();
        for w in sides.windows(2) {
            if w[0].0 == w[1].0 && w[1].1 < w[0].2 {
                return Err(XferError::Exchange {
                    index: w[1].3,
                    message: format!(
                        "its bytes [{}, {}) of buffer {} overlap exchange {}'s (exchanges run in parallel)",
                        w[1].1, w[1].2, w[1].0, w[0].3
                    ),
                });
            }
        }
        Ok(Batch {
            per_shape: vec![vec![]; self.shapes.len()],
            per_sum: vec![vec![]; self.sums.len()],
            per_swap,
            per_gated: vec![vec![]; self.gated.len()],
        })
    }

    /// A batch of this program's code for copies made at run time (the
    /// dispatch's rows): each copy an instance of the shape with its run,
    /// counts and strides. Refuses a copy no shape has, and one whose
    /// offsets are not multiples of its shape's piece (the code's loads and
    /// stores would be misaligned); copies that move nothing are dropped.
    pub fn batch(&self, transfers: &[Transfer]) -> Result<Batch, XferError> {
        self.batch_with_sums(transfers, &[])
    }

    /// A batch of copies and sums made at run time (a combine's gathers, an
    /// all-reduce's reduce-scatter): each sum an instance of the shape with
    /// its element count, source count and element type. Refuses a sum no
    /// shape has, and one whose offsets are not multiples of its elements'
    /// size, and run-time row copies (one run each) that the batch's
    /// parallel pieces would race on: two writing the same bytes, or one
    /// writing bytes another (or itself, elsewhere) reads.
    pub fn batch_with_sums(&self, transfers: &[Transfer], sums: &[Sum]) -> Result<Batch, XferError> {
        self.batch_of(transfers, sums)
    }

    /// A batch of copies and gated copies made at run time (a dispatch
    /// whose destinations' rows move only where the device's gate passes):
    /// each gated copy an instance of the gated shape with its run and its
    /// gate's id count. Refuses a gated copy no shape has, offsets that are
    /// not multiples of its piece, a gate offset not a multiple of 4, and
    /// one-run copies (gated or not) that race.
    pub fn batch_gated(&self, transfers: &[Transfer], gated: &[GatedCopy], ids: u32) -> Result<Batch, XferError> {
        let mut b = self.batch_of(transfers, &[])?;
        for (index, g) in gated.iter().enumerate() {
            let c = &g.transfer.copy;
            if c.run_bytes == 0 {
                continue;
            }
            let bad = |message: String| XferError::Copy { index, message };
            if c.counts != [1, 1] {
                return Err(bad("a gated copy is one run".into()));
            }
            let i = self.gated.iter().position(|s| s.run_bytes == c.run_bytes && s.ids == ids).ok_or_else(|| {
                bad(format!("no gated shape of this program copies runs of {} bytes on {ids} ids", c.run_bytes))
            })?;
            let piece = self.gated[i].piece;
            if !(c.src_offset | c.dst_offset).is_multiple_of(piece) || !g.gate.offset.is_multiple_of(4) {
                return Err(bad(format!(
                    "offsets {} and {} (gate {}) are not multiples of the shape's {piece}-byte piece (and 4)",
                    c.src_offset, c.dst_offset, g.gate.offset
                )));
            }
            let t = &g.transfer;
            b.per_gated[i].push((
                Instance { src: t.src, dst: t.dst, src_offset: c.src_offset, dst_offset: c.dst_offset },
                g.gate,
            ));
        }
        let all: Vec<Transfer> = transfers.iter().copied().chain(gated.iter().map(|g| g.transfer)).collect();
        races(&all)?;
        Ok(b)
    }

    fn batch_of(&self, transfers: &[Transfer], sums: &[Sum]) -> Result<Batch, XferError> {
        let mut per_shape = vec![vec![]; self.shapes.len()];
        for (index, t) in transfers.iter().enumerate() {
            let c = &t.copy;
            if c.run_bytes == 0 || c.counts[0] == 0 || c.counts[1] == 0 {
                continue;
            }
            let bad = |message: String| XferError::Copy { index, message };
            let i = self
                .shapes
                .iter()
                .position(|s| {
                    (s.run_bytes, s.counts, s.src_strides, s.dst_strides)
                        == (c.run_bytes, c.counts, c.src_strides, c.dst_strides)
                })
                .ok_or_else(|| {
                    bad(format!("no shape of this program copies runs of {} bytes ({:?})", c.run_bytes, c.counts))
                })?;
            let piece = self.shapes[i].piece;
            if !(c.src_offset | c.dst_offset).is_multiple_of(piece) {
                return Err(bad(format!(
                    "offsets {} and {} are not multiples of the shape's {piece}-byte piece",
                    c.src_offset, c.dst_offset
                )));
            }
            per_shape[i].push(Instance { src: t.src, dst: t.dst, src_offset: c.src_offset, dst_offset: c.dst_offset });
        }
        races(transfers)?;
        let mut per_sum = vec![vec![]; self.sums.len()];
        for (index, s) in sums.iter().enumerate() {
            let bad = |message: String| XferError::Sum { index, message };
            let gate = s.gate.as_ref().map_or(0, |g| g.ids);
            let shape = SumShape { elems: s.elems, sources: s.sources.len() as u32, elem: s.elem, out: s.out, gate };
            let i = self.sums.iter().position(|x| *x == shape).ok_or_else(|| {
                bad(format!(
                    "no sum of this program adds {} rows of {} {:?} elements into {:?}{}",
                    shape.sources,
                    shape.elems,
                    shape.elem,
                    shape.out,
                    if gate > 0 { format!(" gated on {gate} ids") } else { String::new() }
                ))
            })?;
            if let Some(g) = &s.gate {
                if gate == 0 || g.ranges.len() != s.sources.len() || !g.offset.is_multiple_of(4) {
                    return Err(bad(format!(
                        "a gate of {} ids at offset {} with {} ranges for {} sources (one range per source, the ids \
                         4-byte aligned)",
                        g.ids,
                        g.offset,
                        g.ranges.len(),
                        s.sources.len()
                    )));
                }
            }
            if !s.dst_offset.is_multiple_of(s.out.bytes()) {
                return Err(bad(format!(
                    "destination offset {} is not a multiple of {} ({:?})",
                    s.dst_offset,
                    s.out.bytes(),
                    s.out
                )));
            }
            if let Some(&(_, off)) = s.sources.iter().find(|(_, off)| !off.is_multiple_of(s.elem.bytes())) {
                return Err(bad(format!("source offset {off} is not a multiple of {} ({:?})", s.elem.bytes(), s.elem)));
            }
            per_sum[i].push(SumInstance {
                dst: s.dst,
                dst_offset: s.dst_offset,
                sources: s.sources.clone(),
                gate: s.gate.clone(),
            });
        }
        Ok(Batch {
            per_shape,
            per_sum,
            per_swap: vec![vec![]; self.swaps.len()],
            per_gated: vec![vec![]; self.gated.len()],
        })
    }

    /// A content key (hex SHA-256 of the shapes) for caches of compiled code.
    pub fn key(&self) -> String {
        let mut h = Sha256::new();
        h.update(b"moeforge-xfer 1");
        for s in &self.shapes {
            for w in [s.run_bytes, s.counts[0], s.counts[1], s.src_strides[0], s.src_strides[1]].into_iter().chain([
                s.dst_strides[0],
                s.dst_strides[1],
                s.piece,
            ]) {
                h.update(w.to_le_bytes());
            }
        }
        // (A program without sums keeps the key it had before sums existed.)
        if !self.sums.is_empty() {
            h.update(b"sums");
            for s in &self.sums {
                h.update(s.elems.to_le_bytes());
                h.update(u64::from(s.sources).to_le_bytes());
                h.update(u64::from(s.elem == Elem::F32).to_le_bytes());
                h.update(u64::from(s.out == Elem::F32).to_le_bytes());
                // (An ungated sum keeps the key it had before gates existed.)
                if s.gate > 0 {
                    h.update(b"gate");
                    h.update(u64::from(s.gate).to_le_bytes());
                }
            }
        }
        if !self.swaps.is_empty() {
            h.update(b"exchanges");
            for s in &self.swaps {
                h.update(s.run_bytes.to_le_bytes());
                h.update(s.piece.to_le_bytes());
            }
        }
        if !self.gated.is_empty() {
            h.update(b"gated");
            for s in &self.gated {
                h.update(s.run_bytes.to_le_bytes());
                h.update(s.piece.to_le_bytes());
                h.update(u64::from(s.ids).to_le_bytes());
            }
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl Batch {
    /// The table the code reads: each copy shape's instance count, each sum
    /// shape's, each exchange shape's, then every copy instance as `[src,
    /// dst, src_offset, dst_offset]`, shape by shape, then every sum
    /// instance as `[dst, dst_offset, src, src_offset, …]` (gated: `[dst,
    /// dst_offset, gate buffer, gate offset, src, src_offset, lo, hi, …]`), shape by shape,
    /// then every exchange as `[a, b, a_offset, b_offset]`, shape by shape,
    /// then every gated copy as `[src, dst, src_offset, dst_offset, gate
    /// buffer, gate offset, lo, hi]` (lo and hi sign-extended), shape by
    /// shape (the gated shapes' counts after the exchanges').
    pub fn words(&self) -> Vec<u64> {
        let mut w: Vec<u64> = self.per_shape.iter().map(|v| v.len() as u64).collect();
        w.extend(self.per_sum.iter().map(|v| v.len() as u64));
        w.extend(self.per_swap.iter().map(|v| v.len() as u64));
        w.extend(self.per_gated.iter().map(|v| v.len() as u64));
        for i in self.per_shape.iter().flatten() {
            w.extend([u64::from(i.src), u64::from(i.dst), i.src_offset, i.dst_offset]);
        }
        for i in self.per_sum.iter().flatten() {
            w.extend([u64::from(i.dst), i.dst_offset]);
            match &i.gate {
                None => {
                    for &(src, off) in &i.sources {
                        w.extend([u64::from(src), off]);
                    }
                }
                Some(g) => {
                    w.extend([u64::from(g.buf), g.offset]);
                    for (&(src, off), &(lo, hi)) in i.sources.iter().zip(&g.ranges) {
                        w.extend([u64::from(src), off, i64::from(lo) as u64, i64::from(hi) as u64]);
                    }
                }
            }
        }
        for i in self.per_swap.iter().flatten() {
            w.extend([u64::from(i.src), u64::from(i.dst), i.src_offset, i.dst_offset]);
        }
        for (i, g) in self.per_gated.iter().flatten() {
            w.extend([u64::from(i.src), u64::from(i.dst), i.src_offset, i.dst_offset]);
            // The range as the code compares it: sign-extended i32s.
            w.extend([u64::from(g.buf), g.offset, i64::from(g.lo) as u64, i64::from(g.hi) as u64]);
        }
        w
    }

    /// Pieces of the whole batch (a launch's work items).
    pub fn pieces(&self, program: &Program) -> u64 {
        let copies = program
            .shapes
            .iter()
            .zip(&self.per_shape)
            .fold(0u64, |n, (s, v)| n.saturating_add(s.pieces().saturating_mul(v.len() as u64)));
        let sums = program
            .sums
            .iter()
            .zip(&self.per_sum)
            .fold(copies, |n, (s, v)| n.saturating_add(s.elems.saturating_mul(v.len() as u64)));
        let swaps = program
            .swaps
            .iter()
            .zip(&self.per_swap)
            .fold(sums, |n, (s, v)| n.saturating_add(s.pieces().saturating_mul(v.len() as u64)));
        program
            .gated
            .iter()
            .zip(&self.per_gated)
            .fold(swaps, |n, (s, v)| n.saturating_add((s.run_bytes / s.piece).saturating_mul(v.len() as u64)))
    }

    pub fn is_empty(&self) -> bool {
        self.per_shape.iter().all(Vec::is_empty)
            && self.per_sum.iter().all(Vec::is_empty)
            && self.per_swap.iter().all(Vec::is_empty)
            && self.per_gated.iter().all(Vec::is_empty)
    }

    /// Every sum instance with its shape, shape by shape (the table's order).
    pub fn sum_instances<'a>(
        &'a self,
        program: &'a Program,
    ) -> impl Iterator<Item = (&'a SumShape, &'a SumInstance)> + 'a {
        program.sums.iter().zip(&self.per_sum).flat_map(|(s, v)| v.iter().map(move |i| (s, i)))
    }

    /// Every instance with its shape, shape by shape (the table's order).
    pub fn instances<'a>(&'a self, program: &'a Program) -> impl Iterator<Item = (&'a Shape, &'a Instance)> + 'a {
        program.shapes.iter().zip(&self.per_shape).flat_map(|(s, v)| v.iter().map(move |i| (s, i)))
    }

    /// Checks the batch against the buffers it will run on (`sizes[i]`: the
    /// bytes of buffer i): it was built for `program`, every buffer index
    /// exists, every run lies inside its buffer and every offset is a
    /// multiple of its shape's piece.
    pub fn check(&self, program: &Program, sizes: &[u64]) -> Result<(), XferError> {
        if self.per_shape.len() != program.shapes.len()
            || self.per_sum.len() != program.sums.len()
            || self.per_swap.len() != program.swaps.len()
            || self.per_gated.len() != program.gated.len()
        {
            return Err(XferError::Bounds(format!(
                "{} copy shapes, {} sum shapes, {} exchange shapes and {} gated shapes of instances for a program of \
                 {}, {}, {} and {}",
                self.per_shape.len(),
                self.per_sum.len(),
                self.per_swap.len(),
                self.per_gated.len(),
                program.shapes.len(),
                program.sums.len(),
                program.swaps.len(),
                program.gated.len()
            )));
        }
        for (s, i) in self.sum_instances(program) {
            let side = |buf: u32, off: u64, elem: u64, what: &str| {
                let size = *sizes
                    .get(buf as usize)
                    .ok_or_else(|| XferError::Bounds(format!("{what} buffer {buf} of {} buffers", sizes.len())))?;
                if !off.is_multiple_of(elem) {
                    return Err(XferError::Bounds(format!("{what} offset {off} is not a multiple of {elem}")));
                }
                match s.elems.checked_mul(elem).and_then(|n| off.checked_add(n)) {
                    Some(e) if e <= size => Ok(()),
                    _ => Err(XferError::Bounds(format!(
                        "{what} row ends past buffer {buf} ({size} bytes): offset {off} + {} elements of {elem} bytes",
                        s.elems
                    ))),
                }
            };
            if i.sources.len() != s.sources as usize {
                return Err(XferError::Bounds(format!(
                    "a sum of {} sources in a shape of {}",
                    i.sources.len(),
                    s.sources
                )));
            }
            side(i.dst, i.dst_offset, s.out.bytes(), "sum destination")?;
            for &(src, off) in &i.sources {
                side(src, off, s.elem.bytes(), "sum source")?;
            }
            match (&i.gate, s.gate) {
                (None, 0) => {}
                (Some(g), ids) if ids > 0 && g.ids == ids && g.ranges.len() == i.sources.len() => {
                    let size = *sizes.get(g.buf as usize).ok_or_else(|| {
                        XferError::Bounds(format!("sum gate buffer {} of {} buffers", g.buf, sizes.len()))
                    })?;
                    match g.offset.checked_add(4 * u64::from(ids)) {
                        Some(e) if e <= size && g.offset.is_multiple_of(4) => {}
                        _ => {
                            return Err(XferError::Bounds(format!(
                                "sum gate: {ids} ids at offset {} of buffer {} ({size} bytes)",
                                g.offset, g.buf
                            )))
                        }
                    }
                }
                _ => return Err(XferError::Bounds(format!("a sum's gate does not match its shape's {} ids", s.gate))),
            }
        }
        let copies = program.shapes.iter().zip(&self.per_shape);
        for (s, v) in copies.chain(program.swaps.iter().zip(&self.per_swap)) {
            let (src_end, dst_end) =
                s.extents().ok_or_else(|| XferError::Bounds("a shape's extent overflows".into()))?;
            for i in v {
                let side = |buf: u32, off: u64, end: u64, what: &str| {
                    let size = *sizes
                        .get(buf as usize)
                        .ok_or_else(|| XferError::Bounds(format!("{what} buffer {buf} of {} buffers", sizes.len())))?;
                    if !off.is_multiple_of(s.piece) {
                        return Err(XferError::Bounds(format!(
                            "{what} offset {off} is not a multiple of its {}-byte piece",
                            s.piece
                        )));
                    }
                    match off.checked_add(end) {
                        Some(e) if e <= size => Ok(()),
                        _ => Err(XferError::Bounds(format!(
                            "{what} runs end past buffer {buf} ({size} bytes): offset {off} + extent {end}"
                        ))),
                    }
                };
                side(i.src, i.src_offset, src_end, "source")?;
                side(i.dst, i.dst_offset, dst_end, "destination")?;
            }
        }
        for (s, v) in program.gated.iter().zip(&self.per_gated) {
            for (i, g) in v {
                let side = |buf: u32, off: u64, len: u64, align: u64, what: &str| {
                    let size = *sizes
                        .get(buf as usize)
                        .ok_or_else(|| XferError::Bounds(format!("{what} buffer {buf} of {} buffers", sizes.len())))?;
                    if !off.is_multiple_of(align) {
                        return Err(XferError::Bounds(format!("{what} offset {off} is not a multiple of {align}")));
                    }
                    match off.checked_add(len) {
                        Some(e) if e <= size => Ok(()),
                        _ => Err(XferError::Bounds(format!(
                            "{what} ends past buffer {buf} ({size} bytes): offset {off} + {len}"
                        ))),
                    }
                };
                side(i.src, i.src_offset, s.run_bytes, s.piece, "gated source")?;
                side(i.dst, i.dst_offset, s.run_bytes, s.piece, "gated destination")?;
                side(g.buf, g.offset, 4 * u64::from(s.ids), 4, "gate")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    /// A seeded xorshift: each call a value below `n`.
    fn xorshift(mut x: u64) -> impl FnMut(u64) -> u64 {
        move |n| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        }
    }

    /// `build`'s refusal of copies whose destination runs may overlap,
    /// against brute force: every pair of runs compared as byte ranges, over
    /// small random copies. What it accepts never overlaps; what overlaps is
    /// refused; and `check`'s extents are the last byte any run touches.
    #[test]
    fn accepted_copies_have_disjoint_destination_runs_and_exact_extents() {
        let mut next = xorshift(0x2545_f491_4f6c_dd1du64);
        let (mut accepted, mut refused_overlapping) = (0, 0);
        for _ in 0..20_000 {
            let c = StridedCopy {
                src_offset: next(64),
                dst_offset: next(64),
                run_bytes: 1 + next(12),
                counts: [1 + next(4), 1 + next(4)],
                src_strides: [next(40), next(16)],
                dst_strides: [next(40), next(16)],
            };
            let runs = |off: u64, s: [u64; 2]| -> Vec<(u64, u64)> {
                (0..c.counts[0])
                    .flat_map(|a| (0..c.counts[1]).map(move |b| off + a * s[0] + b * s[1]))
                    .map(|d| (d, d + c.run_bytes))
                    .collect()
            };
            let dst = runs(c.dst_offset, c.dst_strides);
            let overlap = dst.iter().enumerate().any(|(i, r)| dst[i + 1..].iter().any(|q| r.0 < q.1 && q.0 < r.1));
            let src_end = runs(c.src_offset, c.src_strides).iter().map(|r| r.1).max().unwrap();
            let dst_end = dst.iter().map(|r| r.1).max().unwrap();
            match Program::build(&[vec![Transfer { src: 0, dst: 1, copy: c }]]) {
                Ok((p, b)) => {
                    accepted += 1;
                    assert!(!overlap, "{c:?}");
                    // Exactly the extents: one byte less on either side is refused.
                    b[0].check(&p, &[src_end, dst_end]).unwrap();
                    assert!(b[0].check(&p, &[src_end - 1, dst_end]).is_err(), "{c:?}");
                    assert!(b[0].check(&p, &[src_end, dst_end - 1]).is_err(), "{c:?}");
                }
                Err(_) => refused_overlapping += usize::from(overlap),
            }
        }
        assert!(accepted > 2_000 && refused_overlapping > 2_000, "{accepted} accepted, {refused_overlapping} refused");
    }

    /// Shapes are shared across batches, pieces are the widest every
    /// instance allows, and the table lays out counts then instances.
    #[test]
    fn batches_share_their_program_and_lay_out_the_table() {
        let c = StridedCopy {
            src_offset: 0,
            dst_offset: 32,
            run_bytes: 64,
            counts: [2, 1],
            src_strides: [64, 0],
            dst_strides: [64, 0],
        };
        let odd = StridedCopy { src_offset: 8, ..c };
        let other = StridedCopy { run_bytes: 16, counts: [1, 1], ..c };
        let (p, b) = Program::build(&[
            vec![Transfer { src: 0, dst: 1, copy: c }, Transfer { src: 2, dst: 1, copy: other }],
            vec![Transfer { src: 1, dst: 0, copy: odd }],
        ])
        .unwrap();
        assert_eq!(p.shapes().len(), 2);
        assert_eq!(p.shapes()[0].piece, 8, "an 8-byte offset in the second batch narrows the shared shape");
        assert_eq!(p.shapes()[1].piece, 16);
        assert_eq!(b[0].words(), vec![1, 1, 0, 1, 0, 32, 2, 1, 0, 32]);
        assert_eq!(b[1].words(), vec![1, 0, 1, 0, 8, 32]);
        assert_eq!(b[0].pieces(&p), 2 * 8 + 1);
        assert_ne!(p.key(), Program::build(&[vec![Transfer { src: 0, dst: 1, copy: c }]]).unwrap().0.key());
    }

    /// A run-time batch of a fixed program: each copy finds its shape, and
    /// one the code cannot run (no such shape, misaligned) is refused.
    #[test]
    fn run_time_batches_take_the_programs_shapes_or_are_refused() {
        let row = |src: u64, dst: u64| Transfer { src: 0, dst: 1, copy: StridedCopy::one_run(src, dst, 64) };
        let (p, _) = Program::build(&[vec![row(256, 512), row(320, 576)]]).unwrap();
        assert_eq!(p.shapes()[0].piece, 16);
        let b = p.batch(&[row(0, 64), row(640, 128)]).unwrap();
        assert_eq!(b.words(), vec![2, 0, 1, 0, 64, 0, 1, 640, 128]);
        let e = p.batch(&[row(0, 8)]).unwrap_err().to_string();
        assert!(e.contains("16-byte piece"), "{e}");
        let odd = Transfer { copy: StridedCopy { run_bytes: 32, ..row(0, 0).copy }, ..row(0, 0) };
        let e = p.batch(&[row(0, 0), odd]).unwrap_err().to_string();
        assert!(e.starts_with("transfer 1:") && e.contains("no shape"), "{e}");
    }

    /// Run-time row copies of one batch run in parallel: against brute
    /// force over random rows, a batch is refused exactly when two
    /// destinations overlap or a destination overlaps another copy's source
    /// (or its own, elsewhere).
    #[test]
    fn run_time_batches_refuse_copies_that_race() {
        let (p, _) =
            Program::build(&[vec![Transfer { src: 0, dst: 0, copy: StridedCopy::one_run(0, 16, 16) }]]).unwrap();
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15u64);
        let (mut refused, mut accepted) = (0, 0);
        for _ in 0..5_000 {
            let copies: Vec<Transfer> = (0..1 + next(4))
                .map(|_| Transfer {
                    src: next(2) as u32,
                    dst: next(2) as u32,
                    copy: StridedCopy::one_run(16 * next(8), 16 * next(8), 16),
                })
                .collect();
            let range = |b: u32, o: u64| (b, o, o + 16);
            let hit = |a: (u32, u64, u64), b: (u32, u64, u64)| a.0 == b.0 && a.1 < b.2 && b.1 < a.2;
            let mut race = false;
            for (i, a) in copies.iter().enumerate() {
                for (j, b) in copies.iter().enumerate() {
                    let (wa, rb) = (range(a.dst, a.copy.dst_offset), range(b.src, b.copy.src_offset));
                    let same = i == j && wa == rb;
                    race |= i < j && hit(wa, range(b.dst, b.copy.dst_offset));
                    race |= hit(wa, rb) && !same;
                }
            }
            match p.batch(&copies) {
                Ok(_) => {
                    accepted += 1;
                    assert!(!race, "{copies:?}");
                }
                Err(e) => {
                    refused += 1;
                    assert!(race, "{copies:?}: {e}");
                }
            }
        }
        assert!(refused > 500 && accepted > 500, "{refused} refused, {accepted} accepted");
    }

    /// Exchanges: one shape per byte count (its piece narrowed by every
    /// offset given), the table's counts then instances after the copies',
    /// and batches whose exchanges overlap, or that no shape runs, refused.
    #[test]
    fn exchange_batches_take_the_programs_shapes_and_never_overlap() {
        let (p, _) = Program::build(&[]).unwrap();
        let p = p.with_exchanges([(64, 4096), (48, 16), (64, 8), (0, 0)]);
        let shapes: Vec<(u64, u64)> = p.exchange_shapes().iter().map(|s| (s.run_bytes, s.piece)).collect();
        assert_eq!(shapes, vec![(64, 8), (48, 16)]);
        assert_ne!(p.key(), Program::build(&[]).unwrap().0.key());
        let x = |a: u32, a_offset: u64, b: u32, b_offset: u64, bytes: u64| Exchange { a, a_offset, b, b_offset, bytes };
        let b = p.exchange_batch(&[x(0, 0, 1, 64, 64), x(1, 0, 1, 128, 48), x(0, 8, 0, 8, 0)]).unwrap();
        assert_eq!(b.words(), vec![1, 1, 0, 1, 0, 64, 1, 1, 0, 128]);
        assert_eq!(b.pieces(&p), 8 + 3);
        b.check(&p, &[64, 176]).unwrap();
        assert!(b.check(&p, &[64, 175]).is_err(), "the second exchange ends past buffer 1");
        // Overlaps: with another exchange's side, or with its own other side.
        let e = p.exchange_batch(&[x(0, 0, 1, 0, 64), x(1, 32, 2, 0, 64)]).unwrap_err().to_string();
        assert!(e.starts_with("exchange 1:") && e.contains("overlap exchange 0"), "{e}");
        assert!(p.exchange_batch(&[x(3, 0, 3, 40, 64)]).is_err());
        assert!(p.exchange_batch(&[x(3, 0, 3, 64, 64)]).is_ok(), "adjacent runs do not overlap");
        let e = p.exchange_batch(&[x(0, 4, 1, 0, 64)]).unwrap_err().to_string();
        assert!(e.contains("8-byte piece"), "{e}");
        let e = p.exchange_batch(&[x(0, 0, 1, 0, 32)]).unwrap_err().to_string();
        assert!(e.contains("no exchange shape"), "{e}");
        // A copy batch of the program without exchanges does not run on it.
        let (q, batches) =
            Program::build(&[vec![Transfer { src: 0, dst: 1, copy: StridedCopy::one_run(0, 0, 16) }]]).unwrap();
        assert!(batches[0].check(&q.clone().with_exchanges([(64, 0)]), &[16, 16]).is_err());
    }

    #[test]
    fn code_compiled_for_another_program_is_refused() {
        let (p, _) =
            Program::build(&[vec![Transfer { src: 0, dst: 0, copy: StridedCopy::one_run(0, 64, 64) }]]).unwrap();
        let ok = Code::new(p.clone(), header("//", &p) + ".entry", header(";", &p) + "define");
        assert!(ok.is_ok());
        let e = Code::new(p.clone(), "// moeforge transfer program 00\n".into(), header(";", &p)).unwrap_err();
        assert!(e.contains("its PTX was compiled for another transfer program"), "{e}");
        assert!(Code::new(p.clone(), header("//", &p), String::new()).unwrap_err().contains("its IR"));
    }
}
