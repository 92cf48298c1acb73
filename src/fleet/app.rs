//! An application on a real agent's host: a steady getHost + report load
//! over its modules through the client library (static route file
//! included), every failure counted, and each module's route version
//! polled with getRoute to see when changes arrive.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use lbagent_client::{Client, ClientOptions, HostSource};

use crate::clock::Clock;
use crate::record::{AppRecord, Arrivals, Module};

/// How the application runs.
#[derive(Clone, Debug)]
pub struct AppOptions {
    /// The host's name in the lab (for the record).
    pub host: String,
    /// The agent's heartbeat file.
    pub heartbeat: PathBuf,
    /// The agent's static route file (read when the agent is down).
    pub snapshot: PathBuf,
    /// The modules used.
    pub modules: Vec<Module>,
    /// getHost + report pairs per second.
    pub rate: u32,
    /// Each module's getRoute poll interval.
    pub poll: Duration,
    /// The longest run after every module registered (SIGTERM ends it
    /// sooner).
    pub duration: Duration,
    /// The longest wait for every module to register.
    pub register_within: Duration,
}

const CALL_TIMEOUT: Duration = Duration::from_millis(500);

/// Waits until the agent has written its static route file after `since`
/// (so that it holds the modules just registered): the file is what
/// answers while the agent cannot, and the load is only counted once an
/// answer is possible.
fn wait_for_snapshot(
    path: &std::path::Path,
    since: std::time::SystemTime,
    within: Duration,
) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let written = std::fs::metadata(path).and_then(|m| m.modified());
        if matches!(written, Ok(t) if t > since) {
            return Ok(());
        }
        if Instant::now() > deadline {
            anyhow::bail!(
                "the agent did not write its static route file {} within {within:?} of registering the modules (is agent.snapshot_interval longer?)",
                path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs the application.
///
/// # Errors
/// The client cannot be made, or a module does not register in time.
pub fn run(opts: &AppOptions) -> Result<AppRecord> {
    let clock = Clock::new();
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())
        .context("installing the SIGTERM handler")?;
    let copts = ClientOptions {
        heartbeat_path: opts.heartbeat.clone(),
        snapshot_path: opts.snapshot.clone(),
        ..ClientOptions::default()
    };
    let mut client = Client::with_options(copts).context("making the client")?;
    let deadline = Instant::now() + opts.register_within;
    for &(modid, cmdid) in &opts.modules {
        loop {
            match client.register(modid, cmdid, Duration::from_secs(1)) {
                Ok(_) => break,
                Err(e) if Instant::now() > deadline => {
                    anyhow::bail!(
                        "module {modid}:{cmdid} did not register within {:?}: {e}",
                        opts.register_within
                    )
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }
    wait_for_snapshot(
        &opts.snapshot,
        std::time::SystemTime::now(),
        opts.register_within,
    )?;
    let mut rec = AppRecord {
        host: opts.host.clone(),
        arrivals: opts
            .modules
            .iter()
            .map(|&module| Arrivals {
                agent: 0,
                module,
                seen: Vec::new(),
            })
            .collect(),
        ..AppRecord::default()
    };
    let start = Instant::now();
    let call_every = Duration::from_secs(1) / opts.rate.max(1);
    let poll_every = opts.poll / opts.modules.len().max(1) as u32;
    let (mut next_call, mut next_poll) = (start, start);
    let (mut call_k, mut poll_k) = (0usize, 0usize);
    while start.elapsed() < opts.duration && !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if now >= next_call {
            let (modid, cmdid) = opts.modules[call_k % opts.modules.len()];
            call_k += 1;
            next_call += call_every;
            rec.gethosts += 1;
            match client.get_host(modid, cmdid, CALL_TIMEOUT) {
                Ok(host) => {
                    if host.source == HostSource::StaticRoutes {
                        rec.static_answers += 1;
                    }
                    rec.reports += 1;
                    if client.report(modid, cmdid, host.addr, 0, 1).is_err() {
                        rec.report_failures += 1;
                    }
                }
                Err(e) => {
                    rec.gethost_failures += 1;
                    if rec.failure_examples.len() < 20 {
                        rec.failure_examples
                            .push((clock.now_ms(), (modid, cmdid), e.to_string()));
                    }
                }
            }
        }
        if now >= next_poll {
            let i = poll_k % opts.modules.len();
            poll_k += 1;
            next_poll += poll_every;
            let (modid, cmdid) = opts.modules[i];
            if let Ok(view) = client.get_route(modid, cmdid, CALL_TIMEOUT) {
                let seen = &mut rec.arrivals[i].seen;
                if seen.last().is_none_or(|&(v, _)| view.version > v) {
                    seen.push((view.version, clock.now_ms()));
                }
            }
        }
        let next = next_call.min(next_poll);
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    Ok(rec)
}
