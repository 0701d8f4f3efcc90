"""torch.ops.orca against the pure-torch references in reference_ops.py."""
import re

import pytest
import torch

import orca_ext  # noqa: F401
import reference_ops as ref
from orca_ext import _C, ops
from orca_ext.testing import random_ragged_batch

TOL = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (4e-3, 4e-3)}
DTYPES = list(TOL)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------- packed_linear

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
# T <= 8 takes the skinny kernel (K covers its full-step, 16-wide and scalar tails); float32
# up to 32 the token-lanes kernel (9 / 20 / 32: one and two vectors, row and column tails);
# above, oneDNN for float32 (activations as its post-ops), BLAS for the others (1100: several
# row and column tiles for gelu_tanh / relu, the last partial). K = 0 / N = 0: empty products.
@pytest.mark.parametrize("T,K,N", [(0, 64, 96), (1, 64, 96), (1, 112, 90), (2, 100, 34),
                                   (3, 40, 70), (4, 512, 1100), (5, 80, 64), (7, 48, 130),
                                   (8, 1040, 520), (9, 64, 96), (20, 100, 70), (32, 512, 130),
                                   (300, 128, 512), (1100, 64, 200), (40, 0, 16), (4, 0, 16),
                                   (40, 64, 0)])
def test_packed_linear(device, dtype, activation, with_bias, with_residual, T, K, N):
    gen = torch.Generator().manual_seed(T * 7 + N)
    x = torch.randn(T, K, generator=gen).to(dtype).to(device)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype).to(device)
    b = torch.randn(N, generator=gen).to(dtype).to(device) if with_bias else None
    n_out = N // 2 if activation in ops.GATED_ACTIVATIONS else N
    r = torch.randn(T, n_out, generator=gen).to(dtype).to(device) if with_residual else None
    out = ops.packed_linear(x, w, b, activation, r)
    expected = ref.packed_linear(x.cpu(), w.cpu(), None if b is None else b.cpu(), activation,
                                 None if r is None else r.cpu())
    assert out.dtype == dtype and out.shape == expected.shape
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", ["layer_norm", "layer_norm_no_bias", "rms_norm"])
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu_and_mul", "gelu_tanh_and_mul"])
# Up to 8 rows the norm runs in the op's own loop (its sums over 32, then 16, then single
# elements: K = 84 has all three), above through ATen (lanes and GEMM paths).
@pytest.mark.parametrize("T,K,N", [(0, 64, 96), (1, 64, 96), (2, 84, 40), (4, 100, 34),
                                   (8, 512, 130), (9, 64, 96), (40, 128, 70), (300, 48, 64)])
def test_packed_linear_input_norm(device, dtype, norm, activation, T, K, N):
    gen = torch.Generator().manual_seed(T * 11 + K)
    x = (3 * torch.randn(T, K, generator=gen) + 1).to(dtype).to(device)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype).to(device)
    gamma = (1 + torch.randn(K, generator=gen) / 4).to(dtype).to(device)
    beta = torch.randn(K, generator=gen).to(dtype).to(device) if norm == "layer_norm" else None
    n_out = N // 2 if activation in ops.GATED_ACTIVATIONS else N
    r = torch.randn(T, n_out, generator=gen).to(dtype).to(device)
    kind = "rms_norm" if norm == "rms_norm" else "layer_norm"
    out = ops.packed_linear(x, w, None, activation, r, kind, gamma, beta, 1e-5)
    cpu = [t.cpu() if t is not None else None for t in (x, gamma, beta)]
    normed = (ref.rms_norm(cpu[0], cpu[1], 1e-5) if kind == "rms_norm"
              else ref.layer_norm(*cpu, 1e-5))
    expected = ref.packed_linear(normed, w.cpu(), None, activation, r.cpu())
    assert out.dtype == dtype and out.shape == expected.shape
    assert_close(out, expected, dtype)


def test_packed_linear_noncontiguous_input(device):
    x = torch.randn(16, 64, device=device).t()  # [64, 16] non-contiguous
    w = torch.randn(32, 16, device=device)
    torch.testing.assert_close(ops.packed_linear(x, w, None, "relu"), torch.relu(x @ w.t()))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
def test_packed_linear_float32_gemm_runs_on_onednn(activation):
    x, w = torch.randn(40, 64), torch.randn(96, 64)
    with torch.profiler.profile() as prof:
        ops.packed_linear(x, w, None, activation)
    assert "mkldnn::_linear_pointwise" in {e.key for e in prof.key_averages()}


# ---------------------------------------------------------------------------- store_kv

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_store_kv(device, dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, H, D, T = 32, 2, 32, 20
    k_cache = torch.zeros(num_blocks, block_size, H, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    key, value = (torch.randn(T, H, D, generator=gen).to(dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[::5] = -1  # skipped tokens
    exp_k, exp_v = k_cache.clone(), v_cache.clone()
    ref.store_kv(key, value, exp_k, exp_v, slots)
    k_dev, v_dev = k_cache.to(device), v_cache.to(device)
    ops.store_kv(key.to(device), value.to(device), k_dev, v_dev, slots.to(device))
    assert torch.equal(k_dev.cpu(), exp_k) and torch.equal(v_dev.cpu(), exp_v)


def test_store_kv_strided_views(device):
    """K and V as views into a fused QKV output, as the model passes them."""
    qkv = torch.randn(5, 3, 2, 16, device=device)
    k_cache = torch.zeros(4, 2, 2, 16, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 3, 5, 6, 7], device=device)
    ops.store_kv(qkv[:, 1], qkv[:, 2], k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(8, 2, 16)[slots], qkv[:, 1])
    assert torch.equal(v_cache.view(8, 2, 16)[slots], qkv[:, 2])


# ---------------------------------------------------------------------------- ragged_attention

# (q_lens, context_lens): decode-only, fresh prefills, and prefills over earlier KV mixed
# with decodes (chunked prefill / multi-token continuation).
MIXES = {
    "decode": ([1, 1, 1, 1], [1, 17, 40, 130]),
    "prefill": ([5, 33, 1], [5, 33, 1]),
    "mixed": ([1, 40, 1, 9, 1], [70, 40, 3, 30, 257]),
}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("head_dim", [32, 40, 64, 80, 96, 128, 256])  # 40: the scalar path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_attention_grid(device, mix, block_size, heads, head_dim, dtype):
    """bfloat16 too: on CPUs with AVX512-BF16, prefill-like rows take the bf16 pair kernels."""
    q_lens, ctx = MIXES[mix]
    batch = random_ragged_batch(q_lens, ctx, *heads, head_dim, block_size, dtype=dtype,
                                device=device)
    out = ops.ragged_attention(*batch.args())
    expected = ref.ragged_attention(*(a.cpu() if torch.is_tensor(a) else a for a in batch.args()))
    assert out.shape == expected.shape
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_ragged_attention_dtypes(device, dtype, block_size):
    batch = random_ragged_batch(*MIXES["mixed"], 8, 2, 64, block_size, dtype=dtype, device=device)
    out = ops.ragged_attention(*batch.args())
    assert out.dtype == dtype
    expected = ref.ragged_attention(*(a.cpu() if torch.is_tensor(a) else a for a in batch.args()))
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens,ctx", [
    ([1], [3000]), ([700], [2100]), ([1, 1, 300], [2500, 9, 300]),
    ([1], [130]), ([1, 1, 1], [64, 129, 200]),
])
def test_ragged_attention_long_contexts_split(device, dtype, q_lens, ctx):
    """Long contexts go through the split-KV + log-sum-exp merge path (on CUDA, the
    tensor-core kernels split; they run for bfloat16); on CPU so do decodes of a few short
    requests (from 64 positions), to give every thread a share of the KV."""
    batch = random_ragged_batch(q_lens, ctx, 4, 1, 64, 16, dtype=dtype, device=device)
    out = ops.ragged_attention(*batch.args())
    expected = ref.ragged_attention(*(a.cpu() if torch.is_tensor(a) else a for a in batch.args()))
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_attention_wide_query_groups(device, dtype):
    """96 query heads on one KV head: a work item's rows exceed one 64-lane pass (CPU)."""
    batch = random_ragged_batch([3, 1, 2], [40, 70, 2], 96, 1, 32, 16, dtype=dtype, device=device)
    expected = ref.ragged_attention(*(a.cpu() if torch.is_tensor(a) else a for a in batch.args()))
    assert_close(ops.ragged_attention(*batch.args()), expected, dtype)


def test_ragged_attention_empty_and_zero_query_requests(device):
    empty = random_ragged_batch([0, 0], [4, 0], 4, 2, 32, 16, device=device)
    assert ops.ragged_attention(*empty.args()).shape == (0, 4, 32)
    batch = random_ragged_batch([0, 3, 0, 1], [5, 3, 0, 9], 4, 2, 32, 4, device=device)
    expected = ref.ragged_attention(*(a.cpu() if torch.is_tensor(a) else a for a in batch.args()))
    assert_close(ops.ragged_attention(*batch.args()), expected, torch.float32)


def test_ragged_attention_noncontiguous_q(device):
    batch = random_ragged_batch([3, 1], [3, 8], 4, 4, 32, 4, device=device)
    qkv = torch.cat([batch.q, batch.q], dim=1)  # q as a strided view, like a fused QKV split
    q_view = qkv[:, :4]
    out = ops.ragged_attention(q_view, *batch.args()[1:])
    torch.testing.assert_close(out, ops.ragged_attention(*batch.args()))


# ------------------------------------------------------------- ragged_attention's sliding window

# Decodes over long contexts (split KV ranges), a fresh prefill, and prefills over cached KV
# mixed with decodes; windows of 1 and 3 (a query sees itself and its last keys), windows that
# end inside the contexts, and 4096, longer than all of them.
WINDOW_MIXES = {
    "decode": ([1, 1, 1, 1], [1, 17, 600, 3000]),
    "prefill": ([150], [150]),
    "mixed": ([1, 40, 1, 130, 1], [70, 40, 3, 700, 2500]),
}
WINDOWS = [1, 3, 100, 512, 4096]


def attention_reference(batch, window):
    return ref.ragged_attention(*(a.cpu() if torch.is_tensor(a) else a for a in batch.args()),
                                window)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("mix", list(WINDOW_MIXES))
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])  # 40: the scalar path
@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_attention_window(device, dtype, head_dim, mix, window):
    batch = random_ragged_batch(*WINDOW_MIXES[mix], 8, 2, head_dim, 16, dtype=dtype,
                                device=device)
    out = ops.ragged_attention(*batch.args(), window)
    assert_close(out, attention_reference(batch, window), dtype)


@pytest.mark.parametrize("window", [1, 7, 64])
@pytest.mark.parametrize("block_size", [1, 64])
@pytest.mark.parametrize("heads", [(4, 4), (6, 1)])
def test_ragged_attention_window_layouts(device, window, block_size, heads):
    batch = random_ragged_batch(*WINDOW_MIXES["mixed"], *heads, 64, block_size, device=device)
    out = ops.ragged_attention(*batch.args(), window)
    assert_close(out, attention_reference(batch, window), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_attention_window_skips_unseen_kv(device, dtype):
    """KV before each request's first query's window is never read: NaNs there (a sliding
    window layer's cache past its window) leave every output finite and as without them."""
    q_lens, ctx, window = [1, 1, 300, 1], [4000, 90, 2100, 64], 200
    batch = random_ragged_batch(q_lens, ctx, 8, 2, 64, 16, dtype=dtype, device=device)
    expected = attention_reference(batch, window)
    block_size = batch.k_cache.shape[1]
    for r, (q_len, c) in enumerate(zip(q_lens, ctx)):
        first_seen = max(0, c - q_len - window + 1)
        for j in range(first_seen):
            block = batch.block_table[r, j // block_size]
            batch.k_cache[block, j % block_size] = float("nan")
            batch.v_cache[block, j % block_size] = float("nan")
    out = ops.ragged_attention(*batch.args(), window)
    assert out.isfinite().all()
    assert_close(out, expected, dtype)


def test_ragged_attention_window_past_contexts_is_none(device):
    """A window no context reaches hides nothing: window 0's result, bit for bit."""
    batch = random_ragged_batch(*WINDOW_MIXES["mixed"], 8, 2, 64, 16, dtype=torch.bfloat16,
                                device=device)
    assert torch.equal(ops.ragged_attention(*batch.args(), 2500),
                       ops.ragged_attention(*batch.args()))


# ------------------------------------------------ ragged_attention's CPU bfloat16 kernel paths

ATTENTION_ISAS = ["portable", "avx512bf16", "amx"]
# Prefill-like items (more than 8 query rows per KV head) of bfloat16 take the path
# ORCA_ATTENTION_ISA names: float lanes, bf16 pair dot products, or AMX tiles. Query lengths 1 to
# 600 (not multiples of 16: short AMX key and row tiles, tiles across the causal diagonal)
# mixed with decodes; chunks over a cached prefix (context > q_len: query positions start at
# context - q_len, tiles wholly before the diagonal); long contexts split into partials; long
# prefills (the AMX path's 128-row items).
ISA_MIXES = {
    "prefill": ([600], [600]),
    "short": ([2, 3, 9, 16, 31, 47], [2, 40, 9, 100, 31, 47]),
    "chunked": ([77, 1, 130, 1], [300, 45, 130, 1000]),
    "mixed": ([1, 33, 1, 250, 17, 1], [90, 33, 7, 517, 200, 64]),
    "split": ([1, 400], [3000, 2100]),
    # From 1024 queries the AMX path's items take up to 128 rows (wider row tiles).
    "long": ([1100, 1, 5], [1300, 50, 5]),
}


@pytest.fixture(params=ATTENTION_ISAS)
def attention_isa(request, force_isa) -> str:
    if request.param not in _C.attention_isas():
        pytest.skip(f"this build or CPU does not run the {request.param} attention path")
    force_isa("attention", request.param)
    return request.param


def check_attention_bf16(q_lens, ctx, heads, head_dim, block_size):
    batch = random_ragged_batch(q_lens, ctx, *heads, head_dim, block_size, dtype=torch.bfloat16)
    out = ops.ragged_attention(*batch.args())
    assert_close(out, ref.ragged_attention(*batch.args()), torch.bfloat16)


@pytest.mark.parametrize("mix", list(ISA_MIXES))
@pytest.mark.parametrize("block_size", [1, 16, 64])
# GQA as SmolLM2's 9 query heads on 3 KV heads, and a whole 8-head group on one.
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
def test_ragged_attention_isa_grid(attention_isa, mix, block_size, heads):
    check_attention_bf16(*ISA_MIXES[mix], heads, 64, block_size)


# 32, 64, 96, 128, 256: AMX tiles (K steps of 32 dims); 80: the bf16 pair kernels under amx.
@pytest.mark.parametrize("head_dim", [32, 80, 96, 128, 256])
@pytest.mark.parametrize("mix", ["chunked", "mixed"])
def test_ragged_attention_isa_head_dims(attention_isa, head_dim, mix):
    check_attention_bf16(*ISA_MIXES[mix], (9, 3), head_dim, 16)


# Windows inside a KV tile (1, 3), across tiles and splits (100, 512), past the contexts (4096).
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("mix", ["short", "chunked", "mixed", "split", "long"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_ragged_attention_isa_window(attention_isa, window, mix, head_dim):
    batch = random_ragged_batch(*ISA_MIXES[mix], 9, 3, head_dim, 16, dtype=torch.bfloat16)
    out = ops.ragged_attention(*batch.args(), window)
    assert_close(out, ref.ragged_attention(*batch.args(), window), torch.bfloat16)


def test_ragged_attention_isa_errors():
    with pytest.raises(ValueError, match="attention ISA must be one of 'portable', "
                                         "'avx512bf16', 'amx', got 'sse9'"):
        _C.set_isa("attention", "sse9")
    assert _C.attention_isas()[0] == "portable"
    for name in ATTENTION_ISAS:
        if name in _C.attention_isas():
            continue
        with pytest.raises(ValueError, match=f"attention ISA '{name}' is a path this build"):
            _C.set_isa("attention", name)


# ---------------------------------------------------------------------- plan_attention (CPU)

def plan_for(batch, window: int = 0) -> torch.Tensor:
    return ops.plan_attention(batch.q, batch.k_cache, batch.cu_q_lens, batch.context_lens,
                              batch.block_table, window)


@pytest.mark.parametrize("mix", list(ISA_MIXES))
@pytest.mark.parametrize("window", [0, 100])
def test_step_plan_gives_the_op_s_own_bits(attention_isa, mix, window):
    """One plan serves every layer of a step: the same items as a call's own plan, so the
    same bits, on each kernel path; and the layers' other tensors (q, the caches) may differ."""
    batch = random_ragged_batch(*ISA_MIXES[mix], 9, 3, 64, 16, dtype=torch.bfloat16)
    plan = plan_for(batch, window)
    for layer in range(2):
        q = batch.q if layer == 0 else torch.randn_like(batch.q)
        k, v = (batch.k_cache, batch.v_cache) if layer == 0 else (batch.v_cache, batch.k_cache)
        args = (q, k, v, *batch.args()[3:])
        assert torch.equal(ops.ragged_attention(*args, window, plan),
                           ops.ragged_attention(*args, window))
    assert_close(ops.ragged_attention(*batch.args(), window, plan),
                 ref.ragged_attention(*batch.args(), window), torch.bfloat16)


def test_step_plan_keeps_the_path_it_was_made_with(force_isa):
    """The kernel path is chosen when the step is planned, not by each layer's call."""
    batch = random_ragged_batch([300, 1], [300, 40], 8, 2, 64, 16, dtype=torch.bfloat16)
    force_isa("attention", "portable")
    plan = plan_for(batch)
    portable = ops.ragged_attention(*batch.args())
    force_isa("attention", _C.attention_isas()[-1])
    assert torch.equal(ops.ragged_attention(*batch.args(), plan=plan), portable)


def test_step_plan_checks_the_metadata_once():
    """plan_attention raises the op's own metadata errors, and the op refuses a plan made for
    other shapes, window, dtype or metadata values instead of reading out of bounds."""
    batch = random_ragged_batch([3, 1], [3, 20], 4, 2, 32, 4)
    bad_table = batch.block_table.clone()
    bad_table[1, 0] = 999
    with pytest.raises(RuntimeError, match=r"block_table\[1, 0\] = 999 is out of range"):
        ops.plan_attention(batch.q, batch.k_cache, batch.cu_q_lens, batch.context_lens,
                           bad_table)
    plan = plan_for(batch)
    longer = batch.context_lens.clone()
    longer[1] += 1
    other = random_ragged_batch([3, 1], [3, 20], 4, 2, 32, 4, dtype=torch.bfloat16)
    cases = [((*batch.args(), 5, plan), "plan was made for a window of 0 but this call has 5"),
             ((*batch.args()[:4], longer, *batch.args()[5:], 0, plan),
              "plan was made for other cu_q_lens / context_lens / block_table values"),
             ((*batch.args()[:5], bad_table, batch.scale, 0, plan),
              "plan was made for other cu_q_lens / context_lens / block_table values"),
             ((*other.args(), 0, plan), "plan was made for a q dtype"),
             ((batch.q[:3], *batch.args()[1:], 0, plan), "number of query tokens of 4 but"),
             ((*batch.args(), 0, plan.int()), "plan must be a step plan from plan_attention"),
             ((*batch.args(), 0, torch.zeros_like(plan)), "plan is not a step plan"),
             ((*batch.args(), 0, plan[:-1]), "plan is not a step plan")]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            ops.ragged_attention(*args)


# ---------------------------------------------------------------------------- rms_norm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 640), (3, 5, 256), (40, 100), (0, 32)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(device, dtype, shape, with_residual):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=gen) * 3).to(device, dtype)
    weight = torch.randn(shape[-1], generator=gen).to(device, dtype)
    residual = torch.randn(shape, generator=gen).to(device, dtype) if with_residual else None
    got = ops.rms_norm(x, weight, 1e-6, residual)
    want = ref.rms_norm(x, weight, 1e-6) + (0 if residual is None else residual.double())
    assert got.shape == x.shape and got.dtype == dtype
    assert_close(got, want, dtype)


def test_rms_norm_rows_do_not_depend_on_their_neighbours():
    """A row's result is the same alone or among others (what makes the per-op QK and post
    norms equal the fused stack's), and a strided view gives its contiguous copy's."""
    x, w = torch.randn(33, 3, 64), torch.randn(64)
    whole = ops.rms_norm(x, w, 1e-6)
    assert torch.equal(ops.rms_norm(x[5:6], w, 1e-6), whole[5:6])
    view = x[:, 1:]
    assert torch.equal(ops.rms_norm(view, w, 1e-6), ops.rms_norm(view.contiguous(), w, 1e-6))


def test_rms_norm_errors():
    x = torch.randn(3, 8)
    cases = [((x, torch.randn(7), 1e-6), "weight has 7 entries but x's last dimension is 8"),
             ((x, torch.randn(8).double(), 1e-6), "weight has dtype Double but x has dtype Float"),
             ((x.long(), torch.randn(8), 1e-6), "x must be float32, bfloat16 or float16"),
             ((x, torch.randn(8), -1.0), "eps must be finite and >= 0, got -1"),
             ((x, torch.randn(8), 1e-6, torch.randn(3, 7)),
              "residual must have x's shape [3, 8], got [3, 7]"),
             ((torch.tensor(1.0), torch.randn(1), 1e-6), "x must have at least one dimension")]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            ops.rms_norm(*args)


# ---------------------------------------------------------------------------- opcheck

def test_opcheck(device):
    batch = random_ragged_batch([3, 1], [3, 20], 4, 2, 32, 4, device=device)
    torch.library.opcheck(torch.ops.orca.ragged_attention.default, batch.args())
    torch.library.opcheck(torch.ops.orca.ragged_attention.default, (*batch.args(), 5))
    if device == "cpu":
        plan = plan_for(batch, 5)
        torch.library.opcheck(torch.ops.orca.ragged_attention.default, (*batch.args(), 5, plan))
        torch.library.opcheck(torch.ops.orca.plan_attention.default,
                              (batch.q, batch.k_cache, batch.cu_q_lens, batch.context_lens,
                               batch.block_table, 5))
    x = torch.randn(5, 16, device=device)
    for act, n in [("none", 8), ("gelu_tanh", 8), ("silu_and_mul", 16),
                   ("gelu_tanh_and_mul", 16)]:
        torch.library.opcheck(torch.ops.orca.packed_linear.default,
                              (x, torch.randn(n, 16, device=device), None, act))
    torch.library.opcheck(torch.ops.orca.packed_linear.default,
                          (x, torch.randn(8, 16, device=device), torch.randn(8, device=device),
                           "relu"))
    for n in (5, 40):  # the fused epilogue and the GEMM path
        torch.library.opcheck(torch.ops.orca.packed_linear.default,
                              (torch.randn(n, 16, device=device), torch.randn(8, 16, device=device),
                               None, "gelu_tanh", torch.randn(n, 8, device=device)))
        norm = torch.randn(16, device=device)
        torch.library.opcheck(torch.ops.orca.packed_linear.default,
                              (torch.randn(n, 16, device=device), torch.randn(8, 16, device=device),
                               None, "none", None, "layer_norm", norm, norm, 1e-5))
        torch.library.opcheck(torch.ops.orca.packed_linear.default,
                              (torch.randn(n, 16, device=device), torch.randn(8, 16, device=device),
                               None, "none", None, "rms_norm", norm, None, 1e-6))
    for residual in (None, torch.randn(5, 16, device=device)):
        torch.library.opcheck(torch.ops.orca.rms_norm.default,
                              (torch.randn(5, 16, device=device), torch.randn(16, device=device),
                               1e-6, residual))
    k_cache = torch.zeros(4, 4, 2, 32, device=device)
    torch.library.opcheck(torch.ops.orca.store_kv.default,
                          (torch.randn(3, 2, 32, device=device), torch.randn(3, 2, 32, device=device),
                           k_cache, k_cache.clone(), torch.tensor([0, 5, -1], device=device)))


def test_torch_compile_traces_ops():
    batch = random_ragged_batch([2, 1], [2, 6], 4, 2, 32, 4)

    def step(x, w, *attn_args):
        return ops.packed_linear(x, w, None, "gelu_tanh"), ops.ragged_attention(*attn_args)

    x, w = torch.randn(3, 16), torch.randn(8, 16)
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for got, want in zip(compiled(x, w, *batch.args()), step(x, w, *batch.args())):
        torch.testing.assert_close(got, want)
