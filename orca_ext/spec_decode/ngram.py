"""N-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of a
request's last n tokens in its own prompt and output (llama.cpp's lookup, vLLM's ``ngram``)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..request import Request


def ngram_proposal(tokens: np.ndarray, lookup_min: int, lookup_max: int, k: int) -> list[int]:
    """Up to ``k`` tokens following the latest earlier occurrence of the longest suffix of
    ``tokens`` (``lookup_max`` down to ``lookup_min`` long) found again in ``tokens``."""
    length = len(tokens)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        # Window i covers tokens i .. i+n-1; only windows with a token after them (i+n < length)
        # and before the suffix itself.
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """Proposals from each request's own tokens; holds no state."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, requests: Sequence[tuple[Request, int]]) -> list[list[int]]:
        return [ngram_proposal(np.asarray(request.all_token_ids, dtype=np.int64),
                               self.lookup_min, self.lookup_max, k) for request, k in requests]

    def drop(self, request_ids: Iterable[int]) -> None:
        pass
