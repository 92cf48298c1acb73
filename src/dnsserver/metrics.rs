//! The route server's figures and their Prometheus text (written through
//! prometheus-client's text encoder), and the tiny HTTP endpoint that
//! serves them (`GET /metrics`).
//!
//! Counting is plain field increments on each executor's own [`Counters`]
//! and the store thread's [`StoreStatus`]; each publishes a copy into a
//! [`Board`] slot now and then (the executors on their tick), and the
//! endpoint renders whatever the slots hold. Nothing on the request path
//! touches an atomic or a lock.

use lbagent_service::metrics_http;
use lbagent_service::wakefd::StopEvent;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode_registry;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType::{Counter, Gauge};
use prometheus_client::registry::Registry;

use lbagent_service::exposition::{family, sample};
use std::fmt;
use std::net::TcpListener;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// One serving executor's counters and gauges.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Connections accepted.
    pub accepted: u64,
    /// `accept` calls that failed (file descriptors exhausted...).
    pub accept_errors: u64,
    /// Connections closed, by [`CloseKind`].
    pub closed: [u64; CloseKind::COUNT],
    /// PullReq frames answered (or held).
    pub pull_reqs: u64,
    /// Modules named in PullReqs.
    pub pulls: u64,
    /// RouteAnswers sent for modules that exist.
    pub answers: u64,
    /// RouteAnswers sent with `exists = false`.
    pub answers_unknown: u64,
    /// Nodes sent in RouteAnswers (pushes not included).
    pub answer_nodes: u64,
    /// Modules of versioned pulls found unchanged at the version the agent
    /// holds: named in a RouteUnchanged, no nodes sent.
    pub unchanged: u64,
    /// RouteUnchanged frames sent (at most one per PullReq).
    pub unchanged_frames: u64,
    /// Module pulls held (not answered) because no route was loaded yet;
    /// they are answered by a push once the first load succeeds.
    pub pulls_held: u64,
    /// PullReqs refused with an ErrorResp (no modules, too many).
    pub bad_requests: u64,
    /// RoutePush frames queued to connections.
    pub pushes: u64,
    /// KeepAlives answered.
    pub keepalives: u64,
    /// Subscriptions refused: the connection holds the most allowed.
    pub subscriptions_refused: u64,
    /// Subscriptions refused: every connection together holds the most
    /// allowed (`dnsserver.max_subscriptions`).
    pub subscriptions_refused_total_bound: u64,
    /// Connections refused: `dnsserver.max_connections` were open.
    pub connections_refused: u64,
    /// Connections refused at the TLS handshake (plain TCP, a certificate
    /// expired, not yet valid, of another CA or name).
    pub tls_refused: u64,
    /// Subscriptions dropped by an agent's Unsubscribe.
    pub unsubscribes: u64,
    /// Open connections (gauge).
    pub connections: u64,
    /// Subscriptions of open connections (gauge).
    pub subscriptions: u64,
}

/// Why a connection was closed, for [`Counters::closed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseKind {
    /// The peer closed it.
    Peer = 0,
    /// Silent past the idle timeout.
    Idle = 1,
    /// A byte stream that is not frames (length 0 or over the limit).
    BadFrame = 2,
    /// A frame that does not decode.
    Undecodable = 3,
    /// A message that does not belong on a route server connection.
    Unexpected = 4,
    /// Too many pushes queued for a peer that does not read.
    SlowReader = 5,
    /// A socket error.
    Io = 6,
    /// The route server is stopping.
    Shutdown = 7,
}

impl CloseKind {
    /// How many kinds there are.
    pub const COUNT: usize = 8;

    /// Every kind, in label order.
    pub const ALL: [CloseKind; CloseKind::COUNT] = [
        CloseKind::Peer,
        CloseKind::Idle,
        CloseKind::BadFrame,
        CloseKind::Undecodable,
        CloseKind::Unexpected,
        CloseKind::SlowReader,
        CloseKind::Io,
        CloseKind::Shutdown,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        [
            "peer",
            "idle",
            "bad_frame",
            "undecodable",
            "unexpected",
            "slow_reader",
            "io",
            "shutdown",
        ][self as usize]
    }
}

/// What the store thread knows, published after every poll.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStatus {
    /// Whether the last store operation succeeded.
    pub up: bool,
    /// Whether routes were ever loaded.
    pub loaded: bool,
    /// Modules in the table.
    pub modules: u64,
    /// The route version of the table.
    pub route_version: u64,
    /// Polls (version checks, change reads, full reloads) attempted.
    pub polls: u64,
    /// Polls that failed (store unreachable or refusing).
    pub poll_failures: u64,
    /// Full reloads that succeeded.
    pub full_reloads: u64,
    /// Full reloads that failed.
    pub full_reload_failures: u64,
    /// Change-log reads that succeeded.
    pub change_reloads: u64,
    /// Change-log reads that failed.
    pub change_reload_failures: u64,
    /// Modules reported changed (pushed), over all reloads.
    pub modules_changed: u64,
    /// Modules left out because their answer does not fit a frame (gauge).
    pub modules_refused: u64,
    /// Rows the store skipped as malformed in its last read (gauge).
    pub bad_rows: u64,
    /// Times the store's file was found deleted or replaced under the
    /// server (SQLite).
    pub store_replaced: u64,
    /// When the last full reload succeeded.
    pub last_full_reload: Option<Instant>,
    /// When the store last answered.
    pub last_store_ok: Option<Instant>,
}

/// Where the executors and the store thread publish, and the endpoint
/// reads.
#[derive(Debug)]
pub struct Board {
    started: Instant,
    executors: Vec<Mutex<Counters>>,
    store: Mutex<StoreStatus>,
    /// What the metrics endpoint refused or timed out.
    pub http: metrics_http::HttpCounters,
}

impl Board {
    /// A board for `executors` serving executors.
    pub fn new(executors: usize) -> Self {
        Board {
            started: Instant::now(),
            executors: (0..executors).map(|_| Mutex::default()).collect(),
            store: Mutex::default(),
            http: metrics_http::HttpCounters::default(),
        }
    }

    /// How many executors publish here.
    pub fn executors(&self) -> usize {
        self.executors.len()
    }

    /// Publishes executor `i`'s counters.
    pub fn publish(&self, i: usize, counters: &Counters) {
        if let Some(slot) = self.executors.get(i) {
            *lock(slot) = *counters;
        }
    }

    /// Publishes the store thread's status.
    pub fn publish_store(&self, status: &StoreStatus) {
        *lock(&self.store) = *status;
    }

    /// Executor `i`'s last published counters.
    pub fn executor(&self, i: usize) -> Counters {
        self.executors.get(i).map(|s| *lock(s)).unwrap_or_default()
    }

    /// Every executor's counters summed (gauges too).
    pub fn total(&self) -> Counters {
        let mut t = Counters::default();
        for slot in &self.executors {
            let c = *lock(slot);
            t.accepted += c.accepted;
            t.accept_errors += c.accept_errors;
            for (sum, n) in t.closed.iter_mut().zip(c.closed) {
                *sum += n;
            }
            t.pull_reqs += c.pull_reqs;
            t.pulls += c.pulls;
            t.answers += c.answers;
            t.answers_unknown += c.answers_unknown;
            t.answer_nodes += c.answer_nodes;
            t.unchanged += c.unchanged;
            t.unchanged_frames += c.unchanged_frames;
            t.pulls_held += c.pulls_held;
            t.bad_requests += c.bad_requests;
            t.pushes += c.pushes;
            t.keepalives += c.keepalives;
            t.subscriptions_refused += c.subscriptions_refused;
            t.subscriptions_refused_total_bound += c.subscriptions_refused_total_bound;
            t.connections_refused += c.connections_refused;
            t.tls_refused += c.tls_refused;
            t.unsubscribes += c.unsubscribes;
            t.connections += c.connections;
            t.subscriptions += c.subscriptions;
        }
        t
    }

    /// The store thread's last published status.
    pub fn store(&self) -> StoreStatus {
        *lock(&self.store)
    }

    /// The Prometheus text of everything on the board, ages taken at `now`.
    pub fn render(&self, now: Instant) -> String {
        let age = |at: Option<Instant>| {
            now.saturating_duration_since(at.unwrap_or(self.started))
                .as_secs_f64()
        };
        let store = self.store();
        let scrape = Scrape {
            per: (0..self.executors.len())
                .map(|i| self.executor(i))
                .collect(),
            total: self.total(),
            store,
            reload_age_s: age(store.last_full_reload),
            store_ok_age_s: age(store.last_store_ok),
            metrics_refused: self.http.refused(),
            metrics_timeouts: self.http.timed_out(),
        };
        let mut registry = Registry::with_prefix("lbagent_dnsserver");
        registry.register_collector(Box::new(scrape));
        let mut out = String::with_capacity(6144);
        encode_registry(&mut out, &registry).expect("a String takes every write");
        out
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

// === the exposition ===
//
// Written by prometheus-client's text encoder, every family under the
// registry's prefix `lbagent_dnsserver_`, in the text format 0.0.4 as
// `lbagent_service::exposition` says.

/// What one scrape writes: a copy of the board (prometheus-client's
/// collectors own what they encode), ages taken.
#[derive(Debug)]
struct Scrape {
    per: Vec<Counters>,
    total: Counters,
    store: StoreStatus,
    reload_age_s: f64,
    store_ok_age_s: f64,
    metrics_refused: u64,
    metrics_timeouts: u64,
}

impl Collector for Scrape {
    fn encode(&self, mut e: DescriptorEncoder) -> fmt::Result {
        let e = &mut e;
        let (t, s) = (&self.total, &self.store);
        let open = self.per.iter().enumerate();
        let open = open.map(|(i, c)| ([("executor", i)], c.connections));
        let help = "Open agent connections, by serving executor.";
        family(e, "connections", Gauge, help, open)?;
        let help = "Agent connections accepted.";
        counter(e, "connections_accepted_total", help, t.accepted)?;
        let help = "Failed accepts (out of file descriptors?).";
        counter(e, "accept_errors_total", help, t.accept_errors)?;
        let closed = |k: CloseKind| ([("reason", k.label())], t.closed[k as usize]);
        let help = "Connections closed, by reason.";
        family(
            e,
            "connections_closed_total",
            Counter,
            help,
            CloseKind::ALL.map(closed),
        )?;
        let help = "Connections closed after staying silent past dnsserver.idle_timeout.";
        counter(e, "idle_closes_total", help, closed(CloseKind::Idle).1)?;
        let bad = [
            CloseKind::BadFrame,
            CloseKind::Undecodable,
            CloseKind::Unexpected,
        ];
        let help = "Frames that closed their connection: not a frame, not a message, \
                    or not a route server request.";
        family(e, "bad_frames_total", Counter, help, bad.map(closed))?;
        let help = "PullReqs refused with an ErrorResp (no modules or too many).";
        counter(e, "bad_requests_total", help, t.bad_requests)?;
        counter(
            e,
            "pull_requests_total",
            "PullReq frames received.",
            t.pull_reqs,
        )?;
        counter(e, "pulls_total", "Modules named in PullReqs.", t.pulls)?;
        let answers = [
            ([("exists", "true")], t.answers),
            ([("exists", "false")], t.answers_unknown),
        ];
        family(e, "answers_total", Counter, "RouteAnswers sent.", answers)?;
        let help = "Nodes sent in RouteAnswers (the cost of pulls on the wire).";
        counter(e, "answer_nodes_total", help, t.answer_nodes)?;
        let help = "Modules of versioned pulls unchanged at the version the agent holds \
                    (answered in a RouteUnchanged, without nodes).";
        counter(e, "unchanged_total", help, t.unchanged)?;
        let help = "RouteUnchanged frames sent (one per PullReq at most).";
        counter(e, "unchanged_frames_total", help, t.unchanged_frames)?;
        let help = "Module pulls held because no route was loaded yet \
                    (answered by push after the first load).";
        counter(e, "pulls_held_total", help, t.pulls_held)?;
        let help = "RoutePushes sent to subscribed connections.";
        counter(e, "pushes_total", help, t.pushes)?;
        counter(e, "keepalives_total", "KeepAlives answered.", t.keepalives)?;
        let help = "Module subscriptions of open connections.";
        gauge(e, "subscriptions", help, t.subscriptions)?;
        let refused = [
            ([("bound", "connection")], t.subscriptions_refused),
            ([("bound", "total")], t.subscriptions_refused_total_bound),
        ];
        let help = "Subscriptions refused (the pull was answered): the connection, or every \
                    connection together, holds the most allowed.";
        family(e, "subscriptions_refused_total", Counter, help, refused)?;
        let help = "Connections refused: dnsserver.max_connections were open.";
        counter(e, "connections_refused_total", help, t.connections_refused)?;
        let help = "Connections refused at the TLS handshake (plain TCP, or a certificate \
                    expired, not yet valid, of another CA or of a name outside tls.peer_names).";
        counter(e, "tls_refused_total", help, t.tls_refused)?;
        let help = "Subscriptions dropped by an agent's Unsubscribe (the agent forgot the module).";
        counter(e, "unsubscribes_total", help, t.unsubscribes)?;

        let help = "1 when the last store operation succeeded, 0 when the store is \
                    unreachable or refusing.";
        gauge(e, "store_up", help, u64::from(s.up))?;
        let help = "1 once routes were loaded from the store; 0 while pulls are held.";
        gauge(e, "routes_loaded", help, u64::from(s.loaded))?;
        gauge(e, "modules", "Modules loaded.", s.modules)?;
        let help = "The route version the served table reflects.";
        gauge(e, "route_version", help, s.route_version)?;
        counter(e, "store_polls_total", "Store polls attempted.", s.polls)?;
        let help = "Store polls that failed.";
        counter(e, "store_poll_failures_total", help, s.poll_failures)?;
        let reloads = [
            ([("kind", "full")], s.full_reloads),
            ([("kind", "changes")], s.change_reloads),
        ];
        let help =
            "Successful reloads: of every route, or of the changes since the served version.";
        family(e, "reloads_total", Counter, help, reloads)?;
        let failures = [
            ([("kind", "full")], s.full_reload_failures),
            ([("kind", "changes")], s.change_reload_failures),
        ];
        family(
            e,
            "reload_failures_total",
            Counter,
            "Failed reloads.",
            failures,
        )?;
        let help = "Modules found changed by reloads (each pushed to its subscribers).";
        counter(e, "modules_changed_total", help, s.modules_changed)?;
        let help = "Modules not served: their answer does not fit in one frame.";
        gauge(e, "modules_refused", help, s.modules_refused)?;
        let help = "Malformed store rows skipped by the last read.";
        gauge(e, "store_bad_rows", help, s.bad_rows)?;
        let help = "Times the store's SQLite file was found deleted or replaced under the server.";
        counter(e, "store_replaced_total", help, s.store_replaced)?;
        let help = "Seconds since the last successful full reload (since start when none).";
        seconds(e, "last_reload_age_seconds", help, self.reload_age_s)?;
        let help = "Seconds since the store last answered (since start when never).";
        seconds(e, "store_ok_age_seconds", help, self.store_ok_age_s)?;
        let help = "Metrics connections answered 503: too many were open.";
        counter(
            e,
            "metrics_connections_refused_total",
            help,
            self.metrics_refused,
        )?;
        let help = "Metrics connections closed for taking too long.";
        counter(e, "metrics_timeouts_total", help, self.metrics_timeouts)
    }
}

/// A counter family of one sample without labels.
fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> fmt::Result {
    sample(e, name, Counter, help, v)
}

/// A gauge family of one sample without labels.
fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> fmt::Result {
    sample(e, name, Gauge, help, v)
}

/// A gauge of seconds, one sample without labels.
fn seconds(e: &mut DescriptorEncoder, name: &str, help: &str, v: f64) -> fmt::Result {
    e.encode_descriptor(name, help, None, Gauge)?
        .encode_gauge(&v)
}

// === the endpoint ===

/// Serves `GET /metrics` from `board` on `listener` until `stop` is set,
/// within the bounds of [`metrics_http::serve_blocking`] (counted in
/// `board.http`).
pub fn serve(listener: TcpListener, board: Arc<Board>, stop: Arc<StopEvent>) {
    let body = || board.render(Instant::now()) + &lbagent_service::reload::metrics_text();
    if let Err(e) = metrics_http::serve_blocking(&listener, &stop, &board.http, &body) {
        tracing::error!("the metrics endpoint stopped: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The value of the sample `name` (labels included) in `text`.
    fn sample(text: &str, name: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no sample {name} in\n{text}"))
    }

    #[test]
    fn the_text_sums_executors_and_shows_the_store() {
        let board = Board::new(2);
        let mut c = Counters {
            pulls: 5,
            connections: 2,
            ..Counters::default()
        };
        c.closed[CloseKind::Idle as usize] = 1;
        board.publish(0, &c);
        c.connections = 3;
        c.closed[CloseKind::BadFrame as usize] = 4;
        board.publish(1, &c);
        let t0 = Instant::now();
        board.publish_store(&StoreStatus {
            up: false,
            loaded: true,
            modules: 7,
            route_version: 42,
            poll_failures: 3,
            last_full_reload: Some(t0),
            ..StoreStatus::default()
        });
        let text = board.render(t0 + Duration::from_secs(12));
        assert_eq!(sample(&text, "lbagent_dnsserver_pulls_total"), 10.0);
        assert_eq!(
            sample(&text, "lbagent_dnsserver_connections{executor=\"0\"}"),
            2.0
        );
        assert_eq!(
            sample(&text, "lbagent_dnsserver_connections{executor=\"1\"}"),
            3.0
        );
        assert_eq!(sample(&text, "lbagent_dnsserver_idle_closes_total"), 2.0);
        assert_eq!(
            sample(
                &text,
                "lbagent_dnsserver_bad_frames_total{reason=\"bad_frame\"}"
            ),
            4.0
        );
        assert_eq!(sample(&text, "lbagent_dnsserver_store_up"), 0.0);
        assert_eq!(
            sample(&text, "lbagent_dnsserver_store_poll_failures_total"),
            3.0
        );
        assert_eq!(sample(&text, "lbagent_dnsserver_modules"), 7.0);
        assert_eq!(sample(&text, "lbagent_dnsserver_route_version"), 42.0);
        assert_eq!(
            sample(&text, "lbagent_dnsserver_last_reload_age_seconds"),
            12.0
        );
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, value) = line.rsplit_once(' ').unwrap();
            assert!(name.starts_with("lbagent_dnsserver_"), "{line}");
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
    }
}
