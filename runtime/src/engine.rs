//! The step-level engine interface every backend implements and every
//! driver uses: `moeforge run`, the coming server and the switch policy
//! drive engines only through [`Engine`], so a new backend (the emulated
//! device, CUDA) plugs in without touching them.
//!
//! An engine owns its requests from [`Engine::submit`] to their last token.
//! Each [`Engine::step`] admits what fits, runs one forward step over every
//! running request and reports the tokens it produced, in order, and the
//! requests that finished. [`Engine::switch`] changes the parallelism mode
//! between steps (or says why it cannot), and [`Engine::stats`] is what a
//! policy or a metrics endpoint reads.

use crate::policy::Measured;
pub use crate::sampling::Sampling;
use moeforge_plan::memory::Mode;

pub type RequestId = u64;

/// A generation request: `max_new` tokens after `prompt`, each picked by
/// `sampling` (greedy unless a temperature is given).
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub max_new: usize,
    pub sampling: Sampling,
}

impl Request {
    /// A greedy request.
    pub fn new(id: RequestId, prompt: Vec<u32>, max_new: usize) -> Request {
        Request { id, prompt, max_new, sampling: Sampling::default() }
    }
    pub fn with_sampling(mut self, sampling: Sampling) -> Request {
        self.sampling = sampling;
        self
    }
}

/// What one step did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOutput {
    pub step: usize,
    pub mode: Option<Mode>,
    /// Requests that ran, and the tokens they processed.
    pub running: usize,
    pub tokens: usize,
    /// The tokens generated this step, one per running request, in order.
    pub produced: Vec<(RequestId, u32)>,
    /// Requests whose last token was produced this step.
    pub finished: Vec<RequestId>,
    pub seconds: f64,
}

/// A switch that happened, or was cancelled.
#[derive(Clone, Debug, PartialEq)]
pub struct SwitchEvent {
    /// The step it happened before.
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

/// An engine's state, as policies and metrics read it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub mode: Option<Mode>,
    pub modes: Vec<Mode>,
    pub waiting: usize,
    pub running: usize,
    pub finished: usize,
    pub steps: usize,
    /// KV pages in use and in total, over every rank.
    pub kv_pages_used: u64,
    pub kv_pages_total: u64,
    /// Decode graphs the device keeps (one per mode and batch bucket), and
    /// decode steps that replayed one so far (0 on a backend without them).
    pub decode_graphs: u64,
    pub graph_replays: u64,
}

impl Stats {
    /// Requests submitted and not finished (the switch policy's load).
    pub fn inflight(&self) -> usize {
        self.waiting + self.running
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request itself is invalid (empty prompt, unknown token, …).
    #[error("{0}")]
    BadRequest(String),
    /// The request can never fit (KV capacity), or the mode does not exist.
    #[error("{0}")]
    Capacity(String),
    /// The backend failed.
    #[error("{0}")]
    Backend(String),
}

/// One serving engine: a backend executing a bundle.
pub trait Engine {
    /// Queues a request; it is admitted when the engine's admission rule allows.
    fn submit(&mut self, req: Request) -> Result<(), EngineError>;
    /// Admits, runs one forward step over every running request, retires
    /// finished ones.
    fn step(&mut self) -> Result<StepOutput, EngineError>;
    /// Drops a request, waiting or running, and frees its KV; false if the
    /// engine does not hold it.
    fn cancel(&mut self, id: RequestId) -> bool;
    /// Switches to `to` between steps; the event says whether it was
    /// cancelled (the target cannot hold the live KV cache) and what moved.
    fn switch(&mut self, to: Mode) -> Result<SwitchEvent, EngineError>;
    fn stats(&self) -> Stats;
    /// Drops what the engine keeps of a finished request (its tokens, for
    /// inspection); a long-running server calls it once it has delivered them.
    fn forget(&mut self, id: RequestId);
    /// Measures this engine's decode step cost in TP and in EP at each
    /// batch (requests in flight, each with `context` tokens cached) before
    /// serving, for `t_high = auto` (Moebius §4.5: on the decode graphs it
    /// will serve with; the median of `steps` each), `batches` in order
    /// until the crossover. `None` where the engine has no such steps to
    /// measure (the caller then takes the cost model's crossover); nothing
    /// it serves changes.
    fn probe_decode_costs(
        &mut self,
        batches: &[usize],
        steps: usize,
        context: u32,
    ) -> Result<Option<Measured>, EngineError> {
        let _ = (batches, steps, context);
        Ok(None)
    }
}

/// A boxed engine is an engine (servers hold `Box<dyn Engine + Send>`).
impl<E: Engine + ?Sized> Engine for Box<E> {
    fn submit(&mut self, req: Request) -> Result<(), EngineError> {
        (**self).submit(req)
    }
    fn step(&mut self) -> Result<StepOutput, EngineError> {
        (**self).step()
    }
    fn cancel(&mut self, id: RequestId) -> bool {
        (**self).cancel(id)
    }
    fn switch(&mut self, to: Mode) -> Result<SwitchEvent, EngineError> {
        (**self).switch(to)
    }
    fn stats(&self) -> Stats {
        (**self).stats()
    }
    fn forget(&mut self, id: RequestId) {
        (**self).forget(id)
    }
    fn probe_decode_costs(
        &mut self,
        batches: &[usize],
        steps: usize,
        context: u32,
    ) -> Result<Option<Measured>, EngineError> {
        (**self).probe_decode_costs(batches, steps, context)
    }
}
