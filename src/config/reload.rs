//! What a configuration reload (SIGHUP, `systemctl reload`) may change in a
//! running process: pure functions over two [`Config`]s, no I/O.
//!
//! Each field is, for a role (agent, route server, reporter): live (applied
//! without a restart), fixed (a change refuses the whole reload: the process
//! keeps its old configuration), or not the role's (ignored: the three
//! services share one file, and a change to the agent's fields must not
//! make the route server refuse its reload).

use super::Config;

/// The process that reloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// `lbagent agent`.
    Agent,
    /// `lbagent dnsserver`.
    Dnsserver,
    /// `lbagent reporter`.
    Reporter,
}

/// How a field behaves on reload, for a role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reloadable {
    /// Applied to the running process.
    Live,
    /// Needs a restart: a change refuses the reload.
    Restart,
    /// The role does not use it.
    Ignored,
}

/// The fields the agent applies live, besides every `[lb]` field.
const AGENT_LIVE: &[&str] = &[
    "agent.route_servers",
    "agent.reporters",
    "agent.snapshot_interval",
    "log.level",
];

/// How `field` (`section.name`) behaves on reload for `role`.
pub fn reloadable(role: Role, field: &str) -> Reloadable {
    let section = field.split_once('.').map_or(field, |(s, _)| s);
    match (role, section) {
        (_, "log") if field == "log.level" => Reloadable::Live,
        (_, "log") => Reloadable::Restart,
        (Role::Agent, "lb") => Reloadable::Live,
        (Role::Agent, "agent") if AGENT_LIVE.contains(&field) => Reloadable::Live,
        (Role::Agent, "agent") => Reloadable::Restart,
        (Role::Agent, "admission") if field == "admission.level_timeout_ms" => Reloadable::Restart,
        (Role::Agent, "shm") => Reloadable::Restart,
        (Role::Dnsserver, "dnsserver" | "store") => Reloadable::Restart,
        (Role::Reporter, "reporter" | "store") => Reloadable::Restart,
        // The files named are re-read when they change; naming others
        // (or turning TLS on or off) needs a restart.
        (_, "tls") => Reloadable::Restart,
        _ => Reloadable::Ignored,
    }
}

/// Every `section.field` whose value differs between `old` and `new`,
/// sorted.
pub fn changed_fields(old: &Config, new: &Config) -> Vec<String> {
    let (Ok(a), Ok(b)) = (toml::Table::try_from(old), toml::Table::try_from(new)) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (section, fields) in &b {
        let (Some(toml::Value::Table(before)), toml::Value::Table(after)) =
            (a.get(section), fields)
        else {
            if a.get(section) != Some(fields) {
                out.push(section.clone());
            }
            continue;
        };
        let mut names: Vec<&String> = after.keys().chain(before.keys()).collect();
        names.sort();
        names.dedup();
        for name in names {
            if before.get(name) != after.get(name) {
                out.push(format!("{section}.{name}"));
            }
        }
    }
    out
}

/// A reload's verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Apply these fields (live for the role; none: nothing to do).
    Apply(Vec<String>),
    /// Refused: these fields changed and need a restart.
    Refuse(Vec<String>),
}

/// What reloading from `old` to `new` does for `role`: the live fields to
/// apply, or the fixed fields that refuse it. Fields the role does not use
/// are left out of both.
pub fn plan(role: Role, old: &Config, new: &Config) -> Plan {
    let mut live = Vec::new();
    let mut fixed = Vec::new();
    for field in changed_fields(old, new) {
        match reloadable(role, &field) {
            Reloadable::Live => live.push(field),
            Reloadable::Restart => fixed.push(field),
            Reloadable::Ignored => {}
        }
    }
    if fixed.is_empty() {
        Plan::Apply(live)
    } else {
        Plan::Refuse(fixed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LogLevel;

    #[test]
    fn no_change_is_an_empty_apply() {
        let c = Config::default();
        assert!(changed_fields(&c, &c).is_empty());
        for role in [Role::Agent, Role::Dnsserver, Role::Reporter] {
            assert_eq!(plan(role, &c, &c), Plan::Apply(vec![]));
        }
    }

    #[test]
    fn the_agent_applies_lb_lists_intervals_and_the_level_live() {
        let old = Config::default();
        let mut new = old.clone();
        new.lb.err_rate = 0.5;
        new.lb.update_timeout = 5;
        new.agent.route_servers = vec!["10.0.0.1:7777".into(), "10.0.0.2:7777".into()];
        new.agent.reporters = vec!["10.0.0.3:7778".into()];
        new.agent.snapshot_interval = 10;
        new.log.level = LogLevel::Debug;
        assert_eq!(
            plan(Role::Agent, &old, &new),
            Plan::Apply(vec![
                "agent.reporters".into(),
                "agent.route_servers".into(),
                "agent.snapshot_interval".into(),
                "lb.err_rate".into(),
                "lb.update_timeout".into(),
                "log.level".into(),
            ])
        );
    }

    #[test]
    fn ports_shards_and_paths_refuse_the_agents_reload() {
        let old = Config::default();
        for (field, edit) in [
            (
                "agent.base_port",
                (|c: &mut Config| c.agent.base_port = 9000) as fn(&mut Config),
            ),
            ("agent.shards", |c| c.agent.shards = 3),
            ("agent.snapshot_path", |c| {
                c.agent.snapshot_path = "/x/y".into()
            }),
            ("agent.metrics_addr", |c| {
                c.agent.metrics_addr = "127.0.0.1:1".parse().unwrap()
            }),
            ("log.format", |c| c.log.format = crate::LogFormat::Json),
            ("admission.level_timeout_ms", |c| {
                c.admission.level_timeout_ms = 500
            }),
        ] {
            let mut new = old.clone();
            edit(&mut new);
            // A live change beside it does not get through either.
            new.lb.err_rate = 0.3;
            assert_eq!(
                plan(Role::Agent, &old, &new),
                Plan::Refuse(vec![field.to_string()]),
                "{field}"
            );
        }
    }

    #[test]
    fn a_servers_reload_ignores_the_agents_fields_and_refuses_its_own() {
        let old = Config::default();
        let mut new = old.clone();
        new.lb.err_rate = 0.3;
        new.agent.base_port = 9000;
        new.admission.alpha = 0.2;
        new.log.level = LogLevel::Warn;
        for role in [Role::Dnsserver, Role::Reporter] {
            assert_eq!(
                plan(role, &old, &new),
                Plan::Apply(vec!["log.level".into()])
            );
        }
        new.dnsserver.poll_interval_ms = 50;
        new.store.url = "sqlite:/tmp/other.db".into();
        assert_eq!(
            plan(Role::Dnsserver, &old, &new),
            Plan::Refuse(vec![
                "dnsserver.poll_interval_ms".into(),
                "store.url".into()
            ])
        );
        assert_eq!(
            plan(Role::Reporter, &old, &new),
            Plan::Refuse(vec!["store.url".into()])
        );
    }
}
