//! Support gate: rejects valid specs that the generators cannot serve yet,
//! with a located E0200 diagnostic instead of a wrong or partial bundle.
//!
//! It does not re-check what the dsl checker guarantees.

use moeforge_dsl::spec::{DType, DeployId, Routing};
use moeforge_dsl::{Checked, Code, Diagnostic, Diagnostics};

/// Largest expert count the warp-per-token router holds in registers (32 per lane).
pub const MAX_ROUTER_EXPERTS: u32 = 1024;

pub fn check(checked: &Checked, id: DeployId) -> Diagnostics {
    let spec = &checked.spec;
    let d = spec.deploy(id);
    let m = spec.model(d.model);
    let ms = &checked.spans.models[d.model.index()];
    let span = |path: &str| ms.get(path).unwrap_or(moeforge_dsl::Span::new(moeforge_dsl::FileId(0), 0, 0));
    let mut out = Diagnostics::default();
    if m.dtype.experts == DType::Mxfp4 {
        out.push(
            Diagnostic::new(
                Code::Unsupported,
                format!("`{}` stores experts in mxfp4, which the kernel generator does not support yet", m.name),
            )
            .at(span("dtype.experts"), "mxfp4 experts")
            .help("moeforge v1 emits bf16 and fp8 e4m3 expert kernels; use a bf16 or fp8 checkpoint of this model"),
        );
    }
    if m.dtype.activations == DType::Fp8E4m3 {
        out.push(
            Diagnostic::new(Code::Unsupported, "fp8 activations at dispatch are not generated yet")
                .at(span("dtype.activations"), "fp8 activations")
                .help("declare `activations = bf16`; experts may still be fp8"),
        );
    }
    if m.moe.experts > MAX_ROUTER_EXPERTS {
        out.push(
            Diagnostic::new(
                Code::Unsupported,
                format!("{} routed experts exceed the router kernel's {MAX_ROUTER_EXPERTS}", m.moe.experts),
            )
            .at(span("moe.experts"), "too many experts for one warp")
            .help("the router holds a token's scores in one warp's registers"),
        );
    }
    if let Routing::SigmoidGrouped { groups, .. } = m.moe.routing {
        if groups > 32 {
            out.push(
                Diagnostic::new(Code::Unsupported, format!("{groups} expert groups exceed the router kernel's 32"))
                    .at(span("moe.routing.groups"), "too many groups")
                    .help("the router keeps the selected groups in a 32-bit mask"),
            );
        }
    }
    if m.hidden % 8 != 0 {
        out.push(
            Diagnostic::new(Code::Unsupported, format!("hidden = {} is not a multiple of 8", m.hidden))
                .at(span("hidden"), "rows are copied in 16-byte vectors")
                .help("the permute kernels move bf16 rows as 16-byte vectors"),
        );
    }
    out
}
