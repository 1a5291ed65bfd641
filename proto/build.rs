//! Compiles the `.proto` files with a vendored `protoc`, so that a fresh
//! machine needs nothing installed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // The secrets on the wire get a redacting Debug (see src/lib.rs): cloud
    // keys, the cache settings, whose Redis URL may carry a password, and a
    // node's own token as it is issued, and the hop keys.
    config.skip_debug([
        "oqp.admin.v1.AddNodeResponse",
        "oqp.policy.v1.CloudKey",
        "oqp.policy.v1.HopPeer",
        "oqp.policy.v1.EmbeddingCacheSettings",
    ]);
    tonic_prost_build::configure().compile_with_config(
        config,
        &[
            "oqp/policy/v1/policy.proto",
            "oqp/admin/v1/admin.proto",
            "oqp/admin/v1/audit.proto",
        ],
        &["."],
    )?;
    Ok(())
}
