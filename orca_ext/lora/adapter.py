"""A PEFT LoRA adapter read from its folder and checked against the model it will run on.

A folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``) and ``adapter_model.safetensors`` (``...<module>.lora_A.weight [r, in]`` and
``...<module>.lora_B.weight [out, r]`` under the base model's tensor names). The family's map from
its checkpoint names to our parameters (``hf_weight_map``) places each Hugging Face projection:
q / k / v go to their row ranges of our fused ``qkv``, gate / up to theirs of ``mlp.up``. A fused
linear's adapter is one low-rank pair: the parts' A matrices stacked, and a block-diagonal B
(each part's B on its own output rows and its own ranks).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..model.loader import model_family
from .request import LoRARequest

# Our linears an adapter may change, by their names inside a block.
LORA_LINEARS = ("attn.qkv", "attn.out", "mlp.up", "mlp.down")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class LinearPart:
    """Where a Hugging Face projection lands: our linear, its output rows, and its index among
    the linear's parts (ranks are laid out part by part)."""

    linear: str  # "layers.3.attn.qkv"
    part: int
    row_start: int
    rows: int


@dataclass
class LinearDelta:
    """One linear's low-rank pair in the pool's layout: ``a [rank, in]``, ``b_t [rank, out]``
    (B transposed), float32; a fused linear's parts occupy consecutive ranks."""

    a: torch.Tensor
    b_t: torch.Tensor


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    deltas: dict[str, LinearDelta]  # by our linear's name

    @property
    def num_bytes(self) -> int:
        return sum(d.a.nbytes + d.b_t.nbytes for d in self.deltas.values())


def lora_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The model's linears adapters may change, by name (``layers.{i}.attn.qkv`` ...)."""
    return {f"layers.{i}.{name}": block.get_submodule(name)
            for i, block in enumerate(model.layers) for name in LORA_LINEARS}


def linear_parts(model: nn.Module) -> dict[str, LinearPart]:
    """Hugging Face module name (``model.layers.0.self_attn.q_proj``) -> where it lands."""
    linears = lora_linears(model)
    parts: dict[str, LinearPart] = {}
    for ours, hf in model_family(model.config).hf_weight_map(model.config).items():
        linear = ours.removesuffix(".weight")
        if linear not in linears or not ours.endswith(".weight") or hf.transpose:
            continue
        out_features = linears[linear].weight.shape[0]
        sizes = hf.sizes or (out_features,) * len(hf.names)
        start = 0
        for index, (name, rows) in enumerate(zip(hf.names, sizes)):
            parts[name.removesuffix(".weight")] = LinearPart(linear, index, start, rows)
            start += rows
    return parts


def num_parts(model: nn.Module) -> dict[str, int]:
    """How many Hugging Face projections each adaptable linear is made of (qkv: 3)."""
    counts: dict[str, int] = dict.fromkeys(lora_linears(model), 1)
    for part in linear_parts(model).values():
        counts[part.linear] = max(counts[part.linear], part.part + 1)
    return counts


def _read_config(folder: Path, name: str, max_rank: int) -> tuple[int, float]:
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"adapter {name!r}: no {CONFIG_FILE} in {folder}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"adapter {name!r}: {config_file} is not valid JSON ({exc})") from None
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"adapter {name!r}: peft_type {peft_type!r} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"adapter {name!r}: rank {rank} is above max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)):
        raise ValueError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"adapter {name!r}: per-module {key} is not supported")
    if config.get("use_dora"):
        raise ValueError(f"adapter {name!r}: DoRA (use_dora) is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter {name!r}: bias={config['bias']!r} is not supported "
                         "(only 'none')")
    if config.get("modules_to_save"):
        raise ValueError(f"adapter {name!r}: modules_to_save {config['modules_to_save']} "
                         "(fully trained modules) is not supported")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _read_tensors(folder: Path, name: str) -> dict[str, torch.Tensor]:
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.is_file():
        other = " (adapter_model.bin is not supported)" if (folder / "adapter_model.bin").exists() \
            else ""
        raise ValueError(f"adapter {name!r}: no {WEIGHTS_FILE} in {folder}{other}")
    try:
        with safe_open(weights_file, framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"adapter {name!r}: cannot read {weights_file} ({exc})") from None


def load_peft_adapter(request: LoRARequest, model: nn.Module, max_rank: int) -> LoRAAdapter:
    """Read and check ``request``'s PEFT folder for ``model``; ValueError naming what is wrong
    (missing files, rank above ``max_rank``, modules or shapes the model does not have)."""
    folder = Path(request.lora_path)
    name = request.lora_name
    if not folder.is_dir():
        raise ValueError(f"adapter {name!r}: {request.lora_path!r} is not a folder (PEFT) or a "
                         "file (GGUF)")
    rank, scale = _read_config(folder, name, max_rank)
    tensors = _read_tensors(folder, name)
    parts = linear_parts(model)
    _check_targets(folder, name, {module.rsplit(".", 1)[-1] for module in parts})
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _LORA_KEY.match(key.removeprefix(_PEFT_PREFIX))
        if match is None:
            raise ValueError(f"adapter {name!r}: tensor {key!r} is not a LoRA A or B weight")
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    if not pairs:
        raise ValueError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return place_pairs(request, model, rank, scale, pairs)


def place_pairs(request: LoRARequest, model: nn.Module, rank: int, scale: float,
                pairs: dict[str, dict[str, torch.Tensor]]) -> LoRAAdapter:
    """An adapter from its A and B tensors by Hugging Face module name (``pairs[module]["A"]``
    ``[rank, in]``, ``["B"]`` ``[out, rank]``), checked against ``model``'s projections."""
    name = request.lora_name
    parts = linear_parts(model)
    for module in pairs:
        if module not in parts:
            raise ValueError(f"adapter {name!r}: module {module!r} is not an attention or MLP "
                             "projection of this model")
    linears = lora_linears(model)
    counts = num_parts(model)
    deltas: dict[str, LinearDelta] = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: module {module!r} lacks its lora_"
                             f"{'B' if 'A' in pair else 'A'} weight")
        part = parts[module]
        out_features, in_features = linears[part.linear].weight.shape[0], \
            _in_features(linears[part.linear])
        a, b = pair["A"], pair["B"]
        if a.shape != (rank, in_features) or b.shape != (part.rows, rank):
            raise ValueError(f"adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}, but this model needs [{rank}, {in_features}] "
                             f"and [{part.rows}, {rank}] (a different base model?)")
        delta = deltas.get(part.linear)
        if delta is None:
            ranks = counts[part.linear] * rank
            delta = deltas[part.linear] = LinearDelta(torch.zeros(ranks, in_features),
                                                      torch.zeros(ranks, out_features))
        ranks = slice(part.part * rank, (part.part + 1) * rank)
        delta.a[ranks] = a.float()
        delta.b_t[ranks, part.row_start:part.row_start + part.rows] = b.float().t()
    return LoRAAdapter(request, rank, scale, deltas)


def _check_targets(folder: Path, name: str, projections: set[str]) -> None:
    """A listed target module that is none of the model's projections (``lm_head``,
    ``embed_tokens``) is refused by name; a regex is left to the tensors' names."""
    targets = json.loads((folder / CONFIG_FILE).read_text()).get("target_modules") or []
    if isinstance(targets, str):
        return
    unknown = sorted(t for t in targets if t.rsplit(".", 1)[-1] not in projections)
    if unknown:
        raise ValueError(f"adapter {name!r}: target modules {unknown} are not attention or MLP "
                         f"projections of this model ({', '.join(sorted(projections))})")


def load_adapter(request: LoRARequest, model: nn.Module, max_rank: int) -> LoRAAdapter:
    """A PEFT folder, or a llama.cpp GGUF LoRA file (``gguf_adapter.py``)."""
    if Path(request.lora_path).is_file():
        from .gguf_adapter import load_gguf_adapter

        return load_gguf_adapter(request, model, max_rank)
    return load_peft_adapter(request, model, max_rank)


def _in_features(linear: nn.Module) -> int:
    return getattr(linear, "in_features", None) or linear.weight.shape[1]
