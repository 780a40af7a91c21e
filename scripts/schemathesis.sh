#!/usr/bin/env bash
# schemathesis (from PyPI, in a venv under target/) against the debug server binary on the tiny
# fixture model with the dense fixture as its reference (so that /kld and /diff compute rather
# than answer 404), on 127.0.0.1 with an API key. Every check schemathesis has, except
# positive_data_acceptance (see docs/reliability.md: the schema cannot state the vocabulary
# size or the tokenizer's token count, so schema-valid bodies can be 422 by design).
# Exits non-zero on any failure. SCHEMATHESIS_EXAMPLES (default 50) examples per operation;
# SCHEMATHESIS_EXCLUDE: the checks to leave out instead (default positive_data_acceptance;
# empty: none).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p "${CARGO_TARGET_DIR:-target}"
target="$(cd "${CARGO_TARGET_DIR:-target}" && pwd)"
venv="${SCHEMATHESIS_VENV:-$target/schemathesis-venv}"
version=4.32.5
if [ "$("$venv/bin/schemathesis" --version 2>/dev/null)" != "schemathesis, version $version" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "schemathesis==$version"
fi
cargo build -q -p exactscore-server
bin="$target/debug/exactscore-server"
key="st-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
log="$target/schemathesis-server.log"
report="$target/schemathesis-report"
EXACTSCORE_API_KEY="$key" RUST_LOG=warn,exactscore_server=info "$bin" --host 127.0.0.1 --port 0 \
  --reference-model tests/fixtures/llama-dense-bf16 \
  --max-input-tokens 256 --max-batch-tokens 4096 >"$log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true' EXIT
addr=""
for _ in $(seq 1 600); do
  addr="$(sed -n 's/.*ready addr=\([0-9.:]*\).*/\1/p' "$log" | head -1)"
  [ -n "$addr" ] && break
  kill -0 "$pid" 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
[ -n "$addr" ] || { echo "server did not start" >&2; cat "$log"; exit 1; }
case "$addr" in 127.0.0.1:*) ;; *) echo "not loopback: $addr" >&2; exit 1 ;; esac
echo "server at $addr (pid $pid)"
exclude=()
[ -n "${SCHEMATHESIS_EXCLUDE-positive_data_acceptance}" ] &&
  exclude=(--exclude-checks "${SCHEMATHESIS_EXCLUDE-positive_data_acceptance}")
start=$(date +%s)
status=0
# Run inside target/ so that schemathesis' own cache (.schemathesis/) lands there.
(cd "$target" && "$venv/bin/schemathesis" --no-color run "http://$addr/openapi.json" \
  --header "Authorization: Bearer $key" \
  --checks all "${exclude[@]}" \
  --max-examples "${SCHEMATHESIS_EXAMPLES:-50}" --seed "${SCHEMATHESIS_SEED:-1}" \
  --workers 2 --request-timeout 30 --generation-database none \
  --report junit --report-dir "$report") || status=$?
echo "schemathesis: exit $status in $(( $(date +%s) - start )) s; report in $report"
kill -0 "$pid" || { echo "the server died" >&2; cat "$log"; exit 1; }
curl -sf "http://$addr/health/ready" >/dev/null || { echo "server not ready after the run" >&2; exit 1; }
exit "$status"
