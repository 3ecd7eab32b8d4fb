//! Scalar reference implementations of the emitted routing-path kernels.
//!
//! Written from the model definitions (not from the CUDA), they are what the
//! host-emulation tier compares the emitted kernels against, and what the
//! CPU twin's MoE layer uses. Arithmetic is f32 in the same formulas the
//! models' reference code uses; ties in top-k go to the lower expert id.

use moeforge_dsl::spec::Routing;

/// The routing rule of a model, as the router kernel is specialized to it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RoutingRule {
    pub experts: usize,
    pub top_k: usize,
    pub routing: Routing,
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Indices of the `k` largest values, larger first, ties to the lower index.
fn top_k_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Routes every token: returns `(topk_ids, topk_weights)`, each `[tokens, top_k]`.
/// `logits` is `[tokens, experts]`; `bias` is the selection bias of sigmoid routing.
pub fn route(rule: &RoutingRule, logits: &[f32], bias: Option<&[f32]>) -> (Vec<i32>, Vec<f32>) {
    let (e, k) = (rule.experts, rule.top_k);
    let tokens = logits.len() / e.max(1);
    let mut ids = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    for row in logits.chunks_exact(e) {
        let (score, choice): (Vec<f32>, Vec<f32>) = match rule.routing {
            Routing::SoftmaxTopk { .. } => {
                let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exps: Vec<f32> = row.iter().map(|x| (x - m).exp()).collect();
                let sum: f32 = exps.iter().sum();
                let p: Vec<f32> = exps.iter().map(|x| x * (1.0 / sum)).collect();
                (p.clone(), p)
            }
            Routing::SigmoidGrouped { groups, top_groups, bias: use_bias, .. } => {
                let s: Vec<f32> = row.iter().map(|&x| sigmoid(x)).collect();
                let mut c: Vec<f32> = match (use_bias, bias) {
                    (true, Some(b)) => s.iter().zip(b).map(|(x, y)| x + y).collect(),
                    _ => s.clone(),
                };
                let (g, tg) = (groups as usize, top_groups as usize);
                if g > 1 {
                    let size = e / g;
                    let gscore: Vec<f32> = c
                        .chunks(size)
                        .map(|grp| top_k_indices(grp, 2.min(size)).iter().map(|&i| grp[i]).sum())
                        .collect();
                    let keep = top_k_indices(&gscore, tg);
                    for (i, v) in c.iter_mut().enumerate() {
                        if !keep.contains(&(i / size)) {
                            *v = f32::NEG_INFINITY;
                        }
                    }
                }
                (s, c)
            }
        };
        let picked = top_k_indices(&choice, k);
        let mut w: Vec<f32> = picked.iter().map(|&i| score[i]).collect();
        let (norm, scaling) = match rule.routing {
            Routing::SoftmaxTopk { norm_topk } => (norm_topk, 1.0),
            Routing::SigmoidGrouped { norm_topk, scaling, .. } => (norm_topk, scaling as f32),
        };
        if norm {
            let s: f32 = w.iter().sum::<f32>() + 1e-20;
            w.iter_mut().for_each(|x| *x /= s);
        }
        w.iter_mut().for_each(|x| *x *= scaling);
        ids.extend(picked.iter().map(|&i| i as i32));
        weights.extend(w);
    }
    (ids, weights)
}

/// The expert-contiguous layout of one rank's routed rows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Permutation {
    /// Rows routed to each local expert.
    pub counts: Vec<i32>,
    /// First row of each local expert, then the total (`num_local + 1` entries).
    pub offsets: Vec<i32>,
    /// For each row, the entry (`token * top_k + k`) it holds, or -1 for padding.
    pub row_entry: Vec<i32>,
    /// For each row, its local expert.
    pub row_expert: Vec<i32>,
    /// For each entry, its row, or -1 when another rank computes it.
    pub entry_row: Vec<i32>,
}

/// Lays out the entries routed to experts `[expert_begin, expert_begin + num_local)`:
/// experts in order, each padded to a multiple of `block_m` rows, rows of one
/// expert in ascending entry order.
pub fn permute(topk_ids: &[i32], expert_begin: i32, num_local: usize, block_m: usize) -> Permutation {
    let local = |id: i32| {
        let l = id - expert_begin;
        (l >= 0 && (l as usize) < num_local).then_some(l as usize)
    };
    let mut counts = vec![0i32; num_local];
    for &id in topk_ids {
        if let Some(l) = local(id) {
            counts[l] += 1;
        }
    }
    let mut offsets = Vec::with_capacity(num_local + 1);
    let mut at = 0i32;
    for &c in &counts {
        offsets.push(at);
        at += (c as usize).div_ceil(block_m) as i32 * block_m as i32;
    }
    offsets.push(at);
    let mut row_entry = vec![-1i32; at as usize];
    let mut row_expert = vec![0i32; at as usize];
    for l in 0..num_local {
        for r in offsets[l]..offsets[l + 1] {
            row_expert[r as usize] = l as i32;
        }
    }
    let mut next: Vec<i32> = offsets[..num_local].to_vec();
    let mut entry_row = vec![-1i32; topk_ids.len()];
    for (i, &id) in topk_ids.iter().enumerate() {
        if let Some(l) = local(id) {
            row_entry[next[l] as usize] = i as i32;
            entry_row[i] = next[l];
            next[l] += 1;
        }
    }
    Permutation { counts, offsets, row_entry, row_expert, entry_row }
}

/// bf16 bits → f32.
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// f32 → bf16 bits, round to nearest even (NaN stays NaN).
pub fn f32_to_bf16(f: f32) -> u16 {
    let u = f.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    let rounded = u.wrapping_add(0x7fff + ((u >> 16) & 1));
    (rounded >> 16) as u16
}

/// `out[t] = Σ_k w[t,k] · y[entry_row[t,k]]` over the entries this rank
/// computed, accumulated in f32 in k order, rounded to bf16.
pub fn combine(y: &[u16], hidden: usize, entry_row: &[i32], weights: &[f32], top_k: usize) -> Vec<u16> {
    let tokens = entry_row.len() / top_k.max(1);
    let mut out = vec![0u16; tokens * hidden];
    for t in 0..tokens {
        for j in 0..hidden {
            let mut acc = 0f32;
            for k in 0..top_k {
                let r = entry_row[t * top_k + k];
                if r >= 0 {
                    acc += weights[t * top_k + k] * bf16_to_f32(y[r as usize * hidden + j]);
                }
            }
            out[t * hidden + j] = f32_to_bf16(acc);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_top2_renormalized() {
        let rule = RoutingRule { experts: 4, top_k: 2, routing: Routing::SoftmaxTopk { norm_topk: true } };
        let (ids, w) = route(&rule, &[0.0, 2.0, 1.0, 2.0], None);
        assert_eq!(ids, vec![1, 3]); // tie between 1 and 3 goes to the lower id first
        assert!((w[0] - 0.5).abs() < 1e-6 && (w[1] - 0.5).abs() < 1e-6);
    }

    #[test]
    fn grouped_routing_drops_weak_groups() {
        // Two groups of two; group 0 = {0,1}, group 1 = {2,3}. Expert 2 is the
        // single best, but group 0's top-2 sum is larger, so with one group kept
        // the picks come from group 0.
        let rule = RoutingRule {
            experts: 4,
            top_k: 1,
            routing: Routing::SigmoidGrouped { groups: 2, top_groups: 1, scaling: 2.0, norm_topk: false, bias: false },
        };
        let (ids, w) = route(&rule, &[1.0, 1.0, 3.0, -5.0], None);
        assert_eq!(ids, vec![0]);
        assert!((w[0] - 2.0 * sigmoid(1.0)).abs() < 1e-6);
    }

    #[test]
    fn permutation_pads_and_is_stable() {
        let p = permute(&[5, 4, 5, 9, 4, 5], 4, 2, 4);
        assert_eq!(p.counts, vec![2, 3]);
        assert_eq!(p.offsets, vec![0, 4, 8]);
        assert_eq!(p.row_entry, vec![1, 4, -1, -1, 0, 2, 5, -1]);
        assert_eq!(p.entry_row, vec![4, 0, 5, -1, 1, 6]);
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(bf16_to_f32(f32_to_bf16(f32::from_bits(0x3f80_8000))), 1.0); // 1 + 2^-8: halfway, down to even
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82); // 1 + 3·2^-8: halfway, up to even
    }
}
