#!/usr/bin/env python3
"""Joins the tables that scripts/device_bench.sh wrote (exactscore-bench speed, transformers
baseline) into one: tokens/s of every exactscore row over the baseline's at the same batch.
Each format is compared with the baseline run on the same kind of weights (`--weights` of
baseline_transformers.py: w4a16 for W4A16, nvfp4 for NVFP4A16 and NVFP4, fp8 for FP8).
Each `--gate FORMAT BATCH MIN_RATIO MAX_PEAK` is an acceptance bound: the exit status is 1
when that row or its baseline is missing, slower than MIN_RATIO × transformers, or above
MAX_PEAK: GiB, or with an `x` suffix a multiple of the checkpoint's stored weight bytes
(`1.25x`: peak memory at most weights + 25 %).

    python3 scripts/bench_summary.py $OUT/speed.txt $OUT/baseline.txt --gate w4a16 4 1.0 8
    python3 scripts/bench_summary.py $OUT/speed.txt $OUT/baseline.txt --gate w4a16 8 1.3 1.25x
"""
import argparse
import sys


def rows(path):
    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        return []
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines
            if line.startswith("| ") and not line.startswith("| format") and "---" not in line
            and not line.startswith("|   ")  # the profile and expert-load lines under a row
            and not line.startswith("| transformers")]


ap = argparse.ArgumentParser()
ap.add_argument("speed")
ap.add_argument("baseline")
ap.add_argument("--gate", nargs=4, action="append", default=[],
                metavar=("FORMAT", "BATCH", "MIN_RATIO", "MAX_PEAK"))
args = ap.parse_args()

# baseline rows: baseline WEIGHTS | batch | ms/window | tokens/s | peak GiB (WEIGHTS: the
# decoder weights transformers ran; "baseline" alone in older logs: its random init)
base = {}
for r in rows(args.baseline):
    if r[0].split()[0] == "baseline":
        weights = (r[0].split() + ["init"])[1]
        base[(weights, int(r[1]))] = (r[2], float(r[3]))
# Each format is compared with transformers running the same kind of weights, dequantized.
SAME_WEIGHTS = {"w4a16": "w4a16", "nvfp4a16": "nvfp4", "nvfp4": "nvfp4", "fp8": "fp8"}
ratios = {}
print("| format | attention | batch | ms/window | tokens/s | × transformers | transformers' weights "
      "| % of ceiling | peak GiB |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows(args.speed):
    fmt, kernel, _, batch, ms, tps, ceil, peak = r[:8]
    # peak over the stored weight bytes (a column since issue 24; absent in older logs)
    over_weights = float(r[11]) if len(r) > 11 else None
    weights = SAME_WEIGHTS.get(fmt, "init")
    b = base.get((weights, int(batch)))
    ratio = float(tps) / b[1] if b else None
    ratios.setdefault((fmt, int(batch)), (ratio, float(peak), over_weights))  # the first run
    shown = f"{ratio:.2f}" if ratio else "—"
    print(f"| {fmt} | {kernel} | {batch} | {ms} | {tps} | {shown} | {weights if b else 'none'} "
          f"| {ceil} | {peak} |")
for (weights, batch), (ms, tps) in sorted(base.items()):
    print(f"| transformers bf16 sdpa | — | {batch} | {ms} | {tps:.0f} | 1.00 | {weights} | | |")

failed = 0
for fmt, batch, min_ratio, max_peak in args.gate:
    ratio, peak, over_weights = ratios.get((fmt, int(batch)), (None, None, None))
    if max_peak.endswith("x"):
        measured, bound, unit = over_weights, float(max_peak[:-1]), "x the stored weights"
    else:
        measured, bound, unit = peak, float(max_peak), "GiB"
    ok = ratio is not None and ratio >= float(min_ratio) and measured is not None \
        and measured <= bound
    failed += not ok
    shown = f"{ratio:.2f}" if ratio else "missing"
    print(f"gate {fmt} batch {batch}: × transformers {shown} >= {min_ratio}, peak {measured} "
          f"{unit} <= {bound}: {'ok' if ok else 'FAIL'}")
sys.exit(1 if failed else 0)
