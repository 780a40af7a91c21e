#!/usr/bin/env python3
"""Builds tests/fixtures/rope/: what transformers makes of each RoPE schedule we implement.

cases.json: for a list of config.json files (every `rope_type` we serve, in v4 and v5 key
styles, with the defaults transformers fills in: a missing or top-level
`original_max_position_embeddings`, a null YaRN factor, mscale pairs, `truncate: false`, an
empty YaRN ramp), the f32 `inv_freq` and `attention_scaling` of transformers' own
`LlamaRotaryEmbedding`, and its f32 cos/sin at a few positions.

llama-yarn.json: float32 reference log-probs of the llama-dense-bf16 fixture's weights with its
RoPE replaced by YaRN (pretraining context 64, factor 4, so the 223- and 256-token sequences run
past the original context), from a plain transformers `from_pretrained` in float32.

Usage (CPU only, no network; under a minute), in the venv of scripts/requirements-fixtures.txt:
    python scripts/make_rope_fixtures.py
"""
import copy
import json
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
OUT = FIXTURES / "rope"
DENSE = FIXTURES / "llama-dense-bf16"
POSITIONS = [0, 1, 7, 63, 64, 255, 4095, 100000]


def base(head_dim=64, max_pos=4096, **extra):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 16,
        "hidden_size": 4 * head_dim,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "max_position_embeddings": max_pos,
    }
    config.update(extra)
    return config


CASES = {
    "default": base(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "linear_v4": base(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0}),
    "dynamic": base(
        max_pos=40960, rope_parameters={"rope_type": "dynamic", "factor": 1.1, "rope_theta": 1e6}
    ),
    "dynamic_v4": base(rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 2.0}),
    "llama3_original_from_max_positions": base(
        max_pos=8192,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ),
    # Qwen's long-context recipe.
    "yarn_qwen": base(
        head_dim=128,
        max_pos=131072,
        rope_theta=1e6,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
    "yarn_original_from_max_positions": base(
        max_pos=2048, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    ),
    "yarn_top_level_original_wins": base(
        max_pos=16384,
        original_max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    # DeepSeek-V3 style: the factor is the ratio of the contexts, the attention factor the
    # ratio of two mscales.
    "yarn_null_factor_mscale": base(
        max_pos=163840,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": None,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
    # gpt-oss style: no truncation of the correction range.
    "yarn_untruncated": base(
        max_pos=131072,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    ),
    "yarn_attention_factor_and_betas": base(
        max_pos=65536,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "attention_factor": 0.9,
            "beta_fast": 16,
            "beta_slow": 2,
        },
    ),
    # Equal betas: transformers widens the empty ramp by 0.001.
    "yarn_empty_ramp": base(
        max_pos=8192,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 4,
            "beta_slow": 4,
        },
    ),
}

# The end-to-end case: the dense fixture's Llama with YaRN over a 64-token pretraining context.
YARN_E2E = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
}


def f32_list(t):
    return [float(x) for x in t.to(torch.float32).flatten().tolist()]


def rope_case(config_json):
    config = LlamaConfig.from_dict(copy.deepcopy(config_json))
    rope = LlamaRotaryEmbedding(config)
    # Read before any forward: a dynamic RoPE recomputes them for positions past the context.
    inv_freq, attention_scaling = f32_list(rope.inv_freq), float(rope.attention_scaling)
    positions = [p for p in POSITIONS if p < config.max_position_embeddings]
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rope(x, torch.tensor([positions]))
    return {
        "config": config_json,
        "inv_freq": inv_freq,
        "attention_scaling": attention_scaling,
        "positions": positions,
        "cos": [f32_list(row) for row in cos[0]],
        "sin": [f32_list(row) for row in sin[0]],
    }


@torch.no_grad()
def reference_sequences(model, sequences):
    """`model`'s log-probs of each sequence's `token_ids`, in the fixtures' convention: f32
    logits upcast to f64 before log_softmax, no log-prob for the first id."""
    out = []
    for seq in sequences:
        ids = seq["token_ids"]
        logits = model(input_ids=torch.tensor([ids])).logits[0].to(torch.float64)
        logprobs = torch.log_softmax(logits, dim=-1)[:-1]
        target = torch.tensor(ids[1:])
        token_logprobs = logprobs.gather(1, target[:, None])[:, 0]
        out.append(
            {
                "token_ids": ids,
                "token_logprobs": [None] + [float(v) for v in token_logprobs],
                "sum_nll": float(-token_logprobs.sum()),
            }
        )
    return out


def yarn_reference():
    dense = json.loads((DENSE / "reference.json").read_text())
    config = json.loads((DENSE / "config.json").read_text())
    config["rope_parameters"] = YARN_E2E
    config["max_position_embeddings"] = 256
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for f in DENSE.iterdir():
            if f.name != "config.json":
                (tmp / f.name).symlink_to(f)
        (tmp / "config.json").write_text(json.dumps(config))
        model = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, attn_implementation="eager"
        )
    model.eval()
    sequences = reference_sequences(model, dense["sequences"])
    return {
        "weights": "llama-dense-bf16",
        "rope_parameters": YARN_E2E,
        "max_position_embeddings": 256,
        "sequences": sequences,
    }


def main():
    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    cases = {name: rope_case(cfg) for name, cfg in CASES.items()}
    (OUT / "cases.json").write_text(json.dumps({"versions": versions, "cases": cases}) + "\n")
    e2e = yarn_reference()
    e2e["versions"] = versions
    (OUT / "llama-yarn.json").write_text(json.dumps(e2e) + "\n")
    for name, case in cases.items():
        print(f"{name}: attention_scaling {case['attention_scaling']}")


if __name__ == "__main__":
    main()
