"""Pearson's correlation, as a local `evaluate` module: load it by path, no hub access.

r = Σ (x_i − x̄)(y_i − ȳ) / √(Σ (x_i − x̄)² · Σ (y_i − ȳ)²) (Pearson 1895); the same output key
as the hub's `evaluate-metric/pearsonr`, without its SciPy dependency (and without its p-value).
"""

import datasets
import evaluate
import numpy as np


class Pearsonr(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Pearson's linear correlation between predictions and references.",
            citation="",
            inputs_description="predictions: list of float; references: list of float",
            features=datasets.Features(
                {"predictions": datasets.Value("float64"), "references": datasets.Value("float64")}
            ),
        )

    def _compute(self, predictions, references):
        x, y = np.asarray(predictions, dtype=float), np.asarray(references, dtype=float)
        x, y = x - x.mean(), y - y.mean()
        denominator = float(np.sqrt((x * x).sum() * (y * y).sum()))
        return {"pearsonr": float((x * y).sum()) / denominator if denominator else 0.0}
