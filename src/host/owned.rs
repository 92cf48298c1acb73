//! Files only the agent's user can plant: the one place that decides
//! whether a directory or a file on the host belongs to the agent, for
//! the agent (which makes and adopts them) and for its clients (which read
//! them). The heartbeat, the shared-memory regions and the static route
//! file all go through it; so does any later file of the agent's
//! directory (a Unix socket).
//!
//! # The rules
//!
//! - **The agent directory** (the heartbeat's, the regions', the static
//!   route file's parent) is a real directory (not a symbolic link),
//!   writable by its owner only (no group or world write bit), and owned
//!   by root or the agent's user. Every directory above it is owned by
//!   root, the reader or the agent directory's owner, and writable by
//!   others only with the sticky bit (`/tmp`); right below such a
//!   directory, anyone could have made the next one, so that one must be
//!   owned by root or the reader. The agent makes a missing agent
//!   directory (mode 0755) and then checks it like any other.
//! - **The agent user**, as a client sees it, is the agent directory's
//!   owner: the directory passed the rules above, so only root or that
//!   user could have made it. A client trusts files owned by root, by
//!   itself, or by that user.
//! - **The agent creates** each file with `O_CREAT | O_EXCL | O_NOFOLLOW`
//!   ([`create_exclusive`]), or under a temporary name made so and renamed.
//!   It **adopts** an existing file ([`open_or_create`]) only when it is a
//!   regular file, reached without a symbolic link, owned by the agent's
//!   own user and writable by nobody else.
//! - **The agent binds** a Unix socket ([`check_socket_path`]) only in
//!   its checked directory, where nothing is at the path or only a socket
//!   of its own user (a stale one it replaces); a symbolic link, another
//!   kind of file or another user's socket is refused, named, as a file
//!   it would adopt is.
//! - **A client opens** a file ([`open_trusted`]) without following a
//!   symbolic link and without blocking, and judges what it opened
//!   (`fstat`): a regular file, owned by a trusted user, not writable by
//!   others (a region may be group-writable: its group is `shm.group`).
//!   In a shared sticky directory (`/dev/shm`, where older agents wrote
//!   the heartbeat) there is no agent user: only root's or the client's
//!   own files are trusted.
//!
//! Every refusal names the file, its owner and mode, and the fix. The
//! checks cost a few `stat` calls when a file is opened, never per request.
//! The judgements themselves ([`judge_dir`], [`judge_file`]) are pure.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The facts about a file or directory the rules look at (from `stat`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Facts {
    /// The owner's uid.
    pub uid: u32,
    /// `st_mode`: type and permission bits.
    pub mode: u32,
}

impl Facts {
    /// The facts of `meta`.
    pub fn of(meta: &std::fs::Metadata) -> Facts {
        Facts {
            uid: meta.uid(),
            mode: meta.mode(),
        }
    }

    fn kind(&self) -> u32 {
        self.mode & libc::S_IFMT
    }

    fn perm(&self) -> u32 {
        self.mode & 0o7777
    }

    fn others_write(&self) -> bool {
        self.mode & 0o022 != 0
    }

    fn sticky(&self) -> bool {
        self.mode & libc::S_ISVTX != 0
    }
}

/// The users whose files a process trusts: root, itself, and the agent
/// directory's owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trusted {
    /// The process's effective uid.
    pub me: u32,
    /// The agent directory's owner, once known.
    pub agent: Option<u32>,
}

impl Trusted {
    /// Root and this process's effective uid.
    pub fn me() -> Trusted {
        Trusted {
            me: nix::unistd::geteuid().as_raw(),
            agent: None,
        }
    }

    /// True when `uid` is root, the process itself or the agent.
    pub fn allows(&self, uid: u32) -> bool {
        uid == 0 || uid == self.me || Some(uid) == self.agent
    }

    fn me_or_root(&self, uid: u32) -> bool {
        uid == 0 || uid == self.me
    }
}

/// Why a file or directory of the agent is not used.
#[derive(Debug, thiserror::Error)]
pub enum OwnedError {
    /// It breaks a rule: another owner, writable by others, a symbolic
    /// link, not a directory.
    #[error("refusing {path}: {problem}; {fix}")]
    Refused {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong, with its owner and mode.
        problem: String,
        /// What to do.
        fix: String,
    },
    /// The path names something other than a regular file (a FIFO, a
    /// device, a directory, a socket); nothing was read from it.
    #[error("{path} is a {kind}, not a regular file")]
    NotAFile {
        /// The path.
        path: PathBuf,
        /// What it is.
        kind: &'static str,
    },
    /// A system call failed.
    #[error("cannot {op} {path}: {error}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The system's error.
        error: io::Error,
    },
}

impl OwnedError {
    /// True when the file (or a directory above it) does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, OwnedError::Io { error, .. } if error.kind() == io::ErrorKind::NotFound)
    }
}

/// `uid N (name), mode 0NNN` for a message.
pub fn describe(f: &Facts) -> String {
    let name = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(f.uid))
        .ok()
        .flatten()
        .map_or_else(|| "no such user".to_string(), |u| u.name);
    format!("owned by uid {} ({name}), mode {:04o}", f.uid, f.perm())
}

const DIR_FIX: &str = "the agent's files need a directory only the agent's user can write, \
     under directories only root can change (the packaged unit's /run/lbagent and \
     /var/lib/lbagent): fix its owner and mode (chown AGENT_USER DIR; chmod 0755 DIR), \
     or point agent.heartbeat_path, agent.snapshot_path and shm.dir there";

// === the pure judgements ===

/// Where a directory stands on the path to the agent's files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirRole {
    /// A directory above the agent directory; `below_open` when the one
    /// above it is writable by others (sticky).
    Above {
        /// The directory above this one is writable by others.
        below_open: bool,
    },
    /// The agent directory itself.
    Agent {
        /// The directory above it is writable by others (sticky).
        below_open: bool,
    },
}

/// Judges one directory on the way to the agent's files (see the module
/// header): `None` when it passes, else what is wrong.
pub fn judge_dir(f: &Facts, role: DirRole, trusted: &Trusted) -> Option<String> {
    if f.kind() == libc::S_IFLNK {
        return Some(format!("it is a symbolic link ({})", describe(f)));
    }
    if f.kind() != libc::S_IFDIR {
        return Some(format!("it is not a directory ({})", describe(f)));
    }
    match role {
        DirRole::Above { below_open } => {
            if below_open && !trusted.me_or_root(f.uid) {
                return Some(format!(
                    "it is inside a directory anyone can write, and not root's ({})",
                    describe(f)
                ));
            }
            if !trusted.allows(f.uid) {
                return Some(format!(
                    "its owner is not root or the agent's user ({})",
                    describe(f)
                ));
            }
            if f.others_write() && !f.sticky() {
                return Some(format!("other users can write it ({})", describe(f)));
            }
        }
        DirRole::Agent { below_open } => {
            if f.others_write() {
                return Some(format!("other users can write it ({})", describe(f)));
            }
            if below_open && !trusted.me_or_root(f.uid) {
                return Some(format!(
                    "it is inside a directory anyone can write, and not root's or this process's ({})",
                    describe(f)
                ));
            }
        }
    }
    None
}

/// Judges a file a client opened (already `fstat`ed): `None` when it
/// passes. `group_write` allows the group write bit (a shared-memory
/// region's `shm.group`).
pub fn judge_file(f: &Facts, trusted: &Trusted, group_write: bool) -> Option<String> {
    if !trusted.allows(f.uid) {
        return Some(format!(
            "it is not the agent's: {}, and the agent's user is {}",
            describe(f),
            trusted
                .agent
                .map_or_else(|| "root".to_string(), |u| format!("uid {u}"))
        ));
    }
    let forbidden = if group_write { 0o002 } else { 0o022 };
    if f.mode & forbidden != 0 {
        return Some(format!("other users can write it ({})", describe(f)));
    }
    None
}

/// Judges a file the agent is about to adopt (reuse in place): `None`
/// when it is its own (`me`) and only it can write it. `private`: nobody
/// else may even read it (a lock file).
pub fn judge_adopt(f: &Facts, me: u32, private: bool) -> Option<String> {
    if f.uid != me {
        return Some(format!(
            "it was not made by this agent's user (uid {me}): {} (planted, or left by an \
             agent run as that user, by hand say: stop that agent if it still runs)",
            describe(f)
        ));
    }
    let forbidden = if private { 0o077 } else { 0o022 };
    if f.mode & forbidden != 0 {
        return Some(format!(
            "other users can write or read it ({})",
            describe(f)
        ));
    }
    None
}

/// Judges what is at the path where the agent binds a Unix socket (from
/// `lstat`): `None` when it is a socket of the agent's own user `me`
/// (a stale one it may replace), else what is wrong. A socket's write bits
/// are who may connect: not judged.
pub fn judge_socket(f: &Facts, me: u32) -> Option<String> {
    if f.kind() == libc::S_IFLNK {
        return Some(format!("it is a symbolic link ({})", describe(f)));
    }
    if f.kind() != libc::S_IFSOCK {
        return Some(format!("it is not a socket ({})", describe(f)));
    }
    if f.uid != me {
        return Some(format!(
            "it was not made by this agent's user (uid {me}): {}",
            describe(f)
        ));
    }
    None
}

// === the file system ===

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> OwnedError + 'a {
    move |error| OwnedError::Io {
        op,
        path: path.to_path_buf(),
        error,
    }
}

fn lstat(path: &Path) -> Result<Facts, OwnedError> {
    std::fs::symlink_metadata(path)
        .map(|m| Facts::of(&m))
        .map_err(io_err("look at", path))
}

fn refused(path: &Path, problem: String, fix: &str) -> OwnedError {
    OwnedError::Refused {
        path: path.to_path_buf(),
        problem,
        fix: fix.to_string(),
    }
}

/// The parent of `path` (`.` for a bare name).
pub fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Checks the agent directory `dir` and every directory above it for a
/// reader that trusts `trusted` (see the module header), and returns who
/// is trusted for its files: `trusted` with the directory's owner as the
/// agent.
///
/// # Errors
/// [`OwnedError::Refused`] naming the first directory that breaks a
/// rule; [`OwnedError::Io`] when one cannot be looked at (missing).
pub fn check_agent_dir(dir: &Path, trusted: Trusted) -> Result<Trusted, OwnedError> {
    check_dir_chain(dir, trusted, false)
}

/// [`check_agent_dir`], and with `reader_shared` a directory anyone may
/// write with the sticky bit (`/dev/shm`, where agents before issue 27
/// wrote the heartbeat) is accepted too, but then its owner vouches for
/// nobody: only files owned by root or the reader are trusted there.
fn check_dir_chain(
    dir: &Path,
    trusted: Trusted,
    reader_shared: bool,
) -> Result<Trusted, OwnedError> {
    let agent = lstat(dir)?;
    let above = std::fs::canonicalize(parent_of(dir)).map_err(io_err("resolve", parent_of(dir)))?;
    let mut t = trusted;
    // The agent directory's owner may own what is above it too (its home).
    t.agent = Some(agent.uid);
    let mut open = false;
    let mut walked = PathBuf::new();
    for part in above.components() {
        walked.push(part);
        let f = lstat(&walked)?;
        if let Some(problem) = judge_dir(&f, DirRole::Above { below_open: open }, &t) {
            return Err(refused(&walked, problem, DIR_FIX));
        }
        open = f.others_write();
    }
    if reader_shared && agent.kind() == libc::S_IFDIR && agent.sticky() && agent.others_write() {
        // Shared: judged as a directory above, and nobody is the agent.
        if let Some(problem) = judge_dir(&agent, DirRole::Above { below_open: open }, &trusted) {
            return Err(refused(dir, problem, DIR_FIX));
        }
        return Ok(trusted);
    }
    if let Some(problem) = judge_dir(&agent, DirRole::Agent { below_open: open }, &trusted) {
        return Err(refused(dir, problem, DIR_FIX));
    }
    Ok(t)
}

/// The agent's side: makes the agent directory `dir` if it is missing
/// (mode 0755, so that clients can read the files in it) and checks it
/// as [`check_agent_dir`] does, and that this process's user (or root)
/// owns it.
///
/// # Errors
/// [`OwnedError::Refused`] naming the directory, its owner and mode;
/// [`OwnedError::Io`] when it cannot be made (no permission: run the agent
/// as root once, or through its unit, or give it a directory its user owns).
pub fn ensure_agent_dir(dir: &Path) -> Result<(), OwnedError> {
    if std::fs::symlink_metadata(dir).is_err() {
        match std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
        {
            Ok(()) => {
                // The umask may have taken read bits away: clients need them.
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
                    .map_err(io_err("set the mode of", dir))?;
            }
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                return Err(refused(
                    dir,
                    format!("this user (uid {}) cannot create it ({e})", Trusted::me().me),
                    &format!(
                        "make it once as root (install -d -m 0755 -o AGENT_USER {}; the packaged \
                         unit's RuntimeDirectory= does), or run the agent with agent.heartbeat_path, \
                         agent.snapshot_path and shm.dir in a directory this user owns (clients then \
                         need LBAGENT_HEARTBEAT)",
                        dir.display()
                    ),
                ))
            }
            Err(e) => return Err(io_err("create the agent directory", dir)(e)),
        }
    }
    let me = Trusted::me();
    check_agent_dir(dir, me)?;
    let f = lstat(dir)?;
    if !me.me_or_root(f.uid) {
        return Err(refused(
            dir,
            format!(
                "this agent's user (uid {}) does not own it ({})",
                me.me,
                describe(&f)
            ),
            DIR_FIX,
        ));
    }
    Ok(())
}

fn open_flags(opts: &mut OpenOptions) -> &mut OpenOptions {
    opts.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
}

/// Creates `path` with `O_CREAT | O_EXCL | O_NOFOLLOW`, read-write, mode
/// `mode` exactly (whatever the umask). Fails if anything is there,
/// a symbolic link included.
///
/// # Errors
/// [`OwnedError::Io`] (`AlreadyExists` when something is at the path).
pub fn create_exclusive(path: &Path, mode: u32) -> Result<File, OwnedError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(io_err("create", path))?;
    file.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(io_err("set the mode of", path))?;
    Ok(file)
}

/// The agent's side: opens `path` read-write, creating it exclusively
/// (mode `mode`) when missing, or adopting the file there only when it is
/// the agent's own (regular, no symbolic link, owned by this process's
/// user, writable by nobody else; with `private`, `mode` 0600 files:
/// readable by nobody else either). The directory must already have
/// passed [`ensure_agent_dir`].
///
/// # Errors
/// [`OwnedError::Refused`] naming the file, its owner and mode, and the
/// fix; [`OwnedError::NotAFile`]; [`OwnedError::Io`].
pub fn open_or_create(path: &Path, mode: u32, private: bool) -> Result<File, OwnedError> {
    match create_exclusive(path, mode) {
        Ok(f) => return Ok(f),
        Err(OwnedError::Io { error, .. }) if error.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let fix = format!(
        "remove it (rm {}) and start the agent again: it makes its own",
        path.display()
    );
    let me = Trusted::me().me;
    let file = match open_flags(OpenOptions::new().read(true).write(true)).open(path) {
        Ok(f) => f,
        // Another user's file, which this user may not open (an agent run
        // as root leaves a 0600 lock): judged by what is there, as one it
        // could open would be, so that the error says whose it is and what
        // to do instead of a bare "Permission denied".
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            let problem = lstat(path).ok().and_then(|f| judge_adopt(&f, me, private));
            return Err(match problem {
                Some(problem) => refused(path, problem, &fix),
                None => io_err("open", path)(e),
            });
        }
        Err(e) => return Err(symlink_or(path, e, &fix)),
    };
    let meta = file.metadata().map_err(io_err("stat", path))?;
    if !meta.is_file() {
        return Err(OwnedError::NotAFile {
            path: path.to_path_buf(),
            kind: crate::heartbeat::file_kind(&meta.file_type()),
        });
    }
    if let Some(problem) = judge_adopt(&Facts::of(&meta), me, private) {
        return Err(refused(path, problem, &fix));
    }
    Ok(file)
}

/// The agent's side, before it binds a Unix socket at `path`: makes and
/// checks the directory as [`ensure_agent_dir`] does, then judges what is
/// at the path ([`judge_socket`]). Returns whether a socket of the
/// agent's own user is there (stale or live: the caller finds out, and
/// removes a stale one); nothing there is `false`.
///
/// # Errors
/// [`OwnedError::Refused`] naming the directory or the path, its owner
/// and mode, and the fix; [`OwnedError::Io`].
pub fn check_socket_path(path: &Path) -> Result<bool, OwnedError> {
    ensure_agent_dir(parent_of(path))?;
    let f = match lstat(path) {
        Err(e) if e.is_not_found() => return Ok(false),
        r => r?,
    };
    if let Some(problem) = judge_socket(&f, Trusted::me().me) {
        let fix = format!(
            "remove it (rm {}) and start the agent again: it makes its own",
            path.display()
        );
        return Err(refused(path, problem, &fix));
    }
    Ok(true)
}

/// `ELOOP` from `O_NOFOLLOW` is a symbolic link at the path: refused.
fn symlink_or(path: &Path, e: io::Error, fix: &str) -> OwnedError {
    if e.raw_os_error() == Some(libc::ELOOP) {
        let what = std::fs::symlink_metadata(path)
            .map(|m| describe(&Facts::of(&m)))
            .unwrap_or_default();
        return refused(path, format!("it is a symbolic link ({what})"), fix);
    }
    io_err("open", path)(e)
}

/// The client's side: opens `path` (read-only, or read-write with
/// `write`) without following a symbolic link and without blocking,
/// checks its directory ([`check_agent_dir`]; a shared sticky directory
/// such as `/dev/shm` is accepted, but there only root's or this
/// process's own files are trusted) and judges what was opened
/// ([`judge_file`]; `group_write` allows the group write bit).
///
/// # Errors
/// [`OwnedError::Refused`] naming the file or directory, its owner and
/// mode; [`OwnedError::NotAFile`]; [`OwnedError::Io`]
/// ([`OwnedError::is_not_found`] when there is no file).
pub fn open_trusted(path: &Path, write: bool, group_write: bool) -> Result<File, OwnedError> {
    let fix = "it may have been planted by another user: the agent is treated as down; \
               remove it and let the agent make its own";
    let file = open_flags(OpenOptions::new().read(true).write(write))
        .open(path)
        .map_err(|e| symlink_or(path, e, fix))?;
    let meta = file.metadata().map_err(io_err("stat", path))?;
    if !meta.is_file() {
        return Err(OwnedError::NotAFile {
            path: path.to_path_buf(),
            kind: crate::heartbeat::file_kind(&meta.file_type()),
        });
    }
    // Nothing has been read from it yet: its directory decides whom to
    // trust (in a shared sticky directory: root and this process only).
    let trusted = check_dir_chain(parent_of(path), Trusted::me(), true)?;
    if let Some(problem) = judge_file(&Facts::of(&meta), &trusted, group_write) {
        return Err(refused(path, problem, fix));
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIR: u32 = libc::S_IFDIR;
    const REG: u32 = libc::S_IFREG;
    const LNK: u32 = libc::S_IFLNK;

    fn t(me: u32, agent: Option<u32>) -> Trusted {
        Trusted { me, agent }
    }

    fn f(uid: u32, mode: u32) -> Facts {
        Facts { uid, mode }
    }

    #[test]
    fn only_the_agents_own_socket_may_be_replaced() {
        let sock = libc::S_IFSOCK;
        assert_eq!(judge_socket(&f(7, sock | 0o666), 7), None);
        let other = judge_socket(&f(65534, sock | 0o755), 7).unwrap();
        assert!(
            other.contains("not made by this agent's user (uid 7)"),
            "{other}"
        );
        let link = judge_socket(&f(7, libc::S_IFLNK | 0o777), 7).unwrap();
        assert!(link.contains("symbolic link"), "{link}");
        let file = judge_socket(&f(7, libc::S_IFREG | 0o644), 7).unwrap();
        assert!(file.contains("not a socket"), "{file}");
    }

    #[test]
    fn an_agent_directory_writable_by_others_or_a_link_is_refused() {
        let me = t(1000, None);
        let agent = DirRole::Agent { below_open: false };
        assert_eq!(judge_dir(&f(999, DIR | 0o755), agent, &me), None);
        assert!(judge_dir(&f(999, DIR | 0o775), agent, &me)
            .unwrap()
            .contains("write"));
        assert!(judge_dir(&f(0, DIR | 0o1777), agent, &me)
            .unwrap()
            .contains("write"));
        assert!(judge_dir(&f(0, LNK | 0o777), agent, &me)
            .unwrap()
            .contains("symbolic link"));
        assert!(judge_dir(&f(0, REG | 0o755), agent, &me)
            .unwrap()
            .contains("not a directory"));
    }

    #[test]
    fn below_a_sticky_directory_only_root_or_the_reader_may_own_the_next() {
        let me = t(1000, Some(999));
        let open = DirRole::Agent { below_open: true };
        assert_eq!(judge_dir(&f(0, DIR | 0o755), open, &me), None);
        assert_eq!(judge_dir(&f(1000, DIR | 0o700), open, &me), None);
        assert!(judge_dir(&f(65534, DIR | 0o755), open, &me).is_some());
        let above = DirRole::Above { below_open: true };
        assert!(judge_dir(&f(999, DIR | 0o755), above, &me).is_some());
        // /tmp itself: root's, sticky.
        let top = DirRole::Above { below_open: false };
        assert_eq!(judge_dir(&f(0, DIR | 0o1777), top, &me), None);
        assert!(judge_dir(&f(0, DIR | 0o777), top, &me)
            .unwrap()
            .contains("write"));
        assert!(judge_dir(&f(65534, DIR | 0o755), top, &me)
            .unwrap()
            .contains("owner"));
    }

    #[test]
    fn a_client_trusts_root_itself_and_the_agent_and_nobody_writable_by_others() {
        let me = t(1000, Some(999));
        for uid in [0, 1000, 999] {
            assert_eq!(judge_file(&f(uid, REG | 0o644), &me, false), None);
        }
        let e = judge_file(&f(65534, REG | 0o644), &me, false).unwrap();
        assert!(
            e.contains("uid 65534") && e.contains("0644") && e.contains("uid 999"),
            "{e}"
        );
        assert!(judge_file(&f(999, REG | 0o666), &me, false).is_some());
        assert!(judge_file(&f(999, REG | 0o664), &me, false).is_some());
        assert_eq!(judge_file(&f(999, REG | 0o660), &me, true), None);
        assert!(judge_file(&f(999, REG | 0o662), &me, true).is_some());
    }

    #[test]
    fn the_agent_adopts_only_its_own_file_writable_by_nobody_else() {
        assert_eq!(judge_adopt(&f(7, REG | 0o644), 7, false), None);
        assert!(judge_adopt(&f(8, REG | 0o644), 7, false).is_some());
        assert!(judge_adopt(&f(7, REG | 0o666), 7, false).is_some());
        assert!(judge_adopt(&f(7, REG | 0o644), 7, true).is_some());
        assert_eq!(judge_adopt(&f(7, REG | 0o600), 7, true), None);
    }

    #[test]
    fn the_agent_makes_its_directory_0755_and_refuses_a_world_writable_one() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b");
        ensure_agent_dir(&dir).unwrap();
        let m = std::fs::metadata(&dir).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o755);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = ensure_agent_dir(&dir).unwrap_err().to_string();
        assert!(
            e.contains(&*dir.to_string_lossy()) && e.contains("0777"),
            "{e}"
        );
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(tmp.path().join("a"), &link).unwrap();
        let e = ensure_agent_dir(&link).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
    }

    #[test]
    fn a_client_reads_in_a_shared_sticky_directory_only_root_or_its_own_files() {
        let tmp = tempfile::tempdir().unwrap();
        let shared = tmp.path().join("shm");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let path = shared.join("hb");
        std::fs::write(&path, b"x").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        open_trusted(&path, false, false).unwrap();
        assert!(ensure_agent_dir(&shared).is_err());
        let me = Trusted::me();
        assert_eq!(check_dir_chain(&shared, me, true).unwrap(), me);
    }

    #[test]
    fn files_are_created_exclusively_and_a_link_is_never_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        create_exclusive(&path, 0o600).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        assert!(create_exclusive(&path, 0o600).is_err());
        open_or_create(&path, 0o600, true).unwrap();
        let target = tmp.path().join("target");
        std::fs::write(&target, b"x").unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = open_or_create(&link, 0o644, false).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        let e = open_trusted(&link, false, false).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = open_or_create(&target, 0o644, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("0666") && e.contains("rm "), "{e}");
        let e = open_trusted(&target, false, false).unwrap_err().to_string();
        assert!(e.contains("0666"), "{e}");
    }
}
