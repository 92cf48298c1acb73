//! The route cache's per-call path allocates nothing: a counting global
//! allocator (per thread) around many cached getHost + report pairs, with a
//! real heartbeat and a fake agent on loopback that fills the cache.
//!
//! The window counted is retried (a few times, bounded) when any datagram
//! reached the agent during it: a refresh or a batch due after 2 s is not
//! the per-call path, and a slow machine may cross such a boundary.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::net::{Ipv4Addr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lbagent::client::{Client, ClientOptions, HostSource};
use lbagent::host::heartbeat::{AgentInfo, HeartbeatWriter};
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::wire::{decode, CacheRoute, Encoder, Limits, Message, RetCode};

/// Counts the allocations (and reallocations) of the calling thread.
struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // `try_with`: no panic while the thread is being torn down.
    let _ = ALLOCS.try_with(|n| n.set(n.get() + 1));
}

// SAFETY: every call goes to the system allocator unchanged; the counter is
// a const-initialised thread-local Cell, which does not allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCS.with(Cell::get)
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

const M: ModuleId = ModuleId::new(77, 1);
const PAIRS: u32 = 20_000;

#[test]
fn cached_get_host_and_report_allocate_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(20)))
        .unwrap();
    let port = sock.local_addr().unwrap().port();
    let hb_path = dir.path().join("hb");
    let hb = HeartbeatWriter::create(
        &hb_path,
        &AgentInfo {
            shards: 1,
            base_port: port,
            bind: Ipv4Addr::LOCALHOST,
            pid: 1,
            snapshot_path: dir.path().join("snapshot"),
        },
    )
    .unwrap();
    hb.beat(unix_ms());
    let received = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (r, s) = (received.clone(), stop.clone());
    let agent = std::thread::spawn(move || {
        let route: Vec<RouteNode> = (1..=10)
            .map(|i| RouteNode {
                addr: NodeAddr::new(Ipv4Addr::new(10, 7, 0, i), 80),
                weight: 1,
            })
            .collect();
        let mut enc = Encoder::new();
        let mut buf = vec![0u8; 65_536];
        while !s.load(Ordering::Relaxed) {
            let Ok((n, peer)) = sock.recv_from(&mut buf) else {
                continue;
            };
            r.fetch_add(1, Ordering::SeqCst);
            if let Ok(Message::CacheGetRouteReq(q)) = decode(&buf[..n], &Limits::UDP) {
                let unchanged = q.known_version() == 1;
                let resp = CacheRoute {
                    seq: q.seq(),
                    module: ModuleId::new(q.modid(), q.cmdid()),
                    retcode: RetCode::Ok,
                    version: 1,
                    unchanged,
                    any_overloaded: false,
                    nodes: if unchanged { &[] } else { &route },
                };
                sock.send_to(enc.cache_get_route_resp(&resp), peer).unwrap();
            }
        }
    });

    let mut c = Client::with_options(ClientOptions {
        heartbeat_path: hb_path,
        cache: true,
        static_fallback: false,
        ..ClientOptions::default()
    })
    .unwrap();
    // Generous: the fake agent is a thread of this process, and a stall of
    // a busy machine must not time out the cache's refresh.
    let t = Duration::from_secs(5);
    let pair = |c: &mut Client| {
        let h = c.get_host(M.modid, M.cmdid, t).unwrap();
        assert_eq!(h.source, HostSource::Cache);
        c.report(M.modid, M.cmdid, h.addr, 0, 1).unwrap();
    };
    // Warm up: the route is fetched, every node has a success held.
    for _ in 0..100 {
        pair(&mut c);
    }
    let mut result = None;
    for _attempt in 0..5 {
        hb.beat(unix_ms());
        let before = received.load(Ordering::SeqCst);
        let a0 = allocations();
        for _ in 0..PAIRS {
            pair(&mut c);
        }
        let allocated = allocations() - a0;
        // A datagram sent in the window has reached the agent by now.
        std::thread::sleep(Duration::from_millis(50));
        if received.load(Ordering::SeqCst) == before {
            result = Some(allocated);
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    agent.join().unwrap();
    let allocated = result.expect("every window sent something to the agent: not the cached path");
    assert_eq!(
        allocated, 0,
        "{allocated} allocations in {PAIRS} cached getHost + report pairs"
    );
}
