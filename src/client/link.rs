//! The datagrams between one client and the agent's shards: one UDP socket
//! per shard, connected (so that the kernel drops datagrams from anyone
//! else, and a closed port reports "connection refused" at once instead of
//! a silent timeout), requests numbered by a sequence, answers matched by
//! it, lost datagrams re-sent.
//!
//! # Retries
//!
//! A request is sent at once and again every [`resend_interval`] (a quarter
//! of the caller's timeout, clamped to 10..=100 ms) with the same sequence
//! number, until an answer carrying that number arrives or the timeout
//! passes. A loopback datagram is lost only when a receive buffer is full;
//! re-sending a few times within the timeout rides over that without adding
//! much load to an agent that is merely slow.
//!
//! # Matching
//!
//! Every answer echoes its request's sequence number. An answer with
//! another number is stale (a late answer to an earlier request, or to an
//! earlier copy) and is discarded. Bytes that do not decode, or a message
//! that is not an answer, mean something other than the agent is on the
//! port: [`Failure::Garbage`].
//!
//! # Shared memory
//!
//! When the heartbeat offers regions ([`Link::sync`]) and the client allows
//! it, a request to a shard goes through a slot of that shard's region
//! ([`lbagent_shm::attach`]) instead: the same bytes, the same answer, no
//! re-sending (nothing is lost); a getHost or report goes as a record of
//! the fixed layout ([`lbagent_shm::fixed`]), and a getHost's answer comes
//! back as one ([`Answer::Host`]). A region the agent closed, or one that
//! cannot be attached, sends the request by UDP instead (attaching is tried
//! again a second later), so every failure path stays UDP's.
//!
//! # The local socket
//!
//! With its UDP socket for a shard, the link opens a connection to the
//! shard's local socket when the agent serves one ([`super::local`]: a
//! Unix stream connection beside the heartbeat, once per shard and agent)
//! and hands the UDP socket to the agent over it: the agent then knows
//! whose datagrams come from that source, takes requests that act beyond
//! the caller from it when the user is trusted, and gives its balance
//! units back when the connection closes. Requests still go over UDP; over
//! the connection (the same bytes, the answer on it, no re-sending) only
//! when UDP is refused or unreachable while the connection is open (a
//! container with its own network namespace), and then until the agent
//! changes. A socket that is not there (an older agent,
//! `agent.local_socket = false`) or not the agent's is not tried again
//! until the heartbeat names another agent: no clock is read per request.
//!
//! Owns the sockets, the slots, the local connections, the encoder and the
//! receive buffer; knows nothing of heartbeats, static routes or the
//! cache.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::local::{LocalConn, RecvError};
use super::locate::Endpoints;
use lbagent_model::{ModuleId, NodeAddr};
use lbagent_shm::attach::{Attachment, Due, ShmFailure, REPORT_WAIT};
use lbagent_shm::fixed::{self, HostAnswer};
use lbagent_shm::layout::{FMT_FIXED, FMT_FLATBUFFERS};
use lbagent_wire::{decode, Encoder, Limits, Message};

/// An answer, as it came: a FlatBuffers message (UDP, and shared memory
/// for every answer but a getHost's), or a getHost answer record of the
/// fixed layout (shared memory).
#[derive(Debug)]
pub(crate) enum Answer<'a> {
    /// A decoded message.
    Msg(Message<'a>),
    /// A getHost's answer in the fixed layout.
    Host(HostAnswer),
}

/// How long a report (which waits for nothing) waits at most for the
/// agent's hello on a new local connection.
const REPORT_HELLO_WAIT: Duration = Duration::from_secs(1);

/// The shortest interval between copies of a request.
pub const MIN_RESEND: Duration = Duration::from_millis(10);

/// The longest interval between copies of a request.
pub const MAX_RESEND: Duration = Duration::from_millis(100);

/// How long to wait for an answer before sending a request again: a quarter
/// of `timeout`, clamped to [`MIN_RESEND`]..=[`MAX_RESEND`].
pub fn resend_interval(timeout: Duration) -> Duration {
    (timeout / 4).clamp(MIN_RESEND, MAX_RESEND)
}

/// Why a request got no usable answer.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The shard's port refused the datagram: nothing listens there.
    Refused,
    /// No answer within the timeout.
    TimedOut,
    /// Something answered with bytes that are not an answer.
    Garbage(String),
    /// A system call failed.
    Io(io::Error),
}

/// What an answer is, before its body is looked at.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// It answers the request with this sequence number.
    Ours,
    /// It answers another request: discard it.
    Stale,
    /// Not an answer at all.
    Garbage(String),
}

/// The sequence number an answer echoes, `None` for a message that is not
/// an answer from the agent.
pub(crate) fn answer_seq(msg: &Message<'_>) -> Option<u64> {
    match msg {
        Message::GetHostResp(m) => Some(u64::from(m.seq())),
        Message::RegisterResp(m) => Some(u64::from(m.seq())),
        Message::GetRouteResp(m) => Some(u64::from(m.seq())),
        Message::CacheGetRouteResp(m) => Some(u64::from(m.seq())),
        Message::ErrorResp(m) => Some(m.seq()),
        _ => None,
    }
}

/// Judges a decoded datagram against the request numbered `seq`.
pub(crate) fn judge(msg: &Message<'_>, seq: u32) -> Verdict {
    match answer_seq(msg) {
        Some(s) if s == u64::from(seq) => Verdict::Ours,
        Some(_) => Verdict::Stale,
        None => Verdict::Garbage(format!(
            "a {} message where an answer was expected",
            msg.name()
        )),
    }
}

struct ShardSocket {
    sock: UdpSocket,
    /// The receive timeout last set on the socket.
    read_timeout: Option<Duration>,
}

impl ShardSocket {
    fn connect(to: SocketAddr) -> io::Result<Self> {
        let sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        sock.connect(to)?;
        Ok(ShardSocket {
            sock,
            read_timeout: None,
        })
    }

    /// Sets the receive timeout unless it is already `t` (a system call
    /// saved on almost every request).
    fn wait_at_most(&mut self, t: Duration) -> io::Result<()> {
        if self.read_timeout != Some(t) {
            self.sock.set_read_timeout(Some(t))?;
            self.read_timeout = Some(t);
        }
        Ok(())
    }
}

/// The regions the heartbeat offers: their prefix and the agent's pid.
pub(crate) type ShmTarget = (PathBuf, u32);

/// How long an attach waits at most for the agent to lease a slot.
const LEASE_WAIT: Duration = Duration::from_secs(1);

/// How long after a failed attach (or a closed region) a shard's region is
/// tried again.
const ATTACH_RETRY: Duration = Duration::from_secs(1);

/// One client's sockets (and slots) towards the agent's shards.
pub(crate) struct Link {
    endpoints: Option<Endpoints>,
    generation: u64,
    sockets: Vec<Option<ShardSocket>>,
    enc: Encoder,
    buf: Vec<u8>,
    seq: u32,
    /// Whether the client may use shared memory.
    shm_allowed: bool,
    /// The regions offered, if any.
    shm_target: Option<ShmTarget>,
    /// Per shard: the slot held.
    slots: Vec<Option<Attachment>>,
    /// Per shard: no attach before this instant.
    attach_after: Vec<Option<Instant>>,
    /// The heartbeat the local sockets are beside (None: the client does
    /// not use them).
    local_heartbeat: Option<PathBuf>,
    /// Per shard: its local connection.
    locals: Vec<Local>,
    /// Per shard: UDP did not reach it while the local connection was
    /// open; requests go over the connection.
    udp_down: Vec<bool>,
    /// Per shard: the node hint of the last getHost answered through its
    /// region, for that module and host ([`fixed::Hint`]): a report of
    /// the same node hands it back.
    hints: Vec<Option<(ModuleId, NodeAddr, u32)>>,
}

/// Where a shard's local connection stands.
#[derive(Debug)]
enum Local {
    /// Not tried with this agent yet.
    Untried,
    /// Open.
    Open(LocalConn),
    /// Not there, or broken: UDP until the agent changes.
    Off,
}

/// How a request over the local connection ended without an answer.
enum LocalEnd {
    /// Nothing usable happened there: send it by UDP.
    Fallback,
    /// The request's own failure.
    Failed(Failure),
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("endpoints", &self.endpoints)
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

impl Link {
    /// A link with no sockets yet; the sequence starts at a random number
    /// so that two clients on one port (after a crash) do not collide.
    #[cfg(test)]
    pub fn new() -> Self {
        Self::with_transports(false, None)
    }

    /// [`Link::new`], using the shared-memory regions the heartbeat offers
    /// when `shm` is true, and the local sockets beside `local_heartbeat`
    /// when given.
    pub fn with_transports(shm: bool, local_heartbeat: Option<PathBuf>) -> Self {
        Link {
            local_heartbeat,
            locals: Vec::new(),
            udp_down: Vec::new(),
            endpoints: None,
            generation: u64::MAX,
            sockets: Vec::new(),
            enc: Encoder::new(),
            buf: vec![0; Limits::UDP.max_len + 1],
            seq: fastrand::u32(..),
            shm_allowed: shm,
            shm_target: None,
            slots: Vec::new(),
            attach_after: Vec::new(),
            hints: Vec::new(),
        }
    }

    /// Points the link at `endpoints`; closes every socket (and gives back
    /// every slot) when the endpoints' `generation` changed.
    pub fn sync(&mut self, endpoints: Endpoints, generation: u64) {
        if self.generation != generation || self.endpoints != Some(endpoints) {
            self.generation = generation;
            self.endpoints = Some(endpoints);
            self.sockets.clear();
            self.sockets.resize_with(endpoints.shards as usize, || None);
            self.slots.clear();
            self.slots.resize_with(endpoints.shards as usize, || None);
            self.attach_after.clear();
            self.attach_after.resize(endpoints.shards as usize, None);
            self.locals.clear();
            self.locals
                .resize_with(endpoints.shards as usize, || Local::Untried);
            self.udp_down.clear();
            self.udp_down.resize(endpoints.shards as usize, false);
            self.hints.clear();
            self.hints.resize(endpoints.shards as usize, None);
        }
    }

    /// Whether `shard`'s local connection is open (connecting it the first
    /// time it is asked for with this agent).
    /// The agent's hello is awaited until `hello_by` at most (a request's
    /// own timeout): a connection not greeted in time is not used with
    /// this agent.
    fn local(&mut self, shard: u32, hello_by: Instant) -> bool {
        let i = shard as usize;
        match self.locals.get(i) {
            Some(Local::Open(_)) => return true,
            Some(Local::Untried) if self.local_heartbeat.is_some() => {}
            _ => return false,
        }
        // The UDP socket first: the connection carries it to the agent.
        // One that cannot even be made (no route to the agent's address:
        // another network namespace) leaves the connection as the way.
        let udp_ok = self.socket(shard).is_ok();
        let Link {
            local_heartbeat,
            locals,
            sockets,
            udp_down,
            ..
        } = self;
        let hb = local_heartbeat.as_deref().expect("checked above");
        let udp = sockets[i].as_ref().map(|s| s.sock.as_fd());
        locals[i] = match LocalConn::connect(hb, shard, udp, hello_by) {
            Ok(c) => {
                udp_down[i] = !udp_ok;
                Local::Open(c)
            }
            Err(_) => Local::Off,
        };
        matches!(locals[i], Local::Open(_))
    }

    /// UDP could not reach `shard` (refused, unreachable) while its local
    /// connection is open: its requests go over the connection until the
    /// agent changes (a container with its own network namespace).
    fn udp_unreachable(&mut self, shard: u32) -> bool {
        let open = matches!(self.locals.get(shard as usize), Some(Local::Open(_)));
        if open {
            self.udp_down[shard as usize] = true;
        }
        open
    }

    /// How many shards this link holds an open local connection to.
    pub fn local_connected(&self) -> usize {
        self.locals
            .iter()
            .filter(|l| matches!(l, Local::Open(_)))
            .count()
    }

    /// Sends the encoded request over `shard`'s open local connection and
    /// waits until `deadline` for the answer numbered `seq`.
    fn local_exchange<T>(
        &mut self,
        shard: u32,
        seq: u32,
        deadline: Instant,
        answer: &mut impl FnMut(Answer<'_>) -> T,
    ) -> Result<T, LocalEnd> {
        let Link { locals, enc, .. } = self;
        let Some(Local::Open(c)) = locals.get_mut(shard as usize) else {
            return Err(LocalEnd::Fallback);
        };
        if c.send(enc.finished()).is_err() {
            return Err(LocalEnd::Fallback);
        }
        loop {
            let r = match c.recv(deadline) {
                Ok(r) => r,
                Err(RecvError::Closed | RecvError::Io) => return Err(LocalEnd::Fallback),
                Err(RecvError::TimedOut) => return Err(LocalEnd::Failed(Failure::TimedOut)),
                Err(RecvError::Garbage(why)) => {
                    locals[shard as usize] = Local::Off;
                    return Err(LocalEnd::Failed(Failure::Garbage(why)));
                }
            };
            let msg = match decode(c.frame(r), &Limits::UDP) {
                Ok(m) => m,
                Err(e) => {
                    return Err(LocalEnd::Failed(Failure::Garbage(format!(
                        "undecodable answer: {e}"
                    ))))
                }
            };
            match judge(&msg, seq) {
                Verdict::Ours => return Ok(answer(Answer::Msg(msg))),
                Verdict::Stale => continue,
                Verdict::Garbage(why) => return Err(LocalEnd::Failed(Failure::Garbage(why))),
            }
        }
    }

    /// Follows the regions the heartbeat offers (`None`: none); a change
    /// gives back every slot held.
    pub fn sync_shm(&mut self, target: Option<&ShmTarget>) {
        if self.shm_target.as_ref() != target {
            self.shm_target = target.cloned();
            self.slots.iter_mut().for_each(|s| *s = None);
            self.attach_after.iter_mut().for_each(|a| *a = None);
        }
    }

    /// How many shards this link holds a slot of.
    pub fn shm_attached(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Attaches to `shard`'s region if allowed, offered, and not failed
    /// within [`ATTACH_RETRY`]; true when a slot is held. The slot is
    /// leased over the shard's local socket when the agent leases slots
    /// and the client uses the local socket ([`lbagent_shm::lease`]: it
    /// is this client's as long as it lives, in whatever pid namespace it
    /// runs), else claimed by pid.
    fn attach(&mut self, shard: u32) -> bool {
        let i = shard as usize;
        if !self.shm_allowed || i >= self.slots.len() {
            return false;
        }
        if self.slots[i].is_some() {
            return true;
        }
        let Some((prefix, pid)) = &self.shm_target else {
            return false;
        };
        let now = Instant::now();
        if self.attach_after[i].is_some_and(|t| now < t) {
            return false;
        }
        let path = lbagent_shm::region_path(prefix, shard);
        let hb = self.local_heartbeat.as_deref();
        let attached = Attachment::open(&path, *pid).and_then(|(region, file)| {
            if let Some(hb) = hb.filter(|_| Attachment::leases(&region)) {
                let by = now + LEASE_WAIT;
                if let Ok((conn, slot)) = LocalConn::lease(hb, shard, file.as_fd(), by) {
                    return match slot {
                        Some(slot) => Attachment::leased(region, slot, conn),
                        None => Err(format!("{}: no slot free", path.display())),
                    };
                }
            }
            Attachment::claim(region)
        });
        match attached {
            Ok(a) => {
                self.slots[i] = Some(a);
                true
            }
            Err(_) => {
                self.attach_after[i] = Some(now + ATTACH_RETRY);
                false
            }
        }
    }

    /// Gives back `shard`'s slot (its region closed) and tries again later.
    fn detach(&mut self, shard: u32) {
        let i = shard as usize;
        self.slots[i] = None;
        self.attach_after[i] = Some(Instant::now() + ATTACH_RETRY);
    }

    /// Sends the encoded request through `shard`'s slot and waits for its
    /// answer into `buf`. `Ok(None)`: the region is closed, go by UDP.
    fn shm_exchange(
        &mut self,
        shard: u32,
        record: Option<&fixed::Request>,
        answer: bool,
        due: &Due,
    ) -> Result<Option<(usize, u8)>, ShmFailure> {
        // Once its UDP failed, a leased slot rings over its connection
        // until it is given back: no socket is tried per request.
        let over_lease = self.slots[shard as usize]
            .as_ref()
            .is_some_and(|s| s.rings_over_lease());
        let udp = !over_lease && self.socket(shard).is_ok();
        let Link {
            sockets,
            slots,
            enc,
            buf,
            hints,
            ..
        } = self;
        let slot = slots[shard as usize].as_mut().expect("attached");
        // A leased slot needs no UDP: its doorbell goes over the lease's
        // connection (a client in its own network namespace).
        if !udp && !slot.is_leased() {
            return Err(ShmFailure::Closed);
        }
        slot.ring_over_lease(!udp);
        let sock = sockets[shard as usize].as_ref().map(|s| &s.sock);
        // The doorbell: an empty datagram on the shard's port, sent only
        // while the shard is parked.
        let mut ring = || {
            if let Some(sock) = sock {
                let _ = sock.send(&[]);
            }
        };
        let mut rec = [0u8; fixed::MAX_LEN];
        let (req, format) = match record {
            Some(r) => {
                let hint = if slot.reads_hints() {
                    node_hint(r, hints[shard as usize])
                } else {
                    fixed::Hint::None
                };
                let n = fixed::encode_request_hinted(r, hint, &mut rec);
                (&rec[..n], FMT_FIXED)
            }
            None => (enc.finished(), FMT_FLATBUFFERS),
        };
        let seq = match slot.post(req, format, answer, due, &mut ring) {
            Ok(seq) => seq,
            Err(ShmFailure::Closed) => return Ok(None),
            Err(e) => return Err(e),
        };
        if !answer {
            return Ok(Some((0, format)));
        }
        match slot.wait(seq, due, buf, &mut ring) {
            Ok(n) => Ok(Some(n)),
            Err(ShmFailure::Closed) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The next sequence number (never 0, which ErrorResp uses for "unknown").
    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        if self.seq == 0 {
            self.seq = 1;
        }
        self.seq
    }

    fn socket(&mut self, shard: u32) -> Result<&mut ShardSocket, Failure> {
        let endpoints = self
            .endpoints
            .ok_or_else(|| Failure::Io(io::Error::other("no agent endpoints known")))?;
        let slot = self
            .sockets
            .get_mut(shard as usize)
            .ok_or_else(|| Failure::Io(io::Error::other(format!("no shard {shard}"))))?;
        if slot.is_none() {
            *slot = Some(ShardSocket::connect(endpoints.shard_addr(shard)).map_err(Failure::Io)?);
        }
        Ok(slot.as_mut().expect("set above"))
    }

    /// Sends one datagram that has no answer (a report), built by `build`
    /// from a fresh sequence number.
    ///
    /// # Errors
    /// [`Failure::Refused`] when the port is known closed, [`Failure::Io`].
    pub fn send(
        &mut self,
        shard: u32,
        record: Option<fixed::Request>,
        build: impl FnOnce(&mut Encoder, u32),
    ) -> Result<(), Failure> {
        let seq = self.next_seq();
        let record = record.map(|r| r.with_seq(seq));
        let mut build = Some(build);
        if self.attach(shard) {
            if record.is_none() {
                (build.take().expect("not built yet"))(&mut self.enc, seq);
            }
            match self.shm_exchange(shard, record.as_ref(), false, &Due::after(REPORT_WAIT)) {
                Ok(Some(_)) => return Ok(()),
                Ok(None) => self.detach(shard),
                // The slot's previous request is not consumed yet: UDP.
                Err(_) => {}
            }
        }
        if let Some(build) = build {
            build(&mut self.enc, seq);
        }
        let local = self.local(shard, Instant::now() + REPORT_HELLO_WAIT);
        if local && self.udp_down[shard as usize] && self.local_send(shard) {
            return Ok(());
        }
        self.socket(shard)?;
        let Link { sockets, enc, .. } = self;
        let s = sockets[shard as usize].as_mut().expect("opened above");
        let failed = match s.sock.send(enc.finished()) {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Failure::Refused,
            Err(e) => Failure::Io(e),
        };
        if self.udp_unreachable(shard) && self.local_send(shard) {
            return Ok(());
        }
        Err(failed)
    }

    /// Sends the encoded request over `shard`'s open local connection;
    /// false (and the connection dropped) when it broke.
    fn local_send(&mut self, shard: u32) -> bool {
        let i = shard as usize;
        if let Some(Local::Open(c)) = self.locals.get_mut(i) {
            if c.send(self.enc.finished()).is_ok() {
                return true;
            }
        }
        self.locals[i] = Local::Off;
        self.udp_down[i] = false;
        false
    }

    /// Sends the request `build` encodes (given a fresh sequence number) to
    /// `shard`, re-sending it until an answer with that number arrives or
    /// the call's deadline (`due`) passes, and returns what `answer` makes
    /// of that answer.
    ///
    /// # Errors
    /// [`Failure::Refused`], [`Failure::TimedOut`], [`Failure::Garbage`],
    /// [`Failure::Io`].
    pub fn request<T>(
        &mut self,
        shard: u32,
        due: &Due,
        record: Option<fixed::Request>,
        build: impl FnOnce(&mut Encoder, u32),
        mut answer: impl FnMut(Answer<'_>) -> T,
    ) -> Result<T, Failure> {
        let seq = self.next_seq();
        let record = record.map(|r| r.with_seq(seq));
        let mut build = Some(build);
        if self.attach(shard) {
            if record.is_none() {
                (build.take().expect("not built yet"))(&mut self.enc, seq);
            }
            match self.shm_exchange(shard, record.as_ref(), true, due) {
                Ok(Some((n, FMT_FIXED))) => {
                    let (a, hint) = fixed::decode_answer_hinted(&self.buf[..n])
                        .map_err(|e| Failure::Garbage(format!("undecodable answer: {e}")))?;
                    if a.seq != seq {
                        return Err(Failure::Garbage(
                            "an answer to another request in the shared-memory slot".into(),
                        ));
                    }
                    if let (Some(i), Some(host)) = (hint, a.host) {
                        self.hints[shard as usize] = Some((a.module, host, i));
                    }
                    return Ok(answer(Answer::Host(a)));
                }
                Ok(Some((n, _))) => {
                    let msg = decode(&self.buf[..n], &Limits::UDP)
                        .map_err(|e| Failure::Garbage(format!("undecodable answer: {e}")))?;
                    return match judge(&msg, seq) {
                        Verdict::Ours => Ok(answer(Answer::Msg(msg))),
                        Verdict::Stale => Err(Failure::Garbage(
                            "an answer to another request in the shared-memory slot".into(),
                        )),
                        Verdict::Garbage(why) => Err(Failure::Garbage(why)),
                    };
                }
                Ok(None) | Err(ShmFailure::Closed) => self.detach(shard),
                // Consumed without an answer: UDP would have waited out
                // the timeout for nothing.
                Err(ShmFailure::TimedOut | ShmFailure::Dropped) => return Err(Failure::TimedOut),
                Err(ShmFailure::Garbage(why)) => return Err(Failure::Garbage(why)),
            }
        }
        if let Some(build) = build {
            build(&mut self.enc, seq);
        }
        let deadline = due.deadline();
        let timeout = due.remaining();
        let local = self.local(shard, deadline);
        if local && self.udp_down[shard as usize] {
            match self.local_exchange(shard, seq, deadline, &mut answer) {
                Ok(t) => return Ok(t),
                Err(LocalEnd::Failed(f)) => return Err(f),
                // The agent went away: UDP says so, as without the local
                // socket.
                Err(LocalEnd::Fallback) => {
                    self.locals[shard as usize] = Local::Off;
                    self.udp_down[shard as usize] = false;
                }
            }
        }
        match self.udp_request(shard, seq, timeout, &mut answer) {
            Err(f @ (Failure::Refused | Failure::Io(_))) if self.udp_unreachable(shard) => {
                match self.local_exchange(shard, seq, deadline, &mut answer) {
                    Ok(t) => Ok(t),
                    Err(LocalEnd::Failed(f)) => Err(f),
                    Err(LocalEnd::Fallback) => {
                        self.locals[shard as usize] = Local::Off;
                        self.udp_down[shard as usize] = false;
                        Err(f)
                    }
                }
            }
            r => r,
        }
    }

    /// The UDP exchange of [`Link::request`]: the encoded request sent and
    /// re-sent until its answer or the timeout.
    fn udp_request<T>(
        &mut self,
        shard: u32,
        seq: u32,
        timeout: Duration,
        answer: &mut impl FnMut(Answer<'_>) -> T,
    ) -> Result<T, Failure> {
        self.socket(shard)?;
        let Link {
            sockets, enc, buf, ..
        } = self;
        let s = sockets[shard as usize].as_mut().expect("opened above");
        let req = enc.finished();
        let start = Instant::now();
        let deadline = start + timeout;
        let interval = resend_interval(timeout);
        let mut next_send = start;
        loop {
            let now = Instant::now();
            if now >= next_send {
                match s.sock.send(req) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                        return Err(Failure::Refused)
                    }
                    // A full send buffer loses this copy; the next one may pass.
                    Err(e) if is_transient(&e) => {}
                    Err(e) => return Err(Failure::Io(e)),
                }
                next_send += interval;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Failure::TimedOut);
            }
            let wait = ceil_ms(next_send.min(deadline) - now);
            s.wait_at_most(wait).map_err(Failure::Io)?;
            match s.sock.recv(buf) {
                Ok(n) => {
                    let msg = match decode(&buf[..n], &Limits::UDP) {
                        Ok(m) => m,
                        Err(e) => return Err(Failure::Garbage(format!("undecodable answer: {e}"))),
                    };
                    match judge(&msg, seq) {
                        Verdict::Ours => return Ok(answer(Answer::Msg(msg))),
                        Verdict::Stale => continue,
                        Verdict::Garbage(why) => return Err(Failure::Garbage(why)),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    return Err(Failure::Refused)
                }
                Err(e) if is_transient(&e) => {}
                Err(e) => return Err(Failure::Io(e)),
            }
        }
    }
}

/// Errors after which the exchange simply goes on: a receive timeout, an
/// interrupted call, a momentarily full buffer.
fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    ) || e.raw_os_error() == Some(libc::ENOBUFS)
}

/// `d` rounded up to whole milliseconds, at least 1 ms (a receive timeout
/// of 0 would mean "forever"; whole milliseconds keep the value stable from
/// one request to the next, so the socket option is rarely set).
fn ceil_ms(d: Duration) -> Duration {
    let ms = d.as_nanos().div_ceil(1_000_000).max(1);
    Duration::from_millis(ms.min(u128::from(u64::MAX)) as u64)
}

/// What request `r` carries of the node hint ([`fixed::Hint`]) towards a
/// shard that reads hints: a getHost asks for one; a report hands back
/// `last`, the hint of the last getHost answered there, when it was for
/// the same module and node.
fn node_hint(r: &fixed::Request, last: Option<(ModuleId, NodeAddr, u32)>) -> fixed::Hint {
    match r {
        fixed::Request::GetHost(_) => fixed::Hint::Ask,
        fixed::Request::Report(rep) => match last {
            Some((m, host, i)) if m == rep.module && host == rep.host => fixed::Hint::Node(i),
            _ => fixed::Hint::None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbagent_model::{ModuleId, NodeAddr};
    use lbagent_wire::RetCode;

    const M: ModuleId = ModuleId::new(4, 2);

    #[test]
    fn a_report_hands_back_the_hint_of_its_own_modules_node_only() {
        let host = NodeAddr::new(Ipv4Addr::new(10, 0, 0, 1), 80);
        let other = NodeAddr::new(Ipv4Addr::new(10, 0, 0, 2), 80);
        let g = fixed::Request::GetHost(lbagent_wire::GetHost {
            seq: 1,
            module: M,
            business_priority: 0,
            user_priority: 0,
        });
        assert_eq!(node_hint(&g, None), fixed::Hint::Ask);
        let report = |module, host| {
            fixed::Request::Report(lbagent_wire::Report {
                seq: 2,
                module,
                host,
                retcode: 0,
                tcost_ms: 1,
                downstream_level: None,
                consumed: 0,
            })
        };
        let last = Some((M, host, 7));
        assert_eq!(node_hint(&report(M, host), last), fixed::Hint::Node(7));
        assert_eq!(node_hint(&report(M, other), last), fixed::Hint::None);
        let m2 = ModuleId::new(5, 2);
        assert_eq!(node_hint(&report(m2, host), last), fixed::Hint::None);
        assert_eq!(node_hint(&report(M, host), None), fixed::Hint::None);
    }

    #[test]
    fn resend_interval_is_a_quarter_of_the_timeout_within_bounds() {
        assert_eq!(resend_interval(Duration::from_millis(1)), MIN_RESEND);
        assert_eq!(
            resend_interval(Duration::from_millis(200)),
            Duration::from_millis(50)
        );
        assert_eq!(resend_interval(Duration::from_secs(5)), MAX_RESEND);
    }

    #[test]
    fn ceil_ms_never_gives_zero() {
        assert_eq!(ceil_ms(Duration::ZERO), Duration::from_millis(1));
        assert_eq!(
            ceil_ms(Duration::from_micros(1001)),
            Duration::from_millis(2)
        );
        assert_eq!(
            ceil_ms(Duration::from_millis(25)),
            Duration::from_millis(25)
        );
    }

    #[test]
    fn answers_are_judged_by_their_sequence_number() {
        let mut enc = Encoder::new();
        let host = Some(NodeAddr::new(Ipv4Addr::LOCALHOST, 1));
        let ours = enc.get_host_resp(7, M, RetCode::Ok, host, None).to_vec();
        assert_eq!(
            judge(&decode(&ours, &Limits::UDP).unwrap(), 7),
            Verdict::Ours
        );
        assert_eq!(
            judge(&decode(&ours, &Limits::UDP).unwrap(), 8),
            Verdict::Stale
        );
        let err = enc.error_resp(0, M, RetCode::BadRequest, "?").to_vec();
        assert_eq!(
            judge(&decode(&err, &Limits::UDP).unwrap(), 7),
            Verdict::Stale
        );
        let req = enc.get_host_req(7, M, 0, 0).to_vec();
        assert!(matches!(
            judge(&decode(&req, &Limits::UDP).unwrap(), 7),
            Verdict::Garbage(ref w) if w.contains("GetHostReq")
        ));
    }

    /// A fake shard on loopback that answers only the `answer_from`-th copy
    /// of a request, after sending a stale answer.
    #[test]
    fn a_lost_request_is_resent_and_stale_answers_are_skipped() {
        let shard = UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = shard.local_addr().unwrap().port();
        shard
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let t = std::thread::spawn(move || {
            let mut buf = vec![0u8; 2048];
            let mut enc = Encoder::new();
            let mut copies = 0;
            loop {
                let (n, peer) = shard.recv_from(&mut buf).unwrap();
                let Message::GetHostReq(r) = decode(&buf[..n], &Limits::UDP).unwrap() else {
                    panic!("not a GetHostReq")
                };
                copies += 1;
                if copies < 3 {
                    continue; // "lost"
                }
                let host = Some(NodeAddr::new(Ipv4Addr::LOCALHOST, 9));
                let stale = enc
                    .get_host_resp(r.seq().wrapping_sub(1), M, RetCode::Ok, None, None)
                    .to_vec();
                shard.send_to(&stale, peer).unwrap();
                let ok = enc.get_host_resp(r.seq(), M, RetCode::Ok, host, None);
                shard.send_to(ok, peer).unwrap();
                return copies;
            }
        });
        let mut link = Link::new();
        let endpoints = Endpoints {
            ip: Ipv4Addr::LOCALHOST,
            base_port: port,
            shards: 1,
        };
        link.sync(endpoints, 1);
        // 5 s: copies go every 100 ms (MAX_RESEND) all the same, and a
        // stall of a busy machine (the fake shard is a thread of this
        // process) cannot time out the third.
        let got = link
            .request(
                0,
                &Due::after(Duration::from_secs(5)),
                None,
                |e, seq| {
                    e.get_host_req(seq, M, 0, 0);
                },
                |m| match m {
                    Answer::Msg(Message::GetHostResp(r)) => r.host().map(NodeAddr::from),
                    _ => None,
                },
            )
            .unwrap();
        assert_eq!(got, Some(NodeAddr::new(Ipv4Addr::LOCALHOST, 9)));
        assert_eq!(t.join().unwrap(), 3);
    }

    #[test]
    fn a_closed_port_is_refused_quickly_and_silence_times_out() {
        let closed = UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let mut link = Link::new();
        link.sync(
            Endpoints {
                ip: Ipv4Addr::LOCALHOST,
                base_port: port,
                shards: 1,
            },
            1,
        );
        // Refused at once, not after the (long) timeout; the margin between
        // is for a stall of a busy machine.
        let t0 = Instant::now();
        let r = link.request(
            0,
            &Due::after(Duration::from_secs(20)),
            None,
            |e, s| {
                e.get_route_req(s, M);
            },
            |_| (),
        );
        assert!(matches!(r, Err(Failure::Refused)), "{r:?}");
        assert!(t0.elapsed() < Duration::from_secs(10));

        let silent = UdpSocket::bind("127.0.0.1:0").unwrap();
        link.sync(
            Endpoints {
                ip: Ipv4Addr::LOCALHOST,
                base_port: silent.local_addr().unwrap().port(),
                shards: 1,
            },
            2,
        );
        // 3 s: a resend every 100 ms (MAX_RESEND), about thirty copies; a
        // stall of a busy machine (a throttled cgroup stops every thread
        // for up to a second or two) can cost many of them, never all but
        // three (the interval itself is tested above, without a socket or
        // a clock).
        let timeout = Duration::from_secs(3);
        let t0 = Instant::now();
        let r = link.request(
            0,
            &Due::after(timeout),
            None,
            |e, s| {
                e.get_route_req(s, M);
            },
            |_| (),
        );
        assert!(matches!(r, Err(Failure::TimedOut)), "{r:?}");
        let took = t0.elapsed();
        assert!(
            took >= timeout && took < timeout + Duration::from_secs(5),
            "{took:?}"
        );
        let mut buf = [0u8; 256];
        silent.set_nonblocking(true).unwrap();
        let mut copies = 0;
        while silent.recv(&mut buf).is_ok() {
            copies += 1;
        }
        assert!(copies >= 3, "re-sent every 100 ms: {copies} copies");
    }
}
