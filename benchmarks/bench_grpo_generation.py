"""python benchmarks/bench_grpo_generation.py [--quick] [--output benchmarks/results/grpo_generation.json]

GRPO's generation round, prompt by prompt (`--generation_prompts_per_call 1`: the recipe before
2026-12-06) against 8 prompts a call (the default), everything else the same:
recipes/grpo.py on the bundled SmolLM2-135M-Instruct, LoRA r 16 on every linear layer, fp32 on
this machine's CPU, 8 prompts × G = 4 completions of at most 64 tokens a round, one update of
32 completions (8 × 4) a round, 3 rounds. The prompts are the offline arithmetic task's, asking
for the working ("... Show your working, then give the number."), so completions run long, as
reasoning ones do.

Reported for each setting: each round's seconds in `generate_round` (timed around the call, the
rest of the update beside it), the completion tokens it sampled per second, and the completions'
mean length (the two settings draw different completions, so their lengths differ a little). The
figure to read is the generation's seconds per round, the first round (warm-up) left out.
--quick: a 2-layer, 32-wide Llama with SmolLM2's tokenizer, 1 round of 8-token completions (tests
the script; its figures say nothing).
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ft_accum.data.offline_assets import bundled_smollm2_dir  # noqa: E402
from ft_accum.data.rewards import arithmetic_task  # noqa: E402
from ft_accum.testing import make_tiny_chat_lm, write_jsonl  # noqa: E402
from ft_accum.testing.benchmarking import machine_info, run_recipe, timed_generation_rounds  # noqa: E402

PROMPTS_PER_CALL = (1, 8)


def prompt_files(path: Path) -> dict[str, Path]:
    """The arithmetic task, each question asking for the working."""
    splits = {"train": arithmetic_task(64, seed=1).to_list(), "validation": arithmetic_task(8, seed=2).to_list()}
    for rows in splits.values():
        for row in rows:
            question = row["prompt"][0]["content"].replace("Answer with the number only.", "")
            row["prompt"][0]["content"] = question + "Show your working, then give the number."
    return {split: write_jsonl(path / f"{split}.jsonl", rows) for split, rows in splits.items()}


def run(model_dir: Path, files: dict, prompts_per_call: int, quick: bool) -> dict:
    rounds = 1 if quick else 3
    # recipes/configs/grpo.yaml's LoRA and LR spelled out: run_recipe passes --config=none
    flags = {
        "model_name_or_path": model_dir, "train_file": files["train"], "validation_file": files["validation"],
        "num_generations": 4, "max_completion_length": 8 if quick else 64, "temperature": 1.0,
        "per_device_train_batch_size": 8, "effective_batch_size": 32, "generation_batch_size": 32,
        "generation_prompts_per_call": prompts_per_call, "max_train_steps": rounds, "max_eval_samples": 1,
        "checkpointing_steps": 1000, "seed": 42, "use_lora": True, "lora_r": 16, "lora_alpha": 32,
        "lora_target_modules": "all-linear", "learning_rate": 5e-5, "lr_scheduler_type": "constant",
    }  # fmt: skip
    with timed_generation_rounds() as record:
        results, metrics = run_recipe("grpo", [f"--{k}={v}" for k, v in flags.items()], in_process=True)
    steady = record[1:] or record  # the first round warms up
    generation = statistics.median(r["seconds"] for r in steady)
    return {
        "rounds": record,
        "train_runtime_seconds": results["train_runtime"],
        "generation_seconds_per_round": generation,
        "rest_of_update_seconds": (results["train_runtime"] - sum(r["seconds"] for r in record)) / len(record),
        "completion_tokens_per_second": statistics.median(r["completion_tokens"] / r["seconds"] for r in steady),
        "mean_completion_length": statistics.mean(m["completion_length"] for m in metrics),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, one round: tests the script")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "grpo_generation.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        files = prompt_files(work)
        model_dir = make_tiny_chat_lm(work / "tiny") if args.quick else bundled_smollm2_dir()
        runs = {f"{n} a call": run(model_dir, files, n, args.quick) for n in PROMPTS_PER_CALL}
    first, last = (runs[f"{n} a call"] for n in PROMPTS_PER_CALL)
    summary = {
        "quick": args.quick,
        "machine": machine_info(),
        "runs": runs,
        "generation_speedup": first["generation_seconds_per_round"] / last["generation_seconds_per_round"],
        "update_speedup": first["train_runtime_seconds"] / last["train_runtime_seconds"],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=2))
    print("| prompts a call | generation s/round | rest of update s | completion tokens/s | mean length |")
    print("|---|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['generation_seconds_per_round']:.1f} | {r['rest_of_update_seconds']:.1f} | "
              f"{r['completion_tokens_per_second']:.0f} | {r['mean_completion_length']:.1f} |")  # fmt: skip
    print(f"generation {summary['generation_speedup']:.2f}× faster, whole run {summary['update_speedup']:.2f}×")


if __name__ == "__main__":
    main()
