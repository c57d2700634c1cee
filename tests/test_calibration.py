"""calibration.py: reliability bins, ECE, Brier, AUROC."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specbook.calibration import auroc, brier, ece, reliability


def test_reliability_by_hand():
    pred = torch.tensor([0.05, 0.15, 0.12, 0.95, 1.0])
    label = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0])
    rows = reliability(pred, label, bins=10)
    assert [r["count"] for r in rows] == [1, 2, 0, 0, 0, 0, 0, 0, 0, 2]  # 1.0 falls in the last bin
    assert rows[1]["mean_pred"] == pytest.approx(0.135) and rows[1]["mean_label"] == pytest.approx(0.5)
    assert rows[2]["mean_pred"] is None and rows[9]["lo"] == pytest.approx(0.9)
    # ECE: 1/5 |0.05 - 0| + 2/5 |0.135 - 0.5| + 2/5 |0.975 - 1|
    assert ece(pred, label) == pytest.approx(0.2 * 0.05 + 0.4 * 0.365 + 0.4 * 0.025)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.sampled_from([0.0, 1.0])), min_size=1, max_size=60),
       st.integers(1, 20))
def test_reliability_properties(pairs, bins):
    pred = torch.tensor([p for p, _ in pairs], dtype=torch.float64)
    label = torch.tensor([y for _, y in pairs], dtype=torch.float64)
    rows = reliability(pred, label, bins)
    assert len(rows) == bins and sum(r["count"] for r in rows) == len(pairs)
    for r in rows:
        if r["count"]:
            assert r["lo"] - 1e-12 <= r["mean_pred"] <= r["hi"] + 1e-12
    assert 0.0 <= ece(pred, label, bins) <= 1.0
    assert ece(label, label, bins) == pytest.approx(0.0)  # a perfect forecaster
    assert brier(label, label) == 0.0


def test_auroc_and_bad_input():
    assert auroc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0
    assert auroc(torch.tensor([0.9, 0.1]), torch.tensor([0.0, 1.0])) == 0.0
    assert auroc(torch.tensor([0.5, 0.5]), torch.tensor([0.0, 1.0])) == 0.5
    assert auroc(torch.tensor([0.5]), torch.tensor([1.0])) is None
    with pytest.raises(ValueError, match="bins"):
        reliability(torch.tensor([0.5]), torch.tensor([1.0]), bins=0)
    with pytest.raises(ValueError, match="one entry each"):
        reliability(torch.tensor([0.5, 0.2]), torch.tensor([1.0]))
