//! What the route client's and the statistics client's glommio shells
//! share: racing two futures, waiting for
//! whichever of shutdown / an input item / readable bytes / a deadline
//! comes first, and taking what a local channel already holds.
//!
//! Owns no protocol: each client's sans-IO core decides what to send and
//! when; this file only waits.

use std::future::{poll_fn, Future};
use std::io;
use std::pin::{pin, Pin};
use std::task::Poll;
use std::time::Duration;

use futures_lite::{AsyncRead, AsyncReadExt};
use glommio::channels::local_channel::LocalReceiver;

/// The io_uring submission depth of an executor that holds thousands of
/// connections (the route server's and the reporter's; glommio's default
/// is 128).
///
/// The kernel sizes a ring's table of pending polls from its completion
/// queue (2 x this depth): 2^(log2(entries) - 5) buckets, from 2 to 256. At
/// glommio's default that is 8 buckets, and every cancellation the
/// executor issues (its preemption timers' at each sleep, a dropped read)
/// walks one: with 5,000 connections, each holding a poll for readable
/// bytes, 625 requests a walk. perf put a quarter of a reporter's CPU in
/// that walk (`io_poll_find`) at 5,000 simulated agents. 4,096 gives the
/// most buckets the kernel makes (256); the rings take about 1 MiB,
/// charged to the process's memory, not to `ulimit -l`.
pub const RING_DEPTH: usize = 4096;

/// Which of two raced futures completed.
pub enum Either<A, B> {
    /// The first future completed.
    Left(A),
    /// The second future completed.
    Right(B),
}

/// The first of `a` and `b` to complete (`a` when both are ready).
pub async fn race<A: Future, B: Future>(a: A, b: B) -> Either<A::Output, B::Output> {
    let (mut a, mut b) = (pin!(a), pin!(b));
    poll_fn(|cx| {
        if let Poll::Ready(x) = a.as_mut().poll(cx) {
            return Poll::Ready(Either::Left(x));
        }
        b.as_mut().poll(cx).map(Either::Right)
    })
    .await
}

/// What woke a [`wait`].
pub enum Woken<T> {
    /// The shutdown future completed.
    Shutdown,
    /// An input item, or `None`: the input channel is closed.
    Input(Option<T>),
    /// Bytes were read into the buffer (or the read failed).
    Read(io::Result<usize>),
    /// The deadline passed.
    Timer,
}

/// Waits for shutdown, an item on `input` (when given), bytes read from
/// `stream` (a TCP or TLS stream) into its buffer (when given), or `deadline` (None: no deadline),
/// checked in that order when several are ready. Every branch is
/// cancel-safe: glommio reads only when the socket is ready, into the
/// buffer, on completion; a channel item is taken only when it is returned.
pub async fn wait<T, S: AsyncRead + Unpin>(
    shutdown: Pin<&mut impl Future<Output = ()>>,
    input: Option<&LocalReceiver<T>>,
    stream: Option<(&mut S, &mut [u8])>,
    deadline: Option<Duration>,
) -> Woken<T> {
    let timer = async move {
        match deadline {
            Some(d) if d.is_zero() => {}
            Some(d) => glommio::timer::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    let item = async move {
        match input {
            Some(input) => input.recv().await,
            None => std::future::pending().await,
        }
    };
    let readable = async move {
        match stream {
            Some((stream, buf)) => stream.read(buf).await,
            None => std::future::pending().await,
        }
    };
    let (mut shutdown, mut item, mut readable, mut timer) =
        (shutdown, pin!(item), pin!(readable), pin!(timer));
    poll_fn(|cx| {
        if shutdown.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Woken::Shutdown);
        }
        if let Poll::Ready(r) = readable.as_mut().poll(cx) {
            return Poll::Ready(Woken::Read(r));
        }
        if let Poll::Ready(i) = item.as_mut().poll(cx) {
            return Poll::Ready(Woken::Input(i));
        }
        timer.as_mut().poll(cx).map(|()| Woken::Timer)
    })
    .await
}

/// Takes one item `rx` already holds, without waiting: `Some(Some(item))`,
/// `Some(None)` when the channel is closed, `None` when it is empty.
pub async fn try_recv<T>(rx: &LocalReceiver<T>) -> Option<Option<T>> {
    poll_fn(|cx| {
        let recv = pin!(rx.recv());
        Poll::Ready(match recv.poll(cx) {
            Poll::Ready(item) => Some(item),
            Poll::Pending => None,
        })
    })
    .await
}
