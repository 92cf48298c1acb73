//! Bulk route import: a MODULES x 10-node table (1M rows at the default
//! 100k modules) through `Store::import_routes`, on SQLite in a temporary
//! directory and, when `LBAGENT_TEST_POSTGRES_URL` is set, on PostgreSQL
//! (a fresh schema, dropped afterwards).
//!
//! Per round and backend, in a fresh store:
//! - `parse`: the CSV text of the table through `store::table::parse`
//!   (what `lbagent route import` does before it opens the store);
//! - `import`: the table into the empty store (one transaction);
//! - `replace`: the same table again with `--replace` semantics (every
//!   module's nodes deleted and written again, one transaction);
//! - `export`: `load_all` and `store::table::write` to a buffer.
//!
//! The baseline, measured in the same run on the same store: BASELINE
//! `add_node` calls (one transaction each, what loading a table took
//! before), as rows per second. Medians of ROUNDS rounds.
//!
//! Run: `cargo bench --bench route_import -- [MODULES] [ROUNDS] [BASELINE]`
//! (defaults 100000, 3, 2000).

use std::time::{Duration, Instant};

use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::store::table::{self, TableFormat};
use lbagent::store::{self, ModuleRoute, StoreUrl};

const NODES: u32 = 10;

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let arg = |i: usize, default: u64| -> u64 {
        args.get(i).map_or(default, |s| {
            s.parse()
                .unwrap_or_else(|_| panic!("argument {i} `{s}` is not a number"))
        })
    };
    let modules = arg(0, 100_000) as u32;
    let rounds = arg(1, 3) as usize;
    let baseline = arg(2, 2_000) as u32;

    let rows = table_rows(modules);
    let routes: Vec<ModuleRoute> = (0..modules)
        .map(|k| ModuleRoute {
            module: ModuleId::new(k, 1),
            version: 0,
            nodes: rows[(k * NODES) as usize..((k + 1) * NODES) as usize]
                .iter()
                .map(|r| r.1)
                .collect(),
            policy: lbagent::model::Policy::L5,
            options: Default::default(),
            meta: Vec::new(),
        })
        .collect();
    let mut csv = Vec::new();
    table::write(&mut csv, &routes, TableFormat::Csv).unwrap();
    let csv = String::from_utf8(csv).unwrap();
    println!(
        "table: {modules} modules x {NODES} nodes = {} rows, CSV {} MB; {rounds} rounds; baseline {baseline} add_node calls",
        rows.len(),
        csv.len() / 1_000_000
    );

    let mut backends = vec!["sqlite"];
    let pg = std::env::var("LBAGENT_TEST_POSTGRES_URL").ok();
    if pg.is_some() {
        backends.push("postgres");
    } else {
        println!("note: LBAGENT_TEST_POSTGRES_URL is not set: SQLite only");
    }
    for backend in backends {
        let mut t: [Vec<Duration>; 5] = Default::default();
        for round in 0..rounds {
            let (url, cleanup) = fresh_store(backend, pg.as_deref(), round);
            let mut s = store::open(&url).expect("open the store");

            let t0 = Instant::now();
            let parsed = table::parse(&csv, TableFormat::Csv)
                .expect("the table parses")
                .rows;
            t[0].push(t0.elapsed());
            assert_eq!(parsed.len(), rows.len());

            let t0 = Instant::now();
            let got = s.import_routes(&parsed, false).expect("import");
            t[1].push(t0.elapsed());
            assert_eq!(got.nodes, rows.len());

            let t0 = Instant::now();
            s.import_routes(&parsed, true).expect("import --replace");
            t[2].push(t0.elapsed());

            let t0 = Instant::now();
            let all = s.load_all().expect("load_all");
            let mut out = Vec::with_capacity(csv.len());
            table::write(&mut out, &all.modules, TableFormat::Csv).unwrap();
            t[3].push(t0.elapsed());
            assert_eq!(out.len(), csv.len(), "export is the table");

            // The baseline: a row per transaction, into modules of their own.
            let t0 = Instant::now();
            for i in 0..baseline {
                let node = RouteNode {
                    addr: NodeAddr::new(
                        std::net::Ipv4Addr::new(10, 200, (i >> 8) as u8, i as u8),
                        80,
                    ),
                    weight: 1,
                };
                s.add_node(ModuleId::new(modules + i, 1), node)
                    .expect("add_node");
            }
            t[4].push(t0.elapsed());
            drop(s);
            cleanup();
        }
        let n = rows.len() as f64;
        let med: Vec<Duration> = t.iter_mut().map(|v| median(v)).collect();
        let base_rate = f64::from(baseline) / med[4].as_secs_f64();
        println!("\n{backend}: medians of {rounds} rounds");
        for (name, d) in ["parse", "import", "replace", "export"].iter().zip(&med) {
            let rate = n / d.as_secs_f64();
            println!(
                "  {name:8} {:>8.2} s  {:>10.0} rows/s  {:>7.0}x add_node",
                d.as_secs_f64(),
                rate,
                rate / base_rate
            );
        }
        println!(
            "  add_node {:>8.2} s for {baseline} rows: {:>10.0} rows/s (baseline)",
            med[4].as_secs_f64(),
            base_rate
        );
    }
}

fn table_rows(modules: u32) -> Vec<(ModuleId, RouteNode)> {
    (0..modules)
        .flat_map(|k| {
            let [_, a, b, c] = k.to_be_bytes();
            (1..=NODES).map(move |i| {
                (
                    ModuleId::new(k, 1),
                    RouteNode {
                        addr: NodeAddr::new(std::net::Ipv4Addr::new(10, a, b, c), 8000 + i as u16),
                        weight: 1 + i,
                    },
                )
            })
        })
        .collect()
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

type Cleanup = Box<dyn FnOnce()>;

fn fresh_store(backend: &str, pg: Option<&str>, round: usize) -> (StoreUrl, Cleanup) {
    if backend == "sqlite" {
        let dir = tempfile::tempdir().unwrap();
        let url = StoreUrl::Sqlite(dir.path().join("lbagent.db"));
        return (url, Box::new(move || drop(dir)));
    }
    let base = pg.unwrap().to_string();
    let schema = format!("lbagent_perf_import_{}_{round}", std::process::id());
    let mut admin = ::postgres::Client::connect(&base, ::postgres::NoTls).expect("connect");
    admin
        .batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema};"
        ))
        .expect("create the schema");
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}options=-csearch_path%3D{schema}");
    (
        StoreUrl::Postgres(url),
        Box::new(move || {
            let _ = admin.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
        }),
    )
}
