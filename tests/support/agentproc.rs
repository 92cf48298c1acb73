//! The real agent binary as a child process, for the end-to-end tests of
//! the agent (tests/agent.rs), of the client library (tests/client.rs) and
//! of the shared-memory transport (tests/shm.rs). Include it after
//! `common.rs`:
//! `#[path = "support/agentproc.rs"] mod agentproc;`.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::RwLockReadGuard;
use std::time::{Duration, Instant};

use lbagent::client::{Client, ClientOptions};
use lbagent::host::heartbeat::HeartbeatReader;
use lbagent::host::snapshot;
use lbagent::model::ModuleId;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::common::{addr_after, http_get, spawn_logged, wait_for, wait_logged};

/// A running agent: its directory (heartbeat, snapshot, config, its
/// stderr in `agent.stderr`), its first shard's port, its metrics address,
/// and whether it offers shared-memory regions.
pub struct AgentProc {
    pub child: Option<Child>,
    pub dir: PathBuf,
    config: PathBuf,
    /// Shard 0's UDP port (shard k's is `port + k`), as the heartbeat says.
    pub port: u16,
    pub metrics: SocketAddr,
    shm: bool,
    /// Held while the agent lives, let go after it is killed (a test file
    /// that runs one test alone hands its other agents a read turn here).
    pub turn: Option<RwLockReadGuard<'static, ()>>,
}

impl AgentProc {
    /// The config file: on 127.0.0.1 (`base_port = 0`), snapshot every
    /// second, heartbeat and snapshot in `dir`; `lb` and `agent` are extra
    /// lines for those tables (`agent` may go on with further tables).
    pub fn config_text(
        dir: &Path,
        route_server: SocketAddr,
        reporter: &str,
        shards: u32,
        metrics: SocketAddr,
        (lb, agent): (&str, &str),
    ) -> String {
        format!(
            "[lb]\n{lb}\n[agent]\nbase_port = 0\nshards = {shards}\nroute_servers = [\"{route_server}\"]\nreporters = [\"{reporter}\"]\n\
             heartbeat_path = \"{}\"\nsnapshot_path = \"{}\"\nsnapshot_interval = 1\nmetrics_addr = \"{metrics}\"\n{agent}\n",
            dir.join("heartbeat").display(),
            dir.join("routes.snapshot").display()
        )
    }

    /// An agent with `shards` shards pulling from `route_server`, reporting
    /// nowhere, writing its snapshot every second; `extra` is appended to
    /// the config (e.g. a `[shm]` table: then start also waits for the
    /// heartbeat to offer the regions).
    pub fn start(dir: &Path, route_server: SocketAddr, shards: u32, extra: &str) -> AgentProc {
        Self::start_with(dir, route_server, "127.0.0.1:1", shards, ("", extra), None)
    }

    /// [`AgentProc::start`] reporting to `reporter`, with extra lines for
    /// the `[lb]` and `[agent]` tables ([`AgentProc::config_text`]), holding
    /// `turn` until the agent is killed.
    pub fn start_with(
        dir: &Path,
        route_server: SocketAddr,
        reporter: &str,
        shards: u32,
        extra: (&str, &str),
        turn: Option<RwLockReadGuard<'static, ()>>,
    ) -> AgentProc {
        let config = dir.join("lbagent.toml");
        // Port 0: the agent binds a free port and says which in its log (a
        // port picked here and bound there later could be taken between by
        // another test).
        let metrics = SocketAddr::from(([127, 0, 0, 1], 0));
        let text = Self::config_text(dir, route_server, reporter, shards, metrics, extra);
        std::fs::write(&config, text).unwrap();
        let mut a = AgentProc {
            child: None,
            dir: dir.to_path_buf(),
            config,
            port: 0,
            metrics,
            shm: extra.1.contains("[shm]"),
            turn,
        };
        a.spawn();
        a
    }

    /// Starts the binary and waits until it beats in the heartbeat file
    /// (reused in place across restarts, as in production), and offers its
    /// regions when it has any, and (from its log) where its metrics are.
    /// Its stderr goes to `agent.stderr` in the directory (for tests that
    /// read the log), and to the test's too with `LBAGENT_TEST_STDERR` set.
    pub fn spawn(&mut self) {
        let log = self.dir.join("agent.stderr");
        let child = spawn_logged(
            Command::new(env!("CARGO_BIN_EXE_lbagent"))
                .args(["agent", "--config", self.config.to_str().unwrap()])
                .stdout(Stdio::null()),
            &log,
        )
        .expect("start lbagent agent");
        let pid = child.id();
        self.child = Some(child);
        let port = wait_for(Duration::from_secs(20), || {
            let r = HeartbeatReader::open(&self.heartbeat_path()).ok()?;
            let h = r.read().ok()?;
            let offered = !self.shm || r.shm_prefix().ok()?.is_some();
            (h.info.pid == pid && h.beat_unix_ms > 0 && offered).then_some(h.info.base_port)
        })
        .expect("the agent beats (and offers its regions) within 20 s");
        self.port = port;
        let child = self.child.as_mut().expect("just started");
        self.metrics = wait_logged(child, &log, Duration::from_secs(20), |l| {
            addr_after(l, "metrics on http://")
        })
        .unwrap_or_else(|e| panic!("the agent logs its metrics address within 20 s: {e}"));
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
        let sig = Signal::try_from(sig).expect("a signal number");
        assert_eq!(kill(Pid::from_raw(self.pid()), sig), Ok(()));
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then waits for the process to exit (bounded).
    pub fn stop(&mut self) {
        self.sigterm();
    }

    /// SIGTERM, then waits for the process to exit (at most 10 s): its
    /// exit code and how long it took.
    pub fn sigterm(&mut self) -> (Option<i32>, Duration) {
        let mut c = self.child.take().expect("running");
        let t0 = Instant::now();
        assert_eq!(kill(Pid::from_raw(c.id() as i32), Signal::SIGTERM), Ok(()));
        let status =
            wait_for(Duration::from_secs(10), || c.try_wait().unwrap()).expect("the agent stops");
        (status.code(), t0.elapsed())
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
            let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGCONT);
        }
        self.kill9();
    }
}
