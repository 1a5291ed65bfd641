#!/usr/bin/env bash
# The real-client step: the official Python clients (ollama, openai, anthropic; pinned in
# requirements.txt) run tests/clients/real_clients.py through oqp in
# single-box mode, auth on, in front of the fake Ollama; then
# tests/clients/tls_clients.py through a second oqp whose proxy port serves TLS
# with a certificate of a throwaway CA (test-ca), the clients given the CA
# bundle. Everything runs on free loopback ports and is stopped on exit,
# whatever happens.
#
#   tests/clients/run.sh            # from anywhere; builds the two binaries
#   OQP_VENV=/path/to/venv tests/clients/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

target=${CARGO_TARGET_DIR:-target}/debug
venv=${OQP_VENV:-.venv}

echo "-- building oqp-controlplane, fake-ollama, test-ca and oqpctl"
cargo build --locked -q -p oqp-controlplane --bin oqp-controlplane -p oqp-tests --bin fake-ollama \
  --bin test-ca -p oqpctl --bin oqpctl

echo "-- python environment ($venv)"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r tests/clients/requirements.txt
python="$venv/bin/python"

work=$(mktemp -d)
pids=()
cleanup() {
  local status=$?
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ "$status" -ne 0 ]; then
    echo "-- oqp log (tail)"; tail -n 40 "$work/oqp.log" 2>/dev/null || true
    echo "-- oqp over TLS log (tail)"; tail -n 20 "$work/oqp-tls.log" 2>/dev/null || true
    echo "-- fake log (tail)"; tail -n 20 "$work/fake.log" 2>/dev/null || true
  fi
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT INT TERM

free_port() {
  "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Waits until $1 has a first line (the fake prints its address there).
wait_for_line() {
  for _ in $(seq 200); do
    [ -s "$1" ] && return 0
    sleep 0.05
  done
  echo "no address in $1" >&2
  return 1
}

echo "-- starting the fake Ollama"
"$target/fake-ollama" --model llama3.2 --loaded llama3.2 --embedding-model all-minilm \
  >"$work/fake.addr" 2>"$work/fake.log" &
pids+=($!)
wait_for_line "$work/fake.addr"
fake=$(head -n 1 "$work/fake.addr")

proxy_port=$(free_port)
control_port=$(free_port)
key="sk-real-clients-$("$python" -c 'import secrets; print(secrets.token_hex(12))')"
spent_key="sk-spent-$("$python" -c 'import secrets; print(secrets.token_hex(12))')"
operator_key="sk-operator-$("$python" -c 'import secrets; print(secrets.token_hex(12))')"
mkdir -p "$work/state"
cat >"$work/config.yml" <<YAML
proxy:
  host: "127.0.0.1"
  port: $proxy_port
ollama:
  hosts:
    - url: "http://$fake"
      name: fake
auth:
  enabled: true
  keys:
    - key: "$key"
      client_id: real-clients
    - key: "$spent_key"
      client_id: spent
      budget: {tokens: 1, window: 1d}
    - key: "$operator_key"
      client_id: operator
      scope: management
control_plane:
  listen: "127.0.0.1:$control_port"
  state_dir: "$work/state"
YAML

echo "-- starting oqp (single box) on 127.0.0.1:$proxy_port"
OQP_LOG=${OQP_LOG:-warn} "$target/oqp-controlplane" --config "$work/config.yml" --with-dataplane \
  >"$work/oqp.log" 2>&1 &
pids+=($!)
# Waits until $1/health answers 200 (bounded), trusting the CA bundle $2 if given.
wait_for_health() {
  "$python" - "$1" "${2:-}" <<'PY'
import ssl, sys, time, urllib.request
url, ca = sys.argv[1] + "/health", sys.argv[2]
context = ssl.create_default_context(cafile=ca) if ca else None
deadline = time.monotonic() + 30
while True:
    try:
        with urllib.request.urlopen(url, timeout=1, context=context) as response:
            if response.status == 200:
                break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit(f"oqp did not answer {url}")
    time.sleep(0.05)
PY
}
wait_for_health "http://127.0.0.1:$proxy_port"

echo "-- running the clients"
OLLAMA_HOST="http://127.0.0.1:$proxy_port" OLLAMA_API_KEY="$key" OQP_SPENT_KEY="$spent_key" \
  OQP_CHAT_MODEL=llama3.2 OQP_EMBED_MODEL=all-minilm \
  "$python" tests/clients/real_clients.py

# What the clients used, as the operator sees it (a management key sees every client's
# usage; the clients' own keys see only theirs): the data plane reports about once a
# second, so the table is asked for until the agents' routes are in it (bounded).
echo "-- oqpctl usage after the clients"
for _ in $(seq 100); do
  table=$(OQPCTL_KEY="$operator_key" OQP_CONTROL_PLANE="http://127.0.0.1:$control_port" NO_COLOR=1 \
    "$target/oqpctl" usage --by client,model 2>&1) || true
  grep -q "real-clients" <<<"$table" && grep -q "spent" <<<"$table" && break
  sleep 0.1
done
echo "$table"
grep -q "real-clients" <<<"$table" && grep -q "spent" <<<"$table"

# The same clients over TLS: a second oqp in front of the same fake, its proxy port serving a
# certificate for 127.0.0.1 from a CA made for this run; the clients trust that CA's bundle.
echo "-- starting oqp with TLS on its proxy port"
"$target/test-ca" "$work/tls"
tls_port=$(free_port)
tls_control_port=$(free_port)
mkdir -p "$work/state-tls"
cat >"$work/config-tls.yml" <<YAML
proxy:
  host: "127.0.0.1"
  port: $tls_port
  tls:
    cert_file: "$work/tls/server.crt"
    key_file: "$work/tls/server.key"
ollama:
  hosts:
    - url: "http://$fake"
      name: fake
auth:
  enabled: true
  keys:
    - key: "$key"
      client_id: real-clients
control_plane:
  listen: "127.0.0.1:$tls_control_port"
  state_dir: "$work/state-tls"
YAML
OQP_LOG=${OQP_LOG:-warn} "$target/oqp-controlplane" --config "$work/config-tls.yml" \
  --with-dataplane >"$work/oqp-tls.log" 2>&1 &
pids+=($!)
wait_for_health "https://127.0.0.1:$tls_port" "$work/tls/ca.pem"

echo "-- running the clients over TLS"
OQP_TLS_URL="https://127.0.0.1:$tls_port" OLLAMA_API_KEY="$key" OQP_CA_BUNDLE="$work/tls/ca.pem" \
  OQP_CHAT_MODEL=llama3.2 "$python" tests/clients/tls_clients.py
