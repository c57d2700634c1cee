"""KV-cache rollback on top of transformers' Cache.

After verification only the accepted prefix (chain) or the accepted root-to-leaf path (tree) of
the draft may stay in the target's cache:

    crop_to(cache, n)               keep the first n positions (chain rollback)
    keep_positions(cache, start, idx)  keep positions [0, start) + start + idx, in order (tree compaction)

Both work on transformers' dynamic cache and on fastpath.StaticKVCache (rollback = moving its length).

    GrowingKV                       a drafter's own append-only K/V (the block drafter's context), preallocated

transformers 5.x ``Cache.crop(t)`` takes the number of tokens to *remove* as a negative int;
``crop_to`` hides that convention behind an absolute length.
"""

from __future__ import annotations

import torch


def seq_len(cache) -> int:
    return int(cache.get_seq_length()) if cache is not None else 0


def crop_to(cache, length: int) -> None:
    """Keep the first ``length`` positions of every layer (in place)."""
    cur = seq_len(cache)
    if length < 0 or length > cur:
        raise ValueError(f"cannot crop a cache of {cur} positions to {length}")
    if length < cur:
        cache.crop(length - cur)  # negative: number of tokens to remove


def right_padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """Per-sequence K or V [1, h, n_r, d] -> one batch [R, h, max n_r, d], each row zero-padded after its n_r slots
    (the caller masks the padding out)."""
    C = max(t.shape[2] for t in rows)
    return torch.cat([torch.nn.functional.pad(t, (0, 0, 0, C - t.shape[2])) for t in rows])


def keep_positions(cache, start: int, keep: torch.Tensor) -> None:
    """Keep positions [0, start) plus ``start + keep`` (ascending offsets) in every layer; drop the rest.

    Used after a tree forward: ``keep`` are the offsets (within the draft block appended at
    ``start``) of the accepted root-to-leaf path. Keys/values: [B, H, S, D]. A static cache
    (fastpath.StaticKVCache) copies the path into place itself.
    """
    if hasattr(cache, "keep_positions"):
        return cache.keep_positions(start, keep)
    keep = keep.to(torch.long)
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        idx = torch.cat([torch.arange(start, device=layer.keys.device), start + keep.to(layer.keys.device)])
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)


class GrowingKV:
    """One sequence's keys / values for several layers, preallocated [1, h, capacity, d] per layer and doubled when
    outgrown, so appending never copies what is already there.

    ``append`` commits new positions after the ``n`` committed ones. ``slot(layer)`` is what an attention reads
    its context from: ``slot.join(k, v)`` writes a block's own K/V after the committed positions (scratch: the next
    ``append`` or ``join`` overwrites it) and returns views [1, h, n + Q, d] of [committed ; block], the same
    values as ``torch.cat`` without copying the committed part."""

    CAPACITY = 256  # the smallest buffer

    def __init__(self, capacity: int = CAPACITY):
        if capacity < 1 or capacity & (capacity - 1):
            raise ValueError(f"GrowingKV capacity must be a power of two, got {capacity}")
        self.capacity, self.n = capacity, 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def reserve(self, like: torch.Tensor, layers: int, need: int) -> None:
        """Room for ``need`` slots in ``layers`` layers of ``like``'s heads / dtype; capacities are powers of two
        (at least ``capacity``), so fixed-shape consumers see few sizes (block_compiled: one graph each)."""
        if not self.k:
            shape = (1, like.shape[1], max(self.capacity, 1 << (need - 1).bit_length()), like.shape[3])
            self.k = [like.new_zeros(shape) for _ in range(layers)]
            self.v = [like.new_zeros(shape) for _ in range(layers)]
        elif need > self.k[0].shape[2]:
            size = 1 << (need - 1).bit_length()
            grow = lambda t: torch.cat([t[:, :, :self.n], t.new_zeros(t.shape[0], t.shape[1], size - self.n,  # noqa: E731
                                                                                    t.shape[3])], 2)
            self.k, self.v = [grow(t) for t in self.k], [grow(t) for t in self.v]

    def append(self, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """kvs: per layer (k, v) [1, h, m, d] of the next m positions."""
        m = kvs[0][0].shape[2]
        self.reserve(kvs[0][0], len(kvs), self.n + m)
        for i, (k, v) in enumerate(kvs):
            self.k[i][:, :, self.n:self.n + m] = k
            self.v[i][:, :, self.n:self.n + m] = v
        self.n += m

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer the committed (k, v) [1, h, n, d] (views: valid until the next ``append``)."""
        return [(k[:, :, :self.n], v[:, :, :self.n]) for k, v in zip(self.k, self.v)]

    def slot(self, layer: int) -> "_Slot":
        return _Slot(self, layer)


class _Slot:
    def __init__(self, kv: GrowingKV, layer: int):
        self.kv, self.layer = kv, layer

    def join(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [1, h, Q, d] the block's own -> [committed ; block] [1, h, n + Q, d]."""
        kv, Q = self.kv, k.shape[2]
        kv.reserve(k, self.layer + 1, kv.n + Q)
        end = kv.n + Q
        kv.k[self.layer][:, :, kv.n:end] = k
        kv.v[self.layer][:, :, kv.n:end] = v
        return kv.k[self.layer][:, :, :end], kv.v[self.layer][:, :, :end]
