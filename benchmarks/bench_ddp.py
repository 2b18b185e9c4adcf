"""python benchmarks/bench_ddp.py [--repeats 3] [--quick]

Throughput of every recipe under 2 real DDP processes against 1 process, at the same effective
batch, through the real `accelerate launch`: one process with `--config_file accelerate_configs/cpu.yaml`,
two with `ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2` (torchrun,
MULTI_CPU, gloo; `OMP_NUM_THREADS` = cores / 2 so the two processes share the cores instead of
fighting over them). Each recipe runs its own config (recipes/configs/<name>.yaml) for a few
updates; its config gives the effective batch, so the accumulation halves on two processes.
Every run asserts the process count it got from all_results.json.

The figure is the median per-update rate, warm-up left out (samples/s; target tokens/s for the
causal LM), 1 and 2 processes interleaved, alternating which runs first. On a 2-core machine with no GPU two processes share the
same two cores, so this measures DDP's cost (the gradient all-reduce, the split data), not a speed-up.
--quick: image_classification only, 3 updates, once, the 1-process run in this process.
"""

import statistics
import sys
from pathlib import Path

from ft_accum.testing.benchmarking import launch_recipe, repeats_main, run_recipe, steady_rate

ROOT = Path(__file__).resolve().parents[1]

UPDATES = {
    "text_classification": 6,
    "token_classification": 6,
    "seq2seq": 8,
    "image_classification": 20,
    "causal_lm": 6,
}


def run(recipe: str, num_processes: int, updates: int, quick: bool = False) -> float:
    args = [
        "--config",
        str(ROOT / "recipes" / "configs" / f"{recipe}.yaml"),
        f"--max_train_steps={updates}",
        "--num_train_epochs=1",
        "--max_eval_samples=8",
        f"--checkpointing_steps={updates + 1}",
    ]
    if quick and num_processes == 1:  # a smoke test: only the 2-process run needs the launcher
        results, records = run_recipe(recipe, args, in_process=True)
    else:
        results, records = launch_recipe(recipe, args, num_processes)
    if results["num_processes"] != num_processes:
        raise RuntimeError(f"{recipe}: asked for {num_processes} processes, the run had {results['num_processes']}")
    return steady_rate([r["tokens_per_second" if recipe == "causal_lm" else "samples_per_second"] for r in records])


def measure(repeats: int = 3, quick: bool = False) -> dict:
    recipes = ["image_classification"] if quick else list(UPDATES)
    tables = {}
    for recipe in recipes:
        updates = 3 if quick else UPDATES[recipe]
        runs = {1: [], 2: []}
        for repeat in range(repeats):
            for num_processes in (1, 2) if repeat % 2 == 0 else (2, 1):  # alternate which goes first
                rate = run(recipe, num_processes, updates, quick)
                runs[num_processes].append(rate)
                print(
                    f"{recipe} repeat {repeat + 1}/{repeats} {num_processes} process(es): {rate:.1f}", file=sys.stderr
                )
        ratios = [two / one for one, two in zip(runs[1], runs[2])]
        tables[recipe] = {
            "unit": "tokens/s" if recipe == "causal_lm" else "samples/s",
            "updates": updates,
            "runs": {str(k): v for k, v in runs.items()},
            "median": {str(k): statistics.median(v) for k, v in runs.items()},
            "per_repeat_ratios": ratios,
            "ratio": statistics.median(ratios),
        }
    return {
        "setup": {"repeats": repeats, "quick": quick, "device": "cpu", "precision": "fp32", "backend": "gloo"},
        "recipes": tables,
    }


if __name__ == "__main__":
    repeats_main(measure, __doc__, ROOT / "benchmarks" / "results" / "ddp.json")
