"""python benchmarks/bench_low_memory.py [--quick]

What the low-memory full fine-tune trades (issue 17), on this machine. Needs the [lowmem] extra.

1. Quality. recipes/causal_lm.py fully fine-tunes the bundled, pretrained SmolLM2-135M on BBC News
   text (packed 64-token blocks, 16 per update, 24 updates, LR 5e-5 with 4 warmup updates, fp32
   compute on CPU), four times with the same seed and data:
     fp32 weights + AdamW (the default), fp32 + 8-bit AdamW, bf16 weights + AdamW,
     bf16 weights + 8-bit AdamW (`--model_dtype bfloat16 --optim adamw_8bit`, what fits
     Qwen2.5-1.5B on a 12 GB card), and the same with stochastic rounding of the bf16 weights
     (`--optim adamw_torch_8bit`, torchao).
   It reports each run's training-loss curve, its gap to the default's, and the eval perplexity.
2. Bytes. The weights, gradients and optimizer state of SmolLM2-135M after one real step in each
   configuration, summed over the real tensors, beside the planner's prediction.

--quick: a tiny Llama, 3 updates, in this process, without the torchao configuration (torchao
compiles its step per parameter shape: ~35 s on a cold cache; tests/test_low_memory.py runs that
path through the recipe).

Results: benchmarks/results/low_memory.json, and the curves in benchmarks/results/low_memory_loss.png
(when matplotlib, the [report] extra, is installed).
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from ft_accum.core.batch_arithmetic import BatchPlan
from ft_accum.planner import tracing
from ft_accum.testing.benchmarking import machine_info, optimizer_state_bytes, run_recipe
from ft_accum.training.run_setup import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
CONFIGURATIONS = {
    "fp32 + AdamW": ("float32", "adamw_torch"),
    "fp32 + 8-bit AdamW": ("float32", "adamw_8bit"),
    "bf16 + AdamW": ("bfloat16", "adamw_torch"),
    "bf16 + 8-bit AdamW": ("bfloat16", "adamw_8bit"),
    "bf16 + 8-bit AdamW, stochastic rounding": ("bfloat16", "adamw_torch_8bit"),
}
UPDATES = 24


def train(model_dir: str | None, dtype: str, optim: str, quick: bool, data: list[str]) -> tuple[dict, list[dict]]:
    args = [
        "--use_lora=false", "--packing", "--block_size=64", "--per_device_train_batch_size=8",
        "--effective_batch_size=16", "--learning_rate=5e-5", "--lr_scaling=none", "--num_warmup_steps=4",
        f"--max_train_steps={3 if quick else UPDATES}", f"--max_train_samples={40 if quick else 400}",
        f"--max_eval_samples={4 if quick else 100}", "--seed=42", f"--model_dtype={dtype}", f"--optim={optim}",
    ]  # fmt: skip
    if model_dir:
        args.append(f"--model_name_or_path={model_dir}")
    return run_recipe("causal_lm", [*args, *data], in_process=quick)


def state_bytes(model_dir: str | None, dtype: str, optim: str) -> dict:
    """Weights, gradients and optimizer state after one step, from the real tensors (GiB)."""
    from transformers import AutoModelForCausalLM

    from ft_accum.data.offline_assets import bundled_smollm2_dir

    model = AutoModelForCausalLM.from_pretrained(model_dir or bundled_smollm2_dir())
    model = model.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    settings = argparse.Namespace(
        optim=optim, weight_decay=0.0, model_dtype=dtype, scaled_learning_rate=lambda effective_batch_size: 1e-5
    )
    optimizer = build_optimizer(model, settings, plan=BatchPlan(1, 1, 1), no_decay=())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors) / 2**30

    measured = {
        "weights": nbytes(model.parameters()),
        "gradients": nbytes(p.grad for p in model.parameters()),
        "optimizer_state": optimizer_state_bytes(optimizer) / 2**30,
    }
    # The planner's count: 8-bit blocks (the same for bitsandbytes and torchao), or two moments in the weights' dtype.
    low_bit = optim in ("adamw_8bit", "adamw_torch_8bit")
    predicted_state = sum(
        tracing.low_bit_state_bytes(p.numel(), "adamw_8bit") if low_bit else 2 * p.nbytes for p in model.parameters()
    )
    return measured | {"predicted_optimizer_state": predicted_state / 2**30}


def plot(curves: dict[str, list[float]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name)
    ax.set_xlabel("optimizer update")
    ax.set_ylabel("training loss (per target token)")
    ax.set_title("SmolLM2-135M full fine-tune, same seed and data")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def measure(model_dir: str | None, quick: bool, data: list[str], names: list[str], runs: dict) -> dict:
    for name in names:
        dtype, optim = CONFIGURATIONS[name]
        bytes_gib = state_bytes(model_dir, dtype, optim)
        results, records = train(model_dir, dtype, optim, quick, data)
        runs[name] = {
            "losses": [r["loss"] for r in records],
            "eval_perplexity": results["eval_perplexity"],
            "initial_eval_perplexity": results["initial_eval_perplexity"],
            "bytes_gib": bytes_gib,
        }
        print(f"{name}: final loss {records[-1]['loss']:.4f}, eval perplexity {results['eval_perplexity']:.2f}",
              file=sys.stderr)  # fmt: skip
    reference = runs["fp32 + AdamW"]["losses"]
    for run in runs.values():
        gaps = [a - b for a, b in zip(run["losses"], reference)]
        tail = gaps[len(gaps) // 2 :]
        run["loss_gap_to_fp32_adamw"] = {
            "last_half_mean": statistics.mean(tail),
            "last_half_max_abs": max(map(abs, tail)),
            "final": gaps[-1],
        }
    return {
        "setup": {"quick": quick, "updates": 3 if quick else UPDATES, "model": model_dir or "SmolLM2-135M (bundled)"},
        "machine": machine_info(),
        "runs": runs,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 3 updates, in this process: a smoke test")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "low_memory.json")
    parser.add_argument("--configurations", nargs="*", choices=list(CONFIGURATIONS), help="run only these")
    parser.add_argument("--plot_only", action="store_true", help="redraw the plot from --output, run nothing")
    args = parser.parse_args()
    if args.plot_only:
        runs = json.loads(args.output.read_text())["runs"]
        plot(
            {name: run["losses"] for name, run in runs.items()}, args.output.with_name(args.output.stem + "_loss.png")
        )
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = None, []
        if args.quick:  # a tiny model with a word tokenizer, on text made of its words
            from ft_accum.testing import make_documents, make_tiny_lm, write_jsonl

            model_dir = str(make_tiny_lm("llama", Path(tmp) / "lm", width=64))
            for split, seed in (("train", 1), ("validation", 2)):
                data.append(f"--{split}_file={write_jsonl(Path(tmp) / f'{split}.jsonl', make_documents(40, seed))}")
        names = [n for n in CONFIGURATIONS if not args.configurations or n in args.configurations]
        if args.quick and not args.configurations:
            names = [n for n in names if CONFIGURATIONS[n][1] != "adamw_torch_8bit"]
        # --configurations reruns some runs and keeps the others' last figures from --output.
        previous = json.loads(args.output.read_text())["runs"] if args.configurations and args.output.is_file() else {}
        results = measure(model_dir, args.quick, data, names, previous)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    curves = {name: run["losses"] for name, run in results["runs"].items()}
    plotted = plot(curves, args.output.with_name(args.output.stem + "_loss.png"))
    for name, run in results["runs"].items():
        gap, gib = run["loss_gap_to_fp32_adamw"], run["bytes_gib"]
        print(f"{name:<20} eval ppl {run['eval_perplexity']:7.2f}  loss gap (last half, mean) {gap['last_half_mean']:+.4f}  "
              f"weights+grads+state {gib['weights'] + gib['gradients'] + gib['optimizer_state']:.3f} GiB")  # fmt: skip
    if plotted:
        print(f"plot: {args.output.with_name(args.output.stem + '_loss.png')}")


if __name__ == "__main__":
    main()
