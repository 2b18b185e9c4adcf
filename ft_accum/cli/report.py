"""`ft-accum report OUTPUT_DIR [OUTPUT_DIR ...]`: plots and a table that compare runs.

Reads each run's `metrics.jsonl` (one line per optimizer update) and `all_results.json`, and
writes PNG plots (matplotlib, non-interactive Agg backend) plus a `report.md` that embeds them
under a summary table. Several runs, or a sweep's output_dir (every run folder under it), are
overlaid: this is how ten overnight experiments are compared in the morning.

On a search's output folder (`ft-accum sweep` with a `search:` section) the report begins with the
trials table (parameters, base and final LR, the metric, the state, evaluations, updates done, wall
time), the best trial with the command that reproduces it, and Optuna's own plots (optimization
history, the reported evaluations of every trial, parameter importances, parallel coordinates),
drawn by optuna.visualization.matplotlib.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ft_accum.core.errors import ConfigError

# (file, title, y key, y label, log scale)
PLOTS = [
    ("loss.png", "Training loss per update", "loss", "loss (window mean)", True),
    ("lr.png", "Learning rate", "lr", "learning rate", False),
    ("grad_norm.png", "Gradient norm before clipping", "grad_norm", "‖g‖", True),
    ("throughput.png", "Throughput", None, "per second", False),
    ("noise_scale.png", "Gradient noise scale vs effective batch", "noise_scale", "samples or tokens", True),
    # recipes/preference_tuning.py: means over each update's pairs
    ("reward_accuracy.png", "Reward accuracy per update", "reward_accuracy", "chosen reward > rejected", False),
    ("reward_margin.png", "Reward margin per update", "reward_margin", "chosen − rejected reward", False),
]


def find_runs(paths: list[str]) -> list[Path]:
    """Each path is a run folder (it holds metrics.jsonl) or a sweep folder (its subfolders do)."""
    runs = []
    for text in paths:
        path = Path(text)
        if (path / "metrics.jsonl").is_file():
            runs.append(path)
        elif path.is_dir() and (found := sorted(p.parent for p in path.glob("*/metrics.jsonl"))):
            runs.extend(found)
        else:
            raise ConfigError(
                f"{path} holds no metrics.jsonl (nor do its subfolders); pass a run's --output_dir or a sweep's output_dir"
            )
    return runs


def read_records(metrics_file: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl. A last line cut off by a kill is skipped with a warning; a damaged
    line before it is an error that names it (something other than a kill broke the file)."""
    lines = [
        (n, line) for n, line in enumerate(metrics_file.read_text(errors="replace").splitlines(), 1) if line.strip()
    ]
    records = []
    for position, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif position == len(lines) - 1:
            print(
                f"warning: {metrics_file} line {number} is cut off (a run killed while writing it); skipped it",
                file=sys.stderr,
            )
        else:
            raise ConfigError(
                f"{metrics_file} line {number} is not a JSON object; the file is damaged, repair or remove that line"
            )
    return records


def load_run(path: Path) -> dict[str, Any]:
    records = read_records(path / "metrics.jsonl")
    if not records:
        raise ConfigError(f"{path / 'metrics.jsonl'} is empty: the run logged no update yet")
    results_path = path / "all_results.json"
    try:
        results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    except ValueError:
        raise ConfigError(f"{results_path} is not valid JSON; rerun the last evaluation or remove the file") from None
    return {"name": path.name, "path": path, "records": records, "results": results}


def make_report(paths: list[str], out_dir: str | None = None) -> Path:
    """Write the plots and report.md; return the report's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [load_run(p) for p in find_runs(paths)]
    out = Path(out_dir) if out_dir else (runs[0]["path"] if len(runs) == 1 else runs[0]["path"].parent) / "report"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, title, key, ylabel, log in PLOTS:
        if key and not any(key in r for run in runs for r in run["records"]):
            continue  # e.g. no noise_scale unless --measure_noise_scale was on
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        for run in runs:
            records = run["records"]
            if key == "loss":
                x_key = "tokens_seen" if "tokens_per_second" in records[0] else "samples_seen"
                x = [r[x_key] for r in records]
                ax.set_xlabel(x_key.replace("_", " "))
            else:
                x = [r["step"] for r in records]
                ax.set_xlabel("optimizer update")
            if key is None:
                y_key = "tokens_per_second" if "tokens_per_second" in records[0] else "samples_per_second"
                ax.set_ylabel(y_key.replace("_", " "))
            else:
                y_key = key
                ax.set_ylabel(ylabel)
            points = [
                (a, r[y_key])
                for a, r in zip(x, records)
                if r.get(y_key) is not None and r[y_key] == r[y_key] and r[y_key] != float("inf")
            ]
            if key == "noise_scale" and not points and any(r.get(y_key) == float("inf") for r in records):
                # Every estimate infinite: |G|² was never measured positive (noise dominates). Say so, not an empty plot.
                ax.text(
                    0.5,
                    0.5,
                    f"{run['name']}: noise scale not measurable yet (|G|² ≤ 0 at every update)",
                    transform=ax.transAxes,
                    ha="center",
                    fontsize=8,
                )
            if points:
                # Markers: the noise scale may be finite at only a few updates (inf elsewhere is left out).
                (line,) = ax.plot(
                    *zip(*points), label=run["name"], linewidth=1.4, marker="." if key == "noise_scale" else None
                )
                batches = [(a, r["noise_scale_batch"]) for a, r in zip(x, records) if r.get("noise_scale_batch")]
                if (
                    key == "noise_scale" and batches
                ):  # the batch per update, in the noise scale's unit (samples or tokens)
                    ax.step(
                        *zip(*batches),
                        where="post",
                        color=line.get_color(),
                        linestyle="--",
                        linewidth=1,
                        label=f"{run['name']}: batch",
                    )
                elif key == "noise_scale" and run["results"].get("effective_batch_size"):
                    ax.axhline(
                        run["results"]["effective_batch_size"],
                        color=line.get_color(),
                        linestyle="--",
                        linewidth=1,
                        label=f"{run['name']}: effective batch",
                    )
        if log:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if len(runs) > 1 or key == "noise_scale":
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / filename)
        plt.close(fig)
        written.append((filename, title))
    searches = [Path(p) for p in paths if (Path(p) / "search.json").is_file()]
    head = [line for folder in searches for line in search_section(folder, out, plt)]
    (out / "report.md").write_text("\n".join(head) + ("\n" if head else "") + _markdown(runs, written))
    return out / "report.md"


SEARCH_PLOTS = [  # (file, title, optuna.visualization.matplotlib function)
    ("search_history.png", "Optimization history", "plot_optimization_history"),
    ("search_evaluations.png", "Each trial's evaluations (pruned trials end early)", "plot_intermediate_values"),
    ("search_importances.png", "Parameter importances (fANOVA)", "plot_param_importances"),
    ("search_parallel.png", "Parallel coordinates", "plot_parallel_coordinate"),
]


def search_section(folder: Path, out: Path, plt) -> list[str]:
    """The search's trials table, its best trial's command, and Optuna's plots, as report.md lines."""
    import warnings

    from ft_accum.cli import search_results

    optuna, study, record = search_results.load_search_study(folder)
    trials = search_results.trial_records(optuna, study, folder, record.get("num_processes", 1))
    lines = search_results.summary_lines(trials, record) + [""]
    import optuna.visualization.matplotlib as optuna_plots

    for filename, title, function in SEARCH_PLOTS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
            try:
                axes = getattr(optuna_plots, function)(study)
            except (ValueError, RuntimeError, ZeroDivisionError) as exc:  # e.g. importances of one finished trial
                lines += [f"## {title}", "", f"(not drawn: {exc})", ""]
                continue
        if function in ("plot_optimization_history", "plot_intermediate_values"):
            axes.set_ylabel(record["metric"])
            axes.set_xlabel("trial" if function == "plot_optimization_history" else "evaluation (epoch)")
        figure = (axes.flat[0] if hasattr(axes, "flat") else axes).get_figure()
        figure.set_size_inches(8, 4.8)
        figure.tight_layout()
        figure.savefig(out / filename, dpi=110)
        plt.close(figure)
        lines += [f"## {title}", "", f"![{title}]({filename})", ""]
    return lines


def _markdown(runs: list[dict], plots: list[tuple[str, str]]) -> str:
    eval_keys = sorted({k for run in runs for k in run["results"] if k.startswith("eval_")})
    columns = [
        "run",
        "effective batch",
        "micro × accum",
        "updates",
        "final train loss",
        *eval_keys,
        "train time (s)",
        "samples/s",
        "peak memory (GB)",
    ]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for run in runs:
        last, results = run["records"][-1], run["results"]

        def fmt(value):
            return f"{value:.4g}" if isinstance(value, float) else ("" if value is None else str(value))

        row = [
            run["name"],
            fmt(results.get("effective_batch_size")),
            f"{last.get('per_device_train_batch_size', results.get('per_device_train_batch_size', ''))} × "
            f"{last.get('gradient_accumulation_steps', results.get('gradient_accumulation_steps', ''))}",
            fmt(last["step"]),
            fmt(last["loss"]),
            *(fmt(results.get(k)) for k in eval_keys),
            fmt(results.get("train_runtime")),
            fmt(results.get("train_samples_per_second")),
            fmt(results.get("peak_memory_gb")),
        ]
        lines.append("| " + " | ".join(row) + " |")
    body = [f"# Training report: {len(runs)} run{'s' if len(runs) != 1 else ''}", "", *lines, ""]
    for filename, title in plots:
        body += [f"## {title}", "", f"![{title}]({filename})", ""]
    return "\n".join(body)
