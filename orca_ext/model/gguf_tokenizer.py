"""A GGUF file's tokenizer as a ``tokenizers.Tokenizer``, built from the file's metadata as
transformers' GGUF loader builds it: byte-level BPE (``tokenizer.ggml.model`` ``gpt2``) with the
pre-tokenizer ``tokenizer.ggml.pre`` names, or SentencePiece BPE (``llama``: Llama 2, Mistral,
Gemma) with byte fallback and the merges its vocabulary implies. Control tokens become special
added tokens, user-defined ones (Gemma's ``\\n`` runs) plain added tokens, both matched whole in
the text before BPE."""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from .tokenizer import Tokenizer, bytes_to_unicode

if TYPE_CHECKING:
    from .gguf import GGUFFile

# Text splits before byte-level BPE, by ``tokenizer.ggml.pre`` (llama.cpp's pre-tokenizer
# names): the regexes llama.cpp's llama-vocab.cpp applies, in order.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,), "gpt2": (_GPT2_SPLIT,), "gpt-2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT), "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT), "codeshell": (r"\p{N}", _GPT2_SPLIT),
    "llama3": (_LLAMA3_SPLIT,), "llama-v3": (_LLAMA3_SPLIT,), "llama-bpe": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,), "dbrx": (_LLAMA3_SPLIT,), "falcon3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,), "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_SPIECE_SPACE = "\u2581"  # SentencePiece's spelling of a space
# Gemma files spell their whitespace-run tokens with real spaces ("  "), which SentencePiece
# spells with its own; their merges follow the vocabulary's order, not the scores (which give
# every user-defined token the same -1000); and no space is prepended to the text.
_GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})


def gguf_tokenizer(file: GGUFFile) -> Tokenizer:
    """The tokenizer the file's metadata describes: byte-level BPE (``gpt2``) with the
    pre-tokenizer ``tokenizer.ggml.pre`` names, or SentencePiece BPE (``llama``)."""
    kind = file.value("tokenizer.ggml.model")
    tokens = file.value("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{file.path}: the file has no tokenizer (tokenizer.ggml.tokens)")
    types = file.value("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{file.path}: tokenizer.ggml.token_type has {len(types)} entries for "
                         f"{len(tokens)} tokens")
    if kind == "gpt2":
        inner, specials = _byte_level_bpe(file, tokens, types)
        add_bos = bool(file.value("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        inner, specials = _sentencepiece_bpe(file, tokens, types)
        add_bos = bool(file.value("tokenizer.ggml.add_bos_token", True))
    else:
        raise ValueError(f"{file.path}: unsupported tokenizer model {kind!r}; supported: "
                         "'gpt2' (byte-level BPE), 'llama' (SentencePiece)")
    inner.add_special_tokens([AddedToken(t, special=True, normalized=False)
                              for t in specials[_CONTROL]])
    inner.add_tokens([AddedToken(t, special=False, normalized=False)
                      for t in specials[_USER_DEFINED]])
    template = []
    for flag, key in ((add_bos, "bos"), (bool(file.value("tokenizer.ggml.add_eos_token", False)),
                                         "eos")):
        token_id = file.value(f"tokenizer.ggml.{key}_token_id")
        if flag and token_id is not None:
            template.append((key, inner.id_to_token(int(token_id)), int(token_id)))
    if template:
        head = [t for k, t, _ in template if k == "bos"]
        tail = [t for k, t, _ in template if k == "eos"]
        inner.post_processor = processors.TemplateProcessing(
            single=" ".join([*head, "$A", *tail]),
            pair=" ".join([*head, "$A", *tail, *head, "$B", *tail]),
            special_tokens=[(t, i) for _, t, i in template])
    return Tokenizer(inner)


def _merges(file: GGUFFile) -> list[tuple[str, str]] | None:
    merges = file.value("tokenizer.ggml.merges")
    if merges is None:
        return None
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ValueError(f"{file.path}: tokenizer merge {merge!r} is not two tokens")
        pairs.append((left, right))
    return pairs


def _byte_level_bpe(file: GGUFFile, tokens: list[str], types: list[int]
                    ) -> tuple[_HFTokenizer, dict[int, list[str]]]:
    pre = file.value("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(f"{file.path}: unsupported pre-tokenizer {pre!r}; supported: "
                         f"{', '.join(PRE_TOKENIZER_SPLITS)}")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token the file spells outside the byte alphabet is respelled byte by byte, as the
    # merges spell it.
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode())
               for t in tokens]
    merges = _merges(file)
    if merges is None:
        raise ValueError(f"{file.path}: a byte-level BPE tokenizer needs tokenizer.ggml.merges")
    inner = _HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated")
              for r in PRE_TOKENIZER_SPLITS[pre]]
    inner.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    inner.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a mislabel in the file: not special.
    specials = {
        _CONTROL: [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet],
        _USER_DEFINED: [t for t, k in zip(spelled, types) if k == _USER_DEFINED],
    }
    return inner, specials


def _sentencepiece_bpe(file: GGUFFile, tokens: list[str], types: list[int]
                       ) -> tuple[_HFTokenizer, dict[int, list[str]]]:
    gemma = file.architecture in _GEMMA_ARCHITECTURES
    spelled = [_SPIECE_SPACE * len(t) if gemma and " " in t and not t.strip() else t
               for t in tokens]
    merges = _merges(file)
    if merges is None:
        scores = file.value("tokenizer.ggml.scores")
        if gemma:
            scores = np.arange(0, -len(spelled), -1, dtype=np.float64)
        elif scores is None or len(scores) != len(spelled):
            raise ValueError(f"{file.path}: a SentencePiece tokenizer needs "
                             "tokenizer.ggml.merges or one score per token")
        merges = merges_from_scores(spelled, scores)
    unk = file.value("tokenizer.ggml.unknown_token_id")
    vocab = {t: i for i, t in enumerate(spelled)}
    inner = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                    unk_token=spelled[int(unk)] if unk is not None else None))
    # Gemma's SentencePiece model adds no dummy prefix, whatever the file says (transformers).
    prefix = not gemma and bool(file.value("tokenizer.ggml.add_space_prefix", True))
    inner.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPIECE_SPACE, prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    inner.decoder = decoders.Sequence(steps)
    # A respelled user-defined token (Gemma's space runs) is left to the merges, as in
    # transformers; the rest are matched whole in the text.
    specials = {_CONTROL: [t for t, k in zip(spelled, types) if k == _CONTROL],
                _USER_DEFINED: [t for t, s, k in zip(tokens, spelled, types)
                                if k == _USER_DEFINED and t == s]}
    return inner, specials


# Polynomial hashing of substrings modulo 2**64 (numpy's uint64 arithmetic wraps): an odd base,
# so that it has an inverse.
_BASE = 0x9E3779B97F4A7C15
_BASE_INVERSE = pow(_BASE, -1, 1 << 64)
# Every hash is also multiplied by this odd constant (a bijection, so no new collisions): it
# spreads small values, such as a one-character token's code point, over the top bits that
# pick a hash-table bucket.
_SPREAD = 0xD6E8FEB86659FD93
# Tokens whose split points are looked up together (~100,000 split points for Gemma 3).
_TOKENS_PER_CHUNK = 16384


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]
                       ) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges, implied by its vocabulary: every split of a token into two
    tokens, ordered as transformers orders them (best-scored merged token first, then the longer
    left piece, then vocabulary order).

    Vectorized, as Gemma 3's 262,144 tokens have about 1.2 million split points: each split's
    two pieces are hashed from prefix sums over all the tokens' code points (the same text
    hashes the same wherever it sits), looked up in a hash table of the tokens' hashes, and
    every match is then checked character by character."""
    count = len(tokens)
    codes = np.frombuffer("".join(tokens).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=count)
    starts = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    total = len(codes)
    # sums[i] = sum of codes[j] * BASE**j for j < i; the hash of codes[a:b] is
    # (sums[b] - sums[a]) * BASE**-a * SPREAD, which does not depend on where the text sits.
    powers = np.empty(total + 1, dtype=np.uint64)
    powers[0] = 1
    np.cumprod(np.full(total, _BASE, dtype=np.uint64), out=powers[1:])
    inverses = np.empty(total + 1, dtype=np.uint64)
    inverses[0] = 1
    np.cumprod(np.full(total, _BASE_INVERSE, dtype=np.uint64), out=inverses[1:])
    inverses *= np.uint64(_SPREAD)
    sums = np.zeros(total + 1, dtype=np.uint64)
    np.cumsum(codes * powers[:total], out=sums[1:])

    def hashes(begin: np.ndarray, end: np.ndarray) -> np.ndarray:
        return (sums[end] - sums[begin]) * inverses[begin]

    token_hashes = hashes(starts[:-1], starts[1:])
    by_hash = np.argsort(token_hashes, kind="stable")
    sorted_hashes = token_hashes[by_hash]
    # A hash table over the sorted hashes: bucket b (the top bits, 2-4 buckets per token) holds
    # sorted_hashes[first[b]:first[b + 1]], a few probes where a binary search takes ~18.
    bits = count.bit_length() + 1
    shift = np.uint64(64 - bits)
    first = np.zeros((1 << bits) + 1, dtype=np.int64)
    np.cumsum(np.bincount((sorted_hashes >> shift).astype(np.int64), minlength=1 << bits),
              out=first[1:])
    # Hashes of two or more tokens: duplicate tokens or (not seen in practice) a collision.
    shared = sorted_hashes[1:][sorted_hashes[1:] == sorted_hashes[:-1]]

    def text(begin: int, end: int) -> str:
        return "".join(map(chr, codes[begin:end].tolist()))

    @functools.cache
    def vocab() -> dict[str, int]:
        """Tokens by spelling (a duplicate: its last copy), built only if shared hashes or a
        collision need it."""
        return {t: i for i, t in enumerate(tokens)}

    def lookup(begin: np.ndarray, end: np.ndarray) -> np.ndarray:
        """The token with the hash and length of codes[begin:end], for each pair, or -1; a
        shared hash is resolved by the text."""
        wanted = hashes(begin, end)
        bucket = (wanted >> shift).astype(np.int64)
        at, stop = first[bucket], first[bucket + 1]
        ids = np.full(len(wanted), -1, dtype=np.int64)
        probing = np.flatnonzero(at < stop)
        while len(probing):
            hit = sorted_hashes[at[probing]] == wanted[probing]
            ids[probing[hit]] = by_hash[at[probing[hit]]]
            at[probing] += 1
            probing = probing[~hit & (at[probing] < stop[probing])]
        ids[(ids >= 0) & (lengths[ids] != end - begin)] = -1  # another length: a collision
        if len(shared):
            for i in np.flatnonzero(np.isin(wanted, shared)).tolist():
                ids[i] = vocab().get(text(begin[i], end[i]), -1)
        return ids

    # The last copy of a duplicate token is the one that splits.
    splits = (np.fromiter((vocab()[t] == i for i, t in enumerate(tokens)), dtype=bool,
                          count=count) if len(shared) else np.ones(count, dtype=bool))
    # A few thousand tokens at a time: each step's arrays stay small, in memory the process
    # has already touched, instead of a few hundred megabytes of fresh pages for all at once.
    found = []
    for chunk in range(0, max(count, 1), _TOKENS_PER_CHUNK):
        ids = np.arange(chunk, min(count, chunk + _TOKENS_PER_CHUNK))
        ids = ids[splits[ids] & (lengths[ids] > 1)]
        # Every split point: a position inside a token (not its first character).
        points = lengths[ids] - 1
        owner = np.repeat(ids, points)
        # The k-th split point of a token (k from 0) sits k + 1 characters past its start.
        split = np.arange(len(owner)) + np.repeat(starts[ids] + 1 - (np.cumsum(points) - points),
                                                  points)
        left = lookup(starts[owner], split)
        split, owner, left = split[left >= 0], owner[left >= 0], left[left >= 0]
        right = lookup(split, starts[owner + 1])
        split, owner, left, right = split[right >= 0], owner[right >= 0], left[right >= 0], \
            right[right >= 0]
        # Equal hashes and lengths, checked character by character: a piece whose hash
        # collides with a token of another spelling (not seen in practice) is no merge.
        equal = _spells(codes, starts[owner], split, starts[owner + 1], starts[left],
                        starts[right])
        found.append((split[equal], owner[equal], left[equal], right[equal]))
    split, owner, left, right = (np.concatenate(parts) for parts in zip(*found))
    score = np.asarray(scores, dtype=np.float64)[owner]
    left_length = split - starts[owner]
    right_length = starts[owner + 1] - split
    # lexsort: the last key first; it is stable, so vocabulary order breaks the remaining ties.
    order = np.lexsort((owner, -right_length, -left_length, -score))
    spellings = np.array(tokens, dtype=object)
    return list(zip(spellings[left[order]].tolist(), spellings[right[order]].tolist()))


def _spells(codes: np.ndarray, begin: np.ndarray, split: np.ndarray, end: np.ndarray,
            left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Whether codes[begin[i]:end[i]] == codes[left[i]:left[i] + split[i] - begin[i]] +
    codes[right[i]:right[i] + end[i] - split[i]] for each i, in one pass over the texts."""
    lengths = end - begin
    if not len(lengths):
        return np.zeros(0, dtype=bool)
    # Each character of the texts, and how far its copy in the pieces lies from it.
    pieces = np.empty(2 * len(lengths), dtype=np.int64)
    pieces[0::2], pieces[1::2] = split - begin, end - split
    shifts = np.empty(2 * len(lengths), dtype=np.int64)
    shifts[0::2], shifts[1::2] = left - begin, right - split
    ends = np.cumsum(lengths)
    at = np.repeat(begin - (ends - lengths), lengths)
    at += np.arange(len(at))
    copies = at + np.repeat(shifts, pieces)
    differs = np.flatnonzero(codes[at] != codes[copies])
    equal = np.ones(len(lengths), dtype=bool)
    equal[np.searchsorted(ends, differs, side="right")] = False
    return equal
