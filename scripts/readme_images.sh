#!/usr/bin/env bash
# Regenerates the README's images under docs/img/:
#   tiny-kld.png      `exactscore compare --plot` of `exactscore kld` runs of the bundled tiny
#                     checkpoints (W4A16 g128, W8A16 channel, NVFP4A16, FP8 weights only) against
#                     their dense bf16 original, 16 WikiText-2 windows of 512 tokens, f32 on CPU;
#   smollm2-w4a16-diff.png
#                     `exactscore diff --from` the saved SmolLM2-135M W4A16 report
#                     (docs/bench/2026-11-26-cpu-smollm2-attribution.json).
# Each server runs on a free loopback port and is stopped after its run. PROFILE=release (default
# debug) builds and runs the release binaries; SERVER_BIN=PATH uses a server binary built
# elsewhere. About a minute on 2 cores once built.
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${PROFILE:-debug}"
flags=()
[ "$profile" = release ] && flags=(--release)
target="${CARGO_TARGET_DIR:-target}/$profile"
if [ -z "${SERVER_BIN:-}" ]; then
  cargo build -q "${flags[@]}" -p exactscore-server --bin exactscore-server
  SERVER_BIN="$target/exactscore-server"
fi
cargo build -q "${flags[@]}" -p exactscore-client --bin exactscore
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

reports=()
for model in llama-w4a16-g128 llama-w8a16-channel llama-nvfp4a16 llama-fp8-dynamic; do
  p="$(port)"
  "$SERVER_BIN" --model "tests/fixtures/$model" --port "$p" \
    --reference-model tests/fixtures/llama-dense-bf16 --activation-quant off \
    >"$out/$model.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    grep -q "ready addr=" "$out/$model.log" && break
    sleep 0.1
  done
  "$target/exactscore" kld --server "http://127.0.0.1:$p" --dataset wikitext2 --ctx 512 \
    --max-windows 16 --no-progress --json "$out/$model.json" >/dev/null
  kill "$pid"
  wait "$pid" || true
  reports+=("$out/$model.json")
done
"$target/exactscore" compare "${reports[@]}" --plot docs/img/tiny-kld.png
"$target/exactscore" diff --from docs/bench/2026-11-26-cpu-smollm2-attribution.json \
  --plot docs/img/smollm2-w4a16-diff.png >/dev/null
ls -l docs/img/tiny-kld.png docs/img/smollm2-w4a16-diff.png
