//! The `lbagent` binary: one subcommand per role. See `lbagent --help`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use lbagent::config::{Config, DEFAULT_TOML};
use lbagent::model::NodeAddr;

/// Exit status of a subcommand whose implementation has not landed yet
/// (sysexits EX_UNAVAILABLE).
const EXIT_NOT_BUILT: u8 = 69;
/// Exit status of a configuration that cannot be used (sysexits EX_CONFIG).
const EXIT_CONFIG: u8 = 78;

/// lbagent: a load-balancing agent for every host of a large fleet.
///
/// Applications ask the local agent over UDP for a node of a remote service
/// named by (modid, cmdid) and report how each call went; the agent steers
/// traffic away from overloaded or dead nodes.
///
/// Exit status: 0 success; 1 runtime failure (one line says why); 2 bad
/// command line; 69 the subcommand is not built yet (its issue says when);
/// 78 configuration invalid.
#[derive(Parser, Debug)]
#[command(name = "lbagent", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The agent: UDP shards and the control core. Runs until SIGTERM or
    /// SIGINT (then flushes statistics, writes the snapshot, exits 0).
    Agent(AgentArgs),
    /// The route server ("dnsserver"). Not built yet: arrives with issue #4.
    Dnsserver(ServerArgs),
    /// The reporter. Not built yet: arrives with issue #4.
    Reporter(ServerArgs),
    /// Route server, reporter and agent in one process on the embedded store.
    /// Not built yet: arrives with issue #4.
    Standalone {
        /// Directory of the embedded SQLite store, created on first run.
        #[arg(long, default_value = "./lbagent-data")]
        data: PathBuf,
    },
    /// Edit the routes in the store. Not built yet: arrives with issue #4.
    #[command(subcommand)]
    Route(RouteCommand),
    /// Ask the local agent for a node of a module. Not built yet: arrives
    /// with issue #5.
    Gethost {
        /// Module id.
        modid: u32,
        /// Command id.
        cmdid: u32,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Report a call's result to the local agent. Not built yet: arrives
    /// with issue #5.
    Report {
        /// Module id.
        modid: u32,
        /// Command id.
        cmdid: u32,
        /// The node called, A.B.C.D:PORT.
        node: NodeAddr,
        /// The call's result: 0 success, anything else a failure.
        #[arg(allow_hyphen_values = true)]
        retcode: i32,
        /// The call's time cost in milliseconds.
        #[arg(long, default_value_t = 0)]
        tcost: u32,
    },
    /// The agent's view of a module: every node, its state and counters.
    /// Not built yet: arrives with issue #5.
    Getroute {
        /// Module id.
        modid: u32,
        /// Command id.
        cmdid: u32,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// The load generator. Not built yet: arrives with issue #5.
    Qpstest(QpstestArgs),
}

#[derive(Args, Debug)]
struct AgentArgs {
    /// The TOML configuration file (without it: the built-in defaults).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Validate the configuration (file and overrides), print the verdict
    /// and exit: 0 valid, 78 invalid.
    #[arg(long)]
    check: bool,
    /// Print the documented default configuration file and exit.
    #[arg(long, conflicts_with = "check")]
    print_config: bool,
    /// Override one field: SECTION.FIELD=VALUE (repeatable), e.g.
    /// `--set lb.probe_num=20`. Applied after the file, in order.
    #[arg(long = "set", value_name = "SECTION.FIELD=VALUE")]
    set: Vec<String>,
    /// Override agent.base_port: shard i serves UDP base_port + i.
    #[arg(long, value_name = "PORT")]
    base_port: Option<u16>,
    /// Override agent.shards (0 = one per core but the last).
    #[arg(long, value_name = "N")]
    shards: Option<u32>,
}

#[derive(Args, Debug)]
struct ServerArgs {
    /// The TOML configuration file.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The store: `sqlite:PATH` (embedded default) or a `postgres://` URL.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

#[derive(Subcommand, Debug)]
enum RouteCommand {
    /// Add a node to a module's route.
    Add {
        /// Module id.
        modid: u32,
        /// Command id.
        cmdid: u32,
        /// The node, A.B.C.D:PORT.
        node: NodeAddr,
        /// The node's weight / capacity.
        #[arg(long, default_value_t = 1)]
        weight: u32,
        /// The store: `sqlite:PATH` or a `postgres://` URL.
        #[arg(long, value_name = "URL")]
        store: Option<String>,
    },
    /// Remove a node from a module's route.
    Del {
        /// Module id.
        modid: u32,
        /// Command id.
        cmdid: u32,
        /// The node, A.B.C.D:PORT.
        node: NodeAddr,
        /// The store: `sqlite:PATH` or a `postgres://` URL.
        #[arg(long, value_name = "URL")]
        store: Option<String>,
    },
    /// List routes: all modules, or one.
    List {
        /// Module id (with CMDID: list one module).
        modid: Option<u32>,
        /// Command id.
        cmdid: Option<u32>,
        /// The store: `sqlite:PATH` or a `postgres://` URL.
        #[arg(long, value_name = "URL")]
        store: Option<String>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Debug)]
struct QpstestArgs {
    /// Synchronous client threads.
    #[arg(long, default_value_t = 30)]
    threads: u32,
    /// Seconds to run.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Spread the threads over this many modules.
    #[arg(long, default_value_t = 1)]
    modules: u32,
    /// getHost only, no report after each.
    #[arg(long)]
    no_report: bool,
    /// Go through the client's route cache.
    #[arg(long)]
    cache: bool,
    /// Print the summary as one JSON object.
    #[arg(long)]
    json: bool,
    /// Start an embedded route server, reporter and agent first.
    #[arg(long)]
    standalone: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Agent(args) => agent(args),
        Command::Dnsserver(_) => not_built("dnsserver", 4),
        Command::Reporter(_) => not_built("reporter", 4),
        Command::Standalone { .. } => not_built("standalone", 4),
        Command::Route(_) => not_built("route", 4),
        Command::Gethost { .. } => not_built("gethost", 5),
        Command::Report { .. } => not_built("report", 5),
        Command::Getroute { .. } => not_built("getroute", 5),
        Command::Qpstest(_) => not_built("qpstest", 5),
    }
}

fn agent(args: AgentArgs) -> ExitCode {
    if args.print_config {
        print!("{DEFAULT_TOML}");
        return ExitCode::SUCCESS;
    }
    let mut overrides = args.set.clone();
    if let Some(port) = args.base_port {
        overrides.push(format!("agent.base_port={port}"));
    }
    if let Some(shards) = args.shards {
        overrides.push(format!("agent.shards={shards}"));
    }
    let config = match Config::load(args.config.as_deref(), &overrides) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lbagent agent: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if args.check {
        let source = args
            .config
            .as_ref()
            .map_or("built-in defaults".to_string(), |p| p.display().to_string());
        println!(
            "config ok: {source}; base_port {}, shards {}, route servers {:?}, reporters {:?}",
            config.agent.base_port,
            if config.agent.shards == 0 {
                "auto".to_string()
            } else {
                config.agent.shards.to_string()
            },
            config.agent.route_servers,
            config.agent.reporters
        );
        return ExitCode::SUCCESS;
    }
    match lbagent::agent::runtime::run(&config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lbagent agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn not_built(what: &str, issue: u32) -> ExitCode {
    eprintln!("lbagent {what}: not built yet; it arrives with issue #{issue}");
    ExitCode::from(EXIT_NOT_BUILT)
}
