#!/usr/bin/env bash
# Issue 37's GPU measurements, on a lent machine with two GPUs (binaries xz- or gzip-compressed
# in .device/; results in $OUT):
#   bash scripts/device_reliability.sh [sticky] [wait-behind]
# sticky:      an 8B-shape W4A16 server, two replicas each pipelined over both GPUs, a sticky
#              device error injected into replica 0 after 20 batches: /score from 4 connections
#              until the server stops; every 200 must be bitwise equal, the exit code 1 and the
#              exit within the drain timeout (10 s) of the first 503.
# wait-behind: a 70B-shape W4A16 server with a 70B-shape NVFP4A16 reference on the other GPU:
#              small /score latencies while a /kld of 8 x 2048 tokens and while an attribution
#              (/diff, layers 0-1, 1 x 2048 tokens) runs.
set -uo pipefail
export LD_LIBRARY_PATH=${CUDA_LIB_DIR:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib}:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/exactscore-out}
TOKENIZER=${TOKENIZER:-tests/fixtures/llama-w4a16-g128}
mkdir -p "$OUT"
for b in .device/*.xz .device/*.gz; do
  [ -f "$b" ] || continue
  name=$(basename "${b%.*}")
  case "$b" in *.xz) xz -dc "$b" ;; *) gzip -dc "$b" ;; esac > "/tmp/$name" && chmod +x "/tmp/$name"
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
status=0
port=8790

# A random-weight checkpoint of shape $1 in format $2 (4 distinct layers repeated), once.
checkpoint() {
  local dir=/tmp/ckpt-$1-$2
  [ -f "$dir/done" ] || { rm -rf "$dir" && /tmp/exactscore-bench write-checkpoint --shape "$1" \
    --format "$2" --out "$dir" --tokenizer "$TOKENIZER" --distinct-layers 4 >&2 \
    && touch "$dir/done"; } || return 1
  echo "$dir"
}

wait_ready() {
  python3 - "$port" <<'PY'
import sys, time, urllib.request
deadline = time.time() + 400
while time.time() < deadline:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health/ready", timeout=1); sys.exit(0)
    except Exception:
        time.sleep(0.1)
sys.exit("server not ready after 400 s")
PY
}

for part in ${@:-sticky wait-behind}; do case $part in
  sticky)
    dir=$(checkpoint llama3-8b w4a16) || { status=1; continue; }
    /tmp/exactscore-server --model "$dir" --device cuda:0,cuda:1,cuda:0,cuda:1 --replicas 2 \
      --dtype bf16 --drain-timeout-secs 10 --inject-fault device-lost-after:20@0 --port $port \
      > "$OUT/sticky-server.log" 2>&1 &
    server=$!
    wait_ready || { echo "FAIL sticky: not ready"; tail "$OUT/sticky-server.log"; status=1; continue; }
    python3 scripts/reliability_probe.py sticky http://127.0.0.1:$port | tee "$OUT/sticky.txt" \
      || status=1
    wait $server; rc=$?
    first=$(awk '/^first_503_epoch/ {print $2}' "$OUT/sticky.txt")
    echo "sticky: server exit $rc, $(awk "BEGIN{printf \"%.2f\", $(date +%s.%N) - $first}") s" \
      "after the first 503 at the latest (drain timeout 10 s)" | tee -a "$OUT/sticky.txt"
    [ "$rc" = 1 ] || status=1
    ;;
  wait-behind)
    dir=$(checkpoint llama3-70b w4a16) && ref=$(checkpoint llama3-70b nvfp4a16) \
      || { status=1; continue; }
    /tmp/exactscore-server --model "$dir" --device cuda:0 --reference-model "$ref" \
      --reference-device cuda:1 --dtype bf16 --port $port > "$OUT/wait-server.log" 2>&1 &
    server=$!
    wait_ready || { echo "FAIL wait-behind: not ready"; tail "$OUT/wait-server.log"; status=1; continue; }
    python3 scripts/reliability_probe.py wait-behind http://127.0.0.1:$port kld 8 2048 \
      | tee -a "$OUT/wait-behind.txt" || status=1
    python3 scripts/reliability_probe.py wait-behind http://127.0.0.1:$port attribution 1 2048 \
      | tee -a "$OUT/wait-behind.txt" || status=1
    kill -TERM $server; wait $server
    ;;
  *) echo "usage: $0 [sticky] [wait-behind]" >&2; exit 2 ;;
esac; done
exit $status
