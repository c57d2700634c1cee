"""DFlash / DSpark (drafters/dflash.py): the block attention, one draft forward per step, training = drafting,
the Markov head, the confidence target and its calibration, bad input. Losslessness at T > 0: test_lossless.py."""

import argparse

import pytest
import torch

from specbook.decoding import generate, speculative_generate
from specbook.drafters.dflash import (
    BlockDrafter,
    BlockNet,
    DFlashObjective,
    DSparkObjective,
    calibrate,
    default_taps,
    ece,
    load_block,
    sequential_platt_scaling,
    sequential_temperature_scaling,
    survival,
    tv_distance,
)
from specbook.models import fingerprint, tiny_llama
from specbook.training import Batch, CheckpointError, checkpoint_vocab, save_checkpoint

L = 8


@pytest.fixture(scope="module")
def deep():
    """A tiny random Llama with 8 layers: DFlash taps (2, 4, 6) for m = 3."""
    return tiny_llama(vocab_size=48, hidden_size=32, layers=L, seed=1)


def _net(target, vocab=None, noise=0.3, seed=0, gamma=4, rank=0, confidence=False, taps=None):
    torch.manual_seed(seed)
    vocab = torch.arange(0, target.config.vocab_size, 2) if vocab is None else vocab
    net = BlockNet(target.config, vocab, gamma=gamma, layers=2, markov_rank=rank, confidence=confidence, taps=taps)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return net.eval()


def _batch(target, n=2, S=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.config.vocab_size, (n, S), generator=g)
    with torch.no_grad():
        hs = target(tokens, output_hidden_states=True).hidden_states
    feats = torch.stack([hs[t] for t in default_taps(L)] + [hs[-1]], dim=2)
    return Batch(tokens, feats, torch.ones(n, S, dtype=torch.bool))


def test_default_taps_follow_dflash():
    assert default_taps(30) == (2, 15, 28)  # layers 1, 14, 27 at their outputs
    assert default_taps(8) == (2, 4, 6)
    assert default_taps(30, 1) == (16,)
    assert default_taps(30, 2) == (2, 28)


def _objective(cls, target, net, anchors=3):
    obj = cls(target, net.vocab, gamma=net.gamma, layers=2, anchors=anchors)
    obj.net.load_state_dict(net.state_dict())
    obj.net.eval()
    return obj


def test_block_mask_by_hand():
    from specbook.drafters.dflash import block_mask

    m = block_mask(torch.tensor([2, 4]), 6, 1)  # two blocks of 2 positions in a window of 6
    want = torch.tensor([[1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
                         [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
                         [1, 1, 1, 1, 0, 0, 0, 0, 1, 1],
                         [1, 1, 1, 1, 0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, want)


def test_static_cut_by_hand():
    from specbook.drafters.dflash import static_cut
    from specbook.viz import cut_steps

    assert static_cut([0.9, 0.5, 0.2], 0.3) == 2 and static_cut([0.9, 0.5], 0.1) == 2 and static_cut([0.2], 0.3) == 0
    steps = [{"survival": [0.9, 0.5, 0.2], "accepted": 1}, {"survival": [0.9, 0.8, 0.7], "accepted": 3}]
    assert cut_steps(steps, 0.3) == {"cuts": [2, 3], "kept": 4, "wasted": 1, "lost": 0, "verified": 5}


def test_block_sees_its_context_before_the_anchor_and_only_features(deep):
    """Training's block attention: a block's logits change with a context feature before its anchor, not with one
    after it, and not with the context's token ids (context K/V come only from the injected features)."""
    obj = _objective(DFlashObjective, deep, _net(deep), anchors=1)
    b = _batch(deep)
    b.mask[:] = False
    b.mask[:, 10] = True  # the only possible anchor: 10
    base = obj._forward(b)["logits"]
    feats = b.feats.clone()
    feats[:, 12:, :3] += 5.0  # positions after the anchor (inside and beyond its block)
    assert torch.allclose(obj._forward(Batch(b.tokens, feats, b.mask))["logits"], base, atol=1e-5)
    toks = b.tokens.clone()
    toks[:, :10] = (toks[:, :10] + 1) % 48  # context tokens (not the anchor)
    assert torch.allclose(obj._forward(Batch(toks, b.feats, b.mask))["logits"], base, atol=1e-5)
    feats = b.feats.clone()
    feats[:, 3, :3] += 5.0  # one context position before the anchor
    assert not torch.allclose(obj._forward(Batch(b.tokens, feats, b.mask))["logits"], base, atol=1e-3)


def test_block_attention_is_non_causal_inside_the_block(deep):
    """Every block position reads every other one: changing the anchor changes the last position's output, and a
    causal mask would give a different output at the first mask position."""
    net = _net(deep)
    ctx = torch.randn(1, 6, 3 * 32)
    kv = net.context_kv(net.context(ctx), torch.arange(6)[None])
    emb = net.mask_embedding.expand(1, 5, -1).clone()
    emb[0, 0] = torch.randn(32)
    pos = torch.arange(6, 11)[None]
    h = net.block(emb, pos, kv)
    emb2 = emb.clone()
    emb2[0, 0] += 1.0
    assert not torch.allclose(net.block(emb2, pos, kv)[0, -1], h[0, -1], atol=1e-4)
    causal = torch.cat([torch.ones(5, 6, dtype=torch.bool), torch.ones(5, 5, dtype=torch.bool).tril()], 1)[None, None]
    assert not torch.allclose(net.block(emb, pos, kv, causal)[0, 1], h[0, 1], atol=1e-4)


@pytest.mark.parametrize("cls,rank", [(DFlashObjective, 0), (DSparkObjective, 8)])
def test_training_forward_equals_drafting(deep, cls, rank):
    """The teacher-forced training forward at an anchor gives the logits the drafter computes after committing the
    same context (the drafter's cached context K/V, the Markov head fed the true previous tokens)."""
    net = _net(deep, rank=rank, confidence=bool(rank))
    obj = cls(deep, net.vocab, gamma=4, layers=2, anchors=1, markov_rank=rank)
    obj.net.load_state_dict(net.state_dict())
    obj.net.eval()
    b = _batch(deep, n=1)
    a = 9
    b.mask[:] = False
    b.mask[0, a] = True
    f = obj._forward(b)
    toks = b.tokens[0].tolist()
    d = BlockDrafter(deep, obj.net)
    from specbook.decoding import SpecState
    from specbook.sampling import SamplingConfig

    hid = b.feats[0, :a, :3].flatten(1)  # states of positions 0..a-1; the anchor a is the newest token
    st = SpecState(tokens=toks[:a + 1], prompt_len=a + 1, sampling=SamplingConfig(0.0), generator=None, target=deep,
                   target_hidden=hid)
    d.begin(st)
    with torch.no_grad():
        kv = obj.net.context_kv(obj.net.context(hid[None]), torch.arange(a)[None])
        emb = torch.cat([deep.get_input_embeddings()(torch.tensor([[toks[a]]])), obj.net.mask_embedding.expand(1, 4, -1)], 1)
        h = obj.net.block(emb, torch.arange(a, a + 5)[None], kv)[0, 1:]
        logits = h @ d.W.T
        if obj.net.rank:
            logits = logits + obj.net.markov_w2(obj.net.markov(torch.tensor(toks[a:a + 4])))
    torch.testing.assert_close(f["logits"][0], logits, atol=1e-5, rtol=1e-5)
    draft = d.propose(st)  # greedy: the drafter's first token is the argmax of position 1
    assert int(draft.tokens[0]) == int(obj.net.vocab[logits[0].argmax()])
    assert d.forwards == 1


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_one_draft_forward_per_step(deep, gamma):
    net = _net(deep, gamma=6)
    ids = torch.randint(0, 48, (1, 6), generator=torch.Generator().manual_seed(gamma))
    res = speculative_generate(deep, BlockDrafter(deep, net, gamma=gamma), ids, max_new_tokens=20, eos_token_id=-1)
    s = res.stats
    assert s.draft_forwards == s.target_forwards - 1  # one draft forward per step (the prefill has none)


@pytest.mark.parametrize("rank,threshold,taps", [(0, None, None), (8, None, None), (8, 0.3, None), (8, "auto", None),
                                                (8, None, (2, 4, L))])
def test_drafter_greedy_equals_ar(deep, rank, threshold, taps):
    """Lossless at T = 0, the static and the "auto" cut included; taps (2, 4, L): the last one is the final state."""
    net = _net(deep, rank=rank, confidence=bool(rank), taps=taps)
    for seed in range(3):
        ids = torch.randint(0, 48, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        d = BlockDrafter(deep, net, threshold=threshold, latency={1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0})
        res = speculative_generate(deep, d, ids, max_new_tokens=16, eos_token_id=-1)
        assert res.tokens[0] == generate(deep, ids, max_new_tokens=16, eos_token_id=-1).tokens[0]


def test_markov_head_with_w1_zero_is_plain_dflash_and_reads_the_previous_token(deep):
    dspark = _net(deep, rank=8, confidence=True)
    with torch.no_grad():
        dspark.markov_w1.weight.zero_()
    dflash = BlockNet(deep.config, dspark.vocab, gamma=4, layers=2)
    dflash.load_state_dict({k: v for k, v in dspark.state_dict().items() if not k.startswith(("markov", "confidence"))})
    dflash.eval()
    for seed in range(2):
        ids = torch.randint(0, 48, (1, 7), generator=torch.Generator().manual_seed(seed))
        from specbook.sampling import SamplingConfig

        outs = [speculative_generate(deep, BlockDrafter(deep, n), ids, max_new_tokens=12, eos_token_id=-1,
                                     sampling=SamplingConfig(1.0), generator=torch.Generator().manual_seed(5)).tokens[0]
                for n in (dspark, dflash)]
        assert outs[0] == outs[1]
    # teacher forcing: training adds W2 W1[the true previous token] to position k's logits
    net = _net(deep, rank=8, confidence=True)
    obj = DSparkObjective(deep, net.vocab, gamma=4, layers=2, anchors=2, markov_rank=8)
    obj.net.load_state_dict(net.state_dict())
    b = _batch(deep)
    with torch.no_grad():
        obj.g.manual_seed(0)
        f = obj._forward(b)
        w2 = obj.net.markov_w2.weight.clone()
        obj.net.markov_w2.weight.zero_()
        obj.g.manual_seed(0)  # the same anchors
        f0 = obj._forward(b)
    assert f["w1"] is not None
    obj2 = DSparkObjective(deep, net.vocab, gamma=4, layers=2, anchors=2, markov_rank=8)
    obj2.net.load_state_dict(net.state_dict())
    anchors, _ = obj2._anchors(b, False)
    at = (anchors[:, :, None] + torch.arange(1, 5)).clamp_max(b.tokens.shape[1] - 1) - 1  # x_{k-1} (in the window)
    prev = torch.stack([b.tokens[i, at[i]] for i in range(2)]).reshape(-1, 4)
    torch.testing.assert_close(f["logits"] - f0["logits"], obj.net.markov(prev) @ w2.T, atol=1e-5, rtol=1e-5)


def test_tv_distance_by_hand():
    # draft over a 2-token draft vocabulary; the target puts 0.2 of its mass outside it
    q = torch.tensor([0.7, 0.3])
    p_v = torch.tensor([0.5, 0.3])  # p = (0.5, 0.3, 0.2 elsewhere)
    # TV = 1/2 (|0.7 - 0.5| + |0.3 - 0.3| + 0.2) = 0.2; 1 - TV = sum min(p, q) = 0.5 + 0.3 = 0.8
    assert abs(float(tv_distance(q, p_v)) - 0.2) < 1e-6


def test_sequential_temperature_scaling_recovers_a_known_temperature():
    """Outcomes drawn with survival prob sigmoid(z_k / 2) per position: the head is over-confident by a factor 2 in
    logit; the fit finds t ~ 2 at each position and the cumulative ECE drops."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(20000, 3, generator=g) * 3 + 1
    o = (torch.rand(20000, 3, generator=g) < torch.sigmoid(z / 2)).double()
    temps = sequential_temperature_scaling(z, o)
    assert all(1.6 < t < 2.5 for t in temps), temps
    cum = o.cumprod(-1)
    for k in range(3):
        before = ece(survival(z, [1.0] * 3)[:, k], cum[:, k])
        after = ece(survival(z, temps)[:, k], cum[:, k])
        assert after < 0.5 * before and after < 0.02
    rep = calibrate({"z": z, "hit": o, "soft": torch.sigmoid(z / 2)})
    assert rep["after"]["greedy"]["ece"][2] < rep["before"]["greedy"]["ece"][2]
    assert rep["after"]["greedy"]["auroc"][0] > 0.7 and rep["after"]["sampled"]["auroc"] is None


def test_sequential_platt_scaling_recovers_a_shift_a_temperature_cannot():
    """Outcomes drawn with survival prob sigmoid(z_k / 2 - 1): over-confident in scale AND in level. The log-loss
    fit finds t ~ 2, b ~ -1 at each position and a near-zero cumulative ECE; DSpark's temperature-only fit cannot
    move the level and stays several times worse at position 1."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(20000, 3, generator=g) * 3 + 1
    o = (torch.rand(20000, 3, generator=g) < torch.sigmoid(z / 2 - 1)).double()
    temps, shifts = sequential_platt_scaling(z, o)
    assert all(1.6 < t < 2.5 for t in temps) and all(-1.3 < b < -0.7 for b in shifts), (temps, shifts)
    cum = o.cumprod(-1)
    t_only = sequential_temperature_scaling(z, o)
    for k in range(3):
        after = ece(survival(z, temps, shifts)[:, k], cum[:, k])
        assert after < 0.02
    assert ece(survival(z, t_only)[:, 0], cum[:, 0]) > 3 * ece(survival(z, temps, shifts)[:, 0], cum[:, 0])


def test_objectives_learn(deep, fit):
    b = _batch(deep, n=4)
    for cls in (DFlashObjective, DSparkObjective):
        obj = cls(deep, torch.arange(0, 48, 2), gamma=4, layers=2, anchors=4)
        obj.g.manual_seed(0)
        first, last = fit(obj, b, lr=3e-3, steps=40)
        assert last < 0.8 * first, (cls.kind, first, last)
        ev = obj.evaluate(b)
        assert {"acc_1", "surv_4", "soft_1", "tau0", "mean_acc"} <= set(ev) and 1 <= ev["tau0"] <= 5
        _, info = obj.loss(b)
        assert set(info) == set(obj.loss_weights)


def test_bad_input(deep, tmp_path):
    net = _net(deep)
    with pytest.raises(ValueError, match="gamma"):
        BlockNet(deep.config, torch.arange(4), gamma=0)
    with pytest.raises(ValueError, match="gamma"):
        BlockDrafter(deep, net, gamma=0)
    with pytest.raises(ValueError, match="longer than the block"):
        BlockDrafter(deep, net, gamma=9)
    dspark = _net(deep, rank=8, confidence=True)
    for bad in (-0.1, 1.5, "high"):
        with pytest.raises(ValueError, match="threshold"):
            BlockDrafter(deep, dspark, threshold=bad)
    with pytest.raises(ValueError, match="confidence head"):
        BlockDrafter(deep, net, threshold=0.5)
    with pytest.raises(ValueError, match="latency"):
        BlockDrafter(deep, dspark, threshold="auto")
    with pytest.raises(ValueError, match="taps"):
        BlockNet(deep.config, torch.arange(4), taps=(2, 9))
    obj = DFlashObjective(deep, torch.arange(0, 48, 2), gamma=4, layers=2)
    card = {"kind": "dflash", "config": obj.card_config(), "target_fingerprint": fingerprint(deep)}
    save_checkpoint(tmp_path / "df", obj.state(), card, dtype=torch.float32)
    loaded, _ = load_block(deep, tmp_path / "df", "dflash")
    assert loaded.vocab.tolist() == list(range(0, 48, 2)) and loaded.taps == (2, 4, 6)
    with pytest.raises(CheckpointError, match="trained for target"):
        load_block(tiny_llama(vocab_size=48, hidden_size=32, layers=L, seed=9), tmp_path / "df", "dflash")
    with pytest.raises(CheckpointError):
        load_block(deep, tmp_path / "df", "dspark")  # a DFlash checkpoint is not a DSpark one
    shallow = tiny_llama(vocab_size=48, hidden_size=32, layers=4, seed=1)
    card = {**card, "target_fingerprint": fingerprint(shallow), "config": {**card["config"], "num_hidden_layers_target": 4}}
    save_checkpoint(tmp_path / "dfs", obj.state(), card, dtype=torch.float32)
    with pytest.raises(CheckpointError, match="taps layers"):
        load_block(shallow, tmp_path / "dfs", "dflash")
    other_vocab = tiny_llama(vocab_size=64, hidden_size=32, layers=L, seed=1)
    card = {**card, "target_fingerprint": fingerprint(other_vocab),
            "config": {**obj.card_config()}}
    save_checkpoint(tmp_path / "dfv", obj.state(), card, dtype=torch.float32)
    with pytest.raises(CheckpointError, match="vocabulary 48"):
        load_block(other_vocab, tmp_path / "dfv", "dflash")


@pytest.mark.slow
def test_real_model_block_drafters_greedy_equal_ar(real):
    """Random DFlash / DSpark drafters on SmolLM2 (taps 2, 15, 28) in fp32: greedy output equals our AR loop's."""
    from specbook.decoding import encode
    from specbook.prompts import load_prompts

    model, tok = real
    nets = [_net(model, vocab=torch.arange(0, 4096), noise=0.0, gamma=7),
            _net(model, vocab=torch.arange(0, 4096), noise=0.0, gamma=7, rank=16, confidence=True)]
    assert nets[0].taps == (2, 15, 28)
    for p in load_prompts("eval", limit=2):
        ids, _ = encode(tok, p["turns"][0])
        ref = generate(model, ids, max_new_tokens=32).tokens[0]
        for net, th in ((nets[0], None), (nets[1], 0.2)):
            assert speculative_generate(model, BlockDrafter(model, net, threshold=th), ids,
                                        max_new_tokens=32).tokens[0] == ref


def test_warm_start_refuses_a_markov_head_of_another_vocabulary(deep, tmp_path):
    """DSpark's Markov head holds a row per draft token: a checkpoint over other tokens cannot be continued (the
    rows would belong to other tokens), while the same vocabulary warm-starts every tensor."""
    from specbook.training import warm_start

    net = _net(deep, rank=8, confidence=True)
    trained = DSparkObjective(deep, net.vocab, gamma=4, layers=2, anchors=1, markov_rank=8)
    trained.net.load_state_dict(net.state_dict())
    card = {"kind": "dspark", "config": trained.card_config(), "target": "tiny", "target_fingerprint": fingerprint(deep),
            "steps": 5, "corpus_sha": "abc"}
    save_checkpoint(tmp_path / "d", trained.state(), card, dtype=torch.float32)
    same = DSparkObjective(deep, net.vocab, gamma=4, layers=2, anchors=1, markov_rank=8)
    assert warm_start(same, tmp_path / "d", deep)["vocab_changed"] is False
    assert all(torch.equal(same.state()[k], v) for k, v in trained.state().items())
    other = DSparkObjective(deep, net.vocab + 1, gamma=4, layers=2, anchors=1, markov_rank=8)
    with pytest.raises(CheckpointError, match="row per draft token.*--keep-vocab"):
        warm_start(other, tmp_path / "d", deep)
    kept = DSparkObjective(deep, checkpoint_vocab(tmp_path / "d"), gamma=4, layers=2, anchors=1, markov_rank=8)
    assert torch.equal(kept.net.vocab, net.vocab)  # --keep-vocab: the checkpoint's tokens, in its draft order
    assert warm_start(kept, tmp_path / "d", deep)["vocab_changed"] is False


@pytest.mark.parametrize("cached", [False, True])
def test_teacher_of_overlapping_blocks_is_each_positions_own(deep, cached):
    """Blocks overlap when a window trains many anchors; the teacher is computed once per window row, and every
    block position still reads p_k = softmax(lm_head(final state at a + k - 1)) restricted to the draft vocabulary.
    ``cached``: the batch carries the target's per-token (lse, argmax) (features.load_or_build_teacher), which the
    objective reads instead of the full-vocabulary logits."""
    from specbook.features import teacher_stats

    net = _net(deep)
    obj = DFlashObjective(deep, net.vocab, gamma=4, layers=2, anchors=12)
    b = _batch(deep, n=2, S=24)
    if cached:
        b = Batch(b.tokens, b.feats, b.mask, *teacher_stats(b.feats[:, :, len(net.taps)], obj.W_full))
    anchors, valid = obj._anchors(b, heldout=True)  # evenly spaced: the same blocks as _forward's
    f = obj._forward(b, heldout=True)
    rows = [(i, int(a)) for i in range(2) for a, v in zip(anchors[i], valid[i]) if v]
    assert len({(i, a + k) for i, a in rows for k in range(4)}) < 4 * len(rows)  # blocks share rows: dedup exercised
    for r, (i, a) in enumerate(rows):
        for k in range(1, 5):
            full = b.feats[i, a + k - 1, len(net.taps)].float() @ obj.W_full.T  # the final state, after the taps
            torch.testing.assert_close(f["p_v"][r, k - 1], torch.softmax(full, -1)[net.vocab], atol=1e-6, rtol=1e-5)
            want = net.t2d[full.argmax()]
            assert int(f["t_arg_in"][r, k - 1]) == (-1 if want == len(net.vocab) else int(want))
    if cached:  # the cached argmax is what the objective reads: shifting it moves t_arg_in
        shifted = obj._forward(Batch(b.tokens, b.feats, b.mask, b.lse, (b.t_arg + 1) % 48), heldout=True)
        assert not torch.equal(shifted["t_arg_in"], f["t_arg_in"])


def test_warm_start_may_change_the_anchors_per_window_but_not_the_block(deep, tmp_path):
    """Anchors per window shape the training only: a continued run may train more blocks per window; a gamma or a
    Markov rank the weights were not built for is refused."""
    from specbook.training import warm_start

    trained = DSparkObjective(deep, _net(deep).vocab, gamma=4, layers=2, anchors=1, markov_rank=8)
    card = {"kind": "dspark", "config": trained.card_config(), "target": "tiny", "target_fingerprint": fingerprint(deep),
            "steps": 5, "corpus_sha": "abc"}
    save_checkpoint(tmp_path / "d", trained.state(), card, dtype=torch.float32)
    more = DSparkObjective(deep, trained.net.vocab, gamma=4, layers=2, anchors=16, markov_rank=8)
    assert more.card_config()["anchors_per_window"] == 16
    warm_start(more, tmp_path / "d", deep)
    assert all(torch.equal(more.state()[k], v) for k, v in trained.state().items())
    for kw in ({"gamma": 3, "markov_rank": 8}, {"gamma": 4, "markov_rank": 4}):
        with pytest.raises(CheckpointError, match="has config"):
            warm_start(DSparkObjective(deep, trained.net.vocab, layers=2, anchors=16, **kw), tmp_path / "d", deep)


def test_keep_vocab_needs_a_checkpoint_with_a_draft_vocabulary(deep, tmp_path):
    from specbook.drafters.eagle import EagleObjective
    from specbook.train import _head_vocab

    with pytest.raises(SystemExit, match="--init"):
        _head_vocab(argparse.Namespace(keep_vocab=True, init=None, vocab=8192))
    full = EagleObjective(deep, vocab=None)  # drafts over the whole target vocabulary: its checkpoint stores none
    card = {"kind": "eagle", "config": full.card_config(), "target": "tiny", "target_fingerprint": fingerprint(deep)}
    save_checkpoint(tmp_path / "f", full.state(), card, dtype=torch.float32)
    with pytest.raises(CheckpointError, match="full vocabulary"):
        checkpoint_vocab(tmp_path / "f")
