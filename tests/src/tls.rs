//! TLS for tests and the benchmark: a throwaway CA that issues certificates for 127.0.0.1
//! (rcgen), files to point `proxy.tls` at, and a client that trusts the CA.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// A certificate authority made for one test.
pub struct TestCa {
    key: rcgen::KeyPair,
    cert: rcgen::Certificate,
}

/// A certificate and its key, as PEM.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestCa {
    /// A fresh CA.
    #[allow(clippy::expect_used)]
    pub fn new() -> Self {
        let key = rcgen::KeyPair::generate().expect("CA key");
        let mut params =
            rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        // A name of its own: with rcgen's default, shared by the certificates it issues,
        // OpenSSL (Python's ssl, curl) takes each leaf for self-signed and refuses it.
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "oqp test CA");
        let cert = params.self_signed(&key).expect("CA certificate");
        Self { key, cert }
    }

    /// The CA's certificate, PEM.
    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    /// A certificate for 127.0.0.1, valid from `not_before` to `not_after` (rcgen's defaults
    /// when `None`).
    #[allow(clippy::expect_used)]
    pub fn issue_valid(
        &self,
        not_before: Option<(i32, u8, u8)>,
        not_after: Option<(i32, u8, u8)>,
    ) -> Issued {
        let key = rcgen::KeyPair::generate().expect("leaf key");
        let mut params =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("leaf parameters");
        if let Some((year, month, day)) = not_before {
            params.not_before = rcgen::date_time_ymd(year, month, day);
        }
        if let Some((year, month, day)) = not_after {
            params.not_after = rcgen::date_time_ymd(year, month, day);
        }
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("leaf certificate");
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// A certificate for 127.0.0.1 with rcgen's default validity.
    pub fn issue(&self) -> Issued {
        self.issue_valid(None, None)
    }

    /// A client certificate whose subject's Common Name is `common_name`.
    #[allow(clippy::expect_used)]
    pub fn issue_client(&self, common_name: &str) -> Issued {
        let key = rcgen::KeyPair::generate().expect("client key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("parameters");
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "oqp tests");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, common_name);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("client certificate");
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issued").finish_non_exhaustive()
    }
}

impl Default for TestCa {
    fn default() -> Self {
        Self::new()
    }
}

impl Issued {
    /// Writes `<stem>.crt` and `<stem>.key` into `dir`; returns their paths.
    #[allow(clippy::expect_used)]
    pub fn write(&self, dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
        let cert = dir.join(format!("{stem}.crt"));
        let key = dir.join(format!("{stem}.key"));
        std::fs::write(&cert, &self.cert_pem).expect("write certificate");
        std::fs::write(&key, &self.key_pem).expect("write key");
        (cert, key)
    }
}

/// The `tls:` section naming `cert` and `key`, indented for `proxy:`.
pub fn proxy_tls_yaml(cert: &Path, key: &Path) -> String {
    format!(
        "  tls:\n    cert_file: \"{}\"\n    key_file: \"{}\"\n",
        cert.display(),
        key.display()
    )
}

/// A client configuration trusting `ca_pem` only, offering `alpn`.
#[allow(clippy::expect_used)]
pub fn client_config(ca_pem: &str, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.expect("CA PEM")).expect("CA certificate");
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|protocol| protocol.to_vec()).collect();
    Arc::new(config)
}

/// A client configuration trusting `ca_pem` only, presenting `identity` as its client
/// certificate, offering HTTP/1.1.
#[allow(clippy::expect_used)]
pub fn client_config_with_cert(ca_pem: &str, identity: &Issued) -> Arc<rustls::ClientConfig> {
    use rustls_pki_types::PrivateKeyDer;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.expect("CA PEM")).expect("CA certificate");
    }
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(identity.cert_pem.as_bytes())
            .collect::<Result<_, _>>()
            .expect("client certificate PEM");
    let key = PrivateKeyDer::from_pem_slice(identity.key_pem.as_bytes()).expect("client key PEM");
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_root_certificates(roots)
    .with_client_auth_cert(chain, key)
    .expect("client certificate");
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

/// Connects to `addr` and completes a TLS handshake for 127.0.0.1.
pub async fn connect(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let _ = tcp.set_nodelay(true);
    let name = ServerName::IpAddress(addr.ip().into());
    TlsConnector::from(config).connect(name, tcp).await
}
