#!/usr/bin/env python3
"""Digests of every /score, /kld and /diff response of a server binary on the test fixtures.

The GPU half of the refactoring guard (the CPU half is tests/tests/golden_digest.rs, in CI): run
it with the binary before a change and the binary after it, on the same card, and compare.

    python3 scripts/golden_digest.py BINARY --device cuda:0 [--dtypes f32,bf16] > digests.json
    python3 scripts/golden_digest.py --compare OLD.json NEW.json

The requests are the CPU test's: the fixture's four reference sequences, every optional output
on, attribution in /diff where the reference is another checkpoint. A response is parsed, its `usage.queue_ms` / `usage.compute_ms` are
dropped, and the rest is hashed as sorted-key JSON. Python's standard library only.
"""
import argparse
import hashlib
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"

# The cases and requests that tests/tests/golden_digest.rs reads too.
TABLE = json.loads((FIXTURES.parent / "golden" / "cases.json").read_text())
CASES = [(c["served"], c["reference"]) for c in TABLE["cases"]]


def sequences(variant):
    ref = json.loads((FIXTURES / variant / "reference.json").read_text())
    return [s["token_ids"] for s in ref["sequences"]]


def requests(seqs, attribute):
    """(name, route, body) of every request of the table, `tokens` (and `attribute`) filled in."""
    out = []
    for r in TABLE["requests"]:
        body = dict(r["body"], tokens=seqs[: r.get("sequences", len(seqs))])
        if r.get("attribute"):
            body["attribute"] = attribute
        out.append((r["name"], r["route"], body))
    return out


def without_timings(v):
    if isinstance(v, dict):
        return {k: without_timings(x) for k, x in v.items() if k not in ("queue_ms", "compute_ms")}
    if isinstance(v, list):
        return [without_timings(x) for x in v]
    return v


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(base, route, body):
    req = urllib.request.Request(f"{base}/{route}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_ready(base, proc):
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode} before it was ready")
        try:
            urllib.request.urlopen(f"{base}/health/ready", timeout=1)
            return
        except Exception:
            time.sleep(0.05)
    sys.exit("server not ready after 300 s")


def digests_of(binary, variant, reference, dtype, device):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [binary, "--model", str(FIXTURES / variant), "--reference-model", str(FIXTURES / reference),
         "--dtype", dtype, "--device", device, "--port", str(port),
         "--max-input-tokens", "512", "--max-batch-tokens", "2048"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = {}
    try:
        wait_ready(base, proc)
        for name, route, body in requests(sequences(variant), variant != reference):
            status, text = post(base, route, body)
            if status != 200:
                sys.exit(f"{variant} {dtype} {device} /{route}: {status} {text[:300]!r}")
            canonical = json.dumps(without_timings(json.loads(text)), sort_keys=True)
            out[f"{variant}/{dtype}/{device}/{name}"] = hashlib.sha256(canonical.encode()).hexdigest()
    finally:
        proc.terminate()
        proc.wait()
    return out


def compare(old_path, new_path):
    old, new = json.loads(Path(old_path).read_text()), json.loads(Path(new_path).read_text())
    keys = sorted(set(old) | set(new))
    differing = [k for k in keys if old.get(k) != new.get(k)]
    for k in differing:
        print(f"DIFFERS {k}")
    print(f"{len(keys) - len(differing)} of {len(keys)} digests equal")
    return 1 if differing else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", nargs="?")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if not args.binary:
        ap.error("give the server binary, or --compare OLD NEW")
    out = {}
    for variant, reference in CASES:
        for dtype in args.dtypes.split(","):
            out.update(digests_of(args.binary, variant, reference, dtype, args.device))
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
