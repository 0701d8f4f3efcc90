"""Llama, and the Llama-shaped Mistral (a sliding window), Qwen2 (qkv bias) and Qwen3 (QK norms):
pre-RMSNorm blocks, RoPE, SwiGLU, grouped-query attention, tied or untied lm_head, optional
attention and MLP biases."""
from __future__ import annotations

import re

from .config import ModelConfig
from .decoder import BlockSpec, DecoderSpec, LayerSpec, RopeSpec
from .weights import HFWeight

# Rotary tables that old checkpoints saved as weights, and a GGUF's rope_freqs (read into the
# config's rope scaling).
IGNORED_HF_WEIGHTS = re.compile(r"\.rotary_emb\.inv_freq$|^rope_freqs\.weight$")


def decoder_spec(config: ModelConfig) -> DecoderSpec:
    block = BlockSpec(config.hidden_size, config.intermediate_size, config.num_heads,
                      config.num_kv_heads, config.head_dim, "rms_norm", config.norm_eps,
                      config.activation, qkv_bias=config.qkv_bias, out_bias=config.o_bias,
                      mlp_bias=config.mlp_bias, qk_norm=config.qk_norm)
    layers = tuple(LayerSpec(config.attention_scale, config.layer_window(i))
                   for i in range(config.num_layers))
    rope = RopeSpec(config.rope_theta, config.rope_scaling, config.rotary_dim or config.head_dim)
    return DecoderSpec(block, layers, (rope,), config.vocab_size, config.tie_word_embeddings,
                       config.max_position_embeddings)


def global_weights(config: ModelConfig, norm_shift: float = 0.0) -> dict[str, HFWeight]:
    """The embedding, final norm and (untied) head under Llama-style Hugging Face names."""
    out = {"embed.weight": HFWeight(("model.embed_tokens.weight",)),
           "norm.weight": HFWeight(("model.norm.weight",), shift=norm_shift)}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = HFWeight(("lm_head.weight",))
    return out


def attention_weights(config: ModelConfig, ours: str, hf: str,
                      norm_shift: float = 0.0) -> dict[str, HFWeight]:
    """Layer ``ours``'s attention from separate q / k / v / o projections (and QK norms) under
    the Hugging Face prefix ``hf``."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    out = {}
    for kind in ["weight"] + ["bias"] * config.qkv_bias:
        out[f"{ours}attn.qkv.{kind}"] = HFWeight(
            tuple(f"{hf}self_attn.{p}_proj.{kind}" for p in "qkv"),
            sizes=(q_size, kv_size, kv_size))
    for kind in ["weight"] + ["bias"] * config.o_bias:
        out[f"{ours}attn.out.{kind}"] = HFWeight((f"{hf}self_attn.o_proj.{kind}",))
    if config.qk_norm:
        for p in "qk":
            out[f"{ours}attn.{p}_norm.weight"] = HFWeight((f"{hf}self_attn.{p}_norm.weight",),
                                                          shift=norm_shift)
    return out


def hf_weight_map(config: ModelConfig) -> dict[str, HFWeight]:
    """Our parameter name -> the Hugging Face tensors it is made of (fused ones are the
    concatenation of theirs along dim 0)."""
    inter = config.intermediate_size
    out = global_weights(config)
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        out[ours + "attn_norm.weight"] = HFWeight((hf + "input_layernorm.weight",))
        out[ours + "mlp_norm.weight"] = HFWeight((hf + "post_attention_layernorm.weight",))
        out |= attention_weights(config, ours, hf)
        for kind in ["weight"] + ["bias"] * config.mlp_bias:
            out[f"{ours}mlp.up.{kind}"] = HFWeight(
                (f"{hf}mlp.gate_proj.{kind}", f"{hf}mlp.up_proj.{kind}"), sizes=(inter, inter))
            out[f"{ours}mlp.down.{kind}"] = HFWeight((f"{hf}mlp.down_proj.{kind}",))
    return out


def canonical_hf_name(name: str) -> str:
    return name
