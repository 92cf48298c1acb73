//! The `lbagent` binary's command line: `agent --check` verdicts, exit
//! codes, and the server subcommands' configuration checks.

use std::io::Write;
use std::process::{Command, Output};

fn lbagent(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lbagent"))
        .args(args)
        .output()
        .expect("run lbagent")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn config_file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

#[test]
fn check_accepts_the_printed_default_config() {
    let printed = lbagent(&["agent", "--print-config"]);
    assert!(printed.status.success());
    let f = config_file(&String::from_utf8(printed.stdout).unwrap());
    let o = lbagent(&["agent", "--check", "--config", f.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("config ok"));
}

#[test]
fn check_without_a_file_validates_the_defaults_and_flags() {
    let o = lbagent(&[
        "agent",
        "--check",
        "--base-port",
        "9000",
        "--shards",
        "4",
        "--set",
        "lb.probe_num=20",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("base_port 9000, shards 4"));
}

/// Each bad configuration: exit 78 and one line on stderr naming the fault.
#[test]
fn check_refuses_bad_configs_with_one_line_naming_the_fault() {
    let unknown = config_file("[lb]\nprobe_nun = 3\n");
    let range = config_file("[lb]\nerr_rate = 2.0\n");
    let syntax = config_file("[lb\n");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--config", "/nonexistent/lbagent.toml"],
            "/nonexistent/lbagent.toml",
        ),
        (
            vec!["--config", unknown.path().to_str().unwrap()],
            "probe_nun",
        ),
        (
            vec!["--config", range.path().to_str().unwrap()],
            "lb.err_rate = 2 is out of range: allowed 0.0..=1.0",
        ),
        (vec!["--config", syntax.path().to_str().unwrap()], ":1:"),
        (
            vec!["--set", "lb.probe_num=1"],
            "lb.probe_num = 1 is out of range",
        ),
        (vec!["--set", "probe_num=1"], "bad --set"),
        (vec!["--shards", "5000"], "agent.shards"),
    ];
    for (extra, needle) in cases {
        let mut args = vec!["agent", "--check"];
        args.extend(&extra);
        let o = lbagent(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(78), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    }
}

#[test]
fn a_bad_argument_is_a_usage_error() {
    let o = lbagent(&["report", "1", "2", "10.0.0.1:0", "0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("port 0"), "{}", stderr(&o));
    let o = lbagent(&["agent", "--base-port", "70000", "--check"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn server_subcommands_check_their_configuration_and_store_url() {
    let o = lbagent(&["dnsserver", "--check", "--store", "sqlite:/tmp/x.db"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("sqlite:/tmp/x.db"));
    let o = lbagent(&["reporter", "--check", "--set", "reporter.writers=4"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    for args in [
        vec!["dnsserver", "--check", "--store", "mysql://x"],
        vec!["reporter", "--check", "--store", "sqlite:"],
        vec![
            "dnsserver",
            "--check",
            "--set",
            "dnsserver.poll_interval_ms=0",
        ],
        vec!["reporter", "--check", "--set", "reporter.writers=0"],
        vec!["standalone", "--set", "dnsserver.idle_timeout=0"],
    ] {
        let o = lbagent(&args);
        assert_eq!(o.status.code(), Some(78), "{args:?}: {}", stderr(&o));
        assert_eq!(stderr(&o).trim().lines().count(), 1, "{args:?}: one line");
        assert!(o.stdout.is_empty(), "{args:?} printed output");
    }
    let o = lbagent(&["route", "list", "--store", "mysql://x"]);
    assert_eq!(o.status.code(), Some(78), "{}", stderr(&o));
    assert!(stderr(&o).contains("store.url"), "{}", stderr(&o));
}
