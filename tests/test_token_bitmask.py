"""torch.ops.orca.apply_token_bitmask against a reference built from numpy's bit unpacking (bit
t % 32 of word t // 32, little-endian as llguidance and xgrammar write it)."""
import numpy as np
import pytest
import torch

from orca_ext import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(logits: torch.Tensor, bitmask: torch.Tensor,
              indices: torch.Tensor | None) -> torch.Tensor:
    out = logits.clone().cpu()
    vocab = out.shape[1]
    bits = np.unpackbits(bitmask.cpu().numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, :vocab].astype(bool))
    rows = range(bitmask.shape[0]) if indices is None else indices.tolist()
    for i, row in enumerate(rows):
        out[row][~allowed[i]] = float("-inf")
    return out


def random_bitmask(masks: int, vocab: int, density: float, gen: torch.Generator,
                   words: int | None = None) -> torch.Tensor:
    words = words or (vocab + 31) // 32
    bits = (torch.rand(masks, words * 32, generator=gen) < density).numpy()
    packed = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    mask = torch.from_numpy(packed.copy())
    mask[:, ::7] = -1  # whole words allowed (the kernels skip them)
    return mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 49152])
@pytest.mark.parametrize("with_indices", [False, True])
def test_matches_reference(device, dtype, vocab, with_indices):
    gen = torch.Generator().manual_seed(vocab)
    batch = 5
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    indices = torch.tensor([3, 0, 4]) if with_indices else None
    masks = 3 if with_indices else batch
    bitmask = random_bitmask(masks, vocab, 0.3, gen)
    expected = reference(logits, bitmask, indices)
    actual = logits.to(device)
    ops.apply_token_bitmask(actual, bitmask.to(device),
                            None if indices is None else indices.to(device))
    assert torch.equal(actual.cpu(), expected)


def test_wider_bitmask_and_strided_rows(device):
    """Words past the vocabulary are ignored; a row-strided view is masked in place."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4, 150, generator=gen)
    bitmask = random_bitmask(2, 100, 0.5, gen, words=8)
    indices = torch.tensor([1, 3])
    expected = base.clone()
    expected[:, :100] = reference(base[:, :100], bitmask, indices)
    actual = base.to(device)
    ops.apply_token_bitmask(actual[:, :100], bitmask.to(device), indices.to(device))
    assert torch.equal(actual.cpu(), expected)


def test_empty_and_all_allowed(device):
    logits = torch.randn(3, 70, device=device)
    before = logits.clone()
    ops.apply_token_bitmask(logits, torch.empty(0, 3, dtype=torch.int32, device=device),
                            torch.empty(0, dtype=torch.int64, device=device))
    ops.apply_token_bitmask(logits, torch.full((3, 3), -1, dtype=torch.int32, device=device))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("call,message", [
    (lambda x, m: ops.apply_token_bitmask(x, m.long()), "bitmask must have dtype Int"),
    (lambda x, m: ops.apply_token_bitmask(x, m[:, :1].contiguous()), "needs at least 2"),
    (lambda x, m: ops.apply_token_bitmask(x, m[:1]), "without indices they must match"),
    (lambda x, m: ops.apply_token_bitmask(x.int(), m), "logits must be float32"),
    (lambda x, m: ops.apply_token_bitmask(x, m, torch.tensor([0])), "indices has 1 rows"),
    (lambda x, m: ops.apply_token_bitmask(x, m, torch.tensor([0, 2])), "outside logits' 2 rows"),
    (lambda x, m: ops.apply_token_bitmask(x[0], m), "logits must be 2-D"),
])
def test_errors_name_the_argument(call, message):
    logits, bitmask = torch.zeros(2, 40), torch.full((2, 2), -1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=message):
        call(logits, bitmask)


def test_opcheck(device):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 100, generator=gen).to(device)
    bitmask = random_bitmask(2, 100, 0.5, gen).to(device)
    torch.library.opcheck(torch.ops.orca.apply_token_bitmask.default,
                          (logits, bitmask, torch.tensor([2, 0], device=device)))
    torch.library.opcheck(torch.ops.orca.apply_token_bitmask.default,
                          (logits[:2].clone(), bitmask))
