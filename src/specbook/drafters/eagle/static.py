"""EAGLE-1's static tree: Medusa's sparse-tree construction (tree.sparse_tree) from the head's held-out
rank accuracies, at a fixed size or the size the target's latency curve pays for ("auto")."""

from __future__ import annotations

from ...tree import sized_sparse_tree


def static_tree(card: dict, nodes: int | str, depth: int = 5, temperature: float = 0.0,
                latency: dict[int, float] | None = None, draft_cost: float = 0.0) -> list[tuple[int, ...]]:
    """An EAGLE-1 static tree for this head: Medusa's sparse-tree construction (tree.sparse_tree) with the head's
    held-out rank accuracies (static_accuracy) used at every depth — EAGLE's features keep per-depth acceptance
    roughly flat, unlike Medusa's heads. ``nodes``: a node count, or "auto" = the size ``latency`` pays for with
    the step's draft forwards (one per depth, ``draft_cost`` seconds each) as overhead (tree.auto_nodes)."""
    return sized_sparse_tree(static_accuracy(card, depth, temperature), nodes, latency, overhead=depth * draft_cost)


def static_accuracy(card: dict, depth: int, temperature: float = 0.0) -> list[list[float]]:
    """acc[d][c] for the static tree, the same at every depth: the head's held-out step-1 rank accuracies.

    Greedy (temperature 0): P(the c-th guess is the target's argmax), card ``acc_r{c}``. Sampling: a one-hot
    pick x is accepted with probability p(x), so the c-th guess is worth E[p(x_c)], card ``soft_r{c}``
    (measured at T = 1, used for every T > 0 as an approximation; cards from before it fall back to acc_r)."""
    ev = card["heldout"]
    key = "soft_r" if temperature > 0 and "soft_r0" in ev else "acc_r"
    acc = [ev[f"{key}{c}"] for c in range(sum(1 for k in ev if k.startswith(key)))]
    return [acc] * depth

