//! What the Debian package and its systemd units rely on: the packaged
//! configuration is the documented default with the state moved to
//! /var/lib/lbagent, and each service tells systemd when it is ready
//! (`Type=notify`), the agent then pinging the watchdog and saying when it
//! stops. systemd is played by a Unix datagram socket in `$NOTIFY_SOCKET`.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lbagent::config::{Config, DEFAULT_TOML};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const PACKAGED: &str = include_str!("../tools/debian/lbagent.toml");

#[test]
fn the_packaged_config_is_the_default_with_the_state_in_var_lib_and_tls_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lbagent.toml");
    std::fs::write(&path, PACKAGED).unwrap();
    let packaged = Config::load(Some(&path), &[]).expect("the packaged config loads");
    let mut expected = Config::default();
    expected.agent.snapshot_path = PathBuf::from("/var/lib/lbagent/routes.snapshot");
    expected.store.url = "sqlite:/var/lib/lbagent/lbagent.db".into();
    expected.tls.cert = PathBuf::from("/etc/lbagent/tls/host.pem");
    expected.tls.key = PathBuf::from("/etc/lbagent/tls/host.key");
    expected.tls.ca = PathBuf::from("/etc/lbagent/tls/ca.pem");
    assert!(expected.tls.enabled(), "the package speaks mutual TLS");
    assert!(!expected.tls.insecure);
    assert_eq!(format!("{packaged:?}"), format!("{expected:?}"));
    // Every line of the documented default is there (the comments too),
    // but for the two moved paths and the three TLS files.
    let moved = ["snapshot_path = ", "url = ", "cert = ", "key = ", "ca = "];
    for line in DEFAULT_TOML.lines() {
        if !moved.iter().any(|m| line.starts_with(m)) {
            assert!(
                PACKAGED.lines().any(|l| l == line),
                "tools/debian/lbagent.toml lacks the default's line {line:?}: regenerate it from src/config/lbagent.toml"
            );
        }
    }
}

/// A stand-in for systemd's notification socket.
struct Systemd {
    sock: UnixDatagram,
    path: PathBuf,
}

impl Systemd {
    fn new(dir: &Path) -> Systemd {
        let path = dir.join("notify");
        let sock = UnixDatagram::bind(&path).unwrap();
        Systemd { sock, path }
    }

    /// The next notification within `limit`.
    fn next(&self, limit: Duration) -> Option<String> {
        let t0 = Instant::now();
        let mut buf = [0u8; 512];
        loop {
            let left = limit.checked_sub(t0.elapsed())?;
            self.sock
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .unwrap();
            match self.sock.recv(&mut buf) {
                Ok(n) => return Some(String::from_utf8_lossy(&buf[..n]).into_owned()),
                // A receive with a timeout fails so when the process is
                // stopped and continued: receive again, for what is left.
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return None,
            }
        }
    }

    /// Waits up to `limit` for `state`, skipping others.
    fn wait_for(&self, state: &str, limit: Duration) -> bool {
        let t0 = Instant::now();
        while let Some(left) = limit.checked_sub(t0.elapsed()) {
            match self.next(left.max(Duration::from_millis(1))) {
                Some(s) if s == state => return true,
                Some(_) => {}
                None => return false,
            }
        }
        false
    }
}

fn spawn(args: &[&str], systemd: &Systemd, watchdog_usec: Option<u64>) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lbagent"));
    cmd.args(args)
        .env("NOTIFY_SOCKET", &systemd.path)
        .env_remove("WATCHDOG_PID")
        .stdout(Stdio::null())
        .stderr(if std::env::var_os("LBAGENT_TEST_STDERR").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        });
    match watchdog_usec {
        Some(us) => cmd.env("WATCHDOG_USEC", us.to_string()),
        None => cmd.env_remove("WATCHDOG_USEC"),
    };
    cmd.spawn().expect("start lbagent")
}

fn sigterm(child: &mut Child) -> bool {
    let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(30) {
        if let Ok(Some(status)) = child.try_wait() {
            return status.success();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    false
}

#[test]
fn the_agent_says_ready_pings_the_watchdog_and_says_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let systemd = Systemd::new(dir.path());
    let heartbeat = format!(
        "agent.heartbeat_path=\"{}\"",
        dir.path().join("hb").display()
    );
    let snapshot = format!(
        "agent.snapshot_path=\"{}\"",
        dir.path().join("routes.snapshot").display()
    );
    let mut agent = spawn(
        &[
            "agent",
            "--base-port",
            "0",
            "--shards",
            "2",
            "--set",
            "agent.metrics_addr=\"127.0.0.1:0\"",
            "--set",
            "agent.route_servers=[\"127.0.0.1:1\"]",
            "--set",
            "agent.reporters=[\"127.0.0.1:1\"]",
            "--set",
            &heartbeat,
            "--set",
            &snapshot,
        ],
        &systemd,
        // WatchdogSec=1s: a check every 500 ms.
        Some(1_000_000),
    );
    let ready = systemd.next(Duration::from_secs(20));
    let pings = (0..2)
        .filter(|_| systemd.wait_for("WATCHDOG=1", Duration::from_secs(20)))
        .count();
    let clean = sigterm(&mut agent);
    let stopping = systemd.wait_for("STOPPING=1", Duration::from_secs(5));
    assert_eq!(ready.as_deref(), Some("READY=1"), "the first notification");
    assert_eq!(pings, 2, "watchdog pings while every loop turns");
    assert!(stopping, "STOPPING=1 on SIGTERM");
    assert!(clean, "exit status 0 after SIGTERM");
}

#[test]
fn without_watchdog_usec_the_agent_only_says_ready_and_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let systemd = Systemd::new(dir.path());
    let heartbeat = format!(
        "agent.heartbeat_path=\"{}\"",
        dir.path().join("hb").display()
    );
    let snapshot = format!(
        "agent.snapshot_path=\"{}\"",
        dir.path().join("routes.snapshot").display()
    );
    let mut agent = spawn(
        &[
            "agent",
            "--base-port",
            "0",
            "--shards",
            "1",
            "--set",
            "agent.metrics_addr=\"127.0.0.1:0\"",
            "--set",
            "agent.route_servers=[\"127.0.0.1:1\"]",
            "--set",
            "agent.reporters=[\"127.0.0.1:1\"]",
            "--set",
            &heartbeat,
            "--set",
            &snapshot,
        ],
        &systemd,
        None,
    );
    let ready = systemd.next(Duration::from_secs(20));
    // Two seconds would hold several pings at the shortest check interval.
    let more = systemd.next(Duration::from_secs(2));
    let clean = sigterm(&mut agent);
    let after = systemd.next(Duration::from_secs(5));
    assert_eq!(ready.as_deref(), Some("READY=1"));
    assert_eq!(more, None, "nothing between READY and STOPPING");
    assert_eq!(after.as_deref(), Some("STOPPING=1"));
    assert!(clean);
}

#[test]
fn the_route_server_and_the_reporter_say_ready() {
    for role in ["dnsserver", "reporter"] {
        let dir = tempfile::tempdir().unwrap();
        let systemd = Systemd::new(dir.path());
        let store = format!("sqlite:{}", dir.path().join("lbagent.db").display());
        let listen = format!("{role}.listen=\"127.0.0.1:0\"");
        let metrics = format!("{role}.metrics_addr=\"127.0.0.1:0\"");
        let mut server = spawn(
            &[role, "--store", &store, "--set", &listen, "--set", &metrics],
            &systemd,
            None,
        );
        let ready = systemd.next(Duration::from_secs(30));
        let clean = sigterm(&mut server);
        assert_eq!(ready.as_deref(), Some("READY=1"), "{role}");
        assert!(clean, "{role} exits 0 after SIGTERM");
    }
}
