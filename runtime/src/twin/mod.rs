//! The CPU twin (the `cpu` backend): a real MoE decoder running on P
//! simulated ranks over a bundle's memory plan, switching TP↔EP live
//! (Moebius §3, §4). It implements [`Engine`].
//!
//! Every rank owns one unified buffer of the plan's size; every weight and
//! KV-cache byte lives in it and is reached only through the plan's views
//! (selected by tensor role) and KV page layout. Ranks compute in parallel
//! (one thread each per phase); collectives run between phases in a fixed
//! order, so every run is deterministic:
//!
//! - EP (DP attention + EP experts): a rank runs attention for its own
//!   requests with full heads, routes its tokens, dispatches each (token, k)
//!   to the expert's owner (all-to-all), and combines the returned outputs in
//!   k order.
//! - TP: every rank runs every request with its head shard and its `1/P`
//!   slice of every expert; partial outputs are all-reduced in rank order.
//!
//! Modules by concern: [`model`] (what the twin computes and the views it
//! needs), `load` (checkpoint slicing into the views), `forward` (one step:
//! attention, norms, the LM head), `moe` (routing, dispatch, experts,
//! combine), `switch` (TP↔EP switching and KV migration), [`reshard`] (the
//! plan's weight descriptors, executed), `paging` (KV pages). What the
//! capability table refuses (`moeforge_plan::caps`) the twin refuses at
//! construction.

pub mod dense;
mod forward;
mod load;
pub mod math;
pub mod model;
pub mod moe;
mod paging;
pub mod reshard;
mod switch;
pub mod weights;

pub use model::TwinModel;

use crate::engine::{Engine, EngineError, Request, RequestId, Stats, StepOutput, SwitchEvent};
use crate::policy::{Calibration, Measured};
use crate::LoadedBundle;
use moeforge_dsl::spec::DType;
use moeforge_plan::memory::{MemoryPlan, Mode, TensorPart, TensorRole, View};
use moeforge_plan::roles::Role;
use paging::{kv_pages, Pages};
use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;
use weights::Checkpoint;

/// A request as the twin tracks it.
#[derive(Clone, Debug)]
pub struct Live {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub max_new: usize,
    pub generated: Vec<u32>,
    /// Tokens whose KV is cached.
    pub cached: usize,
    /// Its sampling parameters and generator (it moves with the request on
    /// a switch: the twin keeps it outside the ranks).
    pub sampler: crate::sampling::Sampler,
}

impl Live {
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
    #[error("the plan holds no {0} view of `{1}`")]
    MissingView(&'static str, String),
    #[error("the plan's {mode} view of `{tensor}` is {found}; the model needs {expected}")]
    ViewShape { mode: &'static str, tensor: String, found: String, expected: String },
    #[error("the twin would allocate {need} bytes for {ranks} rank buffers, above the limit of {limit}; compile a spec with a small `hbm` for the CPU twin")]
    TooLarge { need: u64, ranks: u32, limit: u64 },
    #[error("the plan holds no {0:?} mode")]
    NoMode(Mode),
}

impl From<TwinError> for EngineError {
    fn from(e: TwinError) -> EngineError {
        match e {
            TwinError::NoMode(_) => EngineError::Capacity(e.to_string()),
            _ => EngineError::Backend(e.to_string()),
        }
    }
}

/// One simulated GPU.
struct Rank {
    id: usize,
    /// Its ExpertPlex role in a role plan.
    role: Option<Role>,
    /// Its unified buffer; empty on a device, whose buffers hold everything.
    buf: Vec<u8>,
    pages: Pages,
    /// Page table per request held by this rank.
    tables: BTreeMap<RequestId, Vec<u32>>,
    /// Requests this rank serves (EP: its own; TP: every running request).
    requests: Vec<RequestId>,
}

/// The twin engine.
pub struct Twin {
    pub model: TwinModel,
    plan: MemoryPlan,
    /// The weight views by mode and role.
    views: BTreeMap<(Mode, TensorRole), View>,
    /// The block-scale views of the fp8 roles, by mode and role.
    scales: BTreeMap<(Mode, TensorRole), View>,
    /// The bias views (attention projections, router, experts), by mode and role.
    biases: BTreeMap<(Mode, TensorRole), View>,
    ranks: Vec<Rank>,
    mode: Mode,
    requests: BTreeMap<RequestId, Live>,
    waiting: VecDeque<RequestId>,
    finished: Vec<RequestId>,
    done: std::collections::BTreeSet<RequestId>,
    /// Logits behind every generated token, per request (kept for tests).
    pub logits: BTreeMap<RequestId, Vec<Vec<f32>>>,
    pub keep_logits: bool,
    /// Every switch asked of this engine, done or cancelled.
    pub events: Vec<SwitchEvent>,
    step: usize,
    /// The device the step runs on (`--backend emu`): the bundle's programs
    /// and kernels over the same ranks, pages and requests; none runs the
    /// twin's own arithmetic.
    device: Option<crate::device::exec::Executor>,
    /// Which experts each rank's EP slots hold, and the routing policy.
    slots: moe::Slots,
    /// Where EP's routed rows were computed so far.
    routed: std::sync::Mutex<moe::Routed>,
    /// The plan's ExpertPlex roles, when it has them.
    roles: Option<moeforge_plan::roles::Roles>,
    /// Prefill→decode KV handoffs so far.
    handoffs: Handoffs,
}

/// What the prefill→decode KV handoffs of a role plan moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Handoffs {
    pub requests: u64,
    pub pages: u64,
    pub bytes: u64,
}

/// Largest total of rank buffers the twin allocates.
pub const MAX_TWIN_BYTES: u64 = 16 << 30;

impl Twin {
    /// Builds the ranks from a verified bundle and loads the checkpoint
    /// through the views: replicated and attention tensors in every mode,
    /// experts in the starting mode's. Refuses a model the capability table
    /// says the twin cannot run, and a plan whose views do not have the
    /// shapes the model needs, before allocating anything.
    pub fn new(bundle: &LoadedBundle, ck: &Checkpoint, start: Mode) -> Result<Twin, TwinError> {
        let mut twin = Twin::build(bundle, ck, start, true)?;
        twin.load(ck)?;
        Ok(twin)
    }

    /// The twin's ranks and state, with host buffers (`host`) or without
    /// (a device holds the weights and KV); nothing loaded yet.
    fn build(bundle: &LoadedBundle, ck: &Checkpoint, start: Mode, host: bool) -> Result<Twin, TwinError> {
        let spec = &bundle.spec;
        let m = spec.models.first().ok_or_else(|| TwinError::Unsupported("the bundle's spec has no model".into()))?;
        let mut model = TwinModel::from_spec(m).map_err(TwinError::Unsupported)?;
        let full = bundle.plan.plan();
        model.ep_slots = full.layout.max_experts_per_rank as usize;
        let plan = bundle.plan.memory.clone();
        if !plan.modes.contains(&start) {
            return Err(TwinError::NoMode(start));
        }
        let need = plan.buffer_bytes.saturating_mul(u64::from(plan.group));
        if host && need > MAX_TWIN_BYTES {
            return Err(TwinError::TooLarge { need, ranks: plan.group, limit: MAX_TWIN_BYTES });
        }
        let p = plan.group as usize;
        let ep = full.layout.ep_size.max(1) as usize;
        if full.placement.is_none() && model.experts % ep != 0 {
            return Err(TwinError::Unsupported(format!(
                "{} experts do not split evenly over {ep} ranks; the CPU twin needs E mod P = 0",
                model.experts
            )));
        }
        let (views, scales, biases) = check_views(&model, &plan)?;
        ck.validate(&model)?;
        let pages = kv_pages(&plan, start);
        let ranks = (0..p)
            .map(|id| Rank {
                id,
                role: full.role(id),
                buf: if host { vec![0u8; plan.buffer_bytes as usize] } else { Vec::new() },
                // MoE servers hold no KV.
                pages: Pages::new(if full.role(id) == Some(Role::Moe) { 0 } else { pages }),
                tables: BTreeMap::new(),
                requests: vec![],
            })
            .collect();
        let twin = Twin {
            model,
            plan,
            views,
            scales,
            biases,
            ranks,
            mode: start,
            requests: BTreeMap::new(),
            waiting: VecDeque::new(),
            finished: vec![],
            done: Default::default(),
            logits: BTreeMap::new(),
            keep_logits: false,
            events: vec![],
            step: 0,
            device: None,
            slots: moe::Slots::of(full),
            routed: Default::default(),
            roles: full.roles.clone(),
            handoffs: Handoffs::default(),
        };
        Ok(twin)
    }

    /// The twin's scheduling (admission, KV pages, sampling state) over
    /// `dev`: each step runs the bundle's program for its mode and phase on
    /// the device, every kernel the bundle's own. No rank buffer exists on
    /// the host: every view's bytes go from the checkpoint straight to the
    /// device (the same slicing as the host twin's load), so the host holds
    /// the checkpoint and nothing the size of the plan.
    pub fn on_device(
        bundle: &LoadedBundle,
        ck: &Checkpoint,
        start: Mode,
        dev: Box<dyn crate::device::Device + Send>,
    ) -> Result<Twin, TwinError> {
        let mut twin = Twin::build(bundle, ck, start, false)?;
        let device = |e: crate::device::exec::ExecError| TwinError::Unsupported(e.to_string());
        let exec = crate::device::exec::Executor::new(
            dev,
            bundle.plan.plan(),
            &bundle.kernels,
            &bundle.cubins,
            &bundle.transfers,
        )
        .map_err(device)?;
        twin.device = Some(exec);
        twin.load(ck)?;
        Ok(twin)
    }

    /// Bytes of rank buffers this process holds on the host (0 on a device).
    pub fn host_buffer_bytes(&self) -> u64 {
        self.ranks.iter().map(|r| r.buf.len() as u64).sum()
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }
    /// Where EP's routed (token, k) rows were computed so far.
    pub fn routed(&self) -> moe::Routed {
        self.routed.lock().map(|r| *r).unwrap_or_default()
    }
    /// The prefill→decode KV handoffs of a role plan so far.
    pub fn handoffs(&self) -> Handoffs {
        self.handoffs
    }
    /// The requests each GPU serves now, by rank (a role plan's MoE servers none).
    pub fn served(&self) -> Vec<Vec<RequestId>> {
        self.ranks.iter().map(|r| r.requests.clone()).collect()
    }
    /// Slot exchanges the drift re-planning executed so far.
    /// On a device, where the combines' rows went so far.
    pub fn combine_traffic(&self) -> Option<crate::device::exec::CombineTraffic> {
        self.device.as_ref().map(crate::device::exec::Executor::combine_traffic)
    }

    /// The device's dispatch traffic so far (`None` without a device).
    pub fn dispatch_traffic(&self) -> Option<crate::device::exec::DispatchTraffic> {
        self.device.as_ref().map(crate::device::exec::Executor::dispatch_traffic)
    }

    /// Checks every device routing against the host's
    /// ([`crate::device::exec::Executor::verify_routing`]); no effect
    /// without a device.
    pub fn verify_device_routing(&mut self, on: bool) {
        if let Some(d) = self.device.as_mut() {
            d.verify_routing(on);
        }
    }

    /// Routes the device's decode dispatches as prefill's instead of on
    /// fixed slots ([`crate::device::exec::Executor::route_decode`]); no
    /// effect without a device.
    pub fn route_decode_on_device(&mut self, on: bool) {
        if let Some(d) = self.device.as_mut() {
            d.route_decode(on);
        }
    }

    /// Runs the device's decode steps as graphs where it records them (the
    /// default there; [`crate::device::exec::Executor::use_graphs`]); no
    /// effect without a device.
    pub fn use_device_graphs(&mut self, on: bool) {
        if let Some(d) = self.device.as_mut() {
            d.use_graphs(on);
        }
    }

    /// Records the device's decode graphs of both modes now, for the batch
    /// buckets that hold up to `most` requests a rank, as Moebius §4.4 does
    /// at startup ([`Twin::walk_modes`]: the current mode's first, then the
    /// other mode's after a weight-only warm-up switch, taken only where a
    /// graph holds that mode's smallest bucket,
    /// [`crate::device::exec::Executor::graphs_hold`]). Returns the (mode,
    /// bucket)s recorded; nothing without a device that records graphs.
    /// Refused while a request is in flight.
    pub fn capture_graphs(&mut self, most: u32) -> Result<Vec<(Mode, u32)>, EngineError> {
        let Some(d) = self.device.as_ref().filter(|d| d.records_graphs() && most > 0) else {
            return self.idle_or("recording decode graphs").map(|()| Vec::new());
        };
        let mut held = Vec::new();
        for &m in &self.plan.modes {
            match d.graphs_hold(m) {
                Ok(true) => held.push(m),
                Ok(false) => {}
                Err(e) => return Err(EngineError::Backend(format!("recording decode graphs: {e}"))),
            }
        }
        if held.is_empty() {
            return self.idle_or("recording decode graphs").map(|()| Vec::new());
        }
        let (mut kept, mut visited) = (Vec::new(), Vec::new());
        self.walk_modes("recording decode graphs", |d, mode| {
            if held.contains(&mode) {
                kept.extend(d.capture_decode_graphs(mode, most)?.into_iter().map(|b| (mode, b)));
            }
            visited.push(mode);
            // On to the other mode only where it has a graph to record.
            Ok(held.iter().any(|m| !visited.contains(m)))
        })?;
        Ok(kept)
    }

    /// Moebius §4.5's startup calibration on this engine's own decode
    /// steps, as it serves them (graph replays where the device records
    /// graphs, else call by call): batches in increasing order, each timed
    /// in both modes ([`crate::device::exec::Executor::probe_decode`], the
    /// median of `steps`, each request with `context` tokens cached on
    /// pages of its own), until the first whose EP step is no slower than
    /// TP's (the crossover: no later batch changes T_h) or one that does
    /// not fit the engine (its KV the pool, or its inputs the step). The
    /// walk zig-zags between the modes ([`Twin::walk_modes`],
    /// [`crossover_walk`]: each batch's second mode times the next batch
    /// before it switches back), so it switches about once per batch.
    /// Returns the batches timed in both modes, in order (a prefix of
    /// `batches`), and the one that did not fit if that ended the walk;
    /// `None` without a device or in a single-mode plan, or where nothing
    /// sets T_h: no batch timed in both modes, and no batch TP outgrew.
    pub fn probe_decode_steps(
        &mut self,
        batches: &[usize],
        steps: usize,
        context: u32,
    ) -> Result<Option<Measured>, EngineError> {
        if self.plan.modes.len() != 2 || self.device.is_none() || batches.is_empty() {
            return Ok(None);
        }
        let mut cost: BTreeMap<(Mode, usize), f64> = BTreeMap::new();
        let mut unfit = None;
        self.walk_modes("calibrating T_h", |d, mode| loop {
            match crossover_walk(batches.len(), &cost, mode, unfit.is_some()) {
                Walk::Time(i) => {
                    let b = u32::try_from(batches[i]).unwrap_or(u32::MAX);
                    match d.probe_decode(mode, b, steps, context)? {
                        Some(mut t) => {
                            t.sort_by(f64::total_cmp);
                            cost.insert((mode, i), t.get(t.len() / 2).copied().unwrap_or(0.0));
                        }
                        // TP outgrew the batch only where EP's ranks hold it (its
                        // KV, its headers and rows). Where TP splits the KV heads
                        // both pools hold the same tokens and EP's ranks round
                        // their share up, so a batch whose KV overflows TP's pool
                        // overflows EP's too (named EP's: T_h stays). TP outgrows
                        // first where it replicates KV heads, or where its ranks
                        // hold every request in inputs of which EP's hold a share.
                        None if mode == Mode::Tp && d.probe_holds(Mode::Ep, b, context) => {
                            unfit = Some((batches[i], Mode::Tp))
                        }
                        None => unfit = Some((batches[i], Mode::Ep)),
                    }
                }
                Walk::Switch => return Ok(true),
                Walk::Done => return Ok(false),
            }
        })?;
        let costs: Calibration = (0..batches.len())
            .map_while(|i| Some((batches[i], *cost.get(&(Mode::Tp, i))?, *cost.get(&(Mode::Ep, i))?)))
            .collect();
        // TP outgrowing a batch sets T_h there, even with nothing timed before.
        let learned = !costs.is_empty() || matches!(unfit, Some((_, Mode::Tp)));
        Ok(learned.then_some(Measured { costs, unfit, context }))
    }

    /// Whether the device runs decode steps as graphs (`false` without one).
    pub fn records_graphs(&self) -> bool {
        self.device.as_ref().is_some_and(crate::device::exec::Executor::records_graphs)
    }

    /// Refuses work that must run before serving while a request is in
    /// flight (a warm-up switch would move its KV).
    fn idle_or(&self, what: &str) -> Result<(), EngineError> {
        match self.inflight() {
            0 => Ok(()),
            n => Err(EngineError::Capacity(format!("{what} happens before serving: {n} requests are in flight"))),
        }
    }

    /// Runs `f` on the device before serving, first in the current mode;
    /// while `f` says to go on, the twin switches to the plan's other mode
    /// and runs it again there. Each switch is a weight-only warm-up
    /// switch, taken while no request is active (only the reshard runs, no
    /// KV moves), and none is a serving event (no switch record is kept,
    /// and a graph replay counts as after a switch only after a later live
    /// one). Refused while a request is in flight. Whatever happens, the
    /// twin ends in the mode it started in. Nothing without a device.
    fn walk_modes(
        &mut self,
        what: &str,
        mut f: impl FnMut(&mut crate::device::exec::Executor, Mode) -> Result<bool, crate::device::exec::ExecError>,
    ) -> Result<(), EngineError> {
        self.idle_or(what)?;
        if self.device.is_none() {
            return Ok(());
        }
        let (start, events) = (self.mode, self.events.len());
        let mut ran = Ok(());
        loop {
            let mode = self.mode;
            let Some(d) = self.device.as_mut() else { break };
            match f(d, mode) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    ran = Err(EngineError::Backend(format!("{what}: {e}")));
                    break;
                }
            }
            let Some(&other) = self.plan.modes.iter().find(|&&m| m != mode) else { break };
            match self.switch_to(other) {
                Ok(true) => {}
                Ok(false) => {
                    ran = Err(EngineError::Backend(format!(
                        "{what}: the warm-up switch into {} was refused",
                        other.name()
                    )));
                    break;
                }
                Err(e) => {
                    ran = Err(e.into());
                    break;
                }
            }
        }
        // Back to the starting mode whatever happened (a weight-only switch:
        // nothing is in flight), and no serving switch recorded.
        let back = if self.mode == start { Ok(true) } else { self.switch_to(start) };
        self.events.truncate(events);
        ran?;
        if !back? {
            return Err(EngineError::Backend(format!("{what}: the switch back to {} was refused", start.name())));
        }
        if let Some(d) = self.device.as_mut() {
            d.rebase_graphs();
        }
        Ok(())
    }

    /// What the device's decode graphs did so far (`None` without a device).
    pub fn graph_stats(&self) -> Option<crate::device::exec::GraphStats> {
        self.device.as_ref().map(crate::device::exec::Executor::graph_stats)
    }

    /// The device's weight reshards so far, warm-up switches included
    /// (`None` without a device).
    pub fn device_reshards(&self) -> Option<u64> {
        self.device.as_ref().map(crate::device::exec::Executor::reshards)
    }

    /// The (mode, bucket)s whose decode graph the device keeps.
    pub fn graph_keys(&self) -> Vec<(Mode, u32)> {
        self.device.as_ref().map(crate::device::exec::Executor::graph_keys).unwrap_or_default()
    }

    /// Why the device refused to record a decode graph, per (mode, bucket).
    pub fn graph_refusals(&self) -> Vec<String> {
        self.device.as_ref().map(crate::device::exec::Executor::graph_refusals).unwrap_or_default()
    }

    /// Routed entries whose device routing was checked (`None` without a device).
    pub fn device_routing_checked(&self) -> Option<u64> {
        self.device.as_ref().map(crate::device::exec::Executor::routing_checked)
    }

    /// The attached device's description (`None` without a device, or when
    /// it has nothing to add).
    pub fn device_description(&self) -> Option<String> {
        self.device.as_ref().and_then(crate::device::exec::Executor::describe)
    }

    /// How the device's slot swaps overlapped serving (`None` without a device).
    pub fn swap_overlap(&self) -> Option<crate::device::exec::SwapOverlap> {
        self.device.as_ref().map(crate::device::exec::Executor::swap_overlap)
    }

    /// Routed (token, expert) entries per MoE layer and expert since the
    /// engine started, as Zepp's drift statistics count them (on a device,
    /// what its routing counted; a graph's padding rows are none).
    pub fn routed_loads(&self) -> Vec<Vec<f64>> {
        self.slots.total()
    }

    pub fn swaps(&self) -> u64 {
        self.slots.swaps
    }
    /// When a Zepp placement is re-planned on drifted loads.
    pub fn set_swap_policy(&mut self, policy: moe::SwapPolicy) {
        self.slots.policy_swap = policy;
    }

    /// Exchanges the contents of two EP expert slots of `layer` between the
    /// two ranks (weights, block scales and biases): a direct transfer of
    /// each slot's bytes, the slots' addresses unchanged, so every view,
    /// descriptor and kernel argument stays valid. The bytes are the plan's
    /// (`transfers::slot_exchanges`); on a device they move as its compiled
    /// `expert_swap` program on the device's side stream, beside the next
    /// step, which waits for them before that layer's expert computation.
    fn exchange_slots(&mut self, layer: usize, s: moeforge_plan::placement::Swap) -> Result<(), EngineError> {
        if let Some(dev) = self.device.as_mut() {
            return dev.exchange_slots(layer as u32, &s).map(|_| ()).map_err(|e| EngineError::Backend(e.to_string()));
        }
        if s.a >= self.ranks.len() || s.b >= self.ranks.len() {
            return Err(EngineError::Backend(format!(
                "a slot swap between GPUs {} and {} of {}",
                s.a,
                s.b,
                self.ranks.len()
            )));
        }
        for x in moeforge_plan::transfers::slot_exchanges(&self.plan, layer as u32, &s) {
            let (a, b, n) = (x.a_offset as usize, x.b_offset as usize, x.bytes as usize);
            let staged = self.ranks[s.a].buf.get(a..a + n).map(<[u8]>::to_vec);
            let other = self.ranks[s.b].buf.get(b..b + n).map(<[u8]>::to_vec);
            let (Some(x), Some(y)) = (staged, other) else {
                return Err(EngineError::Backend(format!("a slot swap of layer {layer} lies outside the buffers")));
            };
            self.ranks[s.a].buf[a..a + n].copy_from_slice(&y);
            self.ranks[s.b].buf[b..b + n].copy_from_slice(&x);
        }
        Ok(())
    }
    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }
    pub fn request(&self, id: RequestId) -> Option<&Live> {
        self.requests.get(&id)
    }
    pub fn finished(&self) -> &[RequestId] {
        &self.finished
    }
    /// Requests admitted and not finished.
    pub fn inflight(&self) -> usize {
        self.requests.len() - self.done.len()
    }
    pub fn idle(&self) -> bool {
        self.inflight() == 0
    }

    /// The bytes of `role`'s weight at layer `layer` as rank `rank` holds
    /// them in `mode`'s view, for inspection and tests.
    pub fn view_bytes(&self, rank: usize, mode: Mode, role: TensorRole, layer: u32) -> Option<&[u8]> {
        let v = self.views.get(&(mode, role)).filter(|v| v.covers(layer))?;
        let at = v.offset_of(layer) as usize;
        self.ranks.get(rank)?.buf.get(at..at + v.bytes() as usize)
    }

    /// The same view's bytes as the attached device holds them (`None`
    /// without a device, or when the view does not cover `layer`).
    pub fn device_view_bytes(&mut self, rank: usize, mode: Mode, role: TensorRole, layer: u32) -> Option<Vec<u8>> {
        let v = self.views.get(&(mode, role)).filter(|v| v.covers(layer))?;
        let (at, len) = (v.offset_of(layer), v.bytes());
        self.device.as_mut()?.download(rank, at, len).ok()
    }

    /// The experts rank `rank`'s EP slots of (absolute) layer `layer` hold
    /// now, in slot order: the placement's, then every swap since.
    pub fn slot_experts(&self, layer: usize, rank: usize) -> &[u32] {
        self.slots.experts(layer, rank)
    }

    /// The same, as the attached device's dispatch routes to them (`None`
    /// without a device).
    pub fn device_slot_experts(&self, layer: usize, rank: usize) -> Option<Vec<u32>> {
        let moe = layer.checked_sub(self.slots.first_moe_layer())?;
        self.device.as_ref()?.slot_experts(moe, rank).map(<[u32]>::to_vec)
    }

    /// Runs until every submitted request finished (or `max_steps`).
    pub fn run_to_completion(&mut self, max_steps: usize) -> Result<(), EngineError> {
        for _ in 0..max_steps {
            if self.idle() {
                break;
            }
            self.step()?;
        }
        Ok(())
    }

    fn pages_needed(&self, id: RequestId) -> usize {
        self.requests.get(&id).map_or(0, |r| r.reserve().div_ceil(self.plan.kv.page_tokens.max(1) as usize))
    }

    /// Pages request `id` reserves on a GPU of `role`: a prefill server
    /// holds its prompt's KV only (the decode server takes the rest), any
    /// other rank its whole sequence.
    fn pages_on(&self, role: Option<Role>, id: RequestId) -> usize {
        match role {
            Some(Role::Prefill) => {
                self.requests.get(&id).map_or(0, |r| r.prompt.len().div_ceil(self.plan.kv.page_tokens.max(1) as usize))
            }
            _ => self.pages_needed(id),
        }
    }

    /// Pages reserved on a rank by the requests it serves.
    fn reserved(&self, r: &Rank) -> usize {
        r.requests.iter().map(|id| self.pages_on(r.role, *id)).sum()
    }

    /// Admits waiting requests by the shared rule ([`crate::batching`]):
    /// in arrival order while their full KV reservation fits.
    fn admit(&mut self) {
        let mut waiting = std::mem::take(&mut self.waiting);
        crate::batching::admit_fifo(&mut waiting, |id| self.place(id));
        self.waiting = waiting;
    }

    /// Places one request if its reservation fits: EP on the least-loaded
    /// rank with room, TP on every rank. In a role plan this is the request
    /// scheduler's first choice: the prefill server with the fewest tokens
    /// to process that has room for the prompt's KV (the decode server is
    /// chosen at the handoff, [`Twin::hand_off`]).
    fn place(&mut self, id: RequestId) -> bool {
        // On a device a rank's step carries at most `step_tokens` tokens:
        // a prompt joins a rank whose next step has room for it.
        let budget = self.device.as_ref().map_or(usize::MAX, crate::device::exec::Executor::step_tokens);
        let prompt = self.requests.get(&id).map_or(0, |q| q.prompt.len());
        let fits = |r: &Rank| self.next_step_tokens(r).saturating_add(prompt) <= budget;
        if self.roles.is_some() {
            let best = (0..self.ranks.len())
                .filter(|&r| self.ranks[r].role == Some(Role::Prefill))
                .filter(|&r| {
                    let rank = &self.ranks[r];
                    self.reserved(rank) + self.pages_on(rank.role, id) <= rank.pages.total as usize && fits(rank)
                })
                .min_by_key(|&r| (self.load_tokens(r), self.ranks[r].requests.len(), r));
            let Some(r) = best else { return false };
            self.ranks[r].requests.push(id);
            return true;
        }
        let need = self.pages_needed(id);
        let room = |r: &Rank| self.reserved(r) + need <= r.pages.total as usize && fits(r);
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

    /// Whether request `id` on `rank` had its prefill on a prefill server
    /// (a prompt is prefilled in one step) and waits there for the handoff:
    /// it is held, not computed.
    fn awaits_handoff(&self, rank: &Rank, id: RequestId) -> bool {
        rank.role == Some(Role::Prefill) && self.requests.get(&id).is_some_and(|q| q.cached > 0)
    }

    /// Tokens rank `r`'s next step computes: a whole prompt for a request
    /// not prefilled yet, one token for a decoding one, none for one held
    /// for its handoff.
    fn next_step_tokens(&self, r: &Rank) -> usize {
        r.requests
            .iter()
            .filter(|&&id| !self.awaits_handoff(r, id))
            .filter_map(|id| self.requests.get(id))
            .map(|q| if q.cached == 0 { q.prompt.len() } else { 1 })
            .sum()
    }

    fn load_tokens(&self, r: usize) -> usize {
        self.ranks[r].requests.iter().filter_map(|id| self.requests.get(id)).map(Live::len).sum()
    }

    /// ExpertPlex's prefill→decode KV handoff, after a step: every request
    /// whose prefill finished on a prefill server (and that has tokens left)
    /// moves to the decode server the request scheduler picks, the one with
    /// the fewest reserved KV pages (then requests) that has room for the
    /// whole sequence. Its KV pages are copied page by page into pages of
    /// the decode server's pool (both use the attention servers' one page
    /// format), its page table follows, and the prefill server's pages are
    /// freed. A request no decode server has room for waits on its prefill
    /// server, which does not decode it. The decode server's reservation
    /// covers every page copied (admission reserved them); a free list
    /// shorter than the page table would be a broken reservation, and is an
    /// error, never a truncated page table.
    fn hand_off(&mut self) -> Result<(), EngineError> {
        if self.roles.is_none() {
            return Ok(());
        }
        let geom = paging::KvGeom::of(&self.plan, Mode::Ep);
        for src in 0..self.ranks.len() {
            if self.ranks[src].role != Some(Role::Prefill) {
                continue;
            }
            for id in self.ranks[src].requests.clone() {
                let Some(q) = self.requests.get(&id) else { continue };
                if q.done() || q.cached < q.prompt.len() {
                    continue;
                }
                let need = self.pages_needed(id);
                let Some(dst) = (0..self.ranks.len())
                    .filter(|&r| self.ranks[r].role == Some(Role::Decode))
                    .filter(|&r| self.reserved(&self.ranks[r]) + need <= self.ranks[r].pages.total as usize)
                    .min_by_key(|&r| (self.reserved(&self.ranks[r]), self.ranks[r].requests.len(), r))
                else {
                    continue;
                };
                let held = self.ranks[src].tables.get(&id).map_or(0, Vec::len);
                if self.ranks[dst].pages.free.len() < held {
                    return Err(EngineError::Backend(format!(
                        "request {id}: decode server {dst} reserved its {need} KV pages but has {} free for the {held} \
                         prefilled ones",
                        self.ranks[dst].pages.free.len()
                    )));
                }
                let from = self.ranks[src].tables.remove(&id).unwrap_or_default();
                let mut to = Vec::with_capacity(from.len());
                for &pg in &from {
                    let Some(np) = self.ranks[dst].pages.free.pop_front() else { continue };
                    if self.device.is_none() {
                        let (a, b) =
                            (geom.base + pg as usize * geom.page_bytes, geom.base + np as usize * geom.page_bytes);
                        let page = self.ranks[src].buf.get(a..a + geom.page_bytes).map(<[u8]>::to_vec);
                        if let (Some(page), Some(out)) = (page, self.ranks[dst].buf.get_mut(b..b + geom.page_bytes)) {
                            out.copy_from_slice(&page);
                        }
                    }
                    to.push(np);
                }
                // On a device the pages move as the compiled `kv_handoff`
                // program, peer to peer.
                if let Some(dev) = self.device.as_mut() {
                    let pairs: Vec<(u32, u32)> = from.iter().copied().zip(to.iter().copied()).collect();
                    dev.hand_off_pages(src, dst, &pairs).map_err(|e| EngineError::Backend(e.to_string()))?;
                }
                self.handoffs.requests += 1;
                self.handoffs.pages += to.len() as u64;
                self.handoffs.bytes += (to.len() * geom.page_bytes) as u64;
                self.ranks[src].pages.free.extend(from);
                self.ranks[src].requests.retain(|x| *x != id);
                self.ranks[dst].tables.insert(id, to);
                self.ranks[dst].requests.push(id);
            }
        }
        Ok(())
    }

    /// Frees a finished or cancelled request's pages on every rank.
    fn release(&mut self, id: RequestId) {
        for rank in &mut self.ranks {
            if let Some(pages) = rank.tables.remove(&id) {
                rank.pages.free.extend(pages);
            }
            rank.requests.retain(|x| *x != id);
        }
    }

    fn retire(&mut self) -> Vec<RequestId> {
        let done: Vec<RequestId> =
            self.requests.values().filter(|r| r.done() && !self.done.contains(&r.id)).map(|r| r.id).collect();
        for &id in &done {
            self.release(id);
            self.finished.push(id);
            self.done.insert(id);
        }
        done
    }
}

impl Engine for Twin {
    fn submit(&mut self, req: Request) -> Result<(), EngineError> {
        if self.requests.contains_key(&req.id) {
            return Err(EngineError::BadRequest(format!("request id {} is already in use", req.id)));
        }
        if req.max_new == 0 {
            return Err(EngineError::BadRequest(format!("request {} asks for no tokens (max_new = 0)", req.id)));
        }
        if req.prompt.is_empty() {
            return Err(EngineError::BadRequest(format!("request {} has an empty prompt", req.id)));
        }
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= self.model.vocab) {
            return Err(EngineError::BadRequest(format!(
                "token {t} of request {} is outside the vocabulary of {}",
                req.id, self.model.vocab
            )));
        }
        if let Some(most) = self.device.as_ref().map(crate::device::exec::Executor::step_tokens) {
            if req.prompt.len() > most {
                return Err(EngineError::Capacity(format!(
                    "request {}'s prompt of {} tokens is more than the {most} one step carries per rank on this \
                     device (the plan's step inputs; prompts are prefilled in one step)",
                    req.id,
                    req.prompt.len()
                )));
            }
        }
        let page = self.plan.kv.page_tokens.max(1) as usize;
        let ep_pages = self.plan.kv.ep.pages as usize;
        let tp_pages = self.plan.kv.tp.as_ref().map_or(usize::MAX, |t| t.pages as usize);
        let Some(tokens) = req.prompt.len().checked_add(req.max_new) else {
            return Err(EngineError::BadRequest(format!("request {} asks for {} tokens", req.id, req.max_new)));
        };
        if tokens as u64 > moeforge_plan::memory::MAX_SEQ {
            return Err(EngineError::Capacity(format!(
                "request {} needs {tokens} tokens (prompt + max_new); the plan's page tables hold {} per request",
                req.id,
                moeforge_plan::memory::MAX_SEQ
            )));
        }
        let need = tokens.div_ceil(page);
        if need > ep_pages.min(tp_pages) {
            return Err(EngineError::Capacity(format!(
                "request {} needs {need} KV pages of {page} tokens; one rank holds {}",
                req.id,
                ep_pages.min(tp_pages)
            )));
        }
        self.waiting.push_back(req.id);
        let sampler = crate::sampling::Sampler::new(req.sampling);
        let live = Live { id: req.id, prompt: req.prompt, max_new: req.max_new, generated: vec![], cached: 0, sampler };
        self.requests.insert(req.id, live);
        Ok(())
    }

    /// Admits, runs one forward step over every running request (its whole
    /// prompt on its first step, one token after), appends greedy tokens,
    /// retires finished requests.
    fn step(&mut self) -> Result<StepOutput, EngineError> {
        self.admit();
        let t0 = Instant::now();
        let running: usize = match self.mode {
            Mode::Tp => self.ranks.first().map_or(0, |r| r.requests.len()),
            // A role plan's prefilled request waiting on its prefill server
            // for a decode server's room is held, not run.
            Mode::Ep => {
                self.ranks.iter().map(|r| r.requests.iter().filter(|&&id| !self.awaits_handoff(r, id)).count()).sum()
            }
        };
        let (tokens, produced) = self.forward()?;
        self.hand_off()?;
        if self.mode == Mode::Ep {
            // On a device the dispatch routed the rows: its counts are the window's.
            if let Some(dev) = self.device.as_mut() {
                self.slots.record(dev.take_expert_loads());
            }
            // (The twin's table already holds every swap: a failed exchange
            // fails the step, and the device's table stays behind.)
            for (layer, s) in self.slots.end_step() {
                self.exchange_slots(layer, s)?;
            }
        }
        let finished = self.retire();
        let out = StepOutput {
            step: self.step,
            mode: Some(self.mode),
            running,
            tokens,
            produced,
            finished,
            seconds: t0.elapsed().as_secs_f64(),
        };
        self.step += 1;
        Ok(out)
    }

    fn cancel(&mut self, id: RequestId) -> bool {
        if self.done.contains(&id) || self.requests.remove(&id).is_none() {
            return false;
        }
        self.waiting.retain(|x| *x != id);
        self.release(id);
        self.logits.remove(&id);
        true
    }

    fn switch(&mut self, to: Mode) -> Result<SwitchEvent, EngineError> {
        if to == self.mode {
            let e = SwitchEvent {
                step: self.step,
                from: to,
                to,
                inflight: self.inflight(),
                cancelled: Some(format!("already in {}", to.name())),
                weight_bytes_moved: 0,
                kv_bytes_moved: 0,
                seconds: 0.0,
            };
            self.events.push(e.clone());
            return Ok(e);
        }
        self.switch_to(to)?;
        self.events.last().cloned().ok_or_else(|| EngineError::Backend("the switch left no event".into()))
    }

    fn forget(&mut self, id: RequestId) {
        if self.done.remove(&id) {
            self.requests.remove(&id);
            self.logits.remove(&id);
        }
    }

    fn probe_decode_costs(
        &mut self,
        batches: &[usize],
        steps: usize,
        context: u32,
    ) -> Result<Option<Measured>, EngineError> {
        self.probe_decode_steps(batches, steps, context)
    }

    fn stats(&self) -> Stats {
        let total: u64 = self.ranks.iter().map(|r| u64::from(r.pages.total)).sum();
        let free: u64 = self.ranks.iter().map(|r| r.pages.free.len() as u64).sum();
        let graphs = self.graph_stats().unwrap_or_default();
        Stats {
            mode: Some(self.mode),
            modes: self.plan.modes.clone(),
            waiting: self.waiting.len(),
            running: self.inflight().saturating_sub(self.waiting.len()),
            finished: self.finished.len(),
            steps: self.step,
            kv_pages_used: total - free,
            kv_pages_total: total,
            decode_graphs: self.graph_keys().len() as u64,
            graph_replays: graphs.replayed,
        }
    }
}

/// What [`Twin::probe_decode_steps`] does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Walk {
    /// Time batch `i` in the current mode.
    Time(usize),
    /// Switch to the other mode (the current one has timed what it can
    /// before the other catches up).
    Switch,
    Done,
}

/// The crossover walk over `n` batches in increasing order, given what was
/// timed so far (`cost[(mode, i)]`) and the mode the twin is in: the first
/// batch this mode has not timed is timed; once a batch is timed in both
/// modes, the walk ends if EP's cost is at most TP's (the crossover) and
/// otherwise goes on in this mode; a batch timed in this mode only waits
/// for the other (a switch). `ended` (a batch did not fit) ends it.
fn crossover_walk(n: usize, cost: &BTreeMap<(Mode, usize), f64>, mode: Mode, ended: bool) -> Walk {
    let pair = |i: usize| Some((*cost.get(&(Mode::Tp, i))?, *cost.get(&(Mode::Ep, i))?));
    // The batches both modes timed are a prefix; the walk ends at a crossover in it.
    if ended || (0..n).map_while(pair).any(|(tp, ep)| ep <= tp) {
        return Walk::Done;
    }
    match (0..n).find(|&i| !cost.contains_key(&(mode, i))) {
        // This mode is ahead of the other: the other's turn.
        Some(i) if i > 0 && pair(i - 1).is_none() => Walk::Switch,
        Some(i) => Walk::Time(i),
        // This mode timed every batch: the other still may not have.
        None if n > 0 && pair(n - 1).is_none() => Walk::Switch,
        None => Walk::Done,
    }
}

/// The views by mode and role of every weight (and fp8 weight's block
/// scales).
type Views = BTreeMap<(Mode, TensorRole), View>;

/// The weight views the forward pass reads, by mode and role, each with the
/// shape and dtype the model's arithmetic needs (so no edited plan can make
/// the twin read outside a view), the block-scale views of its fp8 weights,
/// and the KV geometry the model implies.
fn check_views(m: &TwinModel, plan: &MemoryPlan) -> Result<(Views, Views, Views), TwinError> {
    let p = plan.group as usize;
    let tp_kv = plan.kv.tp.as_ref().map_or(0, |t| t.heads_per_rank as usize);
    let mut out = BTreeMap::new();
    let mut scales = BTreeMap::new();
    let mut biases = BTreeMap::new();
    for &mode in &plan.modes {
        for role in m.roles() {
            let v = plan
                .view(mode, role, TensorPart::Weight)
                .ok_or_else(|| TwinError::MissingView(mode.name(), role.name(TensorPart::Weight)))?;
            let Some((shape, dtype)) = m.view_shape(role, mode, p, tp_kv) else { continue };
            if v.shape != shape || v.dtype != dtype || v.layers != m.layers_of(role) {
                return Err(TwinError::ViewShape {
                    mode: mode.name(),
                    tensor: v.tensor.clone(),
                    found: format!("{:?} {} for layers {:?}", v.shape, v.dtype.name(), v.layers),
                    expected: format!("{shape:?} {}", dtype.name()),
                });
            }
            out.insert((mode, role), v.clone());
            if let Some(shape) = m.bias_shape(role, mode, p, tp_kv) {
                let b = plan
                    .view(mode, role, TensorPart::Bias)
                    .ok_or_else(|| TwinError::MissingView(mode.name(), role.name(TensorPart::Bias)))?;
                if b.shape != shape || b.dtype != DType::Bf16 || b.layers != v.layers {
                    return Err(TwinError::ViewShape {
                        mode: mode.name(),
                        tensor: b.tensor.clone(),
                        found: format!("{:?} {} for layers {:?}", b.shape, b.dtype.name(), b.layers),
                        expected: format!("{shape:?} bf16"),
                    });
                }
                biases.insert((mode, role), b.clone());
            }
            let Some(shape) = m.scale_view_shape(role, mode, p, tp_kv) else { continue };
            let s = plan
                .view(mode, role, TensorPart::ScaleInv)
                .ok_or_else(|| TwinError::MissingView(mode.name(), role.name(TensorPart::ScaleInv)))?;
            if s.shape != shape || s.dtype != DType::F32 || s.layers != v.layers {
                return Err(TwinError::ViewShape {
                    mode: mode.name(),
                    tensor: s.tensor.clone(),
                    found: format!("{:?} {} for layers {:?}", s.shape, s.dtype.name(), s.layers),
                    expected: format!("{shape:?} f32"),
                });
            }
            scales.insert((mode, role), s.clone());
        }
    }
    let kv = &plan.kv;
    // In TP every rank's query heads must find their KV heads on the rank.
    let group = m.heads / m.kv_heads.max(1);
    let tp_ok = !plan.modes.contains(&Mode::Tp)
        || (m.heads.is_multiple_of(p)
            && m.expert_ffn.is_multiple_of(p)
            && kv.tp_heads.len() == p
            && (0..p).all(|r| {
                let [qa, qb] = moeforge_plan::memory::head_block(m.heads as u32, p as u32, r as u32);
                let [ka, kb] = kv.tp_heads[r];
                (qa..qb).all(|hq| (ka..kb).contains(&(hq / group.max(1) as u32)))
            }));
    let kv_ok = kv.head_token_bytes == m.kv_token_bytes() as u64
        && kv.ep.heads_per_rank as usize == m.kv_heads
        && kv.tp_heads.iter().all(|&[a, b]| (b as usize) <= m.kv_heads && a < b)
        && tp_ok;
    if !kv_ok {
        return Err(TwinError::ViewShape {
            mode: "kv",
            tensor: "kv pages".into(),
            found: format!("{} bytes per head and token, {} heads", kv.head_token_bytes, kv.ep.heads_per_rank),
            expected: format!("{} bytes, {} heads", m.kv_token_bytes(), m.kv_heads),
        });
    }
    Ok((out, scales, biases))
}

#[cfg(test)]
mod tests {
    use super::{crossover_walk, Walk};
    use moeforge_plan::memory::Mode;
    use std::collections::BTreeMap;

    /// Runs the walk from `start` on fixed costs (`tp[i]`, `ep[i]`; batch
    /// `fits` and later ones do not fit): the (mode, batch) timed in order,
    /// and the switches.
    fn walk(start: Mode, tp: &[f64], ep: &[f64], fits: usize) -> (Vec<(Mode, usize)>, usize) {
        let (mut mode, mut cost, mut ended) = (start, BTreeMap::new(), false);
        let (mut timed, mut switches) = (vec![], 0);
        for _ in 0..100 {
            match crossover_walk(tp.len(), &cost, mode, ended) {
                Walk::Time(i) if i >= fits => ended = true,
                Walk::Time(i) => {
                    timed.push((mode, i));
                    cost.insert((mode, i), if mode == Mode::Tp { tp[i] } else { ep[i] });
                }
                Walk::Switch => {
                    switches += 1;
                    mode = if mode == Mode::Tp { Mode::Ep } else { Mode::Tp };
                }
                Walk::Done => return (timed, switches),
            }
        }
        panic!("the walk did not end: {timed:?}");
    }

    #[test]
    fn the_crossover_walk_zig_zags_and_stops_at_the_first_batch_where_ep_is_no_slower() {
        use Mode::{Ep, Tp};
        // EP is no slower first at batch 2 (3 ≤ 3): batch 3 is never timed.
        let (timed, switches) = walk(Ep, &[1.0, 2.0, 3.0, 4.0], &[2.0, 3.0, 3.0, 1.0], 4);
        assert_eq!(timed, [(Ep, 0), (Tp, 0), (Tp, 1), (Ep, 1), (Ep, 2), (Tp, 2)]);
        assert_eq!(switches, 3);
        // Never: every batch in both modes, one switch per batch.
        let (timed, switches) = walk(Tp, &[1.0, 1.0, 1.0], &[2.0, 2.0, 2.0], 3);
        assert_eq!(timed, [(Tp, 0), (Ep, 0), (Ep, 1), (Tp, 1), (Tp, 2), (Ep, 2)]);
        assert_eq!(switches, 3);
        // A crossover at the first batch.
        assert_eq!(walk(Tp, &[2.0, 1.0], &[1.0, 9.0], 2), (vec![(Tp, 0), (Ep, 0)], 1));
        // Batch 1 does not fit (in the first mode to reach it): the walk ends
        // with batch 0 timed in both modes.
        assert_eq!(walk(Ep, &[1.0, 1.0, 1.0], &[2.0, 2.0, 2.0], 1), (vec![(Ep, 0), (Tp, 0)], 1));
        assert_eq!(walk(Ep, &[], &[], 0), (vec![], 0));
    }
}
