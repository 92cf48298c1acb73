//! What every long-running lbagent process (the agent, the route server,
//! the reporter, the demo service) shares: its log, reloading its
//! configuration, its signals, systemd notification, the `/metrics`
//! exchange, and the wake-ups across threads that let an idle process sleep.
//!
//! # Layout
//!
//! - [`logging`]: `tracing` to standard error, text or JSON lines.
//! - [`reload`]: SIGHUP / `systemctl reload`: read, validate, apply.
//! - [`signal`]: SIGTERM / SIGINT / SIGHUP for the long-running commands.
//! - [`sdnotify`]: systemd readiness and watchdog notifications.
//! - [`metrics_http`]: the `GET /metrics` exchange every server answers;
//!   [`exposition`]: what their prometheus-client families share.
//! - [`doorbell`], [`wakefd`]: wake-ups across threads for a glommio task
//!   and for a thread blocked in `poll`, so that idle servers sleep
//!   instead of polling stop flags.
//! - [`conn`]: racing and waiting primitives of the glommio TCP shells
//!   (the agent's route and statistics clients, the servers' connections).
#![warn(missing_docs)]

pub mod conn;
pub mod doorbell;
pub mod exposition;
pub mod logging;
pub mod metrics_http;
pub mod reload;
pub mod sdnotify;
pub mod signal;
pub mod wakefd;
