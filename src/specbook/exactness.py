"""Exact output distributions on tiny models, and empirical checks against them.

With a vocabulary of a few tokens every prefix of length < k can be enumerated, so the *exact*
joint distribution of the first k emitted tokens is computable and any sampler can be compared
to it by total-variation distance. Used by the losslessness tests and notebook 01.

``check_lossless`` is THE losslessness check every method's test calls: it runs the whole
speculative loop n times for the first k >= 3 tokens (so acceptance at depth >= 1, corrections
after a rejection, bonus tokens and the drafter's state across steps are all exercised), and
compares the empirical joint with the exact one against a noise bound computed the same way:
the TV of n samples drawn from the exact distribution itself, simulated many times.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

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


def exact_joint(p_logits: dict, cfg: SamplingConfig, k: int) -> torch.Tensor:
    """Exact joint distribution [V ** k] (row-major over the k tokens) of the first k tokens the target emits,
    from ``logit_table(model, prompt, depth=k - 1)``."""
    V = p_logits[()].shape[0]
    probs = {pre: probs_from(lg, cfg).double() for pre, lg in p_logits.items() if len(pre) < k}
    out = torch.ones(1, dtype=torch.float64)
    for L in range(k):
        rows = torch.stack([probs[pre] for pre in itertools.product(range(V), repeat=L)])  # [V ** L, V]
        out = (out[:, None] * rows).reshape(-1)
    return out


def loop_joint(target, drafter, prompt: list[int], cfg: SamplingConfig, n: int, generator: torch.Generator,
               k: int = 3, acceptance: str = "exact") -> torch.Tensor:
    """Empirical joint [V ** k] of the first k tokens from ``n`` runs of the whole speculative loop."""
    from .decoding import speculative_generate

    V = target.config.vocab_size
    counts = torch.zeros(V ** k, dtype=torch.float64)
    ids = torch.tensor([prompt])
    for _ in range(n):
        y = speculative_generate(target, drafter, ids, max_new_tokens=k, sampling=cfg, generator=generator,
                                 eos_token_id=-1, acceptance=acceptance).tokens[0]
        counts[sum(t * V ** (k - 1 - i) for i, t in enumerate(y))] += 1
    return counts / n


def noise_floor(exact: torch.Tensor, n: int, generator: torch.Generator, trials: int = 200) -> torch.Tensor:
    """TVs [trials] of n-sample empirical distributions drawn from ``exact`` itself: what a perfect sampler scores."""
    draws = torch.multinomial(exact.float().expand(trials, -1), n, replacement=True, generator=generator)
    emp = torch.zeros(trials, exact.shape[0], dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(draws.shape, dtype=torch.float64)) / n
    return 0.5 * (emp - exact[None]).abs().sum(-1)


@dataclass
class LosslessCheck:
    """The result of ``check_lossless``: ``tv`` of the loop against the exact joint, and the noise ``bound`` =
    the mean + 4 standard deviations of the TV a perfect sampler scores with the same n (``floor`` = that mean)."""

    tv: float
    floor: float
    bound: float
    n: int
    k: int

    @property
    def ok(self) -> bool:
        return self.tv < self.bound

    @property
    def ratio(self) -> float:
        """tv / bound: < 1 passes; a broken variant must score >= 3."""
        return self.tv / self.bound

    def __str__(self) -> str:
        return f"TV {self.tv:.4f} vs bound {self.bound:.4f} (floor {self.floor:.4f}, n {self.n}, k {self.k}): " \
               f"{self.ratio:.2f}x the bound"


def check_lossless(target, drafter, prompt: list[int], cfg: SamplingConfig, *, n: int = 4000, k: int = 3,
                   seed: int = 0, acceptance: str = "exact", table: dict | None = None) -> LosslessCheck:
    """THE losslessness check: the joint of the first ``k`` tokens of ``n`` loop runs with ``drafter`` against the
    target's exact joint (``table`` = ``logit_table(target, prompt, k - 1)`` when already computed), with the noise
    bound from ``noise_floor``. Deterministic given ``seed``. A new method's losslessness test calls this and
    asserts ``.ok``; its broken variant asserts ``.ratio >= 3``."""
    if k < 1 or n < 1:
        raise ValueError(f"need k >= 1 tokens and n >= 1 runs, got k={k}, n={n}")
    table = table if table is not None else logit_table(target, prompt, depth=k - 1)
    exact = exact_joint(table, cfg, k)
    emp = loop_joint(target, drafter, prompt, cfg, n, torch.Generator().manual_seed(seed), k, acceptance)
    floors = noise_floor(exact, n, torch.Generator().manual_seed(seed + 1))
    mean, std = float(floors.mean()), float(floors.std())
    return LosslessCheck(tv(emp, exact), mean, mean + 4 * std, n, k)


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    """Total-variation distance 0.5 * sum |a - b|."""
    return 0.5 * float((a - b).abs().sum())


def tv_bound(p: torch.Tensor, n: int, factor: float = 1.5) -> float:
    """``factor`` x the expected TV of an n-sample empirical distribution of p, 0.5 * sum sqrt(p(1-p)/n)
    (an upper bound on E|p_hat - p| per cell by Jensen)."""
    return factor * 0.5 * float(torch.sqrt(p * (1 - p) / n).sum())
