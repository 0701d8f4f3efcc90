"""Typed wrappers and fake (meta) registrations for the ``torch.ops.orca`` ops.

The schemas live in ``csrc/registration.cpp``; CPU kernels in ``csrc/cpu/``, CUDA kernels in
``csrc/cuda/``. The fake registrations let ``torch.compile`` trace the ops without running them.
A model's decoder blocks prepared for decode steps on the CPU are ``torch.classes.orca.
DecoderStack`` (``runner/decoder_stack.py`` builds one).
"""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the library that registers torch.ops.orca)

ACTIVATIONS = ("none", "gelu_tanh", "relu", "silu_and_mul", "gelu_tanh_and_mul")
# Gated activations: weight rows are gate rows then up rows, and the output is act(gate) * up.
GATED_ACTIVATIONS = ("silu_and_mul", "gelu_tanh_and_mul")


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str = "none", residual: torch.Tensor | None = None,
                  norm: str = "none", norm_weight: torch.Tensor | None = None,
                  norm_bias: torch.Tensor | None = None, norm_eps: float = 1e-5) -> torch.Tensor:
    """``activation(norm(x) @ weight.T + bias) + residual`` on packed tokens ``x [T, K]``,
    ``weight [N, K]``.

    The bias, activation and residual (``[T, N]``, e.g. a block's input) run in the GEMM's
    epilogue. ``silu_and_mul`` takes ``weight [2I, K]`` (gate rows, then up rows) and returns
    ``silu(gate) * up`` of shape ``[T, I]`` (Llama's MLP); ``gelu_tanh_and_mul`` likewise
    returns ``gelu_tanh(gate) * up`` (Gemma's), ``gelu_tanh`` being
    ``F.gelu(approximate="tanh")``. ``norm`` normalizes the input rows first, as the
    block's norm before this linear would: ``layer_norm`` (``norm_weight``, optional
    ``norm_bias``, ``[K]``) or ``rms_norm`` (Llama's: normalized in float32, cast to the dtype,
    then scaled by ``norm_weight``).
    """
    return torch.ops.orca.packed_linear(x, weight, bias, activation, residual, norm, norm_weight,
                                        norm_bias, norm_eps)


def logits_linear(x: torch.Tensor, weight: torch.Tensor, norm: str = "none",
                  norm_weight: torch.Tensor | None = None, norm_bias: torch.Tensor | None = None,
                  norm_eps: float = 1e-5) -> torch.Tensor:
    """float32 logits ``norm(x) @ weight.T`` ``[T, N]`` of packed rows ``x [T, K]`` (float32,
    bfloat16 or float16, as ``weight [N, K]``): the GEMM's float32 sums themselves, not rounded to
    the inputs' dtype (a bfloat16 logit near 20 has a step of 0.125, enough to tie the top two
    tokens). ``norm`` and its arguments as in ``packed_linear``, applied in the inputs' dtype."""
    return torch.ops.orca.logits_linear(x, weight, norm, norm_weight, norm_bias, norm_eps)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the caches ``[num_blocks, block_size, Hkv, D]``
    at flat slots ``slot_mapping [T]`` (int64); a negative slot is skipped."""
    torch.ops.orca.store_kv(key, value, k_cache, v_cache, slot_mapping)


def plan_attention(q: torch.Tensor, k_cache: torch.Tensor, cu_q_lens: torch.Tensor,
                   context_lens: torch.Tensor, block_table: torch.Tensor,
                   window: int = 0) -> torch.Tensor:
    """One step's attention plan on the CPU (FlashInfer's plan / run): the metadata's values
    checked, the batch cut into work items and the kernel path chosen, once, for every layer's
    ``ragged_attention(..., window, plan=...)`` of that step. The arguments are those of
    ``ragged_attention`` (``q`` and ``k_cache`` for their shapes and dtypes); the plan is an
    opaque uint8 tensor, refused by a call whose shapes, dtype, window or metadata values are
    not the ones it was made for."""
    return torch.ops.orca.plan_attention(q, k_cache, cu_q_lens, context_lens, block_table,
                                         window)


def ragged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cu_q_lens: torch.Tensor, context_lens: torch.Tensor,
                     block_table: torch.Tensor, scale: float, window: int = 0,
                     plan: torch.Tensor | None = None) -> torch.Tensor:
    """Split-and-merge causal attention of packed queries ``q [T, Hq, D]`` over paged KV.

    Request ``r`` owns query rows ``cu_q_lens[r]:cu_q_lens[r+1]``; its query ``i`` sits at
    position ``pos = context_lens[r] - q_len + i`` and attends to KV positions ``0..pos`` found
    through ``block_table[r]``. Returns ``[T, Hq, D]`` in packed order.

    ``window > 0`` is a sliding window (Mistral's, Gemma 3's local layers, as Hugging Face
    defines it): the query at ``pos`` attends to positions ``j`` with ``pos - window < j <= pos``
    only, and KV before every query's window is not read. ``window = 0`` attends to all of
    ``0..pos``.

    On CPU, bfloat16 prefill-like rows run the best kernel path this build and CPU have
    (``orca_ext._C.attention_isas()`` lists them: AMX tiles where the CPU has AMX-BF16 and the
    OS grants tile data, else AVX512-BF16 pair dot products); ``ORCA_ATTENTION_ISA=
    portable|avx512bf16|amx`` at load, or ``orca_ext._C.set_isa("attention", name)``, forces one.

    ``plan`` (CPU): this step's ``plan_attention`` for the same arguments, which spares each
    layer the metadata checks and the planning; without it the call plans for itself. On CUDA
    the op plans from shapes alone and ``plan`` must be None.
    """
    return torch.ops.orca.ragged_attention(q, k_cache, v_cache, cu_q_lens, context_lens,
                                           block_table, scale, window, plan)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """Llama's RMSNorm over the last dim of ``x [..., K]``: normalized in float32, rounded to
    the dtype, scaled by ``weight [K]`` (and rounded); with ``residual`` (``x``'s shape),
    ``residual + norm(x)``, the sum rounded once more. On CPU it is the row kernel of the fused
    linears' input norms and of the DecoderStack, so the per-op blocks match the stack's bits."""
    return torch.ops.orca.rms_norm(x, weight, eps, residual)


@torch.library.register_fake("orca::rms_norm")
def _rms_norm_fake(x, weight, eps, residual=None):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("orca::packed_linear")
def _packed_linear_fake(x, weight, bias=None, activation="none", residual=None, norm="none",
                        norm_weight=None, norm_bias=None, norm_eps=1e-5):
    n = weight.shape[0] // 2 if activation in GATED_ACTIVATIONS else weight.shape[0]
    return x.new_empty((x.shape[0], n))


@torch.library.register_fake("orca::logits_linear")
def _logits_linear_fake(x, weight, norm="none", norm_weight=None, norm_bias=None, norm_eps=1e-5):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


@torch.library.register_fake("orca::store_kv")
def _store_kv_fake(key, value, k_cache, v_cache, slot_mapping):
    return None


@torch.library.register_fake("orca::ragged_attention")
def _ragged_attention_fake(q, k_cache, v_cache, cu_q_lens, context_lens, block_table, scale,
                           window=0, plan=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("orca::plan_attention")
def _plan_attention_fake(q, k_cache, cu_q_lens, context_lens, block_table, window=0):
    # Its size depends on the metadata's values.
    size = torch.library.get_ctx().new_dynamic_size()
    return cu_q_lens.new_empty((size,), dtype=torch.uint8)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        indices: torch.Tensor | None = None) -> None:
    """In place: ``logits[r, t] = -inf`` wherever bit ``t % 32`` of ``bitmask[i, t // 32]`` is
    clear, for ``logits [B, V]`` (float32, bfloat16 or float16), the int32 ``bitmask
    [M, W]`` (``W >= ceil(V / 32)``; llguidance's and xgrammar's layout: bit set = token
    allowed) and ``r = indices[i]`` (int64 ``[M]``), or ``r = i`` without ``indices`` (then
    ``M == B``). Rows without a mask are not touched."""
    torch.ops.orca.apply_token_bitmask(logits, bitmask, indices)


@torch.library.register_fake("orca::apply_token_bitmask")
def _apply_token_bitmask_fake(logits, bitmask, indices=None):
    return None


# The block formats quantized_linear and quantized_embedding read: GGUF's, by ggml's type names,
# and orca's q8_m (orca_ext.quantize).
QUANT_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q8_m", "q4_K", "q5_K", "q6_K")
# A format's name with this suffix names its blocks in the x16 layout (``interleave_rows16``).
ROWS16_SUFFIX = "_x16"


def quantized_linear(x: torch.Tensor, qweight: torch.Tensor, format: str, in_features: int,
                     bias: torch.Tensor | None = None, activation: str = "none",
                     residual: torch.Tensor | None = None, norm: str = "none",
                     norm_weight: torch.Tensor | None = None,
                     norm_bias: torch.Tensor | None = None,
                     norm_eps: float = 1e-5, int8_activations: bool = True) -> torch.Tensor:
    """``packed_linear`` with the weight ``[N, in_features]`` held as GGUF blocks: ``qweight``
    is uint8 ``[N, in_features / block_weights * block_bytes]``, each row the blocks llama.cpp
    stores for ``format`` (per 32 weights ``q8_0``: 34 bytes, ``q4_0``: 18, ``q4_1``: 20,
    ``q5_0``: 22, ``q5_1``: 24, orca's ``q8_m``: 36; per 256 weights, in_features a multiple of
    256, ``q4_K``: 144, ``q5_K``: 176, ``q6_K``: 210; see ``orca_ext.quantize``), or its rows in the
    x16 layout (``interleave_rows16``; format ``"q5_0_x16"`` etc.). ``x [T, in_features]`` is
    float32 or bfloat16 and the output is in its dtype; bias, activation, residual and norm as in
    ``packed_linear`` (CPU only).

    The kernels' ISA is the best this CPU runs (``orca_ext._C.quant_isas()`` lists them);
    ``ORCA_QUANT_ISA=portable|avx2|avx512|avx512_vnni|amx_int8`` at load, or
    ``orca_ext._C.set_isa("quant", name)``, forces one. ``avx512_vnni`` and ``amx_int8`` split the
    activations of up to 2 tokens into two int8 parts per block of 32 (llama.cpp's one int8 rounding
    plus its remainder: within ``max |x| / 65024`` of the block, finer than bfloat16), except
    ``q8_0`` on ``avx512_vnni`` and with ``int8_activations=False`` (the models' output heads, whose
    near-tied logits any rounding may flip); on the x16 layout they do so for up to 24 tokens on
    ``avx512_vnni``, 8 on ``amx_int8`` (every format, ``q8_0`` too), and with
    ``int8_activations=False`` run half as many tokens as twice as many: each token's two parts
    and those of its remainder (within ``max |x| / 65024**2``, finer than float32's rounding of
    x). Whatever ``int8_activations`` says, ``avx512_vnni`` rounds more float32 tokens (beyond 8
    on the row layout, 12 on the x16 one) to int16 per block of 32 (within ``max |x| / 65534``)
    for its int16 GEMM, and beyond those ``amx_int8`` (the default where the CPU has AMX)
    multiplies every format on AMX tiles on activations split in two int8 parts (within
    ``max |x| / 64516``); both read the x16 layout directly. The other kernels read x16 rows
    de-interleaved into scratch and use the activations as given.
    """
    return torch.ops.orca.quantized_linear(x, qweight, format, in_features, bias, activation,
                                           residual, norm, norm_weight, norm_bias, norm_eps,
                                           int8_activations)


@torch.library.register_fake("orca::quantized_linear")
def _quantized_linear_fake(x, qweight, format, in_features, bias=None, activation="none",
                           residual=None, norm="none", norm_weight=None, norm_bias=None,
                           norm_eps=1e-5, int8_activations=True):
    n = qweight.shape[0] // 2 if activation in GATED_ACTIVATIONS else qweight.shape[0]
    return x.new_empty((x.shape[0], n))


def interleave_rows16(qweight: torch.Tensor, format: str, in_features: int) -> torch.Tensor:
    """The blocks ``qweight`` (uint8 ``[N, row bytes]`` of ``format``, one of QUANT_FORMATS, N a
    multiple of 16) in the x16 layout, which ``quantized_linear`` reads as format ``format +
    ROWS16_SUFFIX``: the same bytes, each group of 16 rows' blocks interleaved field by field so
    that its int8 kernels of a few tokens on ``avx512_vnni`` / ``amx_int8`` run one output row per
    vector lane (csrc/include/orca/cpu/quant_rows16.h lays it out). A gated weight's gate and up
    halves must each have a multiple of 16 rows. CPU only."""
    return torch.ops.orca.interleave_rows16(qweight, format, in_features)


def deinterleave_rows16(qweight: torch.Tensor, format: str, in_features: int) -> torch.Tensor:
    """``interleave_rows16``'s inverse: the x16 blocks ``qweight`` in the file's row layout."""
    return torch.ops.orca.deinterleave_rows16(qweight, format, in_features)


@torch.library.register_fake("orca::interleave_rows16")
def _interleave_rows16_fake(qweight, format, in_features):
    return torch.empty_like(qweight)


@torch.library.register_fake("orca::deinterleave_rows16")
def _deinterleave_rows16_fake(qweight, format, in_features):
    return torch.empty_like(qweight)


def quantized_embedding(ids: torch.Tensor, qweight: torch.Tensor, format: str,
                        embedding_dim: int) -> torch.Tensor:
    """float32 rows ``[T, embedding_dim]`` of a table held as GGUF blocks ``qweight`` (uint8
    ``[num_embeddings, embedding_dim / block_weights * block_bytes]`` of ``format``, as in
    ``quantized_linear``, the x16 layout included: a table tied to an output head so laid out)
    for the token ids ``ids [T]`` (int64 or int32): only the rows looked up are dequantized (CPU
    only)."""
    return torch.ops.orca.quantized_embedding(ids, qweight, format, embedding_dim)


@torch.library.register_fake("orca::quantized_embedding")
def _quantized_embedding_fake(ids, qweight, format, embedding_dim):
    return qweight.new_empty((ids.shape[0], embedding_dim), dtype=torch.float32)


def lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                scales: torch.Tensor, cu_seg_lens: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """In place, for each run of packed rows sharing an adapter: ``y[rows] += scales[s] *
    (x[rows] @ lora_a[s].T) @ lora_b[s]`` where ``s = seg_slots[i]`` and ``rows =
    cu_seg_lens[i]:cu_seg_lens[i+1]``; a run with slot -1 (no adapter) is not touched (Punica's
    and S-LoRA's segmented shrink and expand).

    ``y [T, N]`` and ``x [T, K]`` share a float dtype (the sums are float32, rounded once into
    ``y``); ``lora_a`` float32 ``[num_slots, rank, K]`` (PEFT's ``lora_A.weight`` per slot),
    ``lora_b`` float32 ``[num_slots, rank, N]`` (``lora_B.weight`` transposed, so the expand
    streams rows of N), ``scales`` float32 ``[num_slots]``, ``cu_seg_lens`` int32 ``[S + 1]``
    (from 0 to T), ``seg_slots`` int32 ``[S]``. A slot's unused ranks are zero rows.

    On CPU the kernel's ISA is the best this CPU runs (``orca_ext._C.lora_isas()``);
    ``ORCA_LORA_ISA=portable|avx2|avx512`` at load, or ``orca_ext._C.set_isa("lora", name)``,
    forces one.
    """
    torch.ops.orca.lora_linear(y, x, lora_a, lora_b, scales, cu_seg_lens, seg_slots)


@torch.library.register_fake("orca::lora_linear")
def _lora_linear_fake(y, x, lora_a, lora_b, scales, cu_seg_lens, seg_slots):
    return None
