"""python benchmarks/bench_loop_redesign.py --commit af29a05 [--task classification lm] [--accumulation 1 4] [--repeats 3]

Issue 54 moved the division before the backward: each window is fetched and counted (one all-reduce)
before its first forward, instead of rescaling the gradients at the sync step. Does the recipe's loop
run slower for it? This runs the recipe variant of bench_loop_overhead.py (the same models, data,
flags and steady per-update rate) from this tree and from `--commit`'s tree, checked out with
`git worktree` under --out, each with its own `ft_accum` first on PYTHONPATH, through the real
`accelerate launch` on accelerate_configs/cpu.yaml. The two alternate within each repeat (before,
after; then after, before), so neither always runs first. Reported per task and accumulation: each
side's median rate and the median of the per-repeat ratios after / before.
Results: benchmarks/results/loop_redesign.json.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ft_accum.testing import load_script, read_metrics
from ft_accum.testing.benchmarking import launch_in_tree, machine_info, steady_rate

ROOT = Path(__file__).resolve().parents[1]


def run_recipe_in(tree: Path, recipe: str, args: list[str]) -> list[dict]:
    """One launch of `tree`'s recipe with `tree`'s ft_accum; its metrics.jsonl records."""
    with tempfile.TemporaryDirectory() as out:
        launch_in_tree(tree, recipe, ["--config=none", *args], out)
        return read_metrics(Path(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="af29a05")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "loop_redesign")
    parser.add_argument("--task", nargs="+", choices=["classification", "lm"], default=["classification", "lm"])
    parser.add_argument("--accumulation", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "loop_redesign.json")
    args = parser.parse_args()
    bench = load_script(ROOT / "benchmarks" / "bench_loop_overhead.py")
    before = args.out / f"tree-{args.commit}"
    if not before.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.commit], cwd=ROOT, check=True)
    trees = {"before": before, "after": ROOT}
    tables = []
    with tempfile.TemporaryDirectory() as models:
        for task in args.task:
            model_dir = bench.build_model_dir(task, False, Path(models) / task)
            key = "tokens_per_second" if task == "lm" else "samples_per_second"
            for accumulation in args.accumulation:
                updates = max(3, 48 // accumulation)
                recipe, flags = bench.recipe_args(task, model_dir, accumulation, updates)
                rates = {"before": [], "after": []}
                for repeat in range(args.repeats):
                    for side in ("before", "after") if repeat % 2 == 0 else ("after", "before"):
                        rate = steady_rate([r[key] for r in run_recipe_in(trees[side], recipe, flags)])
                        rates[side].append(rate)
                        print(f"{task} ×{accumulation} repeat {repeat + 1} {side}: {rate:.1f}", file=sys.stderr)
                ratios = [a / b for a, b in zip(rates["after"], rates["before"])]
                tables.append(
                    {
                        "task": task,
                        "accumulation": accumulation,
                        "unit": bench.UNIT[task],
                        "rates": rates,
                        "median_before": statistics.median(rates["before"]),
                        "median_after": statistics.median(rates["after"]),
                        "ratio_after_to_before": statistics.median(ratios),
                        "per_repeat_ratios": ratios,
                    }
                )
                print(json.dumps(tables[-1]))
    result = {"commit": args.commit, "command": " ".join(sys.argv), "machine": machine_info(), "tables": tables}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
