//! Who the peer is: the names its (verified) certificate carries. The
//! servers act on these, never on what a frame says.

use std::net::IpAddr;

use rustls::pki_types::{CertificateDer, ServerName};

/// A peer's identity: the DNS names (subject alternative names) of the
/// certificate it presented and the handshake verified.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Identity {
    names: Vec<String>,
    /// The peer's address, when its certificate names it (an IP SAN).
    ip: Option<IpAddr>,
}

impl Identity {
    /// The identity of `cert` (already verified by the handshake) for a
    /// peer connected from `peer`: its DNS names, and `peer` when the
    /// certificate is valid for that address. A certificate that does not
    /// parse has no names.
    pub fn of(cert: &CertificateDer<'_>, peer: Option<IpAddr>) -> Identity {
        let Ok(ee) = webpki::EndEntityCert::try_from(cert) else {
            return Identity::default();
        };
        let names = ee.valid_dns_names().map(str::to_owned).collect();
        let ip = peer.filter(|ip| {
            let name = ServerName::IpAddress((*ip).into());
            ee.verify_is_valid_for_subject_name(&name).is_ok()
        });
        Identity { names, ip }
    }

    /// An identity with these names and address (tests, plain links).
    pub fn new(names: Vec<String>, ip: Option<IpAddr>) -> Identity {
        Identity { names, ip }
    }

    /// The DNS names, in the certificate's order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The peer's address, when the certificate vouches for it.
    pub fn ip(&self) -> Option<IpAddr> {
        self.ip
    }

    /// Whether any name matches any of `patterns` (see
    /// [`lbagent_config::name_matches`]).
    pub fn matches_any(&self, patterns: &[String]) -> bool {
        self.names
            .iter()
            .any(|n| patterns.iter().any(|p| lbagent_config::name_matches(p, n)))
    }

    /// The name to log: the first DNS name, or the address, or `(no name)`.
    pub fn display_name(&self) -> String {
        match (self.names.first(), self.ip) {
            (Some(n), _) => n.clone(),
            (None, Some(ip)) => ip.to_string(),
            (None, None) => "(no name)".into(),
        }
    }
}
