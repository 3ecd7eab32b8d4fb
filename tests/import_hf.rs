//! `moeforge import-hf` against the configs the Hub publishes
//! (tests/fixtures/hf/*/config.json, copied as published; SOURCES.md says
//! from where): every zoo model imports to the hand-written `.moe` block,
//! field for field (so its parameter counts and shapes agree), and the
//! key-name variants of older and newer `transformers` read the same.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use moeforge::dsl::hf::{import, HfError};
use moeforge::dsl::spec::{DType, Model};
use serde_json::Value;

/// Fixture directory → the zoo file holding the same model.
const ZOO: &[(&str, &str)] = &[
    ("qwen3-30b-a3b", "qwen3-30b-a3b"),
    ("qwen3-235b-a22b", "qwen3-235b-a22b"),
    ("deepseek-v3", "deepseek-v3"),
    ("kimi-k2", "kimi-k2"),
    ("minimax-m2", "minimax-m2"),
    ("glm-4.5-air", "glm-4.5-air"),
    ("glm-5", "glm-5"),
    ("mixtral-8x7b", "mixtral-8x7b"),
    ("gpt-oss-120b", "gpt-oss-120b"),
];

fn fixture(name: &str) -> String {
    std::fs::read_to_string(root().join("tests/fixtures/hf").join(name).join("config.json"))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn zoo_model(file: &str) -> Model {
    let path = root().join("models").join(format!("{file}.moe"));
    let checked = moeforge::dsl::check_paths(&[path], &moeforge::dsl::FsLoader).unwrap();
    checked.spec.models.into_iter().next().unwrap()
}

#[test]
fn every_zoo_model_imports_to_its_hand_written_block() {
    for (fx, file) in ZOO {
        let want = zoo_model(file);
        let mut got = import(&fixture(fx), &want.name).unwrap_or_else(|e| panic!("{fx}: {e}"));
        if *fx == "glm-5" {
            // zai-org/GLM-5 publishes the bf16 checkpoint; the zoo block
            // describes the same model as zai-org/GLM-5-FP8 ships it.
            assert_eq!((got.model.dtype.weights, got.model.dtype.block_scale), (DType::Bf16, None));
            got.model.dtype = want.dtype;
        }
        assert_eq!(got.model, want, "{fx}: the import differs from models/{file}.moe");
        assert_eq!(got.model.params(), want.params(), "{fx}");
        // The written text checks back to the same model.
        let text = moeforge::dsl::hf::to_moe(&got, "config.json");
        let back =
            moeforge::dsl::check_str("imported.moe", &text).unwrap_or_else(|f| panic!("{fx}: {}", f.render(false)));
        assert_eq!(back.spec.models[0], want, "{fx}");
    }
}

/// `f` applied to a fixture's JSON.
fn edited(name: &str, f: impl FnOnce(&mut serde_json::Map<String, Value>)) -> String {
    let mut v: Value = serde_json::from_str(&fixture(name)).unwrap();
    f(v.as_object_mut().unwrap());
    v.to_string()
}

#[test]
fn older_and_newer_key_names_read_the_same() {
    let base = import(&fixture("qwen3-30b-a3b"), "m").unwrap().model;
    // transformers 5 moves rope_theta into rope_parameters.
    let newer = edited("qwen3-30b-a3b", |m| {
        let theta = m.remove("rope_theta").unwrap();
        m.insert("rope_parameters".into(), serde_json::json!({ "rope_type": "default", "rope_theta": theta }));
    });
    assert_eq!(import(&newer, "m").unwrap().model, base);
    // num_experts / num_local_experts.
    let renamed = edited("qwen3-30b-a3b", |m| {
        let e = m.remove("num_experts").unwrap();
        m.insert("num_local_experts".into(), e);
    });
    assert_eq!(import(&renamed, "m").unwrap().model, base);
    // partial_rotary_factor / rotary_dim give the same rotary width.
    let gqa = |m: &Model| match m.attention {
        moeforge::dsl::spec::Attention::Gqa { rope_dim, head_dim, .. } => (rope_dim, head_dim),
        _ => panic!("not gqa"),
    };
    let minimax = import(&fixture("minimax-m2"), "m").unwrap().model;
    let (rope, head) = gqa(&minimax);
    let factor = edited("minimax-m2", |m| {
        m.remove("rotary_dim");
        m.insert("partial_rotary_factor".into(), serde_json::json!(f64::from(rope) / f64::from(head)));
    });
    assert_eq!(import(&factor, "m").unwrap().model, minimax);
}

#[test]
fn yarn_rope_scaling_is_imported_and_other_kinds_are_noted() {
    use moeforge::dsl::spec::RopeScaling;
    // The values each published config.json gives (tests/fixtures/hf).
    let published = [
        ("deepseek-v3", 40.0, 32.0, Some(1.0), true),
        ("kimi-k2", 32.0, 1.0, Some(1.0), true),
        ("gpt-oss-120b", 32.0, 32.0, None, false),
    ];
    for (fx, factor, beta_fast, mscale, truncate) in published {
        let got = import(&fixture(fx), "m").unwrap();
        let want = RopeScaling {
            factor,
            original_max_positions: 4096,
            beta_fast,
            beta_slow: 1.0,
            mscale,
            mscale_all_dim: mscale,
            truncate,
        };
        assert_eq!(got.model.rope_scaling, Some(want), "{fx}");
        assert!(!got.notes.iter().any(|n| n.contains("RoPE scaling")), "{fx}: {:?}", got.notes);
    }
    // transformers 5's spelling: the kind and its parameters inside rope_parameters.
    let nested = edited("qwen3-30b-a3b", |m| {
        m.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                               "original_max_position_embeddings": 32768}),
        );
        m.remove("rope_theta");
    });
    let got = import(&nested, "m").unwrap();
    assert_eq!(got.model.rope_theta, 1e6);
    let y = got.model.rope_scaling.expect("yarn read from rope_parameters");
    assert_eq!((y.factor, y.original_max_positions, y.beta_fast, y.beta_slow), (4.0, 32768, 32.0, 1.0));
    // A kind the spec cannot say is a note, not silently dropped.
    let linear = edited("qwen3-30b-a3b", |m| {
        m.insert("rope_scaling".into(), serde_json::json!({"type": "linear", "factor": 2.0}));
    });
    let got = import(&linear, "m").unwrap();
    assert_eq!(got.model.rope_scaling, None);
    assert!(got.notes.iter().any(|n| n.starts_with("RoPE scaling linear")), "{:?}", got.notes);
}

#[test]
fn unsupported_architectures_and_missing_keys_are_named() {
    let other = edited("qwen3-30b-a3b", |m| {
        m.insert("architectures".into(), serde_json::json!(["LlamaForCausalLM"]));
        m.insert("model_type".into(), serde_json::json!("llama"));
    });
    let e = import(&other, "m").unwrap_err();
    assert!(matches!(&e, HfError::Unsupported(a) if a == "LlamaForCausalLM"), "{e}");
    assert!(e.to_string().contains("LlamaForCausalLM") && e.to_string().contains("Qwen3MoeForCausalLM"));
    for (fx, key) in
        [("qwen3-30b-a3b", "hidden_size"), ("deepseek-v3", "kv_lora_rank"), ("mixtral-8x7b", "num_local_experts")]
    {
        let missing = edited(fx, |m| {
            m.remove(key);
        });
        let e = import(&missing, "m").unwrap_err().to_string();
        let named = if key == "num_local_experts" { "n_routed_experts" } else { key };
        assert!(e.contains(&format!("`{named}`")), "{fx} without {key}: {e}");
    }
    let e = import("{ not json", "m").unwrap_err();
    assert!(matches!(e, HfError::Json(_)));
    let e = import(
        &edited("qwen3-30b-a3b", |m| {
            m.insert("hidden_size".into(), serde_json::json!("big"));
        }),
        "m",
    )
    .unwrap_err();
    assert!(e.to_string().contains("`hidden_size`"), "{e}");
}

#[test]
fn the_cli_writes_a_checked_file_and_nothing_on_error() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("Qwen3-30B-A3B");
    std::fs::create_dir(&ck).unwrap();
    std::fs::write(ck.join("config.json"), fixture("qwen3-30b-a3b")).unwrap();
    let out = tmp.path().join("q.moe");
    let o = moeforge(&["import-hf", ck.to_str().unwrap(), "-o", out.to_str().unwrap()], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("imported qwen3-30b-a3b (Qwen3MoeForCausalLM)"), "{}", text(&o.stdout));
    let checked = moeforge::dsl::check_paths(std::slice::from_ref(&out), &moeforge::dsl::FsLoader).unwrap();
    let mut want = zoo_model("qwen3-30b-a3b");
    want.name = "qwen3-30b-a3b".into();
    assert_eq!(checked.spec.models[0], want);
    // A bad config: an error naming the key, exit 1, no file.
    std::fs::write(
        ck.join("config.json"),
        edited("qwen3-30b-a3b", |m| {
            m.remove("vocab_size");
        }),
    )
    .unwrap();
    let bad = tmp.path().join("bad.moe");
    let o = moeforge(&["import-hf", ck.to_str().unwrap(), "-o", bad.to_str().unwrap()], None);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("`vocab_size`"), "{}", text(&o.stderr));
    assert!(!bad.exists());
    let leftovers: Vec<_> =
        std::fs::read_dir(tmp.path()).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
    assert_eq!(leftovers.len(), 2, "{leftovers:?}");
}

#[test]
fn mla_without_interleaved_rope_is_refused_by_name() {
    let flat = edited("deepseek-v3", |m| {
        m.insert("rope_interleave".into(), serde_json::json!(false));
    });
    let e = import(&flat, "m").unwrap_err().to_string();
    assert!(e.contains("`rope_interleave`") && e.contains("interleaved"), "{e}");
    let explicit = edited("deepseek-v3", |m| {
        m.insert("rope_interleave".into(), serde_json::json!(true));
    });
    assert!(import(&explicit, "m").is_ok());
}

/// YaRN keys as transformers' standardize_rope_params resolves them: a
/// top-level original_max_position_embeddings wins, a missing one is
/// max_position_embeddings; an explicit attention_factor other than the
/// derived one is refused (the spec cannot state it), the derived one passes.
#[test]
fn yarn_keys_resolve_as_transformers_does() {
    let with = |f: &dyn Fn(&mut serde_json::Map<String, Value>)| import(&edited("gpt-oss-120b", f), "m");
    let top = with(&|m| {
        m.insert("original_max_position_embeddings".into(), serde_json::json!(8192));
    })
    .unwrap();
    assert_eq!(top.model.rope_scaling.unwrap().original_max_positions, 8192);
    let missing = with(&|m| {
        m["rope_scaling"].as_object_mut().unwrap().remove("original_max_position_embeddings");
    })
    .unwrap();
    assert_eq!(missing.model.rope_scaling.unwrap().original_max_positions, 131072, "max_position_embeddings");
    let derived = 0.1 * 32f64.ln() + 1.0;
    let same = with(&|m| {
        m["rope_scaling"].as_object_mut().unwrap().insert("attention_factor".into(), serde_json::json!(derived));
    });
    assert!(same.is_ok());
    let other = with(&|m| {
        m["rope_scaling"].as_object_mut().unwrap().insert("attention_factor".into(), serde_json::json!(1.0));
    })
    .unwrap_err()
    .to_string();
    assert!(other.contains("rope_scaling.attention_factor"), "{other}");
}

/// GLM-5's "shared" indexer layers (transformers: they reuse the previous
/// full layer's top-k) are refused by name; explicit all-"full" layers, and
/// the default schedule (`index_topk_freq` 1), import.
#[test]
fn dsa_layers_that_share_a_selection_are_refused_by_name() {
    let with = |f: &dyn Fn(&mut serde_json::Map<String, Value>)| import(&edited("glm-5", f), "m");
    let layers = |m: &serde_json::Map<String, Value>| m["num_hidden_layers"].as_u64().unwrap() as usize;
    let shared = with(&|m| {
        let mut t = vec![serde_json::json!("full"); layers(m)];
        t[1] = serde_json::json!("shared");
        m.insert("indexer_types".into(), Value::Array(t));
    })
    .unwrap_err()
    .to_string();
    assert!(shared.contains("`indexer_types`") && shared.contains("reuses another's DSA selection"), "{shared}");
    let full = with(&|m| {
        m.insert("indexer_types".into(), Value::Array(vec![serde_json::json!("full"); layers(m)]));
    });
    assert!(full.is_ok(), "{:?}", full.err());
    let pattern = with(&|m| {
        m.insert("index_topk_pattern".into(), serde_json::json!("FFS"));
    })
    .unwrap_err()
    .to_string();
    assert!(pattern.contains("`index_topk_pattern`"), "{pattern}");
    let freq = with(&|m| {
        m.insert("index_topk_freq".into(), serde_json::json!(4));
    })
    .unwrap_err()
    .to_string();
    assert!(freq.contains("`index_topk_freq`"), "{freq}");
    assert!(with(&|m| {
        m.insert("index_topk_freq".into(), serde_json::json!(1));
    })
    .is_ok());
    // DeepSeek-V3.2's indexer rotates half-split pairs; the kernels rotate GLM-5's interleaved ones.
    let split = with(&|m| {
        m.insert("indexer_rope_interleave".into(), serde_json::json!(false));
    })
    .unwrap_err()
    .to_string();
    assert!(split.contains("`indexer_rope_interleave`"), "{split}");
}
