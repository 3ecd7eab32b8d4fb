//! `moeforge`: a compiler from a short MoE model/cluster/tile spec to a
//! specialized MoE serving stack.
//!
//! This crate is the facade: it re-exports the stage crates and holds the
//! embedded default spec. The CLI lives in `main.rs` and `cli/`.
//!
//! - [`dsl`]: the `.moe` language (parse, check, [`dsl::Spec`]).
//! - [`plan`]: what the compiler produces and the runtime consumes (the plan
//!   IR, its validator, the cost model, the bundle format and loader).
//! - [`codegen`]: planning passes and emission (spec → plan → bundle).
//! - [`runtime`]: backends that execute or simulate a bundle.
//! - [`server`]: the OpenAI-compatible HTTP server over any engine.
//! - [`spec!`]: check a `.moe` file at Rust compile time and embed it
//!   ([`EmbeddedSpec`]); [`compile()`]: a checked spec into a bundle.

pub use moeforge_codegen as codegen;
pub use moeforge_cuda as cuda;
pub use moeforge_dsl as dsl;
pub use moeforge_macros::spec;
pub use moeforge_plan as plan;
pub use moeforge_runtime as runtime;
pub use moeforge_server as server;
pub use moeforge_xfer as xfer;

pub mod compile;
pub mod deploy;
pub mod embedded;

pub use compile::compile;
pub use embedded::EmbeddedSpec;
