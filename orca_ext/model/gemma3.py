"""Gemma 3 (text): RMSNorms before and after attention and the MLP, QK norms, a GELU-tanh gated
MLP, head_dim independent of hidden / heads, embeddings scaled by sqrt(hidden), the query scaled
by ``query_pre_attn_scalar``, and local sliding-window layers (rotary base
``rope_local_base_freq``) between global ones (every sixth by default, base ``rope_theta``)."""
from __future__ import annotations

import math
import re

from . import llama
from .config import ModelConfig
from .decoder import BlockSpec, DecoderSpec, LayerSpec, RopeSpec
from .weights import HFWeight

IGNORED_HF_WEIGHTS = re.compile(r"\.rotary_emb\.inv_freq$")
# Gemma's RMSNorms scale by 1 + w: their stored w is shifted by 1 at load.
NORM_SHIFT = 1.0
_GLOBAL_ROPE, _LOCAL_ROPE = 0, 1


def decoder_spec(config: ModelConfig) -> DecoderSpec:
    block = BlockSpec(config.hidden_size, config.intermediate_size, config.num_heads,
                      config.num_kv_heads, config.head_dim, "rms_norm", config.norm_eps,
                      config.activation, qkv_bias=config.qkv_bias, out_bias=config.o_bias,
                      qk_norm=True, post_norms=True)
    layers = tuple(LayerSpec(config.attention_scale, config.layer_window(i),
                             _LOCAL_ROPE if config.layer_window(i) else _GLOBAL_ROPE)
                   for i in range(config.num_layers))
    dim = config.rotary_dim or config.head_dim
    ropes = (RopeSpec(config.rope_theta, config.rope_scaling, dim),
             RopeSpec(config.rope_local_theta or 10000.0, None, dim))
    return DecoderSpec(block, layers, ropes, config.vocab_size, config.tie_word_embeddings,
                       config.max_position_embeddings, embed_scale=math.sqrt(config.hidden_size))


def hf_weight_map(config: ModelConfig) -> dict[str, HFWeight]:
    """Our parameter name -> the Hugging Face tensors it is made of (fused ones are the
    concatenation of theirs along dim 0; norms shifted by ``NORM_SHIFT``)."""
    inter = config.intermediate_size
    out = llama.global_weights(config, NORM_SHIFT)
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for our_name, hf_name in (("attn_norm", "input_layernorm"),
                                  ("post_attn_norm", "post_attention_layernorm"),
                                  ("mlp_norm", "pre_feedforward_layernorm"),
                                  ("post_mlp_norm", "post_feedforward_layernorm")):
            out[f"{ours}{our_name}.weight"] = HFWeight((f"{hf}{hf_name}.weight",),
                                                       shift=NORM_SHIFT)
        out |= llama.attention_weights(config, ours, hf, NORM_SHIFT)
        out[f"{ours}mlp.up.weight"] = HFWeight(
            (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"), sizes=(inter, inter))
        out[f"{ours}mlp.down.weight"] = HFWeight((f"{hf}mlp.down_proj.weight",))
    return out


def canonical_hf_name(name: str) -> str:
    """Multimodal Gemma 3 checkpoints nest the text model under ``language_model``."""
    return name.replace("model.language_model.", "model.", 1)
