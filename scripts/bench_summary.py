#!/usr/bin/env python3
"""Joins the tables that scripts/device_bench.sh wrote (exactscore-bench speed, transformers
baseline) into one: tokens/s of every exactscore row over the baseline's at the same batch.
Each `--gate FORMAT BATCH MIN_RATIO MAX_PEAK_GIB` is an acceptance bound: the exit status is 1
when that row is missing, slower than MIN_RATIO × transformers, or above MAX_PEAK_GIB.

    python3 scripts/bench_summary.py $OUT/speed.txt $OUT/baseline.txt --gate w4a16 4 1.0 8
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
            and "profile" not in line and not line.startswith("| transformers")]


ap = argparse.ArgumentParser()
ap.add_argument("speed")
ap.add_argument("baseline")
ap.add_argument("--gate", nargs=4, action="append", default=[],
                metavar=("FORMAT", "BATCH", "MIN_RATIO", "MAX_PEAK_GIB"))
args = ap.parse_args()

# baseline rows: baseline | batch | ms/window | tokens/s | peak GiB
base = {int(r[1]): (r[2], float(r[3])) for r in rows(args.baseline) if r[0] == "baseline"}
ratios = {}
print("| format | attention | batch | ms/window | tokens/s | × transformers bf16 | % of ceiling | peak GiB |")
print("|---|---|---|---|---|---|---|---|")
for r in rows(args.speed):
    fmt, kernel, _, batch, ms, tps, ceil, peak = r[:8]
    b = base.get(int(batch))
    ratio = float(tps) / b[1] if b else None
    ratios.setdefault((fmt, int(batch)), (ratio, float(peak)))  # the first run of a shape
    shown = f"{ratio:.2f}" if ratio else "—"
    print(f"| {fmt} | {kernel} | {batch} | {ms} | {tps} | {shown} | {ceil} | {peak} |")
for batch, (ms, tps) in sorted(base.items()):
    print(f"| transformers bf16 sdpa | — | {batch} | {ms} | {tps:.0f} | 1.00 | | |")

failed = 0
for fmt, batch, min_ratio, max_peak in args.gate:
    ratio, peak = ratios.get((fmt, int(batch)), (None, None))
    ok = ratio is not None and ratio >= float(min_ratio) and peak <= float(max_peak)
    failed += not ok
    shown = f"{ratio:.2f}" if ratio else "missing"
    print(f"gate {fmt} batch {batch}: × transformers {shown} >= {min_ratio}, peak {peak} GiB "
          f"<= {max_peak}: {'ok' if ok else 'FAIL'}")
sys.exit(1 if failed else 0)
