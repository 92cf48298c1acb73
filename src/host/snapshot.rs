//! The static route file: the agent's last known routes on disk, for the
//! client library to answer from while the agent is down (seed 000: a random
//! node of the module when the heartbeat is more than 2 s old).
//!
//! The control core writes it every 60 s from its own copy of the routes with
//! [`write()`], atomically (temp file, fsync, rename, fsync of the directory),
//! so a reader sees the old file or the new one, never a mix. The client
//! library reads it with [`read`], which validates everything and never
//! panics, whatever the bytes. A restarting agent reads it with
//! [`read_index`]: the same checks, but the routes stay bytes until a
//! shard makes each one's module ([`SnapshotIndex`]). This module owns the file format; it must not
//! touch the heartbeat, the shards or the network, and takes the time as an
//! argument.
//!
//! # Format (version 1)
//!
//! All integers little-endian. A 32-byte header:
//!
//! | offset | size | field |
//! |---:|---:|---|
//! | 0 | 8 | magic, [`MAGIC`] = `"LBAGSNAP"` |
//! | 8 | 4 | format version, [`FORMAT_VERSION`] |
//! | 12 | 4 | route count |
//! | 16 | 8 | time written, unix seconds |
//! | 24 | 4 | payload length in bytes |
//! | 28 | 4 | CRC-32 (IEEE) of header bytes 0..28 followed by the payload |
//!
//! then the payload, the routes in strictly increasing module order
//! (`modid`, then `cmdid`), each a 20-byte route header followed by its nodes:
//!
//! | size | route field | | size | node field |
//! |---:|---|---|---:|---|
//! | 4 | modid | | 4 | IPv4 address (`NodeAddr::ip`) |
//! | 4 | cmdid | | 2 | port, 1..=65535 |
//! | 8 | route version | | 4 | weight |
//! | 4 | node count | | | |
//!
//! The file is exactly header plus payload: nothing may follow it. The
//! checksum covers the header too, so a flipped bit anywhere is caught.
//!
//! # The zones file (issue 31)
//!
//! The nodes' zones and labels are not in the static route file, whose
//! format every client ever shipped reads (version 1, nothing after the
//! payload): an agent whose nodes have any writes them beside it, to
//! [`zones_path`] (the static route file's path with `.zones` appended),
//! first, then the static route file. The zones file has the same 32-byte
//! header as the static route file, with the magic [`ZONES_MAGIC`] =
//! `"LBAGZONE"`, version [`ZONES_FORMAT_VERSION`], and the static route
//! file's route count and time written; its payload is the CRC-32 of the
//! static route file it belongs to (its header's bytes 28..32), then a
//! 4-byte entry count, then per entry
//!
//! | size | field |
//! |---:|---|
//! | 4 | the route's number in the static route file (0 = the first) |
//! | 4 | the node's IPv4 address |
//! | 2 | its port, 1..=65535 |
//! | 1 | zone length, 0..=63 (0: no zone), then the zone's bytes |
//! | 1 | label count, 0..=16, then per label: 1 key length (1..=63), the key, 1 value length (0..=63), the value |
//!
//! in strictly increasing (route, address, port) order, each with a zone
//! or a label, labels sorted by key, each name checked as the model checks
//! it (`A-Z a-z 0-9 . _ -`), and at least one entry: a file has one form,
//! the one [`write()`] makes of what it holds. An agent whose nodes have
//! none writes no zones file and removes an old one. Only a restarting
//! agent reads it ([`read_index`]): a zones file that is missing, belongs
//! to another static route file (a crash between the two renames) or is
//! bad in any way leaves the routes without zones and labels until the
//! route server's next answer, and [`SnapshotIndex::zones_problem`] says
//! why; it never costs the routes themselves. Clients never read it.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use lbagent_model::{Label, Labels, ModuleId, NodeAddr, NodeMeta, RouteNode, Zone, MAX_LABELS};

/// The first 8 bytes of every snapshot file.
pub const MAGIC: [u8; 8] = *b"LBAGSNAP";

/// The packaged static route file (`agent.snapshot_path`), where clients
/// look unless told otherwise: in the agent's state directory (the unit's
/// `StateDirectory=lbagent`, kept across reboots), which only the agent's
/// user can write.
pub const DEFAULT_PATH: &str = "/var/lib/lbagent/routes.snapshot";

/// The format version this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// The first 8 bytes of every zones file ([`zones_path`]).
pub const ZONES_MAGIC: [u8; 8] = *b"LBAGZONE";

/// The zones file's format version.
pub const ZONES_FORMAT_VERSION: u32 = 1;

/// Where the zones and labels of the static route file at `path` are
/// kept: `path` with `.zones` appended (see the module docs).
pub fn zones_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".zones");
    PathBuf::from(p)
}

/// The header's length in bytes.
pub const HEADER_LEN: usize = 32;

/// The largest file [`read`] accepts (and [`write()`] writes): 256 MiB,
/// about 26 million nodes. A client reads at most this much, whatever the
/// file's size or its header claim.
pub const MAX_LEN: u64 = 256 << 20;

const ROUTE_LEN: usize = 20;
const NODE_LEN: usize = 10;
/// Bytes of the header the checksum covers (all but the checksum itself).
const CHECKED_HEADER_LEN: usize = 28;

/// One module's route as the agent last knew it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotRoute {
    /// The module.
    pub module: ModuleId,
    /// The route's version, as the route server numbered it.
    pub version: u64,
    /// The module's nodes; may be empty.
    pub nodes: Vec<RouteNode>,
    /// The zones and labels of those of its nodes that have any, by
    /// address: written to the zones file ([`zones_path`]); [`read`]
    /// (the clients') leaves it empty.
    pub meta: Vec<(NodeAddr, NodeMeta)>,
}

/// A whole snapshot file: when it was written and every module's route.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// When the agent wrote it, unix seconds.
    pub written_unix_s: u64,
    /// The routes, sorted by module with no module twice ([`read`] guarantees
    /// it; [`route`](Self::route) relies on it).
    pub routes: Vec<SnapshotRoute>,
}

impl Snapshot {
    /// The route of `module`, by binary search.
    pub fn route(&self, module: ModuleId) -> Option<&SnapshotRoute> {
        self.routes
            .binary_search_by_key(&module, |r| r.module)
            .ok()
            .map(|i| &self.routes[i])
    }

    /// Node `r % n` of `module`'s `n` nodes: a uniformly random node when the
    /// caller passes a random `r`. `None` for an unknown module or one with
    /// no nodes.
    pub fn random_node(&self, module: ModuleId, r: u64) -> Option<NodeAddr> {
        let nodes = &self.route(module)?.nodes;
        if nodes.is_empty() {
            return None;
        }
        Some(nodes[(r % nodes.len() as u64) as usize].addr)
    }
}

/// Why a snapshot cannot be written or read. For a reader every variant
/// means: no static routes; the call fails as "agent down".
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The file does not exist (the agent has not written one yet).
    #[error("snapshot file {path} does not exist")]
    Missing {
        /// The snapshot file.
        path: PathBuf,
    },
    /// A system call failed.
    #[error("cannot {op} {path}: {error}")]
    Io {
        /// What was being done: "open", "read", "write", "fsync", "rename", ...
        op: &'static str,
        /// The file or directory it was done to.
        path: PathBuf,
        /// The system's error (in the message, not a `source()`: a chain
        /// printed with `{:#}` would name it twice).
        error: io::Error,
    },
    /// The file or its directory breaks the ownership rules of
    /// [`crate::owned`]: another user could have planted or changed it.
    #[error("snapshot file: {0}")]
    Untrusted(crate::owned::OwnedError),
    /// The path names something other than a regular file (a FIFO, a
    /// device, a directory, a socket): nothing is read from it.
    #[error("snapshot file {path} is a {kind}, not a regular file")]
    NotAFile {
        /// The path.
        path: PathBuf,
        /// What it is: "directory", "FIFO", "character device", ...
        kind: &'static str,
    },
    /// Larger than [`MAX_LEN`], or declares a payload that would make it so.
    #[error("snapshot file {path} is too large: {len} bytes, at most {MAX_LEN}")]
    TooLarge {
        /// The snapshot file.
        path: PathBuf,
        /// Its length, or the length its header declares.
        len: u64,
    },
    /// Shorter than its header, or than the payload length it declares.
    #[error("snapshot file {path} is truncated: {len} bytes, expected {expected}")]
    Truncated {
        /// The snapshot file.
        path: PathBuf,
        /// Its length.
        len: u64,
        /// The length its header needs.
        expected: u64,
    },
    /// Does not start with its magic ([`MAGIC`], or [`ZONES_MAGIC`] for a
    /// zones file): not such a file.
    #[error(
        "snapshot file {path} has bad magic {found:02x?}, expected \"{}\"",
        String::from_utf8_lossy(expected)
    )]
    BadMagic {
        /// The snapshot file.
        path: PathBuf,
        /// Its first 8 bytes.
        found: [u8; 8],
        /// The magic wanted.
        expected: [u8; 8],
    },
    /// Written in a format version this code does not read.
    #[error("snapshot file {path} has format version {found}, this build reads {reads}")]
    UnsupportedVersion {
        /// The snapshot file.
        path: PathBuf,
        /// The version found.
        found: u32,
        /// The version this build reads.
        reads: u32,
    },
    /// The checksum does not match: the file is corrupt.
    #[error("snapshot file {path} is corrupt: checksum {stored:#010x} stored, {computed:#010x} computed")]
    ChecksumMismatch {
        /// The snapshot file.
        path: PathBuf,
        /// The checksum in the header.
        stored: u32,
        /// The checksum of the bytes.
        computed: u32,
    },
    /// The checksum matches but the content breaks a rule of the format.
    #[error("snapshot file {path} is malformed: {what}")]
    Malformed {
        /// The snapshot file.
        path: PathBuf,
        /// The rule broken and where.
        what: String,
    },
    /// [`write()`] was given routes the format cannot hold or [`read`] would
    /// reject: a module twice, a node with port 0, a count over `u32::MAX`.
    /// Nothing was written.
    #[error("cannot write snapshot file {path}: {what}")]
    Invalid {
        /// The snapshot file.
        path: PathBuf,
        /// What is wrong with the routes.
        what: String,
    },
}

fn io_error<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> SnapshotError + 'a {
    move |error| SnapshotError::Io {
        op,
        path: path.to_path_buf(),
        error,
    }
}

// === write ===

/// Writes `routes` (in any order) to `path` atomically: to a uniquely named
/// temp file in the same directory, fsynced, renamed over `path`, then the
/// directory fsynced. Creates the parent directory if missing. On any error
/// the temp file is removed and the old file, if any, is left as it was.
///
/// # Errors
/// [`SnapshotError::Invalid`] when the routes cannot be written (a module
/// twice, a node with port 0, a count that does not fit; nothing is written),
/// [`SnapshotError::Io`] when a directory, the temp file, the rename or an
/// fsync fails.
pub fn write(
    path: &Path,
    written_unix_s: u64,
    routes: &[SnapshotRoute],
) -> Result<(), SnapshotError> {
    let (bytes, zones) =
        encode_files(written_unix_s, routes).map_err(|what| SnapshotError::Invalid {
            path: path.to_path_buf(),
            what,
        })?;
    let zpath = zones_path(path);
    match zones {
        // The zones file first: a crash between the renames leaves a zones
        // file bound to the new static route file beside the old one, which
        // a reader recognises and leaves out.
        Some(z) => {
            write_bytes(&zpath, &z, |_| Ok(()))?;
            write_bytes(path, &bytes, |_| Ok(()))
        }
        None => {
            write_bytes(path, &bytes, |_| Ok(()))?;
            // Best effort: one left behind belongs to an older static
            // route file, and a reader leaves it out.
            let _ = fs::remove_file(&zpath);
            Ok(())
        }
    }
}

/// The static route file's bytes for `routes` (what [`encode_files`] makes
/// first).
#[cfg(test)]
fn encode(written_unix_s: u64, routes: &[SnapshotRoute]) -> Result<Vec<u8>, String> {
    encode_files(written_unix_s, routes).map(|(main, _)| main)
}

/// The static route file's bytes for `routes`, sorted by module, and the
/// zones file's when some node has a zone or a label; the reason when the
/// format cannot hold them.
fn encode_files(
    written_unix_s: u64,
    routes: &[SnapshotRoute],
) -> Result<(Vec<u8>, Option<Vec<u8>>), String> {
    let mut sorted: Vec<&SnapshotRoute> = routes.iter().collect();
    sorted.sort_by_key(|r| r.module);
    let main = encode_sorted(written_unix_s, &sorted)?;
    let zones = encode_meta(&sorted)?.map(|section| {
        let mut payload = Vec::with_capacity(4 + section.len());
        payload.extend_from_slice(&main[CHECKED_HEADER_LEN..HEADER_LEN]);
        payload.extend_from_slice(&section);
        seal(
            ZONES_MAGIC,
            ZONES_FORMAT_VERSION,
            le_u32(&main, 12),
            written_unix_s,
            &payload,
        )
    });
    Ok((main, zones))
}

/// A file of the common header (`magic`, `version`, `count`, the time
/// written, the payload's length and the CRC-32 of both) and `payload`.
fn seal(magic: [u8; 8], version: u32, count: u32, written_unix_s: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = header(magic, version, count, written_unix_s, payload.len() as u32);
    out.extend_from_slice(payload);
    seal_checksum(&mut out);
    out
}

/// The common header with its checksum left 0 (see [`seal_checksum`]).
fn header(
    magic: [u8; 8],
    version: u32,
    count: u32,
    written_unix_s: u64,
    payload_len: u32,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN);
    out.extend_from_slice(&magic);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&written_unix_s.to_le_bytes());
    out.extend_from_slice(&payload_len.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out
}

/// Writes the checksum of a whole file (header and payload) into its
/// header.
fn seal_checksum(out: &mut [u8]) {
    let crc = checksum(&out[..CHECKED_HEADER_LEN], &out[HEADER_LEN..]);
    out[CHECKED_HEADER_LEN..HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
}

/// The static route file's bytes for `sorted` (the routes in module
/// order); the reason when the format cannot hold them.
fn encode_sorted(written_unix_s: u64, sorted: &[&SnapshotRoute]) -> Result<Vec<u8>, String> {
    if let Some(pair) = sorted.windows(2).find(|p| p[0].module == p[1].module) {
        return Err(format!("module {} appears twice", pair[0].module));
    }
    let count = u32::try_from(sorted.len())
        .map_err(|_| format!("{} routes, at most {}", sorted.len(), u32::MAX))?;
    let payload_len: usize = sorted
        .iter()
        .map(|r| ROUTE_LEN + NODE_LEN * r.nodes.len())
        .sum::<usize>();
    if (HEADER_LEN + payload_len) as u64 > MAX_LEN {
        return Err(format!(
            "{} bytes, a snapshot file is at most {MAX_LEN}",
            HEADER_LEN + payload_len
        ));
    }
    let payload_len32 = u32::try_from(payload_len)
        .map_err(|_| format!("payload of {payload_len} bytes, at most {}", u32::MAX))?;

    let mut out = header(MAGIC, FORMAT_VERSION, count, written_unix_s, payload_len32);
    out.reserve_exact(payload_len);
    for route in sorted {
        let module = route.module;
        let nodes = u32::try_from(route.nodes.len())
            .map_err(|_| format!("module {module} has more than {} nodes", u32::MAX))?;
        out.extend_from_slice(&module.modid.to_le_bytes());
        out.extend_from_slice(&module.cmdid.to_le_bytes());
        out.extend_from_slice(&route.version.to_le_bytes());
        out.extend_from_slice(&nodes.to_le_bytes());
        for node in &route.nodes {
            if node.addr.port == 0 {
                return Err(format!(
                    "module {module} has node {} with port 0",
                    node.addr
                ));
            }
            out.extend_from_slice(&node.addr.ip.to_le_bytes());
            out.extend_from_slice(&node.addr.port.to_le_bytes());
            out.extend_from_slice(&node.weight.to_le_bytes());
        }
    }
    seal_checksum(&mut out);
    Ok(out)
}

/// The zones file's entries for `sorted` (the routes in file order), with
/// their count first; None when no node has a zone or a label.
fn encode_meta(sorted: &[&SnapshotRoute]) -> Result<Option<Vec<u8>>, String> {
    let mut entries: Vec<(u32, NodeAddr, &NodeMeta)> = Vec::new();
    for (i, r) in sorted.iter().enumerate() {
        let i = u32::try_from(i).map_err(|_| "too many routes".to_string())?;
        entries.extend(
            r.meta
                .iter()
                .filter(|(_, m)| !m.is_empty())
                .map(|(a, m)| (i, *a, m)),
        );
    }
    if entries.is_empty() {
        return Ok(None);
    }
    entries.sort_by_key(|e| (e.0, e.1));
    if let Some(w) = entries
        .windows(2)
        .find(|w| (w[0].0, w[0].1) == (w[1].0, w[1].1))
    {
        return Err(format!(
            "module {} node {} has its zone and labels twice",
            sorted[w[0].0 as usize].module, w[0].1
        ));
    }
    let count = u32::try_from(entries.len()).map_err(|_| "too many entries".to_string())?;
    let mut out = Vec::new();
    out.extend_from_slice(&count.to_le_bytes());
    // The model bounds every name to 63 bytes and 16 labels: each length
    // fits its byte.
    let name = |out: &mut Vec<u8>, s: &str| {
        out.push(s.len() as u8);
        out.extend_from_slice(s.as_bytes());
    };
    for (i, addr, m) in entries {
        if addr.port == 0 {
            return Err(format!(
                "module {} has metadata for node {addr} with port 0",
                sorted[i as usize].module
            ));
        }
        out.extend_from_slice(&i.to_le_bytes());
        out.extend_from_slice(&addr.ip.to_le_bytes());
        out.extend_from_slice(&addr.port.to_le_bytes());
        name(&mut out, m.zone.as_ref().map_or("", |z| z.as_str()));
        out.push(m.labels.iter().count() as u8);
        for l in m.labels.iter() {
            name(&mut out, l.key());
            name(&mut out, l.value());
        }
    }
    Ok(Some(out))
}

fn checksum(header: &[u8], payload: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(header);
    hasher.update(payload);
    hasher.finalize()
}

/// The atomic write. `before_rename` runs on the synced, closed temp file
/// just before the rename (tests inject failures there).
fn write_bytes(
    path: &Path,
    bytes: &[u8],
    before_rename: impl FnOnce(&Path) -> io::Result<()>,
) -> Result<(), SnapshotError> {
    let name = path.file_name().ok_or_else(|| SnapshotError::Invalid {
        path: path.to_path_buf(),
        what: "the path names no file".to_string(),
    })?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    // The agent's directory: made if missing, refused if another user
    // could plant a file in it (crate::owned).
    crate::owned::ensure_agent_dir(dir).map_err(SnapshotError::Untrusted)?;
    let (tmp, mut file) = create_temp(dir, name)?;

    let staged = (|| {
        file.write_all(bytes).map_err(io_error("write", &tmp))?;
        file.sync_all().map_err(io_error("fsync", &tmp))?;
        drop(file);
        before_rename(&tmp).map_err(io_error("prepare", &tmp))?;
        fs::rename(&tmp, path).map_err(io_error("rename temp file over", path))
    })();
    if let Err(e) = staged {
        // Best effort: the error that matters is the one above.
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error("fsync directory", dir))
}

/// Creates `dir/.NAME.PID.N.tmp` exclusively, trying a few N.
fn create_temp(dir: &Path, name: &std::ffi::OsStr) -> Result<(PathBuf, File), SnapshotError> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let pid = std::process::id();
    let mut last = None;
    for _ in 0..16 {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".{pid}.{n}.tmp"));
        let tmp = dir.join(tmp_name);
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
        {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some((tmp, e)),
            Err(e) => return Err(io_error("create temp file", &tmp)(e)),
        }
    }
    let (tmp, e) = last.expect("at least one attempt");
    Err(io_error("create temp file", &tmp)(e))
}

// === read ===

/// Reads and validates the snapshot at `path`. Only a regular file is read
/// (opened without blocking, so a FIFO at the path fails at once instead of
/// waiting for a writer), and at most [`MAX_LEN`] bytes of it: memory use is
/// bounded by the file's length (at most the header plus the declared
/// payload plus one byte).
///
/// # Errors
/// [`SnapshotError::Missing`] when there is no file,
/// [`SnapshotError::NotAFile`] for a FIFO, device, directory or socket,
/// [`SnapshotError::TooLarge`] above [`MAX_LEN`] (its size or its header's
/// claim), [`SnapshotError::Io`] when it cannot be read, and every error of
/// [`decode`].
pub fn read(path: &Path) -> Result<Snapshot, SnapshotError> {
    decode(path, &read_bytes(path)?)
}

/// Reads and validates the snapshot at `path` as [`read`] does, but keeps
/// it as its bytes with an index of its routes: each route's nodes are
/// decoded only when asked for ([`SnapshotIndex::nodes`]). What an agent
/// starts from: a 1M-node file is read, checked and indexed in a few
/// milliseconds, and its 100,000 routes are not made into vectors first.
///
/// # Errors
/// Those of [`read`], for the same files.
///
/// The zones and labels come from the zones file beside it
/// ([`zones_path`]) when it is there and belongs to this file; otherwise
/// the routes come without them and [`SnapshotIndex::zones_problem`] says
/// why (nothing when there is simply no zones file).
pub fn read_index(path: &Path) -> Result<SnapshotIndex, SnapshotError> {
    let mut index = SnapshotIndex::new(path, read_bytes(path)?)?;
    let zpath = zones_path(path);
    match read_bytes(&zpath) {
        Ok(bytes) => {
            if let Err(e) = index.attach_zones(&zpath, &bytes) {
                index.zones_problem = Some(e.to_string());
            }
        }
        Err(SnapshotError::Missing { .. }) => {}
        Err(e) => index.zones_problem = Some(e.to_string()),
    }
    Ok(index)
}

/// The file's bytes, bounded as [`read`] says; not yet validated.
fn read_bytes(path: &Path) -> Result<Vec<u8>, SnapshotError> {
    // Its owner, mode and directory checked (crate::owned): a file another
    // user could have planted feeds nobody's fallback. What was opened is
    // judged, not what the path named a moment before.
    let file = crate::owned::open_trusted(path, false, false).map_err(|e| match e {
        e if e.is_not_found() => SnapshotError::Missing {
            path: path.to_path_buf(),
        },
        crate::owned::OwnedError::NotAFile { path, kind } => SnapshotError::NotAFile { path, kind },
        e => SnapshotError::Untrusted(e),
    })?;
    let meta = file.metadata().map_err(io_error("stat", path))?;
    if meta.len() > MAX_LEN {
        return Err(SnapshotError::TooLarge {
            path: path.to_path_buf(),
            len: meta.len(),
        });
    }
    let mut bytes = Vec::with_capacity(HEADER_LEN);
    let reader = &file;
    reader
        .take(HEADER_LEN as u64)
        .read_to_end(&mut bytes)
        .map_err(io_error("read", path))?;
    if bytes.len() == HEADER_LEN {
        let declared = HEADER_LEN as u64 + u64::from(le_u32(&bytes, 24));
        if declared > MAX_LEN {
            return Err(SnapshotError::TooLarge {
                path: path.to_path_buf(),
                len: declared,
            });
        }
        // One byte past the declared payload, to notice trailing bytes (a
        // file still growing). Sized once for what the file holds (a
        // 10 MB file read into a doubling vector spends more in copies and
        // page faults than in the read), never past its size at the open:
        // bytes it gained since make the vector grow as they arrive.
        let want = (declared + 1).min(meta.len().max(HEADER_LEN as u64));
        bytes.reserve_exact(want as usize - HEADER_LEN);
        reader
            .take(declared - HEADER_LEN as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(io_error("read", path))?;
    }
    Ok(bytes)
}

/// Validates a snapshot file's bytes and decodes them; `path` only names the
/// file in errors. Never panics; allocates at most in proportion to
/// `bytes.len()`.
///
/// # Errors
/// [`SnapshotError::Truncated`] (shorter than the header or the declared
/// payload), [`SnapshotError::BadMagic`], [`SnapshotError::UnsupportedVersion`],
/// [`SnapshotError::ChecksumMismatch`], [`SnapshotError::Malformed`] (bytes
/// after the payload, a count that does not fit the payload, modules out of
/// order or twice, a node with port 0).
pub fn decode(path: &Path, bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
    let (written_unix_s, starts) = index(path, bytes)?;
    let routes = starts
        .iter()
        .map(|&at| route_at(bytes, at as usize, Vec::new()))
        .collect();
    Ok(Snapshot {
        written_unix_s,
        routes,
    })
}

/// A validated snapshot file kept as its bytes, with where each route
/// starts ([`read_index`]). The routes are in strictly increasing module
/// order, every count fits, no node has port 0: every accessor reads
/// bytes already checked, and never fails.
pub struct SnapshotIndex {
    written_unix_s: u64,
    /// The whole file.
    bytes: Vec<u8>,
    /// Where each route's header starts in `bytes`, in module order.
    starts: Vec<u32>,
    /// The zones and labels (from the zones file), by route number and node.
    meta: Vec<RouteMeta>,
    /// Why the zones file was left out, when it was there but could not be
    /// used.
    zones_problem: Option<String>,
}

/// One node's zone and labels in a zones file: (route number, node, its
/// metadata).
type RouteMeta = (u32, NodeAddr, NodeMeta);

/// Route `i`'s entries of `meta` (sorted by route number), by address.
fn meta_of(meta: &[RouteMeta], i: usize) -> Vec<(NodeAddr, NodeMeta)> {
    let i = i as u32;
    let from = meta.partition_point(|m| m.0 < i);
    meta[from..]
        .iter()
        .take_while(|m| m.0 == i)
        .map(|m| (m.1, m.2.clone()))
        .collect()
}

impl SnapshotIndex {
    /// Validates `bytes`, a whole snapshot file (`path` only names it in
    /// errors), and indexes its routes. Costs one pass over the bytes (the
    /// checksum) and one over the route and node fields; allocates 4 bytes
    /// per route beside the bytes.
    ///
    /// # Errors
    /// Those of [`decode`], for the same bytes.
    pub fn new(path: &Path, bytes: Vec<u8>) -> Result<SnapshotIndex, SnapshotError> {
        let (written_unix_s, starts) = index(path, &bytes)?;
        Ok(SnapshotIndex {
            written_unix_s,
            bytes,
            starts,
            meta: Vec::new(),
            zones_problem: None,
        })
    }

    /// Takes the zones and labels from `bytes`, a whole zones file (`path`
    /// only names it in errors), when it belongs to this static route file.
    /// Never panics; allocates at most in proportion to `bytes.len()`.
    ///
    /// # Errors
    /// [`SnapshotError::Truncated`], [`SnapshotError::BadMagic`],
    /// [`SnapshotError::UnsupportedVersion`],
    /// [`SnapshotError::ChecksumMismatch`] as for the static route file;
    /// [`SnapshotError::Malformed`] when it belongs to another static route
    /// file or breaks a rule of the format. The index is unchanged then.
    pub fn attach_zones(&mut self, path: &Path, bytes: &[u8]) -> Result<(), SnapshotError> {
        let main_crc: [u8; 4] = self.bytes[CHECKED_HEADER_LEN..HEADER_LEN]
            .try_into()
            .expect("4 bytes");
        let payload = check_header(path, bytes, ZONES_MAGIC, ZONES_FORMAT_VERSION)?;
        let malformed = |what: String| SnapshotError::Malformed {
            path: path.to_path_buf(),
            what,
        };
        let (count, written) = (le_u32(bytes, 12), le_u64(bytes, 16));
        if payload.len() < 4
            || payload[..4] != main_crc
            || count as usize != self.len()
            || written != self.written_unix_s
        {
            return Err(malformed(format!(
                "it belongs to another static route file than the one beside it ({} routes written at {}, this file names {count} at {written}): left out",
                self.len(),
                self.written_unix_s
            )));
        }
        self.meta = index_meta(&payload[4..], self.len()).map_err(malformed)?;
        Ok(())
    }

    /// Why the zones file beside the static route file was left out, when
    /// it was there and could not be used ([`read_index`]).
    pub fn zones_problem(&self) -> Option<&str> {
        self.zones_problem.as_deref()
    }

    /// When the agent wrote it, unix seconds.
    #[cfg(test)]
    pub fn written_unix_s(&self) -> u64 {
        self.written_unix_s
    }

    /// How many routes it holds.
    pub fn len(&self) -> usize {
        self.starts.len()
    }

    /// True when it holds no route.
    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }

    /// Route `i`'s module (routes are numbered in module order).
    ///
    /// # Panics
    /// `i >= self.len()`.
    pub fn module(&self, i: usize) -> ModuleId {
        module_at(&self.bytes, self.starts[i] as usize)
    }

    /// Route `i`'s version.
    ///
    /// # Panics
    /// `i >= self.len()`.
    pub fn version(&self, i: usize) -> u64 {
        le_u64(&self.bytes, self.starts[i] as usize + 8)
    }

    /// How many nodes route `i` has.
    ///
    /// # Panics
    /// `i >= self.len()`.
    pub fn node_count(&self, i: usize) -> usize {
        le_u32(&self.bytes, self.starts[i] as usize + 16) as usize
    }

    /// Route `i`'s nodes, decoded now.
    ///
    /// # Panics
    /// `i >= self.len()`.
    pub fn nodes(&self, i: usize) -> Vec<RouteNode> {
        nodes_at(&self.bytes, self.starts[i] as usize)
    }

    /// The zones and labels of route `i`'s nodes that have any, by
    /// address (none without a zones file).
    pub fn meta(&self, i: usize) -> Vec<(NodeAddr, NodeMeta)> {
        meta_of(&self.meta, i)
    }

    /// Route `i`, decoded now.
    ///
    /// # Panics
    /// `i >= self.len()`.
    #[cfg(test)]
    pub fn route(&self, i: usize) -> SnapshotRoute {
        route_at(&self.bytes, self.starts[i] as usize, self.meta(i))
    }

    /// The number of `module`'s route, by binary search.
    pub fn find(&self, module: ModuleId) -> Option<usize> {
        self.starts
            .binary_search_by_key(&module, |&at| module_at(&self.bytes, at as usize))
            .ok()
    }

    /// Every route decoded, in module order: what [`read`] would give.
    #[cfg(test)]
    pub fn to_snapshot(&self) -> Snapshot {
        Snapshot {
            written_unix_s: self.written_unix_s,
            routes: (0..self.len()).map(|i| self.route(i)).collect(),
        }
    }
}

impl std::fmt::Debug for SnapshotIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotIndex")
            .field("written_unix_s", &self.written_unix_s)
            .field("routes", &self.starts.len())
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

/// What [`index`] finds in a valid file: the time written and where each
/// route's header starts.
type Indexed = (u64, Vec<u32>);

/// Validates a whole file's bytes. Never panics.
fn index(path: &Path, bytes: &[u8]) -> Result<Indexed, SnapshotError> {
    check_header(path, bytes, MAGIC, FORMAT_VERSION)?;
    let malformed = |what: String| SnapshotError::Malformed {
        path: path.to_path_buf(),
        what,
    };
    let route_count = le_u32(bytes, 12);
    let written_unix_s = le_u64(bytes, 16);
    let (starts, end) = index_routes(route_count, bytes).map_err(malformed)?;
    let rest = &bytes[HEADER_LEN + end..];
    if !rest.is_empty() {
        return Err(malformed(format!(
            "{} payload bytes after the last of {route_count} routes",
            rest.len()
        )));
    }
    Ok((written_unix_s, starts))
}

/// Checks the common header of a static route or zones file (`magic`,
/// `version`, the declared length, the checksum) and returns the payload.
/// Never panics.
fn check_header<'a>(
    path: &Path,
    bytes: &'a [u8],
    magic_wanted: [u8; 8],
    version_wanted: u32,
) -> Result<&'a [u8], SnapshotError> {
    let len = bytes.len() as u64;
    let truncated = |expected: u64| SnapshotError::Truncated {
        path: path.to_path_buf(),
        len,
        expected,
    };
    let malformed = |what: String| SnapshotError::Malformed {
        path: path.to_path_buf(),
        what,
    };
    if bytes.len() < HEADER_LEN {
        return Err(truncated(HEADER_LEN as u64));
    }
    let magic: [u8; 8] = bytes[..8].try_into().expect("8 bytes");
    if magic != magic_wanted {
        return Err(SnapshotError::BadMagic {
            path: path.to_path_buf(),
            found: magic,
            expected: magic_wanted,
        });
    }
    let version = le_u32(bytes, 8);
    if version != version_wanted {
        return Err(SnapshotError::UnsupportedVersion {
            path: path.to_path_buf(),
            found: version,
            reads: version_wanted,
        });
    }
    let payload_len = le_u32(bytes, 24) as usize;
    let stored = le_u32(bytes, 28);
    let expected = (HEADER_LEN + payload_len) as u64;
    if len < expected {
        return Err(truncated(expected));
    }
    if len > expected {
        return Err(malformed(format!(
            "{} bytes after the declared {payload_len}-byte payload",
            len - expected
        )));
    }
    let computed = checksum(&bytes[..CHECKED_HEADER_LEN], &bytes[HEADER_LEN..]);
    if computed != stored {
        return Err(SnapshotError::ChecksumMismatch {
            path: path.to_path_buf(),
            stored,
            computed,
        });
    }
    Ok(&bytes[HEADER_LEN..])
}

/// A zones file's entries (`rest`, its payload after the static route
/// file's checksum, exactly), for a static route file of `routes` routes;
/// the rule broken otherwise. Allocates at most in proportion to `rest.len()`.
fn index_meta(rest: &[u8], routes: usize) -> Result<Vec<RouteMeta>, String> {
    let mut r = Reader { bytes: rest, at: 0 };
    let count = r.u32("the zones and labels' entry count")? as usize;
    if count == 0 {
        // write() makes no zones file of no entries: one file, one form.
        return Err("a zones file with no zone or label entry (write() makes none then)".into());
    }
    // Each entry takes at least 12 bytes.
    if count > rest.len() / 12 {
        return Err(format!(
            "{count} zone and label entries do not fit in {} bytes",
            rest.len()
        ));
    }
    let mut out: Vec<RouteMeta> = Vec::with_capacity(count);
    for e in 0..count {
        let route = r.u32("an entry's route")?;
        let ip = r.u32("an entry's address")?;
        let port = r.u16("an entry's port")?;
        let addr = NodeAddr { ip, port };
        if route as usize >= routes || port == 0 {
            return Err(format!(
                "zone and label entry {e} names route {route} node {addr}: the file has {routes} routes, and a node needs a port"
            ));
        }
        let bad = |what: String| format!("route {route} node {addr}: {what}");
        let zone = match r.name("a zone")? {
            "" => None,
            z => Some(z.parse::<Zone>().map_err(|e| bad(e.to_string()))?),
        };
        let n = r.u8("a label count")? as usize;
        if n > MAX_LABELS {
            return Err(bad(format!("{n} labels, at most {MAX_LABELS}")));
        }
        let mut labels = Vec::with_capacity(n);
        for _ in 0..n {
            let (k, v) = (r.name("a label key")?, r.name("a label value")?);
            labels.push(Label::new(k, v).map_err(|e| bad(e.to_string()))?);
        }
        if labels.windows(2).any(|w| w[0].key() > w[1].key()) {
            // write() sorts them: one file, one form.
            return Err(bad("labels not sorted by key".into()));
        }
        let labels = Labels::new(labels).map_err(|e| bad(e.to_string()))?;
        if zone.is_none() && labels.is_empty() {
            return Err(bad("an entry with neither a zone nor a label".into()));
        }
        if let Some(prev) = out.last() {
            if (prev.0, prev.1) >= (route, addr) {
                return Err(bad("not in strictly increasing (route, node) order".into()));
            }
        }
        out.push((route, addr, NodeMeta { zone, labels }));
    }
    if r.at != rest.len() {
        return Err(format!(
            "{} bytes after the last of {count} zone and label entries",
            rest.len() - r.at
        ));
    }
    Ok(out)
}

/// Reads the zones-and-labels section, every read bounds-checked.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        if self.bytes.len() - self.at < n {
            return Err(format!(
                "{what} is cut off at byte {} of the zones and labels",
                self.at
            ));
        }
        let out = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(out)
    }

    fn u8(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16, String> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(le_u32(self.take(4, what)?, 0))
    }

    /// A length byte and that many bytes of ASCII (checked further by the
    /// model).
    fn name(&mut self, what: &str) -> Result<&'a str, String> {
        let n = self.u8(what)? as usize;
        let b = self.take(n, what)?;
        std::str::from_utf8(b).map_err(|_| format!("{what} is not text"))
    }
}

/// Where each of the `route_count` routes of a whole file (`bytes`, the
/// header's length already checked) starts, and where in the payload the
/// routes end; the rule broken otherwise. Offsets fit a u32: a file is at
/// most [`MAX_LEN`] bytes.
fn index_routes(route_count: u32, bytes: &[u8]) -> Result<(Vec<u32>, usize), String> {
    let payload = &bytes[HEADER_LEN..];
    let count = route_count as usize;
    if count > payload.len() / ROUTE_LEN {
        return Err(format!(
            "route count {count} needs at least {} bytes, the payload has {}",
            count as u64 * ROUTE_LEN as u64,
            payload.len()
        ));
    }
    let mut starts: Vec<u32> = Vec::with_capacity(count);
    let mut prev: Option<ModuleId> = None;
    let mut at = 0;
    for i in 0..count {
        if payload.len() - at < ROUTE_LEN {
            return Err(format!("route {i} is cut off at payload byte {at}"));
        }
        let module = module_at(payload, at);
        let node_count = le_u32(payload, at + 16) as usize;
        if let Some(prev) = prev {
            if prev >= module {
                return Err(format!(
                    "route {i}: module {module} after {prev}, not in strictly increasing order"
                ));
            }
        }
        prev = Some(module);
        starts.push((HEADER_LEN + at) as u32);
        at += ROUTE_LEN;
        if node_count > (payload.len() - at) / NODE_LEN {
            return Err(format!(
                "module {module} claims {node_count} nodes, only {} bytes remain",
                payload.len() - at
            ));
        }
        let nodes = &payload[at..at + node_count * NODE_LEN];
        if let Some(j) = nodes
            .chunks_exact(NODE_LEN)
            .position(|n| n[4] == 0 && n[5] == 0)
        {
            return Err(format!("module {module} node {j} has port 0"));
        }
        at += node_count * NODE_LEN;
    }
    Ok((starts, at))
}

/// The module of the route header at `at`; bounds checked by [`index`].
fn module_at(bytes: &[u8], at: usize) -> ModuleId {
    ModuleId::new(le_u32(bytes, at), le_u32(bytes, at + 4))
}

/// The nodes of the route whose header is at `at`; checked by [`index`].
fn nodes_at(bytes: &[u8], at: usize) -> Vec<RouteNode> {
    let count = le_u32(bytes, at + 16) as usize;
    let first = at + ROUTE_LEN;
    bytes[first..first + count * NODE_LEN]
        .chunks_exact(NODE_LEN)
        .map(|n| RouteNode {
            addr: NodeAddr {
                ip: le_u32(n, 0),
                port: u16::from_le_bytes([n[4], n[5]]),
            },
            weight: le_u32(n, 6),
        })
        .collect()
}

/// The route whose header is at `at`, with its nodes' `meta`; checked by
/// [`index`].
fn route_at(bytes: &[u8], at: usize, meta: Vec<(NodeAddr, NodeMeta)>) -> SnapshotRoute {
    SnapshotRoute {
        module: module_at(bytes, at),
        version: le_u64(bytes, at + 8),
        nodes: nodes_at(bytes, at),
        meta,
    }
}

/// The little-endian u32 at `at`; callers have checked the bounds.
fn le_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

/// The little-endian u64 at `at`; callers have checked the bounds.
fn le_u64(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::Ipv4Addr;

    #[test]
    fn special_and_oversized_files_are_refused_without_reading_them() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        for (path, kind) in [
            (fifo.as_path(), "FIFO"),
            (dir.path(), "directory"),
            (Path::new("/dev/zero"), "character device"),
        ] {
            let err = read(path).unwrap_err();
            assert!(
                matches!(err, SnapshotError::NotAFile { kind: k, .. } if k == kind),
                "{}: {err}",
                path.display()
            );
        }
        let huge = dir.path().join("huge");
        File::create(&huge).unwrap().set_len(MAX_LEN + 1).unwrap();
        let err = read(&huge).unwrap_err();
        assert!(
            matches!(err, SnapshotError::TooLarge { len, .. } if len == MAX_LEN + 1),
            "{err}"
        );
        // A small file whose header claims more than the bound.
        let claims = dir.path().join("claims");
        let mut bytes = sealed(0, &[]);
        bytes[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        fs::write(&claims, &bytes).unwrap();
        let err = read(&claims).unwrap_err();
        assert!(
            matches!(err, SnapshotError::TooLarge { len, .. } if len == HEADER_LEN as u64 + u64::from(u32::MAX)),
            "{err}"
        );
    }

    fn node(last: u8, port: u16, weight: u32) -> RouteNode {
        RouteNode {
            addr: NodeAddr::new(Ipv4Addr::new(10, 0, 0, last), port),
            weight,
        }
    }

    fn route(modid: u32, cmdid: u32, nodes: Vec<RouteNode>) -> SnapshotRoute {
        SnapshotRoute {
            module: ModuleId::new(modid, cmdid),
            version: u64::from(modid) * 100 + u64::from(cmdid),
            nodes,
            meta: Vec::new(),
        }
    }

    fn sample() -> Vec<SnapshotRoute> {
        vec![
            route(7, 1, vec![node(1, 9000, 1), node(2, 9001, 0)]),
            route(3, 9, vec![node(3, 80, 10)]),
            route(7, 0, vec![]),
        ]
    }

    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// A file with a valid checksum around any header fields and payload.
    fn sealed(route_count: u32, payload: &[u8]) -> Vec<u8> {
        sealed_as(FORMAT_VERSION, route_count, payload)
    }

    /// [`sealed`] in format `version`.
    fn sealed_as(version: u32, route_count: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&route_count.to_le_bytes());
        out.extend_from_slice(&5u64.to_le_bytes());
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(payload);
        let crc = checksum(&out[..CHECKED_HEADER_LEN], &out[HEADER_LEN..]);
        out[CHECKED_HEADER_LEN..HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
        out
    }

    fn route_bytes(modid: u32, cmdid: u32, node_count: u32, nodes: &[(u32, u16, u32)]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&modid.to_le_bytes());
        out.extend_from_slice(&cmdid.to_le_bytes());
        out.extend_from_slice(&1u64.to_le_bytes());
        out.extend_from_slice(&node_count.to_le_bytes());
        for (ip, port, weight) in nodes {
            out.extend_from_slice(&ip.to_le_bytes());
            out.extend_from_slice(&port.to_le_bytes());
            out.extend_from_slice(&weight.to_le_bytes());
        }
        out
    }

    fn malformed_what(bytes: &[u8]) -> String {
        match decode(Path::new("/x/snap"), bytes) {
            Err(SnapshotError::Malformed { what, .. }) => what,
            other => panic!("expected malformed, got {other:?}"),
        }
    }

    #[test]
    fn round_trips_sorted_routes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("routes.snap");
        write(&path, 1_700_000_000, &sample()).unwrap();
        let snap = read(&path).unwrap();
        let mut expected = sample();
        expected.sort_by_key(|r| r.module);
        assert_eq!(
            snap,
            Snapshot {
                written_unix_s: 1_700_000_000,
                routes: expected
            }
        );
        assert_eq!(names_in(dir.path()), ["routes.snap"]);
    }

    #[test]
    fn round_trips_no_routes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("routes.snap");
        write(&path, 0, &[]).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len(), HEADER_LEN as u64);
        let snap = read(&path).unwrap();
        assert!(snap.routes.is_empty());
        assert_eq!(snap.random_node(ModuleId::new(1, 1), 3), None);
    }

    #[test]
    fn round_trips_a_route_with_many_nodes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("routes.snap");
        let nodes: Vec<RouteNode> = (0..20_000u32)
            .map(|i| RouteNode {
                addr: NodeAddr {
                    ip: 0x0a00_0000 + i,
                    port: 1 + (i % 65_535) as u16,
                },
                weight: i,
            })
            .collect();
        let routes = vec![route(1, 2, nodes), route(0, 0, vec![node(9, 1, 1)])];
        write(&path, 42, &routes).unwrap();
        let snap = read(&path).unwrap();
        assert_eq!(
            snap.route(ModuleId::new(1, 2)).unwrap().nodes,
            routes[0].nodes
        );
        assert_eq!(snap.routes.len(), 2);
    }

    #[test]
    fn looks_up_routes_and_picks_nodes() {
        let mut routes = sample();
        routes.sort_by_key(|r| r.module);
        let snap = Snapshot {
            written_unix_s: 1,
            routes,
        };
        assert_eq!(
            snap.route(ModuleId::new(3, 9)).unwrap().nodes,
            [node(3, 80, 10)]
        );
        assert!(snap.route(ModuleId::new(3, 8)).is_none());
        let m = ModuleId::new(7, 1);
        assert_eq!(snap.random_node(m, 0), Some(node(1, 9000, 1).addr));
        assert_eq!(snap.random_node(m, 1), Some(node(2, 9001, 0).addr));
        assert_eq!(snap.random_node(m, u64::MAX), Some(node(2, 9001, 0).addr));
        // A module with no nodes, and an unknown one.
        assert_eq!(snap.random_node(ModuleId::new(7, 0), 5), None);
        assert_eq!(snap.random_node(ModuleId::new(8, 0), 5), None);
    }

    #[test]
    fn overwrites_and_creates_missing_directories() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/b/routes.snap");
        write(&path, 1, &sample()).unwrap();
        write(&path, 2, &[route(1, 1, vec![node(1, 1, 1)])]).unwrap();
        let snap = read(&path).unwrap();
        assert_eq!(snap.written_unix_s, 2);
        assert_eq!(snap.routes.len(), 1);
        assert_eq!(names_in(&dir.path().join("a/b")), ["routes.snap"]);
    }

    #[test]
    fn write_rejects_what_read_would_reject() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("routes.snap");
        let twice = [route(1, 1, vec![]), route(1, 1, vec![])];
        let port0 = [route(1, 1, vec![node(1, 0, 1)])];
        for routes in [&twice[..], &port0[..]] {
            let err = write(&path, 1, routes).unwrap_err();
            assert!(matches!(err, SnapshotError::Invalid { .. }), "{err}");
            assert!(err.to_string().contains("routes.snap"), "{err}");
        }
        assert!(names_in(dir.path()).is_empty());
    }

    #[test]
    fn failed_write_keeps_the_old_file_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("routes.snap");
        write(&path, 1, &sample()).unwrap();
        let old = fs::read(&path).unwrap();

        let bytes = encode(2, &[]).unwrap();
        let mut seen_tmp = None;
        let err = write_bytes(&path, &bytes, |tmp| {
            assert_eq!(
                fs::read(tmp).unwrap(),
                bytes,
                "temp file holds the new content"
            );
            seen_tmp = Some(tmp.to_path_buf());
            Err(io::Error::other("injected"))
        })
        .unwrap_err();
        assert!(
            matches!(err, SnapshotError::Io { op: "prepare", .. }),
            "{err}"
        );
        assert!(seen_tmp.unwrap().starts_with(dir.path()));
        assert_eq!(fs::read(&path).unwrap(), old);
        assert_eq!(names_in(dir.path()), ["routes.snap"]);
    }

    #[test]
    fn failed_rename_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        // A non-empty directory where the file should be: rename fails.
        let path = dir.path().join("routes.snap");
        fs::create_dir(&path).unwrap();
        fs::write(path.join("keep"), b"x").unwrap();
        let err = write(&path, 1, &sample()).unwrap_err();
        assert!(matches!(err, SnapshotError::Io { .. }), "{err}");
        assert_eq!(names_in(dir.path()), ["routes.snap"]);
        assert_eq!(names_in(&path), ["keep"]);
    }

    #[test]
    fn unwritable_directory_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        // A regular file as the parent: no temp file can be created there.
        let blocker = dir.path().join("blocker");
        fs::write(&blocker, b"not a directory").unwrap();
        let err = write(&blocker.join("routes.snap"), 1, &sample()).unwrap_err();
        assert!(matches!(err, SnapshotError::Untrusted(_)), "{err}");
        assert!(err.to_string().contains("not a directory"), "{err}");
        assert_eq!(fs::read(&blocker).unwrap(), b"not a directory");
        assert_eq!(names_in(dir.path()), ["blocker"]);

        // A read-only directory stops everyone but root.
        use std::os::unix::fs::PermissionsExt;
        let ro = dir.path().join("ro");
        fs::create_dir(&ro).unwrap();
        let path = ro.join("routes.snap");
        write(&path, 1, &sample()).unwrap();
        let old = fs::read(&path).unwrap();
        fs::set_permissions(&ro, fs::Permissions::from_mode(0o555)).unwrap();
        let root = nix::unistd::geteuid().is_root();
        let result = write(&path, 2, &[]);
        fs::set_permissions(&ro, fs::Permissions::from_mode(0o755)).unwrap();
        if !root {
            assert!(
                matches!(result, Err(SnapshotError::Io { .. })),
                "{result:?}"
            );
            assert_eq!(fs::read(&path).unwrap(), old);
        }
        assert_eq!(names_in(&ro), ["routes.snap"]);
    }

    #[test]
    fn missing_file_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let err = read(&dir.path().join("none.snap")).unwrap_err();
        assert!(matches!(err, SnapshotError::Missing { .. }), "{err}");
        assert!(err.to_string().contains("none.snap"));
    }

    #[test]
    fn a_directory_is_not_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = read(dir.path()).unwrap_err();
        assert!(
            matches!(
                err,
                SnapshotError::NotAFile {
                    kind: "directory",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn cut_files_are_truncated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("routes.snap");
        let good = encode(1, &sample()).unwrap();
        for cut in [0, 10, HEADER_LEN - 1, HEADER_LEN, good.len() - 1] {
            fs::write(&path, &good[..cut]).unwrap();
            let err = read(&path).unwrap_err();
            let expected = if cut < HEADER_LEN {
                HEADER_LEN
            } else {
                good.len()
            } as u64;
            assert!(
                matches!(err, SnapshotError::Truncated { len, expected: e, .. } if len == cut as u64 && e == expected),
                "cut {cut}: {err}"
            );
        }
    }

    #[test]
    fn foreign_files_have_bad_magic() {
        let mut bytes = encode(1, &sample()).unwrap();
        bytes[0] = b'X';
        let err = decode(Path::new("/x/snap"), &bytes).unwrap_err();
        assert!(
            matches!(err, SnapshotError::BadMagic { found, .. } if found[0] == b'X'),
            "{err}"
        );
        assert!(err.to_string().contains("/x/snap"), "{err}");
    }

    #[test]
    fn newer_formats_are_unsupported() {
        let mut bytes = encode(1, &sample()).unwrap();
        bytes[8..12].copy_from_slice(&3u32.to_le_bytes());
        let err = decode(Path::new("/x/snap"), &bytes).unwrap_err();
        assert!(
            matches!(err, SnapshotError::UnsupportedVersion { found: 3, .. }),
            "{err}"
        );
    }

    fn meta(zone: &str, labels: &str) -> NodeMeta {
        NodeMeta {
            zone: (!zone.is_empty()).then(|| zone.parse().unwrap()),
            labels: labels.parse().unwrap(),
        }
    }

    /// Issue 31: the zones and labels survive in the zones file, which is
    /// written only when some node has either; the static route file
    /// beside it is byte for byte what it would be without them, so every
    /// client ever shipped still reads it.
    #[test]
    fn zones_and_labels_round_trip_in_the_zones_file_and_the_static_file_stays_version_1() {
        let plain = sample();
        let (v1, none) = encode_files(7, &plain).unwrap();
        assert!(none.is_none(), "no meta: no zones file");
        let mut routes = sample();
        let addr0 = routes[0].nodes[0].addr;
        let addr1 = routes[1].nodes[0].addr;
        routes[0].meta = vec![(addr0, meta("eu-1", "version=canary,tier=gold"))];
        routes[1].meta = vec![(addr1, meta("", "flag="))];
        let (main, zones) = encode_files(7, &routes).unwrap();
        assert_eq!(main, v1, "the static route file is the same bytes");
        assert_eq!(le_u32(&main, 8), 1, "version 1, what older clients read");
        let zones = zones.expect("a zones file");
        let mut want = routes.clone();
        want.sort_by_key(|r| r.module);
        let mut idx = SnapshotIndex::new(Path::new("/x/snap"), main.clone()).unwrap();
        idx.attach_zones(Path::new("/x/snap.zones"), &zones)
            .unwrap();
        assert_eq!(idx.to_snapshot().routes, want);
        let i = idx.find(routes[0].module).unwrap();
        assert_eq!(idx.meta(i), routes[0].meta);
        // A client's read: the routes, no meta.
        let client = decode(Path::new("/x/snap"), &main).unwrap();
        assert!(client.routes.iter().all(|r| r.meta.is_empty()));
        // A zones file of another static route file (another time written:
        // a crash between the renames) is left out, the routes kept.
        let (other, _) = encode_files(8, &routes).unwrap();
        let mut idx = SnapshotIndex::new(Path::new("/x/snap"), other).unwrap();
        let err = idx
            .attach_zones(Path::new("/x/snap.zones"), &zones)
            .unwrap_err();
        assert!(
            err.to_string().contains("another static route file"),
            "{err}"
        );
        assert!((0..idx.len()).all(|i| idx.meta(i).is_empty()));
    }

    /// On disk: write() makes the zones file first and removes it when the
    /// nodes have none; read_index takes it, read (the clients') never
    /// looks; a bad zones file costs the agent the zones, not the routes.
    #[test]
    fn the_zones_file_on_disk_is_written_read_replaced_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("routes.snapshot");
        let zpath = zones_path(&path);
        assert_eq!(zpath, dir.path().join("routes.snapshot.zones"));
        let mut routes = sample();
        let addr0 = routes[0].nodes[0].addr;
        routes[0].meta = vec![(addr0, meta("eu-1", ""))];
        write(&path, 5, &routes).unwrap();
        assert!(zpath.exists());
        let idx = read_index(&path).unwrap();
        assert_eq!(idx.zones_problem(), None);
        assert_eq!(
            idx.meta(idx.find(routes[0].module).unwrap()),
            routes[0].meta
        );
        assert!(read(&path)
            .unwrap()
            .routes
            .iter()
            .all(|r| r.meta.is_empty()));
        // A corrupt zones file: the routes load, without zones, and why.
        let mut z = fs::read(&zpath).unwrap();
        let last = z.len() - 1;
        z[last] ^= 1;
        fs::write(&zpath, &z).unwrap();
        let idx = read_index(&path).unwrap();
        assert_eq!(idx.len(), 3);
        assert!(
            idx.zones_problem().unwrap().contains("checksum"),
            "{:?}",
            idx.zones_problem()
        );
        assert!((0..idx.len()).all(|i| idx.meta(i).is_empty()));
        // A zones file anyone could have written (mode 0666) is not
        // trusted: the routes load, without zones, and why.
        write(&path, 5, &routes).unwrap();
        fs::set_permissions(&zpath, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
        let idx = read_index(&path).unwrap();
        assert_eq!(idx.len(), 3);
        let why = idx
            .zones_problem()
            .expect("the writable zones file refused");
        assert!(why.contains("routes.snapshot.zones"), "{why}");
        assert!((0..idx.len()).all(|i| idx.meta(i).is_empty()));
        // No zones any more: the file goes.
        write(&path, 6, &sample()).unwrap();
        assert!(!zpath.exists());
        assert_eq!(read_index(&path).unwrap().zones_problem(), None);
    }

    /// A hostile zones file: every bound checked, named, no panic.
    #[test]
    fn bad_zones_and_labels_in_a_zones_file_are_malformed() {
        let route = route_bytes(1, 1, 1, &[(1, 80, 1)]);
        let main = sealed(1, &route);
        let main_crc = main[CHECKED_HEADER_LEN..HEADER_LEN].to_vec();
        let written = le_u64(&main, 16);
        let entry = |route_no: u32, port: u16, zone: &[u8], labels: &[(&[u8], &[u8])]| {
            let mut e = Vec::new();
            e.extend_from_slice(&route_no.to_le_bytes());
            e.extend_from_slice(&1u32.to_le_bytes());
            e.extend_from_slice(&port.to_le_bytes());
            e.push(zone.len() as u8);
            e.extend_from_slice(zone);
            e.push(labels.len() as u8);
            for (k, v) in labels {
                e.push(k.len() as u8);
                e.extend_from_slice(k);
                e.push(v.len() as u8);
                e.extend_from_slice(v);
            }
            e
        };
        let zones_of = |payload: &[u8]| {
            let p = [&main_crc[..], payload].concat();
            seal(ZONES_MAGIC, ZONES_FORMAT_VERSION, 1, written, &p)
        };
        let file = |entries: &[Vec<u8>]| {
            let mut p = (entries.len() as u32).to_le_bytes().to_vec();
            for e in entries {
                p.extend_from_slice(e);
            }
            zones_of(&p)
        };
        let attach = |bytes: &[u8]| {
            let mut idx = SnapshotIndex::new(Path::new("/x/snap"), main.clone()).unwrap();
            idx.attach_zones(Path::new("/x/snap.zones"), bytes)
                .map(|()| idx)
        };
        let good = file(&[entry(0, 80, b"eu-1", &[(b"v", b"1")])]);
        assert_eq!(attach(&good).unwrap().meta(0).len(), 1);
        let seventeen: Vec<(&[u8], &[u8])> = (0..17).map(|_| (&b"k"[..], &b"v"[..])).collect();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (file(&[entry(1, 80, b"eu", &[])]), "route 1"),
            (file(&[entry(0, 0, b"eu", &[])]), "needs a port"),
            (file(&[entry(0, 80, b"eu 1", &[])]), "the character ' '"),
            (file(&[entry(0, 80, &[b'z'; 64], &[])]), "at most 63"),
            (file(&[entry(0, 80, &[0xff], &[])]), "not text"),
            (file(&[entry(0, 80, b"eu", &seventeen)]), "at most 16"),
            (
                file(&[entry(0, 80, b"eu", &[(b"a", b"1"), (b"a", b"2")])]),
                "twice",
            ),
            (file(&[entry(0, 80, b"eu", &[(b"", b"1")])]), "empty"),
            (file(&[entry(0, 80, b"", &[])]), "neither"),
            (
                file(&[entry(0, 80, b"", &[(b"b", b""), (b"a", b"")])]),
                "not sorted",
            ),
            (file(&[]), "no zone or label entry"),
            (
                file(&[entry(0, 80, b"eu", &[]), entry(0, 80, b"us", &[])]),
                "increasing",
            ),
            (zones_of(&9u32.to_le_bytes()), "do not fit"),
            (zones_of(&[]), "cut off"),
            (
                seal(ZONES_MAGIC, ZONES_FORMAT_VERSION, 1, written, &[0; 8]),
                "another static route file",
            ),
            (
                seal(
                    ZONES_MAGIC,
                    ZONES_FORMAT_VERSION,
                    2,
                    written,
                    &good[HEADER_LEN..],
                ),
                "another static route file",
            ),
            ([&good[..], &[0]].concat(), "after the declared"),
        ];
        for (bytes, want) in cases {
            let what = match attach(&bytes) {
                Err(SnapshotError::Malformed { what, .. }) => what,
                other => panic!("{want}: {other:?}"),
            };
            assert!(what.contains(want), "{want}: {what}");
        }
        // A static route file with bytes after its routes (what a
        // version-2 file of an unreleased build looked like) is malformed.
        let trailing = sealed(1, &[route.clone(), vec![0; 4]].concat());
        assert!(malformed_what(&trailing).contains("after the last"));
        // The wrong magic: a static route file given as a zones file.
        assert!(matches!(
            attach(&main),
            Err(SnapshotError::BadMagic {
                expected: ZONES_MAGIC,
                ..
            })
        ));
    }

    #[test]
    fn flipped_bits_fail_the_checksum() {
        let good = encode(1, &sample()).unwrap();
        // In the payload, in the time written, in the route count.
        for at in [HEADER_LEN + 3, 16, 12] {
            let mut bytes = good.clone();
            bytes[at] ^= 0x10;
            let err = decode(Path::new("/x/snap"), &bytes).unwrap_err();
            assert!(
                matches!(err, SnapshotError::ChecksumMismatch { .. }),
                "byte {at}: {err}"
            );
        }
    }

    #[test]
    fn checksummed_nonsense_is_malformed() {
        let r = |modid, cmdid| route_bytes(modid, cmdid, 1, &[(1, 80, 1)]);
        // More routes than the payload can hold.
        assert!(malformed_what(&sealed(u32::MAX, &r(1, 1))).contains("route count"));
        // More nodes than the rest of the payload can hold.
        let greedy = route_bytes(1, 1, u32::MAX, &[(1, 80, 1)]);
        assert!(malformed_what(&sealed(1, &greedy)).contains("claims"));
        // A node with port 0.
        let port0 = route_bytes(1, 1, 1, &[(1, 0, 1)]);
        assert!(malformed_what(&sealed(1, &port0)).contains("port 0"));
        // Modules out of order, and twice.
        let unsorted = [r(2, 0), r(1, 9)].concat();
        assert!(malformed_what(&sealed(2, &unsorted)).contains("increasing"));
        let twice = [r(1, 1), r(1, 1)].concat();
        assert!(malformed_what(&sealed(2, &twice)).contains("increasing"));
        // Fewer routes declared than the payload holds.
        assert!(malformed_what(&sealed(1, &[r(1, 1), r(1, 2)].concat())).contains("after the last"));
        // A cut-off route header that the count check lets through.
        let mut cut = r(1, 1);
        cut.extend_from_slice(&[0; 19]);
        assert!(malformed_what(&sealed(2, &cut)).contains("cut off"));
        // Bytes after the declared payload.
        let mut long = sealed(1, &r(1, 1));
        long.push(0);
        assert!(malformed_what(&long).contains("after the declared"));
    }

    #[test]
    fn trailing_bytes_on_disk_are_malformed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("routes.snap");
        let mut bytes = encode(1, &sample()).unwrap();
        bytes.extend_from_slice(&[0; 1000]);
        fs::write(&path, &bytes).unwrap();
        let err = read(&path).unwrap_err();
        assert!(matches!(err, SnapshotError::Malformed { .. }), "{err}");
    }

    fn arb_routes() -> impl Strategy<Value = Vec<SnapshotRoute>> {
        let node = (any::<u32>(), 1u16.., any::<u32>()).prop_map(|(ip, port, weight)| RouteNode {
            addr: NodeAddr { ip, port },
            weight,
        });
        // Some nodes get a zone and labels (format 2), from a few names.
        let zones = ["eu-1", "us-2", "a.b_c"];
        let labels = ["", "version=canary", "tier=gold,v=", "a=1,b=2,c=3"];
        let meta = (0usize..4, 0usize..4).prop_map(move |(z, l)| NodeMeta {
            zone: zones.get(z).map(|z| z.parse().unwrap()),
            labels: labels[l].parse().unwrap(),
        });
        let route = (
            0u32..8,
            0u32..8,
            any::<u64>(),
            prop::collection::vec((node, prop::option::weighted(0.3, meta)), 0..6),
        )
            .prop_map(|(modid, cmdid, version, nodes)| {
                let mut meta: Vec<(NodeAddr, NodeMeta)> = nodes
                    .iter()
                    .filter_map(|(n, m)| m.clone().filter(|m| !m.is_empty()).map(|m| (n.addr, m)))
                    .collect();
                meta.sort_by_key(|(a, _)| *a);
                meta.dedup_by_key(|(a, _)| *a);
                SnapshotRoute {
                    module: ModuleId::new(modid, cmdid),
                    version,
                    nodes: nodes.into_iter().map(|(n, _)| n).collect(),
                    meta,
                }
            });
        prop::collection::vec(route, 0..10).prop_map(|mut routes| {
            routes.sort_by_key(|r| r.module);
            routes.dedup_by_key(|r| r.module);
            routes
        })
    }

    #[test]
    fn an_index_finds_and_decodes_each_route_on_demand() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("routes.snap");
        write(&path, 77, &sample()).unwrap();
        let index = read_index(&path).unwrap();
        assert_eq!((index.len(), index.written_unix_s()), (3, 77));
        // Module order: (3, 9), (7, 0), (7, 1).
        let i = index.find(ModuleId::new(7, 1)).unwrap();
        assert_eq!(i, 2);
        assert_eq!(index.module(i), ModuleId::new(7, 1));
        assert_eq!(index.version(i), 701);
        assert_eq!(index.node_count(i), 2);
        assert_eq!(index.nodes(i), [node(1, 9000, 1), node(2, 9001, 0)]);
        assert_eq!(index.node_count(1), 0);
        assert!(index.nodes(1).is_empty());
        for absent in [
            ModuleId::new(0, 0),
            ModuleId::new(7, 2),
            ModuleId::new(5, 5),
        ] {
            assert_eq!(index.find(absent), None, "{absent}");
        }
        assert_eq!(index.to_snapshot(), read(&path).unwrap());
    }

    #[test]
    fn an_index_refuses_what_read_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("routes.snap");
        assert!(matches!(
            read_index(&path),
            Err(SnapshotError::Missing { .. })
        ));
        let mut bytes = encode(1, &sample()).unwrap();
        bytes[HEADER_LEN + 25] ^= 0x04;
        fs::write(&path, &bytes).unwrap();
        let err = read_index(&path).unwrap_err();
        assert!(
            matches!(err, SnapshotError::ChecksumMismatch { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("routes.snap is corrupt"), "{err}");
    }

    proptest! {
        #[test]
        fn an_index_agrees_with_decode(routes in arb_routes(), t in any::<u64>(), probe in (0u32..9, 0u32..9)) {
            let (bytes, zones) = encode_files(t, &routes).unwrap();
            let mut index = SnapshotIndex::new(Path::new("p"), bytes.clone()).unwrap();
            prop_assert_eq!(index.to_snapshot(), decode(Path::new("p"), &bytes).unwrap());
            if let Some(z) = &zones {
                index.attach_zones(Path::new("p.zones"), z).unwrap();
            }
            let probe = ModuleId::new(probe.0, probe.1);
            let found = index.find(probe).map(|i| index.route(i));
            prop_assert_eq!(found.as_ref(), routes.iter().find(|r| r.module == probe));
        }

        #[test]
        fn damaged_bytes_fail_the_index_as_they_fail_decode(
            routes in arb_routes(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        ) {
            let mut bytes = encode(1, &routes).unwrap();
            for (at, value) in edits {
                let at = at.index(bytes.len());
                bytes[at] = value;
            }
            let decoded = decode(Path::new("p"), &bytes);
            let indexed = SnapshotIndex::new(Path::new("p"), bytes);
            match (decoded, indexed) {
                (Ok(d), Ok(i)) => prop_assert_eq!(d, i.to_snapshot()),
                (Err(a), Err(b)) => prop_assert_eq!(a.to_string(), b.to_string()),
                (d, i) => prop_assert!(false, "decode {:?}, index {:?}", d, i),
            }
        }

        #[test]
        fn encoded_routes_decode_to_themselves(routes in arb_routes(), t in any::<u64>()) {
            let (bytes, zones) = encode_files(t, &routes).unwrap();
            // The clients' read: the routes without their zones and labels.
            let snap = decode(Path::new("p"), &bytes).unwrap();
            let bare: Vec<SnapshotRoute> = routes
                .iter()
                .map(|r| SnapshotRoute { meta: Vec::new(), ..r.clone() })
                .collect();
            prop_assert_eq!(snap, Snapshot { written_unix_s: t, routes: bare });
            // The agent's: with them, from the zones file.
            let mut index = SnapshotIndex::new(Path::new("p"), bytes).unwrap();
            if let Some(z) = &zones {
                index.attach_zones(Path::new("p.zones"), z).unwrap();
            }
            prop_assert_eq!(index.to_snapshot(), Snapshot { written_unix_s: t, routes });
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(Path::new("p"), &bytes);
        }

        #[test]
        fn arbitrary_zones_files_never_panic(
            payload in prop::collection::vec(any::<u8>(), 0..256),
            count in 0u32..5,
        ) {
            let main = encode(3, &sample()).unwrap();
            let mut idx = SnapshotIndex::new(Path::new("p"), main.clone()).unwrap();
            let _ = idx.attach_zones(Path::new("z"), &payload);
            // Behind a valid header bound to the file, to reach the entries.
            let p = [&main[CHECKED_HEADER_LEN..HEADER_LEN], &payload[..]].concat();
            let sealed = seal(ZONES_MAGIC, ZONES_FORMAT_VERSION, count, 3, &p);
            if idx.attach_zones(Path::new("z"), &sealed).is_err() {
                prop_assert!((0..idx.len()).all(|i| idx.meta(i).is_empty()));
            }
        }

        #[test]
        fn arbitrary_payloads_behind_a_valid_header_never_panic(
            count in any::<u32>(),
            payload in prop::collection::vec(any::<u8>(), 0..512),
        ) {
            let _ = decode(Path::new("p"), &sealed(count % 64, &payload));
            let _ = decode(Path::new("p"), &sealed(count, &payload));
        }

        #[test]
        fn every_cut_is_truncated(routes in arb_routes(), cut in any::<prop::sample::Index>()) {
            let bytes = encode(1, &routes).unwrap();
            let cut = cut.index(bytes.len());
            let is_truncated = matches!(
                decode(Path::new("p"), &bytes[..cut]),
                Err(SnapshotError::Truncated { .. })
            );
            prop_assert!(is_truncated);
        }

        #[test]
        fn every_single_bit_flip_is_caught(routes in arb_routes(), at in any::<prop::sample::Index>(), bit in 0u8..8) {
            let mut bytes = encode(1, &routes).unwrap();
            let at = at.index(bytes.len());
            bytes[at] ^= 1 << bit;
            prop_assert!(decode(Path::new("p"), &bytes).is_err());
        }

        #[test]
        fn random_damage_never_panics(
            routes in arb_routes(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        ) {
            let mut bytes = encode(1, &routes).unwrap();
            for (at, value) in edits {
                let at = at.index(bytes.len());
                bytes[at] = value;
            }
            let _ = decode(Path::new("p"), &bytes);
        }
    }
}
