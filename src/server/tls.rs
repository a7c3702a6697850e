//! TLS with rustls (the ring provider): the listener's certificate, and the
//! trust roots for `https://` upstreams.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::ring;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

use crate::config::TlsConfig;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{field}: cannot read certificates from {path}")]
    Certificates {
        field: &'static str,
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("{field}: {path} holds no certificate")]
    NoCertificate { field: &'static str, path: PathBuf },
    #[error(
        "server.tls.key: cannot read a private key from {path} (an unencrypted PEM key: PKCS#8, PKCS#1 or SEC1; decrypt an encrypted one first)"
    )]
    Key {
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("server.tls.key: the key {key} does not fit the certificate {cert}")]
    Mismatch {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("upstream.ca: a certificate in {path} is not a valid trust root")]
    Root {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
}

/// The certificates of the PEM file `path`, which the configuration's
/// `field` names.
fn certificates(field: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|source| TlsError::Certificates {
            field,
            path: path.to_path_buf(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            field,
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

/// The listener's TLS: the certificate chain and key of `config`, HTTP/2
/// and HTTP/1.1 offered by ALPN.
pub fn acceptor(config: &TlsConfig) -> Result<TlsAcceptor, TlsError> {
    let chain = certificates("server.tls.cert", &config.cert)?;
    let key = PrivateKeyDer::from_pem_file(&config.key).map_err(|source| TlsError::Key {
        path: config.key.clone(),
        source,
    })?;
    let provider = Arc::new(ring::default_provider());
    // Checks that the key belongs to the chain's first certificate.
    let mut server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|source| TlsError::Mismatch {
            cert: config.cert.clone(),
            key: config.key.clone(),
            source,
        })?;
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(server)))
}

/// Trust for `https://` upstreams: the webpki roots, plus `ca` if given.
pub fn client_config(ca: Option<&Path>) -> Result<rustls::ClientConfig, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca {
        for cert in certificates("upstream.ca", path)? {
            roots.add(cert).map_err(|source| TlsError::Root {
                path: path.to_path_buf(),
                source,
            })?;
        }
    }
    let provider = Arc::new(ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth())
}
