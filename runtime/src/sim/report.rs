//! Metrics and outputs: SLO attainment, P90 goodput, rate sweeps, CSV and
//! an SVG plot of attainment against rate (the papers' Figures 7–10).

use super::workload::{requests, Req};
use super::{Bench, Deployment, Outcome, System};
use moeforge_dsl::spec::Slo;
use std::fmt::Write as _;

/// Fraction of requests meeting both SLOs (refused requests miss).
pub fn attainment(slo: &Slo, outcomes: &[Outcome]) -> f64 {
    let ok = outcomes
        .iter()
        .filter(|o| o.ttft.is_some_and(|t| t <= slo.ttft) && o.tpot.is_some_and(|t| t <= slo.tpot))
        .count();
    ok as f64 / outcomes.len().max(1) as f64
}

/// The goodput criterion: at least this fraction of requests meet both SLOs.
pub const GOODPUT_ATTAINMENT: f64 = 0.9;

/// Requests a probe at `rate` simulates: `seconds` of arrivals, at least 200.
pub fn probe_requests(rate: f64, seconds: f64) -> usize {
    ((rate * seconds).ceil() as usize).clamp(200, 200_000)
}

/// Percentile (nearest rank) of the present values.
pub fn percentile(values: impl Iterator<Item = f64>, p: f64) -> Option<f64> {
    let mut v: Vec<f64> = values.collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let i = ((p / 100.0 * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    Some(v[i])
}

/// One point of a sweep.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    pub rate: f64,
    pub attainment: f64,
    pub ttft_p50: Option<f64>,
    pub ttft_p90: Option<f64>,
    pub tpot_p50: Option<f64>,
    pub tpot_p90: Option<f64>,
}

/// A system's result: the deployment that did best, its goodput, its curve.
#[derive(Clone, Debug)]
pub struct SystemResult {
    pub system: System,
    pub deployment: Result<Deployment, String>,
    /// P90 goodput in requests per second (cluster-wide).
    pub goodput: f64,
    pub curve: Vec<Point>,
}

/// How probes are run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Probe {
    /// Seconds of arrivals each probe simulates.
    pub seconds: f64,
    pub seed: u64,
}

impl Bench<'_> {
    fn stream(&self, rate: f64, probe: Probe) -> Vec<Req> {
        requests(&self.spec.deploys[0].workload, probe_requests(rate, probe.seconds), rate, probe.seed)
    }

    pub fn point(&self, dep: &Deployment, rate: f64, probe: Probe) -> Point {
        let out = self.simulate(dep, &self.stream(rate, probe));
        let slo = &self.spec.deploys[0].slo;
        Point {
            rate,
            attainment: attainment(slo, &out),
            ttft_p50: percentile(out.iter().filter_map(|o| o.ttft), 50.0),
            ttft_p90: percentile(out.iter().filter_map(|o| o.ttft), 90.0),
            tpot_p50: percentile(out.iter().filter_map(|o| o.tpot), 50.0),
            tpot_p90: percentile(out.iter().filter_map(|o| o.tpot), 90.0),
        }
    }

    /// P90 goodput: the highest rate with attainment ≥ 90%. Doubles from
    /// `start` until a probe fails, then bisects (12 steps: 0.02% of the
    /// bracket). Streams at different rates are time-scaled copies of one
    /// seeded stream, so probes compare like with like.
    pub fn goodput(&self, dep: &Deployment, start: f64, probe: Probe) -> f64 {
        let ok = |rate: f64| self.point(dep, rate, probe).attainment >= GOODPUT_ATTAINMENT;
        let (mut lo, mut hi) = (0.0, start.max(1e-3));
        let mut grow = 0;
        while ok(hi) {
            lo = hi;
            hi *= 2.0;
            grow += 1;
            if grow > 20 {
                return lo;
            }
        }
        if lo == 0.0 {
            // Even `start` fails: search downwards.
            let mut r = hi;
            for _ in 0..12 {
                r /= 2.0;
                if ok(r) {
                    lo = r;
                    hi = r * 2.0;
                    break;
                }
            }
            if lo == 0.0 {
                return 0.0;
            }
        }
        for _ in 0..12 {
            let mid = (lo + hi) / 2.0;
            if ok(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Where the goodput bisection starts: a quarter of the layout search's
    /// predicted goodput, or 1 req/s without a search.
    fn start_rate(&self) -> f64 {
        self.plan.search.as_ref().and_then(|s| s.ranked.first()).map_or(1.0, |c| (c.goodput / 4.0).max(0.05))
    }

    /// A system's deployment and its goodput, or why it cannot run here.
    pub fn evaluated(&self, system: System, start: f64, probe: Probe) -> Result<(f64, Deployment), String> {
        let dep = self.deployment(system)?;
        Ok((self.goodput(&dep, start, probe), dep))
    }

    /// Evaluates systems: each system's deployment by goodput, then every
    /// system's attainment at `rates` points up to 1.5× the best
    /// goodput found.
    pub fn compare(&self, systems: &[System], rates: usize, probe: Probe) -> Vec<SystemResult> {
        let start = self.start_rate();
        let mut results: Vec<SystemResult> = systems
            .iter()
            .map(|&system| match self.evaluated(system, start, probe) {
                Err(why) => SystemResult { system, deployment: Err(why), goodput: 0.0, curve: Vec::new() },
                Ok((goodput, dep)) => SystemResult { system, deployment: Ok(dep), goodput, curve: Vec::new() },
            })
            .collect();
        let top = results.iter().map(|r| r.goodput).fold(0.0, f64::max).max(start);
        let grid: Vec<f64> = (1..=rates).map(|i| top * 1.5 * i as f64 / rates as f64).collect();
        for r in results.iter_mut() {
            if let Ok(dep) = &r.deployment {
                r.curve = grid.iter().map(|&rate| self.point(dep, rate, probe)).collect();
            }
        }
        results
    }
}

fn opt(v: Option<f64>) -> String {
    v.map_or(String::new(), |x| format!("{x:.6}"))
}

/// `system,deployment,rate,rate_per_node,attainment,ttft_p50,ttft_p90,tpot_p50,tpot_p90`.
pub fn curves_csv(results: &[SystemResult], nodes: u32) -> String {
    let mut s = String::from("system,deployment,rate,rate_per_node,attainment,ttft_p50,ttft_p90,tpot_p50,tpot_p90\n");
    for r in results {
        let Ok(dep) = &r.deployment else { continue };
        for p in &r.curve {
            let _ = writeln!(
                s,
                "{},\"{}\",{:.4},{:.4},{:.4},{},{},{},{}",
                r.system.name(),
                dep.label,
                p.rate,
                p.rate / f64::from(nodes),
                p.attainment,
                opt(p.ttft_p50),
                opt(p.ttft_p90),
                opt(p.tpot_p50),
                opt(p.tpot_p90)
            );
        }
    }
    s
}

/// `system,deployment,goodput,goodput_per_node,expert_copies,decode_kv_tokens,note`.
pub fn goodput_csv(results: &[SystemResult], nodes: u32) -> String {
    let mut s = String::from("system,deployment,goodput,goodput_per_node,expert_copies,decode_kv_tokens,note\n");
    for r in results {
        match &r.deployment {
            Ok(d) => {
                let _ = writeln!(
                    s,
                    "{},\"{}\",{:.4},{:.4},{},{:.0},",
                    r.system.name(),
                    d.label,
                    r.goodput,
                    r.goodput / f64::from(nodes),
                    d.expert_copies,
                    d.decode_kv_tokens
                );
            }
            Err(why) => {
                let _ = writeln!(s, "{},,,,,,\"{}\"", r.system.name(), why.replace('"', "'"));
            }
        }
    }
    s
}

/// The goodput table: each system against the first one (the reference).
/// What a paper measured for one end-to-end setting: ExpertPlex's P90
/// goodput per node where it states one, and its goodput over each
/// baseline's (ExpertPlex §7.2, Figs. 7–10; GLM-5's PDMux "parity" is 1.0).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Published {
    pub setting: &'static str,
    pub goodput_per_node: Option<f64>,
    pub ratios: &'static [(System, f64)],
    /// The setting's other conclusions (Moebius's rollout and bursty trace).
    pub others: &'static [Claim],
}

/// Moebius's published conclusions on Qwen3-235B-A22B, 8×H200: the rollout
/// gain over the better static layout per step (§6.3, 1.16–1.25×) and the
/// bursty trace (§6.2, Fig. 9: four switches, quiet-period TPOT TP 37 ms
/// against EP 52 ms, Moebius tracking TP, mean burst TTFT reaching TP 9.9 s
/// against Moebius's 3.1 s peak).
pub const MOEBIUS_CLAIMS: [Claim; 5] = [
    Claim::RolloutGain { lo: 1.16, hi: 1.25 },
    Claim::Switches { paper: 4 },
    Claim::QuietTpAhead { paper: 52.0 / 37.0 },
    Claim::TracksTp,
    Claim::BurstBelowTp,
];

/// The published setting a deployment reproduces, by model, input
/// distribution and GPU count: MiniMax-M2 on 8 and GLM-5 on 24 GPUs on
/// ShareGPT and LooGLE (ExpertPlex), Qwen3-235B-A22B on 8 with any input
/// (Moebius: its claims need `--rollout`/`--bursty`).
pub fn published(model: &str, input: &moeforge_dsl::spec::LengthDist, gpus: u32) -> Option<Published> {
    use moeforge_dsl::spec::LengthDist::{Loogle, Sharegpt};
    use System::{ChunkedPrefill, Colocated, GreenContext, PdDisagg};
    let family = if model.starts_with("minimax-m2") && gpus == 8 {
        "minimax"
    } else if model.starts_with("glm-5") && gpus == 24 {
        "glm-5"
    } else if model.starts_with("qwen3-235b") && gpus == 8 {
        return Some(Published {
            setting: "Moebius §6.2–6.3: Qwen3-235B-A22B, 8×H200",
            goodput_per_node: None,
            ratios: &[],
            others: &MOEBIUS_CLAIMS,
        });
    } else {
        return None;
    };
    Some(match (family, input) {
        ("minimax", Sharegpt) => Published {
            setting: "ExpertPlex Fig. 7: MiniMax-M2.7, ShareGPT, 8×H800",
            goodput_per_node: Some(11.3),
            ratios: &[(PdDisagg, 2.01), (GreenContext, 1.41), (Colocated, 2.72), (ChunkedPrefill, 5.65)],
            others: &[],
        },
        ("minimax", Loogle) => Published {
            setting: "ExpertPlex Fig. 8: MiniMax-M2.7, LooGLE, 8×H800",
            goodput_per_node: None,
            ratios: &[(GreenContext, 1.28), (Colocated, 4.12)],
            others: &[],
        },
        ("glm-5", Sharegpt) => Published {
            setting: "ExpertPlex Fig. 9: GLM-5.1-FP8, ShareGPT, 3×8 H800",
            goodput_per_node: Some(1.5),
            ratios: &[(GreenContext, 1.0), (Colocated, 1.5), (ChunkedPrefill, 3.3)],
            others: &[],
        },
        ("glm-5", Loogle) => Published {
            setting: "ExpertPlex Fig. 10: GLM-5.1-FP8, LooGLE, 3×8 H800",
            goodput_per_node: None,
            ratios: &[(GreenContext, 1.66), (Colocated, 2.5), (ChunkedPrefill, 5.0)],
            others: &[],
        },
        _ => return None,
    })
}

/// The goodput table; with `paper`, each ratio beside the published one.
pub fn table(results: &[SystemResult], nodes: u32, paper: Option<&Published>) -> String {
    let mut s = String::new();
    let reference = results.first();
    let _ = writeln!(
        s,
        "{:<16} {:<34} {:>12} {:>14} {:>9} {:>9}",
        "system", "deployment", "P90 goodput", "req/s/node", "ratio", "paper"
    );
    for r in results {
        match &r.deployment {
            Ok(d) => {
                let ratio = match reference {
                    Some(f) if r.goodput > 0.0 => format!("{:.2}×", f.goodput / r.goodput),
                    _ => "∞".into(),
                };
                let published = paper.and_then(|p| {
                    if r.system == System::ExpertPlex {
                        p.goodput_per_node.map(|g| format!("{g} /node"))
                    } else {
                        p.ratios.iter().find(|x| x.0 == r.system).map(|x| format!("{:.2}×", x.1))
                    }
                });
                let _ = writeln!(
                    s,
                    "{:<16} {:<34} {:>12.3} {:>14.3} {:>9} {:>9}",
                    r.system.name(),
                    d.label,
                    r.goodput,
                    r.goodput / f64::from(nodes),
                    ratio,
                    published.unwrap_or_else(|| "–".into())
                );
            }
            Err(why) => {
                let _ = writeln!(s, "{:<16} not run: {why}", r.system.name());
            }
        }
    }
    if let Some(f) = reference {
        let _ = writeln!(s, "ratio = {} goodput / system goodput", f.system.name());
    }
    if let Some(p) = paper.filter(|p| p.goodput_per_node.is_some() || !p.ratios.is_empty()) {
        let _ = writeln!(s, "paper = {} (expertplex goodput / system goodput)", p.setting);
    }
    s
}

const COLORS: [&str; 8] = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#ff7f0e"];

/// SLO attainment against request rate per node, one line per system, with
/// the 90% goodput line.
pub fn svg(results: &[SystemResult], nodes: u32, title: &str) -> String {
    let (w, h, l, r, t, b) = (720.0, 440.0, 60.0, 210.0, 40.0, 50.0);
    let (pw, ph) = (w - l - r, h - t - b);
    let xmax = results.iter().flat_map(|r| r.curve.iter().map(|p| p.rate)).fold(0.0, f64::max) / f64::from(nodes);
    let xmax = if xmax > 0.0 { xmax } else { 1.0 };
    let x = |v: f64| l + pw * v / xmax;
    let y = |a: f64| t + ph * (1.0 - a);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">"
    );
    let _ = writeln!(s, "<rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>");
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">{}</text>",
        l + pw / 2.0,
        xml(title)
    );
    for i in 0..=5 {
        let a = f64::from(i) / 5.0;
        let _ = writeln!(
            s,
            "<line x1=\"{l}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{:.0}%</text>",
            l + pw,
            y(a),
            y(a),
            l - 6.0,
            y(a) + 4.0,
            a * 100.0
        );
        let v = xmax * f64::from(i) / 5.0;
        let _ =
            writeln!(s, "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>", x(v), t + ph + 18.0, trim(v));
    }
    let _ = writeln!(
        s,
        "<line x1=\"{l}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"black\" stroke-dasharray=\"4 3\"/><text x=\"{:.1}\" y=\"{:.1}\">90% SLO</text>",
        l + pw,
        y(0.9),
        y(0.9),
        l + 4.0,
        y(0.9) - 4.0
    );
    let _ = writeln!(
        s,
        "<rect x=\"{l}\" y=\"{t}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"black\"/>\n<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">Request rate (req/s/node)</text>\n<text transform=\"translate(16 {:.1}) rotate(-90)\" text-anchor=\"middle\">SLO attainment</text>",
        l + pw / 2.0,
        h - 12.0,
        t + ph / 2.0
    );
    for (i, res) in results.iter().filter(|r| !r.curve.is_empty()).enumerate() {
        let c = COLORS[i % COLORS.len()];
        let pts: Vec<String> =
            res.curve.iter().map(|p| format!("{:.1},{:.1}", x(p.rate / f64::from(nodes)), y(p.attainment))).collect();
        let _ = writeln!(s, "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>", pts.join(" "));
        let ly = t + 14.0 + 18.0 * i as f64;
        let label = match &res.deployment {
            Ok(d) => format!("{} ({})", res.system.name(), d.label),
            Err(_) => res.system.name().to_string(),
        };
        let _ = writeln!(
            s,
            "<line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{ly:.1}\" y2=\"{ly:.1}\" stroke=\"{c}\" stroke-width=\"2\"/><text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\">{}</text>",
            l + pw + 10.0,
            l + pw + 28.0,
            l + pw + 32.0,
            ly + 4.0,
            xml(&label)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn trim(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// One RL rollout step (Moebius §6.3): `n` prompts at once, every one
/// decoded to its length; the step's completion time per system.
#[derive(Clone, Debug)]
pub struct RolloutResult {
    pub system: System,
    pub deployment: Result<Deployment, String>,
    /// Seconds until the last request finished.
    pub seconds: f64,
}

impl Bench<'_> {
    /// Runs one rollout step on static TP, static EP and Moebius (starting
    /// in EP, the rollout setting: the batch only drains).
    pub fn rollout(&self, n: usize, seed: u64) -> Vec<RolloutResult> {
        let reqs = super::workload::rollout_step(&self.spec.deploys[0].workload, n, seed);
        [System::StaticTp, System::StaticEp, System::Moebius]
            .into_iter()
            .map(|system| {
                let dep = self.deployment(system);
                match dep {
                    Ok(mut dep) => {
                        if let super::Phases::Unified { switch: Some(s), .. } = &mut dep.phases {
                            s.start = moeforge_plan::memory::Mode::Ep;
                        }
                        let out = self.simulate(&dep, &reqs);
                        let seconds = if out.iter().all(|o| o.finish.is_some()) {
                            out.iter().filter_map(|o| o.finish).fold(0.0, f64::max)
                        } else {
                            f64::INFINITY
                        };
                        RolloutResult { system, deployment: Ok(dep), seconds }
                    }
                    Err(why) => RolloutResult { system, deployment: Err(why), seconds: f64::INFINITY },
                }
            })
            .collect()
    }
}

/// Moebius's rollout speed over the better static layout's (Moebius
/// §6.3's "beating an oracle that picks the better static layout"): the
/// faster static completion time over Moebius's; `None` when Moebius or
/// every static layout did not run or finish (no verdict, not a loss).
pub fn rollout_gain(rs: &[RolloutResult]) -> Option<f64> {
    let best_static = better_static_seconds(rs);
    let m = rs.iter().find(|r| r.system == System::Moebius)?;
    (m.seconds.is_finite() && m.seconds > 0.0 && best_static.is_finite()).then(|| best_static / m.seconds)
}

/// The faster static layout's rollout completion time (infinite when none finished).
pub fn better_static_seconds(rs: &[RolloutResult]) -> f64 {
    rs.iter().filter(|r| r.system != System::Moebius).map(|r| r.seconds).fold(f64::INFINITY, f64::min)
}

/// One row of the sensitivity report: the systems' goodputs with one
/// calibrated constant scaled by `factor` (`None`: the published set), and
/// Moebius's runs where the sweep was asked for them ([`MoebiusRuns`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SensitivityRow {
    pub constant: Option<&'static str>,
    pub factor: f64,
    pub goodput: Vec<(System, f64)>,
    pub moebius: MoebiusMeasures,
}

/// Which of Moebius's runs each sweep row adds to the goodputs: a rollout
/// step of `rollout` prompts, the bursty trace, both seeded with `seed`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MoebiusRuns {
    pub rollout: Option<usize>,
    pub bursty: bool,
    pub seed: u64,
}

/// What Moebius's published conclusions are checked on in one sweep row
/// (`None` where that run was not asked for).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MoebiusMeasures {
    /// [`rollout_gain`] of the rollout step.
    pub rollout_gain: Option<f64>,
    pub bursty: Option<BurstyMeasures>,
}

/// The bursty trace's figures of static TP, static EP and Moebius.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BurstyMeasures {
    /// Moebius's mode switches.
    pub switches: usize,
    /// Mean quiet-period TPOT of TP, EP and Moebius (seconds).
    pub quiet_tpot: [f64; 3],
    /// Burst TTFT of TP, EP and Moebius: the higher of the two bursts'
    /// peak TTFT ([`BurstyResult::burst_ttft`], seconds).
    pub burst_ttft: [f64; 3],
}

impl BurstyMeasures {
    /// From [`Bench::bursty`]'s results; `None` unless all three ran.
    pub fn of(rs: &[BurstyResult]) -> Option<BurstyMeasures> {
        let get = |s: System| rs.iter().find(|r| r.system == s && r.deployment.is_ok());
        let (tp, ep, mo) = (get(System::StaticTp)?, get(System::StaticEp)?, get(System::Moebius)?);
        Some(BurstyMeasures {
            switches: mo.switches,
            quiet_tpot: [tp.quiet_tpot, ep.quiet_tpot, mo.quiet_tpot],
            burst_ttft: [tp.burst_ttft(), ep.burst_ttft(), mo.burst_ttft()],
        })
    }
}

impl Bench<'_> {
    /// The Moebius runs `runs` asks for, on this bench's cost model.
    pub fn moebius_measures(&self, runs: MoebiusRuns) -> MoebiusMeasures {
        MoebiusMeasures {
            rollout_gain: runs.rollout.and_then(|n| rollout_gain(&self.rollout(n, runs.seed))),
            bursty: if runs.bursty { BurstyMeasures::of(&self.bursty(runs.seed)) } else { None },
        }
    }
}

impl Bench<'_> {
    /// The goodput of each system (0 where it cannot run) without
    /// attainment curves.
    pub fn goodputs(&self, systems: &[System], probe: Probe) -> Vec<(System, f64)> {
        let start = self.start_rate();
        systems.iter().map(|&s| (s, self.evaluated(s, start, probe).map_or(0.0, |b| b.0))).collect()
    }

    /// `moeforge simulate --sensitivity`: every calibrated constant scaled
    /// by each of `factors` in turn, the roofline rebuilt from it and every
    /// system re-evaluated on the same request streams. ExpertPlex keeps the
    /// compiled layout (the search is not rerun), so a row shows how the
    /// conclusions move with the constant, not a re-optimized deployment.
    /// Each row also holds the Moebius runs `runs` asks for (rollout step,
    /// bursty trace) on that row's constants. Refused for a plan whose cost model is a measured profile (it has no
    /// roofline constants to move).
    pub fn sensitivity(
        &self,
        systems: &[System],
        probe: Probe,
        factors: &[f64],
        runs: MoebiusRuns,
    ) -> Result<Vec<SensitivityRow>, String> {
        if self.plan.cost.source != "roofline" {
            return Err(format!(
                "the cost model is `{}`, not the roofline: a measured profile has no calibrated constants to perturb",
                self.plan.cost.source
            ));
        }
        let d = self.spec.deploys.first().ok_or("the bundle's spec holds no deployment")?;
        let (m, c, t) = (self.spec.model(d.model), self.spec.cluster(d.cluster), self.spec.tile_set(d.tiles));
        let base = self.plan.cost.calib;
        let systems: Vec<System> = systems.iter().copied().filter(|&s| self.deployment(s).is_ok()).collect();
        let systems = &systems[..];
        let mut rows = vec![SensitivityRow {
            constant: None,
            factor: 1.0,
            goodput: self.goodputs(systems, probe),
            moebius: self.moebius_measures(runs),
        }];
        for (name, _, _) in base.entries() {
            for &factor in factors {
                let k = base.scaled(name, factor).ok_or_else(|| format!("unknown constant `{name}`"))?;
                let mut plan = self.plan.clone();
                plan.cost = moeforge_plan::cost::CostModel::roofline_with(m, c, t, k);
                let mut bench = Bench::new(self.spec, &plan)?;
                bench.search = self.search.clone();
                rows.push(SensitivityRow {
                    constant: Some(name),
                    factor,
                    goodput: bench.goodputs(systems, probe),
                    moebius: bench.moebius_measures(runs),
                });
            }
        }
        Ok(rows)
    }
}

/// The sensitivity table: per row, the reference system's goodput per node
/// and its ratio over every other system.
pub fn sensitivity_table(rows: &[SensitivityRow], nodes: u32) -> String {
    let mut s = String::new();
    let Some(first) = rows.first() else { return s };
    let Some(&(reference, _)) = first.goodput.first() else { return s };
    let _ = write!(s, "{:<26} {:>6} {:>12}", "constant", "×", format!("{} /node", reference.name()));
    for (sys, _) in first.goodput.iter().skip(1) {
        let _ = write!(s, " {:>15}", sys.name());
    }
    let _ = writeln!(s);
    for r in rows {
        let g0 = r.goodput.first().map_or(0.0, |x| x.1);
        let _ =
            write!(s, "{:<26} {:>6.2} {:>12.3}", r.constant.unwrap_or("(published)"), r.factor, g0 / f64::from(nodes));
        for &(_, g) in r.goodput.iter().skip(1) {
            let cell = if g > 0.0 { format!("{:.2}×", g0 / g) } else { "–".into() };
            let _ = write!(s, " {cell:>15}");
        }
        let _ = writeln!(s);
    }
    let _ = writeln!(s, "ratio = {} goodput / system goodput; – = the system cannot run here", reference.name());
    s
}

/// Factors of the sensitivity sweep: the ±20% table's, and the wider ones
/// the claims report searches for the move that would change a conclusion:
/// ×1/8 to ×8 in steps of √2. Where a goodput moves smoothly with a
/// constant, a step moves it by about √2 at most, well inside the factor-4
/// band of [`GOODPUT_WITHIN`]; where it falls off an SLO cliff (to 0), the
/// band may be stepped over, and the report then shows no move for it.
pub const SENSITIVITY_FACTORS: [f64; 2] = [0.8, 1.2];
pub const CLAIM_FACTORS: [f64; 14] = [
    0.125,
    0.176_776_695_296_636_9,
    0.25,
    0.353_553_390_593_273_8,
    0.5,
    std::f64::consts::FRAC_1_SQRT_2,
    0.8,
    1.2,
    std::f64::consts::SQRT_2,
    2.0,
    2.828_427_124_746_190_3,
    4.0,
    5.656_854_249_492_381,
    8.0,
];
/// "Within 2×" of a published goodput (the bar for the absolute figure).
pub const GOODPUT_WITHIN: f64 = 2.0;
/// A published parity ("similar goodput") holds when the modeled ratio is within ±20%.
pub const PARITY: f64 = 1.2;

/// A published end-to-end conclusion the model should reproduce, checked
/// under every perturbation of the sensitivity sweep.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Claim {
    /// ExpertPlex's goodput per node within [`GOODPUT_WITHIN`] of the measured `per_node`.
    Goodput { per_node: f64 },
    /// ExpertPlex ahead of `system` where the paper measured it ahead
    /// (`paper` > 1), or at parity with it (`paper` = 1, within [`PARITY`]).
    Leads { system: System, paper: f64 },
    /// Moebius's rollout speed over the better static layout's within the
    /// published range.
    RolloutGain { lo: f64, hi: f64 },
    /// Moebius switches modes `paper` times over the bursty trace.
    Switches { paper: usize },
    /// Static TP decodes faster than static EP in the bursty trace's quiet
    /// period: EP's TPOT over TP's within [`PARITY`] of the published ratio.
    QuietTpAhead { paper: f64 },
    /// Moebius's quiet-period TPOT within [`PARITY`] of static TP's.
    TracksTp,
    /// Moebius's burst TTFT below static TP's.
    BurstBelowTp,
}

impl Claim {
    /// The claims of one published setting: its goodput, then each baseline's ratio.
    pub fn of(p: &Published) -> Vec<Claim> {
        p.goodput_per_node
            .map(|g| Claim::Goodput { per_node: g })
            .into_iter()
            .chain(p.ratios.iter().map(|&(system, paper)| Claim::Leads { system, paper }))
            .chain(p.others.iter().copied())
            .collect()
    }

    pub fn describe(&self) -> String {
        match *self {
            Claim::Goodput { per_node } => format!("expertplex within {GOODPUT_WITHIN}× of {per_node} req/s/node"),
            Claim::Leads { system, paper } if paper <= 1.0 => {
                format!("expertplex at parity with {} (±{:.0}%)", system.name(), (PARITY - 1.0) * 100.0)
            }
            Claim::Leads { system, paper } => format!("expertplex ahead of {} (paper {paper:.2}×)", system.name()),
            Claim::RolloutGain { lo, hi } => format!("moebius {lo}–{hi}× the better static layout, rollout"),
            Claim::Switches { paper } => format!("moebius switches {paper} times, bursty trace"),
            Claim::QuietTpAhead { paper } => format!("quiet TPOT: static-ep {paper:.2}× static-tp (±{:.0}%)", pct()),
            Claim::TracksTp => format!("quiet TPOT: moebius tracks static-tp (±{:.0}%)", pct()),
            Claim::BurstBelowTp => "burst TTFT: moebius below static-tp".into(),
        }
    }

    /// Whether the claim holds in one sweep row; `None` when a system or
    /// run it names did not run.
    pub fn holds(&self, row: &SensitivityRow, nodes: u32) -> Option<bool> {
        let of = |s: System| row.goodput.iter().find(|g| g.0 == s).map(|g| g.1);
        let within = |ratio: f64, paper: f64| (1.0 / PARITY..=PARITY).contains(&(ratio / paper));
        let bursty = row.moebius.bursty;
        // [TP, EP, Moebius] of the bursty trace.
        let (tp, ep, mo) = (0, 1, 2);
        match *self {
            Claim::Goodput { per_node } => {
                let ratio = of(System::ExpertPlex)? / f64::from(nodes.max(1)) / per_node;
                Some((1.0 / GOODPUT_WITHIN..=GOODPUT_WITHIN).contains(&ratio))
            }
            Claim::Leads { system, paper } => {
                let (xp, other) = (of(System::ExpertPlex)?, of(system)?);
                if other <= 0.0 && xp <= 0.0 {
                    // Neither serves: no verdict on their order.
                    None
                } else if other <= 0.0 {
                    Some(paper > 1.0)
                } else if paper <= 1.0 {
                    Some(within(xp / other, 1.0))
                } else {
                    Some(xp > other)
                }
            }
            Claim::RolloutGain { lo, hi } => row.moebius.rollout_gain.map(|g| (lo..=hi).contains(&g)),
            Claim::Switches { paper } => bursty.map(|b| b.switches == paper),
            Claim::QuietTpAhead { paper } => bursty.map(|b| within(b.quiet_tpot[ep] / b.quiet_tpot[tp], paper)),
            Claim::TracksTp => bursty.map(|b| within(b.quiet_tpot[mo] / b.quiet_tpot[tp], 1.0)),
            Claim::BurstBelowTp => bursty.map(|b| b.burst_ttft[mo] < b.burst_ttft[tp]),
        }
    }
}

/// [`PARITY`] as a percentage.
fn pct() -> f64 {
    (PARITY - 1.0) * 100.0
}

/// One claim under the sweep: whether it holds with the published
/// constants, and for each constant that changes that, the factors nearest
/// ×1 below and above at which it does (`None` on a side where none does).
#[derive(Clone, Debug, PartialEq)]
pub struct ClaimResult {
    pub claim: Claim,
    pub now: Option<bool>,
    pub changes: Vec<Change>,
}

/// The nearest downward and upward moves of one constant that change a claim.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Change {
    pub constant: &'static str,
    pub down: Option<f64>,
    pub up: Option<f64>,
}

/// Every claim against every row of a sensitivity sweep.
pub fn claims(rows: &[SensitivityRow], claims: &[Claim], nodes: u32) -> Vec<ClaimResult> {
    let now_row = rows.iter().find(|r| r.constant.is_none());
    claims
        .iter()
        .map(|&claim| {
            let now = now_row.and_then(|r| claim.holds(r, nodes));
            let mut changes: Vec<Change> = Vec::new();
            for r in rows {
                let Some(name) = r.constant else { continue };
                let Some(h) = claim.holds(r, nodes) else { continue };
                if now.is_none_or(|n| n == h) {
                    continue;
                }
                let i = match changes.iter().position(|c| c.constant == name) {
                    Some(i) => i,
                    None => {
                        changes.push(Change { constant: name, down: None, up: None });
                        changes.len() - 1
                    }
                };
                let side = if r.factor < 1.0 { &mut changes[i].down } else { &mut changes[i].up };
                if side.is_none_or(|f| r.factor.ln().abs() < f.ln().abs()) {
                    *side = Some(r.factor);
                }
            }
            ClaimResult { claim, now, changes }
        })
        .collect()
}

/// The claims report: per claim, whether it holds and the one-constant moves
/// that would change it, each with the constant's value there and where
/// published measurements put it.
pub fn claims_table(results: &[ClaimResult], base: &moeforge_plan::cost::Calibration, factors: &[f64]) -> String {
    use moeforge_plan::cost::Calibration;
    let mut s = String::new();
    let (lo, hi) = factors.iter().fold((f64::INFINITY, 0.0f64), |(a, b), &f| (a.min(f), b.max(f)));
    let _ = writeln!(s, "{:<52} {:>4}  one-constant moves (×{} … ×{}) that change it", "claim", "now", lo, hi);
    let value = |name: &str| base.entries().iter().find(|e| e.0 == name).map_or(0.0, |e| e.1);
    for r in results {
        let now = match r.now {
            Some(true) => "yes",
            Some(false) => "no",
            None => "–",
        };
        let verb = if r.now == Some(true) { "breaks" } else { "holds" };
        let _ = write!(s, "{:<52} {now:>4}  ", r.claim.describe());
        if r.now.is_none() {
            let needs = match r.claim {
                Claim::RolloutGain { .. } => "not run: give --rollout N",
                Claim::Switches { .. } | Claim::QuietTpAhead { .. } | Claim::TracksTp | Claim::BurstBelowTp => {
                    "not run: give --bursty"
                }
                Claim::Goodput { .. } | Claim::Leads { .. } => "a system it names did not run",
            };
            let _ = writeln!(s, "{needs}");
            continue;
        }
        if r.changes.is_empty() {
            let _ = writeln!(s, "none");
            continue;
        }
        let moves = r.changes.iter().flat_map(|c| [c.down, c.up].into_iter().flatten().map(move |f| (c.constant, f)));
        for (i, (name, f)) in moves.enumerate() {
            let v = value(name) * f;
            let range = match Calibration::published_range(name) {
                Some((a, b)) if (a..=b).contains(&v) => format!("inside published {}–{}", sig(a), sig(b)),
                Some((a, b)) => format!("outside published {}–{}", sig(a), sig(b)),
                None => "assumed, nothing published".into(),
            };
            let lead = if i == 0 { String::new() } else { format!("{:<58}", "") };
            let _ = writeln!(s, "{lead}{verb} at {name} ×{} = {} ({range})", sig(f), sig(v));
        }
    }
    let _ = writeln!(
        s,
        "one constant moves at a time; every layout stays the compiled one; the nearest factor below and above ×1 is shown"
    );
    s
}

/// Four significant digits.
fn sig(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else {
        let digits = (3 - v.abs().log10().floor() as i32).max(0) as usize;
        format!("{v:.digits$}")
    }
}

/// The highest mean of `(arrival, value)` pairs binned by arrival into
/// `width`-second bins from time 0 (0 without pairs).
pub fn peak_bin_mean(pairs: impl Iterator<Item = (f64, f64)>, width: f64) -> f64 {
    let mut bins: std::collections::BTreeMap<i64, (f64, u32)> = std::collections::BTreeMap::new();
    for (at, v) in pairs {
        let b = bins.entry((at / width).floor() as i64).or_default();
        *b = (b.0 + v, b.1 + 1);
    }
    bins.values().map(|&(sum, n)| sum / f64::from(n)).fold(0.0, f64::max)
}

/// One system on Moebius §6.2's bursty trace ([`super::workload::moebius_bursty`]).
#[derive(Clone, Debug, PartialEq)]
pub struct BurstyResult {
    pub system: System,
    pub deployment: Result<Deployment, String>,
    /// Mode switches completed.
    pub switches: usize,
    /// Each burst's peak TTFT as Moebius §6.2 reports it ("mean TTFT over
    /// arrivals in 10 s bins": TP's reaching 9.9 s, Moebius's peaking at
    /// 3.1 s): the highest mean over the 10 s bins of arrivals in the
    /// burst's half of the trace (split mid-quiet at a bin's edge, so the bins its backlog
    /// spills into count), served requests only.
    pub burst_peak: [f64; 2],
    /// p99 TTFT of the requests arriving in each burst (its 20 s of
    /// arrivals; Moebius's at 6.0 and 1.9 s).
    pub burst_p99: [f64; 2],
    /// Mean TPOT of the requests arriving in the quiet period, from 60 s
    /// after the first burst (once its backlog has drained) to its end.
    pub quiet_tpot: f64,
    /// Requests that never got a first token (refused or unfinished).
    pub unserved: usize,
    /// Requests retracted to make KV room (SGLang's `retract_decode`), each time counted.
    pub retractions: usize,
}

impl BurstyResult {
    /// The higher of the two bursts' peak TTFT (Moebius §6.2: TP's "mean
    /// TTFT reaches 9.9 s", Moebius's "burst TTFT peaks at 3.1 s").
    pub fn burst_ttft(&self) -> f64 {
        self.burst_peak[0].max(self.burst_peak[1])
    }
}

impl Bench<'_> {
    /// Static TP, static EP and Moebius on the bursty trace.
    pub fn bursty(&self, seed: u64) -> Vec<BurstyResult> {
        use super::workload::{moebius_bursty, BURSTY_QUIET};
        let reqs = moebius_bursty(seed);
        let (q0, q1) = BURSTY_QUIET;
        [System::StaticTp, System::StaticEp, System::Moebius]
            .into_iter()
            .map(|system| {
                let dep = self.deployment(system);
                let Ok(d) = &dep else {
                    return BurstyResult {
                        system,
                        deployment: dep,
                        switches: 0,
                        burst_peak: [0.0; 2],
                        burst_p99: [0.0; 2],
                        quiet_tpot: 0.0,
                        unserved: 0,
                        retractions: 0,
                    };
                };
                let trace = self.simulate_traced(d, &reqs);
                let out = &trace.outcomes;
                let mean = |xs: Vec<f64>| if xs.is_empty() { 0.0 } else { xs.iter().sum::<f64>() / xs.len() as f64 };
                let ttfts = |from: f64, to: f64| {
                    reqs.iter()
                        .zip(out)
                        .filter(move |(r, _)| r.arrival >= from && r.arrival < to)
                        .filter_map(|(_, o)| o.ttft)
                };
                let bursts = [(0.0, q0), (q1, f64::INFINITY)];
                // Mid-quiet, on a bin's edge (no bin is split between the bursts).
                let mid = ((q0 + q1) / 20.0).floor() * 10.0;
                let burst_peak = [(0.0, mid), (mid, f64::INFINITY)].map(|(a, b)| {
                    let served = reqs.iter().zip(out).filter(|(r, _)| r.arrival >= a && r.arrival < b);
                    peak_bin_mean(served.filter_map(|(r, o)| Some((r.arrival, o.ttft?))), 10.0)
                });
                let burst_p99 = bursts.map(|(a, b)| percentile(ttfts(a, b), 99.0).unwrap_or(0.0));
                let quiet_tpot = mean(
                    reqs.iter()
                        .zip(out)
                        .filter(|(r, _)| r.arrival >= q0 + 60.0 && r.arrival < q1)
                        .filter_map(|(_, o)| o.tpot)
                        .collect(),
                );
                let unserved = out.iter().filter(|o| o.ttft.is_none()).count();
                BurstyResult {
                    system,
                    deployment: dep,
                    switches: trace.switches.len(),
                    burst_peak,
                    burst_p99,
                    quiet_tpot,
                    unserved,
                    retractions: trace.retractions,
                }
            })
            .collect()
    }
}

/// One system's serving under one placement policy's routing.
#[derive(Clone, Debug, PartialEq)]
pub struct PlacementResult {
    /// The system evaluated: ExpertPlex where the plan's replicas sit on its
    /// MoE servers, colocated DP+EP otherwise.
    pub system: System,
    /// `None`: uniform expert popularity (no skew to place against).
    pub policy: Option<moeforge_dsl::spec::PlacementPolicy>,
    pub busiest: f64,
    pub local: f64,
    pub goodput: f64,
}

impl Bench<'_> {
    /// The layout the placement pass placed for, under every placement
    /// policy's routing of the plan's expert loads: ExpertPlex (the plan's
    /// roles) where the replicas sit on its MoE servers, colocated DP+EP
    /// otherwise. The busiest EP rank's share of rows sets the MoE time of a
    /// layer, the fraction served on the sender's node sets how much crosses
    /// the NICs. A first row with uniform popularity shows what the skew costs.
    pub fn placements(&self, probe: Probe) -> Result<Vec<PlacementResult>, String> {
        use moeforge_plan::cost::step::MoeSide;
        let p =
            self.plan.placement.as_ref().ok_or("the deployment has no expert placement (`placement { policy }`)")?;
        if p.stats.is_empty() {
            return Err("the plan's placement holds no routing statistics (a bundle from an older moeforge)".into());
        }
        let system = if self.plan.roles.as_ref().is_some_and(|r| r.moe_servers()) {
            System::ExpertPlex
        } else {
            System::Colocated
        };
        let mut base = self.deployment(system)?;
        let uniform_local = match moe_shapes(&mut base.phases).last().map(|s| s.moe) {
            Some(MoeSide::Ep { local, .. }) => local,
            _ => 1.0,
        };
        // The statistics count rows served on the sender's node with the
        // placed GPUs as the senders, one per GPU; under uniform routing
        // that is 1/k over the k nodes holding them. ExpertPlex's senders are
        // its attention servers, and one on a node without MoE servers never
        // serves a row locally: scale by the uniform layout's locality over 1/k
        // (1 for colocated serving and for attention on every MoE node).
        let k = match &self.plan.roles {
            Some(r) if system == System::ExpertPlex => r.per_node.iter().filter(|n| n[0] > 0).count(),
            _ => self.env.nodes as usize,
        };
        let scale = (uniform_local * k.max(1) as f64).min(1.0);
        let rows = std::iter::once((None, 1.0, uniform_local))
            .chain(p.stats.iter().map(|s| (Some(s.policy), s.busiest, (s.local * scale).min(1.0))));
        let start = (self.goodputs(&[system], probe)[0].1 / 2.0).max(0.05);
        Ok(rows
            .map(|(policy, busiest, local)| {
                let mut env = self.env.clone();
                env.skew = busiest;
                let mut dep = base.clone();
                for shape in moe_shapes(&mut dep.phases) {
                    if let MoeSide::Ep { local: l, .. } = &mut shape.moe {
                        *l = local;
                    }
                }
                let bench = Bench {
                    spec: self.spec,
                    plan: self.plan,
                    env,
                    search: self.search.clone(),
                    length_cap: self.length_cap,
                };
                PlacementResult { system, policy, busiest, local, goodput: bench.goodput(&dep, start, probe) }
            })
            .collect())
    }
}

/// The shapes of a deployment whose phases route to the EP MoE side: a
/// unified engine's EP shape, or both sides of a split one.
fn moe_shapes(p: &mut super::Phases) -> Vec<&mut super::Shape> {
    match p {
        super::Phases::Unified { ep: Some(shape), .. } => vec![shape],
        super::Phases::Split { prefill, decode, .. } => vec![prefill, decode],
        super::Phases::Unified { .. } => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bins [0, 10) and [10, 20) of 10 s by arrival: means (1 + 3) / 2 = 2
    /// and (8 + 2 + 5) / 3 = 5, the peak 5; an arrival at 19.99 is in the
    /// second bin, one at 20 would open a third; no pairs, 0.
    #[test]
    fn the_peak_bin_mean_is_the_highest_ten_second_bins_mean() {
        let pairs = [(0.0, 1.0), (9.5, 3.0), (10.0, 8.0), (12.0, 2.0), (19.99, 5.0)];
        assert_eq!(peak_bin_mean(pairs.into_iter(), 10.0), 5.0);
        assert_eq!(peak_bin_mean(pairs.into_iter().chain([(20.0, 5.5)]), 10.0), 5.5);
        assert_eq!(peak_bin_mean(pairs.into_iter().take(2), 10.0), 2.0);
        assert_eq!(peak_bin_mean(std::iter::empty(), 10.0), 0.0);
    }
    use moeforge_plan::cost::Calibration;

    fn row(constant: Option<&'static str>, factor: f64, xp: f64, green: f64) -> SensitivityRow {
        SensitivityRow {
            constant,
            factor,
            goodput: vec![(System::ExpertPlex, xp), (System::GreenContext, green)],
            moebius: MoebiusMeasures::default(),
        }
    }

    #[test]
    fn a_claim_holds_by_its_published_rule() {
        let g = |xp: f64, other: f64| row(None, 1.0, xp, other);
        let goodput = Claim::Goodput { per_node: 10.0 };
        // Within 2× either way, per node.
        assert_eq!(goodput.holds(&g(20.0, 1.0), 1), Some(true));
        assert_eq!(goodput.holds(&g(20.1, 1.0), 1), Some(false));
        assert_eq!(goodput.holds(&g(5.0, 1.0), 1), Some(true));
        assert_eq!(goodput.holds(&g(4.9, 1.0), 1), Some(false));
        assert_eq!(goodput.holds(&g(40.0, 1.0), 2), Some(true));
        let ahead = Claim::Leads { system: System::GreenContext, paper: 1.41 };
        assert_eq!(ahead.holds(&g(2.0, 1.9), 1), Some(true));
        assert_eq!(ahead.holds(&g(1.9, 2.0), 1), Some(false));
        // A baseline that cannot serve at all is behind.
        assert_eq!(ahead.holds(&g(1.0, 0.0), 1), Some(true));
        let parity = Claim::Leads { system: System::GreenContext, paper: 1.0 };
        assert_eq!(parity.holds(&g(1.19, 1.0), 1), Some(true));
        assert_eq!(parity.holds(&g(1.0, 1.25), 1), Some(false));
        // Neither serves: no verdict on their order.
        assert_eq!(ahead.holds(&g(0.0, 0.0), 1), None);
        // A system the claim names that did not run: no verdict.
        assert_eq!(Claim::Leads { system: System::Colocated, paper: 2.0 }.holds(&g(1.0, 1.0), 1), None);
    }

    #[test]
    fn the_nearest_move_that_changes_a_claim_is_reported_per_constant() {
        // Hand-built sweep: with the published constants ExpertPlex is behind
        // Green Context (40 vs 50) and 4× a paper's 10 req/s/node: both claims fail.
        let rows = vec![
            row(None, 1.0, 40.0, 50.0),
            // comm_floor: ahead at ×4 and ×8 (×4 is nearer ×1), never within 2×.
            row(Some("comm_floor"), 2.0, 35.0, 45.0),
            row(Some("comm_floor"), 4.0, 30.0, 27.0),
            row(Some("comm_floor"), 8.0, 25.0, 20.0),
            // gemm_memory_efficiency: within 2× at ×0.25 and ×0.5 (nearer), never ahead.
            row(Some("gemm_memory_efficiency"), 0.25, 8.0, 12.0),
            row(Some("gemm_memory_efficiency"), 0.5, 19.0, 25.0),
            row(Some("gemm_memory_efficiency"), 2.0, 80.0, 90.0),
        ];
        let got = claims(
            &rows,
            &[Claim::Goodput { per_node: 10.0 }, Claim::Leads { system: System::GreenContext, paper: 1.41 }],
            1,
        );
        assert_eq!(got[0].now, Some(false));
        let change = |constant, down, up| Change { constant, down, up };
        assert_eq!(got[0].changes, vec![change("gemm_memory_efficiency", Some(0.5), None)]);
        assert_eq!(got[1].now, Some(false));
        assert_eq!(got[1].changes, vec![change("comm_floor", None, Some(4.0))]);
        // A claim that holds lists the moves that break it.
        // Moves on both sides are reported, each the nearest on its side.
        let ahead_now = vec![
            row(None, 1.0, 40.0, 30.0),
            row(Some("op_overhead"), 0.25, 40.0, 45.0),
            row(Some("op_overhead"), 0.5, 40.0, 41.0),
            row(Some("op_overhead"), 2.0, 40.0, 41.0),
        ];
        let got_ahead = claims(&ahead_now, &[Claim::Leads { system: System::GreenContext, paper: 1.41 }], 1);
        assert_eq!(
            (got_ahead[0].now, got_ahead[0].changes.clone()),
            (Some(true), vec![change("op_overhead", Some(0.5), Some(2.0))])
        );
        let table = claims_table(&got, &Calibration::published(), &CLAIM_FACTORS);
        assert!(
            table.contains("holds at gemm_memory_efficiency ×0.5000 = 0.3247 (outside published 0.5039–0.7964)"),
            "{table}"
        );
        assert!(table.contains("holds at comm_floor ×4.000 = 0.00009600 (outside published"), "{table}");
        let table = claims_table(&got_ahead, &Calibration::published(), &CLAIM_FACTORS);
        assert!(table.contains("breaks at op_overhead ×2.000 = 0.00001000 (assumed, nothing published)"), "{table}");
    }

    /// A sweep row holding only Moebius's runs.
    fn moebius_row(gain: Option<f64>, bursty: Option<BurstyMeasures>) -> SensitivityRow {
        SensitivityRow {
            constant: None,
            factor: 1.0,
            goodput: vec![],
            moebius: MoebiusMeasures { rollout_gain: gain, bursty },
        }
    }

    #[test]
    fn moebius_claims_hold_by_their_published_rules() {
        // The paper's own figures: quiet TPOT TP 37, EP 52 ms, Moebius on
        // TP's; burst TTFT TP 9.9, EP 2.0, Moebius 3.1 s; four switches.
        let paper = BurstyMeasures { switches: 4, quiet_tpot: [0.037, 0.052, 0.037], burst_ttft: [9.9, 2.0, 3.1] };
        let all = |row: &SensitivityRow| MOEBIUS_CLAIMS.map(|c| c.holds(row, 1));
        assert_eq!(all(&moebius_row(Some(1.2), Some(paper))), [Some(true); 5]);
        // Without the runs, no verdict.
        assert_eq!(all(&moebius_row(None, None)), [None; 5]);
        let gain = Claim::RolloutGain { lo: 1.16, hi: 1.25 };
        assert_eq!(gain.holds(&moebius_row(Some(1.09), None), 1), Some(false));
        assert_eq!(gain.holds(&moebius_row(Some(1.16), None), 1), Some(true));
        assert_eq!(gain.holds(&moebius_row(Some(1.31), None), 1), Some(false));
        // A hand-built row: 6 switches (not the paper's 4), TP 50.6
        // and EP ~equal quiet TPOTs (1.02×: not TP's published 1.41× lead,
        // below 52/37/1.2 = 1.171), Moebius at 49.7 ms (tracks), 0.17 s
        // burst TTFT against TP's 38 s.
        let model =
            BurstyMeasures { switches: 6, quiet_tpot: [0.0506, 0.0516, 0.0497], burst_ttft: [38.0, 0.16, 0.17] };
        assert_eq!(all(&moebius_row(None, Some(model)))[1..], [Some(false), Some(false), Some(true), Some(true)]);
        // EP 1.18× TP's is inside ±20% of 52/37 (1.171–1.686), 1.17× is not.
        let quiet = |ep: f64| BurstyMeasures { quiet_tpot: [0.1, ep, 0.1], ..paper };
        let ahead = Claim::QuietTpAhead { paper: 52.0 / 37.0 };
        assert_eq!(ahead.holds(&moebius_row(None, Some(quiet(0.118))), 1), Some(true));
        assert_eq!(ahead.holds(&moebius_row(None, Some(quiet(0.117))), 1), Some(false));
        // A burst TTFT equal to TP's is not below it.
        let tie = BurstyMeasures { burst_ttft: [3.0, 1.0, 3.0], ..paper };
        assert_eq!(Claim::BurstBelowTp.holds(&moebius_row(None, Some(tie)), 1), Some(false));
        // The claims table says which flag a missing run needs.
        let none = claims(&[moebius_row(None, None)], &MOEBIUS_CLAIMS, 1);
        let table = claims_table(&none, &Calibration::published(), &CLAIM_FACTORS);
        assert!(table.contains("not run: give --rollout N"), "{table}");
        assert!(table.contains("not run: give --bursty"), "{table}");
    }

    #[test]
    fn the_rollout_gain_is_over_the_faster_static_layout() {
        let r = |system, seconds| RolloutResult { system, deployment: Err(String::new()), seconds };
        let rs = [r(System::StaticTp, 1062.4), r(System::StaticEp, 826.9), r(System::Moebius, 749.5)];
        assert_eq!(rollout_gain(&rs), Some(826.9 / 749.5));
        // Moebius unfinished, or not run: no verdict.
        let rs = [r(System::StaticTp, 10.0), r(System::Moebius, f64::INFINITY)];
        assert_eq!(rollout_gain(&rs), None);
        assert_eq!(rollout_gain(&rs[..1]), None);
    }

    #[test]
    fn every_published_setting_has_its_claims() {
        use moeforge_dsl::spec::LengthDist;
        let p = published("minimax-m2", &LengthDist::Sharegpt, 8).unwrap_or_else(|| panic!("minimax sharegpt"));
        // Another cluster is not the paper's setting.
        assert!(published("minimax-m2", &LengthDist::Sharegpt, 16).is_none());
        let c = Claim::of(&p);
        assert_eq!(c.len(), 5);
        assert_eq!(c[0], Claim::Goodput { per_node: 11.3 });
        assert!(c.contains(&Claim::Leads { system: System::GreenContext, paper: 1.41 }));
        let glm = published("glm-5", &LengthDist::Sharegpt, 24).unwrap_or_else(|| panic!("glm sharegpt"));
        assert!(Claim::of(&glm)[1].describe().contains("parity"));
        let moebius = published("qwen3-235b-a22b", &LengthDist::Rollout, 8).unwrap_or_else(|| panic!("qwen3-235b"));
        assert_eq!(Claim::of(&moebius), MOEBIUS_CLAIMS.to_vec());
    }
}
