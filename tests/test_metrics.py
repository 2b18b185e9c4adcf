"""The bundled evaluate modules load by path (no hub) and agree with scikit-learn."""

import numpy as np
import pytest

from ft_accum.data.metrics import BUNDLED_METRICS, load_metric


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


def test_a_metric_that_is_not_shipped_is_one_line_offline(monkeypatch):
    """Issue 27: load_metric("pearsonr") offline ended in a raw FileNotFoundError traceback (pearsonr now
    ships; spearmanr stands for any metric that does not)."""
    from ft_accum.core.errors import ConfigError, one_line_errors

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    with pytest.raises(SystemExit) as exit_info, one_line_errors():
        load_metric("spearmanr")
    message = str(exit_info.value.code)
    assert message.startswith("error: metric 'spearmanr' is not shipped") and "\n" not in message, message
    assert all(name in message for name in BUNDLED_METRICS) and "<name>.py" in message
    with pytest.raises(ConfigError):
        load_metric("no_such_metric_anywhere")


def test_a_local_evaluate_module_loads_by_its_folder(tmp_path):
    import shutil

    from ft_accum.data.metrics import BUNDLED_METRICS_DIR

    folder = tmp_path / "my_accuracy"
    folder.mkdir()
    shutil.copy(BUNDLED_METRICS_DIR / "accuracy" / "accuracy.py", folder / "my_accuracy.py")
    assert load_metric(str(folder)).compute(predictions=[1, 1], references=[1, 0])["accuracy"] == 0.5
