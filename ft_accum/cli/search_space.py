"""A sweep file's `search:` section, checked before any trial runs (see cli/search.py for the format): its
keys, each dimension of the space against the recipe's own settings, the sampler and the pruner as Optuna's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ft_accum.core.errors import ConfigError
from ft_accum.training.yaml_config import typed_value

SAMPLERS = ("tpe", "random", "grid", "cmaes")


PRUNERS = ("median", "hyperband", "none")


SEARCH_KEYS = ("n_trials", "metric", "direction", "sampler", "pruner", "space", "storage", "enqueue", "plan", "seed")


PLAN_KEYS = ("model", "task", "seq_len", "gpu_memory", "precision", "lora_r", "optimizer", "num_processes")


def import_optuna():
    try:
        import optuna
    except ImportError:
        raise ConfigError(
            'a search: section needs Optuna, which is not installed; pip install -e ".[search]" (or pip install optuna)'
        ) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def load_search(search: Any, path: Path, recipe: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Check the `search:` section against the recipe's settings; return it with defaults filled in.
    Everything that can be wrong before a trial runs is caught here."""
    where = f"{path}: search"
    if not isinstance(search, dict):
        raise ConfigError(f"{where} must be a mapping (n_trials, metric, direction, space, ...)")
    unknown = sorted(set(search) - set(SEARCH_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(SEARCH_KEYS)}")
    for key in ("n_trials", "metric", "space"):
        if key not in search:
            raise ConfigError(f"{where} needs {key}; e.g. n_trials: 12, metric: eval_accuracy, space: {{...}}")
    n_trials = search["n_trials"]
    if not isinstance(n_trials, int) or isinstance(n_trials, bool) or n_trials < 1:
        raise ConfigError(f"{where}.n_trials must be a whole number ≥ 1, got {n_trials!r}")
    direction = search.get("direction", "maximize")
    if direction not in ("maximize", "minimize"):
        raise ConfigError(f"{where}.direction must be maximize or minimize, got {direction!r}")
    sampler = search.get("sampler", "tpe")
    if sampler not in SAMPLERS:
        raise ConfigError(f"{where}.sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    space = search["space"]
    if not isinstance(space, dict) or not space:
        raise ConfigError(f"{where}.space is empty; give each searched setting a range or choices")
    checked = {name: check_dimension(name, spec, settings, recipe, where) for name, spec in space.items()}
    if sampler == "grid":
        ranged = [name for name, d in checked.items() if "choices" not in d]
        if ranged:
            raise ConfigError(
                f"{where}: the grid sampler needs choices for every setting, not a range ({', '.join(ranged)})"
            )
        points = math.prod(len(d["choices"]) for d in checked.values())
        if n_trials > points:
            raise ConfigError(
                f"{where}: the grid has {points} point(s), fewer than n_trials {n_trials}; set n_trials ≤ {points}"
            )
    enqueue = search.get("enqueue") or []
    if not isinstance(enqueue, list) or not all(isinstance(e, dict) for e in enqueue):
        raise ConfigError(f"{where}.enqueue must be a list of mappings of setting: value")
    if len(enqueue) > n_trials:
        raise ConfigError(
            f"{where}.enqueue lists {len(enqueue)} trials, more than n_trials {n_trials}; raise n_trials"
        )
    for entry in enqueue:
        outside = sorted(set(entry) - set(checked))
        if outside:
            raise ConfigError(
                f"{where}.enqueue: {', '.join(outside)} is not in the space; enqueue only searched settings"
            )
        for key, value in entry.items():
            typed_value(value, settings[key], f"{where}.enqueue: {key}")
    plan = search.get("plan")
    if plan is not None:
        if not isinstance(plan, dict) or not {"model", "task", "seq_len"} <= set(plan):
            raise ConfigError(
                f"{where}.plan needs model, task and seq_len (and gpu_memory, default 12GiB), as `ft-accum plan` takes"
            )
        unknown = sorted(set(plan) - set(PLAN_KEYS))
        if unknown:
            raise ConfigError(f"{where}.plan: unknown key(s) {', '.join(unknown)}; valid: {', '.join(PLAN_KEYS)}")
        from ft_accum.planner import configs, memory_planner, task_specs

        if plan["task"] not in task_specs.TASKS:
            raise ConfigError(f"{where}.plan.task must be one of {', '.join(task_specs.TASKS)}, got {plan['task']!r}")
        configs.load_model_config(plan["model"])  # a name it cannot find fails now, naming the shipped ones
        memory_planner.parse_memory(str(plan.get("gpu_memory", "12GiB")))
    return {
        "n_trials": n_trials,
        "metric": str(search["metric"]),
        "direction": direction,
        "sampler": sampler,
        "pruner": check_pruner(search.get("pruner", "median"), where),
        "space": checked,
        "storage": search.get("storage"),
        "enqueue": enqueue,
        "plan": plan,
        "seed": search.get("seed"),
    }


def check_dimension(name: str, spec: Any, settings: dict[str, Any], recipe: Path, where: str) -> dict[str, Any]:
    """One searched setting: {low, high, log?, step?} or {choices: [...]}, of the recipe's type."""
    if name not in settings:
        raise ConfigError(
            f"{where}.space: {name} is not a setting of {recipe.name}, so no flag would take it; "
            f"valid: {', '.join(sorted(settings))}"
        )
    if name in ("output_dir", "resume_from_checkpoint"):
        raise ConfigError(f"{where}.space: the sweep sets {name} itself; search another setting")
    kind = settings[name]
    if isinstance(spec, dict) and "choices" in spec:
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where}.space.{name}: choices is empty; list at least one value")
        for value in choices:
            typed_value(value, kind, f"{where}.space.{name}")
        return {"choices": choices}
    if not isinstance(spec, dict) or not {"low", "high"} <= set(spec):
        raise ConfigError(
            f"{where}.space.{name}: write a range as {{low: ..., high: ..., log: true}} or a list as {{choices: [...]}}"
        )
    low, high = spec["low"], spec["high"]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)):
        raise ConfigError(f"{where}.space.{name}: low and high must be numbers, got {low!r} and {high!r}")
    if not low < high:
        raise ConfigError(f"{where}.space.{name}: the range {low}..{high} is empty or inverted; give low < high")
    log = bool(spec.get("log", False))
    if log and low <= 0:
        raise ConfigError(f"{where}.space.{name}: a log range needs low > 0, got {low}")
    if log and spec.get("step") is not None:
        raise ConfigError(f"{where}.space.{name}: give step or log, not both (Optuna samples one or the other)")
    integer = "int" in str(kind)  # int or Optional[int] (the recipe's annotation)
    if integer and not all(isinstance(v, int) for v in (low, high)):
        raise ConfigError(f"{where}.space.{name} is a whole number; give whole-number low and high")
    if not integer and "float" not in str(kind):
        raise ConfigError(f"{where}.space.{name} is not a number setting; give it {{choices: [...]}}")
    return {"low": low, "high": high, "log": log, "step": spec.get("step"), "integer": integer}


def check_pruner(pruner: Any, where: str) -> dict[str, Any]:
    spec = {"type": pruner} if isinstance(pruner, str) else dict(pruner or {"type": "none"})
    if spec.get("type") not in PRUNERS:
        raise ConfigError(f"{where}.pruner type must be one of {', '.join(PRUNERS)}, got {spec.get('type')!r}")
    allowed = {
        "median": {"n_warmup_evaluations", "n_startup_trials"},
        "hyperband": {"reduction_factor", "max_evaluations"},
    }
    unknown = sorted(set(spec) - {"type"} - allowed.get(spec["type"], set()))
    if unknown:
        raise ConfigError(f"{where}.pruner: {', '.join(unknown)} does not apply to the {spec['type']} pruner")
    return spec


def make_sampler(optuna, search: dict):
    seed = search["seed"]
    if search["sampler"] == "grid":
        return optuna.samplers.GridSampler({k: d["choices"] for k, d in search["space"].items()}, seed=seed)
    if search["sampler"] == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed)
    if search["sampler"] == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(optuna, spec: dict):
    """Steps are evaluations (the epoch index), so trials of different batch sizes compare at equal data."""
    if spec["type"] == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=spec.get("n_startup_trials", 5), n_warmup_steps=spec.get("n_warmup_evaluations", 0)
        )
    if spec["type"] == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=1,
            max_resource=spec.get("max_evaluations", "auto"),
            reduction_factor=spec.get("reduction_factor", 3),
        )
    return optuna.pruners.NopPruner()


def sample(trial, space: dict) -> dict[str, Any]:
    """The trial's values; asked again for a trial taken up, Optuna returns the stored ones."""
    values = {}
    for name, d in space.items():
        if "choices" in d:
            values[name] = trial.suggest_categorical(name, d["choices"])
        elif d["integer"]:
            values[name] = trial.suggest_int(name, d["low"], d["high"], step=d["step"] or 1, log=d["log"])
        else:
            values[name] = trial.suggest_float(name, d["low"], d["high"], step=d["step"], log=d["log"])
    return values
