"""specbook.data_scaling: each run is one `python -m specbook.train` command; the committed figure's JSON is what
its own command makes."""
import json
import shlex

import matplotlib
import pytest

from specbook import data_scaling, report, train

matplotlib.use("Agg")


def test_each_run_is_a_train_command_that_differs_only_in_its_fraction(tmp_path):
    ns = data_scaling.parse_args(["--records", "3200", "--steps", "800"])
    a = data_scaling.run_argv("eagle3", 0.25, ns, tmp_path / "a" / "eagle3")
    b = data_scaling.run_argv("eagle3", 1.0, ns, tmp_path / "a" / "eagle3")
    pa, pb = train.parser().parse_args(a), train.parser().parse_args(b)
    assert (pa.method, pa.train_fraction, pb.train_fraction) == ("eagle3", 0.25, 1.0)
    assert (pa.records, pa.steps, pa.eval_batches, pa.ttt_steps, pa.force) == (3200, 800, 16, 4, True)
    assert {k: v for k, v in vars(pa).items() if k != "train_fraction"} == \
        {k: v for k, v in vars(pb).items() if k != "train_fraction"}
    e = train.parser().parse_args(data_scaling.run_argv("eagle", 0.5, ns, tmp_path / "eagle"))
    assert e.method == "eagle" and e.ttt_steps == 7  # eagle: no unroll flag (the parser's default is unused)


def _card(method, fraction, acc):
    s1, s2 = data_scaling.STEP_METRICS[method]
    evals = [{"step": 200 * (i + 1), s1: a, s2: a - 0.1, "other": 0.0} for i, a in enumerate(acc)]
    return {"evals": evals, "train_records": int(1000 * fraction), "train_tokens": int(300_000 * fraction),
            "steps": 200 * len(acc), "train_seconds": 12.0, "corpus_sha": "abc", "command": "python -m specbook.train x"}


def test_summary_reads_step_one_and_two_by_method_and_the_page_and_plot_show_them():
    runs = [data_scaling.summarize(m, f, _card(m, f, [0.2 * f, 0.3 * f + (0.1 if m == "eagle3" else 0)]))
            for m in ("eagle", "eagle3") for f in (0.25, 1.0)]
    assert runs[1]["final"] == {"step": 400, "step1": 0.3, "step2": pytest.approx(0.2)}
    assert runs[3]["final"]["step1"] == pytest.approx(0.4) and runs[3]["method"] == "eagle3"
    res = {"command": "python -m specbook.data_scaling", "records": 3200, "methods": ["eagle", "eagle3"],
           "fractions": [0.25, 1.0], "runs": runs}
    page = report.scaling_section("x", res)
    assert "| eagle3 | 1 | 1000 | 300000 | 400 | 0.400 | 0.300 | 0.400 | 12 |" in page
    axes = data_scaling.plot(res)
    assert len(axes[0].lines) == 4 and len(axes[1].lines) == 4
    assert list(axes[0].lines[2].get_ydata()) == [pytest.approx(0.175), pytest.approx(0.4)]  # eagle3 step 1


def test_bad_methods_and_fractions_are_refused_before_any_training():
    with pytest.raises(SystemExit, match="not \\['medusa'\\]"):
        data_scaling.main(["--methods", "eagle,medusa"])
    with pytest.raises(SystemExit, match="in \\(0, 1\\]"):
        data_scaling.main(["--fractions", "0.5,2"])


def test_committed_scaling_runs_are_what_their_command_makes():
    """Every run in a committed JSON is the train command data_scaling builds from the JSON's own command line, the
    fractions are nested (more train records for a larger part) and every run of a method took the same steps."""
    for f in sorted(report.SCALING_DIR.glob("*.json")):
        d = json.loads(f.read_text())
        argv = shlex.split(d["command"])[3:]  # after "python -m specbook.data_scaling"
        seen = {}
        for r in d["runs"]:
            targv = shlex.split(r["command"])[3:]
            out = targv[targv.index("--out") + 1]
            ns = data_scaling.parse_args(argv)
            assert targv == data_scaling.run_argv(r["method"], r["fraction"], ns, out), (f.name, r["method"])
            seen.setdefault(r["method"], []).append(r)
        assert set(seen) == set(d["methods"])
        for frac in d["fractions"]:  # every head of one part trained on the same records
            assert len({(r["train_records"], r["train_tokens"]) for r in d["runs"] if r["fraction"] == frac}) == 1
        for rs in seen.values():
            rs.sort(key=lambda r: r["fraction"])
            assert [r["fraction"] for r in rs] == sorted(d["fractions"])
            assert all(a["train_records"] < b["train_records"] for a, b in zip(rs, rs[1:]))
            assert len({r["steps"] for r in rs}) == 1 and len({r["corpus_sha"] for r in rs}) == 1
