//! The PEM files named in `[tls]`, read into what rustls takes, each error
//! naming the file and what to do. Uses rustls' own PEM reader
//! (`rustls-pki-types`), so no other parser is involved.

use std::path::{Path, PathBuf};

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::RootCertStore;

/// Why the TLS files cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsFileError {
    /// A file could not be read or holds no PEM block of the kind needed.
    #[error("cannot use {what} {path}: {reason}")]
    File {
        /// Which file (`tls.cert`, `tls.key`, `tls.ca`).
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// What is wrong and what to do.
        reason: String,
    },
    /// rustls refused the files together (a key that does not match the
    /// certificate, a CA bundle it cannot use).
    #[error("cannot use the TLS files ({cert}, {key}, {ca}): {reason}")]
    Refused {
        /// `tls.cert`.
        cert: PathBuf,
        /// `tls.key`.
        key: PathBuf,
        /// `tls.ca`.
        ca: PathBuf,
        /// What rustls said.
        reason: String,
    },
}

fn file_error(what: &'static str, path: &Path, reason: impl Into<String>) -> TlsFileError {
    TlsFileError::File {
        what,
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The most bytes a PEM file is read for (a CA bundle of a few hundred
/// certificates fits).
pub const MAX_PEM_LEN: u64 = 4 << 20;

/// The bytes of PEM file `path` (`what`: which of `[tls]`), read without
/// blocking: a FIFO or a device there is refused at once, never waited on
/// (a reload or a handshake would stall, and SIGTERM with it).
fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsFileError> {
    lbagent_config::read_regular_bytes(path, MAX_PEM_LEN)
        .map_err(|e| file_error(what, path, e.to_string()))
}

fn pem_reason(e: pem::Error) -> String {
    match e {
        pem::Error::Io(e) => format!("{e}"),
        pem::Error::NoItemsFound => "no PEM block of the expected kind in it".into(),
        other => format!("not valid PEM ({other:?})"),
    }
}

/// The certificate chain in `path` (`what`: its config field), leaf first.
///
/// # Errors
/// [`TlsFileError::File`]: unreadable, not PEM, or no CERTIFICATE block.
pub fn certs(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    let bytes = read(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(what, path, pem_reason(e)))?;
    if certs.is_empty() {
        return Err(file_error(
            what,
            path,
            "no CERTIFICATE block in it: give a PEM certificate file",
        ));
    }
    Ok(certs)
}

/// The private key in `path` (`tls.key`).
///
/// # Errors
/// [`TlsFileError::File`]: unreadable or no private key block.
pub fn key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsFileError> {
    let bytes = read("tls.key", path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| {
        let reason = match e {
            pem::Error::NoItemsFound => {
                "no PRIVATE KEY block in it (PKCS#8, RSA or EC): give the key of tls.cert".into()
            }
            other => pem_reason(other),
        };
        file_error("tls.key", path, reason)
    })
}

/// The CA certificates in `path` (`tls.ca`) as a root store.
///
/// # Errors
/// [`TlsFileError::File`]: unreadable, no certificate, or one that is not a
/// usable trust anchor.
pub fn roots(path: &Path) -> Result<RootCertStore, TlsFileError> {
    let mut roots = RootCertStore::empty();
    for cert in certs("tls.ca", path)? {
        roots
            .add(cert)
            .map_err(|e| file_error("tls.ca", path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(roots)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_is_refused_at_once_never_waited_on() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("ca.pem");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        // Without a writer, a blocking open would never return.
        let e = roots(&fifo).unwrap_err().to_string();
        let k = key(&fifo).unwrap_err().to_string();
        assert!(e.contains("tls.ca") && e.contains("FIFO"), "{e}");
        assert!(k.contains("tls.key") && k.contains("FIFO"), "{k}");
    }
}
