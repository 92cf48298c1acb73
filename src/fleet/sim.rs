//! The fleet simulator: M agents in one process, each with a route link
//! (a [`RouteClientCore`] following its own modules) and a statistics
//! link (a [`StatsClientCore`] pushing one entry per tick), all on one
//! current-thread tokio runtime. It records when each route version
//! arrived and which statistics were acknowledged, and writes a
//! [`SimRecord`].
//!
//! Two file descriptors per agent: the lab starts several simulators when
//! the open-files limit (20,000 here) is short of `2 * agents`.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use anyhow::{Context, Result};
use lbagent_agent::routeclient::{RouteClientConfig, RouteClientCore, RouteClientEvent};
use lbagent_agent::statsclient::{StatsClientConfig, StatsClientCore, StatsClientEvent};
use lbagent_lb::NodeCallStats;
use lbagent_model::{ModuleId, NodeAddr};
use tokio::sync::watch;

use crate::clock::Clock;
use crate::ledger::{self, Pushed};
use crate::link::{drive, Hooks, Phase};
use crate::record::{Acked, Arrivals, LagSummary, Module, SimRecord};
use crate::verdict::quantile;

/// How often the loop-lag probe asks to be woken, ms.
const PROBE_EVERY_MS: u64 = 10;

/// The first module id of the lab (`modid`; `cmdid` is 1).
pub const FIRST_MODID: u32 = 10_000;

/// The caller address of simulated agent `index` (10.128.0.0/9, host
/// byte order): unique per agent, so the store keeps one row per agent.
pub fn caller_of(index: u32) -> u32 {
    0x0a80_0000 + index + 1
}

/// The node a simulated agent reports calls to for module index `m`.
pub fn stats_node(m: u32) -> (u32, u16) {
    (0x0a63_0000 + m, 9000)
}

/// The module of index `m`.
pub fn module(m: u32) -> Module {
    (FIRST_MODID + m, 1)
}

/// The module indexes agent `index` follows: `per_agent` consecutive
/// indexes from `index * per_agent`, modulo `modules`, so that every
/// module has about `agents * per_agent / modules` followers.
pub fn modules_of(index: u32, per_agent: u32, modules: u32) -> Vec<u32> {
    (0..per_agent)
        .map(|j| {
            ((u64::from(index) * u64::from(per_agent) + u64::from(j)) % u64::from(modules)) as u32
        })
        .collect()
}

/// `addrs` rotated left by `by`, so that agents spread over the servers.
pub fn rotated(addrs: &[SocketAddr], by: u32) -> Vec<SocketAddr> {
    let mut v = addrs.to_vec();
    if !v.is_empty() {
        let k = by as usize % v.len();
        v.rotate_left(k);
    }
    v
}

/// How to run the simulator.
#[derive(Clone, Debug)]
pub struct SimOptions {
    /// The route servers, in order (each agent starts at a different one).
    pub route_servers: Vec<SocketAddr>,
    /// The reporters, likewise.
    pub reporters: Vec<SocketAddr>,
    /// Agents in this process.
    pub agents: u32,
    /// The index of the first (callers and modules follow from it).
    pub first: u32,
    /// Modules in the lab.
    pub modules: u32,
    /// Modules each agent follows.
    pub per_agent: u32,
    /// One statistics entry per agent every this many ms (0: none).
    pub stats_interval_ms: u64,
    /// Each module's periodic re-pull, ms (0: none): the route client's
    /// `refresh_ms`.
    pub refresh_ms: u64,
    /// The longest the run lasts before draining (a signal ends it sooner).
    pub duration: Duration,
    /// The longest the drain lasts.
    pub drain: Duration,
}

/// The route link's owner: records arrivals.
struct RouteHooks {
    arrivals: Vec<Arrivals>,
    /// When the link last came up.
    last_connect_ms: u64,
    /// Whether the link was up when the run ended (None: not ended yet).
    up_at_end: Option<bool>,
}

impl Hooks<RouteClientCore> for RouteHooks {
    fn on_event(&mut self, event: RouteClientEvent, now: u64) {
        if let RouteClientEvent::Route(r) = event {
            let m = (r.module.modid, r.module.cmdid);
            if let Some(a) = self.arrivals.iter_mut().find(|a| a.module == m) {
                a.seen.push((r.version, now));
            }
        }
    }
    fn next_tick(&self, _: Phase) -> Option<u64> {
        None
    }
    fn tick(&mut self, _: &mut RouteClientCore, _: u64) {}
    fn finished(&self, _: &RouteClientCore, phase: Phase) -> bool {
        phase >= Phase::Drain
    }
    fn on_connected(&mut self, now: u64) {
        self.last_connect_ms = now;
    }
    fn on_end(&mut self, core: &RouteClientCore) {
        self.up_at_end.get_or_insert(core.link().is_connected());
    }
}

/// The statistics link's owner: pushes one entry per tick, remembers it.
struct StatsHooks {
    modules: Vec<u32>,
    interval_ms: u64,
    next_at: u64,
    pushed: Vec<Pushed>,
    rejected: u64,
}

impl Hooks<StatsClientCore> for StatsHooks {
    fn on_event(&mut self, event: StatsClientEvent, _: u64) {
        if let StatsClientEvent::ServerError(e) = event {
            self.rejected += e.rejected as u64;
        }
    }
    fn next_tick(&self, phase: Phase) -> Option<u64> {
        (phase == Phase::Run && self.interval_ms > 0).then_some(self.next_at)
    }
    fn tick(&mut self, core: &mut StatsClientCore, now: u64) {
        self.next_at = self.next_at.max(now.saturating_sub(self.interval_ms)) + self.interval_ms;
        let succ = self.pushed.len() as u32 + 1;
        let m = self.modules[self.pushed.len() % self.modules.len()];
        let (ip, port) = stats_node(m);
        let node = NodeCallStats {
            addr: NodeAddr { ip, port },
            succ,
            err: 0,
            overloaded: false,
            consumed: 0,
        };
        let module = module(m);
        core.push(ModuleId::new(module.0, module.1), vec![node], now);
        self.pushed.push((module, (ip, port), succ));
    }
    fn finished(&self, core: &StatsClientCore, phase: Phase) -> bool {
        phase == Phase::Stop || (phase == Phase::Drain && core.is_drained())
    }
}

/// What one agent's two links left.
struct AgentOutcome {
    arrivals: Vec<Arrivals>,
    route: lbagent_agent::routeclient::RouteClientStats,
    route_connected: bool,
    last_connect_ms: u64,
    acked: Option<Vec<Acked>>,
    stats: lbagent_agent::statsclient::StatsClientStats,
    rejected: u64,
}

async fn run_agent(
    opts: SimOptions,
    index: u32,
    clock: Clock,
    phase: watch::Receiver<Phase>,
) -> Result<AgentOutcome> {
    let mods = modules_of(index, opts.per_agent, opts.modules);
    let mut rc = RouteClientConfig::new(rotated(&opts.route_servers, index));
    rc.jitter_seed = u64::from(index) * 0x9E37_79B9 + 1;
    rc.refresh_ms = opts.refresh_ms;
    let mut route = RouteClientCore::new(&rc).context("route client configuration")?;
    for &m in &mods {
        let (modid, cmdid) = module(m);
        route.want(ModuleId::new(modid, cmdid));
    }
    let mut rh = RouteHooks {
        arrivals: mods
            .iter()
            .map(|&m| Arrivals {
                agent: index,
                module: module(m),
                seen: Vec::new(),
            })
            .collect(),
        last_connect_ms: 0,
        up_at_end: None,
    };
    let mut sc = StatsClientConfig::new(rotated(&opts.reporters, index));
    sc.caller = Ipv4Addr::from(caller_of(index));
    // One report in flight: acknowledged entries are a prefix (ledger).
    sc.max_reports_in_flight = 1;
    sc.jitter_seed = u64::from(index) * 0x7F4A_7C15 + 3;
    let mut stats = StatsClientCore::new(&sc).context("stats client configuration")?;
    let phase_offset = if opts.stats_interval_ms > 0 {
        fastrand::u64(..opts.stats_interval_ms)
    } else {
        0
    };
    let mut sh = StatsHooks {
        modules: mods,
        interval_ms: opts.stats_interval_ms,
        next_at: clock.now_ms() + phase_offset,
        pushed: Vec::new(),
        rejected: 0,
    };
    let route_link = drive(&mut route, &mut rh, clock, phase.clone());
    let stats_link = drive(&mut stats, &mut sh, clock, phase);
    tokio::join!(route_link, stats_link);
    let s = stats.stats();
    Ok(AgentOutcome {
        arrivals: rh.arrivals,
        route: route.stats(),
        route_connected: rh.up_at_end.unwrap_or(false),
        last_connect_ms: rh.last_connect_ms,
        acked: ledger::acked(caller_of(index), &sh.pushed, s.acked),
        stats: s,
        rejected: sh.rejected,
    })
}

/// Measures the simulator's own scheduling lag while the links run: a
/// timer due every [`PROBE_EVERY_MS`], and how late the loop woke it. On a
/// loaded machine with thousands of links on one thread, that lateness is
/// in every arrival time the simulator records.
async fn probe_loop_lag(mut phase: watch::Receiver<Phase>) -> LagSummary {
    let mut lags = Vec::new();
    while *phase.borrow() == Phase::Run {
        let due = tokio::time::Instant::now() + Duration::from_millis(PROBE_EVERY_MS);
        tokio::select! {
            _ = tokio::time::sleep_until(due) => {
                lags.push(due.elapsed().as_millis() as u64);
            }
            r = phase.changed() => if r.is_err() { break },
        }
    }
    lag_summary(&mut lags)
}

/// The quantiles of `lags` (sorted in place).
pub fn lag_summary(lags: &mut [u64]) -> LagSummary {
    lags.sort_unstable();
    LagSummary {
        p50: quantile(lags, 0.5),
        p99: quantile(lags, 0.99),
        max: quantile(lags, 1.0),
        n: lags.len() as u64,
    }
}

/// Runs the simulator: every agent until the duration passes or SIGTERM /
/// SIGINT arrives, then drains the statistics links, then stops.
///
/// # Errors
/// A configuration the cores refuse, or a runtime that cannot start.
pub fn run(opts: SimOptions) -> Result<SimRecord> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the simulator's runtime")?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let clock = Clock::new();
        let (tx, rx) = watch::channel(Phase::Run);
        let mut handles = Vec::new();
        for k in 0..opts.agents {
            let index = opts.first + k;
            handles.push(tokio::task::spawn_local(run_agent(
                opts.clone(),
                index,
                clock,
                rx.clone(),
            )));
        }
        let probe = tokio::task::spawn_local(probe_loop_lag(rx.clone()));
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("SIGTERM handler")?;
        tokio::select! {
            _ = tokio::time::sleep(opts.duration) => {}
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        let _ = tx.send(Phase::Drain);
        // Each agent ends once its statistics are acknowledged; past the
        // drain time, every link is told to stop.
        let deadline = tokio::time::sleep(opts.drain);
        tokio::pin!(deadline);
        let mut stopped = false;
        let mut outcomes = Vec::with_capacity(handles.len());
        for mut h in handles {
            let r = loop {
                tokio::select! {
                    r = &mut h => break r,
                    _ = &mut deadline, if !stopped => {
                        let _ = tx.send(Phase::Stop);
                        stopped = true;
                    }
                }
            };
            outcomes.push(r);
        }
        let mut rec = SimRecord {
            agents: opts.agents,
            loop_lag: probe.await.context("the loop-lag probe panicked")?,
            ..SimRecord::default()
        };
        for o in outcomes {
            let o = o.context("a simulated agent panicked")??;
            rec.arrivals.extend(o.arrivals);
            rec.route_connects += o.route.connects;
            rec.modules_pulled += o.route.modules_pulled;
            rec.unchanged += o.route.unchanged;
            rec.route_connected_at_end += u32::from(o.route_connected);
            rec.last_connect_ms = rec.last_connect_ms.max(o.last_connect_ms);
            rec.stats_pushed += o.stats.pushed;
            rec.stats_acked += o.stats.acked;
            rec.stats_dropped += o.stats.dropped;
            rec.stats_rejected += o.rejected;
            rec.stats_unsettled += o.stats.queued + o.stats.in_flight;
            match o.acked {
                Some(a) => rec.acked.extend(a),
                None => anyhow::bail!("an agent counted more acknowledged entries than it pushed"),
            }
        }
        Ok(rec)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lag_summary_takes_nearest_rank_quantiles_of_unsorted_lags() {
        let mut lags: Vec<u64> = (1..=100).rev().collect();
        let s = lag_summary(&mut lags);
        assert_eq!((s.p50, s.p99, s.max, s.n), (50, 99, 100, 100));
        assert_eq!(lag_summary(&mut []), LagSummary::default());
    }

    #[test]
    fn every_module_gets_followers_and_agents_spread_over_servers() {
        let mut followers = vec![0u32; 100];
        for i in 0..1000 {
            for m in modules_of(i, 10, 100) {
                followers[m as usize] += 1;
            }
        }
        assert!(followers.iter().all(|&f| f == 100), "{followers:?}");
        let a: Vec<SocketAddr> = vec!["10.0.0.1:1".parse().unwrap(), "10.0.0.2:1".parse().unwrap()];
        assert_eq!(rotated(&a, 1)[0], a[1]);
        assert_eq!(rotated(&a, 2)[0], a[0]);
        assert_ne!(caller_of(0), caller_of(1));
    }
}
