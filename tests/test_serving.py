"""The serving loop (serving.py): the policies by hand, DSpark's Appendix A counterexample, the step curve,
greedy identity with requests joining and leaving, exact losslessness of Algorithm 1 with concurrent requests, and
the no-early-stop scheduler failing the same check."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specbook import serving as S
from specbook.decoding import generate
from specbook.drafters.dflash import BlockDrafter, BlockNet
from specbook.drafters.draft_model import DraftModelDrafter
from specbook.exactness import exact_joint, logit_table, noise_floor, tv
from specbook.models import tiny_llama
from specbook.sampling import SamplingConfig
from specbook.verify import DraftTree

VOCAB = 4


class Confident(DraftModelDrafter):
    """A draft model whose drafts carry survivals from a rule on the previous draft token: c_1 = ``first``,
    c_j = ``high`` if x_{j-1} is in ``favoured`` else ``low``. Any function of the tokens before position j is a
    legal confidence (it is known before x_j is drawn); one this sharp makes the no-early-stop bias large."""

    confidences = True

    def __init__(self, draft, favoured=(2,), first=0.6, high=0.95, low=0.02, gamma=2):
        super().__init__(draft, gamma=gamma)
        self.favoured, self.first, self.high, self.low = set(favoured), first, high, low

    def propose(self, state):
        d = super().propose(state)
        c = [self.first] + [self.high if x in self.favoured else self.low for x in d.tokens[:-1].tolist()]
        return DraftTree(d.tokens, d.parents, d.q, torch.tensor(c).cumprod(0)[:len(d)])


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=0)


def _draft(seed):
    return tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=seed)


# ---------------------------------------------------------------- Appendix A and the scheduler by hand


APPENDIX_A = S.StepCurve({1: 1 / 1.0, 2: 1 / 0.5, 3: 1 / 0.45})  # SPS(1) = 1, SPS(2) = 0.5, SPS(3) = 0.45


def test_appendix_a_counterexample():
    """One request, gamma 2, a_1 = 0.8; x_1 = A gives c_2 = 0.9, x_1 = B gives c_2 = 0. The full search verifies x_1
    only when it is A, which outputs (0.85, 0.15) against the target's (0.7, 0.3); the early stop never admits x_1
    (Theta_1 = 0.9 < Theta_0 = 1) and outputs the target's distribution exactly."""
    p, q = torch.tensor([0.7, 0.3]), torch.tensor([0.5, 0.5])
    surv = {0: [0.8, 0.8 * 0.9], 1: [0.8, 0.8 * 0.0]}  # by x_1: A = 0, B = 1
    assert S.expected_rate([surv[0]], [2], APPENDIX_A) == pytest.approx(1.134)
    search = [S.algorithm1([surv[x]], APPENDIX_A, early_stop=False)[0] >= 1 for x in (0, 1)]
    stop = [S.algorithm1([surv[x]], APPENDIX_A, early_stop=True)[0] >= 1 for x in (0, 1)]
    assert search == [True, False] and stop == [False, False]
    torch.testing.assert_close(S.first_token_distribution(p, q, search), torch.tensor([0.85, 0.15], dtype=torch.float64))
    torch.testing.assert_close(S.first_token_distribution(p, q, stop), p.double())
    torch.testing.assert_close(S.first_token_distribution(p, q, [True, True]), p.double())  # verify always: lossless


def test_algorithm1_by_hand():
    curve = S.StepCurve({2: 1.0, 3: 1.2, 4: 1.5, 5: 2.5})
    surv = [[0.9, 0.5], [0.8, 0.1]]
    # Theta: B=2: 2.0; + (0,1) a=.9: 2.9/1.2 = 2.42; + (1,1) a=.8: 3.7/1.5 = 2.47; + (0,2) a=.5: 4.2/2.5 = 1.68 -> stop
    assert S.algorithm1(surv, curve) == [1, 1]
    assert S.greedy_path(surv) == [(0.9, 0, 1), (0.8, 1, 1), (0.5, 0, 2), (0.1, 1, 2)]
    assert S.top_budget(surv, 3) == [2, 1] and S.top_budget(surv, 0) == [0, 0]
    assert S.algorithm1([], curve) == []
    path = S.admission_path(surv, curve)
    assert [r["admitted"] for r in path] == [True, True, False, False]
    assert path[1]["B"] == 4 and path[1]["theta"] == pytest.approx(3.7 / 1.5)
    # ties keep prefixes: c = 1 makes a_{r,2} = a_{r,1}
    assert S.greedy_path([[0.5, 0.5]]) == [(0.5, 0, 1), (0.5, 0, 2)]


def test_schedule_policies():
    curve = S.StepCurve({2: 1.0, 3: 1.2, 4: 1.5, 5: 2.5})
    surv, lengths = [[0.9, 0.5], [0.8, 0.1]], [2, 2]
    sch = lambda name, **kw: S.schedule(S.parse_policy(name), surv, lengths, curve, **kw)  # noqa: E731
    assert sch("none") == [0, 0] and sch("fixed:1") == [1, 1] and sch("fixed:7") == [2, 2]
    assert sch("threshold:0.6") == [1, 1] and sch("threshold:0") == [2, 2]
    assert sch("alg1") == [1, 1]
    # vllm: the budget from last step's survivals, filled with this step's best candidates
    assert sch("vllm", stale=[[0.1, 0.0], [0.1, 0.0]]) == [0, 0]
    assert sch("vllm", stale=None) == S.top_budget(surv, sum(S.algorithm1([[1.0, 1.0]] * 2, curve, early_stop=False)))


survivals = st.lists(st.lists(st.floats(0.01, 1.0), min_size=1, max_size=7).map(
    lambda cs: torch.tensor(cs).cumprod(0).tolist()), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(survivals, st.lists(st.floats(0.01, 1.0), min_size=4, max_size=4))
def test_algorithm1_properties(surv, costs):
    """Prefix lengths within each block; the early stop's Theta >= not verifying at all; the full search's Theta
    >= the early stop's (its maximum runs along the same path); vllm's budget gives a prefix per request."""
    sizes = [1, 4, 16, 64]
    curve = S.StepCurve({s: c * s ** 0.5 + c for s, c in zip(sizes, costs)})
    ell = S.algorithm1(surv, curve)
    full = S.algorithm1(surv, curve, early_stop=False)
    for e, f, s in zip(ell, full, surv):
        assert 0 <= e <= len(s) and 0 <= f <= len(s)
    zero = S.expected_rate(surv, [0] * len(surv), curve)
    assert S.expected_rate(surv, ell, curve) >= zero - 1e-9
    assert S.expected_rate(surv, full, curve) >= S.expected_rate(surv, ell, curve) - 1e-9
    top = S.top_budget(surv, sum(full))
    assert sum(top) == sum(full) and all(t <= len(s) for t, s in zip(top, surv))


def test_step_curve_is_monotone_and_interpolates():
    c = S.StepCurve({1: 1.0, 4: 0.8, 8: 2.0})  # 1 token slower than 4: padded to 4 it costs 0.8
    assert c.seconds_by_size == {1: 0.8, 4: 0.8, 8: 2.0}
    assert c.seconds(6) == pytest.approx(1.4) and c.seconds(16) == pytest.approx(4.0) and c.seconds(0.5) == 0.8
    assert c.sps(8) == pytest.approx(0.5)
    assert S.StepCurve.from_json(c.to_json()).seconds_by_size == c.seconds_by_size
    with pytest.raises(ValueError, match="at least one"):
        S.StepCurve({})


def test_profile_step_curve_on_a_tiny_model(target):
    c = S.profile_step_curve(target, sizes=(1, 2, 4), context=8, repeats=1)
    vals = [c.seconds_by_size[k] for k in (1, 2, 4)]
    assert vals == sorted(vals) and all(v > 0 for v in vals) and c.context == 8


# ---------------------------------------------------------------- bad input


def test_bad_input(target):
    reqs = S.closed_loop([[0, 1, 2]], 4)
    with pytest.raises(ValueError, match="concurrency"):
        S.serve(target, reqs, concurrency=0)
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        S.serve(target, reqs, policy="fastest")
    for bad in ("fixed:0", "fixed:x", "threshold:2", "alg1:3"):
        with pytest.raises(ValueError):
            S.parse_policy(bad)
    with pytest.raises(ValueError, match="DSpark"):  # a confidence policy with a drafter that has none
        S.serve(target, reqs, policy="alg1", drafter=DraftModelDrafter(_draft(9)), curve=APPENDIX_A)
    with pytest.raises(ValueError, match="drafter"):
        S.serve(target, reqs, policy="fixed:2")
    with pytest.raises(ValueError, match="not lossless"):
        S.serve(target, reqs, policy="search", drafter=Confident(_draft(9)), curve=APPENDIX_A)
    with pytest.raises(ValueError, match="step curve"):
        S.serve(target, reqs, policy="alg1", drafter=Confident(_draft(9)))
    with pytest.raises(ValueError, match="exceeds the model context"):
        S.serve(target, S.closed_loop([[0] * 250], 10))
    with pytest.raises(ValueError, match="no requests"):
        S.serve(target, [])
    with pytest.raises(ValueError, match="rate"):
        S.poisson_trace([[0]], 4, rate=0)
    with pytest.raises(ValueError, match="drafter must be one of"):  # the CLI's loader, before any model loads
        S._load("smollm2-135m-instruct", "fast", "medusa")
    with pytest.raises(ValueError, match="gamma"):
        S._load("smollm2-135m-instruct", "fast", "eagle", gamma=0)


# ---------------------------------------------------------------- greedy identity, joins and leaves


PROMPTS = [[0, 3, 2, 1], [0, 2, 2], [0, 1, 3, 3, 2], [0, 2], [0, 3, 3, 1, 1, 2]]


@pytest.mark.parametrize("policy", ["none", "fixed:1", "fixed:3", "threshold:0.3", "alg1", "vllm"])
def test_greedy_output_is_each_requests_own(target, policy):
    """T = 0, fp32: every request's tokens equal its own plain greedy decoding, whatever shares the batch: 5 requests
    of different lengths through concurrency 2 (requests join as others finish) and a Poisson trace."""
    full = [generate(target, torch.tensor([p]), max_new_tokens=12, eos_token_id=-1).tokens[0] for p in PROMPTS]
    ref = [r[:n] for r, n in zip(full, (9, 4, 7, 12, 5))]  # greedy: a shorter budget is a prefix
    reqs = [S.Request(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS, (9, 4, 7, 12, 5)))]
    drafter = None if policy == "none" else Confident(_draft(9), gamma=3, first=0.9, high=0.8, low=0.3)
    curve = S.StepCurve({2: 1.0, 3: 1.1, 4: 1.2, 8: 2.0})
    out = S.serve(target, reqs, policy=policy, drafter=drafter, concurrency=2, curve=curve, eos_token_id=-1)
    assert [r.tokens for r in out.requests] == ref
    assert max(s.requests for s in out.steps) == 2 and out.tokens == sum(len(r) for r in ref)
    trace = S.poisson_trace(PROMPTS, 6, rate=50.0, seed=1)
    out = S.serve(target, trace, policy=policy, drafter=drafter, concurrency=3, curve=curve, eos_token_id=-1)
    assert [r.tokens for r in out.requests] == [x[:6] for x in full]
    assert all(r.finished_at >= r.first_token_at >= r.arrival for r in out.requests)


def test_block_drafter_serves_and_records(target):
    """The DSpark block drafter (target features through the packed forward) under Algorithm 1: greedy identity, and
    the per-step trace the simulator replays."""
    torch.manual_seed(0)
    net = BlockNet(target.config, torch.tensor([0, 2, 3]), gamma=3, layers=1, taps=(1,), markov_rank=4,
                   confidence=True).eval()
    d = BlockDrafter(target, net)
    reqs = S.closed_loop(PROMPTS[:3], 8)
    curve = S.StepCurve({3: 1.0, 4: 1.05, 6: 1.2, 12: 3.0})
    out = S.serve(target, reqs, policy="alg1", drafter=d, concurrency=3, curve=curve, eos_token_id=-1, record=True)
    ref = [generate(target, torch.tensor([p]), max_new_tokens=8, eos_token_id=-1).tokens[0] for p in PROMPTS[:3]]
    assert [r.tokens for r in out.requests] == ref
    steps = [t for r in out.requests for t in r.trace]
    assert steps and all(len(t["survival"]) == t["drafted"] == 3 and t["accepted"] <= t["verified"] for t in steps)
    assert sum(r.verified for r in out.requests) == sum(t["verified"] for t in steps) > 0
    with pytest.raises(ValueError, match="threshold=None"):
        S.serve(target, reqs, policy="alg1", drafter=BlockDrafter(target, net, threshold=0.5), curve=curve)


def _eagle_chain(target, depth=3, calibration=1.5, children="topk"):
    from specbook.drafters.eagle import EagleDrafter, EagleHead
    from specbook.tree import chain_choices

    torch.manual_seed(0)
    head = EagleHead(target.config).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for prm in head.parameters():
            prm.add_(torch.randn(prm.shape, generator=g) * 0.2)
    return EagleDrafter(target, head, choices=chain_choices(depth), calibration=calibration, children=children)


@pytest.mark.parametrize("policy", ["fixed:3", "alg1"])
def test_eagle_chain_serves_with_its_path_confidence(target, policy):
    """An EAGLE chain (target features through the packed forward, the chains drafted together) as the second
    survival source: greedy identity with AR while requests join and leave, survivals recorded per step, non-increasing
    and <= 1; Algorithm 1 verifies some but not all of them. A tree-drafting EagleDrafter is refused."""
    from specbook.drafters.eagle import EagleDrafter

    d = _eagle_chain(target)
    reqs = [S.Request(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS, (8, 5, 9, 3, 7)))]
    curve = S.StepCurve({3: 1.0, 4: 1.05, 6: 1.2, 12: 3.0})
    out = S.serve(target, reqs, policy=policy, drafter=d, concurrency=3, curve=curve, eos_token_id=-1, record=True)
    ref = [generate(target, torch.tensor([r.prompt]), max_new_tokens=r.max_new_tokens, eos_token_id=-1).tokens[0]
           for r in reqs]
    assert [r.tokens for r in out.requests] == ref
    steps = [t for r in out.requests for t in r.trace]
    assert all(t["survival"] == sorted(t["survival"], reverse=True) and max(t["survival"]) <= 1 for t in steps)
    verified, drafted = sum(s.verified for s in out.steps), sum(s.drafted for s in out.steps)
    assert (verified == drafted) if policy == "fixed:3" else (0 < verified < drafted)
    tree = EagleDrafter(target, d.head, choices=[(0,), (1,), (0, 0)])
    with pytest.raises(ValueError, match="chain_choices"):
        S.serve(target, reqs, policy="alg1", drafter=tree, curve=curve)


def test_a_tree_draft_is_refused_at_run_time(target):
    """A drafter without the ``chain`` flag whose proposal is a tree (two siblings) is refused with a clear error
    when it drafts, not verified as if it were a chain."""

    class Siblings(DraftModelDrafter):
        def propose(self, state):
            return DraftTree(torch.tensor([1, 2]), torch.tensor([-1, -1]))

    with pytest.raises(ValueError, match="proposed a tree"):
        S.serve(target, S.closed_loop(PROMPTS[:2], 4), policy="fixed:2", drafter=Siblings(_draft(9), gamma=2),
                concurrency=2, eos_token_id=-1)


@pytest.mark.parametrize("compile", [False, True])
def test_serving_on_the_static_cache_equals_transformers_cache(target, compile, monkeypatch):
    """The packed row as a FastTarget's static cache (eager, and compiled on a few buckets), started too small for
    three running requests so that holes are compacted away and the row is grown mid-run: every request's tokens
    equal the same serving run on transformers' cache (fp32, T = 0), for a draft model and the block drafter (target
    features through the packed forward)."""
    from specbook.fastpath import FastTarget

    torch.manual_seed(0)
    net = BlockNet(target.config, torch.tensor([0, 2, 3]), gamma=3, layers=1, taps=(1,), markov_rank=4,
                   confidence=True).eval()
    budgets = (150, 60, 200, 120, 160)  # three running at once need more than the 256 slots the row starts with
    reqs = [S.Request(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS, budgets))]
    curve = S.StepCurve({3: 1.0, 4: 1.05, 6: 1.2, 12: 3.0})
    ft = FastTarget(target, compile=compile, buckets=(1, 4, 16))
    draft = Confident(_draft(9), gamma=3, first=0.9, high=0.8, low=0.3)
    cases = [("fixed:3", draft, draft)]  # (policy, drafter on transformers' cache, drafter on the FastTarget)
    if not compile:  # the block drafter's graphs (with hidden states) would double the compile time
        cases.append(("alg1", BlockDrafter(target, net), BlockDrafter(ft, net)))
    ref = [S.serve(target, reqs, policy=p, drafter=d, concurrency=3, curve=curve, eos_token_id=-1)
           for p, d, _ in cases]
    monkeypatch.setattr(S, "packed_capacity", lambda *a: 64)  # a row smaller than three requests need
    for (p, _, d), r in zip(cases, ref):
        out = S.serve(ft, reqs, policy=p, drafter=d, concurrency=3, curve=curve, eos_token_id=-1)
        assert [x.tokens for x in out.requests] == [x.tokens for x in r.requests], p
        assert out.grown >= 1 and out.tokens == sum(budgets)
        # compiled: the row's graphs before the clock; the grown row's wider graphs inside it, reported apart
        assert (out.compile_s > 0 and out.compile_in_clock_s > 0) if compile else out.compile_s == 0
    if compile:
        assert ft.stats.compiled_calls > 0 and ft.stats.recompiles == 0 and ft.stats.warmup_s
    else:
        assert ft.stats.eager_calls > 0 and ft.stats.compiled_calls == 0


# ---------------------------------------------------------------- exact losslessness with concurrent requests


def _joints(target, prompts, policy, drafter, curve, n, k, seed=1, **kw):
    """Empirical joint [V ** k] of each request's first k tokens over n runs of the serving loop."""
    g = torch.Generator().manual_seed(seed)
    counts = [torch.zeros(VOCAB ** k, dtype=torch.float64) for _ in prompts]
    reqs = S.closed_loop(prompts, k)
    verified = drafted = 0
    for _ in range(n):
        out = S.serve(target, reqs, policy=policy, drafter=drafter, concurrency=len(prompts), curve=curve,
                      sampling=SamplingConfig(1.0), generator=g, eos_token_id=-1, **kw)
        for c, r in zip(counts, out.requests):
            c[sum(t * VOCAB ** (k - 1 - i) for i, t in enumerate(r.tokens))] += 1
        verified += sum(s.verified for s in out.steps)
        drafted += sum(s.drafted for s in out.steps)
    return [c / n for c in counts], verified / max(drafted, 1)


def _ratios(target, prompts, emp, n, k, seed=1):
    out = []
    for p, e in zip(prompts, emp):
        exact = exact_joint(logit_table(target, p, k - 1), SamplingConfig(1.0), k)
        floors = noise_floor(exact, n, torch.Generator().manual_seed(seed + 1))
        out.append(tv(e, exact) / float(floors.mean() + 4 * floors.std()))
    return out


@pytest.mark.parametrize("policy", ["alg1", "vllm"])
def test_scheduled_serving_is_lossless(target, policy):
    """Two requests in one batch at T = 1, their blocks cut by the policy (which verifies a varying number of
    tokens, decided by survivals that depend on the drafted tokens): each request's first 3 tokens follow the
    target's exact joint."""
    prompts = [[0, 2, 2], [0, 3, 2, 1]]
    curve = S.StepCurve({2: 1.0, 3: 1.25, 4: 1.45, 5: 1.6, 6: 1.75})
    emp, verified = _joints(target, prompts, policy, Confident(_draft(9), first=0.7), curve, n=1500, k=3)
    ratios = _ratios(target, prompts, emp, 1500, 3)
    print(policy, ratios, verified)
    assert 0.1 < verified < 0.95  # the share of drafted tokens verified: the policy cut blocks, not all of them
    assert max(ratios) < 1, f"{policy}: TV / bound per request {ratios}"


def _sampled_q_survivals():
    """BROKEN on purpose: EAGLE chains whose survivals multiply the q of the token actually drawn (the tree code's
    path confidence at T > 0), so Algorithm 1's decision to verify x_j reads x_j itself."""
    from specbook.drafters.eagle import EagleDrafter

    class SampledQ(EagleDrafter):
        @staticmethod
        def propose_batch(drafters, states):
            out = EagleDrafter.propose_batch(drafters, states)
            return [DraftTree(t.tokens, t.parents, t.q, (t.q[torch.arange(len(t)), t.tokens] * d.calibration)
                              .cumprod(0).clamp(max=1.0), children=t.children) for d, t in zip(drafters, out)]

    return SampledQ


def test_eagle_chain_scheduled_serving_is_lossless(target):
    """Two requests at T = 1, EAGLE chains sampled without replacement (one child per node: a draw from q), cut by
    Algorithm 1 from the chains' calibrated confidences (which depend on the tokens drafted before each position):
    each request's first 3 tokens follow the target's exact joint. The same chains scored by the drawn token's own
    q fail the same check clearly (more runs shrink the noise floor below the bias)."""
    prompts = [[0, 2, 2], [0, 3, 2, 1]]
    curve = S.StepCurve({2: 1.0, 3: 1.3, 4: 1.55, 5: 1.7, 6: 1.8})
    drafter = _eagle_chain(target, depth=2, calibration=1.0, children="noreplace")
    emp, verified = _joints(target, prompts, "alg1", drafter, curve, n=1500, k=3)
    ratios = _ratios(target, prompts, emp, 1500, 3)
    broken = _sampled_q_survivals()(target, drafter.head, choices=drafter.nodes, calibration=1.0, children="noreplace")
    emp, _ = _joints(target, prompts, "alg1", broken, curve, n=5000, k=3)
    bad = _ratios(target, prompts, emp, 5000, 3)
    print(ratios, verified, bad)
    assert 0.2 < verified < 0.9  # Algorithm 1 cut the chains: some drafted tokens were verified, not all
    assert max(ratios) < 1, f"TV / bound per request {ratios}"
    assert max(bad) >= 1.5, f"survivals read from the drawn token should fail the check: {bad}"


def test_no_early_stop_scheduler_fails_the_check(target):
    """DSpark Appendix A through the loop: the full search (no early stop) verifies x_1 only when its continuation
    looks confident, i.e. depending on x_1 itself; the output leaves the target's distribution by >= 3x the bound.
    One request (the paper's setting): a_1 alone does not pay (Theta_1 < Theta_0), a_1 + a_2 does when x_1 is
    favoured."""
    prompts = [[0, 2, 2]]
    curve = S.StepCurve({1: 1.0, 2: 1.7, 3: 1.75})
    drafter = Confident(_draft(9), favoured=(2,), first=0.6)
    emp, _ = _joints(target, prompts, "search", drafter, curve, n=3000, k=2, allow_lossy=True)
    bad = _ratios(target, prompts, emp, 3000, 2)
    emp, verified = _joints(target, prompts, "alg1", drafter, curve, n=1000, k=2)
    good = _ratios(target, prompts, emp, 1000, 2)
    print("search", bad, "alg1", good, verified)
    assert bad[0] >= 3, f"the no-early-stop scheduler should fail clearly: {bad}"
    assert good[0] < 1 and verified == 0  # the early stop never admits x_1 here (Theta_1 < Theta_0)


@pytest.mark.parametrize("threshold", [None, 0.45])
def test_block_drafter_batched_proposals_match_one_at_a_time(target, threshold):
    """propose_batch (ONE block forward over requests with different context lengths, padding masked; the tokens
    drawn for all rows together, position by position) drafts what propose drafts for each request alone: the same
    greedy tokens, the same q and survivals up to rounding — also when a survival threshold cuts rows at different
    positions."""
    import copy

    from specbook.decoding import SpecState

    torch.manual_seed(0)
    net = BlockNet(target.config, torch.tensor([0, 2, 3]), gamma=3, layers=2, taps=(1,), markov_rank=4,
                   confidence=True).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    proto = BlockDrafter(target, net, threshold=threshold)
    states = []
    for prompt in PROMPTS[:3]:
        with torch.no_grad():
            out = target(torch.tensor([prompt]), output_hidden_states=True)
        states.append(SpecState(tokens=prompt + [2], prompt_len=len(prompt), sampling=SamplingConfig(), generator=None,
                                target=target, target_hidden=out.hidden_states[1][0]))
    alone, together = [copy.copy(proto) for _ in states], [copy.copy(proto) for _ in states]
    for a, b, s in zip(alone, together, states):
        a.begin(s)
        b.begin(s)
    one = [d.propose(s) for d, s in zip(alone, states)]
    many = BlockDrafter.propose_batch(together, states)
    for x, y in zip(one, many):
        assert x.tokens.tolist() == y.tokens.tolist()
        torch.testing.assert_close(x.q, y.q, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(x.confidence, y.confidence, atol=1e-5, rtol=1e-4)
    assert all(d.forwards == 1 for d in together)
    for a, b in zip(alone, together):  # the survivals of the proposed positions and of the first one cut
        assert a.survival[0] == pytest.approx(b.survival[0], abs=1e-5)
    if threshold is not None:  # the cut really differs between rows here, so the batch handled ragged stops
        assert len({len(x.tokens) for x in one}) > 1, [len(x.tokens) for x in one]


def test_block_drafter_batched_sampling_draws_one_uniform_per_live_row(target):
    """At T = 1 a batch of one draws exactly what propose draws alone from the same seed (one uniform per position),
    and a batch of three consumes one uniform per row and position: the generator ends where 3 x gamma draws leave
    it."""
    import copy

    from specbook.decoding import SpecState

    torch.manual_seed(0)
    net = BlockNet(target.config, torch.tensor([0, 2, 3]), gamma=3, layers=1, taps=(1,), markov_rank=4,
                   confidence=True).eval()
    proto = BlockDrafter(target, net)
    with torch.no_grad():
        out = target(torch.tensor([PROMPTS[0]]), output_hidden_states=True)

    def fresh(g):
        s = SpecState(tokens=PROMPTS[0] + [2], prompt_len=len(PROMPTS[0]), sampling=SamplingConfig(temperature=1.0),
                      generator=g, target=target, target_hidden=out.hidden_states[1][0])
        d = copy.copy(proto)
        d.begin(s)
        return d, s

    d1, s1 = fresh(torch.Generator().manual_seed(5))
    d2, s2 = fresh(torch.Generator().manual_seed(5))
    torch.testing.assert_close(d1.propose(s1).q, BlockDrafter.propose_batch([d2], [s2])[0].q)
    g = torch.Generator().manual_seed(5)
    rows = [fresh(g) for _ in range(3)]
    BlockDrafter.propose_batch([d for d, _ in rows], [s for _, s in rows])
    ref = torch.Generator().manual_seed(5)
    torch.rand(3 * 3, generator=ref)
    assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=ref))


def test_simulate_cli_on_the_committed_sweep(tmp_path, capsys):
    """`python -m specbook.serving simulate` on the committed sweep: a table, and a JSON labelled as a simulation
    whose concurrency-1 rows come within the validation's reach of the real runs."""
    import json

    from specbook.report import ROOT

    src = ROOT / "docs" / "bench" / "cpu_serving_t0.json"
    out = tmp_path / "sim.json"
    S.main(["simulate", str(src), "--concurrency", "1", "64", "--out", str(out)])
    assert "| concurrency | policy | throughput" in capsys.readouterr().out
    sim = json.loads(out.read_text())
    sweep = json.loads(src.read_text())
    assert sim["note"].startswith("SIMULATED") and len(sim["rows"]) == 2 * len(sweep["settings"]["policies"])
    assert all(r["simulated"] and r["throughput"] > 0 for r in sim["rows"])
    assert len(sim["validation"]) == len(sweep["rows"])


def test_sim_costs_recover_the_costs_a_simulation_ran_with():
    """A sweep made by the simulator itself (known costs, a linear step curve so that steps x seconds(mean B) is exact):
    ``sim_costs`` fits every cost back, and the held-out validation (each concurrency simulated with costs fitted to
    the others) reproduces every run."""
    g = torch.Generator().manual_seed(0)
    traces = []
    for _ in range(6):
        recs = []
        for _ in range(12):
            c = torch.rand(5, generator=g).clamp(0.05, 0.95)
            match = int((torch.rand(5, generator=g) < c).int().cumprod(0).sum())
            recs.append({"survival": c.cumprod(0).tolist(), "match": match})
        traces.append(recs)
    curve = S.StepCurve({1: 0.010, 256: 0.010 + 255 * 0.0004})  # seconds(B) = 0.0096 + 0.0004 B
    true = S.SimCosts(curve, draft_s=0.002, prefill_s=0.05, request_s=0.001, draft_step_s=0.004, token_s=0.00005,
                      prefill_running_s=0.003)
    rows = [S.simulate(traces, p, c, true, requests=max(2 * c, 6), max_new_tokens=24)
            for c in (1, 2, 4, 8) for p in ("none", "fixed:1", "fixed:3", "alg1")]
    sweep = {"settings": {"max_new_tokens": 24}, "curve": curve.to_json(), "rows": rows, "traces": traces}
    got = S.sim_costs(sweep)
    for k in ("draft_s", "prefill_s", "request_s", "draft_step_s", "token_s", "prefill_running_s"):
        assert getattr(got, k) == pytest.approx(getattr(true, k), rel=1e-6, abs=1e-9), k
    assert max(abs(v["error"]) for v in S.validate(sweep)) < 1e-6
    bad = S.SimCosts(curve, draft_s=0.02, prefill_s=0.05)  # the check is not vacuous: other costs give other runs
    ref = next(r for r in rows if (r["concurrency"], r["policy"]) == (4, "fixed:3"))
    assert abs(S.simulate(traces, "fixed:3", 4, bad, requests=8, max_new_tokens=24)["throughput"] /
               ref["throughput"] - 1) > 0.1


def test_sweep_forwards_and_the_simulators_rows(target):
    """The sweep's forward modes: each mode's target (an unknown one refused by name), and the simulator modelling
    only the first mode's rows of a side-by-side sweep (a sweep without modes: every row)."""
    from specbook.fastpath import FastTarget

    assert S.forward_target(target, "hf") is target
    assert isinstance(S.forward_target(target, "static"), FastTarget) and not S.forward_target(target, "static").compiled
    with pytest.raises(ValueError, match="forward must be one of"):
        S.forward_target(target, "cuda-graphs")
    rows = [{"policy": "none", "forward": "compiled"}, {"policy": "none", "forward": "hf"}]
    assert S.sim_rows({"settings": {"forwards": ["hf", "compiled"]}, "rows": rows}) == [rows[1]]
    old = [{"policy": "none"}, {"policy": "alg1"}]
    assert S.sim_rows({"settings": {}, "rows": old}) == old


def test_results_page_says_where_algorithm_1_sits():
    """The results page's serving summary by hand: Algorithm 1 over no speculation and the longest fixed k at the
    highest concurrency, over the best fixed k at the lowest, and where each fixed k falls below no speculation."""
    from specbook.report import _policy_ratios

    thr = {(1, "none"): 10, (1, "fixed:1"): 12, (1, "fixed:3"): 15, (1, "alg1"): 14,
           (4, "none"): 20, (4, "fixed:1"): 22, (4, "fixed:3"): 18, (4, "alg1"): 26}
    rows = [{"concurrency": c, "policy": p, "forward": "hf", "throughput": t} for (c, p), t in thr.items()]
    rows.append({"concurrency": 4, "policy": "none", "forward": "compiled", "throughput": 99.0})  # not the first mode
    rows = S.sim_rows({"settings": {"forwards": ["hf", "compiled"]}, "rows": rows})
    assert _policy_ratios(rows) == ("Algorithm 1 at c = 4: 1.30x no speculation, 1.44x fixed:3; at c = 1: 0.93x the "
                                    "best fixed k (fixed:3). Fixed k below no speculation: fixed:1 at no level; "
                                    "fixed:3 at c = 4.\n\n")
    assert _policy_ratios([r for r in rows if r["policy"] != "alg1"]) == ""


def test_an_oracle_with_perfect_drafts_on_a_flat_curve_emits_gamma_plus_one_per_step():
    """``ceiling``'s oracle by hand: every token accepted (alpha = 1), a flat step curve, no other cost -> each step
    emits gamma + 1 tokens per request for the price of one plain step, so throughput is exactly (gamma + 1) x no
    speculation; with alpha = 0 it drafts nothing (B = R) and equals no speculation."""
    gamma, mx = 5, 1 + 6 * 4  # the prefill's token, then four full steps of six
    flat = S.SimCosts(S.StepCurve({1: 0.01, 256: 0.01}), draft_s=0.0, prefill_s=0.0)
    base = S.simulate(S.geometric_traces(0.5, gamma), "none", 4, flat, max_new_tokens=mx)["throughput"]
    perfect = S.simulate(S.geometric_traces(1.0, gamma), "search", 4, flat, max_new_tokens=mx)
    assert perfect["throughput"] / base == pytest.approx(gamma + 1)
    assert perfect["verified_per_step"] == perfect["accepted_per_step"] == 4 * gamma
    blind = S.simulate(S.geometric_traces(0.0, gamma), "search", 4, flat, max_new_tokens=mx)
    assert blind["throughput"] == pytest.approx(base) and blind["batch_tokens_mean"] == 4


def test_oracle_and_geometric_traces():
    """An oracle trace is the recorded one with survivals 1 up to its match and 0 after (records without a known match
    dropped with their trace); geometric traces are seeded and accept alpha (1 - alpha^gamma) / (1 - alpha) tokens
    per step on average; a bad alpha or gamma is refused."""
    rec = [[{"survival": [0.9, 0.5, 0.2], "match": 2}, {"survival": [0.4, 0.1, 0.05], "match": 0}],
           [{"survival": [0.9, 0.8, 0.7], "match": None}]]
    assert S.oracle_traces(rec) == [[{"survival": [1.0, 1.0, 0.0], "match": 2},
                                     {"survival": [0.0, 0.0, 0.0], "match": 0}]]
    a, g = 0.7, 5
    t = S.geometric_traces(a, g, requests=40, steps=100, seed=3)
    assert t == S.geometric_traces(a, g, requests=40, steps=100, seed=3) != S.geometric_traces(a, g, 40, 100, seed=4)
    mean = sum(r["match"] for x in t for r in x) / 4000
    assert mean == pytest.approx(a * (1 - a ** g) / (1 - a), rel=0.05)
    assert all(r["survival"] == [1.0] * r["match"] + [0.0] * (g - r["match"]) for x in t for r in x)
    for bad in ((1.5, 5), (0.5, 0)):
        with pytest.raises(ValueError, match="alpha"):
            S.geometric_traces(*bad)


def test_equivalent_alpha_inverts_the_iid_model():
    """The alpha whose i.i.d. mean accepted length matches the traces' (gamma 5: alpha = 0.5 accepts 0.96875 tokens a
    block); geometric traces of a known alpha read back close to it; no known match is refused."""
    one = [[{"survival": [1.0] * 5, "match": 1}, {"survival": [1.0] * 5, "match": 0.9375}]]
    assert S.equivalent_alpha(one, 5) == pytest.approx(0.5, abs=1e-9)
    assert S.equivalent_alpha(S.geometric_traces(0.8, 5, requests=50, steps=100), 5) == pytest.approx(0.8, abs=0.02)
    with pytest.raises(ValueError, match="known match"):
        S.equivalent_alpha([[{"survival": [0.5], "match": None}]], 1)


def test_simulate_replays_every_trace_by_default():
    """At concurrency 1 the default number of requests still covers every trace: a low concurrency does not
    replay only the first two (which may be unusually easy)."""
    easy = [[{"survival": [1.0] * 3, "match": 3}]] * 2
    hard = [[{"survival": [0.0] * 3, "match": 0}]] * 6
    costs = S.SimCosts(S.StepCurve({1: 0.01, 256: 0.01}), draft_s=0.0, prefill_s=0.0)
    run = S.simulate(easy + hard, "fixed:3", 1, costs, max_new_tokens=9)
    assert run["requests"] == 8 and run["accepted_per_step"] < 3


def test_committed_ceilings_are_what_the_command_computes(tmp_path, capsys):
    """Each committed ceiling JSON is rebuilt from its sweep by the command it records: no figure typed in; and at the
    sweep's own output length no scheduler reaches 1.3x no speculation at c = 16 with the recorded drafts, even an
    oracle drafting for free (what the serving issue's note reads)."""
    import json
    import os

    from specbook.report import ROOT

    found = sorted((ROOT / "docs" / "bench").glob("*ceiling*.json"))
    assert found
    for f in found:
        d = json.loads(f.read_text())
        args = d["settings"]["command"].split()[3:]
        assert args[:2] == ["ceiling", d["source"]] and "--out" in args
        args[args.index("--out") + 1] = str(tmp_path / f.name)
        here = os.getcwd()
        os.chdir(ROOT)
        try:
            S.main(args)
        finally:
            os.chdir(here)
        assert "throughput over no speculation (simulated)" in capsys.readouterr().out
        got = json.loads((tmp_path / f.name).read_text())["rows"]
        assert [r["over_none"] for r in got] == pytest.approx([r["over_none"] for r in d["rows"]], rel=1e-9)
        assert [{k: v for k, v in r.items() if k != "over_none"} for r in got] == \
            [{k: v for k, v in r.items() if k != "over_none"} for r in d["rows"]]
        c16 = [r for r in d["rows"] if r["concurrency"] == 16 and r["drafts"] == "recorded"
               and r["max_new_tokens"] == d["settings"]["sweep_max_new_tokens"]]
        assert len(c16) == 3 and all(r["over_none"] < 1.3 for r in c16)
