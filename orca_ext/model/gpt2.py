"""GPT-2: learned positions, pre-LayerNorm blocks, gelu_tanh MLP, biases everywhere, tied
embeddings."""
from __future__ import annotations

import re

from .config import ModelConfig
from .decoder import BlockSpec, DecoderSpec, LayerSpec
from .weights import HFWeight

# Causal-mask buffers that old checkpoints saved next to the real weights.
IGNORED_HF_WEIGHTS = re.compile(r"\.attn\.(masked_)?bias$")


def decoder_spec(config: ModelConfig) -> DecoderSpec:
    block = BlockSpec(config.hidden_size, config.intermediate_size, config.num_heads,
                      config.num_kv_heads, config.head_dim, "layer_norm", config.norm_eps,
                      config.activation, qkv_bias=True, out_bias=True, mlp_bias=True)
    # scale_attn_by_inverse_layer_idx: layer i's scores are further divided by i + 1.
    layers = tuple(LayerSpec(config.attention_scale / (i + 1 if
                                                       config.scale_attn_by_inverse_layer_idx
                                                       else 1))
                   for i in range(config.num_layers))
    return DecoderSpec(block, layers, (), config.vocab_size, config.tie_word_embeddings,
                       config.max_position_embeddings)


def hf_weight_map(config: ModelConfig) -> dict[str, HFWeight]:
    """Our parameter name -> the Hugging Face tensors it is made of (Conv1D weights are stored
    ``[in, out]``, hence transposed)."""
    out: dict[str, HFWeight] = {
        "embed.weight": HFWeight(("transformer.wte.weight",)),
        "pos_embed.weight": HFWeight(("transformer.wpe.weight",)),
        "norm.weight": HFWeight(("transformer.ln_f.weight",)),
        "norm.bias": HFWeight(("transformer.ln_f.bias",)),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = HFWeight(("lm_head.weight",))
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}.", f"transformer.h.{i}."
        for our_name, hf_name in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2"),
                                  ("attn.qkv", "attn.c_attn"), ("attn.out", "attn.c_proj"),
                                  ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")):
            conv1d = not our_name.endswith("norm")
            out[f"{ours}{our_name}.weight"] = HFWeight((f"{hf}{hf_name}.weight",), conv1d)
            out[f"{ours}{our_name}.bias"] = HFWeight((f"{hf}{hf_name}.bias",))
    return out


def canonical_hf_name(name: str) -> str:
    """The original OpenAI checkpoints name tensors without the ``transformer.`` prefix."""
    return name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"
