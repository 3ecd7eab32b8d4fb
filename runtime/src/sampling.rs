//! Token sampling from a step's logits: greedy, or temperature and nucleus
//! (top-p) sampling from a seeded generator, so a request's tokens depend
//! only on its prompt and its sampling parameters, never on what else is
//! batched with it or on the parallelism mode.

use moeforge_plan::rng::SplitMix64;

/// How a request picks each token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0: greedy (the highest logit, the lowest id on ties).
    pub temperature: f32,
    /// Nucleus: sample among the most likely tokens whose probabilities sum
    /// to at least this (1: all tokens).
    pub top_p: f32,
    /// The generator's seed.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Sampling {
        Sampling { temperature: 0.0, top_p: 1.0, seed: 0 }
    }
}

impl Sampling {
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

/// The greedy token: the highest logit, the lowest id among equals; a NaN
/// counts as -inf (as in the device's `sample_greedy`).
pub fn argmax(v: &[f32]) -> u32 {
    let key = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if key(*x) > key(v[best]) {
            best = i;
        }
    }
    best as u32
}

/// A request's sampler: its parameters and its generator's state.
#[derive(Clone, Debug)]
pub struct Sampler {
    pub params: Sampling,
    rng: SplitMix64,
}

impl Sampler {
    pub fn new(params: Sampling) -> Sampler {
        Sampler { params, rng: SplitMix64(params.seed) }
    }

    /// The generator's state (the device sampler advances it in the
    /// request's header; the engine writes it there and reads it back).
    pub fn state(&self) -> u64 {
        self.rng.0
    }
    pub fn set_state(&mut self, state: u64) {
        self.rng.0 = state;
    }

    /// The next token from `logits`. Greedy draws nothing from the
    /// generator; otherwise one uniform draw per token: softmax of
    /// `logits / temperature` (in f64), most likely first (ties by id), cut
    /// to the smallest prefix whose mass reaches `top_p`, sampled by
    /// inverse CDF over that prefix.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() || logits.is_empty() {
            return argmax(logits);
        }
        let t = f64::from(self.params.temperature);
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut p: Vec<(usize, f64)> =
            logits.iter().enumerate().map(|(i, &x)| (i, ((f64::from(x) - f64::from(max)) / t).exp())).collect();
        let total: f64 = p.iter().map(|x| x.1).sum();
        if !(total.is_finite() && total > 0.0) {
            return argmax(logits);
        }
        p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let top_p = f64::from(self.params.top_p.clamp(0.0, 1.0));
        let mut kept = 0;
        let mut mass = 0.0;
        for &(_, w) in &p {
            kept += 1;
            mass += w / total;
            if mass >= top_p {
                break;
            }
        }
        let p = &p[..kept.max(1)];
        let kept_mass: f64 = p.iter().map(|x| x.1).sum();
        // 53 bits of the draw: uniform in [0, 1).
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * kept_mass;
        let mut acc = 0.0;
        for &(i, w) in p {
            acc += w;
            if u < acc {
                return i as u32;
            }
        }
        p[p.len() - 1].0 as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(temperature: f32, top_p: f32, seed: u64) -> Sampler {
        Sampler::new(Sampling { temperature, top_p, seed })
    }

    #[test]
    fn greedy_and_tiny_nucleus_pick_the_argmax() {
        let logits = [0.1, 2.0, 2.0, -1.0];
        assert_eq!(sampler(0.0, 1.0, 1).sample(&logits), 1, "ties go to the lower id");
        for seed in 0..50 {
            assert_eq!(sampler(1.0, 1e-6, seed).sample(&logits), 1);
        }
    }

    /// Frequencies follow softmax(logits / T): with logits ln 1, ln 3 at
    /// T = 1 the second token has probability 3/4; at T = 2 it is √3/(1+√3).
    #[test]
    fn frequencies_follow_the_tempered_softmax() {
        let logits = [0.0f32, 3f32.ln()];
        for (t, want) in [(1.0f32, 0.75f64), (2.0, 3f64.sqrt() / (1.0 + 3f64.sqrt()))] {
            let mut s = sampler(t, 1.0, 42);
            let n = 20_000;
            let hits = (0..n).filter(|_| s.sample(&logits) == 1).count();
            let f = hits as f64 / f64::from(n);
            // 4 standard deviations of a binomial proportion.
            let sd = (want * (1.0 - want) / f64::from(n)).sqrt();
            assert!((f - want).abs() < 4.0 * sd, "T = {t}: {f} vs {want}");
        }
    }

    /// Top-p keeps the smallest most-likely prefix reaching p: with
    /// probabilities 0.5, 0.3, 0.2 and p = 0.7, the 0.2 token never comes.
    #[test]
    fn nucleus_drops_the_tail() {
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let mut s = sampler(1.0, 0.7, 7);
        let draws: Vec<u32> = (0..5000).map(|_| s.sample(&logits)).collect();
        assert!(!draws.contains(&2));
        let ones = draws.iter().filter(|&&x| x == 1).count() as f64 / 5000.0;
        assert!((ones - 0.375).abs() < 0.03, "{ones}");
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut s = sampler(0.8, 0.9, seed);
            (0..30).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }
}
