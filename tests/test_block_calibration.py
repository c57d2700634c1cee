"""In-loop calibration of DSpark's survival (drafters.block_calibration)."""

import json
import shutil

import pytest
import torch

from specbook.corpus import load_corpus, write_corpus
from specbook.drafters.block_calibration import (
    calibrate_in_loop,
    calibration_source,
    card_calibration,
    heldout_prompt_ids,
    loop_outcomes,
    main,
    trace_outcomes,
)
from specbook.drafters.dflash import BlockDrafter, BlockNet, calibration_report, load_block, survival, trace_blocks
from specbook.models import tiny_llama
from specbook.training import TrainData


@pytest.fixture(scope="module")
def deep():
    return tiny_llama(vocab_size=48, hidden_size=32, layers=8, seed=1)


def _spark(target, gamma=4, rank=8, confidence=True, seed=0):
    torch.manual_seed(seed)
    net = BlockNet(target.config, torch.arange(0, 48, 2), gamma=gamma, layers=2, markov_rank=rank,
                   confidence=confidence)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return net.eval()


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 48, (1, 4 + i % 3), generator=g) for i in range(n)]


def test_card_calibration_prefers_the_in_loop_fit():
    tf = {"greedy": [0.5], "sampled": [2.0]}
    loop = {"temperatures": {"greedy": [0.7], "sampled": [1.5]}, "shifts": {"greedy": [-0.4], "sampled": [0.1]}}
    assert card_calibration({"calibration": {"temperatures": tf}}) == {"temperatures": tf, "shifts": None}
    assert card_calibration({"calibration": {"temperatures": tf, "in_loop": loop}}) == loop
    assert card_calibration({}) == {"temperatures": None, "shifts": None}


def test_calibration_source_names_the_fit_each_setting_reads():
    tf, loop = {"greedy": [0.5]}, {"temperatures": {"greedy": [0.7]}, "shifts": {"greedy": [-0.4]}}
    both = {"calibration": {"temperatures": tf, "in_loop": loop}}
    assert [calibration_source(both, s) for s in ("card", "held_out", "none")] == ["in_loop", "held_out", "none"]
    assert calibration_source({"calibration": {"temperatures": tf}}) == "held_out"
    assert calibration_source({}) == calibration_source({}, "held_out") == "none"
    assert card_calibration(both, "none") == {"temperatures": None, "shifts": None}
    with pytest.raises(ValueError, match="calibration must be one of"):
        calibration_source(both, "tf")


def test_the_drafter_reports_the_calibrated_survival_of_its_own_logits(deep):
    """a_k = prod_{i<=k} sigmoid(z_i / t_i + b_i) of the recorded z, for the sampling mode's temperatures and shifts."""
    net = _spark(deep)
    cal = {"temperatures": {"greedy": [0.5, 1.0, 2.0, 4.0], "sampled": [1.0] * 4},
           "shifts": {"greedy": [-1.0, 0.5, 0.0, 2.0], "sampled": [0.0] * 4}}
    steps, _ = trace_blocks(deep, BlockDrafter(deep, net, **cal), _prompts(1)[0], max_new_tokens=16, eos_token_id=-1)
    full = [s for s in steps if len(s["z"]) == 4]
    assert full
    z = torch.tensor([s["z"] for s in full], dtype=torch.float64)
    expect = survival(z, cal["temperatures"]["greedy"], cal["shifts"]["greedy"])
    assert torch.allclose(torch.tensor([s["survival"] for s in full], dtype=torch.float64), expect, atol=1e-6)


def test_loop_outcomes_by_hand():
    steps = [{"tokens": [1, 2, 3], "accepted": 2, "z": [0.1, 0.2, 0.3]},
             {"tokens": [1, 2], "accepted": 2, "z": [0.5, 0.6]},  # cut short: not a full block
             {"tokens": [4, 5, 6], "accepted": 0, "z": [-1.0, 0.0, 1.0]},
             {"tokens": [4, 5, 6], "accepted": 3, "z": [2.0, 2.0, 2.0]}]
    z, o = loop_outcomes(steps, 3)
    assert z.tolist() == [[0.1, 0.2, 0.3], [-1.0, 0.0, 1.0], [2.0, 2.0, 2.0]]
    assert o.tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
    assert loop_outcomes(steps[1:2], 3)[0].shape == (0, 3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_trace_outcomes_are_the_loops_full_blocks(deep, temperature):
    net = _spark(deep)
    z, o = trace_outcomes(deep, net, _prompts(3), temperature, max_new_tokens=24, eos_token_id=-1)
    assert z.shape == o.shape and z.shape[1] == net.gamma and len(z) >= 3
    assert (o[:, 1:] <= o[:, :-1]).all()  # a prefix survives only if the shorter one did
    z2, o2 = trace_outcomes(deep, net, _prompts(3), temperature, max_new_tokens=24, eos_token_id=-1)
    assert torch.equal(z, z2) and torch.equal(o, o2)  # seeded per prompt: the same blocks every call


def test_the_fit_never_raises_position_one_log_loss_on_its_own_data(deep):
    """(t, b) = (1, 0) is on the grid, so on the data it was fitted on position 1's log loss can only fall; the
    report is calibration_report of the same blocks; DSpark's temperature-only fit is reported beside it."""
    net = _spark(deep)
    ids = _prompts(6)
    res = calibrate_in_loop(deep, net, ids, ids, max_new_tokens=24, eos_token_id=-1)
    z, o = trace_outcomes(deep, net, ids, 0.0, max_new_tokens=24, eos_token_id=-1)

    def nll(t, b):
        a = survival(z, t, b)[:, 0].clamp(1e-9, 1 - 1e-9)
        return float(-(o[:, 0] * a.log() + (1 - o[:, 0]) * (1 - a).log()).mean())

    g = res["temperatures"]["greedy"], res["shifts"]["greedy"]
    assert nll(*g) <= nll([1.0] * 4, [0.0] * 4) + 1e-12
    assert res["after"]["greedy"] == calibration_report(z, o, *g)
    for mode in ("greedy", "sampled"):
        assert len(res["temperatures"][mode]) == len(res["shifts"][mode]) == net.gamma
        assert res["fit_blocks"][mode] == res["report_blocks"][mode] > 0
        assert len(res["temperature_only"][mode]["temperatures"]) == net.gamma


def test_heldout_prompts_are_the_prompts_training_held_out(tmp_path):
    """The fit's prompts: one per held-out prompt group of the split TrainData makes (same corpus, same seed)."""
    recs = [([1, 2, i % 7 + 3], [5, 6, 7, i % 5], {"question_id": f"q{i % 40}"}) for i in range(80)]
    write_corpus(tmp_path / "c", recs, vocab_size=48, target="tiny", fingerprint="fp", settings={})
    corpus = load_corpus(tmp_path / "c")
    card = {"corpus_sha": corpus.sha, "corpus_records": len(corpus), "train_config": {"seed": 3}}
    ids = heldout_prompt_ids(card, tmp_path / "c")
    data = TrainData(corpus, None, seed=3)
    held_q = {corpus.records[i]["question_id"] for i in data.heldout}
    assert len(ids) == len(held_q) >= 1
    first = {q: next(i for i in data.heldout if corpus.records[i]["question_id"] == q) for q in held_q}
    assert sorted(x[0].tolist() for x in ids) == sorted(corpus.sequence(i)[:3].tolist() for i in first.values())
    with pytest.raises(ValueError, match="trained on corpus"):
        heldout_prompt_ids({**card, "corpus_sha": "another"}, tmp_path / "c")


def test_a_drafter_without_a_confidence_head_is_refused(deep):
    with pytest.raises(ValueError, match="confidence head"):
        trace_outcomes(deep, _spark(deep, rank=0, confidence=False), _prompts(1), 0.0, max_new_tokens=8)


@pytest.mark.slow
def test_the_command_writes_the_card_and_the_checkpoint_still_loads(real, tmp_path):
    from specbook.train import CKPT_DIR

    model, _ = real
    for suffix in (".json", ".safetensors"):
        shutil.copy(CKPT_DIR / f"dspark{suffix}", tmp_path / f"dspark{suffix}")
    before = json.loads((tmp_path / "dspark.json").read_text())
    before.get("calibration", {}).pop("in_loop", None)
    (tmp_path / "dspark.json").write_text(json.dumps(before))
    res = main(["--checkpoint", str(tmp_path / "dspark"), "--dtype", "fp32", "--fit", "2", "--report", "1",
                "--max-new-tokens", "24"])
    _, card = load_block(model, tmp_path / "dspark", "dspark")  # the weights' sha still matches
    assert card["calibration"]["in_loop"] == json.loads(json.dumps(res))
    assert card_calibration(card) == {"temperatures": res["temperatures"], "shifts": res["shifts"]}
    assert card["calibration"]["temperatures"] == before["calibration"]["temperatures"]  # the teacher-forced fit kept
    assert res["fit_prompts"] == 2 and res["command"].startswith("python -m specbook.drafters.block_calibration")


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit, match="--fit must be >= 0"):
        main(["--fit", "-1"])
    with pytest.raises(SystemExit, match="--report must be >= 1"):
        main(["--report", "0"])
