//! Support gate: refuses valid specs whose model uses a feature the
//! bundle's kernels do not implement ([`moeforge_plan::caps`], the one
//! capability table), with a located E0200 diagnostic per feature instead
//! of a wrong or partial bundle.
//!
//! It does not re-check what the dsl checker guarantees, nor target limits
//! (which weight formats and tiles an architecture computes: the kernels
//! pass asks the target).

use super::{At, Ctx, PassError};
use moeforge_dsl::Code;
use moeforge_plan::caps::{refusals, Component};
use moeforge_plan::Plan;

/// Plans nothing; fails with every feature of the model the MoE kernels lack.
pub fn run(cx: &Ctx<'_>, _plan: &mut Plan) -> Result<(), Vec<PassError>> {
    let out: Vec<PassError> = refusals(cx.model, Component::MoeKernels)
        .into_iter()
        .map(|(u, why)| {
            PassError::new(
                Code::Unsupported,
                At::Model(u.field.into()),
                format!(
                    "`{}` uses {}, which the generated kernels do not implement: {why}",
                    cx.model.name,
                    u.feature.name()
                ),
            )
            .label(u.feature.name())
            .help("use a checkpoint of the model without it (the capability table is in moeforge-plan's caps.rs)")
        })
        .collect();
    if out.is_empty() {
        Ok(())
    } else {
        Err(out)
    }
}
