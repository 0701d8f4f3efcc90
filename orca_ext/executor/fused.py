"""A GPT-2 or Llama model's decoder blocks as one ``ops.decoder_layers`` call (CPU).

The model files stay the readable reference (one module per block, each op a call); this
module reads the same parameters into the fused op's argument lists, once, and returns a forward
the traced iteration runs instead of the model's. Up to 8 tokens (decode at small batch) the op
runs the whole stack in one parallel region, without ~50 op dispatches and fork-joins a step.
Models whose blocks are anything else (another family, the tensor-parallel wrappers, a
subclass) keep their own forward.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .. import ops
from ..model.gpt2 import GPT2, GPT2Block
from ..model.layers import AttentionMetadata, LayerNorm, Linear, RMSNorm
from ..model.llama import Llama, LlamaBlock

Forward = Callable[[torch.Tensor, torch.Tensor, Sequence[tuple[torch.Tensor, torch.Tensor]],
                    AttentionMetadata], torch.Tensor]


@dataclass
class BlockStack:
    """``decoder_layers``' weight arguments, in its per-layer order."""

    norm_weights: list[torch.Tensor]
    norm_biases: list[torch.Tensor]  # empty: the norms have none
    weights: list[torch.Tensor]
    biases: tuple[list[torch.Tensor], ...]  # qkv, out, up, down; each empty or one per layer
    scales: list[float]
    norm: str
    norm_eps: float
    activation: str
    num_heads: int
    num_kv_heads: int


def _stack(norms: list[LayerNorm | RMSNorm], linears: list[Linear], scales: list[float],
           num_heads: int, num_kv_heads: int) -> BlockStack | None:
    """norms: two per layer (attention, MLP); linears: four (qkv, out, MLP up, MLP down)."""
    norm_types, eps = {type(n) for n in norms}, {n.eps for n in norms}
    activations = {lin.activation for lin in linears[2::4]}
    norm_biases = [getattr(n, "bias", None) for n in norms]
    biases = tuple([lin.bias for lin in linears[role::4]] for role in range(4))
    if (len(norm_types) != 1 or len(eps) != 1 or len(activations) != 1
            or any(type(lin) is not Linear for lin in linears)
            or any(lin.activation != "none" for i, lin in enumerate(linears) if i % 4 != 2)
            or any(len({b is None for b in group}) != 1 for group in (norm_biases, *biases))):
        return None
    return BlockStack(
        norm_weights=[n.weight for n in norms],
        norm_biases=[] if norm_biases[0] is None else norm_biases,
        weights=[lin.weight for lin in linears],
        biases=tuple([] if group[0] is None else group for group in biases),
        scales=scales, norm="layer_norm" if norm_types == {LayerNorm} else "rms_norm",
        norm_eps=eps.pop(), activation=activations.pop(), num_heads=num_heads,
        num_kv_heads=num_kv_heads)


def _gpt2_stack(model: GPT2) -> BlockStack | None:
    layers = list(model.layers)
    if not layers or any(type(b) is not GPT2Block for b in layers):
        return None
    heads = layers[0].attn.num_heads
    return _stack([n for b in layers for n in (b.ln_1, b.ln_2)],
                  [lin for b in layers for lin in (b.attn.qkv, b.attn.out, b.mlp.fc, b.mlp.proj)],
                  [b.attn.scale for b in layers], heads, heads)


def _llama_stack(model: Llama) -> BlockStack | None:
    layers = list(model.layers)
    if not layers or any(type(b) is not LlamaBlock for b in layers):
        return None
    attn = layers[0].attn
    return _stack([n for b in layers for n in (b.input_norm, b.post_attn_norm)],
                  [lin for b in layers
                   for lin in (b.attn.qkv, b.attn.out, b.mlp.gate_up, b.mlp.down)],
                  [b.attn.scale for b in layers], attn.num_heads, attn.num_kv_heads)


def fused_forward(model: nn.Module) -> Forward | None:
    """``model.forward`` with its blocks as one ``decoder_layers`` call, or None where that does
    not apply (see the module docstring; CPU weights only)."""
    if type(model) is GPT2:
        stack = _gpt2_stack(model)
    elif type(model) is Llama:
        stack = _llama_stack(model)
    else:
        return None
    if stack is None or any(w.device.type != "cpu" for w in stack.weights):
        return None

    def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        x, rotary = model.embed_inputs(input_ids, positions)
        cos, sin = (None, None) if rotary is None else (t.flatten(1) for t in rotary)
        return ops.decoder_layers(
            x, stack.norm_weights, stack.norm_biases, stack.weights, stack.biases,
            [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.cu_q_lens,
            meta.context_lens, meta.block_table, meta.slot_mapping, cos, sin, stack.norm,
            stack.norm_eps, stack.activation, stack.num_heads, stack.num_kv_heads, stack.scales)

    return forward
