// A spec that does not parse.
fn main() {
    let _ = moeforge::spec!("syntax.moe");
}
