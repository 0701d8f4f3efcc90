"""Inter-layer (pipeline) parallelism around an unchanged model: a stage keeps only its layers,
and a stage after the first receives the previous stage's packed hidden states in place of its
input embeddings, so the decoder's own ``forward`` runs the stage and ``compute_logits`` the head.
"""
from __future__ import annotations

import re

import torch
from torch import nn

# The modules the decoder's forward calls on the input ids/positions before its first layer; the
# first one's output becomes the hidden states (GPT-2 adds its position embedding to it).
INPUT_MODULES = ("embed", "pos_embed")
_LAYER = re.compile(r"^layers\.(\d+)(\.|$)")


class Received:
    """Holds the hidden states this stage got from the previous one, for the current batch."""

    hidden: torch.Tensor | None = None


class StageInput(nn.Module):
    """Stands in for an input embedding on a later stage: the first returns the received hidden
    states, the others (GPT-2's position embedding) zero."""

    def __init__(self, received: Received, primary: bool) -> None:
        super().__init__()
        self.received, self.primary = received, primary

    def forward(self, ids: torch.Tensor) -> torch.Tensor | int:
        if not self.primary:
            return 0
        hidden, self.received.hidden = self.received.hidden, None
        return hidden


def stage_keeps(layers: range, first: bool, last: bool):
    """``keep(name)``: whether a stage with global ``layers`` uses the parameter or module
    ``name`` (input embeddings on the first stage, the final norm and lm_head on the last)."""
    def keep(name: str) -> bool:
        match = _LAYER.match(name)
        if match:
            return int(match.group(1)) in layers
        if name == "layers" or not name:
            return True
        return first if name.split(".")[0] in INPUT_MODULES else last

    return keep


def cut_stage(model: nn.Module, layers: range, first: bool) -> Received | None:
    """Keep only ``layers`` (renumbered from 0); on a later stage, swap the input embeddings for
    ``StageInput``s (the received hidden states are already scaled) and return the ``Received``
    to fill before each forward."""
    model.layers = nn.ModuleList(model.layers[i] for i in layers)
    if first:
        return None
    received = Received()
    for i, name in enumerate(INPUT_MODULES):
        if getattr(model, name) is not None:
            setattr(model, name, StageInput(received, primary=i == 0))
    model.embed_scale = 1.0
    return received
