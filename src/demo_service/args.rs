//! `lbagent demo-service`: its flags and its runner.

use std::net::{SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::{Args, ValueEnum};

use super::core::{ServiceParams, Shedding};
use super::serve::{serve, Counters};
use crate::config::Config;

/// Exit status of a configuration that cannot be used (as `agent`'s).
const EXIT_CONFIG: u8 = 78;

/// The shedding policy, as the command line names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SheddingArg {
    /// DAGOR admission control with the [admission] constants.
    Dagor,
    /// No control: queue everything while the queue has room.
    Off,
    /// Reject each request with probability --random-rate.
    Random,
}

/// The flags of `lbagent demo-service`.
#[derive(Args, Debug, Clone)]
pub struct DemoServiceArgs {
    /// UDP address to serve (port 0 picks a free port; the first line on
    /// stdout says which).
    #[arg(long, default_value = "127.0.0.1:9900")]
    pub bind: SocketAddr,
    /// Workers W: requests processed at once. Capacity is W / S.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub workers: u32,
    /// Service time S of one request, microseconds.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..=60_000_000))]
    pub service_us: u64,
    /// Most requests waiting for a worker; past it a request is answered
    /// Unavailable at once.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub queue: u64,
    /// How to shed load at arrival.
    #[arg(long, value_enum, default_value_t = SheddingArg::Dagor)]
    pub shedding: SheddingArg,
    /// Rejection probability for --shedding random, 0.0..=1.0.
    #[arg(long, default_value_t = 0.0)]
    pub random_rate: f64,
    /// A TOML configuration file whose [admission] section to use.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Override one field: SECTION.FIELD=VALUE (repeatable), e.g.
    /// `--set admission.queuing_threshold_ms=10`.
    #[arg(long = "set", value_name = "SECTION.FIELD=VALUE")]
    pub set: Vec<String>,
}

impl DemoServiceArgs {
    /// The service's parameters with the configuration's admission
    /// constants.
    ///
    /// # Errors
    /// A message naming the bad flag.
    pub fn params(&self, config: &Config) -> Result<ServiceParams, String> {
        let shedding = match self.shedding {
            SheddingArg::Dagor => Shedding::Dagor,
            SheddingArg::Off => Shedding::Off,
            SheddingArg::Random if (0.0..=1.0).contains(&self.random_rate) => Shedding::Random {
                rate: self.random_rate,
            },
            SheddingArg::Random => {
                return Err(format!(
                    "--random-rate {} is out of range: allowed 0.0..=1.0",
                    self.random_rate
                ))
            }
        };
        Ok(ServiceParams {
            workers: self.workers,
            service_us: self.service_us,
            queue: self.queue as usize,
            shedding,
            admission: config.admission.params(),
            seed: fastrand::u64(..),
        })
    }
}

/// Runs `lbagent demo-service` until SIGTERM or SIGINT: exit 0 then, 78 for
/// a bad configuration, 2 for a bad flag, 1 when the socket fails.
pub fn command(args: &DemoServiceArgs) -> ExitCode {
    crate::service::signal::install();
    let config = match Config::load(args.config.as_deref(), &args.set) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lbagent demo-service: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let params = match args.params(&config) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("lbagent demo-service: {e}");
            return ExitCode::from(2);
        }
    };
    let socket = match UdpSocket::bind(args.bind) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lbagent demo-service: cannot bind {}: {e}", args.bind);
            return ExitCode::FAILURE;
        }
    };
    let addr = socket.local_addr().map_or(args.bind, |a| a);
    println!(
        "demo-service listening on {addr}: {} workers x {} us = {:.0} requests/s, queue {}, shedding {:?}",
        params.workers,
        params.service_us,
        params.capacity(),
        params.queue,
        params.shedding
    );
    let stop = AtomicBool::new(false);
    let counters = Counters::default();
    let result = std::thread::scope(|s| {
        let server = s.spawn(|| serve(&socket, params, &stop, &counters));
        while !crate::service::signal::received() && !server.is_finished() {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        stop.store(true, Ordering::Relaxed);
        server.join()
    });
    let load = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    println!(
        "demo-service: {} arrived, {} completed, {} rejected, {} queue full, {} malformed",
        load(&counters.arrived),
        load(&counters.completed),
        load(&counters.rejected),
        load(&counters.queue_full),
        load(&counters.malformed)
    );
    match result {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) => {
            eprintln!("lbagent demo-service: {e}");
            ExitCode::FAILURE
        }
        Err(_) => {
            eprintln!("lbagent demo-service: the service thread panicked");
            ExitCode::FAILURE
        }
    }
}
