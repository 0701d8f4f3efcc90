"""Float weights to and from the GGUF blocks ``ops.quantized_linear`` reads, through llama.cpp's
own ``gguf.quants``: the bytes a GGUF file of the same weights would hold.

The formats, by ggml's type names: blocks of 32 weights (q8_0, q4_0, q4_1, q5_0, q5_1) and
super-blocks of 256 (the K-quants q4_K, q5_K, q6_K); and orca's own q8_m (blocks of 32 uint8
quants with an fp16 scale d and min m, w = q d + m), which holds every 32-weight format's blocks
exactly. ``quantize_weight`` makes q8_0, q4_0 and q4_1 (the formats a model is quantized to at
load); ``dequantize_weight`` reads them all; ``as_exact`` rewrites 32-weight blocks as the q8_0
(from q4_0 / q5_0 / iq4_nl, which no kernel reads) or q8_m blocks of the same weights, and
``iq4_xs_as_q8_0`` IQ4_XS super-blocks as q8_0 within float16's rounding of their scales."""
from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

# Each format's weights per block and bytes per block, as ggml-common.h lays them out.
BLOCK_LAYOUTS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22),
                 "q5_1": (32, 24), "q8_m": (32, 36), "q4_K": (256, 144), "q5_K": (256, 176),
                 "q6_K": (256, 210)}
# IQ4_NL (ggml's block_iq4_nl: an fp16 d, then 16 bytes of 4-bit indices into these values,
# low nibbles first): no kernel reads it, but q8_0 holds its blocks exactly (as_exact).
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# The layouts of every format a weight's blocks are read in: the kernels', IQ4_NL and IQ4_XS.
STORED_LAYOUTS = {**BLOCK_LAYOUTS, "iq4_nl": (32, 18), "iq4_xs": (256, 136)}
# The formats GGUF files store (ggml's types; q8_m is orca's own).
GGUF_FORMATS = tuple(f for f in BLOCK_LAYOUTS if f != "q8_m")
# The formats quantize_weight makes.
QUANTIZE_FORMATS = ("q8_0", "q4_0", "q4_1")
# ``quantization``'s values besides None (``model/quantized.py`` says what each does).
QUANTIZATIONS = ("none", *QUANTIZE_FORMATS)
# The formats whose blocks q8_0 holds exactly (w = (q - offset) d, the same d) and those q8_m
# holds exactly (every 32-weight one), by the offset of their unsigned quants q (q8_0's int8
# read as uint8 + 128; None where the block stores a min m: w = q d + m): as_exact rewrites them.
EXACT_IN_Q8_0 = {"q8_0": 128, "q4_0": 8, "q5_0": 16, "iq4_nl": 128}
EXACT_IN_Q8_M = {**EXACT_IN_Q8_0, "q4_1": None, "q5_1": None, "q8_m": None}


def check_quantization(quantization: str | None,
                       device: torch.device | str = "cpu") -> str | None:
    """``quantization`` checked (a ValueError naming it): None, or one of QUANTIZATIONS, a
    format only on the CPU (the quantized kernels are CPU kernels)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATIONS)}, got "
                         f"{quantization!r}")
    if quantization not in (None, "none") and torch.device(device).type != "cpu":
        raise ValueError(f"quantization: {quantization!r} runs on the CPU only (the "
                         f"quantized kernels are CPU kernels), not on {device}")
    return quantization


def block_weights(format: str) -> int:
    """The weights per block of ``format``: a row's length must be a multiple of it."""
    return STORED_LAYOUTS[format][0]


def row_bytes(format: str, in_features: int) -> int:
    """The bytes of one row of ``in_features`` weights in ``format``'s blocks."""
    weights, nbytes = STORED_LAYOUTS[format]
    return in_features // weights * nbytes


def _quant_type(format: str, formats: Collection[str]) -> GGMLQuantizationType:
    from gguf import GGMLQuantizationType

    if format not in formats:
        raise ValueError(f"format must be one of {list(formats)}, got {format!r}")
    return GGMLQuantizationType[format.upper()]


def quantize_weight(weight: torch.Tensor, format: str) -> torch.Tensor:
    """uint8 ``[N, K / 32 * block_bytes]``: each row of the float ``weight [N, K]`` (K a
    multiple of 32) as ``format``'s blocks (one of QUANTIZE_FORMATS), rounded as llama.cpp's
    reference quantizer does."""
    from gguf import quants

    qtype = _quant_type(format, QUANTIZE_FORMATS)
    if weight.dim() != 2 or weight.shape[1] % block_weights(format) != 0:
        raise ValueError(f"weight must be [N, K] with K a multiple of {block_weights(format)}, "
                         f"got shape {tuple(weight.shape)}")
    data = weight.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    return torch.from_numpy(np.ascontiguousarray(quants.quantize(data, qtype)))


def dequantize_weight(qweight: torch.Tensor, format: str, in_features: int) -> torch.Tensor:
    """float32 ``[N, in_features]``: the weights the blocks ``qweight`` (from ``quantize_weight``
    or a GGUF file, or in the x16 layout: ``ops.interleave_rows16``) hold, through
    ``gguf.quants.dequantize`` (q8_m: q d + m in float32, the product exact and the sum rounded
    once, as gguf computes q4_1's)."""
    from gguf import quants

    from .ops import ROWS16_SUFFIX, deinterleave_rows16

    if (base := format.removesuffix(ROWS16_SUFFIX)) != format and base in BLOCK_LAYOUTS:
        return dequantize_weight(deinterleave_rows16(qweight, base, in_features), base,
                                 in_features)
    if format not in BLOCK_LAYOUTS:
        raise ValueError(f"format must be one of {list(BLOCK_LAYOUTS)} (or one of them with "
                         f"{ROWS16_SUFFIX!r}), got {format!r}")
    expected = row_bytes(format, in_features)
    if (qweight.dim() != 2 or in_features % block_weights(format)
            or qweight.shape[1] != expected):
        raise ValueError(f"qweight must be uint8 [N, {expected}] for in_features = "
                         f"{in_features} in {format}, got shape {tuple(qweight.shape)}")
    data = qweight.detach().to(device="cpu", dtype=torch.uint8).contiguous()
    if format == "q8_m":
        blocks = data.reshape(data.shape[0], -1, BLOCK_LAYOUTS[format][1])
        d, m = (blocks[..., i:i + 2].contiguous().view(torch.float16).float() for i in (0, 2))
        return (blocks[..., 4:].float() * d + m).reshape(data.shape[0], -1)
    qtype = _quant_type(format, GGUF_FORMATS)
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(data.numpy(), qtype)))


def _unsigned_quants(blocks: torch.Tensor, format: str) -> torch.Tensor:
    """int16 ``[..., 32]``: the quants of 32-weight ``blocks [..., block bytes]`` as unsigned
    values in weight order (q8_0's int8 plus 128)."""
    if format in ("q8_0", "q8_m"):
        quants = blocks[..., -32:]
        return (quants.view(torch.int8).to(torch.int16) + 128 if format == "q8_0"
                else quants.to(torch.int16))
    nibbles = blocks[..., -16:]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # weights 0-15, then 16-31
    if format == "iq4_nl":
        return torch.tensor(IQ4_NL_VALUES, dtype=torch.int16)[q.long()] + 128
    if format in ("q5_0", "q5_1"):
        bits = torch.arange(8, dtype=torch.uint8)
        qh = 2 if format == "q5_0" else 4
        high = (blocks[..., qh:qh + 4, None] >> bits) & 1  # [.., byte, bit]: bit j of the u32 qh
        q = q | (high.reshape(*q.shape) << 4)
    return q.to(torch.int16)


def as_exact(qweight: torch.Tensor, format: str, target: str) -> torch.Tensor:
    """The ``target`` blocks (uint8 ``[N, K / 32 * block bytes]``) of the weights that the
    ``format`` blocks ``qweight`` hold, dequantizing to the same float32 values: q8_0 from
    EXACT_IN_Q8_0 (each block's d kept, its quants minus their offset as int8), q8_m from
    EXACT_IN_Q8_M (d kept, the unsigned quants, m = -offset d or the block's own m; the products
    q d are exact, so one rounding of q d + m gives the source's values)."""
    exact = EXACT_IN_Q8_0 if target == "q8_0" else EXACT_IN_Q8_M
    if target not in ("q8_0", "q8_m") or format not in exact:
        raise ValueError(f"{format} blocks are not held exactly by {target}")
    blocks = qweight.reshape(qweight.shape[0], -1, STORED_LAYOUTS[format][1])
    d = blocks[..., :2]
    q = _unsigned_quants(blocks, format)
    offset = exact[format]
    if target == "q8_0":
        parts = [d, (q - offset).to(torch.int8).view(torch.uint8)]
    elif offset is None:
        parts = [d, blocks[..., 2:4], q.to(torch.uint8)]
    else:
        m = (-offset * d.contiguous().view(torch.float16).float()).half()
        if not torch.isfinite(m).all():
            raise ValueError(f"{format} blocks with scales beyond float16's range / {offset} "
                             "have no q8_m form")
        parts = [d, m.view(torch.uint8), q.to(torch.uint8)]
    return torch.cat(parts, dim=-1).reshape(qweight.shape[0], -1)


def iq4_xs_as_q8_0(qweight: torch.Tensor) -> torch.Tensor:
    """q8_0 blocks (uint8 ``[N, K / 32 * 34]``) of the IQ4_XS super-blocks ``qweight`` (uint8
    ``[N, K / 256 * 136]``; ggml's block_iq4_xs: an fp16 d, the 6-bit sub-block scales' high
    2 bits (a u16) and low 4 bits (4 bytes), then 4-bit indices into IQ4_NL_VALUES as IQ4_NL
    lays them out): each 32-weight sub-block's scale d (ls - 32) rounded to float16 once, its
    grid values the quants. Every weight is then within float16's rounding of its scale, where
    q8_0's rounding of the dequantized weights errs up to 1/254 of a block's largest."""
    blocks = qweight.reshape(qweight.shape[0], -1, 136)
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    high = blocks[..., 2:4].contiguous().view(torch.int16).int() & 0xFFFF
    sub_block = torch.arange(8)
    low = blocks[..., 4 + sub_block // 2].int() >> (4 * (sub_block % 2)) & 15
    scale = (d * ((low | (high >> (2 * sub_block) & 3) << 4) - 32)).half()
    if not torch.isfinite(scale).all():
        raise ValueError("IQ4_XS blocks with scales beyond float16's range have no q8_0 form")
    # Each sub-block's 16 bytes are laid out as an IQ4_NL block's quants.
    unsigned = _unsigned_quants(blocks[..., 8:].reshape(*blocks.shape[:2], 8, 16), "iq4_nl")
    values = (unsigned - 128).to(torch.int8).view(torch.uint8)
    q8_0 = torch.cat([scale.unsqueeze(-1).view(torch.uint8), values], dim=-1)
    return q8_0.reshape(qweight.shape[0], -1)
