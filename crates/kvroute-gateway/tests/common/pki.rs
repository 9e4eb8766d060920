//! Test certificates: a private CA and server certificates it signs, written as PEM files
//! (rcgen; ECDSA P-256 keys), for the TLS tests of the gateway and of `kvroute serve`.

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use std::path::{Path, PathBuf};

/// A certificate authority that signs server certificates.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl TestCa {
    /// A new self-signed CA named `name`.
    pub fn new(name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().expect("CA key");
        TestCa { issuer: CertifiedIssuer::self_signed(params, key).expect("CA certificate") }
    }

    /// The CA's certificate, PEM.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// Writes the CA's certificate to `dir/NAME`; returns the path.
    #[allow(dead_code)] // not every test that includes this file writes the CA
    pub fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, self.pem()).expect("write CA");
        p
    }

    /// A server certificate for `localhost` and `127.0.0.1` signed by this CA, written as
    /// `dir/STEM.crt` (the chain: leaf then CA) and `dir/STEM.key`; returns both paths.
    pub fn server_cert(&self, dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
        let params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).expect("server params");
        let key = KeyPair::generate().expect("server key");
        let cert = params.signed_by(&key, &self.issuer).expect("server certificate");
        let (crt, keyp) = (dir.join(format!("{stem}.crt")), dir.join(format!("{stem}.key")));
        std::fs::write(&crt, format!("{}{}", cert.pem(), self.pem())).expect("write certificate");
        std::fs::write(&keyp, key.serialize_pem()).expect("write key");
        (crt, keyp)
    }
}

/// A client that trusts only `ca` (no system roots).
#[allow(dead_code)] // not every test that includes this file uses reqwest over TLS
pub fn client_trusting(ca: &TestCa, http1_only: bool) -> reqwest::Client {
    let cert = reqwest::Certificate::from_pem(ca.pem().as_bytes()).expect("CA pem");
    let b = reqwest::Client::builder().tls_certs_only([cert]);
    let b = if http1_only { b.http1_only() } else { b };
    b.build().expect("client")
}

/// A fresh temporary directory `TMP/kvroute-TAG-XXXXXX`, removed when the guard drops (also
/// on a panic).
pub fn scratch_dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("kvroute-{tag}-")).tempdir().expect("temp dir")
}
