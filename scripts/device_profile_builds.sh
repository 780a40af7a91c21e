#!/usr/bin/env bash
# Runs on the lent GPU machine: `exactscore-bench speed --profile` of several builds of the bench
# on one card, in ABC..CBA order (a drift over time favours none), one process per run, and a
# table per run: ms/window of the plain timed pass, the profiled pass, the sum of its
# synchronized stages, and the gap between them (host time between stages). The builds come as
# .device/eb-NAME.xz; the first named is the old one, the last the new one. Exits 1 where the
# median of the paired new / old ratios (k-th run of each) exceeds 1 + MAX_SLOWDOWN (default
# 0.01) at any batch size.
#   bash scripts/device_profile_builds.sh OLD [MIDDLE...] NEW
# SHAPE (qwen3-30b-a3b), FORMAT (w4a16), BATCHES (1,8), ITERS (3). Results go to $OUT.
set -uo pipefail
export LD_LIBRARY_PATH=${CUDA_LIB_DIR:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib}:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/exactscore-out}
mkdir -p "$OUT"
builds="$*"
for b in $builds; do xz -dc ".device/eb-$b.xz" > "/tmp/eb-$b" && chmod +x "/tmp/eb-$b"; done
order="$builds $(echo "$builds" | tr ' ' '\n' | tac | tr '\n' ' ')"
: > "$OUT/profile-rows.txt"
for b in $order; do
  "/tmp/eb-$b" speed --shape "${SHAPE:-qwen3-30b-a3b}" --formats "${FORMAT:-w4a16}" \
    --batch "${BATCHES:-1,8}" --attention flash --iters "${ITERS:-3}" --profile \
    > "$OUT/profile-run.txt" 2>&1 || { tail -5 "$OUT/profile-run.txt"; exit 1; }
  cat "$OUT/profile-run.txt" >> "$OUT/profile-raw.txt"
  python3 - "$b" "$OUT/profile-run.txt" >> "$OUT/profile-rows.txt" <<'PY'
import re, sys
build, lines = sys.argv[1], open(sys.argv[2]).read().splitlines()
timed = [l for l in lines if l.startswith("| ") and "profile" not in l and l.count("|") > 10 and l.split("|")[4].strip().isdigit()]
prof = [l for l in lines if "profile, ms/window" in l]
for t, p in zip(timed, prof):
    cols = [c.strip() for c in t.split("|")]
    m = re.search(r"sum ([\d.]+) of ([\d.]+)", p)
    print(build, cols[4], cols[5], m.group(2), m.group(1), f"{float(m.group(2)) - float(m.group(1)):.1f}")
PY
done
python3 - "$OUT/profile-rows.txt" "${MAX_SLOWDOWN:-0.01}" "${builds%% *}" "${builds##* }" <<'PY'
import statistics, sys
rows, limit, old, new = sys.argv[1], 1 + float(sys.argv[2]), sys.argv[3], sys.argv[4]
runs = {}
print("| build | batch | ms/window | profiled | stages | gap |")
print("|---|---|---|---|---|---|")
for line in open(rows):
    build, batch, ms, profiled, stages, gap = line.split()
    print(f"| {build} | {batch} | {ms} | {profiled} | {stages} | {gap} |")
    runs.setdefault((build, batch), []).append(float(ms))
failed = False
for (build, batch), old_ms in sorted(runs.items()):
    if build != old:
        continue
    new_ms = runs.get((new, batch), [])
    ratios = [n / o for n, o in zip(new_ms, old_ms)]
    median = statistics.median(ratios) if ratios else float("nan")
    ok = median <= limit
    failed |= not ok
    print(f"batch {batch}: {new} / {old} paired {', '.join(f'{r:.3f}' for r in ratios)}; median {median:.4f} {'ok' if ok else 'FAIL'}")
sys.exit(1 if failed else 0)
PY
