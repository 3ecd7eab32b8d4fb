// The expansion is the checked Spec type: using it as something else is a
// type error in the user's crate.
fn main() {
    let spec = moeforge::spec!("../../examples/tiny-qwen3-cpu4.moe");
    let name: u32 = spec.deploys[0].name.clone();
    let _ = name;
}
