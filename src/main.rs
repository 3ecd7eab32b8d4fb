//! The `moeforge` command line: check, compile, explain and simulate `.moe`
//! specs; run bundles on the CPU twin.

mod simulate;

use clap::{Parser, Subcommand, ValueEnum};
use moeforge::codegen::{self, NvccMode};
use moeforge::dsl::{self, Checked, Code, Diagnostic, Diagnostics, Failed, FsLoader, Loader, SourceMap};
use moeforge::embedded;
use moeforge::plan;
use moeforge::runtime::twin;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "moeforge",
    version,
    about = "Compile a MoE model + cluster + tiles spec into a specialized serving bundle"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Default, ValueEnum)]
enum Format {
    /// Rendered diagnostics and text.
    #[default]
    Human,
    /// JSON on stdout (diagnostics as an array of objects).
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Check spec files; print every diagnostic; exit non-zero on any error.
    Check {
        /// `.moe` files (with the files they `use`).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Compile one deployment into a bundle directory (written atomically).
    Compile {
        /// A `.moe` file holding a `deploy` block; omitted: the embedded
        /// default (Qwen3-30B-A3B on 1×8 H200).
        file: Option<PathBuf>,
        /// Output directory; replaced atomically if it exists.
        #[arg(short, long, default_value = "bundle")]
        output: PathBuf,
        /// Which deployment, when the file has several.
        #[arg(long)]
        deploy: Option<String>,
        /// `auto` ($MOEFORGE_NVCC, then PATH), `off`, or a path to nvcc.
        #[arg(long, default_value = "auto")]
        nvcc: String,
        /// A measured latency profile (JSON samples) that overrides the roofline cost model.
        #[arg(long)]
        profile: Option<PathBuf>,
        /// Measured expert loads (SGLang expert statistics JSON) for the placement pass.
        #[arg(long)]
        loads: Option<PathBuf>,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Write random bf16 weights for a spec's model in Hugging Face safetensors names.
    InitWeights {
        /// A `.moe` file holding the model (through a deployment or alone).
        spec: PathBuf,
        /// Which deployment's model, when the file has several.
        #[arg(long)]
        deploy: Option<String>,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Output directory (model.safetensors).
        #[arg(short, long)]
        output: PathBuf,
        /// Tensor naming: `qwen3-moe` or `mixtral`.
        #[arg(long, default_value = "qwen3-moe")]
        family: String,
    },
    /// Serve prompts from a bundle: prints tokens, switch events and per-step timings.
    Run {
        /// A bundle directory written by `moeforge compile`.
        bundle: PathBuf,
        /// Execution backend; `cpu` is the twin (simulated ranks on the host).
        #[arg(long, default_value = "cpu")]
        backend: String,
        /// Checkpoint directory (*.safetensors).
        #[arg(long)]
        weights: PathBuf,
        /// A prompt as token ids (`"1 2 3"`); repeatable.
        #[arg(long)]
        prompt: Vec<String>,
        /// A file of prompts, one per line as token ids; `#` starts a comment.
        #[arg(long)]
        prompts: Option<PathBuf>,
        /// Tokens to generate per request.
        #[arg(long, default_value_t = 16)]
        max_new: usize,
        /// Request i arrives at step i × this (0: all at once).
        #[arg(long, default_value_t = 0)]
        arrive_every: usize,
        /// Starting mode: `ep` or `tp` (when the plan holds it).
        #[arg(long, default_value = "ep")]
        start: String,
        /// Force a switch before these steps (comma-separated), instead of the policy.
        #[arg(long, value_delimiter = ',')]
        switch_at: Vec<usize>,
    },
    /// Simulate serving a deployment under its workload: every system on the
    /// same cost model; writes goodput.csv, attainment.csv and attainment.svg.
    Simulate {
        /// A `.moe` file holding a `deploy` block; omitted: the embedded default.
        file: Option<PathBuf>,
        /// Output directory; replaced atomically if it exists.
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
    },
    /// Print the checked spec (as canonical .moe) and the plan, without writing anything.
    Explain {
        /// A `.moe` file holding a `deploy` block; omitted: the embedded default.
        file: Option<PathBuf>,
        #[arg(long)]
        deploy: Option<String>,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}

/// Prints diagnostics in the chosen format and returns the failure code.
fn fail(sources: &SourceMap, diags: &Diagnostics, format: Format) -> ExitCode {
    match format {
        Format::Human => {
            let color = std::io::stderr().is_terminal();
            eprint!("{}", diags.render(sources, color));
        }
        Format::Json => out(&serde_json::to_string_pretty(&diags.to_json(sources)).unwrap_or_default()),
    }
    ExitCode::from(1)
}

fn out(s: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{s}");
}

fn load(file: &Option<PathBuf>) -> (Result<Checked, Failed>, bool) {
    match file {
        Some(f) => (dsl::check_paths(std::slice::from_ref(f), &FsLoader), false),
        None => {
            let loader = embedded::loader();
            (dsl::check_paths(&[PathBuf::from(embedded::DEFAULT_SPEC)], &loader as &dyn Loader), true)
        }
    }
}

/// Picks the deployment: the named one, or the only one.
fn pick(checked: &Checked, name: Option<&str>) -> Result<dsl::spec::DeployId, Diagnostics> {
    let names: Vec<&str> = checked.spec.deploys.iter().map(|d| d.name.as_str()).collect();
    let d = match name {
        Some(n) => checked.spec.find_deploy(n).ok_or_else(|| {
            Diagnostic::new(Code::NoDeployment, format!("no deployment named `{n}`")).help(format!(
                "deployments in this spec: {}",
                if names.is_empty() { "none".into() } else { names.join(", ") }
            ))
        }),
        None if names.len() == 1 => Ok(dsl::spec::DeployId(0)),
        None if names.is_empty() => Err(Diagnostic::new(Code::NoDeployment, "the spec has no `deploy` block")
            .help("add `deploy NAME { model = … cluster = … tiles = … }` or `use` a file with one")),
        None => Err(Diagnostic::new(Code::NoDeployment, format!("the spec has {} deployments", names.len()))
            .help(format!("choose one with --deploy: {}", names.join(", ")))),
    };
    d.map_err(|x| Diagnostics(vec![x]))
}

fn run(cmd: Command) -> Result<(), ExitCode> {
    match cmd {
        Command::InitWeights { spec, deploy, seed, output, family } => {
            let checked = load(&Some(spec)).0.map_err(|f| fail(&f.sources, &f.diagnostics, Format::Human))?;
            let model = match deploy {
                Some(d) => {
                    let id = pick(&checked, Some(&d)).map_err(|x| fail(&checked.sources, &x, Format::Human))?;
                    checked.spec.model(checked.spec.deploy(id).model).clone()
                }
                None if checked.spec.models.len() == 1 => checked.spec.models[0].clone(),
                None => match pick(&checked, None) {
                    Ok(id) => checked.spec.model(checked.spec.deploy(id).model).clone(),
                    Err(x) => return Err(fail(&checked.sources, &x, Format::Human)),
                },
            };
            let family = twin::weights::Family::parse(&family).ok_or_else(|| {
                eprintln!("error: unknown --family `{family}`\n  help: use `qwen3-moe` or `mixtral`");
                ExitCode::from(2)
            })?;
            let tm = twin::TwinModel::from_spec(&model).map_err(|e| {
                eprintln!("error: {e}");
                ExitCode::from(1)
            })?;
            twin::weights::write_random(&tm, seed, family, &output).map_err(|e| {
                eprintln!("error: {e}");
                ExitCode::from(1)
            })?;
            let params: usize = tm.tensor_shapes().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
            out(&format!(
                "wrote {} ({} parameters, seed {seed}) to {}",
                model.name,
                params,
                output.join("model.safetensors").display()
            ));
            Ok(())
        }
        Command::Run { bundle, backend, weights, prompt, prompts, max_new, arrive_every, start, switch_at } => {
            run_twin(RunArgs { bundle, backend, weights, prompt, prompts, max_new, arrive_every, start, switch_at })
        }
        Command::Check { files, format } => match dsl::check_paths(&files, &FsLoader) {
            Ok(c) => {
                let s = &c.spec;
                match format {
                    Format::Human => eprintln!(
                        "ok: {} model(s), {} cluster(s), {} tile set(s), {} deployment(s)",
                        s.models.len(),
                        s.clusters.len(),
                        s.tiles.len(),
                        s.deploys.len()
                    ),
                    Format::Json => out("[]"),
                }
                Ok(())
            }
            Err(f) => Err(fail(&f.sources, &f.diagnostics, format)),
        },
        Command::Explain { file, deploy, format } => {
            let checked = load(&file).0.map_err(|f| fail(&f.sources, &f.diagnostics, format))?;
            let id = pick(&checked, deploy.as_deref()).map_err(|d| fail(&checked.sources, &d, format))?;
            let plan = codegen::plan_deployment(&checked, id).map_err(|d| fail(&checked.sources, &d, format))?;
            match format {
                Format::Human => {
                    out(&format!("// checked spec of deployment `{}`\n", plan.plan().deploy));
                    out(&checked.spec.deployment(id).to_string());
                    out(&format!("// plan\n{}", plan.plan()));
                }
                Format::Json => out(&serde_json::to_string_pretty(&serde_json::json!({
                    "spec": checked.spec.deployment(id),
                    "plan": plan.plan(),
                }))
                .unwrap_or_default()),
            }
            Ok(())
        }
        Command::Simulate { file, output, deploy, systems, seconds, seed, rates, rollout, profile } => {
            let (checked, embedded) = load(&file);
            let checked = checked.map_err(|f| fail(&f.sources, &f.diagnostics, Format::Human))?;
            let id = pick(&checked, deploy.as_deref()).map_err(|d| fail(&checked.sources, &d, Format::Human))?;
            let systems = simulate::systems(&systems).map_err(|e| error(e, "see `moeforge simulate --help`"))?;
            let valid = seconds.is_finite()
                && seconds > 0.0
                && seconds <= 86_400.0
                && (1..=1000).contains(&rates)
                && rollout.is_none_or(|n| (1..=1_000_000).contains(&n));
            if !valid {
                return Err(error(
                    "--seconds must be in (0, 86400], --rates in 1..=1000, --rollout in 1..=1000000",
                    "e.g. --seconds 60 --rates 12 --rollout 2048",
                ));
            }
            let opts = codegen::PlanOptions { profile: read_profile(&profile)?, ..Default::default() };
            let plan = codegen::plan_deployment_with(&checked, id, &opts)
                .map_err(|d| fail(&checked.sources, &d, Format::Human))?;
            if embedded {
                eprintln!("note: no spec given; simulating the embedded default {}", embedded::DEFAULT_SPEC);
            }
            let spec = checked.spec.deployment(id);
            let mut bench = moeforge::runtime::sim::Bench::new(&spec, plan.plan())
                .map_err(|e| error(e, "refit the profile with more samples over the serving range"))?;
            if bench.search.is_none() {
                // The strategy did not ask for the layout search; ExpertPlex still needs its layout.
                let d = spec.deploy(moeforge::dsl::spec::DeployId(0));
                bench = bench.with_search(codegen::passes::search::search(&spec, d, &plan.plan().cost));
            }
            let args = simulate::Args { seconds, seed, rates, rollout };
            let (text, files) = simulate::run(&bench, &systems, &args);
            plan::bundle::write_dir(&output, files.iter().map(|(n, b)| (*n, b.as_bytes()))).map_err(|e| {
                eprintln!("error: cannot write {}: {e}", output.display());
                ExitCode::from(1)
            })?;
            out(&text);
            out(&format!("wrote goodput.csv, attainment.csv, attainment.svg to {}", output.display()));
            Ok(())
        }
        Command::Compile { file, output, deploy, nvcc, profile, loads, format } => {
            let (checked, embedded) = load(&file);
            let checked = checked.map_err(|f| fail(&f.sources, &f.diagnostics, format))?;
            let id = pick(&checked, deploy.as_deref()).map_err(|d| fail(&checked.sources, &d, format))?;
            let mut opts = codegen::PlanOptions { profile: read_profile(&profile)?, ..Default::default() };
            if let Some(p) = &loads {
                let text = std::fs::read_to_string(p).map_err(|e| error(format!("{}: {e}", p.display()), ""))?;
                let parsed = codegen::placement::load_sglang(&text).map_err(|e| {
                    error(
                        format!("{}: {e}", p.display()),
                        "expected {\"logical_count\": [[count per expert] per MoE layer]}",
                    )
                })?;
                opts.loads = Some((parsed, plan::bundle::sha256_hex(text.as_bytes())));
            }
            let plan =
                codegen::plan_deployment_with(&checked, id, &opts).map_err(|d| fail(&checked.sources, &d, format))?;
            let mode = match nvcc.as_str() {
                "auto" => NvccMode::Auto,
                "off" => NvccMode::Off,
                p => NvccMode::Path(PathBuf::from(p)),
            };
            let (bundle, summary) = codegen::emit(&checked, id, &plan, &mode).map_err(|e| {
                eprintln!("error: {e}");
                ExitCode::from(1)
            })?;
            bundle.write(&output).map_err(|e| {
                eprintln!("error: cannot write bundle to {}: {e}", output.display());
                ExitCode::from(1)
            })?;
            let p = plan.plan();
            match format {
                Format::Human => {
                    if embedded {
                        eprintln!("note: no spec given; compiling the embedded default {}", embedded::DEFAULT_SPEC);
                    }
                    out(&summary_text(p, &output, &bundle, &summary));
                }
                Format::Json => out(&serde_json::to_string_pretty(&serde_json::json!({
                    "bundle": output,
                    "deploy": p.deploy,
                    "spec_hash": p.spec_hash,
                    "files": bundle.files.keys().collect::<Vec<_>>(),
                    "compiled_with": summary.compiled_with,
                }))
                .unwrap_or_default()),
            }
            Ok(())
        }
    }
}

fn summary_text(
    p: &codegen::Plan,
    dir: &std::path::Path,
    bundle: &codegen::Bundle,
    s: &codegen::EmitSummary,
) -> String {
    let mut t = format!("compiled `{}` → {}\n{}", p.deploy, dir.display(), p.summary());
    let kernels: Vec<&str> = p.kernels.iter().map(|k| k.name.as_str()).collect();
    t.push_str(&format!("  kernels  {} for {}", kernels.join(", "), p.cluster.arch.name()));
    match (&s.compiled_with, &s.skipped_reason) {
        (Some(v), _) => t.push_str(&format!(", compiled to cubin ({v})\n")),
        (None, Some(why)) => t.push_str(&format!(", not compiled: {why}\n")),
        _ => t.push('\n'),
    }
    t.push_str(&format!("  files    {}\n", bundle.files.keys().cloned().collect::<Vec<_>>().join(" ")));
    t.push_str(&format!("  spec     sha256 {}", p.spec_hash));
    t
}

struct RunArgs {
    bundle: PathBuf,
    backend: String,
    weights: PathBuf,
    prompt: Vec<String>,
    prompts: Option<PathBuf>,
    max_new: usize,
    arrive_every: usize,
    start: String,
    switch_at: Vec<usize>,
}

/// Reads a measured latency profile (`--profile`) and its digest.
fn read_profile(path: &Option<PathBuf>) -> Result<Option<(plan::cost::Profile, String)>, ExitCode> {
    let Some(p) = path else { return Ok(None) };
    let bytes = std::fs::read(p).map_err(|e| error(format!("{}: {e}", p.display()), ""))?;
    let parsed: plan::cost::Profile = serde_json::from_slice(&bytes).map_err(|e| {
        error(
            format!("{}: not a latency profile: {e}", p.display()),
            "a profile is {\"samples\": [{\"component\": \"moe\", \"x\": 12, \"s\": 1, \"t\": 3.1e-5}, …]}",
        )
    })?;
    Ok(Some((parsed, plan::bundle::sha256_hex(&bytes))))
}

fn error(msg: impl std::fmt::Display, help: &str) -> ExitCode {
    eprintln!("error: {msg}");
    if !help.is_empty() {
        eprintln!("  help: {help}");
    }
    ExitCode::from(1)
}

/// Parses `"1 2 3"` / `"1,2,3"`; `where_` names the source in errors.
fn parse_prompt(text: &str, where_: &str) -> Result<Vec<u32>, ExitCode> {
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>().map_err(|_| {
                error(
                    format!("{where_}: `{t}` is not a token id"),
                    "prompts are token ids separated by spaces or commas",
                )
            })
        })
        .collect()
}

fn run_twin(a: RunArgs) -> Result<(), ExitCode> {
    use moeforge::plan::memory::Mode;
    if a.backend != "cpu" {
        return Err(error(
            format!("backend `{}` is not available in this build", a.backend),
            "use `--backend cpu` (the CPU twin)",
        ));
    }
    let start = match a.start.as_str() {
        "ep" => Mode::Ep,
        "tp" => Mode::Tp,
        other => return Err(error(format!("unknown --start `{other}`"), "use `ep` or `tp`")),
    };
    let bundle = moeforge::runtime::load_bundle(&a.bundle)
        .map_err(|e| error(e, "compile the spec again with `moeforge compile`"))?;
    let ck = twin::weights::Checkpoint::load(&a.weights)
        .map_err(|e| error(e, "write weights with `moeforge init-weights SPEC -o DIR`"))?;
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    for (i, p) in a.prompt.iter().enumerate() {
        prompts.push(parse_prompt(p, &format!("--prompt #{}", i + 1))?);
    }
    if let Some(f) = &a.prompts {
        let text = std::fs::read_to_string(f).map_err(|e| error(format!("{}: {e}", f.display()), ""))?;
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if !line.is_empty() {
                prompts.push(parse_prompt(line, &format!("{}:{}", f.display(), n + 1))?);
            }
        }
    }
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(error("no prompts (or an empty one)", "give --prompt \"1 2 3\" or --prompts FILE"));
    }
    let mut t = twin::Twin::new(&bundle, &ck, start).map_err(|e| error(e, ""))?;
    let mut calibration = None;
    if !a.switch_at.is_empty() {
        t.set_policy(None);
    } else if let Some(p) = t.policy().cloned() {
        if p.calibrate {
            let batches: Vec<usize> = [1usize, 2, 4, 8, 16, 32].into_iter().collect();
            let costs = twin::calibrate(&bundle, &ck, &batches, 3).map_err(|e| error(e, ""))?;
            let t_high = twin::coordinator::crossover(&costs);
            let spec_low = bundle.spec.deploys.first().and_then(|d| d.switch.t_low);
            t.set_policy(Some(p.with_t_high(t_high, spec_low)));
            calibration = Some(costs);
        }
    }
    let n = prompts.len();
    let mut arrivals: Vec<(usize, twin::Request)> = prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| (i * a.arrive_every, twin::Request::new(i as u64, p, a.max_new)))
        .collect();
    arrivals.reverse();
    let t0 = std::time::Instant::now();
    for step in 0..100_000 {
        while arrivals.last().is_some_and(|(at, _)| *at <= step) {
            if let Some((_, r)) = arrivals.pop() {
                t.submit(r).map_err(|e| error(e, ""))?;
            }
        }
        if arrivals.is_empty() && t.idle() {
            break;
        }
        if a.switch_at.contains(&step) {
            let target = if t.mode() == Mode::Ep { Mode::Tp } else { Mode::Ep };
            t.switch_to(target).map_err(|e| error(e, ""))?;
        }
        t.step().map_err(|e| error(e, ""))?;
    }
    let total = t0.elapsed().as_secs_f64();
    let plan = t.plan();
    out(&format!(
        "cpu twin: {} on {} ranks, modes [{}], started in {}",
        bundle.plan.model.name,
        plan.group,
        plan.modes.iter().map(|m| m.name()).collect::<Vec<_>>().join(", "),
        start.name()
    ));
    if let Some(costs) = &calibration {
        let rows: Vec<String> =
            costs.iter().map(|(b, tp, ep)| format!("B={b}: tp {:.2} ms, ep {:.2} ms", tp * 1e3, ep * 1e3)).collect();
        out(&format!("calibration: {}", rows.join("; ")));
    }
    if let Some(p) = t.policy() {
        let th = if p.t_high == u32::MAX {
            "never (EP was not faster at any probed batch)".to_string()
        } else {
            p.t_high.to_string()
        };
        out(&format!("policy: T_h = {th}, T_l = {}, W = {}, C = {}s", p.t_low, p.window, p.cooldown));
    }
    for id in 0..n as u64 {
        if let Some(r) = t.request(id) {
            let toks: Vec<String> = r.generated.iter().map(u32::to_string).collect();
            out(&format!("request {id}: {}", toks.join(" ")));
        }
    }
    for e in &t.events {
        match &e.cancelled {
            None => out(&format!(
                "switch before step {}: {} → {} with {} in flight, {} weight bytes and {} KV bytes moved in {:.2} ms",
                e.step,
                e.from.name(),
                e.to.name(),
                e.inflight,
                e.weight_bytes_moved,
                e.kv_bytes_moved,
                e.seconds * 1e3
            )),
            Some(why) => out(&format!("switch before step {} to {} cancelled: {why}", e.step, e.to.name())),
        }
    }
    out("step  mode  running  tokens  ms");
    for s in &t.steps {
        out(&format!("{:>4}  {:<4}  {:>7}  {:>6}  {:.2}", s.step, s.mode.name(), s.running, s.tokens, s.seconds * 1e3));
    }
    out(&format!("{} requests, {} steps, {:.3} s", n, t.steps.len(), total));
    Ok(())
}
