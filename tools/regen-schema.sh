#!/usr/bin/env bash
# Regenerates the Rust code of schema/lbagent.fbs with the pinned flatc.
#
#   tools/regen-schema.sh           write src/wire/gen/lbagent_generated.rs
#   tools/regen-schema.sh --check   exit 1 (with the diff) when the checked-in
#                                   file is not what the schema generates now
#
# The flatc binary is built from source by tools/flatc (the `flatc` crate,
# flatbuffers 23.5.26, matching the `flatbuffers = "=23.5.26"` runtime); the
# first build takes a minute or two, later runs reuse tools/flatc/target.
# Works from any directory.
set -euo pipefail

readonly FLATC_VERSION="23.5.26"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly root
readonly schema="schema/lbagent.fbs"
readonly generated="src/wire/gen/lbagent_generated.rs"

check=0
case "${1:-}" in
  "") ;;
  --check) check=1 ;;
  -h | --help)
    sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
  *)
    echo "regen-schema: unknown argument '$1' (use --check or nothing)" >&2
    exit 2
    ;;
esac

# Build (if needed) and locate the pinned flatc.
flatc="$(cargo run --quiet --release --locked --manifest-path "$root/tools/flatc/Cargo.toml")"
version="$("$flatc" --version)"
if [[ "$version" != "flatc version $FLATC_VERSION" ]]; then
  echo "regen-schema: $flatc is '$version', expected flatc version $FLATC_VERSION" >&2
  exit 2
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# Run from the repository root with a relative schema path and a fixed locale
# so that the output depends on nothing but the schema and the flatc version.
(cd "$root" && LC_ALL=C "$flatc" --rust -o "$tmp" "$schema")
out="$tmp/lbagent_generated.rs"
if [[ ! -f "$out" ]]; then
  echo "regen-schema: flatc did not produce $(basename "$out")" >&2
  exit 2
fi

if ((check)); then
  if [[ ! -f "$root/$generated" ]]; then
    echo "regen-schema: $generated is missing: run tools/regen-schema.sh" >&2
    exit 1
  fi
  if ! diff -u --label "$generated (checked in)" --label "$generated (from $schema)" \
    "$root/$generated" "$out"; then
    echo "regen-schema: $generated is out of date with $schema: run tools/regen-schema.sh and commit the result" >&2
    exit 1
  fi
  echo "regen-schema: $generated is current (flatc $FLATC_VERSION)"
else
  mkdir -p "$root/$(dirname "$generated")"
  cp "$out" "$root/$generated"
  echo "regen-schema: wrote $generated (flatc $FLATC_VERSION)"
fi
