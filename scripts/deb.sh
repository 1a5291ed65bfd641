#!/usr/bin/env bash
# Builds oqp's Debian package from a staged tree with `dpkg-deb --build`.
#
#   scripts/deb.sh [--no-build] [--bin-dir DIR] [--out DIR] [PROFILE]
#
# PROFILE is the cargo profile whose binaries are packaged: `dist` (the default: release
# without debug info), `release`, or `debug` (what a test run already built: the package test
# in tests/tests/deb.rs uses it to keep CI short). Without --no-build the binaries are built
# first. --bin-dir takes them from DIR instead of target/PROFILE. The package is written to
# --out (default target/debian) and its path printed last.
#
# Why dpkg-deb and not cargo-deb: dpkg-deb ships with every Debian and Ubuntu, so building the
# package needs no tool beyond the Rust toolchain and what the system has, and the staged tree
# below is the whole recipe, readable in one place.
#
# The package: /usr/bin/oqp-controlplane, oqp-dataplane, oqpctl; the systemd units of
# examples/systemd (binaries in /usr/bin, run as the system user `oqp` rather than a
# DynamicUser, key credentials left for the operator to enable); /etc/oqp/config.yml (the
# quick-start config, a conffile: an upgrade never overwrites the operator's edits); the
# `oqp` system user and /var/lib/oqp, created by postinst.
set -euo pipefail
cd "$(dirname "$0")/.."

build=1
bin_dir=""
out_dir=""
profile="dist"
while [ $# -gt 0 ]; do
    case "$1" in
        --no-build) build=0 ;;
        --bin-dir) bin_dir="$2"; shift ;;
        --out) out_dir="$2"; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        -*) echo "deb.sh: unknown option $1" >&2; exit 2 ;;
        *) profile="$1" ;;
    esac
    shift
done

target="${CARGO_TARGET_DIR:-target}"
if [ "$profile" = "dev" ]; then profile="debug"; fi
if [ -z "$bin_dir" ]; then bin_dir="$target/$profile"; fi
if [ -z "$out_dir" ]; then out_dir="$target/debian"; fi
binaries=(oqp-controlplane oqp-dataplane oqpctl)

if [ "$build" = 1 ]; then
    cargo_profile="$profile"
    if [ "$profile" = "debug" ]; then cargo_profile="dev"; fi
    cargo build --locked --profile "$cargo_profile" \
        -p oqp-controlplane -p oqp-dataplane -p oqpctl >&2
fi
for binary in "${binaries[@]}"; do
    if [ ! -x "$bin_dir/$binary" ]; then
        echo "deb.sh: $bin_dir/$binary is missing (build it, or drop --no-build)" >&2
        exit 1
    fi
done

version="$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)"
arch="$(dpkg --print-architecture)"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
chmod 0755 "$stage"

install -d -m 0755 "$stage/DEBIAN" "$stage/usr/bin" "$stage/lib/systemd/system" \
    "$stage/etc/oqp" "$stage/usr/share/doc/oqp"
for binary in "${binaries[@]}"; do
    install -m 0755 "$bin_dir/$binary" "$stage/usr/bin/$binary"
done

# The units as examples/systemd documents them, for a package: binaries in /usr/bin, the
# package's system user, and the key credentials commented out (the quick-start config has
# no keys; a unit whose credential file is missing does not start).
for unit in oqp-controlplane oqp-dataplane; do
    {
        echo "# As packaged: /usr/bin, the system user oqp instead of a DynamicUser, and key"
        echo "# credentials commented out (enable those the config names). From examples/systemd:"
        echo "#"
    } >"$stage/lib/systemd/system/$unit.service"
    sed -e 's|/usr/local/bin/|/usr/bin/|g' \
        -e 's|^DynamicUser=yes$|User=oqp\nGroup=oqp|' \
        -e 's|^LoadCredential=\(.*\.key:.*\)$|# LoadCredential=\1|' \
        "examples/systemd/$unit.service" >>"$stage/lib/systemd/system/$unit.service"
    chmod 0644 "$stage/lib/systemd/system/$unit.service"
done

{
    cat examples/quickstart.yml
    printf '\n# The key store, in the unit'"'"'s StateDirectory.\ncontrol_plane:\n  state_dir: /var/lib/oqp\n'
} >"$stage/etc/oqp/config.yml"
chmod 0640 "$stage/etc/oqp/config.yml"
install -m 0644 LICENSE "$stage/usr/share/doc/oqp/copyright"

# The newest glibc symbol version the binaries use is the libc6 they need.
glibc="$(for binary in "${binaries[@]}"; do grep -ao 'GLIBC_2\.[0-9][0-9]*' "$bin_dir/$binary" || true; done \
    | sed 's/GLIBC_//' | sort -V | tail -n 1)"
depends="passwd"
if [ -n "$glibc" ]; then depends="libc6 (>= $glibc), $depends"; fi
installed_kb="$(du -sk --exclude=DEBIAN "$stage" | cut -f1)"

cat >"$stage/DEBIAN/control" <<EOF
Package: oqp
Version: $version
Architecture: $arch
Maintainer: oqp maintainers <oqp@users.noreply.github.com>
Installed-Size: $installed_kb
Depends: $depends
Section: net
Priority: optional
Homepage: https://github.com/oqp/oqp
Description: admission-control proxy for Ollama
 oqp puts one queue in front of one or more Ollama hosts: API keys with
 scopes and ceilings, priority tiers, fair share between clients, caps,
 failover, usage and budgets, Prometheus metrics and a status dashboard.
 This package holds the control plane (oqp-controlplane, which also runs
 the data plane of its own machine), the data plane for other GPU boxes
 (oqp-dataplane), the oqpctl command line, and their systemd units.
EOF

echo /etc/oqp/config.yml >"$stage/DEBIAN/conffiles"

cat >"$stage/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
    if ! getent passwd oqp >/dev/null; then
        useradd --system --user-group --home-dir /var/lib/oqp --no-create-home \
            --shell /usr/sbin/nologin --comment "oqp admission-control proxy" oqp
    fi
    install -d -m 0700 -o oqp -g oqp /var/lib/oqp
    # The config may name key files: readable by the service's group, not by everyone.
    if [ -z "$2" ]; then
        chown root:oqp /etc/oqp /etc/oqp/config.yml
        chmod 0750 /etc/oqp
        chmod 0640 /etc/oqp/config.yml
    fi
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload >/dev/null || true
    fi
fi
exit 0
EOF

cat >"$stage/DEBIAN/prerm" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
    systemctl stop oqp-controlplane.service oqp-dataplane.service >/dev/null 2>&1 || true
fi
exit 0
EOF

cat >"$stage/DEBIAN/postrm" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = purge ]; then
    # The key store goes with the package; the user stays (Debian keeps system users, as
    # files it owned may remain elsewhere).
    rm -rf /var/lib/oqp
fi
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null || true
fi
exit 0
EOF
chmod 0755 "$stage/DEBIAN/postinst" "$stage/DEBIAN/prerm" "$stage/DEBIAN/postrm"

mkdir -p "$out_dir"
deb="$out_dir/oqp_${version}_${arch}.deb"
dpkg-deb --root-owner-group --build "$stage" "$deb" >&2
echo "$deb"
