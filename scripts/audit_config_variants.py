#!/usr/bin/env python3
"""Held-out config audit: ExactScore's CPU f32 log-probs against transformers f32 on config
variants the fixtures do not exercise (a dev tool; nothing in CI runs it).

For each variant (one or two config keys changed from a family's tiny base, the bases being
scripts/make_arch_fixtures.py's): build the model with transformers (seeded, weights drawn by
make_arch_fixtures.init_weights so logits are not flat), save it in float32 with
save_pretrained (tensor names as transformers writes them), compute reference log-probs of three
random sequences (40, 70 and 100 ids < 2000), start the server binary on the directory, score
the same ids through POST /v1/score and print one row per variant: the largest |delta| over
every scored token, or the server's refusal / error. Pass: max |delta| <= 1e-4.

Families: qwen3_5 (text-only and ForConditionalGeneration), qwen3_5_moe, qwen3_next, gemma4
(dense, MoE, ForConditionalGeneration), and qwen3 / qwen3_moe as controls.

Usage (CPU only, ~10 s a variant on 2 cores):
    /tmp/venv-fixtures/bin/python scripts/audit_config_variants.py \
        --server target/release/exactscore-server [--only REGEX] [--keep DIR]
"""
import argparse
import copy
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_arch_fixtures as maf  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "tests" / "fixtures" / "llama-dense-bf16"
VOCAB = 2000
TOLERANCE = 1e-4


class _Std(dict):
    """make_arch_fixtures.INIT_STD, with fused experts (`experts.gate_up_proj`) and any
    projection it does not name drawn like the other projections."""

    def __missing__(self, key):
        return 0.06


maf.INIT_STD = _Std(maf.INIT_STD)

QWEN35_ROPE = maf.QWEN35_ROPE
NEXT_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
QWEN35 = dict(maf.HYBRID, intermediate_size=256, rope_parameters=QWEN35_ROPE)
QWEN35_MOE = dict(maf.HYBRID, hidden_size=64, moe_intermediate_size=32,
                  shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                  rope_parameters=QWEN35_ROPE)
QWEN3_NEXT = dict(maf.HYBRID, hidden_size=64, intermediate_size=192, moe_intermediate_size=32,
                  shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                  norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[2],
                  rope_parameters=NEXT_ROPE)
GEMMA4 = dict(maf.GEMMA4_COMMON, num_hidden_layers=5, intermediate_size=128,
              layer_types=["sliding_attention", "full_attention", "sliding_attention",
                           "sliding_attention", "full_attention"],
              num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
              vocab_size_per_layer_input=VOCAB)
GEMMA4_MOE = dict(maf.GEMMA4_COMMON, num_hidden_layers=3, intermediate_size=128,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                  hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=8,
                  top_k_experts=2, moe_intermediate_size=32)
QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
             tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
QWEN3_MOE = dict(QWEN3, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                 norm_topk_prob=True)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
        "beta_fast": 32.0, "beta_slow": 1.0}
LINEAR = {"rope_type": "linear", "factor": 2.0}


def rope(base, **kw):
    out = dict(base)
    out.update(kw)
    return {k: v for k, v in out.items() if v is not None}


def gemma4_rope(full=None, sliding=None):
    r = copy.deepcopy(maf.GEMMA4_COMMON["rope_parameters"])
    if full is not None:
        r["full_attention"] = full
    if sliding is not None:
        r["sliding_attention"] = sliding
    return r


def drop(d, *keys):
    return {k: v for k, v in d.items() if k not in keys}


# (name, arch key for init_weights, config class, model class, kwargs, composite?)
# composite: dict(config, vision) for ForConditionalGeneration (text kwargs go to text_config).
def variants():
    v = []

    def add(name, arch, cfg, model, kw, vision=None, **extra):
        v.append(dict(name=name, arch=arch, config=cfg, model=model, kw=kw, vision=vision, **extra))

    # Qwen3.5 dense, text-only class
    q = ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM")
    add("qwen3_5/base", *q, QWEN35)
    add("qwen3_5/prf0.5", *q, dict(QWEN35, rope_parameters=rope(
        QWEN35_ROPE, partial_rotary_factor=0.5, mrope_section=[6, 5, 5])))
    add("qwen3_5/prf1.0", *q, dict(QWEN35, rope_parameters=rope(
        QWEN35_ROPE, partial_rotary_factor=1.0, mrope_section=[11, 11, 10])))
    add("qwen3_5/mrope_not_interleaved", *q, dict(QWEN35, rope_parameters=rope(
        QWEN35_ROPE, mrope_interleaved=False)))
    add("qwen3_5/no_mrope", *q, dict(QWEN35, rope_parameters=rope(
        QWEN35_ROPE, mrope_section=None, mrope_interleaved=None)))
    add("qwen3_5/rope_yarn", *q, dict(QWEN35, rope_parameters=rope(
        QWEN35_ROPE, mrope_section=None, mrope_interleaved=None, **YARN)))
    add("qwen3_5/rope_linear", *q, dict(QWEN35, rope_parameters=rope(
        QWEN35_ROPE, mrope_section=None, mrope_interleaved=None, **LINEAR)))
    add("qwen3_5/full_attention_interval2", *q, dict(drop(QWEN35, "layer_types"),
                                                      full_attention_interval=2))
    add("qwen3_5/default_layer_types", *q, drop(QWEN35, "layer_types"))
    add("qwen3_5/all_full", *q, dict(QWEN35, layer_types=["full_attention"] * 4))
    add("qwen3_5/all_linear", *q, dict(QWEN35, layer_types=["linear_attention"] * 4))
    add("qwen3_5/attention_bias", *q, dict(QWEN35, attention_bias=True))
    add("qwen3_5/head_dim32", *q, dict(QWEN35, head_dim=32, rope_parameters=rope(
        QWEN35_ROPE, mrope_section=[2, 1, 1])))
    add("qwen3_5/kv_heads4", *q, dict(QWEN35, num_key_value_heads=4))
    add("qwen3_5/lin_heads_equal", *q, dict(QWEN35, linear_num_key_heads=4))
    add("qwen3_5/lin_kdim_ne_vdim", *q, dict(QWEN35, linear_key_head_dim=16,
                                             linear_value_head_dim=48))
    add("qwen3_5/lin_key_heads1", *q, dict(QWEN35, linear_num_key_heads=1))
    add("qwen3_5/conv_kernel3", *q, dict(QWEN35, linear_conv_kernel_dim=3))
    add("qwen3_5/conv_kernel2", *q, dict(QWEN35, linear_conv_kernel_dim=2))
    add("qwen3_5/tied", *q, dict(QWEN35, tie_word_embeddings=True))
    add("qwen3_5/rope_theta1e4", *q, dict(QWEN35, rope_parameters=rope(QWEN35_ROPE,
                                                                        rope_theta=10000.0)))
    add("qwen3_5/fcg", "qwen3_5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration", QWEN35,
        vision=dict(maf.TINY_VISION, out_hidden_size=128))
    add("qwen3_5/fcg_tied", "qwen3_5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
        dict(QWEN35, tie_word_embeddings=True), vision=dict(maf.TINY_VISION, out_hidden_size=128))
    # the tie flag only at the top level, or only in text_config
    add("qwen3_5/fcg_tied_top_only", "qwen3_5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
        QWEN35, vision=dict(maf.TINY_VISION, out_hidden_size=128), tie_top=True)
    add("qwen3_5/fcg_tied_text_only", "qwen3_5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
        dict(QWEN35, tie_word_embeddings=True), vision=dict(maf.TINY_VISION, out_hidden_size=128),
        tie_top=False)

    # Qwen3.5-MoE
    m = ("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM")
    add("qwen3_5_moe/base", *m, QWEN35_MOE)
    add("qwen3_5_moe/fcg", "qwen3_5_moe", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
        QWEN35_MOE, vision=dict(maf.TINY_VISION, out_hidden_size=64))
    add("qwen3_5_moe/topk1", *m, dict(QWEN35_MOE, num_experts_per_tok=1))
    add("qwen3_5_moe/topk4", *m, dict(QWEN35_MOE, num_experts_per_tok=4))
    add("qwen3_5_moe/prf0.5", *m, dict(QWEN35_MOE, rope_parameters=rope(
        QWEN35_ROPE, partial_rotary_factor=0.5, mrope_section=[6, 5, 5])))
    add("qwen3_5_moe/attention_bias", *m, dict(QWEN35_MOE, attention_bias=True))
    add("qwen3_5_moe/lin_heads_equal", *m, dict(QWEN35_MOE, linear_num_key_heads=4))
    add("qwen3_5_moe/shared0", *m, dict(QWEN35_MOE, shared_expert_intermediate_size=0))
    add("qwen3_5_moe/tied", *m, dict(QWEN35_MOE, tie_word_embeddings=True))
    add("qwen3_5_moe/full_attention_interval2", *m, dict(drop(QWEN35_MOE, "layer_types"),
                                                          full_attention_interval=2))

    # Qwen3-Next
    n = ("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM")
    add("qwen3_next/base", *n, QWEN3_NEXT)
    add("qwen3_next/norm_topk", *n, dict(QWEN3_NEXT, norm_topk_prob=True))
    add("qwen3_next/sparse_step2", *n, dict(QWEN3_NEXT, decoder_sparse_step=2, mlp_only_layers=[]))
    add("qwen3_next/no_mlp_only", *n, dict(QWEN3_NEXT, mlp_only_layers=[]))
    add("qwen3_next/shared0", *n, dict(QWEN3_NEXT, shared_expert_intermediate_size=0))
    add("qwen3_next/topk1", *n, dict(QWEN3_NEXT, num_experts_per_tok=1))
    add("qwen3_next/prf0.5", *n, dict(QWEN3_NEXT, rope_parameters=rope(
        NEXT_ROPE, partial_rotary_factor=0.5)))
    add("qwen3_next/prf1.0", *n, dict(QWEN3_NEXT, rope_parameters=rope(
        NEXT_ROPE, partial_rotary_factor=1.0)))
    add("qwen3_next/rope_yarn", *n, dict(QWEN3_NEXT, rope_parameters=rope(NEXT_ROPE, **YARN)))
    add("qwen3_next/rope_linear", *n, dict(QWEN3_NEXT, rope_parameters=rope(NEXT_ROPE, **LINEAR)))
    add("qwen3_next/attention_bias", *n, dict(QWEN3_NEXT, attention_bias=True))
    add("qwen3_next/lin_heads_equal", *n, dict(QWEN3_NEXT, linear_num_key_heads=4))
    add("qwen3_next/conv_kernel3", *n, dict(QWEN3_NEXT, linear_conv_kernel_dim=3))
    add("qwen3_next/default_layer_types", *n, drop(QWEN3_NEXT, "layer_types"))
    add("qwen3_next/tied", *n, dict(QWEN3_NEXT, tie_word_embeddings=True))

    # Gemma 4
    g = ("gemma4", "Gemma4TextConfig", "Gemma4ForCausalLM")
    add("gemma4/base", *g, GEMMA4)
    add("gemma4/sliding_window8", *g, dict(GEMMA4, sliding_window=8))
    add("gemma4/no_softcap", *g, dict(GEMMA4, final_logit_softcapping=None))
    add("gemma4/k_ne_v", *g, dict(GEMMA4, attention_k_eq_v=False))
    add("gemma4/no_global_kv_heads", *g, drop(GEMMA4, "num_global_key_value_heads"))
    add("gemma4/global_head_dim32", *g, dict(GEMMA4, global_head_dim=32))
    add("gemma4/kv_shared0", *g, dict(GEMMA4, num_kv_shared_layers=0))
    add("gemma4/kv_shared3", *g, dict(GEMMA4, num_kv_shared_layers=3))
    add("gemma4/no_ple", *g, dict(GEMMA4, hidden_size_per_layer_input=0))
    add("gemma4/no_double_wide", *g, dict(GEMMA4, use_double_wide_mlp=False))
    add("gemma4/untied", *g, dict(GEMMA4, tie_word_embeddings=False))
    add("gemma4/attention_bias", *g, dict(GEMMA4, attention_bias=True))
    add("gemma4/default_layer_types6", *g, dict(drop(GEMMA4, "layer_types"), num_hidden_layers=6,
                                                num_kv_shared_layers=0))
    add("gemma4/full_prf0.5", *g, dict(GEMMA4, rope_parameters=gemma4_rope(
        full={"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e6})))
    add("gemma4/full_rope_default", *g, dict(GEMMA4, rope_parameters=gemma4_rope(
        full={"rope_type": "default", "rope_theta": 1e6})))
    add("gemma4/sliding_rope_linear", *g, dict(GEMMA4, rope_parameters=gemma4_rope(
        sliding={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})))
    add("gemma4/full_rope_yarn", *g, dict(GEMMA4, rope_parameters=gemma4_rope(
        full={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
              "original_max_position_embeddings": 1024})))
    add("gemma4/gelu_exact", *g, dict(GEMMA4, hidden_activation="gelu"))
    add("gemma4/bidirectional_vision", *g, dict(GEMMA4, use_bidirectional_attention="vision"))
    add("gemma4/fcg", "gemma4", "Gemma4Config", "Gemma4ForConditionalGeneration", GEMMA4,
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=2, head_dim=16))
    add("gemma4/fcg_untied", "gemma4", "Gemma4Config", "Gemma4ForConditionalGeneration",
        dict(GEMMA4, tie_word_embeddings=False),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=2, head_dim=16))
    gm = ("gemma4_moe", "Gemma4TextConfig", "Gemma4ForCausalLM")
    add("gemma4_moe/base", *gm, GEMMA4_MOE)
    add("gemma4_moe/topk1", *gm, dict(GEMMA4_MOE, top_k_experts=1))
    add("gemma4_moe/topk4", *gm, dict(GEMMA4_MOE, top_k_experts=4))
    add("gemma4_moe/with_ple", *gm, dict(GEMMA4_MOE, hidden_size_per_layer_input=8,
                                         vocab_size_per_layer_input=VOCAB))
    add("gemma4_moe/kv_shared1_double_wide", *gm, dict(GEMMA4_MOE, num_kv_shared_layers=1,
                                                        use_double_wide_mlp=True, num_hidden_layers=4,
                                                        layer_types=["sliding_attention",
                                                                     "full_attention",
                                                                     "sliding_attention",
                                                                     "full_attention"]))
    add("gemma4_moe/sliding_window8", *gm, dict(GEMMA4_MOE, sliding_window=8))
    add("gemma4_moe/fcg", "gemma4_moe", "Gemma4Config", "Gemma4ForConditionalGeneration",
        GEMMA4_MOE, vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=2, head_dim=16))

    # Controls: Qwen3, Qwen3-MoE
    c = ("qwen3", "Qwen3Config", "Qwen3ForCausalLM")
    add("qwen3/base", *c, QWEN3)
    add("qwen3/attention_bias", *c, dict(QWEN3, attention_bias=True))
    add("qwen3/tied", *c, dict(QWEN3, tie_word_embeddings=True))
    add("qwen3/rope_yarn", *c, dict(QWEN3, rope_parameters=dict(YARN, rope_theta=1e6)))
    add("qwen3/rope_linear", *c, dict(QWEN3, rope_parameters=dict(LINEAR, rope_theta=1e6)))
    add("qwen3/sliding_window8", *c, dict(QWEN3, use_sliding_window=True, sliding_window=8,
                                          max_window_layers=1))
    add("qwen3/sliding_window8_all", *c, dict(QWEN3, use_sliding_window=True, sliding_window=8,
                                              max_window_layers=0))
    add("qwen3/sliding_window_off", *c, dict(QWEN3, use_sliding_window=False, sliding_window=8,
                                             max_window_layers=1))
    cm = ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM")
    add("qwen3_moe/base", *cm, QWEN3_MOE)
    add("qwen3_moe/no_norm_topk", *cm, dict(QWEN3_MOE, norm_topk_prob=False))
    add("qwen3_moe/sparse_step2", *cm, dict(QWEN3_MOE, decoder_sparse_step=2))
    add("qwen3_moe/mlp_only1", *cm, dict(QWEN3_MOE, mlp_only_layers=[1]))
    add("qwen3_moe/topk1", *cm, dict(QWEN3_MOE, num_experts_per_tok=1))
    add("qwen3_moe/sliding_window8", *cm, dict(QWEN3_MOE, use_sliding_window=True,
                                               sliding_window=8))
    return v


def build(spec, seed):
    import transformers

    # Gemma 4's ForConditionalGeneration embeds its placeholder ids as the pad token: it needs one
    pad = 0 if spec["model"] == "Gemma4ForConditionalGeneration" else None
    ids = dict(bos_token_id=1992, eos_token_id=1993, pad_token_id=pad)
    if spec["vision"] is not None:
        cfg = getattr(transformers, spec["config"])(
            text_config=dict(vocab_size=VOCAB, **ids, **spec["kw"]),
            vision_config=dict(spec["vision"]),
            tie_word_embeddings=spec.get("tie_top", spec["kw"].get("tie_word_embeddings", False)),
            **ids)
    else:
        cfg = getattr(transformers, spec["config"])(vocab_size=VOCAB, **ids, **spec["kw"])
    model = getattr(transformers, spec["model"])(cfg).to(torch.float32)
    with torch.no_grad():
        maf.init_weights(model, seed, spec["arch"])
    if cfg.get_text_config().tie_word_embeddings or getattr(cfg, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def sequences(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (40, 70, 100)]


@torch.no_grad()
def reference(model, seqs):
    out = []
    for ids in seqs:
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        out.append([lp[i - 1, ids[i]].item() for i in range(1, len(ids))])
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url, body=None, timeout=120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read() or b"null")


def serve_and_score(server, model_dir, seqs, log):
    port = free_port()
    with open(log, "w") as logf:
        proc = subprocess.Popen([server, "--model", str(model_dir), "--port", str(port),
                                 "--dtype", "f32", "--device", "cpu"],
                                stdout=logf, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if proc.poll() is not None:
                tail = Path(log).read_text().strip().splitlines()[-3:]
                return None, "REFUSED/EXIT: " + " | ".join(tail)
            try:
                if http(f"http://127.0.0.1:{port}/health/ready", timeout=2)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.3)
        else:
            return None, "server not ready after 120 s"
        try:
            _, resp = http(f"http://127.0.0.1:{port}/v1/score", {"tokens": seqs})
        except urllib.error.HTTPError as e:
            return None, f"HTTP {e.code}: {e.read().decode()[:300]}"
        return [s["token_logprobs"][1:] for s in resp["sequences"]], None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", default=str(REPO / "target" / "release" / "exactscore-server"))
    ap.add_argument("--only", default=None, help="regex on variant names")
    ap.add_argument("--keep", default=None, help="keep the checkpoints under this directory")
    ap.add_argument("--json", default=None, help="write the table as JSON here")
    args = ap.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="audit-variants-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in variants():
        if args.only and not re.search(args.only, spec["name"]):
            continue
        d = work / spec["name"].replace("/", "__")
        seed = zlib.crc32(spec["name"].encode()) % 100000  # stable when variants are added
        try:
            model = build(spec, seed)
            seqs = sequences(seed)
            ref = reference(model, seqs)
            if d.exists():
                shutil.rmtree(d)
            model.save_pretrained(d)
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(TOKENIZER_DIR / f, d / f)
        except Exception as e:  # a variant transformers itself rejects
            rows.append((spec["name"], None, f"transformers: {type(e).__name__}: {e}"[:200]))
            print(f"{spec['name']:40s} SKIP  {rows[-1][2]}", flush=True)
            continue
        got, err = serve_and_score(args.server, d, seqs, d / "server.log")
        if err:
            rows.append((spec["name"], None, err[:300]))
            print(f"{spec['name']:40s} ERROR {err[:300]}", flush=True)
            continue
        delta = max(abs(a - b) for r, s in zip(ref, got) for a, b in zip(r, s))
        mean = sum(abs(a - b) for r, s in zip(ref, got) for a, b in zip(r, s)) / sum(map(len, ref))
        verdict = "ok" if delta <= TOLERANCE else "WRONG"
        rows.append((spec["name"], delta, verdict))
        print(f"{spec['name']:40s} {verdict:5s} max|d|={delta:.2e} mean|d|={mean:.2e}", flush=True)
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r[2] not in ("ok",)]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} variants within {TOLERANCE:g}")


if __name__ == "__main__":
    main()
