"""The prepared ``DecoderStack`` against the models' own per-op blocks, and its errors."""
from __future__ import annotations

import re

import pytest
import torch

from orca_ext.kv import KVCache, SlotAllocator
from orca_ext.model import load_model
from orca_ext.model.decoder import Decoder
from orca_ext.model.layers import AttentionMetadata, Linear
from orca_ext.runner.decoder_stack import build_decoder_stack, stack_forward, unsupported_reason
import reference_ops as ref
from tiny_models import SPECS, VOCAB, make_hf_model, save_hf_model

BLOCK_SIZE = 4
# (tokens already in the cache, tokens this iteration) per request: decodes at batch 1 / 4 / 8
# and a mixed batch of 8 tokens (the stack takes up to 8).
BATCHES = {
    "decode_1": [(9, 1)],
    "decode_4": [(3, 1), (17, 1), (0, 1), (30, 1)],
    "decode_8": [(i * 5, 1) for i in range(8)],
    "mixed_8": [(0, 5), (12, 1), (7, 2)],
}


@pytest.fixture(scope="module", params=list(SPECS))
def model_folder(request, tmp_path_factory):
    return save_hf_model(make_hf_model(request.param), tmp_path_factory.mktemp(request.param))


def run_both(loaded, batch: list[tuple[int, int]], seed: int = 0,
             kv_dtype: torch.dtype | None = None):
    """(hidden states, caches) from the model's own forward and from the fused one, each from
    the same random caches (of ``kv_dtype``, default the model's) and inputs."""
    kv_dtype = kv_dtype or loaded.dtype
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
    cache = KVCache(loaded.config, blocks, BLOCK_SIZE, kv_dtype)
    for k, v in cache:
        for c in (k, v):
            if kv_dtype == torch.int8:
                c.copy_(ref.quantize_kv_int8(torch.randn(*c.shape[:-1], c.shape[-1] - 4,
                                                         generator=gen)))
            else:
                c.copy_(torch.randn(c.shape, generator=gen))
    stack = build_decoder_stack(loaded.model)
    results = []
    for fused in (False, True):
        caches = KVCache(loaded.config, blocks, BLOCK_SIZE, kv_dtype)
        for (k, v), (k0, v0) in zip(caches, cache):
            k.copy_(k0)
            v.copy_(v0)
        with torch.inference_mode():
            if fused:
                hidden = stack_forward(loaded.model, stack, input_ids, positions, caches, meta)
            else:
                hidden = loaded.model(input_ids, positions, caches, meta)
        results.append((hidden, caches))
    return results


def assert_fused_equals_per_op(loaded, batch: list[tuple[int, int]]) -> None:
    """The fused stack gives the per-op blocks' hidden states and KV caches bit for bit."""
    (want, want_caches), (got, got_caches) = run_both(loaded, batch)
    assert got.dtype == want.dtype and torch.equal(got, want)
    for (k_want, v_want), (k_got, v_got) in zip(want_caches, got_caches):
        assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_fused_blocks_match_the_models_blocks(model_folder, batch, dtype):
    """Same kernels, same work split, same rounding: the fused stack gives the per-op blocks'
    hidden states and KV caches bit for bit (GPT-2; Llama with GQA, llama3 rope, biases; Qwen2;
    Mistral's head_dim)."""
    loaded = load_model(str(model_folder), dtype=dtype)
    assert loaded.dtype == dtype
    assert_fused_equals_per_op(loaded, BATCHES[batch])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", ["decode_4", "mixed_8"])
def test_fused_blocks_match_the_models_blocks_with_int8_kv(model_folder, batch, dtype):
    """With an int8 KV cache the stack quantizes the new rows and reads the cache as store_kv
    and ragged_attention do: the same hidden states and cache bytes."""
    loaded = load_model(str(model_folder), dtype=dtype)
    (want, want_caches), (got, got_caches) = run_both(loaded, BATCHES[batch],
                                                      kv_dtype=torch.int8)
    assert torch.equal(got, want)
    for (k_want, v_want), (k_got, v_got) in zip(want_caches, got_caches):
        assert k_got.dtype == torch.int8
        assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)


def test_stack_applies_to_plain_models_only(model_folder):
    loaded = load_model(str(model_folder))
    model = loaded.model
    assert unsupported_reason(model) is None

    class Subclass(type(model)):
        pass

    model.__class__ = Subclass  # e.g. a wrapper that changes forward
    assert "is not a plain Decoder" in unsupported_reason(model)
    with pytest.raises(ValueError, match="no DecoderStack for this model"):
        build_decoder_stack(model)
    model.__class__ = Subclass.__bases__[0]

    class ShardedLinear(Linear):
        pass

    linear = next(m for m in model.layers[-1].mlp.modules() if isinstance(m, Linear))
    linear.__class__ = ShardedLinear  # a Linear whose forward may do anything
    assert "MLP up linears are not plain or quantized Linear" in unsupported_reason(model)
    linear.__class__ = Linear


HIDDEN, HEADS, HEAD_DIM = 32, 2, 16


def layer_args(**change) -> tuple:
    """add_layer's arguments for a GPT-2-shaped block (hidden 32, 2 heads): a weight set to None
    is left out; scale, window and rotary are the layer's settings."""
    weights = dict(attn_norm=torch.rand(HIDDEN), attn_norm_bias=torch.randn(HIDDEN),
                   qkv=torch.randn(3 * HIDDEN, HIDDEN), out=torch.randn(HIDDEN, HIDDEN),
                   mlp_norm=torch.rand(HIDDEN), mlp_norm_bias=torch.randn(HIDDEN),
                   up=torch.randn(4 * HIDDEN, HIDDEN), down=torch.randn(HIDDEN, 4 * HIDDEN))
    settings = dict(formats={}, scale=0.25, window=0, rotary=0)
    for name, value in change.items():
        if name in settings:
            settings[name] = value
        elif value is None:
            weights.pop(name)
        else:
            weights[name] = value
    return weights, *settings.values()


def small_stack(num_layers: int = 1, **config):
    torch.manual_seed(0)
    settings = dict(norm="layer_norm", norm_eps=1e-5, activation="gelu_tanh", num_heads=HEADS,
                    num_kv_heads=HEADS, head_dim=HEAD_DIM) | config
    stack = torch.classes.orca.DecoderStack(*settings.values())
    for _ in range(num_layers):
        stack.add_layer(*layer_args())
    return stack


def step_args(num_layers: int = 1, tokens: int = 3, **change) -> dict:
    """forward's arguments: one decode per token, contexts of 5 in blocks of 4."""
    args = dict(
        x=torch.randn(tokens, HIDDEN),
        k_caches=[torch.randn(8, 4, HEADS, HEAD_DIM) for _ in range(num_layers)],
        v_caches=[torch.randn(8, 4, HEADS, HEAD_DIM) for _ in range(num_layers)],
        cu_q_lens=torch.arange(tokens + 1, dtype=torch.int32),
        context_lens=torch.full((tokens,), 5, dtype=torch.int32),
        block_table=torch.arange(2 * tokens, dtype=torch.int32).view(tokens, 2),
        slot_mapping=torch.arange(tokens, dtype=torch.int64) * 8 + 4, rotary_cos=None,
        rotary_sin=None)
    args.update(change)
    return args


@pytest.mark.parametrize("change,message", [
    (dict(norm="none"), "DecoderStack needs a norm"),
    (dict(norm="batch_norm"), "norm must be one of"),
    (dict(activation="swish"), "activation must be one of"),
    (dict(num_kv_heads=3), "num_heads (2) must be a positive multiple of num_kv_heads (3)"),
    (dict(head_dim=7), "head_dim must be a positive even number, got 7"),
    (dict(norm_eps=float("nan")), "norm_eps must be finite and >= 0"),
])
def test_config_errors_name_the_bad_argument(change, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        small_stack(**change)


@pytest.mark.parametrize("change,message", [
    (dict(scale=-1.0), "scale must be a finite positive number, got -1"),
    (dict(window=-2), "window must be >= 0 (0: no window), got -2"),
    (dict(rotary=-1), "rotary must be >= 0"),
    (dict(qkv=torch.randn(90, 32)), "layer 0's qkv must have (num_heads + 2 * num_kv_heads)"),
    (dict(down=torch.randn(32, 100)),
     "layer 0's down linear: weight is [32, 100] but x is [1, 128]"),
    (dict(qkv_bias=torch.zeros(95)),
     "layer 0's qkv linear: bias has 95 entries but weight has N = 96"),
    (dict(mlp_norm=torch.rand(31)), "layer 0's up linear: norm_weight has 31 entries"),
    (dict(out=torch.randn(32, 32, dtype=torch.bfloat16)),
     "layer 0's out is BFloat16 on cpu; the stack's tensors must be Float"),
    (dict(qkv=torch.randn(96)), "layer 0's qkv linear: weight must be 2-D"),
    (dict(up=None), "layer 0 lacks the weight 'up'"),
    (dict(up_proj=torch.randn(4)), "layer 0: unknown weight 'up_proj'"),
    (dict(formats={"gate": "q8_0"}), "formats names 'gate', not one of the linears"),
    (dict(formats={"qkv": "q3_k"}), "layer 0's qkv linear: format must be one of"),
    (dict(q_norm=torch.rand(HEAD_DIM)), "has only one of q_norm and k_norm"),
    (dict(q_norm=torch.rand(8), k_norm=torch.rand(8)), "layer 0's q_norm: weight has 8 entries"),
    (dict(post_attn_norm=torch.rand(HIDDEN), post_mlp_norm=torch.rand(HIDDEN)),
     "post norms are RMSNorms, in a stack of rms_norm blocks"),
])
def test_layer_errors_name_the_bad_argument(change, message):
    stack = small_stack(num_layers=0)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        stack.add_layer(*layer_args(**change))
    assert stack.num_layers() == 0  # a rejected layer is not added


def test_layers_must_agree():
    stack = small_stack(num_layers=1)
    with pytest.raises(RuntimeError, match="layer 1 has a different set of optional weights"):
        stack.add_layer(*layer_args(qkv_bias=torch.zeros(96)))
    with pytest.raises(RuntimeError, match="layer 1's MLP width 64 differs from layer 0's 128"):
        stack.add_layer(*layer_args(up=torch.randn(64, 32), down=torch.randn(32, 64)))
    with pytest.raises(RuntimeError, match="layer 1's attn_norm is BFloat16"):
        stack.add_layer(*layer_args(**{name: None if t is None else t.bfloat16()
                                       for name, t in layer_args()[0].items()}))


@pytest.mark.parametrize("change,message", [
    (dict(x=torch.randn(3, 30)), "x must be Float [T, 32] on the CPU"),
    (dict(x=torch.randn(9, 32)), "DecoderStack runs up to 8 tokens a call, got 9"),
    (dict(k_caches=[]), "k_caches and v_caches must hold one cache per layer (1)"),
    (dict(rotary_cos=torch.ones(1, 3, 8)), "rotary_cos and rotary_sin must be given together"),
    (dict(rotary_cos=torch.ones(1, 3, 9), rotary_sin=torch.ones(1, 3, 9)),
     "rotary_cos must be [num_tables >= 1, T = 3, rotary_dim / 2 <= head_dim / 2 = 8], got "
     "[1, 3, 9]"),
    (dict(rotary_cos=torch.ones(3, 8), rotary_sin=torch.ones(3, 8)), "rotary_cos must be 3-D"),
    (dict(context_lens=torch.full((3,), 40, dtype=torch.int32)), "needs 10 blocks of 4"),
    (dict(slot_mapping=torch.arange(3, dtype=torch.int32)), "slot_mapping must have dtype Long"),
    (dict(slot_mapping=torch.tensor([0, 32, 1])),
     "slot_mapping[1] = 32 is out of range for a cache of 32 slots"),
])
def test_step_errors_name_the_bad_argument(change, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        small_stack().forward(*step_args(**change).values())


def test_layers_must_share_cache_shape():
    args = step_args(num_layers=2)
    args["v_caches"][1] = torch.randn(9, 4, 2, 16)
    with pytest.raises(RuntimeError, match="layer 1's KV cache is Float \\[9, 4, 2, 16\\]"):
        small_stack(num_layers=2).forward(*args.values())


def test_empty_batch_returns_a_copy_of_the_input():
    args = step_args(tokens=0)
    out = small_stack().forward(*args.values())
    assert out.shape == (0, HIDDEN)


def test_builtin_model_uses_the_stack():
    model = load_model("orca-tiny").model
    assert type(model) is Decoder and unsupported_reason(model) is None
    assert build_decoder_stack(model).num_layers() == model.config.num_layers


def test_partial_steps_compose_to_the_whole_stack():
    """Half-layer steps (a tensor-parallel rank's, here with the identity for the all-reduce)
    give the whole stack's result bit for bit; without the residual a step returns only the
    half-layer's output."""
    stack, args = small_stack(num_layers=2), step_args(num_layers=2)
    caches = [[c.clone() for c in args["k_caches"]], [c.clone() for c in args["v_caches"]]]
    want = stack.forward(*args.values())
    x, rest = args["x"], list(args.values())[1:]
    rest[0], rest[1] = caches
    for step in range(4):
        x = stack.forward_partial(x, *rest, step, True)
    assert torch.equal(x, want)
    partial = stack.forward_partial(args["x"], *rest, 1, False)
    with_residual = stack.forward_partial(args["x"], *rest, 1, True)
    torch.testing.assert_close(partial + args["x"], with_residual)
    with pytest.raises(RuntimeError, match=re.escape("step must be in [0, 4)")):
        stack.forward_partial(args["x"], *rest, 4, True)
