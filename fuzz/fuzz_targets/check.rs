//! Fuzzes the parser and checker: any bytes, as a root file that may `use`
//! two fixed in-memory files (one valid, one using the root back), must give
//! a `Checked` or diagnostics, never a panic or a hang; rendering the
//! diagnostics must not panic either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moeforge_dsl::{check_paths, MemLoader};
use std::path::PathBuf;

const MODEL: &str = include_str!("../../models/qwen3-30b-a3b.moe");

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let loader = MemLoader::new([("root.moe", text.as_ref()), ("m.moe", MODEL), ("back.moe", "use \"root.moe\"\n")]);
    match check_paths(&[PathBuf::from("root.moe")], &loader) {
        Ok(c) => {
            let _ = c.spec.to_string();
        }
        Err(f) => {
            let _ = f.render(false);
            let _ = f.diagnostics.to_json(&f.sources);
        }
    }
});
