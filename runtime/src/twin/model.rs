//! The model the CPU twin computes: its shape, derived from the spec and
//! admitted by the capability table, the checkpoint tensors it reads, and
//! the shape each of the plan's views must have for its arithmetic.

use super::math::Rope;
use moeforge_dsl::spec::{Attention, DType, Model, QkNormScope, Routing};
use moeforge_plan::caps;
use moeforge_plan::memory::{Mode, TensorRole};

/// The model shape the twin computes, derived from the spec.
#[derive(Clone, Debug, PartialEq)]
pub struct TwinModel {
    pub layers: usize,
    pub hidden: usize,
    pub vocab: usize,
    pub dense_layers: usize,
    pub dense_ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub qk_norm: bool,
    /// QK-norm over the whole projection (all heads at once, MiniMax-M2)
    /// rather than over each head.
    pub qk_norm_per_layer: bool,
    pub rope: Rope,
    pub rms_eps: f64,
    pub tie_embeddings: bool,
    pub experts: usize,
    pub top_k: usize,
    pub expert_ffn: usize,
    /// Shared experts merged into one FFN of this size (0: none).
    pub shared_ffn: usize,
    pub routing: Routing,
}

impl TwinModel {
    pub fn from_spec(m: &Model) -> Result<TwinModel, String> {
        let refused = caps::refusals(m, caps::Component::CpuTwin);
        if !refused.is_empty() {
            let why: Vec<String> = refused.iter().map(|(u, why)| format!("{} ({why})", u.feature.name())).collect();
            return Err(format!("the CPU twin cannot run `{}`: it uses {}", m.name, why.join(", ")));
        }
        let Attention::Gqa { heads, kv_heads, head_dim, qk_norm, qk_norm_scope, rope_dim, .. } = m.attention else {
            return Err(format!("the CPU twin cannot run `{}`: it uses MLA attention", m.name));
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
            qk_norm,
            qk_norm_per_layer: qk_norm && qk_norm_scope == QkNormScope::PerLayer,
            rope: Rope::new(rope_dim as usize, m.rope_theta, m.rope_scaling.as_ref()),
            rms_eps: m.rms_eps,
            tie_embeddings: m.tie_embeddings,
            experts: m.moe.experts as usize,
            top_k: m.moe.top_k as usize,
            expert_ffn: m.moe.expert_ffn as usize,
            shared_ffn: (m.moe.shared_experts * m.moe.shared_ffn) as usize,
            routing: m.moe.routing,
        })
    }

    /// The lengths of the q and k norm weights: one head, or every head.
    pub fn qk_norm_widths(&self) -> (usize, usize) {
        if self.qk_norm_per_layer {
            (self.heads * self.head_dim, self.kv_heads * self.head_dim)
        } else {
            (self.head_dim, self.head_dim)
        }
    }

    pub fn selection_bias(&self) -> bool {
        matches!(self.routing, Routing::SigmoidGrouped { bias: true, .. })
    }

    /// Every checkpoint tensor (canonical names) and its shape.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
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
            v.push((format!("{p}.self_attn.q_proj.weight"), vec![self.heads * d, h]));
            v.push((format!("{p}.self_attn.k_proj.weight"), vec![self.kv_heads * d, h]));
            v.push((format!("{p}.self_attn.v_proj.weight"), vec![self.kv_heads * d, h]));
            v.push((format!("{p}.self_attn.o_proj.weight"), vec![h, self.heads * d]));
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
            if l < self.dense_layers {
                ffn(&mut v, &format!("{p}.mlp"), self.dense_ffn);
            } else {
                v.push((format!("{p}.mlp.gate.weight"), vec![self.experts, h]));
                if self.selection_bias() {
                    v.push((format!("{p}.mlp.gate.e_score_correction_bias"), vec![self.experts]));
                }
                for e in 0..self.experts {
                    ffn(&mut v, &format!("{p}.mlp.experts.{e}"), self.expert_ffn);
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
        let (e, i) = (self.experts, self.expert_ffn);
        let (sf, df) = (self.shared_ffn, self.dense_ffn);
        let shape: Vec<usize> = match role {
            TensorRole::Embedding | TensorRole::LmHead => vec![v, h],
            TensorRole::FinalNorm | TensorRole::InputNorm | TensorRole::PostAttentionNorm => vec![h],
            TensorRole::QProj => vec![heads * d, h],
            TensorRole::KProj | TensorRole::VProj => vec![kv * d, h],
            TensorRole::OProj => vec![h, heads * d],
            TensorRole::QNorm => vec![self.qk_norm_widths().0],
            TensorRole::KNorm => vec![self.qk_norm_widths().1],
            TensorRole::Router => vec![e, h],
            TensorRole::RouterBias => return Some((vec![e as u64], DType::F32)),
            TensorRole::SharedGate | TensorRole::SharedUp => vec![sf, h],
            TensorRole::SharedDown => vec![h, sf],
            TensorRole::DenseGate | TensorRole::DenseUp => vec![df, h],
            TensorRole::DenseDown => vec![h, df],
            TensorRole::ExpertsW13 if tp => vec![e, 2 * i / p, h],
            TensorRole::ExpertsW13 => vec![e / p, 2 * i, h],
            TensorRole::ExpertsW2 if tp => vec![e, h, i / p],
            TensorRole::ExpertsW2 => vec![e / p, h, i],
            _ => return None,
        };
        Some((shape.into_iter().map(|x| x as u64).collect(), DType::Bf16))
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
        let mut v = vec![Embedding, FinalNorm, InputNorm, PostAttentionNorm, QProj, KProj, VProj, OProj];
        if !self.tie_embeddings {
            v.push(LmHead);
        }
        if self.qk_norm {
            v.extend([QNorm, KNorm]);
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
