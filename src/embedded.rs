//! The embedded default: Qwen3-30B-A3B on one 8×H200 node, with the model
//! zoo files it uses, so `moeforge compile` works with no files at hand.

use moeforge_dsl::MemLoader;

/// Path of the default deployment inside the embedded file table.
pub const DEFAULT_SPEC: &str = "examples/qwen3-30b-a3b-h200.moe";

/// Every embedded file, by repository-relative path.
pub const FILES: &[(&str, &str)] = &[
    (DEFAULT_SPEC, include_str!("../examples/qwen3-30b-a3b-h200.moe")),
    ("models/qwen3-30b-a3b.moe", include_str!("../models/qwen3-30b-a3b.moe")),
    ("models/clusters.moe", include_str!("../models/clusters.moe")),
    ("models/tiles.moe", include_str!("../models/tiles.moe")),
];

pub fn loader() -> MemLoader {
    MemLoader::new(FILES.iter().copied())
}
