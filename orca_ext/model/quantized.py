"""Quantized weights in the models: which linears and embeddings hold GGUF blocks, the layers
that hold them, and filling them from a checkpoint.

``quantization`` (``EngineConfig``, ``load_model``): None runs a GGUF file in its stored formats
(Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K blocks as stored, a fused weight of
32-weight parts in different formats and IQ4_NL rewritten exactly as q8_0 or q8_m; other
quantized types, Q2_K, Q3_K and the other i-quants, converted to q8_0 at load) and any other
model unquantized; ``"none"`` dequantizes everything; ``"q8_0"``, ``"q4_0"``, ``"q4_1"`` quantize
every linear weight (and a tied embedding with the output head) at load. Quantized models run
float32 activations by default, as llama.cpp does. Where the CPU's quantized kernels read it, the
decoder linears' and the output head's blocks are then rewritten in place in the x16 layout
(``interleave_rows``).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import _C, ops
from ..quantize import (EXACT_IN_Q8_0, EXACT_IN_Q8_M, GGUF_FORMATS, as_exact, block_weights,
                        iq4_xs_as_q8_0, quantize_weight, row_bytes)
from .layers import Embedding, LayerNorm, Layer, Linear, RMSNorm
from .weights import Checkpoint, HFWeight

_log = logging.getLogger(__name__)

# GGUF tensor types the quantized kernels read as stored, by their format names.
NATIVE_TYPES = {format.upper(): format for format in GGUF_FORMATS}
# The types whose blocks are copied from the file (the native ones, and IQ4_NL, which as_exact
# rewrites as the q8_0 blocks of the same weights), by their format names.
COPIED_TYPES = {**NATIVE_TYPES, "IQ4_NL": "iq4_nl"}
FLOAT_TYPES = ("F32", "F16", "BF16")
# The format other quantized GGUF types (Q2_K, Q3_K, the i-quants) are converted to at load.
CONVERTED_FORMAT = "q8_0"


def _blocks(rows: int, in_features: int, format: str) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, row_bytes(format, in_features), dtype=torch.uint8),
                        requires_grad=False)


class QuantizedLinear(Layer):
    """``Linear`` with its weight as GGUF blocks: ``weight`` is uint8 ``[out_features,
    in_features / block_weights * block_bytes]`` of ``format`` (``ops.quantized_linear``); the
    bias, the fused norm and the activations stay float."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 activation: str = "none", format: str = "q8_0") -> None:
        super().__init__()
        self.in_features, self.out_features, self.format = in_features, out_features, format
        self.weight = _blocks(out_features, in_features, format)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias \
            else None
        self.activation = activation

    @classmethod
    def replacing(cls, linear: Linear, format: str) -> QuantizedLinear:
        """A QuantizedLinear of ``linear``'s shape and activation, sharing its bias."""
        out_features, in_features = linear.weight.shape
        new = cls(in_features, out_features, False, linear.activation, format)
        new.bias = linear.bias
        return new

    # Its LoRA adapter slots (``lora.layers.LinearLoRA``), set on an engine with enable_lora.
    lora: Any = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                norm: LayerNorm | RMSNorm | None = None) -> torch.Tensor:
        if self.lora is not None and self.lora.batch.active:
            return self.lora.forward(self, x, residual, norm)
        return self.project(x, self.activation, residual, norm)

    def project(self, x: torch.Tensor, activation: str, residual: torch.Tensor | None = None,
                norm: LayerNorm | RMSNorm | None = None) -> torch.Tensor:
        """The op call of ``forward`` with ``activation`` in its epilogue."""
        norm_args = () if norm is None else norm.fused_args()
        return ops.quantized_linear(x, self.weight, self.format, self.in_features, self.bias,
                                    activation, residual, *norm_args)

    def logits(self, x: torch.Tensor, norm: LayerNorm | RMSNorm | None = None) -> torch.Tensor:
        """float32 logits ``norm(x) @ weight.T``: quantized_linear on float32 rows (bfloat16
        rows normalized in their dtype first, as ``Linear.logits`` does), never rounded to int8:
        that rounding of a one-token step's final hidden state flipped near-tied greedy tokens
        (SmolLM2's answer to "What is the capital of France?")."""
        if self.bias is not None or self.activation != "none":
            raise ValueError("logits are computed without a bias or activation")
        if x.dtype != torch.float32:
            x, norm = (x if norm is None else norm(x)).float(), None
        norm_args = () if norm is None else norm.fused_args()
        return ops.quantized_linear(x, self.weight, self.format, self.in_features, None, "none",
                                    None, *norm_args, int8_activations=False)


class QuantizedEmbedding(Layer):
    """``Embedding`` with its table as GGUF blocks: the rows looked up are dequantized
    (``ops.quantized_embedding``), never the whole table; returned in ``dtype``."""

    def __init__(self, num_embeddings: int, dim: int, format: str = "q8_0",
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dim, self.format, self.dtype = dim, format, dtype
        self.weight = _blocks(num_embeddings, dim, format)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = ops.quantized_embedding(ids, self.weight, self.format, self.dim)
        return rows if self.dtype == torch.float32 else rows.to(self.dtype)


@dataclass(frozen=True)
class QuantizedWeight:
    """How one parameter is filled: GGUF blocks of ``format``, copied as stored (``native``;
    parts stored in another format rewritten exactly by ``as_exact``: q4_0 / q5_0 parts of a
    q8_0 weight, the 32-weight parts of a q8_m one) or quantized at load from the float
    weights."""

    format: str
    native: bool


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter name -> every name of that parameter (a tied embedding and head share)."""
    groups: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        groups[id(param)].append(name)
    return {name: names for names in groups.values() for name in names}


def _matrices(model: nn.Module) -> dict[str, nn.Module]:
    """The weight names of the model's Linear and Embedding modules -> the module."""
    return {f"{name}.weight": module for name, module in model.named_modules()
            if isinstance(module, (Linear, Embedding))}


def plan_quantization(model: nn.Module, weight_map: dict[str, HFWeight],
                      checkpoint: Checkpoint | None,
                      quantization: str | None) -> dict[str, QuantizedWeight]:
    """The parameters (names in ``weight_map``) to hold as GGUF blocks and how to fill them.
    With a format, every linear weight (a tied embedding with it) whose width is a multiple of
    32; with None, a GGUF checkpoint's quantized tensors (``checkpoint.raw``), native where the
    kernels read the stored type (NATIVE_TYPES; every part of a fused weight in the same one, or
    the parts in types q8_0 holds exactly, as llama.cpp's Q4_K_M files store a Q8_0 v beside a
    Q5_0 q and k, and IQ4_NL, which no kernel reads (a logged note), or else in 32-weight types,
    all held exactly by q8_m, as its Q5_K_M files store a Q8_0 v beside a Q5_1 q and k), else
    converted to q8_0 with one logged note."""
    if quantization == "none" or (quantization is None and not hasattr(checkpoint, "raw")):
        return {}
    matrices, tied = _matrices(model), tied_names(model)
    plan: dict[str, QuantizedWeight] = {}
    converted: list[str] = []
    rewritten: list[str] = []  # held exactly, but no kernel reads the stored type
    for name, module in matrices.items():
        if name not in weight_map:
            continue  # a tied head: planned with its embedding
        group = [matrices[n] for n in tied[name] if n in matrices]
        width = module.weight.shape[1]
        if quantization is not None:
            linear = any(isinstance(m, Linear) for m in group)
            if linear and width % block_weights(quantization) == 0:
                plan[name] = QuantizedWeight(quantization, False)
            continue
        types = {checkpoint.raw(n).tensor_type.name for n in weight_map[name].names}
        if types <= set(FLOAT_TYPES):
            continue
        if len(types) == 1 and types <= NATIVE_TYPES.keys():
            plan[name] = QuantizedWeight(NATIVE_TYPES[types.pop()], True)
        elif (formats := {t.lower() for t in types}) <= EXACT_IN_Q8_M.keys():
            exact = "q8_0" if formats <= EXACT_IN_Q8_0.keys() else "q8_m"
            plan[name] = QuantizedWeight(exact, True)
            if not types <= NATIVE_TYPES.keys():
                rewritten.append(f"{name} ({'+'.join(sorted(types))} as {exact})")
        elif width % block_weights(CONVERTED_FORMAT) == 0:
            plan[name] = QuantizedWeight(CONVERTED_FORMAT, False)
            converted.append(f"{name} ({'+'.join(sorted(types))})")
    if rewritten:
        _log.info("%s: %d weights in types the kernels do not read held exactly in orca's "
                  "formats (the same weights in larger blocks): %s", checkpoint.source,
                  len(rewritten), ", ".join(rewritten))
    if converted:
        _log.info("%s: %d weights in types the kernels do not read as stored converted to %s at "
                  "load (IQ4_XS as its sub-blocks' grid values and float16 scales, the others "
                  "dequantized, then quantized): %s", checkpoint.source, len(converted),
                  CONVERTED_FORMAT, ", ".join(converted))
    return plan


def quantize_modules(model: nn.Module, plan: dict[str, QuantizedWeight],
                     dtype: torch.dtype) -> None:
    """Replace the Linear and Embedding modules of the planned weights (every module of a tied
    one, sharing one block tensor) by their quantized layers, before their memory is laid out."""
    matrices, tied = _matrices(model), tied_names(model)
    for name, how in plan.items():
        shared = None
        for member in tied[name]:
            old = matrices[member]
            if isinstance(old, Linear):
                new: Layer = QuantizedLinear.replacing(old, how.format)
            else:
                new = QuantizedEmbedding(*old.weight.shape, how.format, dtype)
            if shared is None:
                shared = new.weight
            new.weight = shared
            parent, _, attr = member.removesuffix(".weight").rpartition(".")
            setattr(model.get_submodule(parent), attr, new)


def load_quantized_weights(model: nn.Module, weight_map: dict[str, HFWeight],
                           checkpoint: Checkpoint, plan: dict[str, QuantizedWeight]) -> None:
    """Fill the blocks of ``model``'s quantized layers (``plan``) from ``checkpoint``; the
    float parameters are ``weights.load_hf_weights``'s."""
    params = dict(model.named_parameters())
    with checkpoint:
        for name, how in plan.items():
            module = model.get_submodule(name.removesuffix(".weight"))
            load_quantized(params[name], checkpoint, weight_map[name], logical_shape(module), how)


def load_quantized(out: torch.Tensor, checkpoint: Checkpoint, spec: HFWeight,
                   shape: tuple[int, int], how: QuantizedWeight) -> None:
    """Fill ``out``, the uint8 blocks of a weight of float ``shape`` ``[N, K]``: the stored rows
    (fused parts one after the other; a part stored in another format than ``how.format``
    rewritten by ``as_exact``), or its parts converted: IQ4_XS blocks to q8_0 by
    ``iq4_xs_as_q8_0``, others as their float values quantized (row by row, so part by part)."""
    parts = checkpoint.parts(spec, shape)
    if how.native:
        offset = 0
        for name, (rows, _) in zip(spec.names, parts):
            stored = COPIED_TYPES[checkpoint.raw(name).tensor_type.name]
            if stored == how.format:
                checkpoint.copy_raw_blocks(name, out[offset:offset + rows])
            else:
                blocks = torch.empty(rows, row_bytes(stored, shape[1]), dtype=torch.uint8)
                checkpoint.copy_raw_blocks(name, blocks)
                out[offset:offset + rows].copy_(as_exact(blocks, stored, how.format))
            offset += rows
        return
    offset = 0
    for name, (rows, piece) in zip(spec.names, parts):
        stored = checkpoint.raw(name).tensor_type.name if hasattr(checkpoint, "raw") else None
        if how.format == "q8_0" and stored == "IQ4_XS":
            blocks = torch.empty(rows, row_bytes("iq4_xs", shape[1]), dtype=torch.uint8)
            checkpoint.copy_raw_blocks(name, blocks)
            out[offset:offset + rows].copy_(iq4_xs_as_q8_0(blocks))
        else:
            values = piece[:].t() if spec.transpose else piece[:]
            out[offset:offset + rows].copy_(quantize_weight(values, how.format))
        offset += rows


def rows16_formats(isa: str) -> tuple[str, ...]:
    """The formats whose x16 layout (``ops.interleave_rows16``) the decode-sized int8 kernels of
    ``isa`` read directly: every one on ``avx512_vnni`` and ``amx_int8`` (whose tile kernels read
    it directly too); none elsewhere."""
    return ops.QUANT_FORMATS if isa in ("avx512_vnni", "amx_int8") else ()


def interleave_rows(model: nn.Module) -> None:
    """Rewrite in place, in the x16 layout, the blocks of the decoder blocks' quantized linears
    and of the output head whose format has one on the kernels this CPU runs
    (``_C.get_isa("quant")``) and whose rows (each gated half's) are a multiple of 16: their
    decode steps then run one output row per vector lane (the head's on its activations' int8
    parts and their remainder's, as fine as float32). An embedding tied to the head reads its
    rows so too; one that is not keeps the file's rows (it gathers rows)."""
    formats = rows16_formats(_C.get_isa("quant"))
    head = getattr(model, "lm_head", None)
    linears = [*getattr(model, "layers", nn.ModuleList()).modules(), head]
    embeddings = [m for m in model.modules() if isinstance(m, QuantizedEmbedding)]
    for module in linears:
        if not isinstance(module, QuantizedLinear) or module.format not in formats:
            continue
        halves = 2 if module.activation in ops.GATED_ACTIVATIONS else 1
        if module.weight.shape[0] % (16 * halves):
            continue
        _interleave_in_place(module.weight, module.format, module.in_features)
        tied = [embed for embed in embeddings if embed.weight is module.weight]
        for layer in (module, *tied):
            layer.format += ops.ROWS16_SUFFIX


# Rows rewritten per interleave_rows16 call: a slice in cache, not a copy of a whole output head.
_INTERLEAVE_SLICE_BYTES = 4 << 20


def _interleave_in_place(weight: torch.Tensor, format: str, in_features: int) -> None:
    """``weight``'s rows (a multiple of 16) rewritten in the x16 layout, slice by slice."""
    rows = max(16, _INTERLEAVE_SLICE_BYTES // weight.shape[1] // 16 * 16)
    for start in range(0, weight.shape[0], rows):
        part = weight[start:start + rows]
        part.copy_(ops.interleave_rows16(part, format, in_features))


def logical_shape(module: Any) -> tuple[int, int]:
    """The float shape ``[N, K]`` a quantized layer's blocks stand for."""
    if isinstance(module, QuantizedLinear):
        return module.out_features, module.in_features
    return module.weight.shape[0], module.dim
