//! The `lbagent` binary: one subcommand per role. See `lbagent --help`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use lbagent::config::reload::Role;
use lbagent::config::{Config, ConfigSource, DEFAULT_TOML};
use lbagent::model::{Label, Labels, ModuleId, NodeAddr, NodeMeta, Policy, RouteNode, Zone};
use lbagent::store::table::{self, TableFormat};
use lbagent::store::{self, ModuleRoute, StoreError, StoreUrl};

/// Exit status of a configuration that cannot be used (sysexits EX_CONFIG).
const EXIT_CONFIG: u8 = 78;
/// Exit status of a bad command line (as clap's).
const EXIT_USAGE: u8 = 2;
/// Exit status of a refused route change (sysexits EX_DATAERR).
const EXIT_REFUSED: u8 = 65;

/// lbagent: a load-balancing agent for every host of a large fleet.
///
/// Applications ask the local agent over UDP for a node of a remote service
/// named by (modid, cmdid) and report how each call went; the agent steers
/// traffic away from overloaded or dead nodes.
///
/// Exit status: 0 success; 1 runtime failure (one line says why); 2 bad
/// command line; 78 configuration invalid; the tool commands (gethost,
/// report, getroute) and `route` have their own, in their --help.
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
    /// The route server ("dnsserver"): serves route pulls over TCP from
    /// memory, pushes changes to the agents that asked. Runs until SIGTERM
    /// or SIGINT.
    Dnsserver(ServerArgs),
    /// The reporter: writes the agents' call statistics into the store.
    /// Runs until SIGTERM or SIGINT.
    Reporter(ServerArgs),
    /// Route server, reporter and agent in one process on the embedded
    /// SQLite store in DIR (created on first run). Runs until SIGTERM or
    /// SIGINT. Listens on loopback: route server 7777, reporter 7778, agent
    /// 8888.. (change with --set, e.g. --set agent.base_port=9000).
    Standalone(StandaloneArgs),
    /// Edit or list the routes in the store. Each change is one
    /// transaction (routes, version, change log): route servers push it to
    /// the agents within a second. A SQLite store is never created unless
    /// `route add --create` asks (or standalone's first start made it).
    /// Exit status: 0 done; 1 store unavailable or missing; 2 bad command
    /// line (an unparseable or non-unicast address, port 0 or above 65535,
    /// a weight outside 1..=1000000; an import table with bad rows, or
    /// unreadable); 65 refused (a duplicate node,
    /// deleting what is not there), nothing changed.
    #[command(subcommand)]
    Route(RouteCommand),
    /// Ask the local agent for a node of a module, through the client
    /// library (found through its heartbeat; from its static route file
    /// when it is down). Exit status: 0 a node; 3 no such module; 4 every
    /// node overloaded; 5 rejected by admission control; 6 agent down;
    /// 7 agent down and no usable static route; 8 timeout; 9 bad response;
    /// 10 bad argument.
    Gethost(lbagent::client_tools::GethostArgs),
    /// Report a call's result to the local agent (exit status as gethost).
    Report(lbagent::client_tools::ReportArgs),
    /// The agent's view of a module: every node, its state and counters
    /// (exit status as gethost).
    Getroute(lbagent::client_tools::GetrouteArgs),
    /// The load generator: T synchronous client threads looping getHost
    /// (+ report) against the local agent, the floor or an embedded
    /// standalone system; live line every second, summary with latency
    /// percentiles. Only getHosts that returned a host count as QPS.
    /// With --rate, an open loop at fixed rates (or a sweep) with latency
    /// from each request's intended send time; `qpstest compare` and
    /// `qpstest plot` work on saved `--json` runs.
    Qpstest(lbagent::qpstest::QpstestArgs),
    /// A UDP service of fixed capacity (W workers x service time S) that
    /// sheds load with DAGOR admission control, or randomly, or not at all,
    /// and attaches its admission level to every response: the subject of
    /// the DAGOR experiment (bench/dagor.rs). Runs until SIGTERM or SIGINT.
    DemoService(lbagent::demo_service::DemoServiceArgs),
}

/// The log's flags, shared by the long-running subcommands.
#[derive(Args, Debug, Clone)]
struct LogArgs {
    /// The least severe level logged: off, error, warn, info, debug, trace
    /// (overrides log.level; a reload keeps it).
    #[arg(long, value_name = "LEVEL")]
    log_level: Option<String>,
    /// text (one line per event) or json (one object per line) (overrides
    /// log.format).
    #[arg(long, value_name = "text|json")]
    log_format: Option<String>,
}

impl LogArgs {
    /// The flags as `--set` overrides (after the file, so they win).
    fn overrides(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(l) = &self.log_level {
            out.push(format!("log.level={}", toml_string(l)));
        }
        if let Some(f) = &self.log_format {
            out.push(format!("log.format={}", toml_string(f)));
        }
        out
    }
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
    #[command(flatten)]
    log: LogArgs,
}

#[derive(Args, Debug)]
struct ServerArgs {
    /// The TOML configuration file (without it: the built-in defaults).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The store: `sqlite:PATH` (embedded default) or a `postgres://` URL.
    /// Overrides store.url.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// Override one field: SECTION.FIELD=VALUE (repeatable), e.g.
    /// `--set dnsserver.listen=127.0.0.1:7777`.
    #[arg(long = "set", value_name = "SECTION.FIELD=VALUE")]
    set: Vec<String>,
    /// Validate the configuration, print the verdict and exit: 0 valid,
    /// 78 invalid.
    #[arg(long)]
    check: bool,
    #[command(flatten)]
    log: LogArgs,
}

#[derive(Args, Debug)]
struct StandaloneArgs {
    /// Data directory: the SQLite store (lbagent.db) and the static route
    /// file (routes.snapshot) live here; created on first run.
    #[arg(long, value_name = "DIR", default_value = "./lbagent-data")]
    data: PathBuf,
    /// A TOML configuration file for the three parts (store.url and
    /// agent.snapshot_path are replaced by files in DIR).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Override one field: SECTION.FIELD=VALUE (repeatable).
    #[arg(long = "set", value_name = "SECTION.FIELD=VALUE")]
    set: Vec<String>,
    #[command(flatten)]
    log: LogArgs,
}

#[derive(Subcommand, Debug)]
enum RouteCommand {
    /// Add a node to a module's route.
    Add {
        /// Module id.
        modid: u32,
        /// Command id.
        cmdid: u32,
        /// The node, A.B.C.D:PORT: a unicast address (not 0.0.0.0,
        /// 255.255.255.255 or multicast) and a port in 1..=65535.
        #[arg(value_parser = unicast_node)]
        node: NodeAddr,
        /// The node's weight / capacity (balance policy), 1..=1000000.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(store::MAX_WEIGHT)))]
        weight: u32,
        /// The node's zone (a data centre, a rack, a cloud zone): 1 to 63
        /// characters of A-Z a-z 0-9 . _ -. Agents whose agent.zone is the
        /// same prefer it.
        #[arg(long, value_name = "ZONE", value_parser = parse_zone)]
        zone: Option<Zone>,
        /// A label of the node, KEY=VALUE (e.g. version=canary; a key of 1
        /// to 63 characters, a value of 0 to 63, of A-Z a-z 0-9 . _ -);
        /// repeat for more, at most 16, each key once. `gethost --select`
        /// picks among the nodes whose labels match.
        #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
        labels: Vec<Label>,
        /// The store: `sqlite:PATH` or a `postgres://` URL (default: store.url
        /// of --config, else sqlite:./lbagent-data/lbagent.db, the
        /// standalone default).
        #[arg(long, value_name = "URL")]
        store: Option<String>,
        /// A configuration file whose store.url to use.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Create the SQLite store when its file does not exist (without
        /// it, a path that names no file is an error: a mistyped path
        /// never becomes a new, empty store).
        #[arg(long)]
        create: bool,
    },
    /// Show or set the zone and labels of a node the module has. Given
    /// options replace what they name (`--label` replaces every label);
    /// the others keep theirs; none: show them. One versioned change,
    /// pushed to every agent following the module.
    Meta {
        /// Module id.
        modid: u32,
        /// Command id.
        cmdid: u32,
        /// The node, A.B.C.D:PORT.
        node: NodeAddr,
        /// The node's zone: 1 to 63 characters of A-Z a-z 0-9 . _ -.
        #[arg(long, value_name = "ZONE", value_parser = parse_zone, conflicts_with = "no_zone")]
        zone: Option<Zone>,
        /// Clear the node's zone.
        #[arg(long)]
        no_zone: bool,
        /// A label, KEY=VALUE; repeat for more (at most 16, each key
        /// once). The node's labels become exactly these.
        #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label, conflicts_with = "no_labels")]
        labels: Vec<Label>,
        /// Clear the node's labels.
        #[arg(long)]
        no_labels: bool,
        /// The store: `sqlite:PATH` or a `postgres://` URL (default as for add).
        #[arg(long, value_name = "URL")]
        store: Option<String>,
        /// A configuration file whose store.url to use.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Remove a node from a module's route.
    Del {
        /// Module id.
        modid: u32,
        /// Command id.
        cmdid: u32,
        /// The node, A.B.C.D:PORT.
        node: NodeAddr,
        /// The store: `sqlite:PATH` or a `postgres://` URL (default as for add).
        #[arg(long, value_name = "URL")]
        store: Option<String>,
        /// A configuration file whose store.url to use.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Apply a whole route table from FILE in one transaction and one
    /// route version: CSV with a header (modid,cmdid,ip,port,weight, and
    /// optionally zone and labels, labels as k=v;k2=v2) or JSON lines
    /// ({"modid":..,"cmdid":..,"ip":"A.B.C.D","port":..,"weight":..},
    /// optionally "zone":"..","labels":"k=v,k2=v2"),
    /// picked by the extension (.csv; .jsonl, .ndjson, .json), else by the
    /// first line ({ means JSON lines). Every row is checked first with
    /// route add's rules; any bad row: all of them are named by line (exit
    /// 2) and nothing changes. Without --replace the nodes are added, and
    /// a node a module has already refuses the whole table (exit 65), as
    /// route add does.
    Import {
        /// The table file (`-`: standard input).
        file: PathBuf,
        /// Each module named in the file ends with exactly the file's
        /// nodes (its other nodes are deleted); modules not named are
        /// untouched.
        #[arg(long)]
        replace: bool,
        /// The file's format, instead of detecting it.
        #[arg(long, value_name = "csv|jsonl")]
        format: Option<TableFormat>,
        /// The store: `sqlite:PATH` or a `postgres://` URL (default as for add).
        #[arg(long, value_name = "URL")]
        store: Option<String>,
        /// A configuration file whose store.url to use.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Create the SQLite store when its file does not exist.
        #[arg(long)]
        create: bool,
    },
    /// Write every route to standard output as a table that `route
    /// import` reads back unchanged (one row per node, in module and node
    /// order).
    Export {
        /// csv (with its header) or jsonl.
        #[arg(long, value_name = "csv|jsonl", default_value = "csv")]
        format: TableFormat,
        /// The store: `sqlite:PATH` or a `postgres://` URL (default as for add).
        #[arg(long, value_name = "URL")]
        store: Option<String>,
        /// A configuration file whose store.url to use.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Set a module's policy: `l5` (the default: round robin with the
    /// L5 overload rules, by the nodes' weights when they differ),
    /// `balance` (seed 002: a node's weight is its capacity in units,
    /// getHost takes a unit and report returns it) or `p2c` (power of two
    /// choices over each node's peak-EWMA time cost times its outstanding
    /// getHosts + 1, with L5's overload rules). One versioned change: every
    /// agent following the module gets it within a push.
    Policy {
        /// Module id.
        modid: u32,
        /// Command id.
        cmdid: u32,
        /// `l5`, `balance` or `p2c`.
        #[arg(value_parser = parse_policy)]
        policy: Policy,
        /// The store: `sqlite:PATH` or a `postgres://` URL (default as for add).
        #[arg(long, value_name = "URL")]
        store: Option<String>,
        /// A configuration file whose store.url to use.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Show a module's own load-balancing options, or set those given
    /// (the others keep theirs); `default` unsets one, so that the
    /// agent's `[lb]` default applies. One versioned change, pushed as
    /// the policy is.
    Options {
        /// Module id.
        modid: u32,
        /// Command id.
        cmdid: u32,
        /// Milliseconds over which a node entering the idle list ramps to
        /// its full weight, 0..=3600000 (0 = off), or `default`.
        #[arg(long, value_name = "MS|default", value_parser = parse_slow_start)]
        slow_start_ms: Option<Setting>,
        /// The most nodes, percent, the overload rules mark overloaded at
        /// once, 1..=100 (100 = no limit), or `default`.
        #[arg(long, value_name = "PERCENT|default", value_parser = parse_max_overloaded)]
        max_overloaded_percent: Option<Setting>,
        /// Below this idle share, percent, getHost answers round robin
        /// over every node instead of overloaded, 0..=100 (0 = off), or
        /// `default`.
        #[arg(long, value_name = "PERCENT|default", value_parser = parse_percent)]
        panic_percent: Option<Setting>,
        /// Below this idle share of the agent's zone, percent, getHost
        /// spills over to other zones, 0..=100, or `default`.
        #[arg(long, value_name = "PERCENT|default", value_parser = parse_percent)]
        locality_min_percent: Option<Setting>,
        /// Print the options as one JSON object.
        #[arg(long)]
        json: bool,
        /// The store: `sqlite:PATH` or a `postgres://` URL (default as for add).
        #[arg(long, value_name = "URL")]
        store: Option<String>,
        /// A configuration file whose store.url to use.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// List routes: all modules, or one.
    List {
        /// Module id (with CMDID: list one module).
        modid: Option<u32>,
        /// Command id.
        cmdid: Option<u32>,
        /// The store: `sqlite:PATH` or a `postgres://` URL (default as for add).
        #[arg(long, value_name = "URL")]
        store: Option<String>,
        /// A configuration file whose store.url to use.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Agent(args) => agent(args),
        Command::Dnsserver(args) => server("dnsserver", args),
        Command::Reporter(args) => server("reporter", args),
        Command::Standalone(args) => standalone(args),
        Command::Route(cmd) => {
            // The store's warnings (a bad row skipped) reach standard error.
            lbagent::service::logging::init(&Default::default());
            route(cmd)
        }
        Command::Gethost(args) => lbagent::client_tools::gethost(&args).emit(),
        Command::Report(args) => lbagent::client_tools::report(&args).emit(),
        Command::Getroute(args) => lbagent::client_tools::getroute(&args).emit(),
        Command::Qpstest(args) => {
            // What an embedded standalone system logs (--standalone).
            lbagent::service::logging::init(&Default::default());
            lbagent::qpstest::command(&args)
        }
        Command::DemoService(args) => lbagent::demo_service::command(&args),
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
    overrides.extend(args.log.overrides());
    let source = ConfigSource::new(args.config.clone(), overrides);
    let config = match source.load() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lbagent agent: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if args.check {
        if let Err(code) = check_tls("agent", &config.tls) {
            return code;
        }
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
    lbagent::service::logging::init(&config.log);
    match lbagent::agent::runtime::run(&config, source) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("lbagent agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Loads the configuration for a server subcommand: the file, then
/// `--store`, then the `--set` overrides (and where it came from, for a
/// reload).
fn server_config(
    what: &str,
    config: Option<&std::path::Path>,
    store: Option<&str>,
    set: &[String],
) -> Result<(Config, StoreUrl, ConfigSource), ExitCode> {
    let mut overrides = Vec::new();
    if let Some(url) = store {
        overrides.push(format!("store.url={}", toml_string(url)));
    }
    overrides.extend_from_slice(set);
    let source = ConfigSource::new(config.map(|p| p.to_path_buf()), overrides);
    let config = source.load().map_err(|e| {
        eprintln!("lbagent {what}: {e}");
        ExitCode::from(EXIT_CONFIG)
    })?;
    let url = config.store.url.parse::<StoreUrl>().map_err(|e| {
        eprintln!("lbagent {what}: {e}");
        ExitCode::from(EXIT_CONFIG)
    })?;
    // sslmode=verify-ca/verify-full without sslrootcert=: the fleet's CA.
    let url = match config.tls.enabled() {
        true => store::with_default_ca(url, &config.tls.ca),
        false => url,
    };
    Ok((config, url, source))
}

/// `--check`: the `[tls]` files load (when TLS is on); otherwise one line
/// naming the file and what is wrong, and the configuration exit status.
fn check_tls(what: &str, tls: &lbagent::config::TlsConfig) -> Result<(), ExitCode> {
    if !tls.enabled() {
        return Ok(());
    }
    lbagent::tls::Tls::load(tls).map(drop).map_err(|e| {
        eprintln!("lbagent {what}: {e}");
        ExitCode::from(EXIT_CONFIG)
    })
}

/// A TOML basic string holding `s`.
fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

fn server(what: &str, args: ServerArgs) -> ExitCode {
    let mut set = args.set.clone();
    set.extend(args.log.overrides());
    let (config, url, source) =
        match server_config(what, args.config.as_deref(), args.store.as_deref(), &set) {
            Ok(c) => c,
            Err(code) => return code,
        };
    if args.check {
        if let Err(code) = check_tls(what, &config.tls) {
            return code;
        }
        let listen = if what == "dnsserver" {
            config.dnsserver.listen
        } else {
            config.reporter.listen
        };
        println!("config ok: {what} on {listen}, store {url}");
        return ExitCode::SUCCESS;
    }
    lbagent::service::logging::init(&config.log);
    let _span = if what == "dnsserver" {
        tracing::info_span!("dnsserver").entered()
    } else {
        tracing::info_span!("reporter").entered()
    };
    // A reload changes the log level live; the server's own fields need a
    // restart (refused, named).
    let role = if what == "dnsserver" {
        Role::Dnsserver
    } else {
        Role::Reporter
    };
    let tls = match lbagent::tls::Tls::from_config(&config.tls, what) {
        Ok(tls) => tls,
        Err(e) => {
            tracing::error!("cannot start mutual TLS: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let mut current = config.clone();
    let reload_tls = tls.clone();
    lbagent::service::signal::on_reload(move || {
        // The TLS files are read again whatever the configuration says.
        if let Some(tls) = &reload_tls {
            tls.reload();
        }
        lbagent::service::reload::reload(role, &source, &mut current, |_, _, _| Ok(()))
    });
    let result = if what == "dnsserver" {
        lbagent::dnsserver::run(&config.dnsserver, url, tls)
    } else {
        lbagent::reporter::run(&config.reporter, url, tls)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("lbagent {what}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn standalone(args: StandaloneArgs) -> ExitCode {
    let mut opts = lbagent::standalone::StandaloneOptions::new(&args.data);
    // The standalone defaults (loopback listeners) under the file and the
    // overrides.
    let mut set = args.set.clone();
    set.extend(args.log.overrides());
    opts.config = match Config::load_onto(&opts.config, args.config.as_deref(), &set) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lbagent standalone: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    lbagent::service::logging::init(&opts.config.log);
    let _span = tracing::info_span!("standalone").entered();
    match lbagent::standalone::run(opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("lbagent standalone: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn route(cmd: RouteCommand) -> ExitCode {
    let (store_arg, config) = match &cmd {
        RouteCommand::Add { store, config, .. }
        | RouteCommand::Meta { store, config, .. }
        | RouteCommand::Del { store, config, .. }
        | RouteCommand::Import { store, config, .. }
        | RouteCommand::Export { store, config, .. }
        | RouteCommand::Policy { store, config, .. }
        | RouteCommand::Options { store, config, .. }
        | RouteCommand::List { store, config, .. } => (store.clone(), config.clone()),
    };
    // An import's table is read and checked before the store is opened:
    // a bad table never touches (or creates) a store.
    let rows = match &cmd {
        RouteCommand::Import { file, format, .. } => match read_table(file, *format) {
            Ok(rows) => Some(rows),
            Err(code) => return code,
        },
        _ => None,
    };
    let (_, url, _) = match server_config("route", config.as_deref(), store_arg.as_deref(), &[]) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let create = matches!(
        cmd,
        RouteCommand::Add { create: true, .. } | RouteCommand::Import { create: true, .. }
    );
    let opened = if create {
        store::open(&url)
    } else {
        store::open_existing(&url)
    };
    let mut db = match opened {
        Ok(s) => s,
        Err(e @ StoreError::Missing { .. }) => {
            eprintln!(
                "lbagent route: {e} (`route add --create` or `route import --create` makes a new store)"
            );
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("lbagent route: {e}");
            return ExitCode::FAILURE;
        }
    };
    let refused = |e: StoreError| {
        eprintln!("lbagent route: {e}");
        match e {
            StoreError::Unavailable { .. }
            | StoreError::SchemaTooNew { .. }
            | StoreError::Missing { .. }
            | StoreError::Replaced { .. } => ExitCode::FAILURE,
            StoreError::BadUrl(_) => ExitCode::from(EXIT_CONFIG),
            _ => ExitCode::from(EXIT_REFUSED),
        }
    };
    match cmd {
        RouteCommand::Add {
            modid,
            cmdid,
            node,
            weight,
            zone,
            labels,
            ..
        } => {
            let module = ModuleId::new(modid, cmdid);
            let labels = match labels_of(labels) {
                Ok(l) => l,
                Err(code) => return code,
            };
            let meta = NodeMeta { zone, labels };
            match db.add_node_meta(module, RouteNode { addr: node, weight }, &meta) {
                Ok(v) => {
                    println!(
                        "added {node} (weight {weight}{}) to module {module}; route version {v}",
                        meta_text(&meta)
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => refused(e),
            }
        }
        RouteCommand::Meta {
            modid,
            cmdid,
            node,
            zone,
            no_zone,
            labels,
            no_labels,
            ..
        } => {
            let module = ModuleId::new(modid, cmdid);
            let held = match db.list(Some(module)) {
                Ok(routes) => routes
                    .first()
                    .filter(|r| r.nodes.iter().any(|n| n.addr == node))
                    .map(|r| {
                        r.meta
                            .iter()
                            .find(|(a, _)| *a == node)
                            .map(|(_, m)| m.clone())
                            .unwrap_or_default()
                    }),
                Err(e) => return refused(e),
            };
            let Some(mut meta) = held else {
                return refused(StoreError::NotFound { module, node });
            };
            let change = zone.is_some() || no_zone || !labels.is_empty() || no_labels;
            if !change {
                println!("module {module} node {node}{}", meta_text(&meta));
                return ExitCode::SUCCESS;
            }
            if let Some(z) = zone {
                meta.zone = Some(z);
            } else if no_zone {
                meta.zone = None;
            }
            if !labels.is_empty() {
                meta.labels = match labels_of(labels) {
                    Ok(l) => l,
                    Err(code) => return code,
                };
            } else if no_labels {
                meta.labels = Labels::default();
            }
            match db.set_meta(module, node, &meta) {
                Ok(v) => {
                    println!(
                        "module {module} node {node}{}; route version {v}",
                        meta_text(&meta)
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => refused(e),
            }
        }
        RouteCommand::Del {
            modid, cmdid, node, ..
        } => {
            let module = ModuleId::new(modid, cmdid);
            match db.del_node(module, node) {
                Ok(v) => {
                    println!("deleted {node} from module {module}; route version {v}");
                    ExitCode::SUCCESS
                }
                Err(e) => refused(e),
            }
        }
        RouteCommand::Policy {
            modid,
            cmdid,
            policy,
            ..
        } => {
            let module = ModuleId::new(modid, cmdid);
            match db.set_policy(module, policy) {
                Ok(v) => {
                    println!("module {module} policy {policy}; route version {v}");
                    ExitCode::SUCCESS
                }
                Err(e) => refused(e),
            }
        }
        RouteCommand::Options {
            modid,
            cmdid,
            slow_start_ms,
            max_overloaded_percent,
            panic_percent,
            locality_min_percent,
            json,
            ..
        } => {
            let module = ModuleId::new(modid, cmdid);
            let held = match db.list(Some(module)) {
                Ok(routes) => routes.first().map(|r| r.options).unwrap_or_default(),
                Err(e) => return refused(e),
            };
            let mut options = held;
            apply_setting(&mut options.slow_start_ms, slow_start_ms);
            let narrow = |s: Option<Setting>| {
                s.map(|s| match s {
                    Setting::Default => Setting::Default,
                    Setting::Value(v) => Setting::Value(v.min(100)),
                })
            };
            let pct = |field: &mut Option<u8>, s: Option<Setting>| {
                let mut wide = field.map(u32::from);
                apply_setting(&mut wide, narrow(s));
                *field = wide.map(|v| v as u8);
            };
            pct(&mut options.max_overloaded_percent, max_overloaded_percent);
            pct(&mut options.panic_percent, panic_percent);
            pct(&mut options.locality_min_percent, locality_min_percent);
            let mut version = None;
            if options != held {
                match db.set_options(module, options) {
                    Ok(v) => version = Some(v),
                    Err(e) => return refused(e),
                }
            }
            if json {
                println!("{}", options_json(module, &options, version));
            } else {
                match version {
                    Some(v) => println!("module {module} {options}; route version {v}"),
                    None => println!("module {module} {options}"),
                }
            }
            ExitCode::SUCCESS
        }
        RouteCommand::Import { replace, .. } => {
            let t = rows.unwrap_or_default();
            match db.import_table(&t.rows, &t.meta, replace) {
                Ok(i) => {
                    println!(
                        "imported {} nodes of {} modules{}; route version {}",
                        i.nodes,
                        i.modules,
                        if replace { " (replaced)" } else { "" },
                        i.version
                    );
                    ExitCode::SUCCESS
                }
                Err(e @ StoreError::BadInput(_)) => {
                    eprintln!("lbagent route import: {e}");
                    ExitCode::from(EXIT_USAGE)
                }
                Err(e) => refused(e),
            }
        }
        RouteCommand::Export { format, .. } => {
            let routes = match db.load_all() {
                Ok(r) => r.modules,
                Err(e) => return refused(e),
            };
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::with_capacity(1 << 16, stdout.lock());
            match table::write(&mut out, &routes, format).and_then(|()| {
                use std::io::Write;
                out.flush()
            }) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("lbagent route export: cannot write: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        RouteCommand::List {
            modid, cmdid, json, ..
        } => {
            let module = match (modid, cmdid) {
                (Some(m), Some(c)) => Some(ModuleId::new(m, c)),
                (None, None) => None,
                _ => {
                    eprintln!("lbagent route list: give both MODID and CMDID, or neither");
                    return ExitCode::from(EXIT_USAGE);
                }
            };
            let routes = match db.list(module) {
                Ok(r) => r,
                Err(e) => return refused(e),
            };
            let version = match db.route_version() {
                Ok(v) => v,
                Err(e) => return refused(e),
            };
            if json {
                println!("{}", routes_json(version, &routes));
            } else {
                print!("{}", routes_text(version, &routes));
            }
            ExitCode::SUCCESS
        }
    }
}

/// `route import`'s table: read, its format detected (unless given) and
/// every row checked. Bad rows or an unreadable file: one message, exit 2.
fn read_table(
    file: &std::path::Path,
    format: Option<TableFormat>,
) -> Result<table::Table, ExitCode> {
    let read = if file.as_os_str() == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map(|_| s)
    } else {
        std::fs::read_to_string(file)
    };
    let text = read.map_err(|e| {
        eprintln!("lbagent route import: cannot read {}: {e}", file.display());
        ExitCode::from(EXIT_USAGE)
    })?;
    let format = format.unwrap_or_else(|| TableFormat::detect(file, &text));
    table::parse(&text, format).map_err(|bad| {
        eprintln!("lbagent route import: {}: {bad}", file.display());
        ExitCode::from(EXIT_USAGE)
    })
}

/// `--zone`: a zone name within the model's bounds.
fn parse_zone(s: &str) -> Result<Zone, String> {
    s.parse().map_err(|e| format!("{e}"))
}

/// `--label`: one `KEY=VALUE` within the model's bounds.
fn parse_label(s: &str) -> Result<Label, String> {
    s.parse().map_err(|e| format!("{e}"))
}

/// The `--label`s given as a node's labels: at most 16, each key once;
/// otherwise the reason on standard error and exit 2.
fn labels_of(labels: Vec<Label>) -> Result<Labels, ExitCode> {
    Labels::new(labels).map_err(|e| {
        eprintln!("lbagent route: --label: {e}");
        ExitCode::from(EXIT_USAGE)
    })
}

/// `, zone Z, labels k=v,...` for what `meta` has (nothing for none).
fn meta_text(meta: &NodeMeta) -> String {
    let mut out = String::new();
    if let Some(z) = &meta.zone {
        out.push_str(&format!(", zone {z}"));
    }
    if !meta.labels.is_empty() {
        out.push_str(&format!(", labels {}", meta.labels));
    }
    if meta.is_empty() {
        out.push_str(", no zone, no labels");
    }
    out
}

/// A policy name, `l5`, `balance` or `p2c`.
fn parse_policy(s: &str) -> Result<Policy, String> {
    s.parse().map_err(|e| format!("{e}"))
}

/// A module option on the command line: a value, or `default` (unset).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Setting {
    /// Unset: the agent's `[lb]` default applies.
    Default,
    /// This value.
    Value(u32),
}

/// `default` or a whole number in `lo..=hi`, for the option `what`.
fn parse_setting(s: &str, lo: u32, hi: u32, what: &str) -> Result<Setting, String> {
    if s == "default" {
        return Ok(Setting::Default);
    }
    match s.parse::<u32>() {
        Ok(v) if (lo..=hi).contains(&v) => Ok(Setting::Value(v)),
        _ => Err(format!(
            "{what} {s:?} is not `default` or a whole number in {lo}..={hi}"
        )),
    }
}

/// `--slow-start-ms`: `default` or 0..=3600000.
fn parse_slow_start(s: &str) -> Result<Setting, String> {
    parse_setting(s, 0, 3_600_000, "slow_start_ms")
}

/// `--max-overloaded-percent`: `default` or 1..=100.
fn parse_max_overloaded(s: &str) -> Result<Setting, String> {
    parse_setting(s, 1, 100, "max_overloaded_percent")
}

/// A percent option: `default` or 0..=100.
fn parse_percent(s: &str) -> Result<Setting, String> {
    parse_setting(s, 0, 100, "the percentage")
}

/// Applies a command-line setting, if given, to a held option.
fn apply_setting(held: &mut Option<u32>, s: Option<Setting>) {
    match s {
        None => {}
        Some(Setting::Default) => *held = None,
        Some(Setting::Value(v)) => *held = Some(v),
    }
}

/// `route options --json`: one object, an unset option as null.
fn options_json(
    module: ModuleId,
    o: &lbagent::model::ModuleOptions,
    version: Option<u64>,
) -> serde_json::Value {
    serde_json::json!({
        "modid": module.modid,
        "cmdid": module.cmdid,
        "slow_start_ms": o.slow_start_ms,
        "max_overloaded_percent": o.max_overloaded_percent,
        "panic_percent": o.panic_percent,
        "locality_min_percent": o.locality_min_percent,
        "route_version": version,
    })
}

/// A node address that can be a node: [`NodeAddr`]'s syntax, and a
/// unicast IPv4 address (not unspecified, broadcast or multicast).
fn unicast_node(s: &str) -> Result<NodeAddr, String> {
    let node: NodeAddr = s.parse().map_err(|e| format!("{e}"))?;
    let ip = std::net::Ipv4Addr::from(node.ip);
    let what = if ip.is_unspecified() {
        Some("the unspecified address")
    } else if ip.is_broadcast() {
        Some("the broadcast address")
    } else if ip.is_multicast() {
        Some("a multicast address")
    } else {
        None
    };
    match what {
        Some(what) => Err(format!(
            "{ip} is {what}, not a node: give the node's unicast IPv4 address"
        )),
        None => Ok(node),
    }
}

/// `route list --json`: one object.
fn routes_json(version: u64, routes: &[ModuleRoute]) -> serde_json::Value {
    let modules: Vec<serde_json::Value> = routes
        .iter()
        .map(|r| {
            serde_json::json!({
                "modid": r.module.modid,
                "cmdid": r.module.cmdid,
                "version": r.version,
                "policy": r.policy.as_str(),
                "options": {
                    "slow_start_ms": r.options.slow_start_ms,
                    "max_overloaded_percent": r.options.max_overloaded_percent,
                    "panic_percent": r.options.panic_percent,
                    "locality_min_percent": r.options.locality_min_percent,
                },
                "nodes": r.nodes.iter().map(|n| {
                    let meta = node_meta(r, n.addr);
                    serde_json::json!({
                        "node": n.addr.to_string(),
                        "weight": n.weight,
                        "zone": meta.and_then(|m| m.zone.as_ref()).map(|z| z.as_str()),
                        "labels": meta.map(|m| m.labels.to_string()).unwrap_or_default(),
                    })
                }).collect::<Vec<_>>(),
            })
        })
        .collect();
    serde_json::json!({ "route_version": version, "modules": modules })
}

/// The zone and labels of `route`'s node `addr`, if it has any.
fn node_meta(route: &ModuleRoute, addr: NodeAddr) -> Option<&NodeMeta> {
    route
        .meta
        .binary_search_by_key(&addr, |(a, _)| *a)
        .ok()
        .map(|i| &route.meta[i].1)
}

/// `route list`: one line per node (the policy, then the zone and the
/// labels, `-` for none, last).
fn routes_text(version: u64, routes: &[ModuleRoute]) -> String {
    let mut out = format!(
        "# route version {version}\n# modid cmdid node weight module_version policy zone labels\n"
    );
    for r in routes {
        for n in &r.nodes {
            let meta = node_meta(r, n.addr);
            let zone = meta
                .and_then(|m| m.zone.as_ref())
                .map_or("-", |z| z.as_str());
            let labels = meta
                .filter(|m| !m.labels.is_empty())
                .map_or_else(|| "-".to_string(), |m| m.labels.to_string());
            out.push_str(&format!(
                "{} {} {} {} {} {} {zone} {labels}\n",
                r.module.modid, r.module.cmdid, n.addr, n.weight, r.version, r.policy
            ));
        }
    }
    out
}
