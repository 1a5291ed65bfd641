//! The oqp control plane: one per homelab.
//!
//! It owns the config file ([`config`]), compiles it with the operator's
//! runtime state into policy snapshots ([`compile`]), keeps the state every
//! snapshot is built from ([`hub`]), keeps the keys minted at run time
//! ([`keystore`]), and serves them to data planes and the
//! admin API to oqpctl over gRPC ([`grpc`]). In the background it polls the
//! upstream hosts ([`poller`]), reads Ollama Cloud balances and issuer keys ([`readers`]) and delivers webhooks ([`webhooks`]) over one
//! outbound HTTP client ([`outbound`]). Management actions are recorded in
//! the audit trail ([`audit`]). [`ControlPlane`] starts it all.

pub mod audit;
pub mod balances;
pub mod compile;
pub mod config;
pub mod grpc;
pub mod hop_keys;
pub mod hub;
pub mod incoming;
pub mod inventory;
pub mod jwks;
pub mod keystore;
pub mod node_credentials;
pub mod node_token;
pub mod outbound;
pub mod poller;
pub mod readers;
pub(crate) mod state_file;
pub mod usage;
pub mod webhooks;

mod run;

pub use run::{ControlPlane, Options, StartError};
