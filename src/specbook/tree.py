"""Draft trees as parents arrays (depths, ancestor masks, position ids, root-to-leaf paths) and
Medusa-style choice-path tree specs (a static tree written as rank paths; sparse trees sized from
measured rank accuracies), shared by Medusa and EAGLE-1.

The target scores ``[root] + nodes`` in one forward. Row 0 of the block is the root (the last
committed token, at position ``past``); node i sits at position ``past + 1 + depth(i)`` and may
attend to the whole cache, the root, its ancestors and itself — nothing else (tree attention).
"""

from __future__ import annotations

import itertools

import torch


def children_of(parents: list[int], n: int) -> dict[int, list[int]]:
    """{node: its children in order}, with -1 = the root; every node has an entry."""
    ch: dict[int, list[int]] = {-1: []}
    for i in range(n):
        ch.setdefault(parents[i], []).append(i)
        ch.setdefault(i, [])
    return ch


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool "may attend" [..., Q, K] -> the additive float mask attention adds to its scores:
    0 where allowed, the dtype's minimum elsewhere (transformers' and sdpa's convention)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def depths(parents: torch.Tensor) -> torch.Tensor:
    """parents [N] (-1 = root) -> depth [N] (children of the root have depth 0)."""
    p = parents.tolist()
    d = [0] * len(p)
    for i, par in enumerate(p):
        if par >= i:
            raise ValueError(f"node {i} has parent {par}: parents must be topologically ordered")
        if par < -1:
            raise ValueError(f"node {i} has parent {par}: use -1 for the root")
        d[i] = 0 if par < 0 else d[par] + 1
    return torch.tensor(d, dtype=torch.long)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Bool [N + 1, N + 1] over the block [root] + nodes: True where row may attend to column."""
    n = parents.shape[0]
    m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    m[:, 0] = True  # everyone sees the root
    p = parents.tolist()
    for i in range(n):
        m[i + 1, i + 1] = True
        a = p[i]
        while a >= 0:
            m[i + 1, a + 1] = True
            a = p[a]
    return m


def block_inputs(parents: torch.Tensor, past: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """4D additive attention mask [1, 1, N + 1, past + N + 1] and position ids [1, N + 1].

    The mask is 0 where attention is allowed and the dtype's minimum elsewhere (transformers
    accepts such a float 4D mask on the sdpa/eager paths and uses it as is).
    """
    n = parents.shape[0]
    allowed = torch.cat([torch.ones(n + 1, past, dtype=torch.bool), ancestor_mask(parents)], dim=1)
    mask = additive_mask(allowed, dtype)
    pos = torch.cat([torch.zeros(1, dtype=torch.long), depths(parents) + 1]) + past
    return mask[None, None].to(device), pos[None].to(device)


def leaf_paths(parents: torch.Tensor) -> list[list[int]]:
    """Root-to-leaf node paths (Medusa's retrieve indices), one per leaf, in node order."""
    p = parents.tolist()
    has_child = set(x for x in p if x >= 0)
    paths = []
    for i in range(len(p)):
        if i in has_child:
            continue
        path, a = [], i
        while a >= 0:
            path.append(a)
            a = p[a]
        paths.append(path[::-1])
    return paths


# --------------------------------------------------------------------------- choice-path trees (Medusa, EAGLE-1)


def tree_from_choices(choices: list[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """Medusa choice paths -> (nodes in topological order, parents [N]).

    A choice (c_1, ..., c_d) is the node reached by taking head 1's c_1-th best token, then head 2's
    c_2-th best, ...; every prefix of a choice must itself be a choice (its parent).
    """
    nodes = sorted({tuple(int(x) for x in c) for c in choices}, key=lambda c: (len(c), c))
    if not nodes:
        raise ValueError("a tree needs at least one choice path")
    index = {c: i for i, c in enumerate(nodes)}
    parents = []
    for c in nodes:
        if not c or min(c) < 0:
            raise ValueError(f"choice {c} must be a non-empty tuple of ranks >= 0")
        if len(c) > 1 and c[:-1] not in index:
            raise ValueError(f"choice {c} has no parent: {c[:-1]} is missing from the tree spec")
        parents.append(index[c[:-1]] if len(c) > 1 else -1)
    return nodes, torch.tensor(parents, dtype=torch.long)


def chain_choices(depth: int) -> list[tuple[int, ...]]:
    """The top-1 chain of ``depth`` nodes: (0,), (0, 0), ..."""
    return [(0,) * d for d in range(1, depth + 1)]


def ranked_paths(acc: list[list[float]], n_nodes: int) -> list[tuple[tuple[int, ...], float]]:
    """Medusa's sparse tree with each path's estimated acceptance, best first (see sparse_tree)."""
    if n_nodes < 1:
        raise ValueError(f"n_nodes must be >= 1, got {n_nodes}")
    K, C = len(acc), len(acc[0])
    chosen: list[tuple[tuple[int, ...], float]] = []
    frontier = {(c,): acc[0][c] for c in range(C)}
    while frontier and len(chosen) < n_nodes:
        best = max(frontier, key=lambda c: (frontier[c], [-x for x in c]))
        score = frontier.pop(best)
        chosen.append((best, score))
        if len(best) < K:
            for c in range(C):
                frontier[best + (c,)] = score * acc[len(best)][c]
    return chosen


def sparse_tree(acc: list[list[float]], n_nodes: int) -> list[tuple[int, ...]]:
    """Medusa's sparse tree: the ``n_nodes`` choice paths with the highest estimated acceptance.

    ``acc[k][c]`` = measured probability that head k + 1's c-th best token is the right one; a path's
    acceptance is estimated as the product along it (heads treated as independent, as in the paper).
    Greedy best-first expansion from the root keeps the result a valid tree.
    """
    return [c for c, _ in ranked_paths(acc, n_nodes)]


def auto_nodes(acc: list[list[float]], latency: dict[int, float], max_nodes: int = 64, overhead: float = 0.0) -> int:
    """The sparse-tree size this machine pays for: the n maximising the expected accepted length
    (1 + the n best paths' estimated acceptance) per second of (overhead + target latency(n + 1)), from the
    measured latency curve (roofline.profile_latency_vs_k). The Medusa paper picks its tree the same way
    (expected acceptance length vs measured latency per tree size) on its GPU; here it runs per machine."""
    from .roofline import auto_size

    return auto_size([v for _, v in ranked_paths(acc, max_nodes)], latency, max_nodes, overhead)


def sized_sparse_tree(acc: list[list[float]], nodes: int | str, latency: dict[int, float] | None = None,
                      overhead: float = 0.0) -> list[tuple[int, ...]]:
    """sparse_tree of ``nodes`` paths, or of the size auto_nodes picks when ``nodes`` is "auto" (needs ``latency``)."""
    if nodes == "auto":
        if not latency:
            raise ValueError("nodes='auto' needs the target's latency curve (roofline.profile_latency_vs_k)")
        nodes = auto_nodes(acc, latency, overhead=overhead)
    return sparse_tree(acc, nodes)


def all_choices(depth: int, width: int) -> list[tuple[int, ...]]:
    """The full tree of ``width`` children per node down to ``depth`` (for small illustrations)."""
    return [c for d in range(1, depth + 1) for c in itertools.product(range(width), repeat=d)]
