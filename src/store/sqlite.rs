//! The embedded store: one SQLite file through rusqlite's bundled library.
//!
//! The database runs in WAL mode, so a route server's reads never wait for
//! the reporter's or an admin's writes. Every write transaction starts with
//! `BEGIN IMMEDIATE` (it takes the write lock up front, so two writers
//! queue instead of failing on a lock upgrade) and waits up to
//! [`SQLITE_BUSY_TIMEOUT`] for it. Reads run in one deferred transaction:
//! one snapshot.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rusqlite::types::Value;
use rusqlite::{
    params, Connection, ErrorCode, OpenFlags, OptionalExtension, Row, Transaction,
    TransactionBehavior,
};

use super::migrations::{self, MIGRATIONS, SQLITE_SCHEMA_VERSION_TABLE};
use super::{
    assemble, check_consumed, check_node, meta_columns, prepare_import, prepare_status, version_of,
    BadRows, CallStatus, ChangeRow, Changes, Consumed, Imported, ModuleRoute, PolicyRow, ReportKey,
    RouteRow, RouteSet, StatusRow, Store, StoreError, TableMeta, TextCol, CONSUMED_REPORT_KEEP_S,
    SQLITE_BUSY_TIMEOUT,
};
use lbagent_model::{ModuleId, ModuleOptions, NodeAddr, NodeMeta, Policy, RouteNode};

/// One connection to a SQLite store.
///
/// It remembers which file it opened (device and inode): before every
/// transaction it checks that the path still names that file, so a
/// database deleted or replaced under a running server fails with
/// [`StoreError::Replaced`] instead of being read and written unseen.
pub(crate) struct SqliteStore {
    conn: Connection,
    url: String,
    bad: BadRows,
    path: PathBuf,
    /// (device, inode) of the file opened.
    file: (u64, u64),
}

impl SqliteStore {
    /// Opens the database at `path` and migrates it; `create`: creates
    /// the file and its directory when missing.
    pub(crate) fn open(path: &Path, create: bool) -> Result<Self, StoreError> {
        let url = format!("sqlite:{}", path.display());
        let fail = |why: String| StoreError::Unavailable {
            url: url.clone(),
            why,
        };
        let missing = || StoreError::Missing { url: url.clone() };
        if create {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .map_err(|e| fail(format!("cannot create directory {}: {e}", dir.display())))?;
            }
        } else if !path.exists() {
            return Err(missing());
        }
        if path.is_dir() {
            return Err(fail(format!(
                "{} is a directory, not a database file",
                path.display()
            )));
        }
        let mut flags = OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_URI
            | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        if create {
            flags |= OpenFlags::SQLITE_OPEN_CREATE;
        }
        let conn = Connection::open_with_flags(path, flags).map_err(|e| {
            if !create && !path.exists() {
                return missing();
            }
            fail(format!(
                "cannot open {}: {}",
                path.display(),
                super::why(&e)
            ))
        })?;
        let meta = std::fs::metadata(path)
            .map_err(|e| fail(format!("cannot stat {}: {e}", path.display())))?;
        let mut store = SqliteStore {
            conn,
            bad: BadRows::new(url.clone()),
            url,
            path: path.to_path_buf(),
            file: (meta.dev(), meta.ino()),
        };
        store
            .conn
            .busy_timeout(SQLITE_BUSY_TIMEOUT)
            .map_err(|e| store.unavailable(e))?;
        store.wal()?;
        store.migrate()?;
        Ok(store)
    }

    /// Whether the path still names the file this connection opened.
    ///
    /// # Errors
    /// [`StoreError::Replaced`] when it was deleted or now names another
    /// file; [`StoreError::Unavailable`] when it cannot be looked at.
    fn same_file(&self) -> Result<(), StoreError> {
        let replaced = |why: String| StoreError::Replaced {
            url: self.url.clone(),
            why,
        };
        match std::fs::metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == self.file => Ok(()),
            Ok(_) => Err(replaced(format!(
                "{} is now another file than the one opened (it was replaced)",
                self.path.display()
            ))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(replaced(format!(
                "{} was deleted while open",
                self.path.display()
            ))),
            Err(e) => Err(StoreError::Unavailable {
                url: self.url.clone(),
                why: format!("cannot stat {}: {e}", self.path.display()),
            }),
        }
    }

    fn unavailable(&self, e: rusqlite::Error) -> StoreError {
        StoreError::Unavailable {
            url: self.url.clone(),
            why: super::why(&e),
        }
    }

    /// Puts the database in WAL mode unless it is already. Switching needs
    /// an exclusive lock, and SQLite may refuse it without calling the busy
    /// handler, so this retries until the busy timeout.
    fn wal(&mut self) -> Result<(), StoreError> {
        let deadline = Instant::now() + SQLITE_BUSY_TIMEOUT;
        loop {
            let mode: Result<String, _> = self
                .conn
                .query_row("PRAGMA journal_mode", [], |r| r.get(0))
                .and_then(|m: String| {
                    if m.eq_ignore_ascii_case("wal") {
                        Ok(m)
                    } else {
                        self.conn
                            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
                    }
                });
            match mode {
                Ok(_) => return Ok(()),
                Err(e) if is_busy(&e) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(e) => return Err(self.unavailable(e)),
            }
        }
    }

    /// The schema version recorded in the store, 0 when it has none.
    fn schema_version(conn: &Connection) -> rusqlite::Result<u32> {
        let exists: bool = conn.query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version')",
            [],
            |r| r.get(0),
        )?;
        if !exists {
            return Ok(0);
        }
        let v: Option<i64> =
            conn.query_row("SELECT MAX(version) FROM schema_version", [], |r| r.get(0))?;
        Ok(v.map_or(0, |v| u32::try_from(v).unwrap_or(u32::MAX)))
    }

    fn too_new(&self, found: u32) -> StoreError {
        StoreError::SchemaTooNew {
            url: self.url.clone(),
            found,
            known: migrations::LATEST,
        }
    }

    fn migrate(&mut self) -> Result<(), StoreError> {
        // A current store is opened without taking the write lock.
        let found = Self::schema_version(&self.conn).map_err(|e| self.unavailable(e))?;
        if found > migrations::LATEST {
            return Err(self.too_new(found));
        }
        if found == migrations::LATEST {
            return Ok(());
        }
        let url = self.url.clone();
        let unavailable = |e: rusqlite::Error| StoreError::Unavailable {
            url: url.clone(),
            why: super::why(&e),
        };
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(unavailable)?;
        tx.execute_batch(SQLITE_SCHEMA_VERSION_TABLE)
            .map_err(unavailable)?;
        // Another process may have migrated while this one waited for the lock.
        let found = Self::schema_version(&tx).map_err(unavailable)?;
        if found > migrations::LATEST {
            return Err(StoreError::SchemaTooNew {
                url: url.clone(),
                found,
                known: migrations::LATEST,
            });
        }
        for m in MIGRATIONS.iter().filter(|m| m.version > found) {
            let failed = |e: rusqlite::Error| StoreError::Unavailable {
                url: url.clone(),
                why: format!(
                    "migration {} ({}) failed: {}",
                    m.version,
                    m.name,
                    super::why(&e)
                ),
            };
            tx.execute_batch(m.sqlite).map_err(failed)?;
            tx.execute(
                "INSERT INTO schema_version (version, name) VALUES (?1, ?2)",
                params![m.version, m.name],
            )
            .map_err(failed)?;
        }
        tx.commit().map_err(unavailable)
    }

    fn write_tx(&mut self) -> Result<Transaction<'_>, StoreError> {
        self.same_file()?;
        let url = self.url.clone();
        self.conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::Unavailable {
                url,
                why: super::why(&e),
            })
    }

    fn read_tx(&mut self) -> Result<Transaction<'_>, StoreError> {
        self.same_file()?;
        let url = self.url.clone();
        self.bad.start();
        self.conn
            .transaction_with_behavior(TransactionBehavior::Deferred)
            .map_err(|e| StoreError::Unavailable {
                url,
                why: super::why(&e),
            })
    }

    /// Routes, module versions and the route version, in one snapshot.
    /// `module`: one module only. `since`: only modules changed after that
    /// version (and those with no node left appear empty).
    fn read_routes(
        &mut self,
        module: Option<ModuleId>,
        since: Option<u64>,
    ) -> Result<(u64, Vec<ModuleRoute>), StoreError> {
        let url = self.url.clone();
        let un = |e: rusqlite::Error| StoreError::Unavailable {
            url: url.clone(),
            why: super::why(&e),
        };
        let tx = self.read_tx()?;
        let version: Option<i64> = tx
            .query_row("SELECT version FROM route_version WHERE id = 1", [], |r| {
                r.get(0)
            })
            .optional()
            .map_err(un)?;
        let (m_lo, m_hi, c_lo, c_hi) = match module {
            Some(m) => (
                i64::from(m.modid),
                i64::from(m.modid),
                i64::from(m.cmdid),
                i64::from(m.cmdid),
            ),
            None => (i64::MIN, i64::MAX, i64::MIN, i64::MAX),
        };
        let change_row = |v: &[i64]| ChangeRow {
            modid: v[0],
            cmdid: v[1],
            version: v[2],
        };
        let changes = match since {
            // The log's rows after `since` through its primary key, which
            // leads with the version (a module has one row: its latest
            // change). No GROUP BY: SQLite would then walk the module
            // index, every row of the log, to avoid a sort.
            Some(v) => query(
                &tx,
                "SELECT modid, cmdid, version FROM route_change WHERE version > ?1",
                params![i64::try_from(v).unwrap_or(i64::MAX)],
                change_row,
            ),
            None => query(
                &tx,
                "SELECT modid, cmdid, MAX(version) FROM route_change
                  WHERE modid BETWEEN ?1 AND ?2 AND cmdid BETWEEN ?3 AND ?4
                  GROUP BY modid, cmdid",
                params![m_lo, m_hi, c_lo, c_hi],
                change_row,
            ),
        }
        .map_err(un)?;
        let nodes = if since.is_some() {
            // Each changed module's rows through the primary key: the cost
            // is the change's, not the table's.
            let mut modules: Vec<(i64, i64)> = changes.iter().map(|c| (c.modid, c.cmdid)).collect();
            modules.sort_unstable();
            modules.dedup();
            let mut nodes = Vec::new();
            for (modid, cmdid) in modules {
                nodes.extend(
                    route_rows(
                        &tx,
                        "SELECT modid, cmdid, ip, port, weight - consumed, zone, labels
                           FROM route_data WHERE modid = ?1 AND cmdid = ?2",
                        params![modid, cmdid],
                    )
                    .map_err(un)?,
                );
            }
            nodes
        } else {
            route_rows(
                &tx,
                "SELECT modid, cmdid, ip, port, weight - consumed, zone, labels FROM route_data
                  WHERE modid BETWEEN ?1 AND ?2 AND cmdid BETWEEN ?3 AND ?4",
                params![m_lo, m_hi, c_lo, c_hi],
            )
            .map_err(un)?
        };
        let policies = query(
            &tx,
            "SELECT modid, cmdid, policy, slow_start_ms, max_overloaded_percent,
                    panic_percent, locality_min_percent FROM route_policy
              WHERE modid BETWEEN ?1 AND ?2 AND cmdid BETWEEN ?3 AND ?4",
            params![m_lo, m_hi, c_lo, c_hi],
            |v| PolicyRow {
                modid: v[0],
                cmdid: v[1],
                policy: v[2],
                slow_start_ms: v[3],
                max_overloaded_percent: v[4],
                panic_percent: v[5],
                locality_min_percent: v[6],
            },
        )
        .map_err(un)?;
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

    /// Bumps the route version and logs `module` as changed, in `tx`.
    /// Runs `sql` on `node`'s row of `module` (`?1` to `?4` name it,
    /// `extra` binds `?5` on) and bumps the module's version, in one
    /// transaction; [`StoreError::NotFound`] (nothing changed) when no row
    /// matched. Deleting a node and setting its meta.
    fn change_node(
        &mut self,
        module: ModuleId,
        node: NodeAddr,
        sql: &str,
        extra: &[&dyn rusqlite::ToSql],
    ) -> Result<u64, StoreError> {
        let url = self.url.clone();
        let un = |e: rusqlite::Error| StoreError::Unavailable {
            url: url.clone(),
            why: super::why(&e),
        };
        let tx = self.write_tx()?;
        let mut p: Vec<&dyn rusqlite::ToSql> =
            vec![&module.modid, &module.cmdid, &node.ip, &node.port];
        p.extend_from_slice(extra);
        let changed = tx.execute(sql, p.as_slice()).map_err(un)?;
        if changed == 0 {
            return Err(StoreError::NotFound { module, node });
        }
        let v = Self::bump(&tx, module).map_err(un)?;
        tx.commit().map_err(un)?;
        Ok(v)
    }

    fn bump(tx: &Transaction<'_>, module: ModuleId) -> rusqlite::Result<u64> {
        let v = Self::next_version(tx)?;
        Self::log_change(tx, v, module)?;
        Ok(v as u64)
    }

    /// Bumps the route version, in `tx`; returns the new one.
    /// Applies consumed units in `tx` (see [`Store::consume`]).
    fn apply_consumed(
        tx: &Transaction<'_>,
        rows: &[(ModuleId, NodeAddr, u32)],
    ) -> rusqlite::Result<Consumed> {
        let mut changed: Vec<ModuleId> = Vec::new();
        {
            let mut stmt = tx.prepare_cached(
                "UPDATE route_data SET consumed = MIN(weight, consumed + ?5)
                  WHERE modid = ?1 AND cmdid = ?2 AND ip = ?3 AND port = ?4
                    AND consumed < weight",
            )?;
            for &(module, node, units) in rows {
                let n = stmt.execute(params![
                    module.modid,
                    module.cmdid,
                    node.ip,
                    node.port,
                    units
                ])?;
                if n > 0 {
                    changed.push(module);
                }
            }
        }
        let nodes = changed.len();
        changed.sort_unstable();
        changed.dedup();
        let version = if changed.is_empty() {
            tx.query_row("SELECT version FROM route_version WHERE id = 1", [], |r| {
                r.get::<_, i64>(0)
            })
            .optional()?
            .unwrap_or(0) as u64
        } else {
            let v = Self::next_version(tx)?;
            for &m in &changed {
                Self::log_change(tx, v, m)?;
            }
            v as u64
        };
        Ok(Consumed { version, nodes })
    }

    fn next_version(tx: &Transaction<'_>) -> rusqlite::Result<i64> {
        tx.query_row(
            "INSERT INTO route_version (id, version)
                  VALUES (1, (SELECT COALESCE(MAX(version), 0) FROM route_change) + 1)
             ON CONFLICT (id) DO UPDATE SET version = route_version.version + 1
             RETURNING version",
            [],
            |r| r.get(0),
        )
    }

    /// Logs `module` as changed at version `v` (dropping its older
    /// entries), in `tx`.
    fn log_change(tx: &Transaction<'_>, v: i64, module: ModuleId) -> rusqlite::Result<()> {
        let (modid, cmdid) = (i64::from(module.modid), i64::from(module.cmdid));
        tx.prepare_cached("INSERT INTO route_change (version, modid, cmdid) VALUES (?1, ?2, ?3)")?
            .execute(params![v, modid, cmdid])?;
        tx.prepare_cached(
            "DELETE FROM route_change WHERE modid = ?1 AND cmdid = ?2 AND version < ?3",
        )?
        .execute(params![modid, cmdid, v])?;
        Ok(())
    }
}

/// Runs `sql`, which selects `modid, cmdid, ip, port, weight, zone,
/// labels`, and reads every row.
fn route_rows(
    tx: &Transaction<'_>,
    sql: &str,
    params: impl rusqlite::Params,
) -> rusqlite::Result<Vec<RouteRow>> {
    let mut stmt = tx.prepare_cached(sql)?;
    let mut rows = stmt.query(params)?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        out.push(RouteRow {
            modid: int(row, 0)?,
            cmdid: int(row, 1)?,
            ip: int(row, 2)?,
            port: int(row, 3)?,
            weight: int(row, 4)?,
            zone: text(row, 5)?,
            labels: text(row, 6)?,
        });
    }
    Ok(out)
}

fn text(row: &Row<'_>, i: usize) -> rusqlite::Result<TextCol> {
    Ok(match row.get::<_, Value>(i)? {
        Value::Null => TextCol::Null,
        Value::Text(s) => TextCol::Text(s),
        _ => TextCol::NotText,
    })
}

fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
    )
}

/// Runs `sql` and maps every row's integer columns through `make`. A
/// column that does not hold an integer (possible only around the STRICT
/// tables) reads as `i64::MIN`, which every check refuses.
fn query<T>(
    tx: &Transaction<'_>,
    sql: &str,
    params: impl rusqlite::Params,
    make: impl Fn(&[i64]) -> T,
) -> rusqlite::Result<Vec<T>> {
    let mut stmt = tx.prepare_cached(sql)?;
    let n = stmt.column_count();
    let mut rows = stmt.query(params)?;
    let mut out = Vec::new();
    let mut cols = vec![0i64; n];
    while let Some(row) = rows.next()? {
        for (i, c) in cols.iter_mut().enumerate() {
            *c = int(row, i)?;
        }
        out.push(make(&cols));
    }
    Ok(out)
}

fn int(row: &Row<'_>, i: usize) -> rusqlite::Result<i64> {
    Ok(match row.get::<_, Value>(i)? {
        Value::Integer(v) => v,
        _ => i64::MIN,
    })
}

impl Store for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    fn route_version(&mut self) -> Result<u64, StoreError> {
        self.same_file()?;
        // Through a statement prepared once per connection: the route
        // server calls this every poll (tens of milliseconds).
        let v: Option<i64> = self
            .conn
            .prepare_cached("SELECT version FROM route_version WHERE id = 1")
            .and_then(|mut stmt| stmt.query_row([], |r| r.get(0)).optional())
            .map_err(|e| self.unavailable(e))?;
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
        let url = self.url.clone();
        let un = |e: rusqlite::Error| StoreError::Unavailable {
            url: url.clone(),
            why: super::why(&e),
        };
        let tx = self.write_tx()?;
        let inserted = tx
            .execute(
                "INSERT INTO route_data (modid, cmdid, ip, port, weight, zone, labels)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
                 ON CONFLICT (modid, cmdid, ip, port) DO NOTHING",
                params![
                    module.modid,
                    module.cmdid,
                    node.addr.ip,
                    node.addr.port,
                    node.weight,
                    zone,
                    labels
                ],
            )
            .map_err(un)?;
        if inserted == 0 {
            return Err(StoreError::Duplicate {
                module,
                node: node.addr,
            });
        }
        let v = Self::bump(&tx, module).map_err(un)?;
        tx.commit().map_err(un)?;
        Ok(v)
    }

    fn del_node(&mut self, module: ModuleId, node: NodeAddr) -> Result<u64, StoreError> {
        self.change_node(
            module,
            node,
            "DELETE FROM route_data WHERE modid = ?1 AND cmdid = ?2 AND ip = ?3 AND port = ?4",
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
            "UPDATE route_data SET zone = ?5, labels = ?6
              WHERE modid = ?1 AND cmdid = ?2 AND ip = ?3 AND port = ?4",
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
        let url = self.url.clone();
        let un = |e: rusqlite::Error| StoreError::Unavailable {
            url: url.clone(),
            why: super::why(&e),
        };
        let tx = self.write_tx()?;
        let v = Self::next_version(&tx).map_err(un)?;
        if replace {
            let mut del = tx
                .prepare_cached("DELETE FROM route_data WHERE modid = ?1 AND cmdid = ?2")
                .map_err(un)?;
            for m in modules {
                del.execute(params![m.modid, m.cmdid]).map_err(un)?;
            }
        }
        {
            let mut ins = tx
                .prepare_cached(
                    "INSERT INTO route_data (modid, cmdid, ip, port, weight, consumed, zone, labels)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                     ON CONFLICT (modid, cmdid, ip, port) DO NOTHING",
                )
                .map_err(un)?;
            for (m, n) in rows {
                let (weight, consumed) = super::stored_weight(n.weight);
                let (zone, labels) = prepared.columns(*m, n.addr);
                let inserted = ins
                    .execute(params![
                        m.modid,
                        m.cmdid,
                        n.addr.ip,
                        n.addr.port,
                        weight,
                        consumed,
                        zone,
                        labels
                    ])
                    .map_err(un)?;
                if inserted == 0 {
                    // Only without replace: the rows are distinct.
                    return Err(StoreError::Duplicate {
                        module: *m,
                        node: n.addr,
                    }); // rolls back
                }
            }
        }
        for m in modules {
            Self::log_change(&tx, v, *m).map_err(un)?;
        }
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

    fn set_policy(&mut self, module: ModuleId, policy: Policy) -> Result<u64, StoreError> {
        let url = self.url.clone();
        let un = |e: rusqlite::Error| StoreError::Unavailable {
            url: url.clone(),
            why: super::why(&e),
        };
        let tx = self.write_tx()?;
        tx.execute(
            "INSERT INTO route_policy (modid, cmdid, policy) VALUES (?1, ?2, ?3)
             ON CONFLICT (modid, cmdid) DO UPDATE SET policy = excluded.policy",
            params![module.modid, module.cmdid, policy.code()],
        )
        .map_err(un)?;
        let v = Self::bump(&tx, module).map_err(un)?;
        tx.commit().map_err(un)?;
        Ok(v)
    }

    fn set_options(&mut self, module: ModuleId, options: ModuleOptions) -> Result<u64, StoreError> {
        options
            .validate()
            .map_err(|e| StoreError::BadInput(e.to_string()))?;
        let url = self.url.clone();
        let un = |e: rusqlite::Error| StoreError::Unavailable {
            url: url.clone(),
            why: super::why(&e),
        };
        let tx = self.write_tx()?;
        tx.execute(
            "INSERT INTO route_policy (modid, cmdid, policy, slow_start_ms,
                    max_overloaded_percent, panic_percent, locality_min_percent)
             VALUES (?1, ?2, 0, ?3, ?4, ?5, ?6)
             ON CONFLICT (modid, cmdid) DO UPDATE SET
                slow_start_ms = excluded.slow_start_ms,
                max_overloaded_percent = excluded.max_overloaded_percent,
                panic_percent = excluded.panic_percent,
                locality_min_percent = excluded.locality_min_percent",
            params![
                module.modid,
                module.cmdid,
                options.slow_start_ms,
                options.max_overloaded_percent,
                options.panic_percent,
                options.locality_min_percent
            ],
        )
        .map_err(un)?;
        let v = Self::bump(&tx, module).map_err(un)?;
        tx.commit().map_err(un)?;
        Ok(v)
    }

    fn consume(&mut self, rows: &[(ModuleId, NodeAddr, u32)]) -> Result<Consumed, StoreError> {
        check_consumed(rows)?;
        let url = self.url.clone();
        let un = |e: rusqlite::Error| StoreError::Unavailable {
            url: url.clone(),
            why: super::why(&e),
        };
        let tx = self.write_tx()?;
        let consumed = Self::apply_consumed(&tx, rows).map_err(un)?;
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
        let url = self.url.clone();
        let un = |e: rusqlite::Error| StoreError::Unavailable {
            url: url.clone(),
            why: super::why(&e),
        };
        let tx = self.write_tx()?;
        let (caller, agent_start, seq) = key.columns();
        let now = now_s.min(i64::MAX as u64) as i64;
        let recorded = tx
            .prepare_cached(
                "INSERT INTO consumed_report (caller, agent_start, seq, at)
                 VALUES (?1, ?2, ?3, ?4) ON CONFLICT DO NOTHING",
            )
            .and_then(|mut stmt| stmt.execute(params![caller, agent_start, seq, now]))
            .map_err(un)?;
        if recorded == 0 {
            // Applied before: the transaction rolls back as it drops.
            return Ok(None);
        }
        let keep = CONSUMED_REPORT_KEEP_S as i64;
        tx.prepare_cached("DELETE FROM consumed_report WHERE at < ?1")
            .and_then(|mut stmt| stmt.execute(params![now.saturating_sub(keep)]))
            .map_err(un)?;
        let consumed = Self::apply_consumed(&tx, rows).map_err(un)?;
        tx.commit().map_err(un)?;
        Ok(Some(consumed))
    }

    fn upsert_status(&mut self, rows: &[CallStatus]) -> Result<(), StoreError> {
        let rows = prepare_status(rows)?;
        if rows.is_empty() {
            return Ok(());
        }
        let url = self.url.clone();
        let un = |e: rusqlite::Error| StoreError::Unavailable {
            url: url.clone(),
            why: super::why(&e),
        };
        let tx = self.write_tx()?;
        {
            let mut stmt = tx
                .prepare_cached(
                    "INSERT INTO server_call_status
                         (modid, cmdid, ip, port, caller, succ_cnt, err_cnt, ts, overload,
                          agent_start, seq)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
                     ON CONFLICT (modid, cmdid, ip, port, caller) DO UPDATE SET
                         succ_cnt = excluded.succ_cnt, err_cnt = excluded.err_cnt,
                         ts = excluded.ts, overload = excluded.overload,
                         agent_start = excluded.agent_start, seq = excluded.seq
                     WHERE NOT (excluded.agent_start <> 0
                                AND excluded.agent_start = server_call_status.agent_start
                                AND excluded.seq < server_call_status.seq)",
                )
                .map_err(un)?;
            for r in &rows {
                stmt.execute(params![
                    r.module.modid,
                    r.module.cmdid,
                    r.node.ip,
                    r.node.port,
                    r.caller,
                    r.succ,
                    r.err,
                    r.ts as i64, // checked by prepare_status
                    i64::from(r.overload),
                    // The bits of the agent's u64s (CallStatus::supersedes).
                    r.agent_start as i64,
                    r.seq as i64,
                ])
                .map_err(un)?;
            }
        }
        tx.commit().map_err(un)
    }

    fn call_status(&mut self, module: Option<ModuleId>) -> Result<Vec<CallStatus>, StoreError> {
        let url = self.url.clone();
        let un = |e: rusqlite::Error| StoreError::Unavailable {
            url: url.clone(),
            why: super::why(&e),
        };
        let (m_lo, m_hi, c_lo, c_hi) = match module {
            Some(m) => (
                i64::from(m.modid),
                i64::from(m.modid),
                i64::from(m.cmdid),
                i64::from(m.cmdid),
            ),
            None => (i64::MIN, i64::MAX, i64::MIN, i64::MAX),
        };
        let tx = self.read_tx()?;
        let rows = query(
            &tx,
            "SELECT modid, cmdid, ip, port, caller, succ_cnt, err_cnt, ts, overload,
                    agent_start, seq
               FROM server_call_status
              WHERE modid BETWEEN ?1 AND ?2 AND cmdid BETWEEN ?3 AND ?4",
            params![m_lo, m_hi, c_lo, c_hi],
            |v| StatusRow {
                modid: v[0],
                cmdid: v[1],
                ip: v[2],
                port: v[3],
                caller: v[4],
                succ: v[5],
                err: v[6],
                ts: v[7],
                overload: v[8],
                agent_start: v[9],
                seq: v[10],
            },
        )
        .map_err(un)?;
        tx.commit().map_err(un)?;
        Ok(self.bad.statuses(rows))
    }

    fn bad_rows(&self) -> u64 {
        self.bad.count()
    }
}
