//! Bad specs: every kind of error the checker promises gives a located
//! diagnostic with its stable code and a help line. Each case mutates a
//! valid spec; the rendered diagnostics are pinned as snapshots.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use moeforge_dsl::{check_paths, check_str, Code, MemLoader};
use std::path::PathBuf;

const BASE: &str = r#"model m {
  layers = 4
  hidden = 256
  vocab = 1000
  attention gqa { heads = 8  kv_heads = 2  head_dim = 32 }
  moe {
    experts = 16
    top_k = 4
    expert_ffn = 128
    routing softmax_topk { norm_topk = true }
  }
}

cluster c {
  nodes = 1
  gpus_per_node = 8
  gpu h100 {
    arch = sm_90a
    sms = 132
    hbm = 80GB
    hbm_bandwidth = 3.35TB/s
    bf16 = 989TFLOP/s
    smem_per_sm = 228KiB
    smem_per_block = 227KiB
  }
  scale_up nvlink { bandwidth = 450GB/s  latency = 2us }
}

tiles t {
  prefill {
    gate_up { block_m = 128  block_n = 128  block_k = 64  cluster = [2, 1]  stages = 4 }
    down    { block_m = 128  block_n = 128  block_k = 64  stages = 4 }
  }
  decode {
    gate_up { block_m = 64  block_n = 128  block_k = 64  stages = 4 }
    down    { block_m = 64  block_n = 128  block_k = 64  stages = 4 }
  }
}

deploy d {
  model = m
  cluster = c
  tiles = t
  slo { ttft = 1s  tpot = 50ms }
  workload {
    input = sharegpt
    output = sharegpt
    arrival poisson { rate = 4req/s }
  }
}
"#;

/// Checks `BASE` with `from` replaced by `to`; expects exactly the codes
/// listed, each with a primary span and a help line; pins the rendering.
fn check(name: &str, from: &str, to: &str, expect: &[Code]) {
    assert!(BASE.contains(from), "{name}: `{from}` not in BASE");
    let text = BASE.replacen(from, to, 1);
    let failed = match check_str("spec.moe", &text) {
        Ok(_) => panic!("{name}: expected {expect:?}, but the spec checked"),
        Err(f) => f,
    };
    let codes: Vec<Code> = failed.diagnostics.iter().map(|d| d.code).collect();
    assert_eq!(codes, expect, "{name}:\n{}", failed.render(false));
    for d in failed.diagnostics.iter() {
        assert!(d.primary.is_some(), "{name}: {:?} has no location", d.code);
        assert!(d.help.is_some(), "{name}: {:?} has no help", d.code);
    }
    insta::assert_snapshot!(name, failed.render(false));
}

#[test]
fn base_spec_is_valid() {
    if let Err(f) = check_str("spec.moe", BASE) {
        panic!("{}", f.render(false));
    }
}

#[test]
fn syntax_error() {
    check("syntax", "layers = 4", "layers = = 4", &[Code::Syntax]);
}

#[test]
fn unterminated_block() {
    check(
        "unterminated",
        "  scale_up nvlink { bandwidth = 450GB/s  latency = 2us }\n}",
        "  scale_up nvlink {",
        &[Code::Syntax],
    );
}

#[test]
fn unknown_reference() {
    check("unknown_name", "cluster = c", "cluster = c2", &[Code::UnknownName]);
}

#[test]
fn duplicate_block() {
    check(
        "duplicate_name",
        "tiles t {",
        "tiles t {}\ntiles t {",
        &[Code::MissingField, Code::MissingField, Code::DuplicateName],
    );
}

#[test]
fn duplicate_field() {
    check("duplicate_field", "hidden = 256", "hidden = 256\n  hidden = 512", &[Code::DuplicateField]);
}

#[test]
fn missing_field() {
    check("missing_field", "  vocab = 1000\n", "", &[Code::MissingField]);
}

#[test]
fn unknown_field_with_suggestion() {
    check("unknown_field", "top_k = 4", "top_k = 4\n    topk = 4", &[Code::UnknownField]);
}

#[test]
fn unit_mismatch() {
    check("unit_mismatch", "hbm = 80GB", "hbm = 80GB/s", &[Code::UnitMismatch]);
}

#[test]
fn missing_unit() {
    check("missing_unit", "latency = 2us", "latency = 2", &[Code::UnitMismatch]);
}

#[test]
fn unit_on_a_count() {
    check("unit_on_count", "layers = 4", "layers = 4GB", &[Code::UnitMismatch]);
}

#[test]
fn unknown_unit() {
    check("unknown_unit", "ttft = 1s", "ttft = 1fortnight", &[Code::UnknownUnit]);
}

#[test]
fn number_out_of_range() {
    check("out_of_range", "layers = 4", "layers = 0", &[Code::OutOfRange]);
}

#[test]
fn fractional_count() {
    check("fractional_count", "layers = 4", "layers = 4.5", &[Code::OutOfRange]);
}

#[test]
fn huge_number() {
    check("huge_number", "vocab = 1000", "vocab = 1e400", &[Code::OutOfRange]);
}

#[test]
fn wrong_value_type() {
    check("wrong_type", "hidden = 256", "hidden = big", &[Code::WrongType]);
}

#[test]
fn unknown_choice() {
    check("unknown_variant", "arch = sm_90a", "arch = sm_90", &[Code::UnknownVariant]);
}

#[test]
fn top_k_exceeds_experts() {
    check("top_k", "top_k = 4", "top_k = 17", &[Code::TopKExceedsExperts]);
}

#[test]
fn heads_not_divisible() {
    check("heads", "kv_heads = 2", "kv_heads = 3", &[Code::HeadsNotDivisible]);
}

#[test]
fn tile_smem_too_large() {
    check(
        "tile_smem",
        "gate_up { block_m = 128  block_n = 128  block_k = 64  cluster = [2, 1]  stages = 4 }",
        "gate_up { block_m = 128  block_n = 128  block_k = 64  cluster = [2, 1]  stages = 8 }",
        &[Code::TileSmemExceeded],
    );
}

#[test]
fn tile_not_mma_multiple() {
    check(
        "tile_mma",
        "gate_up { block_m = 64  block_n = 128  block_k = 64  stages = 4 }",
        "gate_up { block_m = 48  block_n = 128  block_k = 64  stages = 4 }",
        &[Code::TileNotMmaMultiple],
    );
}

/// The prefill attention's tiles: 16-row MMA steps, and K and Vᵀ tiles in
/// 48 KiB of static shared memory (heads of 32 dims: block_kv 160 would need
/// 2 × (160 × 40 + 32 × 168) = 23 KiB, so the range check fires first;
/// block_kv 128 fits).
#[test]
fn attention_tiles() {
    let from = "    down    { block_m = 64  block_n = 128  block_k = 64  stages = 4 }\n  }\n}";
    let tiles = |a: &str| {
        format!(
            "    down    {{ block_m = 64  block_n = 128  block_k = 64  stages = 4 }}\n  }}\n  attention {{ {a} }}\n}}"
        )
    };
    check("attention_tiles_mma", from, &tiles("block_q = 40  block_kv = 64"), &[Code::TileNotMmaMultiple]);
    check("attention_tiles_range", from, &tiles("block_q = 64  block_kv = 160"), &[Code::OutOfRange]);
    // Heads of 128 dims with 128 keys a step: 68 KiB, over the 48 KiB.
    let wide = BASE.replacen(from, &tiles("block_q = 64  block_kv = 128"), 1).replacen(
        "attention gqa { heads = 8  kv_heads = 2  head_dim = 32 }",
        "attention gqa { heads = 8  kv_heads = 2  head_dim = 128 }",
        1,
    );
    let failed = check_str("spec.moe", &wide).map(|_| ()).expect_err("68 KiB of tiles");
    let codes: Vec<Code> = failed.diagnostics.iter().map(|d| d.code).collect();
    assert_eq!(codes, vec![Code::TileSmemExceeded], "{}", failed.render(false));
    let text = failed.render(false);
    assert!(text.contains("68KiB") && text.contains("block_kv = 128"), "{text}");
    // The dense GEMMs' tiles: decode's height a multiple of the MMA's m too.
    let dense = "block_q = 32  block_kv = 16 }\n  dense { block_m = 128  block_n = 64  block_k = 64  stages = 3  decode_block_m = 48";
    check("dense_tiles_mma", from, &tiles(dense), &[Code::TileNotMmaMultiple]);
    let ok = BASE.replacen(from, &tiles("block_q = 32  block_kv = 128"), 1);
    let checked = check_str("spec.moe", &ok).unwrap_or_else(|f| panic!("{}", f.render(false)));
    let a = checked.spec.tiles[0].attention.expect("the attention tiles");
    assert_eq!((a.block_q, a.block_kv), (32, 128));
    assert_eq!(a.smem_bytes(32), 2 * (128 * 40 + 32 * 136));
}

#[test]
fn tile_cluster_shape() {
    check("tile_cluster", "cluster = [2, 1]", "cluster = [3, 1]", &[Code::TileCluster]);
}

#[test]
fn contiguous_layout_needs_one_block_m() {
    check(
        "contiguous_block_m",
        "down    { block_m = 128  block_n = 128  block_k = 64  stages = 4 }",
        "down    { block_m = 64  block_n = 128  block_k = 64  stages = 4 }",
        &[Code::Inconsistent],
    );
}

#[test]
fn weights_do_not_fit() {
    check(
        "weights_fit",
        "experts = 16\n    top_k = 4\n    expert_ffn = 128",
        "experts = 60000\n    top_k = 4\n    expert_ffn = 100000",
        &[Code::WeightsDoNotFit],
    );
}

#[test]
fn switch_thresholds() {
    check(
        "switch",
        "  tiles = t\n",
        "  tiles = t\n  switch { t_high = 100  t_low = 200 }\n",
        &[Code::InconsistentDeploy],
    );
}

#[test]
fn unknown_block_kind() {
    check("block_kind", "tiles t {", "tile t {", &[Code::UnknownBlockKind, Code::UnknownName]);
}

#[test]
fn multi_node_needs_scale_out() {
    check("scale_out", "nodes = 1", "nodes = 2", &[Code::MissingField]);
}

#[test]
fn grouped_routing_limits() {
    check(
        "grouped",
        "routing softmax_topk { norm_topk = true }",
        "routing sigmoid_grouped { groups = 8  top_groups = 1  scaling = 2.5 }",
        &[Code::TopKExceedsExperts],
    );
}

#[test]
fn errors_are_all_collected() {
    let text = BASE.replacen("top_k = 4", "top_k = 99", 1).replacen("hbm = 80GB", "hbm = 80", 1).replacen(
        "rate = 4req/s",
        "rate = 4ms",
        1,
    );
    let failed = check_str("spec.moe", &text).err().unwrap_or_else(|| panic!("should fail"));
    let codes: Vec<Code> = failed.diagnostics.iter().map(|d| d.code).collect();
    assert_eq!(codes, vec![Code::UnitMismatch, Code::UnitMismatch, Code::TopKExceedsExperts]);
}

#[test]
fn json_diagnostics_carry_locations() {
    let text = BASE.replacen("top_k = 4", "top_k = 99", 1);
    let failed = check_str("spec.moe", &text).err().unwrap_or_else(|| panic!("should fail"));
    let json = failed.diagnostics.to_json(&failed.sources);
    let first = &json[0];
    assert_eq!(first["code"], "E0120");
    assert_eq!(first["primary"]["file"], "spec.moe");
    assert_eq!(first["primary"]["line"], 8);
    assert_eq!(first["primary"]["col"], 5);
    assert!(first["help"].as_str().is_some_and(|h| !h.is_empty()));
}

fn mem(files: &[(&str, &str)], root: &str) -> Result<moeforge_dsl::Checked, moeforge_dsl::Failed> {
    check_paths(&[PathBuf::from(root)], &MemLoader::new(files.iter().copied()))
}

#[test]
fn circular_use() {
    let failed = mem(&[("a.moe", "use \"b.moe\"\n"), ("b.moe", "use \"sub/../a.moe\"\n")], "a.moe")
        .err()
        .unwrap_or_else(|| panic!("cycle accepted"));
    let codes: Vec<Code> = failed.diagnostics.iter().map(|d| d.code).collect();
    assert_eq!(codes, vec![Code::CircularUse]);
    insta::assert_snapshot!("circular_use", failed.render(false));
}

#[test]
fn missing_use() {
    let failed =
        mem(&[("a.moe", "use \"nope.moe\"\n")], "a.moe").err().unwrap_or_else(|| panic!("missing file accepted"));
    let codes: Vec<Code> = failed.diagnostics.iter().map(|d| d.code).collect();
    assert_eq!(codes, vec![Code::UseNotFound]);
}

#[test]
fn diamond_use_loads_once() {
    let model = BASE.split("cluster c").next().unwrap_or_default();
    let files = [
        ("root.moe", "use \"x.moe\"\nuse \"y.moe\"\n"),
        ("x.moe", "use \"m.moe\"\n"),
        ("y.moe", "use \"m.moe\"\n"),
        ("m.moe", model),
    ];
    let checked = mem(&files, "root.moe").unwrap_or_else(|f| panic!("{}", f.render(false)));
    assert_eq!(checked.spec.models.len(), 1);
}

#[test]
fn duplicate_across_files_points_at_both() {
    let model = BASE.split("cluster c").next().unwrap_or_default();
    let files = [("root.moe", "use \"m.moe\"\nmodel m { }\n"), ("m.moe", model)];
    let failed = mem(&files, "root.moe").err().unwrap_or_else(|| panic!("duplicate accepted"));
    let d = failed.diagnostics.iter().find(|d| d.code == Code::DuplicateName).unwrap_or_else(|| panic!("no E0102"));
    assert_eq!(d.secondary.len(), 1);
    assert_ne!(d.secondary[0].span.file, d.primary.as_ref().map(|p| p.span.file).unwrap_or(d.secondary[0].span.file));
    insta::assert_snapshot!("duplicate_across_files", failed.render(false));
}

#[test]
fn every_code_is_distinct_and_stable() {
    let mut seen = std::collections::BTreeSet::new();
    for c in Code::ALL {
        assert!((c.as_str().starts_with('E') || c.as_str().starts_with('W')) && c.as_str().len() == 5, "{c}");
        assert!(seen.insert(c.as_str()), "{c} reused");
    }
}

#[test]
fn removed_fields_say_why() {
    check("removed_l2", "smem_per_block = 227KiB\n", "smem_per_block = 227KiB\n    l2 = 50MB\n", &[Code::UnknownField]);
}

/// Fields that parse but have no effect yet are accepted with a located
/// warning, only where a block writes them.
#[test]
fn fields_without_effect_warn_where_written() {
    let text = BASE
        .replacen("  prefill {\n", "  prefill {\n    layout = contiguous\n", 1)
        .replacen("  scale_up nvlink", "  scale_up nvlink { bandwidth = 450GB/s  latency = 2us }\n  scale_out ib { nics_per_node = 8  bandwidth = 400Gb/s  latency = 5us  virtual_lanes = 2 }\n  scale_up_unused", 1)
        .replacen("  scale_up_unused { bandwidth = 450GB/s  latency = 2us }\n", "", 1)
        .replacen("nodes = 1", "nodes = 2", 1);
    let checked = check_str("spec.moe", &text).unwrap_or_else(|f| panic!("{}", f.render(false)));
    let w = checked.all_warnings();
    let codes: Vec<Code> = w.iter().map(|d| d.code).collect();
    // `virtual_lanes` has an effect (the simulator's ExpertPlex prefill/decode link priority).
    assert_eq!(codes, vec![Code::NoEffect], "{}", w.render(&checked.sources, false));
    assert!(w.iter().all(|d| d.severity == moeforge_dsl::Severity::Warning && d.primary.is_some()));
    insta::assert_snapshot!("no_effect_warnings", w.render(&checked.sources, false));
    // Without those fields there is nothing to warn about.
    assert!(check_str("spec.moe", BASE).unwrap_or_else(|f| panic!("{}", f.render(false))).warnings.is_empty());
}

#[test]
fn a_partial_dsa_indexer() {
    check(
        "partial_indexer",
        "attention gqa { heads = 8  kv_heads = 2  head_dim = 32 }",
        "attention mla { heads = 8  kv_lora = 64  qk_nope = 32  qk_rope = 16  v_head = 32  index_heads = 4  index_topk = 64 }",
        &[Code::MissingField],
    );
}

#[test]
fn an_unknown_qk_norm_scope() {
    check(
        "qk_norm_scope",
        "attention gqa { heads = 8  kv_heads = 2  head_dim = 32 }",
        "attention gqa { heads = 8  kv_heads = 2  head_dim = 32  qk_norm = per_token }",
        &[Code::UnknownVariant],
    );
}

#[test]
fn rope_scaling_errors() {
    check(
        "rope_scaling_kind",
        "  vocab = 1000\n",
        "  vocab = 1000\n  rope_scaling linear { factor = 2 }\n",
        &[Code::UnknownVariant],
    );
    check(
        "rope_scaling_missing_original",
        "  vocab = 1000\n",
        "  vocab = 1000\n  rope_scaling yarn { factor = 40 }\n",
        &[Code::MissingField],
    );
    check(
        "rope_scaling_factor_below_one",
        "  vocab = 1000\n",
        "  vocab = 1000\n  rope_scaling yarn { factor = 0.5  original_max_positions = 4096 }\n",
        &[Code::OutOfRange],
    );
}

#[test]
fn indexer_narrower_than_rope() {
    check(
        "indexer_rope",
        "attention gqa { heads = 8  kv_heads = 2  head_dim = 32 }",
        "attention mla { heads = 8  q_lora = 64  kv_lora = 64  qk_nope = 32  qk_rope = 16  v_head = 32  index_heads = 4  index_head_dim = 8  index_topk = 64 }",
        &[Code::Inconsistent],
    );
}

#[test]
fn head_dim_past_the_attention_kernels() {
    // The kernels take heads of at most 256: refused where it is written.
    check("head_dim_too_wide", "head_dim = 32", "head_dim = 264", &[Code::OutOfRange]);
}

/// A diagnostic far along a line (past the column a snippet is drawn for;
/// past 65535 the renderer cannot even pad to it) is rendered in its plain
/// form with its location and help, and never panics.
#[test]
fn a_diagnostic_past_column_65535_renders_plainly() {
    let text = format!("{}@\n", " ".repeat(70_000));
    let failed = check_str("wide.moe", &text).map(|_| ()).expect_err("a syntax error");
    let shown = failed.render(false);
    assert!(shown.contains("at wide.moe:1:70001") && shown.contains("help:"), "{}", &shown[..shown.len().min(400)]);
}

/// Thousands of diagnostics: the terminal rendering shows the first 50 and
/// counts the rest (each rendering copies its file's text into the snippet).
#[test]
fn many_diagnostics_render_the_first_fifty() {
    let fields: String = (0..2000).map(|i| format!("  nonsense_{i} = 1\n")).collect();
    let text = BASE.replacen("  layers = 4\n", &format!("  layers = 4\n{fields}"), 1);
    let failed = check_str("spec.moe", &text).map(|_| ()).expect_err("unknown fields");
    assert!(failed.diagnostics.len() >= 2000);
    let shown = failed.render(false);
    assert!(
        shown.contains(&format!("… and {} more", failed.diagnostics.len() - 50)),
        "{}",
        &shown[shown.len() - 300..]
    );
    assert_eq!(shown.matches("E0105").count(), 50);
}

/// `use` reads regular files of bounded size: a device is refused where
/// the `use` is written (it would be read forever), as is a file past the bound.
#[test]
fn use_reads_only_regular_files_of_bounded_size() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("main.moe");
    std::fs::write(&main, "use \"/dev/zero\"\n").unwrap();
    let failed =
        check_paths(std::slice::from_ref(&main), &moeforge_dsl::FsLoader).map(|_| ()).expect_err("a device is refused");
    let shown = failed.render(false);
    assert!(shown.contains("not a regular file") && shown.contains("main.moe:1"), "{shown}");
    let big = dir.path().join("big.moe");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len(moeforge_dsl::source::MAX_SPEC_BYTES + 1).unwrap();
    std::fs::write(&main, "use \"big.moe\"\n").unwrap();
    let failed = check_paths(&[main], &moeforge_dsl::FsLoader).map(|_| ()).expect_err("a huge file is refused");
    let shown = failed.render(false);
    assert!(shown.contains("a spec file holds at most 16777216"), "{shown}");
}

#[test]
fn a_workload_length_past_a_million_tokens() {
    // The simulator decodes every token of every request: 16M-token outputs
    // are refused where they are written.
    check("length_too_long", "output = sharegpt", "output fixed { value = 16777216 }", &[Code::OutOfRange]);
}
