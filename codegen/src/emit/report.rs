//! `report.md`: what was planned and emitted, for a human.

use crate::nvcc::PtxasStats;
use moeforge_plan::search::Candidate;
use moeforge_plan::{KernelParams, Plan};
use std::collections::BTreeMap;
use std::fmt::Write;

fn gb(b: u64) -> String {
    format!("{:.2} GB", b as f64 / 1e9)
}

/// How the kernels were (or were not) compiled.
pub enum Toolchain<'a> {
    Compiled {
        nvcc_version: &'a str,
        stats: &'a BTreeMap<String, Vec<PtxasStats>>,
        /// Per kernel, when cuobjdump was available.
        sass: &'a BTreeMap<String, crate::nvcc::SassCounts>,
    },
    Skipped(&'a str),
}

pub fn render(plan: &Plan, model: &moeforge_dsl::spec::Model, toolchain: &Toolchain<'_>) -> String {
    let mut s = String::new();
    let m = &plan.model;
    let c = &plan.cluster;
    let l = &plan.layout;
    let _ = writeln!(s, "# moeforge report: `{}`\n", plan.deploy);
    let _ = writeln!(s, "Bundle format {} · spec hash `{}`\n", plan.format_version, plan.spec_hash);
    let _ = writeln!(s, "## Model `{}`\n", m.name);
    let _ = writeln!(s, "| | |\n|---|---|");
    let _ = writeln!(s, "| layers (MoE) | {} ({}) |", m.layers, m.moe_layers);
    let _ = writeln!(s, "| hidden | {} |", m.hidden);
    let _ = writeln!(s, "| routed experts × top-k | {} × {} (expert FFN {}) |", m.experts, m.top_k, m.expert_ffn);
    let _ = writeln!(
        s,
        "| parameters | {:.2} B total, {:.2} B active |",
        m.params_total as f64 / 1e9,
        m.params_active as f64 / 1e9
    );
    let _ = writeln!(
        s,
        "| weights | {} (experts {}, {} per expert) |",
        gb(m.weight_bytes),
        m.expert_dtype.name(),
        gb(m.expert_bytes)
    );
    let _ = writeln!(s, "| KV cache per token | {} KB |", m.kv_bytes_per_token as f64 / 1e3);
    let _ = writeln!(s, "\n## Cluster `{}`\n", c.name);
    let _ = writeln!(
        s,
        "{} node(s) × {} {} ({}, {} SMs, {} HBM) = {} GPUs\n",
        c.nodes,
        c.gpus_per_node,
        c.gpu,
        c.arch.name(),
        c.sms,
        gb(c.hbm_bytes),
        c.world
    );
    let _ = writeln!(s, "## Layout\n");
    let _ = writeln!(
        s,
        "attention `{}`, experts `{}`: {} routed experts per GPU per layer.\n",
        l.attention, l.moe, l.max_experts_per_rank
    );
    if let Some(n) = &l.note {
        let _ = writeln!(s, "> {n}\n");
    }
    roles(&mut s, plan);
    capabilities(&mut s, model);
    memory(&mut s, plan, model);
    search(&mut s, plan);
    placement(&mut s, plan);
    programs(&mut s, plan);
    let _ = writeln!(s, "\n## Kernels\n");
    match toolchain {
        Toolchain::Compiled { nvcc_version, .. } => {
            let _ = writeln!(
                s,
                "Compiled with nvcc ({nvcc_version}), flags `{}`.\n",
                crate::target::of(c.arch).nvcc_flags().join(" ")
            );
        }
        Toolchain::Skipped(why) => {
            let _ = writeln!(s, "Not compiled: {why}.\n");
        }
    }
    for k in &plan.kernels {
        let _ = writeln!(s, "### `kernels/{}.cu`: {}\n", k.name, k.purpose);
        let consts = match &k.params {
            KernelParams::Router(p) => serde_json::to_value(p),
            KernelParams::Permute(p) => serde_json::to_value(p),
            KernelParams::Apk(p) => serde_json::to_value(p),
            KernelParams::Layer(p) => serde_json::to_value(p),
            KernelParams::Zepp(p) => serde_json::to_value(p),
        };
        if let Ok(serde_json::Value::Object(map)) = consts {
            let row: Vec<String> = map.iter().map(|(k, v)| format!("{k} = {v}")).collect();
            let _ = writeln!(s, "Constants: {}\n", row.join(", "));
        }
        let stats = match toolchain {
            Toolchain::Compiled { stats, .. } => stats.get(&k.name),
            Toolchain::Skipped(_) => None,
        };
        let _ = writeln!(
            s,
            "| entry | grid × block | registers | spills (st/ld) | stack | static smem |\n|---|---|---|---|---|---|"
        );
        for e in &k.entries {
            let st = stats.and_then(|v| v.iter().find(|p| p.function == e.symbol));
            let (regs, spills, stack, smem) = match st {
                Some(p) => (
                    p.registers.to_string(),
                    format!("{}/{}", p.spill_stores, p.spill_loads),
                    p.stack_frame.to_string(),
                    p.static_smem.to_string(),
                ),
                None => ("–".into(), "–".into(), "–".into(), "–".into()),
            };
            let _ = writeln!(s, "| `{}` | {} × {} | {regs} | {spills} | {stack} | {smem} |", e.symbol, e.grid, e.block);
        }
        let _ = writeln!(s);
        let dynamic: u32 = k.entries.iter().map(|e| e.dynamic_smem).max().unwrap_or(0);
        if dynamic > 0 {
            let _ = writeln!(s, "Dynamic shared memory: {dynamic} bytes per CTA.\n");
        }
        if let Toolchain::Compiled { sass, .. } = toolchain {
            match sass.get(&k.name) {
                Some(c) => {
                    let row: Vec<String> = c.iter().filter(|(_, n)| **n > 0).map(|(f, n)| format!("{n} {f}")).collect();
                    let row = if row.is_empty() {
                        "none of the tensor-core, TMA or async-copy families".to_string()
                    } else {
                        row.join(", ")
                    };
                    let _ = writeln!(s, "SASS (cuobjdump): {row}.\n");
                }
                None => {
                    let _ = writeln!(s, "SASS not inspected: no cuobjdump and nvdisasm next to nvcc.\n");
                }
            }
        }
    }
    s
}

/// What each component of the stack can run of this model (the capability table).
fn capabilities(s: &mut String, model: &moeforge_dsl::spec::Model) {
    use moeforge_plan::caps::{refusals, Component};
    let _ = writeln!(s, "## Capabilities\n\n| component | runs this model |\n|---|---|");
    for c in Component::ALL {
        let refused: Vec<String> =
            refusals(model, c).iter().map(|(u, why)| format!("{} ({why})", u.feature.name())).collect();
        let verdict = if refused.is_empty() { "yes".to_string() } else { format!("no: {}", refused.join("; ")) };
        let _ = writeln!(s, "| {} | {verdict} |", c.name());
    }
    let _ = writeln!(s);
}

/// The memory plan section: the per-rank buffer by region (the shape of
/// Moebius's Figure 13), KV capacity per mode, the dual-mode overhead and the
/// reshard volumes with a modeled switch time.
fn memory(s: &mut String, plan: &Plan, model: &moeforge_dsl::spec::Model) {
    let mem = &plan.memory;
    let modes: Vec<&str> = mem.modes.iter().map(|m| m.name()).collect();
    let _ = writeln!(s, "## Memory plan (per rank)\n");
    let _ = writeln!(
        s,
        "One unified buffer of {} per rank ({:.0}% of {} HBM), modes [{}] over a group of {} ranks.\n",
        gb(mem.buffer_bytes),
        mem.memory_fraction * 100.0,
        gb(mem.hbm),
        modes.join(", "),
        mem.group
    );
    if let Some(r) = &mem.single_mode_reason {
        let _ = writeln!(s, "> Single-layout plan: {r}.\n");
    }
    if plan.roles.is_some() {
        let _ = writeln!(
            s,
            "Role plan: the workspace (`comm`, `scratch`, `requests`) sits at the same offsets on every GPU; \
             behind it the attention servers' regions and the MoE servers' overlay the same addresses.\n"
        );
    }
    let _ = writeln!(s, "| region | offset | bytes | modes | held by |\n|---|---|---|---|---|");
    for r in &mem.regions {
        let m: Vec<&str> = r.modes.iter().map(|m| m.name()).collect();
        let held = if r.roles.is_empty() {
            "every GPU".to_string()
        } else {
            r.roles.iter().map(|x| x.name()).collect::<Vec<_>>().join(", ")
        };
        let _ = writeln!(s, "| {} | {} | {} | {} | {held} |", r.kind.name(), r.offset, gb(r.bytes), m.join(", "));
    }
    let kv = &mem.kv;
    let _ = writeln!(s, "\nKV cache: pages of {} tokens.\n", kv.page_tokens);
    let _ = writeln!(
        s,
        "| mode | KV heads per rank | page bytes | pages per rank | tokens (group) |\n|---|---|---|---|---|"
    );
    let _ = writeln!(
        s,
        "| ep | {} | {} | {} | {} |",
        kv.ep.heads_per_rank, kv.ep.page_bytes, kv.ep.pages, kv.ep.capacity_tokens
    );
    if let Some(tp) = &kv.tp {
        let rep = if kv.replication > 1 { format!(" (each head on {} ranks)", kv.replication) } else { String::new() };
        let _ = writeln!(
            s,
            "| tp | {}{rep} | {} | {} | {} |",
            tp.heads_per_rank, tp.page_bytes, tp.pages, tp.capacity_tokens
        );
    }
    if let (Some(_), moeforge_dsl::spec::Attention::Mla { kv_lora, qk_rope, .. }) = (&kv.tp, &model.attention) {
        let _ = writeln!(
            s,
            "\nTP with MLA: each rank holds 1/{} of the query heads (their rows of `q_b_proj`/`q_proj` and `kv_b_proj`, their columns of `o_proj`); the latent cache ({kv_lora} + {qk_rope} values per token and layer) has no head axis, so every rank keeps all of it.",
            mem.group
        );
    }
    let o = &mem.overhead;
    let _ = writeln!(
        s,
        "\nDual-mode overhead: {} ({:.2}% of the buffer) of KV cache given up against the single-layout EP plan (fixed bytes: EP-only {}, TP-only {}, this plan {}).",
        gb(o.overhead_bytes),
        o.overhead_fraction * 100.0,
        gb(o.single_ep_fixed_bytes),
        gb(o.single_tp_fixed_bytes),
        gb(o.fixed_bytes)
    );
    if let Some(rs) = &mem.reshard {
        let layers = u64::from(mem.slots.moe_layers);
        let _ = writeln!(s, "\n| reshard | layer order | copies per layer | over links (all ranks) | lower bound | local | modeled time |\n|---|---|---|---|---|---|---|");
        for w in [&rs.ep_to_tp, &rs.tp_to_ep] {
            let t = plan.cost.reshard_seconds(w, mem);
            let _ = writeln!(
                s,
                "| {}→{} | {:?} | {} | {} | {} | {} | {:.0} ms |",
                w.from.name(),
                w.to.name(),
                w.order,
                w.per_layer.len(),
                gb(w.interconnect_bytes_per_layer * layers),
                gb(w.owner_changed_bytes_per_layer * layers),
                gb(w.local_bytes_per_layer * layers),
                t * 1e3
            );
        }
        let _ = writeln!(
            s,
            "\nModeled time: every rank sends its share of the bytes over links at once, on the cost model's scale-up link ({} per direction at {:.0}% efficiency, plus its fixed cost); attention switches by view swap, KV moves per live page table.",
            crate::emit::report::gbs(plan.cluster.scale_up_bandwidth),
            plan.cost.calib.nvlink_efficiency * 100.0
        );
    }
    let _ = writeln!(s);
}

pub fn gbs(b: f64) -> String {
    format!("{:.0} GB/s", b / 1e9)
}

/// The cost model and the layout search (ExpertPlex Algorithm 1).
fn search(s: &mut String, plan: &Plan) {
    let cm = &plan.cost;
    let _ = writeln!(s, "## Cost model\n");
    let _ = writeln!(s, "Source: {}. Per layer, t(x, s) = α + β·x + γ·x·s + δ·x·s² (seconds):\n", cm.source);
    let _ = writeln!(s, "| component | x, s | α | β | γ | δ |\n|---|---|---|---|---|---|");
    for (name, xs, f) in [
        ("attention, prefill", "requests, input length", &cm.attn_prefill),
        ("attention, decode", "requests, context", &cm.attn_decode),
        ("MoE GateUp+Down (all SMs)", "x_moe tiles, 1", &cm.moe),
        ("dense / shared FFN", "tokens, –", &cm.ffn),
        ("LM head", "tokens, –", &cm.head),
    ] {
        let _ = writeln!(s, "| {name} | {xs} | {:.3e} | {:.3e} | {:.3e} | {:.3e} |", f.alpha, f.beta, f.gamma, f.delta);
    }
    let _ = writeln!(
        s,
        "\nMoE beyond the fit: an active expert's first tile streams its weights ({:.3e} s on the whole GPU) when that exceeds β; every routed row moves {:.3e} s of input/output and {:.3e} s of intermediate activations (the latter sliced under TP).",
        cm.moe_expert_weights, cm.moe_row_io, cm.moe_row_mid
    );
    let _ = writeln!(s, "\nCalibrated constants (`moeforge simulate --sensitivity` moves each ±20%):\n");
    let _ = writeln!(s, "| constant | value | source |\n|---|---|---|");
    for (name, value, source) in cm.calib.entries() {
        let _ = writeln!(s, "| `{name}` | {value:.4e} | {source} |");
    }
    let _ = writeln!(s);
    let Some(r) = &plan.search else {
        let _ = writeln!(s, "Layout search: not run for strategy `{}`.\n", plan.layout.requested.name());
        return;
    };
    let _ = writeln!(s, "## Layout search (ExpertPlex Algorithm 1)\n");
    let _ = writeln!(
        s,
        "Mean input {:.0} and output {:.0} tokens; {} layouts enumerated, {} fit memory, {} (layout, q) candidates meet both SLOs.\n",
        r.mean_input, r.mean_output, r.layouts_considered, r.layouts_fitting, r.feasible
    );
    if r.ranked.is_empty() {
        let _ = writeln!(s, "> No layout meets both SLOs under the model.\n");
        return;
    }
    let _ = writeln!(s, "Attention is `dp` (one GPU per group) or `tpW` (groups of W GPUs); overlap is TBO, SBO or serial per phase (§6.3). \
        A batch marked † is capped by the KV its servers hold, not by its SLO.\n");
    let _ = writeln!(s, "| rank | MoE / prefill / decode GPUs | per node [moe, p, d] | q (SMs) | prefill attention, overlap | decode attention, overlap | B_p tokens (T_p) | B_d (T_d) | prefill req/s | decode req/s | G req/s |\n|---|---|---|---|---|---|---|---|---|---|---|");
    for (i, c) in r.ranked.iter().enumerate() {
        let nodes: Vec<String> = c.per_node.iter().map(|n| format!("[{}, {}, {}]", n[0], n[1], n[2])).collect();
        let _ = writeln!(
            s,
            "| {} | {} / {} / {} | {} | {} | {}, {} | {}, {} | {}{} ({:.0} ms) | {}{} ({:.1} ms) | {:.2} | {:.2} | {:.2} |",
            i + 1,
            c.moe_gpus,
            c.prefill_gpus,
            c.decode_gpus,
            nodes.join(" "),
            c.q,
            Candidate::attention_name(c.prefill_width),
            c.overlap.prefill.name(),
            Candidate::attention_name(c.decode_width),
            c.overlap.decode.name(),
            c.prefill_tokens,
            if c.prefill_kv_bound { "†" } else { "" },
            c.t_prefill * 1e3,
            c.decode_batch,
            if c.decode_kv_bound { "†" } else { "" },
            c.t_decode * 1e3,
            c.prefill_rate,
            c.decode_rate,
            c.goodput
        );
    }
    if !r.alternatives.is_empty() {
        let _ = writeln!(
            s,
            "\n`strategy = auto` weighed the strategies the planner realizes by Eq. 1 on the same cost model \
             (colocated: prefill-first cycles of one decode and one prefill iteration, which must fit TPOT):\n\n\
             | strategy | layout | G req/s |\n|---|---|---|"
        );
        for a in &r.alternatives {
            let _ = writeln!(s, "| {} | {} | {:.2} |", a.strategy.name(), a.label, a.goodput);
        }
    }
    match &plan.roles {
        Some(r) if r.moe_servers() => {
            let realized =
                plan.search.as_ref().and_then(|x| x.ranked.iter().position(|c| c.data_parallel())).map_or(1, |i| i + 1);
            let _ = writeln!(
                s,
                "\nRealized: the plan's roles (Layout above) are rank {realized}'s layout, its q the APK's and its overlap the one its programs run and the simulator times{}.\n",
                if realized == 1 { "" } else { " (the best layout with data-parallel attention: role plans execute no tensor-parallel attention groups yet)" }
            );
        }
        Some(_) => {
            let _ = writeln!(s, "\nRealized: `auto` chose PD disaggregation (the comparison above); the plan's instances are in Layout.\n");
        }
        _ => {
            let _ = writeln!(
                s,
                "\nAdvisory: the plan realizes the colocated layout (strategy `{}` requested; Layout above says \
                 why), so the memory plan and kernels above follow it, not rank 1.\n",
                plan.layout.requested.name()
            );
        }
    }
}

/// The realized ExpertPlex roles: each GPU's role by node, the APK's q,
/// and the communication schedule between the roles.
fn roles(s: &mut String, plan: &Plan) {
    use moeforge_plan::roles::Role;
    let Some(r) = &plan.roles else { return };
    let gpn = plan.cluster.gpus_per_node as usize;
    if r.moe_servers() {
        let _ = writeln!(
            s,
            "ExpertPlex roles, realized from the layout search's best layout (predicted goodput {:.2} req/s); \
             every MoE server's APK gives decode q = {} of {} SMs.\n",
            r.goodput, r.q, plan.cluster.sms
        );
    } else {
        let size = r.ep_groups.first().map_or(0, Vec::len);
        let _ = writeln!(
            s,
            "PD disaggregation, realized: {} whole-model instances of {size} GPUs (data-parallel attention, \
             experts striped over the instance's GPUs), {} prefill and {} decode.\n",
            r.ep_groups.len(),
            r.ep_groups
                .iter()
                .filter(|g| g.first().is_some_and(|&x| r.gpus.get(x as usize) == Some(&Role::Prefill)))
                .count(),
            r.ep_groups
                .iter()
                .filter(|g| g.first().is_some_and(|&x| r.gpus.get(x as usize) == Some(&Role::Decode)))
                .count(),
        );
    }
    let _ = writeln!(s, "| node | GPUs (local rank: role) | MoE / prefill / decode |\n|---|---|---|");
    for (n, counts) in r.per_node.iter().enumerate() {
        let gpus: Vec<String> =
            (0..gpn).filter_map(|l| r.gpus.get(n * gpn + l).map(|role| format!("{l}: {}", role.name()))).collect();
        let _ = writeln!(s, "| {n} | {} | {} / {} / {} |", gpus.join(", "), counts[0], counts[1], counts[2]);
    }
    let (attn, moe) = (r.attention_ranks(), r.ranks(Role::Moe));
    let rows_of = |role: Role| r.posts.iter().find(|p| r.gpus.get(p.src as usize) == Some(&role)).map_or(0, |p| p.rows);
    let _ = writeln!(s, "\n### Communication schedule\n");
    if !r.moe_servers() {
        let _ = writeln!(
            s,
            "- **Dispatch and combine** run within each instance, as in a colocated plan (all-to-all over its GPUs).\n\
             - **KV handoff**: after a request's prefill step its KV moves from its prefill GPU to the decode GPU \
             the request scheduler picks, page by page ({} tokens, {} bytes a page).\n",
            r.kv_handoff.page_tokens, r.kv_handoff.page_bytes
        );
        return;
    }
    let _ = writeln!(
        s,
        "- **Dispatch** (attention-initiated, one-sided): each of the {} attention ranks writes its token rows \
         into a region of every MoE rank's `dispatch` buffer reserved for it: {} rows per (prefill server, MoE) \
         pair and {} per (decode server, MoE) pair: a decode server's region holds one full decode step of it \
         (the search's B_d over the decode servers; a token sends a MoE rank at most one row), the prefill \
         servers share the rest; {} posts in all (`roles.posts`). \
         Reserved regions need no count exchange before the write, as DeepEP's low-latency mode; a source \
         sends one MoE rank at most its post's rows a round, more in rounds (each after the MoE rank \
         consumed the last).",
        attn.len(),
        rows_of(Role::Prefill),
        rows_of(Role::Decode),
        r.posts.len()
    );
    let _ = writeln!(
        s,
        "- **Combine**: the attention rank pulls its rows back from the same rows of the MoE rank's `combine` buffer."
    );
    {
        use moeforge_plan::roles::Path;
        let count = |f: &dyn Fn(&Path) -> bool| r.posts.iter().filter(|p| f(&p.path)).count();
        let prefill_direct = r
            .posts
            .iter()
            .filter(|p| r.gpus.get(p.src as usize) == Some(&Role::Prefill) && matches!(p.path, Path::Rdma { .. }))
            .count();
        let _ = writeln!(
            s,
            "- **Paths** (§5, `roles.posts[].path`): {} posts stay on NVLink; {} decode posts go straight over RDMA \
             on virtual lane 0; {} prefill posts cross once to the destination node's prefill server (the sender's \
             local rank where it is one), which forwards them over NVLink from its own `dispatch` rows and gathers \
             the combine, on a link no decode traffic uses; {prefill_direct} prefill posts go to nodes without a prefill server straight over RDMA, {}.",
            count(&|p| *p == Path::Nvlink),
            count(&|p| *p == Path::Rdma { lane: 0 }) - prefill_direct * usize::from(r.lanes < 2),
            count(&|p| matches!(p, Path::Relay { .. })),
            if r.lanes >= 2 {
                "on the lower-priority lane 1, so decode goes first where the phases share a link"
            } else {
                "sharing decode's lane (the scale-out link has one virtual lane)"
            }
        );
    }
    let _ = writeln!(
        s,
        "- **KV handoff**: after a request's prefill step its KV moves from its prefill server to the decode \
         server the request scheduler picks, page by page ({} tokens, {} bytes a page).",
        r.kv_handoff.page_tokens, r.kv_handoff.page_bytes
    );
    let _ = writeln!(s, "\n| MoE rank | posting attention ranks (first row, path) |\n|---|---|");
    for m in &moe {
        use moeforge_plan::roles::Path;
        let path = |p: &Path| match p {
            Path::Nvlink => "nvlink".to_string(),
            Path::Rdma { lane } => format!("rdma lane {lane}"),
            Path::Relay { via } => format!("via {via}"),
        };
        let from: Vec<String> = r
            .posts
            .iter()
            .filter(|p| p.dst == *m)
            .map(|p| format!("{} ({}, {})", p.src, p.first_row, path(&p.path)))
            .collect();
        let _ = writeln!(s, "| {m} | {} |", from.join(", "));
    }
    let _ = writeln!(s);
}

fn placement(s: &mut String, plan: &Plan) {
    let Some(p) = &plan.placement else { return };
    let _ = writeln!(s, "## Expert placement\n");
    let per_gpu = p.replicas.first().and_then(|l| l.first()).map_or(0, Vec::len);
    let _ = writeln!(
        s,
        "Policy `{:?}`, {} redundant replicas ({} slots per GPU), loads: {}.\n",
        p.policy, p.redundant_experts, per_gpu, p.loads
    );
    let us = |t: f64| format!("{:.1} us", t * 1e6);
    let _ = writeln!(
        s,
        "Modeled MoE layer 0 at {} tokens per GPU: no replication {}, EPLB {}, Zepp {}.\n",
        crate::passes::place::TOKENS_PER_GPU,
        p.latency_none.map_or("n/a (experts do not stripe evenly)".into(), us),
        us(p.latency_eplb),
        us(p.latency_zepp)
    );
    let routing = match p.policy {
        moeforge_dsl::spec::PlacementPolicy::Zepp => format!(
            "Zepp's locality-preferred water-filling (own GPU, then own node, then remote) and its consolidation \
             of remote requests; a replica of expert e takes at most ⌈{:.2} · rows_e / replicas_e⌉ of the \
             iteration's rows_e (slack {})",
            1.0 + p.slack,
            p.slack
        ),
        _ => "an even split of each source's rows over the replicas (no per-replica bound)".to_string(),
    };
    let _ = writeln!(
        s,
        "Realized: each GPU's EP expert views hold {per_gpu} slots per MoE layer, loaded with the replicas below \
         (every layer's table is in `plan.json` `placement.replicas`). Every iteration each dispatch routes \
         the live routed counts per (source GPU, expert) with {routing}: on the devices as \
         `kernels/zepp_route.cu` (each source counts its entries, the counts are exchanged, every source \
         with entries routes all sources' counts over the layer's replica table in the `replica_table` buffer and writes the per-expert \
         bounds and each entry's physical slot into `zepp_route`, both at fixed addresses), on the CPU \
         twin with the same routing in Rust.\n"
    );
    if !p.stats.is_empty() {
        let _ = writeln!(s, "| routing | busiest GPU / mean | rows served on the sender's node |\n|---|---|---|");
        for st in &p.stats {
            let _ = writeln!(s, "| {:?} | {:.3} | {:.3} |", st.policy, st.busiest, st.local);
        }
        let _ = writeln!(s);
    }
    if let Some(l0) = p.replicas.first() {
        let _ = writeln!(s, "Layer 0 slots per GPU (slot order):\n");
        for (g, es) in l0.iter().enumerate() {
            let list: Vec<String> = es.iter().map(u32::to_string).collect();
            let _ = writeln!(s, "- GPU {g}: {}", list.join(" "));
        }
        let _ = writeln!(s);
        replica_bounds(s, plan, p, l0);
    }
}

/// Where the routing kernel finds the replica table and writes the bounds,
/// and layer 0's replicated experts with the share of their rows each
/// replica may take.
fn replica_bounds(s: &mut String, plan: &Plan, p: &moeforge_plan::placement::PlacementPlan, l0: &[Vec<u32>]) {
    use moeforge_plan::memory::BufferName;
    let buffer = |n| plan.memory.buffers.iter().find(|b| b.name == n);
    let (Some(table), Some(route)) = (buffer(BufferName::ReplicaTable), buffer(BufferName::ZeppRoute)) else {
        return;
    };
    let experts = plan.model.experts as usize;
    let width = p.max_replicas();
    let parts = moeforge_plan::memory::ZeppRouteParts::of(
        plan.ranks.len() as u64,
        experts as u64,
        width as u64,
        moeforge_plan::memory::MAX_BATCH_TOKENS * u64::from(plan.model.top_k),
    );
    let bounds = route.offset + parts.bounds;
    let _ = writeln!(
        s,
        "On the devices the routing kernel reads each layer's replica table at a fixed address, `replica_table` \
         at {} ({} i32 per expert: its replicas' physical slots, GPUs ascending), rewritten for a layer when a \
         swap exchanges its slots, and writes every iteration's per-expert bounds at {bounds} (in `zepp_route`, \
         at {}).\n",
        table.offset, width, route.offset
    );
    let gpn = (plan.cluster.gpus_per_node as usize).max(1);
    let reps = moeforge_plan::placement::replicas_of(l0, experts);
    let replicated: Vec<(usize, &Vec<usize>)> = reps.iter().enumerate().filter(|(_, r)| r.len() > 1).collect();
    if replicated.is_empty() {
        return;
    }
    let bound = |n: usize| match p.policy {
        moeforge_dsl::spec::PlacementPolicy::Zepp => format!("≤ {:.1}%", 100.0 * (1.0 + p.slack) / n as f64),
        _ => format!("{:.1}% (even split)", 100.0 / n as f64),
    };
    let _ = writeln!(s, "Layer 0's replicated experts (of rows_e, the share one replica may take):\n");
    let _ = writeln!(s, "| expert | replicas on GPUs (node) | per replica |\n|---|---|---|");
    for (e, gpus) in replicated {
        let on: Vec<String> = gpus.iter().map(|&g| format!("{g} ({})", g / gpn)).collect();
        let _ = writeln!(s, "| {e} | {} | {} |", on.join(", "), bound(gpus.len()));
    }
    let _ = writeln!(s);
}

/// The per-rank programs: per mode and phase, the overlap, streams and the
/// ops of each block with their kernels; then which ops still lack one.
fn programs(s: &mut String, plan: &Plan) {
    use moeforge_plan::program::KernelRef;
    let _ = writeln!(s, "\n## Per-rank programs\n");
    if plan.roles.as_ref().is_some_and(moeforge_plan::roles::Roles::moe_servers) {
        let _ = writeln!(
            s,
            "ExpertPlex roles: a phase's attention servers run the `Attention` program (everything but the \
             routed experts), the MoE servers the `Moe` program of both phases (their side of each MoE layer: \
             the rows the dispatch delivers into their posts, the permutation, the APK, the combine's rows). \
             The two sides meet at the same communication ops.\n"
        );
    }
    let _ = writeln!(
        s,
        "One forward step per role, mode and phase (`plan.json` `programs`): ops on named streams, \
         ordered by events, over fixed buffer and view addresses. The validator unrolls each step \
         layer by layer and proves every read follows its write and no two streams touch the same \
         rows without an event between them.\n"
    );
    let _ = writeln!(s, "| role | mode | phase | ranks | overlap | micro-batches | streams | ops per MoE layer |\n|---|---|---|---|---|---|---|---|");
    for p in &plan.programs {
        let moe = p.blocks.iter().find(|b| b.kind == moeforge_plan::program::BlockKind::Moe).map_or(0, |b| b.ops.len());
        let _ = writeln!(
            s,
            "| {:?} | {} | {} | {} | {:?} | {} | {} | {moe} |",
            p.role,
            p.mode.name(),
            p.phase.name(),
            p.ranks.len(),
            p.overlap,
            p.micro_batches,
            p.streams.join(", ")
        );
    }
    let mut missing: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
    let mut launched: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
    for p in &plan.programs {
        for (_, op) in p.ops() {
            match &op.kernel {
                KernelRef::Missing { family } => {
                    missing.insert(family.clone());
                }
                KernelRef::Launch { instance, entry } => {
                    launched.insert(format!("{instance}::{entry}"));
                }
                KernelRef::Post { instance } => {
                    launched.insert(format!("{instance} (posted to the persistent grid)"));
                }
                KernelRef::Transfer | KernelRef::Skip { .. } => {}
            }
        }
    }
    let list =
        |v: &std::collections::BTreeSet<String>| v.iter().map(|x| format!("`{x}`")).collect::<Vec<_>>().join(", ");
    let _ = writeln!(s, "\nOps with an emitted kernel: {}.\n", list(&launched));
    if !missing.is_empty() {
        let _ = writeln!(
            s,
            "Ops whose kernel this bundle does not emit yet (the program states them; no backend can run \
             the step on a GPU until they exist): {}.\n",
            list(&missing)
        );
    }
    let _ = writeln!(
        s,
        "Where the APK runs. The dense GEMMs (projections, router, LM head, dense and \
         shared-expert FFNs) run on the `dense` instance (bf16 weights) or `dense_fp8` (fp8 e4m3 \
         weights with 128×128 block scales, dequantized to bf16 in shared memory: W8A16), the \
         APK's tiles and scheduler as a one-group GEMM, launched per operation with its shape and \
         epilogue posted (GemmArgs in plan.json). TP's MoE op \
         runs on `apk_tp` (every expert's `1/P` of the intermediate), also launched per operation: \
         in TP nothing runs beside it. EP's MoE op posts to the persistent APK; its grid holds \
         every SM, so on colocated ranks attention kernels on the same GPU would starve until it \
         is sized to the plan's SMs or launched per op (the cuda-backend issue decides with a \
         GPU's measurements)."
    );
}
