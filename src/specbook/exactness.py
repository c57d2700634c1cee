"""Exact output distributions on tiny models, and empirical checks against them.

With a vocabulary of a dozen tokens every prefix of length <= 2 can be enumerated, so the
*exact* distribution of the first two emitted tokens is computable and any sampler can be
compared to it by total-variation distance. Used by the losslessness tests and notebook 01.
"""

from __future__ import annotations

import itertools

import torch

from .sampling import SamplingConfig, probs_from
from .verify import DraftTree, verify


def logit_table(model, prompt: list[int], depth: int = 2) -> dict[tuple, torch.Tensor]:
    """Next-token logits [V] after ``prompt + prefix`` for every prefix of length <= depth."""
    V = model.config.vocab_size
    out = {}
    with torch.no_grad():
        for L in range(depth + 1):
            group = list(itertools.product(range(V), repeat=L))
            ids = torch.tensor([prompt + list(p) for p in group])
            logits = model(ids).logits[:, -1, :].float()
            out.update({p: logits[i] for i, p in enumerate(group)})
    return out


def exact_first_two(p_logits: dict, cfg: SamplingConfig) -> torch.Tensor:
    """Exact joint distribution [V, V] of the first two tokens the target emits."""
    p1 = probs_from(p_logits[()], cfg)
    V = p1.shape[0]
    return torch.stack([p1[a] * probs_from(p_logits[(a,)], cfg) for a in range(V)]).double()


def speculative_first_two(p_logits: dict, q_logits: dict, cfg: SamplingConfig, n: int, generator: torch.Generator,
                          gamma: int = 2) -> torch.Tensor:
    """Empirical joint [V, V] of the first two tokens from one chain step of ``gamma`` (<= 2) draft tokens.

    The draft samples from q; ``verify`` decides. If the step emits only one token (a correction at
    the first position), the second is drawn from the target itself, as the next step would start there.
    """
    if not 1 <= gamma <= 2:
        raise ValueError("the enumerated tables cover gamma in {1, 2}")
    V = p_logits[()].shape[0]
    counts = torch.zeros(V, V, dtype=torch.float64)
    qcache = {}
    for _ in range(n):
        prefix, toks, qs = (), [], []
        for _ in range(gamma):
            if prefix not in qcache:
                qcache[prefix] = probs_from(q_logits[prefix], cfg)
            q = qcache[prefix]
            x = int(torch.multinomial(q, 1, generator=generator))
            toks.append(x)
            qs.append(q)
            prefix = prefix + (x,)
        rows = torch.stack([p_logits[tuple(toks[:i])] for i in range(gamma + 1)])
        res = verify(rows, DraftTree.chain(torch.tensor(toks), torch.stack(qs)), cfg, generator)
        out = [toks[i] for i in res.path] + [res.next_token]
        if len(out) < 2:
            out.append(int(torch.multinomial(probs_from(p_logits[(out[0],)], cfg), 1, generator=generator)))
        counts[out[0], out[1]] += 1
    return counts / n


def topk_tree(q_logits: dict, width: int = 2) -> DraftTree:
    """A deterministic depth-2 tree of top-``width`` picks (Medusa / EAGLE style, one-hot q): the root's
    children are the ``width`` best tokens of ``q_logits[()]``, each child a's children the best of
    ``q_logits[(a,)]``."""
    toks, parents = [], []
    first = q_logits[()].topk(width).indices.tolist()
    for a in first:
        toks.append(a)
        parents.append(-1)
    for i, a in enumerate(first):
        for b in q_logits[(a,)].topk(width).indices.tolist():
            toks.append(b)
            parents.append(i)
    return DraftTree(torch.tensor(toks), torch.tensor(parents))


def tree_first_two(p_logits: dict, tree: DraftTree, cfg: SamplingConfig, n: int, generator: torch.Generator,
                   accept=None) -> torch.Tensor:
    """Empirical joint [V, V] of the first two emitted tokens when ``tree`` (depth <= 2) is verified at the
    root context; ``accept(p_rows, tree, cfg, generator)`` defaults to the lossless ``verify``."""
    accept = accept or verify
    V = p_logits[()].shape[0]
    toks, par = tree.tokens.tolist(), tree.parents.tolist()

    def path_of(i):
        out = []
        while i >= 0:
            out.append(toks[i])
            i = par[i]
        return tuple(out[::-1])

    rows = torch.stack([p_logits[()]] + [p_logits[path_of(i)] for i in range(len(toks))])
    counts = torch.zeros(V, V, dtype=torch.float64)
    for _ in range(n):
        res = accept(rows, tree, cfg, generator)
        out = [toks[i] for i in res.path] + [res.next_token]
        if len(out) < 2:
            out.append(int(torch.multinomial(probs_from(p_logits[(out[0],)], cfg), 1, generator=generator)))
        counts[out[0], out[1]] += 1
    return counts / n


def loop_first_two(target, drafter, prompt: list[int], cfg: SamplingConfig, n: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Empirical joint [V, V] of the first two tokens from ``n`` runs of the whole speculative loop."""
    from .decoding import speculative_generate

    V = target.config.vocab_size
    counts = torch.zeros(V, V, dtype=torch.float64)
    ids = torch.tensor([prompt])
    for _ in range(n):
        y = speculative_generate(target, drafter, ids, max_new_tokens=2, sampling=cfg, generator=generator,
                                 eos_token_id=-1).tokens[0]
        counts[y[0], y[1]] += 1
    return counts / n


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    """Total-variation distance 0.5 * sum |a - b|."""
    return 0.5 * float((a - b).abs().sum())


def tv_bound(p: torch.Tensor, n: int, factor: float = 1.5) -> float:
    """``factor`` x the expected TV of an n-sample empirical distribution of p, 0.5 * sum sqrt(p(1-p)/n)
    (an upper bound on E|p_hat - p| per cell by Jensen)."""
    return factor * 0.5 * float(torch.sqrt(p * (1 - p) / n).sum())
