#!/usr/bin/env bash
# The client library and the bindings built on it carry none of the
# servers' dependencies: `cargo tree` of lbagent-client, lbagent-capi and
# lbagent-python (normal and build dependencies, every feature as built)
# must name none of glommio, SQLite, PostgreSQL, tokio or clap. Run by
# .ci/run; prints each tree's size and fails naming what crept in.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

forbidden='^(glommio|rusqlite|libsqlite3-sys|postgres|tokio|tokio-postgres|clap|clap_builder) '
status=0
for pkg in lbagent-client lbagent-capi lbagent-python; do
  tree="$(cargo tree --locked -p "$pkg" -e normal,build --prefix none --no-dedupe | sort -u)"
  crates="$(printf '%s\n' "$tree" | awk '{print $1}' | sort -u | wc -l)"
  bad="$(printf '%s\n' "$tree" | grep -E "$forbidden" || true)"
  if [[ -n "$bad" ]]; then
    echo "client-deps-check: $pkg depends on a server crate:" >&2
    printf '  %s\n' $bad >&2
    echo "  (cargo tree -p $pkg -i <crate> shows the path; the client layers must not depend on the agent, the servers or the binary)" >&2
    status=1
  else
    echo "$pkg: $crates crates, none of glommio, SQLite, PostgreSQL, tokio, clap"
  fi
done
exit "$status"
