#!/usr/bin/env bash
# tools/docs/check.sh: what CI checks of the documentation.
#   1. `mdbook build docs`, failing on any warning or error it prints (a
#      missing page or include, a broken SUMMARY);
#   2. every relative link of the book and of README/CONTRIBUTING/CHANGELOG
#      resolves, fragments included (tools/docs/links.py);
#   3. the configuration reference is what src/config/lbagent.toml
#      generates, and `lbagent agent --print-config` prints that file
#      (tools/docs/config-ref.py --check --binary BIN);
#   4. `lbagent … --help` parses for every command the book and the README
#      show (tools/docs/commands.py BIN).
# Environment: LBAGENT_BIN (default target/debug/lbagent, built when missing).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

fail() { echo "docs-check: $*" >&2; exit 1; }

out="$(mdbook build docs 2>&1)" || fail "mdbook build docs failed: $out"
printf '%s\n' "$out"
if grep -Eq '(WARN|ERROR)' <<<"$out"; then
  fail "mdbook build docs printed warnings or errors (above)"
fi
python3 tools/docs/links.py

bin="${LBAGENT_BIN:-target/debug/lbagent}"
if [[ ! -x "$bin" ]]; then
  cargo build --locked --bin lbagent
fi
python3 tools/docs/config-ref.py --check --binary "$bin"
python3 tools/docs/commands.py "$bin"
