#!/usr/bin/env python3
"""Baseline for exactscore-bench: HF transformers scoring 2048-token windows of a random-weight
model of the same shape (bf16, sdpa), log_softmax + gather of the targets on the GPU, the way
an evaluation script using transformers does it. Prints one table row per batch size.

    python3 scripts/baseline_transformers.py --shape llama3-8b --batch 1,4 --ctx 2048
"""
import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256),
}

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="llama3-8b")
ap.add_argument("--batch", default="1,4")
ap.add_argument("--ctx", type=int, default=2048)
ap.add_argument("--iters", type=int, default=5)
args = ap.parse_args()

cfg = LlamaConfig(**SHAPES[args.shape], rms_norm_eps=1e-5, max_position_embeddings=131072,
                  rope_theta=500000.0, tie_word_embeddings=False)
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
model.config._attn_implementation = "sdpa"
print(f"| transformers {torch.__version__} bf16 sdpa | batch | ms/window | tokens/s | peak GPU GiB |")
print("|---|---|---|---|---|")
for batch in [int(b) for b in args.batch.split(",")]:
    ids = torch.randint(0, cfg.vocab_size, (batch, args.ctx), device="cuda")

    def step():
        with torch.inference_mode():
            logits = model(ids).logits.float()
            lp = torch.log_softmax(logits[:, :-1], dim=-1)
            return lp.gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / args.iters
    print(f"| baseline | {batch} | {ms / batch:.1f} | {batch * args.ctx / ms * 1e3:.0f} | "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} |")
