#!/usr/bin/env bash
# perf/shards.sh: how the agent scales across shards (not run by CI).
#
# For each shard count N in SHARDS_LIST, starts `lbagent standalone` (route
# server, reporter and agent in one process, SQLite store in a temporary
# directory) with agent.shards = N, loads SHARDS_MODULES 10-node modules
# with `lbagent route import`, and drives it with `lbagent qpstest` through
# the agent's heartbeat: SHARDS_THREADS synchronous threads spread over the
# modules, getHost + report, SHARDS_DURATION seconds, SHARDS_ROUNDS rounds.
# The agent's shards are pinned by the agent to cores 0..N-1 and its control
# core to the last core; qpstest is pinned (taskset) to the cores between, so
# clients and shards do not share cores. A `--floor` run (one bare
# recvmmsg/sendmmsg loop, no LB work) comes first, as the baseline.
#
# Per run it prints one row: shards, wall getHost/s, the whole standalone
# process's CPU-seconds (from /proc/PID/stat, every thread: shards, control
# core, route server, reporter) and getHost per CPU-second, and qpstest's
# p50/p99 in µs; for the floor, its own thread's CPU.
#
# Usage: perf/shards.sh
# Environment: SHARDS_BIN (target/release/lbagent), SHARDS_LIST ("1 2 4 8"),
#   SHARDS_THREADS (60), SHARDS_MODULES (256), SHARDS_DURATION (5),
#   SHARDS_ROUNDS (3), SHARDS_QPSTEST_ARGS (more qpstest flags for every
#   run, e.g. --no-report), SHARDS_NCPU (nproc; the cores to plan for).
# Needs at least max(SHARDS_LIST) + 2 cores. Every child is killed at exit.

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${SHARDS_BIN:-$ROOT/target/release/lbagent}
LIST=${SHARDS_LIST:-"1 2 4 8"}
THREADS=${SHARDS_THREADS:-60}
MODULES=${SHARDS_MODULES:-256}
DURATION=${SHARDS_DURATION:-5}
ROUNDS=${SHARDS_ROUNDS:-3}
EXTRA=${SHARDS_QPSTEST_ARGS:-}
NCPU=${SHARDS_NCPU:-$(nproc)}

[ -x "$BIN" ] || { echo "shards: no binary at $BIN (cargo build --release, or set SHARDS_BIN)" >&2; exit 2; }
for n in $LIST; do
    if [ $((n + 2)) -gt "$NCPU" ]; then
        echo "shards: $n shards need at least $((n + 2)) cores (this machine has $NCPU)" >&2
        exit 2
    fi
done

WORK=$(mktemp -d)
PID=
cleanup() {
    [ -n "$PID" ] && kill -9 "$PID" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

# CPU ticks (utime + stime) of a process, all its threads.
ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
HZ=$(getconf CLK_TCK)

# The route table: MODULES modules (10000 + k, 1), 10 nodes each.
TABLE=$WORK/routes.csv
{
    echo "modid,cmdid,ip,port,weight"
    for ((k = 0; k < MODULES; k++)); do
        for ((i = 1; i <= 10; i++)); do
            echo "$((10000 + k)),1,10.$((k / 256)).$((k % 256)).$i,8080,1"
        done
    done
} >"$TABLE"

# qpstest once; prints "qps p50 p99" from its JSON summary.
qps_json() { python3 -c 'import json,sys; d=json.load(sys.stdin); print(round(d["qps"]), round(d["latency_us"]["p50"]), round(d["latency_us"]["p99"]), d["server_cpu"]["seconds"] if d.get("server_cpu") else "-", round(d.get("get_hosts_per_server_cpu_second") or 0))'; }

echo "# $(date -u +%FT%TZ) $(uname -n), $NCPU cores, $THREADS threads over $MODULES modules, ${DURATION}s rounds"
echo "# run shards qps cpu_s qps_per_cpu_s p50_us p99_us"

for ((r = 1; r <= ROUNDS; r++)); do
    out=$(taskset -c 2-$((NCPU - 1)) "$BIN" qpstest --floor --threads "$THREADS" --duration "$DURATION" $EXTRA --json 2>/dev/null) || {
        echo "shards: the floor run failed" >&2
        exit 1
    }
    read -r q p50 p99 cpu per < <(echo "$out" | qps_json)
    echo "floor - $q $cpu $per $p50 $p99"
done

for n in $LIST; do
    for ((r = 1; r <= ROUNDS; r++)); do
        data=$WORK/data-$n-$r
        mkdir -p "$data"
        "$BIN" route import --create --store "sqlite:$data/lbagent.db" "$TABLE" >/dev/null || {
            echo "shards: route import failed" >&2
            exit 1
        }
        "$BIN" standalone --data "$data" --set agent.shards="$n" \
            --set agent.heartbeat_path="$data/hb" >"$data/log" 2>&1 &
        PID=$!
        for _ in $(seq 100); do
            [ -s "$data/hb" ] && break
            sleep 0.1
        done
        [ -s "$data/hb" ] || { echo "shards: standalone with $n shards did not start:" >&2; cat "$data/log" >&2; exit 1; }
        # One short warm-up run pulls every module's route into the agent.
        taskset -c "$n-$((NCPU - 2))" "$BIN" qpstest --heartbeat "$data/hb" --threads "$THREADS" \
            --modules "$MODULES" --duration 1 --json >/dev/null 2>&1
        t0=$(ticks "$PID")
        out=$(taskset -c "$n-$((NCPU - 2))" "$BIN" qpstest --heartbeat "$data/hb" --threads "$THREADS" \
            --modules "$MODULES" --duration "$DURATION" $EXTRA --json 2>/dev/null)
        t1=$(ticks "$PID")
        kill "$PID"
        wait "$PID" 2>/dev/null
        PID=
        read -r q p50 p99 _ _ < <(echo "$out" | qps_json)
        cpu=$(awk -v a="$t0" -v b="$t1" -v hz="$HZ" 'BEGIN { printf "%.2f", (b - a) / hz }')
        per=$(awk -v q="$q" -v d="$DURATION" -v c="$cpu" 'BEGIN { printf "%.0f", q * d / c }')
        echo "agent $n $q $cpu $per $p50 $p99"
    done
done
