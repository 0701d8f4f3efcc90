"""GGUF files (llama.cpp's format), read with llama.cpp's own ``gguf`` package.

A file carries the model's config as metadata, its tokenizer (vocabulary, merges, special
tokens, chat template) and its tensors under llama.cpp's names, often in a block-quantized format.
``GGUFFile`` checks the file once; ``hf_config`` turns its metadata into the Hugging Face
``config.json`` keys ``ModelConfig.from_hf`` reads; ``GGUFCheckpoint`` presents its tensors under
Hugging Face names and layout, dequantized on demand (``raw`` keeps the stored blocks for a
quantized path); ``gguf_tokenizer`` (in gguf_tokenizer.py) rebuilds the tokenizer as a
``tokenizers.Tokenizer``.
"""
from __future__ import annotations

import mmap
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .gguf_tokenizer import gguf_tokenizer  # noqa: F401  (imported from here by the loader)
from .weights import Checkpoint

# General llama.cpp architecture -> Hugging Face architecture (Mistral files say "llama").
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gpt2": "GPT2LMHeadModel"}

_LLAMA_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_BLOCK_NAMES = {
    "llama": _LLAMA_BLOCK, "qwen2": _LLAMA_BLOCK, "qwen3": _LLAMA_BLOCK | _QK_NORMS,
    "gemma3": _LLAMA_BLOCK | _QK_NORMS | {
        "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
    "gpt2": {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
             "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
}
_DECODER_GLOBALS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                    "output": "lm_head"}
_GPT2_GLOBALS = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                 "output_norm": "transformer.ln_f", "output": "lm_head"}
# Gemma's converter stores its RMSNorm weights w as 1 + w (the scale it multiplies by); the
# checkpoint presents Hugging Face's w, which the family's weight map shifts back.
_NORM_SHIFTS = {"gemma3": 1.0}
# GPT-2's Conv1D weights are [in, out] in Hugging Face checkpoints; llama.cpp stores [out, in].
_CONV1D_PARTS = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")


def _tensor_types() -> dict[str, Any]:
    from gguf import GGMLQuantizationType as Q

    return {t.name: t for t in (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                                Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ1_S, Q.IQ1_M,
                                Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL,
                                Q.IQ4_XS)}


class GGUFFile:
    """A GGUF file, checked when opened: readable, every tensor of a type that loads and with
    the bytes its shape needs. ``metadata`` maps keys to Python values."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"GGUF file {str(self.path)!r} does not exist")
        try:
            from gguf import GGML_QUANT_SIZES

            from .gguf_reader import GGUFArrayReader, contents
        except ImportError:
            raise ValueError(f"{self.path}: reading GGUF files needs the 'gguf' package "
                             "(pip install gguf)") from None
        try:
            reader = GGUFArrayReader(self.path)
        except Exception as e:  # the reader raises whatever its parser hits on a bad file
            raise ValueError(f"{self.path}: not a readable GGUF file "
                             f"({type(e).__name__}: {e})") from None
        self._mapping = reader.data.base  # the file's mmap.mmap, which the tensors view
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            try:
                self.metadata[key] = contents(field)
            except Exception as e:
                raise ValueError(f"{self.path}: metadata {key!r} does not decode ({e})") from None
        loadable = _tensor_types()
        self.tensors = {}
        for tensor in reader.tensors:
            kind = tensor.tensor_type.name
            if kind not in loadable:
                raise ValueError(f"{self.path}: tensor {tensor.name!r} has type {kind}, which "
                                 f"does not load; supported: {', '.join(loadable)}")
            block, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
            expected = int(tensor.n_elements) // block * block_bytes
            if int(tensor.n_elements) % block or tensor.data.nbytes != expected:
                raise ValueError(f"{self.path}: tensor {tensor.name!r} ({kind}, "
                                 f"{tensor.n_elements} elements) has {tensor.data.nbytes} bytes "
                                 f"of data, expected {expected}: the file is truncated or "
                                 "damaged")
            self.tensors[tensor.name] = tensor
        self.architecture = self.metadata.get("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"{self.path}: unsupported architecture {self.architecture!r}; "
                             f"supported: {', '.join(ARCHITECTURES)}")

    def release_pages(self) -> None:
        """Unmap the file's pages from this process (they stay in the page cache, and a later
        read of a tensor maps them again): once the weights are copied out, the file no longer
        counts in its resident memory."""
        if isinstance(self._mapping, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
            self._mapping.madvise(mmap.MADV_DONTNEED)

    def value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_value(self, key: str, default: Any = None) -> Any:
        """``{architecture}.{key}``, e.g. ``llama.block_count``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        full = f"{self.architecture}.{key}"
        if full not in self.metadata:
            raise ValueError(f"{self.path}: metadata lacks {full!r}")
        return self.metadata[full]


def hf_config(file: GGUFFile) -> dict[str, Any]:
    """The file's metadata as Hugging Face ``config.json`` keys."""
    tokens = file.value("tokenizer.ggml.tokens") or []
    embed = file.tensors.get("token_embd.weight")
    vocab = file.arch_value("vocab_size") or len(tokens) or (
        int(embed.shape[-1]) if embed is not None else None)
    if not vocab:
        raise ValueError(f"{file.path}: no vocab_size, tokenizer tokens or token_embd.weight")
    common = {"architectures": [ARCHITECTURES[file.architecture]], "vocab_size": int(vocab),
              "tie_word_embeddings": "output.weight" not in file.tensors,
              "bos_token_id": file.value("tokenizer.ggml.bos_token_id"),
              "eos_token_id": file.value("tokenizer.ggml.eos_token_id")}
    heads = int(file.require("attention.head_count"))
    hidden = int(file.require("embedding_length"))
    if file.architecture == "gpt2":
        return {**common, "model_type": "gpt2", "n_embd": hidden,
                "n_layer": int(file.require("block_count")), "n_head": heads,
                "n_positions": int(file.require("context_length")),
                "n_inner": int(file.arch_value("feed_forward_length", 4 * hidden)),
                "layer_norm_epsilon": float(file.arch_value("attention.layer_norm_epsilon",
                                                            1e-5)),
                "activation_function": "gelu_new"}
    head_dim = int(file.arch_value("attention.key_length", hidden // heads))
    rope_dim = int(file.arch_value("rope.dimension_count", head_dim))
    config = {**common, "model_type": file.architecture, "hidden_size": hidden,
              "num_hidden_layers": int(file.require("block_count")),
              "num_attention_heads": heads,
              "num_key_value_heads": int(file.arch_value("attention.head_count_kv", heads)),
              "head_dim": head_dim,
              "intermediate_size": int(file.require("feed_forward_length")),
              "max_position_embeddings": int(file.require("context_length")),
              "rms_norm_eps": float(file.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
              "rope_theta": float(file.arch_value("rope.freq_base", 10000.0)),
              "partial_rotary_factor": rope_dim / head_dim}
    if file.architecture == "gemma3":
        config |= _gemma3_config(file, head_dim)
    else:
        config["hidden_act"] = "silu"
    if file.architecture == "phi3" and "rope_factors_long.weight" in file.tensors:
        config["rope_scaling"] = _phi3_longrope(file)
        return config
    scaling = file.arch_value("rope.scaling.type", "none")
    if "rope_freqs.weight" in file.tensors:
        if scaling not in ("none", "llama3"):
            raise ValueError(f"{file.path}: rope_freqs.weight beside rope scaling {scaling!r} "
                             "is not supported")
        config["rope_scaling"] = _rope_freqs(file, rope_dim)
        return config
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear",
                                  "factor": float(file.require("rope.scaling.factor"))}
    elif scaling != "none":
        raise ValueError(f"{file.path}: unsupported rope scaling {scaling!r}; supported: "
                         "'none', 'linear'")
    return config


def _gemma3_config(file: GGUFFile, head_dim: int) -> dict[str, Any]:
    """Gemma 3's keys that its GGUF files do not store, as llama.cpp and transformers set them:
    every sixth layer global, local layers' rotary base 10000, the query scaled by
    1 / sqrt(head_dim)."""
    return {"hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": int(file.require("attention.sliding_window")),
            "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": head_dim,
            "final_logit_softcapping": file.arch_value("final_logit_softcapping"),
            "attn_logit_softcapping": file.arch_value("attn_logit_softcapping")}


def _rope_freqs(file: GGUFFile, rope_dim: int) -> dict[str, Any]:
    """Llama 3.1's rope scaling as llama.cpp's converter stores it: rope_freqs.weight, each
    frequency's divisor (1 for the high ones, the factor for the low ones, interpolated
    between), which LongRoPE's per-frequency factors apply as llama.cpp does, its cos and sin
    unscaled."""
    values = _Dequantized(file, "rope_freqs.weight", False, None)[:].reshape(-1)
    if values.numel() != rope_dim // 2 or not bool(((values > 0) & values.isfinite()).all()):
        raise ValueError(f"{file.path}: rope_freqs.weight must hold {rope_dim // 2} positive "
                         f"factors (rotary dims / 2), got {values.tolist()[:8]} "
                         f"({values.numel()} values)")
    factors = values.tolist()
    return {"rope_type": "longrope", "long_factor": factors, "short_factor": factors,
            "attention_factor": 1.0}


def _phi3_longrope(file: GGUFFile) -> dict[str, Any]:
    """Phi-3's LongRoPE from its factor tensors and scaling keys."""
    def factors(name: str) -> list[float]:
        return [float(f) for f in np.asarray(file.tensors[name].data, dtype=np.float32)]

    scaling: dict[str, Any] = {
        "rope_type": "longrope", "long_factor": factors("rope_factors_long.weight"),
        "short_factor": factors("rope_factors_short.weight"),
        "original_max_position_embeddings": int(file.require(
            "rope.scaling.original_context_length"))}
    attention_factor = file.arch_value("rope.scaling.attn_factor")
    if attention_factor is not None:
        scaling["attention_factor"] = float(attention_factor)
    return scaling


def _unpermute_rotary(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which interleaves each head's two rotary halves row by row."""
    shape = rows.shape
    return rows.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]) \
        .transpose(1, 2).reshape(shape)


# The 16-bit float types, converted to float32 by torch (exactly, as gguf.quants does).
_HALF_TYPES = {"F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class _Dequantized:
    """One GGUF tensor as the Hugging Face tensor it stands for, dequantized when indexed."""

    file: GGUFFile
    gguf_name: str
    transpose: bool
    rotary_heads: int | None
    shift: float = 0.0  # subtracted (a stored 1 + w norm weight as w)

    def get_shape(self) -> tuple[int, ...]:
        shape = tuple(int(n) for n in reversed(self.file.tensors[self.gguf_name].shape))
        return shape[::-1] if self.transpose else shape

    def __getitem__(self, index: Any) -> torch.Tensor:
        from gguf.quants import dequantize

        tensor = self.file.tensors[self.gguf_name]
        half = _HALF_TYPES.get(tensor.tensor_type.name)
        if half is not None:  # torch's conversion runs on every thread, numpy's on one
            with warnings.catch_warnings():  # the file's read-only map is only read from
                warnings.simplefilter("ignore", UserWarning)
                halves = torch.from_numpy(tensor.data.view(np.int16)).view(half)
            values = halves.float()
        else:
            values = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type),
                                          dtype=np.float32)
            if not values.flags.writeable:  # F32 data comes as a read-only view of the file
                values = values.copy()
            values = torch.from_numpy(values)
        values = values.reshape(tuple(int(n) for n in reversed(tensor.shape)))
        if self.rotary_heads is not None:
            values = _unpermute_rotary(values, self.rotary_heads)
        if self.shift:
            values = values - self.shift
        return (values.t() if self.transpose else values)[index]


class GGUFCheckpoint(Checkpoint):
    """A GGUF file's tensors under Hugging Face names, in Hugging Face layout (Q and K rows back
    in rotate-half order, GPT-2's Conv1D weights [in, out]), dequantized to float32 on demand."""

    def __init__(self, file: GGUFFile) -> None:
        self.file, self.source = file, str(file.path)
        arch = file.architecture
        blocks = _BLOCK_NAMES[arch]
        globals_ = _GPT2_GLOBALS if arch == "gpt2" else _DECODER_GLOBALS
        prefix = "transformer.h." if arch == "gpt2" else "model.layers."
        heads = int(file.arch_value("attention.head_count", 0))
        rotary_heads = {"attn_q": heads,
                        "attn_k": int(file.arch_value("attention.head_count_kv", heads))}
        self._tensors: dict[str, _Dequantized] = {}
        for name in file.tensors:
            base, _, kind = name.rpartition(".")
            parts = base.split(".")
            if parts[0] == "blk" and len(parts) == 3 and parts[2] in blocks:
                hf, part = f"{prefix}{parts[1]}.{blocks[parts[2]]}.{kind}", parts[2]
            elif base in globals_:
                hf, part = f"{globals_[base]}.{kind}", base
            else:
                hf, part = name, None  # reported as unused by check_names
            transpose = arch == "gpt2" and part in _CONV1D_PARTS and kind == "weight"
            # Only the llama converter permutes (the others keep Hugging Face's row order).
            permuted = arch == "llama" and part in rotary_heads
            norm = part is not None and part.endswith("norm") and kind == "weight"
            self._tensors[hf] = _Dequantized(file, name, transpose,
                                             rotary_heads[part] if permuted else None,
                                             _NORM_SHIFTS.get(arch, 0.0) if norm else 0.0)

    def names(self) -> list[str]:
        return list(self._tensors)

    def get_slice(self, name: str) -> _Dequantized:
        return self._tensors[name]

    def raw(self, name: str) -> Any:
        """The stored tensor (``gguf.ReaderTensor``: type, shape, block bytes) behind ``name``."""
        return self.file.tensors[self._tensors[name].gguf_name]

    def copy_raw_blocks(self, name: str, out: torch.Tensor) -> None:
        """Copy a quantized matrix's stored blocks into ``out`` (uint8 ``[rows, row bytes]``)
        straight from the file, Q and K rows back in Hugging Face order: each row is its own
        blocks along the input dim, so the un-permutation moves whole rows (and GPT-2's weights
        are stored [out, in] already)."""
        entry = self._tensors[name]
        tensor = self.file.tensors[entry.gguf_name]
        rows = int(tensor.n_elements) // int(tensor.shape[0])
        with warnings.catch_warnings():  # the file's read-only map is only read from
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(tensor.data.view(np.uint8).reshape(rows, -1))
        if blocks.shape != out.shape:
            raise ValueError(f"{self.source}: tensor {name!r} has {tuple(blocks.shape)} bytes of "
                             f"blocks, expected {tuple(out.shape)}")
        heads = entry.rotary_heads
        if heads is None:
            out.copy_(blocks)
        else:
            out.view(heads, 2, rows // heads // 2, -1).copy_(
                blocks.view(heads, rows // heads // 2, 2, -1).transpose(1, 2))
