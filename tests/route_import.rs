//! `lbagent route import` and `route export` through the real binary: bad
//! rows named and nothing changed, the round trip, `--replace`, and a large
//! table reaching an agent by push. The store-level cases (one version,
//! the change log, both backends) are in tests/store.rs.

#[path = "support/common.rs"]
mod common;
#[path = "support/udpclient.rs"]
mod udpclient;

use common::{addr_after, spawn_logged, wait_for, wait_logged};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use udpclient::Client;

use lbagent::host::heartbeat::HeartbeatReader;
use lbagent::model::{ModuleId, NodeAddr};
use lbagent::wire::RetCode;

const BIN: &str = env!("CARGO_BIN_EXE_lbagent");

/// `lbagent route ARGS --store STORE`.
fn route(store: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("route")
        .args(args)
        .args(["--store", store])
        .output()
        .expect("run lbagent route")
}

fn ok(store: &str, args: &[&str]) -> String {
    let out = route(store, args);
    assert!(
        out.status.success(),
        "lbagent route {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn sqlite_url(dir: &Path, name: &str) -> String {
    format!("sqlite:{}", dir.join(name).display())
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn an_import_with_bad_rows_names_them_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_url(dir.path(), "lbagent.db");
    ok(&store, &["add", "1", "1", "10.0.0.1:80", "--create"]);
    let before = ok(&store, &["list"]);

    let table = write(
        dir.path(),
        "t.csv",
        "modid,cmdid,ip,port,weight\n\
         2,2,10.0.0.2,80,1\n\
         2,2,10.0.0.3,0,1\n\
         2,2,10.0.0.4,80,1\n\
         2,2,239.1.1.1,80,1\n",
    );
    let out = route(&store, &["import", &table]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("2 bad rows, nothing imported"), "{err}");
    assert!(err.contains("line 3: ") && err.contains("port 0"), "{err}");
    assert!(err.contains("line 5: ") && err.contains("unicast"), "{err}");
    assert!(
        !err.contains("line 2:") && !err.contains("line 4:"),
        "{err}"
    );
    assert_eq!(ok(&store, &["list"]), before, "nothing changed");

    // A node the store has refuses the whole table, as route add does.
    let table = write(
        dir.path(),
        "dup.jsonl",
        "{\"modid\":2,\"cmdid\":2,\"ip\":\"10.0.0.2\",\"port\":80,\"weight\":1}\n\
         {\"modid\":1,\"cmdid\":1,\"ip\":\"10.0.0.1\",\"port\":80,\"weight\":1}\n",
    );
    let out = route(&store, &["import", &table]);
    assert_eq!(out.status.code(), Some(65));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already has node 10.0.0.1:80"), "{err}");
    assert_eq!(ok(&store, &["list"]), before, "nothing changed");

    // An unreadable file is bad input; a missing store is never created.
    let out = route(&store, &["import", "/nonexistent/table.csv"]);
    assert_eq!(out.status.code(), Some(2));
    let missing = sqlite_url(dir.path(), "typo.db");
    let good = write(
        dir.path(),
        "good.csv",
        "modid,cmdid,ip,port,weight\n3,3,10.0.0.9,80,1\n",
    );
    let out = route(&missing, &["import", &good]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!dir.path().join("typo.db").exists());
}

#[test]
fn export_then_import_is_the_identity_and_replace_replaces_named_modules() {
    let dir = tempfile::tempdir().unwrap();
    let a = sqlite_url(dir.path(), "a.db");
    let b = sqlite_url(dir.path(), "b.db");
    let table = write(
        dir.path(),
        "t.jsonl",
        "{\"modid\":1,\"cmdid\":1,\"ip\":\"10.0.0.1\",\"port\":80,\"weight\":2}\n\
         {\"modid\":1,\"cmdid\":1,\"ip\":\"10.0.0.2\",\"port\":81,\"weight\":1}\n\
         {\"modid\":4000000000,\"cmdid\":7,\"ip\":\"192.168.0.1\",\"port\":65535,\"weight\":1000000}\n",
    );
    let said = ok(&a, &["import", &table, "--create"]);
    assert!(
        said.contains("imported 3 nodes of 2 modules; route version 1"),
        "{said}"
    );
    let csv = ok(&a, &["export"]);
    assert_eq!(
        csv,
        "modid,cmdid,ip,port,weight\n\
         1,1,10.0.0.1,80,2\n\
         1,1,10.0.0.2,81,1\n\
         4000000000,7,192.168.0.1,65535,1000000\n"
    );
    let jsonl = ok(&a, &["export", "--format", "jsonl"]);
    assert_eq!(
        jsonl,
        std::fs::read_to_string(dir.path().join("t.jsonl")).unwrap()
    );

    // Into a second store and out again: the same table, either format.
    let exported = write(dir.path(), "export.csv", &csv);
    ok(&b, &["import", &exported, "--create"]);
    assert_eq!(ok(&b, &["export"]), csv);
    assert_eq!(ok(&b, &["export", "--format", "jsonl"]), jsonl);

    // --replace: module (1,1) ends with exactly the file's nodes; the
    // module not named keeps its node. Standard input, format sniffed.
    let replace = "modid,cmdid,ip,port,weight\n1,1,10.0.0.2,81,5\n1,1,10.0.0.3,80,1\n";
    let out = Command::new(BIN)
        .args(["route", "import", "-", "--replace", "--store", &b])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(replace.as_bytes())?;
            c.wait_with_output()
        })
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        ok(&b, &["export"]),
        "modid,cmdid,ip,port,weight\n\
         1,1,10.0.0.2,81,5\n\
         1,1,10.0.0.3,80,1\n\
         4000000000,7,192.168.0.1,65535,1000000\n"
    );
    assert!(ok(&b, &["list"]).starts_with("# route version 2\n"));
}

// === a large import reaching an agent ===

/// A child process killed when dropped.
struct Proc(Child);

impl Proc {
    /// `lbagent ARGS`, its log in the file `log` ([`spawn_logged`]).
    fn spawn(args: &[&str], log: &Path) -> Proc {
        let child = spawn_logged(Command::new(BIN).args(args).stdout(Stdio::null()), log)
            .unwrap_or_else(|e| panic!("start lbagent {args:?}: {e}"));
        Proc(child)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The set of hosts 40 getHosts return, sorted.
fn hosts(udp: &mut Client, m: ModuleId) -> Vec<NodeAddr> {
    let mut seen = Vec::new();
    for _ in 0..40 {
        if let (RetCode::Ok, Some(h)) = udp.get_host(m) {
            if !seen.contains(&h) {
                seen.push(h);
            }
        }
    }
    seen.sort();
    seen
}

#[test]
fn a_large_import_reaches_a_subscribed_agent_by_push() {
    // 100k modules (issue 15), two nodes each: 200k rows keep the debug
    // build's import within seconds (perf/route_import.rs measures 1M rows).
    const MODULES: u32 = 100_000;
    const NODES: u32 = 2;
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_url(dir.path(), "lbagent.db");
    ok(&store, &["add", "999999", "1", "10.255.0.1:80", "--create"]);

    // Port 0: the route server says which port it got in its log.
    let log = dir.path().join("dnsserver.log");
    let mut server = Proc::spawn(
        &[
            "dnsserver",
            "--store",
            &store,
            "--set",
            "dnsserver.listen=127.0.0.1:0",
            "--set",
            "dnsserver.metrics_addr=127.0.0.1:0",
        ],
        &log,
    );
    let server_addr = wait_logged(&mut server.0, &log, Duration::from_secs(20), |l| {
        addr_after(l, "serving pulls on ")
    })
    .unwrap_or_else(|e| panic!("the route server starts within 20 s: {e}"));

    let heartbeat = dir.path().join("heartbeat");
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "[lb]\nupdate_timeout = 300\n[agent]\nbase_port = 0\nshards = 1\n\
             route_servers = [\"{server_addr}\"]\nreporters = [\"127.0.0.1:1\"]\n\
             heartbeat_path = \"{}\"\nsnapshot_path = \"{}\"\nmetrics_addr = \"127.0.0.1:0\"\n",
            heartbeat.display(),
            dir.path().join("routes.snapshot").display()
        ),
    )
    .unwrap();
    let agent = Proc::spawn(
        &["agent", "--config", config.to_str().unwrap()],
        &dir.path().join("agent.log"),
    );
    let pid = agent.0.id();
    let udp_port = wait_for(Duration::from_secs(15), || {
        let h = HeartbeatReader::open(&heartbeat).ok()?.read().ok()?;
        (h.info.pid == pid && h.beat_unix_ms > 0).then_some(h.info.base_port)
    })
    .expect("the agent writes its heartbeat within 15 s");
    let mut udp = Client::new(udp_port);

    // The agent asks for the last module of the table: not there yet. It
    // re-pulls an absent module only after update_timeout (300 s here), so
    // a route seen sooner was pushed.
    let last = ModuleId::new(MODULES - 1, 1);
    assert_eq!(udp.get_host(last).0, RetCode::NoSuchModule);
    std::thread::sleep(Duration::from_millis(300));

    let mut text = String::from("modid,cmdid,ip,port,weight\n");
    for k in 0..MODULES {
        let [_, _, a, b] = k.to_be_bytes();
        for i in 1..=NODES {
            text.push_str(&format!("{k},1,10.{a}.{b}.{i},8080,1\n"));
        }
    }
    let table = write(dir.path(), "big.csv", &text);
    let t0 = Instant::now();
    let said = ok(&store, &["import", &table]);
    eprintln!("import of {MODULES} modules: {:?}: {said}", t0.elapsed());
    assert!(
        said.contains("imported 200000 nodes of 100000 modules; route version 2"),
        "{said}"
    );

    let [_, _, a, b] = (MODULES - 1).to_be_bytes();
    let want: Vec<NodeAddr> = (1..=NODES)
        .map(|i| format!("10.{a}.{b}.{i}:8080").parse().unwrap())
        .collect();
    let t0 = Instant::now();
    // The route server notices the new version within poll_interval_ms
    // and reads the change log of 100k modules: 14 s in a debug build on a
    // loaded 2-core machine, hence the generous bound.
    wait_for(Duration::from_secs(90), || {
        (hosts(&mut udp, last) == want).then_some(())
    })
    .expect("the imported module reaches the agent by push within 90 s");
    eprintln!("pushed to the agent in {:?}", t0.elapsed());
}
