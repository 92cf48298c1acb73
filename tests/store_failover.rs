//! Issue 32: a reporter follows a PostgreSQL promotion without a restart
//! and loses nothing it acknowledged.
//!
//! The test makes its own two-server cluster on loopback from Debian's
//! PostgreSQL binaries (`initdb`, `pg_basebackup -R`, `pg_ctl`, run as the
//! `postgres` user, since the server refuses root): a primary, and a
//! streaming standby that is synchronous (`synchronous_standby_names`), so
//! that a commit the primary confirms is on the standby too. The reporter
//! runs in-process with a URL naming both servers and
//! `target_session_attrs=read-write`. Reports flow; the primary is killed
//! (`pg_ctl stop -m immediate`) and the standby promoted; reports go on
//! flowing. Every report the reporter acknowledged, before or after, must
//! be in the promoted server, and writes must be accepted again within
//! 15 s of the promotion.
//!
//! Gated like the other PostgreSQL tests on `LBAGENT_TEST_POSTGRES_URL`
//! (CI sets it, having installed PostgreSQL), and skipped when not run as
//! root or without the binaries.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use lbagent::config::ReporterConfig;
use lbagent::model::{ModuleId, NodeAddr};
use lbagent::reporter::Reporter;
use lbagent::store::{self, StoreUrl};
use lbagent::wire::{
    decode, write_frame, Encoder, FrameDecoder, Limits, Message, ModuleStats, NodeStats,
};

/// The longest any single wait may take (a busy machine).
const WAIT: Duration = Duration::from_secs(60);

/// The newest Debian PostgreSQL's binaries, if installed.
fn pg_bin() -> Option<PathBuf> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|b| b.join("initdb").exists())
        .collect();
    versions.sort();
    versions.pop()
}

/// Runs `bin/cmd args` as the `postgres` user; panics with its output when
/// it fails.
fn as_postgres(bin: &Path, cmd: &str, args: &[&str]) {
    let out = Command::new("setpriv")
        .args([
            "--reuid",
            "postgres",
            "--regid",
            "postgres",
            "--clear-groups",
        ])
        .arg(bin.join(cmd))
        .args(args)
        .output()
        .expect("run setpriv");
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A server of the test's cluster: stopped (immediately) when dropped.
struct Server {
    bin: PathBuf,
    data: PathBuf,
}

impl Server {
    fn start(bin: &Path, data: &Path, dir: &Path, port: u16, extra: &str) -> Server {
        let opts = format!(
            "-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={} -c fsync=off {extra}",
            dir.display()
        );
        let log = format!("{}.log", data.display());
        as_postgres(
            bin,
            "pg_ctl",
            &[
                "-D",
                data.to_str().unwrap(),
                "-o",
                &opts,
                "-l",
                &log,
                "-w",
                "-t",
                "60",
                "start",
            ],
        );
        Server {
            bin: bin.to_path_buf(),
            data: data.to_path_buf(),
        }
    }

    fn kill(&self) {
        as_postgres(
            &self.bin,
            "pg_ctl",
            &["-D", self.data.to_str().unwrap(), "-m", "immediate", "stop"],
        );
    }

    fn promote(&self) {
        as_postgres(
            &self.bin,
            "pg_ctl",
            &[
                "-D",
                self.data.to_str().unwrap(),
                "-w",
                "-t",
                "60",
                "promote",
            ],
        );
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = Command::new("setpriv")
            .args([
                "--reuid",
                "postgres",
                "--regid",
                "postgres",
                "--clear-groups",
            ])
            .arg(self.bin.join("pg_ctl"))
            .args(["-D", self.data.to_str().unwrap(), "-m", "immediate", "stop"])
            .output();
    }
}

/// Two loopback ports for the servers: below Linux's ephemeral range
/// (32768..), so that no client socket holds them, and from the process
/// id, so that parallel runs rarely meet (a taken port fails the start,
/// loudly, naming it).
fn ports() -> (u16, u16) {
    let base = 20_000 + (std::process::id() % 6_000) as u16 * 2;
    (base, base + 1)
}

/// An agent connection sending one-row reports, module = seq.
struct Agent {
    stream: TcpStream,
    frames: FrameDecoder,
    enc: Encoder,
}

impl Agent {
    fn connect(addr: SocketAddr) -> Agent {
        let stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        Agent {
            stream,
            frames: FrameDecoder::default(),
            enc: Encoder::new(),
        }
    }

    /// Sends report `seq` and waits for its answer: true for a StatsAck.
    fn report(&mut self, seq: u64) -> bool {
        let nodes = [NodeStats {
            addr: NodeAddr::new(Ipv4Addr::new(10, 0, 0, 1), 80),
            succ: seq as u32,
            err: 0,
            overloaded: false,
        }];
        let modules = [ModuleStats {
            module: ModuleId::new(seq as u32, 1),
            nodes: &nodes,
            consumed: &[],
        }];
        let mut out = Vec::new();
        write_frame(
            &mut out,
            self.enc
                .stats_report_of_run(seq, 7, 1_700_000_000, 9, &modules),
        )
        .unwrap();
        self.stream.write_all(&out).unwrap();
        let mut buf = [0u8; 1024];
        loop {
            if let Some(f) = self.frames.next_frame().unwrap() {
                return matches!(decode(f, &Limits::TCP_FRAME).unwrap(), Message::StatsAck(a) if a.seq() == seq);
            }
            let n = self
                .stream
                .read(&mut buf)
                .expect("an answer within the wait");
            assert!(n > 0, "the reporter closed the connection");
            self.frames.feed(&buf[..n]);
        }
    }
}

#[test]
fn a_reporter_follows_a_promotion_and_loses_nothing_it_acknowledged() {
    if std::env::var_os("LBAGENT_TEST_POSTGRES_URL").is_none() {
        println!("note: LBAGENT_TEST_POSTGRES_URL is not set: skipping");
        return;
    }
    let Some(bin) = pg_bin() else {
        println!("note: no /usr/lib/postgresql/*/bin/initdb: skipping");
        return;
    };
    if unsafe { libc::geteuid() } != 0 {
        println!("note: not root (the servers run as postgres): skipping");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let status = Command::new("chown")
        .args(["postgres:postgres", dir.path().to_str().unwrap()])
        .status()
        .unwrap();
    assert!(status.success());
    let (p1, p2) = ports();
    let primary_data = dir.path().join("primary");
    let standby_data = dir.path().join("standby");
    as_postgres(
        &bin,
        "initdb",
        &[
            "-D",
            primary_data.to_str().unwrap(),
            "-A",
            "trust",
            "-U",
            "lbagent",
            "--no-sync",
        ],
    );
    // Synchronous: a commit the primary confirms is on the standby.
    let primary = Server::start(
        &bin,
        &primary_data,
        dir.path(),
        p1,
        "-c wal_level=replica -c max_wal_senders=4 -c synchronous_standby_names=*",
    );
    as_postgres(
        &bin,
        "pg_basebackup",
        &[
            "-h",
            "127.0.0.1",
            "-p",
            &p1.to_string(),
            "-U",
            "lbagent",
            "-D",
            standby_data.to_str().unwrap(),
            "-R",
            "-X",
            "stream",
            "--no-sync",
        ],
    );
    let standby = Server::start(&bin, &standby_data, dir.path(), p2, "");

    let url = format!(
        "postgres://lbagent@127.0.0.1:{p1},127.0.0.1:{p2}/postgres?target_session_attrs=read-write&connect_timeout=5"
    );
    let store_url: StoreUrl = url.parse().unwrap();
    let cfg = ReporterConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        metrics_addr: "127.0.0.1:0".parse().unwrap(),
        retry_max_ms: 500,
        ..ReporterConfig::default()
    };
    let reporter = Reporter::start(&cfg, store_url.clone()).expect("the reporter starts");
    let mut agent = Agent::connect(reporter.addr());
    let mut acked = Vec::new();
    for seq in 1..=20 {
        assert!(agent.report(seq), "report {seq} acknowledged");
        acked.push(seq);
    }

    primary.kill();
    let promoted_at = Instant::now();
    standby.promote();
    // The first report after the promotion waits for the reporter to find
    // the new primary; the rest flow.
    let mut first_after = None;
    for seq in 21..=40 {
        if agent.report(seq) {
            first_after.get_or_insert_with(|| promoted_at.elapsed());
            acked.push(seq);
        }
    }
    let took = first_after.expect("writes accepted again after the promotion");
    println!("writes accepted again {took:?} after the promotion");
    assert!(
        took <= Duration::from_secs(15) + Duration::from_secs(5),
        "writes accepted again {took:?} after the promotion (target 15 s; 5 s allowed for a busy machine)"
    );
    reporter.stop().expect("a clean stop");

    let rows = store::open(&store_url).unwrap().call_status(None).unwrap();
    let stored: Vec<u64> = rows.iter().map(|r| u64::from(r.module.modid)).collect();
    for seq in &acked {
        assert!(
            stored.contains(seq),
            "report {seq} was acknowledged and is not in the promoted server"
        );
    }
    drop(standby);
    drop(primary);
}
