import pytest
import torch

from specbook.decoding import generate, pad_left
from specbook.sampling import SamplingConfig, make_generator

PROMPTS_TINY = [[0, 5, 9, 11], [0, 7], [0, 3, 3, 3, 8, 2, 4], [0, 12, 40]]


def hf_greedy(model, ids, mask, n):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=model.config.pad_token_id,
                         eos_token_id=None)
    return out[:, ids.shape[1]:].tolist()


def test_tiny_greedy_matches_transformers(tiny):
    for p in PROMPTS_TINY:
        ids, mask = pad_left([p], pad_id=1)
        ours = generate(tiny, ids, mask, max_new_tokens=12, eos_token_id=-1).tokens
        assert ours == hf_greedy(tiny, ids, mask, 12)


def test_batch_with_left_padding_equals_rows_alone(tiny):
    ids, mask = pad_left(PROMPTS_TINY, pad_id=1)
    batched = generate(tiny, ids, mask, max_new_tokens=10, eos_token_id=-1).tokens
    for p, row in zip(PROMPTS_TINY, batched):
        alone = generate(tiny, *pad_left([p], pad_id=1), max_new_tokens=10, eos_token_id=-1).tokens[0]
        assert row == alone


def test_eos_stops_each_row(tiny):
    ids, mask = pad_left(PROMPTS_TINY, pad_id=1)
    free = generate(tiny, ids, mask, max_new_tokens=10, eos_token_id=-1).tokens
    eos = free[0][3]
    res = generate(tiny, ids, mask, max_new_tokens=10, eos_token_id=eos)
    for full, row in zip(free, res.tokens):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert row == full[:cut]
    assert res.stats.new_tokens == sum(len(r) for r in res.tokens)


def test_sampling_is_reproducible(tiny):
    ids, mask = pad_left(PROMPTS_TINY, pad_id=1)
    cfg = SamplingConfig(temperature=1.0, top_p=0.9)
    a = generate(tiny, ids, mask, max_new_tokens=16, sampling=cfg, generator=make_generator(5), eos_token_id=-1).tokens
    b = generate(tiny, ids, mask, max_new_tokens=16, sampling=cfg, generator=make_generator(5), eos_token_id=-1).tokens
    c = generate(tiny, ids, mask, max_new_tokens=16, sampling=cfg, generator=make_generator(6), eos_token_id=-1).tokens
    assert a == b and a != c


def test_stats(tiny):
    ids, mask = pad_left([PROMPTS_TINY[0]], pad_id=1)
    res = generate(tiny, ids, mask, max_new_tokens=8, eos_token_id=-1)
    assert res.stats.target_forwards == 8 and len(res.stats.step_times) == 7
    assert res.stats.tau == 1.0 and res.stats.total_time > 0


def test_bad_input(tiny):
    ids, mask = pad_left([PROMPTS_TINY[0]], pad_id=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny, ids, mask, max_new_tokens=0)
    with pytest.raises(ValueError, match="Generator"):
        generate(tiny, ids, mask, sampling=SamplingConfig(temperature=1.0))
    with pytest.raises(ValueError, match="exceeds the model context"):
        generate(tiny, ids, mask, max_new_tokens=10_000)
    with pytest.raises(ValueError, match="exceeds the context"):
        pad_left([[1] * 300], pad_id=1, max_new_tokens=10, max_length=256)
    with pytest.raises(ValueError, match="empty"):
        pad_left([[]], pad_id=1)


@pytest.mark.slow
def test_real_model_greedy_parity_with_transformers(real):
    """Identical greedy tokens to transformers generate(), fp32, 8 eval prompts x 64 tokens."""
    from specbook.decoding import encode
    from specbook.prompts import load_prompts

    model, tok = real
    prompts = load_prompts("eval", limit=8)
    mismatches = []
    for p in prompts:
        ids, mask = encode(tok, p["turns"][0])
        ours = generate(model, ids, mask, max_new_tokens=64, eos_token_id=tok.eos_token_id).tokens[0]
        out = model.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
        theirs = out[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in theirs:
            theirs = theirs[: theirs.index(tok.eos_token_id) + 1]
        if ours != theirs:
            mismatches.append(p["question_id"])
    assert not mismatches, f"greedy tokens differ from transformers on {mismatches}"


@pytest.mark.slow
def test_real_model_sampling_reproducible(real):
    from specbook.decoding import encode

    model, tok = real
    ids, mask = encode(tok, ["Tell me a story about a fox.", "Name three colours."])
    cfg = SamplingConfig(temperature=0.8, top_p=0.95)
    a = generate(model, ids, mask, max_new_tokens=24, sampling=cfg, generator=make_generator(11)).tokens
    b = generate(model, ids, mask, max_new_tokens=24, sampling=cfg, generator=make_generator(11)).tokens
    assert a == b


def test_finished_rows_are_dropped_without_changing_any_row(tiny, monkeypatch):
    """Twelve rows ending at different steps (several EOS ids): each row equals its free run cut at its first EOS,
    while finished rows leave the batch (and its cache) along the way."""
    from transformers import DynamicCache

    drops = []
    orig = DynamicCache.batch_select_indices
    monkeypatch.setattr(DynamicCache, "batch_select_indices", lambda self, idx: drops.append(len(idx)) or orig(self, idx))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 48, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(12)]
    ids, mask = pad_left(prompts, pad_id=1)
    free = generate(tiny, ids, mask, max_new_tokens=24, eos_token_id=-1).tokens
    eos = sorted({r[k] for r in free for k in (2, 7)})[:4]  # tokens the rows hit early and late
    res = generate(tiny, ids, mask, max_new_tokens=24, eos_token_id=eos)
    ends = []
    for full, row in zip(free, res.tokens):
        cut = min([full.index(e) + 1 for e in eos if e in full] + [len(full)])
        assert row == full[:cut]
        ends.append(cut)
    assert len(set(ends)) > 3 and min(ends) < 12  # rows really finished at different times, some early
    assert drops and drops == sorted(drops, reverse=True)  # the batch shrank, more than once or at least once
