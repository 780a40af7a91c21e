#!/usr/bin/env python3
"""Deterministically build the two tiny local lm-eval data sets from the WikiText-2 raw test file.

    python3 make_data.py [CORPUS_GZ] [OUT_DIR]

CORPUS_GZ defaults to <repo>/tests/fixtures/corpus/wikitext-2-raw-test.txt.gz (repo = two levels up),
OUT_DIR to ./data next to this file. Stdlib only; the outputs are checked in, so run.sh never needs this.

data/mc.jsonl      20 docs: {"id", "context", "choices"[4], "label"}
                   context = first 12 words of a paragraph's first sentence; the gold choice is the real
                   next 3 words; the 3 distractors are 3-word spans taken from other paragraphs.
data/lastword.jsonl 12 docs: {"id", "context", "target"} - lambada-style: even ids end a context
                   with "of" and target " the", odd ids: first 10 words -> the 11th.
data/rolling.jsonl 5 docs: {"id", "title", "page"} - an article's title row and its first paragraph,
                   in the same "page" shape as EleutherAI/wikitext_document_level (rows joined by "\\n").
"""
import gzip
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))


def rows(corpus):
    raw = gzip.open(corpus, "rb").read().decode("utf-8")
    return raw.split("\r\n")[:-1]  # file ends with CRLF


def main():
    corpus = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        REPO, "tests/fixtures/corpus/wikitext-2-raw-test.txt.gz")
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(HERE, "data")
    os.makedirs(out, exist_ok=True)
    lines = rows(corpus)
    paras = [l.strip() for l in lines
             if l.strip() and not l.startswith(" = ") and len(l.split()) >= 40]
    rng = random.Random(20240601)

    # ---- multiple choice ------------------------------------------------------------------
    picked = paras[::max(1, len(paras) // 20)][:20]
    spans = []  # distractor pool: 3-word spans from the middle of *other* paragraphs
    for p in paras[1::7]:
        w = p.split()
        spans.append(" ".join(w[20:23]))
    mc = []
    for i, p in enumerate(picked):
        w = p.split()
        ctx, gold = " ".join(w[:12]), " ".join(w[12:15])
        pool = [s for s in spans if s != gold]
        distract = rng.sample(pool, 3)
        label = rng.randrange(4)
        choices = distract[:label] + [gold] + distract[label:]
        mc.append({"id": i, "context": ctx, "choices": choices, "label": label})
    with open(os.path.join(out, "mc.jsonl"), "w", encoding="utf-8") as f:
        for d in mc:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")

    # ---- lambada-style next word (output_type loglikelihood: the path where is_greedy is the metric)
    lw = []
    for p in paras[3::5]:
        w = p.split()
        if len(lw) % 2 == 0:  # "... of" -> " the": a frequent bigram, so greedy hits (acc=1) do occur
            ks = [k for k in range(5, min(len(w) - 1, 60)) if w[k] == "of" and w[k + 1] == "the"]
            if not ks:
                continue
            k = ks[0] + 1
        else:
            k = 10
        lw.append({"id": len(lw), "context": " ".join(w[:k]), "target": " " + w[k]})
        if len(lw) == 12:
            break
    with open(os.path.join(out, "lastword.jsonl"), "w", encoding="utf-8") as f:
        for d in lw:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")

    # ---- rolling perplexity ---------------------------------------------------------------
    heads = [i for i, l in enumerate(lines) if l.startswith(" = ") and not l.startswith(" = = ")]
    roll = []
    for k, h in enumerate(heads[:: len(heads) // 5][:5]):
        # title row, empty row, first non-empty paragraph row (as the document-level set keeps them)
        j = h + 1
        while not lines[j].strip():
            j += 1
        para = lines[j]
        words = para.split(" ")
        if len(words) > 120:  # keep it short: ~120 words -> ~150-250 tokens, several 64-token windows
            para = " ".join(words[:120])
        page = lines[h] + "\n\n" + para + "\n"
        roll.append({"id": k, "title": lines[h].strip(" ="), "page": page})
    with open(os.path.join(out, "rolling.jsonl"), "w", encoding="utf-8") as f:
        for d in roll:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    print(f"wrote {len(mc)} mc, {len(lw)} lastword, {len(roll)} rolling docs to {out}")


if __name__ == "__main__":
    main()
