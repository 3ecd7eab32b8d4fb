//! The dense single-rank reference: the model computed straight from the
//! checkpoint tensors, one token at a time, with a contiguous KV cache per
//! request. No buffers, views, sharding or paging: it is what the twin's
//! TP and EP runs are compared against.

use super::math::{attend, bf16s, dsa_select, layer_norm, rms_norm, round_bf16, silu, softmax_mix, Mat, Scales};
use super::model::MlaShape;
use super::weights::{Checkpoint, Dtype, WeightsError};
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
    /// The DSA indexer's keys (MLA with an indexer).
    index: Vec<Vec<f32>>,
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

    /// A checkpoint matrix: bf16, or fp8 with its `_scale_inv` blocks.
    fn mat(&self, name: &str) -> Mat<'a> {
        let t = &self.ck.tensors[name];
        let scales = (t.dtype == Dtype::F8E4m3).then(|| {
            let s = &self.ck.tensors[&format!("{name}_scale_inv")];
            Scales { buf: &s.data, at: 0, stride: s.shape[1], block: self.m.scale_block }
        });
        Mat { buf: &t.data, at: 0, rows: t.shape[0], cols: t.shape[1], row_stride: t.shape[1], scales }
    }

    fn vec(&self, name: &str) -> Vec<f32> {
        let t = &self.ck.tensors[name];
        if t.dtype == Dtype::F32 {
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
                if let Some(a) = m.mla {
                    let o = self.mla(&p, &h, pos, a, &mut cache[0]);
                    x.iter_mut().zip(&o).for_each(|(s, d)| *s += d);
                    self.ffn_block(&p, l, &mut x);
                    continue;
                }
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
                self.ffn_block(&p, l, &mut x);
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

    /// MLA in its naive form (the one transformers computes, unlike the
    /// twin's absorbed one): every cached latent is expanded by `kv_b_proj`
    /// into each head's `nope` key and value, the shared rope key appended.
    /// `cache` holds the bf16-rounded latent and rotated rope key per position.
    fn mla(&self, p: &str, h: &[f32], pos: usize, a: MlaShape, cache: &mut HeadCache) -> Vec<f32> {
        let m = self.m;
        let eps = m.rms_eps as f32;
        let attn = format!("{p}.self_attn");
        let (q, q_resid) = match a.q_lora {
            Some(_) => {
                let qa = self.mat(&format!("{attn}.q_a_proj.weight")).matvec(h);
                let qa = rms_norm(&qa, &self.vec(&format!("{attn}.q_a_layernorm.weight")), eps);
                (self.mat(&format!("{attn}.q_b_proj.weight")).matvec(&qa), qa)
            }
            None => (self.mat(&format!("{attn}.q_proj.weight")).matvec(h), h.to_vec()),
        };
        // DSA: the positions this query attends to.
        let selected: Vec<usize> = match a.indexer {
            Some(ix) => {
                let ip = format!("{attn}.indexer");
                let kn = (self.vec(&format!("{ip}.k_norm.weight")), self.vec(&format!("{ip}.k_norm.bias")));
                let mut k = layer_norm(&self.mat(&format!("{ip}.wk.weight")).matvec(h), &kn.0, &kn.1, 1e-6);
                m.rope.apply(&mut k, pos);
                cache.index.push(k.iter().map(|x| round_bf16(*x)).collect());
                let mut iq = self.mat(&format!("{ip}.wq_b.weight")).matvec(&q_resid);
                for head in iq.chunks_exact_mut(ix.head_dim) {
                    m.rope.apply(head, pos);
                }
                let s = (ix.heads as f32).powf(-0.5);
                let w: Vec<f32> =
                    self.mat(&format!("{ip}.weights_proj.weight")).matvec(h).iter().map(|v| v * s).collect();
                let keys: Vec<&[f32]> = cache.index.iter().map(Vec::as_slice).collect();
                dsa_select(&iq, &w, &keys, ix.top_k)
            }
            None => (0..=pos).collect(),
        };
        let ckv = self.mat(&format!("{attn}.kv_a_proj_with_mqa.weight")).matvec(h);
        let c = rms_norm(&ckv[..a.kv_lora], &self.vec(&format!("{attn}.kv_a_layernorm.weight")), eps);
        let mut k_rope = ckv[a.kv_lora..].to_vec();
        m.rope.apply(&mut k_rope, pos);
        cache.keys.push(c.iter().map(|x| round_bf16(*x)).collect());
        cache.values.push(k_rope.iter().map(|x| round_bf16(*x)).collect());
        let kvb = self.mat(&format!("{attn}.kv_b_proj.weight"));
        // Expanded keys and values of every cached position: [pos][head × (nope + v)].
        let expanded: Vec<Vec<f32>> = cache.keys.iter().map(|c| kvb.matvec(c)).collect();
        let (qw, kw) = (a.nope + a.rope, a.nope + a.v_head);
        let mut heads = Vec::with_capacity(m.heads * a.v_head);
        for hq in 0..m.heads {
            let mut qh = q[hq * qw..(hq + 1) * qw].to_vec();
            m.rope.apply(&mut qh[a.nope..], pos);
            let scores: Vec<f32> = selected
                .iter()
                .map(|&j| {
                    let key = expanded[j][hq * kw..hq * kw + a.nope].iter().chain(&cache.values[j]);
                    key.zip(&qh).map(|(k, q)| k * q).sum::<f32>() * a.softmax_scale
                })
                .collect();
            heads.extend(softmax_mix(&scores, a.v_head, |i| &expanded[selected[i]][hq * kw + a.nope..(hq + 1) * kw]));
        }
        self.mat(&format!("{attn}.o_proj.weight")).matvec(&heads)
    }

    /// The FFN half of layer `l`: post-attention norm, then the dense FFN or
    /// the MoE block (routing, experts, shared experts), added to `x`.
    fn ffn_block(&self, p: &str, l: usize, x: &mut [f32]) {
        let m = self.m;
        let eps = m.rms_eps as f32;
        let h2 = rms_norm(x, &self.vec(&format!("{p}.post_attention_layernorm.weight")), eps);
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
}
