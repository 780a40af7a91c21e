#!/usr/bin/env python3
"""Captures, from transformers + compressed-tensors (f32), the input of every activation-quantized
Linear and its QDQ for the first TOKENS tokens of a real checkpoint's first reference sequence,
into MODEL_DIR/act_qdq_real.safetensors (`{layer}.input`, `{layer}.input_qdq`, NVFP4 also
`{layer}.input_global_scale`), the shape of the fixtures' act_qdq_vectors. The opt-in test
`smollm2_activation_qdq_is_bit_exact_on_real_activations` (server/tests/real_model.rs) checks
ExactScore's QDQ against it.

    python3 scripts/capture_real_act_qdq.py MODEL_DIR [--tokens 64]
Needs the Python stack the fixtures were made with (transformers 5.17, compressed-tensors 0.19)
and, with --generator, the directory of that fixture generator (make_fixtures.py, not part of
this repository), whose load_model decompresses checkpoints as the reference did.
"""
import argparse
import json
import pathlib
import sys

import torch
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from safetensors.torch import save_file

ap = argparse.ArgumentParser()
ap.add_argument("model_dir")
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--generator", required=True, help="directory holding make_fixtures.py")
args = ap.parse_args()
sys.path.insert(0, args.generator)
import make_fixtures as mf  # noqa: E402  (load_model: decompression and the NVFP4 bf16 upcast)

path = pathlib.Path(args.model_dir)
model = mf.load_model(path, torch.float32, attn="sdpa")
reference = json.loads((path / "reference.json").read_text())
ids = torch.tensor([reference["sequences"][0]["token_ids"][: args.tokens]])
captured = {}


def capture(name):
    def pre_hook(module, inputs):
        x = inputs[0].detach().clone()
        qdq = forward_quantize(module, x.clone(), "input", module.quantization_scheme.input_activations)
        captured[f"{name}.input"] = x[0].contiguous()
        captured[f"{name}.input_qdq"] = qdq[0].contiguous()
        gs = getattr(module, "input_global_scale", None)
        if gs is not None:
            captured[f"{name}.input_global_scale"] = gs.detach().reshape(1).float().clone()
    return pre_hook


for name, module in model.named_modules():
    scheme = getattr(module, "quantization_scheme", None)
    if scheme is not None and scheme.input_activations is not None:
        module.register_forward_pre_hook(capture(name))
with torch.no_grad():
    model(ids)
save_file(captured, str(path / "act_qdq_real.safetensors"))
print(f"{sum(k.endswith('.input') for k in captured)} layers captured into {path / 'act_qdq_real.safetensors'}")
