//! The per-rank programs: every example's programs verify, they express
//! the overlaps the papers describe (TBO, SBO, communication beside
//! compute), TP's collectives are the ones tensor parallelism needs, and
//! the verifier catches each kind of broken program.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use moeforge_codegen::plan_deployment;
use moeforge_dsl::{check_paths, FsLoader};
use moeforge_plan::memory::{BufferName, Mode, TensorPart, TensorRole};
use moeforge_plan::program::*;
use moeforge_plan::validate::check;
use moeforge_plan::Plan;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn plan_of(path: &Path) -> Plan {
    let c = check_paths(&[path.to_path_buf()], &FsLoader).unwrap_or_else(|e| panic!("{}: {e:?}", path.display()));
    let id = c.spec.deploy_ids().next().unwrap();
    plan_deployment(&c, id).unwrap_or_else(|e| panic!("{}: {e:?}", path.display())).plan().clone()
}

fn example(name: &str) -> Plan {
    plan_of(&root().join("examples").join(format!("{name}.moe")))
}

/// An example whose strategy is `expertplex` or `pd-disagg` (a role plan,
/// no programs yet), planned colocated instead: the same model, cluster and tiles.
fn colocated(name: &str) -> Plan {
    let text = std::fs::read_to_string(root().join("examples").join(format!("{name}.moe"))).unwrap();
    assert!(text.contains("strategy = expertplex") || text.contains("strategy = pd-disagg"), "{name}");
    let text = text
        .replace("strategy = expertplex", "strategy = colocated")
        .replace("strategy = pd-disagg", "strategy = colocated")
        .replace("use \"../models/", &format!("use \"{}/models/", root().display()));
    // Each call its own directory: tests run in parallel threads of one process.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{name}.moe"));
    std::fs::write(&path, text).unwrap();
    plan_of(&path)
}

/// MiniMax-M2's shapes (all-head QK-norm) with bf16 weights (dual-mode
/// expert slots need bf16) in a switching deployment, so the plan holds TP.
fn minimax_dual() -> Plan {
    let dir = tempfile::tempdir().unwrap();
    let model = std::fs::read_to_string(root().join("models/minimax-m2.moe")).unwrap();
    let model = model.replace("weights = fp8_e4m3  block_scale = [128, 128]", "weights = bf16");
    assert!(model.contains("weights = bf16"));
    let text = format!(
        "{model}\nuse \"{m}/clusters.moe\"\nuse \"{m}/tiles.moe\"\n\
         deploy mm {{\n  model = minimax-m2\n  cluster = h200x8\n  tiles = hopper-bf16\n  slo {{ ttft = 1s  tpot = 50ms }}\n  \
         workload {{ input = sharegpt  output = sharegpt  arrival poisson {{ rate = 4req/s }} }}\n  \
         switch {{ t_high = 256  t_low = 204  window = 64  cooldown = 5s }}\n  memory_fraction = 0.9\n}}\n",
        m = root().join("models").display()
    );
    let path = dir.path().join("mm.moe");
    std::fs::write(&path, text).unwrap();
    let p = plan_of(&path);
    assert_eq!(p.memory.modes, [Mode::Tp, Mode::Ep], "{:?}", p.memory.single_mode_reason);
    p
}

fn program(p: &Plan, mode: Mode, phase: Phase) -> &Program {
    p.programs.iter().find(|q| q.mode == mode && q.phase == phase).unwrap()
}

fn op_index(p: &Program, name: &str) -> (usize, usize) {
    for (bi, b) in p.blocks.iter().enumerate() {
        // A micro-batched program names its ops `name.0`, `name.1`, …: the first.
        let first = format!("{name}.0");
        if let Some(oi) = b.ops.iter().position(|o| o.name == name || o.name == first) {
            return (bi, oi);
        }
    }
    panic!("no op {name}")
}

/// The issued instance of op `name` at `layer`.
fn issued<'a>(all: &'a [Issued], p: &Program, name: &str, layer: u32) -> &'a Issued {
    let (b, o) = op_index(p, name);
    all.iter().find(|i| i.block == b && i.op == o && i.layer == layer).unwrap()
}

fn concurrent(a: &Issued, b: &Issued) -> bool {
    !a.happens_before(b) && !b.happens_before(a)
}

fn findings(p: &Plan) -> Vec<String> {
    check(p).into_iter().map(|v| v.to_string()).collect()
}

#[test]
fn every_example_has_verified_programs_for_each_mode_and_phase() {
    let mut n = 0;
    for e in std::fs::read_dir(root().join("examples")).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_none_or(|x| x != "moe") {
            continue;
        }
        let p = plan_of(&path);
        if let Some(roles) = &p.roles {
            // A role plan: each GPU runs its role's programs (the validator
            // checks who runs which phase as what), and every one verifies.
            assert!(findings(&p).is_empty(), "{}: {:?}", path.display(), findings(&p));
            for g in 0..roles.gpus.len() as u32 {
                assert!(p.programs.iter().any(|q| q.ranks.contains(&g)), "{}: GPU {g} runs nothing", path.display());
            }
            n += 1;
            continue;
        }
        for &mode in &p.memory.modes {
            for phase in [Phase::Prefill, Phase::Decode] {
                let mut ranks: Vec<u32> = p
                    .programs
                    .iter()
                    .filter(|q| q.mode == mode && q.phase == phase)
                    .flat_map(|q| q.ranks.clone())
                    .collect();
                ranks.sort_unstable();
                assert_eq!(ranks, (0..p.cluster.world).collect::<Vec<_>>(), "{}: {mode:?} {phase:?}", path.display());
            }
        }
        assert!(findings(&p).is_empty(), "{}: {:?}", path.display(), findings(&p));
        n += 1;
    }
    assert!(n >= 8, "only {n} examples");
}

/// ExpertPlex §6.3 / SGLang's TBO: micro-batch 1's attention runs while
/// micro-batch 0's dispatch is in flight, and micro-batch 0's experts while
/// micro-batch 1's dispatch is; a micro-batch's experts wait for its dispatch.
#[test]
fn prefill_two_batch_overlap_puts_communication_beside_compute() {
    let p = colocated("minimax-m2-h800");
    let pre = program(&p, Mode::Ep, Phase::Prefill);
    assert_eq!((pre.overlap, pre.micro_batches), (Overlap::Tbo, 2));
    let (all, unsatisfied) = unroll(pre);
    assert!(unsatisfied.is_empty());
    for layer in [0, 30, 61] {
        let d0 = issued(&all, pre, "dispatch.0", layer);
        let d1 = issued(&all, pre, "dispatch.1", layer);
        assert!(concurrent(d0, issued(&all, pre, "attention.1", layer)), "layer {layer}");
        assert!(concurrent(d1, issued(&all, pre, "experts.0", layer)), "layer {layer}");
        assert!(concurrent(issued(&all, pre, "combine.0", layer), issued(&all, pre, "experts.1", layer)));
        assert!(d0.happens_before(issued(&all, pre, "experts.0", layer)));
        assert!(d1.happens_before(issued(&all, pre, "experts.1", layer)));
        assert!(issued(&all, pre, "combine.1", layer).happens_before(issued(&all, pre, "moe_residual.1", layer)));
    }
    // The next layer starts after this one's residual: nothing runs ahead.
    assert!(issued(&all, pre, "moe_residual.0", 0).happens_before(issued(&all, pre, "input_norm.0", 1)));
}

/// Decode's SBO (DeepSeek-V3 has a shared expert): the shared expert runs on
/// its own stream beside dispatch, the APK and combine; WaitDone is the
/// residual add's wait on the combine and on the shared expert.
#[test]
fn decode_single_batch_overlap_runs_shared_experts_beside_the_routed_path() {
    let p = example("deepseek-v3-h100x32");
    let dec = program(&p, Mode::Ep, Phase::Decode);
    assert_eq!((dec.overlap, dec.micro_batches, dec.streams.len()), (Overlap::Sbo, 1, 4));
    let (all, _) = unroll(dec);
    let layer = 10;
    // The shared expert is two GEMMs (SwiGLU, then down) on the `shared` stream.
    let (gate_up, down) = (issued(&all, dec, "shared_gate_up", layer), issued(&all, dec, "shared_down", layer));
    for other in ["dispatch", "experts", "combine"] {
        assert!(concurrent(gate_up, issued(&all, dec, other, layer)), "{other}");
        assert!(concurrent(down, issued(&all, dec, other, layer)), "{other}");
    }
    let residual = issued(&all, dec, "moe_residual", layer);
    assert!(gate_up.happens_before(down) && down.happens_before(residual));
    assert!(issued(&all, dec, "combine", layer).happens_before(residual));
    // Its gate_up waits for this layer's normed rows (the post-attention norm).
    let moe = dec.blocks.iter().position(|b| b.kind == BlockKind::Moe).unwrap();
    let norm = dec.blocks[moe].ops.iter().position(|o| o.name == "post_attention_norm").unwrap();
    let norm = all.iter().find(|i| i.block == moe && i.op == norm && i.layer == layer).unwrap();
    assert!(norm.happens_before(gate_up));
    // MLA reads the absorbed kv_b in attention, in both phases, and never
    // decompresses k and v with a kv_b GEMM.
    for phase in [Phase::Decode, Phase::Prefill] {
        let prog = program(&p, Mode::Ep, phase);
        let att: Vec<_> = prog.ops().filter(|(_, o)| o.name.starts_with("attention")).collect();
        assert!(!att.is_empty(), "{phase:?}");
        for (_, o) in att {
            assert!(o.reads.contains(&Operand::Weight { role: TensorRole::KvBProj, part: TensorPart::Weight }));
        }
        assert!(prog.ops().all(|(_, o)| !o.name.starts_with("kv_b_proj")), "{phase:?}");
    }
    // The three leading dense layers have their own body.
    assert_eq!(dec.blocks[1].kind, BlockKind::Dense);
    assert_eq!(dec.blocks[1].layers, Some([0, 3]));
}

/// Megatron-style TP needs one all-reduce after `o_proj` and one after the
/// experts per layer; MiniMax-M2's all-head QK-norm adds the sum of squares'
/// (4 bytes each for q and k per token); EP has none and moves rows by two
/// all-to-alls.
#[test]
fn tensor_parallel_programs_all_reduce_what_tp_splits() {
    let count = |p: &Program, kind: CommKind| {
        p.blocks[1].ops.iter().filter(|o| o.comm.as_ref().is_some_and(|c| c.kind == kind)).count()
    };
    let q = example("qwen3-235b-a22b-bursty");
    assert_eq!(count(program(&q, Mode::Tp, Phase::Decode), CommKind::AllReduce), 2);
    let mm = minimax_dual();
    assert!(findings(&mm).is_empty(), "{:?}", findings(&mm));
    let tp = program(&mm, Mode::Tp, Phase::Decode);
    assert_eq!(count(tp, CommKind::AllReduce), 3);
    let sumsq = tp.blocks[1].ops.iter().find(|o| o.name == "qk_sumsq_all_reduce").unwrap();
    assert_eq!(sumsq.comm.as_ref().unwrap().row_bytes, 8);
    let ep = program(&mm, Mode::Ep, Phase::Decode);
    assert_eq!((count(ep, CommKind::AllReduce), count(ep, CommKind::AllToAll)), (0, 2));
    // EP's all-head QK-norm is local (every head is on the rank).
    let (b, o) = op_index(ep, "qk_norm");
    assert_eq!(ep.blocks[b].ops[o].kind, OpKind::QkNorm { all_heads: true, partial: false });
    // TP's collectives address the TP buffers; EP's the EP slots.
    let ar = mm.memory.buffer(Mode::Tp, BufferName::AllReduce).unwrap();
    let dispatch = mm.memory.buffer(Mode::Ep, BufferName::Dispatch).unwrap();
    assert_eq!(ar.region, dispatch.region, "both in comm");
    assert!(mm.memory.buffer(Mode::Ep, BufferName::AllReduce).is_none());
}

/// Edits `plan`'s program `pi` with `f` and returns the validator's findings.
fn broken(plan: &Plan, pi: usize, f: impl FnOnce(&mut Program)) -> Vec<String> {
    let mut p = plan.clone();
    f(&mut p.programs[pi]);
    findings(&p)
}

fn op_mut<'a>(p: &'a mut Program, name: &str) -> &'a mut Op {
    let (b, o) = op_index(p, name);
    &mut p.blocks[b].ops[o]
}

fn assert_finds(found: &[String], needle: &str) {
    assert!(found.iter().any(|f| f.contains(needle)), "expected `{needle}` in {found:#?}");
}

#[test]
fn the_verifier_catches_each_kind_of_broken_program() {
    let plan = colocated("minimax-m2-h800");
    let pi = plan.programs.iter().position(|q| q.mode == Mode::Ep && q.phase == Phase::Prefill).unwrap();
    // The experts no longer wait for their dispatch: a race on the received rows.
    let f = broken(&plan, pi, |p| op_mut(p, "permute_count.0").waits.clear());
    assert_finds(&f, "concurrently with");
    assert_finds(&f, "Dispatch");
    // The residual add no longer waits for the combine (WaitDone dropped).
    let f = broken(&plan, pi, |p| op_mut(p, "moe_residual.1").waits.clear());
    assert_finds(&f, "MoeOut");
    // A wait on an event nothing has recorded yet.
    let f = broken(&plan, pi, |p| {
        let e = op_mut(p, "combine.1").record.unwrap();
        op_mut(p, "input_norm.0").waits.push(e);
    });
    assert_finds(&f, "which no earlier op of the step records");
    // The KV write moved off `compute`: attention reads pages it may not have written.
    let f = broken(&plan, pi, |p| op_mut(p, "kv_write.0").stream = 1);
    assert_finds(&f, "the KV pages of layer 0 concurrently");
    // Both micro-batches' attention write the same rows.
    let f = broken(&plan, pi, |p| {
        op_mut(p, "dispatch.0").micro_batch = None;
    });
    assert_finds(&f, "concurrently with");
    // The embedding is gone: the first norm reads a residual nobody wrote.
    let f = broken(&plan, pi, |p| p.blocks[0].ops.clear());
    assert_finds(&f, "reads Residual before any op of the step writes it");
    // A weight the memory plan does not hold, a buffer of the other mode,
    // a kernel entry that does not exist, a stream out of range.
    let f = broken(&plan, pi, |p| {
        op_mut(p, "attention.0").reads.push(Operand::Weight { role: TensorRole::Sinks, part: TensorPart::Weight })
    });
    assert_finds(&f, "no ep view of model.layers.{l}.self_attn.sinks");
    let f = broken(&plan, pi, |p| op_mut(p, "o_proj.0").writes.push(Operand::Buffer { name: BufferName::AllReduce }));
    assert_finds(&f, "no ep buffer AllReduce");
    let f = broken(&plan, pi, |p| {
        op_mut(p, "route.0").kernel = KernelRef::Launch { instance: "router".into(), entry: "moe_route".into() }
    });
    assert_finds(&f, "no entry `moe_route`");
    let f = broken(&plan, pi, |p| op_mut(p, "gather.0").stream = 7);
    assert_finds(&f, "stream 7 of 3");
    // The step must end with the sampled tokens, after every stream.
    let f = broken(&plan, pi, |p| {
        p.blocks.last_mut().unwrap().ops.pop();
    });
    assert_finds(&f, "must write the sampled tokens");
    // Layers skipped, and a rank without a decode program.
    let f = broken(&plan, pi, |p| p.blocks[1].layers = Some([0, 60]));
    assert_finds(&f, "cover layers [0, 60)");
    let f = broken(&plan, pi, |p| {
        p.ranks.pop();
    });
    assert_finds(&f, "not each of [0, 1, 2, 3, 4, 5, 6, 7] once");
    // A communication op whose statement disagrees with its operands.
    let f = broken(&plan, pi, |p| op_mut(p, "combine.0").comm.as_mut().unwrap().to = BufferName::Residual);
    assert_finds(&f, "but its operands or kernel say otherwise");
}

#[test]
fn programs_are_deterministic() {
    let a = serde_json::to_string(&colocated("glm-5-h800x24").programs).unwrap();
    let b = serde_json::to_string(&colocated("glm-5-h800x24").programs).unwrap();
    assert_eq!(a, b);
}

/// An op launches only an entry whose contract is its own, and a
/// communication op's row size matches the buffers it moves between.
#[test]
fn ops_launch_only_their_own_kernels_and_move_whole_rows() {
    let plan = example("qwen3-235b-a22b-bursty");
    let pi = plan.programs.iter().position(|q| q.mode == Mode::Tp && q.phase == Phase::Decode).unwrap();
    let f = broken(&plan, pi, |p| {
        op_mut(p, "input_norm").kernel = KernelRef::Launch { instance: "layer".into(), entry: "sample_tokens".into() }
    });
    assert_finds(&f, "cannot launch `sample_tokens`");
    // DSA's attention launches the sparse kernel, not the dense MLA one.
    let glm = colocated("glm-5-h800x24");
    let gi = glm.programs.iter().position(|q| q.mode == Mode::Ep && q.phase == Phase::Decode).unwrap();
    let f = broken(&glm, gi, |p| {
        op_mut(p, "attention").kernel = KernelRef::Launch { instance: "layer".into(), entry: "mla_attention".into() }
    });
    assert_finds(&f, "cannot launch `mla_attention`");
    let f = broken(&plan, pi, |p| op_mut(p, "moe_all_reduce").comm.as_mut().unwrap().row_bytes = 2 * 4096);
    assert_finds(&f, "bytes per row");
    // The APK's work is posted: EP's combine waits for its record (WaitDone).
    let ep = program(&plan, Mode::Ep, Phase::Decode);
    let (all, _) = unroll(ep);
    let experts = issued(&all, ep, "experts", 5);
    assert_eq!(ep.streams[experts.stream], "apk");
    assert!(experts.happens_before(issued(&all, ep, "combine_rows", 5)));
    assert!(issued(&all, ep, "gather", 5).happens_before(experts));
    let pi = plan.programs.iter().position(|q| q.mode == Mode::Ep && q.phase == Phase::Decode).unwrap();
    let f = broken(&plan, pi, |p| op_mut(p, "combine_rows").waits.clear());
    assert_finds(&f, "ExpertOut");
}

/// Every projection of a bf16 model runs on the dense APK with the shape its
/// weights give: the fused q‖k‖v GEMM of the rank's heads, o_proj adding
/// into the residual (EP) or writing TP's f32 partial sums, the router and
/// LM head in f32, SwiGLU halves for the dense FFN; and the verifier refuses
/// a GEMM whose statement disagrees with its operands.
#[test]
fn dense_gemms_state_their_shapes_and_the_verifier_holds_them_to_their_operands() {
    use moeforge_plan::GridVar;
    let plan = example("qwen3-235b-a22b-bursty");
    // Qwen3-235B-A22B's config.json: hidden 4096, vocab 151936, head_dim 128.
    let (h, d, vocab) = (4096u32, 128u32, 151936u32);
    let gemm = |p: &Program, name: &str| {
        let (b, o) = op_index(p, name);
        let op = &p.blocks[b].ops[o];
        assert_eq!(op.kernel, KernelRef::Launch { instance: "dense".into(), entry: "apk_dense".into() }, "{name}");
        op.gemm.unwrap()
    };
    // Qwen3-235B: 64 query heads, 4 KV heads, head_dim 128, 128 experts, TP = 8.
    let ep = program(&plan, Mode::Ep, Phase::Prefill);
    let qkv = gemm(ep, "qkv_proj.0");
    assert_eq!((qkv.n, qkv.k, qkv.epilogue), ((64 + 2 * 4) * d, h, Epilogue::StoreBf16));
    assert_eq!(gemm(ep, "o_proj.1").epilogue, Epilogue::AddF32);
    assert_eq!((gemm(ep, "router_gemm.0").n, gemm(ep, "router_gemm.0").epilogue), (128, Epilogue::StoreF32));
    let head = gemm(ep, "lm_head");
    assert_eq!((head.n, head.rows, head.epilogue), (vocab, GridVar::SampledRows, Epilogue::StoreF32));
    let tp = program(&plan, Mode::Tp, Phase::Decode);
    // TP: 8 query heads and one of the 4 KV heads (replicated twice) per rank.
    assert_eq!(gemm(tp, "qkv_proj").n, (8 + 2) * d);
    assert_eq!((gemm(tp, "o_proj").k, gemm(tp, "o_proj").epilogue), (8 * d, Epilogue::StoreF32));
    // TP's MoE: every expert's 1/8 slice on its own APK instance, launched per
    // op, and the combine keeping f32 partial sums for the all-reduce.
    let launch = |instance: &str, entry: &str| KernelRef::Launch { instance: instance.into(), entry: entry.into() };
    let (b, o) = op_index(tp, "experts");
    assert_eq!(tp.blocks[b].ops[o].kernel, launch("apk_tp", "moe_apk"));
    let (b, o) = op_index(tp, "combine_rows");
    assert_eq!(tp.blocks[b].ops[o].kernel, launch("permute", "moe_combine_f32"));
    assert_eq!(tp.blocks[b].ops[o].writes, [Operand::Buffer { name: BufferName::AllReduce }]);
    let apk_tp = plan.kernels.iter().find(|k| k.name == "apk_tp").unwrap();
    let moeforge_plan::KernelParams::Apk(a) = &apk_tp.params else { panic!("apk_tp is an APK") };
    // Qwen3-235B-A22B: 128 experts of moe_intermediate_size 1536.
    assert_eq!((a.local_experts, a.inter), (128, 1536 / 8));
    assert!(tp.ops().all(|(_, o)| !matches!(o.kernel, KernelRef::Missing { .. })), "a TP op without a kernel");
    // GLM-4.5-Air's leading dense layer (ffn 10944, hidden 4096): SwiGLU
    // into FfnMid, then down into the residual.
    let glm = colocated("glm-4.5-air-h200");
    let dec = program(&glm, Mode::Ep, Phase::Decode);
    let (gu, down) = (gemm(dec, "dense_gate_up"), gemm(dec, "dense_down"));
    assert_eq!((gu.epilogue, gu.n, gu.k), (Epilogue::SwiGlu, 10944, 4096));
    assert_eq!((down.epilogue, down.n, down.k), (Epilogue::AddF32, 4096, 10944));

    let pi = plan.programs.iter().position(|q| q.mode == Mode::Ep && q.phase == Phase::Prefill).unwrap();
    let f = broken(&plan, pi, |p| op_mut(p, "qkv_proj.0").gemm.as_mut().unwrap().k += 8);
    assert_finds(&f, "k = 4104 columns from column 0 of Normed");
    let f = broken(&plan, pi, |p| op_mut(p, "router_gemm.0").gemm.as_mut().unwrap().n -= 2);
    assert_finds(&f, "not one bf16 or fp8 [126][4096]");
    let f = broken(&plan, pi, |p| op_mut(p, "qkv_proj.0").gemm.as_mut().unwrap().x_col = 4);
    assert_finds(&f, "multiples of 8");
    let f = broken(&plan, pi, |p| op_mut(p, "lm_head").gemm.as_mut().unwrap().y_col = 2);
    assert_finds(&f, "within the row");
    // Weights out of order are no longer one matrix.
    let f = broken(&plan, pi, |p| op_mut(p, "qkv_proj.0").reads.swap(1, 2));
    assert_finds(&f, "back to back");
    let f = broken(&plan, pi, |p| {
        op_mut(p, "o_proj.0").reads.retain(|r| *r != Operand::Buffer { name: BufferName::Residual })
    });
    assert_finds(&f, "without reading it");
    let f = broken(&plan, pi, |p| op_mut(p, "router_gemm.0").gemm = None);
    assert_finds(&f, "states its shape");
    let f = broken(&plan, pi, |p| op_mut(p, "route.0").gemm = Some(qkv));
    assert_finds(&f, "is no GEMM");
    // In place, reading and writing the same columns.
    let f = broken(&plan, pi, |p| {
        let op = op_mut(p, "qkv_proj.0");
        op.reads[0] = Operand::Buffer { name: BufferName::Qkv };
        op.gemm.as_mut().unwrap().k = 128;
    });
    assert_finds(&f, "while reading");
    // SwiGLU whose gate and up halves are uneven: GLM-4.5-Air's dense layer
    // with its down weight standing in for the up half.
    let gi = glm.programs.iter().position(|q| q.mode == Mode::Ep && q.phase == Phase::Decode).unwrap();
    let f = broken(&glm, gi, |p| {
        let op = op_mut(p, "dense_gate_up");
        op.reads[2] = Operand::Weight { role: TensorRole::DenseDown, part: TensorPart::Weight };
    });
    assert_finds(&f, "not one bf16 or fp8");
}

/// DeepSeek-V3 as the Hub ships it (fp8 e4m3 projections with 128×128 block
/// scales): its projections, dense and shared-expert FFNs launch the fp8
/// dense APK and read every part's scales; the LM head and router stay on
/// the bf16 one; gate‖up is one fp8 matrix whose scales follow each other.
#[test]
fn fp8_projections_run_on_the_fp8_dense_apk() {
    let plan = example("deepseek-v3-h100x32");
    assert!(findings(&plan).is_empty(), "{:?}", findings(&plan));
    let dec = program(&plan, Mode::Ep, Phase::Decode);
    let op = |name: &str| {
        let (b, o) = op_index(dec, name);
        dec.blocks[b].ops[o].clone()
    };
    let launch = |instance: &str, entry: &str| KernelRef::Launch { instance: instance.into(), entry: entry.into() };
    let scales =
        |o: &Op| o.reads.iter().filter(|r| matches!(r, Operand::Weight { part: TensorPart::ScaleInv, .. })).count();
    for (name, parts) in [("q_a_proj", 1), ("o_proj", 1), ("dense_gate_up", 2), ("shared_gate_up", 2)] {
        let o = op(name);
        assert_eq!(o.kernel, launch("dense_fp8", "apk_dense_fp8"), "{name}");
        assert_eq!(scales(&o), parts, "{name} reads its parts' scales");
    }
    for name in ["lm_head", "router_gemm"] {
        assert_eq!(op(name).kernel, launch("dense", "apk_dense"), "{name}");
    }
    assert!(dec.ops().all(|(_, o)| !matches!(o.kernel, KernelRef::Missing { .. })), "an op without a kernel");
    // A part's scales dropped from the reads.
    let pi = plan.programs.iter().position(|q| q.mode == Mode::Ep && q.phase == Phase::Decode).unwrap();
    let f = broken(&plan, pi, |p| {
        op_mut(p, "shared_gate_up")
            .reads
            .retain(|r| !matches!(r, Operand::Weight { part: TensorPart::ScaleInv, role: TensorRole::SharedUp }))
    });
    assert_finds(&f, "every part's block scales");
}

/// The entries' parameters as the emitted CUDA declares them: `(symbol,
/// ["type name", …])` for every `extern "C" __global__` function of `src`,
/// qualifiers (`__restrict__`) and launch attributes dropped.
fn prototypes(src: &str) -> Vec<(String, Vec<String>)> {
    fn strip_call(s: &mut String, attr: &str) {
        while let Some(i) = s.find(attr) {
            let open = i + attr.len();
            let mut depth = 0;
            let mut end = open;
            for (j, c) in s[open..].char_indices() {
                match c {
                    '(' => depth += 1,
                    ')' => {
                        depth -= 1;
                        if depth == 0 {
                            end = open + j + 1;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            s.replace_range(i..end, " ");
        }
    }
    let mut out = Vec::new();
    for (i, _) in src.match_indices("extern \"C\" __global__ void") {
        let Some(len) = src[i..].find('{') else { continue };
        let mut head = src[i..i + len].to_string();
        // Template text around the declaration (`{%- if … %}` blocks) is rendered away.
        strip_call(&mut head, "__cluster_dims__");
        strip_call(&mut head, "__launch_bounds__");
        let head = head.trim_start_matches("extern \"C\" __global__ void").replace("__restrict__", " ");
        let open = head.find('(').unwrap();
        let close = head.rfind(')').unwrap();
        let name = head[..open].split_whitespace().last().unwrap().to_string();
        let params = head[open + 1..close]
            .split(',')
            .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" ").replace(" *", "*"))
            .collect();
        out.push((name, params));
    }
    out
}

/// Every entry a plan declares is the function its emitted source defines,
/// parameter for parameter (the source's text is the other authority: the
/// declarations the verifier types launch arguments against must be its),
/// and every launch of every example's programs passes arguments the
/// verifier accepts.
#[test]
fn entry_parameters_are_the_emitted_functions_and_every_launch_passes_its_arguments() {
    let mut checked = 0;
    for e in std::fs::read_dir(root().join("examples")).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_none_or(|x| x != "moe") {
            continue;
        }
        let c = check_paths(std::slice::from_ref(&path), &FsLoader).unwrap();
        let id = c.spec.deploy_ids().next().unwrap();
        let valid = plan_deployment(&c, id).unwrap();
        for k in &valid.plan().kernels {
            let src = moeforge_codegen::emit::cuda::render(&valid, k).unwrap();
            let defined = prototypes(&src);
            for ep in &k.entries {
                let found = defined.iter().find(|(n, _)| *n == ep.symbol);
                let (_, params) =
                    found.unwrap_or_else(|| panic!("{}: {} defines no `{}`", path.display(), k.name, ep.symbol));
                assert_eq!(params, &ep.params, "{}: {}::{}", path.display(), k.name, ep.symbol);
                checked += 1;
            }
        }
        for p in &valid.plan().programs {
            for (_, op) in p.ops() {
                if let KernelRef::Launch { instance, entry } = &op.kernel {
                    let ep = valid.plan().kernels.iter().find(|k| &k.name == instance).unwrap();
                    let ep = ep.entries.iter().find(|e| &e.symbol == entry).unwrap();
                    let flat = !ep.params.iter().any(|p| p.contains("__grid_constant__"));
                    assert_eq!(
                        op.args.len(),
                        if flat { ep.params.len() } else { 0 },
                        "{}: {}",
                        path.display(),
                        op.name
                    );
                }
            }
        }
    }
    assert!(checked > 100, "{checked} entries");
}

/// What the arguments say, against the model's published shapes: TP ranks
/// start at their own heads (MiniMax-M2: 48 query heads and 8 KV heads over
/// 8 ranks, config.json), EP ranks at their own experts, and the
/// permutation's arrays lie inside its slice with room for every entry and
/// each expert's padding.
#[test]
fn launch_arguments_place_each_rank_at_its_heads_experts_and_arrays() {
    use moeforge_plan::memory::{RouteIndexParts, MAX_BATCH_TOKENS};
    use moeforge_plan::GridVar;
    let plan = minimax_dual();
    let tp = program(&plan, Mode::Tp, Phase::Decode);
    let attention = tp.ops().map(|(_, o)| o).find(|o| o.name == "attention").unwrap();
    let per_rank = |a: &Arg| match a {
        Arg::Ptr { .. } | Arg::Null | Arg::Count { .. } | Arg::Float { .. } | Arg::Layer => panic!("{a:?}"),
        Arg::Int { value } => vec![*value; 8],
        Arg::PerRank { values } => values.clone(),
    };
    // (…, tokens, q_heads, kv_heads, q_head0, kv_head0, …)
    assert_eq!(attention.args[4], Arg::Count { var: GridVar::Tokens });
    assert_eq!(per_rank(&attention.args[5]), vec![6; 8]);
    assert_eq!(per_rank(&attention.args[6]), vec![1; 8]);
    assert_eq!(per_rank(&attention.args[7]), (0..8).map(|r| 6 * r).collect::<Vec<_>>());
    assert_eq!(per_rank(&attention.args[8]), (0..8).collect::<Vec<_>>());
    // The all-head QK-norm's partial sums: every KV head is held once.
    let sumsq = tp.ops().map(|(_, o)| o).find(|o| o.name == "qk_sumsq").unwrap();
    assert_eq!(sumsq.args[4], Arg::Float { value: 1.0 });

    // EP: MiniMax-M2's 256 experts, 32 per rank.
    let ep = program(&plan, Mode::Ep, Phase::Prefill);
    let count = ep.ops().map(|(_, o)| o).find(|o| o.name == "permute_count.1").unwrap();
    assert_eq!(count.args[0], Arg::Ptr { operand: Operand::Buffer { name: BufferName::DispatchIds }, at: 0 });
    assert_eq!(count.args[1], Arg::Count { var: GridVar::ReceivedEntries });
    assert_eq!(per_rank(&count.args[2]), (0..8).map(|r| 32 * r).collect::<Vec<_>>());
    assert_eq!(per_rank(&count.args[3]), vec![32; 8]);
    let combine = ep.ops().map(|(_, o)| o).find(|o| o.name == "combine_rows.1").unwrap();
    assert_eq!(combine.grid, Some(moeforge_plan::Grid::Per { over: GridVar::Received, per: 1 }));

    // The permutation's arrays, for two micro-batches of MiniMax-M2's top-8
    // entries: disjoint, inside the slice, each holding a slice's entries
    // plus M_t − 1 padding rows per expert.
    let ri = plan.memory.buffer(Mode::Ep, BufferName::RouteIndex).unwrap();
    let slice = ri.slice_bytes(2);
    let parts = RouteIndexParts::of(slice, 256);
    let entries = MAX_BATCH_TOKENS * 8 / 2;
    let block_m = plan
        .kernels
        .iter()
        .find_map(|k| match &k.params {
            moeforge_plan::KernelParams::Permute(p) => Some(u64::from(p.block_m)),
            _ => None,
        })
        .unwrap();
    assert!(parts.capacity >= entries + 32 * (block_m - 1), "{parts:?} for {entries} entries");
    let spans = [
        (parts.counts, 4 * 256),
        (parts.offsets, 4 * 257),
        (parts.row_entry, 4 * parts.capacity),
        (parts.row_expert, 4 * parts.capacity),
        (parts.entry_row, 4 * parts.capacity),
    ];
    for w in spans.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "{spans:?}");
    }
    assert!(spans[4].0 + spans[4].1 <= slice && spans.iter().all(|s| s.0 % 16 == 0), "{spans:?} in {slice}");
    let at = |o: &Op, i: usize| match o.args[i] {
        Arg::Ptr { at, .. } => at,
        _ => panic!(),
    };
    assert_eq!((at(count, 4), at(count, 5)), (parts.counts, parts.entry_row));
}

/// The verifier holds each launch's arguments to its entry's parameters and
/// to the op's own operands.
#[test]
fn the_verifier_refuses_arguments_the_kernel_would_misread() {
    use moeforge_plan::GridVar;
    let plan = example("qwen3-235b-a22b-bursty");
    let pi = plan.programs.iter().position(|q| q.mode == Mode::Tp && q.phase == Phase::Decode).unwrap();
    let f = broken(&plan, pi, |p| {
        op_mut(p, "rope").args.pop();
    });
    assert_finds(&f, "4 arguments for `rope`'s 5 parameters");
    // A float for an int, an int for a pointer.
    let f = broken(&plan, pi, |p| op_mut(p, "rope").args[3] = Arg::Float { value: 1.0 });
    assert_finds(&f, "`int q_heads` (I32) cannot take Float");
    let f = broken(&plan, pi, |p| op_mut(p, "rope").args[1] = Arg::Int { value: 0 });
    assert_finds(&f, "`const int32_t* positions`");
    // A writable pointer to a buffer the op only reads: the race checker
    // would not see the write.
    let f = broken(&plan, pi, |p| {
        op_mut(p, "input_norm").args[4] = Arg::Ptr { operand: Operand::Buffer { name: BufferName::Residual }, at: 0 }
    });
    assert_finds(&f, "which the op does not list in its writes");
    // An operand the op lists but never passes.
    let f = broken(&plan, pi, |p| op_mut(p, "kv_write").writes.push(Operand::Buffer { name: BufferName::Attn }));
    assert_finds(&f, "passes no pointer to it");
    // A bf16 parameter given an f32 weight; a pointer past its slice.
    let f = broken(&plan, pi, |p| {
        op_mut(p, "input_norm").args[2] =
            Arg::Ptr { operand: Operand::Weight { role: TensorRole::RouterBias, part: TensorPart::Weight }, at: 0 };
        op_mut(p, "input_norm").reads.push(Operand::Weight { role: TensorRole::RouterBias, part: TensorPart::Weight });
    });
    assert_finds(&f, "e_score_correction_bias");
    let f = broken(&plan, pi, |p| {
        op_mut(p, "permute_offsets").args[3] =
            Arg::Ptr { operand: Operand::Buffer { name: BufferName::RouteIndex }, at: 1 << 40 }
    });
    assert_finds(&f, "-byte slice of RouteIndex");
    // Per-rank values for a world they do not match; a transfer with arguments.
    let f = broken(&plan, pi, |p| op_mut(p, "attention").args[7] = Arg::PerRank { values: vec![0; 3] });
    assert_finds(&f, "3 per-rank values for a world of 8");
    let f = broken(&plan, pi, |p| op_mut(p, "moe_all_reduce").args.push(Arg::Count { var: GridVar::Tokens }));
    assert_finds(&f, "only a launch has arguments");
    // The APK takes its templates, not flat arguments.
    let f = broken(&plan, pi, |p| op_mut(p, "qkv_proj").args.push(Arg::Layer));
    assert_finds(&f, "takes the APK's templates and state");
}

/// ExpertPlex's role programs verify, and an edited one is refused: a MoE
/// server's program that embeds tokens, a program run by a GPU of another
/// role, an attention server's combine that pulls nothing in, and a MoE
/// server's experts no longer waiting for the rows its dispatch delivers.
#[test]
fn the_verifier_checks_role_programs() {
    let plan = example("glm-5-h800x24");
    let roles = plan.roles.as_ref().expect("an ExpertPlex example");
    assert!(roles.moe_servers());
    assert!(findings(&plan).is_empty(), "{:?}", findings(&plan));
    let of = |role: Role, phase: Phase| plan.programs.iter().position(|q| q.role == role && q.phase == phase).unwrap();
    let (moe, attn) = (of(Role::Moe, Phase::Prefill), of(Role::Attention, Phase::Prefill));
    // The MoE side issues no attention, embedding or head ops; the
    // attention side no routed experts.
    assert!(plan.programs[moe].ops().all(|(b, _)| b.kind == BlockKind::Moe));
    assert!(plan.programs[attn].ops().all(|(_, o)| o.kind != OpKind::Experts));
    let f = broken(&plan, moe, |p| {
        let embed = plan.programs[attn].blocks[0].ops[0].clone();
        p.blocks[0].ops.push(embed);
    });
    assert_finds(&f, "issues ops in MoE layers only");
    let f = broken(&plan, moe, |p| p.role = Role::Attention);
    assert_finds(&f, "as Moe, not Attention");
    // Op names carry their micro-batch where the step has two.
    let name = |p: &Program, op: &str| if p.micro_batches > 1 { format!("{op}.0") } else { op.to_string() };
    let f = broken(&plan, attn, |p| op_mut(p, &name(p, "combine")).writes.clear());
    assert_finds(&f, "but its operands or kernel say otherwise");
    let f = broken(&plan, moe, |p| op_mut(p, &name(p, "permute_count")).waits.clear());
    assert_finds(&f, "concurrently with");
}
