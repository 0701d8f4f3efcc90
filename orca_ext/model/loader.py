"""Loading a model by built-in name or from a Hugging Face model folder (never the network),
and saving one back as a folder that ``transformers`` can load."""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import gpt2, llama
from .arena import allocate_in_arena
from .builtin import BUILTIN_MODELS, builtin_tokenizer, init_random_weights
from .config import ModelConfig
from .tokenizer import Tokenizer
from .weights import load_hf_weights, save_hf_weights

_FAMILIES = {"gpt2": (gpt2, gpt2.GPT2), "llama": (llama, llama.Llama)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: nn.Module  # forward(input_ids, positions, kv_caches, meta) + compute_logits
    config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: list[int]
    max_model_len: int
    chat_template: str | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if dtype in DTYPES.values():
        return dtype
    raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(config: ModelConfig, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> nn.Module:
    """The family's module with uninitialized parameters of ``dtype`` on ``device``."""
    _, cls = _FAMILIES[config.family]
    with torch.device(device), _default_dtype(dtype):
        model = cls(config).eval()
    allocate_in_arena(model)
    return model


@dataclass
class ModelInfo:
    """What serving needs besides the weights (a distributed engine's driver holds no weights)."""

    config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: list[int]
    max_model_len: int
    chat_template: str | None = None
    folder: Path | None = None  # the Hugging Face folder; None for a built-in model


def load_model_info(name_or_path: str) -> ModelInfo:
    """Config, tokenizer, stop ids and chat template of a built-in name or a model folder,
    without reading any weights."""
    if name_or_path in BUILTIN_MODELS:
        config = ModelConfig.from_hf(BUILTIN_MODELS[name_or_path])
        return ModelInfo(config, builtin_tokenizer(), list(config.eos_token_ids),
                         config.max_model_len)
    folder = Path(name_or_path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist (built-in models: "
                                f"{', '.join(BUILTIN_MODELS)}; models are never downloaded)")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json")
    config = ModelConfig.from_hf(_read_json(config_file))
    tokenizer = Tokenizer.from_file(folder / "tokenizer.json")
    generation = folder / "generation_config.json"
    eos = list(config.eos_token_ids)
    if generation.is_file():
        eos_value = _read_json(generation).get("eos_token_id")
        eos_value = [eos_value] if isinstance(eos_value, int) else eos_value or []
        eos = list(dict.fromkeys([*eos_value, *eos]))
    return ModelInfo(config, tokenizer, eos, config.max_model_len, _chat_template(folder), folder)


def load_model(name_or_path: str, dtype: torch.dtype | str = "float32",
               device: torch.device | str = "cpu") -> LoadedModel:
    """Load the built-in ``orca-tiny`` or a Hugging Face model folder (config.json, *.safetensors
    or a sharded index, tokenizer.json, optional generation_config.json)."""
    dtype = resolve_dtype(dtype)
    info = load_model_info(name_or_path)
    config = info.config
    model = build_model(config, dtype, device)
    if info.folder is None:
        init_random_weights(model)
    else:
        family, _ = _FAMILIES[config.family]
        load_hf_weights(model, family.hf_weight_map(config), info.folder,
                        family.canonical_hf_name, family.IGNORED_HF_WEIGHTS)
    return LoadedModel(model, config, info.tokenizer, info.eos_token_ids, info.max_model_len,
                       info.chat_template)


def save_pretrained_folder(loaded: LoadedModel, path: str | Path) -> Path:
    """Write ``loaded`` as a Hugging Face folder: config.json, model.safetensors,
    generation_config.json, tokenizer.json and tokenizer_config.json."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = loaded.config
    family, _ = _FAMILIES[config.family]
    hf_config = {**config.hf_config, "dtype": str(loaded.dtype).removeprefix("torch.")}
    _write_json(folder / "config.json", hf_config)
    save_hf_weights(loaded.model, family.hf_weight_map(config), folder / "model.safetensors")
    eos = loaded.eos_token_ids
    _write_json(folder / "generation_config.json",
                {"bos_token_id": config.bos_token_id,
                 "eos_token_id": eos[0] if len(eos) == 1 else eos})
    loaded.tokenizer.save(folder / "tokenizer.json")
    tokenizer_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, token_id in (("bos_token", config.bos_token_id),
                          ("eos_token", eos[0] if eos else None)):
        if token_id is not None:
            tokenizer_config[key] = loaded.tokenizer.inner.id_to_token(token_id)
    if loaded.chat_template is not None:
        tokenizer_config["chat_template"] = loaded.chat_template
    _write_json(folder / "tokenizer_config.json", tokenizer_config)
    return folder


def _chat_template(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tokenizer_config = folder / "tokenizer_config.json"
    if tokenizer_config.is_file():
        template = _read_json(tokenizer_config).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
