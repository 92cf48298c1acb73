#!/usr/bin/env bash
# Coverage-guided fuzzing of lbagent's parsers with AFL++ (afl.rs, stable
# Rust). The targets live in tools/fuzz/ (see tools/fuzz/src/lib.rs).
#
#   tools/fuzz.sh TARGET SECONDS   fuzz one target for SECONDS
#   tools/fuzz.sh all SECONDS      fuzz each target for SECONDS, one after another
#   tools/fuzz.sh list             the targets
#
# Targets: datagram hot frame heartbeat snapshot config.
# Each run starts from seeds written fresh from real encodings (the `seeds`
# binary), prints one line per target (executions, crashes, hangs) and exits
# 1 when any target crashed; the crashing inputs are kept under
# $LBAGENT_FUZZ_OUT/TARGET/default/crashes/ (default: tools/fuzz/out).
# Installs cargo-afl and builds AFL++ when they are missing. The build goes
# to $LBAGENT_FUZZ_TARGET (default ~/.cache/lbagent-fuzz/target), outside
# the work tree, so that a fresh clone on the same machine rebuilds only
# lbagent itself.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TARGETS=(datagram hot frame heartbeat snapshot config)

usage() {
  echo "usage: tools/fuzz.sh TARGET|all SECONDS   (targets: ${TARGETS[*]})" >&2
  exit 2
}

[[ $# -ge 1 ]] || usage
if [[ "$1" == list ]]; then
  printf '%s\n' "${TARGETS[@]}"
  exit 0
fi
[[ $# -eq 2 && "$2" =~ ^[1-9][0-9]*$ ]] || usage
what="$1"
seconds="$2"
if [[ "$what" == all ]]; then
  run=("${TARGETS[@]}")
else
  found=""
  for t in "${TARGETS[@]}"; do [[ "$t" == "$what" ]] && found=1; done
  [[ -n "$found" ]] || { echo "fuzz.sh: no target '$what' (targets: ${TARGETS[*]})" >&2; exit 2; }
  run=("$what")
fi

export CARGO_TARGET_DIR="${LBAGENT_FUZZ_TARGET:-$HOME/.cache/lbagent-fuzz/target}"
out="${LBAGENT_FUZZ_OUT:-$PWD/tools/fuzz/out}"

# cargo-afl, and AFL++ built for this rustc (once per machine and toolchain).
if ! cargo afl --version >/dev/null 2>&1; then
  echo "fuzz.sh: installing cargo-afl" >&2
  cargo install cargo-afl --locked --version '^0.18'
fi
if ! config_log="$(cargo afl config --build 2>&1)"; then
  if ! grep -q "already built" <<<"$config_log"; then
    printf '%s\n' "$config_log" >&2
    echo "fuzz.sh: cannot build AFL++ (cargo afl config --build)" >&2
    exit 1
  fi
fi

# Not --locked: tools/fuzz/Cargo.lock starts from the main lock file, and a
# dependency added to lbagent since is resolved here rather than failing.
(cd tools/fuzz && cargo afl build --release --bins)
bin="$CARGO_TARGET_DIR/release"

seeds="$out/seeds"
rm -rf "$seeds"
"$bin/seeds" "$seeds"

# A busy or shared machine: no CPU binding, no CPU-governor or core-dump
# checks (they refuse to start rather than fuzz more slowly).
export AFL_NO_UI=1 AFL_NO_AFFINITY=1 AFL_SKIP_CPUFREQ=1
export AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_QUIET=1

field() { sed -n "s/^$1 *: *//p" "$2" | head -n 1; }

# The targets' scratch files (heartbeat, snapshot, config), on tmpfs when
# there is one, removed whatever happens.
scratch_base=/dev/shm
[[ -d "$scratch_base" && -w "$scratch_base" ]] || scratch_base="${TMPDIR:-/tmp}"
LBAGENT_FUZZ_SCRATCH="$(mktemp -d "$scratch_base/lbagent-fuzz.XXXXXX")"
export LBAGENT_FUZZ_SCRATCH
trap 'rm -rf "$LBAGENT_FUZZ_SCRATCH"' EXIT

failed=0
for t in "${run[@]}"; do
  dir="$out/$t"
  rm -rf "$dir"
  mkdir -p "$dir"
  # -t: 2 s an execution before it counts as a hang (a loaded CI machine).
  if ! cargo afl fuzz -i "$seeds/$t" -o "$dir" -V "$seconds" -t 2000 -- "$bin/fuzz_$t" \
      >"$dir/afl.log" 2>&1; then
    tail -n 30 "$dir/afl.log" >&2
    echo "fuzz.sh: afl-fuzz failed for $t (log: $dir/afl.log)" >&2
    failed=1
    continue
  fi
  stats="$dir/default/fuzzer_stats"
  execs="$(field execs_done "$stats")"
  crashes="$(field saved_crashes "$stats")"
  hangs="$(field saved_hangs "$stats")"
  paths="$(field corpus_count "$stats")"
  speed="$(field execs_per_sec "$stats")"
  echo "fuzz $t: ${seconds} s, ${execs} executions (${speed}/s), ${paths} corpus entries, ${crashes} unique crashes, ${hangs} hangs"
  if [[ "${crashes:-0}" != 0 ]]; then
    echo "fuzz.sh: $t crashed; inputs in $dir/default/crashes/:" >&2
    ls "$dir/default/crashes/" >&2
    failed=1
  fi
done
exit "$failed"
