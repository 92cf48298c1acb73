//! Finding the local agent with no configuration: the heartbeat file says
//! whether the agent is alive, how many shards it runs, on which ports, and
//! where its static route file is.
//!
//! Owns the client's [`HeartbeatReader`] and what it last read. The cached
//! path of the client (no request sent) looks at nothing here: it compares
//! its tick with [`Locator::alive_until`] of the last full check. Before
//! every request the client asks [`Locator::fresh`]: one atomic load of the
//! header's sequence word and one comparison with the client's coarse
//! monotonic clock. While the sequence has not moved since the last full
//! check, the beat is the one seen then, and its age is that age plus the
//! monotonic time since, so "alive" holds until a precomputed instant
//! (`alive_until`, at most [`DEFAULT_MAX_AGE_MS`] after the beat). When the
//! sequence moved (every beat: once a second) or that instant passed,
//! [`Locator::check`] loads the beat and compares it with Unix time, as
//! before; the whole header is re-read only when the beat moved, when the
//! file was replaced, or when a request failed ([`Locator::reread`]). It
//! must not touch sockets or the static route file.
//!
//! [`DEFAULT_MAX_AGE_MS`]: lbagent_host::heartbeat::DEFAULT_MAX_AGE_MS

use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::link::ShmTarget;
use lbagent_host::heartbeat::{
    is_alive, AgentInfo, HeartbeatError, HeartbeatReader, DEFAULT_PATH, LEGACY_PATH,
};

/// Where the agent's shards listen, as the heartbeat header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Endpoints {
    /// The address to send to: the agent's bind address, or loopback when
    /// it binds every address.
    pub ip: Ipv4Addr,
    /// Shard 0's UDP port; shard i listens on `base_port + i`.
    pub base_port: u16,
    /// Number of shards, at least 1.
    pub shards: u32,
}

/// The most shards a heartbeat header may name: the agent's own bound
/// (`agent.shards` is at most 1024). A larger count is a corrupt header,
/// and the client sizes per-shard tables from it.
pub(crate) const MAX_SHARDS: u32 = 1_024;

impl Endpoints {
    /// The endpoints of a header, or why the header cannot be used. Every
    /// field is checked before anything is sized or computed from it.
    pub fn from_info(info: &AgentInfo) -> Result<Endpoints, String> {
        if info.shards == 0 {
            return Err("the heartbeat header says the agent runs 0 shards".into());
        }
        if info.shards > MAX_SHARDS {
            return Err(format!(
                "the heartbeat header says the agent runs {} shards, at most {MAX_SHARDS} \
                 (a corrupt or foreign heartbeat file?)",
                info.shards
            ));
        }
        if info.base_port == 0 {
            return Err("the heartbeat header says the agent listens on port 0".into());
        }
        // In u64: no shard count can wrap the sum.
        let last = u64::from(info.base_port) + u64::from(info.shards) - 1;
        if last > u64::from(u16::MAX) {
            return Err(format!(
                "the heartbeat header's ports {}..{last} do not fit in 65535",
                info.base_port,
            ));
        }
        let ip = if info.bind.is_unspecified() {
            Ipv4Addr::LOCALHOST
        } else {
            info.bind
        };
        Ok(Endpoints {
            ip,
            base_port: info.base_port,
            shards: info.shards,
        })
    }

    /// The address of shard `shard` (< `shards`).
    pub fn shard_addr(&self, shard: u32) -> SocketAddr {
        // from_info checked that every shard's port fits.
        SocketAddr::from((self.ip, (u32::from(self.base_port) + shard) as u16))
    }
}

/// What [`Locator::check`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Liveness {
    /// The agent beat within the allowed age, at `beat` (unix ms), and its
    /// header names usable endpoints.
    Alive {
        /// The beat seen, unix milliseconds.
        beat: u64,
    },
    /// The agent is down, for the reason given.
    Down(String),
}

/// `(device, inode)`: tells a replaced file from the one mapped.
type FileId = (u64, u64);

fn file_id(path: &Path) -> Option<FileId> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// The client's view of the heartbeat file.
#[derive(Debug)]
pub(crate) struct Locator {
    path: PathBuf,
    max_age_ms: u64,
    reader: Option<(HeartbeatReader, Option<FileId>)>,
    /// The last header read, usable or not.
    info: Option<AgentInfo>,
    /// The shared-memory regions the last header offered, with its pid.
    shm: Option<ShmTarget>,
    /// The endpoints of the last header, when usable.
    endpoints: Result<Endpoints, String>,
    /// The beat at which the header was last read.
    header_beat: u64,
    /// [`HeartbeatReader::header_stamp`] when the header was last read: at
    /// a new beat the header is read again only when it changed.
    stamp: Option<u64>,
    /// Bumped whenever `endpoints` changes (sockets must be rebuilt).
    generation: u64,
    /// The static route file while no header names one.
    default_snapshot: PathBuf,
    /// What [`Locator::fresh`] compares with: set by a [`Locator::check`]
    /// that found the agent alive, cleared by anything else.
    fast: Fast,
    /// The mapped file is the old agents' [`LEGACY_PATH`], read because
    /// nothing is at the default path.
    legacy: bool,
}

/// The last full check that found the agent alive.
#[derive(Clone, Copy, Debug)]
struct Fast {
    /// The header's sequence word then (even).
    seq: u64,
    /// The monotonic millisecond until which that beat is young enough.
    alive_until: u64,
}

impl Fast {
    /// No answer to trust: the sequence word never reaches `u64::MAX` (so
    /// `fresh` is false even at time 0), and the time check fails first
    /// at any later time.
    const NONE: Fast = Fast {
        seq: u64::MAX,
        alive_until: 0,
    };
}

impl Locator {
    /// A locator for the heartbeat file at `path`; `default_snapshot` is the
    /// static route file used until a header names one.
    pub fn new(path: PathBuf, max_age_ms: u64, default_snapshot: PathBuf) -> Self {
        Locator {
            path,
            max_age_ms,
            reader: None,
            info: None,
            shm: None,
            endpoints: Err("no heartbeat read yet".into()),
            header_beat: 0,
            stamp: None,
            generation: 0,
            default_snapshot,
            fast: Fast::NONE,
            legacy: false,
        }
    }

    /// True when the agent is alive at `now_mono_ms` (the client's
    /// monotonic clock) by the last [`Locator::check`], and the heartbeat
    /// has not been written since: the endpoints are those of that check.
    /// One atomic load. False means "ask [`Locator::check`]", not "down".
    #[inline(always)]
    pub fn fresh(&self, now_mono_ms: u64) -> bool {
        // `Fast::NONE` fails the time check (after 0) or the sequence's.
        now_mono_ms <= self.fast.alive_until
            && match &self.reader {
                Some((r, _)) => r.sequence() == self.fast.seq,
                None => false,
            }
    }

    /// The monotonic millisecond until which the beat seen by the last
    /// [`Locator::check`] is young enough (the client's cached path goes by
    /// it alone); 0 unless that check found the agent alive, and after
    /// [`Locator::reread`].
    pub fn alive_until(&self) -> u64 {
        self.fast.alive_until
    }

    /// Whether the agent is alive at `now_unix_ms`. Opens the file when it
    /// is not open yet (or was replaced), and re-reads the header when the
    /// beat moved since it was last read. `now_mono_ms` (the client's
    /// monotonic clock, read at the same moment) dates the answer for
    /// [`Locator::fresh`].
    pub fn check(&mut self, now_unix_ms: u64, now_mono_ms: u64) -> Liveness {
        self.fast = Fast::NONE;
        let live = self.check_slow(now_unix_ms);
        if let (Liveness::Alive { beat }, Some((r, _))) = (&live, &self.reader) {
            // The sequence is loaded after the beat: if the agent beat in
            // between, the next `fresh` sees another value and checks again.
            let seq = r.sequence();
            if seq & 1 == 0 {
                let until = i128::from(now_mono_ms) + i128::from(self.max_age_ms)
                    - (i128::from(now_unix_ms) - i128::from(*beat));
                self.fast = Fast {
                    seq,
                    alive_until: until.clamp(0, i128::from(u64::MAX)) as u64,
                };
            }
        }
        live
    }

    fn check_slow(&mut self, now_unix_ms: u64) -> Liveness {
        if self.reader.is_none() {
            if let Err(why) = self.open() {
                return Liveness::Down(why);
            }
        }
        let beat = match self.reader.as_ref().map(|(r, _)| r.beat_unix_ms()) {
            Some(Ok(b)) => b,
            Some(Err(e)) => {
                // Re-open next time: the file may be re-initialised.
                self.reader = None;
                return Liveness::Down(format!("{e}"));
            }
            None => return Liveness::Down("heartbeat file not open".into()),
        };
        if !is_alive(beat, now_unix_ms, self.max_age_ms) {
            if self.replaced() {
                // A new agent may have created a new file: look at it once.
                self.reader = None;
                if self.open().is_ok() {
                    if let Some(Ok(b)) = self.reader.as_ref().map(|(r, _)| r.beat_unix_ms()) {
                        if is_alive(b, now_unix_ms, self.max_age_ms) {
                            return self.alive(b);
                        }
                    }
                }
            }
            return Liveness::Down(stale_reason(&self.path, beat, now_unix_ms, self.max_age_ms));
        }
        self.alive(beat)
    }

    /// The agent beat at `beat`: re-reads the header if the beat moved and
    /// the header's stamp changed (a new agent in place).
    fn alive(&mut self, beat: u64) -> Liveness {
        if beat != self.header_beat {
            let stamp = self
                .reader
                .as_ref()
                .and_then(|(r, _)| r.header_stamp().ok());
            if stamp.is_none() || stamp != self.stamp {
                self.read_header();
            }
            self.header_beat = beat;
        }
        match &self.endpoints {
            Ok(_) => Liveness::Alive { beat },
            Err(why) => Liveness::Down(why.clone()),
        }
    }

    /// Re-reads the header now (after a failed request: the agent may have
    /// restarted on other ports). True when the endpoints changed.
    pub fn reread(&mut self) -> bool {
        self.fast = Fast::NONE;
        let before = self.generation;
        if self.replaced() {
            self.reader = None;
            let _ = self.open();
        } else {
            self.read_header();
        }
        self.generation != before
    }

    /// The endpoints of the last usable header.
    pub fn endpoints(&self) -> Option<Endpoints> {
        self.endpoints.as_ref().ok().copied()
    }

    /// Bumped whenever [`Self::endpoints`] changes.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The shared-memory regions the agent offers (their prefix) and its
    /// pid, as the last header read says.
    pub fn shm(&self) -> Option<&ShmTarget> {
        self.shm.as_ref()
    }

    /// The last header read (the agent's pid, ports, snapshot path).
    pub fn info(&self) -> Option<&AgentInfo> {
        self.info.as_ref()
    }

    /// The static route file: the one the last header named, else the
    /// configured default.
    pub fn snapshot_path(&self) -> &Path {
        match &self.info {
            Some(i) if !i.snapshot_path.as_os_str().is_empty() => &i.snapshot_path,
            _ => &self.default_snapshot,
        }
    }

    /// Opens the file and reads its header.
    fn open(&mut self) -> Result<(), String> {
        // The file's identity before it is opened: one replaced in between
        // is then noticed at the next check.
        let id = file_id(&self.path);
        let (reader, id, legacy) = match HeartbeatReader::open(&self.path) {
            Ok(r) => (r, id, false),
            // An agent of before issue 27 left its heartbeat in /dev/shm:
            // read it only if it passes the same checks (owned by root or
            // this process's user; /dev/shm's owner vouches for nobody).
            Err(missing @ HeartbeatError::Missing { .. })
                if self.path == Path::new(DEFAULT_PATH) =>
            {
                let id = file_id(Path::new(LEGACY_PATH));
                match HeartbeatReader::open(Path::new(LEGACY_PATH)) {
                    Ok(r) => (r, id, true),
                    Err(HeartbeatError::Missing { .. }) => return Err(missing.to_string()),
                    Err(e) => return Err(e.to_string()),
                }
            }
            Err(e) => return Err(e.to_string()),
        };
        self.legacy = legacy;
        self.reader = Some((reader, id));
        self.read_header();
        Ok(())
    }

    /// True when the path no longer names the file that is mapped (deleted,
    /// or replaced by another file).
    fn replaced(&self) -> bool {
        if self.legacy && file_id(&self.path).is_some() {
            // The default path appeared: the agent moved there.
            return true;
        }
        match &self.reader {
            Some((r, Some(id))) => file_id(r.path()) != Some(*id),
            Some((_, None)) => true,
            None => false,
        }
    }

    fn read_header(&mut self) {
        let Some((reader, _)) = &self.reader else {
            return;
        };
        self.stamp = reader.header_stamp().ok();
        let endpoints = match reader.read() {
            Ok(hb) => {
                let e = Endpoints::from_info(&hb.info);
                // A corrupt extension offers nothing: UDP.
                self.shm = reader.shm_prefix().ok().flatten().map(|p| (p, hb.info.pid));
                self.info = Some(hb.info);
                e
            }
            Err(e) => {
                self.shm = None;
                Err(e.to_string())
            }
        };
        let changed = match (&self.endpoints, &endpoints) {
            (Ok(a), Ok(b)) => a != b,
            (Err(_), Err(_)) => false,
            _ => true,
        };
        if changed {
            self.generation += 1;
        }
        self.endpoints = endpoints;
    }
}

fn stale_reason(path: &Path, beat: u64, now: u64, max_age: u64) -> String {
    if beat == 0 {
        return format!(
            "heartbeat file {} has not been beaten yet: the agent is starting or died at start",
            path.display()
        );
    }
    if beat > now {
        return format!(
            "heartbeat file {} shows a beat {} ms in the future (more than {max_age} ms): was the clock stepped?",
            path.display(),
            beat - now
        );
    }
    format!(
        "heartbeat file {} last beat {} ms ago (more than {max_age} ms): is the agent running?",
        path.display(),
        now - beat
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbagent_host::heartbeat::HeartbeatWriter;

    fn info(shards: u32, base_port: u16, snapshot: &str) -> AgentInfo {
        AgentInfo {
            shards,
            base_port,
            bind: Ipv4Addr::UNSPECIFIED,
            pid: 1,
            snapshot_path: PathBuf::from(snapshot),
        }
    }

    #[test]
    fn endpoints_refuse_headers_that_name_no_port() {
        assert!(Endpoints::from_info(&info(0, 9000, "/s")).is_err());
        assert!(Endpoints::from_info(&info(1, 0, "/s")).is_err());
        assert!(Endpoints::from_info(&info(2, 65535, "/s")).is_err());
        // Counts that would wrap `base_port + shards - 1` in u32.
        for shards in [u32::MAX, u32::MAX - 8999, 1 << 31] {
            let e = Endpoints::from_info(&info(shards, 9000, "/s")).unwrap_err();
            assert!(e.contains("shards, at most 1024"), "{e}");
        }
        let e = Endpoints::from_info(&info(1_025, 1, "/s")).unwrap_err();
        assert!(e.contains("1025 shards"), "{e}");
        assert!(Endpoints::from_info(&info(MAX_SHARDS, 64_512, "/s")).is_ok());
        let e = Endpoints::from_info(&info(MAX_SHARDS, 64_513, "/s")).unwrap_err();
        assert!(e.contains("64513..65536"), "{e}");
        let e = Endpoints::from_info(&info(2, 65534, "/s")).unwrap();
        assert_eq!(e.ip, Ipv4Addr::LOCALHOST, "0.0.0.0 is reached on loopback");
        assert_eq!(e.shard_addr(1), "127.0.0.1:65535".parse().unwrap());
    }

    #[test]
    fn a_missing_file_is_down_and_the_default_snapshot_is_used() {
        let dir = tempfile::tempdir().unwrap();
        let mut l = Locator::new(dir.path().join("hb"), 2000, "/default".into());
        match l.check(10_000, 10_000) {
            Liveness::Down(why) => assert!(why.contains("does not exist"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(l.snapshot_path(), Path::new("/default"));
    }

    #[test]
    fn beats_decide_liveness_and_a_restart_on_other_ports_is_noticed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let w = HeartbeatWriter::create(&path, &info(2, 9000, "/snap")).unwrap();
        let mut l = Locator::new(path.clone(), 2000, "/default".into());
        assert!(
            matches!(l.check(10_000, 10_000), Liveness::Down(ref w) if w.contains("not been beaten"))
        );
        assert_eq!(
            l.snapshot_path(),
            Path::new("/snap"),
            "a stale header still names the file"
        );
        w.beat(10_000);
        assert_eq!(l.check(11_000, 11_000), Liveness::Alive { beat: 10_000 });
        assert_eq!(l.endpoints().unwrap().base_port, 9000);
        let g = l.generation();
        assert!(
            matches!(l.check(12_001, 12_001), Liveness::Down(ref w) if w.contains("2001 ms ago"))
        );
        // The agent restarts in place on other ports and beats again (the
        // old one gone: it held the file's lock).
        drop(w);
        let w2 = HeartbeatWriter::create(&path, &info(3, 9100, "/snap2")).unwrap();
        w2.beat(13_000);
        assert_eq!(l.check(13_100, 13_100), Liveness::Alive { beat: 13_000 });
        assert_eq!(l.endpoints().unwrap().shards, 3);
        assert!(l.generation() > g);
        assert_eq!(l.snapshot_path(), Path::new("/snap2"));
    }

    #[test]
    fn a_replaced_file_is_reopened() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let w = HeartbeatWriter::create(&path, &info(1, 9000, "/a")).unwrap();
        w.beat(1_000);
        let mut l = Locator::new(path.clone(), 2000, "/default".into());
        assert_eq!(l.check(1_500, 1_500), Liveness::Alive { beat: 1_000 });
        drop(w);
        std::fs::remove_file(&path).unwrap();
        let w = HeartbeatWriter::create(&path, &info(1, 9200, "/b")).unwrap();
        w.beat(5_000);
        assert_eq!(l.check(5_100, 5_100), Liveness::Alive { beat: 5_000 });
        assert_eq!(l.endpoints().unwrap().base_port, 9200);
    }

    #[test]
    fn an_unusable_header_is_down_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let w = HeartbeatWriter::create(&path, &info(0, 9000, "/a")).unwrap();
        w.beat(1_000);
        let mut l = Locator::new(path, 2000, "/default".into());
        assert!(matches!(l.check(1_000, 1_000), Liveness::Down(ref w) if w.contains("0 shards")));
    }

    #[test]
    fn fresh_holds_until_the_beat_is_too_old_on_the_monotonic_clock_and_stops_at_a_new_beat() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let w = HeartbeatWriter::create(&path, &info(1, 9000, "/a")).unwrap();
        let mut l = Locator::new(path, 2000, "/default".into());
        assert!(!l.fresh(0), "nothing checked yet");
        w.beat(10_000);
        // Unix 10_500 (the beat is 500 ms old) is monotonic 700_000 here.
        assert_eq!(l.check(10_500, 700_000), Liveness::Alive { beat: 10_000 });
        assert!(l.fresh(700_000));
        assert!(l.fresh(701_500), "1500 ms later the beat is 2000 ms old");
        assert!(!l.fresh(701_501), "2001 ms old: ask check");
        assert!(matches!(l.check(12_001, 701_501), Liveness::Down(_)));
        assert!(!l.fresh(701_501), "down is never fresh");
        // A beat from the future (the clocks disagree by 1 s) ages from there.
        w.beat(13_000);
        assert_eq!(l.check(12_000, 800_000), Liveness::Alive { beat: 13_000 });
        assert!(l.fresh(803_000) && !l.fresh(803_001));
        // Any write of the agent (a beat) makes it look again.
        w.beat(13_000);
        assert!(!l.fresh(800_001));
        assert_eq!(l.check(12_001, 800_001), Liveness::Alive { beat: 13_000 });
        assert!(l.fresh(800_002));
        // A request failed: re-read, and check again before trusting it.
        l.reread();
        assert!(!l.fresh(800_002));
    }

    #[test]
    fn the_header_stamp_ignores_beats_and_sees_every_other_field() {
        use lbagent_host::heartbeat::HeartbeatReader;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let w = HeartbeatWriter::create(&path, &info(1, 9000, "/a")).unwrap();
        let r = HeartbeatReader::open(&path).unwrap();
        let s0 = r.header_stamp().unwrap();
        w.beat(5_000);
        assert_eq!(r.header_stamp().unwrap(), s0);
        drop(w);
        let mut seen = vec![s0];
        for i in [
            info(1, 9000, "/b"),
            info(2, 9000, "/a"),
            info(1, 9001, "/a"),
        ] {
            let w = HeartbeatWriter::create(&path, &i).unwrap();
            let s = r.header_stamp().unwrap();
            assert!(!seen.contains(&s), "{i:?}");
            seen.push(s);
            drop(w);
        }
    }
}
