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

/// Exit status of an open-loop run in which the generator did not keep
/// the offered rate at some step (the run is marked invalid).
pub const EXIT_INVALID: u8 = 4;

/// Exit status of `qpstest compare` when B is slower than A beyond the
/// runs' noise.
pub const EXIT_SLOWER: u8 = 5;

/// `lbagent qpstest`: T synchronous client threads looping getHost (and a
/// report of success) against the local agent, a line every second, then a
/// summary with latency percentiles and the server's CPU. Only a getHost
/// that returned a host from the agent (or its route cache) counts toward
/// QPS; static-route answers and errors are counted apart, by kind.
///
/// With --rate, an open loop instead: requests sent at a fixed rate
/// whatever the agent does, latency measured from each request's intended
/// send time (coordinated omission corrected) with the uncorrected service
/// time beside it; a list or FROM:TO:STEP sweeps the rates.
///
/// Exit status: 0 the run completed and getHosts were answered; 1 it could
/// not run (one line says why); 3 it ran but no getHost was answered; 4 an
/// open-loop step did not keep its offered rate (the run is invalid).
#[derive(Args, Debug, Clone)]
#[command(args_conflicts_with_subcommands = true)]
pub struct QpstestArgs {
    /// Tools on saved runs (`--json` output) instead of a run.
    #[command(subcommand)]
    pub tool: Option<QpstestTool>,
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
    /// Go through the client's route cache (in the closed loop each thread
    /// then counts on its own and times one call in 64: a cached call is
    /// faster than two clock reads; the open loop times every call).
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
    /// Open loop: offer this many requests per second in all, spread over
    /// the --threads (each thread sends when a request is due and waits for
    /// its answer, so at most --threads are outstanding; a request not sent
    /// within the timeout of its due time is given up as `not_sent`). A
    /// list (`50k,100k`) or FROM:TO:STEP (`50k:500k:50k`) runs one step per
    /// rate, each for --warmup then --duration, and prints one row per step
    /// with the knee marked. `k` and `m` multiply by 1,000 and 1,000,000.
    #[arg(long, value_name = "RATE|LIST|FROM:TO:STEP")]
    pub rate: Option<super::sweep::RatePlan>,
    /// Open loop: how requests arrive, evenly spaced or as a Poisson
    /// process of the same mean rate.
    #[arg(long, value_enum, default_value_t = super::schedule::Arrivals::Constant, requires = "rate")]
    pub arrivals: super::schedule::Arrivals,
    /// Seconds run before the measured window (each step's, in the open
    /// loop), excluded from every figure and file.
    #[arg(long, value_name = "S", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=3_600))]
    pub warmup: u64,
    /// Open loop: run each step this many times; the rows give the medians
    /// and the JSON every round (what `qpstest compare` needs: 3 or more).
    #[arg(long, default_value_t = 1, requires = "rate", value_parser = clap::value_parser!(u32).range(1..=super::open::MAX_ROUNDS as i64))]
    pub rounds: u32,
    /// Write the latency as an HdrHistogram interval log (`.hlog`, one
    /// histogram per second of the measured window, values in ns; the open
    /// loop's from the intended send time, its sweep's steps and rounds
    /// tagged).
    #[arg(long, value_name = "FILE")]
    pub hist_log: Option<PathBuf>,
    /// Write the latency's percentile spectrum as HdrHistogram text
    /// (`.hgrm`, µs); an open-loop sweep's steps go to FILE with -RATE (and
    /// rounds -rN) before the extension.
    #[arg(long, value_name = "FILE")]
    pub percentiles: Option<PathBuf>,
    /// Open loop: draw latency by percentile for each step and the
    /// latency-vs-throughput curve into this PNG.
    #[arg(long, value_name = "FILE.png", requires = "rate")]
    pub plot: Option<PathBuf>,
}

/// `lbagent qpstest compare` and `lbagent qpstest plot`.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum QpstestTool {
    /// Compare two runs (their `--json` output, open or closed loop).
    ///
    /// Each figure side by side (median of the rounds, their range, ratio B/A)
    /// and whether a difference is beyond the runs' own noise (the rounds'
    /// ranges do not overlap and the medians differ by more than 5%; needs
    /// 3 or more rounds a side; from 5 the ranges leave out the lowest and
    /// highest fifth). Exit status: 0 B is not slower, 1 the
    /// files cannot be compared, 5 B is slower beyond the noise.
    Compare(CompareArgs),
    /// Draw open-loop runs (their `--json` output) into one PNG.
    ///
    /// Latency by percentile per step (HdrHistogram's axis), and the
    /// latency-vs-throughput curves, each run named by its file name.
    Plot(PlotArgs),
}

/// `lbagent qpstest compare A.json B.json`.
#[derive(Args, Debug, Clone)]
pub struct CompareArgs {
    /// Run A, the baseline.
    pub a: PathBuf,
    /// Run B, compared with A.
    pub b: PathBuf,
    /// Print the comparison as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `lbagent qpstest plot RUN.json... --out FILE.png`.
#[derive(Args, Debug, Clone)]
pub struct PlotArgs {
    /// The runs, each named in the legend by its file name.
    #[arg(required = true)]
    pub runs: Vec<PathBuf>,
    /// The PNG to write.
    #[arg(long, value_name = "FILE.png")]
    pub out: PathBuf,
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
            warmup: Duration::from_secs(self.warmup),
            hist_log: self.hist_log.clone(),
            percentiles: self.percentiles.clone(),
            open: self.rate.clone().map(|plan| super::open::OpenLoop {
                plan,
                arrivals: self.arrivals,
                rounds: self.rounds,
                plot: self.plot.clone(),
            }),
        }
    }
}

/// Runs `lbagent qpstest` with these arguments: the summary on stdout,
/// failures on stderr as one line. Installs the SIGTERM / SIGINT handler,
/// so that Ctrl-C ends the run early with its summary.
pub fn command(args: &QpstestArgs) -> ExitCode {
    match &args.tool {
        Some(QpstestTool::Compare(c)) => return compare(c),
        Some(QpstestTool::Plot(p)) => return plot(p),
        None => {}
    }
    crate::service::signal::install();
    let mut stdout = std::io::stdout().lock();
    let opts = args.options();
    if opts.open.is_some() {
        return match super::open::run_open(&opts, &mut stdout) {
            Ok(r) if !r.valid => ExitCode::from(EXIT_INVALID),
            Ok(r)
                if r.steps
                    .iter()
                    .all(|s| s.rounds.iter().all(|x| x.get_hosts == 0)) =>
            {
                ExitCode::from(EXIT_NO_ANSWER)
            }
            Ok(_) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("lbagent qpstest: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    match super::run(&opts, &mut stdout) {
        Ok(s) if s.get_hosts > 0 => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(EXIT_NO_ANSWER),
        Err(e) => {
            eprintln!("lbagent qpstest: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Reads a run file (`qpstest --json` output).
fn read_run(path: &std::path::Path) -> anyhow::Result<serde_json::Value> {
    use anyhow::Context;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(text.trim()).with_context(|| {
        format!(
            "{} is not one JSON object (qpstest --json output)",
            path.display()
        )
    })
}

/// `lbagent qpstest compare`.
fn compare(args: &CompareArgs) -> ExitCode {
    let run = || -> anyhow::Result<super::compare::Comparison> {
        let (a, b) = (read_run(&args.a)?, read_run(&args.b)?);
        super::compare::compare(&a, &b).map_err(anyhow::Error::msg)
    };
    match run() {
        Ok(c) => {
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string(&c).expect("a comparison serializes")
                );
            } else {
                println!("A: {}\nB: {}\n{c}", args.a.display(), args.b.display());
            }
            if c.verdict == super::compare::Verdict::Slower && !c.mixed {
                ExitCode::from(EXIT_SLOWER)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("lbagent qpstest compare: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `lbagent qpstest plot`.
fn plot(args: &PlotArgs) -> ExitCode {
    let run = || -> anyhow::Result<()> {
        let runs = args
            .runs
            .iter()
            .map(|p| {
                let name = p
                    .file_stem()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned();
                read_run(p).map(|v| (name, v))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let named: Vec<(&str, &serde_json::Value)> =
            runs.iter().map(|(n, v)| (n.as_str(), v)).collect();
        super::plot::draw(&named, &args.out)
            .map_err(|e| anyhow::anyhow!("cannot draw {}: {e}", args.out.display()))
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lbagent qpstest plot: {e:#}");
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
    fn open_loop_flags_map_to_an_open_loop_and_need_a_rate() {
        let o = parse(&[
            "--rate",
            "50k:150k:50k",
            "--arrivals",
            "poisson",
            "--warmup",
            "2",
            "--rounds",
            "3",
            "--hist-log",
            "/tmp/x.hlog",
            "--percentiles",
            "/tmp/x.hgrm",
            "--plot",
            "/tmp/x.png",
        ])
        .unwrap();
        let open = o.open.expect("an open loop");
        assert_eq!(open.plan.rates(), [50e3, 100e3, 150e3]);
        assert_eq!(open.arrivals, super::super::schedule::Arrivals::Poisson);
        assert_eq!((open.rounds, o.warmup), (3, Duration::from_secs(2)));
        assert_eq!(o.hist_log.unwrap(), PathBuf::from("/tmp/x.hlog"));
        assert_eq!(open.plot.unwrap(), PathBuf::from("/tmp/x.png"));
        // The closed loop takes the files and the warm-up, not the rest.
        let closed = parse(&["--warmup", "1", "--hist-log", "h", "--percentiles", "p"]).unwrap();
        assert!(closed.open.is_none() && closed.hist_log.is_some());
        for bad in [
            &["--arrivals", "poisson"][..],
            &["--rounds", "3"],
            &["--plot", "x.png"],
            &["--rate", "0"],
            &["--rate", "50k", "--rounds", "0"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn compare_and_plot_are_subcommands_that_take_no_run_flags() {
        let tool = |argv: &[&str]| {
            let argv = std::iter::once("qpstest").chain(argv.iter().copied());
            Cli::try_parse_from(argv).map(|c| c.args.tool)
        };
        match tool(&["compare", "a.json", "b.json"]).unwrap() {
            Some(QpstestTool::Compare(c)) => {
                assert_eq!((c.a, c.b), ("a.json".into(), "b.json".into()))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            tool(&["plot", "a.json", "b.json", "--out", "c.png"]).unwrap(),
            Some(QpstestTool::Plot(p)) if p.runs.len() == 2
        ));
        assert!(tool(&["compare", "a.json"]).is_err());
        assert!(tool(&["plot", "a.json"]).is_err(), "--out is required");
        assert!(tool(&["--threads", "3", "compare", "a", "b"]).is_err());
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
