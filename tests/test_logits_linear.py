"""ops.logits_linear and the models' compute_logits: float32 logits from float32 accumulation,
against float64 references of the same (bfloat16 / float16) values."""
import pytest
import torch

import orca_ext  # noqa: F401
import reference_ops as ref
from orca_ext import ops
from engine_fakes import ScriptedBatches
from orca_ext.kv import KVCache, SlotAllocator
from orca_ext.model import load_model
from orca_ext.runner import ModelRunner
from orca_ext.sampling_params import SamplingParams

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NORM_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}
# float32 accumulation of K products: errors of order sqrt(K) * 2**-24 of the terms. A logit
# rounded to bfloat16 (float16) is off by up to 2**-9 (2**-12) of itself, 100x-1000x more.
GEMM_TOL = 1e-5


def normed_rows(x: torch.Tensor, norm: str, gamma, beta, eps: float) -> torch.Tensor:
    """x's rows normalized as packed_linear normalizes them (in x's dtype): its output against
    the identity, which adds each element to zeros only, so it is the normalized rows exactly."""
    eye = torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    return ops.packed_linear(x, eye, None, "none", None, norm, gamma, beta, eps)


def assert_float32_accumulation(out: torch.Tensor, expected: torch.Tensor,
                                dtype: torch.dtype) -> None:
    """out equals the float64 ``expected`` within float32 accumulation error, far closer than
    rounding it to the inputs' ``dtype`` (bfloat16 for float32 inputs) would leave it."""
    assert out.dtype == torch.float32 and out.shape == expected.shape
    atol = GEMM_TOL * expected.abs().max().item()
    torch.testing.assert_close(out.double().cpu(), expected, atol=atol, rtol=0)
    rounded = expected.to(torch.bfloat16 if dtype == torch.float32 else dtype).double()
    assert (rounded - expected).abs().max().item() > 20 * atol, \
        f"the tolerance would not catch logits rounded to {dtype}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", ["none", "layer_norm", "rms_norm"])
# 1-8 rows: the skinny kernel; 9-32: bfloat16 with K even takes the token-lanes kernel (one and
# two vectors of tokens), the others the widened float32 GEMM, as every dtype does from 33
# (float32: packed_linear's own paths). N odd: a partial last column block and tile. K = 576
# (SmolLM2's hidden size) fills whole vector steps, K = 66 and 75 leave even and odd tails.
@pytest.mark.parametrize("T", [1, 2, 5, 8, 9, 16, 31, 33, 100, 300])
@pytest.mark.parametrize("N,K", [(1000, 576), (1001, 66), (4099, 75)])
def test_logits_linear(device, dtype, norm, T, N, K):
    gen = torch.Generator().manual_seed(T * 13 + K)
    x = (3 * torch.randn(T, K, generator=gen) + 1).to(dtype).to(device)
    # Logits of magnitude ~20-40, as a real model's top tokens have.
    w = (10 * torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype).to(device)
    gamma = (1 + torch.randn(K, generator=gen) / 4).to(dtype).to(device)
    beta = torch.randn(K, generator=gen).to(dtype).to(device) if norm == "layer_norm" else None
    norm_args = () if norm == "none" else (norm, gamma, beta, 1e-5)
    out = ops.logits_linear(x, w, *norm_args)
    rows = x if norm == "none" else normed_rows(x, *norm_args)
    if norm != "none":
        cpu = [t.cpu() if t is not None else None for t in (x, gamma, beta)]
        normed = (ref.rms_norm(cpu[0], cpu[1], 1e-5) if norm == "rms_norm"
                  else ref.layer_norm(*cpu, 1e-5))
        tol = NORM_TOL[dtype]
        torch.testing.assert_close(rows.double().cpu(), normed, atol=tol, rtol=tol)
    assert_float32_accumulation(out, rows.cpu().double() @ w.cpu().double().t(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_linear_empty_and_strided(dtype):
    w = torch.randn(70, 48).to(dtype)
    assert ops.logits_linear(torch.randn(0, 48).to(dtype), w).shape == (0, 70)
    no_columns = torch.randn(40, 0).to(dtype), torch.randn(70, 0).to(dtype)
    assert torch.equal(ops.logits_linear(*no_columns), torch.zeros(40, 70))
    x = torch.randn(48, 12).to(dtype).t()  # [12, 48], not contiguous
    assert_float32_accumulation(ops.logits_linear(x, w), x.double() @ w.double().t(), dtype)


def test_logits_linear_opcheck(device):
    for t in (3, 20, 40):  # the skinny, lanes (bfloat16) and widened paths
        for dtype in DTYPES:
            x = torch.randn(t, 16, device=device).to(dtype)
            w = torch.randn(24, 16, device=device).to(dtype)
            gamma = torch.randn(16, device=device).to(dtype)
            torch.library.opcheck(torch.ops.orca.logits_linear.default, (x, w))
            torch.library.opcheck(torch.ops.orca.logits_linear.default,
                                  (x, w, "layer_norm", gamma, gamma, 1e-5))
            torch.library.opcheck(torch.ops.orca.logits_linear.default,
                                  (x, w, "rms_norm", gamma, None, 1e-6))


ERROR_CASES = [
    (dict(weight=torch.randn(6, 8).half()), r"weight has dtype \S+ but x has dtype"),
    (dict(weight=torch.randn(6, 7)), r"weight.size\(1\) must equal x.size\(1\)"),
    (dict(norm="batch_norm", norm_weight=torch.randn(8)),
     "norm must be one of 'none', 'layer_norm', 'rms_norm', got 'batch_norm'"),
    (dict(x=torch.randn(4, 8).int()), "x must be float32, bfloat16 or float16"),
    (dict(x=torch.randn(8)), r"x must be 2-D \[T, K\]"),
    (dict(norm="layer_norm"), r"norm needs norm_weight \[K\]"),
    (dict(norm_weight=torch.randn(8)), "norm_weight / norm_bias are given but norm is 'none'"),
    (dict(norm="rms_norm", norm_weight=torch.randn(8), norm_bias=torch.randn(8)),
     "rms_norm takes no norm_bias"),
    (dict(norm="layer_norm", norm_weight=torch.randn(7)),
     "norm_weight has .* but x has K = 8 columns"),
    (dict(norm="layer_norm", norm_weight=torch.randn(8), norm_bias=torch.randn(8).half()),
     r"norm_bias has dtype \S+ but x has dtype"),
]


@pytest.mark.parametrize("override,message", ERROR_CASES)
def test_logits_linear_errors(override, message):
    """The shared checks (csrc/checks.h, which the CUDA kernel runs too), naming the argument."""
    args = dict(x=torch.randn(4, 8), weight=torch.randn(6, 8), norm="none", norm_weight=None,
                norm_bias=None)
    args.update(override)
    with pytest.raises(RuntimeError, match=message):
        ops.logits_linear(**args)


# ---------------------------------------------------------------------------- models

@pytest.mark.parametrize("num_rows", [1, 5, 12, 40])
def test_bfloat16_model_logits(num_rows):
    """orca-tiny in bfloat16: compute_logits is the float64 product of the rows its final norm
    gives and the lm_head, within float32 accumulation error (not rounded to bfloat16)."""
    model = load_model("orca-tiny", dtype="bfloat16").model
    hidden = (4 * torch.randn(50, 512, generator=torch.Generator().manual_seed(num_rows))
              ).bfloat16()
    indices = torch.randperm(50, generator=torch.Generator().manual_seed(1))[:num_rows]
    with torch.inference_mode():
        logits = model.compute_logits(hidden, indices)
    rows = hidden[indices]
    normed = normed_rows(rows, *model.norm.fused_args())
    torch.testing.assert_close(normed.double(), model.norm(rows).double(), atol=3e-2, rtol=3e-2)
    assert_float32_accumulation(logits, normed.double() @ model.lm_head.weight.double().t(),
                                torch.bfloat16)


def test_runner_step_gives_float32_logits():
    """A bfloat16 model's logits through the runner's stack step are logits_linear's float32
    sums, not rounded to bfloat16."""
    loaded = load_model("orca-tiny", dtype="bfloat16")
    runner = ModelRunner(loaded.model, KVCache(loaded.config, 4, 4, torch.bfloat16))
    allocator = SlotAllocator(4, 4)
    allocator.allocate(0, 3)
    batch = ScriptedBatches(allocator).batch([(0, [65, 66, 67], 0, SamplingParams(), 3, True)])
    with torch.inference_mode():
        inputs = runner.prepare(batch)
        inputs.sample_rows = torch.tensor([1, 2])
        logits = runner.logits(inputs, runner.forward(inputs))
    assert logits.dtype == torch.float32 and logits.shape == (2, 257)
    # Values between bfloat16's steps: the float32 sums themselves.
    assert (logits != logits.bfloat16().float()).float().mean() > 0.9
