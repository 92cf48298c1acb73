#!/usr/bin/env bash
# What building lbagent costs a developer and a user of the client library,
# measured on one commit in a worktree of its own with a target directory of
# its own (so nothing is shared with the caller's builds):
#   - a clean `cargo build --release --workspace` (wall seconds);
#   - an incremental `cargo build --release --workspace` after touching the
#     L5 core's root file (src/lb/lib.rs, or src/lb/mod.rs before the
#     workspace split);
#   - the sizes of liblbagent_c.so and liblbagent_c.a;
#   - `pip install .` into a fresh venv (maturin preinstalled, build isolation
#     off so that only the crate is timed) and the size of the extension module
#     it installs.
# Usage: perf/build_cost.sh [COMMIT]   (default HEAD); prints one line per
# figure as `name value`. Quote before/after pairs from one invocation each,
# run back to back on the same machine.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
commit="${1:-HEAD}"
work="$(mktemp -d /tmp/lbagent-build-cost.XXXXXX)"
cleanup() { git -C "$repo" worktree remove --force "$work/tree" >/dev/null 2>&1 || true; rm -rf "$work"; }
trap cleanup EXIT
git -C "$repo" worktree add --detach "$work/tree" "$commit" >/dev/null 2>&1
cd "$work/tree"
export CARGO_TARGET_DIR="$work/target"
sha="$(git rev-parse --short HEAD)"
echo "commit $sha"
cargo fetch --locked >/dev/null 2>&1
t0=$(date +%s.%N)
cargo build --release --workspace --locked --quiet
t1=$(date +%s.%N)
printf 'clean_release_build_s %.1f\n' "$(echo "$t1 - $t0" | bc)"
if [[ -f src/lb/lib.rs ]]; then lbroot=src/lb/lib.rs; else lbroot=src/lb/mod.rs; fi
touch "$lbroot"
t0=$(date +%s.%N)
cargo build --release --workspace --locked --quiet
t1=$(date +%s.%N)
printf 'incremental_after_touch_lb_s %.1f\n' "$(echo "$t1 - $t0" | bc)"
printf 'liblbagent_c_so_bytes %s\n' "$(stat -c %s "$CARGO_TARGET_DIR/release/liblbagent_c.so")"
printf 'liblbagent_c_a_bytes %s\n' "$(stat -c %s "$CARGO_TARGET_DIR/release/liblbagent_c.a")"
python3 -m venv "$work/venv"
export PATH="$work/venv/bin:$PATH"
"$work/venv/bin/pip" install --quiet "maturin>=1.5,<2" >/dev/null
# A target directory pip's build has to itself: the clean cost a user pays.
export CARGO_TARGET_DIR="$work/pip-target"
t0=$(date +%s.%N)
"$work/venv/bin/pip" install --quiet --no-build-isolation . >/dev/null
t1=$(date +%s.%N)
printf 'pip_install_s %.1f\n' "$(echo "$t1 - $t0" | bc)"
ext="$(find "$work/venv/lib" -path '*lbagent/_native*.so' | head -n 1)"
printf 'python_extension_bytes %s\n' "$(stat -c %s "$ext")"
