//! The servers' check of a client certificate: the CA's (rustls' webpki
//! verifier: chain, validity period, key usage), then the names
//! (`tls.peer_names`), so that a certificate of the right CA but the wrong
//! identity is refused in the handshake itself, with an alert the client
//! sees.

use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, OtherError};

use super::Identity;

/// A client certificate the CA signed whose names match none of
/// `tls.peer_names`.
#[derive(Debug, thiserror::Error)]
#[error("its certificate names {names:?}, none of tls.peer_names {allowed:?}")]
pub struct NotAPeer {
    /// The certificate's DNS names.
    pub names: Vec<String>,
    /// `tls.peer_names`.
    pub allowed: Vec<String>,
}

/// The CA's verifier, then the name check (none when `peer_names` is
/// empty).
#[derive(Debug)]
pub(crate) struct PeerNames {
    pub(crate) inner: Arc<dyn ClientCertVerifier>,
    pub(crate) peer_names: Vec<String>,
}

impl ClientCertVerifier for PeerNames {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        if self.peer_names.is_empty() {
            return Ok(verified);
        }
        let identity = Identity::of(end_entity, None);
        if identity.matches_any(&self.peer_names) {
            return Ok(verified);
        }
        let refused = NotAPeer {
            names: identity.names().to_vec(),
            allowed: self.peer_names.clone(),
        };
        Err(rustls::Error::InvalidCertificate(CertificateError::Other(
            OtherError(Arc::new(refused)),
        )))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}
