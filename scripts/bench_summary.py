#!/usr/bin/env python3
"""Joins the tables that scripts/device_bench.sh wrote (exactscore-bench speed, transformers
baseline) into one: tokens/s of every exactscore row over the baseline's at the same batch.

    python3 scripts/bench_summary.py $OUT/speed.txt $OUT/baseline.txt
"""
import sys


def rows(path):
    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        return []
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines
            if line.startswith("| ") and not line.startswith("| format") and "---" not in line
            and "profile" not in line and not line.startswith("| transformers")]


speed, baseline = rows(sys.argv[1]), rows(sys.argv[2])
base = {int(r[1]): float(r[3]) for r in baseline if r[0] == "baseline"}
print("| format | attention | batch | ms/window | tokens/s | × transformers bf16 | % of ceiling | peak GiB |")
print("|---|---|---|---|---|---|---|---|")
for r in speed:
    fmt, kernel, _, batch, ms, tps, ceil, peak = r[:8]
    b = base.get(int(batch))
    ratio = f"{float(tps) / b:.2f}" if b else "—"
    print(f"| {fmt} | {kernel} | {batch} | {ms} | {tps} | {ratio} | {ceil} | {peak} |")
for batch, tps in sorted(base.items()):
    print(f"| transformers bf16 sdpa | — | {batch} | {batch * 2048 / tps * 1e3 / batch:.1f} | {tps:.0f} | 1.00 | | |")
