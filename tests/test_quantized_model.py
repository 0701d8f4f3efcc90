"""Quantized models: a GGUF file's Q8_0 / Q4_0 / Q4_1 tensors, and Q5_0 / Q5_1 / Q4_K / Q5_K /
Q6_K ones, run as stored against the same weights dequantized to float32, other types converted
to q8_0, ``quantization="q8_0"`` on a safetensors model, the quantized embedding op, the
DecoderStack on quantized blocks, errors."""
from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch
from torch import nn
from gguf import GGMLQuantizationType as Q
from gguf_files import make_model, random_blocks, write_gguf
from test_decoder_stack import BATCHES, assert_fused_equals_per_op, run_both
from test_loader import forward_logits
from tiny_models import make_hf_model, save_hf_model

from orca_ext import LLM, SamplingParams, _C, ops
from orca_ext.config import EngineConfig
from orca_ext.model import load_model
from orca_ext.model.layers import Linear
from orca_ext.model import quantized as quantized_module
from orca_ext.model.quantized import (QuantizedEmbedding, QuantizedLinear, interleave_rows,
                                      rows16_formats)
from orca_ext.quantize import dequantize_weight, quantize_weight
from orca_ext.runner.decoder_stack import build_decoder_stack, unsupported_reason

ARCHS = ["llama", "qwen2", "gpt2", "gemma3", "phi3"]
ISAS = ["portable", "avx2", "avx512", "avx512_vnni", "amx_int8"]
TOKENS = [5, 17, 200, 3, 99, 42, 7, 250, 1, 64, 128, 33]
# Each layer's matrices in one native format (a fused qkv / gate_up shares it), the embedding
# Q8_0 as SmolLM2's file stores it, an untied head Q4_0.
LAYER_TYPES = [Q.Q4_1, Q.Q4_0, Q.Q8_0]


def native_types(arch: str) -> dict[str, Q]:
    parts = (["attn_qkv", "attn_output", "ffn_up", "ffn_down"] if arch in ("gpt2", "phi3") else
             ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"])
    types = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q4_0}
    config = make_model(arch).config
    for layer in range(getattr(config, "num_hidden_layers", None) or config.n_layer):
        for part in parts:
            types[f"blk.{layer}.{part}.weight"] = LAYER_TYPES[layer % len(LAYER_TYPES)]
    return types


@pytest.fixture(scope="module", params=ARCHS)
def gguf_file(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(arch) / f"{arch}.gguf"
    return write_gguf(make_model(arch), arch, path, native_types(arch))


@pytest.fixture(scope="module")
def native_and_float(gguf_file):
    return load_model(str(gguf_file)), load_model(str(gguf_file), quantization="none")


@pytest.fixture
def isa(request, force_isa) -> str:
    if request.param not in _C.quant_isas():
        pytest.skip(f"this CPU does not run the {request.param} path")
    force_isa("quant", request.param)
    return request.param


def stored_format(module) -> str:
    """A quantized layer's block format, whichever layout its rows are in (the loader puts
    decoder linears in the x16 layout on CPUs whose kernels read it)."""
    return module.format.removesuffix(ops.ROWS16_SUFFIX)


def _float_weight(module) -> torch.Tensor:
    return dequantize_weight(module.weight, module.format,
                             module.in_features if isinstance(module, QuantizedLinear)
                             else module.dim)


def test_stored_blocks_are_the_files_weights(native_and_float):
    """Every linear and the embedding keep the file's blocks: dequantized, they are the
    dequantized model's weights bit for bit (Q/K rows un-permuted as whole block rows, q/k/v and
    gate/up concatenated); a tied head shares the embedding's blocks."""
    native, dequantized = native_and_float
    floats = dict(dequantized.model.named_modules())
    kinds = set()
    for name, module in native.model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            kinds.add((type(module).__name__, stored_format(module)))
            assert torch.equal(_float_weight(module), floats[name].weight), name
        assert not isinstance(module, Linear), f"{name} was left unquantized"
    assert ("QuantizedEmbedding", "q8_0") in kinds
    assert {f for _, f in kinds} == {"q8_0", "q4_0", "q4_1"}
    if native.config.tie_word_embeddings:
        assert native.model.lm_head.weight is _embedding(native.model).weight
    assert native.dtype == torch.float32


def _embedding(model) -> QuantizedEmbedding:
    return model.embed if hasattr(model, "embed") else model.wte


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"], indirect=True)
def test_native_logits_match_the_dequantized_model(native_and_float, isa):
    """With float32 activations the quantized kernels multiply by the very weights the
    dequantized model holds (q * d is exact in float32) and differ from its GEMM only in the
    order of the float32 sums: logits of order 1 agree to ~1e-5 through the layers."""
    native, dequantized = native_and_float
    for tokens in (TOKENS, TOKENS[:1], TOKENS[:2]):  # the dot kernels, and 1-2 token steps
        torch.testing.assert_close(forward_logits(native, tokens),
                                   forward_logits(dequantized, tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", ["avx512_vnni", "amx_int8"], indirect=True)
def test_int8_activation_logits_stay_close(native_and_float, isa):
    """avx512_vnni and amx_int8 split the activations into two int8 parts per block of 32: each
    is off by up to max |x| / 65024 of its block (1-2 token steps; the tiles' longer steps
    max |x| / 64516; avx512_vnni's int16 GEMM beyond 8 tokens max |x| / 65534), finer than
    bfloat16: logits stay within 1e-3 of their largest and the top token stays (llama.cpp's one
    int8 part, off by max |x| / 254, moves them by ~1e-2)."""
    native, dequantized = native_and_float
    for tokens in (TOKENS[:1], TOKENS[:2], TOKENS):
        got, want = forward_logits(native, tokens), forward_logits(dequantized, tokens)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * float(want.abs().max()))
        # The random model's top logits are near-ties: one of the 12 may flip.
        assert (got.argmax(-1) == want.argmax(-1)).sum() >= len(tokens) - len(tokens) // 12


def test_greedy_outputs_match_the_dequantized_model(native_and_float):
    """The engine on the stored formats (DecoderStack decode steps on the default ISA) and on
    the dequantized weights: greedy outputs equal on most prompts (a near-tie in a random tiny
    model may flip one token, and everything after it)."""
    native, dequantized = native_and_float
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 40, (8,), generator=gen)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = [[list(o.outputs[0].token_ids) for o in
                LLM(m, max_batch_size=4, kv_cache_tokens=1024).generate(prompts, params,
                                                                         use_tqdm=False)]
               for m in (native, dequantized)]
    equal = sum(a == b for a, b in zip(*outputs))
    assert equal >= 6, f"{equal} of 8 greedy outputs equal"


def test_mixed_and_unread_types_convert_to_q8_0(tmp_path, caplog):
    """A fused weight whose parts mix a K-quant with another format (no format of ours holds
    both), and Q2_K / Q3_K, load as q8_0 (dequantized, then quantized: within q8_0's rounding of
    the file's values), with one logged note."""
    types = native_types("llama")
    types["blk.0.attn_k.weight"] = Q.Q4_K  # q and v stay Q4_1
    types["blk.1.ffn_down.weight"] = Q.Q3_K
    types["blk.1.ffn_gate.weight"] = types["blk.1.ffn_up.weight"] = Q.Q2_K
    path = write_gguf(make_model("llama"), "llama", tmp_path / "mixed.gguf", types)
    with caplog.at_level(logging.INFO, logger="orca_ext.model.quantized"):
        native = load_model(str(path))
    notes = [r.getMessage() for r in caplog.records if "converted to q8_0" in r.getMessage()]
    assert len(notes) == 1 and "3 weights" in notes[0] and "Q4_1+Q4_K" in notes[0]
    dequantized = load_model(str(path), quantization="none")
    floats = dict(dequantized.model.named_modules())
    for name in ("layers.0.attn.qkv", "layers.1.mlp.down", "layers.1.mlp.up"):
        module = native.model.get_submodule(name)
        assert stored_format(module) == "q8_0"
        want = floats[name].weight
        assert torch.equal(_float_weight(module),
                           dequantize_weight(quantize_weight(want, "q8_0"), "q8_0",
                                             want.shape[1]))
    assert stored_format(native.model.layers[1].attn.qkv) == "q4_0"


# The formats run as stored beyond Q8_0 / Q4_0 / Q4_1, one per layer of a gemma3 file (six
# layers, every width a multiple of 256; K-quants as random blocks), its tied embedding Q6_K.
STORED_LAYER_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q5_1]


@pytest.fixture(scope="module")
def stored_formats_file(tmp_path_factory):
    types = {"token_embd.weight": Q.Q6_K}
    for layer in range(make_model("gemma3").config.num_hidden_layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                     "ffn_down"):
            types[f"blk.{layer}.{part}.weight"] = STORED_LAYER_TYPES[layer % 5]
    path = tmp_path_factory.mktemp("stored") / "stored.gguf"
    return write_gguf(make_model("gemma3"), "gemma3", path, types)


@pytest.fixture(scope="module")
def stored_formats_model(stored_formats_file):
    return (load_model(str(stored_formats_file)),
            load_model(str(stored_formats_file), quantization="none"))


def test_stored_formats_load_as_stored(stored_formats_file, stored_formats_model, caplog):
    """Q5_0, Q5_1, Q4_K, Q5_K and Q6_K tensors keep the file's blocks, with no conversion note:
    dequantized, they are the dequantized model's weights bit for bit."""
    with caplog.at_level(logging.INFO, logger="orca_ext.model.quantized"):
        load_model(str(stored_formats_file))
    assert not [r for r in caplog.records if "converted" in r.getMessage()]
    native, dequantized = stored_formats_model
    floats = dict(dequantized.model.named_modules())
    formats = set()
    for name, module in native.model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            formats.add(stored_format(module))
            assert torch.equal(_float_weight(module), floats[name].weight), name
    assert formats == {"q5_0", "q5_1", "q4_K", "q5_K", "q6_K"}
    assert native.model.lm_head.weight is _embedding(native.model).weight


def test_q5_0_and_q4_0_parts_beside_q8_0_load_exactly_as_q8_0(tmp_path, caplog):
    """A fused qkv of Q5_0 (or Q4_0) q and k beside a Q8_0 v, as llama.cpp's Q4_K_M files store
    some layers: q8_0 blocks of the very same weights (no conversion note), bit for bit."""
    types = native_types("llama")
    types["blk.0.attn_q.weight"] = types["blk.0.attn_k.weight"] = Q.Q5_0
    types["blk.0.attn_v.weight"] = types["blk.1.attn_k.weight"] = Q.Q8_0
    types["blk.1.attn_q.weight"] = types["blk.1.attn_v.weight"] = Q.Q4_0
    path = write_gguf(make_model("llama"), "llama", tmp_path / "mixed.gguf", types)
    with caplog.at_level(logging.INFO, logger="orca_ext.model.quantized"):
        native = load_model(str(path))
    assert not [r for r in caplog.records if "converted" in r.getMessage()]
    dequantized = load_model(str(path), quantization="none")
    for layer in range(2):
        qkv = native.model.layers[layer].attn.qkv
        assert stored_format(qkv) == "q8_0"
        assert torch.equal(_float_weight(qkv), dequantized.model.layers[layer].attn.qkv.weight)
    want = forward_logits(dequantized, TOKENS)
    # avx512_vnni and amx_int8 round the 12 tokens' activations (int16 blocks, two int8 parts).
    rounded = _C.get_isa("quant") in ("avx512_vnni", "amx_int8")
    torch.testing.assert_close(forward_logits(native, TOKENS), want, rtol=0 if rounded else 1e-4,
                               atol=(1e-3 * float(want.abs().max())) if rounded else 1e-4)


def test_mixed_32_weight_parts_load_exactly_as_q8_m(tmp_path, caplog):
    """A fused qkv of Q5_1 q and k beside a Q8_0 v (llama.cpp's Q5_K_M files where a row is
    not a multiple of 256), a fused gate / up of Q4_1 and Q5_0: q8_m blocks of the very same
    weights (no conversion note), bit for bit, and the model's logits; the fused stack's decode
    steps equal the per-op blocks bit for bit."""
    types = native_types("llama")
    types["blk.0.attn_q.weight"] = types["blk.0.attn_k.weight"] = Q.Q5_1
    types["blk.0.attn_v.weight"] = Q.Q8_0
    types["blk.1.ffn_gate.weight"], types["blk.1.ffn_up.weight"] = Q.Q4_1, Q.Q5_0
    path = write_gguf(make_model("llama"), "llama", tmp_path / "mixed.gguf", types)
    with caplog.at_level(logging.INFO, logger="orca_ext.model.quantized"):
        native = load_model(str(path))
    assert not [r for r in caplog.records if "converted" in r.getMessage()]
    dequantized = load_model(str(path), quantization="none")
    for fused, float_layer in ((native.model.layers[0].attn.qkv,
                                dequantized.model.layers[0].attn.qkv),
                               (native.model.layers[1].mlp.up, dequantized.model.layers[1].mlp.up)):
        assert stored_format(fused) == "q8_m"
        assert torch.equal(_float_weight(fused), float_layer.weight)
    want = forward_logits(dequantized, TOKENS)
    rounded = _C.get_isa("quant") in ("avx512_vnni", "amx_int8")  # as in the test above
    torch.testing.assert_close(forward_logits(native, TOKENS), want, rtol=0 if rounded else 1e-4,
                               atol=(1e-3 * float(want.abs().max())) if rounded else 1e-4)
    assert_fused_equals_per_op(native, BATCHES["decode_4"])


def test_iq4_nl_loads_exactly_as_q8_0(tmp_path, caplog):
    """IQ4_NL tensors (llama.cpp's IQ4_XS files store them where a row is not a multiple of
    256), alone or beside Q8_0, as q8_0 blocks of the very same weights, and beside Q4_1 as
    q8_m, with one note naming them (no conversion note): bit for bit the weights gguf-py
    dequantizes, and the fused stack's decode steps equal the per-op blocks bit for bit."""
    types = native_types("llama")
    for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        types[f"blk.0.{part}.weight"] = Q.IQ4_NL
    types["blk.1.attn_q.weight"] = types["blk.1.attn_k.weight"] = Q.IQ4_NL
    types["blk.1.attn_v.weight"] = Q.Q8_0
    types["blk.1.ffn_gate.weight"], types["blk.1.ffn_up.weight"] = Q.IQ4_NL, Q.Q4_1
    path = write_gguf(make_model("llama"), "llama", tmp_path / "iq4_nl.gguf", types)
    with caplog.at_level(logging.INFO, logger="orca_ext.model.quantized"):
        native = load_model(str(path))
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "converted" in m]
    notes = [m for m in messages if "held exactly in orca's formats" in m]
    assert len(notes) == 1 and "6 weights" in notes[0]
    assert "(IQ4_NL+Q8_0 as q8_0)" in notes[0] and "(IQ4_NL+Q4_1 as q8_m)" in notes[0]
    dequantized = load_model(str(path), quantization="none")
    floats = dict(dequantized.model.named_modules())
    formats = {"layers.0.attn.qkv": "q8_0", "layers.0.attn.out": "q8_0",
               "layers.0.mlp.up": "q8_0", "layers.0.mlp.down": "q8_0",
               "layers.1.attn.qkv": "q8_0", "layers.1.mlp.up": "q8_m"}
    for name, fmt in formats.items():
        module = native.model.get_submodule(name)
        assert stored_format(module) == fmt, name
        assert torch.equal(_float_weight(module), floats[name].weight), name
    assert_fused_equals_per_op(native, BATCHES["decode_4"])


# The i-quants gguf-py dequantizes from random blocks (IQ1_M's scale, spread over its sub-block
# scales, is not written as one float16), one per layer of a gemma3 file, its embedding IQ4_XS.
I_QUANT_LAYER_TYPES = [Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S]


def test_i_quants_convert_to_q8_0(tmp_path, caplog):
    """IQ1_S, IQ2_XXS / XS / S and IQ3_XXS / S tensors load as q8_0 (dequantized by gguf-py,
    then quantized: q8_0's rounding of the file's values), IQ4_XS as q8_0 of its grid values
    and float16 sub-block scales (within float16's rounding of gguf-py's values), with one note
    naming them, and the model generates."""
    types = {"token_embd.weight": Q.IQ4_XS}
    for layer in range(make_model("gemma3").config.num_hidden_layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                     "ffn_down"):
            types[f"blk.{layer}.{part}.weight"] = I_QUANT_LAYER_TYPES[layer]
    path = write_gguf(make_model("gemma3"), "gemma3", tmp_path / "i_quants.gguf", types)
    with caplog.at_level(logging.INFO, logger="orca_ext.model.quantized"):
        native = load_model(str(path))
    notes = [r.getMessage() for r in caplog.records if "converted to q8_0" in r.getMessage()]
    assert len(notes) == 1 and "25 weights" in notes[0]
    assert all(t.name in notes[0] for t in (*I_QUANT_LAYER_TYPES, Q.IQ4_XS))
    dequantized = load_model(str(path), quantization="none")
    floats = dict(dequantized.model.named_modules())
    embedding = _embedding(native.model)
    for name, module in native.model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            assert stored_format(module) == "q8_0", name
            want, got = floats[name].weight, _float_weight(module)
            if module.weight is embedding.weight:  # IQ4_XS, with the tied head
                assert ((got - want).abs() <= want.abs() * 2.0 ** -11).all()
                assert not torch.equal(got, want)  # float16 scales, not the file's
            else:
                assert torch.equal(got, dequantize_weight(quantize_weight(want, "q8_0"), "q8_0",
                                                          want.shape[1])), name
    llm = LLM(str(path))
    out = llm.generate([TOKENS], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_stored_formats_run_as_the_dequantized_model(stored_formats_model, isa):
    """On every ISA the logits are the dequantized model's to float32 summation order (on
    avx512_vnni and amx_int8, 1-2 token steps to their two int8 parts of the activations, as
    test_int8_activation_logits_stay_close bounds them), and the fused stack's decode steps
    equal the per-op blocks bit for bit (on amx_int8 up to 64 tokens a step, on its tiles)."""
    native, dequantized = stored_formats_model
    for tokens in (TOKENS, TOKENS[:1], TOKENS[:2]):
        want = forward_logits(dequantized, tokens)
        int8 = isa in ("avx512_vnni", "amx_int8") and len(tokens) <= 2
        torch.testing.assert_close(forward_logits(native, tokens), want, rtol=0 if int8 else 1e-4,
                                   atol=(1e-3 if int8 else 1e-4) * float(want.abs().max()))
    assert unsupported_reason(native.model) is None
    wide = isa == "amx_int8"
    assert build_decoder_stack(native.model).max_tokens() == (64 if wide else 8)
    for batch in ("decode_4", "mixed_8", *(WIDE_BATCHES if wide else ())):
        assert_fused_equals_per_op(native, {**BATCHES, **WIDE_BATCHES}[batch])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2", "gpt2"])
def test_quantization_of_a_safetensors_model(name, fmt, tmp_path):
    """``quantization=fmt`` quantizes every linear of a Hugging Face model at load (GPT-2's
    Conv1D transposed first): the reference is the float model with each linear weight replaced
    by its quantized-then-dequantized values, which the kernels reproduce to float32 summation
    order and, on avx512_vnni and amx_int8, their split of the activations (within
    max |x| / 64516 of each: a
    misplaced weight would move a logit by >= 1e-2)."""
    folder = save_hf_model(make_hf_model(name), tmp_path)
    quantized = load_model(str(folder), quantization=fmt)
    reference = load_model(str(folder))
    linears = 0
    for module_name, module in reference.model.named_modules():
        if isinstance(module, Linear):
            ours = quantized.model.get_submodule(module_name)
            assert isinstance(ours, QuantizedLinear) and stored_format(ours) == fmt
            module.weight.copy_(_float_weight(ours))
            linears += 1
    assert linears == 4 * reference.config.num_layers + 1
    tied = reference.config.tie_word_embeddings
    assert isinstance(_embedding(quantized.model), QuantizedEmbedding) == tied
    torch.testing.assert_close(forward_logits(quantized, TOKENS),
                               forward_logits(reference, TOKENS), rtol=1e-3, atol=1e-3)


def test_orca_tiny_quantized_at_load_generates():
    """The built-in random model's float32 draws quantized; decode steps on the DecoderStack."""
    loaded = load_model("orca-tiny", quantization="q8_0")
    assert isinstance(loaded.model.embed, QuantizedEmbedding) and unsupported_reason(
        loaded.model) is None
    llm = LLM(loaded, max_batch_size=2, kv_cache_tokens=256)
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


# A stack of quantized layers takes up to 64 tokens a call on amx_int8 (its max_tokens()).
WIDE_BATCHES = {"decode_32": [(i * 3, 1) for i in range(32)],
                "mixed_64": [(0, 30), (11, 1), (4, 17), (40, 16)]}


@pytest.mark.parametrize("batch", list(BATCHES) + list(WIDE_BATCHES))
@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_decoder_stack_on_quantized_blocks_is_bit_exact(native_and_float, batch, isa):
    """The fused stack runs each quantized linear's blocks with quantized_linear's kernels, work
    blocks and rounding (int8 activations included on avx512_vnni and amx_int8): the per-op
    blocks' hidden states and KV caches bit for bit."""
    if batch in WIDE_BATCHES and isa != "amx_int8":
        pytest.skip("more than 8 tokens a step run the stack on amx_int8 only")
    native, _ = native_and_float
    assert unsupported_reason(native.model) is None
    assert_fused_equals_per_op(native, {**BATCHES, **WIDE_BATCHES}[batch])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_quantized_stack_max_tokens(native_and_float, isa):
    stack = build_decoder_stack(native_and_float[0].model)
    most = 64 if isa == "amx_int8" else 8
    assert stack.max_tokens() == most
    x = torch.zeros(most + 1, native_and_float[0].config.hidden_size)
    caches = [torch.zeros(1)] * stack.num_layers()
    with pytest.raises(RuntimeError, match=f"DecoderStack runs up to {most} tokens a call, got "
                                           f"{most + 1}"):
        stack.forward(x, caches, caches, *[torch.zeros(1, dtype=torch.int32)] * 3,
                      torch.zeros(most + 1, dtype=torch.int64), None, None)


def test_decoder_stack_bfloat16_activations_bit_exact(gguf_file):
    loaded = load_model(str(gguf_file), dtype="bfloat16")
    assert isinstance(loaded.model.layers[0].attn.qkv, QuantizedLinear)
    (want, _), (got, _) = run_both(loaded, BATCHES["decode_4"])
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_quantized_stack_layer_errors_name_the_argument():
    stack = torch.classes.orca.DecoderStack("rms_norm", 1e-5, "silu_and_mul", 4, 2, 64)
    weights = dict(attn_norm=torch.ones(256), qkv=torch.zeros(512, 8 * 20, dtype=torch.uint8),
                   out=torch.zeros(256, 8 * 20, dtype=torch.uint8), mlp_norm=torch.ones(256),
                   up=torch.zeros(1024, 8 * 20, dtype=torch.uint8),
                   down=torch.zeros(256, 16 * 20, dtype=torch.uint8))
    formats = dict.fromkeys(("qkv", "out", "up", "down"), "q4_1")
    stack.add_layer(weights, formats, 0.125, 0, 0)
    for change, format_change, message in [
        ({}, dict(qkv="q2_K"), "layer 1's qkv linear: format must be one of"),
        (dict(down=torch.zeros(256, 16 * 18, dtype=torch.uint8)), {},
         "layer 1's down linear: qweight has 288 bytes per row but in_features = 512"),
        (dict(qkv=torch.zeros(500, 160, dtype=torch.uint8)), {},
         "layer 1's qkv must have (num_heads + 2 * num_kv_heads) * head_dim = 512 rows"),
        (dict(attn_norm=torch.ones(256).bfloat16()), {}, "layer 1's attn_norm is BFloat16"),
        ({}, dict(out=None), "layer 1's out is Byte on cpu; the stack's tensors must be Float"),
    ]:
        layer_formats = {k: v for k, v in {**formats, **format_change}.items() if v is not None}
        with pytest.raises(RuntimeError, match=re.escape(message)):
            stack.add_layer({**weights, **change}, layer_formats, 0.125, 0, 0)
    assert stack.num_layers() == 1


def test_blocks_mixing_float_and_quantized_linears_run_the_stack(gguf_file):
    """A block whose qkv is float (its GGUF blocks dequantized) among quantized linears: the
    stack takes each linear in its own kind, bit for bit against the per-op blocks."""
    loaded = load_model(str(gguf_file))
    block = loaded.model.layers[0]
    qkv = block.attn.qkv
    replacement = Linear(qkv.in_features, qkv.out_features, False)
    replacement.weight.copy_(_float_weight(qkv))
    replacement.bias = qkv.bias
    block.attn.qkv = replacement
    assert unsupported_reason(loaded.model) is None
    (want, _), (got, _) = run_both(loaded, BATCHES["decode_4"])
    assert torch.equal(got, want)


# --- the quantized embedding op ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K"])
@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_quantized_embedding_rows(fmt, isa):
    """The rows as gguf dequantizes them, bit for bit (q5 and K-quant tables: random blocks)."""
    dim = 256 if fmt.endswith("K") else 96
    if fmt in ("q8_0", "q4_0", "q4_1"):
        q = quantize_weight(torch.randn(50, dim), fmt)
    else:
        kind = Q[fmt.upper()]
        q = torch.from_numpy(random_blocks(kind, 50, dim, np.random.default_rng(0)))
    full = dequantize_weight(q, fmt, dim)
    ids = torch.tensor([3, 0, 49, 3, 17])
    for index in (ids, ids.int(), ids[:0]):
        got = ops.quantized_embedding(index, q, fmt, dim)
        assert got.dtype == torch.float32 and torch.equal(got, full[index.long()])
    many = torch.randint(0, 50, (700,))  # the threaded path
    assert torch.equal(ops.quantized_embedding(many, q, fmt, dim), full[many])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K"])
@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_quantized_embedding_rows16(fmt, isa):
    """A table in the x16 layout (an embedding tied to an output head so laid out) gives the
    rows of the file's layout bit for bit (q5: its high bits restored; the threaded path too)."""
    dim = 256 if fmt.endswith("K") else 96
    if fmt in ("q8_0", "q4_1"):
        q = quantize_weight(torch.randn(48, dim), fmt)
    else:
        q = torch.from_numpy(random_blocks(Q[fmt.upper()], 48, dim, np.random.default_rng(1)))
    grouped = ops.interleave_rows16(q, fmt, dim)
    ids = torch.cat([torch.tensor([47, 0, 15, 16, 31, 5]), torch.randint(0, 48, (700,))])
    assert torch.equal(ops.quantized_embedding(ids, grouped, fmt + ops.ROWS16_SUFFIX, dim),
                       dequantize_weight(q, fmt, dim)[ids])


def test_quantized_embedding_opcheck():
    q = quantize_weight(torch.randn(20, 64), "q4_1")
    for ids in (torch.tensor([1, 19, 4]), torch.tensor([2], dtype=torch.int32)):
        torch.library.opcheck(torch.ops.orca.quantized_embedding.default, (ids, q, "q4_1", 64))


@pytest.mark.parametrize("change,message", [
    (dict(format="iq4_nl"), "format must be one of 'q8_0', 'q4_0', 'q4_1', 'q5_0', 'q5_1', "
                            "'q8_m', 'q4_K', 'q5_K', 'q6_K', or one of them with '_x16' (the "
                            "x16 layout), got 'iq4_nl'"),
    (dict(format="q8_0_x16"), "qweight in the x16 layout ('q8_0_x16') must have a multiple of "
                              "16 rows, got 6"),
    (dict(format="q4_K"), "embedding_dim must be a non-negative multiple of 256 (the block "
                          "size of q4_K), got 32"),
    (dict(format="q6_K", embedding_dim=256), "qweight has 34 bytes per row but embedding_dim "
                                             "= 256 in q6_K blocks takes 210"),
    (dict(ids=torch.tensor([0, 6])), "ids[1] = 6 is out of range for a table of 6 rows"),
    (dict(ids=torch.tensor([-1])), "ids[0] = -1 is out of range"),
    (dict(ids=torch.tensor([0.0])), "ids must be int64 or int32"),
    (dict(ids=torch.tensor([[0]])), "ids must be 1-D"),
    (dict(embedding_dim=40), "embedding_dim must be a non-negative multiple of 32 (the block "
                             "size of q8_0), got 40"),
    (dict(embedding_dim=64), "qweight has 34 bytes per row but embedding_dim = 64"),
    (dict(qweight=torch.zeros(6, 34, dtype=torch.int8)), "qweight must have dtype"),
])
def test_quantized_embedding_errors(change, message):
    args = dict(ids=torch.tensor([0, 5]), qweight=torch.zeros(6, 34, dtype=torch.uint8),
                format="q8_0", embedding_dim=32)
    args.update(change)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.quantized_embedding(**args)


# --- configuration -------------------------------------------------------------------------------


def test_quantized_models_run_float32_under_auto(gguf_file):
    assert EngineConfig(str(gguf_file)).resolved().dtype == torch.float32
    assert EngineConfig("orca-tiny", quantization="q4_0").resolved().dtype == torch.float32
    assert EngineConfig(str(gguf_file), quantization="none",
                        dtype="float32").resolved().dtype == torch.float32
    with pytest.raises(ValueError, match="dtype: the quantized kernels take float32"):
        EngineConfig(str(gguf_file), dtype="float16").resolved()


@pytest.mark.parametrize("kwargs,message", [
    (dict(quantization="int8"), "quantization must be None or one of none, q8_0, q4_0, q4_1, "
                                "got 'int8'"),
    (dict(quantization="q8_0", dtype="float16"), "dtype: the quantized kernels take float32 or "
                                                 "bfloat16"),
    (dict(quantization="q8_0", device="cuda"), "quantization: 'q8_0' runs on the CPU only"),
    (dict(quantization="q4_1", tensor_parallel_size=2), "quantization: 'q4_1' runs in one "
                                                         "process"),
])
def test_config_errors_name_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig("orca-tiny", **kwargs)


def test_a_quantized_model_is_not_saved_as_a_folder(tmp_path):
    from orca_ext.model import save_pretrained_folder

    with pytest.raises(ValueError, match="load it with quantization='none' to save it"):
        save_pretrained_folder(load_model("orca-tiny", quantization="q4_0"), tmp_path)


def test_loaded_model_takes_no_quantization():
    loaded = load_model("orca-tiny")
    with pytest.raises(ValueError, match="quantization: 'q8_0' asked for a loaded model"):
        EngineConfig(loaded, quantization="q8_0")
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        load_model("orca-tiny", quantization="Q8_0")


@pytest.mark.parametrize("isa", ["avx512_vnni", "amx_int8"])
def test_float_activations_on_request(force_isa, isa):
    """``int8_activations=False`` runs the int8 paths' one- and two-token steps on the
    activations as given: the float avx512 path's results (the output heads' logits). amx_int8's
    tiles (3 tokens and more) split the activations into two int8 parts either way, within
    max |x| / 64516 of each."""
    if isa not in _C.quant_isas():
        pytest.skip(f"this CPU does not run the {isa} path")
    q = quantize_weight(torch.randn(70, 96), "q4_1")
    op = torch.ops.orca.quantized_linear.default
    for T in (1, 2, 5, 40) if isa == "amx_int8" else (1, 2):
        x = torch.randn(T, 96)
        force_isa("quant", "avx512")
        want = ops.quantized_linear(x, q, "q4_1", 96)
        force_isa("quant", isa)
        got = ops.quantized_linear(x, q, "q4_1", 96, int8_activations=False)
        if T <= 2:
            assert torch.equal(got, want)
            assert not torch.equal(ops.quantized_linear(x, q, "q4_1", 96), want)
        else:
            assert torch.equal(got, ops.quantized_linear(x, q, "q4_1", 96))
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        torch.library.opcheck(op, (x, q, "q4_1", 96, None, "none", None, "none", None, None,
                                   1e-5, False))


def test_rows16_formats_per_isa():
    """The x16 layout where the decode-sized int8 kernels read it: every format on avx512_vnni
    and amx_int8."""
    assert rows16_formats("avx512_vnni") == rows16_formats("amx_int8") == ops.QUANT_FORMATS
    for isa in ("portable", "avx2", "avx512"):
        assert rows16_formats(isa) == ()


@pytest.mark.parametrize("isa", ["avx2", "avx512_vnni", "amx_int8"])
def test_loader_interleaves_decoder_linears_for_the_cpus_kernels(stored_formats_file, isa,
                                                                 force_isa):
    """Loaded under avx512_vnni or amx_int8, the decoder blocks' linears are in the x16 layout
    (the same weights), and the embedding and the head keep the file's rows: their 300 rows are
    not a multiple of 16; under avx2 nothing is interleaved."""
    if isa not in _C.quant_isas():
        pytest.skip(f"this CPU does not run the {isa} path")
    force_isa("quant", isa)
    model = load_model(str(stored_formats_file)).model
    rows16 = rows16_formats(isa)
    seen = set()
    for name, module in model.named_modules():
        if not isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            continue
        in_layers = name.startswith("layers.")
        want = in_layers and stored_format(module) in rows16
        assert module.format.endswith(ops.ROWS16_SUFFIX) == want, name
        seen.add(module.format)
    assert any(f.endswith(ops.ROWS16_SUFFIX) for f in seen) == bool(rows16)


@pytest.mark.parametrize("isa", ["avx2", "avx512_vnni", "amx_int8"])
@pytest.mark.parametrize("fmt", ["q8_0", "q6_K"])
def test_loader_interleaves_the_head_and_its_tied_embedding(isa, fmt, force_isa):
    """An output head of a multiple of 16 rows goes to the x16 layout with the embedding tied to
    it where the CPU's int8 kernels read the layout: the same embedding rows bit for bit, and
    logits one token a step and for a prompt within float rounding of the dequantized weights'
    in float64; a head of other rows keeps the file's."""
    if isa not in _C.quant_isas():
        pytest.skip(f"this CPU does not run the {isa} path")
    force_isa("quant", isa)
    K = 256
    for rows, want in ((48, bool(rows16_formats(isa))), (40, False)):
        model = nn.Module()
        model.layers = nn.ModuleList()
        model.lm_head = QuantizedLinear(K, rows, False, "none", fmt)
        model.lm_head.weight.copy_(
            quantize_weight(torch.randn(rows, K), fmt) if fmt == "q8_0" else torch.from_numpy(
                random_blocks(Q[fmt.upper()], rows, K, np.random.default_rng(rows))))
        model.embed = QuantizedEmbedding(rows, K, fmt)
        model.embed.weight = model.lm_head.weight
        x = torch.randn(12, K, generator=torch.Generator().manual_seed(rows))
        ids = torch.arange(rows)
        rows_before = model.embed(ids)
        exact = x.double() @ rows_before.double().t()
        interleave_rows(model)
        suffix = ops.ROWS16_SUFFIX if want else ""
        assert (model.lm_head.format, model.embed.format) == (fmt + suffix, fmt + suffix)
        assert torch.equal(model.embed(ids), rows_before)
        for tokens in (1, 12):
            torch.testing.assert_close(model.lm_head.logits(x[:tokens]).double(), exact[:tokens],
                                       rtol=0, atol=1e-4 * float(exact.abs().max()))


@pytest.mark.parametrize("batch", ["decode_4", "mixed_8"])
def test_rows16_layout_runs_the_model(gguf_file, batch, monkeypatch):
    """With the decoder linears in the x16 layout on any CPU (the loader's choice widened to
    every format), the model's logits stay within the int8 activations' rounding of the
    dequantized model's, and the fused stack equals the per-op blocks bit for bit."""
    monkeypatch.setattr(quantized_module, "rows16_formats", lambda isa: ops.QUANT_FORMATS)
    native = load_model(str(gguf_file))
    formats = [m.format for m in native.model.layers.modules() if isinstance(m, QuantizedLinear)]
    assert formats and all(f.endswith(ops.ROWS16_SUFFIX) for f in formats)
    want = forward_logits(load_model(str(gguf_file), quantization="none"), TOKENS)
    torch.testing.assert_close(forward_logits(native, TOKENS), want, rtol=0,
                               atol=1e-3 * float(want.abs().max()))
    assert_fused_equals_per_op(native, BATCHES[batch])
