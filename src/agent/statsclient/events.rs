//! What the statistics client tells its owner: events, errors, counters.

use super::*;

/// An ErrorResp: the reporter refused a report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatsServerError {
    /// The refused report's sequence number (0: it could not be read).
    pub seq: u64,
    /// The module the error names ((0, 0) when none).
    pub module: ModuleId,
    /// Why, as a code.
    pub retcode: RetCode,
    /// Why, in words.
    pub message: String,
    /// Entries of the refused report, dropped (0 when `seq` names no
    /// report in flight).
    pub rejected: usize,
}

/// What the stats client tells its caller; every event is for a log line
/// (`Display` writes one).
#[derive(Debug)]
pub enum StatsClientEvent {
    /// The buffer bound was exceeded: the oldest waiting entries were
    /// dropped.
    Dropped {
        /// Entries dropped since the last such event.
        entries: u64,
        /// Entries dropped since the start.
        total: u64,
    },
    /// The reporter refused a report; its entries are dropped.
    ServerError(StatsServerError),
    /// Connected to this reporter (shell only).
    Connected(SocketAddr),
    /// A connection attempt failed; the next one follows the back-off
    /// (shell only).
    ConnectFailed {
        /// The address tried.
        addr: SocketAddr,
        /// Why it failed.
        error: StatsClientError,
    },
    /// An established connection ended (shell only).
    Disconnected {
        /// The reporter's address.
        addr: SocketAddr,
        /// Why the connection ended.
        error: StatsClientError,
        /// Entries sent and not acknowledged, queued again to be re-sent.
        requeued: u64,
    },
}

impl fmt::Display for StatsClientEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StatsClientEvent::Dropped { entries, total } => write!(
                f,
                "statistics buffer full: dropped the {entries} oldest entries ({total} in all)"
            ),
            StatsClientEvent::ServerError(e) => write!(
                f,
                "reporter refused report {} ({:?}, {} entries dropped): {}",
                e.seq, e.retcode, e.rejected, e.message
            ),
            StatsClientEvent::Connected(addr) => write!(f, "connected to reporter {addr}"),
            StatsClientEvent::ConnectFailed { addr, error } => write!(
                f,
                "cannot connect to reporter {addr}: {error}; retrying with back-off"
            ),
            StatsClientEvent::Disconnected {
                addr,
                error,
                requeued,
            } => write!(
                f,
                "lost reporter {addr}: {error}; {requeued} unacknowledged entries will be re-sent"
            ),
        }
    }
}

/// Why a connection to a reporter ends. Every variant means: close the
/// connection; the client reconnects per its back-off.
#[derive(Debug, thiserror::Error)]
pub enum StatsClientError {
    /// The byte stream is not a sequence of frames.
    #[error("bad frame from the reporter: {0}")]
    Frame(#[from] FrameError),
    /// A frame is not a valid message.
    #[error("undecodable message from the reporter: {0}")]
    Decode(#[from] DecodeError),
    /// A valid message that a reporter never sends to an agent.
    #[error(
        "unexpected {0} from the reporter: only StatsAck and ErrorResp belong on this connection"
    )]
    Unexpected(&'static str),
    /// The reporter answered ErrorResp `Unavailable`.
    #[error("reporter unavailable: {0}")]
    Unavailable(String),
    /// Nothing arrived for `ack_timeout_ms` while reports were in flight.
    #[error("reporter silent for {0} ms while reports were in flight")]
    AckTimeout(u64),
    /// The reporter closed the connection.
    #[error("reporter closed the connection")]
    Closed,
    /// A socket call failed (connect, read, write, or a write that could
    /// not proceed for `ack_timeout_ms`).
    #[error("reporter connection i/o failed: {0}")]
    Io(#[from] io::Error),
}

/// Counters for metrics, kept by [`StatsClientCore`]. Entries are counted
/// as pushed (after splitting); at every moment
/// `pushed == acked + dropped + rejected + queued + in_flight`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsClientStats {
    /// Connections established.
    pub connects: u64,
    /// Connection attempts failed or connections lost.
    pub disconnects: u64,
    /// Entries accepted by [`StatsClientCore::push`].
    pub pushed: u64,
    /// Entries sent, re-sends included.
    pub sent: u64,
    /// Entries sent again after a lost connection.
    pub resent: u64,
    /// Entries acknowledged by a reporter.
    pub acked: u64,
    /// Entries dropped past [`StatsClientConfig::max_queued`].
    pub dropped: u64,
    /// Entries refused by a reporter's ErrorResp.
    pub rejected: u64,
    /// Entries waiting to be sent now (a gauge).
    pub queued: u64,
    /// Entries sent and not acknowledged now (a gauge).
    pub in_flight: u64,
    /// StatsReport frames sent, re-sends included.
    pub reports_sent: u64,
    /// StatsAcks matching a report in flight.
    pub reports_acked: u64,
    /// StatsAcks matching no report in flight.
    pub stale_acks: u64,
    /// ErrorResps received.
    pub server_errors: u64,
}

pub use crate::reconnect::Wake;
