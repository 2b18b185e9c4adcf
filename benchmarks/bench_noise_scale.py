"""python benchmarks/bench_noise_scale.py [--updates 10] [--repeats 3]

Cost of --measure_noise_scale: the text-classification recipe on its offline default (MiniLM,
BBC News, max_seq_length 128, micro-batch 8 × accumulation 4, fp32, one process), run through
the real `accelerate launch` with the measurement off and on, interleaved. Each run's
throughput is its median per-update samples/s from metrics.jsonl, warm-up update excluded.
Results go to benchmarks/results/noise_scale.json and a line on stdout.
"""

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from ft_accum.testing import launch_command, read_metrics
from ft_accum.testing.benchmarking import steady_rate, summarize

ROOT = Path(__file__).resolve().parents[1]


def run(measure: bool, updates: int, out: Path) -> dict:
    command, env = launch_command(
        "text_classification",
        [
            "--per_device_train_batch_size=8",
            "--gradient_accumulation_steps=4",
            f"--max_train_steps={updates}",
            f"--max_train_samples={32 * updates}",
            "--max_eval_samples=32",
            "--report_to=none",
            f"--output_dir={out}",
            *(["--measure_noise_scale"] if measure else []),
        ],
    )
    subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT, env=env)
    records = read_metrics(out)
    return {
        "samples_per_second": steady_rate([r["samples_per_second"] for r in records]),
        "noise_scale": records[-1].get("noise_scale"),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = {"plain": [], "measured": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in ("plain", "measured"):
                runs[name].append(run(name == "measured", args.updates, Path(tmp) / f"{name}-{repeat}"))
    summary = summarize(runs, "samples_per_second")
    result = {"updates": args.updates, "repeats": args.repeats, "runs": runs, **summary}
    (ROOT / "benchmarks" / "results" / "noise_scale.json").write_text(json.dumps(result, indent=2))
    ratio = summary["ratio_to_plain"]["measured"]
    print(
        f"--measure_noise_scale throughput: {ratio:.3f}× the run without it (overhead {100 * (1 - ratio):+.1f}%); "
        f"per-repeat ratios {[round(r, 3) for r in summary['per_repeat_ratios']['measured']]}"
    )


if __name__ == "__main__":
    main()
