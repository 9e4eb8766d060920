//! TLS with rustls: HTTPS for clients (`tls_cert`, `tls_key`, read again on SIGHUP) and the
//! trust roots for `https://` workers (`worker_ca_file`).
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

/// The client-facing TLS configuration: the certificate and key files, and the
/// configuration built from them, swapped whole on reload.
pub struct ServerTls {
    cert: PathBuf,
    key: PathBuf,
    current: ArcSwap<rustls::ServerConfig>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls").field("cert", &self.cert).field("key", &self.key).finish_non_exhaustive()
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
        Ok(Arc::new(ServerTls {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            current: ArcSwap::from_pointee(config),
        }))
    }

    /// Reads both files again and, if they load, serves the new certificate to every
    /// handshake from now on.
    ///
    /// # Errors
    /// As [`ServerTls::load`]; the certificate in use is then kept.
    pub fn reload(&self) -> anyhow::Result<()> {
        let config = server_config(&self.cert, &self.key)?;
        self.current.store(Arc::new(config));
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
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .with_context(|| format!("tls_key {} does not fit tls_cert {}", key.display(), cert.display()))?;
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
