//! Memory plan pass: the unified buffer of every rank, its regions and the
//! TP and EP views (Moebius §4.2). The direct-transfer reshard descriptors
//! between the views are the `reshard` pass's.
//!
//! Dual mode is planned when the deploy enables `switch` on a single node and
//! the shapes shard evenly (experts and expert FFN by P, query heads by P, KV
//! heads by P or P by KV heads) with bf16 experts; otherwise the plan holds
//! the EP views alone and says why. It does not decide when to switch (the
//! runtime's coordinator does) nor build KV transfer descriptors (they depend
//! on live page tables; the plan gives the head ownership they are built from).

use super::{At, Ctx, PassError};
use moeforge_dsl::spec::{Attention, AttnBias, DType, Deploy, Model, QkNormScope, Routing, Spec};
use moeforge_dsl::Code;
use moeforge_plan::memory::*;
use moeforge_plan::roles::{KvHandoff, Role, Roles};
use moeforge_plan::Plan;

struct Tensor {
    role: TensorRole,
    part: TensorPart,
    shape: Vec<u64>,
    dtype: DType,
    shard: Shard,
    /// The next tensor follows with no alignment padding: one GEMM reads
    /// them as one matrix (q‖k‖v, gate‖up).
    packed: bool,
}

fn t(role: TensorRole, shape: &[u64], dtype: DType, shard: Shard) -> Tensor {
    Tensor { role, part: TensorPart::Weight, shape: shape.to_vec(), dtype, shard, packed: false }
}

/// Packs the tensors of `v` from `from` on into one matrix for one GEMM
/// (q‖k‖v, gate‖up): the parts' weights back to back, then (fp8) their block
/// scales back to back (the scales of the whole matrix when every part but
/// the last is a whole number of 128-row blocks), then their biases back to
/// back (one bias vector of the whole output).
fn pack(v: &mut [Tensor], from: usize) {
    let run = &mut v[from..];
    run.sort_by_key(|x| x.part);
    let n = run.len();
    for i in 0..n {
        run[i].packed = i + 1 < n && run[i + 1].part == run[i].part;
    }
}

/// A bias of `rows` values (bf16), laid out like its weight's rows.
fn bias(out: &mut Vec<Tensor>, role: TensorRole, rows: u64, shard: Shard) {
    out.push(Tensor { role, part: TensorPart::Bias, shape: vec![rows], dtype: DType::Bf16, shard, packed: false });
}

/// A 2-D weight and, when it is fp8, its 128×128 block scales.
fn weight(out: &mut Vec<Tensor>, role: TensorRole, rows: u64, cols: u64, m: &Model, dtype: DType, shard: Shard) {
    out.push(t(role, &[rows, cols], dtype, shard));
    if dtype == DType::Fp8E4m3 {
        let [br, bc] = m.dtype.block_scale.unwrap_or([128, 128]);
        out.push(Tensor {
            role,
            part: TensorPart::ScaleInv,
            shape: vec![rows.div_ceil(u64::from(br)), cols.div_ceil(u64::from(bc))],
            dtype: DType::F32,
            shard,
            packed: false,
        });
    }
}

/// Lays out regions and views front to back.
struct Builder {
    at: u64,
    regions: Vec<Region>,
    views: Vec<View>,
    /// The roles holding the regions laid out next (empty: every GPU).
    holders: Vec<Role>,
}

impl Builder {
    fn region(&mut self, kind: RegionKind, bytes: u64, modes: &[Mode]) -> (RegionId, u64) {
        let offset = self.at;
        let bytes = align(bytes);
        let id = RegionId(self.regions.len() as u32);
        self.regions.push(Region { kind, offset, bytes, modes: modes.to_vec(), roles: self.holders.clone() });
        self.at += bytes;
        (id, offset)
    }

    fn id(&self, kind: RegionKind) -> Option<RegionId> {
        self.regions.iter().position(|r| r.kind == kind).map(|i| RegionId(i as u32))
    }

    /// A region of per-layer tensor groups: for each group, layers `[a, b)`
    /// each hold the tensors back to back.
    fn layered(&mut self, kind: RegionKind, mode_views: &[Mode], groups: Vec<([u32; 2], Vec<Tensor>)>) {
        let start = self.at;
        let id = RegionId(self.regions.len() as u32);
        let mut off = start;
        for ([a, b], tensors) in groups {
            // A packed tensor's successor starts where its bytes end; after
            // the last of a packed run (and any other tensor) the next one
            // starts aligned.
            let mut inner = 0;
            let mut at = Vec::with_capacity(tensors.len());
            for x in &tensors {
                at.push(inner);
                inner += x.shape.iter().product::<u64>() * elt_bytes(x.dtype);
                if !x.packed {
                    inner = align(inner);
                }
            }
            let stride = inner;
            for (x, inner) in tensors.into_iter().zip(at) {
                for &mode in mode_views {
                    self.views.push(view(&x, mode, id, off + inner, [a, b], stride));
                }
            }
            off += stride * u64::from(b - a);
        }
        self.at = start;
        self.region(kind, off - start, mode_views);
    }
}

fn view(x: &Tensor, mode: Mode, region: RegionId, offset: u64, layers: [u32; 2], layer_stride: u64) -> View {
    let mut strides = vec![1u64; x.shape.len()];
    for i in (0..x.shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * x.shape[i + 1];
    }
    View {
        tensor: x.role.name(x.part),
        role: x.role,
        part: x.part,
        mode,
        region,
        offset,
        layers,
        layer_stride,
        shape: x.shape.clone(),
        strides,
        dtype: x.dtype,
        shard: x.shard,
    }
}

/// Why dual mode is not possible, if it is not.
pub(crate) fn single_mode_reason(spec: &Spec, d: &Deploy, roles: Option<&Roles>) -> Option<String> {
    let m = spec.model(d.model);
    let c = spec.cluster(d.cluster);
    let p = c.gpus_per_node;
    if !d.switch.enabled {
        return Some("the deployment does not enable `switch`".into());
    }
    // The realized layout decides, not the requested strategy: a strategy
    // that fell back to the colocated layout may switch like any other.
    match roles {
        Some(r) if r.moe_servers() => return Some(
            "ExpertPlex roles put attention and experts on different GPUs; a TP↔EP switch needs every GPU to hold both"
                .into(),
        ),
        Some(_) => {
            return Some(
                "PD instances each serve one phase in EP; TP↔EP switching is planned for colocated deployments".into(),
            )
        }
        None => {}
    }
    if c.nodes > 1 {
        return Some("TP↔EP switching is planned within one NVLink node; this cluster has several".into());
    }
    if m.dtype.experts != DType::Bf16 {
        return Some(format!("dual-mode expert slots need bf16 experts, not {}", m.dtype.experts.name()));
    }
    if m.moe.bias {
        return Some("dual-mode expert slots hold weights only; the experts' biases are not resharded".into());
    }
    if !m.moe.experts.is_multiple_of(p) || !m.moe.expert_ffn.is_multiple_of(p) {
        return Some(format!(
            "{} experts of FFN size {} do not shard evenly over {p} ranks",
            m.moe.experts, m.moe.expert_ffn
        ));
    }
    let heads_ok = match m.attention {
        Attention::Gqa { heads, kv_heads, .. } => heads % p == 0 && (kv_heads % p == 0 || p.is_multiple_of(kv_heads)),
        Attention::Mla { heads, .. } => heads % p == 0,
    };
    if !heads_ok {
        return Some(format!("the attention heads do not shard over {p} ranks"));
    }
    None
}

/// Writes `plan.memory` (its reshard descriptors are the next pass's). It
/// does not decide when to switch, nor which expert a slot holds (the
/// placement pass's replicas, or the stripes).
pub fn run(cx: &Ctx<'_>, plan: &mut Plan) -> Result<(), Vec<PassError>> {
    let (m, c, d) = (cx.model, cx.cluster, cx.deploy);
    let reason = single_mode_reason(cx.spec, d, plan.roles.as_ref());
    let dual = reason.is_none();
    let p = if dual { c.gpus_per_node } else { c.world_size() };
    let modes: Vec<Mode> = if dual { vec![Mode::Tp, Mode::Ep] } else { vec![Mode::Ep] };
    let buffer_bytes = ((c.gpu.hbm as f64 * d.memory_fraction).floor() as u64) / ALIGN * ALIGN;
    let (h, v) = (u64::from(m.hidden), u64::from(m.vocab));
    let (e, i) = (u64::from(m.moe.experts), u64::from(m.moe.expert_ffn));
    let pp = u64::from(p);
    let wdt = m.dtype.weights;
    let dense_layers = m.dense.map_or(0, |x| x.layers);
    let n = m.moe_layers();
    let all_layers = [0, m.layers];
    let moe_layers = [dense_layers, m.layers];

    let mut b = Builder { at: 0, regions: vec![], views: vec![], holders: vec![] };
    // An ExpertPlex role plan lays the workspace first, at the same offsets
    // on every GPU, and overlays the roles' own regions behind it: attention servers'
    // weights and KV pool, MoE servers' expert slots.
    let attention_roles = vec![Role::Prefill, Role::Decode];
    let role_plan = plan.roles.as_ref().is_some_and(Roles::moe_servers);
    let mut specs = Workspace::buffers(m, dual);
    // A replicated placement routes on the devices: its replica tables and
    // the routing kernel's arrays sit in the workspace at fixed addresses.
    if let Some(p) = plan.placement.as_ref().filter(|p| p.policy != moeforge_dsl::spec::PlacementPolicy::None) {
        specs.extend(Workspace::zepp_buffers(m, u64::from(c.world_size()), p.max_replicas() as u64));
    }
    let ws = Workspace::of_specs(&specs);
    let mut buffers = Vec::new();
    let mut workspace = |b: &mut Builder| {
        for (kind, bytes) in
            [(RegionKind::Comm, ws.comm), (RegionKind::Scratch, ws.scratch), (RegionKind::Requests, ws.requests)]
        {
            let (id, base) = b.region(kind, bytes, &modes);
            buffers.extend(lay_buffers(&specs, kind, id, base));
        }
    };
    if role_plan {
        workspace(&mut b);
        b.holders = attention_roles.clone();
    }
    let role_area = b.at;

    // Replicated weights: identical bytes in both modes.
    let mut global = vec![t(TensorRole::Embedding, &[v, h], DType::Bf16, Shard::Full)];
    if !m.tie_embeddings {
        global.push(t(TensorRole::LmHead, &[v, h], DType::Bf16, Shard::Full));
    }
    global.push(t(TensorRole::FinalNorm, &[h], DType::Bf16, Shard::Full));
    let norms = vec![
        t(TensorRole::InputNorm, &[h], DType::Bf16, Shard::Full),
        t(TensorRole::PostAttentionNorm, &[h], DType::Bf16, Shard::Full),
    ];
    let mut moe_rep = vec![t(TensorRole::Router, &[e, h], DType::Bf16, Shard::Full)];
    if m.moe.bias {
        bias(&mut moe_rep, TensorRole::Router, e, Shard::Full);
    }
    if let Routing::SigmoidGrouped { bias: true, .. } = m.moe.routing {
        moe_rep.push(t(TensorRole::RouterBias, &[e], DType::F32, Shard::Full));
    }
    if m.moe.shared_experts > 0 {
        let is = u64::from(m.moe.shared_experts) * u64::from(m.moe.shared_ffn);
        let sdt = m.dtype.experts;
        let at = moe_rep.len();
        weight(&mut moe_rep, TensorRole::SharedGate, is, h, m, sdt, Shard::Full);
        weight(&mut moe_rep, TensorRole::SharedUp, is, h, m, sdt, Shard::Full);
        pack(&mut moe_rep, at);
        weight(&mut moe_rep, TensorRole::SharedDown, h, is, m, sdt, Shard::Full);
    }
    let mut groups = vec![([0, 1], global), (all_layers, norms), (moe_layers, moe_rep)];
    if let Some(dl) = m.dense {
        let f = u64::from(dl.ffn);
        let mut dense = vec![];
        weight(&mut dense, TensorRole::DenseGate, f, h, m, wdt, Shard::Full);
        weight(&mut dense, TensorRole::DenseUp, f, h, m, wdt, Shard::Full);
        pack(&mut dense, 0);
        weight(&mut dense, TensorRole::DenseDown, h, f, m, wdt, Shard::Full);
        groups.push(([0, dl.layers], dense));
    }
    b.layered(RegionKind::Replicated, &modes, groups);

    // Attention: the full copy (EP, data-parallel) and, in dual mode, this
    // rank's head shard (TP). Tensors whose TP view is the full tensor alias
    // the EP copy.
    let (full, shard) = attention_tensors(m, p);
    b.layered(RegionKind::AttentionEp, &[Mode::Ep], vec![(all_layers, full)]);
    if dual {
        b.layered(RegionKind::AttentionTp, &[Mode::Tp], vec![(all_layers, shard)]);
        // Tensors with no TP shard (norms, MLA's low-rank projections) are
        // the same in both modes: the TP view aliases the EP copy.
        let sharded: Vec<(TensorRole, TensorPart)> =
            b.views.iter().filter(|x| x.mode == Mode::Tp).map(|x| (x.role, x.part)).collect();
        let ep_region = b.id(RegionKind::AttentionEp);
        let aliases: Vec<View> = b
            .views
            .iter()
            .filter(|x| Some(x.region) == ep_region && !sharded.contains(&(x.role, x.part)))
            .map(|x| View { mode: Mode::Tp, ..x.clone() })
            .collect();
        // The region's modes are those whose views point into it.
        if let (false, Some(id)) = (aliases.is_empty(), ep_region) {
            b.regions[id.index()].modes = vec![Mode::Tp, Mode::Ep];
        }
        b.views.extend(aliases);
    }

    // Expert slots: N+1 in dual mode, N otherwise.
    let elt = elt_bytes(m.dtype.experts);
    // The most experts any rank holds: the layout's stripes (the first E mod P
    // ranks one more), or the placement's slots per GPU.
    let el = u64::from(plan.layout.max_experts_per_rank);
    let w13_bytes = align(el * 2 * i * h * elt);
    let w2_bytes = align(el * h * i * elt);
    // fp8 experts carry f32 block scales after the weights (single-mode only).
    let [br, bc] = m.dtype.block_scale.unwrap_or([128, 128]).map(u64::from);
    let (s13, s2) = if m.dtype.experts == DType::Fp8E4m3 {
        // Gate and up are scaled separately: 2·⌈I/br⌉ scale rows.
        (vec![el, 2 * i.div_ceil(br), h.div_ceil(bc)], vec![el, h.div_ceil(br), i.div_ceil(bc)])
    } else {
        (vec![], vec![])
    };
    let scale_bytes = |s: &Vec<u64>| if s.is_empty() { 0 } else { align(s.iter().product::<u64>() * 4) };
    // Expert biases (GPT-OSS; single-mode only): per local expert, gate's then
    // up's intermediate columns, and the down projection's hidden ones (bf16).
    let (b13, b2) = if m.moe.bias { (vec![el, 2 * i], vec![el, h]) } else { (vec![], vec![]) };
    let bias_bytes = |s: &Vec<u64>| if s.is_empty() { 0 } else { align(s.iter().product::<u64>() * 2) };
    let slot_bytes = w13_bytes + w2_bytes + scale_bytes(&s13) + scale_bytes(&s2) + bias_bytes(&b13) + bias_bytes(&b2);
    let slot_count = u64::from(n) + u64::from(dual);
    let attention_end = b.at;
    if role_plan {
        b.at = role_area;
        b.holders = vec![Role::Moe];
    }
    let (experts, base) = b.region(RegionKind::Experts, slot_bytes * slot_count, &modes);
    let moe_end = b.at;
    if role_plan {
        b.at = attention_end;
        b.holders = attention_roles.clone();
    }
    let slots = ExpertSlots {
        region: experts,
        base,
        moe_layers: n,
        first_moe_layer: dense_layers,
        slot_bytes,
        w13_bytes,
        w2_bytes,
        tp_shift: 0,
        ep_shift: u32::from(dual),
    };
    let edt = m.dtype.experts;
    for &mode in &modes {
        let shift = if mode == Mode::Tp { slots.tp_shift } else { slots.ep_shift };
        let off = base + u64::from(shift) * slot_bytes;
        let (w13, w2, sh13, sh2) = match mode {
            Mode::Ep => (vec![el, 2 * i, h], vec![el, h, i], Shard::LocalExperts, Shard::LocalExperts),
            Mode::Tp => (
                vec![e, 2 * i / pp, h],
                vec![e, h, i / pp],
                Shard::ExpertShard { dim: 1 },
                Shard::ExpertShard { dim: 2 },
            ),
        };
        let x13 = t(TensorRole::ExpertsW13, &w13, edt, sh13);
        let x2 = t(TensorRole::ExpertsW2, &w2, edt, sh2);
        b.views.push(view(&x13, mode, experts, off, moe_layers, slot_bytes));
        b.views.push(view(&x2, mode, experts, off + w13_bytes, moe_layers, slot_bytes));
        // After the weights: fp8 block scales (f32), then biases (bf16), each w13's then w2's.
        let mut at = off + w13_bytes + w2_bytes;
        for (part, dtype, elt, (x13, x2)) in
            [(TensorPart::ScaleInv, DType::F32, 4, (&s13, &s2)), (TensorPart::Bias, DType::Bf16, 2, (&b13, &b2))]
        {
            for (role, shape) in [(TensorRole::ExpertsW13, x13), (TensorRole::ExpertsW2, x2)] {
                if shape.is_empty() {
                    continue;
                }
                let shard = Shard::LocalExperts;
                let x = Tensor { role, part, shape: shape.clone(), dtype, shard, packed: false };
                b.views.push(view(&x, mode, experts, at, moe_layers, slot_bytes));
                at += align(shape.iter().product::<u64>() * elt);
            }
        }
    }

    // Communication, scratch and request metadata: the shared workspace formula.
    if !role_plan {
        workspace(&mut b);
    }

    let fixed = b.at;
    if role_plan && moe_end > buffer_bytes {
        return Err(PassError::new(
            Code::WeightsDoNotFit,
            At::Deploy("memory_fraction".into()),
            format!(
                "deployment `{}` does not fit: each MoE server needs {:.2} GB for its {} expert slots and the workspace but the unified buffer is {:.2} GB",
                d.name,
                moe_end as f64 / 1e9,
                plan.layout.max_experts_per_rank,
                buffer_bytes as f64 / 1e9
            ),
        )
        .label("MoE servers too small")
        .help("raise `memory_fraction`, or use a cluster with more GPUs so the search can place more MoE servers")
        .into());
    }
    if fixed > buffer_bytes {
        let need = fixed as f64 / 1e9;
        let have = buffer_bytes as f64 / 1e9;
        return Err(PassError::new(
            Code::WeightsDoNotFit,
            At::Deploy("memory_fraction".into()),
            format!(
                "deployment `{}` does not fit: each GPU needs {need:.2} GB of weights and buffers but the unified buffer is {have:.2} GB ({:.0}% of {:.1} GB), {:.2} GB short",
                d.name,
                d.memory_fraction * 100.0,
                c.gpu.hbm as f64 / 1e9,
                need - have
            ),
        )
        .label("per-GPU budget too small")
        .help("raise `memory_fraction`, use a cluster with more GPUs, or a lower-precision checkpoint")
        .into());
    }
    let pool = buffer_bytes - fixed;
    let (kv_region, _) = b.region(RegionKind::KvPool, pool, &modes);
    let mut kv = kv_plan(m, p, dual, pool, kv_region);
    if let Some(r) = &plan.roles {
        // Only attention servers hold KV, each its own requests'.
        let holders = r.attention_ranks().len() as u64;
        kv.ep.capacity_tokens = holders * kv.ep.pages * u64::from(kv.page_tokens);
    }
    if kv.ep.pages == 0 {
        return Err(PassError::new(
            Code::WeightsDoNotFit,
            At::Deploy("memory_fraction".into()),
            format!(
                "deployment `{}` does not fit: {pool} bytes are left for the KV cache, one page of {} tokens needs {}",
                d.name, kv.page_tokens, kv.ep.page_bytes
            ),
        )
        .label("per-GPU budget too small")
        .help("raise `memory_fraction` or use GPUs with more HBM")
        .into());
    }
    // The pool region was aligned up; keep the buffer exact.
    if let Some(r) = b.regions.last_mut() {
        r.bytes = pool;
    }

    let bytes_of = |k: RegionKind| b.regions.iter().find(|r| r.kind == k).map_or(0, |r| r.bytes);
    let (attn_ep, attn_tp) = (bytes_of(RegionKind::AttentionEp), bytes_of(RegionKind::AttentionTp));
    let single_ep = fixed - attn_tp - if dual { slot_bytes } else { 0 };
    let aliased = aliased_bytes(&b.views, b.id(RegionKind::AttentionEp));
    let single_tp = if dual { fixed - attn_ep + aliased - slot_bytes } else { single_ep };
    let overhead_bytes = fixed - single_ep;
    let overhead = DualModeOverhead {
        fixed_bytes: fixed,
        single_ep_fixed_bytes: single_ep,
        single_tp_fixed_bytes: single_tp,
        overhead_bytes,
        overhead_fraction: overhead_bytes as f64 / buffer_bytes as f64,
    };
    plan.memory = MemoryPlan {
        hbm: c.gpu.hbm,
        memory_fraction: d.memory_fraction,
        buffer_bytes,
        modes,
        group: p,
        single_mode_reason: reason,
        max_batch_tokens: MAX_BATCH_TOKENS,
        max_requests: MAX_REQUESTS,
        regions: b.regions,
        views: b.views,
        slots,
        kv,
        reshard: None,
        overhead,
        buffers,
    };
    if let Some(roles) = plan.roles.as_mut() {
        let mem = &plan.memory;
        if let (true, Some(d)) = (roles.moe_servers(), mem.buffer(Mode::Ep, BufferName::Dispatch)) {
            // Requests one decode server steps: the realized search candidate's B_d over its decode servers.
            let decode_tokens = plan
                .search
                .as_ref()
                .and_then(|s| s.realizable())
                .map_or(1.0, |b| f64::from(b.decode_batch) / f64::from(b.decode_gpus.max(1)));
            roles.posts =
                Roles::posts(&roles.gpus, c.gpus_per_node, roles.lanes, decode_tokens, (d.rows, d.row_bytes, d.offset));
        }
        roles.kv_handoff = KvHandoff { page_tokens: mem.kv.page_tokens, page_bytes: mem.kv.ep.page_bytes };
    }
    Ok(())
}
/// Bytes of the TP views that alias the EP attention copy (a single TP plan
/// would need its own copy of them).
fn aliased_bytes(views: &[View], attention_ep: Option<RegionId>) -> u64 {
    views
        .iter()
        .filter(|x| x.mode == Mode::Tp && Some(x.region) == attention_ep)
        .map(|x| align(x.bytes()) * u64::from(x.layers[1] - x.layers[0]))
        .sum()
}

/// (EP full copy, TP shard) of one layer's attention tensors.
fn attention_tensors(m: &Model, p: u32) -> (Vec<Tensor>, Vec<Tensor>) {
    let h = u64::from(m.hidden);
    let pp = u64::from(p);
    let wdt = m.dtype.weights;
    let q = Shard::Heads { dim: 0, heads: HeadSet::Query };
    let kvs = Shard::Heads { dim: 0, heads: HeadSet::Kv };
    let cols = Shard::Heads { dim: 1, heads: HeadSet::Query };
    let (mut full, mut shard) = (vec![], vec![]);
    match m.attention {
        Attention::Gqa { heads, kv_heads, head_dim, qk_norm, qk_norm_scope, sinks, bias: ab, .. } => {
            let (nh, nkv, d) = (u64::from(heads), u64::from(kv_heads), u64::from(head_dim));
            let kv_local = (nkv / pp).max(1);
            let (qkv_bias, o_bias) = (ab != AttnBias::None, ab == AttnBias::All);
            weight(&mut full, TensorRole::QProj, nh * d, h, m, wdt, Shard::Full);
            weight(&mut full, TensorRole::KProj, nkv * d, h, m, wdt, Shard::Full);
            weight(&mut full, TensorRole::VProj, nkv * d, h, m, wdt, Shard::Full);
            if qkv_bias {
                bias(&mut full, TensorRole::QProj, nh * d, Shard::Full);
                bias(&mut full, TensorRole::KProj, nkv * d, Shard::Full);
                bias(&mut full, TensorRole::VProj, nkv * d, Shard::Full);
            }
            pack(&mut full, 0);
            weight(&mut full, TensorRole::OProj, h, nh * d, m, wdt, Shard::Full);
            // o_proj's bias is whole in both modes (TP's view aliases this one;
            // TP adds it once).
            if o_bias {
                bias(&mut full, TensorRole::OProj, h, Shard::Full);
            }
            weight(&mut shard, TensorRole::QProj, nh / pp * d, h, m, wdt, q);
            weight(&mut shard, TensorRole::KProj, kv_local * d, h, m, wdt, kvs);
            weight(&mut shard, TensorRole::VProj, kv_local * d, h, m, wdt, kvs);
            if qkv_bias {
                bias(&mut shard, TensorRole::QProj, nh / pp * d, q);
                bias(&mut shard, TensorRole::KProj, kv_local * d, kvs);
                bias(&mut shard, TensorRole::VProj, kv_local * d, kvs);
            }
            pack(&mut shard, 0);
            weight(&mut shard, TensorRole::OProj, h, nh / pp * d, m, wdt, cols);
            if qk_norm {
                // Per head: one vector shared by the heads; per layer: over the whole projection.
                let (qn, kn) = match qk_norm_scope {
                    QkNormScope::PerHead => (d, d),
                    QkNormScope::PerLayer => (nh * d, nkv * d),
                };
                full.push(t(TensorRole::QNorm, &[qn], DType::Bf16, Shard::Full));
                full.push(t(TensorRole::KNorm, &[kn], DType::Bf16, Shard::Full));
            }
            if sinks {
                full.push(t(TensorRole::Sinks, &[nh], DType::Bf16, Shard::Full));
                shard.push(t(TensorRole::Sinks, &[nh / pp], DType::Bf16, q));
            }
        }
        Attention::Mla { heads, q_lora, kv_lora, qk_nope, qk_rope, v_head, indexer } => {
            let (nh, kl, nope, rope, vh) =
                (u64::from(heads), u64::from(kv_lora), u64::from(qk_nope), u64::from(qk_rope), u64::from(v_head));
            match q_lora {
                Some(ql) => {
                    let ql = u64::from(ql);
                    weight(&mut full, TensorRole::QAProj, ql, h, m, wdt, Shard::Full);
                    full.push(t(TensorRole::QANorm, &[ql], DType::Bf16, Shard::Full));
                    weight(&mut full, TensorRole::QBProj, nh * (nope + rope), ql, m, wdt, Shard::Full);
                    weight(&mut shard, TensorRole::QBProj, nh / pp * (nope + rope), ql, m, wdt, q);
                }
                None => {
                    weight(&mut full, TensorRole::QProj, nh * (nope + rope), h, m, wdt, Shard::Full);
                    weight(&mut shard, TensorRole::QProj, nh / pp * (nope + rope), h, m, wdt, q);
                }
            }
            weight(&mut full, TensorRole::KvAProj, kl + rope, h, m, wdt, Shard::Full);
            full.push(t(TensorRole::KvANorm, &[kl], DType::Bf16, Shard::Full));
            weight(&mut full, TensorRole::KvBProj, nh * (nope + vh), kl, m, wdt, Shard::Full);
            weight(&mut full, TensorRole::OProj, h, nh * vh, m, wdt, Shard::Full);
            weight(&mut shard, TensorRole::KvBProj, nh / pp * (nope + vh), kl, m, wdt, q);
            weight(&mut shard, TensorRole::OProj, h, nh / pp * vh, m, wdt, cols);
            // The DSA indexer: small, whole on every rank in both modes.
            if let Some(ix) = indexer {
                let (ih, id) = (u64::from(ix.heads), u64::from(ix.head_dim));
                let q_in = q_lora.map_or(h, u64::from);
                weight(&mut full, TensorRole::IndexerQ, ih * id, q_in, m, wdt, Shard::Full);
                weight(&mut full, TensorRole::IndexerK, id, h, m, wdt, Shard::Full);
                full.push(t(TensorRole::IndexerKNorm, &[2, id], DType::Bf16, Shard::Full));
                full.push(t(TensorRole::IndexerWeights, &[ih, h], DType::Bf16, Shard::Full));
            }
        }
    }
    (full, shard)
}

fn kv_plan(m: &Model, p: u32, dual: bool, pool: u64, region: RegionId) -> KvPlan {
    let layers = u64::from(m.layers);
    let page = u64::from(PAGE_TOKENS);
    let (kv_heads, head_token_bytes) = match m.attention {
        Attention::Gqa { kv_heads, head_dim, .. } => (kv_heads, 2 * u64::from(head_dim) * 2),
        // MLA caches one latent (kv_lora + rope) per token, and the DSA
        // indexer its key; neither can be split by head.
        Attention::Mla { .. } => (1, m.kv_bytes_per_token_layer()),
    };
    let mode = |heads: u32, ranks_holding_own: u64| {
        let page_bytes = layers * u64::from(heads) * page * head_token_bytes;
        let pages = pool / page_bytes.max(1);
        KvMode { heads_per_rank: heads, page_bytes, pages, capacity_tokens: ranks_holding_own * pages * page }
    };
    let ep = mode(kv_heads, u64::from(p));
    let (tp_local, replication, heads) = tp_kv_heads(kv_heads, p);
    let tp_heads = if dual { heads } else { vec![] };
    KvPlan {
        region,
        page_tokens: PAGE_TOKENS,
        head_token_bytes,
        ep,
        tp: dual.then(|| mode(tp_local, 1)),
        tp_heads,
        replication: if dual { replication } else { 1 },
    }
}

/// The buffers of region `kind` at fixed offsets from `base`: those both
/// modes use first, then EP's and TP's alike from the same offset (a rank
/// runs one mode at a time, so their communication slots alias).
fn lay_buffers(specs: &[BufferSpec], kind: RegionKind, region: RegionId, base: u64) -> Vec<Buffer> {
    let mut out = Vec::new();
    let mut at = base;
    let mut place = |at: &mut u64, s: &BufferSpec| {
        out.push(Buffer { name: s.name, region, modes: s.modes, offset: *at, rows: s.rows, row_bytes: s.row_bytes });
        *at += align(s.rows * s.row_bytes);
    };
    for s in specs.iter().filter(|s| s.region == kind && s.modes == BufferModes::Both) {
        place(&mut at, s);
    }
    let shared_end = at;
    for only in [BufferModes::Ep, BufferModes::Tp] {
        let mut at = shared_end;
        for s in specs.iter().filter(|s| s.region == kind && s.modes == only) {
            place(&mut at, s);
        }
    }
    out
}
