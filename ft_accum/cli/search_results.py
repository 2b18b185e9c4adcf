"""A search's results: the study's trials as records, the best one, and the tables of results.md and
`ft-accum report`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ft_accum.cli.search_space import import_optuna
from ft_accum.cli.search_study import open_storage
from ft_accum.cli.search_trials import final_learning_rate
from ft_accum.training.model_card import write_atomically

SEARCH_FILE = "search.json"  # what `ft-accum report` needs to find the study


def load_search_study(output_dir: Path):
    """(optuna, study, search.json's record) of a search's output folder, for `ft-accum report`."""
    optuna = import_optuna()
    record = json.loads((output_dir / SEARCH_FILE).read_text())
    storage, _ = open_storage(optuna, {"storage": record["storage"]}, output_dir, worker=False)
    return optuna, optuna.load_study(study_name=record["study_name"], storage=storage), record


def trial_records(optuna, study, output_dir: Path, num_processes: int) -> list[dict[str, Any]]:
    """One row per trial: parameters, base and final LR, metric, state, updates done, wall time."""
    rows = []
    for frozen in study.get_trials(deepcopy=False):
        attrs = frozen.user_attrs
        run = attrs.get("run", f"trial_{frozen.number:04d}")
        args = attrs.get("args") or {}
        metrics = output_dir / run / "metrics.jsonl"
        rows.append({
            "run": run,
            "number": frozen.number,
            "state": frozen.state.name,
            "value": frozen.value,
            "params": dict(frozen.params),
            "final_learning_rate": final_learning_rate(args, num_processes) if args else None,
            "per_device_train_batch_size": args.get("per_device_train_batch_size"),
            "evaluations": len(frozen.intermediate_values),
            "last_reported": frozen.intermediate_values[max(frozen.intermediate_values)] if frozen.intermediate_values else None,
            "updates": len(metrics.read_text().splitlines()) if metrics.exists() else 0,
            "wall_seconds": round(attrs.get("wall_seconds", 0.0), 1),
            "command": attrs.get("command", ""),
            "resume_command": attrs.get("resume_command"),
            "error": attrs.get("error", ""),
            "same_as": attrs.get("same_as"),
        })  # fmt: skip
    return rows


def best_record(records: list[dict], direction: str) -> dict | None:
    complete = [r for r in records if r["state"] == "COMPLETE" and r["value"] is not None]
    if not complete:
        return None
    return (max if direction == "maximize" else min)(complete, key=lambda r: r["value"])


def trials_table(records: list[dict], search: dict) -> list[str]:
    """The markdown table of the trials, in order."""
    names = list(dict.fromkeys(k for r in records for k in r["params"]))
    columns = ["trial", *names]
    if "learning_rate" in names:
        columns.append("final LR")
    columns += [search["metric"], "state", "evaluations", "updates", "wall s"]

    def cell(value):
        return f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in records:
        values = [r["run"], *(r["params"].get(n) for n in names)]
        if "learning_rate" in names:
            values.append(r["final_learning_rate"])
        metric = r["value"] if r["state"] == "COMPLETE" else r["last_reported"]
        state = r["state"].lower() + (f" ({r['error']})" if r["error"] else "")
        state += f" (as {r['same_as']}, not run again)" if r.get("same_as") else ""
        values += [metric, state.replace("|", "\\|"), r["evaluations"], r["updates"], r["wall_seconds"]]
        lines.append("| " + " | ".join(cell(v) for v in values) + " |")
    return lines


def summary_lines(records: list[dict], search: dict) -> list[str]:
    """The trials table and the best trial's command, as markdown lines: results.md, and the head of
    `ft-accum report` on a search folder. `search` needs metric, direction and n_trials."""
    best = best_record(records, search["direction"])
    text = [f"# Search: {search['direction']} {search['metric']}, {len(records)} of {search['n_trials']} trials", ""]
    text += trials_table(records, search)
    text.append("")
    text.append(
        "`final LR` is the LR the run trained at: the searched --learning_rate scaled by the recipe's "
        "--lr_scaling to the trial's effective batch. A pruned trial's metric is its last reported evaluation."
    )
    if best:
        text += ["", f"Best: {best['run']}, {search['metric']} {best['value']:.4g}. Reproduce it with:", "",
                 "```bash", best["command"], "```"]  # fmt: skip
    return text


def write_search_results(output_dir: Path, records: list[dict], search: dict) -> None:
    """results.md (`summary_lines`) and results.json."""
    best = best_record(records, search["direction"])
    write_atomically(output_dir / "results.json", json.dumps({"trials": records, "best": best}, indent=2) + "\n")
    write_atomically(output_dir / "results.md", "\n".join(summary_lines(records, search)) + "\n")
