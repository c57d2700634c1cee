"""DeepSeek-V3 MTP modules (drafters/mtp.py): the causal chain across modules, the loss, the drafter's caches
against a from-scratch recompute, greedy equality with AR, bad input. Losslessness at T > 0: test_lossless.py."""
import pytest
import torch

from specbook.decoding import generate, speculative_generate
from specbook.drafters.mtp import MTPDrafter, MTPModules, MTPObjective, load_mtp
from specbook.training import CheckpointError, save_checkpoint


def _random_modules(target, depth=3, scale=0.2, seed=0):
    torch.manual_seed(seed)
    mods = MTPModules(target.config, depth)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in mods.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return mods.eval()


def _logits(target, h):
    return target.model.norm(h) @ target.get_output_embeddings().weight.T


@torch.no_grad()
def reference_draft(target, mods, tokens: list[int], depth: int, feed_h0: bool = False) -> list[int]:
    """Greedy draft from scratch, by the paper's equations: module k at positions 0..n-2 reads h^{k-1} and
    t_{i+k} (drafted tokens beyond the committed ones). ``feed_h0``: the broken variant where every module
    reads the target's hidden state instead of the previous module's output."""
    n = len(tokens)
    h0 = target(torch.tensor([tokens[:n - 1]]), output_hidden_states=True).hidden_states[-1]  # [1, n-1, H]
    seq, h = list(tokens), h0
    for k in range(1, depth + 1):
        emb = target.get_input_embeddings()(torch.tensor([seq[k:n - 1 + k]]))
        h = mods.mods[k - 1](h0 if feed_h0 else h, emb)
        seq.append(int(_logits(target, h[0, -1]).argmax()))
    return seq[n:]


def test_drafter_caches_equal_a_recompute_and_the_chain_matters(tiny):
    """Every step's draft (incremental caches, tails, crops) equals the paper's equations run from scratch on the
    committed tokens; feeding the target's hidden state to every module (no chain) drafts something else."""
    mods = _random_modules(tiny)
    drafter = MTPDrafter(tiny, mods)
    seen, differs = [], 0
    orig = drafter.propose

    def checked(state):
        draft = orig(state)
        want = reference_draft(tiny, mods, state.tokens, 3)
        assert draft.tokens.tolist() == want, f"step {len(seen)}"
        seen.append(want)
        return draft

    drafter.propose = checked
    for seed in range(4):
        ids = torch.randint(1, tiny.config.vocab_size, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        res = speculative_generate(tiny, drafter, ids, max_new_tokens=20)
        assert res.tokens[0] == generate(tiny, ids, max_new_tokens=20).tokens[0]
    for tokens in ([1, 2, 3, 4, 5], [7, 3, 9, 11, 2, 8], [5, 5, 1, 20, 31, 4, 9]):
        differs += reference_draft(tiny, mods, tokens, 3) != reference_draft(tiny, mods, tokens, 3, feed_h0=True)
    assert len(seen) > 8 and differs >= 2


def test_one_token_prompt_drafts_nothing_then_catches_up(tiny):
    drafter = MTPDrafter(tiny, _random_modules(tiny))
    ids = torch.tensor([[3]])
    assert speculative_generate(tiny, drafter, ids, max_new_tokens=12).tokens[0] == \
        generate(tiny, ids, max_new_tokens=12).tokens[0]


def test_loss_is_the_mean_of_the_per_depth_cross_entropies(tiny, tiny_feature_batch):
    obj = MTPObjective(tiny, depth=2)
    b = tiny_feature_batch
    loss, info = obj.loss(b)
    emb = tiny.get_input_embeddings()(b.tokens).float()
    h1 = obj.modules.mods[0](b.feats[:, :-1, 0], emb[:, 1:])  # position i predicts token i + 2
    h2 = obj.modules.mods[1](h1[:, :-1], emb[:, 2:])  # position i predicts token i + 3
    ce = torch.nn.functional.cross_entropy
    ce1 = ce(_logits(tiny, h1[:, :-1]).flatten(0, 1), b.tokens[:, 2:].flatten())
    ce2 = ce(_logits(tiny, h2[:, :-1]).flatten(0, 1), b.tokens[:, 3:].flatten())
    torch.testing.assert_close(loss, (ce1 + ce2) / 2)
    assert abs(info["ce1"] - ce1.item()) < 1e-5 and abs(info["ce2"] - ce2.item()) < 1e-5


def test_reduced_vocabulary_leaves_unknown_labels_out(tiny, tiny_feature_batch, fit):
    vocab = torch.arange(0, tiny.config.vocab_size, 2)  # even ids only
    obj = MTPObjective(tiny, depth=2, vocab=vocab)
    (_, l1), *_ = obj._per_depth(tiny_feature_batch)
    assert ((l1 >= 0) == (tiny_feature_batch.tokens[:, 2:].flatten() % 2 == 0)).all()
    first, last = fit(obj, tiny_feature_batch, lr=3e-3, steps=40)
    assert last < 0.5 * first  # the modules learn through the loop's loss


def test_bad_input(tiny, tmp_path):
    mods = _random_modules(tiny, depth=2)
    with pytest.raises(ValueError, match="needs 3 MTP modules but the checkpoint has 2"):
        MTPDrafter(tiny, mods, depth=3)
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        MTPDrafter(tiny, mods, depth=0)
    with pytest.raises(ValueError, match="number of MTP modules must be an int >= 1"):
        MTPModules(tiny.config, 0)
    obj = MTPObjective(tiny, depth=2)
    from specbook.models import fingerprint, tiny_llama

    card = {"kind": "mtp", "config": obj.card_config(), "target": "tiny", "target_fingerprint": fingerprint(tiny)}
    save_checkpoint(tmp_path / "m", obj.state(), card, dtype=torch.float32)
    loaded, vocab, _ = load_mtp(tiny, tmp_path / "m")
    assert loaded.depth == 2 and vocab is None
    other = tiny_llama(seed=9)
    with pytest.raises(CheckpointError, match="trained for target"):
        load_mtp(other, tmp_path / "m")
    (tmp_path / "m.safetensors").write_bytes((tmp_path / "m.safetensors").read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_mtp(tiny, tmp_path / "m")


@pytest.mark.slow
def test_real_model_mtp_greedy_equals_ar(real):
    """Greedy MTP drafting on SmolLM2 in fp32 emits exactly our AR loop's tokens: the committed modules when
    they exist, random ones otherwise (equality does not depend on the draft's quality)."""
    from specbook.decoding import encode
    from specbook.prompts import load_prompts
    from specbook.train import CKPT_DIR

    model, tok = real
    if (CKPT_DIR / "mtp.json").exists():
        mods, vocab, _ = load_mtp(model, CKPT_DIR / "mtp")
    else:
        mods, vocab = _random_modules(model, depth=2, scale=0.0), None
    for i, p in enumerate(load_prompts("eval", limit=4)):
        ids, _ = encode(tok, p["turns"][0])
        drafter = MTPDrafter(model, mods, vocab, depth=1 + i % mods.depth)
        assert speculative_generate(model, drafter, ids, max_new_tokens=48).tokens[0] == \
            generate(model, ids, max_new_tokens=48).tokens[0], p["question_id"]
