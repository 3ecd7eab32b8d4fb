//! The checked specification: what a `.moe` file means.
//!
//! A [`Spec`] is produced only by the checker (`check.rs`), so every value in
//! it has passed the range and consistency checks listed in `DESIGN.md`: a
//! consumer never re-validates. Blocks refer to each other through typed
//! handles ([`ModelId`], [`ClusterId`], [`TilesId`]); spans live in a side
//! table ([`crate::SpanTable`]), so two specs that differ only in layout or
//! comments compare equal and hash alike.
//!
//! Units are resolved: sizes are bytes, times seconds, bandwidths bytes/s,
//! compute rates FLOP/s, arrival rates requests/s.
//!
//! ```text
//! model NAME {                       → Model
//!   layers hidden vocab [tie_embeddings rope_theta rms_eps]
//!   dense { layers ffn }             → Model::dense (leading dense layers)
//!   attention gqa { heads kv_heads head_dim [qk_norm (true|false|per_head|per_layer) rope_dim sinks
//!                   bias (none|qkv|all)] }
//!   attention mla { heads [q_lora] kv_lora qk_nope qk_rope v_head [index_heads index_head_dim index_topk] }
//!   sliding_window { size pattern = [sliding, full, …] }
//!   moe { experts top_k expert_ffn [shared_experts shared_ffn activation bias]
//!         routing softmax_topk { [norm_topk] }
//!         routing sigmoid_grouped { groups top_groups scaling [norm_topk bias] } }
//!   dtype { weights [experts activations block_scale] }
//! }
//! cluster NAME { nodes gpus_per_node gpu NAME { … } scale_up NAME { … } [scale_out NAME { … }] }
//! tiles NAME { prefill { layout gate_up { … } down { … } } decode { … } }
//! deploy NAME { model cluster tiles slo { } workload { } [strategy switch { } placement { } memory_fraction] }
//! ```

use serde::{Deserialize, Serialize};

macro_rules! handle {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub u32);
        impl $name {
            pub fn index(self) -> usize { self.0 as usize }
        }
    };
}
handle!(
    /// Index of a [`Model`] in [`Spec::models`].
    ModelId
);
handle!(
    /// Index of a [`Cluster`] in [`Spec::clusters`].
    ClusterId
);
handle!(
    /// Index of a [`Tiles`] in [`Spec::tiles`].
    TilesId
);
handle!(
    /// Index of a [`Deploy`] in [`Spec::deploys`].
    DeployId
);

/// Every block of a checked file and the files it `use`s, in declaration order.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Spec {
    pub models: Vec<Model>,
    pub clusters: Vec<Cluster>,
    pub tiles: Vec<Tiles>,
    pub deploys: Vec<Deploy>,
}

impl Spec {
    pub fn model(&self, id: ModelId) -> &Model {
        &self.models[id.index()]
    }
    pub fn cluster(&self, id: ClusterId) -> &Cluster {
        &self.clusters[id.index()]
    }
    pub fn tile_set(&self, id: TilesId) -> &Tiles {
        &self.tiles[id.index()]
    }
    pub fn deploy(&self, id: DeployId) -> &Deploy {
        &self.deploys[id.index()]
    }
    pub fn deploy_ids(&self) -> impl Iterator<Item = DeployId> {
        (0..self.deploys.len() as u32).map(DeployId)
    }
    pub fn find_deploy(&self, name: &str) -> Option<DeployId> {
        self.deploys.iter().position(|d| d.name == name).map(|i| DeployId(i as u32))
    }
    /// The blocks one deployment uses, as a self-contained spec (handles
    /// renumbered to 0). Its canonical JSON is what bundles hash.
    pub fn deployment(&self, id: DeployId) -> Spec {
        let d = self.deploy(id);
        let mut d2 = d.clone();
        d2.model = ModelId(0);
        d2.cluster = ClusterId(0);
        d2.tiles = TilesId(0);
        Spec {
            models: vec![self.model(d.model).clone()],
            clusters: vec![self.cluster(d.cluster).clone()],
            tiles: vec![self.tile_set(d.tiles).clone()],
            deploys: vec![d2],
        }
    }
}

// ───────────────────────────── model ─────────────────────────────

/// `model NAME { … }`: a decoder-only MoE transformer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Model {
    pub name: String,
    /// Total transformer layers, dense and MoE.
    pub layers: u32,
    /// Hidden size H.
    pub hidden: u32,
    pub vocab: u32,
    /// Whether the LM head shares the embedding matrix.
    pub tie_embeddings: bool,
    pub rope_theta: f64,
    /// RoPE frequency scaling for long contexts (`rope_scaling yarn { … }`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    pub rms_eps: f64,
    /// Leading dense layers (`dense { layers ffn }`), DeepSeek-style.
    pub dense: Option<DenseLayers>,
    pub attention: Attention,
    pub sliding_window: Option<SlidingWindow>,
    pub moe: Moe,
    pub dtype: Dtypes,
}

/// YaRN RoPE scaling (Peng et al. 2023, as Hugging Face transformers'
/// `_compute_yarn_parameters` computes it): each rotary frequency blends
/// the original (`θ^(-2i/d)`) and the interpolated (`/ factor`) one by a
/// linear ramp between the dimensions whose wavelengths turn `beta_fast`
/// and `beta_slow` times in `original_max_positions`; cos and sin are
/// multiplied by the attention factor (`0.1·mscale·ln(factor) + 1` over
/// the same with `mscale_all_dim`, or `0.1·ln(factor) + 1` when either is
/// absent). DeepSeek-V3's MLA also multiplies its softmax scale by the
/// square of `0.1·mscale_all_dim·ln(factor) + 1`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    pub factor: f64,
    /// The context length the model was pre-trained with.
    pub original_max_positions: u32,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    /// Rounds the ramp's ends outwards to whole dimensions (transformers' default).
    pub truncate: bool,
}

impl RopeScaling {
    fn get_mscale(&self, m: f64) -> f64 {
        if self.factor <= 1.0 {
            1.0
        } else {
            0.1 * m * self.factor.ln() + 1.0
        }
    }

    /// The factor cos and sin are multiplied by.
    pub fn attention_factor(&self) -> f64 {
        match (self.mscale, self.mscale_all_dim) {
            (Some(a), Some(b)) if a != 0.0 && b != 0.0 => self.get_mscale(a) / self.get_mscale(b),
            _ => self.get_mscale(1.0),
        }
    }

    /// The inverse frequency of each of the `rope_dim / 2` rotary pairs.
    pub fn inv_freq(&self, rope_dim: u32, theta: f64) -> Vec<f64> {
        let dim = f64::from(rope_dim);
        let max = f64::from(self.original_max_positions);
        let correction = |rot: f64| dim * (max / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
        let (mut low, mut high) = (correction(self.beta_fast), correction(self.beta_slow));
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, high) = (low.max(0.0), high.min(dim - 1.0));
        let span = if low == high { 0.001 } else { high - low };
        (0..rope_dim / 2)
            .map(|i| {
                let pos_freq = theta.powf(2.0 * f64::from(i) / dim);
                let extrapolation = 1.0 / pos_freq;
                let interpolation = 1.0 / (self.factor * pos_freq);
                let ramp = ((f64::from(i) - low) / span).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                interpolation * (1.0 - keep) + extrapolation * keep
            })
            .collect()
    }

    /// DeepSeek-V3's MLA softmax-scale multiplier (`mscale²` with `mscale_all_dim`).
    pub fn mla_softmax_factor(&self) -> f64 {
        self.mscale_all_dim.filter(|m| *m != 0.0).map_or(1.0, |m| self.get_mscale(m).powi(2))
    }
}

/// The first `layers` layers use a dense SwiGLU FFN of size `ffn` instead of MoE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DenseLayers {
    pub layers: u32,
    pub ffn: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Attention {
    /// Grouped-query attention (`attention gqa { … }`).
    Gqa {
        heads: u32,
        kv_heads: u32,
        head_dim: u32,
        /// RMSNorm on q and k (Qwen3, GLM-4.5, MiniMax-M2).
        qk_norm: bool,
        /// Over each head (Qwen3) or the whole projection (MiniMax-M2's
        /// `per_layer`); `qk_norm = per_layer` in the surface syntax.
        #[serde(default, skip_serializing_if = "QkNormScope::is_per_head")]
        qk_norm_scope: QkNormScope,
        /// Rotary dimensions per head; `head_dim` unless partial RoPE.
        rope_dim: u32,
        /// Learned per-head attention sinks (GPT-OSS).
        sinks: bool,
        /// Projection biases: q, k and v (GLM-4.5, Qwen2), or o too (GPT-OSS).
        #[serde(default, skip_serializing_if = "AttnBias::is_none")]
        bias: AttnBias,
    },
    /// Multi-head latent attention (`attention mla { … }`), DeepSeek-V3 style.
    Mla {
        heads: u32,
        /// Rank of the query down-projection; `None` projects q directly.
        q_lora: Option<u32>,
        kv_lora: u32,
        qk_nope: u32,
        qk_rope: u32,
        v_head: u32,
        /// DeepSeek Sparse Attention's lightning indexer (GLM-5), which
        /// picks the `top_k` keys each query attends to.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        indexer: Option<Indexer>,
    },
}

/// Where the QK-norm's RMSNorm runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNormScope {
    /// Over each head's `head_dim` values, one weight vector shared by heads.
    #[default]
    PerHead,
    /// Over the whole q (`heads × head_dim`) and k (`kv_heads × head_dim`) projections.
    PerLayer,
}

impl QkNormScope {
    pub fn is_per_head(&self) -> bool {
        *self == QkNormScope::PerHead
    }
}

/// The DSA lightning indexer of an MLA layer: `heads` scoring heads of
/// `head_dim`, keeping `top_k` keys per query. Its weights: `wq_b`
/// (q_lora or hidden → heads × head_dim), `wk` (hidden → head_dim), a
/// LayerNorm on k (weight and bias) and `weights_proj` (hidden → heads);
/// its key cache holds `head_dim` values per token and layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Indexer {
    pub heads: u32,
    pub head_dim: u32,
    pub top_k: u32,
}

impl Indexer {
    /// Parameters per layer; `q_in` is the width its query projection reads.
    pub fn params(&self, hidden: u64, q_in: u64) -> u64 {
        let (n, d) = (u64::from(self.heads), u64::from(self.head_dim));
        prod(&[q_in, n, d]).saturating_add(prod(&[hidden, d])).saturating_add(2 * d).saturating_add(prod(&[hidden, n]))
    }
}

impl Attention {
    pub fn heads(&self) -> u32 {
        match *self {
            Attention::Gqa { heads, .. } | Attention::Mla { heads, .. } => heads,
        }
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Which attention projections carry a bias (`bias = none | qkv | all`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttnBias {
    #[default]
    None,
    /// q, k and v (transformers' `attention_bias` for GLM-4.5 and Qwen2).
    Qkv,
    /// q, k, v and o (GPT-OSS).
    All,
}

impl AttnBias {
    pub fn is_none(&self) -> bool {
        *self == AttnBias::None
    }
    pub fn name(self) -> &'static str {
        match self {
            AttnBias::None => "none",
            AttnBias::Qkv => "qkv",
            AttnBias::All => "all",
        }
    }
}

/// `sliding_window { size pattern }`: layer i uses `pattern[i % len]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlidingWindow {
    pub size: u32,
    pub pattern: Vec<LayerAttn>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerAttn {
    Sliding,
    Full,
}

/// `moe { … }`: the routed and shared experts of every non-dense layer.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Moe {
    /// Routed experts per layer E.
    pub experts: u32,
    /// Experts each token is routed to.
    pub top_k: u32,
    /// Intermediate size I of one routed expert.
    pub expert_ffn: u32,
    pub shared_experts: u32,
    /// Intermediate size of one shared expert (defaults to `expert_ffn`).
    pub shared_ffn: u32,
    pub activation: Activation,
    pub routing: Routing,
    /// Biases on the router's logits and on every routed expert's gate/up
    /// and down projections (GPT-OSS).
    #[serde(default, skip_serializing_if = "is_false")]
    pub bias: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// SwiGLU: `silu(gate) * up`.
    Silu,
    /// GPT-OSS's clamped SwiGLU variant.
    SwigluOai,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Routing {
    /// Softmax over all router logits, top-k, optionally renormalized over the k.
    SoftmaxTopk { norm_topk: bool },
    /// DeepSeek-V3: sigmoid scores (+ a learned correction bias for selection
    /// only), experts split into `groups`; keep the `top_groups` groups with
    /// the best top-2 sums, top-k inside them, optionally renormalize, then
    /// multiply by `scaling`.
    SigmoidGrouped { groups: u32, top_groups: u32, scaling: f64, norm_topk: bool, bias: bool },
}

/// Storage types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dtypes {
    /// Non-expert weights.
    pub weights: DType,
    /// Routed and shared expert weights.
    pub experts: DType,
    /// Activations exchanged between attention and experts.
    pub activations: DType,
    /// Block-scale shape `[rows, cols]` for fp8 weights.
    pub block_scale: Option<[u32; 2]>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    Bf16,
    Fp8E4m3,
    /// OCP microscaling fp4 with an e8m0 scale per 32 values.
    Mxfp4,
    /// Scales and selection biases in memory plans; not a model storage type.
    F32,
}

impl DType {
    /// Storage bits per element, including amortized scales where
    /// `block` is the fp8 block-scale shape.
    pub fn bits_per_element(self, block: Option<[u32; 2]>) -> f64 {
        match self {
            DType::Bf16 => 16.0,
            DType::Fp8E4m3 => {
                let scale = block.map_or(0.0, |[r, c]| 32.0 / f64::from(r.max(1) * c.max(1)));
                8.0 + scale
            }
            DType::Mxfp4 => 4.0 + 8.0 / 32.0,
            DType::F32 => 32.0,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::Fp8E4m3 => "fp8_e4m3",
            DType::Mxfp4 => "mxfp4",
            DType::F32 => "f32",
        }
    }
}

/// Parameter counts of a [`Model`], by component.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamCount {
    pub embedding: u64,
    pub lm_head: u64,
    pub attention: u64,
    pub norms: u64,
    pub dense_ffn: u64,
    pub router: u64,
    pub routed_experts: u64,
    pub shared_experts: u64,
}

impl ParamCount {
    /// The sum (saturating: a checked spec's extreme shapes cannot overflow,
    /// they only fail to fit any cluster).
    pub fn total(&self) -> u64 {
        [
            self.embedding,
            self.lm_head,
            self.attention,
            self.norms,
            self.dense_ffn,
            self.router,
            self.routed_experts,
            self.shared_experts,
        ]
        .iter()
        .fold(0u64, |a, &b| a.saturating_add(b))
    }
}

/// `Π xs`, saturating.
fn prod(xs: &[u64]) -> u64 {
    xs.iter().fold(1u64, |a, &b| a.saturating_mul(b))
}

impl Model {
    pub fn moe_layers(&self) -> u32 {
        self.layers.saturating_sub(self.dense.map_or(0, |d| d.layers))
    }

    /// Attention projection parameters of one layer (including q/k norms).
    pub fn attention_params_per_layer(&self) -> u64 {
        let h = u64::from(self.hidden);
        match self.attention {
            Attention::Gqa { heads, kv_heads, head_dim, qk_norm, qk_norm_scope, sinks, bias, .. } => {
                let (q, kv, d) = (u64::from(heads), u64::from(kv_heads), u64::from(head_dim));
                let norms = match (qk_norm, qk_norm_scope) {
                    (false, _) => 0,
                    (true, QkNormScope::PerHead) => 2 * d,
                    (true, QkNormScope::PerLayer) => (q + kv) * d,
                };
                let biases = match bias {
                    AttnBias::None => 0,
                    AttnBias::Qkv => (q + 2 * kv) * d,
                    AttnBias::All => (q + 2 * kv) * d + h,
                };
                prod(&[2, h, q, d]).saturating_add(prod(&[2, h, kv, d])) + norms + if sinks { q } else { 0 } + biases
            }
            Attention::Mla { heads, q_lora, kv_lora, qk_nope, qk_rope, v_head, indexer } => {
                let (n, kv, nope, rope, v) =
                    (u64::from(heads), u64::from(kv_lora), u64::from(qk_nope), u64::from(qk_rope), u64::from(v_head));
                let q = match q_lora {
                    Some(r) => prod(&[h, u64::from(r)]) + u64::from(r) + prod(&[u64::from(r), n, nope + rope]),
                    None => prod(&[h, n, nope + rope]),
                };
                let dsa = indexer.map_or(0, |i| i.params(h, q_lora.map_or(h, u64::from)));
                [q, prod(&[h, kv + rope]), kv, prod(&[kv, n, nope + v]), prod(&[n, v, h]), dsa]
                    .iter()
                    .fold(0u64, |a, &b| a.saturating_add(b))
            }
        }
    }

    /// Parameters of one routed expert (gate, up, down, and their biases).
    pub fn expert_params(&self) -> u64 {
        let (h, i) = (u64::from(self.hidden), u64::from(self.moe.expert_ffn));
        prod(&[3, h, i]) + if self.moe.bias { 2 * i + h } else { 0 }
    }

    pub fn params(&self) -> ParamCount {
        let h = u64::from(self.hidden);
        let layers = u64::from(self.layers);
        let moe_layers = u64::from(self.moe_layers());
        let dense = self.dense.map_or(0, |d| prod(&[u64::from(d.layers), 3, h, u64::from(d.ffn)]));
        let (e, shared) = (u64::from(self.moe.experts), u64::from(self.moe.shared_experts));
        ParamCount {
            embedding: prod(&[u64::from(self.vocab), h]),
            lm_head: if self.tie_embeddings { 0 } else { prod(&[u64::from(self.vocab), h]) },
            attention: prod(&[layers, self.attention_params_per_layer()]),
            norms: layers * 2 * h + h,
            dense_ffn: dense,
            router: prod(&[moe_layers, e, h + u64::from(self.moe.bias)]),
            routed_experts: prod(&[moe_layers, e, self.expert_params()]),
            shared_experts: prod(&[moe_layers, shared, 3, h, u64::from(self.moe.shared_ffn)]),
        }
    }

    /// Parameters touched per token (shared, dense and top-k routed experts).
    pub fn active_params(&self) -> u64 {
        let p = self.params();
        let routed_active = prod(&[u64::from(self.moe_layers()), u64::from(self.moe.top_k), self.expert_params()]);
        p.total().saturating_sub(p.routed_experts).saturating_add(routed_active)
    }

    /// Bytes of all weights as stored: experts in `dtype.experts`, the rest in
    /// `dtype.weights` (embeddings, norms and the router stay bf16).
    pub fn weight_bytes(&self) -> u64 {
        let p = self.params();
        let bits = |dt: DType| dt.bits_per_element(self.dtype.block_scale);
        let expert_bits = (p.routed_experts + p.shared_experts) as f64 * bits(self.dtype.experts);
        let linear_bits = (p.attention + p.dense_ffn) as f64 * bits(self.dtype.weights);
        let bf16_bits = (p.embedding + p.lm_head + p.norms + p.router) as f64 * 16.0;
        ((expert_bits + linear_bits + bf16_bits) / 8.0).ceil() as u64
    }

    /// Bytes of every weight but the routed experts (what an attention
    /// server holds when the experts live on MoE servers).
    pub fn nonrouted_weight_bytes(&self) -> u64 {
        let routed = u64::from(self.moe_layers()) * u64::from(self.moe.experts) * self.expert_bytes();
        self.weight_bytes().saturating_sub(routed)
    }

    /// Bytes of one routed expert's weights.
    pub fn expert_bytes(&self) -> u64 {
        (self.expert_params() as f64 * self.dtype.experts.bits_per_element(self.dtype.block_scale) / 8.0).ceil() as u64
    }

    /// KV-cache bytes per token per layer (bf16 cache).
    pub fn kv_bytes_per_token_layer(&self) -> u64 {
        match self.attention {
            Attention::Gqa { kv_heads, head_dim, .. } => 2 * u64::from(kv_heads) * u64::from(head_dim) * 2,
            Attention::Mla { kv_lora, qk_rope, indexer, .. } => {
                (u64::from(kv_lora) + u64::from(qk_rope) + indexer.map_or(0, |i| u64::from(i.head_dim))) * 2
            }
        }
    }
}

// ───────────────────────────── cluster ─────────────────────────────

/// `cluster NAME { … }`: identical nodes of identical GPUs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    pub name: String,
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub gpu: Gpu,
    /// Intra-node fabric (NVLink), per GPU per direction.
    pub scale_up: Link,
    /// Inter-node fabric; required when `nodes > 1`.
    pub scale_out: Option<ScaleOut>,
}

impl Cluster {
    pub fn world_size(&self) -> u32 {
        self.nodes * self.gpus_per_node
    }
}

/// `gpu NAME { … }`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    pub name: String,
    pub arch: Arch,
    pub sms: u32,
    pub hbm: u64,
    pub hbm_bandwidth: f64,
    pub bf16_flops: f64,
    pub fp8_flops: Option<f64>,
    pub smem_per_sm: u64,
    /// Largest dynamic shared memory one block may use.
    pub smem_per_block: u64,
}

/// The compute capability kernels are generated for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    /// Ampere (A100): `mma.sync`, `cp.async`.
    Sm80,
    /// Hopper with arch-specific features (H100/H800/H200): wgmma, TMA, clusters.
    Sm90a,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Sm80 => "sm_80",
            Arch::Sm90a => "sm_90a",
        }
    }
    /// The MMA instruction shape `[m, n, k]` for 16-bit inputs; k doubles for fp8.
    pub fn mma_shape(self, dtype: DType) -> [u32; 3] {
        let k = if dtype == DType::Bf16 { 16 } else { 32 };
        match self {
            Arch::Sm80 => [16, 8, k],
            // One warpgroup's wgmma covers 64 rows.
            Arch::Sm90a => [64, 8, k],
        }
    }
    /// Whether thread-block clusters exist on this architecture.
    pub fn has_clusters(self) -> bool {
        self == Arch::Sm90a
    }
}

/// `scale_up NAME { bandwidth latency }`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    pub name: String,
    pub bandwidth: f64,
    pub latency: f64,
}

/// `scale_out NAME { nics_per_node bandwidth latency virtual_lanes }`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScaleOut {
    pub name: String,
    pub nics_per_node: u32,
    /// Per NIC, per direction.
    pub bandwidth: f64,
    pub latency: f64,
    /// InfiniBand virtual lanes (default 1). With two or more, ExpertPlex's
    /// prefill traffic rides a lower-priority lane than decode's where the
    /// phases share a scale-out link (§5); the simulator models that.
    pub virtual_lanes: u32,
}

// ───────────────────────────── tiles ─────────────────────────────

/// `tiles NAME { prefill { … } decode { … } attention { … } dense { … } }`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tiles {
    pub name: String,
    pub prefill: PhaseTiles,
    pub decode: PhaseTiles,
    /// The prefill attention kernel's tiles; absent: the target's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<AttentionTiles>,
    /// The dense GEMMs' tiles (projections, router, LM head, dense and
    /// shared-expert FFNs); absent: the routed experts' tiles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dense: Option<DenseTiles>,
}

/// `dense { block_m = 128  block_n = 128  block_k = 64  cluster = [2, 1]
/// stages = 4  decode_block_m = 64 }`: the dense APK's tile (one GEMM per
/// operation, both phases on one stage ring and cluster shape, as the MoE
/// APK) and the tile height of its decode operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DenseTiles {
    pub tile: Tile,
    pub decode_block_m: u32,
}

/// `attention { block_q = 64  block_kv = 64 }`: the flash-attention-style
/// prefill kernel's query rows per block (16 per warp, one MMA's m) and the
/// keys it stages in shared memory per step (K, and V transposed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttentionTiles {
    pub block_q: u32,
    pub block_kv: u32,
}

impl AttentionTiles {
    /// Static shared memory of a block for heads of `head_dim`: the key tile
    /// `[block_kv][head_dim + 8]` and the transposed value tile
    /// `[head_dim][block_kv + 8]`, bf16 (rows padded against bank conflicts).
    pub fn smem_bytes(&self, head_dim: u32) -> u64 {
        let (d, kv) = (u64::from(head_dim), u64::from(self.block_kv));
        2 * (kv * (d + 8) + d * (kv + 8))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Prefill,
    Decode,
}

impl Tiles {
    pub fn phase(&self, phase: Phase) -> &PhaseTiles {
        match phase {
            Phase::Prefill => &self.prefill,
            Phase::Decode => &self.decode,
        }
    }

    /// The dense GEMMs' tiles as a tile set (both GEMMs of a phase the
    /// dense tile; decode's at `decode_block_m` rows); `None` without a
    /// `dense` sub-block. [`Tiles::dense_field`] names a field of this set in
    /// the `dense` sub-block.
    pub fn dense_tiles(&self) -> Option<Tiles> {
        let d = self.dense?;
        let decode = Tile { block_m: d.decode_block_m, ..d.tile };
        Some(Tiles {
            name: self.name.clone(),
            prefill: PhaseTiles { layout: Layout::Contiguous, gate_up: d.tile, down: d.tile },
            decode: PhaseTiles { layout: Layout::Masked, gate_up: decode, down: decode },
            attention: None,
            dense: None,
        })
    }

    /// The `dense` sub-block's field for `field` of [`Tiles::dense_tiles`]
    /// (`decode.gate_up.block_m` → `dense.decode_block_m`, any other
    /// `phase.gemm.key` → `dense.key`).
    pub fn dense_field(field: &str) -> String {
        let key = field.rsplit('.').next().unwrap_or(field);
        if field.starts_with("decode.") && key == "block_m" {
            "dense.decode_block_m".into()
        } else {
            format!("dense.{key}")
        }
    }
}

/// The grouped-GEMM tiles of one phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseTiles {
    pub layout: Layout,
    pub gate_up: Tile,
    pub down: Tile,
}

/// How routed rows are arranged for the grouped GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// Rows of all experts packed back to back, each expert padded to `block_m`.
    Contiguous,
    /// A fixed `[experts, max_rows]` buffer with a per-expert row count.
    Masked,
}

/// One GEMM's tile: block sizes, CTA-cluster shape and pipeline depth.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tile {
    pub block_m: u32,
    pub block_n: u32,
    pub block_k: u32,
    /// CTA-cluster shape `[x, y]`.
    pub cluster: [u32; 2],
    pub stages: u32,
}

impl Tile {
    /// Shared memory of the pipeline plus the epilogue staging tile.
    pub fn smem_bytes(&self, input: DType) -> u64 {
        let elt = if input == DType::Bf16 { 2 } else { 1 };
        let stage = (u64::from(self.block_m) + u64::from(self.block_n)) * u64::from(self.block_k) * elt;
        let epilogue = u64::from(self.block_m) * u64::from(self.block_n) * 2;
        u64::from(self.stages) * stage + epilogue
    }
}

// ───────────────────────────── deploy ─────────────────────────────

/// `deploy NAME { … }`: a model on a cluster with tiles and goals.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Deploy {
    pub name: String,
    pub model: ModelId,
    pub cluster: ClusterId,
    pub tiles: TilesId,
    pub slo: Slo,
    pub workload: Workload,
    pub strategy: Strategy,
    pub switch: SwitchPolicy,
    pub placement: Placement,
    /// Fraction of each GPU's HBM the serving stack may use.
    pub memory_fraction: f64,
}

/// Latency targets in seconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    pub ttft: f64,
    pub tpot: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    pub input: LengthDist,
    pub output: LengthDist,
    pub arrival: Arrival,
}

/// A distribution of token counts.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LengthDist {
    Fixed {
        value: u32,
    },
    Uniform {
        min: u32,
        max: u32,
    },
    /// Log-normal with the given mean and log-space sigma, truncated at `max`.
    Lognormal {
        mean: f64,
        sigma: f64,
        max: u32,
    },
    /// ShareGPT-like chat lengths.
    Sharegpt,
    /// LooGLE-like long documents.
    Loogle,
    /// RL rollout (Moebius §6.3): short prompts (median 120), heavy-tailed outputs (median 1510) up to 32k.
    Rollout,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Arrival {
    pub process: ArrivalProcess,
    /// Mean requests per second.
    pub rate: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ArrivalProcess {
    Poisson,
    /// Gamma inter-arrivals with shape `burstiness` (1 = Poisson, < 1 burstier).
    Gamma {
        burstiness: f64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Shared MoE servers with per-phase attention servers (ExpertPlex).
    Expertplex,
    /// Instance-level prefill/decode disaggregation.
    PdDisagg,
    /// DP attention + EP experts, both phases on every GPU.
    Colocated,
    /// Let the planner choose.
    Auto,
}

impl Strategy {
    /// The spec's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Expertplex => "expertplex",
            Strategy::PdDisagg => "pd-disagg",
            Strategy::Colocated => "colocated",
            Strategy::Auto => "auto",
        }
    }
}

/// The TP↔EP switch policy (Moebius §4.5).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SwitchPolicy {
    pub enabled: bool,
    /// In TP, switch to EP when in-flight requests exceed T_h; `None` = calibrate.
    pub t_high: Option<u32>,
    /// In EP, switch to TP when the mean over the window is below T_ℓ;
    /// `None` = 0.8·T_h.
    pub t_low: Option<u32>,
    /// Window W in iterations.
    pub window: u32,
    /// Cooldown C in seconds.
    pub cooldown: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Placement {
    pub policy: PlacementPolicy,
    /// Extra expert replicas across the cluster, per MoE layer.
    pub redundant_experts: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlacementPolicy {
    /// Experts striped contiguously over ranks, one copy each.
    None,
    /// DeepSeek's expert-parallel load balancer.
    Eplb,
    /// Zepp: locality-preferred replica placement and routing.
    Zepp,
}
