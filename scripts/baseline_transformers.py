#!/usr/bin/env python3
"""Baseline for exactscore-bench: HF transformers scoring 2048-token windows of a random-weight
model of the same shape (bf16, sdpa), log_softmax + gather of the targets on the GPU, the way
an evaluation script using transformers does it. Prints one table row per batch size.
`--weights FORMAT` gives the decoder Linears the dequantized values of a random FORMAT
checkpoint: transformers decompresses a quantized model to such bf16 weights, and they (through
the activations they produce) change the GEMMs' power draw and so their speed under the power
cap (H100: 4-6 %). `--linears-only` times the Linears' GEMMs alone.

    python3 scripts/baseline_transformers.py --shape llama3-8b --batch 1,4 --weights w4a16
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
ap.add_argument("--weights", choices=["init", "w4a16", "nvfp4", "fp8"], default="init",
                help="decoder Linear weights: transformers' random init (normal, std 0.02), or "
                     "the dequantized values of a random checkpoint of that format drawn as "
                     "exactscore-bench draws its own: what transformers runs for such a model")
ap.add_argument("--linears-only", action="store_true",
                help="time only the GEMMs of the decoder Linears and lm_head (F.linear on the "
                     "weights above, batch x ctx rows, each on its input in one real forward): "
                     "the floor of any implementation running them as bf16 cuBLAS GEMMs on "
                     "these weights")
args = ap.parse_args()

cfg = LlamaConfig(**SHAPES[args.shape], rms_norm_eps=1e-5, max_position_embeddings=131072,
                  rope_theta=500000.0, tie_word_embeddings=False)
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
model.config._attn_implementation = "sdpa"


def random_float(shape, exponents, mantissa_bits):
    """2^e * (1 + m / 2^mantissa_bits), e uniform in `exponents`, m a random mantissa: the
    bench's bf16 (7 bits) and e4m3 (3 bits) values."""
    e = torch.randint(exponents[0], exponents[1], shape, device="cuda").float()
    m = torch.randint(0, 2 ** mantissa_bits, shape, device="cuda")
    return (1 + m / 2 ** mantissa_bits) * torch.exp2(e)


FP4_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def dequantized(kind, out_features, in_features):
    """A decoder Linear's weight as transformers holds it after decompressing a random
    checkpoint of `kind`, with exactscore-bench's distributions (random_model.rs): the values,
    and the activations they lead to, set how much power (and so clock) the GEMMs get."""
    shape = (out_features, in_features)
    if kind == "w4a16":  # int4 codes, one scale per 128 inputs in 2^-8..2^-6
        codes = torch.randint(-8, 8, (out_features, in_features // 128, 128), device="cuda")
        w = codes * random_float((out_features, in_features // 128, 1), (-8, -6), 7)
    elif kind == "nvfp4":  # e2m1 codes, e4m3 block scales in 16..240 per 16, global 20000
        codes = torch.tensor(FP4_E2M1, device="cuda")[
            torch.randint(0, 16, (out_features, in_features // 16, 16), device="cuda")]
        w = codes * (random_float((out_features, in_features // 16, 1), (4, 8), 3) / 20000)
    else:  # fp8: e4m3 codes (exponents 2^-6..2^7), one bf16 scale per output in 2^-12..2^-10
        codes = random_float(shape, (-6, 8), 3)
        sign = torch.randint(0, 2, shape, device="cuda") * 2 - 1
        w = sign * codes * random_float((out_features, 1), (-12, -10), 7)
    return w.reshape(shape).bfloat16()


def decoder_linears(layer):
    a, m = layer.self_attn, layer.mlp
    return [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]


if args.weights != "init":
    with torch.no_grad():
        for layer in model.model.layers:
            for linear in decoder_linears(layer):
                linear.weight.copy_(dequantized(args.weights, *linear.weight.shape))


def forward_step(ids):
    """One scoring forward over `ids`: logits, log-softmax and the targets' gather on the GPU."""
    def step():
        with torch.inference_mode():
            logits = model(ids).logits.float()
            lp = torch.log_softmax(logits[:, :-1], dim=-1)
            return lp.gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()
    return step


def linears_step(ids):
    """One pass of every Linear GEMM of a forward over `ids`, each on the input it had in one
    real forward (activations set the GEMMs' power too)."""
    inputs = {}

    def keep(linear):
        def hook(_, args):  # returns None: the forward's own input is left alone
            inputs[linear] = args[0].reshape(-1, args[0].shape[-1])
        return hook

    linears = [linear for layer in model.model.layers for linear in decoder_linears(layer)]
    hooks = [linear.register_forward_pre_hook(keep(linear)) for linear in linears]
    with torch.inference_mode():
        hidden = model.model(ids).last_hidden_state  # after the final norm: lm_head's input
    for hook in hooks:
        hook.remove()
    inputs[model.lm_head] = hidden.reshape(-1, hidden.shape[-1])
    linears.append(model.lm_head)

    def step():
        with torch.inference_mode():
            for linear in linears:
                torch.nn.functional.linear(inputs[linear], linear.weight)
    return step


what = "Linear GEMMs only" if args.linears_only else "sdpa"
label = f"{'linears' if args.linears_only else 'baseline'} {args.weights}"
print(f"| transformers {torch.__version__} bf16 {what}, {args.weights} weights | batch | ms/window | tokens/s | peak GPU GiB |")
print("|---|---|---|---|---|")
for batch in [int(b) for b in args.batch.split(",")]:
    ids = torch.randint(0, cfg.vocab_size, (batch, args.ctx), device="cuda")

    step = linears_step(ids) if args.linears_only else forward_step(ids)

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
    print(f"| {label} | {batch} | {ms / batch:.1f} | {batch * args.ctx / ms * 1e3:.0f} | "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} |")
