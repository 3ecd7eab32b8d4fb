// The macro takes one string literal.
fn main() {
    let _ = moeforge::spec!(42);
}
