"""Model configuration parsed from a Hugging Face ``config.json``.

``ModelConfig.from_hf`` normalizes the per-family key names (GPT-2's ``n_embd``/``n_layer``...,
Llama's ``hidden_size``/``num_hidden_layers``...) into one flat dataclass and rejects what the
models here cannot run exactly, naming the value. The family files turn it into the
description of their blocks (``decoder.DecoderSpec``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> model family (the file in orca_ext/model/ that describes it).
ARCHITECTURES = {
    "GPT2LMHeadModel": "gpt2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
_MODEL_TYPES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "phi3": "Phi3ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                     "gelu_fast": "gelu_tanh", "relu": "relu"}
_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_GATED = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul",
          "gelu_tanh": "gelu_tanh_and_mul"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    family: str  # the family file: "gpt2", "llama" (Llama, Mistral, Qwen2, Qwen3), "gemma3", "phi3"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    activation: str  # packed_linear epilogue of the MLP's first linear
    tie_word_embeddings: bool
    attention_scale: float  # softmax scale of q.k, 1/sqrt(head_dim) unless the config says not
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm of each q and k head (Qwen3, Gemma 3)
    rope_theta: float = 10000.0
    # {"rope_type": "linear" | "llama3" | "longrope", ...}; longrope's "factors" are the ones
    # this model serves with (see _rope).
    rope_scaling: dict[str, Any] | None = None
    rope_local_theta: float | None = None  # Gemma 3's sliding-window layers' rotary base
    rotary_dim: int | None = None  # rotated dims of a head (partial rotary), None: head_dim
    sliding_window: int | None = None
    # Per layer: "full_attention" or "sliding_attention" (the window above); () for all full.
    layer_types: tuple[str, ...] = ()
    scale_attn_by_inverse_layer_idx: bool = False  # GPT-2 option: scores / (layer + 1)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.family != "gpt2" and self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not
                                            0 < self.rotary_dim <= self.head_dim):
            raise ValueError(f"partial rotary over {self.rotary_dim} of {self.head_dim} dims: "
                             "it must be even and at most head_dim")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_layers} layers")
        bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ValueError(f"unsupported layer type {bad[0]!r}; supported: 'full_attention', "
                             "'sliding_attention'")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int:
        """Layer ``layer``'s attention window (0: none)."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return int(self.sliding_window)
        return 0

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        architecture = _architecture(hf)
        family = ARCHITECTURES[architecture]
        parse = {"gpt2": _gpt2_fields, "llama": _llama_fields, "gemma3": _gemma3_fields,
                 "phi3": _phi3_fields}[family]
        try:
            fields = parse(hf, architecture)
            return cls(architecture=architecture, family=family, vocab_size=hf["vocab_size"],
                       bos_token_id=hf.get("bos_token_id"),
                       eos_token_ids=_token_ids(hf.get("eos_token_id")), hf_config=dict(hf),
                       **fields)
        except KeyError as e:
            raise ValueError(f"config.json for {architecture} lacks the key "
                             f"{e.args[0]!r}") from None


def _architecture(hf: dict[str, Any]) -> str:
    names = hf.get("architectures") or []
    if not names:
        model_type = hf.get("model_type")
        names = [_MODEL_TYPES.get(model_type, f"model_type={model_type!r}")]
    for name in names:
        if name in ARCHITECTURES:
            return name
    raise ValueError(f"unsupported architecture {names[0]!r}; supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _gpt2_fields(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        raise ValueError(f"unsupported GPT-2 activation_function {act!r}; supported: "
                         f"{', '.join(_GPT2_ACTIVATIONS)}")
    hidden, heads = hf["n_embd"], hf["n_head"]
    return dict(hidden_size=hidden, num_layers=hf["n_layer"], num_heads=heads, num_kv_heads=heads,
                head_dim=hidden // heads, intermediate_size=hf.get("n_inner") or 4 * hidden,
                max_position_embeddings=hf["n_positions"],
                norm_eps=hf.get("layer_norm_epsilon", 1e-5), activation=_GPT2_ACTIVATIONS[act],
                tie_word_embeddings=hf.get("tie_word_embeddings", True), qkv_bias=True,
                o_bias=True, mlp_bias=True,
                attention_scale=(hidden // heads) ** -0.5 if hf.get("scale_attn_weights", True)
                else 1.0,
                scale_attn_by_inverse_layer_idx=hf.get("scale_attn_by_inverse_layer_idx", False))


def _gated_activation(hf: dict[str, Any], key: str, default: str, architecture: str) -> str:
    act = hf.get(key) or default
    if act not in _GATED:
        raise ValueError(f"unsupported {key} {act!r} for {architecture}; supported: "
                         f"{', '.join(_GATED)}")
    return _GATED[act]


def _common_fields(hf: dict[str, Any], architecture: str, default_act: str = "silu",
                   act_key: str = "hidden_act") -> dict[str, Any]:
    """The keys Llama-like configs share."""
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return dict(hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=head_dim, attention_scale=head_dim ** -0.5,
                intermediate_size=hf["intermediate_size"],
                max_position_embeddings=hf["max_position_embeddings"],
                norm_eps=hf.get("rms_norm_eps", 1e-6),
                activation=_gated_activation(hf, act_key, default_act, architecture))


def _llama_fields(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    fields = _common_fields(hf, architecture)
    qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = hf.get("attention_bias", False)
    theta, scaling, rotary_dim = _rope(hf, fields["head_dim"])
    window = hf.get("sliding_window")
    if architecture == "MistralForCausalLM" and window:
        layer_types = ("sliding_attention",) * fields["num_layers"]
    elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and hf.get("use_sliding_window"):
        layer_types = tuple(hf.get("layer_types") or (
            "sliding_attention" if i >= hf.get("max_window_layers", 0) else "full_attention"
            for i in range(fields["num_layers"])))
    else:
        layer_types, window = (), None
    return dict(fields, tie_word_embeddings=hf.get("tie_word_embeddings", False),
                qkv_bias=qwen2 or attention_bias, o_bias=attention_bias and not qwen2,
                mlp_bias=hf.get("mlp_bias", False), qk_norm=architecture == "Qwen3ForCausalLM",
                rope_theta=theta, rope_scaling=scaling, rotary_dim=rotary_dim,
                sliding_window=window, layer_types=layer_types)


def _gemma3_fields(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    fields = _common_fields(hf, architecture, "gelu_pytorch_tanh", "hidden_activation")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise ValueError(f"unsupported {key} {hf[key]!r} for {architecture} (Gemma 3 has "
                             "none; Gemma 2's soft-capping is not implemented)")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"unsupported use_bidirectional_attention for {architecture} (an "
                         "embedding model, not a causal LM)")
    layers = fields["num_layers"]
    pattern = hf.get("sliding_window_pattern", 6)
    layer_types = tuple(hf.get("layer_types") or (
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)))
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one rope per layer type
        theta, scaling, rotary_dim = _rope({"rope_parameters": params["full_attention"]},
                                           fields["head_dim"])
        local, _, _ = _rope({"rope_parameters": params.get("sliding_attention") or
                             {"rope_theta": 10000.0}}, fields["head_dim"])
    else:
        theta, scaling, rotary_dim = _rope({"rope_theta": 1_000_000.0, **hf}, fields["head_dim"])
        local = float(hf.get("rope_local_base_freq", 10000.0))
    return dict(fields, attention_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
                tie_word_embeddings=hf.get("tie_word_embeddings", True),
                qkv_bias=hf.get("attention_bias", False), o_bias=hf.get("attention_bias", False),
                qk_norm=True, rope_theta=theta, rope_scaling=scaling, rope_local_theta=local,
                rotary_dim=rotary_dim, sliding_window=hf.get("sliding_window"),
                layer_types=layer_types)


def _phi3_fields(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    fields = _common_fields(hf, architecture)
    theta, scaling, rotary_dim = _rope(hf, fields["head_dim"])
    window = hf.get("sliding_window")
    return dict(fields, tie_word_embeddings=hf.get("tie_word_embeddings", False),
                rope_theta=theta, rope_scaling=scaling, rotary_dim=rotary_dim,
                sliding_window=window,
                layer_types=("sliding_attention",) * fields["num_layers"] if window else ())


def _rope(hf: dict[str, Any], head_dim: int
          ) -> tuple[float, dict[str, Any] | None, int | None]:
    """(theta, scaling, rotary dims or None for all) from transformers 5's ``rope_parameters``
    or the older ``rope_theta`` + ``rope_scaling`` + ``partial_rotary_factor`` keys."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type in ("su", "yarn") and "long_factor" in params:
        rope_type = "longrope"  # Phi-3's older names for it
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: "
                         f"{', '.join(_ROPE_TYPES)}")
    fraction = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    rotary_dim = None if fraction == 1.0 else int(head_dim * fraction)
    if rope_type == "default":
        return theta, None, rotary_dim
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
    if rope_type == "longrope":
        return theta, _longrope(hf, params), rotary_dim
    return theta, {"rope_type": rope_type, **params}, rotary_dim


def _longrope(hf: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE's factors for this model: the long ones where its context is longer than the
    original one (as llama.cpp decides, once per model rather than per step, so a request's
    rotation never depends on its batch), and Hugging Face's attention factor."""
    original = params.get("original_max_position_embeddings") or hf.get(
        "original_max_position_embeddings") or hf["max_position_embeddings"]
    longest = hf["max_position_embeddings"]
    factor = params.get("factor") or longest / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(
            1 + math.log(factor) / math.log(original))
    factors = params["long_factor"] if longest > original else params["short_factor"]
    return {"rope_type": "longrope", "factors": tuple(float(f) for f in factors),
            "attention_factor": float(attention_factor),
            "original_max_position_embeddings": int(original)}


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)
