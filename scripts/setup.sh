#!/usr/bin/env bash
# Installs what the test suite needs beyond the Rust toolchain, on Debian.
# Idempotent: installs only what is missing.
set -euo pipefail

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
# Headless Chromium renders /dashboard in tests/tests/e2e/observability.rs (with a font for its
# text); the test skips without it, except in CI.
command -v chromium >/dev/null 2>&1 || need+=(chromium fonts-dejavu-core)
# The real-client step (tests/clients/run.sh) makes a virtual environment for the pinned clients.
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3 python3-venv)
if ((${#need[@]})); then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
