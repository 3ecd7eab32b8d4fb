//! The library form of `moeforge compile`: a checked spec (a file checked at
//! run time, or one embedded with [`crate::spec!`]) into a bundle, for a
//! user crate's `build.rs` or tools of its own. The CLI is a caller of it.

use moeforge_codegen::{
    self as codegen, Bundle, EmitOptions, EmitSummary, KernelCache, NvccMode, PlanOptions, Progress,
};
use moeforge_dsl::spec::DeployId;
use moeforge_dsl::{Checked, Code, Diagnostic, Diagnostics};
use moeforge_plan::ValidPlan;

/// How to compile. `Default` is the CLI's default: the only deployment,
/// nvcc found automatically, the user's kernel cache.
pub struct Options<'a> {
    /// Which deployment (`None`: the only one).
    pub deploy: Option<String>,
    /// Measured inputs to planning.
    pub plan: PlanOptions,
    pub nvcc: NvccMode,
    /// The kernel cache; `None` runs nvcc for every kernel.
    pub cache: Option<KernelCache>,
    pub progress: Option<&'a dyn Fn(Progress<'_>)>,
}

impl Default for Options<'_> {
    fn default() -> Self {
        Options {
            deploy: None,
            plan: PlanOptions::default(),
            nvcc: NvccMode::Auto,
            cache: KernelCache::user(),
            progress: None,
        }
    }
}

/// A compiled deployment: the bundle (write it with `Bundle::write`), its
/// validated plan, what emission did, and the warnings of the spec and the
/// planner.
pub struct Compiled {
    pub bundle: Bundle,
    pub plan: ValidPlan,
    pub summary: EmitSummary,
    pub warnings: Diagnostics,
}

#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// The spec does not plan (or names no deployment); `rendered` shows the
    /// diagnostics against the spec's sources.
    #[error("{rendered}")]
    Spec { diagnostics: Diagnostics, rendered: String },
    /// Emission failed (a template, or nvcc rejecting a kernel).
    #[error(transparent)]
    Emit(#[from] codegen::EmitError),
}

/// The named deployment, or the only one.
pub fn deployment(checked: &Checked, name: Option<&str>) -> Result<DeployId, Diagnostics> {
    let names: Vec<&str> = checked.spec.deploys.iter().map(|d| d.name.as_str()).collect();
    let d = match name {
        Some(n) => checked.spec.find_deploy(n).ok_or_else(|| {
            Diagnostic::new(Code::NoDeployment, format!("no deployment named `{n}`")).help(format!(
                "deployments in this spec: {}",
                if names.is_empty() { "none".into() } else { names.join(", ") }
            ))
        }),
        None if names.len() == 1 => Ok(DeployId(0)),
        None if names.is_empty() => Err(Diagnostic::new(Code::NoDeployment, "the spec has no `deploy` block")
            .help("add `deploy NAME { model = … cluster = … tiles = … }` or `use` a file with one")),
        None => Err(Diagnostic::new(Code::NoDeployment, format!("the spec has {} deployments", names.len()))
            .help(format!("choose one with --deploy: {}", names.join(", ")))),
    };
    d.map_err(|x| Diagnostics(vec![x]))
}

/// Plans and emits one deployment of `spec`.
///
/// ```no_run
/// // In a user crate: `let spec = moeforge::spec!("../deploy.moe");` (relative to the file).
/// let spec = &moeforge::embedded::DEFAULT;
/// let out = moeforge::compile(spec, &moeforge::compile::Options::default())?;
/// out.bundle.write(std::path::Path::new("bundle"))?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn compile<S: AsRef<Checked> + ?Sized>(spec: &S, options: &Options<'_>) -> Result<Compiled, CompileError> {
    let checked = spec.as_ref();
    let fail = |diagnostics: Diagnostics| CompileError::Spec {
        rendered: diagnostics.render(&checked.sources, false),
        diagnostics,
    };
    let id = deployment(checked, options.deploy.as_deref()).map_err(fail)?;
    let mut warnings = checked.warnings_for(id);
    let (plan, w) = codegen::plan_with_warnings(checked, id, &options.plan).map_err(fail)?;
    warnings.extend(w);
    let opts = EmitOptions { nvcc: options.nvcc.clone(), cache: options.cache.clone(), progress: options.progress };
    let (bundle, summary) = codegen::emit_with(checked, id, &plan, &opts)?;
    Ok(Compiled { bundle, plan, summary, warnings })
}
