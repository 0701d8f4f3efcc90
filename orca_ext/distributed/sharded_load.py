"""A worker's weights: only the parameters its stage runs, and of each only its TP shard.

The model is built with every parameter on the meta device (no memory), then each needed
parameter is replaced by its shard: read straight from the checkpoint with safetensors'
``get_slice`` (only the shard's bytes are read), or, for the built-in random model, drawn exactly
as a single process draws it (one full tensor at a time) and sliced. Tied parameters stay tied.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..model.builtin import init_random_weights
from ..model.config import ModelConfig
from ..model.loader import ModelInfo, build_model, model_family, open_checkpoint
from .tensor_parallel import (ShardRanges, param_split, shard_ranges, shard_tensor, take_shard,
                              tp_plan)


class _ParamsOnMeta(TorchFunctionMode):
    """Parameters are created by ``torch.empty`` (layers.py): put those on the meta device;
    computed buffers (rotary tables) stay real."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.empty:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def build_meta_model(config: ModelConfig, dtype: torch.dtype,
                     device: torch.device | str) -> nn.Module:
    with _ParamsOnMeta():
        return build_model(config, dtype, device)


def load_shards(model: nn.Module, info: ModelInfo, keep: Callable[[str], bool], rank: int,
                tp: int, dtype: torch.dtype, device: torch.device | str) -> None:
    """Replace every parameter that ``keep(name)`` wants by this rank's shard on ``device``."""
    aliases: dict[int, list[str]] = {}
    params: dict[str, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
        params.setdefault(name, param)
    # A tied parameter goes by its first name (the one named_parameters() and the weight map use).
    wanted = {names[0]: names for names in aliases.values() if any(keep(n) for n in names)}
    plan = tp_plan(info.config) if tp > 1 else {}

    def ranges(name: str) -> ShardRanges:
        return shard_ranges(param_split(plan, name), tuple(params[name].shape), rank, tp)

    if info.checkpoint is None:
        shards = _random_shards(model, wanted, plan, rank, tp)
    else:
        shards = _checkpoint_shards(info, params, wanted, ranges)
    for name, names in wanted.items():
        shard = nn.Parameter(shards.pop(name).to(device=device, dtype=dtype).contiguous(),
                             requires_grad=False)
        for alias in names:
            owner, _, attr = alias.rpartition(".")
            setattr(model.get_submodule(owner), attr, shard)


class _Capture:
    """Stands in for a parameter in ``init_random_weights``: keeps the shard of what it is
    given."""

    def __init__(self, name: str, param: nn.Parameter, sink: Callable[[str, torch.Tensor], None]):
        self.name, self.shape, self._dim, self._sink = name, param.shape, param.dim(), sink

    def dim(self) -> int:
        return self._dim

    def copy_(self, value: torch.Tensor) -> None:
        self._sink(self.name, value)


class _CaptureModel:
    def __init__(self, items: list[tuple[str, _Capture]]) -> None:
        self._items = items

    def named_parameters(self):
        return iter(self._items)


def _random_shards(model: nn.Module, wanted: dict[str, list[str]], plan: dict, rank: int,
                   tp: int) -> dict[str, torch.Tensor]:
    shards: dict[str, torch.Tensor] = {}

    def sink(name: str, value: torch.Tensor) -> None:
        if name in wanted:
            shards[name] = shard_tensor(value, param_split(plan, name), rank, tp)

    init_random_weights(_CaptureModel([(name, _Capture(name, p, sink))
                                       for name, p in model.named_parameters()]))
    return shards


def _checkpoint_shards(info: ModelInfo, params: dict[str, nn.Parameter],
                       wanted: dict[str, list[str]],
                       ranges: Callable[[str], ShardRanges]) -> dict[str, torch.Tensor]:
    config = info.config
    family = model_family(config)
    weight_map = family.hf_weight_map(config)
    shards = {}
    with open_checkpoint(info) as checkpoint:
        checkpoint.check_names(weight_map, config.architecture, family.IGNORED_HF_WEIGHTS)
        for name in wanted:
            spec, shape = weight_map[name], tuple(params[name].shape)
            parts, offset = [], 0
            for rows, piece in checkpoint.parts(spec, shape):
                parts.append((offset, rows, piece))
                offset += rows
            shard = take_shard(_part_reader(parts, spec.transpose, shape), ranges(name))
            shards[name] = shard.float() + spec.shift if spec.shift else shard
    return shards


def _part_reader(parts: list[tuple[int, int, Any]], transpose: bool, shape: tuple[int, ...]):
    """``read(a, b, cols)`` over a parameter stored as the dim-0 concatenation of ``parts``
    (each ``(offset, rows, safetensors slice)``, stored ``[in, out]`` when ``transpose``)."""
    def read(a: int, b: int, cols: tuple[int, int] | None) -> torch.Tensor:
        pieces = []
        for offset, rows, piece in parts:
            lo, hi = max(a, offset) - offset, min(b, offset + rows) - offset
            if lo >= hi:
                continue
            if len(shape) == 1:
                pieces.append(piece[lo:hi])
            elif transpose:
                pieces.append((piece[:, lo:hi] if cols is None
                               else piece[cols[0]:cols[1], lo:hi]).t())
            else:
                pieces.append(piece[lo:hi] if cols is None else piece[lo:hi, cols[0]:cols[1]])
        if not pieces:
            width = shape[1:] if cols is None else (cols[1] - cols[0],)
            return torch.zeros((0, *width))
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    return read
