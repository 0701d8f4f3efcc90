"""The model runner: a runner's copy of its requests, each iteration's tensors, the forward pass
(a prepared DecoderStack or the model's own), logits and sampling."""
from .model_runner import ModelRunner

__all__ = ["ModelRunner"]
