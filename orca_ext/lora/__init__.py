"""LoRA adapters served together on one base model (S-LoRA / Punica's scheme on selective
batching): the base linears run once over the packed rows, and ``ops.lora_linear`` adds each
request's low-rank delta on its own rows.

- ``request.py``: ``LoRARequest`` (vLLM's), what a request names.
- ``adapter.py``: a PEFT folder read and checked against the model, its tensors placed into our
  fused linears' output ranges.
- ``slots.py``: the scheduler's bookkeeping of the ``max_loras`` slots a batch may use.
- ``layers.py``: a linear's slot weights and the step's per-request slots (``LoRABatch``).
- ``manager.py``: the runner's side: the adapters known, the CPU cache (``max_cpu_loras``,
  LRU) and which adapter each slot holds.
"""
from .request import LoRARequest

__all__ = ["LoRARequest"]
