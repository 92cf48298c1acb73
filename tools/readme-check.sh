#!/usr/bin/env bash
# tools/readme-check.sh: run the README's own commands, as written, the way
# a newcomer does: `cargo run --release -- standalone` ("Run it") in the
# background, then every `cargo run --release -- ...` line of "Next steps"
# from the repository root, each of which must exit 0; the getHosts must
# come from the agent (not its static route file) and name the README's
# nodes. Then it stops the standalone and removes what it made.
#
# Why: nothing else ran these lines, and one was broken for weeks (`cargo
# run` found two binaries once lbagent-fleet joined the workspace). And a
# run by hand as root leaves the agent's heartbeat in /run/lbagent; this
# check moves aside what is there before it (/run/lbagent, ./lbagent-data)
# and puts it back after, so that it neither trips on a leftover nor
# leaves one for the package test.
#
# Run as root (the README's standalone keeps its heartbeat in
# /run/lbagent), from any directory; .ci/run calls it after perf/check has
# built the release binary (`cargo run --release` then builds nothing).
# Uses the README's ports (7777, 7778, 8888.., 9777, 9778, 9888) on
# loopback: refuses to start while an lbagent runs on this host.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { printf 'readme-check: %s\n' "$*"; }
fail() { echo "readme-check: $*" >&2; exit 1; }

[[ "$(id -u)" -eq 0 ]] || fail "run it as root: the README's standalone keeps its heartbeat in /run/lbagent"
if running="$(pgrep -d ' ' -x lbagent)"; then
  fail "an lbagent runs on this host (pid $running): the README's commands use its ports; stop it first"
fi

# The README's lines: the fenced sh blocks, comments cut off.
mapfile -t lines < <(awk '/^```sh$/ { on = 1; next } /^```$/ { on = 0 } on' README.md |
  sed 's/[[:space:]]*#.*$//' | grep '^cargo run --release -- ' || true)
start="cargo run --release -- standalone"
[[ " ${lines[0]:-} " == " $start " ]] || fail "README.md's first command is not '$start' (found '${lines[0]:-nothing}'): update this check with the README"
((${#lines[@]} >= 4)) || fail "README.md has ${#lines[@]} 'cargo run --release --' lines; expected the standalone and its next steps"

tmp="$(mktemp -d)"
pid=""
saved=() ours=()
aside() { printf '%s.readme-check-saved.%s' "$1" "$$"; }
cleanup() {
  local rc=$?
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  if ((rc != 0)) && [[ -s "$tmp/standalone.log" ]]; then
    echo "--- the standalone's log" >&2
    tail -n 40 "$tmp/standalone.log" >&2
  fi
  rm -rf "$tmp"
  # Only what this check made: a path it moved aside, or one that was not
  # there before it.
  for path in "${ours[@]}"; do rm -rf "$path"; done
  for path in "${saved[@]}"; do
    mv "$(aside "$path")" "$path" && say "put $path back"
  done
}
trap cleanup EXIT
for path in /run/lbagent ./lbagent-data; do
  if [[ -e "$path" || -L "$path" ]]; then
    [[ ! -e "$(aside "$path")" ]] || fail "$(aside "$path") is in the way"
    mv "$path" "$(aside "$path")"
    saved+=("$path")
    say "moved $path aside (left by an earlier run); it is put back at the end"
  fi
  ours+=("$path")
done

# Built first (a no-op after perf/check), so that the wait below waits for
# the start, not for a build.
cargo build --release --locked --bin lbagent
# "Run it": in the background, as a newcomer's first terminal.
say "\$ $start &"
$start >"$tmp/standalone.log" 2>&1 &
pid=$!
for _ in $(seq 600); do
  [[ -s /run/lbagent/heartbeat ]] && grep -q "connected to route server" "$tmp/standalone.log" && break
  kill -0 "$pid" 2>/dev/null || fail "'$start' exited: $(tail -n 20 "$tmp/standalone.log")"
  sleep 0.1
done
[[ -s /run/lbagent/heartbeat ]] || fail "'$start' wrote no heartbeat in /run/lbagent within 60 s"

# "Next steps", each as written; a getHost must be the agent's answer and
# one of the README's nodes.
nodes=()
for line in "${lines[@]:1}"; do
  say "\$ $line"
  if [[ "$line" == *" route add "* ]]; then
    nodes+=("$(awk '{ print $9 }' <<<"$line")")
  fi
  out="$tmp/out" err="$tmp/err"
  tries=1
  # The agent pulls a route the moment it is asked for it: the first
  # getHost after a route add may find it still on its way (exit 3).
  [[ "$line" == *" gethost "* ]] && tries=50
  for ((i = 1; ; i++)); do
    if $line >"$out" 2>"$err"; then break; fi
    ((i < tries)) || fail "'$line' failed: $(cat "$err")"
    sleep 0.2
  done
  if [[ "$line" == *" gethost "* ]]; then
    host="$(head -n 1 "$out")"
    if grep -q "agent is down" "$err"; then fail "'$line' was not answered by the agent: $(cat "$err")"; fi
    [[ " ${nodes[*]} " == *" $host "* ]] || fail "'$line' answered '$host', not one of the README's nodes (${nodes[*]})"
    say "  $host"
  fi
done
say "the README's commands run as written: standalone, then ${#lines[@]} commands in all"
