//! Hugging Face `config.json` → a `model` block (`moeforge import-hf`).
//!
//! Reads the configs as the Hub ships them for Qwen3-MoE, Mixtral,
//! DeepSeek-V3 and Kimi-K2, GLM-4.5 and GLM-5, MiniMax-M2 and GPT-OSS, with
//! the key names of older and newer `transformers` releases: `num_experts`
//! or `num_local_experts`; `rope_theta` or `rope_parameters.rope_theta`;
//! `rope_scaling` or the scaling inside `rope_parameters`; `rotary_dim` or
//! `partial_rotary_factor`; MiniMax-M2's `qk_norm_type`; GLM-5's `index_*`
//! (the DSA indexer). A `quantization_config` gives the storage types (fp8
//! with its block shape, or mxfp4 experts).
//!
//! What the spec cannot say (RoPE scaling, multi-token-prediction layers)
//! is returned as [`Imported::notes`], which the CLI writes as comments. An
//! unknown architecture or a missing key is an [`HfError`] naming it.

use crate::spec::*;
use serde_json::{Map, Value};

/// A model read from a config, and what the spec leaves out.
#[derive(Clone, Debug, PartialEq)]
pub struct Imported {
    pub model: Model,
    /// The architecture named in the config (`architectures[0]`).
    pub architecture: String,
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HfError {
    #[error("config.json is not JSON: {0}")]
    Json(String),
    #[error("config.json has no `architectures` (or `model_type`) to say what model it is")]
    NoArchitecture,
    #[error("architecture `{0}` is not supported; supported: {SUPPORTED}")]
    Unsupported(String),
    #[error("config.json has no `{key}` ({architecture} needs it)")]
    Missing { key: String, architecture: String },
    #[error("`{key}` = {value} in config.json: {why}")]
    Bad { key: String, value: String, why: String },
}

/// GPT-OSS's clamped SwiGLU constants (transformers' `GptOssExperts`: `alpha`, `limit`).
pub const SWIGLU_OAI_ALPHA: f64 = 1.702;
pub const SWIGLU_OAI_LIMIT: f64 = 7.0;

/// The architectures [`import`] reads.
pub const SUPPORTED: &str = "Qwen3MoeForCausalLM, MixtralForCausalLM, DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2), \
Glm4MoeForCausalLM (GLM-4.5), GlmMoeDsaForCausalLM (GLM-5), MiniMaxM2ForCausalLM, GptOssForCausalLM";

/// A config's fields with errors that name the key.
struct Cfg<'a> {
    map: &'a Map<String, Value>,
    arch: &'a str,
}

impl<'a> Cfg<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }
    fn missing(&self, key: &str) -> HfError {
        HfError::Missing { key: key.into(), architecture: self.arch.into() }
    }
    fn bad(&self, key: &str, v: &Value, why: &str) -> HfError {
        HfError::Bad { key: key.into(), value: v.to_string(), why: why.into() }
    }
    /// The first of `keys` present, as a whole number that fits u32.
    fn u32_of(&self, keys: &[&str]) -> Result<u32, HfError> {
        self.opt_u32(keys)?.ok_or_else(|| self.missing(keys[0]))
    }
    fn opt_u32(&self, keys: &[&str]) -> Result<Option<u32>, HfError> {
        for k in keys {
            if let Some(v) = self.get(k) {
                let n = v.as_u64().and_then(|n| u32::try_from(n).ok());
                return n.map(Some).ok_or_else(|| self.bad(k, v, "expected a whole number"));
            }
        }
        Ok(None)
    }
    fn f64_of(&self, keys: &[&str]) -> Result<f64, HfError> {
        self.opt_f64(keys)?.ok_or_else(|| self.missing(keys[0]))
    }
    fn opt_f64(&self, keys: &[&str]) -> Result<Option<f64>, HfError> {
        for k in keys {
            if let Some(v) = self.get(k) {
                return v.as_f64().map(Some).ok_or_else(|| self.bad(k, v, "expected a number"));
            }
        }
        Ok(None)
    }
    fn opt_bool(&self, key: &str) -> Result<Option<bool>, HfError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.bad(key, v, "expected true or false")),
        }
    }
    fn opt_str(&self, key: &str) -> Option<&'a str> {
        self.get(key).and_then(Value::as_str)
    }
}

/// The architectures `import` reads, by family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Qwen3Moe,
    Mixtral,
    DeepseekV3,
    Glm4Moe,
    GlmDsa,
    MiniMaxM2,
    GptOss,
}

fn family(arch: &str, model_type: Option<&str>) -> Option<Family> {
    Some(match (arch, model_type) {
        ("Qwen3MoeForCausalLM", _) | (_, Some("qwen3_moe")) => Family::Qwen3Moe,
        ("MixtralForCausalLM", _) | (_, Some("mixtral")) => Family::Mixtral,
        ("DeepseekV3ForCausalLM", _) | (_, Some("deepseek_v3" | "kimi_k2")) => Family::DeepseekV3,
        ("Glm4MoeForCausalLM", _) | (_, Some("glm4_moe")) => Family::Glm4Moe,
        ("GlmMoeDsaForCausalLM", _) | (_, Some("glm_moe_dsa")) => Family::GlmDsa,
        ("MiniMaxM2ForCausalLM", _) | (_, Some("minimax_m2")) => Family::MiniMaxM2,
        ("GptOssForCausalLM", _) | (_, Some("gpt_oss")) => Family::GptOss,
        _ => return None,
    })
}

/// Reads `config` (the text of a config.json) as model `name`.
pub fn import(config: &str, name: &str) -> Result<Imported, HfError> {
    let v: Value = serde_json::from_str(config).map_err(|e| HfError::Json(e.to_string()))?;
    let map = v.as_object().ok_or_else(|| HfError::Json("the top level is not an object".into()))?;
    let arch_owned = map
        .get("architectures")
        .and_then(|a| a.as_array())
        .and_then(|a| a.first())
        .and_then(|a| a.as_str())
        .or_else(|| map.get("model_type").and_then(Value::as_str))
        .ok_or(HfError::NoArchitecture)?
        .to_string();
    let arch = arch_owned.as_str();
    let fam = family(arch, map.get("model_type").and_then(Value::as_str))
        .ok_or_else(|| HfError::Unsupported(arch.to_string()))?;
    let c = Cfg { map, arch };
    let mut notes = Vec::new();

    let layers = c.u32_of(&["num_hidden_layers"])?;
    let hidden = c.u32_of(&["hidden_size"])?;
    let vocab = c.u32_of(&["vocab_size"])?;
    let tie_embeddings = c.opt_bool("tie_word_embeddings")?.unwrap_or(false);
    let rms_eps = c.f64_of(&["rms_norm_eps"])?;
    let (rope_theta, rope_scaling) = rope(&c, &mut notes)?;

    // Attention.
    let heads = c.u32_of(&["num_attention_heads"])?;
    let attention = match fam {
        Family::DeepseekV3 | Family::GlmDsa => Attention::Mla {
            heads,
            q_lora: c.opt_u32(&["q_lora_rank"])?,
            kv_lora: c.u32_of(&["kv_lora_rank"])?,
            qk_nope: c.u32_of(&["qk_nope_head_dim"])?,
            qk_rope: c.u32_of(&["qk_rope_head_dim"])?,
            v_head: c.u32_of(&["v_head_dim"])?,
            indexer: indexer(&c, fam)?,
        },
        _ => {
            let kv_heads = c.opt_u32(&["num_key_value_heads"])?.unwrap_or(heads);
            let head_dim = match c.opt_u32(&["head_dim"])? {
                Some(d) => d,
                None if heads > 0 && hidden % heads == 0 => hidden / heads,
                None => return Err(c.missing("head_dim")),
            };
            // transformers 5 writes partial_rotary_factor inside rope_parameters.
            let nested = c.get("rope_parameters").and_then(|p| p.get("partial_rotary_factor"));
            // transformers' standardize_rope_params only fills the nested one from the top level.
            let factor = match (nested, c.opt_f64(&["partial_rotary_factor"])?) {
                (Some(v), _) => Some(
                    v.as_f64().ok_or_else(|| c.bad("rope_parameters.partial_rotary_factor", v, "expected a number"))?,
                ),
                (None, f) => f,
            };
            let rope_dim = match (c.opt_u32(&["rotary_dim"])?, factor) {
                (Some(r), _) => r,
                (None, Some(f)) => {
                    let r = f64::from(head_dim) * f;
                    if !(r.fract() == 0.0 && r > 0.0 && r <= f64::from(head_dim)) {
                        let v = Value::from(f);
                        return Err(c.bad("partial_rotary_factor", &v, "must give a whole rotary width ≤ head_dim"));
                    }
                    r as u32
                }
                (None, None) => head_dim,
            };
            let (qk_norm, qk_norm_scope) = qk_norm(&c, fam)?;
            // transformers' attention_bias: q/k/v biases; GPT-OSS's o_proj has one too.
            let bias = match (c.opt_bool("attention_bias")?, fam) {
                (Some(true), Family::GptOss) => AttnBias::All,
                (Some(true), _) => AttnBias::Qkv,
                _ => AttnBias::None,
            };
            Attention::Gqa {
                heads,
                kv_heads,
                head_dim,
                qk_norm,
                qk_norm_scope,
                rope_dim,
                sinks: fam == Family::GptOss,
                bias,
            }
        }
    };

    // The spec's MLA rotates interleaved pairs, as DeepSeek's checkpoints are laid out.
    if matches!(attention, Attention::Mla { .. }) && c.opt_bool("rope_interleave")? == Some(false) {
        return Err(c.bad(
            "rope_interleave",
            &Value::Bool(false),
            "the spec's MLA rotates interleaved pairs (x[2i], x[2i+1]), as DeepSeek's checkpoints do",
        ));
    }

    // Layers that are not MoE: DeepSeek-style leading dense layers.
    let dense_k = c.opt_u32(&["first_k_dense_replace"])?.unwrap_or(0);
    if let Some(v) = c.get("mlp_only_layers") {
        if v.as_array().is_some_and(|a| !a.is_empty()) {
            return Err(c.bad("mlp_only_layers", v, "dense layers between MoE layers are not supported"));
        }
    }
    if let Some(step) = c.opt_u32(&["decoder_sparse_step"])? {
        if step != 1 {
            let v = c.get("decoder_sparse_step").cloned().unwrap_or(Value::Null);
            return Err(c.bad("decoder_sparse_step", &v, "only every layer being MoE (1) is supported"));
        }
    }
    let dense =
        if dense_k > 0 { Some(DenseLayers { layers: dense_k, ffn: c.u32_of(&["intermediate_size"])? }) } else { None };
    if c.opt_bool("attention_bias")? == Some(true) && matches!(attention, Attention::Mla { .. }) {
        notes.push("attention_bias = true: MLA's projection biases are not part of the spec".into());
    }
    if let Some(n) = c.opt_u32(&["num_nextn_predict_layers"])?.filter(|&n| n > 0) {
        let what = if n == 1 { "layer is".to_string() } else { format!("{n} layers are") };
        notes.push(format!("num_nextn_predict_layers = {n}: the multi-token-prediction {what} not part of the spec"));
    }

    // Experts.
    let experts = c.u32_of(&["n_routed_experts", "num_local_experts", "num_experts"])?;
    let top_k = c.u32_of(&["num_experts_per_tok", "experts_per_token"])?;
    let expert_ffn = match fam {
        Family::Mixtral | Family::MiniMaxM2 | Family::GptOss => c.u32_of(&["intermediate_size"])?,
        _ => c.u32_of(&["moe_intermediate_size"])?,
    };
    let shared_experts = c.opt_u32(&["n_shared_experts"])?.unwrap_or(0);
    let norm_topk = c.opt_bool("norm_topk_prob")?;
    let routing = match fam {
        Family::Qwen3Moe => Routing::SoftmaxTopk { norm_topk: norm_topk.unwrap_or(false) },
        // Mixtral and GPT-OSS normalize over the chosen experts.
        Family::Mixtral | Family::GptOss => Routing::SoftmaxTopk { norm_topk: true },
        Family::DeepseekV3 | Family::Glm4Moe | Family::GlmDsa | Family::MiniMaxM2 => {
            let scoring = c.opt_str("scoring_func").unwrap_or("sigmoid");
            if scoring != "sigmoid" {
                let v = c.get("scoring_func").cloned().unwrap_or(Value::Null);
                return Err(c.bad("scoring_func", &v, "grouped routing is read for sigmoid scores only"));
            }
            let bias = match fam {
                // transformers' MiniMax-M2 always adds the bias and does not write the key.
                Family::MiniMaxM2 => c.opt_bool("use_routing_bias")?.unwrap_or(true),
                _ => c.opt_str("topk_method").is_none_or(|m| m == "noaux_tc"),
            };
            Routing::SigmoidGrouped {
                groups: c.opt_u32(&["n_group"])?.unwrap_or(1),
                top_groups: c.opt_u32(&["topk_group"])?.unwrap_or(1),
                scaling: c.opt_f64(&["routed_scaling_factor"])?.unwrap_or(1.0),
                norm_topk: norm_topk.unwrap_or(true),
                bias,
            }
        }
    };
    let activation = if fam == Family::GptOss { Activation::SwigluOai } else { Activation::Silu };
    if fam == Family::GptOss {
        // `swiglu_oai` is GPT-OSS's gate·σ(1.702·gate)·(up+1) with both clamped at 7; other constants
        // would be another activation.
        for (key, want) in [("swiglu_alpha", SWIGLU_OAI_ALPHA), ("swiglu_limit", SWIGLU_OAI_LIMIT)] {
            if let Some(v) = c.opt_f64(&[key])?.filter(|v| (v - want).abs() > 1e-9) {
                let why = format!("swiglu_oai is defined with {key} = {want}; another value is not supported");
                return Err(c.bad(key, &Value::from(v), &why));
            }
        }
    }
    // GPT-OSS's router and experts carry biases.
    let bias = fam == Family::GptOss;
    let moe = Moe { experts, top_k, expert_ffn, shared_experts, shared_ffn: expert_ffn, activation, routing, bias };

    let sliding_window = sliding(&c, fam)?;
    let dtype = dtypes(&c)?;
    let model = Model {
        name: name.to_string(),
        layers,
        hidden,
        vocab,
        tie_embeddings,
        rope_theta,
        rope_scaling,
        rms_eps,
        dense,
        attention,
        sliding_window,
        moe,
        dtype,
    };
    Ok(Imported { model, architecture: arch.to_string(), notes })
}

/// `rope_theta`, at the top level (older configs) or inside
/// `rope_parameters` (newer), and the RoPE scaling (`rope_scaling`, or the
/// type and its parameters in `rope_parameters`): YaRN becomes the spec's
/// `rope_scaling yarn`; any other kind becomes a note.
fn rope(c: &Cfg<'_>, notes: &mut Vec<String>) -> Result<(f64, Option<RopeScaling>), HfError> {
    let params = c.get("rope_parameters").and_then(Value::as_object);
    let theta = match (c.opt_f64(&["rope_theta"])?, params.and_then(|p| p.get("rope_theta"))) {
        (Some(t), _) => t,
        (None, Some(v)) => v.as_f64().ok_or_else(|| c.bad("rope_parameters.rope_theta", v, "expected a number"))?,
        (None, None) => return Err(c.missing("rope_theta")),
    };
    let (key, scaling) = match c.get("rope_scaling").and_then(Value::as_object) {
        Some(s) => ("rope_scaling", Some(s)),
        None => ("rope_parameters", params),
    };
    let Some(s) = scaling else { return Ok((theta, None)) };
    let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str).unwrap_or("default");
    let num = |k: &str| -> Result<Option<f64>, HfError> {
        match s.get(k).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| c.bad(&format!("{key}.{k}"), v, "expected a number")),
        }
    };
    match kind {
        "default" => Ok((theta, None)),
        "yarn" => {
            // As transformers' standardize_rope_params: a top-level
            // original_max_position_embeddings wins (Phi-3 style), a missing
            // one is max_position_embeddings; a missing factor is max / original.
            let top = c.opt_f64(&["original_max_position_embeddings"])?;
            let original =
                match top.or(num("original_max_position_embeddings")?).or(c.opt_f64(&["max_position_embeddings"])?) {
                    Some(o) if o >= 1.0 && o.fract() == 0.0 && o <= f64::from(u32::MAX) => o,
                    Some(o) => {
                        let v = Value::from(o);
                        return Err(c.bad(
                            &format!("{key}.original_max_position_embeddings"),
                            &v,
                            "expected a whole count",
                        ));
                    }
                    None => return Err(c.missing(&format!("{key}.original_max_position_embeddings"))),
                };
            let factor = match num("factor")? {
                Some(f) => f,
                None => {
                    c.opt_f64(&["max_position_embeddings"])?.ok_or_else(|| c.missing(&format!("{key}.factor")))?
                        / original
                }
            };
            let truncate = match s.get("truncate") {
                None | Some(Value::Null) => true,
                Some(v) => v.as_bool().ok_or_else(|| c.bad(&format!("{key}.truncate"), v, "expected true or false"))?,
            };
            let y = RopeScaling {
                factor,
                original_max_positions: original as u32,
                beta_fast: num("beta_fast")?.filter(|b| *b != 0.0).unwrap_or(32.0),
                beta_slow: num("beta_slow")?.filter(|b| *b != 0.0).unwrap_or(1.0),
                mscale: num("mscale")?,
                mscale_all_dim: num("mscale_all_dim")?,
                truncate,
            };
            // transformers uses an explicit attention_factor as given; the spec derives it.
            if let Some(af) = num("attention_factor")? {
                if (af - y.attention_factor()).abs() > 1e-9 * af.abs().max(1.0) {
                    let v = Value::from(af);
                    let why = format!(
                        "the spec derives the attention factor from factor and mscale ({}); an explicit other value cannot be stated",
                        y.attention_factor()
                    );
                    return Err(c.bad(&format!("{key}.attention_factor"), &v, &why));
                }
            }
            Ok((theta, Some(y)))
        }
        other => {
            let mut parts = vec![other.to_string()];
            for k in ["factor", "original_max_position_embeddings"] {
                if let Some(v) = s.get(k).filter(|v| !v.is_null()) {
                    parts.push(format!("{k} = {v}"));
                }
            }
            notes.push(format!("RoPE scaling {}: the spec supports yarn only; left out", parts.join(", ")));
            Ok((theta, None))
        }
    }
}

/// Qwen3 always norms q and k per head; GLM-4.5 says so with `use_qk_norm`.
/// MiniMax-M2's published config says `use_qk_norm` and `qk_norm_type =
/// per_layer` (one norm over the whole projection); transformers' class
/// always norms that way and writes neither key, so both are its defaults.
fn qk_norm(c: &Cfg<'_>, fam: Family) -> Result<(bool, QkNormScope), HfError> {
    let on = match fam {
        Family::Qwen3Moe => true,
        Family::MiniMaxM2 => c.opt_bool("use_qk_norm")?.unwrap_or(true),
        _ => c.opt_bool("use_qk_norm")?.unwrap_or(false),
    };
    let scope = match c.opt_str("qk_norm_type") {
        None if fam == Family::MiniMaxM2 => QkNormScope::PerLayer,
        None | Some("per_head") => QkNormScope::PerHead,
        Some("per_layer") => QkNormScope::PerLayer,
        Some(_) => {
            let v = c.get("qk_norm_type").cloned().unwrap_or(Value::Null);
            return Err(c.bad("qk_norm_type", &v, "expected per_head or per_layer"));
        }
    };
    Ok((on, if on { scope } else { QkNormScope::PerHead }))
}

/// GLM-5's DSA indexer (`index_n_heads`, `index_head_dim`, `index_topk`).
fn indexer(c: &Cfg<'_>, fam: Family) -> Result<Option<Indexer>, HfError> {
    let keys = ["index_n_heads", "index_head_dim", "index_topk"];
    let present: Vec<&str> = keys.iter().copied().filter(|k| c.get(k).is_some()).collect();
    if present.is_empty() {
        return if fam == Family::GlmDsa { Err(c.missing("index_topk")) } else { Ok(None) };
    }
    // transformers' "shared" layers reuse the previous full layer's top-k
    // instead of running their own indexer; every layer here runs its own.
    let why = "a layer that reuses another's DSA selection is not supported: every layer runs its own indexer";
    if let Some(v) = c.get("indexer_types") {
        let full = |x: &Value| matches!(x.as_str(), Some("full"));
        if !v.as_array().is_some_and(|a| a.iter().all(full)) {
            return Err(c.bad("indexer_types", v, why));
        }
    }
    if let Some(v) = c.get("index_topk_pattern") {
        if !v.as_str().is_some_and(|p| p.chars().all(|ch| ch == 'F')) {
            return Err(c.bad("index_topk_pattern", v, why));
        }
    }
    if c.opt_bool("indexer_rope_interleave")? == Some(false) {
        return Err(c.bad(
            "indexer_rope_interleave",
            &Value::Bool(false),
            "the DSA indexer rotates interleaved pairs (x[2i], x[2i+1]), as GLM-5 does",
        ));
    }
    if c.get("indexer_types").is_none()
        && c.get("index_topk_pattern").is_none()
        && c.opt_u32(&["index_topk_freq"])?.unwrap_or(1) > 1
    {
        return Err(c.bad("index_topk_freq", &c.get("index_topk_freq").cloned().unwrap_or(Value::Null), why));
    }
    Ok(Some(Indexer {
        heads: c.u32_of(&["index_n_heads"])?,
        head_dim: c.u32_of(&["index_head_dim"])?,
        top_k: c.u32_of(&["index_topk"])?,
    }))
}

/// GPT-OSS's alternating sliding-window layers (`layer_types`, or the
/// default alternation starting with a sliding layer).
fn sliding(c: &Cfg<'_>, fam: Family) -> Result<Option<SlidingWindow>, HfError> {
    let Some(size) = c.opt_u32(&["sliding_window"])? else { return Ok(None) };
    if c.opt_bool("use_sliding_window")? == Some(false) {
        return Ok(None);
    }
    let pattern = match c.get("layer_types").and_then(Value::as_array) {
        Some(types) => {
            let mut p = Vec::with_capacity(types.len());
            for t in types {
                p.push(match t.as_str() {
                    Some("sliding_attention") => LayerAttn::Sliding,
                    Some("full_attention") => LayerAttn::Full,
                    _ => return Err(c.bad("layer_types", t, "expected sliding_attention or full_attention")),
                });
            }
            shortest_period(&p)
        }
        None if fam == Family::GptOss => vec![LayerAttn::Sliding, LayerAttn::Full],
        None => return Ok(None),
    };
    if pattern.iter().all(|l| *l == LayerAttn::Full) {
        return Ok(None);
    }
    Ok(Some(SlidingWindow { size, pattern }))
}

/// The shortest prefix that repeats to give `p`.
fn shortest_period(p: &[LayerAttn]) -> Vec<LayerAttn> {
    (1..=p.len()).find(|&n| p.iter().enumerate().all(|(i, l)| *l == p[i % n])).map_or(p.to_vec(), |n| p[..n].to_vec())
}

/// Storage types: `quantization_config` (fp8 blocks, mxfp4 experts), else
/// `torch_dtype`/`dtype` (bf16).
fn dtypes(c: &Cfg<'_>) -> Result<Dtypes, HfError> {
    let dtype = c.opt_str("torch_dtype").or_else(|| c.opt_str("dtype")).unwrap_or("bfloat16");
    if dtype != "bfloat16" {
        let v = c.get("torch_dtype").or_else(|| c.get("dtype")).cloned().unwrap_or(Value::Null);
        return Err(c.bad("torch_dtype", &v, "only bfloat16 checkpoints (or quantized ones) are read"));
    }
    let mut d = Dtypes { weights: DType::Bf16, experts: DType::Bf16, activations: DType::Bf16, block_scale: None };
    let Some(q) = c.get("quantization_config") else { return Ok(d) };
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or_default();
    match method {
        "fp8" => {
            let fmt = q.get("fmt").and_then(Value::as_str).unwrap_or("e4m3");
            if !matches!(fmt, "e4m3" | "float8_e4m3fn") {
                return Err(c.bad("quantization_config.fmt", &q["fmt"], "only e4m3 fp8 is supported"));
            }
            let block = match q.get("weight_block_size") {
                Some(b) => {
                    let dims: Option<Vec<u32>> = b
                        .as_array()
                        .map(|a| a.iter().filter_map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok())).collect());
                    match dims.as_deref() {
                        Some([r, k]) => Some([*r, *k]),
                        _ => return Err(c.bad("quantization_config.weight_block_size", b, "expected [rows, cols]")),
                    }
                }
                None => None,
            };
            d.weights = DType::Fp8E4m3;
            d.experts = DType::Fp8E4m3;
            d.block_scale = block;
        }
        "mxfp4" => d.experts = DType::Mxfp4,
        other => {
            return Err(c.bad(
                "quantization_config.quant_method",
                &Value::String(other.to_string()),
                "supported: fp8 (e4m3, block scales) and mxfp4",
            ))
        }
    }
    Ok(d)
}

/// A model block as `.moe` text, with `notes` as comments above it.
pub fn to_moe(imported: &Imported, source: &str) -> String {
    let mut s = format!("// Imported from {source} ({}) by `moeforge import-hf`.\n", imported.architecture);
    for n in &imported.notes {
        s.push_str(&format!("// note: {n}\n"));
    }
    s.push_str(&imported.model.to_string());
    s
}
