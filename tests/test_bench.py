import json

import pytest

from specbook import bench, roofline
from specbook.prompts import load_prompts


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown method"):
        bench.run_bench(["nope"], [{"turns": ["hi"]}], model=object(), tokenizer=object())


def test_prompt_loading_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"question_id": 1, "turns": []}\n')
    with pytest.raises(ValueError, match="turns"):
        load_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError):
        load_prompts(tmp_path / "missing.jsonl")


def test_prompt_set_shape():
    tr, ev = load_prompts("train"), load_prompts("eval")
    assert len(tr) + len(ev) > 3000
    cats = {r["category"] for r in tr}
    assert cats == {"multi_turn", "writing", "translation", "summarization", "qa", "math_reasoning", "coding", "rag",
                    "code_explain", "code_tests", "code_port", "code_edit", "code_fix", "code_complete", "code_write",
                    "math_word", "long_input", "rewriting"}
    assert cats == {r["category"] for r in ev}  # the eval split has every category
    assert not {tuple(r["turns"]) for r in tr} & {tuple(r["turns"]) for r in ev}, "eval must never be trained on"
    assert not {r["group"] for r in tr if "group" in r} & {r["group"] for r in ev if "group" in r}  # nor its sources


def test_per_category_takes_the_first_n_of_each():
    ps = [{"category": c, "turns": [str(i)]} for i, c in enumerate("aabacbbc")]
    assert [p["turns"][0] for p in bench.per_category(ps, 2)] == ["0", "1", "2", "4", "5", "7"]
    assert [p["turns"][0] for p in bench.per_category(ps, 2, ["c", "a"])] == ["0", "1", "4", "7"]
    with pytest.raises(ValueError, match=r"no prompts of categories \['z'\].*'a', 'b', 'c'"):
        bench.per_category(ps, 2, ["a", "z"])
    with pytest.raises(SystemExit):  # --categories without --per-category: argparse names the problem
        bench.main(["--categories", "a"])
    # skip: the next n of each, disjoint from the first n; a category left empty is refused, not dropped
    assert [p["turns"][0] for p in bench.per_category(ps, 2, skip=1)] == ["1", "3", "5", "6", "7"]
    assert [p["turns"][0] for p in bench.per_category(ps, 1, ["a", "b"], skip=2)] == ["3", "6"]
    with pytest.raises(ValueError, match=r"first 2 prompts of every category leaves none of \['c'\]"):
        bench.per_category(ps, 2, skip=2)
    with pytest.raises(ValueError, match="n >= 1 and skip >= 0"):
        bench.per_category(ps, 2, skip=-1)
    with pytest.raises(SystemExit):
        bench.main(["--skip", "2"])


def test_mtp_auto_depth_by_hand():
    from specbook.drafters.mtp import auto_depth, chain_survival

    card = {"config": {"modules": 3}, "heldout": {"acc_1": 0.8, "acc_2": 0.5, "acc_3": 0.5}}
    assert chain_survival(card) == pytest.approx([0.8, 0.4, 0.2])
    flat = {1: 1.0, 4: 1.0}  # verification free up to 4 tokens: (1 + .8 + .4 + .2) / (1 + 3c)
    assert auto_depth(card, flat, module_cost=0.0) == 3
    assert auto_depth(card, flat, module_cost=0.2) == 2  # 2.2 / 1.4 = 1.571 beats 2.4 / 1.6 = 1.5 and 1.8 / 1.2
    assert auto_depth(card, {1: 1.0, 2: 2.0}, module_cost=0.0) == 1  # every extra token costs a full forward


def test_step_split_by_hand():
    a = {"draft_seconds": 0.3, "verify_seconds": 1.2, "draft_forwards": 40, "steps": 20}
    assert bench.step_split(a) == {"draft_ms_per_step": 15.0, "verify_ms_per_step": 60.0,
                                   "draft_forwards_per_step": 2.0}
    assert bench.step_split({**a, "steps": 0}) == {}  # a run that never stepped (EOS at once) has no split
    assert bench.step_split({**a, "draft_seconds": None, "steps": None}) == {}  # a method outside our loop


def test_monotone_latency_by_hand():
    # 8 tokens measured slower than 16: noise only adds time, and 8 padded to 16 costs 54.7, so 8 is lowered
    lat = {1: 45.8, 2: 49.9, 4: 49.9, 8: 55.7, 16: 54.7, 32: 63.6}
    assert roofline.monotone_latency(lat) == {1: 45.8, 2: 49.9, 4: 49.9, 8: 54.7, 16: 54.7, 32: 63.6}
    # one slow point at a small k moves nothing after it (a running maximum would lift 4 and 8 to 60)
    assert roofline.monotone_latency({1: 40.0, 2: 60.0, 4: 42.0, 8: 44.0}) == {1: 40.0, 2: 42.0, 4: 42.0, 8: 44.0}
    assert list(roofline.monotone_latency({4: 2.0, 1: 3.0}).items()) == [(1, 2.0), (4, 2.0)]  # keys in any order


@pytest.mark.slow
def test_bench_cli_json_contract(tmp_path, real, monkeypatch):
    model, tok = real
    prompts = load_prompts("eval", limit=2)
    res = bench.run_bench(["hf_generate"], prompts, max_new_tokens=6, model=model, tokenizer=tok, progress=False)
    assert set(res) >= {"machine", "settings", "rows"}
    for r in res["rows"]:
        assert set(r) >= {"method", "tokens_per_s", "tau", "speedup", "target_forwards", "new_tokens", "peak_mem_mb"}
    ar = next(r for r in res["rows"] if r["method"] == "ar")
    assert ar["speedup"] == 1.0 and ar["tau"] == 1.0
    # the CLI end to end (same model through the loader; eager static cache: compiled graphs are test_fastpath's)
    out = tmp_path / "b.json"
    bench.main(["--methods", "ar", "--limit", "1", "--max-new-tokens", "4", "--dtype", "fp32", "--no-compile",
                "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["rows"][0]["method"] == "ar" and "command" in data["settings"]
    assert data["settings"]["forward"] == "static"


@pytest.mark.slow
def test_bench_auto_trees_record_what_they_measured(real):
    """medusa / eagle / eagle2 with "auto" sizes: the run measures the latency curve and the draft cost once,
    sizes the static trees from them, and the JSON says what was used (so the numbers can be reproduced)."""
    model, tok = real
    res = bench.run_bench(["medusa", "eagle", "eagle2"], load_prompts("eval", limit=1), max_new_tokens=8, model=model,
                          tokenizer=tok, progress=False)
    s = res["settings"]
    assert sorted(s["latency_s"]) == [1, 2, 4, 8, 16, 32, 64] and all(v > 0 for v in s["latency_s"].values())
    assert s["eagle"]["nodes"] == bench.EagleSettings().nodes == "auto" and s["eagle"]["draft_cost_s"] > 0
    assert len(s["eagle"]["static_choices"]) >= 1 and len(s["medusa_choices"]) >= 1
    assert max(len(c) for c in s["eagle"]["static_choices"]) <= bench.EagleSettings().depth
    lat = [s["latency_s"][k] for k in sorted(s["latency_s"])]
    assert lat == sorted(lat)  # made non-decreasing in k (roofline.monotone_latency)
    from specbook.drafters.eagle import confidence_calibration, load_eagle
    from specbook.train import CKPT_DIR

    # eagle2's calibration is the committed card's (held-out top-1 hit rate / top-1 confidence): the head is underconfident
    assert s["eagle"]["eagle2_calibration"] == confidence_calibration(load_eagle(model, CKPT_DIR / "eagle")[2]) > 1.0
    for r in res["rows"]:
        assert r["tau"] >= 1.0 and r["new_tokens"] >= 8
        if r["method"] == "ar":
            assert "draft_ms_per_step" not in r  # not our speculative loop: no step split
        else:  # the step split: every step runs the heads (Medusa) or at least the head's catch-up (EAGLE)
            assert r["draft_ms_per_step"] > 0 and r["verify_ms_per_step"] > 0
            assert r["draft_forwards_per_step"] >= 1.0


def test_variant_names_parse_and_refuse_clearly():
    assert bench.parse_variant("eagle2") == ("eagle2", {})
    assert bench.parse_variant("eagle2[children=iid]") == ("eagle2", {("eagle", "children"): "iid"})
    # a bare field two groups have resolves to the method's own group; group.field always works
    assert bench.parse_variant("eagle2[depth=6;top_k=4]") == ("eagle2", {("eagle", "depth"): 6, ("eagle", "top_k"): 4})
    assert bench.parse_variant("mtp[depth=2]") == ("mtp", {("mtp", "depth"): 2})
    assert bench.parse_variant("pld[lookup.k=1]") == ("pld", {("lookup", "k"): 1})
    for bad, msg in [("sps[depth=6]", "ambiguous"), ("eagle2[nope=1]", "unknown"), ("nope[k=1]", "unknown method"),
                     ("eagle2[children]", "key=value"), ("eagle2[", "bad method")]:
        with pytest.raises(ValueError, match=msg):
            bench.parse_variant(bad)
    with pytest.raises(ValueError, match="children must be one of"):  # values are validated by the settings
        bench._variant_ctx(bench.BenchContext(model=None, tokenizer=None, sampling=None, max_new_tokens=1),
                           "eagle2[children=sorted]")


@pytest.mark.slow
def test_a_variant_runs_with_its_own_settings_in_the_same_run(real):
    model, tok = real
    res = bench.run_bench(["pld", "pld[k=1]"], load_prompts("eval", limit=1), max_new_tokens=12, model=model,
                          tokenizer=tok, progress=False)
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"ar", "pld", "pld[k=1]"}
    assert rows["pld[k=1]"]["tau"] <= 2.0  # one draft token per step at most: the override took effect
    assert res["settings"]["variants"] == {"pld[k=1]": {"lookup.k": 1}}
    assert res["settings"]["lookup"]["k"] == bench.LookupSettings().k  # the plain method keeps the run's settings


def test_block_settings_validate_and_variants_reach_them():
    from specbook.bench import BlockSettings, parse_variant

    assert parse_variant("dspark[threshold=0.5;gamma=3]") == ("dspark", {("block", "threshold"): 0.5,
                                                                         ("block", "gamma"): 3})
    assert parse_variant("dflash[gamma=4]") == ("dflash", {("block", "gamma"): 4})
    for bad in ({"gamma": 0}, {"threshold": 1.5}, {"threshold": "high"}, {"threshold": None}, {"calibration": "tf"}):
        with pytest.raises(ValueError, match="gamma|threshold|calibration"):
            BlockSettings(**bad)
    assert parse_variant("dspark[calibration=held_out]") == ("dspark", {("block", "calibration"): "held_out"})


def test_dspark_calibration_setting_picks_what_the_drafter_reads():
    from specbook.bench import BlockSettings

    tf, loop = {"greedy": [0.9]}, {"temperatures": {"greedy": [1.2]}, "shifts": {"greedy": [-0.5]}}
    card = {"calibration": {"temperatures": tf, "in_loop": loop}}
    assert BlockSettings().survival_calibration(card) == loop  # the default reads the card's in-loop fit
    assert BlockSettings(calibration="held_out").survival_calibration(card) == {"temperatures": tf, "shifts": None}
    assert BlockSettings(calibration="none").survival_calibration(card) == {"temperatures": None, "shifts": None}
    assert BlockSettings().survival_calibration({"calibration": {"temperatures": tf}}) == {"temperatures": tf,
                                                                                           "shifts": None}


def test_checkpoint_variants_read_another_folder_and_share_the_run(tmp_path):
    """``M[checkpoints=F]``: the same method reading drafters from another folder, side by side with ``M`` in one
    run; it loads its own drafters and shares the run's target, latency curves and draft vocabulary."""
    from specbook.train import CKPT_DIR

    assert bench.parse_variant(f"eagle2[checkpoints={tmp_path}]") == ("eagle2", {("drafters", "checkpoints"): str(tmp_path)})
    assert bench.DrafterSettings().folder() == CKPT_DIR
    assert bench.DrafterSettings(checkpoints=str(tmp_path)).folder() == tmp_path
    assert bench.DrafterSettings(checkpoints="data/checkpoints").folder() == CKPT_DIR  # relative: the repo root
    ctx = bench.BenchContext(model=None, tokenizer=None, sampling=None, max_new_tokens=1)
    with pytest.raises(ValueError, match="checkpoints folder .*nowhere.* does not exist"):
        bench._variant_ctx(ctx, "eagle2[checkpoints=/nowhere]")
    _, vctx = bench._variant_ctx(ctx, f"eagle2[checkpoints={tmp_path}]")
    _, again = bench._variant_ctx(ctx, f"medusa[checkpoints={tmp_path}]")
    assert vctx.loaded is again.loaded is not ctx.loaded  # one sibling per folder
    assert vctx.loaded.targets is ctx.loaded.targets and vctx.loaded.latency_by is ctx.loaded.latency_by
    assert vctx.loaded.draft_vocab is ctx.loaded.draft_vocab and vctx.loaded.cards is not ctx.loaded.cards
    assert bench.checkpoint(vctx, "eagle") == tmp_path / "eagle" and bench.checkpoint(ctx, "eagle") == CKPT_DIR / "eagle"


@pytest.mark.slow
def test_a_checkpoint_variant_runs_the_other_folder(real, tmp_path):
    """Medusa with the committed heads and with a copy of them in another folder: identical tokens and tau (the
    same weights), the JSON names each folder and the corpus the heads were trained on; a folder without the
    method's checkpoint is refused naming the file and how to train it."""
    import shutil

    from specbook.train import CKPT_DIR
    from specbook.training import CheckpointError

    model, tok = real
    for suffix in (".json", ".safetensors"):
        shutil.copy(CKPT_DIR / f"medusa{suffix}", tmp_path / f"medusa{suffix}")
    v = f"medusa[checkpoints={tmp_path}]"
    res = bench.run_bench(["medusa", v], load_prompts("eval", limit=1), max_new_tokens=12, model=model,
                          tokenizer=tok, progress=False)
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["medusa"]["tau"] == rows[v]["tau"] and rows["medusa"]["new_tokens"] == rows[v]["new_tokens"]
    ck = res["settings"]["checkpoints"]
    assert ck["medusa"]["medusa"]["folder"] == "data/checkpoints" and ck[v]["medusa"]["folder"] == str(tmp_path)
    assert ck[v]["medusa"]["corpus_sha"] == ck["medusa"]["medusa"]["corpus_sha"] is not None
    with pytest.raises(CheckpointError, match="needs both eagle.safetensors and eagle.json.*specbook.train eagle"):
        bench.run_bench([f"eagle[checkpoints={tmp_path}]"], load_prompts("eval", limit=1), max_new_tokens=4,
                        model=model, tokenizer=tok, progress=False)
