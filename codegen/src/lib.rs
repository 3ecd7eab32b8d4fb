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

pub mod emit;
pub mod nvcc;
pub mod passes;
pub mod placement;
pub mod target;

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
/// support gate → layout → memory plan → reshard descriptors → cost model
/// (roofline, or a fitted profile) → layout search (ExpertPlex Algorithm 1)
/// → kernel instances → expert placement (Zepp or EPLB) → validation. In
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
    let summary =
        EmitSummary { skipped_reason: version.is_none().then(|| skipped.to_string()), compiled_with: version };
    Ok((bundle, summary))
}
