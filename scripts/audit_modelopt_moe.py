#!/usr/bin/env python3
"""Held-out check of ModelOpt FP8 on a mixture (a dev tool; nothing in CI runs it): the tiny
Qwen3-MoE of scripts/make_arch_fixtures.py quantized and exported by nvidia-modelopt itself
(`FP8_DEFAULT_CFG`, max calibration on three seeded sequences, `export_hf_checkpoint`, CPU f32),
then scored by the server (--dtype f32 --device cpu) against transformers f32 on the weights as
vLLM serves them: each expert's gate/up requantized to their largest scale (vLLM's
`process_fp8_weight_tensor_strategy_moe` and ModelOpt's MoE method), q/k/v and the dense
gate/up likewise where their scales differ, static input scales the largest over the fused
shards and over the experts; weights only, and with the static fp8 activations emulated.
`--fused-fp8-scales per-layer` is printed against the served reference too (it must miss).

Usage:
    /tmp/venv-fixtures/bin/python scripts/audit_modelopt_moe.py OUT_DIR \
        target/release/exactscore-server

Last run (2026-11-29, nvidia-modelopt 0.47.0, transformers 5.17.0): served weights only max
|delta| 2.35e-6, mean 8.0e-7; emulated max 2.84e-6; per-layer against the served emulated
reference max 0.344, mean 0.071. modelopt gave every expert the same input scale (0.012061 for
gate/up), so the largest-over-experts rule changed nothing there.
"""
import shutil
import sys

import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import make_arch_fixtures as maf
import make_format_fixtures as mff
import audit_config_variants as acv
from safetensors.torch import load_file
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint

out, server = sys.argv[1], sys.argv[2]
model = maf.build_model("qwen3moe", torch.float32).eval()
model.config.architectures = ["Qwen3MoeForCausalLM"]
g = torch.Generator().manual_seed(5)
seqs = [torch.randint(0, 2000, (n,), generator=g).tolist() for n in (40, 70, 100)]
with torch.no_grad():
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: [m(input_ids=torch.tensor([s])) for s in seqs])
shutil.rmtree(out, ignore_errors=True)
export_hf_checkpoint(model, export_dir=out)
for f in ["tokenizer.json", "tokenizer_config.json"]:
    shutil.copy(mff.DENSE / f, out)
st = load_file(f"{out}/model.safetensors")

def req(code, s, top):
    dq = (code.float() * s.to(torch.float16).float()).to(torch.float16)
    return (dq.float() * (torch.tensor(1.0) / top)).clamp(-448, 448).to(torch.float8_e4m3fn).float() * top

# vLLM-served weights
ref = maf.build_model("qwen3moe", torch.float32, init=False).eval()
sd = ref.state_dict()
w = {}
names = sorted({k[:-len(".weight_scale")] for k in st if k.endswith(".weight_scale")})
for n in names:
    w[n] = st[n + ".weight"].float() * st[n + ".weight_scale"].float()
def fused(group):
    top = max(st[n + ".weight_scale"].float() for n in group)
    if all(torch.equal(st[n + ".weight_scale"], st[group[0] + ".weight_scale"]) for n in group):
        return
    for n in group:
        w[n] = req(st[n + ".weight"], st[n + ".weight_scale"].float(), top)
for L in range(2):
    fused([f"model.layers.{L}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")])
    if L == 1:
        fused([f"model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj")])
for e in range(8):
    fused([f"model.layers.0.mlp.experts.{e}.{p}" for p in ("gate_proj", "up_proj")])
input_scale = {}
for n in names:
    peers = [n]
    if ".experts." in n:
        leaf = n.rsplit(".", 1)[1]
        grp = ("gate_proj", "up_proj") if leaf != "down_proj" else ("down_proj",)
        peers = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(8) for p in grp]
    else:
        base, leaf = n.rsplit(".", 1)
        for G in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            if leaf in G: peers = [f"{base}.{p}" for p in G]
    input_scale[n] = max(st[p + ".input_scale"].float() for p in peers)
print("expert gate input scales:", [round(float(st[f"model.layers.0.mlp.experts.{e}.gate_proj.input_scale"]), 6) for e in range(4)])
for k in sd:
    if k in st and st[k].dtype != torch.float8_e4m3fn:
        sd[k] = st[k].float()
missing = [k for k in sd if k not in st and not any(k == n + ".weight" for n in names)]
assert not missing, missing
for n in names:
    sd[n + ".weight"] = w[n]
ref.load_state_dict(sd)
wo = acv.reference(ref, seqs)
for n, s in input_scale.items():
    ref.get_submodule(n).register_forward_pre_hook(lambda _m, a, s=s: (mff.fp8_static_qdq(a[0], s),))
em = acv.reference(ref, seqs)
def serve(args):
    orig = acv.subprocess.Popen
    acv.subprocess.Popen = lambda cmd, **kw: orig(cmd + args, **kw)
    try: return acv.serve_and_score(server, out, seqs, "/tmp/moe-mo.log")
    finally: acv.subprocess.Popen = orig
for label, r, args in [("served weights-only", wo, ["--activation-quant", "off"]), ("served emulated", em, []),
                       ("per-layer vs served emulated", em, ["--fused-fp8-scales", "per-layer"])]:
    got, err = serve(args)
    if err: print(label, err); continue
    d = [abs(a - b) for x, y in zip(r, got) for a, b in zip(x, y)]
    print(f"{label}: max {max(d):.3g} mean {sum(d)/len(d):.3g}")
