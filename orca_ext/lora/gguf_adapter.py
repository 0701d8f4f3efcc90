"""llama.cpp's GGUF LoRA files (``convert_lora_to_gguf.py``'s output): ``general.type =
adapter``, ``adapter.type = lora``, ``adapter.lora.alpha``, and per adapted projection
``blk.{i}.{attn_q|...}.weight.lora_a`` ``[r, in]`` and ``.lora_b`` ``[out, r]``. llama.cpp
scales by alpha / r (alpha 0: 1). Its Llama converter permutes q and k rows for its rotary
layout, lora_b's included; they are put back in Hugging Face's order here, as the base's are."""
from __future__ import annotations

import torch
from torch import nn

from ..model.gguf import _BLOCK_NAMES, ARCHITECTURES, GGUFFile, _unpermute_rotary
from .adapter import LoRAAdapter, place_pairs
from .request import LoRARequest


def _tensor(file: GGUFFile, name: str) -> torch.Tensor:
    from gguf.quants import dequantize

    tensor = file.tensors[name]
    values = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float()
    return values.reshape(tuple(int(n) for n in reversed(tensor.shape)))


def load_gguf_adapter(request: LoRARequest, model: nn.Module, max_rank: int) -> LoRAAdapter:
    name = request.lora_name
    try:
        file = GGUFFile(request.lora_path)
    except ValueError as exc:
        raise ValueError(f"adapter {name!r}: {exc}") from None
    if file.value("general.type") != "adapter" or file.value("adapter.type") != "lora":
        raise ValueError(f"adapter {name!r}: {request.lora_path} is not a GGUF LoRA adapter "
                         f"(general.type {file.value('general.type')!r}, adapter.type "
                         f"{file.value('adapter.type')!r})")
    if ARCHITECTURES[file.architecture] != model.config.architecture:
        raise ValueError(f"adapter {name!r}: made for a {file.architecture} model, but the base "
                         f"is {model.config.architecture}")
    blocks = _BLOCK_NAMES[file.architecture]
    heads = {"attn_q": model.config.num_heads, "attn_k": model.config.num_kv_heads}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name in file.tensors:
        base, _, kind = tensor_name.rpartition(".")
        parts = base.split(".")
        if kind not in ("lora_a", "lora_b") or len(parts) != 4 or parts[0] != "blk" \
                or parts[3] != "weight" or parts[2] not in blocks:
            raise ValueError(f"adapter {name!r}: tensor {tensor_name!r} is not a LoRA A or B "
                             "of an attention or MLP projection")
        module = f"model.layers.{parts[1]}.{blocks[parts[2]]}"
        values = _tensor(file, tensor_name)
        if kind == "lora_b" and file.architecture == "llama" and parts[2] in heads:
            values = _unpermute_rotary(values, heads[parts[2]])
        pairs.setdefault(module, {})["A" if kind == "lora_a" else "B"] = values
    ranks = {p["A"].shape[0] for p in pairs.values() if "A" in p}
    if len(ranks) != 1:
        raise ValueError(f"adapter {name!r}: its lora_a tensors must share one rank, got "
                         f"{sorted(ranks) or 'none'}")
    rank = ranks.pop()
    if rank > max_rank:
        raise ValueError(f"adapter {name!r}: rank {rank} is above max_lora_rank {max_rank}")
    alpha = float(file.value("adapter.lora.alpha", 0.0))
    return place_pairs(request, model, rank, alpha / rank if alpha else 1.0, pairs)
