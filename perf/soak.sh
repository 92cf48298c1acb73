#!/usr/bin/env bash
# perf/soak.sh: a bounded soak of the whole system (not run by CI).
#
# Starts a private system in a temporary directory, on loopback ports the
# OS picks (read from each process's log) and a generated configuration:
# `lbagent dnsserver`, `lbagent reporter` and `lbagent agent` as separate
# processes on a SQLite store. Then, for
# SOAK_SECONDS (default 600):
#   - saturation load: `lbagent qpstest` (getHost + report) against the agent
#     through its heartbeat, in back-to-back bounded runs;
#   - route churn: `lbagent route add` / `route del` on the store every
#     SOAK_CHURN_S seconds;
#   - garbage datagrams to the agent's UDP ports: random bytes and mutations
#     of valid requests and answers captured on loopback at the start;
#   - agent restarts every SOAK_RESTART_S seconds, alternately SIGTERM and
#     kill -9, on the same heartbeat and snapshot paths;
# and every 10 s prints a row: RSS and open fds of each process (the agent's
# current pid), qpstest's getHosts and errors, and the agent's error counters
# (summed over its incarnations). Ends with one verdict line, PASS or FAIL,
# and exits 0 on PASS, 1 on FAIL, 2 on a bad command line or a start failure.
#
# "Flat" means, for each long-lived process (route server, reporter, agent):
#   RSS at the end (median of the last 3 samples) within max(10 %, 8 MiB)
#   of its warm-up value (median of the samples in 30..60 s), and open fds at
#   the end within +-8 of warm-up.
# The verdict is PASS when everything is flat, the route server and the
# reporter never died, the agent never died except when killed, answered a
# getHost within SOAK_ANSWER_BOUND_S after every restart, every qpstest run
# got answers from the agent, and the garbage reached it (its
# lbagent_malformed_datagrams_total moved).
#
# Usage: perf/soak.sh [--duration SECONDS]
# Environment: SOAK_SECONDS (600), SOAK_BIN (target/release/lbagent),
#   SOAK_THREADS (16 qpstest threads), SOAK_MODULES (4), SOAK_RESTART_S (60),
#   SOAK_CHURN_S (3), SOAK_GARBAGE_RATE (datagrams/s, 500),
#   SOAK_ANSWER_BOUND_S (10), SOAK_KEEP (keep the temp dir when set; it is
#   always kept on FAIL, with the logs and a stuck agent's stacks).
# Every child is killed at exit (trap), on Ctrl-C or on failure too.

set -uo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

SECONDS_TOTAL=${SOAK_SECONDS:-600}
while [ $# -gt 0 ]; do
    case "$1" in
    --duration) SECONDS_TOTAL=${2:-}; shift 2 || { usage >&2; exit 2; } ;;
    --duration=*) SECONDS_TOTAL=${1#--duration=}; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "soak: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
done
case "$SECONDS_TOTAL" in
'' | *[!0-9]*) echo "soak: --duration takes whole seconds, got '$SECONDS_TOTAL'" >&2; exit 2 ;;
esac
if [ "$SECONDS_TOTAL" -lt 90 ]; then
    echo "soak: --duration must be at least 90 s (60 s warm-up, then samples)" >&2
    exit 2
fi

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${SOAK_BIN:-$ROOT/target/release/lbagent}
THREADS=${SOAK_THREADS:-16}
MODULES=${SOAK_MODULES:-4}
RESTART_S=${SOAK_RESTART_S:-60}
CHURN_S=${SOAK_CHURN_S:-3}
GARBAGE_RATE=${SOAK_GARBAGE_RATE:-500}
ANSWER_BOUND_S=${SOAK_ANSWER_BOUND_S:-10}
MODID=20000
CMDID=1
[ -x "$BIN" ] || { echo "soak: $BIN not found: cargo build --release --locked first (or set SOAK_BIN)" >&2; exit 2; }
command -v python3 >/dev/null || { echo "soak: python3 is required" >&2; exit 2; }
command -v curl >/dev/null || { echo "soak: curl is required" >&2; exit 2; }

DIR=$(mktemp -d /tmp/lbagent-soak.XXXXXX)
DNS_PID='' REP_PID='' AGENT_PID='' QPS_LOOP_PID='' GARBAGE_PID=''

cleanup() {
    trap - EXIT INT TERM
    local p
    for p in $QPS_LOOP_PID $GARBAGE_PID; do
        pkill -TERM -P "$p" 2>/dev/null
        kill -TERM "$p" 2>/dev/null
    done
    for p in $AGENT_PID $REP_PID $DNS_PID; do kill -TERM "$p" 2>/dev/null; done
    sleep 1
    for p in $QPS_LOOP_PID $GARBAGE_PID; do
        pkill -KILL -P "$p" 2>/dev/null
        kill -KILL "$p" 2>/dev/null
    done
    for p in $AGENT_PID $REP_PID $DNS_PID; do kill -KILL "$p" 2>/dev/null; done
    wait 2>/dev/null
    if [ -n "${SOAK_KEEP:-}" ] || [ "${VERDICT:-}" = FAIL ]; then
        echo "soak: kept $DIR" >&2
    else
        rm -rf "$DIR"
    fi
}
trap cleanup EXIT
trap 'echo "soak: interrupted" >&2; exit 130' INT TERM

die() { echo "soak: $*" >&2; VERDICT=FAIL; exit 2; }
now() { date +%s; }

STORE="sqlite:$DIR/lbagent.db"
HEARTBEAT="$DIR/heartbeat"
SNAPSHOT="$DIR/routes.snapshot"
CONFIG="$DIR/lbagent.toml"

# The store and the modules qpstest uses: MODULES modules of 10 nodes.
CREATE=--create
"$BIN" route add --help | grep -q -- --create || CREATE=''
"$BIN" route add "$MODID" "$CMDID" 10.1.0.1:8000 --store "$STORE" $CREATE >/dev/null || die "route add --create failed"
for ((m = 0; m < MODULES; m++)); do
    for ((n = 1; n <= 10; n++)); do
        [ "$m" -eq 0 ] && [ "$n" -eq 1 ] && continue
        "$BIN" route add $((MODID + m)) "$CMDID" "10.1.$m.$n:8000" --store "$STORE" >/dev/null || die "route add failed"
    done
done

# Every process binds port 0 and says in its log which port it got (a port
# picked free here and bound there later could be taken between by another
# process). The agent's first start pins its ports in its config, so that
# restarts come back on them (the agent retries a port still held for 3 s).

# The first match of the sed expression (printing its capture) in FILE,
# waiting up to SECONDS. The expressions match only a whole line (the text
# after the address included), never one half written.
logged() { # FILE SED_EXPR SECONDS
    local deadline=$(($(now) + $3)) v
    while [ "$(now)" -lt "$deadline" ]; do
        v=$(sed -n "$2" "$1" 2>/dev/null | head -1)
        [ -n "$v" ] && { echo "$v"; return 0; }
        sleep 0.2
    done
    return 1
}

"$BIN" dnsserver --store "$STORE" --set dnsserver.listen=127.0.0.1:0 --set dnsserver.metrics_addr=127.0.0.1:0 >"$DIR/dnsserver.log" 2>&1 &
DNS_PID=$!
"$BIN" reporter --store "$STORE" --set reporter.listen=127.0.0.1:0 --set reporter.metrics_addr=127.0.0.1:0 >"$DIR/reporter.log" 2>&1 &
REP_PID=$!
DNS_ADDR=$(logged "$DIR/dnsserver.log" 's/.*serving pulls on \([0-9.]*:[0-9]*\) (.*/\1/p' 20) ||
    { tail -5 "$DIR/dnsserver.log" >&2; die "the route server did not listen within 20 s"; }
REP_ADDR=$(logged "$DIR/reporter.log" 's/.*listening for agents on \([0-9.]*:[0-9]*\), .*/\1/p' 20) ||
    { tail -5 "$DIR/reporter.log" >&2; die "the reporter did not listen within 20 s"; }

write_config() { # UDP_PORT METRICS_PORT (0: the agent picks)
    cat >"$CONFIG" <<EOF
[lb]
report_timeout = 1
[agent]
bind = "127.0.0.1"
base_port = $1
shards = 1
route_servers = ["$DNS_ADDR"]
reporters = ["$REP_ADDR"]
heartbeat_path = "$HEARTBEAT"
snapshot_path = "$SNAPSHOT"
snapshot_interval = 5
metrics_addr = "127.0.0.1:$2"
EOF
}
write_config 0 0
"$BIN" agent --check --config "$CONFIG" >/dev/null || die "generated config $CONFIG is invalid"

AGENT_STARTS=0
start_agent() {
    AGENT_STARTS=$((AGENT_STARTS + 1))
    "$BIN" agent --config "$CONFIG" >>"$DIR/agent.log" 2>&1 &
    AGENT_PID=$!
    disown "$AGENT_PID" # no "Killed" notice from bash after a kill -9 restart
}

# Waits until a getHost is answered by the agent (not the static route
# file); prints the seconds it took, or returns 1 after ANSWER_BOUND_S.
wait_answer() { # START_EPOCH_NS
    local deadline=$(($(now) + ANSWER_BOUND_S))
    while [ "$(now)" -lt "$deadline" ]; do
        if "$BIN" gethost "$MODID" "$CMDID" --json --heartbeat "$HEARTBEAT" --timeout-ms 500 2>/dev/null |
            grep -q '"source":"agent"'; then
            echo "scale=2; ($(date +%s%N) - $1) / 1000000000" | bc
            return 0
        fi
        sleep 0.1
    done
    return 1
}

t0=$(date +%s%N)
start_agent
# "serving on 127.0.0.1:[PORT] (1 shards), metrics on http://ADDR/metrics":
# the ports it got, pinned for its restarts.
read -r UDP_PORT AGENT_MPORT < <(logged "$DIR/agent.log" \
    's/.*serving on 127\.0\.0\.1:\[\([0-9]*\)\] .*metrics on http:\/\/127\.0\.0\.1:\([0-9]*\)\/metrics.*/\1 \2/p' 20)
[ -n "${AGENT_MPORT:-}" ] || { tail -5 "$DIR/agent.log" >&2; die "the agent did not start within 20 s"; }
write_config "$UDP_PORT" "$AGENT_MPORT"
first=$(wait_answer "$t0") || { tail -5 "$DIR/agent.log" >&2; die "the agent did not answer within ${ANSWER_BOUND_S} s of its start"; }
echo "soak: $DIR; route server $DNS_ADDR, reporter $REP_ADDR, agent udp :$UDP_PORT (answered ${first} s after start); $SECONDS_TOTAL s, qpstest $THREADS threads x $MODULES modules"

START=$(now)
END=$((START + SECONDS_TOTAL))

# Saturation: back-to-back qpstest runs of at most 10 s until END.
mkdir -p "$DIR/qps"
(
    trap 'exit 0' TERM
    i=0
    while :; do
        left=$((END - $(now)))
        [ "$left" -ge 2 ] || break
        d=$((left < 10 ? left : 10))
        i=$((i + 1))
        timeout -k 5 $((d + 20)) "$BIN" qpstest --heartbeat "$HEARTBEAT" --threads "$THREADS" \
            --modid "$MODID" --cmdid "$CMDID" --modules "$MODULES" --duration "$d" --json \
            >"$DIR/qps/$(printf %04d $i).tmp" 2>/dev/null
        mv "$DIR/qps/$(printf %04d $i).tmp" "$DIR/qps/$(printf %04d $i).json"
    done
) &
QPS_LOOP_PID=$!

# Garbage: capture valid datagrams to and from the agent for 3 s, then send
# random and mutated datagrams until END.
python3 - "$UDP_PORT" "$END" "$GARBAGE_RATE" "$DIR/garbage.count" >"$DIR/garbage.log" 2>&1 <<'EOF' &
import os, random, socket, struct, sys, time
port, end, rate, count_path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
seeds = []
try:
    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    raw.bind(("lo", 0)); raw.settimeout(0.2)
    stop = time.time() + 3
    while time.time() < stop and len(seeds) < 64:
        try:
            pkt = raw.recv(65535)
        except socket.timeout:
            continue
        ip = pkt[14:]
        if len(ip) < 28 or ip[0] >> 4 != 4 or ip[9] != 17:
            continue
        ihl = (ip[0] & 15) * 4
        sport, dport = struct.unpack("!HH", ip[ihl:ihl + 4])
        if port in (sport, dport):
            payload = bytes(ip[ihl + 8:])
            if payload and payload not in seeds:
                seeds.append(payload)
    raw.close()
    print(f"captured {len(seeds)} valid datagrams", flush=True)
except OSError as e:
    print(f"no capture ({e}): random bytes only", flush=True)
rng = random.Random(10)
def mutate(b):
    b = bytearray(b)
    op = rng.randrange(6)
    if op == 0:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif op == 1:
        b = b[:rng.randrange(len(b))]
    elif op == 2:
        i = rng.randrange(len(b)); b[i:i + 4] = os.urandom(4)
    elif op == 3:
        b += os.urandom(rng.randint(1, 64))
    elif op == 4:
        i = rng.randrange(len(b)); b[i:i + 4] = rng.choice([b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\xff\xff\xff\x7f"])
    else:
        i = rng.randrange(len(b)); b = b[:i] + b[i:] + b[i:]
    return bytes(b)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setblocking(False)
sent = 0
batch = max(1, rate // 20)
while time.time() < end:
    for _ in range(batch):
        if seeds and rng.random() < 0.6:
            d = mutate(rng.choice(seeds))
        else:
            d = os.urandom(rng.choice([0, 1, 3, 8, 16, 64, 200, 512, 1400]))
        try:
            s.sendto(d, ("127.0.0.1", port)); sent += 1
        except OSError:
            pass
    try:
        while True:
            s.recv(65535)
    except OSError:
        pass
    with open(count_path + ".tmp", "w") as f:
        f.write(str(sent))
    os.replace(count_path + ".tmp", count_path)
    time.sleep(0.05)
print(f"sent {sent}", flush=True)
EOF
GARBAGE_PID=$!

# --- sampling -------------------------------------------------------------
rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
fds() { ls "/proc/$1/fd" 2>/dev/null | wc -l; }
alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }

AGENT_COUNTERS='lbagent_malformed_datagrams_total lbagent_errors_total lbagent_invalid_requests_total lbagent_unexpected_messages_total lbagent_send_errors_total lbagent_stats_dropped_total lbagent_unknown_modules_refused_total lbagent_requests_total'
# Prints "name value" per counter, summed over labels; nothing when down.
agent_metrics() {
    curl -s -m 3 "http://127.0.0.1:$AGENT_MPORT/metrics" 2>/dev/null | awk -v names="$AGENT_COUNTERS" '
        BEGIN { n = split(names, a, " "); for (i = 1; i <= n; i++) want[a[i]] = 1 }
        /^#/ { next }
        { name = $1; sub(/\{.*/, "", name); if (name in want) sum[name] += $NF; seen = 1 }
        END { if (seen) for (k in want) printf "%s %.0f\n", k, sum[k] }'
}
declare -A BASE CUR
for c in $AGENT_COUNTERS; do BASE[$c]=0 CUR[$c]=0; done
read_agent_metrics() {
    local line k v
    while read -r k v; do CUR[$k]=$v; done < <(agent_metrics)
}
bank_agent_metrics() { # the incarnation is about to end: add its counters to BASE
    read_agent_metrics
    for c in $AGENT_COUNTERS; do
        BASE[$c]=$((BASE[$c] + CUR[$c]))
        CUR[$c]=0
    done
}
total() { echo $((BASE[$1] + CUR[$1])); }

QPS_SEEN=0 QPS_RUNS=0 QPS_EMPTY=0 QPS_GETHOSTS=0 QPS_ERRORS=0 QPS_STATIC=0 LAST_QPS=0
declare -A QPS_ERR_KIND
read_qps() {
    local f out
    for f in "$DIR"/qps/*.json; do
        [ -e "$f" ] || continue
        local n=${f##*/}; n=${n%.json}; n=$((10#$n))
        [ "$n" -le "$QPS_SEEN" ] && continue
        QPS_SEEN=$n
        out=$(python3 -c '
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except Exception:
    print("bad 0 0 0 0"); sys.exit()
kinds = " ".join(f"{k}={v}" for k, v in s["errors"].items())
print("ok", s["get_hosts"], s["from_agent"], s["error_total"], s["static_route_answers"], int(s["qps"]), kinds)' "$f")
        set -- $out
        QPS_RUNS=$((QPS_RUNS + 1))
        if [ "$1" != ok ] || [ "$3" -eq 0 ]; then QPS_EMPTY=$((QPS_EMPTY + 1)); fi
        [ "$1" = ok ] || continue
        QPS_GETHOSTS=$((QPS_GETHOSTS + $2))
        QPS_ERRORS=$((QPS_ERRORS + $4))
        QPS_STATIC=$((QPS_STATIC + $5))
        LAST_QPS=$6
        shift 6
        local kv
        for kv in "$@"; do
            QPS_ERR_KIND[${kv%=*}]=$((${QPS_ERR_KIND[${kv%=*}]:-0} + ${kv#*=}))
        done
    done
}

SAMPLES="$DIR/samples.tsv" # t dns_rss dns_fd rep_rss rep_fd ag_rss ag_fd
: >"$SAMPLES"
DNS_DIED=0 REP_DIED=0 AGENT_UNEXPECTED=0 RESTART_FAILS=0 RESTARTS=0 MAX_ANSWER=0
printf '%5s %9s %9s %7s %7s %9s %9s %8s %10s %10s %7s %9s %9s %6s\n' \
    t dns_rss dns_fd rep_rss rep_fd agent_rss agent_fd restarts qps_last gethosts qerrs malformed agent_err static
sample() {
    local t=$(($(now) - START))
    alive "$DNS_PID" || DNS_DIED=1
    alive "$REP_PID" || REP_DIED=1
    if ! alive "$AGENT_PID"; then
        AGENT_UNEXPECTED=$((AGENT_UNEXPECTED + 1))
        echo "soak: the agent (pid $AGENT_PID) died unexpectedly at ${t} s; restarting it" >&2
        bank_agent_metrics
        local t1=$(date +%s%N)
        start_agent
        wait_answer "$t1" >/dev/null || RESTART_FAILS=$((RESTART_FAILS + 1))
    fi
    read_agent_metrics
    read_qps
    local dr df rr rf ar af
    dr=$(rss_kib "$DNS_PID") df=$(fds "$DNS_PID")
    rr=$(rss_kib "$REP_PID") rf=$(fds "$REP_PID")
    ar=$(rss_kib "$AGENT_PID") af=$(fds "$AGENT_PID")
    printf '%s %s %s %s %s %s %s\n' "$t" "$dr" "$df" "$rr" "$rf" "$ar" "$af" >>"$SAMPLES"
    printf '%5d %7.1fMi %9d %5.1fMi %7d %7.1fMi %9d %8d %10d %10d %7d %9d %9d %6d\n' \
        "$t" "$(echo "$dr/1024" | bc -l)" "$df" "$(echo "$rr/1024" | bc -l)" "$rf" \
        "$(echo "$ar/1024" | bc -l)" "$af" "$RESTARTS" "$LAST_QPS" "$QPS_GETHOSTS" "$QPS_ERRORS" \
        "$(total lbagent_malformed_datagrams_total)" "$(total lbagent_errors_total)" "$QPS_STATIC"
}

# What a process that does not answer is doing: its threads' states and
# wait channels, its log's tail and, with gdb, every thread's stack.
diagnose() { # PID
    local t
    for t in /proc/"$1"/task/*; do
        echo "$t $(cat "$t/comm") state=$(awk '{print $3}' "$t/stat") wchan=$(cat "$t/wchan")"
    done
    tail -20 "$DIR/agent.log"
    curl -s -m 2 "http://127.0.0.1:$AGENT_MPORT/metrics" | grep -v '^#' | grep -v ' 0$' | head -60
    command -v gdb >/dev/null && timeout 30 gdb -p "$1" -batch -ex 'thread apply all bt' 2>/dev/null | grep -E '^(Thread|#)' | head -200
}

SIGNAL=TERM
restart_agent() {
    local t=$(($(now) - START)) old=$AGENT_PID
    bank_agent_metrics
    kill -"$SIGNAL" "$old" 2>/dev/null
    local deadline=$(($(now) + 10))
    while alive "$old" && [ "$(now)" -lt "$deadline" ]; do sleep 0.1; done
    if alive "$old"; then
        echo "soak: the agent (pid $old) ignored SIGTERM for 10 s; kill -9" >&2
        RESTART_FAILS=$((RESTART_FAILS + 1))
        kill -KILL "$old" 2>/dev/null
    fi
    wait "$old" 2>/dev/null
    local t1=$(date +%s%N) took
    start_agent
    RESTARTS=$((RESTARTS + 1))
    if took=$(wait_answer "$t1"); then
        echo "# ${t} s: agent restarted after SIG$SIGNAL (pid $old -> $AGENT_PID), answering after ${took} s" >>"$DIR/restarts.log"
        if [ "$(echo "$took > $MAX_ANSWER" | bc)" = 1 ]; then MAX_ANSWER=$took; fi
    else
        echo "soak: the agent (pid $AGENT_PID) did not answer within ${ANSWER_BOUND_S} s of its restart after SIG$SIGNAL at ${t} s; its threads and stacks: $DIR/stuck-$AGENT_PID.txt; killing it and starting another" >&2
        echo "# ${t} s: agent restarted after SIG$SIGNAL (pid $old -> $AGENT_PID): NO ANSWER within ${ANSWER_BOUND_S} s" >>"$DIR/restarts.log"
        RESTART_FAILS=$((RESTART_FAILS + 1))
        diagnose "$AGENT_PID" >"$DIR/stuck-$AGENT_PID.txt" 2>&1
        kill -KILL "$AGENT_PID" 2>/dev/null
        wait "$AGENT_PID" 2>/dev/null
        t1=$(date +%s%N)
        start_agent
        wait_answer "$t1" >/dev/null || RESTART_FAILS=$((RESTART_FAILS + 1))
    fi
    if [ "$SIGNAL" = TERM ]; then SIGNAL=KILL; else SIGNAL=TERM; fi
}

CHURN_N=0 CHURN_FAILS=0 CHURNED=''
churn() {
    # Alternately adds and deletes a node on one of the loaded modules.
    local m=$((MODID + CHURN_N % MODULES))
    if [ -z "$CHURNED" ]; then
        CHURNED="$m 10.2.$((CHURN_N % 250)).1:9000"
        set -- $CHURNED
        "$BIN" route add "$1" "$CMDID" "$2" --store "$STORE" >/dev/null 2>>"$DIR/churn.log" || CHURN_FAILS=$((CHURN_FAILS + 1))
    else
        set -- $CHURNED
        "$BIN" route del "$1" "$CMDID" "$2" --store "$STORE" >/dev/null 2>>"$DIR/churn.log" || CHURN_FAILS=$((CHURN_FAILS + 1))
        CHURNED=''
    fi
    CHURN_N=$((CHURN_N + 1))
}

next_sample=$((START + 10))
next_restart=$((START + RESTART_S + 15))
next_churn=$((START + CHURN_S))
while [ "$(now)" -lt "$END" ]; do
    n=$(now)
    if [ "$n" -ge "$next_churn" ]; then churn; next_churn=$((n + CHURN_S)); fi
    if [ "$n" -ge "$next_restart" ] && [ $((END - n)) -gt 40 ]; then
        restart_agent
        next_restart=$((n + RESTART_S))
    fi
    if [ "$(now)" -ge "$next_sample" ]; then sample; next_sample=$((next_sample + 10)); fi
    sleep 0.5
done
sample
# Let the last qpstest run finish (bounded by its timeout) and count it.
for _ in $(seq 1 40); do alive "$QPS_LOOP_PID" || break; sleep 0.5; done
wait "$GARBAGE_PID" 2>/dev/null
read_qps

# --- verdict --------------------------------------------------------------
cat "$DIR/restarts.log" 2>/dev/null
GARBAGE_SENT=$(cat "$DIR/garbage.count" 2>/dev/null || echo 0)
echo "# garbage: $(head -1 "$DIR/garbage.log"); $GARBAGE_SENT datagrams sent"
echo "# route churn: $CHURN_N changes, $CHURN_FAILS failed"
kinds=''
for k in "${!QPS_ERR_KIND[@]}"; do kinds+=" $k=${QPS_ERR_KIND[$k]}"; done
echo "# qpstest: $QPS_RUNS runs, $QPS_GETHOSTS getHosts, $QPS_ERRORS errors (${kinds# }), $QPS_STATIC static-route answers, $QPS_EMPTY runs with no answer from the agent"
echo "# agent counters over its $AGENT_STARTS incarnations:$(for c in $AGENT_COUNTERS; do printf ' %s=%s' "${c#lbagent_}" "$(total "$c")"; done)"

VERDICT=PASS
reasons=()
fail() { VERDICT=FAIL; reasons+=("$1"); }
flat=$(python3 - "$SAMPLES" <<'EOF'
import statistics, sys
rows = [list(map(int, l.split())) for l in open(sys.argv[1]) if l.strip()]
warm = [r for r in rows if 30 <= r[0] <= 60] or rows[:3]
last = rows[-3:]
out = []
for name, ri, fi in (("route server", 1, 2), ("reporter", 3, 4), ("agent", 5, 6)):
    w_rss = statistics.median(r[ri] for r in warm); e_rss = statistics.median(r[ri] for r in last)
    w_fd = statistics.median(r[fi] for r in warm); e_fd = statistics.median(r[fi] for r in last)
    peak = max(r[ri] for r in rows)
    bound = max(0.10 * w_rss, 8 * 1024)
    ok_rss = abs(e_rss - w_rss) <= bound
    ok_fd = abs(e_fd - w_fd) <= 8
    out.append(f"{'ok' if ok_rss and ok_fd else 'FAIL'} {name}: RSS {w_rss/1024:.1f} -> {e_rss/1024:.1f} MiB "
               f"(bound +-{bound/1024:.1f}, peak {peak/1024:.1f}), fds {w_fd:.0f} -> {e_fd:.0f} (bound +-8)")
print("\n".join(out))
EOF
)
echo "$flat" | sed 's/^/# /'
echo "$flat" | grep -q '^FAIL' && fail "RSS or fds not flat"
[ "$DNS_DIED" = 0 ] || fail "the route server died"
[ "$REP_DIED" = 0 ] || fail "the reporter died"
[ "$AGENT_UNEXPECTED" = 0 ] || fail "the agent died $AGENT_UNEXPECTED times unasked"
[ "$RESTART_FAILS" = 0 ] || fail "$RESTART_FAILS restarts failed (no answer within ${ANSWER_BOUND_S} s, or SIGTERM ignored)"
[ "$RESTARTS" -gt 0 ] || fail "no restart happened"
[ "$QPS_RUNS" -gt 0 ] && [ "$QPS_EMPTY" = 0 ] || fail "$QPS_EMPTY of $QPS_RUNS qpstest runs got nothing from the agent"
[ "$(total lbagent_malformed_datagrams_total)" -gt 0 ] || fail "no garbage datagram reached the agent"
[ "$CHURN_FAILS" = 0 ] || fail "$CHURN_FAILS route changes failed"
if [ "$VERDICT" = PASS ]; then
    echo "VERDICT: PASS: RSS and fds flat, no process died, $RESTARTS restarts each answered within ${MAX_ANSWER} s (bound ${ANSWER_BOUND_S} s), $SECONDS_TOTAL s"
    exit 0
fi
echo "VERDICT: FAIL: $(IFS=';'; echo "${reasons[*]}")"
exit 1
