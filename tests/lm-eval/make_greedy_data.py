#!/usr/bin/env python3
"""Next-word docs whose target IS the served model's greedy token, so lm-eval's `acc` (is_greedy)
is exercised on hits, not only on misses (a random fixture model never predicts real text).

    python3 make_greedy_data.py URL MODEL   # writes data/generated/lastword_greedy.jsonl

For each context of data/lastword.jsonl the target is `choices[0].text` of
POST /v1/completions {prompt: context, max_tokens: 1, temperature: 0}. Stdlib only."""
import json
import os
import sys
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
url, model = sys.argv[1].rstrip("/"), sys.argv[2]
key = os.environ.get("OPENAI_API_KEY", "EMPTY")
out_dir = os.path.join(HERE, "data", "generated")
os.makedirs(out_dir, exist_ok=True)
docs = [json.loads(l) for l in open(os.path.join(HERE, "data", "lastword.jsonl"), encoding="utf-8")]
with open(os.path.join(out_dir, "lastword_greedy.jsonl"), "w", encoding="utf-8") as f:
    for d in docs:
        body = json.dumps({"model": model, "prompt": d["context"], "max_tokens": 1, "temperature": 0})
        req = urllib.request.Request(f"{url}/v1/completions", body.encode(), {
            "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        text = json.load(urllib.request.urlopen(req))["choices"][0]["text"]
        f.write(json.dumps({"id": d["id"], "context": d["context"], "target": text}, ensure_ascii=False) + "\n")
print(f"{len(docs)} greedy next-word docs")
