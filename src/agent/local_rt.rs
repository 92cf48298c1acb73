//! The shard's side of the local socket: the connections the acceptor
//! thread identified ([`super::local_socket`]) are served on the shard's
//! executor, each by a reader task (frames in, [`ShardCore::handle_queued`]
//! as from the connection's [`local_peer`], answers queued) and a writer
//! task (answers out, in order, with the answers released later: a
//! waiting register's). The UDP request loop is not touched: these tasks
//! run when it yields or parks, and cost it nothing per datagram.
//!
//! A local request costs a read and a write system call (no batching, an
//! answer copied once into its connection's queue): the local socket is
//! for who needs to be identified, UDP and shared memory stay the fast
//! paths. Its requests are handled without a queuing time (a stream
//! carries no arrival stamp), so the shard's own shedding neither measures
//! nor sheds them (see the trust model's page). A connection that sends a frame that is no frame (length 0 or
//! above the UDP size limit) is closed; one whose answers are not read
//! loses those past [`ANSWER_QUEUE`] answers or [`ANSWER_BYTES`] (counted
//! as send errors).
//!
//! A connection that asked for a shared-memory slot (and proved it may use
//! the region, [`super::local_socket`]) is leased one when it opens: the
//! slot's index follows the hello ([`lbagent_shm::lease::lease_answer`]),
//! and when the connection closes the slot is freed and the balance units
//! taken through it go back. A [`lbagent_shm::lease::RING_FRAME`] on any
//! connection wakes the shard's request loop as an empty datagram does
//! (the shard sends one to its own port): the doorbell of a client whose
//! UDP cannot reach the shard.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::rc::Rc;
use std::sync::Arc;

use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::channels::local_channel::{self, LocalSender};
use glommio::channels::shared_channel::ConnectedSender;
use glommio::net::UnixStream;

use super::local_socket::{Accepted, Inbox};
use super::messages::ToControl;
use super::shard::callers::{client_key, local_peer};
use super::shard::ShardCore;
use super::shard_rt::{offer, TimerWake};
use lbagent_host::clock;
use lbagent_shm::layout::slot_peer;
use lbagent_shm::lease::{lease_answer, RING_MAGIC};
use lbagent_shm::serve::Server;
use lbagent_wire::frame::{write_frame, FrameDecoder};
use lbagent_wire::{DecodeError, Limits};

/// The most local connections one shard serves at once; past it a new
/// one is closed at once (counted in `lbagent_local_connections_refused_total`).
pub const MAX_CONNECTIONS: usize = 1024;

/// Answers queued for one connection's writer.
pub const ANSWER_QUEUE: usize = 256;

/// Bytes of answers queued for one connection's writer at most: a client
/// that asks and never reads holds no more than this (1,024 connections:
/// 64 MiB per shard at worst).
pub const ANSWER_BYTES: usize = 64 << 10;

/// A connection's writer: its queue of framed answers, and the bytes in it.
type Writer = (LocalSender<Vec<u8>>, Rc<Cell<usize>>);

/// The open connections' answer queues, by connection number.
#[derive(Default)]
pub struct Conns {
    /// Per connection: its writer's queue and the bytes in it.
    senders: RefCell<HashMap<u32, Writer>>,
    next: Cell<u32>,
}

impl Conns {
    /// Queues `answer` (one message) for connection `conn`, framed; false
    /// when the connection is gone or its queue is full.
    pub fn deliver(&self, conn: u32, answer: &[u8]) -> bool {
        let senders = self.senders.borrow();
        let Some((tx, queued)) = senders.get(&conn) else {
            return false;
        };
        let len = answer.len() + 4;
        if queued.get() + len > ANSWER_BYTES {
            return false;
        }
        let mut framed = Vec::with_capacity(len);
        if write_frame(&mut framed, answer).is_err() || tx.try_send(framed).is_err() {
            return false;
        }
        queued.set(queued.get() + len);
        true
    }

    /// True when no connection is open.
    pub fn is_empty(&self) -> bool {
        self.senders.borrow().is_empty()
    }

    /// A number no open connection has.
    fn number(&self) -> u32 {
        let senders = self.senders.borrow();
        loop {
            let n = self.next.get();
            self.next.set(n.wrapping_add(1));
            if !senders.contains_key(&n) {
                return n;
            }
        }
    }
}

/// What the connection tasks share with the rest of the shard.
#[derive(Clone)]
pub(crate) struct Shared {
    /// The shard's core.
    pub(crate) core: Rc<RefCell<ShardCore>>,
    /// The open connections.
    pub(crate) conns: Rc<Conns>,
    /// The ring to the control core (for the core's outbox).
    pub(crate) to_control: Rc<ConnectedSender<ToControl>>,
    /// The timer task's doorbell.
    pub(crate) timer: Rc<TimerWake>,
    /// The shard's shared-memory region, if it has one (its slots are
    /// leased to connections).
    pub(crate) shm: Option<Rc<RefCell<Server>>>,
    /// A socket connected to the shard's own UDP port: an empty datagram
    /// on it wakes the parked request loop.
    pub(crate) bell: Option<Rc<std::net::UdpSocket>>,
}

/// Takes the connections the acceptor queues for this shard, forever
/// (cancelled by dropping its task).
pub(crate) async fn accept(inbox: Arc<Inbox>, shared: Shared) {
    loop {
        inbox.bell.rung().await;
        let refused = inbox.take_refused();
        shared.core.borrow_mut().metrics.local_refused += refused;
        for accepted in inbox.take() {
            if shared.conns.senders.borrow().len() >= MAX_CONNECTIONS {
                shared.core.borrow_mut().metrics.local_refused += 1;
                continue;
            }
            open(accepted, &shared);
        }
    }
}

/// Starts serving one identified connection.
fn open(accepted: Accepted, shared: &Shared) {
    let Accepted { fd, caller, lease } = accepted;
    let Ok(write_fd) = fd.try_clone() else {
        shared.core.borrow_mut().metrics.local_refused += 1;
        return;
    };
    let conn = shared.conns.number();
    let (tx, rx) = local_channel::new_bounded::<Vec<u8>>(ANSWER_QUEUE);
    let queued = Rc::new(Cell::new(0));
    shared
        .conns
        .senders
        .borrow_mut()
        .insert(conn, (tx, queued.clone()));
    {
        let mut c = shared.core.borrow_mut();
        c.local_connected(conn, caller);
        // The client waits for this before its first request.
        let hello = c.local_hello(conn);
        shared.conns.deliver(conn, hello);
    }
    if lease {
        let slot = shared.shm.as_ref().and_then(|s| s.borrow_mut().lease(conn));
        shared.conns.deliver(conn, &lease_answer(slot));
    }
    // SAFETY: each descriptor is owned (accepted, or duplicated above) and
    // handed to exactly one stream.
    let reader = unsafe { UnixStream::from_raw_fd(fd.into_raw_fd()) };
    let mut writer = unsafe { UnixStream::from_raw_fd(write_fd.into_raw_fd()) };
    glommio::spawn_local(async move {
        while let Some(bytes) = rx.recv().await {
            if writer.write_all(&bytes).await.is_err() {
                break;
            }
            queued.set(queued.get().saturating_sub(bytes.len()));
        }
    })
    .detach();
    let shared = shared.clone();
    glommio::spawn_local(async move {
        serve(conn, reader, &shared).await;
        // Dropping the sender ends the writer once it wrote what is queued.
        shared.conns.senders.borrow_mut().remove(&conn);
        let mut c = shared.core.borrow_mut();
        c.local_closed(conn);
        if let Some(s) = &shared.shm {
            // Its slot goes back, and the units taken through it.
            for slot in s.borrow_mut().end_leases(conn) {
                c.release_client(client_key(slot_peer(slot)));
            }
        }
    })
    .detach();
}

/// Reads frames until the connection ends (or sends something that is no
/// frame), each handled as a request from the connection's peer address.
async fn serve(conn: u32, mut reader: UnixStream, shared: &Shared) {
    let peer = local_peer(conn);
    let mut frames = FrameDecoder::new(Limits::UDP.max_len);
    let mut chunk = vec![0u8; 4096];
    loop {
        let n = match reader.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        frames.feed(&chunk[..n]);
        let mut c = shared.core.borrow_mut();
        let now = clock::now_ms();
        loop {
            match frames.next_frame() {
                Ok(Some(frame)) if frame == RING_MAGIC => {
                    if let Some(b) = &shared.bell {
                        // A full buffer already holds a doorbell.
                        let _ = b.send(&[]);
                    }
                }
                Ok(Some(frame)) => {
                    if let Some(answer) = c.handle_queued(frame, peer, now, None) {
                        if !shared.conns.deliver(conn, answer) {
                            c.metrics.send_errors += 1;
                        }
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    c.metrics.count_malformed(&DecodeError::Oversized {
                        len: Limits::UDP.max_len + 1,
                        max: Limits::UDP.max_len,
                    });
                    return;
                }
            }
        }
        if !c.outbox.is_empty() {
            offer(&mut c, &shared.to_control, now);
        }
        shared.timer.nudge(&c);
    }
}
