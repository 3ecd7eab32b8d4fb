//! The CPU twin: a real MoE decoder running on P simulated ranks over a
//! bundle's memory plan, switching TP↔EP live (Moebius §3, §4).
//!
//! Every rank owns one unified buffer of the plan's size; every weight and
//! KV-cache byte lives in it and is reached only through the plan's views
//! (weights) and KV page layout. Ranks compute in parallel (one thread each
//! per phase); collectives run between phases in a fixed order, so every run
//! is deterministic:
//!
//! - EP (DP attention + EP experts): a rank runs attention for its own
//!   requests with full heads, routes its tokens, dispatches each (token, k)
//!   to the expert's owner (all-to-all), and combines the returned outputs in
//!   k order.
//! - TP: every rank runs every request with its head shard and its `1/P`
//!   slice of every expert; partial outputs are all-reduced in rank order.
//!
//! A switch pauses between steps. Expert weights move by executing the
//! plan's reshard descriptors layer by layer in the plan's order, in place in
//! the N+1 slots; attention switches by view; requests move as §3.2 says
//! (metadata all-gather on EP→TP, longest-first to least-loaded on TP→EP,
//! waiting requests carry nothing); KV moves head by head from live page
//! tables through a staging copy (gather, exchange, scatter: the three-stage
//! path of §3.2) into pages allocated in the target format. The staging is
//! host memory outside the unified buffers; a device implementation would
//! instead allocate target pages outside the live source pages and write
//! them directly (§4.3), which this twin does not model. The capacity check
//! uses the requests' full reservations (prompt + max_new), which is
//! conservative against §4.5's live-token check. Activations are process
//! memory, not views.
//!
//! MLA attention, sliding windows, sinks and non-bf16 weights are rejected.

pub mod coordinator;
pub mod dense;
pub mod math;
pub mod weights;

use crate::reference::{route, RoutingRule};
use crate::LoadedBundle;
use coordinator::{Coordinator, Policy};
use math::{argmax, attend, bf16s, put_bf16s, rms_norm, rope, silu, Mat};
use moeforge_dsl::spec::{Attention, Model, Routing};
use moeforge_plan::caps;
use moeforge_plan::memory::{Copy, LayerOrder, MemoryPlan, Mode, RegionKind, TensorRole, View, WeightReshard};
use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;
use weights::Checkpoint;

/// The model shape the twin computes, derived from the spec.
#[derive(Clone, Debug, PartialEq)]
pub struct TwinModel {
    pub layers: usize,
    pub hidden: usize,
    pub vocab: usize,
    pub dense_layers: usize,
    pub dense_ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub qk_norm: bool,
    pub rope_dim: usize,
    pub rope_theta: f64,
    pub rms_eps: f64,
    pub tie_embeddings: bool,
    pub experts: usize,
    pub top_k: usize,
    pub expert_ffn: usize,
    /// Shared experts merged into one FFN of this size (0: none).
    pub shared_ffn: usize,
    pub routing: Routing,
}

impl TwinModel {
    pub fn from_spec(m: &Model) -> Result<TwinModel, String> {
        let refused = caps::refusals(m, caps::Component::CpuTwin);
        if !refused.is_empty() {
            let why: Vec<String> = refused.iter().map(|(u, why)| format!("{} ({why})", u.feature.name())).collect();
            return Err(format!("the CPU twin cannot run `{}`: it uses {}", m.name, why.join(", ")));
        }
        let Attention::Gqa { heads, kv_heads, head_dim, qk_norm, rope_dim, .. } = m.attention else {
            return Err(format!("the CPU twin cannot run `{}`: it uses MLA attention", m.name));
        };
        Ok(TwinModel {
            layers: m.layers as usize,
            hidden: m.hidden as usize,
            vocab: m.vocab as usize,
            dense_layers: m.dense.map_or(0, |d| d.layers as usize),
            dense_ffn: m.dense.map_or(0, |d| d.ffn as usize),
            heads: heads as usize,
            kv_heads: kv_heads as usize,
            head_dim: head_dim as usize,
            qk_norm,
            rope_dim: rope_dim as usize,
            rope_theta: m.rope_theta,
            rms_eps: m.rms_eps,
            tie_embeddings: m.tie_embeddings,
            experts: m.moe.experts as usize,
            top_k: m.moe.top_k as usize,
            expert_ffn: m.moe.expert_ffn as usize,
            shared_ffn: (m.moe.shared_experts * m.moe.shared_ffn) as usize,
            routing: m.moe.routing,
        })
    }

    pub fn selection_bias(&self) -> bool {
        matches!(self.routing, Routing::SigmoidGrouped { bias: true, .. })
    }

    /// Every checkpoint tensor (canonical names) and its shape.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, d) = (self.hidden, self.head_dim);
        let mut v = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab, h])];
        if !self.tie_embeddings {
            v.push(("lm_head.weight".into(), vec![self.vocab, h]));
        }
        v.push(("model.norm.weight".into(), vec![h]));
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            v.push((format!("{p}.input_layernorm.weight"), vec![h]));
            v.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            v.push((format!("{p}.self_attn.q_proj.weight"), vec![self.heads * d, h]));
            v.push((format!("{p}.self_attn.k_proj.weight"), vec![self.kv_heads * d, h]));
            v.push((format!("{p}.self_attn.v_proj.weight"), vec![self.kv_heads * d, h]));
            v.push((format!("{p}.self_attn.o_proj.weight"), vec![h, self.heads * d]));
            if self.qk_norm {
                v.push((format!("{p}.self_attn.q_norm.weight"), vec![d]));
                v.push((format!("{p}.self_attn.k_norm.weight"), vec![d]));
            }
            let ffn = |v: &mut Vec<(String, Vec<usize>)>, pre: &str, f: usize| {
                v.push((format!("{pre}.gate_proj.weight"), vec![f, h]));
                v.push((format!("{pre}.up_proj.weight"), vec![f, h]));
                v.push((format!("{pre}.down_proj.weight"), vec![h, f]));
            };
            if l < self.dense_layers {
                ffn(&mut v, &format!("{p}.mlp"), self.dense_ffn);
            } else {
                v.push((format!("{p}.mlp.gate.weight"), vec![self.experts, h]));
                if self.selection_bias() {
                    v.push((format!("{p}.mlp.gate.e_score_correction_bias"), vec![self.experts]));
                }
                for e in 0..self.experts {
                    ffn(&mut v, &format!("{p}.mlp.experts.{e}"), self.expert_ffn);
                }
                if self.shared_ffn > 0 {
                    ffn(&mut v, &format!("{p}.mlp.shared_experts"), self.shared_ffn);
                }
            }
        }
        v
    }
}

/// A request as the engine tracks it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_new: usize,
    pub generated: Vec<u32>,
    /// Tokens whose KV is cached.
    pub cached: usize,
}

impl Request {
    pub fn new(id: u64, prompt: Vec<u32>, max_new: usize) -> Request {
        Request { id, prompt, max_new, generated: vec![], cached: 0 }
    }
    fn len(&self) -> usize {
        self.prompt.len() + self.generated.len()
    }
    fn token(&self, i: usize) -> u32 {
        if i < self.prompt.len() {
            self.prompt[i]
        } else {
            self.generated[i - self.prompt.len()]
        }
    }
    /// Tokens the finished request will have cached (its KV reservation).
    fn reserve(&self) -> usize {
        self.prompt.len() + self.max_new
    }
    pub fn done(&self) -> bool {
        self.generated.len() >= self.max_new
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TwinError {
    #[error("{0}")]
    Unsupported(String),
    #[error(transparent)]
    Weights(#[from] weights::WeightsError),
    #[error("the plan holds no `{0}` view for `{1}`")]
    MissingView(&'static str, String),
    #[error("the twin would allocate {need} bytes for {ranks} rank buffers, above the limit of {limit}; compile a spec with a small `hbm` for the CPU twin")]
    TooLarge { need: u64, ranks: u32, limit: u64 },
    #[error("the plan holds no {0:?} mode")]
    NoMode(Mode),
    #[error("token {token} is outside the vocabulary of {vocab}")]
    Token { token: u32, vocab: usize },
    #[error("request {0} needs more KV cache than one rank has")]
    TooLong(u64),
    #[error("{0}")]
    Request(String),
}

/// A page allocator over one rank's KV pool in one page format.
#[derive(Clone, Debug)]
struct Pages {
    free: VecDeque<u32>,
    total: u32,
}

impl Pages {
    fn new(total: u64) -> Pages {
        let total = total.min(u64::from(u32::MAX)) as u32;
        Pages { free: (0..total).collect(), total }
    }
}

/// One simulated GPU.
struct Rank {
    id: usize,
    buf: Vec<u8>,
    pages: Pages,
    /// Page table per request held by this rank.
    tables: BTreeMap<u64, Vec<u32>>,
    /// Requests this rank serves (EP: its own; TP: every running request).
    requests: Vec<u64>,
}

/// A switch that happened, or was cancelled.
#[derive(Clone, Debug, PartialEq)]
pub struct SwitchEvent {
    pub step: usize,
    pub from: Mode,
    pub to: Mode,
    pub inflight: usize,
    /// `None` when done; the reason when cancelled.
    pub cancelled: Option<String>,
    pub weight_bytes_moved: u64,
    pub kv_bytes_moved: u64,
    pub seconds: f64,
}

/// What one step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    pub step: usize,
    pub mode: Mode,
    pub running: usize,
    pub tokens: usize,
    pub seconds: f64,
}

/// The twin engine.
pub struct Twin {
    pub model: TwinModel,
    plan: MemoryPlan,
    views: BTreeMap<(Mode, String), View>,
    ranks: Vec<Rank>,
    mode: Mode,
    requests: BTreeMap<u64, Request>,
    waiting: VecDeque<u64>,
    finished: Vec<u64>,
    /// Logits behind every generated token, per request (kept for tests).
    pub logits: BTreeMap<u64, Vec<Vec<f32>>>,
    pub keep_logits: bool,
    coordinator: Option<Coordinator>,
    pub events: Vec<SwitchEvent>,
    pub steps: Vec<StepRecord>,
    step: usize,
    clock: Clock,
}

/// Time as the switch policy sees it.
#[derive(Clone, Copy, Debug)]
pub enum Clock {
    Wall(Instant),
    /// Each step advances time by this many seconds (deterministic tests).
    Logical {
        step_seconds: f64,
    },
}

/// Largest total of rank buffers the twin allocates.
pub const MAX_TWIN_BYTES: u64 = 16 << 30;

impl Twin {
    /// Builds the ranks from a verified bundle, loads the checkpoint through
    /// the views of `start` (experts) and both modes (attention, replicated).
    pub fn new(bundle: &LoadedBundle, ck: &Checkpoint, start: Mode) -> Result<Twin, TwinError> {
        let spec = &bundle.spec;
        let m = spec.models.first().ok_or_else(|| TwinError::Unsupported("the bundle's spec has no model".into()))?;
        let model = TwinModel::from_spec(m).map_err(TwinError::Unsupported)?;
        let plan = bundle.plan.memory.clone();
        if !plan.modes.contains(&start) {
            return Err(TwinError::NoMode(start));
        }
        let need = plan.buffer_bytes * u64::from(plan.group);
        if need > MAX_TWIN_BYTES {
            return Err(TwinError::TooLarge { need, ranks: plan.group, limit: MAX_TWIN_BYTES });
        }
        if model.experts % plan.group as usize != 0 {
            return Err(TwinError::Unsupported(format!(
                "{} experts do not split evenly over {} ranks; the CPU twin needs E mod P = 0",
                model.experts, plan.group
            )));
        }
        ck.validate(&model)?;
        let views: BTreeMap<(Mode, String), View> =
            plan.views.iter().map(|v| ((v.mode, v.tensor.clone()), v.clone())).collect();
        // Every tensor the forward pass reads must have a view in every mode.
        for mode in &plan.modes {
            for name in required_views(&model) {
                if !views.contains_key(&(*mode, name.clone())) {
                    return Err(TwinError::MissingView(mode.name(), name));
                }
            }
        }
        let pages = kv_pages(&plan, start);
        let ranks = (0..plan.group as usize)
            .map(|id| Rank {
                id,
                buf: vec![0u8; plan.buffer_bytes as usize],
                pages: Pages::new(pages),
                tables: BTreeMap::new(),
                requests: vec![],
            })
            .collect();
        let deploy = spec.deploys.first();
        let coordinator = deploy
            .filter(|d| d.switch.enabled && plan.modes.len() == 2)
            .map(|d| Coordinator::new(Policy::from_spec(&d.switch)));
        let mut twin = Twin {
            model,
            plan,
            views,
            ranks,
            mode: start,
            requests: BTreeMap::new(),
            waiting: VecDeque::new(),
            finished: vec![],
            logits: BTreeMap::new(),
            keep_logits: false,
            coordinator,
            events: vec![],
            steps: vec![],
            step: 0,
            clock: Clock::Wall(Instant::now()),
        };
        twin.load(ck)?;
        Ok(twin)
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }
    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }
    pub fn set_clock(&mut self, clock: Clock) {
        self.clock = clock;
    }
    /// Replaces the spec's switch policy (`None`: switch only when asked).
    pub fn set_policy(&mut self, policy: Option<Policy>) {
        self.coordinator = policy.map(Coordinator::new);
    }
    pub fn policy(&self) -> Option<&Policy> {
        self.coordinator.as_ref().map(|c| &c.policy)
    }
    pub fn request(&self, id: u64) -> Option<&Request> {
        self.requests.get(&id)
    }
    pub fn finished(&self) -> &[u64] {
        &self.finished
    }
    /// Requests admitted and not finished.
    pub fn inflight(&self) -> usize {
        self.requests.len() - self.finished.len()
    }
    pub fn idle(&self) -> bool {
        self.inflight() == 0
    }

    /// The bytes of `tensor` (a view name with `{l}`) at layer `layer` as
    /// rank `rank` holds them in `mode`'s view, for inspection and tests.
    pub fn view_bytes(&self, rank: usize, mode: Mode, tensor: &str, layer: u32) -> Option<&[u8]> {
        let v = self.views.get(&(mode, tensor.to_string())).filter(|v| v.covers(layer))?;
        let at = v.offset_of(layer) as usize;
        self.ranks.get(rank)?.buf.get(at..at + v.bytes() as usize)
    }

    fn view(&self, mode: Mode, name: &str) -> Result<&View, TwinError> {
        self.views.get(&(mode, name.to_string())).ok_or_else(|| TwinError::MissingView(mode.name(), name.to_string()))
    }

    // ───────────────────────── loading ─────────────────────────

    /// Writes every tensor into the views that hold it: replicated and both
    /// attention layouts in every plan mode, experts in the starting mode.
    fn load(&mut self, ck: &Checkpoint) -> Result<(), TwinError> {
        let m = self.model.clone();
        let p = self.plan.group as usize;
        let views: Vec<View> = self.plan.views.clone();
        for v in &views {
            // TP views of full attention tensors alias the EP copy: written once.
            let region = self.plan.regions.get(v.region.index()).map(|r| r.kind);
            if v.mode == Mode::Tp && region == Some(RegionKind::AttentionEp) {
                continue;
            }
            if v.role.is_routed_expert() && v.mode != self.mode {
                continue;
            }
            for l in v.layers[0]..v.layers[1] {
                let name = v.tensor.replace("{l}", &l.to_string());
                for r in 0..p {
                    let bytes = self.slice_for(ck, &m, v, &name, l as usize, r)?;
                    if bytes.len() as u64 != v.bytes() {
                        return Err(TwinError::Unsupported(format!(
                            "`{name}` is {} bytes in the checkpoint's layout but its {} view holds {}",
                            bytes.len(),
                            v.mode.name(),
                            v.bytes()
                        )));
                    }
                    let at = v.offset_of(l) as usize;
                    self.ranks[r].buf[at..at + bytes.len()].copy_from_slice(&bytes);
                }
            }
        }
        Ok(())
    }

    /// The bytes view `v` holds on rank `r` for layer `l`.
    fn slice_for(
        &self,
        ck: &Checkpoint,
        m: &TwinModel,
        v: &View,
        name: &str,
        l: usize,
        r: usize,
    ) -> Result<Vec<u8>, TwinError> {
        use moeforge_plan::memory::{HeadSet, Shard};
        let p = self.plan.group as usize;
        let rows = |t: &weights::Tensor, a: usize, b: usize| {
            let w = t.shape.get(1).copied().unwrap_or(1) * if t.f32 { 4 } else { 2 };
            t.data[a * w..b * w].to_vec()
        };
        let shape = |v: &View| v.shape.iter().map(|&x| x as usize).collect::<Vec<_>>();
        Ok(match v.shard {
            Shard::Full => ck.get(name, &shape(v))?.data.clone(),
            Shard::Heads { dim, heads } => {
                let hd = m.head_dim;
                let [a, b] = match heads {
                    HeadSet::Query => moeforge_plan::memory::head_block(m.heads as u32, p as u32, r as u32),
                    HeadSet::Kv => self.plan.kv.tp_heads[r],
                };
                let (a, b) = (a as usize * hd, b as usize * hd);
                let full_shape: Vec<usize> = match v.role {
                    TensorRole::OProj => vec![m.hidden, m.heads * hd],
                    TensorRole::KProj | TensorRole::VProj => vec![m.kv_heads * hd, m.hidden],
                    _ => vec![m.heads * hd, m.hidden],
                };
                let t = ck.get(name, &full_shape)?;
                if dim == 0 {
                    rows(t, a, b)
                } else {
                    let cols = full_shape[1];
                    (0..full_shape[0])
                        .flat_map(|row| t.data[2 * (row * cols + a)..2 * (row * cols + b)].to_vec())
                        .collect()
                }
            }
            Shard::LocalExperts | Shard::ExpertShard { .. } => {
                let (e, i, h) = (m.experts, m.expert_ffn, m.hidden);
                let layer_pre = format!("model.layers.{l}.mlp.experts");
                let w13 = v.role == TensorRole::ExpertsW13;
                let mut out = Vec::with_capacity(v.bytes() as usize);
                let (experts, slice): (Vec<usize>, (usize, usize)) = match v.shard {
                    Shard::LocalExperts => ((r * e / p..(r + 1) * e / p).collect(), (0, i)),
                    _ => ((0..e).collect(), (r * i / p, (r + 1) * i / p)),
                };
                for g in experts {
                    if w13 {
                        for part in ["gate_proj", "up_proj"] {
                            let t = ck.get(&format!("{layer_pre}.{g}.{part}.weight"), &[i, h])?;
                            out.extend(rows(t, slice.0, slice.1));
                        }
                    } else {
                        let t = ck.get(&format!("{layer_pre}.{g}.down_proj.weight"), &[h, i])?;
                        for row in 0..h {
                            out.extend_from_slice(&t.data[2 * (row * i + slice.0)..2 * (row * i + slice.1)]);
                        }
                    }
                }
                out
            }
        })
    }

    // ───────────────────────── requests ─────────────────────────

    /// Queues a request; it is admitted when KV pages are free.
    pub fn submit(&mut self, req: Request) -> Result<(), TwinError> {
        if self.requests.contains_key(&req.id) {
            return Err(TwinError::Request(format!("request id {} is already in use", req.id)));
        }
        if req.max_new == 0 {
            return Err(TwinError::Request(format!("request {} asks for no tokens (max_new = 0)", req.id)));
        }
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= self.model.vocab) {
            return Err(TwinError::Token { token: t, vocab: self.model.vocab });
        }
        let page = self.plan.kv.page_tokens as usize;
        let ep_pages = self.plan.kv.ep.pages as usize;
        let tp_pages = self.plan.kv.tp.as_ref().map_or(usize::MAX, |t| t.pages as usize);
        if req.reserve().div_ceil(page) > ep_pages.min(tp_pages) || req.prompt.is_empty() {
            return Err(TwinError::TooLong(req.id));
        }
        self.waiting.push_back(req.id);
        self.requests.insert(req.id, req);
        Ok(())
    }

    fn pages_needed(&self, id: u64) -> usize {
        self.requests[&id].reserve().div_ceil(self.plan.kv.page_tokens as usize)
    }

    /// Pages reserved on a rank by the requests it serves.
    fn reserved(&self, r: &Rank) -> usize {
        r.requests.iter().map(|id| self.pages_needed(*id)).sum()
    }

    /// Admits waiting requests by the shared rule ([`crate::batching`]):
    /// in arrival order while their full KV reservation fits.
    fn admit(&mut self) {
        let mut waiting = std::mem::take(&mut self.waiting);
        crate::batching::admit_fifo(&mut waiting, |id| self.place(id));
        self.waiting = waiting;
    }

    /// Places one request if its reservation fits: EP on the least-loaded
    /// rank with room, TP on every rank.
    fn place(&mut self, id: u64) -> bool {
        let need = self.pages_needed(id);
        let room = |r: &Rank| self.reserved(r) + need <= r.pages.total as usize;
        match self.mode {
            Mode::Tp => {
                if !self.ranks.iter().all(room) {
                    return false;
                }
                self.ranks.iter_mut().for_each(|r| r.requests.push(id));
            }
            Mode::Ep => {
                let best = (0..self.ranks.len())
                    .filter(|&r| room(&self.ranks[r]))
                    .min_by_key(|&r| (self.load_tokens(r), self.ranks[r].requests.len(), r));
                let Some(r) = best else { return false };
                self.ranks[r].requests.push(id);
            }
        }
        true
    }

    fn load_tokens(&self, r: usize) -> usize {
        self.ranks[r].requests.iter().map(|id| self.requests[id].len()).sum()
    }

    // ───────────────────────── stepping ─────────────────────────

    fn now(&self) -> f64 {
        match self.clock {
            Clock::Wall(t0) => t0.elapsed().as_secs_f64(),
            Clock::Logical { step_seconds } => self.step as f64 * step_seconds,
        }
    }

    /// One iteration: consult the switch policy, admit, run one forward step
    /// over every running request (its whole prompt on its first step, one
    /// token after), append greedy tokens, retire finished requests.
    pub fn step(&mut self) -> Result<(), TwinError> {
        let (inflight, now, mode) = (self.inflight(), self.now(), self.mode);
        if let Some(target) = self.coordinator.as_mut().and_then(|c| c.decide(mode, inflight, now)) {
            self.switch_to(target)?;
        }
        self.admit();
        let t0 = Instant::now();
        let running: usize = match self.mode {
            Mode::Tp => self.ranks[0].requests.len(),
            Mode::Ep => self.ranks.iter().map(|r| r.requests.len()).sum(),
        };
        let tokens = self.forward()?;
        self.retire();
        self.steps.push(StepRecord {
            step: self.step,
            mode: self.mode,
            running,
            tokens,
            seconds: t0.elapsed().as_secs_f64(),
        });
        self.step += 1;
        Ok(())
    }

    /// Runs until every submitted request finished (or `max_steps`).
    pub fn run_to_completion(&mut self, max_steps: usize) -> Result<(), TwinError> {
        for _ in 0..max_steps {
            if self.idle() {
                break;
            }
            self.step()?;
        }
        Ok(())
    }

    fn retire(&mut self) {
        let done: Vec<u64> =
            self.requests.values().filter(|r| r.done() && !self.finished.contains(&r.id)).map(|r| r.id).collect();
        for id in done {
            for rank in &mut self.ranks {
                if let Some(pages) = rank.tables.remove(&id) {
                    rank.pages.free.extend(pages);
                }
                rank.requests.retain(|x| *x != id);
            }
            self.finished.push(id);
        }
    }

    /// The forward pass of one step. Returns the number of tokens processed.
    fn forward(&mut self) -> Result<usize, TwinError> {
        let m = self.model.clone();
        let mode = self.mode;
        let p = self.ranks.len();
        // Per rank: (request, position, token) for every token to process.
        let batches: Vec<Vec<(u64, usize, u32)>> = self
            .ranks
            .iter()
            .map(|r| {
                r.requests
                    .iter()
                    .flat_map(|id| {
                        let q = &self.requests[id];
                        (q.cached..q.len()).map(move |pos| (q.id, pos, q.token(pos)))
                    })
                    .collect()
            })
            .collect();
        let n_tokens: usize = match mode {
            Mode::Tp => batches[0].len(),
            Mode::Ep => batches.iter().map(Vec::len).sum(),
        };
        // Pages for the new positions.
        let page = self.plan.kv.page_tokens as usize;
        for (r, batch) in self.ranks.iter_mut().zip(&batches) {
            for &(id, pos, _) in batch {
                let table = r.tables.entry(id).or_default();
                if pos / page >= table.len() {
                    let pg = r.pages.free.pop_front().ok_or(TwinError::TooLong(id))?;
                    table.push(pg);
                }
            }
        }
        let embed = self.view(mode, "model.embed_tokens.weight")?.clone();
        let mut x: Vec<Vec<Vec<f32>>> = self
            .ranks
            .iter()
            .zip(&batches)
            .map(|(r, b)| {
                b.iter()
                    .map(|&(_, _, t)| {
                        bf16s(&r.buf, embed.offset as usize + 2 * t as usize * m.hidden, m.hidden).collect()
                    })
                    .collect()
            })
            .collect();
        let cx = Ctx::new(self, mode)?;
        for l in 0..m.layers {
            // Attention (parallel per rank), then the TP all-reduce.
            let outs: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
                let handles: Vec<_> = self
                    .ranks
                    .iter_mut()
                    .zip(&batches)
                    .zip(&x)
                    .map(|((rank, batch), xs)| {
                        let cx = &cx;
                        s.spawn(move || cx.attention(rank, l, batch, xs))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
            });
            let outs = if mode == Mode::Tp { all_reduce(outs) } else { outs };
            add_outputs(&mut x, outs);
            // FFN: router, dispatch, experts, combine.
            let normed: Vec<Vec<Vec<f32>>> = x
                .iter()
                .enumerate()
                .map(|(r, xs)| {
                    xs.iter()
                        .map(|v| {
                            cx.norm(&self.ranks[r].buf, &format!("model.layers.{l}.post_attention_layernorm.weight"), v)
                        })
                        .collect()
                })
                .collect();
            let outs = if l < m.dense_layers {
                par_ranks(&self.ranks, |rank| {
                    normed[rank.id].iter().map(|h| cx.ffn(&rank.buf, &format!("model.layers.{l}.mlp"), h)).collect()
                })
            } else {
                self.moe(&cx, l, &normed)?
            };
            add_outputs(&mut x, outs);
        }
        // Logits for the last token of each request.
        let mut results: Vec<(u64, Vec<f32>)> = Vec::new();
        let head = if m.tie_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" };
        let ranks_with_output: Vec<usize> = match mode {
            Mode::Tp => vec![0],
            Mode::Ep => (0..p).collect(),
        };
        for r in ranks_with_output {
            let rank = &self.ranks[r];
            for (i, &(id, pos, _)) in batches[r].iter().enumerate() {
                if pos + 1 == self.requests[&id].len() {
                    let xn = cx.norm(&rank.buf, "model.norm.weight", &x[r][i]);
                    results.push((id, cx.mat(&rank.buf, head)?.matvec(&xn)));
                }
            }
        }
        for (id, logits) in results {
            let q = self.requests.get_mut(&id).ok_or(TwinError::TooLong(id))?;
            q.cached = q.len();
            q.generated.push(argmax(&logits));
            if self.keep_logits {
                self.logits.entry(id).or_default().push(logits);
            }
        }
        Ok(n_tokens)
    }

    /// The MoE layer over every rank's normed tokens.
    fn moe(&self, cx: &Ctx, l: usize, normed: &[Vec<Vec<f32>>]) -> Result<Vec<Vec<Vec<f32>>>, TwinError> {
        let m = &self.model;
        let p = self.ranks.len();
        let rule = RoutingRule { experts: m.experts, top_k: m.top_k, routing: m.routing };
        let pre = format!("model.layers.{l}.mlp");
        // Routing (replicated router weights; each rank routes the tokens it holds).
        let routes: Vec<Vec<(Vec<i32>, Vec<f32>)>> = par_ranks(&self.ranks, |rank| {
            normed[rank.id]
                .iter()
                .map(|h| {
                    let logits =
                        cx.mat(&rank.buf, &format!("{pre}.gate.weight")).map(|w| w.matvec(h)).unwrap_or_default();
                    let bias =
                        m.selection_bias().then(|| cx.f32s(&rank.buf, &format!("{pre}.gate.e_score_correction_bias")));
                    route(&rule, &logits, bias.as_deref())
                })
                .collect()
        });
        let shared =
            |rank: &Rank, h: &[f32]| (m.shared_ffn > 0).then(|| cx.ffn(&rank.buf, &format!("{pre}.shared_experts"), h));
        match cx.mode {
            Mode::Tp => {
                // Each rank: Σ_k w_k · expert_k restricted to its I/P slice; then all-reduce.
                let partial = par_ranks(&self.ranks, |rank| {
                    normed[rank.id]
                        .iter()
                        .zip(&routes[rank.id])
                        .map(|(h, (ids, w))| {
                            let mut y = vec![0f32; m.hidden];
                            for (e, wk) in ids.iter().zip(w) {
                                let ye = cx.expert(&rank.buf, l, *e as usize, h);
                                y.iter_mut().zip(&ye).for_each(|(a, b)| *a += wk * b);
                            }
                            y
                        })
                        .collect()
                });
                let mut reduced = all_reduce(partial);
                // Shared experts are replicated: every rank adds the same full output.
                for (rank, ys) in self.ranks.iter().zip(reduced.iter_mut()) {
                    for (y, h) in ys.iter_mut().zip(&normed[rank.id]) {
                        if let Some(s) = shared(rank, h) {
                            y.iter_mut().zip(&s).for_each(|(a, b)| *a += b);
                        }
                    }
                }
                Ok(reduced)
            }
            Mode::Ep => {
                // Dispatch: (source rank, token, k) to the expert's owner.
                let per = m.experts / p;
                let mut inbox: Vec<Vec<(usize, usize, usize, usize)>> = vec![vec![]; p];
                for (src, rs) in routes.iter().enumerate() {
                    for (t, (ids, _)) in rs.iter().enumerate() {
                        for (k, &e) in ids.iter().enumerate() {
                            inbox[e as usize / per].push((src, t, k, e as usize));
                        }
                    }
                }
                let results: Vec<Vec<Vec<f32>>> = par_ranks(&self.ranks, |rank| {
                    inbox[rank.id].iter().map(|&(src, t, _, e)| cx.expert(&rank.buf, l, e, &normed[src][t])).collect()
                });
                // Combine: back to the source, summed in k order.
                let mut ys: Vec<Vec<Vec<Vec<f32>>>> =
                    normed.iter().map(|xs| xs.iter().map(|_| vec![vec![]; m.top_k]).collect()).collect();
                for (owner, res) in results.into_iter().enumerate() {
                    for (&(src, t, k, _), y) in inbox[owner].iter().zip(res) {
                        ys[src][t][k] = y;
                    }
                }
                Ok(ys
                    .into_iter()
                    .enumerate()
                    .map(|(r, tokens)| {
                        tokens
                            .into_iter()
                            .enumerate()
                            .map(|(t, parts)| {
                                let mut y = vec![0f32; m.hidden];
                                for (k, part) in parts.iter().enumerate() {
                                    let wk = routes[r][t].1[k];
                                    y.iter_mut().zip(part).for_each(|(a, b)| *a += wk * b);
                                }
                                if let Some(s) = shared(&self.ranks[r], &normed[r][t]) {
                                    y.iter_mut().zip(&s).for_each(|(a, b)| *a += b);
                                }
                                y
                            })
                            .collect()
                    })
                    .collect())
            }
        }
    }

    // ───────────────────────── switching ─────────────────────────

    /// Switches now, unless the target mode cannot hold the live KV cache
    /// (then the switch is recorded as cancelled). Returns whether it switched.
    pub fn switch_to(&mut self, target: Mode) -> Result<bool, TwinError> {
        if target == self.mode {
            return Ok(false);
        }
        if !self.plan.modes.contains(&target) {
            return Err(TwinError::NoMode(target));
        }
        let t0 = Instant::now();
        let from = self.mode;
        let inflight = self.inflight();
        // Running requests in metadata all-gather order: rank by rank, each in its order.
        let mut running: Vec<u64> = Vec::new();
        for r in &self.ranks {
            for id in &r.requests {
                if !running.contains(id) {
                    running.push(*id);
                }
            }
        }
        // New ownership and the KV capacity check.
        let target_pages = kv_pages(&self.plan, target) as usize;
        let owners: BTreeMap<u64, usize> = match target {
            Mode::Ep => self.partition(&running),
            Mode::Tp => BTreeMap::new(),
        };
        let over = match target {
            Mode::Tp => {
                let need: usize = running.iter().map(|id| self.pages_needed(*id)).sum();
                (need > target_pages).then(|| {
                    format!("TP needs {need} KV pages per rank for {} requests, has {target_pages}", running.len())
                })
            }
            Mode::Ep => (0..self.ranks.len()).find_map(|r| {
                let need: usize = owners.iter().filter(|(_, o)| **o == r).map(|(id, _)| self.pages_needed(*id)).sum();
                (need > target_pages).then(|| format!("EP rank {r} needs {need} KV pages, has {target_pages}"))
            }),
        };
        if let Some(reason) = over {
            self.events.push(SwitchEvent {
                step: self.step,
                from,
                to: target,
                inflight,
                cancelled: Some(reason),
                weight_bytes_moved: 0,
                kv_bytes_moved: 0,
                seconds: t0.elapsed().as_secs_f64(),
            });
            let now = self.now();
            if let Some(c) = self.coordinator.as_mut() {
                c.cancelled(now);
            }
            return Ok(false);
        }
        // KV: gather every running request's cached K/V per layer and head.
        let staged = self.gather_kv(&running, &owners, target)?;
        // Expert weights: the plan's descriptors, in place, in the plan's layer order.
        let reshard = self.plan.reshard.clone().ok_or(TwinError::NoMode(target))?;
        let w = if target == Mode::Tp { &reshard.ep_to_tp } else { &reshard.tp_to_ep };
        let weight_bytes = execute_reshard(&self.plan, w, &mut self.ranks);
        // Ownership and pages in the target format; scatter the KV.
        self.mode = target;
        for r in &mut self.ranks {
            r.pages = Pages::new(target_pages as u64);
            r.tables.clear();
            r.requests.clear();
        }
        for &id in &running {
            match target {
                Mode::Tp => self.ranks.iter_mut().for_each(|r| r.requests.push(id)),
                Mode::Ep => self.ranks[owners[&id]].requests.push(id),
            }
        }
        let kv_bytes = self.scatter_kv(&running, staged)?;
        self.events.push(SwitchEvent {
            step: self.step,
            from,
            to: target,
            inflight,
            cancelled: None,
            weight_bytes_moved: weight_bytes,
            kv_bytes_moved: kv_bytes,
            seconds: t0.elapsed().as_secs_f64(),
        });
        let now = self.now();
        if let Some(c) = self.coordinator.as_mut() {
            c.switched(now);
        }
        Ok(true)
    }

    /// TP→EP request partition (Moebius §3.2): by decreasing sequence length
    /// (ties by id), each to the rank with the fewest tokens, then requests,
    /// then the lowest id. Deterministic, so every rank computes the same.
    fn partition(&self, running: &[u64]) -> BTreeMap<u64, usize> {
        let mut order: Vec<u64> = running.to_vec();
        order.sort_by_key(|id| (std::cmp::Reverse(self.requests[id].len()), *id));
        let mut load = vec![(0usize, 0usize); self.ranks.len()];
        let mut out = BTreeMap::new();
        for id in order {
            let r = (0..load.len()).min_by_key(|&r| (load[r].0, load[r].1, r)).unwrap_or(0);
            load[r].0 += self.requests[&id].len();
            load[r].1 += 1;
            out.insert(id, r);
        }
        out
    }

    /// Byte offset of (page, layer, local head, token in page) in the KV pool of `mode`.
    fn kv_slot(&self, mode: Mode, page: u32, layer: usize, head: usize, tip: usize) -> usize {
        let kv = &self.plan.kv;
        let (heads, page_bytes) = match (mode, &kv.tp) {
            (Mode::Tp, Some(tp)) => (tp.heads_per_rank as usize, tp.page_bytes),
            _ => (kv.ep.heads_per_rank as usize, kv.ep.page_bytes),
        };
        let base = self.plan.regions.get(kv.region.index()).map_or(0, |r| r.offset) as usize;
        base + page as usize * page_bytes as usize
            + ((layer * heads + head) * kv.page_tokens as usize + tip) * kv.head_token_bytes as usize
    }

    /// The KV heads `[a, b)` a rank stores in `mode`.
    fn kv_heads_of(&self, mode: Mode, r: usize) -> (usize, usize) {
        match mode {
            Mode::Ep => (0, self.model.kv_heads),
            Mode::Tp => {
                let [a, b] = self.plan.kv.tp_heads[r];
                (a as usize, b as usize)
            }
        }
    }

    /// Reads the cached K/V of every running request: staged[req][layer][head] = bytes of all positions.
    fn gather_kv(
        &self,
        running: &[u64],
        owners: &BTreeMap<u64, usize>,
        target: Mode,
    ) -> Result<BTreeMap<u64, StagedKv>, TwinError> {
        let m = &self.model;
        let page = self.plan.kv.page_tokens as usize;
        let tb = self.plan.kv.head_token_bytes as usize;
        let mut out = BTreeMap::new();
        for &id in running {
            let n = self.requests[&id].cached;
            let mut layers = vec![vec![Vec::with_capacity(n * tb); m.kv_heads]; m.layers];
            for (layer, heads) in layers.iter_mut().enumerate() {
                for (h, bytes) in heads.iter_mut().enumerate() {
                    // The source rank holding head h: EP the owner; TP the new owner if it holds h, else the first holder.
                    let src = match self.mode {
                        Mode::Ep => self.ranks.iter().position(|r| r.requests.contains(&id)).unwrap_or(0),
                        Mode::Tp => {
                            let holds = |r: usize| {
                                let (a, b) = self.kv_heads_of(Mode::Tp, r);
                                (a..b).contains(&h)
                            };
                            match (target, owners.get(&id)) {
                                (Mode::Ep, Some(&o)) if holds(o) => o,
                                _ => (0..self.ranks.len()).find(|&r| holds(r)).unwrap_or(0),
                            }
                        }
                    };
                    let rank = &self.ranks[src];
                    let table = rank.tables.get(&id).cloned().unwrap_or_default();
                    let local = h - self.kv_heads_of(self.mode, src).0;
                    for pos in 0..n {
                        let at = self.kv_slot(self.mode, table[pos / page], layer, local, pos % page);
                        bytes.extend_from_slice(&rank.buf[at..at + tb]);
                    }
                }
            }
            out.insert(id, layers);
        }
        Ok(out)
    }

    /// Writes staged K/V into freshly allocated pages of the current mode.
    fn scatter_kv(&mut self, running: &[u64], staged: BTreeMap<u64, StagedKv>) -> Result<u64, TwinError> {
        let page = self.plan.kv.page_tokens as usize;
        let tb = self.plan.kv.head_token_bytes as usize;
        let mut moved = 0u64;
        for &id in running {
            let n = self.requests[&id].cached;
            let layers = &staged[&id];
            for r in 0..self.ranks.len() {
                if !self.ranks[r].requests.contains(&id) {
                    continue;
                }
                let mut table = Vec::new();
                for _ in 0..n.div_ceil(page) {
                    table.push(self.ranks[r].pages.free.pop_front().ok_or(TwinError::TooLong(id))?);
                }
                let (a, b) = self.kv_heads_of(self.mode, r);
                for (layer, heads) in layers.iter().enumerate() {
                    for (h, head) in heads.iter().enumerate().take(b).skip(a) {
                        for pos in 0..n {
                            let at = self.kv_slot(self.mode, table[pos / page], layer, h - a, pos % page);
                            self.ranks[r].buf[at..at + tb].copy_from_slice(&head[pos * tb..(pos + 1) * tb]);
                            moved += tb as u64;
                        }
                    }
                }
                self.ranks[r].tables.insert(id, table);
            }
        }
        Ok(moved)
    }
}

/// View names the forward pass reads (with `{l}` for the layer).
fn required_views(m: &TwinModel) -> Vec<String> {
    let mut v = vec!["model.embed_tokens.weight".to_string(), "model.norm.weight".to_string()];
    if !m.tie_embeddings {
        v.push("lm_head.weight".into());
    }
    let l = "model.layers.{l}";
    for t in ["input_layernorm.weight", "post_attention_layernorm.weight"] {
        v.push(format!("{l}.{t}"));
    }
    for t in ["q_proj", "k_proj", "v_proj", "o_proj"] {
        v.push(format!("{l}.self_attn.{t}.weight"));
    }
    if m.qk_norm {
        v.push(format!("{l}.self_attn.q_norm.weight"));
        v.push(format!("{l}.self_attn.k_norm.weight"));
    }
    v.push(format!("{l}.mlp.gate.weight"));
    v.push(format!("{l}.mlp.experts.w13"));
    v.push(format!("{l}.mlp.experts.w2"));
    if m.selection_bias() {
        v.push(format!("{l}.mlp.gate.e_score_correction_bias"));
    }
    if m.shared_ffn > 0 || m.dense_layers > 0 {
        let pre = if m.shared_ffn > 0 { "mlp.shared_experts" } else { "mlp" };
        for t in ["gate_proj", "up_proj", "down_proj"] {
            v.push(format!("{l}.{pre}.{t}.weight"));
        }
    }
    v
}

/// One request's staged KV: `[layer][kv head]` → bytes of every cached position.
type StagedKv = Vec<Vec<Vec<u8>>>;

/// Pages per rank of `mode`'s KV format.
fn kv_pages(plan: &MemoryPlan, mode: Mode) -> u64 {
    match (mode, &plan.kv.tp) {
        (Mode::Tp, Some(tp)) => tp.pages,
        _ => plan.kv.ep.pages,
    }
}

/// Executes a weight reshard on the ranks' buffers: for each MoE layer in
/// the plan's order, every descriptor, byte for byte. Returns the bytes that
/// crossed between ranks.
pub fn execute_reshard(plan: &MemoryPlan, w: &WeightReshard, ranks: &mut [impl AsMut<[u8]>]) -> u64 {
    let s = &plan.slots;
    let order: Vec<u32> = match w.order {
        LayerOrder::Ascending => (0..s.moe_layers).collect(),
        LayerOrder::Descending => (0..s.moe_layers).rev().collect(),
    };
    let mut remote = 0;
    for l in order {
        let src_base = s.base + u64::from(l + w.src_shift) * s.slot_bytes;
        let dst_base = s.base + u64::from(l + w.dst_shift) * s.slot_bytes;
        for c in &w.per_layer {
            copy_runs(c, src_base, dst_base, ranks);
            if c.src_rank != c.dst_rank {
                remote += c.bytes();
            }
        }
    }
    remote
}

fn copy_runs(c: &Copy, src_base: u64, dst_base: u64, ranks: &mut [impl AsMut<[u8]>]) {
    let run = c.run_bytes as usize;
    for (so, dof) in c.runs() {
        let (s, d) = ((src_base + so) as usize, (dst_base + dof) as usize);
        if c.src_rank == c.dst_rank {
            ranks[c.src_rank as usize].as_mut().copy_within(s..s + run, d);
        } else {
            let (a, b) = (c.src_rank as usize, c.dst_rank as usize);
            let (lo, hi) = ranks.split_at_mut(a.max(b));
            let (src, dst) = if a < b { (lo[a].as_mut(), hi[0].as_mut()) } else { (hi[0].as_mut(), lo[b].as_mut()) };
            dst[d..d + run].copy_from_slice(&src[s..s + run]);
        }
    }
}

impl AsMut<[u8]> for Rank {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

/// `x[r][t] += out[r][t]`.
fn add_outputs(x: &mut [Vec<Vec<f32>>], outs: Vec<Vec<Vec<f32>>>) {
    for (xs, os) in x.iter_mut().zip(outs) {
        for (v, o) in xs.iter_mut().zip(os) {
            v.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        }
    }
}

/// Sums every rank's partial outputs in rank order and gives each rank the sum.
fn all_reduce(partial: Vec<Vec<Vec<f32>>>) -> Vec<Vec<Vec<f32>>> {
    let p = partial.len();
    let mut sum = partial[0].clone();
    for other in &partial[1..] {
        for (s, o) in sum.iter_mut().zip(other) {
            s.iter_mut().zip(o).for_each(|(a, b)| *a += b);
        }
    }
    vec![sum; p]
}

/// Runs `f` on every rank in parallel (one thread each).
fn par_ranks<T: Send>(ranks: &[Rank], f: impl Fn(&Rank) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks.iter().map(|r| s.spawn(|| f(r))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    })
}

/// The views and constants a step needs, resolved once per step.
struct Ctx {
    mode: Mode,
    m: TwinModel,
    views: BTreeMap<String, View>,
    p: usize,
    q_heads: Vec<[u32; 2]>,
    kv_heads: Vec<(usize, usize)>,
    kv: KvGeom,
}

#[derive(Clone, Copy)]
struct KvGeom {
    base: usize,
    page_bytes: usize,
    heads: usize,
    page_tokens: usize,
    token_bytes: usize,
}

impl Ctx {
    fn new(t: &Twin, mode: Mode) -> Result<Ctx, TwinError> {
        let views =
            t.views.iter().filter(|((md, _), _)| *md == mode).map(|((_, n), v)| (n.clone(), v.clone())).collect();
        let p = t.ranks.len();
        let kvp = &t.plan.kv;
        let (heads, page_bytes) = match (mode, &kvp.tp) {
            (Mode::Tp, Some(tp)) => (tp.heads_per_rank as usize, tp.page_bytes as usize),
            _ => (kvp.ep.heads_per_rank as usize, kvp.ep.page_bytes as usize),
        };
        let base = t.plan.regions.get(kvp.region.index()).map_or(0, |r| r.offset) as usize;
        Ok(Ctx {
            mode,
            m: t.model.clone(),
            views,
            p,
            q_heads: (0..p as u32)
                .map(|r| match mode {
                    Mode::Tp => moeforge_plan::memory::head_block(t.model.heads as u32, p as u32, r),
                    Mode::Ep => [0, t.model.heads as u32],
                })
                .collect(),
            kv_heads: (0..p).map(|r| t.kv_heads_of(mode, r)).collect(),
            kv: KvGeom {
                base,
                page_bytes,
                heads,
                page_tokens: kvp.page_tokens as usize,
                token_bytes: kvp.head_token_bytes as usize,
            },
        })
    }

    fn view(&self, name: &str) -> Option<&View> {
        self.views.get(name)
    }

    /// Resolves `name` (with a concrete layer) to its view and layer offset.
    fn find(&self, name: &str) -> Option<(&View, usize)> {
        // "model.layers.7.x" → pattern "model.layers.{l}.x", layer 7
        if let Some(rest) = name.strip_prefix("model.layers.") {
            let (num, tail) = rest.split_once('.')?;
            let l: u32 = num.parse().ok()?;
            let v = self.view(&format!("model.layers.{{l}}.{tail}")).filter(|v| v.covers(l))?;
            return Some((v, v.offset_of(l) as usize));
        }
        self.view(name).map(|v| (v, v.offset as usize))
    }

    fn mat<'b>(&self, buf: &'b [u8], name: &str) -> Result<Mat<'b>, TwinError> {
        let (v, at) = self.find(name).ok_or_else(|| TwinError::MissingView(self.mode.name(), name.to_string()))?;
        Ok(Mat { buf, at, rows: v.shape[0] as usize, cols: v.shape[1] as usize, row_stride: v.shape[1] as usize })
    }

    fn vec(&self, buf: &[u8], name: &str) -> Vec<f32> {
        match self.find(name) {
            Some((v, at)) => bf16s(buf, at, v.shape.iter().product::<u64>() as usize).collect(),
            None => vec![],
        }
    }

    fn f32s(&self, buf: &[u8], name: &str) -> Vec<f32> {
        match self.find(name) {
            Some((v, at)) => {
                let n = v.shape.iter().product::<u64>() as usize;
                buf[at..at + 4 * n].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            None => vec![],
        }
    }

    fn norm(&self, buf: &[u8], name: &str, x: &[f32]) -> Vec<f32> {
        rms_norm(x, &self.vec(buf, name), self.m.rms_eps as f32)
    }

    fn ffn(&self, buf: &[u8], pre: &str, x: &[f32]) -> Vec<f32> {
        let run = || -> Result<Vec<f32>, TwinError> {
            let g = self.mat(buf, &format!("{pre}.gate_proj.weight"))?.matvec(x);
            let u = self.mat(buf, &format!("{pre}.up_proj.weight"))?.matvec(x);
            let z: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
            Ok(self.mat(buf, &format!("{pre}.down_proj.weight"))?.matvec(&z))
        };
        run().unwrap_or_else(|_| vec![0.0; self.m.hidden])
    }

    /// Global expert `e` of MoE layer `l` on `x`: EP the whole expert (this
    /// rank owns it); TP this rank's `I/P` slice (a partial sum).
    fn expert(&self, buf: &[u8], l: usize, e: usize, x: &[f32]) -> Vec<f32> {
        let (h, i) = (self.m.hidden, self.m.expert_ffn);
        let (Some((_, w13)), Some((_, w2))) = (
            self.find(&format!("model.layers.{l}.mlp.experts.w13")),
            self.find(&format!("model.layers.{l}.mlp.experts.w2")),
        ) else {
            return vec![0.0; h];
        };
        let (local, rows) = match self.mode {
            Mode::Ep => (e % (self.m.experts / self.p), i),
            Mode::Tp => (e, i / self.p),
        };
        let gate = Mat { buf, at: w13 + 2 * local * 2 * rows * h, rows, cols: h, row_stride: h }.matvec(x);
        let up = Mat { buf, at: w13 + 2 * (local * 2 * rows + rows) * h, rows, cols: h, row_stride: h }.matvec(x);
        let z: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
        Mat { buf, at: w2 + 2 * local * h * rows, rows: h, cols: rows, row_stride: rows }.matvec(&z)
    }

    /// Attention of one rank's tokens in layer `l`: writes K/V of the new
    /// positions into the rank's pages, attends with the rank's query heads,
    /// and returns the output projection (complete in EP, partial in TP).
    fn attention(&self, rank: &mut Rank, l: usize, batch: &[(u64, usize, u32)], xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
        let m = &self.m;
        let hd = m.head_dim;
        let eps = m.rms_eps as f32;
        let pre = format!("model.layers.{l}.self_attn");
        let [qa, qb] = self.q_heads[rank.id];
        let (ka, kb) = self.kv_heads[rank.id];
        let group = m.heads / m.kv_heads;
        let geo = self.kv;
        let slot = |page: u32, head: usize, tip: usize| {
            geo.base
                + page as usize * geo.page_bytes
                + ((l * geo.heads + head) * geo.page_tokens + tip) * geo.token_bytes
        };
        let (qn, kn) = if m.qk_norm {
            (self.vec(&rank.buf, &format!("{pre}.q_norm.weight")), self.vec(&rank.buf, &format!("{pre}.k_norm.weight")))
        } else {
            (vec![], vec![])
        };
        let in_norm = self.vec(&rank.buf, &format!("model.layers.{l}.input_layernorm.weight"));
        let normed: Vec<Vec<f32>> = xs.iter().map(|x| rms_norm(x, &in_norm, eps)).collect();
        // K/V of every new position first, so prompt tokens can attend to each other.
        let mut qs = Vec::with_capacity(batch.len());
        for (&(id, pos, _), h) in batch.iter().zip(&normed) {
            let (Ok(wq), Ok(wk), Ok(wv)) = (
                self.mat(&rank.buf, &format!("{pre}.q_proj.weight")),
                self.mat(&rank.buf, &format!("{pre}.k_proj.weight")),
                self.mat(&rank.buf, &format!("{pre}.v_proj.weight")),
            ) else {
                return vec![vec![0.0; m.hidden]; batch.len()];
            };
            let (q, k, v) = (wq.matvec(h), wk.matvec(h), wv.matvec(h));
            qs.push(q);
            let page = rank.tables.get(&id).and_then(|t| t.get(pos / geo.page_tokens)).copied().unwrap_or(0);
            for g in 0..kb - ka {
                let mut kh = k[g * hd..(g + 1) * hd].to_vec();
                if m.qk_norm {
                    kh = rms_norm(&kh, &kn, eps);
                }
                rope(&mut kh, pos, m.rope_dim, m.rope_theta);
                let at = slot(page, g, pos % geo.page_tokens);
                put_bf16s(&mut rank.buf, at, &kh);
                put_bf16s(&mut rank.buf, at + 2 * hd, &v[g * hd..(g + 1) * hd]);
            }
        }
        let o_proj = self.mat(&rank.buf, &format!("{pre}.o_proj.weight"));
        batch
            .iter()
            .zip(qs)
            .map(|(&(id, pos, _), q)| {
                let table = rank.tables.get(&id).cloned().unwrap_or_default();
                let mut heads = Vec::with_capacity((qb - qa) as usize * hd);
                for (i, hq) in (qa as usize..qb as usize).enumerate() {
                    let mut qh = q[i * hd..(i + 1) * hd].to_vec();
                    if m.qk_norm {
                        qh = rms_norm(&qh, &qn, eps);
                    }
                    rope(&mut qh, pos, m.rope_dim, m.rope_theta);
                    let g = hq / group - ka;
                    let key = |j: usize| {
                        bf16s(&rank.buf, slot(table[j / geo.page_tokens], g, j % geo.page_tokens), hd).collect()
                    };
                    let value = |j: usize| {
                        bf16s(&rank.buf, slot(table[j / geo.page_tokens], g, j % geo.page_tokens) + 2 * hd, hd)
                            .collect()
                    };
                    heads.extend(attend(&qh, pos + 1, key, value));
                }
                o_proj.as_ref().map(|w| w.matvec(&heads)).unwrap_or_else(|_| vec![0.0; m.hidden])
            })
            .collect()
    }
}

/// Measures decode step cost in TP and EP for each batch size (median of
/// `steps` decode steps after the prefill step), for T_h calibration at the
/// crossover (Moebius §4.5). Returns `(batch, tp seconds, ep seconds)`.
pub fn calibrate(
    bundle: &LoadedBundle,
    ck: &Checkpoint,
    batches: &[usize],
    steps: usize,
) -> Result<Vec<(usize, f64, f64)>, TwinError> {
    let mut out = Vec::new();
    for &b in batches {
        let mut cost = [0f64; 2];
        for (i, mode) in [Mode::Tp, Mode::Ep].into_iter().enumerate() {
            let mut t = Twin::new(bundle, ck, mode)?;
            t.set_policy(None);
            for id in 0..b {
                t.submit(Request::new(id as u64, vec![(id % t.model.vocab) as u32], steps + 1))?;
            }
            t.step()?; // prefill
            let mut times = Vec::new();
            for _ in 0..steps {
                let s = Instant::now();
                t.step()?;
                times.push(s.elapsed().as_secs_f64());
            }
            times.sort_by(f64::total_cmp);
            cost[i] = times[times.len() / 2];
        }
        out.push((b, cost[0], cost[1]));
    }
    Ok(out)
}
