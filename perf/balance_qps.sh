#!/usr/bin/env bash
# The balance policy through the real system: one `lbagent standalone`, a
# `balance` module of unequal capacities, several `lbagent qpstest`
# processes that hold each host for a while before reporting it (so each
# getHost's unit stays taken), and `lbagent getroute --json` sampled every
# 50 ms. Prints, per node, its capacity, the largest and the mean units in
# use seen, and whether a node was ever past its capacity (the verdict).
#
#   perf/balance_qps.sh [BIN]     BIN: the lbagent binary (default
#                                 target/release/lbagent, else target/debug)
#
# Knobs (environment): PROCS 3 qpstest processes, THREADS 8 each, HOLD_MS 20,
# SECONDS_RUN 8, WEIGHTS "2 4 6 8". Bounded: the run and every wait end
# within SECONDS_RUN + 30 s, and everything started is killed on exit.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${1:-}"
if [[ -z "$bin" ]]; then
  bin="$root/target/release/lbagent"
  [[ -x "$bin" ]] || bin="$root/target/debug/lbagent"
fi
procs="${PROCS:-3}" threads="${THREADS:-8}" hold="${HOLD_MS:-20}"
run_s="${SECONDS_RUN:-8}" weights="${WEIGHTS:-2 4 6 8}"

dir="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT

hb="$dir/heartbeat"
store="sqlite:$dir/data/lbagent.db"
"$bin" standalone --data "$dir/data" \
  --set dnsserver.listen=127.0.0.1:0 --set dnsserver.metrics_addr=127.0.0.1:0 \
  --set reporter.listen=127.0.0.1:0 --set reporter.metrics_addr=127.0.0.1:0 \
  --set agent.metrics_addr=127.0.0.1:0 --set agent.base_port=0 \
  --set agent.heartbeat_path="$hb" --set agent.snapshot_path="$dir/snapshot" \
  >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 100); do [[ -s "$hb" ]] && break; sleep 0.1; done
[[ -s "$hb" ]] || { echo "balance_qps: standalone wrote no heartbeat in 10 s" >&2; exit 1; }

modid=90 cmdid=1 i=0
for w in $weights; do
  i=$((i + 1))
  "$bin" route add $modid $cmdid "10.90.0.$i:80" --weight "$w" --store "$store" >/dev/null
done
"$bin" route policy $modid $cmdid balance --store "$store" >/dev/null
for _ in $(seq 100); do
  if "$bin" getroute $modid $cmdid --json --heartbeat "$hb" 2>/dev/null | jq -e '.policy == "balance"' >/dev/null; then
    break
  fi
  sleep 0.1
done

samples="$dir/samples"
for _ in $(seq "$procs"); do
  "$bin" qpstest --heartbeat "$hb" --modid $modid --cmdid $cmdid --threads "$threads" \
    --duration "$run_s" --hold-ms "$hold" --json >"$dir/qps.$RANDOM.json" 2>/dev/null &
  pids+=($!)
done
end=$((SECONDS + run_s))
while ((SECONDS < end)); do
  "$bin" getroute $modid $cmdid --json --heartbeat "$hb" 2>/dev/null | jq -c '[.nodes[] | [.host, .capacity, .in_use]]' >>"$samples" || true
  sleep 0.05
done
for p in "${pids[@]:1}"; do wait "$p" || true; done

echo "balance_qps: $procs qpstest x $threads threads, hold $hold ms, $run_s s; weights $weights; $(wc -l <"$samples") getRoute samples"
jq -s -r '
  (map(.[]) | group_by(.[0]) | map({host: .[0][0], cap: (map(.[1]) | max),
     max_in_use: (map(.[2]) | max), mean: ((map(.[2]) | add) / length)})) as $n
  | "| node | capacity | max in use | mean in use | mean / capacity |",
    "|---|---|---|---|---|",
    ($n[] | "| \(.host) | \(.cap) | \(.max_in_use) | \(.mean * 100 | round / 100) | \(.mean / .cap * 100 | round / 100) |"),
    (if ($n | all(.max_in_use <= .cap)) then "verdict: no node was ever past its capacity"
     else "verdict: FAIL, a node was past its capacity" end)' "$samples"
jq -s -r '"qpstest: getHosts answered with a host \(map(.from_agent) | add), OVERLOADED \(map(.errors.overloaded // 0) | add), reports \(map(.reports) | add)"' "$dir"/qps.*.json
