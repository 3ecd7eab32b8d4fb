//! What the twin and emu benches serve: every transformers fixture family
//! (tests/fixtures/models), its three prompts, eight new tokens each. The
//! fp8 DeepSeek-V3 and GPT-OSS plan EP only (fp8 experts, expert biases):
//! the benches skip a mode the plan does not have.

use moeforge::runtime::engine::{Engine, Request};
use moeforge::runtime::twin::Twin;

pub const FAMILIES: [&str; 7] =
    ["qwen3-moe", "mixtral", "minimax-m2", "deepseek-v3", "deepseek-v3-fp8", "glm-5", "gpt-oss"];
pub const PROMPTS: [&[u32]; 3] = [&[3, 17, 42, 99, 5, 64, 7], &[120, 1], &[9]];
pub const NEW: usize = 8;

/// Submits the prompts (the untimed setup).
pub fn submitted(mut t: Twin) -> Twin {
    for (i, p) in PROMPTS.iter().enumerate() {
        t.submit(Request::new(i as u64, p.to_vec(), NEW)).expect("submit");
    }
    t
}

/// Steps until every request has finished (the timed part).
pub fn served(mut t: Twin) -> Twin {
    while !t.idle() {
        t.step().expect("step");
    }
    t
}
