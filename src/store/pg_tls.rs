//! TLS to PostgreSQL, as the URL's `sslmode` asks, through rustls (the
//! ring provider; no OpenSSL).
//!
//! The `postgres` crate knows `sslmode` `disable`, `prefer` and `require`
//! only, and no `sslrootcert`/`sslcert`/`sslkey` (it refuses the URL). [`split`] takes these out
//! of the URL (giving the crate `sslmode=require` for the two `verify-`
//! modes, so that it never falls back to plain TCP) and [`PgTls::connector`]
//! builds the rustls client that the meaning of each mode needs, following
//! libpq:
//!
//! - `disable`, `prefer` (the default): plain TCP, as before TLS was built
//!   (libpq's `prefer` would try TLS without verifying anything, which
//!   protects from nothing an active attacker does).
//! - `require`: TLS, the server's certificate not verified (encryption
//!   without authentication; a warning at start), unless `sslrootcert=`
//!   is given, which makes it `verify-ca` (as in libpq).
//! - `verify-ca`: TLS, the server's certificate chain checked against
//!   `sslrootcert=`, its names not.
//! - `verify-full`: TLS, the chain checked and the certificate must name
//!   the host of the URL.
//!
//! `sslcert=` and `sslkey=` (both or neither) give a client certificate
//! for PostgreSQL's `cert` authentication.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, CONTROLS};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

/// How the server is verified, from the URL's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `disable` or `prefer` (the default): plain TCP.
    Plain,
    /// `require` without `sslrootcert=`: TLS, nothing verified.
    EncryptOnly,
    /// `verify-ca` (or `require` with `sslrootcert=`): the chain.
    VerifyCa,
    /// `verify-full`: the chain and the host name.
    VerifyFull,
}

/// The TLS parameters of one PostgreSQL URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PgTls {
    /// How the server is verified.
    pub(crate) mode: Mode,
    /// `sslrootcert=`: the CA bundle (PEM) that signs the server's
    /// certificate.
    pub(crate) root_cert: Option<PathBuf>,
    /// `sslcert=`: this client's certificate chain (PEM).
    pub(crate) cert: Option<PathBuf>,
    /// `sslkey=`: this client's private key (PEM).
    pub(crate) key: Option<PathBuf>,
}

/// The parameters this module handles (the crate refuses them).
const OURS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

/// Splits a `postgres://` URL (the only form the config takes, see
/// `StoreUrl`) into the URL for the `postgres` crate and its TLS
/// parameters; an error names the parameter that is wrong.
pub(crate) fn split(url: &str) -> Result<(String, PgTls), String> {
    let (rest, params) = split_url(url);
    let mut tls = PgTls {
        mode: Mode::Plain,
        root_cert: None,
        cert: None,
        key: None,
    };
    let mut crate_mode = None;
    for (key, value) in params {
        match key.as_str() {
            "sslmode" => {
                let (mode, for_crate) = match value.as_str() {
                    "disable" => (Mode::Plain, "disable"),
                    "prefer" => (Mode::Plain, "prefer"),
                    "require" => (Mode::EncryptOnly, "require"),
                    "verify-ca" => (Mode::VerifyCa, "require"),
                    "verify-full" => (Mode::VerifyFull, "require"),
                    other => {
                        return Err(format!(
                            "sslmode={other} is not known: use disable, prefer, require, \
                             verify-ca or verify-full"
                        ))
                    }
                };
                tls.mode = mode;
                crate_mode = Some(for_crate);
            }
            "sslrootcert" => tls.root_cert = Some(path_of("sslrootcert", &value)?),
            "sslcert" => tls.cert = Some(path_of("sslcert", &value)?),
            "sslkey" => tls.key = Some(path_of("sslkey", &value)?),
            _ => unreachable!("only OURS are split out"),
        }
    }
    if tls.mode == Mode::EncryptOnly && tls.root_cert.is_some() {
        tls.mode = Mode::VerifyCa;
    }
    if matches!(tls.mode, Mode::VerifyCa | Mode::VerifyFull) && tls.root_cert.is_none() {
        return Err(
            "sslmode=verify-ca and verify-full need sslrootcert=<the CA bundle (PEM) that signs \
             the server's certificate>"
                .into(),
        );
    }
    if tls.cert.is_some() != tls.key.is_some() {
        return Err(
            "sslcert= and sslkey= go together: give both (a client certificate for \
                    PostgreSQL's cert authentication) or neither"
                .into(),
        );
    }
    if tls.mode == Mode::Plain && (tls.cert.is_some() || tls.root_cert.is_some()) {
        return Err(
            "sslrootcert=/sslcert= are given but TLS is off: add sslmode=verify-full (or \
             verify-ca, require)"
                .into(),
        );
    }
    let text = match crate_mode {
        None => rest,
        Some(m) => join(&rest, &format!("sslmode={m}")),
    };
    Ok((text, tls))
}

/// Characters percent-encoded in a path put into a URL's query.
const QUERY_VALUE: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'#')
    .add(b'%')
    .add(b'&')
    .add(b'+')
    .add(b'=')
    .add(b'?');

/// `url` with `sslrootcert=ca` added when its `sslmode` is `verify-ca` or
/// `verify-full` and it names no `sslrootcert=`: the `[tls] ca` of our
/// configuration as the default CA bundle. Other URLs (plain, `require`,
/// an explicit `sslrootcert=`) are returned unchanged.
pub(crate) fn with_default_ca(url: &str, ca: &Path) -> String {
    let (_, params) = split_url(url);
    let verify = params
        .iter()
        .any(|(k, v)| k == "sslmode" && matches!(v.as_str(), "verify-ca" | "verify-full"));
    if !verify || params.iter().any(|(k, _)| k == "sslrootcert") {
        return url.to_string();
    }
    let ca = ca.to_string_lossy();
    join(
        url,
        &format!("sslrootcert={}", utf8_percent_encode(&ca, QUERY_VALUE)),
    )
}

/// A parameter's value as a path: not empty.
fn path_of(key: &str, value: &str) -> Result<PathBuf, String> {
    if value.is_empty() {
        return Err(format!("{key}= is empty: give the path of a PEM file"));
    }
    Ok(PathBuf::from(value))
}

/// The URL `rest` with `param` added to its query.
fn join(rest: &str, param: &str) -> String {
    if rest.contains('?') {
        if rest.ends_with('?') {
            format!("{rest}{param}")
        } else {
            format!("{rest}&{param}")
        }
    } else {
        format!("{rest}?{param}")
    }
}

/// A URL without [`OURS`] in its query, and their decoded values.
fn split_url(url: &str) -> (String, Vec<(String, String)>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_string(), Vec::new());
    };
    let mut kept = Vec::new();
    let mut ours = Vec::new();
    for pair in query.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let key = percent_decode_str(k).decode_utf8_lossy().into_owned();
        if OURS.contains(&key.as_str()) {
            ours.push((key, percent_decode_str(v).decode_utf8_lossy().into_owned()));
        } else {
            kept.push(pair);
        }
    }
    let text = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    (text, ours)
}

impl PgTls {
    /// The rustls connector for this mode; `None` for plain TCP. Reads the
    /// PEM files; an error names the file and what is wrong with it.
    pub(crate) fn connector(&self) -> Result<Option<MakeRustlsConnect>, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier: Arc<dyn ServerCertVerifier> = match self.mode {
            Mode::Plain => return Ok(None),
            Mode::EncryptOnly => Arc::new(NoVerifier(provider.clone())),
            Mode::VerifyCa | Mode::VerifyFull => {
                let path = self.root_cert.as_deref().expect("checked by split");
                let mut roots = RootCertStore::empty();
                for cert in certs("sslrootcert", path)? {
                    roots.add(cert).map_err(|e| {
                        format!(
                            "sslrootcert {}: not a usable CA certificate: {e}",
                            path.display()
                        )
                    })?;
                }
                let webpki =
                    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                        .build()
                        .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
                if self.mode == Mode::VerifyFull {
                    webpki
                } else {
                    Arc::new(ChainOnly(webpki))
                }
            }
        };
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("cannot set up TLS: {e}"))?
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let config = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let chain = certs("sslcert", cert)?;
                let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| {
                    format!("sslkey {}: cannot read a private key: {e}", key.display())
                })?;
                builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                    format!(
                        "sslcert {} and sslkey {} do not make a client certificate: {e}",
                        cert.display(),
                        key.display()
                    )
                })?
            }
            _ => builder.with_no_client_auth(),
        };
        Ok(Some(MakeRustlsConnect::new(config)))
    }

    /// What a failed connection's error means for TLS, and what to do;
    /// `None` when it is not about TLS.
    pub(crate) fn explain(&self, e: &(dyn std::error::Error + 'static)) -> Option<String> {
        let mut cause = Some(e);
        while let Some(c) = cause {
            if let Some(r) = rustls_error(c) {
                return Some(self.explain_rustls(r));
            }
            if c.to_string()
                .contains("requires a valid client certificate")
            {
                return Some(
                    "the server asks for a client certificate (cert authentication): give \
                     sslcert= and sslkey=, a certificate whose CN is the user, signed by a CA in \
                     the server's ssl_ca_file"
                        .into(),
                );
            }
            if self.mode != Mode::Plain && c.to_string().contains("server does not support TLS") {
                return Some(
                    "the server does not speak TLS: turn `ssl = on` in its postgresql.conf \
                     (with ssl_cert_file and ssl_key_file)"
                        .into(),
                );
            }
            cause = c.source();
        }
        None
    }

    fn explain_rustls(&self, e: &rustls::Error) -> String {
        let ca = self
            .root_cert
            .as_deref()
            .map_or_else(|| "sslrootcert".into(), |p| p.display().to_string());
        use CertificateError as C;
        match e {
            rustls::Error::InvalidCertificate(C::UnknownIssuer | C::BadSignature) => format!(
                "TLS: the server's certificate is not signed by a CA in {ca} (unknown CA): give \
                 the CA that signs it with sslrootcert="
            ),
            rustls::Error::InvalidCertificate(
                C::NotValidForName | C::NotValidForNameContext { .. },
            ) => format!(
                "TLS: the server's certificate does not name the host connected to ({e}): \
                 connect by a name the certificate carries, or give the server a certificate \
                 for this name"
            ),
            rustls::Error::InvalidCertificate(C::Expired | C::ExpiredContext { .. }) => {
                "TLS: the server's certificate has expired: renew it (or check this host's \
                 clock)"
                    .into()
            }
            rustls::Error::InvalidCertificate(C::NotValidYet | C::NotValidYetContext { .. }) => {
                "TLS: the server's certificate is not valid yet: check this host's clock".into()
            }
            rustls::Error::AlertReceived(alert) => format!(
                "TLS handshake refused by the server (alert {alert:?}): if it asks for a client \
                 certificate, give sslcert= and sslkey= signed by the CA it trusts"
            ),
            other => format!("TLS handshake with the server failed: {other}"),
        }
    }
}

/// `c` as a rustls error, directly or inside an `io::Error` (whose
/// `source` skips the error it wraps).
fn rustls_error<'a>(c: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    if let Some(r) = c.downcast_ref::<rustls::Error>() {
        return Some(r);
    }
    c.downcast_ref::<std::io::Error>()
        .and_then(|io| io.get_ref())
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
}

/// The certificates of a PEM file, at least one.
fn certs(what: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{what} {}: cannot read certificates: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{what} {}: no certificate (-----BEGIN CERTIFICATE-----) in it",
            path.display()
        ));
    }
    Ok(certs)
}

/// `verify-ca`: the chain checked by webpki, the name not (webpki checks
/// the name last, so a name error means the chain was good).
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `require` without a CA: any certificate accepted (libpq's meaning),
/// the handshake's signatures still checked.
#[derive(Debug)]
struct NoVerifier(Arc<CryptoProvider>);

impl ServerCertVerifier for NoVerifier {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_full_in_a_url_becomes_require_for_the_crate() {
        let (text, tls) =
            split("postgres://u:p@h:5432/db?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x")
                .unwrap();
        assert_eq!(
            text,
            "postgres://u:p@h:5432/db?application_name=x&sslmode=require"
        );
        assert_eq!(tls.mode, Mode::VerifyFull);
        assert_eq!(tls.root_cert.as_deref(), Some(Path::new("/etc/ca.pem")));
    }

    #[test]
    fn a_url_without_tls_parameters_is_unchanged() {
        let url = "postgresql://u@h/db?connect_timeout=3";
        let (text, tls) = split(url).unwrap();
        assert_eq!(text, url);
        assert_eq!(tls.mode, Mode::Plain);
        assert_eq!(split("postgres://h/db").unwrap().0, "postgres://h/db");
    }

    #[test]
    fn the_configs_ca_is_the_default_for_the_verify_modes_only() {
        let ca = Path::new("/etc/lbagent/tls/ca & 100%.pem");
        let url = with_default_ca("postgres://h/db?sslmode=verify-full", ca);
        assert_eq!(
            url,
            "postgres://h/db?sslmode=verify-full&sslrootcert=/etc/lbagent/tls/ca%20%26%20100%25.pem"
        );
        let (_, tls) = split(&url).unwrap();
        assert_eq!(tls.root_cert.as_deref(), Some(ca));
        for kept in [
            "postgres://h/db",
            "postgres://h/db?sslmode=require",
            "postgres://h/db?sslmode=verify-ca&sslrootcert=/pg-ca.pem",
        ] {
            assert_eq!(with_default_ca(kept, ca), kept);
        }
    }

    #[test]
    fn require_with_a_ca_verifies_the_chain_as_libpq_does() {
        let (_, tls) = split("postgres://h/db?sslmode=require").unwrap();
        assert_eq!(tls.mode, Mode::EncryptOnly);
        let (_, tls) = split("postgres://h/db?sslmode=require&sslrootcert=/ca.pem").unwrap();
        assert_eq!(tls.mode, Mode::VerifyCa);
    }

    #[test]
    fn wrong_tls_parameters_are_named() {
        let e = split("postgres://h/db?sslmode=verify-full").unwrap_err();
        assert!(e.contains("need sslrootcert="), "{e}");
        let e = split("postgres://h/db?sslmode=allow").unwrap_err();
        assert!(e.contains("sslmode=allow is not known"), "{e}");
        let e = split("postgres://h/db?sslmode=require&sslcert=/c.pem").unwrap_err();
        assert!(e.contains("sslcert= and sslkey= go together"), "{e}");
        let e = split("postgres://h/db?sslrootcert=/ca.pem").unwrap_err();
        assert!(e.contains("TLS is off"), "{e}");
        let e = split("postgres://h/db?sslmode=verify-ca&sslrootcert=").unwrap_err();
        assert!(e.contains("sslrootcert= is empty"), "{e}");
    }

    #[test]
    fn a_missing_or_empty_ca_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("none.pem");
        let (_, tls) = split(&format!(
            "postgres://h/db?sslmode=verify-full&sslrootcert={}",
            missing.display()
        ))
        .unwrap();
        let e = tls.connector().err().unwrap();
        assert!(
            e.starts_with(&format!("sslrootcert {}", missing.display())),
            "{e}"
        );
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let (_, tls) = split(&format!(
            "postgres://h/db?sslmode=verify-full&sslrootcert={}",
            empty.display()
        ))
        .unwrap();
        let e = tls.connector().err().unwrap();
        assert!(e.contains("no certificate"), "{e}");
    }
}
