import pytest
import torch

from specbook.cache import crop_to, keep_positions
from specbook.decoding import new_cache
from specbook.models import cache_kw
from specbook.tree import ancestor_mask, block_inputs, depths, leaf_paths


def test_chain_tree():
    parents = torch.tensor([-1, 0, 1])
    assert depths(parents).tolist() == [0, 1, 2]
    m = ancestor_mask(parents)
    assert torch.equal(m, torch.tril(torch.ones(4, 4, dtype=torch.bool)))  # a chain is causal attention
    assert leaf_paths(parents) == [[0, 1, 2]]


def test_star_tree():
    parents = torch.tensor([-1, -1, -1])
    assert depths(parents).tolist() == [0, 0, 0]
    m = ancestor_mask(parents)
    assert torch.equal(m, torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]], dtype=torch.bool))
    assert leaf_paths(parents) == [[0], [1], [2]]


def test_unbalanced_tree():
    #        root
    #       /    \
    #      0      1
    #     / \      \
    #    2   3      4
    #    |
    #    5
    parents = torch.tensor([-1, -1, 0, 0, 1, 2])
    assert depths(parents).tolist() == [0, 0, 1, 1, 1, 2]
    m = ancestor_mask(parents)
    assert m[6].tolist() == [True, True, False, True, False, False, True]  # node 5 sees root, 0, 2, itself
    assert leaf_paths(parents) == [[0, 3], [1, 4], [0, 2, 5]]
    mask, pos = block_inputs(parents, past=10)
    assert mask.shape == (1, 1, 7, 17) and pos.tolist() == [[10, 11, 11, 12, 12, 12, 13]]
    assert (mask[0, 0, :, :10] == 0).all()  # the whole cache is visible
    assert mask[0, 0, 6, 10 + 4] == torch.finfo(torch.float32).min  # node 5 must not see node 3


def test_missing_parent_is_an_error():
    with pytest.raises(ValueError, match="topologically"):
        depths(torch.tensor([-1, 3, 0]))
    with pytest.raises(ValueError, match="root"):
        depths(torch.tensor([-2]))


def _kv(model, ids):
    cache = new_cache(model)
    with torch.no_grad():
        model(input_ids=ids, **cache_kw(cache), use_cache=True)
    return cache


def test_crop_equals_recomputed_cache(tiny):
    ids = torch.tensor([[0, 5, 9, 11, 3, 7, 2, 8]])
    cache = _kv(tiny, ids)
    crop_to(cache, 5)
    fresh = _kv(tiny, ids[:, :5])
    for a, b in zip(cache.layers, fresh.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-6) and torch.allclose(a.values, b.values, atol=1e-6)
    with pytest.raises(ValueError, match="cannot crop"):
        crop_to(cache, 9)


def test_tree_forward_and_path_compaction_equal_the_chain(tiny):
    """Tree logits along a path equal the chain's; the compacted cache equals a recomputed one."""
    ctx = torch.tensor([[0, 5, 9, 11]])
    parents = torch.tensor([-1, -1, 0, 0, 1, 2])
    tokens = torch.tensor([4, 6, 7, 8, 9, 10])
    past = ctx.shape[1] - 1
    cache = _kv(tiny, ctx[:, :-1])
    mask, pos = block_inputs(parents, past)
    block = torch.cat([ctx[:, -1:], tokens[None]], dim=1)
    with torch.no_grad():
        tree_logits = tiny(input_ids=block, attention_mask=mask, position_ids=pos, **cache_kw(cache), use_cache=True).logits
    path = [0, 2, 5]
    chain = torch.cat([ctx, tokens[path][None]], dim=1)
    with torch.no_grad():
        chain_logits = tiny(input_ids=chain).logits
    rows = [0] + [i + 1 for i in path]
    assert torch.allclose(tree_logits[0, rows], chain_logits[0, past:], atol=1e-4)
    keep_positions(cache, past + 1, torch.tensor(path))
    fresh = _kv(tiny, chain)
    for a, b in zip(cache.layers, fresh.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)
