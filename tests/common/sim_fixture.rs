//! One planned deployment of a spec file, and the simulator bench over it
//! (tests/sim.rs, tests/anchors.rs).

use moeforge::codegen::{plan_deployment, ValidPlan};
use moeforge::dsl::spec::DeployId;
use moeforge::dsl::{check_paths, Checked, FsLoader, Spec};
use moeforge::runtime::sim::Bench;

pub struct Fixture {
    pub spec: Spec,
    pub planned: ValidPlan,
}

/// The first deployment of `rel` (a path under the repository root), planned.
pub fn load(rel: &str) -> Fixture {
    let checked: Checked =
        check_paths(&[super::root().join(rel)], &FsLoader).unwrap_or_else(|f| panic!("{}", f.render(false)));
    let planned = plan_deployment(&checked, DeployId(0)).unwrap_or_else(|d| panic!("{d:?}"));
    Fixture { spec: checked.spec.deployment(DeployId(0)), planned }
}

/// `examples/{name}.moe`.
pub fn fixture(name: &str) -> Fixture {
    load(&format!("examples/{name}.moe"))
}

impl Fixture {
    pub fn bench(&self) -> Bench<'_> {
        Bench::new(&self.spec, self.planned.plan()).unwrap_or_else(|e| panic!("{e}"))
    }
}
