"""Tiny random Hugging Face models saved as model folders, for the model and loader tests."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

from orca_ext.model import byte_level_tokenizer

VOCAB = 300  # the byte tokenizer's 257 tokens, and some unused ids

_COMMON = dict(vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.1,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)
_LLAMA = dict(_COMMON, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}

# name -> (config class, model class, config kwargs)
SPECS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                  initializer_range=0.1, bos_token_id=None, eos_token_id=None)),
    # GQA, untied head, llama3 rope scaling.
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM",
                  dict(_LLAMA, num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=False, rope_parameters=_LLAMA3_ROPE)),
    # MHA, tied head, attention and MLP biases.
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM",
                   dict(_LLAMA, num_attention_heads=4, num_key_value_heads=4,
                        tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    # qkv bias (no o_proj bias), GQA 4:1.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(_LLAMA, num_attention_heads=4, num_key_value_heads=1)),
    # head_dim != hidden / heads.
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(_LLAMA, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     sliding_window=None)),
    # A sliding window shorter than the prompts.
    "mistral_window": ("MistralConfig", "MistralForCausalLM",
                       dict(_LLAMA, num_attention_heads=4, num_key_value_heads=2,
                            sliding_window=5)),
    # QK norms, head_dim != hidden / heads.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(_LLAMA, num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(_LLAMA, num_attention_heads=4, num_key_value_heads=2, pad_token_id=None)),
    # LongRoPE (every sequence longer than the original context: the long factors), partial
    # rotary and a tied head, as Phi-4-mini.
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM",
                      dict(_LLAMA, num_attention_heads=4, num_key_value_heads=2,
                           pad_token_id=None, tie_word_embeddings=True,
                           original_max_position_embeddings=4,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.75,
                                            "short_factor": [1.0, 1.5, 2.0, 2.5, 3.0, 3.5],
                                            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]})),
    # Local layers (window shorter than the prompts, their own rotary base) around a global
    # one, QK and post norms, GELU-tanh gating, scaled embeddings, a query_pre_attn_scalar.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(_LLAMA, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, pad_token_id=None, sliding_window=5,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    query_pre_attn_scalar=24,
                    rope_parameters={"full_attention": {"rope_type": "default",
                                                        "rope_theta": 10000.0},
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 100.0}})),
}


def make_hf_model(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random model; its norm weights are random too (Gemma's start at 0, others' at 1)."""
    config_cls, model_cls, kwargs = SPECS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**kwargs)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name or "ln_" in param_name:
                param.add_(torch.randn(param.shape) * 0.2)
    return model


def save_hf_model(model: transformers.PreTrainedModel, folder: Path, **save_kwargs) -> Path:
    """``save_pretrained`` plus the byte-level tokenizer.json that load_model needs."""
    model.save_pretrained(folder, **save_kwargs)
    byte_level_tokenizer(["<|endoftext|>"]).save(folder / "tokenizer.json")
    return folder
