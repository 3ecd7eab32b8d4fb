//! The example crate as its user runs it: the binary serves its embedded
//! spec, and a completion's tokens are the twin's for the same prompt.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use moeforge::codegen::NvccMode;
use moeforge::plan::memory::Mode;
use moeforge::runtime::engine::{Engine, Request};
use moeforge::runtime::twin::{weights, Twin, TwinModel};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

#[test]
fn serves_the_embedded_spec() {
    let tmp = std::env::temp_dir().join(format!("moeforge-example-test-{}", std::process::id()));
    let w = tmp.join("weights");
    let spec = moeforge::spec!("../../tiny-qwen3-cpu4.moe");
    let model = spec.model(spec.deploys[0].model);
    let tm = TwinModel::from_spec(model).unwrap();
    weights::write_random(&tm, 7, weights::Family::Qwen3Moe, &w).unwrap();

    // The reference: the same bundle on the twin, no server.
    let opts = moeforge::compile::Options { nvcc: NvccMode::Off, cache: None, ..Default::default() };
    let b = tmp.join("bundle");
    moeforge::compile(spec, &opts).unwrap().bundle.write(&b).unwrap();
    let bundle = moeforge::runtime::load_bundle(&b).unwrap();
    let ck = weights::Checkpoint::load(&w).unwrap();
    let mut twin = Twin::new(&bundle, &ck, Mode::Ep).unwrap();
    twin.submit(Request::new(0, vec![1, 2, 3], 8)).unwrap();
    let mut want = Vec::new();
    while twin.stats().inflight() > 0 {
        want.extend(twin.step().unwrap().produced.into_iter().map(|(_, t)| t));
    }

    let mut child = Command::new(env!("CARGO_BIN_EXE_moeforge-example-serve-embedded"))
        .args([w.to_str().unwrap(), "0"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let line = BufReader::new(child.stdout.take().unwrap()).lines().next().unwrap().unwrap();
    let url = line.split_whitespace().last().unwrap().to_string();
    assert!(line.starts_with("tiny-qwen3-cpu4: listening on http://"), "{line}");
    let o = Command::new("curl")
        .args(["-sS", &format!("{url}/v1/completions"), "-H", "content-type: application/json"])
        .args(["-d", r#"{"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}"#])
        .output()
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&tmp);
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let got: Vec<u32> =
        r["choices"][0]["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    assert_eq!(got, want);
}
