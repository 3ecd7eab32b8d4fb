//! The capability table: which model features each component of the stack
//! implements. One table, consulted by the compiler's support gate (a
//! feature the MoE kernels lack is refused at compile time, at the spec
//! field that asks for it), by the kernel generators (the router's limits)
//! and by the CPU twin (which refuses a bundle whose model it cannot run,
//! naming the features). A feature is implemented everywhere it is needed
//! or refused; nothing silently computes something else.
//!
//! Target-specific limits (which weight formats and tile shapes an
//! architecture's tensor-core path computes) are the compiler's targets'.

use moeforge_dsl::spec::{Activation, Attention, DType, Model, Routing};

/// Largest expert count the warp-per-token router holds in registers (32 per lane).
pub const ROUTER_MAX_EXPERTS: u32 = 1024;
/// Most expert groups the router's 32-bit group mask holds.
pub const ROUTER_MAX_GROUPS: u32 = 32;

/// A part of the stack that computes some of a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Component {
    /// The bundle's MoE kernels: router, permutation and combine, the APK.
    MoeKernels,
    /// The `cpu` backend: the CPU twin.
    CpuTwin,
}

impl Component {
    pub const ALL: [Component; 2] = [Component::MoeKernels, Component::CpuTwin];
    pub fn name(self) -> &'static str {
        match self {
            Component::MoeKernels => "MoE kernels",
            Component::CpuTwin => "CPU twin",
        }
    }
}

/// A model feature some component may lack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Feature {
    MlaAttention,
    DsaIndexer,
    PerLayerQkNorm,
    AttentionSinks,
    SlidingWindow,
    /// GPT-OSS's clamped SwiGLU (`activation = swiglu_oai`).
    ClampedSwiglu,
    Fp8Experts,
    /// fp8 attention and dense weights (not just the experts).
    Fp8Weights,
    Mxfp4Experts,
    Fp8Activations,
    /// More routed experts than the router holds ([`ROUTER_MAX_EXPERTS`]).
    ManyExperts,
    /// More expert groups than the router's mask holds ([`ROUTER_MAX_GROUPS`]).
    ManyGroups,
    /// A hidden size that is not whole 16-byte bf16 vectors.
    UnalignedHidden,
}

impl Feature {
    pub fn name(self) -> &'static str {
        match self {
            Feature::MlaAttention => "MLA attention",
            Feature::DsaIndexer => "the DSA indexer (sparse attention)",
            Feature::PerLayerQkNorm => "QK-norm over the whole projection (per_layer)",
            Feature::AttentionSinks => "attention sinks",
            Feature::SlidingWindow => "sliding-window attention",
            Feature::ClampedSwiglu => "the clamped SwiGLU (swiglu_oai)",
            Feature::Fp8Experts => "fp8 experts",
            Feature::Fp8Weights => "fp8 attention and dense weights",
            Feature::Mxfp4Experts => "mxfp4 experts",
            Feature::Fp8Activations => "fp8 activations at dispatch",
            Feature::ManyExperts => "more than 1024 routed experts",
            Feature::ManyGroups => "more than 32 expert groups",
            Feature::UnalignedHidden => "a hidden size that is not a multiple of 8",
        }
    }
}

/// Whether `component` implements `feature`; when not, why.
pub fn support(component: Component, feature: Feature) -> Result<(), &'static str> {
    use Component::*;
    use Feature::*;
    match (component, feature) {
        // The MoE kernels see the routed block only: attention features pass.
        (
            MoeKernels,
            MlaAttention | DsaIndexer | PerLayerQkNorm | AttentionSinks | SlidingWindow | Fp8Experts | Fp8Weights
            | ClampedSwiglu,
        ) => Ok(()),
        (MoeKernels, Mxfp4Experts) => Err("the APK reads bf16 or fp8 e4m3 experts"),
        (MoeKernels, Fp8Activations) => Err("dispatch moves bf16 rows"),
        (MoeKernels, ManyExperts) => Err("the router holds a token's scores in one warp's registers"),
        (MoeKernels, ManyGroups) => Err("the router keeps the selected groups in a 32-bit mask"),
        (MoeKernels, UnalignedHidden) => Err("the permute kernels move bf16 rows as 16-byte vectors"),
        (
            CpuTwin,
            ManyExperts | ManyGroups | UnalignedHidden | PerLayerQkNorm | MlaAttention | DsaIndexer | Fp8Experts
            | Fp8Weights | AttentionSinks | SlidingWindow | ClampedSwiglu,
        ) => Ok(()),
        (CpuTwin, Mxfp4Experts) => Err("the twin reads bf16 and fp8 e4m3 (block-scaled) checkpoints"),
        (CpuTwin, Fp8Activations) => Err("the twin exchanges f32 activations"),
    }
}

/// A feature a model uses, and the model field (dotted path) that asks for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Use {
    pub feature: Feature,
    pub field: &'static str,
}

/// Every feature of the table that model `m` uses.
pub fn uses(m: &Model) -> Vec<Use> {
    let mut out = Vec::new();
    let mut add = |feature, field| out.push(Use { feature, field });
    match m.attention {
        Attention::Mla { indexer, .. } => {
            add(Feature::MlaAttention, "attention");
            if indexer.is_some() {
                add(Feature::DsaIndexer, "attention.index_topk");
            }
        }
        Attention::Gqa { sinks, qk_norm, qk_norm_scope, .. } => {
            if sinks {
                add(Feature::AttentionSinks, "attention.sinks");
            }
            if qk_norm && qk_norm_scope == moeforge_dsl::spec::QkNormScope::PerLayer {
                add(Feature::PerLayerQkNorm, "attention.qk_norm");
            }
        }
    }
    if m.sliding_window.is_some() {
        add(Feature::SlidingWindow, "sliding_window");
    }
    if m.moe.activation == Activation::SwigluOai {
        add(Feature::ClampedSwiglu, "moe.activation");
    }
    match m.dtype.experts {
        DType::Fp8E4m3 => add(Feature::Fp8Experts, "dtype.experts"),
        DType::Mxfp4 => add(Feature::Mxfp4Experts, "dtype.experts"),
        DType::Bf16 | DType::F32 => {}
    }
    if m.dtype.weights != DType::Bf16 {
        add(Feature::Fp8Weights, "dtype.weights");
    }
    if m.dtype.activations != DType::Bf16 {
        add(Feature::Fp8Activations, "dtype.activations");
    }
    if m.moe.experts > ROUTER_MAX_EXPERTS {
        add(Feature::ManyExperts, "moe.experts");
    }
    if let Routing::SigmoidGrouped { groups, .. } = m.moe.routing {
        if groups > ROUTER_MAX_GROUPS {
            add(Feature::ManyGroups, "moe.routing.groups");
        }
    }
    if !m.hidden.is_multiple_of(8) {
        add(Feature::UnalignedHidden, "hidden");
    }
    out
}

/// The features of `m` that `component` does not implement, with why.
pub fn refusals(m: &Model, component: Component) -> Vec<(Use, &'static str)> {
    uses(m).into_iter().filter_map(|u| support(component, u.feature).err().map(|why| (u, why))).collect()
}
