#!/usr/bin/env bash
# Runs on the lent GPU machine (no Rust toolchain there): GPU-vs-CPU numerics on the fixtures,
# the throughput table, the transformers baseline on the same shape, and WikiText-2 through the
# real HTTP server, in one command.
#   bash scripts/device_bench.sh [check] [speed FORMATS BATCHES] [baseline WEIGHTS BATCHES] [summary]
#                                [wikitext FORMAT CONCURRENCY] [kld BATCHES] [coldstart MODEL]
#                                [jit MODEL_DIR] [attention WINDOWS] [pipeline FORMATS LAYOUTS]
#                                [same REPORT REPORT] [oom FORMAT FREE_GIB]
#                                [speedup BASE_LABEL LABEL MIN_RATIO]
# Binaries come gzipped in .device/ (see docs/performance.md); results go to $OUT. Exits 1 when a
# step failed (a numerics miss, a crash, a failed client run, a missed SUMMARY_GATE).
# Environment: SHAPE (llama3-8b), ATTENTION (kernels timed by `speed`), SERVER_ATTENTION (the
# server's kernel in `wikitext`), TOKENIZER (a directory with tokenizer.json for `wikitext`; the
# figures in docs/performance.md use SmolLM2's, made by scripts/smollm2_tokenizer.py),
# SUMMARY_GATE (`summary`'s acceptance bounds, `;`-separated: FORMAT BATCH MIN_RATIO
# MAX_PEAK_GIB each; issue 13's are in docs/performance.md), COLDSTART_MAX_S, WIKITEXT_MAX_S
# (`wikitext` fails over it; unset: no bound), SERVER_DEVICE (the server's `--device`, default
# cuda:0), SERVER_ARGS (more server flags: `--replicas 2`, `--reference-device cuda:1`, ...),
# LABEL (appended to the report's name), SERVER_BIN (another server binary for `wikitext`, e.g.
# an older build to compare with), DISTINCT_LAYERS (checkpoints draw only this many
# layers and repeat them: fast writes of large shapes), PIPELINE_ARGS (more `pipeline` flags),
# CUDA_LIB_DIR
# (where the CUDA 13 runtime libraries are: a toolkit's lib64 or the wheels' nvidia/cu13/lib;
# default: the torch venv of the machine the figures were measured on).
set -uo pipefail
export LD_LIBRARY_PATH=${CUDA_LIB_DIR:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib}:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/exactscore-out}
mkdir -p "$OUT"
for b in .device/*.gz; do
  name=$(basename "$b" .gz)
  gzip -dc "$b" > "/tmp/$name" && chmod +x "/tmp/$name"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
SHAPE=${SHAPE:-llama3-8b}
ATTENTION=${ATTENTION:-materialized,flash}
TOKENIZER=${TOKENIZER:-tests/fixtures/llama-w4a16-g128}
SUMMARY_GATE=${SUMMARY_GATE:-w4a16 4 1.0 8}
status=0

# WikiText-2 test split, exl3 windows (ctx 2048, stride 512), through exactscore-server on a
# random-weight checkpoint of $SHAPE written to disk; prints the client's wall time.
checkpoint() {
  local dir=/tmp/ckpt-$SHAPE-$1
  [ -f "$dir/model.safetensors" ] || /tmp/exactscore-bench write-checkpoint --shape "$SHAPE" \
    --format "$1" --out "$dir" --tokenizer "$TOKENIZER" \
    ${DISTINCT_LAYERS:+--distinct-layers $DISTINCT_LAYERS} >&2 || return 1
  echo "$dir"
}

# Polls /health/ready on port $1 every 20 ms, for at most 300 s.
wait_ready() {
  python3 - "$1" <<'PY'
import sys, time, urllib.request
deadline = time.time() + 300
while time.time() < deadline:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health/ready", timeout=1); sys.exit(0)
    except Exception:
        time.sleep(0.02)
sys.exit("server not ready after 300 s")
PY
}

# Process start to /health/ready for the model directory $1 (a fixture, or FORMAT of $SHAPE
# when $1 is a format name): first with an empty driver JIT cache (what a fresh machine has),
# then again with the cache that run left; the difference is the JIT start-up still does. The
# step fails when the empty-cache start takes longer than COLDSTART_MAX_S (default 3).
coldstart() {
  local model=$1 port=8766 max=${COLDSTART_MAX_S:-3} rc=0 cache server t0 t1 secs
  [ -d "$model" ] || model=$(checkpoint "$model") || return 1
  cache=$(mktemp -d)
  for run in empty-jit-cache warm-jit-cache; do
    t0=$(date +%s.%N)
    CUDA_CACHE_PATH=$cache /tmp/exactscore-server --model "$model" --device cuda:0 --dtype bf16 \
      --port $port > "$OUT/coldstart-server.log" 2>&1 &
    server=$!
    wait_ready $port || { kill $server; tail -20 "$OUT/coldstart-server.log"; return 1; }
    t1=$(date +%s.%N)
    kill -TERM $server; wait $server
    secs=$(awk "BEGIN{printf \"%.2f\", $t1 - $t0}")
    echo "coldstart $(basename "$model") ($run): process start to ready $secs s" | tee -a "$OUT/coldstart.txt"
    if [ $run = empty-jit-cache ] && awk "BEGIN{exit !($secs > $max)}"; then
      echo "coldstart: $secs s is over COLDSTART_MAX_S=$max"; rc=1
    fi
  done
  return $rc
}

# TASK=kld: `exactscore kld` against the same server given a bf16 reference of the same shape.
wikitext() {
  local format=$1 concurrency=$2 task=${TASK:-ppl} port=8765 dir refdir reference=()
  dir=$(checkpoint "$format") || return 1
  if [ "$task" = kld ]; then
    refdir=$(checkpoint bf16) || return 1
    reference=(--reference-model "$refdir")
  fi
  local t0=$(date +%s.%N)
  # shellcheck disable=SC2086 # SERVER_ARGS is a list of flags
  "${SERVER_BIN:-/tmp/exactscore-server}" --model "$dir" "${reference[@]}" --device "${SERVER_DEVICE:-cuda:0}" \
    --dtype bf16 --attention "${SERVER_ATTENTION:-auto}" --max-input-tokens 2048 --port $port \
    ${SERVER_ARGS:-} > "$OUT/server-$format${LABEL:+-$LABEL}.log" 2>&1 &
  local server=$!
  wait_ready $port || { kill $server; tail -20 "$OUT/server-$format.log"; return 1; }
  local t1=$(date +%s.%N)
  # shellcheck disable=SC2086 # MAX_WINDOWS is empty or two words
  /tmp/exactscore "$task" --server http://127.0.0.1:$port --dataset wikitext2 \
    --wikitext-path tests/fixtures/corpus/wikitext-2-raw-test.txt.gz --method exl3 --ctx 2048 \
    --stride 512 --concurrency "$concurrency" ${MAX_WINDOWS:+--max-windows $MAX_WINDOWS} \
    --no-progress --json "$OUT/wikitext-$task-$format${LABEL:+-$LABEL}.json"
  local rc=$? t2=$(date +%s.%N)
  # How the server batched the run, and the model's share of the wall time.
  python3 - $port <<'PY' | tee -a "$OUT/wikitext.txt"
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode()
keep = ("exactscore_batch_sequences_sum", "exactscore_batch_sequences_count",
        "exactscore_compute_seconds_sum", "exactscore_compute_seconds_count")
print("server metrics:", ", ".join(l for l in text.splitlines() if l.startswith(keep)))
PY
  kill -TERM $server; wait $server
  local secs=$(awk "BEGIN{print $t2 - $t1}")
  echo "wikitext2 $task $SHAPE $format ${LABEL:-} (--device ${SERVER_DEVICE:-cuda:0} ${SERVER_ARGS:-}): server start to ready $(awk "BEGIN{print $t1 - $t0}") s, $task run $secs s (client exit $rc)" | tee -a "$OUT/wikitext.txt"
  if [ -n "${WIKITEXT_MAX_S:-}" ] && awk "BEGIN{exit !($secs > $WIKITEXT_MAX_S)}"; then
    echo "wikitext: $secs s is over WIKITEXT_MAX_S=$WIKITEXT_MAX_S" | tee -a "$OUT/wikitext.txt"; rc=1
  fi
  return $rc
}

# Whether two `wikitext` reports hold the same per-window numbers, bit for bit (each window's
# f64 sums of the f32 per-token values, in the same order).
same() {
  python3 - "$OUT/$1" "$OUT/$2" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
wa, wb = a["per_window"], b["per_window"]
equal = len(wa) == len(wb) and all(x == y for x, y in zip(wa, wb))
print(f"same: {sys.argv[1].split('/')[-1]} vs {sys.argv[2].split('/')[-1]}: {len(wa)} windows, "
      f"per-window numbers bitwise equal = {equal}")
sys.exit(0 if equal else 1)
PY
}

# The out-of-memory retry on a real device: a PyTorch process holds all but FREE_GIB of GPU 0,
# the server is given a --max-batch-tokens far above what fits, and 64 windows are sent at once;
# every one must be answered, and the server's /metrics tell how many batches were halved.
oom() {
  local format=$1 free=$2 port=8767 dir holder rc
  dir=$(checkpoint "$format") || return 1
  python3 -c "
import time, torch
free, total = torch.cuda.mem_get_info(0)
keep = free - int($free * 2**30)
x = torch.empty(keep, dtype=torch.uint8, device='cuda:0')
print(f'holding {keep / 2**30:.1f} of {total / 2**30:.1f} GiB', flush=True)
time.sleep(3600)" > "$OUT/oom-holder.log" 2>&1 &
  holder=$!
  for _ in $(seq 100); do grep -q holding "$OUT/oom-holder.log" && break; sleep 0.2; done
  cat "$OUT/oom-holder.log"
  /tmp/exactscore-server --model "$dir" --device cuda:0 --dtype bf16 --max-input-tokens 2048 \
    --max-batch-tokens 1048576 --max-batch-requests 512 --max-queued-requests 1024 --port $port \
    > "$OUT/server-oom.log" 2>&1 &
  local server=$!
  wait_ready $port || { kill $server $holder; tail -20 "$OUT/server-oom.log"; return 1; }
  /tmp/exactscore ppl --server http://127.0.0.1:$port --dataset wikitext2 \
    --wikitext-path tests/fixtures/corpus/wikitext-2-raw-test.txt.gz --method exl3 --ctx 2048 \
    --stride 512 --concurrency 64 --max-windows 64 --no-progress --json "$OUT/oom-ppl.json"
  rc=$?
  python3 - $port <<'PY' | tee -a "$OUT/oom.txt"
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode()
keep = ("exactscore_oom_retries_total", "exactscore_batch_sequences_sum",
        "exactscore_batch_sequences_count", "exactscore_replica_failed_batches_total")
print("oom: server metrics:", ", ".join(l for l in text.splitlines() if l.startswith(keep)))
PY
  kill -TERM $server; wait $server; kill $holder
  echo "oom: client exit $rc (64 windows, --max-batch-tokens 1048576)" | tee -a "$OUT/oom.txt"
  return $rc
}

# Whether the `wikitext` run labelled $2 was at least $3 times as fast as the one labelled $1
# (their `ppl run` / `kld run` seconds in $OUT/wikitext.txt, the same task and shape).
speedup() {
  awk -v base="$1" -v fast="$2" -v min="$3" '
    / run [0-9.]+ s / { for (i = 1; i < NF; i++) if ($i == "run") secs = $(i + 1)
      for (i = 1; i < NF; i++) if ($(i + 1) ~ /^\(--device/) label = $i
      t[label] = secs }
    END { if (!(base in t) || !(fast in t)) { print "speedup: no run labelled " base " or " fast; exit 1 }
      r = t[base] / t[fast]; ok = r >= min
      printf "speedup: %s %.2f s vs %s %.2f s = %.2fx (min %s): %s\n", fast, t[fast], base, t[base], r, min, ok ? "ok" : "FAIL"
      exit !ok }' "$OUT/wikitext.txt"
}

# Runs one step, its output also appended to $OUT/LOG; a failing step marks the run failed.
step() {
  local log=$1; shift
  "$@" 2>&1 | tee -a "$OUT/$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

while [ $# -gt 0 ]; do
  case "$1" in
    check) step check.txt /tmp/exactscore-bench check --fixtures tests/fixtures; shift ;;
    speed) step speed.txt /tmp/exactscore-bench speed --shape "$SHAPE" --formats "$2" --batch "$3" --attention "$ATTENTION" --profile; shift 3 ;;
    coldstart) step coldstart-run.txt coldstart "$2"; shift 2 ;;
    attention) step attention.txt /tmp/exactscore-bench attention --windows "$2"; shift 2 ;;
    jit) step jit.txt env CUDA_CACHE_PATH="$(mktemp -d)" /tmp/exactscore-bench jit --model "$2"; shift 2 ;;
    kld) step kld.txt /tmp/exactscore-bench kld --shape "$SHAPE" --format w4a16 --batch "$2" --min-ratio 0.45; shift 2 ;;
    baseline) step baseline.txt python3 scripts/baseline_transformers.py --shape "$SHAPE" --weights "$2" --batch "$3"; shift 3 ;;
    wikitext) step wikitext-run.txt wikitext "$2" "$3"; shift 3 ;;
    pipeline)
      # shellcheck disable=SC2086 # PIPELINE_ARGS is a list of flags
      step pipeline.txt /tmp/exactscore-bench pipeline --shape "$SHAPE" --formats "$2" --layouts "$3" ${PIPELINE_ARGS:-}
      shift 3 ;;
    same) step same.txt same "$2" "$3"; shift 3 ;;
    speedup) step speedup.txt speedup "$2" "$3" "$4"; shift 4 ;;
    oom) step oom-run.txt oom "$2" "$3"; shift 3 ;;
    summary)
      gates=()
      IFS=';' read -ra bounds <<< "$SUMMARY_GATE"
      # shellcheck disable=SC2206 # each bound is four words
      for bound in "${bounds[@]}"; do gates+=(--gate $bound); done
      step summary.txt python3 scripts/bench_summary.py "$OUT/speed.txt" "$OUT/baseline.txt" "${gates[@]}"; shift ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
done
exit $status
