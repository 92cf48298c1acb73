//! Requests that act beyond their caller, tried as somebody else (issue
//! 27): a real `lbagent standalone` run by root (as CI runs), attackers
//! as uid 65534 (`setpriv --reuid 65534 --regid 65534 --clear-groups`),
//! an application in its own pid and network namespace (`unshare --pid
//! --net --fork --mount-proc`). Each case is seen failing to do harm, and
//! the same request from an allowed client is seen doing what it should
//! (so that no check passes by refusing everything).
//!
//! Needs root (for setpriv and unshare): as another user every test says
//! so and returns.

#[path = "support/common.rs"]
mod common;

use common::{start_standalone, wait_for, Proc};
use std::net::UdpSocket;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use lbagent::client::{Client, ClientError, ClientOptions};
use lbagent::host::heartbeat::HeartbeatReader;
use lbagent::model::{ModuleId, NodeAddr};
use lbagent::wire::{decode, Encoder, Limits, Message, Report, RetCode};

const BIN: &str = env!("CARGO_BIN_EXE_lbagent");

/// How a process is run: as root (the agent's user here, trusted), as
/// uid 65534 (not trusted), or as 65534 in its own pid and network
/// namespaces.
#[derive(Clone, Copy, Debug, PartialEq)]
enum As {
    Root,
    Nobody,
    Contained,
}

fn is_root() -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    eprintln!("skipped: needs root (setpriv, unshare), as CI runs it");
    false
}

fn command(who: As, args: &[&str]) -> Command {
    let nobody = [
        "--reuid",
        "65534",
        "--regid",
        "65534",
        "--clear-groups",
        BIN,
    ];
    let mut c = match who {
        As::Root => Command::new(BIN),
        As::Nobody => {
            let mut c = Command::new("setpriv");
            c.args(nobody);
            c
        }
        As::Contained => {
            let mut c = Command::new("unshare");
            c.args(["--pid", "--net", "--fork", "--mount-proc", "setpriv"]);
            c.args(nobody);
            c
        }
    };
    c.args(args).stdin(Stdio::null());
    c
}

fn run(who: As, args: &[&str]) -> Output {
    command(who, args)
        .output()
        .unwrap_or_else(|e| panic!("run lbagent {args:?} as {who:?}: {e}"))
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {} / {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// A standalone system (one shard, statistics every second) in a directory
/// every user may read (the heartbeat and the local socket are the
/// agent's; the directory is root's, mode 0755).
struct System {
    _proc: Proc,
    _dir: tempfile::TempDir,
    dir: PathBuf,
    hb: String,
    store: String,
}

impl System {
    fn start(extra: &[&str]) -> System {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        // "{dir}" in a setting is the system's directory.
        let shown = dir.display().to_string();
        let sets: Vec<String> = extra.iter().map(|s| s.replace("{dir}", &shown)).collect();
        let (proc, heartbeat) = start_standalone(BIN, &dir, &sets);
        let data = dir.join("data");
        System {
            _proc: proc,
            _dir: tmp,
            store: format!("sqlite:{}", data.join("lbagent.db").display()),
            hb: heartbeat.display().to_string(),
            dir,
        }
    }

    /// `lbagent route ...` against the store (as root).
    fn route(&self, args: &[&str]) -> Output {
        let mut a = vec!["route"];
        a.extend_from_slice(args);
        a.extend_from_slice(&["--store", &self.store]);
        let out = run(As::Root, &a);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// A module of these `(node, weight)`, with `policy`, held by the agent.
    fn module(&self, modid: &str, nodes: &[(&str, &str)], policy: &str) {
        for (n, w) in nodes {
            self.route(&["add", modid, "1", n, "--weight", w]);
        }
        self.route(&["policy", modid, "1", policy]);
        wait_for(Duration::from_secs(10), || {
            let v = self.getroute(modid)?;
            (v["policy"] == policy && v["nodes"].as_array()?.len() == nodes.len()).then_some(())
        })
        .unwrap_or_else(|| panic!("the agent holds module {modid} within 10 s"));
    }

    /// `lbagent getroute MODID 1 --json` (takes no unit).
    fn getroute(&self, modid: &str) -> Option<serde_json::Value> {
        let out = self.tool(As::Root, "getroute", modid, &["--json"]);
        out.status.success().then(|| json(&out))
    }

    /// Units in use of the module, over its nodes.
    fn in_use(&self, modid: &str) -> u64 {
        let v = self.getroute(modid).expect("getroute answers within 30 s");
        v["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["in_use"].as_u64().unwrap())
            .sum()
    }

    /// The stored weight of `node` of module `modid`.
    fn stored_weight(&self, modid: &str, node: &str) -> u64 {
        let list = json(&self.route(&["list", modid, "1", "--json"]));
        list["modules"][0]["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["node"] == node)
            .unwrap()["weight"]
            .as_u64()
            .unwrap()
    }

    /// `lbagent TOOL MODID 1 ...` as `who`, run again (for 30 s at most)
    /// while it finds the agent down (exit 6: on a busy machine the
    /// heartbeat can lag past its 2 s) or, but for a report, slow (exit
    /// 8): what the tests look at is what the agent answers, not whether
    /// it kept its beat.
    fn tool(&self, who: As, tool: &str, modid: &str, rest: &[&str]) -> Output {
        let mut a = vec![tool, modid, "1"];
        a.extend_from_slice(rest);
        a.extend_from_slice(&["--heartbeat", &self.hb, "--timeout-ms", "10000"]);
        let t0 = std::time::Instant::now();
        loop {
            let out = run(who, &a);
            // A report that timed out may have been taken: not sent twice.
            let busy = match out.status.code() {
                Some(6) => true,
                Some(8) => tool != "report",
                _ => false,
            };
            if !busy || t0.elapsed() > Duration::from_secs(30) {
                return out;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// A library client in this process (root: trusted), patient with a
    /// heartbeat that lags on a busy machine.
    fn client(&self) -> Client {
        Client::with_options(ClientOptions {
            heartbeat_path: self.hb.clone().into(),
            max_heartbeat_age: Duration::from_secs(30),
            ..ClientOptions::default()
        })
        .unwrap()
    }

    /// The UDP port of the agent's only shard.
    fn udp_port(&self) -> u16 {
        let h = HeartbeatReader::open(Path::new(&self.hb))
            .unwrap()
            .read()
            .unwrap();
        h.info.base_port
    }

    #[allow(dead_code)]
    fn dir(&self) -> &Path {
        &self.dir
    }
}

/// One request over plain UDP to the agent's shard, its answer if any
/// within `wait`.
fn udp_exchange(port: u16, request: &[u8], wait: Duration) -> Option<Vec<u8>> {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_read_timeout(Some(wait)).unwrap();
    s.send_to(request, ("127.0.0.1", port)).unwrap();
    let mut buf = [0u8; 65536];
    let n = s.recv(&mut buf).ok()?;
    Some(buf[..n].to_vec())
}

#[test]
fn a_consume_report_from_an_unallowed_uid_is_refused_and_nothing_changes_in_the_store() {
    if !is_root() {
        return;
    }
    let sys = System::start(&[]);
    let node = "10.27.0.1:80";
    sys.module("270", &[(node, "10")], "balance");

    // uid 65534 over the local socket: refused, said so, exit 10.
    let out = sys.tool(As::Nobody, "report", "270", &[node, "0", "--consume", "7"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(10), "{err}");
    assert!(
        err.contains("refused the consumption") && err.contains("trusted"),
        "{err}"
    );
    // Anyone over plain UDP: ErrorResp Forbidden.
    let mut enc = Encoder::new();
    let req = enc
        .report_req(&Report {
            seq: 77,
            module: ModuleId::new(270, 1),
            host: node.parse::<NodeAddr>().unwrap(),
            retcode: 0,
            tcost_ms: 0,
            downstream_level: None,
            consumed: 9,
        })
        .to_vec();
    let answer =
        udp_exchange(sys.udp_port(), &req, Duration::from_secs(20)).expect("an answer over UDP");
    let Message::ErrorResp(e) = decode(&answer, &Limits::UDP).unwrap() else {
        panic!("not an ErrorResp")
    };
    assert_eq!((e.retcode(), e.seq()), (RetCode::Forbidden, 77));
    // Statistics go every second: three seconds later the store has
    // seen nothing.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(sys.stored_weight("270", node), 10);

    // The same report from root (trusted) is taken: the check refuses
    // only whom it must.
    let out = sys.tool(As::Root, "report", "270", &[node, "0", "--consume", "3"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for(Duration::from_secs(10), || {
        (sys.stored_weight("270", node) == 7).then_some(())
    })
    .expect("root's consumption reaches the store within 10 s");
}

#[test]
fn a_level_from_an_unallowed_client_does_not_reject_another_clients_gethosts_and_an_allowed_ones_does(
) {
    if !is_root() {
        return;
    }
    let sys = System::start(&[]);
    let node = "10.27.0.2:80";
    sys.module("271", &[(node, "1")], "l5");
    // Three reports carrying the strictest level, as uid 65534 (over the
    // local socket) ...
    for _ in 0..3 {
        let out = sys.tool(
            As::Nobody,
            "report",
            "271",
            &[node, "0", "--downstream-level", "1,1"],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // ... and over plain UDP from this process.
    let mut enc = Encoder::new();
    let req = enc
        .report_req(&Report {
            seq: 5,
            module: ModuleId::new(271, 1),
            host: node.parse::<NodeAddr>().unwrap(),
            retcode: 0,
            tcost_ms: 0,
            downstream_level: Some(lbagent::wire::AdmissionLevel::new(1, 1)),
            consumed: 0,
        })
        .to_vec();
    assert!(
        udp_exchange(sys.udp_port(), &req, Duration::from_millis(500)).is_none(),
        "a report has no answer"
    );
    // Another client's getHosts go on.
    let mut victim = sys.client();
    for _ in 0..20 {
        let h = victim.get_host(271, 1, Duration::from_secs(10));
        assert_eq!(h.map(|h| h.addr.to_string()).as_deref(), Ok(node));
    }
    let out = sys.tool(As::Root, "gethost", "271", &["--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // From an allowed client (root, over the local socket) the level is
    // every caller's: collaborative admission still works.
    let out = sys.tool(
        As::Root,
        "report",
        "271",
        &[node, "0", "--downstream-level", "1,1"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let h = victim.get_host(271, 1, Duration::from_secs(10));
    assert!(matches!(h, Err(ClientError::Rejected { .. })), "{h:?}");
    let out = sys.tool(As::Nobody, "gethost", "271", &[]);
    assert_eq!(
        out.status.code(),
        Some(5),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_forged_report_frees_no_unit() {
    if !is_root() {
        return;
    }
    let sys = System::start(&[]);
    let node = "10.27.0.3:80";
    sys.module("272", &[(node, "2")], "balance");
    let mut holder = sys.client();
    for _ in 0..2 {
        holder.get_host(272, 1, Duration::from_secs(10)).unwrap();
    }
    assert_eq!(sys.in_use("272"), 2);
    // uid 65534 reports the node five times, over the local socket and
    // over UDP: it took nothing, it frees nothing.
    for _ in 0..5 {
        let out = sys.tool(As::Nobody, "report", "272", &[node, "0"]);
        assert!(out.status.success());
    }
    let mut enc = Encoder::new();
    for seq in 0..5 {
        let req = enc
            .report_req(&Report {
                seq,
                module: ModuleId::new(272, 1),
                host: node.parse::<NodeAddr>().unwrap(),
                retcode: 0,
                tcost_ms: 0,
                downstream_level: None,
                consumed: 0,
            })
            .to_vec();
        udp_exchange(sys.udp_port(), &req, Duration::from_millis(100));
    }
    assert_eq!(sys.in_use("272"), 2);
    let out = sys.tool(As::Nobody, "gethost", "272", &[]);
    assert_eq!(out.status.code(), Some(4), "no unit is free: overloaded");
    // The holder's own report frees one.
    holder.report(272, 1, node.parse().unwrap(), 0, 0).unwrap();
    assert_eq!(sys.in_use("272"), 1);
}

#[test]
fn a_loop_of_gethosts_from_one_client_takes_at_most_units_per_client() {
    if !is_root() {
        return;
    }
    let sys = System::start(&["lb.units_per_client=3"]);
    let node = "10.27.0.4:80";
    sys.module("273", &[(node, "10")], "balance");
    // Over plain UDP, one source address.
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut enc = Encoder::new();
    let mut ok = 0;
    for seq in 0..20 {
        let req = enc.get_host_req(seq, ModuleId::new(273, 1), 0, 0).to_vec();
        s.send_to(&req, ("127.0.0.1", sys.udp_port())).unwrap();
        let mut buf = [0u8; 2048];
        let n = s.recv(&mut buf).expect("an answer");
        if let Message::GetHostResp(r) = decode(&buf[..n], &Limits::UDP).unwrap() {
            if r.retcode() == RetCode::Ok {
                ok += 1;
            }
        }
    }
    assert_eq!(ok, 3, "one UDP source holds at most 3 units");
    // Over the local socket, one library client.
    let mut c = sys.client();
    let got: Vec<_> = (0..20)
        .map(|_| c.get_host(273, 1, Duration::from_secs(10)).is_ok())
        .collect();
    assert_eq!(got.iter().filter(|&&g| g).count(), 3, "{got:?}");
    assert_eq!(sys.in_use("273"), 6);
    // Others still get theirs.
    assert!(sys
        .client()
        .get_host(273, 1, Duration::from_secs(10))
        .is_ok());
}

#[test]
fn a_client_in_its_own_pid_and_network_namespace_is_served_bounded_and_reclaimed() {
    if !is_root() {
        return;
    }
    let sys = System::start(&["lb.units_per_client=2"]);
    let node = "10.27.0.5:80";
    sys.module("274", &[(node, "10")], "balance");
    // Served: its 127.0.0.1 is not the agent's, the local socket is.
    let out = sys.tool(As::Contained, "gethost", "274", &["--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(&out);
    assert_eq!(
        (v["host"].as_str(), v["source"].as_str()),
        (Some(node), Some("agent"))
    );
    // Identified like any other: uid 65534 may not consume.
    let out = sys.tool(
        As::Contained,
        "report",
        "274",
        &[node, "0", "--consume", "1"],
    );
    assert_eq!(
        out.status.code(),
        Some(10),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Bounded and reclaimed: one client looping getHosts without reports
    // holds two units while it runs, none once it is gone.
    let hb = sys.hb.clone();
    let mut load = command(
        As::Contained,
        &[
            "qpstest",
            "--threads",
            "1",
            "--duration",
            "4",
            "--no-report",
            "--modid",
            "274",
            "--cmdid",
            "1",
            "--transport",
            "local",
            "--heartbeat",
            &hb,
            "--json",
        ],
    );
    let load = Proc(
        load.stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let held = wait_for(Duration::from_secs(20), || {
        let n = sys.in_use("274");
        (n > 0).then_some(n)
    })
    .expect("the contained client takes units");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        held.max(sys.in_use("274")),
        2,
        "bounded by lb.units_per_client"
    );
    drop(load);
    wait_for(Duration::from_secs(10), || {
        (sys.in_use("274") == 0).then_some(())
    })
    .expect("its units go back once it is gone");
}

/// The host pid of the process `parent` forked (the first in /proc whose
/// parent it is).
fn child_of(parent: u32) -> Option<i32> {
    std::fs::read_dir("/proc").ok()?.find_map(|e| {
        let pid: i32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // "pid (comm) state ppid ...": the command may hold spaces.
        let ppid: u32 = stat
            .rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        (ppid == parent).then_some(pid)
    })
}

/// A process killed with SIGKILL when dropped (a test that fails midway
/// leaves nothing running).
struct Killed(i32);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

#[test]
fn a_shm_client_in_its_own_pid_and_network_namespace_is_served_bounded_and_reclaimed() {
    use lbagent::shm::layout;
    use lbagent::shm::region::Region;
    use std::sync::atomic::Ordering;
    if !is_root() {
        return;
    }
    // The region's group is uid 65534's own (nogroup), so that it may map
    // it; a unit not reported stays out for 600 s unless its client is
    // seen gone.
    let sys = System::start(&[
        "lb.units_per_client=2",
        "lb.unit_timeout=600",
        "shm.enabled=true",
        "shm.dir={dir}",
        "shm.group=nogroup",
    ]);
    let node = "10.27.0.6:80";
    sys.module("275", &[(node, "10")], "balance");
    let agent_pid = HeartbeatReader::open(Path::new(&sys.hb))
        .unwrap()
        .read()
        .unwrap()
        .info
        .pid;
    // One thread looping getHosts without reports over shared memory, as
    // uid 65534 in its own pid and network namespaces (pid 1 there).
    let log = sys.dir().join("contained.log");
    let mut unshare = Command::new("unshare");
    unshare
        .args(["--pid", "--net", "--fork", "--mount-proc", "setpriv"])
        .args([
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            BIN,
        ])
        .args([
            "qpstest",
            "--threads",
            "1",
            "--duration",
            "600",
            "--no-report",
        ])
        .args(["--modid", "275", "--cmdid", "1", "--transport", "shm"])
        .args(["--heartbeat", &sys.hb])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let unshare = Proc(unshare.spawn().unwrap());
    let client = Killed(
        wait_for(Duration::from_secs(10), || child_of(unshare.0.id()))
            .expect("unshare forks the contained client"),
    );
    let said = || std::fs::read_to_string(&log).unwrap_or_default();

    let region = Region::open(&sys.dir().join("heartbeat.shm.0")).unwrap();
    let g = *region.geometry();
    let word = |s: u32, off: usize| region.u32(g.slot_offset(s) + off).load(Ordering::SeqCst);
    let held = || (0..g.slots).find(|&s| word(s, layout::S_STATE) != layout::FREE);
    let seq = |s: u32| word(s, layout::S_REQ_SEQ) & !layout::TAKEN;
    // The slot its worker holds, served through (its request sequence
    // moves: not only over the local socket), and leased over its
    // connection: the owner is the agent's pid, not a pid of the client's
    // namespace. (Its registering client held one for a moment before.)
    let slot = wait_for(Duration::from_secs(30), || {
        let s = held()?;
        let from = seq(s);
        std::thread::sleep(Duration::from_millis(300));
        (word(s, layout::S_STATE) != layout::FREE && seq(s).wrapping_sub(from) >= 20).then_some(s)
    })
    .unwrap_or_else(|| {
        panic!(
            "the contained client is served through a slot; it said: {}",
            said()
        )
    });
    assert_eq!(word(slot, layout::S_STATE), agent_pid, "{}", said());
    // Bounded, and never reclaimed while it lives: the shard looks once a
    // second.
    let bounded = wait_for(Duration::from_secs(20), || {
        (sys.in_use("275") == 2).then_some(())
    });
    assert!(
        bounded.is_some(),
        "bounded by lb.units_per_client: {}",
        sys.in_use("275")
    );
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(800));
        assert_eq!(word(slot, layout::S_STATE), agent_pid, "still its slot");
        assert_eq!(held(), Some(slot), "one slot, the same");
        assert_eq!(sys.in_use("275"), 2);
    }
    let before = seq(slot);
    std::thread::sleep(Duration::from_millis(500));
    assert_ne!(seq(slot), before, "still served through its slot");

    // Killed: its slot and its units go back within a few seconds.
    drop(client);
    wait_for(Duration::from_secs(15), || {
        (word(slot, layout::S_STATE) == layout::FREE).then_some(())
    })
    .expect("the dead client's slot is free again");
    wait_for(Duration::from_secs(15), || {
        (sys.in_use("275") == 0).then_some(())
    })
    .expect("the units it held go back");
    drop(unshare);
}
