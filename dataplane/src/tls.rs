//! TLS on client listeners (`proxy.tls`, `client_injection.listeners[].tls`).
//!
//! The snapshot names a certificate chain and a private key by path; this data plane reads them
//! on its own box, so a private key never crosses the policy stream. Each listener's rustls
//! configuration resolves its certificate through a [`Certificate`], one `ArcSwap` that a
//! reload replaces: handshakes after the swap present the new certificate, and connections
//! already open keep theirs (nothing is dropped). [`TlsCerts::run`] reloads on SIGHUP and when
//! the files' contents change; a reload that fails keeps the last good certificate and says why.
//!
//! TLS 1.2 and 1.3 only, HTTP/2 and HTTP/1.1 offered by ALPN. A plaintext request on a TLS port
//! gets a plain `400` saying so instead of a handshake error ([`accept`]).

use std::path::Path;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sha2::Digest;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;

use crate::policy::TlsFiles;

mod validity;

/// How often the files of every TLS listener are read for a change.
const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// The first byte of a TLS record carrying a handshake (a ClientHello starts with it).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// The answer to a plaintext request on a TLS port.
const PLAINTEXT_REFUSAL: &[u8] = b"HTTP/1.1 400 Bad Request\r\n\
content-type: application/json\r\nconnection: close\r\ncontent-length: 72\r\n\r\n\
{\"error\":\"this port speaks TLS: send the request with https:// instead\"}";

/// Why a listener's certificate and key could not be used. Names the files and the problem,
/// never a byte of the key.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read TLS {what} file {path}: {source}")]
    Read {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    /// The certificate file holds no PEM certificate.
    #[error("TLS certificate file {0} holds no PEM certificate")]
    NoCertificate(String),
    /// The key file holds no usable PEM private key.
    #[error(
        "TLS key file {0} holds no usable PEM private key (PKCS#8, PKCS#1 or SEC1: RSA, ECDSA or Ed25519)"
    )]
    NoKey(String),
    /// The key is not the certificate's.
    #[error("TLS key file {key} does not match the certificate in {cert}")]
    Mismatch { cert: String, key: String },
    /// The certificate's validity does not include now.
    #[error("TLS certificate in {path} {when}")]
    NotValidNow { path: String, when: String },
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Config(String),
    /// The client CA file holds no usable PEM certificate.
    #[error("TLS client_ca_file {0} holds no usable PEM CA certificate")]
    NoClientCa(String),
}

/// A listener's certificate, replaced in place by a reload.
#[derive(Debug)]
pub struct Certificate {
    files: TlsFiles,
    current: ArcSwap<CertifiedKey>,
    /// A digest of the files' contents as last read, so that an unchanged pair is not
    /// reloaded and a broken one is reported once per change.
    seen: Mutex<[u8; 32]>,
}

/// The TLS listeners' certificates, for reloads.
#[derive(Debug, Default)]
pub struct TlsCerts {
    loaded: Mutex<Vec<Weak<Certificate>>>,
}

impl TlsCerts {
    /// Loads `files` and builds an acceptor that follows their reloads.
    pub fn open(&self, files: &TlsFiles) -> Result<TlsAcceptor, TlsError> {
        let (key, seen) = load(files)?;
        let certificate = Arc::new(Certificate {
            files: files.clone(),
            current: ArcSwap::from_pointee(key),
            seen: Mutex::new(seen),
        });
        let verifier = files
            .client_ca_file
            .as_deref()
            .map(client_verifier)
            .transpose()?;
        let acceptor = acceptor(certificate.clone(), verifier)?;
        if let Ok(mut loaded) = self.loaded.lock() {
            loaded.retain(|certificate| certificate.strong_count() > 0);
            loaded.push(Arc::downgrade(&certificate));
        }
        Ok(acceptor)
    }

    /// Re-reads every open listener's files; `force` reloads even unchanged ones (SIGHUP).
    /// Returns the failures, each keeping its last good certificate.
    pub fn reload(&self, force: bool) -> Vec<TlsError> {
        let certificates: Vec<_> = match self.loaded.lock() {
            Ok(loaded) => loaded.iter().filter_map(Weak::upgrade).collect(),
            Err(_) => return Vec::new(),
        };
        certificates
            .iter()
            .filter_map(|certificate| certificate.reload(force).err())
            .collect()
    }

    /// Reloads on SIGHUP and when a file changes, until `shutdown`.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hangup = match signal(SignalKind::hangup()) {
            Ok(hangup) => Some(hangup),
            Err(error) => {
                tracing::warn!(%error, "no SIGHUP handler: TLS certificates reload on file changes only");
                None
            }
        };
        let mut tick = tokio::time::interval(WATCH_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let force = tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => false,
                Some(()) = async {
                    match hangup.as_mut() {
                        Some(hangup) => hangup.recv().await,
                        None => std::future::pending().await,
                    }
                } => true,
            };
            for error in self.reload(force) {
                tracing::error!(%error, "TLS certificate not reloaded; the last good one stays");
            }
        }
    }
}

impl Certificate {
    fn reload(&self, force: bool) -> Result<(), TlsError> {
        let digest = match digest(&self.files) {
            Ok(digest) => digest,
            // Mid-replacement (one file gone): read again at the next tick.
            Err(error) if !force => {
                tracing::debug!(%error, "TLS files not readable; retrying");
                return Ok(());
            }
            Err(error) => return Err(error),
        };
        {
            let Ok(mut seen) = self.seen.lock() else {
                return Ok(());
            };
            if *seen == digest && !force {
                return Ok(());
            }
            *seen = digest;
        }
        let (key, _) = load(&self.files)?;
        self.current.store(Arc::new(key));
        tracing::info!(cert = %self.files.cert_file.display(), "TLS certificate reloaded");
        Ok(())
    }
}

impl ResolvesServerCert for Certificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

/// Completes the handshake of a connection accepted on a TLS port. A client that sends
/// something other than a TLS handshake (a plaintext HTTP request) is answered with a plain
/// `400` that says so, and closed: `None`, as for a failed handshake.
pub async fn accept(
    acceptor: &TlsAcceptor,
    stream: TcpStream,
    peer: std::net::SocketAddr,
) -> Option<TlsStream<TcpStream>> {
    let mut first = [0u8; 1];
    match stream.peek(&mut first).await {
        Ok(1) if first[0] == TLS_HANDSHAKE_RECORD => {}
        Ok(1) => {
            tracing::debug!(%peer, "plaintext request on a TLS port");
            let mut stream = stream;
            let _ = stream.write_all(PLAINTEXT_REFUSAL).await;
            let _ = stream.shutdown().await;
            return None;
        }
        _ => return None,
    }
    match acceptor.accept(stream).await {
        Ok(stream) => Some(stream),
        Err(error) => {
            tracing::debug!(%peer, %error, "TLS handshake failed");
            None
        }
    }
}

/// The Common Name of the client certificate a connection presented, which rustls verified
/// against the listener's `client_ca_file`; `None` when it presented none.
pub fn peer_common_name(stream: &TlsStream<TcpStream>) -> Option<Arc<str>> {
    let leaf = stream.get_ref().1.peer_certificates()?.first()?;
    validity::common_name(leaf).map(Arc::from)
}

/// A verifier of client certificates issued by the CAs in `path`; a client may also connect
/// without one (it then needs a key, as on any port).
fn client_verifier(
    path: &Path,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
    let shown = path.display().to_string();
    let pem = read(path, "client CA")?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|_| TlsError::NoClientCa(shown.clone()))?;
        roots
            .add(cert)
            .map_err(|_| TlsError::NoClientCa(shown.clone()))?;
    }
    if roots.is_empty() {
        return Err(TlsError::NoClientCa(shown));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .allow_unauthenticated()
        .build()
        .map_err(|error| TlsError::Config(error.to_string()))
}

/// The rustls server configuration of a listener presenting `certificate`, asking for client
/// certificates when it has a `verifier`.
fn acceptor(
    certificate: Arc<Certificate>,
    verifier: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
) -> Result<TlsAcceptor, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|error| TlsError::Config(error.to_string()))?;
    let builder = match verifier {
        Some(verifier) => builder.with_client_cert_verifier(verifier),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_cert_resolver(certificate);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Reads and checks a certificate chain and its key.
fn load(files: &TlsFiles) -> Result<(CertifiedKey, [u8; 32]), TlsError> {
    let cert_bytes = read(&files.cert_file, "certificate")?;
    let key_bytes = read(&files.key_file, "key")?;
    let seen = digest_of(&cert_bytes, &key_bytes);
    let cert_path = files.cert_file.display().to_string();
    let key_path = files.key_file.display().to_string();
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_bytes)
        .collect::<Result<_, _>>()
        .map_err(|_| TlsError::NoCertificate(cert_path.clone()))?;
    let Some(leaf) = chain.first() else {
        return Err(TlsError::NoCertificate(cert_path));
    };
    // Clients would refuse it anyway, each with its own obscure message: say it here, once.
    if let Some(when) = validity::problem(leaf, std::time::SystemTime::now()) {
        return Err(TlsError::NotValidNow {
            path: cert_path,
            when,
        });
    }
    // The parser's own errors may quote the file: only the path is reported.
    let key =
        PrivateKeyDer::from_pem_slice(&key_bytes).map_err(|_| TlsError::NoKey(key_path.clone()))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&key)
        .map_err(|_| TlsError::NoKey(key_path.clone()))?;
    let certified = CertifiedKey::new(chain, signing);
    match certified.keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {}
        Err(_) => {
            return Err(TlsError::Mismatch {
                cert: cert_path,
                key: key_path,
            });
        }
    }
    Ok((certified, seen))
}

fn read(path: &Path, what: &'static str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.display().to_string(),
        source,
    })
}

fn digest(files: &TlsFiles) -> Result<[u8; 32], TlsError> {
    Ok(digest_of(
        &read(&files.cert_file, "certificate")?,
        &read(&files.key_file, "key")?,
    ))
}

fn digest_of(cert: &[u8], key: &[u8]) -> [u8; 32] {
    let mut hasher = sha2::Sha256::new();
    hasher.update(sha2::Sha256::digest(cert));
    hasher.update(sha2::Sha256::digest(key));
    hasher.finalize().into()
}
