"""Failure modes (notebook 08): deterministic long prompts and the over-long error in every loop, rows and requests
that cannot read each other's KV (and the check failing when they can), and the Spec-Bench reader."""
import json
import os
from pathlib import Path

import pytest
import torch

from specbook import serving as S
from specbook import specbench
from specbook.decoding import generate, pad_left, speculative_generate, speculative_generate_batch
from specbook.drafters.draft_model import DraftModelDrafter
from specbook.drafters.lookup import PromptLookupDrafter
from specbook.longctx import long_prompt, long_prompts
from specbook.models import tiny_llama
from specbook.tree import additive_mask

SPEC_BENCH = Path(os.environ.get("SPECBOOK_SPEC_BENCH", Path(__file__).resolve().parents[2] / "shared" / "data" /
                                 "spec_bench" / "question.jsonl"))


# ---------------------------------------------------------------- long prompts


def test_long_prompts_are_deterministic_nested_and_fit(real):
    smol_tokenizer = real[1]
    a = long_prompt(smol_tokenizer, 1024)
    assert a == long_prompt(smol_tokenizer, 1024)  # the same text on every call
    assert 900 < a["tokens"] <= 1024  # the closest paragraph cut below the length asked for
    b = long_prompt(smol_tokenizer, 2048)
    doc_a, doc_b = (p["turns"][0].rsplit("\n\n", 1)[0] for p in (a, b))
    assert doc_b.startswith(doc_a) and b["paragraphs"] > a["paragraphs"]  # a shorter context is a prefix
    with pytest.raises(ValueError, match="exceeds the model context 8192"):
        long_prompt(smol_tokenizer, 8192, max_new_tokens=64)
    with pytest.raises(ValueError, match="shorter than one paragraph"):
        long_prompt(smol_tokenizer, 16)
    two = long_prompts(smol_tokenizer, [1024, 2048], per_length=2)
    assert [p["category"] for p in two] == ["1024", "1024", "2048", "2048"]
    assert two[0] == a and two[2] == b  # seed 0 is the one-prompt sweep's report
    assert two[1]["turns"] != two[0]["turns"] and 900 < two[1]["tokens"] <= 1024  # another report, same budget
    with pytest.raises(ValueError, match="per_length must be >= 1"):
        long_prompts(smol_tokenizer, [1024], per_length=0)


def test_every_loop_refuses_an_over_long_prompt(tiny):
    n = int(tiny.config.max_position_embeddings)
    ids = torch.zeros(1, n - 4, dtype=torch.long)
    for run in (lambda: generate(tiny, ids, max_new_tokens=8),
                lambda: speculative_generate(tiny, PromptLookupDrafter(3), ids, max_new_tokens=8),
                lambda: speculative_generate_batch(tiny, [PromptLookupDrafter(3)], ids, torch.ones_like(ids),
                                                   max_new_tokens=8),
                lambda: S.serve(tiny, [S.Request(0, ids[0].tolist(), 8)], policy="none")):
        with pytest.raises(ValueError, match="exceeds the model context"):
            run()


# ---------------------------------------------------------------- batch effects: no row reads another's KV


ROWS = [[0, 5, 9, 11, 2, 7], [0, 7], [0, 3, 3, 3, 8, 2, 4], [0, 12, 40]]


def _alone(tiny, n):
    return [generate(tiny, *pad_left([p], 1), max_new_tokens=n, eos_token_id=-1).tokens[0] for p in ROWS]


def test_batch_rows_with_padding_equal_rows_alone_and_the_check_catches_a_leak(tiny):
    """Rows of different lengths (left padding) in one batch: each row's greedy output equals its batch-1 output in
    fp32. The same check fails when the padding is left visible, the KV-slot mixing behind batch-size collapses."""
    alone = _alone(tiny, 16)
    ids, mask = pad_left(ROWS, 1)
    drafters = [DraftModelDrafter(tiny_llama(seed=3), 3) for _ in ROWS]
    out = speculative_generate_batch(tiny, drafters, ids, mask, max_new_tokens=16, eos_token_id=-1)
    assert out.tokens == alone
    drafters = [DraftModelDrafter(tiny_llama(seed=3), 3) for _ in ROWS]
    leaky = speculative_generate_batch(tiny, drafters, ids, torch.ones_like(mask), max_new_tokens=16, eos_token_id=-1)
    assert leaky.tokens != alone  # a padded row that reads the pad slots decodes something else


def _leaky_inputs(self, segments):
    """PackedCache.inputs with the owner check removed: every request sees every live slot (the bug)."""
    ids, pos, _, q_owner = ORIGINAL_INPUTS(self, segments)
    S_, T = len(self.owner), ids.shape[1]
    k_live = torch.cat([self.owner, q_owner]) >= 0
    new = torch.arange(S_ + T)[None] - S_
    allowed = k_live[None] & ((new < 0) | (new <= torch.arange(T)[:, None]))
    return ids, pos, additive_mask(allowed, self.dtype)[None, None].to(self.device), q_owner


ORIGINAL_INPUTS = S.PackedCache.inputs


def test_packed_requests_equal_requests_alone_and_the_check_catches_a_leak(tiny, monkeypatch):
    """Four requests packed into one cache row: each one's greedy tokens equal its batch-1 output; with the owner
    check removed from the mask (requests reading each other's slots) the same comparison fails."""
    alone = _alone(tiny, 12)
    reqs = lambda: [S.Request(i, p, 12) for i, p in enumerate(ROWS)]  # noqa: E731
    drafter = DraftModelDrafter(tiny_llama(seed=3), 3)
    out = S.serve(tiny, reqs(), policy="fixed:3", drafter=drafter, concurrency=4, eos_token_id=-1)
    assert [r.tokens for r in out.requests] == alone
    monkeypatch.setattr(S.PackedCache, "inputs", _leaky_inputs)
    leaky = S.serve(tiny, reqs(), policy="fixed:3", drafter=drafter, concurrency=4, eos_token_id=-1)
    assert [r.tokens for r in leaky.requests] != alone


# ---------------------------------------------------------------- Spec-Bench


def _write(path, recs):
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return path


def test_spec_bench_reader_refuses_other_files(tmp_path):
    ok = {"question_id": 1, "category": "qa", "turns": ["What is 2 + 2?"]}
    assert specbench.load_questions(_write(tmp_path / "ok.jsonl", [ok])) == [ok]
    for bad, why in (({**ok, "category": "long_input"}, "category 'long_input'"),
                     ({"category": "qa", "turns": ["x"]}, "question_id"),
                     ({**ok, "turns": []}, "turns"),
                     ("not json", "not valid JSON")):
        p = tmp_path / "bad.jsonl"
        p.write_text((bad if isinstance(bad, str) else json.dumps(bad)) + "\n")
        with pytest.raises(ValueError, match="not Spec-Bench format.*" + why.split()[0]):
            specbench.load_questions(p)
    with pytest.raises(FileNotFoundError, match="--questions"):
        specbench.load_questions(tmp_path / "missing.jsonl")
    # the project's own prompt file has Spec-Bench's shape but not its categories: refused
    with pytest.raises(ValueError, match="not Spec-Bench format"):
        specbench.load_questions(Path(__file__).resolve().parents[1] / "data" / "prompts" / "eval.jsonl")


def test_stratified_sample_spans_groups_and_is_seeded(tmp_path):
    recs = [{"question_id": i, "category": c, "turns": [f"q{i}", "second"]}
            for i, c in enumerate([c for c in specbench.GROUPS for _ in range(3)])]
    p = _write(tmp_path / "q.jsonl", recs)
    s = specbench.stratified(specbench.load_questions(p), 2, seed=0)
    assert [x["category"] for x in s] == [g for g in specbench.GROUP_ORDER for _ in range(2)]
    mt = [x["source_category"] for x in s if x["category"] == "multi-turn"]
    assert len(set(mt)) == 2  # round-robin: two different MT-bench categories
    assert all(len(x["turns"]) == 1 for x in s)  # first turn only (the documented simplification)
    assert s == specbench.stratified(specbench.load_questions(p), 2, seed=0)
    assert s != specbench.stratified(specbench.load_questions(p), 2, seed=1)
    with pytest.raises(ValueError, match="fewer than per_group"):
        specbench.stratified(specbench.load_questions(p), 4)


@pytest.mark.skipif(not SPEC_BENCH.exists(), reason="Spec-Bench's question.jsonl not on this machine")
def test_the_real_spec_bench_file_loads_with_its_six_groups():
    qs = specbench.load_questions(SPEC_BENCH)
    assert len(qs) == 480
    s = specbench.stratified(qs, 5)
    assert [x["category"] for x in s[::5]] == list(specbench.GROUP_ORDER)


def test_leaderboard_shape_from_the_committed_run():
    d = json.loads((Path(__file__).resolve().parents[1] / "docs" / "bench" / "cpu_specbench_t0.json").read_text())
    rows = specbench.leaderboard(d)
    assert {r["method"] for r in rows} >= set(specbench.METHODS)
    assert all(r[g][0] is not None and r[g][1] is not None for r in rows for g in specbench.GROUP_ORDER)
