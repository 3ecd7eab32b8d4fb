//! Lowering: syntax blocks to typed [`crate::spec`] values.
//!
//! One function per block kind. Each reads every field (recording all
//! problems) and builds its value only if nothing was wrong. Cross-block
//! references (a deploy's model, cluster, tiles) stay names here; `check.rs`
//! resolves them and runs the checks that need several blocks at once.

use crate::diag::{Code, Diagnostic, Diagnostics};
use crate::fields::{Fields, SpanMap};
use crate::spec::*;
use crate::syntax::{Block, Ident};
use crate::units::Dim;

const BIG: u64 = 1 << 24;

/// The longest prompt or output a workload may draw (a million tokens, past
/// every context the zoo's models serve): the simulator decodes every token.
const MAX_LENGTH: u64 = 1 << 20;

pub fn model(b: &Block, name: &str, diags: &mut Diagnostics, spans: &mut SpanMap) -> Option<Model> {
    let mut f = Fields::new(b, "", diags, spans);
    let layers = f.req_count("layers", 1, 1024);
    let hidden = f.req_count("hidden", 64, 1 << 20);
    let vocab = f.req_count("vocab", 1, 1 << 24);
    let tie = f.opt_bool("tie_embeddings", false);
    let rope_theta = f.opt_qty("rope_theta", Dim::None, 1.0, 1e12, 1e6);
    let rms_eps = f.opt_qty("rms_eps", Dim::None, 1e-12, 1e-1, 1e-6);
    let rope_scaling = match f.variant("rope_scaling") {
        Some((kind, blk)) => rope_scaling_block(&kind, blk, f.diags, f.spans).map(Some),
        None => Some(None),
    };
    let dense = match f.sub_block("dense") {
        Some(db) => {
            let mut g = Fields::new(db, "dense", f.diags, f.spans);
            let l = g.req_count("layers", 0, 1024);
            let ffn = g.req_count("ffn", 1, 1 << 20);
            g.finish();
            match (l, ffn) {
                (Some(0), Some(_)) => Ok(None),
                (Some(layers), Some(ffn)) => Ok(Some(DenseLayers { layers, ffn })),
                _ => Err(()),
            }
        }
        None => Ok(None),
    };
    let attention = f.req_variant("attention", "attention gqa { heads = 32 kv_heads = 4 head_dim = 128 }");
    let attention = attention.and_then(|(kind, blk)| attention_block(&kind, blk, f.diags, f.spans));
    let sliding = match f.sub_block("sliding_window") {
        Some(sb) => {
            let mut g = Fields::new(sb, "sliding_window", f.diags, f.spans);
            let size = g.req_count("size", 1, BIG);
            let pattern = g.choice_list("pattern", &[("sliding", LayerAttn::Sliding), ("full", LayerAttn::Full)]);
            g.finish();
            match (size, pattern) {
                (Some(size), Some(pattern)) => Ok(Some(SlidingWindow { size, pattern })),
                _ => Err(()),
            }
        }
        None => Ok(None),
    };
    let moe = f
        .req_block("moe", "moe { experts = 128 top_k = 8 expert_ffn = 768 }")
        .and_then(|mb| moe_block(mb, f.diags, f.spans));
    let dtype = match f.sub_block("dtype") {
        Some(db) => dtype_block(db, f.diags, f.spans),
        None => {
            Some(Dtypes { weights: DType::Bf16, experts: DType::Bf16, activations: DType::Bf16, block_scale: None })
        }
    };
    f.finish();
    Some(Model {
        name: name.to_string(),
        layers: layers?,
        hidden: hidden?,
        vocab: vocab?,
        tie_embeddings: tie?,
        rope_theta: rope_theta?,
        rope_scaling: rope_scaling?,
        rms_eps: rms_eps?,
        dense: dense.ok()?,
        attention: attention?,
        sliding_window: sliding.ok()?,
        moe: moe?,
        dtype: dtype?,
    })
}

fn unknown_variant(diags: &mut Diagnostics, what: &str, kind: &Ident, choices: &[&str]) {
    let mut d =
        Diagnostic::new(Code::UnknownVariant, format!("unknown {what} `{}`", kind.text)).at(kind.span, "unknown kind");
    d = match crate::fields::suggest(&kind.text, choices) {
        Some(s) => d.help(format!("did you mean `{s}`? (choices: {})", choices.join(", "))),
        None => d.help(format!("choose one of: {}", choices.join(", "))),
    };
    diags.push(d);
}

/// A variant that needs parameters was given as a bare name.
fn needs_params(diags: &mut Diagnostics, key: &str, kind: &Ident, example: &str) {
    diags.push(
        Diagnostic::new(Code::MissingField, format!("`{key} = {}` needs parameters", kind.text))
            .at(kind.span, "parameters missing")
            .help(format!("write `{example}`")),
    );
}

fn attention_block(
    kind: &Ident,
    blk: Option<&Block>,
    diags: &mut Diagnostics,
    spans: &mut SpanMap,
) -> Option<Attention> {
    let Some(blk) = blk else {
        match kind.text.as_str() {
            "gqa" | "mla" => {
                needs_params(diags, "attention", kind, &format!("attention {} {{ heads = … }}", kind.text))
            }
            _ => unknown_variant(diags, "attention", kind, &["gqa", "mla"]),
        }
        return None;
    };
    match kind.text.as_str() {
        "gqa" => {
            let mut g = Fields::new(blk, "attention", diags, spans);
            let heads = g.req_count("heads", 1, 4096);
            let kv_heads = g.req_count("kv_heads", 1, 4096);
            // The attention kernels take heads of at most 256 (FlashAttention's bound too).
            let head_dim = g.req_count("head_dim", 8, 256);
            let qk_norm = g.opt_choice(
                "qk_norm",
                &[
                    ("false", (false, QkNormScope::PerHead)),
                    ("true", (true, QkNormScope::PerHead)),
                    ("per_head", (true, QkNormScope::PerHead)),
                    ("per_layer", (true, QkNormScope::PerLayer)),
                ],
                (false, QkNormScope::PerHead),
            );
            let rope_dim = g.maybe_count("rope_dim", 0, 1024);
            let sinks = g.opt_bool("sinks", false);
            let bias = g.opt_choice(
                "bias",
                &[("none", AttnBias::None), ("qkv", AttnBias::Qkv), ("all", AttnBias::All)],
                AttnBias::None,
            );
            g.finish();
            let head_dim = head_dim?;
            let (qk_norm, qk_norm_scope) = qk_norm?;
            Some(Attention::Gqa {
                heads: heads?,
                kv_heads: kv_heads?,
                head_dim,
                qk_norm,
                qk_norm_scope,
                rope_dim: rope_dim.ok()?.unwrap_or(head_dim),
                sinks: sinks?,
                bias: bias?,
            })
        }
        "mla" => {
            let mut g = Fields::new(blk, "attention", diags, spans);
            let heads = g.req_count("heads", 1, 4096);
            let q_lora = g.maybe_count("q_lora", 1, BIG);
            let kv_lora = g.req_count("kv_lora", 1, BIG);
            let qk_nope = g.req_count("qk_nope", 1, 1024);
            let qk_rope = g.req_count("qk_rope", 1, 1024);
            let v_head = g.req_count("v_head", 1, 1024);
            let index_heads = g.maybe_count("index_heads", 1, 4096);
            let index_head_dim = g.maybe_count("index_head_dim", 1, 1024);
            let index_topk = g.maybe_count("index_topk", 1, BIG);
            // The DSA indexer: all three fields, or none.
            let indexer = match (index_heads, index_head_dim, index_topk) {
                (Ok(None), Ok(None), Ok(None)) => Ok(None),
                (Ok(Some(heads)), Ok(Some(head_dim)), Ok(Some(top_k))) => Ok(Some(Indexer { heads, head_dim, top_k })),
                (Ok(h), Ok(d), Ok(_)) => {
                    let absent = match (h, d) {
                        (None, _) => "index_heads",
                        (_, None) => "index_head_dim",
                        _ => "index_topk",
                    };
                    g.missing(absent, "index_heads = 32  index_head_dim = 128  index_topk = 2048");
                    Err(())
                }
                _ => Err(()),
            };
            g.finish();
            let indexer = indexer.ok()?;
            Some(Attention::Mla {
                heads: heads?,
                q_lora: q_lora.ok()?,
                kv_lora: kv_lora?,
                qk_nope: qk_nope?,
                qk_rope: qk_rope?,
                v_head: v_head?,
                indexer,
            })
        }
        _ => {
            unknown_variant(diags, "attention", kind, &["gqa", "mla"]);
            None
        }
    }
}

fn moe_block(b: &Block, diags: &mut Diagnostics, spans: &mut SpanMap) -> Option<Moe> {
    let mut f = Fields::new(b, "moe", diags, spans);
    let experts = f.req_count("experts", 1, 65536);
    let top_k = f.req_count("top_k", 1, 1024);
    let expert_ffn = f.req_count("expert_ffn", 1, 1 << 20);
    let shared = f.opt_count("shared_experts", 0, 64, 0);
    let shared_ffn = f.maybe_count("shared_ffn", 1, 1 << 20);
    let activation = f.opt_choice(
        "activation",
        &[("silu", Activation::Silu), ("swiglu_oai", Activation::SwigluOai)],
        Activation::Silu,
    );
    let routing = f.req_variant("routing", "routing softmax_topk { norm_topk = true }");
    let routing = routing.and_then(|(kind, blk)| routing_block(&kind, blk, f.diags, f.spans));
    let bias = f.opt_bool("bias", false);
    f.finish();
    let expert_ffn = expert_ffn?;
    Some(Moe {
        experts: experts?,
        top_k: top_k?,
        expert_ffn,
        shared_experts: shared?,
        shared_ffn: shared_ffn.ok()?.unwrap_or(expert_ffn),
        activation: activation?,
        routing: routing?,
        bias: bias?,
    })
}

/// `rope_scaling yarn { factor original_max_positions [beta_fast beta_slow
/// mscale mscale_all_dim truncate] }`, with transformers' defaults.
fn rope_scaling_block(
    kind: &Ident,
    blk: Option<&Block>,
    diags: &mut Diagnostics,
    spans: &mut SpanMap,
) -> Option<RopeScaling> {
    const EXAMPLE: &str = "rope_scaling yarn { factor = 40 original_max_positions = 4096 }";
    match (kind.text.as_str(), blk) {
        ("yarn", Some(b)) => {
            let mut g = Fields::new(b, "rope_scaling", diags, spans);
            let factor = g.req_qty("factor", Dim::None, 1.0, 1e4, "factor = 40");
            let original = g.req_count("original_max_positions", 1, 1 << 26);
            let beta_fast = g.opt_qty("beta_fast", Dim::None, 1e-3, 1e4, 32.0);
            let beta_slow = g.opt_qty("beta_slow", Dim::None, 1e-3, 1e4, 1.0);
            let mscale = g.maybe_qty("mscale", Dim::None, 0.0, 1e3);
            let mscale_all_dim = g.maybe_qty("mscale_all_dim", Dim::None, 0.0, 1e3);
            let truncate = g.opt_bool("truncate", true);
            g.finish();
            Some(RopeScaling {
                factor: factor?,
                original_max_positions: original?,
                beta_fast: beta_fast?,
                beta_slow: beta_slow?,
                mscale: mscale.ok()?,
                mscale_all_dim: mscale_all_dim.ok()?,
                truncate: truncate?,
            })
        }
        ("yarn", None) => {
            needs_params(diags, "rope_scaling", kind, EXAMPLE);
            None
        }
        _ => {
            unknown_variant(diags, "rope_scaling", kind, &["yarn"]);
            None
        }
    }
}

fn routing_block(kind: &Ident, blk: Option<&Block>, diags: &mut Diagnostics, spans: &mut SpanMap) -> Option<Routing> {
    match (kind.text.as_str(), blk) {
        ("softmax_topk", None) => Some(Routing::SoftmaxTopk { norm_topk: false }),
        ("softmax_topk", Some(b)) => {
            let mut g = Fields::new(b, "moe.routing", diags, spans);
            let norm = g.opt_bool("norm_topk", false);
            g.finish();
            Some(Routing::SoftmaxTopk { norm_topk: norm? })
        }
        ("sigmoid_grouped", Some(b)) => {
            let mut g = Fields::new(b, "moe.routing", diags, spans);
            let groups = g.req_count("groups", 1, 1024);
            let top_groups = g.req_count("top_groups", 1, 1024);
            let scaling = g.opt_qty("scaling", Dim::None, 1e-3, 1e3, 1.0);
            let norm = g.opt_bool("norm_topk", true);
            let bias = g.opt_bool("bias", true);
            g.finish();
            Some(Routing::SigmoidGrouped {
                groups: groups?,
                top_groups: top_groups?,
                scaling: scaling?,
                norm_topk: norm?,
                bias: bias?,
            })
        }
        ("sigmoid_grouped", None) => {
            needs_params(diags, "routing", kind, "routing sigmoid_grouped { groups = 8 top_groups = 4 scaling = 2.5 }");
            None
        }
        _ => {
            unknown_variant(diags, "routing", kind, &["softmax_topk", "sigmoid_grouped"]);
            None
        }
    }
}

const DTYPES: &[(&str, DType)] = &[("bf16", DType::Bf16), ("fp8_e4m3", DType::Fp8E4m3), ("mxfp4", DType::Mxfp4)];

fn dtype_block(b: &Block, diags: &mut Diagnostics, spans: &mut SpanMap) -> Option<Dtypes> {
    let mut f = Fields::new(b, "dtype", diags, spans);
    let weights = f.opt_choice("weights", DTYPES, DType::Bf16);
    let experts = match f.value("experts") {
        Some(v) => crate::fields::choice(f.diags, "experts", v, DTYPES).map(Some),
        None => Some(None),
    };
    let activations = f.opt_choice("activations", &[("bf16", DType::Bf16), ("fp8_e4m3", DType::Fp8E4m3)], DType::Bf16);
    let block_scale = f.count_list::<2>("block_scale", 1, 4096);
    let head = f.head();
    f.finish();
    let weights = weights?;
    let experts = experts?.unwrap_or(weights);
    let block_scale = block_scale.ok()?;
    if (weights == DType::Fp8E4m3 || experts == DType::Fp8E4m3) && block_scale.is_none() {
        diags.push(
            Diagnostic::new(Code::MissingField, "fp8 weights need `block_scale`")
                .at(head, "needs `block_scale`")
                .help("add `block_scale = [128, 128]` (DeepSeek-V3 style 128×128 blocks)"),
        );
        return None;
    }
    Some(Dtypes { weights, experts, activations: activations?, block_scale })
}

pub fn cluster(b: &Block, name: &str, diags: &mut Diagnostics, spans: &mut SpanMap) -> Option<Cluster> {
    let mut f = Fields::new(b, "", diags, spans);
    // Serving deployments of more nodes than this are not planned.
    let nodes = f.req_count("nodes", 1, 1024);
    let gpn = f.req_count("gpus_per_node", 1, 72);
    let gpu = f.req_block("gpu", "gpu h100 { arch = sm_90a sms = 132 … }").and_then(|g| gpu_block(g, f.diags, f.spans));
    let scale_up = f
        .req_block("scale_up", "scale_up nvlink { bandwidth = 450GB/s latency = 2us }")
        .and_then(|l| link_block(l, "scale_up", f.diags, f.spans));
    let scale_out = match f.sub_block("scale_out") {
        Some(l) => scale_out_block(l, f.diags, f.spans).map(Some).ok_or(()),
        None => Ok(None),
    };
    let head = f.head();
    f.finish();
    let (nodes, scale_out) = (nodes?, scale_out.ok()?);
    if nodes > 1 && scale_out.is_none() {
        diags.push(
            Diagnostic::new(Code::MissingField, format!("a cluster of {nodes} nodes needs `scale_out`"))
                .at(head, "needs `scale_out`")
                .help("add `scale_out infiniband { nics_per_node = 8 bandwidth = 200Gb/s latency = 5us }`"),
        );
        return None;
    }
    Some(Cluster { name: name.to_string(), nodes, gpus_per_node: gpn?, gpu: gpu?, scale_up: scale_up?, scale_out })
}

fn block_name(b: &Block, key: &str, diags: &mut Diagnostics, example: &str) -> Option<String> {
    match &b.name {
        Some(n) => Some(n.text.clone()),
        None => {
            diags.push(
                Diagnostic::new(Code::BlockName, format!("`{key}` needs a name"))
                    .at(b.kind.span, "name missing after this")
                    .help(format!("write `{example}`")),
            );
            None
        }
    }
}

fn gpu_block(b: &Block, diags: &mut Diagnostics, spans: &mut SpanMap) -> Option<Gpu> {
    let name = block_name(b, "gpu", diags, "gpu h100 { … }");
    let mut f = Fields::new(b, "gpu", diags, spans);
    let arch = f.req_choice("arch", &[("sm_90a", Arch::Sm90a), ("sm_80", Arch::Sm80)]);
    let sms = f.req_count("sms", 1, 1024);
    let hbm = f.req_qty("hbm", Dim::Bytes, 1e6, 1e14, "80GB");
    let hbm_bw = f.req_qty("hbm_bandwidth", Dim::Bandwidth, 1e9, 1e15, "3.35TB/s");
    let bf16 = f.req_qty("bf16", Dim::FlopRate, 1e12, 1e18, "989TFLOP/s");
    let fp8 = f.maybe_qty("fp8", Dim::FlopRate, 1e12, 1e18);
    let smem_sm = f.req_qty("smem_per_sm", Dim::Bytes, 1024.0, 1e8, "228KiB");
    let smem_blk = f.req_qty("smem_per_block", Dim::Bytes, 1024.0, 1e8, "227KiB");
    f.removed("l2", "no plan, kernel or cost model ever read it");
    let head = f.head();
    f.finish();
    let (smem_sm, smem_blk) = (smem_sm? as u64, smem_blk? as u64);
    if smem_blk > smem_sm {
        diags.push(
            Diagnostic::new(Code::Inconsistent, "`smem_per_block` exceeds `smem_per_sm`")
                .at(head, "in this GPU")
                .help("one block cannot use more shared memory than its SM has"),
        );
        return None;
    }
    Some(Gpu {
        name: name?,
        arch: arch?,
        sms: sms?,
        hbm: hbm? as u64,
        hbm_bandwidth: hbm_bw?,
        bf16_flops: bf16?,
        fp8_flops: fp8.ok()?,
        smem_per_sm: smem_sm,
        smem_per_block: smem_blk,
    })
}

fn link_block(b: &Block, key: &str, diags: &mut Diagnostics, spans: &mut SpanMap) -> Option<Link> {
    let name = block_name(b, key, diags, &format!("{key} nvlink {{ … }}"));
    let mut f = Fields::new(b, "scale_up", diags, spans);
    let bw = f.req_qty("bandwidth", Dim::Bandwidth, 1e6, 1e15, "450GB/s");
    let lat = f.req_qty("latency", Dim::Time, 0.0, 1.0, "2us");
    f.finish();
    Some(Link { name: name?, bandwidth: bw?, latency: lat? })
}

fn scale_out_block(b: &Block, diags: &mut Diagnostics, spans: &mut SpanMap) -> Option<ScaleOut> {
    let name = block_name(b, "scale_out", diags, "scale_out infiniband { … }");
    let mut f = Fields::new(b, "scale_out", diags, spans);
    let nics = f.req_count("nics_per_node", 1, 64);
    let bw = f.req_qty("bandwidth", Dim::Bandwidth, 1e6, 1e15, "200Gb/s");
    let lat = f.req_qty("latency", Dim::Time, 0.0, 1.0, "5us");
    let lanes = f.opt_count("virtual_lanes", 1, 16, 1);
    f.finish();
    Some(ScaleOut { name: name?, nics_per_node: nics?, bandwidth: bw?, latency: lat?, virtual_lanes: lanes? })
}

pub fn tiles(b: &Block, name: &str, diags: &mut Diagnostics, spans: &mut SpanMap) -> Option<Tiles> {
    let mut f = Fields::new(b, "", diags, spans);
    let prefill = f
        .req_block("prefill", "prefill { layout = contiguous gate_up { … } down { … } }")
        .and_then(|p| phase_block(p, "prefill", Layout::Contiguous, f.diags, f.spans));
    let decode = f
        .req_block("decode", "decode { layout = masked gate_up { … } down { … } }")
        .and_then(|p| phase_block(p, "decode", Layout::Masked, f.diags, f.spans));
    let attention = match f.sub_block("attention") {
        Some(ab) => {
            let mut g = Fields::new(ab, "attention", f.diags, f.spans);
            let block_q = g.req_count("block_q", 16, 128);
            let block_kv = g.req_count("block_kv", 16, 128);
            g.finish();
            match (block_q, block_kv) {
                (Some(block_q), Some(block_kv)) => Ok(Some(AttentionTiles { block_q, block_kv })),
                _ => Err(()),
            }
        }
        None => Ok(None),
    };
    let dense = match f.sub_block("dense") {
        Some(db) => {
            let mut g = Fields::new(db, "dense", f.diags, f.spans);
            let tile = tile_fields(&mut g);
            let decode_block_m = g.req_count("decode_block_m", 1, 1024);
            g.finish();
            match (tile, decode_block_m) {
                (Some(tile), Some(decode_block_m)) => Ok(Some(DenseTiles { tile, decode_block_m })),
                _ => Err(()),
            }
        }
        None => Ok(None),
    };
    f.finish();
    Some(Tiles {
        name: name.to_string(),
        prefill: prefill?,
        decode: decode?,
        attention: attention.ok()?,
        dense: dense.ok()?,
    })
}

fn phase_block(
    b: &Block,
    path: &str,
    default: Layout,
    diags: &mut Diagnostics,
    spans: &mut SpanMap,
) -> Option<PhaseTiles> {
    let mut f = Fields::new(b, path, diags, spans);
    let layout = f.opt_choice("layout", &[("contiguous", Layout::Contiguous), ("masked", Layout::Masked)], default);
    let example = "gate_up { block_m = 128 block_n = 128 block_k = 64 stages = 4 }";
    let gate_up =
        f.req_block("gate_up", example).and_then(|t| tile_block(t, &format!("{path}.gate_up"), f.diags, f.spans));
    let down = f.req_block("down", example).and_then(|t| tile_block(t, &format!("{path}.down"), f.diags, f.spans));
    let head = f.head();
    f.finish();
    let (layout, gate_up, down) = (layout?, gate_up?, down?);
    if layout == Layout::Contiguous && gate_up.block_m != down.block_m {
        diags.push(
            Diagnostic::new(
                Code::Inconsistent,
                format!(
                    "contiguous layout needs one row padding, but gate_up.block_m = {} and down.block_m = {}",
                    gate_up.block_m, down.block_m
                ),
            )
            .at(head, "in this phase")
            .help("Down reads GateUp's output rows in place, so both GEMMs must use the same block_m (the padding height M_t)"),
        );
        return None;
    }
    Some(PhaseTiles { layout, gate_up, down })
}

fn tile_block(b: &Block, path: &str, diags: &mut Diagnostics, spans: &mut SpanMap) -> Option<Tile> {
    let mut f = Fields::new(b, path, diags, spans);
    let tile = tile_fields(&mut f);
    f.finish();
    tile
}

/// A tile's fields: block sizes, CTA-cluster shape (default [1, 1]), stages.
fn tile_fields(f: &mut Fields<'_, '_>) -> Option<Tile> {
    let m = f.req_count("block_m", 1, 1024);
    let n = f.req_count("block_n", 1, 1024);
    let k = f.req_count("block_k", 1, 1024);
    let cluster = f.count_list::<2>("cluster", 1, 16);
    let stages = f.req_count("stages", 1, 32);
    Some(Tile { block_m: m?, block_n: n?, block_k: k?, cluster: cluster.ok()?.unwrap_or([1, 1]), stages: stages? })
}

/// A deploy before name resolution: references are still names.
pub struct DeployAst {
    pub model: Option<Ident>,
    pub cluster: Option<Ident>,
    pub tiles: Option<Ident>,
    /// Everything but the handles, which `check.rs` fills in.
    pub rest: Option<Deploy>,
}

pub fn deploy(b: &Block, name: &str, diags: &mut Diagnostics, spans: &mut SpanMap) -> DeployAst {
    let mut f = Fields::new(b, "", diags, spans);
    let model = f.req_name("model", "MODEL_NAME");
    let cluster = f.req_name("cluster", "CLUSTER_NAME");
    let tiles = f.req_name("tiles", "TILES_NAME");
    let slo = f.req_block("slo", "slo { ttft = 1s tpot = 50ms }").and_then(|s| {
        let mut g = Fields::new(s, "slo", f.diags, f.spans);
        let ttft = g.req_qty("ttft", Dim::Time, 1e-6, 3600.0, "1s");
        let tpot = g.req_qty("tpot", Dim::Time, 1e-6, 60.0, "50ms");
        g.finish();
        Some(Slo { ttft: ttft?, tpot: tpot? })
    });
    let workload = f
        .req_block("workload", "workload { input = sharegpt output = sharegpt arrival poisson { rate = 4req/s } }")
        .and_then(|w| workload_block(w, f.diags, f.spans));
    let strategy = f.opt_choice(
        "strategy",
        &[
            ("expertplex", Strategy::Expertplex),
            ("pd-disagg", Strategy::PdDisagg),
            ("colocated", Strategy::Colocated),
            ("auto", Strategy::Auto),
        ],
        Strategy::Auto,
    );
    let switch = match f.sub_block("switch") {
        Some(s) => switch_block(s, f.diags, f.spans),
        None => Some(SwitchPolicy { enabled: false, t_high: None, t_low: None, window: 8, cooldown: 5.0 }),
    };
    let placement = match f.sub_block("placement") {
        Some(p) => {
            let mut g = Fields::new(p, "placement", f.diags, f.spans);
            let policy = g.opt_choice(
                "policy",
                &[("none", PlacementPolicy::None), ("eplb", PlacementPolicy::Eplb), ("zepp", PlacementPolicy::Zepp)],
                PlacementPolicy::None,
            );
            let redundant = g.opt_count("redundant_experts", 0, 65536, 0);
            g.finish();
            policy.zip(redundant).map(|(policy, redundant_experts)| Placement { policy, redundant_experts })
        }
        None => Some(Placement { policy: PlacementPolicy::None, redundant_experts: 0 }),
    };
    let fraction = f.opt_qty("memory_fraction", Dim::None, 0.05, 1.0, 0.9);
    f.finish();
    let rest = (|| {
        Some(Deploy {
            name: name.to_string(),
            model: ModelId(0),
            cluster: ClusterId(0),
            tiles: TilesId(0),
            slo: slo?,
            workload: workload?,
            strategy: strategy?,
            switch: switch?,
            placement: placement?,
            memory_fraction: fraction?,
        })
    })();
    DeployAst { model, cluster, tiles, rest }
}

fn switch_block(b: &Block, diags: &mut Diagnostics, spans: &mut SpanMap) -> Option<SwitchPolicy> {
    let mut f = Fields::new(b, "switch", diags, spans);
    let enabled = f.opt_bool("enabled", true);
    let t_high = auto_count(&mut f, "t_high");
    let t_low = auto_count(&mut f, "t_low");
    let window = f.opt_count("window", 1, 1 << 20, 8);
    let cooldown = f.opt_qty("cooldown", Dim::Time, 0.0, 86400.0, 5.0);
    f.finish();
    let (t_high, t_low) = (t_high.ok()?, t_low.ok()?);
    if let (Some((h, _)), Some((l, lspan))) = (t_high, t_low) {
        if l > h {
            diags.push(
                Diagnostic::new(Code::InconsistentDeploy, format!("`t_low` ({l}) exceeds `t_high` ({h})"))
                    .at(lspan, "must be at most t_high")
                    .help("T_ℓ ≤ T_h keeps the switch from oscillating (Moebius §4.5); the paper uses T_ℓ = 0.8·T_h"),
            );
            return None;
        }
    }
    Some(SwitchPolicy {
        enabled: enabled?,
        t_high: t_high.map(|t| t.0),
        t_low: t_low.map(|t| t.0),
        window: window?,
        cooldown: cooldown?,
    })
}

/// `key = N` or `key = auto` (→ `None`).
fn auto_count(f: &mut Fields<'_, '_>, key: &'static str) -> Result<Option<(u32, crate::source::Span)>, ()> {
    match f.value(key) {
        None => Ok(None),
        Some(v) if matches!(&v.kind, crate::syntax::ValueKind::Ident(s) if s == "auto") => Ok(None),
        Some(v) => crate::fields::count(f.diags, key, v, 1, 1 << 24).map(|c| Some((c, v.span))).ok_or(()),
    }
}

fn workload_block(b: &Block, diags: &mut Diagnostics, spans: &mut SpanMap) -> Option<Workload> {
    let mut f = Fields::new(b, "workload", diags, spans);
    let input = f.req_variant("input", "input = sharegpt").and_then(|(k, blk)| length_dist(&k, blk, f.diags, f.spans));
    let output =
        f.req_variant("output", "output = sharegpt").and_then(|(k, blk)| length_dist(&k, blk, f.diags, f.spans));
    let arrival = f
        .req_variant("arrival", "arrival poisson { rate = 4req/s }")
        .and_then(|(k, blk)| arrival_block(&k, blk, f.diags, f.spans));
    f.finish();
    Some(Workload { input: input?, output: output?, arrival: arrival? })
}

fn length_dist(kind: &Ident, blk: Option<&Block>, diags: &mut Diagnostics, spans: &mut SpanMap) -> Option<LengthDist> {
    const KINDS: &[&str] = &["fixed", "uniform", "lognormal", "sharegpt", "loogle", "rollout"];
    let preset = match kind.text.as_str() {
        "sharegpt" => Some(LengthDist::Sharegpt),
        "loogle" => Some(LengthDist::Loogle),
        "rollout" => Some(LengthDist::Rollout),
        _ => None,
    };
    match (preset, blk) {
        (Some(p), None) => return Some(p),
        (Some(p), Some(b)) => {
            Fields::new(b, "workload.dist", diags, spans).finish();
            return b.items.is_empty().then_some(p);
        }
        (None, None) => {
            if KINDS.contains(&kind.text.as_str()) {
                needs_params(diags, "length", kind, &format!("{} {{ … }}", kind.text));
            } else {
                unknown_variant(diags, "length distribution", kind, KINDS);
            }
            return None;
        }
        (None, Some(_)) => {}
    }
    let b = blk?;
    let mut f = Fields::new(b, "workload.dist", diags, spans);
    let out = match kind.text.as_str() {
        "fixed" => {
            let v = f.req_count("value", 1, MAX_LENGTH);
            f.finish();
            LengthDist::Fixed { value: v? }
        }
        "uniform" => {
            let min = f.req_count("min", 1, MAX_LENGTH);
            let max = f.req_count("max", 1, MAX_LENGTH);
            let head = f.head();
            f.finish();
            let (min, max) = (min?, max?);
            if min > max {
                diags.push(
                    Diagnostic::new(Code::InconsistentDeploy, format!("uniform lengths with min {min} > max {max}"))
                        .at(head, "empty range")
                        .help("swap `min` and `max`"),
                );
                return None;
            }
            LengthDist::Uniform { min, max }
        }
        "lognormal" => {
            let mean = f.req_qty("mean", Dim::None, 1.0, 1e7, "1024");
            let sigma = f.req_qty("sigma", Dim::None, 0.0, 10.0, "1.0");
            let max = f.req_count("max", 1, MAX_LENGTH);
            f.finish();
            LengthDist::Lognormal { mean: mean?, sigma: sigma?, max: max? }
        }
        _ => {
            f.finish();
            unknown_variant(diags, "length distribution", kind, KINDS);
            return None;
        }
    };
    Some(out)
}

fn arrival_block(kind: &Ident, blk: Option<&Block>, diags: &mut Diagnostics, spans: &mut SpanMap) -> Option<Arrival> {
    let Some(b) = blk else {
        match kind.text.as_str() {
            "poisson" | "gamma" => {
                needs_params(diags, "arrival", kind, &format!("arrival {} {{ rate = 4req/s }}", kind.text))
            }
            _ => unknown_variant(diags, "arrival process", kind, &["poisson", "gamma"]),
        }
        return None;
    };
    let mut f = Fields::new(b, "workload.arrival", diags, spans);
    let rate = f.req_qty("rate", Dim::Rate, 1e-6, 1e7, "4req/s");
    let process = match kind.text.as_str() {
        "poisson" => Some(ArrivalProcess::Poisson),
        "gamma" => {
            f.req_qty("burstiness", Dim::None, 1e-3, 1e3, "0.5").map(|b| ArrivalProcess::Gamma { burstiness: b })
        }
        _ => {
            unknown_variant(f.diags, "arrival process", kind, &["poisson", "gamma"]);
            None
        }
    };
    f.finish();
    Some(Arrival { process: process?, rate: rate? })
}
