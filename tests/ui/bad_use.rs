// A spec that uses a file that is not there, and names blocks nobody defines.
fn main() {
    let _ = moeforge::spec!("bad_use.moe");
}
