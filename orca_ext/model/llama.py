"""Llama, and the Llama-shaped Mistral and Qwen2: RoPE, RMSNorm, SwiGLU, grouped-query
attention, tied or untied lm_head, optional qkv bias (Qwen2) and attention/MLP biases."""
from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from .config import ModelConfig
from .layers import (AttentionMetadata, Embedding, Layer, Linear, RMSNorm, RotaryEmbedding,
                     apply_rotary, paged_attention)
from .weights import HFWeight

# Rotary tables that old checkpoints saved as weights.
IGNORED_HF_WEIGHTS = re.compile(r"\.rotary_emb\.inv_freq$")


class LlamaAttention(Layer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.out = Linear(q_size, config.hidden_size, bias=config.o_bias)
        self.scale = config.attention_scale

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                norm: RMSNorm) -> torch.Tensor:
        """``x + attention(norm(x))``."""
        qkv = self.qkv(x, norm=norm).unflatten(1, (-1, self.head_dim))
        # Rotate q and k heads together; v heads are the last num_kv_heads.
        qk = apply_rotary(qkv[:, :self.num_heads + self.num_kv_heads], cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        return self.out(paged_attention(q, k, v, kv_cache, meta, self.scale), residual=x)


class LlamaMLP(Layer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Gate rows then up rows; silu(gate) * up is fused into the GEMM epilogue.
        self.gate_up = Linear(config.hidden_size, 2 * config.intermediate_size,
                              bias=config.mlp_bias, activation="silu_and_mul")
        self.down = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """``x + mlp(norm(x))``."""
        return self.down(self.gate_up(x, norm=norm), residual=x)


class LlamaBlock(Layer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = LlamaAttention(config)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.attn(x, cos, sin, kv_cache, meta, norm=self.input_norm)
        return self.mlp(x, norm=self.post_attn_norm)


class Llama(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def embed_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The first block's input ``[T, hidden]`` and the rotary cos, sin
        ``[T, 1, head_dim // 2]``."""
        x = self.embed(input_ids)
        return x, self.rotary(positions, x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """Packed ``input_ids``/``positions`` ``[T]`` -> hidden states ``[T, hidden]`` (before
        the final norm, which ``compute_logits`` applies to the rows it needs)."""
        x, (cos, sin) = self.embed_inputs(input_ids, positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[len(indices), vocab]`` of the packed rows ``indices``, from the
        lm_head GEMM's float32 accumulation."""
        return self.lm_head.logits(hidden.index_select(0, indices), norm=self.norm)


def hf_weight_map(config: ModelConfig) -> dict[str, HFWeight]:
    """Our parameter name -> the Hugging Face tensors it is made of (fused ones are the
    concatenation of theirs along dim 0)."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    out: dict[str, HFWeight] = {
        "embed.weight": HFWeight(("model.embed_tokens.weight",)),
        "norm.weight": HFWeight(("model.norm.weight",)),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = HFWeight(("lm_head.weight",))
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        out[ours + "input_norm.weight"] = HFWeight((hf + "input_layernorm.weight",))
        out[ours + "post_attn_norm.weight"] = HFWeight((hf + "post_attention_layernorm.weight",))
        kinds = ["weight"] + ["bias"] * config.qkv_bias
        for kind in kinds:
            out[f"{ours}attn.qkv.{kind}"] = HFWeight(
                tuple(f"{hf}self_attn.{p}_proj.{kind}" for p in "qkv"),
                sizes=(q_size, kv_size, kv_size))
        for kind in ["weight"] + ["bias"] * config.o_bias:
            out[f"{ours}attn.out.{kind}"] = HFWeight((f"{hf}self_attn.o_proj.{kind}",))
        for kind in ["weight"] + ["bias"] * config.mlp_bias:
            out[f"{ours}mlp.gate_up.{kind}"] = HFWeight(
                (f"{hf}mlp.gate_proj.{kind}", f"{hf}mlp.up_proj.{kind}"), sizes=(inter, inter))
            out[f"{ours}mlp.down.{kind}"] = HFWeight((f"{hf}mlp.down_proj.{kind}",))
    return out


def canonical_hf_name(name: str) -> str:
    return name
