//! Issue 31, zones and labels end to end through real processes: set with
//! `lbagent route add --zone/--label` and `route meta`, stored, pushed by
//! the route server to a real agent, which prefers its own zone's nodes and
//! picks only the nodes a selector matches; kept through `route export` →
//! `route import --replace`. Every wait is bounded.

#[path = "support/common.rs"]
mod common;

use common::{json, patient_client, run, run_ok, start_standalone, wait_for, LBAGENT as BIN};
use std::collections::BTreeSet;
use std::time::Duration;

use lbagent::client::Client;
use lbagent::model::Selector;

/// The nodes `n` getHosts of module (31, 1) answered, selecting by
/// `select` when given; None when one failed (the module not there yet).
fn try_answered(client: &mut Client, select: Option<&str>, n: usize) -> Option<BTreeSet<String>> {
    let selector: Option<Selector> = select.map(|s| s.parse().unwrap());
    (0..n)
        .map(|_| {
            let host = match &selector {
                Some(s) => client.get_host_selecting(31, 1, s, Duration::from_secs(2)),
                None => client.get_host(31, 1, Duration::from_secs(2)),
            };
            host.ok().map(|h| h.addr.to_string())
        })
        .collect()
}

/// [`try_answered`], every getHost answered.
fn answered(client: &mut Client, select: Option<&str>, n: usize) -> BTreeSet<String> {
    try_answered(client, select, n).expect("every getHost is answered")
}

fn set(nodes: &[&str]) -> BTreeSet<String> {
    nodes.iter().map(|s| s.to_string()).collect()
}

const EU: &str = "10.31.0.1:80";
const US_CANARY: &str = "10.31.0.2:80";
const US_STABLE: &str = "10.31.0.3:80";

#[test]
fn zones_and_labels_set_from_the_shell_steer_a_real_agents_get_hosts() {
    let dir = tempfile::tempdir().unwrap();
    let (_system, hb) = start_standalone(BIN, dir.path(), &["agent.zone=eu-1".to_string()]);
    let store = format!("sqlite:{}", dir.path().join("data/lbagent.db").display());
    let add = |node: &str, zone: &str, label: &str| {
        run_ok(&[
            "route", "add", "31", "1", node, "--zone", zone, "--label", label, "--store", &store,
        ]);
    };
    add(EU, "eu-1", "version=stable");
    add(US_CANARY, "us-1", "version=canary");
    add(US_STABLE, "us-1", "version=stable");
    // All three nodes: the agent may have pulled the route between the
    // commits, and the checks below need every node.
    let hb_arg = hb.display().to_string();
    wait_for(Duration::from_secs(15), || {
        let out = run(&["getroute", "31", "1", "--json", "--heartbeat", &hb_arg]);
        let v = out.status.success().then(|| json(&out))?;
        (v["nodes"].as_array()?.len() == 3).then_some(())
    })
    .expect("the agent has all three nodes within 15 s");
    let mut client = patient_client(&hb);
    // The agent is in eu-1: every getHost stays on the eu-1 node once the
    // route (with its zones) has arrived.
    wait_for(Duration::from_secs(15), || {
        (try_answered(&mut client, None, 6)? == set(&[EU])).then_some(())
    })
    .expect("within 15 s the agent answers only its own zone's node");
    assert_eq!(answered(&mut client, None, 20), set(&[EU]));
    // A selector picks only the nodes it matches, whatever their zone.
    assert_eq!(
        answered(&mut client, Some("version=canary"), 20),
        set(&[US_CANARY])
    );
    assert!(answered(&mut client, Some("version=stable"), 20).is_subset(&set(&[EU, US_STABLE])));

    // route meta moves the eu-1 node to us-1: no node is local any more,
    // and the agent takes turns over all three.
    run_ok(&[
        "route", "meta", "31", "1", EU, "--zone", "us-1", "--store", &store,
    ]);
    wait_for(Duration::from_secs(15), || {
        (answered(&mut client, None, 9).len() == 3).then_some(())
    })
    .expect("within 15 s the zone change reaches the agent");
    run_ok(&[
        "route", "meta", "31", "1", EU, "--zone", "eu-1", "--store", &store,
    ]);
    wait_for(Duration::from_secs(15), || {
        (answered(&mut client, None, 6) == set(&[EU])).then_some(())
    })
    .expect("within 15 s the zone is back");

    // Export, then import --replace: the identity, zones and labels kept.
    let exported = run_ok(&["route", "export", "--store", &store]).stdout;
    let text = String::from_utf8(exported.clone()).unwrap();
    assert!(
        text.starts_with("modid,cmdid,ip,port,weight,zone,labels\n"),
        "{text}"
    );
    assert!(
        text.contains("10.31.0.2,80,1,us-1,version=canary"),
        "{text}"
    );
    let file = dir.path().join("routes.csv");
    std::fs::write(&file, &exported).unwrap();
    run_ok(&[
        "route",
        "import",
        "--replace",
        file.to_str().unwrap(),
        "--store",
        &store,
    ]);
    let again = run_ok(&["route", "export", "--store", &store]).stdout;
    assert_eq!(
        String::from_utf8(again).unwrap(),
        text,
        "export → import --replace is the identity"
    );
    // The agent, pushed the re-imported route, still steers.
    assert_eq!(answered(&mut client, None, 20), set(&[EU]));
    assert_eq!(
        answered(&mut client, Some("version=canary"), 10),
        set(&[US_CANARY])
    );
}

#[test]
fn bad_zones_and_labels_are_refused_by_the_shell_with_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite:{}", dir.path().join("lbagent.db").display());
    run_ok(&[
        "route",
        "add",
        "1",
        "1",
        "10.0.0.1:80",
        "--create",
        "--store",
        &store,
    ]);
    let long = "z".repeat(64);
    let cases: [(&[&str], &str); 5] = [
        (&["--zone", "eu 1"], "the character ' '"),
        (&["--zone", &long], "at most 63"),
        (&["--label", "version"], "KEY=VALUE"),
        (&["--label", "a=1", "--label", "a=2"], "given twice"),
        (&["--label", "k=v!"], "the character '!'"),
    ];
    for (flags, want) in cases {
        let mut args = vec!["route", "add", "1", "1", "10.0.0.2:80", "--store", &store];
        args.extend_from_slice(flags);
        let out = run(&args);
        assert_eq!(out.status.code(), Some(2), "{flags:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{flags:?}: {err}");
    }
    let seventeen: Vec<String> = (0..17).map(|i| format!("k{i}=v")).collect();
    let mut args = vec!["route", "meta", "1", "1", "10.0.0.1:80", "--store", &store];
    for l in &seventeen {
        args.extend_from_slice(&["--label", l]);
    }
    let out = run(&args);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("at most 16"));
    // Nothing was stored: the node has neither.
    let shown = run_ok(&["route", "meta", "1", "1", "10.0.0.1:80", "--store", &store]);
    assert_eq!(
        String::from_utf8_lossy(&shown.stdout).trim(),
        "module [1, 1] node 10.0.0.1:80, no zone, no labels"
    );
    // A node the module does not have: refused, exit 65.
    let out = run(&[
        "route",
        "meta",
        "1",
        "1",
        "10.0.0.9:80",
        "--zone",
        "eu",
        "--store",
        &store,
    ]);
    assert_eq!(out.status.code(), Some(65));
}
