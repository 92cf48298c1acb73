//! Certificates for tests (feature `testing`): a CA, and leaves it signs
//! with chosen names and validity, written as PEM files a `[tls]` table
//! names. Made with rcgen, so no test needs openssl.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair,
};

use super::TlsConfig;

/// A certificate authority.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// When a leaf is valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Validity {
    /// From 2020 to 2100.
    Now,
    /// From 2001 to 2002.
    Expired,
    /// From 2090 to 2100.
    NotYet,
}

impl TestCa {
    /// A new CA named `name`.
    pub fn new(name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.not_before = rcgen::date_time_ymd(2000, 1, 1);
        params.not_after = rcgen::date_time_ymd(2100, 1, 1);
        let key = KeyPair::generate().expect("a key");
        TestCa {
            issuer: CertifiedIssuer::self_signed(params, key).expect("a CA certificate"),
        }
    }

    /// The CA certificate, PEM.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A leaf certificate for `names` (DNS names or IP addresses), usable
    /// by a client and a server: `(certificate PEM, key PEM)`.
    pub fn leaf(&self, names: &[&str], validity: Validity) -> (String, String) {
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let mut params = CertificateParams::new(names).expect("valid names");
        let (from, to) = match validity {
            Validity::Now => ((2020, 1, 1), (2100, 1, 1)),
            Validity::Expired => ((2001, 1, 1), (2002, 1, 1)),
            Validity::NotYet => ((2090, 1, 1), (2100, 1, 1)),
        };
        params.not_before = rcgen::date_time_ymd(from.0, from.1, from.2);
        params.not_after = rcgen::date_time_ymd(to.0, to.1, to.2);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().expect("a key");
        let cert = params.signed_by(&key, &self.issuer).expect("a leaf");
        (cert.pem(), key.serialize_pem())
    }

    /// Writes a leaf for `names` and this CA as `<dir>/<stem>.pem`,
    /// `<stem>.key` and `<stem>-ca.pem`; returns the `[tls]` table naming
    /// them (the other fields default).
    pub fn write(&self, dir: &Path, stem: &str, names: &[&str], validity: Validity) -> TlsConfig {
        let (cert, key) = self.leaf(names, validity);
        let path = |ext: &str| -> PathBuf { dir.join(format!("{stem}{ext}")) };
        std::fs::write(path(".pem"), cert).expect("write the certificate");
        std::fs::write(path(".key"), key).expect("write the key");
        std::fs::write(path("-ca.pem"), self.pem()).expect("write the CA");
        TlsConfig {
            cert: path(".pem"),
            key: path(".key"),
            ca: path("-ca.pem"),
            ..TlsConfig::default()
        }
    }
}
