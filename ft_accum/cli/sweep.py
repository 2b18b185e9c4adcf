"""`ft-accum sweep SWEEP.yaml`: a queue of runs on one GPU that survives the night.

A sweep file names a recipe, an Accelerate config, base arguments, and a grid or a list of runs:

    recipe: text_classification             # recipes/<name>.py, or a path to a recipe file
    accelerate_config: accelerate_configs/single_gpu_bf16.yaml
    output_dir: outputs/sweeps/lr_batch     # default: outputs/sweeps/<sweep file name>
    timeout_per_run: 3h                     # optional
    base: {num_train_epochs: 3, per_device_train_batch_size: 8}
    grid: {learning_rate: [1e-5, 3e-5], effective_batch_size: [32, 128]}
    # or:  runs: [{learning_rate: 1e-5}, {learning_rate: 3e-5, seed: 1}]

Runs go one after another, each through the real `accelerate launch` in a process group of its
own, with its output in `<output_dir>/<run>/log.txt`. A failed run (crash, non-finite loss,
timeout) is recorded with its error line and the sweep goes on. A run that died of out-of-memory
is queued again once with half the micro-batch and twice the accumulation (same effective batch,
same LR). Run the same command again after a kill: finished runs are skipped, interrupted ones
resume from their last checkpoint. State lives in `sweep_state.json`, replaced atomically.
"""

from __future__ import annotations

import ast
import csv
import hashlib
import itertools
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from ft_accum.cli.launching import (
    OOM_MARKERS,
    ProgressLine,
    command_for,
    default_micro,
    error_line,
    launch_and_watch,
    replan_for_memory,
)
from ft_accum.core.errors import ConfigError
from ft_accum.training.run_outputs import lock_output_dir
from ft_accum.training.yaml_config import read_yaml, typed_value

STATE_FILE = "sweep_state.json"
SHORT_NAMES = {
    "learning_rate": "lr",
    "effective_batch_size": "ebs",
    "per_device_train_batch_size": "micro",
    "gradient_accumulation_steps": "accum",
    "num_train_epochs": "epochs",
    "max_train_steps": "steps",
    "weight_decay": "wd",
    "lr_scaling": "scaling",
    "model_name_or_path": "model",
}


def parse_duration(text: str | int | float | None) -> float | None:
    """'8h', '90m', '1h30m', '45s' or a number of seconds → seconds."""
    if text is None:
        return None
    if isinstance(text, (int, float)):
        return float(text)
    parts = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s)?\s*", str(text))
    if not parts or not any(parts.groups()):
        raise ConfigError(f"cannot read the duration {text!r}; write it like 8h, 90m, 1h30m or 45s")
    hours, minutes, seconds = (float(g) if g else 0.0 for g in parts.groups())
    return hours * 3600 + minutes * 60 + seconds


def recipe_path(recipe: str, sweep_file: Path) -> Path:
    """The sweep's recipe: a path (from the working directory or the sweep file's folder), or a shipped one's name."""
    from ft_accum.training.recipe_files import find_recipe

    return find_recipe(recipe, sweep_file.parent)


def recipe_settings(path: Path) -> dict[str, Any]:
    """The recipe's settings: the fields of its TaskArguments dataclass, read with `ast` (nothing is
    imported or run), and those of the shared `arguments.TrainingArguments`."""
    import typing

    from ft_accum.training.arguments import TrainingArguments

    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TaskArguments":
            task = {
                n.target.id: _annotation_type(ast.unparse(n.annotation))
                for n in node.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            }
            return task | typing.get_type_hints(TrainingArguments)
    raise ConfigError(f"{path} has no TaskArguments dataclass, so its settings cannot be checked")


def _annotation_type(text: str):
    """`Optional[int]` → Optional[int], from the annotation's source text (the recipe is not imported)."""
    import typing

    base = {"int": int, "float": float, "bool": bool, "str": str}
    inner = text.removeprefix("Optional[").removesuffix("]") if text.startswith("Optional[") else text
    kind = base.get(inner.replace(" | None", ""), str)
    return typing.Optional[kind] if text.startswith("Optional[") or "| None" in text else kind


def load_sweep(sweep_file: str | os.PathLike) -> dict[str, Any]:
    """Read and check the sweep file; return it with `runs` expanded to [{name, args}] in order."""
    path = Path(sweep_file)
    if not path.is_file():
        raise ConfigError(f"sweep file {path} does not exist")
    spec = read_yaml(path)
    if not isinstance(spec, dict):
        raise ConfigError(f"{path} must hold a mapping (recipe, accelerate_config, base, grid or runs)")
    keys = ("recipe", "accelerate_config", "output_dir", "base", "grid", "runs", "search", "timeout_per_run")
    unknown = sorted(set(spec) - set(keys))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(keys)}")
    if "recipe" not in spec:
        raise ConfigError(f"{path} names no recipe; add e.g. `recipe: text_classification`")
    recipe = recipe_path(str(spec["recipe"]), path)
    accelerate_config = spec.get("accelerate_config")
    if accelerate_config:
        from ft_accum.training.recipe_files import find_accelerate_config

        accelerate_config = str(find_accelerate_config(accelerate_config, path.parent))
    base = spec.get("base") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"{path}: base must be a mapping of setting: value, got {type(base).__name__}")
    if sum(k in spec for k in ("grid", "runs", "search")) > 1:
        raise ConfigError(f"{path} has more than one of grid, runs and search; give one")
    valid = recipe_settings(recipe)
    _check_settings(base, valid, recipe, path)
    if "output_dir" in base or "resume_from_checkpoint" in base:
        raise ConfigError(f"{path}: the sweep sets output_dir and resume_from_checkpoint itself; remove them")
    sweep = {
        "path": str(path.resolve()),
        "recipe": str(recipe),
        "accelerate_config": accelerate_config,
        "base": base,
        "output_dir": str(spec.get("output_dir") or Path("outputs") / "sweeps" / path.stem),
        "timeout_per_run": parse_duration(spec.get("timeout_per_run")),
    }
    if "search" in spec:
        from ft_accum.cli.search_space import load_search

        search = load_search(spec["search"], path, recipe, valid)
        return {**sweep, "search": search, "runs": [], "varied": sorted(search["space"])}
    if "grid" in spec:
        grid = spec["grid"] or {}
        if not isinstance(grid, dict):
            raise ConfigError(f"{path}: grid must be a mapping of setting: [values], e.g. learning_rate: [1e-5, 3e-5]")
        if not grid or any(not isinstance(v, list) or not v for v in grid.values()):
            raise ConfigError(
                f"{path}: the grid is empty; give each setting a non-empty list, e.g. learning_rate: [1e-5, 3e-5]"
            )
        keys = list(grid)
        variants = [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]
    elif "runs" in spec:
        variants = spec["runs"] or []
        if not variants or not all(isinstance(v, dict) for v in variants):
            raise ConfigError(f"{path}: runs must be a non-empty list of mappings of setting: value")
    else:
        raise ConfigError(
            f"{path} has no grid, runs or search; add e.g. `grid: {{learning_rate: [1e-5, 3e-5]}}` (docs/sweeps.md)"
        )
    for variant in variants:
        _check_settings(variant, valid, recipe, path)
    if any("output_dir" in v or "resume_from_checkpoint" in v for v in variants):
        raise ConfigError(f"{path}: the sweep sets output_dir and resume_from_checkpoint itself; remove them")
    varied = sorted({k for v in variants for k in v})
    runs, names = [], set()
    for variant in variants:
        name = run_name(variant, varied)
        if name in names:
            raise ConfigError(f"{path}: two runs would both be named {name}; make their settings differ")
        names.add(name)
        runs.append({"name": name, "args": {**base, **variant}, "varied": {k: variant.get(k) for k in varied}})
    return {**sweep, "runs": runs, "varied": varied}


def _check_settings(variant: dict, valid: dict, recipe: Path, path: Path) -> None:
    bad = sorted(set(variant) - set(valid))
    if bad:
        raise ConfigError(
            f"{path}: {', '.join(bad)} is not a setting of {recipe.name}; valid: {', '.join(sorted(valid))}"
        )
    for key, value in variant.items():  # a wrong type fails here, not as a failed run hours later
        typed_value(value, valid[key], f"{path}: {key}")


def run_name(variant: dict[str, Any], varied: list[str]) -> str:
    """`lr=3e-05_ebs=32`: readable, and stable across invocations (made from the settings, not the order)."""
    parts = [f"{SHORT_NAMES.get(k, k)}={variant[k]}" for k in varied if k in variant]
    name = "_".join(parts) or "run"
    return re.sub(r"[^A-Za-z0-9=._+-]", "-", name)[:120]


def write_state(output_dir: Path, state: dict) -> None:
    """Write to a temporary file and rename it over the old one: the state is never half-written."""
    tmp = output_dir / f".{STATE_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output_dir / STATE_FILE)


def reconcile_state(sweep: dict, output_dir: Path) -> dict:
    """Load the saved state and match it to the sweep file: add new runs, refuse changed ones."""
    path = output_dir / STATE_FILE
    state = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    changed = [
        r["name"]
        for r in sweep["runs"]
        if r["name"] in state["runs"] and state["runs"][r["name"]]["args"] != _jsonable(r["args"])
    ]
    if changed:
        raise ConfigError(
            f"the sweep file changed the settings of run(s) {', '.join(changed)} since they were queued in {output_dir}; "
            "restore the file, or give the changed sweep a new output_dir (results would otherwise mix two settings)"
        )
    added = [r["name"] for r in sweep["runs"] if r["name"] not in state["runs"]]
    if state["runs"] and added:
        print(f"sweep file edited: {len(added)} new run(s) added: {', '.join(added)}", flush=True)
    for run in sweep["runs"]:
        state["runs"].setdefault(
            run["name"],
            {
                "args": _jsonable(run["args"]),
                "varied": _jsonable(run["varied"]),
                "status": "pending",
                "attempts": 0,
                "replanned": False,
            },
        )
    state["sweep_file_sha256"] = hashlib.sha256(Path(sweep["path"]).read_bytes()).hexdigest()
    return state


def _jsonable(value):
    return json.loads(json.dumps(value))


def run_sweep(sweep_file: str, dry_run: bool = False, time_budget: str | None = None, worker: bool = False) -> dict:
    """Run (or resume) every run of the sweep, or its search's trials; return the final state."""
    sweep = load_sweep(sweep_file)
    if sweep.get("search"):
        from ft_accum.cli.search import run_search

        if time_budget:
            raise ConfigError("--time_budget applies to a grid or a list of runs; a search ends at its n_trials")
        return run_search(sweep, worker=worker, dry_run=dry_run)
    if worker:
        raise ConfigError(f"--worker shares an Optuna study between sweeps; {sweep_file} has no search: section")
    budget = parse_duration(time_budget)
    output_dir = Path(sweep["output_dir"])
    if dry_run:
        print(f"{len(sweep['runs'])} run(s) of {Path(sweep['recipe']).name} into {output_dir}:")
        state_path = output_dir / STATE_FILE
        saved = json.loads(state_path.read_text())["runs"] if state_path.exists() else {}
        for i, run in enumerate(sweep["runs"], 1):
            status = saved.get(run["name"], {}).get("status", "pending")
            print(f"  {i:>2}. {run['name']:<40} {status:<9} {' '.join(f'--{k}={v}' for k, v in run['args'].items())}")
        return {"runs": saved}
    output_dir.mkdir(parents=True, exist_ok=True)
    # One sweep per folder: a second would queue the same runs and rewrite sweep_state.json under the
    # first. Each run's own folder is locked by the recipe that runs in it.
    lock_output_dir(output_dir)
    state = reconcile_state(sweep, output_dir)
    write_state(output_dir, state)
    started, recipe_micro = time.monotonic(), default_micro(Path(sweep["recipe"]))
    queue = [r for r in sweep["runs"] if state["runs"][r["name"]]["status"] not in ("ok", "replanned")]
    for position, run in enumerate(queue, 1):
        record = state["runs"][run["name"]]
        durations = [
            r["wall_seconds"]
            for r in state["runs"].values()
            if r["status"] in ("ok", "replanned") and r.get("wall_seconds")
        ]
        if budget and durations and time.monotonic() - started + sum(durations) / len(durations) > budget:
            record["status"] = "skipped"
            record["error"] = "time budget: not enough left for a run of the measured length"
            write_state(output_dir, state)
            continue
        args = record.get("replanned_args") or run["args"]
        while True:
            outcome = _run_once(sweep, run["name"], args, output_dir, position, len(queue), state)
            if outcome == "out_of_memory" and not record["replanned"]:
                args = replan_for_memory(args, recipe_micro)
                record.update(replanned=True, replanned_args=_jsonable(args), status="pending")
                print(
                    f"  {run['name']}: out of memory; queued again with per_device_train_batch_size "
                    f"{args['per_device_train_batch_size']} (same effective batch)",
                    flush=True,
                )
                write_state(output_dir, state)
                continue
            break
        write_results(sweep, output_dir, state)
    write_results(sweep, output_dir, state)
    counts = {
        s: sum(r["status"] == s for r in state["runs"].values()) for s in ("ok", "replanned", "failed", "skipped")
    }
    print(
        f"sweep done: {counts['ok']} ok, {counts['replanned']} ok after a replan, {counts['failed']} failed, "
        f"{counts['skipped']} skipped; results in {output_dir / 'results.md'}",
        flush=True,
    )
    return state


def _run_once(sweep: dict, name: str, args: dict, output_dir: Path, position: int, total: int, state: dict) -> str:
    record = state["runs"][name]
    run_dir = output_dir / name
    run_dir.mkdir(parents=True, exist_ok=True)
    command = command_for(sweep, {"args": args}, run_dir)
    record.update(status="running", attempts=record["attempts"] + 1, command=command, log=str(run_dir / "log.txt"))
    write_state(output_dir, state)
    metrics = run_dir / "metrics.jsonl"
    first_update = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    progress = ProgressLine()

    def watch(process, began):
        progress.show(*_summary(state, name, run_dir, position, total, began, first_update))

    try:
        returncode, wall, timed_out = launch_and_watch(command, run_dir, sweep["timeout_per_run"], watch)
    except BaseException:
        record["status"] = "interrupted"
        write_state(output_dir, state)
        raise
    finished = (run_dir / "all_results.json").exists() and returncode == 0
    record["wall_seconds"] = record.get("wall_seconds", 0.0) + wall
    if finished:
        record["status"] = "replanned" if record["replanned"] else "ok"
        record.pop("error", None)
        outcome = "ok"
    else:
        tail = (run_dir / "log.txt").read_text(errors="replace")[-4000:]
        record["status"] = "failed"
        record["error"] = (
            f"timed out after {sweep['timeout_per_run']:.0f} s" if timed_out else error_line(run_dir / "log.txt")
        )
        record["log_tail"] = tail.splitlines()[-15:]
        outcome = "out_of_memory" if any(m in tail for m in OOM_MARKERS) else "failed"
        print(f"  {name}: {record['status']}: {record['error']}", flush=True)
    write_state(output_dir, state)
    return outcome


def _summary(
    state: dict, name: str, run_dir: Path, position: int, total: int, began: float, first_update: int
) -> tuple[int, str]:
    """(updates done, 'run i of N: update u of U, ETA …, done/failed/left'); U is read from the recipe's banner."""
    done = sum(r["status"] in ("ok", "replanned") for r in state["runs"].values())
    failed = sum(r["status"] == "failed" for r in state["runs"].values())
    metrics = run_dir / "metrics.jsonl"
    update = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    banner = (
        re.findall(r"(\d+) optimizer updates", (run_dir / "log.txt").read_text(errors="replace"))
        if (run_dir / "log.txt").exists()
        else []
    )
    planned = int(banner[-1]) if banner else None
    elapsed = time.monotonic() - began
    progress = f"update {update}" + (f" of {planned}" if planned else "")
    if planned and update > first_update:  # the rate of this attempt (a resumed run starts past 0)
        progress += f", ETA {(planned - update) * elapsed / (update - first_update) / 60:.1f} min"
    return (
        update,
        f"[run {position}/{total}] {name}: {progress} | done {done}, failed {failed}, left {total - position}",
    )


def write_results(sweep: dict, output_dir: Path, state: dict) -> None:
    """results.csv and results.md: one row per run, varied settings, final eval metrics, speed, memory, status."""
    rows = []
    for run in sweep["runs"]:
        record = state["runs"][run["name"]]
        results_path = output_dir / run["name"] / "all_results.json"
        results = (
            json.loads(results_path.read_text())
            if results_path.exists() and record["status"] in ("ok", "replanned")
            else {}
        )
        row = {"run": run["name"], **{k: v for k, v in record["varied"].items()}}
        row.update({k: v for k, v in results.items() if k.startswith("eval_")})
        row.update(
            {
                "updates": results.get("num_update_steps"),
                "effective_batch_size": results.get("effective_batch_size"),
                "per_device_train_batch_size": results.get("per_device_train_batch_size"),
                "wall_seconds": round(record.get("wall_seconds", 0.0), 1),
                "samples_per_second": results.get("train_samples_per_second"),
                "peak_memory_gb": results.get("peak_memory_gb"),
                "status": record["status"],
                "error": record.get("error", ""),
            }
        )
        rows.append(row)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    tmp = output_dir / ".results.csv.tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, output_dir / "results.csv")

    def cell(value):
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    (output_dir / "results.md").write_text(f"# Sweep {Path(sweep['path']).name}\n\n" + "\n".join(lines) + "\n")
