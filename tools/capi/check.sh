#!/usr/bin/env bash
# The C ABI's CI check, run by .ci/run:
#   1. tools/capi/lbagent.h is what cbindgen makes of tools/capi/src/lib.rs
#      (`--regen` rewrites it instead);
#   2. liblbagent_c.a and liblbagent_c.so build, and tools/capi/example.c
#      links against each;
#   3. both example programs run against a real system: `lbagent standalone`
#      on free loopback ports in a temporary directory, with one module
#      added by `lbagent route add` (one node labelled version=canary, which
#      lb_get_host_selecting must pick every time). Their output is printed;
#   4. tools/capi/dagor.c (DAGOR through the C ABI: getHost by user id, a
#      report with a downstream level, the level's two bytes) runs against
#      the same system on a module of one node, and must exit 0.
# Needs cbindgen on PATH (`cargo install cbindgen --locked`) and a C compiler.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

header=tools/capi/lbagent.h
gen() {
  cbindgen --quiet --config tools/capi/cbindgen.toml --crate lbagent-capi --output "$1"
}

if [[ "${1:-}" == "--regen" ]]; then
  gen "$header"
  echo "wrote $header"
  exit 0
fi

tmp="$(mktemp -d)"
standalone_pid=""
cleanup() {
  if [[ -n "$standalone_pid" ]]; then
    kill "$standalone_pid" 2>/dev/null || true
    wait "$standalone_pid" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

echo "--- header is current ($header)"
gen "$tmp/lbagent.h"
if ! diff -u "$header" "$tmp/lbagent.h"; then
  echo "$header is out of date: run tools/capi/check.sh --regen and commit it" >&2
  exit 1
fi

echo "--- build liblbagent_c and lbagent, link the example (static and shared)"
cargo build --locked -p lbagent-capi -p lbagent 2>&1 | tail -n 3
lib=target/debug
cc -std=c99 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -Werror -Itools/capi tools/capi/example.c \
  "$lib/liblbagent_c.a" -lpthread -ldl -lm -o "$tmp/example-static"
cc -std=c99 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -Werror -Itools/capi tools/capi/example.c \
  -L"$lib" -llbagent_c -o "$tmp/example-shared"
cc -std=c99 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -Werror -Itools/capi tools/capi/dagor.c \
  "$lib/liblbagent_c.a" -lpthread -ldl -lm -o "$tmp/dagor"

echo "--- start lbagent standalone in $tmp"
bin=target/debug/lbagent
hb="$tmp/heartbeat"
"$bin" standalone --data "$tmp/data" \
  --set dnsserver.listen=127.0.0.1:0 --set dnsserver.metrics_addr=127.0.0.1:0 \
  --set reporter.listen=127.0.0.1:0 --set reporter.metrics_addr=127.0.0.1:0 \
  --set agent.metrics_addr=127.0.0.1:0 --set agent.base_port=0 --set agent.shards=1 \
  --set "agent.heartbeat_path=$hb" >"$tmp/standalone.log" 2>&1 &
standalone_pid=$!

# The route is added once the store exists; the agent serves it once the
# route server has loaded it (its reload period). Bounded waits.
store="sqlite:$tmp/data/lbagent.db"
for _ in $(seq 1 200); do
  [[ -s "$hb" && -f "$tmp/data/lbagent.db" ]] && break
  sleep 0.05
done
[[ -s "$hb" ]] || { cat "$tmp/standalone.log"; echo "no heartbeat in 10 s" >&2; exit 1; }
"$bin" route add 77 1 10.7.0.1:80 --store "$store"
"$bin" route add 77 1 10.7.0.2:80 --label version=canary --store "$store"
"$bin" route add 79 1 10.9.0.1:80 --store "$store"
ok=""
for _ in $(seq 1 100); do
  if "$bin" gethost 77 1 --heartbeat "$hb" --timeout-ms 200 >/dev/null 2>&1 &&
    "$bin" gethost 79 1 --heartbeat "$hb" --timeout-ms 200 >/dev/null 2>&1; then ok=1; break; fi
  sleep 0.1
done
[[ -n "$ok" ]] || { cat "$tmp/standalone.log"; echo "the route did not reach the agent in 10 s+" >&2; exit 1; }

echo "--- example (static library)"
"$tmp/example-static" "$hb" 77 1 | tee "$tmp/example.out"
# The selector reaches the agent: only the node labelled version=canary.
grep -q "^selector version=canary: 10.7.0.2:80, every time$" "$tmp/example.out" ||
  { echo "lb_get_host_selecting did not pick the labelled node" >&2; exit 1; }
echo "--- example (shared library)"
LD_LIBRARY_PATH="$lib" "$tmp/example-shared" "$hb" 77 1
echo "--- DAGOR (dagor.c: module 79/1, one node)"
"$tmp/dagor" "$hb" 79 1
echo "--- C ABI check passed"
