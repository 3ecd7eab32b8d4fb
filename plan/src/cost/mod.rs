//! The tile-aware latency model (ExpertPlex §6.2).
//!
//! Every profiled component `c` is a fitted form
//! `t̂_c(x, s) = α_c + β_c·x + γ_c·x·s + δ_c·x·s²` (Eq. 2): attention with
//! x = local batch and s = sequence length, MoE grouped GEMMs with
//! x = x_moe = Σ_{e: m_e>0} ⌈m_e / M_t⌉ (Eq. 3) and s = 1. Defaults come from
//! a roofline of the spec's GPU; a measured profile (JSON samples) is fitted
//! by least squares and overrides them component by component. Network time
//! needs no profile: it follows from routed bytes, link bandwidths and
//! latencies, with the hierarchical prefill path (one scale-out crossing per
//! destination node, then NVLink fan-out) and direct decode transfers.

use moeforge_dsl::spec::{Cluster, DType, Model, Tiles};
use serde::{Deserialize, Serialize};

pub mod calib;
pub mod step;

pub use calib::Calibration;

/// `t(x, s) = α + β·x + γ·x·s + δ·x·s²`, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Fit {
    pub alpha: f64,
    pub beta: f64,
    pub gamma: f64,
    pub delta: f64,
}

/// One measured latency.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub x: f64,
    pub s: f64,
    pub t: f64,
}

impl Fit {
    pub fn eval(&self, x: f64, s: f64) -> f64 {
        self.alpha + self.beta * x + self.gamma * x * s + self.delta * x * s * s
    }

    /// Least-squares fit of the four coefficients. Terms whose column is zero
    /// in every sample (e.g. γ, δ when s is always 0) are fixed at 0.
    pub fn least_squares(samples: &[Sample]) -> Result<Fit, String> {
        let feats = |p: &Sample| [1.0, p.x, p.x * p.s, p.x * p.s * p.s];
        let used: Vec<usize> = (0..4).filter(|&j| samples.iter().any(|p| feats(p)[j] != 0.0)).collect();
        let n = used.len();
        if samples.len() < n || n == 0 {
            return Err(format!("{} samples cannot determine {n} coefficients", samples.len()));
        }
        // Normal equations AᵀA c = Aᵀt, scaled per column for conditioning.
        let scale: Vec<f64> =
            used.iter().map(|&j| samples.iter().map(|p| feats(p)[j].abs()).fold(0.0, f64::max).max(1e-300)).collect();
        let mut m = vec![vec![0.0; n + 1]; n];
        for p in samples {
            let f = feats(p);
            for (a, &ja) in used.iter().enumerate() {
                for (b, &jb) in used.iter().enumerate() {
                    m[a][b] += f[ja] / scale[a] * f[jb] / scale[b];
                }
                m[a][n] += f[ja] / scale[a] * p.t;
            }
        }
        for col in 0..n {
            let piv = (col..n).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs())).unwrap_or(col);
            if m[piv][col].abs() < 1e-12 {
                return Err("the samples do not determine the fit (collinear inputs)".into());
            }
            m.swap(col, piv);
            for r in 0..n {
                if r != col {
                    let k = m[r][col] / m[col][col];
                    let pivot_row = m[col].clone();
                    for (x, p) in m[r].iter_mut().zip(&pivot_row).skip(col) {
                        *x -= k * p;
                    }
                }
            }
        }
        let mut c = [0.0; 4];
        for (a, &j) in used.iter().enumerate() {
            c[j] = m[a][n] / m[a][a] / scale[a];
        }
        Ok(Fit { alpha: c[0], beta: c[1], gamma: c[2], delta: c[3] })
    }
}

/// ExpertPlex Eq. 3: tiles executed for the routed rows `m_e` of each expert.
pub fn x_moe(rows: &[u64], m_t: u64) -> u64 {
    rows.iter().filter(|&&m| m > 0).map(|&m| m.div_ceil(m_t.max(1))).sum()
}

/// Expected x_moe of `experts` local experts when `routed` rows are spread
/// uniformly over `total_experts` experts: each expert's rows m are Poisson
/// with mean λ = routed / total_experts and E⌈m / M_t⌉ = Σ_j P(m > j·M_t)
/// (a normal approximation with continuity correction once λ > 200).
pub fn expected_x_moe(routed: f64, total_experts: f64, experts: f64, m_t: f64) -> f64 {
    let lambda = routed / total_experts.max(1.0);
    if lambda <= 0.0 {
        return 0.0;
    }
    let mt = m_t.max(1.0);
    // The layout search asks for the same (λ, M_t) many times over (each
    // layout's batch sweep): the sum is remembered per exact pair (a pure
    // function of its arguments, so results stay bit-identical).
    thread_local! {
        static TILES: std::cell::RefCell<std::collections::HashMap<(u64, u64), f64>> =
            std::cell::RefCell::new(std::collections::HashMap::new());
    }
    let key = (lambda.to_bits(), mt.to_bits());
    if let Some(t) = TILES.with(|c| c.borrow().get(&key).copied()) {
        return experts * t;
    }
    let tiles = expected_tiles(lambda, mt);
    TILES.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() >= 1 << 20 {
            c.clear();
        }
        c.insert(key, tiles);
    });
    experts * tiles
}

/// E⌈m / M_t⌉ of one expert whose rows m are Poisson with mean `lambda`.
fn expected_tiles(lambda: f64, mt: f64) -> f64 {
    let cap = lambda + 40.0 * lambda.sqrt() + 40.0;
    let mut tiles = 0.0;
    if lambda > 200.0 {
        let mut k = 0.0;
        while k <= cap {
            let t = 0.5 * erfc((k + 0.5 - lambda) / (2.0 * lambda).sqrt());
            tiles += t;
            if t < 1e-9 {
                break;
            }
            k += mt;
        }
    } else {
        // One pass: P(m ≤ k) accumulated term by term, P(m > k) added at multiples of M_t.
        let step = mt as u64;
        let mut p = (-lambda).exp();
        let mut cdf = p;
        let mut k = 0u64;
        loop {
            if k.is_multiple_of(step) {
                let t = (1.0 - cdf).max(0.0);
                tiles += t;
                if t < 1e-9 || k as f64 > cap {
                    break;
                }
            }
            k += 1;
            p *= lambda / k as f64;
            cdf += p;
        }
    }
    tiles
}

/// Expected number of the `experts` local experts that receive at least one
/// of `routed` rows spread uniformly over `total_experts` (the first term
/// of [`expected_x_moe`]'s sum: P(m > 0) = 1 − e^{−λ}).
pub fn expected_active(routed: f64, total_experts: f64, experts: f64) -> f64 {
    let lambda = routed / total_experts.max(1.0);
    if lambda <= 0.0 {
        0.0
    } else {
        experts * (1.0 - (-lambda).exp())
    }
}

/// Complementary error function (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * z);
    let poly =
        t * (0.254_829_592 + t * (-0.284_496_736 + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let r = poly * (-z * z).exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

/// Link figures the communication model uses (bytes/s, seconds).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, Default)]
pub struct Links {
    pub scale_up_bw: f64,
    pub scale_up_latency: f64,
    /// Per GPU: the node's NIC bandwidth divided over its GPUs.
    pub scale_out_bw: f64,
    pub scale_out_latency: f64,
    pub nodes: u32,
    pub gpus_per_node: u32,
}

/// The fitted components of one deployment, per layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
pub struct CostModel {
    /// `roofline`, or `profile sha256:…` when a measured profile was fitted.
    pub source: String,
    /// Prefill attention of one layer on one GPU: x requests, s input length.
    pub attn_prefill: Fit,
    /// Decode attention of one layer on one GPU: x requests, s context length.
    pub attn_decode: Fit,
    /// GateUp + Down grouped GEMMs of one MoE layer on one GPU with all SMs:
    /// x = x_moe, β the compute of one prefill-height (M_t) tile.
    pub moe: Fit,
    /// Seconds one active expert's weights take to stream from HBM on the
    /// whole GPU: its first tile costs max(β, this), its further tiles β (the
    /// weights are then in L2). 0 under a measured profile, whose fit holds it.
    #[serde(default)]
    pub moe_expert_weights: f64,
    /// Activation traffic per routed row: the row's input and its output
    /// (seconds per row, not sliced under TP), and its GateUp output and Down
    /// input (sliced under TP). 0 under a measured profile.
    #[serde(default)]
    pub moe_row_io: f64,
    #[serde(default)]
    pub moe_row_mid: f64,
    /// Dense FFN and shared experts of one layer: x tokens.
    pub ffn: Fit,
    /// Final norm and LM head: x tokens.
    pub head: Fit,
    pub links: Links,
    pub sms: u32,
    /// CTAs per cluster of the MoE kernel (1 where the GPU has no
    /// clusters): SMs are given to a phase in multiples of it, so the layout
    /// search's q, the APK's q and the simulator's q' all round to it.
    pub cluster: u32,
    /// Tile height M_t of each phase's grouped GEMM.
    pub m_t_prefill: u32,
    pub m_t_decode: u32,
    /// DeepSeek Sparse Attention's terms inside `attn_decode.gamma` and
    /// `attn_prefill.delta` (the indexer) and its top-k; `None` for dense attention.
    #[serde(default)]
    pub dsa: Option<DsaTerms>,
    /// The constants the components were derived with (and the
    /// communication and iteration terms read at run time).
    #[serde(default)]
    pub calib: Calibration,
}

/// Q_max: the most SMs decode may hold under contention, in whole CTA
/// clusters, leaving prefill one cluster whenever the GPU has two (the
/// APK's constant, the layout search's bound and the simulator's cap).
pub fn q_max(sms: u32, cluster: u32) -> u32 {
    let cluster = cluster.max(1);
    (sms / cluster).saturating_sub(1).max(1) * cluster
}

/// CTAs per CTA cluster of the MoE kernel on `c`'s GPU: the prefill GateUp
/// tile's cluster shape (the APK runs both phases on one grid of that
/// shape), or 1 where the architecture has no clusters.
pub fn cta_cluster(c: &Cluster, t: &Tiles) -> u32 {
    if c.gpu.arch.has_clusters() {
        let [x, y] = t.prefill.gate_up.cluster;
        (x * y).max(1)
    } else {
        1
    }
}

/// Kernels per component: attention (norm, QKV, RoPE, attention, output),
/// MoE (router, permute, GateUp, Down, combine), FFN (norm, GateUp, Down), head.
pub const ATTN_KERNELS: f64 = 5.0;
pub const MOE_KERNELS: f64 = 5.0;
pub const FFN_KERNELS: f64 = 3.0;

/// What DeepSeek Sparse Attention (GLM-5) adds to the attention fit: the
/// lightning indexer scores every cached token's index key
/// (`2·index_heads·index_head_dim` FLOPs per cached token in decode: γ;
/// `index_heads·index_head_dim` per causal token pair in prefill: δ). The
/// index key's bytes are already in the KV bytes per token. The sparse
/// attention reads at most `top_k` keys per query: `Env` caps the dense
/// attention terms (the rest of γ and δ) per request at `top_k` keys.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct DsaTerms {
    pub decode_gamma: f64,
    pub prefill_delta: f64,
    pub top_k: f64,
}

pub fn dsa_terms(m: &Model, flops: f64) -> Option<DsaTerms> {
    let moeforge_dsl::spec::Attention::Mla { indexer: Some(ix), .. } = m.attention else {
        return None;
    };
    let (ih, id) = (f64::from(ix.heads), f64::from(ix.head_dim));
    Some(DsaTerms { decode_gamma: 2.0 * ih * id / flops, prefill_delta: ih * id / flops, top_k: f64::from(ix.top_k) })
}

impl CostModel {
    /// Defaults from a roofline of the spec's GPU and links with the
    /// published constants.
    pub fn roofline(m: &Model, c: &Cluster, t: &Tiles) -> CostModel {
        CostModel::roofline_with(m, c, t, Calibration::published())
    }

    /// The roofline with calibration `k` (the sensitivity report's perturbations).
    pub fn roofline_with(m: &Model, c: &Cluster, t: &Tiles, k: Calibration) -> CostModel {
        let g = &c.gpu;
        let fp8 = m.dtype.experts == DType::Fp8E4m3;
        let flops = if fp8 { g.fp8_flops.unwrap_or(g.bf16_flops) } else { g.bf16_flops } * k.compute_efficiency;
        // Attention's score and value products run in bf16 whatever the
        // weights' format (FlashAttention-3 and FlashMLA as served).
        let attn_flops = g.bf16_flops * k.compute_efficiency;
        // Weights stream through small-M GEMMs; KV and activations are plain streams.
        let gemm_bw = g.hbm_bandwidth * k.gemm_memory_efficiency;
        let bw = g.hbm_bandwidth * k.stream_memory_efficiency;
        let (h, i) = (f64::from(m.hidden), f64::from(m.moe.expert_ffn));
        let elt = m.dtype.experts.bits_per_element(m.dtype.block_scale) / 8.0;
        let welt = m.dtype.weights.bits_per_element(m.dtype.block_scale) / 8.0;
        let layers = f64::from(m.layers);
        let attn_params = m.attention_params_per_layer() as f64;
        let kv_layer = m.kv_bytes_per_token_layer() as f64;
        // Attention: weights read once per call (α), projections per token (β),
        // KV read per cached token (γ), scores per token pair (δ).
        let heads = f64::from(m.attention.heads());
        // FLOPs per head and (query, key) pair, scores plus values: GQA's
        // 2·d + 2·d; MLA decode in the absorbed form multiplies the latent
        // (2·(kv_lora + qk_rope) + 2·kv_lora), MLA prefill in the naive form
        // (2·(qk_nope + qk_rope) + 2·v_head): the target stack's kernel; the
        // emitted program attends absorbed in both phases for now.
        let (pair_decode, pair_prefill) = match m.attention {
            moeforge_dsl::spec::Attention::Gqa { head_dim, .. } => {
                (4.0 * f64::from(head_dim), 4.0 * f64::from(head_dim))
            }
            moeforge_dsl::spec::Attention::Mla { kv_lora, qk_nope, qk_rope, v_head, .. } => (
                2.0 * f64::from(kv_lora + qk_rope) + 2.0 * f64::from(kv_lora),
                2.0 * f64::from(qk_nope + qk_rope) + 2.0 * f64::from(v_head),
            ),
        };
        let attn_weights = attn_params * welt / gemm_bw;
        let kernels = ATTN_KERNELS * k.op_overhead;
        // Decode reads each cached token's KV and multiplies it into every
        // head (MLA's absorbed form multiplies the latent into all heads,
        // which makes it compute-bound).
        let mut attn_decode = Fit {
            alpha: kernels + attn_weights,
            beta: 2.0 * attn_params / flops,
            gamma: (kv_layer / bw).max(heads * pair_decode / attn_flops),
            delta: 0.0,
        };
        // Prefill: x requests of s tokens; projections per token (γ·x·s),
        // causal token pairs (δ·x·s², half of s² pairs).
        let mut attn_prefill = Fit {
            alpha: kernels + attn_weights,
            beta: 0.0,
            gamma: 2.0 * attn_params / flops + kv_layer / bw,
            delta: heads * pair_prefill / 2.0 / attn_flops,
        };
        // DSA: the attention reads at most `index_topk` keys per query
        // (capped by `Env` per request); the indexer scores every key.
        let dsa = dsa_terms(m, attn_flops);
        if let Some(d) = &dsa {
            attn_decode.gamma += d.decode_gamma;
            attn_prefill.delta += d.prefill_delta;
        }
        // One M_t-row tile of one expert (6·M_t·H·I FLOPs) computes; the
        // expert's first tile also streams its 3·H·I weights from HBM.
        let m_t = f64::from(t.prefill.gate_up.block_m);
        let moe = Fit { alpha: MOE_KERNELS * k.op_overhead, beta: 6.0 * m_t * h * i / flops, gamma: 0.0, delta: 0.0 };
        let moe_expert_weights = 3.0 * h * i * elt / gemm_bw;
        // Per routed row: its input (fp8 with one scale per 128, or bf16) is
        // read and its bf16 output written; GateUp's activated output (I
        // values) is written and read back by Down, in the experts' format.
        let a_in = if fp8 { 1.0 + 4.0 / 128.0 } else { 2.0 };
        let moe_row_io = (h * a_in + 2.0 * h) / bw;
        let moe_row_mid = 2.0 * i * a_in / bw;
        let ffn_size =
            f64::from(m.moe.shared_experts * m.moe.shared_ffn) + m.dense.map_or(0.0, |d| f64::from(d.ffn) / layers);
        let ffn = Fit {
            alpha: FFN_KERNELS * k.op_overhead + 3.0 * h * ffn_size * welt / gemm_bw,
            beta: 6.0 * h * ffn_size / flops,
            gamma: 0.0,
            delta: 0.0,
        };
        let vocab = f64::from(m.vocab);
        let head = Fit {
            alpha: k.op_overhead + vocab * h * 2.0 / gemm_bw,
            beta: 2.0 * vocab * h / flops,
            gamma: 0.0,
            delta: 0.0,
        };
        let (out_bw, out_lat) = c
            .scale_out
            .as_ref()
            .map_or((0.0, 0.0), |o| (o.bandwidth * f64::from(o.nics_per_node) / f64::from(c.gpus_per_node), o.latency));
        CostModel {
            source: "roofline".into(),
            attn_prefill,
            attn_decode,
            moe,
            moe_expert_weights,
            moe_row_io,
            moe_row_mid,
            ffn,
            head,
            links: Links {
                scale_up_bw: c.scale_up.bandwidth,
                scale_up_latency: c.scale_up.latency,
                scale_out_bw: out_bw,
                scale_out_latency: out_lat,
                nodes: c.nodes,
                gpus_per_node: c.gpus_per_node,
            },
            sms: g.sms,
            cluster: cta_cluster(c, t),
            m_t_prefill: t.prefill.gate_up.block_m,
            m_t_decode: t.decode.gate_up.block_m,
            dsa,
            calib: k,
        }
    }

    /// MoE computation of one layer on one GPU with `q` of its SMs: `x`
    /// tiles of the phase's height `m_t` (x_moe), `active` experts among
    /// them, `rows` routed rows, every expert sliced `slice` ways (TP).
    /// Compute scales with the SMs held; HBM streams scale with them only
    /// below the share that saturates the bandwidth
    /// ([`Calibration::stream_sm_saturation`]). Each active expert's first
    /// tile waits for its weights or its compute, whichever is longer; its
    /// other tiles find them in L2.
    pub fn moe_seconds(&self, x: f64, active: f64, rows: f64, m_t: f64, slice: f64, q: f64) -> f64 {
        if x <= 0.0 {
            return 0.0;
        }
        let share = f64::from(self.sms) / q.max(1.0);
        // No phase needs more than every SM to saturate HBM (the clamp keeps a
        // perturbed constant physical).
        let stream = (self.calib.stream_sm_saturation.min(1.0) * share).max(1.0);
        // The fit's slope at s = 1 (β for the roofline, any fitted γ, δ too),
        // rescaled from the prefill tile height to this phase's.
        let per_tile = self.moe.beta + self.moe.gamma + self.moe.delta;
        let tile = per_tile * m_t / f64::from(self.m_t_prefill.max(1)) / slice;
        let first = (tile * share).max(self.moe_expert_weights * stream / slice);
        let active = active.min(x);
        self.moe.alpha
            + tile * share * (x - active)
            + first * active
            + rows * (self.moe_row_io + self.moe_row_mid / slice) * stream
    }

    /// Whether every fitted component gives a finite, non-negative latency
    /// over the sizes serving reaches (what a fitted profile must, and what
    /// the simulator needs: work takes time).
    pub fn check_latencies(&self) -> Result<(), String> {
        for (name, fit, s) in [
            ("attn_prefill", &self.attn_prefill, 2048.0),
            ("attn_decode", &self.attn_decode, 2048.0),
            ("moe", &self.moe, 1.0),
            ("ffn", &self.ffn, 0.0),
            ("head", &self.head, 0.0),
        ] {
            for x in [0.0, 1.0, 16.0, 256.0, 4096.0, 65536.0] {
                let t = fit.eval(x, s);
                if !(t.is_finite() && t >= 0.0) {
                    return Err(format!(
                        "the cost model's `{name}` gives {t:e} s at x = {x}, s = {s} ({}); a latency must be finite \
                         and non-negative",
                        self.source
                    ));
                }
            }
        }
        Ok(())
    }

    /// Applies measured samples: every component with samples is refitted.
    /// Samples must be finite, sizes and latencies non-negative, and the
    /// fits must give latencies [`CostModel::check_latencies`] accepts.
    pub fn with_profile(mut self, profile: &Profile, digest: &str) -> Result<CostModel, String> {
        if let Some((i, p)) = profile.samples.iter().enumerate().find(|(_, p)| {
            let s = p.sample;
            ![s.x, s.s, s.t].iter().all(|v| v.is_finite() && *v >= 0.0)
        }) {
            return Err(format!(
                "sample {i} (`{}`: x = {}, s = {}, t = {}): sizes and latencies must be finite and non-negative",
                p.component, p.sample.x, p.sample.s, p.sample.t
            ));
        }
        for (name, fit) in [
            ("attn_prefill", &mut self.attn_prefill),
            ("attn_decode", &mut self.attn_decode),
            ("moe", &mut self.moe),
            ("ffn", &mut self.ffn),
            ("head", &mut self.head),
        ] {
            let samples: Vec<Sample> =
                profile.samples.iter().filter(|s| s.component == name).map(|s| s.sample).collect();
            if !samples.is_empty() {
                *fit = Fit::least_squares(&samples).map_err(|e| format!("component `{name}`: {e}"))?;
            }
        }
        // A measured MoE fit holds the weight streams and activation traffic.
        if profile.samples.iter().any(|s| s.component == "moe") {
            self.moe_expert_weights = 0.0;
            self.moe_row_io = 0.0;
            self.moe_row_mid = 0.0;
        }
        if let Some(s) = profile.samples.iter().find(|s| !COMPONENTS.contains(&s.component.as_str())) {
            return Err(format!("unknown component `{}` (known: {})", s.component, COMPONENTS.join(", ")));
        }
        self.source = format!("profile sha256:{digest}");
        self.check_latencies().map_err(|e| {
            format!("{e}: a fit extrapolated past its samples can go negative; measure over the sizes serving reaches")
        })?;
        Ok(self)
    }

    /// Time to move `bytes` of routed rows from one GPU over the scale-up link.
    pub fn nvlink(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            0.0
        } else {
            self.calib.comm_floor
                + self.links.scale_up_latency
                + bytes / (self.links.scale_up_bw * self.calib.nvlink_efficiency)
        }
    }

    /// One-way MoE dispatch (or combine) of `tokens` rows of `row_bytes`
    /// from one GPU to top-k experts spread evenly over `gpus` GPUs on
    /// `nodes` nodes, a fraction `local` of them on the sender's node.
    /// Decode sends every (token, expert) pair directly, as DeepEP's
    /// low-latency kernels do: the local share over NVLink and the rest over
    /// RDMA, concurrently. Prefill sends a token once per distinct
    /// destination GPU (E = G(1 − (1 − 1/G)^k)) and, across nodes, takes the
    /// hierarchical path (ExpertPlex §5, DeepEP's normal kernels): one RDMA
    /// crossing per remote node holding one of the token's experts, then
    /// NVLink fan-out there.
    #[allow(clippy::too_many_arguments)]
    pub fn dispatch(
        &self,
        tokens: f64,
        row_bytes: f64,
        top_k: f64,
        gpus: f64,
        nodes: f64,
        local: f64,
        hierarchical: bool,
    ) -> f64 {
        if tokens <= 0.0 {
            return 0.0;
        }
        if !hierarchical {
            let bytes = tokens * top_k * row_bytes;
            return self.nvlink(bytes * local).max(self.rdma(bytes * (1.0 - local)));
        }
        let per_gpu = tokens * row_bytes * distinct(gpus, top_k);
        if nodes > 1.0 {
            self.rdma(tokens * row_bytes * remote_nodes(top_k, nodes, local)) + self.nvlink(per_gpu / nodes)
        } else {
            self.nvlink(per_gpu)
        }
    }

    /// Modeled time of a weight reshard: every rank sends its share of the
    /// bytes crossing between ranks at once over its own scale-up link.
    pub fn reshard_seconds(&self, w: &crate::memory::WeightReshard, mem: &crate::memory::MemoryPlan) -> f64 {
        let per_rank =
            w.interconnect_bytes_per_layer as f64 * f64::from(mem.slots.moe_layers) / f64::from(mem.group.max(1));
        self.nvlink(per_rank)
    }

    /// Time to move `bytes` from one GPU over its share of the node's NICs.
    pub fn rdma(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 || self.links.scale_out_bw <= 0.0 {
            0.0
        } else {
            self.calib.comm_floor
                + self.links.scale_out_latency
                + bytes / (self.links.scale_out_bw * self.calib.rdma_efficiency)
        }
    }
}

/// Expected remote nodes one token's `top_k` experts reach over `nodes`
/// nodes when each lies on the sender's node with probability `local` and
/// on each other node with probability (1 − local)/(nodes − 1): every
/// remote node is reached unless all k miss it, so
/// (n − 1)(1 − (1 − (1 − local)/(n − 1))^k). Locality-preferred routing
/// (Zepp) raises `local` and so lowers the copies that cross nodes.
pub fn remote_nodes(top_k: f64, nodes: f64, local: f64) -> f64 {
    if nodes <= 1.0 {
        return 0.0;
    }
    let away = (1.0 - local.clamp(0.0, 1.0)) / (nodes - 1.0);
    (nodes - 1.0) * (1.0 - (1.0 - away).powf(top_k))
}

/// Expected distinct places `top_k` picks reach among `n` equally likely ones.
fn distinct(n: f64, top_k: f64) -> f64 {
    n * (1.0 - (1.0 - 1.0 / n.max(1.0)).powf(top_k))
}

pub const COMPONENTS: &[&str] = &["attn_prefill", "attn_decode", "moe", "ffn", "head"];

/// A measured profile: `{"samples": [{"component": "moe", "x": 12, "s": 1, "t": 3.1e-5}, …]}`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub samples: Vec<ProfileSample>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProfileSample {
    pub component: String,
    #[serde(flatten)]
    pub sample: Sample,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The roofline cost model of an example deployment.
    fn roofline_of(example: &str) -> CostModel {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../examples/{example}.moe"));
        let checked = moeforge_dsl::check_paths(&[path], &moeforge_dsl::FsLoader)
            .unwrap_or_else(|f| panic!("{}", f.render(false)));
        let s = &checked.spec;
        let d = &s.deploys[0];
        CostModel::roofline(s.model(d.model), s.cluster(d.cluster), s.tile_set(d.tiles))
    }

    #[test]
    fn least_squares_recovers_exact_coefficients() {
        let truth = Fit { alpha: 2e-5, beta: 3e-7, gamma: 4e-10, delta: 5e-14 };
        let mut samples = Vec::new();
        for x in [1.0, 2.0, 8.0, 32.0, 64.0] {
            for s in [128.0, 1024.0, 4096.0] {
                samples.push(Sample { x, s, t: truth.eval(x, s) });
            }
        }
        let fit = Fit::least_squares(&samples).unwrap_or_default();
        for (a, b) in
            [(fit.alpha, truth.alpha), (fit.beta, truth.beta), (fit.gamma, truth.gamma), (fit.delta, truth.delta)]
        {
            assert!((a - b).abs() <= 1e-6 * b.abs(), "{fit:?} vs {truth:?}");
        }
    }

    #[test]
    fn least_squares_drops_absent_terms_and_rejects_underdetermined_input() {
        let samples: Vec<Sample> =
            (1..6).map(|x| Sample { x: f64::from(x), s: 1.0, t: 1e-5 + 2e-6 * f64::from(x) }).collect();
        // s = 1 makes x, x·s and x·s² collinear: only α and one slope are identifiable.
        assert!(Fit::least_squares(&samples).is_err());
        let samples: Vec<Sample> =
            (1..6).map(|x| Sample { x: f64::from(x), s: 0.0, t: 1e-5 + 2e-6 * f64::from(x) }).collect();
        let fit = Fit::least_squares(&samples).unwrap_or_default();
        assert!((fit.beta - 2e-6).abs() < 1e-12 && fit.gamma == 0.0 && fit.delta == 0.0);
        assert!(Fit::least_squares(&samples[..1]).is_err());
    }

    /// GLM-5's indexer (32 heads of 128) is charged on top of dense MLA:
    /// per cached token in decode, the index key's 128 bf16 values read and
    /// 2·32·128 FLOPs; per causal token pair in prefill, 32·128 FLOPs.
    #[test]
    fn dsa_charges_the_lightning_indexer() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/glm-5-h800x24.moe");
        let checked = moeforge_dsl::check_paths(&[path], &moeforge_dsl::FsLoader)
            .unwrap_or_else(|f| panic!("{}", f.render(false)));
        let s = &checked.spec;
        let d = &s.deploys[0];
        let (m, c) = (s.model(d.model), s.cluster(d.cluster));
        let sparse = CostModel::roofline(m, c, s.tile_set(d.tiles));
        let mut dense_model = m.clone();
        if let moeforge_dsl::spec::Attention::Mla { indexer, .. } = &mut dense_model.attention {
            assert_eq!(indexer.map(|i| (i.heads, i.head_dim, i.top_k)), Some((32, 128, 2048)));
            *indexer = None;
        }
        let dense = CostModel::roofline(&dense_model, c, s.tile_set(d.tiles));
        let g = &c.gpu;
        let k = Calibration::published();
        // Attention products run in bf16 (the model's experts are fp8).
        let flops = g.bf16_flops * k.compute_efficiency;
        let bw = g.hbm_bandwidth * k.stream_memory_efficiency;
        // The indexer's FLOPs per cached token, on top of dense MLA's decode
        // term (the larger of its latent read, now 128 values longer, and its FLOPs).
        let extra_gamma = sparse.attn_decode.gamma - dense.attn_decode.gamma;
        let kv = |m: &Model| m.kv_bytes_per_token_layer() as f64 / bw;
        let dense_term = |m: &Model| dense.attn_decode.gamma.max(kv(m));
        let want = 2.0 * 32.0 * 128.0 / flops + dense_term(m) - dense.attn_decode.gamma;
        assert!((extra_gamma / want - 1.0).abs() < 1e-9, "{extra_gamma} vs {want}");
        assert_eq!(sparse.dsa.map(|d| d.top_k), Some(2048.0));
        let extra_delta = sparse.attn_prefill.delta - dense.attn_prefill.delta;
        assert!((extra_delta * flops / (32.0 * 128.0) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn prefill_dispatch_deduplicates_per_gpu_and_per_node() {
        let cm = roofline_of("glm-5-h800x24");
        let (row, k) = (6144.0 * 2.0, 8.0);
        // One node, 8 GPUs: a top-8 token reaches 8(1 − (7/8)^8) ≈ 5.25 GPUs, not 8.
        let direct = cm.dispatch(4096.0, row, k, 8.0, 1.0, 1.0, false);
        let dedup = cm.dispatch(4096.0, row, k, 8.0, 1.0, 1.0, true);
        let distinct = 8.0 * (1.0 - (7.0f64 / 8.0).powi(8));
        let bw = cm.links.scale_up_bw * cm.calib.nvlink_efficiency;
        let floor = cm.calib.comm_floor + 2e-6;
        assert!(((direct - floor) * bw / (4096.0 * row * k) - 1.0).abs() < 1e-9);
        assert!(((dedup - floor) * bw / (4096.0 * row * distinct) - 1.0).abs() < 1e-9);
        // Three nodes, a third local: RDMA carries one copy per remote node
        // (2(1 − (2/3)^8) ≈ 1.92 of the 2 remote nodes), far less than the
        // direct path's 2/3 of 8 copies.
        let hier = cm.dispatch(4096.0, row, k, 24.0, 3.0, 1.0 / 3.0, true);
        let flat = cm.dispatch(4096.0, row, k, 24.0, 3.0, 1.0 / 3.0, false);
        assert!(hier < flat, "hierarchical {hier} vs direct {flat}");
        let rdma = cm.rdma(4096.0 * row * 2.0 * (1.0 - (2.0f64 / 3.0).powi(8)));
        let nvlink = cm.nvlink(4096.0 * row * 24.0 * (1.0 - (23.0f64 / 24.0).powi(8)) / 3.0);
        assert!((hier / (rdma + nvlink) - 1.0).abs() < 1e-9, "{hier} vs {}", rdma + nvlink);
    }

    /// The expected remote nodes against every placement of a token's
    /// experts, enumerated: each of k experts on one of n nodes, the
    /// sender's with probability `local` and the others evenly otherwise
    /// (uniform placement is local = 1/n).
    #[test]
    fn remote_nodes_match_an_enumeration_of_expert_placements() {
        fn enumerate(k: u32, n: usize, local: f64) -> f64 {
            let p = |node: usize| if node == 0 { local } else { (1.0 - local) / (n - 1) as f64 };
            let mut expected = 0.0;
            for code in 0..n.pow(k) {
                let (mut c, mut prob, mut hit) = (code, 1.0, vec![false; n]);
                for _ in 0..k {
                    let node = c % n;
                    c /= n;
                    prob *= p(node);
                    hit[node] = true;
                }
                expected += prob * hit[1..].iter().filter(|&&h| h).count() as f64;
            }
            expected
        }
        for (k, n, local) in
            [(8u32, 3usize, 1.0 / 3.0), (8, 4, 0.25), (2, 2, 0.5), (4, 3, 0.547), (8, 3, 0.9), (3, 4, 0.0)]
        {
            let want = enumerate(k, n, local);
            let got = remote_nodes(f64::from(k), n as f64, local);
            assert!((got - want).abs() < 1e-9, "k {k} n {n} local {local}: {got} vs {want}");
        }
        // More rows served locally, fewer nodes crossed; none on one node.
        assert!(remote_nodes(8.0, 3.0, 0.55) < remote_nodes(8.0, 3.0, 1.0 / 3.0));
        assert_eq!(remote_nodes(8.0, 1.0, 1.0), 0.0);
    }

    #[test]
    fn x_moe_counts_tiles_not_tokens() {
        // Same 256 rows: on 2 experts 2 tiles; on 64 experts 64 tiles (ExpertPlex Fig. 6).
        assert_eq!(x_moe(&[128, 128], 128), 2);
        assert_eq!(x_moe(&[4; 64], 128), 64);
        assert_eq!(x_moe(&[0, 129, 1], 128), 3);
    }

    #[test]
    fn expected_x_moe_matches_limits() {
        // Few rows: about one tile per active expert; many rows: rows / M_t.
        let sparse = expected_x_moe(8.0, 256.0, 256.0, 128.0);
        assert!((sparse - 256.0 * (1.0 - (-8.0f64 / 256.0).exp())).abs() < 1e-6, "{sparse}");
        let dense = expected_x_moe(256.0 * 1280.0, 256.0, 256.0, 128.0);
        assert!((dense / (256.0 * 10.0) - 1.0).abs() < 0.06, "{dense}");
    }
}
