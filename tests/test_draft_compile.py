"""draft_compile: the drafters' forwards compiled beside eager — same weights, same outputs, each drafter's own
cost measurement on both, and the results-page section that reads the probe's JSON."""

import json

import pytest
import torch

from specbook import draft_compile, report
from specbook.drafters.dflash import BlockNet
from specbook.drafters.eagle import EagleHead
from specbook.drafters.eagle3 import Eagle3Head
from specbook.drafters.medusa import MedusaHeads
from specbook.drafters.mtp import MTPModules


def _nets(tiny):
    torch.manual_seed(0)
    vocab = torch.arange(0, tiny.config.vocab_size, 2)
    return {"medusa": (MedusaHeads(tiny.config.hidden_size, 3).eval(), vocab),
            "eagle": (EagleHead(tiny.config).eval(), None),
            "eagle3": (Eagle3Head(tiny.config, vocab, taps=(0, 1, 2)).eval(), None),
            "mtp": (MTPModules(tiny.config, 2).eval(), None),
            "dspark": (BlockNet(tiny.config, vocab, gamma=3, taps=(1, 2), markov_rank=4, confidence=True).eval(), None)}


def test_compiled_copy_shares_weights_and_leaves_the_original_eager(tiny):
    head = EagleHead(tiny.config).eval()
    twin = draft_compile.compiled_copy(head)
    assert twin.fc.weight is head.fc.weight and twin.hidden == head.hidden
    assert "forward" not in vars(head)  # the original's forward is untouched
    H = tiny.config.hidden_size
    x = torch.randn(1, 5, H)
    pos = torch.arange(5)[None]
    with torch.inference_mode():
        torch.testing.assert_close(twin(x, x, position_ids=pos), head(x, x, position_ids=pos), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", draft_compile.HEADS)
def test_each_drafters_cost_measurement_runs_eager_and_compiled(tiny, kind):
    """Every drafter's own cost function accepts its compiled twin (the probe's two sides measure one thing)."""
    net, vocab = _nets(tiny)[kind]
    for side in (net, draft_compile._compiled(kind, net, dynamic=False)):
        assert draft_compile._cost(tiny, kind, side, vocab, context=8) > 0


def test_probe_needs_the_committed_drafters_and_names_an_unknown_one(tiny):
    with pytest.raises(ValueError, match="unknown drafter 'pld'"):
        draft_compile._load(tiny, "pld", None)
    with pytest.raises(SystemExit, match="--repeats"):
        draft_compile.main(["--repeats", "0"])


def _probe_beside_a_headline(tmp_path, row: dict) -> tuple[dict, dict]:
    """A probe of one row on "CPU A", and a headline T = 0 run on the same CPU written into ``tmp_path`` whose mtp
    step is 8 ms of drafting and 32 ms of verifying -> (probe, headline)."""
    probe = {"machine": {"cpu": "CPU A"}, "rows": [row], "settings": {
        "threads": 2, "dtype": "bfloat16", "context": 256, "repeats": 3, "command": "python -m specbook.draft_compile"}}
    head = {"machine": {"cpu": "CPU A"}, "rows": [{"method": "mtp", "draft_ms_per_step": 8.0, "verify_ms_per_step": 32.0}]}
    (tmp_path / report.README_RUNS[0]).write_text(json.dumps(head))
    return probe, head


def test_results_section_prices_a_step_only_on_the_headline_runs_machine(tmp_path):
    row = {"drafter": "mtp", "eager_ms": 2.0, "fixed_ms": 1.5, "dynamic_ms": 1.6, "fixed_over_eager": 0.75,
           "dynamic_over_eager": 0.8, "compile_s": {"fixed": 1.0, "dynamic": 2.0}}
    probe, head = _probe_beside_a_headline(tmp_path, row)
    text = report.draft_compile_section("probe", probe, tmp_path)
    assert "| mtp | 2.0 | 1.5 | 1.6 | 0.75 | 0.8 | 1.0, 2.0 |" in text
    assert "mtp 5.0%" in text  # (1 - 0.75) x 8 ms of a 40 ms step
    head["machine"]["cpu"] = "CPU B"
    (tmp_path / report.README_RUNS[0]).write_text(json.dumps(head))
    text = report.draft_compile_section("probe", probe, tmp_path)
    assert "No T = 0 compiled-forward bench run on this CPU" in text and "5.0%" not in text
    head["machine"]["cpu"] = "CPU A"  # another T = 0 compiled run made on the probe's CPU is used instead
    (tmp_path / "cpu_bf16_t0_compiled_a.json").write_text(json.dumps(head))
    text = report.draft_compile_section("probe", probe, tmp_path)
    assert "a step of cpu_bf16_t0_compiled_a.json" in text and "mtp 5.0%" in text
    probe["rows"] = [{**row, "fixed_ms": 2.5, "fixed_over_eager": 1.25}]  # compiled slower: no saving, not a negative one
    assert "mtp 0.0%" in report.draft_compile_section("probe", probe, tmp_path)


def test_results_section_reads_the_frozen_side_where_the_probe_has_it(tmp_path):
    """A probe with the frozen side (the target's compile settings): its column in the table, and the share of a step
    priced at the better compiled side; the fixed side's alone where a probe predates it (the test above)."""
    row = {"drafter": "mtp", "eager_ms": 2.0, "fixed_ms": 1.5, "dynamic_ms": 1.6, "frozen_ms": 1.0,
           "fixed_over_eager": 0.75, "dynamic_over_eager": 0.8, "frozen_over_eager": 0.5,
           "compile_s": {"fixed": 1.0, "dynamic": 2.0, "frozen": 3.0}}
    probe, _ = _probe_beside_a_headline(tmp_path, row)
    text = report.draft_compile_section("probe", probe, tmp_path)
    assert "| mtp | 2.0 | 1.5 | 1.6 | 1.0 | 0.75 | 0.8 | 0.5 | 1.0, 2.0, 3.0 |" in text
    assert "fixed-shape and frozen compiled cost: mtp 10.0%" in text  # (1 - 0.5) x 8 ms of a 40 ms step
    probe["rows"] = [{**row, "frozen_ms": 3.0, "frozen_over_eager": 1.5}]  # the better side prices: fixed's 0.75
    assert "mtp 5.0%" in report.draft_compile_section("probe", probe, tmp_path)
