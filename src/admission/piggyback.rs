//! The admission level on the wire: what a service attaches to its
//! responses so that its callers learn its level (collaborative admission).
//!
//! Two forms:
//! - [`encode`] / [`decode`]: two bytes, `[B*, U*]`, for a service's own
//!   protocol (a header field, a trailer). `[0, 0]` means "no level".
//! - [`to_fb`] / [`from_fb`]: the schema's `AdmissionLevel` struct, as
//!   `GetHostResp.admission_level` and `ReportReq.downstream_level` carry it.
//!
//! Decoding checks the range: a level is `(1..=128, 1..=128)` or none.

use super::AdmissionLevel;
use lbagent_wire::fb;

/// Bytes of the compact encoding.
pub const ENCODED_LEN: usize = 2;

/// Why a received level cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LevelError {
    /// Fewer than [`ENCODED_LEN`] bytes.
    #[error("admission level needs {ENCODED_LEN} bytes, got {0}")]
    Short(usize),
    /// A part outside `1..=128` (and not the `(0, 0)` of "no level").
    #[error("admission level ({business}, {user}) is out of range: each part 1..=128, or both 0 for none")]
    OutOfRange {
        /// The business part received.
        business: u8,
        /// The user part received.
        user: u8,
    },
}

/// The two bytes of a level (`None`: `[0, 0]`).
pub fn encode(level: Option<AdmissionLevel>) -> [u8; ENCODED_LEN] {
    level.map_or([0, 0], |l| [l.business, l.user])
}

/// A level from the first two bytes of `bytes`.
///
/// # Errors
/// [`LevelError::Short`] for fewer than two bytes,
/// [`LevelError::OutOfRange`] for a part outside `1..=128`.
pub fn decode(bytes: &[u8]) -> Result<Option<AdmissionLevel>, LevelError> {
    match bytes {
        [b, u, ..] => check(*b, *u),
        _ => Err(LevelError::Short(bytes.len())),
    }
}

/// The schema struct for a level (`None`: `(0, 0)`).
pub fn to_fb(level: Option<AdmissionLevel>) -> fb::AdmissionLevel {
    let [b, u] = encode(level);
    fb::AdmissionLevel::new(b, u)
}

/// A level from an optional schema struct (absent or `(0, 0)`: none).
///
/// # Errors
/// [`LevelError::OutOfRange`] for a part outside `1..=128`.
pub fn from_fb(level: Option<&fb::AdmissionLevel>) -> Result<Option<AdmissionLevel>, LevelError> {
    level.map_or(Ok(None), |l| check(l.business(), l.user()))
}

fn check(business: u8, user: u8) -> Result<Option<AdmissionLevel>, LevelError> {
    let ok = |p: u8| (1..=128).contains(&p);
    match (business, user) {
        (0, 0) => Ok(None),
        (b, u) if ok(b) && ok(u) => Ok(Some(AdmissionLevel::new(b, u))),
        (business, user) => Err(LevelError::OutOfRange { business, user }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_level_round_trips_through_both_forms() {
        for b in 1..=128u8 {
            for u in [1u8, 2, 64, 127, 128] {
                let l = Some(AdmissionLevel::new(b, u));
                assert_eq!(decode(&encode(l)), Ok(l));
                assert_eq!(from_fb(Some(&to_fb(l))), Ok(l));
            }
        }
        assert_eq!(decode(&encode(None)), Ok(None));
        assert_eq!(from_fb(Some(&to_fb(None))), Ok(None));
        assert_eq!(from_fb(None), Ok(None));
    }

    #[test]
    fn a_bad_level_is_named() {
        assert_eq!(decode(&[5]), Err(LevelError::Short(1)));
        assert_eq!(
            decode(&[0, 7]),
            Err(LevelError::OutOfRange {
                business: 0,
                user: 7
            })
        );
        let e = from_fb(Some(&fb::AdmissionLevel::new(129, 1))).unwrap_err();
        assert_eq!(
            e.to_string(),
            "admission level (129, 1) is out of range: each part 1..=128, or both 0 for none"
        );
        // Trailing bytes belong to the service's own protocol.
        assert_eq!(decode(&[3, 4, 99]), Ok(Some(AdmissionLevel::new(3, 4))));
    }
}
