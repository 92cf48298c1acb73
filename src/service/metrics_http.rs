//! The one HTTP exchange the metrics endpoints of the agent, the route
//! server and the reporter serve: read a request head, answer `GET
//! /metrics` with the Prometheus text and anything else with 404
//! ([`head_complete`], [`response`]: pure), and the bounds every endpoint
//! keeps: at most [`MAX_CONNECTIONS`] connections at once (one more is
//! answered 503 and closed), and [`REQUEST_TIMEOUT`] for a connection to
//! send its request and take its answer. [`serve_blocking`] is the
//! endpoint of a server that gives it a thread of its own; a glommio
//! server keeps the same bounds in its own shell.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags};

use crate::wakefd::{poll_timeout, StopEvent};

/// The longest request head read; a longer one is answered as it stands.
pub const MAX_REQUEST_HEAD: usize = 8192;

/// Most connections a metrics endpoint holds at once; one more is answered
/// [`BUSY_RESPONSE`] and closed, counted as refused.
pub const MAX_CONNECTIONS: usize = 32;

/// How long a connection may take to send its request and read the
/// answer; then it is closed, counted as timed out.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// What a connection past [`MAX_CONNECTIONS`] is told before it is closed.
pub const BUSY_RESPONSE: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 57\r\nConnection: close\r\n\r\ntoo many metrics connections open: try again in a moment\n";

/// What an endpoint refused, for its own metrics.
#[derive(Debug, Default)]
pub struct HttpCounters {
    /// Connections answered 503 because [`MAX_CONNECTIONS`] were open.
    pub refused: AtomicU64,
    /// Connections closed at [`REQUEST_TIMEOUT`] without a whole exchange.
    pub timed_out: AtomicU64,
}

impl HttpCounters {
    /// The connections refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// The connections timed out so far.
    pub fn timed_out(&self) -> u64 {
        self.timed_out.load(Ordering::Relaxed)
    }
}

/// Whether `req` holds a whole request head (or as much as will be read).
pub fn head_complete(req: &[u8]) -> bool {
    req.len() >= MAX_REQUEST_HEAD || req.windows(4).any(|w| w == b"\r\n\r\n")
}

/// The whole response to `req`: `GET /metrics` gets `body()` as
/// Prometheus text (version 0.0.4), anything else a 404 saying where the
/// metrics are. `body` runs only for a metrics request.
pub fn response(req: &[u8], body: impl FnOnce() -> String) -> String {
    if req.starts_with(b"GET /metrics ") || req.starts_with(b"GET /metrics?") {
        let body = body();
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    } else {
        let msg = "not found: the metrics are at GET /metrics\n";
        format!(
            "HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{msg}",
            msg.len()
        )
    }
}

/// One connection of [`serve_blocking`]: reading its head, then writing
/// its answer.
struct Exchange {
    stream: TcpStream,
    req: Vec<u8>,
    out: Vec<u8>,
    written: usize,
    deadline: Instant,
}

impl Exchange {
    /// Moves what the socket allows; true when the exchange is over.
    fn step(&mut self, body: &dyn Fn() -> String) -> bool {
        let mut buf = [0u8; 512];
        while self.out.is_empty() {
            match self.stream.read(&mut buf) {
                Ok(0) => return true,
                Ok(n) => {
                    self.req.extend_from_slice(&buf[..n]);
                    if head_complete(&self.req) {
                        self.out = response(&self.req, body).into_bytes();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return true,
            }
        }
        while self.written < self.out.len() {
            match self.stream.write(&self.out[self.written..]) {
                Ok(0) => return true,
                Ok(n) => self.written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return true,
            }
        }
        true
    }

    fn events(&self) -> PollFlags {
        if self.out.is_empty() {
            PollFlags::POLLIN
        } else {
            PollFlags::POLLOUT
        }
    }
}

/// Serves `GET /metrics` with `body()` on `listener` until `stop` is set,
/// on the calling thread: every connection is non-blocking and served as
/// its bytes come, so silent connections never delay another; at most
/// [`MAX_CONNECTIONS`] at once, each closed at [`REQUEST_TIMEOUT`].
/// Refusals and timeouts are counted in `counters`. The thread sleeps in
/// `poll` until a connection, a byte, the next request's deadline or the
/// stop (its descriptor is in the set): nothing wakes it while idle.
///
/// # Errors
/// When `listener` cannot be made non-blocking.
pub fn serve_blocking(
    listener: &TcpListener,
    stop: &StopEvent,
    counters: &HttpCounters,
    body: &dyn Fn() -> String,
) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let mut open: Vec<Exchange> = Vec::new();
    // Which open exchanges the last poll found ready (kept apart from the
    // poll set, which borrows their streams).
    let mut ready: Vec<bool> = Vec::new();
    while !stop.is_set() {
        let now = Instant::now();
        let wait = open
            .iter()
            .map(|x| x.deadline.saturating_duration_since(now))
            .min();
        let mut fds = Vec::with_capacity(open.len() + 2);
        fds.push(PollFd::new(stop.as_fd(), PollFlags::POLLIN));
        fds.push(PollFd::new(listener.as_fd(), PollFlags::POLLIN));
        fds.extend(
            open.iter()
                .map(|x| PollFd::new(x.stream.as_fd(), x.events())),
        );
        // An interrupted poll is one more turn; the stop, the deadlines and
        // the accept below are checked all the same.
        let _ = poll(&mut fds, poll_timeout(wait));
        ready.clear();
        // Any event at all (HUP and ERR too; bits nix does not know as well).
        ready.extend(fds[2..].iter().map(|f| f.any().unwrap_or(true)));
        drop(fds);
        let now = Instant::now();
        let mut turn = ready.iter();
        open.retain_mut(|x| {
            if *turn.next().unwrap_or(&false) && x.step(body) {
                return false;
            }
            if now >= x.deadline {
                counters.timed_out.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            true
        });
        accept_all(listener, &mut open, counters);
    }
    Ok(())
}

/// Accepts every connection waiting on `listener`: into `open` while
/// there is room, else answered 503 and closed.
fn accept_all(listener: &TcpListener, open: &mut Vec<Exchange>, counters: &HttpCounters) {
    loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // WouldBlock, or out of descriptors: try again on the next turn.
            Err(_) => return,
        };
        if stream.set_nonblocking(true).is_err() {
            continue;
        }
        if open.len() >= MAX_CONNECTIONS {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            let _ = (&stream).write(BUSY_RESPONSE);
            continue;
        }
        open.push(Exchange {
            stream,
            req: Vec::new(),
            out: Vec::new(),
            written: 0,
            deadline: Instant::now() + REQUEST_TIMEOUT,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn metrics_get_the_text_and_other_paths_a_404() {
        let ok = response(b"GET /metrics HTTP/1.1\r\n\r\n", || "a 1\n".into());
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.ends_with("Content-Length: 4\r\nConnection: close\r\n\r\na 1\n"));
        assert!(response(b"GET /metrics?x=1 HTTP/1.1\r\n\r\n", String::new).contains("200 OK"));
        let nf = response(b"GET /other HTTP/1.1\r\n\r\n", || unreachable!());
        assert!(nf.starts_with("HTTP/1.1 404 Not Found\r\n"), "{nf}");
        assert!(response(b"POST /metrics HTTP/1.1\r\n\r\n", String::new).contains("404"));
    }

    #[test]
    fn a_head_is_complete_at_its_blank_line_or_at_the_bound() {
        assert!(!head_complete(b"GET /metrics HTTP/1.1\r\n"));
        assert!(head_complete(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"));
        assert!(head_complete(&[b'a'; MAX_REQUEST_HEAD]));
    }

    #[test]
    fn the_busy_response_says_its_length_right() {
        let text = std::str::from_utf8(BUSY_RESPONSE).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.contains(&format!("Content-Length: {}", body.len())),
            "{text}"
        );
    }

    /// Starts [`serve_blocking`] on a free port; returns its address, the
    /// stop flag, the counters and the thread.
    fn endpoint() -> (
        std::net::SocketAddr,
        Arc<StopEvent>,
        Arc<HttpCounters>,
        std::thread::JoinHandle<()>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(StopEvent::new().unwrap());
        let counters = Arc::new(HttpCounters::default());
        let (s, c) = (stop.clone(), counters.clone());
        let h = std::thread::spawn(move || {
            serve_blocking(&listener, &s, &c, &|| "up 1\n".to_string()).unwrap()
        });
        (addr, stop, counters, h)
    }

    fn scrape(addr: std::net::SocketAddr) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        text
    }

    #[test]
    fn silent_connections_do_not_delay_a_scrape_and_time_out() {
        let (addr, stop, counters, h) = endpoint();
        let silent: Vec<TcpStream> = (0..10).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let t0 = Instant::now();
        let text = scrape(addr);
        let took = t0.elapsed();
        assert!(text.ends_with("up 1\n"), "{text}");
        // The scrape is served beside the silent ones, not after their
        // timeouts (10 x 2 s in turn): well under one timeout.
        assert!(took < REQUEST_TIMEOUT, "the scrape took {took:?}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while counters.timed_out() < 10 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(counters.timed_out(), 10);
        drop(silent);
        stop.set();
        h.join().unwrap();
    }

    #[test]
    fn connections_past_the_bound_are_refused_with_503() {
        let (addr, stop, counters, h) = endpoint();
        let held: Vec<TcpStream> = (0..MAX_CONNECTIONS)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        // Accepted in order: the next is the one past the bound.
        // The next one is told why and closed (it reads before it sends:
        // a request left unread at the close would turn it into a reset).
        let mut next = TcpStream::connect(addr).unwrap();
        next.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut text = String::new();
        next.read_to_string(&mut text).unwrap();
        assert!(text.starts_with("HTTP/1.1 503"), "{text}");
        assert!(counters.refused() >= 1);
        drop(held);
        stop.set();
        h.join().unwrap();
    }
}
