//! `moeforge run BUNDLE --weights DIR`: serves prompts on a backend through
//! the engine interface and the switch-policy driver; prints each request's
//! tokens, the switch events and the per-step timings.

use super::{error, out};
use clap::ValueEnum;
use moeforge::plan::bundle::LoadedBundle;
use moeforge::plan::memory::Mode;
use moeforge::runtime::engine::{Engine, EngineError, Request, StepOutput};
use moeforge::runtime::policy::{self, Calibrated, Driver, Policy};
use moeforge::runtime::twin::moe::SwapPolicy;
use moeforge::runtime::twin::weights::Checkpoint;
use moeforge::runtime::{machine, twin};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The execution backend.
/// Steps `run` takes at most.
const MAX_STEPS: usize = 100_000;

#[derive(Clone, Copy, ValueEnum)]
pub enum Backend {
    /// The CPU twin: simulated ranks on the host, real numerics.
    Cpu,
    /// The emulated device: every step runs the bundle's program and its own
    /// emitted kernels (built for the host with g++, CTAs as threads) at the
    /// plan's addresses; the twin schedules.
    Emu,
    /// An NVIDIA GPU: the same program as `emu`, the kernels built with nvcc
    /// for the GPU and launched through the CUDA driver, one process driving
    /// the node's GPUs (`MOEFORGE_CUDA_DEVICES`) with peer access.
    Cuda,
}

impl Backend {
    /// How the output names the backend.
    pub fn describe(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu twin",
            Backend::Emu => "emulated device",
            Backend::Cuda => "cuda device",
        }
    }
}

/// The parallelism mode the engine starts in.
#[derive(Clone, Copy, ValueEnum)]
pub enum Start {
    Tp,
    Ep,
}

#[derive(clap::Args)]
pub struct Args {
    /// A bundle directory written by `moeforge compile`.
    bundle: PathBuf,
    #[command(flatten)]
    opts: Options,
}

/// Everything but the bundle (a deployable binary carries its own).
#[derive(clap::Args)]
pub struct Options {
    /// Execution backend.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: Backend,
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
    /// Starting mode (when the plan holds it).
    #[arg(long, value_enum, default_value = "ep")]
    start: Start,
    /// Force a switch before these steps (comma-separated), instead of the policy.
    #[arg(long, value_delimiter = ',')]
    switch_at: Vec<usize>,
    /// Check every device routing of the replicated placement
    /// (`kernels/zepp_route.cu`) against the host routing of the same counts
    /// (a verification mode: each dispatch also routes on the host).
    #[arg(long)]
    verify_routing: bool,
    #[command(flatten)]
    swap: SwapArgs,
    #[command(flatten)]
    graphs: GraphArgs,
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

fn prompts(a: &Options) -> Result<Vec<Vec<u32>>, ExitCode> {
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
    Ok(prompts)
}

/// Loads and validates a bundle directory.
pub fn load_dir(bundle: &Path) -> Result<LoadedBundle, ExitCode> {
    moeforge::runtime::load_bundle(bundle).map_err(|e| error(e, "compile the spec again with `moeforge compile`"))
}

/// The GPUs `--backend cuda` drives for `bundle`: those
/// `MOEFORGE_CUDA_DEVICES` names (comma-separated ordinals, in that order),
/// else every GPU the driver sees; at most one per rank. Checked before the
/// checkpoint is read: no driver or no GPU, GPUs of another or of mixed
/// architectures, without a peer path between them, or too small for the
/// rank buffers they would hold fail at once.
fn cuda_gpus(bundle: &LoadedBundle) -> Result<Vec<moeforge_cuda::Gpu>, ExitCode> {
    // Set at all (empty or not Unicode too): the old name is refused, not ignored.
    if let Some(v) = std::env::var_os("MOEFORGE_CUDA_DEVICE").map(|v| v.to_string_lossy().into_owned()) {
        return Err(error(
            format!("MOEFORGE_CUDA_DEVICE = `{v}` is no longer read: the cuda backend drives several GPUs"),
            "set MOEFORGE_CUDA_DEVICES instead (comma-separated indices, e.g. 0 or 0,1,2,3) and unset MOEFORGE_CUDA_DEVICE",
        ));
    }
    let chosen = match std::env::var_os("MOEFORGE_CUDA_DEVICES").map(|v| v.to_string_lossy().into_owned()) {
        None => None,
        Some(v) => {
            Some(v.split(',').map(|x| x.trim().parse::<usize>()).collect::<Result<Vec<_>, _>>().map_err(|_| {
                error(
                    format!("MOEFORGE_CUDA_DEVICES = `{v}` is not a list of GPU indices"),
                    "give comma-separated indices such as 0,1,2,3, or unset it to use every GPU",
                )
            })?)
        }
    };
    let visible = moeforge_cuda::probe().map_err(|e| {
        error(format!("--backend cuda: {e}"), "run it on a machine with an NVIDIA GPU, or use --backend emu")
    })?;
    let mem = &bundle.plan.memory;
    let ranks = mem.group as usize;
    let gpus = moeforge_cuda::select(&visible, chosen.as_deref(), ranks).map_err(|e| {
        error(format!("--backend cuda: MOEFORGE_CUDA_DEVICES: {e}"), "name GPUs the driver sees, each once")
    })?;
    // sm_90a code (wgmma, TMA, clusters) runs on compute capability 9.0 only.
    if bundle.plan.cluster.arch == moeforge::dsl::spec::Arch::Sm90a {
        if let Some(gpu) = gpus.iter().find(|g| g.capability != (9, 0)) {
            return Err(error(
                format!(
                    "--backend cuda: the bundle is compiled for sm_90a (Hopper) but GPU {} ({}) is compute \
                     capability {}.{}",
                    gpu.ordinal, gpu.name, gpu.capability.0, gpu.capability.1
                ),
                "compile the spec for a cluster of this GPU's architecture, or leave that GPU out of MOEFORGE_CUDA_DEVICES",
            ));
        }
    }
    moeforge_cuda::check_together(&gpus).map_err(|e| {
        error(
            format!("--backend cuda: {e}"),
            "set MOEFORGE_CUDA_DEVICES to GPUs of one architecture that reach each other (NVLink or PCIe P2P), or to one GPU",
        )
    })?;
    moeforge_cuda::check_fit(ranks, mem.buffer_bytes, &gpus).map_err(|e| {
        error(
            format!("--backend cuda: {e}"),
            "give the run a GPU per rank (MOEFORGE_CUDA_DEVICES), or compile a smaller plan (`hbm` or \
             `memory_fraction` in the spec)",
        )
    })?;
    Ok(gpus)
}

/// Checks that the backend can run `bundle` on this machine, then loads the
/// checkpoint.
pub fn prepare(bundle: &LoadedBundle, weights: &Path, backend: Backend) -> Result<Checkpoint, ExitCode> {
    match backend {
        // These hold every rank's unified buffer in this host's memory.
        Backend::Cpu | Backend::Emu => machine::check_cpu(&bundle.plan, &machine::Host::probe()).map_err(|e| {
            error(
                format!("this machine does not fit the bundle: {e}"),
                "run it on the cluster it was compiled for (the cpu backend runs small specs such as models/clusters.moe's `cpu4`)",
            )
        })?,
        // Before the checkpoint is read: no driver or no GPU, GPUs of another
        // or of mixed architectures, without a peer path, or too small for the
        // rank buffers they would hold fail at once.
        Backend::Cuda => {
            cuda_gpus(bundle)?;
        }
    }
    // Mapped, not read: the tensors kept as stored stay ranges of the files
    // (the backends cut their views' slices from them).
    let ck = Checkpoint::load_with(weights, &moeforge_cuda::map_file)
        .map_err(|e| error(e, "write weights with `moeforge init-weights SPEC -o DIR`"))?;
    if let Some(first) = ck.rounded.first() {
        eprintln!(
            "note: {} f32 tensor(s) rounded to bf16 for the twin's bf16 views, starting with `{first}`",
            ck.rounded.len()
        );
    }
    Ok(ck)
}

/// The twin on `backend` under the switch-policy driver, starting in
/// `start`, its decode graphs as `graphs` says (the options, and the
/// buckets recorded before serving without `--capture-graphs`); with `policy`, the spec's switch policy decides,
/// `t_high = auto` set at the TP/EP crossover of this engine's own decode
/// steps (graph replays where it records graphs; the emulated device's
/// crossover is its own), or at the cost model's where it has no device
/// steps (the CPU twin).
pub fn driver(
    bundle: &LoadedBundle,
    ck: &Checkpoint,
    backend: Backend,
    start: Mode,
    policy: bool,
    graphs: (&GraphArgs, u32),
    configure: impl FnOnce(&mut twin::Twin),
) -> Result<(Driver<twin::Twin>, Startup), ExitCode> {
    let deploy = bundle.spec.deploys.first();
    let switch = deploy.map(|d| &d.switch);
    let mut engine = match backend {
        Backend::Cpu => twin::Twin::new(bundle, ck, start).map_err(EngineError::from),
        Backend::Emu => {
            moeforge::runtime::device::emu::EmuDevice::start(&moeforge::runtime::device::emu::default_cache())
                .and_then(|mut dev| {
                    // MOEFORGE_EMU_LAZY_SIDE=1: side transfers (Zepp's swaps) run
                    // only when a wait asks for them, so a step that did not wait
                    // for one computes with the bytes it has not moved (a check of
                    // the waits).
                    if std::env::var("MOEFORGE_EMU_LAZY_SIDE").is_ok_and(|v| v == "1") {
                        dev.lazy_side()?;
                    }
                    Ok(dev)
                })
                .map_err(|e| EngineError::Backend(format!("the emulated device: {e}")))
                .and_then(|dev| twin::Twin::on_device(bundle, ck, start, Box::new(dev)).map_err(Into::into))
        }
        Backend::Cuda => {
            let ordinals: Vec<usize> = cuda_gpus(bundle)?.iter().map(|g| g.ordinal).collect();
            moeforge_cuda::CudaDevice::open(&ordinals, &moeforge_cuda::default_cache())
                .map_err(|e| EngineError::Backend(format!("the cuda device: {e}")))
                .and_then(|dev| twin::Twin::on_device(bundle, ck, start, Box::new(dev)).map_err(Into::into))
        }
    }
    .map_err(|e| error(e, ""))?;
    // What serving runs with is set before graphs are recorded or timed.
    configure(&mut engine);
    let reshards = engine.device_reshards();
    let recorded = graphs.0.apply(&mut engine, graphs.1)?;
    let warmup_switch = engine.device_reshards() != reshards;
    let context = deploy.map_or(0, |d| policy::calibration_context(&d.workload));
    let modeled = |context| moeforge::runtime::sim::Bench::new(&bundle.spec, &bundle.plan)?.decode_costs(context);
    let (driver, calibration) = policy::driver(switch, &bundle.plan.memory.modes, policy, engine, context, modeled)
        .map_err(|e| error(e, ""))?;
    Ok((driver, Startup { warmup_switch, recorded, calibration }))
}

/// What ran before serving (the decode graphs recorded, the calibration)
/// and the policy in force, a line each.
pub fn startup_lines(startup: &Startup, driver: &Driver<twin::Twin>) -> Vec<String> {
    let mut lines = Vec::new();
    if let Some(kept) = &startup.recorded {
        lines.push(recorded_line(kept, startup.warmup_switch));
    }
    policy_lines(&startup.calibration, driver.policy(), driver.engine.records_graphs(), &mut lines);
    lines
}

/// The calibration and the policy in force; `graphs`: whether the engine's
/// decode steps (those calibration timed) are graph replays.
fn policy_lines(calibration: &Option<Calibrated>, policy: Option<&Policy>, graphs: bool, lines: &mut Vec<String>) {
    let mut out = |s: &str| lines.push(s.to_string());
    let rows = |costs: &policy::Calibration| {
        let rows: Vec<String> =
            costs.iter().map(|(b, tp, ep)| format!("B={b}: tp {:.2} ms, ep {:.2} ms", tp * 1e3, ep * 1e3)).collect();
        rows.join("; ")
    };
    match calibration {
        Some(Calibrated::Measured(m)) => out(&format!(
            "calibration, measured on this engine's decode steps of requests with {} cached tokens each ({}, the \
             median of {} each, until EP is no slower): {}{}",
            m.context,
            if graphs { "graph replays where a graph holds the step" } else { "call by call" },
            policy::CALIBRATION_STEPS,
            rows(&m.costs),
            m.unfit.map_or_else(String::new, |(b, mode)| format!(
                "{}B={b} does not fit one {} step (its requests' KV at that context, or the step's inputs)",
                if m.costs.is_empty() { "" } else { "; " },
                mode.name()
            ))
        )),
        Some(Calibrated::Modeled { costs, context }) => out(&format!(
            "calibration, modeled (this engine measured no decode step; the cost model's decode iterations of \
             requests with {context} cached tokens each): {}",
            rows(costs)
        )),
        Some(Calibrated::Default(why)) => out(&format!(
            "calibration: none ({why}); T_h is {}, Moebius's measured crossover on 8×H200",
            policy::DEFAULT_T_HIGH
        )),
        None => {}
    }
    if let Some(p) = policy {
        let th = if p.t_high == u32::MAX {
            "never (EP was not faster at any calibrated batch)".to_string()
        } else {
            p.t_high.to_string()
        };
        out(&format!("policy: T_h = {th}, T_l = {}, W = {}, C = {}s", p.t_low, p.window, p.cooldown));
    }
}

pub fn run(a: Args) -> Result<(), ExitCode> {
    let bundle = load_dir(&a.bundle)?;
    run_bundle(&a.opts, &bundle)
}

/// When a replicated placement's slots are swapped (`run` and `serve`).
#[derive(clap::Args)]
pub struct SwapArgs {
    /// Zepp's drift window for a replicated placement: every this many
    /// steps, each MoE layer's routed loads since the last window decide
    /// whether intra-node slot swaps run (default 64).
    #[arg(long)]
    swap_window: Option<usize>,
    /// Swap when a layer's busiest GPU would carry more than this × the
    /// mean load (at least 1; default 1 + 2 × the placement's slack).
    #[arg(long)]
    swap_threshold: Option<f64>,
}

/// How decode steps run as graphs (`run` and `serve`).
#[derive(clap::Args)]
pub struct GraphArgs {
    /// Run every decode step call by call: no decode graphs (a device that
    /// records them otherwise pads each decode step to its batch bucket
    /// and replays that bucket's graph).
    #[arg(long)]
    eager: bool,
    /// Record both modes' decode graphs for the batch buckets that hold up
    /// to N requests a rank before serving (a weight-only warm-up switch
    /// enters the other mode and comes back, Moebius §4.4), so that no
    /// serving step, after a switch either, records one; 0: each bucket's
    /// on its first use. Default where the device records graphs (one GPU,
    /// the emulated device): `run`, as many as it has requests (all may be
    /// in flight at once), at most 256; `serve`, 256 on a GPU (Moebius
    /// §6.5's per-rank cap) and 8 on the emulated device (whose steps of 256
    /// rows take seconds: both modes' buckets to 256 would take minutes).
    #[arg(long)]
    capture_graphs: Option<u32>,
}

impl GraphArgs {
    /// Refuses `--capture-graphs N` where nothing records graphs: the CPU
    /// twin, or beside `--eager`.
    pub fn check(&self, backend: Backend) -> Result<(), ExitCode> {
        let asked = self.capture_graphs.is_some_and(|n| n > 0);
        if asked && matches!(backend, Backend::Cpu) {
            return Err(error(
                "--capture-graphs: the cpu twin records no graphs",
                "run with --backend emu or cuda, or drop --capture-graphs",
            ));
        }
        if asked && self.eager {
            return Err(error("--capture-graphs records graphs and --eager runs without them", "give one of the two"));
        }
        Ok(())
    }

    /// Turns the engine's graphs on or off and records those
    /// `--capture-graphs N` asks for (`default` without it, where the
    /// engine records graphs). Returns the (mode, bucket) graphs kept,
    /// `None` where none were asked for.
    pub fn apply(&self, engine: &mut twin::Twin, default: u32) -> Result<Option<Vec<(Mode, u32)>>, ExitCode> {
        engine.use_device_graphs(!self.eager);
        let n = self.capture_graphs.unwrap_or(if engine.records_graphs() { default } else { 0 });
        if n == 0 {
            return Ok(None);
        }
        let kept = engine
            .capture_graphs(n)
            .map_err(|e| error(e, "give --capture-graphs 0 to record each graph on its first use"))?;
        Ok(Some(kept))
    }
}

/// What `run` and `serve` did before serving: the decode graphs recorded
/// ([`GraphArgs::apply`]), whether that took a weight-only warm-up switch
/// into the other mode, and the calibration of `t_high = auto`.
pub struct Startup {
    pub warmup_switch: bool,
    pub recorded: Option<Vec<(Mode, u32)>>,
    pub calibration: Option<Calibrated>,
}

/// Says which decode graphs were recorded before serving, and whether a
/// warm-up switch entered the other mode to record its own.
fn recorded_line(kept: &[(Mode, u32)], warmup_switch: bool) -> String {
    let per_mode: Vec<String> = [Mode::Ep, Mode::Tp]
        .iter()
        .filter_map(|&m| {
            let sizes: Vec<String> = kept.iter().filter(|k| k.0 == m).map(|k| k.1.to_string()).collect();
            (!sizes.is_empty()).then(|| format!("{} buckets {}", m.name(), sizes.join(", ")))
        })
        .collect();
    format!(
        "decode graphs recorded before serving: {} (each from a warm-up and a recorded step of padding requests \
         only{})",
        if per_mode.is_empty() {
            "none (no decode step of this plan runs as a graph here: its dispatch is routed, or no bucket fits \
             one step's inputs or one post round)"
                .to_string()
        } else {
            per_mode.join("; ")
        },
        if warmup_switch { "; the other mode entered by a weight-only warm-up switch and left" } else { "" }
    )
}

/// The drift window and threshold the options ask for (`None`: the plan's
/// defaults); an error for a plan without replicas or a value the policy
/// cannot take.
pub fn swap_policy(a: &SwapArgs, bundle: &LoadedBundle) -> Result<Option<SwapPolicy>, ExitCode> {
    if a.swap_window.is_none() && a.swap_threshold.is_none() {
        return Ok(None);
    }
    let Some(placement) = bundle.plan.placement.as_ref() else {
        return Err(error(
            "--swap-window / --swap-threshold: the plan has no replicated placement, so there are no slots to swap",
            "compile a deployment with `placement { policy = zepp }` (or `eplb`)",
        ));
    };
    let default = SwapPolicy::default_for(placement.slack);
    if a.swap_window == Some(0) {
        return Err(error("--swap-window 0: a drift window is at least one step", "give 1 or more steps"));
    }
    if let Some(t) = a.swap_threshold.filter(|t| !(t.is_finite() && *t >= 1.0)) {
        return Err(error(
            format!("--swap-threshold {t}: the busiest GPU's load over the mean is at least 1"),
            &format!(
                "give a ratio of 1 or more (1: swap on any imbalance; the plan's default is {})",
                default.threshold
            ),
        ));
    }
    Ok(Some(SwapPolicy {
        window: a.swap_window.unwrap_or(default.window),
        threshold: a.swap_threshold.unwrap_or(default.threshold),
    }))
}

/// `run` on a loaded bundle.
pub fn run_bundle(a: &Options, bundle: &LoadedBundle) -> Result<(), ExitCode> {
    let start = match a.start {
        Start::Tp => Mode::Tp,
        Start::Ep => Mode::Ep,
    };
    let prompts = prompts(a)?;
    if a.verify_routing && matches!(a.backend, Backend::Cpu) {
        return Err(error(
            "--verify-routing checks the devices' replica routing, and the cpu twin routes on the host",
            "run with --backend emu (or cuda)",
        ));
    }
    if a.verify_routing && bundle.plan.placement.is_none() {
        return Err(error(
            "--verify-routing: the plan has no replicated placement, so no dispatch routes to replicas",
            "compile a deployment with `placement { policy = zepp }` (or `eplb`)",
        ));
    }
    let swap = swap_policy(&a.swap, bundle)?;
    // The last request must arrive within the run's steps.
    let last = prompts.len().saturating_sub(1).checked_mul(a.arrive_every).filter(|&at| at < MAX_STEPS);
    if last.is_none() {
        return Err(error(
            format!(
                "--arrive-every {}: request {} would arrive after the run's {MAX_STEPS} steps",
                a.arrive_every,
                prompts.len().saturating_sub(1)
            ),
            &format!(
                "give at most {} (the steps between arrivals)",
                (MAX_STEPS - 1) / prompts.len().saturating_sub(1).max(1)
            ),
        ));
    }
    a.graphs.check(a.backend)?;
    let ck = prepare(bundle, &a.weights, a.backend)?;
    let (mut driver, startup) = driver(
        bundle,
        &ck,
        a.backend,
        start,
        a.switch_at.is_empty(),
        (&a.graphs, prompts.len().min(256) as u32),
        |engine| {
            engine.verify_device_routing(a.verify_routing);
            if let Some(policy) = swap {
                engine.set_swap_policy(policy);
            }
        },
    )?;
    let n = prompts.len();
    let mut arrivals: Vec<(usize, Request)> = prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| (i * a.arrive_every, Request::new(i as u64, p, a.max_new)))
        .collect();
    arrivals.reverse();
    let mut tokens: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut steps: Vec<StepOutput> = Vec::new();
    let mut forced = Vec::new();
    let t0 = std::time::Instant::now();
    for step in 0..MAX_STEPS {
        while arrivals.last().is_some_and(|(at, _)| *at <= step) {
            if let Some((_, r)) = arrivals.pop() {
                driver.engine.submit(r).map_err(|e| error(e, ""))?;
            }
        }
        let stats = driver.engine.stats();
        if arrivals.is_empty() && stats.inflight() == 0 {
            break;
        }
        if a.switch_at.contains(&step) {
            let target = if stats.mode == Some(Mode::Ep) { Mode::Tp } else { Mode::Ep };
            forced.push(driver.engine.switch(target).map_err(|e| error(e, ""))?);
        }
        let s = driver.step().map_err(|e| error(e, ""))?;
        for &(id, t) in &s.produced {
            tokens.entry(id).or_default().push(t);
        }
        steps.push(s);
    }
    let total = t0.elapsed().as_secs_f64();
    let plan = &bundle.plan.memory;
    out(&format!(
        "{}: {} on {} ranks, modes [{}], started in {}",
        a.backend.describe(),
        bundle.plan.model.name,
        plan.group,
        plan.modes.iter().map(|m| m.name()).collect::<Vec<_>>().join(", "),
        start.name()
    ));
    if let Some(d) = driver.engine.device_description() {
        out(&format!("device: {d}"));
    }
    if let Some(r) = &bundle.plan.roles {
        use moeforge::plan::roles::Role;
        let of = |role: Role| r.ranks(role).iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        out(&format!(
            "roles: prefill servers [{}], decode servers [{}], MoE servers [{}]; each request prefills on a prefill server and its KV moves to a decode server",
            of(Role::Prefill),
            of(Role::Decode),
            of(Role::Moe)
        ));
    }
    for line in startup_lines(&startup, &driver) {
        out(&line);
    }
    for id in 0..n as u64 {
        let toks: Vec<String> = tokens.get(&id).into_iter().flatten().map(u32::to_string).collect();
        out(&format!("request {id}: {}", toks.join(" ")));
    }
    let mut events: Vec<_> = forced.into_iter().chain(driver.events.iter().cloned()).collect();
    events.sort_by_key(|e| e.step);
    for e in events.iter().filter(|e| e.from != e.to) {
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
    for s in &steps {
        let mode = s.mode.map_or("-", Mode::name);
        out(&format!("{:>4}  {:<4}  {:>7}  {:>6}  {:.2}", s.step, mode, s.running, s.tokens, s.seconds * 1e3));
    }
    out(&format!("{} requests, {} steps, {:.3} s", n, steps.len(), total));
    if a.verify_routing {
        out(&format!(
            "replica routing: {} routed entries routed on the device, each to the slot the host routing gives it",
            driver.engine.device_routing_checked().unwrap_or(0)
        ));
    }
    if driver.engine.swaps() > 0 {
        let o = driver.engine.swap_overlap().unwrap_or_default();
        out(&format!(
            "slot swaps: {} (Zepp's drift re-plans, exchanged in place{})",
            driver.engine.swaps(),
            if o.swaps > 0 {
                format!(
                    " on the device's side stream: {} main-stream ops issued beside them, {} finished on the device \
                     while they were queued",
                    o.ops_beside, o.device_overlapped
                )
            } else {
                String::new()
            }
        ));
    }
    if let Some(g) = driver.engine.graph_stats().filter(|g| g.captured + g.eager + g.warmups + g.refused > 0) {
        out(&format!(
            "decode graphs: {} recorded (one per mode and batch bucket{}), {} decode steps replayed one, {} ran as a \
             bucket's warm-up, {} ran call by call (not a graph's shape), {} padding rows{}",
            g.captured,
            match g.recorded_before_serving {
                0 => String::new(),
                n => format!(", {n} before serving"),
            },
            g.replayed,
            g.warmups,
            g.eager,
            g.padded_rows,
            match (g.replayed_after_switch, g.replayed_after_swap) {
                (0, 0) => String::new(),
                (switch, swap) => format!(
                    "; replays of a graph recorded before a later live switch: {switch}, before a later slot swap: \
                     {swap} ({} issued while a swap was still queued, which the graph waits for before that layer's \
                     experts)",
                    g.replayed_beside_swap
                ),
            }
        ));
        for why in driver.engine.graph_refusals() {
            out(&format!("decode graph not recorded: {why}"));
        }
    }
    if let Some(d) = driver.engine.dispatch_traffic().filter(|d| d.rounds > 0) {
        out(&format!(
            "dispatch rounds: {} beyond one per step (sources with more tokens than their posts reserve ran in rounds of whole requests)",
            d.rounds
        ));
    }
    Ok(())
}
