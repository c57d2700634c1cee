"""The README and the results page: generated from what was measured, and the example runs."""
import re

import pytest

from specbook import report


def test_results_page_is_regenerated_byte_for_byte():
    """docs/RESULTS.md and the README's results table are exactly what `python -m specbook.report results` writes
    from the committed bench JSONs (no hand-typed numbers)."""
    assert report.RESULTS.read_text() == report.results_page()
    readme = report.README.read_text()
    assert report.with_readme_block(readme, report.readme_block()) == readme


def test_results_page_prices_drafting_and_shows_the_latency_curve():
    """The results page says what each method would reach with free drafting (its step time minus the drafting) and
    prints the run's latency(k) / latency(1): the two facts that bound a speculative speedup."""
    from specbook.report import _latency_line, draft_free

    assert draft_free({"speedup": 1.5, "draft_ms_per_step": 10.0, "verify_ms_per_step": 30.0}) == 2.0
    assert draft_free({"speedup": 1.0, "tau": 1.0}) is None  # ar: no step split
    line = _latency_line({"forward": "compiled", "latency_s_by_forward": {"compiled": {"1": 0.02, "16": 0.03}},
                          "latency_s": {"1": 1.0}})
    assert "k = 16: 1.50" in line and "latency(1) = 20.0 ms" in line
    assert _latency_line({}) == ""


def test_readme_block_needs_its_markers():
    with pytest.raises(ValueError, match="results markers"):
        report.with_readme_block("# no markers here\n", report.readme_block())


def test_every_bench_command_the_readme_shows_names_a_real_method_and_json():
    from specbook.bench import METHODS, parse_variant_base

    readme = report.README.read_text().replace("\\\n", " ")
    cmds = re.findall(r"python -m specbook\.bench ([^\n`]+)", readme)
    assert cmds
    for c in cmds:
        methods = re.search(r"--methods (\S+)", c)
        if methods:
            assert {parse_variant_base(m) for m in methods.group(1).strip("\"'").split(",")} <= set(METHODS), c
        out = re.search(r"--json (\S+)", c)
        if out and out.group(1).startswith("docs/"):
            assert (report.ROOT / out.group(1)).exists(), c


@pytest.mark.slow
def test_readme_python_example_runs(capsys):
    """The README's "Use it from Python" example, executed as written."""
    readme = report.README.read_text()
    section = readme[readme.index("## Use it from Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    tau = float(re.search(r"tau = ([0-9.]+)", out).group(1))
    assert tau > 1.0, out


HISTORY = re.compile(r"\b(stops? \d+|issue|the brief|earlier stop|first run on|[0-9a-f]{7,40})\b", re.I)


def test_notebook_markdown_has_no_project_history():
    """Prose stays true on every rerun: no commit hashes, "stop N", "issue" or other project history in the
    notebooks' markdown (git keeps history)."""
    import json

    bad = []
    for nb in sorted((report.ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                bad += [f"{nb.name} cell {i}: {m.group(0)!r}" for m in HISTORY.finditer("".join(cell["source"]))]
    assert not bad, bad


NOISE = re.compile(r"(\w*Warning\b|[Dd]eprecat\w*|(?<![\d.])0%\|)")  # warnings, deprecations, a bar still at 0%


def _output_texts(cell: dict):
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            yield "stream", "".join(o["text"])
        for kind in ("text/plain", "text/markdown", "text/html"):
            if kind in o.get("data", {}):
                yield kind, "".join(o["data"][kind])


def test_committed_notebook_outputs_are_clean():
    """What a reader sees in a committed notebook is the run's result: no warnings, deprecation notices or
    progress bars left at 0% in any output or saved widget state, and no project history in the Markdown the
    cells generate."""
    import json

    bad = []
    for nb in sorted((report.ROOT / "notebooks").glob("*.ipynb")):
        d = json.loads(nb.read_text())
        for i, cell in enumerate(d["cells"]):
            for kind, text in _output_texts(cell):
                bad += [f"{nb.name} cell {i} ({kind}): {m.group(0)!r}" for m in NOISE.finditer(text)]
                if kind == "text/markdown":
                    bad += [f"{nb.name} cell {i} (generated Markdown): {m.group(0)!r}" for m in HISTORY.finditer(text)]
        widgets = json.dumps(d.get("metadata", {}).get("widgets", {}))
        bad += [f"{nb.name} saved widget state: {m.group(0)!r}" for m in NOISE.finditer(widgets)]
    assert not bad, bad


def test_output_scan_catches_what_it_names():
    cell = {"outputs": [{"output_type": "stream", "text": ["x.py:3: FutureWarning: `a` is deprecated\n"]},
                        {"output_type": "display_data", "data": {"text/plain": ["Loading:   0%|          | 0/272"]}},
                        {"output_type": "display_data", "data": {"text/plain": ["Loading: 100%|##########| 272/272"]}}]}
    found = [m.group(0) for _, t in _output_texts(cell) for m in NOISE.finditer(t)]
    assert found == ["FutureWarning", "deprecated", "0%|"]


def _executed(path, summary: dict):
    import json

    cell = {"cell_type": "code", "source": "", "metadata": {}, "execution_count": 1,
            "outputs": [{"output_type": "stream", "name": "stdout", "text": report.TAG + json.dumps(summary) + "\n"}]}
    path.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))


def test_tour_summary_never_calls_smoke_figures_results(tmp_path, capsys):
    """The tour's summary of a --quick run (SPECBOOK_FAST=1) says its figures are a smoke run, not results;
    a full-size run is labelled as such."""
    _executed(tmp_path / "01_x.ipynb", {"notebook": "01_x", "fast": True, "tau": 9.9})
    report.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "Smoke-run summary" in out and "they are not results" in out and "Results summary" not in out
    _executed(tmp_path / "01_x.ipynb", {"notebook": "01_x", "fast": False, "tau": 2.1})
    report.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "Results summary (full-size notebook runs)" in out and "Smoke" not in out


def test_checkpoint_table_compares_two_sets_of_drafters_per_category():
    """The results page's per-category table for ``M`` against ``M[checkpoints=F]``: tau per category, the change
    from the method's own drafters to the folder's (whatever each was trained on), and both pooled
    (tokens / forwards) over the template categories and over the broad ones."""
    v = "eagle2[checkpoints=data/checkpoints/other]"

    def r(cat, m, tokens, forwards):
        return {"category": cat, "method": m, "new_tokens": tokens, "target_forwards": forwards}

    def card(folder, sha, records):
        return {"eagle": {"folder": folder, "corpus_sha": sha, "corpus_records": records, "steps": 8}}

    rows = [r("qa", "eagle2", 300, 100), r("qa", v, 200, 100), r("code_fix", "eagle2", 100, 50),
            r("code_fix", v, 100, 100), r("math_word", "eagle2", 90, 30), r("math_word", v, 90, 45), r("qa", "ar", 100, 100)]
    d = {"rows": [{"method": m} for m in ("ar", "eagle2", v)], "by_category": rows,
         "settings": {"checkpoints": {"eagle2": card("data/checkpoints", "new", 2),
                                      v: card("data/checkpoints/other", "old", 1)}}}
    assert report.checkpoint_pairs(d) == [("eagle2", v, "data/checkpoints/other")]
    table = report.checkpoint_table(d)
    assert f"| category | eagle2 | {v} | change |" in table  # the method's own drafters first, the folder's second
    assert "| qa | 3.0 | 2.0 | -33.3% |" in table and "| code_fix | 2.0 | 1.0 | -50.0% |" in table
    assert "| **template categories** (1) | 3.0 | 2.0 | -33.3% |" in table
    assert "| **broad categories** (2) | 2.375 | 1.31 | -44.8% |" in table  # (100+90)/(50+30), (100+90)/(100+45)
    assert f"{v} 0.66, eagle2 0.79" in table  # 1.31 / 2.0 and 2.375 / 3.0
    assert f"worst per-category change, second against first: {v} code_fix -50.0%" in table
    assert "data/checkpoints/other/eagle (corpus old, 1 records" in table and "(corpus new, 2 records" in table
    # record counts do not turn the pair round (a spread subset of a larger corpus has fewer records)
    d["settings"]["checkpoints"] = {"eagle2": card("data/checkpoints", "old", 1), v: card("data/checkpoints/other", "new", 2)}
    assert f"| category | eagle2 | {v} | change |" in report.checkpoint_table(d)
    d["settings"]["checkpoints"]["eagle2"]["eagle"]["corpus_records"] = None  # a card older than the field
    assert "(corpus old, record count not on its card, 8 steps)" in report.checkpoint_table(d)
    assert report.checkpoint_table({"rows": [{"method": "eagle2"}], "by_category": []}) == ""
    d["by_category"] = [x for x in rows if x["category"] == "qa"]  # template categories only: no empty broad row
    table = report.checkpoint_table(d)
    assert "**template categories** (1)" in table and "broad categories" not in table
    d["by_category"] = [{**x, "category": c} for x, c in zip(rows[:4], ("256", "256", "8000", "8000"))]
    table = report.checkpoint_table(d)  # a long-context sweep: its categories are context lengths, not prompt kinds
    assert "| **every context length** (2) | 2.667 | 1.5 | -43.8% |" in table and "categories**" not in table


def test_change_interval_is_a_paired_bootstrap_over_prompts():
    """The bracketed interval beside a per-category change: prompts resampled within each category, both methods on
    the same draw. Checked where the answer is known: a method that equals the other on every prompt has the
    interval [0, 0]; one whose tau is twice the other's on every prompt has [+100%, +100%], whatever the draw; a
    change that flips sign between prompts spans zero; a run without per-prompt counts gets no interval."""
    v = "medusa[checkpoints=x]"

    def run(old, new, cats):
        return {"by_prompt": {"categories": cats, "methods": {
            "medusa": {"new_tokens": [t for t, _ in old], "target_forwards": [f for _, f in old]},
            v: {"new_tokens": [t for t, _ in new], "target_forwards": [f for _, f in new]}}}}

    same = [(30, 10), (50, 40), (20, 20)]
    assert report.change_interval(run(same, same, ["qa"] * 3), "medusa", v, ["qa"]) == (0.0, 0.0)
    double = [(60, 10), (100, 40), (40, 20)]
    lo, hi = report.change_interval(run(same, double, ["qa"] * 3), "medusa", v, ["qa"])
    assert lo == pytest.approx(1.0) and hi == pytest.approx(1.0)
    mixed = [(60, 10), (25, 40), (20, 20)]  # better on one prompt, worse on another
    lo, hi = report.change_interval(run(same, mixed, ["qa"] * 3), "medusa", v, ["qa"])
    assert lo < 0 < hi
    # a pooled group resamples each category on its own: a category of one prompt is always in the draw
    d = run(same + [(10, 10)], mixed + [(10, 10)], ["qa"] * 3 + ["rag"])
    assert report.change_interval(d, "medusa", v, ["rag"]) == (0.0, 0.0)
    assert report.change_interval(d, "medusa", v, ["translation"]) is None  # no prompts of it
    assert report.change_interval({}, "medusa", v, ["qa"]) is None
    assert report._change_cell(2.0, 1.5, (-0.4, -0.1)) == "-25.0% [-40, -10]"


def test_versus_lines_compare_a_method_with_its_rival_per_second_and_per_forward():
    """A run holding dspark and eagle2: dspark's tokens/s and tau against eagle2's, each interval paired over the
    prompts; a dspark twice as fast on every prompt reads [+100, +100] for speed whatever its tau."""
    bp = {"categories": ["qa", "qa", "rag"], "methods": {
        "eagle2": {"new_tokens": [30, 50, 20], "target_forwards": [10, 20, 10], "seconds": [1.0, 2.0, 1.0]},
        "dspark": {"new_tokens": [30, 50, 20], "target_forwards": [15, 25, 10], "seconds": [0.5, 1.0, 0.5]}}}
    rows = [{"method": "ar", "tokens_per_s": 10.0, "tau": 1.0}, {"method": "eagle2", "tokens_per_s": 25.0, "tau": 2.5},
            {"method": "dspark", "tokens_per_s": 50.0, "tau": 2.0}]
    line = report.versus_lines({"rows": rows, "by_prompt": bp})
    assert line.startswith("- dspark against eagle2 in this run: tokens/s +100.0% [+100, +100], tau -20.0% [")
    assert report.change_interval({"by_prompt": bp}, "eagle2", "dspark", ["qa", "rag"], per="seconds") == \
        pytest.approx((1.0, 1.0))
    assert report.versus_lines({"rows": rows[:2], "by_prompt": bp}) == ""  # no dspark in the run: no line


def test_checkpoint_table_names_the_losses_beyond_noise():
    """With per-prompt counts, each change gets its interval, and a category is named as losing more than 5% only
    when its whole interval lies below -5%."""
    v = "medusa[checkpoints=x]"
    cats = ["qa"] * 3 + ["rag"] * 3
    old = [(30, 10)] * 3 + [(30, 10), (30, 10), (30, 10)]
    new = [(15, 10)] * 3 + [(45, 10), (15, 10), (30, 10)]  # qa: -50% on every prompt; rag: -50%..+50%, pooled 0%
    rows = [{"category": c, "method": m, "new_tokens": sum(t for (t, _), k in zip(x, cats) if k == c),
             "target_forwards": sum(f for (_, f), k in zip(x, cats) if k == c)}
            for c in ("qa", "rag") for m, x in (("medusa", old), (v, new))]
    d = {"rows": [{"method": m} for m in ("ar", "medusa", v)], "by_category": rows, "settings": {},
         "by_prompt": {"categories": cats, "methods": {
             m: {"new_tokens": [t for t, _ in x], "target_forwards": [f for _, f in x]} for m, x in (("medusa", old), (v, new))}}}
    table = report.checkpoint_table(d)
    assert "| qa | 3.0 | 1.5 | -50.0% [-50, -50] |" in table
    assert "| rag | 3.0 | 3.0 | +0.0% [" in table
    assert f"whose whole interval lies below -5%: {v} qa -50.0% [-50, -50]" in table
    del d["by_prompt"]
    assert "| qa | 3.0 | 1.5 | -50.0% |" in report.checkpoint_table(d) and "interval" not in report.checkpoint_table(d)


def test_template_categories_are_the_template_sets():
    from specbook.prompts import TEMPLATE_CATEGORIES, build

    tr, ev = build(broad=False)
    assert set(TEMPLATE_CATEGORIES) == {r["category"] for r in tr + ev}


def test_every_committed_drafter_is_trained_on_the_committed_corpus_or_a_spread_subset(tmp_path):
    """What data/checkpoints/README.md and the README say: each card's corpus sha is the committed corpus's, or
    that of the evenly spaced subset of it with the card's record count (`train --records N`)."""
    import json

    from specbook.corpus import load_corpus, subset

    corpus = load_corpus()
    cards = {p.stem: json.loads(p.read_text()) for p in (report.ROOT / "data" / "checkpoints").glob("*.json")}
    assert {"eagle", "medusa", "mtp", "draft_model", "eagle3", "dflash", "dspark"} <= set(cards)
    subsets = {}
    for kind, card in cards.items():
        n = card.get("corpus_records")
        if card["corpus_sha"] != corpus.sha:
            assert n and n < len(corpus), f"{kind}: corpus {card['corpus_sha']} is not the committed corpus"
            subsets.setdefault(n, subset(corpus, n, tmp_path / str(n), spread=True).sha)
            assert card["corpus_sha"] == subsets[n], f"{kind}: corpus {card['corpus_sha']} is no subset of data/corpus"


def test_every_run_says_which_checkpoints_it_read():
    card = {"folder": "data/checkpoints", "corpus_sha": "abc", "corpus_records": 3, "steps": 8}
    s = {"checkpoints": {"eagle2": {"eagle": card}, "eagle": {"eagle": card},
                         "mtp": {"mtp": {**card, "corpus_sha": "def"}}}}
    line = report._checkpoints_line(s)
    assert "data/checkpoints/eagle (corpus abc), data/checkpoints/mtp (corpus def)." in line
    assert line.count("(corpus abc)") == 1  # one entry per checkpoint, however many methods read it
    assert "none" in report._checkpoints_line({"checkpoints": {}})
    assert "not recorded" in report._checkpoints_line({})


def test_the_benchs_default_child_rule_is_no_slower_than_top_k_in_the_committed_t1_run():
    """The bench's default child rule at T > 0 is chosen by measurement: the README's T = 1 run records the default
    it ran under, and there eagle2 with it is at least as fast as eagle2 with the papers' top-k picks."""
    import json

    from specbook.bench import EagleSettings

    d = json.loads((report.ROOT / "docs" / "bench" / "cpu_bf16_t1_compiled.json").read_text())
    assert d["settings"]["eagle"]["children"] == EagleSettings().children
    by = {r["method"]: r for r in d["rows"]}
    assert by["eagle2"]["speedup"] >= by["eagle2[children=topk]"]["speedup"]


def test_a_serving_runs_calibration_reads_in_words_old_and_new():
    """Runs recorded DSpark's temperatures alone; with the in-loop fit they record temperatures and shifts."""
    old = {"greedy": [0.5, 2.0], "sampled": [1.0, 1.0]}
    new = {"temperatures": old, "shifts": {"greedy": [-0.4, 0.0], "sampled": [0.0, 0.0]}}
    assert report._survival_calibration(old, "greedy") == "per-position temperatures (greedy) 0.50, 2.00"
    assert report._survival_calibration(new, "greedy") == ("per-position temperatures (greedy) 0.50, 2.00 and shifts "
                                                           "-0.4, +0.0")
    assert report._survival_calibration({"temperatures": old, "shifts": None}, "sampled").endswith("1.00, 1.00")
    assert report._survival_calibration(1.25, "greedy") == "x 1.250"
    assert report._survival_calibration(None, "greedy") == "none"
