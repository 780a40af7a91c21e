#!/usr/bin/env python3
"""Held-out config audit of the DeepSeek family (MLA and group-limited MoE) and Mixtral: does the
server's CPU float32 forward agree with transformers' float32 forward on config variants that the
fixtures do not exercise?

For each family (deepseek_v3 / Kimi K2, deepseek_v2, glm4_moe, glm4_moe_lite, mistral4, mixtral,
and Mistral3ForConditionalGeneration wrapping a deepseek_v3 or mistral4 text model) and each
variant (one or two config keys changed from the tiny base that scripts/make_arch_fixtures.py
uses), this:
  1. builds a seeded random float32 model with transformers (weights scaled so that the logits
     are not flat, a random e_score_correction_bias where the router has one),
  2. writes it with save_pretrained (the tensor names transformers writes) in float32, or with
     --bf16 in bf16 (the reference then loads it back in float32), plus the 2000-token
     tokenizer of tests/fixtures/llama-dense-bf16,
  3. computes float32 reference log-probs of three seeded token sequences (40, 80, 120 ids),
  4. starts the server (--dtype f32 --device cpu) on it, scores the same ids through /score,
  5. prints one row per variant: max |delta| over all scored tokens, PASS (<= 1e-4) / FAIL, or
     the server's refusal or crash (its last log line).

Usage (CPU only, no network; a few seconds a variant):
    /tmp/venv-fixtures/bin/python scripts/audit_config_variants_mla.py \
        --server target/release/exactscore-server [--only deepseek_v3] [--variant NAME] [--keep DIR]

Last run (2026-11-28, transformers 5.17.0, torch 2.14.0, CPU f32): 97 variants; 90 pass (max
|delta| <= 1.1e-5); transformers itself cannot build or run the other 7 (n_shared_experts 0 for
V3 and V2, num_key_value_heads != num_attention_heads for MLA, topk_method noaux_tc for V2,
Mistral 4 without llama_4_scaling_beta or without YaRN, Mixtral YaRN without head_dim); the same
with --bf16 (checkpoints stored in bf16, the reference loading them in f32), max |delta| 7.8e-6.
main's server before this audit's fixes: 79 of its 89 variants passed; it refused DeepSeek-V2's
mlp_bias and Mistral 3 around a DeepSeek-V3 text model (twice), the rest as above.

`--fixture NAME` instead writes the test fixture tests/fixtures/NAME/ of FIXTURES (a variant
shrunk to a 256-token vocabulary and one dense plus one sparse layer, float32, ~170 KB):
config.json and model.safetensors as save_pretrained writes them, and reference.json with the
float32 log-probs of three sequences in the layout of the other fixtures' references
(`sequences[i].token_ids`, `.token_logprobs` with a leading null). server/tests/arch_numerics.rs
scores them.
"""
import argparse
import copy
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "tests" / "fixtures" / "llama-dense-bf16"
VOCAB = 2000
PASS = 1e-4
STORE_BF16 = False

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
        "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0}
MLA = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=32,
           qk_rope_head_dim=16, v_head_dim=24, rms_norm_eps=1e-6, max_position_embeddings=5120,
           hidden_act="silu", tie_word_embeddings=False)

BASES = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        MLA, q_lora_rank=64, n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=4,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, rope_interleave=True, num_nextn_predict_layers=0,
        rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0))),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        MLA, q_lora_rank=None, n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=4,
        n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=4.0,
        first_k_dense_replace=1, rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707))),
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM", dict(
        MLA, q_lora_rank=64, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
        n_group=4, topk_group=2, routed_scaling_factor=2.0, norm_topk_prob=True,
        first_k_dense_replace=1, rope_interleave=True, max_position_embeddings=1024,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "llama_4_scaling_beta": 0.1})),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        MLA, q_lora_rank=None, v_head_dim=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=1.8,
        norm_topk_prob=True, mlp_layer_types=["dense", "sparse", "sparse"], rope_interleave=False,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=True,
        use_qk_norm=True, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
        first_k_dense_replace=1, rms_norm_eps=1e-5, max_position_embeddings=4096,
        num_nextn_predict_layers=0, hidden_act="silu", tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5})),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
        max_position_embeddings=4096, hidden_act="silu", tie_word_embeddings=False,
        sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}

# (family, variant name, config overrides); the wrapper families take the text base of theirs.
VARIANTS = [
    ("deepseek_v3", "base", {}),
    ("deepseek_v3", "q_lora_rank=null", dict(q_lora_rank=None)),
    ("deepseek_v3", "v_head_dim=48", dict(v_head_dim=48)),
    ("deepseek_v3", "nope16/rope32/v32", dict(qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=32)),
    ("deepseek_v3", "rope default", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    ("deepseek_v3", "yarn mscale only", dict(rope_parameters=dict(YARN, mscale=0.707))),
    ("deepseek_v3", "yarn mscale_all_dim only", dict(rope_parameters=dict(YARN, mscale_all_dim=0.707))),
    ("deepseek_v3", "yarn no mscale", dict(rope_parameters=dict(YARN))),
    ("deepseek_v3", "yarn mscale!=all_dim", dict(rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=0.5))),
    ("deepseek_v3", "rope_interleave=false", dict(rope_interleave=False)),
    ("deepseek_v3", "attention_bias", dict(attention_bias=True)),
    ("deepseek_v3", "attention_bias, q_lora_rank=null", dict(attention_bias=True, q_lora_rank=None)),
    ("deepseek_v3", "num_nextn_predict_layers=1 (no mtp tensors)", dict(num_nextn_predict_layers=1)),
    ("deepseek_v3", "n_group=1", dict(n_group=1, topk_group=1)),
    ("deepseek_v3", "norm_topk_prob=false", dict(norm_topk_prob=False)),
    ("deepseek_v3", "routed_scaling_factor=1", dict(routed_scaling_factor=1.0)),
    ("deepseek_v3", "n_shared_experts=0", dict(n_shared_experts=0)),
    ("deepseek_v3", "n_shared_experts=1", dict(n_shared_experts=1)),
    ("deepseek_v3", "first_k_dense_replace=0", dict(first_k_dense_replace=0)),
    ("deepseek_v3", "first_k_dense_replace=2", dict(first_k_dense_replace=2)),
    ("deepseek_v3", "first_k_dense_replace=3 (all dense)", dict(first_k_dense_replace=3)),
    ("deepseek_v3", "tie_word_embeddings", dict(tie_word_embeddings=True)),
    ("deepseek_v3", "kimi-k2 (n_group 1, 1 shared, rope yarn 32)",
     dict(n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.827,
          rope_parameters=dict(YARN, factor=32.0, mscale=1.0, mscale_all_dim=1.0))),
    ("deepseek_v3", "kimi-k2 rope (beta_fast=beta_slow=1, theta 50000)",
     dict(n_group=1, topk_group=1, rope_parameters=dict(YARN, rope_theta=50000.0, factor=32.0, beta_fast=1.0,
                                                         beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))),
    ("deepseek_v3", "rope_scaling (legacy key)", dict(rope_parameters=None, rope_theta=10000.0,
                                                       rope_scaling=dict(YARN, type="yarn", mscale=1.0, mscale_all_dim=1.0))),
    ("deepseek_v3", "mqa kv_heads=1", dict(num_key_value_heads=1)),
    # keys of the published configs that DeepseekV3Config keeps but the model never reads
    ("deepseek_v3", "published extras (noaux_tc, sigmoid, moe_layer_freq)",
     dict(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, aux_loss_alpha=0.001,
          seq_aux=True, ep_size=1)),
    ("deepseek_v3", "scoring_func=softmax (unread)", dict(scoring_func="softmax")),
    ("deepseek_v2", "base", {}),
    ("deepseek_v2", "q_lora_rank=64", dict(q_lora_rank=64)),
    ("deepseek_v2", "topk_method=greedy", dict(topk_method="greedy", n_group=None, topk_group=None)),
    ("deepseek_v2", "greedy with groups", dict(topk_method="greedy")),
    ("deepseek_v2", "norm_topk_prob=true", dict(norm_topk_prob=True)),
    ("deepseek_v2", "routed_scaling_factor=1", dict(routed_scaling_factor=1.0)),
    ("deepseek_v2", "first_k_dense_replace=0", dict(first_k_dense_replace=0)),
    ("deepseek_v2", "first_k_dense_replace=2", dict(first_k_dense_replace=2)),
    ("deepseek_v2", "n_shared_experts=0", dict(n_shared_experts=0)),
    ("deepseek_v2", "attention_bias", dict(attention_bias=True)),
    ("deepseek_v2", "mlp_bias", dict(mlp_bias=True)),
    ("deepseek_v2", "rope default", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    ("deepseek_v2", "yarn mscale_all_dim only", dict(rope_parameters=dict(YARN, mscale_all_dim=0.707))),
    ("deepseek_v2", "v_head_dim=48", dict(v_head_dim=48)),
    ("deepseek_v2", "tie_word_embeddings", dict(tie_word_embeddings=True)),
    ("deepseek_v2", "moe_layer_freq=2", dict(moe_layer_freq=2)),
    ("deepseek_v2", "published extras (softmax, aux)", dict(scoring_func="softmax", aux_loss_alpha=0.001,
                                                           seq_aux=True, moe_layer_freq=1)),
    ("deepseek_v2", "topk_method=noaux_tc", dict(topk_method="noaux_tc")),
    ("mistral4", "base", {}),
    ("mistral4", "q_lora_rank=null", dict(q_lora_rank=None)),
    ("mistral4", "rope_interleave=false", dict(rope_interleave=False)),
    ("mistral4", "no llama4 scaling", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                                                            "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
    ("mistral4", "rope default", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    ("mistral4", "n_group=1", dict(n_group=1, topk_group=1)),
    ("mistral4", "norm_topk_prob=false", dict(norm_topk_prob=False)),
    ("mistral4", "n_shared_experts=2", dict(n_shared_experts=2)),
    ("mistral4", "first_k_dense_replace=0", dict(first_k_dense_replace=0)),
    ("mistral4", "attention_bias", dict(attention_bias=True)),
    ("mistral4", "tie_word_embeddings", dict(tie_word_embeddings=True)),
    ("glm4_moe_lite", "base", {}),
    ("glm4_moe_lite", "q_lora_rank=64", dict(q_lora_rank=64)),
    ("glm4_moe_lite", "v_head_dim=24", dict(v_head_dim=24)),
    ("glm4_moe_lite", "n_group=2", dict(n_group=2, topk_group=1)),
    ("glm4_moe_lite", "norm_topk_prob=false", dict(norm_topk_prob=False)),
    ("glm4_moe_lite", "rope_interleave=true", dict(rope_interleave=True)),
    ("glm4_moe_lite", "yarn", dict(rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0))),
    ("glm4_moe_lite", "attention_bias", dict(attention_bias=True)),
    ("glm4_moe_lite", "first_k_dense_replace=2", dict(mlp_layer_types=None, first_k_dense_replace=2)),
    ("glm4_moe_lite", "mlp_layer_types all dense", dict(mlp_layer_types=["dense"] * 3)),
    ("glm4_moe_lite", "n_shared_experts=2", dict(n_shared_experts=2)),
    ("glm4_moe_lite", "tie_word_embeddings", dict(tie_word_embeddings=True)),
    ("glm4_moe_lite", "published extras (noaux_tc, sigmoid)", dict(topk_method="noaux_tc", scoring_func="sigmoid")),
    ("glm4_moe", "base", {}),
    ("glm4_moe", "use_qk_norm=false", dict(use_qk_norm=False)),
    ("glm4_moe", "attention_bias=false", dict(attention_bias=False)),
    ("glm4_moe", "partial_rotary_factor=1", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0})),
    ("glm4_moe", "partial_rotary_factor=0.25", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
    ("glm4_moe", "partial_rotary_factor absent", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    ("glm4_moe", "n_group=1", dict(n_group=1, topk_group=1)),
    ("glm4_moe", "norm_topk_prob=false", dict(norm_topk_prob=False)),
    ("glm4_moe", "first_k_dense_replace=0", dict(first_k_dense_replace=0)),
    ("glm4_moe", "first_k_dense_replace=2", dict(first_k_dense_replace=2)),
    ("glm4_moe", "n_shared_experts=2", dict(n_shared_experts=2)),
    ("glm4_moe", "yarn", dict(rope_parameters=dict(YARN, partial_rotary_factor=0.5))),
    ("glm4_moe", "head_dim=16 (!= hidden/heads)", dict(head_dim=16)),
    ("glm4_moe", "tie_word_embeddings", dict(tie_word_embeddings=True)),
    ("glm4_moe", "num_nextn_predict_layers=1 (no mtp tensors)", dict(num_nextn_predict_layers=1)),
    ("mixtral", "base", {}),
    ("mixtral", "sliding_window=16", dict(sliding_window=16)),
    ("mixtral", "router_jitter_noise", dict(router_jitter_noise=0.1)),
    ("mixtral", "top-3 of 8", dict(num_experts_per_tok=3)),
    ("mixtral", "top-1 of 8", dict(num_experts_per_tok=1)),
    ("mixtral", "head_dim=48", dict(head_dim=48)),
    ("mixtral", "tie_word_embeddings", dict(tie_word_embeddings=True)),
    ("mixtral", "yarn", dict(rope_parameters=dict(YARN, rope_theta=1e6))),
    ("mixtral", "yarn with head_dim (5.17 needs it)", dict(head_dim=32, rope_parameters=dict(YARN, rope_theta=1e6))),
    ("mistral3:deepseek_v3", "Mistral Large 3 shape (llama4 scaling)",
     dict(rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1))),
    ("mistral3:deepseek_v3", "plain", {}),
    ("mistral3:mistral4", "base", {}),
]


# Test fixtures: (family, overrides) small enough to commit.
TINY = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
            n_group=2, topk_group=1, first_k_dense_replace=1)
FIXTURES = {
    # DeepseekV2MLP's mlp_bias: biases on the dense MLP and the shared experts, not the routed
    "deepseek_v2-mlp-bias": ("deepseek_v2", dict(TINY, mlp_bias=True, attention_bias=True)),
}
FIXTURE_VOCAB = 256


def build_config(family, overrides, vocab=VOCAB):
    if family.startswith("mistral3:"):
        text = family.split(":")[1]
        _, _, kw = BASES[text]
        kw = copy.deepcopy(kw)
        kw.update(overrides)
        kw.update(model_type=text, vocab_size=VOCAB, bos_token_id=1992, eos_token_id=1993)
        vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, head_dim=16, patch_size=4,
                      image_size=16, num_channels=3)
        cfg = transformers.Mistral3Config(text_config=kw, vision_config=vision,
                                          tie_word_embeddings=False)
        return cfg, transformers.Mistral3ForConditionalGeneration
    cname, mname, kw = BASES[family]
    kw = copy.deepcopy(kw)
    kw.update(overrides)
    kw = {k: v for k, v in kw.items() if not (v is None and k == "rope_parameters")}
    cfg = getattr(transformers, cname)(vocab_size=vocab, bos_token_id=min(1992, vocab - 2),
                                       eos_token_id=min(1993, vocab - 1), pad_token_id=None, **kw)
    return cfg, getattr(transformers, mname)


@torch.no_grad()
def init_weights(model, seed):
    """Seeded: norms ~U(0.6, 1.4), matrices N(0, 1/fan_in) (logits spread of a few nats),
    embeddings 0.5, biases 0.1, e_score_correction_bias 0.1."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if "norm" in name and name.endswith("weight"):
            v = 0.6 + 0.8 * torch.rand(p.shape, generator=g)
        elif "embed_tokens" in name:
            v = (0.12 if model.config.get_text_config().tie_word_embeddings else 0.5) * torch.randn(p.shape, generator=g)
        elif name.endswith("bias") or p.dim() == 1:
            v = 0.1 * torch.randn(p.shape, generator=g)
        else:
            fan_in = p.shape[-1]
            gain = 1.5 if name.endswith("lm_head.weight") else 0.8
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                gain = 2.0  # router: decisive, so near-ties are rare
            v = gain / math.sqrt(fan_in) * torch.randn(p.shape, generator=g)
        p.copy_(v.to(p.dtype))
    for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
        if name.endswith("e_score_correction_bias"):
            b.copy_((0.1 * torch.randn(b.shape, generator=g)).to(b.dtype))
    if model.config.get_text_config().tie_word_embeddings:
        model.tie_weights()


def sequences(seed, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    bos = min(1992, vocab - 2)
    return [[bos] + torch.randint(0, vocab - 8, (n - 1,), generator=g).tolist() for n in (40, 80, 120)]


@torch.no_grad()
def reference(model, seqs):
    out = []
    for ids in seqs:
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        lsm = torch.log_softmax(logits, -1)
        out.append(lsm[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist())
    return out


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def http(url, body=None, timeout=120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def serve_and_score(server, model_dir, seqs, log_path):
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([server, "--model", str(model_dir), "--port", str(port), "--dtype",
                                 "f32", "--device", "cpu"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if proc.poll() is not None:
                lines = Path(log_path).read_text().strip().splitlines()
                return None, "exit %s: %s" % (proc.returncode, lines[-1] if lines else "")
            try:
                status, _ = http(f"http://127.0.0.1:{port}/health/ready", timeout=2)
                if status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.3)
        else:
            return None, "not ready in 120 s"
        status, body = http(f"http://127.0.0.1:{port}/score", {"tokens": seqs})
        if status != 200:
            return None, "HTTP %d: %s" % (status, body)
        return [s["token_logprobs"][1:] for s in body["sequences"]], None
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


def run_variant(server, family, name, overrides, seed, work):
    out = work / f"{family.replace(':', '-')}-{name}".replace(" ", "_").replace("/", "_")
    if out.exists():
        shutil.rmtree(out)
    try:
        cfg, cls = build_config(family, overrides)
        torch.manual_seed(seed)
        model = cls(cfg).to(torch.float32).eval()
        init_weights(model, seed)
        if STORE_BF16:  # bf16 on disk; the reference loads it in f32, as a user would
            model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
            model = cls.from_pretrained(out, dtype=torch.float32).eval()
        else:
            model.save_pretrained(out, safe_serialization=True)
    except Exception as e:  # transformers refuses the variant itself
        return "transformers refuses: %s" % str(e).splitlines()[0][:110]
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / f, out / f)
    seqs = sequences(seed)
    model.config._attn_implementation = "eager"
    try:
        ref = reference(model, seqs)
    except Exception as e:  # transformers cannot run the variant
        return "transformers fails: %s" % str(e).splitlines()[0][:110]
    got, err = serve_and_score(server, out, seqs, out / "server.log")
    if err:
        return "ERROR " + err[:160]
    deltas = [abs(a - b) for r, s in zip(ref, got) for a, b in zip(r, s)]
    worst = max(deltas)
    return "%s max|d|=%.2e mean|d|=%.2e" % ("PASS" if worst <= PASS else "FAIL", worst,
                                          sum(deltas) / len(deltas))


def write_fixture(name):
    family, overrides = FIXTURES[name]
    out = REPO / "tests" / "fixtures" / name
    seed = zlib.crc32(name.encode()) % 100000
    cfg, cls = build_config(family, overrides, vocab=FIXTURE_VOCAB)
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    init_weights(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    model.config._attn_implementation = "eager"
    seqs = sequences(seed, FIXTURE_VOCAB)
    ref = reference(model, seqs)
    doc = {"transformers": transformers.__version__, "torch": torch.__version__,
           "sequences": [{"token_ids": ids, "token_logprobs": [None] + lp}
                         for ids, lp in zip(seqs, ref)]}
    (out / "reference.json").write_text(json.dumps(doc) + "\n")
    (out / "generation_config.json").unlink(missing_ok=True)
    print("wrote", out, sum(f.stat().st_size for f in out.iterdir()), "bytes")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", default=str(REPO / "target" / "release" / "exactscore-server"))
    ap.add_argument("--only", default=None, help="comma-separated families")
    ap.add_argument("--variant", default=None, help="substring of variant names")
    ap.add_argument("--keep", default=None, help="write the checkpoints here and keep them")
    ap.add_argument("--bf16", action="store_true", help="store the checkpoints in bf16")
    ap.add_argument("--fixture", default=None, choices=sorted(FIXTURES), help="write this fixture")
    args = ap.parse_args()
    if args.fixture:
        return write_fixture(args.fixture)
    global STORE_BF16
    STORE_BF16 = args.bf16
    torch.set_num_threads(2)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="audit-mla-"))
    work.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    print("transformers", transformers.__version__, "torch", torch.__version__, flush=True)
    for family, name, overrides in VARIANTS:
        if only and family not in only:
            continue
        if args.variant and args.variant not in name:
            continue
        seed = zlib.crc32(f"{family}:{name}".encode()) % 100000
        result = run_variant(args.server, family, name, overrides, seed, work)
        print(f"| {family} | {name} | {result} |", flush=True)
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    sys.exit(main())
