"""python benchmarks/bench_search.py [--max_train_samples 320] [--output benchmarks/results/search.json]

A 12-trial Optuna search (TPE, median pruning) against a grid of the same 12 configurations, both
through `ft-accum sweep` on the text-classification recipe's offline default (all-MiniLM-L6-v2 on
BBC News topics, its shipped config) on this CPU: learning_rate × effective_batch_size, 4 × 3. Both
sweeps run one after the other, not at the same time. Reports each one's best eval_accuracy, its
wall time, and the optimizer updates the search's pruning saved (the updates its pruned trials
would still have run, from each run's banner). Then `ft-accum report` on the search writes the
morning's report (trials table and Optuna's plots) beside it. Needs the [demo,search,report] extras.

--quick: 2 configurations of a tiny config-built model for 2 trials: a smoke test, never a measurement.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ft_accum.testing.benchmarking import machine_info  # noqa: E402

GRID = {"learning_rate": [3.0e-5, 1.0e-4, 3.0e-4, 1.0e-3], "effective_batch_size": [16, 32, 64]}


def sweep_files(folder: Path, max_train_samples: int, quick: bool, warmup: int) -> tuple[Path, Path]:
    """grid.yaml and search.yaml: the same base, the same 12 configurations."""
    base = yaml.safe_load((ROOT / "recipes" / "configs" / "text_classification.yaml").read_text())
    for key in ("output_dir", "effective_batch_size", "learning_rate"):
        base.pop(key, None)
    base.update(max_train_samples=max_train_samples, report_to="none", checkpointing_steps=1000)
    grid = dict(GRID)
    if quick:
        from ft_accum.testing import make_rows, make_tiny_bert, write_jsonl

        model = make_tiny_bert(folder / "tiny-bert")
        base.update(model_name_or_path=str(model), max_seq_length=32, num_train_epochs=2,
                    train_file=str(write_jsonl(folder / "train.jsonl", make_rows(48, seed=1))),
                    validation_file=str(write_jsonl(folder / "validation.jsonl", make_rows(12, seed=2))))  # fmt: skip
        grid = {"learning_rate": [1.0e-3, 1.0e-5], "effective_batch_size": [8]}
    common = {"recipe": "text_classification", "accelerate_config": str(ROOT / "accelerate_configs" / "cpu.yaml")}
    grid_file, search_file = folder / "grid.yaml", folder / f"search_warmup{warmup}.yaml"
    grid_file.write_text(yaml.safe_dump({**common, "output_dir": str(folder / "grid"), "base": base, "grid": grid}))
    search = {
        "n_trials": 2 if quick else 12,
        "metric": "eval_accuracy",
        "direction": "maximize",
        "sampler": "tpe",
        "seed": 0,
        "pruner": {"type": "median", "n_startup_trials": 1 if quick else 3, "n_warmup_evaluations": warmup},
        "space": {name: {"choices": values} for name, values in grid.items()},
    }
    search_file.write_text(
        yaml.safe_dump({**common, "output_dir": str(folder / search_file.stem), "base": base, "search": search})
    )
    return grid_file, search_file


def run_sweep(sweep_file: Path, log: Path) -> float:
    started = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-m", "ft_accum.cli.main", "sweep", str(sweep_file)], cwd=ROOT,
                       stdout=f, stderr=subprocess.STDOUT, check=True)  # fmt: skip
    return time.perf_counter() - started


def updates(run_dir: Path) -> tuple[int, int]:
    """(updates done, updates planned): metrics.jsonl's lines, and the banner's `N optimizer updates`."""
    done = len((run_dir / "metrics.jsonl").read_text().splitlines()) if (run_dir / "metrics.jsonl").exists() else 0
    planned = re.findall(r"(\d+) optimizer updates", (run_dir / "log.txt").read_text())
    return done, int(planned[0]) if planned else done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_train_samples", type=int, default=320)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "search.json"))
    parser.add_argument("--folder", default=None, help="where the sweeps run (default: a temporary folder)")
    parser.add_argument(
        "--n_warmup_evaluations", type=int, default=0, help="the median pruner's: evaluations never pruned"
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    folder = Path(args.folder or tempfile.mkdtemp(prefix="bench_search_"))
    folder.mkdir(parents=True, exist_ok=True)
    grid_file, search_file = sweep_files(folder, args.max_train_samples, args.quick, args.n_warmup_evaluations)
    search_dir = folder / search_file.stem
    # A grid that an earlier invocation finished in this folder is not run again (the sweep would skip
    # every run); its time is then the sum of its runs' wall times, as for the search below.
    state = folder / "grid" / "sweep_state.json"
    grid_done = state.exists() and all(r["status"] == "ok" for r in json.loads(state.read_text())["runs"].values())
    grid_seconds = None if grid_done else run_sweep(grid_file, folder / "grid.log")
    search_seconds = run_sweep(search_file, folder / f"{search_file.stem}.log")
    with open(folder / "grid" / "results.csv") as f:
        grid_rows = list(csv.DictReader(f))
    grid_best = max(grid_rows, key=lambda r: float(r["eval_accuracy"] or 0))
    trials = json.loads((search_dir / "results.json").read_text())
    counts = {"done": 0, "planned": 0}
    for trial in trials["trials"]:
        if trial.get("same_as"):  # a repeat, told the earlier trial's end without a run
            trial["updates_planned"] = 0
            continue
        done, planned = updates(search_dir / trial["run"])
        trial["updates_planned"] = planned
        counts["done"] += done
        counts["planned"] += planned
    grid_updates = sum(updates(folder / "grid" / r["run"])[0] for r in grid_rows)
    subprocess.run([sys.executable, "-m", "ft_accum.cli.main", "report", str(search_dir)], cwd=ROOT, check=True)
    grid_run_seconds = sum(float(r["wall_seconds"]) for r in grid_rows)
    search_run_seconds = sum(t["wall_seconds"] for t in trials["trials"])
    result = {
        "command": "python benchmarks/bench_search.py" + (" --quick" if args.quick else f" --max_train_samples {args.max_train_samples} --n_warmup_evaluations {args.n_warmup_evaluations}"),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "folder": str(folder),
        "grid": {"wall_seconds": round(grid_seconds, 1) if grid_seconds else None, "run_seconds": round(grid_run_seconds, 1), "best_eval_accuracy": float(grid_best["eval_accuracy"]),
                 "best": grid_best["run"], "updates": grid_updates,
                 "runs": [{k: r[k] for k in ("run", "eval_accuracy", "updates", "wall_seconds", "status")} for r in grid_rows]},
        "search": {"wall_seconds": round(search_seconds, 1), "run_seconds": round(search_run_seconds, 1), "n_warmup_evaluations": args.n_warmup_evaluations,
                   "repeats_not_run": sum(bool(t.get("same_as")) for t in trials["trials"]), "best_eval_accuracy": (trials["best"] or {}).get("value"),
                   "best": (trials["best"] or {}).get("run"), "best_params": (trials["best"] or {}).get("params"),
                   "updates": counts["done"], "updates_if_unpruned": counts["planned"],
                   "pruned": sum(t["state"] == "PRUNED" for t in trials["trials"]),
                   "trials": [{k: t.get(k) for k in ("run", "params", "state", "value", "last_reported", "evaluations", "updates", "updates_planned", "wall_seconds", "same_as")} for t in trials["trials"]]},
    }  # fmt: skip
    if not args.quick:  # one result per pruner setting, kept side by side
        saved = json.loads(Path(args.output).read_text()) if Path(args.output).exists() else {}
        saved = saved if "runs" in saved else {"runs": {}}
        saved["runs"][f"n_warmup_evaluations={args.n_warmup_evaluations}"] = result
        Path(args.output).write_text(json.dumps(saved, indent=2) + "\n")
    g, s = result["grid"], result["search"]
    print(f"| | best eval_accuracy | the runs' wall time | optimizer updates |\n|---|---|---|---|\n"
          f"| grid, 12 runs | {g['best_eval_accuracy']:.4f} ({g['best']}) | {g['run_seconds'] / 60:.1f} min | {g['updates']} |\n"
          f"| TPE + median pruning (warm-up {args.n_warmup_evaluations}), 12 trials | {s['best_eval_accuracy']:.4f} ({s['best']}) "
          f"| {s['run_seconds'] / 60:.1f} min | {s['updates']} ({s['pruned']} pruned, {s['updates_if_unpruned'] - s['updates']} "
          f"saved; {s['repeats_not_run']} repeats not run) |")  # fmt: skip
    print(f"report: {search_dir / 'report'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
