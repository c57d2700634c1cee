"""KV-cache rollback on top of transformers' Cache.

After verification only the accepted prefix (chain) or the accepted root-to-leaf path (tree) of
the draft may stay in the target's cache:

    crop_to(cache, n)               keep the first n positions (chain rollback)
    keep_positions(cache, start, idx)  keep positions [0, start) + start + idx, in order (tree compaction)

Both work on transformers' dynamic cache and on fastpath.StaticKVCache (rollback = moving its length).

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
