//! `moeforge simulate`: the serving simulator (runtime `sim` backend) over a
//! spec's deployment, writing CSV and SVG and printing goodput ratios.

use moeforge::runtime::sim::report::{self, Probe};
use moeforge::runtime::sim::{Bench, System};
use std::fmt::Write as _;

pub struct Args {
    pub seconds: f64,
    pub seed: u64,
    pub rates: usize,
    pub rollout: Option<usize>,
}

/// Parses `--systems`; empty means all.
pub fn systems(names: &[String]) -> Result<Vec<System>, String> {
    if names.is_empty() {
        return Ok(System::ALL.to_vec());
    }
    names
        .iter()
        .map(|n| {
            System::parse(n).ok_or_else(|| {
                format!(
                    "unknown system `{n}` (known: {})",
                    System::ALL.iter().map(|s| s.name()).collect::<Vec<_>>().join(", ")
                )
            })
        })
        .collect()
}

/// Runs the comparison; returns the printed report and the files to write.
pub fn run(bench: &Bench, systems: &[System], a: &Args) -> (String, Vec<(&'static str, String)>) {
    let nodes = bench.env.nodes;
    let probe = Probe { seconds: a.seconds, seed: a.seed };
    let results = bench.compare(systems, a.rates, probe);
    let d = &bench.spec.deploys[0];
    let title = format!(
        "{}: TTFT {} s, TPOT {} ms, {} s of arrivals per probe",
        d.name,
        d.slo.ttft,
        d.slo.tpot * 1e3,
        a.seconds
    );
    let mut text = String::new();
    let _ = writeln!(text, "{title}\n");
    text.push_str(&report::table(&results, nodes));
    let mut files = vec![
        ("goodput.csv", report::goodput_csv(&results, nodes)),
        ("attainment.csv", report::curves_csv(&results, nodes)),
        ("attainment.svg", report::svg(&results, nodes, &title)),
    ];
    if let Some(n) = a.rollout {
        let rs = bench.rollout(n, a.seed);
        let _ = writeln!(text, "\nRL rollout step: {n} prompts at once, completion time");
        let mut csv = String::from("system,deployment,seconds\n");
        let best_static =
            rs.iter().filter(|r| r.system != System::Moebius).map(|r| r.seconds).fold(f64::INFINITY, f64::min);
        for r in &rs {
            match &r.deployment {
                Ok(dep) => {
                    let vs = if r.seconds.is_finite() { best_static / r.seconds } else { 0.0 };
                    let _ = writeln!(
                        text,
                        "{:<12} {:<28} {:>9.1} s   {:.2}× the better static layout's speed",
                        r.system.name(),
                        dep.label,
                        r.seconds,
                        vs
                    );
                    let _ = writeln!(csv, "{},\"{}\",{:.3}", r.system.name(), dep.label, r.seconds);
                }
                Err(why) => {
                    let _ = writeln!(text, "{:<12} not run: {why}", r.system.name());
                }
            }
        }
        files.push(("rollout.csv", csv));
    }
    (text, files)
}
