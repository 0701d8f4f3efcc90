"""Model configuration parsed from a Hugging Face ``config.json``.

``ModelConfig.from_hf`` normalizes the per-family key names (GPT-2's ``n_embd``/``n_layer``...,
Llama's ``hidden_size``/``num_hidden_layers``...) into one flat dataclass and rejects what the
models here cannot run exactly, naming the value.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> model family (the file in orca_ext/model/ that implements it).
ARCHITECTURES = {
    "GPT2LMHeadModel": "gpt2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                     "gelu_fast": "gelu_tanh", "relu": "relu"}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    family: str  # "gpt2" or "llama" (Llama, Mistral and Qwen2 share llama.py)
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
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear" | "llama3", ...}
    sliding_window: int | None = None
    scale_attn_by_inverse_layer_idx: bool = False  # GPT-2 option: scores / (layer + 1)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.family == "llama" and self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly: a sliding window (not implemented by the attention
        op) caps it, since within the window full attention is identical."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        architecture = _architecture(hf)
        family = ARCHITECTURES[architecture]
        try:
            fields = _gpt2_fields(hf) if family == "gpt2" else _llama_fields(hf, architecture)
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
        by_type = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                   "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        names = [by_type.get(hf.get("model_type"), f"model_type={hf.get('model_type')!r}")]
    for name in names:
        if name in ARCHITECTURES:
            return name
    raise ValueError(f"unsupported architecture {names[0]!r}; supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _gpt2_fields(hf: dict[str, Any]) -> dict[str, Any]:
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


def _llama_fields(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} for {architecture}; supported: 'silu'")
    heads = hf["num_attention_heads"]
    qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = hf.get("attention_bias", False)
    if architecture == "MistralForCausalLM" or (qwen2 and hf.get("use_sliding_window")):
        sliding_window = hf.get("sliding_window")
    else:
        sliding_window = None
    theta, scaling = _rope(hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return dict(hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=head_dim, attention_scale=head_dim ** -0.5,
                intermediate_size=hf["intermediate_size"],
                max_position_embeddings=hf["max_position_embeddings"],
                norm_eps=hf.get("rms_norm_eps", 1e-6), activation="silu_and_mul",
                tie_word_embeddings=hf.get("tie_word_embeddings", False),
                qkv_bias=qwen2 or attention_bias, o_bias=attention_bias and not qwen2,
                mlp_bias=hf.get("mlp_bias", False), rope_theta=theta, rope_scaling=scaling,
                sliding_window=sliding_window)


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` keys."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: "
                         f"{', '.join(_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {params['partial_rotary_factor']!r}")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
    return theta, {"rope_type": rope_type, **params}


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)
