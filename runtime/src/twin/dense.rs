//! The dense single-rank reference: the model computed straight from the
//! checkpoint tensors, one token at a time, with a contiguous KV cache per
//! request. No buffers, views, sharding or paging: it is what the twin's
//! TP and EP runs are compared against.

use super::math::{attend, bf16s, rms_norm, round_bf16, silu, Mat};
use super::weights::{Checkpoint, WeightsError};
use super::TwinModel;
use crate::reference::{route, RoutingRule};
use crate::sampling::argmax;

/// Greedy tokens and the logits that chose each of them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
}

/// One KV head's cache: bf16-rounded keys and values per position.
#[derive(Clone, Debug, Default)]
struct HeadCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

pub struct Dense<'a> {
    m: &'a TwinModel,
    ck: &'a Checkpoint,
}

impl<'a> Dense<'a> {
    pub fn new(m: &'a TwinModel, ck: &'a Checkpoint) -> Result<Self, WeightsError> {
        ck.validate(m)?;
        Ok(Dense { m, ck })
    }

    fn mat(&self, name: &str) -> Mat<'a> {
        let t = &self.ck.tensors[name];
        Mat { buf: &t.data, at: 0, rows: t.shape[0], cols: t.shape[1], row_stride: t.shape[1] }
    }

    fn vec(&self, name: &str) -> Vec<f32> {
        let t = &self.ck.tensors[name];
        if t.f32 {
            t.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        } else {
            bf16s(&t.data, 0, t.data.len() / 2).collect()
        }
    }

    fn ffn(&self, pre: &str, x: &[f32]) -> Vec<f32> {
        let g = self.mat(&format!("{pre}.gate_proj.weight")).matvec(x);
        let u = self.mat(&format!("{pre}.up_proj.weight")).matvec(x);
        let z: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
        self.mat(&format!("{pre}.down_proj.weight")).matvec(&z)
    }

    /// Greedy decoding of `max_new` tokens after `prompt`.
    pub fn generate(&self, prompt: &[u32], max_new: usize) -> Generation {
        let m = self.m;
        let (hd, nh, nkv) = (m.head_dim, m.heads, m.kv_heads);
        let group = nh / nkv;
        let eps = m.rms_eps as f32;
        // kv[layer][kv head] = keys and values, one Vec per position
        let mut kv: Vec<Vec<HeadCache>> = vec![vec![HeadCache::default(); nkv]; m.layers];
        let mut out = Generation::default();
        let mut tokens: Vec<u32> = prompt.to_vec();
        let mut pos = 0;
        while out.tokens.len() < max_new {
            let tok = tokens[pos];
            let embed = &self.ck.tensors["model.embed_tokens.weight"];
            let mut x: Vec<f32> = bf16s(&embed.data, 2 * tok as usize * m.hidden, m.hidden).collect();
            for (l, cache) in kv.iter_mut().enumerate() {
                let p = format!("model.layers.{l}");
                let h = rms_norm(&x, &self.vec(&format!("{p}.input_layernorm.weight")), eps);
                let q = self.mat(&format!("{p}.self_attn.q_proj.weight")).matvec(&h);
                let k = self.mat(&format!("{p}.self_attn.k_proj.weight")).matvec(&h);
                let v = self.mat(&format!("{p}.self_attn.v_proj.weight")).matvec(&h);
                let (qn, kn) = if m.qk_norm {
                    (
                        Some(self.vec(&format!("{p}.self_attn.q_norm.weight"))),
                        Some(self.vec(&format!("{p}.self_attn.k_norm.weight"))),
                    )
                } else {
                    (None, None)
                };
                // The all-head QK-norm (MiniMax-M2) normalizes the whole projection.
                let (q, k) = match (&qn, &kn) {
                    (Some(wq), Some(wk)) if m.qk_norm_per_layer => (rms_norm(&q, wq, eps), rms_norm(&k, wk, eps)),
                    _ => (q, k),
                };
                let per_head = !m.qk_norm_per_layer;
                for g in 0..nkv {
                    let mut kh = k[g * hd..(g + 1) * hd].to_vec();
                    if let Some(w) = kn.as_ref().filter(|_| per_head) {
                        kh = rms_norm(&kh, w, eps);
                    }
                    m.rope.apply(&mut kh, pos);
                    cache[g].keys.push(kh.iter().map(|x| round_bf16(*x)).collect());
                    cache[g].values.push(v[g * hd..(g + 1) * hd].iter().map(|x| round_bf16(*x)).collect());
                }
                let mut heads = Vec::with_capacity(nh * hd);
                for hq in 0..nh {
                    let mut qh = q[hq * hd..(hq + 1) * hd].to_vec();
                    if let Some(w) = qn.as_ref().filter(|_| per_head) {
                        qh = rms_norm(&qh, w, eps);
                    }
                    m.rope.apply(&mut qh, pos);
                    let c = &cache[hq / group];
                    heads.extend(attend(&qh, pos + 1, |j| c.keys[j].clone(), |j| c.values[j].clone()));
                }
                let o = self.mat(&format!("{p}.self_attn.o_proj.weight")).matvec(&heads);
                x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
                let h2 = rms_norm(&x, &self.vec(&format!("{p}.post_attention_layernorm.weight")), eps);
                let y = if l < m.dense_layers {
                    self.ffn(&format!("{p}.mlp"), &h2)
                } else {
                    let logits = self.mat(&format!("{p}.mlp.gate.weight")).matvec(&h2);
                    let bias = m.selection_bias().then(|| self.vec(&format!("{p}.mlp.gate.e_score_correction_bias")));
                    let rule = RoutingRule { experts: m.experts, top_k: m.top_k, routing: m.routing };
                    let (ids, w) = route(&rule, &logits, bias.as_deref());
                    let mut y = vec![0f32; m.hidden];
                    for (e, wk) in ids.iter().zip(&w) {
                        let ye = self.ffn(&format!("{p}.mlp.experts.{e}"), &h2);
                        y.iter_mut().zip(&ye).for_each(|(a, b)| *a += wk * b);
                    }
                    if m.shared_ffn > 0 {
                        let s = self.ffn(&format!("{p}.mlp.shared_experts"), &h2);
                        y.iter_mut().zip(&s).for_each(|(a, b)| *a += b);
                    }
                    y
                };
                x.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
            }
            pos += 1;
            if pos == tokens.len() {
                let xn = rms_norm(&x, &self.vec("model.norm.weight"), eps);
                let head = if m.tie_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" };
                let logits = self.mat(head).matvec(&xn);
                let next = argmax(&logits);
                out.tokens.push(next);
                out.logits.push(logits);
                tokens.push(next);
            }
        }
        out
    }
}
