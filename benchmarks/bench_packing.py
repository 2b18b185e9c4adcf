"""python benchmarks/bench_packing.py [--repeats 3] [--quick]

Instruction tuning with --packing against padding: recipes/instruction_tuning.py on its offline
BBC instructions (one-word topics and headlines, ~116 tokens per conversation; rows of up to 512), the
same conversations, 8 rows × 2 per update, through the real `accelerate launch`, fp32 on this CPU.
The model is a 4-layer, 256-wide GPT-2 built from a config with SmolLM2's tokenizer and chat
template, so the comparison is about the rows, not about a big model.

Packing fills each row with several conversations up to --max_seq_length, with position ids
restarting per conversation (no cross-talk): fewer, fuller rows, so fewer updates for the same
data. The figure is assistant tokens per second of training (the tokens the loss is over), median
over updates with the first left out, then the median over repeats; the runs alternate.
Results: benchmarks/results/packing.json.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from ft_accum.testing.benchmarking import run_recipe, steady_rate

ROOT = Path(__file__).resolve().parents[1]


def args_for(model_dir: Path, packing: bool, quick: bool) -> list[str]:
    return [
        f"--model_name_or_path={model_dir}",
        f"--packing={packing}",
        "--max_seq_length=512",
        "--per_device_train_batch_size=8",
        "--gradient_accumulation_steps=2",
        f"--max_train_samples={32 if quick else 320}",
        "--max_eval_samples=4",
        "--max_new_tokens=1",
        "--learning_rate=1e-3",
        "--seed=42",
    ]


def build_model_dir(path: Path, quick: bool) -> Path:
    """GPT-2 from a config (4 layers, 256 wide; 1 × 32 with --quick), SmolLM2's tokenizer and chat template."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from ft_accum.data.offline_assets import bundled_smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(bundled_smollm2_dir())
    width, layers = (32, 1) if quick else (256, 4)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_embd=width, n_layer=layers, n_head=4, n_positions=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def measure(repeats: int, quick: bool) -> dict:
    runs = {"padded": [], "packed": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(Path(tmp) / "lm", quick)
        for repeat in range(repeats):
            order = ["padded", "packed"] if repeat % 2 == 0 else ["packed", "padded"]
            for name in order:
                results, records = run_recipe(
                    "instruction_tuning", args_for(model_dir, name == "packed", quick), in_process=quick
                )
                rate = steady_rate([r["tokens_per_second"] for r in records])
                runs[name].append(
                    {
                        "assistant_tokens_per_second": rate,
                        "updates": len(records),
                        "train_runtime": results["train_runtime"],
                    }
                )
                print(f"repeat {repeat + 1}/{repeats} {name}: {rate:.0f} assistant tokens/s", file=sys.stderr)
    median = {n: statistics.median(r["assistant_tokens_per_second"] for r in rs) for n, rs in runs.items()}
    return {
        "setup": {"quick": quick, "repeats": repeats, "device": "cpu", "precision": "fp32"},
        "runs": runs,
        "median_assistant_tokens_per_second": median,
        "packed_over_padded": median["packed"] / median["padded"],
        "train_runtime_ratio": statistics.median(r["train_runtime"] for r in runs["packed"])
        / statistics.median(r["train_runtime"] for r in runs["padded"]),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny model, once, in this process: a smoke test")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "packing.json")
    args = parser.parse_args()
    results = measure(1 if args.quick else args.repeats, args.quick)
    print(json.dumps({k: results[k] for k in ("median_assistant_tokens_per_second", "packed_over_padded")}))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
