//! `moeforge-plan`: what the compiler produces and the runtime consumes.
//!
//! Produced by `moeforge-codegen` (its passes fill a [`Plan`] and its
//! emitter writes a [`Bundle`]), consumed by `moeforge-runtime` (which loads a
//! bundle with [`load_bundle`] and executes or simulates its plan). Holds the
//! plan IR ([`plan`], [`memory`], [`search`], [`placement`]), the validator
//! that gates both emission and loading ([`validate`]), the tile-aware cost
//! model with the one iteration-time function the layout search and the
//! simulator share ([`cost`]), and the bundle format ([`bundle`]).
//!
//! This crate never depends on codegen, tera or the runtime: the runtime
//! links it, not the compiler.

pub mod bundle;
pub mod caps;
pub mod cost;
pub mod memory;
pub mod placement;
pub mod plan;
pub mod program;
pub mod reshard;
pub mod rng;
pub mod roles;
pub mod search;
mod text;
pub mod transfers;
pub mod validate;
pub mod workload;

pub use bundle::{load_bundle, Bundle, BundleError, LoadedBundle, Manifest};
pub use plan::*;
pub use validate::{validate, ValidPlan, Violation};
