//! `lbagent-fleet`: the fleet lab's programs (see `tools/fleet/lab`).

use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use lbagent_fleet::record::{AppRecord, Arrivals, ChurnRecord, SimRecord};
use lbagent_fleet::verdict::{self, Stored, Window};
use lbagent_fleet::{app, churn, sim};
use lbagent_store::StoreUrl;

/// The fleet lab's programs; `tools/fleet/lab` runs them in the lab's
/// network namespaces.
#[derive(Parser)]
#[command(name = "lbagent-fleet", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Play many agents against the route servers and reporters, on the
    /// agent's own protocol cores; write what arrived and what was
    /// acknowledged (JSON) at the end (SIGTERM, or --duration-s).
    Sim {
        /// Route servers, comma-separated IP:PORT.
        #[arg(long, value_delimiter = ',', required = true)]
        route_servers: Vec<SocketAddr>,
        /// Reporters, comma-separated IP:PORT.
        #[arg(long, value_delimiter = ',', required = true)]
        reporters: Vec<SocketAddr>,
        /// Simulated agents in this process (two connections each).
        #[arg(long, default_value_t = 1000)]
        agents: u32,
        /// Index of the first agent (several processes split a fleet).
        #[arg(long, default_value_t = 0)]
        first: u32,
        /// Modules in the lab.
        #[arg(long, default_value_t = 1000)]
        modules: u32,
        /// Modules each agent follows.
        #[arg(long, default_value_t = 10)]
        per_agent: u32,
        /// One statistics entry per agent every this many ms (0: none).
        #[arg(long, default_value_t = 1000)]
        stats_interval_ms: u64,
        /// Each module's periodic re-pull, ms (the agent's default: 15000;
        /// 0: none). The lab's restart storm sets it past its window, so
        /// that every pull the servers count there is a reconnection's.
        #[arg(long, default_value_t = 15_000)]
        refresh_ms: u64,
        /// The longest run before draining, seconds.
        #[arg(long, default_value_t = 600)]
        duration_s: u64,
        /// The longest drain (statistics acknowledged), seconds.
        #[arg(long, default_value_t = 20)]
        drain_s: u64,
        /// Where to write the record (JSON).
        #[arg(long)]
        out: PathBuf,
    },
    /// Set the lab's modules up in the store, then change one route every
    /// interval; write every commit's version and time (JSON).
    Churn {
        /// The store URL.
        #[arg(long)]
        store: String,
        /// Modules in the lab.
        #[arg(long, default_value_t = 1000)]
        modules: u32,
        /// Every other change goes to one of the first HOT modules.
        #[arg(long, default_value_t = 0)]
        hot: u32,
        /// One change every this many ms.
        #[arg(long, default_value_t = 500)]
        interval_ms: u64,
        /// How long to churn, seconds (0: set up only).
        #[arg(long, default_value_t = 60)]
        duration_s: u64,
        /// Where to write the record (JSON).
        #[arg(long)]
        out: PathBuf,
        /// Do not set the modules up: take the record a `--duration-s 0`
        /// run left in OUT (its setup version and modules). Importing them
        /// again would make every module a change pushed to every follower
        /// just before the measured churn.
        #[arg(long)]
        no_setup: bool,
    },
    /// An application on a real agent's host: getHost + report at a steady
    /// rate, failures counted, route versions polled (JSON at the end).
    App {
        /// The host's name in the lab.
        #[arg(long)]
        host: String,
        /// The agent's heartbeat file.
        #[arg(long)]
        heartbeat: PathBuf,
        /// The agent's static route file.
        #[arg(long)]
        snapshot: PathBuf,
        /// Module indexes used (comma-separated; module = 10000 + index, 1).
        #[arg(long, value_delimiter = ',', required = true)]
        modules: Vec<u32>,
        /// getHost + report pairs per second.
        #[arg(long, default_value_t = 200)]
        rate: u32,
        /// Each module's getRoute poll interval, ms.
        #[arg(long, default_value_t = 20)]
        poll_ms: u64,
        /// The longest run, seconds (SIGTERM ends it sooner).
        #[arg(long)]
        duration_s: u64,
        /// Where to write the record (JSON).
        #[arg(long)]
        out: PathBuf,
    },
    /// Check the invariants from the records and the store; print the
    /// table; exit 1 when one failed.
    Verdict {
        /// The churn record.
        #[arg(long)]
        churn: PathBuf,
        /// Simulator records.
        #[arg(long)]
        sim: Vec<PathBuf>,
        /// Application records.
        #[arg(long)]
        app: Vec<PathBuf>,
        /// Fault windows FROM_MS:TO_MS[:HOST]: changes committed inside one
        /// are timed from its end, for every agent; with HOST, the real
        /// agent HOST was cut off: its changes from then must arrive but are
        /// not timed (its time to reconnect is a figure of its own).
        #[arg(long, value_parser = parse_window)]
        window: Vec<(u64, u64, Option<String>)>,
        /// Segments NAME=FROM_MS:TO_MS: route change to last agent is also
        /// printed for the changes committed inside each (one scenario).
        #[arg(long, value_parser = parse_segment)]
        segment: Vec<(String, u64, u64)>,
        /// The convergence bound, ms.
        #[arg(long, default_value_t = 5000)]
        bound_ms: u64,
        /// The store, to read the statistics rows from.
        #[arg(long)]
        store: String,
        /// How long to wait for acknowledged rows to be written, seconds.
        #[arg(long, default_value_t = 15)]
        stored_wait_s: u64,
        /// Also write the figures here (JSON).
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

fn parse_segment(s: &str) -> Result<(String, u64, u64), String> {
    let (name, span) = s
        .split_once('=')
        .ok_or_else(|| format!("segment {s:?}: expected NAME=FROM_MS:TO_MS"))?;
    let (a, b, _) = parse_window(span)?;
    Ok((name.to_string(), a, b))
}

fn parse_window(s: &str) -> Result<(u64, u64, Option<String>), String> {
    let mut parts = s.splitn(3, ':');
    let mut num = || -> Result<u64, String> {
        let p = parts
            .next()
            .ok_or_else(|| format!("window {s:?}: expected FROM_MS:TO_MS[:HOST]"))?;
        p.parse().map_err(|e| format!("window {s:?}: {p:?}: {e}"))
    };
    let (a, b) = (num()?, num()?);
    if a > b {
        return Err(format!("window {s:?}: ends before it starts"));
    }
    Ok((a, b, parts.next().map(str::to_string)))
}

fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_string(value)?;
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn store_url(s: &str) -> Result<StoreUrl> {
    s.parse::<StoreUrl>()
        .map_err(|e| anyhow::anyhow!("--store: {e}"))
}

fn main() -> ExitCode {
    match run(Cli::parse().command) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("lbagent-fleet: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(command: Command) -> Result<bool> {
    match command {
        Command::Sim {
            route_servers,
            reporters,
            agents,
            first,
            modules,
            per_agent,
            stats_interval_ms,
            refresh_ms,
            duration_s,
            drain_s,
            out,
        } => {
            let rec = sim::run(sim::SimOptions {
                route_servers,
                reporters,
                agents,
                first,
                modules,
                per_agent,
                stats_interval_ms,
                refresh_ms,
                duration: Duration::from_secs(duration_s),
                drain: Duration::from_secs(drain_s),
            })?;
            write_json(&out, &rec)?;
            Ok(true)
        }
        Command::Churn {
            store,
            modules,
            hot,
            interval_ms,
            duration_s,
            out,
            no_setup,
        } => {
            let url = store_url(&store)?;
            let mut rec = if no_setup {
                let rec: ChurnRecord = read_json(&out)
                    .context("--no-setup takes the record of an earlier set-up run from --out")?;
                anyhow::ensure!(
                    rec.modules.len() == modules as usize,
                    "--no-setup: {} holds {} modules, not --modules {modules}: set up again",
                    out.display(),
                    rec.modules.len()
                );
                rec
            } else {
                churn::setup(&url, modules)?
            };
            write_json(&out, &rec)?;
            let opts = churn::ChurnOptions {
                store: url,
                modules,
                hot,
                interval: Duration::from_millis(interval_ms),
                duration: Duration::from_secs(duration_s),
            };
            churn::run(&opts, &mut rec);
            write_json(&out, &rec)?;
            Ok(true)
        }
        Command::App {
            host,
            heartbeat,
            snapshot,
            modules,
            rate,
            poll_ms,
            duration_s,
            out,
        } => {
            let rec = app::run(&app::AppOptions {
                host,
                heartbeat,
                snapshot,
                modules: modules.into_iter().map(sim::module).collect(),
                rate,
                poll: Duration::from_millis(poll_ms),
                duration: Duration::from_secs(duration_s),
                register_within: Duration::from_secs(30),
            })?;
            write_json(&out, &rec)?;
            Ok(true)
        }
        Command::Verdict {
            churn,
            sim,
            app,
            window,
            segment,
            bound_ms,
            store,
            stored_wait_s,
            json,
        } => judge(&Judge {
            churn,
            sims: sim,
            apps: app,
            windows: window,
            segments: segment,
            bound_ms,
            store: store_url(&store)?,
            stored_wait: Duration::from_secs(stored_wait_s),
            json,
        }),
    }
}

struct Judge {
    churn: PathBuf,
    sims: Vec<PathBuf>,
    apps: Vec<PathBuf>,
    windows: Vec<(u64, u64, Option<String>)>,
    segments: Vec<(String, u64, u64)>,
    bound_ms: u64,
    store: StoreUrl,
    stored_wait: Duration,
    json: Option<PathBuf>,
}

/// Every statistics row in the store.
fn stored_rows(url: &StoreUrl) -> Result<Vec<Stored>> {
    let mut store = lbagent_store::open_existing(url).context("opening the store")?;
    let rows = store
        .call_status(None)
        .context("reading server_call_status")?;
    Ok(rows
        .into_iter()
        .map(|r| {
            (
                r.caller,
                (r.module.modid, r.module.cmdid),
                (r.node.ip, r.node.port),
                r.succ,
            )
        })
        .collect())
}

fn judge(j: &Judge) -> Result<bool> {
    let churn: ChurnRecord = read_json(&j.churn)?;
    let sims: Vec<SimRecord> = j.sims.iter().map(|p| read_json(p)).collect::<Result<_>>()?;
    let apps: Vec<AppRecord> = j.apps.iter().map(|p| read_json(p)).collect::<Result<_>>()?;
    let want = verdict::final_versions(&churn);
    let mut ok = true;
    let mut fail = |what: String| {
        println!("INVARIANT FAILED: {what}");
        ok = false;
    };
    let mut figures = serde_json::Map::new();
    println!(
        "{:<58} {:>10} {:>10} {:>10} {:>8}",
        "figure", "p50", "p99", "max", "n"
    );
    let global: Vec<Window> = j
        .windows
        .iter()
        .filter(|w| w.2.is_none())
        .map(|w| (w.0, w.1))
        .collect();
    let app_windows: Vec<Vec<Window>> = apps
        .iter()
        .map(|a| {
            j.windows
                .iter()
                .filter(|w| w.2.as_deref() == Some(a.host.as_str()))
                .map(|w| (w.0, w.1))
                .collect()
        })
        .collect();
    let real: Vec<verdict::Follower<'_>> = apps
        .iter()
        .zip(&app_windows)
        .flat_map(|(a, own)| {
            let global = global.as_slice();
            a.arrivals.iter().map(move |r| (r, global, own.as_slice()))
        })
        .collect();
    let simulated: Vec<verdict::Follower<'_>> = sims
        .iter()
        .flat_map(|s| s.arrivals.iter().map(|r| (r, global.as_slice(), &[][..])))
        .collect();
    let groups = [("real agents", real), ("simulated agents", simulated)];
    for (name, followers) in &groups {
        if followers.is_empty() {
            continue;
        }
        let arrivals: Vec<&Arrivals> = followers.iter().map(|f| f.0).collect();
        let arrivals = &arrivals;
        let c = verdict::convergence(&churn.commits, followers);
        let (p50, p99, max) = (
            verdict::quantile(&c.latencies, 0.5),
            verdict::quantile(&c.latencies, 0.99),
            verdict::quantile(&c.latencies, 1.0),
        );
        println!(
            "{:<58} {:>8}ms {:>8}ms {:>8}ms {:>8}",
            format!("route change -> last of the {name}"),
            p50,
            p99,
            max,
            c.latencies.len()
        );
        figures.insert(
            format!("converge_{}", name.replace(' ', "_")),
            serde_json::json!({"p50": p50, "p99": p99, "max": max, "n": c.latencies.len()}),
        );
        if !c.missing.is_empty() {
            let (commit, short) = c.missing[0];
            fail(format!(
                "{} route changes never reached every one of the {name} (first: module {:?} version {} at {} ms, {} followers short)",
                c.missing.len(), commit.module, commit.version, commit.t_ms, short
            ));
        }
        if max > j.bound_ms {
            fail(format!(
                "a route change took {max} ms to reach the last of the {name}, over the {} ms bound",
                j.bound_ms
            ));
        }
        for (segment, from, to) in &j.segments {
            let commits: Vec<_> = churn
                .commits
                .iter()
                .filter(|c| c.t_ms >= *from && c.t_ms <= *to)
                .copied()
                .collect();
            let c = verdict::convergence(&commits, followers);
            let (p50, p99, max) = (
                verdict::quantile(&c.latencies, 0.5),
                verdict::quantile(&c.latencies, 0.99),
                verdict::quantile(&c.latencies, 1.0),
            );
            println!(
                "{:<58} {:>8}ms {:>8}ms {:>8}ms {:>8}",
                format!("  in {segment}"),
                p50,
                p99,
                max,
                c.latencies.len()
            );
            figures.insert(
                format!("converge_{}_{segment}", name.replace(' ', "_")),
                serde_json::json!({"p50": p50, "p99": p99, "max": max, "n": c.latencies.len()}),
            );
        }
        let behind = verdict::behind(arrivals, &want);
        if let Some(&(agent, module, held, wanted)) = behind.first() {
            fail(format!(
                "{} of the {name}'s modules ended behind the committed version (first: agent {agent} module {module:?} holds {held}, committed {wanted})",
                behind.len()
            ));
        }
    }
    if !sims.is_empty() {
        // The simulators' own lateness, in every simulated arrival above:
        // the worst simulator's, per quantile.
        let worst = |f: fn(&SimRecord) -> u64| sims.iter().map(f).max().unwrap_or(0);
        let (p50, p99, max) = (
            worst(|s| s.loop_lag.p50),
            worst(|s| s.loop_lag.p99),
            worst(|s| s.loop_lag.max),
        );
        let n: u64 = sims.iter().map(|s| s.loop_lag.n).sum();
        println!(
            "{:<58} {:>8}ms {:>8}ms {:>8}ms {:>8}",
            "simulators' own loop lag (a 10 ms timer's lateness)", p50, p99, max, n
        );
        figures.insert(
            "sim_loop_lag".into(),
            serde_json::json!({"p50": p50, "p99": p99, "max": max, "n": n}),
        );
    }
    let gethosts: u64 = apps.iter().map(|a| a.gethosts).sum();
    let failed: u64 = apps.iter().map(|a| a.gethost_failures).sum();
    let statics: u64 = apps.iter().map(|a| a.static_answers).sum();
    println!(
        "{:<58} {:>32} {:>8}",
        "application getHosts failed (static answers)",
        format!("{failed} ({statics})"),
        gethosts
    );
    figures.insert(
        "gethosts".into(),
        serde_json::json!({"n": gethosts, "failed": failed, "static": statics}),
    );
    if failed > 0 {
        let ex = apps.iter().flat_map(|a| a.failure_examples.iter()).next();
        fail(format!(
            "{failed} application getHosts failed (first: {ex:?})"
        ));
    }
    let acked: Vec<_> = sims.iter().flat_map(|s| s.acked.iter().copied()).collect();
    let deadline = Instant::now() + j.stored_wait;
    let lost = loop {
        let lost = verdict::lost(&acked, &stored_rows(&j.store)?);
        if lost.is_empty() || Instant::now() >= deadline {
            break lost;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let sum = |f: fn(&SimRecord) -> u64| sims.iter().map(f).sum::<u64>();
    let callers = acked
        .iter()
        .map(|a| a.caller)
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    println!(
        "{:<58} {:>32} {:>8}",
        "acknowledged statistics keys lost (acked entries)",
        format!("{} ({})", lost.len(), sum(|s| s.stats_acked)),
        acked.len()
    );
    figures.insert(
        "stats".into(),
        serde_json::json!({"keys": acked.len(), "callers": callers, "lost": lost.len(),
            "pushed": sum(|s| s.stats_pushed), "acked": sum(|s| s.stats_acked),
            "dropped": sum(|s| s.stats_dropped), "rejected": sum(|s| s.stats_rejected),
            "unsettled": sum(|s| s.stats_unsettled)}),
    );
    if let Some((a, stored)) = lost.first() {
        let lost_callers = lost
            .iter()
            .map(|(a, _)| a.caller)
            .collect::<std::collections::BTreeSet<_>>()
            .len();
        fail(format!(
            "{} acknowledged statistics keys of {lost_callers} callers are not in the store (first: caller {:#x} module {:?} acked succ {} stored {stored:?})",
            lost.len(), a.caller, a.module, a.succ
        ));
    }
    if sum(|s| s.stats_dropped) + sum(|s| s.stats_rejected) > 0 {
        fail(format!(
            "simulated agents dropped {} and had {} statistics entries refused",
            sum(|s| s.stats_dropped),
            sum(|s| s.stats_rejected)
        ));
    }
    if sum(|s| s.stats_unsettled) > 0 {
        fail(format!(
            "{} statistics entries were still unacknowledged after the drain: the reporters did not recover",
            sum(|s| s.stats_unsettled)
        ));
    }
    let agents: u64 = sims.iter().map(|s| u64::from(s.agents)).sum();
    let connected: u64 = sims
        .iter()
        .map(|s| u64::from(s.route_connected_at_end))
        .sum();
    let connects = sum(|s| s.route_connects);
    println!(
        "{:<58} {:>32} {:>8}",
        "simulated agents connected at the end (connects)",
        format!("{connected} ({connects})"),
        agents
    );
    let per_agent: u64 = sims.iter().map(|s| s.arrivals.len() as u64).sum();
    println!(
        "{:<58} {:>32} {:>8}",
        "modules pulled per followed module (15 s re-pulls included)",
        format!(
            "{:.2} ({})",
            sum(|s| s.modules_pulled) as f64 / per_agent.max(1) as f64,
            sum(|s| s.unchanged)
        ),
        per_agent
    );
    figures.insert(
        "route_links".into(),
        serde_json::json!({"agents": agents, "connected_at_end": connected,
        "connects": connects, "modules_pulled": sum(|s| s.modules_pulled), "followed": per_agent,
        "unchanged": sum(|s| s.unchanged),
        "last_connect_ms": sims.iter().map(|s| s.last_connect_ms).max().unwrap_or(0)}),
    );
    if connected < agents {
        fail(format!(
            "{} simulated agents had no route server at the end",
            agents - connected
        ));
    }
    println!(
        "{:<58} {:>32} {:>8}",
        "route changes committed (store failures)",
        format!("{} ({})", churn.commits.len(), churn.failures.len()),
        ""
    );
    figures.insert(
        "churn".into(),
        serde_json::json!({"commits": churn.commits.len(),
        "failures": churn.failures.len(),
        "failure_times": churn.failures.iter().map(|f| f.0).collect::<Vec<_>>(),
        "commit_times": churn.commits.iter().map(|c| c.t_ms).collect::<Vec<_>>()}),
    );
    if let Some(path) = &j.json {
        write_json(path, &serde_json::Value::Object(figures))?;
    }
    Ok(ok)
}
