#!/usr/bin/env bash
# perf/shm.sh: the shared-memory transport against UDP and the UDP floor
# (issue 16), same run: for 1 and 2 shards, getHost + report and getHost
# only, ROUNDS rounds of SECONDS s with 30 qpstest threads, medians per
# cell; then latency where the agent keeps up (1 and 2 threads, clients
# off the shard's core); then the idle CPU of a parked agent with 30
# attached clients. Prints Markdown tables. Environment: SECONDS_EACH (3),
# ROUNDS (3), KEEPUP (1; 0 skips the latency table), SHM_SHARDS ("1 2";
# more on a many-core machine, e.g. "1 2 4 8"), IDLE (1; 0 skips the idle
# runs), LBAGENT (a binary to measure instead of building this tree's, e.g.
# another branch's, for a before/after comparison). With N shards the threads spread over N modules, one per shard, so
# every shard has work.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SECONDS_EACH=${SECONDS_EACH:-3}
ROUNDS=${ROUNDS:-3}
if [[ -z ${LBAGENT:-} ]]; then
  LBAGENT=target/release/lbagent
  cargo build --release --locked --bin lbagent >&2
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

json_number() { sed -n "s/.*\"$2\":\\([-0-9.eE+]*\\).*/\\1/p" "$1" | head -n 1; }
median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

# One run: prints "qps per_cpu p50_us p99_us errors".
run() {
  local json="$scratch/run.json"
  "$LBAGENT" qpstest --json --threads 30 --duration "$SECONDS_EACH" "$@" >"$json" 2>/dev/null || true
  echo "$(json_number "$json" qps) $(json_number "$json" get_hosts_per_server_cpu_second) \
$(json_number "$json" p50) $(json_number "$json" p99) $(json_number "$json" error_total)"
}

echo "| shards | calls | transport | getHost per agent CPU-s | × floor | wall getHost/s | p50 µs | p99 µs | errors |"
echo "|---:|---|---|---:|---:|---:|---:|---:|---:|"
for shards in ${SHM_SHARDS:-1 2}; do
  for calls in report no-report; do
    extra=()
    [[ $calls == no-report ]] && extra=(--no-report)
    : >"$scratch/floor" ; : >"$scratch/udp" ; : >"$scratch/shm"
    for _ in $(seq "$ROUNDS"); do
      run --floor "${extra[@]}" >>"$scratch/floor"
      run --standalone --shards "$shards" --modules "$shards" --transport udp "${extra[@]}" >>"$scratch/udp"
      run --standalone --shards "$shards" --modules "$shards" --transport shm "${extra[@]}" >>"$scratch/shm"
    done
    fc=$(cut -d' ' -f2 "$scratch/floor" | median)
    for t in floor udp shm; do
      q=$(cut -d' ' -f1 "$scratch/$t" | median)
      c=$(cut -d' ' -f2 "$scratch/$t" | median)
      p50=$(cut -d' ' -f3 "$scratch/$t" | median)
      p99=$(cut -d' ' -f4 "$scratch/$t" | median)
      err=$(cut -d' ' -f5 "$scratch/$t" | awk '{ s += $1 } END { print s }')
      name=$t
      [[ $t == floor ]] && name="UDP floor"
      [[ $t == udp ]] && name="UDP agent"
      [[ $t == shm ]] && name="shared memory"
      printf '| %s | %s | %s | %.0f | %.2f | %.0f | %.1f | %.1f | %s |\n' \
        "$([[ $t == floor ]] && echo "-" || echo "$shards")" "$calls" "$name" "$c" \
        "$(awk -v c="$c" -v f="$fc" 'BEGIN { print c / f }')" "$q" "$p50" "$p99" "$err"
    done
  done
done

# Latency where the agent keeps up: 1 and 2 client threads, getHost only,
# the clients kept off core 0, where the standalone agent pins its shard
# (taskset; the shard sets its own affinity), UDP and shared memory back to
# back in each round, medians of ROUNDS. Set KEEPUP=0 to skip.
if [[ ${KEEPUP:-1} != 0 ]]; then
  last=$(($(nproc) - 1))
  pin=()
  ((last > 0)) && pin=(taskset -c "1-$last")
  echo
  echo "| client threads | transport | wall getHost/s | getHost per agent CPU-s | p50 µs | p99 µs | errors |"
  echo "|---:|---|---:|---:|---:|---:|---:|"
  for threads in 1 2; do
    : >"$scratch/udp" ; : >"$scratch/shm"
    for _ in $(seq "$ROUNDS"); do
      for t in udp shm; do
        json="$scratch/keepup.json"
        "${pin[@]}" "$LBAGENT" qpstest --json --threads "$threads" --duration "$SECONDS_EACH" \
          --no-report --standalone --shards 1 --transport "$t" >"$json" 2>/dev/null || true
        echo "$(json_number "$json" qps) $(json_number "$json" get_hosts_per_server_cpu_second) \
$(json_number "$json" p50) $(json_number "$json" p99) $(json_number "$json" error_total)" >>"$scratch/$t"
      done
    done
    for t in udp shm; do
      printf '| %s | %s | %.0f | %.0f | %.1f | %.1f | %s |\n' "$threads" \
        "$([[ $t == udp ]] && echo "UDP agent" || echo "shared memory")" \
        "$(cut -d' ' -f1 "$scratch/$t" | median)" "$(cut -d' ' -f2 "$scratch/$t" | median)" \
        "$(cut -d' ' -f3 "$scratch/$t" | median)" "$(cut -d' ' -f4 "$scratch/$t" | median)" \
        "$(cut -d' ' -f5 "$scratch/$t" | awk '{ s += $1 } END { print s }')"
    done
  done
fi

# Idle: 30 threads each take one host and hold it 12 s without a call:
# the agent's CPU over the 8 s run is that of a parked agent with 30
# attached clients (qpstest counts the agent threads' CPU).
[[ ${IDLE:-1} == 0 ]] && exit 0
for t in udp shm; do
  json="$scratch/idle-$t.json"
  "$LBAGENT" qpstest --json --threads 30 --duration 8 --hold-ms 12000 --standalone \
    --transport "$t" >"$json" 2>/dev/null || true
  echo "idle ($t, 30 clients attached, 8 s): agent CPU $(sed -n "s/.*\"server_cpu\":{\"seconds\":\([-0-9.eE+]*\).*/\1/p" "$json") s"
done
