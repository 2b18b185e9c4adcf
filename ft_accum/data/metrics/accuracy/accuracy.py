"""Accuracy, as a local `evaluate` module: load it by path, no hub access.

accuracy = (1/n) Σ [prediction_i == reference_i]; the same definition and output key as the hub's
`evaluate-metric/accuracy`, without its scikit-learn dependency.
"""

import datasets
import evaluate
import numpy as np


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Fraction of predictions equal to their reference.",
            citation="",
            inputs_description="predictions: list of int; references: list of int",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        correct = np.asarray(predictions) == np.asarray(references)
        if sample_weight is not None:
            correct = correct * np.asarray(sample_weight, dtype=float)
        total = float(correct.sum())
        return {"accuracy": total / len(correct) if normalize else total}
