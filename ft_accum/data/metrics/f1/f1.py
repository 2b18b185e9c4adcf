"""F1 as a local `evaluate` module: load it by path, no hub access.

Per class c: F1_c = 2·TP_c / (2·TP_c + FP_c + FN_c). `average="macro"` is the unweighted mean over
the classes that appear in predictions or references (scikit-learn's convention, which the hub's
`evaluate-metric/f1` wraps); "micro" pools the counts; "binary" reports `pos_label` only.
"""

import datasets
import evaluate
import numpy as np


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="F1 score: harmonic mean of precision and recall.",
            citation="",
            inputs_description="predictions: list of int; references: list of int",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, average="binary", pos_label=1):
        predictions = np.asarray(predictions)
        references = np.asarray(references)
        labels = np.union1d(predictions, references)
        tp = np.array([np.sum((predictions == c) & (references == c)) for c in labels], dtype=float)
        fp = np.array([np.sum((predictions == c) & (references != c)) for c in labels], dtype=float)
        fn = np.array([np.sum((predictions != c) & (references == c)) for c in labels], dtype=float)
        if average == "micro":
            return {"f1": _f1(tp.sum(), fp.sum(), fn.sum())}
        per_class = np.array([_f1(*counts) for counts in zip(tp, fp, fn)])
        if average == "macro":
            return {"f1": float(per_class.mean())}
        if average == "binary":
            hit = labels == pos_label
            return {"f1": float(per_class[hit][0]) if hit.any() else 0.0}
        if average is None:
            return {"f1": per_class.tolist()}
        raise ValueError(f"average must be 'binary', 'micro', 'macro' or None, got {average!r}")


def _f1(tp, fp, fn):
    denominator = 2 * tp + fp + fn
    return float(2 * tp / denominator) if denominator else 0.0
