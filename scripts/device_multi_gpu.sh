#!/usr/bin/env bash
# One model across GPUs, measured on the lent GPU machine (binaries gzipped in .device/, as for
# scripts/device_bench.sh; results in $OUT). Each part is one device command:
#   bash scripts/device_multi_gpu.sh one-gpu    # stages on one GPU: bitwise, speed, OOM retry
#   bash scripts/device_multi_gpu.sh two-gpu    # 8B: check's second-GPU rows, replicas, /kld
#                                               # with the reference on the other GPU
#   bash scripts/device_multi_gpu.sh two-gpu-70b  # 70B W4A16 split vs one GPU, 1/2/4 stages
#                                               # bitwise, a 70B bf16 reference split for /kld
# Exits 1 when a step failed (a bitwise miss, a crash, a failed client run, a speedup under
# the issue's bound: replicas >= 1.9x and the 70B split >= 1.8x one GPU).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bench() { bash "$here/device_bench.sh" "$@" || status=1; }
status=0
export TOKENIZER=${TOKENIZER:-.device/tok-smollm2} ATTENTION=flash
# Timings compare layouts of the same weights; four drawn layers repeated keep the 70B shapes'
# checkpoints quick to build and write.
export DISTINCT_LAYERS=${DISTINCT_LAYERS:-4}
case "${1:-}" in
  one-gpu)
    PIPELINE_ARGS="--windows 8 --iters 3 --distinct-layers $DISTINCT_LAYERS --min-ratio 0.9" \
      bench pipeline bf16,w4a16 "cuda:0;cuda:0,cuda:0;cuda:0,cuda:0,cuda:0,cuda:0"
    bench oom w4a16 9
    ;;
  two-gpu)
    bench check
    PIPELINE_ARGS="--windows 8 --iters 3 --distinct-layers $DISTINCT_LAYERS" \
      bench pipeline w4a16 "cuda:0;cuda:0,cuda:1"
    LABEL=one-gpu bench wikitext w4a16 16
    LABEL=replicas SERVER_DEVICE=cuda:0,cuda:1 SERVER_ARGS="--replicas 2" bench wikitext w4a16 32
    bench same wikitext-ppl-w4a16-one-gpu.json wikitext-ppl-w4a16-replicas.json
    bench speedup one-gpu replicas 1.9
    export TASK=kld MAX_WINDOWS=160
    LABEL=ref-same-gpu bench wikitext w4a16 16
    LABEL=ref-other-gpu SERVER_ARGS="--reference-device cuda:1" bench wikitext w4a16 16
    bench same wikitext-kld-w4a16-ref-same-gpu.json wikitext-kld-w4a16-ref-other-gpu.json
    ;;
  two-gpu-70b)
    export SHAPE=llama3-70b MAX_WINDOWS=${MAX_WINDOWS:-96}
    LABEL=one-gpu bench wikitext w4a16 16
    LABEL=split SERVER_DEVICE=cuda:0,cuda:1 bench wikitext w4a16 32
    LABEL=four-stages SERVER_DEVICE=cuda:0,cuda:0,cuda:1,cuda:1 bench wikitext w4a16 32
    bench same wikitext-ppl-w4a16-one-gpu.json wikitext-ppl-w4a16-split.json
    bench same wikitext-ppl-w4a16-one-gpu.json wikitext-ppl-w4a16-four-stages.json
    bench speedup one-gpu split 1.8
    # The bf16 70B (141 GB) fits no single GPU: split over both, beside an 8B W4A16 on GPU 0.
    SHAPE=llama3-8b PIPELINE_ARGS="--windows 2 --iters 2 --distinct-layers 2 \
      --reference-shape llama3-70b --reference-layout cuda:0,cuda:1 --reference-split 38,42" \
      bench pipeline w4a16 "cuda:0"
    ;;
  *) echo "usage: $0 one-gpu | two-gpu | two-gpu-70b" >&2; exit 2 ;;
esac
grep -h -E "^\| |bitwise|same:|wikitext2|oom:|kld:|FAIL" "${OUT:-/tmp/exactscore-out}"/*.txt 2>/dev/null | tail -60
exit $status
