"""THE verification core: greedy and lossless rejection sampling over a draft chain or tree.

Notation (Leviathan et al. 2023, Chen et al. 2023):  **p = target, q = draft.**

A draft is a tree given by a parents array (a chain is the tree with parents[i] = i - 1).
Node i carries token x_i and q_i, the distribution x_i was drawn from (one-hot for
deterministic picks such as top-k children or prompt lookup). The target scores the root
(the last committed token) and every node in one forward, giving p_root and p_i.

Lossless rule (chain: Leviathan Alg. 1; tree: recursive rejection over siblings, as in
SpecInfer / EAGLE), walking down from the root:

    p <- p(node)
    for each child c of node, in order:
        accept c with probability min(1, p(x_c) / q_c(x_c))        -> descend into c
        otherwise p <- norm(max(0, p - q_c))                       -> try the next sibling
    no child accepted:  emit a correction sampled from p (the residual)
    leaf reached:       emit a bonus token sampled from p(leaf)

For a chain this is exactly Leviathan's algorithm. Siblings must be i.i.d. draws from one q, distinct
one-hot picks, or draws WITHOUT replacement from one q whose rows say so: sibling i carries q_i = q with
the earlier siblings' tokens removed and renormalized — the distribution it was drawn from. The same rule
then is Recursive Speculative Decoding's (Jeon et al. 2024): accept x_i with min(1, p_i(x_i) / q_i(x_i)),
else p_{i+1} = norm(max(0, p_i - q_i)). Every emitted token is distributed as the target's.

Greedy (temperature 0): descend into the child whose token equals argmax p; correction = argmax.

Typical acceptance (Medusa) is *lossy* and lives in ``typical_accept`` with that label.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal, get_args

import torch

from .sampling import SamplingConfig, probs_from, sample
from .tree import children_of as _children
from .tree import depths

Children = Literal["onehot", "iid", "noreplace"]
CHILDREN = get_args(Children)


@dataclass
class DraftTree:
    """What a drafter proposes. N nodes; node i's parent is ``parents[i]`` (-1 = the root).

    tokens  [N] long     the drafted tokens
    parents [N] long     parent index, topologically ordered (parents[i] < i)
    q       [N, V] f32   the distribution node i was sampled from, or None (all one-hot)
    confidence [N]       optional drafter confidence (EAGLE-2 / DSpark scheduling)
    children             how siblings were drawn — the contract that makes verification lossless:
                         "onehot": deterministic picks (q = None; duplicates are wasted, never wrong);
                         "iid": independent draws from ONE q per parent (every sibling carries the same q row);
                         "noreplace": draws without replacement from one q, in draw order, sibling i carrying
                         q with siblings < i removed and renormalized (``sampling.without_replacement_rows``).
                         Default: "onehot" when q is None, else "iid".
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    children: Children | None = None

    def __post_init__(self):
        n = self.tokens.shape[0]
        if self.parents.shape != (n,):
            raise ValueError(f"parents must have shape [{n}], got {tuple(self.parents.shape)}")
        if n and bool((self.parents >= torch.arange(n, device=self.parents.device)).any()):
            raise ValueError("parents must be topologically ordered (parents[i] < i)")
        if n and bool((self.parents < -1).any()):
            raise ValueError("parents must be -1 (root) or a node index")
        if self.q is not None and self.q.shape[0] != n:
            raise ValueError(f"q must have one row per node ({n}), got {self.q.shape[0]}")
        if self.children is None:
            self.children = "onehot" if self.q is None else "iid"
        if self.children not in CHILDREN:
            raise ValueError(f"children must be one of {CHILDREN} (how siblings were drawn), got {self.children!r}")
        if (self.children == "onehot") != (self.q is None):
            raise ValueError(f"children={self.children!r} with q {'missing' if self.q is None else 'given'}: one-hot "
                             "picks carry q=None, i.i.d. draws carry the q they were drawn from")

    @staticmethod
    def chain(tokens: torch.Tensor, q: torch.Tensor | None = None) -> "DraftTree":
        n = tokens.shape[0]
        return DraftTree(tokens, torch.arange(-1, n - 1, device=tokens.device), q)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @cached_property
    def is_chain(self) -> bool:
        n = len(self)
        return bool(torch.equal(self.parents.cpu(), torch.arange(-1, n - 1)))

    @cached_property
    def depths(self) -> torch.Tensor:
        """[N] depth of every node (children of the root: 0); computed once per draft."""
        return depths(self.parents.cpu())

    def truncate_depth(self, max_depth: int) -> "DraftTree":
        """The sub-tree of nodes with depth < ``max_depth`` (closed under ancestors; parents re-indexed)."""
        keep = (self.depths < max_depth).nonzero().flatten()
        new = torch.full((len(self),), -1, dtype=torch.long)
        new[keep] = torch.arange(len(keep))
        par = self.parents.cpu()[keep]
        parents = torch.where(par >= 0, new[par.clamp_min(0)], par).to(self.parents.device)
        pick = keep.to(self.tokens.device)
        return DraftTree(self.tokens[pick], parents, None if self.q is None else self.q[keep.to(self.q.device)],
                         None if self.confidence is None else self.confidence[keep.to(self.confidence.device)],
                         self.children)

    def check_siblings(self) -> None:
        """Raise if siblings break their rule's q contract (the cheap part of the contract; verify calls it):
        i.i.d. siblings share one q row; without-replacement siblings are distinct and each row is the
        previous one with the previous sibling's token removed and renormalized."""
        if self.children == "onehot" or self.is_chain:
            return
        ch = _children(self.parents.tolist(), len(self))
        toks = self.tokens.tolist()
        for parent, kids in ch.items():
            for a, c in zip(kids, kids[1:]):
                if self.children == "iid":
                    if not torch.equal(self.q[c], self.q[kids[0]]):
                        raise ValueError(f"siblings {kids[0]} and {c} (children of {parent}) carry different q rows: "
                                         "i.i.d. siblings must all be drawn from one distribution")
                    continue
                want = self.q[a].float().clone()
                want[toks[a]] = 0
                if toks[c] in [toks[x] for x in kids[:kids.index(c)]] or \
                        not torch.allclose(self.q[c].float(), want / want.sum(), atol=1e-6):
                    raise ValueError(f"sibling {c} (child of {parent}) is not a draw without replacement after {a}: "
                                     "its token must be new and its q the previous row minus the previous token")


@dataclass
class VerifyResult:
    path: list[int]  # accepted node indices, root to deepest
    next_token: int  # correction (first rejection) or bonus (everything on the path accepted down to a leaf)
    bonus: bool  # True when next_token is a bonus token
    tested: list[tuple[int, bool]]  # (depth, accepted) per tested node: conditional per-position acceptance

    @property
    def n_accepted(self) -> int:
        return len(self.path)


def accept_prob(px: float, qx: float) -> float:
    """min(1, p(x) / q(x)): the probability of keeping a token x drawn from q."""
    return min(1.0, px / qx)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); falls back to p when p <= q everywhere (only reachable through rounding)."""
    r = (p - q).clamp_min(0)
    s = r.sum()
    return r / s if s > 1e-12 else p


def residual_one_hot(p: torch.Tensor, x: int) -> torch.Tensor:
    """norm(max(0, p - onehot(x))) = p with x removed, renormalised (a deterministic pick was rejected)."""
    r = p.clone()
    r[x] = 0
    s = r.sum()
    return r / s if s > 1e-12 else p


def verify(p: torch.Tensor, draft: DraftTree, sampling: SamplingConfig, generator: torch.Generator | None = None,
           *, p_is_probs: bool = False) -> VerifyResult:
    """Verify one draft against target scores ``p`` [N + 1, V]: row 0 = root, row i + 1 = node i.

    ``p`` are logits unless ``p_is_probs``; the sampling config (temperature, top-k, top-p) turns them
    into the target distribution exactly as plain decoding would. ``draft.q`` must have been computed
    with the same config from the draft's logits (the drafter's job).
    """
    n = len(draft)
    if p.shape[0] != n + 1:
        raise ValueError(f"p must have N + 1 = {n + 1} rows (root + nodes), got {p.shape[0]}")
    draft.check_siblings()
    tokens = draft.tokens.tolist()
    ch = _children(draft.parents.tolist(), n)
    depth = draft.depths.tolist()
    tested: list[tuple[int, bool]] = []
    path: list[int] = []

    if sampling.greedy:  # deterministic: no random numbers
        return _verify_greedy(p.argmax(-1).tolist(), tokens, ch, depth)

    if generator is None:
        raise ValueError("lossless verification at temperature > 0 needs an explicit torch.Generator")
    P = p.float() if p_is_probs else probs_from(p, sampling)  # [N + 1, V] float32
    node = -1
    cur = P[0]
    while True:
        nxt = None
        for c in ch[node]:
            x = tokens[c]
            if draft.q is None:
                qc = None
                qx = 1.0
            else:
                qc = draft.q[c].float()
                qx = float(qc[x])
            if qx <= 0:
                raise ValueError(f"draft node {c} has q(x)=0 for its own token {x}: q must be the distribution "
                                 "the token was sampled from")
            px = float(cur[x])
            u = float(torch.rand(1, generator=generator, device=P.device))
            ok = u < accept_prob(px, qx)
            tested.append((depth[c], ok))
            if ok:
                nxt = c
                break
            if qc is None:  # one-hot q: the residual removes x and renormalises
                cur = residual_one_hot(cur, x)
            else:
                cur = residual(cur, qc)
        if nxt is None:
            tok = int(sample(cur, generator))
            return VerifyResult(path, tok, bonus=not ch[node], tested=tested)
        path.append(nxt)
        node = nxt
        cur = P[node + 1]


def _verify_greedy(best: list[int], tokens: list[int], ch: dict[int, list[int]], depth: list[int]) -> VerifyResult:
    """Temperature 0: descend into the child whose token is the target's argmax ``best[node + 1]``."""
    tested: list[tuple[int, bool]] = []
    path: list[int] = []
    node = -1
    while True:
        want = best[node + 1]
        nxt = None
        for c in ch[node]:
            ok = tokens[c] == want
            tested.append((depth[c], ok))
            if ok:
                nxt = c
                break
        if nxt is None:
            return VerifyResult(path, want, bonus=not ch[node], tested=tested)
        path.append(nxt)
        node = nxt


def typical_accept(p_logits: torch.Tensor, draft: DraftTree, sampling: SamplingConfig, eps: float = 0.09,
                   delta: float = 0.3, generator: torch.Generator | None = None) -> VerifyResult:
    """Medusa's typical acceptance — **LOSSY** at T > 0: the output is *not* distributed as the target's.

    Medusa's rule (Cai et al. 2024, sec. 2.3.1): a token x after a node is typical if
    p(x) > min(eps, delta * exp(-H(p))), with p the target's distribution at the run's temperature.
    Every candidate (a root-to-leaf path, tree order) keeps its longest typical prefix; the longest
    prefix over all candidates is accepted (ties: the first candidate). The next token is then drawn
    from the target's distribution at the last accepted node (argmax at temperature 0).
    At temperature 0 this is exactly greedy verification (only the argmax is typical), so it runs
    as ``verify`` there: no 1e-5 temperature, exact on logit ties.
    """
    if sampling.greedy:
        return verify(p_logits, draft, sampling)
    if generator is None:
        raise ValueError("typical acceptance at temperature > 0 needs an explicit torch.Generator")
    from .tree import leaf_paths

    P = probs_from(p_logits, sampling)  # [N + 1, V]
    ent = -(P * P.clamp_min(1e-30).log()).sum(-1)  # [N + 1]
    thresh = torch.minimum(torch.full_like(ent, eps), delta * torch.exp(-ent))
    tokens, parents, depth = draft.tokens.tolist(), draft.parents.tolist(), draft.depths.tolist()
    ok = [float(P[parents[i] + 1, tokens[i]]) > float(thresh[parents[i] + 1]) for i in range(len(draft))]
    best: list[int] = []
    for cand in leaf_paths(draft.parents):
        acc = []
        for i in cand:
            if not ok[i]:
                break
            acc.append(i)
        if len(acc) > len(best):
            best = acc
    # conditional per-position acceptance: every node whose ancestors were all typical was tested
    reach: list[bool] = []
    for i in range(len(draft)):
        reach.append(parents[i] < 0 or (reach[parents[i]] and ok[parents[i]]))
    tested = [(depth[i], ok[i]) for i in range(len(draft)) if reach[i]]
    last = best[-1] if best else -1
    tok = int(sample(P[last + 1], generator))
    has_child = any(p == last for p in parents)
    return VerifyResult(best, tok, bonus=not has_child, tested=tested)
