#!/usr/bin/env bash
# tools/deb-test.sh: build the Debian package with cargo-deb, check its
# contents, install it on this machine, check the installed configuration
# and units, run the three services with test certificates (mutual TLS, as
# packaged) and check they talk, then remove and purge it and check that
# nothing is left.
# Run as root (or with sudo) on a Debian/Ubuntu machine; .ci/run calls it.
#
# It packages target/release/lbagent as it is (`cargo deb --no-build`): CI's
# perf/check has just built it. Without one, it builds it first.
# Environment: LBAGENT_DEB_PROFILE (release) packages another profile's
# binary instead (dev: a quick local check of the packaging only).
# Needs: cargo-deb (installed with `cargo install cargo-deb --locked` when
# missing), dpkg, systemd-analyze (Debian package `systemd`), openssl (the
# test certificates), curl (the metrics), setpriv (util-linux). Uses the
# packaged ports (7777, 7778, 8888.., 9777, 9778, 9888) on loopback.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

sudo=""
if [[ "$(id -u)" -ne 0 ]]; then sudo="sudo"; fi
profile="${LBAGENT_DEB_PROFILE:-release}"
dir="$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
[[ "$profile" == dev ]] && bin="$dir/debug/lbagent" || bin="$dir/$profile/lbagent"
out="$dir/debian"

fail() { echo "deb-test: $*" >&2; exit 1; }
say() { printf 'deb-test: %s\n' "$*"; }

# What the end undoes, whatever stops the script: the services it
# started, its scratch directories, the package it installed, the paths
# it moved aside. A failure prints the services' logs first.
ctl="" pki="" logs="" installed=0
pids=() saved=()
stop_services() {
  for p in "${pids[@]}"; do $sudo kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
purge_ours() {
  if dpkg-query -W lbagent >/dev/null 2>&1; then $sudo dpkg -P lbagent >/dev/null 2>&1 || true; fi
}
aside() { printf '%s.deb-test-saved.%s' "$1" "$$"; }
cleanup() {
  local rc=$?
  stop_services
  if ((rc != 0)) && [[ -n "$logs" ]]; then
    for f in "$logs"/*.log; do
      if [[ -e "$f" ]]; then echo "--- $f" >&2; cat "$f" >&2; fi
    done
  fi
  if [[ -n "$ctl" ]]; then rm -rf "$ctl"; fi
  if [[ -n "$pki" ]]; then rm -rf "$pki"; fi
  if ((installed)); then purge_ours; fi
  for path in "${saved[@]}"; do
    $sudo rm -rf "$path"
    $sudo mv "$(aside "$path")" "$path" && say "put $path back"
  done
}
trap cleanup EXIT

if ! cargo deb --version >/dev/null 2>&1; then
  say "installing cargo-deb"
  t0=$SECONDS
  cargo install cargo-deb --locked --quiet
  say "cargo-deb installed in $((SECONDS - t0)) s"
fi
if [[ ! -x "$bin" ]]; then
  say "no $bin: building it"
  cargo build --locked --profile "$profile" --bin lbagent
fi

# 1. Build. --fast: lighter compression, the package is only installed here;
# --strip: the release profile keeps line tables (debug = 1) for perf/, which
# cargo-deb would otherwise ship (a 41 MB binary instead of 6.4 MB).
rm -rf "$out"
cargo deb --no-build --fast --strip --profile "$profile" -o "$out/" >/dev/null
deb="$(ls "$out"/lbagent_*.deb)"
say "built $deb ($(du -h "$deb" | cut -f1))"

# 2. Contents and control fields.
contents="$(dpkg-deb -c "$deb")"
for path in ./usr/bin/lbagent ./etc/lbagent/lbagent.toml \
  ./usr/lib/systemd/system/lbagent.service \
  ./usr/lib/systemd/system/lbagent-dnsserver.service \
  ./usr/lib/systemd/system/lbagent-reporter.service \
  ./usr/share/doc/lbagent/README.md ./usr/share/doc/lbagent/lbagent-alerts.yml \
  ./usr/share/doc/lbagent/lbagent-dashboard.json; do
  grep -q " $path\$" <<<"$contents" || fail "the package lacks $path"
done
grep -q '^-rwxr-xr-x .* ./usr/bin/lbagent$' <<<"$contents" || fail "usr/bin/lbagent is not mode 755"
info="$(dpkg-deb -I "$deb")"
grep -q '^ Depends:.*adduser' <<<"$info" || fail "Depends lacks adduser: $info"
[[ "$(dpkg-deb -f "$deb" Package)" == lbagent ]] || fail "the package is not named lbagent"
ctl="$(mktemp -d)"
dpkg-deb -e "$deb" "$ctl"
grep -qx /etc/lbagent/lbagent.toml "$ctl/conffiles" || fail "/etc/lbagent/lbagent.toml is not a conffile"
for script in postinst postrm prerm; do
  [[ -x "$ctl/$script" ]] || fail "no executable $script"
  sh -n "$ctl/$script" || fail "$script does not parse"
done
say "contents ok: binary, conffile, three units, maintainer scripts"

# 3. Install (apt resolves Depends) and check what it installed.
if dpkg-query -W lbagent >/dev/null 2>&1; then
  fail "lbagent is already installed here; purge it first (dpkg -P lbagent)"
fi
# The test runs the services on the packaged ports and paths: another
# lbagent running here would take them.
if running="$(pgrep -d ' ' -x lbagent)"; then
  fail "an lbagent runs on this host (pid $running): this test uses the packaged ports and paths; stop it first"
fi
# The package's own paths, left by a run by hand (the README's first
# try, run as root, leaves its heartbeat and lock in /run/lbagent, owned
# by root: the packaged agent, rightly, refuses to adopt them) or by an
# earlier test: moved aside, put back at the end.
for path in /run/lbagent /var/lib/lbagent /etc/lbagent; do
  if [[ -e "$path" || -L "$path" ]]; then
    [[ ! -e "$(aside "$path")" ]] || fail "$(aside "$path") is in the way"
    $sudo mv "$path" "$(aside "$path")"
    saved+=("$path")
    say "moved $path aside (not the package's: left by an earlier run); it is put back at the end"
  fi
done
# From here on a failure purges what this test installed (the next run
# would otherwise stop at "already installed"); the end purges anyway.
installed=1
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$deb" >/dev/null
getent passwd lbagent >/dev/null || fail "postinst did not create the lbagent user"
# The packaged [tls] names /etc/lbagent/tls/{host.pem,host.key,ca.pem}:
# a test CA and one certificate for this host (all three roles), as
# deploying.md shows. --check reads them.
tls=/etc/lbagent/tls
pki="$(mktemp -d)"
ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
openssl req -x509 "${ec[@]}" -keyout "$pki/ca.key" -out "$pki/ca.pem" -days 2 \
  -subj /CN=lbagent-deb-test-ca 2>/dev/null
openssl req "${ec[@]}" -keyout "$pki/host.key" -out "$pki/host.csr" \
  -subj /CN=deb-test.lbagent.test 2>/dev/null
printf 'subjectAltName=DNS:deb-test.lbagent.test,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' >"$pki/ext"
openssl x509 -req -in "$pki/host.csr" -CA "$pki/ca.pem" -CAkey "$pki/ca.key" -CAcreateserial \
  -days 2 -out "$pki/host.pem" -extfile "$pki/ext" 2>/dev/null
$sudo install -d -m 0755 "$tls"
$sudo install -m 0644 "$pki/host.pem" "$pki/ca.pem" "$tls/"
$sudo install -m 0640 -g lbagent "$pki/host.key" "$tls/"
/usr/bin/lbagent agent --check --config /etc/lbagent/lbagent.toml
/usr/bin/lbagent dnsserver --check --config /etc/lbagent/lbagent.toml
/usr/bin/lbagent reporter --check --config /etc/lbagent/lbagent.toml
units=(/usr/lib/systemd/system/lbagent.service
  /usr/lib/systemd/system/lbagent-dnsserver.service
  /usr/lib/systemd/system/lbagent-reporter.service)
# systemd-analyze verify exits 0 on some parse errors (it ignores the
# line): any message fails the check.
verify="$(systemd-analyze verify "${units[@]}" 2>&1)" || fail "systemd-analyze verify: $verify"
[[ -z "$verify" ]] || fail "systemd-analyze verify: $verify"
# The agent's own directories (docs: The trust model): systemd makes them
# for User=lbagent, and the packaged config names them.
for line in RuntimeDirectory=lbagent RuntimeDirectoryMode=0755 StateDirectory=lbagent StateDirectoryMode=0755; do
  grep -qx "$line" /usr/lib/systemd/system/lbagent.service || fail "lbagent.service lacks $line"
done
for line in 'heartbeat_path = "/run/lbagent/heartbeat"' 'snapshot_path = "/var/lib/lbagent/routes.snapshot"' 'dir = "/run/lbagent"'; do
  grep -qxF "$line" /etc/lbagent/lbagent.toml || fail "/etc/lbagent/lbagent.toml lacks $line"
done
say "installed: user lbagent, config checks ok, systemd-analyze verify clean, the agent's directories"

# 4. Run the three services as the lbagent user on the installed
# configuration (mutual TLS between them) and check that they talk: the
# agent pulls a route from the route server and answers a getHost; its
# statistics reach the reporter; a plain-TCP peer is refused.
conf=/etc/lbagent/lbagent.toml
logs="$pki/logs"
mkdir -p "$logs"
# What the units' StateDirectory and RuntimeDirectory make for User=lbagent.
$sudo install -d -o lbagent -g lbagent -m 0755 /var/lib/lbagent /run/lbagent
as_lbagent() { $sudo setpriv --reuid lbagent --regid lbagent --init-groups "$@"; }
# Starts a service in the background as lbagent, its stderr in LOG. A
# simple command run with & is exec'd in the child (setpriv execs in
# turn): $! is the service's own pid, which stop_services kills.
start_as_lbagent() { # LOG COMMAND...
  local log=$1
  shift
  $sudo setpriv --reuid lbagent --regid lbagent --init-groups "$@" 2>"$log" &
  pids+=($!)
}
metric() { curl -s --max-time 5 "http://127.0.0.1:$1/metrics" | awk -v n="$2" '$1 == n { print $2 }'; }
until_true() { # SECONDS-LIMIT WHAT COMMAND...
  local limit=$1 what=$2
  shift 2
  for ((i = 0; i < limit * 5; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  fail "$what: not within $limit s"
}
start_as_lbagent "$logs/dnsserver.log" /usr/bin/lbagent dnsserver --config "$conf"
start_as_lbagent "$logs/reporter.log" /usr/bin/lbagent reporter --config "$conf"
started() { grep -q "mutual TLS" "$logs/dnsserver.log" && grep -q "mutual TLS" "$logs/reporter.log"; }
until_true 30 "the route server and the reporter start" started
grep -q "listening for agents on 127.0.0.1:7778 (mutual TLS)" "$logs/reporter.log" ||
  fail "the reporter does not listen with mutual TLS on loopback: $(cat "$logs/reporter.log")"
as_lbagent /usr/bin/lbagent route add 1 1 10.0.0.1:8080 --config "$conf" >/dev/null
start_as_lbagent "$logs/agent.log" /usr/bin/lbagent agent --config "$conf" --set lb.report_timeout=1
# The agent's own answer: the client library would answer from a static
# route file too while the agent is down.
from_agent() { /usr/bin/lbagent gethost 1 1 --json | grep -qF '"source":"agent"'; }
until_true 30 "the agent answers a getHost with the route pulled over TLS" from_agent
/usr/bin/lbagent report 1 1 10.0.0.1:8080 0 --tcost 3 >/dev/null
reports() { [[ "$(metric 9778 lbagent_reporter_reports_total)" -gt 0 ]]; }
until_true 30 "the agent's statistics reach the reporter over TLS" reports
# A plain-TCP peer is refused at its first bytes.
exec 3<>/dev/tcp/127.0.0.1/7777 && printf 'plain\n' >&3 && exec 3>&-
refused() { [[ "$(metric 9777 lbagent_dnsserver_tls_refused_total)" -ge 1 ]]; }
until_true 30 "the route server refuses plain TCP" refused
grep -q "not TLS" "$logs/dnsserver.log" || fail "the refusal is not logged: $(cat "$logs/dnsserver.log")"
stop_services
if pgrep -u lbagent -x lbagent >/dev/null; then fail "a service outlived stop_services"; fi
say "ran: route server, reporter and agent talk over mutual TLS; plain TCP refused"

# 5. Remove (the conffile stays), then purge (everything goes).
$sudo mkdir -p /var/lib/lbagent /run/lbagent
$sudo touch /var/lib/lbagent/lbagent.db /run/lbagent/heartbeat
$sudo dpkg -r lbagent >/dev/null
[[ ! -e /usr/bin/lbagent ]] || fail "remove left /usr/bin/lbagent"
[[ -e /etc/lbagent/lbagent.toml ]] || fail "remove deleted the conffile"
[[ -e /var/lib/lbagent/lbagent.db ]] || fail "remove deleted the state (only purge may)"
$sudo dpkg -P lbagent >/dev/null
for path in /etc/lbagent /var/lib/lbagent /run/lbagent "${units[@]}"; do
  [[ ! -e "$path" ]] || fail "purge left $path"
done
if dpkg-query -W lbagent >/dev/null 2>&1; then fail "purge left lbagent in dpkg's database"; fi
say "removed and purged cleanly"
