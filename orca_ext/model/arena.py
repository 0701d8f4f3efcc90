"""CPU buffers advised for transparent huge pages: a model's parameters in one of them, and the
KV cache.

A decode step streams every weight (and each request's KV) once. On 4 KB pages such a read
misses the TLB every 4 KB; from one 2 MB-aligned huge-page buffer, with the weights laid out in
the order the forward pass reads them, it misses once per 2 MB, which makes a small-batch decode
step markedly faster (bench/model.py measures it).
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import torch
from torch import nn

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux <sys/mman.h>


def allocate_in_arena(module: nn.Module) -> None:
    """Point each parameter of ``module`` (a tied one once) at its own slice of one new buffer,
    in registration order; values are not copied, so call it before loading weights."""
    params = list(dict.fromkeys(module.parameters()))
    if not params or any(p.device.type != "cpu" for p in params):
        return
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.nbytes // 64) * 64  # each tensor starts on a cache line
    buffer = huge_page_empty(total)
    for p, offset in zip(params, offsets):
        p.data = buffer[offset:offset + p.nbytes].view(p.dtype).view(p.shape)


def huge_page_empty(nbytes: int) -> torch.Tensor:
    """An uninitialized CPU uint8 tensor of ``nbytes``, 2 MB-aligned and advised for huge pages
    (before anything touches it, so the kernel backs it with them where it can)."""
    buffer = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = -buffer.data_ptr() % _HUGE_PAGE
    _advise_huge_pages(buffer.data_ptr() + start, nbytes)
    return buffer[start:start + nbytes]


def huge_page_zeros(nbytes: int) -> torch.Tensor:
    """A zeroed CPU uint8 tensor of ``nbytes``, 2 MB-aligned and advised for huge pages: an
    anonymous mapping, whose pages the kernel hands out zeroed on first touch, so making it costs
    no time and only the parts written take memory (a KV cache's blocks as requests fill them)."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # not a POSIX system: zeroed up front
        return huge_page_empty(nbytes).zero_()
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    start = -buffer.data_ptr() % _HUGE_PAGE
    _advise_huge_pages(buffer.data_ptr() + start, nbytes)
    return buffer[start:start + nbytes]


def _advise_huge_pages(address: int, length: int) -> None:
    """A hint before the pages are touched; where it is unsupported the buffer works as is."""
    if not sys.platform.startswith("linux"):
        return
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise(address, length, _MADV_HUGEPAGE)
