//! The agent's local socket, bound and accepted on plain threads: each
//! shard's Unix stream socket (`<heartbeat_path>.sock.<i>`,
//! [`lbagent_host::local::socket_path`]) is bound at start, before any
//! executor runs, and one acceptor thread takes every connection, asks the
//! kernel who made it (`SO_PEERCRED`: uid, gid and pid, the pid as the
//! agent's pid namespace sees it, whatever namespace the client runs in)
//! and hands it to its shard with the verdict of [`Trust`]. The identity
//! is checked once per connection, never per request; the shard serves the
//! connection ([`super::local_rt`]).
//!
//! A client may open its connection with [`ID_MAGIC`] carrying its UDP
//! socket for the shard (`SCM_RIGHTS`): holding the socket proves the
//! client owns its source address, so the agent trusts that UDP source as
//! it trusts the connection, and gives back the units the source holds
//! when the connection closes. The client library then keeps sending its
//! requests over UDP (the shard's batched path, its own shedding and
//! receive timestamps) and uses the connection itself only when UDP cannot
//! reach the agent (another network namespace). The acceptor waits
//! [`ID_WAIT`] at most for that first message; the socket it received is
//! closed at once (only its address is kept).
//!
//! A client may instead open a connection with
//! [`lbagent_shm::lease::LEASE_MAGIC`] carrying the shard's shared-memory
//! region file, open read-write: holding it proves the client may use the
//! region (it passed the region's own permission checks), and the shard
//! then leases it a slot held as long as the connection
//! ([`lbagent_shm::lease`]: slot liveness that needs no pid, for clients
//! in their own pid namespace). A file that is not the shard's region, or
//! not open read-write, leases nothing.
//!
//! Why a stream and not datagrams: a datagram socket answers a client at
//! the address it bound, and an unbound client's autobound address lives
//! in its network namespace, which the agent in another namespace cannot
//! reach; a connection made through the path (the agent's directory
//! mounted into a container) answers over itself. Its end is also the
//! client's end: units it held go back when it closes.
//!
//! Binding never follows or replaces what another user planted: the
//! directory and the path are judged by [`lbagent_host::owned`] as every
//! file of the agent's directory is (a directory others can write is
//! refused), and a path that exists is replaced only when it is a socket
//! owned by the agent's user that nobody serves (a stale one from a
//! crash); anything else (a symlink, another kind of file, another owner,
//! a live agent) refuses the start with a message naming it, its owner
//! and mode, and the fix.

use std::collections::VecDeque;
use std::net::UdpSocket;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::Context;
use lbagent_config::AgentConfig;
use lbagent_service::doorbell::Doorbell;
use lbagent_service::wakefd::WakeFd;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{
    accept4, getsockopt, sockopt, ControlMessageOwned, MsgFlags, SockFlag, SockaddrIn,
};

use super::bell::ShardBell;
use super::shard::callers::LocalCaller;

/// Connections accepted and not yet taken by their shard, per shard; past
/// it a connection is closed at once (counted). The same bound holds the
/// connections whose first message the acceptor awaits.
pub const MAX_PENDING: usize = 1024;

/// The first 4 bytes a client may send, with its UDP socket attached.
pub const ID_MAGIC: &[u8; 4] = b"LBID";

/// The first 4 bytes a client without a UDP socket for the shard sends
/// (it cannot reach the shard's port): nothing to wait for.
pub const NO_ID_MAGIC: &[u8; 4] = b"LBNO";

/// How long the acceptor waits for a connection's first message.
pub const ID_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Who the agent trusts with requests that act beyond the caller, over
/// the local socket: root, the agent's own user, and the configured uids
/// and (primary) gids. Pure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trust {
    own_uid: u32,
    uids: Vec<u32>,
    gids: Vec<u32>,
}

impl Trust {
    /// The trust of an agent running as `own_uid` with `config`.
    pub fn new(own_uid: u32, config: &AgentConfig) -> Trust {
        Trust {
            own_uid,
            uids: config.trusted_uids.clone(),
            gids: config.trusted_gids.clone(),
        }
    }

    /// Whether a process of `uid` and `gid` is trusted.
    pub fn trusts(&self, uid: u32, gid: u32) -> bool {
        uid == 0 || uid == self.own_uid || self.uids.contains(&uid) || self.gids.contains(&gid)
    }
}

/// Binds shard sockets at `path` safely (see the module header), mode
/// 0666: any local process may connect (what it may do is decided by who
/// it is).
///
/// # Errors
/// The path is taken by something the agent must not replace, or the
/// bind fails; the message names the path and what to do.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    // The directory and what is at the path, judged as every file of the
    // agent's directory is (lbagent_host::owned: same refusals, same
    // messages).
    if lbagent_host::owned::check_socket_path(path)? {
        remove_stale(path)?;
    }
    let listener = UnixListener::bind(path).with_context(|| {
        format!(
            "cannot bind the local socket {} (beside agent.heartbeat_path; set agent.local_socket = false to go without it)",
            path.display()
        )
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).with_context(|| {
        format!(
            "cannot open the local socket {} to local users",
            path.display()
        )
    })?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// A socket of the agent's own user where a shard's socket goes: removed
/// when nobody serves it (stale, from a crash), refused otherwise.
fn remove_stale(path: &Path) -> anyhow::Result<()> {
    let shown = path.display();
    if UnixStream::connect(path).is_ok() {
        anyhow::bail!(
            "the local socket {shown} is served by another agent (same agent.heartbeat_path?): stop it first"
        );
    }
    std::fs::remove_file(path)
        .with_context(|| format!("cannot remove the stale local socket {shown}"))
}

/// A connection the acceptor identified, for its shard.
#[derive(Debug)]
pub struct Accepted {
    /// The connection.
    pub fd: OwnedFd,
    /// Who made it.
    pub caller: LocalCaller,
    /// It asks for a shared-memory slot, and proved it may use the
    /// shard's region.
    pub lease: bool,
}

/// Connections for one shard, from the acceptor thread.
#[derive(Debug, Default)]
pub struct Inbox {
    queue: Mutex<VecDeque<Accepted>>,
    /// Rung when the queue grew.
    pub bell: Doorbell,
    /// Connections closed at once (the queue was full, or the kernel gave
    /// no credentials), not yet counted by the shard.
    refused: AtomicU64,
    /// The shard's UDP doorbell and a socket to ring it from
    /// ([`super::bell`]): a shard that waits on its UDP socket alone takes
    /// the connection at once, not when the wait ends.
    udp_bell: OnceLock<(ShardBell, Arc<UdpSocket>)>,
}

impl Inbox {
    /// Takes every queued connection.
    pub fn take(&self) -> Vec<Accepted> {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.drain(..).collect()
    }

    /// Takes the count of connections refused since the last call.
    pub fn take_refused(&self) -> u64 {
        self.refused.swap(0, Ordering::Relaxed)
    }

    /// From now on a queued connection also rings the shard's UDP doorbell
    /// (`bell`) from `socket` (one the acceptor's rings to every shard
    /// share, [`ShardBell::socket`]). Without it, connections reach a
    /// shard waiting on its UDP socket when the wait ends
    /// (`park::POLL_PARK`). Set once; later calls are ignored.
    pub fn ring_over_udp(&self, bell: ShardBell, socket: Arc<UdpSocket>) {
        let _ = self.udp_bell.set((bell, socket));
    }

    fn push(&self, fd: OwnedFd, caller: LocalCaller, lease: bool) {
        {
            let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            if q.len() >= MAX_PENDING {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return;
            }
            q.push_back(Accepted { fd, caller, lease });
        }
        self.bell.ring();
        if let Some((bell, socket)) = self.udp_bell.get() {
            bell.ring(socket);
        }
    }
}

/// The shards' bound sockets, their inboxes and the acceptor thread.
pub struct Acceptor {
    paths: Vec<PathBuf>,
    stop: Arc<WakeFd>,
    thread: Option<JoinHandle<()>>,
}

impl Acceptor {
    /// Binds every shard's socket beside `heartbeat` and starts the
    /// acceptor thread; returns it and each shard's inbox. `regions`
    /// names each shard's shared-memory region file (device, inode), if
    /// it has one: a connection that passes it open read-write is leased
    /// a slot.
    ///
    /// # Errors
    /// A socket cannot be bound (see [`bind`]), or the thread or its stop
    /// descriptor cannot be made.
    pub fn start(
        heartbeat: &Path,
        shards: u32,
        trust: Trust,
        regions: Vec<Option<(u64, u64)>>,
    ) -> anyhow::Result<(Acceptor, Vec<Arc<Inbox>>)> {
        let paths: Vec<PathBuf> = (0..shards)
            .map(|i| lbagent_host::local::socket_path(heartbeat, i))
            .collect();
        let mut listeners = Vec::new();
        for p in &paths {
            match bind(p) {
                Ok(l) => listeners.push(l),
                Err(e) => {
                    remove_paths(&paths[..listeners.len()]);
                    return Err(e);
                }
            }
        }
        let inboxes: Vec<Arc<Inbox>> = (0..shards).map(|_| Arc::new(Inbox::default())).collect();
        let stop =
            Arc::new(WakeFd::new().context("cannot make the local acceptor's stop descriptor")?);
        let thread = {
            let (stop, inboxes) = (stop.clone(), inboxes.clone());
            std::thread::Builder::new()
                .name("lbagent-local".into())
                .spawn(move || accept_loop(&listeners, &inboxes, &stop, &trust, &regions))
                .context("cannot start the local socket's acceptor thread")?
        };
        let acceptor = Acceptor {
            paths,
            stop,
            thread: Some(thread),
        };
        Ok((acceptor, inboxes))
    }

    /// Stops the acceptor and removes the sockets (clients go by UDP).
    pub fn stop(&mut self) {
        self.stop.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        remove_paths(&self.paths);
        self.paths.clear();
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop();
    }
}

fn remove_paths(paths: &[PathBuf]) {
    for p in paths {
        let _ = std::fs::remove_file(p);
    }
}

/// A connection accepted whose first message has not come yet.
struct Waiting {
    fd: OwnedFd,
    caller: LocalCaller,
    shard: usize,
    until: Instant,
}

/// What a connection's first message said.
#[derive(Debug, Default, PartialEq, Eq)]
struct Id {
    /// The UDP source of the socket it passed.
    udp: Option<std::net::SocketAddr>,
    /// It asked for a slot and passed the shard's region file.
    lease: bool,
}

/// Waits for connections on every listener (and the stop), accepts each,
/// identifies it, reads its identification message if any (waiting
/// [`ID_WAIT`] at most) and queues it for its shard.
fn accept_loop(
    listeners: &[UnixListener],
    inboxes: &[Arc<Inbox>],
    stop: &WakeFd,
    trust: &Trust,
    regions: &[Option<(u64, u64)>],
) {
    let mut waiting: Vec<Waiting> = Vec::new();
    loop {
        let now = Instant::now();
        // Past their wait: handed over as they are.
        let mut k = 0;
        while k < waiting.len() {
            if waiting[k].until <= now {
                let w = waiting.swap_remove(k);
                inboxes[w.shard].push(w.fd, w.caller, false);
            } else {
                k += 1;
            }
        }
        let mut fds: Vec<PollFd> = listeners
            .iter()
            .map(|l| PollFd::new(l.as_fd(), PollFlags::POLLIN))
            .collect();
        fds.push(PollFd::new(stop.as_fd(), PollFlags::POLLIN));
        fds.extend(
            waiting
                .iter()
                .map(|w| PollFd::new(w.fd.as_fd(), PollFlags::POLLIN)),
        );
        let timeout = waiting
            .iter()
            .map(|w| w.until.saturating_duration_since(now))
            .min()
            .map_or(PollTimeout::NONE, |d| {
                PollTimeout::from(d.as_millis().clamp(1, 1000) as u16)
            });
        if poll(&mut fds, timeout).is_err() {
            continue;
        }
        let ready: Vec<bool> = fds
            .iter()
            .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        drop(fds);
        if ready[listeners.len()] {
            return;
        }
        // Identification messages first (their indices move when the
        // listeners add to the list).
        for k in (0..waiting.len()).rev() {
            if ready[listeners.len() + 1 + k] {
                let mut w = waiting.swap_remove(k);
                let region = regions.get(w.shard).copied().flatten();
                let id = read_id(&w.fd, region);
                w.caller.udp = id.udp;
                inboxes[w.shard].push(w.fd, w.caller, id.lease);
            }
        }
        for (i, l) in listeners.iter().enumerate() {
            if ready[i] {
                accept_all(l, i, &inboxes[i], trust, &mut waiting);
            }
        }
    }
}

/// Reads a connection's identification message, if that is what its
/// first bytes are: the UDP source address of the socket it carries, or
/// whether the region file it carries (a lease's) is `region`, open
/// read-write. What it passed is closed at once. Anything else is left
/// unread.
fn read_id(fd: &OwnedFd, region: Option<(u64, u64)>) -> Id {
    let raw = fd.as_raw_fd();
    let mut magic = [0u8; 4];
    let Ok(peeked) =
        nix::sys::socket::recv(raw, &mut magic, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT)
    else {
        return Id::default();
    };
    let lease = &magic == lbagent_shm::lease::LEASE_MAGIC;
    if peeked < 4 || (&magic != ID_MAGIC && &magic != NO_ID_MAGIC && !lease) {
        return Id::default();
    }
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let mut iov = [std::io::IoSliceMut::new(&mut magic)];
    let Ok(msg) = nix::sys::socket::recvmsg::<()>(
        raw,
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC,
    ) else {
        return Id::default();
    };
    let mut id = Id::default();
    let Ok(cmsgs) = msg.cmsgs() else {
        return id;
    };
    for c in cmsgs {
        if let ControlMessageOwned::ScmRights(fds) = c {
            for (i, f) in fds.into_iter().enumerate() {
                // SAFETY: the kernel installed this descriptor for us with
                // the message; nothing else owns it.
                let passed = unsafe { OwnedFd::from_raw_fd(f) };
                if i > 0 {
                    continue;
                }
                if lease {
                    id.lease =
                        region.is_some_and(|r| lbagent_shm::region::is_open_rw(passed.as_fd(), r));
                } else {
                    id.udp = udp_source(&passed);
                }
            }
        }
    }
    id
}

/// The local address of a UDP socket (an IPv4 one: the shards bind IPv4).
fn udp_source(fd: &OwnedFd) -> Option<std::net::SocketAddr> {
    let ty = getsockopt(fd, sockopt::SockType).ok()?;
    if ty != nix::sys::socket::SockType::Datagram {
        return None;
    }
    let a: SockaddrIn = nix::sys::socket::getsockname(fd.as_raw_fd()).ok()?;
    (a.port() != 0).then(|| std::net::SocketAddr::from((a.ip(), a.port())))
}

/// Accepts every pending connection of `l` (shard `shard`'s).
fn accept_all(
    l: &UnixListener,
    shard: usize,
    inbox: &Inbox,
    trust: &Trust,
    waiting: &mut Vec<Waiting>,
) {
    loop {
        let fd: OwnedFd = match accept4(l.as_fd(), SockFlag::SOCK_CLOEXEC) {
            Ok(fd) => fd,
            // EAGAIN: none left; anything else (a connection reset before
            // it was taken, EMFILE) ends this round too.
            Err(_) => return,
        };
        match getsockopt(&fd, sockopt::PeerCredentials) {
            Ok(c) => {
                let (uid, gid) = (c.uid(), c.gid());
                let caller = LocalCaller {
                    uid,
                    gid,
                    pid: c.pid(),
                    trusted: trust.trusts(uid, gid),
                    udp: None,
                };
                if waiting.len() >= MAX_PENDING {
                    inbox.push(fd, caller, false);
                } else {
                    waiting.push(Waiting {
                        fd,
                        caller,
                        shard,
                        until: Instant::now() + ID_WAIT,
                    });
                }
            }
            Err(_) => {
                inbox.refused.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(uids: &[u32], gids: &[u32]) -> AgentConfig {
        AgentConfig {
            trusted_uids: uids.to_vec(),
            trusted_gids: gids.to_vec(),
            ..AgentConfig::default()
        }
    }

    #[test]
    fn root_the_agents_user_and_the_configured_ids_are_trusted() {
        let t = Trust::new(999, &config(&[1001], &[2002]));
        assert!(t.trusts(0, 0));
        assert!(t.trusts(999, 5));
        assert!(t.trusts(1001, 5));
        assert!(t.trusts(5, 2002));
        assert!(!t.trusts(65534, 65534));
        assert!(!t.trusts(1002, 2003));
    }

    #[test]
    fn a_stale_socket_of_the_agent_is_replaced_and_anything_else_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb.sock.0");
        // A stale socket (bound, then its listener gone) is replaced.
        drop(UnixListener::bind(&path).unwrap());
        let live = bind(&path).unwrap();
        // A live one is refused, naming it.
        let e = bind(&path).unwrap_err().to_string();
        assert!(e.contains("served by another agent"), "{e}");
        drop(live);
        std::fs::remove_file(&path).unwrap();
        // A regular file and a symbolic link are refused, never followed.
        std::fs::write(&path, b"x").unwrap();
        let e = bind(&path).unwrap_err().to_string();
        assert!(e.contains("not a socket"), "{e}");
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &path).unwrap();
        let e = bind(&path).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        assert!(
            e.starts_with(&format!("refusing {}", path.display())),
            "{e}"
        );
        assert!(!dir.path().join("elsewhere").exists());
    }

    #[test]
    fn a_socket_in_a_directory_others_can_write_is_never_bound() {
        let dir = tempfile::tempdir().unwrap();
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let path = open.join("hb.sock.0");
        let e = bind(&path).unwrap_err().to_string();
        assert!(
            e.contains(&format!("refusing {}", open.display()))
                && e.contains("other users can write it"),
            "{e}"
        );
        assert!(!path.exists());
    }

    #[test]
    fn the_acceptor_identifies_each_connection_for_its_shard() {
        let dir = tempfile::tempdir().unwrap();
        let hb = dir.path().join("hb");
        let (mut acc, inboxes) = Acceptor::start(
            &hb,
            2,
            Trust::new(12345, &config(&[], &[])),
            vec![None, None],
        )
        .unwrap();
        let _c = UnixStream::connect(lbagent_host::local::socket_path(&hb, 1)).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let got = loop {
            let got = inboxes[1].take();
            if !got.is_empty() || std::time::Instant::now() > deadline {
                break got;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        assert_eq!(got.len(), 1);
        let me = nix::unistd::geteuid().as_raw();
        assert_eq!(got[0].caller.uid, me);
        assert_eq!(got[0].caller.pid, std::process::id() as i32);
        assert_eq!(got[0].caller.trusted, me == 0 || me == 12345);
        assert!(inboxes[0].take().is_empty());
        assert_eq!(got[0].caller.udp, None, "it sent no identification");
        // A client that passes its UDP socket is known by its source.
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let c = UnixStream::connect(lbagent_host::local::socket_path(&hb, 0)).unwrap();
        let fds = [udp.as_raw_fd()];
        nix::sys::socket::sendmsg::<()>(
            c.as_raw_fd(),
            &[std::io::IoSlice::new(ID_MAGIC)],
            &[nix::sys::socket::ControlMessage::ScmRights(&fds)],
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .unwrap();
        let got = loop {
            let got = inboxes[0].take();
            if !got.is_empty() || std::time::Instant::now() > deadline {
                break got;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        assert_eq!(got[0].caller.udp, Some(udp.local_addr().unwrap()));
        // The message was taken: the stream starts after it.
        let mut first = [0u8; 1];
        let n = nix::sys::socket::recv(got[0].fd.as_raw_fd(), &mut first, MsgFlags::MSG_DONTWAIT);
        assert!(n.is_err(), "nothing left to read: {n:?}");
        acc.stop();
        assert!(!lbagent_host::local::socket_path(&hb, 0).exists());
    }

    #[test]
    fn a_lease_is_asked_only_with_the_shards_region_open_read_write() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let hb = dir.path().join("hb");
        let region = dir.path().join("region");
        let other = dir.path().join("other");
        std::fs::write(&region, b"r").unwrap();
        std::fs::write(&other, b"o").unwrap();
        let meta = std::fs::metadata(&region).unwrap();
        let (mut acc, inboxes) = Acceptor::start(
            &hb,
            1,
            Trust::new(12345, &config(&[], &[])),
            vec![Some((meta.dev(), meta.ino()))],
        )
        .unwrap();
        let rw = |p: &Path| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(p)
                .unwrap()
        };
        let tries = [
            (rw(&region), true),
            (std::fs::File::open(&region).unwrap(), false),
            (rw(&other), false),
        ];
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        for (file, lease) in tries {
            let c = UnixStream::connect(lbagent_host::local::socket_path(&hb, 0)).unwrap();
            let fds = [file.as_raw_fd()];
            nix::sys::socket::sendmsg::<()>(
                c.as_raw_fd(),
                &[std::io::IoSlice::new(lbagent_shm::lease::LEASE_MAGIC)],
                &[nix::sys::socket::ControlMessage::ScmRights(&fds)],
                MsgFlags::MSG_NOSIGNAL,
                None,
            )
            .unwrap();
            let got = loop {
                let got = inboxes[0].take();
                if !got.is_empty() || std::time::Instant::now() > deadline {
                    break got;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            };
            assert_eq!(got.len(), 1);
            assert_eq!((got[0].lease, got[0].caller.udp), (lease, None));
        }
        acc.stop();
    }
}
