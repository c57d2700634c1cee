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
from ..models import cache_kw
from ..sampling import probs_from, sample
from ..verify import DraftTree
from . import head_rows


def check_same_tokenizer(target_tok, draft_tok, target_name: str = "target", draft_name: str = "draft") -> None:
    """A draft must speak the target's vocabulary: same size and same token -> id map."""
    if len(target_tok) != len(draft_tok) or target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(
            f"tokenizer mismatch: {target_name} has {len(target_tok)} tokens, {draft_name} has {len(draft_tok)}"
            f"{'' if len(target_tok) != len(draft_tok) else ' with a different token->id map'}; speculative decoding "
            "needs a draft with the target's tokenizer (e.g. a smaller model of the same family)")


class DraftModelDrafter(Drafter):
    """gamma tokens per step from a small causal LM sharing the target's vocabulary.

    ``vocab``: optional [Vd] target token ids the draft may propose (a reduced output layer, as in
    EAGLE-3's d2t/t2d): only those rows of the LM head are computed, which cuts the draft's largest
    cost for a small model with a 49k vocabulary. q is the softmax over that subset, scattered into
    the full vocabulary (zero elsewhere) — still exactly the distribution the token was sampled
    from, so verification stays lossless; tokens outside the subset are never proposed.

    ``draft_model`` may be a ``fastpath.FastTarget``: its forwards then run on a static cache (compiled, or eager
    with compile=False), the reduced vocabulary given to it (``FastTarget(draft, vocab=...)``). The bench runs the
    draft that way when the target's forward is compiled.
    """

    def __init__(self, draft_model, gamma: int = 4, vocab: torch.Tensor | None = None):
        from ..fastpath import FastTarget

        if not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma (draft tokens per step) must be an int >= 1, got {gamma!r}")
        self.model = draft_model
        self.gamma = gamma
        # a FastTarget draft (its forwards on a static cache, compiled or not) computes its own output rows
        self.fast = isinstance(draft_model, FastTarget)
        if self.fast:
            if vocab is not None:
                raise ValueError("a FastTarget draft computes its own output layer: give the reduced vocabulary to "
                                 "FastTarget(draft, vocab=...), not to the drafter")
            self.head, self.vocab = None, draft_model.vocab
        else:
            head, self.vocab = head_rows(draft_model.get_output_embeddings().weight, vocab)
            self.head = head.contiguous()  # [V, H] or [Vd, H]
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
        self.cache = self._new_cache(len(state.tokens))
        self.cached = []

    def _new_cache(self, n: int):
        """A cache for a sequence of ``n`` tokens and one step's drafts (a static one sized for it when fast)."""
        return self.model.new_cache(n + self.gamma) if self.fast else new_cache(self.model)

    def _logits(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The draft's logits [V] (or [Vd]) after feeding ``ids`` [1, n] at positions ``pos``; the cache grows."""
        if self.fast:  # every position's logits: the graphs warmed up per bucket (a block's last row is taken)
            return self.model(input_ids=ids, position_ids=pos, cache=self.cache).logits[0, -1]
        out = self.model.model(input_ids=ids, position_ids=pos, **cache_kw(self.cache), use_cache=True)
        return out.last_hidden_state[0, -1] @ self.head.T

    @torch.inference_mode()
    def propose(self, state: SpecState) -> DraftTree:
        dev = self.model.device
        toks, qs = [], []
        if self.fast and len(state.tokens) + self.gamma > self.cache.capacity:
            self.cache, self.cached = self._new_cache(len(state.tokens)), []  # outgrown: a larger one, refilled
        pending = state.tokens[len(self.cached):]  # committed tokens the draft has not seen yet
        for _ in range(self.gamma):
            ids = torch.tensor([pending], device=dev)
            pos = torch.arange(len(self.cached), len(self.cached) + len(pending), device=dev)[None]
            logits = self._logits(ids, pos)  # [V] or [Vd]
            self.forwards += 1
            self.cached.extend(pending)
            q = probs_from(logits, state.sampling)  # float32: the distribution we sample from
            i = int(sample(q, state.generator)) if not state.sampling.greedy else int(q.argmax())
            if self.vocab is not None:
                x = int(self.vocab[i])
                q = torch.zeros(self.model.config.vocab_size, device=q.device).index_copy_(0, self.vocab, q)
            else:
                x = i
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


# --------------------------------------------------------------------------- the distilled draft model

DEFAULT_LAYERS_FROM = (0, 1, 29)  # which target layers initialise the draft's layers


def build_draft_model(target, layers_from: tuple[int, ...] = DEFAULT_LAYERS_FROM):
    """A small causal LM made from the target: a few of its decoder layers (copied, trainable), its final
    norm (copied, trainable) and its embedding / tied LM head (shared storage, frozen).

    Sharing the embedding keeps the draft's checkpoint to its layers (~3.5M parameters each for SmolLM2)
    and guarantees the draft speaks the target's vocabulary.
    """
    import copy

    from transformers import AutoModelForCausalLM

    L = target.config.num_hidden_layers
    bad = [i for i in layers_from if not 0 <= i < L]
    if not layers_from or bad:
        raise ValueError(f"layers_from must be target layer indices in [0, {L}), got {layers_from}")
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = len(layers_from)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [target.config.layer_types[i] for i in layers_from]
    draft = AutoModelForCausalLM.from_config(cfg, dtype=target.dtype)
    with torch.no_grad():
        for j, i in enumerate(layers_from):
            draft.model.layers[j].load_state_dict(target.model.layers[i].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
    emb = torch.nn.Parameter(target.get_input_embeddings().weight, requires_grad=False)  # same storage, frozen
    draft.model.embed_tokens.weight = emb
    draft.lm_head.weight = torch.nn.Parameter(target.get_output_embeddings().weight, requires_grad=False)
    draft.to(target.device)
    draft.specbook_layers_from = tuple(layers_from)
    return draft


def trainable_state(draft) -> dict:
    return {k: v for k, v in draft.state_dict().items() if not k.startswith(("model.embed_tokens", "lm_head"))}


class DraftModelObjective:
    """Distillation: KL(p_target || q_draft) at every response position (teacher = target's cached final
    hidden state through the frozen LM head)."""

    kind = "draft_model"

    def __init__(self, target, layers_from: tuple[int, ...] = DEFAULT_LAYERS_FROM, feature_index: int = 0):
        self.draft = build_draft_model(target, layers_from)
        self.draft.float()  # master weights in fp32; the loop autocasts to bf16 where that is native
        self.module = self.draft
        self.layers_from = tuple(layers_from)
        self.fi = feature_index  # which cached layer is the final hidden state

    def _logits(self, batch):
        h = self.draft.model(input_ids=batch.tokens).last_hidden_state  # [B, S, H]
        W = self.draft.lm_head.weight
        q_logits = (h[batch.mask]) @ W.T.to(h.dtype)  # [M, V]
        ht = batch.feats[:, :, self.fi, :][batch.mask].to(h.dtype)  # [M, H]
        p_logits = ht @ W.T.to(h.dtype)  # [M, V]
        return p_logits.float(), q_logits.float()

    def loss(self, batch):
        p_logits, q_logits = self._logits(batch)
        logp = torch.log_softmax(p_logits, -1)
        logq = torch.log_softmax(q_logits, -1)
        kl = (logp.exp() * (logp - logq)).sum(-1).mean()
        return kl, {"top1": float((p_logits.argmax(-1) == q_logits.argmax(-1)).float().mean())}

    def evaluate(self, batch):
        p_logits, q_logits = self._logits(batch)
        p, q = torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)
        return {"top1_agree": float((p.argmax(-1) == q.argmax(-1)).float().mean()),  # greedy acceptance
                "alpha_T1": float(torch.minimum(p, q).sum(-1).mean())}  # 1 - TV: acceptance at T=1

    def card_config(self) -> dict:
        return {"layers_from": list(self.layers_from)}

    def state(self) -> dict:
        return trainable_state(self.draft)


def load_draft_model(target, path):
    """Build the draft for ``target`` from a checkpoint (refuses one trained for another target)."""
    from ..training import CheckpointError, load_checkpoint

    state, card = load_checkpoint(path, target=target, kind="draft_model")
    draft = build_draft_model(target, tuple(card["config"]["layers_from"]))
    missing, unexpected = draft.load_state_dict({k: v.to(target.dtype) for k, v in state.items()}, strict=False)
    if unexpected or [k for k in missing if not k.startswith(("model.embed_tokens", "lm_head"))]:
        raise CheckpointError(f"{path}: weights do not match a draft_model with layers {card['config']['layers_from']}")
    return draft.eval(), card
