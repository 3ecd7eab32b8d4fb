//! Emission: a validated plan to the files of a bundle.
//!
//! Everything here is deterministic: ordered maps, no timestamps, no paths of
//! the machine that compiled. `cuda` renders kernels from the tera templates,
//! `report` writes `report.md`; the bundle format itself (manifest, hashes,
//! atomic write) is `moeforge_plan::bundle`.

pub mod cuda;
pub mod report;
