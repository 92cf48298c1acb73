//! The tool commands `lbagent gethost`, `lbagent report` and
//! `lbagent getroute`, as library functions on the client library: each
//! takes its parsed arguments and returns what to print and the exit
//! status ([`ToolOutcome`]), so the binary only prints, and tests call them
//! directly.
//!
//! # Exit status
//!
//! | code | meaning |
//! |---:|---|
//! | 0 | success |
//! | 3 | no such module: the agent has no route for it |
//! | 4 | module overloaded: every node is overloaded |
//! | 5 | rejected by the agent's admission control |
//! | 6 | agent down: no fresh heartbeat, or its port refuses datagrams |
//! | 7 | agent down and the static route file cannot answer (gethost) |
//! | 8 | timeout: the agent did not answer in `--timeout-ms` |
//! | 9 | bad response: something that is not the agent answered |
//! | 10 | bad argument, or a request the agent refused |
//!
//! (1, 2, 69 and 78 are the binary's: runtime failure, usage, not built,
//! configuration invalid.) On failure one line on stderr says why; with
//! `--json`, stdout carries one JSON object instead, failures included:
//! `{"error": KIND, "message": ..., "modid": .., "cmdid": ..}` with KIND as
//! [`ClientError::kind`].

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use serde_json::{json, Value};

use crate::admission::UserPriorities;
use crate::client::{Client, ClientError, ClientOptions, HostSource, RouteView};
use crate::model::{NodeAddr, Policy};
use crate::wire::{AdmissionLevel, NodeStatus};

/// Parses `B,U` (each 1..=128) as an admission level.
fn parse_level(s: &str) -> Result<AdmissionLevel, String> {
    let part = |p: Option<&str>, name: &str| -> Result<u8, String> {
        let p = p.ok_or_else(|| format!("{s:?}: expected B,U (two numbers 1..=128)"))?;
        match p.trim().parse::<u8>() {
            Ok(v @ 1..=128) => Ok(v),
            _ => Err(format!("{s:?}: {name} {p:?} is not a number 1..=128")),
        }
    };
    let mut it = s.splitn(2, ',');
    let b = part(it.next(), "B")?;
    let u = part(it.next(), "U")?;
    Ok(AdmissionLevel::new(b, u))
}

pub use crate::client::exit::{
    exit_code, EXIT_AGENT_DOWN, EXIT_BAD_ARGUMENT, EXIT_BAD_RESPONSE, EXIT_CONFIG,
    EXIT_NO_SUCH_MODULE, EXIT_OK, EXIT_OVERLOADED, EXIT_REJECTED, EXIT_STATIC_ROUTES, EXIT_TIMEOUT,
};

/// How the tools find the agent (shared by the three commands).
#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct AgentConnArgs {
    /// The agent's heartbeat file [default: $LBAGENT_HEARTBEAT, else
    /// /run/lbagent/heartbeat].
    #[arg(long, value_name = "PATH")]
    pub heartbeat: Option<PathBuf>,
    /// The static route file, used only when there is no heartbeat file
    /// [default: $LBAGENT_SNAPSHOT, else /var/lib/lbagent/routes.snapshot].
    #[arg(long, value_name = "PATH")]
    pub snapshot: Option<PathBuf>,
    /// How long to wait for the agent, in milliseconds (1..=60000).
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 1000,
        value_parser = clap::value_parser!(u64).range(1..=60_000)
    )]
    pub timeout_ms: u64,
}

impl Default for AgentConnArgs {
    fn default() -> Self {
        AgentConnArgs {
            heartbeat: None,
            snapshot: None,
            timeout_ms: 1000,
        }
    }
}

impl AgentConnArgs {
    fn options(&self) -> ClientOptions {
        let mut o = ClientOptions::default();
        if let Some(p) = &self.heartbeat {
            o.heartbeat_path = p.clone();
        }
        if let Some(p) = &self.snapshot {
            o.snapshot_path = p.clone();
        }
        o
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}

/// `lbagent gethost MODID CMDID`: ask the local agent for a node of a
/// module, through the client library (while the agent is down, from its
/// static route file: stderr says so).
#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct GethostArgs {
    /// Module id.
    pub modid: u32,
    /// Command id.
    pub cmdid: u32,
    /// Print one JSON object: {"modid", "cmdid", "host", "ip", "port",
    /// "source": "agent" | "static_routes"}.
    #[arg(long)]
    pub json: bool,
    /// DAGOR business priority of the call, 1..=128 (1 = most important);
    /// unset counts as 128. Exit 5 when the agent rejects it (every idle
    /// node's downstream level refuses it).
    #[arg(long, value_name = "B", value_parser = clap::value_parser!(u8).range(1..=128))]
    pub priority: Option<u8>,
    /// The user the call is for: its user priority U is the keyed hash of
    /// this id under --user-hash-seed, the key rotating every
    /// admission.user_key_period_s of --config (without --config: the
    /// packaged default, 3600 s); unset, U counts as 128.
    #[arg(long, value_name = "ID")]
    pub user: Option<String>,
    /// The seed of the user-priority hash [default: admission.user_hash_seed
    /// of --config, else the packaged admission.user_hash_seed]: the
    /// services that assign user priorities must use the same.
    #[arg(long, value_name = "SEED")]
    pub user_hash_seed: Option<u64>,
    /// A configuration file (the services' or the agent's) whose
    /// admission.user_hash_seed and admission.user_key_period_s hash --user
    /// (exit 78 when it cannot be read or is invalid).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Consistent hashing: ask for the node this key belongs to (a
    /// session, a user, a cache key): the same key gets the same node
    /// while it is idle, and adding or removing one node of N moves about
    /// 1/N of the keys. Its bytes are hashed here; not with --priority
    /// or --user.
    #[arg(long, value_name = "K", conflicts_with_all = ["priority", "user", "select"])]
    pub key: Option<String>,
    /// Labels: choose among the nodes carrying every KEY=VALUE of this
    /// comma-separated list (e.g. version=canary); at most 16 terms of 1 to
    /// 63 characters of A-Z a-z 0-9 . _ - each (exit 2 otherwise). Not with
    /// --priority or --user.
    #[arg(long, value_name = "K=V,...", conflicts_with_all = ["priority", "user"])]
    pub select: Option<crate::model::Selector>,
    /// Finding the agent.
    #[command(flatten)]
    pub conn: AgentConnArgs,
}

/// `lbagent report MODID CMDID IP:PORT RETCODE`: report a call's result to
/// the local agent, then show the node as the agent now counts it.
#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct ReportArgs {
    /// Module id.
    pub modid: u32,
    /// Command id.
    pub cmdid: u32,
    /// The node called, A.B.C.D:PORT.
    pub node: NodeAddr,
    /// The call's result: 0 success, anything else a failure.
    #[arg(allow_hyphen_values = true)]
    pub retcode: i32,
    /// The call's time cost in milliseconds (a failure counts
    /// max(1, MS / 100) errors).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub tcost: u32,
    /// The admission level the downstream attached to its response
    /// (DAGOR), passed on to the agent: it keeps it for the node for
    /// admission.level_timeout_ms and rejects getHosts it refuses.
    #[arg(long, value_name = "B,U", value_parser = parse_level)]
    pub downstream_level: Option<AdmissionLevel>,
    /// Capacity units of the node the call consumed for good (a `balance`
    /// module's stored resources), 1..=1000000: the agent passes them to
    /// the reporter, and the route server lowers the node's capacity for
    /// every agent (never below 0).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u32).range(1..=i64::from(crate::wire::MAX_CONSUMED)))]
    pub consume: Option<u32>,
    /// Print one JSON object: the report and the node's state after it.
    #[arg(long)]
    pub json: bool,
    /// Finding the agent.
    #[command(flatten)]
    pub conn: AgentConnArgs,
}

/// `lbagent getroute MODID CMDID`: the agent's view of a module, every
/// node with its state and counters.
#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct GetrouteArgs {
    /// Module id.
    pub modid: u32,
    /// Command id.
    pub cmdid: u32,
    /// Print one JSON object: {"modid", "cmdid", "version", "nodes": [..]}.
    #[arg(long)]
    pub json: bool,
    /// Finding the agent.
    #[command(flatten)]
    pub conn: AgentConnArgs,
}

/// What a tool command prints and how it exits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolOutcome {
    /// The exit status (see the module documentation).
    pub code: u8,
    /// What goes to stdout.
    pub stdout: String,
    /// What goes to stderr.
    pub stderr: String,
}

impl ToolOutcome {
    /// Prints stdout and stderr and returns the exit status, for `main`.
    pub fn emit(self) -> ExitCode {
        use std::io::Write;
        // A closed stdout (`| head`) is not worth a panic.
        let _ = std::io::stdout().write_all(self.stdout.as_bytes());
        let _ = std::io::stderr().write_all(self.stderr.as_bytes());
        ExitCode::from(self.code)
    }

    fn ok(stdout: String, stderr: String) -> Self {
        ToolOutcome {
            code: EXIT_OK,
            stdout,
            stderr,
        }
    }

    fn failed(command: &str, json: bool, modid: u32, cmdid: u32, e: &ClientError) -> Self {
        let code = exit_code(e);
        if json {
            let v = json!({
                "error": e.kind(),
                "message": e.to_string(),
                "modid": modid,
                "cmdid": cmdid,
                "exit_code": code,
            });
            // The object on stdout for programs, the one-line message on
            // stderr for people, as without --json.
            ToolOutcome {
                code,
                stdout: format!("{v}\n"),
                stderr: format!("lbagent {command}: {e}\n"),
            }
        } else {
            ToolOutcome {
                code,
                stdout: String::new(),
                stderr: format!("lbagent {command}: {e}\n"),
            }
        }
    }
}

/// The user-priority hash of `lbagent gethost --user`: seed and key period
/// from `--config`'s `[admission]` (the packaged defaults without it), the
/// seed overridden by `--user-hash-seed`.
fn user_keys(args: &GethostArgs) -> Result<UserPriorities, String> {
    let admission = match &args.config {
        Some(path) => {
            crate::config::Config::load(Some(path), &[])
                .map_err(|e| {
                    format!(
                        "--config {}: {e}: fix the file, or leave --config out to hash \
                         --user with the packaged admission defaults",
                        path.display()
                    )
                })?
                .admission
        }
        None => crate::config::AdmissionConfig::default(),
    };
    let seed = args.user_hash_seed.unwrap_or(admission.user_hash_seed);
    Ok(UserPriorities::new(seed, admission.user_key_period_s))
}

/// `lbagent gethost`: one getHost through the client library (after a
/// register when the agent does not know the module yet). Prints the
/// node as `A.B.C.D:PORT` (or the JSON object); exit status as the module
/// documentation says.
pub fn gethost(args: &GethostArgs) -> ToolOutcome {
    let fail =
        |e: &ClientError| ToolOutcome::failed("gethost", args.json, args.modid, args.cmdid, e);
    let mut client = match Client::with_options(args.conn.options()) {
        Ok(c) => c,
        Err(e) => return fail(&e),
    };
    let timeout = args.conn.timeout();
    let user = match &args.user {
        None => 0,
        Some(id) => match user_keys(args) {
            Ok(mut keys) => {
                let unix_s = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                keys.priority(id.as_bytes(), unix_s)
            }
            Err(why) => {
                return ToolOutcome {
                    code: EXIT_CONFIG,
                    stdout: String::new(),
                    stderr: format!("lbagent gethost: {why}\n"),
                }
            }
        },
    };
    let prio = crate::client::Priority::new(args.priority.unwrap_or(0), user);
    let ask = |client: &mut Client| match (&args.key, &args.select) {
        (Some(key), _) => client.get_host_keyed(args.modid, args.cmdid, key.as_bytes(), timeout),
        (None, Some(sel)) => client.get_host_selecting(args.modid, args.cmdid, sel, timeout),
        (None, None) => client.get_host_with(args.modid, args.cmdid, prio, timeout),
    };
    let host = match ask(&mut client) {
        Ok(h) => h,
        // A one-shot command is always a first use: the agent may not have
        // pulled the module yet. Register (pull and wait, within the same
        // timeout) and ask once more, as an application would.
        Err(ClientError::NoSuchModule { .. }) => {
            match client
                .register(args.modid, args.cmdid, timeout)
                .and_then(|_| ask(&mut client))
            {
                Ok(h) => h,
                Err(e) => return fail(&e),
            }
        }
        Err(e) => return fail(&e),
    };
    let note = match host.source {
        HostSource::StaticRoutes => {
            "lbagent gethost: the agent is down: answered with a random node from its static route file\n"
                .to_string()
        }
        HostSource::Agent | HostSource::Cache => String::new(),
    };
    if args.json {
        let v = json!({
            "modid": args.modid,
            "cmdid": args.cmdid,
            "host": host.addr.to_string(),
            "ip": host.addr.ipv4().to_string(),
            "port": host.addr.port,
            "source": host.source.as_str(),
        });
        ToolOutcome::ok(format!("{v}\n"), note)
    } else {
        ToolOutcome::ok(format!("{}\n", host.addr), note)
    }
}

/// `lbagent report`: sends the report, then asks the agent for the module's
/// route on the same socket (so the agent has applied the report when it
/// answers) and prints the node's state and counters. A node that is not
/// in the module's route is a bad argument (exit 10): the agent ignored the
/// report.
pub fn report(args: &ReportArgs) -> ToolOutcome {
    let fail =
        |e: &ClientError| ToolOutcome::failed("report", args.json, args.modid, args.cmdid, e);
    let mut client = match Client::with_options(args.conn.options()) {
        Ok(c) => c,
        Err(e) => return fail(&e),
    };
    // The library drops reports while the agent is down; a tool says so.
    if let Err(e) = client.agent() {
        return fail(&e);
    }
    if let Err(e) = client.report_consuming(
        args.modid,
        args.cmdid,
        args.node,
        args.retcode,
        args.tcost,
        args.downstream_level,
        args.consume.unwrap_or(0),
    ) {
        return fail(&e);
    }
    let view = match client.get_route(args.modid, args.cmdid, args.conn.timeout()) {
        Ok(v) => v,
        Err(e) => return fail(&e),
    };
    let Some(node) = view.nodes.iter().find(|n| n.addr == args.node) else {
        let known: Vec<String> = view.nodes.iter().map(|n| n.addr.to_string()).collect();
        return fail(&ClientError::BadRequest(format!(
            "node {} is not in module {}'s route ({}): the agent ignored the report",
            args.node,
            view.module,
            known.join(", ")
        )));
    };
    if args.json {
        let v = json!({
            "modid": args.modid,
            "cmdid": args.cmdid,
            "node": args.node.to_string(),
            "retcode": args.retcode,
            "tcost_ms": args.tcost,
            "version": view.version,
            "consumed": args.consume.unwrap_or(0),
            "status": node_json(view.policy, node),
        });
        return ToolOutcome::ok(format!("{v}\n"), String::new());
    }
    let what = if args.retcode == 0 {
        "success".to_string()
    } else {
        format!("failure (retcode {}, {} ms)", args.retcode, args.tcost)
    };
    let text = format!(
        "reported {what} of {} for module {}; the agent now counts: {}, vsucc {}, verr {}, \
         window {} ok / {} err, consecutive {} ok / {} err\n",
        args.node,
        view.module,
        state(node),
        node.vsucc,
        node.verr,
        node.rsucc,
        node.rerr,
        node.contin_succ,
        node.contin_err
    );
    ToolOutcome::ok(text, String::new())
}

/// `lbagent getroute`: the agent's view of the module, as a table (or the
/// JSON object).
pub fn getroute(args: &GetrouteArgs) -> ToolOutcome {
    let fail =
        |e: &ClientError| ToolOutcome::failed("getroute", args.json, args.modid, args.cmdid, e);
    let mut client = match Client::with_options(args.conn.options()) {
        Ok(c) => c,
        Err(e) => return fail(&e),
    };
    match client.get_route(args.modid, args.cmdid, args.conn.timeout()) {
        Ok(view) if args.json => ToolOutcome::ok(format!("{}\n", route_json(&view)), String::new()),
        Ok(view) => ToolOutcome::ok(route_table(&view), String::new()),
        Err(e) => fail(&e),
    }
}

fn state(n: &NodeStatus) -> &'static str {
    if n.overloaded {
        "overloaded"
    } else {
        "idle"
    }
}

fn node_json(policy: Policy, n: &NodeStatus) -> Value {
    let mut v = json!({
        "host": n.addr.to_string(),
        "weight": n.weight,
        "state": state(n),
        "vsucc": n.vsucc,
        "verr": n.verr,
        "rsucc": n.rsucc,
        "rerr": n.rerr,
        "contin_succ": n.contin_succ,
        "contin_err": n.contin_err,
        "bad_windows": n.bad_windows,
        "window_age_ms": n.window_age_ms,
        "overload_age_ms": n.overload_age_ms,
    });
    if policy == Policy::Balance {
        v["capacity"] = json!(n.capacity);
        v["in_use"] = json!(n.in_use);
        v["phi"] = json!(n.phi);
    }
    v
}

/// The JSON object `lbagent getroute --json` prints.
pub fn route_json(view: &RouteView) -> Value {
    json!({
        "modid": view.module.modid,
        "cmdid": view.module.cmdid,
        "version": view.version,
        "policy": view.policy.as_str(),
        "nodes": view.nodes.iter().map(|n| node_json(view.policy, n)).collect::<Vec<_>>(),
    })
}

/// The table `lbagent getroute` prints: a summary line, a header, one line
/// per node. AGE_MS is the idle window's age for an idle node, the time
/// since it became overloaded for an overloaded one. A `balance` module
/// adds its policy to the summary and, per node, CAP (capacity as counted
/// now, 0 while overloaded), INUSE (units handed out and not had back) and
/// PHI (the probability of the next getHost).
pub fn route_table(view: &RouteView) -> String {
    let overloaded = view.nodes.iter().filter(|n| n.overloaded).count();
    let balance = view.policy == Policy::Balance;
    let mut out = format!(
        "module {}: version {}, {} nodes, {overloaded} overloaded{}\n",
        view.module,
        view.version,
        view.nodes.len(),
        if balance { ", policy balance" } else { "" }
    );
    let _ = write!(
        out,
        "{:<21} {:<10} {:>6} {:>8} {:>8} {:>8} {:>8} {:>6} {:>6} {:>7} {:>10}",
        "NODE",
        "STATE",
        "WEIGHT",
        "VSUCC",
        "VERR",
        "RSUCC",
        "RERR",
        "CSUCC",
        "CERR",
        "BADWIN",
        "AGE_MS"
    );
    if balance {
        let _ = write!(out, " {:>7} {:>7} {:>8}", "CAP", "INUSE", "PHI");
    }
    out.push('\n');
    for n in &view.nodes {
        let age = if n.overloaded {
            n.overload_age_ms
        } else {
            n.window_age_ms
        };
        let _ = write!(
            out,
            "{:<21} {:<10} {:>6} {:>8} {:>8} {:>8} {:>8} {:>6} {:>6} {:>7} {:>10}",
            n.addr.to_string(),
            state(n),
            n.weight,
            n.vsucc,
            n.verr,
            n.rsucc,
            n.rerr,
            n.contin_succ,
            n.contin_err,
            n.bad_windows,
            age
        );
        if balance {
            let _ = write!(out, " {:>7} {:>7} {:>8.4}", n.capacity, n.in_use, n.phi);
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModuleId;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(subcommand)]
        cmd: Cmd,
    }

    #[derive(clap::Subcommand, Debug)]
    enum Cmd {
        Gethost(GethostArgs),
        Report(ReportArgs),
        Getroute(GetrouteArgs),
    }

    #[test]
    fn the_arguments_parse_as_documented() {
        let cli = Cli::try_parse_from([
            "x",
            "report",
            "1",
            "2",
            "10.0.0.1:80",
            "-1",
            "--tcost",
            "250",
            "--heartbeat",
            "/tmp/hb",
        ])
        .unwrap();
        let Cmd::Report(r) = cli.cmd else { panic!() };
        assert_eq!((r.modid, r.cmdid, r.retcode, r.tcost), (1, 2, -1, 250));
        assert_eq!(r.conn.heartbeat, Some(PathBuf::from("/tmp/hb")));
        assert_eq!(r.conn.timeout_ms, 1000);
        let cli = Cli::try_parse_from(["x", "gethost", "1", "2", "--json", "--timeout-ms", "50"])
            .unwrap();
        assert!(matches!(cli.cmd, Cmd::Gethost(ref g) if g.json && g.conn.timeout_ms == 50));
        assert!(Cli::try_parse_from(["x", "getroute", "1", "2", "--timeout-ms", "0"]).is_err());
        assert!(Cli::try_parse_from(["x", "report", "1", "2", "10.0.0.1:0", "0"]).is_err());
    }

    #[test]
    fn exit_codes_are_distinct_and_avoid_the_binarys() {
        let m = ModuleId::new(1, 1);
        let errors = [
            ClientError::NoSuchModule { module: m },
            ClientError::Overloaded { module: m },
            ClientError::Rejected { module: m },
            ClientError::AgentDown(String::new()),
            ClientError::StaticRoutes(String::new()),
            ClientError::Timeout {
                module: m,
                waited: Duration::ZERO,
            },
            ClientError::BadResponse(String::new()),
            ClientError::BadRequest(String::new()),
        ];
        let mut codes: Vec<u8> = errors.iter().map(exit_code).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), errors.len());
        for reserved in [0, 1, 2, 69, 78] {
            assert!(!codes.contains(&reserved), "{reserved}");
        }
    }

    #[test]
    fn a_failure_in_json_is_one_object_naming_the_kind() {
        let e = ClientError::Overloaded {
            module: ModuleId::new(3, 4),
        };
        let out = ToolOutcome::failed("gethost", true, 3, 4, &e);
        assert_eq!(out.code, EXIT_OVERLOADED);
        let v: Value = serde_json::from_str(out.stdout.trim()).unwrap();
        assert_eq!(v["error"], "overloaded");
        assert_eq!(v["modid"], 3);
        assert!(v["message"].as_str().unwrap().contains("[3, 4]"));
        let out = ToolOutcome::failed("gethost", false, 3, 4, &e);
        assert!(out.stdout.is_empty());
        assert!(out
            .stderr
            .starts_with("lbagent gethost: module [3, 4] is overloaded"));
    }

    #[test]
    fn the_route_table_has_a_line_per_node() {
        let n = |port, overloaded| NodeStatus {
            addr: NodeAddr {
                ip: 0x0a00_0001,
                port,
            },
            weight: 1,
            overloaded,
            vsucc: 180,
            verr: 0,
            rsucc: 0,
            rerr: 0,
            contin_succ: 0,
            contin_err: 0,
            bad_windows: 0,
            window_age_ms: 5,
            overload_age_ms: 7,
            capacity: 0,
            in_use: 0,
            phi: 0.0,
        };
        let view = RouteView {
            policy: Policy::L5,
            module: ModuleId::new(1, 2),
            version: 9,
            nodes: vec![n(80, false), n(81, true)],
        };
        let t = route_table(&view);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        assert!(lines[0].contains("version 9, 2 nodes, 1 overloaded"));
        assert!(lines[2].starts_with("10.0.0.1:80") && lines[2].trim_end().ends_with(" 5"));
        assert!(lines[3].contains("overloaded") && lines[3].trim_end().ends_with(" 7"));
        let j = route_json(&view);
        assert_eq!(j["nodes"][1]["state"], "overloaded");
        assert_eq!(j["version"], 9);
    }
}
