"""The bundled evaluate modules load by path (no hub) and agree with scikit-learn."""

import numpy as np
import pytest

from ft_accum.metrics import BUNDLED_METRICS, load_metric


def test_bundled_metrics_are_listed():
    assert {"accuracy", "f1"} <= set(BUNDLED_METRICS)


@pytest.mark.parametrize("seed", range(5))
def test_accuracy_and_f1_match_sklearn(seed):
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(seed)
    refs, preds = rng.integers(0, 4, 50), rng.integers(0, 4, 50)
    assert load_metric("accuracy").compute(predictions=preds, references=refs)["accuracy"] == pytest.approx(
        sklearn_metrics.accuracy_score(refs, preds)
    )
    f1 = load_metric("f1")
    for average in ("macro", "micro"):
        assert f1.compute(predictions=preds, references=refs, average=average)["f1"] == pytest.approx(
            sklearn_metrics.f1_score(refs, preds, average=average)
        )
    binary_refs, binary_preds = refs % 2, preds % 2
    assert f1.compute(predictions=binary_preds, references=binary_refs)["f1"] == pytest.approx(
        sklearn_metrics.f1_score(binary_refs, binary_preds)
    )


def test_metrics_load_with_the_hub_unreachable(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_metric("accuracy").compute(predictions=[1, 0], references=[1, 1])["accuracy"] == 0.5
