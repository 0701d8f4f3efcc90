"""A GGUF file's tokenizer as a ``tokenizers.Tokenizer``, built from the file's metadata as
transformers' GGUF loader builds it: byte-level BPE (``tokenizer.ggml.model`` ``gpt2``) with the
pre-tokenizer ``tokenizer.ggml.pre`` names, or SentencePiece BPE (``llama``: Llama 2, Mistral,
Gemma) with byte fallback and the merges its vocabulary implies. Control tokens become special
added tokens, user-defined ones (Gemma's ``\\n`` runs) plain added tokens, both matched whole in
the text before BPE."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from .. import _C
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
# GPT-4o's o200k split (Phi-4-mini) and Mistral's tekken (Mistral Nemo): a letter run ends where
# a lowercase run follows capitals ("HelloWorld": "Hello", "World"); o200k keeps contractions on
# the word and digits in threes, tekken has no contractions and splits every digit.
_UPPER_THEN_LOWER = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
_UPPER_RUN = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_O200K_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O_SPLIT = (f"{_UPPER_THEN_LOWER}{_CONTRACTION}|{_UPPER_RUN}{_CONTRACTION}"
                rf"|\p{{N}}{{1,3}}{_O200K_REST}")
_TEKKEN_SPLIT = rf"{_UPPER_THEN_LOWER}|{_UPPER_RUN}|\p{{N}}{_O200K_REST}"
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,), "gpt2": (_GPT2_SPLIT,), "gpt-2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT), "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT), "codeshell": (r"\p{N}", _GPT2_SPLIT),
    "llama3": (_LLAMA3_SPLIT,), "llama-v3": (_LLAMA3_SPLIT,), "llama-bpe": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,), "dbrx": (_LLAMA3_SPLIT,), "falcon3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,), "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    "gpt-4o": (_GPT4O_SPLIT,), "tekken": (_TEKKEN_SPLIT,),
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
    bad = next((merge for merge in merges if " " not in merge), None)
    if bad is not None:
        raise ValueError(f"{file.path}: tokenizer merge {bad!r} is not two tokens")
    return [tuple(merge.split(" ", 1)) for merge in merges]


def _byte_level_bpe(file: GGUFFile, tokens: list[str], types: list[int]
                    ) -> tuple[_HFTokenizer, dict[int, list[str]]]:
    pre = file.value("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(f"{file.path}: unsupported pre-tokenizer {pre!r}; supported: "
                         f"{', '.join(PRE_TOKENIZER_SPLITS)}")
    spelling = bytes_to_unicode()
    # The characters of the file's tokens outside the byte alphabet (usually none: found in
    # one pass over the whole vocabulary, not token by token).
    outside = set("".join(tokens)) - set(spelling.values())
    # A token the file spells outside the byte alphabet is respelled byte by byte, as the
    # merges spell it.
    spelled = [t if outside.isdisjoint(t) else "".join(spelling[b] for b in t.encode())
               for t in tokens] if outside else tokens
    merges = _merges(file)
    if merges is None:
        raise ValueError(f"{file.path}: a byte-level BPE tokenizer needs tokenizer.ggml.merges")
    inner = _HFTokenizer(models.BPE(vocab=dict(zip(spelled, range(len(spelled)))), merges=merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated")
              for r in PRE_TOKENIZER_SPLITS[pre]]
    inner.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    inner.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a mislabel in the file: not special.
    specials = {
        _CONTROL: [t for t, k in zip(tokens, types) if k == _CONTROL and outside.isdisjoint(t)],
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
    vocab = dict(zip(spelled, range(len(spelled))))  # a spelled-twice token: its last id
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


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]
                       ) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges, implied by its vocabulary: every split of a token into two
    tokens, ordered as transformers orders them (best-scored merged token first, then the longer
    left piece, then vocabulary order); a duplicated token splits as its last copy. Gemma 3's
    262,144 tokens have about 1.2 million split points: the compiled core finds them."""
    return _C.sentencepiece_merges(list(tokens), np.asarray(scores, dtype=np.float64).tolist())
