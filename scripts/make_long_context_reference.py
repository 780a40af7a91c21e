#!/usr/bin/env python3
"""Builds tests/fixtures/long-context/: transformers' float32 reference of one long sequence.

The sequence: BOS, then the first 16383 tokens of the bundled WikiText-2 test split
(tests/fixtures/corpus), tokenized with the tiny fixtures' tokenizer. Its 16384 positions run
past the llama3 RoPE's original context (8192) of the tiny Llama fixtures.

Both tiny Llama checkpoints are run in float32 by transformers: llama-w4a16-g128 (the served
model, its int4 weights unpacked by compressed-tensors' own decompressor, scales cast to f32 as
transformers does at load) and llama-dense-bf16 (the /kld reference, its bf16 weights widened
to f32). The sequence goes through in chunks of 2048 tokens with a KV cache (transformers'
chunked prefill: each chunk's queries attend to the cache and themselves, sdpa), so that the
reference itself never holds more than 2048 x 16384 scores per head. Per position i (predicting
token i + 1) it stores, in float32:

* `logprobs`: log p(token i+1 | prefix) of the served model (log_softmax of f32 logits, in f64);
* `reference_logprobs`: the same of the reference model;
* `kld`: KL(reference || served) of the two next-token distributions, in f64, rounded to f32;

and `tokens` (int32). One safetensors file, about 260 KB; `server/tests/long_context.rs` reads it.

Usage (CPU, no network, about a minute), in the venv of scripts/requirements-fixtures.txt:
    python scripts/make_long_context_reference.py
"""
import gzip
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
OUT = FIXTURES / "long-context"
SERVED = FIXTURES / "llama-w4a16-g128"
REFERENCE = FIXTURES / "llama-dense-bf16"
TOKENS = 16384
CHUNK = 2048


def sequence():
    tok = Tokenizer.from_file(str(REFERENCE / "tokenizer.json"))
    corpus = FIXTURES / "corpus" / "wikitext-2-raw-test.txt.gz"
    text = gzip.decompress(corpus.read_bytes()).decode("utf-8")
    ids = tok.encode(text[:400_000], add_special_tokens=False).ids
    bos = json.loads((REFERENCE / "config.json").read_text())["bos_token_id"]
    assert len(ids) >= TOKENS - 1, len(ids)
    return [bos] + ids[: TOKENS - 1]


def float_model(path):
    """The checkpoint in float32: compressed-tensors' decompression of quantized Linears."""
    cfg = json.loads((path / "config.json").read_text())
    config = LlamaConfig.from_pretrained(str(path))
    config.quantization_config = None
    model = LlamaForCausalLM(config).to(torch.float32)
    tensors = load_file(str(path / "model.safetensors"))
    state, modules = {}, {}
    for key, t in tensors.items():
        module, local = key.rsplit(".", 1)
        modules.setdefault(module, {})[local] = t
    qcfg = cfg.get("quantization_config")
    for module, local in modules.items():
        if "weight_scale" not in local:
            state.update({f"{module}.{k}": v.to(torch.float32) for k, v in local.items()})
            continue
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationConfig

        q = QuantizationConfig.model_validate(qcfg)
        local = dict(local)
        local["weight_scale"] = local["weight_scale"].to(torch.float32)
        decompressor = BaseCompressor.get_value_from_registry(q.format)
        w = decompressor.decompress(local, q.config_groups["group_0"])["weight"]
        state[f"{module}.weight"] = w.to(torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    model.config._attn_implementation = "sdpa"
    return model.eval()


@torch.no_grad()
def log_softmax_chunks(model, ids):
    """f64 log-softmax of every position's logits, chunk by chunk with a KV cache."""
    cache = DynamicCache(config=model.config)
    out = []
    for start in range(0, len(ids), CHUNK):
        x = torch.tensor([ids[start : start + CHUNK]], dtype=torch.long)
        positions = torch.arange(start, start + x.shape[1])
        res = model(input_ids=x, past_key_values=cache, use_cache=True, cache_position=positions)
        cache = res.past_key_values
        out.append(torch.log_softmax(res.logits[0].to(torch.float64), dim=-1))
        print(f"  {start + x.shape[1]} tokens", flush=True)
    return torch.cat(out)


def main():
    torch.manual_seed(0)
    ids = sequence()
    target = torch.tensor(ids[1:], dtype=torch.long)[:, None]
    print("served", SERVED.name)
    served = log_softmax_chunks(float_model(SERVED), ids)[:-1]
    print("reference", REFERENCE.name)
    reference = log_softmax_chunks(float_model(REFERENCE), ids)[:-1]
    kld = (reference.exp() * (reference - served)).sum(dim=-1)
    OUT.mkdir(parents=True, exist_ok=True)
    tensors = {
        "tokens": torch.tensor(ids, dtype=torch.int32),
        "logprobs": served.gather(1, target)[:, 0].to(torch.float32),
        "reference_logprobs": reference.gather(1, target)[:, 0].to(torch.float32),
        "kld": kld.to(torch.float32),
    }
    import transformers
    import compressed_tensors

    meta = {
        "served": SERVED.name,
        "reference": REFERENCE.name,
        "chunk": str(CHUNK),
        "attention": "sdpa",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "compressed_tensors": compressed_tensors.__version__,
    }
    save_file(tensors, str(OUT / "reference.safetensors"), metadata=meta)
    lp = tensors["logprobs"]
    print(f"mean NLL {-lp.double().mean():.4f}, mean KLD {kld.mean():.6f}")


if __name__ == "__main__":
    main()
