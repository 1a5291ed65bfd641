//! The oqp control plane: one per homelab.
//!
//! It owns the config file ([`config`]), compiles it with the operator's
//! runtime state into policy snapshots ([`compile`]), keeps the state every
//! snapshot is built from ([`hub`]), and serves them to data planes and the
//! admin API to oqpctl over gRPC ([`grpc`]). [`ControlPlane`] starts it all.

pub mod compile;
pub mod config;
pub mod grpc;
pub mod hub;

mod run;

pub use run::{ControlPlane, Options, StartError};
