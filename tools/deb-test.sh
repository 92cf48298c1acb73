#!/usr/bin/env bash
# tools/deb-test.sh: build the Debian package with cargo-deb, check its
# contents, install it on this machine, check the installed configuration
# and units, then remove and purge it and check that nothing is left.
# Run as root (or with sudo) on a Debian/Ubuntu machine; .ci/run calls it.
#
# It packages target/release/lbagent as it is (`cargo deb --no-build`): CI's
# perf/check has just built it. Without one, it builds it first.
# Environment: LBAGENT_DEB_PROFILE (release) packages another profile's
# binary instead (dev: a quick local check of the packaging only).
# Needs: cargo-deb (installed with `cargo install cargo-deb --locked` when
# missing), dpkg, systemd-analyze (Debian package `systemd`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

sudo=""
if [[ "$(id -u)" -ne 0 ]]; then sudo="sudo"; fi
profile="${LBAGENT_DEB_PROFILE:-release}"
dir="$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
[[ "$profile" == dev ]] && bin="$dir/debug/lbagent" || bin="$dir/$profile/lbagent"
out="$dir/debian"

fail() { echo "deb-test: $*" >&2; exit 1; }
say() { printf 'deb-test: %s\n' "$*"; }

if ! cargo deb --version >/dev/null 2>&1; then
  say "installing cargo-deb"
  t0=$SECONDS
  cargo install cargo-deb --locked --quiet
  say "cargo-deb installed in $((SECONDS - t0)) s"
fi
if [[ ! -x "$bin" ]]; then
  say "no $bin: building it"
  cargo build --locked --profile "$profile" --bin lbagent
fi

# 1. Build. --fast: lighter compression, the package is only installed here;
# --strip: the release profile keeps line tables (debug = 1) for perf/, which
# cargo-deb would otherwise ship (a 41 MB binary instead of 6.4 MB).
rm -rf "$out"
cargo deb --no-build --fast --strip --profile "$profile" -o "$out/" >/dev/null
deb="$(ls "$out"/lbagent_*.deb)"
say "built $deb ($(du -h "$deb" | cut -f1))"

# 2. Contents and control fields.
contents="$(dpkg-deb -c "$deb")"
for path in ./usr/bin/lbagent ./etc/lbagent/lbagent.toml \
  ./usr/lib/systemd/system/lbagent.service \
  ./usr/lib/systemd/system/lbagent-dnsserver.service \
  ./usr/lib/systemd/system/lbagent-reporter.service \
  ./usr/share/doc/lbagent/README.md ./usr/share/doc/lbagent/lbagent-alerts.yml \
  ./usr/share/doc/lbagent/lbagent-dashboard.json; do
  grep -q " $path\$" <<<"$contents" || fail "the package lacks $path"
done
grep -q '^-rwxr-xr-x .* ./usr/bin/lbagent$' <<<"$contents" || fail "usr/bin/lbagent is not mode 755"
info="$(dpkg-deb -I "$deb")"
grep -q '^ Depends:.*adduser' <<<"$info" || fail "Depends lacks adduser: $info"
[[ "$(dpkg-deb -f "$deb" Package)" == lbagent ]] || fail "the package is not named lbagent"
ctl="$(mktemp -d)"
trap 'rm -rf "$ctl"' EXIT
dpkg-deb -e "$deb" "$ctl"
grep -qx /etc/lbagent/lbagent.toml "$ctl/conffiles" || fail "/etc/lbagent/lbagent.toml is not a conffile"
for script in postinst postrm prerm; do
  [[ -x "$ctl/$script" ]] || fail "no executable $script"
  sh -n "$ctl/$script" || fail "$script does not parse"
done
say "contents ok: binary, conffile, three units, maintainer scripts"

# 3. Install (apt resolves Depends) and check what it installed.
if dpkg-query -W lbagent >/dev/null 2>&1; then
  fail "lbagent is already installed here; purge it first (dpkg -P lbagent)"
fi
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$deb" >/dev/null
getent passwd lbagent >/dev/null || fail "postinst did not create the lbagent user"
/usr/bin/lbagent agent --check --config /etc/lbagent/lbagent.toml
/usr/bin/lbagent dnsserver --check --config /etc/lbagent/lbagent.toml
/usr/bin/lbagent reporter --check --config /etc/lbagent/lbagent.toml
units=(/usr/lib/systemd/system/lbagent.service
  /usr/lib/systemd/system/lbagent-dnsserver.service
  /usr/lib/systemd/system/lbagent-reporter.service)
# systemd-analyze verify exits 0 on some parse errors (it ignores the
# line): any message fails the check.
verify="$(systemd-analyze verify "${units[@]}" 2>&1)" || fail "systemd-analyze verify: $verify"
[[ -z "$verify" ]] || fail "systemd-analyze verify: $verify"
# The agent's own directories (docs: The trust model): systemd makes them
# for User=lbagent, and the packaged config names them.
for line in RuntimeDirectory=lbagent RuntimeDirectoryMode=0755 StateDirectory=lbagent StateDirectoryMode=0755; do
  grep -qx "$line" /usr/lib/systemd/system/lbagent.service || fail "lbagent.service lacks $line"
done
for line in 'heartbeat_path = "/run/lbagent/heartbeat"' 'snapshot_path = "/var/lib/lbagent/routes.snapshot"' 'dir = "/run/lbagent"'; do
  grep -qxF "$line" /etc/lbagent/lbagent.toml || fail "/etc/lbagent/lbagent.toml lacks $line"
done
say "installed: user lbagent, config checks ok, systemd-analyze verify clean, the agent's directories"

# 4. Remove (the conffile stays), then purge (everything goes).
$sudo mkdir -p /var/lib/lbagent /run/lbagent
$sudo touch /var/lib/lbagent/lbagent.db /run/lbagent/heartbeat
$sudo dpkg -r lbagent >/dev/null
[[ ! -e /usr/bin/lbagent ]] || fail "remove left /usr/bin/lbagent"
[[ -e /etc/lbagent/lbagent.toml ]] || fail "remove deleted the conffile"
[[ -e /var/lib/lbagent/lbagent.db ]] || fail "remove deleted the state (only purge may)"
$sudo dpkg -P lbagent >/dev/null
for path in /etc/lbagent /var/lib/lbagent /run/lbagent "${units[@]}"; do
  [[ ! -e "$path" ]] || fail "purge left $path"
done
if dpkg-query -W lbagent >/dev/null 2>&1; then fail "purge left lbagent in dpkg's database"; fi
say "removed and purged cleanly"
