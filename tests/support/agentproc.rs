//! The real agent binary as a child process, for the end-to-end tests of
//! the client library (tests/client.rs) and of the shared-memory transport
//! (tests/shm.rs). Include it after `common.rs`:
//! `#[path = "support/agentproc.rs"] mod agentproc;`.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use lbagent::agent::heartbeat::HeartbeatReader;
use lbagent::agent::snapshot;
use lbagent::client::{Client, ClientOptions};
use lbagent::model::ModuleId;

use super::common::{free_tcp_port, http_get, wait_for};

/// A running agent: its directory (heartbeat, snapshot, config), its
/// metrics address, and whether it offers shared-memory regions.
pub struct AgentProc {
    pub child: Option<Child>,
    pub dir: PathBuf,
    config: PathBuf,
    pub metrics: SocketAddr,
    shm: bool,
}

impl AgentProc {
    /// An agent with `shards` shards pulling from `route_server`, reporting
    /// nowhere, writing its snapshot every second; `extra` is appended to
    /// the config (e.g. a `[shm]` table: then start also waits for the
    /// heartbeat to offer the regions).
    pub fn start(dir: &Path, route_server: SocketAddr, shards: u32, extra: &str) -> AgentProc {
        let config = dir.join("lbagent.toml");
        let metrics = SocketAddr::from(([127, 0, 0, 1], free_tcp_port()));
        let text = format!(
            "[agent]\nbase_port = 0\nshards = {shards}\nroute_servers = [\"{route_server}\"]\n\
             reporters = [\"127.0.0.1:1\"]\nheartbeat_path = \"{}\"\nsnapshot_path = \"{}\"\n\
             snapshot_interval = 1\nmetrics_addr = \"{metrics}\"\n{extra}",
            dir.join("heartbeat").display(),
            dir.join("routes.snapshot").display(),
        );
        std::fs::write(&config, text).unwrap();
        let mut a = AgentProc {
            child: None,
            dir: dir.to_path_buf(),
            config,
            metrics,
            shm: extra.contains("[shm]"),
        };
        a.spawn();
        a
    }

    /// Starts the binary and waits until it beats in the heartbeat file
    /// (reused in place across restarts, as in production), and offers its
    /// regions when it has any.
    pub fn spawn(&mut self) {
        let child = Command::new(env!("CARGO_BIN_EXE_lbagent"))
            .args(["agent", "--config", self.config.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(if std::env::var_os("LBAGENT_TEST_STDERR").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .spawn()
            .expect("start lbagent agent");
        let pid = child.id();
        self.child = Some(child);
        wait_for(Duration::from_secs(20), || {
            let r = HeartbeatReader::open(&self.heartbeat_path()).ok()?;
            let h = r.read().ok()?;
            let offered = !self.shm || r.shm_prefix().ok()?.is_some();
            (h.info.pid == pid && h.beat_unix_ms > 0 && offered).then_some(())
        })
        .expect("the agent beats (and offers its regions) within 20 s");
    }

    pub fn heartbeat_path(&self) -> PathBuf {
        self.dir.join("heartbeat")
    }

    pub fn snapshot_path(&self) -> PathBuf {
        self.dir.join("routes.snapshot")
    }

    /// Options that find this agent; the default static route file points
    /// nowhere, so a static answer proves the header's path was used.
    pub fn options(&self) -> ClientOptions {
        ClientOptions {
            heartbeat_path: self.heartbeat_path(),
            snapshot_path: self.dir.join("not-the-snapshot"),
            ..ClientOptions::default()
        }
    }

    pub fn client(&self) -> Client {
        Client::with_options(self.options()).unwrap()
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }

    pub fn signal(&self, sig: i32) {
        assert_eq!(unsafe { libc::kill(self.pid(), sig) }, 0);
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then waits for the process to exit (bounded).
    pub fn stop(&mut self) {
        self.signal(libc::SIGTERM);
        let mut c = self.child.take().unwrap();
        wait_for(Duration::from_secs(10), || c.try_wait().unwrap()).expect("the agent stops");
    }

    /// The region file of `shard`, as the heartbeat names it.
    pub fn region_path(&self, shard: u32) -> PathBuf {
        let prefix = HeartbeatReader::open(&self.heartbeat_path())
            .unwrap()
            .shm_prefix()
            .unwrap()
            .expect("regions offered");
        lbagent::shm::region_path(&prefix, shard)
    }

    /// One counter of `/metrics`, summed over its labels.
    pub fn metric(&self, name: &str) -> Option<f64> {
        let text = http_get(self.metrics, "/metrics")?;
        let mut sum = None;
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(name) else {
                continue;
            };
            if !(rest.starts_with('{') || rest.starts_with(' ')) {
                continue;
            }
            let v: f64 = rest.rsplit(' ').next()?.parse().ok()?;
            sum = Some(sum.unwrap_or(0.0) + v);
        }
        sum
    }

    /// Waits until the snapshot file holds `module`.
    pub fn wait_snapshot(&self, module: ModuleId) {
        wait_for(Duration::from_secs(5), || {
            snapshot::read(&self.snapshot_path())
                .ok()?
                .route(module)
                .map(|_| ())
        })
        .expect("the snapshot holds the module within 5 s");
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        if let Some(c) = &self.child {
            // A stopped process must be resumed to die on SIGKILL promptly.
            unsafe { libc::kill(c.id() as i32, libc::SIGCONT) };
        }
        self.kill9();
    }
}
