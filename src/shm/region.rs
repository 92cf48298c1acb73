//! The one place with `unsafe` for the shared-memory transport: mapping a
//! region file, its words as atomics, copying bytes in and out, the futex
//! calls and the `SIGBUS` guard (nix has no futex, and the guard's handler
//! must stay async-signal-safe raw calls). The rest of its system calls
//! (reserving, chown, whether a pid is alive, group lookup) go through
//! nix's safe wrappers. Everything above it works with offsets that
//! [`super::layout`] computed and this module checks.

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use memmap2::{MmapOptions, MmapRaw};
use nix::errno::Errno;
use nix::fcntl::posix_fallocate;
use nix::sys::signal::kill;
use nix::unistd::{fchown, sysconf, Gid, Group, Pid, SysconfVar};

use super::layout::{self, Geometry, SLOT_WORDS};

/// Why a region cannot be created or opened.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// A system call on the file failed.
    #[error("shared-memory region {path}: cannot {op}: {error}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The region file.
        path: PathBuf,
        /// The system's error (in the message, not a `source()`: a chain
        /// printed with `{:#}` would name it twice).
        error: io::Error,
    },
    /// The file or its directory breaks the ownership rules of
    /// [`lbagent_host::owned`]: another user could have planted or
    /// changed it.
    #[error("shared-memory region: {0}")]
    Untrusted(lbagent_host::owned::OwnedError),
    /// The file is not a region this build can use.
    #[error("shared-memory region {path} is unusable: {why}")]
    Invalid {
        /// The region file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
}

impl RegionError {
    /// True when the file system had no room for the region (`ENOSPC`: a
    /// full `/dev/shm`), a condition of the host rather than of the
    /// configuration.
    pub fn is_no_space(&self) -> bool {
        matches!(self, RegionError::Io { error, .. } if error.raw_os_error() == Some(libc::ENOSPC))
    }
}

/// Who may open a region: the agent's user only (mode 0600), or also a
/// group (mode 0660, the file's group set to it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Mode 0600.
    Owner,
    /// Mode 0660 and this group id.
    Group(u32),
}

/// What a region's header says about its agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The shard the region belongs to.
    pub shard: u32,
    /// The agent's pid.
    pub pid: u32,
    /// Random per agent start.
    pub boot: u64,
}

/// A mapped region file.
pub struct Region {
    map: MmapRaw,
    geometry: Geometry,
    identity: Identity,
    path: PathBuf,
    /// The entry of [`GUARDED`] covering this mapping, if guarded.
    guard: Option<usize>,
    /// The file's device and inode, as it was mapped.
    file_id: (u64, u64),
}

// SAFETY: the mapping is plain shared memory, accessed only through
// atomics and raw copies (never through references to its bytes), which
// any thread may do; the slot protocol (layout docs) orders them.
unsafe impl Send for Region {}
// SAFETY: as for Send: no method hands out references into the bytes.
unsafe impl Sync for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("path", &self.path)
            .field("identity", &self.identity)
            .field("slots", &self.geometry.slots)
            .finish_non_exhaustive()
    }
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> RegionError + 'a {
    move |error| RegionError::Io {
        op,
        path: path.to_path_buf(),
        error,
    }
}

/// Allocates now (`posix_fallocate`) every page of the region a client
/// writes: the header and, in each slot, its control words and request
/// area. A region file is sized with a hole; on a full tmpfs (`/dev/shm`)
/// the first write to a page in the hole would raise `SIGBUS` in the
/// process writing, a client's application included. Reserved at
/// creation, a full file system is instead an error naming the file when
/// the agent starts ([`RegionError::is_no_space`]: the agent then offers no
/// regions). The response areas (most of a slot) stay a hole until used:
/// only the agent writes them, and its mappings are guarded
/// ([`Region::guard`]: such a fault closes the region, its clients go by
/// UDP); a client reads only what the agent wrote.
fn reserve(file: &File, g: &Geometry) -> io::Result<()> {
    let spans = std::iter::once((0, layout::HEADER_LEN))
        .chain((0..g.slots).map(|i| (g.slot_offset(i), layout::S_DATA + g.req_cap)));
    for (at, len) in spans {
        let (at, len) = (
            libc::off_t::try_from(at).map_err(|_| too_large())?,
            libc::off_t::try_from(len).map_err(|_| too_large())?,
        );
        loop {
            match posix_fallocate(file, at, len) {
                Ok(()) => break,
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}

/// The device and inode numbers of an open file.
fn file_id(file: &File) -> io::Result<(u64, u64)> {
    let meta = file.metadata()?;
    Ok((meta.dev(), meta.ino()))
}

/// True when `fd` is an open file description of the file whose device and
/// inode are `id`, opened for reading and writing: what proves that a
/// process which passed it may use that region (it opened it with the
/// region's own permission checks).
pub fn is_open_rw(fd: std::os::fd::BorrowedFd<'_>, id: (u64, u64)) -> bool {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    use nix::sys::stat::fstat;
    let Ok(st) = fstat(fd) else {
        return false;
    };
    let rw = fcntl(fd, FcntlArg::F_GETFL)
        .map(|f| OFlag::from_bits_truncate(f) & OFlag::O_ACCMODE == OFlag::O_RDWR)
        .unwrap_or(false);
    rw && (st.st_dev, st.st_ino) == id
}

fn too_large() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "region too large")
}

impl Region {
    /// Creates the region for `identity` at `path` with `geometry`: a new
    /// file written under a temporary name, then renamed over `path`, so a
    /// client never maps a half-made region and one that mapped the
    /// previous agent's keeps that (closed) file. The parent directory must
    /// exist.
    ///
    /// # Errors
    /// [`RegionError::Io`] naming the step that failed.
    pub fn create(
        path: &Path,
        geometry: Geometry,
        identity: Identity,
        access: Access,
    ) -> Result<Region, RegionError> {
        use lbagent_host::owned;
        // The agent's directory (made if missing; refused if others can
        // write it), then a temporary name created exclusively, never
        // through a symbolic link.
        owned::ensure_agent_dir(owned::parent_of(path)).map_err(RegionError::Untrusted)?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".tmp{}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let _ = std::fs::remove_file(&tmp);
        let mode = match access {
            Access::Owner => 0o600,
            Access::Group(_) => 0o660,
        };
        let file = owned::create_exclusive(&tmp, mode).map_err(|e| match e {
            owned::OwnedError::Io { error, .. } => io_err("create", &tmp)(error),
            e => RegionError::Untrusted(e),
        })?;
        let made = (|| {
            if let Access::Group(gid) = access {
                // No owner: the owner is kept.
                fchown(&file, None, Some(Gid::from_raw(gid)))
                    .map_err(|e| io_err("chown to the group", &tmp)(e.into()))?;
            }
            file.set_len(geometry.file_len() as u64)
                .map_err(io_err("size", &tmp))?;
            reserve(&file, &geometry).map_err(io_err(
                "reserve its memory (is the file system full? free space in it, or lower [shm] slots)",
                &tmp,
            ))?;
            let map = MmapOptions::new()
                .len(geometry.file_len())
                .map_raw(&file)
                .map_err(io_err("map", &tmp))?;
            let region = Region {
                map,
                geometry,
                identity,
                path: path.to_path_buf(),
                guard: None,
                file_id: file_id(&file).map_err(io_err("stat", &tmp))?,
            };
            let r = Ordering::Relaxed;
            region.u32(layout::H_VERSION).store(layout::VERSION, r);
            region.u32(layout::H_SHARD).store(identity.shard, r);
            region.u32(layout::H_PID).store(identity.pid, r);
            region.u32(layout::H_SLOTS).store(geometry.slots, r);
            region
                .u32(layout::H_SLOT_SIZE)
                .store(geometry.slot_size as u32, r);
            region
                .u32(layout::H_REQ_CAP)
                .store(geometry.req_cap as u32, r);
            region
                .u32(layout::H_RESP_CAP)
                .store(geometry.resp_cap as u32, r);
            region.u64(layout::H_BOOT).store(identity.boot, r);
            // The magic last: a header with it is complete.
            region
                .u32(layout::H_MAGIC)
                .store(layout::MAGIC, Ordering::Release);
            std::fs::rename(&tmp, path).map_err(io_err("rename into place", path))?;
            Ok(region)
        })();
        if made.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        made
    }

    /// Opens and maps the region at `path` (read-write: a client writes its
    /// slot) and checks its header against the file.
    ///
    /// # Errors
    /// [`RegionError::Io`] (missing, no permission), [`RegionError::Invalid`]
    /// (not a regular file, bad magic or version, a geometry that does not
    /// fit the file).
    pub fn open(path: &Path) -> Result<Region, RegionError> {
        Self::open_file(path).map(|(region, _)| region)
    }

    /// [`Region::open`], and the file it mapped, still open read-write (a
    /// client passes it to the agent to prove it may use the region: see
    /// [`super::lease`]).
    ///
    /// # Errors
    /// As [`Region::open`].
    pub fn open_file(path: &Path) -> Result<(Region, File), RegionError> {
        use lbagent_host::owned::{open_trusted, OwnedError};
        let invalid = |why: String| RegionError::Invalid {
            path: path.to_path_buf(),
            why,
        };
        // Owner, mode and directory checked first (lbagent_host::owned);
        // group-writable is the `shm.group` mode.
        let file = open_trusted(path, true, true).map_err(|e| match e {
            OwnedError::Io { op, error, .. } => io_err(op, path)(error),
            OwnedError::NotAFile { .. } => invalid("not a regular file".into()),
            e => RegionError::Untrusted(e),
        })?;
        let meta = file.metadata().map_err(io_err("stat", path))?;
        if meta.len() < layout::HEADER_LEN as u64 {
            return Err(invalid(format!(
                "{} bytes, shorter than its header",
                meta.len()
            )));
        }
        // Map the header first, read the geometry, then the whole file.
        let head = MmapOptions::new()
            .len(layout::HEADER_LEN)
            .map_raw(&file)
            .map_err(io_err("map", path))?;
        let peek = Region {
            map: head,
            geometry: Geometry::new(0),
            identity: Identity {
                shard: 0,
                pid: 0,
                boot: 0,
            },
            path: path.to_path_buf(),
            guard: None,
            file_id: (meta.dev(), meta.ino()),
        };
        let magic = peek.u32(layout::H_MAGIC).load(Ordering::Acquire);
        if magic != layout::MAGIC {
            return Err(invalid(format!(
                "magic {magic:#010x}, expected {:#010x}",
                layout::MAGIC
            )));
        }
        let version = peek.load32(layout::H_VERSION);
        if version != layout::VERSION {
            return Err(invalid(format!(
                "layout version {version}, this build reads {}",
                layout::VERSION
            )));
        }
        let geometry = Geometry::from_header(
            peek.load32(layout::H_SLOTS),
            peek.load32(layout::H_SLOT_SIZE),
            peek.load32(layout::H_REQ_CAP),
            peek.load32(layout::H_RESP_CAP),
            meta.len(),
        )
        .map_err(invalid)?;
        let identity = Identity {
            shard: peek.load32(layout::H_SHARD),
            pid: peek.load32(layout::H_PID),
            boot: peek.u64(layout::H_BOOT).load(Ordering::Relaxed),
        };
        let map = MmapOptions::new()
            .len(geometry.file_len())
            .map_raw(&file)
            .map_err(io_err("map", path))?;
        let region = Region {
            map,
            geometry,
            identity,
            path: path.to_path_buf(),
            guard: None,
            file_id: (meta.dev(), meta.ino()),
        };
        Ok((region, file))
    }

    /// Makes the mapping survive its file being truncated: any process
    /// that may write the region (it opens the file read-write to write
    /// its slot) may also `ftruncate` it, and touching a mapped page past
    /// the file's new end raises `SIGBUS`, which would kill the agent. Once
    /// guarded, such a fault maps private zero pages over the rest of the
    /// mapping instead (the slots there read as free and empty), and
    /// [`Region::truncated`] says so; the serving loop then closes it
    /// ([`Region::close_if_truncated`]: its clients go by UDP). Installs the process's `SIGBUS` handler the first time
    /// (faults elsewhere go on to the handler it replaced). Only the agent
    /// guards its regions: a client library installs no signal handler in
    /// its application. Returns false if the handler could not be installed
    /// or every guard entry is in use (the region is served unguarded).
    pub fn guard(&mut self) -> bool {
        if self.guard.is_some() {
            return true;
        }
        if !install_sigbus_handler() {
            return false;
        }
        let start = self.map.as_ptr() as usize;
        for (i, e) in GUARDED.iter().enumerate() {
            if e.start
                .compare_exchange(0, start, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                e.faulted.store(false, Ordering::Relaxed);
                e.len.store(self.map.len(), Ordering::Release);
                self.guard = Some(i);
                return true;
            }
        }
        false
    }

    /// Once the guarded mapping met its file truncated ([`Region::truncated`]),
    /// marks the region closed in its header, so that its clients go by UDP
    /// at once instead of waiting for answers that can no longer reach
    /// them; returns whether it did. Called by the serving loop, never from
    /// the signal handler: if the header itself is gone, the store faults
    /// once more and the handler maps a private page over it (the clients
    /// then see their file shrink and give up the region themselves).
    pub fn close_if_truncated(&self) -> bool {
        if !self.truncated() {
            return false;
        }
        self.u32(layout::H_CLOSED).store(1, Ordering::SeqCst);
        true
    }

    /// True once a guarded mapping met its file truncated under it (see
    /// [`Region::guard`]).
    pub fn truncated(&self) -> bool {
        self.guard
            .is_some_and(|i| GUARDED[i].faulted.load(Ordering::Acquire))
    }

    /// The region's geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Who made the region.
    pub fn identity(&self) -> Identity {
        self.identity
    }

    /// The region file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The mapped file's device and inode numbers (what an open file a
    /// client passes is compared with).
    pub fn file_id(&self) -> (u64, u64) {
        self.file_id
    }

    /// The header's features word ([`layout::FEAT_LEASE`],
    /// [`layout::FEAT_NODE_HINT`]).
    pub fn features(&self) -> u32 {
        self.u32(layout::H_FEATURES).load(Ordering::Acquire)
    }

    /// Sets the header's features word (the agent, once it knows what it
    /// offers).
    pub fn set_features(&self, features: u32) {
        self.u32(layout::H_FEATURES)
            .store(features, Ordering::Release);
    }

    /// Adds `bits` to the header's features word (each part of the agent
    /// that offers something sets its own bit).
    pub fn add_features(&self, bits: u32) {
        self.u32(layout::H_FEATURES)
            .fetch_or(bits, Ordering::AcqRel);
    }

    /// The 32-bit word at byte `off`.
    ///
    /// # Panics
    /// When `off` is not 4-aligned or the word is outside the mapping (a
    /// bug: offsets come from [`layout`]).
    #[inline]
    pub fn u32(&self, off: usize) -> &AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= self.map.len(), "word at {off}");
        // SAFETY: the mapping is page aligned, `off` is 4-aligned and in
        // bounds, and the mapping lives as long as `self`. The memory is
        // only accessed as atomics by every process (the bytes areas are
        // distinct offsets, see layout).
        unsafe { &*self.map.as_ptr().add(off).cast::<AtomicU32>() }
    }

    /// Slot `slot`'s offset and the words of its header, with one check:
    /// that the geometry has the slot. Every slot of the geometry lies
    /// whole inside the mapping (it maps the geometry's whole file:
    /// [`Geometry::file_len`](layout::Geometry::file_len), checked against
    /// the file when a region is opened), and its offset is a multiple of
    /// 64, so no bounds or alignment check is needed past that one (the
    /// shard's request path reads a slot's header twice a request: a check
    /// of the offset against the mapping cost 4 instructions each,
    /// callgrind).
    ///
    /// # Panics
    /// When `slot` is not one of the geometry's.
    #[inline(always)]
    pub fn slot(&self, slot: u32) -> (usize, &[AtomicU32; SLOT_WORDS]) {
        assert!(slot < self.geometry.slots, "slot {slot}");
        let base = self.geometry.slot_offset(slot);
        debug_assert!(base % 64 == 0 && base + self.geometry.slot_size <= self.map.len());
        // SAFETY: as in `u32`: page-aligned mapping, a 64-aligned offset,
        // the whole array inside the live mapping (argued above), accessed
        // only as atomics.
        let words = unsafe {
            &*self
                .map
                .as_ptr()
                .add(base)
                .cast::<[AtomicU32; SLOT_WORDS]>()
        };
        (base, words)
    }

    /// Copies the inline answer `record` into slot `slot`'s second line
    /// ([`layout::S_INLINE_B`]), with [`Region::slot`]'s one check.
    ///
    /// # Panics
    /// When `slot` is not one of the geometry's.
    #[inline(always)]
    pub fn copy_in_inline<const N: usize>(&self, slot: u32, record: &[u8; N]) {
        const {
            assert!(
                N <= layout::INLINE_B && layout::S_INLINE_B + layout::INLINE_B <= layout::S_DATA
            )
        };
        let (base, _) = self.slot(slot);
        // SAFETY: the range lies inside the slot's first S_DATA bytes
        // (S_INLINE_B + INLINE_B <= S_DATA), inside the mapping as
        // `slot` argues; `record` is ours.
        unsafe {
            std::ptr::copy_nonoverlapping(
                record.as_ptr(),
                self.map.as_mut_ptr().add(base + layout::S_INLINE_B),
                N,
            )
        }
    }

    /// The 64-bit word at byte `off`.
    ///
    /// # Panics
    /// As [`Region::u32`], 8-aligned.
    pub fn u64(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= self.map.len(), "word at {off}");
        // SAFETY: as in `u32`, with an 8-aligned offset.
        unsafe { &*self.map.as_ptr().add(off).cast::<AtomicU64>() }
    }

    fn load32(&self, off: usize) -> u32 {
        self.u32(off).load(Ordering::Relaxed)
    }

    /// Copies the inline cell of the slot at `base` (its bytes at
    /// [`layout::S_INLINE_A`] and [`layout::S_INLINE_B`]) into `dst`, with
    /// one bounds check: the slot's first [`layout::S_DATA`] bytes must lie
    /// inside the mapping. As [`Region::copy_out`], the bytes may be
    /// changing under it.
    ///
    /// # Panics
    /// When the slot's header is outside the mapping (a bug).
    #[inline]
    pub fn copy_out_inline(&self, base: usize, dst: &mut [u8; layout::INLINE_CAP]) {
        assert!(base
            .checked_add(layout::S_DATA)
            .is_some_and(|e| e <= self.map.len()));
        // SAFETY: checked above.
        unsafe { self.copy_inline_unchecked(base, dst) }
    }

    /// [`Region::copy_out_inline`] of slot `slot`, with [`Region::slot`]'s
    /// one check.
    ///
    /// # Panics
    /// When `slot` is not one of the geometry's.
    #[inline(always)]
    pub fn copy_out_inline_of(&self, slot: u32, dst: &mut [u8; layout::INLINE_CAP]) {
        let (base, _) = self.slot(slot);
        // SAFETY: the slot lies whole inside the mapping (`slot`).
        unsafe { self.copy_inline_unchecked(base, dst) }
    }

    /// The copy of [`Region::copy_out_inline`].
    ///
    /// # Safety
    /// The slot's first [`layout::S_DATA`] bytes from `base` must lie
    /// inside the mapping.
    #[inline(always)]
    unsafe fn copy_inline_unchecked(&self, base: usize, dst: &mut [u8; layout::INLINE_CAP]) {
        // SAFETY: both ranges are inside the slot's first S_DATA bytes,
        // inside the live mapping (the caller's promise); `dst` is ours.
        unsafe {
            let src = self.map.as_ptr().add(base);
            std::ptr::copy_nonoverlapping(
                src.add(layout::S_INLINE_A),
                dst.as_mut_ptr(),
                layout::INLINE_A,
            );
            std::ptr::copy_nonoverlapping(
                src.add(layout::S_INLINE_B),
                dst.as_mut_ptr().add(layout::INLINE_A),
                layout::INLINE_B,
            );
        }
    }

    /// Copies `dst.len()` bytes from offset `off` of the region.
    ///
    /// # Panics
    /// When the range is outside the mapping.
    #[inline]
    pub fn copy_out(&self, off: usize, dst: &mut [u8]) {
        assert!(off
            .checked_add(dst.len())
            .is_some_and(|e| e <= self.map.len()));
        // SAFETY: the range is inside the live mapping and `dst` is ours. The
        // bytes may be written concurrently by another process (a client
        // rewriting its own request); the slot protocol then discards the
        // copy (the sequence moved), and the copy is only ever decoded
        // after being checked like any datagram.
        unsafe {
            std::ptr::copy_nonoverlapping(self.map.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        }
    }

    /// Copies `src` to offset `off` of the region.
    ///
    /// # Panics
    /// When the range is outside the mapping.
    #[inline]
    pub fn copy_in(&self, off: usize, src: &[u8]) {
        assert!(off
            .checked_add(src.len())
            .is_some_and(|e| e <= self.map.len()));
        // SAFETY: as in `copy_out`, in the other direction; the region is
        // mapped writable by both sides.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.map.as_mut_ptr().add(off), src.len())
        }
    }

    /// Sleeps while the word at `off` holds `expected`, at most `timeout`
    /// (a shared futex: the waker is another process). Returns early on a
    /// wake, a signal, or when the word already differs.
    pub fn futex_wait(&self, off: usize, expected: u32, timeout: Duration) {
        let word = self.u32(off);
        let ts = libc::timespec {
            tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: FUTEX_WAIT on a live, aligned 32-bit word of a shared
        // mapping with a relative timeout; no memory is written.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                expected,
                &ts as *const libc::timespec,
            );
        }
    }

    /// Wakes every waiter on the word at `off`.
    pub fn futex_wake(&self, off: usize) {
        let word = self.u32(off);
        // SAFETY: FUTEX_WAKE on a live, aligned 32-bit word; no memory is
        // read or written by the kernel besides the futex queue.
        unsafe {
            libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
        }
    }
}

impl Drop for Region {
    /// Takes the mapping out of the `SIGBUS` guard before it is unmapped.
    fn drop(&mut self) {
        if let Some(i) = self.guard.take() {
            GUARDED[i].len.store(0, Ordering::Release);
            GUARDED[i].start.store(0, Ordering::Release);
        }
    }
}

/// A guarded mapping: its start (0: entry free) and length.
struct Guarded {
    start: AtomicUsize,
    len: AtomicUsize,
    faulted: AtomicBool,
}

/// Room for this many guarded mappings (one per shard of the agent).
const GUARDS: usize = 256;

/// The guarded mappings, read by the signal handler (atomics only: it may
/// run at any point of any thread).
static GUARDED: [Guarded; GUARDS] = [const {
    Guarded {
        start: AtomicUsize::new(0),
        len: AtomicUsize::new(0),
        faulted: AtomicBool::new(false),
    }
}; GUARDS];

/// The `SIGBUS` action the guard's handler replaced, and the page size.
static PREVIOUS: OnceLock<(libc::sigaction, usize)> = OnceLock::new();

/// Installs [`on_sigbus`] once per process; true if it is installed.
fn install_sigbus_handler() -> bool {
    PREVIOUS
        .get_or_init(|| {
            let page = sysconf(SysconfVar::PAGE_SIZE)
                .ok()
                .flatten()
                .unwrap_or(4096)
                .max(4096) as usize;
            // SAFETY: all-zero is a valid sigaction; both structs are live,
            // and the handler only touches atomics and async-signal-safe
            // calls (mmap, sigaction).
            unsafe {
                let mut act: libc::sigaction = std::mem::zeroed();
                act.sa_sigaction = on_sigbus as *const () as usize;
                act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut act.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(libc::SIGBUS, &act, &mut old) != 0 {
                    // Not installed: say so by a page size of 0.
                    return (old, 0);
                }
                (old, page)
            }
        })
        .1
        != 0
}

/// The `SIGBUS` handler: a fault inside a guarded mapping (its file was
/// truncated) maps private zero pages from the faulting page to the
/// mapping's end, and the access is retried; any other fault goes to the
/// previous handler, or to the default action (the process dies, as it
/// would have).
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let Some((old, page)) = PREVIOUS.get() else {
        return;
    };
    // SAFETY: the kernel hands a valid siginfo to an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    for e in &GUARDED {
        let start = e.start.load(Ordering::Acquire);
        let len = e.len.load(Ordering::Acquire);
        if start == 0 || addr < start || addr >= start + len {
            continue;
        }
        let from = addr & !(page - 1);
        // SAFETY: [from, start + len) lies inside a live mapping this
        // process owns (registered until the Region is dropped); replacing
        // it with anonymous memory changes what the region's atomics read,
        // never what Rust owns.
        let r = unsafe {
            libc::mmap(
                from as *mut libc::c_void,
                start + len - from,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if r != libc::MAP_FAILED {
            // Nothing else: the handler never touches the file's pages.
            // The file may have been cut anywhere, the header included,
            // and a store there would fault again inside the handler,
            // where SIGBUS is blocked: the kernel would then kill the
            // process (issue 27). Closing the region is the serving
            // loop's business ([`Region::close_if_truncated`]), outside
            // any handler, where a fault is just another guarded one.
            e.faulted.store(true, Ordering::Release);
            return;
        }
    }
    let h = old.sa_sigaction;
    if h == libc::SIG_DFL || h == libc::SIG_IGN {
        // SAFETY: restoring the default action; returning re-runs the
        // faulting access, which then ends the process as without a guard.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
        }
    } else if old.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the previous handler was installed as an SA_SIGINFO one.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(h) };
        f(sig, info, ctx);
    } else {
        // SAFETY: the previous handler was installed as a plain one.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(h) };
        f(sig);
    }
}

/// True when no process `pid` exists (`kill(pid, 0)` fails with ESRCH). A
/// process of another user exists (EPERM).
pub fn process_gone(pid: i32) -> bool {
    // No signal: only the existence check is made.
    kill(Pid::from_raw(pid), None) == Err(Errno::ESRCH)
}

/// The group id of group `name`, if the system knows it.
pub fn group_id(name: &str) -> Option<u32> {
    Group::from_name(name)
        .ok()
        .flatten()
        .map(|g| g.gid.as_raw())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn ident() -> Identity {
        Identity {
            shard: 1,
            pid: std::process::id(),
            boot: 77,
        }
    }

    #[test]
    fn a_created_region_opens_with_its_identity_and_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.0");
        let g = Geometry::new(3);
        let made = Region::create(&path, g, ident(), Access::Owner).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(meta.len(), g.file_len() as u64);
        // What clients write is allocated, not a hole (no write of theirs
        // can fault for want of space); the response areas are not.
        let allocated = meta.blocks() * 512;
        let written = (layout::HEADER_LEN + 3 * (layout::S_DATA + g.req_cap)) as u64;
        assert!(
            (written..g.file_len() as u64).contains(&allocated),
            "{allocated} bytes allocated, {written} written by clients, {} in all",
            g.file_len()
        );
        let opened = Region::open(&path).unwrap();
        assert_eq!(opened.identity(), ident());
        assert_eq!(*opened.geometry(), g);
        // Both map the same memory.
        made.copy_in(g.slot_offset(2) + layout::S_DATA, b"hello");
        let mut got = [0u8; 5];
        opened.copy_out(g.slot_offset(2) + layout::S_DATA, &mut got);
        assert_eq!(&got, b"hello");
        // Nothing but the region is left in the directory.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn only_a_full_file_system_is_no_space() {
        let err = |errno| RegionError::Io {
            op: "reserve its memory",
            path: PathBuf::from("/dev/shm/x"),
            error: io::Error::from_raw_os_error(errno),
        };
        assert!(err(libc::ENOSPC).is_no_space());
        assert!(!err(libc::EACCES).is_no_space());
        let invalid = RegionError::Invalid {
            path: PathBuf::from("/dev/shm/x"),
            why: "bad magic".into(),
        };
        assert!(!invalid.is_no_space());
    }

    #[test]
    fn a_group_region_is_0660_in_that_group() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.0");
        let gid = nix::unistd::getegid().as_raw();
        Region::create(&path, Geometry::new(1), ident(), Access::Group(gid)).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!((meta.mode() & 0o777, meta.gid()), (0o660, gid));
    }

    #[test]
    fn foreign_or_short_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x");
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let e = Region::open(&path).unwrap_err().to_string();
        assert!(e.contains("magic"), "{e}");
        std::fs::write(&path, b"short").unwrap();
        assert!(Region::open(&path)
            .unwrap_err()
            .to_string()
            .contains("shorter"));
        let e = Region::open(&dir.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot open"), "{e}");
        assert!(Region::open(dir.path()).is_err());
        // A header claiming more slots than the file holds.
        let g = Geometry::new(2);
        Region::create(&path, g, ident(), Access::Owner).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(g.file_len() as u64 - 1).unwrap();
        let e = Region::open(&path).unwrap_err().to_string();
        assert!(e.contains("needs"), "{e}");
    }

    #[test]
    fn a_region_of_another_layout_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.0");
        let made = Region::create(&path, Geometry::new(2), ident(), Access::Owner).unwrap();
        assert!(Region::open(&path).is_ok());
        // Version 2 (before the fixed layout), and one from the future.
        for other in [2, layout::VERSION + 1] {
            made.u32(layout::H_VERSION).store(other, Ordering::SeqCst);
            let e = Region::open(&path).unwrap_err().to_string();
            assert!(
                e.contains(&format!("layout version {other}, this build reads 3")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_futex_waiter_is_woken_and_a_silent_one_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.0");
        let region = std::sync::Arc::new(
            Region::create(&path, Geometry::new(1), ident(), Access::Owner).unwrap(),
        );
        let off = region.geometry().slot_offset(0) + layout::S_RESP_SEQ;
        let t0 = std::time::Instant::now();
        region.futex_wait(off, 0, Duration::from_millis(30));
        assert!(t0.elapsed() >= Duration::from_millis(25));
        let other = region.clone();
        let waker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            other.u32(off).store(1, Ordering::SeqCst);
            other.futex_wake(off);
        });
        let t0 = std::time::Instant::now();
        while region.u32(off).load(Ordering::SeqCst) == 0 {
            region.futex_wait(off, 0, Duration::from_secs(10));
        }
        assert!(t0.elapsed() < Duration::from_secs(5));
        waker.join().unwrap();
    }

    #[test]
    fn a_region_truncated_to_nothing_faults_once_per_access_and_never_in_the_handler() {
        // Issue 27: after `truncate -s 0` the handler used to store
        // `closed` into the header, past the file's end too: a second
        // SIGBUS inside the handler, and the kernel killed the agent.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.0");
        let g = Geometry::new(4);
        let mut region = Region::create(&path, g, ident(), Access::Owner).unwrap();
        assert!(region.guard());
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(0).unwrap();
        // A slot first (past the header), then the header itself.
        let off = g.slot_offset(3) + layout::S_REQ_SEQ;
        assert_eq!(region.u32(off).load(Ordering::SeqCst), 0);
        assert!(region.truncated());
        assert!(region.close_if_truncated());
        assert_eq!(region.u32(layout::H_CLOSED).load(Ordering::SeqCst), 1);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
        // Regrown and cut again while mapped: still no fault escapes.
        f.set_len(g.file_len() as u64).unwrap();
        f.set_len(0).unwrap();
        region.u32(layout::H_MAGIC).store(3, Ordering::SeqCst);
        assert_eq!(region.u32(layout::H_MAGIC).load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_guarded_region_survives_its_file_truncated_under_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.0");
        let g = Geometry::new(3);
        let mut region = Region::create(&path, g, ident(), Access::Owner).unwrap();
        assert!(region.guard());
        assert!(!region.truncated());
        let off = g.slot_offset(2) + layout::S_REQ_SEQ;
        region.u32(off).store(7, Ordering::SeqCst);
        // A client (any process that can open it read-write) truncates it.
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(layout::HEADER_LEN as u64).unwrap();
        // Without the guard this access kills the process with SIGBUS.
        assert_eq!(region.u32(off).load(Ordering::SeqCst), 0);
        region.u32(off).store(9, Ordering::SeqCst);
        assert_eq!(region.u32(off).load(Ordering::SeqCst), 9);
        let mut buf = [1u8; 16];
        region.copy_out(g.slot_offset(1) + layout::S_DATA, &mut buf);
        assert_eq!(buf, [0u8; 16]);
        assert!(region.truncated());
        // The serving loop closes it; the header, still inside the file,
        // is still shared: it says the region is closed (its clients go by
        // UDP), and no client maps it.
        assert!(region.close_if_truncated());
        let e = Region::open(&path).unwrap_err().to_string();
        assert!(e.contains("needs"), "{e}");
        let mut head = [0u8; 4];
        std::fs::File::open(&path)
            .and_then(|mut f| {
                use std::io::{Read, Seek};
                f.seek(io::SeekFrom::Start(layout::H_CLOSED as u64))?;
                f.read_exact(&mut head)
            })
            .unwrap();
        assert_eq!(u32::from_ne_bytes(head), 1);
        drop(region);
        // Its guard entry is free again.
        let mut again = Region::create(&path, g, ident(), Access::Owner).unwrap();
        assert!(again.guard());
        assert!(!again.truncated());
    }

    #[test]
    fn a_dead_pid_is_gone_and_a_live_one_is_not() {
        assert!(!process_gone(std::process::id() as i32));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        child.wait().unwrap();
        assert!(process_gone(pid));
    }
}
