//! What a user crate sees when `moeforge::spec!` refuses a spec: the compile
//! errors are pinned (tests/ui/*.stderr), with the `.moe` file's
//! `path:line:col` and the diagnostic's code. Regenerate them with
//! `TRYBUILD=overwrite cargo test --test trybuild` and review the diff.

#[test]
fn spec_macro_errors_in_a_user_crate() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
