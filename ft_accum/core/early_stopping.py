"""Which evaluation is the best, and when to stop: transformers' rules, as functions of the numbers.

The Trainer ranks evaluations by `metric_for_best_model` (`Trainer._determine_best_metric`: a new
best is strictly better than the old) and its `EarlyStoppingCallback.check_metric_value` counts the
evaluations in a row that did not improve on the best by more than `early_stopping_threshold`; the
run stops when that count reaches `early_stopping_patience`. Here the count and the best are part of
the training state, so a resumed run decides as the uninterrupted one did (transformers #28544).
"""

from __future__ import annotations

from ft_accum.core.errors import ConfigError

# Metric names where smaller is better (transformers infers only "loss"; a perplexity or an error rate is the same).
LOWER_IS_BETTER = ("loss", "perplexity", "divergence", "error", "wer", "cer", "mse", "mae", "rmse")


def metric_key(name: str, metrics: dict[str, object]) -> str:
    """The key of `name` in an evaluation's `metrics`: `accuracy` and `eval_accuracy` both name
    `eval_accuracy` (as in the Trainer). A name it does not hold is one line listing those it does."""
    for key in (name, f"eval_{name}"):
        if isinstance(metrics.get(key), (int, float)):
            return key
    numbers = ", ".join(k for k, v in metrics.items() if isinstance(v, (int, float)))
    raise ConfigError(
        f"--metric_for_best_model {name} is not a metric of this recipe's evaluation; use one of {numbers}"
    )


def greater_is_better(name: str) -> bool:
    """Whether a larger `name` is better: False for losses, perplexities, divergences and error rates."""
    return not any(word in name.lower() for word in LOWER_IS_BETTER)


def is_new_best(value: float, best: float | None, greater: bool) -> bool:
    """The best-model rule: the first evaluation, or strictly better than `best`."""
    return best is None or (value > best if greater else value < best)


def improves(value: float, best: float | None, greater: bool, threshold: float) -> bool:
    """The early-stopping rule: better than `best` by more than `threshold` (the first evaluation always is)."""
    return best is None or (is_new_best(value, best, greater) and abs(value - best) > threshold)
