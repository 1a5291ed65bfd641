//! `test-ca DIR`: a throwaway certificate authority (rcgen, as the TLS tests make theirs) for
//! CI's real-client step: writes `DIR/ca.pem` (the bundle clients trust) and
//! `DIR/server.crt` / `DIR/server.key` (0600), a certificate for 127.0.0.1 for oqp's
//! `proxy.tls`. Nothing here guards anything beyond one run on loopback.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use oqp_tests::tls::TestCa;

/// Writes a fresh CA and a server certificate for 127.0.0.1 into a directory.
#[derive(Debug, Parser)]
#[command(name = "test-ca", version)]
struct Args {
    /// Where to write ca.pem, server.crt and server.key (created if missing).
    dir: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let ca = TestCa::new();
    let ca_file = args.dir.join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).with_context(|| format!("writing {}", ca_file.display()))?;
    let (_, key) = ca.issue().write(&args.dir, "server");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("restricting {}", key.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        super::Args::command().debug_assert();
    }
}
