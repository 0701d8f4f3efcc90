"""The KV cache's default size (what the batch can use, capped by memory), an explicit size the
machine cannot hold, and ``dtype="auto"``."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from orca_ext import LLM
from orca_ext.kv import cache as kv_cache
from orca_ext.kv.cache import (DEFAULT_KV_CAP_BYTES, kv_bytes_per_block,
                                        plan_kv_blocks)
from orca_ext.model import ModelConfig, load_model
from orca_ext.model import dtypes
from orca_ext.model.builtin import BUILTIN_MODELS

GIB = 2**30
# SmolLM2-135M's shape: 30 layers x 3 KV heads x 64, so 46 KB of float32 KV a token.
SMOLLM2 = ModelConfig.from_hf({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "intermediate_size": 1536, "max_position_embeddings": 8192})


def _with_memory(monkeypatch, available: int | None) -> None:
    monkeypatch.setattr(kv_cache, "available_memory", lambda device="cpu": available)


def test_default_is_what_the_batch_can_use_when_it_fits(monkeypatch):
    _with_memory(monkeypatch, 64 * GIB)
    blocks, why = plan_kv_blocks(SMOLLM2, 16, torch.float32, "cpu", 4, 2048)
    assert blocks * 16 == 4 * 2048
    assert "max_batch_size x context" in why


def test_default_is_capped_at_4_gib(monkeypatch):
    """40 full 8192-token float32 contexts would take 15 GB; 64, 24 GB (OOM-killed before)."""
    _with_memory(monkeypatch, 64 * GIB)
    per_block = kv_bytes_per_block(SMOLLM2, 16, torch.float32)
    for batch in (40, 64):
        blocks, why = plan_kv_blocks(SMOLLM2, 16, torch.float32, "cpu", batch, 8192)
        assert blocks == DEFAULT_KV_CAP_BYTES // per_block
        assert "default cap of 4.00 GiB" in why and "set kv_cache_tokens" in why


def test_default_is_capped_at_half_the_available_memory(monkeypatch):
    _with_memory(monkeypatch, 2 * GIB)
    blocks, why = plan_kv_blocks(SMOLLM2, 16, torch.float32, "cpu", 32, 8192)
    assert blocks == GIB // kv_bytes_per_block(SMOLLM2, 16, torch.float32)
    assert "50% of the 2.00 GiB available" in why
    # Caches of several workers on this machine share the same cap.
    shared, _ = plan_kv_blocks(SMOLLM2, 16, torch.float32, "cpu", 32, 8192,
                               caches_on_this_machine=4)
    assert shared == blocks // 4


def test_explicit_size_over_the_available_memory_is_an_error_naming_the_numbers(monkeypatch):
    _with_memory(monkeypatch, 1 * GIB)
    with pytest.raises(ValueError, match=r"65536 tokens, 2\.81 GiB.*1\.00 GiB of memory "
                                         r"available"):
        plan_kv_blocks(SMOLLM2, 16, torch.float32, "cpu", 1, 8192, kv_cache_tokens=65536)
    with pytest.raises(ValueError, match="more than the 1.00 GiB"):
        plan_kv_blocks(SMOLLM2, 16, torch.float32, "cpu", 1, 8192, kv_cache_memory=3 * GIB)
    assert plan_kv_blocks(SMOLLM2, 16, torch.float32, "cpu", 1, 8192,
                          kv_cache_tokens=4096) == (256, "as asked")


def test_the_engine_raises_before_allocating_and_logs_its_choice(monkeypatch, caplog):
    loaded = load_model("orca-tiny")
    _with_memory(monkeypatch, 1 * GIB)
    with pytest.raises(ValueError, match="more than the 1.00 GiB"):
        LLM(loaded, kv_cache_memory=2 * GIB)
    with caplog.at_level(logging.INFO, logger="orca_ext.build"):
        LLM(loaded, max_batch_size=2)
    tokens = 2 * BUILTIN_MODELS["orca-tiny"]["n_positions"]
    assert any(f"= {tokens} tokens" in r.getMessage() and "max_batch_size x context"
               in r.getMessage() for r in caplog.records)


def test_the_real_machine_reports_its_memory():
    available = kv_cache.available_memory("cpu")
    assert available is not None and available > 0


@pytest.mark.parametrize("native_bf16, expected", [(True, torch.bfloat16),
                                                   (False, torch.float32)])
def test_auto_dtype_follows_the_cpu(monkeypatch, native_bf16, expected):
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: native_bf16)
    assert dtypes.resolve_dtype("auto", "cpu") == expected
    assert load_model("orca-tiny", "auto").dtype == expected


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_a_cpu_kv_cache_is_zero_and_takes_memory_only_where_written():
    """The cache is an anonymous mapping: making 1 GiB of it takes no memory (and no time to
    zero it), every value reads 0, and memory grows only by the blocks written."""
    config = SMOLLM2
    block_bytes = kv_bytes_per_block(config, 16, torch.float32)
    num_blocks = -(-(1 << 30) // block_bytes)
    before = _resident_bytes()
    cache = kv_cache.KVCache(config, num_blocks, 16, torch.float32)
    assert cache.storage.nbytes >= 1 << 30
    assert _resident_bytes() - before < 64 << 20
    k, v = cache[0]
    assert k.data_ptr() % (2 << 20) == 0
    assert not k[-1].any() and not v[num_blocks // 2].any()
    k[:8].fill_(1.0)
    assert k[:8].eq(1.0).all() and not k[8:16].any()
    assert _resident_bytes() - before < 128 << 20
