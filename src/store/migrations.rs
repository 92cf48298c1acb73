//! The schema's versioned migrations, SQL per backend.
//!
//! [`MIGRATIONS`] lists every schema version in order; the store's
//! `schema_version` table records which ones ran (one row each). `open`
//! applies the missing ones in one transaction, under a lock, so several
//! processes opening a new store at once create it exactly once. A store
//! whose `schema_version` names a version above [`LATEST`] is refused.
//!
//! Never edit a migration that has shipped: add the next one.
//!
//! # The schema (version 1), after the original's `dnsserver.sql`
//!
//! Every `u32` of the model (modid, cmdid, IPv4 address in host byte order,
//! caller, counts) is an integer column checked to `0..=4294967295`:
//! PostgreSQL has no unsigned types, so those are `BIGINT` there. Ports are
//! checked to `1..=65535`, weights to `1..=1000000` ([`super::MAX_WEIGHT`]).
//! SQLite tables are `STRICT`, so a column holds an integer or nothing.
//!
//! - `route_data (modid, cmdid, ip, port, weight)`, keyed by
//!   (modid, cmdid, ip, port).
//! - `route_version (id = 1, version)`: the route version, one row.
//! - `route_change (version, modid, cmdid)`: the change log. Each admin
//!   change appends its module with the new route version, and deletes that
//!   module's older entries in the same transaction: only a module's latest
//!   change matters to readers (`changes_since`, module versions), and the
//!   log stays as small as the number of modules ever changed.
//! - `server_call_status (modid, cmdid, ip, port, caller, succ_cnt, err_cnt,
//!   ts, overload)`, keyed by (modid, cmdid, ip, port, caller).
//!
//! # Version 2: the balance policy (issue 13)
//!
//! - `route_policy (modid, cmdid, policy)`: a module's policy, 0 = `l5`
//!   (also what a module without a row has), 1 = `balance`. Setting it is a
//!   versioned change like a node's.
//! - `route_data.consumed`: capacity units reported consumed for good, at
//!   most the node's weight (the store keeps `consumed <= weight`). The
//!   route server serves `weight - consumed`, the capacity left.
//!
//! # Version 3: consumed units exactly once (issue 32)
//!
//! - `consumed_report (caller, agent_start, seq, at)`: the reports whose
//!   consumed units were applied, keyed by who sent them (the caller, the
//!   agent's run number, the report's sequence number), with when (Unix
//!   seconds). [`crate::Store::consume_once`] records its report in the
//!   transaction that applies its units, so a re-sent report is applied
//!   once; rows older than [`crate::CONSUMED_REPORT_KEEP_S`] are deleted
//!   as new ones come.
//!
//! # Version 4: module options and `p2c` (issue 31)
//!
//! - `route_policy.policy` also takes 2 = `p2c` (SQLite: the table is
//!   made again with the wider check, its rows copied).
//! - `route_policy.slow_start_ms`, `max_overloaded_percent`,
//!   `panic_percent`, `locality_min_percent`: a module's own options,
//!   NULL where it keeps the agent's default. A module with options and
//!   no policy set has a row with policy 0 (`l5`).
//!
//! # Version 5: the newest report wins (issue 32)
//!
//! - `server_call_status.agent_start`, `server_call_status.seq`: the agent
//!   run and the report that carried the row (the bits of the wire's
//!   `u64`s; 0 and 0 for rows written before, or by a reporter that does
//!   not know the columns). An upsert does not replace a row with one
//!   from an earlier report of the same run
//!   ([`crate::CallStatus::supersedes`]). Readers that predate the columns
//!   still read and write the table (the columns have defaults).
//!
//! # Version 6: a node's zone and labels (issue 31)
//!
//! - `route_data.zone`: the node's zone, NULL for none (1 to 63 bytes of
//!   `A-Z a-z 0-9 . _ -`; the model checks the charset on the way in and
//!   on the way out, the column only its length).
//! - `route_data.labels`: its labels as `k=v,k2=v2`, sorted by key, NULL
//!   for none (at most 16; bounded to 2,047 characters by the column).

/// One schema version: what it does and its SQL for each backend.
pub(crate) struct Migration {
    /// The schema version this migration brings the store to.
    pub version: u32,
    /// A short name, recorded in `schema_version`.
    pub name: &'static str,
    /// The statements for SQLite.
    pub sqlite: &'static str,
    /// The statements for PostgreSQL.
    pub postgres: &'static str,
}

/// The newest schema version this binary knows.
pub const LATEST: u32 = 6;

/// `schema_version` itself, created before any migration runs (SQLite).
pub(crate) const SQLITE_SCHEMA_VERSION_TABLE: &str = "CREATE TABLE IF NOT EXISTS schema_version (
    version    INTEGER PRIMARY KEY,
    name       TEXT NOT NULL,
    applied_at INTEGER NOT NULL DEFAULT (CAST(strftime('%s', 'now') AS INTEGER))
)";

/// `schema_version` itself, created before any migration runs (PostgreSQL).
pub(crate) const POSTGRES_SCHEMA_VERSION_TABLE: &str = "CREATE TABLE IF NOT EXISTS schema_version (
    version    INTEGER PRIMARY KEY,
    name       TEXT NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
)";

/// Every migration, in order: `MIGRATIONS[i].version == i + 1`.
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
    version: 1,
    name: "routes, route version, change log, call status",
    sqlite: "
CREATE TABLE route_data (
    modid  INTEGER NOT NULL CONSTRAINT route_data_modid_check  CHECK (modid BETWEEN 0 AND 4294967295),
    cmdid  INTEGER NOT NULL CONSTRAINT route_data_cmdid_check  CHECK (cmdid BETWEEN 0 AND 4294967295),
    ip     INTEGER NOT NULL CONSTRAINT route_data_ip_check     CHECK (ip BETWEEN 0 AND 4294967295),
    port   INTEGER NOT NULL CONSTRAINT route_data_port_check   CHECK (port BETWEEN 1 AND 65535),
    weight INTEGER NOT NULL DEFAULT 1 CONSTRAINT route_data_weight_check CHECK (weight BETWEEN 1 AND 1000000),
    PRIMARY KEY (modid, cmdid, ip, port)
) STRICT;

CREATE TABLE route_version (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    version INTEGER NOT NULL CONSTRAINT route_version_version_check CHECK (version >= 0)
) STRICT;
INSERT INTO route_version (id, version) VALUES (1, 0);

CREATE TABLE route_change (
    version INTEGER NOT NULL CONSTRAINT route_change_version_check CHECK (version >= 1),
    modid   INTEGER NOT NULL CONSTRAINT route_change_modid_check   CHECK (modid BETWEEN 0 AND 4294967295),
    cmdid   INTEGER NOT NULL CONSTRAINT route_change_cmdid_check   CHECK (cmdid BETWEEN 0 AND 4294967295),
    PRIMARY KEY (version, modid, cmdid)
) STRICT;
CREATE INDEX route_change_module ON route_change (modid, cmdid, version);

CREATE TABLE server_call_status (
    modid    INTEGER NOT NULL CONSTRAINT server_call_status_modid_check    CHECK (modid BETWEEN 0 AND 4294967295),
    cmdid    INTEGER NOT NULL CONSTRAINT server_call_status_cmdid_check    CHECK (cmdid BETWEEN 0 AND 4294967295),
    ip       INTEGER NOT NULL CONSTRAINT server_call_status_ip_check       CHECK (ip BETWEEN 0 AND 4294967295),
    port     INTEGER NOT NULL CONSTRAINT server_call_status_port_check     CHECK (port BETWEEN 1 AND 65535),
    caller   INTEGER NOT NULL CONSTRAINT server_call_status_caller_check   CHECK (caller BETWEEN 0 AND 4294967295),
    succ_cnt INTEGER NOT NULL CONSTRAINT server_call_status_succ_cnt_check CHECK (succ_cnt BETWEEN 0 AND 4294967295),
    err_cnt  INTEGER NOT NULL CONSTRAINT server_call_status_err_cnt_check  CHECK (err_cnt BETWEEN 0 AND 4294967295),
    ts       INTEGER NOT NULL CONSTRAINT server_call_status_ts_check       CHECK (ts >= 0),
    overload INTEGER NOT NULL CONSTRAINT server_call_status_overload_check CHECK (overload IN (0, 1)),
    PRIMARY KEY (modid, cmdid, ip, port, caller)
) STRICT;
",
    postgres: "
CREATE TABLE route_data (
    modid  BIGINT  NOT NULL CONSTRAINT route_data_modid_check  CHECK (modid BETWEEN 0 AND 4294967295),
    cmdid  BIGINT  NOT NULL CONSTRAINT route_data_cmdid_check  CHECK (cmdid BETWEEN 0 AND 4294967295),
    ip     BIGINT  NOT NULL CONSTRAINT route_data_ip_check     CHECK (ip BETWEEN 0 AND 4294967295),
    port   INTEGER NOT NULL CONSTRAINT route_data_port_check   CHECK (port BETWEEN 1 AND 65535),
    weight BIGINT  NOT NULL DEFAULT 1 CONSTRAINT route_data_weight_check CHECK (weight BETWEEN 1 AND 1000000),
    PRIMARY KEY (modid, cmdid, ip, port)
);

CREATE TABLE route_version (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    version BIGINT NOT NULL CONSTRAINT route_version_version_check CHECK (version >= 0)
);
INSERT INTO route_version (id, version) VALUES (1, 0);

CREATE TABLE route_change (
    version BIGINT NOT NULL CONSTRAINT route_change_version_check CHECK (version >= 1),
    modid   BIGINT NOT NULL CONSTRAINT route_change_modid_check   CHECK (modid BETWEEN 0 AND 4294967295),
    cmdid   BIGINT NOT NULL CONSTRAINT route_change_cmdid_check   CHECK (cmdid BETWEEN 0 AND 4294967295),
    PRIMARY KEY (version, modid, cmdid)
);
CREATE INDEX route_change_module ON route_change (modid, cmdid, version);

CREATE TABLE server_call_status (
    modid    BIGINT  NOT NULL CONSTRAINT server_call_status_modid_check    CHECK (modid BETWEEN 0 AND 4294967295),
    cmdid    BIGINT  NOT NULL CONSTRAINT server_call_status_cmdid_check    CHECK (cmdid BETWEEN 0 AND 4294967295),
    ip       BIGINT  NOT NULL CONSTRAINT server_call_status_ip_check       CHECK (ip BETWEEN 0 AND 4294967295),
    port     INTEGER NOT NULL CONSTRAINT server_call_status_port_check     CHECK (port BETWEEN 1 AND 65535),
    caller   BIGINT  NOT NULL CONSTRAINT server_call_status_caller_check   CHECK (caller BETWEEN 0 AND 4294967295),
    succ_cnt BIGINT  NOT NULL CONSTRAINT server_call_status_succ_cnt_check CHECK (succ_cnt BETWEEN 0 AND 4294967295),
    err_cnt  BIGINT  NOT NULL CONSTRAINT server_call_status_err_cnt_check  CHECK (err_cnt BETWEEN 0 AND 4294967295),
    ts       BIGINT  NOT NULL CONSTRAINT server_call_status_ts_check       CHECK (ts >= 0),
    overload BOOLEAN NOT NULL,
    PRIMARY KEY (modid, cmdid, ip, port, caller)
);
",
    },
    Migration {
        version: 2,
        name: "module policy, consumed capacity",
        sqlite: "
CREATE TABLE route_policy (
    modid  INTEGER NOT NULL CONSTRAINT route_policy_modid_check  CHECK (modid BETWEEN 0 AND 4294967295),
    cmdid  INTEGER NOT NULL CONSTRAINT route_policy_cmdid_check  CHECK (cmdid BETWEEN 0 AND 4294967295),
    policy INTEGER NOT NULL CONSTRAINT route_policy_policy_check CHECK (policy IN (0, 1)),
    PRIMARY KEY (modid, cmdid)
) STRICT;
ALTER TABLE route_data ADD COLUMN consumed INTEGER NOT NULL DEFAULT 0
    CONSTRAINT route_data_consumed_check CHECK (consumed BETWEEN 0 AND 1000000);
",
        postgres: "
CREATE TABLE route_policy (
    modid  BIGINT   NOT NULL CONSTRAINT route_policy_modid_check  CHECK (modid BETWEEN 0 AND 4294967295),
    cmdid  BIGINT   NOT NULL CONSTRAINT route_policy_cmdid_check  CHECK (cmdid BETWEEN 0 AND 4294967295),
    policy SMALLINT NOT NULL CONSTRAINT route_policy_policy_check CHECK (policy IN (0, 1)),
    PRIMARY KEY (modid, cmdid)
);
ALTER TABLE route_data ADD COLUMN consumed BIGINT NOT NULL DEFAULT 0
    CONSTRAINT route_data_consumed_check CHECK (consumed BETWEEN 0 AND 1000000);
",
    },
    // === issue 32: consumed units exactly once (the fleetfix block) ===
    Migration {
        version: 3,
        name: "reports whose consumed units were applied",
        sqlite: "
CREATE TABLE consumed_report (
    caller      INTEGER NOT NULL CONSTRAINT consumed_report_caller_check CHECK (caller BETWEEN 0 AND 4294967295),
    agent_start INTEGER NOT NULL,
    seq         INTEGER NOT NULL,
    at          INTEGER NOT NULL,
    PRIMARY KEY (caller, agent_start, seq)
) STRICT;
CREATE INDEX consumed_report_at ON consumed_report (at);
",
        postgres: "
CREATE TABLE consumed_report (
    caller      BIGINT NOT NULL CONSTRAINT consumed_report_caller_check CHECK (caller BETWEEN 0 AND 4294967295),
    agent_start BIGINT NOT NULL,
    seq         BIGINT NOT NULL,
    at          BIGINT NOT NULL,
    PRIMARY KEY (caller, agent_start, seq)
);
CREATE INDEX consumed_report_at ON consumed_report (at);
",
    },
    // --- issue 31 (module options) ---
    Migration {
        version: 4,
        name: "module options, p2c policy",
        sqlite: "
CREATE TABLE route_policy_v3 (
    modid  INTEGER NOT NULL CONSTRAINT route_policy_modid_check  CHECK (modid BETWEEN 0 AND 4294967295),
    cmdid  INTEGER NOT NULL CONSTRAINT route_policy_cmdid_check  CHECK (cmdid BETWEEN 0 AND 4294967295),
    policy INTEGER NOT NULL CONSTRAINT route_policy_policy_check CHECK (policy IN (0, 1, 2)),
    slow_start_ms          INTEGER CONSTRAINT route_policy_slow_start_check CHECK (slow_start_ms BETWEEN 0 AND 4294967295),
    max_overloaded_percent INTEGER CONSTRAINT route_policy_max_overloaded_check CHECK (max_overloaded_percent BETWEEN 1 AND 100),
    panic_percent          INTEGER CONSTRAINT route_policy_panic_check CHECK (panic_percent BETWEEN 0 AND 100),
    locality_min_percent   INTEGER CONSTRAINT route_policy_locality_check CHECK (locality_min_percent BETWEEN 0 AND 100),
    PRIMARY KEY (modid, cmdid)
) STRICT;
INSERT INTO route_policy_v3 (modid, cmdid, policy) SELECT modid, cmdid, policy FROM route_policy;
DROP TABLE route_policy;
ALTER TABLE route_policy_v3 RENAME TO route_policy;
",
        postgres: "
ALTER TABLE route_policy DROP CONSTRAINT route_policy_policy_check;
ALTER TABLE route_policy ADD CONSTRAINT route_policy_policy_check CHECK (policy IN (0, 1, 2));
ALTER TABLE route_policy
    ADD COLUMN slow_start_ms BIGINT
        CONSTRAINT route_policy_slow_start_check CHECK (slow_start_ms BETWEEN 0 AND 4294967295),
    ADD COLUMN max_overloaded_percent SMALLINT
        CONSTRAINT route_policy_max_overloaded_check CHECK (max_overloaded_percent BETWEEN 1 AND 100),
    ADD COLUMN panic_percent SMALLINT
        CONSTRAINT route_policy_panic_check CHECK (panic_percent BETWEEN 0 AND 100),
    ADD COLUMN locality_min_percent SMALLINT
        CONSTRAINT route_policy_locality_check CHECK (locality_min_percent BETWEEN 0 AND 100);
",
    },
    // --- end issue 31 ---
    // === issue 32: a re-sent older report never replaces a newer row ===
    Migration {
        version: 5,
        name: "call status: the report that carried each row",
        sqlite: "
ALTER TABLE server_call_status ADD COLUMN agent_start INTEGER NOT NULL DEFAULT 0;
ALTER TABLE server_call_status ADD COLUMN seq INTEGER NOT NULL DEFAULT 0;
",
        postgres: "
ALTER TABLE server_call_status
    ADD COLUMN agent_start BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN seq BIGINT NOT NULL DEFAULT 0;
",
    },
    // --- end issue 32 (report order) ---
    // --- issue 31: zones and labels in the store (the meta block) ---
    Migration {
        version: 6,
        name: "node zone and labels",
        sqlite: "
ALTER TABLE route_data ADD COLUMN zone TEXT
    CONSTRAINT route_data_zone_check CHECK (zone IS NULL OR length(zone) BETWEEN 1 AND 63);
ALTER TABLE route_data ADD COLUMN labels TEXT
    CONSTRAINT route_data_labels_check CHECK (labels IS NULL OR length(labels) BETWEEN 1 AND 2047);
",
        postgres: "
ALTER TABLE route_data
    ADD COLUMN zone TEXT
        CONSTRAINT route_data_zone_check CHECK (zone IS NULL OR length(zone) BETWEEN 1 AND 63),
    ADD COLUMN labels TEXT
        CONSTRAINT route_data_labels_check CHECK (labels IS NULL OR length(labels) BETWEEN 1 AND 2047);
",
    },
    // --- end issue 31: zones and labels ---
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_consecutive_and_end_at_latest() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(
                m.version as usize,
                i + 1,
                "migration {} out of order",
                m.name
            );
        }
        assert_eq!(MIGRATIONS.last().map(|m| m.version), Some(LATEST));
    }
}
