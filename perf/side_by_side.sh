#!/usr/bin/env bash
# perf/side_by_side.sh: issue 29's side-by-side table. The agent runs as its
# own process (`lbagent standalone`, one shard, which pins itself to core 0;
# its CPU is the whole process's, route server and reporter threads
# included), the UDP floor (`qpstest --floor`, its serving thread pinned to
# core 0) in the same rounds, in alternating order; 30 qpstest threads,
# "pinned" to core 1 (taskset) or unpinned. Rows: getHost + report and
# getHost only; columns: the floor, the agent over UDP, the agent over
# shared memory, getHosts per server CPU-second, medians of ROUNDS rounds,
# and the agent/floor ratio as the median of the per-round ratios (with
# their range); and the floor again in a process of its own (the agent's
# shape: its clients in another process), with the agent's ratio to it.
# Environment: ROUNDS (3), SECONDS_EACH (4), THREADS (30), LBAGENT (the
# binary; default: build this tree's release).
# Needs 2 cores or more; meant for a quiet machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROUNDS=${ROUNDS:-3}
SECONDS_EACH=${SECONDS_EACH:-4}
THREADS=${THREADS:-30}
if [[ -z ${LBAGENT:-} ]]; then
  LBAGENT=${CARGO_TARGET_DIR:-target}/release/lbagent
  cargo build --release --locked --bin lbagent >&2
fi
NCPU=$(nproc)
((NCPU >= 2)) || { echo "side_by_side: needs 2 cores or more" >&2; exit 2; }
HZ=$(getconf CLK_TCK)
scratch=$(mktemp -d)
PID=
cleanup() {
  [[ -n $PID ]] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null
  rm -rf "$scratch"
}
trap cleanup EXIT

ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
range() { sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END { printf "%.2f–%.2f", lo, hi }'; }
field() { python3 -c "import json,sys; d=json.load(sys.stdin); print(d.get('$1') or 0)"; }

# The agent: its own process, one shard, a 10-node module (7,1).
start_agent() {
  local data=$scratch/agent
  rm -rf "$data"
  mkdir -p "$data"
  {
    echo "modid,cmdid,ip,port,weight"
    for i in $(seq 10); do echo "7,1,10.0.0.$i,8080,1"; done
  } >"$scratch/routes.csv"
  "$LBAGENT" route import --create --store "sqlite:$data/lbagent.db" "$scratch/routes.csv" >/dev/null
  "$LBAGENT" standalone --data "$data" --set agent.shards=1 \
    --set agent.heartbeat_path="$data/hb" --set agent.base_port=18888 \
    --set dnsserver.listen=127.0.0.1:17777 --set reporter.listen=127.0.0.1:17778 \
    --set shm.enabled=true --set shm.dir="$data" >"$data/log" 2>&1 &
  PID=$!
  for _ in $(seq 100); do
    [[ -s $data/hb ]] && break
    sleep 0.1
  done
  [[ -s $data/hb ]] || { echo "side_by_side: the agent did not start:" >&2; cat "$data/log" >&2; exit 1; }
  # Pull the route into the agent before measuring.
  "$LBAGENT" qpstest --heartbeat "$data/hb" --threads 2 --modid 7 --cmdid 1 --duration 1 --json >/dev/null 2>&1
}

# One agent run: prints getHosts per agent-process CPU-second.
agent_run() { # pin transport extra...
  local pin=$1 transport=$2
  shift 2
  local t0 t1 out q
  t0=$(ticks "$PID")
  out=$($pin "$LBAGENT" qpstest --heartbeat "$scratch/agent/hb" --threads "$THREADS" --modid 7 --cmdid 1 \
    --transport "$transport" --duration "$SECONDS_EACH" --json "$@" 2>/dev/null)
  t1=$(ticks "$PID")
  q=$(echo "$out" | field qps)
  awk -v q="$q" -v d="$SECONDS_EACH" -v a="$t0" -v b="$t1" -v hz="$HZ" 'BEGIN { printf "%.0f\n", q * d / ((b - a) / hz) }'
}

# One floor run: getHosts per floor-thread CPU-second.
floor_run() { # pin extra...
  local pin=$1
  shift
  $pin "$LBAGENT" qpstest --floor --threads "$THREADS" --duration "$SECONDS_EACH" --json "$@" 2>/dev/null |
    field get_hosts_per_server_cpu_second
}

# One run against the floor in a process of its own, as the agent is (the
# floor above shares the qpstest process with its clients): a floor
# process with one client thread at 10 requests a second keeps it up, and
# this floor's serving thread (the one on core 0) is measured.
floor_own_run() { # pin extra...
  local pin=$1
  shift
  local fp hb tid t0 t1 out q
  taskset -c 1 "$LBAGENT" qpstest --floor --threads 1 --rate 10 --duration $((SECONDS_EACH + 30)) --json >/dev/null 2>&1 &
  fp=$!
  for _ in $(seq 100); do
    hb=$(ls -d /tmp/lbagent-qpstest-floor-"$fp"-*/heartbeat 2>/dev/null | head -1)
    [[ -n $hb && -s $hb ]] && break
    sleep 0.1
  done
  tid=
  for t in /proc/"$fp"/task/*; do
    [[ $(awk '{ print $39 }' "$t/stat") == 0 ]] && tid=${t##*/}
  done
  [[ -n $hb && -n $tid ]] || { echo "side_by_side: the floor process did not start" >&2; kill "$fp"; exit 1; }
  t0=$(ticks "$fp/task/$tid")
  out=$($pin "$LBAGENT" qpstest --heartbeat "$hb" --threads "$THREADS" --modid 7 --cmdid 1 \
    --transport udp --duration "$SECONDS_EACH" --json "$@" 2>/dev/null)
  t1=$(ticks "$fp/task/$tid")
  kill "$fp" 2>/dev/null; wait "$fp" 2>/dev/null || true
  q=$(echo "$out" | field qps)
  awk -v q="$q" -v d="$SECONDS_EACH" -v a="$t0" -v b="$t1" -v hz="$HZ" 'BEGIN { printf "%.0f\n", q * d / ((b - a) / hz) }'
}

echo "# $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $NCPU cores, load $(cut -d' ' -f1-3 /proc/loadavg); $THREADS threads, $ROUNDS rounds of ${SECONDS_EACH}s"
echo "| clients | calls | UDP floor | agent over UDP | agent/floor (range) | floor, own process | agent/that floor (range) | agent over shared memory | shm/floor |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|"
start_agent
for shape in pinned unpinned; do
  pin=
  [[ $shape == pinned ]] && pin="taskset -c 1"
  for calls in report no-report; do
    extra=()
    [[ $calls == no-report ]] && extra=(--no-report)
    : >"$scratch/f"; : >"$scratch/u"; : >"$scratch/s"; : >"$scratch/r"; : >"$scratch/o"; : >"$scratch/ro"
    for r in $(seq "$ROUNDS"); do
      # Alternate the order so that neither always runs first.
      if ((r % 2)); then
        f=$(floor_run "$pin" "${extra[@]}"); u=$(agent_run "$pin" udp "${extra[@]}")
      else
        u=$(agent_run "$pin" udp "${extra[@]}"); f=$(floor_run "$pin" "${extra[@]}")
      fi
      o=$(floor_own_run "$pin" "${extra[@]}")
      s=$(agent_run "$pin" shm "${extra[@]}")
      echo "$f" >>"$scratch/f"; echo "$u" >>"$scratch/u"; echo "$s" >>"$scratch/s"; echo "$o" >>"$scratch/o"
      awk -v u="$u" -v f="$f" 'BEGIN { print u / f }' >>"$scratch/r"
      awk -v u="$u" -v f="$o" 'BEGIN { print u / f }' >>"$scratch/ro"
      echo "# $shape $calls round $r: floor $f, udp $u, floor in its own process $o, shm $s" >&2
    done
    printf '| %s | %s | %.0f | %.0f | %.2f (%s) | %.0f | %.2f (%s) | %.0f | %.1f× |\n' "$shape" \
      "$([[ $calls == report ]] && echo "getHost + report" || echo "getHost only")" \
      "$(median <"$scratch/f")" "$(median <"$scratch/u")" "$(median <"$scratch/r")" "$(range <"$scratch/r")" \
      "$(median <"$scratch/o")" "$(median <"$scratch/ro")" "$(range <"$scratch/ro")" \
      "$(median <"$scratch/s")" "$(awk -v s="$(median <"$scratch/s")" -v f="$(median <"$scratch/f")" 'BEGIN { print s / f }')"
  done
done
