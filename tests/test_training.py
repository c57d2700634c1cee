"""Corpus round trip, feature cache staleness, the training loop, checkpoints."""
import json
import math

import numpy as np
import pytest
import torch

from specbook.corpus import CorpusError, load_corpus, tokenize_prompts, write_corpus
from specbook.drafters.draft_model import DraftModelObjective, load_draft_model
from specbook.features import StaleFeatures, load_or_build, load_or_build_teacher, open_store
from specbook.models import fingerprint, tiny_llama
from specbook.training import CheckpointError, TrainConfig, TrainData, load_checkpoint, save_checkpoint, train


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_llama(vocab_size=48, hidden_size=32, seed=0)


@pytest.fixture
def tiny_corpus(tmp_path, tiny_target):
    from specbook.decoding import generate, pad_left

    g = torch.Generator().manual_seed(0)
    prompts = [[0] + torch.randint(2, 48, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(24)]
    recs = []
    for i, p in enumerate(prompts):
        out = generate(tiny_target, *pad_left([p], 1), max_new_tokens=40, eos_token_id=-1).tokens[0]
        recs.append((p, out, {"question_id": f"q{i}", "category": "toy", "pass": 0}))
    write_corpus(tmp_path / "corpus", recs, vocab_size=48, target="tiny", fingerprint=fingerprint(tiny_target),
                 settings={"toy": True})
    return load_corpus(tmp_path / "corpus"), recs


def test_corpus_round_trip(tiny_corpus):
    corpus, recs = tiny_corpus
    assert len(corpus) == len(recs)
    for i, (p, r, m) in enumerate(recs):
        assert corpus.sequence(i).tolist() == p + r
        assert corpus.prompt_len(i) == len(p)
        assert corpus.records[i] == m
    assert corpus.manifest["response_tokens"] == sum(len(r) for _, r, _ in recs)


def test_corpus_tampering_is_detected(tiny_corpus, tmp_path):
    corpus, _ = tiny_corpus
    tokens = np.load(tmp_path / "corpus" / "tokens.npy")
    tokens[3] += 1
    np.save(tmp_path / "corpus" / "tokens.npy", tokens)
    with pytest.raises(CorpusError, match="sha256"):
        load_corpus(tmp_path / "corpus")
    with pytest.raises(CorpusError, match="no corpus"):
        load_corpus(tmp_path / "nowhere")


def test_a_training_subset_is_written_once_and_read_after(tiny_corpus, tmp_path, monkeypatch):
    """``train --records N``'s subset is read from the cache when it is there (never rewritten in place under a run
    that may be reading it), and written again only when it is missing or its files no longer match their manifest."""
    from specbook.train import training_corpus

    monkeypatch.setenv("SPECBOOK_CACHE", str(tmp_path / "cache"))
    corpus, _ = tiny_corpus
    assert training_corpus(corpus, 0) is corpus
    first = training_corpus(corpus, 10)
    tokens = tmp_path / "cache" / "subsets" / f"{corpus.sha}-10" / "tokens.npy"
    stamp = tokens.stat().st_mtime_ns
    again = training_corpus(corpus, 10)
    assert again.sha == first.sha and len(again) == 10 and tokens.stat().st_mtime_ns == stamp
    np.save(tokens, np.zeros(3, dtype=np.uint16))  # an edited copy is not trusted
    assert training_corpus(corpus, 10).sha == first.sha


def test_long_prompts_are_skipped_and_counted():
    class Tok:
        def apply_chat_template(self, msgs, **kw):
            return list(range(len(msgs[0]["content"])))

    recs = [{"question_id": "a", "turns": ["short"]}, {"question_id": "b", "turns": ["x" * 50]}]
    kept, skipped = tokenize_prompts(Tok(), recs, max_prompt_tokens=10)
    assert [r["question_id"] for r, _ in kept] == ["a"] and skipped == 1


def test_feature_cache_reuse_and_staleness(tiny_corpus, tiny_target, tmp_path):
    corpus, _ = tiny_corpus
    store = load_or_build(tiny_target, corpus, (-1, 1), root=tmp_path / "feats", progress=False)
    # features equal the target's own hidden states
    seq = torch.from_numpy(corpus.sequence(2))[None]
    with torch.no_grad():
        o = tiny_target.model(input_ids=seq, output_hidden_states=True)
    off, n = int(corpus.index[2, 0]), seq.shape[1]
    got = store.rows(off, off + n).float()
    assert torch.allclose(got[:, 0], o.last_hidden_state[0], atol=3e-2, rtol=2e-2)
    assert torch.allclose(got[:, 1], o.hidden_states[1][0], atol=3e-2, rtol=2e-2)
    again = load_or_build(tiny_target, corpus, (-1, 1), root=tmp_path / "feats", progress=False)
    assert again.path == store.path
    # a store built for another target is refused, never silently used
    with pytest.raises(StaleFeatures, match="built for"):
        store.check("0000000000000000", corpus.sha, (-1, 1))
    (store.path / "meta.json").unlink()  # partial build
    with pytest.raises(StaleFeatures, match="partial"):
        open_store(store.path)
    rebuilt = load_or_build(tiny_target, corpus, (-1, 1), root=tmp_path / "feats", progress=False)
    assert rebuilt.meta["corpus_sha"] == corpus.sha


def test_narrower_request_reads_a_wider_store(tiny_corpus, tiny_target, tmp_path):
    """EAGLE's (-1,) after EAGLE-3's (1, -1): the stored final state is viewed, the target is not run again; a layer
    the wider store lacks still gets its own build."""
    corpus, _ = tiny_corpus
    wide = load_or_build(tiny_target, corpus, (1, -1), root=tmp_path / "feats", progress=False)
    narrow = load_or_build(tiny_target, corpus, (-1,), root=tmp_path / "feats", progress=False)
    assert narrow.path == wide.path and narrow.layers == (-1,)
    off, n = int(corpus.index[1, 0]), int(corpus.index[1, 1] + corpus.index[1, 2])
    assert torch.equal(narrow.rows(off, off + n)[:, 0], wide.rows(off, off + n)[:, 1])
    narrow.check(narrow.meta["target_fingerprint"], corpus.sha, (-1,))
    other = load_or_build(tiny_target, corpus, (0,), root=tmp_path / "feats", progress=False)
    assert other.path != wide.path and other.layers == (0,)
    assert len(list((tmp_path / "feats").glob("*/meta.json"))) == 2


def test_teacher_store_holds_the_final_states_statistics_and_is_built_once(tiny_corpus, tiny_target, tmp_path):
    """features.load_or_build_teacher: per corpus token the log-sum-exp and argmax of final @ W.T, computed in
    several passes; shared by every store of the target and corpus; computed again for another head or after a
    partial write; a store without the final state is refused."""
    corpus, _ = tiny_corpus
    root = tmp_path / "feats"
    store = load_or_build(tiny_target, corpus, (1, -1), root=root, progress=False)
    W = tiny_target.get_output_embeddings().weight.detach().float()
    T = int(store.meta["shape"][0])
    t = load_or_build_teacher(store, W, progress=False, rows_per_pass=100)  # several passes
    z = store.rows(0, T)[:, 1].float() @ W.T
    lse, arg = t.rows(0, T)
    torch.testing.assert_close(lse, torch.logsumexp(z, -1))
    assert torch.equal(arg, z.argmax(-1)) and arg.dtype == torch.long
    (made,) = root.glob("teacher-*/lse.bin")
    stamp = made.stat().st_mtime_ns
    other_store = load_or_build(tiny_target, corpus, (0, -1), root=root, progress=False)
    assert other_store.path != store.path
    again = load_or_build_teacher(other_store, W, progress=False)  # another store of the corpus: the same files
    assert made.stat().st_mtime_ns == stamp and torch.equal(again.rows(0, T)[1], arg)
    other = load_or_build_teacher(store, 2 * W, progress=False)  # another head: its own statistics
    torch.testing.assert_close(other.rows(0, T)[0], torch.logsumexp(2 * z, -1))
    assert len(list(root.glob("teacher-*/lse.bin"))) == 2
    with open(made.with_name("arg.bin"), "r+b") as fh:  # a partial write
        fh.truncate(8)
    assert torch.equal(load_or_build_teacher(store, W, progress=False).rows(0, T)[1], arg)
    no_final = load_or_build(tiny_target, corpus, (1,), root=tmp_path / "feats1", progress=False)
    with pytest.raises(StaleFeatures, match="final state"):
        load_or_build_teacher(no_final, W, progress=False)


@pytest.mark.parametrize("pack", [False, True])
def test_batches_carry_the_teacher_at_their_own_positions(tiny_corpus, tiny_target, tmp_path, pack):
    """With a teacher store every window's (lse, argmax) are its own tokens', in plain and packed windows; the
    objectives that read them get them from train.teacher_for, the rest get None."""
    from specbook.drafters.eagle import EagleObjective
    from specbook.drafters.eagle3 import Eagle3Objective
    from specbook.train import teacher_for

    corpus, _ = tiny_corpus
    store = load_or_build(tiny_target, corpus, (-1,), root=tmp_path / "feats", progress=False)
    assert teacher_for(EagleObjective(tiny_target), store, tiny_target) is None
    obj = Eagle3Objective(tiny_target, torch.arange(48), taps=(1, 1, 1), ttt_steps=1)
    teacher = teacher_for(obj, store, tiny_target, progress=False)
    data = TrainData(corpus, store, seq_len=40, seed=0, pack=pack, teacher=teacher)
    b = data.batch(4, torch.Generator().manual_seed(5))
    real = b.feats.float().abs().sum((-1, -2)) > 0  # padding rows are zeros
    z = b.feats[:, :, 0].float() @ tiny_target.get_output_embeddings().weight.detach().float().T
    torch.testing.assert_close(b.lse[real], torch.logsumexp(z, -1)[real])
    assert torch.equal(b.t_arg[real], z.argmax(-1)[real])
    assert TrainData(corpus, store, seq_len=40, seed=0, pack=pack).batch(4, torch.Generator()).lse is None
    teacher.corpus_sha = "0" * 16  # another corpus's statistics would be misaligned: refused
    with pytest.raises(ValueError, match="teacher statistics are for corpus"):
        TrainData(corpus, store, seq_len=40, teacher=teacher)


def _setup(tiny_target, corpus, tmp_path):
    store = load_or_build(tiny_target, corpus, (-1,), root=tmp_path / "feats", progress=False)
    return TrainData(corpus, store, seq_len=24, seed=0)


def test_heldout_split_is_by_prompt(tiny_corpus, tiny_target, tmp_path):
    """Two passes answer each prompt twice: both answers fall on the same side of the split. With one pass the
    split is the one by record (the held-out set of the committed checkpoints is unchanged)."""
    corpus, recs = tiny_corpus
    one = _setup(tiny_target, corpus, tmp_path)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(corpus), generator=g).tolist()
    n_eval = max(1, int(len(corpus) * 0.03))
    assert (one.heldout, one.train) == (perm[:n_eval], perm[n_eval:])
    two_recs = recs + [(p, r[::-1], {**m, "pass": 1}) for p, r, m in recs]  # a second answer per prompt
    write_corpus(tmp_path / "two", two_recs, vocab_size=48, target="tiny", fingerprint=fingerprint(tiny_target),
                 settings={"toy": True})
    two_c = load_corpus(tmp_path / "two")
    two = TrainData(two_c, load_or_build(tiny_target, two_c, (-1,), root=tmp_path / "f2", progress=False), seq_len=24)
    qid = [r["question_id"] for r in two_c.records]
    assert sorted(two.heldout + two.train) == list(range(2 * len(recs)))
    assert {qid[i] for i in two.heldout}.isdisjoint({qid[i] for i in two.train})
    assert len(two.heldout) == 2 * n_eval
    lone = [(recs[0][0], recs[0][1], recs[0][2]), (recs[0][0], recs[0][1][:5], {**recs[0][2], "pass": 1})]
    write_corpus(tmp_path / "lone", lone, vocab_size=48, target="tiny", fingerprint=fingerprint(tiny_target),
                 settings={"toy": True})
    with pytest.raises(ValueError, match="at least 2 prompts"):
        TrainData(load_corpus(tmp_path / "lone"), None, seq_len=24)


def test_train_fraction_is_nested_and_keeps_the_held_out_prompts(tiny_corpus, tiny_target, tmp_path):
    """Data-scaling runs: a fraction trains on the first part of the train prompts (1/4 inside 1/2 inside all),
    every fraction reads the same held-out records, and the card's token count is the train records' tokens."""
    corpus, _ = tiny_corpus
    store = load_or_build(tiny_target, corpus, (-1,), root=tmp_path / "feats", progress=False)
    full = TrainData(corpus, store, seq_len=24, seed=0)
    parts = {f: TrainData(corpus, store, seq_len=24, seed=0, train_fraction=f) for f in (0.25, 0.5)}
    assert all(d.heldout == full.heldout for d in parts.values())
    assert parts[0.25].train == full.train[:len(parts[0.25].train)] == parts[0.5].train[:len(parts[0.25].train)]
    assert 0 < len(parts[0.25].train) < len(parts[0.5].train) < len(full.train)
    assert len(parts[0.5].train) == math.ceil(0.5 * len(full.train))  # one record per prompt in this corpus
    want = sum(int(corpus.index[i, 1] + corpus.index[i, 2]) for i in parts[0.25].train)
    assert parts[0.25].train_tokens == want < full.train_tokens
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="train_fraction"):
            TrainData(corpus, store, seq_len=24, train_fraction=bad)
        with pytest.raises(ValueError, match="train_fraction"):
            TrainConfig(train_fraction=bad)


def test_packed_windows_are_whole_records_end_to_end(tiny_corpus, tiny_target, tmp_path):
    """--pack: every window holds exactly seq_len tokens, made of train records from their first token on (the last
    one cut), with each record's own features; no loss position predicts across a record boundary."""
    corpus, _ = tiny_corpus
    store = load_or_build(tiny_target, corpus, (-1,), root=tmp_path / "feats", progress=False)
    data = TrainData(corpus, store, seq_len=100, seed=0, pack=True)
    b = data.batch(3, torch.Generator().manual_seed(7))
    assert b.tokens.shape == (3, 100) and b.feats.shape[:2] == (3, 100)

    def record_at(row: int, j: int) -> tuple[int, int]:  # the train record whose first tokens start at j, and n
        for i in data.train:
            off, pl, rl = (int(x) for x in corpus.index[i])
            n = min(100 - j, pl + rl)
            if np.array_equal(corpus.tokens[off:off + n], b.tokens[row, j:j + n].numpy()):
                return i, n
        raise AssertionError(f"row {row} position {j}: no train record starts here")

    pieces = 0
    for row in range(3):
        j = 0
        while j < 100:
            rec, n = record_at(row, j)
            off, pl, _ = (int(x) for x in corpus.index[rec])
            assert torch.equal(b.feats[row, j:j + n], store.rows(off, off + n))
            assert not b.mask[row, j + n - 1]  # its next token is the next record's (or past the window)
            assert int(b.mask[row, j:j + n].sum()) == max(0, n - pl)  # every response position but the last
            j, pieces = j + n, pieces + 1
    assert pieces > 3  # records shorter than the window: several per row
    plain = TrainData(corpus, store, seq_len=100, seed=0)
    assert plain.batch(3, torch.Generator().manual_seed(7)).tokens.shape[1] < 100  # unpacked: one record a window


def test_loop_drives_toy_drafter_below_bound(tiny_corpus, tiny_target, tmp_path):
    corpus, _ = tiny_corpus
    data = _setup(tiny_target, corpus, tmp_path)
    obj = DraftModelObjective(tiny_target, layers_from=(0,))
    cfg = TrainConfig(steps=150, batch=8, seq_len=24, lr=1e-2, warmup=5, eval_every=75, ckpt_every=75, autocast="off")
    first = obj.loss(data.batch(8, torch.Generator().manual_seed(123)))[0].item()
    with torch.no_grad():
        alpha0 = obj.evaluate(data.batch(32, torch.Generator().manual_seed(5), heldout=True))["alpha_T1"]
    res = train(obj, data, cfg, progress=False)
    last = np.mean([h["loss"] for h in res.history[-10:]])
    print(f"KL first {first:.3f} -> last {last:.3f}; held-out {res.evals[-1]}")
    assert last < 0.5 * first, "the loop must at least halve the distillation loss of a 1-layer toy draft"
    assert res.evals[-1]["alpha_T1"] > alpha0 + 0.05, f"held-out acceptance {alpha0:.3f} -> {res.evals[-1]['alpha_T1']:.3f}"


def test_resume_gives_the_same_weights(tiny_corpus, tiny_target, tmp_path):
    corpus, _ = tiny_corpus
    data = _setup(tiny_target, corpus, tmp_path)
    cfg = TrainConfig(steps=12, batch=4, seq_len=24, warmup=2, eval_every=4, ckpt_every=4, autocast="off")
    a = DraftModelObjective(tiny_target, layers_from=(0,))
    train(a, data, cfg, run_dir=tmp_path / "full", progress=False)
    b = DraftModelObjective(tiny_target, layers_from=(0,))
    train(b, data, cfg, run_dir=tmp_path / "crash", progress=False, stop_after=8)  # "crash" after step 8
    c = DraftModelObjective(tiny_target, layers_from=(0,))
    res = train(c, data, cfg, run_dir=tmp_path / "crash", progress=False)  # resume from step 8
    assert res.steps == 12
    for (k, va), vc in zip(a.state().items(), c.state().values()):
        assert torch.equal(va, vc), k


def test_checkpoint_round_trip_and_errors(tiny_target, tmp_path):
    obj = DraftModelObjective(tiny_target, layers_from=(0,))
    card = {"kind": "draft_model", "config": obj.card_config(), "target": "tiny",
            "target_fingerprint": fingerprint(tiny_target), "heldout": {}}
    save_checkpoint(tmp_path / "ck", obj.state(), card, dtype=torch.float32)
    draft, c = load_draft_model(tiny_target, tmp_path / "ck")
    for k, v in obj.state().items():
        assert torch.equal(draft.state_dict()[k], v), k
    with pytest.raises(CheckpointError, match="trained for target"):
        load_checkpoint(tmp_path / "ck", target=tiny_llama(vocab_size=48, hidden_size=32, seed=9))
    with pytest.raises(CheckpointError, match="not 'medusa'"):
        load_checkpoint(tmp_path / "ck", kind="medusa")
    st = tmp_path / "ck.safetensors"
    st.write_bytes(st.read_bytes()[:-50])  # truncated
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="needs both"):
        load_checkpoint(tmp_path / "missing")


def test_bad_train_config():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=0)


class ToyTok:
    """Just enough tokenizer for corpus generation on the tiny model: characters -> ids 2..47."""

    pad_token_id = 1
    eos_token_id = 1

    def apply_chat_template(self, msgs, **kw):
        return [i for m in msgs for i in [0] + [2 + (ord(c) % 46) for c in m["content"]]]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids if not (skip_special_tokens and i < 2))

    def __len__(self):
        return 48


def test_interrupted_generation_resumes_without_duplicates_or_gaps(tmp_path, tiny_target):
    from specbook.corpus import CorpusSettings, generate_corpus

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": f"q{i}", "category": "toy", "turns": ["x" * (3 + i % 7) + str(i)]})
                               + "\n" for i in range(10)))
    s = CorpusSettings(target="tiny", prompts=str(prompts), max_new_tokens=6, batch=3, dtype="fp32", max_prompt_tokens=64)
    kw = dict(limit=None, progress=False, model=tiny_target, tokenizer=ToyTok())
    full = generate_corpus(s, tmp_path / "full", **kw)
    assert generate_corpus(s, tmp_path / "resumed", stop_after=2, **kw) is None  # interrupted after 2 of 4 batches
    assert not (tmp_path / "resumed" / "manifest.json").exists()
    resumed = generate_corpus(s, tmp_path / "resumed", **kw)
    a, b = load_corpus(tmp_path / "full"), load_corpus(tmp_path / "resumed")
    assert full["records"] == resumed["records"] == 10
    assert [r["question_id"] for r in a.records] == [r["question_id"] for r in b.records]
    assert len({r["question_id"] for r in b.records}) == 10  # no duplicates, no gaps
    assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


def test_more_passes_on_a_clean_clone_reuse_the_finalized_corpus(tmp_path, tiny_target, monkeypatch):
    """A clean clone holds the committed corpus but no .work shards: --passes 2 must generate pass 1 only and keep
    pass 0's records as they are."""
    import shutil

    from specbook import corpus as C

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": f"q{i}", "category": "toy", "turns": ["y" * (2 + i % 5) + str(i)]})
                               + "\n" for i in range(7)))
    s1 = C.CorpusSettings(target="tiny", prompts=str(prompts), max_new_tokens=5, batch=3, dtype="fp32", max_prompt_tokens=64)
    kw = dict(limit=None, progress=False, model=tiny_target, tokenizer=ToyTok())
    C.generate_corpus(s1, tmp_path / "c", **kw)
    one = load_corpus(tmp_path / "c")
    shutil.rmtree(tmp_path / "c" / ".work")  # what a clone sees
    calls = []
    import specbook.decoding as D  # generate_corpus imports decoding.generate at call time: count the calls there

    orig = D.generate
    monkeypatch.setattr(D, "generate", lambda *a, **k: calls.append(k["sampling"].temperature) or orig(*a, **k))
    C.generate_corpus(C.CorpusSettings(**{**s1.__dict__, "passes": 2}), tmp_path / "c", **kw)
    two = load_corpus(tmp_path / "c")
    assert calls == [s1.later_pass_temperature] * 3  # 3 batches of pass 1 generated, none of pass 0
    assert [r["pass"] for r in two.records] == [0] * 7 + [1] * 7
    for i in range(7):  # pass 0 kept token for token
        assert two.records[i] == one.records[i]
        assert np.array_equal(two.sequence(i), one.sequence(i))
    assert sorted(r["question_id"] for r in two.records[7:]) == sorted(r["question_id"] for r in one.records)


def test_empty_prompt_file_is_a_clear_error(tmp_path, tiny_target):
    from specbook.corpus import CorpusSettings, generate_corpus

    (tmp_path / "empty.jsonl").write_text("\n")
    s = CorpusSettings(target="tiny", prompts=str(tmp_path / "empty.jsonl"), batch=2, dtype="fp32")
    with pytest.raises(ValueError, match="no prompts"):
        generate_corpus(s, tmp_path / "out", progress=False, model=tiny_target, tokenizer=ToyTok())


def test_follow_up_turns_are_asked_after_the_targets_own_answer(tmp_path, tiny_target):
    from specbook.corpus import CorpusSettings, generate_corpus

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": f"q{i}", "category": "toy",
                                           "turns": ["ab" * (1 + i)] + (["cd"] if i % 2 else [])}) + "\n" for i in range(5)))
    s = CorpusSettings(target="tiny", prompts=str(prompts), max_new_tokens=4, batch=2, dtype="fp32", max_prompt_tokens=64)
    generate_corpus(s, tmp_path / "c", progress=False, model=tiny_target, tokenizer=ToyTok())
    c, tok = load_corpus(tmp_path / "c"), ToyTok()
    first = {r["question_id"]: i for i, r in enumerate(c.records) if r["turn"] == 0}
    second = [i for i, r in enumerate(c.records) if r["turn"] == 1]
    assert sorted(c.records[i]["question_id"] for i in second) == ["q1", "q3"]
    for i in second:
        j = first[c.records[i]["question_id"]]
        q0 = c.sequence(j)[:c.prompt_len(j)].tolist()
        a0 = c.sequence(j)[c.prompt_len(j):].tolist()
        msgs = [{"content": "ab" * (1 + int(c.records[i]["question_id"][1:]))},
                {"content": tok.decode(a0, skip_special_tokens=True).strip()}, {"content": "cd"}]
        assert c.sequence(i)[:c.prompt_len(i)].tolist() == tok.apply_chat_template(msgs)
        assert c.sequence(i)[:len(q0)].tolist() == q0


def test_more_prompts_generate_only_the_new_ones(tmp_path, tiny_target, monkeypatch):
    import specbook.decoding as D
    from specbook import corpus as C

    prompts = tmp_path / "p.jsonl"
    rows = [json.dumps({"question_id": f"q{i}", "category": "toy", "turns": ["z" * (2 + i % 4) + str(i)]}) + "\n"
            for i in range(9)]
    prompts.write_text("".join(rows[:6]))
    s = C.CorpusSettings(target="tiny", prompts=str(prompts), max_new_tokens=5, batch=4, dtype="fp32", max_prompt_tokens=64)
    kw = dict(progress=False, model=tiny_target, tokenizer=ToyTok())
    C.generate_corpus(s, tmp_path / "c", **kw)
    one = load_corpus(tmp_path / "c")
    old = {r["question_id"]: one.sequence(i).tolist() for i, r in enumerate(one.records)}  # before the files change
    prompts.write_text("".join(rows))
    rows_seen = []
    orig = D.generate
    monkeypatch.setattr(D, "generate", lambda m, ids, *a, **k: rows_seen.append(ids.shape[0]) or orig(m, ids, *a, **k))
    C.generate_corpus(C.CorpusSettings(**{**s.__dict__, "batch": 2}), tmp_path / "c", **kw)
    two = load_corpus(tmp_path / "c")
    assert sum(rows_seen) == 3  # only q6..q8 were generated
    for i, r in enumerate(two.records):
        if r["question_id"] in old:
            assert two.sequence(i).tolist() == old[r["question_id"]]
    assert len(two) == 9


def test_batches_respect_the_token_budget():
    from specbook.corpus import plan_batches

    lengths = [10, 3000, 50, 2500, 12, 900, 40]
    batches = plan_batches(lengths, batch=4, batch_tokens=5000)
    assert sorted(i for b in batches for i in b) == list(range(7))
    for b in batches:
        assert len(b) <= 4 and (len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 5000)


def test_broad_prompts_split_by_source():
    from specbook.broad_prompts import build_broad, plant_bug, split_by_group

    recs = build_broad()
    tr, ev = split_by_group(recs, torch.Generator().manual_seed(0))
    assert len(tr) + len(ev) == len(recs)
    assert not {r["group"] for r in tr} & {r["group"] for r in ev}  # no evaluated document or function is trained on
    cats = {r["category"] for r in recs}
    assert {"code_complete", "code_fix", "math_word", "long_input", "multi_turn", "rewriting"} <= cats
    assert cats == {r["category"] for r in ev}
    assert all(len(r["turns"]) == 2 for r in recs if r["category"] == "multi_turn")
    src = "def f(a, b):\n    return a == b"
    assert plant_bug(src, torch.Generator().manual_seed(0)) == "def f(a, b):\n    return a != b"


def test_features_for_several_methods_is_the_union_of_their_layers():
    """``--features-for``: one store for the union of the methods' layers (the trained method's first), so one
    pass of the target over the corpus serves each of them."""
    from types import SimpleNamespace

    from specbook.drafters.dflash import default_taps as dflash_taps
    from specbook.drafters.eagle3 import default_taps as eagle3_taps
    from specbook.train import feature_layers

    cfg = SimpleNamespace(num_hidden_layers=30)
    assert feature_layers(["eagle"], cfg) == (-1,)
    both = feature_layers(["eagle", "eagle3", "dflash", "mtp"], cfg)
    assert both[0] == -1 and set(both) == {-1, *eagle3_taps(30), *dflash_taps(30)} and len(both) == len(set(both))
    with pytest.raises(SystemExit, match="unknown method.*nope"):
        feature_layers(["eagle", "nope"], cfg)


def test_a_tap_at_the_last_layer_is_the_final_state_and_reads_a_store_that_holds_it(tiny_corpus, tiny_target, tmp_path):
    """``--taps ...,L``: output_hidden_states[L] is transformers' last_hidden_state (after the final norm), so the
    tap is stored as -1 and a store holding the final state serves it, no second pass over the corpus; bad --taps
    and --taps for a method without taps are refused."""
    import argparse

    from specbook.features import store_layers
    from specbook.train import METHODS, _taps, run

    corpus, _ = tiny_corpus
    L = tiny_target.config.num_hidden_layers
    ids = torch.as_tensor(corpus.tokens[:12].astype('int64'))[None]
    with torch.no_grad():
        out = tiny_target.model(ids, output_hidden_states=True)
    assert torch.equal(out.hidden_states[L], out.last_hidden_state)  # the premise of the alias
    assert store_layers((1, L, -1), L) == (1, -1, -1)
    assert METHODS["dflash"].layers_for(tiny_target.config, (1, L)) == (1, -1, -1)
    wide = load_or_build(tiny_target, corpus, (0, 1, -1), root=tmp_path / "feats", progress=False)
    tapped = load_or_build(tiny_target, corpus, METHODS["dspark"].layers_for(tiny_target.config, (1, L)),
                           root=tmp_path / "feats", progress=False)
    assert tapped.path == wide.path and len(list((tmp_path / "feats").glob("*/meta.json"))) == 1
    off = int(corpus.index[0, 0])
    rows = tapped.rows(off, off + 5)
    assert torch.equal(rows[:, 1], rows[:, 2]) and torch.equal(rows[:, 1], wide.rows(off, off + 5)[:, 2])
    assert _taps(argparse.Namespace(taps="2,15,30")) == (2, 15, 30) and _taps(argparse.Namespace(taps=None)) is None
    with pytest.raises(SystemExit, match="comma-separated"):
        _taps(argparse.Namespace(taps="2;15"))
    with pytest.raises(SystemExit, match="block drafters"):
        run("eagle", argparse.Namespace(taps="2,30", anchors=8), [])


def test_features_of_padded_batches_equal_each_sequences_own_forward(tiny_corpus, tiny_target, tmp_path):
    """The build batches sequences of different lengths, right-padded and without a mask: every sequence's rows must
    still be what the target computes on that sequence alone."""
    corpus, _ = tiny_corpus
    store = load_or_build(tiny_target, corpus, (-1, 2), root=tmp_path / "feats", progress=False, batch_tokens=256)
    lengths = {len(corpus.sequence(i)) for i in range(len(corpus))}
    assert len(lengths) > 1  # the batches do hold padding
    for i in range(len(corpus)):
        seq = torch.from_numpy(corpus.sequence(i))[None]
        with torch.no_grad():
            o = tiny_target.model(input_ids=seq, output_hidden_states=True)
        off = int(corpus.index[i, 0])
        got = store.rows(off, off + seq.shape[1])
        want = torch.stack([o.last_hidden_state[0], o.hidden_states[2][0]], dim=1).to(torch.bfloat16)
        assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2), i


def test_an_interrupted_feature_build_resumes_where_it_stopped(tiny_corpus, tiny_target, tmp_path, monkeypatch):
    """A build killed mid-way (a session ending) goes on from its last recorded batch: the target runs only over
    what is left, and the store equals one built in a single go."""
    corpus, _ = tiny_corpus
    decoder, forward = tiny_target.model, tiny_target.model.forward
    calls, dies_after = [], [2]

    def counted(*a, **kw):  # the target's decoder, failing on the batch after `dies_after`
        calls.append(kw["input_ids"].shape[0])
        if dies_after[0] is not None and len(calls) > dies_after[0]:
            raise KeyboardInterrupt("session ended")
        return forward(*a, **kw)

    monkeypatch.setattr(decoder, "forward", counted)
    root = tmp_path / "feats"
    with pytest.raises(KeyboardInterrupt):
        load_or_build(tiny_target, corpus, (-1,), root=root, progress=False, batch_tokens=128, save_every_s=0)
    first = list(calls)
    calls.clear()
    dies_after[0] = None
    store = load_or_build(tiny_target, corpus, (-1,), root=root, progress=False, batch_tokens=128)
    resumed = list(calls)
    monkeypatch.undo()
    whole = load_or_build(tiny_target, corpus, (-1,), root=tmp_path / "whole", progress=False, batch_tokens=128)
    assert len(first) == 3 and sum(resumed) + sum(first[:2]) == len(corpus)  # the 2 finished batches were not rerun
    assert np.array_equal(np.asarray(store.data), np.asarray(whole.data))
    assert not (store.path / "progress.json").exists()


def test_corpus_info_names_the_sha_of_a_spread_subset(tiny_corpus, tmp_path, capsys):
    from specbook.corpus import main, subset

    corpus, _ = tiny_corpus
    main(["info", "--corpus", str(tmp_path / "corpus")])
    whole = json.loads(capsys.readouterr().out)
    main(["info", "--corpus", str(tmp_path / "corpus"), "--records", "5"])
    part = json.loads(capsys.readouterr().out)
    assert whole["sha"] == corpus.sha and whole["records"] == len(corpus)
    # the subset `train --records 5` trains on: evenly spaced records, its own sha
    assert part["sha"] == subset(corpus, 5, tmp_path / "sub", spread=True).sha != corpus.sha and part["records"] == 5
    with pytest.raises(SystemExit):
        main(["info", "--corpus", str(tmp_path / "corpus"), "--records", "0"])
    assert "at least 1 record" in capsys.readouterr().err


def test_seeded_build_starts_every_run_of_a_seed_from_the_same_head(tiny):
    """train.run draws a head's initial weights from --seed: the same seed gives the same weights, another seed
    others, and the caller's global RNG is not moved."""
    from specbook.train import METHODS

    spec = METHODS["eagle"]
    before = torch.random.get_rng_state()
    a, b, c = (spec.seeded_build(tiny, s).state() for s in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())
