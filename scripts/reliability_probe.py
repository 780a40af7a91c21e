#!/usr/bin/env python3
"""Client side of scripts/device_reliability.sh (standard library only).

  wait-behind URL KIND SEQS TOKENS   a big /kld or /diff (KIND kld | attribution) in a thread;
                                     small /score requests every 100 ms while it runs; prints
                                     the small requests' latencies before and during it
  sticky URL                         /score from 4 connections until the server stops; prints the
                                     status counts, whether every 200 was bitwise equal to the
                                     first, and the time of the first 503 (epoch seconds)
"""
import json, sys, threading, time, urllib.error, urllib.request


def post(url, path, body, timeout=600):
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        return e.code, e.read(), time.perf_counter() - t0


def ids(seq, n):
    return [(seq * 7919 + i * 104729) % 1999 + 1 for i in range(n)]


def small(url):
    return post(url, "/score", {"tokens": [11, 12, 13]}, timeout=120)


def quantiles(xs):
    xs = sorted(xs)
    return f"p50 {xs[len(xs) // 2] * 1e3:.0f} ms, max {xs[-1] * 1e3:.0f} ms over {len(xs)}"


def wait_behind(url, kind, seqs, tokens):
    before = [small(url)[2] for _ in range(10)]
    tokens_in = [ids(s, tokens) for s in range(seqs)]
    if kind == "kld":
        path, body = "/kld", {"tokens": tokens_in}
    else:
        path, body = "/diff", {"tokens": tokens_in, "attribute": {"layers": [0, 1]}}
    big = {}
    t = threading.Thread(target=lambda: big.update(r=post(url, path, body)))
    t.start()
    time.sleep(0.3)
    during, statuses = [], set()
    while t.is_alive():
        status, _, secs = small(url)
        statuses.add(status)
        during.append(secs)
        time.sleep(0.1)
    t.join()
    status, text, secs = big["r"]
    print(f"wait-behind {kind} {seqs} x {tokens}: big request {status} in {secs:.2f} s; "
          f"small /score before: {quantiles(before)}; during: {quantiles(during)} "
          f"(statuses {sorted(statuses)})")
    return status == 200 and statuses == {200}


def sticky(url):
    answers, counts, first_503, lock = [], {}, [], threading.Lock()
    body = {"tokens": ids(1, 64)}

    def run():
        while True:
            try:
                status, text, _ = post(url, "/score", body, timeout=60)
            except Exception:
                return
            with lock:
                counts[status] = counts.get(status, 0) + 1
                if status == 200:
                    a = json.loads(text)
                    a.pop("id", None)
                    a.pop("usage", None)
                    answers.append(json.dumps(a, sort_keys=True))
                elif not first_503:
                    first_503.append(time.time())
                    print(f"first {status}: {text[:200]!r}")

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    same = all(a == answers[0] for a in answers) if answers else False
    print(f"sticky: statuses {dict(sorted(counts.items()))}, every 200 bitwise equal: {same}")
    print(f"first_503_epoch {first_503[0] if first_503 else 'none'}")
    return same and bool(first_503) and counts.get(200, 0) > 0


if __name__ == "__main__":
    mode, url = sys.argv[1], sys.argv[2]
    ok = (wait_behind(url, sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
          if mode == "wait-behind" else sticky(url))
    sys.exit(0 if ok else 1)
