"""The built-in ``orca-tiny`` model: needs no files, so serving, generation and benchmarks run
out of the box.

It is GPT-2-shaped (8 layers, hidden 512, 8 heads, 1024 positions, about 26M parameters) with a
byte-level tokenizer (256 byte tokens + ``<|endoftext|>``) and deterministic seeded RANDOM
weights: its text is random bytes, useful only to exercise and time the engine. Save it with
``save_pretrained_folder`` to load the same weights into ``transformers``.
"""
from __future__ import annotations

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
