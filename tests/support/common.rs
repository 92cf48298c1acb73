//! Small helpers every end-to-end test file needs: bounded waits, a child
//! process's log in a file (and the addresses it bound, read from it), a
//! loopback address nothing listens on, the wall clock in milliseconds, a
//! GET of a metrics page, a standalone system started from the binary,
//! `lbagent` commands run as a user runs them, a patient client library.
//! Include it with
//! `#[path = "support/common.rs"] mod common;`.
//!
//! No helper here picks a "free" port for a process to bind later: another
//! test can take such a port in between. Servers bind port 0 and the test
//! reads the port they got from their log ([`wait_logged`], [`addr_after`]).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Calls `f` every 20 ms until it returns Some, at most `limit`.
pub fn wait_for<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if t0.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A loopback address nothing listens on, TCP or UDP: port 1 is below the
/// range the kernel hands out for port 0 and no test binds it (a port that
/// was free a moment ago could be another test's listener by the time it
/// is used). A connection is refused; a datagram meets "port unreachable".
pub fn nowhere() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 1))
}

/// Starts `cmd` with its standard error in the file `log`, for the test to
/// read (the addresses a server bound, its log lines); with
/// `LBAGENT_TEST_STDERR` set, also copied to the test's standard error.
pub fn spawn_logged(cmd: &mut Command, log: &Path) -> std::io::Result<Child> {
    let file = std::fs::File::create(log)?;
    if std::env::var_os("LBAGENT_TEST_STDERR").is_none() {
        return cmd.stderr(file).spawn();
    }
    let mut child = cmd.stderr(Stdio::piped()).spawn()?;
    let mut from = child.stderr.take().expect("piped");
    // Ends when the child (and whatever inherited its stderr) is gone.
    std::thread::spawn(move || {
        let mut file = file;
        let mut buf = [0u8; 4096];
        loop {
            match from.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let _ = file.write_all(&buf[..n]);
                    let _ = std::io::stderr().write_all(&buf[..n]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    });
    Ok(child)
}

/// The first complete line (ended by a newline: a line being written is
/// not read half) of the file `log` for which `f` gives Some.
pub fn find_in_log<T>(log: &Path, f: impl FnMut(&str) -> Option<T>) -> Option<T> {
    let text = std::fs::read_to_string(log).ok()?;
    let complete = &text[..text.rfind('\n')? + 1];
    complete.lines().find_map(f)
}

/// Waits (at most `limit`) until a complete line of `child`'s `log` gives
/// Some through `f`. Err, with the log, when the child exited first or the
/// time ran out.
pub fn wait_logged<T>(
    child: &mut Child,
    log: &Path,
    limit: Duration,
    mut f: impl FnMut(&str) -> Option<T>,
) -> Result<T, String> {
    let t0 = Instant::now();
    loop {
        if let Some(v) = find_in_log(log, &mut f) {
            return Ok(v);
        }
        let log_text = || std::fs::read_to_string(log).unwrap_or_default();
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!(
                "the process exited ({status}); its log:\n{}",
                log_text()
            ));
        }
        if t0.elapsed() > limit {
            return Err(format!(
                "not logged within {limit:?}; the log:\n{}",
                log_text()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The socket address right after `marker` in `line` ("metrics on
/// http://127.0.0.1:4242/metrics" with marker "http://": 127.0.0.1:4242).
pub fn addr_after(line: &str, marker: &str) -> Option<SocketAddr> {
    let rest = &line[line.find(marker)? + marker.len()..];
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == ':'))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// GET `path`; the body when the status is 200.
pub fn http_get(addr: SocketAddr, path: &str) -> Option<String> {
    // Generous: a stall of a busy machine must not turn a scrape into
    // None (the server answers and closes at once when it is well).
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

/// A child process killed (and reaped) when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `lbagent standalone` (the binary `bin`) with its data, heartbeat
/// and snapshot in `dir`: every listener on a loopback port of its own
/// (port 0), one shard, statistics sent every second, then the `extra`
/// `--set` settings. Returns once its heartbeat names it (at most 15 s),
/// with its heartbeat path.
pub fn start_standalone(bin: &str, dir: &Path, extra: &[String]) -> (Proc, std::path::PathBuf) {
    let heartbeat = dir.join("heartbeat");
    let mut sets = vec![
        "dnsserver.listen=127.0.0.1:0".to_string(),
        "dnsserver.metrics_addr=127.0.0.1:0".to_string(),
        "reporter.listen=127.0.0.1:0".to_string(),
        "reporter.metrics_addr=127.0.0.1:0".to_string(),
        "agent.metrics_addr=127.0.0.1:0".to_string(),
        "agent.base_port=0".to_string(),
        "agent.shards=1".to_string(),
        "lb.report_timeout=1".to_string(),
        format!("agent.heartbeat_path={}", heartbeat.display()),
        format!("agent.snapshot_path={}", dir.join("snapshot").display()),
    ];
    sets.extend_from_slice(extra);
    let data = dir.join("data");
    let mut args = vec!["standalone", "--data", data.to_str().unwrap()];
    for s in &sets {
        args.extend_from_slice(&["--set", s]);
    }
    let child = Command::new(bin)
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start lbagent standalone");
    let pid = child.id();
    let proc = Proc(child);
    wait_for(Duration::from_secs(15), || {
        let h = lbagent::host::heartbeat::HeartbeatReader::open(&heartbeat)
            .ok()?
            .read()
            .ok()?;
        (h.info.pid == pid && h.beat_unix_ms > 0).then_some(())
    })
    .expect("standalone writes its heartbeat within 15 s");
    (proc, heartbeat)
}

/// The package's `lbagent` binary.
pub const LBAGENT: &str = env!("CARGO_BIN_EXE_lbagent");

/// Runs `lbagent ARGS` to its end, stdin closed; its output.
pub fn run(args: &[&str]) -> Output {
    Command::new(LBAGENT)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run lbagent {args:?}: {e}"))
}

/// [`run`], which must succeed (else the test fails with its stderr).
pub fn run_ok(args: &[&str]) -> Output {
    let out = run(args);
    assert!(
        out.status.success(),
        "lbagent {args:?} failed ({:?}): {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A command's stdout as JSON (else the test fails showing it).
pub fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

/// The client library on the agent whose heartbeat is `hb`, patient with a
/// heartbeat that lags on a busy machine (30 s).
pub fn patient_client(hb: impl AsRef<Path>) -> lbagent::client::Client {
    lbagent::client::Client::with_options(lbagent::client::ClientOptions {
        heartbeat_path: hb.as_ref().into(),
        max_heartbeat_age: Duration::from_secs(30),
        ..lbagent::client::ClientOptions::default()
    })
    .expect("a client")
}
