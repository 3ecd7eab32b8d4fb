//! Lowering a [`Program`] to LLVM IR, and the IR to PTX or host code.
//!
//! One body, `moeforge_xfer_body(bases, table, worker, workers)`, is the
//! whole program on every target: for each shape in order, pieces `worker`,
//! `worker + workers`, … of the batch's instances of that shape, each piece
//! one load and one store of the shape's piece width. A piece's index splits
//! into (instance, run (a, b), piece within the run) by divisions by the
//! shape's constants; consecutive pieces are consecutive bytes of a run.
//! Then each sum shape the same way, a piece being one destination element:
//! its sources' elements loaded in order (bf16 widened exactly to f32),
//! added to +0.0 one by one with IEEE f32 adds (no fast-math flag, so no
//! reassociation and no contraction on any target), one f32 stored (or
//! rounded to bf16, to nearest, ties to even); a gated sum's source is
//! loaded and added only when one of the gate's ids lies in its range, in a
//! branch, so a skipped source is never read. Then each exchange shape as
//! a copy shape, except that a piece is loaded from both sides before it
//! is stored into the other. Then each gated shape: a piece of a one-run
//! copy, moved only when one of its gate's i32 ids lies in `[lo, hi)`. The
//! targets differ only in the entry that calls the body (inlined):
//! - GPU: the kernel `moeforge_xfer(bases, table)`, one worker per thread of
//!   the grid (worker = global thread index, workers = threads in the grid);
//! - host: `moeforge_xfer(bases, table, worker, workers)`, called with the
//!   worker split the caller chooses (the emulated device and [`crate::jit`]
//!   use one worker).
//!
//! `bases[i]` is buffer i's address; `table` is [`crate::Batch::words`].

use crate::{header, Elem, GatedShape, Program, Shape, SumShape, XferError, ENTRY, GATED_WORDS, INSTANCE_WORDS};
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::module::{Linkage, Module};
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetMachine, TargetTriple};
use inkwell::types::BasicTypeEnum;
use inkwell::values::{BasicValue, FunctionValue, IntValue, PointerValue};
use inkwell::{AddressSpace, IntPredicate, OptimizationLevel};
use std::sync::Once;

const BODY: &str = "moeforge_xfer_body";
/// LLVM's calling convention number for a PTX kernel (`ptx_kernel`).
const PTX_KERNEL: u32 = 71;
/// The PTX ISA the GPU code targets: 8.0, what sm_90a needs and CUDA 12's
/// drivers and later load.
const PTX_FEATURES: &str = "+ptx80";

/// `ptr + index` elements of `ty`: a GEP without `inbounds`.
fn gep<'c>(
    b: &Builder<'c>,
    ty: impl inkwell::types::BasicType<'c>,
    ptr: PointerValue<'c>,
    index: IntValue<'c>,
) -> Result<PointerValue<'c>, XferError> {
    // SAFETY: this builds IR, it runs nothing; a GEP without `inbounds` is
    // defined for any index. What the code later dereferences is bounded by
    // `Batch::check` before any device runs it.
    unsafe { b.build_gep(ty, ptr, &[index], "") }.map_err(llvm)
}

/// The integer (or, for 16 bytes, vector) type one piece of `bytes` is
/// loaded and stored as.
fn piece_type(ctx: &Context, bytes: u64) -> BasicTypeEnum<'_> {
    match bytes {
        16 => ctx.i32_type().vec_type(4).into(),
        8 => ctx.i64_type().into(),
        4 => ctx.i32_type().into(),
        2 => ctx.i16_type().into(),
        _ => ctx.i8_type().into(),
    }
}

fn llvm(e: impl std::fmt::Display) -> XferError {
    XferError::Llvm(e.to_string())
}

static TARGETS: Once = Once::new();

fn init() {
    TARGETS.call_once(|| {
        let c = InitializationConfig::default();
        Target::initialize_nvptx(&c);
        // Fails only on a host LLVM was not built for; host_object says so.
        let _ = Target::initialize_native(&c);
    });
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flavor {
    Gpu,
    Host,
}

/// The module of `program` for `flavor`, verified, not yet optimized.
pub(crate) fn module<'c>(ctx: &'c Context, program: &Program, flavor: Flavor) -> Result<Module<'c>, XferError> {
    let m = ctx.create_module("moeforge_xfer");
    let b = ctx.create_builder();
    let body = body(ctx, &m, &b, program)?;
    let ptr = ctx.ptr_type(AddressSpace::default());
    let i64t = ctx.i64_type();
    match flavor {
        Flavor::Host => {
            let ty = ctx.void_type().fn_type(&[ptr.into(), ptr.into(), i64t.into(), i64t.into()], false);
            let f = m.add_function(ENTRY, ty, None);
            b.position_at_end(ctx.append_basic_block(f, "entry"));
            let args: Vec<_> = f.get_param_iter().map(Into::into).collect();
            b.build_call(body, &args, "").map_err(llvm)?;
            b.build_return(None).map_err(llvm)?;
        }
        Flavor::Gpu => {
            let ty = ctx.void_type().fn_type(&[ptr.into(), ptr.into()], false);
            let f = m.add_function(ENTRY, ty, None);
            f.set_call_conventions(PTX_KERNEL);
            b.position_at_end(ctx.append_basic_block(f, "entry"));
            let i32t = ctx.i32_type();
            let sreg = |name: &str| -> Result<IntValue<'c>, XferError> {
                let name = format!("llvm.nvvm.read.ptx.sreg.{name}");
                let g = m.get_function(&name).unwrap_or_else(|| m.add_function(&name, i32t.fn_type(&[], false), None));
                let v = b.build_call(g, &[], "").map_err(llvm)?;
                let v =
                    v.try_as_basic_value().basic().ok_or_else(|| llvm("a special register read returned nothing"))?;
                b.build_int_z_extend(v.into_int_value(), i64t, "").map_err(llvm)
            };
            let (tid, ntid, ctaid, nctaid) = (sreg("tid.x")?, sreg("ntid.x")?, sreg("ctaid.x")?, sreg("nctaid.x")?);
            let first = b.build_int_mul(ctaid, ntid, "").map_err(llvm)?;
            let worker = b.build_int_add(first, tid, "worker").map_err(llvm)?;
            let workers = b.build_int_mul(nctaid, ntid, "workers").map_err(llvm)?;
            let p = f.get_params();
            b.build_call(body, &[p[0].into(), p[1].into(), worker.into(), workers.into()], "").map_err(llvm)?;
            b.build_return(None).map_err(llvm)?;
        }
    }
    m.verify().map_err(llvm)?;
    Ok(m)
}

/// The body: one strided loop per copy shape, then one per sum shape, then
/// one per exchange shape.
fn body<'c>(
    ctx: &'c Context,
    m: &Module<'c>,
    b: &Builder<'c>,
    program: &Program,
) -> Result<FunctionValue<'c>, XferError> {
    let (shapes, sums, swaps, gated) =
        (program.shapes(), program.sum_shapes(), program.exchange_shapes(), program.gated_shapes());
    let ptr = ctx.ptr_type(AddressSpace::default());
    let i64t = ctx.i64_type();
    let ty = ctx.void_type().fn_type(&[ptr.into(), ptr.into(), i64t.into(), i64t.into()], false);
    let f = m.add_function(BODY, ty, Some(Linkage::Internal));
    let inline = ctx.create_enum_attribute(Attribute::get_named_enum_kind_id("alwaysinline"), 0);
    f.add_attribute(AttributeLoc::Function, inline);
    let params = f.get_params();
    let (bases, table) = (params[0].into_pointer_value(), params[1].into_pointer_value());
    let (worker, workers) = (params[2].into_int_value(), params[3].into_int_value());
    let c = |v: u64| i64t.const_int(v, false);
    // Table words and buffer addresses are 8-byte aligned on every device
    // (said here: a module without a data layout would assume 4 for i64, and
    // the NVPTX back end would split each load in two).
    let aligned = |v: inkwell::values::BasicValueEnum<'c>| -> Result<inkwell::values::BasicValueEnum<'c>, XferError> {
        v.as_instruction_value().ok_or_else(|| llvm("a load is not an instruction"))?.set_alignment(8).map_err(llvm)?;
        Ok(v)
    };
    let word = |at: IntValue<'c>, name: &str| -> Result<IntValue<'c>, XferError> {
        let p = gep(b, i64t, table, at)?;
        Ok(aligned(b.build_load(i64t, p, name).map_err(llvm)?)?.into_int_value())
    };
    // A gate's `n` i32 ids at `off` of buffer `buf`, sign-extended (gated
    // copies and gated sums read a token's top-k ids the same way).
    let gate_ids = |buf: IntValue<'c>, off: IntValue<'c>, n: u32| -> Result<Vec<IntValue<'c>>, XferError> {
        let slot = gep(b, ptr, bases, buf)?;
        let base = aligned(b.build_load(ptr, slot, "gate_base").map_err(llvm)?)?.into_pointer_value();
        (0..u64::from(n))
            .map(|j| {
                let o = b.build_int_add(off, i64t.const_int(4 * j, false), "").map_err(llvm)?;
                let at = gep(b, ctx.i8_type(), base, o)?;
                let id = b.build_load(ctx.i32_type(), at, "id").map_err(llvm)?;
                id.as_instruction_value()
                    .ok_or_else(|| llvm("a load is not an instruction"))?
                    .set_alignment(4)
                    .map_err(llvm)?;
                b.build_int_s_extend(id.into_int_value(), i64t, "").map_err(llvm)
            })
            .collect()
    };
    // Whether one of `ids` lies in [lo, hi).
    let any_inside = |ids: &[IntValue<'c>], lo: IntValue<'c>, hi: IntValue<'c>| -> Result<IntValue<'c>, XferError> {
        let mut any = ctx.bool_type().const_zero();
        for &id in ids {
            let above = b.build_int_compare(IntPredicate::SGE, id, lo, "").map_err(llvm)?;
            let below = b.build_int_compare(IntPredicate::SLT, id, hi, "").map_err(llvm)?;
            let inside = b.build_and(above, below, "").map_err(llvm)?;
            any = b.build_or(any, inside, "any").map_err(llvm)?;
        }
        Ok(any)
    };

    let entry = ctx.append_basic_block(f, "entry");
    b.position_at_end(entry);
    // Each shape's instance count, and where its instances start in the table.
    let mut counts = vec![];
    let mut starts = vec![];
    let mut at = c((shapes.len() + sums.len() + swaps.len() + gated.len()) as u64);
    let per: Vec<(u64, u64)> = shapes
        .iter()
        .map(|s| (INSTANCE_WORDS as u64, s.pieces()))
        .chain(sums.iter().map(|s| (s.words() as u64, s.elems)))
        .chain(swaps.iter().map(|s| (INSTANCE_WORDS as u64, s.pieces())))
        .chain(gated.iter().map(|s| (GATED_WORDS as u64, s.run_bytes / s.piece)))
        .collect();
    for (i, &(words, pieces)) in per.iter().enumerate() {
        let n = word(c(i as u64), "n")?;
        starts.push(at);
        let words = b.build_int_mul(n, c(words), "").map_err(llvm)?;
        at = b.build_int_add(at, words, "").map_err(llvm)?;
        counts.push(b.build_int_mul(n, c(pieces), "pieces").map_err(llvm)?);
    }
    let done = ctx.append_basic_block(f, "done");
    let mut pred = entry;
    let f32t = ctx.f32_type();
    enum Loop<'s> {
        /// A copy shape, or (`true`) an exchange shape.
        Copy(&'s Shape, bool),
        Sum(&'s SumShape),
        Gated(&'s GatedShape),
    }
    let loops = shapes
        .iter()
        .map(|s| Loop::Copy(s, false))
        .chain(sums.iter().map(Loop::Sum))
        .chain(swaps.iter().map(|s| Loop::Copy(s, true)))
        .chain(gated.iter().map(Loop::Gated));
    for (i, l) in loops.enumerate() {
        // One grid-stride loop: pieces (a copy or an exchange) or elements
        // (a sum) `worker`, `worker + workers`, … below `counts[i]`.
        let (label, unit) = match l {
            Loop::Copy(_, false) => (format!("shape{i}"), "piece"),
            Loop::Sum(_) => (format!("sum{}", i - shapes.len()), "element"),
            Loop::Copy(_, true) => (format!("exchange{}", i - shapes.len() - sums.len()), "piece"),
            Loop::Gated(_) => (format!("gated{}", i - shapes.len() - sums.len() - swaps.len()), "piece"),
        };
        let head = ctx.append_basic_block(f, &label);
        let step = ctx.append_basic_block(f, &format!("{label}.{unit}"));
        b.position_at_end(pred);
        b.build_unconditional_branch(head).map_err(llvm)?;
        b.position_at_end(head);
        let p = b.build_phi(i64t, "p").map_err(llvm)?;
        p.add_incoming(&[(&worker, pred)]);
        let pv = p.as_basic_value().into_int_value();
        let more = b.build_int_compare(IntPredicate::ULT, pv, counts[i], "").map_err(llvm)?;
        let next = ctx.append_basic_block(f, &format!("{label}.end"));
        b.build_conditional_branch(more, step, next).map_err(llvm)?;

        b.position_at_end(step);
        match l {
            Loop::Copy(s, exchange) => {
                let per_run = s.run_bytes / s.piece;
                let inst = b.build_int_unsigned_div(pv, c(s.pieces()), "instance").map_err(llvm)?;
                let local = b.build_int_unsigned_rem(pv, c(s.pieces()), "").map_err(llvm)?;
                let run = b.build_int_unsigned_div(local, c(per_run), "run").map_err(llvm)?;
                let k = b.build_int_unsigned_rem(local, c(per_run), "k").map_err(llvm)?;
                let a = b.build_int_unsigned_div(run, c(s.counts[1]), "a").map_err(llvm)?;
                let bb = b.build_int_unsigned_rem(run, c(s.counts[1]), "b").map_err(llvm)?;
                let w = b.build_int_mul(inst, c(INSTANCE_WORDS as u64), "").map_err(llvm)?;
                let w = b.build_int_add(starts[i], w, "").map_err(llvm)?;
                let field = |j: u64, name: &str| -> Result<IntValue<'c>, XferError> {
                    let at = b.build_int_add(w, c(j), "").map_err(llvm)?;
                    word(at, name)
                };
                let (src, dst) = (field(0, "src")?, field(1, "dst")?);
                let (src_off, dst_off) = (field(2, "src_offset")?, field(3, "dst_offset")?);
                let address =
                    |buf: IntValue<'c>, off: IntValue<'c>, strides: [u64; 2]| -> Result<PointerValue<'c>, XferError> {
                        let slot = gep(b, ptr, bases, buf)?;
                        let base = aligned(b.build_load(ptr, slot, "base").map_err(llvm)?)?.into_pointer_value();
                        let mut o = off;
                        for (n, by) in [(a, strides[0]), (bb, strides[1]), (k, s.piece)] {
                            let t = b.build_int_mul(n, c(by), "").map_err(llvm)?;
                            o = b.build_int_add(o, t, "").map_err(llvm)?;
                        }
                        gep(b, ctx.i8_type(), base, o)
                    };
                let from = address(src, src_off, s.src_strides)?;
                let to = address(dst, dst_off, s.dst_strides)?;
                let piece = piece_type(ctx, s.piece);
                let align = s.piece as u32;
                let load = |at: PointerValue<'c>, name: &str| -> Result<_, XferError> {
                    let v = b.build_load(piece, at, name).map_err(llvm)?;
                    v.as_instruction_value()
                        .ok_or_else(|| llvm("a load is not an instruction"))?
                        .set_alignment(align)
                        .map_err(llvm)?;
                    Ok(v)
                };
                let v = load(from, "v")?;
                if exchange {
                    // Both sides loaded before either is stored: the worker
                    // owns this piece of both runs.
                    let w = load(to, "w")?;
                    b.build_store(from, w).map_err(llvm)?.set_alignment(align).map_err(llvm)?;
                }
                b.build_store(to, v).map_err(llvm)?.set_alignment(align).map_err(llvm)?;
            }
            Loop::Gated(s) => {
                // A piece of an instance's run, moved only when one of the
                // gate's ids lies in [lo, hi) (read by every piece: a warp's
                // pieces of one run read the same words).
                let per_run = s.run_bytes / s.piece;
                let inst = b.build_int_unsigned_div(pv, c(per_run), "instance").map_err(llvm)?;
                let k = b.build_int_unsigned_rem(pv, c(per_run), "k").map_err(llvm)?;
                let w = b.build_int_mul(inst, c(GATED_WORDS as u64), "").map_err(llvm)?;
                let w = b.build_int_add(starts[i], w, "").map_err(llvm)?;
                let field = |j: u64, name: &str| -> Result<IntValue<'c>, XferError> {
                    let at = b.build_int_add(w, c(j), "").map_err(llvm)?;
                    word(at, name)
                };
                let base_of = |buf: IntValue<'c>| -> Result<PointerValue<'c>, XferError> {
                    let slot = gep(b, ptr, bases, buf)?;
                    Ok(aligned(b.build_load(ptr, slot, "base").map_err(llvm)?)?.into_pointer_value())
                };
                let ids = gate_ids(field(4, "gate")?, field(5, "gate_offset")?, s.ids)?;
                let any = any_inside(&ids, field(6, "lo")?, field(7, "hi")?)?;
                let copy = ctx.append_basic_block(f, &format!("{label}.copy"));
                let skip = ctx.append_basic_block(f, &format!("{label}.next"));
                b.build_conditional_branch(any, copy, skip).map_err(llvm)?;
                b.position_at_end(copy);
                let at = |buf: IntValue<'c>, off: IntValue<'c>| -> Result<PointerValue<'c>, XferError> {
                    let base = base_of(buf)?;
                    let t = b.build_int_mul(k, c(s.piece), "").map_err(llvm)?;
                    let o = b.build_int_add(off, t, "").map_err(llvm)?;
                    gep(b, ctx.i8_type(), base, o)
                };
                let from = at(field(0, "src")?, field(2, "src_offset")?)?;
                let to = at(field(1, "dst")?, field(3, "dst_offset")?)?;
                let piece = piece_type(ctx, s.piece);
                let v = b.build_load(piece, from, "v").map_err(llvm)?;
                v.as_instruction_value()
                    .ok_or_else(|| llvm("a load is not an instruction"))?
                    .set_alignment(s.piece as u32)
                    .map_err(llvm)?;
                b.build_store(to, v).map_err(llvm)?.set_alignment(s.piece as u32).map_err(llvm)?;
                b.build_unconditional_branch(skip).map_err(llvm)?;
                b.position_at_end(skip);
            }
            Loop::Sum(s) => {
                let inst = b.build_int_unsigned_div(pv, c(s.elems), "instance").map_err(llvm)?;
                let e = b.build_int_unsigned_rem(pv, c(s.elems), "element").map_err(llvm)?;
                let w = b.build_int_mul(inst, c(s.words() as u64), "").map_err(llvm)?;
                let w = b.build_int_add(starts[i], w, "").map_err(llvm)?;
                let field = |k: u64, name: &str| -> Result<IntValue<'c>, XferError> {
                    let at = b.build_int_add(w, c(k), "").map_err(llvm)?;
                    word(at, name)
                };
                // Element `e` of the row at (buffer, offset), `size` bytes each.
                let element =
                    |buf: IntValue<'c>, off: IntValue<'c>, size: u64| -> Result<PointerValue<'c>, XferError> {
                        let slot = gep(b, ptr, bases, buf)?;
                        let base = aligned(b.build_load(ptr, slot, "base").map_err(llvm)?)?.into_pointer_value();
                        let t = b.build_int_mul(e, c(size), "").map_err(llvm)?;
                        let o = b.build_int_add(off, t, "").map_err(llvm)?;
                        gep(b, ctx.i8_type(), base, o)
                    };
                // A gated sum's ids (the token's), read once per element.
                let gated = s.gate > 0;
                let ids = if gated { gate_ids(field(2, "gate")?, field(3, "gate_offset")?, s.gate)? } else { vec![] };
                let (first, per) = if gated { (4, 4) } else { (2, 2) };
                let mut acc = f32t.const_float(0.0);
                for k in 0..u64::from(s.sources) {
                    let src = field(first + per * k, "src")?;
                    let src_off = field(first + per * k + 1, "src_offset")?;
                    // Gated: read and add the source only when one of the ids
                    // lies in its [lo, hi); otherwise the sum stays as it was.
                    let mut skip = None;
                    if gated {
                        let any =
                            any_inside(&ids, field(first + per * k + 2, "lo")?, field(first + per * k + 3, "hi")?)?;
                        let from = b.get_insert_block().ok_or_else(|| llvm("no block to branch from"))?;
                        let read = ctx.append_basic_block(f, &format!("{label}.source{k}"));
                        let join = ctx.append_basic_block(f, &format!("{label}.source{k}.end"));
                        b.build_conditional_branch(any, read, join).map_err(llvm)?;
                        b.position_at_end(read);
                        skip = Some((from, join, acc));
                    }
                    let at = element(src, src_off, s.elem.bytes())?;
                    let x = match s.elem {
                        Elem::Bf16 => {
                            let v = b.build_load(ctx.i16_type(), at, "bf16").map_err(llvm)?;
                            v.as_instruction_value()
                                .ok_or_else(|| llvm("a load is not an instruction"))?
                                .set_alignment(2)
                                .map_err(llvm)?;
                            let wide = b.build_int_z_extend(v.into_int_value(), ctx.i32_type(), "").map_err(llvm)?;
                            let bits =
                                b.build_left_shift(wide, ctx.i32_type().const_int(16, false), "").map_err(llvm)?;
                            b.build_bit_cast(bits, f32t, "x").map_err(llvm)?.into_float_value()
                        }
                        Elem::F32 => {
                            let v = b.build_load(f32t, at, "x").map_err(llvm)?;
                            v.as_instruction_value()
                                .ok_or_else(|| llvm("a load is not an instruction"))?
                                .set_alignment(4)
                                .map_err(llvm)?;
                            v.into_float_value()
                        }
                    };
                    acc = b.build_float_add(acc, x, "acc").map_err(llvm)?;
                    if let Some((from, join, before)) = skip {
                        let read = b.get_insert_block().ok_or_else(|| llvm("no block to join from"))?;
                        b.build_unconditional_branch(join).map_err(llvm)?;
                        b.position_at_end(join);
                        let phi = b.build_phi(f32t, "acc").map_err(llvm)?;
                        phi.add_incoming(&[(&before, from), (&acc, read)]);
                        acc = phi.as_basic_value().into_float_value();
                    }
                }
                let to = element(field(0, "dst")?, field(1, "dst_offset")?, s.out.bytes())?;
                match s.out {
                    Elem::F32 => {
                        b.build_store(to, acc).map_err(llvm)?.set_alignment(4).map_err(llvm)?;
                    }
                    Elem::Bf16 => {
                        // Round to nearest, ties to even: add 0x7fff plus the bit
                        // that survives, keep the upper half; a NaN stays a (quiet) NaN.
                        let i32t = ctx.i32_type();
                        let k = |v: u64| i32t.const_int(v, false);
                        let bits = b.build_bit_cast(acc, i32t, "").map_err(llvm)?.into_int_value();
                        let upper = b.build_right_shift(bits, k(16), false, "").map_err(llvm)?;
                        let odd = b.build_and(upper, k(1), "").map_err(llvm)?;
                        let bias = b.build_int_add(odd, k(0x7fff), "").map_err(llvm)?;
                        let rounded = b.build_int_add(bits, bias, "").map_err(llvm)?;
                        let rounded = b.build_right_shift(rounded, k(16), false, "").map_err(llvm)?;
                        let quiet = b.build_or(upper, k(0x40), "").map_err(llvm)?;
                        let nan = b.build_float_compare(inkwell::FloatPredicate::UNO, acc, acc, "nan").map_err(llvm)?;
                        let v = b.build_select(nan, quiet, rounded, "").map_err(llvm)?.into_int_value();
                        let v = b.build_int_truncate(v, ctx.i16_type(), "bf16").map_err(llvm)?;
                        b.build_store(to, v).map_err(llvm)?.set_alignment(2).map_err(llvm)?;
                    }
                }
            }
        }
        let latch = b.get_insert_block().ok_or_else(|| llvm("no block to continue from"))?;
        let n = b.build_int_add(pv, workers, "").map_err(llvm)?;
        p.add_incoming(&[(&n, latch)]);
        b.build_unconditional_branch(head).map_err(llvm)?;
        pred = next;
    }
    b.position_at_end(pred);
    b.build_unconditional_branch(done).map_err(llvm)?;
    b.position_at_end(done);
    b.build_return(None).map_err(llvm)?;
    Ok(f)
}

fn machine(triple: &TargetTriple, cpu: &str, features: &str, reloc: RelocMode) -> Result<TargetMachine, XferError> {
    init();
    let target = Target::from_triple(triple).map_err(llvm)?;
    target
        .create_target_machine(triple, cpu, features, OptimizationLevel::Aggressive, reloc, CodeModel::Default)
        .ok_or_else(|| llvm(format!("no target machine for {} ({cpu})", triple.as_str().to_string_lossy())))
}

/// Sets `m`'s target and runs LLVM's O3 pipeline on it.
pub(crate) fn optimize(m: &Module<'_>, tm: &TargetMachine) -> Result<(), XferError> {
    m.set_triple(&tm.get_triple());
    m.set_data_layout(&tm.get_target_data().get_data_layout());
    m.run_passes("default<O3>", tm, PassBuilderOptions::create()).map_err(llvm)
}

pub(crate) fn host_machine() -> Result<TargetMachine, XferError> {
    // A fixed, generic CPU: the same program gives the same object on every
    // host of an architecture (content-keyed caches stay valid).
    let triple = TargetMachine::get_default_triple();
    let cpu = if triple.as_str().to_string_lossy().starts_with("x86_64") { "x86-64" } else { "generic" };
    machine(&triple, cpu, "", RelocMode::PIC)
}

/// The program as PTX for `arch` (`sm_90a`, `sm_80`, …): the kernel
/// [`ENTRY`]`(bases, table)`, one worker per thread of the grid.
pub fn ptx(program: &Program, arch: &str) -> Result<String, XferError> {
    let tm = machine(&TargetTriple::create("nvptx64-nvidia-cuda"), arch, PTX_FEATURES, RelocMode::Default)?;
    let ctx = Context::create();
    let m = module(&ctx, program, Flavor::Gpu)?;
    optimize(&m, &tm)?;
    let buf = tm.write_to_memory_buffer(&m, FileType::Assembly).map_err(llvm)?;
    let text = String::from_utf8(buf.as_slice().to_vec()).map_err(llvm)?;
    Ok(header("//", program) + &text)
}

/// The program as a relocatable object for this host (position-independent,
/// for a shared library): `void moeforge_xfer(void** bases, const uint64_t*
/// table, uint64_t worker, uint64_t workers)`.
pub fn host_object(program: &Program) -> Result<Vec<u8>, XferError> {
    let tm = host_machine()?;
    let ctx = Context::create();
    let m = module(&ctx, program, Flavor::Host)?;
    optimize(&m, &tm)?;
    Ok(tm.write_to_memory_buffer(&m, FileType::Object).map_err(llvm)?.as_slice().to_vec())
}

/// The program's host-flavored IR, target-independent (no triple): what a
/// bundle carries for the emulated device, which compiles it for its host
/// with LLVM's `llc`.
pub fn host_ir(program: &Program) -> Result<String, XferError> {
    let ctx = Context::create();
    let m = module(&ctx, program, Flavor::Host)?;
    let text = m.print_to_string().to_string();
    Ok(header(";", program) + &text)
}
