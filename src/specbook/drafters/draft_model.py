"""Vanilla speculative sampling (Leviathan et al. 2023; Chen et al. 2023) with a separate draft model.

The draft model proposes gamma tokens autoregressively, sampling each from q computed in float32
from its logits with the *same* SamplingConfig as the target; q is returned with the tokens so
verification is exact. The draft keeps its own KV cache; after verification it is cropped back to
the longest prefix of its cached tokens that is still committed (cache.py).
"""

from __future__ import annotations

import torch

from ..cache import crop_to
from ..decoding import Drafter, SpecState, new_cache
from ..sampling import probs_from, sample
from ..verify import DraftTree


def check_same_tokenizer(target_tok, draft_tok, target_name: str = "target", draft_name: str = "draft") -> None:
    """A draft must speak the target's vocabulary: same size and same token -> id map."""
    if len(target_tok) != len(draft_tok) or target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(
            f"tokenizer mismatch: {target_name} has {len(target_tok)} tokens, {draft_name} has {len(draft_tok)}"
            f"{'' if len(target_tok) != len(draft_tok) else ' with a different token->id map'}; speculative decoding "
            "needs a draft with the target's tokenizer (e.g. a smaller model of the same family)")


class DraftModelDrafter(Drafter):
    """gamma tokens per step from a small causal LM sharing the target's vocabulary."""

    def __init__(self, draft_model, gamma: int = 4):
        if not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma (draft tokens per step) must be an int >= 1, got {gamma!r}")
        self.model = draft_model
        self.gamma = gamma
        self.forwards = 0
        self.cache = None
        self.cached: list[int] = []  # tokens whose K/V are in self.cache

    def _check(self, state: SpecState) -> None:
        t, d = state.target, self.model
        if t.config.vocab_size != d.config.vocab_size and t.get_output_embeddings().weight.shape[0] != \
                d.get_output_embeddings().weight.shape[0]:
            raise ValueError(f"vocab size mismatch: target {t.config.vocab_size}, draft {d.config.vocab_size}")
        if t.device != d.device:
            raise ValueError(f"draft model is on {d.device} but the target is on {t.device}; move both to one device")

    def begin(self, state: SpecState) -> None:
        self._check(state)
        self.cache = new_cache(self.model)
        self.cached = []

    @torch.inference_mode()
    def propose(self, state: SpecState) -> DraftTree:
        dev = self.model.device
        toks, qs = [], []
        pending = state.tokens[len(self.cached):]  # committed tokens the draft has not seen yet
        for _ in range(self.gamma):
            ids = torch.tensor([pending], device=dev)
            pos = torch.arange(len(self.cached), len(self.cached) + len(pending), device=dev)[None]
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True,
                             logits_to_keep=1)
            self.forwards += 1
            self.cached.extend(pending)
            q = probs_from(out.logits[0, -1], state.sampling)  # [V] float32, the distribution we sample from
            x = int(sample(q, state.generator)) if not state.sampling.greedy else int(q.argmax())
            toks.append(x)
            qs.append(q)
            pending = [x]
        return DraftTree.chain(torch.tensor(toks, dtype=torch.long), torch.stack(qs))

    def update(self, state: SpecState, draft, result) -> None:
        # keep the longest cached prefix that is still part of the committed sequence
        n = 0
        for a, b in zip(self.cached, state.tokens):
            if a != b:
                break
            n += 1
        n = min(n, len(state.tokens) - 1)
        crop_to(self.cache, n)
        self.cached = self.cached[:n]
