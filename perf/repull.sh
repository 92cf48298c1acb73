#!/usr/bin/env bash
# Route re-pull cost on the wire: what the agent's re-pulls of many unchanged
# modules cost the route server connection over a fixed window.
#
#   perf/repull.sh BINARY [MODULES] [WARMUP_S] [WINDOW_S]
#
# Runs `BINARY qpstest --standalone --modules MODULES` (30 threads spread
# over the modules, every module with 10 nodes, nothing changing), waits
# WARMUP_S seconds (default 20: every module pulled once), then samples the
# route server's counters (its Prometheus endpoint) and the bytes of the
# agent's route server connection (`ss -ti` on loopback, both directions)
# at the start and the end of a WINDOW_S-second window (default 30). Prints
# the deltas as `name value` lines. Run it with the binary of each commit to
# compare, in the same session. Every wait is bounded; qpstest is stopped
# at the end.
set -euo pipefail

bin="${1:?usage: perf/repull.sh BINARY [MODULES] [WARMUP_S] [WINDOW_S]}"
modules="${2:-10000}"
warmup="${3:-20}"
window="${4:-30}"

# qpstest's own output goes to $REPULL_LOG when set (kept), else nowhere.
log="${REPULL_LOG:-/dev/null}"
"$bin" qpstest --standalone --modules "$modules" --threads 30 \
  --duration $((warmup + window + 15)) >"$log" 2>&1 &
qps=$!
cleanup() {
  kill "$qps" 2>/dev/null || true
  wait "$qps" 2>/dev/null || true
}
trap cleanup EXIT

# The listening ports of the qpstest process (its in-process system).
ports() { ss -ltnpH 2>/dev/null | grep "pid=$qps," | awk '{print $4}' | sed 's/.*://' | sort -u; }

get() { curl -s --max-time 2 "http://127.0.0.1:$1/metrics" || true; }

sleep "$warmup"
dns_metrics=""
route_port=""
for p in $(ports); do
  text="$(get "$p")"
  if grep -q '^lbagent_dnsserver_pulls_total' <<<"$text"; then dns_metrics="$p"; fi
  addr="$(grep -o 'lbagent_route_server_connected{addr="[^"]*"} 1' <<<"$text" | sed 's/.*addr="\([^"]*\)".*/\1/' || true)"
  if [[ -n "$addr" ]]; then route_port="${addr##*:}"; fi
done
if [[ -z "$dns_metrics" || -z "$route_port" ]]; then
  echo "repull: cannot find the route server's metrics or port (ports: $(ports | tr '\n' ' '))" >&2
  exit 1
fi

# name value lines: the route server's counters and the connection's bytes
# as the route server's socket counts them (sent: to the agent).
sample() {
  get "$dns_metrics" | grep -E '^lbagent_dnsserver_(pull_requests_total|pulls_total|answers_total\{exists="true"\}|answer_nodes_total|unchanged_total|unchanged_frames_total|pushes_total) ' || true
  ss -tinH state established "( sport = :$route_port )" 2>/dev/null |
    grep -o 'bytes_sent:[0-9]*\|bytes_received:[0-9]*' |
    awk -F: '{s[$1] += $2} END {printf "server_bytes_sent %d\nserver_bytes_received %d\n", s["bytes_sent"], s["bytes_received"]}'
}

before="$(sample)"
sleep "$window"
after="$(sample)"
echo "# $bin: $modules modules, ${window}s window after ${warmup}s"
join <(sort <<<"$before") <(sort <<<"$after") | awk '{printf "%s %d\n", $1, $3 - $2}'
