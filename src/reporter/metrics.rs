//! The reporter's figures and their Prometheus text exposition (what
//! `GET /metrics` answers), written through prometheus-client's text
//! encoder. Pure: the shell gathers a [`ReporterStats`] and renders it.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode_registry;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType::{Counter, Gauge};
use prometheus_client::registry::Registry;

use lbagent_service::exposition::{figures, Figure};

/// A snapshot of the reporter's counters and gauges.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReporterStats {
    /// Agent connections open now.
    pub connections_open: u64,
    /// Agent connections accepted since start.
    pub connections: u64,
    /// StatsReports accepted and acknowledged.
    pub reports: u64,
    /// StatsReports refused with ErrorResp (content the store cannot hold).
    pub reports_refused: u64,
    /// Connections closed for a frame that is not a StatsReport.
    pub bad_frames: u64,
    /// Connections refused: `reporter.max_connections` were open.
    pub connections_refused: u64,
    /// Connections refused at the TLS handshake.
    pub tls_refused: u64,
    /// Consumed-units entries refused: the identity is not on
    /// `tls.consume_allow`.
    pub consumed_refused: u64,
    /// Connections closed after `reporter.idle_timeout` without a frame.
    pub idle_closed: u64,
    /// Connections closed: a frame took longer than `reporter.read_timeout_ms`.
    pub read_timeouts: u64,
    /// Connections closed: incomplete frames passed `reporter.max_buffered_bytes`.
    pub buffer_full_closed: u64,
    /// Bytes of incomplete frames held now, every connection together.
    pub partial_bytes: u64,
    /// Times a writer found the SQLite file deleted or replaced.
    pub store_replaced: u64,
    /// Metrics connections answered 503 (too many open).
    pub metrics_refused: u64,
    /// Metrics connections closed for taking too long.
    pub metrics_timeouts: u64,
    /// Rows accepted into the buffer.
    pub rows_accepted: u64,
    /// Rows replaced by a newer row of the same module, node and caller
    /// before they were written.
    pub rows_coalesced: u64,
    /// Rows written to the store.
    pub rows_written: u64,
    /// Rows dropped, oldest first, because the buffer was full: the loss.
    pub rows_dropped: u64,
    /// Rows the store refused as invalid.
    pub rows_rejected: u64,
    /// Rows held now, waiting or being written.
    pub rows_buffered: u64,
    /// The most rows held at once (`reporter.buffer_rows`).
    pub buffer_rows: u64,
    /// Transactions that wrote a batch.
    pub transactions: u64,
    /// Failed attempts to connect to the store or to write a batch.
    pub write_failures: u64,
    /// Writer threads.
    pub writers: u64,
    /// Writers whose connection is open and whose last write succeeded.
    pub writers_up: u64,
}

impl ReporterStats {
    /// Whether every writer reaches the store.
    pub fn store_up(&self) -> bool {
        self.writers_up == self.writers
    }
}

// === the exposition ===
//
// Declared once below and written by prometheus-client's text encoder, as
// `lbagent_service::exposition` says (the text format 0.0.4).

/// Every figure, in exposition order.
const FIGURES: [Figure<ReporterStats>; 27] = [
        ("connections", Gauge, "Agent connections open now.", |s| s.connections_open),
        ("connections_total", Counter, "Agent connections accepted.", |s| s.connections),
        ("reports_total", Counter, "StatsReports accepted and acknowledged.", |s| s.reports),
        (
            "reports_refused_total",
            Counter,
            "StatsReports refused with ErrorResp (content the store cannot hold).",
            |s| s.reports_refused,
        ),
        (
            "bad_frames_total",
            Counter,
            "Connections closed for a frame that is not a StatsReport.",
            |s| s.bad_frames,
        ),
        (
            "connections_refused_total",
            Counter,
            "Agent connections refused: reporter.max_connections were open.",
            |s| s.connections_refused,
        ),
        (
            "tls_refused_total",
            Counter,
            "Agent connections refused at the TLS handshake (plain TCP, or a certificate expired, not yet valid, of another CA or of a name outside tls.peer_names).",
            |s| s.tls_refused,
        ),
        (
            "consumed_refused_total",
            Counter,
            "Consumed capacity units refused: the agent's identity is not on tls.consume_allow (its call statistics are stored).",
            |s| s.consumed_refused,
        ),
        (
            "idle_closed_total",
            Counter,
            "Agent connections closed after reporter.idle_timeout without a frame.",
            |s| s.idle_closed,
        ),
        (
            "read_timeouts_total",
            Counter,
            "Agent connections closed: a frame took longer than reporter.read_timeout_ms.",
            |s| s.read_timeouts,
        ),
        (
            "buffer_full_closed_total",
            Counter,
            "Agent connections closed: incomplete frames passed reporter.max_buffered_bytes.",
            |s| s.buffer_full_closed,
        ),
        ("partial_bytes", Gauge, "Bytes of incomplete frames held now.", |s| s.partial_bytes),
        (
            "store_replaced_total",
            Counter,
            "Times a writer found the store's SQLite file deleted or replaced under it (the rows stay buffered).",
            |s| s.store_replaced,
        ),
        (
            "metrics_connections_refused_total",
            Counter,
            "Metrics connections answered 503: too many were open.",
            |s| s.metrics_refused,
        ),
        (
            "metrics_timeouts_total",
            Counter,
            "Metrics connections closed for taking too long.",
            |s| s.metrics_timeouts,
        ),
        ("rows_accepted_total", Counter, "Call status rows accepted into the buffer.", |s| s.rows_accepted),
        (
            "rows_coalesced_total",
            Counter,
            "Rows replaced by a newer row of the same module, node and caller before being written.",
            |s| s.rows_coalesced,
        ),
        ("rows_written_total", Counter, "Rows written to the store.", |s| s.rows_written),
        (
            "rows_dropped_total",
            Counter,
            "Rows dropped, oldest first, because the buffer was full (the loss).",
            |s| s.rows_dropped,
        ),
        ("rows_rejected_total", Counter, "Rows the store refused as invalid.", |s| s.rows_rejected),
        ("rows_buffered", Gauge, "Rows held now, waiting or being written.", |s| s.rows_buffered),
        ("buffer_rows_max", Gauge, "The most rows held at once (reporter.buffer_rows).", |s| s.buffer_rows),
        ("transactions_total", Counter, "Transactions that wrote a batch.", |s| s.transactions),
        (
            "write_failures_total",
            Counter,
            "Failed attempts to connect to the store or to write a batch.",
            |s| s.write_failures,
        ),
        ("writers", Gauge, "Writer threads.", |s| s.writers),
        (
            "writers_up",
            Gauge,
            "Writers whose store connection is open and whose last write succeeded.",
            |s| s.writers_up,
        ),
    (
        "store_up",
        Gauge,
        "1 when every writer reaches the store, else 0.",
        |s| u64::from(s.store_up()),
    ),
];

/// The Prometheus text exposition (format 0.0.4) of `s`.
pub fn render(s: &ReporterStats) -> String {
    let mut registry = Registry::with_prefix("lbagent_reporter");
    registry.register_collector(Box::new(Scrape(*s)));
    let mut out = String::with_capacity(4096);
    encode_registry(&mut out, &registry).expect("a String takes every write");
    out
}

/// What one scrape writes (prometheus-client's collectors own what they
/// encode).
#[derive(Debug)]
struct Scrape(ReporterStats);

impl Collector for Scrape {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        figures(&mut e, &FIGURES, &self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the sample `name` in `text`.
    fn sample(text: &str, name: &str) -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn every_figure_is_rendered_with_help_and_type() {
        let s = ReporterStats {
            connections_open: 1,
            connections: 2,
            reports: 3,
            reports_refused: 4,
            bad_frames: 5,
            rows_accepted: 6,
            rows_coalesced: 7,
            rows_written: 8,
            rows_dropped: 9,
            rows_rejected: 10,
            rows_buffered: 11,
            buffer_rows: 12,
            transactions: 13,
            write_failures: 14,
            writers: 3,
            writers_up: 2,
            connections_refused: 15,
            idle_closed: 16,
            read_timeouts: 17,
            buffer_full_closed: 18,
            partial_bytes: 19,
            store_replaced: 20,
            metrics_refused: 21,
            metrics_timeouts: 22,
            tls_refused: 23,
            consumed_refused: 24,
        };
        let text = render(&s);
        let want = [
            ("connections", 1),
            ("connections_total", 2),
            ("reports_total", 3),
            ("reports_refused_total", 4),
            ("bad_frames_total", 5),
            ("rows_accepted_total", 6),
            ("rows_coalesced_total", 7),
            ("rows_written_total", 8),
            ("rows_dropped_total", 9),
            ("rows_rejected_total", 10),
            ("rows_buffered", 11),
            ("buffer_rows_max", 12),
            ("transactions_total", 13),
            ("write_failures_total", 14),
            ("writers", 3),
            ("writers_up", 2),
            ("store_up", 0),
            ("connections_refused_total", 15),
            ("idle_closed_total", 16),
            ("read_timeouts_total", 17),
            ("buffer_full_closed_total", 18),
            ("partial_bytes", 19),
            ("store_replaced_total", 20),
            ("metrics_connections_refused_total", 21),
            ("metrics_timeouts_total", 22),
            ("tls_refused_total", 23),
            ("consumed_refused_total", 24),
        ];
        for (name, value) in want {
            let full = format!("lbagent_reporter_{name}");
            assert_eq!(sample(&text, &full), Some(value), "{full}");
            assert!(
                text.contains(&format!("# TYPE {full} ")),
                "{full} has no TYPE"
            );
            assert!(
                text.contains(&format!("# HELP {full} ")),
                "{full} has no HELP"
            );
        }
        let up = ReporterStats {
            writers: 3,
            writers_up: 3,
            ..s
        };
        assert_eq!(sample(&render(&up), "lbagent_reporter_store_up"), Some(1));
    }
}
