"""Megatron-style intra-layer parallelism, applied around an unchanged model (gpt-fast style).

A plan names the decoder's linear layers to split (module names below ``layers.N.``):
- column-parallel (split along the output dim, no communication): fused QKV, split by head in
  each of its q/k/v sections (so each rank keeps ``Hq/tp`` query heads and the ``Hkv/tp`` KV heads
  they read), and the MLP's first linear (gate and up split alike, so ``silu_and_mul`` stays local);
- row-parallel (split along the input dim, one all-reduce of the output; the bias is added by TP
  rank 0 only): attention output and MLP down projections;
- vocab-parallel: the token embedding (each rank looks up its vocab range, an all-reduce merges)
  and lm_head (each rank computes its vocab slice of the logits, an all-gather joins them for
  sampling). The vocab is padded to a multiple of ``tp`` with zero rows.
Everything else (norms, position embeddings, rotary tables) is replicated. Attention modules get
their ``num_heads`` / ``num_kv_heads`` divided by ``tp``; the KV cache holds the local KV heads.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..model.config import ModelConfig
from ..model.layers import LayerNorm, Linear, RMSNorm


@dataclass(frozen=True)
class Split:
    kind: str  # "replicate", "column", "row" or "vocab"
    sections: tuple[int, ...] = ()  # column: dim-0 sections, each split evenly (fused layers)


REPLICATE, ROW, VOCAB = Split("replicate"), Split("row"), Split("vocab")
_LAYER_PREFIX = re.compile(r"^layers\.\d+\.")


def tp_plan(config: ModelConfig) -> dict[str, Split]:
    """Module name (without ``layers.N.``) -> how its weight is split, for the decoder's block
    (``model/decoder.py``; a gated MLP's gate and up rows split alike)."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    gated = config.activation.endswith("_and_mul")
    return {"attn.qkv": Split("column", (q, kv, kv)), "attn.out": ROW,
            "mlp.up": Split("column", (inter, inter) if gated else (inter,)), "mlp.down": ROW,
            "embed": VOCAB, "lm_head": VOCAB}


def param_split(plan: dict[str, Split], name: str) -> Split:
    """How parameter ``name`` (e.g. ``layers.3.attn.out.bias``) is split."""
    module, _, kind = name.rpartition(".")
    split = plan.get(_LAYER_PREFIX.sub("", module), REPLICATE)
    if split.kind == "row" and kind != "weight":
        return REPLICATE  # a row-parallel bias is added once, after the all-reduce
    return split


@dataclass(frozen=True)
class ShardRanges:
    """What one rank keeps of a full parameter: dim-0 row ranges (concatenated), an optional
    dim-1 column range, and zero rows padded at the end."""

    rows: tuple[tuple[int, int], ...]
    cols: tuple[int, int] | None = None
    pad_rows: int = 0


def shard_ranges(split: Split, shape: tuple[int, ...], rank: int, tp: int) -> ShardRanges:
    if tp == 1 or split.kind == "replicate":
        return ShardRanges(((0, shape[0]),))
    if split.kind == "column":
        sections = split.sections or (shape[0],)
        if sum(sections) != shape[0] or any(s % tp for s in sections):
            raise ValueError(f"cannot split sections {sections} of a {tuple(shape)} tensor "
                             f"{tp} ways")
        rows, offset = [], 0
        for size in sections:
            piece = size // tp
            rows.append((offset + rank * piece, offset + (rank + 1) * piece))
            offset += size
        return ShardRanges(tuple(rows))
    if split.kind == "row":
        if shape[1] % tp:
            raise ValueError(f"cannot split the {shape[1]} input features of a {tuple(shape)} "
                             f"tensor {tp} ways")
        piece = shape[1] // tp
        return ShardRanges(((0, shape[0]),), (rank * piece, (rank + 1) * piece))
    if split.kind == "vocab":
        per_rank = -(-shape[0] // tp)
        start = min(shape[0], rank * per_rank)
        stop = min(shape[0], start + per_rank)
        return ShardRanges(((start, stop),), None, per_rank - (stop - start))
    raise ValueError(f"unknown split {split.kind!r}")


def take_shard(read: Callable[[int, int, tuple[int, int] | None], torch.Tensor],
               ranges: ShardRanges) -> torch.Tensor:
    """Assemble a shard from ``read(row_start, row_stop, cols)`` calls (rows of the full
    parameter, restricted to ``cols`` when given)."""
    parts = [read(a, b, ranges.cols) for a, b in ranges.rows]
    if ranges.pad_rows:
        parts.append(parts[0].new_zeros((ranges.pad_rows, *parts[0].shape[1:])))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def shard_tensor(full: torch.Tensor, split: Split, rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of a full parameter value."""
    def read(a: int, b: int, cols: tuple[int, int] | None) -> torch.Tensor:
        rows = full[a:b]
        return rows if cols is None else rows[:, cols[0]:cols[1]]

    return take_shard(read, shard_ranges(split, tuple(full.shape), rank, tp)).contiguous()


class TPGroup:
    """A stage's tensor-parallel ranks: all-reduce and all-gather, identical on every rank.

    NCCL runs its own collectives. On gloo (CPU) every rank sends its tensor to each peer and
    sums (or joins) the parts in rank order: a gloo collective goes through the process group's
    worker thread and costs about ten send/recv round trips for the small tensors of a decode
    step, which dominated a TP=2 iteration.
    """

    def __init__(self, group: object, ranks: list[int], index: int, backend: str) -> None:
        self.group, self.ranks, self.index, self.backend = group, ranks, index, backend
        self.size = len(ranks)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = x.contiguous()
        peers = [(i, r) for i, r in enumerate(self.ranks) if i != self.index]
        sends = [dist.isend(x, r, group=self.group) for _, r in peers]
        parts = [x] * self.size
        for i, r in peers:
            parts[i] = torch.empty_like(x)
            dist.recv(parts[i], r, group=self.group)
        for work in sends:
            work.wait()
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend != "gloo":
            dist.all_reduce(x, group=self.group)
            return x
        parts = self._exchange(x)
        out = parts[0] + parts[1]
        for part in parts[2:]:
            out += part
        return out

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.backend != "gloo":
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            return parts
        return self._exchange(x)


class RowParallelLinear(nn.Module):
    """``x`` holds this rank's slice of the input features; the partial products are summed
    across the TP group (one all-reduce). TP rank 0 adds the bias and the residual. With LoRA,
    each rank adds its adapter rows' delta from its slice of A (``lora/shard.py``) to its partial
    product, before the sum."""

    # Its LoRA adapter slots (``lora.layers.LinearLoRA``), set on an engine with enable_lora.
    lora: Any = None

    def __init__(self, linear: nn.Module, group: TPGroup) -> None:
        super().__init__()
        if linear.activation != "none":
            raise ValueError("a row-parallel linear cannot fuse an activation before the sum")
        self.weight = linear.weight
        self.bias = linear.bias if group.index == 0 else None
        self.group = group

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        residual = residual if self.group.index == 0 else None
        partial = ops.packed_linear(x, self.weight, self.bias, "none", residual)
        if self.lora is not None and self.lora.batch.active:
            batch = self.lora.batch
            ops.lora_linear(partial, x, self.lora.a, self.lora.b_t, batch.scales,
                            batch.cu_seg_lens, batch.seg_slots)
        return self.group.all_reduce(partial)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + num_local)`` of the vocabulary; ids outside give zeros, and the
    all-reduce fills in every rank's rows."""

    def __init__(self, weight: nn.Parameter, start: int, num_local: int, group: TPGroup) -> None:
        super().__init__()
        self.weight, self.start, self.num_local, self.group = weight, start, num_local, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(out)


class VocabParallelLMHead(nn.Module):
    """float32 logits of this rank's vocab slice (``ops.logits_linear``), all-gathered into
    ``[S, vocab]`` for sampling; in the model's place of ``Linear.logits``."""

    def __init__(self, linear: nn.Module, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        if linear.bias is not None or linear.activation != "none":
            raise ValueError("a vocab-parallel lm_head has no bias or activation")
        self.weight, self.vocab_size, self.group = linear.weight, vocab_size, group

    def logits(self, x: torch.Tensor, norm: LayerNorm | RMSNorm | None = None) -> torch.Tensor:
        norm_args = () if norm is None else norm.fused_args()
        parts = self.group.all_gather(ops.logits_linear(x, self.weight, *norm_args))
        return torch.cat(parts, dim=1)[:, :self.vocab_size]


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)


def parallelize(model: nn.Module, config: ModelConfig, group: TPGroup | None,
                keep: Callable[[str], bool]) -> None:
    """Swap in the row- and vocab-parallel modules and divide the attention head counts; the
    parameters must already be this rank's shards. ``keep(name)`` says which modules this stage
    runs (the others are left alone)."""
    if group is None or group.size == 1:
        return
    rank, tp = group.index, group.size
    plan = tp_plan(config)
    for name, module in list(model.named_modules()):
        split = plan.get(_LAYER_PREFIX.sub("", name))
        if split is None or not keep(name):
            continue
        if split.kind == "row":
            _set_module(model, name, RowParallelLinear(module, group))
        elif split.kind == "vocab":
            ranges = shard_ranges(VOCAB, (config.vocab_size,), rank, tp)
            (start, stop), = ranges.rows
            if isinstance(module, Linear):
                _set_module(model, name, VocabParallelLMHead(module, config.vocab_size, group))
            else:
                _set_module(model, name, VocabParallelEmbedding(module.weight, start,
                                                                stop - start, group))
    for module in model.modules():
        for attr in ("num_heads", "num_kv_heads"):
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, getattr(module, attr) // tp)
