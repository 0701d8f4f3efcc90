"""A model's decoder blocks as one prepared ``torch.classes.orca.DecoderStack``.

The model (``model/decoder.py``) stays the readable reference (one module per block, each op a
call). This module hands the same parameters to the C++ stack once, by the block's generic
names, which checks them and keeps them laid out for decode steps: up to
``DecoderStack.max_tokens()`` tokens, the whole stack runs in one parallel region per step
instead of ~10 op dispatches and fork-joins per layer, with the per-op blocks' results bit for
bit; a linear holding GGUF blocks (``QuantizedLinear``) runs the quantized kernels in the same
region. A tensor-parallel rank's stack runs one half-layer at a time (``forward_partial``),
all-reducing its partial sums in between as the row-parallel linears do.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import _C  # noqa: F401  (loads the library that registers torch.classes.orca)
from ..distributed.tensor_parallel import RowParallelLinear, TPGroup
from ..kv import KVCache
from ..model.decoder import Decoder, DecoderBlock
from ..model.layers import AttentionMetadata, Linear
from ..model.quantized import QuantizedLinear


def _linears(block: DecoderBlock) -> dict[str, nn.Module]:
    return {"qkv": block.attn.qkv, "out": block.attn.out, "up": block.mlp.up,
            "down": block.mlp.down}


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model``'s blocks cannot run as a DecoderStack, or None if they can."""
    name = type(model).__name__
    if type(model) is not Decoder:
        return f"{name} is not a plain Decoder (the block DecoderStack knows)"
    if not len(model.layers) or any(type(b) is not DecoderBlock for b in model.layers):
        return f"{name}'s layers are not plain decoder blocks"
    device = model.layers[0].attn.qkv.weight.device
    if device.type != "cpu":
        return f"DecoderStack runs on the CPU; the weights are on {device}"
    linears = [_linears(b) for b in model.layers]
    if any(type(lin[n]) not in (Linear, QuantizedLinear) for lin in linears for n in ("qkv", "up")):
        return f"{name}'s qkv or MLP up linears are not plain or quantized Linear layers"
    row_types = {type(lin[n]) for lin in linears for n in ("out", "down")}
    if not (row_types <= {Linear, QuantizedLinear} or row_types == {RowParallelLinear}):
        return f"{name}'s output linears are not all plain or all row-parallel"
    return None


def tp_group(model: nn.Module) -> TPGroup | None:
    """The tensor-parallel group of a model whose blocks ``unsupported_reason`` accepts."""
    out = model.layers[0].attn.out
    return out.group if isinstance(out, RowParallelLinear) else None


def _layer_weights(block: DecoderBlock) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The block's tensors under DecoderStack's names, and the GGUF format of each linear that
    holds blocks."""
    weights: dict[str, torch.Tensor] = {}
    formats: dict[str, str] = {}
    norms = {"attn_norm": block.attn_norm, "mlp_norm": block.mlp_norm,
             "q_norm": block.attn.q_norm, "k_norm": block.attn.k_norm,
             "post_attn_norm": block.post_attn_norm, "post_mlp_norm": block.post_mlp_norm}
    for name, norm in norms.items():
        if norm is not None:
            weights[name] = norm.weight
            if getattr(norm, "bias", None) is not None:
                weights[f"{name}_bias"] = norm.bias
    for name, linear in _linears(block).items():
        weights[name] = linear.weight
        if linear.bias is not None:
            weights[f"{name}_bias"] = linear.bias
        if isinstance(linear, QuantizedLinear):
            formats[name] = linear.format
    return weights, formats


def build_decoder_stack(model: Decoder) -> torch.ScriptObject:
    """``model``'s blocks as a DecoderStack (check ``unsupported_reason`` first); the stack keeps
    references to the parameters, not copies (on a tensor-parallel rank: its shards, and the
    row-parallel biases on rank 0 only, as the row-parallel linears add them)."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"no DecoderStack for this model: {reason}")
    block, attn = model.spec.block, model.layers[0].attn
    stack = torch.classes.orca.DecoderStack(block.norm, block.norm_eps, block.activation,
                                            attn.num_heads, attn.num_kv_heads, attn.head_dim)
    for layer in model.layers:
        weights, formats = _layer_weights(layer)
        stack.add_layer(weights, formats, layer.attn.scale, layer.attn.window, layer.attn.rope)
    return stack


def set_stack_lora(stack: torch.ScriptObject, model: Decoder, lora_linears: dict,
                   scales: torch.Tensor) -> None:
    """Hand the stack the LoRA slots of ``model``'s linears (``lora.layers.LinearLoRA`` by
    ``layers.{i}.attn.qkv`` ...), by reference: the runner refills them in place."""
    names = {"qkv": "attn.qkv", "out": "attn.out", "up": "mlp.up", "down": "mlp.down"}
    layers = [{f"{ours}_{ab}": getattr(lora_linears[f"layers.{i}.{theirs}"], attr)
               for ours, theirs in names.items() for ab, attr in (("a", "a"), ("b", "b_t"))}
              for i in range(len(model.layers))]
    stack.set_lora(layers, scales)


def stack_forward(model: Decoder, stack: torch.ScriptObject, input_ids: torch.Tensor,
                  positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                  group: TPGroup | None = None,
                  lora_slots: torch.Tensor | None = None) -> torch.Tensor:
    """``model(input_ids, positions, kv_cache, meta)`` with the blocks run by ``stack`` (on a
    tensor-parallel rank of ``group``: half-layer by half-layer, each sum all-reduced, then a
    post-norm block's norm and residual add applied as its per-op forward applies them);
    ``lora_slots`` (int32 [B]) adds each request's adapter delta (``set_stack_lora`` first; a
    tensor-parallel rank adds its share's delta to its partial sums)."""
    x, rotary = model.embed_inputs(input_ids, positions)
    cos, sin = (None, None) if rotary is None else (rotary[0], rotary[1])
    args = (kv_cache.keys, kv_cache.values, meta.cu_q_lens, meta.context_lens, meta.block_table,
            meta.slot_mapping, cos, sin)
    if group is None:
        return stack.forward(x, *args) if lora_slots is None else \
            stack.forward_lora(x, *args, lora_slots)
    post_norms = model.spec.block.post_norms
    for step in range(2 * stack.num_layers()):
        add_residual = group.index == 0 and not post_norms
        if lora_slots is None:
            partial = stack.forward_partial(x, *args, step, add_residual)
        else:
            partial = stack.forward_partial_lora(x, *args, step, add_residual, lora_slots)
        summed = group.all_reduce(partial)
        if post_norms:
            block = model.layers[step // 2]
            norm = block.post_mlp_norm if step % 2 else block.post_attn_norm
            summed = norm(summed, residual=x)
        x = summed
    return x
