//! `moeforge-codegen`: from a checked spec to a bundle.
//!
//! Takes a [`moeforge_dsl::Checked`] spec and one of its deployments; gives a
//! validated [`Plan`] ([`plan_deployment`]) and the [`Bundle`] of files
//! ([`emit`]): `manifest.json`, `spec.json`, `plan.json`, `kernels/*.cu`
//! (plus cubins when nvcc is available) and `report.md`. The pipeline is
//! spelled out in [`plan_deployment`]; each pass lives in `passes/`. The
//! emitter only accepts a [`ValidPlan`].
//!
//! Consumed by the `moeforge` CLI (and a user's build.rs). The runtime never
//! links this crate: what it needs of the plan is `moeforge-plan`.

pub mod cache;
pub mod emit;
pub mod nvcc;
pub mod passes;
pub mod placement;
pub mod target;

pub use cache::KernelCache;
pub use moeforge_plan::{validate, Bundle, Manifest, Plan, ValidPlan, Violation};
pub use nvcc::NvccMode;

use moeforge_dsl::spec::DeployId;
use moeforge_dsl::Diagnostic;
use moeforge_dsl::{Checked, Code, Diagnostics};
use moeforge_plan::{cost, ClusterFacts, ModelFacts, FORMAT_VERSION};
use std::collections::BTreeMap;

/// The tool string recorded in manifests.
pub const TOOL: &str = concat!("moeforge ", env!("CARGO_PKG_VERSION"));

/// The canonical JSON of one deployment's spec; its SHA-256 is the spec hash.
pub fn canonical_spec(checked: &Checked, id: DeployId) -> Vec<u8> {
    let mut v = serde_json::to_vec_pretty(&checked.spec.deployment(id)).unwrap_or_default();
    v.push(b'\n');
    v
}

/// Runs the planning pipeline ([`passes::PIPELINE`]) for one deployment:
/// support gate → cost model (roofline, or a fitted profile) → layout
/// search (ExpertPlex Algorithm 1) → layout (colocated, or the search's
/// ExpertPlex roles) → expert placement (Zepp or EPLB) → memory plan →
/// reshard descriptors → kernel instances → programs → validation. In
/// debug builds the validator runs after every pass, and a violated
/// invariant is an internal-error diagnostic naming the pass.
pub fn plan_deployment(checked: &Checked, id: DeployId) -> Result<ValidPlan, Diagnostics> {
    plan_deployment_with(checked, id, &PlanOptions::default())
}

/// Inputs to planning besides the spec.
#[derive(Clone, Debug, Default)]
pub struct PlanOptions {
    /// A measured latency profile and its SHA-256 (it overrides the roofline).
    pub profile: Option<(cost::Profile, String)>,
    /// Measured expert loads `[moe layer][expert]` and their SHA-256.
    pub loads: Option<(Vec<Vec<f64>>, String)>,
}

/// [`plan_deployment`] with measured inputs.
pub fn plan_deployment_with(checked: &Checked, id: DeployId, opts: &PlanOptions) -> Result<ValidPlan, Diagnostics> {
    plan_with_warnings(checked, id, opts).map(|(plan, _)| plan)
}

/// [`plan_deployment_with`], and the passes' warnings: values of the spec
/// that plan but have no effect on the bundle.
pub fn plan_with_warnings(
    checked: &Checked,
    id: DeployId,
    opts: &PlanOptions,
) -> Result<(ValidPlan, Diagnostics), Diagnostics> {
    if id.index() >= checked.spec.deploys.len() {
        return Err(Diagnostics(vec![Diagnostic::new(Code::NoDeployment, format!("no deployment #{}", id.0))]));
    }
    let cx = passes::Ctx::new(checked, id, opts);
    let spec_hash = moeforge_plan::bundle::sha256_hex(&canonical_spec(checked, id));
    let mut plan = Plan::new(
        &cx.deploy.name,
        spec_hash,
        ModelFacts::of(cx.model),
        ClusterFacts::of(cx.cluster),
        cx.deploy.strategy,
    );
    for (name, pass) in passes::PIPELINE {
        pass(&cx, &mut plan).map_err(|e| cx.diagnostics(&e))?;
        if cfg!(debug_assertions) {
            let v = validate::check(&plan);
            if !v.is_empty() {
                return Err(internal(name, &v));
            }
        }
    }
    let plan = validate::validate(plan).map_err(|v| internal("validate", &v))?;
    Ok((plan, cx.warnings()))
}

/// A broken plan invariant as diagnostics: a bug, reported instead of a panic.
fn internal(pass: &str, v: &[Violation]) -> Diagnostics {
    Diagnostics(
        v.iter()
            .map(|x| {
                Diagnostic::new(Code::Internal, format!("internal error after pass `{pass}`: plan invariant {x}"))
                    .help("this is a moeforge bug; please report it with the spec")
            })
            .collect(),
    )
}

/// What emission did besides writing sources.
#[derive(Clone, Debug)]
pub struct EmitSummary {
    /// `Some(nvcc version)` when kernels were compiled.
    pub compiled_with: Option<String>,
    pub skipped_reason: Option<String>,
    /// Kernels taken from the kernel cache, and kernels nvcc compiled.
    pub cache_hits: usize,
    pub nvcc_runs: usize,
    /// The cache could not store an entry (the bundle is complete anyway).
    pub cache_warning: Option<String>,
}

/// Where a kernel build stands, for progress displays.
#[derive(Clone, Copy, Debug)]
pub enum Progress<'a> {
    /// nvcc is about to build kernel `index` of `total` (or take it from the cache).
    Start { kernel: &'a str, index: usize, total: usize },
    /// It is built; `cached`: it came from the kernel cache.
    Done { kernel: &'a str, cached: bool },
}

/// How [`emit_with`] builds kernels.
#[derive(Default)]
pub struct EmitOptions<'a> {
    pub nvcc: NvccMode,
    /// The kernel cache to read and fill; `None` runs nvcc for every kernel.
    pub cache: Option<KernelCache>,
    pub progress: Option<&'a dyn Fn(Progress<'_>)>,
}

#[derive(Debug, thiserror::Error)]
pub enum EmitError {
    #[error(transparent)]
    Template(#[from] emit::cuda::TemplateError),
    #[error(transparent)]
    Nvcc(#[from] nvcc::NvccError),
    /// The plan's transfer programs could not be compiled.
    #[error("transfer programs: {0}")]
    Transfer(String),
}

/// The plan's transfer programs (`plan::transfers::programs`: the weight
/// reshard, the EP dispatch's rows and combine's sums, the TP all-reduce),
/// each lowered once to LLVM IR:
/// `kernels/xfer_{name}.ptx` (PTX for `arch`, which the cuda device loads
/// through the driver's JIT) and `kernels/xfer_{name}.ll` (the host-flavored
/// IR the emulated device compiles with `llc`).
#[cfg(feature = "llvm")]
fn transfer_files(p: &moeforge_plan::Plan, arch: &str) -> Result<Vec<(String, Vec<u8>)>, EmitError> {
    let err = |e: moeforge_xfer::XferError| EmitError::Transfer(e.to_string());
    let mut out = vec![];
    for (name, program) in moeforge_plan::transfers::programs(p).map_err(err)? {
        let (ptx, ir) = moeforge_plan::transfers::files(name);
        out.push((ptx, moeforge_xfer::ptx(&program, arch).map_err(err)?.into_bytes()));
        out.push((ir, moeforge_xfer::host_ir(&program).map_err(err)?.into_bytes()));
    }
    Ok(out)
}

#[cfg(not(feature = "llvm"))]
fn transfer_files(p: &moeforge_plan::Plan, _: &str) -> Result<Vec<(String, Vec<u8>)>, EmitError> {
    match moeforge_plan::transfers::programs(p) {
        Ok(v) if v.is_empty() => Ok(vec![]),
        _ => Err(EmitError::Transfer(
            "this moeforge was built without LLVM (the `llvm` feature): it runs bundles but cannot compile their transfer programs".into(),
        )),
    }
}

/// Emits the bundle of a validated plan, compiling kernels with `nvcc`
/// (and no cache).
pub fn emit(
    checked: &Checked,
    id: DeployId,
    plan: &ValidPlan,
    nvcc: &NvccMode,
) -> Result<(Bundle, EmitSummary), EmitError> {
    emit_with(checked, id, plan, &EmitOptions { nvcc: nvcc.clone(), ..EmitOptions::default() })
}

/// Emits the bundle of a validated plan. The bytes do not depend on the
/// cache: a cached kernel is the cubin and figures nvcc produced for the
/// same source, flags and nvcc.
pub fn emit_with(
    checked: &Checked,
    id: DeployId,
    plan: &ValidPlan,
    opts: &EmitOptions<'_>,
) -> Result<(Bundle, EmitSummary), EmitError> {
    let nvcc = &opts.nvcc;
    let p = plan.plan();
    let mut bundle = Bundle::default();
    bundle.add("spec.json", canonical_spec(checked, id));
    let mut plan_json = serde_json::to_vec_pretty(p).unwrap_or_default();
    plan_json.push(b'\n');
    bundle.add("plan.json", plan_json);
    let arch = p.cluster.arch.name();
    let nvcc_path = nvcc.resolve();
    // The cache needs nvcc's identity; an nvcc that does not run is
    // compiled with (and reports its error) uncached.
    let identity = nvcc_path.as_deref().and_then(|n| Some((nvcc::full_version(n)?, nvcc::sass_tools(n))));
    let cache = opts.cache.as_ref().filter(|_| identity.is_some());
    let flags = target::nvcc_flags(arch);
    let (mut hits, mut runs, mut cache_warning) = (0, 0, None);
    let mut stats = BTreeMap::new();
    let mut sass = BTreeMap::new();
    let mut version = None;
    let total = p.kernels.len();
    for (index, k) in p.kernels.iter().enumerate() {
        let src = emit::cuda::render(plan, k)?;
        if let Some(path) = &nvcc_path {
            if let Some(f) = opts.progress {
                f(Progress::Start { kernel: &k.name, index, total });
            }
            let key = identity.as_ref().map(|(v, tools)| {
                cache::KeyParts {
                    name: &k.name,
                    arch,
                    flags: &flags,
                    nvcc_version: v,
                    sass_tools: *tools,
                    source: &src,
                }
                .key()
            });
            let hit = cache.zip(key.as_deref()).and_then(|(c, key)| c.get(key));
            let cached = hit.is_some();
            let out = match hit {
                Some(c) => c,
                None => {
                    let c = nvcc::compile(path, &k.name, &src, arch)?;
                    runs += 1;
                    if let Some((cache, key)) = cache.zip(key.as_deref()) {
                        if let Err(e) = cache.put(key, &c) {
                            cache_warning = Some(e.to_string());
                        }
                    }
                    c
                }
            };
            hits += usize::from(cached);
            if let Some(f) = opts.progress {
                f(Progress::Done { kernel: &k.name, cached });
            }
            bundle.add(&format!("kernels/{}.cubin", k.name), out.cubin);
            stats.insert(k.name.clone(), out.stats);
            if let Some(c) = out.sass {
                sass.insert(k.name.clone(), c);
            }
            version = Some(out.nvcc_version);
        }
        bundle.add(&format!("kernels/{}.cu", k.name), src);
    }
    for (file, text) in transfer_files(p, arch)? {
        bundle.add(&file, text);
    }
    let skipped = match nvcc {
        NvccMode::Off => "compilation disabled (`--nvcc off`)",
        _ => "no nvcc found (run `scripts/setup.sh` and set MOEFORGE_NVCC, or pass `--nvcc PATH`)",
    };
    let toolchain = match &version {
        Some(v) => emit::report::Toolchain::Compiled { nvcc_version: v, stats: &stats, sass: &sass },
        None => emit::report::Toolchain::Skipped(skipped),
    };
    let model = checked.spec.model(checked.spec.deploy(id).model);
    bundle.add("report.md", emit::report::render(p, model, &toolchain));
    bundle.seal(Manifest {
        format_version: FORMAT_VERSION,
        tool: TOOL.to_string(),
        deploy: p.deploy.clone(),
        spec_hash: p.spec_hash.clone(),
        targets: vec![arch.to_string()],
        cubins: version.is_some(),
        files: BTreeMap::new(),
    });
    let summary = EmitSummary {
        skipped_reason: version.is_none().then(|| skipped.to_string()),
        compiled_with: version,
        cache_hits: hits,
        nvcc_runs: runs,
        cache_warning,
    };
    Ok((bundle, summary))
}
