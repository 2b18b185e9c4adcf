"""Metrics through `evaluate`, offline.

`evaluate.load("accuracy")` fetches a script from the hub, which this project never reaches by
default. The metrics the recipes use ship here as local evaluate modules and are loaded by path;
any other name goes to `evaluate.load(name)` for users who are online.
"""

from __future__ import annotations

from pathlib import Path

import evaluate

BUNDLED_METRICS_DIR = Path(__file__).parent
BUNDLED_METRICS = tuple(sorted(p.name for p in BUNDLED_METRICS_DIR.iterdir() if (p / f"{p.name}.py").is_file()))


def load_metric(name: str, **kwargs) -> evaluate.EvaluationModule:
    """A bundled metric by path when we ship it, otherwise `evaluate.load(name)` from the hub."""
    if name in BUNDLED_METRICS:
        return evaluate.load(str(BUNDLED_METRICS_DIR / name), **kwargs)
    return evaluate.load(name, **kwargs)
