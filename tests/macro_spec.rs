//! `moeforge::spec!` embeds a spec checked at compile time.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

const QWEN: &str = moeforge::spec!("examples/qwen3-30b-a3b-h200.moe");

#[test]
fn embedded_spec_equals_a_runtime_check() {
    let embedded: moeforge::dsl::Spec = serde_json::from_str(QWEN).unwrap();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/qwen3-30b-a3b-h200.moe");
    let checked = moeforge::dsl::check_paths(&[path], &moeforge::dsl::FsLoader).unwrap();
    assert_eq!(embedded, checked.spec);
}
