import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specbook.sampling import (
    SamplingConfig,
    logits_to_probs,
    make_generator,
    sample,
    top_k_filter,
    top_p_filter,
    validate,
)


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    p = logits_to_probs(logits, temperature=0)
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))  # ties -> lowest index


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 3.0])
    p = logits_to_probs(logits, temperature=2.0)
    assert torch.allclose(p, torch.softmax(logits / 2, -1))
    assert p.dtype == torch.float32


def test_bf16_logits_give_fp32_probs():
    p = logits_to_probs(torch.randn(3, 10, generator=make_generator(0)).bfloat16(), temperature=1.0)
    assert p.dtype == torch.float32 and torch.allclose(p.sum(-1), torch.ones(3))


def test_top_k_keeps_k():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    assert torch.isinf(top_k_filter(logits, 2)).tolist() == [True, False, True, False]


def test_top_p_keeps_the_greedy_token_among_ties():
    """Equal logits: the nucleus is made of the lowest indices, so it holds argmax's pick (index 0)."""
    for V in (5, 17, 300):
        kept = ~torch.isinf(top_p_filter(torch.zeros(V), 0.5))
        assert kept[0] and kept.sum() == -(-V // 2)


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = ~torch.isinf(top_p_filter(probs.log(), 0.8))
    assert kept.tolist() == [True, True, False, False]
    kept = ~torch.isinf(top_p_filter(probs.log(), 0.81))
    assert kept.tolist() == [True, True, True, False]
    kept = ~torch.isinf(top_p_filter(probs.log(), 0.1))
    assert kept.tolist() == [True, False, False, False]  # the top token is always kept


@pytest.mark.parametrize("kw,msg", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(temperature=float("nan")), "temperature"),
])
def test_bad_arguments_are_named(kw, msg):
    args = dict(temperature=1.0, top_k=None, top_p=1.0) | kw
    with pytest.raises(ValueError, match=msg):
        validate(**args)
    with pytest.raises(ValueError, match=msg):
        SamplingConfig(**args)


def test_sample_is_reproducible_and_uses_the_generator():
    p = torch.softmax(torch.randn(64, 20, generator=make_generator(1)), -1)
    a, b = sample(p, make_generator(7)), sample(p, make_generator(7))
    c = sample(p, make_generator(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sample_matches_distribution():
    p = torch.tensor([0.1, 0.0, 0.6, 0.3])
    toks = sample(p.expand(200_000, 4), make_generator(3))
    freq = torch.bincount(toks, minlength=4).float() / toks.numel()
    assert freq[1] == 0
    assert torch.allclose(freq, p, atol=0.005)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=2, max_size=30), st.floats(0.05, 3.0),
       st.integers(0, 40), st.floats(0.01, 1.0))
def test_probs_are_a_distribution_and_never_sample_filtered(logits, t, k, p):
    logits = torch.tensor(logits)
    probs = logits_to_probs(logits, temperature=t, top_k=k, top_p=p)
    assert torch.all(probs >= 0) and abs(float(probs.sum()) - 1) < 1e-5
    assert probs[logits.argmax()] > 0  # the most likely token always survives
    if k:  # ties with the k-th largest logit are kept (as transformers' TopKLogitsWarper does)
        kth = logits.sort(descending=True).values[min(k, len(logits)) - 1]
        assert int((probs > 0).sum()) <= int((logits >= kth).sum())
    toks = sample(probs.expand(50, -1), make_generator(0))
    assert torch.all(probs[toks] > 0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=2, max_size=8), st.integers(1, 6), st.integers(0, 10_000))
def test_gumbel_top_k_draws_are_distinct_and_in_the_support(w, k, seed):
    from specbook.sampling import gumbel_top_k, without_replacement_rows

    q = torch.tensor(w)
    if q.sum() == 0:
        return
    q = q / q.sum()
    t = gumbel_top_k(q, k, torch.Generator().manual_seed(seed))
    assert len(set(t.tolist())) == len(t) == min(k, int((q > 0).sum()))
    assert all(float(q[i]) > 0 for i in t)
    rows = without_replacement_rows(q, t)
    for i in range(len(t)):
        assert abs(float(rows[i].sum()) - 1) < 1e-5 and all(float(rows[i][j]) == 0 for j in t[:i])


def test_gumbel_top_k_first_draw_is_q_and_pairs_match_sequential_sampling():
    """By enumeration: P(first = a) = q(a), P(first = a, second = b) = q(a) q(b) / (1 - q(a)) — 40,000 draws
    against the exact values (tolerance ~5 standard errors)."""
    from specbook.sampling import gumbel_top_k

    q = torch.tensor([0.5, 0.25, 0.15, 0.1])
    g = torch.Generator().manual_seed(0)
    n = 40_000
    first, pair = torch.zeros(4), torch.zeros(4, 4)
    for _ in range(n):
        a, b = gumbel_top_k(q, 2, g).tolist()
        first[a] += 1
        pair[a, b] += 1
    assert torch.allclose(first / n, q, atol=5 * (0.25 / n) ** 0.5)
    exact = q[:, None] * q[None, :] / (1 - q[:, None])
    exact.fill_diagonal_(0)
    assert torch.allclose(pair / n, exact, atol=5 * (0.25 / n) ** 0.5)
