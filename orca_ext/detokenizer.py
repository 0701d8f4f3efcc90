"""Incremental detokenization of one sequence, and stop strings."""
from __future__ import annotations

from typing import Protocol

# Prompt tokens decoded as left context, so that a first output token whose text depends on its
# neighbour (e.g. a leading space) decodes as it would inside the whole sequence.
_PROMPT_CONTEXT = 5


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


class Detokenizer:
    """Grows a sequence's text one token at a time.

    Each token decodes a short window (the tokens since the last emitted text, plus the ones
    before as context) instead of the whole sequence, and text is emitted only once it no longer
    ends in an incomplete character (U+FFFD), so a multi-byte character split over tokens comes
    out whole. Stop strings are searched in the new text only; ``text`` is cut before a match.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str]) -> None:
        self.text = ""
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._read = len(self._ids)  # _ids[:_read] is context whose text is already out
        self._stop = stop
        # While running, this many trailing characters may be the start of a stop string.
        self._holdback = max(map(len, stop), default=1) - 1

    def append(self, token_id: int) -> str | None:
        """Add a token; return the stop string it completed, if any."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str | None:
        """At the end of the sequence, emit what waited for a character that never completed
        (it decodes as U+FFFD, as in a decode of the whole sequence); return a stop string hit."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str | None:
        prefix = self._tokenizer.decode(self._ids[:self._read])
        full = self._tokenizer.decode(self._ids)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return None  # no new text yet, or an incomplete character
        delta = full[len(prefix):]
        del self._ids[:self._read]
        self._read = len(self._ids)
        self.text += delta
        start = max(0, len(self.text) - len(delta) - self._holdback)
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[:index]
        return stop

    def output_text(self, finished: bool) -> str:
        """The text to report; while running, without what may yet turn out to be a stop string."""
        if finished or not self._holdback:
            return self.text
        return self.text[:max(0, len(self.text) - self._holdback)]
