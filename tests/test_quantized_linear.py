"""ops.quantized_linear on GGUF blocks (q8_0 / q4_0 / q4_1 quantized by gguf-py; q5_0 / q5_1 and
the K-quants q4_K / q5_K / q6_K as random valid blocks; orca's q8_m as random blocks, its
reference q d + m in torch) against gguf.quants.dequantize and a float64 matmul (the epilogue in
float64 through reference_ops), on every kernel path this CPU runs; orca_ext.quantize against
gguf.quants."""
from __future__ import annotations

import functools
import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

import reference_ops as ref
from gguf_files import random_blocks
from orca_ext import _C, ops
from orca_ext.quantize import (BLOCK_LAYOUTS, EXACT_IN_Q8_0, EXACT_IN_Q8_M, IQ4_NL_VALUES,
                               QUANTIZE_FORMATS, as_exact, block_weights, dequantize_weight,
                               iq4_xs_as_q8_0, quantize_weight)

FORMATS = list(QUANTIZE_FORMATS)
# The formats run as stored from GGUF files, which gguf-py does not quantize (K-quants) or
# orca_ext.quantize does not make: random valid blocks. avx512_vnni's int8 kernels and
# amx_int8's tiles read them too.
STORED_FORMATS = ["q5_0", "q5_1", "q8_m", "q4_K", "q5_K", "q6_K"]
# The largest |q * scale| of each stored format per unit of its float16 scales (q6_K: 128 * 32),
# so that random blocks get weights of order 1 / sqrt(K).
STORED_RANGE = {"q5_0": 16, "q5_1": 32, "q8_m": 256, "q4_K": 63 * 15, "q5_K": 63 * 31,
                "q6_K": 128 * 32}
ISAS = ["portable", "avx2", "avx512", "avx512_vnni", "amx_int8"]
INT8_MAX_T = 2  # up to this many tokens avx512_vnni splits the activations into int8 parts
DOT_MAX_T_INT16 = 8  # beyond this many float32 tokens avx512_vnni rounds them to int16 blocks
AMX_MAX_T_BF16 = 64  # amx_int8's tiles take any number of float32 tokens, this many bfloat16
DTYPES = [torch.float32, torch.bfloat16]
# float32: the kernels sum K <= 576 float32 products in another order than the float64
# reference, an error of order sqrt(K) * 2**-24 of the sum of |terms| (~1e-6 here), and the
# epilogue's exp is within a few ulp; 1e-4 leaves a margin and still fails on any misplaced
# weight (one quantization step moves an output by >= 1e-2). bfloat16: the output, the
# normalized input rows and (from 17 tokens) the dequantized weight panel are rounded to
# bfloat16, 2**-9 of each value, and so is the GEMM's output before the epilogue (as in
# packed_linear's bfloat16 GEMM path), as packed_linear's bfloat16 tolerance allows at outputs
# and activation inputs of order 1.
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
# Up to 24 tokens (float32; bfloat16: 16) the dot kernels, 8 tokens at a time (9, 16, 17 and 24
# take two and three passes); more, the dequantized panels and a GEMM (600: several panels).
# avx512_vnni's float32 tokens beyond 8: the int16 GEMM's tiles of 16 tokens, one (9, 16) or
# two at a time (17, 24, 25, 64), a single last one (65, 600 = 38 tiles).
# amx_int8: groups of 4 to 16 tokens (5: one of 8, 17: two of 12, 64: four of 16), a padded
# last group (25, 600), up to 64 bfloat16 tokens (65: the panels).
TOKENS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 25, 64, 65, 600]
# K: one block, and 3, 9, 18 blocks (none a multiple of 256); N odd: partial row groups and a
# partial last block of output columns.
SHAPES = [(32, 7), (96, 33), (288, 129), (576, 33)]


@pytest.fixture(params=ISAS)
def isa(request, force_isa) -> str:
    if request.param not in _C.quant_isas():
        pytest.skip(f"this CPU does not run the {request.param} path")
    force_isa("quant", request.param)
    return request.param


@functools.cache
def quantized(fmt: str, K: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight [N, K] (a linear layer's scale) as blocks, and their dequantized values:
    quantized by gguf-py, or for the stored formats random blocks (float16 scales down to
    subnormal ones for the K-quants)."""
    if fmt == "q8_m":
        rng = np.random.default_rng(K * 1000 + N)
        q = torch.from_numpy(random_q8_m(N, K, rng, 1 / (K ** 0.5 * STORED_RANGE[fmt])))
    elif fmt in STORED_FORMATS:
        rng = np.random.default_rng(K * 1000 + N)
        kind = GGMLQuantizationType[fmt.upper()]
        q = torch.from_numpy(random_blocks(kind, N, K, rng, 1 / (K ** 0.5 * STORED_RANGE[fmt])))
    else:
        gen = torch.Generator().manual_seed(K * 1000 + N)
        q = quantize_weight(torch.randn(N, K, generator=gen) / K ** 0.5, fmt)
    return q, dequantize_weight(q, fmt, K)


def random_q8_m(rows: int, cols: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """uint8 ``[rows, cols / 32 * 36]``: q8_m blocks of random quants, float16 d in
    ``[scale / 10, 1.1 scale)`` and m in ``(-160 d, -96 d)`` (weights around zero)."""
    shape = (rows, cols // 32)
    d = (rng.random(shape) * scale + scale / 10).astype(np.float16)
    m = (-(rng.random(shape) * 64 + 96) * d.astype(np.float32)).astype(np.float16)
    quants = rng.integers(0, 256, size=(*shape, 32), dtype=np.uint8)
    parts = [d.view(np.uint8).reshape(*shape, 2), m.view(np.uint8).reshape(*shape, 2), quants]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def int8x2_rounded(rows: torch.Tensor, lo_steps: int) -> torch.Tensor:
    """float64 ``rows [T, K]`` as the int8 paths take them: each block of 32 as int8 multiples
    of ``dx = max |x| / 127`` (llama.cpp's q8_0 rounding of the activations) plus the remainder
    as int8 multiples of dx / lo_steps, in float32, nearest even: within dx / (2 lo_steps)."""
    x = rows.float().reshape(rows.shape[0], -1, 32)
    dx = x.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    hi = torch.round(x * inverse)
    dx_lo = dx / lo_steps
    inverse_lo = torch.where(dx > 0, 1 / dx_lo, torch.zeros_like(dx))
    lo = torch.round((x - hi * dx) * inverse_lo).clamp(-127, 127)
    return (hi.double() * dx.double() + lo.double() * dx_lo.double()).reshape(rows.shape)


def int16_rounded(rows: torch.Tensor) -> torch.Tensor:
    """float64 ``rows [T, K]`` as avx512_vnni's int16 GEMM takes them: each block of 32 as
    multiples of ``dx = max |x| / 32767`` in float32, nearest even: within dx / 2."""
    x = rows.float().reshape(rows.shape[0], -1, 32)
    dx = x.abs().amax(-1, keepdim=True) / 32767
    inverse = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    return (torch.round(x * inverse).double() * dx.double()).reshape(rows.shape)


def rounding(isa: str, T: int, dtype: torch.dtype, fmt: str, int8_activations: bool = True):
    """How the path rounds T tokens of x in fmt: remainders in dx / 256 where avx512_vnni's
    kernels (on amx_int8 too; not q8_0 on avx512_vnni) take up to INT8_MAX_T tokens, in dx / 254
    where amx_int8's tiles take more, to int16 blocks where avx512_vnni's int16 GEMM takes more
    than DOT_MAX_T_INT16 float32 tokens, else None (float32 activations)."""
    if T <= INT8_MAX_T:
        vnni = (isa == "amx_int8" or (isa == "avx512_vnni" and fmt != "q8_0")) and int8_activations
        return functools.partial(int8x2_rounded, lo_steps=256) if vnni else None
    tiles = isa == "amx_int8"
    if isa == "avx512_vnni" and dtype == torch.float32 and T > DOT_MAX_T_INT16:
        return int16_rounded
    if tiles and (dtype == torch.float32 or T <= AMX_MAX_T_BF16):
        return functools.partial(int8x2_rounded, lo_steps=254)
    return None


def kernel_rows(rows: torch.Tensor, isa: str, dtype: torch.dtype, fmt: str,
                int8_activations: bool = True) -> torch.Tensor:
    """The activations the kernels of fmt multiply."""
    rounded = rounding(isa, rows.shape[0], dtype, fmt, int8_activations)
    return rounded(rows) if rounded else rows


def normed_rows(x: torch.Tensor, norm: str, gamma, beta, eps: float) -> torch.Tensor:
    """x's rows normalized as the op normalizes them (in x's dtype): packed_linear's shared norm
    against the identity, which adds each element to zeros only."""
    eye = torch.eye(x.shape[1], dtype=x.dtype)
    return ops.packed_linear(x, eye, None, "none", None, norm, gamma, beta, eps)


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("K,N", SHAPES)
def test_quantized_linear(isa, fmt, dtype, T, K, N):
    q, w = quantized(fmt, K, N)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T)).to(dtype)
    expected = kernel_rows(x.double(), isa, dtype, fmt) @ w.double().t()
    assert_close(ops.quantized_linear(x, q, fmt, K), expected, dtype)


# K for the stored formats: one block and 9 (q5_0, q5_1); one super-block and three (K-quants).
STORED_SHAPES = {32: [(32, 7), (288, 33)], 256: [(256, 7), (768, 33)]}


@pytest.mark.parametrize("fmt", STORED_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 2, 3, 8, 9, 17, 25, 600])
@pytest.mark.parametrize("shape", [0, 1])
def test_quantized_linear_stored_formats(isa, fmt, dtype, T, shape):
    """The dot kernels (1-24 tokens; avx512_vnni's int8 kernels up to INT8_MAX_T), the panels
    and the int16 GEMM on every ISA; amx_int8's tiles beyond INT8_MAX_T tokens (q6_K in units of
    16 values, the others 32; N odd: a last group of rows short of 16)."""
    K, N = STORED_SHAPES[block_weights(fmt)][shape]
    q, w = quantized(fmt, K, N)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T)).to(dtype)
    expected = kernel_rows(x.double(), isa, dtype, fmt) @ w.double().t()
    assert_close(ops.quantized_linear(x, q, fmt, K), expected, dtype)


@pytest.mark.parametrize("fmt", STORED_FORMATS)
def test_stored_formats_dequantize_as_gguf(isa, fmt):
    """The kernels' float32 weights are gguf's bit for bit (quantized_embedding returns them; q8_m:
    its torch reference's)."""
    K = 3 * block_weights(fmt)
    q, w = quantized(fmt, K, 9)
    assert torch.equal(ops.quantized_embedding(torch.arange(9), q, fmt, K), w)


@pytest.mark.parametrize("fmt", FORMATS + STORED_FORMATS)
@pytest.mark.parametrize("isa,T,steps", [("avx512_vnni", 1, 512), ("avx512_vnni", 2, 512),
                                         ("avx512_vnni", 9, 516), ("avx512_vnni", 300, 516),
                                         ("amx_int8", 1, 512), ("amx_int8", 3, 508),
                                         ("amx_int8", 40, 508), ("amx_int8", 300, 508)])
def test_int8_activation_error(fmt, isa, T, steps, force_isa):
    """The int8 and int16 paths' one error beyond float32 accumulation: each activation rounded
    by at most its block's dx / steps (dx = max |x| / 127; the remainder's int8 part is in steps
    of dx / 256 in avx512_vnni's kernels, dx / 254 in amx_int8's tiles; avx512_vnni's int16
    GEMM rounds to max |x| / 32767, within dx / 516), so an output moves by at most
    sum_k |w_k| dx_k / steps."""
    if isa not in _C.quant_isas():
        pytest.skip(f"this CPU does not run the {isa} path")
    if rounding(isa, T, torch.float32, fmt) is None:
        pytest.skip(f"{isa} takes {T} tokens of {fmt} as float32")
    force_isa("quant", isa)
    K, N = (576, 129) if block_weights(fmt) == 32 else (768, 129)
    q, w = quantized(fmt, K, N)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(5))
    dx = (x.reshape(T, -1, 32).abs().amax(-1, keepdim=True) / 127).expand(-1, -1, 32)
    bound = (dx.reshape(T, K).double() / steps) @ w.double().abs().t()
    out = ops.quantized_linear(x, q, fmt, K).double()
    error = (out - x.double() @ w.double().t()).abs()
    assert (error <= bound + TOL[torch.float32]).all()
    # The activations are rounded indeed: the reference without the rounding is further off.
    exact = (out - kernel_rows(x.double(), isa, torch.float32, fmt) @ w.double().t()).abs()
    assert error.mean() > 4 * exact.mean()


# (activation, bias, residual, norm): each epilogue piece, and all of them together.
EPILOGUES = [("none", True, False, "none"), ("gelu_tanh", True, False, "none"),
             ("relu", False, True, "none"), ("silu_and_mul", True, True, "none"),
             ("none", False, False, "layer_norm"),
             ("gelu_tanh", True, False, "layer_norm_no_bias"),
             ("silu_and_mul", True, True, "rms_norm"),
             ("gelu_tanh_and_mul", True, True, "none"),
             ("gelu_tanh_and_mul", False, False, "rms_norm")]


def epilogue_inputs(T: int, K: int, N: int, dtype: torch.dtype, activation: str,
                    with_bias: bool, with_residual: bool, norm: str):
    """x [T, K], the bias, the residual and the norm's arguments of one EPILOGUES case."""
    gen = torch.Generator().manual_seed(T * 7 + N)
    x = torch.randn(T, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if with_bias else None
    n_out = N // 2 if activation in ops.GATED_ACTIVATIONS else N
    r = torch.randn(T, n_out, generator=gen).to(dtype) if with_residual else None
    gamma = (1 + torch.randn(K, generator=gen) / 4).to(dtype)
    beta = torch.randn(K, generator=gen).to(dtype) if norm == "layer_norm" else None
    kind = "layer_norm" if norm.startswith("layer_norm") else norm
    return x, b, r, (() if norm == "none" else (kind, gamma, beta, 1e-5))


def epilogue_reference(x, w, b, activation, r, norm_args, rounded) -> torch.Tensor:
    """The op's output in float64: the rows normalized (the op's own normalized rows, then
    ``rounded``, where the path rounds them; else the reference norms), the weights w, then the
    epilogue."""
    if rounded:
        rows = rounded(x.double() if not norm_args else normed_rows(x, *norm_args).double())
    elif not norm_args:
        rows = x
    else:
        kind, gamma, beta, eps = norm_args
        rows = (ref.rms_norm(x, gamma, eps) if kind == "rms_norm"
                else ref.layer_norm(x, gamma, beta, eps))
    return ref.packed_linear(rows, w, b, activation, r)


@pytest.mark.parametrize("fmt", FORMATS + STORED_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5, 9, 17, 25, 64])
@pytest.mark.parametrize("activation,with_bias,with_residual,norm", EPILOGUES)
def test_quantized_linear_epilogue(isa, fmt, dtype, T, activation, with_bias, with_residual,
                                   norm):
    # N even, so that the gated acts have their gate and up halves.
    K, N = (96, 66) if block_weights(fmt) == 32 else (256, 66)
    q, w = quantized(fmt, K, N)
    x, b, r, norm_args = epilogue_inputs(T, K, N, dtype, activation, with_bias, with_residual,
                                         norm)
    out = ops.quantized_linear(x, q, fmt, K, b, activation, r, *norm_args)
    expected = epilogue_reference(x, w, b, activation, r, norm_args, rounding(isa, T, dtype, fmt))
    assert_close(out, expected, dtype)


def test_default_isa_is_the_best_this_cpu_runs(force_isa):
    q, w = quantized("q4_0", 96, 33)
    x = torch.randn(1, 96)
    assert _C.get_isa("quant") == _C.quant_isas()[-1]  # the suite runs without ORCA_QUANT_ISA
    default = ops.quantized_linear(x, q, "q4_0", 96)
    force_isa("quant", _C.quant_isas()[-1])
    assert torch.equal(default, ops.quantized_linear(x, q, "q4_0", 96))
    assert _C.quant_isas()[0] == "portable"


def hand_made_blocks(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of one block each, built from ggml's block layout by hand (not through gguf),
    and the weights they hold: weight j of a row is a distinct small integer times d."""
    rows, weights = [], []
    for row, (d, m) in enumerate([(0.5, -1.0), (2.0, 3.0)]):
        header = struct.pack("<e", d) + (struct.pack("<e", m) if fmt == "q4_1" else b"")
        if fmt == "q8_0":
            q = [(5 * j + row) % 256 - 128 for j in range(32)]
            body, values = struct.pack("<32b", *q), [v * d for v in q]
        else:
            q = [(j * 7 + row) % 16 for j in range(32)]  # elements 0-15 low nibbles, 16-31 high
            body = bytes(q[j] | q[j + 16] << 4 for j in range(16))
            values = [v * d + m if fmt == "q4_1" else (v - 8) * d for v in q]
        rows.append(np.frombuffer(header + body, dtype=np.uint8))
        weights.append(values)
    return torch.from_numpy(np.stack(rows)), torch.tensor(weights)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [1, 30])  # the dot kernels and the panels
def test_block_layout(isa, fmt, T):
    """Against the format's definition itself: small integer x with 127 in each row (so that
    int8 activations round nothing; 32767 where avx512_vnni's int16 GEMM takes them), so that
    every sum is exact."""
    q, w = hand_made_blocks(fmt)
    x = torch.randint(-3, 4, (T, 32), generator=torch.Generator().manual_seed(T)).float()
    x[:, 5] = 32767 if isa == "avx512_vnni" and T > DOT_MAX_T_INT16 else 127
    torch.testing.assert_close(ops.quantized_linear(x, q, fmt, 32), x @ w.t(), atol=0, rtol=0)
    torch.testing.assert_close(dequantize_weight(q, fmt, 32), w, atol=0, rtol=0)


def test_noncontiguous_inputs():
    q, w = quantized("q8_0", 96, 33)
    x = torch.randn(96, 5).t()  # [5, 96], not contiguous
    wide = torch.zeros(33, 2 * q.shape[1], dtype=torch.uint8)
    wide[:, :q.shape[1]] = q
    out = ops.quantized_linear(x, wide[:, :q.shape[1]], "q8_0", 96)
    torch.testing.assert_close(out, ops.quantized_linear(x.contiguous(), q, "q8_0", 96))
    rows = kernel_rows(x.double(), _C.quant_isas()[-1], torch.float32, "q8_0")  # the default
    assert_close(out, rows @ w.double().t(), torch.float32)


def test_empty():
    q, _ = quantized("q4_1", 96, 33)
    assert ops.quantized_linear(torch.randn(0, 96), q, "q4_1", 96).shape == (0, 33)
    no_rows = torch.zeros(0, q.shape[1], dtype=torch.uint8)
    assert ops.quantized_linear(torch.randn(4, 96), no_rows, "q4_1", 96).shape == (4, 0)
    no_columns = torch.zeros(6, 0, dtype=torch.uint8)
    for T in (4, 40):  # an empty sum: the bias alone
        out = ops.quantized_linear(torch.randn(T, 0), no_columns, "q4_1", 0, torch.ones(6))
        assert torch.equal(out, torch.ones(T, 6))


def test_inference_mode():
    """The panels' worker threads write their buffers under the caller's inference mode."""
    q, w = quantized("q4_0", 96, 129)
    for T in (3, 600):
        for dtype in DTYPES:
            x = torch.randn(T, 96).to(dtype)
            with torch.inference_mode():
                out = ops.quantized_linear(x, q, "q4_0", 96, None, "gelu_tanh")
            assert out.is_inference()
            rows = kernel_rows(x.double(), _C.quant_isas()[-1], dtype, "q4_0")  # the default
            assert_close(out, ref.packed_linear(rows, w, None, "gelu_tanh"), dtype)


def test_opcheck():
    q, _ = quantized("q4_0", 96, 66)
    for T in (1, 3, 30):  # the dot kernels (int8 on avx512_vnni), amx_int8's tiles, the panels
        for dtype in DTYPES:
            x, b = torch.randn(T, 96).to(dtype), torch.randn(66).to(dtype)
            r, gamma = torch.randn(T, 33).to(dtype), torch.randn(96).to(dtype)
            op = torch.ops.orca.quantized_linear.default
            torch.library.opcheck(op, (x, q, "q4_0", 96, None))
            for act in ops.GATED_ACTIVATIONS:
                torch.library.opcheck(op, (x, q, "q4_0", 96, b, act, r, "rms_norm", gamma, None,
                                           1e-6))


ERROR_CASES = [
    (dict(format="q2_K"), "format must be one of 'q8_0', 'q4_0', 'q4_1', 'q5_0', 'q5_1', "
                          "'q8_m', 'q4_K', 'q5_K', 'q6_K', or one of them with '_x16' "
                          r"\(the x16 layout\), got 'q2_K'"),
    (dict(format="q8_m"), "qweight has 34 bytes per row but in_features = 32 in q8_m blocks "
                          "takes 36"),
    (dict(x=torch.randn(4, 40), in_features=40),
     "in_features must be a non-negative multiple of 32 .*got 40"),
    (dict(format="q4_K"), r"in_features must be a non-negative multiple of 256 \(the block size "
                          r"of q4_K\), got 32"),
    (dict(format="q6_K", x=torch.randn(4, 288), in_features=288),
     "in_features must be a non-negative multiple of 256 .*q6_K.*got 288"),
    (dict(format="q5_K", x=torch.randn(4, 256), in_features=256,
          qweight=torch.zeros(6, 175, dtype=torch.uint8)),
     r"qweight has 175 bytes per row but in_features = 256 in q5_K blocks takes 176 \(176 "
     r"bytes per 256 weights\)"),
    (dict(format="q5_1"), "qweight has 34 bytes per row but in_features = 32 in q5_1 blocks "
                          "takes 24"),
    (dict(qweight=torch.zeros(6, 33, dtype=torch.uint8)),
     "qweight has 33 bytes per row but in_features = 32 in q8_0 blocks takes 34"),
    (dict(format="q4_1"), "qweight has 34 bytes per row but in_features = 32 in q4_1 blocks "
                          "takes 20"),
    (dict(qweight=torch.zeros(6, 34, dtype=torch.int8)), "qweight must have dtype"),
    (dict(qweight=torch.zeros(6 * 34, dtype=torch.uint8)), r"qweight must be 2-D"),
    (dict(x=torch.randn(4, 32).int()), "x must be float32 or bfloat16"),
    (dict(x=torch.randn(4, 32).half()), "x must be float32 or bfloat16"),
    (dict(x=torch.randn(32)), r"x must be 2-D \[T, K\]"),
    (dict(x=torch.randn(4, 64)), r"x.size\(1\) must equal in_features"),
    (dict(bias=torch.randn(5)), "bias has 5 entries but qweight has N = 6 rows"),
    (dict(bias=torch.randn(6).bfloat16()), r"bias has dtype \S+ but x has dtype"),
    (dict(residual=torch.randn(4, 5)), r"residual must be the output's shape \[4, 6\]"),
    (dict(activation="silu_and_mul", residual=torch.randn(4, 6)),
     r"residual must be the output's shape \[4, 3\]"),
    (dict(activation="silu_and_mul", qweight=torch.zeros(5, 34, dtype=torch.uint8)),
     "silu_and_mul needs qweight with 2I rows"),
    (dict(activation="gelu_tanh_and_mul", qweight=torch.zeros(5, 34, dtype=torch.uint8)),
     "gelu_tanh_and_mul needs qweight with 2I rows"),
    (dict(activation="swish"), "activation must be one of"),
    (dict(norm="layer_norm", norm_weight=torch.randn(31)),
     "norm_weight has 31 entries but x has K = 32 columns"),
    (dict(norm="rms_norm"), r"norm needs norm_weight \[K\]"),
    (dict(norm="rms_norm", norm_weight=torch.randn(32), norm_bias=torch.randn(32)),
     "rms_norm takes no norm_bias"),
]


@pytest.mark.parametrize("override,message", ERROR_CASES)
def test_errors(override, message):
    args = dict(x=torch.randn(4, 32), qweight=torch.zeros(6, 34, dtype=torch.uint8),
                format="q8_0", in_features=32, bias=None, activation="none", residual=None,
                norm="none", norm_weight=None, norm_bias=None)
    args.update(override)
    with pytest.raises(RuntimeError, match=message):
        ops.quantized_linear(**args)


def test_forced_isa_errors():
    before = _C.get_isa("quant")
    with pytest.raises(ValueError, match="quant ISA must be one of 'portable', 'avx2', "
                                         "'avx512', 'avx512_vnni', 'amx_int8', got 'sse9'"):
        _C.set_isa("quant", "sse9")
    missing = [name for name in ISAS if name not in _C.quant_isas()]
    for name in missing:
        with pytest.raises(ValueError, match=f"quant ISA '{name}' is a path this build or CPU "
                                             "does not run"):
            _C.set_isa("quant", name)
    with pytest.raises(ValueError, match="kind must be one of 'quant', 'attention', 'lora', "
                                         "got 'gemm'"):
        _C.set_isa("gemm", "portable")
    assert _C.get_isa("quant") == before  # a refused choice changes nothing


# --------------------------------------------------------------------------- the x16 layout
# Up to this many tokens the x16 layout's int8 kernels take them (amx_int8: then its tiles).
ROWS16_INT8_MAX_T = {"avx512_vnni": 24, "amx_int8": 8}
# Each format's block fields (first byte, bytes) in the x16 layout's order, as
# csrc/include/orca/cpu/quant_rows16.h describes them (q6_K's d and scales first).
ROWS16_FIELDS = {"q8_0": [(0, 2), (2, 32)], "q4_0": [(0, 2), (2, 16)],
                 "q4_1": [(0, 2), (2, 2), (4, 16)], "q5_0": [(0, 2), (2, 4), (6, 16)],
                 "q5_1": [(0, 2), (2, 2), (4, 4), (8, 16)], "q8_m": [(0, 2), (2, 2), (4, 32)],
                 "q4_K": [(0, 2), (2, 2), (4, 12), (16, 128)],
                 "q5_K": [(0, 2), (2, 2), (4, 12), (16, 32), (48, 128)],
                 "q6_K": [(208, 2), (192, 16), (128, 64), (0, 128)]}


def rearranged_high_bits(field: torch.Tensor) -> torch.Tensor:
    """q5's qh bytes ``[..., 4]`` as the x16 layout holds them: bit 8i + v from bit 4v + i of the
    little-endian qh, bit 8i + 4 + v from bit 16 + 4v + i (i, v < 4)."""
    qh = sum(field[..., i].long() << (8 * i) for i in range(4))
    source = [4 * v + i if v < 4 else 16 + 4 * (v - 4) + i for i in range(4) for v in range(8)]
    moved = sum(((qh >> old) & 1) << new for new, old in enumerate(source))
    return torch.stack([(moved >> (8 * i)) & 255 for i in range(4)], -1).to(torch.uint8)


def rows16_reference(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """The x16 layout of the blocks ``q [N, row bytes]``, built in torch from its description:
    per group of 16 rows and block, each field for the 16 rows: a 2-byte field's 16 values; a
    longer one as vectors of bytes 4v to 4v + 3 of each row (q5's qh rearranged)."""
    block = BLOCK_LAYOUTS[fmt][1]
    rows, blocks = q.shape[0], q.shape[1] // block
    b = q.reshape(rows // 16, 16, blocks, block).transpose(1, 2)  # [group, block, row, byte]
    parts = []
    for at, size in ROWS16_FIELDS[fmt]:
        field = b[..., at:at + size]
        if fmt in ("q5_0", "q5_1") and size == 4:
            field = rearranged_high_bits(field)
        if size > 2:  # [.., row, vector, 4] -> [.., vector, row, 4]
            field = field.reshape(*field.shape[:3], -1, 4).transpose(2, 3)
        parts.append(field.reshape(*b.shape[:2], -1))
    return torch.cat(parts, -1).reshape(rows, -1)


ROWS16_SHAPES = {32: [(32, 16), (96, 48), (288, 64)], 256: [(256, 16), (768, 48)]}


@pytest.mark.parametrize("fmt", FORMATS + STORED_FORMATS)
@pytest.mark.parametrize("shape", [0, 1])
def test_rows16_layout(fmt, shape):
    """interleave_rows16 lays the blocks out as described, bit for bit, and
    deinterleave_rows16 gives them back; dequantize_weight reads either."""
    K, N = ROWS16_SHAPES[block_weights(fmt)][shape]
    q, w = quantized(fmt, K, N)
    grouped = ops.interleave_rows16(q, fmt, K)
    assert torch.equal(grouped, rows16_reference(q, fmt))
    assert torch.equal(ops.deinterleave_rows16(grouped, fmt, K), q)
    assert torch.equal(dequantize_weight(grouped, fmt + ops.ROWS16_SUFFIX, K), w)


@pytest.mark.parametrize("fmt", FORMATS + STORED_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 2, 5, 8, 9, 24, 25, 600])
@pytest.mark.parametrize("activation,with_bias,with_residual,norm", EPILOGUES)
def test_quantized_linear_rows16(isa, fmt, dtype, T, activation, with_bias, with_residual,
                                 norm):
    """The x16 layout against gguf's weights and a float64 matmul on every ISA and epilogue:
    its int8 kernels (in passes of 8 tokens: 1-24 on avx512_vnni, 1-8 on amx_int8), amx_int8's
    tiles reading it directly, and the other kernels on its rows de-interleaved; beyond the int8
    kernels, the row layout's results bit for bit."""
    K, N = (96 if block_weights(fmt) == 32 else 512), 96  # gated: halves of 48 rows
    q, w = quantized(fmt, K, N)
    x, b, r, norm_args = epilogue_inputs(T, K, N, dtype, activation, with_bias, with_residual,
                                         norm)
    out = ops.quantized_linear(x, ops.interleave_rows16(q, fmt, K), fmt + ops.ROWS16_SUFFIX, K,
                               b, activation, r, *norm_args)
    # The x16 int8 kernels split up to ROWS16_INT8_MAX_T tokens into two int8 parts; beyond, the
    # kernels give the row layout's results.
    int8_kernels = T <= ROWS16_INT8_MAX_T.get(isa, 0)
    rounded = (functools.partial(int8x2_rounded, lo_steps=256) if int8_kernels
               else rounding(isa, T, dtype, fmt))
    assert_close(out, epilogue_reference(x, w, b, activation, r, norm_args, rounded), dtype)
    if not int8_kernels:
        row_layout = ops.quantized_linear(x, q, fmt, K, b, activation, r, *norm_args)
        assert torch.equal(out, row_layout)


def rows16_refusing_int8(isa: str, T: int, dtype: torch.dtype, fmt: str):
    """How a call that refuses int8 rounding (an output head's) rounds T tokens on the x16
    layout: as finely as float32 (None) on the int8 kernels, which take each token's two int8
    parts and those of their remainder, up to half the tokens they take; beyond, as on the row
    layout."""
    if T <= ROWS16_INT8_MAX_T.get(isa, 0) // 2:
        return None
    return rounding(isa, T, dtype, fmt, int8_activations=False)


@pytest.mark.parametrize("fmt", FORMATS + STORED_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 2, 4, 5, 12, 13, 25])
def test_quantized_linear_rows16_refusing_int8(isa, fmt, dtype, T):
    """A call that refuses int8 rounding (an output head's logits, its final norm fused) on the
    x16 layout against gguf's weights and a float64 matmul on every ISA: its float32 rows
    unrounded up to 12 tokens on avx512_vnni (in passes of 4), 4 on amx_int8; beyond, amx_int8's
    tiles and avx512_vnni's int16 GEMM reading the layout directly, and the other kernels on its
    rows de-interleaved; then the row layout's results bit for bit."""
    K, N = (96 if block_weights(fmt) == 32 else 512), 48
    q, w = quantized(fmt, K, N)
    x, _, _, norm_args = epilogue_inputs(T, K, N, dtype, "none", False, False, "rms_norm")
    out = ops.quantized_linear(x, ops.interleave_rows16(q, fmt, K), fmt + ops.ROWS16_SUFFIX, K,
                               None, "none", None, *norm_args, int8_activations=False)
    rounded = rows16_refusing_int8(isa, T, dtype, fmt)
    assert_close(out, epilogue_reference(x, w, None, "none", None, norm_args, rounded), dtype)
    if T > ROWS16_INT8_MAX_T.get(isa, 0) // 2:
        row_layout = ops.quantized_linear(x, q, fmt, K, None, "none", None, *norm_args,
                                          int8_activations=False)
        assert torch.equal(out, row_layout)


@pytest.mark.parametrize("fmt", FORMATS + STORED_FORMATS)
@pytest.mark.parametrize("isa,T", [("avx512_vnni", 1), ("avx512_vnni", 12), ("amx_int8", 1),
                                   ("amx_int8", 4)])
def test_rows16_refusing_int8_is_as_fine_as_float32(fmt, isa, T, force_isa):
    """The x16 layout's int8 kernels on the activations' split and their remainder's split are
    as close to a float64 matmul as the float32 kernels on the row layout (within 4x their
    largest error), and far closer than the split alone (the call that allows int8 rounding)."""
    if isa not in _C.quant_isas():
        pytest.skip(f"this CPU does not run the {isa} path")
    K, N = (640, 256) if block_weights(fmt) == 32 else (768, 256)
    q, w = quantized(fmt, K, N)
    grouped = ops.interleave_rows16(q, fmt, K)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(3)) * 4
    exact = x.double() @ w.double().t()

    def error(qweight: torch.Tensor, format: str, int8_activations: bool) -> torch.Tensor:
        out = ops.quantized_linear(x, qweight, format, K, int8_activations=int8_activations)
        return (out.double() - exact).abs()

    force_isa("quant", "avx512")
    float_rows = error(q, fmt, False)
    force_isa("quant", isa)
    fine = error(grouped, fmt + ops.ROWS16_SUFFIX, False)
    assert fine.max() <= 4 * float_rows.max()
    assert error(grouped, fmt + ops.ROWS16_SUFFIX, True).mean() > 16 * fine.mean()


def test_rows16_opcheck():
    q, _ = quantized("q5_0", 96, 48)
    grouped = ops.interleave_rows16(q, "q5_0", 96)
    torch.library.opcheck(torch.ops.orca.interleave_rows16.default, (q, "q5_0", 96))
    torch.library.opcheck(torch.ops.orca.deinterleave_rows16.default, (grouped, "q5_0", 96))
    for T in (1, 30):
        torch.library.opcheck(torch.ops.orca.quantized_linear.default,
                              (torch.randn(T, 96), grouped, "q5_0_x16", 96, None))


ROWS16_ERROR_CASES = [
    (dict(qweight=torch.zeros(40, 34, dtype=torch.uint8)),
     r"qweight in the x16 layout \('q8_0_x16'\) must have a multiple of 16 rows, got 40"),
    (dict(activation="silu_and_mul", qweight=torch.zeros(48, 34, dtype=torch.uint8)),
     "must have a multiple of 16 rows in each of its gate and up halves, got 48"),
    (dict(format="q2_K_x16"), "format must be one of 'q8_0', 'q4_0', 'q4_1', 'q5_0', 'q5_1', "
                              "'q8_m', 'q4_K', 'q5_K', 'q6_K', or one of them with '_x16' "
                              r"\(the x16 layout\), got 'q2_K_x16'"),
    (dict(format="q8_0_x8"), "format must be one of .* got 'q8_0_x8'"),
]


@pytest.mark.parametrize("override,message", ROWS16_ERROR_CASES)
def test_rows16_errors(override, message):
    args = dict(x=torch.randn(4, 32), qweight=torch.zeros(32, 34, dtype=torch.uint8),
                format="q8_0_x16", in_features=32)
    args.update(override)
    with pytest.raises(RuntimeError, match=message):
        ops.quantized_linear(**args)


@pytest.mark.parametrize("args,message", [
    ((torch.zeros(32, 210, dtype=torch.uint8), "q6_K", 288),
     r"in_features must be a non-negative multiple of 256 \(the block size of q6_K\), got 288"),
    ((torch.zeros(32, 34, dtype=torch.uint8), "q2_K", 32), "format must be one of"),
    ((torch.zeros(40, 34, dtype=torch.uint8), "q8_0", 32),
     "qweight must have a multiple of 16 rows for the x16 layout, got 40"),
    ((torch.zeros(32, 35, dtype=torch.uint8), "q8_0", 32),
     "qweight has 35 bytes per row but in_features = 32 in q8_0 blocks takes 34"),
    ((torch.zeros(32, 34, dtype=torch.uint8), "q8_0_x16", 32), "format must be one of"),
])
def test_interleave_rows16_errors(args, message):
    for op in (ops.interleave_rows16, ops.deinterleave_rows16):
        with pytest.raises(RuntimeError, match=message):
            op(*args)


# ---------------------------------------------------------------------------- orca_ext.quantize

@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_weight_matches_gguf(fmt):
    w = torch.randn(40, 288, generator=torch.Generator().manual_seed(3)) * 0.05
    w[3, :32] = 0  # an all-zero block: d = 0
    q = quantize_weight(w.bfloat16(), fmt)
    qtype = GGMLQuantizationType[fmt.upper()]
    expected = quants.quantize(w.bfloat16().float().numpy(), qtype)
    assert q.dtype == torch.uint8 and q.shape == (40, 288 // 32 * {"q8_0": 34, "q4_0": 18,
                                                                     "q4_1": 20}[fmt])
    assert np.array_equal(q.numpy(), expected)
    deq = dequantize_weight(q, fmt, 288)
    assert np.array_equal(deq.numpy(), quants.dequantize(expected, qtype))
    # Each weight within a quantization step of its block's range (q8_0: 1/127 of its max).
    step = w.abs().amax(1, keepdim=True) / (127 if fmt == "q8_0" else 7)
    assert ((deq - w).abs() <= step).all()


# 32-weight GGUF formats as stored (gguf-py quantizes the first three) and the formats that
# hold them exactly.
EXACT_CASES = [(fmt, target) for target, exact in (("q8_0", EXACT_IN_Q8_0), ("q8_m", EXACT_IN_Q8_M))
               for fmt in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1") if fmt in exact]


@pytest.mark.parametrize("fmt,target", EXACT_CASES)
def test_as_exact_holds_the_same_weights(fmt, target):
    """as_exact's blocks dequantize (q8_m through its torch reference) to gguf's dequantization
    of the source blocks bit for bit, and the kernels read them as such."""
    K = 288
    q, w = quantized(fmt, K, 33)
    if fmt in QUANTIZE_FORMATS:
        q = q.clone()
        q[5, :2] = torch.tensor([0, 0], dtype=torch.uint8)  # a zero scale
    w = torch.from_numpy(quants.dequantize(q.numpy(), GGMLQuantizationType[fmt.upper()]))
    exact = as_exact(q, fmt, target)
    assert exact.shape == (33, K // 32 * {"q8_0": 34, "q8_m": 36}[target])
    assert torch.equal(dequantize_weight(exact, target, K), w)
    assert torch.equal(ops.quantized_embedding(torch.arange(33), exact, target, K), w)


def test_iq4_nl_as_exact():
    """IQ4_NL blocks (random, gguf-py only dequantizes them) as q8_0 and q8_m: gguf-py's
    dequantization of the source bit for bit."""
    blocks = torch.from_numpy(random_blocks(GGMLQuantizationType.IQ4_NL, 7, 96,
                                            np.random.default_rng(0)))
    w = torch.from_numpy(quants.dequantize(blocks.numpy(), GGMLQuantizationType.IQ4_NL))
    for target in ("q8_0", "q8_m"):
        assert torch.equal(dequantize_weight(as_exact(blocks, "iq4_nl", target), target, 96), w)


def test_iq4_xs_as_q8_0():
    """IQ4_XS super-blocks as q8_0: each weight within float16's rounding (2^-11 relative) of
    gguf-py's dequantization, each q8_0 quant the weight's grid value; a scale beyond float16's
    range is refused."""
    rng = np.random.default_rng(0)
    blocks = random_blocks(GGMLQuantizationType.IQ4_XS, 5, 512, rng)
    w = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.IQ4_XS))
    q8_0 = iq4_xs_as_q8_0(torch.from_numpy(blocks))
    assert q8_0.shape == (5, 16 * 34)
    got = dequantize_weight(q8_0, "q8_0", 512)
    assert ((got - w).abs() <= w.abs() * 2.0 ** -11).all()
    values = set(q8_0.reshape(5, 16, 34)[..., 2:].contiguous().view(torch.int8).unique().tolist())
    assert values <= set(IQ4_NL_VALUES)
    blocks[0, :2] = np.array([65000.0], dtype=np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="IQ4_XS blocks with scales beyond float16's range"):
        iq4_xs_as_q8_0(torch.from_numpy(blocks))


def test_as_exact_errors():
    q, _ = quantized("q4_1", 64, 3)
    with pytest.raises(ValueError, match="q4_1 blocks are not held exactly by q8_0"):
        as_exact(q, "q4_1", "q8_0")
    with pytest.raises(ValueError, match="q4_K blocks are not held exactly by q8_m"):
        as_exact(torch.zeros(3, 144, dtype=torch.uint8), "q4_K", "q8_m")
    big = quantize_weight(torch.full((1, 32), 65500.0), "q8_0")  # d = 515.5: -128 d overflows
    with pytest.raises(ValueError, match="beyond float16's range"):
        as_exact(big, "q8_0", "q8_m")


def test_quantize_weight_errors():
    with pytest.raises(ValueError, match="format must be one of"):
        quantize_weight(torch.randn(4, 32), "q2_k")
    with pytest.raises(ValueError, match="K a multiple of 32"):
        quantize_weight(torch.randn(4, 40), "q8_0")
    with pytest.raises(ValueError, match=r"qweight must be uint8 \[N, 34\]"):
        dequantize_weight(torch.zeros(4, 20, dtype=torch.uint8), "q8_0", 32)
