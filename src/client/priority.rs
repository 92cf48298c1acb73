//! [`Priority`]: the DAGOR priorities a getHost carries.

use super::ClientError;
use lbagent_admission::UserPriorities;

/// A call's DAGOR priorities: business `B` and user `U`, each 1..=128
/// (1 = most important), or 0 = unset (the agent counts it as 128).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Priority {
    /// Business priority `B`.
    pub business: u8,
    /// User priority `U`.
    pub user: u8,
}

impl Priority {
    /// Priorities from their two values.
    pub const fn new(business: u8, user: u8) -> Self {
        Priority { business, user }
    }

    /// Business priority `business` for user `user_id`, whose `U` is the
    /// keyed hash of the id under `keys` (the admission core's rotating
    /// key: one priority per user within a period) at wall-clock time
    /// `unix_s`.
    pub fn of_user(business: u8, user_id: &[u8], keys: &mut UserPriorities, unix_s: u64) -> Self {
        Priority::new(business, keys.priority(user_id, unix_s))
    }

    /// Checks both values are 0..=128.
    ///
    /// # Errors
    /// [`ClientError::BadRequest`] naming the value out of range.
    #[inline]
    pub fn validate(&self) -> Result<(), ClientError> {
        if self.business > 128 || self.user > 128 {
            return Err(self.out_of_range());
        }
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn out_of_range(&self) -> ClientError {
        ClientError::BadRequest(format!(
            "priorities ({}, {}) are out of range: each is 0 (unset) or 1..=128",
            self.business, self.user
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_id_hashes_into_range_and_out_of_range_is_refused() {
        let mut keys = UserPriorities::new(7, 3600);
        let p = Priority::of_user(5, b"alice", &mut keys, 1_800_000_000);
        assert_eq!(p.business, 5);
        assert!((1..=128).contains(&p.user));
        assert_eq!(p, Priority::of_user(5, b"alice", &mut keys, 1_800_000_001));
        assert!(Priority::new(129, 1).validate().is_err());
        assert!(Priority::new(128, 0).validate().is_ok());
    }
}
