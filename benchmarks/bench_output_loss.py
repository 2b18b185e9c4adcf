"""python benchmarks/bench_output_loss.py [--quick]

The chunked output-layer loss (ft_accum/models/output_loss.py) against the two unchunked loss paths, on
the settings of issue 16 (GPT-2 124M and Qwen2.5-0.5B, 1024 tokens, bf16 mixed precision, fused
AdamW, fused attention):

- model:   `model(**batch, labels=...).loss`: transformers' own loss, what a plain PyTorch loop and
           the Transformers Trainer backpropagate;
- logits:  the recipes before issue 16 (`causal_lm_loss_sum` on the full logits; --no_chunked_loss);
- chunked: the recipes now.

1. Memory: the peak of one training step as `ft_accum.planner.memory_planner` traces it (fake tensors; its
   tracker gives the same bytes on real CPU tensors, tests/test_output_loss.py). On a GPU,
   benchmarks/gpu_check.py measures the real peaks.
2. Time, on this CPU: forward + backward of the loss alone (hidden states → summed loss →
   gradients of the hidden states and the output layer), 1024 target tokens, hidden size 256, fp32,
   for vocabularies of 32k, 50k and 152k entries (Llama 2, GPT-2, Qwen2.5); median of 3 after a
   warm-up. Small enough for 2 CPU cores; the ratios, not the seconds, are the point.

Results: benchmarks/results/output_loss.json.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ft_accum.core.loss_normalization import causal_lm_loss_sum
from ft_accum.models.output_loss import linear_cross_entropy_sum, shift_labels
from ft_accum.planner import configs, tracing

ROOT = Path(__file__).resolve().parents[1]
LOSS_PATHS = ("model", "logits", "chunked")


def memory(models, micro_batches, seq_len, layers: int | None = None) -> list[dict]:
    rows = []
    for name in models:
        config = configs.load_model_config(name)
        if layers:
            config.num_hidden_layers = layers
        for checkpointing in (False, True):
            traced = {
                path: tracing.trace_micro_batches(
                    config,
                    micro_batches,
                    task="causal_lm",
                    seq_len=seq_len,
                    precision="bf16-mixed",
                    gradient_checkpointing=checkpointing,
                    loss_path=path,
                )
                for path in LOSS_PATHS
            }
            for micro in micro_batches:
                peaks = {path: max(traced[path][micro], key=lambda e: e.peak).peak / 2**30 for path in LOSS_PATHS}
                rows.append(
                    {"model": name, "micro": micro, "gradient_checkpointing": checkpointing, "peak_gib": peaks}
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def loss_time(vocab: int, tokens: int, hidden_size: int, repeats: int) -> dict:
    torch.manual_seed(0)
    hidden = torch.randn(1, tokens + 1, hidden_size, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens + 1))

    def model_style():  # transformers' ForCausalLMLoss: fp32 logits, shifted labels, mean (here: sum)
        logits = F.linear(hidden, weight).float()
        return F.cross_entropy(logits.flatten(0, 1), shift_labels(labels).flatten(), reduction="sum")

    paths = {
        "model": model_style,
        "logits": lambda: causal_lm_loss_sum(F.linear(hidden, weight), labels)[0],
        "chunked": lambda: linear_cross_entropy_sum(hidden, weight, None, shift_labels(labels))[0],
    }
    seconds = {}
    for name, loss_fn in paths.items():
        times = []
        for repeat in range(repeats + 1):
            hidden.grad = weight.grad = None
            started = time.perf_counter()
            loss_fn().backward()
            if repeat:  # the first is a warm-up
                times.append(time.perf_counter() - started)
        seconds[name] = statistics.median(times)
    return {"vocab": vocab, "tokens": tokens, "hidden_size": hidden_size, "seconds": seconds}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="GPT-2 cut to 1 layer at 256 tokens, one small vocabulary: a smoke test"
    )
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "output_loss.json")
    args = parser.parse_args()
    if args.quick:
        results = {
            "quick": True,
            "memory": memory(["gpt2-124m"], [1, 2], 256, layers=1),
            "time": [loss_time(4096, 256, 64, 1)],
        }
    else:
        results = {
            "quick": False,
            "memory": memory(["gpt2-124m", "qwen2.5-0.5b"], [1, 4, 8], 1024),
            "time": [loss_time(vocab, 1024, 256, 3) for vocab in (32_000, 50_257, 151_936)],
        }
    for row in results["time"]:
        print(json.dumps(row), flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
