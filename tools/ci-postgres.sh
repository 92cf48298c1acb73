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
# TLS: the cluster speaks TLS too (`ssl = on`; plain TCP still works, so
# `sslmode=prefer` URLs talk plain). The script makes, once, a test CA and
# a server certificate it signs (names `localhost` and 127.0.0.1) with
# `openssl`, in /etc/postgresql/<version>/<cluster>/lbagent-ci-tls/, and
# records the CA's path in the database setting `lbagent.test_ca` (read with
# `SELECT current_setting('lbagent.test_ca')`; tests/store.rs's TLS cases
# use it) and on stderr. Beside it, client.pem and client.key (the key
# world-readable: a test key) for the role `lbagent_cert`, which logs in
# with that certificate only (PostgreSQL's cert authentication).
#
# Environment:
#   LBAGENT_PG_PORT   port for a new cluster (default: the first free port
#                     from 55432 up)
#   LBAGENT_PG_CLUSTER  cluster name (default: lbagent)
set -euo pipefail

cluster="${LBAGENT_PG_CLUSTER:-lbagent}"
role=lbagent
cert_role=lbagent_cert
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

# --- TLS certificates (made once; kept while both are there) --------------
tlsdir="/etc/postgresql/$version/$cluster/lbagent-ci-tls"
if [[ ! -s "$tlsdir/ca.pem" || ! -s "$tlsdir/server.pem" || ! -s "$tlsdir/server.key" \
      || ! -s "$tlsdir/client.pem" || ! -s "$tlsdir/client.key" ]]; then
  command -v openssl >/dev/null || die "openssl not found: apt-get install openssl"
  say "making a test CA and server certificate in $tlsdir"
  $sudo mkdir -p "$tlsdir" || die "cannot create $tlsdir"
  tmp="$(mktemp -d)"
  (
    cd "$tmp"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
      -subj "/CN=lbagent-ci test CA" -keyout ca.key -out ca.pem \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
      -subj "/CN=localhost" -keyout server.key -out server.csr
    printf '%s\n' "subjectAltName=DNS:localhost,IP:127.0.0.1" "basicConstraints=critical,CA:FALSE" \
      "extendedKeyUsage=serverAuth" >server.ext
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile server.ext -out server.pem
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
      -subj "/CN=$cert_role" -keyout client.key -out client.csr
    printf '%s\n' "basicConstraints=critical,CA:FALSE" "extendedKeyUsage=clientAuth" >client.ext
    openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile client.ext -out client.pem
  ) >&2 2>&1 || { rm -rf "$tmp"; die "openssl could not make the test certificates"; }
  $sudo install -m 0644 "$tmp/ca.pem" "$tlsdir/ca.pem" \
    && $sudo install -m 0644 -o postgres -g postgres "$tmp/server.pem" "$tlsdir/server.pem" \
    && $sudo install -m 0600 -o postgres -g postgres "$tmp/server.key" "$tlsdir/server.key" \
    && $sudo install -m 0644 "$tmp/client.pem" "$tlsdir/client.pem" \
    && $sudo install -m 0644 "$tmp/client.key" "$tlsdir/client.key" \
    || { rm -rf "$tmp"; die "cannot install the test certificates in $tlsdir"; }
  rm -rf "$tmp"
fi
$sudo chmod 0755 "$tlsdir" || die "cannot make $tlsdir readable"

# Written on every run (Debian's postgresql.conf includes conf.d); takes
# effect at the next start, or at the reload below when the cluster runs.
confd="/etc/postgresql/$version/$cluster/conf.d"
[[ -d "$confd" ]] || die "$confd is missing: is $version/$cluster a Debian cluster?"
$sudo tee "$confd/lbagent-ci.conf" >/dev/null <<CONF || die "cannot write $confd/lbagent-ci.conf"
# tools/ci-postgres.sh: a throw-away test server on loopback.
listen_addresses = '127.0.0.1'
ssl = on
ssl_cert_file = '$tlsdir/server.pem'
ssl_key_file = '$tlsdir/server.key'
ssl_ca_file = '$tlsdir/ca.pem'
max_connections = 200
fsync = off
synchronous_commit = off
full_page_writes = off
CONF

# The role $cert_role logs in with a client certificate only (PostgreSQL's
# cert authentication: the certificate's CN is the role): the first line of
# pg_hba.conf, so that it matches before the password lines.
hba="/etc/postgresql/$version/$cluster/pg_hba.conf"
hba_line="hostssl $db $cert_role 127.0.0.1/32 cert"
if ! $sudo grep -qxF "$hba_line" "$hba"; then
  $sudo sed -i "1i $hba_line" "$hba" || die "cannot add the cert line to $hba"
fi

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
else
  # The TLS settings take effect at a reload (PostgreSQL 10 and later).
  $sudo pg_ctlcluster --skip-systemctl-redirect "$version" "$cluster" reload >&2 \
    || die "cannot reload cluster $version/$cluster"
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

psql_admin -c "DO \$\$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$cert_role') THEN
    CREATE ROLE $cert_role LOGIN IN ROLE $role;
  END IF;
END \$\$;" >&2 || die "cannot create role $cert_role"

if [[ "$(psql_admin -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'")" != 1 ]]; then
  say "creating database $db"
  psql_admin -c "CREATE DATABASE $db OWNER $role" >&2 || die "cannot create database $db"
fi

psql_admin -c "ALTER DATABASE $db SET lbagent.test_ca = '$tlsdir/ca.pem'" >&2 \
  || die "cannot record the test CA's path in database $db"
say "TLS: the test CA is $tlsdir/ca.pem (sslmode=verify-full&sslrootcert=$tlsdir/ca.pem)"

url="postgres://$role:$password@127.0.0.1:$port/$db"
PGPASSWORD="$password" psql -X -q -h 127.0.0.1 -p "$port" -U "$role" -d "$db" -tAc "SELECT 1" >/dev/null \
  || die "cannot log in as $role over TCP on 127.0.0.1:$port"
PGPASSWORD="$password" PGSSLMODE=verify-full PGSSLROOTCERT="$tlsdir/ca.pem" \
  psql -X -q -h localhost -p "$port" -U "$role" -d "$db" -tAc "SELECT 1" >/dev/null \
  || die "cannot log in as $role over TLS (verify-full) on localhost:$port"
say "ready: postgres://$role:***@127.0.0.1:$port/$db"
echo "$url"
