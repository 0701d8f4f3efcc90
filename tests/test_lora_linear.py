"""torch.ops.orca.lora_linear: segmented LoRA shrink and expand against a float64 reference, on
every CPU ISA path (and CUDA where present), its errors, and opcheck."""
import pytest
import torch

import reference_ops as ref
from orca_ext import _C, ops
from orca_ext.testing import forced_isa

ISAS = ["portable", "avx2", "avx512"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=ISAS)
def isa(request, force_isa) -> str:
    if request.param not in _C.lora_isas():
        pytest.skip(f"this CPU does not run the {request.param} path")
    force_isa("lora", request.param)
    return request.param


def random_case(seg_lens: list[int], seg_slots: list[int], K: int, N: int, rank: int,
                num_slots: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    T = sum(seg_lens)
    x = torch.randn(T, K, generator=gen).to(dtype)
    y = torch.randn(T, N, generator=gen).to(dtype)
    a = torch.randn(num_slots, rank, K, generator=gen) / K ** 0.5
    b = torch.randn(num_slots, rank, N, generator=gen)
    scales = torch.rand(num_slots, generator=gen) + 0.5
    cu = torch.tensor([0, *torch.tensor(seg_lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor(seg_slots, dtype=torch.int32)
    return tuple(t.to(device) for t in (y, x, a, b, scales, cu, slots))


CASES = [  # (segment lengths, their slots, K, N, rank, slots)
    ([1], [0], 64, 96, 8, 1),
    ([3, 1, 2, 5], [1, -1, 0, 1], 576, 960, 16, 3),  # SmolLM2's qkv shapes, base rows between
    ([2, 0, 7], [2, 1, -1], 33, 17, 4, 3),  # tails under every vector width, an empty segment
    ([40, 1], [0, 0], 128, 1536, 48, 2),  # a prefill (GEMMs) and a decode of one adapter
    ([3, 20, 16, 2], [0, 1, -1, 1], 96, 80, 16, 2),  # prompts of two adapters and the base
    ([4], [-1], 32, 32, 8, 2),  # no adapter rows: y untouched
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_lora_linear_matches_reference(isa, case, dtype):
    y, x, a, b, scales, cu, slots = random_case(*case, dtype=dtype)
    expected = ref.lora_linear(y, x, a, b, scales, cu, slots)
    untouched = y.clone()
    ops.lora_linear(y, x, a, b, scales, cu, slots)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    scale = expected.abs().max().item() + 1
    assert (y.double() - expected).abs().max().item() <= tol * scale
    for s, slot in enumerate(slots.tolist()):
        if slot < 0:  # rows of the base model: bit for bit as they were
            rows = slice(int(cu[s]), int(cu[s + 1]))
            assert torch.equal(y[rows], untouched[rows])


def test_lora_linear_isas_agree_closely():
    y, x, a, b, scales, cu, slots = random_case([5, 3], [0, 1], 300, 200, 16, 2)
    expected = ref.lora_linear(y, x, a, b, scales, cu, slots)
    for name in _C.lora_isas():
        out = y.clone()
        with forced_isa("lora", name):
            ops.lora_linear(out, x, a, b, scales, cu, slots)
        assert torch.allclose(out.double(), expected, atol=1e-4, rtol=1e-5), name


def test_zero_padded_ranks_change_nothing():
    """An adapter of rank 4 in a slot of rank 16 (zero rows above) gives its rank-4 delta."""
    y, x, a, b, scales, cu, slots = random_case([3], [0], 64, 32, 4, 1)
    padded_a = torch.zeros(1, 16, 64)
    padded_b = torch.zeros(1, 16, 32)
    padded_a[:, :4], padded_b[:, :4] = a, b
    out, padded = y.clone(), y.clone()
    ops.lora_linear(out, x, a, b, scales, cu, slots)
    ops.lora_linear(padded, x, padded_a, padded_b, scales, cu, slots)
    assert torch.allclose(out, padded, atol=1e-6)


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# (argument, bad value, message); the good arguments are 3 segments of 7 rows, 2 slots.
BAD_ARGS = [
    ("cu_seg_lens", i32(0, 1, 5, 6), r"cu_seg_lens\[-1\] must equal the 7 rows"),
    ("cu_seg_lens", i32(0, 4, 3, 7), "must not decrease"),
    ("cu_seg_lens", i32(1, 2, 3, 7), r"cu_seg_lens\[0\]"),
    ("cu_seg_lens", torch.tensor([0, 1, 5, 7]), "cu_seg_lens must have dtype Int"),
    ("seg_slots", i32(0, 2, -1), r"seg_slots\[1\] = 2"),
    ("seg_slots", i32(0, -2, -1), r"seg_slots\[1\] = -2"),
    ("seg_slots", i32(0, 1), "one more entry"),
    ("lora_a", torch.zeros(2, 4, 9), "lora_a's last dim is 9"),
    ("lora_a", torch.zeros(2, 4, 16, dtype=torch.float64), "lora_a must have dtype"),
    ("lora_b", torch.zeros(2, 4, 9), "lora_b's last dim is 9"),
    ("lora_b", torch.zeros(2, 3, 8), "lora_b must be"),
    ("scales", torch.ones(3), "scales has 3 entries"),
    ("y", torch.zeros(7, 8, dtype=torch.bfloat16), "y has dtype"),
    ("y", torch.zeros(6, 8), "y has 6 rows"),
]
ARG_NAMES = ["y", "x", "lora_a", "lora_b", "scales", "cu_seg_lens", "seg_slots"]


@pytest.mark.parametrize("name,value,message", BAD_ARGS)
def test_lora_linear_errors_name_the_bad_value(name, value, message):
    args = list(random_case([1, 4, 2], [0, 1, -1], 16, 8, 4, 2))
    args[ARG_NAMES.index(name)] = value
    with pytest.raises(RuntimeError, match=message):
        ops.lora_linear(*args)


def test_opcheck():
    for seg_lens, seg_slots in (([2, 3], [1, -1]), ([1], [0]), ([3, 1], [-1, -1])):
        args = random_case(seg_lens, seg_slots, 16, 24, 4, 2)
        torch.library.opcheck(torch.ops.orca.lora_linear.default, args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_lora_linear_cuda(case, dtype):
    y, x, a, b, scales, cu, slots = random_case(*case, dtype=dtype, device="cuda")
    expected = ref.lora_linear(y.cpu(), x.cpu(), a.cpu(), b.cpu(), scales.cpu(), cu.cpu(),
                               slots.cpu())
    ops.lora_linear(y, x, a, b, scales, cu, slots)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert (y.cpu().double() - expected).abs().max().item() <= tol * (expected.abs().max() + 1)
