//! `moeforge-codegen`: from a checked spec to a bundle.
//!
//! Takes a [`moeforge_dsl::Checked`] spec and one of its deployments; gives a
//! validated [`Plan`] ([`plan_deployment`]) and the [`Bundle`] of files
//! ([`emit`]): `manifest.json`, `spec.json`, `plan.json`, `kernels/*.cu`
//! (plus cubins when nvcc is available) and `report.md`. The pipeline is
//! spelled out in [`plan_deployment`]; each pass lives in `passes/`. The
//! emitter only accepts a [`ValidPlan`].
//!
//! Consumed by the `moeforge` CLI and by `moeforge-runtime` (which reads the
//! plan and manifest types).

pub mod emit;
pub mod nvcc;
pub mod passes;
pub mod placement;
pub mod target;

pub use moeforge_plan::{validate, Bundle, Manifest, Plan, ValidPlan, Violation};
pub use nvcc::NvccMode;

use moeforge_dsl::spec::DeployId;
use moeforge_dsl::{Checked, Code, Diagnostic, Diagnostics};
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

/// Runs the planning pipeline for one deployment:
/// support gate → layout → memory plan (unified buffer, TP/EP views, reshard
/// descriptors) → kernel instances → cost model (roofline, or a fitted
/// profile) → layout search (ExpertPlex Algorithm 1) → expert placement
/// (Zepp or EPLB) → validation.
/// Invariants are checked after every pass in debug builds.
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

/// [`plan_deployment`] with a measured profile.
pub fn plan_deployment_with(checked: &Checked, id: DeployId, opts: &PlanOptions) -> Result<ValidPlan, Diagnostics> {
    let unsupported = passes::support::check(checked, id);
    if !unsupported.is_empty() {
        return Err(unsupported);
    }
    let spec = &checked.spec;
    let d = spec.deploy(id);
    let m = spec.model(d.model);
    let c = spec.cluster(d.cluster);
    let (layout, ranks) = passes::layout::run(spec, d);
    let mut plan = Plan {
        format_version: FORMAT_VERSION,
        deploy: d.name.clone(),
        spec_hash: moeforge_plan::bundle::sha256_hex(&canonical_spec(checked, id)),
        model: ModelFacts::of(m),
        cluster: ClusterFacts::of(c),
        layout,
        ranks,
        memory: passes::unified::run(spec, d).map_err(|msg| {
            let ds = &checked.spans.deploys[id.index()];
            let mut diag =
                Diagnostic::new(Code::WeightsDoNotFit, format!("deployment `{}` does not fit: {msg}", d.name))
                    .help("raise `memory_fraction`, use a cluster with more GPUs, or a lower-precision checkpoint");
            if let Some(s) = ds.get("memory_fraction").or(ds.get("cluster")) {
                diag = diag.at(s, "per-GPU budget too small");
            }
            Diagnostics(vec![diag])
        })?,
        kernels: vec![],
        cost: cost::CostModel::roofline(m, c, spec.tile_set(d.tiles)),
        search: None,
        placement: None,
    };
    debug_check(&plan, "layout and memory plan");
    plan.kernels = passes::kernels::run(spec, d, plan.layout.max_experts_per_rank);
    debug_check(&plan, "kernels");
    if let Some((profile, digest)) = &opts.profile {
        plan.cost = plan.cost.clone().with_profile(profile, digest).map_err(|e| {
            Diagnostics(vec![Diagnostic::new(Code::Unsupported, format!("the latency profile cannot be used: {e}"))
                .help("a profile is {\"samples\": [{\"component\": \"moe\", \"x\": …, \"s\": …, \"t\": seconds}, …]}")])
        })?;
    }
    if matches!(d.strategy, moeforge_dsl::spec::Strategy::Expertplex | moeforge_dsl::spec::Strategy::Auto) {
        plan.search = Some(passes::search::run(spec, d, &plan.cost));
    }
    let apks = passes::kernels::apk(spec, d, &plan.ranks, &plan.cost, plan.search.as_ref()).map_err(|e| {
        let (spans, block) = if e.model {
            (&checked.spans.models[d.model.index()], format!("model `{}`", m.name))
        } else {
            (&checked.spans.tiles[d.tiles.index()], format!("tile set `{}`", spec.tile_set(d.tiles).name))
        };
        let mut diag = Diagnostic::new(
            Code::Unsupported,
            format!("{block} does not fit the Adaptive Persistent Kernel: {}", e.message),
        )
        .help("use a tile set like `hopper-bf16` (sm_90a) or `ampere-bf16` (sm_80) in models/tiles.moe");
        if let Some(s) = spans.get(&e.field) {
            diag = diag.at(s, "not generated for this target");
        }
        Diagnostics(vec![diag])
    })?;
    plan.kernels.extend(apks);
    let loads = opts.loads.as_ref().map(|(l, digest)| (l.as_slice(), digest.as_str()));
    plan.placement = passes::place::run(spec, d, &plan.cost, loads).map_err(|e| {
        let ds = &checked.spans.deploys[id.index()];
        let mut diag = Diagnostic::new(Code::Unsupported, format!("expert placement failed: {e}")).help(
            "(experts + redundant_experts) must be a multiple of the GPU count; measured loads must match the model",
        );
        if let Some(s) = ds.get("placement.redundant_experts").or(ds.get("placement")) {
            diag = diag.at(s, "placement policy");
        }
        Diagnostics(vec![diag])
    })?;
    validate::validate(plan).map_err(|v| internal(&v))
}

fn debug_check(plan: &Plan, pass: &str) {
    if cfg!(debug_assertions) {
        let v = validate::check(plan);
        debug_assert!(v.is_empty(), "after pass `{pass}`: {v:?}");
    }
}

fn internal(v: &[Violation]) -> Diagnostics {
    Diagnostics(
        v.iter()
            .map(|x| {
                Diagnostic::new(Code::Unsupported, format!("internal error: {x}"))
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
}

#[derive(Debug, thiserror::Error)]
pub enum EmitError {
    #[error(transparent)]
    Template(#[from] emit::cuda::TemplateError),
    #[error(transparent)]
    Nvcc(#[from] nvcc::NvccError),
}

/// Emits the bundle of a validated plan.
pub fn emit(
    checked: &Checked,
    id: DeployId,
    plan: &ValidPlan,
    nvcc: &NvccMode,
) -> Result<(Bundle, EmitSummary), EmitError> {
    let p = plan.plan();
    let mut bundle = Bundle::default();
    bundle.add("spec.json", canonical_spec(checked, id));
    let mut plan_json = serde_json::to_vec_pretty(p).unwrap_or_default();
    plan_json.push(b'\n');
    bundle.add("plan.json", plan_json);
    let arch = p.cluster.arch.name();
    let nvcc_path = nvcc.resolve();
    let mut stats = BTreeMap::new();
    let mut sass = BTreeMap::new();
    let mut version = None;
    for k in &p.kernels {
        let src = emit::cuda::render(plan, k)?;
        if let Some(path) = &nvcc_path {
            let out = nvcc::compile(path, &k.name, &src, arch)?;
            bundle.add(&format!("kernels/{}.cubin", k.name), out.cubin);
            stats.insert(k.name.clone(), out.stats);
            if let Some(c) = out.sass {
                sass.insert(k.name.clone(), c);
            }
            version = Some(out.nvcc_version);
        }
        bundle.add(&format!("kernels/{}.cu", k.name), src);
    }
    let skipped = match nvcc {
        NvccMode::Off => "compilation disabled (`--nvcc off`)",
        _ => "no nvcc found (run `scripts/setup.sh` and set MOEFORGE_NVCC, or pass `--nvcc PATH`)",
    };
    let toolchain = match &version {
        Some(v) => emit::report::Toolchain::Compiled { nvcc_version: v, stats: &stats, sass: &sass },
        None => emit::report::Toolchain::Skipped(skipped),
    };
    bundle.add("report.md", emit::report::render(p, &toolchain));
    bundle.seal(Manifest {
        format_version: FORMAT_VERSION,
        tool: TOOL.to_string(),
        deploy: p.deploy.clone(),
        spec_hash: p.spec_hash.clone(),
        targets: vec![arch.to_string()],
        cubins: version.is_some(),
        files: BTreeMap::new(),
    });
    let summary =
        EmitSummary { skipped_reason: version.is_none().then(|| skipped.to_string()), compiled_with: version };
    Ok((bundle, summary))
}
