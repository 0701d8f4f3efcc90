"""Loading a model by built-in name, from a Hugging Face model folder or from a GGUF file (never
the network), and saving one back as a folder that ``transformers`` can load."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ..quantize import check_quantization
from . import gemma3, gpt2, llama, phi3
from .arena import allocate_in_arena
from .builtin import (BUILTIN_GGUF_MODELS, BUILTIN_MODELS, builtin_gguf_path, builtin_tokenizer,
                      init_random_weights)
from .config import ModelConfig
from .decoder import Decoder
from .gguf import GGUFCheckpoint, GGUFFile, gguf_tokenizer, hf_config
from .dtypes import resolve_dtype
from .quantized import (QuantizedWeight, interleave_rows, load_quantized_weights,
                        plan_quantization, quantize_modules)
from .tokenizer import Tokenizer
from .weights import Checkpoint, SafetensorsCheckpoint, load_hf_weights, save_hf_weights

_FAMILIES = {"gpt2": gpt2, "llama": llama, "gemma3": gemma3, "phi3": phi3}
_log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model's description and its module with the weights."""

    info: ModelInfo
    model: nn.Module  # forward(input_ids, positions, kv_caches, meta) + compute_logits

    @property
    def config(self) -> ModelConfig:
        return self.info.config

    @property
    def tokenizer(self) -> Tokenizer:
        return self.info.tokenizer

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (a quantized head's weight is uint8 blocks)."""
        return next(p.dtype for p in self.model.parameters() if p.is_floating_point())

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    def with_context(self, max_model_len: int | None) -> LoadedModel:
        """This model with its context capped at ``max_model_len`` (``ModelInfo.with_context``)."""
        return dataclasses.replace(self, info=self.info.with_context(max_model_len))


def runs_quantized(name_or_path: str, quantization: str | None,
                   device: torch.device | str = "cpu") -> bool:
    """Whether ``load_model(name_or_path, quantization=...)`` gives quantized layers: a format
    always (on the CPU only), None for a GGUF file on the CPU; a ValueError naming a bad
    ``quantization``."""
    check_quantization(quantization, device)
    if quantization == "none":
        return False
    if quantization is not None:
        return True
    if torch.device(device).type != "cpu" or name_or_path in BUILTIN_MODELS:
        return False
    resolved = resolve_model_path(name_or_path)
    return resolved.suffix == ".gguf" or resolved.is_file()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                quantized: dict[str, QuantizedWeight] | None = None) -> nn.Module:
    """The family's module with uninitialized parameters of ``dtype`` on ``device``, the weights
    in ``quantized`` (``quantized.plan_quantization``) as uninitialized GGUF blocks."""
    with torch.device(device), _default_dtype(dtype):
        model = family_model(config)
        if quantized:
            quantize_modules(model, quantized, dtype)
    allocate_in_arena(model)
    return model


@dataclass(frozen=True)
class ModelInfo:
    """The one description of a model besides its weights: what the engine, the servers and a
    distributed engine's driver (which holds no weights) read."""

    config: ModelConfig
    tokenizer: Tokenizer | None
    eos_token_ids: list[int]  # every id that ends generation (end of turn included)
    max_model_len: int
    chat_template: str | None = None
    folder: Path | None = None  # a Hugging Face folder's safetensors checkpoint
    gguf: GGUFFile | None = None  # or a GGUF file's; neither for orca-tiny's random weights

    @property
    def checkpoint(self) -> Path | None:
        """Where the weights come from; None for a built-in random model."""
        return self.gguf.path if self.gguf is not None else self.folder

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def bos_token_id(self) -> int | None:
        """The tokenizer's begin of sequence (a chat template's ``bos_token``)."""
        return self.config.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own end of sequence (a chat template's ``eos_token``)."""
        return next(iter(self.config.eos_token_ids), None)

    def with_context(self, max_model_len: int | None) -> ModelInfo:
        """This description with its context capped at ``max_model_len`` (None: as it is);
        ValueError when that exceeds the model's."""
        if max_model_len is None:
            return self
        if max_model_len > self.max_model_len:
            raise ValueError(f"max_model_len {max_model_len} is longer than the model's context "
                             f"({self.max_model_len} tokens)")
        return dataclasses.replace(self, max_model_len=max_model_len)


def resolve_model_path(name_or_path: str) -> str | Path:
    """A built-in name as is, a built-in GGUF name as its installed file, a folder holding
    exactly one ``.gguf`` (and no config.json) as that file, anything else as a path."""
    if name_or_path in BUILTIN_MODELS:
        return name_or_path
    if name_or_path in BUILTIN_GGUF_MODELS:
        return builtin_gguf_path(name_or_path)
    path = Path(name_or_path)
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        if len(ggufs) > 1:
            raise ValueError(f"{path} holds {len(ggufs)} .gguf files "
                             f"({', '.join(g.name for g in ggufs)}); name one of them")
    return path


def load_model_info(name_or_path: str, with_gguf_tokenizer: bool = True) -> ModelInfo:
    """Config, tokenizer, stop ids and chat template of a built-in name, a model folder or a GGUF
    file, without reading any weights. ``with_gguf_tokenizer=False`` leaves a GGUF file's
    tokenizer out (None), for a load that builds it beside the weights."""
    resolved = resolve_model_path(name_or_path)
    if isinstance(resolved, str):
        config = ModelConfig.from_hf(BUILTIN_MODELS[resolved])
        return ModelInfo(config, builtin_tokenizer(), list(config.eos_token_ids),
                         config.max_model_len)
    if resolved.suffix == ".gguf" or resolved.is_file():
        return _gguf_info(GGUFFile(resolved), with_gguf_tokenizer)
    folder = resolved
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist (built-in models: "
                                f"{', '.join([*BUILTIN_MODELS, *BUILTIN_GGUF_MODELS])}; models "
                                "are never downloaded)")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json (and no .gguf file)")
    config = ModelConfig.from_hf(_read_json(config_file))
    tokenizer = Tokenizer.from_file(folder / "tokenizer.json")
    generation = folder / "generation_config.json"
    eos = list(config.eos_token_ids)
    if generation.is_file():
        eos_value = _read_json(generation).get("eos_token_id")
        eos_value = [eos_value] if isinstance(eos_value, int) else eos_value or []
        eos = list(dict.fromkeys([*eos_value, *eos]))
    return ModelInfo(config, tokenizer, eos, config.max_model_len, _chat_template(folder), folder)


def _gguf_info(file: GGUFFile, with_tokenizer: bool) -> ModelInfo:
    try:
        config = ModelConfig.from_hf(hf_config(file))
    except ValueError as e:
        raise ValueError(f"{file.path}: {e}") from None
    tokens = len(file.value("tokenizer.ggml.tokens") or ())
    if tokens > config.vocab_size:
        raise ValueError(f"{file.path}: the tokenizer has {tokens} tokens, more than the "
                         f"model's vocab_size {config.vocab_size}")
    tokenizer = gguf_tokenizer(file) if with_tokenizer else None
    # End-of-turn tokens (llama.cpp's eot / eom) stop generation as the end-of-sequence one does.
    eos = [int(file.value(f"tokenizer.ggml.{key}_token_id"))
           for key in ("eos", "eot", "eom") if file.value(f"tokenizer.ggml.{key}_token_id")
           is not None]
    return ModelInfo(config, tokenizer, list(dict.fromkeys(eos)), config.max_model_len,
                     file.value("tokenizer.chat_template"), gguf=file)


def open_checkpoint(info: ModelInfo) -> Checkpoint:
    """The weights of a model folder or GGUF file as a ``Checkpoint``."""
    if info.gguf is not None:
        return GGUFCheckpoint(info.gguf)
    if info.folder is None:
        raise ValueError("a built-in random model has no checkpoint")
    return SafetensorsCheckpoint(info.folder, model_family(info.config).canonical_hf_name)


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off: a load makes a few hundred thousand long-lived objects
    (a vocabulary's strings and merges, the modules), over which its passes would run again and
    again while they are made."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def load_model(name_or_path: str, dtype: torch.dtype | str = "float32",
               device: torch.device | str = "cpu",
               quantization: str | None = None) -> LoadedModel:
    """Load a built-in model (``orca-tiny``, ``smollm2-135m-instruct``), a Hugging Face model
    folder (config.json, *.safetensors or a sharded index, tokenizer.json, optional
    generation_config.json) or a GGUF file (or a folder holding exactly one). ``quantization``
    as ``quantized.py`` describes it: None runs a GGUF file's quantized tensors as stored."""
    with _cyclic_gc_paused():
        return _load_model(name_or_path, dtype, device, quantization)


def _load_model(name_or_path: str, dtype: torch.dtype | str, device: torch.device | str,
                quantization: str | None) -> LoadedModel:
    dtype = resolve_dtype(dtype, device, runs_quantized(name_or_path, quantization, device))
    if quantization is None and torch.device(device).type != "cpu":
        quantization = "none"
    info = load_model_info(name_or_path, with_gguf_tokenizer=False)
    tokenizer_build = None
    if info.gguf is not None:
        # Built on a second thread: the tokenizers library's BPE build holds the GIL, the
        # weights' copies release it, so the two overlap on a second core.
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gguf-tokenizer")
        tokenizer_build = pool.submit(gguf_tokenizer, info.gguf)
        pool.shutdown(wait=False)  # the thread ends with the build
    config = info.config
    family = model_family(config)
    weight_map = family.hf_weight_map(config)
    checkpoint = None if info.checkpoint is None else open_checkpoint(info)
    if checkpoint is not None:  # names first: the plan reads the stored types
        checkpoint.check_names(weight_map, config.architecture, family.IGNORED_HF_WEIGHTS)
    # The plan needs the modules' shapes and ties: those of a model built on the meta device.
    with torch.device("meta"), _default_dtype(dtype):
        shapes = family_model(config)
    plan = plan_quantization(shapes, weight_map, checkpoint, quantization)
    model = build_model(config, dtype, device, plan)
    if checkpoint is None:
        if plan:  # random weights, drawn in float and quantized as a checkpoint's would be
            _init_random_quantized(model, config, plan)
        else:
            init_random_weights(model)
    else:
        load_hf_weights(model, weight_map, checkpoint, family.IGNORED_HF_WEIGHTS, skip=plan)
        load_quantized_weights(model, weight_map, checkpoint, plan)
        if info.gguf is not None:
            info.gguf.release_pages()
    if plan:
        interleave_rows(model)
    if tokenizer_build is not None:
        info = dataclasses.replace(info, tokenizer=tokenizer_build.result())
    return LoadedModel(info, model)


def model_family(config: ModelConfig) -> ModuleType:
    """The family file describing ``config``'s model (``decoder_spec``, ``hf_weight_map``)."""
    return _FAMILIES[config.family]


def family_model(config: ModelConfig) -> Decoder:
    """The family's decoder, built under whatever device and dtype the caller set."""
    return Decoder(config, model_family(config).decoder_spec(config)).eval()


def _init_random_quantized(model: nn.Module, config: ModelConfig,
                           plan: dict[str, QuantizedWeight]) -> None:
    """A built-in random model's weights, drawn as for the float model, the planned ones
    quantized from the float32 draws."""
    from ..quantize import quantize_weight

    with _default_dtype(torch.float32):
        reference = family_model(config)
    init_random_weights(reference)
    weights = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        param.copy_(quantize_weight(weights[name], plan[name].format) if name in plan
                    else weights[name])


def save_pretrained_folder(loaded: LoadedModel, path: str | Path) -> Path:
    """Write ``loaded`` as a Hugging Face folder: config.json, model.safetensors,
    generation_config.json, tokenizer.json and tokenizer_config.json."""
    if any(p.dtype == torch.uint8 for p in loaded.model.parameters()):
        raise ValueError("save_pretrained_folder saves float weights; this model holds GGUF "
                         "blocks (load it with quantization='none' to save it)")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = loaded.config
    family = model_family(config)
    hf_config = {**config.hf_config, "dtype": str(loaded.dtype).removeprefix("torch.")}
    _write_json(folder / "config.json", hf_config)
    save_hf_weights(loaded.model, family.hf_weight_map(config), folder / "model.safetensors")
    eos = loaded.info.eos_token_ids
    _write_json(folder / "generation_config.json",
                {"bos_token_id": config.bos_token_id,
                 "eos_token_id": eos[0] if len(eos) == 1 else eos})
    loaded.tokenizer.save(folder / "tokenizer.json")
    tokenizer_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, token_id in (("bos_token", config.bos_token_id),
                          ("eos_token", eos[0] if eos else None)):
        if token_id is not None:
            tokenizer_config[key] = loaded.tokenizer.inner.id_to_token(token_id)
    if loaded.info.chat_template is not None:
        tokenizer_config["chat_template"] = loaded.info.chat_template
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
