"""Pure-torch references of the orca ops: explicit per-request loops, float64 math."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  activation: str, residual: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ weight.double().t()
    if bias is not None:
        y = y + bias.double()
    if activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    elif activation == "relu":
        y = torch.relu(y)
    elif activation == "silu_and_mul":
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    elif activation == "gelu_tanh_and_mul":
        gate, up = y.chunk(2, dim=-1)
        y = F.gelu(gate, approximate="tanh") * up
    return y if residual is None else y + residual.double()


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    return F.layer_norm(x.double(), (x.shape[-1],), weight.double(),
                        None if bias is None else bias.double(), eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return weight.double() * h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            flat_k[slot] = key[t]
            flat_v[slot] = value[t]


def gather_kv(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of one request's KV, ``[length, Hkv, D]``."""
    block_size = cache.shape[1]
    pos = torch.arange(length)
    slots = block_row.long()[pos // block_size] * block_size + pos % block_size
    return cache.reshape(-1, *cache.shape[2:])[slots]


def ragged_attention(q, k_cache, v_cache, cu_q_lens, context_lens, block_table,
                     scale: float, window: int = 0) -> torch.Tensor:
    """Query ``i`` of a request sees the keys ``j`` with ``pos - window < j <= pos`` (all
    ``j <= pos`` for ``window = 0``), ``pos = context_len - q_len + i``."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    cu = cu_q_lens.tolist()
    for r, ctx in enumerate(context_lens.tolist()):
        q_r = q[cu[r]:cu[r + 1]].double()
        q_len = q_r.shape[0]
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_table[r], ctx).double().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_table[r], ctx).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_r, k) * scale
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        hidden = k_pos > q_pos
        if window > 0:
            hidden |= k_pos <= q_pos - window
        scores.masked_fill_(hidden, -math.inf)
        out[cu[r]:cu[r + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def hadamard_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(H' x, 1 / sqrt(b)) for rows ``x [..., D]``: the Walsh-Hadamard transform of entries +-1
    over blocks of b values (the largest power of two dividing D), as butterflies of sums and
    differences in x's dtype, in the kernels' order; times 1 / sqrt(b) it is orthonormal and its
    own inverse."""
    D = x.shape[-1]
    b = D & -D
    y, h = x, 1
    while h < b:
        y = y.reshape(*x.shape[:-1], D // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return y.reshape(x.shape), 1 / torch.tensor(float(b), dtype=x.dtype).sqrt()


def quantize_kv_int8(x: torch.Tensor, keys: bool = False) -> torch.Tensor:
    """Rows ``x [..., D]`` as an int8 KV cache stores them, ``[..., D + 4]``: for ``y = x``
    (values) or ``y = H' x`` (keys, whose scale is then times 1 / sqrt(b)), ``round(y / s)``
    (nearest even) then the float32 scale ``s = max |y| / 127`` as its 4 bytes."""
    y, norm = hadamard_rows(x.float()) if keys else (x.float(), torch.tensor(1.0))
    scale = y.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(y / scale), torch.zeros_like(y)).clamp(-127, 127)
    return torch.cat([q.to(torch.int8), (scale * norm).contiguous().view(torch.int8)], dim=-1)


def dequantize_kv_int8(rows: torch.Tensor, keys: bool = False) -> torch.Tensor:
    """An int8 KV cache's rows ``[..., D + 4]`` as float64 values ``[..., D]`` (keys rotated
    back by H)."""
    scale = rows[..., -4:].contiguous().view(torch.float32).double()
    y = rows[..., :-4].double() * scale
    if not keys:
        return y
    rotated, norm = hadamard_rows(y)
    return rotated * norm


def lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                scales: torch.Tensor, cu_seg_lens: torch.Tensor,
                seg_slots: torch.Tensor) -> torch.Tensor:
    """float64 ``y`` plus, per segment with a slot, ``scale * (x @ A^T) @ B^T`` (``lora_b`` is
    B transposed)."""
    out = y.double().clone()
    for s, slot in enumerate(seg_slots.tolist()):
        if slot < 0:
            continue
        rows = slice(int(cu_seg_lens[s]), int(cu_seg_lens[s + 1]))
        out[rows] += scales[slot].double() * (x[rows].double() @ lora_a[slot].double().t()) \
            @ lora_b[slot].double()
    return out
