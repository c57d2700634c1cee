"""Gloeckle's parallel heads trained with the trunk (drafters/parallel_heads.py): the manual trunk equals the
model, the one-head-at-a-time backward equals the summed loss, self-speculation is lossless and greedy-exact."""
import pytest
import torch

from specbook.decoding import generate, speculative_generate
from specbook.drafters.parallel_heads import SelfSpecDrafter, ToyConfig, ToyMTP, ToyObjective, load_toy, toy_vocab
from specbook.exactness import check_lossless
from specbook.sampling import SamplingConfig
from specbook.training import Batch, CheckpointError, save_checkpoint


def _toy(vocab=11, heads=3, noise=0.0, seed=0):
    cfg = ToyConfig(vocab=vocab, hidden=32, layers=2, heads=heads, attn_heads=2, max_positions=128)
    m = ToyMTP(cfg, torch.arange(vocab) * 2, seed=seed)  # even target ids are in the vocabulary
    if noise:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise)
    return m.float()


def _batch(m, B=3, S=12):
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 2 * m.cfg.vocab, (B, S), generator=g)
    return Batch(toks, torch.zeros(B, S, 1, 0), torch.rand(B, S, generator=g) > 0.3)


def test_vocabulary_map():
    m = _toy()
    assert m.to_toy(torch.tensor([0, 2, 20, 1, 21, 99])).tolist() == [0, 1, 10, 11, 11, 11]  # odd / large -> other
    assert toy_vocab([5, 5, 5, 2, 2, 9], 2).tolist() == [2, 5]


def test_trunk_plus_head_one_is_the_model():
    m = _toy(noise=0.1)
    ids = torch.randint(0, 12, (2, 9), generator=torch.Generator().manual_seed(1))
    z, pe = m.trunk(ids)
    torch.testing.assert_close(m.head_logits(0, z, pe), m.lm(ids).logits)
    torch.testing.assert_close(z, m.lm(ids, output_hidden_states=True).hidden_states[m.cfg.layers - 1])


def test_one_head_at_a_time_equals_the_summed_loss():
    m = _toy(noise=0.1)
    b = _batch(m)
    obj = ToyObjective(m)
    loss, info = obj.loss(b)
    loss.backward()
    got = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    toks = m.to_toy(b.tokens)
    z, pe = m.trunk(toks)
    ce = torch.nn.functional.cross_entropy
    want = 0
    for i in range(3):
        msk = b.mask[:, i:-1]
        want = want + ce(m.head_logits(i, z, pe)[:, :12 - 1 - i][msk], toks[:, i + 1:][msk])
    torch.testing.assert_close(loss, want.detach())
    want.backward()
    assert got.keys() == {k for k, p in m.named_parameters() if p.grad is not None}
    for k, p in m.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[k], p.grad, rtol=1e-4, atol=1e-6)
    assert info["ce1"] > 0


def test_self_speculation_greedy_equals_ar():
    m = _toy(noise=0.2)
    for seed in range(3):
        ids = torch.randint(0, 12, (1, 4 + seed), generator=torch.Generator().manual_seed(seed))
        res = speculative_generate(m.lm, SelfSpecDrafter(m), ids, max_new_tokens=16, eos_token_id=-1)
        assert res.tokens[0] == generate(m.lm, ids, max_new_tokens=16, eos_token_id=-1).tokens[0]
        assert res.stats.draft_forwards > 0


@pytest.mark.parametrize("depth", [1, 2])
def test_self_speculation_is_lossless(depth):
    m = _toy(vocab=3, heads=3, noise=0.4, seed=2)  # 4 ids: exact joint of 3 tokens
    res = check_lossless(m.lm, SelfSpecDrafter(m, depth=depth), [0, 3, 2, 1], SamplingConfig(1.0), n=1500, k=3, seed=1)
    assert res.ok, res


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match=r"depth must be an int in \[1, 2\]"):
        SelfSpecDrafter(_toy(), depth=3)
    with pytest.raises(ValueError, match="no extra heads"):
        SelfSpecDrafter(_toy(heads=1))
    with pytest.raises(ValueError, match="layers must be >= 2"):
        ToyConfig(layers=1)
    m = _toy()
    save_checkpoint(tmp_path / "t", ToyObjective(m).state(), {"kind": "toy_mtp", "config": ToyObjective(m).card_config()},
                    dtype=torch.float32)
    back, _ = load_toy(tmp_path / "t")
    assert back.to_toy(torch.tensor([4])).tolist() == [2]
    (tmp_path / "t.safetensors").write_bytes(b"broken")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_toy(tmp_path / "t")


def test_bench_runs_self_speculation_against_the_toys_own_ar():
    from specbook import bench
    from specbook.drafters.parallel_heads import ToyTokenizer

    class Tok:  # a target tokenizer with a chat template: characters -> ids (odd ids fall outside the toy vocab)
        chat_template = "chars"
        eos_token_id, pad_token_id = 1, 0

        def apply_chat_template(self, messages, **kw):
            return [ord(c) % 22 for c in messages[0]["content"]]

        def decode(self, ids, **kw):
            return "".join(chr(97 + i) for i in ids)

    m = _toy(noise=0.2)
    tt = ToyTokenizer(Tok(), m)
    assert tt.apply_chat_template([{"content": "ab"}]) == [11, 5]  # 97 % 22 = 9 is odd: other; 98 % 22 = 10 -> 5
    assert tt.decode([1, 11]) == "c\ufffd"
    res = bench.run_bench(["self_spec"], [{"turns": ["abc"], "category": "x"}, {"turns": ["hello"], "category": "y"}],
                          model=m.lm, tokenizer=tt, max_new_tokens=8, progress=False, loaded=bench.Loaded(toy=m))
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["ar"]["tau"] == 1.0 and rows["self_spec"]["tau"] >= 1.0 and rows["self_spec"]["new_tokens"] > 0
    bp = res["by_prompt"]  # each prompt's counts (what the results page's paired intervals resample), in prompt order
    assert bp["categories"] == ["x", "y"]
    for name in ("ar", "self_spec"):
        cat = {r["category"]: r for r in res["by_category"] if r["method"] == name}
        for k in ("new_tokens", "target_forwards"):
            assert bp["methods"][name][k] == [cat["x"][k], cat["y"][k]] and sum(bp["methods"][name][k]) == rows[name][k]
    with pytest.raises(ValueError, match="toy MTP model"):
        bench.run_bench(["self_spec"], [{"turns": ["abc"]}], model=m.lm, tokenizer=tt, max_new_tokens=4, progress=False)
