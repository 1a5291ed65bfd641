//! The connection to the control plane's admin API: address, TLS and the
//! caller's oqp key in the `authorization` metadata.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use oqp_proto::admin::v1::admin_service_client::AdminServiceClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// An admin client that sends the caller's key with every call.
pub type Admin = AdminServiceClient<InterceptedService<Channel, KeyInterceptor>>;

/// Adds `authorization: Bearer <key>` to every call.
#[derive(Clone)]
pub struct KeyInterceptor(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for KeyInterceptor {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

/// Connects to `url` (http or https), presenting `key` if given.
pub async fn connect(
    url: &str,
    key: Option<String>,
    ca: Option<&PathBuf>,
) -> anyhow::Result<Admin> {
    let mut endpoint = Endpoint::from_shared(url.to_owned())
        .with_context(|| format!("invalid control plane URL '{url}'"))?
        .connect_timeout(Duration::from_secs(3))
        .timeout(Duration::from_secs(30));
    if url.starts_with("https://") {
        let mut tls = ClientTlsConfig::new().with_webpki_roots();
        if let Some(path) = ca {
            let pem = std::fs::read(path)
                .with_context(|| format!("cannot read CA file {}", path.display()))?;
            tls = tls.ca_certificate(Certificate::from_pem(pem));
        }
        endpoint = endpoint.tls_config(tls)?;
    }
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("cannot reach the control plane at {url}"))?;
    let value = match key {
        Some(key) => Some(
            format!("Bearer {key}")
                .parse()
                .context("the key contains characters that cannot be sent")?,
        ),
        None => None,
    };
    Ok(AdminServiceClient::with_interceptor(
        channel,
        KeyInterceptor(value),
    ))
}

/// The caller's key: from `--key-file`, else env `OQPCTL_KEY`.
pub fn load_key(file: Option<&PathBuf>) -> anyhow::Result<Option<String>> {
    if let Some(path) = file {
        let key = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read key file {}", path.display()))?;
        return Ok(Some(key.trim_end().to_owned()));
    }
    Ok(std::env::var("OQPCTL_KEY")
        .ok()
        .filter(|key| !key.is_empty()))
}
