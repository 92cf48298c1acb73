#!/usr/bin/env bash
# A PostgreSQL for the store tests, from Debian's packages, on loopback.
#
#   url="$(tools/ci-postgres.sh | tail -n 1)"
#   export LBAGENT_TEST_POSTGRES_URL="$url"
#
# Installs `postgresql` (assumes `apt-get update` already ran), creates the
# cluster `lbagent` (Debian's pg_createcluster; owned by the `postgres`
# user, since the server refuses to run as root) listening on 127.0.0.1 only,
# starts it, creates the role and database `lbagent` (password `lbagent`),
# and prints the URL on its last stdout line. Everything else goes to
# stderr.
#
# Idempotent: a second run reuses the cluster (and its port), starts it if
# it is down, and resets the role's password. Any failure exits non-zero
# with a message.
#
# For tests only: the cluster runs with fsync off.
#
# Environment:
#   LBAGENT_PG_PORT   port for a new cluster (default: the first free port
#                     from 55432 up)
#   LBAGENT_PG_CLUSTER  cluster name (default: lbagent)
set -euo pipefail

cluster="${LBAGENT_PG_CLUSTER:-lbagent}"
role=lbagent
password=lbagent
db=lbagent

say() { printf 'ci-postgres: %s\n' "$*" >&2; }
die() { printf 'ci-postgres: error: %s\n' "$*" >&2; exit 1; }

sudo=""
if [[ "$(id -u)" -ne 0 ]]; then
  command -v sudo >/dev/null || die "not root and no sudo: run as root"
  sudo="sudo"
fi

# Runs a command as the postgres user.
as_postgres() {
  if [[ "$(id -u)" -eq 0 ]]; then
    (cd / && runuser -u postgres -- "$@")
  else
    (cd / && sudo -u postgres -- "$@")
  fi
}

# --- install ---------------------------------------------------------------
if ! command -v pg_createcluster >/dev/null || ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  say "installing postgresql from Debian's packages"
  # The package's own `main` cluster may fail to start in a container
  # without an init system; that does not matter here, ours is separate.
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends postgresql >&2 \
    || die "apt-get install postgresql failed (did apt-get update run?)"
fi
command -v pg_createcluster >/dev/null || die "pg_createcluster not found after installing postgresql"
version="$(ls /usr/lib/postgresql | sort -V | tail -n 1)"
[[ -x "/usr/lib/postgresql/$version/bin/postgres" ]] || die "no server binary in /usr/lib/postgresql/$version"
say "PostgreSQL $version"

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# The cluster's line from pg_lsclusters: version cluster port status ...
cluster_line() { pg_lsclusters --no-header 2>/dev/null | awk -v v="$version" -v c="$cluster" '$1 == v && $2 == c'; }

# --- cluster ----------------------------------------------------------------
if [[ -z "$(cluster_line)" ]]; then
  port="${LBAGENT_PG_PORT:-}"
  if [[ -z "$port" ]]; then
    taken="$(pg_lsclusters --no-header 2>/dev/null | awk '{print $3}')"
    for p in $(seq 55432 55531); do
      if ! grep -qx "$p" <<<"$taken" && ! port_in_use "$p"; then port="$p"; break; fi
    done
    [[ -n "$port" ]] || die "no free port in 55432..55531"
  fi
  say "creating cluster $version/$cluster on 127.0.0.1:$port"
  $sudo pg_createcluster "$version" "$cluster" --port "$port" --start-conf manual \
    -- --auth-local=peer --auth-host=scram-sha-256 >&2 \
    || die "pg_createcluster $version $cluster failed"
fi
read -r _ _ port status _ <<<"$(cluster_line)"
[[ -n "$port" ]] || die "cluster $version/$cluster not listed by pg_lsclusters"

# Written on every run (Debian's postgresql.conf includes conf.d); takes
# effect at the next start.
confd="/etc/postgresql/$version/$cluster/conf.d"
[[ -d "$confd" ]] || die "$confd is missing: is $version/$cluster a Debian cluster?"
$sudo tee "$confd/lbagent-ci.conf" >/dev/null <<'CONF' || die "cannot write $confd/lbagent-ci.conf"
# tools/ci-postgres.sh: a throw-away test server on loopback.
listen_addresses = '127.0.0.1'
ssl = off
max_connections = 200
fsync = off
synchronous_commit = off
full_page_writes = off
CONF

if [[ "$status" != online* ]]; then
  if port_in_use "$port"; then
    die "port $port of cluster $version/$cluster is taken by another program"
  fi
  say "starting cluster $version/$cluster"
  $sudo pg_ctlcluster --skip-systemctl-redirect "$version" "$cluster" start >&2 || {
    log="/var/log/postgresql/postgresql-$version-$cluster.log"
    [[ -r "$log" ]] && tail -n 20 "$log" >&2
    die "cannot start cluster $version/$cluster"
  }
fi

# Bounded by time, not tries (each pg_isready may itself wait seconds on a
# loaded machine).
ready=""
deadline=$((SECONDS + 60))
while (( SECONDS < deadline )); do
  if pg_isready -q -t 5 -h 127.0.0.1 -p "$port"; then ready=1; break; fi
  sleep 0.5
done
[[ -n "$ready" ]] || die "cluster $version/$cluster does not answer on 127.0.0.1:$port after 60 s"

# --- role and database ------------------------------------------------------
psql_admin() { as_postgres psql -X -q -v ON_ERROR_STOP=1 -p "$port" -d postgres "$@"; }

psql_admin -c "DO \$\$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$role') THEN
    CREATE ROLE $role LOGIN PASSWORD '$password';
  ELSE
    ALTER ROLE $role LOGIN PASSWORD '$password';
  END IF;
END \$\$;" >&2 || die "cannot create role $role"

if [[ "$(psql_admin -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'")" != 1 ]]; then
  say "creating database $db"
  psql_admin -c "CREATE DATABASE $db OWNER $role" >&2 || die "cannot create database $db"
fi

url="postgres://$role:$password@127.0.0.1:$port/$db"
PGPASSWORD="$password" psql -X -q -h 127.0.0.1 -p "$port" -U "$role" -d "$db" -tAc "SELECT 1" >/dev/null \
  || die "cannot log in as $role over TCP on 127.0.0.1:$port"
say "ready: postgres://$role:***@127.0.0.1:$port/$db"
echo "$url"
