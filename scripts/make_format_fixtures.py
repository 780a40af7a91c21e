#!/usr/bin/env python3
"""Fixtures of the non-compressed-tensors checkpoint formats (issue 35): the tiny Llama of
tests/fixtures/llama-dense-bf16 quantized into each format's own on-disk layout, each with
float32 reference log-probs from transformers on the weights dequantized by the format's own
library, and dequantization test vectors.

    /tmp/venv-fixtures/bin/python scripts/make_format_fixtures.py [--only NAME,...]

Needs the fixture venv (transformers 5.17, torch 2.14 CPU) and, for GPTQ, GPTQModel 7.7.0
installed without its dependencies (its pins want a newer transformers) plus the few it imports:
    BUILD_CUDA_EXT=0 pip install --no-deps gptqmodel==7.7.0 pypcre logbar device-smi \
        threadpoolctl tokenicer defuser
Runs in about a minute on 2 CPU cores; deterministic (seeded), no network.

What each fixture matches of a published checkpoint is in tests/fixtures/FORMATS.md.
"""

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
DENSE = FIXTURES / "llama-dense-bf16"
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


# ----------------------------------------------------------------------------------------------
# GPTQ: GPTQModel's layout (qweight packed along K, qzeros along N, v1 zeros stored minus one)
# ----------------------------------------------------------------------------------------------
def pack_stream(codes, bits):
    """Codes (uint, along axis 0) into a little-endian bit stream of int32 words along axis 0:
    code k in bits k*bits.. (GPTQ's packing of every width; 3-bit codes cross words)."""
    n = codes.shape[0]
    assert (n * bits) % 32 == 0
    words = np.zeros((n * bits // 32,) + codes.shape[1:], dtype=np.uint64)
    for k in range(n):
        bit = k * bits
        v = codes[k].astype(np.uint64) << np.uint64(bit % 32)
        words[bit // 32] |= v & np.uint64(0xFFFFFFFF)
        if bit // 32 + 1 < words.shape[0]:
            words[bit // 32 + 1] |= v >> np.uint64(32)
    return (words & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)


def gptq_quantize(w, bits, group, sym, act_order, rng):
    """Round-to-nearest GPTQ-style quantization of w [N, K] (GPTQ's Quantizer: asymmetric
    min/max or symmetric with the zero point at the midpoint). Returns codes [K, N] uint,
    zeros [G, N], scales fp16 [G, N], g_idx [K]."""
    n, k = w.shape
    maxq = 2**bits - 1
    group = group if group > 0 else k
    perm = rng.permutation(k) if act_order else np.arange(k)
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[perm] = np.arange(k) // group
    groups = k // group
    scales = np.zeros((groups, n), dtype=np.float16)
    zeros = np.zeros((groups, n), dtype=np.int64)
    codes = np.zeros((k, n), dtype=np.int64)
    for g in range(groups):
        cols = perm[g * group:(g + 1) * group]
        x = w[:, cols]
        lo = np.minimum(x.min(axis=1), 0)
        hi = np.maximum(x.max(axis=1), 0)
        if sym:
            amax = np.maximum(-lo, hi)
            s = (2 * amax / maxq).astype(np.float16)
            z = np.full(n, (maxq + 1) // 2)
        else:
            s = ((hi - lo) / maxq).astype(np.float16)
            z = np.round(-lo / s.astype(np.float32)).astype(np.int64)
        s = np.where(s == 0, np.float16(1e-3), s)
        scales[g] = s
        zeros[g] = z
        q = np.clip(np.round(x / s.astype(np.float32)[:, None]) + z[:, None], 0, maxq)
        codes[cols] = q.T
    return codes.astype(np.uint32), zeros, scales, g_idx


def gptq_tensors(w, bits, group, sym, act_order, v1, rng):
    codes, zeros, scales, g_idx = gptq_quantize(w, bits, group, sym, act_order, rng)
    stored_zeros = (zeros - 1) if v1 else zeros
    stored_zeros = (stored_zeros & (2**bits - 1)).astype(np.uint32)
    return {
        "qweight": pack_stream(codes, bits),
        "qzeros": pack_stream(stored_zeros.T, bits).T.copy(),
        "scales": scales,
        "g_idx": g_idx,
    }


def unpack_stream(words, bits, count):
    """Inverse of pack_stream along axis 0."""
    w = words.view(np.uint32).astype(np.uint64)
    out = np.zeros((count,) + w.shape[1:], dtype=np.uint64)
    for k in range(count):
        bit = k * bits
        lo = w[bit // 32]
        hi = w[bit // 32 + 1] if bit // 32 + 1 < w.shape[0] else np.zeros_like(lo)
        out[k] = ((lo | (hi << np.uint64(32))) >> np.uint64(bit % 32)) & np.uint64(2**bits - 1)
    return out.astype(np.int64)


def spec_dequantize(t, bits, v1):
    """This script's own reading of the layout (numpy), checked against GPTQModel's."""
    k = t["g_idx"].shape[0]
    groups, n = t["scales"].shape
    q = unpack_stream(t["qweight"], bits, k)                      # [K, N]
    z = unpack_stream(t["qzeros"].T.copy(), bits, n).T + int(v1)  # [G, N]
    g = t["g_idx"].astype(np.int64)
    w = (q - z[g]).astype(np.float32) * t["scales"].astype(np.float32)[g]
    return w.T.copy()


def gptqmodel_dequantize(t, bits, group, sym, desc_act, v1):
    w = _gptqmodel_dequantize(t, bits, group, sym, desc_act, v1)
    spec = spec_dequantize(t, bits, v1)
    assert np.array_equal(w.view(np.uint32), spec.view(np.uint32)), "GPTQModel != spec"
    return w


def _gptqmodel_dequantize(t, bits, group, sym, desc_act, v1):
    """The weight [N, K] in float32 as GPTQModel's torch kernel computes it from the stored
    tensors (its generic PackableQuantLinear.dequantize_weight: `scales[g_idx] * (weight -
    zeros[g_idx])`), with the scales upcast to float32 so that the product is exact."""
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module

    k = t["g_idx"].shape[0]
    n = t["scales"].shape[1]
    m = TorchLinear(bits=bits, group_size=group, sym=sym, desc_act=desc_act, in_features=k,
                    out_features=n, bias=False, pack_dtype=torch.int32)
    m.qweight.data = torch.from_numpy(t["qweight"].copy())
    m.qzeros.data = torch.from_numpy(t["qzeros"].copy())
    m.scales.data = torch.from_numpy(t["scales"].copy())
    m.g_idx.data = torch.from_numpy(t["g_idx"].copy())
    if v1:  # the torch kernel reads v2 zero points; GPTQModel converts v1 ones at load
        convert_gptq_v1_to_v2_format_module(m, bits=bits, pack_dtype=torch.int32)
    m.scales.data = m.scales.data.float()
    with torch.no_grad():
        w = PackableQuantLinear.dequantize_weight(m)
    return w.T.contiguous().float().numpy()


def gptq_config(bits, group, sym, desc_act, fmt):
    # As GPTQModel 7 writes it (Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4 has the same semantic keys:
    # bits, group_size, desc_act, sym, quant_method, checkpoint_format absent = gptq).
    return {"bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
            "lm_head": False, "quant_method": "gptq", "checkpoint_format": fmt, "format": fmt,
            "pack_dtype": "int32", "true_sequential": True, "damp_percent": 0.05,
            "meta": {"quantizer": ["exactscore make_format_fixtures.py (round to nearest)"]}}


GPTQ_VARIANTS = {
    # name: bits, group, sym, desc_act, v1
    "llama-gptq-int4-g128": (4, 128, True, False, True),
    "llama-gptq-v2-int3-actorder-asym": (3, 64, False, True, False),
}

# Dequantization vectors: every width, both zero-point formats, sym/asym, act-order.
GPTQ_VECTORS = [(b, g, s, a, v1) for b in (2, 3, 4, 8) for (g, s, a, v1) in
                [(32, True, False, True), (32, False, True, True), (64, False, True, False),
                 (-1, False, False, True)]]


# ----------------------------------------------------------------------------------------------
# Common: the dense model, references, files
# ----------------------------------------------------------------------------------------------
def dense_tensors():
    return {k: v for k, v in load_file(str(DENSE / "model.safetensors")).items()}


def texts():
    ref = json.loads((DENSE / "reference.json").read_text())
    return [(s["text"], s["token_ids"]) for s in ref["sequences"]]


def versions():
    import safetensors
    import transformers
    out = {"python": sys.version.split()[0], "torch": torch.__version__,
           "transformers": transformers.__version__, "safetensors": safetensors.__version__,
           "numpy": np.__version__}
    try:
        import gptqmodel
        out["gptqmodel"] = gptqmodel.__version__
    except Exception:
        pass
    return out


@torch.no_grad()
def reference_logprobs(weights):
    """transformers float32 LlamaForCausalLM (sdpa) with `weights` (name -> float32 tensor)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(str(DENSE))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    model.eval()
    seqs = []
    for text, ids in texts():
        logits = model(input_ids=torch.tensor([ids])).logits[0].to(torch.float64)
        lsm = torch.log_softmax(logits, dim=-1)
        lp = lsm[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
        seqs.append({"text": text, "token_ids": ids,
                     "token_logprobs": [None] + [float(v) for v in lp],
                     "top1_ids": [int(i) for i in logits.argmax(-1)],
                     "sum_nll": float(-lp.sum()), "num_scored": len(lp)})
    return seqs


def dequant_check(deq):
    out = {}
    for name, w in sorted(deq.items()):
        w = np.ascontiguousarray(w, dtype=np.float32)
        out[name] = {"shape": list(w.shape),
                     "sha256_f32_le": hashlib.sha256(w.astype("<f4").tobytes()).hexdigest(),
                     "sum_f64": float(w.astype(np.float64).sum())}
    return out


def write_variant(name, qconfig, quantized, deq, dequantizer):
    out = FIXTURES / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        shutil.copy(DENSE / f, out / f)
    cfg = json.loads((DENSE / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_mixed(quantized, out / "model.safetensors")
    dense = dense_tensors()
    weights = {k: v.float() for k, v in dense.items()}
    for lin, w in deq.items():
        weights[lin + ".weight"] = torch.from_numpy(w)
    seqs = reference_logprobs(weights)
    ref = {"variant": name, "torch_dtype_used": "float32", "reference_mode": "weights_only",
           "dequantizer": dequantizer, "sequences": seqs,
           "mean_nll": sum(s["sum_nll"] for s in seqs) / sum(s["num_scored"] for s in seqs),
           "versions": versions()}
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    (out / "dequant_check.json").write_text(json.dumps(dequant_check(deq), indent=1) + "\n")
    print(f"{name}: mean NLL {ref['mean_nll']:.6f}, "
          f"{(out / 'model.safetensors').stat().st_size} bytes")


def base_tensors(dense, quantized_linears):
    """Every dense tensor but the weights of the quantized Linears, as numpy (bf16 kept)."""
    out = {}
    for k, v in dense.items():
        if k[: -len(".weight")] in quantized_linears:
            continue
        out[k] = v
    return out


def save_mixed(tensors, path):
    """numpy arrays and torch tensors (bf16, which numpy lacks) into one safetensors file."""
    from safetensors.torch import save_file as save_torch
    save_torch({k: (v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v)))
                for k, v in tensors.items()}, str(path))


def linear_names(dense):
    return [f"model.layers.{i}.{l}" for i in range(2) for l in LINEARS
            if f"model.layers.{i}.{l}.weight" in dense]


# ----------------------------------------------------------------------------------------------
def make_gptq(name, spec, seed):
    bits, group, sym, desc_act, v1 = spec
    rng = np.random.default_rng(seed)
    dense = dense_tensors()
    lins = linear_names(dense)
    tensors = base_tensors(dense, set(lins))
    deq = {}
    for lin in lins:
        w = dense[lin + ".weight"].float().numpy()
        t = gptq_tensors(w, bits, group, sym, desc_act, v1, rng)
        for k, v in t.items():
            tensors[f"{lin}.{k}"] = v
        deq[lin] = gptqmodel_dequantize(t, bits, group, sym, desc_act, v1)
    fmt = "gptq" if v1 else "gptq_v2"
    write_variant(name, gptq_config(bits, group, sym, desc_act, fmt), tensors, deq,
                  "gptqmodel 7.7.0 PackableQuantLinear.dequantize_weight (f32 scales)")


def make_ct_actorder(name, seed, group=64):
    """compressed-tensors `pack-quantized` int4, symmetric, `actorder: group` with
    `weight_g_idx`, as compressed-tensors wrote it before 0.19 removed it (0.19 can no longer
    read it): codes packed along each row (element 0 in the low bits, offset 8), bf16
    `weight_scale` [out, groups], `weight_g_idx` I32 [in]. The weights are the same codes read
    as a GPTQ v2 layer by GPTQModel, which applies the same g_idx lookup."""
    rng = np.random.default_rng(seed)
    dense = dense_tensors()
    lins = linear_names(dense)
    tensors = base_tensors(dense, set(lins))
    deq = {}
    for lin in lins:
        w = dense[lin + ".weight"].float().numpy()
        codes, zeros, scales, g_idx = gptq_quantize(w, 4, group, True, True, rng)
        scales_bf16 = torch.from_numpy(scales.astype(np.float32)).to(torch.bfloat16)
        t = {"qweight": pack_stream(codes, 4),
             "qzeros": pack_stream(zeros.astype(np.uint32).T, 4).T.copy(),
             "scales": scales_bf16.float().numpy(), "g_idx": g_idx}
        deq[lin] = gptqmodel_dequantize(t, 4, group, True, True, v1=False)
        # GPTQ's qweight transposed: each row's codes along K, the offset 8 already in them.
        tensors[f"{lin}.weight_packed"] = pack_stream(codes, 4).T.copy()
        tensors[f"{lin}.weight_scale"] = scales_bf16.T.contiguous()
        tensors[f"{lin}.weight_g_idx"] = g_idx
        tensors[f"{lin}.weight_shape"] = np.array(w.shape, dtype=np.int64)
    qconfig = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
        "sparsity_config": {}, "transform_config": {},
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
            "output_activations": None,
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": group, "actorder": "group", "dynamic": False,
                        "block_structure": None, "observer": "minmax"}}}}
    write_variant(name, qconfig, tensors, deq,
                  "gptqmodel 7.7.0 PackableQuantLinear.dequantize_weight of the same codes, "
                  "zero points and bf16 scales as a gptq_v2 layer (f32 scales)")


def make_gptq_vectors(seed):
    """tests/fixtures/gptq-vectors/: small layers [N=32, K=128] of every width and zero-point
    format, and each one's float32 weight as GPTQModel dequantizes it (`<layer>.expected`)."""
    rng = np.random.default_rng(seed)
    out = FIXTURES / "gptq-vectors"
    out.mkdir(exist_ok=True)
    tensors, layers = {}, {}
    for bits, group, sym, act, v1 in GPTQ_VECTORS:
        layer = f"b{bits}_g{group}_{'sym' if sym else 'asym'}{'_act' if act else ''}_{'v1' if v1 else 'v2'}"
        w = rng.standard_normal((32, 128)).astype(np.float32) * 0.05
        t = gptq_tensors(w, bits, group, sym, act, v1, rng)
        for k, v in t.items():
            tensors[f"{layer}.{k}"] = v
        tensors[f"{layer}.expected"] = gptqmodel_dequantize(t, bits, group, sym, act, v1)
        layers[layer] = {"bits": bits, "group_size": group, "sym": sym, "desc_act": act,
                         "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "layers.json").write_text(json.dumps({"versions": versions(), "layers": layers},
                                                indent=1) + "\n")
    print(f"gptq-vectors: {len(layers)} layers")


# ----------------------------------------------------------------------------------------------
# compressed-tensors formats: quantized by llm-compressor, decompressed by compressed-tensors
# ----------------------------------------------------------------------------------------------
CT_VARIANTS = {
    # name: llm-compressor preset scheme
    "llama-mxfp4a16": "MXFP4A16",
}


def make_ct(name, scheme):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    out = FIXTURES / name
    if out.exists():
        shutil.rmtree(out)
    model = AutoModelForCausalLM.from_pretrained(str(DENSE), dtype=torch.bfloat16)
    model = oneshot(model=model, recipe=QuantizationModifier(
        targets="Linear", scheme=scheme, ignore=["lm_head"]))
    model.save_pretrained(str(out), save_compressed=True)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(DENSE / f, out / f)
    # The reference: transformers loads the checkpoint and compressed-tensors decompresses it
    # (to bf16 for the fp4 formats: upcast to f32, exact).
    m = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    hq = getattr(m, "hf_quantizer", None)
    if hq is not None and hasattr(m, "ct_decompress_hook"):
        hq.compressor.decompress_model(m)
    weights = {k: v.detach().float() for k, v in m.state_dict().items()
               if not k.endswith(("_scale", "_packed", "_zero_point", "_global_scale"))}
    deq = {k[: -len(".weight")]: v.numpy() for k, v in weights.items()
           if k[: -len(".weight")] in set(linear_names(dense_tensors()))}
    seqs = reference_logprobs(weights)
    ref = {"variant": name, "torch_dtype_used": "float32", "reference_mode": "weights_only",
           "dequantizer": "compressed-tensors 0.19.0 (transformers from_pretrained + "
                          "decompress_model)", "sequences": seqs,
           "mean_nll": sum(s["sum_nll"] for s in seqs) / sum(s["num_scored"] for s in seqs),
           "versions": versions()}
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    (out / "dequant_check.json").write_text(json.dumps(dequant_check(deq), indent=1) + "\n")
    print(f"{name}: mean NLL {ref['mean_nll']:.6f}, {len(deq)} Linears")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    torch.manual_seed(0)
    for i, (name, spec) in enumerate(GPTQ_VARIANTS.items()):
        if not only or name in only:
            make_gptq(name, spec, 100 + i)
    if not only or "gptq-vectors" in only:
        make_gptq_vectors(200)
    if not only or "llama-w4a16-actorder-g64" in only:
        make_ct_actorder("llama-w4a16-actorder-g64", 300)
    for name, scheme in CT_VARIANTS.items():
        if not only or name in only:
            make_ct(name, scheme)


if __name__ == "__main__":
    main()
