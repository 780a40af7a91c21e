#!/usr/bin/env python3
"""Test vectors for server/src/ops/linear_attention.rs (tests/fixtures/linear_attention/).

The Gated DeltaNet layers of Qwen3.5, Qwen3.5-MoE and Qwen3-Next call three torch functions of
transformers' modeling_qwen3_next.py (the fallbacks used when neither `causal_conv1d` nor
`flash-linear-attention` is installed, i.e. what a transformers float32 reference computes):
  * causal_conv1d_fn(x [B, C, T], w [C, K], bias=None, activation="silu")
  * torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, use_qk_l2norm_in_kernel=True)
  * torch_recurrent_gated_delta_rule(...) (token by token; the decode path)
This script calls them on seeded random inputs of the layer's shapes and writes inputs and
outputs as float32 safetensors:
  conv1d.safetensors  per case `{case}.x` [T, C], `{case}.w` [C, K], `{case}.out` [T, C]
  delta_rule.safetensors  per case `{case}.{q,k}` [T, Hk, Dk], `{case}.v` [T, Hv, Dv],
      `{case}.{g,beta}` [T, Hv], `{case}.chunked` / `{case}.recurrent` [T, Hv, Dv] and
      `{case}.state` [Hv, Dk, Dv] (the chunked final state)
The metadata entry `cases` lists each case with its parameters (JSON). The q/k heads are passed
with Hk < Hv where the case says so: the model repeats them (repeat_interleave) before the call,
and so does this script, so `{case}.q` holds the Hk heads as the layer has them.

Usage: OMP_NUM_THREADS=1 /tmp/venv-fixtures/bin/python scripts/make_linear_attention_vectors.py
"""
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers.models.qwen3_next import modeling_qwen3_next as m

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "linear_attention"

CONV_CASES = [
    # name, tokens, channels, kernel, activation
    ("t1", 1, 8, 4, "silu"),
    ("t3", 3, 16, 4, "silu"),
    ("t17", 17, 24, 4, "silu"),
    ("t70_k3", 70, 12, 3, "silu"),
    ("t9_noact", 9, 8, 4, None),
]
DELTA_CASES = [
    # name, tokens, k heads, v heads, Dk, Dv, decay scale, l2norm
    ("t1", 1, 2, 2, 16, 8, 1.0, True),
    ("t5", 5, 1, 2, 8, 8, 1.0, True),
    ("t64", 64, 2, 4, 16, 16, 1.0, True),
    ("t100", 100, 2, 4, 32, 16, 1.0, True),
    ("t130", 130, 1, 1, 16, 32, 0.1, True),  # slow decay: the state spans chunks
    ("t77_strong", 77, 2, 2, 8, 8, 20.0, True),  # exp(cumsum) underflows inside a chunk
    ("t70_nol2", 70, 2, 2, 16, 16, 0.5, False),
]


@torch.no_grad()
def conv_case(gen, t, c, k, act):
    x = torch.randn(t, c, generator=gen)
    w = 0.5 * torch.randn(c, k, generator=gen)
    out = m.causal_conv1d_fn(x.T.contiguous()[None], w, None, activation=act)[0].T.contiguous()
    return {"x": x, "w": w, "out": out}


@torch.no_grad()
def delta_case(gen, t, hk, hv, dk, dv, decay, l2):
    # q, k, v as they leave the conv (SiLU of a normal); a, b as the projections give them
    q = F.silu(torch.randn(t, hk, dk, generator=gen))
    k = F.silu(torch.randn(t, hk, dk, generator=gen))
    v = F.silu(torch.randn(t, hv, dv, generator=gen))
    a = torch.randn(t, hv, generator=gen)
    b = torch.randn(t, hv, generator=gen)
    a_log = torch.log(decay * (0.05 + torch.rand(hv, generator=gen)))
    dt_bias = torch.rand(hv, generator=gen)
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    r = hv // hk
    qr, kr = (x.repeat_interleave(r, dim=1) if r > 1 else x for x in (q, k))
    args = dict(g=g[None], beta=beta[None], use_qk_l2norm_in_kernel=l2)
    chunked, state = m.torch_chunk_gated_delta_rule(
        qr[None], kr[None], v[None], output_final_state=True, **args)
    recurrent, _ = m.torch_recurrent_gated_delta_rule(qr[None], kr[None], v[None], **args)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "chunked": chunked[0],
            "recurrent": recurrent[0], "state": state[0]}


def write(name, cases, fn, gen):
    tensors, meta = {}, []
    for case in cases:
        for key, t in fn(gen, *case[1:]).items():
            tensors[f"{case[0]}.{key}"] = t.to(torch.float32).contiguous()
        meta.append(dict(zip(FIELDS[name], case)))
    save_file(tensors, str(OUT / f"{name}.safetensors"), metadata={
        "cases": json.dumps(meta), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__})
    return meta


FIELDS = {
    "conv1d": ("name", "tokens", "channels", "kernel", "activation"),
    "delta_rule": ("name", "tokens", "k_heads", "v_heads", "k_dim", "v_dim", "decay_scale", "l2norm"),
}


def main():
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(3301)
    write("conv1d", CONV_CASES, conv_case, gen)
    write("delta_rule", DELTA_CASES, delta_case, gen)
    for f in sorted(OUT.glob("*.safetensors")):
        print(f.name, f.stat().st_size)


if __name__ == "__main__":
    main()
