//! Random small deployments as `.moe` text, for the planner's property test
//! (`tests/planner.rs`) and its cargo-fuzz target (`fuzz/fuzz_targets/plan.rs`,
//! which includes this file). Every choice is drawn from a [`Draw`], so the
//! same bytes give the same spec. Values are picked around the edges the
//! checker accepts: one SM, one GPU, tiny HBM, odd expert counts, odd tiles,
//! clusters larger than the GPU, fp8 with and without block scales.

#![allow(dead_code)] // each user takes one of the two sources

/// A source of choices: fuzz bytes, or a seeded generator.
pub trait Draw {
    /// A value in `[0, n)`.
    fn below(&mut self, n: u32) -> u32;
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u32) as usize]
    }
    fn coin(&mut self) -> bool {
        self.below(2) == 1
    }
}

/// Choices read from fuzz input; zeros once it runs out.
pub struct Bytes<'a>(pub &'a [u8]);

impl Draw for Bytes<'_> {
    fn below(&mut self, n: u32) -> u32 {
        let (head, rest) = match self.0 {
            [a, b, rest @ ..] => (u32::from(*a) << 8 | u32::from(*b), rest),
            [a] => (u32::from(*a), &[][..]),
            [] => (0, &[][..]),
        };
        self.0 = rest;
        if n == 0 {
            0
        } else {
            head % n
        }
    }
}

/// Choices from SplitMix64.
pub struct Seeded(pub u64);

impl Draw for Seeded {
    fn below(&mut self, n: u32) -> u32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        if n == 0 {
            0
        } else {
            (z % u64::from(n)) as u32
        }
    }
}

fn tile(d: &mut impl Draw, arch_90: bool, m: u32, k: u32) -> String {
    let n = d.pick(&[16u32, 64, 128, 128, 128, 256]);
    // Mostly the ring's one depth; sometimes another.
    let k = if d.below(8) == 0 { d.pick(&[32u32, 64, 128]) } else { k };
    let cluster = if arch_90 { format!("cluster = [{}, 1]", d.pick(&[1u32, 1, 1, 2, 2, 4])) } else { String::new() };
    let stages = d.pick(&[1u32, 2, 3, 4, 6]);
    format!("{{ block_m = {m} block_n = {n} block_k = {k} {cluster} stages = {stages} }}")
}

/// A whole spec: one model, cluster, tile set and deployment.
pub fn spec_text(d: &mut impl Draw) -> String {
    let layers = d.pick(&[1u32, 2, 3, 4, 7]);
    let hidden = d.pick(&[64u32, 72, 128, 256, 1000, 2048]);
    let vocab = d.pick(&[16u32, 100, 512]);
    let heads = d.pick(&[1u32, 2, 4, 8, 16]);
    let kv_heads = d.pick(&[1u32, 2, 4, 8]).min(heads);
    let head_dim = d.pick(&[8u32, 16, 64, 128]);
    let attention = if d.below(4) == 0 {
        format!(
            "attention mla {{ heads = {heads} {} kv_lora = {} qk_nope = {} qk_rope = {} v_head = {} }}",
            if d.coin() { format!("q_lora = {}", d.pick(&[16u32, 64])) } else { String::new() },
            d.pick(&[16u32, 64, 512]),
            d.pick(&[8u32, 32]),
            d.pick(&[8u32, 16, 64]),
            d.pick(&[8u32, 32])
        )
    } else {
        format!(
            "attention gqa {{ heads = {heads} kv_heads = {kv_heads} head_dim = {head_dim} qk_norm = {} }}",
            d.coin()
        )
    };
    let experts = d.pick(&[1u32, 2, 3, 7, 8, 16, 32, 33, 64, 128, 256, 257]);
    let top_k = d.pick(&[1u32, 2, 4, 8]).min(experts);
    let ffn = d.pick(&[8u32, 24, 32, 128, 768]);
    let dense = if layers > 1 && d.coin() {
        format!("dense {{ layers = 1 ffn = {} }}", d.pick(&[16u32, 96]))
    } else {
        String::new()
    };
    let shared = if d.coin() { format!("shared_experts = 1 shared_ffn = {ffn}") } else { String::new() };
    let routing = if d.coin() && experts >= 2 {
        let groups = d.pick(&[1u32, 2, 4]).min(experts);
        let groups = if experts.is_multiple_of(groups) { groups } else { 1 };
        format!(
            "routing sigmoid_grouped {{ groups = {groups} top_groups = {} scaling = 2.5 norm_topk = true bias = {} }}",
            d.pick(&[1u32, 2]).min(groups),
            d.coin()
        )
    } else {
        format!("routing softmax_topk {{ norm_topk = {} }}", d.coin())
    };
    let dtype = match d.below(8) {
        0 => "dtype { weights = bf16 experts = fp8_e4m3 activations = bf16 block_scale = [128, 128] }".to_string(),
        1 if d.below(4) == 0 => format!(
            "dtype {{ weights = fp8_e4m3 experts = fp8_e4m3 block_scale = [{}, {}] }}",
            d.pick(&[64u32, 128]),
            d.pick(&[64u32, 128])
        ),
        _ => "dtype { weights = bf16 }".to_string(),
    };
    let arch_90 = d.below(4) != 0;
    let nodes = d.pick(&[1u32, 1, 2, 3]);
    let gpn = d.pick(&[1u32, 2, 3, 4, 8]);
    let sms = d.pick(&[1u32, 2, 3, 7, 8, 16, 132, 132]);
    let hbm = d.pick(&["64MB", "1GB", "4GB", "80GB"]);
    let scale_out = if nodes > 1 { "scale_out ib { nics_per_node = 2 bandwidth = 200Gb/s latency = 5us }" } else { "" };
    let ms: &[u32] = if arch_90 { &[64, 64, 128, 128, 192] } else { &[16, 32, 64, 128] };
    let pm = d.pick(ms);
    let dm = d.pick(ms);
    let k = d.pick(&[32u32, 64, 64, 128]);
    let (pgu, pdn) = (tile(d, arch_90, pm, k), tile(d, arch_90, pm, k));
    let (dgu, ddn) = (tile(d, arch_90, dm, k), tile(d, arch_90, dm, k));
    let strategy = d.pick(&["auto", "colocated", "expertplex", "pd-disagg"]);
    let switch = if d.coin() {
        format!("switch {{ t_high = {} window = 2 cooldown = 0s }}", d.pick(&[1u32, 4, 64]))
    } else {
        String::new()
    };
    let placement = match d.below(4) {
        0 => format!("placement {{ policy = zepp redundant_experts = {} }}", d.pick(&[0u32, 1, 8])),
        1 => format!("placement {{ policy = eplb redundant_experts = {} }}", d.pick(&[0u32, 1, 8])),
        _ => String::new(),
    };
    let fraction = d.pick(&[0.3f64, 0.85, 0.95]);
    let input = d.pick(&["sharegpt", "loogle", "rollout"]);
    let tpot = d.pick(&["5ms", "50ms", "1s"]);
    format!(
        r#"model m {{ layers = {layers} hidden = {hidden} vocab = {vocab} rope_theta = 10000 rms_eps = 1e-6 {dense}
  {attention}
  moe {{ experts = {experts} top_k = {top_k} expert_ffn = {ffn} {shared} {routing} }}
  {dtype} }}
cluster c {{ nodes = {nodes} gpus_per_node = {gpn}
  gpu g {{ arch = {arch} sms = {sms} hbm = {hbm} hbm_bandwidth = 1TB/s bf16 = 100TFLOP/s fp8 = 200TFLOP/s smem_per_sm = 228KiB smem_per_block = 227KiB }}
  scale_up nv {{ bandwidth = 100GB/s latency = 2us }} {scale_out} }}
tiles t {{ prefill {{ gate_up {pgu} down {pdn} }} decode {{ gate_up {dgu} down {ddn} }} }}
deploy d {{ model = m cluster = c tiles = t slo {{ ttft = 1s tpot = {tpot} }}
  workload {{ input = {input} output = sharegpt arrival poisson {{ rate = 1req/s }} }}
  strategy = {strategy} {switch} {placement} memory_fraction = {fraction} }}
"#,
        arch = if arch_90 { "sm_90a" } else { "sm_80" },
    )
}
