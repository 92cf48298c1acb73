//! A `Rejected` getHost answer encoded once per admission level, with only
//! the sequence number and the module patched in per answer: what a shard
//! shedding at its own level sends (issue 12, the agent's own overload),
//! for a fraction of an encoding's cost.
//!
//! The places of the three patched fields are found by encoding with marker
//! values, and checked at once against a second, real encoding; a template
//! that fails the check is never used. FlatBuffers leaves out a field equal
//! to its default (0), which changes the layout: an answer with a zero
//! sequence number or module id is encoded in full instead.

use super::{AdmissionLevel, Encoder, RetCode};
use lbagent_model::ModuleId;

/// A `Rejected` GetHostResp for one level.
#[derive(Clone, Debug)]
pub struct RejectedAnswer {
    level: AdmissionLevel,
    bytes: Vec<u8>,
    /// Where seq, modid and cmdid lie in `bytes` (None: encode in full).
    at: Option<[usize; 3]>,
}

/// Marker values for seq, modid, cmdid: distinct, no zero byte.
const MARKS: [u32; 3] = [0x5e5e_5e5e, 0x6d6d_6d6d, 0x6c6c_6c6c];
/// Other values for the check.
const CHECK: [u32; 3] = [0x0102_0304, 0x0a0b_0c0d, 0x1112_1314];

impl RejectedAnswer {
    /// The template for `level`, encoded with `enc`.
    pub fn new(enc: &mut Encoder, level: AdmissionLevel) -> Self {
        let encode = |enc: &mut Encoder, v: [u32; 3]| {
            enc.get_host_resp(
                v[0],
                ModuleId::new(v[1], v[2]),
                RetCode::Rejected,
                None,
                Some(level),
            )
            .to_vec()
        };
        let bytes = encode(enc, MARKS);
        let find = |mark: u32| {
            let m = mark.to_le_bytes();
            let mut hits = bytes.windows(4).enumerate().filter(|(_, w)| *w == m);
            match (hits.next(), hits.next()) {
                (Some((i, _)), None) => Some(i),
                _ => None,
            }
        };
        let mut t = RejectedAnswer {
            level,
            bytes: bytes.clone(),
            at: None,
        };
        if let (Some(s), Some(m), Some(c)) = (find(MARKS[0]), find(MARKS[1]), find(MARKS[2])) {
            t.at = Some([s, m, c]);
            let want = encode(enc, CHECK);
            let patched = t.patch(CHECK[0], ModuleId::new(CHECK[1], CHECK[2]));
            if patched.as_deref() != Some(&want[..]) {
                t.at = None;
            }
        }
        t
    }

    /// The level the answers carry.
    pub fn level(&self) -> AdmissionLevel {
        self.level
    }

    /// The answer to getHost `seq` for `module`; `None` when it cannot be
    /// patched (a zero field, or no template): encode it in full.
    pub fn answer(&mut self, seq: u32, module: ModuleId) -> Option<&[u8]> {
        let at = self.at?;
        if seq == 0 || module.modid == 0 || module.cmdid == 0 {
            return None;
        }
        for (i, v) in at.into_iter().zip([seq, module.modid, module.cmdid]) {
            self.bytes[i..i + 4].copy_from_slice(&v.to_le_bytes());
        }
        Some(&self.bytes)
    }

    fn patch(&mut self, seq: u32, module: ModuleId) -> Option<Vec<u8>> {
        self.answer(seq, module).map(<[u8]>::to_vec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_zero_field_is_left_to_the_encoder() {
        let mut enc = Encoder::new();
        let mut t = RejectedAnswer::new(&mut enc, AdmissionLevel::new(60, 3));
        assert!(t.answer(1, ModuleId::new(2, 3)).is_some());
        assert!(t.answer(0, ModuleId::new(2, 3)).is_none());
        assert!(t.answer(1, ModuleId::new(0, 3)).is_none());
        assert!(t.answer(1, ModuleId::new(2, 0)).is_none());
        assert_eq!(t.level(), AdmissionLevel::new(60, 3));
    }

    proptest! {
        /// The patched template is byte for byte what the encoder makes.
        #[test]
        fn the_patched_template_is_the_encoding(
            seq in 1u32.., modid in 1u32.., cmdid in 1u32..,
            b in 1u8..=128, u in 1u8..=128,
        ) {
            let mut enc = Encoder::new();
            let level = AdmissionLevel::new(b, u);
            let mut t = RejectedAnswer::new(&mut enc, level);
            let module = ModuleId::new(modid, cmdid);
            let got = t.answer(seq, module).expect("a template").to_vec();
            let want = enc.get_host_resp(seq, module, RetCode::Rejected, None, Some(level)).to_vec();
            prop_assert_eq!(got, want);
        }
    }
}
