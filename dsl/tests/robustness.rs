//! No input may panic or hang the checker. Two sources of nasty input:
//! crash inputs kept from `cargo fuzz` runs (`fuzz_regressions/`), and a
//! deterministic mutation sweep over the whole zoo that runs in every
//! `cargo test` (byte flips, truncation, splices of syntax fragments).
//! Whatever checks must also print back to `.moe` that checks to the same spec.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use moeforge_dsl::{check_paths, check_str, MemLoader};
use std::path::{Path, PathBuf};

fn zoo() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut out = Vec::new();
    for dir in ["models", "examples"] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(root.join(dir))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "moe"))
            .collect();
        files.sort();
        for f in files {
            out.push((
                format!("{dir}/{}", f.file_name().unwrap().to_string_lossy()),
                std::fs::read_to_string(&f).unwrap(),
            ));
        }
    }
    out
}

/// Checks `text` as `examples/fuzz.moe` beside the real zoo, so `use` works.
fn exercise(zoo: &[(String, String)], text: &str) {
    let mut loader = MemLoader::new(zoo.iter().map(|(p, t)| (p.as_str(), t.as_str())));
    loader.insert("examples/fuzz.moe", text);
    match check_paths(&[PathBuf::from("examples/fuzz.moe")], &loader) {
        Ok(c) => {
            let printed = c.spec.to_string();
            let again = check_str("printed.moe", &printed)
                .unwrap_or_else(|f| panic!("printed form invalid:\n{}\n{printed}", f.render(false)));
            assert_eq!(again.spec, c.spec);
        }
        Err(f) => {
            assert!(!f.diagnostics.is_empty());
            let _ = f.render(false);
            let _ = f.diagnostics.to_json(&f.sources);
        }
    }
}

#[test]
fn kept_fuzz_crashes_do_not_panic() {
    let zoo = zoo();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_regressions");
    for e in std::fs::read_dir(dir).unwrap() {
        let bytes = std::fs::read(e.unwrap().path()).unwrap();
        exercise(&zoo, &String::from_utf8_lossy(&bytes));
    }
}

const FRAGMENTS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    "\"",
    "=",
    "//",
    "use \"examples/fuzz.moe\"",
    "use \"../models/clusters.moe\"",
    "-1",
    "1e999",
    "0",
    "4.8TB/s",
    "2us",
    "µs",
    "%",
    "GB/",
    "/s",
    "[1, 2, 3]",
    "[]",
    "model",
    "deploy x {",
    "tiles",
    "auto",
    "é",
    "\u{0}",
    "99999999999999999999",
    "top_k = 0",
    "experts = 1",
    "groups = 0",
    ".",
    "-",
    ",",
    ";",
];

#[test]
fn mutated_zoo_files_never_panic() {
    let zoo = zoo();
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut cases = 0;
    for (_, text) in &zoo {
        let bytes = text.as_bytes();
        for _ in 0..60 {
            let mut b = bytes.to_vec();
            for _ in 0..1 + next() % 4 {
                if b.is_empty() {
                    break;
                }
                let at = (next() as usize) % b.len();
                match next() % 5 {
                    0 => b[at] = (next() % 256) as u8,
                    1 => b.truncate(at),
                    2 => {
                        let end = (at + (next() as usize % 40)).min(b.len());
                        b.drain(at..end);
                    }
                    _ => {
                        let frag = FRAGMENTS[(next() as usize) % FRAGMENTS.len()];
                        b.splice(at..at, frag.bytes());
                    }
                }
            }
            exercise(&zoo, &String::from_utf8_lossy(&b));
            cases += 1;
        }
    }
    assert!(cases > 500);
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    let zoo = zoo();
    for open in ["{", "[", "model m { a = "] {
        exercise(&zoo, &format!("model m {{ x = {} }}", open.repeat(100_000)));
    }
    let f = check_str("deep.moe", &format!("model m {{ x = {} }}", "[".repeat(1000))).err().unwrap();
    assert_eq!(f.diagnostics.0[0].code, moeforge_dsl::Code::Syntax);
}
