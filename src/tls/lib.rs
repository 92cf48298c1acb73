//! Mutual TLS between hosts (issue 26): the agent's route and statistics
//! clients and the route server's and reporter's listeners speak TLS 1.2 /
//! 1.3 (rustls with the `ring` provider; no OpenSSL), each side presenting
//! a certificate of the fleet's CA and verifying the other's.
//!
//! - [`Tls`] holds `[tls]` and the rustls configurations built from its
//!   PEM files; [`Tls::refresh`] (called at every new connection) re-reads
//!   the files when they changed, and [`Tls::reload`] (SIGHUP) at once.
//!   A connection keeps the configuration it started with: a rotation
//!   drops nothing, and files that do not load are logged and the previous
//!   ones kept.
//! - [`accept`] and [`connect`] turn a TCP connection into a [`Stream`]
//!   (plain when TLS is off); a refused handshake comes back as one line
//!   naming why ([`refusal`]).
//! - The server side learns the peer's [`Identity`] (its certificate's DNS
//!   names, and its address when the certificate names it): the reporter
//!   stamps rows with it and checks it against `tls.consume_allow`; both
//!   servers accept only `tls.peer_names` ([`verify`]).
//!
//! Owns no protocol and no socket of its own: the shells hand it their
//! TCP connections. The client library does not depend on it.
//!
//! # Layout
//!
//! - this file: [`Tls`], [`accept`], [`connect`].
//! - [`pem`]: the PEM files read. [`identity`]: who the peer is.
//! - [`verify`]: the servers' name check. [`refusal`]: why a handshake
//!   failed, in one line. [`stream`]: plain or TLS as one stream.
//! - [`throttle`]: one log line per peer per minute.
//! - `testing` (feature `testing`): a CA and certificates for tests.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod identity;
pub mod pem;
pub mod refusal;
pub mod stream;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod throttle;
pub mod verify;

use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_lite::future;
use glommio::net::TcpStream;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::ServerName;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ServerConfig};

pub use identity::Identity;
pub use lbagent_config::TlsConfig;
pub use pem::TlsFileError;
pub use refusal::Side;
pub use stream::{send, Stream};
pub use throttle::PerPeer;
pub use verify::NotAPeer;

/// How often a refusal of one peer is logged at most (once a minute).
pub const REFUSAL_LOG_MS: u64 = 60_000;

/// How long a server waits for a client's handshake before closing it.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What identifies a version of the three files: device, inode, size and
/// modification time of each (a rename or a rewrite changes it).
type Stamp = [(u64, u64, u64, i64, i64); 3];

fn stamp(cfg: &TlsConfig) -> Option<Stamp> {
    let one = |p: &Path| {
        std::fs::metadata(p)
            .ok()
            .map(|m| (m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
    };
    Some([one(&cfg.cert)?, one(&cfg.key)?, one(&cfg.ca)?])
}

/// The rustls configurations built from one version of the files.
#[derive(Clone)]
struct Configs {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

struct State {
    stamp: Option<Stamp>,
    configs: Configs,
    /// The version that failed to load (logged once, not retried).
    failed: Option<Stamp>,
}

/// `[tls]` and the configurations built from its files, shared by every
/// connection of a process (threads included).
pub struct Tls {
    cfg: TlsConfig,
    state: Mutex<State>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn build(cfg: &TlsConfig) -> Result<Configs, TlsFileError> {
    let chain = pem::certs("tls.cert", &cfg.cert)?;
    let key = pem::key(&cfg.key)?;
    let roots = Arc::new(pem::roots(&cfg.ca)?);
    let refused = |reason: String| TlsFileError::Refused {
        cert: cfg.cert.clone(),
        key: cfg.key.clone(),
        ca: cfg.ca.clone(),
        reason,
    };
    let inner = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
        .build()
        .map_err(|e| refused(format!("{e}")))?;
    let verifier = Arc::new(verify::PeerNames {
        inner,
        peer_names: cfg.peer_names.clone(),
    });
    let server = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| refused(format!("{e}")))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| refused(format!("{e} (does tls.key belong to tls.cert?)")))?;
    let client = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| refused(format!("{e}")))?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| refused(format!("{e} (does tls.key belong to tls.cert?)")))?;
    Ok(Configs {
        server: Arc::new(server),
        client: Arc::new(client),
    })
}

impl Tls {
    /// Reads the files `cfg` names.
    ///
    /// # Errors
    /// [`TlsFileError`] naming the file and what is wrong.
    pub fn load(cfg: &TlsConfig) -> Result<Arc<Tls>, TlsFileError> {
        let stamp = stamp(cfg);
        let configs = build(cfg)?;
        Ok(Arc::new(Tls {
            cfg: cfg.clone(),
            state: Mutex::new(State {
                stamp,
                configs,
                failed: None,
            }),
        }))
    }

    /// [`Tls::load`] when `cfg` turns TLS on; `None` when it is off, with
    /// a warning for `service` when `tls.insecure` allows plain TCP
    /// between hosts.
    ///
    /// # Errors
    /// As [`Tls::load`].
    pub fn from_config(cfg: &TlsConfig, service: &str) -> Result<Option<Arc<Tls>>, TlsFileError> {
        if cfg.enabled() {
            return Tls::load(cfg).map(Some);
        }
        if cfg.insecure {
            tracing::warn!(
                "{service}: tls.insecure = true and no tls.cert: plain TCP between hosts, unauthenticated; any host that reaches the port can read and write routes and statistics"
            );
        }
        Ok(None)
    }

    /// The `[tls]` table it was built from.
    pub fn config(&self) -> &TlsConfig {
        &self.cfg
    }

    /// Re-reads the files if they changed since the last read (a stat of
    /// each; cheap enough for every new connection). A version that does
    /// not load is logged once and the previous one kept.
    pub fn refresh(&self) {
        self.reread(false);
    }

    /// Re-reads the files now (SIGHUP), whether or not they look changed.
    pub fn reload(&self) {
        self.reread(true);
    }

    fn reread(&self, force: bool) {
        let now = stamp(&self.cfg);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if !force && (now == state.stamp || (now.is_some() && now == state.failed)) {
            return;
        }
        match build(&self.cfg) {
            Ok(configs) => {
                state.configs = configs;
                state.stamp = now;
                state.failed = None;
                tracing::info!(
                    "read the TLS files again ({}, {}, {}): new connections use them",
                    self.cfg.cert.display(),
                    self.cfg.key.display(),
                    self.cfg.ca.display()
                );
            }
            Err(e) => {
                if state.failed != now || force {
                    tracing::warn!("{e}; keeping the previous TLS files until they load");
                }
                state.failed = now;
            }
        }
    }

    fn configs(&self) -> Configs {
        self.refresh();
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.configs.clone()
    }

    /// The client configuration of the files now (for a client of its
    /// own, such as a test's blocking rustls stream).
    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.configs().client
    }

    /// The server configuration of the files now.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.configs().server
    }

    /// Whether `identity` may consume capacity units (`tls.consume_allow`).
    pub fn may_consume(&self, identity: &Identity) -> bool {
        identity.matches_any(&self.cfg.consume_allow)
    }
}

/// A process's [`Tls`], or none (TLS off), as a value a client's settings
/// can hold: equal when both are off or both are the same [`Tls`].
#[derive(Clone, Debug, Default)]
pub struct TlsHandle(pub Option<Arc<Tls>>);

impl PartialEq for TlsHandle {
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Eq for TlsHandle {}

impl TlsHandle {
    /// The [`Tls`], if on.
    pub fn get(&self) -> Option<&Tls> {
        self.0.as_deref()
    }
}

/// Connects to `addr` and, when `tls` is on, makes the handshake, all
/// within `timeout`; sets `TCP_NODELAY` and `write_timeout` on the socket.
///
/// # Errors
/// The connection's error, a timeout, or why the handshake failed.
pub async fn dial(
    tls: Option<&Tls>,
    addr: SocketAddr,
    timeout: Duration,
    write_timeout: Duration,
) -> io::Result<Stream> {
    let deadline = std::time::Instant::now() + timeout;
    let tcp = TcpStream::connect_timeout(addr, timeout)
        .await
        .map_err(io::Error::from)?;
    // Small frames must not wait for Nagle; a write blocked this long
    // means the peer stopped reading.
    let _ = tcp.set_nodelay(true);
    let _ = tcp.set_write_timeout(Some(write_timeout));
    let left = deadline.saturating_duration_since(std::time::Instant::now());
    let timer = async {
        glommio::timer::sleep(left).await;
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "no TLS handshake with {addr} within {} ms",
                timeout.as_millis()
            ),
        ))
    };
    future::or(connect(tls, tcp, addr), timer).await
}

/// The server's side of a new connection `tcp`: the TLS handshake when
/// `tls` is given (at most [`HANDSHAKE_TIMEOUT`]), the identity of the
/// peer's certificate; the plain stream otherwise.
///
/// # Errors
/// The one-line reason the handshake failed (a plain-TCP peer, a
/// certificate expired, not valid yet, of another CA or another name).
pub async fn accept(tls: Option<&Tls>, tcp: TcpStream) -> Result<Stream, String> {
    let Some(tls) = tls else {
        return Ok(Stream::Plain(tcp));
    };
    let peer = tcp.peer_addr().ok().map(|a| a.ip());
    let acceptor = futures_rustls::TlsAcceptor::from(tls.configs().server);
    let handshake = acceptor.accept(tcp);
    let timeout = async {
        glommio::timer::sleep(HANDSHAKE_TIMEOUT).await;
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "no TLS handshake within {} s (a plain-TCP peer that waits?)",
                HANDSHAKE_TIMEOUT.as_secs()
            ),
        ))
    };
    match future::or(handshake, timeout).await {
        Ok(stream) => {
            let identity = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|c| Identity::of(c, peer))
                .unwrap_or_default();
            Ok(Stream::Server(Box::new(stream), identity))
        }
        Err(e) if e.kind() == io::ErrorKind::TimedOut => Err(e.to_string()),
        Err(e) => Err(refusal::why(&e, Side::Server)),
    }
}

/// The client's side of a new connection `tcp` to `addr`: the TLS
/// handshake when `tls` is given, checking the server's certificate names
/// `tls.server_name` (or `addr`'s IP address when that is empty); the
/// plain stream otherwise.
///
/// # Errors
/// An I/O error whose message says why the handshake failed.
pub async fn connect(tls: Option<&Tls>, tcp: TcpStream, addr: SocketAddr) -> io::Result<Stream> {
    let Some(tls) = tls else {
        return Ok(Stream::Plain(tcp));
    };
    let name = if tls.cfg.server_name.is_empty() {
        ServerName::IpAddress(addr.ip().into())
    } else {
        ServerName::try_from(tls.cfg.server_name.clone()).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("tls.server_name {:?}: {e}", tls.cfg.server_name),
            )
        })?
    };
    let connector = futures_rustls::TlsConnector::from(tls.configs().client);
    match connector.connect(name, tcp).await {
        Ok(stream) => Ok(Stream::Client(Box::new(stream))),
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("TLS handshake refused: {}", refusal::why(&e, Side::Client)),
        )),
    }
}

#[cfg(test)]
mod tests;
