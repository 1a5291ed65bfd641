//! Compiles the `.proto` files with a vendored `protoc`, so that a fresh
//! machine needs nothing installed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // The one secret on the wire gets a redacting Debug (see src/lib.rs).
    config.skip_debug(["oqp.policy.v1.CloudKey"]);
    tonic_prost_build::configure().compile_with_config(
        config,
        &["oqp/policy/v1/policy.proto", "oqp/admin/v1/admin.proto"],
        &["."],
    )?;
    Ok(())
}
