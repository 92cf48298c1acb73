//! The client's side of the agent's local socket
//! ([`lbagent_host::local::socket_path`], beside the heartbeat): one Unix
//! stream connection per shard. The kernel tells the agent who connected
//! (uid, gid, pid). The connection opens with an identification message
//! that carries the client's UDP socket for the shard (`SCM_RIGHTS`): the
//! agent then knows that UDP source is this process's, so requests that
//! act beyond the caller (a report that consumes units, a level every
//! caller of the module shares) are taken from it over UDP when the
//! agent's configuration trusts that user, and the balance units it took
//! go back when the connection closes (the process exited). Requests
//! themselves go over UDP; over the connection (the same FlatBuffers
//! messages, each a frame: u32 little-endian length, then the message)
//! only when UDP cannot reach the agent, as from a container with its own
//! network namespace that mounts the agent's directory.
//!
//! A second kind of connection holds a shared-memory slot
//! ([`LocalConn::lease`], [`lbagent_shm::lease`]): it opens with the
//! region file instead of the UDP socket, the agent answers with the slot
//! it leased, and the slot is this client's as long as the connection is
//! open, in whatever pid namespace the client runs.
//!
//! The socket is used only when it belongs to the heartbeat file's owner
//! (the agent's user) or root: a socket planted by anyone else is not
//! spoken to. Writes never raise SIGPIPE (`MSG_NOSIGNAL`): an agent that
//! went away is an error the link answers by going over UDP.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::socket::{
    connect, send, sendmsg, socket, AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType,
    UnixAddr,
};

/// The identification message's bytes (the agent's `local_socket::ID_MAGIC`).
const ID_MAGIC: &[u8; 4] = b"LBID";

/// The identification message of a client without a UDP socket.
const NO_ID_MAGIC: &[u8; 4] = b"LBNO";

/// How long a new connection waits for the agent's hello (the agent's
/// acceptor waits 1 s at most for the identification message, which comes
/// at once).
const HELLO_WAIT: Duration = Duration::from_secs(2);

use lbagent_wire::Limits;

/// Why a frame did not come.
#[derive(Debug)]
pub(crate) enum RecvError {
    /// The agent closed the connection (it stopped, or refused it).
    Closed,
    /// Nothing within the deadline.
    TimedOut,
    /// The bytes are no frame: the connection is unusable.
    Garbage(String),
    /// A system call failed.
    Io,
}

/// One connection to a shard's local socket.
#[derive(Debug)]
pub(crate) struct LocalConn {
    stream: UnixStream,
    /// Bytes received; frames are taken from `start`.
    rx: Vec<u8>,
    start: usize,
    out: Vec<u8>,
    read_timeout: Option<Duration>,
}

impl LocalConn {
    /// Connects to shard `shard`'s socket beside `heartbeat`, when it is a
    /// socket of the heartbeat's owner or root. Never blocks: a socket
    /// whose backlog is full is an error (the link goes by UDP).
    ///
    /// # Errors
    /// No socket there, another owner's, or the connection is refused.
    pub(crate) fn connect(
        heartbeat: &Path,
        shard: u32,
        udp: Option<std::os::fd::BorrowedFd<'_>>,
        hello_by: Instant,
    ) -> io::Result<LocalConn> {
        let magic = if udp.is_some() { ID_MAGIC } else { NO_ID_MAGIC };
        Self::open(heartbeat, shard, magic, udp, hello_by)
    }

    /// Asks shard `shard`'s socket beside `heartbeat` for a slot of its
    /// shared-memory region, passing `region` (the region's file, open
    /// read-write: the proof that this process may use it); returns the
    /// connection that holds the slot, and the slot (`None`: every slot is
    /// taken). Waits until `by` at most (2 s at most) for the answer.
    ///
    /// # Errors
    /// As [`LocalConn::connect`], or the answer is no lease.
    pub(crate) fn lease(
        heartbeat: &Path,
        shard: u32,
        region: std::os::fd::BorrowedFd<'_>,
        by: Instant,
    ) -> io::Result<(UnixStream, Option<u32>)> {
        use lbagent_shm::lease::{parse_lease_answer, LEASE_MAGIC};
        let mut c = Self::open(heartbeat, shard, LEASE_MAGIC, Some(region), by)?;
        let answer = c
            .recv(by.min(Instant::now() + HELLO_WAIT))
            .map_err(|e| io::Error::other(format!("no lease from the agent: {e:?}")))?;
        let slot = parse_lease_answer(c.frame(answer))
            .ok_or_else(|| io::Error::other("the agent's answer to a lease is no lease"))?;
        Ok((c.stream, slot))
    }

    fn open(
        heartbeat: &Path,
        shard: u32,
        magic: &[u8; 4],
        pass: Option<std::os::fd::BorrowedFd<'_>>,
        hello_by: Instant,
    ) -> io::Result<LocalConn> {
        let path = lbagent_host::local::socket_path(heartbeat, shard);
        let sock = std::fs::symlink_metadata(&path)?;
        let agent = std::fs::metadata(heartbeat)?;
        if !sock.file_type().is_socket() {
            return Err(io::Error::other(format!(
                "{} is not a socket",
                path.display()
            )));
        }
        if sock.uid() != agent.uid() && sock.uid() != 0 {
            return Err(io::Error::other(format!(
                "{} belongs to uid {}, not to the agent's user (uid {}, the heartbeat's owner): not used",
                path.display(),
                sock.uid(),
                agent.uid()
            )));
        }
        let fd = socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )?;
        connect(fd.as_raw_fd(), &UnixAddr::new(&path)?)?;
        let stream = UnixStream::from(fd);
        stream.set_nonblocking(false)?;
        // The identification message, with the UDP socket (or a lease's
        // region file) when there is one (without, the agent need not
        // wait for it).
        let fds = pass.map(|u| [u.as_raw_fd()]);
        let cmsgs: &[ControlMessage] = match &fds {
            Some(f) => &[ControlMessage::ScmRights(f)],
            None => &[],
        };
        sendmsg::<()>(
            stream.as_raw_fd(),
            &[std::io::IoSlice::new(magic)],
            cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        )?;
        let mut c = LocalConn {
            stream,
            rx: Vec::with_capacity(4096),
            start: 0,
            out: Vec::with_capacity(256),
            read_timeout: None,
        };
        // The agent's hello: it has taken the connection (and the UDP
        // source it carries) before any request goes out.
        let hello = c
            .recv(hello_by.min(Instant::now() + HELLO_WAIT))
            .map_err(|e| io::Error::other(format!("no hello from the agent: {e:?}")))?;
        match lbagent_wire::decode(c.frame(hello), &Limits::UDP) {
            Ok(lbagent_wire::Message::ErrorResp(r))
                if r.seq() == 0 && r.retcode() == lbagent_wire::RetCode::Ok => {}
            _ => {
                return Err(io::Error::other(
                    "the local socket's first answer is no hello",
                ))
            }
        }
        Ok(c)
    }

    /// Sends one message as a frame.
    ///
    /// # Errors
    /// The connection is gone (the agent stopped), or the message is empty
    /// or too long.
    pub(crate) fn send(&mut self, msg: &[u8]) -> io::Result<()> {
        if msg.is_empty() || msg.len() > Limits::UDP.max_len {
            return Err(io::Error::other(
                "a message the local socket does not carry",
            ));
        }
        self.out.clear();
        self.out
            .extend_from_slice(&(msg.len() as u32).to_le_bytes());
        self.out.extend_from_slice(msg);
        let mut sent = 0;
        while sent < self.out.len() {
            match send(
                self.stream.as_raw_fd(),
                &self.out[sent..],
                MsgFlags::MSG_NOSIGNAL,
            ) {
                Ok(n) => sent += n,
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// The next frame's bytes (a range of [`LocalConn::frame`]), waiting
    /// until `deadline` at most.
    ///
    /// # Errors
    /// See [`RecvError`].
    pub(crate) fn recv(&mut self, deadline: Instant) -> Result<std::ops::Range<usize>, RecvError> {
        use std::io::Read;
        loop {
            if let Some(r) = self.complete()? {
                return Ok(r);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(RecvError::TimedOut);
            }
            let wait = (deadline - now).max(Duration::from_millis(1));
            if self.read_timeout != Some(wait) {
                self.stream
                    .set_read_timeout(Some(wait))
                    .map_err(|_| RecvError::Io)?;
                self.read_timeout = Some(wait);
            }
            if self.start == self.rx.len() {
                self.rx.clear();
                self.start = 0;
            }
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(RecvError::Closed),
                Ok(n) => self.rx.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                    return Err(RecvError::Closed)
                }
                Err(_) => return Err(RecvError::Io),
            }
        }
    }

    /// The bytes of a frame [`LocalConn::recv`] gave.
    pub(crate) fn frame(&self, r: std::ops::Range<usize>) -> &[u8] {
        &self.rx[r]
    }

    /// A complete frame at `start`, taken; None when more bytes are needed.
    fn complete(&mut self) -> Result<Option<std::ops::Range<usize>>, RecvError> {
        let have = &self.rx[self.start..];
        let Some(prefix) = have.get(..4) else {
            return Ok(None);
        };
        let len = u32::from_le_bytes(prefix.try_into().expect("four bytes")) as usize;
        if len == 0 || len > Limits::UDP.max_len {
            return Err(RecvError::Garbage(format!(
                "a frame of {len} bytes on the local socket"
            )));
        }
        if have.len() < 4 + len {
            return Ok(None);
        }
        let r = self.start + 4..self.start + 4 + len;
        self.start = r.end;
        Ok(Some(r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;

    #[test]
    fn frames_go_out_prefixed_and_come_back_whole_across_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let hb = dir.path().join("hb");
        std::fs::write(&hb, b"").unwrap();
        let l = UnixListener::bind(lbagent_host::local::socket_path(&hb, 0)).unwrap();
        let agent = std::thread::spawn(move || {
            let (mut srv, _) = l.accept().unwrap();
            // Without a UDP socket the client says so first.
            let mut id = [0u8; 4];
            srv.read_exact(&mut id).unwrap();
            assert_eq!(&id, NO_ID_MAGIC);
            let hello = lbagent_wire::Encoder::new()
                .error_resp(
                    0,
                    lbagent_model::ModuleId::new(0, 0),
                    lbagent_wire::RetCode::Ok,
                    "hi",
                )
                .to_vec();
            srv.write_all(&(hello.len() as u32).to_le_bytes()).unwrap();
            srv.write_all(&hello).unwrap();
            srv
        });
        let mut c =
            LocalConn::connect(&hb, 0, None, Instant::now() + Duration::from_secs(20)).unwrap();
        let mut srv = agent.join().unwrap();
        c.send(b"abc").unwrap();
        let mut got = [0u8; 7];
        srv.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"\x03\0\0\0abc");
        // Two frames, the second split over two writes.
        srv.write_all(b"\x02\0\0\0hi\x05\0\0").unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let r = c.recv(deadline).unwrap();
        assert_eq!(c.frame(r), b"hi");
        srv.write_all(b"\0hello").unwrap();
        let r = c.recv(deadline).unwrap();
        assert_eq!(c.frame(r), b"hello");
        // Silence times out; a closed agent is Closed.
        let soon = Instant::now() + Duration::from_millis(20);
        assert!(matches!(c.recv(soon), Err(RecvError::TimedOut)));
        drop(srv);
        assert!(matches!(c.recv(deadline), Err(RecvError::Closed)));
        // Writing to it raises no SIGPIPE, only an error.
        let mut failed = false;
        for _ in 0..100 {
            failed |= c.send(b"x").is_err();
        }
        assert!(failed);
    }

    #[test]
    fn no_socket_or_a_plain_file_is_no_connection() {
        let dir = tempfile::tempdir().unwrap();
        let hb = dir.path().join("hb");
        std::fs::write(&hb, b"").unwrap();
        assert!(
            LocalConn::connect(&hb, 0, None, Instant::now() + Duration::from_secs(20)).is_err()
        );
        std::fs::write(lbagent_host::local::socket_path(&hb, 0), b"").unwrap();
        let e = LocalConn::connect(&hb, 0, None, Instant::now() + Duration::from_secs(20))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a socket"), "{e}");
    }
}
