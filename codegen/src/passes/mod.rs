//! Planning passes. Every pass has one shape, [`Pass`]: a plain function of
//! the deployment's context ([`Ctx`]) and the plan built so far, which it
//! extends, failing with [`PassError`]s that point at a field of the spec.
//! [`crate::plan_deployment_with`] runs [`PIPELINE`] in order, turns errors
//! into diagnostics in one place, and runs the validator after every pass in
//! debug builds.

pub mod cost;
pub mod kernels;
pub mod layout;
pub mod memory;
pub mod place;
pub mod program;
pub mod reshard;
pub mod search;
pub mod support;

use crate::target::{self, Target, TileError};
use crate::PlanOptions;
use moeforge_dsl::spec::{Cluster, Deploy, DeployId, Model, Spec, Tiles};
use moeforge_dsl::{BlockSpans, Checked, Code, Diagnostic, Diagnostics};
use moeforge_plan::Plan;

/// A pass: extends `plan` for the deployment in `cx`.
pub type Pass = fn(&Ctx<'_>, &mut Plan) -> Result<(), Vec<PassError>>;

/// The pipeline, in order. Each pass reads only what earlier passes wrote.
pub const PIPELINE: &[(&str, Pass)] = &[
    ("support", support::run),
    ("cost", cost::run),
    ("search", search::run),
    ("layout", layout::run),
    ("placement", place::run),
    ("memory", memory::run),
    ("reshard", reshard::run),
    ("kernels", kernels::run),
    ("program", program::run),
];

/// Everything a pass may read besides the plan: one deployment of a checked
/// spec, its blocks, their spans, the planning options and the target.
pub struct Ctx<'a> {
    pub spec: &'a Spec,
    pub deploy: &'a Deploy,
    pub model: &'a Model,
    pub cluster: &'a Cluster,
    pub tiles: &'a Tiles,
    pub spans: Spans<'a>,
    pub opts: &'a PlanOptions,
    pub target: &'static dyn Target,
    /// Warnings the passes raise: spec values that plan but have no effect.
    warnings: std::cell::RefCell<Vec<PassError>>,
}

/// The spans of the deployment's four blocks.
pub struct Spans<'a> {
    pub model: &'a BlockSpans,
    pub cluster: &'a BlockSpans,
    pub tiles: &'a BlockSpans,
    pub deploy: &'a BlockSpans,
}

impl<'a> Ctx<'a> {
    pub fn new(checked: &'a Checked, id: DeployId, opts: &'a PlanOptions) -> Ctx<'a> {
        let spec = &checked.spec;
        let deploy = spec.deploy(id);
        let cluster = spec.cluster(deploy.cluster);
        static EMPTY: std::sync::OnceLock<BlockSpans> = std::sync::OnceLock::new();
        let empty = EMPTY.get_or_init(BlockSpans::default);
        let pick = |v: &'a [BlockSpans], i: usize| v.get(i).unwrap_or(empty);
        Ctx {
            spec,
            deploy,
            model: spec.model(deploy.model),
            cluster,
            tiles: spec.tile_set(deploy.tiles),
            spans: Spans {
                model: pick(&checked.spans.models, deploy.model.index()),
                cluster: pick(&checked.spans.clusters, deploy.cluster.index()),
                tiles: pick(&checked.spans.tiles, deploy.tiles.index()),
                deploy: pick(&checked.spans.deploys, id.index()),
            },
            opts,
            target: target::of(cluster.gpu.arch),
            warnings: std::cell::RefCell::new(Vec::new()),
        }
    }

    /// Records a warning: the spec plans, but this value has no effect.
    pub fn warn(&self, w: PassError) {
        self.warnings.borrow_mut().push(w);
    }

    /// The warnings raised so far, as diagnostics.
    pub fn warnings(&self) -> Diagnostics {
        Diagnostics(
            self.warnings
                .borrow()
                .iter()
                .map(|e| moeforge_dsl::Diagnostic { severity: moeforge_dsl::Severity::Warning, ..self.diagnostic(e) })
                .collect(),
        )
    }

    /// The diagnostic of a pass error, located at its field.
    pub fn diagnostic(&self, e: &PassError) -> Diagnostic {
        let (spans, path) = match &e.at {
            At::Model(p) => (Some(self.spans.model), p.as_str()),
            At::Cluster(p) => (Some(self.spans.cluster), p.as_str()),
            At::Tiles(p) => (Some(self.spans.tiles), p.as_str()),
            At::Deploy(p) => (Some(self.spans.deploy), p.as_str()),
            At::Input => (None, ""),
        };
        let mut d = Diagnostic::new(e.code, e.message.clone()).help(e.help.clone());
        if let Some(span) = spans.and_then(|s| s.get(path)) {
            d = d.at(span, e.label.clone());
        }
        d
    }

    /// Diagnostics of a pass's errors.
    pub fn diagnostics(&self, errors: &[PassError]) -> Diagnostics {
        Diagnostics(errors.iter().map(|e| self.diagnostic(e)).collect())
    }
}

/// Where a pass error points: a field (dotted path) of one of the
/// deployment's blocks, or an input that is not part of the spec (a
/// profile or statistics file given on the command line).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum At {
    Model(String),
    Cluster(String),
    Tiles(String),
    Deploy(String),
    Input,
}

/// Why a pass cannot plan this deployment: a stable code, a message that
/// says what is too small and by how much, where, and what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassError {
    pub code: Code,
    pub message: String,
    pub at: At,
    /// The text under the underlined field.
    pub label: String,
    pub help: String,
}

impl PassError {
    pub fn new(code: Code, at: At, message: impl Into<String>) -> PassError {
        PassError { code, message: message.into(), at, label: String::new(), help: String::new() }
    }
    pub fn label(mut self, label: impl Into<String>) -> PassError {
        self.label = label.into();
        self
    }
    pub fn help(mut self, help: impl Into<String>) -> PassError {
        self.help = help.into();
        self
    }
}

impl From<PassError> for Vec<PassError> {
    fn from(e: PassError) -> Vec<PassError> {
        vec![e]
    }
}

impl TileError {
    /// This target limitation as a pass error at its field.
    pub fn into_pass_error(self, cx: &Ctx<'_>) -> PassError {
        let (at, block) = if self.model {
            (At::Model(self.field), format!("model `{}`", cx.model.name))
        } else {
            (At::Tiles(self.field), format!("tile set `{}`", cx.tiles.name))
        };
        PassError::new(
            Code::Unsupported,
            at,
            format!("{block} does not fit {}'s MoE kernel: {}", cx.target.arch().name(), self.message),
        )
        .label("not generated for this target")
        .help("use a tile set like `hopper-bf16` (sm_90a) or `ampere-bf16` (sm_80) in models/tiles.moe")
    }
}
