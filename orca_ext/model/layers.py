"""Layers shared by the model families; all work on packed tokens ``[T, ...]``.

Linear layers go through ``ops.packed_linear`` (bias and activation fused), attention through
``ops.store_kv`` + ``ops.ragged_attention``. Norms, embeddings and rotary are plain vectorized
torch ops. Parameters are created uninitialized (the loader or the built-in model fills them).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops

if TYPE_CHECKING:
    from .decoder import RopeSpec


@dataclass
class AttentionMetadata:
    """One iteration's attention metadata, built once and shared by every layer."""

    cu_q_lens: torch.Tensor  # int32 [B+1]
    context_lens: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, max_blocks]
    slot_mapping: torch.Tensor  # int64 [T]
    # The step's CPU attention plans (ops.plan_attention), one per window and cache geometry.
    plans: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    def attention_plan(self, q: torch.Tensor, k_cache: torch.Tensor,
                       window: int) -> torch.Tensor | None:
        """The step's attention plan for layers with this window: made by the first such
        layer, taken by the others. None on CUDA, where ragged_attention plans from shapes."""
        if not q.is_cpu:
            return None
        key = (window, q.shape[1:], q.dtype, k_cache.shape, k_cache.dtype)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = ops.plan_attention(q, k_cache, self.cu_q_lens,
                                                        self.context_lens, self.block_table,
                                                        window)
        return plan


class Layer(nn.Module):
    """Base of the models' inner modules: calling one runs its ``forward`` directly. Inference
    registers no hooks, so nn.Module.__call__'s checks for them would only add time to each of
    a decode step's ~70 calls. Registering a forward hook on one is refused rather than
    silently never called."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__call__ = cls.forward

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{type(self).__name__} calls forward directly and runs no hooks; "
                           "hook the top-level model instead")

    register_forward_pre_hook = register_forward_hook


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class Linear(Layer):
    """``activation(norm(x) @ weight.T + bias) (+ residual)``; ``silu_and_mul`` halves the
    output width. A block's norms and residual adds run inside its linears (the norm on the
    input rows, the add in the epilogue) rather than as ops of their own, which saves a Llama
    decode step the seven ops of each RMSNorm and the round trips of their outputs."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 activation: str = "none") -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        self.activation = activation

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
        return ops.packed_linear(x, self.weight, self.bias, activation, residual, *norm_args)

    def logits(self, x: torch.Tensor, norm: LayerNorm | RMSNorm | None = None) -> torch.Tensor:
        """An output head's float32 logits ``norm(x) @ weight.T`` (``ops.logits_linear``: the
        GEMM's float32 sums, not rounded to a bfloat16 / float16 model's dtype)."""
        if self.bias is not None or self.activation != "none":
            raise ValueError("logits are computed without a bias or activation")
        norm_args = () if norm is None else norm.fused_args()
        return ops.logits_linear(x, self.weight, *norm_args)


class Embedding(Layer):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = _param(num_embeddings, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LayerNorm(Layer):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(dim)
        self.bias = _param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def fused_args(self) -> tuple[str, torch.Tensor, torch.Tensor, float]:
        """``packed_linear``'s norm arguments for this norm."""
        return "layer_norm", self.weight, self.bias, self.eps


class RMSNorm(Layer):
    """Llama's RMSNorm: normalized in float32, cast back, then scaled (``ops.rms_norm``, the
    row kernel the fused linears and the DecoderStack use, so the per-op blocks equal theirs)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``norm(x)`` over the last dim, plus ``residual`` where given."""
        return ops.rms_norm(x, self.weight, self.eps, residual)

    def fused_args(self) -> tuple[str, torch.Tensor, None, float]:
        """``packed_linear``'s norm arguments for this norm."""
        return "rms_norm", self.weight, None, self.eps


def rope_inv_freq(dim: int, theta: float,
                  scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim // 2]`` (float32) of a rotary table over ``dim`` dims, with
    linear, llama3 or longrope scaling, and the factor its cos and sin are multiplied by."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    if scaling is not None and scaling["rope_type"] == "longrope":
        # Phi-3's LongRoPE: per-frequency factors, cos / sin scaled by the attention factor.
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        return 1.0 / (factors * theta ** exponents), scaling["attention_factor"]
    inv_freq = 1.0 / theta ** exponents
    if scaling is None:
        return inv_freq, 1.0
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor, 1.0
    # llama3: keep high frequencies, divide low ones by factor, interpolate in between.
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled), 1.0


class RotaryEmbedding(Layer):
    """Neox-style (rotate-half) rotary tables, one per ``RopeSpec`` (Gemma 3's local and
    global layers use two); all rotate the same number of dims."""

    def __init__(self, ropes: Sequence[RopeSpec]) -> None:
        super().__init__()
        if len({rope.dim for rope in ropes}) != 1:
            raise ValueError("every rotary table of a model must rotate the same dims")
        # Computed on the CPU, then placed: on the meta device (the loader's shape-only model)
        # torch's arange goes through its reference implementations, which import dynamo.
        with torch.device("cpu"):
            tables = [rope_inv_freq(rope.dim, rope.theta, rope.scaling) for rope in ropes]
        device = torch.get_default_device()
        self.register_buffer("inv_freq", torch.stack([t[0] for t in tables]).to(device),
                             persistent=False)
        factors = [t[1] for t in tables]
        self.register_buffer("factors", torch.tensor(factors)[:, None, None]
                             if any(f != 1.0 for f in factors) else None, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """cos and sin stacked ``[2, R, T, rotary_dim // 2]`` for the packed positions;
        computed once per iteration in float32, as Hugging Face does."""
        freqs = positions[None, :, None].float() * self.inv_freq[:, None]
        cos, sin = freqs.cos(), freqs.sin()
        if self.factors is not None:
            cos, sin = cos * self.factors, sin * self.factors
        return torch.stack((cos, sin)).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of ``x [T, H, D]`` by the per-token angles
    (the rest, under partial rotary, pass through)."""
    rot = 2 * cos.shape[-1]
    x1, x2 = x[..., :rot].chunk(2, dim=-1)
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    return torch.cat((*rotated, x[..., rot:]) if rot < x.shape[-1] else rotated, dim=-1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                    scale: float, window: int = 0) -> torch.Tensor:
    """Store the new tokens' ``k``/``v`` ``[T, Hkv, D]`` in this layer's cache, then attend with
    ``q [T, Hq, D]`` over each request's cached context (the last ``window`` positions only,
    where not 0). Returns ``[T, Hq * D]``."""
    k_cache, v_cache = kv_cache
    ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = ops.ragged_attention(q, k_cache, v_cache, meta.cu_q_lens, meta.context_lens,
                               meta.block_table, scale, window,
                               meta.attention_plan(q, k_cache, window))
    return out.flatten(1)
