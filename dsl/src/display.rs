//! The textual form of a [`Spec`]: canonical `.moe` source.
//!
//! Printing a checked spec gives a single self-contained file (no `use`)
//! with every default made explicit and every quantity in a fixed unit.
//! Checking that text gives back an equal `Spec`; tests rely on this.

use crate::spec::*;
use std::fmt::{self, Display, Formatter, Write};

/// Shortest decimal that parses back to the same f64.
fn num(v: f64) -> String {
    let s = format!("{v:?}");
    s.strip_suffix(".0").map(str::to_string).unwrap_or(s)
}

fn b(v: bool) -> &'static str {
    if v {
        "true"
    } else {
        "false"
    }
}

fn dist(d: &LengthDist) -> String {
    match d {
        LengthDist::Fixed { value } => format!(" fixed {{ value = {value} }}"),
        LengthDist::Uniform { min, max } => format!(" uniform {{ min = {min}  max = {max} }}"),
        LengthDist::Lognormal { mean, sigma, max } => {
            format!(" lognormal {{ mean = {}  sigma = {}  max = {max} }}", num(*mean), num(*sigma))
        }
        LengthDist::Sharegpt => " = sharegpt".into(),
        LengthDist::Loogle => " = loogle".into(),
        LengthDist::Rollout => " = rollout".into(),
    }
}

impl Display for Spec {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let mut first = true;
        let mut sep = |f: &mut Formatter<'_>| -> fmt::Result {
            if !first {
                f.write_char('\n')?;
            }
            first = false;
            Ok(())
        };
        for m in &self.models {
            sep(f)?;
            write_model(f, m)?;
        }
        for c in &self.clusters {
            sep(f)?;
            write_cluster(f, c)?;
        }
        for t in &self.tiles {
            sep(f)?;
            write_tiles(f, t)?;
        }
        for d in &self.deploys {
            sep(f)?;
            write_deploy(f, self, d)?;
        }
        Ok(())
    }
}

/// One `model` block, canonical.
impl Display for Model {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write_model(f, self)
    }
}

fn write_model(f: &mut Formatter<'_>, m: &Model) -> fmt::Result {
    writeln!(f, "model {} {{", m.name)?;
    writeln!(f, "  layers = {}\n  hidden = {}\n  vocab = {}", m.layers, m.hidden, m.vocab)?;
    writeln!(f, "  tie_embeddings = {}", b(m.tie_embeddings))?;
    writeln!(f, "  rope_theta = {}\n  rms_eps = {}", num(m.rope_theta), num(m.rms_eps))?;
    if let Some(y) = &m.rope_scaling {
        let opt = |k: &str, v: Option<f64>| v.map(|v| format!("  {k} = {}", num(v))).unwrap_or_default();
        writeln!(
            f,
            "  rope_scaling yarn {{ factor = {}  original_max_positions = {}  beta_fast = {}  beta_slow = {}{}{}  truncate = {} }}",
            num(y.factor),
            y.original_max_positions,
            num(y.beta_fast),
            num(y.beta_slow),
            opt("mscale", y.mscale),
            opt("mscale_all_dim", y.mscale_all_dim),
            b(y.truncate)
        )?;
    }
    if let Some(d) = m.dense {
        writeln!(f, "  dense {{ layers = {}  ffn = {} }}", d.layers, d.ffn)?;
    }
    match m.attention {
        Attention::Gqa { heads, kv_heads, head_dim, qk_norm, qk_norm_scope, rope_dim, sinks, bias } => {
            let norm = match (qk_norm, qk_norm_scope) {
                (true, QkNormScope::PerLayer) => "per_layer",
                (q, _) => b(q),
            };
            let bias = if bias.is_none() { String::new() } else { format!("  bias = {}", bias.name()) };
            writeln!(
                f,
                "  attention gqa {{ heads = {heads}  kv_heads = {kv_heads}  head_dim = {head_dim}  qk_norm = {norm}  rope_dim = {rope_dim}  sinks = {}{bias} }}",
                b(sinks)
            )?
        }
        Attention::Mla { heads, q_lora, kv_lora, qk_nope, qk_rope, v_head, indexer } => {
            let q = q_lora.map(|q| format!("  q_lora = {q}")).unwrap_or_default();
            let dsa = indexer
                .map(|i| {
                    format!("  index_heads = {}  index_head_dim = {}  index_topk = {}", i.heads, i.head_dim, i.top_k)
                })
                .unwrap_or_default();
            writeln!(
                f,
                "  attention mla {{ heads = {heads}{q}  kv_lora = {kv_lora}  qk_nope = {qk_nope}  qk_rope = {qk_rope}  v_head = {v_head}{dsa} }}"
            )?
        }
    }
    if let Some(w) = &m.sliding_window {
        let p: Vec<&str> =
            w.pattern.iter().map(|l| if *l == LayerAttn::Sliding { "sliding" } else { "full" }).collect();
        writeln!(f, "  sliding_window {{ size = {}  pattern = [{}] }}", w.size, p.join(", "))?;
    }
    let moe = &m.moe;
    writeln!(f, "  moe {{")?;
    writeln!(f, "    experts = {}\n    top_k = {}\n    expert_ffn = {}", moe.experts, moe.top_k, moe.expert_ffn)?;
    writeln!(f, "    shared_experts = {}\n    shared_ffn = {}", moe.shared_experts, moe.shared_ffn)?;
    let act = match moe.activation {
        Activation::Silu => "silu",
        Activation::SwigluOai => "swiglu_oai",
    };
    writeln!(f, "    activation = {act}")?;
    if moe.bias {
        writeln!(f, "    bias = true")?;
    }
    match moe.routing {
        Routing::SoftmaxTopk { norm_topk } => writeln!(f, "    routing softmax_topk {{ norm_topk = {} }}", b(norm_topk))?,
        Routing::SigmoidGrouped { groups, top_groups, scaling, norm_topk, bias } => writeln!(
            f,
            "    routing sigmoid_grouped {{ groups = {groups}  top_groups = {top_groups}  scaling = {}  norm_topk = {}  bias = {} }}",
            num(scaling),
            b(norm_topk),
            b(bias)
        )?,
    }
    writeln!(f, "  }}")?;
    let dt = &m.dtype;
    let scale = dt.block_scale.map(|[r, c]| format!("  block_scale = [{r}, {c}]")).unwrap_or_default();
    writeln!(
        f,
        "  dtype {{ weights = {}  experts = {}  activations = {}{scale} }}",
        dt.weights.name(),
        dt.experts.name(),
        dt.activations.name()
    )?;
    writeln!(f, "}}")
}

fn write_cluster(f: &mut Formatter<'_>, c: &Cluster) -> fmt::Result {
    let g = &c.gpu;
    writeln!(f, "cluster {} {{", c.name)?;
    writeln!(f, "  nodes = {}\n  gpus_per_node = {}", c.nodes, c.gpus_per_node)?;
    writeln!(f, "  gpu {} {{", g.name)?;
    writeln!(f, "    arch = {}\n    sms = {}\n    hbm = {}B", g.arch.name(), g.sms, g.hbm)?;
    writeln!(f, "    hbm_bandwidth = {}B/s\n    bf16 = {}FLOP/s", num(g.hbm_bandwidth), num(g.bf16_flops))?;
    if let Some(fp8) = g.fp8_flops {
        writeln!(f, "    fp8 = {}FLOP/s", num(fp8))?;
    }
    writeln!(f, "    smem_per_sm = {}B\n    smem_per_block = {}B", g.smem_per_sm, g.smem_per_block)?;
    writeln!(f, "  }}")?;
    writeln!(
        f,
        "  scale_up {} {{ bandwidth = {}B/s  latency = {}s }}",
        c.scale_up.name,
        num(c.scale_up.bandwidth),
        num(c.scale_up.latency)
    )?;
    if let Some(o) = &c.scale_out {
        writeln!(
            f,
            "  scale_out {} {{ nics_per_node = {}  bandwidth = {}B/s  latency = {}s  virtual_lanes = {} }}",
            o.name,
            o.nics_per_node,
            num(o.bandwidth),
            num(o.latency),
            o.virtual_lanes
        )?;
    }
    writeln!(f, "}}")
}

fn write_tiles(f: &mut Formatter<'_>, t: &Tiles) -> fmt::Result {
    writeln!(f, "tiles {} {{", t.name)?;
    for (name, p) in [("prefill", &t.prefill), ("decode", &t.decode)] {
        let layout = if p.layout == Layout::Contiguous { "contiguous" } else { "masked" };
        writeln!(f, "  {name} {{\n    layout = {layout}")?;
        for (op, x) in [("gate_up", &p.gate_up), ("down", &p.down)] {
            writeln!(
                f,
                "    {op} {{ block_m = {}  block_n = {}  block_k = {}  cluster = [{}, {}]  stages = {} }}",
                x.block_m, x.block_n, x.block_k, x.cluster[0], x.cluster[1], x.stages
            )?;
        }
        writeln!(f, "  }}")?;
    }
    if let Some(a) = &t.attention {
        writeln!(f, "  attention {{ block_q = {}  block_kv = {} }}", a.block_q, a.block_kv)?;
    }
    if let Some(d) = &t.dense {
        let x = &d.tile;
        writeln!(
            f,
            "  dense {{ block_m = {}  block_n = {}  block_k = {}  cluster = [{}, {}]  stages = {}  decode_block_m = {} }}",
            x.block_m, x.block_n, x.block_k, x.cluster[0], x.cluster[1], x.stages, d.decode_block_m
        )?;
    }
    writeln!(f, "}}")
}

fn write_deploy(f: &mut Formatter<'_>, spec: &Spec, d: &Deploy) -> fmt::Result {
    writeln!(f, "deploy {} {{", d.name)?;
    let name = |v: Option<&str>| v.unwrap_or("?").to_string();
    writeln!(f, "  model = {}", name(spec.models.get(d.model.index()).map(|m| m.name.as_str())))?;
    writeln!(f, "  cluster = {}", name(spec.clusters.get(d.cluster.index()).map(|c| c.name.as_str())))?;
    writeln!(f, "  tiles = {}", name(spec.tiles.get(d.tiles.index()).map(|t| t.name.as_str())))?;
    writeln!(f, "  slo {{ ttft = {}s  tpot = {}s }}", num(d.slo.ttft), num(d.slo.tpot))?;
    let w = &d.workload;
    writeln!(f, "  workload {{")?;
    writeln!(f, "    input{}\n    output{}", dist(&w.input), dist(&w.output))?;
    match w.arrival.process {
        ArrivalProcess::Poisson => writeln!(f, "    arrival poisson {{ rate = {}req/s }}", num(w.arrival.rate))?,
        ArrivalProcess::Gamma { burstiness } => writeln!(
            f,
            "    arrival gamma {{ rate = {}req/s  burstiness = {} }}",
            num(w.arrival.rate),
            num(burstiness)
        )?,
    }
    writeln!(f, "  }}")?;
    writeln!(f, "  strategy = {}", d.strategy.name())?;
    let s = &d.switch;
    let auto = |v: Option<u32>| v.map_or("auto".to_string(), |x| x.to_string());
    writeln!(
        f,
        "  switch {{ enabled = {}  t_high = {}  t_low = {}  window = {}  cooldown = {}s }}",
        b(s.enabled),
        auto(s.t_high),
        auto(s.t_low),
        s.window,
        num(s.cooldown)
    )?;
    let policy = match d.placement.policy {
        PlacementPolicy::None => "none",
        PlacementPolicy::Eplb => "eplb",
        PlacementPolicy::Zepp => "zepp",
    };
    writeln!(f, "  placement {{ policy = {policy}  redundant_experts = {} }}", d.placement.redundant_experts)?;
    writeln!(f, "  memory_fraction = {}", num(d.memory_fraction))?;
    writeln!(f, "}}")
}
