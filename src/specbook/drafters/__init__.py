"""One module per method; each defines a Drafter (decoding.Drafter protocol)."""

import torch
from torch import nn


class RMSNorm32(nn.RMSNorm):
    """RMSNorm computed in fp32 and returned in the input's dtype (the target's own norm does the same).

    A bf16 activation meeting an fp32 weight under autocast would otherwise fall off torch's fused kernel
    with a warning; same parameters and state-dict names as ``nn.RMSNorm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.float()
        return nn.functional.rms_norm(x.float(), self.normalized_shape, w, self.eps).to(x.dtype)


def with_vocab(state: dict, vocab: torch.Tensor | None) -> dict:
    """A checkpoint's tensors plus the head vocabulary it proposes from (stored as int64 "vocab"), if reduced."""
    st = dict(state)
    if vocab is not None:
        st["vocab"] = vocab.to(torch.int64)
    return st


def head_rows(W: torch.Tensor, vocab) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An LM head [V, H] restricted to a reduced draft vocabulary: (rows [Vd, H], vocab [Vd] long on W's device).

    ``vocab`` = None keeps the full head. A reduced vocabulary must be a non-empty 1-D list of token ids in
    [0, V) (EAGLE-3's d2t idea: computing only frequent rows is the largest saving for a small draft).
    """
    if vocab is None:
        return W, None
    V = W.shape[0]
    vocab = torch.as_tensor(vocab, dtype=torch.long, device=W.device)
    if vocab.ndim != 1 or len(vocab) < 1 or int(vocab.min()) < 0 or int(vocab.max()) >= V:
        raise ValueError(f"vocab must be a 1-D list of token ids in [0, {V}), got shape {tuple(vocab.shape)}")
    return W.index_select(0, vocab), vocab
