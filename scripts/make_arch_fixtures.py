#!/usr/bin/env python3
"""Builds the Qwen3-MoE, Mixtral, Gemma 3, Gemma 2, Gemma 4, Qwen3.5, Qwen3.5-MoE, Qwen3-Next,
DeepSeek-V3, GLM-4.5 and GLM-4.7-Flash test fixtures under tests/fixtures/.

Tiny seeded random-weight checkpoints, quantized with llm-compressor (round-to-nearest, as the
Llama fixtures are), plus float32 reference log-probs from transformers. The conventions are the
Llama fixtures' (see tests/fixtures/*/reference.json): the same 2000-token tokenizer (read from
tests/fixtures/llama-dense-bf16), the same four sequences (17, 59, 223 and 256 ids incl. BOS),
reference.json with `sequences` / `weights_only` / `bf16_run` / `numerics`, dequant_check.json
with checksums of every dequantized Linear weight.

What differs from a plain `from_pretrained` reference, and why:
  * MoE experts. transformers 5 fuses per-expert checkpoint weights into 3-D parameters; a float32
    load of a quantized MoE checkpoint leaves those experts in bf16, computes them in bf16 and
    skips their activation quantization. The MoE references are built from per-expert Linears
    (`LinearExperts`, the same routing loop as transformers), each loaded from the written
    checkpoint and dequantized by compressed-tensors' own compressor. The experts are linearized
    here, not by llm-compressor's MoE helpers (those need torchvision on CPU).
  * FP8-dynamic activations are quantized per token. compressed-tensors gives a 2-D input one
    scale (an expert receives its tokens as [n, hidden]); the scheme means one scale per token,
    which is what vLLM does and what the reference feeds it here ([n, 1, hidden]).
  * Gemma norm weights: llm-compressor rounds them to bf16 while quantizing (its offset-norm
    calibration turns w into 1 + w and back). Every reference reads the written checkpoint.
  * Gemma 3 configs: transformers writes a stale `_sliding_window_pattern`; `layer_types` is what
    counts and is always written explicitly here.
  * Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (docs/architectures/qwen3_5.md): quantized as
    llm-compressor's examples for them quantize (EXAMPLE_IGNORE: no linear_attn module, router,
    shared-expert gate, embedding, lm_head or vision tower), except `-linattn`, which quantizes
    the linear-attention Linears too. The MoE checkpoints get bf16 `mtp.*` tensors
    (add_mtp_tensors), which the references skip as transformers does. Each reference.json adds
    `mutations`: the log-prob shift when one mechanism is broken on purpose (MUTATIONS).
  * DeepSeek-V3 / GLM-4.5 / GLM-4.7-Flash (docs/architectures/deepseek.md): every Linear but
    lm_head and the router quantized; the routers' `e_score_correction_bias` buffer drawn at
    random; `mutations` for the routing and latent attention, and `routing_near_ties` (choices
    within 1e-6 of flipping). Their configs set `num_mtp_layers=0`: llm-compressor would look
    for MTP tensors in a source checkpoint these in-memory models do not have. Run one variant
    at a time (each run rewrites arch_summary.json).
  * Gemma 4 (docs/architectures/gemma4.md): every Linear but lm_head, the router's projection and
    per_layer_projection (GEMMA4_IGNORE); norms drawn as plain multipliers (x * w), q/k norms
    small (unscaled scores), layer_scalar and the router's scales drawn at random; `mutations`
    for per-layer inputs, KV sharing, layer_scalar, the value norm, the score scale,
    proportional RoPE, the final soft-cap, the norm convention and the router.

Every reference is built the same way: the architecture from config.json in float32 (experts
linearized), every tensor from model.safetensors (quantized Linears dequantized), activation
fake-quant (where the scheme has it) applied by hooks around the quantized Linears. For the dense
architectures that reference is also compared with a plain transformers `from_pretrained` load
(`numerics.manual_vs_from_pretrained_f32`, 0.0 expected).

Usage (CPU only, no network; ~3 minutes on 2 cores):
    python -m venv /tmp/venv-fixtures
    /tmp/venv-fixtures/bin/pip install -r scripts/requirements-fixtures.txt
    /tmp/venv-fixtures/bin/python scripts/make_arch_fixtures.py [--only NAME,...] [--stage all|refs]
"""
import argparse
import gc
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, os.cpu_count() or 1)))

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
TOKENIZER_DIR = FIXTURES / "llama-dense-bf16"
CORPUS = FIXTURES / "corpus" / "wikitext-2-raw-test.txt.gz"

# ----------------------------------------------------------------------------------------------
# Sequences: the Llama fixtures' four texts; the last is cut at a pre-token boundary to 256 ids.
# ----------------------------------------------------------------------------------------------
TEXT_SHORT = "To be, or not to be, that is the question."
TEXT_64 = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal."
)
TEXT_200 = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
    "of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season "
    "of Light, it was the season of Darkness, it was the spring of hope, it was the winter of "
    "despair, we had everything before us, we had nothing before us, we were all going direct to "
    "Heaven, we were all going direct the other way\u2014in short, the period was so far like the "
    "present period, that some of its noisiest authorities insisted on its being received, for good "
    "or for evil, in the superlative degree of comparison only.\n\n"
    "There were a king with a large jaw and a queen with a plain face."
)
TEXT_LONG_SOURCE = (
    "We hold these truths to be self-evident, that all men are created equal, that they are endowed "
    "by their Creator with certain unalienable Rights, that among these are Life, Liberty and the "
    "pursuit of Happiness.--That to secure these rights, Governments are instituted among Men, "
    "deriving their just powers from the consent of the governed, --That whenever any Form of "
    "Government becomes destructive of these ends, it is the Right of the People to alter or to "
    "abolish it, and to institute new Government, laying its foundation on such principles and "
    "organizing its powers in such form, as to them shall seem most likely to effect their Safety "
    "and Happiness. Prudence, indeed, will dictate that Governments long established should not be "
    "changed for light and transient causes; and accordingly all experience hath shewn, that "
    "mankind are more disposed to suffer, while evils are sufferable, than to right themselves by "
    "abolishing the forms to which they are accustomed. But when a long train of abuses and "
    "usurpations, pursuing invariably the same Object evinces a design to reduce them under absolute "
    "Despotism, it is their right, it is their duty, to throw off such Government, and to provide "
    "new Guards for their future security.--Such has been the patient sufferance of these Colonies; "
    "and such is now the necessity which constrains them to alter their former Systems of "
    "Government. The history of the present King of Great Britain is a history of repeated injuries "
    "and usurpations, all having in direct object the establishment of an absolute Tyranny over "
    "these States. To prove this, let Facts be submitted to a candid world."
)
EXACT_LONG_LEN = 256


def make_texts(tok):
    """The 4 (text, ids) pairs; the last one is cut to exactly EXACT_LONG_LEN ids."""
    out = [(t, tok(t)["input_ids"]) for t in (TEXT_SHORT, TEXT_64, TEXT_200)]
    enc = tok(TEXT_LONG_SOURCE, return_offsets_mapping=True)
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    cut = offs[EXACT_LONG_LEN][0]
    text = TEXT_LONG_SOURCE[:cut]
    while tok(text)["input_ids"] != ids[:EXACT_LONG_LEN]:
        cut -= 1
        text = TEXT_LONG_SOURCE[:cut]
    out.append((text, tok(text)["input_ids"]))
    assert [len(i) for _, i in out] == [17, 59, 223, 256], [len(i) for _, i in out]
    return out


# ----------------------------------------------------------------------------------------------
# Architectures. Small enough for ~1-2 MB per checkpoint; every kind of layer present once.
# ----------------------------------------------------------------------------------------------
COMMON = dict(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
)
ARCHS = {
    # layer 0 sparse (8 experts, top 2, renormalised), layer 1 dense through mlp_only_layers
    "qwen3moe": dict(
        config="Qwen3MoeConfig",
        model="Qwen3MoeForCausalLM",
        seed=2401,
        kw=dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
            hidden_act="silu",
        ),
        experts=("gate_proj", "up_proj", "down_proj"),
    ),
    # Mixtral: every layer sparse
    "mixtral": dict(
        config="MixtralConfig",
        model="MixtralForCausalLM",
        seed=2402,
        kw=dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            sliding_window=None,
            tie_word_embeddings=False,
            hidden_act="silu",
        ),
        experts=("w1", "w3", "w2"),
    ),
    # one sliding (window 32, local base 10k) and one global layer (1M, linear x8, as Gemma 3's
    # 4B-27B); query_pre_attn_scalar != head_dim so that the attention scale is tested
    "gemma3": dict(
        config="Gemma3TextConfig",
        model="Gemma3ForCausalLM",
        seed=2403,
        kw=dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=256,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=32,
            query_pre_attn_scalar=48,
            rms_norm_eps=1e-6,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        ),
    ),
    # Gemma 2: sliding + global, attention-logit and final-logit soft-capping (caps chosen low
    # enough that leaving either out moves the log-probs far beyond 1e-4)
    "gemma2": dict(
        config="Gemma2Config",
        model="Gemma2ForCausalLM",
        seed=2404,
        kw=dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=256,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=32,
            query_pre_attn_scalar=48,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            final_logit_softcapping=15.0,
            attn_logit_softcapping=10.0,
        ),
    ),
}

# The hybrid Gated-DeltaNet families (docs/architectures/qwen3_5.md). Four layers, linear and full
# attention mixed as the real configs mix them (3 linear : 1 full, here 1:1 so that both kinds
# repeat); two key heads and four value heads, so the key/query heads are repeated; head_dim 64
# with partial rotary 0.25 (16 rotary dims) and an interleaved mrope section that sums to 8.
# The MoE variants use hidden_size 64 (!= heads * head_dim, as in the real configs) to stay small.
HYBRID = dict(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
)
QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
               "mrope_section": [3, 3, 2], "mrope_interleaved": True}
# The vision tower of the ForConditionalGeneration checkpoints: one block, tiny; the scoring path
# never runs it, but its tensors are in the checkpoint as in the published ones.
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
                   patch_size=4, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=128,
                   num_position_embeddings=16)
# The Qwen3.5 releases store these two linear-attention parameters in float32 (every other tensor
# in bf16); transformers 5.17 has no keep-in-fp32 rule for them, so a bf16 load rounds them.
QWEN35_F32_PARAMS = ("linear_attn.A_log", "linear_attn.norm.weight")
ARCHS.update({
    # Qwen3.5 dense, the text-only class (model_type qwen3_5_text, names model.layers.*)
    "qwen3_5": dict(
        config="Qwen3_5TextConfig",
        model="Qwen3_5ForCausalLM",
        seed=2501,
        f32_params=QWEN35_F32_PARAMS,
        kw=dict(HYBRID, intermediate_size=256, rope_parameters=QWEN35_ROPE),
    ),
    # Qwen3.5-MoE as published: ForConditionalGeneration (model.language_model.*, model.visual.*),
    # every layer sparse with a gated shared expert; mtp.* tensors added to the checkpoint
    "qwen3_5_moe": dict(
        config="Qwen3_5MoeConfig",
        model="Qwen3_5MoeForConditionalGeneration",
        seed=2502,
        f32_params=QWEN35_F32_PARAMS,
        text_kw=dict(HYBRID, hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                     num_experts=8, num_experts_per_tok=2, rope_parameters=QWEN35_ROPE),
        vision_kw=dict(TINY_VISION, out_hidden_size=64),
        experts=("gate_proj", "up_proj", "down_proj"),
        mtp=True,
    ),
    # Qwen3-Next: fused, head-grouped in_proj_qkvz / in_proj_ba; plain rope (no mrope); layer 2
    # dense through mlp_only_layers, norm_topk_prob off so the un-renormalised top-k is exercised
    "qwen3_next": dict(
        config="Qwen3NextConfig",
        model="Qwen3NextForCausalLM",
        seed=2503,
        kw=dict(HYBRID, hidden_size=64, intermediate_size=192, moe_intermediate_size=32,
                shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[2],
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                 "partial_rotary_factor": 0.25}),
        experts=("gate_proj", "up_proj", "down_proj"),
        mtp=True,
    ),
})

# The DeepSeek family (docs/architectures/deepseek.md): multi-head latent attention with
# q/k head dims != v head dim, DeepSeek-V3's sigmoid routing with a correction bias (a random
# buffer here, so that ignoring it moves the choice) and a group limit, shared experts, dense
# first layers. DeepSeek-V3 keeps its published YaRN (factor 40, mscale = mscale_all_dim = 1),
# interleaved rope and low-rank queries; GLM-4.7-Flash (glm4_moe_lite) takes q_lora_rank null
# and the non-interleaved rope; GLM-4.5 (glm4_moe) has plain attention with biases, q/k norms
# and partial rotary 0.5. Every Linear in-feature is a multiple of 32 (W4A16 g32).
DEEPSEEK_EXPERTS = ("gate_proj", "up_proj", "down_proj")
ARCHS.update({
    "deepseek_v3": dict(
        config="DeepseekV3Config",
        model="DeepseekV3ForCausalLM",
        seed=2601,
        kw=dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=16,
                n_shared_experts=2, num_experts_per_tok=4, n_group=4, topk_group=2,
                routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                rope_interleave=True, rms_norm_eps=1e-6, max_position_embeddings=5120, num_mtp_layers=0,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                 "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                hidden_act="silu", tie_word_embeddings=False),
        experts=DEEPSEEK_EXPERTS,
    ),
    # DeepSeek-V2: V2-Lite's plain q_proj (q_lora_rank null), DeepSeek-V2's published YaRN
    # (mscale = mscale_all_dim = 0.707) and `group_limited_greedy` routing (softmax in f32, a
    # group scores its best expert), no renormalisation, routed_scaling_factor.
    "deepseek_v2": dict(
        config="DeepseekV2Config",
        model="DeepseekV2ForCausalLM",
        seed=2604,
        kw=dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=16,
                n_shared_experts=2, num_experts_per_tok=4, n_group=4, topk_group=2,
                topk_method="group_limited_greedy", routed_scaling_factor=4.0,
                first_k_dense_replace=1, rms_norm_eps=1e-6, max_position_embeddings=5120,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                 "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
                hidden_act="silu", tie_word_embeddings=False),
        experts=DEEPSEEK_EXPERTS,
    ),
    # Mistral 4: DeepSeek-V3's latent attention (low-rank q, interleaved rope) with YaRN over
    # the rotary part (partial_rotary_factor qk_rope / qk_head_dim) and llama-4 query scaling
    # (positions >= original_max_position_embeddings = 64 scaled); softmax routing in the
    # compute dtype, a group scoring its two best, renormalised, times the scaling factor.
    "mistral4": dict(
        config="Mistral4Config",
        model="Mistral4ForCausalLM",
        seed=2605,
        kw=dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=16,
                n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                routed_scaling_factor=2.0, norm_topk_prob=True, first_k_dense_replace=1,
                rope_interleave=True, rms_norm_eps=1e-6, max_position_embeddings=1024,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                                 "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                 "llama_4_scaling_beta": 0.1},
                hidden_act="silu", tie_word_embeddings=False),
        experts=DEEPSEEK_EXPERTS,
    ),
    "glm4_moe_lite": dict(
        config="Glm4MoeLiteConfig",
        model="Glm4MoeLiteForCausalLM",
        seed=2602,
        kw=dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
                n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                routed_scaling_factor=1.8, norm_topk_prob=True,
                mlp_layer_types=["dense", "sparse", "sparse"], rope_interleave=False,
                rms_norm_eps=1e-5, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                hidden_act="silu", tie_word_embeddings=False),
        experts=DEEPSEEK_EXPERTS,
    ),
    "glm4_moe": dict(
        config="Glm4MoeConfig",
        model="Glm4MoeForCausalLM",
        seed=2603,
        kw=dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=True,
                use_qk_norm=True, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                first_k_dense_replace=1, rms_norm_eps=1e-5, max_position_embeddings=4096, num_mtp_layers=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.5},
                hidden_act="silu", tie_word_embeddings=False),
        experts=DEEPSEEK_EXPERTS,
    ),
})

# Gemma 4 (docs/architectures/gemma4.md): the dense text model with every mechanism its config
# has, in five layers: sliding (head_dim 32, RoPE 10k) and full layers (global_head_dim 64, one
# kv head, keys as values, proportional RoPE over a quarter of the pairs), the last two sharing
# the keys/values of the last unshared layer of their type (num_kv_shared_layers) with
# double-wide MLPs, per-layer input embeddings (8 per layer), final soft-capping. The MoE text
# model (26B-A4B's shape): a router with its own norm and scales beside the dense MLP, no
# per-layer inputs. Hidden 64 and a PLE of 8 keep each checkpoint well under 1 MB.
GEMMA4_COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    global_head_dim=64,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    max_position_embeddings=4096,
    sliding_window=32,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    final_logit_softcapping=10.0,  # the real models' 30 barely touches a tiny model's logits
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1000000.0},
    },
)
ARCHS.update({
    "gemma4": dict(
        config="Gemma4TextConfig",
        model="Gemma4ForCausalLM",
        seed=2411,
        kw=dict(
            GEMMA4_COMMON,
            num_hidden_layers=5,
            intermediate_size=128,
            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                         "sliding_attention", "full_attention"],
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=2000,
        ),
    ),
    "gemma4_moe": dict(
        config="Gemma4TextConfig",
        model="Gemma4ForCausalLM",
        seed=2412,
        kw=dict(
            GEMMA4_COMMON,
            num_hidden_layers=3,
            intermediate_size=128,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=8,
            top_k_experts=2,
            moe_intermediate_size=32,
        ),
        experts=("gate_proj", "up_proj", "down_proj"),
    ),
})

INIT_STD = {
    "embed": 0.5,
    "tied_embed": 0.12,  # tied: the embedding doubles as lm_head
    "lm_head": 0.15,
    "q_proj": 0.08,
    "k_proj": 0.08,
    "v_proj": 0.06,
    "o_proj": 0.06,
    "gate_proj": 0.06,
    "up_proj": 0.06,
    "down_proj": 0.06,
    "w1": 0.06,
    "w2": 0.06,
    "w3": 0.06,
    "gate": 0.1,  # MoE router
    "shared_expert_gate": 0.15,
    "in_proj_qkv": 0.08,
    "in_proj_qkvz": 0.08,
    "in_proj_z": 0.08,
    "in_proj_b": 0.15,
    "in_proj_a": 0.15,
    "in_proj_ba": 0.15,
    "out_proj": 0.06,
    "conv1d": 0.35,
    "q_a_proj": 0.08,
    "q_b_proj": 0.1,
    "kv_a_proj_with_mqa": 0.08,
    "kv_b_proj": 0.1,
    # Gemma 4: the router's projection (wide enough that few tokens near-tie) and the per-layer
    # input gate / projections
    "proj": 1.0,
    "per_layer_input_gate": 0.1,
    "per_layer_projection": 0.1,
    "per_layer_model_projection": 0.1,
}
# DeepSeek's e_score_correction_bias (a buffer): about the spread of the sigmoid scores.
CORRECTION_BIAS_STD = 0.1

MOE_ROUTER_NAMES = ("mlp.gate",)


def is_gemma(arch):
    return arch.startswith("gemma")


def is_hybrid(arch):
    return arch.startswith("qwen3_5") or arch == "qwen3_next"


def is_gemma4(arch):
    """Gemma 4: plain-weight norms (x * w, not 1 + w), per-layer buffers and router scales."""
    return arch.startswith("gemma4")


def is_deepseek(arch):
    """DeepSeek's group-limited routing (and, but for glm4_moe, its latent attention)."""
    return arch in ("deepseek_v3", "glm4_moe_lite", "glm4_moe", "deepseek_v2", "mistral4")


def has_correction_bias(arch):
    """DeepSeek-V3's sigmoid router with e_score_correction_bias (not the softmax routers of
    DeepSeek-V2 and Mistral 4)."""
    return arch in ("deepseek_v3", "glm4_moe_lite", "glm4_moe")


def zero_centred_norms(model):
    """Names of the (1 + w) RMSNorm weights (Qwen3NextRMSNorm and its copies)."""
    return {f"{n}.weight" for n, m in model.named_modules()
            if type(m).__name__.endswith("RMSNorm") and type(m).__name__.startswith("Qwen3")}


@torch.no_grad()
def init_weights(model, seed, arch):
    """Deterministic init (sorted parameter names). Norm weights are ~U(0.6, 1.4) as multipliers:
    Gemma's (1 + w) norms store w ~ U(-0.4, 0.4), so a loader that forgets either convention
    fails loudly."""
    g = torch.Generator().manual_seed(seed)
    tied = bool(model.config.tie_word_embeddings)
    centred = zero_centred_norms(model) if is_hybrid(arch) else set()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if ".visual." in name or name.startswith("visual."):
            v = 0.05 * torch.randn(p.shape, generator=g)
        elif name.endswith(".A_log"):
            # decays exp(-A * softplus(a + dt_bias)) between ~0.3 and ~0.99 per token
            v = torch.log(0.02 + 0.98 * torch.rand(p.shape, generator=g))
        elif name.endswith(".dt_bias"):
            v = -1.0 + 2.0 * torch.rand(p.shape, generator=g)
        elif is_gemma4(arch) and name.endswith(("q_norm.weight", "k_norm.weight")):
            # Gemma 4 does not scale the scores (scaling 1): unit-RMS heads of 32-64 dimensions
            # would make every softmax one-hot, and the f32 noise floor with it above 1e-4
            v = 0.2 + 0.3 * torch.rand(p.shape, generator=g)
        elif name.endswith("norm.weight") or re.search(r"norm_\d\.weight$", name):
            v = 0.6 + 0.8 * torch.rand(p.shape, generator=g)
            if (is_gemma(arch) and not is_gemma4(arch)) or name in centred:
                v = v - 1.0
        elif name.endswith((".router.scale", ".router.per_expert_scale")):
            v = 0.6 + 0.8 * torch.rand(p.shape, generator=g)
        elif "embed_tokens" in name:
            v = (INIT_STD["tied_embed"] if tied else INIT_STD["embed"]) * torch.randn(p.shape, generator=g)
        elif name.startswith("lm_head"):
            v = INIT_STD["lm_head"] * torch.randn(p.shape, generator=g)
        else:
            kind = name.split(".")[-2]
            v = INIT_STD[kind] * torch.randn(p.shape, generator=g)
        p.copy_(v.to(p.dtype))
    for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
        if name.endswith("e_score_correction_bias"):
            b.copy_((CORRECTION_BIAS_STD * torch.randn(b.shape, generator=g)).to(b.dtype))
        elif name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale
            b.copy_((0.5 + 0.5 * torch.rand(b.shape, generator=g)).to(b.dtype))


# ----------------------------------------------------------------------------------------------
# Linearized experts: one nn.Linear per expert projection, routed exactly as transformers routes
# its fused experts (same loop, same order of the index_add).
# ----------------------------------------------------------------------------------------------
class ExpertMLP(nn.Module):
    def __init__(self, names, hidden, inter, act, dtype):
        super().__init__()
        self.names = names  # (gate, up, down)
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, inter, bias=False, dtype=dtype))
        setattr(self, up, nn.Linear(hidden, inter, bias=False, dtype=dtype))
        setattr(self, down, nn.Linear(inter, hidden, bias=False, dtype=dtype))
        self.act = act

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act(gate(x)) * up(x))


CALIBRATE_ALL_EXPERTS = False


class LinearExperts(nn.ModuleList):
    """Replaces a transformers `*Experts` module (3-D gate_up_proj / down_proj) by per-expert
    Linears with the same forward signature (hidden [n, h], top_k_index, top_k_weights)."""

    def __init__(self, fused, names):
        num, two_inter, hidden = fused.gate_up_proj.shape
        inter = two_inter // 2
        dtype = fused.gate_up_proj.dtype
        super().__init__([ExpertMLP(names, hidden, inter, fused.act_fn, dtype) for _ in range(num)])
        self.num_experts = num
        with torch.no_grad():
            for e, m in enumerate(self):
                gate, up, down = (getattr(m, n) for n in names)
                gate.weight.copy_(fused.gate_up_proj[e, :inter])
                up.weight.copy_(fused.gate_up_proj[e, inter:])
                down.weight.copy_(fused.down_proj[e])

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            if CALIBRATE_ALL_EXPERTS:
                self[e](hidden_states)  # calibration sees every token; the output is discarded
            top_k_pos, token_idx = torch.where(mask[e])
            if token_idx.numel() == 0:
                continue
            out = self[e](hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final


def linearize_experts(model, names):
    for name, module in list(model.named_modules()):
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and name.endswith("experts"):
            model.set_submodule(name, LinearExperts(module, names))
    return model


def build_model(arch, dtype, tok=None, init=True):
    import transformers

    spec = ARCHS[arch]
    tok_ids = {}
    if tok is not None:
        tok_ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None)
    if "text_kw" in spec:  # ForConditionalGeneration: text_config + vision_config
        cfg = getattr(transformers, spec["config"])(
            text_config=dict(vocab_size=2000, **tok_ids, **spec["text_kw"]),
            vision_config=dict(spec["vision_kw"]), tie_word_embeddings=False, **tok_ids)
    else:
        cfg = getattr(transformers, spec["config"])(vocab_size=2000, **tok_ids, **spec["kw"])
    model = getattr(transformers, spec["model"])(cfg).to(torch.float32)
    if "experts" in spec:
        linearize_experts(model, spec["experts"])
    if init:
        init_weights(model, spec["seed"], arch)
        if cfg.tie_word_embeddings:
            model.tie_weights()
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    keep = {}
    if spec.get("f32_params") and dtype != torch.float32:
        keep = {n: p.detach().to(torch.float32).clone() for n, p in model.named_parameters()
                if n.endswith(spec["f32_params"])}
    model = model.to(dtype)
    for n, v in keep.items():  # stored in f32 as the published checkpoints store them
        model.get_parameter(n).data = v
    model.eval()
    return model


# ----------------------------------------------------------------------------------------------
# Variants
# ----------------------------------------------------------------------------------------------
def scheme_w4a16_g32():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True),
    )


VARIANTS = {
    "qwen3moe-w4a16-g32": dict(arch="qwen3moe", scheme=scheme_w4a16_g32),
    "qwen3moe-fp8-dynamic": dict(arch="qwen3moe", scheme="FP8_DYNAMIC", act=True),
    "qwen3moe-nvfp4": dict(arch="qwen3moe", scheme="NVFP4", calib=True, act=True),
    "mixtral-w4a16-g32": dict(arch="mixtral", scheme=scheme_w4a16_g32),
    "gemma3-dense-bf16": dict(arch="gemma3", scheme=None),
    "gemma3-w4a16-g32": dict(arch="gemma3", scheme=scheme_w4a16_g32),
    "gemma3-nvfp4a16": dict(arch="gemma3", scheme="NVFP4A16"),
    "gemma2-dense-bf16": dict(arch="gemma2", scheme=None),
    "gemma2-w4a16-g32": dict(arch="gemma2", scheme=scheme_w4a16_g32),
    # the hybrid families, quantized as llm-compressor's Qwen3.5 / Qwen3-Next examples quantize
    # (EXAMPLE_IGNORE: every linear_attn module, routers, shared-expert gates, lm_head, vision)
    "qwen3_5-w4a16-g32": dict(arch="qwen3_5", scheme=scheme_w4a16_g32),
    "qwen3_5-nvfp4": dict(arch="qwen3_5", scheme="NVFP4", calib=True, act=True),
    # the linear-attention projections quantized too (a recipe without the linear_attn rule)
    "qwen3_5-w4a16-g32-linattn": dict(arch="qwen3_5", scheme=scheme_w4a16_g32, quantize_linear_attn=True),
    "qwen3_5_moe-w4a16-g32": dict(arch="qwen3_5_moe", scheme=scheme_w4a16_g32),
    "qwen3_5_moe-fp8-dynamic": dict(arch="qwen3_5_moe", scheme="FP8_DYNAMIC", act=True),
    "qwen3_next-w4a16-g32": dict(arch="qwen3_next", scheme=scheme_w4a16_g32),
    "qwen3_next-fp8-dynamic": dict(arch="qwen3_next", scheme="FP8_DYNAMIC", act=True),
    # the DeepSeek family: every Linear but lm_head and the router (docs/architectures/deepseek.md)
    "deepseek_v3-w4a16-g32": dict(arch="deepseek_v3", scheme=scheme_w4a16_g32),
    "deepseek_v3-fp8-dynamic": dict(arch="deepseek_v3", scheme="FP8_DYNAMIC", act=True),
    "glm4_moe_lite-w4a16-g32": dict(arch="glm4_moe_lite", scheme=scheme_w4a16_g32),
    "deepseek_v2-w4a16-g32": dict(arch="deepseek_v2", scheme=scheme_w4a16_g32),
    "deepseek_v2-fp8-dynamic": dict(arch="deepseek_v2", scheme="FP8_DYNAMIC", act=True),
    "mistral4-w4a16-g32": dict(arch="mistral4", scheme=scheme_w4a16_g32),
    "glm4_moe-w4a16-g32": dict(arch="glm4_moe", scheme=scheme_w4a16_g32),
    # Gemma 4: every Linear but lm_head, the router's projection and per_layer_projection (its
    # 8 inputs are fewer than a group; the real models' 256 are not)
    "gemma4-w4a16-g32": dict(arch="gemma4", scheme=scheme_w4a16_g32),
    "gemma4-nvfp4a16": dict(arch="gemma4", scheme="NVFP4A16"),
    "gemma4_moe-w4a16-g32": dict(arch="gemma4_moe", scheme=scheme_w4a16_g32),
}
GEMMA4_IGNORE = ["lm_head", "re:.*router\\.proj$", "re:.*per_layer_projection$"]

# What llm-compressor's examples for these families leave out (examples/quantization_w4a4_fp4/
# qwen3_5_example.py, qwen3_next_example.py, quantization_w8a8_fp8/qwen3_5_moe.py): lm_head,
# the vision tower, the MoE routers, the shared-expert gates, the embeddings and every module of
# the Gated DeltaNet layers (in_proj_*, out_proj; conv1d, A_log, dt_bias and the gated norm are
# not Linears anyway). The mtp.* tensors are not part of the transformers model at all.
EXAMPLE_IGNORE = ["lm_head", "re:.*visual.*", "re:.*mlp.gate$", "re:.*shared_expert_gate$",
                  "re:.*embed_tokens$", "re:.*linear_attn.*"]


def calibration_dataset(tok, n=32, seqlen=128):
    import gzip

    from datasets import Dataset

    text = gzip.decompress(CORPUS.read_bytes()).decode("utf-8").replace("\r\n", "\n")
    ids = tok(text[:400000], add_special_tokens=False)["input_ids"]
    step = seqlen - 1
    rows = []
    for i in range(n):
        chunk = [tok.bos_token_id] + ids[i * step : (i + 1) * step]
        rows.append({"input_ids": chunk, "attention_mask": [1] * len(chunk)})
    return Dataset.from_list(rows)


def quantize_and_save(model, spec, out_dir, tok):
    """Round-to-nearest with llm-compressor; the MoE routers (mlp.gate) stay unquantized."""
    global CALIBRATE_ALL_EXPERTS
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    ignore = ["lm_head", "re:.*mlp.gate$"]
    if is_gemma4(spec["arch"]):
        ignore = GEMMA4_IGNORE
    if is_hybrid(spec["arch"]):
        ignore = [p for p in EXAMPLE_IGNORE
                  if not (spec.get("quantize_linear_attn") and "linear_attn" in p)]
    scheme = spec["scheme"]
    if callable(scheme):
        mod = QuantizationModifier(config_groups={"group_0": scheme()}, ignore=ignore)
    else:
        mod = QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore)
    kw = {}
    if spec.get("calib"):
        kw = dict(
            dataset=calibration_dataset(tok),
            num_calibration_samples=32,
            max_seq_length=128,
            shuffle_calibration_samples=False,
        )
    CALIBRATE_ALL_EXPERTS = True
    try:
        model = oneshot(model=model, recipe=mod, **kw)
    finally:
        CALIBRATE_ALL_EXPERTS = False
    model.save_pretrained(str(out_dir), save_compressed=True)
    tok.save_pretrained(str(out_dir))


def build_variant(name, spec, tok, work):
    from transformers import AutoModelForCausalLM

    out = FIXTURES / name
    if out.exists():
        shutil.rmtree(out)
    arch = spec["arch"]
    if "experts" in ARCHS[arch] or is_hybrid(arch) or is_deepseek(arch):
        # transformers 5 would fuse per-expert weights again on reload: quantize in memory.
        model = build_model(arch, torch.bfloat16, tok)
        config_dir = work / f"{arch}-config"  # oneshot reads the config from name_or_path
        model.config.save_pretrained(str(config_dir))
        model.config._name_or_path = str(config_dir)
        quantize_and_save(model, spec, out, tok)
        if ARCHS[arch].get("mtp"):
            add_mtp_tensors(out, model.config.get_text_config(), ARCHS[arch]["seed"])
    else:
        dense = work / f"{arch}-dense-bf16"
        if not dense.exists():
            model = build_model(arch, torch.bfloat16, tok)
            model.generation_config.do_sample = False
            model.save_pretrained(str(dense))
            tok.save_pretrained(str(dense))
            del model
        if spec["scheme"] is None:
            shutil.copytree(dense, out)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.bfloat16)
            quantize_and_save(model, spec, out, tok)
    gc.collect()


def add_mtp_tensors(out_dir, cfg, seed):
    """The published checkpoints carry a multi-token-prediction head (`mtp.*`, bf16, never
    quantized, not part of any transformers class): one full-attention MoE layer plus `fc`
    (2H -> H) and three norms. Random bf16 tensors of those names and shapes are added so that a
    loader has to ignore them by rule, as transformers does (_keys_to_ignore_on_load_unexpected)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed + 7)
    h, hd = cfg.hidden_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        "mtp.layers.0.input_layernorm.weight": (h,),
        "mtp.layers.0.post_attention_layernorm.weight": (h,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * nh * hd, h),
        "mtp.layers.0.self_attn.k_proj.weight": (nkv * hd, h),
        "mtp.layers.0.self_attn.v_proj.weight": (nkv * hd, h),
        "mtp.layers.0.self_attn.o_proj.weight": (h, nh * hd),
        "mtp.layers.0.self_attn.q_norm.weight": (hd,),
        "mtp.layers.0.self_attn.k_norm.weight": (hd,),
        "mtp.layers.0.mlp.gate.weight": (cfg.num_experts, h),
        "mtp.layers.0.mlp.shared_expert_gate.weight": (1, h),
    }
    for proj, shape in (("gate_proj", (cfg.shared_expert_intermediate_size, h)),
                        ("up_proj", (cfg.shared_expert_intermediate_size, h)),
                        ("down_proj", (h, cfg.shared_expert_intermediate_size))):
        shapes[f"mtp.layers.0.mlp.shared_expert.{proj}.weight"] = shape
    for e in range(cfg.num_experts):
        shapes[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = (cfg.moe_intermediate_size, h)
        shapes[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = (cfg.moe_intermediate_size, h)
        shapes[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = (h, cfg.moe_intermediate_size)
    path = Path(out_dir) / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for k, shape in sorted(shapes.items()):
        tensors[k] = (0.05 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    save_file(tensors, str(path), metadata=meta)


# ----------------------------------------------------------------------------------------------
# The reference model: architecture from config.json, every tensor from the checkpoint
# ----------------------------------------------------------------------------------------------
def checkpoint_key_to_module(arch, key):
    """Checkpoint names as published -> module names of our linearized model."""
    if arch == "mixtral":
        key = key.replace(".block_sparse_moe.", ".mlp.")
    return key


def load_checkpoint(path):
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def quant_scheme(cfg):
    from compressed_tensors.quantization import QuantizationConfig

    q = cfg.get("quantization_config")
    return None if q is None else QuantizationConfig.model_validate(q)


def module_is_ignored(qcfg, name):
    import re

    for pat in qcfg.ignore or []:
        if pat.startswith("re:") and re.match(pat[3:], name):
            return True
        if pat == name:
            return True
    return False


def dequantize(fmt, local, scheme, dtype):
    """compressed-tensors' own decompression of one module's tensors. Scales are cast to the
    model dtype first, as transformers does at load (so a float32 product is exact)."""
    from compressed_tensors.compressors import BaseCompressor

    local = dict(local)
    for k in ("weight_scale",):
        if k in local and local[k].is_floating_point():
            local[k] = local[k].to(dtype)
    w = BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme)["weight"]
    return w.to(dtype)  # NVFP4 comes back in bf16 whatever the dtype (exact upcast)


class ActQdq:
    """Input fake-quant of one quantized Linear, as compressed-tensors computes it, fed so that
    per-token schemes get one scale per token whatever the input's rank."""

    def __init__(self, args, input_global_scale):
        from compressed_tensors.quantization import QuantizationStatus

        self.args = args
        self.dummy = SimpleNamespace(quantization_status=QuantizationStatus.FROZEN)
        if input_global_scale is not None:
            self.dummy.input_global_scale = input_global_scale

    def __call__(self, x):
        from compressed_tensors.quantization.lifecycle.forward import forward_quantize

        k = x.shape[-1]
        rows = x.reshape(-1, 1, k)  # [tokens, 1, K]: one "sequence" per token
        out = forward_quantize(self.dummy, rows, "input", self.args).reshape(x.shape)
        if self.args.type == "float" and self.args.num_bits == 8 and x.dtype == torch.float32:
            mine = np_act_qdq_fp8_token(x.reshape(-1, k).numpy()).reshape(x.shape)
            FP8_CHECK["elements"] += x.numel()
            FP8_CHECK["bit_identical"] &= bool(np.array_equal(mine.view(np.uint32), out.numpy().view(np.uint32)))
        return out


FP8_CHECK = {"elements": 0, "bit_identical": True}


def np_act_qdq_fp8_token(x):
    """The FP8-dynamic scheme's meaning, one scale per row (token), in numpy float32."""
    table = np.array([_fp8_e4m3fn(v) for v in range(127)], dtype=np.float64)  # 0 .. 448
    amax = np.maximum(np.abs(np.minimum(x.min(-1, keepdims=True), 0)), np.abs(np.maximum(x.max(-1, keepdims=True), 0)))
    scale = (amax / np.float32(448.0)).astype(np.float32)
    scale = np.where(scale == 0, np.float32(np.finfo(np.float32).eps), scale).astype(np.float32)
    q = np.clip((x / scale).astype(np.float32) + np.float32(0.0), -448.0, 448.0).astype(np.float32)
    a = np.abs(q).astype(np.float64)
    idx = np.clip(np.searchsorted(table, a), 1, 126)
    lo, hi = table[idx - 1], table[idx]
    take_hi = (hi - a < a - lo) | ((hi - a == a - lo) & (idx % 2 == 0))
    q = np.copysign(np.where(take_hi, hi, lo), q).astype(np.float32)
    return (q * scale).astype(np.float32)


def _fp8_e4m3fn(v):
    e, m = (v >> 3) & 0xF, v & 0x7
    return (m / 8.0) * 2.0 ** -6 if e == 0 else (1.0 + m / 8.0) * 2.0 ** (e - 7)


def reference_model(path, arch, dtype, act=True):
    """Float `dtype` model with every weight from the checkpoint. Returns (model, info)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    qcfg = quant_scheme(cfg)
    model = build_model(arch, torch.float32, init=False)
    tensors = load_checkpoint(path)
    modules = dict(model.named_modules())
    by_module = {}
    for key, t in tensors.items():
        if key.startswith("mtp."):
            continue  # multi-token prediction: not part of the scoring model (add_mtp_tensors)
        mod_name, local = checkpoint_key_to_module(arch, key).rsplit(".", 1)
        by_module.setdefault(mod_name, {})[local] = t
    hooks, quantized = [], []
    fmt = None if qcfg is None else qcfg.format
    state = {}
    for mod_name, local in sorted(by_module.items()):
        if mod_name not in modules:
            raise KeyError(f"checkpoint module {mod_name} has no counterpart in the model")
        if "weight_scale" not in local:  # not quantized (A_log / dt_bias have no weight at all)
            for k, v in local.items():
                state[f"{mod_name}.{k}"] = v.to(dtype)
            continue
        scheme = qcfg.config_groups["group_0"]
        assert not module_is_ignored(qcfg, mod_name), mod_name
        w = dequantize(fmt, local, scheme, dtype)
        state[f"{mod_name}.weight"] = w
        if "bias" in local:  # GLM-4.5's q/k/v biases stay dense beside the quantized weight
            state[f"{mod_name}.bias"] = local["bias"].to(dtype)
        quantized.append(mod_name)
        if act and scheme.input_activations is not None:
            gs = local.get("input_global_scale")
            qdq = ActQdq(scheme.input_activations, None if gs is None else gs.to(torch.float32))
            hooks.append(modules[mod_name].register_forward_pre_hook(
                lambda m, a, qdq=qdq: (qdq(a[0]),)))
    model = model.to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (model.config.tie_word_embeddings and m == "lm_head.weight")]
    assert not missing and not unexpected, (missing, unexpected)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    return model, {"quantized_modules": quantized, "act_hooks": len(hooks), "tensors": tensors,
                   "qcfg": qcfg}


# ----------------------------------------------------------------------------------------------
# Log-probs, routing records, statistics
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def run_logprobs(model, ids, attn="sdpa"):
    model.config._attn_implementation = attn
    x = torch.tensor([ids], dtype=torch.long)
    logits = model(input_ids=x).logits[0].to(torch.float64)
    lsm = torch.log_softmax(logits, dim=-1)
    tgt = torch.tensor(ids[1:], dtype=torch.long)
    lp = lsm[:-1].gather(1, tgt[:, None])[:, 0]
    return lp.numpy(), logits.argmax(dim=-1).numpy()


@torch.no_grad()
def routing(model, ids):
    """Per MoE layer: the experts each token chose (in top-k order) and the router's margin, the
    gap between the k-th and (k+1)-th softmax probability (a near-tie flips under any rounding)."""
    out = {}
    hooks = []
    for name, mod in model.named_modules():
        if name.endswith("mlp.gate") and hasattr(mod, "e_score_correction_bias"):
            def ds_hook(m, args, res, name=name):
                out[name.removesuffix(".mlp.gate")] = {"experts": res[2].tolist(),
                                                       **deepseek_margins(m, res[0])}
            hooks.append(mod.register_forward_hook(ds_hook))
        elif name.endswith(".router") and hasattr(mod, "per_expert_scale"):
            def g4_hook(m, args, res, name=name):  # Gemma 4: (probabilities, weights, experts)
                top = torch.topk(res[0].to(torch.float32), m.config.top_k_experts + 1, dim=-1)
                out[name.removesuffix(".router")] = {
                    "experts": res[2].tolist(),
                    "margin": (top.values[:, -2] - top.values[:, -1]).tolist(),
                }
            hooks.append(mod.register_forward_hook(g4_hook))
        elif name.endswith("mlp.gate") and hasattr(mod, "topk_method"):
            def v2_hook(m, args, res, name=name):
                out[name.removesuffix(".mlp.gate")] = {"experts": res[2].tolist(),
                                                       **softmax_group_margins(m, res[0], "max")}
            hooks.append(mod.register_forward_hook(v2_hook))
        elif name.endswith("mlp.gate") and type(mod).__name__ == "Mistral4TopkRouter":
            def m4_hook(m, args, res, name=name):
                out[name.removesuffix(".mlp.gate")] = {"experts": res[2].tolist(),
                                                       **softmax_group_margins(m, res[0], "top2")}
            hooks.append(mod.register_forward_hook(m4_hook))
        elif name.endswith("mlp.gate") and hasattr(mod, "top_k"):
            def hook(m, args, res, name=name):
                logits = res[0].to(torch.float32)
                probs = torch.softmax(logits, dim=-1)
                top = torch.topk(probs, m.top_k + 1, dim=-1)
                out[name.removesuffix(".mlp.gate")] = {
                    "experts": res[2].tolist(),
                    "margin": (top.values[:, -2] - top.values[:, -1]).tolist(),
                }
            hooks.append(mod.register_forward_hook(hook))
    model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return out


def deepseek_margins(router, logits):
    """DeepSeek-V3's choice margins, recomputed in f32 as its router chooses: `margin` between
    the k-th and (k+1)-th choice score (sigmoid + correction bias) among the kept groups, and
    `group_margin` between the topk_group-th and next group score (absent with one group)."""
    scores = logits.to(torch.float32).sigmoid()
    choice = scores + router.e_score_correction_bias.to(torch.float32)
    n, g, tg, k = router.num_experts, router.num_group, router.topk_group, router.top_k
    groups = choice.view(-1, g, n // g).topk(2, dim=-1)[0].sum(-1)
    gsorted = groups.sort(dim=-1, descending=True).values
    keep = torch.zeros_like(groups).scatter_(1, groups.topk(tg, dim=-1)[1], 1)
    mask = keep.unsqueeze(-1).expand(-1, g, n // g).reshape(-1, n).bool()
    masked = choice.masked_fill(~mask, float("-inf")).sort(dim=-1, descending=True).values
    rec = {"margin": (masked[:, k - 1] - masked[:, k]).tolist()}
    if tg < g:
        rec["group_margin"] = (gsorted[:, tg - 1] - gsorted[:, tg]).tolist()
    return rec


def softmax_group_margins(router, logits, group_score):
    """DeepSeek-V2's (group score "max") and Mistral 4's ("top2") choice margins, recomputed as
    its router chooses (softmax scores in the logits' dtype, dropped groups masked to 0.0):
    `margin` between the k-th and (k+1)-th masked score, `group_margin` between the
    topk_group-th and next group score (absent with one group)."""
    scores = logits.softmax(-1)
    n, g, tg, k = router.num_experts, router.num_group or 1, router.topk_group or 1, router.top_k
    if getattr(router, "topk_method", None) == "greedy":
        g = tg = 1
    by_group = scores.view(-1, g, n // g)
    groups = by_group.max(-1).values if group_score == "max" else by_group.topk(2, dim=-1)[0].sum(-1)
    gsorted = groups.sort(dim=-1, descending=True).values
    keep = torch.zeros_like(groups).scatter_(1, groups.topk(tg, dim=-1)[1], 1)
    mask = keep.unsqueeze(-1).expand(-1, g, n // g).reshape(-1, n).bool()
    masked = scores.masked_fill(~mask, 0.0).sort(dim=-1, descending=True).values
    rec = {"margin": (masked[:, k - 1] - masked[:, k]).float().tolist()}
    if tg < g:
        rec["group_margin"] = (gsorted[:, tg - 1] - gsorted[:, tg]).float().tolist()
    return rec


NEAR_TIE = 1e-6


def near_ties(routes):
    """Routing near-ties over every sequence and layer: choices whose margin is below NEAR_TIE
    (any rounding difference could flip them)."""
    count = {"threshold": NEAR_TIE, "tokens_x_layers": 0, "expert_boundary": 0,
             "group_boundary": 0, "min_margin": float("inf"), "min_group_margin": None}
    for seq in routes:
        for rec in seq.values():
            m = np.array(rec["margin"])
            count["tokens_x_layers"] += len(m)
            count["expert_boundary"] += int((m < NEAR_TIE).sum())
            count["min_margin"] = min(count["min_margin"], float(m.min()))
            if "group_margin" in rec:
                gm = np.array(rec["group_margin"])
                count["group_boundary"] += int((gm < NEAR_TIE).sum())
                prev = count["min_group_margin"]
                count["min_group_margin"] = float(gm.min()) if prev is None else min(prev, float(gm.min()))
    return count


def seq_record(text, ids, lp, top1):
    return {
        "text": text,
        "token_ids": [int(i) for i in ids],
        "token_logprobs": [None] + [float(v) for v in lp],
        "top1_ids": [int(i) for i in top1],
        "sum_nll": float(-lp.sum()),
        "num_scored": int(len(lp)),
    }


def diff_stats(a_seqs, b_lps):
    a = np.concatenate([np.array(s["token_logprobs"][1:], dtype=np.float64) for s in a_seqs])
    b = np.concatenate([np.asarray(lp, dtype=np.float64) for lp in b_lps])
    d = np.abs(a - b)
    return {
        "mean_nll_delta": float(a.mean() - b.mean()),
        "max": float(d.max()),
        "mean": float(d.mean()),
        "p99": float(np.percentile(d, 99)),
        "median": float(np.median(d)),
        "frac_gt_1e-4": float((d > 1e-4).mean()),
        "frac_gt_1e-3": float((d > 1e-3).mean()),
    }


def mean_nll(seqs):
    return sum(s["sum_nll"] for s in seqs) / sum(s["num_scored"] for s in seqs)


def run_all(model, texts, attn="sdpa"):
    seqs, lps = [], []
    for text, ids in texts:
        lp, top1 = run_logprobs(model, ids, attn)
        seqs.append(seq_record(text, ids, lp, top1))
        lps.append(lp)
    return seqs, lps


def versions():
    import compressed_tensors
    import llmcompressor
    import safetensors
    import tokenizers
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "compressed_tensors": compressed_tensors.__version__,
        "llmcompressor": llmcompressor.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }


def attn_impl(arch):
    # Soft-capped attention logits exist only in the eager path (sdpa has no softcap).
    return "eager" if arch == "gemma2" else "sdpa"


# ----------------------------------------------------------------------------------------------
# Mutations of the hybrid families: one mechanism broken on purpose, as a loader could break it
# ----------------------------------------------------------------------------------------------
def _modules_of(model, suffix):
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith(suffix)]


def _delta_rule_wrapper(model, **override):
    """Replaces the chunked delta rule the Gated DeltaNet layers call (a module global of their
    modeling file) by one that overrides some of its arguments; returns the undo."""
    mods = {sys.modules[type(m).__module__] for _, m in _modules_of(model, "GatedDeltaNet")}
    saved = {mod: mod.torch_chunk_gated_delta_rule for mod in mods}

    def patched(orig):
        def f(query, key, value, g, beta, **kw):
            if override.get("beta_one"):
                beta = torch.ones_like(beta)
            if override.get("decay_zero"):
                g = torch.zeros_like(g)
            if override.get("no_l2norm"):
                kw["use_qk_l2norm_in_kernel"] = False
            return orig(query, key, value, g=g, beta=beta, **kw)
        return f

    for mod, orig in saved.items():
        mod.torch_chunk_gated_delta_rule = patched(orig)
    return lambda: [setattr(mod, "torch_chunk_gated_delta_rule", orig) for mod, orig in saved.items()]


def _set_params(pairs):
    """Sets (param, new value) pairs in place; returns the undo."""
    old = [(p, p.detach().clone()) for p, _ in pairs]
    with torch.no_grad():
        for p, v in pairs:
            p.copy_(v)

    def undo():
        with torch.no_grad():
            for p, v in old:
                p.copy_(v)
    return undo


def _hooks(handles):
    return lambda: [h.remove() for h in handles]


def mut_conv_taps(model):
    """conv1d dropped: each channel keeps only its current-token tap (weight 1), SiLU kept."""
    pairs = []
    for _, m in _modules_of(model, "GatedDeltaNet"):
        w = torch.zeros_like(m.conv1d.weight)
        w[..., -1] = 1.0
        pairs.append((m.conv1d.weight, w))
    return _set_params(pairs)


def mut_conv_silu(model):
    """the conv1d's SiLU dropped (the taps kept)."""
    mods = [m for _, m in _modules_of(model, "GatedDeltaNet")]
    for m in mods:
        m.activation = None
    return lambda: [setattr(m, "activation", model_act(model)) for m in mods]


def model_act(model):
    return model.config.get_text_config().hidden_act


def mut_attn_gate_ignored(model):
    """full attention's sigmoid output gate ignored (attention output straight into o_proj)."""
    handles = []
    for _, m in _modules_of(model, "Attention"):
        if not hasattr(m, "q_proj") or ".visual." in repr(type(m)):
            continue
        box = {}
        hd = m.head_dim

        def grab(mod, args, out, box=box, hd=hd):
            q = out.view(*out.shape[:-1], -1, 2 * hd)
            box["gate"] = q[..., hd:].reshape(*out.shape[:-1], -1)

        def ungate(mod, args, box=box):
            return (args[0] / torch.sigmoid(box["gate"]),)

        handles.append(m.q_proj.register_forward_hook(grab))
        handles.append(m.o_proj.register_forward_pre_hook(ungate, prepend=True))
    return _hooks(handles)


def mut_attn_gate_contiguous(model):
    """q_proj read as [all queries | all gates] instead of [query_h | gate_h] per head."""
    pairs = []
    for _, m in _modules_of(model, "Attention"):
        if not hasattr(m, "q_proj"):
            continue
        w = m.q_proj.weight
        hd = m.head_dim
        nh = w.shape[0] // (2 * hd)
        q, g = w[: nh * hd], w[nh * hd:]
        new = torch.stack([q.view(nh, hd, -1), g.view(nh, hd, -1)], dim=1).reshape(w.shape)
        pairs.append((w, new))
    return _set_params(pairs)


def mut_centred_norm_as_w(model):
    """every (1 + w) RMSNorm read as a plain w multiplier."""
    params = dict(model.named_parameters())
    return _set_params([(params[n], params[n] - 1.0) for n in zero_centred_norms(model)])


def mut_gated_norm_as_1_plus_w(model):
    """the gated RMSNorm of the linear-attention output read as (1 + w)."""
    return _set_params([(m.norm.weight, m.norm.weight + 1.0)
                        for _, m in _modules_of(model, "GatedDeltaNet")])


def mut_full_rotary(model):
    """rotary applied to the whole head_dim instead of partial_rotary_factor of it."""
    cfg = model.config.get_text_config()
    hd = cfg.head_dim
    base = cfg.rope_parameters["rope_theta"]
    mods = [m for n, m in model.named_modules() if n.endswith("rotary_emb") and "visual" not in n]
    saved = [m.inv_freq for m in mods]
    for m in mods:
        m.inv_freq = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    return lambda: [setattr(m, "inv_freq", f) for m, f in zip(mods, saved)]


def mut_shared_gate_dropped(model):
    """the shared expert's sigmoid gate dropped (shared expert added with weight 1)."""
    handles = [m.shared_expert_gate.register_forward_hook(lambda mod, a, out: torch.full_like(out, 40.0))
               for _, m in _modules_of(model, "SparseMoeBlock")]
    return _hooks(handles)


def mut_topk_norm_flipped(model):
    """norm_topk_prob read the other way (top-k weights renormalised or not)."""
    routers = [m for _, m in _modules_of(model, "TopKRouter") if hasattr(m, "norm_topk_prob")]
    for r in routers:
        r.norm_topk_prob = not r.norm_topk_prob
    return lambda: [setattr(r, "norm_topk_prob", not r.norm_topk_prob) for r in routers]


def mut_qkvz_contiguous(model):
    """Qwen3-Next's head-grouped in_proj_qkvz / in_proj_ba read as contiguous [q|k|v|z], [b|a]
    (Qwen3.5's layout)."""
    pairs = []
    for _, m in _modules_of(model, "GatedDeltaNet"):
        n_qkvz, n_ba = m.in_proj_qkvz.weight.shape[0], m.in_proj_ba.weight.shape[0]
        rows = m.fix_query_key_value_ordering(torch.arange(n_qkvz, dtype=torch.float64)[None, None],
                                              torch.arange(n_ba, dtype=torch.float64)[None, None])
        order_qkvz = torch.cat([t.reshape(-1) for t in rows[:4]]).long()
        order_ba = torch.cat([t.reshape(-1) for t in rows[4:]]).long()
        for w, order in ((m.in_proj_qkvz.weight, order_qkvz), (m.in_proj_ba.weight, order_ba)):
            new = torch.empty_like(w)
            new[order] = w  # the grouped reading of `new` is the contiguous reading of `w`
            pairs.append((w, new))
    return _set_params(pairs)


def mut_f32_params_as_bf16(model):
    """the float32-stored A_log and gated-norm weights rounded to bf16 (a uniform bf16 load)."""
    params = [p for n, p in model.named_parameters() if n.endswith(QWEN35_F32_PARAMS)]
    return _set_params([(p, p.to(torch.bfloat16).to(torch.float32)) for p in params])


def _routers(model):
    """The group-limited routers (DeepSeek-V3's, DeepSeek-V2's, Mistral 4's)."""
    return [m for n, m in model.named_modules()
            if hasattr(m, "routed_scaling_factor") and hasattr(m, "num_group")]


def _set_attrs(objs, attr, value):
    """Sets `attr` of every object (to `value(obj)`); returns the undo."""
    saved = [(o, getattr(o, attr)) for o in objs]
    for o in objs:
        setattr(o, attr, value(o))
    return lambda: [setattr(o, attr, v) for o, v in saved]


def mut_correction_bias_ignored(model):
    """e_score_correction_bias ignored (the choice reads the sigmoid scores alone)."""
    return _set_params([(r.e_score_correction_bias, torch.zeros_like(r.e_score_correction_bias))
                        for r in _routers(model) if hasattr(r, "e_score_correction_bias")])


def _softmax_router_forward(self, hidden_states):
    """DeepseekV3TopkRouter.forward with softmax scores instead of sigmoid ones."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    scores = router_logits.softmax(-1)
    choice = scores + self.e_score_correction_bias
    group_scores = choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(-1)
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group).reshape(-1, self.num_experts)
    choice = choice.masked_fill(~mask.bool(), float("-inf"))
    idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, idx)
    if self.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, w * self.routed_scaling_factor, idx


def mut_softmax_scores(model):
    """softmax router scores instead of DeepSeek's sigmoid (choice and weights)."""
    import types

    routers = _routers(model)
    for r in routers:
        r.forward = types.MethodType(_softmax_router_forward, r)
    return lambda: [delattr(r, "forward") for r in routers]


def _v2_router_forward(self, hidden_states, scores_fn=None, group_fn=None, renorm=False):
    """DeepseekV2TopkRouter.forward (group_limited_greedy) with one step replaceable."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    scores = scores_fn(router_logits) if scores_fn else router_logits.softmax(dim=-1, dtype=torch.float32)
    by_group = scores.view(-1, self.num_group, self.num_experts // self.num_group)
    group_scores = group_fn(by_group) if group_fn else by_group.max(dim=-1).values
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group).reshape(-1, self.num_experts)
    w, idx = torch.topk(scores.masked_fill(~mask.bool(), 0.0), k=self.top_k, dim=-1, sorted=False)
    if renorm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, w * self.routed_scaling_factor, idx


def _patch_v2_routers(model, **kw):
    import types

    routers = _routers(model)
    assert all(r.topk_method == "group_limited_greedy" for r in routers)
    for r in routers:
        r.forward = types.MethodType(lambda self, h: _v2_router_forward(self, h, **kw), r)
    return lambda: [delattr(r, "forward") for r in routers]


def mut_v2_sigmoid_scores(model):
    """sigmoid router scores instead of DeepSeek-V2's softmax (choice and weights)."""
    return _patch_v2_routers(model, scores_fn=torch.sigmoid)


def mut_v2_group_top2_sum(model):
    """a group scored by the sum of its two best experts (DeepSeek-V3's) instead of its best."""
    return _patch_v2_routers(model, group_fn=lambda g: g.topk(2, dim=-1)[0].sum(-1))


def mut_v2_renormalised(model):
    """the chosen scores renormalised to sum 1 (norm_topk_prob, which the class never reads)."""
    return _patch_v2_routers(model, renorm=True)


def mut_v2_rope_halves(model):
    """the rotary part rotated as halves (rotate_half) instead of DeepSeek-V2's neighbour pairs."""
    mods = {sys.modules[type(m).__module__] for m in _mla_modules(model)}
    saved = [(mod, mod.apply_rotary_emb) for mod in mods]

    def halves(orig):
        def f(xq, xk, freqs_cis):
            def pairs(x):  # [.., x0..x(d/2-1), x(d/2)..] -> [.., x0, x(d/2), x1, ...]
                d = x.shape[-1]
                return torch.stack([x[..., : d // 2], x[..., d // 2:]], dim=-1).flatten(-2)

            def unpairs(x):
                return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)

            q, k = orig(pairs(xq), pairs(xk), freqs_cis)
            return unpairs(q), unpairs(k)
        return f

    for mod, orig in saved:
        mod.apply_rotary_emb = halves(orig)
    return lambda: [setattr(mod, "apply_rotary_emb", orig) for mod, orig in saved]


def _m4_router_forward(self, hidden_states, scores_fn=None, group_fn=None):
    """Mistral4TopkRouter.forward with one step replaceable."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    scores = scores_fn(router_logits) if scores_fn else router_logits.softmax(-1)
    by_group = scores.view(-1, self.num_group, self.num_experts // self.num_group)
    group_scores = group_fn(by_group) if group_fn else by_group.topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group).reshape(-1, self.num_experts)
    idx = torch.topk(scores.masked_fill(~mask.bool(), 0.0), k=self.top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, idx)
    if self.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, w * self.routed_scaling_factor, idx


def _patch_m4_routers(model, **kw):
    import types

    routers = _routers(model)
    for r in routers:
        r.forward = types.MethodType(lambda self, h: _m4_router_forward(self, h, **kw), r)
    return lambda: [delattr(r, "forward") for r in routers]


def mut_m4_sigmoid_scores(model):
    """sigmoid router scores instead of Mistral 4's softmax (choice and weights)."""
    return _patch_m4_routers(model, scores_fn=torch.sigmoid)


def mut_m4_group_max(model):
    """a group scored by its best expert (DeepSeek-V2's) instead of the sum of its two best."""
    return _patch_m4_routers(model, group_fn=lambda g: g.max(dim=-1).values)


def mut_m4_norm_flipped(model):
    """norm_topk_prob read the other way (the chosen scores not renormalised)."""
    return _set_attrs(_routers(model), "norm_topk_prob", lambda r: not r.norm_topk_prob)


def mut_llama4_scaling_dropped(model):
    """llama-4 query scaling dropped (llama_4_scaling_beta 0: every position scaled by 1)."""
    rope = model.config.rope_parameters
    beta = rope["llama_4_scaling_beta"]
    rope["llama_4_scaling_beta"] = 0.0
    return lambda: rope.__setitem__("llama_4_scaling_beta", beta)


def mut_no_group_limit(model):
    """the group limit dropped (top-k over every expert, n_group = topk_group = 1)."""
    routers = _routers(model)
    undo = [_set_attrs(routers, "num_group", lambda r: 1), _set_attrs(routers, "topk_group", lambda r: 1)]
    return lambda: [u() for u in undo]


def mut_scaling_dropped(model):
    """routed_scaling_factor dropped (routed experts weighted by the renormalised scores)."""
    return _set_attrs(_routers(model), "routed_scaling_factor", lambda r: 1.0)


def mut_shared_experts_dropped(model):
    """the shared experts dropped."""
    handles = [m.register_forward_hook(lambda mod, a, out: torch.zeros_like(out))
               for n, m in model.named_modules() if n.endswith("mlp.shared_experts")]
    return _hooks(handles)


def _mla_modules(model):
    return [m for n, m in model.named_modules() if hasattr(m, "kv_b_proj")]


def mut_mscale_ignored(model):
    """YaRN's mscale(factor, mscale_all_dim)^2 left out of the attention-score scale."""
    return _set_attrs(_mla_modules(model), "scaling", lambda m: m.qk_head_dim ** -0.5)


def mut_rope_interleave_flipped(model):
    """rope_interleave read the other way (interleaved pairs vs rotate_half halves)."""
    cfg = model.config
    return _set_attrs([cfg], "rope_interleave", lambda c: not c.rope_interleave)


def mut_latent_norm_eps(model):
    """the latent norms built with rms_norm_eps instead of their own 1e-6."""
    norms = [m.kv_a_layernorm for m in _mla_modules(model)]
    norms += [m.q_a_layernorm for m in _mla_modules(model) if m.q_a_layernorm is not None]
    return _set_attrs(norms, "variance_epsilon", lambda n: 1e-2)


def _g4_layers(model):
    return list(model.model.layers)


def mut_g4_ple_dropped(model):
    """Gemma 4's per-layer inputs dropped (per_layer_projection zeroed: nothing of them reaches
    the residual stream)."""
    return _set_params([(m.per_layer_projection.weight, torch.zeros_like(m.per_layer_projection.weight))
                        for m in _g4_layers(model)])


def mut_g4_layer_scalar_ignored(model):
    """Gemma 4's layer_scalar buffers read as 1."""
    return _set_params([(m.layer_scalar, torch.ones_like(m.layer_scalar)) for m in _g4_layers(model)])


def mut_g4_kv_shared_from_first_layer(model):
    """Gemma 4's KV-shared layers reading the first layer of their type, not the last unshared."""
    attns = [m.self_attn for m in _g4_layers(model)]
    saved = [a.store_full_length_kv for a in attns]
    shared_from = {}
    for a in attns:
        if not a.is_kv_shared_layer:
            a.store_full_length_kv = a.layer_type not in shared_from
            shared_from.setdefault(a.layer_type, a.layer_idx)

    def undo():
        for a, v in zip(attns, saved):
            a.store_full_length_kv = v
    return undo


def mut_g4_v_norm_dropped(model):
    """Gemma 4's scale-free value norm left out."""
    norms = [m.self_attn.v_norm for m in _g4_layers(model) if hasattr(m.self_attn, "v_norm")]
    for n in norms:
        n.forward = lambda x: x

    def undo():
        for n in norms:
            del n.forward
    return undo


def mut_g4_scaled_scores(model):
    """Gemma 4's attention scores scaled by 1/sqrt(head_dim) (its scaling is 1)."""
    attns = [m.self_attn for m in _g4_layers(model)]
    return _set_attrs(attns, "scaling", lambda a: a.head_dim ** -0.5)


def mut_g4_proportional_as_default(model):
    """Gemma 4's full layers with default RoPE over every pair (not proportional)."""
    rot = model.model.rotary_emb
    buf = rot.full_attention_inv_freq
    dim = 2 * buf.numel()
    theta = model.config.rope_parameters["full_attention"]["rope_theta"]
    plain = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return _set_params([(buf, plain)])


def mut_g4_final_softcap_dropped(model):
    """Gemma 4's final logit soft-capping left out."""
    return _set_attrs([model.config], "final_logit_softcapping", lambda c: None)


def mut_g4_norms_one_plus_w(model):
    """Gemma 4's norms read as Gemma 3's (1 + w)."""
    norms = [m for m in model.modules() if type(m).__name__ == "Gemma4RMSNorm" and m.with_scale]
    return _set_params([(n.weight, n.weight + 1.0) for n in norms])


def mut_g4_per_expert_scale_ignored(model):
    """Gemma 4's router per_expert_scale read as 1."""
    return _set_params([(m.router.per_expert_scale, torch.ones_like(m.router.per_expert_scale))
                        for m in _g4_layers(model)])


def mut_g4_router_scale_ignored(model):
    """Gemma 4's router input scale read as 1."""
    return _set_params([(m.router.scale, torch.ones_like(m.router.scale)) for m in _g4_layers(model)])


def mut_g4_experts_dropped(model):
    """Gemma 4's expert branch left out (the dense MLP alone)."""
    hooks = [m.experts.register_forward_hook(lambda mod, a, out: torch.zeros_like(out))
             for m in _g4_layers(model)]
    return _hooks(hooks)


MUTATIONS = {
    "conv1d_taps_dropped": (mut_conv_taps, "any"),
    "conv1d_silu_dropped": (mut_conv_silu, "any"),
    "decay_gate_ignored": (lambda m: _delta_rule_wrapper(m, decay_zero=True), "any"),
    "beta_ignored": (lambda m: _delta_rule_wrapper(m, beta_one=True), "any"),
    "qk_l2norm_dropped": (lambda m: _delta_rule_wrapper(m, no_l2norm=True), "any"),
    "attn_output_gate_ignored": (mut_attn_gate_ignored, "any"),
    "attn_gate_read_contiguous": (mut_attn_gate_contiguous, "any"),
    "zero_centred_norms_read_as_w": (mut_centred_norm_as_w, "any"),
    "gated_norm_read_as_1_plus_w": (mut_gated_norm_as_1_plus_w, "any"),
    "full_instead_of_partial_rotary": (mut_full_rotary, "any"),
    "shared_expert_gate_dropped": (mut_shared_gate_dropped, "moe"),
    "norm_topk_prob_flipped": (mut_topk_norm_flipped, "next"),
    "qkvz_ba_read_contiguous": (mut_qkvz_contiguous, "next"),
    "f32_params_rounded_to_bf16": (mut_f32_params_as_bf16, "f32_params"),
    "correction_bias_ignored": (mut_correction_bias_ignored, "sigmoid_router"),
    "softmax_instead_of_sigmoid": (mut_softmax_scores, "sigmoid_router"),
    "sigmoid_instead_of_softmax": (mut_v2_sigmoid_scores, "v2_router"),
    "group_top2_sum_instead_of_max": (mut_v2_group_top2_sum, "v2_router"),
    "weights_renormalised": (mut_v2_renormalised, "v2_router"),
    "rope_halves_instead_of_pairs": (mut_v2_rope_halves, "v2_rope"),
    "m4_sigmoid_instead_of_softmax": (mut_m4_sigmoid_scores, "m4_router"),
    "m4_group_max_instead_of_top2_sum": (mut_m4_group_max, "m4_router"),
    "m4_norm_topk_prob_flipped": (mut_m4_norm_flipped, "m4_router"),
    "llama_4_scaling_dropped": (mut_llama4_scaling_dropped, "m4_router"),
    "no_group_limit": (mut_no_group_limit, "deepseek_groups"),
    "routed_scaling_factor_dropped": (mut_scaling_dropped, "deepseek"),
    "shared_experts_dropped": (mut_shared_experts_dropped, "deepseek"),
    "mscale_ignored": (mut_mscale_ignored, "mla_yarn"),
    "rope_interleave_flipped": (mut_rope_interleave_flipped, "mla_interleave_key"),
    "latent_norm_eps_1e-2": (mut_latent_norm_eps, "mla"),
    "full_instead_of_partial_rotary_glm": (mut_full_rotary, "partial"),
    "per_layer_inputs_dropped": (mut_g4_ple_dropped, "gemma4_ple"),
    "kv_shared_from_first_layer": (mut_g4_kv_shared_from_first_layer, "gemma4_ple"),
    "layer_scalar_ignored": (mut_g4_layer_scalar_ignored, "gemma4"),
    "v_norm_dropped": (mut_g4_v_norm_dropped, "gemma4"),
    "scores_scaled_by_rsqrt_head_dim": (mut_g4_scaled_scores, "gemma4"),
    "proportional_rope_as_default": (mut_g4_proportional_as_default, "gemma4"),
    "final_logit_softcapping_dropped": (mut_g4_final_softcap_dropped, "gemma4"),
    "norms_read_as_1_plus_w": (mut_g4_norms_one_plus_w, "gemma4"),
    "per_expert_scale_ignored": (mut_g4_per_expert_scale_ignored, "gemma4_moe"),
    "router_scale_ignored": (mut_g4_router_scale_ignored, "gemma4_moe"),
    "experts_dropped": (mut_g4_experts_dropped, "gemma4_moe"),
}


def mutation_applies(kind, arch):
    spec = ARCHS[arch]
    if is_gemma4(arch):
        return {
            "gemma4": True,
            "gemma4_ple": arch == "gemma4",
            "gemma4_moe": arch == "gemma4_moe",
        }.get(kind, False)
    if is_deepseek(arch):
        mla = arch != "glm4_moe"
        rope = spec["kw"].get("rope_parameters", {})
        return {
            "deepseek": True,
            "sigmoid_router": has_correction_bias(arch),
            "v2_router": arch == "deepseek_v2",
            "v2_rope": arch == "deepseek_v2",
            "m4_router": arch == "mistral4",
            "mla_interleave_key": mla and arch != "deepseek_v2",
            "deepseek_groups": spec["kw"].get("topk_group", 1) < spec["kw"].get("n_group", 1),
            "mla": mla,
            "mla_yarn": mla and rope.get("rope_type") == "yarn",
            "partial": not mla,
        }.get(kind, False)
    return {
        "any": True,
        "moe": "experts" in spec,
        "next": arch == "qwen3_next",
        "f32_params": bool(spec.get("f32_params")),
    }.get(kind, False)


def mutation_references(path, arch, texts, attn):
    """Log-prob shifts of each mutation on the weights-only float32 reference (so activation
    quantization plays no part): the f32 noise floor is numerics.eager_vs_sdpa_f32."""
    model, _ = reference_model(path, arch, torch.float32, act=False)
    base, _ = run_all(model, texts, attn)
    out = {}
    for name, (fn, kind) in MUTATIONS.items():
        if not mutation_applies(kind, arch):
            continue
        undo = fn(model)
        try:
            _, lps = run_all(model, texts, attn)
        finally:
            undo()
        out[name] = {"description": fn.__doc__.strip() if fn.__doc__ else name, **diff_stats(base, lps)}
        assert out[name]["max"] > (1e-5 if kind == "f32_params" else 1e-3), (name, out[name])
    _, lps = run_all(model, texts, attn)  # every undo restored the model
    assert diff_stats(base, lps)["max"] == 0.0
    del model
    return out


def compute_reference(name, spec, path, texts):
    arch, act = spec["arch"], spec.get("act", False)
    FP8_CHECK.update(elements=0, bit_identical=True)
    attn = attn_impl(arch)
    res = {"variant": name, "architecture": ARCHS[arch]["model"], "torch_dtype_used": "float32"}
    m32, info = reference_model(path, arch, torch.float32, act=True)
    seqs, _ = run_all(m32, texts, attn)
    res["sequences"] = seqs
    numerics = {"attn_implementation": attn,
                "logits_dtype": "float32 (model output), upcast to float64 before log_softmax"}
    if act:
        res["reference_mode"] = "with_activation_quant (per-token for fp8 dynamic)"
        m_w, _ = reference_model(path, arch, torch.float32, act=False)
        seqs_w, lps_w = run_all(m_w, texts, attn)
        res["weights_only"] = {
            "description": "same float32 model without activation fake-quantization",
            "sequences": seqs_w,
            "mean_nll": mean_nll(seqs_w),
        }
        numerics["with_vs_without_act_quant"] = diff_stats(seqs, lps_w)
    else:
        res["reference_mode"] = "weights_only (no activation quantization in this scheme)"
    if "experts" in ARCHS[arch]:
        numerics["linear_experts_vs_fused_f32"] = linear_vs_fused(m_w if act else m32, texts, attn)
        res["routing"] = [routing(m32, ids) for _, ids in texts]
        if act:
            res["weights_only"]["routing"] = [routing(m_w, ids) for _, ids in texts]
    # another float32 summation order (eager vs sdpa or the reverse): how closely any
    # independent float32 implementation can be expected to match
    other = "sdpa" if attn == "eager" else "eager"
    if arch != "gemma2":
        _, lps_other = run_all(m32, texts, other)
        numerics[f"{other}_vs_{attn}_f32"] = diff_stats(seqs, lps_other)
    if arch == "gemma2":
        # the soft-caps matter: scores without them
        m32.config.final_logit_softcapping = None
        _, lps_nocap = run_all(m32, texts, attn)
        numerics["without_final_logit_softcapping"] = diff_stats(seqs, lps_nocap)
        m32.config.final_logit_softcapping = ARCHS[arch]["kw"]["final_logit_softcapping"]
        attns = [layer.self_attn for layer in m32.model.layers]
        for a in attns:
            a.attn_logit_softcapping = None
        _, lps_nocap = run_all(m32, texts, attn)
        numerics["without_attn_logit_softcapping"] = diff_stats(seqs, lps_nocap)
        for a in attns:
            a.attn_logit_softcapping = ARCHS[arch]["kw"]["attn_logit_softcapping"]
    if is_gemma(arch):
        # the window matters: sequences 1-3 are longer than it
        window = m32.config.sliding_window
        m32.config.sliding_window = 1 << 20
        _, lps_full = run_all(m32, texts, attn)
        numerics["without_sliding_window"] = diff_stats(seqs, lps_full)
        m32.config.sliding_window = window
    if "experts" not in ARCHS[arch]:
        mp = from_pretrained(path, torch.float32, attn)
        _, lps_fp = run_all(mp, texts, attn)
        numerics["manual_vs_from_pretrained_f32"] = diff_stats(seqs, lps_fp)
        del mp
    if "text_kw" in ARCHS[arch]:
        numerics["text_only_class_vs_conditional_generation_f32"] = text_only_vs_composite(
            m_w if act else m32, texts, attn)
    if is_hybrid(arch) or is_deepseek(arch) or is_gemma4(arch):
        res["mutations"] = mutation_references(path, arch, texts, attn)
    if is_deepseek(arch) or "routing" in res:
        res["routing_near_ties"] = near_ties(res["routing"])
        if act:
            res["weights_only"]["routing_near_ties"] = near_ties(res["weights_only"]["routing"])
    # bf16 run: the same construction in bfloat16 (activation quant as in `sequences`)
    m16, _ = reference_model(path, arch, torch.bfloat16, act=True)
    seqs16, lps16 = run_all(m16, texts, attn)
    res["bf16_run"] = {
        "description": "the same reference construction in bfloat16 on CPU; logits upcast to "
        "float64 before log_softmax",
        "diff_stats_vs_f32": diff_stats(seqs, lps16),
        "sequences": [{"token_logprobs": s["token_logprobs"], "sum_nll": s["sum_nll"]} for s in seqs16],
    }
    if arch == "mistral4":
        # its router runs in bf16 here: margins of 0 are exact bf16 ties, which torch.topk
        # breaks in an order of its own
        res["bf16_run"]["routing_near_ties"] = near_ties([routing(m16, ids) for _, ids in texts])
    res["numerics"] = numerics
    res["mean_nll"] = mean_nll(seqs)
    if act and FP8_CHECK["elements"]:
        res["activation_qdq_verification"] = {
            "description": "per-token fp8 QDQ of compressed-tensors fed [tokens, 1, K] against "
            "a numpy one-scale-per-row implementation, on every quantized Linear input",
            **FP8_CHECK,
        }
    res["versions"] = versions()
    dq = None
    if info["qcfg"] is not None:
        dq = dequant_checks(path, arch, info)
        res["dequant_verification"] = dq["verification"]
    del m32, m16
    gc.collect()
    return res, (None if dq is None else dq["modules"])


def linear_vs_fused(linear, texts, attn):
    """Our per-expert model against transformers' own fused experts holding the same weights."""
    arch = next(a for a, s in ARCHS.items()
                if s["model"] == type(linear).__name__ and "experts" in s)
    import transformers

    spec = ARCHS[arch]
    cfg = linear.config
    fused = getattr(transformers, spec["model"])(cfg).to(torch.float32).eval()
    state = {}
    for name, t in linear.state_dict().items():
        if ".experts." not in name:
            state[name] = t
    for name, mod in linear.named_modules():
        if isinstance(mod, LinearExperts):
            gate, up, down = spec["experts"]
            state[f"{name}.gate_up_proj"] = torch.stack(
                [torch.cat([getattr(e, gate).weight, getattr(e, up).weight]) for e in mod])
            state[f"{name}.down_proj"] = torch.stack([getattr(e, down).weight for e in mod])
    fused.load_state_dict(state, strict=True)
    seqs, _ = run_all(linear, texts, attn)
    _, lps = run_all(fused, texts, attn)
    return diff_stats(seqs, lps)


def text_only_vs_composite(composite, texts, attn):
    """The ForConditionalGeneration reference against its text-only ForCausalLM class holding the
    same weights (model.language_model.* -> model.*): text-only positions through mrope are the
    plain positions, so 0.0 is expected."""
    import transformers

    name = type(composite).__name__.replace("ForConditionalGeneration", "ForCausalLM")
    text = getattr(transformers, name)(composite.config.get_text_config()).to(torch.float32).eval()
    arch = next(a for a, s in ARCHS.items() if s["model"] == type(composite).__name__)
    if "experts" in ARCHS[arch]:
        linearize_experts(text, ARCHS[arch]["experts"])
    state = {}
    for k, v in composite.state_dict().items():
        if k.startswith("model.language_model."):
            state["model." + k.removeprefix("model.language_model.")] = v
        elif not k.startswith("model.visual."):
            state[k] = v
    text.load_state_dict(state, strict=True)
    hooks = [h for h in composite.modules() if h._forward_pre_hooks]
    assert not hooks, "compare weights-only models"
    seqs, _ = run_all(composite, texts, attn)
    _, lps = run_all(text, texts, attn)
    return diff_stats(seqs, lps)


def from_pretrained(path, dtype, attn):
    """A plain transformers load (compressed-tensors decompresses); NVFP4 weights come back in
    bf16 whatever the dtype and are upcast (exact)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=attn)
    m.eval()
    hq = getattr(m, "hf_quantizer", None)
    if hq is not None and hasattr(m, "ct_decompress_hook"):
        hq.compressor.decompress_model(m)
    for mod in m.modules():
        w = getattr(mod, "weight", None)
        if getattr(mod, "quantization_scheme", None) is not None and w is not None and w.dtype != dtype:
            mod.weight.data = w.data.to(dtype)
    return m


def dequant_checks(path, arch, info):
    """Checksums of every dequantized (float32) Linear weight; for the dense architectures also
    a bit comparison with what transformers + compressed-tensors load."""
    m32, _ = reference_model(path, arch, torch.float32, act=False)
    sd = m32.state_dict()
    modules = {}
    for p in info["quantized_modules"]:
        w = sd[p + ".weight"].numpy()
        modules[p] = {
            "shape": list(w.shape),
            "sha256_f32_le": hashlib.sha256(np.ascontiguousarray(w).tobytes()).hexdigest(),
            "sum_f64": float(w.astype(np.float64).sum()),
            "sum_abs_f64": float(np.abs(w.astype(np.float64)).sum()),
            "row0_first8": [float(x) for x in w[0, :8]],
            "last_row_last8": [float(x) for x in w[-1, -8:]],
        }
    ver = {"format": info["qcfg"].format, "num_modules": len(modules)}
    if "experts" not in ARCHS[arch]:
        fp = from_pretrained(path, torch.float32, "sdpa").state_dict()
        ver["bit_identical_to_from_pretrained_f32"] = all(
            np.array_equal(sd[p + ".weight"].numpy().view(np.uint32), fp[p + ".weight"].numpy().view(np.uint32))
            for p in modules)
    del m32
    return {"modules": modules, "verification": ver}


def fmt_json(obj):
    return json.dumps(obj, indent=1, ensure_ascii=False, allow_nan=False)


def dir_size(p):
    return sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    ap.add_argument("--stage", default="all", choices=["all", "refs"])
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    texts = make_texts(tok)
    work = Path(tempfile.mkdtemp(prefix="arch-fixtures-"))  # fresh: dense bases are rebuilt
    names = list(VARIANTS) if not args.only else args.only.split(",")
    summary_path = FIXTURES / "arch_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    for name in names:
        spec = VARIANTS[name]
        t0 = time.time()
        if args.stage == "all":
            build_variant(name, spec, tok, work)
        path = FIXTURES / name
        ref, modules = compute_reference(name, spec, path, texts)
        (path / "reference.json").write_text(fmt_json(ref) + "\n")
        if modules is not None:
            (path / "dequant_check.json").write_text(fmt_json(modules) + "\n")
        summary[name] = {
            "mean_nll": ref["mean_nll"],
            "weights_only_mean_nll": ref.get("weights_only", {}).get("mean_nll"),
            "bf16_vs_f32": ref["bf16_run"]["diff_stats_vs_f32"],
            **ref["numerics"],
            "dequant": ref.get("dequant_verification"),
            **({"mutations_mean_abs_dlogprob": {k: v["mean"] for k, v in ref["mutations"].items()}}
               if "mutations" in ref else {}),
            **({"routing_near_ties": ref["routing_near_ties"]} if "routing_near_ties" in ref else {}),
            "size_bytes": dir_size(path),
        }
        print(f"[{name}] mean NLL {ref['mean_nll']:.4f}, {dir_size(path) / 1e6:.2f} MB, "
              f"{time.time() - t0:.1f}s", flush=True)
    summary["_versions"] = versions()
    summary_path.write_text(fmt_json(dict(sorted(summary.items()))) + "\n")


if __name__ == "__main__":
    main()
