"""The decoder every family runs, built from the family's description of its block.

A family file (``gpt2.py``, ``llama.py``, ``gemma3.py``, ``phi3.py``) says once what its block
is: a ``DecoderSpec`` (norm kind and where the norms sit, QK norms, the MLP's activation and
gating, biases, rotary tables and which layer uses which, attention window and scale per layer,
the embedding's scale), plus the map from its checkpoint's tensor names to the parameters here.
``Decoder`` is the readable per-op forward of that description; the fused CPU ``DecoderStack``
(``runner/decoder_stack.py``), the tensor-parallel plan and the pipeline stages read the same
description and the same module names, so no other code knows a family's layout.

Every block is: ``x += post_attn_norm(out(attention(qkv(attn_norm(x)))))`` then
``x += post_mlp_norm(down(act(up(mlp_norm(x)))))``, the post norms only where the spec has them
(Gemma 3); each linear is a ``Linear`` or, for quantized weights, a ``QuantizedLinear``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .layers import (AttentionMetadata, Embedding, Layer, LayerNorm, Linear, RMSNorm,
                     RotaryEmbedding, apply_rotary, paged_attention)


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table: base, scaling (``{"rope_type": "linear" | "llama3" | "longrope",
    ...}``, or None) and the rotated dims of each head (fewer than head_dim: partial rotary)."""

    theta: float
    scaling: dict[str, Any] | None
    dim: int


@dataclass(frozen=True)
class LayerSpec:
    """What differs between layers: the softmax scale, the attention window (0: none) and the
    rotary table (an index into ``DecoderSpec.ropes``)."""

    scale: float
    window: int = 0
    rope: int = 0


@dataclass(frozen=True)
class BlockSpec:
    """What every block of a model shares."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm: str  # "rms_norm" or "layer_norm", before attention and before the MLP
    norm_eps: float
    activation: str  # the MLP's up linear's epilogue; a gated one doubles its rows
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # an RMSNorm of each q and k head before rotary (Qwen3, Gemma 3)
    post_norms: bool = False  # RMSNorms of the attention and MLP outputs before the adds

    @property
    def gated(self) -> bool:
        return self.activation.endswith("_and_mul")


@dataclass(frozen=True)
class DecoderSpec:
    block: BlockSpec
    layers: tuple[LayerSpec, ...]
    ropes: tuple[RopeSpec, ...]  # empty: learned position embeddings (GPT-2)
    vocab_size: int
    tie_word_embeddings: bool
    max_positions: int  # rows of the learned position embedding, if any
    embed_scale: float = 1.0  # multiplies the token embeddings (Gemma: sqrt(hidden))


class Attention(Layer):
    def __init__(self, block: BlockSpec, layer: LayerSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = block.num_heads, block.num_kv_heads
        self.head_dim = block.head_dim
        q_size, kv_size = block.num_heads * block.head_dim, block.num_kv_heads * block.head_dim
        self.qkv = Linear(block.hidden_size, q_size + 2 * kv_size, bias=block.qkv_bias)
        self.out = Linear(q_size, block.hidden_size, bias=block.out_bias)
        self.q_norm = RMSNorm(block.head_dim, block.norm_eps) if block.qk_norm else None
        self.k_norm = RMSNorm(block.head_dim, block.norm_eps) if block.qk_norm else None
        self.scale, self.window, self.rope = layer.scale, layer.window, layer.rope

    def forward(self, x: torch.Tensor, rotary: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                norm: LayerNorm | RMSNorm, post_norm: RMSNorm | None) -> torch.Tensor:
        """``x + post_norm(attention(norm(x)))``; ``rotary`` is the step's ``(cos, sin)``
        tables stacked ``[2, R, T, rotary_dim // 2]``, or None."""
        qkv = self.qkv(x, norm=norm).unflatten(1, (-1, self.head_dim))
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, :heads]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]),
                            self.k_norm(qk[:, self.num_heads:])), dim=1)
        if rotary is not None:
            qk = apply_rotary(qk, rotary[0, self.rope, :, None], rotary[1, self.rope, :, None])
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        out = paged_attention(q, k, qkv[:, heads:], kv_cache, meta, self.scale, self.window)
        if post_norm is None:
            return self.out(out, residual=x)
        return post_norm(self.out(out), residual=x)


class MLP(Layer):
    def __init__(self, block: BlockSpec) -> None:
        super().__init__()
        width = block.intermediate_size * (2 if block.gated else 1)
        # A gated activation's gate rows, then its up rows: act(gate) * up in the epilogue.
        self.up = Linear(block.hidden_size, width, bias=block.mlp_bias,
                         activation=block.activation)
        self.down = Linear(block.intermediate_size, block.hidden_size, bias=block.mlp_bias)

    def forward(self, x: torch.Tensor, norm: LayerNorm | RMSNorm,
                post_norm: RMSNorm | None) -> torch.Tensor:
        """``x + post_norm(mlp(norm(x)))``."""
        hidden = self.up(x, norm=norm)
        if post_norm is None:
            return self.down(hidden, residual=x)
        return post_norm(self.down(hidden), residual=x)


def _norm(block: BlockSpec) -> LayerNorm | RMSNorm:
    cls = LayerNorm if block.norm == "layer_norm" else RMSNorm
    return cls(block.hidden_size, block.norm_eps)


class DecoderBlock(Layer):
    def __init__(self, block: BlockSpec, layer: LayerSpec) -> None:
        super().__init__()
        self.attn_norm = _norm(block)
        self.attn = Attention(block, layer)
        self.mlp_norm = _norm(block)
        self.mlp = MLP(block)
        post = block.post_norms
        self.post_attn_norm = RMSNorm(block.hidden_size, block.norm_eps) if post else None
        self.post_mlp_norm = RMSNorm(block.hidden_size, block.norm_eps) if post else None

    def forward(self, x: torch.Tensor, rotary: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.attn(x, rotary, kv_cache, meta, self.attn_norm, self.post_attn_norm)
        return self.mlp(x, self.mlp_norm, self.post_mlp_norm)


class Decoder(nn.Module):
    """A decoder-only model on packed tokens: the embedding (scaled, plus learned positions
    where the spec has no rotary tables), the blocks, the final norm and the output head (tied
    to the embedding or not)."""

    def __init__(self, config: Any, spec: DecoderSpec) -> None:
        super().__init__()
        self.config, self.spec = config, spec
        block = spec.block
        self.embed = Embedding(spec.vocab_size, block.hidden_size)
        self.pos_embed = (Embedding(spec.max_positions, block.hidden_size) if not spec.ropes
                          else None)
        # Multiplies the embeddings in the model's dtype, as Hugging Face's Gemma does; a later
        # pipeline stage receives hidden states already scaled (pipeline.cut_stage sets it to 1).
        self.embed_scale = spec.embed_scale
        self.rotary = RotaryEmbedding(spec.ropes) if spec.ropes else None
        self.layers = nn.ModuleList(DecoderBlock(block, layer) for layer in spec.layers)
        self.norm = _norm(block)
        self.lm_head = Linear(block.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def embed_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first block's input ``[T, hidden]`` and the step's rotary tables (cos and sin
        stacked ``[2, R, T, rotary_dim // 2]``; None with learned positions)."""
        x = self.embed(input_ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        if self.embed_scale != 1.0:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x, None if self.rotary is None else self.rotary(positions, x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """Packed ``input_ids``/``positions`` ``[T]`` -> hidden states ``[T, hidden]`` (before
        the final norm, which ``compute_logits`` applies to the rows it needs)."""
        x, rotary = self.embed_inputs(input_ids, positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rotary, kv_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[len(indices), vocab]`` of the packed rows ``indices``, from the
        lm_head GEMM's float32 accumulation."""
        return self.lm_head.logits(hidden.index_select(0, indices), norm=self.norm)
