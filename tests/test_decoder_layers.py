"""The fused ``decoder_layers`` op against the models' own per-op blocks, and its errors."""
from __future__ import annotations

import re

import pytest
import torch

from orca_ext import ops
from orca_ext.executor import KVCache
from orca_ext.executor.fused import fused_forward
from orca_ext.kv import SlotAllocator
from orca_ext.model import load_model
from orca_ext.model.gpt2 import GPT2
from orca_ext.model.layers import AttentionMetadata, Linear
from tiny_models import SPECS, VOCAB, make_hf_model, save_hf_model

BLOCK_SIZE = 4
# (tokens already in the cache, tokens this iteration) per request: decodes at batch 1 / 4 / 8
# (one parallel region), a mixed batch of 8 tokens, and prefills beyond 8 (op by op).
BATCHES = {
    "decode_1": [(9, 1)],
    "decode_4": [(3, 1), (17, 1), (0, 1), (30, 1)],
    "decode_8": [(i * 5, 1) for i in range(8)],
    "mixed_8": [(0, 5), (12, 1), (7, 2)],
    "prefill_21": [(0, 13), (6, 1), (2, 7)],
}


@pytest.fixture(scope="module", params=list(SPECS))
def model_folder(request, tmp_path_factory):
    return save_hf_model(make_hf_model(request.param), tmp_path_factory.mktemp(request.param))


def run_both(loaded, batch: list[tuple[int, int]], seed: int = 0):
    """(hidden states, caches) from the model's own forward and from the fused one, each from
    the same random caches and inputs."""
    gen = torch.Generator().manual_seed(seed)
    blocks = sum(-(-(done + n) // BLOCK_SIZE) for done, n in batch) + 2
    allocator = SlotAllocator(blocks, BLOCK_SIZE)
    for r, (done, n) in enumerate(batch):
        allocator.allocate(r, done + n)
    *meta_args, positions = allocator.build_metadata(list(range(len(batch))),
                                                     [done for done, _ in batch],
                                                     [n for _, n in batch])
    meta = AttentionMetadata(*meta_args)
    input_ids = torch.randint(0, VOCAB, (positions.numel(),), generator=gen)
    cache = KVCache(loaded.config, blocks, BLOCK_SIZE, loaded.dtype)
    for k, v in cache:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    results = []
    for forward in (loaded.model, fused_forward(loaded.model)):
        caches = [(k.clone(), v.clone()) for k, v in cache]
        with torch.inference_mode():
            hidden = forward(input_ids, positions, caches, meta)
        results.append((hidden, caches))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_fused_blocks_match_the_models_blocks(model_folder, batch, dtype):
    """Same kernels, same work split, same rounding: the fused stack gives the per-op blocks'
    hidden states and KV caches bit for bit (GPT-2; Llama with GQA, llama3 rope, biases; Qwen2;
    Mistral's head_dim), in one parallel region (<= 8 tokens) and op by op (more)."""
    loaded = load_model(str(model_folder), dtype=dtype)
    (want, want_caches), (got, got_caches) = run_both(loaded, BATCHES[batch])
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)
    for (k_want, v_want), (k_got, v_got) in zip(want_caches, got_caches):
        assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)


def test_fused_forward_applies_to_plain_models_only(model_folder):
    loaded = load_model(str(model_folder))
    assert fused_forward(loaded.model) is not None
    model = loaded.model

    class Subclass(type(model)):
        pass

    model.__class__ = Subclass  # e.g. a wrapper that changes forward
    assert fused_forward(model) is None
    model.__class__ = Subclass.__bases__[0]

    class ShardedLinear(Linear):
        pass

    original = model.layers[-1].mlp
    linear = next(m for m in original.modules() if isinstance(m, Linear))
    linear.__class__ = ShardedLinear  # e.g. the tensor-parallel wrappers
    assert fused_forward(model) is None
    linear.__class__ = Linear


def small_stack(num_layers: int = 1, tokens: int = 3) -> dict:
    """decoder_layers' arguments for a GPT-2-shaped stack (hidden 32, 2 heads), one decode per
    token."""
    hidden, heads, head_dim = 32, 2, 16
    torch.manual_seed(0)
    w = []
    for _ in range(num_layers):
        w += [torch.randn(3 * hidden, hidden), torch.randn(hidden, hidden),
              torch.randn(4 * hidden, hidden), torch.randn(hidden, 4 * hidden)]
    return dict(
        x=torch.randn(tokens, hidden),
        norm_weights=[torch.rand(hidden) for _ in range(2 * num_layers)],
        norm_biases=[torch.randn(hidden) for _ in range(2 * num_layers)], weights=w,
        biases=([], [], [], []),
        k_caches=[torch.randn(8, 4, heads, head_dim) for _ in range(num_layers)],
        v_caches=[torch.randn(8, 4, heads, head_dim) for _ in range(num_layers)],
        cu_q_lens=torch.arange(tokens + 1, dtype=torch.int32),
        context_lens=torch.full((tokens,), 5, dtype=torch.int32),
        block_table=torch.arange(2 * tokens, dtype=torch.int32).view(tokens, 2),
        slot_mapping=torch.arange(tokens, dtype=torch.int64) * 8 + 4, rotary_cos=None,
        rotary_sin=None, norm="layer_norm", norm_eps=1e-5, activation="gelu_tanh",
        num_heads=heads, num_kv_heads=heads, scales=[0.25] * num_layers)


def test_opcheck():
    args = small_stack()
    biases = args.pop("biases")
    values = list(args.values())
    values[4:4] = biases
    torch.library.opcheck(torch.ops.orca.decoder_layers.default, tuple(values))


@pytest.mark.parametrize("change,message", [
    (dict(weights=[]), "weights must hold 4 entries per layer (4 for the 1 layers"),
    (dict(scales=[]), "scales must hold 1 entries per layer"),
    (dict(biases=([torch.zeros(96)] * 2, [], [], [])), "qkv_biases (or empty) must hold 1"),
    (dict(norm="none"), "decoder_layers needs a norm"),
    (dict(norm="batch_norm"), "norm must be one of"),
    (dict(activation="swish"), "activation must be one of"),
    (dict(num_kv_heads=3), "num_heads (2) must be a positive multiple of num_kv_heads (3)"),
    (dict(scales=[-1.0]), "scale must be a finite positive number, got -1"),
    (dict(rotary_cos=torch.ones(3, 8)), "rotary_cos and rotary_sin must be given together"),
    (dict(rotary_cos=torch.ones(3, 4), rotary_sin=torch.ones(3, 4)),
     "rotary_cos must be [T, head_dim / 2] = [3, 8], got [3, 4]"),
    (dict(weights=[torch.randn(90, 32), torch.randn(32, 32), torch.randn(128, 32),
                   torch.randn(32, 128)]), "qkv weight must have (num_heads + 2 * num_kv_heads)"),
    (dict(weights=[torch.randn(96, 32), torch.randn(32, 32), torch.randn(128, 32),
                   torch.randn(32, 100)]), "weight.size(1) must equal x.size(1)"),
    (dict(context_lens=torch.full((3,), 40, dtype=torch.int32)), "needs 10 blocks of 4"),
    (dict(slot_mapping=torch.arange(3, dtype=torch.int32)), "slot_mapping must have dtype Long"),
    (dict(slot_mapping=torch.tensor([0, 32, 1])),
     "slot_mapping[1] = 32 is out of range for a cache of 32 slots"),
])
def test_errors_name_the_bad_argument(change, message):
    args = small_stack()
    args.update(change)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.decoder_layers(**args)


def test_layers_must_share_cache_shape():
    args = small_stack(num_layers=2)
    args["v_caches"][1] = torch.randn(9, 4, 2, 16)
    with pytest.raises(RuntimeError, match="layer 1's KV cache is Float \\[9, 4, 2, 16\\]"):
        ops.decoder_layers(**args)


def test_empty_stack_and_batch_return_the_input():
    args = small_stack()
    for key in ("norm_weights", "norm_biases", "weights", "k_caches", "v_caches", "scales"):
        args[key] = []
    out = ops.decoder_layers(**args)
    assert torch.equal(out, args["x"]) and out.data_ptr() != args["x"].data_ptr()


def test_builtin_model_uses_the_fused_stack():
    model = load_model("orca-tiny").model
    assert isinstance(model, GPT2) and fused_forward(model) is not None
