//! The production store: PostgreSQL through the (synchronous) `postgres`
//! crate. Several route servers, reporters and admins share one database.
//!
//! - Reads run in one `REPEATABLE READ, READ ONLY` transaction: the route
//!   version, the change log and the routes come from one snapshot.
//! - Admin changes start with `INSERT .. ON CONFLICT DO UPDATE SET version
//!   = version + 1 RETURNING version` on the one `route_version` row: the
//!   row lock queues concurrent admins, so no two changes share a version,
//!   and a reader that sees version V sees every change up to V.
//! - Call status batches go in one statement (`UNNEST` of one array per
//!   column), their rows sorted by key so that concurrent reporters lock
//!   rows in the same order.
//! - Migrations run in one transaction holding a transaction-level
//!   advisory lock keyed by the schema (`current_schema()`), so stores in
//!   different schemas of one database migrate independently.
//!
//! - TLS (rustls) when the URL asks for it: `sslmode=verify-full` (or
//!   `verify-ca`, `require`) with `sslrootcert=`; see [`super::pg_tls`].
//!   `sslmode=prefer`, the default, talks plain TCP.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use ::postgres::fallible_iterator::FallibleIterator;
use ::postgres::{Client, Config, IsolationLevel, NoTls, Transaction};

use super::migrations::{self, MIGRATIONS, POSTGRES_SCHEMA_VERSION_TABLE};
use super::pg_tls::{self, Mode, PgTls};
use super::{
    assemble, check_consumed, check_node, meta_columns, prepare_import, prepare_status, redact,
    version_of, BadRows, CallStatus, ChangeRow, Changes, Consumed, Imported, ModuleRoute,
    PolicyRow, ReportKey, RouteRow, RouteSet, StatusRow, Store, StoreError, TableMeta, TextCol,
    Wake, CONNECT_TIMEOUT, CONSUMED_REPORT_KEEP_S,
};
use lbagent_model::{ModuleId, ModuleOptions, NodeAddr, NodeMeta, Policy, RouteNode};

/// Connection attempts still waiting for a server that accepted the TCP
/// connection and then said nothing. Each holds a thread; past
/// [`MAX_HUNG_CONNECTS`] `open` fails at once instead of adding another.
static HUNG_CONNECTS: AtomicUsize = AtomicUsize::new(0);
const MAX_HUNG_CONNECTS: usize = 4;

/// One connection to a PostgreSQL store.
pub(crate) struct PostgresStore {
    client: Client,
    /// To connect again after the connection was lost.
    config: Config,
    /// How to connect: plain TCP or the rustls connector, from the URL.
    tls: Arc<Tls>,
    url: String,
    bad: BadRows,
    /// Set by an error that means the connection is gone: the next call
    /// connects afresh instead of trying the dead one again.
    lost: Arc<AtomicBool>,
    /// The schema whose changes this connection listens to (`LISTEN`
    /// issued on it); `None` until [`Store::wait_for_change`] first runs,
    /// and again after every new connection.
    listening: Option<String>,
}

/// `e` as [`StoreError::Unavailable`]; marks the connection `lost` when
/// `e` says it is gone.
fn unavailable(url: &str, lost: &AtomicBool, e: &::postgres::Error) -> StoreError {
    if connection_gone(e) {
        lost.store(true, Ordering::Release);
    }
    StoreError::Unavailable {
        url: url.to_string(),
        why: super::why(e),
    }
}

/// Whether `e` means the connection cannot be used again: closed, an I/O
/// or protocol failure (anything the server did not report as an SQL
/// error), or the server's own word that it ends the session (SQLSTATE
/// class 08, connection exception, or 57P01..57P03: terminated by an
/// administrator, a crash, or a server starting or stopping), or that it
/// takes no writes (25006: read-only).
pub(crate) fn connection_gone(e: &::postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    match e.as_db_error() {
        None => true,
        Some(db) => {
            let code = db.code().code();
            // 25006 (read-only transaction): a server that no longer takes
            // writes (a primary demoted, or a standby reached by a URL
            // without target_session_attrs=read-write): reconnecting lets
            // target_session_attrs find the host that does.
            code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03" | "25006")
        }
    }
}

/// The TLS side of a connection: the URL's parameters and the connector
/// built from them (`None`: plain TCP).
struct Tls {
    params: PgTls,
    connector: Option<tokio_postgres_rustls::MakeRustlsConnect>,
}

impl PostgresStore {
    /// Connects to `url` and migrates the schema.
    pub(crate) fn open(url: &str) -> Result<Box<dyn Store>, StoreError> {
        let shown = redact(url);
        let bad = |why: String| StoreError::BadUrl(format!("{shown}: {why}"));
        let (text, params) = pg_tls::split(url).map_err(bad)?;
        let connector = params.connector().map_err(bad)?;
        if params.mode == Mode::EncryptOnly {
            tracing::warn!(
                url = %shown,
                "sslmode=require: the connection to PostgreSQL is encrypted but the server is \
                 not authenticated (anyone in the path can pose as it); use \
                 sslmode=verify-full with sslrootcert="
            );
        }
        let tls = Arc::new(Tls { params, connector });
        let mut config: Config = text
            .parse()
            .map_err(|e: ::postgres::Error| bad(super::why(&e)))?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("lbagent");
        }
        // Notice a dead server within about a minute rather than hours.
        if config.get_keepalives_idle() >= Duration::from_secs(7200) {
            config.keepalives_idle(Duration::from_secs(30));
        }
        let client = connect(&config, &tls, &shown)?;
        let mut store = PostgresStore {
            client,
            config,
            tls,
            bad: BadRows::new(shown.clone()),
            url: shown,
            lost: Arc::new(AtomicBool::new(false)),
            listening: None,
        };
        store.migrate()?;
        Ok(Box::new(store))
    }

    /// The connection, connected again first when the last one was lost
    /// (server restarted, backend terminated, network cut: known from
    /// [`Client::is_closed`] or from the last error, see
    /// [`connection_gone`]): a caller retrying after
    /// [`StoreError::Unavailable`] needs no new `open`, and only the call
    /// that met the loss fails.
    fn client(&mut self) -> Result<&mut Client, StoreError> {
        if self.lost.load(Ordering::Acquire) || self.client.is_closed() {
            self.client = connect(&self.config, &self.tls, &self.url)?;
            self.lost.store(false, Ordering::Release);
            // A new session listens to nothing.
            self.listening = None;
        }
        Ok(&mut self.client)
    }

    fn migrate(&mut self) -> Result<(), StoreError> {
        let (url, lost) = (self.url.clone(), self.lost.clone());
        let un = |e: ::postgres::Error| unavailable(&url, &lost, &e);
        let too_new = |found| StoreError::SchemaTooNew {
            url: url.clone(),
            found,
            known: migrations::LATEST,
        };
        // A current store is opened without taking the lock (nor needing
        // the right to create tables).
        let found = schema_version(&mut self.client).map_err(un)?;
        if found > migrations::LATEST {
            return Err(too_new(found));
        }
        if found == migrations::LATEST {
            return Ok(());
        }
        let mut tx = self.client.transaction().map_err(un)?;
        tx.execute("SELECT pg_advisory_xact_lock(hashtext('lbagent.schema.' || COALESCE(current_schema(), '')))", &[])
            .map_err(un)?;
        tx.batch_execute(POSTGRES_SCHEMA_VERSION_TABLE)
            .map_err(un)?;
        // Another process may have migrated while this one waited.
        let found = schema_version(&mut tx).map_err(un)?;
        if found > migrations::LATEST {
            return Err(too_new(found));
        }
        for m in MIGRATIONS.iter().filter(|m| m.version > found) {
            let failed = |e: ::postgres::Error| StoreError::Unavailable {
                url: url.clone(),
                why: format!(
                    "migration {} ({}) failed: {}",
                    m.version,
                    m.name,
                    super::why(&e)
                ),
            };
            tx.batch_execute(m.postgres).map_err(failed)?;
            tx.execute(
                "INSERT INTO schema_version (version, name) VALUES ($1, $2)",
                &[&(m.version as i32), &m.name],
            )
            .map_err(failed)?;
        }
        tx.commit().map_err(un)
    }

    fn read_tx(&mut self) -> Result<Transaction<'_>, StoreError> {
        self.bad.start();
        let (url, lost) = (self.url.clone(), self.lost.clone());
        self.client()?
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .map_err(|e| unavailable(&url, &lost, &e))
    }

    /// Routes, module versions and the route version, in one snapshot.
    /// `module`: one module only. `since`: only modules changed after that
    /// version (those with no node left appear empty).
    fn read_routes(
        &mut self,
        module: Option<ModuleId>,
        since: Option<u64>,
    ) -> Result<(u64, Vec<ModuleRoute>), StoreError> {
        let (url, lost) = (self.url.clone(), self.lost.clone());
        let un = |e: ::postgres::Error| unavailable(&url, &lost, &e);
        let (modid, cmdid) = match module {
            Some(m) => (Some(i64::from(m.modid)), Some(i64::from(m.cmdid))),
            None => (None, None),
        };
        let mut tx = self.read_tx()?;
        let version: Option<i64> = tx
            .query_opt("SELECT version FROM route_version WHERE id = 1", &[])
            .map_err(un)?
            .map(|r| int(&r, 0));
        let changes = match since {
            // The log's rows after `since` (a module has one row: its
            // latest change), in version order: through the primary key,
            // which leads with the version.
            Some(v) => tx.query(
                "SELECT modid, cmdid, version FROM route_change WHERE version > $1 ORDER BY version",
                &[&i64::try_from(v).unwrap_or(i64::MAX)],
            ),
            None => tx.query(
                "SELECT modid, cmdid, MAX(version) FROM route_change
                  WHERE $1::BIGINT IS NULL OR (modid = $1 AND cmdid = $2)
                  GROUP BY modid, cmdid",
                &[&modid, &cmdid],
            ),
        };
        let changes: Vec<ChangeRow> = changes
            .map_err(un)?
            .iter()
            .map(|r| ChangeRow {
                modid: int(r, 0),
                cmdid: int(r, 1),
                version: int(r, 2),
            })
            .collect();
        let rows = if since.is_some() {
            // The changed modules' rows through the primary key: the cost
            // is the change's, not the table's.
            let mut modules: Vec<(i64, i64)> = changes.iter().map(|c| (c.modid, c.cmdid)).collect();
            modules.sort_unstable();
            modules.dedup();
            let modids: Vec<i64> = modules.iter().map(|m| m.0).collect();
            let cmdids: Vec<i64> = modules.iter().map(|m| m.1).collect();
            tx.query(
                "SELECT d.modid, d.cmdid, d.ip, d.port, d.weight - d.consumed, d.zone, d.labels
                   FROM UNNEST($1::BIGINT[], $2::BIGINT[]) AS u(modid, cmdid)
                   JOIN route_data d ON d.modid = u.modid AND d.cmdid = u.cmdid",
                &[&modids, &cmdids],
            )
        } else {
            tx.query(
                "SELECT modid, cmdid, ip, port, weight - consumed, zone, labels FROM route_data
                  WHERE $1::BIGINT IS NULL OR (modid = $1 AND cmdid = $2)",
                &[&modid, &cmdid],
            )
        };
        let policies = tx
            .query(
                "SELECT modid, cmdid, policy, slow_start_ms, max_overloaded_percent,
                        panic_percent, locality_min_percent FROM route_policy
                  WHERE ($1::BIGINT IS NULL OR (modid = $1 AND cmdid = $2))",
                &[&modid, &cmdid],
            )
            .map_err(un)?
            .iter()
            .map(|r| PolicyRow {
                modid: int(r, 0),
                cmdid: int(r, 1),
                policy: int(r, 2),
                slow_start_ms: int(r, 3),
                max_overloaded_percent: int(r, 4),
                panic_percent: int(r, 5),
                locality_min_percent: int(r, 6),
            })
            .collect();
        let nodes = rows
            .map_err(un)?
            .iter()
            .map(|r| RouteRow {
                modid: int(r, 0),
                cmdid: int(r, 1),
                ip: int(r, 2),
                port: int(r, 3),
                weight: int(r, 4),
                zone: text(r, 5),
                labels: text(r, 6),
            })
            .collect();
        tx.commit().map_err(un)?;
        let version = version_of(&self.url, version)?;
        let latest = self.bad.changes(changes);
        let nodes = self.bad.routes(nodes);
        let policies = self.bad.policies(policies);
        let keep: Vec<ModuleId> = if since.is_some() {
            latest.keys().copied().collect()
        } else {
            Vec::new()
        };
        Ok((version, assemble(version, &latest, nodes, keep, &policies)))
    }

    /// The error for an import refused because the store has one of
    /// `rows`' nodes already: [`StoreError::Duplicate`] naming one.
    fn duplicate_of(&mut self, rows: &[(ModuleId, RouteNode)]) -> StoreError {
        let (url, lost) = (self.url.clone(), self.lost.clone());
        let un = |e: ::postgres::Error| unavailable(&url, &lost, &e);
        let modid: Vec<i64> = rows.iter().map(|r| i64::from(r.0.modid)).collect();
        let cmdid: Vec<i64> = rows.iter().map(|r| i64::from(r.0.cmdid)).collect();
        let ip: Vec<i64> = rows.iter().map(|r| i64::from(r.1.addr.ip)).collect();
        let port: Vec<i32> = rows.iter().map(|r| i32::from(r.1.addr.port)).collect();
        let found = self.client().and_then(|c| {
            c.query_opt(
                "SELECT d.modid, d.cmdid, d.ip, d.port FROM route_data d
                   JOIN UNNEST($1::BIGINT[], $2::BIGINT[], $3::BIGINT[], $4::INTEGER[])
                        AS u(modid, cmdid, ip, port)
                     ON d.modid = u.modid AND d.cmdid = u.cmdid AND d.ip = u.ip AND d.port = u.port
                  ORDER BY 1, 2, 3, 4 LIMIT 1",
                &[&modid, &cmdid, &ip, &port],
            )
            .map_err(un)
        });
        match found {
            Ok(Some(r)) => {
                let (modid, cmdid, ip, port) = (int(&r, 0), int(&r, 1), int(&r, 2), int(&r, 3));
                StoreError::Duplicate {
                    module: ModuleId::new(modid as u32, cmdid as u32),
                    node: NodeAddr {
                        ip: ip as u32,
                        port: port as u16,
                    },
                }
            }
            Ok(None) => StoreError::BadInput(
                "another admin added a node of this table meanwhile: nothing was imported; import again"
                    .to_string(),
            ),
            Err(e) => e,
        }
    }

    /// Bumps the route version (taking its row lock until commit) and logs
    /// `module` as changed, in `tx`.
    /// Applies consumed units in `tx` (see [`Store::consume`]).
    fn apply_consumed(
        tx: &mut Transaction<'_>,
        rows: &[(ModuleId, NodeAddr, u32)],
    ) -> Result<Consumed, ::postgres::Error> {
        // The version row's lock first, as every admin change takes it:
        // no deadlock with one that deletes a node updated here.
        tx.execute(
            "SELECT version FROM route_version WHERE id = 1 FOR UPDATE",
            &[],
        )?;
        let mut changed: Vec<ModuleId> = Vec::new();
        let update = tx.prepare(
            "UPDATE route_data SET consumed = LEAST(weight, consumed + $5)
              WHERE modid = $1 AND cmdid = $2 AND ip = $3 AND port = $4
                AND consumed < weight",
        )?;
        for &(module, node, units) in rows {
            let n = tx.execute(
                &update,
                &[
                    &i64::from(module.modid),
                    &i64::from(module.cmdid),
                    &i64::from(node.ip),
                    &i32::from(node.port),
                    &i64::from(units),
                ],
            )?;
            if n > 0 {
                changed.push(module);
            }
        }
        let nodes = changed.len();
        changed.sort_unstable();
        changed.dedup();
        let version = match changed.split_first() {
            None => tx
                .query_opt("SELECT version FROM route_version WHERE id = 1", &[])?
                .map_or(0, |r| int(&r, 0).max(0) as u64),
            Some((&first, rest)) => {
                let v = Self::bump(tx, first)?;
                for &m in rest {
                    Self::log_change(tx, v as i64, m)?;
                }
                v
            }
        };
        Ok(Consumed { version, nodes })
    }

    /// Runs `sql` on `node`'s row of `module` (`$1` to `$4` name it,
    /// `extra` binds `$5` on) and bumps the module's version, in one
    /// transaction; [`StoreError::NotFound`] (rolled back) when no row
    /// matched. Deleting a node and setting its meta.
    fn change_node(
        &mut self,
        module: ModuleId,
        node: NodeAddr,
        sql: &str,
        extra: &[&(dyn ::postgres::types::ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        let (url, lost) = (self.url.clone(), self.lost.clone());
        let un = |e: ::postgres::Error| unavailable(&url, &lost, &e);
        let mut tx = self.client()?.transaction().map_err(un)?;
        let v = Self::bump(&mut tx, module).map_err(un)?;
        let key = (
            i64::from(module.modid),
            i64::from(module.cmdid),
            i64::from(node.ip),
            i32::from(node.port),
        );
        let mut p: Vec<&(dyn ::postgres::types::ToSql + Sync)> =
            vec![&key.0, &key.1, &key.2, &key.3];
        p.extend_from_slice(extra);
        let changed = tx.execute(sql, &p).map_err(un)?;
        if changed == 0 {
            return Err(StoreError::NotFound { module, node }); // rolls back
        }
        tx.commit().map_err(un)?;
        Ok(v)
    }

    fn bump(tx: &mut Transaction<'_>, module: ModuleId) -> Result<u64, ::postgres::Error> {
        let row = tx.query_one(
            "INSERT INTO route_version (id, version)
                      VALUES (1, (SELECT COALESCE(MAX(version), 0) FROM route_change) + 1)
                 ON CONFLICT (id) DO UPDATE SET version = route_version.version + 1
                 RETURNING version",
            &[],
        )?;
        let v = int(&row, 0);
        Self::log_change(tx, v, module)?;
        notify(tx, v)?;
        Ok(v as u64)
    }

    /// Logs `module` as changed at version `v` (dropping its older
    /// entries), in `tx`.
    fn log_change(
        tx: &mut Transaction<'_>,
        v: i64,
        module: ModuleId,
    ) -> Result<(), ::postgres::Error> {
        let (modid, cmdid) = (i64::from(module.modid), i64::from(module.cmdid));
        tx.execute(
            "INSERT INTO route_change (version, modid, cmdid) VALUES ($1, $2, $3)",
            &[&v, &modid, &cmdid],
        )?;
        tx.execute(
            "DELETE FROM route_change WHERE modid = $1 AND cmdid = $2 AND version < $3",
            &[&modid, &cmdid, &v],
        )?;
        Ok(())
    }
}

/// Rows per array statement of an import.
const IMPORT_CHUNK: usize = 50_000;

/// The channel every route change is announced on (`NOTIFY`), with the
/// store's schema and the new route version as payload (`SCHEMA VERSION`).
/// Route servers `LISTEN` on it; the payload lets one ignore the changes
/// of stores in other schemas of the same database.
pub(crate) const CHANNEL: &str = "lbagent_route_change";

/// Announces route version `v` on [`CHANNEL`], in `tx`: PostgreSQL sends
/// it to the listeners when (and only if) the transaction commits.
fn notify(tx: &mut Transaction<'_>, v: i64) -> Result<(), ::postgres::Error> {
    tx.execute(
        "SELECT pg_notify($1, COALESCE(current_schema(), '') || ' ' || $2::BIGINT::TEXT)",
        &[&CHANNEL, &v],
    )?;
    Ok(())
}

/// Connects within the configured timeout, counting the whole start-up
/// (TCP, authentication), not only the TCP handshake that the crate's
/// `connect_timeout` bounds.
fn connect(config: &Config, tls: &Arc<Tls>, shown: &str) -> Result<Client, StoreError> {
    let fail = |why: String| StoreError::Unavailable {
        url: shown.to_string(),
        why,
    };
    let hung = HUNG_CONNECTS.load(Ordering::Relaxed);
    if hung >= MAX_HUNG_CONNECTS {
        return Err(fail(format!(
            "{hung} earlier connection attempts are still waiting for the server to answer"
        )));
    }
    let per_host = config
        .get_connect_timeout()
        .copied()
        .unwrap_or(CONNECT_TIMEOUT);
    let hosts = config.get_hosts().len().max(1) as u32;
    let deadline = per_host * hosts + Duration::from_secs(1);
    let (tx, rx) = mpsc::channel();
    // Set, under its lock, when this side gives up: the thread then counts
    // itself out of HUNG_CONNECTS instead of sending.
    let abandoned = Arc::new(Mutex::new(false));
    let config = config.clone();
    let connector = tls.connector.clone();
    let gone = abandoned.clone();
    std::thread::Builder::new()
        .name("lbagent-pg-connect".into())
        .spawn(move || {
            let result = match connector {
                Some(c) => config.connect(c),
                None => config.connect(NoTls),
            };
            let gone = gone.lock().unwrap_or_else(|p| p.into_inner());
            if *gone {
                HUNG_CONNECTS.fetch_sub(1, Ordering::Relaxed);
            } else {
                let _ = tx.send(result);
            }
        })
        .map_err(|e| fail(format!("cannot start a connection thread: {e}")))?;
    let result = match rx.recv_timeout(deadline) {
        Ok(result) => result,
        Err(_) => {
            let mut gone = abandoned.lock().unwrap_or_else(|p| p.into_inner());
            match rx.try_recv() {
                Ok(result) => result, // it answered just now
                Err(_) => {
                    *gone = true;
                    HUNG_CONNECTS.fetch_add(1, Ordering::Relaxed);
                    return Err(fail(format!(
                        "no answer within {} ms (connect_timeout {} s per host)",
                        deadline.as_millis(),
                        per_host.as_secs_f32()
                    )));
                }
            }
        }
    };
    result.map_err(|e| match tls.params.explain(&e) {
        Some(hint) => fail(format!("{hint} ({})", super::why(&e))),
        None => fail(super::why(&e)),
    })
}

/// Column `i` as an integer, whatever integer type a hand-edited table
/// gives it; `i64::MIN` (which every check refuses) for NULL or another
/// type, so that a bad row is skipped rather than a panic.
fn int(r: &::postgres::Row, i: usize) -> i64 {
    if let Ok(v) = r.try_get::<_, Option<i64>>(i) {
        return v.unwrap_or(i64::MIN);
    }
    if let Ok(v) = r.try_get::<_, Option<i32>>(i) {
        return v.map_or(i64::MIN, i64::from);
    }
    if let Ok(v) = r.try_get::<_, Option<i16>>(i) {
        return v.map_or(i64::MIN, i64::from);
    }
    i64::MIN
}

/// Column `i` as text: NULL, text, or (another type in a hand-edited
/// table) not text.
fn text(r: &::postgres::Row, i: usize) -> TextCol {
    match r.try_get::<_, Option<String>>(i) {
        Ok(None) => TextCol::Null,
        Ok(Some(s)) => TextCol::Text(s),
        Err(_) => TextCol::NotText,
    }
}

/// The schema version recorded in the store, 0 when it has none.
fn schema_version(c: &mut impl ::postgres::GenericClient) -> Result<u32, ::postgres::Error> {
    let exists: bool = c
        .query_one("SELECT to_regclass('schema_version') IS NOT NULL", &[])?
        .get(0);
    if !exists {
        return Ok(0);
    }
    let row = c.query_one("SELECT COALESCE(MAX(version), 0) FROM schema_version", &[])?;
    Ok(u32::try_from(int(&row, 0)).unwrap_or(u32::MAX))
}

impl Store for PostgresStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    fn set_policy(&mut self, module: ModuleId, policy: Policy) -> Result<u64, StoreError> {
        let (url, lost) = (self.url.clone(), self.lost.clone());
        let un = |e: ::postgres::Error| unavailable(&url, &lost, &e);
        let mut tx = self.client()?.transaction().map_err(un)?;
        let v = Self::bump(&mut tx, module).map_err(un)?;
        tx.execute(
            "INSERT INTO route_policy (modid, cmdid, policy) VALUES ($1, $2, $3)
             ON CONFLICT (modid, cmdid) DO UPDATE SET policy = excluded.policy",
            &[
                &i64::from(module.modid),
                &i64::from(module.cmdid),
                &i16::from(policy.code()),
            ],
        )
        .map_err(un)?;
        tx.commit().map_err(un)?;
        Ok(v)
    }

    fn set_options(&mut self, module: ModuleId, options: ModuleOptions) -> Result<u64, StoreError> {
        options
            .validate()
            .map_err(|e| StoreError::BadInput(e.to_string()))?;
        let (url, lost) = (self.url.clone(), self.lost.clone());
        let un = |e: ::postgres::Error| unavailable(&url, &lost, &e);
        let mut tx = self.client()?.transaction().map_err(un)?;
        let v = Self::bump(&mut tx, module).map_err(un)?;
        let small = |v: Option<u8>| v.map(i16::from);
        tx.execute(
            "INSERT INTO route_policy (modid, cmdid, policy, slow_start_ms,
                    max_overloaded_percent, panic_percent, locality_min_percent)
             VALUES ($1, $2, 0, $3, $4, $5, $6)
             ON CONFLICT (modid, cmdid) DO UPDATE SET
                slow_start_ms = excluded.slow_start_ms,
                max_overloaded_percent = excluded.max_overloaded_percent,
                panic_percent = excluded.panic_percent,
                locality_min_percent = excluded.locality_min_percent",
            &[
                &i64::from(module.modid),
                &i64::from(module.cmdid),
                &options.slow_start_ms.map(i64::from),
                &small(options.max_overloaded_percent),
                &small(options.panic_percent),
                &small(options.locality_min_percent),
            ],
        )
        .map_err(un)?;
        tx.commit().map_err(un)?;
        Ok(v)
    }

    fn consume(&mut self, rows: &[(ModuleId, NodeAddr, u32)]) -> Result<Consumed, StoreError> {
        check_consumed(rows)?;
        let (url, lost) = (self.url.clone(), self.lost.clone());
        let un = |e: ::postgres::Error| unavailable(&url, &lost, &e);
        let mut tx = self.client()?.transaction().map_err(un)?;
        let consumed = Self::apply_consumed(&mut tx, rows).map_err(un)?;
        tx.commit().map_err(un)?;
        Ok(consumed)
    }

    fn consume_once(
        &mut self,
        key: ReportKey,
        rows: &[(ModuleId, NodeAddr, u32)],
        now_s: u64,
    ) -> Result<Option<Consumed>, StoreError> {
        check_consumed(rows)?;
        let (url, lost) = (self.url.clone(), self.lost.clone());
        let un = |e: ::postgres::Error| unavailable(&url, &lost, &e);
        let mut tx = self.client()?.transaction().map_err(un)?;
        let (caller, agent_start, seq) = key.columns();
        let now = now_s.min(i64::MAX as u64) as i64;
        // Two reporters given the same re-sent report at once: the second
        // INSERT waits for the first transaction, then finds its row.
        let recorded = tx
            .execute(
                "INSERT INTO consumed_report (caller, agent_start, seq, at)
                 VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
                &[&caller, &agent_start, &seq, &now],
            )
            .map_err(un)?;
        if recorded == 0 {
            // Applied before: the transaction rolls back as it drops.
            return Ok(None);
        }
        let keep = CONSUMED_REPORT_KEEP_S as i64;
        tx.execute(
            "DELETE FROM consumed_report WHERE at < $1",
            &[&now.saturating_sub(keep)],
        )
        .map_err(un)?;
        let consumed = Self::apply_consumed(&mut tx, rows).map_err(un)?;
        tx.commit().map_err(un)?;
        Ok(Some(consumed))
    }

    fn route_version(&mut self) -> Result<u64, StoreError> {
        let (url, lost) = (self.url.clone(), self.lost.clone());
        let v: Option<i64> = self
            .client()?
            .query_opt("SELECT version FROM route_version WHERE id = 1", &[])
            .map_err(|e| unavailable(&url, &lost, &e))?
            .map(|r| int(&r, 0));
        version_of(&self.url, v)
    }

    fn load_all(&mut self) -> Result<RouteSet, StoreError> {
        let (version, modules) = self.read_routes(None, None)?;
        Ok(RouteSet { version, modules })
    }

    fn changes_since(&mut self, version: u64) -> Result<Changes, StoreError> {
        let (version, modules) = self.read_routes(None, Some(version))?;
        Ok(Changes { version, modules })
    }

    fn add_node_meta(
        &mut self,
        module: ModuleId,
        node: RouteNode,
        meta: &NodeMeta,
    ) -> Result<u64, StoreError> {
        let node = check_node(module, node)?;
        let (zone, labels) = meta_columns(meta);
        let (url, lost) = (self.url.clone(), self.lost.clone());
        let un = |e: ::postgres::Error| unavailable(&url, &lost, &e);
        let mut tx = self.client()?.transaction().map_err(un)?;
        // The version row first: admins queue here, whole.
        let v = Self::bump(&mut tx, module).map_err(un)?;
        let inserted = tx
            .execute(
                "INSERT INTO route_data (modid, cmdid, ip, port, weight, zone, labels)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)
                 ON CONFLICT (modid, cmdid, ip, port) DO NOTHING",
                &[
                    &i64::from(module.modid),
                    &i64::from(module.cmdid),
                    &i64::from(node.addr.ip),
                    &i32::from(node.addr.port),
                    &i64::from(node.weight),
                    &zone,
                    &labels,
                ],
            )
            .map_err(un)?;
        if inserted == 0 {
            return Err(StoreError::Duplicate {
                module,
                node: node.addr,
            }); // rolls back
        }
        tx.commit().map_err(un)?;
        Ok(v)
    }

    fn del_node(&mut self, module: ModuleId, node: NodeAddr) -> Result<u64, StoreError> {
        self.change_node(
            module,
            node,
            "DELETE FROM route_data WHERE modid = $1 AND cmdid = $2 AND ip = $3 AND port = $4",
            &[],
        )
    }

    fn set_meta(
        &mut self,
        module: ModuleId,
        node: NodeAddr,
        meta: &NodeMeta,
    ) -> Result<u64, StoreError> {
        let (zone, labels) = meta_columns(meta);
        self.change_node(
            module,
            node,
            "UPDATE route_data SET zone = $5, labels = $6
              WHERE modid = $1 AND cmdid = $2 AND ip = $3 AND port = $4",
            &[&zone, &labels],
        )
    }

    fn import_table(
        &mut self,
        rows: &[(ModuleId, RouteNode)],
        meta: &[TableMeta],
        replace: bool,
    ) -> Result<Imported, StoreError> {
        let prepared = prepare_import(rows, meta)?;
        let (rows, modules) = (&prepared.rows, &prepared.modules);
        if rows.is_empty() {
            let version = self.route_version()?;
            return Ok(Imported {
                version,
                modules: 0,
                nodes: 0,
            });
        }
        let m_modid: Vec<i64> = modules.iter().map(|m| i64::from(m.modid)).collect();
        let m_cmdid: Vec<i64> = modules.iter().map(|m| i64::from(m.cmdid)).collect();
        let (url, lost) = (self.url.clone(), self.lost.clone());
        let un = |e: ::postgres::Error| unavailable(&url, &lost, &e);
        let mut tx = self.client()?.transaction().map_err(un)?;
        // The version row first: admins queue here, whole.
        let row = tx
            .query_one(
                "INSERT INTO route_version (id, version)
                      VALUES (1, (SELECT COALESCE(MAX(version), 0) FROM route_change) + 1)
                 ON CONFLICT (id) DO UPDATE SET version = route_version.version + 1
                 RETURNING version",
                &[],
            )
            .map_err(un)?;
        let v = int(&row, 0);
        if replace {
            tx.execute(
                "DELETE FROM route_data d USING UNNEST($1::BIGINT[], $2::BIGINT[]) AS u(modid, cmdid)
                  WHERE d.modid = u.modid AND d.cmdid = u.cmdid",
                &[&m_modid, &m_cmdid],
            )
            .map_err(un)?;
        }
        // Array statements in chunks: a few round trips for a million rows.
        for chunk in rows.chunks(IMPORT_CHUNK) {
            let col =
                |f: fn(&(ModuleId, RouteNode)) -> i64| chunk.iter().map(f).collect::<Vec<i64>>();
            let modid = col(|r| i64::from(r.0.modid));
            let cmdid = col(|r| i64::from(r.0.cmdid));
            let ip = col(|r| i64::from(r.1.addr.ip));
            let port: Vec<i32> = chunk.iter().map(|r| i32::from(r.1.addr.port)).collect();
            let weight = col(|r| i64::from(super::stored_weight(r.1.weight).0));
            let consumed = col(|r| i64::from(super::stored_weight(r.1.weight).1));
            let (zone, labels): (Vec<Option<String>>, Vec<Option<String>>) = chunk
                .iter()
                .map(|r| prepared.columns(r.0, r.1.addr))
                .unzip();
            let inserted = tx
                .execute(
                    "INSERT INTO route_data (modid, cmdid, ip, port, weight, consumed, zone, labels)
                     SELECT * FROM UNNEST($1::BIGINT[], $2::BIGINT[], $3::BIGINT[], $4::INTEGER[], $5::BIGINT[], $6::BIGINT[], $7::TEXT[], $8::TEXT[])
                     ON CONFLICT (modid, cmdid, ip, port) DO NOTHING",
                    &[&modid, &cmdid, &ip, &port, &weight, &consumed, &zone, &labels],
                )
                .map_err(un)?;
            if inserted < chunk.len() as u64 {
                // Only without replace (the rows are distinct): a node the
                // store has. Roll back, then name one.
                drop(tx);
                return Err(self.duplicate_of(rows));
            }
        }
        tx.execute(
            "INSERT INTO route_change (version, modid, cmdid)
             SELECT $1, * FROM UNNEST($2::BIGINT[], $3::BIGINT[])",
            &[&v, &m_modid, &m_cmdid],
        )
        .map_err(un)?;
        tx.execute(
            "DELETE FROM route_change c USING UNNEST($1::BIGINT[], $2::BIGINT[]) AS u(modid, cmdid)
              WHERE c.modid = u.modid AND c.cmdid = u.cmdid AND c.version < $3",
            &[&m_modid, &m_cmdid, &v],
        )
        .map_err(un)?;
        notify(&mut tx, v).map_err(un)?;
        tx.commit().map_err(un)?;
        Ok(Imported {
            version: v as u64,
            modules: modules.len(),
            nodes: rows.len(),
        })
    }

    fn list(&mut self, module: Option<ModuleId>) -> Result<Vec<ModuleRoute>, StoreError> {
        Ok(self.read_routes(module, None)?.1)
    }

    fn upsert_status(&mut self, rows: &[CallStatus]) -> Result<(), StoreError> {
        let rows = prepare_status(rows)?;
        if rows.is_empty() {
            return Ok(());
        }
        let col = |f: fn(&CallStatus) -> i64| rows.iter().map(f).collect::<Vec<i64>>();
        let modid = col(|r| i64::from(r.module.modid));
        let cmdid = col(|r| i64::from(r.module.cmdid));
        let ip = col(|r| i64::from(r.node.ip));
        let port: Vec<i32> = rows.iter().map(|r| i32::from(r.node.port)).collect();
        let caller = col(|r| i64::from(r.caller));
        let succ = col(|r| i64::from(r.succ));
        let err = col(|r| i64::from(r.err));
        let ts = col(|r| r.ts as i64); // checked by prepare_status
        let overload: Vec<bool> = rows.iter().map(|r| r.overload).collect();
        // The bits of the agent's u64s (CallStatus::supersedes).
        let agent_start = col(|r| r.agent_start as i64);
        let seq = col(|r| r.seq as i64);
        let (url, lost) = (self.url.clone(), self.lost.clone());
        let un = |e: ::postgres::Error| unavailable(&url, &lost, &e);
        let mut tx = self.client()?.transaction().map_err(un)?;
        tx.execute(
            "INSERT INTO server_call_status
                 (modid, cmdid, ip, port, caller, succ_cnt, err_cnt, ts, overload, agent_start, seq)
             SELECT * FROM UNNEST($1::BIGINT[], $2::BIGINT[], $3::BIGINT[], $4::INTEGER[], $5::BIGINT[],
                                  $6::BIGINT[], $7::BIGINT[], $8::BIGINT[], $9::BOOLEAN[],
                                  $10::BIGINT[], $11::BIGINT[])
             ON CONFLICT (modid, cmdid, ip, port, caller) DO UPDATE SET
                 succ_cnt = excluded.succ_cnt, err_cnt = excluded.err_cnt,
                 ts = excluded.ts, overload = excluded.overload,
                 agent_start = excluded.agent_start, seq = excluded.seq
             WHERE NOT (excluded.agent_start <> 0
                        AND excluded.agent_start = server_call_status.agent_start
                        AND excluded.seq < server_call_status.seq)",
            &[
                &modid, &cmdid, &ip, &port, &caller, &succ, &err, &ts, &overload, &agent_start,
                &seq,
            ],
        )
        .map_err(un)?;
        tx.commit().map_err(un)
    }

    fn call_status(&mut self, module: Option<ModuleId>) -> Result<Vec<CallStatus>, StoreError> {
        let (url, lost) = (self.url.clone(), self.lost.clone());
        let un = |e: ::postgres::Error| unavailable(&url, &lost, &e);
        let (modid, cmdid) = match module {
            Some(m) => (Some(i64::from(m.modid)), Some(i64::from(m.cmdid))),
            None => (None, None),
        };
        let mut tx = self.read_tx()?;
        let rows = tx
            .query(
                "SELECT modid, cmdid, ip, port, caller, succ_cnt, err_cnt, ts, overload,
                        agent_start, seq
                   FROM server_call_status
                  WHERE $1::BIGINT IS NULL OR (modid = $1 AND cmdid = $2)",
                &[&modid, &cmdid],
            )
            .map_err(un)?
            .iter()
            .map(|r| StatusRow {
                modid: int(r, 0),
                cmdid: int(r, 1),
                ip: int(r, 2),
                port: int(r, 3),
                caller: int(r, 4),
                succ: int(r, 5),
                err: int(r, 6),
                ts: int(r, 7),
                overload: match r.try_get::<_, Option<bool>>(8) {
                    Ok(Some(b)) => i64::from(b),
                    _ => int(r, 8),
                },
                agent_start: int(r, 9),
                seq: int(r, 10),
            })
            .collect();
        tx.commit().map_err(un)?;
        Ok(self.bad.statuses(rows))
    }

    fn bad_rows(&self) -> u64 {
        self.bad.count()
    }

    fn wait_for_change(&mut self, timeout: Duration) -> Result<Wake, StoreError> {
        let (url, lost) = (self.url.clone(), self.lost.clone());
        let un = |e: ::postgres::Error| unavailable(&url, &lost, &e);
        self.client()?; // connected again first if it was lost
        let Some(schema) = self.listening.clone() else {
            self.client
                .batch_execute(&format!("LISTEN {CHANNEL}"))
                .map_err(un)?;
            let schema: String = self
                .client
                .query_one("SELECT COALESCE(current_schema(), '')::TEXT", &[])
                .map_err(un)?
                .get(0);
            self.listening = Some(schema);
            // A change may have committed before LISTEN took effect.
            return Ok(Wake::Changed);
        };
        let ours = |payload: &str| {
            payload
                .strip_prefix(schema.as_str())
                .is_some_and(|rest| rest.starts_with(' '))
        };
        let deadline = std::time::Instant::now() + timeout;
        let mut changed = false;
        {
            let mut notes = self.client.notifications();
            // Everything already buffered first, without waiting; then wait.
            while let Some(n) = notes.iter().next().map_err(un)? {
                changed |= ours(n.payload());
            }
            while !changed {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    break;
                }
                match notes.timeout_iter(left).next().map_err(un)? {
                    Some(n) => changed = ours(n.payload()),
                    None => break,
                }
            }
        }
        if self.client.is_closed() {
            self.lost.store(true, Ordering::Release);
            return Err(StoreError::Unavailable {
                url: self.url.clone(),
                why: "the connection closed while waiting for change notifications".into(),
            });
        }
        Ok(if changed { Wake::Changed } else { Wake::Quiet })
    }
}
