"""EAGLE-3 (drafters/eagle3.py): feature taps, the training-time-test attention, d2t / t2d, the drafter against
AR, bad input. Losslessness at T > 0: test_lossless.py."""
import pytest
import torch

from specbook.decoding import generate, speculative_generate
from specbook.drafters.eagle3 import Eagle3Drafter, Eagle3Head, Eagle3Objective, check_eos, default_taps, load_eagle3, vocab_maps
from specbook.models import tiny_llama
from specbook.training import Batch, CheckpointError, save_checkpoint


@pytest.fixture(scope="module")
def deep():
    """A tiny random Llama with 8 layers: taps 2, 4, 5."""
    return tiny_llama(vocab_size=48, hidden_size=32, layers=8, seed=1)


def _head(target, vocab=None, noise=0.3, seed=0, taps=None):
    torch.manual_seed(seed)
    vocab = torch.arange(0, target.config.vocab_size, 2) if vocab is None else vocab
    head = Eagle3Head(target.config, vocab, taps)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return head.eval()


def test_taps_are_the_states_entering_layers_2_mid_and_L_minus_3(deep):
    """What the drafter reads (hidden_states[l] for its taps) is what enters decoder layers 2, L/2 and L-3,
    caught with forward pre-hooks on the target: the off-by-one that silently ruins acceptance."""
    assert default_taps(30) == (2, 15, 27) and default_taps(8) == (2, 4, 5)
    drafter = Eagle3Drafter(deep, _head(deep), depth=2, top_k=2, total_tokens=4)
    seen = {}
    hooks = [deep.model.layers[t].register_forward_pre_hook(
        lambda m, a, kw, t=t: seen.__setitem__(t, (a[0] if a else kw["hidden_states"]).detach()), with_kwargs=True)
        for t in drafter.hidden_layers]
    ids = torch.randint(0, 48, (1, 7), generator=torch.Generator().manual_seed(0))
    out = deep(ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    for t in drafter.hidden_layers:
        torch.testing.assert_close(out.hidden_states[t], seen[t])


def test_ttt_attention_against_a_hand_written_mask():
    """Steps 0..3 on 4 positions: query (step i, position j) sees step-0 keys at positions <= j and its own
    position's keys of steps 1..i — checked against plain masked attention over all 16 keys."""
    from specbook.drafters.eagle3 import Eagle3Attention

    cfg = tiny_llama(hidden_size=16, layers=1).config
    att = Eagle3Attention(cfg)
    g = torch.Generator().manual_seed(0)
    B, S, hd = 1, 4, att.hd
    ks = [torch.randn(B, att.nkv, S, hd, generator=g) for _ in range(4)]
    vs = [torch.randn(B, att.nkv, S, hd, generator=g) for _ in range(4)]
    q = torch.randn(B, att.nh, S, hd, generator=g)
    rep = att.nh // att.nkv
    K = torch.cat(ks, 2).repeat_interleave(rep, 1)  # keys ordered (step, position): index 4 * s + p
    Vv = torch.cat(vs, 2).repeat_interleave(rep, 1)
    for i in range(4):
        allowed = torch.zeros(S, 4 * S, dtype=torch.bool)
        for j in range(S):
            allowed[j, :j + 1] = True  # step-0 keys, causal
            for s in range(1, i + 1):
                allowed[j, 4 * s + j] = True  # its own position at steps 1..i
        want = torch.softmax((q @ K.transpose(-1, -2) * att.scale).masked_fill(~allowed, float("-inf")), -1) @ Vv
        got = att.ttt(q, ks[0], vs[0], list(zip(ks[1:i + 1], vs[1:i + 1])))
        torch.testing.assert_close(got, want)


def test_unrolled_step_equals_drafting_with_a_cache(deep):
    """Step i of the training-time test at position j equals the inference path: the committed prefix 0..j
    through the cache, then i single-node draft steps reading the head's own states."""
    from transformers import DynamicCache

    head = _head(deep)
    H = deep.config.hidden_size
    g = torch.Generator().manual_seed(2)
    S, steps = 6, 4
    emb = torch.randn(1, S + steps - 1, H, generator=g)
    fused = torch.randn(1, S, 3 * H, generator=g)
    outs = head.unroll(emb, fused, steps)
    for j in (0, 3, 5):
        cache = DynamicCache(config=head.config)
        h = head(emb[:, :j + 1], head.fc(fused[:, :j + 1]), position_ids=torch.arange(j + 1)[None], cache=cache)
        torch.testing.assert_close(h[:, -1], outs[0][:, j], rtol=1e-4, atol=1e-5)
        h = h[:, -1:]
        for i in range(1, steps):
            h = head(emb[:, j + i:j + i + 1], h, position_ids=torch.tensor([[j + i]]), cache=cache)
            torch.testing.assert_close(h[:, 0], outs[i][:, j], rtol=1e-3, atol=2e-4)  # float rounding only


def test_vocab_maps_round_trip():
    vocab = torch.tensor([0, 3, 4, 9, 17])
    d2t, t2d = vocab_maps(vocab, 20)
    assert (torch.arange(5) + d2t).tolist() == vocab.tolist()  # offsets, not ids
    assert d2t.tolist() != vocab.tolist()
    assert t2d.nonzero().flatten().tolist() == vocab.tolist() and t2d.dtype == torch.bool


def test_draft_token_is_the_target_id_of_its_lm_head_row(deep):
    """Objective init copies the target's LM head rows: draft index i's row is the target row of id vocab[i]."""
    vocab = torch.tensor([1, 5, 6, 20, 33])
    obj = Eagle3Objective(deep, vocab, ttt_steps=2)
    torch.testing.assert_close(obj.head.lm_head.weight, deep.get_output_embeddings().weight[vocab])
    assert obj.head.vocab.tolist() == vocab.tolist()


def test_drafter_greedy_equals_ar(deep):
    head = _head(deep)
    for seed in range(3):
        ids = torch.randint(0, 48, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        d = Eagle3Drafter(deep, head, depth=3, top_k=2, total_tokens=6)
        res = speculative_generate(deep, d, ids, max_new_tokens=16, eos_token_id=-1)
        assert res.tokens[0] == generate(deep, ids, max_new_tokens=16, eos_token_id=-1).tokens[0]


def test_objective_learns_and_masks_out_of_vocab_targets(deep, fit):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 48, (4, 16), generator=g)
    with torch.no_grad():
        hs = deep(tokens, output_hidden_states=True).hidden_states
    feats = torch.stack([hs[t] for t in default_taps(8)] + [hs[-1]], dim=2)
    batch = Batch(tokens, feats, torch.ones(4, 16, dtype=torch.bool))
    obj = Eagle3Objective(deep, torch.arange(0, 48, 2), ttt_steps=3)
    for logits, p, ok, _ in obj._steps(batch, 3):
        assert logits.shape[1] == 24 and p.shape == logits.shape and ok.dtype == torch.bool
    f = feats[:, :, 3].float() @ deep.get_output_embeddings().weight.T
    assert obj._targets(batch)[1].tolist() == (f.argmax(-1) % 2 == 0).tolist()  # target argmax in the even ids
    first, last = fit(obj, batch, lr=3e-3, steps=30)
    assert last < 0.7 * first
    ev = obj.evaluate(batch, steps=3)
    assert set(ev) >= {"acc_0", "acc_1", "acc_2", "top1", "mean_acc", "conf_r0", "soft_r0"}


def test_a_cached_teacher_gives_the_same_targets_loss_and_metrics(deep):
    """A batch carrying the target's per-token (lse, argmax) (features.load_or_build_teacher) trains and evaluates
    as one whose objective computes them from the final state; the teacher is softmax over the full vocabulary read
    on the draft tokens, and renormalized there."""
    from specbook.features import teacher_stats

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 48, (3, 16), generator=g)
    with torch.no_grad():
        hs = deep(tokens, output_hidden_states=True).hidden_states
    feats = torch.stack([hs[t] for t in default_taps(8)] + [hs[-1]], dim=2)
    mask = torch.ones(3, 16, dtype=torch.bool)
    obj = Eagle3Objective(deep, torch.arange(0, 48, 2), ttt_steps=3)
    lse, arg = teacher_stats(feats[:, :, 3], obj.W_full)
    plain, cached = Batch(tokens, feats, mask), Batch(tokens, feats, mask, lse, arg)
    full = feats[:, :, 3].float() @ obj.W_full.T
    p_d, ok, p_v = obj._targets(cached)
    torch.testing.assert_close(p_v, torch.softmax(full, -1)[..., 0::2], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(p_d, torch.softmax(full[..., 0::2], -1), atol=1e-6, rtol=1e-5)
    assert torch.equal(ok, obj._targets(plain)[1])
    torch.testing.assert_close(obj.loss(cached)[0], obj.loss(plain)[0])
    assert obj.evaluate(cached, steps=3) == pytest.approx(obj.evaluate(plain, steps=3), abs=1e-6)
    shifted = Batch(tokens, feats, mask, lse, (arg + 1) % 48)  # the cached argmax is what it reads: odd ids fall outside
    assert not torch.equal(obj._targets(shifted)[1], ok)


def test_bad_input(deep, tmp_path):
    with pytest.raises(ValueError, match="3 layers of the target"):
        Eagle3Head(deep.config, torch.arange(4), taps=(2, 4, 9))
    with pytest.raises(ValueError, match="sorted, distinct"):
        Eagle3Head(deep.config, torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="misses the EOS"):
        check_eos(torch.tensor([0, 1, 2]), [7])
    obj = Eagle3Objective(deep, torch.arange(0, 48, 2), ttt_steps=2)
    from specbook.models import fingerprint

    card = {"kind": "eagle3", "config": obj.card_config(), "target_fingerprint": fingerprint(deep)}
    save_checkpoint(tmp_path / "e3", obj.state(), card, dtype=torch.float32)
    head, _ = load_eagle3(deep, tmp_path / "e3")
    assert head.vocab.tolist() == list(range(0, 48, 2))
    with pytest.raises(CheckpointError, match="trained for target"):
        load_eagle3(tiny_llama(vocab_size=48, hidden_size=32, layers=8, seed=9), tmp_path / "e3")
    shallow = tiny_llama(vocab_size=48, hidden_size=32, layers=4, seed=1)
    card["target_fingerprint"] = fingerprint(shallow)
    card["config"] = {**card["config"], "num_hidden_layers_target": 4}
    save_checkpoint(tmp_path / "e3s", obj.state(), card, dtype=torch.float32)
    with pytest.raises(CheckpointError, match="taps layers"):
        load_eagle3(shallow, tmp_path / "e3s")


@pytest.mark.slow
def test_real_model_eagle3_greedy_equals_ar(real):
    """A random EAGLE-3 head on SmolLM2 (taps 2, 15, 27) in fp32: greedy output equals our AR loop's."""
    from specbook.decoding import encode
    from specbook.prompts import load_prompts

    model, tok = real
    head = _head(model, vocab=torch.arange(0, 4096), noise=0.0)
    assert head.taps == (2, 15, 27)
    for p in load_prompts("eval", limit=2):
        ids, _ = encode(tok, p["turns"][0])
        d = Eagle3Drafter(model, head, depth=4, top_k=4, total_tokens=8)
        assert speculative_generate(model, d, ids, max_new_tokens=32).tokens[0] == \
            generate(model, ids, max_new_tokens=32).tokens[0]


def test_warm_start_refuses_another_draft_vocabulary(deep, tmp_path):
    """EAGLE-3's LM head has a row per draft token (mapped by d2t): a checkpoint over other tokens cannot be
    continued; the same vocabulary warm-starts every tensor."""
    from specbook.models import fingerprint
    from specbook.training import warm_start

    trained = Eagle3Objective(deep, torch.arange(0, 48, 2), ttt_steps=2)
    card = {"kind": "eagle3", "config": trained.card_config(), "target": "tiny", "target_fingerprint": fingerprint(deep),
            "steps": 5, "corpus_sha": "abc"}
    save_checkpoint(tmp_path / "e3", trained.state(), card, dtype=torch.float32)
    same = Eagle3Objective(deep, torch.arange(0, 48, 2), ttt_steps=2)
    with torch.no_grad():
        same.head.fc.weight.zero_()
    assert warm_start(same, tmp_path / "e3", deep)["vocab_changed"] is False
    assert all(torch.equal(same.state()[k], v) for k, v in trained.state().items())
    with pytest.raises(CheckpointError, match="row per draft token.*--keep-vocab"):
        warm_start(Eagle3Objective(deep, torch.arange(1, 48, 2), ttt_steps=2), tmp_path / "e3", deep)


def test_keep_vocab_reads_the_ids_back_from_d2t(deep, tmp_path):
    """--keep-vocab: the target ids an EAGLE-3 checkpoint drafts from, rebuilt from its d2t offsets in draft-index
    order, build a head that warm-starts from it with every tensor (the vocabulary unchanged)."""
    from specbook.models import fingerprint
    from specbook.training import checkpoint_vocab, warm_start

    ids = torch.tensor([0, 2, 5, 7, 30, 41])  # sorted: EAGLE-3 maps draft index i to id i + d2t[i]
    trained = Eagle3Objective(deep, ids, ttt_steps=2)
    card = {"kind": "eagle3", "config": trained.card_config(), "target": "tiny", "target_fingerprint": fingerprint(deep),
            "steps": 5, "corpus_sha": "abc"}
    save_checkpoint(tmp_path / "e3", trained.state(), card, dtype=torch.float32)
    kept = checkpoint_vocab(tmp_path / "e3")
    again = Eagle3Objective(deep, kept, ttt_steps=2)
    assert warm_start(again, tmp_path / "e3", deep)["vocab_changed"] is False
    assert all(torch.equal(again.state()[k], v) for k, v in trained.state().items())
