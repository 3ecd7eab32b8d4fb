//! Mean request lengths of the workload presets, shared by the layout search
//! and the simulator.
//!
//! - ShareGPT-like chat: mean input 215, output 197 tokens, what vLLM's and
//!   SGLang's serving benchmarks send from ShareGPT v3 after their length
//!   filter (vLLM: 215,196 input and ~197k output tokens for 1,000 prompts).
//!   That holds with both sides ShareGPT; an output drawn alone misses the
//!   joint 2048 cap and averages about 206.
//! - LooGLE-like long documents: mean input 24k (LooGLE's documents average
//!   over 24k tokens, Li et al. 2023), output 80 tokens.
//! - RL rollout (Moebius §6.3, DeepMath on Qwen3-235B): short prompts
//!   (median 120) and heavy-tailed outputs (median 1510, p99 10386, cap 32768);
//!   mean input 150, output 2500.

use moeforge_dsl::spec::LengthDist;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Input,
    Output,
}

/// The mean of a length distribution (a truncated log-normal's mean is
/// approximated by its untruncated mean capped at `max`).
pub fn mean(d: &LengthDist, side: Side) -> f64 {
    match (d, side) {
        (LengthDist::Fixed { value }, _) => f64::from(*value),
        (LengthDist::Uniform { min, max }, _) => (f64::from(*min) + f64::from(*max)) / 2.0,
        (LengthDist::Lognormal { mean, max, .. }, _) => mean.min(f64::from(*max)),
        (LengthDist::Sharegpt, Side::Input) => 215.0,
        (LengthDist::Sharegpt, Side::Output) => 197.0,
        (LengthDist::Loogle, Side::Input) => 24000.0,
        (LengthDist::Loogle, Side::Output) => 80.0,
        (LengthDist::Rollout, Side::Input) => 150.0,
        (LengthDist::Rollout, Side::Output) => 2500.0,
    }
}
