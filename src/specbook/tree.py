"""Draft trees as parents arrays: depths, ancestor masks, position ids, root-to-leaf paths.

The target scores ``[root] + nodes`` in one forward. Row 0 of the block is the root (the last
committed token, at position ``past``); node i sits at position ``past + 1 + depth(i)`` and may
attend to the whole cache, the root, its ancestors and itself — nothing else (tree attention).
"""

from __future__ import annotations

import torch


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
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
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
