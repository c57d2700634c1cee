"""The speculative loop with real drafters: greedy equivalence, EOS, bad input."""
import pytest
import torch

from specbook.decoding import generate, pad_left, speculative_generate
from specbook.drafters.draft_model import DraftModelDrafter, build_draft_model, check_same_tokenizer
from specbook.drafters.lookup import PromptLookupDrafter, find_continuation
from specbook.models import tiny_llama
from specbook.sampling import SamplingConfig, make_generator


def test_find_continuation():
    toks = [5, 6, 7, 8, 1, 2, 5, 6]
    assert find_continuation(toks, 3, max_ngram=2) == [7, 8, 1]
    assert find_continuation([1, 2, 3], 3) == []
    assert find_continuation([9, 4, 9, 4, 9], 2, max_ngram=3) == [4, 9]  # latest match, longest n-gram


@pytest.mark.parametrize("make", [lambda t: DraftModelDrafter(tiny_llama(seed=1), 3),
                                  lambda t: DraftModelDrafter(build_draft_model(t, (0,)), 5),
                                  lambda t: PromptLookupDrafter(4)], ids=["other-model", "layer-copy", "lookup"])
def test_greedy_equals_ar_on_tiny(tiny, make):
    for p in ([0, 5, 9, 11], [0, 3, 3, 3, 8]):
        ids, _ = pad_left([p], 1)
        ar = generate(tiny, ids, max_new_tokens=40, eos_token_id=-1).tokens[0]
        res = speculative_generate(tiny, make(tiny), ids, max_new_tokens=40, eos_token_id=-1)
        assert res.tokens[0] == ar
        s = res.stats
        assert s.new_tokens == 40 and s.tau == pytest.approx(40 / s.target_forwards)
        assert sum(s.accept_hist.values()) == s.target_forwards - 1


def test_eos_inside_the_draft_ends_the_sequence(tiny):
    ids, _ = pad_left([[0, 5, 9, 11]], 1)
    free = generate(tiny, ids, max_new_tokens=30, eos_token_id=-1).tokens[0]
    eos = free[5]
    res = speculative_generate(tiny, DraftModelDrafter(tiny, 6), ids, max_new_tokens=30, eos_token_id=eos)
    assert res.tokens[0] == free[: free.index(eos) + 1]  # the self-draft proposes past EOS; nothing after it is emitted


def test_bad_input(tiny):
    ids, _ = pad_left([[0, 5, 9]], 1)
    with pytest.raises(ValueError, match="gamma"):
        DraftModelDrafter(tiny, 0)
    with pytest.raises(ValueError, match="k \\(tokens"):
        PromptLookupDrafter(0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(temperature=1, top_p=0)
    with pytest.raises(ValueError, match="vocab size mismatch"):
        speculative_generate(tiny, DraftModelDrafter(tiny_llama(vocab_size=40), 2), ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="draft model is on meta"):
        speculative_generate(tiny, DraftModelDrafter(tiny_llama(seed=1).to("meta"), 2), ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="Generator"):
        speculative_generate(tiny, PromptLookupDrafter(2), ids, sampling=SamplingConfig(1.0))
    with pytest.raises(ValueError, match="batch 1"):
        speculative_generate(tiny, PromptLookupDrafter(2), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="layers_from"):
        build_draft_model(tiny, (5,))


def test_tokenizer_mismatch_names_both():
    class Tok:
        def __init__(self, vocab):
            self.v = vocab

        def __len__(self):
            return len(self.v)

        def get_vocab(self):
            return self.v

    check_same_tokenizer(Tok({"a": 0}), Tok({"a": 0}))
    with pytest.raises(ValueError, match="target has 1 tokens, draft has 2"):
        check_same_tokenizer(Tok({"a": 0}), Tok({"a": 0, "b": 1}))
    with pytest.raises(ValueError, match="different token->id map"):
        check_same_tokenizer(Tok({"a": 0}), Tok({"b": 0}))


def test_sampling_run_is_reproducible(tiny):
    ids, _ = pad_left([[0, 5, 9, 11]], 1)
    cfg = SamplingConfig(1.0, top_k=20)
    a = speculative_generate(tiny, DraftModelDrafter(tiny_llama(seed=1), 3), ids, max_new_tokens=20, sampling=cfg,
                             generator=make_generator(3), eos_token_id=-1).tokens
    b = speculative_generate(tiny, DraftModelDrafter(tiny_llama(seed=1), 3), ids, max_new_tokens=20, sampling=cfg,
                             generator=make_generator(3), eos_token_id=-1).tokens
    assert a == b


def _real_draft(model):
    """The committed distilled draft when present (fast), else an untrained layer copy (greedy equivalence holds
    for any draft)."""
    from specbook.train import CKPT_DIR

    if (CKPT_DIR / "draft_model.json").exists():
        from specbook.drafters.draft_model import load_draft_model

        return load_draft_model(model, CKPT_DIR / "draft_model")[0]
    return build_draft_model(model)


@pytest.mark.slow
def test_real_model_greedy_sps_and_pld_equal_ar(real):
    """fp32, 8 eval prompts x 64 tokens: SpS and prompt lookup emit exactly our AR loop's tokens."""
    from specbook.decoding import encode
    from specbook.prompts import load_prompts

    model, tok = real
    draft = _real_draft(model)
    bad = []
    for p in load_prompts("eval", limit=8):
        ids, _ = encode(tok, p["turns"][0])
        ar = generate(model, ids, max_new_tokens=64, eos_token_id=tok.eos_token_id).tokens[0]
        for name, d in (("sps", DraftModelDrafter(draft, 4)), ("pld", PromptLookupDrafter(10, 2))):
            out = speculative_generate(model, d, ids, max_new_tokens=64, eos_token_id=tok.eos_token_id).tokens[0]
            if out != ar:
                bad.append((name, p["question_id"]))
    assert not bad, f"speculative greedy output differs from AR: {bad}"


@pytest.mark.parametrize("kind", ["draft_model", "lookup"])
def test_batch_rows_equal_rows_alone(tiny, kind):
    """B > 1 with different accepted lengths per row: each row's output equals running it alone (fp32, greedy)."""
    from specbook.decoding import speculative_generate_batch

    prompts = [[0, 5, 9, 11], [0, 7], [0, 3, 3, 3, 8, 2, 4], [0, 12, 40, 12, 40]]
    make = (lambda: DraftModelDrafter(build_draft_model(tiny, (0,)), 3)) if kind == "draft_model" else \
        (lambda: PromptLookupDrafter(3))
    ids, mask = pad_left(prompts, 1)
    res = speculative_generate_batch(tiny, [make() for _ in prompts], ids, mask, max_new_tokens=24, eos_token_id=-1)
    for p, row in zip(prompts, res.tokens):
        alone = generate(tiny, *pad_left([p], 1), max_new_tokens=24, eos_token_id=-1).tokens[0]
        assert row == alone
    assert len(set(res.stats.accept_hist)) > 1, "rows should accept different lengths in this test"


def test_reduced_draft_vocab_greedy_exact_and_q_zero_outside(tiny):
    """A draft restricted to a token subset: greedy output unchanged; q is zero outside the subset (its T > 0
    distribution is checked in test_lossless.py)."""
    ids, _ = pad_left([[0, 5, 9, 11]], 1)
    sub = torch.arange(0, 48, 2)
    ar = generate(tiny, ids, max_new_tokens=30, eos_token_id=-1).tokens[0]
    d = DraftModelDrafter(tiny, 4, vocab=sub)
    assert speculative_generate(tiny, d, ids, max_new_tokens=30, eos_token_id=-1).tokens[0] == ar
    from specbook.decoding import SpecState

    st = SpecState(tokens=[0, 5, 9], prompt_len=3, sampling=SamplingConfig(1.0), generator=make_generator(0), target=tiny)
    d.begin(st)
    tree = d.propose(st)
    assert torch.all(tree.q[:, 1::2] == 0) and torch.allclose(tree.q.sum(-1), torch.ones(4))
    assert all(int(x) % 2 == 0 for x in tree.tokens)
    with pytest.raises(ValueError, match="vocab must be"):
        DraftModelDrafter(tiny, 2, vocab=torch.tensor([0, 99]))


# --------------------------------------------------------------------------- the loops' shared edges


def _free(tiny, prompt, n):
    return generate(tiny, pad_left([prompt], 1)[0], max_new_tokens=n, eos_token_id=-1).tokens[0]


def test_list_valued_eos_ends_every_loop_at_the_first_eos_of_the_list(tiny):
    """Llama-3 / Qwen configs carry a list of EOS ids: every loop stops at the first token in that list."""
    from specbook.decoding import eos_set, speculative_generate_batch

    p = [0, 5, 9, 11]
    free = _free(tiny, p, 30)
    a, b = free[9], free[4]  # the list's second id appears first in the text
    eos = [a, b]
    want = free[: min(free.index(a), free.index(b)) + 1]
    assert eos_set(-1, None) == frozenset()  # -1 = no EOS: the loop runs to max_new_tokens
    ids, mask = pad_left([p], 1)
    assert generate(tiny, ids, mask, max_new_tokens=30, eos_token_id=eos).tokens[0] == want
    for make in (lambda: DraftModelDrafter(tiny, 3), lambda: PromptLookupDrafter(3)):
        assert speculative_generate(tiny, make(), ids, max_new_tokens=30, eos_token_id=eos).tokens[0] == want
        assert speculative_generate_batch(tiny, [make()], ids, mask, max_new_tokens=30, eos_token_id=eos).tokens[0] == want
    # the model config's list is used when no eos_token_id is passed
    old = tiny.config.eos_token_id
    try:
        tiny.config.eos_token_id = eos
        assert speculative_generate(tiny, DraftModelDrafter(tiny, 3), ids, max_new_tokens=30).tokens[0] == want
    finally:
        tiny.config.eos_token_id = old


def test_batch_loop_stats_equal_the_single_loop_at_B1(tiny):
    from specbook.decoding import speculative_generate_batch

    ids, mask = pad_left([[0, 5, 9, 11]], 1)
    draft = build_draft_model(tiny, (0,))
    d1, d2 = DraftModelDrafter(draft, 3), DraftModelDrafter(draft, 3)
    d2.forwards = 7  # a drafter reused across calls: the loop reports this call's forwards only
    one = speculative_generate(tiny, d1, ids, max_new_tokens=20, eos_token_id=-1)
    bat = speculative_generate_batch(tiny, [d2], ids, mask, max_new_tokens=20, eos_token_id=-1)
    assert bat.tokens == one.tokens
    s1, s2 = one.stats, bat.stats
    assert (s2.target_forwards, s2.new_tokens, s2.draft_forwards, s2.drafted) == \
        (s1.target_forwards, s1.new_tokens, s1.draft_forwards, s1.drafted)
    assert s2.accept_hist == s1.accept_hist and s2.pos_tested == s1.pos_tested
    assert s2.prefill_time > 0 and len(s2.step_times) == len(s1.step_times) == s1.target_forwards - 1


def test_draft_is_cut_near_the_end_of_the_context(tiny):
    """A request that fits the context runs, whatever the draft length: drafts are cut where they would pass it."""
    from copy import deepcopy

    from specbook.decoding import speculative_generate_batch
    from specbook.drafters.eagle import Eagle2Drafter, EagleHead

    small = deepcopy(tiny)
    small.config.max_position_embeddings = 16
    p = [0, 5, 9, 11]
    ids, mask = pad_left([p], 1)
    ar = generate(small, ids, max_new_tokens=12, eos_token_id=-1).tokens[0]
    torch.manual_seed(0)
    for d in (DraftModelDrafter(small, 6), PromptLookupDrafter(8, max_ngram=1),
              Eagle2Drafter(small, EagleHead(small.config).eval(), depth=6, top_k=2, total_tokens=10)):
        assert speculative_generate(small, d, ids, max_new_tokens=12, eos_token_id=-1).tokens[0] == ar, type(d).__name__
    out = speculative_generate_batch(small, [DraftModelDrafter(small, 6)], ids, mask, max_new_tokens=12, eos_token_id=-1)
    assert out.tokens[0] == ar
    with pytest.raises(ValueError, match="exceeds the model context"):
        speculative_generate(small, DraftModelDrafter(small, 2), ids, max_new_tokens=13, eos_token_id=-1)


def test_batch_loop_refuses_what_it_cannot_run(tiny):
    from specbook.decoding import speculative_generate_batch
    from specbook.drafters.eagle import EagleDrafter, EagleHead
    from specbook.verify import DraftTree

    class TwoChildren(DraftModelDrafter):
        def propose(self, state):
            return DraftTree(torch.tensor([3, 4]), torch.tensor([-1, -1]))

    ids, mask = pad_left([[0, 5, 9], [0, 7]], 1)
    with pytest.raises(ValueError, match="chains only"):
        speculative_generate_batch(tiny, [TwoChildren(tiny, 1), TwoChildren(tiny, 1)], ids, mask, max_new_tokens=5)
    head = EagleHead(tiny.config).eval()
    with pytest.raises(ValueError, match="EagleDrafter needs them"):
        speculative_generate_batch(tiny, [EagleDrafter(tiny, head, choices=[(0,)])] * 2, ids, mask, max_new_tokens=5)
