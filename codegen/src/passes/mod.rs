//! Planning passes. Each is a plain function over the checked spec and the
//! plan built so far; `crate::plan_deployment` runs them in order.

pub mod kernels;
pub mod layout;
pub mod place;
pub mod reshard;
pub mod search;
pub mod support;
pub mod unified;
