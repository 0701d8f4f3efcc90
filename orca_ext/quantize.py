"""Float weights to and from the GGUF blocks ``ops.quantized_linear`` reads (q8_0, q4_0, q4_1),
through llama.cpp's own ``gguf.quants``: the bytes a GGUF file of the same weights would hold."""
from __future__ import annotations

import numpy as np
import torch

BLOCK_SIZE = 32
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


def _quant_type(format: str):
    from gguf import GGMLQuantizationType

    if format not in BLOCK_BYTES:
        raise ValueError(f"format must be one of {sorted(BLOCK_BYTES)}, got {format!r}")
    return GGMLQuantizationType[format.upper()]


def quantize_weight(weight: torch.Tensor, format: str) -> torch.Tensor:
    """uint8 ``[N, K / 32 * block_bytes]``: each row of the float ``weight [N, K]`` (K a
    multiple of 32) as ``format``'s blocks, rounded as llama.cpp's reference quantizer does."""
    from gguf import quants

    qtype = _quant_type(format)
    if weight.dim() != 2 or weight.shape[1] % BLOCK_SIZE != 0:
        raise ValueError(f"weight must be [N, K] with K a multiple of {BLOCK_SIZE}, got shape "
                         f"{tuple(weight.shape)}")
    data = weight.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    return torch.from_numpy(np.ascontiguousarray(quants.quantize(data, qtype)))


def dequantize_weight(qweight: torch.Tensor, format: str, in_features: int) -> torch.Tensor:
    """float32 ``[N, in_features]``: the weights the blocks ``qweight`` (from ``quantize_weight``
    or a GGUF file) hold, through ``gguf.quants.dequantize``."""
    from gguf import quants

    qtype = _quant_type(format)
    row_bytes = in_features // BLOCK_SIZE * BLOCK_BYTES[format]
    if qweight.dim() != 2 or in_features % BLOCK_SIZE or qweight.shape[1] != row_bytes:
        raise ValueError(f"qweight must be uint8 [N, {row_bytes}] for in_features = "
                         f"{in_features} in {format}, got shape {tuple(qweight.shape)}")
    data = qweight.detach().to(device="cpu", dtype=torch.uint8).contiguous().numpy()
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, qtype)))
