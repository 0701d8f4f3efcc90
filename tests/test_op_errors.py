"""Bad inputs give a RuntimeError whose message names the argument, never a crash."""
import re

import pytest
import torch

from orca_ext import ops
from orca_ext.testing import random_ragged_batch


def attention_args(**overrides):
    batch = random_ragged_batch([2, 1], [2, 9], 4, 2, 32, 4)
    args = dict(q=batch.q, k_cache=batch.k_cache, v_cache=batch.v_cache, cu_q_lens=batch.cu_q_lens,
                context_lens=batch.context_lens, block_table=batch.block_table, scale=batch.scale)
    args.update(overrides)
    return args


def int32(*values):
    return torch.tensor(values, dtype=torch.int32)


ATTENTION_CASES = {
    "q wrong dtype": (lambda a: dict(q=a["q"].double()), "q must be float32, bfloat16 or float16"),
    "cache dtype mismatch": (lambda a: dict(k_cache=a["k_cache"].half()), "k_cache has dtype"),
    "q 2-D": (lambda a: dict(q=a["q"][:, 0]), "q must be 3-D"),
    "heads not a multiple": (lambda a: dict(q=torch.randn(3, 3, 32)), "not a multiple of the cache's 2 KV heads"),
    "head_dim mismatch": (lambda a: dict(q=torch.randn(3, 4, 16)), "k_cache head_dim 32 must equal q head_dim 16"),
    "v_cache shape": (lambda a: dict(v_cache=a["v_cache"][:-1]), "v_cache shape"),
    "cu_q_lens dtype": (lambda a: dict(cu_q_lens=a["cu_q_lens"].long()), "cu_q_lens must have dtype Int"),
    "cu_q_lens length": (lambda a: dict(cu_q_lens=int32(0, 3)), "cu_q_lens must have B+1 = 3"),
    "cu_q_lens not monotone": (lambda a: dict(cu_q_lens=int32(0, 3, 2), q=torch.randn(2, 4, 32),
                                             context_lens=int32(5, 9)),
                               "cu_q_lens must be non-decreasing"),
    "cu_q_lens start": (lambda a: dict(cu_q_lens=int32(1, 2, 3)), "cu_q_lens[0] must be 0"),
    "cu_q_lens total": (lambda a: dict(cu_q_lens=int32(0, 1, 2)), "must equal the number of query tokens T = 3"),
    "context shorter than query": (lambda a: dict(context_lens=int32(1, 9)),
                                   "context_lens[0] = 1 is smaller than request 0's query length 2"),
    "block id out of range": (lambda a: dict(block_table=a["block_table"].clone().fill_(99)),
                              "block_table[0, 0] = 99 is out of range"),
    "negative block id": (lambda a: dict(block_table=a["block_table"].clone().fill_(-1)),
                          "block_table[0, 0] = -1 is out of range"),
    "too few block columns": (lambda a: dict(block_table=a["block_table"][:, :1].contiguous()),
                              "needs 3 blocks of 4 but block_table has 1 columns"),
    "block_table rows": (lambda a: dict(block_table=a["block_table"][:1]), "block_table must have B = 2 rows"),
    "bad scale": (lambda a: dict(scale=float("nan")), "scale must be a finite positive number"),
    "negative window": (lambda a: dict(window=-3), "window must be >= 0 (0: no sliding window), got -3"),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_ragged_attention_errors(case):
    make, message = ATTENTION_CASES[case]
    args = attention_args()
    args.update(make(args))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.ragged_attention(**args)


def test_store_kv_errors():
    cache = torch.zeros(2, 4, 2, 8)
    key = torch.randn(3, 2, 8)
    slots = torch.tensor([0, 1, 2])
    cases = [
        (dict(slot_mapping=torch.tensor([0, 1, 8])), r"slot_mapping\[2\] = 8 is out of range for a cache of 8 slots"),
        (dict(slot_mapping=slots.int()), "slot_mapping must have dtype Long"),
        (dict(slot_mapping=slots[:2]), "slot_mapping has 2 entries but key has T = 3"),
        (dict(key=torch.randn(3, 3, 8), value=torch.randn(3, 3, 8)), "but the cache holds"),
        (dict(value=torch.randn(3, 2, 4)), "value shape"),
        (dict(key=key.half(), value=key.half()), "key has dtype Half but k_cache has dtype Float"),
        (dict(v_cache=torch.zeros(1, 4, 2, 8)), "v_cache shape"),
    ]
    for override, message in cases:
        args = dict(key=key, value=key.clone(), k_cache=cache, v_cache=cache.clone(), slot_mapping=slots)
        args.update(override)
        with pytest.raises(RuntimeError, match=message):
            ops.store_kv(**args)


def test_fp8_kv_cache_on_cpu_is_refused():
    """An fp8 e4m3 cache runs on CUDA only: the CPU ops (and the fused stack's checks) name it."""
    batch = random_ragged_batch([1, 2], [5, 9], 4, 2, 16, 4)
    k8, v8 = batch.k_cache.to(torch.float8_e4m3fn), batch.v_cache.to(torch.float8_e4m3fn)
    message = "k_cache is an fp8_e4m3 KV cache, which runs on CUDA only; got one on cpu"
    with pytest.raises(RuntimeError, match=message):
        ops.ragged_attention(batch.q, k8, v8, *batch.args()[3:])
    with pytest.raises(RuntimeError, match=message):
        ops.store_kv(batch.q[:, :2], batch.q[:, :2], k8, v8, torch.tensor([0, 1, 2]))


def test_packed_linear_errors():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    cases = [
        ((x, torch.randn(6, 7), None, "none"), r"weight.size\(1\) must equal x.size\(1\)"),
        ((x, w, None, "swish"), "activation must be one of 'none', 'gelu_tanh', 'relu', "
                                "'silu_and_mul', 'gelu_tanh_and_mul', got 'swish'"),
        ((x, torch.randn(5, 8), None, "silu_and_mul"), "silu_and_mul needs weight"),
        ((x, torch.randn(5, 8), None, "gelu_tanh_and_mul"), "gelu_tanh_and_mul needs weight"),
        ((x, w, torch.randn(5), "none"), "bias has 5 entries but weight has N = 6"),
        ((x.int(), w, None, "none"), "x must be float32, bfloat16 or float16"),
        ((x, w.half(), None, "relu"), "weight has dtype Half but x has dtype Float"),
        ((x[0], w, None, "none"), "x must be 2-D"),
        ((x, w, None, "none", torch.randn(4, 5)),
         r"residual must be the output's shape \[4, 6\], got shape \[4, 5\]"),
        ((x, w, None, "silu_and_mul", torch.randn(4, 6)),
         r"residual must be the output's shape \[4, 3\]"),
        ((x, w, None, "none", torch.randn(4, 6).double()),
         "residual has dtype Double but x has dtype Float"),
        ((x, w, None, "none", None, "batch_norm", torch.randn(8)),
         "norm must be one of 'none', 'layer_norm', 'rms_norm', got 'batch_norm'"),
        ((x, w, None, "none", None, "layer_norm"), r"norm needs norm_weight \[K\]"),
        ((x, w, None, "none", None, "none", torch.randn(8)),
         "norm_weight / norm_bias are given but norm is 'none'"),
        ((x, w, None, "none", None, "rms_norm", torch.randn(8), torch.randn(8)),
         "rms_norm takes no norm_bias"),
        ((x, w, None, "none", None, "layer_norm", torch.randn(7)),
         "norm_weight has 7 entries but x has K = 8 columns"),
        ((x, w, None, "none", None, "layer_norm", torch.randn(8), torch.randn(8).half()),
         "norm_bias has dtype Half but x has dtype Float"),
        ((x, w, None, "none", None, "rms_norm", torch.randn(8), None, -1.0),
         "norm_eps must be finite and >= 0, got -1"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.packed_linear(*args)
