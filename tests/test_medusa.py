"""Medusa: tree specs, the sparse tree, lossless / typical tree verification, the drafter, checkpoints."""
import pytest
import torch

from specbook import verify as V
from specbook.drafters.medusa import MedusaDrafter, MedusaHeads, MedusaObjective, load_medusa, rank_accuracy
from specbook.exactness import exact_first_two, logit_table, topk_tree, tree_first_two, tv, tv_bound
from specbook.models import tiny_llama
from specbook.sampling import SamplingConfig, make_generator
from specbook.tree import (
    all_choices,
    ancestor_mask,
    auto_nodes,
    chain_choices,
    leaf_paths,
    sparse_tree,
    tree_from_choices,
)

# --------------------------------------------------------------------------- tree specs

def test_tree_from_choices_chain_star_unbalanced():
    nodes, parents = tree_from_choices(chain_choices(3))
    assert nodes == [(0,), (0, 0), (0, 0, 0)] and parents.tolist() == [-1, 0, 1]
    nodes, parents = tree_from_choices([(2,), (0,), (1,)])  # a star, given out of order
    assert nodes == [(0,), (1,), (2,)] and parents.tolist() == [-1, -1, -1]
    nodes, parents = tree_from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert nodes == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert parents.tolist() == [-1, -1, 0, 0, 1, 2]
    assert leaf_paths(parents) == [[0, 3], [1, 4], [0, 2, 5]]
    assert ancestor_mask(parents)[6].tolist() == [True, True, False, True, False, False, True]
    assert len(all_choices(2, 3)) == 3 + 9


def test_tree_spec_bad_input():
    with pytest.raises(ValueError, match="no parent"):
        tree_from_choices([(0,), (1, 0)])  # (1,) is missing
    with pytest.raises(ValueError, match="at least one"):
        tree_from_choices([])
    tgt = tiny_llama(vocab_size=12, hidden_size=32)
    heads = MedusaHeads(32, n_heads=2)
    with pytest.raises(ValueError, match="only 2 Medusa heads"):
        MedusaDrafter(tgt, heads, chain_choices(3))
    with pytest.raises(ValueError, match="top-13"):
        MedusaDrafter(tgt, heads, [(12,)] + [(i,) for i in range(12)])
    with pytest.raises(ValueError, match="n_heads"):
        MedusaHeads(32, n_heads=0)


def test_sparse_tree_hand_computed():
    # head 1: rank 0 right 60%, rank 1 20%; head 2: rank 0 50%, rank 1 10%
    acc = [[0.6, 0.2], [0.5, 0.1]]
    # scores: (0)=.6 (0,0)=.30 (1)=.2 (0,1)=.06 (1,0)=.10 (1,1)=.02
    assert sparse_tree(acc, 1) == [(0,)]
    assert sparse_tree(acc, 3) == [(0,), (0, 0), (1,)]
    assert sparse_tree(acc, 5) == [(0,), (0, 0), (1,), (1, 0), (0, 1)]
    assert len(sparse_tree(acc, 100)) == 6  # everything there is
    tree_from_choices(sparse_tree(acc, 4))  # always a valid tree


def test_auto_nodes_from_the_latency_curve():
    acc = [[0.6, 0.2], [0.5, 0.1]]  # path values .6, .3, .2, .1, .06, .02 (see above)
    # latency(k) = 1 + (k - 1) / 10: tau(n) / latency(n + 1) = 1.6/1.1, 1.9/1.2, 2.1/1.3, 2.2/1.4 -> peak at 3
    lat = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4, 6: 1.5, 7: 1.6}
    assert auto_nodes(acc, lat) == 3
    assert auto_nodes(acc, {1: 1.0, 64: 1.0}) == 6  # free verification: the whole tree
    assert auto_nodes(acc, {1: 1.0, 2: 10.0}) == 1  # dear verification: one node (the minimum)


# --------------------------------------------------------------------------- statistical losslessness

VOCAB, PROMPT, N = 12, [0, 3, 7], 100_000


@pytest.fixture(scope="module")
def tables():
    tgt = tiny_llama(vocab_size=VOCAB, hidden_size=32, seed=3)
    drf = tiny_llama(vocab_size=VOCAB, hidden_size=32, seed=4)
    return logit_table(tgt, PROMPT), logit_table(drf, PROMPT)


@pytest.mark.parametrize("cfg", [SamplingConfig(0.7), SamplingConfig(1.0, top_p=0.8)], ids=["T0.7", "T1-top_p0.8"])
def test_tree_verification_is_lossless(tables, cfg):
    p_logits, q_logits = tables
    tree = topk_tree(q_logits, width=2)  # 2 + 4 nodes of deterministic top-k picks (one-hot q)
    exact = exact_first_two(p_logits, cfg)
    d, b = tv(tree_first_two(p_logits, tree, cfg, N, make_generator(5)), exact), tv_bound(exact, N)
    print(f"tree TV={d:.4f} bound={b:.4f}")
    assert d < b


def test_broken_tree_verification_fails(tables, monkeypatch):
    """Teeth: forget to remove a rejected sibling from p before trying the next one -> must fail."""
    p_logits, q_logits = tables
    cfg = SamplingConfig(1.0)
    monkeypatch.setattr(V, "residual_one_hot", lambda p, x: p)
    exact = exact_first_two(p_logits, cfg)
    d, b = tv(tree_first_two(p_logits, topk_tree(q_logits, 2), cfg, N, make_generator(5)), exact), tv_bound(exact, N)
    print(f"broken tree TV={d:.4f} bound={b:.4f}")
    assert d > 2 * b


def test_typical_acceptance_is_flagged_and_measured_lossy(tables):
    p_logits, q_logits = tables
    cfg = SamplingConfig(1.0)
    assert "LOSSY" in V.typical_accept.__doc__
    exact = exact_first_two(p_logits, cfg)
    typical = lambda rows, tree, c, g: V.typical_accept(rows, tree, c, generator=g)  # noqa: E731
    d = tv(tree_first_two(p_logits, topk_tree(q_logits, 2), cfg, N // 4, make_generator(6), accept=typical), exact)
    b = tv_bound(exact, N // 4)
    print(f"typical acceptance TV={d:.4f} (lossless bound {b:.4f})")
    assert d > 2 * b, "typical acceptance is expected to change the output distribution"


def test_medusa_greedy_equals_ar_on_tiny_model(tiny):
    from specbook.decoding import generate, speculative_generate

    heads = MedusaHeads(tiny.config.hidden_size, n_heads=3)
    torch.manual_seed(1)
    for b in heads.blocks:
        torch.nn.init.normal_(b.linear.weight, std=0.3)
    drafter = MedusaDrafter(tiny, heads, sparse_tree([[0.5, 0.2, 0.1]] * 3, 9))
    for seed in range(4):
        ids = torch.randint(0, tiny.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(seed))
        ar = generate(tiny, ids, max_new_tokens=24, eos_token_id=-1).tokens[0]
        sp = speculative_generate(tiny, drafter, ids, max_new_tokens=24, eos_token_id=-1)
        assert sp.tokens[0] == ar
        assert sp.stats.target_forwards <= 24


def test_acceptance_mode_is_validated(tiny):
    from specbook.decoding import speculative_generate

    drafter = MedusaDrafter(tiny, MedusaHeads(tiny.config.hidden_size, 1), [(0,)])
    with pytest.raises(ValueError, match="acceptance"):
        speculative_generate(tiny, drafter, torch.tensor([[1, 2]]), acceptance="fast")


# --------------------------------------------------------------------------- training + checkpoints

def test_objective_learns_and_checkpoint_round_trip(tmp_path, tiny, tiny_feature_batch, fit):
    from specbook.training import CheckpointError, save_checkpoint

    obj = MedusaObjective(tiny, n_heads=2, vocab=torch.arange(0, tiny.config.vocab_size, 2))
    batch = tiny_feature_batch
    first, last = fit(obj, batch, lr=1e-2)
    assert last < first - 0.2
    ev = obj.evaluate(batch, topk=3)
    assert {"top1_h1", "top3_h2", "acc_h2_r2", "mean_top1"} <= set(ev)

    from specbook.models import fingerprint

    card = {"kind": "medusa", "config": obj.card_config(), "target": "tiny", "target_fingerprint": fingerprint(tiny),
            "heldout": ev}
    save_checkpoint(tmp_path / "m", obj.state(), card, dtype=torch.float32)
    heads, vocab, card2 = load_medusa(tiny, tmp_path / "m")
    assert torch.equal(vocab, obj.vocab) and heads.n_heads == 2
    assert len(rank_accuracy(card2)) == 2 and len(rank_accuracy(card2)[0]) == 3
    other = tiny_llama(seed=9)
    with pytest.raises(CheckpointError, match="fingerprint"):
        load_medusa(other, tmp_path / "m")
    st = (tmp_path / "m.safetensors")
    st.write_bytes(st.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_medusa(tiny, tmp_path / "m")


# --------------------------------------------------------------------------- the real model

@pytest.mark.slow
def test_real_model_medusa_greedy_equals_ar(real):
    """Greedy Medusa (committed heads, a 16-node sparse tree) emits exactly our AR loop's tokens in fp32."""
    from specbook.decoding import encode, generate, speculative_generate
    from specbook.prompts import load_prompts
    from specbook.train import CKPT_DIR

    model, tok = real
    heads, vocab, card = load_medusa(model, CKPT_DIR / "medusa")
    drafter = MedusaDrafter(model, heads, sparse_tree(rank_accuracy(card), 16), vocab=vocab)
    taus = []
    for p in load_prompts("eval", limit=8):
        ids, _ = encode(tok, p["turns"][0])
        ar = generate(model, ids, max_new_tokens=64).tokens[0]
        sp = speculative_generate(model, drafter, ids, max_new_tokens=64)
        assert sp.tokens[0] == ar, p["question_id"]
        taus.append(sp.stats.tau)
    print("mean tau", sum(taus) / len(taus))
    assert sum(taus) / len(taus) > 1.2  # the heads really propose accepted tokens


def test_typical_knobs_reach_the_rule_and_are_validated(tiny):
    """``Typical(eps, delta)`` is what "typical" means by default (same tokens from the same generator); a lower eps
    accepts at least as much in one step (the threshold min(eps, delta e^-H) can only fall); bad knobs are refused."""
    from specbook.decoding import SpecState, Typical, accept, speculative_generate

    heads = MedusaHeads(tiny.config.hidden_size, n_heads=2)
    drafter = MedusaDrafter(tiny, heads, sparse_tree([[0.5, 0.2, 0.1]] * 2, 6))
    ids = torch.tensor([[0, 5, 9, 11]])
    cfg = SamplingConfig(1.0)
    runs = [speculative_generate(tiny, drafter, ids, max_new_tokens=20, eos_token_id=-1, sampling=cfg,
                                 generator=make_generator(3), acceptance=a).tokens for a in ("typical", Typical())]
    assert runs[0] == runs[1]
    st = SpecState(tokens=ids[0].tolist(), prompt_len=4, sampling=cfg, generator=make_generator(0), target=tiny)
    drafter.begin(st)
    st.target_hidden = torch.randn(1, tiny.config.hidden_size, generator=torch.Generator().manual_seed(2))
    tree = drafter.propose(st)
    with torch.no_grad():
        logits = torch.randn(len(tree) + 1, tiny.config.vocab_size, generator=torch.Generator().manual_seed(0))
    n = [accept(logits, tree, cfg, make_generator(1), Typical(eps=e, delta=d)).n_accepted
         for e, d in ((1.0, 10.0), (1e-4, 1e-4))]
    assert n[0] <= n[1] and n[1] >= 1
    for bad in (dict(eps=0.0), dict(eps=1.5), dict(delta=0.0)):
        with pytest.raises(ValueError, match="eps"):
            Typical(**bad)
