//! Reloading the configuration of a running process (SIGHUP, `systemctl
//! reload`): the thin shell around [`lbagent_config::reload::plan`]. The file
//! is read again the way it was at start ([`ConfigSource`]); an invalid file
//! or a change that needs a restart changes nothing and is one log line;
//! otherwise the log level and the role's live fields are applied. The
//! outcomes are counted for the metrics endpoints
//! (`lbagent_config_reloads_total{result}`).

use std::sync::atomic::{AtomicU64, Ordering};

use lbagent_config::reload::{plan, Plan, Role};
use lbagent_config::{Config, ConfigSource};

static RELOADS_OK: AtomicU64 = AtomicU64::new(0);
static RELOADS_FAILED: AtomicU64 = AtomicU64::new(0);

/// Reloads applied (nothing changed included) and refused, in this process.
pub fn counts() -> (u64, u64) {
    (
        RELOADS_OK.load(Ordering::Relaxed),
        RELOADS_FAILED.load(Ordering::Relaxed),
    )
}

/// The reload counters in the Prometheus text format, for a metrics
/// endpoint.
pub fn metrics_text() -> String {
    let (ok, failed) = counts();
    format!(
        "# HELP lbagent_config_reloads_total Configuration reloads (SIGHUP), by result: ok (applied, or nothing to change) or failed (invalid file, or a field that needs a restart changed; the old configuration kept).\n\
         # TYPE lbagent_config_reloads_total counter\n\
         lbagent_config_reloads_total{{result=\"ok\"}} {ok}\n\
         lbagent_config_reloads_total{{result=\"failed\"}} {failed}\n"
    )
}

/// Reads the configuration again from `source` and, when it is valid and
/// changes nothing that needs a restart for `role`, applies it: the log
/// level here, the rest through `apply` (given the old and the new
/// configuration and the live fields that changed), and makes it `current`.
/// `apply` may refuse (an address that does not resolve): then nothing
/// changes. Every outcome is one log line and a count, in that order (a
/// count seen on /metrics means its line is written).
pub fn reload(
    role: Role,
    source: &ConfigSource,
    current: &mut Config,
    apply: impl FnOnce(&Config, &Config, &[String]) -> Result<(), String>,
) {
    let new = match source.load() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("reload refused: {e}; the running configuration is kept");
            RELOADS_FAILED.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    match plan(role, current, &new) {
        Plan::Refuse(fields) => {
            tracing::error!(
                "reload refused: {} cannot change without a restart; the running configuration is kept (nothing applied)",
                fields.join(", ")
            );
            RELOADS_FAILED.fetch_add(1, Ordering::Relaxed);
        }
        Plan::Apply(fields) if fields.is_empty() => {
            *current = new;
            tracing::info!("reload: nothing to change");
            RELOADS_OK.fetch_add(1, Ordering::Relaxed);
        }
        Plan::Apply(fields) => {
            if let Err(why) = apply(current, &new, &fields) {
                tracing::error!("reload refused: {why}; the running configuration is kept");
                RELOADS_FAILED.fetch_add(1, Ordering::Relaxed);
                return;
            }
            crate::logging::set_level(new.log.level);
            *current = new;
            tracing::info!("reload: applied {}", fields.join(", "));
            RELOADS_OK.fetch_add(1, Ordering::Relaxed);
        }
    }
}
