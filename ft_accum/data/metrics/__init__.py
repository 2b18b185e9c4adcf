"""Metrics through `evaluate`, offline.

`evaluate.load("accuracy")` fetches a script from the hub, which this project never reaches by
default. The metrics the recipes use ship here as local evaluate modules and are loaded by path;
any other name goes to `evaluate.load(name)` for users who are online.
"""

from __future__ import annotations

from pathlib import Path

import evaluate

from ft_accum.core.errors import ConfigError

BUNDLED_METRICS_DIR = Path(__file__).parent
BUNDLED_METRICS = tuple(sorted(p.name for p in BUNDLED_METRICS_DIR.iterdir() if (p / f"{p.name}.py").is_file()))


def load_metric(name: str, **kwargs) -> evaluate.EvaluationModule:
    """A bundled metric by path when we ship it, a local evaluate module when `name` is a folder
    holding `<folder name>.py`, otherwise `evaluate.load(name)` from the hub (online only).

    Offline, `evaluate.load` of a name we do not ship ends in a raw FileNotFoundError or
    ConnectionError from deep inside `evaluate`: that becomes one ConfigError line naming the
    shipped metrics and how to add one.
    """
    if name in BUNDLED_METRICS:
        return evaluate.load(str(BUNDLED_METRICS_DIR / name), **kwargs)
    try:
        return evaluate.load(name, **kwargs)
    except (OSError, ValueError, ImportError) as exc:  # FileNotFoundError, ConnectionError, offline mode
        raise ConfigError(
            f"metric {name!r} is not shipped and could not be loaded ({type(exc).__name__}); shipped: "
            f"{', '.join(BUNDLED_METRICS)}. To add one offline, write an evaluate module (a folder <name>/ holding "
            f"<name>.py, as {BUNDLED_METRICS_DIR}/accuracy/ does) and load it by its folder path, or put it in "
            f"{BUNDLED_METRICS_DIR}/"
        ) from exc
