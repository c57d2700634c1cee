"""EAGLE drafting on the target's features: one head runner (draft KV cache over committed positions,
catch-up with the target's true features, tree-attention expansion) under two drafters — ``EagleDrafter``
(EAGLE-1, a static tree) and ``Eagle2Drafter`` (EAGLE-2, a dynamic tree)."""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

from ...cache import right_padded
from ...decoding import Drafter, SpecState, shared_sampling
from ...roofline import auto_size, nodes_to_add
from ...sampling import gumbel_top_k, probs_from, without_replacement_rows
from ...tree import additive_mask, tree_from_choices
from ...verify import DraftTree
from .. import head_rows
from .dynamic import Pool, grow_dynamic, grow_sampled, worth_expanding
from .head import EagleHead

ChildRule = Literal["topk", "iid", "noreplace"]
CHILD_RULES = get_args(ChildRule)


class EagleRunner(Drafter):
    """What both EAGLE drafters share: the head on the target's features and its own KV cache.

    head          EagleHead on the target's device / dtype
    vocab         [Vd] token ids the head may propose (None = full vocabulary)
    top_k         children per expanded node (the widest rank a tree asks of one draft forward)
    children      at T > 0, how a node's children are chosen: "topk" = the draft's top picks (one-hot q: a pick x
                  is kept with probability p(x)); "iid" = drawn i.i.d. from the draft's q under the run's sampling
                  config; "noreplace" = drawn without replacement (Gumbel-top-k) — both kept with min(1, p/q)
                  (verify.py). At T = 0 every rule drafts the top picks.

    Draft KV cache: committed positions only, computed from the target's TRUE features. Tree nodes are
    appended while drafting and cropped away afterwards; the accepted tokens are re-run with the target's
    features at the next step (as the EAGLE reference does), so after every step the draft cache equals one
    recomputed from the committed tokens. Subclasses implement ``_draft(f_root, start)``.
    """

    needs_hidden = True

    def __init__(self, target, head: EagleHead, vocab: torch.Tensor | None = None, *, top_k: int = 4,
                 children: ChildRule = "topk"):
        if children not in CHILD_RULES:
            raise ValueError(f"children must be one of {CHILD_RULES} (how a node's children are chosen at T > 0), "
                             f"got {children!r}")
        self.rule = children
        W, self.vocab = head_rows(target.get_output_embeddings().weight, vocab)
        if next(head.parameters()).device != W.device:
            raise ValueError(f"the EAGLE head is on {next(head.parameters()).device} but the target is on {W.device}; "
                             "move both to one device")
        if head.hidden != target.config.hidden_size:
            raise ValueError(f"the EAGLE head has width {head.hidden}, the target {target.config.hidden_size}: "
                             "it was built for another target")
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
        if top_k > W.shape[0]:
            raise ValueError(f"top_k {top_k} is above the head vocabulary ({W.shape[0]} tokens)")
        self.target, self.head, self.W = target, head.eval(), W.contiguous()
        self.V = target.get_output_embeddings().weight.shape[0]
        self._sampling, self._gen = None, None
        self.E = target.get_input_embeddings()
        self.top_k = top_k
        self.forwards = 0
        self.cache, self.n_cached = None, 0

    def begin(self, state: SpecState) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.head.config)
        self.n_cached = 0

    def _embed(self, ids: list[int]) -> torch.Tensor:
        return self.E(torch.tensor([ids], device=self.W.device)).to(self.W.dtype)

    def _features_in(self, hid: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as the head's input feature (EAGLE: as they are; EAGLE-3: fused by fc)."""
        return hid

    def _logits(self, f: torch.Tensor) -> torch.Tensor:
        return f @ self.W.T  # [..., Vd]

    def _logp(self, f: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self._logits(f).float(), -1)  # draft confidence at T = 1 (EAGLE-2)

    def _sampled(self) -> bool:
        return self.rule != "topk" and not self._sampling.greedy

    def _draw(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k children from one node's q [Vd] by the rule -> (head-vocabulary indices [k'], their q rows [k', Vd])."""
        if self.rule == "noreplace":
            idx = gumbel_top_k(q, k, self._gen)
            return idx, without_replacement_rows(q, idx)
        idx = torch.multinomial(q, k, replacement=True, generator=self._gen)
        return idx, q[None].expand(k, -1)

    def _full(self, rows: torch.Tensor) -> torch.Tensor:
        """q rows over the head vocabulary [k, Vd] -> over the target's [k, V] (zero outside the head's)."""
        if self.vocab is None:
            return rows
        out = torch.zeros(rows.shape[0], self.V, dtype=torch.float32, device=rows.device)
        return out.index_copy_(1, self.vocab, rows.float())

    def _pick(self, f: torch.Tensor, counts: list[int]) -> list[tuple[list[int], list[float], torch.Tensor | None]]:
        """Children of F expanded nodes (their predicted features f [F, H]): ``counts[r]`` for row r ->
        per row (token ids, log-probabilities, q rows [k, V] or None for top picks). Top picks score by the
        draft's T = 1 log-probability (EAGLE-2's confidence); sampled children by the log of the q they were
        drawn from (the draft's probability of what was sampled)."""
        logits = self._logits(f)
        if not self._sampled():
            v, i = torch.log_softmax(logits.float(), -1).topk(max(counts), -1)
            return [(self._ids(i[r, :c]), v[r, :c].tolist(), None) for r, c in enumerate(counts)]
        return self._draw_from(probs_from(logits, self._sampling), counts)

    def _q(self, f: torch.Tensor) -> torch.Tensor:
        """The draft's distribution at predicted features f [F, H] under the run's sampling config -> [F, Vd] f32."""
        return probs_from(self._logits(f), self._sampling)

    def _draw_from(self, q: torch.Tensor, counts: list[int]) -> list[tuple[list[int], list[float], torch.Tensor]]:
        """``counts[r]`` children drawn from each row of q [F, Vd] by the rule -> per row (token ids, log q of the
        draws, the q rows [k, V] they were drawn from)."""
        out = []
        for r, c in enumerate(counts):
            idx, rows = self._draw(q[r], c)
            out.append((self._ids(idx), q[r][idx].log().tolist(), self._full(rows)))
        return out

    def _catch_up(self, state: SpecState) -> torch.Tensor:
        """Feed the committed positions the head has not seen, with the target's true features;
        returns f^ for the newest token's successor position [H]."""
        n = len(state.tokens) - 1  # positions 0..n-1 have target features; token n is the newest
        hid = state.target_hidden
        first = self._first_new(state)
        pos = torch.arange(first, n, device=self.W.device)[None]
        f = self.head(self._embed(state.tokens[first + 1:n + 1]), self._features_in(hid[None].to(self.W.dtype)),
                      position_ids=pos, cache=self.cache)
        self.forwards += 1
        self.n_cached = n
        return f[0, -1]

    def _first_new(self, state: SpecState) -> int:
        """The first position whose target features ``state`` brings: it must be the first the draft cache lacks."""
        first = len(state.tokens) - 1 - state.target_hidden.shape[0]
        if first != self.n_cached:
            raise RuntimeError(f"EAGLE draft cache holds {self.n_cached} positions but the new target features start "
                               f"at {first}: call begin() for a new sequence")
        return first

    def _expand(self, toks: list[int], feats: torch.Tensor, depth0: int, anc: list[list[int]], n_tree: int):
        """One draft forward over a block of tree nodes (tree attention inside the draft's own cache).

        toks [F] node tokens; feats [F, H] their parents' predicted features; depth0: the block's depth
        (0 = children of the root); anc[i]: indices (in append order) of node i's ancestors already in
        the draft cache after the committed prefix; n_tree: tree nodes already appended.
        -> predicted features [F, H] (inputs of the nodes' children)
        """
        F = len(toks)
        n = self.n_cached
        allowed = torch.zeros(F, n + n_tree + F, dtype=torch.bool)
        allowed[:, :n] = True
        for i, a in enumerate(anc):
            allowed[i, [n + j for j in a]] = True
            allowed[i, n + n_tree + i] = True
        mask = additive_mask(allowed, self.W.dtype)[None, None]
        pos = torch.full((1, F), n + depth0, dtype=torch.long, device=self.W.device)
        out = self.head(self._embed(toks), feats[None], position_ids=pos, attention_mask=mask.to(self.W.device),
                        cache=self.cache)
        self.forwards += 1
        return out[0]

    @torch.inference_mode()
    def measure_draft_cost(self, context: int = 256, repeats: int = 5) -> float:
        """Median seconds of one draft forward over ``top_k`` tree nodes (head + log-softmax over the head
        vocabulary) after ``context`` cached positions: the ``draft_cost`` of the auto tree size."""
        from transformers import DynamicCache

        from ...cache import crop_to
        from ...roofline import median_seconds

        saved = (self.cache, self.n_cached, self.forwards)  # profiling is not drafting: all restored below
        H, k = self.W.shape[1], self.top_k
        try:
            self.cache = DynamicCache(config=self.head.config)
            feats = torch.zeros(1, context, H, dtype=self.W.dtype, device=self.W.device)
            self.head(self._embed([0] * context), feats, position_ids=torch.arange(context, device=self.W.device)[None],
                      cache=self.cache)
            self.n_cached = context
            return median_seconds(lambda: self._logp(self._expand([0] * k, feats[0, :k], 0, [[] for _ in range(k)], 0)),
                                  repeats, reset=lambda: crop_to(self.cache, context))
        finally:
            self.cache, self.n_cached, self.forwards = saved

    def _ids(self, idx: torch.Tensor) -> list[int]:
        return (self.vocab[idx] if self.vocab is not None else idx).tolist()

    @torch.inference_mode()
    def propose(self, state: SpecState) -> DraftTree:
        from ...cache import crop_to

        start = self.forwards  # this step's draft forwards = self.forwards - start
        self._sampling, self._gen = state.sampling, state.generator
        if self._sampled() and state.generator is None:
            raise ValueError(f"children={self.rule!r} samples the draft at T > 0: it needs the loop's generator")
        f_root = self._catch_up(state)
        tree = self._draft(f_root, start)
        crop_to(self.cache, self.n_cached)  # drop the tree: only committed positions stay
        return tree

    def _draft(self, f_root: torch.Tensor, start: int) -> DraftTree:  # pragma: no cover
        raise NotImplementedError


def measure_draft_cost(target, head: EagleHead, vocab: torch.Tensor | None = None, top_k: int = 4,
                       context: int = 256, repeats: int = 5) -> float:
    """Median seconds of one EAGLE draft forward over ``top_k`` tree nodes after ``context`` cached positions
    (EagleRunner.measure_draft_cost on a fresh runner): the ``draft_cost`` of Eagle2Drafter's auto size."""
    return EagleRunner(target, head, vocab, top_k=top_k).measure_draft_cost(context, repeats)


class EagleDrafter(EagleRunner):
    """EAGLE-1: the head drafts a fixed tree, ``choices`` (Medusa-style rank paths, tree.tree_from_choices;
    ``tree.chain_choices(d)`` = a chain of d top-1 tokens; ``static.static_tree`` = the sparse
    tree from the head's rank accuracies). Children: top-k picks (one-hot q), or at T > 0 draws from q
    (``children``), each node's children taking its picks in rank order; lossless at any temperature."""

    def __init__(self, target, head: EagleHead, vocab: torch.Tensor | None = None, *,
                 choices: list[tuple[int, ...]], children: ChildRule = "topk", calibration: float = 1.0):
        nodes, parents = tree_from_choices(choices)
        super().__init__(target, head, vocab, top_k=max(c[-1] for c in nodes) + 1, children=children)
        if not (isinstance(calibration, (int, float)) and calibration > 0):
            raise ValueError(f"calibration must be > 0 (confidence_calibration(card)), got {calibration!r}")
        self.nodes, self.parents = nodes, parents
        self.depth = max(len(c) for c in nodes)
        self.gamma = len(nodes)  # draft tokens per step at most
        self.calibration = float(calibration)
        # a chain (one node per depth, ``tree.chain_choices``) reports survivals for serving.py's confidence
        # policies (``_chains``): a_j = min(1, calibration x prod_{i<=j} max q_i), non-increasing in j
        self.chain = len(nodes) == self.depth
        self.confidences = self.chain

    @torch.inference_mode()
    def propose(self, state: SpecState) -> DraftTree:
        """A chain is drafted by ``_chains`` (as ``propose_batch`` drafts many); any other tree by the tree code."""
        return EagleDrafter._chains([self], [state])[0] if self.chain else super().propose(state)

    def _survival(self, log_conf: list[float]) -> torch.Tensor:
        """Cumulative log-confidences -> min(1, calibration x exp(.)) per node (1.0: the raw path confidence)."""
        return (torch.tensor(log_conf, dtype=torch.float64).exp() * self.calibration).clamp(max=1.0).float()

    def _draft(self, f_root: torch.Tensor, start: int) -> DraftTree:
        """The spec's tree, one draft forward per depth. A node's children take the node's picks in rank order
        (top picks, or draws in draw order): which nodes exist never depends on what was drawn, so sampled
        children stay lossless. A node whose q has fewer tokens than the spec asks keeps fewer children."""
        kids: dict[tuple, list[tuple]] = {}
        for c in self.nodes:
            kids.setdefault(c[:-1], []).append(c)
        for v in kids.values():
            v.sort()
        tok, score, qrow, feat_of, slot = {}, {}, {}, {(): f_root}, {}

        sampled = self._sampled()

        def assign(specs: list[tuple], f_rows: torch.Tensor) -> None:
            # top picks: child (..., r) is the rank-r pick; draws: the j-th child (by rank) is the j-th draw
            want = [len(kids[c]) if sampled else kids[c][-1][-1] + 1 for c in specs]
            for c, (ids, lps, rows) in zip(specs, self._pick(f_rows, want)):
                for j, x in enumerate(kids[c]):
                    k = j if sampled else x[-1]
                    if k < len(ids):
                        tok[x], score[x] = ids[k], score.get(c, 0.0) + lps[k]
                        qrow[x] = None if rows is None else rows[k]

        assign([()], f_root[None])
        n_tree = 0
        for d in range(1, self.depth):
            block = [c for c in self.nodes if len(c) == d and c in tok and c in kids]  # nodes with children to draw
            if not block:
                break
            anc = [[slot[c[:m]] for m in range(1, d)] for c in block]
            f = self._expand([tok[c] for c in block], torch.stack([feat_of[c[:-1]] for c in block]), d - 1, anc, n_tree)
            for r, c in enumerate(block):
                slot[c], feat_of[c] = n_tree, f[r]
                n_tree += 1
            assign(block, f)
        keep = [c for c in self.nodes if c in tok]  # topological (the spec's order), closed under ancestors
        new = {c: i for i, c in enumerate(keep)}
        parents = torch.tensor([new[c[:-1]] if len(c) > 1 else -1 for c in keep], dtype=torch.long)
        return DraftTree(torch.tensor([tok[c] for c in keep], dtype=torch.long), parents,
                         q=torch.stack([qrow[c] for c in keep]) if sampled else None,
                         confidence=self._survival([score[c] for c in keep]), children=self.rule if sampled else None)

    @staticmethod
    @torch.inference_mode()
    def propose_batch(drafters: list["EagleDrafter"], states: list[SpecState]) -> list[DraftTree]:
        """``propose`` for several sequences: chains sharing one head and one sampling config / generator are
        drafted together (``_chains``); anything else one at a time."""
        d0 = drafters[0]
        together = all(type(d) is type(d0) and d.head is d0.head and d.chain and d.depth == d0.depth and
                       d.rule == d0.rule for d in drafters) and shared_sampling(states)
        if not together:
            return [d.propose(s) for d, s in zip(drafters, states)]
        return EagleDrafter._chains(drafters, states)

    @staticmethod
    def _chains(drafters: list["EagleDrafter"], states: list[SpecState]) -> list[DraftTree]:
        """R chains drafted together: ONE catch-up forward and ``depth`` - 1 chain forwards for all of them.

        The sequences' draft caches are padded to the longest into one batch cache [R, nkv, C, hd] (row r's padding
        masked out). The catch-up appends M = the most new positions of any row at slots C..C+M-1 (row r's first
        m_r are real: causal among themselves, seeing its committed slots), and each row's real new K/V are copied
        back into its own cache, so the sequences' caches hold their committed positions, as after ``propose``.
        A row whose cache is empty (its prompt: hundreds of positions) is caught up alone first, so the batch pads
        to a step's few new tokens. Depth d then appends one slot per row at C + M + d - 1 (position n_r + d - 1)
        that sees row r's real slots and its own chain. The picks are ``_pick``'s, row by row in order (one row
        draws what the tree code draws for the same chain).

        Survivals: a_j = min(1, calibration x prod_{i<=j} max q_i), q_i the draft's T = 1 distribution at position i
        (EAGLE-2's confidence of a top pick). Each factor is known before x_i is drawn, as DSpark's confidence is:
        the sampled token's own q(x_i) would let a scheduler's decision to verify x_i depend on x_i (DSpark's
        Appendix A bias; tests/test_serving.py checks the chains stay lossless under Algorithm 1). At T = 0 the pick
        is the top one, so this is EAGLE-2's path confidence."""
        d0, R = drafters[0], len(drafters)
        for d, s in zip(drafters, states):
            d._sampling, d._gen = s.sampling, s.generator
        if d0._sampled() and states[0].generator is None:
            raise ValueError(f"children={d0.rule!r} samples the draft at T > 0: it needs the loop's generator")
        alone = {r: d._catch_up(s) for r, (d, s) in enumerate(zip(drafters, states)) if d.n_cached == 0}
        f, cache, seen = EagleDrafter._catch_up_together(drafters, states, alone)  # [R, H], batch cache, [R, C + M]
        n = [d.n_cached for d in drafters]
        dev, dt = d0.W.device, d0.W.dtype
        toks, qrows = [[] for _ in range(R)], [[] for _ in range(R)]
        logc, top = torch.zeros(R, dtype=torch.float64), []  # top: per depth the cumulative log max q [R]
        for depth in range(d0.depth):
            if depth:
                allowed = torch.cat([seen, torch.ones(R, depth, dtype=torch.bool, device=dev)], 1)
                emb = d0.E(torch.tensor([[t[-1]] for t in toks], device=dev)).to(dt)  # [R, 1, H]
                f = d0.head(emb, f[:, None], position_ids=torch.tensor(n, device=dev)[:, None] + depth - 1,
                            attention_mask=additive_mask(allowed, dt)[:, None, None], cache=cache)[:, 0]
            logits = d0._logits(f)  # [R, Vd]
            best = torch.log_softmax(logits.float(), -1).max(-1)
            logc = logc + best.values.double().cpu()
            top.append(logc)
            picks = (d0._draw_from(probs_from(logits, d0._sampling), [1] * R) if d0._sampled()
                     else [(d0._ids(best.indices[r:r + 1]), None, None) for r in range(R)])  # as ``_pick`` picks
            for r, (ids, _, rows) in enumerate(picks):
                toks[r].append(ids[0])
                qrows[r].append(rows)
        for d in drafters:
            d.forwards += d0.depth - 1
        conf = torch.stack(top, 1)  # [R, depth]
        return [DraftTree(torch.tensor(t, dtype=torch.long), torch.arange(-1, len(t) - 1),
                          q=torch.cat(q) if q[0] is not None else None, confidence=d._survival(conf[r].tolist()),
                          children=d.rule if q[0] is not None else None)
                for r, (d, t, q) in enumerate(zip(drafters, toks, qrows))]

    @staticmethod
    def _catch_up_together(drafters: list["EagleDrafter"], states: list[SpecState], done: dict[int, torch.Tensor]):
        """``_catch_up`` for every row not in ``done`` (row -> its f^ already computed) in ONE forward over a padded
        batch cache -> (f^ of each newest token [R, H], the batch cache, its real slots per row [R, C + M])."""
        from transformers import DynamicCache

        d0, R = drafters[0], len(drafters)
        dev, dt, H = d0.W.device, d0.W.dtype, d0.W.shape[1]
        old = [d.n_cached for d in drafters]
        m = [0 if r in done else len(s.tokens) - 1 - d._first_new(s) for r, (d, s) in enumerate(zip(drafters, states))]
        C, M = max(old), max(m)
        cache = DynamicCache(config=d0.head.config)
        cache.update(right_padded([d.cache.layers[0].keys for d in drafters]),
                     right_padded([d.cache.layers[0].values for d in drafters]), 0)
        slots = torch.arange(C + M, device=dev)[None]
        real = torch.tensor(old, device=dev)[:, None]
        seen = (slots < real) | ((slots >= C) & (slots < C + torch.tensor(m, device=dev)[:, None]))  # [R, C + M]
        f = torch.stack([done[r] if r in done else torch.zeros(H, dtype=dt, device=dev) for r in range(R)])
        if M == 0:
            return f, cache, seen
        emb = torch.zeros(R, M, H, dtype=dt, device=dev)
        feats = torch.zeros(R, M, states[0].target_hidden.shape[-1], dtype=dt, device=dev)
        for r, s in enumerate(states):
            if m[r]:
                emb[r, :m[r]] = d0._embed(s.tokens[old[r] + 1:])[0]
                feats[r, :m[r]] = s.target_hidden.to(dt)
        i = torch.arange(M, device=dev)
        allowed = torch.cat([seen[:, None, :C].expand(R, M, C),  # committed slots, then causal among the new
                             (i[None, None, :] <= i[None, :, None]).expand(R, M, M)], 2)  # [R, M, C + M]
        out = d0.head(emb, d0._features_in(feats), position_ids=real + i[None],
                      attention_mask=additive_mask(allowed, dt)[:, None], cache=cache)
        for r, d in enumerate(drafters):
            if m[r]:
                d.cache.update(cache.layers[0].keys[r:r + 1, :, C:C + m[r]], cache.layers[0].values[r:r + 1, :, C:C + m[r]], 0)
                d.n_cached, f[r] = old[r] + m[r], out[r, m[r] - 1]
                d.forwards += 1
        return f, cache, seen


class Eagle2Drafter(EagleRunner):
    """EAGLE-2: a dynamic tree per step (dynamic.grow_dynamic -> Pool.tree), children top-k picks (one-hot q).

    depth, top_k  drafting steps and children per expanded node
    total_tokens  nodes kept after reranking, or "auto" (per step, from ``latency``)
    latency       {k: seconds} target forward latency curve (roofline.profile_latency_vs_k), for "auto"
    draft_cost    seconds per draft forward (``measure_draft_cost``), for "auto": the step's drafting time joins
                  the cost model, and the expansion stops early once another depth cannot pay (``worth_expanding``)
    calibration   for "auto": accepted tokens per unit of draft confidence (``confidence_calibration(card, T)``);
                  the cost model values a node at min(1, calibration x its path confidence). 1.0 = the paper's
                  confidence-as-acceptance. Only the tree's size and depth move.
    children      "topk" (the paper: top-k picks and the rerank); at T > 0 "iid" / "noreplace" draw the children
                  from q instead and grow the tree with ``dynamic.grow_sampled`` (no rerank by what was drawn;
                  ``top_k`` = nodes per depth at most; the first ``total_tokens`` nodes, or in "auto" each depth
                  draws as many nodes as the latency curve pays for, judged before the draws:
                  ``roofline.nodes_to_add`` over the nodes' pre-draw keys).
    """

    def __init__(self, target, head: EagleHead, vocab: torch.Tensor | None = None, *, depth: int = 5,
                 top_k: int = 4, total_tokens: int | Literal["auto"] = 16, latency: dict[int, float] | None = None,
                 max_auto: int = 64, draft_cost: float | None = None, calibration: float = 1.0,
                 children: ChildRule = "topk"):
        super().__init__(target, head, vocab, top_k=top_k, children=children)
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        if total_tokens == "auto":
            if not latency:
                raise ValueError("total_tokens='auto' needs the target's latency curve: "
                                 "latency=roofline.profile_latency_vs_k(target)")
        elif not isinstance(total_tokens, int) or total_tokens < depth:
            raise ValueError(f"total_tokens ({total_tokens!r}) must be an int >= depth ({depth}) or 'auto': "
                             "a smaller tree cannot hold one path of every drafted depth")
        if draft_cost is not None and not (isinstance(draft_cost, (int, float)) and draft_cost >= 0):
            raise ValueError(f"draft_cost must be seconds >= 0 (measure_draft_cost), got {draft_cost!r}")
        if not (isinstance(calibration, (int, float)) and calibration > 0):
            raise ValueError(f"calibration must be > 0 (confidence_calibration(card)), got {calibration!r}")
        self.depth = depth
        self.total_tokens, self.latency, self.max_auto, self.draft_cost = total_tokens, latency, max_auto, draft_cost
        self.calibration = float(calibration)

    def _draft(self, f_root: torch.Tensor, start: int) -> DraftTree:
        out_feat: dict[int, torch.Tensor] = {-1: f_root}  # pool index -> its predicted feature (children's input)
        slot: dict[int, int] = {}  # pool index -> append order in the draft cache
        n_tree = [0]

        def expand(pool: Pool, frontier: list[int]) -> torch.Tensor:
            anc = []
            for j in frontier:
                a, x = [], pool.par[j]
                while x >= 0:
                    a.append(slot[x])
                    x = pool.par[x]
                anc.append(a)
            f = self._expand([pool.tok[j] for j in frontier], torch.stack([out_feat[pool.par[j]] for j in frontier]),
                             pool.dep[frontier[0]], anc, n_tree[0])
            for r, j in enumerate(frontier):
                slot[j], out_feat[j] = n_tree[0], f[r]
                n_tree[0] += 1
            return f

        auto = self.total_tokens == "auto"
        c = self.draft_cost or 0.0
        cal = self.calibration

        def worth(log_q: list[float]) -> list[float]:  # the cost model's acceptance estimate per node
            return [min(1.0, cal * math.exp(x)) for x in log_q]

        def confidences(pool: Pool) -> list[float]:  # best first
            return sorted(worth(pool.score), reverse=True)

        def keep_going(pool: Pool, frontier: list[int]) -> bool:
            mass = cal * sum(math.exp(pool.score[j]) for j in frontier)
            return worth_expanding(confidences(pool), mass, self.latency, self.max_auto,
                                   (self.forwards - start) * c, c)

        def budget(keys: list[float], cand: list[float]) -> int:  # sampled trees: what each depth may draw
            return nodes_to_add(worth(keys), worth(cand), self.latency, self.max_auto, (self.forwards - start) * c)

        stop = keep_going if auto and self.draft_cost is not None else None
        if self._sampled():
            pool = grow_sampled(f_root, expand, self.depth, self.top_k, self._q, self._draw_from, keep_going=stop,
                                budget=budget if auto else None)
            cap = self.max_auto if auto else self.total_tokens
            return pool.tree_in_order(cap, self.rule)
        pool = grow_dynamic(self._logp(f_root), lambda pool, fr: self._logp(expand(pool, fr)), self.depth, self.top_k,
                            to_tokens=self._ids, keep_going=stop)
        if auto:
            total = auto_size(confidences(pool), self.latency, self.max_auto, (self.forwards - start) * c)
        else:
            total = self.total_tokens
        return pool.tree(total)
