//! Host-emulation tier: the emitted router and permutation kernels run on the
//! CPU through a small CUDA shim (runtime/shim: CUDA threads as std::threads,
//! warp shuffles and ballots through per-warp barriers) and must agree with
//! the scalar references in `moeforge_runtime::reference`. This executes the
//! very source that nvcc compiles, specialized per example deployment.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use moeforge::codegen::{self, NvccMode};
use moeforge::dsl::{check_paths, FsLoader};
use moeforge::plan::KernelParams;
use moeforge::runtime::reference::{self, RoutingRule};
use std::path::{Path, PathBuf};
use std::process::Command;

struct Emitted {
    name: String,
    plan: codegen::Plan,
    files: std::collections::BTreeMap<String, Vec<u8>>,
    routing: moeforge::dsl::spec::Routing,
    model: moeforge::dsl::spec::Model,
}

fn emit(example: &Path) -> Emitted {
    let checked = check_paths(&[example.to_path_buf()], &FsLoader).unwrap_or_else(|f| panic!("{}", f.render(false)));
    let id = moeforge::dsl::spec::DeployId(0);
    let plan =
        codegen::plan_deployment(&checked, id).unwrap_or_else(|d| panic!("{}", d.render(&checked.sources, false)));
    let (bundle, _) = codegen::emit(&checked, id, &plan, &NvccMode::Off).unwrap();
    let model = checked.spec.model(checked.spec.deploys[0].model).clone();
    Emitted { name: stem(example), plan: plan.plan().clone(), files: bundle.files, routing: model.moe.routing, model }
}

/// Builds `driver` with the kernel source included; returns the binary.
fn build(dir: &Path, driver: &str, kernel_src: &[u8], tag: &str) -> PathBuf {
    build_host_driver(dir, driver, kernel_src, tag, &[])
}

fn run(bin: &Path, input: &[u8], dir: &Path) -> Vec<u8> {
    let (i, o) = (dir.join("in.bin"), dir.join("out.bin"));
    std::fs::write(&i, input).unwrap();
    let status = Command::new(bin).arg(&i).arg(&o).status().unwrap();
    assert!(status.success(), "{}: exit {status}", bin.display());
    std::fs::read(&o).unwrap()
}

fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
}

#[test]
fn emitted_router_matches_reference_on_every_example() {
    let tmp = tempfile::tempdir().unwrap();
    for ex in examples() {
        let e = emit(&ex);
        let KernelParams::Router(p) = &e.plan.kernels.iter().find(|k| k.name == "router").unwrap().params else {
            panic!("no router")
        };
        let (experts, k) = (p.experts as usize, p.top_k as usize);
        let bin = build(tmp.path(), "router_main.cpp", &e.files["kernels/router.cu"], &format!("{}-router", e.name));
        let mut rng = Rng(0x5eed ^ experts as u64);
        // 37 tokens: not a multiple of the warps per block, so a block exits early.
        let tokens = 37;
        let mut logits = Vec::with_capacity(tokens * experts);
        for t in 0..tokens {
            if t == 5 {
                logits.extend(std::iter::repeat_n(0.25f32, experts)); // all tied: lower ids win
            } else {
                // distinct values, so only deliberate ties exist
                logits.extend(rng.permutation(experts).into_iter().map(|v| (v as f32 - experts as f32 / 2.0) * 0.05));
            }
        }
        let bias: Vec<f32> = (0..experts).map(|_| (rng.unit() * 64.0).round() / 1024.0).collect();
        let mut input = Vec::new();
        input.extend((tokens as i32).to_le_bytes());
        input.extend((experts as i32).to_le_bytes());
        logits.iter().chain(&bias).for_each(|v| input.extend(v.to_le_bytes()));
        let out = run(&bin, &input, tmp.path());
        let (ids, weights) = out.split_at(tokens * k * 4);
        let (ids, weights) = (i32s(ids), f32s(weights));
        let rule = RoutingRule { experts, top_k: k, routing: e.routing };
        let (want_ids, want_w) = reference::route(&rule, &logits, Some(&bias));
        assert_eq!(ids, want_ids, "{}: router ids differ", e.name);
        for (i, (a, b)) in weights.iter().zip(&want_w).enumerate() {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1e-3), "{}: weight {i}: kernel {a} vs reference {b}", e.name);
        }
    }
}

#[test]
fn emitted_permutation_and_combine_match_reference() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["qwen3-30b-a3b-h200", "mixtral-8x7b-a100", "glm-5-h800x24"] {
        let e = emit(&root().join(format!("examples/{name}.moe")));
        let KernelParams::Permute(p) = &e.plan.kernels.iter().find(|k| k.name == "permute").unwrap().params else {
            panic!("no permute")
        };
        let (hidden, k, m_t) = (p.hidden as usize, p.top_k as usize, p.block_m as usize);
        let bin = build(tmp.path(), "permute_main.cpp", &e.files["kernels/permute.cu"], &format!("{}-permute", e.name));
        // The last rank holding experts: with uneven splits (GLM-5: 256
        // experts on its 12 MoE servers) it holds fewer; in a dual plan also
        // TP's permutation, every token over every expert.
        let last = e.plan.ranks.iter().rev().find(|r| r.experts[1] > r.experts[0]).unwrap();
        let mut cases = vec![(last.experts[0] as i32, (last.experts[1] - last.experts[0]) as usize)];
        if e.plan.memory.modes.contains(&moeforge::plan::memory::Mode::Tp) {
            cases.push((0, e.plan.model.experts as usize));
        }
        for (begin, num_local) in cases {
            let mut rng = Rng(0xc0ffee ^ hidden as u64);
            let tokens = 19;
            let experts = e.plan.model.experts as usize;
            let mut ids = Vec::new();
            for _ in 0..tokens {
                // Bias towards the local range so several local experts get more than one row.
                let mut picks: Vec<i32> = Vec::new();
                while picks.len() < k {
                    let id =
                        if rng.below(2) == 0 { begin + rng.below(num_local) as i32 } else { rng.below(experts) as i32 };
                    if !picks.contains(&id) {
                        picks.push(id);
                    }
                }
                ids.extend(picks);
            }
            let weights: Vec<f32> = (0..tokens * k).map(|_| rng.unit().abs() + 0.01).collect();
            let x: Vec<u16> = (0..tokens * hidden).map(|_| reference::f32_to_bf16(rng.unit() * 4.0)).collect();
            let input = |room: i32| {
                let mut input = Vec::new();
                for v in [tokens as i32, begin, num_local as i32, room] {
                    input.extend(v.to_le_bytes());
                }
                ids.iter().for_each(|v| input.extend(v.to_le_bytes()));
                weights.iter().for_each(|v| input.extend(v.to_le_bytes()));
                x.iter().for_each(|v| input.extend(v.to_le_bytes()));
                input
            };
            let want = reference::permute(&ids, begin, num_local, m_t);
            let rows = *want.offsets.last().unwrap() as usize;
            // One row short of the room the layout needs: the device lays out
            // nothing (counts and offsets zero, the total -1), raises its
            // overflow word, and the combine finds no rows.
            let out = run(&bin, &input(rows as i32 - 1), tmp.path());
            let w = |n: usize| i32s(&out[..n * 4]);
            let words = w(2 * num_local + 3);
            assert_eq!(words[..num_local], vec![0; num_local], "{name}: counts after an overflow");
            assert_eq!(words[num_local..2 * num_local], vec![0; num_local], "{name}: offsets after an overflow");
            assert_eq!(words[2 * num_local..], [-1, -1, 1], "{name}: total, total, overflow");
            let rest = &out[(2 * num_local + 3) * 4..];
            assert_eq!(i32s(&rest[..tokens * k * 4]), vec![-1; tokens * k], "{name}: entry_row after an overflow");
            assert!(u16s(&rest[tokens * k * 4..][..tokens * hidden * 2]).iter().all(|&v| v == 0), "{name}: combine");
            // Exactly the room it needs: laid out, no overflow.
            let out = run(&bin, &input(rows as i32), tmp.path());
            let mut at = 0;
            let mut take = |n: usize| {
                let s = &out[at..at + n];
                at += n;
                s
            };
            assert_eq!(i32s(take(num_local * 4)), want.counts, "{name}: counts");
            assert_eq!(i32s(take((num_local + 1) * 4)), want.offsets, "{name}: offsets");
            assert_eq!(i32s(take(4)), vec![rows as i32], "{name}: rows");
            assert_eq!(i32s(take(4)), vec![0], "{name}: no overflow");
            assert!(want.counts.iter().any(|&c| c > 1), "{name}: the test should give some expert several rows");
            assert_eq!(i32s(take(rows * 4)), want.row_entry, "{name}: row_entry");
            assert_eq!(i32s(take(rows * 4)), want.row_expert, "{name}: row_expert");
            assert_eq!(i32s(take(tokens * k * 4)), want.entry_row, "{name}: entry_row");
            let x_perm = u16s(take(rows * hidden * 2));
            for (r, &entry) in want.row_entry.iter().enumerate() {
                let got = &x_perm[r * hidden..(r + 1) * hidden];
                if entry < 0 {
                    assert!(got.iter().all(|&v| v == 0), "{name}: padding row {r} not zeroed");
                } else {
                    let t = entry as usize / k;
                    assert_eq!(got, &x[t * hidden..(t + 1) * hidden], "{name}: row {r} is not token {t}");
                }
            }
            // The driver's stand-in expert: y = bf16(x_perm · (local expert + 1) · 0.5).
            let y: Vec<u16> = x_perm
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    let scale = (want.row_expert[i / hidden] + 1) as f32 * 0.5;
                    reference::f32_to_bf16(reference::bf16_to_f32(v) * scale)
                })
                .collect();
            let combined = u16s(take(tokens * hidden * 2));
            assert_eq!(combined, reference::combine(&y, hidden, &want.entry_row, &weights, k), "{name}: combine");
            // TP's f32 partial sums: the same fp32 sums unrounded (so rounding
            // them gives the bf16 combine exactly), and an f64 sum agrees.
            let sums: Vec<f32> =
                take(tokens * hidden * 4).chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            for t in 0..tokens {
                for j in 0..hidden {
                    let got = sums[t * hidden + j];
                    assert_eq!(reference::f32_to_bf16(got), combined[t * hidden + j], "{name}: f32 combine token {t}");
                    let exact: f64 = (0..k)
                        .filter_map(|q| {
                            let row = want.entry_row[t * k + q];
                            (row >= 0).then(|| {
                                f64::from(weights[t * k + q])
                                    * f64::from(reference::bf16_to_f32(y[row as usize * hidden + j]))
                            })
                        })
                        .sum();
                    assert!((f64::from(got) - exact).abs() <= 1e-5 * (1.0 + exact.abs()), "{name}: {got} vs {exact}");
                }
            }
        }
    }
}

/// Relative closeness for bf16 outputs computed in a different order (or
/// with f32 instead of f64 sine): within two bf16 ulps, or `abs` near zero.
fn close(got: f32, want: f32, abs: f32) -> bool {
    (got - want).abs() <= want.abs() / 128.0 + abs
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| reference::f32_to_bf16(*x).to_le_bytes()).collect()
}

/// The layer kernels (embedding, RMSNorm with and without the fused add,
/// the MoE residual add, greedy sampling, QK-norm per head and over all
/// heads with TP's all-reduced sums, RoPE at long positions, the paged KV
/// write) on every GQA example and on MLA ones for the shared kernels,
/// against the CPU twin's math (`twin::math`, which matches Hugging Face
/// transformers) and the page layout the memory plan documents.
#[test]
#[allow(clippy::needless_range_loop)] // one index walks several parallel arrays
fn emitted_layer_kernels_match_the_twin_math() {
    use moeforge::dsl::spec::{Attention, QkNormScope};
    use moeforge::plan::QkNormKind;
    use moeforge::runtime::sampling::{argmax, Sampler, Sampling};
    use moeforge::runtime::twin::math::{attend, rms_norm, Rope};
    let tmp = tempfile::tempdir().unwrap();
    let (mut gqa_checked, mut mla_checked) = (0, 0);
    for ex in examples() {
        let e = emit(&ex);
        let m = &e.model;
        let KernelParams::Layer(lp) = &e.plan.kernels.iter().find(|k| k.name == "layer").unwrap().params else {
            panic!("no layer kernels")
        };
        let (h, v) = (m.hidden as usize, m.vocab as usize);
        let eps = m.rms_eps as f32;
        let mut extra = Vec::new();
        let gqa = lp.gqa.clone();
        if gqa.is_some() {
            extra.push("-DKERNEL_GQA");
        }
        if lp.mla.is_some() {
            extra.push("-DKERNEL_MLA");
        }
        if gqa.as_ref().is_some_and(|g| g.qk_norm != QkNormKind::None) {
            extra.push("-DKERNEL_QK_NORM");
        }
        let bin = build_host_driver(
            tmp.path(),
            "layer_main.cpp",
            &e.files["kernels/layer.cu"],
            &format!("{}-layer", e.name),
            &extra,
        );
        let mut rng = Rng(0x1a7e ^ h as u64);
        let tokens = 5usize;
        let rows = 7usize;
        let table_rows = 11usize;
        let ids: Vec<i32> = (0..tokens).map(|_| rng.below(table_rows) as i32).collect();
        let table: Vec<f32> =
            (0..table_rows * h).map(|_| reference::bf16_to_f32(reference::f32_to_bf16(rng.unit()))).collect();
        let x: Vec<f32> = (0..tokens * h).map(|_| rng.unit() * 3.0).collect();
        let w: Vec<f32> =
            (0..h).map(|_| reference::bf16_to_f32(reference::f32_to_bf16(1.0 + rng.unit() * 0.5))).collect();
        let delta: Vec<f32> = (0..tokens * h).map(|_| rng.unit()).collect();
        let moe: Vec<f32> = (0..tokens * h).map(|_| rng.unit()).collect();
        let shared: Vec<f32> =
            (0..tokens * h).map(|_| reference::bf16_to_f32(reference::f32_to_bf16(rng.unit()))).collect();
        let norm_rows: Vec<i32> = (0..tokens as i32).rev().collect();
        let mut logits: Vec<f32> = (0..rows * v).map(|_| rng.unit() * 8.0).collect();
        logits[7] = 50.0; // row 0: a tie at 7 and v-1 goes to 7
        logits[v - 1] = 50.0;
        logits[2 * v - 1] = 60.0; // row 1: the last id
        logits[2 * v] = f32::NAN; // row 2: a NaN counts as -inf
        logits[6 * v + 5] = 30.0; // row 6: two tied leaders
        logits[6 * v + 9] = 30.0;
        // Rows 0–2 greedy; 3–6 temperature and top-p from seeded generators.
        let sampling: Vec<Sampling> = vec![
            Sampling::default(),
            Sampling::default(),
            Sampling::default(),
            Sampling { temperature: 0.8, top_p: 0.9, seed: 11 },
            Sampling { temperature: 1.3, top_p: 1.0, seed: 12 },
            Sampling { temperature: 0.5, top_p: 0.3, seed: 13 },
            Sampling { temperature: 40.0, top_p: 0.95, seed: 0xdead_beef_f00d },
        ];
        let meta_words_all = lp.request_meta_words as usize;
        let mut sample_meta = vec![0i32; rows * meta_words_all];
        for (r, s) in sampling.iter().enumerate() {
            let w = &mut sample_meta[r * meta_words_all..];
            w[4] = s.temperature.to_bits() as i32;
            w[5] = s.top_p.to_bits() as i32;
            w[6] = s.seed as u32 as i32;
            w[7] = (s.seed >> 32) as u32 as i32;
        }
        // GQA: this rank holds the second half of the heads (TP over two ranks).
        let (mut qh, mut kvh, mut qh0, mut kvh0, mut wlen, mut stride) = (0, 0, 0, 0, 0, 0);
        let (mut page_bytes, mut pool_bytes, layer) = (0usize, 0usize, 1usize);
        let mut qkv = Vec::new();
        let (mut qw, mut kw) = (Vec::new(), Vec::new());
        let positions: Vec<i32> = vec![0, 1, 4095, 30_000, 131_071];
        let slots: Vec<i32> = vec![3, 17, -1, 40, 0];
        let mut sums_in = vec![0f32; tokens * 2];
        let (mut all_heads, mut heads, mut kv_heads, mut hd) = (false, 0, 0, 0);
        if let (Some(g), Attention::Gqa { heads: gh, kv_heads: gkv, head_dim, qk_norm_scope, .. }) = (&gqa, m.attention)
        {
            all_heads = qk_norm_scope == QkNormScope::PerLayer;
            (heads, kv_heads, hd) = (gh as usize, gkv as usize, head_dim as usize);
            stride = g.qkv_stride as usize;
            let split = if kv_heads >= 2 { 2 } else { 1 };
            (qh, kvh) = (heads / split, kv_heads / split);
            (qh0, kvh0) = (heads - qh, kv_heads - kvh);
            wlen = if all_heads { heads.max(kv_heads) * hd } else { hd };
            qkv = (0..tokens * stride)
                .map(|_| reference::bf16_to_f32(reference::f32_to_bf16(rng.unit() * 2.0)))
                .collect();
            qw = (0..wlen).map(|_| reference::bf16_to_f32(reference::f32_to_bf16(1.0 + rng.unit() * 0.5))).collect();
            kw = (0..wlen).map(|_| reference::bf16_to_f32(reference::f32_to_bf16(1.0 + rng.unit() * 0.5))).collect();
            page_bytes = 3 * 16 * kvh * g.head_token_bytes as usize; // 3 layers of this rank's heads per page
            pool_bytes = 4 * page_bytes;
            // The all-reduced sums: this rank's heads plus the other rank's
            // (which the test makes up), as the all-reduce would give.
            for t in 0..tokens {
                let row = &qkv[t * stride..];
                let sq: f32 = row[..qh * hd].iter().map(|x| x * x).sum();
                let sk: f32 = row[qh * hd..(qh + kvh) * hd].iter().map(|x| x * x).sum();
                sums_in[2 * t] = sq * 2.0 + 1.0;
                sums_in[2 * t + 1] = sk * 2.0 + 0.5;
            }
        }
        // Paged attention: request 0 has 37 tokens cached on pages [3, 0, 2],
        // request 1 three on page [1]; rows decode request 0 at 36, prefill
        // request 1's three positions causally, and request 0 again at 20.
        let meta_words = gqa.as_ref().map_or(0, |_| lp.request_meta_words as usize);
        let mut meta = vec![0i32; 2 * meta_words];
        let row_request: Vec<i32> = vec![0, 1, 1, 1, 0];
        let apos: Vec<i32> = vec![36, 0, 1, 2, 20];
        let tables: [&[i32]; 2] = [&[3, 0, 2], &[1]];
        if meta_words > 0 {
            for (q, pages) in tables.iter().enumerate() {
                meta[q * meta_words + 8..q * meta_words + 8 + pages.len()].copy_from_slice(pages);
            }
        }
        let apool: Vec<u8> =
            (0..pool_bytes / 2).flat_map(|_| reference::f32_to_bf16(rng.unit()).to_le_bytes()).collect();
        let mut input = Vec::new();
        for x in [tokens, h, rows, v, qh, kvh, qh0, kvh0, 1, table_rows, layer, wlen] {
            input.extend((x as i32).to_le_bytes());
        }
        input.extend(0.5f32.to_le_bytes());
        input.extend((pool_bytes as i64).to_le_bytes());
        input.extend((page_bytes as i64).to_le_bytes());
        ids.iter().for_each(|x| input.extend(x.to_le_bytes()));
        input.extend(bf16_bytes(&table));
        x.iter().for_each(|f| input.extend(f.to_le_bytes()));
        input.extend(bf16_bytes(&w));
        delta.iter().for_each(|f| input.extend(f.to_le_bytes()));
        moe.iter().for_each(|f| input.extend(f.to_le_bytes()));
        input.extend(bf16_bytes(&shared));
        norm_rows.iter().for_each(|x| input.extend(x.to_le_bytes()));
        logits.iter().for_each(|f| input.extend(f.to_le_bytes()));
        sample_meta.iter().for_each(|x| input.extend(x.to_le_bytes()));
        if gqa.is_some() {
            input.extend(bf16_bytes(&qkv));
            input.extend(bf16_bytes(&qw));
            input.extend(bf16_bytes(&kw));
            positions.iter().for_each(|x| input.extend(x.to_le_bytes()));
            slots.iter().for_each(|x| input.extend(x.to_le_bytes()));
            sums_in.iter().for_each(|f| input.extend(f.to_le_bytes()));
            input.extend(&apool);
            input.extend(((meta.len() / meta_words.max(1)) as i32).to_le_bytes());
            meta.iter().for_each(|x| input.extend(x.to_le_bytes()));
            row_request.iter().for_each(|x| input.extend(x.to_le_bytes()));
            apos.iter().for_each(|x| input.extend(x.to_le_bytes()));
        }
        // MLA: two local heads; one entry per token and layer, 3 layers a page.
        let mla = lp.mla.clone();
        let mla_local = 2usize;
        let (mut m_qkv, mut qaw, mut kvaw, mut kv_b, mut m_pool, mut m_meta) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        let mut m_page = 0usize;
        if let Some(a) = &mla {
            let s = a.qkv_stride as usize;
            m_qkv = (0..tokens * s).map(|_| reference::bf16_to_f32(reference::f32_to_bf16(rng.unit() * 2.0))).collect();
            qaw = (0..a.q_lora as usize)
                .map(|_| reference::bf16_to_f32(reference::f32_to_bf16(1.0 + rng.unit() * 0.5)))
                .collect();
            kvaw = (0..a.kv_lora as usize)
                .map(|_| reference::bf16_to_f32(reference::f32_to_bf16(1.0 + rng.unit() * 0.5)))
                .collect();
            let kvb = (a.nope + a.v_head) as usize;
            // bf16 kv_b, or (fp8 models) e4m3 codes with 128×128 block scales:
            // the reference multiplies code × scale, as the kernel does.
            let (rows, cols) = (mla_local * kvb, a.kv_lora as usize);
            let mut kv_b_input = vec![];
            if a.kv_b_fp8 {
                let codes: Vec<u8> = (0..rows * cols)
                    .map(|_| loop {
                        let b = rng.below(256) as u8;
                        if b & 0x7f != 0x7f {
                            break b;
                        }
                    })
                    .collect();
                let sc = cols.div_ceil(128);
                let scales: Vec<f32> = (0..rows.div_ceil(128) * sc).map(|_| 0.002 + 0.001 * rng.unit()).collect();
                kv_b = (0..rows * cols)
                    .map(|j| {
                        use moeforge::runtime::twin::math::e4m3_to_f32;
                        e4m3_to_f32(codes[j]) * scales[(j / cols) / 128 * sc + (j % cols) / 128]
                    })
                    .collect();
                kv_b_input.extend(codes);
                scales.iter().for_each(|x| kv_b_input.extend(x.to_le_bytes()));
            } else {
                kv_b = (0..rows * cols)
                    .map(|_| reference::bf16_to_f32(reference::f32_to_bf16(rng.unit() * 0.1)))
                    .collect();
                kv_b_input = bf16_bytes(&kv_b);
            }
            m_page = 3 * 16 * a.entry_bytes as usize;
            m_pool = (0..2 * m_page).flat_map(|_| reference::f32_to_bf16(rng.unit()).to_le_bytes()).collect();
            m_pool.truncate(4 * m_page);
            m_pool.resize(4 * m_page, 0);
            let mw = lp.request_meta_words as usize;
            m_meta = vec![0i32; 2 * mw];
            for (q, pages) in tables.iter().enumerate() {
                m_meta[q * mw + 8..q * mw + 8 + pages.len()].copy_from_slice(pages);
            }
            // The header's pool and page sizes are GQA's; MLA's ride here.
            input.extend(bf16_bytes(&m_qkv));
            input.extend((a.q_lora as i32).to_le_bytes());
            input.extend(bf16_bytes(&qaw));
            input.extend(bf16_bytes(&kvaw));
            input.extend(&kv_b_input);
            positions.iter().for_each(|x| input.extend(x.to_le_bytes()));
            slots.iter().for_each(|x| input.extend(x.to_le_bytes()));
            input.extend(&m_pool);
            input.extend(2i32.to_le_bytes());
            m_meta.iter().for_each(|x| input.extend(x.to_le_bytes()));
            row_request.iter().for_each(|x| input.extend(x.to_le_bytes()));
            apos.iter().for_each(|x| input.extend(x.to_le_bytes()));
            // Patch the header: q_heads, pool and page bytes are MLA's.
            input[16..20].copy_from_slice(&(mla_local as i32).to_le_bytes());
            input[52..60].copy_from_slice(&((4 * m_page) as i64).to_le_bytes());
            input[60..68].copy_from_slice(&(m_page as i64).to_le_bytes());
        }
        let out = run(&bin, &input, tmp.path());
        let mut at = 0;
        let mut take = |n: usize| {
            let s = &out[at..at + n];
            at += n;
            s
        };
        let name = &e.name;
        // Embedding: exact.
        let emb = f32s(take(tokens * h * 4));
        for t in 0..tokens {
            assert_eq!(
                &emb[t * h..(t + 1) * h],
                &table[ids[t] as usize * h..(ids[t] as usize + 1) * h],
                "{name}: embed"
            );
        }
        let bf = |b: &[u8]| u16s(b).into_iter().map(reference::bf16_to_f32).collect::<Vec<f32>>();
        // RMSNorm of rows in reverse order.
        let normed = bf(take(tokens * h * 2));
        for r in 0..tokens {
            let src = norm_rows[r] as usize;
            let want = rms_norm(&x[src * h..(src + 1) * h], &w, eps);
            for i in 0..h {
                assert!(
                    close(normed[r * h + i], want[i], 1e-3),
                    "{name}: rms_norm row {r} [{i}]: {} vs {}",
                    normed[r * h + i],
                    want[i]
                );
            }
        }
        // Fused add + RMSNorm.
        let res = f32s(take(tokens * h * 4));
        let added: Vec<f32> = x.iter().zip(&delta).map(|(a, b)| a + b).collect();
        assert_eq!(res, added, "{name}: add_rms_norm residual");
        let normed = bf(take(tokens * h * 2));
        for r in 0..tokens {
            let want = rms_norm(&added[r * h..(r + 1) * h], &w, eps);
            assert!((0..h).all(|i| close(normed[r * h + i], want[i], 1e-3)), "{name}: add_rms_norm row {r}");
        }
        // The MoE residual add, with and without shared experts: exact.
        let with: Vec<f32> = (0..tokens * h).map(|i| x[i] + (moe[i] + shared[i])).collect();
        assert_eq!(f32s(take(tokens * h * 4)), with, "{name}: residual_add with shared");
        let without: Vec<f32> = (0..tokens * h).map(|i| x[i] + (moe[i] + 0.0)).collect();
        assert_eq!(f32s(take(tokens * h * 4)), without, "{name}: residual_add");
        // Sampling: the twin's sampler, greedy and seeded, and its generator state.
        let want: Vec<i32> =
            (0..rows).map(|r| Sampler::new(sampling[r]).sample(&logits[r * v..(r + 1) * v]) as i32).collect();
        assert_eq!(i32s(take(rows * 4)), want, "{name}: sample_tokens");
        assert_eq!((want[0], want[1]), (7, v as i32 - 1));
        assert_eq!(want[0], argmax(&logits[..v]) as i32);
        let after = i32s(take(rows * meta_words_all * 4));
        for (r, s) in sampling.iter().enumerate() {
            let state =
                (after[r * meta_words_all + 6] as u32 as u64) | ((after[r * meta_words_all + 7] as u32 as u64) << 32);
            let drawn = if s.is_greedy() { s.seed } else { s.seed.wrapping_add(0x9e37_79b9_7f4a_7c15) };
            assert_eq!(state, drawn, "{name}: row {r}'s generator state");
        }
        if let Some(a) = &mla {
            check_mla(
                name,
                a,
                m,
                &mut take,
                &m_qkv,
                &qaw,
                &kvaw,
                &kv_b,
                &m_pool,
                m_page,
                &m_meta,
                &positions,
                &slots,
                &row_request,
                &apos,
                layer,
                mla_local,
                lp.request_meta_words as usize,
            );
            mla_checked += 1;
        }
        let Some(g) = &gqa else {
            assert_eq!(at, out.len(), "{name}: output size");
            continue;
        };
        gqa_checked += 1;
        let head = |buf: &[f32], t: usize, k: usize| buf[t * stride + k * hd..t * stride + (k + 1) * hd].to_vec();
        if g.qk_norm != QkNormKind::None {
            let sums = f32s(take(tokens * 2 * 4));
            for t in 0..tokens {
                let row = &qkv[t * stride..];
                let sq: f32 = row[..qh * hd].iter().map(|x| x * x).sum();
                let sk: f32 = row[qh * hd..(qh + kvh) * hd].iter().map(|x| x * x).sum();
                assert!((sums[2 * t] - sq).abs() <= sq * 1e-4, "{name}: qk_sumsq q: {} vs {sq}", sums[2 * t]);
                assert!(
                    (sums[2 * t + 1] - 0.5 * sk).abs() <= sk * 1e-4,
                    "{name}: qk_sumsq k: {} vs {sk}",
                    sums[2 * t + 1]
                );
            }
            let normed = bf(take(tokens * stride * 2));
            for t in 0..tokens {
                for k in 0..qh + kvh {
                    let is_q = k < qh;
                    let x = head(&qkv, t, k);
                    let want: Vec<f32> = if all_heads {
                        // Global counts, the all-reduced sums, the head's weight slice.
                        let (ss, n, w, g0) = if is_q {
                            (sums_in[2 * t], heads * hd, &qw, qh0 + k)
                        } else {
                            (sums_in[2 * t + 1], kv_heads * hd, &kw, kvh0 + k - qh)
                        };
                        let inv = 1.0 / (ss / n as f32 + eps).sqrt();
                        x.iter().enumerate().map(|(i, v)| v * inv * w[g0 * hd + i]).collect()
                    } else {
                        rms_norm(&x, if is_q { &qw } else { &kw }, eps)
                    };
                    let got = head(&normed, t, k);
                    for i in 0..hd {
                        assert!(
                            close(got[i], want[i], 1e-3),
                            "{name}: qk_norm token {t} head {k} [{i}]: {} vs {}",
                            got[i],
                            want[i]
                        );
                    }
                }
                // v is untouched.
                assert_eq!(
                    &normed[t * stride + (qh + kvh) * hd..t * stride + (qh + 2 * kvh) * hd],
                    &qkv[t * stride + (qh + kvh) * hd..t * stride + (qh + 2 * kvh) * hd]
                );
            }
        }
        if g.qk_norm != QkNormKind::None {
            // Every head on the rank, local sums (EP's path).
            let local = bf(take(tokens * stride * 2));
            for t in 0..tokens {
                let row = &qkv[t * stride..];
                let ssq: f32 = row[..heads * hd].iter().map(|x| x * x).sum();
                let ssk: f32 = row[heads * hd..(heads + kv_heads) * hd].iter().map(|x| x * x).sum();
                for k in 0..heads + kv_heads {
                    let is_q = k < heads;
                    let x = head(&qkv, t, k);
                    let (w, g0) = if is_q { (&qw, k) } else { (&kw, k - heads) };
                    let want: Vec<f32> = if all_heads {
                        let (ss, n) = if is_q { (ssq, heads * hd) } else { (ssk, kv_heads * hd) };
                        let inv = 1.0 / (ss / n as f32 + eps).sqrt();
                        x.iter().enumerate().map(|(i, v)| v * inv * w[g0 * hd + i]).collect()
                    } else {
                        rms_norm(&x, w, eps)
                    };
                    let got = head(&local, t, k);
                    for i in 0..hd {
                        assert!(
                            close(got[i], want[i], 1e-3),
                            "{name}: local qk_norm token {t} head {k} [{i}]: {} vs {}",
                            got[i],
                            want[i]
                        );
                    }
                }
            }
        }
        let roped = bf(take(tokens * stride * 2));
        let rope = Rope::new(g.rope_dim as usize, m.rope_theta, m.rope_scaling.as_ref());
        for t in 0..tokens {
            for k in 0..qh + kvh {
                let mut want = head(&qkv, t, k);
                rope.apply(&mut want, positions[t] as usize);
                let got = head(&roped, t, k);
                for i in 0..hd {
                    assert!(
                        close(got[i], want[i], 4e-3),
                        "{name}: rope token {t} (pos {}) head {k} [{i}]: {} vs {}",
                        positions[t],
                        got[i],
                        want[i]
                    );
                }
            }
        }
        let pool = take(pool_bytes);
        let mut expect = vec![0u8; pool_bytes];
        let htb = g.head_token_bytes as usize;
        for t in 0..tokens {
            if slots[t] < 0 {
                continue;
            }
            let (page, tip) = (slots[t] as usize / 16, slots[t] as usize % 16);
            for gi in 0..kvh {
                let at = page * page_bytes + ((layer * kvh + gi) * 16 + tip) * htb;
                expect[at..at + hd * 2].copy_from_slice(&bf16_bytes(&head(&qkv, t, qh + gi)));
                expect[at + hd * 2..at + 4 * hd].copy_from_slice(&bf16_bytes(&head(&qkv, t, qh + kvh + gi)));
            }
        }
        assert!(pool == expect.as_slice(), "{name}: kv_write");
        // Paged attention against the twin's attend over the same pages.
        let attn = bf(take(tokens * heads * hd * 2));
        let group = heads / kv_heads;
        let at_of =
            |page: i32, gi: usize, j: usize| page as usize * page_bytes + ((layer * kvh + gi) * 16 + j % 16) * htb;
        let read =
            |at: usize| -> Vec<f32> { u16s(&apool[at..at + hd * 2]).into_iter().map(reference::bf16_to_f32).collect() };
        for t in 0..tokens {
            let table = tables[row_request[t] as usize];
            for hl in 0..qh {
                let gi = (qh0 + hl) / group - kvh0;
                let q = head(&qkv, t, hl);
                let want = attend(
                    &q,
                    apos[t] as usize + 1,
                    |j| read(at_of(table[j / 16], gi, j)),
                    |j| read(at_of(table[j / 16], gi, j) + hd * 2),
                );
                let got = &attn[t * heads * hd + hl * hd..t * heads * hd + (hl + 1) * hd];
                for i in 0..hd {
                    assert!(
                        close(got[i], want[i], 2e-3),
                        "{name}: attention row {t} head {hl} [{i}]: {} vs {}",
                        got[i],
                        want[i]
                    );
                }
            }
        }
        assert_eq!(at, out.len(), "{name}: output size");
    }
    assert!(gqa_checked >= 5, "only {gqa_checked} GQA examples");
    assert!(mla_checked >= 3, "only {mla_checked} MLA examples");
}

/// MLA's layer kernels against the twin's math: the latent norms
/// (`rms_norm`), interleaved RoPE (`Rope::interleaved`), the cache entry
/// layout, and the weight-absorbed decode attention as the twin computes it
/// (`q_lat = W_kᵀ q_nope`, scores over latent and rope key, `softmax_mix`
/// over the latents, `W_v · o_lat`).
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
fn check_mla<'a>(
    name: &str,
    a: &moeforge::plan::MlaLayerParams,
    m: &moeforge::dsl::spec::Model,
    take: &mut impl FnMut(usize) -> &'a [u8],
    qkv: &[f32],
    qaw: &[f32],
    kvaw: &[f32],
    kv_b: &[f32],
    apool: &[u8],
    page: usize,
    meta: &[i32],
    positions: &[i32],
    slots: &[i32],
    row_request: &[i32],
    apos: &[i32],
    layer: usize,
    local: usize,
    mw: usize,
) {
    use moeforge::runtime::twin::math::{rms_norm, softmax_mix, Rope};
    let tokens = positions.len();
    let s = a.qkv_stride as usize;
    let (kv_lora, nope, rope, vh) = (a.kv_lora as usize, a.nope as usize, a.rope as usize, a.v_head as usize);
    let (qo, ko, ql) = (a.q_offset as usize, a.kv_offset as usize, a.q_lora as usize);
    let qw = nope + rope;
    // The DSA indexer's key follows the rope key, then its query heads.
    let (ix_heads, ix_dim) = match m.attention {
        moeforge::dsl::spec::Attention::Mla { indexer: Some(ix), .. } => (ix.heads as usize, ix.head_dim as usize),
        _ => (0, 0),
    };
    let (ix_k, ix_q) = (ko + kv_lora + rope, ko + kv_lora + rope + ix_dim);
    if let Some(ix) = &a.indexer {
        assert_eq!(
            (ix.k_offset as usize, ix.q_offset as usize),
            (ix_k, ix_q),
            "{name}: the indexer's place in the row"
        );
    }
    let eps = m.rms_eps as f32;
    let bf = |b: &[u8]| u16s(b).into_iter().map(reference::bf16_to_f32).collect::<Vec<f32>>();
    let normed = bf(take(tokens * s * 2));
    for t in 0..tokens {
        let row = &qkv[t * s..(t + 1) * s];
        let mut want = row.to_vec();
        if ql > 0 {
            want[..ql].copy_from_slice(&rms_norm(&row[..ql], qaw, eps));
        }
        want[ko..ko + kv_lora].copy_from_slice(&rms_norm(&row[ko..ko + kv_lora], kvaw, eps));
        for i in 0..s {
            assert!(
                close(normed[t * s + i], want[i], 1e-3),
                "{name}: latent_norm token {t} [{i}]: {} vs {}",
                normed[t * s + i],
                want[i]
            );
        }
    }
    let roped = bf(take(tokens * s * 2));
    let r = Rope::new(rope, m.rope_theta, m.rope_scaling.as_ref()).interleaved();
    for t in 0..tokens {
        let mut want = qkv[t * s..(t + 1) * s].to_vec();
        for h in 0..local {
            r.apply(&mut want[qo + h * qw + nope..qo + (h + 1) * qw], positions[t] as usize);
        }
        r.apply(&mut want[ko + kv_lora..ko + kv_lora + rope], positions[t] as usize);
        // DSA: the indexer's query heads and its key, the first `rope` dims of each.
        for h in 0..ix_heads {
            r.apply(&mut want[ix_q + h * ix_dim..ix_q + h * ix_dim + rope], positions[t] as usize);
        }
        if ix_dim > 0 {
            r.apply(&mut want[ix_k..ix_k + rope], positions[t] as usize);
        }
        for i in 0..s {
            assert!(
                close(roped[t * s + i], want[i], 4e-3),
                "{name}: mla_rope token {t} (pos {}) [{i}]: {} vs {}",
                positions[t],
                roped[t * s + i],
                want[i]
            );
        }
    }
    let pool = take(4 * page);
    let eb = a.entry_bytes as usize;
    let mut expect = vec![0u8; 4 * page];
    for t in 0..tokens {
        if slots[t] < 0 {
            continue;
        }
        let at = (slots[t] as usize / 16) * page + (layer * 16 + slots[t] as usize % 16) * eb;
        expect[at..at + 2 * (kv_lora + rope + ix_dim)]
            .copy_from_slice(&bf16_bytes(&qkv[t * s + ko..t * s + ko + kv_lora + rope + ix_dim]));
    }
    assert!(pool == expect, "{name}: mla_kv_write");
    let attn = bf(take(tokens * a.heads as usize * vh * 2));
    let kvb = nope + vh;
    for t in 0..tokens {
        let q = row_request[t] as usize;
        let table = &meta[q * mw + 8..];
        let entry = |j: usize| -> Vec<f32> {
            let at = table[j / 16] as usize * page + (layer * 16 + j % 16) * eb;
            u16s(&apool[at..at + 2 * (kv_lora + rope)]).into_iter().map(reference::bf16_to_f32).collect()
        };
        let cached: Vec<Vec<f32>> = (0..=apos[t] as usize).map(entry).collect();
        for h in 0..local {
            let qh = &qkv[t * s + qo + h * qw..t * s + qo + (h + 1) * qw];
            let w = |r: usize| &kv_b[(h * kvb + r) * kv_lora..(h * kvb + r + 1) * kv_lora];
            let mut q_lat = vec![0f32; kv_lora];
            for d in 0..nope {
                q_lat.iter_mut().zip(w(d)).for_each(|(x, y)| *x += qh[d] * y);
            }
            let scores: Vec<f32> = cached
                .iter()
                .map(|e| {
                    let n: f32 = q_lat.iter().zip(&e[..kv_lora]).map(|(x, y)| x * y).sum();
                    let r: f32 = qh[nope..].iter().zip(&e[kv_lora..]).map(|(x, y)| x * y).sum();
                    (n + r) * a.softmax_scale as f32
                })
                .collect();
            let o_lat = softmax_mix(&scores, kv_lora, |j| &cached[j][..kv_lora]);
            for v in 0..vh {
                let want: f32 = w(nope + v).iter().zip(&o_lat).map(|(x, y)| x * y).sum();
                let got = attn[t * a.heads as usize * vh + h * vh + v];
                assert!(close(got, want, 2e-3), "{name}: mla attention row {t} head {h} [{v}]: {got} vs {want}");
            }
        }
    }
}

/// The emitted replica routing (`kernels/zepp_route.cu`: `zepp_count`, then
/// `zepp_route`) on the emulated device, on random instances (1–4 nodes of
/// 1–4 GPUs; 2–41 experts in 1–4 slots per GPU, or, one case in eight,
/// 257–316 experts dealt over the GPUs with a replica more on each, so
/// threads stride over experts; skewed top-k picks; every source or a
/// random dispatch group), against the runtime's host routing
/// (`moeforge_plan::placement::route` and `row_queues`, a separate Rust
/// implementation): the physical slot of every entry of every source, for
/// Zepp (GLM-5's example: water-filling and consolidation) and EPLB
/// (DeepSeek-V3's: the even split). Demand rows of GPUs outside the group
/// hold garbage the kernel must ignore, and the work area keeps the last
/// instance's values. (Seeded: skipping the consolidation, flipping its
/// tie-break or reversing the water-filling's last-row order each fails it.)
#[test]
fn emitted_replica_routing_matches_the_host_routing() {
    use moeforge::dsl::spec::PlacementPolicy;
    use moeforge::plan::memory::ZeppRouteParts;
    use moeforge::plan::placement::{route, row_queues, PlacementPlan, Topology};
    use moeforge::runtime::device::emu::EmuDevice;
    use moeforge::runtime::device::{Device, KernelArg};
    use std::collections::BTreeMap;
    const BYTES: u64 = 1 << 20;
    const ROUTE: u64 = 1 << 16;
    for (example, policy) in [("glm-5-h800x24", PlacementPolicy::Zepp), ("deepseek-v3-h100x32", PlacementPolicy::Eplb)]
    {
        let e = emit(&root().join(format!("examples/{example}.moe")));
        let placement = e.plan.placement.as_ref().unwrap();
        assert_eq!(placement.policy, policy);
        let src = text(&e.files["kernels/zepp_route.cu"]);
        let cache = tempfile::tempdir().unwrap();
        let mut dev = EmuDevice::start(cache.path()).unwrap();
        let module = dev.load("zepp_route", &src, None).unwrap();
        let bufs: Vec<_> = (0..16).map(|_| dev.alloc(BYTES).unwrap()).collect();
        let ptr = |g: usize, offset: u64| KernelArg::Ptr { buffer: bufs[g], offset };
        let int = |x: usize| KernelArg::I32(x as i32);
        let mut rng = Rng(0x5eed ^ policy as u64);
        let (mut instances, mut entries, mut remote, mut uneven) = (0usize, 0usize, 0usize, 0usize);
        for case in 0..80 {
            let (nodes, gpn) = (1 + rng.below(4), 1 + rng.below(4));
            let w = nodes * gpn;
            let wide = case % 8 == 7;
            let experts = if wide { 257 + rng.below(60) } else { 2 + rng.below(40) };
            let k = 1 + rng.below(4.min(experts));
            let slots: Vec<Vec<u32>> = if wide {
                // Every expert dealt once, then one more replica on each GPU.
                let mut v: Vec<Vec<u32>> = vec![vec![]; w];
                for (i, e) in rng.permutation(experts).into_iter().enumerate() {
                    v[i % w].push(e as u32);
                }
                for held in v.iter_mut() {
                    if let Some(extra) = (0..experts as u32).find(|e| !held.contains(e)) {
                        held.push(extra);
                    }
                }
                v
            } else {
                let s = 1 + rng.below(4.min(experts));
                (0..w).map(|_| rng.permutation(experts)[..s].iter().map(|&x| x as u32).collect()).collect()
            };
            let s = slots.iter().map(Vec::len).max().unwrap();
            let group: Vec<usize> =
                if rng.below(3) == 0 { (0..w).filter(|_| rng.below(3) > 0).collect() } else { (0..w).collect() };
            if group.is_empty() {
                continue;
            }
            instances += 1;
            // Skewed picks: low ids are hot.
            let ids_of: BTreeMap<usize, Vec<i32>> = group
                .iter()
                .map(|&g| {
                    let mut ids = vec![];
                    for _ in 0..rng.below(24) {
                        let mut token: Vec<i32> = vec![];
                        while token.len() < k {
                            let x = rng.below(experts).min(rng.below(experts)) as i32;
                            if !token.contains(&x) {
                                token.push(x);
                            }
                        }
                        ids.extend(token);
                    }
                    (g, ids)
                })
                .collect();
            // The host routing over the group's slots.
            let table: Vec<Vec<u32>> =
                (0..w).map(|r| if group.contains(&r) { slots[r].clone() } else { vec![] }).collect();
            let mut demand = vec![vec![0f64; experts]; w];
            for (&g, ids) in &ids_of {
                for &x in ids {
                    demand[g][x as usize] += 1.0;
                }
            }
            let routing = route(policy, &table, &demand, Topology { nodes, gpus_per_node: gpn }, placement.slack);
            // The device: counts, the exchange (by the test), the routing.
            let width = PlacementPlan { replicas: vec![slots.clone()], ..placement.clone() }.max_replicas();
            let parts = ZeppRouteParts::of(w as u64, experts as u64, width as u64, 1024);
            let row = |g: usize| ROUTE + parts.demand + (g * experts * 4) as u64;
            for (&g, ids) in &ids_of {
                dev.upload(bufs[g], 0, &le(ids)).unwrap();
                dev.launch(
                    module,
                    "zepp_count",
                    experts.div_ceil(256) as u32,
                    256,
                    &[
                        ptr(g, 0),
                        int(ids.len()),
                        int(experts),
                        ptr(g, row(g)),
                        KernelArg::Null,
                        KernelArg::Null,
                        int(1),
                    ],
                )
                .unwrap();
            }
            let member: Vec<i32> = (0..w).map(|r| i32::from(group.contains(&r))).collect();
            let tbl = PlacementPlan::replica_table(&slots, experts, s, width);
            for (&g, ids) in ids_of.iter().filter(|(_, ids)| !ids.is_empty()) {
                for r in 0..w {
                    let counts = match ids_of.get(&r) {
                        Some(_) => dev.download(bufs[r], row(r), (experts * 4) as u64).unwrap(),
                        None => le(&vec![7; experts]),
                    };
                    dev.upload(bufs[g], row(r), &counts).unwrap();
                }
                dev.upload(bufs[g], ROUTE + parts.member, &le(&member)).unwrap();
                dev.upload(bufs[g], 4096, &le(&tbl)).unwrap();
                dev.launch(
                    module,
                    "zepp_route",
                    1,
                    256,
                    &[
                        ptr(g, 0),
                        int(ids.len()),
                        ptr(g, ROUTE + parts.demand),
                        ptr(g, 4096),
                        ptr(g, ROUTE + parts.member),
                        int(experts),
                        int(width),
                        int(w),
                        int(gpn),
                        int(s),
                        int(g),
                        ptr(g, ROUTE + parts.work),
                        ptr(g, ROUTE + parts.dest),
                    ],
                )
                .unwrap();
                let got = i32s(&dev.download(bufs[g], ROUTE + parts.dest, (ids.len() * 4) as u64).unwrap());
                let mut take = row_queues(&routing[g]);
                let want: Vec<i32> = ids
                    .iter()
                    .map(|&x| {
                        take[x as usize]
                            .next()
                            .map_or(-1, |d| (d * s + slots[d].iter().position(|&y| y as i32 == x).unwrap()) as i32)
                    })
                    .collect();
                assert_eq!(got, want, "{example} case {case}: source {g} of {nodes}x{gpn}, group {group:?}");
                for (&d, &x) in got.iter().zip(ids) {
                    if d < 0 {
                        continue;
                    }
                    let d = d as usize / s;
                    entries += 1;
                    remote += usize::from(d / gpn != g / gpn);
                    // Not the replica the even split would start at.
                    let reps: Vec<usize> = (0..w).filter(|&r| table[r].contains(&(x as u32))).collect();
                    uneven += usize::from(reps.len() > 1 && d != reps[0]);
                }
            }
        }
        // The instances exercised every tier and several replicas.
        assert!(instances >= 60, "{example}: {instances} instances");
        assert!(entries > 1000 && remote > 0 && uneven > 0, "{example}: {entries} entries, {remote} remote, {uneven}");
    }
}

#[path = "../benches/common/routing_cases.rs"]
mod routing_cases;

/// The emitted Zepp routing at DeepSeek-V3's scale: the decode case of
/// `cargo bench --bench routing` and the GPU check's routing step (4 × 8
/// GPUs, 256 experts, 32 redundant replicas, the hottest expert on 14 GPUs;
/// every source's 64 tokens' top-8 entries over 4 nodes) through GLM-5's
/// `zepp_route` on the emulated device: every source's entries get the
/// slots the host routing gives them, and the per-expert bounds sit where
/// the plan says (`ZeppRouteParts::bounds`). (Skipping the consolidation leaves
/// this case's routing unchanged: most experts have one replica, so each
/// remote node a source sends to holds rows with nowhere else to go; the
/// random instances of `emitted_replica_routing_matches_the_host_routing`
/// exercise it.)
#[test]
fn emitted_zepp_routing_matches_the_host_routing_at_deepseek_v3_scale() {
    use moeforge::plan::memory::ZeppRouteParts;
    use moeforge::runtime::device::emu::EmuDevice;
    use moeforge::runtime::device::{Device, KernelArg};
    let case = routing_cases::cases_of(&["decode"]).pop().expect("the decode case");
    let r = routing_cases::routed(&case);
    let (w, gpn, experts) = (case.t.world(), case.t.gpus_per_node, case.demand[0].len());
    assert!((w, experts) == (32, 256) && r.reps > 2, "{w} GPUs, {experts} experts, {} wide", r.reps);
    let e = emit(&root().join("examples/glm-5-h800x24.moe"));
    let cache = tempfile::tempdir().unwrap();
    let mut dev = EmuDevice::start(cache.path()).unwrap();
    let module = dev.load("zepp_route", &text(&e.files["kernels/zepp_route.cu"]), None).unwrap();
    let threads = e.plan.kernels.iter().find(|k| k.name == "zepp_route").unwrap().entries[1].block;
    let most = r.ids.iter().map(Vec::len).max().unwrap();
    let parts = ZeppRouteParts::of(w as u64, experts as u64, r.reps as u64, most as u64);
    let (ids_at, table_at, route) = (0u64, (w * most * 4) as u64, (w * most * 4 + r.table.len() * 4) as u64);
    let buf = dev.alloc(route + parts.bytes).unwrap();
    let ptr = |offset: u64| KernelArg::Ptr { buffer: buf, offset };
    let int = |x: usize| KernelArg::I32(x as i32);
    dev.upload(buf, table_at, &le(&r.table)).unwrap();
    dev.upload(buf, route + parts.member, &le(&vec![1; w])).unwrap();
    let ids = |s: usize| ids_at + (s * most * 4) as u64;
    for (s, mine) in r.ids.iter().enumerate() {
        dev.upload(buf, ids(s), &le(mine)).unwrap();
        let row = route + parts.demand + (s * experts * 4) as u64;
        let blocks = experts.div_ceil(threads as usize) as u32;
        dev.launch(
            module,
            "zepp_count",
            blocks,
            threads,
            &[ptr(ids(s)), int(mine.len()), int(experts), ptr(row), KernelArg::Null, KernelArg::Null, int(1)],
        )
        .unwrap();
    }
    let (mut entries, mut remote) = (0, 0);
    for (s, mine) in r.ids.iter().enumerate() {
        dev.launch(
            module,
            "zepp_route",
            1,
            threads,
            &[
                ptr(ids(s)),
                int(mine.len()),
                ptr(route + parts.demand),
                ptr(table_at),
                ptr(route + parts.member),
                int(experts),
                int(r.reps),
                int(w),
                int(gpn),
                int(r.per),
                int(s),
                ptr(route + parts.work),
                ptr(route + parts.dest),
            ],
        )
        .unwrap();
        let got = i32s(&dev.download(buf, route + parts.dest, (mine.len() * 4) as u64).unwrap());
        assert!(got == r.dest[s], "source {s}: the kernel's slots differ from the host routing's");
        entries += got.len();
        remote += got.iter().filter(|&&d| d >= 0 && d as usize / r.per / gpn != s / gpn).count();
    }
    assert!(entries > 15_000 && remote > 0, "{entries} entries, {remote} remote");
    // The bounds the routing wrote at their place in the work area: each
    // replica of expert e takes at most ⌈1.1 · rows_e / replicas_e⌉ (Zepp
    // §4.1's relaxed balance constraint, the placement's 10% slack).
    let bounds = i32s(&dev.download(buf, route + parts.bounds, (experts * 4) as u64).unwrap());
    let reps = moeforge::plan::placement::replicas_of(&case.slots, experts);
    for (e, &b) in bounds.iter().enumerate() {
        let rows: f64 = case.demand.iter().map(|d| d[e]).sum();
        let want = if reps[e].is_empty() { 0.0 } else { (1.1 * rows / reps[e].len() as f64).ceil() };
        assert_eq!(f64::from(b), want, "expert {e}: {rows} rows over {} replicas", reps[e].len());
    }
}

fn le(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
