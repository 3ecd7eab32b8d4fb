//! Support gate: rejects valid specs that the generators cannot serve yet,
//! with a located E0200 diagnostic instead of a wrong or partial bundle.
//!
//! It does not re-check what the dsl checker guarantees.

use super::{At, Ctx, PassError};
use moeforge_dsl::spec::{DType, Routing};
use moeforge_dsl::Code;
use moeforge_plan::Plan;

/// Largest expert count the warp-per-token router holds in registers (32 per lane).
pub const MAX_ROUTER_EXPERTS: u32 = 1024;

/// Plans nothing; fails with every unsupported feature of the model.
pub fn run(cx: &Ctx<'_>, _plan: &mut Plan) -> Result<(), Vec<PassError>> {
    let m = cx.model;
    let at = |p: &str| At::Model(p.into());
    let mut out = Vec::new();
    if m.dtype.experts == DType::Mxfp4 {
        out.push(
            PassError::new(
                Code::Unsupported,
                at("dtype.experts"),
                format!("`{}` stores experts in mxfp4, which the kernel generator does not support yet", m.name),
            )
            .label("mxfp4 experts")
            .help("moeforge v1 emits bf16 and fp8 e4m3 expert kernels; use a bf16 or fp8 checkpoint of this model"),
        );
    }
    if m.dtype.activations == DType::Fp8E4m3 {
        out.push(
            PassError::new(
                Code::Unsupported,
                at("dtype.activations"),
                "fp8 activations at dispatch are not generated yet",
            )
            .label("fp8 activations")
            .help("declare `activations = bf16`; experts may still be fp8"),
        );
    }
    if m.moe.experts > MAX_ROUTER_EXPERTS {
        out.push(
            PassError::new(
                Code::Unsupported,
                at("moe.experts"),
                format!("{} routed experts exceed the router kernel's {MAX_ROUTER_EXPERTS}", m.moe.experts),
            )
            .label("too many experts for one warp")
            .help("the router holds a token's scores in one warp's registers"),
        );
    }
    if let Routing::SigmoidGrouped { groups, .. } = m.moe.routing {
        if groups > 32 {
            out.push(
                PassError::new(
                    Code::Unsupported,
                    at("moe.routing.groups"),
                    format!("{groups} expert groups exceed the router kernel's 32"),
                )
                .label("too many groups")
                .help("the router keeps the selected groups in a 32-bit mask"),
            );
        }
    }
    if m.hidden % 8 != 0 {
        out.push(
            PassError::new(Code::Unsupported, at("hidden"), format!("hidden = {} is not a multiple of 8", m.hidden))
                .label("rows are copied in 16-byte vectors")
                .help("the permute kernels move bf16 rows as 16-byte vectors"),
        );
    }
    if out.is_empty() {
        Ok(())
    } else {
        Err(out)
    }
}
