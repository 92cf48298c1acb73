//! The balance policy end to end, from the shell: `lbagent standalone`,
//! `lbagent route add|policy`, and the tools `lbagent gethost|report|
//! getroute` as a user runs them. Every wait is bounded.

#[path = "support/common.rs"]
mod common;

use common::{json, patient_client, run, run_ok, start_standalone, wait_for, Proc, LBAGENT as BIN};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use lbagent::client::ClientError;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// A standalone system in `dir` (statistics sent every second); returns
/// it and its heartbeat path.
fn standalone(dir: &Path) -> (Proc, String) {
    let (p, heartbeat) = start_standalone(BIN, dir, &[]);
    (p, heartbeat.display().to_string())
}

#[test]
fn weights_2_and_3_give_exactly_five_hosts_the_sixth_is_overloaded_and_a_report_frees_one() {
    let dir = tempfile::tempdir().unwrap();
    let (_system, hb) = standalone(dir.path());
    let store = format!("sqlite:{}", dir.path().join("data/lbagent.db").display());
    let hb = ["--heartbeat", hb.as_str()];
    let (a, b) = ("10.8.0.1:80", "10.8.0.2:80");
    run_ok(&[
        "route", "add", "78", "1", a, "--weight", "2", "--store", &store,
    ]);
    run_ok(&[
        "route", "add", "78", "1", b, "--weight", "3", "--store", &store,
    ]);
    let set = run_ok(&["route", "policy", "78", "1", "balance", "--store", &store]);
    assert!(String::from_utf8_lossy(&set.stdout).contains("policy balance"));
    let list = json(&run_ok(&[
        "route", "list", "78", "1", "--json", "--store", &store,
    ]));
    assert_eq!(list["modules"][0]["policy"], "balance");

    // getRoute takes no unit: wait until the agent holds both nodes as a
    // balance module.
    let getroute = |extra: &[&str]| {
        let mut args = vec!["getroute", "78", "1"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&hb);
        run(&args)
    };
    let view = wait_for(Duration::from_secs(10), || {
        let out = getroute(&["--json"]);
        let v = out.status.success().then(|| json(&out))?;
        (v["policy"] == "balance" && v["nodes"].as_array()?.len() == 2).then_some(v)
    })
    .expect("the agent has the balance module within 10 s");
    for n in view["nodes"].as_array().unwrap() {
        assert_eq!(n["in_use"], 0, "{view}");
    }

    // Units are held by the client that took them and go back when it
    // exits (issue 27): one client, in this process, takes them all.
    let mut client = patient_client(hb[1]);
    let mut gethost = || client.get_host(78, 1, Duration::from_secs(2));
    let mut given: BTreeMap<String, u32> = BTreeMap::new();
    for i in 0..5 {
        let host = gethost().unwrap_or_else(|e| panic!("getHost {i}: {e}"));
        *given.entry(host.addr.to_string()).or_default() += 1;
    }
    assert_eq!(
        given,
        BTreeMap::from([(a.to_string(), 2), (b.to_string(), 3)]),
        "five getHosts without reports take every unit, none past a node's weight"
    );
    let sixth = gethost();
    assert!(
        matches!(sixth, Err(ClientError::Overloaded { .. })),
        "no free unit: OVERLOADED; got {sixth:?}"
    );

    // getRoute shows capacity, in use and Φ (0 for every node: none free).
    let view = json(&getroute(&["--json"]));
    for n in view["nodes"].as_array().unwrap() {
        assert_eq!(n["capacity"], n["in_use"], "{view}");
        assert_eq!(n["phi"], 0.0, "{view}");
    }
    let table = String::from_utf8_lossy(&getroute(&[]).stdout).to_string();
    assert!(
        table.contains("policy balance") && table.contains("INUSE"),
        "{table}"
    );

    // A report from another process returns nothing: it took no unit.
    let mut args = vec!["report", "78", "1", b, "0"];
    args.extend_from_slice(&hb);
    run_ok(&args);
    let view = json(&getroute(&["--json"]));
    for n in view["nodes"].as_array().unwrap() {
        assert_eq!(n["capacity"], n["in_use"], "{view}");
    }
    // The client's own report returns one of b's units: its next getHost
    // gets it.
    let b_addr = b.parse().unwrap();
    client.report(78, 1, b_addr, 0, 0).unwrap();
    let view = json(&getroute(&["--json"]));
    let phis: Vec<f64> = view["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["phi"].as_f64().unwrap())
        .collect();
    assert_eq!(phis.iter().sum::<f64>(), 1.0, "{view}");
    let mut gethost = || client.get_host(78, 1, Duration::from_secs(2));
    assert_eq!(gethost().unwrap().addr.to_string(), b);
    assert!(matches!(gethost(), Err(ClientError::Overloaded { .. })));
    // The client exits: every unit it held goes back at once.
    drop(client);
    wait_for(Duration::from_secs(10), || {
        let view = json(&getroute(&["--json"]));
        view["nodes"]
            .as_array()?
            .iter()
            .all(|n| n["in_use"] == 0)
            .then_some(())
    })
    .expect("a client's units go back when it is gone");
}

/// A library client of the agent whose heartbeat is `hb`.
#[test]
fn route_policy_refuses_an_unknown_policy_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite:{}", dir.path().join("lbagent.db").display());
    run_ok(&[
        "route",
        "add",
        "5",
        "5",
        "10.0.0.1:80",
        "--create",
        "--store",
        &store,
    ]);
    let out = run(&["route", "policy", "5", "5", "greedy", "--store", &store]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not one of l5, balance"), "{err}");
    let list = json(&run_ok(&["route", "list", "--json", "--store", &store]));
    assert_eq!(list["modules"][0]["policy"], "l5");
    assert_eq!(list["route_version"], 1);
}

#[test]
fn units_consumed_for_good_lower_the_capacity_for_the_agent_never_below_zero() {
    let dir = tempfile::tempdir().unwrap();
    let (_system, hb) = standalone(dir.path());
    let store = format!("sqlite:{}", dir.path().join("data/lbagent.db").display());
    let hb = ["--heartbeat", hb.as_str()];
    let (a, b) = ("10.9.0.1:80", "10.9.0.2:80");
    run_ok(&[
        "route", "add", "79", "1", a, "--weight", "2", "--store", &store,
    ]);
    run_ok(&[
        "route", "add", "79", "1", b, "--weight", "3", "--store", &store,
    ]);
    run_ok(&["route", "policy", "79", "1", "balance", "--store", &store]);
    let capacity = |node: &str| -> Option<(u64, u64)> {
        let mut args = vec!["getroute", "79", "1", "--json"];
        args.extend_from_slice(&hb);
        let out = run(&args);
        let v = out.status.success().then(|| json(&out))?;
        if v["policy"] != "balance" {
            return None;
        }
        let n = v["nodes"].as_array()?.iter().find(|n| n["host"] == node)?;
        let list = json(&run_ok(&[
            "route", "list", "79", "1", "--json", "--store", &store,
        ]));
        let stored = list["modules"][0]["nodes"]
            .as_array()?
            .iter()
            .find(|n| n["node"] == node)?["weight"]
            .as_u64()?;
        Some((stored, n["capacity"].as_u64()?))
    };
    wait_for(Duration::from_secs(10), || {
        (capacity(b) == Some((3, 3))).then_some(())
    })
    .expect("the agent has the balance module within 10 s");

    let report = |node: &str, consume: &str| {
        let mut args = vec!["report", "79", "1", node, "0", "--consume", consume];
        args.extend_from_slice(&hb);
        run(&args)
    };
    assert!(report(b, "2").status.success());
    wait_for(Duration::from_secs(10), || {
        (capacity(b) == Some((1, 1))).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "2 of 3 units consumed reach the store and the agent within 10 s: {:?}",
            capacity(b)
        )
    });
    // More than is left: the capacity stops at 0.
    assert!(report(b, "5").status.success());
    wait_for(Duration::from_secs(10), || {
        (capacity(b) == Some((0, 0))).then_some(())
    })
    .unwrap_or_else(|| panic!("the capacity goes to 0 and no lower: {:?}", capacity(b)));
    // Only a's two units are left (for one client holding them).
    let mut client = patient_client(hb[1]);
    let mut hosts = Vec::new();
    loop {
        match client.get_host(79, 1, Duration::from_secs(2)) {
            Ok(h) => hosts.push(h.addr.to_string()),
            Err(e) => {
                assert!(matches!(e, ClientError::Overloaded { .. }), "{e}");
                break;
            }
        }
        assert!(hosts.len() <= 2, "{hosts:?}");
    }
    assert_eq!(hosts, [a, a]);
    // 0 and values past the largest weight are refused before sending.
    for bad in ["0", "1000001", "-1"] {
        let out = report(b, bad);
        assert_eq!(out.status.code(), Some(2), "--consume {bad}");
    }
}

#[test]
fn a_balance_module_is_still_balance_after_the_agent_restarts_from_its_snapshot() {
    // The static route file keeps no policy: a restarted agent must get the
    // module's policy from the route server even though the route itself is
    // unchanged (a versioned re-pull would answer "unchanged", no policy).
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite:{}", dir.path().join("data/lbagent.db").display());
    let policy_seen = |hb: &str| {
        wait_for(Duration::from_secs(15), || {
            let out = run(&["getroute", "79", "1", "--json", "--heartbeat", hb]);
            let v = out.status.success().then(|| json(&out))?;
            (v["policy"] == "balance" && v["nodes"].as_array()?.len() == 2).then_some(())
        })
    };
    {
        let (system, hb) = standalone(dir.path());
        for node in ["10.9.0.1:80", "10.9.0.2:80"] {
            run_ok(&[
                "route", "add", "79", "1", node, "--weight", "2", "--store", &store,
            ]);
        }
        run_ok(&["route", "policy", "79", "1", "balance", "--store", &store]);
        policy_seen(&hb).expect("the agent has the balance module within 15 s");
        // SIGTERM: the agent writes its final snapshot before it exits.
        let mut system = system;
        assert_eq!(
            kill(Pid::from_raw(system.0.id() as i32), Signal::SIGTERM),
            Ok(())
        );
        let exited = wait_for(Duration::from_secs(20), || system.0.try_wait().ok()?);
        assert!(exited.is_some(), "standalone exits within 20 s of SIGTERM");
    }
    let snapshots = [
        dir.path().join("snapshot"),
        dir.path().join("data/routes.snapshot"),
    ];
    assert!(
        snapshots.iter().any(|p| p.exists()),
        "a snapshot was written at shutdown: {snapshots:?}"
    );
    let (_system, hb) = standalone(dir.path());
    policy_seen(&hb).expect("after the restart the module is balance again within 15 s");
}
