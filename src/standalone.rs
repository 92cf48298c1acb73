//! Standalone: the route server, the reporter and the agent in one process,
//! on the embedded SQLite store in a data directory (default
//! `./lbagent-data`), created on first run.
//!
//! This is what a newcomer runs first (`lbagent standalone`), and what
//! `lbagent qpstest --standalone` starts to benchmark the whole system. The
//! three parts are the same code as `lbagent dnsserver`, `lbagent reporter`
//! and `lbagent agent`; this module only wires them: the store URL from the
//! data directory, the agent's route server and reporter from the addresses
//! the servers actually bound (port 0 works), the static route file inside
//! the data directory. It starts them in dependency order and stops them in
//! reverse.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::agent::runtime::Agent;
use crate::config::Config;
use crate::dnsserver::DnsServer;
use crate::reporter::Reporter;
use crate::store::{self, StoreUrl};

/// The store file inside the data directory.
pub const STORE_FILE: &str = "lbagent.db";
/// The static route file inside the data directory.
pub const SNAPSHOT_FILE: &str = "routes.snapshot";

/// What to start.
#[derive(Clone, Debug)]
pub struct StandaloneOptions {
    /// The data directory: the store and the static route file live here.
    pub data_dir: PathBuf,
    /// The configuration of the three parts. `store.url` and
    /// `agent.snapshot_path` are replaced by files in `data_dir`;
    /// `agent.route_servers` and `agent.reporters` by the addresses the
    /// route server and the reporter bound.
    pub config: Config,
}

impl StandaloneOptions {
    /// The defaults for a standalone system in `data_dir`: every listener
    /// on loopback (route server 7777, reporter 7778, agent 8888..).
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        let mut config = Config::default();
        config.dnsserver.listen = SocketAddr::from((Ipv4Addr::LOCALHOST, 7777));
        config.reporter.listen = SocketAddr::from((Ipv4Addr::LOCALHOST, 7778));
        StandaloneOptions {
            data_dir: data_dir.into(),
            config,
        }
    }

    /// A private system for a test or a benchmark: every port picked by
    /// the OS, the heartbeat file inside `data_dir`, so that it disturbs
    /// nothing else on the host (an agent already running included).
    pub fn ephemeral(data_dir: impl Into<PathBuf>) -> Self {
        let mut o = Self::new(data_dir);
        let any = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let c = &mut o.config;
        c.dnsserver.listen = any;
        c.dnsserver.metrics_addr = any;
        c.reporter.listen = any;
        c.reporter.metrics_addr = any;
        c.agent.base_port = 0;
        c.agent.metrics_addr = any;
        c.agent.heartbeat_path = absolute(&o.data_dir).join("heartbeat");
        o
    }
}

/// A running standalone system.
pub struct Standalone {
    agent: Option<Agent>,
    reporter: Option<Reporter>,
    dnsserver: Option<DnsServer>,
    store_url: StoreUrl,
    config: Config,
}

impl Standalone {
    /// Creates the data directory and the store (with its schema) when
    /// missing, then starts the route server, the reporter and the agent.
    ///
    /// # Errors
    /// The data directory or the store cannot be created, or a part
    /// cannot start (a port in use, `ulimit -l` too small); the message
    /// names which.
    pub fn start(opts: StandaloneOptions) -> anyhow::Result<Standalone> {
        let data = absolute(&opts.data_dir);
        std::fs::create_dir_all(&data)
            .with_context(|| format!("cannot create the data directory {}", data.display()))?;
        let store_url = StoreUrl::Sqlite(data.join(STORE_FILE));
        store::open(&store_url).with_context(|| format!("cannot open the store {store_url}"))?;

        let mut config = opts.config;
        config.store.url = store_url.to_string();
        config.agent.snapshot_path = data.join(SNAPSHOT_FILE);
        config
            .validate()
            .context("the standalone configuration is invalid")?;

        let dnsserver = DnsServer::start(&config.dnsserver, store_url.clone())
            .context("cannot start the route server")?;
        let reporter = match Reporter::start(&config.reporter, store_url.clone()) {
            Ok(r) => r,
            Err(e) => {
                let _ = dnsserver.stop();
                return Err(e.context("cannot start the reporter"));
            }
        };
        config.agent.route_servers = vec![dnsserver.addr().to_string()];
        config.agent.reporters = vec![reporter.addr().to_string()];
        let agent = match Agent::start(&config) {
            Ok(a) => a,
            Err(e) => {
                let _ = reporter.stop();
                let _ = dnsserver.stop();
                return Err(e.context("cannot start the agent"));
            }
        };
        Ok(Standalone {
            agent: Some(agent),
            reporter: Some(reporter),
            dnsserver: Some(dnsserver),
            store_url,
            config,
        })
    }

    /// The store, for `lbagent route --store`.
    pub fn store_url(&self) -> &StoreUrl {
        &self.store_url
    }

    /// The heartbeat file the client library reads to find the agent.
    pub fn heartbeat_path(&self) -> &Path {
        &self.config.agent.heartbeat_path
    }

    /// The configuration in effect (ports as configured; see the
    /// accessors for the bound ones).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The route server's bound address.
    pub fn dnsserver_addr(&self) -> SocketAddr {
        self.dnsserver.as_ref().expect("running").addr()
    }

    /// The reporter's bound address.
    pub fn reporter_addr(&self) -> SocketAddr {
        self.reporter.as_ref().expect("running").addr()
    }

    /// The agent's UDP ports, shard by shard.
    pub fn agent_ports(&self) -> &[u16] {
        self.agent.as_ref().expect("running").ports()
    }

    /// The metrics endpoints: agent, route server, reporter.
    pub fn metrics_addrs(&self) -> [SocketAddr; 3] {
        [
            self.agent.as_ref().expect("running").metrics_addr(),
            self.dnsserver.as_ref().expect("running").metrics_addr(),
            self.reporter.as_ref().expect("running").metrics_addr(),
        ]
    }

    /// Stops the agent (which flushes its statistics and writes its static
    /// route file), then the reporter (which writes what it holds), then
    /// the route server.
    ///
    /// # Errors
    /// The first part that failed to stop cleanly; the others are still
    /// stopped.
    pub fn stop(mut self) -> anyhow::Result<()> {
        self.stop_all()
    }

    fn stop_all(&mut self) -> anyhow::Result<()> {
        let mut first: Option<anyhow::Error> = None;
        if let Some(a) = self.agent.take() {
            if let Err(e) = a.stop() {
                first.get_or_insert(e.context("the agent did not stop cleanly"));
            }
        }
        if let Some(r) = self.reporter.take() {
            if let Err(e) = r.stop() {
                first.get_or_insert(e.context("the reporter did not stop cleanly"));
            }
        }
        if let Some(d) = self.dnsserver.take() {
            if let Err(e) = d.stop() {
                first.get_or_insert(e.context("the route server did not stop cleanly"));
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for Standalone {
    fn drop(&mut self) {
        let _ = self.stop_all();
    }
}

/// Runs a standalone system until SIGTERM or SIGINT.
///
/// # Errors
/// It could not start, or a part did not stop cleanly.
pub fn run(opts: StandaloneOptions) -> anyhow::Result<()> {
    crate::service::signal::install();
    let s = Standalone::start(opts)?;
    let ports = s.agent_ports();
    let [am, dm, rm] = s.metrics_addrs();
    tracing::info!(
        "store {}; route server on {}, reporter on {}, agent on {}:{}..={} ({} shards); \
         metrics on {am}, {dm}, {rm}; heartbeat {}",
        s.store_url(),
        s.dnsserver_addr(),
        s.reporter_addr(),
        s.config().agent.bind,
        ports[0],
        ports[ports.len() - 1],
        ports.len(),
        s.heartbeat_path().display()
    );
    tracing::info!(
        "add a route with `lbagent route add MODID CMDID IP:PORT --store {}`, \
         then `lbagent gethost MODID CMDID`",
        s.store_url()
    );
    crate::service::signal::wait();
    s.stop()?;
    tracing::info!("stopped");
    Ok(())
}

fn absolute(p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|d| d.join(p))
            .unwrap_or_else(|_| p.to_path_buf())
    }
}
