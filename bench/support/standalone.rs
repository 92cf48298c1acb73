//! What the experiments through the real agent share (`bench/dagor.rs`,
//! `bench/policies.rs`): an embedded route server, reporter and agent
//! (`Standalone`, every port picked by the OS) on a scratch store the
//! bench fills first, and a wait for the agent's first pull of a route.
//! Include it with `#[path = "support/standalone.rs"] mod standalone;`.

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use lbagent::model::ModuleId;
use lbagent::standalone::{Standalone, StandaloneOptions};
use lbagent::store::{self, Store, StoreUrl};
use lbagent::wire::{decode, Encoder, Limits, Message, RetCode};

/// Runs a standalone system in a scratch directory named for `bench`
/// whose store `fill` sets up first, while `f` drives it with the address
/// of the shard that serves `module` (once that shard answers a getHost
/// for it); then stops it and removes the directory.
pub fn with_agent<R>(
    bench: &str,
    module: ModuleId,
    fill: impl FnOnce(&mut dyn Store),
    f: impl FnOnce(SocketAddr) -> R,
) -> R {
    let dir = std::env::temp_dir().join(format!("lbagent-{bench}-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    let url = StoreUrl::Sqlite(dir.join(lbagent::standalone::STORE_FILE));
    let mut s = store::open(&url).expect("the store");
    fill(s.as_mut());
    drop(s);
    let system = Standalone::start(StandaloneOptions::ephemeral(&dir)).expect("standalone agent");
    let ports = system.agent_ports().to_vec();
    let port = ports[module.shard(ports.len() as u32) as usize];
    let agent = SocketAddr::from(([127, 0, 0, 1], port));
    wait_for_route(agent, module);
    let r = f(agent);
    system.stop().expect("stop the standalone agent");
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// Asks the agent for a host of `module` until its first pull of the route
/// is answered (10 s at most).
fn wait_for_route(agent: SocketAddr, module: ModuleId) {
    let socket = UdpSocket::bind("127.0.0.1:0").expect("bind");
    socket
        .set_read_timeout(Some(Duration::from_millis(50)))
        .expect("timeout");
    let mut enc = Encoder::new();
    let mut buf = vec![0u8; 65_536];
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        let _ = socket.send_to(enc.get_host_req(1, module, 1, 1), agent);
        if let Ok(n) = socket.recv(&mut buf) {
            if let Ok(Message::GetHostResp(r)) = decode(&buf[..n], &Limits::UDP) {
                if r.retcode() == RetCode::Ok {
                    return;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the agent at {agent} found no route for {module} within 10 s");
}
