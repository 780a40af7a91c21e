#!/usr/bin/env python3
"""Cross-check of `exactscore ppl --method exl3` with transformers (f32, CPU or GPU).

    python3 scripts/exl3_ppl_transformers.py MODEL_DIR [--ctx 2048 --stride 512 --max-windows 20]

Builds the same `wikitext2` text as the client (gunzip(tests/fixtures/corpus/
wikitext-2-raw-test.txt.gz).replace(b"\\r\\n", b"\\n\\n\\n")[:-2], sha256 checked), tokenizes it
with the checkpoint's tokenizer.json (special tokens as the tokenizer adds them), takes windows
tokens[k*stride : k*stride+ctx] (full windows only), scores positions 1..ctx-1 of each, and prints
the perplexity over all scored positions. Loading a compressed-tensors checkpoint needs the
compressed-tensors package (transformers decompresses it).
"""
import argparse
import gzip
import hashlib
import math
import pathlib

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM


ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--ctx", type=int, default=2048)
ap.add_argument("--stride", type=int, default=512)
ap.add_argument("--max-windows", type=int, default=20)
args = ap.parse_args()

repo = pathlib.Path(__file__).resolve().parent.parent
raw = gzip.open(repo / "tests/fixtures/corpus/wikitext-2-raw-test.txt.gz", "rb").read()
text = raw.replace(b"\r\n", b"\n\n\n")[:-2]
client_src = (repo / "client/src/dataset.rs").read_text()
expected = client_src.split("WIKITEXT2_SHA256: &str =")[1].split('"')[1]
assert hashlib.sha256(text).hexdigest() == expected, "wikitext2 text differs from the client's"

tok = Tokenizer.from_file(str(pathlib.Path(args.model) / "tokenizer.json"))
ids = tok.encode(text.decode("utf-8"), add_special_tokens=True).ids
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
total, count, k = 0.0, 0, 0
while k * args.stride + args.ctx <= len(ids) and k < args.max_windows:
    window = torch.tensor([ids[k * args.stride: k * args.stride + args.ctx]])
    with torch.no_grad():
        logits = model(window).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(1, window[0, 1:, None])[:, 0]
    total -= lp.double().sum().item()
    count += lp.numel()
    k += 1
print(f"{args.model}: {len(ids)} tokens, {k} windows, {count} scored, mean NLL {total / count:.6f}, "
      f"perplexity {math.exp(total / count):.6f}")
