#!/usr/bin/env bash
# Long single sequences on the lent GPU machine (issue 36): 8B-shape W4A16 /score and /kld at
# 32K and 128K tokens (time, tokens/s, peak GPU memory), transformers (sdpa) on the same weights
# at 32K, and /kld at 128K with the bf16 reference on the second GPU. Binaries come xz- or
# gzip-compressed in .device/; results go to $OUT.
#   bash scripts/device_long_context.sh [score] [kld] [baseline] [kld-other-gpu] [hybrid-two-gpu]
set -uo pipefail
export LD_LIBRARY_PATH=${CUDA_LIB_DIR:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib}:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/exactscore-out}
PY=${PY:-/opt/torch/.venv/bin/python}
mkdir -p "$OUT"
for b in .device/*.xz .device/*.gz; do
  [ -f "$b" ] || continue
  name=$(basename "${b%.*}")
  case "$b" in *.xz) xz -dc "$b" ;; *) gzip -dc "$b" ;; esac > "/tmp/$name" && chmod +x "/tmp/$name"
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
status=0
step() {
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/$name.txt"
  local t0=$SECONDS
  "$@" >> "$OUT/$name.txt" 2>&1 || { echo "FAIL $name" | tee -a "$OUT/$name.txt"; status=1; }
  echo "   ($((SECONDS - t0)) s)" >> "$OUT/$name.txt"
}
for part in "${@:-score kld baseline kld-other-gpu}"; do
  for p in $part; do case $p in
    score)
      for ctx in 32768 131072; do
        step score-$ctx /tmp/exactscore-bench speed --shape llama3-8b --formats w4a16 \
          --batch 1 --ctx $ctx --iters 2 --attention flash
      done ;;
    kld)
      step kld-32768 /tmp/exactscore-bench kld --shape llama3-8b --format w4a16 --batch 1 \
        --ctx 32768 --iters 2 ;;
    baseline)
      step baseline-32768 "$PY" scripts/baseline_transformers.py --shape llama3-8b \
        --weights w4a16 --batch 1 --ctx 32768 --iters 2 --logits-chunk 2048 ;;
    kld-other-gpu)
      step kld-131072-ref-cuda1 /tmp/exactscore-bench pipeline --shape llama3-8b --formats w4a16 \
        --layouts cuda:0 --windows 1 --ctx 131072 --iters 1 --reference-shape llama3-8b \
        --reference-layout cuda:1 ;;
    hybrid-two-gpu)
      # Not long context: Qwen3.5's hybrid layers split over two GPUs, bitwise against one.
      step hybrid-two-gpu /tmp/exactscore-bench pipeline --shape qwen3.5-35b-a3b --formats w4a16 \
        --layouts "cuda:0;cuda:0,cuda:1" --windows 4 --iters 2 --distinct-layers 4 ;;
  esac; done
done
grep -h -E "^\||^==|FAIL|rror|\(.* s\)" "$OUT"/*.txt | tail -60
exit $status
