"""Entity-level precision, recall and F1 (CoNLL style), as a local `evaluate` module backed by `seqeval`.

An entity is a maximal span of IOB tags (B-X, I-X …); it counts as correct only when both its
span and its type match the reference (Tjong Kim Sang & De Meulder 2003; seqeval, Nakayama 2018).
Output keys follow the hub's `evaluate-metric/seqeval`: overall_precision, overall_recall,
overall_f1, overall_accuracy, and one {precision, recall, f1, number} dict per entity type.
"""

import datasets
import evaluate


class Seqeval(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Entity-level precision, recall and F1 of IOB-tagged sequences.",
            citation="seqeval: A Python framework for sequence labeling evaluation, Hiroki Nakayama, 2018",
            inputs_description="predictions, references: lists of tag sequences, e.g. [['O', 'B-PER', 'I-PER']]",
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("string")),
                    "references": datasets.Sequence(datasets.Value("string")),
                }
            ),
        )

    def _compute(self, predictions, references, zero_division=0):
        from seqeval.metrics import accuracy_score, classification_report

        report = classification_report(
            y_true=references, y_pred=predictions, output_dict=True, zero_division=zero_division
        )
        report.pop("macro avg", None)
        report.pop("weighted avg", None)
        overall = report.pop("micro avg", {"precision": 0.0, "recall": 0.0, "f1-score": 0.0})
        scores = {
            kind: {
                "precision": v["precision"],
                "recall": v["recall"],
                "f1": v["f1-score"],
                "number": int(v["support"]),
            }
            for kind, v in report.items()
        }
        scores.update(
            overall_precision=overall["precision"],
            overall_recall=overall["recall"],
            overall_f1=overall["f1-score"],
            overall_accuracy=accuracy_score(y_true=references, y_pred=predictions),
        )
        return scores
