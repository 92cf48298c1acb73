//! The heartbeat: a small shared-memory file (in the agent's directory,
//! `/run/lbagent` in production, a tmpfs) through which the agent tells
//! applications on the host that it is alive, and where to find the static
//! route file when it is not.
//!
//! The control core owns the only [`HeartbeatWriter`]: it publishes an
//! [`AgentInfo`] header once at start and calls [`HeartbeatWriter::beat`]
//! every second. The client library opens a [`HeartbeatReader`] and, before
//! every getHost, compares [`HeartbeatReader::beat_unix_ms`] with its clock
//! through [`is_alive`]; when the beat is more than 2 s old
//! ([`DEFAULT_MAX_AGE_MS`]) it answers from the snapshot file named in the
//! header (see [`super::snapshot`]) instead of asking the agent.
//!
//! This module owns the file's layout and its consistency protocol. It must
//! not touch the snapshot file, sockets or clocks: time is an argument.
//!
//! # Layout (version 1)
//!
//! One file of [`FILE_LEN`] bytes, of which the first [`HEADER_LEN`] are
//! used. Every field is a native-endian word (the file never leaves the host)
//! read and written only through atomics; offsets are in bytes.
//!
//! | offset | size | field |
//! |---:|---:|---|
//! | 0 | 8 | `seq`: the seqlock sequence, odd while a write is in progress |
//! | 8 | 4 | magic, [`MAGIC`] (`"LBHB"` on a little-endian host) |
//! | 12 | 4 | layout version, [`LAYOUT_VERSION`] |
//! | 16 | 4 | shard count |
//! | 20 | 4 | bind IPv4 address, as `u32::from(Ipv4Addr)` |
//! | 24 | 4 | agent pid |
//! | 28 | 4 | base UDP port (low 16 bits; the high 16 are 0) |
//! | 32 | 8 | last beat, unix milliseconds (0: not beaten yet) |
//! | 40 | 4 | snapshot path length in bytes |
//! | 44 | 4 | reserved, 0 |
//! | 48 | 512 | snapshot path bytes ([`SNAPSHOT_PATH_MAX`]), zero padded |
//!
//! `seq`, magic and version keep their offsets in every future version, so a
//! reader can always tell which layout it is looking at.
//!
//! ## The shared-memory extension (still version 1)
//!
//! Past the header, inside the same page and under the same seqlock, the
//! agent names its shared-memory regions (issue 16, `[shm]`); readers of
//! the header alone ignore it, and an agent without it leaves it zero:
//!
//! | offset | size | field |
//! |---:|---:|---|
//! | 576 | 4 | [`SHM_MAGIC`] (`"LBSX"`) when regions are offered, else 0 |
//! | 580 | 4 | region prefix length in bytes |
//! | 584 | 512 | region prefix bytes; shard i's region is `PREFIX.i` |
//!
//! # Consistency
//!
//! A seqlock: the writer makes `seq` odd, writes, then makes it even again
//! (release). A reader loads `seq`, copies the fields, and loads `seq` again
//! (acquire fences between); it keeps the copy only if both loads saw the same
//! even value, and gives up with [`HeartbeatError::Unstable`] after a bounded
//! number of attempts, which in practice means the writer died mid-write:
//! treat it like a stale beat.
//!
//! # Ownership
//!
//! Only the agent's user can plant the file ([`crate::owned`]): the agent
//! makes its directory if needed and refuses one others can write,
//! creates the file exclusively or adopts only its own, and takes its
//! lock on `PATH.lock` (mode 0600, so no other user can hold it). A reader
//! checks the file's owner and mode, and its directory's, before it
//! trusts a byte of it.
//!
//! # Restarts
//!
//! [`HeartbeatWriter::create`] reuses an existing file in place (it never
//! unlinks or replaces it, and never shrinks it), so a reader that mapped the
//! file before an agent restart sees the new agent's header and beats. A
//! writer that crashed mid-write leaves `seq` odd; the next `create` makes it
//! even again.

use std::cell::Cell;
use std::ffi::OsStr;
use std::io;
use std::marker::PhantomData;
use std::net::Ipv4Addr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};
use nix::fcntl::{Flock, FlockArg};

/// The magic word at offset 8: the bytes `"LBHB"` read as a little-endian `u32`.
pub const MAGIC: u32 = u32::from_le_bytes(*b"LBHB");

/// The layout version this code writes and reads.
pub const LAYOUT_VERSION: u32 = 1;

/// The longest snapshot path the header holds, in bytes.
pub const SNAPSHOT_PATH_MAX: usize = 512;

/// The bytes of the file the header uses; a shorter file is truncated.
pub const HEADER_LEN: usize = OFF_PATH + SNAPSHOT_PATH_MAX;

/// The shared-memory extension's magic word: `"LBSX"`.
pub const SHM_MAGIC: u32 = u32::from_le_bytes(*b"LBSX");

const OFF_SHM_MAGIC: usize = 576;
const OFF_SHM_LEN: usize = 580;
const OFF_SHM_PATH: usize = 584;
/// The end of the extension: a file at least this long may carry it.
const EXT_END: usize = OFF_SHM_PATH + SNAPSHOT_PATH_MAX;

/// The size the writer gives a new (or shorter) file: one page.
pub const FILE_LEN: u64 = 4096;

/// The seed's rule: a beat more than 2 s old means the agent is down.
pub const DEFAULT_MAX_AGE_MS: u64 = 2_000;

/// The packaged heartbeat path (`agent.heartbeat_path`), where clients look
/// unless told otherwise: in the agent's own directory (the unit's
/// `RuntimeDirectory=lbagent`), which only the agent's user can write.
pub const DEFAULT_PATH: &str = "/run/lbagent/heartbeat";

/// Where agents before issue 27 wrote the heartbeat. Clients that find no
/// file at [`DEFAULT_PATH`] read this one, only if it passes the same
/// checks ([`crate::owned::open_trusted`]): owned by root or the client's
/// own user (`/dev/shm` is anyone's, so its owner says nothing).
pub const LEGACY_PATH: &str = "/dev/shm/lbagent.heartbeat";

const OFF_SEQ: usize = 0;
const OFF_MAGIC: usize = 8;
const OFF_VERSION: usize = 12;
const OFF_SHARDS: usize = 16;
const OFF_BIND: usize = 20;
const OFF_PID: usize = 24;
const OFF_BASE_PORT: usize = 28;
const OFF_BEAT: usize = 32;
const OFF_PATH_LEN: usize = 40;
const OFF_RESERVED: usize = 44;
const OFF_PATH: usize = 48;
const PATH_WORDS: usize = SNAPSHOT_PATH_MAX / 8;

/// Read attempts before a reader reports [`HeartbeatError::Unstable`].
const MAX_ATTEMPTS: u32 = 1_024;
/// Attempts that only spin; later ones also yield, so that a writer
/// descheduled mid-write on the reader's core can finish.
const SPIN_ATTEMPTS: u32 = 128;

/// What the agent publishes about itself: how to reach it and where its
/// static route file is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentInfo {
    /// Number of UDP shards; shard `i` listens on `base_port + i`.
    pub shards: u32,
    /// The UDP port of shard 0.
    pub base_port: u16,
    /// The address the shards are bound to.
    pub bind: Ipv4Addr,
    /// The agent's process id.
    pub pid: u32,
    /// Where the agent writes the static route file (at most
    /// [`SNAPSHOT_PATH_MAX`] bytes).
    pub snapshot_path: PathBuf,
}

/// One consistent reading of the heartbeat file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    /// The header the running (or last) agent published.
    pub info: AgentInfo,
    /// The last beat, unix milliseconds; 0 if the agent has not beaten yet.
    pub beat_unix_ms: u64,
}

/// Why the heartbeat file cannot be written or read. For a reader, every
/// variant means: treat the agent as down and use the static route file.
#[derive(Debug, thiserror::Error)]
pub enum HeartbeatError {
    /// The file does not exist: the agent has never run on this host (or the
    /// path is wrong).
    #[error("heartbeat file {path} does not exist: is the agent running?")]
    Missing {
        /// The heartbeat file.
        path: PathBuf,
    },
    /// The file is shorter than the header.
    #[error("heartbeat file {path} is truncated: {len} bytes, the header needs {min}")]
    Truncated {
        /// The heartbeat file.
        path: PathBuf,
        /// Its length.
        len: u64,
        /// The header's length, [`HEADER_LEN`].
        min: usize,
    },
    /// The magic word is wrong: not a heartbeat file, or not initialised yet.
    #[error("heartbeat file {path} has bad magic {found:#010x}, expected {MAGIC:#010x}")]
    BadMagic {
        /// The heartbeat file.
        path: PathBuf,
        /// The word found at offset 8.
        found: u32,
    },
    /// Written by an agent with a layout this code does not read.
    #[error("heartbeat file {path} has layout version {found}, this build reads {LAYOUT_VERSION}")]
    UnsupportedVersion {
        /// The heartbeat file.
        path: PathBuf,
        /// The version found.
        found: u32,
    },
    /// The snapshot path does not fit the header's field: too long at
    /// create, or a corrupt length when read.
    #[error(
        "heartbeat file {path}: snapshot path of {len} bytes is longer than the {SNAPSHOT_PATH_MAX}-byte field"
    )]
    PathTooLong {
        /// The heartbeat file.
        path: PathBuf,
        /// The path's length in bytes.
        len: usize,
    },
    /// The path names something other than a regular file (a FIFO, a
    /// device, a directory, a socket): nothing is mapped from it.
    #[error("heartbeat file {path} is a {kind}, not a regular file")]
    NotAFile {
        /// The path.
        path: PathBuf,
        /// What it is: "directory", "FIFO", "character device", ...
        kind: &'static str,
    },
    /// A header field holds a value the writer never stores (a corrupt or
    /// foreign file).
    #[error("heartbeat file {path} is corrupt: {field} is {value}, {allowed}")]
    BadField {
        /// The heartbeat file.
        path: PathBuf,
        /// The field.
        field: &'static str,
        /// The value found.
        value: u64,
        /// What the field may hold.
        allowed: &'static str,
    },
    /// The writer kept changing the header for every attempt: it is most
    /// likely dead mid-write.
    #[error("heartbeat file {path} is unstable: no consistent read in {attempts} attempts")]
    Unstable {
        /// The heartbeat file.
        path: PathBuf,
        /// The attempts made.
        attempts: u32,
    },
    /// Another live process holds the file's lock: one agent per
    /// heartbeat path.
    #[error("heartbeat file {path} is owned by another agent ({holder}): stop it, or give this one another agent.heartbeat_path")]
    Locked {
        /// The heartbeat file.
        path: PathBuf,
        /// Who holds it: `pid N` as its header says, or why that is unknown.
        holder: String,
    },
    /// The file or its directory breaks the ownership rules of
    /// [`crate::owned`]: another user could have planted or changed it.
    #[error("heartbeat file: {0}")]
    Untrusted(crate::owned::OwnedError),
    /// A system call failed.
    #[error("cannot {op} heartbeat file {path}: {error}")]
    Io {
        /// What was being done: "open", "size", "map", ...
        op: &'static str,
        /// The heartbeat file.
        path: PathBuf,
        /// The system's error (in the message, not a `source()`: a chain
        /// printed with `{:#}` would name it twice).
        error: io::Error,
    },
}

/// `true` when a beat at `beat_unix_ms` shows the agent alive at
/// `now_unix_ms`: it has beaten (non-zero) and the beat is at most
/// `max_age_ms` away from now, in either direction (a beat far in the future
/// means the clock was stepped back; the live agent's next beat fixes it).
pub fn is_alive(beat_unix_ms: u64, now_unix_ms: u64, max_age_ms: u64) -> bool {
    beat_unix_ms != 0 && beat_unix_ms.abs_diff(now_unix_ms) <= max_age_ms
}

// === impl Shm ===

/// The header's words in a mapping, as atomics.
struct Shm {
    map: MmapRaw,
}

impl Shm {
    /// Maps the first `len` bytes (the header, or the header and the
    /// extension when the file holds it).
    fn map(file: &std::fs::File, writable: bool, len: usize) -> io::Result<Self> {
        let mut options = MmapOptions::new();
        options.len(len);
        let map = if writable {
            options.map_raw(file)?
        } else {
            options.map_raw_read_only(file)?
        };
        Ok(Shm { map })
    }

    fn u32(&self, off: usize) -> &AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= self.map.len());
        // SAFETY: the mapping is page aligned, `off` is 4-aligned and in
        // bounds (checked above), and it lives as long as `self`.
        // The memory is only ever accessed through atomics (by any process),
        // and a read-only mapping is only loaded from, with Relaxed loads of
        // at most pointer size, which std allows on read-only memory.
        unsafe { &*self.map.as_ptr().add(off).cast::<AtomicU32>() }
    }

    fn u64(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= self.map.len());
        // SAFETY: as in `u32`, with an 8-aligned offset.
        unsafe { &*self.map.as_ptr().add(off).cast::<AtomicU64>() }
    }

    fn load32(&self, off: usize) -> u32 {
        self.u32(off).load(Ordering::Relaxed)
    }

    fn load64(&self, off: usize) -> u64 {
        self.u64(off).load(Ordering::Relaxed)
    }

    /// Runs `read` until it saw a stable, even sequence.
    fn stable<T>(&self, path: &Path, read: impl Fn(&Self) -> T) -> Result<T, HeartbeatError> {
        let seq = self.u64(OFF_SEQ);
        for attempt in 0..MAX_ATTEMPTS {
            let before = seq.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if before & 1 == 0 {
                let value = read(self);
                fence(Ordering::Acquire);
                if seq.load(Ordering::Relaxed) == before {
                    return Ok(value);
                }
            }
            if attempt < SPIN_ATTEMPTS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        Err(HeartbeatError::Unstable {
            path: path.to_path_buf(),
            attempts: MAX_ATTEMPTS,
        })
    }

    /// Runs `write` between making the sequence odd and even again. Only one
    /// writer may call this at a time.
    fn write(&self, write: impl FnOnce(&Self)) {
        let seq = self.u64(OFF_SEQ);
        // `| 1` rather than `+ 1`: a writer that died mid-write left it odd.
        let odd = seq.load(Ordering::Relaxed) | 1;
        seq.store(odd, Ordering::Relaxed);
        fence(Ordering::Release);
        write(self);
        seq.store(odd.wrapping_add(1), Ordering::Release);
    }
}

/// The header's fields as plain values, path in its fixed-size field.
#[derive(Clone, Copy)]
struct RawHeader {
    magic: u32,
    version: u32,
    shards: u32,
    bind: u32,
    pid: u32,
    base_port: u32,
    beat: u64,
    path_len: u32,
    path: [u64; PATH_WORDS],
}

impl RawHeader {
    fn from_info(file: &Path, info: &AgentInfo) -> Result<Self, HeartbeatError> {
        let bytes = info.snapshot_path.as_os_str().as_bytes();
        let path = path_words(file, bytes)?;
        Ok(RawHeader {
            magic: MAGIC,
            version: LAYOUT_VERSION,
            shards: info.shards,
            bind: u32::from(info.bind),
            pid: info.pid,
            base_port: u32::from(info.base_port),
            beat: 0,
            path_len: bytes.len() as u32,
            path,
        })
    }

    fn load(shm: &Shm) -> Self {
        let mut path = [0u64; PATH_WORDS];
        for (i, word) in path.iter_mut().enumerate() {
            *word = shm.load64(OFF_PATH + 8 * i);
        }
        RawHeader {
            magic: shm.load32(OFF_MAGIC),
            version: shm.load32(OFF_VERSION),
            shards: shm.load32(OFF_SHARDS),
            bind: shm.load32(OFF_BIND),
            pid: shm.load32(OFF_PID),
            base_port: shm.load32(OFF_BASE_PORT),
            beat: shm.load64(OFF_BEAT),
            path_len: shm.load32(OFF_PATH_LEN),
            path,
        }
    }

    fn store(&self, shm: &Shm) {
        let relaxed = Ordering::Relaxed;
        shm.u32(OFF_MAGIC).store(self.magic, relaxed);
        shm.u32(OFF_VERSION).store(self.version, relaxed);
        shm.u32(OFF_SHARDS).store(self.shards, relaxed);
        shm.u32(OFF_BIND).store(self.bind, relaxed);
        shm.u32(OFF_PID).store(self.pid, relaxed);
        shm.u32(OFF_BASE_PORT).store(self.base_port, relaxed);
        shm.u64(OFF_BEAT).store(self.beat, relaxed);
        shm.u32(OFF_PATH_LEN).store(self.path_len, relaxed);
        shm.u32(OFF_RESERVED).store(0, relaxed);
        for (i, word) in self.path.iter().enumerate() {
            shm.u64(OFF_PATH + 8 * i).store(*word, relaxed);
        }
    }

    fn into_heartbeat(self, file: &Path) -> Result<Heartbeat, HeartbeatError> {
        check_format(file, self.magic, self.version)?;
        let snapshot_path = words_path(file, &self.path, self.path_len as usize)?;
        // The writer stores a u16: a high half that is not 0 is corruption,
        // not a port to truncate into another one.
        let base_port = u16::try_from(self.base_port).map_err(|_| HeartbeatError::BadField {
            path: file.to_path_buf(),
            field: "the base port",
            value: u64::from(self.base_port),
            allowed: "a port is at most 65535",
        })?;
        Ok(Heartbeat {
            info: AgentInfo {
                shards: self.shards,
                base_port,
                bind: Ipv4Addr::from(self.bind),
                pid: self.pid,
                snapshot_path,
            },
            beat_unix_ms: self.beat,
        })
    }
}

/// A path as the header stores it: its bytes, zero-padded, in native
/// words. Refuses one longer than [`SNAPSHOT_PATH_MAX`] bytes (`file`: the
/// heartbeat file, for the error).
fn path_words(file: &Path, bytes: &[u8]) -> Result<[u64; PATH_WORDS], HeartbeatError> {
    if bytes.len() > SNAPSHOT_PATH_MAX {
        return Err(HeartbeatError::PathTooLong {
            path: file.to_path_buf(),
            len: bytes.len(),
        });
    }
    let mut padded = [0u8; SNAPSHOT_PATH_MAX];
    padded[..bytes.len()].copy_from_slice(bytes);
    let mut words = [0u64; PATH_WORDS];
    for (word, chunk) in words.iter_mut().zip(padded.chunks_exact(8)) {
        *word = u64::from_ne_bytes(chunk.try_into().expect("8-byte chunk"));
    }
    Ok(words)
}

/// The first `len` bytes of a path stored by [`path_words`]; a length
/// past [`SNAPSHOT_PATH_MAX`] is corruption.
fn words_path(
    file: &Path,
    words: &[u64; PATH_WORDS],
    len: usize,
) -> Result<PathBuf, HeartbeatError> {
    if len > SNAPSHOT_PATH_MAX {
        return Err(HeartbeatError::PathTooLong {
            path: file.to_path_buf(),
            len,
        });
    }
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    Ok(PathBuf::from(OsStr::from_bytes(&bytes[..len])))
}

/// The shared-memory extension's words (zero when the mapping does not
/// reach it).
struct RawShm {
    magic: u32,
    len: u32,
    path: [u64; PATH_WORDS],
}

impl RawShm {
    fn load(shm: &Shm) -> Self {
        let mut path = [0u64; PATH_WORDS];
        if shm.map.len() < EXT_END {
            return RawShm {
                magic: 0,
                len: 0,
                path,
            };
        }
        for (i, word) in path.iter_mut().enumerate() {
            *word = shm.load64(OFF_SHM_PATH + 8 * i);
        }
        RawShm {
            magic: shm.load32(OFF_SHM_MAGIC),
            len: shm.load32(OFF_SHM_LEN),
            path,
        }
    }
}

fn check_format(file: &Path, magic: u32, version: u32) -> Result<(), HeartbeatError> {
    if magic != MAGIC {
        return Err(HeartbeatError::BadMagic {
            path: file.to_path_buf(),
            found: magic,
        });
    }
    if version != LAYOUT_VERSION {
        return Err(HeartbeatError::UnsupportedVersion {
            path: file.to_path_buf(),
            found: version,
        });
    }
    Ok(())
}

/// What a file type that is not a regular file is, for an error message.
pub(crate) fn file_kind(t: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "directory"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_socket() {
        "socket"
    } else if t.is_symlink() {
        "symbolic link"
    } else if t.is_file() {
        "regular file"
    } else {
        "special file"
    }
}

fn io_error<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> HeartbeatError + 'a {
    move |error| HeartbeatError::Io {
        op,
        path: path.to_path_buf(),
        error,
    }
}

// === impl HeartbeatWriter ===

/// The agent's side: publishes the header and beats. One per file; `Send`
/// but not `Sync`, because the seqlock allows one writer at a time.
pub struct HeartbeatWriter {
    shm: Shm,
    path: PathBuf,
    /// The open lock file whose `flock` says this agent owns the path.
    _lock: Flock<std::fs::File>,
    _not_sync: PhantomData<Cell<()>>,
}

/// The heartbeat file opened and locked ([`HeartbeatLock::take`]), not
/// written yet: an agent takes it before anything else, so that a second
/// agent on the same path stops at once, naming the first.
#[derive(Debug)]
pub struct HeartbeatLock {
    /// `PATH.lock`, mode 0600: only the agent's user can open it, so no
    /// other user can hold its lock (anyone may `flock` a file it can
    /// read, the heartbeat included).
    lock: Flock<std::fs::File>,
    file: std::fs::File,
    path: PathBuf,
}

impl HeartbeatLock {
    /// Makes the agent directory (`path`'s parent) if needed and checks
    /// it, takes the exclusive lock of `PATH.lock`, then opens the
    /// heartbeat file at `path` (created exclusively, or adopted only if
    /// it is this user's own: [`crate::owned::open_or_create`]), without
    /// writing it.
    ///
    /// # Errors
    /// [`HeartbeatError::Locked`] naming the holder's pid when another
    /// process holds it; [`HeartbeatError::Untrusted`] when the directory,
    /// the lock or the heartbeat file is not the agent's (another owner,
    /// writable by others, a symbolic link); [`HeartbeatError::NotAFile`];
    /// [`HeartbeatError::Io`] when it cannot be opened.
    pub fn take(path: &Path) -> Result<Self, HeartbeatError> {
        use crate::owned;
        let untrusted = |e: owned::OwnedError| match e {
            owned::OwnedError::NotAFile { path, kind } => HeartbeatError::NotAFile { path, kind },
            e => HeartbeatError::Untrusted(e),
        };
        owned::ensure_agent_dir(owned::parent_of(path)).map_err(untrusted)?;
        let lock_path = lock_path(path);
        let lock_file = owned::open_or_create(&lock_path, 0o600, true).map_err(untrusted)?;
        let lock = lock_exclusive(lock_file, path)?;
        let file = owned::open_or_create(path, 0o644, false).map_err(untrusted)?;
        Ok(HeartbeatLock {
            lock,
            file,
            path: path.to_path_buf(),
        })
    }
}

/// The lock file beside the heartbeat: `PATH.lock`.
pub fn lock_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".lock");
    PathBuf::from(p)
}

impl HeartbeatWriter {
    /// Creates the file at `path`, or reuses it in place if it exists, sizes
    /// it to at least [`FILE_LEN`], maps it and publishes `info` with a beat
    /// of 0. Call [`beat`](Self::beat) right after: until then readers see
    /// the agent as down. The parent directory must exist.
    ///
    /// # Errors
    /// [`HeartbeatError::PathTooLong`] when `info.snapshot_path` is longer
    /// than [`SNAPSHOT_PATH_MAX`] bytes (the file is then not touched);
    /// [`HeartbeatError::Io`] when the file cannot be opened, sized or mapped.
    pub fn create(path: &Path, info: &AgentInfo) -> Result<Self, HeartbeatError> {
        RawHeader::from_info(path, info)?;
        Self::create_locked(HeartbeatLock::take(path)?, info)
    }

    /// [`HeartbeatWriter::create`] on a file already locked.
    ///
    /// # Errors
    /// As [`HeartbeatWriter::create`], but for the lock.
    pub fn create_locked(lock: HeartbeatLock, info: &AgentInfo) -> Result<Self, HeartbeatError> {
        let HeartbeatLock { lock, file, path } = lock;
        let path = path.as_path();
        let header = RawHeader::from_info(path, info)?;
        let len = file.metadata().map_err(io_error("stat", path))?.len();
        if len < FILE_LEN {
            file.set_len(FILE_LEN).map_err(io_error("size", path))?;
        }
        let shm = Shm::map(&file, true, EXT_END).map_err(io_error("map", path))?;
        shm.write(|shm| {
            header.store(shm);
            // No regions until the agent offers them (set_shm).
            shm.u32(OFF_SHM_MAGIC).store(0, Ordering::Relaxed);
            shm.u32(OFF_SHM_LEN).store(0, Ordering::Relaxed);
        });
        Ok(HeartbeatWriter {
            shm,
            path: path.to_path_buf(),
            _lock: lock,
            _not_sync: PhantomData,
        })
    }

    /// Publishes a beat at `unix_ms` (unix milliseconds). No system call.
    pub fn beat(&self, unix_ms: u64) {
        self.shm
            .write(|shm| shm.u64(OFF_BEAT).store(unix_ms, Ordering::Relaxed));
    }

    /// The heartbeat file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Names the shared-memory regions' prefix (shard i's region is
    /// `PREFIX.i`), or withdraws them (`None`).
    ///
    /// # Errors
    /// [`HeartbeatError::PathTooLong`] when the prefix is longer than
    /// [`SNAPSHOT_PATH_MAX`] bytes (nothing is written).
    pub fn set_shm(&self, prefix: Option<&Path>) -> Result<(), HeartbeatError> {
        let bytes = prefix.map_or(&[][..], |p| p.as_os_str().as_bytes());
        let words = path_words(&self.path, bytes)?;
        self.shm.write(|shm| {
            let r = Ordering::Relaxed;
            for (i, w) in words.iter().enumerate() {
                shm.u64(OFF_SHM_PATH + 8 * i).store(*w, r);
            }
            shm.u32(OFF_SHM_LEN).store(bytes.len() as u32, r);
            let magic = if prefix.is_some() { SHM_MAGIC } else { 0 };
            shm.u32(OFF_SHM_MAGIC).store(magic, r);
        });
        Ok(())
    }

    /// Rewrites the whole header and the beat in one write, as `create` does.
    #[cfg(test)]
    fn publish(&self, info: &AgentInfo, beat_unix_ms: u64) -> Result<(), HeartbeatError> {
        let mut header = RawHeader::from_info(&self.path, info)?;
        header.beat = beat_unix_ms;
        self.shm.write(|shm| header.store(shm));
        Ok(())
    }
}

// SAFETY: the mapping is plain shared memory usable from any thread; `Sync`
// stays off (PhantomData<Cell>) so that only one thread writes.
unsafe impl Send for HeartbeatWriter {}

impl std::fmt::Debug for HeartbeatWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeartbeatWriter")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Takes the exclusive `flock` on the heartbeat file (nix's `Flock`), held
/// for as long as the returned file is open (the writer's lifetime; the
/// kernel releases it when the process dies, even by `kill -9`). Held:
/// [`HeartbeatError::Locked`] naming the pid in the holder's header.
fn lock_exclusive(
    file: std::fs::File,
    path: &Path,
) -> Result<Flock<std::fs::File>, HeartbeatError> {
    let e = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(locked) => return Ok(locked),
        Err((_, e)) => io::Error::from(e),
    };
    if e.kind() != io::ErrorKind::WouldBlock {
        return Err(HeartbeatError::Io {
            op: "lock",
            path: path.to_path_buf(),
            error: e,
        });
    }
    let holder = match HeartbeatReader::open(path).and_then(|r| r.read()) {
        Ok(h) => format!("pid {}", h.info.pid),
        Err(e) => format!("pid unknown: {e}"),
    };
    Err(HeartbeatError::Locked {
        path: path.to_path_buf(),
        holder,
    })
}

// === impl HeartbeatReader ===

/// The client's side: a read-only mapping of the heartbeat file, kept open
/// across agent restarts.
pub struct HeartbeatReader {
    shm: Shm,
    path: PathBuf,
}

impl HeartbeatReader {
    /// Opens and maps the file at `path` read-only and checks that it holds a
    /// readable header.
    ///
    /// # Errors
    /// [`HeartbeatError::Missing`] when there is no file,
    /// [`HeartbeatError::Truncated`] when it is shorter than [`HEADER_LEN`],
    /// [`HeartbeatError::BadMagic`], [`HeartbeatError::UnsupportedVersion`],
    /// [`HeartbeatError::Unstable`] (as for [`beat_unix_ms`](Self::beat_unix_ms)),
    /// [`HeartbeatError::NotAFile`] for a FIFO, device, directory or socket
    /// (opened without blocking, never mapped),
    /// [`HeartbeatError::Io`] when it cannot be opened or mapped.
    pub fn open(path: &Path) -> Result<Self, HeartbeatError> {
        // Non-blocking: opening a FIFO for reading would otherwise wait for
        // a writer, past any timeout of the caller. What is opened is then
        // judged by fstat, so a file swapped in between cannot slip through.
        // Its owner, its mode and its directory's are checked first
        // (crate::owned): a file another user could have planted is not
        // the agent's, whatever it says.
        let file = crate::owned::open_trusted(path, false, false).map_err(|e| match e {
            e if e.is_not_found() => HeartbeatError::Missing {
                path: path.to_path_buf(),
            },
            crate::owned::OwnedError::NotAFile { path, kind } => {
                HeartbeatError::NotAFile { path, kind }
            }
            e => HeartbeatError::Untrusted(e),
        })?;
        let meta = file.metadata().map_err(io_error("stat", path))?;
        let len = meta.len();
        if len < HEADER_LEN as u64 {
            return Err(HeartbeatError::Truncated {
                path: path.to_path_buf(),
                len,
                min: HEADER_LEN,
            });
        }
        // The extension only when the file holds it (an old agent's file
        // is a page long too; it leaves the extension zero).
        let map_len = if len >= EXT_END as u64 {
            EXT_END
        } else {
            HEADER_LEN
        };
        let shm = Shm::map(&file, false, map_len).map_err(io_error("map", path))?;
        let reader = HeartbeatReader {
            shm,
            path: path.to_path_buf(),
        };
        reader.beat_unix_ms()?;
        Ok(reader)
    }

    /// The whole header and the beat, read consistently.
    ///
    /// # Errors
    /// [`HeartbeatError::BadMagic`], [`HeartbeatError::UnsupportedVersion`],
    /// [`HeartbeatError::PathTooLong`] (a corrupt path length),
    /// [`HeartbeatError::BadField`] (a base port above 65535),
    /// [`HeartbeatError::Unstable`] when no consistent read succeeded.
    pub fn read(&self) -> Result<Heartbeat, HeartbeatError> {
        self.shm
            .stable(&self.path, RawHeader::load)?
            .into_heartbeat(&self.path)
    }

    /// A 64-bit digest of the header without the beat (every field and the
    /// path's bytes), read consistently and without allocating: the client
    /// reads the whole header (which allocates the path) only when this
    /// changed since it last did, not at every beat.
    ///
    /// # Errors
    /// As [`beat_unix_ms`](Self::beat_unix_ms).
    pub fn header_stamp(&self) -> Result<u64, HeartbeatError> {
        // One seqlock read of both parts: one consistent header.
        let (raw, ext) = self
            .shm
            .stable(&self.path, |s| (RawHeader::load(s), RawShm::load(s)))?;
        check_format(&self.path, raw.magic, raw.version)?;
        let fixed = [raw.shards, raw.bind, raw.pid, raw.base_port, raw.path_len];
        let ext_fixed = [u64::from(ext.magic), u64::from(ext.len)];
        let words = fixed
            .iter()
            .map(|&w| u64::from(w))
            .chain(raw.path)
            .chain(ext_fixed)
            .chain(ext.path);
        // FNV-1a over words: a different header gives another stamp but
        // with odds of 2^-64 (a request that fails re-reads anyway).
        Ok(words.fold(0xcbf2_9ce4_8422_2325, |h, w| {
            (h ^ w).wrapping_mul(0x0000_0100_0000_01b3)
        }))
    }

    /// The shared-memory regions' prefix the agent offers (shard i's region
    /// is `PREFIX.i`), `None` when it offers none (or the file predates
    /// the extension).
    ///
    /// # Errors
    /// [`HeartbeatError::PathTooLong`] for a corrupt length,
    /// [`HeartbeatError::Unstable`].
    pub fn shm_prefix(&self) -> Result<Option<PathBuf>, HeartbeatError> {
        let ext = self.shm.stable(&self.path, RawShm::load)?;
        if ext.magic != SHM_MAGIC {
            return Ok(None);
        }
        let len = ext.len as usize;
        if len == 0 {
            return Err(HeartbeatError::PathTooLong {
                path: self.path.clone(),
                len,
            });
        }
        words_path(&self.path, &ext.path, len).map(Some)
    }

    /// The header's seqlock sequence word. Every write of the agent (every
    /// beat) changes it, so the same even value twice means the header and
    /// the beat did not change in between: one atomic load, the client's
    /// per-call check (a full [`beat_unix_ms`](Self::beat_unix_ms) when it
    /// moved).
    #[inline(always)]
    pub fn sequence(&self) -> u64 {
        self.shm.u64(OFF_SEQ).load(Ordering::Acquire)
    }

    /// The last beat, unix milliseconds (0: not beaten yet). Called before
    /// every getHost: a few loads, no allocation and no system call unless
    /// the writer is stuck mid-write.
    ///
    /// # Errors
    /// [`HeartbeatError::BadMagic`], [`HeartbeatError::UnsupportedVersion`],
    /// [`HeartbeatError::Unstable`] when no consistent read succeeded.
    pub fn beat_unix_ms(&self) -> Result<u64, HeartbeatError> {
        let (magic, version, beat) = self.shm.stable(&self.path, |shm| {
            (
                shm.load32(OFF_MAGIC),
                shm.load32(OFF_VERSION),
                shm.load64(OFF_BEAT),
            )
        })?;
        check_format(&self.path, magic, version)?;
        Ok(beat)
    }

    /// The heartbeat file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl std::fmt::Debug for HeartbeatReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeartbeatReader")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn info(shards: u32, snapshot: &str) -> AgentInfo {
        AgentInfo {
            shards,
            base_port: 8888,
            bind: Ipv4Addr::new(127, 0, 0, 1),
            pid: 4242,
            snapshot_path: PathBuf::from(snapshot),
        }
    }

    fn poke_u32(path: &Path, off: u64, value: u32) {
        let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        file.write_all_at(&value.to_ne_bytes(), off).unwrap();
    }

    #[test]
    fn round_trips_header_and_beat() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let info = info(3, "/var/lib/lbagent/routes.snap");
        let writer = HeartbeatWriter::create(&path, &info).unwrap();
        let reader = HeartbeatReader::open(&path).unwrap();
        assert_eq!(reader.beat_unix_ms().unwrap(), 0);
        writer.beat(1_700_000_000_123);
        assert_eq!(reader.beat_unix_ms().unwrap(), 1_700_000_000_123);
        assert_eq!(
            reader.read().unwrap(),
            Heartbeat {
                info,
                beat_unix_ms: 1_700_000_000_123
            }
        );
        assert_eq!(std::fs::metadata(&path).unwrap().len(), FILE_LEN);
    }

    #[test]
    fn holds_a_path_of_exactly_the_field_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let long = format!("/{}", "a".repeat(SNAPSHOT_PATH_MAX - 1));
        let writer = HeartbeatWriter::create(&path, &info(1, &long)).unwrap();
        writer.beat(5);
        let got = HeartbeatReader::open(&path).unwrap().read().unwrap();
        assert_eq!(got.info.snapshot_path, PathBuf::from(long));
    }

    #[test]
    fn rejects_a_snapshot_path_too_long_without_touching_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let long = format!("/{}", "a".repeat(SNAPSHOT_PATH_MAX));
        let err = HeartbeatWriter::create(&path, &info(1, &long)).unwrap_err();
        assert!(
            matches!(err, HeartbeatError::PathTooLong { len, .. } if len == SNAPSHOT_PATH_MAX + 1)
        );
        assert!(!path.exists());
    }

    #[test]
    fn reader_opened_before_a_restart_sees_the_new_agent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let first = HeartbeatWriter::create(&path, &info(2, "/old.snap")).unwrap();
        first.beat(1_000);
        let reader = HeartbeatReader::open(&path).unwrap();
        assert_eq!(reader.read().unwrap().info.shards, 2);
        drop(first);

        let new_info = AgentInfo {
            pid: 777,
            base_port: 9999,
            ..info(8, "/new/routes.snap")
        };
        let second = HeartbeatWriter::create(&path, &new_info).unwrap();
        assert_eq!(
            reader.read().unwrap(),
            Heartbeat {
                info: new_info.clone(),
                beat_unix_ms: 0
            }
        );
        second.beat(2_000);
        assert_eq!(reader.beat_unix_ms().unwrap(), 2_000);
        assert_eq!(reader.read().unwrap().info, new_info);
    }

    #[test]
    fn restart_grows_a_short_file_and_keeps_a_long_one() {
        let dir = tempfile::tempdir().unwrap();
        let short = dir.path().join("short");
        std::fs::write(&short, [0u8; 16]).unwrap();
        HeartbeatWriter::create(&short, &info(1, "/s")).unwrap();
        assert_eq!(std::fs::metadata(&short).unwrap().len(), FILE_LEN);

        let long = dir.path().join("long");
        std::fs::write(&long, vec![0u8; 3 * FILE_LEN as usize]).unwrap();
        HeartbeatWriter::create(&long, &info(1, "/s")).unwrap();
        assert_eq!(std::fs::metadata(&long).unwrap().len(), 3 * FILE_LEN);
        HeartbeatReader::open(&long).unwrap();
    }

    #[test]
    fn missing_file_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let err = HeartbeatReader::open(&dir.path().join("nope")).unwrap_err();
        assert!(matches!(err, HeartbeatError::Missing { .. }), "{err}");
        assert!(err.to_string().contains("nope"));
    }

    #[test]
    fn short_file_is_truncated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        for len in [0, 8, HEADER_LEN - 1] {
            std::fs::write(&path, vec![0u8; len]).unwrap();
            let err = HeartbeatReader::open(&path).unwrap_err();
            assert!(
                matches!(err, HeartbeatError::Truncated { len: l, min: HEADER_LEN, .. } if l == len as u64),
                "{err}"
            );
        }
    }

    #[test]
    fn bad_magic_is_reported_at_open_and_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let writer = HeartbeatWriter::create(&path, &info(1, "/s")).unwrap();
        writer.beat(10);
        let reader = HeartbeatReader::open(&path).unwrap();
        poke_u32(&path, OFF_MAGIC as u64, 0xdead_beef);
        for err in [
            reader.read().unwrap_err(),
            reader.beat_unix_ms().unwrap_err(),
            HeartbeatReader::open(&path).unwrap_err(),
        ] {
            assert!(
                matches!(
                    err,
                    HeartbeatError::BadMagic {
                        found: 0xdead_beef,
                        ..
                    }
                ),
                "{err}"
            );
        }
        // A zero-filled file (created, not yet initialised) is bad magic too.
        std::fs::write(&path, vec![0u8; FILE_LEN as usize]).unwrap();
        let err = HeartbeatReader::open(&path).unwrap_err();
        assert!(
            matches!(err, HeartbeatError::BadMagic { found: 0, .. }),
            "{err}"
        );
    }

    #[test]
    fn unknown_layout_version_is_unsupported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        HeartbeatWriter::create(&path, &info(1, "/s")).unwrap();
        poke_u32(&path, OFF_VERSION as u64, 99);
        let err = HeartbeatReader::open(&path).unwrap_err();
        assert!(
            matches!(err, HeartbeatError::UnsupportedVersion { found: 99, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("version 99"), "{err}");
    }

    #[test]
    fn corrupt_path_length_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        HeartbeatWriter::create(&path, &info(1, "/s")).unwrap();
        let reader = HeartbeatReader::open(&path).unwrap();
        poke_u32(&path, OFF_PATH_LEN as u64, 10_000);
        let err = reader.read().unwrap_err();
        assert!(
            matches!(err, HeartbeatError::PathTooLong { len: 10_000, .. }),
            "{err}"
        );
    }

    #[test]
    fn a_base_port_above_65535_is_corrupt_not_truncated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        HeartbeatWriter::create(&path, &info(1, "/s")).unwrap();
        let reader = HeartbeatReader::open(&path).unwrap();
        poke_u32(&path, OFF_BASE_PORT as u64, 0x1_22b8);
        let err = reader.read().unwrap_err();
        assert!(
            matches!(
                err,
                HeartbeatError::BadField {
                    value: 0x1_22b8,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn special_files_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // Without O_NONBLOCK this open would wait for a writer forever.
        for (path, kind) in [
            (fifo.as_path(), "FIFO"),
            (dir.path(), "directory"),
            (Path::new("/dev/zero"), "character device"),
        ] {
            let err = HeartbeatReader::open(path).unwrap_err();
            assert!(
                matches!(err, HeartbeatError::NotAFile { kind: k, .. } if k == kind),
                "{}: {err}",
                path.display()
            );
        }
    }

    #[test]
    fn writer_dead_mid_write_is_unstable_until_the_next_agent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let writer = HeartbeatWriter::create(&path, &info(1, "/s")).unwrap();
        writer.beat(10);
        let reader = HeartbeatReader::open(&path).unwrap();
        drop(writer);
        // seq left odd, as by a crash between the two stores.
        poke_u32(&path, OFF_SEQ as u64, 7);
        let err = reader.beat_unix_ms().unwrap_err();
        assert!(
            matches!(
                err,
                HeartbeatError::Unstable {
                    attempts: MAX_ATTEMPTS,
                    ..
                }
            ),
            "{err}"
        );
        assert!(matches!(
            reader.read(),
            Err(HeartbeatError::Unstable { .. })
        ));

        let writer = HeartbeatWriter::create(&path, &info(1, "/s")).unwrap();
        writer.beat(20);
        assert_eq!(reader.beat_unix_ms().unwrap(), 20);
    }

    #[test]
    fn alive_means_a_recent_beat() {
        assert!(is_alive(10_000, 10_000, 2_000));
        assert!(is_alive(10_000, 12_000, 2_000));
        assert!(!is_alive(10_000, 12_001, 2_000));
        // Not beaten yet.
        assert!(!is_alive(0, 1_000, 2_000));
        // Clock stepped back: slightly ahead is fine, far ahead is not.
        assert!(is_alive(10_500, 10_000, 2_000));
        assert!(!is_alive(100_000, 10_000, 2_000));
        assert!(is_alive(u64::MAX, u64::MAX, 0));
    }

    /// The header a torn-write test writes for counter `k`: every field
    /// derived from `k`, so a mixed read shows.
    fn derived(k: u32) -> AgentInfo {
        AgentInfo {
            shards: k,
            base_port: k as u16,
            bind: Ipv4Addr::from(k),
            pid: k,
            // Varying length, so a torn path shows as well.
            snapshot_path: PathBuf::from(format!("/{}", k.to_string().repeat(1 + k as usize % 60))),
        }
    }

    fn assert_consistent(hb: &Heartbeat) {
        let k = hb.info.shards;
        assert_eq!(hb.info, derived(k), "torn header");
        assert_eq!(hb.beat_unix_ms, u64::from(k) * 1_000, "torn beat");
    }

    #[test]
    fn readers_never_see_a_torn_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let writer = HeartbeatWriter::create(&path, &derived(1)).unwrap();
        writer.publish(&derived(1), 1_000).unwrap();
        let stop = Arc::new(AtomicBool::new(false));

        let writer_thread = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let infos: Vec<AgentInfo> = (1..=997).map(derived).collect();
                let mut k = 1u32;
                while !stop.load(Ordering::Relaxed) {
                    k = k % 997 + 1;
                    writer
                        .publish(&infos[k as usize - 1], u64::from(k) * 1_000)
                        .unwrap();
                }
                k
            })
        };
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let path = path.clone();
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let reader = HeartbeatReader::open(&path).unwrap();
                    let (mut ok, mut unstable, mut seen) =
                        (0u64, 0u64, std::collections::HashSet::new());
                    while !stop.load(Ordering::Relaxed) {
                        match reader.read() {
                            Ok(hb) => {
                                assert_consistent(&hb);
                                seen.insert(hb.info.shards);
                                ok += 1;
                            }
                            Err(HeartbeatError::Unstable { .. }) => unstable += 1,
                            Err(e) => panic!("unexpected error: {e}"),
                        }
                        if let Ok(beat) = reader.beat_unix_ms() {
                            assert_eq!(beat % 1_000, 0, "torn beat");
                        }
                    }
                    (ok, unstable, seen.len())
                })
            })
            .collect();

        let start = Instant::now();
        std::thread::sleep(Duration::from_millis(800));
        stop.store(true, Ordering::Relaxed);
        writer_thread.join().unwrap();
        for reader in readers {
            let (ok, unstable, distinct) = reader.join().unwrap();
            assert!(
                ok > 0,
                "no consistent read in {:?} ({unstable} unstable)",
                start.elapsed()
            );
            assert!(
                distinct > 1 || ok < 10,
                "reader saw only one state in {ok} reads"
            );
        }
    }

    #[test]
    fn a_second_writer_on_the_same_path_is_refused_naming_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let first = HeartbeatWriter::create(&path, &info(2, "/a")).unwrap();
        first.beat(1_000);
        let e = HeartbeatWriter::create(&path, &info(3, "/b")).unwrap_err();
        assert!(matches!(e, HeartbeatError::Locked { .. }), "{e}");
        assert!(e.to_string().contains("pid 4242"), "{e}");
        // The holder's header is untouched.
        let h = HeartbeatReader::open(&path).unwrap().read().unwrap();
        assert_eq!((h.info.shards, h.beat_unix_ms), (2, 1_000));
        // Gone (the kernel drops the lock with the descriptor): free again.
        drop(first);
        HeartbeatWriter::create(&path, &info(3, "/b")).unwrap();
    }

    #[test]
    fn the_lock_is_taken_before_anything_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let lock = HeartbeatLock::take(&path).unwrap();
        assert!(matches!(
            HeartbeatLock::take(&path),
            Err(HeartbeatError::Locked { .. })
        ));
        let w = HeartbeatWriter::create_locked(lock, &info(1, "/a")).unwrap();
        w.beat(5);
        assert_eq!(
            HeartbeatReader::open(&path)
                .unwrap()
                .read()
                .unwrap()
                .beat_unix_ms,
            5
        );
    }

    #[test]
    fn the_shm_prefix_is_offered_withdrawn_and_absent_by_default() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let w = HeartbeatWriter::create(&path, &info(2, "/s")).unwrap();
        let r = HeartbeatReader::open(&path).unwrap();
        assert_eq!(
            r.shm_prefix().unwrap(),
            None,
            "an agent offers none by default"
        );
        let before = r.header_stamp().unwrap();
        w.set_shm(Some(Path::new("/dev/shm/x.shm"))).unwrap();
        assert_eq!(
            r.shm_prefix().unwrap(),
            Some(PathBuf::from("/dev/shm/x.shm"))
        );
        assert_ne!(
            r.header_stamp().unwrap(),
            before,
            "the client re-reads the header"
        );
        // The header itself is untouched: old readers see what they saw.
        assert_eq!(r.read().unwrap().info, info(2, "/s"));
        let long = "/".repeat(SNAPSHOT_PATH_MAX + 1);
        assert!(w.set_shm(Some(Path::new(&long))).is_err());
        w.set_shm(None).unwrap();
        assert_eq!(r.shm_prefix().unwrap(), None);
        // A restarted agent clears what the last one offered.
        w.set_shm(Some(Path::new("/dev/shm/x.shm"))).unwrap();
        drop(w);
        let _w = HeartbeatWriter::create(&path, &info(2, "/s")).unwrap();
        assert_eq!(r.shm_prefix().unwrap(), None);
    }

    #[test]
    fn a_corrupt_shm_prefix_length_is_reported_and_a_header_only_file_has_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb");
        let w = HeartbeatWriter::create(&path, &info(1, "/s")).unwrap();
        w.set_shm(Some(Path::new("/p"))).unwrap();
        poke_u32(&path, OFF_SHM_LEN as u64, 9999);
        let r = HeartbeatReader::open(&path).unwrap();
        assert!(matches!(
            r.shm_prefix(),
            Err(HeartbeatError::PathTooLong { len: 9999, .. })
        ));
        drop(w);
        // A file as short as the header alone (an older writer) maps
        // without the extension.
        let short = dir.path().join("short");
        std::fs::copy(&path, &short).unwrap();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&short)
            .unwrap();
        f.set_len(HEADER_LEN as u64).unwrap();
        let r = HeartbeatReader::open(&short).unwrap();
        assert_eq!(r.shm_prefix().unwrap(), None);
        r.header_stamp().unwrap();
    }
}
