//! The background tasks that read what the hub holds of the outside world and write it
//! into the hub: Ollama Cloud balances and spend ([`balances`]) and the issuers' key sets
//! ([`jwks`]). They sit above the hub, as the poller does; the data they read and how the
//! snapshot carries it live below it, in [`crate::balances`] and [`crate::jwks`].

pub mod balances;
pub mod jwks;
