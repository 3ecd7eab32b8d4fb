//! The MoE block of one layer on every rank: routing (the router weights
//! are replicated; each rank routes the tokens it holds), then TP (every
//! rank's `I/P` slice of every expert, all-reduced) or EP (dispatch each
//! (token, k) to the expert's owner, combine back in k order), plus the
//! replicated shared experts.

use super::forward::{all_reduce, par_ranks, Ctx};
use super::{Rank, Twin};
use crate::reference::{route, RoutingRule};
use moeforge_plan::memory::{Mode, TensorRole};

impl Twin {
    pub(super) fn moe(&self, cx: &Ctx, l: usize, normed: &[Vec<Vec<f32>>]) -> Vec<Vec<Vec<f32>>> {
        let m = &self.model;
        let p = self.ranks.len();
        let rule = RoutingRule { experts: m.experts, top_k: m.top_k, routing: m.routing };
        // Routing (replicated router weights; each rank routes the tokens it holds).
        let routes: Vec<Vec<(Vec<i32>, Vec<f32>)>> = par_ranks(&self.ranks, |rank| {
            normed[rank.id]
                .iter()
                .map(|h| {
                    let mut logits = cx.mat(&rank.buf, TensorRole::Router, l).map(|w| w.matvec(h)).unwrap_or_default();
                    // GPT-OSS's router bias shifts the logits (ranking and softmax both).
                    let b = cx.bias(&rank.buf, TensorRole::Router, l, 0, m.experts);
                    logits.iter_mut().zip(&b).for_each(|(x, b)| *x += b);
                    let bias = m.selection_bias().then(|| cx.f32s(&rank.buf, TensorRole::RouterBias, l));
                    route(&rule, &logits, bias.as_deref())
                })
                .collect()
        });
        let shared_roles = [TensorRole::SharedGate, TensorRole::SharedUp, TensorRole::SharedDown];
        let shared = |rank: &Rank, h: &[f32]| (m.shared_ffn > 0).then(|| cx.ffn(&rank.buf, shared_roles, l, h));
        match cx.mode {
            Mode::Tp => {
                // Each rank: Σ_k w_k · expert_k restricted to its I/P slice; then all-reduce.
                let partial = par_ranks(&self.ranks, |rank| {
                    normed[rank.id]
                        .iter()
                        .zip(&routes[rank.id])
                        .map(|(h, (ids, w))| {
                            let mut y = vec![0f32; m.hidden];
                            for (e, wk) in ids.iter().zip(w) {
                                let ye = cx.expert(&rank.buf, l, *e as usize, h);
                                y.iter_mut().zip(&ye).for_each(|(a, b)| *a += wk * b);
                            }
                            y
                        })
                        .collect()
                });
                let mut reduced = all_reduce(partial);
                // Shared experts are replicated: every rank adds the same full output.
                for (rank, ys) in self.ranks.iter().zip(reduced.iter_mut()) {
                    for (y, h) in ys.iter_mut().zip(&normed[rank.id]) {
                        if let Some(s) = shared(rank, h) {
                            y.iter_mut().zip(&s).for_each(|(a, b)| *a += b);
                        }
                    }
                }
                reduced
            }
            Mode::Ep => {
                // Dispatch: (source rank, token, k) to the expert's owner.
                let per = m.experts / p;
                let mut inbox: Vec<Vec<(usize, usize, usize, usize)>> = vec![vec![]; p];
                for (src, rs) in routes.iter().enumerate() {
                    for (t, (ids, _)) in rs.iter().enumerate() {
                        for (k, &e) in ids.iter().enumerate() {
                            inbox[e as usize / per].push((src, t, k, e as usize));
                        }
                    }
                }
                let results: Vec<Vec<Vec<f32>>> = par_ranks(&self.ranks, |rank| {
                    inbox[rank.id].iter().map(|&(src, t, _, e)| cx.expert(&rank.buf, l, e, &normed[src][t])).collect()
                });
                // Combine: back to the source, summed in k order.
                let mut ys: Vec<Vec<Vec<Vec<f32>>>> =
                    normed.iter().map(|xs| xs.iter().map(|_| vec![vec![]; m.top_k]).collect()).collect();
                for (owner, res) in results.into_iter().enumerate() {
                    for (&(src, t, k, _), y) in inbox[owner].iter().zip(res) {
                        ys[src][t][k] = y;
                    }
                }
                ys.into_iter()
                    .enumerate()
                    .map(|(r, tokens)| {
                        tokens
                            .into_iter()
                            .enumerate()
                            .map(|(t, parts)| {
                                let mut y = vec![0f32; m.hidden];
                                for (k, part) in parts.iter().enumerate() {
                                    let wk = routes[r][t].1[k];
                                    y.iter_mut().zip(part).for_each(|(a, b)| *a += wk * b);
                                }
                                if let Some(s) = shared(&self.ranks[r], &normed[r][t]) {
                                    y.iter_mut().zip(&s).for_each(|(a, b)| *a += b);
                                }
                                y
                            })
                            .collect()
                    })
                    .collect()
            }
        }
    }
}
