#!/usr/bin/env python3
"""Tiny gpt-oss (GptOssForCausalLM) fixtures and their float32 references from transformers.

    tests/fixtures/gpt_oss-dense-bf16   the bf16 layout of the hub's dequantized copies: fused
                                        `mlp.experts.gate_up_proj` [E, hidden, 2*inter] (gate and
                                        up interleaved), `down_proj` [E, inter, hidden], biases
    tests/fixtures/gpt_oss-mxfp4        the same model with its experts in gpt-oss's native MXFP4
                                        (`quant_method: mxfp4`): `*_blocks` uint8
                                        [E, out, in/32, 16] and `*_scales` uint8 [E, out, in/32]

Four layers (sliding, full, sliding, full) with a window of 8 tokens, YaRN (factor 4 over an
original context of 64, `truncate: false`), 8 experts, top 2, attention sinks; weights drawn
large enough that every mechanism moves the log-probs: the clamp of the SwiGLU is active on a
share of the experts' inputs, the sinks take a share of each row's softmax.

The MXFP4 bytes are packed here from the OCP MX specification (transformers' own quantizer needs
the Triton kernels of a GPU): per 32 weights along the input, the shared exponent
`floor(log2(amax)) - 2` (e2m1's largest exponent), each weight rounded to nearest e2m1 (ties to
even) of `w / 2^e`, clamped to ±6. The reference of that checkpoint is transformers'
`from_pretrained` with `Mxfp4Config(dequantize=True)`: its `convert_moe_packed_tensors` decodes
the bytes (to bf16, exactly), then the model runs in float32.

Each reference.json holds the float32 log-probs of the four sequences of
scripts/make_arch_fixtures.py (eager attention, the only one with sinks on the CPU), the experts
each token chose per layer, and `mutations`: the mean and max |Δ log-prob| when one mechanism is
broken on purpose in transformers (sinks dropped, clamp removed, gate/up read as halves, softmax
over all experts before the top-k without renormalising, sliding window ignored, YaRN ignored,
biases dropped); `bf16_run`: transformers' own bf16 run against that float32 reference.

Usage (CPU, no network, under a minute):
    /tmp/venv-fixtures/bin/python scripts/make_gpt_oss_fixtures.py
"""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_arch_fixtures import (  # noqa: E402
    FIXTURES,
    TOKENIZER_DIR,
    make_texts,
    run_all,
    versions,
)

from transformers import AutoTokenizer, GptOssConfig, GptOssForCausalLM, Mxfp4Config  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402

SEED = 20261128
CONFIG = dict(
    architectures=["GptOssForCausalLM"],
    model_type="gpt_oss",
    vocab_size=2000,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    attention_bias=True,
    tie_word_embeddings=False,
    rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=8.0, beta_slow=1.0,
        original_max_position_embeddings=64, truncate=False,
    ),
    swiglu_limit=7.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Standard deviations of the random weights (by name suffix): large enough that the clamp at 7
# and the sinks matter; the residual stream stays in range through the norms.
STD = {
    "embed_tokens.weight": 1.0,
    "q_proj.weight": 0.2, "k_proj.weight": 0.2, "v_proj.weight": 0.2, "o_proj.weight": 0.1,
    "q_proj.bias": 0.2, "k_proj.bias": 0.2, "v_proj.bias": 0.2, "o_proj.bias": 0.2,
    "sinks": 1.0,
    "router.weight": 0.3, "router.bias": 0.5,
    "gate_up_proj": 0.5, "gate_up_proj_bias": 0.5, "down_proj": 0.05, "down_proj_bias": 0.2,
    "lm_head.weight": 0.1,
}
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def build_model():
    torch.manual_seed(SEED)
    config = GptOssConfig(**{k: v for k, v in CONFIG.items() if k != "architectures"})
    config._attn_implementation = "eager"
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
                continue
            std = next(s for suffix, s in STD.items() if name.endswith(suffix))
            p.copy_(std * torch.randn_like(p))
    # stored in bf16, as the hub's copies are; the reference runs in float32 from those values
    return model.to(torch.bfloat16).to(torch.float32)


def pack_mxfp4(w):
    """`w` [E, out, in] (f32) as gpt-oss's blocks [E, out, in/32, 16] and scales [E, out, in/32]."""
    e, out, inp = w.shape
    groups = w.reshape(e, out, inp // 32, 32)
    amax = groups.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2,
                      torch.full_like(amax, -127.0)).clamp(-127, 127)
    scaled = (groups / torch.exp2(exp)[..., None]).clamp(-6, 6)
    # nearest e2m1 magnitude, ties to the even code
    dist = (scaled.abs()[..., None] - E2M1).abs()
    best = dist.min(-1, keepdim=True).values
    ties = (dist == best).to(torch.int64)
    codes = torch.arange(8)
    even_first = torch.where(codes % 2 == 0, codes, codes + 8)  # prefer even codes on a tie
    code = torch.where(ties.bool(), even_first, torch.full_like(even_first, 99)).min(-1).values % 8
    code = code + 8 * (scaled < 0).to(torch.int64) * (code != 0).to(torch.int64)
    code = code.to(torch.uint8).reshape(e, out, inp // 32, 16, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    scales = (exp + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def write_checkpoint(out_dir, tensors, config):
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / f, out_dir / f)


def bf16_state(model):
    return {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}


@torch.no_grad()
def routing(model, ids):
    """Per layer: the experts each token chose, and the gap between the k-th and (k+1)-th
    router logit (a near-tie flips under any rounding)."""
    out, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, modeling_gpt_oss.GptOssTopKRouter):
            def hook(m, args, res, name=name):
                top = torch.topk(res[0], m.top_k + 1, dim=-1).values
                out[name.removesuffix(".mlp.router")] = {
                    "experts": res[2].tolist(),
                    "margin": (top[:, -2] - top[:, -1]).tolist(),
                }
            hooks.append(mod.register_forward_hook(hook))
    model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return out


def deltas(base_lps, lps):
    d = np.abs(np.concatenate(base_lps) - np.concatenate(lps))
    return {"mean": float(d.mean()), "max": float(d.max())}


def mutations(model, texts, base_lps):
    """Each mechanism broken on purpose: (name, apply, undo)."""
    experts_cls = modeling_gpt_oss.GptOssExperts
    router_cls = modeling_gpt_oss.GptOssTopKRouter
    out = {}

    def run(name, apply, undo):
        apply()
        try:
            _, lps = run_all(model, texts, attn="eager")
        finally:
            undo()
        out[name] = deltas(base_lps, lps)
        print(f"  mutation {name}: {out[name]}")

    def params(suffix, value):
        saved = {}

        def apply():
            for n, p in model.named_parameters():
                if n.endswith(suffix):
                    saved[n] = p.detach().clone()
                    p.data.fill_(value)

        def undo():
            for n, p in model.named_parameters():
                if n in saved:
                    p.data.copy_(saved[n])
        return apply, undo

    def patch(cls, attr, new):
        old = getattr(cls, attr)
        return (lambda: setattr(cls, attr, new)), (lambda: setattr(cls, attr, old))

    def config_attr(apply_fn):
        saved = {}

        def apply():
            saved["layer_types"] = list(model.config.layer_types)
            saved["rope"] = model.model.rotary_emb
            apply_fn()

        def undo():
            model.config.layer_types = saved["layer_types"]
            for layer, t in zip(model.model.layers, saved["layer_types"]):
                layer.self_attn.sliding_window = (
                    model.config.sliding_window if t == "sliding_attention" else None)
            model.model.rotary_emb = saved["rope"]
        return apply, undo

    run("sinks_dropped", *params("self_attn.sinks", -1e30))

    def no_clamp(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)
    run("clamp_dropped", *patch(experts_cls, "_apply_gate", no_clamp))

    def halves(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)
    run("gate_up_not_interleaved", *patch(experts_cls, "_apply_gate", halves))

    def softmax_first(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
        probs = torch.softmax(logits, dim=-1)
        scores, indices = torch.topk(probs, self.top_k, dim=-1)
        return logits, scores, indices
    run("router_softmax_before_topk", *patch(router_cls, "forward", softmax_first))

    def all_full():
        model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
    run("sliding_window_ignored", *config_attr(all_full))

    def default_rope():
        cfg = GptOssConfig(**{**{k: v for k, v in CONFIG.items() if k != "architectures"},
                              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
        model.model.rotary_emb = modeling_gpt_oss.GptOssRotaryEmbedding(cfg)
    run("yarn_ignored", *config_attr(default_rope))

    saved = {}

    def drop_biases():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                saved[n] = p.detach().clone()
                p.data.zero_()

    def restore_biases():
        for n, p in model.named_parameters():
            if n in saved:
                p.data.copy_(saved[n])
    run("biases_dropped", drop_biases, restore_biases)
    return out


def reference(model, texts, variant, extra):
    seqs, lps = run_all(model, texts, attn="eager")
    record = {
        "variant": variant,
        "architecture": "GptOssForCausalLM",
        "torch_dtype_used": "float32",
        "attn_implementation": "eager",
        "sequences": seqs,
        "routing": [routing(model, ids) for _, ids in texts],
        "versions": versions(),
        **extra,
    }
    return record, lps


def bf16_run(model, texts, base_lps):
    """transformers' own bf16 run (eager, CPU; the norms stay f32 as `_keep_in_fp32_modules`
    keeps them): how far bf16 compute alone moves the log-probs from the f32 reference."""
    import copy
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    for name in ("input_layernorm", "post_attention_layernorm"):
        for layer in bf16.model.layers:
            getattr(layer, name).to(torch.float32)
    bf16.model.norm.to(torch.float32)
    _, lps = run_all(bf16, texts, attn="eager")
    return {"diff_stats_vs_f32": deltas(base_lps, lps)}


def main():
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    texts = make_texts(tok)
    model = build_model()
    state = bf16_state(model)
    config = {**CONFIG, "dtype": "bfloat16"}

    dense_dir = FIXTURES / "gpt_oss-dense-bf16"
    write_checkpoint(dense_dir, state, config)
    loaded = GptOssForCausalLM.from_pretrained(dense_dir, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    record, base_lps = reference(loaded, texts, "gpt_oss-dense-bf16", {})
    record["mutations"] = mutations(loaded, texts, base_lps)
    record["bf16_run"] = bf16_run(loaded, texts, base_lps)
    print(f"bf16 run: {record['bf16_run']}")
    (dense_dir / "reference.json").write_text(json.dumps(record, indent=1) + "\n")

    native = {k: v for k, v in state.items() if not k.endswith(("gate_up_proj", "down_proj"))}
    for k, v in state.items():
        if k.endswith(("gate_up_proj", "down_proj")):
            # transformers' [E, in, out] as the blocks' [E, out, in]
            blocks, scales = pack_mxfp4(v.to(torch.float32).transpose(1, 2))
            native[f"{k}_blocks"], native[f"{k}_scales"] = blocks, scales
    mx_config = {**config, "quantization_config": {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }}
    mx_dir = FIXTURES / "gpt_oss-mxfp4"
    write_checkpoint(mx_dir, native, mx_config)
    mx = GptOssForCausalLM.from_pretrained(
        mx_dir, quantization_config=Mxfp4Config(dequantize=True), attn_implementation="eager",
    ).to(torch.float32).eval()
    # transformers' decode of the bytes against our packing's intent: every weight a bf16 value
    err = max(float((getattr(l.mlp.experts, p).float() - getattr(model.model.layers[i].mlp.experts, p)
                     ).abs().max()) for i, l in enumerate(mx.model.layers)
              for p in ("gate_up_proj", "down_proj"))
    print(f"mxfp4: max |w - dequant(pack(w))| = {err:.3e}")
    mx_record, mx_lps = reference(mx, texts, "gpt_oss-mxfp4",
                                  {"max_abs_weight_error_vs_bf16": err})
    mx_record["vs_dense_bf16"] = deltas(base_lps, mx_lps)
    mx_record["bf16_run"] = bf16_run(mx, texts, mx_lps)
    print(f"mxfp4 vs bf16 log-probs: {mx_record['vs_dense_bf16']}")
    (mx_dir / "reference.json").write_text(json.dumps(mx_record, indent=1) + "\n")


if __name__ == "__main__":
    main()
