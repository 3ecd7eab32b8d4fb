//! `moeforge::spec!` embeds a spec checked at compile time, as the checked
//! `Spec` type, and `moeforge::compile` turns it into a bundle.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use moeforge::codegen::NvccMode;
use moeforge::EmbeddedSpec;

static QWEN: &EmbeddedSpec = moeforge::spec!("../examples/qwen3-30b-a3b-h200.moe");

#[test]
fn embedded_spec_is_the_checked_spec() {
    let path = root().join("examples/qwen3-30b-a3b-h200.moe");
    let checked = moeforge::dsl::check_paths(&[path], &moeforge::dsl::FsLoader).unwrap();
    assert_eq!(**QWEN, checked.spec);
    assert_eq!(QWEN.deploys[0].name, "qwen3-30b-h200");
    assert_eq!(QWEN.root(), "../examples/qwen3-30b-a3b-h200.moe");
    let names: Vec<&str> = QWEN.files().iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names,
        [
            "../examples/qwen3-30b-a3b-h200.moe",
            "../models/qwen3-30b-a3b.moe",
            "../models/clusters.moe",
            "../models/tiles.moe"
        ]
    );
}

#[test]
fn the_library_compile_is_the_cli_compile() {
    let spec = moeforge::spec!("../examples/tiny-qwen3-cpu4.moe");
    let opts = moeforge::compile::Options { nvcc: NvccMode::Off, cache: None, ..Default::default() };
    let out = moeforge::compile(spec, &opts).unwrap();
    assert_eq!(out.plan.deploy, "tiny-qwen3-cpu4");
    let tmp = tempfile::tempdir().unwrap();
    let (lib, cli) = (tmp.path().join("lib"), tmp.path().join("cli"));
    out.bundle.write(&lib).unwrap();
    let o = moeforge(&["compile", "examples/tiny-qwen3-cpu4.moe", "-o", cli.to_str().unwrap(), "--nvcc", "off"], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(read_tree(&lib), read_tree(&cli));
}

#[test]
fn library_errors_name_the_deployment_and_render_against_the_sources() {
    let opts = moeforge::compile::Options {
        deploy: Some("nope".into()),
        nvcc: NvccMode::Off,
        cache: None,
        ..Default::default()
    };
    let e = moeforge::compile(QWEN, &opts).err().unwrap();
    let msg = e.to_string();
    assert!(msg.contains("no deployment named `nope`") && msg.contains("qwen3-30b-h200"), "{msg}");
}
