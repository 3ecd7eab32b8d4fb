//! `moeforge-dsl`: the `.moe` language.
//!
//! Takes `.moe` text (from files, memory, or a proc-macro) and gives a checked,
//! serde-serializable [`Spec`] plus the [`SourceMap`] and [`SpanTable`] that
//! later stages use to point their own diagnostics into the source. Every
//! error is a [`Diagnostic`] with a stable [`Code`], a span and a help line;
//! all errors are collected, and no input makes this crate panic.
//!
//! Consumed by `moeforge-codegen` (planning and emission), `moeforge-macros`
//! (compile-time checks) and the `moeforge` CLI. This crate never depends on
//! codegen or runtime.

pub mod check;
pub mod diag;
mod display;
mod fields;
pub mod hf;
mod lower;
pub mod source;
pub mod spec;
pub mod syntax;
pub mod units;

pub use check::{check_paths, check_str, BlockRef, BlockSpans, Checked, Failed, SpanTable};
pub use diag::{Code, Diagnostic, Diagnostics, Label, Severity};
pub use source::{normalize, FileId, FsLoader, Loader, MemLoader, SourceMap, Span};
pub use spec::*;
