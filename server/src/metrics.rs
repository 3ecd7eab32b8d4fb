//! The server's Prometheus metrics (`GET /metrics`, text format): request
//! latencies (TTFT, TPOT, end to end), load (running and waiting requests,
//! KV pages), the parallelism mode and its switches, token counts, failed
//! steps and whether the engine is out of service, and the time the server
//! spends outside engine steps (its own cost).

use moeforge_plan::memory::Mode;
use moeforge_runtime::engine::{Stats, SwitchEvent};
use prometheus::{Encoder, Histogram, HistogramOpts, IntCounter, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};
use std::time::Instant;

pub struct Metrics {
    registry: Registry,
    pub ttft: Histogram,
    pub tpot: Histogram,
    pub e2e: Histogram,
    pub running: IntGauge,
    pub waiting: IntGauge,
    pub kv_used: IntGauge,
    pub kv_free: IntGauge,
    pub mode: IntGaugeVec,
    pub switches: IntCounter,
    pub switch_seconds: Histogram,
    pub tokens_in: IntCounter,
    pub tokens_out: IntCounter,
    pub requests: IntCounter,
    pub rejected: IntCounter,
    pub cancelled: IntCounter,
    /// Engine steps that failed (each failed the requests in it), and 1
    /// once a backend failure put the engine out of service.
    pub step_failures: IntCounter,
    pub out_of_service: IntGauge,
    /// Seconds inside engine steps, and seconds the server spent around them
    /// (commands, token dispatch, HTTP handling).
    pub step_seconds: prometheus::Counter,
    pub overhead: prometheus::Counter,
    /// Decode graphs kept, and decode steps that replayed one.
    pub decode_graphs: IntGauge,
    pub graph_replays: IntCounter,
}

fn buckets() -> Vec<f64> {
    vec![0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0]
}

impl Metrics {
    pub fn new() -> Result<Metrics, prometheus::Error> {
        let registry = Registry::new();
        let hist = |name: &str, help: &str| Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets()));
        let m = Metrics {
            ttft: hist("moeforge_ttft_seconds", "time from a request's arrival to its first token")?,
            tpot: hist("moeforge_tpot_seconds", "mean time per output token after the first, per request")?,
            e2e: hist("moeforge_e2e_seconds", "time from a request's arrival to its last token")?,
            running: IntGauge::new("moeforge_requests_running", "requests being decoded")?,
            waiting: IntGauge::new("moeforge_requests_waiting", "requests waiting for KV cache")?,
            kv_used: IntGauge::new("moeforge_kv_pages_used", "KV-cache pages in use, all ranks")?,
            kv_free: IntGauge::new("moeforge_kv_pages_free", "KV-cache pages free, all ranks")?,
            mode: IntGaugeVec::new(Opts::new("moeforge_mode", "1 for the current parallelism mode"), &["mode"])?,
            switches: IntCounter::new("moeforge_switches_total", "TP/EP switches done")?,
            switch_seconds: hist("moeforge_switch_seconds", "duration of each TP/EP switch")?,
            tokens_in: IntCounter::new("moeforge_tokens_in_total", "prompt tokens admitted")?,
            tokens_out: IntCounter::new("moeforge_tokens_out_total", "tokens generated")?,
            requests: IntCounter::new("moeforge_requests_total", "requests accepted")?,
            rejected: IntCounter::new("moeforge_requests_rejected_total", "requests refused (400, 429, 503)")?,
            cancelled: IntCounter::new("moeforge_requests_cancelled_total", "requests cancelled by their client")?,
            step_failures: IntCounter::new(
                "moeforge_step_failures_total",
                "engine steps that failed, failing the requests in them",
            )?,
            out_of_service: IntGauge::new(
                "moeforge_engine_out_of_service",
                "1 once a backend failure put the engine out of service (GET /health answers 503)",
            )?,
            step_seconds: prometheus::Counter::new("moeforge_step_seconds_total", "seconds inside engine steps")?,
            overhead: prometheus::Counter::new(
                "moeforge_server_seconds_total",
                "seconds the server spent outside engine steps (commands, dispatch, HTTP)",
            )?,
            decode_graphs: IntGauge::new(
                "moeforge_decode_graphs",
                "decode graphs the device keeps (one per mode and batch bucket; 0 with --eager or no graphs)",
            )?,
            graph_replays: IntCounter::new(
                "moeforge_decode_graph_replays_total",
                "decode steps that ran as a replay of their bucket's graph",
            )?,
            registry,
        };
        for c in [&m.ttft, &m.tpot, &m.e2e, &m.switch_seconds] {
            m.registry.register(Box::new(c.clone()))?;
        }
        for g in [&m.running, &m.waiting, &m.kv_used, &m.kv_free, &m.out_of_service, &m.decode_graphs] {
            m.registry.register(Box::new(g.clone()))?;
        }
        m.registry.register(Box::new(m.mode.clone()))?;
        for c in [
            &m.switches,
            &m.tokens_in,
            &m.tokens_out,
            &m.requests,
            &m.rejected,
            &m.cancelled,
            &m.step_failures,
            &m.graph_replays,
        ] {
            m.registry.register(Box::new(c.clone()))?;
        }
        m.registry.register(Box::new(m.step_seconds.clone()))?;
        m.registry.register(Box::new(m.overhead.clone()))?;
        Ok(m)
    }

    /// After an engine step (or a command): the gauges, and the step's cost.
    pub fn step(&self, s: &Stats, seconds: f64) {
        self.running.set(s.running as i64);
        self.waiting.set(s.waiting as i64);
        self.kv_used.set(s.kv_pages_used as i64);
        self.kv_free.set(s.kv_pages_total.saturating_sub(s.kv_pages_used) as i64);
        self.decode_graphs.set(s.decode_graphs as i64);
        // The engine's count is cumulative: the counter takes what it added.
        self.graph_replays.inc_by(s.graph_replays.saturating_sub(self.graph_replays.get()));
        for m in [Mode::Tp, Mode::Ep] {
            if s.modes.contains(&m) {
                self.mode.with_label_values(&[m.name()]).set(i64::from(s.mode == Some(m)));
            }
        }
        if seconds > 0.0 {
            self.step_seconds.inc_by(seconds);
        }
    }

    pub fn switch(&self, e: &SwitchEvent) {
        if e.cancelled.is_none() && e.from != e.to {
            self.switches.inc();
            self.switch_seconds.observe(e.seconds);
        }
    }

    /// A request's last token at `now`.
    pub fn finished(&self, submitted: Instant, first: Option<Instant>, tokens: usize, now: Instant) {
        self.e2e.observe((now - submitted).as_secs_f64());
        if let (Some(f), true) = (first, tokens > 1) {
            self.tpot.observe((now - f).as_secs_f64() / (tokens - 1) as f64);
        }
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}
