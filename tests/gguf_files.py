"""Small GGUF files written from tiny random Hugging Face models, as llama.cpp's converter
writes them (its tensor names, Q/K rows permuted for ``llama``, GPT-2's Conv1D weights
transposed), each tensor in a chosen GGUF type, with a small tokenizer in the metadata."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from orca_ext.model.tokenizer import bytes_to_unicode

VOCAB = 300
# Every type gguf.quants dequantizes; gguf-py quantizes all but the K-quants.
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K,
         Q.Q5_K, Q.Q6_K]
# The offsets of the float16 scales (d, and dmin or m) in the blocks random_blocks writes.
_SCALE_OFFSETS = {Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q2_K: (80, 82), Q.Q3_K: (108,),
                  Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ1_S: (0,),
                  Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,),
                  Q.IQ3_S: (0,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}
# The types gguf-py only dequantizes: the file holds random blocks of them.
RANDOM_BLOCK_TYPES = tuple(t for t in _SCALE_OFFSETS if t not in (Q.Q5_0, Q.Q5_1))

_COMMON = dict(vocab_size=VOCAB, max_position_embeddings=512, initializer_range=0.1,
               bos_token_id=1, eos_token_id=2)
_LLAMA = dict(_COMMON, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
              rope_theta=10000.0)
SPECS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_LLAMA, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_LLAMA, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(_LLAMA, tie_word_embeddings=True, head_dim=128)),
    # llama.cpp's Gemma 3 conventions (a GGUF does not store them): every sixth layer global,
    # local rotary base 10000, queries scaled by 1 / sqrt(head_dim).
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(_LLAMA, num_hidden_layers=6, head_dim=256, pad_token_id=0, sliding_window=6,
                    query_pre_attn_scalar=256, rope_theta=1e6, rope_local_base_freq=10000.0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(_LLAMA, num_hidden_layers=3, tie_word_embeddings=False, pad_token_id=0)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_embd=256, n_layer=3, n_head=4, n_positions=1024,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=2)),
}
_LLAMA_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
                "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_QK_NORMS = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_BLOCKS = {
    "qwen3": _LLAMA_BLOCK | _QK_NORMS,
    "gemma3": _LLAMA_BLOCK | _QK_NORMS | {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {"input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"},
}
_GPT2_BLOCK = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
               "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}


def make_model(arch: str, seed: int = 0) -> transformers.PreTrainedModel:
    config_cls, model_cls, kwargs = SPECS[arch]
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order of a Q or K projection's rows (its ``LlamaModel.permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def gguf_tensors(model: transformers.PreTrainedModel, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names and in its layout (float32)."""
    config = model.config
    out = {}
    for name, value in model.state_dict().items():
        w = value.float().numpy()
        if arch == "gpt2":
            name = name.removeprefix("transformer.")
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue
            if name.startswith("h."):
                _, layer, rest = name.split(".", 2)
                part, kind = rest.rsplit(".", 1)
                gguf_name = f"blk.{layer}.{_GPT2_BLOCK[part]}.{kind}"
                if kind == "weight" and w.ndim == 2:
                    w = w.T
            else:
                gguf_name = {"wte.weight": "token_embd.weight",
                             "wpe.weight": "position_embd.weight",
                             "ln_f.weight": "output_norm.weight", "ln_f.bias": "output_norm.bias",
                             "lm_head.weight": "output.weight"}[name]
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
        else:
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            if name.startswith("model.layers."):
                _, _, layer, rest = name.split(".", 3)
                part, kind = rest.rsplit(".", 1)
                gguf_name = f"blk.{layer}.{_BLOCKS.get(arch, _LLAMA_BLOCK)[part]}.{kind}"
                if arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
                    heads = (config.num_attention_heads if part == "self_attn.q_proj"
                             else config.num_key_value_heads)
                    w = llama_cpp_permute(w, heads)
            else:
                gguf_name = {"model.embed_tokens.weight": "token_embd.weight",
                             "model.norm.weight": "output_norm.weight",
                             "lm_head.weight": "output.weight"}[name]
            if arch == "gemma3" and name.endswith("norm.weight"):
                w = w + 1  # llama.cpp's Gemma converter stores the scale 1 + w
        out[gguf_name] = np.ascontiguousarray(w)
    return out


def random_blocks(kind: Q, rows: int, cols: int, rng: np.random.Generator,
                  scale: float = 0.01) -> np.ndarray:
    """uint8 ``[rows, row bytes]``: valid blocks of ``kind`` (Q5_0, Q5_1, a K-quant or an
    i-quant but IQ1_M) with random quant bytes (q6_K's int8 sub-block scales, the i-quants' grid
    indices and signs among them) and float16 scales in ``[scale / 10, 1.1 scale)``."""
    weights, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    shape = (rows, cols // weights)
    blocks = rng.integers(0, 256, size=(*shape, block_bytes), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[kind]:
        scales = (rng.random(shape) * scale + scale / 10).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(*shape, 2)
    return blocks.reshape(rows, -1)


def encode_tensor(values: np.ndarray, kind: Q, rng: np.random.Generator) -> np.ndarray:
    """``values`` stored as ``kind``: quantized by gguf-py where it can; for the K-quants and
    the i-quants (which it only dequantizes) random blocks with small float16 scales, so the
    file's own bytes are the reference."""
    if kind not in RANDOM_BLOCK_TYPES:
        return gguf.quants.quantize(values, kind)
    return random_blocks(kind, *values.shape, rng)


def _padded(tokens: list[str], types: list[int]) -> tuple[list[str], list[int]]:
    unused = VOCAB - len(tokens)
    return tokens + [f"[UNUSED{i}]" for i in range(unused)], types + [5] * unused


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): the 256 byte symbols, a few merges, two control tokens,
    unused tokens up to the model's vocabulary."""
    symbols = [bytes_to_unicode()[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "a n", "Ġa n", "Ġan d", "e r", "o n",
              "Ġ o", "Ġo f", "Ġ i", "Ġi n", "r e", "Ġ s", "Ġ w", "Ġ 1", "1 2", "Ċ Ċ"]
    tokens = symbols + ["".join(m.split(" ")) for m in merges]
    tokens += ["<|endoftext|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return _padded(tokens, types) + (merges,)


def sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    """(tokens, token types, scores): unk/bos/eos, 256 byte-fallback tokens, a few pieces,
    unused tokens up to the model's vocabulary."""
    pieces = ["▁", "e", "t", "a", "o", "h", "n", "s", "i", "r", "d", "l", "▁t", "he", "▁the",
              "▁a", "an", "▁an", "▁and", "in", "▁in", "er", "on", "▁o", "▁of", "re", "▁s",
              "▁w", "is", "▁is"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    tokens, types = _padded(tokens, types)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return tokens, types, scores


def write_gguf(model: transformers.PreTrainedModel, arch: str, path: Path,
               types: dict[str, Q] | Q = Q.F32, tokenizer: str | None = None,
               pre: str | None = None, skip: tuple[str, ...] = (),
               reshape: dict[str, tuple[int, ...]] | None = None, seed: int = 0,
               extra: dict[str, np.ndarray] | None = None) -> Path:
    """Write ``model`` as a GGUF: each tensor as ``types[name]`` (or one type for all; 1-D
    tensors stay F32), the tokenizer ``tokenizer`` ("gpt2" byte-level BPE with pre-tokenizer
    ``pre``, or "llama" SentencePiece; default by architecture), minus the tensors in ``skip``
    and with the shapes in ``reshape`` changed (for the bad-file tests), plus the float32
    tensors ``extra``."""
    rng = np.random.default_rng(seed)
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    if arch == "gpt2":
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_feed_forward_length(4 * config.n_embd)
        writer.add_block_count(config.n_layer)
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
    else:
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
        writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
        head_dim = getattr(config, "head_dim", None) or (config.hidden_size //
                                                         config.num_attention_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
        if arch == "gemma3":
            writer.add_sliding_window(config.sliding_window)
        if arch == "phi3":  # transformers' GGUF load of phi3 defaults it to 32000
            writer.add_pad_token_id(0)
    writer.add_vocab_size(VOCAB)
    tokenizer = tokenizer or ("llama" if arch == "llama" else "gpt2")
    writer.add_tokenizer_model(tokenizer)
    if tokenizer == "gpt2":
        tokens, token_types, merges = byte_level_vocab()
        writer.add_tokenizer_pre(pre or ("qwen2" if arch == "qwen2" else "gpt-2"))
        writer.add_token_merges(merges)
        writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    else:
        tokens, token_types, scores = sentencepiece_vocab()
        writer.add_token_scores(scores)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    for name, values in {**gguf_tensors(model, arch), **(extra or {})}.items():
        if name in skip:
            continue
        if reshape and name in reshape:
            values = np.zeros(reshape[name], dtype=np.float32)
        kind = types.get(name, Q.F32) if isinstance(types, dict) else types
        if values.ndim == 1:
            kind = Q.F32
        data = encode_tensor(values, kind, rng)
        if data.dtype != np.uint8:  # F32 and F16: the writer takes the type from the array
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
