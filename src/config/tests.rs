use super::*;
use std::io::Write;

fn file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

#[test]
fn the_documented_file_is_exactly_the_defaults() {
    assert_eq!(Config::from_toml(DEFAULT_TOML).unwrap(), Config::default());
}

#[test]
fn defaults_are_the_original_lbagent_ini() {
    let lb = Config::default().lb;
    assert_eq!(
        (
            lb.init_succ_cnt,
            lb.ovld_err_cnt,
            lb.contin_succ_lim,
            lb.contin_err_lim,
            lb.probe_num
        ),
        (180, 5, 15, 15, 10)
    );
    assert_eq!(
        (
            lb.update_timeout,
            lb.clear_timeout,
            lb.report_timeout,
            lb.overload_wait_lim
        ),
        (15, 15, 15, 180)
    );
    assert_eq!(
        (
            lb.succ_rate,
            lb.err_rate,
            lb.wind_err_rate,
            lb.wind_err_limit
        ),
        (0.95, 0.1, 0.7, 2)
    );
    assert_eq!(lb.params(), lbagent_lb::LbParams::default());
    Config::default().validate().unwrap();
}

#[test]
fn an_empty_file_is_the_defaults() {
    let f = file("");
    assert_eq!(
        Config::load(Some(f.path()), &[]).unwrap(),
        Config::default()
    );
}

#[test]
fn a_missing_file_names_the_path() {
    let e = Config::load(Some(Path::new("/nonexistent/lbagent.toml")), &[]).unwrap_err();
    assert!(matches!(e, ConfigError::Read { .. }));
    assert!(e.to_string().contains("/nonexistent/lbagent.toml"), "{e}");
}

#[test]
fn an_unknown_key_names_the_key_and_line() {
    let f = file("[lb]\nprobe_num = 3\nprobe_numb = 4\n");
    let e = Config::load(Some(f.path()), &[]).unwrap_err().to_string();
    assert!(e.contains("probe_numb") && e.contains(":3:"), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");
}

#[test]
fn an_unknown_section_is_refused() {
    let e = Config::from_toml("[lbb]\nx = 1\n").unwrap_err().to_string();
    assert!(e.contains("lbb"), "{e}");
}

#[test]
fn a_wrong_type_is_refused() {
    let e = Config::from_toml("[lb]\nprobe_num = \"ten\"\n").unwrap_err();
    assert!(matches!(e, ConfigError::BadValue { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("lb.probe_num = \"ten\"") && msg.contains("an integer"),
        "{msg}"
    );
}

#[test]
fn an_out_of_range_value_names_the_field_and_the_range() {
    for (toml, field, allowed) in [
        ("[lb]\nprobe_num = 1\n", "lb.probe_num", "2..=1000000"),
        ("[lb]\nerr_rate = 1.5\n", "lb.err_rate", "0.0..=1.0"),
        ("[lb]\nclear_timeout = 0\n", "lb.clear_timeout", "1..=86400"),
        (
            "[lb]\ncontin_err_lim = 0\n",
            "lb.contin_err_lim",
            "1..=1000000",
        ),
        (
            "[agent]\nbase_port = 65535\nshards = 2\n",
            "agent.base_port",
            "65535",
        ),
        (
            "[agent]\nroute_servers = []\n",
            "agent.route_servers",
            "at least one",
        ),
        (
            "[agent]\nreporters = [\"1.2.3.4\"]\n",
            "agent.reporters",
            "HOST:PORT",
        ),
        (
            "[agent]\nreporters = [\"1.2.3.4:0\"]\n",
            "agent.reporters",
            "1..=65535",
        ),
        (
            "[agent]\nreporters = [\"1.2.3.456:80\"]\n",
            "agent.reporters",
            "IPv4",
        ),
        (
            "[agent]\nsnapshot_path = \"routes\"\n",
            "agent.snapshot_path",
            "absolute",
        ),
        (
            "[agent]\nmetrics_addr = \"0.0.0.0:9888\"\n",
            "agent.metrics_addr",
            "loopback",
        ),
        (
            "[agent]\nio_memory_kib = 1\n",
            "agent.io_memory_kib",
            "64..=1048576",
        ),
        (
            "[lb]\nlocality_min_percent = 101\n",
            "lb.locality_min_percent",
            "0..=100",
        ),
        (
            "[lb]\nlabel_fallback = \"none\"\n",
            "lb.label_fallback",
            "any or fail",
        ),
        ("[agent]\nzone = \"eu west\"\n", "agent.zone", "A-Z a-z 0-9"),
    ] {
        let e = Config::from_toml(toml).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, ConfigError::Invalid { .. }), "{toml}: {msg}");
        assert!(
            msg.starts_with(field) && msg.contains(allowed),
            "{toml}: {msg}"
        );
    }
}

#[test]
fn nan_rates_are_refused() {
    let mut c = Config::default();
    c.lb.succ_rate = f64::NAN;
    assert!(c.validate().is_err());
}

#[test]
fn overrides_replace_file_values_in_order() {
    let f = file("[lb]\nprobe_num = 3\n");
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let c = Config::load(
        Some(f.path()),
        &set(&["lb.probe_num=20", "agent.base_port=9000"]),
    )
    .unwrap();
    assert_eq!((c.lb.probe_num, c.agent.base_port), (20, 9000));
    let c = Config::load(
        None,
        &set(&[
            "agent.route_servers=[\"10.0.0.1:1\", \"10.0.0.2:1\"]",
            "agent.snapshot_path=/tmp/x",
            "tls.insecure=true",
        ]),
    )
    .unwrap();
    assert_eq!(c.agent.route_servers.len(), 2);
    assert_eq!(c.agent.snapshot_path, PathBuf::from("/tmp/x"));
}

#[test]
fn bad_overrides_are_refused_with_the_argument() {
    let set = |s: &str| vec![s.to_string()];
    for arg in ["probe_num", "probe_num=3", "lb.=3", "lb.a.b=3"] {
        let e = Config::load(None, &set(arg)).unwrap_err();
        assert!(matches!(e, ConfigError::Override { .. }), "{arg}: {e}");
        assert!(e.to_string().contains(arg), "{e}");
    }
    let e = Config::load(None, &set("lb.nope=3"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope"), "{e}");
    let e = Config::load(None, &set("lb.probe_num=0"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("lb.probe_num"), "{e}");
}

#[test]
fn load_onto_keeps_base_fields_the_file_does_not_set() {
    let mut base = Config::default();
    base.dnsserver.listen = "127.0.0.1:7777".parse().unwrap();
    base.reporter.writers = 5;
    let f = file("[dnsserver]\nthreads = 2\n[lb]\nprobe_num = 20\n");
    let c = Config::load_onto(&base, Some(f.path()), &["reporter.writers=7".into()]).unwrap();
    assert_eq!(c.dnsserver.listen, base.dnsserver.listen);
    assert_eq!(c.dnsserver.threads, 2);
    assert_eq!(c.lb.probe_num, 20);
    assert_eq!(c.reporter.writers, 7);
    assert_eq!(
        Config::load_onto(&base, None, &[]).unwrap(),
        base,
        "no file, no overrides: the base itself"
    );
    let bad = file("[dnsserver]\nthreads = \"x\"\n");
    let e = Config::load_onto(&base, Some(bad.path()), &[]).unwrap_err();
    assert!(e.to_string().contains(":2:"), "{e}");
}

#[test]
fn a_value_its_type_cannot_hold_names_the_field_and_its_range() {
    let set = |s: &str| vec![s.to_string()];
    let e = Config::load(None, &set("agent.base_port=99999")).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ConfigError::BadValue { .. }), "{msg}");
    assert!(msg.contains("agent.base_port = 99999"), "{msg}");
    assert!(msg.contains("0..=65535"), "{msg}");
    let e = Config::load(None, &set("lb.probe_num=-1"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("lb.probe_num") && e.contains("0..=4294967295"),
        "{e}"
    );
    let e = Config::load(None, &set("agent.max_unknown_modules=abc"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("agent.max_unknown_modules"), "{e}");
    // In a file: the line and column too.
    let f = file("[agent]\nshards = 2\nbase_port = 70000\n");
    let e = Config::load(Some(f.path()), &[]).unwrap_err().to_string();
    assert!(
        e.contains(":3:") && e.contains("agent.base_port = 70000"),
        "{e}"
    );
    assert!(e.contains("0..=65535"), "{e}");
    // from_toml too.
    let e = Config::from_toml("[agent]\nbase_port = 99999\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("agent.base_port") && e.contains("0..=65535"),
        "{e}"
    );
}

#[test]
fn the_module_bounds_are_checked() {
    let set = |s: &str| vec![s.to_string()];
    for (arg, field) in [
        ("agent.max_unknown_modules=0", "agent.max_unknown_modules"),
        (
            "agent.unknown_module_ttl_ms=1",
            "agent.unknown_module_ttl_ms",
        ),
        ("agent.module_idle_timeout=0", "agent.module_idle_timeout"),
        ("agent.max_modules=0", "agent.max_modules"),
        ("agent.udp_rcvbuf_bytes=100", "agent.udp_rcvbuf_bytes"),
        ("agent.udp_rcvbuf_bytes=67108865", "agent.udp_rcvbuf_bytes"),
    ] {
        let e = Config::load(None, &set(arg)).unwrap_err().to_string();
        assert!(e.starts_with(field) && e.contains("allowed"), "{arg}: {e}");
    }
}

#[test]
fn the_receive_buffer_is_the_system_default_or_a_bounded_size() {
    let set = |s: &str| vec![s.to_string()];
    assert_eq!(Config::default().agent.udp_rcvbuf_bytes, 0);
    for ok in ["0", "4096", "65536", "67108864"] {
        let c = Config::load(None, &set(&format!("agent.udp_rcvbuf_bytes={ok}"))).unwrap();
        assert_eq!(c.agent.udp_rcvbuf_bytes.to_string(), ok);
    }
    let e = Config::load(None, &set("agent.udp_rcvbuf_bytes=4095"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("agent.udp_rcvbuf_bytes") && e.contains("0 (the system default) or 4096..="),
        "{e}"
    );
}

#[test]
fn the_documented_file_names_every_field() {
    // Every field the configuration has is written out, with its comment,
    // in lbagent.toml: the book's configuration reference is generated from
    // that file, so a field missing there would be missing from the docs.
    let full: toml::Table = toml::from_str(&toml::to_string(&Config::default()).unwrap()).unwrap();
    let documented: toml::Table = toml::from_str(DEFAULT_TOML).unwrap();
    let mut missing = Vec::new();
    for (section, fields) in &full {
        let Some(fields) = fields.as_table() else {
            continue;
        };
        for key in fields.keys() {
            let there = documented
                .get(section)
                .and_then(|s| s.as_table())
                .is_some_and(|s| s.contains_key(key));
            if !there {
                missing.push(format!("{section}.{key}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "src/config/lbagent.toml lacks {missing:?}: add each with its comment (meaning, range) and default"
    );
}

#[test]
fn a_fifo_device_or_directory_config_is_refused_at_once_without_reading() {
    // Issue 27: a FIFO at the config path used to block the reload (and
    // SIGTERM with it) until a writer appeared.
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("lbagent.toml");
    nix_mkfifo(&fifo);
    for (path, kind) in [
        (fifo.as_path(), "FIFO"),
        (std::path::Path::new("/dev/null"), "device"),
        (dir.path(), "directory"),
    ] {
        let t0 = std::time::Instant::now();
        let e = Config::load(Some(path), &[]).unwrap_err().to_string();
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
        assert!(
            e.contains(kind) && e.contains(&*path.to_string_lossy()),
            "{e}"
        );
    }
    let big = dir.path().join("big.toml");
    std::fs::write(&big, vec![b'#'; (crate::MAX_FILE_LEN + 1) as usize]).unwrap();
    let e = Config::load(Some(&big), &[]).unwrap_err().to_string();
    assert!(e.contains("bytes"), "{e}");
}

fn nix_mkfifo(path: &std::path::Path) {
    let ok = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(ok.success(), "mkfifo {}", path.display());
}

#[test]
fn a_zone_and_the_steering_rules_are_read() {
    let c = Config::from_toml(
        "[agent]\nzone = \"eu-1a\"\n[lb]\nlocality_min_percent = 40\nlabel_fallback = \"fail\"\n",
    )
    .unwrap();
    assert_eq!(c.agent.zone, "eu-1a");
    assert_eq!(c.lb.locality_min_percent, 40);
    assert_eq!(c.lb.label_fallback(), lbagent_lb::labels::Fallback::Fail);
    let d = Config::default();
    assert_eq!((d.agent.zone.as_str(), d.lb.locality_min_percent), ("", 0));
    assert_eq!(d.lb.label_fallback(), lbagent_lb::labels::Fallback::Any);
    let long = format!("[agent]\nzone = \"{}\"\n", "z".repeat(64));
    assert!(Config::from_toml(&long)
        .unwrap_err()
        .to_string()
        .contains("at most 63"));
}
