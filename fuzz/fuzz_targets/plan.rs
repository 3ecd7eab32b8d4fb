//! Fuzzes the planner past the checker: fuzz bytes choose a small
//! deployment (`tests/common/specgen.rs`, the generator the property test
//! uses); whatever the checker accepts must plan to a bundle or fail with
//! located, coded diagnostics, never a panic or an internal error. Debug
//! assertions are on, so the validator runs after every pass.
#![no_main]

#[path = "../../tests/common/specgen.rs"]
mod specgen;

use libfuzzer_sys::fuzz_target;
use moeforge_codegen::{emit, plan_deployment, NvccMode};
use moeforge_dsl::spec::DeployId;
use moeforge_dsl::{check_str, Code};

fuzz_target!(|data: &[u8]| {
    let text = specgen::spec_text(&mut specgen::Bytes(data));
    let Ok(checked) = check_str("gen.moe", &text) else { return };
    match plan_deployment(&checked, DeployId(0)) {
        Err(d) => {
            for x in d.iter() {
                assert!(x.code != Code::Internal, "{}\n{text}", d.render(&checked.sources, false));
                assert!(x.primary.is_some(), "unlocated {x:?}\n{text}");
            }
            let _ = d.render(&checked.sources, false);
        }
        Ok(plan) => {
            let (bundle, _) = emit(&checked, DeployId(0), &plan, &NvccMode::Off).unwrap_or_else(|e| panic!("{e}\n{text}"));
            assert!(bundle.files.contains_key("plan.json"));
            moeforge_plan::validate::validate(plan.plan().clone()).unwrap_or_else(|v| panic!("{v:?}\n{text}"));
        }
    }
});
