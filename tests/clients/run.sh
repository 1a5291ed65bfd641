#!/usr/bin/env bash
# The real-client step: the official Python clients (ollama, openai, anthropic,
# langchain-ollama; pinned in requirements.txt) run tests/clients/real_clients.py, and
# ollama-js (pinned in js/package.json) runs tests/clients/js/real_clients.mjs, through oqp in
# single-box mode, auth on, in front of a mixed fleet: the fake Ollama (models llama3.2 and
# all-minilm) and two llama-servers (scripts/setup.sh builds them; models tiny-chat and
# tiny-embed), so that the same clients reach both kinds of host through one OLLAMA_HOST;
# then tests/clients/tls_clients.py through a second oqp whose proxy port serves TLS with a
# certificate of a throwaway CA (test-ca), the clients given the CA bundle. Everything runs
# on free loopback ports and is stopped on exit, whatever happens.
#
#   tests/clients/run.sh            # from anywhere; builds the binaries
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

echo "-- ollama-js (tests/clients/js)"
(cd tests/clients/js && npm ci --silent --no-audit --no-fund)

llama_dir=${OQP_LLAMA_SERVER_DIR:-${OQP_CACHE_DIR:-$HOME/.cache/oqp}/llama-server-11434.0.0}
for file in llama-server tiny.gguf tiny-embed.gguf; do
  [ -s "$llama_dir/$file" ] || { echo "$llama_dir/$file is missing: run scripts/setup.sh" >&2; exit 1; }
done

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
    echo "-- llama-server logs (tail)"
    tail -n 20 "$work/llama-chat.log" "$work/llama-embed.log" 2>/dev/null || true
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

# The engines, one thread each (two shared cores run CI). They load while oqp starts.
echo "-- starting two llama-servers (tiny-chat, tiny-embed)"
chat_port=$(free_port)
"$llama_dir/llama-server" -m "$llama_dir/tiny.gguf" --alias tiny-chat -t 1 -tb 1 --no-webui \
  --host 127.0.0.1 --port "$chat_port" >"$work/llama-chat.log" 2>&1 &
pids+=($!)
embed_port=$(free_port)
"$llama_dir/llama-server" -m "$llama_dir/tiny-embed.gguf" --alias tiny-embed -t 1 -tb 1 --no-webui \
  --embedding --pooling mean --host 127.0.0.1 --port "$embed_port" >"$work/llama-embed.log" 2>&1 &
pids+=($!)

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
    - {url: "http://127.0.0.1:$chat_port", name: llama-chat, kind: openai, model_sync_interval: 1}
    - {url: "http://127.0.0.1:$embed_port", name: llama-embed, kind: openai, model_sync_interval: 1}
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
# Ready when oqp answers and lists every model of the fleet (the engines loaded and polled).
"$python" - "$proxy_port" "$key" <<'PY'
import json, sys, time, urllib.request
base, key = f"http://127.0.0.1:{sys.argv[1]}", sys.argv[2]
wanted = {"llama3.2", "all-minilm", "tiny-chat", "tiny-embed"}
deadline = time.monotonic() + 90
names = set()
while True:
    try:
        request = urllib.request.Request(f"{base}/api/tags", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=1) as response:
            names = {m["name"].split(":")[0] for m in json.load(response)["models"]}
            if wanted <= names:
                break
    except (OSError, ValueError, KeyError):
        pass
    if time.monotonic() > deadline:
        sys.exit(f"oqp did not list {sorted(wanted)} at {base}/api/tags (listed {sorted(names)})")
    time.sleep(0.1)
PY

echo "-- running the clients"
OLLAMA_HOST="http://127.0.0.1:$proxy_port" OLLAMA_API_KEY="$key" OQP_SPENT_KEY="$spent_key" \
  OQP_CHAT_MODEL=llama3.2 OQP_EMBED_MODEL=all-minilm \
  OQP_ENGINE_CHAT_MODEL=tiny-chat OQP_ENGINE_EMBED_MODEL=tiny-embed \
  "$python" tests/clients/real_clients.py
OLLAMA_HOST="http://127.0.0.1:$proxy_port" OLLAMA_API_KEY="$key" \
  OQP_CHAT_MODEL=llama3.2 OQP_EMBED_MODEL=all-minilm \
  OQP_ENGINE_CHAT_MODEL=tiny-chat OQP_ENGINE_EMBED_MODEL=tiny-embed \
  node tests/clients/js/real_clients.mjs

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

# Waits until $1/health answers 200 (bounded), trusting the CA bundle $2.
wait_for_health() {
  "$python" - "$1" "$2" <<'PY'
import ssl, sys, time, urllib.request
url, ca = sys.argv[1] + "/health", sys.argv[2]
context = ssl.create_default_context(cafile=ca)
deadline = time.monotonic() + 30
while True:
    try:
        with urllib.request.urlopen(url, timeout=1, context=context) as response:
            if response.status == 200:
                break
    except Exception:
        pass
    if time.monotonic() > deadline:
        sys.exit(f"{url} never answered 200")
    time.sleep(0.1)
PY
}

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
