//! `lbagent demo-service` and its library shell on loopback: answers carry
//! the level, bad datagrams are dropped, overload sheds the least
//! important requests first, the binary's flags are checked.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lbagent::admission::{AdmissionLevel, AdmissionParams};
use lbagent::demo_service::{
    serve, serve_traced, Arrival, Counters, ServiceParams, ServiceTrace, Shedding,
};
use lbagent::model::ModuleId;
use lbagent::wire::{decode, Encoder, Limits, Message, RetCode};

/// One answer: retcode and level.
type Answer = (u32, RetCode, Option<AdmissionLevel>);

struct Caller {
    socket: UdpSocket,
    enc: Encoder,
    buf: Vec<u8>,
}

impl Caller {
    fn new(server: SocketAddr) -> Self {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        socket.connect(server).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        Caller {
            socket,
            enc: Encoder::new(),
            buf: vec![0; 65_536],
        }
    }

    fn send(&mut self, seq: u32, b: u8, u: u8) {
        let req = self.enc.get_host_req(seq, ModuleId::new(7, 8), b, u);
        self.socket.send(req).unwrap();
    }

    fn recv(&mut self) -> Answer {
        // Interrupted: a receive with a timeout fails so when the process is
        // stopped and continued; receive again.
        let n = loop {
            match self.socket.recv(&mut self.buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => break r.expect("an answer within 10 s"),
            }
        };
        let Ok(Message::GetHostResp(resp)) = decode(&self.buf[..n], &Limits::UDP) else {
            panic!("not a GetHostResp");
        };
        assert_eq!((resp.modid(), resp.cmdid()), (7, 8), "the module is echoed");
        let level = AdmissionLevel::from_wire(resp.admission_level());
        (resp.seq(), resp.retcode(), level)
    }

    /// Sends one request and waits for its answer, skipping others.
    fn call(&mut self, seq: u32, b: u8, u: u8) -> Answer {
        self.send(seq, b, u);
        loop {
            let a = self.recv();
            if a.0 == seq {
                return a;
            }
        }
    }
}

/// Runs the service on 127.0.0.1:0 while `f` runs.
fn with_service(params: ServiceParams, f: impl FnOnce(SocketAddr, &Counters)) {
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = socket.local_addr().unwrap();
    let stop = AtomicBool::new(false);
    let counters = Counters::default();
    std::thread::scope(|s| {
        let server = s.spawn(|| serve(&socket, params, &stop, &counters));
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(addr, &counters)));
        stop.store(true, Ordering::Relaxed);
        server.join().unwrap().unwrap();
        if let Err(p) = outcome {
            std::panic::resume_unwind(p);
        }
    });
}

fn params(shedding: Shedding) -> ServiceParams {
    ServiceParams {
        workers: 2,
        service_us: 1000,
        queue: 1000,
        shedding,
        admission: AdmissionParams::default(),
        seed: 1,
    }
}

#[test]
fn every_answer_carries_the_level_under_dagor() {
    with_service(params(Shedding::Dagor), |addr, counters| {
        let mut c = Caller::new(addr);
        for seq in 1..=5 {
            assert_eq!(
                c.call(seq, 128, 128),
                (seq, RetCode::Ok, Some(AdmissionLevel::new(128, 128))),
                "the open level admits everything"
            );
        }
        // Counters are published after the answer is sent.
        let deadline = Instant::now() + Duration::from_secs(10);
        while counters.completed.load(Ordering::Relaxed) < 5 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(counters.completed.load(Ordering::Relaxed), 5);
        assert_eq!(counters.level.load(Ordering::Relaxed), 0x8080);
    });
}

#[test]
fn a_full_queue_answers_unavailable_with_the_level() {
    // One worker busy for a second, one waiting place: of three requests
    // sent at once the third finds the queue full (the first is being
    // served or waiting, the second waiting or refused alike).
    let p = ServiceParams {
        workers: 1,
        service_us: 1_000_000,
        queue: 1,
        ..params(Shedding::Dagor)
    };
    with_service(p, |addr, _| {
        let mut c = Caller::new(addr);
        c.send(1, 128, 128);
        c.send(2, 128, 128);
        assert_eq!(
            c.call(3, 128, 128),
            (3, RetCode::Unavailable, Some(AdmissionLevel::new(128, 128))),
            "a refusal for a full queue carries the level too"
        );
    });
}

#[test]
fn no_level_without_dagor_and_random_shedding_at_rate_one_rejects_all() {
    with_service(params(Shedding::Off), |addr, _| {
        assert_eq!(Caller::new(addr).call(1, 3, 3), (1, RetCode::Ok, None));
    });
    with_service(params(Shedding::Random { rate: 1.0 }), |addr, _| {
        assert_eq!(
            Caller::new(addr).call(1, 1, 1),
            (1, RetCode::Rejected, None)
        );
    });
}

#[test]
fn a_bad_datagram_is_dropped_and_the_service_keeps_serving() {
    with_service(params(Shedding::Dagor), |addr, counters| {
        let mut c = Caller::new(addr);
        c.socket.send(b"not a flatbuffer at all").unwrap();
        // A valid buffer of the wrong message.
        let report = Encoder::new().keep_alive(5).to_vec();
        c.socket.send(&report).unwrap();
        assert_eq!(c.call(9, 1, 1).1, RetCode::Ok);
        assert_eq!(counters.malformed.load(Ordering::Relaxed), 2);
    });
}

#[test]
fn the_traced_shell_keeps_every_request_and_window() {
    // Windows of one request: each start ends one.
    let p = ServiceParams {
        admission: AdmissionParams {
            window_requests: 1,
            ..AdmissionParams::default()
        },
        ..params(Shedding::Dagor)
    };
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = socket.local_addr().unwrap();
    let stop = AtomicBool::new(false);
    let counters = Counters::default();
    let mut trace = ServiceTrace::default();
    std::thread::scope(|s| {
        let server = s.spawn(|| serve_traced(&socket, p, &stop, &counters, &mut trace));
        let mut c = Caller::new(addr);
        c.socket.send(b"junk").unwrap();
        assert_eq!(c.call(1, 3, 4).1, RetCode::Ok);
        assert_eq!(c.call(2, 5, 6).1, RetCode::Ok);
        stop.store(true, Ordering::Relaxed);
        server.join().unwrap().unwrap();
    });
    let seen: Vec<_> = trace
        .arrivals
        .iter()
        .map(|a| (a.business, a.user, a.outcome))
        .collect();
    assert_eq!(
        seen,
        [(3, 4, Arrival::Queued), (5, 6, Arrival::Queued)],
        "the valid requests, in order; the junk is not one"
    );
    for a in &trace.arrivals {
        assert!(
            a.arrival_us <= a.read_us,
            "stamped before it was read: {a:?}"
        );
    }
    assert!(trace.arrivals[0].arrival_us <= trace.arrivals[1].arrival_us);
    // Each start ended a window of one sample.
    assert_eq!(trace.windows.len(), 2, "{trace:?}");
    for (at, _, o) in &trace.windows {
        assert!(*at >= trace.arrivals[0].arrival_us);
        assert_eq!(o.window.samples, 1);
    }
}

#[test]
fn a_full_queue_answers_unavailable() {
    let p = ServiceParams {
        workers: 1,
        service_us: 200_000,
        queue: 1,
        ..params(Shedding::Off)
    };
    with_service(p, |addr, _| {
        let mut c = Caller::new(addr);
        // One in service, one queued, the third refused at once.
        for seq in 1..=3 {
            c.send(seq, 1, 1);
        }
        assert_eq!(c.recv(), (3, RetCode::Unavailable, None));
        assert_eq!(c.recv().0, 1);
        assert_eq!(c.recv().0, 2);
    });
}

#[test]
fn overload_sheds_the_less_important_and_keeps_the_most_important() {
    // 50 requests/s, windows of 100 ms or 20 starts, 20 ms threshold.
    let p = ServiceParams {
        workers: 1,
        service_us: 20_000,
        queue: 10_000,
        admission: AdmissionParams {
            window_us: 100_000,
            window_requests: 20,
            ..AdmissionParams::default()
        },
        ..params(Shedding::Dagor)
    };
    with_service(p, |addr, _| {
        let mut c = Caller::new(addr);
        // A burst of 1.2 s of work at business priority 50.
        for seq in 1..=60 {
            c.send(seq, 50, 1);
        }
        // Probe at priority 60 until the level sheds it.
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut seq = 1000;
        let rejected = loop {
            assert!(Instant::now() < deadline, "no level below 60 within 20 s");
            seq += 1;
            c.send(seq, 60, 1);
            let a = c.recv();
            if a.1 == RetCode::Rejected {
                break a;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let level = rejected.2.expect("a rejection carries the level");
        assert!(level.business < 60, "{level:?}");
        // The most important class is still served, with the level attached.
        let (_, rc, level) = c.call(1, 1, 128);
        assert_eq!(rc, RetCode::Ok);
        assert!(level.is_some());
    });
}

fn lbagent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lbagent"))
}

#[test]
fn the_binary_serves_and_prints_its_address() {
    let mut child = lbagent()
        .args(["demo-service", "--bind", "127.0.0.1:0", "--workers", "2"])
        .args(["--service-us", "1000", "--set", "admission.window_ms=200"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let outcome = std::panic::catch_unwind(|| {
        let addr: SocketAddr = line
            .strip_prefix("demo-service listening on ")
            .and_then(|r| {
                r.split(':')
                    .take(2)
                    .collect::<Vec<_>>()
                    .join(":")
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("first line: {line}"));
        assert!(line.contains("2000 requests/s"), "{line}");
        let a = Caller::new(addr).call(1, 5, 5);
        assert_eq!(a, (1, RetCode::Ok, Some(AdmissionLevel::new(128, 128))));
    });
    child.kill().unwrap();
    child.wait().unwrap();
    if let Err(p) = outcome {
        std::panic::resume_unwind(p);
    }
}

#[test]
fn the_binary_names_a_bad_setting() {
    let out = lbagent()
        .args([
            "demo-service",
            "--bind",
            "127.0.0.1:0",
            "--set",
            "admission.alpha=2",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("admission.alpha = 2 is out of range"), "{err}");
    let out = lbagent()
        .args([
            "demo-service",
            "--bind",
            "127.0.0.1:0",
            "--shedding",
            "random",
        ])
        .args(["--random-rate", "1.5"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--random-rate 1.5 is out of range"), "{err}");
}
