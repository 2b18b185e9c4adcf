"""ROUGE-1, ROUGE-2, ROUGE-L and ROUGE-Lsum F1, as a local `evaluate` module backed by `rouge_score`.

Lin 2004, "ROUGE: A Package for Automatic Evaluation of Summaries"; Google's `rouge_score`
re-implementation. Output keys and defaults follow the hub's `evaluate-metric/rouge`: the mean
F-measure over the examples, Porter stemming off unless `use_stemmer=True`.
"""

import datasets
import evaluate


class Rouge(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="ROUGE F-measures between predictions and references.",
            citation="Lin, Chin-Yew. ROUGE: A Package for Automatic Evaluation of Summaries. 2004.",
            inputs_description="predictions: list of str; references: list of str",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(
        self, predictions, references, rouge_types=("rouge1", "rouge2", "rougeL", "rougeLsum"), use_stemmer=False
    ):
        from rouge_score import rouge_scorer

        scorer = rouge_scorer.RougeScorer(list(rouge_types), use_stemmer=use_stemmer)
        totals = dict.fromkeys(rouge_types, 0.0)
        for prediction, reference in zip(predictions, references):
            for kind, score in scorer.score(reference, prediction).items():
                totals[kind] += score.fmeasure
        return {kind: total / max(len(predictions), 1) for kind, total in totals.items()}
