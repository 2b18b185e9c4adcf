"""python benchmarks/bench_batchnorm.py [--seeds 42 43] [--num_train_epochs 8]

What accumulation does to BatchNorm in practice, on the image recipe's offline default (the small
ResNet from a config, trained from scratch on scikit-learn's 1,797 digits, effective batch 32):

- BN, true batch 32          (32 micro × 1 accumulation): the reference BatchNorm run;
- BN, 8 × 4 accumulated      (--batchnorm keep): each micro-batch of 8 normalised on its own;
- GroupNorm, 8 × 4           (--batchnorm groupnorm): per-sample, so exactly one batch of 32;
- frozen BN, 8 × 4           (--batchnorm freeze): the running statistics of a fresh model (mean 0,
  variance 1), i.e. no normalisation at all when training from scratch.

Every contender runs through the real `accelerate launch`, interleaved per seed, with the same
hyperparameters (recipes/configs/image_classification.yaml). Reports held-out accuracy and loss,
and training seconds per epoch. Results: benchmarks/results/batchnorm.json and a table on stdout.
"""

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from ft_accum.testing import launch_command

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = {
    "BN, true batch 32": ["--per_device_train_batch_size=32", "--batchnorm=keep"],
    "BN, 8 × 4 accumulated": ["--per_device_train_batch_size=8", "--batchnorm=keep"],
    "GroupNorm, 8 × 4": ["--per_device_train_batch_size=8", "--batchnorm=groupnorm"],
    "frozen BN, 8 × 4": ["--per_device_train_batch_size=8", "--batchnorm=freeze"],
}


def run(extra: list[str], seed: int, epochs: int, out: Path) -> dict:
    command, env = launch_command(
        "image_classification",
        [
            "--config",
            str(ROOT / "recipes" / "configs" / "image_classification.yaml"),
            "--effective_batch_size=32",
            f"--seed={seed}",
            f"--num_train_epochs={epochs}",
            "--checkpointing_steps=100000",
            "--report_to=none",
            f"--output_dir={out}",
            "--overwrite_output_dir",
            *extra,
        ],
    )
    finished = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if finished.returncode:
        raise SystemExit(finished.stderr[-3000:])
    results = json.loads((out / "all_results.json").read_text())
    return {
        "eval_accuracy": results["eval_accuracy"],
        "eval_loss": results["eval_loss"],
        "seconds_per_epoch": results["train_runtime"] / epochs,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43])
    parser.add_argument("--num_train_epochs", type=int, default=8)
    args = parser.parse_args()
    runs = {name: [] for name in CONTENDERS}
    for seed in args.seeds:
        for name, extra in CONTENDERS.items():
            runs[name].append(
                {
                    "seed": seed,
                    **run(
                        extra,
                        seed,
                        args.num_train_epochs,
                        ROOT
                        / "outputs"
                        / "bench_batchnorm"
                        / f"{len(runs[name])}-{seed}-{extra[-1][12:]}-{extra[0][-2:]}",
                    ),
                }
            )
            print(name, json.dumps(runs[name][-1]), flush=True)
    (ROOT / "benchmarks" / "results" / "batchnorm.json").write_text(
        json.dumps({"args": vars(args), "runs": runs}, indent=2)
    )
    print("\n| contender | held-out accuracy (per seed) | median | eval loss (median) | s / epoch (median) |")
    print("|---|---|---|---|---|")
    for name, rows in runs.items():
        accuracies = [r["eval_accuracy"] for r in rows]
        print(
            f"| {name} | {', '.join(f'{a:.3f}' for a in accuracies)} | {statistics.median(accuracies):.3f} | "
            f"{statistics.median(r['eval_loss'] for r in rows):.3f} | {statistics.median(r['seconds_per_epoch'] for r in rows):.1f} |"
        )


if __name__ == "__main__":
    main()
