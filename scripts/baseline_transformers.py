#!/usr/bin/env python3
"""Baseline for exactscore-bench: HF transformers scoring 2048-token windows of a random-weight
model of the same shape (bf16, sdpa), log_softmax + gather of the targets on the GPU, the way
an evaluation script using transformers does it. Prints one table row per batch size.
`--weights FORMAT` gives the decoder Linears (and a mixture of experts' experts) the
dequantized values of a random FORMAT checkpoint: transformers decompresses a quantized model
to such bf16 weights, and they (through the activations they produce) change the GEMMs' power
draw and so their speed under the power cap (H100: 4-6 %). `--linears-only` times the Linears'
GEMMs alone.

Shapes (random_model.rs has the same): llama3-8b, llama3-70b; qwen3-30b-a3b (Qwen3MoeForCausalLM:
128 experts of 768, 8 per token, run by transformers' default experts implementation unless
`--experts` names one); gemma3-27b (Gemma3ForCausalLM: windows of 1024 on 5 of 6 layers);
qwen3.5-35b-a3b (Qwen3_5MoeForCausalLM, the text model of the release), qwen3-next-80b-a3b
(Qwen3NextForCausalLM), qwen3.5-27b (Qwen3_5ForCausalLM): Gated DeltaNet layers with a gated
full-attention layer every 4th, run by whatever transformers picks for the conv1d and the delta
rule (its hub kernels where it can fetch them, else the torch fallbacks; the table's header says
whether `fla` and `causal_conv1d` are installed); tiny, tiny-moe, tiny-gemma3, tiny-qwen3.5-moe,
tiny-qwen3-next, tiny-qwen3.5 for a smoke run (`--device cpu`); deepseek-v2-lite
(DeepseekV2ForCausalLM), glm-4.7-flash (Glm4MoeLiteForCausalLM): latent attention (MLA) run by
transformers' eager expansion to per-head keys and values and sdpa; glm-4.5-air
(Glm4MoeForCausalLM); all three DeepSeek's mixture (transformers' fused experts, routed as the
releases' configs say, the first layer dense); gemma4-26b-a4b (Gemma4ForCausalLM with a text
config: 128 experts of 704 beside a dense MLP of 2112 in every layer) and gemma4-31b (dense);
tiny-deepseek-v2, tiny-glm4-moe-lite, tiny-glm4-moe, tiny-gemma4, tiny-gemma4-moe for a smoke
run. W4A16 weights use the group size random_model.rs `w4a16_group` gives the shape (128, or
64 where 128 does not divide a Linear's input: 10944, 2112, 704). The shapes other than Llama
are built directly in bf16 (their f32 init would not fit an 80 GB GPU), draw their embeddings
and routers as exactscore-bench draws them (the router's logits set how the tokens spread over
the experts), and score the lm_head in chunks of `--logits-chunk` rows (the whole batch's f32
logits would not fit next to the weights: 8 windows of Gemma's 262k vocabulary are 17 GB).
`AutoModelForCausalLM.from_pretrained` also loads what `exactscore-bench write-checkpoint`
writes for these shapes (the Qwen3.5 ones as `Qwen3_5MoeForCausalLM` / `Qwen3_5ForCausalLM`
from the ForConditionalGeneration file, transformers 5.17), but this script builds the model
itself, as above.

    python3 scripts/baseline_transformers.py --shape llama3-8b --batch 1,4 --weights w4a16
    python3 scripts/baseline_transformers.py --shape qwen3-30b-a3b --batch 1,8 --weights w4a16
"""
import argparse
import importlib.util
import time

import torch
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, Gemma3ForCausalLM,
                          Gemma3TextConfig, Gemma4ForCausalLM, Gemma4TextConfig, Glm4MoeConfig,
                          Glm4MoeForCausalLM, Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM,
                          LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM,
                          Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3NextConfig,
                          Qwen3NextForCausalLM)


def llama(**kw):
    return LlamaForCausalLM, LlamaConfig(**kw, rms_norm_eps=1e-5, max_position_embeddings=131072,
                                         rope_theta=500000.0, tie_word_embeddings=False)


def qwen3_moe(**kw):
    return Qwen3MoeForCausalLM, Qwen3MoeConfig(
        **kw, rms_norm_eps=1e-6,
        max_position_embeddings=40960, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def gemma3(**kw):
    layers = kw["num_hidden_layers"]
    return Gemma3ForCausalLM, Gemma3TextConfig(
        **kw, rms_norm_eps=1e-6, max_position_embeddings=131072,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        final_logit_softcapping=None, attn_logit_softcapping=None,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                     for i in range(layers)],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


def hybrid(config_class, qwen3_5, **kw):
    """The Qwen3-Next family's keys (random_model.rs `Hybrid`, as the releases' config.json):
    every 4th layer gated full attention, the others Gated DeltaNet; a quarter of each head
    rotary at 1e7 (Qwen3.5's mrope sections: text scoring reads them as the plain rope)."""
    layers, head_dim = kw["num_hidden_layers"], kw["head_dim"]
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    if qwen3_5:
        half = head_dim // 8  # rotary frequencies: head_dim * 0.25 / 2
        rope.update(mrope_section=[-(-half // 3), (half + 1) // 3, half // 3],
                    mrope_interleaved=True)
    return config_class(
        **kw, rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
        hidden_act="silu", linear_conv_kernel_dim=4, rope_parameters=rope,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                     for i in range(layers)])


def qwen3_next(**kw):
    return Qwen3NextForCausalLM, hybrid(Qwen3NextConfig, False, **kw, norm_topk_prob=True,
                                        decoder_sparse_step=1, mlp_only_layers=[])


def qwen3_5_moe(**kw):
    return Qwen3_5MoeForCausalLM, hybrid(Qwen3_5MoeTextConfig, True, **kw)


def qwen3_5(**kw):
    return Qwen3_5ForCausalLM, hybrid(Qwen3_5TextConfig, True, **kw)


def deepseek_moe(experts, per_token, expert_intermediate, shared, scaling):
    """DeepSeek's mixture as random_model.rs `DeepseekMoe`: one expert group, the first layer
    dense."""
    return dict(n_routed_experts=experts, num_experts_per_tok=per_token,
                moe_intermediate_size=expert_intermediate, n_shared_experts=shared,
                routed_scaling_factor=scaling, n_group=1, topk_group=1, hidden_act="silu",
                tie_word_embeddings=False, attention_bias=False)


def mla(q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v):
    return dict(q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope,
                qk_rope_head_dim=qk_rope, v_head_dim=v)


def deepseek_v2(**kw):
    return DeepseekV2ForCausalLM, DeepseekV2Config(
        **kw, rms_norm_eps=1e-6, max_position_embeddings=163840, topk_method="greedy",
        norm_topk_prob=False, first_k_dense_replace=1, head_dim=kw["qk_rope_head_dim"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})


def glm4_moe_lite(**kw):
    layers = kw["num_hidden_layers"]
    return Glm4MoeLiteForCausalLM, Glm4MoeLiteConfig(
        **kw, rms_norm_eps=1e-5, max_position_embeddings=202752, norm_topk_prob=True,
        rope_interleave=True, mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def glm4_moe(**kw):
    return Glm4MoeForCausalLM, Glm4MoeConfig(
        **{**kw, "attention_bias": True}, rms_norm_eps=1e-5, max_position_embeddings=131072,
        norm_topk_prob=True, use_qk_norm=False, first_k_dense_replace=1,
        partial_rotary_factor=0.5, num_nextn_predict_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})


def gemma4(**kw):
    """random_model.rs `Arch::Gemma4`: 5 sliding layers then a global one whose keys are its
    values, no per-layer inputs, softcap 30."""
    layers, experts = kw["num_hidden_layers"], kw.get("num_experts")
    return Gemma4ForCausalLM, Gemma4TextConfig(
        **kw, rms_norm_eps=1e-6, max_position_embeddings=262144,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        final_logit_softcapping=30.0, attention_k_eq_v=True, hidden_size_per_layer_input=0,
        num_kv_shared_layers=0, use_double_wide_mlp=False, enable_moe_block=experts is not None,
        vocab_size_per_layer_input=kw["vocab_size"],
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                     for i in range(layers)],
        rope_parameters={
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


TINY_DEEPSEEK = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=4, vocab_size=2000,
                     **deepseek_moe(8, 2, 128, 1, 1.5))
TINY_GEMMA4 = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
                   num_global_key_value_heads=1, vocab_size=2000, sliding_window=128)

# The published configs' sizes (random_model.rs cites them): attention 16/2 heads of 256 (24/4
# for the 27B), linear attention 16 key heads and 32 value heads (48 for the 27B) of 128.
LINEAR = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
              linear_value_head_dim=128)
TINY_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                   linear_value_head_dim=32)
TINY_HYBRID = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, vocab_size=2000, **TINY_LINEAR)
TINY_SHARED_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                       shared_expert_intermediate_size=128)

# shape: (the model class and config, lm_head rows per chunk: 0 = the whole batch's logits)
SHAPES = {
    "llama3-8b": (lambda: llama(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8,
                                vocab_size=128256), 0),
    "llama3-70b": (lambda: llama(hidden_size=8192, intermediate_size=28672,
                                 num_hidden_layers=80, num_attention_heads=64,
                                 num_key_value_heads=8, vocab_size=128256), 0),
    "qwen3-30b-a3b": (lambda: qwen3_moe(hidden_size=2048, intermediate_size=6144,
                                        num_hidden_layers=48, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128, num_experts=128,
                                        num_experts_per_tok=8, moe_intermediate_size=768,
                                        vocab_size=151936), 2048),
    "gemma3-27b": (lambda: gemma3(hidden_size=5376, intermediate_size=21504,
                                  num_hidden_layers=62, num_attention_heads=32,
                                  num_key_value_heads=16, head_dim=128, vocab_size=262208,
                                  query_pre_attn_scalar=168, sliding_window=1024), 2048),
    "qwen3.5-35b-a3b": (lambda: qwen3_5_moe(
        hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, vocab_size=248320, **LINEAR), 2048),
    "qwen3-next-80b-a3b": (lambda: qwen3_next(
        hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=151936,
        **LINEAR), 2048),
    "qwen3.5-27b": (lambda: qwen3_5(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, vocab_size=248320,
        **{**LINEAR, "linear_num_value_heads": 48}), 2048),
    "tiny": (lambda: llama(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=2000), 0),
    "tiny-moe": (lambda: qwen3_moe(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   num_experts=8,
                                   num_experts_per_tok=2, moe_intermediate_size=128,
                                   vocab_size=2000), 2048),
    "tiny-gemma3": (lambda: gemma3(hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   vocab_size=2000, query_pre_attn_scalar=64,
                                   sliding_window=128), 2048),
    "tiny-qwen3.5-moe": (lambda: qwen3_5_moe(**TINY_HYBRID, **TINY_SHARED_MOE), 2048),
    "tiny-qwen3-next": (lambda: qwen3_next(**TINY_HYBRID, **TINY_SHARED_MOE,
                                           intermediate_size=512), 2048),
    "tiny-qwen3.5": (lambda: qwen3_5(**TINY_HYBRID, intermediate_size=512), 2048),
    "deepseek-v2-lite": (lambda: deepseek_v2(
        hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=102400, **mla(None, 512, 128, 64, 128),
        **deepseek_moe(64, 6, 1408, 2, 1.0)), 2048),
    "glm-4.7-flash": (lambda: glm4_moe_lite(
        hidden_size=2048, intermediate_size=10240, num_hidden_layers=47, num_attention_heads=20,
        num_key_value_heads=20, vocab_size=154880, **mla(768, 512, 192, 64, 256),
        **deepseek_moe(64, 4, 1536, 1, 1.8)), 2048),
    "glm-4.5-air": (lambda: glm4_moe(
        hidden_size=4096, intermediate_size=10944, num_hidden_layers=46, num_attention_heads=96,
        num_key_value_heads=8, head_dim=128, vocab_size=151552,
        **deepseek_moe(128, 8, 1408, 1, 1.0)), 2048),
    "gemma4-26b-a4b": (lambda: gemma4(
        hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
        vocab_size=262144, sliding_window=1024, num_experts=128, top_k_experts=8,
        moe_intermediate_size=704), 2048),
    "gemma4-31b": (lambda: gemma4(
        hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
        num_key_value_heads=16, head_dim=256, global_head_dim=512, num_global_key_value_heads=4,
        vocab_size=262144, sliding_window=1024), 2048),
    "tiny-deepseek-v2": (lambda: deepseek_v2(**TINY_DEEPSEEK, **mla(None, 64, 32, 16, 32)), 2048),
    "tiny-glm4-moe-lite": (lambda: glm4_moe_lite(**TINY_DEEPSEEK, **mla(64, 64, 48, 16, 64)),
                           2048),
    "tiny-glm4-moe": (lambda: glm4_moe(**{**TINY_DEEPSEEK, "num_key_value_heads": 2},
                                       head_dim=64), 2048),
    "tiny-gemma4": (lambda: gemma4(**TINY_GEMMA4), 2048),
    "tiny-gemma4-moe": (lambda: gemma4(**TINY_GEMMA4, num_experts=8, top_k_experts=2,
                                       moe_intermediate_size=128), 2048),
}
# mixtures of experts, whose experts are no Linears in transformers 5
MOE_CLASSES = (Qwen3MoeForCausalLM, Qwen3NextForCausalLM, Qwen3_5MoeForCausalLM,
               DeepseekV2ForCausalLM, Glm4MoeLiteForCausalLM, Glm4MoeForCausalLM)

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
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
                     "these weights (not for a mixture of experts, whose experts are no Linears)")
ap.add_argument("--logits-chunk", type=int, default=None,
                help="lm_head rows scored at once (0: the whole batch's logits in one tensor); "
                     "default: 0 for Llama, 2048 for the other shapes")
ap.add_argument("--experts", default=None,
                help="transformers' experts implementation (eager, grouped_mm, batched_mm); "
                     "default: transformers' own choice")
ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of a tiny shape")
args = ap.parse_args()

build, default_chunk = SHAPES[args.shape]
model_class, cfg = build()
chunk = default_chunk if args.logits_chunk is None else args.logits_chunk
llama_shape = model_class is LlamaForCausalLM
moe = model_class in MOE_CLASSES or getattr(cfg, "enable_moe_block", False)
if args.linears_only and moe:
    ap.error("--linears-only: a mixture of experts' experts are not Linears in transformers 5")
dev = torch.device(args.device)
cuda = dev.type == "cuda"
torch.manual_seed(0)
# The Llama shapes as before (f32 init, then bf16); the others in bf16 from the start.
torch.set_default_dtype(torch.float32 if llama_shape else torch.bfloat16)
with dev:
    model = model_class(cfg).to(torch.bfloat16).eval()
torch.set_default_dtype(torch.float32)
model.config._attn_implementation = "sdpa"
if args.experts:
    model.set_experts_implementation(args.experts)


def random_float(shape, exponents, mantissa_bits):
    """2^e * (1 + m / 2^mantissa_bits), e uniform in `exponents`, m a random mantissa: the
    bench's bf16 (7 bits) and e4m3 (3 bits) values."""
    e = torch.randint(exponents[0], exponents[1], shape, device=dev).float()
    m = torch.randint(0, 2 ** mantissa_bits, shape, device=dev)
    return (1 + m / 2 ** mantissa_bits) * torch.exp2(e)


FP4_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def dequantized(kind, out_features, in_features, shift=0):
    """A decoder Linear's weight as transformers holds it after decompressing a random
    checkpoint of `kind`, with exactscore-bench's distributions (random_model.rs): the values,
    and the activations they lead to, set how much power (and so clock) the GEMMs get. `shift`:
    scales 2^-shift smaller (random_model.rs `scale_shift`: a mixture's residual writers)."""
    shape = (out_features, in_features)
    if kind == "w4a16":  # int4 codes, one scale per GROUP inputs in 2^-8..2^-6
        groups = in_features // GROUP
        codes = torch.randint(-8, 8, (out_features, groups, GROUP), device=dev)
        w = codes * random_float((out_features, groups, 1), (-8 - shift, -6 - shift), 7)
    elif kind == "nvfp4":  # e2m1 codes, e4m3 block scales in 16..240 per 16, global 20000
        codes = torch.tensor(FP4_E2M1, device=dev)[
            torch.randint(0, 16, (out_features, in_features // 16, 16), device=dev)]
        w = codes * (random_float((out_features, in_features // 16, 1), (4, 8), 3) / (20000 * 2.0 ** shift))
    else:  # fp8: e4m3 codes (exponents 2^-6..2^7), one bf16 scale per output in 2^-12..2^-10
        codes = random_float(shape, (-6, 8), 3)
        sign = torch.randint(0, 2, shape, device=dev) * 2 - 1
        w = sign * codes * random_float((out_features, 1), (-12 - shift, -10 - shift), 7)
    return w.reshape(shape).bfloat16()


def bench_bf16(rows, cols, shift=0):
    """random_model.rs's `Rng::bf16`: magnitudes 2^-7..2^-4, random mantissa and sign; `shift`:
    2^-shift smaller (random_model.rs draws its bf16 Linears with `scale_shift` too)."""
    sign = torch.randint(0, 2, (rows, cols), device=dev) * 2 - 1
    return (sign * random_float((rows, cols), (-7 - shift, -4 - shift), 7)).bfloat16()


def fill_rows(param, draw, rows=16384):
    """`param` [rows, cols] drawn `rows` rows at a time (a 262k x 5376 table at once would need
    tens of GB of temporaries)."""
    for start in range(0, param.shape[0], rows):
        part = param[start:start + rows]
        part.copy_(draw(*part.shape))


# The attention's Linears: grouped-query attention's (Gemma 4's global layers have no v_proj)
# or latent attention's (q_proj, or q_a_proj and q_b_proj).
ATTENTION = ["q_proj", "q_a_proj", "q_b_proj", "k_proj", "v_proj", "kv_a_proj_with_mqa",
             "kv_b_proj", "o_proj"]


def decoder_linears(layer):
    """The Linears of `layer` that the formats quantize: attention and dense MLPs (a shared
    expert's too)."""
    a, m = getattr(layer, "self_attn", None), layer.mlp
    out = [getattr(a, n) for n in ATTENTION if getattr(a, n, None) is not None] if a else []
    for mlp in (m, getattr(m, "shared_expert", None), getattr(m, "shared_experts", None)):
        if mlp is not None and hasattr(mlp, "gate_proj"):
            out += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return out


def layer_experts(layer):
    """A layer's fused experts: under `mlp` (Qwen, DeepSeek, GLM) or beside it (Gemma 4)."""
    return getattr(layer.mlp, "experts", None) or getattr(layer, "experts", None)


# W4A16's group: 128 where it divides every quantized input width, as random_model.rs
# `w4a16_group` (64 for 10944, 2112 and 704).
WIDTHS = {linear.in_features for layer in model.model.layers for linear in decoder_linears(layer)}
WIDTHS |= {e.down_proj.shape[-1] for e in map(layer_experts, model.model.layers) if e is not None}
GROUP = next(g for g in (128, 64, 32, 16) if all(w % g == 0 for w in WIDTHS))


def bf16_linears(layer):
    """The Linears that llm-compressor's Qwen3.5 / Qwen3-Next examples leave in bf16 (as
    random_model.rs): a Gated DeltaNet's projections and the shared-expert gate."""
    a, m = getattr(layer, "linear_attn", None), layer.mlp
    names = ["in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
             "out_proj"]
    out = [getattr(a, n) for n in names if hasattr(a, n)] if a is not None else []
    gate = getattr(m, "shared_expert_gate", None)
    return out + ([gate] if gate is not None else [])


def residual_writers(layer):
    """random_model.rs `scale_shift`: o_proj, a Gated DeltaNet's out_proj, the shared expert's
    down_proj (and the experts' down_proj, drawn below)."""
    a, la = getattr(layer, "self_attn", None), getattr(layer, "linear_attn", None)
    shared = getattr(layer.mlp, "shared_expert", None) or getattr(layer.mlp, "shared_experts", None)
    dense = layer.mlp if hasattr(layer.mlp, "down_proj") else None
    return [x for x in (a and a.o_proj, la and la.out_proj, shared and shared.down_proj,
                        dense and dense.down_proj) if x is not None]


with torch.no_grad():
    if args.weights != "init":
        for layer in model.model.layers:
            experts = layer_experts(layer)
            # A mixture's residual writers 2^-16 smaller, as random_model.rs draws them, so
            # that the router sees each token's embedding and spreads the tokens (in every
            # layer, a DeepSeek mixture's dense first one too; Gemma 4 normalises them: its
            # post-norms are drawn small below instead).
            shift = 16 if moe and model_class is not Gemma4ForCausalLM else 0
            writers = residual_writers(layer)
            for linear in decoder_linears(layer):
                linear.weight.copy_(dequantized(args.weights, *linear.weight.shape,
                                                shift if any(linear is w for w in writers) else 0))
            for linear in bf16_linears(layer):
                s = shift if any(linear is w for w in writers) else 0
                fill_rows(linear.weight, lambda rows, cols, s=s: bench_bf16(rows, cols, s))
            la = getattr(layer, "linear_attn", None)
            if la is not None:  # random_model.rs: A_log 0, dt_bias 0, conv1d as its Linears
                la.A_log.zero_()
                la.dt_bias.zero_()
                la.conv1d.weight.copy_(bench_bf16(la.conv1d.weight.shape[0],
                                                  la.conv1d.weight.shape[2]).unsqueeze(1))
            for e in range(experts.num_experts if experts is not None else 0):
                # gate and up stacked as [gate; up] rows, each with its own group scales
                experts.gate_up_proj[e].copy_(dequantized(args.weights, *experts.gate_up_proj[e].shape))
                experts.down_proj[e].copy_(dequantized(args.weights, *experts.down_proj[e].shape, shift))
    if not llama_shape:
        fill_rows(model.model.embed_tokens.weight, bench_bf16)
        if not cfg.tie_word_embeddings:
            fill_rows(model.lm_head.weight, bench_bf16)
        for layer in model.model.layers:
            router = getattr(layer.mlp, "gate", None) or getattr(layer, "router", None)
            if router is not None:
                fill_rows(getattr(router, "proj", router).weight, bench_bf16)
            if moe and model_class is Gemma4ForCausalLM:  # random_model.rs `norm_value`
                layer.post_attention_layernorm.weight.fill_(2.0 ** -16)
                layer.post_feedforward_layernorm.weight.fill_(2.0 ** -16)


def log_probs(hidden, targets):
    """log p(target) of final-norm hidden states [rows, hidden], `chunk` rows of logits at a
    time, soft-capped as the model's forward does."""
    cap = getattr(cfg, "final_logit_softcapping", None)
    out = []
    for start in range(0, hidden.shape[0], chunk):
        logits = model.lm_head(hidden[start:start + chunk])
        if cap:
            logits = torch.tanh(logits / cap) * cap
        lp = torch.log_softmax(logits.float(), dim=-1)
        out.append(lp.gather(-1, targets[start:start + chunk, None]).squeeze(-1))
    return torch.cat(out)


def forward_step(ids):
    """One scoring forward over `ids`: logits, log-softmax and the targets' gather on the GPU."""
    def step():
        with torch.inference_mode():
            if chunk == 0:
                logits = model(ids).logits.float()
                lp = torch.log_softmax(logits[:, :-1], dim=-1)
                return lp.gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()
            hidden = model.model(ids).last_hidden_state[:, :-1]
            return log_probs(hidden.reshape(-1, hidden.shape[-1]), ids[:, 1:].reshape(-1)).cpu()
    return step


def linears_step(ids):
    """One pass of every Linear GEMM of a forward over `ids`, each on the input it had in one
    real forward (activations set the GEMMs' power too)."""
    inputs = {}

    def keep(linear):
        def hook(_, args):  # returns None: the forward's own input is left alone
            inputs[linear] = args[0].reshape(-1, args[0].shape[-1])
        return hook

    linears = [linear for layer in model.model.layers
               for linear in decoder_linears(layer) + bf16_linears(layer)]
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


class Timer:
    """Elapsed ms of the work queued between `start` and `stop`: CUDA events on a GPU, the host
    clock on the CPU."""

    def start(self):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.events[0].record()
        self.t0 = time.perf_counter()

    def stop(self):
        if cuda:
            self.events[1].record()
            torch.cuda.synchronize()
            return self.events[0].elapsed_time(self.events[1])
        return (time.perf_counter() - self.t0) * 1e3


what = "Linear GEMMs only" if args.linears_only else "sdpa"
if moe:
    what += f", experts {model.config._experts_implementation}"
if hasattr(cfg, "linear_num_value_heads"):
    installed = [m for m in ("fla", "causal_conv1d") if importlib.util.find_spec(m)]
    what += f", linear attention with {'+'.join(installed) or 'neither fla nor causal_conv1d'} installed"
if chunk:
    what += f", lm_head in chunks of {chunk} rows"
label = f"{'linears' if args.linears_only else 'baseline'} {args.weights}"
print(f"| transformers {torch.__version__} bf16 {what}, {args.weights} weights, {args.shape} | batch | ms/window | tokens/s | peak GPU GiB |")
print("|---|---|---|---|---|")
for batch in [int(b) for b in args.batch.split(",")]:
    ids = torch.randint(0, cfg.vocab_size, (batch, args.ctx), device=dev)

    step = linears_step(ids) if args.linears_only else forward_step(ids)

    step()
    timer = Timer()
    timer.start()
    for _ in range(args.iters):
        step()
    ms = timer.stop() / args.iters
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    print(f"| {label} | {batch} | {ms / batch:.1f} | {batch * args.ctx / ms * 1e3:.0f} | "
          f"{peak:.1f} |")
