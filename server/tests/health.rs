//! What the server does when an engine step fails, over a scripted engine
//! (the real backends' failures are exercised in the workspace's
//! `tests/serve.rs`, which loses the emulated device under a live server).
//!
//! - A capacity error fails the requests in that step, and the server goes
//!   on serving: `/health` stays 200, a later request completes.
//! - A backend error fails them and puts the engine out of service: later
//!   requests get 503 without reaching the engine, `/health` answers 503
//!   with the failure, and `/metrics` shows it.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use moeforge_runtime::engine::{Engine, EngineError, Request, RequestId, Stats, StepOutput, SwitchEvent};
use moeforge_runtime::policy::Driver;
use moeforge_server::{serve, Config};
use serde_json::Value;
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Produces token `100 + step` for every running request each step, until
/// its `max_new`; step `fail_at` fails with `failure` (once: the next step
/// is step `fail_at` again, as a failed step of the twin counts no step).
struct Scripted {
    running: VecDeque<(RequestId, usize)>,
    step: usize,
    fail_at: usize,
    failure: Option<EngineError>,
    /// Panics (a bug in an engine) at step `fail_at` instead.
    panics: bool,
    submitted: Arc<AtomicUsize>,
}

impl Engine for Scripted {
    fn submit(&mut self, req: Request) -> Result<(), EngineError> {
        self.submitted.fetch_add(1, Ordering::SeqCst);
        self.running.push_back((req.id, req.max_new));
        Ok(())
    }
    fn step(&mut self) -> Result<StepOutput, EngineError> {
        let step = self.step;
        if step == self.fail_at {
            assert!(!self.panics, "the scripted engine's bug at step {step}");
            if let Some(e) = self.failure.take() {
                return Err(e);
            }
        }
        self.step += 1;
        let mut out = StepOutput { step, running: self.running.len(), ..StepOutput::default() };
        for (id, left) in &mut self.running {
            out.produced.push((*id, 100 + step as u32));
            *left -= 1;
            if *left == 0 {
                out.finished.push(*id);
            }
        }
        self.running.retain(|r| r.1 > 0);
        Ok(out)
    }
    fn cancel(&mut self, id: RequestId) -> bool {
        let n = self.running.len();
        self.running.retain(|r| r.0 != id);
        n != self.running.len()
    }
    fn switch(&mut self, _: moeforge_plan::memory::Mode) -> Result<SwitchEvent, EngineError> {
        Err(EngineError::Capacity("one mode".into()))
    }
    fn stats(&self) -> Stats {
        Stats { running: self.running.len(), steps: self.step, ..Stats::default() }
    }
    fn forget(&mut self, _: RequestId) {}
}

/// One HTTP/1.1 exchange: (status, body).
fn http(addr: std::net::SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map_or("", |x| x.1).to_string();
    (status, body)
}

fn json(s: &str) -> Value {
    // A chunked body: the JSON is the one line that parses.
    s.lines().find_map(|l| serde_json::from_str(l).ok()).unwrap_or_else(|| panic!("no JSON in {s:?}"))
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

/// Serves a scripted engine failing its step `fail_at` with `failure` (or
/// panicking there without one), runs
/// `check` against it, then shuts it down; returns the engine's submissions.
fn with_server(fail_at: usize, failure: Option<EngineError>, check: impl FnOnce(std::net::SocketAddr)) -> usize {
    let submitted = Arc::new(AtomicUsize::new(0));
    let engine = Scripted {
        running: VecDeque::new(),
        step: 0,
        fail_at,
        panics: failure.is_none(),
        failure,
        submitted: submitted.clone(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let cfg = Config { model: "scripted".into(), aliases: vec![], max_queue: 8, text: None };
    let server = rt.spawn(serve(listener, Driver::new(engine, None), cfg, async {
        let _ = stopped.await;
    }));
    check(addr);
    let _ = stop.send(());
    rt.block_on(server).unwrap().unwrap();
    submitted.load(Ordering::SeqCst)
}

const ASK: &str = r#"{"prompt": [1, 2, 3], "max_tokens": 4}"#;

#[test]
fn a_capacity_failure_fails_its_step_and_the_server_goes_on() {
    let submitted = with_server(1, Some(EngineError::Capacity("rank 0 ran out of KV pages".into())), |addr| {
        let (code, body) = http(addr, "POST", "/v1/completions", ASK);
        assert_eq!(code, 500, "{body}");
        let msg = json(&body)["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains("rank 0 ran out of KV pages"), "{msg}");
        let (code, body) = http(addr, "GET", "/health", "");
        assert_eq!((code, json(&body)["status"].as_str()), (200, Some("ok")));
        // The engine steps on: tokens 101..=104 of steps 1 to 4.
        let (code, body) = http(addr, "POST", "/v1/completions", ASK);
        assert_eq!(code, 200, "{body}");
        let ids: Vec<u64> =
            json(&body)["choices"][0]["token_ids"].as_array().unwrap().iter().filter_map(Value::as_u64).collect();
        assert_eq!(ids, [101, 102, 103, 104]);
        let (_, m) = http(addr, "GET", "/metrics", "");
        assert_eq!(metric(&m, "moeforge_step_failures_total"), 1.0);
        assert_eq!(metric(&m, "moeforge_engine_out_of_service"), 0.0);
    });
    assert_eq!(submitted, 2);
}

#[test]
fn a_backend_failure_puts_the_engine_out_of_service() {
    let submitted = with_server(2, Some(EngineError::Backend("launch of `moe_apk` failed: trap".into())), |addr| {
        let (code, body) = http(addr, "GET", "/health", "");
        assert_eq!(code, 200, "{body}");
        // The request in flight fails with the device's message.
        let (code, body) = http(addr, "POST", "/v1/completions", ASK);
        assert_eq!(code, 500, "{body}");
        let msg = json(&body)["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains("launch of `moe_apk` failed: trap") && msg.contains("out of service"), "{msg}");
        // Then every probe and request says so, and none reaches the engine.
        let (code, body) = http(addr, "GET", "/health", "");
        assert_eq!(code, 503, "{body}");
        let h = json(&body);
        assert_eq!(h["status"], "out_of_service");
        assert_eq!(h["failed_step"], 2);
        assert_eq!(h["error"], "launch of `moe_apk` failed: trap");
        let (code, body) = http(addr, "POST", "/v1/completions", ASK);
        assert_eq!(code, 503, "{body}");
        let msg = json(&body)["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains("step 2 (or the switch before it) failed") && msg.contains("restart the server"), "{msg}");
        let (_, m) = http(addr, "GET", "/metrics", "");
        assert_eq!(metric(&m, "moeforge_step_failures_total"), 1.0);
        assert_eq!(metric(&m, "moeforge_engine_out_of_service"), 1.0);
    });
    assert_eq!(submitted, 1, "a request reached the engine after it went out of service");
}

/// An engine that panics (a bug) ends the engine thread: the request in
/// flight gets a 503 rather than a truncated 200, and the server reports
/// itself out of service as for a backend failure, with no step to name.
#[test]
fn an_engine_panic_puts_the_server_out_of_service() {
    let submitted = with_server(1, None, |addr| {
        let (code, body) = http(addr, "POST", "/v1/completions", ASK);
        assert_eq!(code, 503, "{body}");
        let (code, body) = http(addr, "GET", "/health", "");
        assert_eq!(code, 503, "{body}");
        let h = json(&body);
        assert_eq!(h["failed_step"], Value::Null);
        assert!(h["error"].as_str().is_some_and(|e| e.contains("panicked") && e.contains("bug at step 1")), "{h}");
        let (code, body) = http(addr, "POST", "/v1/completions", ASK);
        assert_eq!(code, 503, "{body}");
        assert!(
            json(&body)["error"]["message"].as_str().is_some_and(|m| m.contains("engine thread stopped")),
            "{body}"
        );
        let (_, m) = http(addr, "GET", "/metrics", "");
        assert_eq!(metric(&m, "moeforge_engine_out_of_service"), 1.0);
    });
    assert_eq!(submitted, 1);
}
