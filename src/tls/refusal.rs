//! Why a handshake failed, in one line an operator can act on: the
//! certificate expired, is not valid yet, was signed by another CA, names
//! another host; the peer spoke plain TCP; or it timed out. Pure over the
//! error rustls gave.

use std::io;

use rustls::{AlertDescription, CertificateError, Error};

use super::NotAPeer;

/// Whose certificate an error is about, for the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// We are the server: the error is about the client's certificate.
    Server,
    /// We are the client: the error is about the server's certificate.
    Client,
}

/// The one-line reason for a failed handshake `e` (an I/O error that may
/// wrap a [`rustls::Error`]).
pub fn why(e: &io::Error, side: Side) -> String {
    match e.get_ref().and_then(|inner| inner.downcast_ref::<Error>()) {
        Some(tls) => why_tls(tls, side),
        None if e.kind() == io::ErrorKind::UnexpectedEof => {
            "the peer closed the connection during the TLS handshake".into()
        }
        None => format!("I/O error during the TLS handshake: {e}"),
    }
}

/// The one-line reason for `e`.
pub fn why_tls(e: &Error, side: Side) -> String {
    let whose = match side {
        Side::Server => "the client's certificate",
        Side::Client => "the server's certificate",
    };
    match e {
        Error::InvalidCertificate(c) => format!("{whose} {}", certificate(c)),
        Error::NoCertificatesPresented => {
            "the client presented no certificate: mutual TLS needs one (tls.cert, tls.key)".into()
        }
        Error::InvalidMessage(_) | Error::InappropriateMessage { .. } => {
            "not TLS: the peer spoke plain TCP or another protocol (is its [tls] off?)".into()
        }
        Error::AlertReceived(alert) => {
            format!("the peer refused the handshake: {}", alert_reason(*alert))
        }
        other => format!("TLS error: {other}"),
    }
}

fn certificate(c: &CertificateError) -> String {
    match c {
        CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
            "has expired: renew it".into()
        }
        CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
            "is not valid yet (its notBefore is in the future: check the clocks)".into()
        }
        CertificateError::UnknownIssuer => {
            "was not signed by the CA in tls.ca (wrong CA)".into()
        }
        CertificateError::BadSignature => "has a bad signature".into(),
        CertificateError::NotValidForName => "is not valid for the expected name".into(),
        CertificateError::NotValidForNameContext {
            expected,
            presented,
        } => format!(
            "is not valid for the expected name {expected:?}: it names {presented:?} (wrong name; see tls.server_name)"
        ),
        CertificateError::Revoked => "has been revoked".into(),
        CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => {
            "is not for this use (its extended key usage)".into()
        }
        CertificateError::Other(other) => match other.0.downcast_ref::<NotAPeer>() {
            Some(refused) => format!("is refused (wrong name): {refused}"),
            None => format!("is invalid: {other}"),
        },
        other => format!("is invalid: {other:?}"),
    }
}

fn alert_reason(alert: AlertDescription) -> String {
    match alert {
        AlertDescription::CertificateExpired => "our certificate has expired".into(),
        AlertDescription::UnknownCA => "our certificate is not of its CA".into(),
        AlertDescription::BadCertificate
        | AlertDescription::AccessDenied
        | AlertDescription::CertificateUnknown => {
            "it does not accept our certificate (its name, or its CA)".into()
        }
        AlertDescription::CertificateRequired => "it requires a certificate".into(),
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_refusal_names_why() {
        let s = Side::Server;
        let line = |c| why_tls(&Error::InvalidCertificate(c), s);
        assert!(line(CertificateError::Expired).contains("expired"));
        assert!(line(CertificateError::NotValidYet).contains("not valid yet"));
        assert!(line(CertificateError::UnknownIssuer).contains("wrong CA"));
        let plain = io::Error::new(
            io::ErrorKind::InvalidData,
            Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType),
        );
        assert!(why(&plain, s).contains("plain TCP"));
        let refused = NotAPeer {
            names: vec!["x.other".into()],
            allowed: vec!["*.fleet".into()],
        };
        let other = CertificateError::Other(rustls::OtherError(std::sync::Arc::new(refused)));
        assert!(line(other).contains("wrong name"));
    }
}
