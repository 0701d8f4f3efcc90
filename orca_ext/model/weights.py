"""Moving weights between our modules and Hugging Face safetensors checkpoints.

Each family file gives a map: our parameter name -> ``HFWeight`` (the checkpoint tensors it is
made of). Fused parameters (QKV, gate+up) are the concatenation of theirs along dim 0.
"""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

_MAX_LISTED = 8


class HFWeight(NamedTuple):
    names: tuple[str, ...]  # checkpoint tensor names, in concatenation order
    transpose: bool = False  # stored [in, out] (GPT-2's Conv1D)
    sizes: tuple[int, ...] | None = None  # rows each name contributes (None: one whole tensor)
    shift: float = 0.0  # added to the stored values (Gemma's norms store w for a scale of 1 + w)


def _listed(names: list[str]) -> str:
    more = f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def safetensors_index(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the .safetensors file holding it (single or sharded)."""
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = {name: folder / file for name, file in weight_map.items()}
        absent = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if absent:
            raise FileNotFoundError(f"{index_file} names shard files that are missing: "
                                    f"{_listed(absent)}")
        return files
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors weights in {folder} (other weight formats "
                                "such as pytorch_model.bin are not supported)")
    files = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), shard))
    return files


class Checkpoint(ABC):
    """Tensors under their (canonical) Hugging Face names, in Hugging Face layout, read on
    demand: a safetensors folder or a GGUF file."""

    source: str  # the folder or file, for messages

    @abstractmethod
    def names(self) -> list[str]: ...

    @abstractmethod
    def get_slice(self, name: str) -> Any:
        """A lazy view with ``get_shape()`` and ``[a:b]`` / ``[:, a:b]`` indexing that reads
        only what it returns where the format allows."""

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[:]

    def close(self) -> None:
        """Release open files (a checkpoint may be used again after; it reopens them)."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def parts(self, spec: HFWeight, shape: tuple[int, ...]) -> list[tuple[int, Any]]:
        """(rows, lazy slice) of each checkpoint tensor a parameter of ``shape`` is made of,
        each checked against the shape the config gives it; a ValueError naming it otherwise."""
        out = []
        for name, rows in zip(spec.names, spec.sizes or (shape[0],)):
            piece = self.get_slice(name)
            expected = (rows, *shape[1:])
            if spec.transpose:
                expected = expected[::-1]
            if tuple(piece.get_shape()) != expected:
                raise ValueError(f"{self.source}: tensor {name!r} has shape "
                                 f"{tuple(piece.get_shape())}, expected {expected} from the "
                                 "config")
            out.append((rows, piece))
        return out

    def check_names(self, weight_map: dict[str, HFWeight], architecture: str,
                    ignored: re.Pattern[str]) -> None:
        """Every tensor the map needs is here, and every tensor here is used (or knowingly
        ignored); a ValueError naming them otherwise."""
        present = set(self.names())
        wanted = [n for w in weight_map.values() for n in w.names]
        missing = [n for n in wanted if n not in present]
        if missing:
            raise ValueError(f"{self.source}: checkpoint lacks tensors that {architecture} "
                             f"needs: {_listed(missing)}")
        # A checkpoint may store a tied lm_head (a copy of the embedding) anyway.
        unexpected = [n for n in sorted(present - set(wanted))
                      if not ignored.search(n) and n != "lm_head.weight"]
        if unexpected:
            raise ValueError(f"{self.source}: checkpoint has tensors that {architecture} with "
                             f"this config does not use: {_listed(unexpected)}")


class SafetensorsCheckpoint(Checkpoint):
    """A Hugging Face folder's ``*.safetensors`` (single or sharded), names passed through the
    family's ``canonical_name``."""

    def __init__(self, folder: Path, canonical_name: Callable[[str], str]) -> None:
        self.source = str(folder)
        self._files = {canonical_name(name): (name, path)
                       for name, path in safetensors_index(folder).items()}
        self._handles: dict[Path, Any] = {}

    def names(self) -> list[str]:
        return list(self._files)

    def get_slice(self, name: str) -> Any:
        stored_name, path = self._files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path].get_slice(stored_name)

    def close(self) -> None:
        self._handles.clear()


def load_hf_weights(model: nn.Module, weight_map: dict[str, HFWeight], checkpoint: Checkpoint,
                    ignored: re.Pattern[str], skip: Collection[str] = ()) -> None:
    """Fill ``model``'s float parameters from ``checkpoint``; every parameter must be found with
    the right shape, and every checkpoint tensor used (or knowingly ignored). The parameters in
    ``skip`` (a quantized layer's blocks: ``quantized.load_quantized_weights``) are left as
    they are."""
    checkpoint.check_names(weight_map, model.config.architecture, ignored)
    params = dict(model.named_parameters())
    with checkpoint:
        for our_name, spec in weight_map.items():
            if our_name in skip:
                continue
            param = params[our_name]
            rows = 0  # each part straight into its rows (a fused weight's parts one after another)
            for size, piece in checkpoint.parts(spec, tuple(param.shape)):
                part = piece[:].t() if spec.transpose else piece[:]
                param[rows:rows + size].copy_(part.float() + spec.shift if spec.shift else part)
                rows += size


def save_hf_weights(model: nn.Module, weight_map: dict[str, HFWeight], file: Path) -> None:
    """Write ``model``'s parameters as one Hugging Face-named safetensors file."""
    params = dict(model.named_parameters())
    tensors = {}
    for our_name, spec in weight_map.items():
        param = params[our_name].detach().cpu()
        if spec.shift:
            param = param - spec.shift
        parts = param.split(list(spec.sizes)) if spec.sizes else (param,)
        for name, part in zip(spec.names, parts):
            tensors[name] = (part.t() if spec.transpose else part).contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})
