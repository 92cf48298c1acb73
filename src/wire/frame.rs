//! TCP framing: every frame is a u32 little-endian length followed by that
//! many bytes, one FlatBuffers buffer. [`FrameDecoder`] reassembles frames
//! from whatever chunks the socket returns; [`write_frame`] writes one.
//!
//! Knows nothing of what a frame holds: decode it with
//! [`super::decode()`] and [`super::Limits::TCP_FRAME`].

use super::Limits;

/// The longest frame payload either side accepts: 16 MiB.
pub const MAX_FRAME_LEN: usize = Limits::TCP_FRAME.max_len;

const PREFIX_LEN: usize = 4;

/// A buffer held past a large frame is given back above this capacity.
const KEEP_CAPACITY: usize = 64 << 10;

/// The most a length prefix alone may make the decoder reserve: the rest
/// of a frame is allocated only as its bytes arrive, so a peer that
/// announces a large frame and sends nothing holds no more than this.
const RESERVE_AHEAD: usize = 64 << 10;

/// Why a byte stream is not a sequence of frames. The stream cannot be
/// resynchronised: close the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A length prefix of 0: a frame carries exactly one message.
    #[error("frame length 0: a frame must carry one message")]
    Empty,
    /// A length prefix above the limit.
    #[error("frame length {len} exceeds the {max}-byte limit")]
    Oversized {
        /// The length announced (or, writing, the length given).
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// Reassembles length-prefixed frames from arbitrary chunks of a stream.
///
/// ```
/// use lbagent_wire::{write_frame, FrameDecoder};
///
/// let mut stream = Vec::new();
/// write_frame(&mut stream, b"first").unwrap();
/// write_frame(&mut stream, b"second").unwrap();
///
/// let mut frames = FrameDecoder::default();
/// // Reads split the stream anywhere: here, inside the second prefix.
/// frames.feed(&stream[..11]);
/// assert_eq!(frames.next_frame().unwrap(), Some(&b"first"[..]));
/// assert_eq!(frames.next_frame().unwrap(), None);
/// frames.feed(&stream[11..]);
/// assert_eq!(frames.next_frame().unwrap(), Some(&b"second"[..]));
/// ```
#[derive(Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    /// Where the first byte not yet yielded is.
    start: usize,
    max_len: usize,
}

impl Default for FrameDecoder {
    /// A decoder accepting frames up to [`MAX_FRAME_LEN`].
    fn default() -> Self {
        Self::new(MAX_FRAME_LEN)
    }
}

impl FrameDecoder {
    /// A decoder accepting frame payloads of 1..=`max_len` bytes.
    pub fn new(max_len: usize) -> Self {
        FrameDecoder {
            buf: Vec::new(),
            start: 0,
            max_len,
        }
    }

    /// Appends bytes read from the stream.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.compact();
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete frame's payload, or `None` until more bytes arrive.
    ///
    /// # Errors
    /// [`FrameError::Empty`] for a length of 0, [`FrameError::Oversized`]
    /// above the limit. The error repeats on every later call: close the
    /// connection.
    pub fn next_frame(&mut self) -> Result<Option<&[u8]>, FrameError> {
        let pending = &self.buf[self.start..];
        let Some(prefix) = pending.first_chunk::<PREFIX_LEN>() else {
            return Ok(None);
        };
        let len = u32::from_le_bytes(*prefix) as usize;
        if len == 0 {
            return Err(FrameError::Empty);
        }
        if len > self.max_len {
            return Err(FrameError::Oversized {
                len,
                max: self.max_len,
            });
        }
        let missing = (PREFIX_LEN + len).saturating_sub(pending.len());
        if missing > 0 {
            // Grow for the rest of the frame in steps the peer pays for
            // with bytes sent, never from the announced length alone.
            self.buf.reserve(missing.min(RESERVE_AHEAD));
            return Ok(None);
        }
        let payload = self.start + PREFIX_LEN;
        self.start = payload + len;
        Ok(Some(&self.buf[payload..self.start]))
    }

    /// Bytes received and not yet yielded as frames (a partial frame when
    /// the stream ends: it was cut).
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Drops the bytes already yielded.
    fn compact(&mut self) {
        if self.start == 0 {
            return;
        }
        self.buf.drain(..self.start);
        self.start = 0;
        if self.buf.is_empty() && self.buf.capacity() > KEEP_CAPACITY {
            self.buf.shrink_to(KEEP_CAPACITY);
        }
    }
}

/// Appends `payload` to `out` as one frame: its length (u32 little-endian),
/// then the bytes.
///
/// # Errors
/// [`FrameError::Empty`] for an empty payload, [`FrameError::Oversized`]
/// above [`MAX_FRAME_LEN`]: the peer would close the connection on either.
pub fn write_frame(out: &mut Vec<u8>, payload: &[u8]) -> Result<(), FrameError> {
    let len = payload.len();
    if len == 0 {
        return Err(FrameError::Empty);
    }
    if len > MAX_FRAME_LEN {
        return Err(FrameError::Oversized {
            len,
            max: MAX_FRAME_LEN,
        });
    }
    out.reserve(PREFIX_LEN + len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.extend_from_slice(payload);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stream(payloads: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for p in payloads {
            write_frame(&mut out, p).unwrap();
        }
        out
    }

    fn drain(dec: &mut FrameDecoder) -> Result<Vec<Vec<u8>>, FrameError> {
        let mut frames = Vec::new();
        while let Some(f) = dec.next_frame()? {
            frames.push(f.to_vec());
        }
        Ok(frames)
    }

    #[test]
    fn many_frames_in_one_chunk_come_out_in_order() {
        let payloads: Vec<Vec<u8>> = (1..=50u8).map(|i| vec![i; usize::from(i)]).collect();
        let refs: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
        let mut dec = FrameDecoder::default();
        dec.feed(&stream(&refs));
        assert_eq!(drain(&mut dec).unwrap(), payloads);
        assert_eq!(dec.buffered(), 0);
    }

    #[test]
    fn a_split_at_every_byte_position_yields_the_same_frames() {
        let payloads: [&[u8]; 3] = [b"alpha", b"b", b"gamma-delta"];
        let bytes = stream(&payloads);
        for cut in 0..=bytes.len() {
            let mut dec = FrameDecoder::default();
            dec.feed(&bytes[..cut]);
            let mut frames = drain(&mut dec).unwrap();
            dec.feed(&bytes[cut..]);
            frames.extend(drain(&mut dec).unwrap());
            assert_eq!(frames, payloads, "cut at {cut}");
        }
    }

    #[test]
    fn one_byte_at_a_time_yields_every_frame() {
        let payloads: [&[u8]; 2] = [b"one", b"two"];
        let mut dec = FrameDecoder::default();
        let mut frames = Vec::new();
        for b in stream(&payloads) {
            dec.feed(&[b]);
            frames.extend(drain(&mut dec).unwrap());
        }
        assert_eq!(frames, payloads);
    }

    #[test]
    fn a_length_above_the_limit_is_refused_before_the_payload_arrives() {
        let mut dec = FrameDecoder::new(8);
        dec.feed(&9u32.to_le_bytes());
        let err = FrameError::Oversized { len: 9, max: 8 };
        assert_eq!(dec.next_frame(), Err(err));
        assert_eq!(dec.next_frame(), Err(err), "the error sticks");
        let mut huge = FrameDecoder::default();
        huge.feed(&u32::MAX.to_le_bytes());
        assert!(matches!(
            huge.next_frame(),
            Err(FrameError::Oversized { .. })
        ));
    }

    #[test]
    fn a_large_announced_length_reserves_nothing_until_its_bytes_arrive() {
        let mut dec = FrameDecoder::default();
        dec.feed(&(MAX_FRAME_LEN as u32).to_le_bytes());
        assert_eq!(dec.next_frame(), Ok(None));
        assert!(
            dec.buf.capacity() <= 2 * RESERVE_AHEAD,
            "a 16 MiB prefix reserved {} bytes",
            dec.buf.capacity()
        );
    }

    #[test]
    fn a_zero_length_is_refused() {
        let mut dec = FrameDecoder::default();
        dec.feed(&[0, 0, 0, 0, 1]);
        assert_eq!(dec.next_frame(), Err(FrameError::Empty));
    }

    #[test]
    fn writing_refuses_what_the_reader_would_refuse() {
        let mut out = Vec::new();
        assert_eq!(write_frame(&mut out, b""), Err(FrameError::Empty));
        let big = vec![0; MAX_FRAME_LEN + 1];
        assert!(matches!(
            write_frame(&mut out, &big),
            Err(FrameError::Oversized { .. })
        ));
        assert!(out.is_empty());
    }

    #[test]
    fn the_buffer_is_given_back_after_a_large_frame() {
        let big = vec![7; 1 << 20];
        let mut dec = FrameDecoder::default();
        dec.feed(&stream(&[&big]));
        assert_eq!(drain(&mut dec).unwrap().len(), 1);
        dec.feed(b"");
        assert!(dec.buf.capacity() <= KEEP_CAPACITY);
    }

    proptest! {
        #[test]
        fn arbitrary_chunks_never_panic(
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..16),
        ) {
            let mut dec = FrameDecoder::new(256);
            for c in &chunks {
                dec.feed(c);
                let _ = drain(&mut dec);
            }
        }

        #[test]
        fn any_split_of_valid_frames_yields_them(
            payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..40), 0..8),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
        ) {
            let refs: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
            let bytes = stream(&refs);
            let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
            cuts.sort_unstable();
            cuts.push(bytes.len());
            let (mut dec, mut at, mut frames) = (FrameDecoder::default(), 0, Vec::new());
            for cut in cuts {
                dec.feed(&bytes[at..cut]);
                at = cut;
                frames.extend(drain(&mut dec).unwrap());
            }
            prop_assert_eq!(frames, payloads);
        }
    }
}
