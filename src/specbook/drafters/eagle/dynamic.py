"""EAGLE-2's dynamic draft tree: expansion by cumulative draft confidence (``grow_dynamic``), reranking
(``select_nodes`` / ``Pool.tree``), and the cost model that sizes it per step from the target's measured
latency curve (``worth_expanding``; ``roofline.auto_size``), reading confidences through the head's
calibration (``confidence_calibration``)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from ...roofline import latency_table, step_rates
from ...verify import DraftTree


def select_nodes(scores: list[float], parents: list[int], total: int) -> list[int]:
    """EAGLE-2 reranking: the ``total`` candidates of highest score whose ancestors are all kept.

    Scores are cumulative log-probabilities, so a child never beats its parent; ties go to the
    shallower / earlier node, which keeps the selection closed under ancestors. Returned in
    topological (input) order.
    """
    if total < 1:
        raise ValueError(f"total_tokens must be >= 1, got {total}")
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    keep: set[int] = set()
    for i in order:
        if len(keep) >= total:
            break
        if parents[i] < 0 or parents[i] in keep:
            keep.add(i)
    return sorted(keep)


def worth_expanding(values: list[float], frontier_mass: float, latency: dict[int, float], max_nodes: int,
                    overhead: float, draft_cost: float) -> bool:
    """Early stop of EAGLE-2's expansion (not in the paper): is one more draft forward worth its time?

    The children of the frontier hold at most ``frontier_mass`` (the frontier's summed path confidence:
    a node's children share its probability). Even if all of it joined the best tree and verification
    cost nothing extra, the rate is at most max_k (1 + S_k + mass) / (overhead + draft_cost + latency(k + 1)).
    Expand only if that beats the best rate of the tree already in hand; later depths hold no more mass
    per forward, so (up to the small growth of latency with the tree) a depth that cannot pay means none
    after it can."""
    now = max(step_rates(values, latency, max_nodes, overhead), default=0.0)
    best, acc = 0.0, 1.0 + frontier_mass
    lat = latency_table(latency, max_nodes + 1)
    for k in range(1, max_nodes + 1):
        acc += values[k - 1] if k <= len(values) else 0.0
        best = max(best, acc / (overhead + draft_cost + lat[k + 1]))
    return best > now


@dataclass
class Pool:
    """Candidate nodes of a dynamic tree, in creation order (parents before children)."""

    tok: list[int] = field(default_factory=list)
    par: list[int] = field(default_factory=list)  # pool index of the parent, -1 = root
    score: list[float] = field(default_factory=list)  # cumulative draft log-probability of the path (sampled
    # trees: of the ranks each node was drawn as, grow_sampled)
    dep: list[int] = field(default_factory=list)  # 0 = child of the root
    q: list = field(default_factory=list)  # sampled children: the q row each was drawn from (else None)

    def add(self, tok: int, par: int, score: float, dep: int, q=None) -> int:
        self.tok.append(tok), self.par.append(par), self.score.append(score), self.dep.append(dep), self.q.append(q)
        return len(self.tok) - 1

    def tree_in_order(self, total: int, children: str) -> DraftTree:
        """Sampled trees: the first ``total`` nodes in creation order (depth by depth) with their q rows — no
        rerank by what was drawn (grow_sampled says why)."""
        n = min(total, len(self.tok))
        return DraftTree(torch.tensor(self.tok[:n], dtype=torch.long), torch.tensor(self.par[:n], dtype=torch.long),
                         q=torch.stack(self.q[:n]), confidence=torch.tensor(self.score[:n]).exp(), children=children)

    def tree(self, total: int) -> DraftTree:
        """EAGLE-2's rerank: keep the ``total`` best nodes (select_nodes), topologically ordered by depth."""
        keep = sorted(select_nodes(self.score, self.par, total), key=lambda j: (self.dep[j], j))
        new = {j: i for i, j in enumerate(keep)}
        parents = torch.tensor([new[self.par[j]] if self.par[j] >= 0 else -1 for j in keep], dtype=torch.long)
        return DraftTree(torch.tensor([self.tok[j] for j in keep], dtype=torch.long), parents,
                         confidence=torch.tensor([self.score[j] for j in keep]).exp())


def grow_dynamic(lp_root: torch.Tensor, expand, depth: int, top_k: int, to_tokens=None, keep_going=None) -> Pool:
    """EAGLE-2's expansion phase.

    lp_root [V]: draft log-probabilities of the root's children. ``expand(pool, frontier)`` runs the
    draft on the frontier nodes and returns their children's log-probabilities [F, V].
    depth 1: the root's top_k children. Each further depth: every frontier node gets its top_k
    children (all join the pool); the top_k of those by cumulative score form the next frontier.
    ``to_tokens`` maps head-vocabulary indices to token ids (reduced vocabularies).
    ``keep_going(pool, frontier)``, if given, is asked before each expansion; False stops growing early.
    """
    to_tokens = to_tokens or (lambda idx: idx.tolist())
    pool = Pool()
    v, i = lp_root.topk(top_k)
    frontier = [pool.add(t, -1, float(s), 0) for t, s in zip(to_tokens(i), v.tolist())]
    for d in range(1, depth):
        if keep_going is not None and not keep_going(pool, frontier):
            break
        lp = expand(pool, frontier)  # [F, V]
        cv, ci = lp.topk(top_k, dim=-1)  # [F, k]
        cum = (cv + torch.tensor([pool.score[j] for j in frontier], device=cv.device)[:, None]).tolist()
        toks = to_tokens(ci.reshape(-1))
        children = [pool.add(toks[r * top_k + c], j, cum[r][c], d) for r, j in enumerate(frontier) for c in range(top_k)]
        frontier = sorted(heapq.nlargest(top_k, children, key=lambda j: (pool.score[j], -j)))
    return pool


def confidence_calibration(card: dict, temperature: float = 0.0) -> float:
    """How many accepted tokens one unit of draft confidence is worth, from the head's held-out card: the
    acceptance of the top-1 guess (greedy: ``top1``; sampling: ``soft_r0`` = E[p_target(guess)]) over the
    draft's mean top-1 confidence ``conf_r0``. 1.0 (the paper's confidence = acceptance) for cards without it."""
    ev = card.get("heldout", {})
    key = "soft_r0" if temperature > 0 and "soft_r0" in ev else "top1"
    if not ev.get("conf_r0") or key not in ev:
        return 1.0
    return float(ev[key] / ev["conf_r0"])


def path_outcomes(trace: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the loop did with every drafted node: its path confidence (the drafter's ``confidence``, EAGLE-2's
    exp of the cumulative log-probability) and whether verification kept it (1 = on the accepted path). One
    entry per node of every step of a ``speculative_generate(..., trace=...)`` run -> (confidence [N], kept [N]),
    the data of EAGLE-2's reliability diagram (``calibration.reliability``)."""
    conf, kept = [], []
    for i, step in enumerate(trace):
        if step.get("confidence") is None:
            raise ValueError(f"trace step {i} carries no confidences: trace a drafter that reports them (EAGLE-2 / "
                             "EAGLE-3 trees set DraftTree.confidence)")
        on_path = set(step["path"])
        conf += step["confidence"]
        kept += [float(j in on_path) for j in range(len(step["draft"]))]
    return torch.tensor(conf, dtype=torch.float64), torch.tensor(kept, dtype=torch.float64)


def grow_sampled(f_root: torch.Tensor, expand, depth: int, width: int, q_of, draw, keep_going=None,
                 budget=None) -> Pool:
    """EAGLE-2's expansion with SAMPLED children, lossless by construction.

    Verification (verify.py) is exact when every node's presence is decided before it is drawn — by its
    ancestors, its rank among its siblings and the draft's distributions, never by its own identity or by
    siblings drawn after it. EAGLE-2's rerank keeps a node by its own sampled score, which would bias the
    tree toward lucky draws, so here: depth 0 = the root's first ``width`` draws; at each further depth the
    ``width`` frontier nodes (all nodes of the previous depth, at most ``width``) are expanded, a node x's
    rank-c child is worth score(x) + log q_c(x) (q_c = x's c-th largest draft probability: known before
    drawing), the ``width`` best ranks are kept (a prefix of ranks per node) and that many children are drawn
    from x's q (``draw``). A node's score is the key it was admitted with, summed along its path (the root's
    c-th draw: log q_c(root)), not the log-probability of the token it drew: a drawn token's q(x) says little
    of its chance to be accepted, min(1, p(x) / q(x)) on average 1 - TV(p, q), while the top ranks' mass
    follows how sure the draft is. At T > 0 EAGLE-2's path confidence is therefore the product of the ranks'
    probabilities (at T = 0 the same numbers as the top-k picks').
    ``q_of(f)`` -> the draft's distributions [F, Vd] at predicted features f (computed once per depth: the ranks'
    keys and the draws read the same q); ``draw(q, counts)`` -> per row (ids, log q of the draws, q rows) as
    EagleRunner._draw_from (the log q of the draws is not read: scores come from the ranks).
    ``keep_going`` as grow_dynamic (it reads only nodes drawn
    before the depth it decides). ``budget(keys, cand)``, if given, decides before each depth's draws how many of
    its candidates to draw, best first (0 stops; the root draws at least one): ``keys`` = the pre-draw key every
    node already in the tree was admitted with (the pool's scores), ``cand`` = this depth's candidate keys, sorted descending (log
    scale; a root child of rank c has key log q_c(root)). Everything it reads is known before the draws it
    sizes, so the tree stays lossless; the keys are the tree's own estimate of what each node is worth."""
    pool = Pool()  # pool.score: per node, the pre-draw key it was admitted with (what ``budget`` reads)

    def add_children(parents: list[int], q_rows: torch.Tensor, logq: list[list[float]], counts: list[int]) -> list[int]:
        """``counts[r]`` draws from q_rows[r] as children of parents[r]; the c-th draw's key is log q_c = logq[r][c]
        (the parent's ranks, descending) on top of the parent's score."""
        new = []
        for j, lq, (ids, _, rows) in zip(parents, logq, draw(q_rows, counts)):
            base, dep = (pool.score[j], pool.dep[j] + 1) if j >= 0 else (0.0, 0)
            new += [pool.add(t, j, base + lq[i], dep, rows[i]) for i, t in enumerate(ids)]
        return new

    q0 = q_of(f_root[None])  # [1, Vd]
    v0 = q0[0].topk(min(width, q0.shape[-1])).values.log().tolist()  # the root's candidates: ranks 0.. of its q
    n0 = width if budget is None else max(1, budget(pool.score, [x for x in v0 if x > float("-inf")]))
    frontier = add_children([-1], q0, [v0], [n0])
    for _ in range(1, depth):
        if not frontier or (keep_going is not None and not keep_going(pool, frontier)):
            break
        q = q_of(expand(pool, frontier))  # [F, Vd]
        v = q.topk(width, -1).values.log().tolist()  # [F, width] sorted descending
        cand = sorted(((pool.score[j] + v[r][c], r, c) for r, j in enumerate(frontier) for c in range(width)
                       if v[r][c] > float("-inf")), key=lambda t: (-t[0], t[1], t[2]))[:width]
        if budget is not None:
            cand = cand[:budget(pool.score, [k for k, _, _ in cand])]
            if not cand:
                break
        counts = [sum(1 for _, r2, _ in cand if r2 == r) for r in range(len(frontier))]
        rows = [r for r in range(len(frontier)) if counts[r]]
        frontier = add_children([frontier[r] for r in rows], q[rows], [v[r] for r in rows], [counts[r] for r in rows])
    return pool
