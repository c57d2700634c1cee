"""The static-cache fast path (fastpath.py): the same numbers as transformers' forward, rollback that equals
recomputation, every loop's tokens unchanged, compiled graphs that agree with the eager reference, clear errors."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specbook.cache import crop_to, keep_positions
from specbook.decoding import generate, new_cache, speculative_generate
from specbook.fastpath import FastTarget, StaticKVCache, allowed_mask, fast_target
from specbook.models import cache_kw, tiny_llama
from specbook.sampling import SamplingConfig
from specbook.tree import block_inputs
from test_lossless import DRAFTERS, PROMPT, VOCAB


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=48, hidden_size=32, layers=2, seed=0)


def _hf(model, cache, **kw):
    with torch.no_grad():
        return model(**cache_kw(cache), use_cache=True, **kw)


def test_eager_forward_equals_transformers_exactly(model):
    """Prefill, a causal block with explicit positions and a tree block (4D mask): logits and every hidden state
    bit-for-bit equal to transformers' forward with its dynamic cache (fp32: same modules, same order)."""
    fast = FastTarget(model, compile=False)
    ids = torch.randint(48, (1, 12), generator=torch.Generator().manual_seed(1))
    dyn, sta = new_cache(model), fast.new_cache(64)
    steps = [dict(input_ids=ids), dict(input_ids=ids[:, :4], position_ids=torch.arange(12, 16)[None])]
    parents = torch.tensor([-1, -1, 0, 1, 2])
    mask4d, pos = block_inputs(parents, 16)
    steps.append(dict(input_ids=ids[:, :6], attention_mask=mask4d, position_ids=pos))
    for kw in steps:
        ref = _hf(model, cache=dyn, output_hidden_states=True, **kw)
        out = fast(cache=sta, output_hidden_states=True, **kw)
        assert torch.equal(ref.logits, out.logits)
        assert len(ref.hidden_states) == len(out.hidden_states) == 3
        assert all(torch.equal(a, b) for a, b in zip(ref.hidden_states, out.hidden_states))
    assert sta.get_seq_length() == dyn.get_seq_length() == 22


def test_left_padded_batch_equals_transformers(model):
    """A 2D mask with left padding (plain decoding of a batch): the rows' real positions agree with transformers."""
    fast = FastTarget(model, compile=False)
    ids = torch.tensor([[1, 1, 5, 7, 9], [3, 4, 5, 6, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    ref = _hf(model, new_cache(model), input_ids=ids, attention_mask=mask, position_ids=pos)
    out = fast(input_ids=ids, attention_mask=mask, position_ids=pos, cache=fast.new_cache(16, batch=2))
    real = mask.bool()
    assert torch.allclose(ref.logits[real], out.logits[real], atol=1e-5)


@pytest.mark.parametrize("batch", [1, 2])
def test_rollback_equals_recomputation(model, batch):
    """Chain rollback (crop: moving the length) and tree compaction (the accepted path copied into place): the next
    forward's logits equal those of a cache recomputed from the committed tokens alone."""
    fast = FastTarget(model, compile=False)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(48, (batch, 10), generator=g)
    block = torch.randint(48, (batch, 6), generator=g)
    nxt = torch.randint(48, (batch, 1), generator=g)
    # chain: 6 tokens verified, 2 accepted
    cache = fast.new_cache(32, batch=batch)
    fast(input_ids=ids, cache=cache)
    fast(input_ids=block, cache=cache)
    crop_to(cache, 12)
    got = fast(input_ids=nxt, cache=cache).logits
    fresh = fast.new_cache(32, batch=batch)
    fast(input_ids=torch.cat([ids, block[:, :2]], 1), cache=fresh)
    assert torch.allclose(got, fast(input_ids=nxt, cache=fresh).logits, atol=1e-5)
    # tree: root + 5 nodes, the path root -> node 1 -> node 3 accepted
    parents = torch.tensor([-1, -1, 0, 1, 2])
    cache = fast.new_cache(32, batch=batch)
    fast(input_ids=ids, cache=cache)
    mask4d, pos = block_inputs(parents, 10)
    fast(input_ids=block, attention_mask=mask4d.expand(batch, -1, -1, -1), position_ids=pos.expand(batch, -1),
         cache=cache)
    keep_positions(cache, 11, torch.tensor([1, 3]))
    assert cache.get_seq_length() == 13
    got = fast(input_ids=nxt, cache=cache).logits
    fresh = fast.new_cache(32, batch=batch)
    path = torch.cat([ids, block[:, [0, 2, 4]]], 1)  # the root, then nodes 1 and 3 (block offsets 2 and 4)
    fast(input_ids=path, cache=fresh)
    assert torch.allclose(got, fast(input_ids=nxt, cache=fresh).logits, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 6), st.lists(st.integers(0, 7), unique=True, max_size=8), st.integers(1, 2))
def test_keep_positions_matches_the_dynamic_cache(start, keep, batch):
    """Path compaction on the static cache keeps the same entries, in the same order, as on transformers' cache."""
    keep = torch.tensor(sorted(keep), dtype=torch.long)
    g = torch.Generator().manual_seed(start + len(keep))
    k = torch.randn(batch, 2, start + 8, 4, generator=g)
    v = torch.randn(batch, 2, start + 8, 4, generator=g)
    sta = StaticKVCache(1, batch, 2, 4, 32, torch.float32)
    sta.keys[0][:, :, :start + 8], sta.values[0][:, :, :start + 8] = k, v
    sta.length = start + 8
    from transformers import DynamicCache

    dyn = DynamicCache()
    dyn.update(k.clone(), v.clone(), 0)
    keep_positions(sta, start, keep)
    keep_positions(dyn, start, keep)
    n = start + len(keep)
    assert sta.get_seq_length() == dyn.get_seq_length() == n
    assert torch.equal(sta.keys[0][:, :, :n], dyn.layers[0].keys)
    assert torch.equal(sta.values[0][:, :, :n], dyn.layers[0].values)


def test_allowed_mask_reads_each_mask_form():
    causal = allowed_mask(3, 2, 8, 1, None)[0, 0]
    assert causal[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0] and causal[2].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    holes = allowed_mask(2, 3, 6, 1, torch.tensor([[1, 0, 1, 1, 1]]))[0, 0]
    assert holes[1].tolist() == [1, 0, 1, 1, 1, 0]  # a hole stays invisible
    padded = allowed_mask(2, 3, 8, 1, None, rows=4)[0, 0]
    assert padded[3].tolist() == [0, 0, 0, 0, 0, 0, 1, 0]  # a padding query reads its own slot only
    with pytest.raises(ValueError, match="2D or 4D"):
        allowed_mask(2, 0, 4, 1, torch.ones(1, 1, 2))


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_every_drafter_samples_the_same_tokens_through_the_static_cache(kind):
    """The whole loop at T = 1 with the same generator: the same tokens with the static cache as with transformers'
    dynamic cache (eager, fp32), so the losslessness checks carry over to the fast path."""
    target = tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=3)
    fast = FastTarget(target, compile=False)
    ids = torch.tensor([PROMPT])
    cfg = SamplingConfig(1.0)
    for seed in range(12):
        a = speculative_generate(target, DRAFTERS[kind](target), ids, max_new_tokens=8, sampling=cfg,
                                 generator=torch.Generator().manual_seed(seed))
        b = speculative_generate(fast, DRAFTERS[kind](fast), ids, max_new_tokens=8, sampling=cfg,
                                 generator=torch.Generator().manual_seed(seed))
        assert a.tokens == b.tokens and a.stats.target_forwards == b.stats.target_forwards


def test_plain_decoding_through_the_static_cache(model):
    fast = FastTarget(model, compile=False)
    ids = torch.tensor([[1, 1, 5, 7, 9], [3, 4, 5, 6, 8], [2, 9, 9, 4, 1]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    for cfg, seed in [(SamplingConfig(), None), (SamplingConfig(1.0), 3)]:
        gen = (lambda: torch.Generator().manual_seed(seed)) if seed is not None else (lambda: None)
        a = generate(model, ids, mask, max_new_tokens=12, sampling=cfg, generator=gen(), eos_token_id=5)
        b = generate(fast, ids, mask, max_new_tokens=12, sampling=cfg, generator=gen(), eos_token_id=5)
        assert a.tokens == b.tokens


def test_compiled_agrees_with_eager(model):
    """torch.compile'd buckets (padding slots included) against the eager reference: greedy tokens identical for
    plain decoding, a chain drafter and a tree drafter; a block above the largest bucket runs eagerly, counted."""
    eager = FastTarget(model, compile=False)
    comp = FastTarget(model, compile=True, buckets=(1, 4))
    ids = torch.tensor([[3, 7, 11, 2, 9, 14]])
    assert generate(eager, ids, max_new_tokens=10).tokens == generate(comp, ids, max_new_tokens=10).tokens
    draft = tiny_llama(vocab_size=48, hidden_size=32, layers=1, seed=5)
    from specbook.drafters.draft_model import DraftModelDrafter

    for gamma in (2, 5):  # 3 slots -> bucket 4 (one padding slot); 6 slots -> above the buckets: eager
        a = speculative_generate(eager, DraftModelDrafter(draft, gamma=gamma), ids, max_new_tokens=10)
        b = speculative_generate(comp, DraftModelDrafter(draft, gamma=gamma), ids, max_new_tokens=10)
        assert a.tokens == b.tokens
    assert comp.stats.fallbacks > 0 and comp.stats.compiled_calls > 0
    assert set(comp.stats.warmup_s) == {"1", "4"} and comp.stats.recompiles == 0
    s = comp.stats.as_json()
    assert s["warmup_total_s"] > 0 and s["capacities"]


def test_a_draft_model_runs_on_the_fast_path():
    """DraftModelDrafter on a FastTarget of its draft, full and reduced output layer: eager (T = 1, same generator)
    and compiled (greedy) give the tokens of the plain draft on transformers' cache; a sequence that outgrows the
    draft's static cache gets a larger one (refilled), same tokens; a vocabulary given twice is refused."""
    from specbook.drafters.draft_model import DraftModelDrafter

    model = tiny_llama(vocab_size=48, hidden_size=32, layers=2, seed=0, max_position_embeddings=512)
    draft = tiny_llama(vocab_size=48, hidden_size=32, layers=1, seed=5)
    sub = torch.arange(0, 48, 2)
    ids = torch.randint(48, (1, 250), generator=torch.Generator().manual_seed(2))  # 250 + gamma 3 fills 256 slots
    for vocab in (None, sub):
        for compile, cfg in ((False, SamplingConfig(1.0)), (True, SamplingConfig())):
            fast_draft = FastTarget(draft, compile=compile, buckets=(1, 2, 4), vocab=vocab)
            for seed in range(2 if compile else 4):
                runs = []
                for d in (DraftModelDrafter(draft, 3, vocab=vocab), DraftModelDrafter(fast_draft, 3)):
                    runs.append(speculative_generate(model, d, ids, max_new_tokens=12, sampling=cfg,
                                                     generator=torch.Generator().manual_seed(seed)))
                assert runs[0].tokens == runs[1].tokens
                assert d.cache.capacity > 256  # outgrown and replaced
            if compile:
                assert fast_draft.stats.compiled_calls > 0 and fast_draft.stats.recompiles == 0
    with pytest.raises(ValueError, match="FastTarget\\(draft, vocab="):
        DraftModelDrafter(FastTarget(draft, compile=False, vocab=sub), 3, vocab=sub)


def test_bad_input_is_refused(model):
    fast = fast_target(model, compile=False)
    assert fast_target(fast) is fast
    cache = fast.new_cache(8)
    with pytest.raises(ValueError, match="static cache holds 256 positions"):
        fast(input_ids=torch.zeros((1, 300), dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="batch"):
        fast(input_ids=torch.zeros((2, 3), dtype=torch.long), cache=cache)
    with pytest.raises(TypeError, match="inputs_embeds"):
        fast(input_ids=torch.zeros((1, 3), dtype=torch.long), cache=cache, inputs_embeds=torch.zeros(1, 3, 32))
    with pytest.raises(ValueError, match="crop"):
        cache.crop(5)
    with pytest.raises(ValueError, match="buckets"):
        FastTarget(model, compile=False, buckets=(4, 2))
    gpt2 = type("M", (), {"config": type("C", (), {"model_type": "gpt2"})()})()
    with pytest.raises(ValueError, match="gpt2"):
        FastTarget(gpt2)
    # without a static cache the call is transformers' own
    ids = torch.tensor([[3, 7, 11]])
    assert torch.equal(fast(input_ids=ids).logits, model(input_ids=ids).logits)


SLOW_METHODS = ["ar", "sps_rv", "pld", "medusa", "eagle", "eagle2", "eagle3", "mtp", "eagle_chain", "dflash", "dspark"]


@pytest.mark.slow
def test_compiled_greedy_tokens_equal_eager_for_every_bench_method(real, monkeypatch):
    """The real model in fp32 through the bench: every method's greedy tokens with the compiled forward equal those of
    the eager static-cache reference, prompt by prompt (4 eval prompts x 48 tokens; compiled buckets 1, 8 and 32 with
    and without hidden states, so CI compiles six graphs; blocks above 32 take the counted eager fallback)."""
    from specbook import decoding
    from specbook.bench import Loaded, Settings, TargetSettings, run_bench
    from specbook.prompts import load_prompts

    model, tok = real
    seen: list = []
    for name in ("generate", "speculative_generate"):
        orig = getattr(decoding, name)

        def recording(*a, _orig=orig, **kw):
            res = _orig(*a, **kw)
            seen.append(res.tokens)
            return res

        monkeypatch.setattr(decoding, name, recording)
    loaded = Loaded()
    loaded.targets.update(hf=model, compiled=FastTarget(model, compile=True, buckets=(1, 8, 32)))
    prompts = load_prompts("eval", limit=4)
    tokens = {}
    for forward in ("static", "compiled"):
        seen.clear()
        res = run_bench(SLOW_METHODS, prompts, model=model, tokenizer=tok, max_new_tokens=48, progress=False,
                        settings=Settings(target=TargetSettings(forward=forward)), loaded=loaded)
        tokens[forward] = list(seen)
        assert res["settings"]["forward"] == forward
    assert len(tokens["static"]) == len(tokens["compiled"]) >= len(SLOW_METHODS) * len(prompts)
    assert tokens["static"] == tokens["compiled"]
    stats = loaded.targets["compiled"].stats
    assert stats.compiled_calls > 0 and stats.recompiles == 0
    assert set(stats.warmup_s) <= {"1", "8", "32", "1+hidden", "8+hidden", "32+hidden"}
    assert res["settings"]["fast"]["compiled"]["warmup_total_s"] > 0
    draft = res["settings"]["fast"]["draft_model[vocab=8192]"]  # sps_rv's draft ran compiled too
    assert draft["compiled_calls"] > 0 and draft["recompiles"] == 0


def test_compact_rows_keeps_each_rows_real_slots():
    """compact_rows: each row's kept slots, in order, right-aligned; the returned mask marks them; the rest is gone."""
    cache = StaticKVCache(layers=2, batch=2, kv_heads=1, head_dim=3, capacity=16, dtype=torch.float32)
    for k, v in zip(cache.keys, cache.values):
        k[:, :, :6] = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 1, 6, 3)
        v[:, :, :6] = -k[:, :, :6]
    cache.length = 6
    keep = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 1, 0, 0, 0, 1]], dtype=torch.bool)
    before = cache.keys[0][:, :, :6].clone()
    mask = cache.compact_rows(keep)
    assert cache.length == 3 and mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert torch.equal(cache.keys[0][0, :, :3], before[0, :, [0, 2, 3]])
    assert torch.equal(cache.keys[1][1, :, 1:3], before[1, :, [1, 5]])
    assert torch.equal(cache.values[0][0, :, :3], -before[0, :, [0, 2, 3]])
    with pytest.raises(ValueError, match="keep must be"):
        cache.compact_rows(torch.ones(2, 5, dtype=torch.bool))


def test_batch_loop_on_the_static_cache_equals_transformers_cache(model, monkeypatch):
    """speculative_generate_batch with a FastTarget: a static cache of B rows whose rejected slots are holes, compacted
    (compact_rows) when the next block would not fit: the same tokens as with transformers' cache, row by row."""
    from specbook import decoding
    from specbook.drafters.draft_model import DraftModelDrafter
    from specbook.drafters.lookup import PromptLookupDrafter

    monkeypatch.setattr(decoding, "MAX_BLOCK", 8)  # a 256-slot cache that the holes of 40 tokens overflow
    calls = []
    orig = StaticKVCache.compact_rows
    monkeypatch.setattr(StaticKVCache, "compact_rows", lambda self, keep: calls.append(1) or orig(self, keep))
    ids = torch.tensor([[1, 1, 5, 7, 9], [3, 4, 5, 6, 8], [2, 9, 9, 4, 1]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    draft = tiny_llama(vocab_size=48, hidden_size=32, layers=1, seed=5)
    for make in (lambda: DraftModelDrafter(draft, gamma=7), lambda: PromptLookupDrafter(3)):
        a = decoding.speculative_generate_batch(model, [make() for _ in range(3)], ids, mask, max_new_tokens=40,
                                                eos_token_id=-1)
        for fast in (FastTarget(model, compile=False), FastTarget(model, compile=True, buckets=(8,))):
            b = decoding.speculative_generate_batch(fast, [make() for _ in range(3)], ids, mask, max_new_tokens=40,
                                                    eos_token_id=-1)
            assert a.tokens == b.tokens
    assert calls, "the holes should have overflowed the static cache at least once"
