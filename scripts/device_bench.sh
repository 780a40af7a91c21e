#!/usr/bin/env bash
# Runs on the lent GPU machine (no Rust toolchain there): GPU-vs-CPU numerics on the fixtures,
# the throughput table, and the transformers baseline on the same shape, in one command.
#   bash scripts/device_bench.sh [check] [speed FORMATS BATCHES] [baseline BATCHES]
# Binaries come gzipped in .device/ (see docs/performance.md); results go to $OUT.
set -uo pipefail
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/exactscore-out}
mkdir -p "$OUT"
for b in .device/*.gz; do
  name=$(basename "$b" .gz)
  gzip -dc "$b" > "/tmp/$name" && chmod +x "/tmp/$name"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
SHAPE=${SHAPE:-llama3-8b}
ATTENTION=${ATTENTION:-materialized,flash}   # attention kernels timed by `speed`
while [ $# -gt 0 ]; do
  case "$1" in
    check) /tmp/exactscore-bench check --fixtures tests/fixtures 2>&1 | tee "$OUT/check.txt"; shift ;;
    speed) /tmp/exactscore-bench speed --shape "$SHAPE" --formats "$2" --batch "$3" --attention "$ATTENTION" --profile 2>&1 | tee -a "$OUT/speed.txt"; shift 3 ;;
    baseline) python3 scripts/baseline_transformers.py --shape "$SHAPE" --batch "$2" 2>&1 | tee -a "$OUT/baseline.txt"; shift 2 ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
done
