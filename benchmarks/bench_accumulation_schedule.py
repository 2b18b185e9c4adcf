"""python benchmarks/bench_accumulation_schedule.py [--seeds 42 43] [--max_train_samples 640] [--num_train_epochs 3]

Adaptive accumulation against fixed small and fixed large effective batches, at equal samples.

The task is the text-classification recipe's offline default (pretrained MiniLM, BBC News, the
hyperparameters of recipes/configs/text_classification.yaml: AdamW, LR 1e-4 at batch 32 with
sqrt scaling, linear decay, 5 warmup updates). Only the effective batch differs:

- fixed 16:  8 micro × 2 accumulation for the whole run;
- fixed 128: 8 micro × 16 accumulation;
- adaptive:  starts at 16 and doubles (up to 128) while the measured noise scale exceeds 2× the batch.

Every run sees the same samples in the same order (same seed, same epochs). Nothing was tuned
for any contender. Each run goes through the real `accelerate launch`; results go to
benchmarks/results/accumulation_schedule.json, a Markdown table on stdout, and the overlay plots
of `ft-accum report` in benchmarks/results/accumulation_schedule/.
"""

import argparse
import json
import subprocess
import time
from pathlib import Path

from ft_accum.testing import launch_command, read_metrics

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONTENDERS = {
    "fixed 16": ["--effective_batch_size=16"],
    "fixed 128": ["--effective_batch_size=128"],
    "adaptive 16→128": ["--effective_batch_size=16", "--accumulation_schedule=adaptive:max=128"],
}


def run(name: str, extra: list[str], seed: int, args, out: Path) -> dict:
    command, env = launch_command(
        "text_classification",
        [
            "--config",
            str(ROOT / "recipes" / "configs" / "text_classification.yaml"),
            "--per_device_train_batch_size=8",
            f"--seed={seed}",
            f"--max_train_samples={args.max_train_samples}",
            f"--num_train_epochs={args.num_train_epochs}",
            "--checkpointing_steps=1000",
            "--report_to=none",
            f"--output_dir={out}",
            "--overwrite_output_dir",
            *extra,
        ],
    )
    started = time.perf_counter()
    finished = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if finished.returncode:
        raise SystemExit(f"{name} failed:\n{finished.stderr[-3000:]}")
    results = json.loads((out / "all_results.json").read_text())
    records = read_metrics(out)
    advice = [line for line in finished.stdout.splitlines() if "noise scale" in line]
    return {
        "contender": name,
        "seed": seed,
        "eval_accuracy": results["eval_accuracy"],
        "eval_loss": results["eval_loss"],
        "updates": results["num_update_steps"],
        "samples": records[-1]["samples_seen"],
        "wall_seconds": time.perf_counter() - started,
        "final_effective_batch": records[-1]["effective_batch_size"],
        "batch_path": sorted({r["effective_batch_size"] for r in records}),
        "last_noise_scale": records[-1].get("noise_scale"),
        "advice": advice[-1] if advice else None,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43])
    parser.add_argument("--max_train_samples", type=int, default=640)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    args = parser.parse_args()
    outputs = RESULTS / "accumulation_schedule"
    rows = []
    for seed in args.seeds:
        for name, extra in CONTENDERS.items():  # interleaved: one of each per seed
            out = (
                ROOT
                / "outputs"
                / "bench_accumulation_schedule"
                / f"{name.split()[0]}-{name.split()[1].split('→')[0]}-seed{seed}"
            )
            rows.append(run(name, extra, seed, args, out))
            print(json.dumps(rows[-1]), flush=True)
    (RESULTS / "accumulation_schedule.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2))
    print("\n| contender | seed | eval accuracy | eval loss | updates | samples | effective batches used | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['contender']} | {r['seed']} | {r['eval_accuracy']:.3f} | {r['eval_loss']:.3f} | {r['updates']} | {r['samples']} | "
            f"{', '.join(map(str, r['batch_path']))} | {r['wall_seconds']:.0f} |"
        )
    from ft_accum.cli.report import make_report

    seed_dirs = sorted((ROOT / "outputs" / "bench_accumulation_schedule").glob(f"*-seed{args.seeds[0]}"))
    make_report([str(d) for d in seed_dirs], str(outputs))
    print(f"\nplots: {outputs}")


if __name__ == "__main__":
    main()
