#!/usr/bin/env bash
# End-to-end: EleutherAI lm-evaluation-harness `local-completions` against ExactScore, every number
# re-derived from the server's /score by check.py. Exits non-zero on any mismatch.
#
#   tests/lm-eval/run.sh                # from anywhere; builds + starts the server, runs the matrix
#
# Matrix: tokenized_requests {true,false} x batch_size {1,4} x num_concurrent {1,4}, each on the four local
# tasks (tasks/*.yaml: 4-way MC, lambada-style next word (acc = is_greedy), the same contexts with the
# model's own greedy token as target (written once the server is up), rolling perplexity), --limit $LIMIT docs per task.
# No hub access: datasets are local JSONL (json builder, offline); the tokenizer is the server's own
# (tokenizer_backend=remote: GET /tokenizer_info, POST /tokenize, POST /detokenize).
#
# Environment (all optional):
#   LMEVAL_VENV        venv with lm-eval (default /tmp/lmeval; created if it lacks bin/lm_eval)
#   LMEVAL_SPEC        pip spec installed into a new venv (default "lm-eval[api]==0.4.13")
#   EXACTSCORE_BIN     prebuilt server binary (default: cargo build --release -p exactscore-server)
#   SERVER_CMD         full server command instead (gets PORT/MODEL_DIR from env), e.g. the mock:
#                      SERVER_CMD='$LMEVAL_VENV/bin/python mock_server.py --model $MODEL_DIR --port $PORT'
#   SERVER_ARGS        extra server flags (default "--dtype f32")
#   MODEL_DIR          default <repo>/tests/fixtures/llama-w4a16-g128
#   PORT               default: a free port
#   LIMIT              docs per task per run (default 6; the rolling task has 5)
#   MAX_LENGTH         lm-eval max_length (default 64 -> several rolling windows per document)
#   TOKENIZER_BACKEND  remote (default) | huggingface (tokenizer=$MODEL_DIR, needs transformers in venv)
#   TOKENIZED / BATCH_SIZES / CONCURRENCY   override the matrix axes (space-separated lists)
#   OUT                output dir (default: a new mktemp dir; kept, path printed)
#   READY_TIMEOUT      seconds to wait for /health/ready (default 600)
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
LMEVAL_VENV="${LMEVAL_VENV:-/tmp/lmeval}"
LMEVAL_SPEC="${LMEVAL_SPEC:-lm-eval[api]==0.4.13}"
MODEL_DIR="${MODEL_DIR:-$REPO/tests/fixtures/llama-w4a16-g128}"
SERVER_ARGS="${SERVER_ARGS:---dtype f32}"
LIMIT="${LIMIT:-6}"
MAX_LENGTH="${MAX_LENGTH:-64}"
TOKENIZER_BACKEND="${TOKENIZER_BACKEND:-remote}"
TOKENIZED="${TOKENIZED:-true false}"
BATCH_SIZES="${BATCH_SIZES:-1 4}"
CONCURRENCY="${CONCURRENCY:-1 4}"
READY_TIMEOUT="${READY_TIMEOUT:-600}"
OUT="${OUT:-$(mktemp -d /tmp/exactscore-lmeval.XXXXXX)}"
mkdir -p "$OUT"
TASKS=exactscore_wikitext_mc,exactscore_wikitext_lastword,exactscore_wikitext_greedy,exactscore_wikitext_rolling

log() { printf '[run.sh] %s\n' "$*" >&2; }

# ---- venv -------------------------------------------------------------------------------------
if [ ! -x "$LMEVAL_VENV/bin/lm_eval" ]; then
  log "creating venv $LMEVAL_VENV ($LMEVAL_SPEC)"
  python3 -m venv "$LMEVAL_VENV" || exit 2
  extra=""; [ "$TOKENIZER_BACKEND" = huggingface ] && extra="transformers"
  nice -n 19 "$LMEVAL_VENV/bin/pip" install -q "$LMEVAL_SPEC" openai tokenizers $extra || exit 2
fi
PY="$LMEVAL_VENV/bin/python"
log "lm-eval $("$PY" -c 'import importlib.metadata as m; print(m.version("lm_eval"))')"

# ---- hermetic, offline ---------------------------------------------------------------------------
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export HF_HOME="$OUT/hf-home" TOKENIZERS_PARALLELISM=false
export OPENAI_API_KEY="${OPENAI_API_KEY:-EMPTY}"    # lm-eval sends "Authorization: Bearer $OPENAI_API_KEY"
export NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}" no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}"

log "validating task YAMLs (dry, no model)"
(cd "$HERE" && "$PY" validate_tasks.py >"$OUT/validate_tasks.log" 2>&1) || { tail -20 "$OUT/validate_tasks.log" >&2; exit 2; }

# ---- server -------------------------------------------------------------------------------------
PORT="${PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}"
export PORT MODEL_DIR LMEVAL_VENV
URL="http://127.0.0.1:$PORT"
if [ -z "${SERVER_CMD:-}" ]; then
  if [ -z "${EXACTSCORE_BIN:-}" ]; then
    log "building exactscore-server (release)"
    (cd "$REPO" && cargo build --release -p exactscore-server) || exit 2
    EXACTSCORE_BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/exactscore-server"
  fi
  SERVER_CMD="\"$EXACTSCORE_BIN\" --model \"$MODEL_DIR\" --port $PORT $SERVER_ARGS"
fi
log "starting server: $SERVER_CMD  (log: $OUT/server.log)"
(cd "$REPO" && exec setsid bash -c "exec $SERVER_CMD") >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
stop_server() {
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || kill -TERM "$SERVER_PID" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
}
trap stop_server EXIT
trap 'exit 130' INT TERM

deadline=$((SECONDS + READY_TIMEOUT))
until curl -fsS -o /dev/null "$URL/health/ready" 2>/dev/null; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then log "server exited early:"; tail -30 "$OUT/server.log" >&2; exit 2; fi
  if [ $SECONDS -ge $deadline ]; then log "server not ready after ${READY_TIMEOUT}s"; tail -30 "$OUT/server.log" >&2; exit 2; fi
  sleep 0.5
done
MODEL_NAME="${MODEL_NAME:-$(curl -fsS "$URL/v1/models" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])' 2>/dev/null || basename "$MODEL_DIR")}"
log "server ready at $URL, model id '$MODEL_NAME'"
"$PY" "$HERE/make_greedy_data.py" "$URL" "$MODEL_NAME" >&2 || exit 2

if [ "$TOKENIZER_BACKEND" = huggingface ]; then
  TOK_ARGS="tokenizer_backend=huggingface,tokenizer=$MODEL_DIR"
else
  TOK_ARGS="tokenizer_backend=remote"
fi

# ---- matrix -------------------------------------------------------------------------------------
cd "$HERE" || exit 2    # the task YAMLs' data_files are relative to the CWD
failed=()
n=0
for tr in $TOKENIZED; do for bs in $BATCH_SIZES; do for nc in $CONCURRENCY; do
  n=$((n + 1))
  name="tr-${tr}_bs-${bs}_nc-${nc}"
  run_out="$OUT/$name"
  log "[$n] lm_eval $name"
  margs="base_url=$URL/v1/completions,model=$MODEL_NAME,$TOK_ARGS,tokenized_requests=$tr,num_concurrent=$nc,max_length=$MAX_LENGTH,max_retries=1"
  if ! "$LMEVAL_VENV/bin/lm_eval" --model local-completions --model_args "$margs" --batch_size "$bs" \
        --tasks "$TASKS" --include_path "$HERE/tasks" --limit "$LIMIT" \
        --output_path "$run_out" --log_samples >"$OUT/$name.lm_eval.log" 2>&1; then
    log "    lm_eval FAILED (see $OUT/$name.lm_eval.log)"; tail -15 "$OUT/$name.lm_eval.log" >&2
    failed+=("$name:lm_eval"); continue
  fi
  if "$PY" "$HERE/check.py" --output-path "$run_out" --url "$URL" \
        --tokenizer-json "$MODEL_DIR/tokenizer.json" >"$OUT/$name.check.log" 2>&1; then
    log "    check OK: $(grep -E '^  (mc|loglikelihood|rolling)' "$OUT/$name.check.log" | tr -s ' ' | paste -sd';' -)"
  else
    log "    check FAILED (see $OUT/$name.check.log)"; tail -15 "$OUT/$name.check.log" >&2
    failed+=("$name:check")
  fi
done; done; done

log "openai client check"
if ! "$PY" "$HERE/check.py" --url "$URL" --model "$MODEL_NAME" --openai-check >"$OUT/openai.check.log" 2>&1; then
  cat "$OUT/openai.check.log" >&2; failed+=("openai")
else
  grep openai "$OUT/openai.check.log" >&2
fi

# every run must report the same numbers (batch invariance; tokenized/string prompts give the same ids)
"$PY" - "$OUT" <<'EOF' || failed+=("cross-run")
import glob, json, sys, os
vals = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "tr-*", "**", "results_*.json"), recursive=True)):
    r = json.load(open(f))["results"]
    vals[f.split(os.sep)[-3]] = {f"{t}/{k}": v for t, m in r.items() for k, v in m.items()
                                  if isinstance(v, float)}
names = list(vals)
bad = 0
for n in names[1:]:
    for k, v in vals[names[0]].items():
        w = vals[n].get(k)
        if w is None or abs(v - w) > 1e-4 * max(abs(v), abs(w), 1e-6):
            print(f"[run.sh] cross-run mismatch {k}: {names[0]}={v} {n}={w}", file=sys.stderr); bad += 1
print(f"[run.sh] cross-run ({len(names)} runs): {'identical' if not bad else 'DIFFER'}", file=sys.stderr)
for n in names:  # the greedy task must produce hits, or is_greedy=True was never exercised
    acc = vals[n].get("exactscore_wikitext_greedy/acc,none", 0.0)
    if not acc > 0:
        print(f"[run.sh] {n}: greedy-target task acc {acc}, expected hits", file=sys.stderr); bad += 1
if names:
    print(f"[run.sh] greedy-target task acc: {vals[names[0]].get('exactscore_wikitext_greedy/acc,none')}", file=sys.stderr)
sys.exit(1 if bad else 0)
EOF

stop_server
if [ ${#failed[@]} -gt 0 ]; then
  log "FAILED (${#failed[@]}): ${failed[*]}   outputs: $OUT"
  exit 1
fi
log "PASS: $n lm-eval runs + openai check, all numbers match /score, ${SECONDS}s   outputs: $OUT"
