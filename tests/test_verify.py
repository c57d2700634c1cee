"""Losslessness of the verification core: analytic (hypothesis) and statistical (tiny model, enumerable)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specbook import verify as V
from specbook.models import tiny_llama
from specbook.sampling import SamplingConfig, make_generator
from specbook.verify import DraftTree, accept_prob, residual, verify

# --------------------------------------------------------------------------- analytic (exact) checks

def dist(xs):
    t = torch.tensor(xs, dtype=torch.float64)
    return t / t.sum()


def _vec(size):
    # probability vectors with zeros allowed (disjoint supports happen)
    return st.lists(st.one_of(st.just(0.0), st.floats(0.01, 1.0)), min_size=size, max_size=size).filter(lambda v: sum(v) > 0)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 6).flatmap(lambda n: st.tuples(_vec(n), _vec(n))))
def test_one_step_output_distribution_is_exactly_p(pq):
    """Draft x ~ q, accept w.p. min(1, p/q), else residual: P(out = y) = p(y) for any p, q."""
    p, q = dist(pq[0]), dist(pq[1])
    out = torch.zeros_like(p)
    reject = 0.0
    for x in range(len(p)):
        if q[x] == 0:
            continue
        a = accept_prob(float(p[x]), float(q[x]))
        out[x] += q[x] * a
        reject += float(q[x]) * (1 - a)
    out += reject * residual(p, q)
    assert torch.allclose(out, p, atol=1e-9)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 5).flatmap(lambda n: st.tuples(_vec(n), _vec(n))))
def test_two_iid_siblings_recursive_rejection_is_exactly_p(pq):
    """Tree step: two children drawn i.i.d. from q, tried in turn with p <- residual(p, q) between."""
    p, q = dist(pq[0]), dist(pq[1])
    out = torch.zeros_like(p)
    for x1 in range(len(p)):
        if q[x1] == 0:
            continue
        a1 = accept_prob(float(p[x1]), float(q[x1]))
        out[x1] += q[x1] * a1
        p2 = residual(p, q)
        for x2 in range(len(p)):
            if q[x2] == 0:
                continue
            a2 = accept_prob(float(p2[x2]), float(q[x2]))
            out[x2] += q[x1] * (1 - a1) * q[x2] * a2
            out += q[x1] * (1 - a1) * q[x2] * (1 - a2) * residual(p2, q)
    assert torch.allclose(out, p, atol=1e-9)


def test_greedy_verification():
    V_ = 6
    logits = torch.full((4, V_), -5.0)
    for row, tok in enumerate([2, 3, 1, 4]):
        logits[row, tok] = 5.0
    d = DraftTree.chain(torch.tensor([2, 3, 5]))
    r = verify(logits, d, SamplingConfig(0.0))
    assert r.path == [0, 1] and r.next_token == 1 and not r.bonus
    d = DraftTree.chain(torch.tensor([2, 3, 1]))
    r = verify(logits, d, SamplingConfig(0.0))
    assert r.path == [0, 1, 2] and r.next_token == 4 and r.bonus
    # a tree: second child of the root matches
    d = DraftTree(torch.tensor([0, 2, 3]), torch.tensor([-1, -1, 1]))
    r = verify(logits[[0, 0, 1, 2]], d, SamplingConfig(0.0))
    assert r.path == [1, 2] and r.bonus


def test_bad_drafts_are_rejected():
    with pytest.raises(ValueError, match="topologically"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]))
    with pytest.raises(ValueError, match="one row per node"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), q=torch.ones(3, 4))
    d = DraftTree.chain(torch.tensor([1]), q=torch.tensor([[1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="q\\(x\\)=0"):
        verify(torch.zeros(2, 3), d, SamplingConfig(1.0), make_generator(0))
    with pytest.raises(ValueError, match="Generator"):
        verify(torch.zeros(2, 3), d, SamplingConfig(1.0))


# --------------------------------------------------------------------------- statistical check on a tiny model

from specbook.exactness import exact_first_two, logit_table, speculative_first_two, tv, tv_bound  # noqa: E402

VOCAB = 12
PROMPT = [0, 3, 7]
N = 100_000


@pytest.fixture(scope="module")
def tables():
    """Exact target (p) and draft (q) next-token logits for every prefix of length <= 2 after PROMPT."""
    tgt = tiny_llama(vocab_size=VOCAB, hidden_size=32, seed=3)
    drf = tiny_llama(vocab_size=VOCAB, hidden_size=32, seed=4)
    return logit_table(tgt, PROMPT), logit_table(drf, PROMPT)


@pytest.mark.parametrize("cfg", [SamplingConfig(0.5), SamplingConfig(1.0), SamplingConfig(1.0, top_p=0.8)],
                         ids=["T0.5", "T1", "T1-top_p0.8"])
def test_speculative_sampling_is_lossless(tables, cfg):
    p_logits, q_logits = tables
    exact = exact_first_two(p_logits, cfg)
    emp = speculative_first_two(p_logits, q_logits, cfg, N, make_generator(1))
    d, b = tv(emp, exact), tv_bound(exact, N)
    print(f"TV={d:.4f} bound={b:.4f}")
    assert d < b, f"TV {d:.4f} >= bound {b:.4f}: speculative output is not distributed as the target"


def test_broken_sampler_fails_the_same_test(tables, monkeypatch):
    """Teeth: drop the residual (sample the correction from p instead) -> the TV test must fail."""
    p_logits, q_logits = tables
    cfg = SamplingConfig(1.0)
    monkeypatch.setattr(V, "residual", lambda p, q: p)
    exact = exact_first_two(p_logits, cfg)
    emp = speculative_first_two(p_logits, q_logits, cfg, N, make_generator(1))
    print(f"broken: TV={tv(emp, exact):.4f} bound={tv_bound(exact, N):.4f}")
    assert tv(emp, exact) > 2 * tv_bound(exact, N)


# --------------------------------------------------------------------------- the draft contract, typical acceptance


def test_sibling_contract_is_checked():
    q = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.8, 0.0], [0.5, 0.5, 0.0]])
    with pytest.raises(ValueError, match="one-hot picks carry q=None"):
        DraftTree(torch.tensor([0, 1]), torch.tensor([-1, -1]), children="iid")
    with pytest.raises(ValueError, match="children must be one of"):
        DraftTree(torch.tensor([0, 1]), torch.tensor([-1, -1]), q[:2], children="bogus")
    # without replacement: sibling 2's row must be sibling 1's minus its token, renormalized
    wr = DraftTree(torch.tensor([0, 1]), torch.tensor([-1, -1]), torch.tensor([[0.5, 0.3, 0.2], [0.0, 0.6, 0.4]]),
                   children="noreplace")
    verify(torch.zeros(3, 3), wr, SamplingConfig(1.0), make_generator(0))
    for rows, toks in (([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]], [0, 1]),  # the drawn token not removed from q
                       ([[0.5, 0.3, 0.2], [0.0, 0.6, 0.4]], [0, 0])):  # a repeated token
        bad_wr = DraftTree(torch.tensor(toks), torch.tensor([-1, -1]), torch.tensor(rows), children="noreplace")
        with pytest.raises(ValueError, match="without replacement"):
            verify(torch.zeros(3, 3), bad_wr, SamplingConfig(1.0), make_generator(0))
    bad = DraftTree(torch.tensor([0, 1, 1]), torch.tensor([-1, -1, 0]), q)  # siblings 0 and 1 carry different q
    with pytest.raises(ValueError, match="different q rows"):
        verify(torch.zeros(4, 3), bad, SamplingConfig(1.0), make_generator(0))
    ok = DraftTree(torch.tensor([0, 1, 1]), torch.tensor([-1, -1, 0]), q[[0, 2, 1]])
    verify(torch.zeros(4, 3), ok, SamplingConfig(1.0), make_generator(0))  # i.i.d. siblings from one q: fine


def test_truncate_depth_keeps_a_closed_subtree():
    d = DraftTree(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 0, 2, 1]), confidence=torch.arange(5.0))
    t = d.truncate_depth(2)
    assert t.tokens.tolist() == [5, 6, 7, 9] and t.parents.tolist() == [-1, -1, 0, 1]
    assert t.confidence.tolist() == [0.0, 1.0, 2.0, 4.0] and len(d.truncate_depth(0)) == 0


def _peaked(rows):
    """Logits [len(rows), 6] with row r peaked on the tokens in rows[r] (equal mass), near zero elsewhere."""
    lg = torch.full((len(rows), 6), -8.0)
    for r, toks in enumerate(rows):
        lg[r, toks] = 0.0
    return lg


def test_typical_acceptance_takes_the_longest_candidate():
    """Medusa's rule: every candidate keeps its longest typical prefix and the longest one wins — not the first
    typical child in tree order. Tree: root -> 0 -> 2 (2 atypical), root -> 1 -> 3 (both typical)."""
    tree = DraftTree(torch.tensor([0, 1, 2, 3]), torch.tensor([-1, -1, 0, 1]))
    p = _peaked([[0, 1], [4], [3], [5], [5]])  # root: 0 and 1 typical; after 0: 4 (not 2); after 1: 3
    r = V.typical_accept(p, tree, SamplingConfig(1.0), generator=make_generator(0))
    assert r.path == [1, 3] and r.bonus and r.next_token == 5
    assert sorted(r.tested) == [(0, True), (0, True), (1, False), (1, True)]


def test_typical_acceptance_at_T0_is_exactly_greedy_on_ties():
    """At temperature 0 only the argmax is typical: on an exact logit tie the argmax is the first index, as in
    greedy verification (a near-zero temperature such as 1e-5 would accept the tied non-argmax token too)."""
    tree = DraftTree.chain(torch.tensor([2]))
    p = _peaked([[1, 2], [3]])  # tokens 1 and 2 tie; argmax = 1
    r = V.typical_accept(p, tree, SamplingConfig(0.0))
    assert r.path == [] and r.next_token == 1
    assert V.typical_accept(p, tree, SamplingConfig(0.0)) == verify(p, tree, SamplingConfig(0.0))
