"""python benchmarks/bench_torch_compile.py [--repeats 2] [--quick]

What --torch_compile (regional compilation of the repeated blocks) buys: recipes/causal_lm.py with
and without it, through `accelerate launch`, on a 4-layer 256-wide GPT-2 built from a config with
SmolLM2's 49k-entry tokenizer, packed 64-token blocks, 8 × 2 per update, 14 updates, fp32, on this
machine. The figure is target tokens per second over updates 5–14 (the first ones compile), median
over repeats; the first update's rate shows the compile cost.
Results: benchmarks/results/torch_compile.json.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from ft_accum.testing import load_script
from ft_accum.testing.benchmarking import run_recipe

ROOT = Path(__file__).resolve().parents[1]
UPDATES = 14


def measure(repeats: int, quick: bool) -> dict:
    bench = load_script(ROOT / "benchmarks" / "bench_loop_overhead.py")
    runs = {"eager": [], "compiled": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench.build_model_dir("lm", quick, Path(tmp) / "lm")
        for repeat in range(repeats):
            for name in ("eager", "compiled") if repeat % 2 == 0 else ("compiled", "eager"):
                args = [
                    f"--model_name_or_path={model_dir}", "--packing", "--block_size=64",
                    "--per_device_train_batch_size=8", "--gradient_accumulation_steps=2",
                    f"--max_train_steps={6 if quick else UPDATES}", "--max_train_samples=400", "--max_eval_samples=2",
                    "--use_lora=False", "--learning_rate=1e-3", "--seed=42", f"--torch_compile={name == 'compiled'}",
                ]  # fmt: skip
                _, records = run_recipe("causal_lm", args, in_process=quick)
                rates = [r["tokens_per_second"] for r in records]
                steady = statistics.median(rates[4:])
                runs[name].append({"tokens_per_second": steady, "first_update_tokens_per_second": rates[0]})
                print(f"repeat {repeat + 1}/{repeats} {name}: {steady:.0f} tokens/s (first update {rates[0]:.0f})",
                      file=sys.stderr)  # fmt: skip
    median = {n: statistics.median(r["tokens_per_second"] for r in rs) for n, rs in runs.items()}
    return {
        "setup": {"quick": quick, "repeats": repeats, "updates": UPDATES, "device": "cpu", "precision": "fp32"},
        "runs": runs,
        "median_tokens_per_second": median,
        "compiled_over_eager": median["compiled"] / median["eager"],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a tiny model, once, in this process: a smoke test")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "torch_compile.json")
    args = parser.parse_args()
    results = measure(1 if args.quick else args.repeats, args.quick)
    print(json.dumps({k: results[k] for k in ("median_tokens_per_second", "compiled_over_eager")}))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
