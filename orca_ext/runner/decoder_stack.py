"""A GPT-2 or Llama model's decoder blocks as one prepared ``torch.classes.orca.DecoderStack``.

The model files stay the readable reference (one module per block, each op a call). This module
hands the same parameters to the C++ stack once, which checks them and keeps them laid out for
decode steps: up to ``DecoderStack.max_tokens()`` tokens, the whole stack runs in one parallel
region per step instead of ~10 op dispatches and fork-joins per layer, with the per-op blocks'
results bit for bit; a block whose linears hold GGUF blocks (``QuantizedLinear``) runs the
quantized kernels in the same region. A tensor-parallel rank's stack runs one half-layer at a time
(``forward_partial``), all-reducing its partial sums in between as the row-parallel linears do.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import _C  # noqa: F401  (loads the library that registers torch.classes.orca)
from ..distributed.tensor_parallel import RowParallelLinear, TPGroup
from ..kv import KVCache
from ..model.gpt2 import GPT2, GPT2Block
from ..model.layers import AttentionMetadata, LayerNorm, Linear, RMSNorm
from ..model.llama import Llama, LlamaBlock
from ..model.quantized import QuantizedLinear

# (attention norm, qkv, out, MLP norm, MLP up, MLP down) of one block.
BlockParts = tuple[LayerNorm | RMSNorm, Linear, Linear, LayerNorm | RMSNorm, Linear, Linear]


def _block_parts(block: nn.Module) -> BlockParts:
    if isinstance(block, GPT2Block):
        return block.ln_1, block.attn.qkv, block.attn.out, block.ln_2, block.mlp.fc, block.mlp.proj
    return (block.input_norm, block.attn.qkv, block.attn.out, block.post_attn_norm,
            block.mlp.gate_up, block.mlp.down)


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model``'s blocks cannot run as a DecoderStack, or None if they can."""
    name = type(model).__name__
    if type(model) not in (GPT2, Llama):
        return f"{name} is not a GPT-2 or Llama model (the layouts DecoderStack knows)"
    block_type = GPT2Block if type(model) is GPT2 else LlamaBlock
    if not len(model.layers) or any(type(b) is not block_type for b in model.layers):
        return f"{name}'s layers are not its family's plain blocks"
    device = model.layers[0].attn.qkv.weight.device
    if device.type != "cpu":
        return f"DecoderStack runs on the CPU; the weights are on {device}"
    parts = [_block_parts(b) for b in model.layers]
    for p in parts:
        kinds = {type(lin) for lin in (p[1], p[2], p[4], p[5])}
        if QuantizedLinear in kinds and kinds != {QuantizedLinear}:
            return (f"{name} has blocks with both quantized and float linears (the stack takes "
                    "a block's four linears in one kind)")
    if any(type(lin) not in (Linear, QuantizedLinear) for p in parts for lin in (p[1], p[4])):
        return f"{name}'s qkv or MLP up linears are not plain Linear layers"
    row_types = {type(lin) for p in parts for lin in (p[2], p[5])}
    if row_types not in ({Linear}, {RowParallelLinear}, {QuantizedLinear},
                         {Linear, QuantizedLinear}):
        return f"{name}'s output linears are not all plain or all row-parallel"
    return None


def tp_group(model: nn.Module) -> TPGroup | None:
    """The tensor-parallel group of a model whose blocks ``unsupported_reason`` accepts."""
    out = model.layers[0].attn.out
    return out.group if isinstance(out, RowParallelLinear) else None


def build_decoder_stack(model: nn.Module) -> torch.ScriptObject:
    """``model``'s blocks as a DecoderStack (check ``unsupported_reason`` first); the stack keeps
    references to the parameters, not copies (on a tensor-parallel rank: its shards, and the
    row-parallel biases on rank 0 only, as the row-parallel linears add them)."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"no DecoderStack for this model: {reason}")
    first = model.layers[0]
    attn_norm, qkv, _, _, up, _ = _block_parts(first)
    stack = torch.classes.orca.DecoderStack(
        "layer_norm" if isinstance(attn_norm, LayerNorm) else "rms_norm", attn_norm.eps,
        up.activation, first.attn.num_heads,
        getattr(first.attn, "num_kv_heads", first.attn.num_heads), first.attn.head_dim)
    for block in model.layers:
        attn_norm, qkv, out, mlp_norm, up, down = _block_parts(block)
        if isinstance(qkv, QuantizedLinear):
            stack.add_quantized_layer(
                attn_norm.weight, getattr(attn_norm, "bias", None), qkv.weight, qkv.format,
                qkv.bias, out.weight, out.format, out.bias, mlp_norm.weight,
                getattr(mlp_norm, "bias", None), up.weight, up.format, up.bias, down.weight,
                down.format, down.bias, block.attn.scale)
            continue
        stack.add_layer(attn_norm.weight, getattr(attn_norm, "bias", None), qkv.weight, qkv.bias,
                        out.weight, out.bias, mlp_norm.weight, getattr(mlp_norm, "bias", None),
                        up.weight, up.bias, down.weight, down.bias, block.attn.scale)
    return stack


def stack_forward(model: nn.Module, stack: torch.ScriptObject, input_ids: torch.Tensor,
                  positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                  group: TPGroup | None = None) -> torch.Tensor:
    """``model(input_ids, positions, kv_cache, meta)`` with the blocks run by ``stack`` (on a
    tensor-parallel rank of ``group``: half-layer by half-layer, each sum all-reduced)."""
    x, rotary = model.embed_inputs(input_ids, positions)
    cos, sin = (None, None) if rotary is None else tuple(t.flatten(1) for t in rotary)
    args = (kv_cache.keys, kv_cache.values, meta.cu_q_lens, meta.context_lens, meta.block_table,
            meta.slot_mapping, cos, sin)
    if group is None:
        return stack.forward(x, *args)
    for step in range(2 * stack.num_layers()):
        x = group.all_reduce(stack.forward_partial(x, *args, step, group.index == 0))
    return x
