#!/usr/bin/env python3
"""Builds tests/fixtures/mistral3/: a Mistral 3 vision-language checkpoint (the layout of Mistral
Small 3.x) whose text model is the llama-dense-bf16 fixture's weights, and its float32 reference.

The text model is a Mistral with the Llama fixture's sizes and a 64-token sliding window (so the
longer sequences slide); the vision tower is a tiny seeded Pixtral with its projector. Only what
the Llama fixture does not already hold is written:
  config.json        as transformers writes it for Mistral3ForConditionalGeneration
  vision.safetensors the vision tower and projector (bf16), under the names transformers 5.17
                     writes (`vision_tower.*`, `multi_modal_projector.*`)
  reference.json     float32 log-probs of the four fixture sequences (text only), from
                     `from_pretrained` of the whole checkpoint in float32, eager attention
transformers 5.17 writes the text model in the 4.x layout (`language_model.model.*`,
`language_model.lm_head.weight`); the test (server/tests/arch_numerics.rs) puts the text
tensors back that way and in the transformers 5 one (`model.language_model.*`, `lm_head`),
beside vision.safetensors. The top-level `tie_word_embeddings` is
true (Mistral3Config's default) while the checkpoint has its own lm_head: transformers then
does not tie, and neither may we.

Usage (CPU only, no network; under a minute), in the venv of scripts/requirements-fixtures.txt:
    python scripts/make_mistral3_fixture.py
"""
import json
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import Mistral3Config, Mistral3ForConditionalGeneration

from make_rope_fixtures import reference_sequences

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
DENSE = FIXTURES / "llama-dense-bf16"
OUT = FIXTURES / "mistral3"
TEXT_PREFIX = "model.language_model."


def text_config():
    llama = json.loads((DENSE / "config.json").read_text())
    keep = [
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "rms_norm_eps", "rope_parameters", "bos_token_id", "eos_token_id", "hidden_act",
    ]
    config = {k: llama[k] for k in keep}
    config.update(model_type="mistral", sliding_window=64, tie_word_embeddings=False)
    return config


def main():
    torch.manual_seed(3)
    vision = dict(
        model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, head_dim=16, patch_size=4, image_size=16, num_channels=3,
    )
    # Untied while the weights go in (a tied model would load the lm_head into the embedding).
    config = Mistral3Config(text_config=text_config(), vision_config=vision,
                            spatial_merge_size=2, image_token_index=10,
                            tie_word_embeddings=False)
    model = Mistral3ForConditionalGeneration(config).to(torch.bfloat16)
    state = {}
    for name, tensor in load_file(DENSE / "model.safetensors").items():
        state[name if name == "lm_head.weight" else TEXT_PREFIX + name.removeprefix("model.")] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(not m.startswith(TEXT_PREFIX) and m != "lm_head.weight" for m in missing), missing

    dense = json.loads((DENSE / "reference.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        saved = Path(tmp)
        # Saved with Mistral3Config's default top-level `tie_word_embeddings: true`: transformers
        # then ties only where the checkpoint has no lm_head of its own, and this one has.
        written = json.loads((saved / "config.json").read_text())
        written["tie_word_embeddings"] = True
        (saved / "config.json").write_text(json.dumps(written, indent=2) + "\n")
        tensors = load_file(saved / "model.safetensors")
        f32 = Mistral3ForConditionalGeneration.from_pretrained(saved, dtype=torch.float32,
                                                               attn_implementation="eager")
        f32.eval()
        sequences = reference_sequences(f32, dense["sequences"])
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "config.json").write_text((saved / "config.json").read_text())
    # transformers 5.17 writes the 4.x layout: `language_model.model.*`, `language_model.lm_head`.
    saved_text = {"language_model.model." + n.removeprefix(TEXT_PREFIX): n for n in state}
    del saved_text["language_model.model.lm_head.weight"]
    saved_text["language_model.lm_head.weight"] = "lm_head.weight"
    text_names = {n for n in tensors if n in saved_text}
    assert len(text_names) == len(state), sorted(set(tensors) - set(saved_text))
    for name in text_names:
        assert torch.equal(tensors[name], state[saved_text[name]]), name
    save_file({n: t.contiguous() for n, t in tensors.items() if n not in text_names},
              OUT / "vision.safetensors")
    reference = {
        "text_weights": "llama-dense-bf16",
        "description": "Mistral3ForConditionalGeneration in float32 (eager attention), text "
                       "only; logits upcast to float64 before log_softmax",
        "sequences": sequences,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (OUT / "reference.json").write_text(json.dumps(reference) + "\n")
    print(f"{len(tensors) - len(text_names)} vision tensors; "
          f"mean NLL {sum(s['sum_nll'] for s in sequences) / sum(len(s['token_ids']) - 1 for s in sequences):.4f}")


if __name__ == "__main__":
    main()
