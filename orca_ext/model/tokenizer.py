"""Tokenizers: a Hugging Face ``tokenizer.json`` through the ``tokenizers`` library, and the
byte-level tokenizer of the built-in model (token id == byte value), built in code."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the library is imported where used: the byte table loads without it
    from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    """Text <-> token ids. ``inner`` is the ``tokenizers.Tokenizer`` (for incremental
    detokenization or anything else it offers)."""

    def __init__(self, inner: HFTokenizer) -> None:
        self.inner = inner

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} does not exist (only tokenizer.json "
                                    "files of the `tokenizers` library are supported)")
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inner.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.inner.id_to_token(token_id)

    def save(self, path: str | Path) -> None:
        self.inner.save(str(path))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenizes to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(printable, map(chr, printable)))
    others = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + i)) for i, b in enumerate(others))
    return chars


def byte_level_tokenizer(special_tokens: list[str]) -> Tokenizer:
    """One token per UTF-8 byte (id == byte value), then ``special_tokens`` from id 256."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    inner = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens([AddedToken(t, special=True) for t in special_tokens])
    return Tokenizer(inner)
