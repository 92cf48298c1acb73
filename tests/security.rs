//! Issue 27, part 1: the attacks of another local user on the agent's
//! files, on the agent through its shared memory, and the smaller holes,
//! each tried and seen failing. The attacker runs as uid 65534 through
//! `setpriv --reuid 65534 --regid 65534 --clear-groups`, which needs root:
//! CI runs the tests as root, and without root these tests fail loudly
//! (they never pass by skipping). See docs/src/design/trust.md.

#[path = "support/common.rs"]
mod common;
#[path = "support/rebind.rs"]
mod rebind;
#[path = "support/routesrc.rs"]
mod routesrc;

#[path = "support/agentproc.rs"]
mod agentproc;

use std::net::{Ipv4Addr, UdpSocket};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentproc::AgentProc;
use common::wait_for;
use lbagent::client::{Client, ClientError, ClientOptions, HostSource};
use lbagent::host::heartbeat::{AgentInfo, HeartbeatWriter};
use lbagent::host::snapshot::{self, SnapshotRoute};
use lbagent::model::{ModuleId, NodeAddr, Policy, RouteNode};
use lbagent::shm::layout;
use lbagent::shm::region::Region;
use lbagent::store::StoreUrl;
use routesrc::RouteSource;

const BIN: &str = env!("CARGO_BIN_EXE_lbagent");
const M: ModuleId = ModuleId::new(27, 1);
const NOBODY: u32 = 65534;
/// A call meant to be answered: generous for a busy machine.
const T: Duration = Duration::from_secs(5);
/// The attacker's fake agent and node.
const EVIL: Ipv4Addr = Ipv4Addr::new(6, 6, 6, 6);

/// The timing-sensitive tests (load, latency) take turns.
static ALONE: Mutex<()> = Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ALONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Fails loudly without root: the attacks need a second user.
fn require_root() {
    assert_eq!(
        nix::unistd::geteuid().as_raw(),
        0,
        "tests/security.rs runs the attacks as uid {NOBODY} through setpriv, which needs root \
         (CI runs as root): run it as root"
    );
}

/// The command prefix that runs what follows as uid/gid 65534 with no
/// groups.
const NOBODY_SETPRIV: [&str; 6] = [
    "setpriv",
    "--reuid",
    "65534",
    "--regid",
    "65534",
    "--clear-groups",
];

/// `args` run as uid/gid 65534 with no groups.
fn as_nobody(args: &[&str]) -> Output {
    Command::new(NOBODY_SETPRIV[0])
        .args(&NOBODY_SETPRIV[1..])
        .args(args)
        .output()
        .expect("run setpriv (util-linux)")
}

/// A fresh directory that uid 65534 can traverse (tempdir makes 0700).
fn open_tempdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    chmod(dir.path(), 0o755);
    dir
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn chown_nobody(path: &Path) {
    std::os::unix::fs::chown(path, Some(NOBODY), Some(NOBODY)).unwrap();
}

/// A directory like `/dev/shm` or `/tmp`: anyone may create files in it.
fn sticky_dir(parent: &Path) -> PathBuf {
    let d = parent.join("shared");
    std::fs::create_dir(&d).unwrap();
    chmod(&d, 0o1777);
    d
}

fn node(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 27, 0, i), 9000)
}

fn nodes(n: u8) -> Vec<RouteNode> {
    (1..=n)
        .map(|i| RouteNode {
            addr: node(i),
            weight: 1,
        })
        .collect()
}

/// An agent config in `dir` (heartbeat `hb`), run once with `--check`
/// skipped: the agent started, waited for (at most 20 s) to exit.
fn agent_exit(dir: &Path, hb: &Path, extra: &str) -> (Option<i32>, String) {
    agent_exit_as(dir, hb, extra, &[])
}

/// [`agent_exit`], the agent started through `prefix` (`setpriv ...`: as
/// another user).
fn agent_exit_as(dir: &Path, hb: &Path, extra: &str, prefix: &[&str]) -> (Option<i32>, String) {
    let config = dir.join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "[agent]\nbase_port = 0\nshards = 1\nroute_servers = [\"127.0.0.1:1\"]\n\
             reporters = [\"127.0.0.1:1\"]\nheartbeat_path = \"{}\"\nsnapshot_path = \"{}\"\n\
             metrics_addr = \"127.0.0.1:0\"\n{extra}\n",
            hb.display(),
            dir.join("routes.snapshot").display()
        ),
    )
    .unwrap();
    let argv: Vec<&str> = prefix
        .iter()
        .copied()
        .chain([BIN, "agent", "--config", config.to_str().unwrap()])
        .collect();
    let mut child = Command::new(argv[0])
        .args(&argv[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_for(Duration::from_secs(20), || child.try_wait().unwrap());
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the agent started on a planted file instead of refusing it");
    }
    let mut err = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status.unwrap().code(), err)
}

/// A heartbeat as the attacker's fake agent would write it, at `path`
/// (made by root here, then handed over): shard 0 on `port` on loopback,
/// so that a client that trusted it would send there.
fn fake_heartbeat(path: &Path, port: u16) {
    let scratch = tempfile::tempdir().unwrap();
    let made = scratch.path().join("heartbeat");
    let w = HeartbeatWriter::create(
        &made,
        &AgentInfo {
            shards: 1,
            base_port: port,
            bind: Ipv4Addr::LOCALHOST,
            pid: std::process::id(),
            snapshot_path: PathBuf::new(),
        },
    )
    .unwrap();
    w.beat(common::unix_ms());
    std::fs::write(path, std::fs::read(&made).unwrap()).unwrap();
}

/// A UDP socket where the attacker's fake agent listens: it must never
/// receive a request.
fn evil_listener() -> UdpSocket {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_nonblocking(true).unwrap();
    s
}

fn received(s: &UdpSocket) -> bool {
    let mut buf = [0u8; 2048];
    s.recv_from(&mut buf).is_ok()
}

fn no_static(hb: &Path, dir: &Path) -> ClientOptions {
    ClientOptions {
        heartbeat_path: hb.to_path_buf(),
        snapshot_path: dir.join("no-snapshot"),
        static_fallback: false,
        shm: false,
        ..ClientOptions::default()
    }
}

fn assert_names(msg: &str, path: &Path, what: &[&str]) {
    assert!(msg.contains(&*path.to_string_lossy()), "{msg}");
    for w in what {
        assert!(msg.contains(w), "{w:?} not in: {msg}");
    }
}

// === planted heartbeat ===

#[test]
fn a_heartbeat_planted_0666_in_a_shared_directory_is_neither_adopted_nor_read() {
    require_root();
    let dir = open_tempdir();
    let shared = sticky_dir(dir.path());
    let hb = shared.join("lbagent.heartbeat");
    // The attacker plants a world-writable file before the agent starts.
    let out = as_nobody(&["sh", "-c", &format!("umask 0; : > {}", hb.display())]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(std::fs::metadata(&hb).unwrap().mode() & 0o777, 0o666);
    // The agent refuses the directory, naming it, its owner and mode, and
    // the fix, and leaves the attacker's file as it was (never adopted).
    let (code, err) = agent_exit(dir.path(), &hb, "");
    assert_ne!(code, Some(0), "{err}");
    assert_names(
        &err,
        &shared,
        &["uid 0", "1777", "other users can write it", "chmod 0755"],
    );
    assert_eq!(
        std::fs::metadata(&hb).unwrap().len(),
        0,
        "the agent wrote into it"
    );

    // The attacker's fake agent: a valid heartbeat it owns, pointing at
    // its own port. A client refuses it and never sends there.
    let evil = evil_listener();
    std::fs::remove_file(&hb).unwrap();
    fake_heartbeat(&hb, evil.local_addr().unwrap().port());
    chown_nobody(&hb);
    chmod(&hb, 0o666);
    let mut c = Client::with_options(no_static(&hb, dir.path())).unwrap();
    let e = c.get_host(M.modid, M.cmdid, T).unwrap_err();
    assert!(matches!(e, ClientError::AgentDown(_)), "{e}");
    assert_names(&e.to_string(), &hb, &["uid 65534", "0666", "planted"]);
    assert!(
        !received(&evil),
        "the client asked the attacker's fake agent"
    );
}

#[test]
fn a_foreign_heartbeat_in_the_agents_directory_is_refused_by_agent_and_client() {
    require_root();
    let dir = open_tempdir();
    let hb = dir.path().join("heartbeat");
    let evil = evil_listener();
    for mode in [0o644, 0o666] {
        let _ = std::fs::remove_file(&hb);
        fake_heartbeat(&hb, evil.local_addr().unwrap().port());
        chown_nobody(&hb);
        chmod(&hb, mode);
        let before = std::fs::read(&hb).unwrap();
        let (code, err) = agent_exit(dir.path(), &hb, "");
        assert_ne!(code, Some(0), "{err}");
        assert_names(
            &err,
            &hb,
            &[
                "uid 65534",
                &format!("{mode:04o}"),
                "not made by this agent",
                "rm ",
            ],
        );
        assert_eq!(std::fs::read(&hb).unwrap(), before, "the agent rewrote it");
        let mut c = Client::with_options(no_static(&hb, dir.path())).unwrap();
        let e = c.get_host(M.modid, M.cmdid, T).unwrap_err();
        assert!(matches!(e, ClientError::AgentDown(_)), "{e}");
        assert_names(
            &e.to_string(),
            &hb,
            &["uid 65534", "not the agent's", "planted"],
        );
        assert!(
            !received(&evil),
            "the client asked the attacker's fake agent"
        );
    }
}

/// What a first try as root leaves in the agent's directory (the
/// README's `lbagent standalone` run as root, then stopped): root's
/// heartbeat and its 0600 lock, which the packaged agent's user cannot even
/// open. The agent stops naming the file, its owner and what to do (CI's
/// package test met exactly this, with a bare "Permission denied"), and
/// leaves both files as they were.
#[test]
fn files_an_agent_run_as_root_left_stop_another_users_agent_naming_them() {
    require_root();
    let dir = open_tempdir();
    chown_nobody(dir.path());
    let hb = dir.path().join("heartbeat");
    let lock = lbagent::host::heartbeat::lock_path(&hb);
    fake_heartbeat(&hb, 1);
    std::fs::write(&lock, b"").unwrap();
    chmod(&lock, 0o600);
    let (code, err) = agent_exit_as(dir.path(), &hb, "", &NOBODY_SETPRIV);
    assert_ne!(code, Some(0), "{err}");
    assert_names(
        &err,
        &lock,
        &[
            "refusing",
            "uid 0 (root), mode 0600",
            "not made by this agent's user (uid 65534)",
            "left by an agent run as that user",
            "rm ",
        ],
    );
    assert!(!err.contains("Permission denied"), "{err}");
    // The lock alone gone, the heartbeat is next: the same words.
    std::fs::remove_file(&lock).unwrap();
    let before = std::fs::read(&hb).unwrap();
    let (code, err) = agent_exit_as(dir.path(), &hb, "", &NOBODY_SETPRIV);
    assert_ne!(code, Some(0), "{err}");
    assert_names(
        &err,
        &hb,
        &[
            "refusing",
            "uid 0 (root), mode 0644",
            "left by an agent run as that user",
            "rm ",
        ],
    );
    assert_eq!(std::fs::read(&hb).unwrap(), before, "the agent rewrote it");
    assert_eq!(std::fs::metadata(&hb).unwrap().uid(), 0);
}

#[test]
fn a_local_socket_path_another_user_left_or_linked_stops_the_start_naming_it() {
    require_root();
    let dir = open_tempdir();
    let hb = dir.path().join("heartbeat");
    let sock = lbagent::host::local::socket_path(&hb, 0);
    let elsewhere = dir.path().join("elsewhere");
    // A stale socket of uid 65534 where shard 0's goes (an agent once run
    // as that user, or a plant), then a symbolic link of that user's.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    std::os::unix::fs::lchown(&sock, Some(NOBODY), Some(NOBODY)).unwrap();
    let (code, err) = agent_exit(dir.path(), &hb, "");
    assert_ne!(code, Some(0), "{err}");
    assert_names(
        &err,
        &sock,
        &["refusing", "uid 65534", "not made by this agent", "rm "],
    );
    assert_eq!(
        std::fs::symlink_metadata(&sock).unwrap().uid(),
        NOBODY,
        "the agent replaced another user's socket"
    );
    std::fs::remove_file(&sock).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &sock).unwrap();
    std::os::unix::fs::lchown(&sock, Some(NOBODY), Some(NOBODY)).unwrap();
    let (code, err) = agent_exit(dir.path(), &hb, "");
    assert_ne!(code, Some(0), "{err}");
    assert_names(
        &err,
        &sock,
        &["refusing", "symbolic link", "uid 65534", "rm "],
    );
    assert!(!elsewhere.exists(), "the agent followed the link");
    // Its own stale socket is replaced: the agent starts.
    std::fs::remove_file(&sock).unwrap();
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    let config = dir.path().join("agent.toml");
    let mut agent = Command::new(BIN)
        .args(["agent", "--config", config.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let served = wait_for(Duration::from_secs(20), || {
        std::os::unix::net::UnixStream::connect(&sock).ok()
    });
    let _ = agent.kill();
    let _ = agent.wait();
    assert!(served.is_some(), "the agent replaced its own stale socket");
}

#[test]
fn another_user_cannot_hold_the_agents_lock_nor_plant_in_its_directory() {
    require_root();
    let dir = open_tempdir();
    let source = RouteSource::start();
    source.set_route(M, &nodes(2));
    let mut agent = AgentProc::start(dir.path(), source.addr(), 1, "");
    let hb = agent.heartbeat_path();
    // The attacker takes an flock on the heartbeat it can read...
    let mut holder: Child = Command::new(NOBODY_SETPRIV[0])
        .args(&NOBODY_SETPRIV[1..])
        .args(["flock", "-n", "-x", hb.to_str().unwrap(), "sleep", "60"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // ...and cannot even open the lock file, nor create a file there.
    let lock = lbagent::host::heartbeat::lock_path(&hb);
    assert_eq!(std::fs::metadata(&lock).unwrap().mode() & 0o777, 0o600);
    let out = as_nobody(&["flock", "-n", "-x", lock.to_str().unwrap(), "true"]);
    assert!(!out.status.success(), "uid 65534 locked {}", lock.display());
    let planted = dir.path().join("heartbeat.shm.0");
    let out = as_nobody(&["touch", planted.to_str().unwrap()]);
    assert!(
        !out.status.success() && !planted.exists(),
        "planted {}",
        planted.display()
    );
    // Once the holder has its lock (this process cannot take it), restart
    // the agent: it starts.
    let held = wait_for(Duration::from_secs(20), || {
        let free = Command::new("flock")
            .args(["-n", "-x", hb.to_str().unwrap(), "true"])
            .status()
            .unwrap()
            .success();
        (!free).then_some(())
    });
    if held.is_none() {
        let _ = holder.kill();
        let _ = holder.wait();
        panic!("uid 65534 never held the flock");
    }
    assert!(holder.try_wait().unwrap().is_none(), "the holder exited");
    let (code, _) = agent.sigterm();
    assert_eq!(code, Some(0));
    agent.spawn();
    let mut c = agent.client();
    let h = c
        .register(M.modid, M.cmdid, T)
        .and_then(|_| c.get_host(M.modid, M.cmdid, T));
    let _ = holder.kill();
    let _ = holder.wait();
    assert_eq!(h.unwrap().source, HostSource::Agent);
}

#[test]
fn a_heartbeat_at_the_old_dev_shm_path_is_read_only_when_it_passes_the_checks() {
    require_root();
    let dir = open_tempdir();
    let source = RouteSource::start();
    source.set_route(M, &nodes(2));
    let agent = AgentProc::start(dir.path(), source.addr(), 1, "");
    // A private /run and /dev/shm (a mount namespace): the default path
    // is empty, the old one holds a copy of the live agent's heartbeat,
    // owned first by root (read: the agent answers), then by uid 65534
    // (refused, naming the file).
    let hb = agent.heartbeat_path();
    let script = format!(
        "set -e; mount -t tmpfs tmpfs /run; mount -t tmpfs tmpfs /dev/shm; \
         cp {hb} /dev/shm/lbagent.heartbeat; \
         {BIN} gethost {m} {c} --json --snapshot /nonexistent; \
         chown 65534:65534 /dev/shm/lbagent.heartbeat; \
         ! {BIN} gethost {m} {c} --json --snapshot /nonexistent",
        hb = hb.display(),
        m = M.modid,
        c = M.cmdid,
    );
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .env_remove("LBAGENT_HEARTBEAT")
        .env_remove("LBAGENT_SNAPSHOT")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("\"source\":\"agent\""), "{stdout}");
    assert_names(
        &stderr,
        Path::new("/dev/shm/lbagent.heartbeat"),
        &["uid 65534"],
    );
}

// === planted region and static route file ===

#[test]
fn a_region_directory_others_can_write_and_a_foreign_region_are_refused() {
    require_root();
    let dir = open_tempdir();
    let shared = sticky_dir(dir.path());
    let hb = dir.path().join("heartbeat");
    // The attacker plants an empty region where the agent will make one.
    let planted = shared.join("heartbeat.shm.0");
    let out = as_nobody(&["touch", planted.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let shm = format!("[shm]\nenabled = true\ndir = \"{}\"\n", shared.display());
    let (code, err) = agent_exit(dir.path(), &hb, &shm);
    assert_ne!(code, Some(0), "{err}");
    assert_names(
        &err,
        &shared,
        &["uid 0", "1777", "other users can write it", "shm.dir"],
    );
    // A region file another user owns is never mapped by a client, even
    // in a directory that passes (as after a chown by mistake).
    let own = dir.path().join("own");
    std::fs::create_dir(&own).unwrap();
    chmod(&own, 0o755);
    let region = own.join("r.0");
    Region::create(
        &region,
        lbagent::shm::layout::Geometry::new(1),
        lbagent::shm::region::Identity {
            shard: 0,
            pid: 1,
            boot: 1,
        },
        lbagent::shm::region::Access::Owner,
    )
    .unwrap();
    chown_nobody(&region);
    let e = Region::open(&region).unwrap_err().to_string();
    assert_names(&e, &region, &["uid 65534", "not the agent's"]);
}

#[test]
fn a_static_route_file_in_a_directory_another_user_made_is_never_answered() {
    require_root();
    let dir = open_tempdir();
    let shared = sticky_dir(dir.path());
    // The attacker makes the directory first (as /var/tmp/lbagent could
    // be) and plants a valid static route file naming its own node.
    let theirs = shared.join("lbagent");
    let snap = theirs.join("routes.snapshot");
    std::fs::create_dir(&theirs).unwrap();
    snapshot::write(
        &snap,
        1,
        &[SnapshotRoute {
            module: M,
            version: 1,
            nodes: vec![RouteNode {
                addr: NodeAddr::new(EVIL, 666),
                weight: 1,
            }],
            meta: Vec::new(),
        }],
    )
    .unwrap();
    for p in [&theirs, &snap] {
        chown_nobody(p);
    }
    let mut c = Client::with_options(ClientOptions {
        heartbeat_path: dir.path().join("no-agent"),
        snapshot_path: snap.clone(),
        shm: false,
        ..ClientOptions::default()
    })
    .unwrap();
    let e = c.get_host(M.modid, M.cmdid, T).unwrap_err();
    assert!(matches!(e, ClientError::StaticRoutes(_)), "{e}");
    assert_names(&e.to_string(), &theirs, &["uid 65534", "anyone can write"]);
    // The agent's writer (what it runs every snapshot_interval) refuses
    // the directory too, and reads nothing from it.
    let e = snapshot::write(&snap, 2, &[]).unwrap_err().to_string();
    assert_names(&e, &theirs, &["uid 65534"]);
    let e = snapshot::read_index(&snap).unwrap_err().to_string();
    assert_names(&e, &theirs, &["uid 65534"]);
}

// === no client crashes the agent ===

/// `lbagent qpstest` over shared memory against `hb`: the load, in its
/// own process (a truncated region may kill a client; never the agent).
fn shm_load(hb: &Path) -> Child {
    Command::new(BIN)
        .args([
            "qpstest",
            "--transport",
            "shm",
            "--threads",
            "4",
            "--duration",
            "60",
        ])
        .args(["--timeout-ms", "200", "--heartbeat", hb.to_str().unwrap()])
        .args([
            "--modid",
            &M.modid.to_string(),
            "--cmdid",
            &M.cmdid.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn a_region_truncated_to_nothing_under_load_twenty_times_kills_nothing() {
    require_root();
    let _turn = alone();
    let dir = open_tempdir();
    let source = RouteSource::start();
    source.set_route(M, &nodes(3));
    let shm = format!(
        "[shm]\nenabled = true\ndir = \"{}\"\nslots = 8\n",
        dir.path().display()
    );
    for round in 0..20 {
        let mut agent = AgentProc::start(dir.path(), source.addr(), 1, &shm);
        agent
            .client()
            .register(M.modid, M.cmdid, T)
            .expect("the route arrives");
        let mut load = shm_load(&agent.heartbeat_path());
        // Truncate once the load goes through the region.
        let served = wait_for(Duration::from_secs(20), || {
            agent
                .metric("lbagent_shm_requests_total")
                .filter(|v| *v >= 100.0)
        });
        assert!(
            served.is_some(),
            "round {round}: no load over shared memory"
        );
        let region = agent.region_path(0);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&region)
            .unwrap()
            .set_len(0)
            .unwrap();
        let counted = wait_for(Duration::from_secs(15), || {
            agent
                .metric("lbagent_shm_truncated_total")
                .filter(|v| *v >= 1.0)
        });
        let _ = load.kill();
        let _ = load.wait();
        let alive = agent.child.as_mut().unwrap().try_wait().unwrap();
        assert!(alive.is_none(), "round {round}: the agent died: {alive:?}");
        assert!(
            counted.is_some(),
            "round {round}: the truncation was not counted"
        );
        // It serves on, by UDP.
        let mut c = Client::with_options(ClientOptions {
            shm: false,
            ..agent.options()
        })
        .unwrap();
        assert_eq!(
            c.get_host(M.modid, M.cmdid, T).unwrap().source,
            HostSource::Agent
        );
        let (code, _) = agent.sigterm();
        assert_eq!(code, Some(0), "round {round}");
    }
    let log = std::fs::read_to_string(dir.path().join("agent.stderr")).unwrap_or_default();
    assert!(log.contains("truncated"), "{log}");
}

#[test]
fn a_late_answer_rings_the_doorbell_whatever_parked_says() {
    require_root();
    let _turn = alone();
    let dir = open_tempdir();
    let source = RouteSource::start();
    source.set_route(M, &nodes(2));
    let shm = format!(
        "[shm]\nenabled = true\ndir = \"{}\"\nslots = 4\n",
        dir.path().display()
    );
    let agent = AgentProc::start(dir.path(), source.addr(), 1, &shm);
    let mut c = agent.client();
    c.register(M.modid, M.cmdid, T).unwrap();
    // A member of the group keeps saying the shard is awake.
    let region = Region::open(&agent.region_path(0)).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let liar = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                region.u32(layout::H_PARKED).store(0, Ordering::SeqCst);
                std::thread::sleep(Duration::from_micros(50));
            }
        })
    };
    let mut took = Vec::new();
    for _ in 0..15 {
        // Idle long enough for the shard to park.
        std::thread::sleep(Duration::from_millis(150));
        let t0 = Instant::now();
        let h = c.get_host(M.modid, M.cmdid, T).unwrap();
        took.push(t0.elapsed());
        c.report(M.modid, M.cmdid, h.addr, 0, 1).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    liar.join().unwrap();
    assert!(c.shm_attached() > 0, "the calls went by UDP");
    took.sort();
    let median = took[took.len() / 2];
    // Without the bound the shard's own timer answers (about 300 ms); with
    // it, about 5 ms. 100 ms leaves room for a busy machine.
    assert!(
        median < Duration::from_millis(100),
        "median {median:?}: {took:?}"
    );
}

// === the smaller ones ===

#[test]
fn a_fifo_at_the_config_path_on_sighup_does_not_block_sigterm() {
    require_root();
    let dir = open_tempdir();
    let source = RouteSource::start();
    source.set_route(M, &nodes(1));
    let mut agent = AgentProc::start(dir.path(), source.addr(), 1, "");
    let config = dir.path().join("lbagent.toml");
    std::fs::remove_file(&config).unwrap();
    let ok = Command::new("mkfifo").arg(&config).status().unwrap();
    assert!(ok.success());
    agent.signal(libc::SIGHUP);
    let log = dir.path().join("agent.stderr");
    let refused = wait_for(Duration::from_secs(10), || {
        let text = std::fs::read_to_string(&log).ok()?;
        text.contains("reload refused").then_some(text)
    });
    assert!(refused.is_some(), "no refused reload logged");
    assert!(refused.unwrap().contains("FIFO"));
    let (code, took) = agent.sigterm();
    assert_eq!(code, Some(0));
    assert!(took < Duration::from_secs(10));
}

#[test]
fn a_fifo_at_a_tls_file_on_sighup_does_not_block_sigterm() {
    // Issue 27's other reload read: a SIGHUP re-reads the TLS files on
    // the main thread; a FIFO there blocked it (waiting for a writer) and
    // SIGTERM went unheard.
    require_root();
    let dir = open_tempdir();
    let source = RouteSource::start();
    source.set_route(M, &nodes(1));
    let tls = lbagent::tls::testing::TestCa::new("fleet").write(
        dir.path(),
        "agent",
        &["agent.fleet"],
        lbagent::tls::testing::Validity::Now,
    );
    let table = format!(
        "[tls]\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\n",
        tls.cert.display(),
        tls.key.display(),
        tls.ca.display()
    );
    let mut agent = AgentProc::start(dir.path(), source.addr(), 1, &table);
    std::fs::remove_file(&tls.ca).unwrap();
    let ok = Command::new("mkfifo").arg(&tls.ca).status().unwrap();
    assert!(ok.success());
    agent.signal(libc::SIGHUP);
    let log = dir.path().join("agent.stderr");
    let refused = wait_for(Duration::from_secs(10), || {
        let text = std::fs::read_to_string(&log).ok()?;
        text.contains("keeping the previous TLS files")
            .then_some(text)
    });
    assert!(refused.is_some(), "no refused TLS reload logged");
    assert_names(&refused.unwrap(), &tls.ca, &["FIFO", "tls.ca"]);
    let (code, took) = agent.sigterm();
    assert_eq!(code, Some(0));
    assert!(took < Duration::from_secs(10));
}

#[test]
fn route_import_quotes_at_most_a_few_hundred_bytes_of_a_field() {
    let dir = open_tempdir();
    let store = format!("sqlite:{}", dir.path().join("s.db").display());
    let table = dir.path().join("t.csv");
    let huge = "7".repeat(10 << 20);
    std::fs::write(
        &table,
        format!("modid,cmdid,ip,port,weight\n{huge},1,10.0.0.1,80,1\n"),
    )
    .unwrap();
    let out = Command::new(BIN)
        .args([
            "route",
            "import",
            table.to_str().unwrap(),
            "--create",
            "--store",
            &store,
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        out.stderr.len() < 1000,
        "{} bytes on stderr",
        out.stderr.len()
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("line 2") && err.contains("bytes in all"),
        "{err}"
    );
}

#[test]
fn export_then_import_replace_is_the_identity_with_consumed_nodes() {
    let dir = open_tempdir();
    let path = dir.path().join("s.db");
    let url = format!("sqlite:{}", path.display());
    let b = ModuleId::new(27, 2);
    {
        let mut s = lbagent::store::open(&StoreUrl::Sqlite(path.clone())).unwrap();
        for (m, w) in [(M, 3), (b, 10)] {
            for i in 1..=3 {
                s.add_node(
                    m,
                    RouteNode {
                        addr: node(i),
                        weight: w,
                    },
                )
                .unwrap();
            }
        }
        s.set_policy(b, Policy::Balance).unwrap();
        // One node fully consumed, one partly.
        s.consume(&[(b, node(1), 10), (b, node(2), 4)]).unwrap();
    }
    let export = || {
        let out = Command::new(BIN)
            .args(["route", "export", "--store", &url])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let load = || {
        let mut s = lbagent::store::open(&StoreUrl::Sqlite(path.clone())).unwrap();
        let mut all = s.load_all().unwrap().modules;
        for r in &mut all {
            r.version = 0;
        }
        all
    };
    let (first, before) = (export(), load());
    assert!(
        first.contains(",0\n"),
        "a fully consumed node exports 0: {first}"
    );
    let table = dir.path().join("t.csv");
    std::fs::write(&table, &first).unwrap();
    let out = Command::new(BIN)
        .args([
            "route",
            "import",
            table.to_str().unwrap(),
            "--replace",
            "--store",
            &url,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(export(), first);
    assert_eq!(load(), before);
}
