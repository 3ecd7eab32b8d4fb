//! Transfer programs (`moeforge_xfer`): the one LLVM IR that moves the
//! weight reshard's bytes on every device, checked against independent
//! executions.
//!
//! - The reshard of compiled dual-mode plans (Qwen3-MoE, Mixtral, DeepSeek-V3
//!   and GLM-5 on 2, 4 and 8 ranks), run by the JIT
//!   as the devices run it (one batch per layer) against the CPU twin's
//!   descriptor interpreter (`twin::reshard::execute_reshard`: every run of
//!   every descriptor in schedule order, a memmove each), byte for byte on
//!   random rank buffers, EP→TP then TP→EP.
//! - Random strided programs (every piece width, repeated shapes, batches
//!   reading what earlier ones wrote) against a naive run-by-run copy.
//! - A bundle's transfer programs (the reshard and the EP dispatch's rows)
//!   as PTX for sm_90a: kernel entries that ptxas (nvcc tier) assembles
//!   without spilling. (The dispatch runs in every emulated-device test in
//!   EP, whose tokens are transformers'.)
//! - Random sums (bf16 and f32 rows from 0 to 4 sources into f32 or bf16
//!   rows, the bf16 rounding checked against a nearest-value search, in place or not,
//!   batches reading what earlier ones wrote, copies beside them) against a
//!   naive f32 loop, bit for bit, on the JIT and on the emulated device: the
//!   combine's and the all-reduce's arithmetic.
//! - The emulated device runs the bundle's compiled reshard (its IR built
//!   by `llc`) with the same result.

#![cfg(feature = "llvm")]
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::cpu_spec::{compile_text, cpu_deployment, imported_block};
use common::{nvcc, root, Rng};
use moeforge::plan::reshard::transfers;
use moeforge::runtime::device::emu::EmuDevice;
use moeforge::runtime::device::{Device, StridedCopy, Transfer};
use moeforge::runtime::twin::reshard::execute_reshard;
use moeforge::xfer::jit::{self, HostBuffer};
use moeforge::xfer::{Batch, Code, Elem, Program, Sum, SumShape};

fn random_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut g = moeforge::plan::rng::SplitMix64(rng.below(usize::MAX) as u64);
    let mut v: Vec<u8> = (0..n.div_ceil(8)).flat_map(|_| g.next_u64().to_le_bytes()).collect();
    v.truncate(n);
    v
}

/// Compiles `fixture` on `ranks` CPU ranks (a dual-mode plan) into a bundle.
fn bundle(fixture: &str, ranks: u32) -> moeforge::plan::LoadedBundle {
    let dir = root().join("tests/fixtures/models").join(fixture);
    // Room for the weights, and a small KV pool (random bytes fill it all).
    let fraction = if fixture.starts_with("deepseek") || fixture == "glm-5" { 0.6 } else { 0.3 };
    let text = cpu_deployment(&imported_block(&dir), ranks, fraction);
    let tmp = tempfile::tempdir().unwrap();
    compile_text(&text, tmp.path())
}

fn plan(fixture: &str, ranks: u32) -> moeforge::plan::Plan {
    bundle(fixture, ranks).plan.plan().clone()
}

#[test]
fn the_jit_reshard_equals_the_descriptor_interpreter_byte_for_byte() {
    let mut rng = Rng(0x005e_ed0f_7a5f);
    let mut checked = 0;
    for (fixture, ranks) in
        [("qwen3-moe", 2), ("qwen3-moe", 4), ("mixtral", 2), ("deepseek-v3", 4), ("glm-5", 2), ("qwen3-moe", 8)]
    {
        let plan = plan(fixture, ranks);
        let mem = &plan.memory;
        let rs = mem.reshard.as_ref().unwrap_or_else(|| panic!("{fixture}: single-mode: {:?}", mem.single_mode_reason));
        // Random bytes over each rank's whole buffer: every byte a copy
        // misses, or writes where it should not, shows.
        let init: Vec<Vec<u8>> = (0..ranks).map(|_| random_bytes(&mut rng, mem.buffer_bytes as usize)).collect();
        let mut twin = init.clone();
        let mut jit_bufs: Vec<HostBuffer> = init.iter().map(|b| HostBuffer::from_bytes(b)).collect();
        for w in [&rs.ep_to_tp, &rs.tp_to_ep] {
            let remote = execute_reshard(mem, w, &mut twin);
            let t = transfers(mem, rs).unwrap();
            let (program, batches) = (&t.program, t.batches(w.from));
            assert_eq!(batches.len(), mem.slots.moe_layers as usize, "{fixture}: one batch per MoE layer");
            assert!(remote > 0, "{fixture}: the reshard moves bytes between ranks");
            jit::run(program, batches, &mut jit_bufs).unwrap();
            for (r, (t, j)) in twin.iter().zip(&jit_bufs).enumerate() {
                let first = t.iter().zip(j.as_bytes()).position(|(a, b)| a != b);
                assert!(
                    first.is_none(),
                    "{fixture} P={ranks} {:?}→{:?}: rank {r} differs at byte {first:?}",
                    w.from,
                    w.to
                );
            }
            assert!(twin != init, "{fixture}: the reshard changed the buffers");
            checked += 1;
        }
    }
    assert_eq!(checked, 12);
}

/// A naive execution: batches in order, each copy's runs in order, each run
/// a copy of its bytes.
fn interpret(batches: &[Vec<Transfer>], bufs: &mut [Vec<u8>]) {
    for t in batches.iter().flatten() {
        let c = &t.copy;
        for a in 0..c.counts[0] {
            for b in 0..c.counts[1] {
                let s = (c.src_offset + a * c.src_strides[0] + b * c.src_strides[1]) as usize;
                let d = (c.dst_offset + a * c.dst_strides[0] + b * c.dst_strides[1]) as usize;
                let run = c.run_bytes as usize;
                let bytes = bufs[t.src as usize][s..s + run].to_vec();
                bufs[t.dst as usize][d..d + run].copy_from_slice(&bytes);
            }
        }
    }
}

/// Random batches on four buffers: even batches read buffers 0-1 and write
/// 2-3, odd batches the reverse (so a batch reads what the one before
/// wrote); each copy writes its own region (runs disjoint); shapes repeat
/// with new offsets; alignments from 1 to 16 bytes.
fn random_batches(rng: &mut Rng, size: u64) -> Vec<Vec<Transfer>> {
    let mut out = vec![];
    for batch in 0..1 + rng.below(3) {
        let (reads, writes) = if batch % 2 == 0 { ([0u32, 1], [2u32, 3]) } else { ([2, 3], [0, 1]) };
        let mut cursor = [0u64; 2];
        let mut copies: Vec<Transfer> = vec![];
        for _ in 0..1 + rng.below(6) {
            let align = [1u64, 2, 4, 8, 16][rng.below(5)];
            let shape = match copies.last() {
                Some(t) if rng.below(3) == 0 => t.copy,
                _ => {
                    let run = align * (1 + rng.below(6) as u64);
                    let counts = [1 + rng.below(4) as u64, 1 + rng.below(4) as u64];
                    let inner = rng.below(2);
                    let mut dst_strides = [0u64; 2];
                    dst_strides[inner] = run + align * rng.below(3) as u64;
                    dst_strides[1 - inner] =
                        (counts[inner] - 1) * dst_strides[inner] + run + align * rng.below(3) as u64;
                    let src_strides = [align * rng.below(12) as u64, align * rng.below(12) as u64];
                    StridedCopy { src_offset: 0, dst_offset: 0, run_bytes: run, counts, src_strides, dst_strides }
                }
            };
            let w = rng.below(2);
            let extent = |s: [u64; 2]| (shape.counts[0] - 1) * s[0] + (shape.counts[1] - 1) * s[1] + shape.run_bytes;
            let (src_ext, dst_ext) = (extent(shape.src_strides), extent(shape.dst_strides));
            let dst_offset = (cursor[w] + align * rng.below(3) as u64).next_multiple_of(16);
            if dst_offset + dst_ext > size {
                continue;
            }
            cursor[w] = dst_offset + dst_ext;
            let src_offset = (rng.below((size - src_ext) as usize + 1) as u64) / align * align;
            copies.push(Transfer {
                src: reads[rng.below(2)],
                dst: writes[w],
                copy: StridedCopy { src_offset, dst_offset, ..shape },
            });
        }
        out.push(copies);
    }
    out
}

#[test]
fn random_strided_programs_run_like_a_naive_copy() {
    let mut rng = Rng(0x00dd_ba11);
    let size = 4096u64;
    let mut pieces = std::collections::BTreeSet::new();
    for case in 0..60 {
        let batches = random_batches(&mut rng, size);
        let init: Vec<Vec<u8>> = (0..4).map(|_| random_bytes(&mut rng, size as usize)).collect();
        let mut want = init.clone();
        interpret(&batches, &mut want);
        let (program, built) = Program::build(&batches).unwrap();
        pieces.extend(program.shapes().iter().map(|s| s.piece));
        let mut got: Vec<HostBuffer> = init.iter().map(|b| HostBuffer::from_bytes(b)).collect();
        jit::run(&program, &built, &mut got).unwrap();
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!(w.as_slice() == g.as_bytes(), "case {case}: buffer {i} differs ({batches:?})");
        }
    }
    // Every piece width was generated and checked.
    assert_eq!(pieces.into_iter().collect::<Vec<_>>(), vec![1, 2, 4, 8, 16]);
}

#[test]
fn a_batch_outside_its_buffers_is_refused_before_anything_runs() {
    let c = StridedCopy {
        src_offset: 0,
        dst_offset: 64,
        run_bytes: 32,
        counts: [2, 2],
        src_strides: [64, 32],
        dst_strides: [128, 32],
    };
    let (program, batches) = Program::build(&[vec![Transfer { src: 0, dst: 1, copy: c }]]).unwrap();
    // The destination's last run ends at 64 + 128 + 32 + 32 = 256.
    let mut small = vec![HostBuffer::zeroed(256), HostBuffer::zeroed(255)];
    let e = jit::run(&program, &batches, &mut small).unwrap_err().to_string();
    assert!(e.contains("end past buffer 1"), "{e}");
    assert!(small[1].as_bytes().iter().all(|&b| b == 0), "nothing ran");
    let mut one = vec![HostBuffer::zeroed(512)];
    let e = jit::run(&program, &batches, &mut one).unwrap_err().to_string();
    assert!(e.contains("buffer 1 of 1 buffers"), "{e}");
    // A batch of another program (another number of shapes).
    let (other, _) = Program::build(&[vec![
        Transfer { src: 0, dst: 1, copy: c },
        Transfer { src: 0, dst: 1, copy: StridedCopy { run_bytes: 16, ..c } },
    ]])
    .unwrap();
    let mut two = vec![HostBuffer::zeroed(512), HostBuffer::zeroed(512)];
    let e = jit::run(&other, &batches, &mut two).unwrap_err().to_string();
    assert!(e.contains("shapes"), "{e}");
    // Overlapping destination runs and overflowing extents are refused when built.
    let overlap = StridedCopy { dst_strides: [16, 8], ..c };
    let e = Program::build(&[vec![Transfer { src: 0, dst: 1, copy: overlap }]]).unwrap_err().to_string();
    assert!(e.contains("may overlap"), "{e}");
    let huge = StridedCopy { counts: [3, 2], src_strides: [u64::MAX / 2, 0], ..c };
    let e = Program::build(&[vec![Transfer { src: 0, dst: 1, copy: huge }]]).unwrap_err().to_string();
    assert!(e.contains("overflows"), "{e}");
}

#[test]
fn the_transfer_programs_are_ptx_kernels_that_ptxas_assembles_without_spills() {
    let bundle = bundle("qwen3-moe", 4);
    assert_eq!(bundle.transfers.keys().collect::<Vec<_>>(), ["all_reduce", "combine", "dispatch", "reshard"]);
    let sums = |name: &str| bundle.transfers[name].program.sum_shapes().to_vec();
    // The combine: 0 to top-k (2) bf16 rows of the hidden size, and from
    // all 4 ranks gated on the token's 2 ids (a graph's decode dispatch on
    // fixed slots reaches all 4, more than top-k: its rows gated on the
    // device, one gated shape of a hidden row on 2 ids; its combine reads a
    // rank's row only where the same gate passes).
    let (hidden, k) = (u64::from(bundle.plan.plan().model.hidden), bundle.plan.plan().model.top_k);
    assert_eq!(k, 2);
    let sum = |sources, gate| SumShape { elems: hidden, sources, elem: Elem::Bf16, out: Elem::F32, gate };
    assert_eq!(sums("combine"), [sum(0, 0), sum(1, 0), sum(2, 0), sum(4, k)]);
    let gated = bundle.transfers["dispatch"].program.gated_shapes().to_vec();
    assert_eq!(gated.len(), 1, "{gated:?}");
    assert_eq!((gated[0].run_bytes, gated[0].ids), (hidden * 2, k), "{gated:?}");
    assert!(sums("all_reduce").iter().all(|s| s.sources == 4 && s.elem == Elem::F32 && s.out == Elem::F32));
    assert!(sums("all_reduce").iter().any(|s| s.elems == hidden), "the hidden rows' all-reduce");
    for (name, code) in &bundle.transfers {
        check_ptx(name, &code.program);
    }
}

fn check_ptx(name: &str, program: &Program) {
    let ptx = moeforge::xfer::ptx(program, "sm_90a").unwrap();
    assert!(ptx.contains(".target sm_90a"), "{}", &ptx[..ptx.len().min(400)]);
    assert!(ptx.contains(".entry moeforge_xfer("), "a kernel entry");
    // Same program, same bytes (bundles and caches rely on it).
    assert_eq!(ptx, moeforge::xfer::ptx(program, "sm_90a").unwrap());
    let Some(nvcc) = nvcc() else { return };
    let ptxas = nvcc.with_file_name("ptxas");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("xfer.ptx");
    std::fs::write(&file, &ptx).unwrap();
    let o = std::process::Command::new(&ptxas)
        .args(["-arch=sm_90a", "-v", "-o"])
        .arg(dir.path().join("xfer.cubin"))
        .arg(&file)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "ptxas refused {name}'s PTX:\n{log}");
    assert!(log.contains("Compiling entry function 'moeforge_xfer'"), "{log}");
    assert!(log.contains("0 bytes spill stores, 0 bytes spill loads"), "{log}");
}

/// Random exchanges (Zepp's slot swaps) against a naive swap: batches in
/// order on three buffers, each batch's exchanges disjoint (within one
/// buffer too), later batches trading bytes earlier ones moved, sizes and
/// offsets giving every piece width; on the JIT, and the ptxas check of
/// the GPU code. Then a Zepp bundle's `expert_swap` program: one exchange
/// shape per routed-expert view's slot, PTX that ptxas takes.
#[test]
fn random_exchanges_trade_bytes_like_a_naive_swap() {
    use moeforge::xfer::Exchange;
    let mut rng = Rng(0x5a4b_0b7e);
    let size = 4096u64;
    let mut pieces = std::collections::BTreeSet::new();
    for case in 0..60 {
        let mut batches: Vec<Vec<Exchange>> = vec![];
        for _ in 0..1 + rng.below(3) {
            // Disjoint sides: cut the three buffers into 256-byte cells and
            // give each exchange two unused cells.
            let mut free: Vec<(u32, u64)> = (0..3).flat_map(|b| (0..size / 256).map(move |c| (b, c * 256))).collect();
            let mut batch = vec![];
            for _ in 0..1 + rng.below(5) {
                let mut take = || free.swap_remove(rng.below(free.len()));
                let ((a, ao), (b, bo)) = (take(), take());
                let align = [1u64, 2, 4, 8, 16][rng.below(5)];
                let bytes = align * (1 + rng.below(12) as u64);
                let shift = align * rng.below(4) as u64;
                batch.push(Exchange { a, a_offset: ao + shift, b, b_offset: bo + shift, bytes });
            }
            batches.push(batch);
        }
        let init: Vec<Vec<u8>> = (0..3).map(|_| random_bytes(&mut rng, size as usize)).collect();
        let mut want = init.clone();
        for x in batches.iter().flatten() {
            let (a, b, n) = (x.a_offset as usize, x.b_offset as usize, x.bytes as usize);
            let (ta, tb) = (want[x.a as usize][a..a + n].to_vec(), want[x.b as usize][b..b + n].to_vec());
            want[x.a as usize][a..a + n].copy_from_slice(&tb);
            want[x.b as usize][b..b + n].copy_from_slice(&ta);
        }
        let program = Program::build(&[])
            .unwrap()
            .0
            .with_exchanges(batches.iter().flatten().map(|x| (x.bytes, x.a_offset | x.b_offset)));
        pieces.extend(program.exchange_shapes().iter().map(|s| s.piece));
        let built: Vec<Batch> = batches.iter().map(|b| program.exchange_batch(b).unwrap()).collect();
        let mut got: Vec<HostBuffer> = init.iter().map(|b| HostBuffer::from_bytes(b)).collect();
        jit::run(&program, &built, &mut got).unwrap();
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!(w.as_slice() == g.as_bytes(), "case {case}: buffer {i} differs ({batches:?})");
        }
        if case == 0 {
            check_ptx("random exchanges", &program);
        }
    }
    assert_eq!(pieces.into_iter().collect::<Vec<_>>(), vec![1, 2, 4, 8, 16]);
    let dir = root().join("tests/fixtures/models/qwen3-moe");
    let extra = "strategy = expertplex placement { policy = zepp redundant_experts = 4 }";
    let text = common::cpu_spec::cpu_cluster_deployment(&imported_block(&dir), 1, 4, 0.25, extra);
    let tmp = tempfile::tempdir().unwrap();
    let b = compile_text(&text, tmp.path());
    let code = &b.transfers["expert_swap"];
    // Qwen3-MoE (bf16, no expert biases): W13 and W2 slots.
    let plan = b.plan.plan();
    let (h, i) = (u64::from(plan.model.hidden), u64::from(plan.model.expert_ffn));
    let runs: Vec<u64> = code.program.exchange_shapes().iter().map(|s| s.run_bytes).collect();
    assert_eq!(runs, [2 * i * h * 2, h * i * 2]);
    check_ptx("expert_swap", &code.program);
}

/// Random gated copies (a dispatch's token rows that move only to a rank
/// computing one of their entries) against a naive gated copy: three
/// buffers, rows of every piece width, gates of 1 to 8 i32 ids (negative
/// ones, -1, among them) with random ranges; beside ungated copies in the
/// same batch; on the JIT, and the ptxas check of the GPU code. Some gates
/// pass and some do not, or the check would prove nothing.
#[test]
fn random_gated_copies_move_a_row_only_when_its_gate_passes() {
    use moeforge::xfer::{Gate, GatedCopy};
    let mut rng = Rng(0x6a7e_d0c5);
    let size = 8192u64;
    let (mut passed, mut stopped) = (0, 0);
    for case in 0..60 {
        let ids = 1 + rng.below(8) as u32;
        let align = [1u64, 2, 4, 8, 16][rng.below(5)];
        // At most 208 bytes, shifted at most 48: a row stays in its cell.
        let bytes = align * (1 + rng.below(13) as u64);
        // Cells of 256 bytes: rows written into distinct cells, gates read
        // from buffer 2's first 2048 bytes, never written.
        let mut free: Vec<(u32, u64)> = (0..2).flat_map(|b| (0..size / 256).map(move |c| (b, c * 256))).collect();
        let mut init: Vec<Vec<u8>> = (0..3).map(|_| random_bytes(&mut rng, size as usize)).collect();
        let gate_words: Vec<i32> = (0..512).map(|_| rng.below(40) as i32 - 4).collect();
        for (i, w) in gate_words.iter().enumerate() {
            init[2][4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
        }
        let (mut gated, mut plain) = (vec![], vec![]);
        for _ in 0..1 + rng.below(12) {
            let mut take = || free.swap_remove(rng.below(free.len()));
            let ((sb, so), (db, d_o)) = (take(), take());
            let shift = align * rng.below(4) as u64;
            let copy = StridedCopy::one_run(so + shift, d_o + shift, bytes);
            let transfer = Transfer { src: sb, dst: db, copy };
            if rng.below(4) == 0 {
                plain.push(transfer);
                continue;
            }
            let lo = rng.below(40) as i32 - 4;
            let gate =
                Gate { buf: 2, offset: 4 * rng.below(512 - ids as usize) as u64, lo, hi: lo + rng.below(10) as i32 };
            gated.push(GatedCopy { transfer, gate });
        }
        let mut want = init.clone();
        for t in &plain {
            let (a, b, n) = (t.copy.src_offset as usize, t.copy.dst_offset as usize, bytes as usize);
            let row = want[t.src as usize][a..a + n].to_vec();
            want[t.dst as usize][b..b + n].copy_from_slice(&row);
        }
        for g in &gated {
            let at = (g.gate.offset / 4) as usize;
            let pass = gate_words[at..at + ids as usize].iter().any(|&id| g.gate.lo <= id && id < g.gate.hi);
            if !pass {
                stopped += 1;
                continue;
            }
            passed += 1;
            let t = &g.transfer;
            let (a, b, n) = (t.copy.src_offset as usize, t.copy.dst_offset as usize, bytes as usize);
            let row = want[t.src as usize][a..a + n].to_vec();
            want[t.dst as usize][b..b + n].copy_from_slice(&row);
        }
        let offsets = gated.iter().fold(0, |o, g| o | g.transfer.copy.src_offset | g.transfer.copy.dst_offset);
        let (program, _) = Program::build(&[plain.clone()]).unwrap();
        let program = program.with_gated([(bytes, offsets, ids)]);
        let batch = program.batch_gated(&plain, &gated, ids).unwrap();
        let mut got: Vec<HostBuffer> = init.iter().map(|b| HostBuffer::from_bytes(b)).collect();
        jit::run(&program, &[batch], &mut got).unwrap();
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!(w.as_slice() == g.as_bytes(), "case {case}: buffer {i} differs ({gated:?})");
        }
        if case == 0 {
            check_ptx("random gated copies", &program);
        }
    }
    assert!(passed > 50 && stopped > 50, "gates passed {passed}, stopped {stopped}");
}

#[test]
fn the_emulated_device_runs_the_bundles_reshard_program_like_the_interpreter() {
    let bundle = bundle("mixtral", 2);
    // The bundle's compiled code is the program its descriptors make.
    let code = bundle.transfers["reshard"].clone();
    let plan = bundle.plan.plan();
    let mem = &plan.memory;
    let rs = mem.reshard.as_ref().unwrap();
    let mut rng = Rng(77);
    let init: Vec<Vec<u8>> = (0..2).map(|_| random_bytes(&mut rng, mem.buffer_bytes as usize)).collect();
    let mut twin = init.clone();
    execute_reshard(mem, &rs.tp_to_ep, &mut twin);
    let cache = tempfile::tempdir().unwrap();
    let mut dev = EmuDevice::start(cache.path()).unwrap();
    let ids: Vec<_> = init
        .iter()
        .map(|b| {
            let id = dev.alloc(b.len() as u64).unwrap();
            dev.upload(id, 0, b).unwrap();
            id
        })
        .collect();
    let t = transfers(mem, rs).unwrap();
    assert_eq!(t.program, code.program);
    assert_eq!(code.ptx, moeforge::xfer::ptx(&t.program, "sm_90a").unwrap(), "the bundle's PTX");
    assert_eq!(code.host_ir, moeforge::xfer::host_ir(&t.program).unwrap(), "the bundle's IR");
    let batches = t.batches(moeforge::plan::memory::Mode::Tp);
    dev.transfer(&code, batches, &ids).unwrap();
    for (r, id) in ids.iter().enumerate() {
        let got = dev.download(*id, 0, mem.buffer_bytes).unwrap();
        assert!(got == twin[r], "rank {r} differs from the interpreter");
    }
    // A batch that does not fit the device's buffers is an error, not a fault.
    let e = dev.transfer(&code, batches, &ids[..1]).unwrap_err().to_string();
    assert!(e.contains("buffer 1 of 1 buffers"), "{e}");
    let empty: Vec<Batch> = vec![];
    dev.transfer(&code, &empty, &ids).unwrap();
}

/// bf16 bits widened to f32 (exact).
fn widen(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// The bf16 nearest to `x`, ties to the even one, by search: the two bf16
/// values around x (truncation, and the next one away from zero), compared
/// by distance in f64, infinity standing at 2^128 (IEEE's overflow rule:
/// what rounds past the largest finite value by half an ulp is infinite).
fn nearest_bf16(x: f32) -> u16 {
    if x.is_nan() {
        return ((x.to_bits() >> 16) as u16) | 0x40;
    }
    if x.is_infinite() {
        return (x.to_bits() >> 16) as u16;
    }
    let down = (x.to_bits() >> 16) as u16;
    let up = down.wrapping_add(1);
    let value = |b: u16| {
        let v = f64::from(widen(b));
        if v.is_infinite() {
            2f64.powi(128).copysign(v)
        } else {
            v
        }
    };
    let (dd, du) = ((value(down) - f64::from(x)).abs(), (value(up) - f64::from(x)).abs());
    if dd < du || (dd == du && down.is_multiple_of(2)) {
        down
    } else {
        up
    }
}

/// A naive execution of sums: sum by sum, element by element, each source
/// added in order to an f32 that starts at +0.0.
fn add_naively(sums: &[Sum], bufs: &mut [Vec<u8>]) {
    for s in sums {
        // A gated sum's sources whose range holds none of the gate's ids.
        let skipped: Vec<bool> = match &s.gate {
            None => vec![false; s.sources.len()],
            Some(g) => {
                let b = &bufs[g.buf as usize];
                let ids: Vec<i32> = (0..g.ids as usize)
                    .map(|j| {
                        let at = g.offset as usize + 4 * j;
                        i32::from_le_bytes(b[at..at + 4].try_into().unwrap())
                    })
                    .collect();
                g.ranges.iter().map(|&(lo, hi)| !ids.iter().any(|&id| lo <= id && id < hi)).collect()
            }
        };
        for e in 0..s.elems as usize {
            let mut acc = 0.0f32;
            for (&(src, off), _) in s.sources.iter().zip(&skipped).filter(|(_, &skip)| !skip) {
                let b = &bufs[src as usize];
                let at = off as usize;
                acc += match s.elem {
                    Elem::Bf16 => widen(u16::from_le_bytes([b[at + 2 * e], b[at + 2 * e + 1]])),
                    Elem::F32 => f32::from_le_bytes(b[at + 4 * e..at + 4 * e + 4].try_into().unwrap()),
                };
            }
            match s.out {
                Elem::F32 => {
                    let at = s.dst_offset as usize + 4 * e;
                    bufs[s.dst as usize][at..at + 4].copy_from_slice(&acc.to_le_bytes());
                }
                Elem::Bf16 => {
                    let at = s.dst_offset as usize + 2 * e;
                    bufs[s.dst as usize][at..at + 2].copy_from_slice(&nearest_bf16(acc).to_le_bytes());
                }
            }
        }
    }
}

/// Buffers of finite values however they are read: random bf16 bit
/// patterns with exponents kept away from 0xff, so every 4 bytes read as an
/// f32 are finite too (their upper half is one of them). One in eight is
/// ±0 and one in eight subnormal: a sum must start from +0.0 (a −0.0 start
/// or none at all gives −0.0 where the sources are all −0.0) and keep
/// subnormals (no flush to zero).
fn finite_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n / 2)
        .flat_map(|_| {
            let sign = (rng.below(2) as u16) << 15;
            let exponent = match rng.below(8) {
                0 => 0,
                1 => return (sign | (1 + rng.below(127) as u16)).to_le_bytes(),
                _ => (100 + rng.below(50) as u16) << 7,
            };
            let mantissa = if exponent == 0 { 0 } else { rng.below(128) as u16 };
            (sign | exponent | mantissa).to_le_bytes()
        })
        .collect()
}

/// Random batches of sums on four buffers, as `random_batches`' copies:
/// even batches read buffers 0-1 and write 2-3, odd ones the reverse; each
/// sum writes its own row; an f32 sum may list its own destination among
/// its sources (in place, as the all-reduce's reduce-scatter does); a copy
/// may sit in the same batch, writing rows no sum reads.
fn random_sums(rng: &mut Rng, size: u64) -> Vec<(Vec<Transfer>, Vec<Sum>)> {
    let mut out = vec![];
    for batch in 0..1 + rng.below(3) {
        let (reads, writes) = if batch % 2 == 0 { ([0u32, 1], [2u32, 3]) } else { ([2, 3], [0, 1]) };
        let mut cursor = [0u64; 2];
        let (mut sums, mut copies) = (vec![], vec![]);
        for _ in 0..1 + rng.below(6) {
            let elem = if rng.below(2) == 0 { Elem::Bf16 } else { Elem::F32 };
            let into = if rng.below(3) == 0 { Elem::Bf16 } else { Elem::F32 };
            let elems = 1 + rng.below(40) as u64;
            let w = rng.below(2);
            let dst_offset = (cursor[w] + 4 * rng.below(3) as u64).next_multiple_of(4);
            if dst_offset + into.bytes() * elems > size {
                continue;
            }
            cursor[w] = dst_offset + into.bytes() * elems;
            let span = elems * elem.bytes();
            let mut sources: Vec<(u32, u64)> = (0..rng.below(5))
                .map(|_| {
                    let at = rng.below((size - span) as usize + 1) as u64 / elem.bytes() * elem.bytes();
                    (reads[rng.below(2)], at)
                })
                .collect();
            if elem == Elem::F32 && into == Elem::F32 && rng.below(3) == 0 {
                let at = rng.below(sources.len() + 1);
                sources.insert(at, (writes[w], dst_offset));
            }
            sums.push(Sum { dst: writes[w], dst_offset, sources, elems, elem, out: into, gate: None });
        }
        if rng.below(2) == 0 {
            // A copy between two read-side buffers' regions no sum reads is
            // impossible here; write past the sums instead, from a read buffer.
            let w = rng.below(2);
            let dst_offset = cursor[w].next_multiple_of(16);
            if dst_offset + 64 <= size {
                let src_offset = rng.below((size - 64) as usize) as u64 / 16 * 16;
                copies.push(Transfer {
                    src: reads[rng.below(2)],
                    dst: writes[w],
                    copy: StridedCopy::one_run(src_offset, dst_offset, 64),
                });
            }
        }
        out.push((copies, sums));
    }
    out
}

/// The program of `batches`: a copy shape for 64-byte rows, every sum's shape.
fn sum_program(batches: &[(Vec<Transfer>, Vec<Sum>)]) -> Program {
    let (program, _) =
        Program::build(&[vec![Transfer { src: 0, dst: 1, copy: StridedCopy::one_run(0, 0, 64) }]]).unwrap();
    program.with_sums(batches.iter().flat_map(|(_, s)| s).map(|s| SumShape {
        elems: s.elems,
        sources: s.sources.len() as u32,
        elem: s.elem,
        out: s.out,
        gate: s.gate.as_ref().map_or(0, |g| g.ids),
    }))
}

#[test]
fn random_sum_programs_add_like_a_naive_f32_loop_bit_for_bit() {
    let mut rng = Rng(0x5u64 << 40 | 0xadd);
    let size = 2048u64;
    let (mut in_place, mut total, mut bf16_out, mut sources) = (0, 0, 0, std::collections::BTreeSet::new());
    for case in 0..60 {
        let batches = random_sums(&mut rng, size);
        let init: Vec<Vec<u8>> = (0..4).map(|_| finite_bytes(&mut rng, size as usize)).collect();
        let mut want = init.clone();
        for (copies, sums) in &batches {
            interpret(std::slice::from_ref(copies), &mut want);
            add_naively(sums, &mut want);
            total += sums.len();
            in_place += sums.iter().filter(|s| s.sources.contains(&(s.dst, s.dst_offset))).count();
            sources.extend(sums.iter().map(|s| (s.sources.len(), s.elem)));
            bf16_out += sums.iter().filter(|s| s.out == Elem::Bf16).count();
        }
        let program = sum_program(&batches);
        let built: Vec<Batch> = batches.iter().map(|(c, s)| program.batch_with_sums(c, s).unwrap()).collect();
        let mut got: Vec<HostBuffer> = init.iter().map(|b| HostBuffer::from_bytes(b)).collect();
        jit::run(&program, &built, &mut got).unwrap();
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            let first = w.iter().zip(g.as_bytes()).position(|(a, b)| a != b);
            assert!(first.is_none(), "case {case}: buffer {i} differs at byte {first:?}");
        }
    }
    assert!(in_place > 10 && bf16_out > 50 && total > 200, "{in_place} in-place and {bf16_out} bf16 sums of {total}");
    // Every source count 0..=4 was generated with each element type (an
    // in-place sum adds a fifth f32 source).
    for n in 0..=4 {
        assert!(sources.contains(&(n, Elem::Bf16)) && sources.contains(&(n, Elem::F32)), "{n} sources: {sources:?}");
    }
}

/// Random gated sums (a fixed-slot combine over more ranks than top-k: a
/// token's rows from every rank holding experts, each read only where the
/// rank holds one of the token's top-k ids) against a naive loop that skips
/// the gated-out sources; and against the same sums ungated with each
/// gated-out source pointed at a +0.0 row, which must give the same bits
/// (what the executor relies on: a rank serving none of a token's entries
/// computes +0.0 for it). Sources of bf16 with ±0 and subnormals among them,
/// 2 to 6 sources, gates of 1 to 8 i32 ids (negative ones among them), f32
/// and bf16 outputs; on the JIT, and the ptxas check of the GPU code. Some
/// sources pass and some do not, or the check would prove nothing.
#[test]
fn random_gated_sums_read_a_source_only_where_its_gate_passes() {
    use moeforge::xfer::SumGate;
    let mut rng = Rng(0x9a7e_d505);
    let size = 4096u64;
    let (mut read, mut skipped) = (0, 0);
    for case in 0..60 {
        let ids = 1 + rng.below(8) as u32;
        let n = 2 + rng.below(5) as u32;
        let elems = 1 + rng.below(40) as u64;
        let out = if rng.below(3) == 0 { Elem::Bf16 } else { Elem::F32 };
        // Buffers 0-1: sources; 2: destinations; 3: the gates' ids (words
        // of -4..36) and, at its end, a +0.0 row.
        let mut init: Vec<Vec<u8>> = (0..3).map(|_| finite_bytes(&mut rng, size as usize)).collect();
        let words: Vec<i32> = (0..512).map(|_| rng.below(40) as i32 - 4).collect();
        let mut gates: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let zero_row = gates.len() as u64;
        gates.resize(gates.len() + 2 * elems as usize, 0);
        init.push(gates);
        let mut sums = vec![];
        for row in 0..1 + rng.below(8) as u64 {
            let span = elems * 2;
            let sources: Vec<(u32, u64)> =
                (0..n).map(|_| (rng.below(2) as u32, rng.below((size - span) as usize / 2) as u64 * 2)).collect();
            let ranges = (0..n)
                .map(|_| {
                    let lo = rng.below(40) as i32 - 4;
                    (lo, lo + rng.below(10) as i32)
                })
                .collect();
            let gate = SumGate { buf: 3, offset: 4 * rng.below(512 - ids as usize) as u64, ids, ranges };
            let dst_offset = row * 4 * 64;
            sums.push(Sum { dst: 2, dst_offset, sources, elems, elem: Elem::Bf16, out, gate: Some(gate) });
        }
        let mut want = init.clone();
        add_naively(&sums, &mut want);
        // The same sums ungated, a gated-out source reading the +0.0 row.
        let zeroed: Vec<Sum> = sums
            .iter()
            .map(|s| {
                let g = s.gate.as_ref().unwrap();
                let at = (g.offset / 4) as usize;
                let held = &words[at..at + ids as usize];
                let sources = s
                    .sources
                    .iter()
                    .zip(&g.ranges)
                    .map(|(&x, &(lo, hi))| {
                        if held.iter().any(|&id| lo <= id && id < hi) {
                            read += 1;
                            x
                        } else {
                            skipped += 1;
                            (3, zero_row)
                        }
                    })
                    .collect();
                Sum { sources, gate: None, ..s.clone() }
            })
            .collect();
        let (program, _) = Program::build(&[]).unwrap();
        let gated_shape = SumShape { elems, sources: n, elem: Elem::Bf16, out, gate: ids };
        let program = program.with_sums([gated_shape, SumShape { gate: 0, ..gated_shape }]);
        let run = |sums: &[Sum]| {
            let batch = program.batch_with_sums(&[], sums).unwrap();
            let mut got: Vec<HostBuffer> = init.iter().map(|b| HostBuffer::from_bytes(b)).collect();
            jit::run(&program, &[batch], &mut got).unwrap();
            got
        };
        let (gated, plain) = (run(&sums), run(&zeroed));
        for (i, w) in want.iter().enumerate() {
            let first = w.iter().zip(gated[i].as_bytes()).position(|(a, b)| a != b);
            assert!(first.is_none(), "case {case}: buffer {i} differs from the naive loop at byte {first:?}");
            assert!(gated[i].as_bytes() == plain[i].as_bytes(), "case {case}: buffer {i}: skipping is not +0.0");
        }
        if case == 0 {
            check_ptx("random gated sums", &program);
        }
    }
    assert!(read > 100 && skipped > 100, "sources read {read}, skipped {skipped}");
}

/// The bf16 output's rounding at its edges, on the JIT and through ptxas:
/// ties to even either way, negative ties, the largest finite values and
/// the overflow to infinity, infinities, NaNs (kept, quiet) and subnormals,
/// each an f32 summed from one source (+0.0 + x = x, exactly) and rounded.
#[test]
fn the_bf16_rounding_matches_a_nearest_value_search_at_its_edges() {
    let cases: [u32; 14] = [
        0x3f80_8000, // 1.00390625: a tie, to the even 1.0
        0x3f81_8000, // a tie, to the even above
        0xbf80_8000, // a negative tie
        0x3f80_8001, // just past a tie
        0x7f7f_7fff, // below the largest bf16's half ulp: stays finite
        0x7f7f_8000, // a tie at the largest bf16: to the even infinity
        0x7f7f_ffff, // the largest f32: infinity
        0xff7f_ffff,
        0x7f80_0000, // infinities stay
        0xff80_0000,
        0x7f80_0001, // a signalling NaN comes out quiet
        0xffc0_1234,
        0x0000_8001, // subnormals round like normals
        0x8001_7fff,
    ];
    let bytes: Vec<u8> = cases.iter().flat_map(|c| c.to_le_bytes()).collect();
    let n = cases.len() as u64;
    let sum =
        Sum { dst: 1, dst_offset: 0, sources: vec![(0, 0)], elems: n, elem: Elem::F32, out: Elem::Bf16, gate: None };
    let (program, _) = Program::build(&[]).unwrap();
    let program = program.with_sums([SumShape { elems: n, sources: 1, elem: Elem::F32, out: Elem::Bf16, gate: 0 }]);
    check_ptx("bf16 sums", &program);
    let batch = program.batch_with_sums(&[], std::slice::from_ref(&sum)).unwrap();
    let mut bufs = vec![HostBuffer::from_bytes(&bytes), HostBuffer::zeroed(2 * n as usize)];
    jit::run(&program, &[batch], &mut bufs).unwrap();
    let got: Vec<u16> = bufs[1].as_bytes().chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    let want: Vec<u16> = cases.iter().map(|&c| nearest_bf16(f32::from_bits(c))).collect();
    assert_eq!(got, want);
    // The search's own answers at the edges, by hand.
    assert_eq!(&want[..7], &[0x3f80, 0x3f82, 0xbf80, 0x3f81, 0x7f7f, 0x7f80, 0x7f80]);
    assert_eq!(want[10], 0x7fc0, "a signalling NaN, quieted");
}

#[test]
fn sums_the_code_cannot_run_are_refused_before_anything_runs() {
    let shape = SumShape { elems: 8, sources: 2, elem: Elem::Bf16, out: Elem::F32, gate: 0 };
    let (program, _) = Program::build(&[]).unwrap();
    let program = program.with_sums([shape]);
    let sum = |dst_offset: u64, at: u64| Sum {
        dst: 1,
        dst_offset,
        sources: vec![(0, 0), (0, at)],
        elems: 8,
        elem: Elem::Bf16,
        out: Elem::F32,
        gate: None,
    };
    let e = program.batch_with_sums(&[], &[Sum { elems: 9, ..sum(0, 16) }]).unwrap_err().to_string();
    assert!(e.starts_with("sum 0:") && e.contains("no sum of this program"), "{e}");
    let e = program.batch_with_sums(&[], &[sum(0, 16), sum(2, 16)]).unwrap_err().to_string();
    assert!(e.starts_with("sum 1:") && e.contains("multiple of 4"), "{e}");
    let e = program.batch_with_sums(&[], &[sum(0, 3)]).unwrap_err().to_string();
    assert!(e.contains("source offset 3"), "{e}");
    // A destination row ends at 32 + 8 · 4 = 64; a source at 48 + 16 = 64.
    let batch = program.batch_with_sums(&[], &[sum(32, 48)]).unwrap();
    let mut fits = vec![HostBuffer::zeroed(64), HostBuffer::zeroed(64)];
    jit::run(&program, std::slice::from_ref(&batch), &mut fits).unwrap();
    for (sizes, what) in [([63usize, 64], "sum source"), ([64, 63], "sum destination")] {
        let mut small = vec![HostBuffer::zeroed(sizes[0]), HostBuffer::zeroed(sizes[1])];
        let e = jit::run(&program, std::slice::from_ref(&batch), &mut small).unwrap_err().to_string();
        assert!(e.contains(what) && e.contains("ends past"), "{e}");
    }
    // A batch of the program before it had sums.
    let (bare, old) = Program::build(&[vec![]]).unwrap();
    let e = jit::run(&bare.with_sums([shape]), &old, &mut fits).unwrap_err().to_string();
    assert!(e.contains("sum shapes"), "{e}");
    // Gated sums: a gate the shape does not have (or none where it has one),
    // a range per source, ids 4-byte aligned and inside their buffer.
    use moeforge::xfer::SumGate;
    let gated_shape = SumShape { gate: 2, ..shape };
    let program = Program::build(&[]).unwrap().0.with_sums([gated_shape]);
    let gate = |offset: u64, ranges: usize| Some(SumGate { buf: 1, offset, ids: 2, ranges: vec![(0, 4); ranges] });
    let gated = |offset: u64, ranges: usize| Sum { gate: gate(offset, ranges), ..sum(32, 48) };
    let e = program.batch_with_sums(&[], &[sum(32, 48)]).unwrap_err().to_string();
    assert!(e.contains("no sum of this program"), "{e}");
    let e = program.batch_with_sums(&[], &[gated(0, 1)]).unwrap_err().to_string();
    assert!(e.contains("1 ranges for 2 sources"), "{e}");
    let e = program.batch_with_sums(&[], &[gated(2, 2)]).unwrap_err().to_string();
    assert!(e.contains("4-byte aligned"), "{e}");
    let three = Sum { gate: Some(SumGate { ids: 3, ..gate(0, 2).unwrap() }), ..sum(32, 48) };
    let e = program.batch_with_sums(&[], &[three]).unwrap_err().to_string();
    assert!(e.contains("gated on 3 ids"), "{e}");
    // Two ids at 56 end at 64; at 60 they end past buffer 1.
    let batch = program.batch_with_sums(&[], &[gated(56, 2)]).unwrap();
    let mut fits = vec![HostBuffer::zeroed(64), HostBuffer::zeroed(64)];
    jit::run(&program, std::slice::from_ref(&batch), &mut fits).unwrap();
    let batch = program.batch_with_sums(&[], &[gated(60, 2)]).unwrap();
    let e = jit::run(&program, std::slice::from_ref(&batch), &mut fits).unwrap_err().to_string();
    assert!(e.contains("sum gate") && e.contains("buffer 1"), "{e}");
}

#[test]
fn the_emulated_device_runs_sums_like_a_naive_f32_loop() {
    let mut rng = Rng(0x00c0_ffee);
    let size = 2048u64;
    let batches = loop {
        let b = random_sums(&mut rng, size);
        if b.iter().map(|(_, s)| s.len()).sum::<usize>() >= 6 {
            break b;
        }
    };
    let program = sum_program(&batches);
    check_ptx("random sums", &program);
    let code = Code::new(
        program.clone(),
        moeforge::xfer::ptx(&program, "sm_90a").unwrap(),
        moeforge::xfer::host_ir(&program).unwrap(),
    )
    .unwrap();
    let init: Vec<Vec<u8>> = (0..4).map(|_| finite_bytes(&mut rng, size as usize)).collect();
    let mut want = init.clone();
    for (copies, sums) in &batches {
        interpret(std::slice::from_ref(copies), &mut want);
        add_naively(sums, &mut want);
    }
    let cache = tempfile::tempdir().unwrap();
    let mut dev = EmuDevice::start(cache.path()).unwrap();
    let ids: Vec<_> = init
        .iter()
        .map(|b| {
            let id = dev.alloc(size).unwrap();
            dev.upload(id, 0, b).unwrap();
            id
        })
        .collect();
    let built: Vec<Batch> = batches.iter().map(|(c, s)| program.batch_with_sums(c, s).unwrap()).collect();
    dev.transfer(&code, &built, &ids).unwrap();
    for (i, id) in ids.iter().enumerate() {
        assert!(dev.download(*id, 0, size).unwrap() == want[i], "buffer {i} differs from the naive sums");
    }
}

/// The emulated device's side stream (what Zepp's swaps run on): side
/// transfers run in the order they were queued, beside the main stream,
/// and a wait returns once its transfer and every earlier one finished.
/// The second transfer reads what the first wrote, so only that order
/// gives these bytes; a wait on an event never queued is an error.
#[test]
fn the_side_stream_runs_its_transfers_in_queue_order() {
    use moeforge::runtime::device::SideEvent;
    let run = |src: u64, dst: u64| StridedCopy::one_run(src, dst, 64);
    let (program, built) = Program::build(&[
        vec![Transfer { src: 0, dst: 1, copy: run(0, 0) }],
        vec![Transfer { src: 1, dst: 0, copy: run(0, 64) }],
    ])
    .unwrap();
    let code = Code::new(
        program.clone(),
        moeforge::xfer::ptx(&program, "sm_90a").unwrap(),
        moeforge::xfer::host_ir(&program).unwrap(),
    )
    .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let mut dev = EmuDevice::start(cache.path()).unwrap();
    let mut rng = Rng(5);
    let first = random_bytes(&mut rng, 64);
    let ids = [dev.alloc(128).unwrap(), dev.alloc(64).unwrap()];
    let untouched = dev.alloc(64).unwrap();
    dev.upload(ids[0], 0, &first).unwrap();
    let a = dev.side_transfer(&code, &built[..1], &ids).unwrap();
    let b = dev.side_transfer(&code, &built[1..], &ids).unwrap();
    assert!(a < b, "{a:?} {b:?}");
    // The main stream goes on meanwhile, on bytes no side transfer touches:
    // a write and a main-stream transfer (buffer 0's first run into the
    // untouched buffer, which the side transfers only read).
    let other = random_bytes(&mut rng, 64);
    dev.upload(untouched, 0, &other).unwrap();
    assert_eq!(dev.download(untouched, 0, 64).unwrap(), other);
    dev.transfer(&code, &built[..1], &[ids[0], untouched]).unwrap();
    assert_eq!(dev.download(untouched, 0, 64).unwrap(), first);
    dev.side_wait(b).unwrap();
    assert_eq!(dev.download(ids[0], 64, 64).unwrap(), first, "buffer 0's second run is its first, through buffer 1");
    assert_eq!(dev.download(ids[1], 0, 64).unwrap(), first);
    // Waiting again, or on the earlier event, returns at once.
    dev.side_wait(a).unwrap();
    let e = dev.side_wait(SideEvent(b.0 + 1)).unwrap_err().to_string();
    assert!(e.contains("no side transfer"), "{e}");
    // A side batch that does not fit the buffers is refused before it is queued.
    let e = dev.side_transfer(&code, &built[..1], &ids[..1]).unwrap_err().to_string();
    assert!(e.contains("buffer 1 of 1 buffers"), "{e}");
}
