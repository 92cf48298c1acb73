//! The command line of `lbagent qpstest` and its exit status.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use super::{QpsOptions, Target, DEMO_MODULE, MAX_MODULES, MAX_THREADS};
use crate::model::ModuleId;

/// Exit status of a run that completed but in which no getHost returned a
/// host from the agent (every call failed or came from the static routes).
pub const EXIT_NO_ANSWER: u8 = 3;

/// `lbagent qpstest`: T synchronous client threads looping getHost (and a
/// report of success) against the local agent, a line every second, then a
/// summary with latency percentiles and the server's CPU. Only a getHost
/// that returned a host from the agent (or its route cache) counts toward
/// QPS; static-route answers and errors are counted apart, by kind.
///
/// Exit status: 0 the run completed and getHosts were answered; 1 it could
/// not run (one line says why); 3 it ran but no getHost was answered.
#[derive(Args, Debug, Clone)]
pub struct QpstestArgs {
    /// Synchronous client threads, each with its own client.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(1..=MAX_THREADS as i64))]
    pub threads: u32,
    /// Seconds to measure.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub duration: u64,
    /// Spread the threads over this many modules: (MODID + k, CMDID) for k
    /// in 0..N; thread i uses module i % N (with more modules than threads,
    /// modules i, i + T, i + 2T, ... in turn). With --standalone, each gets
    /// 10 demo nodes.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_MODULES as i64))]
    pub modules: u32,
    /// The first module's id.
    #[arg(long, default_value_t = DEMO_MODULE.modid)]
    pub modid: u32,
    /// The modules' command id.
    #[arg(long, default_value_t = DEMO_MODULE.cmdid)]
    pub cmdid: u32,
    /// getHost only: no report after each.
    #[arg(long)]
    pub no_report: bool,
    /// Hold each host this long before reporting it (0: at once): with a
    /// `balance` module, the unit each getHost takes stays taken meanwhile.
    #[arg(long, value_name = "MS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub hold_ms: u64,
    /// Go through the client's route cache (each thread then counts on
    /// its own and times one call in 64: a cached call is faster than two
    /// clock reads).
    #[arg(long)]
    pub cache: bool,
    /// getHost timeout, milliseconds (a getHost that times out is counted
    /// as a `timeout` error).
    #[arg(long, value_name = "MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    pub timeout_ms: u64,
    /// Print the summary as one JSON object on stdout (the live lines go
    /// to stderr).
    #[arg(long)]
    pub json: bool,
    /// The heartbeat file of the agent to measure (default:
    /// $LBAGENT_HEARTBEAT, else /run/lbagent/heartbeat).
    #[arg(long, value_name = "PATH", conflicts_with_all = ["floor", "standalone"])]
    pub heartbeat: Option<PathBuf>,
    /// Measure the floor instead: a bare recvmmsg/sendmmsg loop started in
    /// this process that answers every getHost with a fixed host.
    #[arg(long, conflicts_with = "standalone")]
    pub floor: bool,
    /// Start an embedded route server, reporter and agent with the demo
    /// modules first, and measure them.
    #[arg(long)]
    pub standalone: bool,
    /// getHosts carry DAGOR priorities: `B:SHARE,...` (e.g. `5:0.2,60:0.8`),
    /// each getHost's business priority B drawn by share (shares are
    /// normalized), its user priority uniform in 1..=128. The summary then
    /// counts each class apart: calls, answered, Rejected, other errors,
    /// latency.
    #[arg(long, value_name = "B:SHARE,...")]
    pub priority_mix: Option<super::mix::PriorityMix>,
    /// How the clients talk to the agent: `udp`, `shm` (the agent's
    /// shared-memory regions; a --standalone agent then offers them, an
    /// agent given by --heartbeat must have `[shm] enabled`), or `local`
    /// (the agent's local Unix socket, `agent.local_socket`).
    #[arg(long, value_enum, default_value_t = super::Transport::Udp)]
    pub transport: super::Transport,
    /// With --standalone: the agent's shards (default: its own, cores - 1).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1024))]
    pub shards: u32,
}

impl QpstestArgs {
    /// The run these arguments describe.
    pub fn options(&self) -> QpsOptions {
        let target = if self.floor {
            Target::Floor
        } else if self.standalone {
            Target::Standalone
        } else {
            Target::Heartbeat(
                self.heartbeat
                    .clone()
                    .unwrap_or_else(|| crate::client::ClientOptions::default().heartbeat_path),
            )
        };
        QpsOptions {
            target,
            threads: self.threads,
            duration: Duration::from_secs(self.duration),
            modules: self.modules,
            first_module: ModuleId::new(self.modid, self.cmdid),
            report: !self.no_report,
            hold: Duration::from_millis(self.hold_ms),
            cache: self.cache,
            timeout: Duration::from_millis(self.timeout_ms),
            json: self.json,
            priority_mix: self.priority_mix.clone(),
            transport: self.transport,
            shards: self.shards,
        }
    }
}

/// Runs `lbagent qpstest` with these arguments: the summary on stdout,
/// failures on stderr as one line. Installs the SIGTERM / SIGINT handler,
/// so that Ctrl-C ends the run early with its summary.
pub fn command(args: &QpstestArgs) -> ExitCode {
    crate::service::signal::install();
    let mut stdout = std::io::stdout().lock();
    match super::run(&args.options(), &mut stdout) {
        Ok(s) if s.get_hosts > 0 => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(EXIT_NO_ANSWER),
        Err(e) => {
            eprintln!("lbagent qpstest: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: QpstestArgs,
    }

    fn parse(argv: &[&str]) -> Result<QpsOptions, clap::Error> {
        let argv = std::iter::once("qpstest").chain(argv.iter().copied());
        Cli::try_parse_from(argv).map(|c| c.args.options())
    }

    #[test]
    fn defaults_are_the_original_measurement() {
        let o = parse(&[]).unwrap();
        assert_eq!(o.threads, 30);
        assert_eq!(o.duration, Duration::from_secs(10));
        assert_eq!((o.modules, o.first_module), (1, DEMO_MODULE));
        assert!(o.report && !o.cache && !o.json);
        assert!(matches!(o.target, Target::Heartbeat(_)));
    }

    #[test]
    fn flags_map_to_options() {
        let o = parse(&[
            "--threads",
            "4",
            "--duration",
            "2",
            "--modules",
            "3",
            "--modid",
            "7",
            "--cmdid",
            "9",
            "--no-report",
            "--cache",
            "--json",
            "--timeout-ms",
            "250",
            "--floor",
        ])
        .unwrap();
        assert_eq!((o.threads, o.modules), (4, 3));
        assert_eq!(o.duration, Duration::from_secs(2));
        assert_eq!(o.module(2), ModuleId::new(9, 9));
        assert!(!o.report && o.cache && o.json);
        assert_eq!(o.timeout, Duration::from_millis(250));
        assert_eq!(o.target, Target::Floor);
        let o = parse(&["--heartbeat", "/x/hb"]).unwrap();
        assert_eq!(o.target, Target::Heartbeat("/x/hb".into()));
        assert_eq!(parse(&["--standalone"]).unwrap().target, Target::Standalone);
        let o = parse(&["--priority-mix", "5:0.2,60:0.8"]).unwrap();
        assert_eq!(o.priority_mix.unwrap().classes(), &[(5, 0.2), (60, 0.8)]);
        assert!(parse(&["--priority-mix", "200:1"]).is_err());
    }

    #[test]
    fn nonsense_is_refused_by_the_parser() {
        for bad in [
            &["--threads", "0"][..],
            &["--duration", "0"],
            &["--modules", "0"],
            &["--timeout-ms", "0"],
            &["--floor", "--standalone"],
            &["--floor", "--heartbeat", "/x"],
            &["--threads", "many"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
