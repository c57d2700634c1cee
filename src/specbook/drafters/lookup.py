"""Prompt lookup decoding (Saxena 2023): draft by copying what followed the last n-gram earlier in the context.

No model at all: find the most recent earlier occurrence of the context's last n tokens
(n from ``max_ngram`` down to ``min_ngram``) and propose the ``k`` tokens that followed it.
Deterministic, so q is one-hot (``DraftTree.q = None``) and verification stays lossless.
"""

from __future__ import annotations

import torch

from ..decoding import Drafter, SpecState
from ..verify import DraftTree


def find_continuation(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """The up-to-``k`` tokens that followed the latest earlier match of the longest matching suffix n-gram."""
    L = len(tokens)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = tokens[L - n:]
        # scan right to left, excluding the suffix itself
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                cont = tokens[start + n:start + n + k]
                if cont:
                    return cont
    return []


class PromptLookupDrafter(Drafter):
    def __init__(self, k: int = 10, max_ngram: int = 3, min_ngram: int = 1):
        if k < 1:
            raise ValueError(f"k (tokens to propose) must be >= 1, got {k}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram
        self.forwards = 0

    def propose(self, state: SpecState) -> DraftTree:
        cont = find_continuation(state.tokens, self.k, self.max_ngram, self.min_ngram)
        return DraftTree.chain(torch.tensor(cont, dtype=torch.long))
