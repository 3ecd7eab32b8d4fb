//! The model the CPU twin computes: its shape, derived from the spec and
//! admitted by the capability table, the checkpoint tensors it reads, and
//! the shape each of the plan's views must have for its arithmetic.

use super::math::Rope;
use moeforge_dsl::spec::{Activation, Attention, AttnBias, DType, LayerAttn, Model, QkNormScope, Routing};
use moeforge_plan::caps;
use moeforge_plan::memory::{Mode, TensorPart, TensorRole};

/// DeepSeek-V3's multi-head latent attention: q through an optional LoRA
/// (`q_a_proj`, its RMSNorm, `q_b_proj`) or a direct `q_proj`; per token one
/// latent (`kv_a_proj_with_mqa` → `kv_lora` values, RMS-normed, plus a
/// `qk_rope` key shared by every head) is what the KV cache holds; per head
/// `kv_b_proj` expands it into `qk_nope` key and `v_head` value dims.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaShape {
    pub q_lora: Option<usize>,
    pub kv_lora: usize,
    pub nope: usize,
    pub rope: usize,
    pub v_head: usize,
    /// `(nope + rope)^-1/2`, times YaRN's `mscale²` when scaled.
    pub softmax_scale: f32,
    /// DeepSeek Sparse Attention's lightning indexer (GLM-5), if any.
    pub indexer: Option<IndexerShape>,
}

/// The DSA indexer: `heads` ReLU scoring heads of `head_dim` (RoPE on
/// their first `qk_rope` dims, interleaved), a LayerNorm'd key of
/// `head_dim` cached beside the latent, per-head weights from the hidden
/// state; each query attends to the `top_k` best-scoring cached keys.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IndexerShape {
    pub heads: usize,
    pub head_dim: usize,
    pub top_k: usize,
}

/// The model shape the twin computes, derived from the spec.
#[derive(Clone, Debug, PartialEq)]
pub struct TwinModel {
    pub layers: usize,
    pub hidden: usize,
    pub vocab: usize,
    pub dense_layers: usize,
    pub dense_ffn: usize,
    pub heads: usize,
    /// KV heads: GQA's, or 1 for MLA's shared latent.
    pub kv_heads: usize,
    /// GQA's head width (MLA: the query head's, `qk_nope + qk_rope`).
    pub head_dim: usize,
    /// Multi-head latent attention's shape, when the model uses it.
    pub mla: Option<MlaShape>,
    pub qk_norm: bool,
    /// QK-norm over the whole projection (all heads at once, MiniMax-M2)
    /// rather than over each head.
    pub qk_norm_per_layer: bool,
    pub rope: Rope,
    pub rms_eps: f64,
    pub tie_embeddings: bool,
    pub experts: usize,
    /// Expert slots an EP rank holds per MoE layer as the plan lays them out
    /// (0 until a plan sets it: `E / P` striped). See [`TwinModel::ep_local`].
    pub ep_slots: usize,
    pub top_k: usize,
    pub expert_ffn: usize,
    /// Shared experts merged into one FFN of this size (0: none).
    pub shared_ffn: usize,
    pub routing: Routing,
    /// fp8 e4m3 storage with block scales (the Hub's `weight_scale_inv`):
    /// of the attention and dense projections (`weights`), of the routed
    /// and shared experts (`experts`); `scale_block` rows and columns a scale.
    pub fp8_weights: bool,
    pub fp8_experts: bool,
    pub scale_block: usize,
    /// GPT-OSS: learned per-head sinks in every softmax, a sliding window on
    /// the layers the pattern marks (`window`, per layer), biases on the
    /// attention projections, the router and the experts, and the clamped
    /// SwiGLU.
    pub sinks: bool,
    pub attn_bias: AttnBias,
    pub window: Option<(usize, Vec<bool>)>,
    pub moe_bias: bool,
    pub activation: Activation,
}

impl TwinModel {
    pub fn from_spec(m: &Model) -> Result<TwinModel, String> {
        let refused = caps::refusals(m, caps::Component::CpuTwin);
        if !refused.is_empty() {
            let why: Vec<String> = refused.iter().map(|(u, why)| format!("{} ({why})", u.feature.name())).collect();
            return Err(format!("the CPU twin cannot run `{}`: it uses {}", m.name, why.join(", ")));
        }
        let (sinks, attn_bias) = match m.attention {
            Attention::Gqa { sinks, bias, .. } => (sinks, bias),
            Attention::Mla { .. } => (false, AttnBias::None),
        };
        let (heads, kv_heads, head_dim, qk_norm, qk_norm_per_layer, rope, mla) = match m.attention {
            Attention::Gqa { heads, kv_heads, head_dim, qk_norm, qk_norm_scope, rope_dim, .. } => (
                heads,
                kv_heads,
                head_dim,
                qk_norm,
                qk_norm && qk_norm_scope == QkNormScope::PerLayer,
                Rope::new(rope_dim as usize, m.rope_theta, m.rope_scaling.as_ref()),
                None,
            ),
            Attention::Mla { heads, q_lora, kv_lora, qk_nope, qk_rope, v_head, indexer } => {
                let scale =
                    f64::from(qk_nope + qk_rope).powf(-0.5) * m.rope_scaling.map_or(1.0, |y| y.mla_softmax_factor());
                let shape = MlaShape {
                    q_lora: q_lora.map(|q| q as usize),
                    kv_lora: kv_lora as usize,
                    nope: qk_nope as usize,
                    rope: qk_rope as usize,
                    v_head: v_head as usize,
                    softmax_scale: scale as f32,
                    indexer: indexer.map(|i| IndexerShape {
                        heads: i.heads as usize,
                        head_dim: i.head_dim as usize,
                        top_k: i.top_k as usize,
                    }),
                };
                let rope = Rope::new(qk_rope as usize, m.rope_theta, m.rope_scaling.as_ref()).interleaved();
                (heads, 1, qk_nope + qk_rope, false, false, rope, Some(shape))
            }
        };
        Ok(TwinModel {
            layers: m.layers as usize,
            hidden: m.hidden as usize,
            vocab: m.vocab as usize,
            dense_layers: m.dense.map_or(0, |d| d.layers as usize),
            dense_ffn: m.dense.map_or(0, |d| d.ffn as usize),
            heads: heads as usize,
            kv_heads: kv_heads as usize,
            head_dim: head_dim as usize,
            mla,
            qk_norm,
            qk_norm_per_layer,
            rope,
            rms_eps: m.rms_eps,
            tie_embeddings: m.tie_embeddings,
            experts: m.moe.experts as usize,
            top_k: m.moe.top_k as usize,
            expert_ffn: m.moe.expert_ffn as usize,
            shared_ffn: (m.moe.shared_experts * m.moe.shared_ffn) as usize,
            routing: m.moe.routing,
            fp8_weights: m.dtype.weights == DType::Fp8E4m3,
            fp8_experts: m.dtype.experts == DType::Fp8E4m3,
            scale_block: m.dtype.block_scale.map_or(128, |[r, c]| if r == c { r as usize } else { 0 }),
            sinks,
            attn_bias,
            window: m.sliding_window.as_ref().map(|w| {
                let n = w.pattern.len().max(1);
                (
                    w.size as usize,
                    (0..m.layers as usize).map(|l| w.pattern.get(l % n) == Some(&LayerAttn::Sliding)).collect(),
                )
            }),
            moe_bias: m.moe.bias,
            activation: m.moe.activation,
            ep_slots: 0,
        })
    }

    /// Expert slots an EP rank holds per MoE layer: the plan's (one per
    /// replica under a placement), or `E / P` striped.
    pub fn ep_local(&self, p: usize) -> usize {
        if self.ep_slots > 0 {
            self.ep_slots
        } else {
            self.experts / p.max(1)
        }
    }

    /// The lengths of the q and k norm weights: one head, or every head.
    pub fn qk_norm_widths(&self) -> (usize, usize) {
        if self.qk_norm_per_layer {
            (self.heads * self.head_dim, self.kv_heads * self.head_dim)
        } else {
            (self.head_dim, self.head_dim)
        }
    }

    /// Rows (dim 0) or columns (dim 1, `o_proj`) per query head of a
    /// head-sharded tensor.
    pub fn head_rows(&self, role: TensorRole) -> usize {
        match (self.mla, role) {
            (Some(a), TensorRole::QProj | TensorRole::QBProj) => a.nope + a.rope,
            (Some(a), TensorRole::KvBProj) => a.nope + a.v_head,
            (Some(a), TensorRole::OProj) => a.v_head,
            _ => self.head_dim,
        }
    }

    /// The full (unsharded) shape of a head-sharded tensor.
    pub fn full_shape(&self, role: TensorRole) -> Vec<usize> {
        let (h, n) = (self.hidden, self.heads * self.head_rows(role));
        match (self.mla, role) {
            (_, TensorRole::OProj) => vec![h, n],
            (_, TensorRole::KProj | TensorRole::VProj) => vec![self.kv_heads * self.head_dim, h],
            (Some(a), TensorRole::QBProj) => vec![n, a.q_lora.unwrap_or(h)],
            (Some(a), TensorRole::KvBProj) => vec![n, a.kv_lora],
            _ => vec![n, h],
        }
    }

    /// Bytes one token of one layer takes in one KV head's slot: GQA's K and
    /// V, or MLA's latent and shared rope key (bf16).
    pub fn kv_token_bytes(&self) -> usize {
        match self.mla {
            Some(a) => 2 * (a.kv_lora + a.rope + a.indexer.map_or(0, |i| i.head_dim)),
            None => 4 * self.head_dim,
        }
    }

    /// Whether `role` is stored as fp8 e4m3 with block scales (the plan's
    /// views say the same: the memory pass gives these roles the weights'
    /// or the experts' dtype).
    pub fn fp8(&self, role: TensorRole) -> bool {
        use TensorRole::*;
        match role {
            QProj | KProj | VProj | OProj | QAProj | QBProj | KvAProj | KvBProj | IndexerQ | IndexerK | DenseGate
            | DenseUp | DenseDown => self.fp8_weights,
            SharedGate | SharedUp | SharedDown | ExpertsW13 | ExpertsW2 => self.fp8_experts,
            _ => false,
        }
    }

    /// The block-scale shape `[⌈rows/b⌉, ⌈cols/b⌉]` of an fp8 `[rows, cols]` matrix.
    pub fn scale_shape(&self, rows: usize, cols: usize) -> Vec<usize> {
        let b = self.scale_block.max(1);
        vec![rows.div_ceil(b), cols.div_ceil(b)]
    }

    /// The sliding window of layer `l` (keys within `size` positions of the
    /// query, itself included), or `None` for full attention.
    pub fn window_of(&self, l: usize) -> Option<usize> {
        self.window.as_ref().and_then(|(size, sliding)| sliding.get(l).copied().unwrap_or(false).then_some(*size))
    }

    /// The bias view shape of `role` in `mode` (None: it has no bias):
    /// a projection's output rows (its rank's in TP; o_proj's whole), the
    /// router's experts, the local experts' gate‖up and down columns.
    pub fn bias_shape(&self, role: TensorRole, mode: Mode, p: usize, tp_kv: usize) -> Option<Vec<u64>> {
        use TensorRole::*;
        let tp = mode == Mode::Tp;
        let d = self.head_dim;
        let qkv = self.attn_bias != AttnBias::None;
        let shape = match role {
            QProj if qkv => vec![if tp { self.heads / p } else { self.heads } * d],
            KProj | VProj if qkv => vec![if tp { tp_kv } else { self.kv_heads } * d],
            OProj if self.attn_bias == AttnBias::All => vec![self.hidden],
            Router if self.moe_bias => vec![self.experts],
            ExpertsW13 if self.moe_bias && !tp => vec![self.ep_local(p), 2 * self.expert_ffn],
            ExpertsW2 if self.moe_bias && !tp => vec![self.ep_local(p), self.hidden],
            _ => return None,
        };
        Some(shape.into_iter().map(|x| x as u64).collect())
    }

    pub fn selection_bias(&self) -> bool {
        matches!(self.routing, Routing::SigmoidGrouped { bias: true, .. })
    }

    /// Every checkpoint tensor (canonical names) and its shape; an fp8
    /// matrix is followed by its block scales (`<name>_scale_inv`, f32).
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let mut out = Vec::new();
        for (name, shape) in self.plain_tensor_shapes() {
            let scales = self.fp8_tensor(&name).then(|| self.scale_shape(shape[0], shape[1]));
            out.push((name.clone(), shape));
            if let Some(s) = scales {
                out.push((format!("{name}_scale_inv"), s));
            }
        }
        out
    }

    /// Whether checkpoint tensor `name` (canonical) is an fp8 matrix.
    pub fn fp8_tensor(&self, name: &str) -> bool {
        let proj = name.ends_with("_proj.weight") || name.ends_with("proj_with_mqa.weight");
        if name.contains(".mlp.experts.") || name.contains(".mlp.shared_experts.") {
            proj && self.fp8_experts
        } else if name.contains(".self_attn.indexer.") {
            (name.ends_with(".wq_b.weight") || name.ends_with(".wk.weight")) && self.fp8_weights
        } else {
            proj && self.fp8_weights
        }
    }

    fn plain_tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, d) = (self.hidden, self.head_dim);
        let mut v = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab, h])];
        if !self.tie_embeddings {
            v.push(("lm_head.weight".into(), vec![self.vocab, h]));
        }
        v.push(("model.norm.weight".into(), vec![h]));
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            v.push((format!("{p}.input_layernorm.weight"), vec![h]));
            v.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            let at = |r: TensorRole| r.name(TensorPart::Weight).replace("{l}", &l.to_string());
            match self.mla {
                Some(a) => {
                    match a.q_lora {
                        Some(ql) => {
                            v.push((at(TensorRole::QAProj), vec![ql, h]));
                            v.push((at(TensorRole::QANorm), vec![ql]));
                            v.push((at(TensorRole::QBProj), self.full_shape(TensorRole::QBProj)));
                        }
                        None => v.push((at(TensorRole::QProj), self.full_shape(TensorRole::QProj))),
                    }
                    v.push((at(TensorRole::KvAProj), vec![a.kv_lora + a.rope, h]));
                    v.push((at(TensorRole::KvANorm), vec![a.kv_lora]));
                    v.push((at(TensorRole::KvBProj), self.full_shape(TensorRole::KvBProj)));
                    if let Some(ix) = a.indexer {
                        v.push((at(TensorRole::IndexerQ), vec![ix.heads * ix.head_dim, a.q_lora.unwrap_or(h)]));
                        v.push((at(TensorRole::IndexerK), vec![ix.head_dim, h]));
                        v.push((at(TensorRole::IndexerKNorm), vec![ix.head_dim]));
                        v.push((format!("{p}.self_attn.indexer.k_norm.bias"), vec![ix.head_dim]));
                        v.push((at(TensorRole::IndexerWeights), vec![ix.heads, h]));
                    }
                }
                None => {
                    v.push((at(TensorRole::QProj), vec![self.heads * d, h]));
                    v.push((at(TensorRole::KProj), vec![self.kv_heads * d, h]));
                    v.push((at(TensorRole::VProj), vec![self.kv_heads * d, h]));
                }
            }
            v.push((at(TensorRole::OProj), self.full_shape(TensorRole::OProj)));
            let bias = |r: TensorRole| r.name(TensorPart::Bias).replace("{l}", &l.to_string());
            if self.attn_bias != AttnBias::None && self.mla.is_none() {
                v.push((bias(TensorRole::QProj), vec![self.heads * d]));
                v.push((bias(TensorRole::KProj), vec![self.kv_heads * d]));
                v.push((bias(TensorRole::VProj), vec![self.kv_heads * d]));
            }
            if self.attn_bias == AttnBias::All {
                v.push((bias(TensorRole::OProj), vec![h]));
            }
            if self.sinks {
                v.push((TensorRole::Sinks.name(TensorPart::Weight).replace("{l}", &l.to_string()), vec![self.heads]));
            }
            if self.qk_norm {
                let (qn, kn) = self.qk_norm_widths();
                v.push((format!("{p}.self_attn.q_norm.weight"), vec![qn]));
                v.push((format!("{p}.self_attn.k_norm.weight"), vec![kn]));
            }
            let ffn = |v: &mut Vec<(String, Vec<usize>)>, pre: &str, f: usize| {
                v.push((format!("{pre}.gate_proj.weight"), vec![f, h]));
                v.push((format!("{pre}.up_proj.weight"), vec![f, h]));
                v.push((format!("{pre}.down_proj.weight"), vec![h, f]));
            };
            let expert_biases = |v: &mut Vec<(String, Vec<usize>)>, pre: &str, f: usize| {
                v.push((format!("{pre}.gate_proj.bias"), vec![f]));
                v.push((format!("{pre}.up_proj.bias"), vec![f]));
                v.push((format!("{pre}.down_proj.bias"), vec![h]));
            };
            if l < self.dense_layers {
                ffn(&mut v, &format!("{p}.mlp"), self.dense_ffn);
            } else {
                v.push((format!("{p}.mlp.gate.weight"), vec![self.experts, h]));
                if self.moe_bias {
                    v.push((format!("{p}.mlp.gate.bias"), vec![self.experts]));
                }
                if self.selection_bias() {
                    v.push((format!("{p}.mlp.gate.e_score_correction_bias"), vec![self.experts]));
                }
                for e in 0..self.experts {
                    ffn(&mut v, &format!("{p}.mlp.experts.{e}"), self.expert_ffn);
                    if self.moe_bias {
                        expert_biases(&mut v, &format!("{p}.mlp.experts.{e}"), self.expert_ffn);
                    }
                }
                if self.shared_ffn > 0 {
                    ffn(&mut v, &format!("{p}.mlp.shared_experts"), self.shared_ffn);
                }
            }
        }
        v
    }
}

impl TwinModel {
    /// The shape and dtype of `role`'s view in `mode` with `p` ranks, TP
    /// holding `tp_kv` KV heads per rank: what the twin's arithmetic reads.
    /// `None` for a role the twin does not read.
    pub fn view_shape(&self, role: TensorRole, mode: Mode, p: usize, tp_kv: usize) -> Option<(Vec<u64>, DType)> {
        let (h, d, v) = (self.hidden, self.head_dim, self.vocab);
        let tp = mode == Mode::Tp;
        let (heads, kv) = if tp { (self.heads / p, tp_kv) } else { (self.heads, self.kv_heads) };
        let sharded = |role: TensorRole| -> Vec<usize> {
            let mut s = self.full_shape(role);
            let dim = usize::from(role == TensorRole::OProj);
            s[dim] = heads * self.head_rows(role);
            s
        };
        let (e, i) = (self.experts, self.expert_ffn);
        let (sf, df) = (self.shared_ffn, self.dense_ffn);
        let shape: Vec<usize> = match role {
            TensorRole::Embedding | TensorRole::LmHead => vec![v, h],
            TensorRole::FinalNorm | TensorRole::InputNorm | TensorRole::PostAttentionNorm => vec![h],
            TensorRole::QProj | TensorRole::QBProj | TensorRole::KvBProj | TensorRole::OProj => sharded(role),
            TensorRole::KProj | TensorRole::VProj => vec![kv * d, h],
            TensorRole::QAProj => vec![self.mla?.q_lora?, h],
            TensorRole::QANorm => vec![self.mla?.q_lora?],
            TensorRole::KvAProj => vec![self.mla?.kv_lora + self.mla?.rope, h],
            TensorRole::KvANorm => vec![self.mla?.kv_lora],
            TensorRole::IndexerQ => {
                let (a, ix) = (self.mla?, self.mla?.indexer?);
                vec![ix.heads * ix.head_dim, a.q_lora.unwrap_or(h)]
            }
            TensorRole::IndexerK => vec![self.mla?.indexer?.head_dim, h],
            TensorRole::IndexerKNorm => vec![2, self.mla?.indexer?.head_dim],
            TensorRole::IndexerWeights => vec![self.mla?.indexer?.heads, h],
            TensorRole::QNorm => vec![self.qk_norm_widths().0],
            TensorRole::KNorm => vec![self.qk_norm_widths().1],
            TensorRole::Router => vec![e, h],
            TensorRole::RouterBias => return Some((vec![e as u64], DType::F32)),
            TensorRole::Sinks => vec![heads],
            TensorRole::SharedGate | TensorRole::SharedUp => vec![sf, h],
            TensorRole::SharedDown => vec![h, sf],
            TensorRole::DenseGate | TensorRole::DenseUp => vec![df, h],
            TensorRole::DenseDown => vec![h, df],
            TensorRole::ExpertsW13 if tp => vec![e, 2 * i / p, h],
            TensorRole::ExpertsW13 => vec![self.ep_local(p), 2 * i, h],
            TensorRole::ExpertsW2 if tp => vec![e, h, i / p],
            TensorRole::ExpertsW2 => vec![self.ep_local(p), h, i],
        };
        let dtype = if self.fp8(role) { DType::Fp8E4m3 } else { DType::Bf16 };
        Some((shape.into_iter().map(|x| x as u64).collect(), dtype))
    }

    /// The block-scale view of an fp8 role (`weight_scale_inv`), per mode:
    /// its shape, f32. Experts hold their gate's then up's scales per expert.
    pub fn scale_view_shape(&self, role: TensorRole, mode: Mode, p: usize, tp_kv: usize) -> Option<Vec<u64>> {
        if !self.fp8(role) {
            return None;
        }
        let (shape, _) = self.view_shape(role, mode, p, tp_kv)?;
        let s: Vec<usize> = match (role, shape.as_slice()) {
            (TensorRole::ExpertsW13, &[e, rows, cols]) => {
                let g = self.scale_shape(rows as usize / 2, cols as usize);
                vec![e as usize, 2 * g[0], g[1]]
            }
            (TensorRole::ExpertsW2, &[e, rows, cols]) => {
                [vec![e as usize], self.scale_shape(rows as usize, cols as usize)].concat()
            }
            (_, &[rows, cols]) => self.scale_shape(rows as usize, cols as usize),
            _ => return None,
        };
        Some(s.into_iter().map(|x| x as u64).collect())
    }

    /// The layers `[first, end)` a role's view covers.
    pub fn layers_of(&self, role: TensorRole) -> [u32; 2] {
        use TensorRole::*;
        let (dense, all) = (self.dense_layers as u32, self.layers as u32);
        match role {
            Embedding | LmHead | FinalNorm => [0, 1],
            Router | RouterBias | SharedGate | SharedUp | SharedDown | ExpertsW13 | ExpertsW2 => [dense, all],
            DenseGate | DenseUp | DenseDown => [0, dense],
            _ => [0, all],
        }
    }

    /// The roles the forward pass reads.
    pub fn roles(&self) -> Vec<TensorRole> {
        use TensorRole::*;
        let mut v = vec![Embedding, FinalNorm, InputNorm, PostAttentionNorm, OProj];
        match self.mla {
            Some(a) if a.q_lora.is_some() => v.extend([QAProj, QANorm, QBProj, KvAProj, KvANorm, KvBProj]),
            Some(_) => v.extend([QProj, KvAProj, KvANorm, KvBProj]),
            None => v.extend([QProj, KProj, VProj]),
        }
        if self.mla.is_some_and(|a| a.indexer.is_some()) {
            v.extend([IndexerQ, IndexerK, IndexerKNorm, IndexerWeights]);
        }
        if !self.tie_embeddings {
            v.push(LmHead);
        }
        if self.qk_norm {
            v.extend([QNorm, KNorm]);
        }
        if self.sinks {
            v.push(Sinks);
        }
        v.extend([Router, ExpertsW13, ExpertsW2]);
        if self.selection_bias() {
            v.push(RouterBias);
        }
        if self.shared_ffn > 0 {
            v.extend([SharedGate, SharedUp, SharedDown]);
        }
        if self.dense_layers > 0 {
            v.extend([DenseGate, DenseUp, DenseDown]);
        }
        v
    }
}
