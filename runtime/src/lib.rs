//! `moeforge-runtime`: backends that execute or simulate a bundle.
//!
//! Takes a bundle loaded and validated by [`load_bundle`] (from
//! `moeforge-plan`, which refuses a bundle whose format, hashes or plan
//! invariants do not hold). Gives engines behind one step-level interface
//! ([`engine::Engine`]: submit, step, cancel, switch, stats) and the
//! switch-policy driver over any of them ([`policy`]). [`twin`] is the `cpu`
//! backend: a real MoE decoder on simulated ranks over the bundle's memory
//! plan, switching TP↔EP live. [`sim`] is the `sim` backend: a
//! discrete-event serving simulator on the plan's cost model, comparing
//! ExpertPlex-style sharing, Moebius-style switching and the baselines.
//! [`device`] is the `Device` interface (memory, modules, launches) with
//! the emulated device and the binding of a program op's plan arguments.
//! [`batching`] is the admission rule they share. [`reference`] holds scalar
//! references of the emitted kernels.
//!
//! This crate never links the compiler (`moeforge-codegen`) or its template
//! engine.

pub mod batching;
pub mod device;
pub mod engine;
pub mod machine;
pub mod policy;
pub mod reference;
pub mod sampling;
pub mod sim;
pub mod twin;

pub use moeforge_plan::bundle::{load_bundle, BundleError, LoadedBundle};
