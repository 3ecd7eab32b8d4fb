//! The engine thread: owns the engine (under the switch-policy driver),
//! takes submissions and cancellations from the HTTP side, steps while
//! anything is in flight, and streams each request's tokens back on its own
//! channel. Compute never runs on the async runtime.
//!
//! A request whose receiver is gone (the client disconnected, or a stop
//! string ended it) is cancelled at once, freeing its KV. When every sender
//! of commands is dropped and nothing is in flight, the thread ends: that is
//! the graceful shutdown's last step.
//!
//! A failed step fails the requests in flight (the engine cannot say which
//! one the failure belongs to) with its message. A capacity error (a step
//! that does not fit the plan, which admission is meant to prevent) leaves
//! the engine consistent once they are cancelled, so it goes on serving. A
//! backend error (a device that faulted, hung or went away, a broken
//! invariant of the engine's own state) does not: the engine is out of
//! service from then on ([`Health`]). Later submissions are refused without
//! touching it and `GET /health` answers 503 with the error, so an
//! orchestrator's probe restarts the server instead of routing requests to
//! an engine that can only fail them. A panic of this thread (a bug) does
//! the same: the server catches it where it spawned the thread, and a
//! request whose events end without an answer gets a 503.

use crate::metrics::Metrics;
use moeforge_runtime::engine::{Engine, EngineError, Request, RequestId};
use moeforge_runtime::policy::Driver;
use std::collections::BTreeMap;
use std::sync::{mpsc, Mutex};
use std::time::Instant;
use tokio::sync::{mpsc as tmpsc, oneshot};

/// What a request's stream carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Token(u32),
    /// The last token came: the request produced `max_tokens`.
    Done,
    /// The engine failed; the message says why.
    Failed(String),
}

/// A command from the HTTP side.
pub enum Command {
    /// Queue `req`; `accepted` says whether the engine took it, `events`
    /// then carries its tokens.
    Submit { req: Request, accepted: oneshot::Sender<Result<(), EngineError>>, events: tmpsc::UnboundedSender<Event> },
    /// Drop a request (its stream is no longer wanted).
    Cancel(RequestId),
}

/// Whether the engine still serves: `None`, or the backend failure that put
/// it out of service (sticky: nothing in this process brings it back).
#[derive(Default)]
pub struct Health {
    failed: Mutex<Option<Failure>>,
}

/// The step that failed (`None`: the engine thread itself stopped) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub step: Option<usize>,
    pub message: String,
}

impl Failure {
    /// What a refused request is told.
    pub fn refusal(&self) -> String {
        let what = match self.step {
            Some(s) => format!("step {s} (or the switch before it) failed"),
            None => "the engine thread stopped".into(),
        };
        format!(
            "the engine is out of service: {what} ({}); restart the server (GET /health says 503 until then)",
            self.message
        )
    }
}

impl Health {
    pub fn failure(&self) -> Option<Failure> {
        self.failed.lock().map_or_else(|p| p.into_inner().clone(), |g| g.clone())
    }
    pub(crate) fn fail(&self, f: Failure) {
        let mut g = self.failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        g.get_or_insert(f);
    }
}

struct Live {
    events: tmpsc::UnboundedSender<Event>,
    submitted: Instant,
    first: Option<Instant>,
    tokens: usize,
}

/// Runs the engine until `commands` is closed and nothing is in flight.
pub fn run<E: Engine>(mut driver: Driver<E>, commands: mpsc::Receiver<Command>, metrics: &Metrics, health: &Health) {
    let mut live: BTreeMap<RequestId, Live> = BTreeMap::new();
    let mut closed = false;
    loop {
        // Block for a command while idle; otherwise take what is queued.
        if live.is_empty() {
            if closed {
                return;
            }
            match commands.recv() {
                Ok(c) => handle(&mut driver, &mut live, c, metrics, health),
                Err(_) => return,
            }
        }
        loop {
            match commands.try_recv() {
                Ok(c) => handle(&mut driver, &mut live, c, metrics, health),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    closed = true;
                    break;
                }
            }
        }
        if live.is_empty() {
            continue;
        }
        let switches = driver.events.len();
        let step = match driver.step() {
            Ok(s) => s,
            Err(e) => {
                metrics.step_failures.inc();
                let message = match &e {
                    EngineError::Backend(m) => {
                        let f = Failure { step: Some(driver.engine.stats().steps), message: m.clone() };
                        metrics.out_of_service.set(1);
                        let refusal = f.refusal();
                        health.fail(f);
                        refusal
                    }
                    e => format!("the step failed and every request in it with it: {e}"),
                };
                for (id, l) in std::mem::take(&mut live) {
                    let _ = l.events.send(Event::Failed(message.clone()));
                    driver.engine.cancel(id);
                }
                continue;
            }
        };
        let t0 = Instant::now();
        for e in &driver.events[switches..] {
            metrics.switch(e);
        }
        let now = Instant::now();
        for &(id, tok) in &step.produced {
            let Some(l) = live.get_mut(&id) else { continue };
            if l.first.is_none() {
                l.first = Some(now);
                metrics.ttft.observe((now - l.submitted).as_secs_f64());
            }
            l.tokens += 1;
            if l.events.send(Event::Token(tok)).is_err() {
                // Nobody reads this stream any more: free its KV now.
                driver.engine.cancel(id);
                live.remove(&id);
                metrics.cancelled.inc();
            }
        }
        for &id in &step.finished {
            if let Some(l) = live.remove(&id) {
                let _ = l.events.send(Event::Done);
                metrics.finished(l.submitted, l.first, l.tokens, now);
            }
            driver.engine.forget(id);
        }
        metrics.tokens_out.inc_by(step.produced.len() as u64);
        metrics.step(&driver.engine.stats(), step.seconds);
        metrics.overhead.inc_by(t0.elapsed().as_secs_f64());
    }
}

fn handle<E: Engine>(
    driver: &mut Driver<E>,
    live: &mut BTreeMap<RequestId, Live>,
    c: Command,
    metrics: &Metrics,
    health: &Health,
) {
    let t0 = Instant::now();
    match c {
        Command::Submit { req, accepted, events } => {
            let (id, prompt) = (req.id, req.prompt.len());
            // An engine out of service takes nothing more (the HTTP side
            // checks first; this catches a submission already on its way).
            let r = match health.failure() {
                Some(f) => Err(EngineError::Backend(f.refusal())),
                None => driver.engine.submit(req),
            };
            if r.is_ok() {
                live.insert(id, Live { events, submitted: Instant::now(), first: None, tokens: 0 });
                metrics.tokens_in.inc_by(prompt as u64);
            }
            // A client that left before the answer: its request is dropped.
            if accepted.send(r).is_err() && live.remove(&id).is_some() {
                driver.engine.cancel(id);
                metrics.cancelled.inc();
            }
        }
        Command::Cancel(id) => {
            if live.remove(&id).is_some() {
                driver.engine.cancel(id);
                metrics.cancelled.inc();
            }
        }
    }
    metrics.step(&driver.engine.stats(), 0.0);
    metrics.overhead.inc_by(t0.elapsed().as_secs_f64());
}
