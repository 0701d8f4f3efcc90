"""Token ids back to text: incremental detokenization of one sequence with its stop strings
(``Detokenizer``), and one token's own text and bytes for logprobs (``TokenText``)."""
from __future__ import annotations

from typing import Any, Protocol

from .model.tokenizer import bytes_to_unicode

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


# GPT-2's byte-level alphabet read back: printable character -> the byte it stands for.
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}


class TokenText:
    """Token id -> (text, bytes) of that token alone, for logprobs; cached. A token that is
    not whole UTF-8 (part of a multi-byte character) shows as ``bytes:\\xe2\\x80``, as
    OpenAI writes it, when the tokenizer is byte-level."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> str:
        return self.entry(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self.entry(token_id)[1]

    def entry(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            entry = self._lookup(token_id)
            if len(self._cache) < 1 << 16:
                self._cache[token_id] = entry
        return entry

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        tokenizer = self._tokenizer
        if tokenizer is None:
            return f"<{token_id}>", []
        try:
            text = tokenizer.decode([token_id], skip_special_tokens=False)
        except TypeError:
            text = tokenizer.decode([token_id])
        raw = None
        inner = getattr(tokenizer, "inner", None)
        if inner is not None and hasattr(inner, "id_to_token"):
            piece = inner.id_to_token(token_id)
            if piece and all(c in _BYTE_OF_CHAR for c in piece):
                raw = bytes(_BYTE_OF_CHAR[c] for c in piece)
        if "\ufffd" in text and raw is not None:
            try:
                raw.decode()
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)
        return text, list(text.encode())
