"""Structured outputs: grammars compiled with llguidance, one matcher per constrained sequence,
and each batch's token bitmask computed off the engine loop.

``StructuredOutputs.compile`` turns a ``StructuredOutputsParams`` into a matcher in its start
state (cached by content; a schema or grammar that does not compile is a ValueError naming it);
each sequence gets a copy, which the engine advances on every sampled token. When the engine
schedules a batch, ``StructuredOutputs.bitmask`` starts filling the int32 bitmask of the batch's
constrained sequences in a worker thread (llguidance fills it without the GIL) while the model's
forward runs; the sampler waits for it and applies it with ``torch.ops.orca.apply_token_bitmask``.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import torch

from .sampling_params import StructuredOutputsParams

# Compiled grammars kept (least recently used dropped first).
_CACHE_SIZE = 512
# JSON with no whitespace between its tokens: "," and ":" alone (models otherwise tend to run on
# with spaces and newlines inside a schema's structure).
_COMPACT_JSON: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ",",
                                 "key_separator": ":"}


def grammar_of(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) for ``spec``; not yet checked."""
    kind = spec.kind
    if kind == "json":
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json: the schema is not valid JSON: "
                                 f"{exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured_outputs.json: a JSON schema must be an object, got "
                             f"{type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_COMPACT_JSON)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             overrides=_COMPACT_JSON)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice) for choice in spec.choice))
    try:  # Lark, or GBNF (converted to Lark)
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as exc:
        raise ValueError(f"structured_outputs.grammar: {exc}") from None


def cache_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """What identifies a compiled grammar: the kind and its text (a schema's keys in order,
    which is the order its properties are generated in)."""
    value = getattr(spec, spec.kind)
    return spec.kind, value if isinstance(value, str) else json.dumps(value)


class TokenBitmask:
    """One batch's masks: row ``i`` of ``tensor()`` (int32 ``[M, ceil(V / 32)]``, a set bit
    allows the token) is for the batch's ``rows[i]``-th sampled request. Pickling (a distributed
    executor's control message) waits for the masks and sends them."""

    def __init__(self, rows: list[int], masks: Future[torch.Tensor] | torch.Tensor) -> None:
        self.rows = rows
        self._masks = masks

    def tensor(self) -> torch.Tensor:
        if isinstance(self._masks, Future):
            self._masks = self._masks.result()
        return self._masks

    def __getstate__(self) -> dict[str, Any]:
        return {"rows": self.rows, "masks": self.tensor()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.rows, self._masks = state["rows"], state["masks"]


class StructuredOutputs:
    """The grammar compiler and mask filler of one engine (one tokenizer and vocabulary).

    The llguidance tokenizer is built on first use from the engine's ``tokenizers`` tokenizer
    (its JSON), with ``vocab_size`` tokens (the model's logits; None: the tokenizer's) and the
    engine's end-of-sequence tokens, which a mask allows exactly where the grammar accepts the
    output as complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None,
                 eos_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = 0  # int32 words per mask, known once the tokenizer is built
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pin = torch.cuda.is_available()

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A new matcher for ``spec`` in its start state (its grammar compiled once and cached);
        ValueError naming the problem if it cannot be compiled."""
        key = cache_key(spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled.deep_copy()
        tokenizer = self._llg_tokenizer()
        grammar = grammar_of(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, tokenizer)
        if is_error:
            raise ValueError(f"structured_outputs.{spec.kind}: cannot be compiled: "
                             f"{messages[0]}")
        compiled = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise ValueError(f"structured_outputs.{spec.kind}: cannot be compiled: "
                             f"{compiled.get_error()}")
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled.deep_copy()

    def bitmask(self, matchers: Sequence[tuple[int, llguidance.LLMatcher, list[int]]]
                ) -> TokenBitmask:
        """Start filling the masks of ``(sampled row, matcher, proposals)`` in the worker
        thread: a matcher's masks for its row and, after each of its speculative proposals
        (which its grammar allows), for the rows after it."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="orca-grammar")
        rows = [row + i for row, _, spec in matchers for i in range(1 + len(spec))]
        work = [(matcher, spec) for _, matcher, spec in matchers]
        return TokenBitmask(rows, self._pool.submit(self._fill, work, len(rows)))

    def _fill(self, matchers: list[tuple[llguidance.LLMatcher, list[int]]],
              num_rows: int) -> torch.Tensor:
        """One thread fills the masks one after another (each call without the GIL): on a few
        cores, more threads would take them from the forward running meanwhile. A matcher with
        proposals consumes them one by one between its masks, then rolls them back."""
        masks = torch.empty((num_rows, self.words), dtype=torch.int32, pin_memory=self._pin)
        row_bytes = self.words * 4
        base = masks.data_ptr()
        row = 0
        for matcher, spec in matchers:
            for i in range(len(spec) + 1):
                matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
                row += 1
                if i < len(spec):
                    matcher.consume_token(spec[i])
            if spec:
                matcher.rollback(len(spec))
        return masks

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                inner = getattr(self._tokenizer, "inner", None)
                if inner is None or not hasattr(inner, "to_str"):
                    raise ValueError("structured_outputs: needs the model's tokenizer (a "
                                     "`tokenizers` tokenizer); this engine has none")
                self._ll_tokenizer = llguidance.LLTokenizer(
                    inner.to_str(), n_vocab=self.vocab_size,
                    eos_token=self._eos_token_ids or None)
                self.vocab_size = self._ll_tokenizer.vocab_size
                self.words = (self.vocab_size + 31) // 32
            return self._ll_tokenizer

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
