"""Phi-3 (and Phi-4-mini's shape): Llama's block with qkv and gate_up fused in the checkpoint,
LongRoPE (per-frequency short / long factors and an attention factor), optional partial rotary
and sliding window."""
from __future__ import annotations

import re

from . import llama
from .config import ModelConfig
from .decoder import DecoderSpec
from .weights import HFWeight

IGNORED_HF_WEIGHTS = re.compile(r"\.rotary_emb\.inv_freq$|^rope_factors_(long|short)\.weight$")


def decoder_spec(config: ModelConfig) -> DecoderSpec:
    return llama.decoder_spec(config)


def hf_weight_map(config: ModelConfig) -> dict[str, HFWeight]:
    """Our parameter name -> the Hugging Face tensor it is (the checkpoint's own fusions are
    ours: ``qkv_proj`` and ``gate_up_proj``)."""
    out = llama.global_weights(config)
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for our_name, hf_name in (("attn_norm", "input_layernorm"),
                                  ("mlp_norm", "post_attention_layernorm"),
                                  ("attn.qkv", "self_attn.qkv_proj"),
                                  ("attn.out", "self_attn.o_proj"),
                                  ("mlp.up", "mlp.gate_up_proj"), ("mlp.down", "mlp.down_proj")):
            out[f"{ours}{our_name}.weight"] = HFWeight((f"{hf}{hf_name}.weight",))
    return out


def canonical_hf_name(name: str) -> str:
    return name
