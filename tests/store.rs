//! One suite against both store backends.
//!
//! Every case in `suite!` runs twice: `sqlite::CASE` on a file in a fresh
//! temporary directory, and `postgres::CASE` when `LBAGENT_TEST_POSTGRES_URL`
//! names a database (`tools/ci-postgres.sh` prints one); without it the
//! PostgreSQL cases print a note and pass. Each PostgreSQL case runs in its
//! own schema (the URL's `options=-csearch_path=...`), created before and
//! dropped after, so the cases run in parallel against one database.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use lbagent::model::{ModuleId, NodeAddr, NodeMeta, RouteNode};
use lbagent::store::{
    self, CallStatus, Imported, Store, StoreError, StoreUrl, Wake, DEFAULT_WEIGHT, MAX_WEIGHT,
    SCHEMA_VERSION,
};

const PG_ENV: &str = "LBAGENT_TEST_POSTGRES_URL";

// === the two backends ===

/// A fresh, empty store for one test case.
struct Db {
    url: StoreUrl,
    kind: Kind,
}

enum Kind {
    Sqlite(#[allow(dead_code)] tempfile::TempDir),
    Postgres { admin_url: String, schema: String },
}

impl Db {
    fn sqlite() -> Db {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = StoreUrl::Sqlite(dir.path().join("data").join("lbagent.db"));
        Db {
            url,
            kind: Kind::Sqlite(dir),
        }
    }

    /// A fresh schema in the test database, or `None` (with a note) when
    /// no database is configured.
    fn postgres(case: &str) -> Option<Db> {
        let Ok(base) = std::env::var(PG_ENV) else {
            println!("note: {PG_ENV} is not set: skipping the PostgreSQL case {case}");
            return None;
        };
        let schema = format!("lbagent_test_{case}_{}", std::process::id());
        // The store's default connect_timeout is 5 s (seen exceeded at load
        // average 18); these tests are not about connection latency.
        let sep = if base.contains('?') { '&' } else { '?' };
        let base = format!("{base}{sep}connect_timeout=30");
        let mut admin = ::postgres::Client::connect(&base, ::postgres::NoTls)
            .unwrap_or_else(|e| panic!("{PG_ENV}={}: {e}", store::redact(&base)));
        admin
            .batch_execute(&format!(
                "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema};"
            ))
            .expect("create the test schema");
        let sep = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{sep}options=-csearch_path%3D{schema}&application_name={schema}");
        Some(Db {
            url: StoreUrl::Postgres(url.clone()),
            kind: Kind::Postgres {
                admin_url: url,
                schema,
            },
        })
    }

    fn open(&self) -> Box<dyn Store> {
        store::open(&self.url).unwrap_or_else(|e| panic!("open {}: {e}", self.url))
    }

    /// Runs SQL by hand, around the tables' checks, as an operator with a
    /// database shell would.
    fn hand(&self, sql: &str) {
        match &self.kind {
            Kind::Sqlite(_) => {
                let StoreUrl::Sqlite(path) = &self.url else {
                    unreachable!()
                };
                let conn = rusqlite::Connection::open(path).expect("open by hand");
                conn.execute_batch(&format!("PRAGMA ignore_check_constraints = ON; {sql}"))
                    .unwrap_or_else(|e| panic!("{sql}: {e}"));
            }
            Kind::Postgres { admin_url, .. } => {
                let mut c = ::postgres::Client::connect(admin_url, ::postgres::NoTls)
                    .expect("connect by hand");
                c.batch_execute(
                    "DO $$ DECLARE r record; BEGIN
                       FOR r IN SELECT conrelid::regclass AS t, conname FROM pg_constraint
                                 WHERE contype = 'c' AND connamespace = current_schema()::regnamespace LOOP
                         EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', r.t, r.conname);
                       END LOOP; END $$;",
                )
                .expect("drop the checks");
                c.batch_execute(sql)
                    .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
            }
        }
    }

    /// One integer from SQL run by hand.
    fn count(&self, sql: &str) -> i64 {
        match &self.kind {
            Kind::Sqlite(_) => {
                let StoreUrl::Sqlite(path) = &self.url else {
                    unreachable!()
                };
                let conn = rusqlite::Connection::open(path).expect("open by hand");
                conn.query_row(sql, [], |r| r.get(0))
                    .unwrap_or_else(|e| panic!("{sql}: {e}"))
            }
            Kind::Postgres { admin_url, .. } => {
                let mut c = ::postgres::Client::connect(admin_url, ::postgres::NoTls)
                    .expect("connect by hand");
                let row = c
                    .query_one(sql, &[])
                    .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
                row.try_get::<_, i64>(0)
                    .unwrap_or_else(|_| i64::from(row.get::<_, i32>(0)))
            }
        }
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        if let Kind::Postgres { admin_url, schema } = &self.kind {
            if let Ok(mut c) = ::postgres::Client::connect(admin_url, ::postgres::NoTls) {
                let _ = c.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
            }
        }
    }
}

/// Each case as `sqlite::CASE` and `postgres::CASE`.
macro_rules! suite {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            $(#[test] fn $case() { super::$case(&super::Db::sqlite()); })*
        }
        mod postgres {
            $(#[test] fn $case() {
                if let Some(db) = super::Db::postgres(stringify!($case)) { super::$case(&db); }
            })*
        }
    };
}

suite!(
    migrations_are_idempotent,
    concurrent_opens_migrate_once,
    add_del_and_list,
    every_change_bumps_the_version_and_logs_its_module,
    duplicate_not_found_and_bad_input_change_nothing,
    module_versions_follow_their_latest_change,
    concurrent_admins_never_share_a_version,
    upsert_status_replaces_by_key,
    upsert_status_writes_thousands_in_one_call,
    a_resent_older_report_never_replaces_a_newer_row,
    bad_rows_are_skipped_not_fatal,
    a_newer_schema_is_refused,
    import_is_one_version_and_logs_every_module,
    import_replace_replaces_named_modules_only,
    import_refusals_change_nothing,
    import_of_a_large_table,
    changes_since_reads_exactly_the_changed_modules,
    route_version_sees_another_connections_commit,
    wait_for_change_wakes_on_another_connections_commit,
    policy_is_a_versioned_change_carried_with_the_route,
    consumed_units_lower_the_capacity_never_below_zero,
    options_are_a_versioned_change_beside_the_policy,
    zones_and_labels_are_stored_set_imported_and_checked_on_the_way_out,
);

fn changes_since_reads_exactly_the_changed_modules(db: &Db) {
    let mut s = db.open();
    let rows: Vec<(ModuleId, RouteNode)> = (0..2_000u32)
        .flat_map(|k| {
            (1..=3u8).map(move |i| {
                let [_, _, a, b] = k.to_be_bytes();
                (m(k, 1), node(&format!("10.{a}.{b}.{i}:80"), 1))
            })
        })
        .collect();
    assert_eq!(s.import_routes(&rows, false).unwrap().version, 1);
    // Three changes: a node added, a node deleted, a module emptied.
    s.add_node(m(5, 1), node("192.168.0.1:80", 2)).unwrap();
    s.del_node(m(700, 1), addr("10.2.188.1:80")).unwrap();
    for i in 1..=3 {
        s.del_node(m(1999, 1), addr(&format!("10.7.207.{i}:80")))
            .unwrap();
    }
    let c = s.changes_since(1).unwrap();
    assert_eq!(c.version, 6);
    let got: Vec<(ModuleId, u64, usize)> = c
        .modules
        .iter()
        .map(|r| (r.module, r.version, r.nodes.len()))
        .collect();
    assert_eq!(
        got,
        vec![(m(5, 1), 2, 4), (m(700, 1), 3, 2), (m(1999, 1), 6, 0)]
    );
    assert_eq!(
        c.modules[0].nodes,
        nodes_of(s.as_mut(), m(5, 1)),
        "the module's current nodes"
    );
    // Only what came after the version asked about.
    let got: Vec<ModuleId> = s
        .changes_since(3)
        .unwrap()
        .modules
        .iter()
        .map(|r| r.module)
        .collect();
    assert_eq!(got, vec![m(1999, 1)]);
    assert!(s.changes_since(6).unwrap().modules.is_empty());
}

/// The route server's cheap check (SQLite: a prepared statement, which
/// must not answer from a stale snapshot) sees a commit made by another
/// connection, as a change made by another process would be.
fn route_version_sees_another_connections_commit(db: &Db) {
    let mut server = db.open();
    let mut admin = db.open();
    assert_eq!(server.route_version().unwrap(), 0);
    for v in 1..=3u64 {
        admin
            .add_node(m(1, 1), node(&format!("10.0.0.{v}:80"), 1))
            .unwrap();
        assert_eq!(server.route_version().unwrap(), v);
        assert_eq!(server.route_version().unwrap(), v, "asked twice");
    }
}

fn wait_for_change_wakes_on_another_connections_commit(db: &Db) {
    let mut server = db.open();
    let mut admin = db.open();
    match server.wait_for_change(Duration::from_millis(10)).unwrap() {
        Wake::Unsupported => {
            assert_eq!(server.backend(), "sqlite", "only SQLite cannot announce");
            return;
        }
        // The first call listens, and cannot know what it missed.
        Wake::Changed => {}
        Wake::Quiet => panic!("the first wait must say a change may have been missed"),
    }
    assert_eq!(
        server.wait_for_change(Duration::from_millis(50)).unwrap(),
        Wake::Quiet
    );
    let waiter = std::thread::spawn(move || {
        let t0 = Instant::now();
        let woke = server.wait_for_change(Duration::from_secs(60)).unwrap();
        (woke, t0.elapsed(), server)
    });
    std::thread::sleep(Duration::from_millis(100));
    admin.add_node(m(1, 1), node("10.0.0.1:80", 1)).unwrap();
    let (woke, waited, mut server) = waiter.join().unwrap();
    assert_eq!(woke, Wake::Changed);
    assert!(waited < Duration::from_secs(30), "woke after {waited:?}");
    // A failed transaction announces nothing.
    assert!(admin.add_node(m(1, 1), node("10.0.0.1:80", 1)).is_err());
    assert_eq!(
        server.wait_for_change(Duration::from_millis(200)).unwrap(),
        Wake::Quiet
    );
    // An import announces itself too.
    admin
        .import_routes(&[(m(2, 2), node("10.0.0.2:80", 1))], false)
        .unwrap();
    assert_eq!(
        server.wait_for_change(Duration::from_secs(60)).unwrap(),
        Wake::Changed
    );
}

// === bulk import ===

fn import_is_one_version_and_logs_every_module(db: &Db) {
    let mut s = db.open();
    s.add_node(m(9, 9), node("10.0.0.9:80", 1)).unwrap();
    let rows = vec![
        (m(1, 1), node("10.0.0.1:80", 2)),
        (m(1, 1), node("10.0.0.2:80", 3)),
        (m(2, 5), node("10.0.0.3:81", 1)),
        (m(9, 9), node("10.0.0.10:80", 1)),
    ];
    let got = s.import_routes(&rows, false).unwrap();
    assert_eq!(
        got,
        Imported {
            version: 2,
            modules: 3,
            nodes: 4
        }
    );
    assert_eq!(s.route_version().unwrap(), 2);
    // Added to what the module had.
    assert_eq!(
        nodes_of(s.as_mut(), m(9, 9)),
        vec![node("10.0.0.9:80", 1), node("10.0.0.10:80", 1)]
    );
    let changes = s.changes_since(1).unwrap();
    assert_eq!(changes.version, 2);
    let changed: Vec<(ModuleId, u64)> = changes
        .modules
        .iter()
        .map(|r| (r.module, r.version))
        .collect();
    assert_eq!(changed, vec![(m(1, 1), 2), (m(2, 5), 2), (m(9, 9), 2)]);
    assert_eq!(
        db.count("SELECT COUNT(*) FROM route_change WHERE version = 2"),
        3
    );
    // Older log rows of a touched module are dropped, as route add does.
    assert_eq!(db.count("SELECT COUNT(*) FROM route_change"), 3);
    // An empty table changes nothing.
    let got = s.import_routes(&[], true).unwrap();
    assert_eq!(
        got,
        Imported {
            version: 2,
            modules: 0,
            nodes: 0
        }
    );
}

fn import_replace_replaces_named_modules_only(db: &Db) {
    let mut s = db.open();
    s.add_node(m(1, 1), node("10.0.0.1:80", 1)).unwrap();
    s.add_node(m(1, 1), node("10.0.0.2:80", 1)).unwrap();
    s.add_node(m(3, 3), node("10.0.0.3:80", 1)).unwrap();
    let rows = vec![
        (m(1, 1), node("10.0.0.2:80", 7)),
        (m(1, 1), node("10.0.0.4:80", 1)),
        (m(4, 4), node("10.0.0.5:80", 1)),
    ];
    let got = s.import_routes(&rows, true).unwrap();
    assert_eq!(got.version, 4);
    assert_eq!(
        nodes_of(s.as_mut(), m(1, 1)),
        vec![node("10.0.0.2:80", 7), node("10.0.0.4:80", 1)]
    );
    assert_eq!(nodes_of(s.as_mut(), m(3, 3)), vec![node("10.0.0.3:80", 1)]);
    assert_eq!(nodes_of(s.as_mut(), m(4, 4)), vec![node("10.0.0.5:80", 1)]);
    let changed: Vec<ModuleId> = s
        .changes_since(3)
        .unwrap()
        .modules
        .iter()
        .map(|r| r.module)
        .collect();
    assert_eq!(changed, vec![m(1, 1), m(4, 4)]);
    // The same table again: the same routes, one more version.
    assert_eq!(s.import_routes(&rows, true).unwrap().version, 5);
    assert_eq!(
        nodes_of(s.as_mut(), m(1, 1)),
        vec![node("10.0.0.2:80", 7), node("10.0.0.4:80", 1)]
    );
}

fn import_refusals_change_nothing(db: &Db) {
    let mut s = db.open();
    s.add_node(m(1, 1), node("10.0.0.1:80", 1)).unwrap();
    let before = s.load_all().unwrap();
    // A node the module has: the whole table is refused.
    let rows = vec![
        (m(2, 2), node("10.0.0.2:80", 1)),
        (m(1, 1), node("10.0.0.1:80", 5)),
    ];
    match s.import_routes(&rows, false) {
        Err(StoreError::Duplicate { module, node: n }) => {
            assert_eq!((module, n), (m(1, 1), addr("10.0.0.1:80")))
        }
        other => panic!("{other:?}"),
    }
    // Rows the checks refuse.
    for bad in [
        vec![(m(2, 2), node("10.0.0.2:80", 1_000_001))],
        vec![(m(2, 2), node("255.255.255.255:80", 1))],
        vec![
            (m(2, 2), node("10.0.0.2:80", 1)),
            (m(2, 2), node("10.0.0.2:80", 2)),
        ],
    ] {
        for replace in [false, true] {
            match s.import_routes(&bad, replace) {
                Err(StoreError::BadInput(_)) => {}
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }
    assert_eq!(s.load_all().unwrap(), before);
    assert_eq!(db.count("SELECT COUNT(*) FROM route_change"), 1);
    // Weight 0 is no refusal: a node with no capacity left, as export
    // writes a fully consumed one; it is served (and exported) as 0.
    s.import_routes(&[(m(3, 3), node("10.0.0.3:80", 0))], true)
        .unwrap();
    let got = s.list(Some(m(3, 3))).unwrap();
    assert_eq!(got[0].nodes, vec![node("10.0.0.3:80", 0)]);
}

fn import_of_a_large_table(db: &Db) {
    let mut s = db.open();
    const MODULES: u32 = 10_000;
    let rows: Vec<(ModuleId, RouteNode)> = (0..MODULES)
        .flat_map(|k| {
            (1..=10u8).map(move |i| {
                let [_, _, a, b] = k.to_be_bytes();
                (m(k, 1), node(&format!("10.{a}.{b}.{i}:8080"), 1))
            })
        })
        .collect();
    let got = s.import_routes(&rows, false).unwrap();
    assert_eq!(
        got,
        Imported {
            version: 1,
            modules: MODULES as usize,
            nodes: rows.len()
        }
    );
    let all = s.load_all().unwrap();
    assert_eq!(all.modules.len(), MODULES as usize);
    assert!(all
        .modules
        .iter()
        .all(|r| r.nodes.len() == 10 && r.version == 1));
    // Replacing it whole is one more version.
    assert_eq!(s.import_routes(&rows, true).unwrap().version, 2);
    assert_eq!(
        db.count("SELECT COUNT(*) FROM route_data"),
        rows.len() as i64
    );
}

// === helpers ===

fn m(modid: u32, cmdid: u32) -> ModuleId {
    ModuleId::new(modid, cmdid)
}

fn addr(s: &str) -> NodeAddr {
    s.parse().unwrap()
}

fn node(s: &str, weight: u32) -> RouteNode {
    RouteNode {
        addr: addr(s),
        weight,
    }
}

fn status(module: ModuleId, node: &str, caller: u32, succ: u32) -> CallStatus {
    CallStatus {
        module,
        node: addr(node),
        caller,
        succ,
        err: succ / 10,
        ts: 1_700_000_000,
        overload: false,
        agent_start: 0,
        seq: 0,
    }
}

fn nodes_of(s: &mut dyn Store, module: ModuleId) -> Vec<RouteNode> {
    s.list(Some(module))
        .unwrap()
        .into_iter()
        .flat_map(|r| r.nodes)
        .collect()
}

// === the cases ===

fn migrations_are_idempotent(db: &Db) {
    let mut s = db.open();
    assert_eq!(s.route_version().unwrap(), 0);
    assert_eq!(s.load_all().unwrap(), store::RouteSet::default());
    s.add_node(m(1, 1), node("10.0.0.1:80", 5)).unwrap();
    drop(s);
    let mut s = db.open();
    let mut again = db.open();
    assert_eq!(s.route_version().unwrap(), 1);
    assert_eq!(again.list(None).unwrap(), s.list(None).unwrap());
    assert_eq!(
        db.count("SELECT COUNT(*) FROM schema_version"),
        i64::from(SCHEMA_VERSION)
    );
    assert_eq!(
        db.count("SELECT MAX(version) FROM schema_version"),
        i64::from(SCHEMA_VERSION)
    );
}

fn concurrent_opens_migrate_once(db: &Db) {
    let n = 8;
    let barrier = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|_| {
            let (url, barrier) = (db.url.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let mut s = store::open(&url).map_err(|e| e.to_string())?;
                s.route_version().map_err(|e| e.to_string())
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), Ok(0));
    }
    assert_eq!(
        db.count("SELECT COUNT(*) FROM schema_version"),
        i64::from(SCHEMA_VERSION)
    );
}

fn add_del_and_list(db: &Db) {
    let mut s = db.open();
    assert!(matches!(s.backend(), "sqlite" | "postgres"));
    s.add_node(m(2, 1), node("10.0.0.2:80", 3)).unwrap();
    s.add_node(m(2, 1), node("10.0.0.1:81", 0)).unwrap(); // weight 0: unset
    s.add_node(m(2, 1), node("10.0.0.1:80", MAX_WEIGHT))
        .unwrap();
    s.add_node(m(1, 7), node("223.255.255.255:65535", 1))
        .unwrap();
    // What cannot be a node is refused: broadcast, unspecified, multicast.
    for bad in ["255.255.255.255:80", "0.0.0.0:80", "239.1.1.1:80"] {
        let e = s.add_node(m(1, 7), node(bad, 1)).unwrap_err();
        assert!(matches!(e, StoreError::BadInput(_)), "{bad}: {e}");
    }

    let all = s.list(None).unwrap();
    assert_eq!(
        all.iter().map(|r| r.module).collect::<Vec<_>>(),
        vec![m(1, 7), m(2, 1)]
    );
    assert_eq!(
        all[1].nodes,
        vec![
            node("10.0.0.1:80", MAX_WEIGHT),
            node("10.0.0.1:81", DEFAULT_WEIGHT),
            node("10.0.0.2:80", 3)
        ],
        "nodes sorted by address, weight 0 stored as the default"
    );
    assert_eq!(
        all[0].nodes,
        vec![node("223.255.255.255:65535", 1)],
        "the top of every range round-trips"
    );
    assert_eq!(s.list(Some(m(1, 7))).unwrap(), vec![all[0].clone()]);
    assert_eq!(s.list(Some(m(9, 9))).unwrap(), vec![]);
    assert_eq!(s.load_all().unwrap().modules, all);

    s.del_node(m(2, 1), addr("10.0.0.1:81")).unwrap();
    assert_eq!(
        nodes_of(&mut *s, m(2, 1)),
        vec![node("10.0.0.1:80", MAX_WEIGHT), node("10.0.0.2:80", 3)]
    );
    s.del_node(m(1, 7), addr("223.255.255.255:65535")).unwrap();
    let all = s.load_all().unwrap();
    assert_eq!(
        all.modules.len(),
        1,
        "a module with no node left is not listed"
    );
    assert_eq!(all.version, 6);
}

fn every_change_bumps_the_version_and_logs_its_module(db: &Db) {
    let mut s = db.open();
    assert_eq!(s.add_node(m(1, 1), node("10.0.0.1:80", 1)).unwrap(), 1);
    assert_eq!(s.add_node(m(2, 2), node("10.0.0.2:80", 1)).unwrap(), 2);
    assert_eq!(s.add_node(m(1, 1), node("10.0.0.3:80", 1)).unwrap(), 3);
    assert_eq!(s.route_version().unwrap(), 3);

    let c = s.changes_since(0).unwrap();
    assert_eq!(c.version, 3);
    assert_eq!(
        c.modules
            .iter()
            .map(|r| (r.module, r.version, r.nodes.len()))
            .collect::<Vec<_>>(),
        vec![(m(1, 1), 3, 2), (m(2, 2), 2, 1)]
    );
    let c = s.changes_since(2).unwrap();
    assert_eq!(
        c.modules.iter().map(|r| r.module).collect::<Vec<_>>(),
        vec![m(1, 1)]
    );
    let c = s.changes_since(3).unwrap();
    assert_eq!((c.version, c.modules.len()), (3, 0));

    // The last node of a module goes: it appears with no nodes.
    assert_eq!(s.del_node(m(2, 2), addr("10.0.0.2:80")).unwrap(), 4);
    let c = s.changes_since(3).unwrap();
    assert_eq!(c.version, 4);
    assert_eq!(
        c.modules,
        vec![store::ModuleRoute {
            module: m(2, 2),
            version: 4,
            nodes: vec![],
            policy: lbagent::model::Policy::L5,
            options: Default::default(),
            meta: vec![],
        }]
    );
    assert!(s
        .load_all()
        .unwrap()
        .modules
        .iter()
        .all(|r| r.module != m(2, 2)));

    // A reader from another connection sees the same.
    let mut other = db.open();
    assert_eq!(other.changes_since(3).unwrap(), c);
    // The log keeps each module's latest change only.
    assert_eq!(db.count("SELECT COUNT(*) FROM route_change"), 2);
}

fn duplicate_not_found_and_bad_input_change_nothing(db: &Db) {
    let mut s = db.open();
    s.add_node(m(1, 1), node("10.0.0.1:80", 2)).unwrap();
    let before = s.load_all().unwrap();
    let log = db.count("SELECT COUNT(*) FROM route_change");

    let e = s.add_node(m(1, 1), node("10.0.0.1:80", 9)).unwrap_err();
    assert!(
        matches!(e, StoreError::Duplicate { module, node } if module == m(1, 1) && node == addr("10.0.0.1:80")),
        "{e}"
    );
    let e = s.del_node(m(1, 1), addr("10.0.0.1:81")).unwrap_err();
    assert!(matches!(e, StoreError::NotFound { .. }), "{e}");
    let e = s.del_node(m(5, 5), addr("10.0.0.1:80")).unwrap_err();
    assert!(matches!(e, StoreError::NotFound { .. }), "{e}");
    let e = s
        .add_node(m(1, 1), node("10.0.0.9:80", MAX_WEIGHT + 1))
        .unwrap_err();
    assert!(
        matches!(e, StoreError::BadInput(_)) && e.to_string().contains("weight"),
        "{e}"
    );
    let e = s
        .add_node(
            m(1, 1),
            RouteNode {
                addr: NodeAddr::new(Ipv4Addr::LOCALHOST, 0),
                weight: 1,
            },
        )
        .unwrap_err();
    assert!(
        matches!(e, StoreError::BadInput(_)) && e.to_string().contains("port 0"),
        "{e}"
    );

    assert_eq!(s.load_all().unwrap(), before);
    assert_eq!(db.count("SELECT COUNT(*) FROM route_change"), log);
    // The connection is still usable after the failed transactions.
    assert_eq!(s.add_node(m(1, 1), node("10.0.0.2:80", 1)).unwrap(), 2);
}

fn module_versions_follow_their_latest_change(db: &Db) {
    let mut s = db.open();
    s.add_node(m(1, 1), node("10.0.0.1:80", 1)).unwrap(); // v1
    s.add_node(m(2, 2), node("10.0.0.2:80", 1)).unwrap(); // v2
    s.add_node(m(1, 1), node("10.0.0.3:80", 1)).unwrap(); // v3
                                                          // A module written by hand has no change-log entry: it takes the route version.
    db.hand(
        "INSERT INTO route_data (modid, cmdid, ip, port, weight) VALUES (3, 3, 167772164, 80, 1)",
    );
    let versions = |s: &mut dyn Store| -> Vec<(ModuleId, u64)> {
        s.load_all()
            .unwrap()
            .modules
            .iter()
            .map(|r| (r.module, r.version))
            .collect()
    };
    assert_eq!(
        versions(&mut *s),
        vec![(m(1, 1), 3), (m(2, 2), 2), (m(3, 3), 3)]
    );
    s.add_node(m(2, 2), node("10.0.0.5:80", 1)).unwrap(); // v4
    assert_eq!(
        versions(&mut *s),
        vec![(m(1, 1), 3), (m(2, 2), 4), (m(3, 3), 4)]
    );
    let listed: Vec<_> = s
        .list(None)
        .unwrap()
        .iter()
        .map(|r| (r.module, r.version))
        .collect();
    assert_eq!(listed, versions(&mut *s), "list and load_all agree");
    assert_eq!(s.list(Some(m(3, 3))).unwrap()[0].version, 4);
    // Another connection derives the same versions.
    assert_eq!(versions(&mut *db.open()), versions(&mut *s));
}

fn concurrent_admins_never_share_a_version(db: &Db) {
    let (threads, each) = (4u32, 15u32);
    let barrier = Arc::new(Barrier::new(threads as usize));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (url, barrier) = (db.url.clone(), barrier.clone());
            std::thread::spawn(move || {
                let mut s = store::open(&url).unwrap();
                barrier.wait();
                (0..each)
                    .map(|i| {
                        let n = RouteNode {
                            addr: NodeAddr::new(Ipv4Addr::new(10, 1, t as u8, i as u8), 80),
                            weight: 1,
                        };
                        s.add_node(m(t % 2, 1), n).unwrap()
                    })
                    .collect::<Vec<u64>>()
            })
        })
        .collect();
    let versions: BTreeSet<u64> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    let total = u64::from(threads * each);
    assert_eq!(
        versions,
        (1..=total).collect(),
        "every change got its own version"
    );
    let mut s = db.open();
    assert_eq!(s.route_version().unwrap(), total);
    assert_eq!(
        s.load_all()
            .unwrap()
            .modules
            .iter()
            .map(|r| r.nodes.len())
            .sum::<usize>(),
        total as usize
    );
}

fn upsert_status_replaces_by_key(db: &Db) {
    let mut s = db.open();
    s.upsert_status(&[]).unwrap();
    let a = status(m(1, 1), "10.0.0.1:80", 7, 100);
    let b = CallStatus { caller: 8, ..a };
    s.upsert_status(&[a, b]).unwrap();
    let newer = CallStatus {
        succ: 5,
        err: 6,
        ts: a.ts + 15,
        overload: true,
        ..a
    };
    s.upsert_status(&[newer]).unwrap();
    assert_eq!(
        s.call_status(None).unwrap(),
        vec![newer, b],
        "same key replaced, other caller kept"
    );
    // The same key twice in one batch: the last wins.
    let last = CallStatus { succ: 1, ..newer };
    s.upsert_status(&[CallStatus { succ: 99, ..newer }, last])
        .unwrap();
    assert_eq!(s.call_status(Some(m(1, 1))).unwrap(), vec![last, b]);
    assert_eq!(s.call_status(Some(m(2, 2))).unwrap(), vec![]);
    // Full ranges round-trip.
    let top = CallStatus {
        module: m(u32::MAX, u32::MAX),
        node: addr("255.255.255.255:65535"),
        caller: u32::MAX,
        succ: u32::MAX,
        err: u32::MAX,
        ts: i64::MAX as u64,
        overload: false,
        agent_start: u64::MAX,
        seq: u64::MAX,
    };
    s.upsert_status(&[top]).unwrap();
    assert_eq!(s.call_status(Some(top.module)).unwrap(), vec![top]);
    // A bad row refuses the whole batch.
    let port0 = CallStatus {
        node: NodeAddr::new(Ipv4Addr::LOCALHOST, 0),
        ..a
    };
    let e = s
        .upsert_status(&[status(m(3, 3), "10.0.0.1:80", 1, 1), port0])
        .unwrap_err();
    assert!(matches!(e, StoreError::BadInput(_)), "{e}");
    let e = s
        .upsert_status(&[CallStatus { ts: u64::MAX, ..a }])
        .unwrap_err();
    assert!(matches!(e, StoreError::BadInput(_)), "{e}");
    assert_eq!(s.call_status(Some(m(3, 3))).unwrap(), vec![]);
}

/// Issue 32: an agent's report re-sent after a reconnect can reach a
/// reporter after a newer report of the same run went through another;
/// the store keeps the newer row, in one batch as across batches.
fn a_resent_older_report_never_replaces_a_newer_row(db: &Db) {
    let mut s = db.open();
    let run = 0xfeed_0000_0000_0001_u64; // above i64::MAX: stored as its bits
    let from = |seq: u64, succ: u32| CallStatus {
        agent_start: run,
        seq,
        ..status(m(1, 1), "10.0.0.1:80", 7, succ)
    };
    let newer = from(5, 50);
    s.upsert_status(&[newer]).unwrap();
    s.upsert_status(&[from(4, 40)]).unwrap();
    assert_eq!(
        s.call_status(None).unwrap(),
        vec![newer],
        "re-sent report 4 undid report 5"
    );
    // In one batch, whatever the order.
    let newest = from(7, 70);
    s.upsert_status(&[newest, from(6, 60)]).unwrap();
    assert_eq!(s.call_status(None).unwrap(), vec![newest]);
    // The same report again stores the same values again.
    s.upsert_status(&[newest]).unwrap();
    assert_eq!(s.call_status(None).unwrap(), vec![newest]);
    // Another run of the agent (restarted: its seq starts again), and an
    // agent that does not say its run, replace as they come.
    let restarted = CallStatus {
        agent_start: run + 1,
        ..from(1, 10)
    };
    s.upsert_status(&[restarted]).unwrap();
    assert_eq!(s.call_status(None).unwrap(), vec![restarted]);
    let unknown = status(m(1, 1), "10.0.0.1:80", 7, 3);
    s.upsert_status(&[unknown]).unwrap();
    assert_eq!(s.call_status(None).unwrap(), vec![unknown]);
    // Another caller's row is its own.
    let other = CallStatus {
        caller: 8,
        ..from(1, 1)
    };
    s.upsert_status(&[other]).unwrap();
    assert_eq!(s.call_status(None).unwrap(), vec![unknown, other]);
}

fn upsert_status_writes_thousands_in_one_call(db: &Db) {
    let mut s = db.open();
    let batch: Vec<CallStatus> = (0..5000u32)
        .map(|i| CallStatus {
            module: m(i % 50, 1),
            node: NodeAddr::new(Ipv4Addr::from(0x0a00_0000 + i), 8000),
            caller: i % 7,
            succ: i,
            err: 0,
            ts: 1_700_000_000,
            overload: i % 3 == 0,
            agent_start: u64::from(i % 7) + 1,
            seq: u64::from(i),
        })
        .collect();
    let t = Instant::now();
    s.upsert_status(&batch).unwrap();
    let replaced: Vec<CallStatus> = batch
        .iter()
        .map(|r| CallStatus {
            succ: r.succ + 1,
            ts: r.ts + 15,
            seq: r.seq + 5000,
            ..*r
        })
        .collect();
    s.upsert_status(&replaced).unwrap();
    let took = t.elapsed();
    let mut want = replaced;
    want.sort_by_key(CallStatus::key);
    assert_eq!(s.call_status(None).unwrap(), want);
    assert!(
        took < Duration::from_secs(20),
        "two batches of 5000 took {took:?}"
    );
    println!("{}: two upserts of 5000 rows in {took:?}", s.backend());
}

fn bad_rows_are_skipped_not_fatal(db: &Db) {
    let mut s = db.open();
    s.add_node(m(1, 1), node("10.0.0.1:80", 1)).unwrap();
    s.upsert_status(&[status(m(1, 1), "10.0.0.1:80", 1, 10)])
        .unwrap();
    assert_eq!(s.bad_rows(), 0);
    db.hand(
        "INSERT INTO route_data (modid, cmdid, ip, port, weight) VALUES
             (1, 1, 167772162, 0, 1),
             (1, 1, 4294967296, 80, 1),
             (1, 1, 167772163, 80, -1),
             (1, 1, 167772164, 70000, 1),
             (-1, 1, 167772161, 80, 1),
             (4, 4, 167772161, 80, 1);
         INSERT INTO route_change (version, modid, cmdid) VALUES (7, -5, 1);
         INSERT INTO server_call_status (modid, cmdid, ip, port, caller, succ_cnt, err_cnt, ts, overload) VALUES
             (1, 1, 167772161, 80, 2, -3, 0, 0, FALSE),
             (1, 1, 167772161, 80, 3, 1, 1, -1, FALSE),
             (1, 1, 167772161, 0, 4, 1, 1, 1, FALSE);",
    );
    let all = s.load_all().unwrap();
    assert_eq!(
        all.modules
            .iter()
            .map(|r| (r.module, r.nodes.clone()))
            .collect::<Vec<_>>(),
        vec![
            (m(1, 1), vec![node("10.0.0.1:80", 1)]),
            (m(4, 4), vec![node("10.0.0.1:80", 1)])
        ]
    );
    assert_eq!(s.bad_rows(), 6, "five bad nodes and one bad change");
    assert_eq!(
        s.list(Some(m(1, 1))).unwrap()[0].nodes,
        vec![node("10.0.0.1:80", 1)]
    );
    let c = s.changes_since(0).unwrap();
    assert_eq!(
        c.modules.iter().map(|r| r.module).collect::<Vec<_>>(),
        vec![m(1, 1)]
    );
    assert_eq!(
        s.call_status(None).unwrap(),
        vec![status(m(1, 1), "10.0.0.1:80", 1, 10)]
    );
    assert_eq!(s.bad_rows(), 3, "three bad status rows");
    // A bad route version cannot be skipped: reads say so.
    db.hand("UPDATE route_version SET version = -4");
    let e = s.load_all().unwrap_err();
    assert!(
        matches!(e, StoreError::BadInput(_)) && e.to_string().contains("route_version"),
        "{e}"
    );
}

fn meta(zone: &str, labels: &str) -> NodeMeta {
    NodeMeta {
        zone: (!zone.is_empty()).then(|| zone.parse().unwrap()),
        labels: labels.parse().unwrap(),
    }
}

/// Issue 31: a node's zone and labels are route columns, read back with
/// the route, set on a node the module has, imported, and a bad stored
/// value (a database row is input too) is refused naming the module and
/// node, the node itself still served.
fn zones_and_labels_are_stored_set_imported_and_checked_on_the_way_out(db: &Db) {
    let mut s = db.open();
    let a = m(31, 1);
    let v = s
        .add_node_meta(
            a,
            node("10.0.0.1:80", 1),
            &meta("eu-1", "version=canary,tier=gold"),
        )
        .unwrap();
    s.add_node(a, node("10.0.0.2:80", 1)).unwrap();
    let r = &s.list(Some(a)).unwrap()[0];
    assert_eq!(
        r.meta,
        vec![(
            addr("10.0.0.1:80"),
            meta("eu-1", "tier=gold,version=canary")
        )]
    );
    // set_meta: a versioned change; an empty one clears.
    let v2 = s
        .set_meta(a, addr("10.0.0.2:80"), &meta("us-1", ""))
        .unwrap();
    assert!(v2 > v);
    let c = s.changes_since(v).unwrap();
    assert_eq!(c.modules.len(), 1);
    assert_eq!(c.modules[0].meta.len(), 2, "the change carries the meta");
    s.set_meta(a, addr("10.0.0.1:80"), &NodeMeta::default())
        .unwrap();
    let r = &s.load_all().unwrap().modules[0];
    assert_eq!(r.meta, vec![(addr("10.0.0.2:80"), meta("us-1", ""))]);
    assert!(matches!(
        s.set_meta(a, addr("10.0.0.9:80"), &meta("eu", "")),
        Err(StoreError::NotFound { .. })
    ));
    // import_table: the meta of the rows named; replace keeps it exact.
    let rows = [(a, node("10.0.0.1:80", 2)), (a, node("10.0.0.3:80", 1))];
    let metas = [(a, addr("10.0.0.3:80"), meta("eu-2", "k=v"))];
    s.import_table(&rows, &metas, true).unwrap();
    let r = &s.list(Some(a)).unwrap()[0];
    assert_eq!(r.nodes, rows.iter().map(|r| r.1).collect::<Vec<_>>());
    assert_eq!(r.meta, vec![(addr("10.0.0.3:80"), meta("eu-2", "k=v"))]);
    let stray = [(a, addr("10.0.0.7:80"), meta("eu-2", ""))];
    assert!(matches!(
        s.import_table(&rows, &stray, true),
        Err(StoreError::BadInput(e)) if e.contains("does not list")
    ));
    // A zone or labels written around the checks: the node is served
    // without them, the row counted, the rest of the route kept.
    db.hand(
        "UPDATE route_data SET zone = 'eu 1', labels = 'a=1,a=2' WHERE ip = 167772161;
         UPDATE route_data SET labels = 'version' WHERE ip = 167772163;",
    );
    let r = &s.list(Some(a)).unwrap()[0];
    assert_eq!(r.nodes.len(), 2, "both nodes still served");
    assert!(r.meta.is_empty(), "{:?}", r.meta);
    assert_eq!(s.bad_rows(), 2);
    // Good again: read back.
    s.set_meta(a, addr("10.0.0.1:80"), &meta("eu-1", ""))
        .unwrap();
    assert_eq!(s.list(Some(a)).unwrap()[0].meta.len(), 1);
}

fn a_newer_schema_is_refused(db: &Db) {
    drop(db.open());
    db.hand(&format!(
        "INSERT INTO schema_version (version, name) VALUES ({}, 'from the future')",
        SCHEMA_VERSION + 1
    ));
    match store::open(&db.url) {
        Err(StoreError::SchemaTooNew { found, known, .. }) => {
            assert_eq!((found, known), (SCHEMA_VERSION + 1, SCHEMA_VERSION));
        }
        Err(e) => panic!("expected SchemaTooNew, got {e}"),
        Ok(_) => panic!("a newer schema was opened"),
    }
}

// === one backend only ===

#[test]
fn sqlite_creates_missing_directories() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a").join("b").join("lbagent.db");
    let url: StoreUrl = format!("sqlite:{}", path.display()).parse().unwrap();
    store::open(&url)
        .unwrap()
        .add_node(m(1, 1), node("10.0.0.1:80", 1))
        .unwrap();
    assert!(path.is_file());
}

#[test]
fn sqlite_unwritable_path_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    // The parent "directory" is a file: even root cannot create the store.
    let url = StoreUrl::Sqlite(file.join("lbagent.db"));
    let e = store::open(&url).err().expect("opened under a file");
    let msg = e.to_string();
    assert!(matches!(e, StoreError::Unavailable { .. }), "{msg}");
    assert!(
        msg.contains("not-a-dir") && msg.contains("cannot create directory"),
        "{msg}"
    );

    let e = store::open(&StoreUrl::Sqlite(dir.path().to_path_buf()))
        .err()
        .expect("opened a directory");
    assert!(e.to_string().contains("is a directory"), "{e}");

    // A file that is not a database.
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "not a database\n".repeat(300)).unwrap();
    let e = store::open(&StoreUrl::Sqlite(text))
        .err()
        .expect("opened a text file");
    assert!(matches!(e, StoreError::Unavailable { .. }), "{e}");
    assert!(e.to_string().contains("not a database"), "{e}");
}

#[test]
fn sqlite_relative_path_without_directory() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("plain.db");
    store::open(&StoreUrl::Sqlite(path.clone())).unwrap();
    assert!(path.is_file());
}

#[test]
fn postgres_unreachable_is_unavailable_fast_and_redacted() {
    let url: StoreUrl = "postgres://u:secretpw@127.0.0.1:1/x".parse().unwrap();
    let t = Instant::now();
    let e = store::open(&url).err().expect("connected to port 1");
    assert!(
        t.elapsed() < Duration::from_secs(6),
        "took {:?}",
        t.elapsed()
    );
    let msg = e.to_string();
    assert!(matches!(e, StoreError::Unavailable { .. }), "{msg}");
    assert!(!msg.contains("secretpw"), "{msg}");
    assert!(msg.contains("postgres://u:***@127.0.0.1:1/x"), "{msg}");
    assert!(msg.to_lowercase().contains("refused"), "says why: {msg}");
}

#[test]
fn postgres_connect_timeout_applies() {
    // A listener that accepts and never answers: the whole connect, not
    // only the TCP handshake, is bounded.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let url: StoreUrl = format!("postgres://u:pw@127.0.0.1:{port}/x?connect_timeout=1")
        .parse()
        .unwrap();
    let t = Instant::now();
    let e = store::open(&url)
        .err()
        .expect("connected to a silent listener");
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "took {:?}",
        t.elapsed()
    );
    assert!(matches!(e, StoreError::Unavailable { .. }), "{e}");
    drop(listener);
}

#[test]
fn postgres_bad_url_is_bad_url_and_redacted() {
    let url: StoreUrl = "postgres://u:secretpw@127.0.0.1:5432/x?connect_timeout=soon"
        .parse()
        .unwrap();
    let e = store::open(&url).err().expect("a bad URL opened");
    assert!(matches!(e, StoreError::BadUrl(_)), "{e}");
    assert!(!e.to_string().contains("secretpw"), "{e}");
}

#[test]
fn postgres_reconnects_after_the_connection_is_lost() {
    let Some(db) = Db::postgres("reconnect") else {
        return;
    };
    let Kind::Postgres { schema, .. } = &db.kind else {
        unreachable!()
    };
    let ours = format!("application_name = '{schema}' AND pid <> pg_backend_pid()");
    // Terminates the store's backend and waits until it is gone, so that
    // the store's next call meets a dead connection whatever the load.
    let cut = || {
        let killed = db.count(&format!(
            "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE {ours}"
        ));
        assert_eq!(killed, 1);
        let deadline = Instant::now() + Duration::from_secs(30);
        while db.count(&format!(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE {ours}"
        )) > 0
        {
            assert!(Instant::now() < deadline, "the backend outlived 30 s");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let mut s = db.open();
    s.add_node(m(1, 1), node("10.0.0.1:80", 1)).unwrap();

    // A read: only the call that meets the loss may fail, and it says so;
    // every call after it runs on a new connection.
    cut();
    match s.route_version() {
        Ok(1) => {}
        Err(StoreError::Unavailable { why, .. }) => println!("first read after the loss: {why}"),
        other => panic!("{other:?}"),
    }
    for _ in 0..3 {
        assert_eq!(s.route_version().unwrap(), 1);
    }

    // A write: the same.
    cut();
    match s.add_node(m(1, 1), node("10.0.0.2:80", 1)) {
        Ok(2) => {}
        Err(StoreError::Unavailable { why, .. }) => {
            println!("first write after the loss: {why}");
            assert_eq!(s.add_node(m(1, 1), node("10.0.0.2:80", 1)).unwrap(), 2);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.add_node(m(1, 1), node("10.0.0.3:80", 1)).unwrap(), 3);
}

#[test]
fn redact_hides_both_password_forms() {
    assert_eq!(
        store::redact("postgres://u:pw@h:5/db?password=x&sslmode=disable"),
        "postgres://u:***@h:5/db?password=***&sslmode=disable"
    );
    assert_eq!(store::redact("postgres://h/db"), "postgres://h/db");
}

// === the balance policy ===

fn policy_is_a_versioned_change_carried_with_the_route(db: &Db) {
    use lbagent::model::Policy;
    let mut s = db.open();
    s.add_node(m(1, 1), node("10.0.0.1:80", 2)).unwrap(); // v1
    s.add_node(m(2, 2), node("10.0.0.2:80", 1)).unwrap(); // v2
    assert_eq!(s.load_all().unwrap().modules[0].policy, Policy::L5);
    assert_eq!(s.set_policy(m(1, 1), Policy::Balance).unwrap(), 3);
    let changes = s.changes_since(2).unwrap();
    assert_eq!(changes.version, 3);
    assert_eq!(changes.modules.len(), 1);
    assert_eq!(changes.modules[0].module, m(1, 1));
    assert_eq!(changes.modules[0].policy, Policy::Balance);
    assert_eq!(changes.modules[0].version, 3);
    let all = s.load_all().unwrap().modules;
    assert_eq!(
        all.iter().map(|r| r.policy).collect::<Vec<_>>(),
        [Policy::Balance, Policy::L5]
    );
    assert_eq!(s.list(Some(m(1, 1))).unwrap()[0].policy, Policy::Balance);
    // Back to l5: another version; another connection sees the same.
    assert_eq!(s.set_policy(m(1, 1), Policy::L5).unwrap(), 4);
    assert_eq!(db.open().list(Some(m(1, 1))).unwrap()[0].policy, Policy::L5);
}

// === module options (issue 31) ===

fn options_are_a_versioned_change_beside_the_policy(db: &Db) {
    use lbagent::model::{ModuleOptions, Policy};
    let mut s = db.open();
    s.add_node(m(1, 1), node("10.0.0.1:80", 2)).unwrap(); // v1
    assert!(s.load_all().unwrap().modules[0].options.is_unset());
    let o = ModuleOptions {
        slow_start_ms: Some(30_000),
        max_overloaded_percent: Some(50),
        panic_percent: Some(0),
        locality_min_percent: None,
    };
    // Options first (no policy row yet): the policy stays l5.
    assert_eq!(s.set_options(m(1, 1), o).unwrap(), 2);
    let changes = s.changes_since(1).unwrap();
    assert_eq!(changes.modules[0].options, o);
    assert_eq!(changes.modules[0].policy, Policy::L5);
    // The policy keeps the options, and the options the policy; p2c is stored.
    assert_eq!(s.set_policy(m(1, 1), Policy::P2c).unwrap(), 3);
    let r = &db.open().list(Some(m(1, 1))).unwrap()[0];
    assert_eq!((r.policy, r.options), (Policy::P2c, o));
    let cleared = ModuleOptions {
        slow_start_ms: None,
        ..o
    };
    assert_eq!(s.set_options(m(1, 1), cleared).unwrap(), 4);
    let r = &s.list(Some(m(1, 1))).unwrap()[0];
    assert_eq!((r.policy, r.options), (Policy::P2c, cleared));
    // Out of range: refused, nothing changes.
    let bad = ModuleOptions {
        max_overloaded_percent: Some(0),
        ..o
    };
    let e = s.set_options(m(1, 1), bad).unwrap_err();
    assert!(e.to_string().contains("max_overloaded_percent"), "{e}");
    assert_eq!(s.route_version().unwrap(), 4);
}

fn consumed_units_lower_the_capacity_never_below_zero(db: &Db) {
    let mut s = db.open();
    let (a, b) = (
        "10.0.0.1:80".parse().unwrap(),
        "10.0.0.2:80".parse().unwrap(),
    );
    s.add_node(m(1, 1), node("10.0.0.1:80", 5)).unwrap(); // v1
    s.add_node(m(1, 1), node("10.0.0.2:80", 3)).unwrap(); // v2
    let weights = |s: &mut dyn Store| -> Vec<u32> {
        s.list(Some(m(1, 1))).unwrap()[0]
            .nodes
            .iter()
            .map(|n| n.weight)
            .collect()
    };
    let c = s.consume(&[(m(1, 1), a, 2), (m(1, 1), b, 1)]).unwrap();
    assert_eq!((c.version, c.nodes), (3, 2), "one version for the batch");
    assert_eq!(weights(&mut *s), [3, 2]);
    assert_eq!(s.changes_since(2).unwrap().modules[0].nodes[0].weight, 3);
    // More than is left stops at 0; a node at 0 changes nothing more.
    let c = s.consume(&[(m(1, 1), b, 7)]).unwrap();
    assert_eq!((c.version, c.nodes), (4, 1));
    assert_eq!(weights(&mut *s), [3, 0]);
    let c = s.consume(&[(m(1, 1), b, 1), (m(9, 9), a, 1)]).unwrap();
    assert_eq!((c.version, c.nodes), (4, 0), "nothing changed: no version");
    // Bad values refuse the whole batch.
    for units in [0, store::MAX_WEIGHT + 1] {
        let e = s
            .consume(&[(m(1, 1), a, 1), (m(1, 1), a, units)])
            .unwrap_err();
        assert!(matches!(e, StoreError::BadInput(_)), "{e}");
        assert!(e.to_string().contains("out of range"), "{e}");
    }
    assert_eq!(weights(&mut *s), [3, 0]);
    // Re-adding a node starts it afresh.
    s.del_node(m(1, 1), b).unwrap();
    s.add_node(m(1, 1), node("10.0.0.2:80", 3)).unwrap();
    assert_eq!(weights(&mut *s), [3, 3]);
}

// === TLS to PostgreSQL ===
//
// tools/ci-postgres.sh turns TLS on in its cluster (a server certificate
// for `localhost` and 127.0.0.1 signed by a test CA) and records the CA's
// path in the database setting `lbagent.test_ca`. Like the suite's
// PostgreSQL cases, these skip only when LBAGENT_TEST_POSTGRES_URL is unset.

/// A fresh schema (see [`Db::postgres`]) and the test CA's path.
fn tls_db(case: &str) -> Option<(Db, String)> {
    let db = Db::postgres(case)?;
    let Kind::Postgres { admin_url, .. } = &db.kind else {
        unreachable!()
    };
    let mut c = ::postgres::Client::connect(admin_url, ::postgres::NoTls).expect("connect");
    let ca: Option<String> = c
        .query_one("SELECT current_setting('lbagent.test_ca', true)", &[])
        .expect("read lbagent.test_ca")
        .get(0);
    let ca = ca.filter(|p| !p.is_empty()).unwrap_or_else(|| {
        panic!(
            "the database of {PG_ENV} has no setting lbagent.test_ca (the test CA's path): \
             run tools/ci-postgres.sh, which turns TLS on and records it"
        )
    });
    Some((db, ca))
}

/// The database URL of `db` with `params` added.
fn with_params(db: &Db, params: &str) -> StoreUrl {
    let StoreUrl::Postgres(url) = &db.url else {
        unreachable!()
    };
    StoreUrl::Postgres(format!("{url}&{params}"))
}

/// The database URL of `db` with `params` added, whose host (the name TLS
/// checks) is `host` while the TCP connection goes to the URL's address
/// (`hostaddr`).
fn with_host(db: &Db, host: &str, params: &str) -> StoreUrl {
    let StoreUrl::Postgres(url) = &db.url else {
        unreachable!()
    };
    let c: ::postgres::Config = url.parse().expect("the test URL");
    let ::postgres::config::Host::Tcp(addr) = &c.get_hosts()[0] else {
        panic!("{PG_ENV} must name a TCP host for the TLS cases")
    };
    let at = format!("@{addr}:");
    assert!(
        url.contains(&at),
        "{PG_ENV} must be postgres://user:password@HOST:PORT/... for the TLS cases"
    );
    let url = url.replacen(&at, &format!("@{host}:"), 1);
    StoreUrl::Postgres(format!("{url}&hostaddr={addr}&{params}"))
}

#[test]
fn postgres_over_verified_tls_writes_and_reads_a_route() {
    let Some((db, ca)) = tls_db("tls_ok") else {
        return;
    };
    let url = with_params(&db, &format!("sslmode=verify-full&sslrootcert={ca}"));
    let mut s = store::open(&url).unwrap_or_else(|e| panic!("open {url}: {e}"));
    s.add_node(m(7, 1), node("10.1.2.3:80", 4)).unwrap();
    let all = s.load_all().unwrap();
    assert_eq!(all.modules.len(), 1);
    assert_eq!(all.modules[0].nodes, vec![node("10.1.2.3:80", 4)]);
    // The store's connection (the only other one with this schema's
    // application_name) is TLS, seen from the server.
    let Kind::Postgres { admin_url, schema } = &db.kind else {
        unreachable!()
    };
    let mut c = ::postgres::Client::connect(admin_url, ::postgres::NoTls).expect("connect");
    let row = c
        .query_one(
            "SELECT COUNT(*), COUNT(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a \
             JOIN pg_stat_ssl s USING (pid) \
             WHERE a.application_name = $1 AND a.pid <> pg_backend_pid()",
            &[schema],
        )
        .expect("read pg_stat_ssl");
    let (all, tls): (i64, i64) = (row.get(0), row.get(1));
    assert!(all >= 1, "the store's connection is not seen");
    assert_eq!(tls, all, "a store connection is not TLS");
    // require encrypts without verifying (libpq's meaning): no CA needed.
    let url = with_params(&db, "sslmode=require");
    let mut s = store::open(&url).unwrap_or_else(|e| panic!("open {url}: {e}"));
    assert_eq!(s.load_all().unwrap().modules.len(), 1);
    // verify-ca checks the chain and not the name: another name works.
    let url = with_host(
        &db,
        "not-the-server.invalid",
        &format!("sslmode=verify-ca&sslrootcert={ca}"),
    );
    let mut s = store::open(&url).unwrap_or_else(|e| panic!("open {url}: {e}"));
    assert_eq!(s.load_all().unwrap().modules.len(), 1);
}

#[test]
fn postgres_tls_refuses_a_server_signed_by_another_ca() {
    let Some((db, _ca)) = tls_db("tls_wrong_ca") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("other-ca.pem");
    std::fs::write(
        &other,
        lbagent_tls::testing::TestCa::new("another CA").pem(),
    )
    .unwrap();
    let url = with_params(
        &db,
        &format!("sslmode=verify-full&sslrootcert={}", other.display()),
    );
    let e = store::open(&url)
        .err()
        .expect("a server signed by another CA is refused");
    let msg = e.to_string();
    assert!(matches!(e, StoreError::Unavailable { .. }), "{msg}");
    assert!(
        msg.contains("not signed by a CA in") && msg.contains("unknown CA"),
        "{msg}"
    );
    assert!(msg.contains(&other.display().to_string()), "{msg}");
}

#[test]
fn postgres_tls_refuses_a_server_certificate_for_another_name() {
    let Some((db, ca)) = tls_db("tls_wrong_name") else {
        return;
    };
    let url = with_host(
        &db,
        "not-the-server.invalid",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    let e = store::open(&url)
        .err()
        .expect("a certificate for another name is refused");
    let msg = e.to_string();
    assert!(matches!(e, StoreError::Unavailable { .. }), "{msg}");
    assert!(msg.contains("does not name the host"), "{msg}");
    // The same URL with the server's name works: only the name differs.
    let url = with_host(
        &db,
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    store::open(&url).unwrap_or_else(|e| panic!("open {url}: {e}"));
}

#[test]
fn lbagent_route_verifies_postgres_with_the_configs_tls_ca_by_default() {
    let Some((db, ca)) = tls_db("tls_cli") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // This host's own certificate (from any CA: the route command does not
    // present it to PostgreSQL) and, as tls.ca, the CA that signs the
    // PostgreSQL server's certificate.
    let own = lbagent_tls::testing::TestCa::new("fleet").write(
        dir.path(),
        "host",
        &["host.example"],
        lbagent_tls::testing::Validity::Now,
    );
    let config = dir.path().join("lbagent.toml");
    std::fs::write(
        &config,
        format!(
            "[tls]\ncert = {:?}\nkey = {:?}\nca = {ca:?}\n",
            own.cert.display().to_string(),
            own.key.display().to_string()
        ),
    )
    .unwrap();
    let StoreUrl::Postgres(url) = with_params(&db, "sslmode=verify-full") else {
        unreachable!()
    };
    let route = |with_config: bool| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_lbagent"));
        cmd.args(["route", "add", "7", "1", "10.1.2.3:80", "--store", &url]);
        if with_config {
            cmd.arg("--config").arg(&config);
        }
        cmd.output().expect("run lbagent route")
    };
    // Without the configuration, verify-full has no CA: refused, saying so.
    let out = route(false);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("need sslrootcert="), "{stderr}");
    // With it, tls.ca is the CA: the route is written over verified TLS.
    let out = route(true);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let all = db.open().load_all().unwrap();
    assert_eq!(all.modules.len(), 1, "{stderr}");
    assert_eq!(all.modules[0].nodes, vec![node("10.1.2.3:80", 1)]);
}

#[test]
fn postgres_cert_authentication_with_sslcert_and_sslkey() {
    let Some((db, ca)) = tls_db("tls_cert_auth") else {
        return;
    };
    // tools/ci-postgres.sh: client.pem/client.key beside the CA, for the
    // role lbagent_cert, which logs in with that certificate only.
    let dir = Path::new(&ca).parent().expect("the CA's directory");
    let (cert, key) = (dir.join("client.pem"), dir.join("client.key"));
    let StoreUrl::Postgres(url) =
        with_params(&db, &format!("sslmode=verify-full&sslrootcert={ca}"))
    else {
        unreachable!()
    };
    let (scheme, rest) = url.split_once("://").unwrap();
    let (_, rest) = rest.split_once('@').expect("user@host in the test URL");
    let url = format!("{scheme}://lbagent_cert@{rest}");
    // Without a client certificate the server refuses the role.
    let e = store::open(&StoreUrl::Postgres(url.clone()))
        .err()
        .expect("no client certificate: refused");
    let msg = e.to_string();
    assert!(msg.contains("give sslcert= and sslkey="), "{msg}");
    assert!(msg.contains("requires a valid client certificate"), "{msg}");
    // With it, the role logs in and writes.
    let url = StoreUrl::Postgres(format!(
        "{url}&sslcert={}&sslkey={}",
        cert.display(),
        key.display()
    ));
    let mut s = store::open(&url).unwrap_or_else(|e| panic!("open {url}: {e}"));
    s.add_node(m(8, 1), node("10.8.0.1:80", 2)).unwrap();
    let all = s.load_all().unwrap();
    assert_eq!(all.modules.len(), 1);
    assert_eq!(all.modules[0].nodes, vec![node("10.8.0.1:80", 2)]);
}
