//! User priorities: a keyed hash of the user id into `1..=128`, with a key
//! that rotates every period (an hour by default).
//!
//! Within one period a user keeps one priority, so a user admitted once is
//! likely admitted for the rest of the period (the paper's point: a
//! composite request of one user passes or fails as a whole); from one
//! period to the next the key changes, so no user stays unlucky for long.
//! The hash is SipHash-1-3 keyed by `(seed, period)`: every service that
//! assigns user priorities must share the seed to agree on them.

use std::hash::Hasher;

use siphasher::sip::SipHasher13;

/// The packaged `admission.user_hash_seed`: the key every process that
/// assigns user priorities shares unless configured otherwise.
pub const DEFAULT_USER_HASH_SEED: u64 = 0x1bad_b002_dead_beef;

/// The packaged `admission.user_key_period_s`: the key rotates hourly.
pub const DEFAULT_USER_KEY_PERIOD_S: u64 = 3600;

/// Constants that separate the two key words from each other and from the
/// user hash (arbitrary, fixed: changing them changes every priority).
const KEY_DOMAIN_0: u64 = 0x6c62_6167_656e_7430; // "lbagent0"
const KEY_DOMAIN_1: u64 = 0x6c62_6167_656e_7431; // "lbagent1"

/// The SipHash key of one period, derived from the secret seed.
fn period_key(seed: u64, period: u64) -> (u64, u64) {
    let word = |domain: u64| {
        let mut h = SipHasher13::new_with_keys(seed, domain);
        h.write_u64(period);
        h.finish()
    };
    (word(KEY_DOMAIN_0), word(KEY_DOMAIN_1))
}

fn hash_user(key: (u64, u64), user: &[u8]) -> u8 {
    let mut h = SipHasher13::new_with_keys(key.0, key.1);
    h.write(user);
    (h.finish() % 128) as u8 + 1
}

/// The user priority (`1..=128`) of `user` in period number `period`
/// (for the default hourly rotation: Unix seconds / 3600) under `seed`.
/// A numeric user id is hashed as its 8 little-endian bytes.
pub fn user_priority(seed: u64, period: u64, user: &[u8]) -> u8 {
    hash_user(period_key(seed, period), user)
}

/// [`user_priority`] with the period's key cached: derive it once per
/// period, not once per request.
#[derive(Clone, Debug)]
pub struct UserPriorities {
    seed: u64,
    period_s: u64,
    cached: Option<(u64, (u64, u64))>,
}

impl UserPriorities {
    /// Priorities under `seed`, the key rotating every `period_s` seconds
    /// (at least 1).
    pub fn new(seed: u64, period_s: u64) -> Self {
        UserPriorities {
            seed,
            period_s: period_s.max(1),
            cached: None,
        }
    }

    /// The period number of a wall-clock time (seconds since the Unix
    /// epoch): the key changes when it does.
    pub fn period_of(&self, unix_s: u64) -> u64 {
        unix_s / self.period_s
    }

    /// The priority of `user` at wall-clock time `unix_s`.
    pub fn priority(&mut self, user: &[u8], unix_s: u64) -> u8 {
        let period = self.period_of(unix_s);
        let key = match self.cached {
            Some((p, key)) if p == period => key,
            _ => {
                let key = period_key(self.seed, period);
                self.cached = Some((period, key));
                key
            }
        };
        hash_user(key, user)
    }

    /// The priority of a numeric user id (its 8 little-endian bytes).
    pub fn priority_of_id(&mut self, user: u64, unix_s: u64) -> u8 {
        self.priority(&user.to_le_bytes(), unix_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: u64 = 3600;
    const T0: u64 = 1_790_000_000 / HOUR * HOUR;

    #[test]
    fn a_user_keeps_one_priority_within_the_hour() {
        let mut p = UserPriorities::new(42, HOUR);
        for user in 0..1000u64 {
            let first = p.priority_of_id(user, T0);
            assert!((1..=128).contains(&first));
            for t in [T0 + 1, T0 + 1800, T0 + HOUR - 1] {
                assert_eq!(p.priority_of_id(user, t), first, "user {user} at {t}");
            }
            assert_eq!(user_priority(42, T0 / HOUR, &user.to_le_bytes()), first);
        }
    }

    #[test]
    fn the_key_rotates_with_the_hour_and_the_seed() {
        let mut p = UserPriorities::new(42, HOUR);
        let users = 10_000u64;
        let changed_hour = (0..users)
            .filter(|&u| p.priority_of_id(u, T0) != p.priority_of_id(u, T0 + HOUR))
            .count();
        let changed_seed = (0..users)
            .filter(|&u| {
                user_priority(42, 7, &u.to_le_bytes()) != user_priority(43, 7, &u.to_le_bytes())
            })
            .count();
        // Independent keys: a user keeps its priority with probability 1/128.
        for changed in [changed_hour, changed_seed] {
            assert!(
                changed > users as usize * 95 / 100,
                "{changed} of {users} changed"
            );
        }
    }

    #[test]
    fn users_spread_over_all_priorities() {
        let mut p = UserPriorities::new(7, HOUR);
        let mut counts = [0u32; 128];
        let users = 128_000u64;
        for u in 0..users {
            counts[usize::from(p.priority_of_id(u, T0)) - 1] += 1;
        }
        // 1000 expected per value; binomial sd ~31, so +-20% is > 6 sd.
        for (i, &c) in counts.iter().enumerate() {
            assert!((800..=1200).contains(&c), "priority {} got {c}", i + 1);
        }
        // String ids spread too.
        let distinct: std::collections::HashSet<u8> = (0..2000)
            .map(|i| p.priority(format!("user-{i}").as_bytes(), T0))
            .collect();
        assert_eq!(distinct.len(), 128);
    }
}
