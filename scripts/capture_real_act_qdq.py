#!/usr/bin/env python3
"""Captures, from transformers + compressed-tensors (f32), the input of every activation-quantized
Linear and its QDQ for the first TOKENS tokens of a real checkpoint's first reference sequence,
into MODEL_DIR/act_qdq_real.safetensors (`{layer}.input`, `{layer}.input_qdq`, NVFP4 also
`{layer}.input_global_scale`), the shape of the fixtures' act_qdq_vectors. The opt-in test
`smollm2_activation_qdq_is_bit_exact_on_real_activations` (server/tests/real_model.rs) checks
ExactScore's QDQ against it.

The model is loaded as scripts/make_real_smollm2.py loads it for reference.json (its `load`:
float32, sdpa attention, compressed weights decompressed up front, NVFP4's bf16-decompressed
weights upcast to float32, which is exact), so the captured activations are those of the
reference run.

Requirements: the venv of scripts/make_real_smollm2.py (scripts/requirements-real-smollm2.txt:
transformers 5.17, compressed-tensors 0.19) and the checkpoints it built. Usage:
    /tmp/venv-smollm2/bin/python scripts/capture_real_act_qdq.py \
        DIR/smollm2-135m-nvfp4 DIR/smollm2-135m-fp8-dynamic [--tokens 64]
(~20 s for both on 2 CPU cores), then
    EXACTSCORE_REAL_MODELS=DIR cargo test --release -p exactscore-server --test real_model \
        smollm2_activation_qdq -- --ignored --nocapture
"""
import argparse
import json
import pathlib
import sys

import torch
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from safetensors.torch import save_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_real_smollm2 import load  # noqa: E402  (the reference's float32 load)


def capture(path, tokens):
    model, act = load(path, torch.float32)
    if not act:
        sys.exit(f"{path}: no activation-quantized Linear (an NVFP4 or FP8 checkpoint is needed)")
    reference = json.loads((path / "reference.json").read_text())
    ids = torch.tensor([reference["sequences"][0]["token_ids"][:tokens]])
    captured = {}

    def hook(name):
        def pre_hook(module, inputs):
            x = inputs[0].detach().clone()
            scheme = module.quantization_scheme.input_activations
            qdq = forward_quantize(module, x.clone(), "input", scheme)
            captured[f"{name}.input"] = x[0].contiguous()
            captured[f"{name}.input_qdq"] = qdq[0].contiguous()
            gs = getattr(module, "input_global_scale", None)
            if gs is not None:
                captured[f"{name}.input_global_scale"] = gs.detach().reshape(1).float().clone()
        return pre_hook

    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None and scheme.input_activations is not None:
            module.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        model(ids)
    out = path / "act_qdq_real.safetensors"
    save_file(captured, str(out))
    print(f"{sum(k.endswith('.input') for k in captured)} layers captured into {out}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", nargs="+", type=pathlib.Path,
                    help="checkpoint folder(s) built by make_real_smollm2.py, with reference.json")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    for path in args.model_dir:
        capture(path, args.tokens)


if __name__ == "__main__":
    main()
