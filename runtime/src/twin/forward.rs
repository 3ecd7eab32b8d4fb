//! One forward step on every rank: embeddings, per layer attention (with
//! QK-norm and RoPE over the paged KV cache, TP all-reduce of the partial
//! outputs) then the dense FFN or the MoE block, and the LM head for each
//! request's last position (greedy sampling). The weights come from the
//! views of the current mode, selected by tensor role.

use super::math::{
    attend_window, bf16s, dsa_select, layer_norm, put_bf16s, rms_norm, silu, softmax_mix, swiglu_oai, Mat, Scales,
};
use super::model::MlaShape;
use super::paging::KvGeom;
use super::{Rank, Twin, TwinError, TwinModel};
use crate::engine::{EngineError, RequestId};
use moeforge_dsl::spec::Activation;
use moeforge_plan::memory::{head_block, Mode, TensorRole, View};
use std::collections::BTreeMap;

/// One token to process: (request, position, token id).
pub(super) type Slot = (RequestId, usize, u32);

impl Twin {
    /// The forward pass of one step: the number of tokens processed and the
    /// token each request that reached its last position produced.
    pub(super) fn forward(&mut self) -> Result<(usize, Vec<(RequestId, u32)>), EngineError> {
        let m = self.model.clone();
        let mode = self.mode;
        let p = self.ranks.len();
        // Per rank: every token to process.
        let batches: Vec<Vec<Slot>> = self
            .ranks
            .iter()
            .map(|r| {
                r.requests
                    .iter()
                    // A prefill server only prefills: a request waiting there
                    // for a decode server is not stepped.
                    .filter(|&&id| !self.awaits_handoff(r, id))
                    .filter_map(|id| self.requests.get(id))
                    .flat_map(|q| (q.cached..q.len()).map(move |pos| (q.id, pos, q.token(pos))))
                    .collect()
            })
            .collect();
        let n_tokens: usize = match mode {
            Mode::Tp => batches.first().map_or(0, Vec::len),
            Mode::Ep => batches.iter().map(Vec::len).sum(),
        };
        // Pages for the new positions (admission reserved them).
        let page = self.plan.kv.page_tokens.max(1) as usize;
        for (r, batch) in self.ranks.iter_mut().zip(&batches) {
            for &(id, pos, _) in batch {
                let table = r.tables.entry(id).or_default();
                if pos / page >= table.len() {
                    let pg = r.pages.free.pop_front().ok_or_else(|| {
                        EngineError::Capacity(format!("rank {} ran out of KV pages for request {id}", r.id))
                    })?;
                    table.push(pg);
                }
            }
        }
        // Each new position's page, resolved once (every one was allocated above).
        let mut slot_pages: Vec<Vec<u32>> = Vec::with_capacity(p);
        for (r, batch) in self.ranks.iter().zip(&batches) {
            let pages: Option<Vec<u32>> =
                batch.iter().map(|&(id, pos, _)| r.tables.get(&id).and_then(|t| t.get(pos / page)).copied()).collect();
            slot_pages.push(pages.ok_or_else(|| EngineError::Backend(format!("rank {} lost a page table", r.id)))?);
        }
        if self.device.is_some() {
            return self.forward_on_device(&batches, n_tokens);
        }
        let cx = Ctx::new(self, mode)?;
        let mut x: Vec<Vec<Vec<f32>>> = self
            .ranks
            .iter()
            .zip(&batches)
            .map(|(r, b)| b.iter().map(|&(_, _, t)| cx.row(&r.buf, TensorRole::Embedding, t as usize)).collect())
            .collect();
        for l in 0..m.layers {
            // Projections (parallel per rank); the all-head QK-norm's
            // sum-of-squares reduction; attention; the TP all-reduce.
            let projs: Vec<Proj> = par_ranks(&self.ranks, |rank| cx.project(rank, l, &x[rank.id]));
            if let Some(r) =
                projs.iter().zip(&batches).position(|(pr, b)| pr.q.len() != b.len() || pr.k.len() != b.len())
            {
                return Err(EngineError::Backend(format!(
                    "rank {r}: layer {l}'s attention projections are not in its views"
                )));
            }
            let scales = if m.qk_norm_per_layer { cx.all_head_scales(&projs) } else { vec![vec![]; p] };
            let outs: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
                let handles: Vec<_> = self
                    .ranks
                    .iter_mut()
                    .zip(&batches)
                    .zip(&slot_pages)
                    .zip(projs)
                    .zip(&scales)
                    .map(|((((rank, batch), pages), proj), scales)| {
                        let cx = &cx;
                        s.spawn(move || cx.attention(rank, l, batch, pages, proj, scales))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
            });
            let outs = if mode == Mode::Tp { all_reduce(outs) } else { outs };
            add_outputs(&mut x, outs);
            // FFN: dense, or router, dispatch, experts, combine.
            let normed: Vec<Vec<Vec<f32>>> = x
                .iter()
                .zip(&self.ranks)
                .map(|(xs, rank)| xs.iter().map(|v| cx.norm(&rank.buf, TensorRole::PostAttentionNorm, l, v)).collect())
                .collect();
            let outs = if l < m.dense_layers {
                let dense = [TensorRole::DenseGate, TensorRole::DenseUp, TensorRole::DenseDown];
                par_ranks(&self.ranks, |rank| normed[rank.id].iter().map(|h| cx.ffn(&rank.buf, dense, l, h)).collect())
            } else {
                self.moe(&cx, l, &normed)
            };
            add_outputs(&mut x, outs);
        }
        // Logits for the last token of each request.
        let mut results: Vec<(RequestId, Vec<f32>)> = Vec::new();
        let head = if m.tie_embeddings { TensorRole::Embedding } else { TensorRole::LmHead };
        let ranks_with_output: Vec<usize> = match mode {
            Mode::Tp => vec![0],
            Mode::Ep => (0..p).collect(),
        };
        for r in ranks_with_output {
            let rank = &self.ranks[r];
            for (i, &(id, pos, _)) in batches[r].iter().enumerate() {
                if self.requests.get(&id).is_some_and(|q| pos + 1 == q.len()) {
                    let xn = cx.norm(&rank.buf, TensorRole::FinalNorm, 0, &x[r][i]);
                    results.push((id, cx.mat(&rank.buf, head, 0).map_or_else(Vec::new, |w| w.matvec(&xn))));
                }
            }
        }
        let mut produced = Vec::with_capacity(results.len());
        for (id, logits) in results {
            let Some(q) = self.requests.get_mut(&id) else { continue };
            let token = q.sampler.sample(&logits);
            q.cached = q.len();
            q.generated.push(token);
            produced.push((id, token));
            if self.keep_logits {
                self.logits.entry(id).or_default().push(logits);
            }
        }
        Ok((n_tokens, produced))
    }
}

impl Twin {
    /// The step on the device: each rank's requests (their new tokens,
    /// cached length, page table and sampler) handed to the program
    /// interpreter, which runs the bundle's program for the mode and phase
    /// (decode when every request adds one token to a cached prefix). A
    /// role plan's step is two: its decode servers' decode step and its
    /// prefill servers' prefill step, the MoE servers taking part in both.
    fn forward_on_device(
        &mut self,
        batches: &[Vec<Slot>],
        n_tokens: usize,
    ) -> Result<(usize, Vec<(RequestId, u32)>), EngineError> {
        use crate::device::exec::{ExecError, Work};
        let mode = self.mode;
        let mut ids: Vec<Vec<RequestId>> = Vec::with_capacity(batches.len());
        let mut work: Vec<Vec<Work>> = Vec::with_capacity(batches.len());
        for (rank, batch) in self.ranks.iter().zip(batches) {
            let (mut ri, mut rw) = (Vec::new(), Vec::new());
            for &id in &rank.requests {
                let Some(q) = self.requests.get(&id) else { continue };
                let tokens: Vec<u32> = batch.iter().filter(|s| s.0 == id).map(|s| s.2).collect();
                if tokens.is_empty() {
                    continue;
                }
                rw.push(Work {
                    cached: q.cached as u32,
                    tokens,
                    pages: rank.tables.get(&id).cloned().unwrap_or_default(),
                    sample: true,
                    temperature: q.sampler.params.temperature,
                    top_p: q.sampler.params.top_p,
                    rng: q.sampler.state(),
                });
                ri.push(id);
            }
            ids.push(ri);
            work.push(rw);
        }
        use moeforge_plan::program::Phase;
        use moeforge_plan::roles::Role;
        let mut out: Vec<Vec<Option<crate::device::exec::Sampled>>> =
            work.iter().map(|w| vec![None; w.len()]).collect();
        let steps: Vec<(Phase, Vec<Vec<Work>>)> = match &self.roles {
            None => {
                let decode = work.iter().flatten().all(|w| w.cached > 0 && w.tokens.len() == 1);
                vec![(if decode { Phase::Decode } else { Phase::Prefill }, work)]
            }
            Some(_) => [(Phase::Decode, Role::Decode), (Phase::Prefill, Role::Prefill)]
                .into_iter()
                .map(|(phase, role)| {
                    let of = |(rank, w): (&Rank, &Vec<Work>)| if rank.role == Some(role) { w.clone() } else { vec![] };
                    (phase, self.ranks.iter().zip(&work).map(of).collect::<Vec<_>>())
                })
                .filter(|(_, w)| w.iter().any(|x| !x.is_empty()))
                .collect(),
        };
        let dev = self.device.as_mut().ok_or_else(|| EngineError::Backend("no device".into()))?;
        for (phase, work) in steps {
            let step = dev.step(mode, phase, &work).map_err(|e| match e {
                ExecError::Capacity(_) => EngineError::Capacity(e.to_string()),
                _ => EngineError::Backend(e.to_string()),
            })?;
            for ((o, w), s) in out.iter_mut().zip(&work).zip(step) {
                if !w.is_empty() {
                    *o = s;
                }
            }
        }
        // TP ranks all sample every request: rank 0's tokens are the step's.
        let ranks: Vec<usize> = match mode {
            Mode::Tp => vec![0],
            Mode::Ep => (0..out.len()).collect(),
        };
        let mut produced = Vec::new();
        for r in ranks {
            for (id, s) in ids[r].iter().zip(&out[r]) {
                let (Some(q), Some(s)) = (self.requests.get_mut(id), s) else { continue };
                q.sampler.set_state(s.rng);
                q.cached = q.len();
                q.generated.push(s.token);
                produced.push((*id, s.token));
                if self.keep_logits {
                    self.logits.entry(*id).or_default().push(s.logits.clone());
                }
            }
        }
        Ok((n_tokens, produced))
    }
}

/// `x[r][t] += out[r][t]`.
fn add_outputs(x: &mut [Vec<Vec<f32>>], outs: Vec<Vec<Vec<f32>>>) {
    for (xs, os) in x.iter_mut().zip(outs) {
        for (v, o) in xs.iter_mut().zip(os) {
            v.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        }
    }
}

/// Sums every rank's partial outputs in rank order and gives each rank the sum.
pub(super) fn all_reduce(partial: Vec<Vec<Vec<f32>>>) -> Vec<Vec<Vec<f32>>> {
    let p = partial.len();
    let Some(first) = partial.first() else { return partial };
    let mut sum = first.clone();
    for other in &partial[1..] {
        for (s, o) in sum.iter_mut().zip(other) {
            s.iter_mut().zip(o).for_each(|(a, b)| *a += b);
        }
    }
    vec![sum; p]
}

/// Runs `f` on every rank in parallel (one thread each).
pub(super) fn par_ranks<T: Send>(ranks: &[Rank], f: impl Fn(&Rank) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks.iter().map(|r| s.spawn(|| f(r))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    })
}

/// The views and constants a step needs, resolved once per step. Every
/// view's shape was checked against the model when the twin was built, so
/// the matrices below stay inside their views.
pub(super) struct Ctx {
    pub mode: Mode,
    pub m: TwinModel,
    views: BTreeMap<TensorRole, View>,
    /// Block scales of the fp8 roles.
    scales: BTreeMap<TensorRole, View>,
    /// Biases (attention projections, router, experts).
    biases: BTreeMap<TensorRole, View>,
    pub p: usize,
    q_heads: Vec<[u32; 2]>,
    kv_heads: Vec<(usize, usize)>,
    kv: KvGeom,
}

impl Ctx {
    pub fn new(t: &Twin, mode: Mode) -> Result<Ctx, TwinError> {
        let views: BTreeMap<TensorRole, View> =
            t.views.iter().filter(|((md, _), _)| *md == mode).map(|((_, role), v)| (*role, v.clone())).collect();
        for role in t.model.roles() {
            if !views.contains_key(&role) {
                return Err(TwinError::MissingView(mode.name(), role.name(moeforge_plan::memory::TensorPart::Weight)));
            }
        }
        let of_mode = |m: &BTreeMap<(Mode, TensorRole), View>| -> BTreeMap<TensorRole, View> {
            m.iter().filter(|((md, _), _)| *md == mode).map(|((_, role), v)| (*role, v.clone())).collect()
        };
        let (scales, biases) = (of_mode(&t.scales), of_mode(&t.biases));
        let p = t.ranks.len();
        Ok(Ctx {
            mode,
            m: t.model.clone(),
            views,
            scales,
            biases,
            p,
            q_heads: (0..p as u32)
                .map(|r| match mode {
                    Mode::Tp => head_block(t.model.heads as u32, p as u32, r),
                    Mode::Ep => [0, t.model.heads as u32],
                })
                .collect(),
            kv_heads: (0..p).map(|r| t.kv_heads_of(mode, r)).collect(),
            kv: KvGeom::of(&t.plan, mode),
        })
    }

    /// Byte offset of `role` at layer `l` (global tensors: `l` = 0).
    fn at(&self, role: TensorRole, l: usize) -> Option<(&View, usize)> {
        let v = self.views.get(&role).filter(|v| v.covers(l as u32))?;
        Some((v, v.offset_of(l as u32) as usize))
    }

    pub fn mat<'b>(&self, buf: &'b [u8], role: TensorRole, l: usize) -> Option<Mat<'b>> {
        let (v, at) = self.at(role, l)?;
        let (rows, cols) = (*v.shape.first()? as usize, *v.shape.get(1)? as usize);
        Some(Mat { buf, at, rows, cols, row_stride: cols, scales: self.scales_of(buf, role, l, 0) })
    }

    /// `role`'s bias at layer `l` from element `at` (`n` values; empty: none).
    pub fn bias(&self, buf: &[u8], role: TensorRole, l: usize, at: usize, n: usize) -> Vec<f32> {
        match self.biases.get(&role).filter(|v| v.covers(l as u32)) {
            Some(v) => bf16s(buf, v.offset_of(l as u32) as usize + 2 * at, n).collect(),
            None => vec![],
        }
    }

    /// The block scales of fp8 `role` at layer `l`, from scale row `row0`
    /// of its view (an expert's gate or up, further in).
    fn scales_of<'b>(&self, buf: &'b [u8], role: TensorRole, l: usize, row0: usize) -> Option<Scales<'b>> {
        let v = self.scales.get(&role).filter(|v| v.covers(l as u32))?;
        let stride = *v.shape.last()? as usize;
        Some(Scales { buf, at: v.offset_of(l as u32) as usize + 4 * row0 * stride, stride, block: self.m.scale_block })
    }

    /// Row `i` of a 2-D bf16 view (an embedding).
    fn row(&self, buf: &[u8], role: TensorRole, i: usize) -> Vec<f32> {
        match self.at(role, 0) {
            Some((v, at)) if (i as u64) < v.shape[0] => {
                let cols = v.shape.get(1).copied().unwrap_or(1) as usize;
                bf16s(buf, at + 2 * i * cols, cols).collect()
            }
            _ => vec![0.0; self.m.hidden],
        }
    }

    fn vec(&self, buf: &[u8], role: TensorRole, l: usize) -> Vec<f32> {
        match self.at(role, l) {
            Some((v, at)) => bf16s(buf, at, v.shape.iter().product::<u64>() as usize).collect(),
            None => vec![],
        }
    }

    pub fn f32s(&self, buf: &[u8], role: TensorRole, l: usize) -> Vec<f32> {
        match self.at(role, l) {
            Some((v, at)) => {
                let n = v.shape.iter().product::<u64>() as usize;
                buf[at..at + 4 * n].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            None => vec![],
        }
    }

    pub fn norm(&self, buf: &[u8], role: TensorRole, l: usize, x: &[f32]) -> Vec<f32> {
        rms_norm(x, &self.vec(buf, role, l), self.m.rms_eps as f32)
    }

    /// A SwiGLU FFN from its gate, up and down roles.
    pub fn ffn(&self, buf: &[u8], [gate, up, down]: [TensorRole; 3], l: usize, x: &[f32]) -> Vec<f32> {
        let (Some(g), Some(u), Some(d)) = (self.mat(buf, gate, l), self.mat(buf, up, l), self.mat(buf, down, l)) else {
            return vec![0.0; self.m.hidden];
        };
        let (g, u) = (g.matvec(x), u.matvec(x));
        let z: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
        d.matvec(&z)
    }

    /// Global expert `e` of MoE layer `l` on `x`: EP the whole expert (this
    /// rank owns it); TP this rank's `I/P` slice (a partial sum).
    /// Expert `e` of layer `l` applied to `x`: in TP `e` is the expert id
    /// (every rank holds every expert's slice), in EP the rank's slot.
    pub fn expert(&self, buf: &[u8], l: usize, e: usize, x: &[f32]) -> Vec<f32> {
        let (h, i) = (self.m.hidden, self.m.expert_ffn);
        let (Some((_, w13)), Some((_, w2))) = (self.at(TensorRole::ExpertsW13, l), self.at(TensorRole::ExpertsW2, l))
        else {
            return vec![0.0; h];
        };
        let (local, rows) = match self.mode {
            Mode::Ep => (e, i),
            Mode::Tp => (e, i / self.p),
        };
        // fp8 experts: one byte an element, and each expert's gate, up and
        // down block scales (gate's rows, then up's, per expert).
        let (eb, b) = (if self.m.fp8_experts { 1 } else { 2 }, self.m.scale_block.max(1));
        let (sr13, sr2) = (2 * rows.div_ceil(b), h.div_ceil(b));
        let s13 = |r0| self.scales_of(buf, TensorRole::ExpertsW13, l, r0);
        let mat = |at, rows, cols, scales| Mat { buf, at, rows, cols, row_stride: cols, scales };
        let mut gate = mat(w13 + eb * local * 2 * rows * h, rows, h, s13(local * sr13)).matvec(x);
        let mut up = mat(w13 + eb * (local * 2 * rows + rows) * h, rows, h, s13(local * sr13 + sr13 / 2)).matvec(x);
        // Biases (GPT-OSS; EP only): the local expert's gate, up and down.
        add(&mut gate, &self.bias(buf, TensorRole::ExpertsW13, l, local * 2 * rows, rows));
        add(&mut up, &self.bias(buf, TensorRole::ExpertsW13, l, local * 2 * rows + rows, rows));
        let z: Vec<f32> = match self.m.activation {
            Activation::Silu => gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect(),
            Activation::SwigluOai => gate.iter().zip(&up).map(|(g, u)| swiglu_oai(*g, *u)).collect(),
        };
        let s2 = self.scales_of(buf, TensorRole::ExpertsW2, l, local * sr2);
        let mut y = mat(w2 + eb * local * h * rows, h, rows, s2).matvec(&z);
        add(&mut y, &self.bias(buf, TensorRole::ExpertsW2, l, local * h, h));
        y
    }

    /// The q, k and v projections of one rank's tokens in layer `l` (its
    /// query and KV heads).
    fn project(&self, rank: &Rank, l: usize, xs: &[Vec<f32>]) -> Proj {
        let in_norm = self.vec(&rank.buf, TensorRole::InputNorm, l);
        let eps = self.m.rms_eps as f32;
        if let Some(a) = self.m.mla {
            return self.project_mla(rank, l, xs, &in_norm, a);
        }
        let (Some(wq), Some(wk), Some(wv)) = (
            self.mat(&rank.buf, TensorRole::QProj, l),
            self.mat(&rank.buf, TensorRole::KProj, l),
            self.mat(&rank.buf, TensorRole::VProj, l),
        ) else {
            return Proj::default();
        };
        let (bq, bk, bv) = (
            self.bias(&rank.buf, TensorRole::QProj, l, 0, wq.rows),
            self.bias(&rank.buf, TensorRole::KProj, l, 0, wk.rows),
            self.bias(&rank.buf, TensorRole::VProj, l, 0, wv.rows),
        );
        let mut p = Proj::default();
        for x in xs {
            let h = rms_norm(x, &in_norm, eps);
            let (mut q, mut k, mut v) = (wq.matvec(&h), wk.matvec(&h), wv.matvec(&h));
            add(&mut q, &bq);
            add(&mut k, &bk);
            add(&mut v, &bv);
            p.q.push(q);
            p.k.push(k);
            p.v.push(v);
        }
        p
    }

    /// MLA's projections: q per local head (`nope + rope`), through the q
    /// LoRA and its norm when the model has one; in `k`, the token's cache
    /// entry before RoPE: the RMS-normed latent (`kv_lora`) then the shared
    /// rope key.
    fn project_mla(&self, rank: &Rank, l: usize, xs: &[Vec<f32>], in_norm: &[f32], a: MlaShape) -> Proj {
        let eps = self.m.rms_eps as f32;
        let buf = &rank.buf;
        let q_lora = match a.q_lora {
            Some(_) => match (self.mat(buf, TensorRole::QAProj, l), self.mat(buf, TensorRole::QBProj, l)) {
                (Some(qa), Some(qb)) => Some((qa, self.vec(buf, TensorRole::QANorm, l), qb)),
                _ => return Proj::default(),
            },
            None => None,
        };
        let wq = self.mat(buf, TensorRole::QProj, l);
        let (Some(wkv), kv_norm) = (self.mat(buf, TensorRole::KvAProj, l), self.vec(buf, TensorRole::KvANorm, l))
        else {
            return Proj::default();
        };
        let indexer = match a.indexer {
            Some(ix) => {
                let (wq, wk, wts) = (
                    self.mat(buf, TensorRole::IndexerQ, l),
                    self.mat(buf, TensorRole::IndexerK, l),
                    self.mat(buf, TensorRole::IndexerWeights, l),
                );
                let norm = self.vec(buf, TensorRole::IndexerKNorm, l);
                match (wq, wk, wts) {
                    (Some(wq), Some(wk), Some(wts)) if norm.len() == 2 * ix.head_dim => Some((ix, wq, wk, wts, norm)),
                    _ => return Proj::default(),
                }
            }
            None => None,
        };
        let mut p = Proj::default();
        for x in xs {
            let h = rms_norm(x, in_norm, eps);
            let (q, q_resid) = match (&q_lora, &wq) {
                (Some((qa, norm, qb)), _) => {
                    let r = rms_norm(&qa.matvec(&h), norm, eps);
                    (qb.matvec(&r), r)
                }
                (None, Some(wq)) => (wq.matvec(&h), h.clone()),
                (None, None) => return Proj::default(),
            };
            let ckv = wkv.matvec(&h);
            let mut k = rms_norm(&ckv[..a.kv_lora], &kv_norm, eps);
            k.extend_from_slice(&ckv[a.kv_lora..]);
            if let Some((ix, wq, wk, wts, norm)) = &indexer {
                // The indexer key: LayerNorm (eps 1e-6, as transformers' GLM-5) of wk·h, cached after the latent.
                let (w, b) = norm.split_at(ix.head_dim);
                k.extend(layer_norm(&wk.matvec(&h), w, b, 1e-6));
                p.iq.push(wq.matvec(&q_resid));
                let s = (ix.heads as f32).powf(-0.5);
                p.iw.push(wts.matvec(&h).into_iter().map(|v| v * s).collect());
            }
            p.q.push(q);
            p.k.push(k);
        }
        p
    }

    /// MLA attention of one rank's tokens, in the weight-absorbed form the
    /// decode kernels use: the cache holds each token's latent `c` and
    /// rope key once (TP replicates it on every rank, heads are sharded).
    /// Per head, `kv_b_proj`'s key rows absorb into the query
    /// (`q̃ = W_UKᵀ q_nope`), scores are `(q̃·c + q_rope·k_rope) × scale`,
    /// and its value rows apply once to the softmax-weighted latent.
    fn attention_mla(
        &self,
        rank: &mut Rank,
        l: usize,
        batch: &[Slot],
        pages: &[u32],
        proj: Proj,
        a: MlaShape,
    ) -> Vec<Vec<f32>> {
        let m = &self.m;
        if proj.q.len() != batch.len() || proj.k.len() != batch.len() {
            return vec![vec![0.0; m.hidden]; batch.len()];
        }
        let geo = self.kv;
        let ix_dim = a.indexer.map_or(0, |i| i.head_dim);
        let width = a.kv_lora + a.rope + ix_dim;
        if a.indexer.is_some() && (proj.iq.len() != batch.len() || proj.iw.len() != batch.len()) {
            return vec![vec![0.0; m.hidden]; batch.len()];
        }
        for ((&(_, pos, _), &page), k) in batch.iter().zip(pages).zip(&proj.k) {
            let mut entry = k.clone();
            m.rope.apply(&mut entry[a.kv_lora..a.kv_lora + a.rope], pos);
            if ix_dim > 0 {
                // The indexer's RoPE covers the first qk_rope dims of its key.
                m.rope.apply(&mut entry[a.kv_lora + a.rope..], pos);
            }
            put_bf16s(&mut rank.buf, geo.slot(page, l, 0, pos % geo.page_tokens), &entry);
        }
        let [qa, qb] = self.q_heads[rank.id];
        let (qw, kvb) = (a.nope + a.rope, a.nope + a.v_head);
        let (Some(wkvb), Some(o_proj)) =
            (self.mat(&rank.buf, TensorRole::KvBProj, l), self.mat(&rank.buf, TensorRole::OProj, l))
        else {
            return vec![vec![0.0; m.hidden]; batch.len()];
        };
        batch
            .iter()
            .zip(proj.q)
            .enumerate()
            .map(|(t, (&(id, pos, _), q))| {
                let table = rank.tables.get(&id).cloned().unwrap_or_default();
                let mut cached: Vec<Vec<f32>> = (0..=pos)
                    .map(|j| {
                        let at = geo.slot(table[j / geo.page_tokens], l, 0, j % geo.page_tokens);
                        bf16s(&rank.buf, at, width).collect()
                    })
                    .collect();
                // DSA: only the indexer's top-k cached keys take part.
                if let Some(ix) = a.indexer {
                    let mut iq = proj.iq[t].clone();
                    for head in iq.chunks_exact_mut(ix.head_dim) {
                        m.rope.apply(head, pos);
                    }
                    let keys: Vec<&[f32]> = cached.iter().map(|e| &e[a.kv_lora + a.rope..]).collect();
                    let keep = dsa_select(&iq, &proj.iw[t], &keys, ix.top_k);
                    cached = keep.into_iter().map(|j| std::mem::take(&mut cached[j])).collect();
                }
                let mut heads = Vec::with_capacity((qb - qa) as usize * a.v_head);
                for i in 0..(qb - qa) as usize {
                    let mut qh = q[i * qw..(i + 1) * qw].to_vec();
                    m.rope.apply(&mut qh[a.nope..], pos);
                    let row = |r: usize| wkvb.row(i * kvb + r);
                    let mut q_lat = vec![0f32; a.kv_lora];
                    for (d, qd) in qh[..a.nope].iter().enumerate() {
                        q_lat.iter_mut().zip(row(d)).for_each(|(s, w)| *s += qd * w);
                    }
                    let scores: Vec<f32> = cached
                        .iter()
                        .map(|e| {
                            let nope: f32 = q_lat.iter().zip(&e[..a.kv_lora]).map(|(x, y)| x * y).sum();
                            let rope: f32 = qh[a.nope..].iter().zip(&e[a.kv_lora..]).map(|(x, y)| x * y).sum();
                            (nope + rope) * a.softmax_scale
                        })
                        .collect();
                    let o_lat = softmax_mix(&scores, a.kv_lora, |j| &cached[j][..a.kv_lora]);
                    heads.extend(
                        (0..a.v_head).map(|v| row(a.nope + v).iter().zip(&o_lat).map(|(w, x)| w * x).sum::<f32>()),
                    );
                }
                o_proj.matvec(&heads)
            })
            .collect()
    }

    /// MiniMax-M2's QK-norm runs over every head at once, so under TP each
    /// rank holds only part of the sum of squares. This is that op's
    /// reduction: per token, Σq² over all query heads and Σk² over every KV
    /// head counted once (TP replicates a KV head on several ranks when
    /// kv_heads < P), turned into each rank's `1/rms` for q and for k. In
    /// EP a rank holds every head of its own tokens: the reduction is local.
    fn all_head_scales(&self, projs: &[Proj]) -> Vec<Vec<(f32, f32)>> {
        let m = &self.m;
        let eps = m.rms_eps as f32;
        let hd = m.head_dim;
        let inv = |ssq: f32, ssk: f32| {
            (1.0 / (ssq / (m.heads * hd) as f32 + eps).sqrt(), 1.0 / (ssk / (m.kv_heads * hd) as f32 + eps).sqrt())
        };
        let sq = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>();
        match self.mode {
            Mode::Ep => projs.iter().map(|p| p.q.iter().zip(&p.k).map(|(q, k)| inv(sq(q), sq(k))).collect()).collect(),
            Mode::Tp => {
                let tokens = projs.first().map_or(0, |p| p.q.len());
                let total: Vec<(f32, f32)> = (0..tokens)
                    .map(|t| {
                        let ssq: f32 = projs.iter().map(|p| sq(&p.q[t])).sum();
                        let mut per_kv: Vec<Option<f32>> = vec![None; m.kv_heads];
                        for (r, p) in projs.iter().enumerate() {
                            let (ka, kb) = self.kv_heads[r];
                            for (i, g) in (ka..kb).enumerate() {
                                per_kv[g].get_or_insert_with(|| sq(&p.k[t][i * hd..(i + 1) * hd]));
                            }
                        }
                        inv(ssq, per_kv.iter().flatten().sum())
                    })
                    .collect();
                vec![total; projs.len()]
            }
        }
    }

    /// Attention of one rank's tokens in layer `l`: QK-norm and RoPE,
    /// writes K/V of the new positions into the rank's pages, attends with
    /// the rank's query heads, and returns the output projection (complete
    /// in EP, partial in TP). `scales` are the all-head QK-norm's `1/rms`
    /// per token (empty for per-head norms).
    fn attention(
        &self,
        rank: &mut Rank,
        l: usize,
        batch: &[Slot],
        pages: &[u32],
        proj: Proj,
        scales: &[(f32, f32)],
    ) -> Vec<Vec<f32>> {
        let m = &self.m;
        if let Some(a) = m.mla {
            return self.attention_mla(rank, l, batch, pages, proj, a);
        }
        let hd = m.head_dim;
        let eps = m.rms_eps as f32;
        let [qa, qb] = self.q_heads[rank.id];
        let (ka, kb) = self.kv_heads[rank.id];
        let group = m.heads / m.kv_heads;
        let geo = self.kv;
        let (qn, kn) = if m.qk_norm {
            (self.vec(&rank.buf, TensorRole::QNorm, l), self.vec(&rank.buf, TensorRole::KNorm, l))
        } else {
            (vec![], vec![])
        };
        if proj.q.len() != batch.len() {
            return vec![vec![0.0; m.hidden]; batch.len()];
        }
        // QK-norm of global head `g` of a token: per head, or with the
        // token's all-head scale and the head's slice of the weight.
        let norm = |x: &[f32], w: &[f32], g: usize, scale: Option<f32>| -> Vec<f32> {
            match scale {
                Some(s) => x.iter().zip(&w[g * hd..(g + 1) * hd]).map(|(v, w)| v * s * w).collect(),
                None => rms_norm(x, w, eps),
            }
        };
        // K/V of every new position first, so prompt tokens can attend to each other.
        let mut writes: Vec<(usize, Vec<f32>, Vec<f32>)> = Vec::new();
        for (t, ((&(_, pos, _), &page), (k, v))) in batch.iter().zip(pages).zip(proj.k.iter().zip(&proj.v)).enumerate()
        {
            for g in 0..kb - ka {
                let mut kh = k[g * hd..(g + 1) * hd].to_vec();
                if m.qk_norm {
                    kh = norm(&kh, &kn, ka + g, scales.get(t).map(|s| s.1));
                }
                m.rope.apply(&mut kh, pos);
                writes.push((geo.slot(page, l, g, pos % geo.page_tokens), kh, v[g * hd..(g + 1) * hd].to_vec()));
            }
        }
        for (at, k, v) in writes {
            put_bf16s(&mut rank.buf, at, &k);
            put_bf16s(&mut rank.buf, at + 2 * hd, &v);
        }
        let o_proj = self.mat(&rank.buf, TensorRole::OProj, l);
        // o_proj's bias, once: every rank's in EP, rank 0's partial sum in TP.
        let o_bias = if self.mode == Mode::Ep || rank.id == 0 {
            self.bias(&rank.buf, TensorRole::OProj, l, 0, m.hidden)
        } else {
            vec![]
        };
        // GPT-OSS: the layer's window and the local heads' sinks.
        let (window, sinks) = (m.window_of(l), self.vec(&rank.buf, TensorRole::Sinks, l));
        batch
            .iter()
            .zip(proj.q)
            .enumerate()
            .map(|(t, (&(id, pos, _), q))| {
                let table = rank.tables.get(&id).cloned().unwrap_or_default();
                let mut heads = Vec::with_capacity((qb - qa) as usize * hd);
                for (i, hq) in (qa as usize..qb as usize).enumerate() {
                    let mut qh = q[i * hd..(i + 1) * hd].to_vec();
                    if m.qk_norm {
                        qh = norm(&qh, &qn, hq, scales.get(t).map(|s| s.0));
                    }
                    m.rope.apply(&mut qh, pos);
                    let g = hq / group - ka;
                    let key = |j: usize| {
                        bf16s(&rank.buf, geo.slot(table[j / geo.page_tokens], l, g, j % geo.page_tokens), hd).collect()
                    };
                    let value = |j: usize| {
                        bf16s(&rank.buf, geo.slot(table[j / geo.page_tokens], l, g, j % geo.page_tokens) + 2 * hd, hd)
                            .collect()
                    };
                    let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    heads.extend(attend_window(&qh, first..pos + 1, sinks.get(i).copied(), key, value));
                }
                let mut out = o_proj.as_ref().map(|w| w.matvec(&heads)).unwrap_or_else(|| vec![0.0; m.hidden]);
                add(&mut out, &o_bias);
                out
            })
            .collect()
    }
}

/// One rank's q, k and v projections, per token.
#[derive(Default)]
pub(super) struct Proj {
    q: Vec<Vec<f32>>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// The DSA indexer's query (`heads × head_dim`) and per-head weights.
    iq: Vec<Vec<f32>>,
    iw: Vec<Vec<f32>>,
}

/// `x += b` element by element (`b` empty: nothing).
fn add(x: &mut [f32], b: &[f32]) {
    x.iter_mut().zip(b).for_each(|(a, b)| *a += b);
}
