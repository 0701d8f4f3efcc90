"""Per-request sampling parameters (vLLM-compatible names and defaults)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's ``StructuredOutputsParams``): exactly one of a
    JSON schema (a dict or its JSON text), any JSON object, a regular expression, one of a list
    of strings, or a grammar (Lark, or llama.cpp's GBNF). JSON comes out compact (no whitespace
    between tokens of the JSON syntax); compiling happens when the request is added
    (``orca_ext.structured``), where a schema or grammar it cannot compile is a ValueError."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, json_object, regex, "
                             f"choice or grammar, got {given or 'none'}")
        _check(self.json is None or isinstance(self.json, (dict, str)), "structured_outputs.json",
               self.json, "a JSON schema (a dict or its JSON text)")
        _check(isinstance(self.json_object, bool), "structured_outputs.json_object",
               self.json_object, "a bool")
        _check(self.regex is None or isinstance(self.regex, str), "structured_outputs.regex",
               self.regex, "a string")
        _check(self.choice is None or (isinstance(self.choice, (list, tuple)) and self.choice
                                       and all(isinstance(c, str) for c in self.choice)),
               "structured_outputs.choice", self.choice, "a non-empty list of strings")
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip()),
               "structured_outputs.grammar", self.grammar, "a non-empty Lark or GBNF grammar")
        if self.choice is not None:
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """The one constraint given: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """How to sample one request's output.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``logprobs=None`` returns no logprobs, ``0`` the sampled token's, ``k`` also the top-k.
    ``min_tokens``: no stop token (EOS included) before that many output tokens; ``logit_bias``
    is added to the named tokens' logits before sampling (OpenAI's).
    Every field is validated at construction; a bad value raises ``ValueError`` naming it.
    """

    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "None or an integer >= 1")
        _check(_is_real(self.temperature) and self.temperature >= 0, "temperature",
               self.temperature, "a number >= 0")
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k", self.top_k,
               "an integer >= -1 (0 or -1 disables it)")
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(_is_real(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", self.repetition_penalty, "a number > 0")
        _check(_is_real(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
               "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(_is_real(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
               "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        # Sample i of n uses seed + i, which must fit torch.Generator's signed 64-bit seeds.
        _check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed
                                     and self.seed + self.n - 1 < 2**63),
               "seed", self.seed, f"None or an integer in [-2^63, 2^63 - {self.n}]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "a list of non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "a list of token ids >= 0")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               "logprobs", self.logprobs, "None or an integer in [0, 20]")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens
               and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
               "min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        _check(self.logit_bias is None
               or (isinstance(self.logit_bias, dict)
                   and all(_is_int(t) and t >= 0 and _is_real(b) and -100 <= b <= 100
                           for t, b in self.logit_bias.items())),
               "logit_bias", self.logit_bias, "a dict of token id (>= 0) -> bias in [-100, 100]")
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "None or StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {shown}")
