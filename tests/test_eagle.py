"""EAGLE / EAGLE-2: dynamic tree builder, losslessness, greedy parity, draft-cache consistency, checkpoints."""
import argparse
import math

import pytest
import torch

from specbook.decoding import generate, speculative_generate
from specbook.drafters.eagle import (
    Eagle2Drafter,
    EagleDrafter,
    EagleHead,
    EagleObjective,
    confidence_calibration,
    grow_dynamic,
    load_eagle,
    select_nodes,
    static_tree,
    worth_expanding,
)
from specbook.models import tiny_llama
from specbook.roofline import auto_size
from specbook.sampling import SamplingConfig, make_generator
from specbook.tree import depths

# --------------------------------------------------------------------------- the dynamic tree, by hand

# child distributions of a node, by the node's token (4-token vocabulary)
CHILD = {0: [.05, .7, .16, .09], 1: [.5, .3, .1, .1]}


def test_grow_dynamic_hand_computed():
    """depth 3, top_k 2. Pool (token, score): A=0 .6, B=1 .3 | A1=1 .42, A2=2 .096, B0=0 .15, B1=1 .09
    -> frontier A1, B0 | A1: 0 .21, 1 .126; B0: 1 .105, 2 .024. Top 5 = A, A1, B, A1-0, B0."""
    seen = []

    def expand(pool, frontier):
        seen.append([pool.tok[j] for j in frontier])
        return torch.log(torch.tensor([CHILD[pool.tok[j]] for j in frontier]))

    pool = grow_dynamic(torch.log(torch.tensor([.6, .3, .06, .04])), expand, depth=3, top_k=2)
    assert seen == [[0, 1], [1, 0]]  # depth 1 expands A, B; depth 2 expands A1, B0 (not A2 .096 or B1 .09)
    assert pool.tok == [0, 1, 1, 2, 0, 1, 0, 1, 1, 2]
    assert pool.par == [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]
    want = [.6, .3, .42, .096, .15, .09, .21, .126, .105, .024]
    assert [math.exp(s) for s in pool.score] == pytest.approx(want)
    tree = pool.tree(5)  # A, B, A1, B0, A1-0 (by depth)
    assert tree.tokens.tolist() == [0, 1, 1, 0, 0]
    assert tree.parents.tolist() == [-1, -1, 0, 1, 2]
    assert tree.confidence.tolist() == pytest.approx([.6, .3, .42, .15, .21])
    assert len(pool.tree(100)) == 10


def test_select_nodes_keeps_ancestors_on_ties():
    assert select_nodes([0.0, 0.0, 0.0], [-1, 0, 1], 2) == [0, 1]
    assert select_nodes([-0.1, -0.2, -0.2, -0.3], [-1, 0, -1, 1], 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="total_tokens"):
        select_nodes([0.0], [-1], 0)


def test_auto_size_uses_the_latency_curve():
    lat = {1: 1.0, 2: 1.0, 4: 1.1, 8: 2.0}
    # (1 + .9) / 1.0 = 1.9; (1 + 1.7) / lat(3) = 2.7 / 1.05 = 2.57; 2.8 / 1.1 = 2.55; 2.85 / 1.325 = 2.15
    assert auto_size([.9, .8, .1, .05], lat, 64) == 2
    assert auto_size([.9, .8, .1, .05], {1: 1.0, 64: 1.0}, 64) == 4  # free verification: keep everything
    assert auto_size([.9, .8, .1, .05], lat, 1) == 1


def test_auto_size_counts_the_drafting_time():
    lat = {1: 1.0, 2: 1.0, 4: 1.1, 8: 2.0}
    # overhead 1.0: 1.9 / 2.0 = .95; 2.7 / 2.05 = 1.317; 2.8 / 2.1 = 1.333; 2.85 / 2.325 = 1.226 -> 3 nodes
    assert auto_size([.9, .8, .1, .05], lat, 64, overhead=1.0) == 3
    assert auto_size([.9, .8, .1, .05], lat, 64, overhead=0.0) == 2


def test_nodes_to_add_grows_a_held_tree_by_hand():
    from specbook.roofline import nodes_to_add

    lat = {1: 1.0, 2: 1.0, 4: 1.1, 8: 2.0}
    # held .9 (rate 1.9 / lat(2) = 1.9); + .8: 2.7 / lat(3) 1.05 = 2.57; + .1: 2.8 / 1.1 = 2.55 -> add 1
    assert nodes_to_add([.9], [.8, .1, .05], lat, 64) == 1
    # the same values as auto_size's example, grown from nothing: the same answer
    assert nodes_to_add([], [.9, .8, .1, .05], lat, 64) == auto_size([.9, .8, .1, .05], lat, 64) == 2
    assert nodes_to_add([.9, .8], [.1, .05], lat, 64) == 0  # what was drawn stays; nothing more pays
    assert nodes_to_add([.9], [.8, .7], {1: 1.0, 64: 1.0}, 2) == 1  # never above max_nodes
    assert nodes_to_add([.5], [], lat, 64) == 0


def test_sampled_growth_draws_what_the_budget_allows_and_budgets_before_drawing():
    """grow_sampled with a budget: each depth draws the budget's count of its best candidates, and the budget sees
    only pre-draw keys (the held nodes' admission keys and this depth's candidate keys, descending)."""
    import math

    from specbook.drafters.eagle.dynamic import grow_sampled

    V, seen = 6, []
    q_row = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0])

    def q_of(f):
        return q_row.expand(f.shape[0], V)

    def draw(q, counts):  # the least likely tokens each time: what was drawn must not move the scores
        out = []
        for row, n in zip(q, counts):
            ids = [i for i in row.argsort().tolist() if row[i] > 0][:n]
            out.append((ids, [math.log(row[i]) for i in ids], row.expand(n, V)))
        return out

    def budget(keys, cand):
        seen.append((list(keys), list(cand)))
        return [2, 1, 0][len(seen) - 1]

    pool = grow_sampled(torch.zeros(4), lambda pool, fr: torch.zeros(len(fr), 4), depth=4, width=3, q_of=q_of,
                        draw=draw, budget=budget)
    assert pool.dep == [0, 0, 1]  # 2 root children, 1 grandchild, then the budget stopped the growth
    lq = q_row[:3].log().tolist()
    assert seen[0] == ([], lq)  # the root's candidates: log q of ranks 0..2
    assert seen[1][0] == lq[:2] and seen[1][1] == sorted(seen[1][1], reverse=True) and len(seen[1][1]) == 3
    assert len(seen[2][0]) == 3 and seen[2][0][2] == seen[1][1][0]  # the grandchild holds the key it was admitted with
    # scores are those keys summed along the path, whatever token each draw turned out to be
    assert pool.score[:2] == pytest.approx(lq[:2]) and pool.score[2] == pytest.approx(seen[1][1][0])
    # the root always draws at least one
    seen.clear()
    one = grow_sampled(torch.zeros(4), lambda pool, fr: torch.zeros(len(fr), 4), depth=2, width=3, q_of=q_of,
                       draw=draw, budget=lambda keys, cand: 0)
    assert one.dep == [0]


def test_worth_expanding_by_hand():
    lat = {1: 1.0, 64: 1.0}  # flat: verification cost does not grow with the tree
    # in hand: nodes .5, .2 -> rate (1 + .7) / (overhead 1 + 1) = .85
    # expanding (cost .5) with frontier mass m: at most (1.7 + m) / 2.5 -> pays iff m > .425
    assert worth_expanding([.5, .2], 0.5, lat, 64, overhead=1.0, draft_cost=0.5)
    assert not worth_expanding([.5, .2], 0.4, lat, 64, overhead=1.0, draft_cost=0.5)
    assert worth_expanding([.5, .2], 0.01, lat, 64, overhead=1.0, draft_cost=0.0)  # free drafting always pays


def test_static_tree_from_rank_accuracy():
    card = {"heldout": {"acc_r0": 0.6, "acc_r1": 0.2}, "config": {}}
    # per depth the same rank accuracies: (0)=.6 (0,0)=.36 (1)=.2 (0,0,0)=.216 ...
    assert static_tree(card, 4, depth=3) == [(0,), (0, 0), (0, 0, 0), (1,)]
    # sampling: the soft accuracies E[p(c-th guess)] decide; a card without them falls back to acc_r
    assert static_tree(card, 4, depth=3, temperature=1.0) == static_tree(card, 4, depth=3)
    card["heldout"].update({"soft_r0": 0.3, "soft_r1": 0.25})  # (0)=.3 (1)=.25 (0,0)=.09 (0,1)=.075
    assert static_tree(card, 4, depth=3, temperature=1.0) == [(0,), (1,), (0, 0), (0, 1)]
    assert static_tree(card, 4, depth=3, temperature=0.0) == [(0,), (0, 0), (0, 0, 0), (1,)]


# --------------------------------------------------------------------------- the drafter on a tiny model

VOCAB, PROMPT = 12, [0, 3, 7]


@pytest.fixture(scope="module")
def tiny_pair():
    tgt = tiny_llama(vocab_size=VOCAB, hidden_size=32, seed=3)
    torch.manual_seed(0)
    head = EagleHead(tgt.config).eval()
    return tgt, head


def _drafters(tgt, head):
    return {"dynamic": Eagle2Drafter(tgt, head, depth=3, top_k=2, total_tokens=5),
            "static": EagleDrafter(tgt, head, choices=[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
            "auto": Eagle2Drafter(tgt, head, depth=3, top_k=3, total_tokens="auto", latency={1: 1.0, 4: 1.2, 16: 2.0}),
            # with a draft cost: the drafting time joins the cost model and the expansion may stop early
            "auto_cost": Eagle2Drafter(tgt, head, depth=4, top_k=3, total_tokens="auto", latency={1: 1.0, 4: 1.2, 16: 2.0},
                                      draft_cost=0.1)}


@pytest.mark.parametrize("kind", ["dynamic", "static", "auto", "auto_cost"])
def test_eagle_greedy_equals_ar_on_tiny_model(tiny_pair, kind):
    tgt, head = tiny_pair
    drafter = _drafters(tgt, head)[kind]
    for seed in range(3):
        ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed))
        ar = generate(tgt, ids, max_new_tokens=20, eos_token_id=-1).tokens[0]
        sp = speculative_generate(tgt, drafter, ids, max_new_tokens=20, eos_token_id=-1)
        assert sp.tokens[0] == ar


class _CheckedDrafter(Eagle2Drafter):
    """After every catch-up, the draft cache must equal a from-scratch recomputation over the committed
    tokens with the target's features."""

    checks = 0

    def _catch_up(self, state):
        out = super()._catch_up(state)
        n = self.n_cached
        toks = torch.tensor([state.tokens[: n + 1]])
        with torch.no_grad():
            feats = state.target(toks[:, :n], output_hidden_states=True).hidden_states[-1]  # f_0..f_{n-1}
            from transformers import DynamicCache

            ref = DynamicCache(config=self.head.model.config)
            f = self.head(self.E(toks[:, 1:]), feats, position_ids=torch.arange(n)[None], cache=ref)
        k_ours, k_ref = self.cache.layers[0].keys, ref.layers[0].keys
        assert k_ours.shape == k_ref.shape, (k_ours.shape, k_ref.shape)
        torch.testing.assert_close(k_ours, k_ref, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(self.cache.layers[0].values, ref.layers[0].values, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(out, f[0, -1], atol=1e-5, rtol=1e-4)
        type(self).checks += 1
        return out


def _head_calls(head, dtype):
    """Drafting-shaped calls with a cache: a causal catch-up of 5 positions, a 3-node tree block (node 2 a child
    of node 0) with its 4D mask, one more token. -> outputs and the cache's keys / values."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    H = head.hidden
    x = lambda n: torch.randn(1, n, H, generator=g).to(dtype)  # noqa: E731
    cache = DynamicCache(config=head.model.config)
    outs = [head(x(5), x(5), position_ids=torch.arange(5)[None], cache=cache)]
    allowed = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
    outs.append(head(x(3), x(3), position_ids=torch.tensor([[5, 5, 6]]), attention_mask=mask, cache=cache))
    outs.append(head(x(1), x(1), position_ids=torch.tensor([[8]]), cache=cache))
    layer = cache.layers[0]
    return outs, (layer.keys, layer.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_fast_path_equals_the_transformers_layer(tiny_pair, dtype):
    """Drafting skips transformers' model wrapper (EagleHead._cached_llama); outputs and cache equal the
    wrapper's bit for bit — same modules, same operations, same order."""
    import copy

    _, head = tiny_pair
    h = copy.deepcopy(head).to(dtype)
    assert h.fast_path
    with torch.inference_mode():
        fast, fast_kv = _head_calls(h, dtype)
        h.fast_path = False
        ref, ref_kv = _head_calls(h, dtype)
    for a, b in zip(fast + list(fast_kv), ref + list(ref_kv)):
        assert a.shape == b.shape and torch.equal(a, b), (a - b).abs().max()


def test_draft_cache_equals_recomputation(tiny_pair):
    tgt, head = tiny_pair
    drafter = _CheckedDrafter(tgt, head, depth=3, top_k=2, total_tokens=6)
    ids = torch.tensor([[1, 4, 2, 9]])
    speculative_generate(tgt, drafter, ids, max_new_tokens=24, eos_token_id=-1)
    speculative_generate(tgt, drafter, ids, max_new_tokens=16, sampling=SamplingConfig(1.0),
                         generator=make_generator(2), eos_token_id=-1)
    assert _CheckedDrafter.checks >= 8


def test_tree_drafting_matches_chain_recomputation(tiny_pair):
    """Each node's confidence from the tree-attention draft forwards equals the product of q along its path
    recomputed as a plain causal chain (checks the draft's tree mask, positions and feature wiring)."""
    from transformers import DynamicCache

    from specbook.decoding import SpecState

    tgt, head = tiny_pair
    ids = [1, 4, 2, 9, 3]
    with torch.no_grad():
        out = tgt(torch.tensor([ids]), output_hidden_states=True)
    first = int(out.logits[0, -1].argmax())
    tokens = ids + [first]
    state = SpecState(tokens=list(tokens), prompt_len=len(ids), sampling=SamplingConfig(), generator=None, target=tgt,
                      target_hidden=out.hidden_states[-1][0])
    for drafter in (Eagle2Drafter(tgt, head, depth=4, top_k=3, total_tokens=20),
                    EagleDrafter(tgt, head, choices=[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)])):
        drafter.begin(state)
        tree = drafter.propose(state)
        n = len(tokens) - 1
        W = tgt.get_output_embeddings().weight
        for i in range(len(tree)):
            path, a = [], i
            while a >= 0:
                path.append(int(tree.tokens[a]))
                a = int(tree.parents[a])
            path = path[::-1]
            with torch.no_grad():
                ref = DynamicCache(config=head.model.config)
                f = head(tgt.get_input_embeddings()(torch.tensor([tokens[1:]])), state.target_hidden[None],
                         position_ids=torch.arange(n)[None], cache=ref)[0, -1]
                logq = 0.0
                for d, x in enumerate(path):
                    logq += float(torch.log_softmax(f @ W.T, -1)[x])
                    f = head(tgt.get_input_embeddings()(torch.tensor([[x]])), f[None, None],
                             position_ids=torch.tensor([[n + d]]), cache=ref)[0, -1]
            assert float(tree.confidence[i]) == pytest.approx(math.exp(logq), rel=1e-4, abs=1e-7), (i, path)
        assert len(drafter.cache.layers[0].keys[0, 0]) == n  # the tree was cropped away again


def test_teacher_forced_top1_at_step_starts_is_the_loops_first_token_acceptance(tiny_pair):
    """Greedy, fp32: the first draft token of a step reads exactly the true features, so the teacher-forced
    hits at the positions where steps started must reproduce the loop's depth-0 acceptance count."""
    from specbook.drafters.eagle import teacher_forced_top1
    from specbook.tree import chain_choices

    tgt, head = tiny_pair
    torch.manual_seed(5)
    trained_ish = EagleHead(tgt.config).eval()  # any head works; a second one makes the check less special
    for h in (head, trained_ish):
        drafter = EagleDrafter(tgt, h, choices=chain_choices(3))
        starts, propose = [], drafter.propose
        drafter.propose = lambda state: (starts.append(len(state.tokens)), propose(state))[1]
        ids = torch.tensor([[1, 4, 2, 9]])
        r = speculative_generate(tgt, drafter, ids, max_new_tokens=30, eos_token_id=-1)
        seq = ids[0].tolist() + r.tokens[0]
        hit = teacher_forced_top1(tgt, h, None, seq)
        assert int(hit[starts].sum()) == r.stats.pos_accepted.get(0, 0)
        assert len(starts) == r.stats.pos_tested[0]


def test_path_outcomes_follow_the_loops_trace(tiny_pair):
    """Every drafted node appears once with its path confidence; kept = on the accepted path, so (greedy) a kept
    node's parent is kept, the kept count is the loop's accepted tokens, and a child is never more confident
    than its parent (confidences are products along the path)."""
    from specbook.calibration import reliability
    from specbook.drafters.eagle import path_outcomes

    tgt, head = tiny_pair
    trace: list = []
    r = speculative_generate(tgt, _drafters(tgt, head)["dynamic"], torch.tensor([[1, 4, 2, 9]]), max_new_tokens=24,
                             eos_token_id=-1, trace=trace)
    conf, kept = path_outcomes(trace)
    assert len(conf) == len(kept) == sum(len(s["draft"]) for s in trace)
    assert int(kept.sum()) == sum(len(s["path"]) for s in trace) == sum(r.stats.pos_accepted.values())
    i = 0
    for s in trace:
        c, k = conf[i:i + len(s["draft"])], kept[i:i + len(s["draft"])]
        for j, par in enumerate(s["parents"]):
            if par >= 0:
                assert c[j] <= c[par] + 1e-6
                assert not (k[j] and not k[par])
        i += len(s["draft"])
    assert sum(b["count"] for b in reliability(conf, kept)) == len(conf)
    trace[1]["confidence"] = None
    with pytest.raises(ValueError, match="step 1 carries no confidences"):
        path_outcomes(trace)


def test_costly_drafting_stops_the_expansion_early(tiny_pair):
    """With a draft forward as dear as a whole target step, a second depth cannot pay: the tree stays one deep.
    With free drafting the same drafter grows all its depths (on this head, whose confidences are not tiny)."""
    tgt, head = tiny_pair
    ids = torch.tensor([[1, 4, 2, 9]])
    lat = {1: 1.0, 64: 1.0}
    depth_of = {}
    for cost in (10.0, 0.0):
        drafter = Eagle2Drafter(tgt, head, depth=4, top_k=2, total_tokens="auto", latency=lat, draft_cost=cost)
        seen = []
        propose = drafter.propose

        def spy(state, propose=propose, seen=seen):
            tree = propose(state)
            seen.append(int(depths(tree.parents).max()) + 1)  # tree.depths: children of the root have depth 0
            return tree

        drafter.propose = spy
        speculative_generate(tgt, drafter, ids, max_new_tokens=12, eos_token_id=-1)
        depth_of[cost] = max(seen)
    assert depth_of[10.0] == 1
    assert depth_of[0.0] == 4


def test_confidence_calibration_from_the_card():
    card = {"heldout": {"top1": 0.6, "conf_r0": 0.4, "soft_r0": 0.3}}
    assert confidence_calibration(card) == pytest.approx(1.5)  # greedy: top-1 hit rate / top-1 confidence
    assert confidence_calibration(card, temperature=1.0) == pytest.approx(0.75)  # sampling: E[p(guess)] / confidence
    assert confidence_calibration({"heldout": {"top1": 0.6}}) == 1.0  # an older card: the paper's conf = acceptance


def test_calibration_moves_the_auto_tree_size(tiny_pair):
    """The auto size reads calibration x confidence: valued higher, nodes pay for more verification (and
    valued lower, fewer) on the same head, prompt and latency curve; the output stays the target's greedy."""
    tgt, head = tiny_pair
    ids = torch.tensor([[1, 4, 2, 9]])
    lat = {1: 1.0, 4: 1.3, 16: 2.5, 64: 8.0}
    ar = generate(tgt, ids, max_new_tokens=12, eos_token_id=-1).tokens[0]
    sizes = {}
    for cal in (0.3, 1.0, 3.0):
        drafter = Eagle2Drafter(tgt, head, depth=3, top_k=3, total_tokens="auto", latency=lat, calibration=cal)
        seen = []
        propose = drafter.propose

        def spy(state, propose=propose, seen=seen):
            tree = propose(state)
            seen.append(len(tree))
            return tree

        drafter.propose = spy
        assert speculative_generate(tgt, drafter, ids, max_new_tokens=12, eos_token_id=-1).tokens[0] == ar
        sizes[cal] = seen[0]  # the first step: the same state for every calibration
    print(sizes)
    assert sizes[0.3] < sizes[1.0] < sizes[3.0]


def test_measure_draft_cost_leaves_the_drafter_as_it_was(tiny_pair):
    tgt, head = tiny_pair
    drafter = Eagle2Drafter(tgt, head, depth=3, top_k=2, total_tokens=6)
    ids = torch.tensor([[1, 4, 2, 9]])
    ref = speculative_generate(tgt, drafter, ids, max_new_tokens=10, eos_token_id=-1)
    fw, cache, n = drafter.forwards, drafter.cache, drafter.n_cached
    c = drafter.measure_draft_cost(context=16, repeats=3)
    assert c > 0
    assert (drafter.forwards, drafter.cache, drafter.n_cached) == (fw, cache, n)
    assert speculative_generate(tgt, drafter, ids, max_new_tokens=10, eos_token_id=-1).tokens == ref.tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_chains_match_one_at_a_time(tiny_pair, temperature):
    """EagleDrafter.propose_batch (R chains through one padded draft cache, padding masked) drafts what propose
    drafts for each sequence alone (contexts of different lengths): at T = 0 the same tokens and survivals, which
    are also what the tree code (``_draft`` over the chain's spec) drafts, with its path confidence x calibration; at
    T = 1 a batch of one draws exactly what the tree code draws from the same seed. After either, each sequence's
    draft cache holds its committed positions only. Survivals are non-increasing and <= 1."""
    import copy

    from specbook.cache import crop_to
    from specbook.decoding import SpecState
    from specbook.tree import chain_choices

    tgt, head = tiny_pair
    proto = EagleDrafter(tgt, head, choices=chain_choices(4), calibration=1.7, children="noreplace")
    assert proto.chain and proto.confidences and proto.gamma == 4

    def states(prompts, g):
        out = []
        for pr in prompts:
            with torch.no_grad():
                hid = tgt(torch.tensor([pr]), output_hidden_states=True).hidden_states[-1][0]
            out.append(SpecState(tokens=pr + [5], prompt_len=len(pr), sampling=SamplingConfig(temperature),
                                 generator=g, target=tgt, target_hidden=hid))
        return out

    def begun(sts):
        ds = [copy.copy(proto) for _ in sts]
        for d, s in zip(ds, sts):
            d.begin(s)
        return ds

    def tree_code(d, s):  # EagleRunner.propose with the spec's tree code
        d._sampling, d._gen = s.sampling, s.generator
        out = d._draft(d._catch_up(s), d.forwards)
        crop_to(d.cache, d.n_cached)
        return out

    prompts = [[1, 4, 2], [3, 3, 8, 0, 1, 6, 2], [7, 2, 2, 9, 4]]
    g = None if temperature == 0 else make_generator(4)
    sts = states(prompts if temperature == 0 else prompts[1:2], g)
    alone, together = begun(sts), begun(sts)
    many = EagleDrafter.propose_batch(together, sts)
    if temperature == 0:
        one = [d.propose(s) for d, s in zip(alone, sts)]
        refd = begun(sts)  # drafted by the tree code (its own catch-up), step after step
        ref = [tree_code(d, s) for d, s in zip(refd, sts)]
    else:
        g.manual_seed(4)
        ref = [tree_code(alone[0], sts[0])]
        one = ref
        torch.testing.assert_close(ref[0].q, many[0].q)
    for x, y, z, d in zip(one, many, ref, together):
        assert x.tokens.tolist() == y.tokens.tolist() == z.tokens.tolist() and len(y.tokens) == 4
        assert y.parents.tolist() == [-1, 0, 1, 2]
        if temperature == 0:  # the top pick's q is the max: EAGLE-2's path confidence (at T = 1 the tree code's
            # confidence is the sampled token's own q, which a scheduler may not read)
            torch.testing.assert_close(x.confidence, y.confidence, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(z.confidence, y.confidence, atol=1e-5, rtol=1e-4)
        assert bool((y.confidence[1:] <= y.confidence[:-1]).all()) and float(y.confidence.max()) <= 1.0
        assert d.cache.get_seq_length() == d.n_cached
    assert [d.forwards for d in together] == [d.forwards for d in alone]
    if temperature:
        return
    # a second step: rows accept 0, 2 and 4 draft tokens (+ one more token), so the batched catch-up pads ragged
    # blocks; the drafts and each row's draft cache equal the rows drafted alone and by the tree code
    for k, s, x in zip([0, 2, 4], sts, many):
        s.tokens += x.tokens[:k].tolist() + [int(x.tokens[0]) if k == 4 else 6]
        with torch.no_grad():
            hid = tgt(torch.tensor([s.tokens[:-1]]), output_hidden_states=True).hidden_states[-1][0]
        s.target_hidden = hid[len(s.tokens) - 2 - k:]
    one = [d.propose(s) for d, s in zip(alone, sts)]
    many = EagleDrafter.propose_batch(together, sts)
    ref = [tree_code(d, s) for d, s in zip(refd, sts)]
    for x, y, z, a, b in zip(one, many, ref, refd, together):
        assert x.tokens.tolist() == y.tokens.tolist() == z.tokens.tolist()
        torch.testing.assert_close(x.confidence, y.confidence, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(z.confidence, y.confidence, atol=1e-5, rtol=1e-4)
        assert b.n_cached == a.n_cached == b.cache.get_seq_length()
        torch.testing.assert_close(a.cache.layers[0].keys, b.cache.layers[0].keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a.cache.layers[0].values, b.cache.layers[0].values, atol=1e-5, rtol=1e-4)
    assert [d.forwards for d in together] == [d.forwards for d in alone]


def test_bad_input(tiny_pair):
    tgt, head = tiny_pair
    with pytest.raises(ValueError, match="total_tokens"):
        Eagle2Drafter(tgt, head, depth=4, total_tokens=3)
    with pytest.raises(ValueError, match="top_k"):
        Eagle2Drafter(tgt, head, top_k=0)
    with pytest.raises(ValueError, match="depth"):
        Eagle2Drafter(tgt, head, depth=0)
    with pytest.raises(ValueError, match="latency"):
        Eagle2Drafter(tgt, head, total_tokens="auto")
    with pytest.raises(ValueError, match="top_k 13"):
        Eagle2Drafter(tgt, head, top_k=13, total_tokens=16)
    with pytest.raises(ValueError, match="draft_cost"):
        Eagle2Drafter(tgt, head, total_tokens="auto", latency={1: 1.0}, draft_cost=-1.0)
    with pytest.raises(ValueError, match="calibration"):
        Eagle2Drafter(tgt, head, total_tokens="auto", latency={1: 1.0}, calibration=0.0)
    with pytest.raises(ValueError, match="calibration"):
        EagleDrafter(tgt, head, choices=[(0,)], calibration=-1.0)
    wide = tiny_llama(vocab_size=VOCAB, hidden_size=64, seed=3)
    with pytest.raises(ValueError, match="another target"):
        Eagle2Drafter(wide, head)


# --------------------------------------------------------------------------- training + checkpoints

def test_objective_learns_and_checkpoint_checks(tmp_path, tiny, tiny_feature_batch, fit):
    from specbook.models import fingerprint
    from specbook.training import CheckpointError, save_checkpoint

    obj = EagleObjective(tiny, vocab=torch.arange(0, tiny.config.vocab_size, 2))
    batch = tiny_feature_batch
    first, last = fit(obj, batch, lr=3e-3)
    assert last < 0.7 * first
    ev = obj.evaluate(batch, topk=3)
    assert {"top1", "top3", "acc_r2", "soft_r2", "top1_step2", "mean_top1"} <= set(ev)
    # soft_r{c} = E[p(c-th guess)]: the three guesses are distinct tokens, so their probabilities sum to <= 1
    assert all(0 <= ev[f"soft_r{c}"] <= 1 for c in range(3)) and sum(ev[f"soft_r{c}"] for c in range(3)) <= 1 + 1e-6
    with torch.no_grad():  # by hand: the target's T=1 probability of the head's top guess, averaged
        f = batch.feats[:, :, 0, :].float()
        m = batch.mask[:, 1:]
        pred = obj._predict(batch, 0.0)[m]
        guess = obj.vocab[(pred @ obj.W.T).argmax(-1)]
        p = torch.softmax(f[:, 1:][m] @ obj.W_full.T, -1)
        assert ev["soft_r0"] == pytest.approx(float(p.gather(-1, guess[:, None]).mean()), rel=1e-5)
        # conf_r0: the draft's own probability of its top guess (softmax over the head's vocabulary), averaged
        q = torch.softmax(pred @ obj.W.T, -1)
        assert ev["conf_r0"] == pytest.approx(float(q.max(-1).values.mean()), rel=1e-5)
        assert float(q.max(-1).values.min()) >= 1 / len(obj.vocab)

    card = {"kind": "eagle", "config": obj.card_config(), "target": "tiny", "target_fingerprint": fingerprint(tiny),
            "heldout": ev}
    save_checkpoint(tmp_path / "e", obj.state(), card, dtype=torch.float32)
    head, vocab, _ = load_eagle(tiny, tmp_path / "e")
    assert torch.equal(vocab, obj.vocab)
    x = torch.randn(1, 3, tiny.config.hidden_size)
    torch.testing.assert_close(head(x, x), obj.head.eval()(x, x))
    with pytest.raises(CheckpointError, match="fingerprint"):
        load_eagle(tiny_llama(seed=9), tmp_path / "e")
    # a head trained for another layer count / architecture, with a matching fingerprint
    card_bad = {**card, "config": {**card["config"], "num_hidden_layers_target": 30}}
    save_checkpoint(tmp_path / "e2", obj.state(), card_bad, dtype=torch.float32)
    with pytest.raises(CheckpointError, match="EAGLE head for"):
        load_eagle(tiny, tmp_path / "e2")
    st = tmp_path / "e.safetensors"
    st.write_bytes(st.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_eagle(tiny, tmp_path / "e")


# --------------------------------------------------------------------------- the real model

@pytest.mark.slow
def test_real_model_eagle_greedy_equals_ar(real):
    """Greedy EAGLE (committed head; static tree and EAGLE-2's dynamic tree) emits exactly our AR loop's
    tokens in fp32, and the head really drafts accepted tokens."""
    from specbook import bench
    from specbook.decoding import encode
    from specbook.prompts import load_prompts
    from specbook.train import CKPT_DIR

    model, tok = real
    head, vocab, card = load_eagle(model, CKPT_DIR / "eagle")
    lat = {1: 0.040, 16: 0.046, 64: 0.063}  # a latency curve like an AMX CPU's (bf16), with its draft cost
    s = bench.EagleSettings()
    drafters = [EagleDrafter(model, head, vocab, choices=static_tree(card, 16, depth=s.depth)),
                Eagle2Drafter(model, head, vocab, depth=s.depth, top_k=s.top_k, total_tokens=16),
                Eagle2Drafter(model, head, vocab, depth=s.depth, top_k=s.top_k, total_tokens="auto", latency=lat,
                              draft_cost=0.004)]
    taus = []
    for i, p in enumerate(load_prompts("eval", limit=6)):
        ids, _ = encode(tok, p["turns"][0])
        ar = generate(model, ids, max_new_tokens=64).tokens[0]
        sp = speculative_generate(model, drafters[i % 3], ids, max_new_tokens=64)
        assert sp.tokens[0] == ar, p["question_id"]
        taus.append(sp.stats.tau)
    print("mean tau", sum(taus) / len(taus))
    assert sum(taus) / len(taus) > 1.5


def test_warm_start_copies_a_checkpoint_and_refuses_another_head(tmp_path, tiny, tiny_feature_batch, fit):
    """Continued training starts from exactly the checkpoint's weights; a checkpoint of another head config or
    vocabulary size is refused, not reshaped. Other tokens of the same count are taken: EAGLE's vocabulary only
    picks rows of the target's frozen LM head, so every trained weight still fits."""
    from specbook.models import fingerprint
    from specbook.training import CheckpointError, save_checkpoint, warm_start

    vocab = torch.arange(0, tiny.config.vocab_size, 2)
    trained = EagleObjective(tiny, vocab=vocab)
    fit(trained, tiny_feature_batch, lr=3e-3)
    card = {"kind": "eagle", "config": trained.card_config(), "target": "tiny", "target_fingerprint": fingerprint(tiny),
            "steps": 40, "corpus_sha": "abc"}
    save_checkpoint(tmp_path / "e", trained.state(), card, dtype=torch.float32)

    fresh = EagleObjective(tiny, vocab=vocab)
    assert not torch.equal(fresh.state()["fc.weight"], trained.state()["fc.weight"])
    init = warm_start(fresh, tmp_path / "e", tiny)
    assert init["steps"] == 40 and init["corpus_sha"] == "abc" and len(init["weights_sha256"]) == 64
    assert init["vocab_changed"] is False
    for k, v in trained.state().items():
        assert torch.equal(fresh.state()[k], v), k
    assert fresh.evaluate(tiny_feature_batch, topk=3) == trained.evaluate(tiny_feature_batch, topk=3)

    with pytest.raises(CheckpointError, match="config"):
        warm_start(EagleObjective(tiny, vocab=vocab, noise=0.3), tmp_path / "e", tiny)
    with pytest.raises(CheckpointError, match="config|vocabulary"):  # vocab size is in the config
        warm_start(EagleObjective(tiny, vocab=torch.arange(0, tiny.config.vocab_size, 3)), tmp_path / "e", tiny)
    other = EagleObjective(tiny, vocab=vocab + 1)  # same size, other tokens: the trained weights, its own vocabulary
    assert warm_start(other, tmp_path / "e", tiny)["vocab_changed"] is True
    assert torch.equal(other.vocab, vocab + 1) and torch.equal(other.state()["fc.weight"], trained.state()["fc.weight"])


def test_interpolate_mixes_a_checkpoint_and_its_continuation_only(tmp_path, tiny, tiny_feature_batch, fit):
    """WiSE-FT between a checkpoint and one warm-started from it: every trained weight is exactly
    (1 - alpha) * start + alpha * end (alpha 0 and 1 give the ends back); the draft vocabulary stays the run's. A
    pair that is not a checkpoint and its own continuation is refused, and so is an alpha outside [0, 1]."""
    from specbook.models import fingerprint
    from specbook.train import _fit
    from specbook.training import CheckpointError, interpolate, save_checkpoint, warm_start

    vocab = torch.arange(0, tiny.config.vocab_size, 2)

    def card(obj, **kw):
        return {"kind": "eagle", "config": obj.card_config(), "target": "tiny", "target_fingerprint": fingerprint(tiny),
                "steps": 20, "corpus_sha": "abc", **kw}

    start = EagleObjective(tiny, vocab=vocab)
    fit(start, tiny_feature_batch, lr=3e-3, steps=20)
    save_checkpoint(tmp_path / "a", start.state(), card(start), dtype=torch.float32)
    end = EagleObjective(tiny, vocab=vocab + 1)  # continued on another corpus: other top tokens
    init = warm_start(end, tmp_path / "a", tiny)
    fit(end, tiny_feature_batch, lr=3e-3, steps=20)
    save_checkpoint(tmp_path / "b", end.state(), card(end, init=init), dtype=torch.float32)
    A, B = start.state(), end.state()
    for alpha in (0.0, 0.3, 1.0):
        mixed = EagleObjective(tiny, vocab=vocab + 1)
        mix = interpolate(mixed, tmp_path / "a", tmp_path / "b", alpha, tiny)
        assert mix["alpha"] == alpha and mix["start"]["path"] == str(tmp_path / "a")
        assert mix["end"]["weights_sha256"] != mix["start"]["weights_sha256"]
        for k, v in mixed.state().items():
            want = B[k] if not v.is_floating_point() else torch.lerp(A[k], B[k], alpha)
            assert torch.equal(v, want), (alpha, k)
    assert torch.equal(mixed.state()["fc.weight"], B["fc.weight"]) and not torch.equal(B["fc.weight"], A["fc.weight"])

    with pytest.raises(CheckpointError, match="not warm-started from"):  # the wrong way round
        interpolate(EagleObjective(tiny, vocab=vocab), tmp_path / "b", tmp_path / "a", 0.5, tiny)
    other = EagleObjective(tiny, vocab=vocab + 1)  # trained apart: no shared path
    fit(other, tiny_feature_batch, lr=3e-3, steps=5)
    save_checkpoint(tmp_path / "c", other.state(), card(other), dtype=torch.float32)
    with pytest.raises(CheckpointError, match="not warm-started from"):
        interpolate(EagleObjective(tiny, vocab=vocab + 1), tmp_path / "a", tmp_path / "c", 0.5, tiny)
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        interpolate(EagleObjective(tiny, vocab=vocab + 1), tmp_path / "a", tmp_path / "b", 1.5, tiny)
    with pytest.raises(SystemExit, match="needs --init"):
        _fit("eagle", None, argparse.Namespace(interpolate=str(tmp_path / "a"), init=None), None, None, tiny)
