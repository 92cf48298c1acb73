//! A UDP client of one agent shard that speaks the wire format directly
//! (no client library: these tests check the agent itself). Every wait is
//! bounded by time: a request is sent again every 500 ms (or `per_try`)
//! until it is answered or [`PATIENCE`] has passed (at least three sends).
//! Include it with
//! `#[path = "support/udpclient.rs"] mod udpclient;` beside
//! `support/common.rs` as `mod common`.
#![allow(dead_code)]

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use lbagent::model::{ModuleId, NodeAddr};
use lbagent::wire::{decode, Encoder, Limits, Message, Report, RetCode};

// The including test crate has `#[path = "support/common.rs"] mod common;`.
use super::common::wait_for;

/// How long a request is sent again before it counts as unanswered: a
/// freshly started agent on a loaded machine (a debug build among parallel
/// tests and builds) can be off its cores for more than a second.
pub const PATIENCE: Duration = Duration::from_secs(5);

/// One socket talking to one shard.
pub struct Client {
    sock: UdpSocket,
    to: SocketAddr,
    enc: Encoder,
    seq: u32,
    per_try: Duration,
}

impl Client {
    /// A client of the shard on `127.0.0.1:port`.
    pub fn new(port: u16) -> Client {
        Self::patient(port, Duration::from_millis(500))
    }

    /// A client that waits `per_try` before it sends a request again (at
    /// least three tries, [`PATIENCE`] in all).
    pub fn patient(port: u16, per_try: Duration) -> Client {
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        sock.set_read_timeout(Some(per_try)).unwrap();
        Client {
            sock,
            to: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
            enc: Encoder::new(),
            seq: 0,
            per_try,
        }
    }

    /// Sends the request `build` makes (with the next sequence number) until
    /// it is answered (see [`PATIENCE`]) and returns the answer that echoes
    /// it.
    pub fn ask(&mut self, build: impl FnOnce(&mut Encoder, u32) -> Vec<u8>) -> Vec<u8> {
        let seq = self.seq + 1;
        self.try_ask(build)
            .unwrap_or_else(|| panic!("no answer to request {seq}"))
    }

    /// As [`Client::ask`], but `None` when the request goes unanswered
    /// (an agent still draining a flood, say).
    pub fn try_ask(&mut self, build: impl FnOnce(&mut Encoder, u32) -> Vec<u8>) -> Option<Vec<u8>> {
        self.seq += 1;
        let seq = self.seq;
        let req = build(&mut self.enc, seq);
        let t0 = Instant::now();
        let patience = PATIENCE.max(self.per_try * 3);
        let mut buf = vec![0u8; 65536];
        while t0.elapsed() < patience {
            self.sock.send_to(&req, self.to).unwrap();
            while let Ok((n, _)) = self.sock.recv_from(&mut buf) {
                let answer = buf[..n].to_vec();
                let s = match decode(&answer, &Limits::UDP).unwrap() {
                    Message::GetHostResp(r) => u64::from(r.seq()),
                    Message::GetRouteResp(r) => u64::from(r.seq()),
                    Message::RegisterResp(r) => u64::from(r.seq()),
                    Message::ErrorResp(r) => r.seq(),
                    other => panic!("unexpected answer {}", other.name()),
                };
                if s == u64::from(seq) {
                    return Some(answer);
                }
            }
        }
        None
    }

    /// One getHost: the retcode and the host when there is one.
    pub fn get_host(&mut self, m: ModuleId) -> (RetCode, Option<NodeAddr>) {
        let seq = self.seq + 1;
        self.try_get_host(m)
            .unwrap_or_else(|| panic!("no answer to request {seq}"))
    }

    /// As [`Client::get_host`], but `None` when it goes unanswered.
    pub fn try_get_host(&mut self, m: ModuleId) -> Option<(RetCode, Option<NodeAddr>)> {
        let a = self.try_ask(|e, seq| e.get_host_req(seq, m, 0, 0).to_vec())?;
        Some(match decode(&a, &Limits::UDP).unwrap() {
            Message::GetHostResp(r) => (r.retcode(), r.host().map(NodeAddr::from)),
            Message::ErrorResp(r) => (r.retcode(), None),
            _ => unreachable!(),
        })
    }

    /// One report (no answer is expected).
    pub fn report(&mut self, m: ModuleId, host: NodeAddr, retcode: i32) {
        let req = self.enc.report_req(&Report {
            seq: 0,
            module: m,
            host,
            retcode,
            tcost_ms: 0,
            downstream_level: None,
            consumed: 0,
        });
        self.sock.send_to(req, self.to).unwrap();
    }

    /// (overloaded, vsucc, verr) per node, in route order.
    /// The agent's view of the module: retcode, version, nodes.
    pub fn get_route(&mut self, m: ModuleId) -> (RetCode, u64, Vec<NodeView>) {
        let a = self.ask(|e, seq| e.get_route_req(seq, m).to_vec());
        let Message::GetRouteResp(r) = decode(&a, &Limits::UDP).unwrap() else {
            panic!()
        };
        let nodes = r
            .nodes()
            .map(|v| {
                v.iter()
                    .map(|n| {
                        (
                            NodeAddr::from(n.host().unwrap()),
                            n.overloaded(),
                            n.vsucc(),
                            n.verr(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        (r.retcode(), r.version(), nodes)
    }

    /// Waits (5 s at most) until a getHost returns a host; then the
    /// route's nodes in order.
    pub fn wait_route(&mut self, m: ModuleId) -> Vec<NodeAddr> {
        wait_for(Duration::from_secs(5), || match self.get_host(m) {
            (RetCode::Ok, Some(_)) => Some(()),
            _ => None,
        })
        .expect("the route arrives within 5 s");
        self.get_route(m).2.iter().map(|n| n.0).collect()
    }
}

/// A node as getRoute shows it: address, overloaded, vsucc, verr.
pub type NodeView = (NodeAddr, bool, u32, u32);
