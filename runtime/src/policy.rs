//! The switch policy (Moebius §4.5) and the driver that applies it to any
//! [`Engine`].
//!
//! In TP the [`Coordinator`] switches to EP as soon as the in-flight request
//! count exceeds T_h; in EP it switches back when the mean count over the
//! last W iterations (all spent in EP) is below T_ℓ ≤ T_h. After every
//! switch, or a switch cancelled by the KV capacity check, nothing happens
//! for the cooldown C. T_h = auto is calibrated at the TP/EP crossover of the
//! serving engine's measured decode steps ([`driver`], [`crossover`]);
//! T_ℓ = auto is 0.8·T_h.
//! The simulator runs the same coordinator on modeled iterations.

use crate::engine::{Engine, EngineError, StepOutput, SwitchEvent};
use moeforge_dsl::spec::{SwitchPolicy, Workload};
use moeforge_plan::memory::Mode;
use std::collections::VecDeque;
use std::time::Instant;

#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    pub t_high: u32,
    pub t_low: u32,
    pub window: usize,
    pub cooldown: f64,
    /// Whether T_h still has to be calibrated (`t_high = auto` in the spec);
    /// until [`Policy::with_t_high`] sets it, T_h is [`DEFAULT_T_HIGH`].
    pub calibrate: bool,
}

/// T_h before calibration: the paper's measured crossover on 8×H200.
pub const DEFAULT_T_HIGH: u32 = 256;

impl Policy {
    pub fn from_spec(s: &SwitchPolicy) -> Policy {
        let t_high = s.t_high.unwrap_or(DEFAULT_T_HIGH);
        Policy {
            t_high,
            t_low: s.t_low.unwrap_or((u64::from(t_high) * 4 / 5) as u32).min(t_high),
            window: s.window.max(1) as usize,
            cooldown: s.cooldown,
            calibrate: s.t_high.is_none(),
        }
    }

    /// Sets T_h (and an automatic T_ℓ = 0.8·T_h, kept below T_h).
    pub fn with_t_high(mut self, t_high: u32, spec_t_low: Option<u32>) -> Policy {
        self.t_high = t_high.max(1);
        self.t_low = spec_t_low.unwrap_or((u64::from(self.t_high) * 4 / 5) as u32).min(self.t_high);
        self.calibrate = false;
        self
    }
}

#[derive(Clone, Debug)]
pub struct Coordinator {
    pub policy: Policy,
    history: VecDeque<usize>,
    last: Option<f64>,
}

impl Coordinator {
    pub fn new(policy: Policy) -> Coordinator {
        Coordinator { policy, history: VecDeque::new(), last: None }
    }

    /// The mode to switch to, if any, given this iteration's in-flight count.
    pub fn decide(&mut self, mode: Mode, inflight: usize, now: f64) -> Option<Mode> {
        self.history.push_back(inflight);
        while self.history.len() > self.policy.window {
            self.history.pop_front();
        }
        if self.last.is_some_and(|t| now - t < self.policy.cooldown) {
            return None;
        }
        match mode {
            Mode::Tp => (inflight > self.policy.t_high as usize).then_some(Mode::Ep),
            Mode::Ep => {
                let full = self.history.len() == self.policy.window;
                let mean = self.history.iter().sum::<usize>() as f64 / self.history.len().max(1) as f64;
                (full && mean < f64::from(self.policy.t_low)).then_some(Mode::Tp)
            }
        }
    }

    /// A switch happened at `now`: start the cooldown and a fresh window.
    pub fn switched(&mut self, now: f64) {
        self.last = Some(now);
        self.history.clear();
    }

    /// A switch was cancelled by the capacity check: retry after the cooldown.
    pub fn cancelled(&mut self, now: f64) {
        self.last = Some(now);
    }
}

/// T_h at the TP/EP crossover: the smallest batch whose measured EP step
/// cost is at most TP's. `costs` holds (batch, tp seconds, ep seconds).
/// When EP never wins in the probed range, TP stays: `u32::MAX`.
pub fn crossover(costs: &[(usize, f64, f64)]) -> u32 {
    costs.iter().find(|(_, tp, ep)| ep <= tp).map_or(u32::MAX, |(b, _, _)| *b as u32)
}

/// Costs a calibration measured or modeled: (batch, TP seconds, EP seconds).
pub type Calibration = Vec<(usize, f64, f64)>;

/// The batches (requests in flight) the serving engine's calibration
/// probes, in order, until the first at which EP is no slower than TP: to
/// 256, the batch Moebius caps a rank's graphs at (§6.5: a TP rank holds
/// every request; its measured crossover on 8×H200 is 128–256).
pub const CALIBRATION_BATCHES: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// Decode steps timed per batch and mode (their median is the cost).
pub const CALIBRATION_STEPS: usize = 5;

/// The tokens each request of a calibration step has cached: the
/// workload's mean prompt plus half its mean output, a request halfway
/// through its decode. A decode step's attention reads every cached token
/// of every request (TP: each rank its share of the heads for all of them;
/// EP: all heads for its own), so the crossover moves with the context.
pub fn calibration_context(w: &Workload) -> u32 {
    use moeforge_plan::workload::{mean, Side};
    let tokens = mean(&w.input, Side::Input) + mean(&w.output, Side::Output) / 2.0;
    // Saturating: lengths are bounded by the model's context far below this.
    tokens.round().clamp(0.0, f64::from(u32::MAX)) as u32
}

/// What an engine measured for `t_high = auto` ([`Engine::probe_decode_costs`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Measured {
    /// The batches timed in both modes, in order, up to the crossover.
    pub costs: Calibration,
    /// The batch that did not fit the engine, where that ended the walk
    /// first: its requests' KV at `context` (a rank's pool, a request's page
    /// table) or a capacity error (its step inputs, its posts, its layout's
    /// room). The mode is TP's only where TP could not run it and EP's
    /// ranks hold it (its KV, its request headers and rows); EP's otherwise
    /// (EP's ranks cannot hold it either, or EP could not run it).
    pub unfit: Option<(usize, Mode)>,
    /// The tokens each probed request had cached.
    pub context: u32,
}

impl Measured {
    /// T_h: the crossover; where the walk ended first at a batch TP could
    /// not run in one step and EP could hold, that batch; `u32::MAX` where
    /// EP was slower at every batch probed (or EP could not hold the batch
    /// either: it is no place to go then).
    pub fn t_high(&self) -> u32 {
        match (crossover(&self.costs), self.unfit) {
            (u32::MAX, Some((b, Mode::Tp))) => u32::try_from(b).unwrap_or(u32::MAX),
            (t, _) => t,
        }
    }
}

/// How `t_high = auto` was set.
#[derive(Clone, Debug, PartialEq)]
pub enum Calibrated {
    /// Measured on the serving engine's own decode steps.
    Measured(Measured),
    /// The cost model's crossover, where the engine measures nothing, at
    /// `context` cached tokens a request.
    Modeled { costs: Calibration, context: u32 },
    /// Neither could be had (the reason): T_h is [`DEFAULT_T_HIGH`].
    Default(String),
}

impl Calibrated {
    /// The T_h it gives.
    pub fn t_high(&self) -> u32 {
        match self {
            Calibrated::Measured(m) => m.t_high(),
            Calibrated::Modeled { costs, .. } => crossover(costs),
            Calibrated::Default(_) => DEFAULT_T_HIGH,
        }
    }
}

/// `engine` under the deployment's switch policy when `use_policy`, the
/// spec enables switching and the plan holds both modes. `t_high = auto`
/// is set at the TP/EP crossover first (Moebius §4.5): measured on the
/// engine itself, both modes at [`CALIBRATION_BATCHES`] until the
/// crossover, each request with `context` tokens cached
/// ([`calibration_context`]), as it serves them (its decode graphs where
/// it records them); where it measures nothing (the CPU twin), the cost
/// model's from `modeled` (given the same context); where that fails too,
/// [`DEFAULT_T_HIGH`], and the reason is returned. Time is the wall clock.
pub fn driver<E: Engine>(
    switch: Option<&SwitchPolicy>,
    modes: &[Mode],
    use_policy: bool,
    mut engine: E,
    context: u32,
    modeled: impl FnOnce(u32) -> Result<Calibration, String>,
) -> Result<(Driver<E>, Option<Calibrated>), EngineError> {
    let mut chosen = switch.filter(|s| use_policy && s.enabled && modes.len() == 2).map(Policy::from_spec);
    let mut calibrated = None;
    if let Some(p) = chosen.clone().filter(|p| p.calibrate) {
        let c = match engine.probe_decode_costs(&CALIBRATION_BATCHES, CALIBRATION_STEPS, context)? {
            Some(costs) => Calibrated::Measured(costs),
            None => match modeled(context) {
                Ok(costs) => Calibrated::Modeled { costs, context },
                Err(why) => Calibrated::Default(why),
            },
        };
        chosen = Some(p.with_t_high(c.t_high(), switch.and_then(|s| s.t_low)));
        calibrated = Some(c);
    }
    Ok((Driver::new(engine, chosen).with_clock(Clock::Wall(Instant::now())), calibrated))
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

/// An engine under a switch policy: before each step the coordinator sees
/// the engine's load and may switch it.
pub struct Driver<E: Engine> {
    pub engine: E,
    coordinator: Option<Coordinator>,
    clock: Clock,
    steps: usize,
    /// Every switch the policy made or attempted.
    pub events: Vec<SwitchEvent>,
}

impl<E: Engine> Driver<E> {
    /// `policy = None`: the engine switches only when asked.
    pub fn new(engine: E, policy: Option<Policy>) -> Driver<E> {
        Driver {
            engine,
            coordinator: policy.map(Coordinator::new),
            clock: Clock::Wall(Instant::now()),
            steps: 0,
            events: vec![],
        }
    }

    pub fn with_clock(mut self, clock: Clock) -> Driver<E> {
        self.clock = clock;
        self
    }

    pub fn policy(&self) -> Option<&Policy> {
        self.coordinator.as_ref().map(|c| &c.policy)
    }

    fn now(&self) -> f64 {
        match self.clock {
            Clock::Wall(t0) => t0.elapsed().as_secs_f64(),
            Clock::Logical { step_seconds } => self.steps as f64 * step_seconds,
        }
    }

    /// Consults the policy (switching if it says so), then steps the engine.
    pub fn step(&mut self) -> Result<StepOutput, EngineError> {
        let stats = self.engine.stats();
        let now = self.now();
        if let (Some(c), Some(mode)) = (self.coordinator.as_mut(), stats.mode) {
            // A target the engine's plan does not hold is no decision at all.
            let decision = c.decide(mode, stats.inflight(), now).filter(|t| stats.modes.contains(t));
            if let Some(target) = decision {
                let e = self.engine.switch(target)?;
                if e.cancelled.is_some() {
                    c.cancelled(now);
                } else {
                    c.switched(now);
                }
                self.events.push(e);
            }
        }
        let out = self.engine.step()?;
        self.steps += 1;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(t_high: u32, t_low: u32, window: usize, cooldown: f64) -> Policy {
        Policy { t_high, t_low, window, cooldown, calibrate: false }
    }

    #[test]
    fn tp_switches_to_ep_as_soon_as_the_count_exceeds_t_high() {
        let mut c = Coordinator::new(policy(10, 8, 4, 0.0));
        assert_eq!(c.decide(Mode::Tp, 10, 0.0), None);
        assert_eq!(c.decide(Mode::Tp, 11, 1.0), Some(Mode::Ep));
    }

    #[test]
    fn ep_waits_for_a_full_window_below_t_low() {
        let mut c = Coordinator::new(policy(10, 8, 3, 0.0));
        c.switched(0.0);
        assert_eq!(c.decide(Mode::Ep, 2, 1.0), None); // window not full
        assert_eq!(c.decide(Mode::Ep, 2, 2.0), None);
        assert_eq!(c.decide(Mode::Ep, 30, 3.0), None); // mean 11.3 ≥ 8
        assert_eq!(c.decide(Mode::Ep, 2, 4.0), None); // mean 11.3
        assert_eq!(c.decide(Mode::Ep, 2, 5.0), None); // mean 11.3 (30, 2, 2)
        assert_eq!(c.decide(Mode::Ep, 2, 6.0), Some(Mode::Tp)); // mean 2
    }

    #[test]
    fn cooldown_blocks_switches() {
        let mut c = Coordinator::new(policy(10, 8, 1, 5.0));
        c.switched(0.0);
        assert_eq!(c.decide(Mode::Tp, 100, 4.9), None);
        assert_eq!(c.decide(Mode::Tp, 100, 5.0), Some(Mode::Ep));
        c.cancelled(5.0);
        assert_eq!(c.decide(Mode::Tp, 100, 6.0), None);
    }

    #[test]
    fn auto_thresholds_follow_the_paper() {
        let p = Policy::from_spec(&SwitchPolicy { enabled: true, t_high: None, t_low: None, window: 8, cooldown: 5.0 });
        assert_eq!((p.t_high, p.t_low, p.calibrate), (256, 204, true));
        let p = p.with_t_high(32, None);
        assert_eq!((p.t_high, p.t_low, p.calibrate), (32, 25, false));
        assert_eq!(crossover(&[(1, 1.0, 2.0), (4, 2.0, 2.5), (16, 4.0, 3.0), (64, 9.0, 5.0)]), 16);
        assert_eq!(crossover(&[(1, 1.0, 2.0), (4, 2.0, 2.5)]), u32::MAX);
        // A walk that ended at a batch TP could not run puts T_h there; a
        // crossover before it, or none and nothing unfit, as before.
        let m = |costs: &[(usize, f64, f64)], unfit| Measured { costs: costs.to_vec(), unfit, context: 0 };
        assert_eq!(m(&[(1, 1.0, 2.0), (4, 2.0, 2.5)], Some((16, Mode::Tp))).t_high(), 16);
        assert_eq!(m(&[(1, 1.0, 2.0), (4, 2.0, 2.5)], Some((16, Mode::Ep))).t_high(), u32::MAX);
        assert_eq!(m(&[(1, 1.0, 2.0), (4, 2.0, 1.5)], None).t_high(), 4);
        assert_eq!(m(&[(1, 1.0, 2.0)], None).t_high(), u32::MAX);
    }
}
