//! TLS with rustls: HTTPS for clients (`tls_cert`, `tls_key`, read again on SIGHUP; or, for
//! the endpoint picker's listener with `epp_tls` and no certificate, a self-signed one) and
//! the trust roots for `https://` workers (`worker_ca_file`).
//!
//! The server side offers HTTP/2 and HTTP/1.1 through ALPN, with rustls's safe defaults
//! (TLS 1.2 and 1.3, the `ring` provider). A reload builds a whole new server configuration
//! from the files and swaps it in ([`ServerTls::reload`]); connections already open keep
//! the certificate they were made with, new handshakes use the new one, and a file that
//! fails to load leaves the certificate in use untouched.

use anyhow::{Context, bail};
use arc_swap::ArcSwap;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a [`ServerTls`]'s certificate comes from.
#[derive(Debug)]
enum Source {
    /// PEM files (`tls_cert`, `tls_key`), read again on reload.
    Files { cert: PathBuf, key: PathBuf },
    /// Generated at start ([`ServerTls::self_signed`]); a reload keeps it.
    SelfSigned,
}

/// The client-facing TLS configuration: where its certificate comes from, and the
/// configuration built from it, swapped whole on reload.
pub struct ServerTls {
    source: Source,
    current: ArcSwap<rustls::ServerConfig>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls").field("source", &self.source).finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Reads the PEM certificate chain at `cert` (leaf first) and the PEM private key at
    /// `key`.
    ///
    /// # Errors
    /// A file that cannot be read, holds no certificate or no key, or a key that does not
    /// match the certificate; the message names the file.
    pub fn load(cert: &Path, key: &Path) -> anyhow::Result<Arc<ServerTls>> {
        let config = server_config(cert, key)?;
        let source = Source::Files { cert: cert.to_path_buf(), key: key.to_path_buf() };
        Ok(Arc::new(ServerTls { source, current: ArcSwap::from_pointee(config) }))
    }

    /// A certificate generated now and signed by its own key (ECDSA P-256), for `names`
    /// (DNS names or IP addresses): what the Gateway API Inference Extension's reference
    /// endpoint picker serves when it is given no certificate, so a gateway set up to
    /// reach it over TLS without verifying the certificate (NGINX Gateway Fabric's
    /// default, Istio's `insecureSkipVerify`) reaches kvroute the same way.
    ///
    /// # Errors
    /// The key or certificate could not be generated.
    pub fn self_signed(names: Vec<String>) -> anyhow::Result<Arc<ServerTls>> {
        let made = rcgen::generate_simple_self_signed(names).context("a self-signed certificate")?;
        let key = PrivateKeyDer::Pkcs8(made.signing_key.serialize_der().into());
        let config = with_cert(vec![made.cert.der().clone()], key).context("a self-signed certificate")?;
        Ok(Arc::new(ServerTls { source: Source::SelfSigned, current: ArcSwap::from_pointee(config) }))
    }

    /// Reads the files again and, if they load, serves the new certificate to every
    /// handshake from now on (a self-signed certificate is kept).
    ///
    /// # Errors
    /// As [`ServerTls::load`]; the certificate in use is then kept.
    pub fn reload(&self) -> anyhow::Result<()> {
        if let Source::Files { cert, key } = &self.source {
            let config = server_config(cert, key)?;
            self.current.store(Arc::new(config));
        }
        Ok(())
    }

    /// An acceptor with the current configuration (one per connection: a reload affects
    /// the handshakes that start after it).
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.current.load_full())
    }
}

/// Builds a server configuration from the PEM files, ALPN `h2` then `http/1.1`.
fn server_config(cert: &Path, key: &Path) -> anyhow::Result<rustls::ServerConfig> {
    let chain = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("tls_cert {}", cert.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("tls_cert {}: not a PEM certificate chain", cert.display()))?;
    if chain.is_empty() {
        bail!("tls_cert {}: no CERTIFICATE block in the file", cert.display());
    }
    let key_der = PrivateKeyDer::from_pem_file(key).with_context(|| {
        format!("tls_key {}: no PEM private key (PKCS#8, PKCS#1 or SEC1) in the file", key.display())
    })?;
    with_cert(chain, key_der)
        .with_context(|| format!("tls_key {} does not fit tls_cert {}", key.display(), cert.display()))
}

/// A server configuration serving `chain` with `key`, ALPN `h2` then `http/1.1`.
///
/// # Errors
/// The key does not fit the certificate.
fn with_cert(chain: Vec<CertificateDer<'static>>, key: PrivateKeyDer<'static>) -> anyhow::Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// Reads a PEM bundle of CA certificates for `https://` workers.
///
/// # Errors
/// The file cannot be read or holds no certificate (message names the file).
pub fn worker_roots(path: &Path) -> anyhow::Result<Vec<reqwest::Certificate>> {
    let pem = std::fs::read(path).with_context(|| format!("worker_ca_file {}", path.display()))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem)
        .with_context(|| format!("worker_ca_file {}: not a PEM certificate bundle", path.display()))?;
    if certs.is_empty() {
        bail!("worker_ca_file {}: no CERTIFICATE block in the file", path.display());
    }
    Ok(certs)
}
