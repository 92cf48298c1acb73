//! getHost answers encoded once and patched per answer, for a fraction of
//! an encoding's cost (a FlatBufferBuilder reset, two tables, two vtables
//! and the finish were about 1,100 instructions an answer):
//!
//! - [`RejectedAnswer`]: a `Rejected` answer per admission level, only the
//!   sequence number and the module patched in: what a shard shedding at
//!   its own level sends (issue 12, the agent's own overload). The places
//!   of the three patched fields are found by encoding with marker values.
//! - [`OkAnswer`]: an `Ok` answer per admission level (none, or the one it
//!   carries), the sequence number, the module and the node patched in:
//!   every answered UDP getHost (issue 29). The places are read from the
//!   verified template through the generated accessors' own positions.
//!
//! Either template is checked at once against a second, real encoding; one
//! that fails the check is never used. FlatBuffers leaves out a field equal
//! to its default (0), which changes the layout: an answer with a zero
//! sequence number or module id is encoded in full instead.

use super::{decode, fb, AdmissionLevel, Encoder, Limits, Message, RetCode};
use lbagent_model::{ModuleId, NodeAddr};

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

/// An `Ok` GetHostResp for one admission level (or none).
#[derive(Clone, Debug)]
pub struct OkAnswer {
    level: Option<AdmissionLevel>,
    bytes: Vec<u8>,
    /// Where seq, modid, cmdid and the host struct lie in `bytes` (None:
    /// encode in full).
    at: Option<[usize; 4]>,
}

/// Values for the template: none zero, so that every field is written.
const OK_TEMPLATE: (u32, ModuleId, NodeAddr) = (
    1,
    ModuleId::new(1, 1),
    NodeAddr {
        ip: 0x0100_0001,
        port: 1,
    },
);

/// Other values for the check.
const OK_CHECK: (u32, ModuleId, NodeAddr) = (
    0x0102_0304,
    ModuleId::new(0x0a0b_0c0d, 0x1112_1314),
    NodeAddr {
        ip: 0xc0a8_0102,
        port: 0x2122,
    },
);

impl OkAnswer {
    /// The template for answers carrying `level`, encoded with `enc`.
    pub fn new(enc: &mut Encoder, level: Option<AdmissionLevel>) -> Self {
        let (seq, module, host) = OK_TEMPLATE;
        let bytes = enc
            .get_host_resp(seq, module, RetCode::Ok, Some(host), level)
            .to_vec();
        let mut t = OkAnswer {
            level,
            at: Self::places(&bytes),
            bytes,
        };
        let (seq, module, host) = OK_CHECK;
        let want = enc
            .get_host_resp(seq, module, RetCode::Ok, Some(host), level)
            .to_vec();
        if t.answer(seq, module, host).map(<[u8]>::to_vec) != Some(want) {
            t.at = None;
        }
        t
    }

    /// Where the generated accessors read seq, modid, cmdid and host in
    /// the verified `bytes` (each field present: the template's values are
    /// not zero).
    fn places(bytes: &[u8]) -> Option<[usize; 4]> {
        let Ok(Message::GetHostResp(resp)) = decode(bytes, &Limits::UDP) else {
            return None;
        };
        let (table, vtable) = (resp._tab.loc(), resp._tab.vtable());
        let at = |vt: u16| match vtable.get(vt) {
            0 => None,
            off => Some(table + usize::from(off)),
        };
        Some([
            at(fb::GetHostResp::VT_SEQ)?,
            at(fb::GetHostResp::VT_MODID)?,
            at(fb::GetHostResp::VT_CMDID)?,
            at(fb::GetHostResp::VT_HOST)?,
        ])
    }

    /// The level the answers carry.
    pub fn level(&self) -> Option<AdmissionLevel> {
        self.level
    }

    /// The `Ok` answer to getHost `seq` for `module` naming `host`; `None`
    /// when it cannot be patched (a zero field, or no template): encode it
    /// in full.
    pub fn answer(&mut self, seq: u32, module: ModuleId, host: NodeAddr) -> Option<&[u8]> {
        let [s, m, c, h] = self.at?;
        if seq == 0 || module.modid == 0 || module.cmdid == 0 {
            return None;
        }
        for (i, v) in [(s, seq), (m, module.modid), (c, module.cmdid)] {
            self.bytes[i..i + 4].copy_from_slice(&v.to_le_bytes());
        }
        self.bytes[h..h + 8].copy_from_slice(&fb::Host::from(host).0);
        Some(&self.bytes)
    }

    /// [`OkAnswer::answer`], or the answer encoded in full with `enc` when
    /// it cannot be patched: what every caller sends. Inline: the shard's
    /// hot path (out of line it cost 4 instructions a getHost, callgrind).
    #[inline]
    pub fn answer_or_encode<'a>(
        &'a mut self,
        enc: &'a mut Encoder,
        seq: u32,
        module: ModuleId,
        host: NodeAddr,
    ) -> &'a [u8] {
        let level = self.level;
        if let Some(b) = self.answer(seq, module, host) {
            return b;
        }
        enc.get_host_resp(seq, module, RetCode::Ok, Some(host), level)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_ok_answer_with_a_zero_field_is_left_to_the_encoder() {
        let mut enc = Encoder::new();
        let host = NodeAddr { ip: 1, port: 2 };
        let mut t = OkAnswer::new(&mut enc, None);
        assert!(t.answer(1, ModuleId::new(2, 3), host).is_some());
        assert!(t.answer(0, ModuleId::new(2, 3), host).is_none());
        assert!(t.answer(1, ModuleId::new(0, 3), host).is_none());
        assert!(t.answer(1, ModuleId::new(2, 0), host).is_none());
        // A node of address and port 0 is still a node: the struct is
        // written whatever its values.
        let zero = NodeAddr { ip: 0, port: 0 };
        assert!(t.answer(1, ModuleId::new(2, 3), zero).is_some());
        assert_eq!(t.level(), None);
    }

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

        /// The patched Ok template is byte for byte what the encoder
        /// makes, with and without a level.
        #[test]
        fn the_patched_ok_template_is_the_encoding(
            seq in 1u32.., modid in 1u32.., cmdid in 1u32.., ip: u32, port: u16,
            level in proptest::option::of((1u8..=128, 1u8..=128)),
        ) {
            let mut enc = Encoder::new();
            let level = level.map(|(b, u)| AdmissionLevel::new(b, u));
            let mut t = OkAnswer::new(&mut enc, level);
            let (module, host) = (ModuleId::new(modid, cmdid), NodeAddr { ip, port });
            let got = t.answer(seq, module, host).expect("a template").to_vec();
            let want = enc.get_host_resp(seq, module, RetCode::Ok, Some(host), level).to_vec();
            prop_assert_eq!(got, want);
        }
    }
}
