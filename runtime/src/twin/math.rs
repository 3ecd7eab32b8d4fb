//! The arithmetic of one decoder layer, shared by the dense reference and
//! the ranks of the twin: bf16 storage, f32 compute, fixed summation order.

use crate::reference::{bf16_to_f32, f32_to_bf16};

/// Reads `n` bf16 values at byte offset `at`.
pub fn bf16s(buf: &[u8], at: usize, n: usize) -> impl Iterator<Item = f32> + '_ {
    buf[at..at + 2 * n].chunks_exact(2).map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
}

/// Writes `v` as bf16 at byte offset `at`.
pub fn put_bf16s(buf: &mut [u8], at: usize, v: &[f32]) {
    for (c, x) in buf[at..at + 2 * v.len()].chunks_exact_mut(2).zip(v) {
        c.copy_from_slice(&f32_to_bf16(*x).to_le_bytes());
    }
}

/// Rounds through bf16, as storing to a bf16 buffer does.
pub fn round_bf16(v: f32) -> f32 {
    bf16_to_f32(f32_to_bf16(v))
}

/// fp8 e4m3 (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no
/// infinities, S.1111.111 is NaN) to f32, exactly.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = (i32::from((b >> 3) & 0xf), f32::from(b & 0x7));
    match exp {
        0xf if man == 7.0 => f32::NAN,
        0 => sign * (man / 8.0) * 2f32.powi(-6),
        _ => sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7),
    }
}

/// The block scales of an fp8 matrix (the Hub's `weight_scale_inv`): f32
/// `[⌈rows/block⌉][stride]` at `at` in `buf`; element `[r][c]` of the
/// matrix is its e4m3 code times `scale[r / block][c / block]`.
#[derive(Clone, Copy)]
pub struct Scales<'a> {
    pub buf: &'a [u8],
    pub at: usize,
    pub stride: usize,
    pub block: usize,
}

impl Scales<'_> {
    fn of(&self, r: usize, c: usize) -> f32 {
        let at = self.at + 4 * ((r / self.block) * self.stride + c / self.block);
        f32::from_le_bytes([self.buf[at], self.buf[at + 1], self.buf[at + 2], self.buf[at + 3]])
    }
}

/// A row-major matrix `[rows, cols]` stored at `at` in `buf`, with
/// `row_stride` elements between rows (≥ cols for column slices): bf16, or
/// fp8 e4m3 codes when it has block `scales`.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub buf: &'a [u8],
    pub at: usize,
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub scales: Option<Scales<'a>>,
}

impl Mat<'_> {
    /// A bf16 matrix.
    pub fn bf16(buf: &[u8], at: usize, rows: usize, cols: usize) -> Mat<'_> {
        Mat { buf, at, rows, cols, row_stride: cols, scales: None }
    }

    /// Row `r` in f32 (fp8: each code times its block's scale).
    pub fn row(&self, r: usize) -> Vec<f32> {
        match &self.scales {
            None => bf16s(self.buf, self.at + 2 * r * self.row_stride, self.cols).collect(),
            Some(s) => {
                let base = self.at + r * self.row_stride;
                self.buf[base..base + self.cols].iter().enumerate().map(|(c, &b)| e4m3_to_f32(b) * s.of(r, c)).collect()
            }
        }
    }

    /// `y[r] = Σ_c W[r, c]·x[c]` for every row r, summed in column order.
    pub fn matvec(&self, x: &[f32]) -> Vec<f32> {
        (0..self.rows)
            .map(|r| {
                let mut acc = 0f32;
                match &self.scales {
                    None => {
                        for (w, xi) in bf16s(self.buf, self.at + 2 * r * self.row_stride, self.cols).zip(x) {
                            acc += w * xi;
                        }
                    }
                    Some(_) => {
                        for (w, xi) in self.row(r).into_iter().zip(x) {
                            acc += w * xi;
                        }
                    }
                }
                acc
            })
            .collect()
    }
}

pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(weight).map(|(v, w)| v * inv * w).collect()
}

/// The rotary embedding of a model: the inverse frequency of each rotary
/// pair of the first `dim` dims of a head, and the factor cos and sin are
/// multiplied by (YaRN's attention factor; 1 without scaling).
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub dim: usize,
    pub inv_freq: Vec<f64>,
    pub scale: f32,
    /// Rotates adjacent pairs `(x[2i], x[2i+1])` (DeepSeek's layout) instead
    /// of `(x[i], x[i + dim/2])`.
    pub interleaved: bool,
}

impl Rope {
    pub fn new(dim: usize, theta: f64, scaling: Option<&moeforge_dsl::spec::RopeScaling>) -> Rope {
        match scaling {
            Some(y) => Rope {
                dim,
                inv_freq: y.inv_freq(dim as u32, theta),
                scale: y.attention_factor() as f32,
                interleaved: false,
            },
            None => Rope {
                dim,
                inv_freq: (0..dim / 2).map(|i| 1.0 / theta.powf(2.0 * i as f64 / dim as f64)).collect(),
                scale: 1.0,
                interleaved: false,
            },
        }
    }

    pub fn interleaved(self) -> Rope {
        Rope { interleaved: true, ..self }
    }

    /// Rotates one head (its first `dim` values) at position `pos`.
    pub fn apply(&self, head: &mut [f32], pos: usize) {
        let half = self.dim.min(head.len()) / 2;
        for (i, f) in self.inv_freq.iter().enumerate().take(half) {
            let angle = pos as f64 * f;
            let (s, c) = (angle.sin() as f32 * self.scale, angle.cos() as f32 * self.scale);
            let (x, y) = if self.interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
            let (a, b) = (head[x], head[y]);
            head[x] = a * c - b * s;
            head[y] = b * c + a * s;
        }
    }
}

/// LayerNorm with weight and bias (the DSA indexer's key norm).
pub fn layer_norm(x: &[f32], weight: &[f32], bias: &[f32], eps: f32) -> Vec<f32> {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    x.iter().zip(weight.iter().zip(bias)).map(|(v, (w, b))| (v - mean) * inv * w + b).collect()
}

/// DeepSeek Sparse Attention's selection for one query: the index score of
/// cached key j is `Σ_h w_h · ReLU(q_h · k_j / √head_dim)`; returns the
/// positions of the `top_k` best keys (all of them when fewer), ties to the
/// earlier position. `q` is `[heads × head_dim]` (RoPE applied), `w` the
/// per-head weights (already scaled by `heads^-1/2`).
pub fn dsa_select(q: &[f32], w: &[f32], keys: &[&[f32]], top_k: usize) -> Vec<usize> {
    let d = q.len() / w.len().max(1);
    let scale = 1.0 / (d as f32).sqrt();
    let scores: Vec<f32> = keys
        .iter()
        .map(|k| {
            w.iter()
                .zip(q.chunks_exact(d.max(1)))
                .map(|(wh, qh)| wh * (qh.iter().zip(k.iter()).map(|(a, b)| a * b).sum::<f32>() * scale).max(0.0))
                .sum()
        })
        .collect();
    let mut idx: Vec<usize> = (0..keys.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.truncate(top_k);
    idx.sort_unstable();
    idx
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Softmax-weighted sum of values for one query head over `n` cached
/// positions; `key(j)`/`value(j)` give the j-th cached vectors.
pub fn attend(q: &[f32], n: usize, key: impl Fn(usize) -> Vec<f32>, value: impl Fn(usize) -> Vec<f32>) -> Vec<f32> {
    attend_window(q, 0..n, None, key, value)
}

/// [`attend`] over the keys `keys` only (a sliding window), with a learned
/// sink logit (GPT-OSS) joining the softmax's denominator and adding no value.
pub fn attend_window(
    q: &[f32],
    keys: std::ops::Range<usize>,
    sink: Option<f32>,
    key: impl Fn(usize) -> Vec<f32>,
    value: impl Fn(usize) -> Vec<f32>,
) -> Vec<f32> {
    let scale = 1.0 / (q.len() as f32).sqrt();
    let first = keys.start;
    let scores: Vec<f32> = keys.map(|j| key(j).iter().zip(q).map(|(k, q)| k * q).sum::<f32>() * scale).collect();
    match sink {
        None => softmax_mix(&scores, q.len(), |j| value(first + j)),
        Some(s) => {
            // softmax over [scores…, s], the sink's column dropped.
            let m = scores.iter().copied().fold(s, f32::max);
            let exps: Vec<f32> = scores.iter().map(|x| (x - m).exp()).collect();
            let sum: f32 = exps.iter().sum::<f32>() + (s - m).exp();
            let mut out = vec![0f32; q.len()];
            for (j, e) in exps.iter().enumerate() {
                let p = e / sum;
                for (o, v) in out.iter_mut().zip(value(first + j)) {
                    *o += p * v;
                }
            }
            out
        }
    }
}

/// GPT-OSS's clamped SwiGLU: the gate clamped from above and the up
/// projection both ways at `limit` (7), then `(up + 1) · gate · σ(α·gate)`, α = 1.702.
pub fn swiglu_oai(gate: f32, up: f32) -> f32 {
    const ALPHA: f32 = moeforge_dsl::hf::SWIGLU_OAI_ALPHA as f32;
    const LIMIT: f32 = moeforge_dsl::hf::SWIGLU_OAI_LIMIT as f32;
    let g = gate.min(LIMIT);
    let u = up.clamp(-LIMIT, LIMIT);
    (u + 1.0) * g / (1.0 + (-g * ALPHA).exp())
}

/// `Σ_j softmax(scores)_j · value(j)` over `width` values: the second half
/// of every attention here (GQA, MLA's latent, the naive MLA reference).
pub fn softmax_mix<V: AsRef<[f32]>>(scores: &[f32], width: usize, value: impl Fn(usize) -> V) -> Vec<f32> {
    let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let mut out = vec![0f32; width];
    for (j, e) in exps.iter().enumerate() {
        let p = e / sum;
        for (o, v) in out.iter_mut().zip(value(j).as_ref()) {
            *o += p * v;
        }
    }
    out
}
