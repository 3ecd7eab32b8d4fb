//! Invariants of the memory plan and the weight reshard (Moebius §3.1, §4.2),
//! as property tests over random model shapes and rank counts. The reshard
//! descriptors are executed element by element on simulated rank buffers.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use moeforge_codegen::plan_deployment;
use moeforge_dsl::spec::DeployId;
use moeforge_plan::memory::{Copy, LayerOrder, MemoryPlan, Mode, Shard, View, WeightReshard};
use moeforge_plan::validate::memory_violations;
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Shape {
    p: u32,
    layers: u32,
    dense: u32,
    hidden: u32,
    experts: u32,
    ffn: u32,
    heads: u32,
    kv_heads: u32,
}

fn spec_text(s: &Shape) -> String {
    let dense = if s.dense > 0 { format!("dense {{ layers = {} ffn = {} }}", s.dense, s.ffn) } else { String::new() };
    format!(
        r#"model m {{ layers = {layers} hidden = {hidden} vocab = 64 {dense}
  attention gqa {{ heads = {heads} kv_heads = {kv} head_dim = 16 qk_norm = true }}
  moe {{ experts = {e} top_k = 2 expert_ffn = {ffn} routing softmax_topk {{ norm_topk = true }} }} }}
cluster c {{ nodes = 1 gpus_per_node = {p}
  gpu cpu {{ arch = sm_90a sms = 4 hbm = 2GB hbm_bandwidth = 1TB/s bf16 = 1000TFLOP/s smem_per_sm = 228KiB smem_per_block = 227KiB }}
  scale_up nvlink {{ bandwidth = 450GB/s latency = 2us }} }}
tiles t {{ prefill {{ gate_up {{ block_m = 64 block_n = 64 block_k = 64 stages = 2 }} down {{ block_m = 64 block_n = 64 block_k = 64 stages = 2 }} }}
  decode {{ gate_up {{ block_m = 64 block_n = 64 block_k = 64 stages = 2 }} down {{ block_m = 64 block_n = 64 block_k = 64 stages = 2 }} }} }}
deploy d {{ model = m cluster = c tiles = t slo {{ ttft = 1s tpot = 50ms }}
  workload {{ input = sharegpt output = sharegpt arrival poisson {{ rate = 1req/s }} }}
  switch {{ t_high = 64 }} memory_fraction = 0.5 }}
"#,
        layers = s.layers,
        hidden = s.hidden,
        heads = s.heads,
        kv = s.kv_heads,
        e = s.experts,
        ffn = s.ffn,
        p = s.p,
    )
}

fn shapes() -> impl Strategy<Value = Shape> {
    (0u32..4, 1u32..4, 0u32..2, 1u32..4, 1u32..5, 1u32..4, 0u32..3).prop_map(|(lp, layers, dense, hm, em, im, kvs)| {
        let p = 1 << lp; // 1, 2, 4, 8
                         // Powers of two: either P divides the KV heads or they divide P.
        let kv_heads = [1, 2, 4][kvs as usize];
        Shape {
            p,
            layers: layers + dense,
            dense,
            hidden: 64 * hm,
            experts: (p * em).max(2),
            ffn: 8 * p * im,
            heads: (kv_heads.max(p)) * 2,
            kv_heads,
        }
    })
}

fn plan_for(s: &Shape) -> moeforge_plan::Plan {
    let checked = moeforge_dsl::check_str("p.moe", &spec_text(s)).unwrap_or_else(|f| panic!("{}", f.render(false)));
    let plan =
        plan_deployment(&checked, DeployId(0)).unwrap_or_else(|d| panic!("{}", d.render(&checked.sources, false)));
    plan.into_plan()
}

fn expert_view<'a>(m: &'a MemoryPlan, mode: Mode, w: &str) -> &'a View {
    m.views.iter().find(|v| v.mode == mode && v.tensor.ends_with(w)).unwrap()
}

/// A tag naming one element of the global expert weights: (moe layer, expert,
/// matrix 0 = W13 / 1 = W2, row, col) packed into a u64, 0 meaning "empty".
fn tag(l: u64, g: u64, w: u64, row: u64, col: u64) -> u64 {
    1 + (((l * 4096 + g) * 2 + w) * 65536 + row) * 65536 + col
}

/// Writes the global weights through one mode's expert views (the loader's job).
fn load(m: &MemoryPlan, mode: Mode, s: &Shape, bufs: &mut [Vec<u64>]) {
    let (p, e, i, h) = (s.p as u64, s.experts as u64, s.ffn as u64, s.hidden as u64);
    let w13 = expert_view(m, mode, ".w13");
    let w2 = expert_view(m, mode, ".w2");
    for (r, buf) in bufs.iter_mut().enumerate() {
        let r = r as u64;
        for l in 0..u64::from(m.slots.moe_layers) {
            let layer = m.slots.first_moe_layer + l as u32;
            let (b13, b2) = (w13.offset_of(layer) / 2, w2.offset_of(layer) / 2);
            match mode {
                Mode::Ep => {
                    let el = e / p;
                    for x in 0..el {
                        let g = r * el + x;
                        for row in 0..2 * i {
                            for col in 0..h {
                                buf[(b13 + (x * 2 * i + row) * h + col) as usize] = tag(l, g, 0, row, col);
                            }
                        }
                        for row in 0..h {
                            for col in 0..i {
                                buf[(b2 + (x * h + row) * i + col) as usize] = tag(l, g, 1, row, col);
                            }
                        }
                    }
                }
                Mode::Tp => {
                    let ip = i / p;
                    for g in 0..e {
                        for row in 0..2 * ip {
                            // the shard holds gate rows then up rows of slice r
                            let global_row = if row < ip { r * ip + row } else { i + r * ip + (row - ip) };
                            for col in 0..h {
                                buf[(b13 + (g * 2 * ip + row) * h + col) as usize] = tag(l, g, 0, global_row, col);
                            }
                        }
                        for row in 0..h {
                            for col in 0..ip {
                                buf[(b2 + (g * h + row) * ip + col) as usize] = tag(l, g, 1, row, r * ip + col);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The element indices (u64 = 2 bytes) of mode `mode`'s expert views on a rank, for one layer.
fn view_elems(m: &MemoryPlan, mode: Mode, layer: u32) -> Vec<u64> {
    let mut v = Vec::new();
    for w in [".w13", ".w2"] {
        let x = expert_view(m, mode, w);
        let a = x.offset_of(layer) / 2;
        v.extend(a..a + x.bytes() / 2);
    }
    v
}

/// Runs a reshard on the buffers, checking that no copy overwrites an element
/// that is still to be read and that every target element is written once.
fn execute(m: &MemoryPlan, w: &WeightReshard, bufs: &mut [Vec<u64>]) -> Result<(), String> {
    let n = m.slots.moe_layers;
    // Elements of the source mode not yet read, per rank.
    let mut pending: Vec<Vec<bool>> = bufs.iter().map(|b| vec![false; b.len()]).collect();
    for l in 0..n {
        for pend in pending.iter_mut() {
            for e in view_elems(m, w.from, m.slots.first_moe_layer + l) {
                pend[e as usize] = true;
            }
        }
    }
    let order: Vec<u32> = match w.order {
        LayerOrder::Ascending => (0..n).collect(),
        LayerOrder::Descending => (0..n).rev().collect(),
    };
    let mut written: Vec<Vec<u8>> = bufs.iter().map(|b| vec![0u8; b.len()]).collect();
    for l in order {
        let src_base = m.slots.base + u64::from(l + w.src_shift) * m.slots.slot_bytes;
        let dst_base = m.slots.base + u64::from(l + w.dst_shift) * m.slots.slot_bytes;
        // All copies of one layer run concurrently: read everything first.
        let mut moves: Vec<(usize, usize, u64)> = Vec::new();
        let mut reads: Vec<(usize, usize)> = Vec::new();
        for c in &w.per_layer {
            for (so, dof) in c.runs() {
                for k in 0..c.run_bytes / 2 {
                    let src = ((src_base + so) / 2 + k) as usize;
                    let dst = ((dst_base + dof) / 2 + k) as usize;
                    moves.push((c.dst_rank as usize, dst, bufs[c.src_rank as usize][src]));
                    reads.push((c.src_rank as usize, src));
                }
            }
        }
        for &(rank, dst, _) in &moves {
            if pending[rank][dst] {
                return Err(format!("layer {l}: rank {rank} element {dst} overwritten before it was read"));
            }
        }
        for &(rank, src) in &reads {
            pending[rank][src] = false;
        }
        for (rank, dst, v) in moves {
            bufs[rank][dst] = v;
            written[rank][dst] += 1;
        }
    }
    // Every element of every target view written exactly once, nothing else written.
    for (r, wr) in written.iter().enumerate() {
        let mut expected = vec![0u8; wr.len()];
        for l in 0..n {
            for e in view_elems(m, w.to, m.slots.first_moe_layer + l) {
                expected[e as usize] += 1;
            }
        }
        if *wr != expected {
            let at = wr.iter().zip(&expected).position(|(a, b)| a != b).unwrap_or(0);
            return Err(format!("rank {r}: element {at} written {} times, expected {}", wr[at], expected[at]));
        }
    }
    Ok(())
}

fn snapshot(m: &MemoryPlan, mode: Mode, bufs: &[Vec<u64>]) -> Vec<Vec<u64>> {
    bufs.iter()
        .map(|b| {
            (0..m.slots.moe_layers)
                .flat_map(|l| view_elems(m, mode, m.slots.first_moe_layer + l))
                .map(|e| b[e as usize])
                .collect()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, .. ProptestConfig::default() })]

    #[test]
    fn reshard_moves_every_expert_byte_once_in_place_and_round_trips(s in shapes()) {
        let p = plan_for(&s);
        let m = &p.memory;
        prop_assert_eq!(&m.modes, &vec![Mode::Tp, Mode::Ep], "{:?}", m.single_mode_reason);
        prop_assert!(memory_violations(&p).is_empty(), "{:?}", memory_violations(&p));
        let rs = m.reshard.clone().unwrap();
        // Element buffers covering the expert region only.
        let end = (m.slots.base + m.slots.slot_bytes * (u64::from(m.slots.moe_layers) + 1)) / 2;
        let mut bufs: Vec<Vec<u64>> = (0..s.p).map(|_| vec![0u64; end as usize]).collect();
        load(m, Mode::Ep, &s, &mut bufs);
        let ep_before = snapshot(m, Mode::Ep, &bufs);

        execute(m, &rs.ep_to_tp, &mut bufs).map_err(TestCaseError::fail)?;
        // The TP views hold exactly what loading TP directly would give.
        let mut direct: Vec<Vec<u64>> = (0..s.p).map(|_| vec![0u64; end as usize]).collect();
        load(m, Mode::Tp, &s, &mut direct);
        prop_assert_eq!(snapshot(m, Mode::Tp, &bufs), snapshot(m, Mode::Tp, &direct));

        execute(m, &rs.tp_to_ep, &mut bufs).map_err(TestCaseError::fail)?;
        prop_assert_eq!(snapshot(m, Mode::Ep, &bufs), ep_before, "EP→TP→EP is not the identity");

        // Bytes over links equal the owner-changed bytes, counted independently
        // from the TP elements whose EP owner is another rank.
        let el = u64::from(s.experts / s.p);
        let mut changed = 0u64;
        for (q, b) in direct.iter().enumerate() {
            for x in view_elems(m, Mode::Tp, m.slots.first_moe_layer) {
                let t = b[x as usize] - 1;
                let g = (t / 65536 / 65536 / 2) % 4096;
                if g / el != q as u64 { changed += 2; }
            }
        }
        for w in [&rs.ep_to_tp, &rs.tp_to_ep] {
            let remote: u64 = w.per_layer.iter().filter(|c: &&Copy| c.src_rank != c.dst_rank).map(Copy::bytes).sum();
            prop_assert_eq!(remote, changed);
            prop_assert_eq!(w.interconnect_bytes_per_layer, changed);
            prop_assert_eq!(w.owner_changed_bytes_per_layer, changed);
        }
    }

    #[test]
    fn views_of_one_mode_never_overlap_and_kv_capacity_follows_heads(s in shapes()) {
        let p = plan_for(&s);
        let m = &p.memory;
        prop_assert!(memory_violations(&p).is_empty(), "{:?}", memory_violations(&p));
        let tp = m.kv.tp.clone().unwrap();
        // TP stores max(1, kv/P) heads per rank; EP all kv heads of its own requests.
        prop_assert_eq!(tp.heads_per_rank, (s.kv_heads / s.p).max(1));
        prop_assert_eq!(m.kv.ep.heads_per_rank, s.kv_heads);
        prop_assert_eq!(m.kv.replication, (s.p / s.kv_heads).max(1));
        // Group capacity ratio EP:TP = replication (pages are exact multiples up to rounding).
        let ratio = m.kv.ep.capacity_tokens as f64 / tp.capacity_tokens as f64;
        prop_assert!((ratio - f64::from(m.kv.replication)).abs() < 0.01 * ratio, "ratio {ratio}");
        // Every rank's TP heads are a valid block, and together they cover every KV head.
        let mut covered = vec![0u32; s.kv_heads as usize];
        for [a, b] in &m.kv.tp_heads { for h in *a..*b { covered[h as usize] += 1; } }
        prop_assert!(covered.iter().all(|&c| c == m.kv.replication));
        // Attention head shards: TP views are 1/P of the full query heads.
        let q_full = m.views.iter().find(|v| v.mode == Mode::Ep && v.tensor.ends_with("q_proj.weight")).unwrap();
        let q_tp = m.views.iter().find(|v| v.mode == Mode::Tp && v.tensor.ends_with("q_proj.weight")).unwrap();
        prop_assert_eq!(q_tp.shape[0] * u64::from(s.p), q_full.shape[0]);
        let sharded = matches!(q_tp.shard, Shard::Heads { .. });
        prop_assert!(sharded);
        prop_assert_ne!(&q_tp.region, &q_full.region);
    }
}

#[test]
fn qwen3_235b_on_8_h200_matches_the_papers_memory_figures() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/qwen3-235b-a22b-h200.moe");
    let checked = moeforge_dsl::check_paths(&[path], &moeforge_dsl::FsLoader).unwrap();
    let plan = plan_deployment(&checked, DeployId(0)).unwrap();
    let m = &plan.plan().memory;
    assert_eq!(m.modes, vec![Mode::Tp, Mode::Ep]);
    // Moebius §6.6: 2.4% (2.8 GB) of the per-GPU budget; this plan must do no worse.
    assert!(m.overhead.overhead_fraction <= 0.024, "{:?}", m.overhead);
    // 4 KV heads on 8 ranks: TP replicates each head twice and halves capacity.
    assert_eq!(m.kv.replication, 2);
    let tp = m.kv.tp.as_ref().unwrap();
    let half = m.kv.ep.capacity_tokens as f64 / 2.0;
    assert!((tp.capacity_tokens as f64 - half).abs() < 1e-3 * half, "{} vs {half}", tp.capacity_tokens);
    let rs = m.reshard.as_ref().unwrap();
    assert_eq!(rs.ep_to_tp.interconnect_bytes_per_layer, rs.ep_to_tp.owner_changed_bytes_per_layer);
}
