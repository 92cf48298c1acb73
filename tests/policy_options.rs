//! Issue 31 end to end, from the shell: `lbagent route options` and
//! `route policy ... p2c` stored, pushed to a real agent and applied.
//! Every wait is bounded.

#[path = "support/common.rs"]
mod common;

use common::{json, patient_client, run, run_ok, start_standalone, wait_for, Proc, LBAGENT as BIN};
use std::path::Path;
use std::time::Duration;

use lbagent::client::ClientError;

/// A standalone system in `dir` (statistics sent every second); returns
/// it and its heartbeat path.
fn standalone(dir: &Path) -> (Proc, String) {
    let (p, heartbeat) = start_standalone(BIN, dir, &[]);
    (p, heartbeat.display().to_string())
}

#[test]
fn route_options_are_shown_set_unset_and_checked() {
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
    let shown = run_ok(&["route", "options", "5", "5", "--store", &store]);
    assert_eq!(
        String::from_utf8_lossy(&shown.stdout).trim(),
        "module [5, 5] slow_start_ms=default max_overloaded_percent=default \
         panic_percent=default locality_min_percent=default"
    );
    let set = json(&run_ok(&[
        "route",
        "options",
        "5",
        "5",
        "--slow-start-ms",
        "30000",
        "--panic-percent",
        "50",
        "--json",
        "--store",
        &store,
    ]));
    assert_eq!(set["slow_start_ms"], 30_000);
    assert_eq!(set["panic_percent"], 50);
    assert_eq!(set["max_overloaded_percent"], serde_json::Value::Null);
    assert_eq!(set["route_version"], 2);
    // Only the flags given change; `default` unsets one.
    let set = json(&run_ok(&[
        "route",
        "options",
        "5",
        "5",
        "--panic-percent",
        "default",
        "--locality-min-percent",
        "70",
        "--json",
        "--store",
        &store,
    ]));
    assert_eq!(set["slow_start_ms"], 30_000);
    assert_eq!(set["panic_percent"], serde_json::Value::Null);
    assert_eq!(set["locality_min_percent"], 70);
    let list = json(&run_ok(&["route", "list", "--json", "--store", &store]));
    assert_eq!(list["modules"][0]["options"]["slow_start_ms"], 30_000);
    // Out of range: exit 2 naming the option; nothing changes.
    let out = run(&[
        "route",
        "options",
        "5",
        "5",
        "--max-overloaded-percent",
        "0",
        "--store",
        &store,
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("max_overloaded_percent"), "{err}");
    let list = json(&run_ok(&["route", "list", "--json", "--store", &store]));
    assert_eq!(list["route_version"], 3);
    // p2c is a policy.
    let set = run_ok(&["route", "policy", "5", "5", "p2c", "--store", &store]);
    assert!(String::from_utf8_lossy(&set.stdout).contains("policy p2c"));
}

/// Both nodes of module 81 fail until the agent marks them overloaded;
/// returns what getHost answers then.
fn get_host_after_both_nodes_fail(with_panic: bool) -> Result<(), ClientError> {
    let dir = tempfile::tempdir().unwrap();
    let (_system, hb) = standalone(dir.path());
    let store = format!("sqlite:{}", dir.path().join("data/lbagent.db").display());
    let (a, b) = ("10.8.1.1:80", "10.8.1.2:80");
    run_ok(&["route", "add", "81", "1", a, "--store", &store]);
    run_ok(&["route", "add", "81", "1", b, "--store", &store]);
    if with_panic {
        run_ok(&[
            "route",
            "options",
            "81",
            "1",
            "--panic-percent",
            "50",
            "--store",
            &store,
        ]);
    }
    let mut client = patient_client(&hb);
    wait_for(Duration::from_secs(15), || {
        client.get_host(81, 1, Duration::from_secs(2)).ok()
    })
    .expect("the agent has the module within 15 s");
    // Both nodes: the agent may have pulled the route between the two
    // commits, and a report of a node it does not know yet is dropped.
    wait_for(Duration::from_secs(15), || {
        let out = run(&["getroute", "81", "1", "--json", "--heartbeat", &hb]);
        let v = out.status.success().then(|| json(&out))?;
        (v["nodes"].as_array()?.len() == 2).then_some(())
    })
    .expect("the agent has both nodes within 15 s");
    for node in [a, b] {
        for _ in 0..15 {
            client
                .report(81, 1, node.parse().unwrap(), 1, 0)
                .expect("report");
        }
    }
    // Reports are datagrams: wait until the agent shows both nodes
    // overloaded (getRoute changes nothing), then ask once.
    wait_for(Duration::from_secs(15), || {
        let out = run(&["getroute", "81", "1", "--json", "--heartbeat", &hb]);
        let v = out.status.success().then(|| json(&out))?;
        let nodes = v["nodes"].as_array()?;
        (nodes.len() == 2 && nodes.iter().all(|n| n["state"] == "overloaded")).then_some(())
    })
    .expect("the agent marks both nodes overloaded within 15 s");
    client.get_host(81, 1, Duration::from_secs(2)).map(|_| ())
}

#[test]
fn without_panic_a_module_whose_nodes_all_fail_is_overloaded() {
    let got = get_host_after_both_nodes_fail(false);
    assert!(
        matches!(got, Err(ClientError::Overloaded { .. })),
        "{got:?}"
    );
}

#[test]
fn a_modules_panic_percent_reaches_the_agent_and_answers_instead_of_overloaded() {
    let got = get_host_after_both_nodes_fail(true);
    assert!(got.is_ok(), "in panic getHost answers a node: {got:?}");
}
