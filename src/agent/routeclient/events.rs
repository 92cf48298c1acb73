//! What the route client tells its owner: events, errors, counters.

use super::*;

/// One module's route as the route server sent it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteEvent {
    /// The module.
    pub module: ModuleId,
    /// False: the route server has no such module (or deleted it).
    pub exists: bool,
    /// The route's version; it changes whenever the nodes do. An event may
    /// repeat a version already seen (a push and an answer crossing, a
    /// re-pull after reconnecting): keep the newer.
    pub version: u64,
    /// The nodes, as sent (empty when `exists` is false).
    pub nodes: Vec<RouteNode>,
    /// True for a RoutePush (sent unasked), false for a RouteAnswer.
    pub pushed: bool,
    /// The module's policy (an unknown code, from a newer route server,
    /// reads as `l5`).
    pub policy: Policy,
    /// The module's own options (none set when the server sends none).
    pub options: lbagent_model::ModuleOptions,
    /// The zones and labels of the nodes that have any (issue 31).
    pub meta: Vec<(NodeAddr, NodeMeta)>,
}

/// An ErrorResp: the route server refused a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerError {
    /// The refused request's sequence number (0: it could not be read).
    pub seq: u64,
    /// The module the error names ((0, 0) when none).
    pub module: ModuleId,
    /// Why, as a code.
    pub retcode: RetCode,
    /// Why, in words.
    pub message: String,
    /// The modules of the refused PullReq: no longer in flight, and not
    /// pulled again unless wanted again.
    pub dropped: Vec<ModuleId>,
}

/// What the route client tells its caller.
#[derive(Debug)]
pub enum RouteClientEvent {
    /// A module's route arrived (answer or push).
    Route(RouteEvent),
    /// The route server refused a request; log it.
    ServerError(ServerError),
    /// Connected to this route server (shell only).
    Connected(SocketAddr),
    /// A connection attempt failed; the next one follows the back-off
    /// (shell only).
    ConnectFailed {
        /// The address tried.
        addr: SocketAddr,
        /// Why it failed.
        error: RouteClientError,
    },
    /// An established connection ended; pulls in flight will be re-issued
    /// (shell only).
    Disconnected {
        /// The route server's address.
        addr: SocketAddr,
        /// Why the connection ended.
        error: RouteClientError,
    },
}

/// Why a connection to a route server ends. Every variant means: close the
/// connection; the client reconnects per its back-off.
#[derive(Debug, thiserror::Error)]
pub enum RouteClientError {
    /// The byte stream is not a sequence of frames.
    #[error("bad frame from the route server: {0}")]
    Frame(#[from] FrameError),
    /// A frame is not a valid message.
    #[error("undecodable message from the route server: {0}")]
    Decode(#[from] DecodeError),
    /// A message whose fields break the protocol's rules (a RouteUnchanged
    /// whose versions are not one per module).
    #[error("invalid message from the route server: {0}")]
    Invalid(#[from] ValidationError),
    /// A route whose nodes' zones or labels break the bounds.
    #[error("invalid zones or labels from the route server: {0}")]
    Meta(#[from] BadMeta),
    /// A valid message that a route server never sends to an agent.
    #[error("unexpected {0} from the route server: only RouteAnswer, RouteUnchanged, RoutePush, KeepAliveAck and ErrorResp belong on this connection")]
    Unexpected(&'static str),
    /// Nothing arrived for `idle_timeout_ms` while answers were due.
    #[error("route server silent for {0} ms while answers were due")]
    Idle(u64),
    /// The route server closed the connection.
    #[error("route server closed the connection")]
    Closed,
    /// A socket call failed (connect, read, write, or a write that could
    /// not proceed for `idle_timeout_ms`).
    #[error("route server connection i/o failed: {0}")]
    Io(#[from] io::Error),
}

/// Counters for metrics, kept by [`RouteClientCore`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteClientStats {
    /// Connections established.
    pub connects: u64,
    /// Connection attempts failed or connections lost.
    pub disconnects: u64,
    /// PullReq frames sent.
    pub pull_reqs: u64,
    /// Modules named in PullReqs sent (re-issues included).
    pub modules_pulled: u64,
    /// Modules pulled again by the refresh timer ([`RouteClientConfig::refresh_ms`]).
    pub refreshes: u64,
    /// RouteAnswers accepted.
    pub answers: u64,
    /// Nodes received in accepted RouteAnswers and RoutePushes.
    pub nodes_received: u64,
    /// Modules a RouteUnchanged confirmed at the version held (no nodes sent).
    pub unchanged: u64,
    /// RouteAnswers dropped (no pull of that module and sequence in
    /// flight), and RoutePushes of modules no longer followed.
    pub stale_answers: u64,
    /// Modules named in Unsubscribe frames sent.
    pub unsubscribed: u64,
    /// RoutePushes received.
    pub pushes: u64,
    /// ErrorResps received.
    pub server_errors: u64,
    /// KeepAlives sent.
    pub keepalives: u64,
    /// KeepAliveAcks received.
    pub keepalive_acks: u64,
}

pub use crate::reconnect::Wake;
