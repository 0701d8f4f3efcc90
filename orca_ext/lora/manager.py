"""The runner's side of LoRA: the adapters known, their tensors kept on the CPU (at most
``max_cpu_loras``, least recently used dropped and read again from disk when needed), and which
adapter each of the ``max_loras`` slots holds. The scheduler decides the slots (``slots.py``); a
slot is filled before the first step of the first request that uses it. A distributed worker's
manager keeps its share of each adapter (``shard.py``); the driver, which holds no weights,
checks adapters and tells the workers (``distributed/lora.py``)."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from torch import nn

from .adapter import LoRAAdapter, load_adapter, lora_linears, num_parts
from .layers import LinearLoRA, LoRABatch
from .request import LoRARequest

if TYPE_CHECKING:
    from .shard import AdapterShard

_log = logging.getLogger(__name__)


class KnownAdapters:
    """The adapters an engine knows, by ``lora_int_id``; ids and names are each one adapter's."""

    def __init__(self) -> None:
        self.known: dict[int, LoRARequest] = {}  # by lora_int_id
        # Adapters are added and removed from the servers' threads while the loop runs steps.
        self._lock = threading.Lock()

    def _check_new(self, request: LoRARequest) -> bool:
        """True if ``request`` is not known yet; ValueError if its id or name is another's."""
        known = self.known.get(request.lora_int_id)
        if known is not None:
            if known != request:
                raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter "
                                 f"{known.lora_name!r} at {known.lora_path!r}")
            return False
        for other in self.known.values():
            if other.lora_name == request.lora_name:
                raise ValueError(f"lora_name {request.lora_name!r} is already adapter "
                                 f"{other.lora_int_id}")
        return True

    def by_name(self, lora_name: str) -> LoRARequest | None:
        return next((r for r in self.known.values() if r.lora_name == lora_name), None)


class LoRAManager(KnownAdapters):
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, shard: AdapterShard | None = None) -> None:
        super().__init__()
        self.model, self.shard = model, shard
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, \
            max_cpu_loras
        linears = lora_linears(model)
        device = next(iter(linears.values())).weight.device
        self.batch = LoRABatch(max_loras, device)
        self.linears: dict[str, LinearLoRA] = {}
        counts = num_parts(model)
        for name, linear in linears.items():
            # A tensor-parallel rank's shapes: its shard of the output (column-parallel) or of
            # the input (row-parallel) features.
            out_features = linear.weight.shape[0]
            in_features = getattr(linear, "in_features", None) or linear.weight.shape[1]
            linear.lora = self.linears[name] = LinearLoRA(
                self.batch, max_loras, counts[name] * max_lora_rank, in_features, out_features,
                device)
        self._cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._slot_adapter = [0] * max_loras  # lora_int_id whose weights each slot holds

    # --- adapters ------------------------------------------------------------------------------

    def add(self, request: LoRARequest) -> None:
        """Know ``request``'s adapter, reading and checking it now unless it is known already;
        ValueError (nothing changed) for a bad adapter or an id / name taken by another."""
        if not self._check_new(request):
            return
        adapter = self._read(request)
        with self._lock:
            if not self._check_new(request):
                return
            self.known[request.lora_int_id] = request
            self._cache(adapter)
        _log.info("LoRA adapter %r (id %d, rank %d) from %s", request.lora_name,
                  request.lora_int_id, adapter.rank, request.lora_path)

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        if self.shard is not None:
            return self.shard.read(request, self.max_lora_rank)
        return load_adapter(request, self.model, self.max_lora_rank)

    def remove(self, lora_int_id: int) -> LoRARequest:
        """Forget an adapter (KeyError if unknown); a slot holding it is refilled when reused."""
        with self._lock:
            request = self.known.pop(lora_int_id)
            self._cpu.pop(lora_int_id, None)
            self._slot_adapter = [0 if a == lora_int_id else a for a in self._slot_adapter]
            return request

    @property
    def cpu_adapters(self) -> list[int]:
        """The ids whose tensors are kept on the CPU, least recently used first."""
        return list(self._cpu)

    def _cache(self, adapter: LoRAAdapter) -> None:
        self._cpu[adapter.request.lora_int_id] = adapter
        self._cpu.move_to_end(adapter.request.lora_int_id)
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)

    def _adapter(self, lora_int_id: int) -> LoRAAdapter:
        with self._lock:
            adapter = self._cpu.get(lora_int_id)
            request = self.known[lora_int_id]
        if adapter is None:  # dropped from the CPU cache: read again
            adapter = self._read(request)
        with self._lock:
            self._cache(adapter)
        return adapter

    # --- slots and steps -----------------------------------------------------------------------

    def activate(self, slot: int, lora_int_id: int) -> None:
        """Make ``slot`` hold adapter ``lora_int_id`` (no work if it does already)."""
        if self._slot_adapter[slot] == lora_int_id:
            return
        adapter = self._adapter(lora_int_id)
        for name, lora in self.linears.items():
            delta = adapter.deltas.get(name)
            lora.a[slot].zero_()
            lora.b_t[slot].zero_()
            if delta is not None:
                ranks = delta.a.shape[0]
                lora.a[slot, :ranks].copy_(delta.a)
                lora.b_t[slot, :ranks].copy_(delta.b_t)
        self.batch.scales[slot] = adapter.scale
        self._slot_adapter[slot] = lora_int_id

    def slot_adapter(self, slot: int) -> int:
        return self._slot_adapter[slot]

    def set_step(self, cu_q_lens: torch.Tensor, seg_slots: torch.Tensor | None) -> None:
        self.batch.set(cu_q_lens, seg_slots)

    def clear_step(self) -> None:
        self.batch.clear()
