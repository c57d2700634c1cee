"""The block drafter's compiled step (drafters/block_compiled.py) and the context buffer it reads (cache.GrowingKV):
the buffer equals concatenation, the fixed-shape step drafts what the plain block forward drafts (eagerly and
compiled, across a buffer regrowth), one graph per capacity, the bench setting."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specbook.cache import GrowingKV
from specbook.decoding import generate, speculative_generate
from specbook.drafters.block_compiled import CompiledBlock
from specbook.drafters.dflash import BlockDrafter, BlockNet
from specbook.models import tiny_llama
from specbook.sampling import SamplingConfig


@given(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 5)), min_size=1, max_size=12), st.integers(0, 2))
@settings(max_examples=40, deadline=None)
def test_growing_kv_equals_concatenation(steps, seed):
    """Appends of m positions and block joins of Q positions, in any order, read what torch.cat of the same
    tensors reads, whether or not the buffer had to grow (capacity 4 here: most sequences grow it)."""
    g = torch.Generator().manual_seed(seed)
    kv, ref = GrowingKV(capacity=4), [(torch.zeros(1, 2, 0, 3), torch.zeros(1, 2, 0, 3)) for _ in range(2)]
    for m, Q in steps:
        new = [(torch.randn(1, 2, m, 3, generator=g), torch.randn(1, 2, m, 3, generator=g)) for _ in range(2)]
        kv.append(new)
        ref = [(torch.cat([k0, k], 2), torch.cat([v0, v], 2)) for (k0, v0), (k, v) in zip(ref, new)]
        for layer in range(2):
            bk, bv = torch.randn(1, 2, Q, 3, generator=g), torch.randn(1, 2, Q, 3, generator=g)
            k, v = kv.slot(layer).join(bk, bv)
            torch.testing.assert_close(k, torch.cat([ref[layer][0], bk], 2), rtol=0, atol=0)
            torch.testing.assert_close(v, torch.cat([ref[layer][1], bv], 2), rtol=0, atol=0)
        for (k, v), (rk, rv) in zip(kv.views(), ref):  # the block's scratch never reaches the committed slots
            assert torch.equal(k, rk) and torch.equal(v, rv)
    assert kv.k[0].shape[2] & (kv.k[0].shape[2] - 1) == 0  # capacities stay powers of two
    with pytest.raises(ValueError, match="power of two"):
        GrowingKV(capacity=3)


@pytest.fixture(scope="module")
def deep():
    return tiny_llama(vocab_size=48, hidden_size=32, layers=8, seed=1, max_position_embeddings=512)


def _dspark(target, seed=0):
    torch.manual_seed(seed)
    net = BlockNet(target.config, torch.arange(0, 48, 2), gamma=4, layers=2, markov_rank=8, confidence=True)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return net.eval()


def _decode(target, net, compiled, ids, n, temperature=1.0, seed=3):
    d = BlockDrafter(target, net, threshold=0.2, compiled=compiled)
    trace: list = []
    res = speculative_generate(target, d, ids, max_new_tokens=n, eos_token_id=-1, sampling=SamplingConfig(temperature),
                               generator=torch.Generator().manual_seed(seed), trace=trace)
    return res.tokens[0], [t["draft"] for t in trace], d.survival


@pytest.mark.parametrize("compile", [False, True])
def test_the_step_drafts_what_the_block_forward_drafts(deep, compile):
    """fp32, T = 1 and T = 0 (the greedy chain drawn inside the step): the same draws, the same blocks cut at the
    same places, survivals equal to float rounding — over a long prompt (appended eagerly first) and past 256 context
    slots (the buffer regrown: a second capacity)."""
    net = _dspark(deep)
    cb = CompiledBlock(net, deep.get_output_embeddings().weight[net.vocab], compile=compile)
    for prompt, n, temperature in ((5, 24, 1.0), (30, 260, 1.0), (5, 40, 0.0), (12, 260, 0.0)):
        ids = torch.randint(0, 48, (1, prompt), generator=torch.Generator().manual_seed(prompt))
        (t0, d0, s0), (t1, d1, s1) = (_decode(deep, net, c, ids, n, temperature) for c in (None, cb))
        assert t0 == t1 and d0 == d1
        assert max(abs(a - b) for x, y in zip(s0, s1) for a, b in zip(x, y)) < 1e-5
    assert cb.calls > 0 and ("256+greedy" in cb.warmup_s or not compile)


def test_one_graph_per_capacity_and_lossless_at_t0(deep):
    from specbook.fastpath import _graphs_built

    net = _dspark(deep, seed=4)
    cb = CompiledBlock(net, deep.get_output_embeddings().weight[net.vocab])
    assert set(cb.warm_up(40, greedy=True)) == {"256+greedy"}
    built = _graphs_built()
    ids = torch.randint(0, 48, (1, 6), generator=torch.Generator().manual_seed(0))
    res = speculative_generate(deep, BlockDrafter(deep, net, threshold=0.2, compiled=cb), ids, max_new_tokens=30,
                               eos_token_id=-1)
    assert res.tokens[0] == generate(deep, ids, max_new_tokens=30, eos_token_id=-1).tokens[0]
    assert _graphs_built() == built  # the warmed-up graph served every step: no compile inside the decode
    assert set(cb.warm_up(300)) == {"256+greedy", "256", "512"}
    assert cb.stats_json()["warmup_total_s"] > 0
    assert cb.measure_cost(context=16, repeats=1) > 0 and "32" not in cb.warmup_s  # no graph below 256
    with pytest.raises(ValueError, match="another network or block"):
        BlockDrafter(deep, _dspark(deep, seed=5), compiled=cb)
    with pytest.raises(ValueError, match="another network or block"):
        BlockDrafter(deep, net, gamma=2, compiled=cb)
    short = CompiledBlock(net, cb.W, gamma=2, compile=False)  # a shorter block than trained: its own step
    res = speculative_generate(deep, BlockDrafter(deep, net, gamma=2, compiled=short), ids, max_new_tokens=30,
                               eos_token_id=-1)
    assert res.tokens[0] == generate(deep, ids, max_new_tokens=30, eos_token_id=-1).tokens[0] and short.calls > 0


def test_bench_block_draft_setting():
    from specbook.bench import BlockSettings, parse_variant

    assert parse_variant("dspark[draft=eager]") == ("dspark", {("block", "draft"): "eager"})
    assert BlockSettings().compiled("compiled") and not BlockSettings().compiled("static")
    assert BlockSettings(draft="compiled").compiled("hf") and not BlockSettings(draft="eager").compiled("compiled")
    with pytest.raises(ValueError, match="block draft"):
        BlockSettings(draft="fast")
