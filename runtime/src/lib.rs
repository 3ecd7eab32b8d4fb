//! `moeforge-runtime`: loads bundles and runs them.
//!
//! [`load_bundle`] reads a bundle directory and refuses it unless its format
//! version matches, every file's SHA-256 matches the manifest, and the spec
//! hash matches both `spec.json` and `plan.json`. [`twin`] is the `cpu`
//! backend: a real MoE decoder on simulated ranks over the bundle's memory
//! plan, switching TP↔EP live. [`sim`] is the `sim` backend: a
//! discrete-event serving simulator on the plan's cost model, comparing
//! ExpertPlex-style sharing, Moebius-style switching and the baselines.
//! [`batching`] is the admission rule both share. [`reference`] holds scalar
//! references of the emitted kernels.

pub mod batching;
pub mod reference;
pub mod sim;
pub mod twin;

pub use moeforge_plan::bundle::{load_bundle, BundleError, LoadedBundle};
