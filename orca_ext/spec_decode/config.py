"""``SpeculativeConfig``: vLLM's ``speculative_config`` (a dict or its JSON text), checked once."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")

# Speculation stops adding proposals once a batch holds this many tokens: past it a CPU step's
# cost grows with its tokens (compute-bound), so verified proposals no longer come nearly free
# (bench/speculative.py --crossover measures it; bench/README.md has the figures).
DEFAULT_MAX_BATCH_TOKENS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``"ngram"`` (proposals copied from the request's own prompt and output after
    its last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens) or ``"draft_model"``
    (``model``, a built-in name or a path, sharing the target's vocabulary, run greedily with
    its own KV cache; ``quantization`` as ``EngineConfig``'s). ``num_speculative_tokens`` is the
    most proposed per request and step; each request adapts its own to its acceptance.
    ``max_batch_tokens``: no proposals beyond this many tokens in a batch."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    quantization: str | None = None
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got "
                             f"{self.method!r}")
        for name in ("num_speculative_tokens", "max_batch_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got "
                                 f"{value!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config.model is for method 'draft_model', got "
                                 f"model={self.model!r} with method 'ngram'")
            lookup_max = 4 if self.prompt_lookup_max is None else self.prompt_lookup_max
            lookup_min = min(2, lookup_max) if self.prompt_lookup_min is None \
                else self.prompt_lookup_min
            for name, value in (("prompt_lookup_max", lookup_max),
                                ("prompt_lookup_min", lookup_min)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"speculative_config.{name} must be an integer >= 1, got "
                                     f"{value!r}")
            if lookup_min > lookup_max:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lookup_min}) must be "
                                 f"<= prompt_lookup_max ({lookup_max})")
            object.__setattr__(self, "prompt_lookup_max", lookup_max)
            object.__setattr__(self, "prompt_lookup_min", lookup_min)
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config.model: method 'draft_model' needs the draft "
                                 f"model's name or path, got {self.model!r}")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("speculative_config.prompt_lookup_max / prompt_lookup_min are "
                                 "for method 'ngram'")

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any] | str | None
           ) -> SpeculativeConfig | None:
        """``value`` as a SpeculativeConfig: a dict, its JSON text, or one already built."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be an object, got "
                             f"{type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: "
                             f"{sorted(known)})")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**value)
