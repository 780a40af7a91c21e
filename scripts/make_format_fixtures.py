#!/usr/bin/env python3
"""Fixtures of the non-compressed-tensors checkpoint formats (issue 35): the tiny Llama of
tests/fixtures/llama-dense-bf16 quantized into each format's own on-disk layout, each with
float32 reference log-probs from transformers on the weights dequantized by the format's own
library, and dequantization test vectors.

    /tmp/venv-fixtures/bin/python scripts/make_format_fixtures.py [--only NAME,...]

The AWQ and FP8 fixtures quantize a smaller base (`tiny_dense()`: hidden 128, tied
embeddings) to stay under 1 MB each; FP8's reference.json also holds `reference_emulated`,
transformers with vLLM's per-token-group fp8 activation QDQ. The W8A8-INT8 fixture is
llm-compressor's `W8A8` preset on that base; its `reference_emulated` is vLLM's int8
activations with the int8 GEMM exact in int32 (`reference_emulated_qdq`: the same activations
dequantized, then an f32 GEMM). The ModelOpt NVFP4, FP8 and MIXED_PRECISION fixtures are
packed by this script from the format; `llama-modelopt-export-nvfp4` and
`llama-modelopt-export-fp8` are quantized and exported by nvidia-modelopt 0.47.0 itself (on the
CPU), which also checks the packer: its NVFP4 export is bit-identical. `llama-fp8-static-tensor`
is llm-compressor's `FP8` preset. The per-tensor FP8 fixtures with a scale per fused shard hold
`reference_served`: the weights requantized as vLLM serves them (`vllm_fused_fp8`).

The KV-cache fixtures (`llama-kv-fp8-tensor`, `llama-kv-fp8-head`, `llama-kv-none`) are W4A16
checkpoints whose fp8 k/v scales llm-compressor 0.14 calibrates (`kv_cache_scheme`, per tensor
and per head; none for the last), with `reference_kv_emulated` / `reference_kv_simulated`:
transformers with vLLM's FlashAttention 3 fp8 QDQ of q, k, v after RoPE (docs/kv-cache.md).

The AutoRound fixtures (`llama-autoround-int4-g64-sym`, `llama-autoround-awq-int4-g64`) are
quantized and exported by auto-round 0.16.1 itself (RTN, on the CPU, the reference sequences as
calibration), which needs `pip install --no-deps auto-round==0.16.1` beside GPTQModel.

Needs the fixture venv (transformers 5.17, torch 2.14 CPU) and, for GPTQ and AWQ, GPTQModel 7.7.0
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
def reference_logprobs(weights, config=None, hooks=None):
    """transformers float32 LlamaForCausalLM (sdpa) with `weights` (name -> float32 tensor), of
    `config` (a config.json dict; llama-dense-bf16's when None). `hooks(model)` may register
    forward pre-hooks (activation emulation) before scoring."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
    cfg = AutoConfig.from_pretrained(str(DENSE)) if config is None else LlamaConfig(**config)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in m or (cfg.tie_word_embeddings and m == "lm_head.weight")
                                  for m in missing), (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    if hooks is not None:
        hooks(model)
    return scored(model)


def dequant_check(deq):
    out = {}
    for name, w in sorted(deq.items()):
        w = np.ascontiguousarray(w, dtype=np.float32)
        out[name] = {"shape": list(w.shape),
                     "sha256_f32_le": hashlib.sha256(w.astype("<f4").tobytes()).hexdigest(),
                     "sum_f64": float(w.astype(np.float64).sum())}
    return out


def write_variant(name, qconfig, quantized, deq, dequantizer, config=None, dense=None,
                  emulated=None, extra_emulated=None):
    """`config` / `dense`: the base model's config.json dict and tensors (llama-dense-bf16's
    when None). `emulated`: (description, hooks) of an activation-emulation reference, written
    beside the weights-only one as `reference_emulated`; `extra_emulated`: {key: (description,
    hooks)} of further ones (their log-probs only, to keep the fixture small)."""
    out = FIXTURES / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        shutil.copy(DENSE / f, out / f)
    cfg = dict(config) if config is not None else json.loads((DENSE / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_mixed(quantized, out / "model.safetensors")
    dense = dense_tensors() if dense is None else dense
    weights = {k: v.float() for k, v in dense.items()}
    for lin, w in deq.items():
        weights[lin + ".weight"] = torch.from_numpy(w)
    seqs = reference_logprobs(weights, config)
    mean = lambda seqs: sum(s["sum_nll"] for s in seqs) / sum(s["num_scored"] for s in seqs)
    ref = {"variant": name, "torch_dtype_used": "float32", "reference_mode": "weights_only",
           "dequantizer": dequantizer, "sequences": seqs, "mean_nll": mean(seqs),
           "versions": versions()}
    if emulated is not None:
        what, hooks = emulated
        em = reference_logprobs(weights, config, hooks)
        ref["reference_emulated"] = {"activations": what, "sequences": em, "mean_nll": mean(em)}
    for key, (what, hooks) in (extra_emulated or {}).items():
        em = reference_logprobs(weights, config, hooks)
        slim = [{k: s[k] for k in ("token_logprobs", "sum_nll", "num_scored")} for s in em]
        ref[key] = {"activations": what, "sequences": slim, "mean_nll": mean(em)}
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


# GPTQModel's `dynamic` (per-module overrides, first matching pattern wins): layer 0's
# down_proj left in bf16 (`-:`), layer 1's Linears 8-bit, group 64, asymmetric; the rest 4-bit,
# group 128, symmetric. The order matters: layer 1's pattern would not match layer 0 anyway,
# but a `.*down_proj` entry after it would be shadowed for layer 1.
GPTQ_DYNAMIC = {
    r"-:model\.layers\.0\.mlp\.down_proj": {},
    r"+:model\.layers\.1\..*": {"bits": 8, "group_size": 64, "sym": False},
    r"-:.*down_proj": {},
}


def make_gptq_dynamic(name, seed, base=(4, 128, True)):
    import re
    rng = np.random.default_rng(seed)
    dense = tiny_dense()
    lins = linear_names(dense)
    spec = {}
    for lin in lins:
        for pattern, overrides in GPTQ_DYNAMIC.items():
            negative = pattern.startswith("-:")
            if re.match(pattern[2:], lin):
                spec[lin] = None if negative else (overrides.get("bits", base[0]),
                                                   overrides.get("group_size", base[1]),
                                                   overrides.get("sym", base[2]))
                break
        else:
            spec[lin] = base
    tensors = base_tensors(dense, {l for l in lins if spec[l] is not None})
    deq = {}
    for lin in lins:
        if spec[lin] is None:
            continue
        bits, group, sym = spec[lin]
        w = dense[lin + ".weight"].float().numpy()
        t = gptq_tensors(w, bits, group, sym, False, True, rng)
        for k, v in t.items():
            tensors[f"{lin}.{k}"] = v
        deq[lin] = gptqmodel_dequantize(t, bits, group, sym, False, True)
    qconfig = gptq_config(*base, False, "gptq")
    qconfig["dynamic"] = GPTQ_DYNAMIC
    write_variant(name, qconfig, tensors, deq,
                  "gptqmodel 7.7.0 PackableQuantLinear.dequantize_weight (f32 scales), each "
                  "layer with its `dynamic` overrides", config=tiny_config(), dense=dense)


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
# A smaller base for the fixtures below (each < 1 MB): llama-dense-bf16's tokenizer, sequences
# and RoPE, hidden 128, intermediate 256, 2 layers, one KV head, tied embeddings; random
# weights (seeded), bf16.
# ----------------------------------------------------------------------------------------------
def tiny_config():
    cfg = json.loads((DENSE / "config.json").read_text())
    cfg.update({"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 64, "num_hidden_layers": 2,
                "tie_word_embeddings": True})
    return cfg


def tiny_dense(seed=400, cfg=None):
    """The tiny base's tensors (bf16), of `cfg` (`tiny_config()` when None): embeddings
    N(0, 0.1) (tied with the head: logits of order one), Linears N(0, 1/in), norms near one."""
    cfg = tiny_config() if cfg is None else cfg
    g = torch.Generator().manual_seed(seed)
    h, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
              "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
              "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    rand = lambda *shape, std: (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)
    out = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h, std=0.1),
           "model.norm.weight": (1 + rand(h, std=0.05).float()).to(torch.bfloat16)}
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}"
        for lin, (o, k) in shapes.items():
            out[f"{pre}.{lin}.weight"] = rand(o, k, std=k ** -0.5)
        for norm in ["input_layernorm", "post_attention_layernorm"]:
            out[f"{pre}.{norm}.weight"] = (1 + rand(h, std=0.05).float()).to(torch.bfloat16)
    return out


# ----------------------------------------------------------------------------------------------
# AWQ GEMM (AutoAWQ's WQLinear_GEMM layout): qweight [in, out/8] with the 8 codes of a word in
# the order [0, 2, 4, 6, 1, 3, 5, 7], qzeros [in/g, out/8] alike, fp16 scales [in/g, out]
# ----------------------------------------------------------------------------------------------
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def awq_quantize(w, group):
    """AutoAWQ's pseudo_quantize_tensor (zero point, 4 bits) of w [N, K] without the
    activation-aware search: per group of `group` inputs, fp16 scale (max - min) / 15, zero
    point -round(min / scale). Returns codes [K, N], zeros [G, N] (int32), scales [G, N] fp16."""
    n, k = w.shape
    x = w.reshape(n, k // group, group)
    hi, lo = x.max(axis=-1), x.min(axis=-1)
    s = (np.maximum(hi - lo, 1e-5) / 15).astype(np.float16)
    s32 = s.astype(np.float32)
    z = np.clip(-np.round(lo / s32), 0, 15)
    q = np.clip(np.round(x / s32[..., None]) + z[..., None], 0, 15)
    return (q.reshape(n, k).T.astype(np.int32), z.T.astype(np.int32), s.T.copy())


def awq_spec_dequantize(t, group):
    """This script's own reading of the layout (numpy), checked against GPTQModel's."""
    def unpack(words):
        w = words.view(np.uint32)
        codes = np.stack([(w >> np.uint32(4 * AWQ_REVERSE_ORDER[m])) & np.uint32(15)
                          for m in range(8)], axis=-1)
        return codes.reshape(w.shape[0], -1).astype(np.int64)
    q, z = unpack(t["qweight"]), unpack(t["qzeros"])
    g = np.arange(q.shape[0]) // group
    return ((q - z[g]).astype(np.float32) * t["scales"].astype(np.float32)[g]).T.copy()


def awq_tensors(w, group):
    """The AWQ tensors of w, packed by GPTQModel's `pack_awq`, and the weight [N, K] as
    GPTQModel's `dequantize_gemm` computes it with the scales upcast to f32 (exact)."""
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm, pack_awq
    codes, zeros, scales = awq_quantize(w, group)
    qweight, qzeros = pack_awq(torch.from_numpy(codes), torch.from_numpy(zeros), 4)
    t = {"qweight": qweight.numpy(), "qzeros": qzeros.numpy(), "scales": scales}
    deq = dequantize_gemm(qweight, qzeros, torch.from_numpy(scales).float(), 4, group)
    deq = deq.T.contiguous().numpy()
    assert deq.dtype == np.float32
    spec = awq_spec_dequantize(t, group)
    assert np.array_equal(deq.view(np.uint32), spec.view(np.uint32)), "GPTQModel != spec"
    return t, deq


def make_awq(name, group=64):
    dense = tiny_dense()
    lins = linear_names(dense)
    tensors = base_tensors(dense, set(lins))
    deq = {}
    for lin in lins:
        t, deq[lin] = awq_tensors(dense[lin + ".weight"].float().numpy(), group)
        for k, v in t.items():
            tensors[f"{lin}.{k}"] = v
    # As AutoAWQ 0.2 writes it (Qwen/Qwen2.5-7B-Instruct-AWQ has these keys and values, but
    # group_size 128).
    qconfig = {"bits": 4, "group_size": group, "modules_to_not_convert": None,
               "quant_method": "awq", "version": "gemm", "zero_point": True}
    write_variant(name, qconfig, tensors, deq,
                  "gptqmodel 7.7.0 quantization.awq.utils.packing_utils.dequantize_gemm "
                  "(f32 scales) of the tensors its pack_awq packed",
                  config=tiny_config(), dense=dense)


# ----------------------------------------------------------------------------------------------
# AutoRound (`quant_method: auto-round`): quantized and exported by auto-round itself (RTN,
# iters=0, on the CPU), in both of its packings: `auto_round:auto_gptq` (sym, GPTQ's layout,
# zero points stored minus one) and `auto_round:auto_awq` (what it writes for asymmetric 4-bit).
# The weights as auto-round's inference modules dequantize them, with the scales upcast to f32:
# its torch QuantLinear for the GPTQ packing, GPTQModel's dequantize_gemm for the AWQ one.
# ----------------------------------------------------------------------------------------------
AUTOROUND_VARIANTS = {
    # name: (sym, format passed to quantize_and_save)
    "llama-autoround-int4-g64-sym": (True, "auto_round"),
    "llama-autoround-awq-int4-g64": (False, "auto_round"),
}


def make_autoround(name, sym, fmt, group=64):
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from safetensors.torch import save_file as save_torch, load_file as load_torch

    cfg = tiny_config()
    dense = tiny_dense(cfg=cfg)
    work = FIXTURES / f".{name}-work"
    shutil.rmtree(work, ignore_errors=True)
    base = work / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps(cfg))
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(DENSE / f, base / f)
    save_torch(dense, str(base / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(base))
    calibration = [text for text, _ in texts()]
    ar = AutoRound(model, tok, bits=4, group_size=group, sym=sym, iters=0, dataset=calibration,
                   nsamples=len(calibration), seqlen=64, device_map="cpu", disable_opt_rtn=True)
    ar.quantize_and_save(str(work / "out"), format=fmt)
    saved = next(p.parent for p in (work / "out").rglob("model.safetensors"))
    qconfig = json.loads((saved / "config.json").read_text())["quantization_config"]
    # auto-round's dequantization, f32 scales
    m = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32, device_map="cpu")
    deq = {}
    for lin, mod in m.named_modules():
        if not hasattr(mod, "qweight"):
            continue
        if qconfig["packing_format"] == "auto_round:auto_awq":
            from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
            w = dequantize_gemm(mod.qweight, mod.qzeros, mod.scales.float(), 4, group).T
        else:
            # The weight its forward multiplies by (captured: a product with an identity
            # would turn its -0.0s into +0.0).
            mod.scales = mod.scales.float()
            seen, matmul = [], torch.matmul
            torch.matmul = lambda x, w: seen.append(w) or matmul(x, w)
            try:
                with torch.no_grad():
                    mod(torch.zeros(1, mod.infeatures, dtype=torch.float32))
            finally:
                torch.matmul = matmul
            w = seen[0].T
        deq[lin] = w.contiguous().float().numpy()
    tensors = {k: v for k, v in load_torch(str(saved / "model.safetensors")).items()}
    shutil.rmtree(work)
    import auto_round
    write_variant(name, qconfig, tensors, deq,
                  f"auto-round {auto_round.__version__} ({qconfig['packing_format']}): its "
                  "inference module's dequantization with f32 scales",
                  config=cfg, dense=dense)


# ----------------------------------------------------------------------------------------------
# Hugging Face FP8 with block scales (`quant_method: fp8`, transformers' finegrained_fp8):
# weight float8_e4m3fn [out, in], weight_scale_inv f32 [ceil(out/b0), ceil(in/b1)]
# ----------------------------------------------------------------------------------------------
FP8_MAX = 448.0


def ceil_power_of_two(s):
    """2^ceil(log2 s) of positive normal f32s, exactly (a set mantissa carries into the
    exponent): DeepGEMM's and DeepSeek's `ceil_to_ue8m0`, without log2's rounding."""
    bits = s.float().contiguous().view(torch.int32)
    return ((bits + 0x7FFFFF) & -0x800000).view(torch.float32)


def fp8_block_quantize(w, block, ue8m0=False):
    """transformers' Fp8Quantize of w [N, K] (per block: inverse scale amax / 448, stored;
    codes clamp(w * 448 / amax) to e4m3), over ceil-sized blocks so that edge blocks (N or K
    not a multiple of the block) are quantized too, as DeepSeek's and vLLM's quantizers do.
    With `ue8m0`, DeepSeek-V3.1's `per_block_cast_to_fp8(use_ue8m0=True)`: the inverse scale
    max(amax, 1e-4) / 448 rounded up to a power of two, codes e4m3(w / it)."""
    w = torch.from_numpy(w).float()
    n, k = w.shape
    b0, b1 = block
    rows, cols = -(-n // b0), -(-k // b1)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    inv = torch.empty(rows, cols, dtype=torch.float32)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * b0:(r + 1) * b0, c * b1:(c + 1) * b1]
            amax = tile.abs().amax()
            if ue8m0:
                inv[r, c] = ceil_power_of_two((amax.clamp(min=1e-4) / FP8_MAX).reshape(1))[0]
                codes = tile / inv[r, c]
            else:
                scale = FP8_MAX / amax if amax > 0 else torch.tensor(1.0)
                inv[r, c] = (1.0 / scale).float()
                codes = torch.clamp(tile * scale, -FP8_MAX, FP8_MAX)
            q[r * b0:(r + 1) * b0, c * b1:(c + 1) * b1] = codes.to(torch.float8_e4m3fn)
    return q, inv


def fp8_block_spec_dequantize(q, inv, block):
    """w[r, c] = f32(q[r, c]) * inv[r // b0, c // b1]: the block kernels' reading (vLLM's
    w8a8_block_fp8_matmul, transformers' Triton and DeepGEMM paths), edge blocks included."""
    b0, b1 = block
    s = inv.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[: q.shape[0], : q.shape[1]]
    return (q.float() * s).numpy()


def vllm_group_qdq(x, group=128, ue8m0=False):
    """vLLM's per_token_group_quant_fp8 (the dynamic activations of a block-FP8 Linear) then
    the dequantization its block GEMM applies, in f32: per token and group of 128 inputs,
    s = max(amax |x|, 1e-10) / 448 (with `ue8m0`, rounded up to a power of two, as
    `use_ue8m0` does), q = e4m3(clamp(x / s, ±448)), x' = q * s."""
    shape = x.shape
    x = x.float().reshape(-1, shape[-1] // group, group)
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    if ue8m0:
        s = ceil_power_of_two(s)
    q = torch.clamp(x / s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).reshape(shape)


def fp8_hooks(linears, ue8m0=False):
    def register(model):
        for name in linears:
            model.get_submodule(name).register_forward_pre_hook(
                lambda _m, args: (vllm_group_qdq(args[0], ue8m0=ue8m0),))
    return register


def make_fp8_block(name, block=(128, 128), ue8m0=False):
    dense = tiny_dense()
    lins = linear_names(dense)
    tensors = base_tensors(dense, set(lins))
    spec = {}
    for lin in lins:
        q, inv = fp8_block_quantize(dense[lin + ".weight"].float().numpy(), block, ue8m0)
        tensors[f"{lin}.weight"] = q
        tensors[f"{lin}.weight_scale_inv"] = inv
        spec[lin] = fp8_block_spec_dequantize(q, inv, block)
    # As the Qwen3 FP8 releases write it (Qwen/Qwen3-8B-FP8: these keys and values); with
    # ue8m0 as DeepSeek-V3.1's (deepseek-ai/DeepSeek-V3.1: `scale_fmt: ue8m0`).
    qconfig = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
               "weight_block_size": list(block)}
    if ue8m0:
        qconfig["scale_fmt"] = "ue8m0"
    scales = ", scales rounded up to powers of two (ue8m0)" if ue8m0 else ""
    write_variant(name, qconfig, tensors, spec, "transformers 5.17 finegrained_fp8 "
                  "(from_pretrained on the CPU: Fp8Dequantize), equal to the block formula",
                  config=tiny_config(), dense=dense,
                  emulated=(f"vLLM per_token_group_quant_fp8, group 128{scales}, then the "
                            "block GEMM's dequantization (f32)", fp8_hooks(lins, ue8m0)))
    # The library's reading: transformers loads the fixture (no GPU: dequantize=True).
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(FIXTURES / name), dtype=torch.float32)
    sd = m.state_dict()
    for lin in lins:
        got = sd[lin + ".weight"].float().numpy()
        assert np.array_equal(got.view(np.uint32), spec[lin].view(np.uint32)), lin
    print(f"{name}: transformers' dequantization equals the block formula on every Linear")


# Edge blocks: shapes that are not multiples of the block, each layer's expected weight by the
# block formula (`layers.json`: its SHA-256). transformers' CPU path (Fp8Dequantize) derives the
# block from the scale grid (rows // grid rows), so it refuses [130, 260] (grid [2, 3] does not
# divide it) and reads [200, 136] (grid [2, 2]) as blocks of 100 x 68: wrong, silently. Only
# [256, 128] it reads as the kernels do (FORMATS.md).
FP8_VECTORS = {"edge_200x136": (200, 136), "edge_130x260": (130, 260), "full_256x128": (256, 128)}


def make_fp8_vectors(seed):
    g = torch.Generator().manual_seed(seed)
    out = FIXTURES / "fp8-block-vectors"
    out.mkdir(exist_ok=True)
    tensors, layers = {}, {}
    for layer, (n, k) in FP8_VECTORS.items():
        w = (torch.randn(n, k, generator=g) * 0.05).numpy()
        q, inv = fp8_block_quantize(w, (128, 128))
        tensors[f"{layer}.weight"] = q
        tensors[f"{layer}.weight_scale_inv"] = inv
        deq = fp8_block_spec_dequantize(q, inv, (128, 128))
        layers[layer] = {"shape": [n, k], **dequant_check({layer: deq})[layer]}
    save_mixed(tensors, out / "model.safetensors")
    (out / "layers.json").write_text(json.dumps({"versions": versions(), "block": [128, 128],
                                                 "layers": layers}, indent=1) + "\n")
    print(f"fp8-block-vectors: {len(layers)} layers")


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


# ----------------------------------------------------------------------------------------------
# compressed-tensors W8A8-INT8 (llm-compressor preset `W8A8`): `int-quantized` int8 weights per
# output channel (symmetric), int8 activations per token (dynamic, symmetric)
# ----------------------------------------------------------------------------------------------
def vllm_int8_quant(x):
    """vLLM's `dynamic_scaled_int8_quant_kernel` (csrc/quantization/compressed_tensors/
    int8_quant_kernels.cu) in f32: per token absmax, scale = absmax / 127 (what the GEMM's
    epilogue multiplies by), q = cvt.rni.sat.s8(x * (127 / absmax)) (nearest even, saturated
    to [-128, 127]; a NaN from an all-zero row, 0 * inf, converts to 0)."""
    x = x.float()
    absmax = x.abs().amax(-1, keepdim=True)
    # A true f32 division, as the kernel's `127.0f / absmax` (torch's `127.0 / tensor` would
    # multiply by the tensor's reciprocal: another rounding).
    reciprocal = torch.full_like(absmax, 127.0) / absmax
    q = torch.round(x * reciprocal).clamp(-128, 127)
    return torch.nan_to_num(q, nan=0.0), absmax / 127.0


def int8_gemm_hooks(codes, scales):
    """Each Linear as vLLM's W8A8-INT8 path computes it (`cutlass_scaled_mm`): the input
    quantized per token (`vllm_int8_quant`), the int8 GEMM exact (int32 accumulation, here in
    f64: |sums| < 2^24), then the epilogue `a_scale * (b_scale * f32(acc))` in f32."""
    def register(model):
        for name, q_w in codes.items():
            s_w = scales[name].float().reshape(1, -1)
            q_w64 = q_w.double()

            def forward(x, q_w64=q_w64, s_w=s_w):
                shape = x.shape
                q, s_x = vllm_int8_quant(x.reshape(-1, shape[-1]))
                acc = (q.double() @ q_w64.T).float()
                return (s_x * (s_w * acc)).reshape(*shape[:-1], -1)
            model.get_submodule(name).forward = forward
    return register


def int8_qdq_hooks(linears):
    """The emulation ExactScore runs: the input quantized and dequantized per token in f32
    (`q * scale`), then the f32 GEMM with the dequantized weight."""
    def qdq(x):
        q, s = vllm_int8_quant(x)
        return (q * s).to(x.dtype)

    def register(model):
        for name in linears:
            model.get_submodule(name).register_forward_pre_hook(lambda _m, args: (qdq(args[0]),))
    return register


def llmcompressor_tiny(name, scheme, calibrate=False):
    """llm-compressor 0.14's preset `scheme` on the tiny base (`calibrate`: on the reference
    sequences, for static activation scales), saved compressed and read back. Returns (config,
    dense tensors, quantization_config, the saved tensors, {Linear: the weight
    compressed-tensors decompresses, f32 numpy}), each weight asserted equal to codes times
    scale."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg, dense = tiny_config(), tiny_dense()
    base = FIXTURES / f".{name}.base"  # oneshot wants a model with a path
    model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.bfloat16)
    model.load_state_dict(dense, strict=False)
    model.tie_weights()
    model.save_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    if calibrate:
        from datasets import Dataset
        from transformers import AutoTokenizer
        ids = [ids for _t, ids in texts()]
        model = oneshot(model=model, recipe=recipe, processor=AutoTokenizer.from_pretrained(
                            str(DENSE)),
                        dataset=Dataset.from_dict({"input_ids": ids,
                                                   "attention_mask": [[1] * len(i) for i in ids]}),
                        num_calibration_samples=len(ids), max_seq_length=max(map(len, ids)))
    else:
        model = oneshot(model=model, recipe=recipe)
    tmp = FIXTURES / f".{name}.tmp"
    model.save_pretrained(str(tmp), save_compressed=True)
    shutil.rmtree(base)
    qconfig = json.loads((tmp / "config.json").read_text())["quantization_config"]
    quantized = load_file(str(tmp / "model.safetensors"))
    m = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
    hq = getattr(m, "hf_quantizer", None)
    if hq is not None and hasattr(m, "ct_decompress_hook"):
        hq.compressor.decompress_model(m)
    shutil.rmtree(tmp)
    sd = m.state_dict()
    deq = {lin: sd[lin + ".weight"].detach().float().numpy() for lin in linear_names(dense)}
    for lin in deq:  # compressed-tensors' reading is the format's formula, exactly
        spec = (quantized[lin + ".weight"].float() * quantized[lin + ".weight_scale"].float())
        assert np.array_equal(spec.numpy(), deq[lin]), lin
    return cfg, dense, qconfig, quantized, deq


def make_ct_fp8_static(name):
    """llm-compressor 0.14 `FP8` (fp8 weights and static activations, one scale per tensor) on
    the tiny base, calibrated on the reference sequences; the weights as compressed-tensors
    decompresses them (each layer's own scale); `reference_served`: the weights as vLLM serves
    them (every shard requantized to its fused layer's largest scale, `vllm_fused_fp8` with
    compressed-tensors' rule), activations unquantized; `reference_emulated`: those weights
    with each Linear's input through the static fp8 QDQ of its fused layer's largest
    `input_scale`."""
    cfg, dense, qconfig, quantized, deq = llmcompressor_tiny(name, "FP8", calibrate=True)
    served = vllm_fused_fp8(quantized, always=True)
    input_scales = {}
    for layer in range(cfg["num_hidden_layers"]):
        for group in FUSED:
            names = [f"model.layers.{layer}.{g}" for g in group]
            top = max(quantized[n + ".input_scale"].float().reshape(()) for n in names)
            input_scales.update({n: top for n in names})
    write_variant(name, qconfig, quantized, deq,
                  "compressed-tensors 0.19.0 (transformers from_pretrained + decompress_model)",
                  config=cfg, dense=dense)
    weights = {k: v.float() for k, v in dense.items()}
    weights.update({lin + ".weight": w for lin, w in served.items()})
    out = FIXTURES / name
    ref = json.loads((out / "reference.json").read_text())
    mean = lambda seqs: sum(s["sum_nll"] for s in seqs) / sum(s["num_scored"] for s in seqs)
    for key, what, hooks in [
            ("reference_served", "the weights as vLLM serves them (vllm_fused_fp8, every "
             "layer requantized to its fused layer's largest scale), activations unquantized",
             None),
            ("reference_emulated", "the served weights, each Linear's input through the static "
             "fp8 QDQ (fp8_static_qdq) of its fused layer's largest input_scale",
             fp8_static_hooks(input_scales))]:
        seqs = reference_logprobs(weights, cfg, hooks)
        ref[key] = {"activations": what, "sequences": seqs, "mean_nll": mean(seqs)}
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")


def make_ct_w8a8(name):
    """llm-compressor 0.14 `W8A8` on the tiny base; the weights as compressed-tensors
    decompresses them; `reference_emulated`: vLLM's int8 activations and int32 GEMM;
    `reference_emulated_qdq`: the same activations dequantized, then an f32 GEMM."""
    cfg, dense, qconfig, quantized, deq = llmcompressor_tiny(name, "W8A8")
    lins = linear_names(dense)
    codes = {lin: quantized[lin + ".weight"] for lin in lins}
    scales = {lin: quantized[lin + ".weight_scale"] for lin in lins}
    assert all(codes[lin].dtype == torch.int8 for lin in lins)
    write_variant(name, qconfig, quantized, deq,
                  "compressed-tensors 0.19.0 (transformers from_pretrained + decompress_model)",
                  config=cfg, dense=dense,
                  emulated=("vLLM dynamic_scaled_int8_quant per token, int8 GEMM exact in "
                            "int32, epilogue a_scale * (b_scale * acc) in f32",
                            int8_gemm_hooks(codes, scales)),
                  extra_emulated={"reference_emulated_qdq": (
                      "vLLM's per-token int8 activations dequantized (q * scale, f32), then an "
                      "f32 GEMM with the dequantized weight", int8_qdq_hooks(lins))})
    make_int8_qdq_vectors(FIXTURES / name / "act_qdq_vectors.safetensors", seed=600)


def make_int8_qdq_vectors(path, seed):
    """`synthetic.input` [rows, 128] f32 and `synthetic.input_qdq`, `vllm_int8_quant`'s codes
    times its scale: random rows of several magnitudes, an all-zero row, a row of ties
    (absmax 127: x · 1 = k + 0.5, nearest even), and rows where the product by the reciprocal
    and a division by the scale round to different codes (vLLM multiplies)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(128, generator=g) * s for s in (1e-3, 0.1, 1.0, 30.0, 1e4)]
    rows.append(torch.zeros(128))
    ties = torch.arange(128, dtype=torch.float32) - 64 + 0.5
    ties[0], ties[-1] = 127.0, -127.0
    rows.append(ties)
    found = 0
    while found < 4:  # rows whose reciprocal product and division disagree somewhere
        x = torch.randn(128, generator=g)
        a = x.abs().amax()
        if not torch.equal(torch.round(x * (torch.tensor(127.0) / a)), torch.round(x / (a / 127.0))):
            rows.append(x)
            found += 1
    x = torch.stack(rows).float()
    q, s = vllm_int8_quant(x)
    save_file({"synthetic.input": x.numpy(), "synthetic.input_qdq": (q * s).numpy()}, str(path))


# ----------------------------------------------------------------------------------------------
# NVIDIA ModelOpt NVFP4 (`quant_method: modelopt`, hf_quant_config.json): codes in `weight` U8
# [out, in/2] (low nibble first), `weight_scale` F8_E4M3 [out, in/16], `weight_scale_2` F32 []
# (multiplies), `input_scale` F32 [] (activations' global scale 1 / input_scale)
# ----------------------------------------------------------------------------------------------
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FUSED = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
         ["mlp.gate_proj", "mlp.up_proj"], ["self_attn.o_proj"], ["mlp.down_proj"]]


def e2m1_codes(x):
    """Nearest e2m1 code (sign in bit 3) of each value of x (already within ±6); ties to the
    even code."""
    mag = x.abs()
    d = (mag[..., None] - E2M1).abs()
    best = d.min(-1, keepdim=True).values
    cand = torch.where(d == best, torch.arange(8), 99)
    idx = torch.where(cand % 2 == 0, cand, 99).min(-1).values
    idx = torch.where(idx == 99, cand.min(-1).values, idx)
    return (idx | torch.where(x < 0, 8, 0)).to(torch.uint8)


def modelopt_nvfp4_quantize(w, scale_2):
    """ModelOpt's NVFP4QTensor quantization of w [N, K] against the per-tensor `scale_2`
    (amax / (6 * 448)): per block of 16, fp8(amax / 6 / scale_2), codes e2m1(w / (s * scale_2)).
    Returns (packed U8 [N, K/2], block scales F8_E4M3 [N, K/16])."""
    n, k = w.shape
    blocks = w.reshape(n, k // 16, 16)
    s = (blocks.abs().amax(-1) / 6.0 / scale_2).clamp(max=448.0).to(torch.float8_e4m3fn)
    s_eff = s.float() * scale_2
    s_eff = torch.where(s_eff == 0, torch.ones_like(s_eff), s_eff)
    q = (blocks / s_eff[..., None]).clamp(-6.0, 6.0).reshape(n, k)
    codes = e2m1_codes(q)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(), s


def modelopt_nvfp4_dequantize(packed, s, scale_2):
    """The format's dequantization, per block scale first (ModelOpt's NVFP4QTensor.dequantize):
    w = e2m1(code) * (f32(s) * scale_2), in f32."""
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    vals = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    block = (s.float() * scale_2).repeat_interleave(16, dim=1)
    return (vals * block).numpy()


def nvfp4_act_qdq(x, global_scale):
    """NVFP4 fake-quant of x's rows per 16 values against `global_scale`, compressed-tensors'
    formula as ExactScore implements it for compressed-tensors NVFP4 (bit-exact with its
    act_qdq_vectors), in f32: s = fp8(clamp(global * amax / 6, ±448)) (0.125 where it rounds
    to 0), eff = s / global, q = e2m1(clamp(x / eff, ±6)), x' = q * eff."""
    shape = x.shape
    g = x.float().reshape(-1, shape[-1] // 16, 16)
    s = (global_scale * (g.abs().amax(-1, keepdim=True) / 6.0)).clamp(-448.0, 448.0)
    s = s.to(torch.float8_e4m3fn).float()
    s = torch.where(s == 0, torch.full_like(s, 0.125), s)
    eff = s / global_scale
    q = (g / eff + 0.0).clamp(-6.0, 6.0)
    codes = e2m1_codes(q).long()
    vals = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return (vals * eff).reshape(shape).to(x.dtype)


def nvfp4_act_hooks(input_scales):
    """Each quantized Linear's input through `nvfp4_act_qdq` with the global scale
    1 / input_scale (vLLM's `input_global_scale_inv`, a true f32 division)."""
    def register(model):
        for name, scale in input_scales.items():
            gs = (torch.tensor(1.0) / scale).float()
            model.get_submodule(name).register_forward_pre_hook(
                lambda _m, a, gs=gs: (nvfp4_act_qdq(a[0], gs),))
    return register


@torch.no_grad()
def input_amax(dense, cfg, lins):
    """Per quantized Linear, the absmax of its input over the fixture's sequences (f32 model of
    the dense weights): ModelOpt's max calibration."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in dense.items()}, strict=False)
    model.tie_weights()
    amax = {lin: torch.tensor(0.0) for lin in lins}
    for lin in lins:
        model.get_submodule(lin).register_forward_pre_hook(
            lambda _m, a, lin=lin: amax.__setitem__(lin, torch.maximum(amax[lin], a[0].abs().amax())))
    for _text, ids in texts():
        model(input_ids=torch.tensor([ids]))
    return amax


def make_modelopt_nvfp4(name):
    """The tiny base quantized as ModelOpt's NVFP4 export lays it out (its packer written from
    the format; nvidia-modelopt is not installed): the layers vLLM fuses (q/k/v, gate/up) share
    `weight_scale_2` and `input_scale`, as ModelOpt's export makes them. The config in
    hf_quant_config.json, config.json without quantization_config."""
    vectors = load_file(str(FIXTURES / "llama-nvfp4" / "act_qdq_vectors.safetensors"))
    for p in ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "synthetic"]:
        got = nvfp4_act_qdq(vectors[p + ".input"], vectors[p + ".input_global_scale"].reshape(()))
        assert torch.equal(got.view(torch.int32), vectors[p + ".input_qdq"].view(torch.int32)), p
    cfg, dense = tiny_config(), tiny_dense()
    lins = linear_names(dense)
    amax_in = input_amax(dense, cfg, lins)
    tensors = base_tensors(dense, set(lins))
    deq, input_scales = {}, {}
    for layer in range(cfg["num_hidden_layers"]):
        for fused in FUSED:
            names = [f"model.layers.{layer}.{f}" for f in fused]
            ws = {n: dense[n + ".weight"].float() for n in names}
            scale_2 = (max(w.abs().amax() for w in ws.values()) / (6.0 * 448.0)).float()
            in_scale = (max(amax_in[n] for n in names) / (6.0 * 448.0)).float()
            for n in names:
                packed, s = modelopt_nvfp4_quantize(ws[n], scale_2)
                tensors[f"{n}.weight"] = packed
                tensors[f"{n}.weight_scale"] = s
                tensors[f"{n}.weight_scale_2"] = scale_2.reshape(()).clone()
                tensors[f"{n}.input_scale"] = in_scale.reshape(()).clone()
                deq[n] = modelopt_nvfp4_dequantize(packed, s, scale_2)
                input_scales[n] = in_scale
    qconfig = {"producer": {"name": "modelopt", "version": "0.29.0"},
               "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                "group_size": 16, "exclude_modules": ["lm_head"]}}
    write_variant(name, qconfig, tensors, deq,
                  "the format's dequantization (e2m1 * (f32(weight_scale) * weight_scale_2), "
                  "f32), written from vLLM's ModelOptNvFp4LinearMethod and ModelOpt's "
                  "NVFP4QTensor",
                  config=cfg, dense=dense,
                  emulated=("NVFP4 activation fake-quant per 16 (compressed-tensors' formula, "
                            "nvfp4_act_qdq) with global scale 1 / input_scale (vLLM's "
                            "input_global_scale_inv)", nvfp4_act_hooks(input_scales)))
    out = FIXTURES / name
    config = json.loads((out / "config.json").read_text())
    (out / "hf_quant_config.json").write_text(
        json.dumps(config.pop("quantization_config"), indent=4) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


MODELOPT_EXPORTS = {"llama-modelopt-export-nvfp4": "NVFP4", "llama-modelopt-export-fp8": "FP8"}


def make_modelopt_export(name, algo):
    """The tiny base quantized and exported by nvidia-modelopt itself (`mtq.quantize` with
    its NVFP4 / FP8 default config, max calibration on the reference sequences, then
    `export_hf_checkpoint`), on the CPU in f32. The reference weights are modelopt's own
    dequantization of the exported tensors (`NVFP4QTensor.dequantize`; fp8 `weight *
    weight_scale`). `reference_emulated`: FP8, modelopt's own fake-quantized model (weights
    and static activations, its `_fp8_eager`); NVFP4, `nvfp4_act_hooks` with 1 / input_scale
    (modelopt's NVFP4 activation fake-quant runs only on CUDA). The exported embeddings and
    norms are bf16 values held in f32; they are stored as bf16 (the same numbers)."""
    import modelopt
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg, dense = tiny_config(), tiny_dense()
    model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.float32,
                                             attn_implementation="sdpa")
    model.load_state_dict({k: v.float() for k, v in dense.items()}, strict=False)
    model.tie_weights()
    model.eval()
    qcfg = {"NVFP4": mtq.NVFP4_DEFAULT_CFG, "FP8": mtq.FP8_DEFAULT_CFG}[algo]
    with torch.no_grad():
        mtq.quantize(model, qcfg, lambda m: [m(input_ids=torch.tensor([ids]))
                                             for _t, ids in texts()])
        fake_quant = scored(model) if algo == "FP8" else None
    work = FIXTURES / f".{name}-work"
    shutil.rmtree(work, ignore_errors=True)
    export_hf_checkpoint(model, export_dir=str(work))
    exported = load_file(str(work / "model.safetensors"))
    config = json.loads((work / "config.json").read_text())
    hf_quant_config = (work / "hf_quant_config.json").read_text()
    shutil.rmtree(work)
    qconfig = config.pop("quantization_config")
    config["dtype"] = "bfloat16"
    tensors, deq, input_scales = {}, {}, {}
    for key, t in exported.items():
        if t.dtype == torch.float32 and t.dim() > 0:
            assert torch.equal(t.to(torch.bfloat16).float(), t), key
            t = t.to(torch.bfloat16)
        tensors[key] = t
        if key.endswith(".weight_scale"):
            lin = key[: -len(".weight_scale")]
            w, s = exported[lin + ".weight"], exported[key]
            if algo == "NVFP4":
                scale_2 = exported[lin + ".weight_scale_2"]
                q = NVFP4QTensor(torch.Size([w.shape[0], w.shape[1] * 2]), torch.float32, w)
                theirs = q.dequantize(dtype=torch.float32, scale=s, double_scale=scale_2,
                                      block_sizes={-1: 16})
                # The same numbers as the format's formula; modelopt's table decodes code 8
                # as +0.0 where e2m1 (and the formula) has -0.0, so the bits kept are the
                # formula's.
                deq[lin] = modelopt_nvfp4_dequantize(w, s, scale_2)
                assert torch.equal(torch.from_numpy(deq[lin]), theirs), lin
            else:
                deq[lin] = (w.float() * s.float()).numpy()
            input_scales[lin] = exported[lin + ".input_scale"].float().reshape(())
    assert sorted(deq) == sorted(linear_names(dense)), sorted(deq)
    if algo == "NVFP4":
        emulated = ("NVFP4 activation fake-quant per 16 (compressed-tensors' formula, "
                    "nvfp4_act_qdq) with global scale 1 / input_scale (vLLM's "
                    "input_global_scale_inv)", nvfp4_act_hooks(input_scales))
    else:
        emulated = None
    write_variant(name, qconfig, tensors, deq,
                  f"nvidia-modelopt {modelopt.__version__}'s own dequantization of its export "
                  "(f32)", config=config, dense=dense, emulated=emulated)
    out = FIXTURES / name
    (out / "hf_quant_config.json").write_text(hf_quant_config)
    if fake_quant is not None:
        ref = json.loads((out / "reference.json").read_text())
        served = {k: v.float() for k, v in dense.items()}
        for lin, w in vllm_fused_fp8(exported).items():
            served[lin + ".weight"] = w
        seqs = reference_logprobs(served, config)
        ref["reference_served"] = {
            "weights": "vLLM's requantize_with_max_scale of the fused q/k/v and gate/up shards "
                       "(vllm_fused_fp8), transformers f32, activations unquantized",
            "sequences": seqs,
            "mean_nll": sum(s["sum_nll"] for s in seqs) / sum(s["num_scored"] for s in seqs)}
        ref["reference_emulated"] = {
            "activations": f"nvidia-modelopt {modelopt.__version__}'s fake-quantized model "
                           "(f32): its weights and static per-tensor fp8 activations as "
                           "modelopt simulates them",
            "sequences": fake_quant,
            "mean_nll": sum(s["sum_nll"] for s in fake_quant)
            / sum(s["num_scored"] for s in fake_quant)}
        ref["versions"]["modelopt"] = modelopt.__version__
        (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")


def vllm_fused_fp8(tensors, always=False):
    """The per-tensor fp8 weights of a checkpoint as vLLM serves them (f32): the shards it
    fuses (q/k/v, gate/up) each requantized to their largest `weight_scale` (ModelOpt: where
    the scales differ; compressed-tensors, `always`: every layer, even alone), as vLLM's `requantize_with_max_scale` does on CUDA: `per_tensor_dequantize` (codes
    as float16 times the scale, a 0-dim CUDA tensor that PyTorch's CUDA kernel reads as
    float16; the product rounded to float16), then `static_scaled_fp8_quant` (times
    `1.0f / max_scale`, clamped to ±448, rounded to e4m3)."""
    out = {}
    for layer in range(2):
        for group in FUSED:
            names = [f"model.layers.{layer}.{g}" for g in group]
            scales = [tensors[n + ".weight_scale"].float().reshape(()) for n in names]
            top = max(scales)
            for n, s in zip(names, scales):
                code = tensors[n + ".weight"]
                if not always and all(torch.equal(x, scales[0]) for x in scales):
                    out[n] = code.float() * s
                    continue
                dq = (code.float() * s.to(torch.float16).float()).to(torch.float16)
                q = (dq.float() * (torch.tensor(1.0) / top)).clamp(-448.0, 448.0)
                out[n] = q.to(torch.float8_e4m3fn).float() * top
    return out


def scored(model):
    """`reference_logprobs`' sequences of an already built model."""
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


def fp8_static_qdq(x, scale):
    """FP8 fake-quant with a static per-tensor scale, compressed-tensors' formula as ExactScore
    implements it (`Fp8Static`), in f32: e4m3(clamp(x / scale + 0, ±448)) * scale."""
    q = (x.float() / scale + 0.0).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * scale).to(x.dtype)


def fp8_static_hooks(input_scales):
    """Each listed Linear's input through `fp8_static_qdq` with its `input_scale`."""
    def register(model):
        for n, sc in input_scales.items():
            model.get_submodule(n).register_forward_pre_hook(
                lambda _m, a, sc=sc: (fp8_static_qdq(a[0], sc),))
    return register


def make_modelopt_fp8(name):
    """ModelOpt FP8 (`quant_algo: FP8`) as its export lays it out (packed from the format):
    per Linear `weight` F8_E4M3, `weight_scale` F32 [] = amax / 448, `input_scale` F32 [] =
    the input's calibrated amax / 448; the layers vLLM fuses share both scales (vLLM would
    otherwise requantize the weights to the largest). Config in config.json's spelling."""
    cfg, dense = tiny_config(), tiny_dense()
    lins = linear_names(dense)
    amax_in = input_amax(dense, cfg, lins)
    tensors = base_tensors(dense, set(lins))
    deq, input_scales = {}, {}
    for layer in range(cfg["num_hidden_layers"]):
        for fused in FUSED:
            names = [f"model.layers.{layer}.{f}" for f in fused]
            ws = {n: dense[n + ".weight"].float() for n in names}
            w_scale = (max(w.abs().amax() for w in ws.values()) / 448.0).float()
            in_scale = (max(amax_in[n] for n in names) / 448.0).float()
            for n in names:
                q = (ws[n] / w_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
                tensors[f"{n}.weight"] = q
                tensors[f"{n}.weight_scale"] = w_scale.reshape(()).clone()
                tensors[f"{n}.input_scale"] = in_scale.reshape(()).clone()
                deq[n] = (q.float() * w_scale).numpy()
                input_scales[n] = in_scale

    qconfig = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"],
               "kv_cache_scheme": None,
               "producer": {"name": "modelopt", "version": "0.29.0"}}
    write_variant(name, qconfig, tensors, deq,
                  "the format's dequantization (f32(weight) * weight_scale), written from "
                  "vLLM's ModelOptFp8LinearMethod",
                  config=cfg, dense=dense,
                  emulated=("FP8 static per-tensor activation fake-quant with input_scale "
                            "(fp8_static_qdq)", fp8_static_hooks(input_scales)))


def make_modelopt_mixed(name):
    """ModelOpt `quant_algo: MIXED_PRECISION` (the per-module map NVIDIA's mixed exports
    write, vLLM's ModelOptMixedPrecisionConfig): layer 0's attention FP8 and its MLP NVFP4;
    layer 1's attention left out of `quantized_layers` (unquantized, bf16), its gate/up NVFP4
    and its down_proj FP8. Each module packed as make_modelopt_nvfp4 / make_modelopt_fp8
    pack it (fused layers share their scales); config.json's spelling."""
    cfg, dense = tiny_config(), tiny_dense()
    lins = linear_names(dense)
    amax_in = input_amax(dense, cfg, lins)
    algos = {}
    for layer, (attention, gate_up, down) in enumerate([("FP8", "NVFP4", "NVFP4"),
                                                         (None, "NVFP4", "FP8")]):
        for fused, algo in zip(FUSED, [attention, gate_up, attention, down]):
            for f in fused:
                algos[f"model.layers.{layer}.{f}"] = algo
    listed = {n for n, a in algos.items() if a}
    tensors = base_tensors(dense, listed)
    deq, nvfp4_scales, fp8_scales = {}, {}, {}
    for layer in range(cfg["num_hidden_layers"]):
        for fused in FUSED:
            names = [f"model.layers.{layer}.{f}" for f in fused]
            algo = algos[names[0]]
            if algo is None:
                continue
            ws = {n: dense[n + ".weight"].float() for n in names}
            amax_w = max(w.abs().amax() for w in ws.values())
            amax_x = max(amax_in[n] for n in names)
            for n in names:
                if algo == "NVFP4":
                    scale_2 = (amax_w / (6.0 * 448.0)).float()
                    in_scale = (amax_x / (6.0 * 448.0)).float()
                    packed, sc = modelopt_nvfp4_quantize(ws[n], scale_2)
                    tensors[f"{n}.weight"] = packed
                    tensors[f"{n}.weight_scale"] = sc
                    tensors[f"{n}.weight_scale_2"] = scale_2.reshape(()).clone()
                    deq[n] = modelopt_nvfp4_dequantize(packed, sc, scale_2)
                    nvfp4_scales[n] = in_scale
                else:
                    w_scale = (amax_w / 448.0).float()
                    in_scale = (amax_x / 448.0).float()
                    q = (ws[n] / w_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
                    tensors[f"{n}.weight"] = q
                    tensors[f"{n}.weight_scale"] = w_scale.reshape(()).clone()
                    deq[n] = (q.float() * w_scale).numpy()
                    fp8_scales[n] = in_scale
                tensors[f"{n}.input_scale"] = in_scale.reshape(()).clone()

    def hooks(model):
        nvfp4_act_hooks(nvfp4_scales)(model)
        fp8_static_hooks(fp8_scales)(model)
    quantized_layers = {n: ({"quant_algo": "NVFP4", "group_size": 16} if a == "NVFP4"
                            else {"quant_algo": "FP8"})
                        for n, a in sorted(algos.items()) if a}
    qconfig = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
               "quantized_layers": quantized_layers, "ignore": ["lm_head"],
               "kv_cache_scheme": None, "producer": {"name": "modelopt", "version": "0.29.0"}}
    write_variant(name, qconfig, tensors, deq,
                  "per module, the format's dequantization of its quant_algo (NVFP4: e2m1 * "
                  "(f32(weight_scale) * weight_scale_2); FP8: f32(weight) * weight_scale); the "
                  "modules not listed stay bf16",
                  config=cfg, dense=dense,
                  emulated=("per module: NVFP4 activation fake-quant against 1 / input_scale, "
                            "FP8 static fake-quant with input_scale", hooks))


# KV-cache quantization (compressed-tensors `kv_cache_scheme`): W4A16 weights and fp8 e4m3 K/V
# scales calibrated by llm-compressor on the reference sequences, on a tiny base with two KV
# heads (per-head scales differ) and sharp attention. The emulated reference is transformers with vLLM's
# FlashAttention 3 fp8 path hooked in where vLLM applies it (docs/kv-cache.md): after RoPE,
# q / 1.0, k / k_scale, v / v_scale rounded to e4m3 (saturating) and scaled back, in f32.
# ----------------------------------------------------------------------------------------------
KV_VARIANTS = {
    # name: kv_cache_scheme strategy (None: no scheme, the `--kv-cache-dtype fp8_e4m3` what-if)
    "llama-kv-fp8-tensor": "tensor",
    "llama-kv-fp8-head": "attn_head",
    "llama-kv-none": None,
}


def kv_config():
    cfg = tiny_config()
    cfg.update({"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32})
    return cfg


def fp8_qdq(x, scale):
    """x / scale rounded to e4m3 (clamped to +-448 first: vLLM's saturating conversion), times
    scale, in f32; `scale` broadcasts over x's heads."""
    x = x.float()
    return torch.clamp(x / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def absmax_head_scales(x):
    """Per head (axis 1 of [batch, heads, len, dim]) absmax / 448 over the sequence: the
    simulation's dynamic scales (f32 epsilon where a head is all zeros)."""
    s = x.float().abs().amax(dim=(0, 2, 3), keepdim=True) / FP8_MAX
    return torch.where(s == 0, torch.finfo(torch.float32).eps, s)


def kv_hooks(scales):
    """An attention function that applies vLLM's fp8 FlashAttention path to sdpa's post-RoPE
    inputs ([batch, heads, len, dim], keys and values before GQA repetition): `scales(layer,
    key, value)` gives (k_scale, v_scale) shaped to broadcast over the heads."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, *args, **kwargs):
        ks, vs = scales(module.layer_idx, key, value)
        return sdpa_attention_forward(module, fp8_qdq(query, 1.0), fp8_qdq(key, ks),
                                      fp8_qdq(value, vs), *args, **kwargs)

    def register(model):
        AttentionInterface.register("kv_fp8", attention)
        model.set_attn_implementation("kv_fp8")
    return register


def make_kv(name, strategy, seed=401):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from safetensors.torch import save_file as save_torch

    out = FIXTURES / name
    if out.exists():
        shutil.rmtree(out)
    cfg = kv_config()
    base = FIXTURES / f".{name}-base"
    base.mkdir(exist_ok=True)
    (base / "config.json").write_text(json.dumps(cfg))
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(DENSE / f, base / f)
    dense = tiny_dense(seed, cfg)
    # q and k projections x3: scores of order ten and sharp attention, as in trained models
    # (with the random base's flat attention the KV cache's cost cancels in the mean NLL).
    for k in dense:
        if k.endswith(("q_proj.weight", "k_proj.weight")):
            dense[k] = (dense[k].float() * 3).to(torch.bfloat16)
    save_torch(dense, str(base / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
    ids = [ids for _, ids in texts()]
    calibration = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})
    kv = None if strategy is None else {"num_bits": 8, "type": "float", "strategy": strategy,
                                        "dynamic": False, "symmetric": True}
    model = oneshot(model=model, processor=AutoTokenizer.from_pretrained(str(base)),
                    dataset=calibration, num_calibration_samples=len(ids), max_seq_length=512,
                    recipe=QuantizationModifier(targets="Linear", scheme="W4A16",
                                                ignore=["lm_head"], kv_cache_scheme=kv))
    model.save_pretrained(str(out), save_compressed=True)
    shutil.rmtree(base)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(DENSE / f, out / f)
    # Weights as compressed-tensors decompresses them; the scales as stored (bf16, exact in f32).
    m = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    hq = getattr(m, "hf_quantizer", None)
    if hq is not None and hasattr(m, "ct_decompress_hook"):
        hq.compressor.decompress_model(m)
    stored = load_file(str(out / "model.safetensors"))
    weights = {k: v.detach().float() for k, v in m.state_dict().items()
               if not k.endswith(("_scale", "_packed", "_zero_point", "_global_scale", "_shape"))}
    lins = {k[: -len(".weight")] for k in weights if k.endswith("proj.weight")}
    deq = {k: weights[k + ".weight"].numpy() for k in lins}
    mean = lambda seqs: sum(s["sum_nll"] for s in seqs) / sum(s["num_scored"] for s in seqs)
    seqs = reference_logprobs(weights, cfg)
    ref = {"variant": name, "torch_dtype_used": "float32", "reference_mode": "weights_only",
           "dequantizer": "compressed-tensors 0.19.0 (transformers from_pretrained + "
                          "decompress_model)", "sequences": seqs, "mean_nll": mean(seqs),
           "versions": versions()}
    if strategy is not None:
        def static(layer, key, value):
            pick = lambda kind: stored[f"model.layers.{layer}.self_attn.{kind}_scale"].float() \
                .reshape(1, -1, 1, 1)
            return pick("k"), pick("v")
        em = reference_logprobs(weights, cfg, kv_hooks(static))
        ref["reference_kv_emulated"] = {
            "kv_cache": f"vLLM FlashAttention 3 fp8 path, {strategy} k/v scales from the "
                        "checkpoint, q scale 1.0", "sequences": em, "mean_nll": mean(em)}
    else:
        sim = reference_logprobs(weights, cfg, kv_hooks(
            lambda layer, key, value: (absmax_head_scales(key), absmax_head_scales(value))))
        ref["reference_kv_simulated"] = {
            "kv_cache": "fp8 e4m3 with dynamic per-head absmax/448 k/v scales per sequence, "
                        "q scale 1.0", "sequences": sim, "mean_nll": mean(sim)}
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    (out / "dequant_check.json").write_text(json.dumps(dequant_check(deq), indent=1) + "\n")
    kv_ref = ref.get("reference_kv_emulated", ref.get("reference_kv_simulated"))
    print(f"{name}: mean NLL {ref['mean_nll']:.6f} weights only, {kv_ref['mean_nll']:.6f} with "
          f"the fp8 KV cache, {(out / 'model.safetensors').stat().st_size} bytes")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    torch.manual_seed(0)
    for i, (name, spec) in enumerate(GPTQ_VARIANTS.items()):
        if not only or name in only:
            make_gptq(name, spec, 100 + i)
    if not only or "llama-gptq-dynamic" in only:
        make_gptq_dynamic("llama-gptq-dynamic", 110)
    if not only or "gptq-vectors" in only:
        make_gptq_vectors(200)
    if not only or "llama-w4a16-actorder-g64" in only:
        make_ct_actorder("llama-w4a16-actorder-g64", 300)
    for name, scheme in CT_VARIANTS.items():
        if not only or name in only:
            make_ct(name, scheme)
    if not only or "llama-awq-int4-g64" in only:
        make_awq("llama-awq-int4-g64")
    if not only or "llama-fp8-block" in only:
        make_fp8_block("llama-fp8-block")
    if not only or "llama-fp8-block-ue8m0" in only:
        make_fp8_block("llama-fp8-block-ue8m0", ue8m0=True)
    if not only or "fp8-block-vectors" in only:
        make_fp8_vectors(500)
    if not only or "llama-w8a8-int8" in only:
        make_ct_w8a8("llama-w8a8-int8")
    if not only or "llama-fp8-static-tensor" in only:
        make_ct_fp8_static("llama-fp8-static-tensor")
    if not only or "llama-modelopt-nvfp4" in only:
        make_modelopt_nvfp4("llama-modelopt-nvfp4")
    if not only or "llama-modelopt-fp8" in only:
        make_modelopt_fp8("llama-modelopt-fp8")
    if not only or "llama-modelopt-mixed" in only:
        make_modelopt_mixed("llama-modelopt-mixed")
    for name, algo in MODELOPT_EXPORTS.items():
        if not only or name in only:
            make_modelopt_export(name, algo)
    for name, (sym, fmt) in AUTOROUND_VARIANTS.items():
        if not only or name in only:
            make_autoround(name, sym, fmt)
    for name, strategy in KV_VARIANTS.items():
        if not only or name in only:
            make_kv(name, strategy)


if __name__ == "__main__":
    main()
