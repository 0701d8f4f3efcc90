"""GPT-2: learned positions, pre-LayerNorm blocks, gelu_tanh MLP, tied embeddings."""
from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from .config import ModelConfig
from .layers import AttentionMetadata, Embedding, Layer, LayerNorm, Linear, paged_attention
from .weights import HFWeight

# Causal-mask buffers that old checkpoints saved next to the real weights.
IGNORED_HF_WEIGHTS = re.compile(r"\.attn\.(masked_)?bias$")


class GPT2Attention(Layer):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.out = Linear(config.hidden_size, config.hidden_size, bias=True)
        self.scale = config.attention_scale
        if config.scale_attn_by_inverse_layer_idx:
            self.scale /= layer_idx + 1

    def forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, norm: LayerNorm) -> torch.Tensor:
        """``x + attention(norm(x))``."""
        qkv = self.qkv(x, norm=norm)
        q, k, v = qkv.unflatten(1, (3, self.num_heads, self.head_dim)).unbind(1)
        return self.out(paged_attention(q, k, v, kv_cache, meta, self.scale), residual=x)


class GPT2MLP(Layer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = Linear(config.hidden_size, config.intermediate_size, bias=True,
                         activation=config.activation)
        self.proj = Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, norm: LayerNorm) -> torch.Tensor:
        """``x + mlp(norm(x))``."""
        return self.proj(self.fc(x, norm=norm), residual=x)


class GPT2Block(Layer):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, config.norm_eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = LayerNorm(config.hidden_size, config.norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.attn(x, kv_cache, meta, norm=self.ln_1)
        return self.mlp(x, norm=self.ln_2)


class GPT2(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = Embedding(config.vocab_size, config.hidden_size)
        self.wpe = Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_layers))
        self.ln_f = LayerNorm(config.hidden_size, config.norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    def embed_inputs(self, input_ids: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The first block's input ``[T, hidden]``, and no rotary tables (learned positions)."""
        return self.wte(input_ids) + self.wpe(positions), None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """Packed ``input_ids``/``positions`` ``[T]`` -> hidden states ``[T, hidden]`` (before
        the final norm, which ``compute_logits`` applies to the rows it needs)."""
        x, _ = self.embed_inputs(input_ids, positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, kv_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[len(indices), vocab]`` of the packed rows ``indices``, from the
        lm_head GEMM's float32 accumulation."""
        return self.lm_head.logits(hidden.index_select(0, indices), norm=self.ln_f)


def hf_weight_map(config: ModelConfig) -> dict[str, HFWeight]:
    """Our parameter name -> the Hugging Face tensors it is made of (Conv1D weights are stored
    ``[in, out]``, hence transposed)."""
    out: dict[str, HFWeight] = {
        "wte.weight": HFWeight(("transformer.wte.weight",)),
        "wpe.weight": HFWeight(("transformer.wpe.weight",)),
        "ln_f.weight": HFWeight(("transformer.ln_f.weight",)),
        "ln_f.bias": HFWeight(("transformer.ln_f.bias",)),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = HFWeight(("lm_head.weight",))
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}.", f"transformer.h.{i}."
        for our_name, hf_name in (("ln_1", "ln_1"), ("ln_2", "ln_2"), ("attn.qkv", "attn.c_attn"),
                                  ("attn.out", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                                  ("mlp.proj", "mlp.c_proj")):
            conv1d = not our_name.startswith("ln")
            out[f"{ours}{our_name}.weight"] = HFWeight((f"{hf}{hf_name}.weight",), conv1d)
            out[f"{ours}{our_name}.bias"] = HFWeight((f"{hf}{hf_name}.bias",))
    return out


def canonical_hf_name(name: str) -> str:
    """The original OpenAI checkpoints name tensors without the ``transformer.`` prefix."""
    return name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"
