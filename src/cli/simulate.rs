//! `moeforge simulate`: the serving simulator (runtime `sim` backend) over a
//! spec's deployment, writing CSV and SVG and printing goodput ratios.

use super::{error, fail, load, out, pick, read_profile, warn, Format};
use moeforge::codegen;
use moeforge::embedded;
use moeforge::runtime::sim::report::{self, Probe};
use moeforge::runtime::sim::{Bench, System};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A `.moe` file holding a `deploy` block; omitted: the embedded default.
    file: Option<PathBuf>,
    /// Output directory, written atomically; an existing one is replaced only when it holds
    /// nothing but this command's outputs (anything else there is refused).
    #[arg(short, long, default_value = "sim")]
    output: PathBuf,
    #[arg(long)]
    deploy: Option<String>,
    /// Systems to compare (comma-separated; the first is the reference
    /// of the ratios). Default: all of expertplex, pd-disagg,
    /// green-context, colocated, chunked-prefill, static-tp, static-ep, moebius.
    #[arg(long, value_delimiter = ',')]
    systems: Vec<String>,
    /// Seconds of arrivals each probe simulates.
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Points of the attainment-vs-rate curves.
    #[arg(long, default_value_t = 12)]
    rates: usize,
    /// Also run one RL rollout step of this many prompts (static TP, static EP, Moebius).
    #[arg(long)]
    rollout: Option<usize>,
    /// A measured latency profile (JSON samples) that overrides the roofline cost model.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Also report how each headline ratio moves when each calibrated
    /// constant of the cost model moves ±20%, and, for a setting the papers
    /// measured, which one-constant move (×1/8 … ×8) would change each of
    /// their conclusions (writes sensitivity.txt).
    #[arg(long)]
    sensitivity: bool,
    /// Also replay Moebius §6.2's bursty trace (two bursts around a quiet
    /// period) on static TP, static EP and Moebius.
    #[arg(long)]
    bursty: bool,
}

pub fn run(a: Args) -> Result<(), ExitCode> {
    let (checked, embedded) = load(&a.file);
    let checked = checked.map_err(|f| fail(&f.sources, &f.diagnostics, Format::Human))?;
    let id = pick(&checked, a.deploy.as_deref()).map_err(|d| fail(&checked.sources, &d, Format::Human))?;
    warn(&checked.sources, &checked.warnings_for(id), Format::Human);
    let systems = systems(&a.systems).map_err(|e| error(e, "see `moeforge simulate --help`"))?;
    let valid = a.seconds.is_finite()
        && a.seconds > 0.0
        && a.seconds <= 86_400.0
        && (1..=1000).contains(&a.rates)
        && a.rollout.is_none_or(|n| (1..=1_000_000).contains(&n));
    if !valid {
        return Err(error(
            "--seconds must be in (0, 86400], --rates in 1..=1000, --rollout in 1..=1000000",
            "e.g. --seconds 60 --rates 12 --rollout 2048",
        ));
    }
    let opts = codegen::PlanOptions { profile: read_profile(&a.profile)?, ..Default::default() };
    let (plan, w) =
        codegen::plan_with_warnings(&checked, id, &opts).map_err(|d| fail(&checked.sources, &d, Format::Human))?;
    warn(&checked.sources, &w, Format::Human);
    if embedded {
        eprintln!("note: no spec given; simulating the embedded default {}", embedded::DEFAULT_SPEC);
    }
    let spec = checked.spec.deployment(id);
    let mut bench = Bench::new(&spec, plan.plan())
        .map_err(|e| error(e, "refit the profile with more samples over the serving range"))?;
    if bench.search.is_none() {
        // The strategy did not ask for the layout search; ExpertPlex still needs its layout.
        let d = spec.deploy(moeforge::dsl::spec::DeployId(0));
        bench = bench.with_search(codegen::passes::search::search(&spec, d, &plan.plan().cost));
    }
    let (mut text, mut files) = compare(&bench, &systems, &a);
    if bench.plan.placement.is_some() {
        let probe = Probe { seconds: a.seconds, seed: a.seed };
        match bench.placements(probe) {
            Ok(rs) => {
                let loads = bench.plan.placement.as_ref().map_or("", |p| p.loads.as_str());
                let on = match rs.first().map(|r| r.system) {
                    Some(System::ExpertPlex) => "ExpertPlex on its MoE servers",
                    _ => "colocated DP+EP",
                };
                let _ = writeln!(text, "\nExpert placement, {on} under the placement pass's loads ({loads}):");
                let mut csv = String::from("placement,busiest_over_mean,local_fraction,goodput\n");
                for r in &rs {
                    let name = r.policy.map_or("uniform popularity", |p| match p {
                        moeforge::dsl::spec::PlacementPolicy::None => "none",
                        moeforge::dsl::spec::PlacementPolicy::Eplb => "eplb",
                        moeforge::dsl::spec::PlacementPolicy::Zepp => "zepp",
                    });
                    let _ = writeln!(
                        text,
                        "{name:<20} busiest rank {:>5.2}× the mean, {:>5.1}% of rows on the sender's node, goodput {:>8.3} req/s",
                        r.busiest,
                        r.local * 100.0,
                        r.goodput
                    );
                    let _ = writeln!(csv, "{name},{:.4},{:.4},{:.4}", r.busiest, r.local, r.goodput);
                }
                files.push(("placement.csv", csv));
            }
            Err(why) => {
                let _ = writeln!(text, "\nExpert placement: not evaluated: {why}");
            }
        }
    }
    if a.bursty {
        let rs = bench.bursty(a.seed);
        text.push_str(
            "\nMoebius bursty trace (§6.2: 375 s, bursts peaking at 80 and 120 req/s around a quiet 1–5 req/s)\n",
        );
        let mut csv = String::from(
            "system,deployment,switches,burst1_ttft_peak_s,burst2_ttft_peak_s,burst1_ttft_p99_s,burst2_ttft_p99_s,\
             quiet_tpot_s,unserved,retractions\n",
        );
        for r in &rs {
            match &r.deployment {
                Ok(dep) => {
                    let _ = writeln!(
                        text,
                        "{:<12} {:<28} {} switches, burst TTFT peak {:>5.2} / {:>5.2} s, p99 {:>6.2} / {:>6.2} s, quiet TPOT {:>5.1} ms, {} unserved, {} retractions",
                        r.system.name(),
                        dep.label,
                        r.switches,
                        r.burst_peak[0],
                        r.burst_peak[1],
                        r.burst_p99[0],
                        r.burst_p99[1],
                        r.quiet_tpot * 1e3,
                        r.unserved,
                        r.retractions
                    );
                    let _ = writeln!(
                        csv,
                        "{},\"{}\",{},{:.4},{:.4},{:.4},{:.4},{:.6},{},{}",
                        r.system.name(),
                        dep.label,
                        r.switches,
                        r.burst_peak[0],
                        r.burst_peak[1],
                        r.burst_p99[0],
                        r.burst_p99[1],
                        r.quiet_tpot,
                        r.unserved,
                        r.retractions
                    );
                }
                Err(why) => {
                    let _ = writeln!(text, "{:<12} not run: {why}", r.system.name());
                }
            }
        }
        text.push_str(
            "paper (Moebius §6.2, Fig. 9): mean TTFT in the bursts reaches TP 9.9 s and EP 2.0 s, Moebius peaks at 3.1 s; \
             p99 TTFT Moebius 6.0 / 1.9 s, TP 90 s at burst onset; quiet-period TPOT TP 37 ms and EP 52 ms, Moebius \
             tracks TP's; Moebius switches 4 times\n",
        );
        files.push(("bursty.csv", csv));
    }
    if a.sensitivity {
        let probe = Probe { seconds: a.seconds, seed: a.seed };
        let d = &bench.spec.deploys[0];
        // A published setting also gets the wider sweep its claims are
        // checked on; Moebius's only with the runs they need.
        let paper = report::published(&bench.spec.model(d.model).name, &d.workload.input, bench.env.world)
            .filter(|p| p.goodput_per_node.is_some() || !p.ratios.is_empty() || a.rollout.is_some() || a.bursty);
        let factors: &[f64] = if paper.is_some() { &report::CLAIM_FACTORS } else { &report::SENSITIVITY_FACTORS };
        let runs = match &paper {
            Some(p) if !p.others.is_empty() => {
                report::MoebiusRuns { rollout: a.rollout, bursty: a.bursty, seed: a.seed }
            }
            _ => report::MoebiusRuns::default(),
        };
        let rows = bench
            .sensitivity(&systems, probe, factors, runs)
            .map_err(|e| error(e, "run --sensitivity without --profile"))?;
        let near: Vec<report::SensitivityRow> = rows
            .iter()
            .filter(|r| r.constant.is_none() || report::SENSITIVITY_FACTORS.contains(&r.factor))
            .cloned()
            .collect();
        let mut table = report::sensitivity_table(&near, bench.env.nodes);
        text.push_str("\nSensitivity: each calibrated constant ×0.8 and ×1.2 (the layout stays the compiled one)\n");
        text.push_str(&table);
        if let Some(p) = paper {
            let results = report::claims(&rows, &report::Claim::of(&p), bench.env.nodes);
            let claims = report::claims_table(&results, &bench.plan.cost.calib, factors);
            let head = format!("\nThe paper's conclusions ({}) under one-constant moves\n", p.setting);
            text.push_str(&head);
            text.push_str(&claims);
            table.push_str(&head);
            table.push_str(&claims);
        }
        files.push(("sensitivity.txt", table));
    }
    // What other runs of `simulate` write (flags add files).
    let also = [
        "goodput.csv",
        "attainment.csv",
        "attainment.svg",
        "placement.csv",
        "bursty.csv",
        "rollout.csv",
        "sensitivity.txt",
    ];
    moeforge::plan::bundle::write_dir_exec(&a.output, files.iter().map(|(n, b)| (*n, b.as_bytes())), &[], &also)
        .map_err(|e| error(format!("cannot write {}: {e}", a.output.display()), ""))?;
    out(&text);
    let names: Vec<&str> = files.iter().map(|f| f.0).collect();
    out(&format!("wrote {} to {}", names.join(", "), a.output.display()));
    Ok(())
}

/// Parses `--systems`; empty means all.
fn systems(names: &[String]) -> Result<Vec<System>, String> {
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
fn compare(bench: &Bench, systems: &[System], a: &Args) -> (String, Vec<(&'static str, String)>) {
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
    let model = &bench.spec.model(d.model).name;
    let paper = report::published(model, &d.workload.input, bench.env.world);
    text.push_str(&report::table(&results, nodes, paper.as_ref()));
    let mut files = vec![
        ("goodput.csv", report::goodput_csv(&results, nodes)),
        ("attainment.csv", report::curves_csv(&results, nodes)),
        ("attainment.svg", report::svg(&results, nodes, &title)),
    ];
    if let Some(n) = a.rollout {
        let rs = bench.rollout(n, a.seed);
        let _ = writeln!(text, "\nRL rollout step: {n} prompts at once, completion time");
        let mut csv = String::from("system,deployment,seconds\n");
        let best_static = report::better_static_seconds(&rs);
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
