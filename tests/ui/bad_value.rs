// A spec with an out-of-range value: the user crate fails to compile, and
// the error points into the .moe file with the diagnostic's code.
fn main() {
    let spec = moeforge::spec!("bad_value.moe");
    println!("{}", spec.models.len());
}
