"""The driver's side of LoRA adapters (it holds no weights): ``DriverLoRA`` checks each adapter
against the whole model's shapes (a model on the meta device), keeps the adapters known, and
tells the workers through the control plane, in order with the batches, so a batch reaches
every worker after the adapters its requests use; each worker then reads its own share of the
adapter's files (``lora/shard.py``), which must be at the same path on every node, as the
model's are."""
from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from ..lora.adapter import load_adapter
from ..lora.manager import KnownAdapters
from ..lora.request import LoRARequest
from .messages import AddLoRA, RemoveLoRA

_log = logging.getLogger(__name__)


class DriverLoRA(KnownAdapters):
    """``Engine.lora`` of a distributed engine: ``add`` / ``remove`` / ``known`` / ``by_name``
    as the in-process ``LoRAManager`` has them; ``send`` puts a message on the control plane."""

    def __init__(self, reference: nn.Module, max_lora_rank: int,
                 send: Callable[[AddLoRA | RemoveLoRA], None]) -> None:
        super().__init__()
        self.reference, self.max_lora_rank, self.send = reference, max_lora_rank, send

    def add(self, request: LoRARequest) -> None:
        """Know ``request``'s adapter, checked now (ValueError naming what is wrong; nothing
        changes, on the workers neither), and have every worker read its share."""
        if not self._check_new(request):
            return
        adapter = load_adapter(request, self.reference, self.max_lora_rank)
        with self._lock:
            if not self._check_new(request):
                return
            self.send(AddLoRA(request))
            self.known[request.lora_int_id] = request
        _log.info("LoRA adapter %r (id %d, rank %d) from %s, sent to the workers",
                  request.lora_name, request.lora_int_id, adapter.rank, request.lora_path)

    def remove(self, lora_int_id: int) -> LoRARequest:
        """Forget an adapter (KeyError if unknown), on the workers too."""
        with self._lock:
            request = self.known[lora_int_id]
            self.send(RemoveLoRA(lora_int_id))
            return self.known.pop(lora_int_id)
