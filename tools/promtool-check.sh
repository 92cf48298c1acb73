#!/usr/bin/env bash
# tools/promtool-check.sh: check the Prometheus side of lbagent with promtool.
#   1. `promtool check rules` on tools/prometheus/lbagent-alerts.yml;
#   2. `promtool test rules` on its unit tests (lbagent-alerts.test.yml);
#   3. `promtool check metrics` on every real /metrics endpoint: it starts
#      `lbagent standalone` in a temporary directory on free loopback ports,
#      adds a route, asks for it once, waits until the agent is connected,
#      scrapes the agent's, the route server's and the reporter's endpoints
#      with curl and pipes each to promtool; then stops it.
# promtool: from PATH, else extracted from Debian's `prometheus` package
# (apt-get download; nothing is installed or started).
# Environment: LBAGENT_BIN (target/debug/lbagent, built when missing).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { printf 'promtool-check: %s\n' "$*"; }
fail() { echo "promtool-check: $*" >&2; exit 1; }

tmp="$(mktemp -d)"
pid=""
cleanup() {
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

promtool="$(command -v promtool || true)"
if [[ -z "$promtool" ]]; then
  (cd "$tmp" && apt-get download prometheus >"$tmp/apt.log" 2>&1 &&
    dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x ./usr/bin/promtool) ||
    fail "cannot get promtool from Debian's prometheus package: $(cat "$tmp/apt.log")"
  promtool="$tmp/usr/bin/promtool"
fi
"$promtool" --version 2>&1 | head -n 1

"$promtool" check rules tools/prometheus/lbagent-alerts.yml
(cd tools/prometheus && "$promtool" test rules lbagent-alerts.test.yml)

bin="${LBAGENT_BIN:-target/debug/lbagent}"
if [[ ! -x "$bin" ]]; then
  cargo build --locked --bin lbagent
fi
data="$tmp/data"
"$bin" standalone --data "$data" \
  --set agent.base_port=0 --set agent.shards=2 \
  --set dnsserver.listen=127.0.0.1:0 --set reporter.listen=127.0.0.1:0 \
  --set agent.metrics_addr=127.0.0.1:0 --set dnsserver.metrics_addr=127.0.0.1:0 \
  --set reporter.metrics_addr=127.0.0.1:0 \
  --set "agent.heartbeat_path=\"$tmp/heartbeat\"" 2>"$tmp/log" &
pid=$!
# The start line names the three metrics endpoints: "metrics on A, B, C;".
addrs=""
for _ in $(seq 300); do
  addrs="$(sed -n 's/.*; metrics on \([^;]*\);.*/\1/p' "$tmp/log" | tr -d ',')"
  [[ -n "$addrs" ]] && break
  kill -0 "$pid" 2>/dev/null || fail "lbagent standalone exited: $(cat "$tmp/log")"
  sleep 0.1
done
[[ -n "$addrs" ]] || fail "lbagent standalone did not start in 30 s: $(cat "$tmp/log")"
read -r agent_m dns_m rep_m <<<"$addrs"
"$bin" route add 1 1 10.0.0.1:80 --store "sqlite:$data/lbagent.db" >/dev/null
"$bin" gethost 1 1 --heartbeat "$tmp/heartbeat" >/dev/null 2>&1 || true
for _ in $(seq 200); do
  curl -fsS "http://$agent_m/metrics" | grep -q '^lbagent_route_server_connected{.*} 1$' && break
  sleep 0.1
done
for ep in "agent $agent_m" "dnsserver $dns_m" "reporter $rep_m"; do
  read -r role addr <<<"$ep"
  curl -fsS "http://$addr/metrics" >"$tmp/$role.prom" || fail "cannot scrape the $role at $addr"
  [[ -s "$tmp/$role.prom" ]] || fail "the $role's /metrics at $addr is empty"
  lint="$("$promtool" check metrics <"$tmp/$role.prom" 2>&1)" || fail "promtool check metrics, $role: $lint"
  [[ -z "$lint" ]] || fail "promtool check metrics, $role: $lint"
  say "$role /metrics ($addr): $(grep -c '^# TYPE' "$tmp/$role.prom") families, promtool check metrics clean"
done

# The Grafana dashboard (tools/grafana/lbagent-dashboard.json): every panel's
# expression parses (as a recording rule through promtool) and names only
# metrics these endpoints serve.
python3 tools/grafana/check.py tools/grafana/lbagent-dashboard.json "$tmp/dashboard-rules.yml" \
  "$tmp/agent.prom" "$tmp/dnsserver.prom" "$tmp/reporter.prom"
"$promtool" check rules "$tmp/dashboard-rules.yml"
