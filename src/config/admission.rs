//! The `[admission]` table: DAGOR admission control (seed 004), for every
//! service that embeds [`lbagent_admission`] (`lbagent demo-service`) and
//! for the agent's shards when `agent_shedding` is on.

use serde::{Deserialize, Serialize};

use super::{in_range, ConfigError};
use lbagent_admission::{AdmissionLevel, AdmissionParams};

/// The `[admission]` table. Defaults are the paper's.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// A queuing-time window ends after this many milliseconds…
    pub window_ms: u64,
    /// …or this many requests started, whichever comes first.
    pub window_requests: u32,
    /// Overloaded when a window's average queuing time (arrival to start
    /// of processing) exceeds this many milliseconds.
    pub queuing_threshold_ms: u64,
    /// On overload, the admitted count falls to at most (1 − alpha)·N_adm.
    pub alpha: f64,
    /// Otherwise it rises to at least (1 + beta)·N_adm.
    pub beta: f64,
    /// The level never goes below (min_business, min_user).
    pub min_business: u8,
    /// See `min_business`.
    pub min_user: u8,
    /// The secret seed of the user-priority hash; every service that
    /// assigns user priorities must share it.
    pub user_hash_seed: u64,
    /// Seconds between rotations of the user-priority hash key.
    pub user_key_period_s: u64,
    /// An overloaded window keeps the level instead of cutting it when its
    /// queue shrank by at least alpha of what started (admitted ≤
    /// (1 − alpha)·started; a queue deeper than five thresholds must
    /// shrink proportionally faster): the last cuts are already working
    /// (not in the paper; see README).
    /// Never for the agent's own shedding.
    pub hold_while_draining: bool,
    /// The agent forgets a node's downstream level (collaborative
    /// admission) when no report refreshes it within this many ms.
    pub level_timeout_ms: u64,
    /// The agent protects itself: each shard measures every datagram's
    /// queuing time (kernel receive timestamp to handling) and sheds the
    /// getHosts below its own level with `Rejected` (window, alpha, beta
    /// and floor as above). Off by default: unset priorities count as the
    /// least important, so callers that set none are shed first.
    pub agent_shedding: bool,
    /// The agent's shard is overloaded when a window's average queuing
    /// time exceeds this many microseconds.
    pub agent_queuing_threshold_us: u64,
}

/// The default `admission.agent_queuing_threshold_us`: a shard answers in
/// microseconds, and its socket's default receive buffer holds about a
/// millisecond of datagrams at saturation.
pub const AGENT_QUEUING_THRESHOLD_US: u64 = 500;

impl Default for AdmissionConfig {
    fn default() -> Self {
        let p = AdmissionParams::default();
        AdmissionConfig {
            window_ms: p.window_us / 1000,
            window_requests: p.window_requests,
            queuing_threshold_ms: p.queuing_threshold_us / 1000,
            alpha: p.alpha,
            beta: p.beta,
            min_business: p.floor.business,
            min_user: p.floor.user,
            hold_while_draining: p.hold_while_draining,
            user_hash_seed: lbagent_admission::priority::DEFAULT_USER_HASH_SEED,
            user_key_period_s: lbagent_admission::priority::DEFAULT_USER_KEY_PERIOD_S,
            level_timeout_ms: lbagent_lb::LEVEL_TIMEOUT_MS,
            agent_shedding: false,
            agent_queuing_threshold_us: AGENT_QUEUING_THRESHOLD_US,
        }
    }
}

impl AdmissionConfig {
    /// The parameters the admission core takes.
    pub fn params(&self) -> AdmissionParams {
        AdmissionParams {
            window_us: self.window_ms * 1000,
            window_requests: self.window_requests,
            queuing_threshold_us: self.queuing_threshold_ms * 1000,
            alpha: self.alpha,
            beta: self.beta,
            floor: AdmissionLevel::new(self.min_business, self.min_user),
            hold_while_draining: self.hold_while_draining,
            callers_hold_back: false,
        }
    }

    /// The parameters of the agent's own admission control, None when
    /// `agent_shedding` is off.
    pub fn agent_params(&self) -> Option<AdmissionParams> {
        self.agent_shedding.then(|| AdmissionParams {
            queuing_threshold_us: self.agent_queuing_threshold_us,
            hold_while_draining: false,
            callers_hold_back: true,
            ..self.params()
        })
    }

    /// Checks every field against its allowed range.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        in_range("admission.window_ms", self.window_ms, 1, 60_000)?;
        in_range(
            "admission.window_requests",
            self.window_requests,
            1,
            10_000_000,
        )?;
        in_range(
            "admission.queuing_threshold_ms",
            self.queuing_threshold_ms,
            1,
            60_000,
        )?;
        open_fraction("admission.alpha", self.alpha, "0.0 < alpha < 1.0")?;
        open_fraction("admission.beta", self.beta, "0.0 < beta < 1.0")?;
        in_range("admission.min_business", self.min_business, 1, 128)?;
        in_range("admission.min_user", self.min_user, 1, 128)?;
        // TOML integers are signed 64-bit.
        in_range(
            "admission.user_hash_seed",
            self.user_hash_seed,
            0,
            i64::MAX as u64,
        )?;
        in_range(
            "admission.user_key_period_s",
            self.user_key_period_s,
            1,
            31_536_000,
        )?;
        in_range(
            "admission.level_timeout_ms",
            self.level_timeout_ms,
            100,
            3_600_000,
        )?;
        in_range(
            "admission.agent_queuing_threshold_us",
            self.agent_queuing_threshold_us,
            1,
            60_000_000,
        )?;
        Ok(())
    }
}

fn open_fraction(field: &'static str, v: f64, allowed: &str) -> Result<(), ConfigError> {
    if !(v > 0.0 && v < 1.0) {
        return Err(ConfigError::Invalid {
            field,
            value: v.to_string(),
            allowed: allowed.into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::Config;
    use super::*;

    #[test]
    fn defaults_are_the_papers() {
        let a = AdmissionConfig::default();
        assert_eq!(
            (a.window_ms, a.window_requests, a.queuing_threshold_ms),
            (1000, 2000, 20)
        );
        assert_eq!((a.alpha, a.beta), (0.05, 0.01));
        assert_eq!(
            (a.min_business, a.min_user, a.user_key_period_s),
            (1, 128, 3600)
        );
        assert_eq!(a.params(), AdmissionParams::default());
        a.validate().unwrap();
    }

    #[test]
    fn a_bad_value_names_its_field_and_range() {
        let cases = [
            (
                "window_ms = 0",
                "admission.window_ms = 0 is out of range: allowed 1..=60000",
            ),
            (
                "window_requests = 0",
                "admission.window_requests = 0 is out of range: allowed 1..=10000000",
            ),
            (
                "queuing_threshold_ms = 0",
                "admission.queuing_threshold_ms = 0 is out of range: allowed 1..=60000",
            ),
            (
                "alpha = 1.0",
                "admission.alpha = 1 is out of range: allowed 0.0 < alpha < 1.0",
            ),
            (
                "beta = 0.0",
                "admission.beta = 0 is out of range: allowed 0.0 < beta < 1.0",
            ),
            (
                "min_business = 129",
                "admission.min_business = 129 is out of range: allowed 1..=128",
            ),
            (
                "min_user = 0",
                "admission.min_user = 0 is out of range: allowed 1..=128",
            ),
            (
                "agent_queuing_threshold_us = 0",
                "admission.agent_queuing_threshold_us = 0 is out of range: allowed 1..=60000000",
            ),
            (
                "user_key_period_s = 0",
                "admission.user_key_period_s = 0 is out of range: allowed 1..=31536000",
            ),
        ];
        for (line, want) in cases {
            let e = Config::from_toml(&format!("[admission]\n{line}\n")).unwrap_err();
            assert_eq!(e.to_string(), want, "{line}");
        }
    }

    #[test]
    fn the_section_reads_and_overrides() {
        let c = Config::load(
            None,
            &[
                "admission.window_ms=100".into(),
                "admission.alpha=0.1".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.admission.window_ms, 100);
        assert_eq!(c.admission.params().window_us, 100_000);
        assert_eq!(c.admission.alpha, 0.1);
        assert_eq!(c.admission.agent_params(), None, "off by default");
        assert!(c.admission.params().hold_while_draining, "on by default");
        let c = Config::load(
            None,
            &[
                "admission.agent_shedding=true".into(),
                "admission.agent_queuing_threshold_us=750".into(),
            ],
        )
        .unwrap();
        let p = c.admission.agent_params().expect("on");
        assert_eq!(p.queuing_threshold_us, 750);
        assert!(!p.hold_while_draining, "the shard's queue holds everything");
        assert_eq!(p.window_us, 1_000_000);
    }
}
